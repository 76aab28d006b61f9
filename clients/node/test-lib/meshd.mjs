// The meshd servers of a test file: startMeshd() spawns `meshd --local-agents N` on
// 127.0.0.1:0, reads its port from --port-file and resolves once it is ready; stop()
// (or stopAll(), in the file's after hook) stops it by its pid, within a bounded wait.
// Only the meshd processes started here are ever signalled (their agents go with them).
//
// MESHD_BIN_DIR (set by ctest) locates meshd; else <source>/build/bin, <source> being
// MESHD_SOURCE_DIR or this checkout.
import { spawn } from 'node:child_process';
import { closeSync, existsSync, mkdtempSync, openSync, readFileSync, rmSync } from 'node:fs';
import { createRequire } from 'node:module';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { connect } from '../meshd.mjs';

const here = path.dirname(fileURLToPath(import.meta.url));
export const sourceDir = process.env.MESHD_SOURCE_DIR ?? path.resolve(here, '..', '..', '..');
export const binDir = process.env.MESHD_BIN_DIR ?? path.join(sourceDir, 'build', 'bin');
export const meshdBin = path.join(binDir, 'meshd');

const TERM_WAIT_MS = 15000; // SIGTERM, then SIGKILL past this
const KILL_WAIT_MS = 5000; // and after SIGKILL, this at most

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const started = new Set(); // every meshd spawned here (and its handle) not yet stopped

const running = (proc) => proc.exitCode === null && proc.signalCode === null;

// Whether proc exited within ms.
function exited(proc, ms) {
  if (!running(proc)) return Promise.resolve(true);
  return new Promise((resolve) => {
    const done = (v) => { clearTimeout(timer); proc.off('exit', onExit); resolve(v); };
    const onExit = () => done(true);
    const timer = setTimeout(() => done(!running(proc)), ms);
    proc.once('exit', onExit);
  });
}

// Resolves once meshd.v1.TensorService is SERVING on addr (grpc.health.v1), else throws
// the last status when the deadline passes.
async function serving(addr, deadline) {
  const require = createRequire(import.meta.url);
  const grpc = require('@grpc/grpc-js');
  const healthCheck = require('grpc-health-check');
  const Health = grpc.makeGenericClientConstructor(healthCheck.service, 'Health');
  const client = new Health(addr, grpc.credentials.createInsecure(), { 'grpc.enable_http_proxy': 0 });
  try {
    return await new Promise((resolve) => {
      client.check({ service: 'meshd.v1.TensorService' }, { deadline: Math.min(deadline, Date.now() + 2000) },
        (err, reply) => resolve(err ? `${err.code}: ${err.details}` : reply.status));
    });
  } finally {
    client.close();
  }
}

// Starts meshd and resolves once it is ready:
//   ready 'agents' (default): a session-less ListAgents (connect with connectOpts) lists
//     at least `agents` healthy agents; with agents 0, once the server answers at all.
//   ready 'serving': the health service says meshd.v1.TensorService is SERVING.
// name: its log (<work>/<name>.log, stdout and stderr) and port file (<work>/<name>.port);
// work: the directory for them, else a new temporary one (removed by stop()). env: extra
// variables (the MESHD_* and proxy ones of this process are not passed on). A meshd that
// exits or is not ready within timeoutMs is stopped and the call throws, with its log's end.
// Returns { name, proc, pid, port, addr, log, logText(), logTail(lines), stop() }.
export async function startMeshd({ name = 'meshd', work, agents = 2, args = [], env = {}, connectOpts = {},
  ready = 'agents', timeoutMs = 30000 } = {}) {
  if (!existsSync(meshdBin)) throw new Error(`meshd not built: ${meshdBin}`);
  if (!['agents', 'serving'].includes(ready)) throw new Error(`startMeshd: ready must be 'agents' or 'serving'`);
  const ownWork = !work;
  const dir = work ?? mkdtempSync(path.join(tmpdir(), `meshd-node-${name}-`));
  const log = path.join(dir, `${name}.log`);
  const portFile = path.join(dir, `${name}.port`);
  const childEnv = Object.fromEntries(Object.entries(process.env).filter(
    ([k]) => !k.startsWith('MESHD_') && !/^(https?|grpc|all)_proxy$/i.test(k)));
  Object.assign(childEnv, env);
  const fd = openSync(log, 'w');
  let proc;
  try {
    proc = spawn(meshdBin, ['--listen', '127.0.0.1:0', '--port-file', portFile, '--local-agents', String(agents),
      ...args], { env: childEnv, stdio: ['ignore', fd, fd] });
  } finally {
    closeSync(fd); // the child has its own
  }
  const logText = () => { try { return readFileSync(log, 'utf8'); } catch { return ''; } };
  let stopping = null;
  const m = {
    name, proc, pid: proc.pid, port: undefined, addr: undefined, log, logText,
    logTail: (lines = 40) => logText().split('\n').slice(-lines).join('\n'),
    // SIGTERM to this meshd's pid, SIGKILL past TERM_WAIT_MS; throws if it still has not
    // exited KILL_WAIT_MS after that. Then removes the temporary directory it made.
    stop: () => {
      stopping ??= (async () => {
        try {
          if (running(proc)) {
            proc.kill('SIGTERM');
            if (!await exited(proc, TERM_WAIT_MS)) {
              proc.kill('SIGKILL');
              if (!await exited(proc, KILL_WAIT_MS)) {
                throw new Error(`${name} (pid ${proc.pid}) did not exit within ${KILL_WAIT_MS} ms of SIGKILL`);
              }
            }
          }
        } finally {
          started.delete(m);
        }
        if (ownWork) rmSync(dir, { recursive: true, force: true });
      })();
      return stopping;
    },
  };
  started.add(m);
  proc.once('error', () => {}); // a spawn failure shows as the exit below
  const deadline = Date.now() + timeoutMs;
  let last = '';
  try {
    for (;;) {
      if (!running(proc)) {
        throw new Error(`${name} exited (${proc.exitCode ?? proc.signalCode}) before it was ready\n${m.logTail()}`);
      }
      if (Date.now() > deadline) throw new Error(`${name} not ready within ${timeoutMs} ms: ${last}\n${m.logTail()}`);
      if (!m.addr && existsSync(portFile)) {
        const text = readFileSync(portFile, 'utf8');
        if (/^\d+\n$/.test(text)) {
          m.port = Number(text.trim());
          m.addr = `127.0.0.1:${m.port}`;
        }
      }
      if (!m.addr) last = `no port in ${portFile}`;
      else if (ready === 'serving') {
        last = await serving(m.addr, deadline);
        if (last === 'SERVING') return m;
      } else {
        try {
          const s = await connect(m.addr, { ...connectOpts, clientName: 'node-wait', timeoutMs: 2000 });
          try {
            const { agents: list } = await s.agents();
            if (list.filter((a) => a.healthy).length >= agents) return m;
            last = `${list.filter((a) => a.healthy).length} of ${agents} agents healthy: ${JSON.stringify(list)}`;
          } finally {
            await s.close();
          }
        } catch (e) {
          last = String(e.message ?? e);
        }
      }
      await sleep(m.addr ? 100 : 50);
    }
  } catch (e) {
    await m.stop().catch(() => {});
    throw e;
  }
}

// Stops every meshd startMeshd started in this process and has not stopped yet, those
// still starting too (for a file's after hook); throws the first failure after trying all.
export async function stopAll() {
  const rs = await Promise.allSettled([...started].map((m) => m.stop()));
  const failed = rs.find((r) => r.status === 'rejected');
  if (failed) throw failed.reason;
}

// tests/support/range_http_server.py (the integration tests' HTTP server: ranges,
// validators, misbehaving and versioned resources; its docstring lists the paths):
// resolves to { base: 'http://127.0.0.1:PORT', stop() }. It serves until its stdin
// closes, which stop() does (then kills it by its pid if it has not exited within 5 s);
// a test that dies leaves no server behind.
export async function startRangeServer() {
  const script = path.join(sourceDir, 'tests', 'support', 'range_http_server.py');
  const python = existsSync('/usr/bin/python3') ? '/usr/bin/python3' : 'python3';
  const proc = spawn(python, [script], { stdio: ['pipe', 'pipe', 'inherit'] });
  const stop = async () => {
    proc.stdin.end();
    if (!await exited(proc, 5000)) proc.kill('SIGKILL');
  };
  const port = await new Promise((resolve) => {
    let text = '';
    const timer = setTimeout(() => resolve(0), 10000);
    proc.stdout.on('data', (d) => {
      text += d;
      if (text.includes('\n')) { clearTimeout(timer); resolve(Number(text.split('\n')[0])); }
    });
    proc.once('exit', () => { clearTimeout(timer); resolve(0); });
  });
  if (!(port > 0)) {
    await stop();
    throw new Error(`${script} did not print its port`);
  }
  return { base: `http://127.0.0.1:${port}`, stop };
}
