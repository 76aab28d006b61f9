// Answers the Node client never gets, against a real `meshd --local-agents 2`: a unary
// Execute, or pipelined commands on a Submit stream that dropped, that reached the server,
// which defined their tensors, and whose answers were lost (a deadline, a dropped
// connection). The caller gets an error and no handle, so nobody but the client can let
// go of those tensors (as the Python client does, and this client's proxied upload).
// And transfers refused only for --session-max-transfers, which wait for a slot.
// Every wait is bounded.
//
// MESHD_BIN_DIR (set by ctest) locates meshd; else <source>/build/bin.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { startMeshd, stopAll } from '../test-lib/meshd.mjs';
import { connect, grpc, MeshdError } from '../meshd.mjs';

let meshd;

before(async () => {
  meshd = await startMeshd({ name: 'lost', connectOpts: { token: '' } });
});

after(() => stopAll()); // only the meshd this file started (its own agents go with it)

const rpcError = (code, details) => Object.assign(new Error(details), { code, details, metadata: new grpc.Metadata() });

// From now on the session's unary Execute of a `field` command reaches the server, which
// runs it, and its answer is replaced by `code` (no error kind: the client's own, or a
// broken connection). Returns the seqs whose answers were lost; undo() restores.
function loseAnswers(s, field, code) {
  const real = s.client.Execute;
  const lost = [];
  s.client.Execute = function (request, md, opts, cb) {
    return real.call(this, request, md, opts, (err, reply) => {
      if (!err && request[field]) {
        lost.push(request.seq);
        cb(rpcError(code, `test: the answer to seq ${request.seq} was lost`));
      } else cb(err, reply);
    });
  };
  return { lost, undo: () => { delete s.client.Execute; } };
}

const COMMANDS = { // field -> a command of that kind on mesh (x: a tensor on it)
  factory: (s, mesh) => s.factory({ kind: 'zeros', mesh, shape: [1000] }),
  call: (s, mesh, x) => s.call('add', [x, 1]),
  reduce: (s, mesh, x) => s.reduce(x, ['gpu'], 'sum'),
  literal: (s, mesh) => s.literal(mesh, [10], new Float32Array(10)),
};

for (const code of [grpc.status.DEADLINE_EXCEEDED, grpc.status.UNAVAILABLE]) {
  for (const field of Object.keys(COMMANDS)) {
    test(`a ${field} whose Execute answer is lost (${grpc.status[code]}) leaves no tensor live`, async () => {
      const s = await connect(meshd.addr, { clientName: 'node-lost', token: '', timeoutMs: 10000 });
      try {
        const live = async () => {
          const { sessions } = await s.unary('ListSessions', {});
          return Number(sessions.find((r) => r.session_id === s.id).live_tensors);
        };
        const mesh = await s.createMesh({ gpu: 2 });
        const x = await s.factory({ kind: 'ones', mesh, shape: [4] });
        await s.sync();
        const base = await live();
        const { lost, undo } = loseAnswers(s, field, code);
        try {
          await assert.rejects(COMMANDS[field](s, mesh, x), (e) => {
            assert.ok(e instanceof MeshdError, String(e));
            assert.equal(e.kind, grpc.status[code], e.message);
            return true;
          });
        } finally {
          undo();
        }
        assert.equal(lost.length, 1, `the ${field} did not go as a unary Execute`);
        await s.sync();
        assert.equal(await live(), base, `the tensor the lost ${field} answer defined is still live`);
        // the session goes on, refs in order
        const y = await s.call('add', [x, 2]);
        assert.deepEqual([...await s.fetch(y, { gpu: 1 })], [3, 3, 3, 3]);
      } finally {
        await s.close();
      }
    });
  }
}

test('pipelined commands whose answers a dropped Submit stream lost (UNAVAILABLE) leave no tensor live', async () => {
  const s = await connect(meshd.addr, { clientName: 'node-lost-pipe', token: '', timeoutMs: 10000 });
  try {
    const live = async () => {
      const { sessions } = await s.unary('ListSessions', {});
      return Number(sessions.find((r) => r.session_id === s.id).live_tensors);
    };
    const mesh = await s.createMesh({ gpu: 2 });
    const x = await s.factory({ kind: 'ones', mesh, shape: [4] });
    await s.sync();
    const base = await live();
    // The stream's first answer is the last thing that comes: the connection drops there
    // (the call ends UNAVAILABLE, no kind), the server having run the commands it answered.
    let dropped = 0;
    const real = s.client.Submit;
    s.client.Submit = function (...a) {
      const st = real.apply(this, a);
      const emit = st.emit.bind(st);
      st.emit = (ev, ...args) => {
        if (ev === 'data') {
          if (!dropped++) st.cancel();
          return true;
        }
        if (ev === 'error' && dropped) return emit('error', rpcError(grpc.status.UNAVAILABLE, 'test: connection dropped'));
        return emit(ev, ...args);
      };
      return st;
    };
    await s.setPipeline();
    delete s.client.Submit;
    const rs = await Promise.allSettled([
      s.factory({ kind: 'zeros', mesh, shape: [1000] }),
      s.call('add', [x, 1]),
      s.call('mul', [x, 3]),
    ]);
    for (const r of rs) {
      assert.equal(r.status, 'rejected');
      assert.equal(r.reason.kind, 'UNAVAILABLE', r.reason.message);
    }
    assert.equal(dropped, 1, 'the answers came in one message');
    await s.setPipeline(null);
    await s.sync();
    assert.equal(await live(), base, 'the tensors of the commands whose answers were lost are still live');
    const y = await s.call('add', [x, 2]);
    assert.deepEqual([...await s.fetch(y, { gpu: 0 })], [3, 3, 3, 3]);
  } finally {
    await s.close();
  }
});

test('a command the server rejected (with its kind) releases nothing', async () => {
  const s = await connect(meshd.addr, { clientName: 'node-lost-other', token: '', timeoutMs: 10000 });
  try {
    const mesh = await s.createMesh({ gpu: 2 });
    const x = await s.factory({ kind: 'ones', mesh, shape: [4] });
    await s.sync();
    const sent = [];
    const real = s.client.Execute;
    s.client.Execute = function (request, md, opts, cb) {
      sent.push(request);
      return real.call(this, request, md, opts, cb);
    };
    await assert.rejects(s.call('nosuchop', [x]), (e) => e.kind === 'UNKNOWN_OP');
    delete s.client.Execute;
    assert.ok(!sent.some((r) => r.release), 'a command the server rejected (with its kind) needs no release');
    assert.deepEqual([...await s.fetch(x, { gpu: 0 })], [1, 1, 1, 1]);
  } finally {
    await s.close();
  }
});

// --session-max-transfers (8 by default; 2 here) Upload, Fetch and planned transfers in
// flight per session: the server refuses one more QUOTA, and the session's own transfers
// end soon. Fetches issued together (every rank of a mesh, Promise.all) must wait for a
// slot, as the Python client's do (the C client fetches in waves), not fail.
test('more fetches at once than --session-max-transfers: each waits for a slot, both paths', async () => {
  const few = await startMeshd({ name: 'few-transfers', args: ['--session-max-transfers', '2'],
    connectOpts: { token: '' } });
  for (const dataPath of ['proxy', 'auto']) {
    const s = await connect(few.addr, { clientName: 'node-many-fetches', token: '', timeoutMs: 20000, dataPath });
    try {
      const mesh = await s.createMesh({ gpu: 2 });
      const n = 1 << 20; // 4 MiB a rank: each fetch holds its slot a while
      const x = await s.factory({ kind: 'full', mesh, shape: [n], value: 7 });
      const rs = await Promise.allSettled(Array.from({ length: 12 }, (_, i) => s.fetch(x, { gpu: i % 2 })));
      const failed = rs.filter((r) => r.status === 'rejected').map((r) => r.reason.message);
      assert.deepEqual(failed, [], `${dataPath}: ${failed.length} of 12 fetches failed`);
      for (const r of rs) assert.equal(r.value[n - 1], 7);
      const t = await Promise.all([s.upload(mesh, [4], new Float32Array(4)), s.fetch(x, { gpu: 0 }),
        s.fetch(x, { gpu: 1 }), s.upload(mesh, [4], new Float32Array(4)), s.fetch(x, { gpu: 0 })]);
      assert.deepEqual(t[0].shape, [4]);
      if (dataPath === 'auto') assert.ok(s.transferStats.directFetches >= 12, JSON.stringify(s.transferStats));
    } finally {
      await s.close();
    }
  }
  await few.stop();
});

for (const code of [grpc.status.DEADLINE_EXCEEDED, grpc.status.UNAVAILABLE]) {
  test(`a borrow whose Execute answer is lost (${grpc.status[code]}) does not pin its origin`, async () => {
    // review-117: the server made the borrow, the caller got no answer and has no ref to
    // drop: the origin could not be dropped (BORROWED) until the session ended.
    const s = await connect(meshd.addr, { clientName: 'node-lost-borrow', token: '', timeoutMs: 10000 });
    try {
      const mesh = await s.createMesh({ gpu: 2 });
      const x = await s.factory({ kind: 'ones', mesh, shape: [4] });
      const stream = s.newRef();
      await s.execute({ create_stream: { ref: stream, name: 'side' } });
      await s.sync();
      const { lost, undo } = loseAnswers(s, 'borrow', code);
      const ref = s.newRef(), borrow = s.newRef();
      try {
        await assert.rejects(s.execute({ borrow: { ref, input: x.ref, stream, borrow } }),
          (e) => e instanceof MeshdError && e.kind === grpc.status[code]);
      } finally {
        undo();
      }
      assert.equal(lost.length, 1, 'the borrow did not go as a unary Execute');
      await s.execute({ drop: { refs: [x.ref] } }); // rejected BORROWED
      await s.sync();
    } finally {
      await s.close();
    }
  });
}

// review-123: the lost commands' Release is refused whole (BORROWED) when one of its refs
// is a view of a borrowed tensor: none of its refs was released, not even once the borrow
// ended (Node kept no trace of them), so they stayed live until the session ended.
test('a lost view of a borrowed tensor keeps neither itself nor the other lost refs live', async () => {
  const s = await connect(meshd.addr, { clientName: 'node-lost-view', token: '', timeoutMs: 10000 });
  try {
    const live = async () => {
      const { sessions } = await s.unary('ListSessions', {});
      return Number(sessions.find((r) => r.session_id === s.id).live_tensors);
    };
    const mesh = await s.createMesh({ gpu: 2 });
    const x = await s.factory({ kind: 'ones', mesh, shape: [4] });
    const stream = s.newRef();
    await s.execute({ create_stream: { ref: stream, name: 'side' } });
    await s.sync();
    const base = await live();
    const ref = s.newRef(), borrow = s.newRef();
    await s.execute({ borrow: { ref, input: x.ref, stream, borrow } });
    await s.sync();
    const borrowed = await live();
    // Pipelined commands whose answers a dropped Submit stream lost: one Release names both.
    let dropped = 0;
    const real = s.client.Submit;
    s.client.Submit = function (...a) {
      const st = real.apply(this, a);
      const emit = st.emit.bind(st);
      st.emit = (ev, ...args) => {
        if (ev === 'data') {
          if (!dropped++) st.cancel();
          return true;
        }
        if (ev === 'error' && dropped) return emit('error', rpcError(grpc.status.UNAVAILABLE, 'test: connection dropped'));
        return emit(ev, ...args);
      };
      return st;
    };
    await s.setPipeline();
    delete s.client.Submit;
    const rs = await Promise.allSettled([s.call('view', [x, [2, 2]]), s.call('add', [x, 1])]);
    for (const r of rs) assert.equal(r.status, 'rejected');
    await s.setPipeline(null);
    await s.sync();
    assert.equal(await live(), borrowed + 1, 'only the view of the borrowed tensor may stay live while the borrow does');
    await s.execute({ drop_borrow: { borrow } });
    await s.sync();
    assert.equal(await live(), base, 'the lost view of the borrowed tensor is still live once the borrow ended');
    assert.deepEqual([...await s.fetch(x, { gpu: 0 })], [1, 1, 1, 1]);
  } finally {
    await s.close();
  }
});
