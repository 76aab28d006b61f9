// The Node client's pipeline (setPipeline) when things go wrong, against a real
// `meshd --local-agents 2 --session-max-queued 2 --agent-timeout 60`: with its rank-0
// agent stopped (SIGSTOP, SIGCONT in a finally) two commands fill a session's flow
// window and the server reads nothing more from the Submit stream until the agent runs
// again. Every wait is bounded (within()): a hang fails the test instead of blocking it.
//
// MESHD_BIN_DIR (set by ctest) locates meshd; else <source>/build/bin.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { agentPid, stopAgent } from '../test-lib/agents.mjs';
import { startMeshd, stopAll } from '../test-lib/meshd.mjs';
import { connect } from '../meshd.mjs';

let meshd;
let addr;

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// p's value, or its error thrown; fails if it is still pending after ms (a hang).
async function within(p, ms, what) {
  let timer;
  try {
    return await Promise.race([p, new Promise((_, reject) => {
      timer = setTimeout(() => reject(new Error(`${what}: still waiting after ${ms} ms`)), ms);
    })]);
  } finally {
    clearTimeout(timer);
  }
}

// {ok, value} or {err}, and when it settled (ms after t0).
const settle = (p, t0 = Date.now()) => p.then((value) => ({ ok: true, value, at: Date.now() - t0 }),
  (err) => ({ err, at: Date.now() - t0 }));

before(async () => {
  meshd = await startMeshd({ name: 'pipeline', args: ['--session-max-queued', '2', '--agent-timeout', '60'],
    connectOpts: { token: '' } });
  addr = meshd.addr;
});

after(() => stopAll()); // only the meshd this file started (its own agents go with it)

// A session with a gpu=2 mesh and x = ones(4), all run; and the rank-0 agent's pid,
// stopped by stop(), resumed by resume() (the test's finally resumes it too).
async function setup(timeoutMs) {
  const s = await connect(addr, { clientName: 'node-pipeline-faults', timeoutMs, token: '' });
  const mesh = await s.createMesh({ gpu: 2 });
  const x = await s.factory({ kind: 'ones', mesh, shape: [4] });
  await s.sync({ timeoutMs: 10000 });
  const pid = agentPid(meshd.pid, 0);
  let stopped = false;
  const stop = async () => {
    stopped = true;
    await stopAgent(pid);
  };
  const resume = () => { if (stopped) process.kill(pid, 'SIGCONT'); stopped = false; };
  return { s, mesh, x, stop, resume };
}

// With the agent stopped: two pipelined commands fill the session's flow window; they
// are answered, and the server then reads nothing more from the stream.
async function stall(s, x) {
  await within(Promise.all([s.call('add', [x, 1]), s.call('add', [x, 2])]), 5000, 'the two stalling commands');
}

test('a server that stops reading bounds the pipeline queue: a command that finds it full is not queued and takes no seq or ref', async () => {
  const { s, mesh, stop, resume, x } = await setup(1500);
  try {
    await s.setPipeline();
    await stop();
    await stall(s, x);
    // 100 Literals of 240 KB, none awaited (24 MB): before the fix every one went into
    // the stream's write buffer at once, however long the server did not read.
    const n = 60000;
    const first = s.nextRef + 1; // literal i takes ref first + i
    const calls = [];
    // each timed from its own issue (a busy machine spreads the loop over seconds)
    for (let i = 0; i < 100; i += 1) {
      const issued = Date.now();
      calls.push(settle(s.literal(mesh, [n], new Float32Array(n).fill(i)), issued));
    }
    await sleep(300);
    const held = s.pipelineStats();
    const rs = await within(Promise.all(calls), 10000, 'the 100 literals');
    // never went out: refused room, or taken out of the queue at its deadline
    const notQueued = rs.filter((r) => r.err && /not queued|never sent/.test(r.err.message));
    const handed = held.commands - 2; // the literals the stream took (the two stalling commands aside)
    assert.ok(notQueued.length >= 40, `only ${notQueued.length} of 100 never went out: ${JSON.stringify(held)}`);
    assert.ok(handed + held.queued <= 40, `the client held ${handed} + ${held.queued} literals of 240 KB`);
    for (const r of rs) {
      assert.ok(r.err, 'the server read nothing: no literal can be answered');
      assert.equal(r.err.kind, 'DEADLINE_EXCEEDED', r.err.message);
      assert.ok(r.at >= 1300 && r.at < 6000, `a 1.5 s deadline took ${r.at} ms`);
    }
    assert.match(notQueued[0].err.message, /within 1500 ms/);
    // Alone, the stream still taking nothing: it never goes out (its queue was emptied at
    // the deadlines: queued, then taken out at its own), and it gives its seq and ref back.
    const [seq, ref] = [s.seq, s.nextRef];
    const one = await within(settle(s.literal(mesh, [n], new Float32Array(n))), 5000, 'one more literal');
    assert.equal(one.err?.kind, 'DEADLINE_EXCEEDED', String(one.err));
    assert.match(one.err.message, /was not queued|never sent/);
    assert.deepEqual([s.seq, s.nextRef], [seq, ref], 'the refused command kept its seq or ref');
    // What the stream took goes out once the server reads again; the last one it took
    // ran (those still queued on the client at their deadline were taken out, never sent).
    resume();
    await within(s.sync({ timeoutMs: 20000 }), 25000, 'sync after resume');
    const last = rs.findLastIndex((r) => !/not queued|never sent/.test(r.err.message));
    assert.ok(last >= 0, 'no literal went out at all');
    const got = await s.fetch(first + last, { gpu: 1 }, { timeoutMs: 10000 });
    assert.deepEqual([got[0], got[n - 1]], [last, last]);
    const after = await within(s.literal(mesh, [2], new Float32Array([7, 8])), 10000, 'a literal after');
    assert.equal(Number(after.ref), ref + 1, 'the refused ref was not taken again');
    assert.deepEqual([...await s.fetch(after, { gpu: 0 }, { timeoutMs: 10000 })], [7, 8]);
  } finally {
    resume();
    await s.close().catch(() => {});
  }
});

test('a server that stops reading: tiny commands are accepted up to the queue and the transport window only, not into gRPC-js\'s retry buffer', async () => {
  // gRPC-js used to report a write done at once while the call's retry buffer
  // (grpc.per_rpc_retry_buffer_size, 1 MiB) had room: about 31,000 of these adds were
  // accepted, and all 8000 here. Now: at most 2 * maxBatch queued on the client,
  // WRITES_MAX (2) messages of maxBatch handed to the stream, and what the transport
  // took: the server's stream window (--stream-window-bytes, 64 KiB by default) and the
  // client's 16 KiB retry buffer, at 24 bytes an add at least (about 32 on the wire).
  const maxBatch = 64;
  const bound = 4 * maxBatch + Math.ceil(((64 + 16) << 10) / 24); // 3670
  const n = 8000;
  const { s, stop, resume, x } = await setup(1500);
  try {
    await s.setPipeline({ maxBatch });
    await stop();
    await stall(s, x);
    const t0 = Date.now();
    const calls = [];
    // Issued in bursts, the event loop turning between them as it would for a busy
    // client (in one synchronous loop the 8000 calls took seconds on a loaded machine,
    // past every deadline before the first write went out). Each add keeps its ref
    // (claimed at the call) and, once settled, how many commands the stream had taken.
    const taken = () => s.pipelineStats().commands;
    for (let i = 0; i < n; i += 1) {
      const add = s.call('add', [x, 1]);
      const ref = s.nextRef;
      calls.push(settle(add, t0).then((r) => ({ ...r, ref, taken: taken() })));
      if (i % 200 === 199) await new Promise(setImmediate);
    }
    const rs = await within(Promise.all(calls), 30000, `the ${n} adds`); // a hang guard only
    // never went out: refused room, or taken out of the queue at its deadline
    const notQueued = (r) => /not queued|never sent/.test(r.err?.message);
    const accepted = rs.filter((r) => !notQueued(r)).length;
    assert.ok(accepted <= bound, `${accepted} of ${n} tiny commands accepted while the server did not read (at most ${bound})`);
    assert.ok(accepted > 2 * maxBatch, `only ${accepted} accepted: the queue alone takes ${2 * maxBatch}`);
    // Full stays full: an add issued after one that never went out (refused room, or
    // taken out of the queue at its deadline) went out only if the stream took more after (on a loaded machine the transport may still be
    // filling the window when the first deadline comes: at load 17, add 1300 got in
    // after add 1276 was refused, the stream still taking commands).
    const all = taken();
    const lastIn = rs.findLastIndex((r) => !notQueued(r));
    const early = rs.findIndex((r, i) => i < lastIn && notQueued(r) && r.taken >= all);
    assert.equal(early, -1, `add ${lastIn} was accepted, issued after add ${early} never went out when `
      + `the stream had taken all it would (${all} commands)`);
    for (const r of rs) assert.equal(r.err?.kind, 'DEADLINE_EXCEEDED', String(r.err));
    // What the stream took goes out and runs once the server reads again (what was still
    // queued on the client at its deadline was taken out, never sent).
    resume();
    await within(s.sync({ timeoutMs: 20000 }), 25000, 'sync after resume');
    assert.deepEqual([...await s.fetch(rs[lastIn].ref, { gpu: 1 }, { timeoutMs: 10000 })], [2, 2, 2, 2]);
  } finally {
    resume();
    await s.close().catch(() => {});
  }
});

test('a command whose deadline passes in the client\'s queue is taken out, never sent; one the stream took still runs', async () => {
  const { s, mesh, stop, resume, x } = await setup(1000);
  try {
    await s.setPipeline();
    await stop();
    await stall(s, x);
    // 12 Literals of 240 KB: the stream takes two messages of four, which the transport
    // cannot pass on (the server reads nothing), and the rest wait in the client's queue.
    const n = 60000;
    const first = s.nextRef + 1; // literal i takes ref first + i
    const seq = s.seq;
    const calls = [];
    for (let i = 0; i < 12; i += 1) calls.push(settle(s.literal(mesh, [n], new Float32Array(n).fill(i))));
    const rs = await within(Promise.all(calls), 10000, 'the 12 literals');
    const neverSent = (r) => /never sent/.test(r.err?.message);
    const taken = rs.findLastIndex((r) => /may still run/.test(r.err?.message));
    assert.ok(taken >= 0 && rs.some(neverSent), rs.map((r) => String(r.err)).join('\n'));
    for (const [i, r] of rs.entries()) {
      assert.equal(r.err?.kind, 'DEADLINE_EXCEEDED', String(r.err));
      if (i <= taken) assert.match(r.err.message, /no answer to command seq \d+ within 1000 ms/);
      else if (neverSent(r)) {
        assert.match(r.err.message, new RegExp(`pipeline: command seq ${seq + i + 1} was not sent within 1000 ms: `
          + 'it waited in the client\'s queue .*; it was taken out of the queue and never sent, so it did not run'));
      } else assert.match(r.err.message, /not queued/);
    }
    assert.equal(s.pipelineStats().queued, 0, 'a command past its deadline is still queued');
    assert.deepEqual([s.seq, s.nextRef], [seq + 11, first + 10], 'the last literal, never sent, kept its seq or ref');
    // Once the server reads again: the last literal the stream took ran, the first one
    // taken out of the queue never reached it.
    resume();
    await within(s.sync({ timeoutMs: 20000 }), 25000, 'sync after resume');
    const got = await s.fetch(first + taken, { gpu: 1 }, { timeoutMs: 10000 });
    assert.deepEqual([got[0], got[n - 1]], [taken, taken]);
    const gone = rs.findIndex(neverSent);
    const f = await within(settle(s.fetch(first + gone, { gpu: 1 }, { timeoutMs: 10000 })), 15000, 'the fetch of one never sent');
    assert.equal(f.err?.kind, 'UNKNOWN_REF', String(f.err ?? 'it was fetched: it ran'));
  } finally {
    resume();
    await s.close().catch(() => {});
  }
});

test('a pipelined command whose turn comes after its deadline (the event loop was busy) is not queued, never sent', async () => {
  const { s, x } = await setup(10000);
  try {
    await s.setPipeline();
    const [seq, ref] = [s.seq, s.nextRef];
    const a = settle(s.call('add', [x, 1]));
    const b = settle(s.call('add', [x, 2], {}, { timeoutMs: 20 }));
    // Busy past b's deadline: b's turn (microtasks, once a is queued) comes before its
    // timer can run. Before the fix b was queued and sent all the same, then rejected
    // "no answer ... may still run".
    Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 100);
    const [ra, rb] = await within(Promise.all([a, b]), 10000, 'the two adds');
    assert.ok(ra.ok, String(ra.err));
    assert.equal(rb.err?.kind, 'DEADLINE_EXCEEDED', String(rb.err));
    assert.match(rb.err.message, /command seq \d+ was not queued or sent within 20 ms/);
    assert.deepEqual([s.seq, s.nextRef], [seq + 1, ref + 1], 'b kept its seq or ref');
    assert.equal(s.pipelineStats().commands, 1, 'b was sent');
  } finally {
    await s.close().catch(() => {});
  }
});

test('a command answered late is not dropped: setPipeline(null) says so, and the next call waits for it', async () => {
  const { s, stop, resume, x } = await setup(1000);
  try {
    await s.setPipeline();
    await stop();
    await stall(s, x);
    const y = await within(settle(s.call('add', [x, 10])), 5000, 'the late call');
    assert.equal(y.err?.kind, 'DEADLINE_EXCEEDED', String(y.err));
    const yRef = s.nextRef;
    // One that the server will reject once it reads it: its caller stopped waiting, so
    // the rejection comes as a warning, once.
    const warnings = [];
    const onWarning = (w) => { if (w.name === 'MeshdWarning') warnings.push(w.message); };
    process.on('warning', onWarning);
    const bad = await within(settle(s.execute({ reduce: { ref: s.newRef(), input: x.ref, dims: ['nodim'],
      reduction: 'sum' } }, { timeoutMs: 300 })), 5000, 'the late bad reduce');
    assert.equal(bad.err?.kind, 'DEADLINE_EXCEEDED', String(bad.err));
    // Their commands are still on the stream: turning the pipeline off waits for their
    // answers, the session's 1 s, and says what was left (before: it returned at once, and
    // the unary call below overtook them, so y was refused REF_REUSED unseen).
    const off = await within(settle(s.setPipeline(null)), 5000, 'setPipeline(null)');
    assert.equal(off.err?.kind, 'DEADLINE_EXCEEDED', String(off.err));
    assert.match(off.err.message, /setPipeline\(null\): 2 pipelined command\(s\) sent before it \(seq \d+ first\) not answered within 1000 ms/);
    assert.equal(s.pipelineStats(), null, 'the pipeline is off all the same');
    setTimeout(resume, 500);
    const z = await within(s.call('add', [x, 20], {}, { timeoutMs: 15000 }), 20000, 'the unary call after');
    assert.equal(Number(z.ref), yRef + 2);
    process.off('warning', onWarning);
    assert.equal(warnings.length, 1, warnings.join('\n'));
    assert.match(warnings[0], /seq \d+, whose answer came after its deadline, was rejected: BAD_DIM/);
    assert.deepEqual([...await s.fetch(yRef, { gpu: 0 }, { timeoutMs: 10000 })], [11, 11, 11, 11]);
    assert.deepEqual([...await s.fetch(z, { gpu: 1 }, { timeoutMs: 10000 })], [21, 21, 21, 21]);
  } finally {
    resume();
    await s.close().catch(() => {});
  }
});

test('fetch and sync in a pipeline wait at most their own timeoutMs for the answers before them', async () => {
  const { s, stop, resume, x } = await setup(20000);
  try {
    await s.setPipeline();
    await stop();
    await stall(s, x);
    const y = s.call('mul', [x, 3]); // not answered while the server does not read
    const yRef = s.nextRef;
    let t0 = Date.now();
    const f = await within(settle(s.fetch(yRef, { gpu: 0 }, { timeoutMs: 500 })), 5000, 'fetch');
    assert.equal(f.err?.kind, 'DEADLINE_EXCEEDED', String(f.err));
    assert.ok(Date.now() - t0 < 2500, `a 500 ms fetch took ${Date.now() - t0} ms`);
    t0 = Date.now();
    const sy = await within(settle(s.sync({ timeoutMs: 500 })), 5000, 'sync');
    assert.equal(sy.err?.kind, 'DEADLINE_EXCEEDED', String(sy.err));
    assert.ok(Date.now() - t0 < 2500, `a 500 ms sync took ${Date.now() - t0} ms`);
    resume();
    await within(s.sync({ timeoutMs: 15000 }), 20000, 'sync after resume');
    assert.deepEqual([...await s.fetch(await y, { gpu: 1 }, { timeoutMs: 10000 })], [3, 3, 3, 3]);
  } finally {
    resume();
    await s.close().catch(() => {});
  }
});

test('close: answers missing at its deadline close the session all the same, and nobody gets a CANCELLED of the client', async () => {
  // Every answer in, but the server reads the stream's end only once its agents caught
  // up: turning the pipeline off and closing report nothing.
  const a = await setup(1000);
  try {
    await a.s.setPipeline();
    await a.stop();
    await stall(a.s, a.x);
    await within(a.s.setPipeline(null), 5000, 'setPipeline(null), all answered');
    await within(a.s.close(), 5000, 'close, all answered');
  } finally {
    a.resume();
    await a.s.close().catch(() => {});
  }
  // A call still waiting (its own 20 s) when close runs out of the session's 800 ms.
  const { s, stop, resume, x } = await setup(800);
  try {
    await s.setPipeline();
    await stop();
    await stall(s, x);
    const waiting = settle(s.call('add', [x, 1], {}, { timeoutMs: 20000 }));
    const t0 = Date.now();
    const closed = await within(settle(s.close()), 5000, 'close with an answer missing');
    assert.equal(closed.err?.kind, 'DEADLINE_EXCEEDED', String(closed.err));
    assert.match(closed.err.message, /close: 1 pipelined command\(s\) sent before it/);
    assert.ok(Date.now() - t0 < 3000, `close took ${Date.now() - t0} ms`);
    assert.equal(s.closed, true);
    const w = await within(waiting, 2000, 'the call close left');
    assert.equal(w.err?.kind, 'NO_SESSION', String(w.err));
    const obs = await connect(addr, { clientName: 'node-observer', token: '' });
    try {
      const { sessions } = await obs.unary('ListSessions', {});
      assert.ok(!sessions.some((r) => r.session_id === s.id), 'the session is still open');
    } finally {
      await obs.close();
    }
  } finally {
    resume();
  }
});

test('setPipeline and calls from tasks that interleave keep their order (no write after the stream ended)', async () => {
  const { s, mesh } = await setup(10000);
  try {
    const acc = await s.factory({ kind: 'zeros', mesh, shape: [2] });
    const calls = [];
    const on = (async () => {
      for (let i = 0; i < 8; i += 1) {
        await s.setPipeline({ maxBatch: 1 + (i % 3) });
        calls.push(s.call('add_', [acc, 1]));
      }
    })();
    const off = (async () => {
      for (let i = 0; i < 8; i += 1) {
        calls.push(s.call('add_', [acc, 1])); // issued just before the pipeline goes off
        await s.setPipeline(null);
      }
    })();
    await within(Promise.all([on, off]), 10000, 'the two tasks');
    const rs = await within(Promise.allSettled(calls), 10000, 'their calls');
    assert.deepEqual(rs.filter((r) => r.status === 'rejected').map((r) => r.reason.message), []);
    await s.setPipeline();
    const seen = s.fetch(acc, { gpu: 0 }, { timeoutMs: 10000 });
    const after = s.call('add_', [acc, 100]); // issued after the fetch: not seen by it
    assert.deepEqual([...await seen], [16, 16]);
    await after;
  } finally {
    await s.close().catch(() => {});
  }
});

test('a rejection goes to its own call once; a stream that dies fails every call waiting and the next one, never hangs', async () => {
  const { s, stop, resume, x } = await setup(3000);
  const streams = [];
  const submit = s.client.Submit.bind(s.client);
  s.client.Submit = (...args) => { const st = submit(...args); streams.push(st); return st; };
  try {
    await s.setPipeline();
    const bad = await within(settle(s.reduce(x, ['nodim'])), 5000, 'a bad reduce');
    assert.equal(bad.err?.kind, 'BAD_DIM', String(bad.err));
    await stop();
    await stall(s, x);
    const waiting = settle(s.call('add', [x, 1]));
    await sleep(50);
    streams[0].cancel(); // the stream dies (as when the connection breaks)...
    const sentAsItDied = settle(s.call('add', [x, 2])); // ...and a command goes just then
    const [w, d] = await within(Promise.all([waiting, sentAsItDied]), 2000, 'the calls on the dead stream');
    assert.equal(w.err?.kind, 'CANCELLED', String(w.err));
    assert.equal(d.err?.kind, 'CANCELLED', String(d.err));
    const next = await within(settle(s.call('add', [x, 3])), 2000, 'a call after');
    assert.equal(next.err?.kind, 'CANCELLED', String(next.err));
    // setPipeline again opens a new stream; the rejection is not reported again anywhere
    resume();
    await s.setPipeline();
    assert.equal(streams.length, 2);
    const y = await within(s.call('add', [x, 4]), 10000, 'a call on the new stream');
    assert.deepEqual([...await s.fetch(y, { gpu: 0 }, { timeoutMs: 10000 })], [5, 5, 5, 5]);
    await within(s.setPipeline(null), 5000, 'setPipeline(null)');
  } finally {
    resume();
    await s.close();
  }
});
