// The Node client against a fake meshd and fake agents (in-process grpc-js servers on
// 127.0.0.1:0 speaking tensor_service.proto and agent.proto): what it does with replies
// and failures a real server seldom gives on cue: a shard that fails at once, a plan
// naming no shard or a unix: address, a Fetch whose bytes do not match its shape,
// float16 and unknown dtypes, close() while a direct fetch reads, calls after close(),
// one deadline for a whole upload, a keepalive restarted. No meshd needed.
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { createRequire } from 'node:module';
import path from 'node:path';
import v8 from 'node:v8';
import vm from 'node:vm';
import { connect, grpc, MeshdError, protoPath } from '../meshd.mjs';

const require = createRequire(import.meta.url);
const protoLoader = require('@grpc/proto-loader');

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const OPTS = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true };
const tensorProto = protoPath();
const apiRoot = path.resolve(path.dirname(tensorProto), '..', '..');
const TensorService = grpc.loadPackageDefinition(protoLoader.loadSync(tensorProto, OPTS)).meshd.v1.TensorService.service;
const Agent = grpc.loadPackageDefinition(protoLoader.loadSync(path.join(apiRoot, 'meshd', 'agent', 'v1', 'agent.proto'),
  { ...OPTS, includeDirs: [apiRoot] })).meshd.agent.v1.Agent.service;

const servers = [];
after(() => { for (const s of servers) s.forceShutdown(); });

// A grpc-js server of `service` with the handlers in impl; resolves to its host:port.
async function serve(service, impl) {
  const server = new grpc.Server();
  server.addService(service, impl);
  servers.push(server);
  const port = await new Promise((resolve, reject) => server.bindAsync('127.0.0.1:0',
    grpc.ServerCredentials.createInsecure(), (e, p) => (e ? reject(e) : resolve(p))));
  return `127.0.0.1:${port}`;
}

// A fake meshd: sessions, KeepAlive, CloseSession, and `impl` for the rest (a missing
// RPC is UNIMPLEMENTED); `log` names every RPC it got, in order, and `got` each request.
async function fakeMeshd(impl = {}, { ttl = 300 } = {}) {
  const log = [];
  const got = {};
  const unimplemented = (c, cb) => cb({ code: grpc.status.UNIMPLEMENTED, details: 'fake' });
  const handlers = {};
  for (const [name, def] of Object.entries(TensorService)) {
    const h = impl[name] ?? {
      CreateSession: (c, cb) => cb(null, { session_id: 's1', token: 't', ttl_seconds: ttl, features: ['literal'] }),
      CloseSession: (c, cb) => cb(null, {}),
      KeepAlive: (c, cb) => cb(null, { ttl_seconds: ttl }),
    }[name] ?? unimplemented;
    handlers[name] = (call, cb) => {
      log.push(name);
      if (!def.requestStream) (got[name] ??= []).push(call.request);
      return h(call, cb);
    };
  }
  const addr = await serve(TensorService, handlers);
  return { addr, log, got, count: (name) => log.filter((n) => n === name).length };
}

// Each session's refs are its own (a bare ref it did not hand out is refused): one(s) is
// a ref s handed out at open, which the fake servers take for any tensor or mesh.
const firstRefs = new WeakMap();
const one = (s) => firstRefs.get(s);
const open = async (addr, opts = {}) => {
  const s = await connect(addr, { token: '', clientName: 'node-fake', ...opts });
  firstRefs.set(s, s.newRef());
  return s;
};
const plan = (shards, meta = null) => ({ transfer_id: '18446744073709551615', shards, meta,
  expiry_unix_ms: String(Date.now() + 600000) });
const shard = (rank, address, extra = {}) => ({ rank, address, grant: Buffer.from([rank]), ...extra });
const f32meta = (n) => ({ ref: 1, shape: [n], dtype: 'DTYPE_FLOAT32', strides: [1] });

test('direct upload: a shard that fails at once stops the others and undoes the plan at once, naming its rank', async () => {
  let cancelled = false;
  let t0;
  let finishAt;
  const a = await serve(Agent, { Write: (call, cb) => {
    call.on('data', () => {});
    setTimeout(() => cb({ code: grpc.status.RESOURCE_EXHAUSTED, details: 'out of memory' }), 10);
  } });
  const b = await serve(Agent, { Write: (call) => { // never answers
    call.on('data', () => {});
    call.on('cancelled', () => { cancelled = true; });
  } });
  const m = await fakeMeshd({
    PlanTransfer: (c, cb) => cb(null, plan([shard(0, a), shard(1, b)])),
    FinishUpload: (c, cb) => { finishAt = Date.now() - t0; cb(null, { tensor: null }); },
  });
  const s = await open(m.addr, { dataPath: 'direct', timeoutMs: 4000 });
  try {
    t0 = Date.now();
    await assert.rejects(s.upload(one(s), [4], new Float32Array(4)), (err) => {
      assert.ok(err instanceof MeshdError, String(err));
      assert.equal(err.kind, 'RESOURCE_EXHAUSTED', err.message);
      assert.match(err.message, /direct upload, rank 0 \(agent 127\.0\.0\.1:\d+\): out of memory/);
      return true;
    });
    const took = Date.now() - t0;
    assert.ok(took < 1500, `upload rejected after ${took} ms of a 4000 ms deadline`);
    assert.ok(finishAt !== undefined && finishAt < 1500, `FinishUpload sent at ${finishAt} ms`);
    assert.deepEqual(m.got.FinishUpload.map((r) => r.receipts), [[]]);
    for (let i = 0; i < 50 && !cancelled; i += 1) await sleep(20);
    assert.ok(cancelled, "rank 1's Write was not cancelled");
  } finally {
    await s.close();
  }
});

test('close() waits for a direct fetch in flight: its bytes arrive, FinishFetch before CloseSession', async () => {
  let reading;
  const readStarted = new Promise((resolve) => { reading = resolve; });
  const agent = await serve(Agent, { Read: (call) => {
    reading();
    call.write({ data: Buffer.from(new Float32Array([1, 2]).buffer) });
    setTimeout(() => {
      call.write({ data: Buffer.from(new Float32Array([3, 4]).buffer) });
      call.end();
    }, 400);
  } });
  const m = await fakeMeshd({
    PlanTransfer: (c, cb) => cb(null, plan([shard(0, agent, { after_seq: '7' })], f32meta(4))),
    FinishFetch: (c, cb) => cb(null, {}),
  });
  const s = await open(m.addr, { dataPath: 'direct', timeoutMs: 5000 });
  const fetched = s.fetch(one(s), { gpu: 0 });
  await readStarted;
  await s.close();
  const v = await fetched;
  assert.ok(v instanceof Float32Array);
  assert.deepEqual([...v], [1, 2, 3, 4]);
  assert.deepEqual(m.log.filter((n) => n !== 'KeepAlive'),
    ['CreateSession', 'PlanTransfer', 'FinishFetch', 'CloseSession']);
});

test('once close() is called, awaited or not, every call rejects NO_SESSION (UNAUTHENTICATED) unsent', async () => {
  const m = await fakeMeshd({ Execute: (c, cb) => cb(null, { seq: c.request.seq }) });
  const s = await open(m.addr, { timeoutMs: 5000 });
  const calls = () => [
    s.execute({ sync: {} }), s.call('add', [1, 2]), s.fetch(one(s), {}), s.upload(one(s), [1], new Float32Array(1)),
    s.literal(one(s), [1], new Float32Array(1)), s.inspectUrl('http://127.0.0.1:1/x.npy'),
    s.unary('KeepAlive', {}), s.setPipeline({}),
  ];
  const check = async (what) => {
    const rs = await Promise.allSettled(calls());
    rs.forEach((r, i) => {
      assert.equal(r.status, 'rejected', `${what}: call ${i} went through`);
      assert.ok(r.reason instanceof MeshdError, `${what}: call ${i}: ${r.reason}`);
      assert.equal(r.reason.kind, 'NO_SESSION', `${what}: call ${i}: ${r.reason.message}`);
      assert.equal(r.reason.code, grpc.status.UNAUTHENTICATED, `${what}: call ${i}: code ${r.reason.code}`);
    });
  };
  await s.execute({ sync: {} }); // the one call that goes
  const closing = s.close(); // not awaited
  await check('during close()');
  await closing;
  await check('after close()');
  await s.close(); // again: nothing
  assert.deepEqual(m.log.filter((n) => n !== 'KeepAlive'), ['CreateSession', 'Execute', 'CloseSession']);
});

test('agents() follows ListAgents\' pages; pages that do not end reject INTERNAL, not a loop', async () => {
  const agents = [0, 1, 2, 3, 4].map((rank) => ({ rank, address: `127.0.0.1:${9000 + rank}`, healthy: true }));
  let mode = 'pages';
  const m = await fakeMeshd({
    ListAgents: ({ request: r }, cb) => {
      if (mode === 'repeat') return cb(null, { agents: agents.slice(0, 1), next_page_token: '1.00000000' });
      if (mode === 'empty') return cb(null, { agents: [], next_page_token: '7.00000000' });
      const from = r.page_token ? Number(r.page_token.split('.')[0]) : 0;
      const page = agents.filter((a) => a.rank >= from).slice(0, r.page_size || 2);
      const more = page.length && page[page.length - 1].rank < 4;
      return cb(null, { agents: page, agent_tls: { ca_pem: 'PEM', server_name: 'agents' },
        next_page_token: more ? `${page[page.length - 1].rank + 1}.00000000` : '' });
    },
  });
  const s = await open(m.addr, { timeoutMs: 5000 });
  try {
    const got = await s.agents();
    assert.deepEqual(got.agents.map((a) => a.rank), [0, 1, 2, 3, 4]);
    assert.equal(got.agent_tls.server_name, 'agents');
    assert.deepEqual(m.got.ListAgents.map((r) => r.page_token), ['', '2.00000000', '4.00000000']);
    assert.deepEqual((await s.agents({ pageSize: 4 })).agents.map((a) => a.rank), [0, 1, 2, 3, 4]);
    for (const [how, says] of [['repeat', 'the same next_page_token again'], ['empty', 'an empty page with a next_page_token']]) {
      mode = how;
      await assert.rejects(s.agents(), (e) => e instanceof MeshdError && e.kind === 'INTERNAL'
        && e.message.includes("ListAgents: the server's pages do not end") && e.message.includes(says));
    }
  } finally {
    await s.close();
  }
});

test('upload() and literal() reject bad data (a TypeError), never throw at the call', async () => {
  const m = await fakeMeshd();
  const s = await open(m.addr, { timeoutMs: 5000 });
  for (const [name, go] of [['upload', () => s.upload(one(s), [2], [1, 2])], ['literal', () => s.literal(one(s), [2], 'ab')],
    ['upload', () => s.upload(undefined, [2], new Float32Array(2))]]) {
    let p;
    assert.doesNotThrow(() => { p = go(); }, `${name} threw at the call`);
    await assert.rejects(p, TypeError, `${name} did not reject a TypeError`);
  }
  await s.close();
  assert.deepEqual(m.log.filter((n) => n !== 'KeepAlive'), ['CreateSession', 'CloseSession']);
});

test('a pipelined call that close() leaves unanswered rejects NO_SESSION with code UNAUTHENTICATED', async () => {
  const m = await fakeMeshd({ Submit: (call) => { call.on('data', () => {}); } }); // never answers
  const s = await open(m.addr, { timeoutMs: 300 });
  await s.setPipeline();
  const waiting = s.call('add', [1, 2], {}, { timeoutMs: 5000 }).then(() => null, (e) => e);
  await assert.rejects(s.close(), /close: 1 pipelined command\(s\) sent before it/);
  const err = await waiting;
  assert.equal(err?.kind, 'NO_SESSION', String(err));
  assert.equal(err.code, grpc.status.UNAUTHENTICATED, err.message);
});

test('fetch: float16 and bfloat16 are a Uint16Array of the raw bits; an unknown dtype rejects UNIMPLEMENTED at once', async () => {
  let dtype = 'DTYPE_FLOAT16';
  let cancelled = false;
  const agent = await serve(Agent, { Read: (call) => {
    call.write({ data: Buffer.from(new Uint16Array([0x3c00, 0xc000]).buffer) });
    call.end();
  } });
  const m = await fakeMeshd({
    Fetch: (call) => {
      call.write({ meta: { ref: 1, shape: [2], dtype, strides: [1] } });
      const later = setTimeout(() => { // the bytes come late: an unknown dtype rejects before them
        call.write({ data: Buffer.from(new Uint16Array([0x3f80, 0x4000]).buffer) });
        call.end();
      }, dtype === 'DTYPE_UNSPECIFIED' ? 3000 : 0);
      call.on('cancelled', () => { cancelled = true; clearTimeout(later); });
    },
    PlanTransfer: (c, cb) => cb(null, plan([shard(0, agent)], { ref: 1, shape: [2], dtype, strides: [1] })),
    FinishFetch: (c, cb) => cb(null, {}),
  });
  for (const dataPath of ['proxy', 'direct']) {
    const s = await open(m.addr, { dataPath, timeoutMs: 5000 });
    try {
      for (dtype of ['DTYPE_FLOAT16', 'DTYPE_BFLOAT16']) {
        const v = await s.fetch(one(s), { gpu: 0 });
        assert.ok(v instanceof Uint16Array, `${dataPath} ${dtype}: ${v?.constructor?.name}`);
        assert.equal(v.dtype, dtype);
        assert.deepEqual(v.shape, [2]);
        assert.deepEqual([...v], dataPath === 'proxy' ? [0x3f80, 0x4000] : [0x3c00, 0xc000]);
      }
      dtype = 'DTYPE_UNSPECIFIED';
      const t0 = Date.now();
      const finishes = m.count('FinishFetch');
      await assert.rejects(s.fetch(one(s), { gpu: 0 }), (err) => {
        assert.ok(err instanceof MeshdError, String(err));
        assert.equal(err.kind, 'UNIMPLEMENTED', err.message);
        assert.match(err.message, /no typed array for DTYPE_UNSPECIFIED/);
        return true;
      });
      assert.ok(Date.now() - t0 < 2000, `took ${Date.now() - t0} ms`);
      if (dataPath === 'direct') assert.equal(m.count('FinishFetch'), finishes + 1, 'the plan was not given back');
    } finally {
      await s.close();
    }
  }
  assert.ok(cancelled, 'the proxied Fetch of an unknown dtype was not cancelled');
});

test('proxy fetch: bytes that are not what the shape needs reject INTERNAL', async () => {
  let mode;
  const m = await fakeMeshd({ Fetch: (call) => {
    if (mode !== 'none') call.write({ meta: f32meta(4) });
    if (mode === 'short') call.write({ data: Buffer.alloc(8) });
    if (mode === 'long') { call.write({ data: Buffer.alloc(12) }); call.write({ data: Buffer.alloc(8) }); }
    if (mode === 'exact') { call.write({ data: Buffer.alloc(8, 0) }); call.write({ data: Buffer.alloc(8, 0) }); }
    call.end();
  } });
  const s = await open(m.addr, { dataPath: 'proxy', timeoutMs: 5000 });
  try {
    for (const [m2, re] of [['short', /got 8 bytes where shape \[4\] of DTYPE_FLOAT32 needs 16/],
      ['long', /more bytes than shape \[4\] of DTYPE_FLOAT32 holds \(16\)/], ['none', /without a TensorMeta/]]) {
      mode = m2;
      await assert.rejects(s.fetch(one(s), {}), (err) => {
        assert.ok(err instanceof MeshdError, `${m2}: ${err}`);
        assert.equal(err.kind, 'INTERNAL', err.message);
        assert.match(err.message, re);
        return true;
      });
    }
    mode = 'exact';
    const v = await s.fetch(one(s), {});
    assert.deepEqual([...v], [0, 0, 0, 0]);
    assert.deepEqual(v.shape, [4]);
  } finally {
    await s.close();
  }
});

test("unary('PlanTransfer'): transfer_id and after_seq are decimal strings, every other integer a number", async () => {
  const m = await fakeMeshd({
    PlanTransfer: (c, cb) => cb(null, plan([shard(3, '127.0.0.1:1', { after_seq: '9007199254740993' })], {
      ref: '12', shape: ['2', '3'], dtype: 'DTYPE_FLOAT32', strides: ['3', '1'], mesh: '4', stream: '5',
      storage_offset: '6', error: { kind: 'ERROR_KIND_QUOTA', message: 'x', code: 8, seq: '7', ref: '12' },
    })),
  });
  const s = await open(m.addr);
  try {
    const p = await s.unary('PlanTransfer', { fetch: { ref: 12, coords: [] } });
    assert.equal(p.transfer_id, '18446744073709551615');
    assert.equal(p.shards[0].after_seq, '9007199254740993');
    assert.equal(p.shards[0].rank, 3);
    assert.equal(typeof p.expiry_unix_ms, 'number');
    assert.ok(p.expiry_unix_ms > Date.now());
    const { ref, shape, strides, mesh, stream, storage_offset: offset, error } = p.meta;
    assert.deepEqual({ ref, shape, strides, mesh, stream, offset, seq: error.seq, eref: error.ref },
      { ref: 12, shape: [2, 3], strides: [3, 1], mesh: 4, stream: 5, offset: 6, seq: 7, eref: 12 });
  } finally {
    await s.close();
  }
});

// A fake meshd whose plans follow fake.mode: 'unix' and 'scheme' name addresses that are
// not host:port, 'none' no shard, 'refused' a port nothing listens on, else a fake agent
// (whose Writes succeed; FinishUpload answers no tensor). Its proxied Fetch and Upload work.
async function planFake() {
  const fake = { mode: '' };
  const agent = await serve(Agent, { Write: (call, cb) => {
    call.on('data', () => {});
    call.on('end', () => cb(null, { bytes: 4, receipt: Buffer.from([1]) }));
  } });
  const addresses = { unix: 'unix:/nonexistent/meshd-node-evil.sock', scheme: 'unix:50051', refused: '127.0.0.1:1' };
  fake.m = await fakeMeshd({
    PlanTransfer: (c, cb) => {
      const meta = c.request.fetch ? f32meta(1) : null;
      cb(null, plan(fake.mode === 'none' ? [] : [shard(0, addresses[fake.mode] ?? agent)], meta));
    },
    FinishFetch: (c, cb) => cb(null, {}),
    FinishUpload: (c, cb) => cb(null, { tensor: null }),
    Fetch: (call) => { call.write({ meta: f32meta(1) }); call.write({ data: Buffer.alloc(4) }); call.end(); },
    Upload: (call, cb) => { call.on('data', () => {}); call.on('end', () => cb(null, { tensor: { ref: 9, shape: [1] } })); },
  });
  fake.finishes = () => fake.m.count('FinishFetch') + fake.m.count('FinishUpload');
  return fake;
}

test('a plan naming an address that is not host:port: direct refuses to dial it, auto takes the proxy', async () => {
  const fake = await planFake();
  const s = await open(fake.m.addr, { dataPath: 'direct', timeoutMs: 5000 });
  try {
    for (fake.mode of ['unix', 'scheme']) {
      const finishes = fake.finishes();
      await assert.rejects(s.fetch(one(s), {}), (err) => {
        assert.equal(err.kind, 'UNAVAILABLE', err.message);
        assert.match(err.message, /as the agent of rank 0, not host:port; refusing to dial it/);
        return true;
      });
      await assert.rejects(s.upload(one(s), [1], new Float32Array(1)), /not host:port; refusing to dial it/);
      assert.equal(fake.finishes(), finishes + 2, 'the plans were not given back');
    }
    s.setDataPath('auto');
    fake.mode = 'unix';
    assert.deepEqual([...await s.fetch(one(s), {})], [0]);
    assert.equal((await s.upload(one(s), [1], new Float32Array(1))).ref, 9);
    assert.match(s.transferStats.lastFallback, /"unix:\/nonexistent\/meshd-node-evil\.sock" as the agent of rank 0, not host:port/);
    assert.equal(s.transferStats.proxyFetches + s.transferStats.proxyUploads, 2);
  } finally {
    await s.close();
  }
});

test('a plan with no shard rejects INTERNAL and is given back', async () => {
  const fake = await planFake();
  fake.mode = 'none';
  const s = await open(fake.m.addr, { dataPath: 'direct', timeoutMs: 5000 });
  try {
    await assert.rejects(s.fetch(one(s), {}), (err) => {
      assert.ok(err instanceof MeshdError, String(err));
      assert.equal(err.kind, 'INTERNAL', err.message);
      assert.match(err.message, /the plan names 0 shards/);
      return true;
    });
    await assert.rejects(s.upload(one(s), [1], new Float32Array(1)), (err) => {
      assert.equal(err.kind, 'INTERNAL', err.message);
      assert.match(err.message, /direct upload: the plan names no shard/);
      return true;
    });
    assert.equal(fake.finishes(), 2);
  } finally {
    await s.close();
  }
});

test('a direct fetch whose agent does not answer abandons its plan once', async () => {
  const fake = await planFake();
  fake.mode = 'refused';
  const s = await open(fake.m.addr, { dataPath: 'direct', timeoutMs: 5000 });
  try {
    await assert.rejects(s.fetch(one(s), {}), /rank 0's agent at 127\.0\.0\.1:1 does not answer/);
    assert.equal(fake.m.count('FinishFetch'), 1, 'the plan was abandoned more than once');
  } finally {
    await s.close();
  }
});

test("a FinishUpload that answers no tensor rejects INTERNAL; 'direct' never takes the proxy", async () => {
  const fake = await planFake();
  const s = await open(fake.m.addr, { dataPath: 'direct', timeoutMs: 5000 });
  try {
    await assert.rejects(s.upload(one(s), [1], new Float32Array(1)), (err) => {
      assert.equal(err.kind, 'INTERNAL', err.message);
      assert.match(err.message, /FinishUpload answered no TensorMeta/);
      return true;
    });
    assert.equal(fake.m.count('Upload'), 0, "a 'direct' upload went through the server");
  } finally {
    await s.close();
  }
});

// A FinishUpload with no answer may have finished the upload all the same: it is asked
// once more (the server answers a finished upload's again), within the cleanup deadline
// (min(timeoutMs, 5 s)); no answer to that either, and the upload is undone (FinishUpload
// without receipts, the same deadline) and the first error thrown.
test('upload: one deadline for the plan, the Writes and FinishUpload; one with no answer is asked once more, then undone', async () => {
  const agent = await serve(Agent, { Write: (call, cb) => {
    call.on('data', () => {});
    call.on('end', () => cb(null, { bytes: 4, receipt: Buffer.from([1]) }));
  } });
  const finishes = []; // [ms since t0, receipts]
  let t0;
  const m = await fakeMeshd({
    PlanTransfer: (c, cb) => setTimeout(() => cb(null, plan([shard(0, agent)])), 500),
    FinishUpload: (c) => { finishes.push([Date.now() - t0, (c.request.receipts ?? []).length]); }, // never answers
  });
  const s = await open(m.addr, { dataPath: 'direct', timeoutMs: 1000 });
  try {
    t0 = Date.now();
    await assert.rejects(s.upload(one(s), [1], new Float32Array(1)), (err) => {
      assert.equal(err.kind, 'DEADLINE_EXCEEDED', err.message);
      return true;
    });
    const took = Date.now() - t0;
    assert.deepEqual(finishes.map(([, n]) => n), [1, 1, 0], JSON.stringify(finishes));
    const [[first], [again], [undo]] = finishes;
    assert.ok(first >= 450 && first < 900, `the first FinishUpload went at ${first} ms`);
    assert.ok(again >= 900 && again < 1400, `the second FinishUpload went at ${again} ms`);
    assert.ok(undo >= 1900 && undo < 2400, `the undoing FinishUpload went at ${undo} ms`);
    assert.ok(took >= 2900 && took < 3400, `a 1000 ms upload whose FinishUpload never answers took ${took} ms`);
  } finally {
    await s.close();
  }
});

// The proxied upload hands grpc-js every chunk at once (views of the caller's array,
// no copies), but grpc-js takes them one at a time: it serializes the next only when
// the HTTP/2 stream took the last, so against a server that stops reading the client
// holds about one serialized chunk (1 MiB) beyond the tensor, whatever its size.
test('proxy upload to a server that does not read holds about one chunk beyond the tensor, not a copy', async () => {
  v8.setFlagsFromString('--expose-gc');
  const gc = globalThis.gc ?? vm.runInNewContext('gc');
  let called = false;
  const m = await fakeMeshd({ Upload: () => { called = true; } }); // never reads, never answers
  const s = await open(m.addr, { dataPath: 'proxy', timeoutMs: 1500 });
  try {
    const data = new Float32Array(16 << 20).fill(1); // 64 MiB
    gc();
    const base = process.memoryUsage().arrayBuffers;
    const t0 = Date.now();
    const up = s.upload(one(s), [data.length], data);
    up.catch(() => {});
    await sleep(700);
    gc();
    const held = process.memoryUsage().arrayBuffers - base;
    assert.ok(called, 'the server got no Upload');
    assert.ok(held < (8 << 20), `${(held / 1048576).toFixed(1)} MiB held beyond a 64 MiB tensor`);
    await assert.rejects(up, (err) => {
      assert.equal(err.kind, 'DEADLINE_EXCEEDED', err.message);
      return true;
    });
    const took = Date.now() - t0;
    assert.ok(took >= 1400 && took < 2500, `a 1500 ms upload took ${took} ms`);
  } finally {
    await s.close();
  }
});

test('startKeepAlive() again replaces the timer: one KeepAlive a period, none after stopKeepAlive()', async () => {
  const m = await fakeMeshd({}, { ttl: 1 }); // a period of 333 ms
  const s = await open(m.addr);
  try {
    const period = s.keepAlivePeriodMs;
    s.startKeepAlive();
    s.startKeepAlive();
    await sleep(3.3 * period);
    const sent = m.count('KeepAlive');
    assert.ok(sent >= 2 && sent <= 4, `${sent} KeepAlives in ${3.3 * period} ms at one every ${period} ms`);
    s.stopKeepAlive();
    await sleep(1.4 * period);
    assert.equal(m.count('KeepAlive'), sent, 'KeepAlive sent after stopKeepAlive()');
  } finally {
    await s.close();
  }
});

// a proxied Upload that fails with no kind (its answer may be lost) is released
// from inside the upload's turn; with a pipeline on, that Release takes a seq above the
// one a call issued right after the upload already holds, and goes out on the Submit
// stream first: the server refuses the later call (its seq is not above the Release's).
test('a lost Upload answer released on a pipeline does not push the seq of a call issued after it below', async () => {
  const seqs = [];
  const m = await fakeMeshd({
    Upload: (call, cb) => { call.on('data', () => {}); call.on('end', () => cb({ code: grpc.status.UNAVAILABLE, details: 'dropped' })); },
    Submit: (call) => {
      let last = 0;
      call.on('data', (msg) => {
        for (const c of msg.batch?.length ? msg.batch : [msg]) {
          const seq = Number(c.seq);
          seqs.push([seq, Object.keys(c).find((k) => !['seq', 'batch'].includes(k) && c[k] !== null && c[k] !== undefined && (typeof c[k] !== 'object' || Object.keys(c[k]).length))]);
          const error = seq <= last ? { kind: 'ERROR_KIND_BAD_ARGUMENT', message: `seq ${seq} is not above ${last}`, code: 3, seq: String(seq) } : null;
          if (seq > last) last = seq;
          call.write({ result: { seq: String(seq), error, tensors: [{ ref: 1, shape: [1] }] } });
        }
      });
      call.on('end', () => call.end());
    },
  });
  const s = await open(m.addr, { dataPath: 'proxy', timeoutMs: 3000 });
  try {
    await s.setPipeline({});
    const up = s.upload(one(s), [1], new Float32Array([1])).then(() => null, (e) => e);
    const after = s.call('add', [{ ref: one(s) }, 1]).then(() => null, (e) => e);
    const upErr = await up;
    assert.ok(upErr instanceof MeshdError && upErr.kind === 'UNAVAILABLE', String(upErr));
    const callErr = await after;
    assert.equal(callErr, null, `the call issued after the upload was refused: ${callErr?.message} (seqs sent: ${JSON.stringify(seqs)})`);
  } finally {
    await s.close().catch(() => {});
  }
});

// the FinishFetch after a Read that ended with ~no time left fails
// DEADLINE_EXCEEDED on the client (here: the client's first FinishFetch is lost before it
// reaches the server). Nothing else ends the transfer: the session's transfer slot and the
// agent's snapshot stay held until the grant expires (10 min). Python ends it quietly then.
test('a direct fetch whose FinishFetch got no answer still ends the transfer', async () => {
  const agent = await serve(Agent, { Read: (call) => {
    call.write({ data: Buffer.from(new Float32Array([1]).buffer) });
    call.end();
  } });
  const m = await fakeMeshd({
    PlanTransfer: (c, cb) => cb(null, plan([shard(0, agent)], f32meta(1))),
    FinishFetch: (c, cb) => cb(null, {}),
  });
  const s = await open(m.addr, { dataPath: 'direct', timeoutMs: 5000 });
  const real = s.client.FinishFetch.bind(s.client);
  let lost = 0;
  s.client.FinishFetch = (req, md, opts, cb) => {
    if (lost++ === 0) { // the first one never reaches the server
      const err = Object.assign(new Error('Deadline exceeded'), { code: grpc.status.DEADLINE_EXCEEDED, details: 'Deadline exceeded', metadata: new grpc.Metadata() });
      setImmediate(() => cb(err));
      return undefined;
    }
    return real(req, md, opts, cb);
  };
  try {
    await assert.rejects(s.fetch(one(s), {}), (err) => err instanceof MeshdError && err.kind === 'DEADLINE_EXCEEDED');
    await sleep(100);
    assert.equal(m.count('FinishFetch'), 1, 'no FinishFetch reached the server: the slot and the snapshot stay held for the grant\'s 10 min');
  } finally {
    await s.close().catch(() => {});
  }
});

// inspectUrl (and load(), which calls it) takes its turn with no deadline and
// starts the session's timeoutMs only once its turn came: behind an upload that uses its
// whole timeoutMs, it rejects after twice the timeout (fetch, same case: once).
test('inspectUrl behind a stuck upload rejects within the session timeoutMs', async () => {
  const m = await fakeMeshd({
    Upload: (call) => { call.on('data', () => {}); }, // never answers
    InspectUrl: () => {}, // never answers
  });
  const s = await open(m.addr, { dataPath: 'proxy', timeoutMs: 600 });
  try {
    const up = s.upload(one(s), [1], new Float32Array([1])).catch((e) => e);
    const t0 = Date.now();
    const err = await s.inspectUrl('http://127.0.0.1:1/x.npy').then(() => null, (e) => e);
    const took = Date.now() - t0;
    await up;
    assert.ok(err instanceof MeshdError && err.kind === 'DEADLINE_EXCEEDED', String(err));
    assert.ok(took < 900, `inspectUrl with timeoutMs 600 rejected after ${took} ms`);
  } finally {
    await s.close().catch(() => {});
  }
});

// close() on a server that stops answering is bounded by one timeoutMs, as the C and
// Python clients' close (their CLOSE_LAST_TRY_MS): it took its turn with no deadline
// (behind uploads that each used a whole timeoutMs from their own turn) and then gave
// CloseSession a whole timeoutMs of its own: one timeout for each call before it, and one more.
test('close() behind stuck uploads, on a server that never answers CloseSession, takes one timeoutMs', async () => {
  const m = await fakeMeshd({
    Upload: (call) => { call.on('data', () => {}); }, // never answers
    CloseSession: () => {}, // never answers
  });
  const s = await open(m.addr, { dataPath: 'proxy', timeoutMs: 600 });
  // two: the second's turn (and its timeoutMs) starts when the first's ends
  const ups = [1, 2].map(() => s.upload(one(s), [1], new Float32Array([1])).catch((e) => e));
  const t0 = Date.now();
  const err = await s.close().then(() => null, (e) => e);
  const took = Date.now() - t0;
  await Promise.all(ups);
  assert.ok(err instanceof MeshdError && err.kind === 'DEADLINE_EXCEEDED', String(err));
  assert.ok(took < 1100, `close() with timeoutMs 600 settled after ${took} ms`); // 850 ms: 600, then CloseSession's 250
  assert.ok(s.closed);
});

// A call issued before close() whose turn comes only after close() gave up waiting for it
// (its turn cut at the session's timeoutMs) and closed the channel: it rejects NO_SESSION,
// as the doc of close() says, never grpc-js's plain "Channel has been shut down" Error.
test('calls whose turn comes after close() gave up on them reject NO_SESSION, not a grpc-js Error', async () => {
  const m = await fakeMeshd({
    Upload: (call) => { call.on('data', () => {}); }, // never answers
    CloseSession: () => {}, // never answers
  });
  const s = await open(m.addr, { dataPath: 'proxy', timeoutMs: 400 });
  // the first two hold the turn past close()'s deadline; the rest go after the channel closed
  const calls = [
    s.upload(one(s), [1], new Float32Array([1])),
    s.upload(one(s), [1], new Float32Array([1])),
    s.upload(one(s), [1], new Float32Array([1])),
    s.fetch(one(s), {}, { timeoutMs: 5000 }),
    s.setPipeline({}),
  ].map((p) => p.then(() => null, (e) => e));
  const err = await s.close().then(() => null, (e) => e);
  assert.ok(err instanceof MeshdError && err.kind === 'DEADLINE_EXCEEDED', String(err));
  const got = await Promise.all(calls);
  for (const [i, e] of got.entries()) assert.ok(e instanceof MeshdError, `call ${i}: ${e}`);
  for (const e of got.slice(2)) assert.equal(e.kind, 'NO_SESSION', String(e));
  assert.equal(m.count('Submit'), 0);
});

// A direct upload's plan must name every rank of the mesh once, in the mesh's order, one
// slice each (docs/protocol.md, Direct data path): one that does not (a shard too many or
// too few, a rank twice, ranks out of the mesh's order) is refused INTERNAL before any
// byte goes to an agent, and given back (FinishUpload without receipts).
test('a direct upload whose plan does not match the mesh ranks is refused before any byte moves', async () => {
  let writes = 0;
  const agent = await serve(Agent, { Write: (call, cb) => {
    writes += 1;
    call.on('data', () => {});
    call.on('end', () => cb(null, { bytes: 4, receipt: Buffer.from([1]) }));
  } });
  let shards = [];
  const m = await fakeMeshd({
    Execute: (c, cb) => cb(null, { seq: c.request.seq, mesh: { ref: c.request.create_mesh?.ref ?? 0,
      dims: [{ name: 'gpu', size: 2 }], ranks: [3, 5], literals: true } }),
    PlanTransfer: (c, cb) => cb(null, plan(shards)),
    FinishUpload: (c, cb) => cb(null, { tensor: null }),
  });
  const s = await open(m.addr, { dataPath: 'direct', timeoutMs: 4000 });
  try {
    const mesh = await s.createMesh({ gpu: 2 });
    assert.deepEqual(mesh.ranks, [3, 5]);
    const cases = [
      [[shard(3, agent), shard(5, agent), shard(7, agent)], true], // a shard too many
      [[shard(3, agent)], true], // too few: all the bytes to rank 3
      [[shard(3, agent), shard(3, agent)], true], // a rank twice, rank 5 skipped
      [[shard(5, agent), shard(3, agent)], true], // rank 3's rows to rank 5
      [[shard(5, agent), shard(3, agent)], false], // replicated: the ranks all the same
    ];
    for (const [i, [sh, perRank]] of cases.entries()) {
      shards = sh;
      const finishes = m.count('FinishUpload');
      await assert.rejects(s.upload(mesh, [2], new Float32Array(perRank ? 4 : 2), { perRank }), (err) => {
        assert.ok(err instanceof MeshdError, `case ${i}: ${err}`);
        assert.equal(err.kind, 'INTERNAL', `case ${i}: ${err.message}`);
        assert.match(err.message, /direct upload: the plan/, `case ${i}`);
        return true;
      });
      assert.equal(writes, 0, `case ${i}: bytes were sent on a plan that does not match the mesh`);
      assert.equal(m.count('FinishUpload'), finishes + 1, `case ${i}: the plan was not given back`);
    }
    // the mesh as a bare ref this session did not make a mesh with: the split is still checked
    const other = s.newRef();
    shards = [shard(0, agent), shard(1, agent), shard(2, agent)];
    await assert.rejects(s.upload(other, [2], new Float32Array(4), { perRank: true }), /direct upload: the plan/);
    shards = [shard(0, agent), shard(0, agent)];
    await assert.rejects(s.upload(other, [2], new Float32Array(4), { perRank: true }), /direct upload: the plan/);
    assert.equal(writes, 0, 'bytes were sent on a plan that does not match the mesh');
  } finally {
    await s.close();
  }
});

// close() gives up on an upload that holds its turn past the session's timeoutMs; the
// upload's agent channel, still connecting then, must not outlive the session: every
// agent channel the session opened is closed once close() returned (a long-lived
// process would keep one connection per such session).
test("an agent channel still connecting when close() gave up is closed, not kept", async () => {
  const net = await import('node:net');
  const agent = await serve(Agent, { Write: (call, cb) => {
    call.on('data', () => {});
    call.on('end', () => cb(null, { bytes: 4, receipt: Buffer.from([1]) }));
  } });
  const [host, port] = agent.split(':');
  const open_ = new Set(); // the client's connections to the slow agent, until they close
  const slow = net.createServer((sock) => { // passes a connection on to the agent 400 ms late
    open_.add(sock);
    sock.on('close', () => open_.delete(sock));
    sock.on('error', () => {});
    sock.pause();
    setTimeout(() => {
      if (sock.destroyed) return;
      const up = net.connect(Number(port), host, () => { sock.pipe(up); up.pipe(sock); sock.resume(); });
      up.on('error', () => sock.destroy());
      sock.on('close', () => up.destroy());
    }, 400);
  });
  await new Promise((resolve) => slow.listen(0, '127.0.0.1', resolve));
  const slowAddr = `127.0.0.1:${slow.address().port}`;
  let plans = 0;
  const m = await fakeMeshd({
    // the first plan never answers (its upload holds the turn for a whole timeoutMs)
    PlanTransfer: (c, cb) => { plans += 1; if (plans > 1) cb(null, plan([shard(0, slowAddr)])); },
    FinishUpload: (c, cb) => cb(null, { tensor: null }),
    CloseSession: () => {}, // never answers
  });
  const s = await open(m.addr, { dataPath: 'direct', timeoutMs: 600 });
  try {
    const ups = [1, 2].map(() => s.upload(one(s), [1], new Float32Array([1])).then(() => null, (e) => e));
    await s.close().catch(() => {}); // gives up at ~850 ms; the second upload dials from ~600 ms
    const got = await Promise.all(ups);
    for (const [i, e] of got.entries()) assert.ok(e instanceof MeshdError, `upload ${i}: ${e}`);
    assert.ok(plans === 2, `${plans} plans`);
    for (let i = 0; i < 100 && open_.size; i += 1) await sleep(20);
    assert.equal(open_.size, 0, 'the agent channel opened for the closed session is still connected');
  } finally {
    slow.close();
    for (const sock of open_) sock.destroy();
  }
});

// An agent over TLS whose certificate the plan's CA does not verify: the error says the
// TLS handshake failed, with the agent's address, not that the agent does not answer.
test('a direct transfer whose agent fails the TLS handshake says so, naming the address', async () => {
  const { execFileSync } = await import('node:child_process');
  const { mkdtempSync, readFileSync, rmSync } = await import('node:fs');
  const { tmpdir } = await import('node:os');
  const src = process.env.MESHD_SOURCE_DIR ?? path.resolve(path.dirname(tensorProto), '..', '..', '..');
  const pki = mkdtempSync(path.join(tmpdir(), 'meshd-node-tls-'));
  try {
    execFileSync('bash', [path.join(src, 'tests', 'support', 'make_certs.sh'), pki], { stdio: 'ignore' });
    const f = (n) => readFileSync(path.join(pki, n));
    const server = new grpc.Server();
    server.addService(Agent, { Write: (call, cb) => { call.on('data', () => {}); call.on('end', () => cb(null, { bytes: 4 })); } });
    servers.push(server);
    const port = await new Promise((resolve, reject) => server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createSsl(
      null, [{ cert_chain: f('cluster.pem'), private_key: f('cluster.key') }], false), (e, p) => (e ? reject(e) : resolve(p))));
    const agent = `127.0.0.1:${port}`;
    const m = await fakeMeshd({
      PlanTransfer: (c, cb) => cb(null, { ...plan([shard(0, agent)], c.request.fetch ? f32meta(1) : null),
        agent_tls: { ca_pem: f('rogue-ca.pem').toString(), server_name: 'meshd-cluster' } }),
      FinishUpload: (c, cb) => cb(null, { tensor: null }),
      FinishFetch: (c, cb) => cb(null, {}),
    });
    const s = await open(m.addr, { dataPath: 'direct', timeoutMs: 5000 });
    try {
      for (const call of [() => s.upload(one(s), [1], new Float32Array(1)), () => s.fetch(one(s), {})]) {
        await assert.rejects(call(), (err) => {
          assert.ok(err instanceof MeshdError, String(err));
          assert.equal(err.kind, 'UNAVAILABLE', err.message);
          assert.ok(err.message.includes(`TLS handshake with rank 0's agent at ${agent} failed`), err.message);
          assert.doesNotMatch(err.message, /does not answer/);
          return true;
        });
      }
    } finally {
      await s.close();
    }
  } finally {
    rmSync(pki, { recursive: true, force: true });
  }
});
