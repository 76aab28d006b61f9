// meshd's grpc.health.v1.Health from Node: @grpc/grpc-js with the client definition
// exported by grpc-health-check (its `service`), as any Node user would do it.
//
// MESHD_BIN_DIR (set by ctest) locates meshd; else <source>/build/bin.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { mkdtempSync, readFileSync, existsSync, openSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { createRequire } from 'node:module';

const require = createRequire(import.meta.url);
const grpc = require('@grpc/grpc-js');
const healthCheck = require('grpc-health-check');

const here = path.dirname(fileURLToPath(import.meta.url));
const sourceDir = process.env.MESHD_SOURCE_DIR ?? path.resolve(here, '..', '..', '..');
const binDir = process.env.MESHD_BIN_DIR ?? path.join(sourceDir, 'build', 'bin');
const meshdBin = path.join(binDir, 'meshd');

const HealthClient = grpc.makeGenericClientConstructor(healthCheck.service, 'Health');
const channelOptions = { 'grpc.enable_http_proxy': 0 };

let work;
let meshd;
let port;
let client;

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

function logTail() {
  try {
    return readFileSync(path.join(work, 'meshd.log'), 'utf8').split('\n').slice(-40).join('\n');
  } catch {
    return '(no log)';
  }
}

async function readPortFile(file, timeoutMs) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    if (existsSync(file)) {
      const text = readFileSync(file, 'utf8');
      if (/^\d+\n$/.test(text)) return Number(text.trim());
    }
    if (meshd.exitCode !== null || meshd.signalCode !== null) {
      throw new Error(`meshd exited (${meshd.exitCode ?? meshd.signalCode}) before writing its port\n${logTail()}`);
    }
    if (Date.now() > deadline) throw new Error(`no port in ${file} within ${timeoutMs} ms\n${logTail()}`);
    await sleep(50);
  }
}

function check(service, deadlineMs = 5000) {
  return new Promise((resolve, reject) => {
    client.check({ service }, { deadline: Date.now() + deadlineMs }, (err, reply) => {
      if (err) reject(err);
      else resolve(reply.status);
    });
  });
}

async function waitServing(timeoutMs) {
  const deadline = Date.now() + timeoutMs;
  let last;
  for (;;) {
    try {
      last = await check('', 2000);
      if (last === 'SERVING') return;
    } catch (err) {
      last = `${err.code}: ${err.details}`;
    }
    if (Date.now() > deadline) throw new Error(`"" not SERVING within ${timeoutMs} ms; last ${last}\n${logTail()}`);
    await sleep(100);
  }
}

before(async () => {
  assert.ok(existsSync(meshdBin), `meshd not built: ${meshdBin}`);
  work = mkdtempSync(path.join(tmpdir(), 'meshd-node-'));
  const env = Object.fromEntries(Object.entries(process.env).filter(
    ([k]) => !k.startsWith('MESHD_') && !/^(https?|grpc|all)_proxy$/i.test(k)));
  const log = openSync(path.join(work, 'meshd.log'), 'w');
  const portFile = path.join(work, 'meshd.port');
  meshd = spawn(meshdBin, ['--listen', '127.0.0.1:0', '--port-file', portFile],
    { env, stdio: ['ignore', log, log] });
  port = await readPortFile(portFile, 20000);
  client = new HealthClient(`127.0.0.1:${port}`, grpc.credentials.createInsecure(), channelOptions);
  await waitServing(20000);
});

after(async () => {
  client?.close();
  if (meshd && meshd.exitCode === null && meshd.signalCode === null) {
    const exited = new Promise((resolve) => meshd.once('exit', resolve));
    meshd.kill('SIGTERM');
    const timer = setTimeout(() => meshd.kill('SIGKILL'), 15000);
    await exited;
    clearTimeout(timer);
  }
  if (work) rmSync(work, { recursive: true, force: true });
});

test('Check "" is SERVING', async () => {
  assert.equal(await check(''), 'SERVING');
});

test('Check of an unknown service is NOT_FOUND', async () => {
  await assert.rejects(check('no.such.Service'), (err) => {
    assert.equal(err.code, grpc.status.NOT_FOUND, `got ${err.code}: ${err.details}`);
    return true;
  });
});

test('Watch "" delivers SERVING at once', async () => {
  const call = client.watch({ service: '' });
  try {
    const first = await new Promise((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error('no Watch message within 10 s')), 10000);
      call.once('data', (msg) => { clearTimeout(timer); resolve(msg.status); });
      call.once('error', (err) => { clearTimeout(timer); reject(err); });
      call.once('end', () => { clearTimeout(timer); reject(new Error('Watch ended before a message')); });
    });
    assert.equal(first, 'SERVING');
  } finally {
    call.on('error', () => {}); // the cancel below surfaces as CANCELLED
    call.cancel();
  }
});

test('Watch of an unknown service delivers SERVICE_UNKNOWN', async () => {
  const call = client.watch({ service: 'no.such.Service' });
  try {
    const first = await new Promise((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error('no Watch message within 10 s')), 10000);
      call.once('data', (msg) => { clearTimeout(timer); resolve(msg.status); });
      call.once('error', (err) => { clearTimeout(timer); reject(err); });
    });
    assert.equal(first, 'SERVICE_UNKNOWN');
  } finally {
    call.on('error', () => {});
    call.cancel();
  }
});
