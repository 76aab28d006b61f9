// Handles of another session (against a live meshd): refs are numbered per session, so
// two sessions made alike handed out the same refs, and a TensorMeta or MeshMeta of session
// B used in a call of session A named another object of A (wrong results, no error).
// Each call that takes a handle refuses one of another session, naming the argument; a
// bare ref (a number, a BigInt, {ref}) too: each session numbers its refs in a span of its
// own, and a ref it did not hand out is refused.
// Also: an unknown dtype is BAD_ARGUMENT and a bad shard dim BAD_DIM (DESIGN.md §6);
// reduce's out and inplace (Monarch's reduce(..., _inplace, out)).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { startMeshd, stopAll } from '../test-lib/meshd.mjs';
import { connect, MeshdError } from '../meshd.mjs';

let meshd;
let addr;
const URL_ = 'http://127.0.0.1:9/none.bin'; // never fetched: every load here is refused first

before(async () => {
  meshd = await startMeshd({ name: 'sessions', ready: 'serving' });
  addr = meshd.addr;
});

after(() => stopAll());

// A session with a mesh gpu=2, its slice at gpu=0 and full(value) of shape [2].
async function world(value) {
  const s = await connect(addr, { clientName: 'sessions', timeoutMs: 30000 });
  const mesh = await s.createMesh({ gpu: 2 });
  const slice = await s.sliceMesh(mesh, { gpu: 0 });
  const x = await s.factory({ kind: 'full', mesh, shape: [2], value });
  return { s, mesh, slice, x };
}

// p rejects with a MeshdError BAD_ARGUMENT naming `what` and another session.
async function refused(p, what) {
  const e = await Promise.resolve().then(() => p).then(() => null, (err) => err);
  assert.ok(e, `not refused (${what}): the call went through`);
  assert.ok(e instanceof MeshdError, `${what}: ${e}`);
  assert.equal(e.kind, 'BAD_ARGUMENT', e.message);
  assert.match(e.message, /another session/);
  assert.ok(e.message.includes(what), `${what}: ${e.message}`);
}

test('a handle of another session is refused, naming the argument', async () => {
  const a = await world(1);
  const b = await world(10);
  try {
    assert.notEqual(a.x.ref, b.x.ref, 'two sessions made alike hand out refs of their own');
    // a.x + b.x was a.x + a.x (2, not 11), without an error
    await refused(a.s.call('add', [a.x, b.x]), 'argument 1');
    await refused(a.s.call('cat', [[a.x, b.x]]), 'argument 0[1]');
    await refused(a.s.call('add', [a.x], { other: b.x }), "argument 'other'");
    await refused(a.s.factory({ kind: 'ones', mesh: b.mesh, shape: [2] }), 'mesh');
    await refused(a.s.sliceMesh(b.mesh, { gpu: 0 }), 'parent');
    await refused(a.s.reduce(b.x, ['gpu'], 'sum'), 'input');
    await refused(a.s.reduce(a.x, ['gpu'], 'sum', { mesh: b.slice }), 'mesh');
    await refused(a.s.reduce(a.x, ['gpu'], 'sum', { out: b.x }), 'out');
    await refused(a.s.upload(b.mesh, [2], Float32Array.of(3, 3)), 'mesh');
    await refused(a.s.literal(b.mesh, [2], Float32Array.of(3, 3)), 'mesh');
    await refused(a.s.load(b.mesh, URL_, { dtype: 'DTYPE_FLOAT32', shape: [2] }), 'mesh');
    await refused(a.s.inspectUrl(URL_, b.mesh), 'mesh');
    await refused(a.s.fetch(b.x, { gpu: 0 }), 'tensor');

    // nothing of either was touched, and each session's own handles still work
    await a.s.sync();
    assert.deepEqual([...await a.s.fetch(a.x, { gpu: 0 })], [1, 1]);
    assert.deepEqual([...await b.s.fetch(b.x, { gpu: 0 })], [10, 10]);
    const y = await a.s.call('add', [a.x, 2]);
    assert.deepEqual([...await a.s.fetch(y, { gpu: 1 })], [3, 3]);
    const u = await b.s.upload(b.mesh, [2], Float32Array.of(4, 5));
    const z = await b.s.call('add', [u, b.x]);
    assert.deepEqual([...await b.s.fetch(z, { gpu: 1 })], [14, 15]);
    await refused(a.s.call('add', [a.x, u]), 'argument 1'); // an upload's handle is b's too
    // a bare ref of this session is taken as it is; of another, or never handed out, refused
    assert.deepEqual([...await a.s.fetch(a.x.ref, { gpu: 0 })], [1, 1]);
    const w = await a.s.call('add', [{ ref: a.x.ref }, BigInt(a.x.ref)]);
    assert.deepEqual([...await a.s.fetch(w.ref, { gpu: 0 })], [2, 2]);
    await refused(a.s.fetch(b.x.ref, { gpu: 0 }), 'tensor');
    await refused(a.s.call('add', [a.x, BigInt(b.x.ref)]), 'argument 1');
    await refused(a.s.call('add', [a.x, { ref: b.x.ref }]), 'argument 1');
    await refused(a.s.call('add', [a.x, 1], {}, { stream: b.mesh.ref }), 'stream');
    await refused(a.s.factory({ kind: 'ones', mesh: b.mesh.ref, shape: [2] }), 'mesh');
    await refused(a.s.reduce(b.x.ref, ['gpu'], 'sum'), 'input');
    await refused(a.s.reduce(a.x, ['gpu'], 'sum', { out: b.x.ref }), 'out');
    await refused(a.s.upload(b.mesh.ref, [2], Float32Array.of(3, 3)), 'mesh');
    await refused(a.s.fetch(a.s.nextRef + 1, { gpu: 0 }), 'tensor'); // never handed out
    // the mark is not enumerable: a handle looks as the server sent it
    assert.deepEqual(Object.keys(a.x).sort(), Object.keys({ ...a.x }).sort());
    assert.equal(JSON.stringify(a.x), JSON.stringify({ ...a.x }));
  } finally {
    await a.s.close();
    await b.s.close();
  }
});

// p rejects with a MeshdError of `kind` whose message matches re.
async function rejectsWith(p, kind, re) {
  await assert.rejects(p, (e) => {
    assert.ok(e instanceof MeshdError, String(e));
    assert.equal(e.kind, kind, e.message);
    assert.match(e.message, re);
    return true;
  });
}

test("reduce's out and inplace write the result into out (onto a sub-mesh too) or the input", async () => {
  const { s, mesh, slice } = await world(0);
  try {
    const data = Float32Array.of(1, 2, 3, 3, 4, 5); // rank 0's, then rank 1's
    const x = await s.upload(mesh, [3], data, { perRank: true });
    const [r0, r1] = [[...data.subarray(0, 3)], [...data.subarray(3)]];
    const sum = r0.map((v, i) => v + r1[i]);
    const avg = sum.map((v) => v / 2);
    const max = r0.map((v, i) => Math.max(v, r1[i]));
    const zeros = (m, shape = [3], dtype = 'DTYPE_FLOAT32') => s.factory({ kind: 'zeros', mesh: m, shape, dtype });
    const [sumOut, avgOut, maxOut] = [await zeros(mesh), await zeros(mesh), await zeros(slice)];
    const refs = s.nextRef;
    assert.equal((await s.reduce(x, ['gpu'], 'sum', { out: sumOut })).ref, sumOut.ref);
    assert.equal((await s.reduce(x, ['gpu'], 'avg', { out: avgOut })).ref, avgOut.ref);
    const w = await s.reduce(x, ['gpu'], 'max', { mesh: slice, out: maxOut });
    assert.deepEqual([w.ref, w.mesh], [maxOut.ref, slice.ref]);
    assert.equal(s.nextRef, refs, 'into out, no ref is made');
    for (const gpu of [0, 1]) {
      assert.deepEqual([...await s.fetch(sumOut, { gpu })], sum);
      assert.deepEqual([...await s.fetch(avgOut, { gpu })], avg);
    }
    assert.deepEqual([...await s.fetch(maxOut, {})], max);

    // bad uses: the server's kind and message; nothing is written
    await rejectsWith(s.reduce(x, ['gpu'], 'sum', { out: await zeros(mesh, [2]) }), 'SHAPE_MISMATCH', /out has shape/);
    await rejectsWith(s.reduce(x, ['gpu'], 'sum', { out: await zeros(mesh, [3], 'DTYPE_INT32') }), 'DTYPE_MISMATCH', /out is/);
    await rejectsWith(s.reduce(x, ['gpu'], 'sum', { mesh: slice, out: sumOut }), 'WRONG_MESH', /out \(tensor/);
    await rejectsWith(s.reduce(x, ['gpu'], 'sum', { out: sumOut, inplace: true }), 'BAD_ARGUMENT', /inplace and out/);
    assert.deepEqual([...await s.fetch(sumOut, { gpu: 1 })], sum);

    const y = await s.reduce(x, ['gpu'], 'sum', { inplace: true });
    assert.equal(y.ref, x.ref, 'in place, the answer is the input');
    for (const gpu of [0, 1]) assert.deepEqual([...await s.fetch(x, { gpu })], sum);
  } finally {
    await s.close();
  }
});

test('an unknown dtype is BAD_ARGUMENT and a shard dim the mesh lacks BAD_DIM', async () => {
  const a = await world(1);
  try {
    for (const dtype of ['float64', 'DTYPE_FLOAT33', 11]) {
      for (const call of [
        () => a.s.factory({ kind: 'ones', mesh: a.mesh, shape: [2], dtype }),
        () => a.s.load(a.mesh, URL_, { dtype, shape: [2] }),
      ]) {
        const e = await Promise.resolve().then(call).then((t) => `taken as ${t.dtype}`, (err) => err);
        assert.ok(e instanceof MeshdError, `dtype '${dtype}': ${e}`);
        assert.equal(e.kind, 'BAD_ARGUMENT', e.message);
        assert.ok(e.message.includes(String(dtype)), e.message);
      }
    }
    const e = await a.s.load(a.mesh, URL_, { dtype: 'DTYPE_FLOAT32', shape: [4], shard: 'nodim' })
      .then(() => null, (err) => err);
    assert.ok(e instanceof MeshdError, String(e));
    assert.equal(e.kind, 'BAD_DIM', e.message);
    await a.s.sync();
  } finally {
    await a.s.close();
  }
});
