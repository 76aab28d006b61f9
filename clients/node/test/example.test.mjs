// The Node client against a real `meshd --local-agents 2`: the compute example as a child
// process, and an error through the client (.kind).
//
// MESHD_BIN_DIR (set by ctest) locates meshd; else <source>/build/bin.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { startMeshd, startRangeServer, stopAll } from '../test-lib/meshd.mjs';
import { connect, MeshdError } from '../meshd.mjs';

const here = path.dirname(fileURLToPath(import.meta.url));

let meshd;
let addr;

const logTail = () => meshd.logTail();

before(async () => {
  // ready once meshd.v1.TensorService is SERVING (its agents are up)
  meshd = await startMeshd({ name: 'client', ready: 'serving' });
  addr = meshd.addr;
});

after(() => stopAll()); // only the meshd this file started (its own agents go with it)

test('examples/compute.mjs computes, reduces and fetches the right values', async () => {
  const example = path.join(here, '..', 'examples', 'compute.mjs');
  const { code, stdout, stderr } = await new Promise((resolve) => {
    execFile(process.execPath, [example, '--server', addr], { timeout: 120000 },
      (err, so, se) => resolve({ code: err ? (err.code ?? 1) : 0, stdout: so, stderr: se }));
  });
  assert.equal(code, 0, `example failed (${code})\nstdout:\n${stdout}\nstderr:\n${stderr}\n${logTail()}`);
  assert.match(stdout, /^CHECK OK$/m);
  assert.match(stdout, /^rank 0: .* ok$/m);
  assert.match(stdout, /^rank 1: .* ok$/m);
});

// A .npy file of float32 [2, 4] (0..7) served over HTTP on loopback, which the
// server's default --url-allow permits.
function npyBuffer() {
  const dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 4), }";
  const head = Buffer.alloc(128, ' ');
  Buffer.from('\x93NUMPY\x01\x00', 'latin1').copy(head, 0);
  head.writeUInt16LE(118, 8);
  head.write(dict, 10, 'latin1');
  head[127] = 0x0a;
  return Buffer.concat([head, Buffer.from(new Float32Array([0, 1, 2, 3, 4, 5, 6, 7]).buffer)]);
}

// A safetensors file holding "w": uint8 [2, 2] = 1..4, and an index (as huggingface
// writes one) that puts "w" in it under dir/, and "gone" too, which it lacks.
function safetensorsBuffer() {
  const head = Buffer.from('{"w":{"dtype":"U8","shape":[2,2],"data_offsets":[0,4]}}');
  const len = Buffer.alloc(8);
  len.writeBigUInt64LE(BigInt(head.length));
  return Buffer.concat([len, head, Buffer.from([1, 2, 3, 4])]);
}
const indexJson = JSON.stringify({ metadata: { total_size: 4 },
  weight_map: { w: 'dir/w.safetensors', gone: 'dir/w.safetensors' } }, null, 2);

test('load: agents fetch a .npy file and raw bytes from a URL, sharded', async () => {
  const http = await import('node:http');
  const files = { '/x.npy': npyBuffer(), '/ckpt/dir/w.safetensors': safetensorsBuffer(),
    '/ckpt/model.safetensors.index.json': Buffer.from(indexJson) };
  const srv = http.createServer((req, res) => {
    const body = files[req.url.split('?')[0]];
    if (!body) { res.writeHead(404, { 'Content-Length': 0 }); res.end(); return; }
    const m = /bytes=(\d+)-(\d+)/.exec(req.headers.range ?? '');
    const [a, b] = m ? [Number(m[1]), Math.min(Number(m[2]), body.length - 1)] : [0, body.length - 1];
    res.writeHead(m ? 206 : 200, { 'Content-Length': b - a + 1, 'Accept-Ranges': 'bytes',
      ...(m ? { 'Content-Range': `bytes ${a}-${b}/${body.length}` } : {}) });
    res.end(req.method === 'HEAD' ? undefined : body.subarray(a, b + 1));
  });
  await new Promise((resolve) => srv.listen(0, '127.0.0.1', resolve));
  const url = `http://127.0.0.1:${srv.address().port}/x.npy`;
  const s = await connect(addr, { clientName: 'node-load' });
  try {
    const mesh = await s.createMesh({ gpu: 2 });
    const t = await s.load(mesh, url, { shard: 'gpu', dim: 1 });
    assert.deepEqual(t.shape, [2, 2]);
    assert.deepEqual([...await s.fetch(t, { gpu: 1 })], [2, 3, 6, 7]);
    await assert.rejects(s.load(mesh, url, { dtype: 'DTYPE_FLOAT32', shape: [3] }).then(
      (bad) => s.fetch(bad, { gpu: 0 })), (err) => {
      assert.ok(err instanceof MeshdError, String(err));
      assert.match(err.message, /bytes/);
      return true;
    });
    await assert.rejects(s.load(mesh, 'http://169.254.169.254/x', { dtype: 'DTYPE_UINT8', shape: [1] }),
      (err) => err.kind === 'PERMISSION_DENIED');
    // A checkpoint's index: the tensor comes from the file it names, relative to it.
    const index = url.replace('/x.npy', '/ckpt/model.safetensors.index.json?sig=1');
    const w = await s.load(mesh, index, { name: 'w' });
    assert.deepEqual(w.shape, [2, 2]);
    assert.deepEqual([...await s.fetch(w, { gpu: 1 })], [1, 2, 3, 4]);
    await assert.rejects(s.load(mesh, index), (err) => err.kind === 'BAD_ARGUMENT' &&
      /puts 'gone' in http:\/\/127\.0\.0\.1:\d+\/ckpt\/dir\/w\.safetensors, which is a file without it/.test(err.message));
    await assert.rejects(s.load(mesh, index, { name: 'nope' }), (err) => err.kind === 'BAD_ARGUMENT' &&
      /no tensor named 'nope' in the index .*it holds: w, gone/.test(err.message));
  } finally {
    await s.close();
    srv.close();
  }
});

// A safetensors file whose tensors split over 2 ranks along dim 1 but the second's:
// the load is refused at that tensor, and the first one, loaded already, is dropped
// (the caller got no handle to drop it with: it would hold memory until the session ends).
test('load: a checkpoint refused at one tensor keeps none of the others', async () => {
  const http = await import('node:http');
  const head = Buffer.from(JSON.stringify({
    a: { dtype: 'F32', shape: [2, 4], data_offsets: [0, 32] },
    b: { dtype: 'F32', shape: [2, 3], data_offsets: [32, 56] },
    c: { dtype: 'F32', shape: [2, 4], data_offsets: [56, 88] } }));
  const len = Buffer.alloc(8);
  len.writeBigUInt64LE(BigInt(head.length));
  const body = Buffer.concat([len, head, Buffer.alloc(88)]);
  const srv = http.createServer((req, res) => {
    const m = /bytes=(\d+)-(\d+)/.exec(req.headers.range ?? '');
    const [a, b] = m ? [Number(m[1]), Math.min(Number(m[2]), body.length - 1)] : [0, body.length - 1];
    res.writeHead(m ? 206 : 200, { 'Content-Length': b - a + 1, 'Accept-Ranges': 'bytes',
      ...(m ? { 'Content-Range': `bytes ${a}-${b}/${body.length}` } : {}) });
    res.end(req.method === 'HEAD' ? undefined : body.subarray(a, b + 1));
  });
  await new Promise((resolve) => srv.listen(0, '127.0.0.1', resolve));
  const s = await connect(addr, { clientName: 'node-load-partial' });
  try {
    const mesh = await s.createMesh({ gpu: 2 });
    const live = async () => {
      await s.sync();
      const r = await s.unary('ListSessions', {});
      return Number(r.sessions.find((x) => x.session_id === s.id).live_tensors);
    };
    const before = await live();
    await assert.rejects(s.load(mesh, `http://127.0.0.1:${srv.address().port}/m.safetensors`,
      { shard: 'gpu', dim: 1 }), (err) => err.kind === 'BAD_ARGUMENT' && /split evenly/.test(err.message));
    assert.equal(await live(), before, 'tensors of the refused load are still held');
  } finally {
    await s.close();
    srv.close();
  }
});

// review-99: what load() takes as Python's meshd.load does. A .npy file holds one
// tensor without a name: name= is refused, not ignored (a typo'd name loaded the file's
// tensor); a negative dim counts from the end; a many-tensor load refused at one tensor
// names it.
test('load: name= of a .npy file is refused, a negative dim counts from the end, a refused tensor is named', async () => {
  const http = await import('node:http');
  const head = Buffer.from(JSON.stringify({
    a: { dtype: 'F32', shape: [2, 4], data_offsets: [0, 32] },
    oddone: { dtype: 'F32', shape: [3, 4], data_offsets: [32, 80] } }));
  const len = Buffer.alloc(8);
  len.writeBigUInt64LE(BigInt(head.length));
  const files = { '/x.npy': npyBuffer(), '/m.safetensors': Buffer.concat([len, head, Buffer.alloc(80)]) };
  const srv = http.createServer((req, res) => {
    const body = files[req.url.split('?')[0]];
    if (!body) { res.writeHead(404, { 'Content-Length': 0 }); res.end(); return; }
    const m = /bytes=(\d+)-(\d+)/.exec(req.headers.range ?? '');
    const [a, b] = m ? [Number(m[1]), Math.min(Number(m[2]), body.length - 1)] : [0, body.length - 1];
    res.writeHead(m ? 206 : 200, { 'Content-Length': b - a + 1, 'Accept-Ranges': 'bytes',
      ...(m ? { 'Content-Range': `bytes ${a}-${b}/${body.length}` } : {}) });
    res.end(req.method === 'HEAD' ? undefined : body.subarray(a, b + 1));
  });
  await new Promise((resolve) => srv.listen(0, '127.0.0.1', resolve));
  const base = `http://127.0.0.1:${srv.address().port}`;
  const s = await connect(addr, { clientName: 'node-load-args' });
  try {
    const mesh = await s.createMesh({ gpu: 2 });
    await assert.rejects(s.load(mesh, `${base}/x.npy`, { name: 'w' }), (err) =>
      err.kind === 'BAD_ARGUMENT' && /\.npy/.test(err.message));
    const t = await s.load(mesh, `${base}/x.npy`, { shard: 'gpu', dim: -1 });
    assert.deepEqual(t.shape, [2, 2]);
    assert.deepEqual([...await s.fetch(t, { gpu: 1 })], [2, 3, 6, 7]);
    // raw bytes: the file's 160 bytes as float32 [2, 20], rows split (its last 8: the data)
    const r = await s.load(mesh, `${base}/x.npy`, { dtype: 'DTYPE_FLOAT32', shape: [2, 20], shard: 'gpu', dim: -2 });
    assert.deepEqual(r.shape, [1, 20]);
    assert.deepEqual([...await s.fetch(r, { gpu: 1 })].slice(12), [0, 1, 2, 3, 4, 5, 6, 7]);
    await assert.rejects(s.load(mesh, `${base}/m.safetensors`, { shard: 'gpu', dim: 0 }), (err) =>
      err.kind === 'BAD_ARGUMENT' && /split evenly/.test(err.message) && /'oddone'/.test(err.message));
  } finally {
    await s.close();
    srv.close();
  }
});

// A raw load (dtype and shape) over 2 ranks of a file rewritten between the ranks'
// requests: rank 1's stream runs a 2 s op first (MESHD_FAULT), so rank 0 has read the
// file, whose first GET turns it into version 2 (range_http_server.py /versioned/), before
// rank 1 looks at it. Each rank checked only its own look: rank 0 held version 1, rank 1
// version 2, and no error said so. The load now carries the version InspectUrl saw.
test('load: raw bytes pin one version of the file for every rank', async () => {
  const slow = await startMeshd({ name: 'versions', ready: 'serving',
    env: { MESHD_FAULT: 'call:slow=2000,rank=1,count=1' } });
  const http = await startRangeServer();
  const s = await connect(slow.addr, { clientName: 'node-load-version' });
  try {
    const mesh = await s.createMesh({ gpu: 2 });
    const x = await s.factory({ kind: 'zeros', mesh, shape: [4] });
    await s.call('mul', [x, 3]); // held 2 s on rank 1
    const n = 4096;
    const t = await s.load(mesh, `${http.base}/versioned/raw/etag/1/${n}`, { dtype: 'DTYPE_UINT8', shape: [n] });
    const got = [];
    try {
      for (const gpu of [0, 1]) got.push(Buffer.from(await s.fetch(t, { gpu })));
    } catch (e) {
      assert.ok(e instanceof MeshdError, String(e));
      assert.match(e.message, /changed/);
      return;
    }
    assert.ok(got[0].equals(got[1]), 'rank 0 and rank 1 loaded different versions of one file with no error');
  } finally {
    await s.close();
    await http.stop();
    await slow.stop();
  }
});

test('an unknown op throws a MeshdError with kind UNKNOWN_OP', async () => {
  const s = await connect(addr, { clientName: 'node-test' });
  try {
    const mesh = await s.createMesh({ gpu: 2 });
    const x = await s.factory({ kind: 'ones', mesh: mesh.ref, shape: [2] });
    await assert.rejects(s.call('no_such_op', [x]), (err) => {
      assert.ok(err instanceof MeshdError, String(err));
      assert.equal(err.kind, 'UNKNOWN_OP', err.message);
      return true;
    });
    // the session still works afterwards
    const v = await s.fetch(x, { gpu: 1 });
    assert.ok(v instanceof Float32Array);
    assert.deepEqual([...v], [1, 1]);
  } finally {
    await s.close();
  }
});

test('factory takes a MeshMeta, and a list of tensors goes as a tensor list (cat)', async () => {
  const s = await connect(addr, { clientName: 'node-test' });
  try {
    const mesh = await s.createMesh({ gpu: 2 });
    const a = await s.factory({ kind: 'ones', mesh, shape: [2] });
    const b = await s.factory({ kind: 'full', mesh, shape: [1], value: 3 });
    assert.equal(a.mesh, mesh.ref);
    const c = await s.call('cat', [[a, b]]);
    assert.deepEqual([...c.shape], [3]);
    assert.deepEqual([...(await s.fetch(c, { gpu: 1 }))], [1, 1, 3]);
  } finally {
    await s.close();
  }
});

test('setPipeline: calls issued together share Submit messages, each settles with its own answer', async () => {
  const s = await connect(addr, { clientName: 'node-pipeline' });
  try {
    const mesh = await s.createMesh({ gpu: 2 });
    await assert.rejects(s.setPipeline({ maxBatch: 0 }), /maxBatch must be an integer in 1\.\.4096, got 0/);
    await s.setPipeline({ maxBatch: 64 });
    const x = await s.factory({ kind: 'ones', mesh, shape: [2] });
    // A chain of 150 adds issued before any is awaited (each names the last one's ref),
    // with an unknown op in the middle: it alone is refused, and the chain goes on.
    const calls = [];
    let prev = { ref: x.ref };
    for (let i = 0; i < 150; i++) {
      if (i === 75) calls.push(s.call('no_such_op', [prev]));
      calls.push(s.call('add', [prev, 1]));
      prev = { ref: s.nextRef };
    }
    const settled = await Promise.allSettled(calls);
    const refused = settled.filter((r) => r.status === 'rejected');
    assert.equal(refused.length, 1, refused.map((r) => String(r.reason)).join('\n'));
    assert.equal(refused[0].reason.kind, 'UNKNOWN_OP', String(refused[0].reason));
    assert.equal(settled[75].status, 'rejected', 'the refused one is the 76th issued');
    await s.sync();
    const stats = s.pipelineStats();
    assert.ok(stats.commands >= 152, JSON.stringify(stats));
    assert.ok(stats.messages <= 8 && stats.messages * 10 < stats.commands, `not batched: ${JSON.stringify(stats)}`);
    // fetch waits for every answer, then reads the chain's end: 1 + 150
    assert.deepEqual([...await s.fetch(prev.ref, { gpu: 1 })], [151, 151]);
    await s.setPipeline(null);
    assert.equal(s.pipelineStats(), null);
    const y = await s.call('mul', [prev, 2]); // unary Execute again
    assert.deepEqual([...await s.fetch(y, { gpu: 0 })], [302, 302]);
  } finally {
    await s.close();
  }
});
