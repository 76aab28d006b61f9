// The Node client's data path (docs/protocol.md, Direct data path) against three real
// `meshd --local-agents 2`: --data-path=direct (the proxied Upload and Fetch are refused, so
// every byte that arrives went straight between this process and the agents),
// --data-path=proxy (auto uses the proxy; direct fails), and cluster mTLS on the agents'
// port (this client, without a cluster certificate, goes straight to them over TLS; an
// agent that does not answer: auto falls back, direct fails naming the rank).
//
// MESHD_BIN_DIR (set by ctest) locates meshd; else <source>/build/bin.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import net from 'node:net';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { agentPid as agentChild } from '../test-lib/agents.mjs';
import { sourceDir, startMeshd, stopAll } from '../test-lib/meshd.mjs';
import { connect, grpc, MeshdError } from '../meshd.mjs';

let work;
const servers = {}; // name -> startMeshd's handle ({ proc, pid, addr, log, ... })
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// meshd --local-agents 2 with args (and MESHD_* variables in extraEnv); resolves once
// both agents are healthy.
async function start(name, args, extraEnv = {}) {
  servers[name] = await startMeshd({ name, work, args, env: extraEnv, connectOpts: { token: '' } });
}

// A port nothing listens on, below the kernel's ephemeral range (no port-0 bind lands on
// it meanwhile), for a process this file starts (as meshd_testlib.free_port).
async function freePort() {
  const lo = Number(readFileSync('/proc/sys/net/ipv4/ip_local_port_range', 'utf8').trim().split(/\s+/)[0]);
  for (let i = 0; i < 200; i += 1) {
    const port = Math.max(1024, lo - 12000) + Math.floor(Math.random() * Math.min(12000, lo - 1024));
    const free = await new Promise((resolve) => {
      const srv = net.createServer().once('error', () => resolve(false));
      srv.listen(port, '127.0.0.1', () => srv.close(() => resolve(true)));
    });
    if (free) return port;
  }
  throw new Error('no free port');
}
let receiptsMetrics; // the 'receipts' server's agent's /metrics port

before(async () => {
  work = mkdtempSync(path.join(tmpdir(), 'meshd-node-direct-'));
  receiptsMetrics = await freePort();
  const pki = path.join(work, 'pki');
  execFileSync('bash', [path.join(sourceDir, 'tests', 'support', 'make_certs.sh'), pki], { stdio: 'ignore' });
  const f = (n) => path.join(pki, n);
  await Promise.all([
    start('direct', ['--data-path=direct']),
    start('proxy', ['--data-path=proxy']),
    start('old', [], { MESHD_FAULT: 'hello:old,rank=1' }), // rank 1: a build before Literal
    start('mtls', ['--cluster-ca', f('cluster-ca.pem'), '--cluster-cert', f('cluster.pem'),
      '--cluster-key', f('cluster.key'), '--cluster-listen', '127.0.0.1:0', '--agent-timeout', '10']),
    start('late', ['--data-path=direct', '--transfer-grant-start-ms', '200']),
    // each agent: 2 grants a minute, all of them one session's (unset, its share is a quarter)
    start('nonces', [], { MESHD_MAX_TRANSFER_NONCES: '2', MESHD_MAX_TRANSFER_NONCES_PER_SESSION: '2' }),
    startMeshd({ name: 'receipts', work, agents: 1, connectOpts: { token: '' },
      args: ['--local-agent-metrics-port-base', String(receiptsMetrics)] }).then((m) => { servers.receipts = m; }),
  ]);
});

after(async () => {
  try {
    await stopAll(); // only the meshd this file started (their agents go with them)
  } finally {
    if (work) rmSync(work, { recursive: true, force: true });
  }
});

const open = (name, dataPath) => connect(servers[name].addr, { clientName: 'node-direct', token: '', dataPath });

// A per-rank upload of `each` bytes a rank onto a gpu=2 mesh, both ranks fetched back
// at once and compared byte for byte.
async function roundTrip(s, mesh, each, seed) {
  const data = new Uint8Array(2 * each);
  for (let i = 0; i < data.length; i += 1) data[i] = ((i * 2654435761 + seed * 40503) >>> 13) & 0xff;
  const t = await s.upload(mesh, [each], data, { perRank: true });
  assert.deepEqual(t.shape, [each]);
  const [r0, r1] = await Promise.all([s.fetch(t, { gpu: 0 }), s.fetch(t, { gpu: 1 })]);
  assert.ok(r0 instanceof Uint8Array && r1 instanceof Uint8Array);
  assert.ok(Buffer.from(r0).equals(Buffer.from(data.subarray(0, each))), "rank 0's bytes differ");
  assert.ok(Buffer.from(r1).equals(Buffer.from(data.subarray(each))), "rank 1's bytes differ");
  return t;
}

test('--data-path=direct: sharded bytes go straight to and from both agents, never through the server', async () => {
  const s = await open('direct', 'auto');
  try {
    const mesh = await s.createMesh({ gpu: 2 });
    await roundTrip(s, mesh, (2 << 20) + 12, 1); // several messages each way
    assert.deepEqual(s.transferStats, {
      directUploads: 1, directFetches: 2, proxyUploads: 0, proxyFetches: 0, fallbacks: 0, lastFallback: '',
    });
    // replicated, computed on the agents, fetched as float32
    const x = await s.upload(mesh, [2, 3], new Float32Array([0, 1, 2, 3, 4, 5]));
    const y = await s.call('add', [x, 0.5]);
    assert.deepEqual([...await s.fetch(y, { gpu: 1 })], [0.5, 1.5, 2.5, 3.5, 4.5, 5.5]);
    // the server refuses to carry bytes: a forced proxy fails, the session goes on
    s.setDataPath('proxy');
    await assert.rejects(s.fetch(x, { gpu: 0 }), (err) => {
      assert.ok(err instanceof MeshdError, String(err));
      assert.match(err.message, /--data-path is direct/);
      return true;
    });
    s.setDataPath('direct');
    await roundTrip(s, mesh, 100, 2);
    assert.throws(() => s.setDataPath('fast'), /dataPath must be one of auto, direct, proxy/);
  } finally {
    await s.close();
  }
});

test('direct: a fetch hands its Read\'s receipt to FinishFetch, and its agent runs no DropSnapshot', async () => {
  const s = await open('receipts', 'direct');
  try {
    const mesh = await s.createMesh({ gpu: 1 });
    const x = await s.upload(mesh, [4], new Float32Array([1, 2, 3, 4]));
    const ran = async () => { // instructions the agent ran, once it ran all it was sent
      await s.sync();
      const text = await (await fetch(`http://127.0.0.1:${receiptsMetrics}/metrics`)).text();
      return Number(text.split('\n').find((l) => l.startsWith('meshd_agent_instructions_total ')).split(' ')[1]);
    };
    const syncs = -(await ran()) + (await ran()); // what a sync itself sends
    const n = await ran();
    for (let i = 0; i < 2; i += 1) assert.deepEqual([...await s.fetch(x, { gpu: 0 })], [1, 2, 3, 4]);
    assert.equal(await ran() - n, 2 + syncs, 'a DropSnapshot went with the receipt (2 Snapshots expected)');
  } finally {
    await s.close();
  }
});

test('unary PlanTransfer: the 64-bit transfer_id comes back exact, and FinishUpload finds its plan', async () => {
  const s = await open('direct', 'auto');
  try {
    const mesh = await s.createMesh({ gpu: 2 });
    const plan = await s.unary('PlanTransfer', {
      upload: { ref: s.newRef(), mesh: mesh.ref, shape: [4], dtype: 'DTYPE_FLOAT32', total_bytes: 16 },
    });
    assert.match(plan.transfer_id, /^[0-9]+$/, String(plan.transfer_id)); // a Number rounded past 2^53
    // No receipts: the plan is found, and refused for its missing Writes (undone)...
    await assert.rejects(s.unary('FinishUpload', { transfer_id: plan.transfer_id, receipts: [] }),
      (err) => { assert.doesNotMatch(err.message, /no pending upload/); return true; });
    // ...after which it is gone.
    await assert.rejects(s.unary('FinishUpload', { transfer_id: plan.transfer_id, receipts: [] }),
      /no pending upload/);
  } finally {
    await s.close();
  }
});

// Wraps s.client's FinishUpload: each call goes to the server as it is, and fate(n, err,
// reply) (n: 1 for the first call) answers the caller in its place; the receipts' count of
// each call is pushed to the returned list (0: the upload was abandoned).
function wrapFinishUpload(s, fate) {
  const real = s.client.FinishUpload;
  const calls = [];
  s.client.FinishUpload = function (request, md, opts, cb) {
    const n = calls.push(request.receipts?.length ?? 0);
    return real.call(this, request, md, opts, (err, reply) => fate(n, err, reply, cb));
  };
  return calls;
}
const rpcError = (code, details) => Object.assign(new Error(details), { code, details, metadata: new grpc.Metadata() });

test('direct: a FinishUpload whose answer was lost is asked once more: the upload returns the tensor the server defined', async () => {
  const s = await open('direct', 'direct');
  try {
    const mesh = await s.createMesh({ gpu: 2 });
    const data = new Float32Array([1.5, -2, 3, 4.25, 5, 6]);
    // the first call finishes the upload on the server; its answer is lost
    let calls = wrapFinishUpload(s, (n, err, reply, cb) => (n === 1 && !err
      ? cb(rpcError(grpc.status.DEADLINE_EXCEEDED, 'Deadline exceeded (test: answer lost)')) : cb(err, reply)));
    const t = await s.upload(mesh, [2, 3], data);
    assert.deepEqual(calls, [2, 2]); // asked once more, with the same receipts
    delete s.client.FinishUpload;
    assert.deepEqual(t.shape, [2, 3]);
    for (const gpu of [0, 1]) assert.deepEqual([...await s.fetch(t, { gpu })], [...data]);
    assert.equal(s.transferStats.directUploads, 1);

    // no answer to either: abandoned (FinishUpload without receipts), the first error thrown
    calls = wrapFinishUpload(s, (n, err, reply, cb) => (n <= 2
      ? cb(rpcError(grpc.status.UNAVAILABLE, `test: answer ${n} lost`)) : cb(err, reply)));
    await assert.rejects(s.upload(mesh, [2, 3], data), (e) => {
      assert.ok(e instanceof MeshdError);
      assert.equal(e.kind, 'UNAVAILABLE', e.message);
      assert.match(e.message, /test: answer 1 lost/);
      return true;
    });
    assert.deepEqual(calls, [2, 2, 0]);
    delete s.client.FinishUpload;

    // the same, the first call having finished the upload on the server and the abandon's
    // answer (the same FinishUploadReply, its tensor) coming back: that tensor is dropped,
    // not left defined behind the caller's back
    const ref = s.nextRef + 1; // the upload's (the direct plan claims its header's ref)
    calls = wrapFinishUpload(s, (n, err, reply, cb) => {
      if (n === 1) assert.equal(err, null, 'the first FinishUpload finishes the upload');
      if (n === 3) assert.equal(Number(reply?.tensor?.ref), ref, 'the abandon is answered with the tensor');
      return n <= 2 ? cb(rpcError(grpc.status.DEADLINE_EXCEEDED, `test: answer ${n} lost`)) : cb(err, reply);
    });
    await assert.rejects(s.upload(mesh, [2, 3], data), (e) => {
      assert.equal(e.kind, 'DEADLINE_EXCEEDED', e.message);
      assert.match(e.message, /test: answer 1 lost/);
      return true;
    });
    assert.deepEqual(calls, [2, 2, 0]);
    delete s.client.FinishUpload;
    const [gone] = (await s.execute({ describe: { ref } })).tensors;
    assert.equal(gone.state, 'TENSOR_STATE_DROPPED', JSON.stringify(gone));
    assert.match(gone.error.message, /dropped at command seq/);

    // another error the second time (the transfer failed, or was undone): that one, not abandoned
    calls = wrapFinishUpload(s, (n, err, reply, cb) => cb(n === 1
      ? rpcError(grpc.status.DEADLINE_EXCEEDED, 'test: answer lost')
      : rpcError(grpc.status.NOT_FOUND, 'test: tensor dropped since')));
    await assert.rejects(s.upload(mesh, [2, 3], data), (e) => {
      assert.equal(e.kind, 'NOT_FOUND', e.message);
      assert.match(e.message, /test: tensor dropped since/);
      return true;
    });
    assert.deepEqual(calls, [2, 2]);
    delete s.client.FinishUpload;
    assert.equal(s.transferStats.directUploads, 1);
  } finally {
    await s.close();
  }
});

test('calls issued together reach the server in ref order: uploads, Execute and the pipeline, both paths', async () => {
  // Refs are taken in issue order and must arrive strictly increasing. Before the
  // session sent its ref-claiming calls in turn, these raced on separate gRPC calls:
  // about 1 unary factory in 17, and half of the uploads, were refused REF_REUSED.
  for (const name of ['direct', 'proxy']) {
    for (const pipelined of [false, true]) {
      const s = await open(name, 'auto');
      try {
        if (pipelined) await s.setPipeline();
        const mesh = await s.createMesh({ gpu: 2 });
        const base = await s.factory({ mesh, kind: 'full', shape: [4], value: 1 });
        for (let round = 0; round < 4; round += 1) {
          const big = new Float32Array(1 << 20).fill(round + 2);
          const calls = [s.upload(mesh, [big.length], big)]; // left running while the rest are issued
          for (let i = 0; i < 6; i += 1) calls.push(s.call('add', [base, i]));
          calls.push(s.upload(mesh, [3], new Float32Array([round, round, round])));
          for (let i = 0; i < 6; i += 1) calls.push(s.factory({ mesh, kind: 'full', shape: [2], value: i }));
          const got = await Promise.allSettled(calls);
          const refused = got.filter((r) => r.status === 'rejected').map((r) => r.reason.message);
          assert.deepEqual(refused, [], `${name}, pipelined ${pipelined}, round ${round}`);
          const t = got.map((r) => r.value);
          const refs = t.map((x) => Number(x.ref));
          assert.deepEqual([...refs].sort((a, b) => a - b), refs, 'refs in issue order');
          assert.equal((await s.fetch(t[0], { gpu: 1 }))[12345], round + 2);
          assert.deepEqual([...await s.fetch(t[3], { gpu: 0 })], [3, 3, 3, 3]);
          assert.deepEqual([...await s.fetch(t[7], { gpu: 1 })], [round, round, round]);
          assert.deepEqual([...await s.fetch(t[13], { gpu: 0 })], [5, 5]);
        }
      } finally {
        await s.close();
      }
    }
  }
});

test('--data-path=proxy: auto uses the proxy (reason recorded), direct fails with the refusal', async () => {
  const s = await open('proxy', 'auto');
  try {
    const mesh = await s.createMesh({ gpu: 2 });
    await roundTrip(s, mesh, 70000, 3);
    const st = s.transferStats;
    assert.equal(st.directUploads + st.directFetches, 0);
    assert.equal(st.proxyUploads, 1);
    assert.equal(st.proxyFetches, 2);
    assert.match(st.lastFallback, /--data-path is proxy/);
    s.setDataPath('direct');
    await assert.rejects(s.upload(mesh, [1], new Float32Array([1])), (err) => {
      assert.equal(err.kind, 'FAILED_PRECONDITION', err.message);
      assert.match(err.message, /--data-path is proxy/);
      return true;
    });
  } finally {
    await s.close();
  }
});

// The meshd-agent child of server `name` started with --rank rank (from /proc).
const agentPid = (name, rank) => agentChild(servers[name].pid, rank);

test('cluster mTLS: straight to the agents over TLS; an agent that does not answer: auto falls back, direct names the rank', async () => {
  const s = await open('mtls', 'auto');
  let stopped = 0;
  try {
    const mesh = await s.createMesh({ gpu: 2 });
    await roundTrip(s, mesh, 3000, 4);
    assert.deepEqual(s.transferStats, {
      directUploads: 1, directFetches: 2, proxyUploads: 0, proxyFetches: 0, fallbacks: 0, lastFallback: '',
    });
    // A new session (no agent connections yet) while rank 1's agent is stopped: its
    // port accepts, no handshake follows. Resumed well after the 1 s wait, for the proxy
    // (at 2 s a loaded CI machine's handshakes, each agent's in turn, outlasted the stop:
    // the connection succeeded and the transfers went direct).
    const s2 = await open('mtls', 'auto');
    try {
      const mesh2 = await s2.createMesh({ gpu: 2 });
      stopped = agentPid('mtls', 1);
      process.kill(stopped, 'SIGSTOP');
      const resume = setTimeout(() => { process.kill(stopped, 'SIGCONT'); stopped = 0; }, 4000);
      try {
        await roundTrip(s2, mesh2, 3000, 5);
      } finally {
        clearTimeout(resume);
        if (stopped) { process.kill(stopped, 'SIGCONT'); stopped = 0; }
      }
      const st = s2.transferStats;
      assert.equal(st.directUploads + st.directFetches, 0, JSON.stringify(st));
      assert.equal(st.proxyUploads, 1);
      assert.equal(st.proxyFetches, 2);
      assert.match(st.lastFallback, /rank 1's agent at 127\.0\.0\.1:\d+ does not answer within 1000 ms|did not connect/);
      const t0 = Date.now();
      await roundTrip(s2, mesh2, 10, 6); // not tried again for a while: no connection wait
      assert.ok(Date.now() - t0 < 900, `took ${Date.now() - t0} ms`);
    } finally {
      await s2.close();
    }
    const s3 = await open('mtls', 'direct');
    try {
      const mesh3 = await s3.createMesh({ gpu: 2 });
      stopped = agentPid('mtls', 1);
      process.kill(stopped, 'SIGSTOP');
      await assert.rejects(s3.upload(mesh3, [1], new Float32Array([1])), (err) => {
        assert.equal(err.kind, 'UNAVAILABLE', err.message);
        assert.match(err.message, /direct upload: rank 1's agent at 127\.0\.0\.1:\d+ does not answer within 1000 ms/);
        return true;
      });
    } finally {
      if (stopped) { process.kill(stopped, 'SIGCONT'); stopped = 0; }
      await s3.close();
    }
    s.setDataPath('proxy');
    await roundTrip(s, mesh, 10, 7);
  } finally {
    if (stopped) process.kill(stopped, 'SIGCONT');
    await s.close();
  }
});

test('auto: an agent whose connection fails at once with under DIRECT_CONNECT_MS left is no deadline: the proxy takes the transfer', async () => {
  const s = await open('old', 'auto'); // (rank 1 predates Literal: no matter for upload and fetch)
  const real = grpc.credentials.createInsecure;
  try {
    const mesh = await s.createMesh({ gpu: 2 });
    const data = new Float32Array([1.5, 2, 3]);
    // This session's agent channels (made on first use) speak TLS to the agents' plaintext
    // ports: every connection attempt fails at once, as to a port that refuses.
    grpc.credentials.createInsecure = () => grpc.credentials.createSsl();
    s.timeoutMs = 800; // less than the 1 s an agent gets to connect
    const t0 = Date.now();
    const t = await s.upload(mesh, [3], data);
    assert.deepEqual([...await s.fetch(t, { gpu: 1 })], [...data]);
    assert.ok(Date.now() - t0 < 800, `took ${Date.now() - t0} ms`);
    const st = s.transferStats;
    assert.equal(st.directUploads + st.directFetches, 0, JSON.stringify(st));
    assert.equal(st.proxyUploads, 1, JSON.stringify(st));
    assert.equal(st.proxyFetches, 1, JSON.stringify(st));
    assert.match(st.lastFallback, /agent did not connect|rank \d's agent at 127\.0\.0\.1:\d+ does not answer/);
    // direct: the agent's failure (UNAVAILABLE naming its rank), not a deadline that has not passed
    s.setDataPath('direct');
    await assert.rejects(s.fetch(t, { gpu: 0 }), (e) => {
      assert.equal(e.kind, 'UNAVAILABLE', e.message);
      assert.match(e.message, /direct fetch: rank 0's agent at 127\.0\.0\.1:\d+ does not answer/);
      return true;
    });
  } finally {
    grpc.credentials.createInsecure = real;
    s.timeoutMs = 60000;
    await s.close();
  }
});

test('direct: an agent killed mid-upload fails it with AGENT_LOST naming the rank; the session goes on', async () => {
  const s = await open('direct', 'direct');
  const mesh = async () => { // rank 1's replacement may still be registering
    const until = Date.now() + 30000;
    for (;;) {
      try { return await s.createMesh({ gpu: 2 }); } catch (e) {
        if (Date.now() > until) throw e;
        await sleep(50);
      }
    }
  };
  try {
    const each = 48 << 20; // far past what the sockets buffer: the kill lands mid-write
    const data = new Uint8Array(2 * each).fill(9);
    let err;
    for (let attempt = 0; attempt < 5 && !err?.message.includes('direct upload, rank 1'); attempt += 1) {
      const m = await mesh();
      const pid = agentPid('direct', 1);
      const up = s.upload(m, [each], data, { perRank: true });
      setTimeout(() => process.kill(pid, 'SIGKILL'), 20 + 30 * attempt);
      err = await up.then(() => undefined, (e) => e);
    }
    assert.ok(err, 'every upload finished before its agent was killed');
    assert.equal(err.kind, 'AGENT_LOST', err.message);
    assert.match(err.message, /direct upload, rank 1 \(agent 127\.0\.0\.1:\d+\): the connection to its agent broke \(.+\): the agent died or cannot be reached/);
    const m = await mesh(); // the session goes on, on the replacement
    const t = await s.upload(m, [3], new Float32Array([1, 2, 3]));
    assert.deepEqual([...await s.fetch(t, { gpu: 1 })], [1, 2, 3]);
  } finally {
    await s.close();
  }
});

test('literal: a command, not an upload: exact per rank, pipelined in bounded messages, over the bounds a RangeError', async () => {
  const s = await open('proxy', 'auto');
  try {
    assert.equal(s.literals, true, 'the server lists the literal feature');
    const mesh = await s.createMesh({ gpu: 2 });
    assert.equal(mesh.literals, true);
    const x = await s.literal(mesh, [3], new Float32Array([1.5, -2, 3.25]));
    const y = await s.literal(mesh, [2], new BigInt64Array([10n, -11n, 1n << 40n, 21n]), { perRank: true });
    assert.deepEqual([...await s.fetch(x, { gpu: 1 })], [1.5, -2, 3.25]);
    assert.deepEqual([...await s.fetch(y, { gpu: 0 })], [10n, -11n]);
    assert.deepEqual([...await s.fetch(y, { gpu: 1 })], [1n << 40n, 21n]);
    assert.equal(s.transferStats.proxyUploads + s.transferStats.directUploads, 0, 'a literal went as an upload');
    await assert.rejects(s.literal(mesh, [5], new Float32Array(3)), (err) => {
      assert.equal(err.kind, 'BAD_ARGUMENT');
      assert.match(err.message, /Literal: 12 bytes of data/);
      return true;
    });
    await assert.rejects(s.literal(mesh, [(1 << 20) + 1], new Uint8Array((1 << 20) + 1)),
      /more than a Literal carries .*upload\(\) them/);

    // Pipelined: a message ends before 1 MiB of Literal data, and before its Literals
    // send 8 MiB to the agents (here a MeshMeta that counts 9 ranks: 4.5 MB each).
    await s.setPipeline({ maxBatch: 256 });
    const big = (seed, n) => Uint8Array.from({ length: n }, (_, i) => (i * 31 + seed) & 0xff);
    const a = big(1, 600000), b = big(2, 600000);
    const ts = await Promise.all([s.literal(mesh, [a.length], a), s.literal(mesh, [b.length], b)]);
    assert.equal(s.pipelineStats().messages, 2, 'two 600 kB Literals went in one message');
    const c = await s.call('add', [ts[1], 1]);
    const nine = { ...mesh, ranks: [0, 1, 0, 1, 0, 1, 0, 1, 0] };
    const d = big(3, 500000), e = big(4, 500000);
    const us = await Promise.all([s.literal(nine, [d.length], d), s.literal(nine, [e.length], e)]);
    assert.equal(s.pipelineStats().messages, 5, 'two Literals sending 9 MB went in one message');
    await s.sync();
    assert.ok(Buffer.from(await s.fetch(ts[0], { gpu: 1 })).equals(Buffer.from(a)));
    const got = await s.fetch(c, { gpu: 0 });
    assert.equal(got.length, b.length);
    assert.ok(got.every((v, i) => v === b[i] + 1), 'add(b, 1) differs');
    assert.ok(Buffer.from(await s.fetch(us[1], { gpu: 1 })).equals(Buffer.from(e)));
    await assert.rejects(s.literal(nine, [1000000], new Uint8Array(1000000)), /9000000 to the mesh's ranks/);
    assert.equal(s.transferStats.proxyUploads + s.transferStats.directUploads, 0, 'a literal went as an upload');
  } finally {
    await s.close();
  }
});

test('literal: a mesh with an agent older than Literal (MESHD_FAULT=hello:old) gets an upload; its slice without it a command', async () => {
  const s = await open('old', 'proxy');
  try {
    const mesh = await s.createMesh({ gpu: 2 });
    assert.equal(mesh.literals, false, 'a mesh with an older agent says it runs Literals');
    const x = await s.literal(mesh, [4], new Int32Array([1, -2, 3, 1 << 30]));
    assert.equal(s.transferStats.proxyUploads, 1);
    assert.deepEqual([...await s.fetch(x, { gpu: 1 })], [1, -2, 3, 1 << 30]);
    // by its ref alone: the session knows the mesh, so no Literal is tried (and refused)
    const x2 = await s.literal(mesh.ref, [1], new Int32Array([7]));
    assert.equal(s.transferStats.proxyUploads, 2);
    assert.equal(s.literals, true, 'a Literal was tried on the mesh and refused');
    assert.deepEqual([...await s.fetch(x2, { gpu: 0 })], [7]);
    const m0 = await s.sliceMesh(mesh, { gpu: 0 });
    assert.equal(m0.literals, true);
    const y = await s.literal(m0, [2], new Float64Array([0.25, -8]));
    assert.equal(s.transferStats.proxyUploads, 2, "rank 0's slice got an upload");
    assert.deepEqual([...await s.fetch(y, {})], [0.25, -8]);
  } finally {
    await s.close();
  }
});

test('fetch waits for the calls issued before it, unary and pipelined; later ones wait for its plan only', async () => {
  for (const name of ['proxy', 'direct']) {
    const s = await open(name, 'auto');
    try {
      const mesh = await s.createMesh({ gpu: 2 });
      const x = await s.factory({ kind: 'zeros', mesh, shape: [4] });
      for (const piped of [false, true]) {
        if (piped) await s.setPipeline({ maxBatch: 256 });
        for (let i = 1; i <= 20; i += 1) {
          s.call('add_', [x, 1]); // not awaited: the fetch issued next must see it
          const got = await s.fetch(x, { gpu: i % 2 });
          const want = piped ? 20 + i : i;
          assert.deepEqual([...got], [want, want, want, want], `${name}, ${piped ? 'pipelined' : 'unary'}, round ${i}`);
        }
      }
      // issued after the fetch: not seen by it
      const before = s.fetch(x, { gpu: 0 });
      const later = s.call('add_', [x, 100]);
      assert.deepEqual([...await before], [40, 40, 40, 40]);
      await later;
      await s.sync();
    } finally {
      await s.close();
    }
  }
});

test('fetch: float16 and bfloat16 come as a Uint16Array of their raw bits, both paths', async () => {
  for (const name of ['direct', 'proxy']) {
    const s = await open(name, 'auto');
    try {
      const mesh = await s.createMesh({ gpu: 2 });
      for (const [dtype, bits] of [['DTYPE_FLOAT16', [0x3c00, 0xc000]], ['DTYPE_BFLOAT16', [0x3f80, 0xc000]]]) {
        const one = await s.factory({ kind: 'ones', mesh, shape: [2, 1], dtype });
        const two = await s.factory({ kind: 'full', mesh, shape: [1], dtype, value: -2 });
        for (const [t, want] of [[one, [bits[0], bits[0]]], [two, [bits[1]]]]) {
          const v = await s.fetch(t, { gpu: 1 });
          assert.ok(v instanceof Uint16Array, `${name} ${dtype}: ${v.constructor.name}`);
          assert.equal(v.dtype, dtype);
          assert.deepEqual(v.shape, t.shape);
          assert.deepEqual([...v], want, `${name} ${dtype}`);
        }
      }
      const st = s.transferStats;
      assert.equal(name === 'direct' ? st.directFetches : st.proxyFetches, 4, JSON.stringify(st));
    } finally {
      await s.close();
    }
  }
});

test('a pipelined sync that timed out hands its errors to the next sync', async () => {
  const s = await open('proxy', 'proxy');
  try {
    const mesh = await s.createMesh({ gpu: 2 });
    const x = await s.literal(mesh, [3], new Float32Array([1, 2, 3]));
    const idx = await s.literal(mesh, [1], new BigInt64Array([5n])); // out of range: fails on the agents
    await s.setPipeline({ maxBatch: 256 });
    await s.call('index_select', [x, { i: 0 }, idx]);
    const told = [];
    for (const opts of [{ timeoutMs: 1 }, {}]) {
      try {
        await s.sync(opts);
      } catch (e) {
        told.push(e.kind);
      }
    }
    assert.equal(told.filter((k) => k === 'REMOTE_FAILURE').length, 1, `reported: ${told}`);
  } finally {
    await s.close();
  }
});

test('pipelined messages stay under the server message size whatever the commands', async () => {
  const s = await open('proxy', 'proxy');
  try {
    const mesh = await s.createMesh({ gpu: 2 });
    await s.setPipeline({ maxBatch: 4096 });
    const refs = Array.from({ length: 4000 }, (_, i) => 1e12 + i); // none live: skipped
    const answers = await Promise.all(Array.from({ length: 300 }, () => s.execute({ release: { refs } })));
    assert.equal(answers.length, 300);
    assert.ok(s.pipelineStats().messages >= 12, `${s.pipelineStats().messages} messages for ~12 MB`);
    const y = await s.factory({ kind: 'ones', mesh, shape: [2] });
    assert.deepEqual([...await s.fetch(y, { gpu: 1 })], [1, 1]);
  } finally {
    await s.close();
  }
});

test('proxy: an Upload whose answer was lost lets go of the tensor the server defined', async () => {
  // The server defines the tensor; the answer is lost (a deadline, a dropped connection),
  // so the caller gets an error and no ref. The client releases the ref: the tensor stood,
  // its bytes held on every rank, until the session closed.
  const s = await open('proxy', 'proxy');
  try {
    const mesh = await s.createMesh({ gpu: 2 });
    const live = async () => {
      const { sessions } = await s.unary('ListSessions', {});
      return Number(sessions.find((r) => r.session_id === s.id).live_tensors);
    };
    const before = await live();
    const real = s.client.Upload;
    s.client.Upload = function (md, opts, cb) {
      return real.call(this, md, opts, (err, reply) => cb(err ?? rpcError(grpc.status.DEADLINE_EXCEEDED,
        'Deadline exceeded (test: answer lost)'), err ? reply : undefined));
    };
    await assert.rejects(s.upload(mesh, [2, 3], new Float32Array(6)), (e) => {
      assert.equal(e.kind, 'DEADLINE_EXCEEDED', e.message);
      return true;
    });
    delete s.client.Upload;
    await s.sync();
    assert.equal(await live(), before, 'the tensor the lost answer defined is still live');
  } finally {
    await s.close();
  }
});

test('direct: more fetches waiting on one agent than it keeps (64) all succeed: its QUOTA refusal is retried', async () => {
  // 9 sessions each fetch a value still being computed 8 times at once (--session-max-transfers):
  // 72 Reads wait for their seq on rank 0, past the 64 an agent lets wait. The agent refuses the
  // rest RESOURCE_EXHAUSTED "64 Reads already wait for seqs" and keeps their grants; the client
  // retries that refusal until the fetch's deadline (it failed the user's fetch before).
  const nsess = 9; const nfetch = 8;
  // rank 0's first 9 op calls (each session's add_) run 4 s: the fetches wait for them
  const m = await startMeshd({ name: 'reads-full', work, agents: 1, args: ['--data-path=direct'],
    env: { MESHD_FAULT: `call:slow=4000,rank=0,count=${nsess}` }, connectOpts: { token: '' } });
  const sessions = [];
  try {
    for (let i = 0; i < nsess; i += 1) {
      sessions.push(await connect(m.addr, { clientName: 'node-reads-full', token: '', dataPath: 'direct', timeoutMs: 60000 }));
    }
    const xs = [];
    for (const s of sessions) {
      const mesh = await s.createMesh({ gpu: 1 });
      const x = await s.factory({ kind: 'zeros', mesh, shape: [16] });
      xs.push(x);
    }
    const all = sessions.map((s, i) => {
      s.call('add_', [xs[i], 3]); // not awaited: slow on the agent, the fetches wait for it
      return Promise.allSettled(Array.from({ length: nfetch }, () => s.fetch(xs[i], { gpu: 0 })));
    });
    const results = (await Promise.all(all)).flat();
    const failed = results.filter((r) => r.status === 'rejected').map((r) => r.reason?.message ?? String(r.reason));
    assert.deepEqual(failed, [], `${failed.length} of ${results.length} fetches failed: ${failed.slice(0, 2).join(' | ')}`);
    for (const r of results) assert.deepEqual([...r.value], Array(16).fill(3));
  } finally {
    await Promise.allSettled(sessions.map((s) => s.close()));
    await m.stop();
  }
});

// The C client's test hook (MESHD_TEST_DIRECT_DELAY_MS): this process waits 400 ms after
// each PlanTransfer answer, past the 200 ms its grants must start within.
const LATE = /^PERMISSION_DENIED: the transfer's grant expired before it started \(the client was paused after its plan, an agent's clock was stepped, or, with an older server or agent, the clocks differ by more than --transfer-grant-start-ms\); call again \(direct (upload|fetch), rank \d \(agent 127\.0\.0\.1:\d+\): transfer grant refused: expired/;

test('direct: a transfer paused past its grants\' start-by time is planned once more; paused again, it says so', async () => {
  const s = await open('late', 'direct');
  try {
    const mesh = await s.createMesh({ gpu: 2 });
    process.env.MESHD_TEST_DIRECT_DELAY_MS = '400,once'; // the first plan of each transfer only
    const t = await roundTrip(s, mesh, 100, 8); // was PERMISSION_DENIED "transfer grant refused: expired"
    assert.deepEqual(s.transferStats, {
      directUploads: 1, directFetches: 2, proxyUploads: 0, proxyFetches: 0, fallbacks: 0, lastFallback: '',
    });
    process.env.MESHD_TEST_DIRECT_DELAY_MS = '400'; // every plan: the new one is late too
    for (const go of [() => s.fetch(t, { gpu: 1 }), () => s.upload(mesh, [2], new Float32Array([1, 2]))]) {
      await assert.rejects(go(), (err) => {
        assert.ok(err instanceof MeshdError, String(err));
        assert.equal(err.kind, 'PERMISSION_DENIED', err.message);
        assert.match(err.message, LATE);
        return true;
      });
    }
    delete process.env.MESHD_TEST_DIRECT_DELAY_MS;
    await roundTrip(s, mesh, 100, 9); // every plan's slot and ref came back
    await s.sync();
  } finally {
    delete process.env.MESHD_TEST_DIRECT_DELAY_MS;
    await s.close();
  }
});

test('direct: a fetch whose grant came too late is not planned again once a later command may have changed the value', async () => {
  const s = await open('late', 'direct');
  try {
    const mesh = await s.createMesh({ gpu: 2 });
    const x = await s.upload(mesh, [2], new Float32Array([1, 2]));
    process.env.MESHD_TEST_DIRECT_DELAY_MS = '400,once';
    const got = s.fetch(x, { gpu: 0 });
    const later = s.call('add', [x, 1]); // issued while the fetch waits for its late Read
    await assert.rejects(got, (err) => { assert.match(err.message, LATE); return true; });
    delete process.env.MESHD_TEST_DIRECT_DELAY_MS;
    assert.deepEqual([...await s.fetch(await later, { gpu: 0 })], [2, 3]);
  } finally {
    delete process.env.MESHD_TEST_DIRECT_DELAY_MS;
    await s.close();
  }
});

test('an agent whose grant table is full (--max-transfer-nonces): auto takes the proxy for that transfer, direct says so', async () => {
  const s = await open('nonces', 'auto');
  try {
    const mesh = await s.createMesh({ gpu: 2 });
    const u = await s.upload(mesh, [3], new Float32Array([1, 2, 3])); // a grant on each agent
    assert.deepEqual([...await s.fetch(u, { gpu: 0 })], [1, 2, 3]); // rank 0's second: its table is full
    assert.deepEqual([...await s.fetch(u, { gpu: 0 })], [1, 2, 3]); // was RESOURCE_EXHAUSTED
    const v = await s.upload(mesh, [2], new Float32Array([4, 5])); // rank 0 refuses, rank 1's last
    assert.deepEqual([...await s.fetch(v, { gpu: 1 })], [4, 5]);
    const st = s.transferStats;
    assert.deepEqual([st.directUploads, st.directFetches, st.proxyUploads, st.proxyFetches, st.fallbacks],
      [1, 1, 1, 2, 3], JSON.stringify(st));
    assert.match(st.lastFallback, /direct fetch, rank 1 \(agent 127\.0\.0\.1:\d+\): the agent has too many transfers in flight \(its --max-transfer-nonces table is full\)/);
    s.setDataPath('direct');
    for (const go of [() => s.fetch(u, { gpu: 1 }), () => s.upload(mesh, [1], new Float32Array([6]))]) {
      await assert.rejects(go(), (err) => {
        assert.ok(err instanceof MeshdError, String(err));
        assert.equal(err.code, grpc.status.RESOURCE_EXHAUSTED, err.message);
        assert.match(err.message, /direct (fetch|upload), rank \d \(agent 127\.0\.0\.1:\d+\): the agent has too many transfers in flight \(its --max-transfer-nonces table is full\); retry later, or use the proxied path/);
        return true;
      });
    }
    s.setDataPath('proxy');
    await roundTrip(s, mesh, 10, 10);
    await s.sync();
  } finally {
    await s.close();
  }
});
