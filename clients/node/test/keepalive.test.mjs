// The Node client's background KeepAlive and deadlines (issue 12, points 4 and 7) against a
// real `meshd --local-agents 2 --session-ttl 2 --agent-timeout 60`: sessions expire after
// 2 idle seconds, and a stopped (SIGSTOP) agent wedges its rank without being declared
// lost. Every test SIGCONTs what it stopped, in a finally.
//
// MESHD_BIN_DIR (set by ctest) locates meshd; else <source>/build/bin.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { agentPid, stopAgent } from '../test-lib/agents.mjs';
import { startMeshd, stopAll } from '../test-lib/meshd.mjs';
import { connect, keepAlivePeriodMs, MeshdError } from '../meshd.mjs';

let meshd;
let addr;

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const logText = () => meshd.logText();

async function listed(sessionId) {
  const obs = await connect(addr, { clientName: 'node-observer' });
  try {
    const { sessions } = await obs.unary('ListSessions', {});
    return sessions.some((r) => r.session_id === sessionId);
  } finally {
    await obs.close();
  }
}

before(async () => {
  // ready once both agents are healthy (ListAgents through a session-less call)
  meshd = await startMeshd({ name: 'keepalive', args: ['--session-ttl', '2', '--agent-timeout', '60'] });
  addr = meshd.addr;
});

after(() => stopAll()); // only the meshd this file started (its own agents go with it)

test('the keepalive period is a third of the lease, at least 250 ms', () => {
  // a 1 s floor made a 1 s lease's period the lease itself: an idle ttl-1 session expired
  assert.equal(keepAlivePeriodMs(1), 333);
  assert.equal(keepAlivePeriodMs(2), 666);
  assert.equal(keepAlivePeriodMs(0.5), 250);
  assert.equal(keepAlivePeriodMs(300), 100000);
  assert.equal(keepAlivePeriodMs(0), 100000);
});

test('an idle session outlives its 2 s lease; close stops the keepalive', async () => {
  const s = await connect(addr, { clientName: 'node-idle' });
  // The control: a session whose keepalive is stopped expires in the same 7 s.
  const bare = await connect(addr, { clientName: 'node-bare' });
  // An idle connection with no session traffic at all (issue 12, idle clients keep their
  // connection): a session with the default lease, its keepalive stopped.
  const quiet = await connect(addr, { clientName: 'node-quiet', ttlSeconds: 300 });
  // The shortest lease there is (1 s): kept too.
  const short = await connect(addr, { clientName: 'node-ttl1', ttlSeconds: 1 });
  let sent = 0;
  const orig = s.client.KeepAlive.bind(s.client);
  s.client.KeepAlive = (...a) => { sent += 1; return orig(...a); };
  try {
    assert.equal(s.ttlSeconds, 2);
    bare.stopKeepAlive();
    quiet.stopKeepAlive();
    const mesh = await s.createMesh({ gpu: 2 });
    const meshBare = await bare.createMesh({ gpu: 2 });
    const meshQuiet = await quiet.createMesh({ gpu: 2 });
    const meshShort = await short.createMesh({ gpu: 2 });
    assert.equal(short.ttlSeconds, 1);
    await sleep(7000); // no call of ours: more than three leases
    assert.ok(sent >= 3, `only ${sent} KeepAlive(s) in 7 s`);
    const x = await s.factory({ kind: 'full', mesh: mesh.ref, shape: [3], value: 2 });
    await s.sync();
    assert.deepEqual([...await s.fetch(x, { gpu: 1 })], [2, 2, 2]);
    await assert.rejects(bare.factory({ kind: 'ones', mesh: meshBare.ref, shape: [1] }), (err) => {
      assert.equal(err.kind, 'NO_SESSION', err.message);
      return true;
    });
    const q = await quiet.factory({ kind: 'ones', mesh: meshQuiet.ref, shape: [2] });
    assert.deepEqual([...await quiet.fetch(q, { gpu: 0 })], [1, 1]);
    const r = await short.factory({ kind: 'ones', mesh: meshShort.ref, shape: [2] });
    assert.deepEqual([...await short.fetch(r, { gpu: 1 })], [1, 1]);
  } finally {
    bare.closed = true; // expired on the server already
    bare.client.close();
    await short.close().catch(() => {}); // (expired: the assertion above said so)
    await quiet.close();
    await s.close();
  }
  const after = sent;
  assert.equal(await listed(s.id), false, 'the closed session is still listed');
  await sleep(2500);
  assert.equal(sent, after, 'KeepAlive sent after close');
  const lines = logText().split('\n').filter((l) => l.includes(s.id));
  assert.ok(lines.some((l) => l.includes('closed')), lines.join('\n'));
  assert.ok(!lines.some((l) => l.includes('expired')), lines.join('\n'));
});

test('pipelined commands the server holds back past their deadline throw DEADLINE_EXCEEDED', async () => {
  // A wedged rank fills the session's flow-control bound (--session-max-queued, 1024):
  // the server reads no more of the Submit stream, so the commands past it get no
  // answer. Each rejects at its deadline: the session's timeoutMs (2 s) or its own.
  const s = await connect(addr, { clientName: 'node-pipe-deadline', timeoutMs: 2000 });
  const pid = agentPid(meshd.pid, 1);
  try {
    const mesh = await s.createMesh({ gpu: 2 });
    const x = await s.factory({ kind: 'ones', mesh: mesh.ref, shape: [4] });
    await s.sync();
    await s.setPipeline({ maxBatch: 256 });
    await stopAgent(pid);
    const t0 = Date.now();
    const settle = (p) => p.then(() => ({ ok: true, at: Date.now() - t0 }),
      (err) => ({ err, at: Date.now() - t0 }));
    const calls = [];
    for (let i = 0; i < 1300; i++) calls.push(settle(s.call('add', [x, 1])));
    const own = settle(s.call('add', [x, 2], {}, { timeoutMs: 700 }));
    const ownR = await own;
    assert.equal(ownR.err?.kind, 'DEADLINE_EXCEEDED', String(ownR.err));
    assert.match(ownR.err.message, /within 700 ms/);
    assert.ok(ownR.at >= 600 && ownR.at < 1900, `a 700 ms deadline took ${ownR.at} ms`);
    const rs = await Promise.all(calls);
    const late = rs.filter((r) => r.err);
    assert.ok(rs.filter((r) => r.ok).length >= 1000, 'the bound should have let ~1024 in');
    assert.ok(late.length >= 200, `only ${late.length} of 1300 were held back`);
    for (const r of late) {
      assert.equal(r.err.kind, 'DEADLINE_EXCEEDED', String(r.err));
      assert.ok(r.at >= 1800 && r.at < 6000, `a 2 s deadline took ${r.at} ms`);
    }
    assert.match(late[0].err.message, /within 2000 ms/);
    process.kill(pid, 'SIGCONT');
    await s.sync({ timeoutMs: 30000 }); // the late ones ran after all, and the session works
    const z = await s.call('add', [x, 5]);
    assert.deepEqual([...await s.fetch(z, { gpu: 1 }, { timeoutMs: 30000 })], [6, 6, 6, 6]);
  } finally {
    process.kill(pid, 'SIGCONT');
    await s.close();
  }
});

test('sync and fetch with a deadline on a wedged agent throw DEADLINE_EXCEEDED', async () => {
  const s = await connect(addr, { clientName: 'node-deadline' });
  const pid = agentPid(meshd.pid, 1);
  try {
    const mesh = await s.createMesh({ gpu: 2 });
    const x = await s.factory({ kind: 'ones', mesh: mesh.ref, shape: [4] });
    await s.sync();
    await stopAgent(pid);
    const y = await s.call('add', [x, 1]); // accepted at once; rank 1 cannot run it
    let t0 = Date.now();
    await assert.rejects(s.sync({ timeoutMs: 1000 }), (err) => {
      assert.ok(err instanceof MeshdError, String(err));
      assert.equal(err.kind, 'DEADLINE_EXCEEDED', err.message);
      return true;
    });
    let took = Date.now() - t0;
    assert.ok(took >= 900 && took < 3000, `a 1 s deadline took ${took} ms`);
    t0 = Date.now();
    await assert.rejects(s.fetch(y, { gpu: 1 }, { timeoutMs: 1000 }), (err) => {
      assert.equal(err.kind, 'DEADLINE_EXCEEDED', err.message);
      return true;
    });
    took = Date.now() - t0;
    assert.ok(took < 3000, `a 1 s fetch deadline took ${took} ms`);
    process.kill(pid, 'SIGCONT');
    await s.sync({ timeoutMs: 30000 });
    assert.deepEqual([...await s.fetch(y, { gpu: 1 })], [2, 2, 2, 2]);
  } finally {
    process.kill(pid, 'SIGCONT');
    await s.close();
  }
});
