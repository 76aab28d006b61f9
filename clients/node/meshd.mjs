// A small meshd client for Node.js: @grpc/grpc-js with @grpc/proto-loader loading
// api/meshd/v1/tensor_service.proto at run time (no generated code).
//
// The proto is found at $MESHD_SOURCE_DIR/api/meshd/v1/tensor_service.proto when
// MESHD_SOURCE_DIR is set (ctest sets it; the build-tree copy of this file is not next
// to api/), else at ../../api/... relative to this file (the source tree), or at the
// path given as connect(addr, {protoPath}).
//
// 64-bit integers (refs, seqs, shapes; uint64/int64 in the proto) are plain JS Numbers
// (proto-loader `longs: Number`): seqs are counters this client hands out from 1, refs
// counters too, each session's from a span of its own (the n-th session a process opens
// numbers its refs from (n mod 9000) * 10^12 + 1, as the C client: the first 1, 2, ...,
// the second 1000000000001, ...), all below Number.MAX_SAFE_INTEGER (2^53 - 1).
// Enums are their names (`enums: String`): dtype "DTYPE_FLOAT32", kind "ERROR_KIND_...".
// fetch() gives a typed array by dtype: Float32Array, Float64Array, Int8Array, Uint8Array
// (uint8 and bool), Int16Array, Int32Array, BigInt64Array, and for float16 and bfloat16 a
// Uint16Array of the raw bits (JS has no such floats; decode them yourself). Another
// dtype rejects with a MeshdError (UNIMPLEMENTED) before any byte is read.
//
//   import { connect } from './meshd.mjs';
//   const s = await connect('127.0.0.1:50051');
//   const mesh = await s.createMesh({ gpu: 2 });
//   const x = await s.factory({ kind: 'full', mesh: mesh.ref, shape: [3], value: 2 });
//   const y = await s.call('add', [x, 1]);            // a tensor ref, a double
//   const z = await s.reduce(y, ['gpu'], 'sum');
//   const v = await s.fetch(z, { gpu: 0 });            // Float32Array
//   await s.sync({ timeoutMs: 5000 });                 // DEADLINE_EXCEEDED past 5 s
//   await s.close();
//
// Security (docs/security.md): connect(addr, {token, rootCerts, certChain, privateKey, ...})
// speaks TLS (any certificate option or tls: true; rootCerts: the CA that verifies the
// server, else the system's roots) and mTLS (certChain + privateKey), and sends the bearer
// token as `authorization: Bearer TOKEN` on every call. Each certificate option is a PEM
// Buffer/string or a file path. Unset options come from MESHD_TOKEN, MESHD_TLS (=1),
// MESHD_TLS_CA, MESHD_TLS_CERT, MESHD_TLS_KEY, MESHD_TLS_SERVER_NAME; an explicit tls: false
// reads none of the MESHD_TLS* variables (plaintext whatever they say). A token is not sent in
// plaintext to an address that is not loopback unless insecure: true. The token never shows
// in a Session's inspect output or in error messages.
//
//   const s = await connect('meshd.example:50051', { token, rootCerts: 'ca.pem' });
//
// Data path (docs/protocol.md, Direct data path): connect(addr, {dataPath}) or
// session.setDataPath(mode). 'auto' (default) moves upload and fetch bytes straight between
// this process and the agents (PlanTransfer, then Agent/Write or Agent/Read per shard, all
// shards at once, then FinishUpload or FinishFetch) when the server offers it, the agents'
// port is TLS (cluster mTLS: the plan names the CA and name to verify them with; a one-time
// grant authenticates each call, no client certificate) or the session is not over TLS,
// and the agents connect within 1 s; else through the server (Upload, Fetch), the
// reason counted in session.transferStats. 'direct' always goes straight and fails when it
// cannot (UNAVAILABLE naming the rank and address); 'proxy' always through the server.
// A plan's agents are dialled only at host:port addresses (another, unix:/path say: auto
// takes the proxy, direct UNAVAILABLE). A Read or Write refused because it started past
// its grant's start-by time (this process paused between plan and transfer, or clocks
// apart by more than the server's --transfer-grant-start-ms) is planned once more (a fetch
// only while no command was issued after it); late again, it rejects "the transfer's
// grant expired before it started ...; call again". One refused because the agent's grant
// table (--max-transfer-nonces) is full: auto takes the proxy for that transfer (a fetch
// on the same terms), direct rejects saying the agent has too many transfers in flight.
// The first shard of an upload to fail cancels the others' Writes and undoes the upload
// at once (FinishUpload without receipts). A
// FinishUpload that got no answer (DEADLINE_EXCEEDED, UNAVAILABLE) is asked once more with
// the cleanup deadline (the server answers a finished upload's again): an answer and the
// upload succeeds; none, and it is undone and the upload rejects with the first error
// (a tensor the undoing FinishUpload answers with, the first having defined it, is dropped).
//
// While a session is open it sends KeepAlive every third of its ttl (never more often
// than every 250 ms) from an unref'd timer, so an idle session outlives its ttl and the timer never
// keeps the process alive; close() stops it, and so does garbage collection of a
// session that was never closed.
//
// A command whose answer was lost (a unary Execute past its deadline or cut off, the
// pipelined ones a dropped Submit stream owed) rejects without a handle; the tensors the
// server may have defined for it are released (Release, after the calls issued before).
// A transfer (upload, fetch) that finds the session's --session-max-transfers all in
// use waits for one of its own to end, its deadline at most, as the Python client does.
//
// Once close() is called (awaited or not), every later call (execute and the
// conveniences, fetch, upload, literal, inspectUrl, unary, setPipeline) rejects with
// MeshdError NO_SESSION (code UNAUTHENTICATED, as the server's) without being sent.
import { existsSync, readFileSync } from 'node:fs';
import { BlockList, isIP } from 'node:net';
import tls from 'node:tls';
import path from 'node:path';
import { inspect } from 'node:util';
import { fileURLToPath } from 'node:url';
import { createRequire } from 'node:module';

const require = createRequire(import.meta.url);
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const here = path.dirname(fileURLToPath(import.meta.url));
const PROTO_REL = path.join('api', 'meshd', 'v1', 'tensor_service.proto');
const KIND_MD = 'meshd-error-kind';
const CHUNK = 1 << 20; // Upload data chunk size
const QUEUED = Symbol('queued'); // execute: a pipelined command's answer, still to come
const WEIGHT = Symbol('weight'); // a queued Literal's {bytes, sent}: what the batch may hold
const LITERAL_MAX_BYTES = 1 << 20; // the data one Literal carries (docs/protocol.md)
const AGENTS_MAX = 1 << 20; // past any server's --max-agents: agents() stops a list that never ends
const LITERAL_MAX_SENT = 8 << 20; // what it, or one message's Literals, sends the agents
const BATCH_BYTES = 1 << 20; // a pipelined message ends past about this many bytes
const MESSAGE_MAX = 4 << 20; // the server's largest message
// Flow control (a server that stops reading the Submit stream): at most WRITES_MAX
// messages handed to the stream and not yet taken by it, and behind them a queue of
// at most 2 * maxBatch commands and QUEUE_BYTES (one command always fits an empty one).
const WRITES_MAX = 2;
const QUEUE_BYTES = 2 * BATCH_BYTES;
// ...and "taken by the stream" must mean taken by the transport (HTTP/2 flow control:
// the server's --stream-window-bytes, 64 KiB by default). gRPC-js keeps each call's
// messages for a transparent retry, up to grpc.per_rpc_retry_buffer_size (1 MiB by
// default), and reports such a write done at once, before the transport took it: a
// server that stopped reading had about 30,000 tiny pipelined commands (1 MiB of
// them) accepted past WRITES_MAX. grpc.enable_retries 0 does not bound it (the buffer
// is kept all the same; only the retries go). With 16 KiB, less than the server's
// window, as many were accepted as with no buffer at all (2,816 at maxBatch 256: the
// queue, and the window's worth), and the calls whose message fits it (unary Execute,
// KeepAlive, CreateSession...) are still retried transparently.
const RETRY_BUFFER_BYTES = 16 << 10;
const NOT_SENT = Symbol('notSent'); // on an error: the command never went out
// On each TensorMeta and MeshMeta a session hands out (not enumerable: inspect, JSON and
// deepEqual do not see it): the session's mark. Refs are numbered per session, so two
// sessions made alike hand out the same refs: one of another session would name another
// object (or none) here, and a call that takes it refuses it (Session.#own).
const OWNER = Symbol('meshd.owner');
// Refs handed to the caller as bare numbers (t.ref, a BigInt argument) carry no mark: so
// that one of another session is refused at the call too, each session numbers its refs
// in a span of its own, REF_SPAN wide: the n-th a process opens from
// (n mod REF_TAGS) * REF_SPAN + 1 (the C client's numbering; REF_TAGS * REF_SPAN < 2^53,
// so every ref is an exact Number).
const REF_SPAN = 1e12;
const REF_TAGS = 9000;
let sessionsOpened = 0;

// About how many bytes a command takes on the wire (its strings, lists and bytes;
// 10 a number): what a pipelined message may hold (BATCH_BYTES) is counted in these.
function weigh(v) {
  if (v === null || v === undefined) return 0;
  if (typeof v === 'string') return v.length + 2;
  if (typeof v !== 'object') return 10;
  if (ArrayBuffer.isView(v)) return v.byteLength + 4;
  let n = 2;
  for (const k in v) n += weigh(v[k]) + 1;
  return n;
}
// Commands whose claimed refs are all tensors (a Release may name them).
const TENSOR_KINDS = ['factory', 'call', 'reduce', 'to_mesh', 'literal', 'load'];
const RELEASE_BATCH = 1024; // refs per Release (the server's --max-command-refs is 4096 by default)
// The refs a command claims (those the conveniences took with newRef just before it).
function claims(command) {
  const [kind] = Object.keys(command);
  const c = command[kind] ?? {};
  if (kind === 'call') return (c.results ?? []).map(Number);
  if (kind === 'borrow') return [Number(c.ref), Number(c.borrow)].filter((r) => r > 0);
  if (['create_mesh', 'slice_mesh', 'create_stream', 'factory', 'reduce', 'to_mesh', 'load', 'literal'].includes(kind)) {
    return Number(c.ref) > 0 ? [Number(c.ref)] : [];
  }
  return [];
}

const AGENT_PROTO_REL = path.join('meshd', 'agent', 'v1', 'agent.proto');
const GRANT_MD = 'meshd-transfer-grant-bin';
export const DATA_PATHS = Object.freeze(['auto', 'direct', 'proxy']);
export const DIRECT_CONNECT_MS = 1000; // an agent that does not connect within this...
const DIRECT_RETRY_MS = 30000; // ...is not tried again (auto) for this long
// Writes of 2 MiB (half the agents' default 4 MiB message limit), reads of 1 MiB.
const WRITE_CHUNK = 2 << 20;
const READ_CHUNK = 1 << 20;
const ABANDON_MS = 300; // FinishFetch of a fetch given up on
const CLOSE_LAST_TRY_MS = 250; // CloseSession's time at least, should the waits before it have taken the rest
const CLEANUP_MS = 5000; // FinishUpload undoing an upload given up on (the session's timeoutMs if less)
const PROXY = Symbol('proxy'); // #directUpload, #directFetch: use the proxy instead
// An agent's refusal of a Read or Write that started past its grant's start-by time
// (--transfer-grant-start-ms after the plan: the client was paused between the plan and
// the call, or a clock was stepped): nothing moved, and a new plan's grants are good again.
const LATE_REFUSAL = 'did not start by its start-by time';
const LATE_MSG = "the transfer's grant expired before it started (the client was paused after its plan, an "
  + "agent's clock was stepped, or, with an older server or agent, the clocks differ by more than "
  + '--transfer-grant-start-ms); call again';
// An agent's refusal of a grant because its table of grants in use (--max-transfer-nonces)
// is full (agent/transfer_grant.c, RESOURCE_EXHAUSTED): nothing moved.
const TABLE_FULL_REFUSAL = 'grants are in use on this agent already';
const REFUSAL = Symbol('refusal'); // on a shard's MeshdError: 'late' or 'full', as above

// Tests only (test/direct.test.mjs), never set in use, as the C client's:
// MESHD_TEST_DIRECT_DELAY_MS=<ms> waits <ms> after each PlanTransfer answer (a client
// paused between its plan and its transfer); "<ms>,once" only after a transfer's first
// plan, not after a new plan for a late grant (again).
function testPause(again) {
  const m = /^(\d+)(,once)?$/.exec(process.env.MESHD_TEST_DIRECT_DELAY_MS ?? '');
  const ms = m ? Number(m[1]) : 0;
  if (ms <= 0 || ms > 60000 || (again && m[2])) return undefined;
  return new Promise((resolve) => { setTimeout(resolve, ms); });
}
const UNKINDED = Symbol('unkinded'); // a MeshdError with no kind of the server's (its answer may be lost)

export function protoPath() {
  const candidates = [];
  if (process.env.MESHD_SOURCE_DIR) candidates.push(path.join(process.env.MESHD_SOURCE_DIR, PROTO_REL));
  candidates.push(path.resolve(here, '..', '..', PROTO_REL));
  for (const c of candidates) if (existsSync(c)) return c;
  throw new Error(`meshd: ${PROTO_REL} not found (tried ${candidates.join(', ')}); set MESHD_SOURCE_DIR`);
}

const cached = {};
// wide: 64-bit integers decoded as decimal strings (PlanTransfer's transfer ids are
// random 64-bit values, which a Number would round).
function loadService(file, wide = false) {
  const key = wide ? 'wide' : 'narrow';
  if (cached[key] && cached[key].file === file) return cached[key].svc;
  const def = protoLoader.loadSync(file, {
    keepCase: true, longs: wide ? String : Number, enums: String, defaults: true, oneofs: true,
  });
  const svc = grpc.loadPackageDefinition(def).meshd.v1.TensorService;
  cached[key] = { file, svc };
  return svc;
}

// meshd.agent.v1.Agent (Read and Write only are open to clients, under a grant), loaded
// from agent.proto next to tensor_service.proto's api/ folder.
let agentCached;
function loadAgentService(tensorProto) {
  const apiRoot = path.resolve(path.dirname(tensorProto), '..', '..');
  const file = path.join(apiRoot, AGENT_PROTO_REL);
  if (agentCached && agentCached.file === file) return agentCached.svc;
  const def = protoLoader.loadSync(file, {
    keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true, includeDirs: [apiRoot],
  });
  const svc = grpc.loadPackageDefinition(def).meshd.agent.v1.Agent;
  agentCached = { file, svc };
  return svc;
}

// Whether channel becomes READY by `end`; false at once on a failed attempt (refused,
// reset, a handshake it cannot do), where waitForReady would wait out the time.
async function connected(channel, end) {
  const { IDLE, READY, TRANSIENT_FAILURE, SHUTDOWN } = grpc.connectivityState;
  let state = channel.getConnectivityState(true);
  while (state !== READY) {
    if (state === TRANSIENT_FAILURE || state === SHUTDOWN) return false;
    const from = state;
    const changed = await new Promise((resolve) => channel.watchConnectivityState(from, end, (err) => resolve(!err)));
    if (!changed) return false;
    // asked to connect only when idle: grpc-js dials again for a channel closed meanwhile
    // (SHUTDOWN), a connection nothing would ever close
    state = channel.getConnectivityState(false);
    if (state === IDLE) state = channel.getConnectivityState(true);
  }
  return true;
}

// Why a TLS handshake with the agent at address (host:port) fails, under the plan's CA
// and name, within ms; '' when it succeeds, or when the connection itself fails (refused,
// no answer): what a failed gRPC connection over TLS does not say.
function tlsFailure(address, ca, name, ms) {
  const i = address.lastIndexOf(':');
  const host = address.slice(0, i).replace(/^\[|\]$/g, '');
  const port = Number(address.slice(i + 1));
  const sni = name || host;
  return new Promise((resolve) => {
    let sock;
    const done = (why) => { clearTimeout(timer); sock?.destroy(); resolve(why); };
    const timer = setTimeout(() => done(''), Math.max(1, ms));
    try {
      sock = tls.connect({ host, port, ca, ALPNProtocols: ['h2'], servername: isIP(sni) ? undefined : sni,
        checkServerIdentity: (h, cert) => tls.checkServerIdentity(sni, cert) });
    } catch (e) {
      done(e.message);
      return;
    }
    sock.once('secureConnect', () => done(''));
    sock.once('error', (e) => done(/^E(CONNREFUSED|CONNRESET|TIMEDOUT|HOSTUNREACH|NETUNREACH|PIPE)$/.test(e.code ?? '')
      ? '' : e.message));
  });
}

function checkDataPath(mode) {
  if (!DATA_PATHS.includes(mode)) {
    throw new RangeError(`meshd: dataPath must be one of ${DATA_PATHS.join(', ')}, got ${JSON.stringify(mode)}`);
  }
  return mode;
}

// An Error from meshd: .kind is the ErrorKind name without its prefix ("UNKNOWN_OP"),
// .code the gRPC status code, .seq the failing command when known.
export class MeshdError extends Error {
  constructor(kind, message, code, seq) {
    super(`${kind}: ${message}`);
    this.name = 'MeshdError';
    this.kind = kind;
    this.code = code;
    this.seq = seq;
  }

  static fromRpc(err) {
    const md = err.metadata?.get(KIND_MD) ?? [];
    let kind = md.length ? String(md[0]) : '';
    if (!kind) kind = grpc.status[err.code] ?? `CODE_${err.code}`;
    return new MeshdError(kind, err.details ?? err.message, err.code);
  }

  static fromError(e) {
    const kind = String(e.kind).replace(/^ERROR_KIND_/, '');
    return new MeshdError(kind, e.message, e.code, e.seq || undefined);
  }
}

// The proto's DType names: a string it lacks ('float64', a typo) was sent as
// DTYPE_UNSPECIFIED, which the server takes as float32: a tensor of another dtype, no error.
const DTYPE_NAMES = ['DTYPE_FLOAT32', 'DTYPE_FLOAT64', 'DTYPE_FLOAT16', 'DTYPE_BFLOAT16', 'DTYPE_INT8',
  'DTYPE_UINT8', 'DTYPE_INT16', 'DTYPE_INT32', 'DTYPE_INT64', 'DTYPE_BOOL'];
function checkDtype(fn, dtype) {
  if (dtype === undefined || DTYPE_NAMES.includes(dtype) || (Number.isInteger(dtype) && dtype > 0 && dtype <= DTYPE_NAMES.length)) return;
  throw new MeshdError('BAD_ARGUMENT', `meshd: ${fn}: unknown dtype ${inspect(dtype)}; meshd has `
    + `${DTYPE_NAMES.join(', ')}`, grpc.status.INVALID_ARGUMENT);
}

const DTYPES = {
  DTYPE_FLOAT32: Float32Array,
  DTYPE_FLOAT64: Float64Array,
  DTYPE_INT8: Int8Array,
  DTYPE_UINT8: Uint8Array,
  DTYPE_INT16: Int16Array,
  DTYPE_INT32: Int32Array,
  DTYPE_INT64: BigInt64Array,
  DTYPE_BOOL: Uint8Array,
};
// What fetch() makes of each dtype: upload's, and float16/bfloat16 as their raw bits.
const FETCH_TYPES = { ...DTYPES, DTYPE_FLOAT16: Uint16Array, DTYPE_BFLOAT16: Uint16Array };

// A TensorMeta or Error read with 64-bit integers as strings, as Numbers.
function narrowMeta(m) {
  if (!m) return m;
  for (const k of ['ref', 'mesh', 'stream', 'storage_offset']) m[k] = Number(m[k]);
  m.shape = m.shape.map(Number);
  m.strides = m.strides.map(Number);
  if (m.error) for (const k of ['code', 'seq', 'ref']) m.error[k] = Number(m.error[k]);
  return m;
}

// PlanTransfer's reply read with 64-bit integers as strings (the wide client): its
// transfer_id and the shards' after_seq stay decimal strings (random or large 64-bit
// values a Number would round), every other integer becomes a Number.
function narrowPlan(reply) {
  reply.expiry_unix_ms = Number(reply.expiry_unix_ms);
  for (const sh of reply.shards ?? []) sh.rank = Number(sh.rank);
  narrowMeta(reply.meta);
  return reply;
}

// What an agent's address in a plan must look like before it is dialled: host:port (a
// name, an IPv4 address or a bracketed IPv6 one), never another gRPC target (unix:/path,
// dns:///name, ipv4:..., or a "host" that grpc-js reads as a scheme, unix:123), which
// would dial something other than the agent.
const HOST_PORT = /^(\[[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?\]|[A-Za-z0-9_.-]+):[0-9]{1,5}$/;
const SCHEMES = /^(unix|unix-abstract|dns|ipv4|ipv6|xds|vsock)$/i;
function hostPort(address) {
  const m = HOST_PORT.exec(address);
  return Boolean(m) && !SCHEMES.test(m[1]);
}

// One Arg of a Call: a number is a double (`f`) unless wrapped as {i: n}; a Tensor
// handle ({ref}) or a BigInt is a ref; {ints: [..]}, {s: '..'}, {b: true}, ... pass through.
function toArg(a) {
  if (typeof a === 'number') return { f: a };
  if (typeof a === 'boolean') return { b: a };
  if (typeof a === 'string') return { s: a };
  if (a === null || a === undefined) return { none: true };
  if (typeof a === 'bigint') return { ref: Number(a) };
  if (Array.isArray(a) && a.length && a.every((x) => typeof x === 'object' && x !== null && 'ref' in x)) {
    return { refs: { refs: a.map((x) => x.ref) } }; // tensors (cat, stack)
  }
  if (Array.isArray(a)) return { ints: { values: a } };
  if (typeof a === 'object' && 'ref' in a && Object.keys(a).length !== 1) return { ref: a.ref };
  return a; // already an Arg ({ref}, {i}, {ints}, ...)
}

// KeepAlive period for a session lease of ttlSeconds: a third of it, at least 250 ms
// (a floor well below a 1 s lease, which a 1 s period let expire).
const KEEPALIVE_MIN_MS = 250;
export function keepAlivePeriodMs(ttlSeconds) {
  return Math.max(KEEPALIVE_MIN_MS, Math.floor(((ttlSeconds || 300) * 1000) / 3));
}

// Clears the keepalive timer of a session that was collected without close().
const keepAliveTimers = new FinalizationRegistry((stop) => stop());

export class Session {
  #md; // every call's metadata: authorization (with a token), meshd-session, meshd-token

  #agents = new Map(); // address + the plan's AgentTls -> Agent client (direct path), made on first use
  #dialing = new Set(); // Agent clients still connecting (close() closes them too)
  #handshakes = new Map(); // address -> why the last TLS handshake with its agent failed
  #refused = false; // the server refused PlanTransfer for its --data-path
  #agentsPlain = false; // a plan said the agents speak plaintext (for a session over TLS)
  #offUntil = 0; // auto: no direct try before this (an agent did not connect)
  #protoFile;
  #wide; // TensorService on the same channel, 64-bit integers as strings (PlanTransfer)
  #pipe = null; // setPipeline: the Submit stream, its queue and the answers awaited
  #meshes = new Map(); // ref -> the MeshMeta of each mesh this session made (literal)
  #order = Promise.resolve(); // the last ref-claiming send issued (#inOrder)
  #steps = 0; // sends issued to #order and not yet finished
  #old = []; // pipelines turned off whose streams have not ended (their answers may be due)
  #drains = []; // #drain's waiters: every pipelined command answered
  #lateErrors = []; // run-time errors in the answer of a pipelined sync that timed out
  #closing = null; // close() under way
  #closeCalled = false; // close() was called: later calls reject NO_SESSION unsent
  #fetches = new Set(); // fetches whose bytes are still moving (close() waits for them)
  #held = []; // refs of lost answers whose Release was refused BORROWED: sent again once a borrow ends
  #mark = Symbol('meshd.session'); // OWNER of the handles this session hands out
  #refBase; // this session's refs are #refBase + 1, + 2, ... (REF_SPAN)

  constructor(client, reply, timeoutMs, baseMd = new grpc.Metadata(), { tls = false, dataPath = 'auto', protoFile } = {}) {
    this.client = client;
    this.id = reply.session_id;
    this.ttlSeconds = reply.ttl_seconds;
    this.timeoutMs = timeoutMs;
    this.tls = tls;
    this.#md = baseMd.clone();
    this.#md.set('meshd-session', this.id);
    this.#md.set('meshd-token', reply.token);
    this.#refBase = (sessionsOpened++ % REF_TAGS) * REF_SPAN;
    this.nextRef = this.#refBase;
    this.seq = 0;
    this.closed = false;
    this.literals = (reply.features ?? []).includes('literal'); // the server takes Literals
    this.dataPath = checkDataPath(dataPath);
    this.#protoFile = protoFile;
    this.transferStats = {
      directUploads: 0, directFetches: 0, proxyUploads: 0, proxyFetches: 0, fallbacks: 0, lastFallback: '',
    };
    this.startKeepAlive();
  }

  // 'auto', 'direct' or 'proxy' for later uploads and fetches; forcing a mode also
  // forgets an agent that did not connect.
  setDataPath(mode) {
    this.dataPath = checkDataPath(mode);
    this.#offUntil = 0;
  }

  // The timer holds the session only weakly (the client and metadata it needs are
  // captured instead), so an unclosed session can still be collected.
  startKeepAlive() {
    if (this.keepAliveTimer) this.stopKeepAlive(); // a second call replaces the timer
    const periodMs = keepAlivePeriodMs(this.ttlSeconds);
    const self = new WeakRef(this);
    const { client } = this;
    const md = this.#md;
    const timeoutMs = Math.min(this.timeoutMs, 5000);
    let inFlight = false;
    const timer = setInterval(() => {
      const s = self.deref();
      if (!s || s.closed) { clearInterval(timer); return; }
      if (inFlight) return;
      inFlight = true;
      client.KeepAlive({}, md, { deadline: Date.now() + timeoutMs }, (err) => {
        inFlight = false;
        // NO_SESSION: closed or expired, nothing left to keep; other errors: next period.
        if (err && err.code === grpc.status.UNAUTHENTICATED) clearInterval(timer);
      });
    }, periodMs);
    timer.unref();
    this.keepAliveTimer = timer;
    this.keepAlivePeriodMs = periodMs;
    keepAliveTimers.register(this, () => clearInterval(timer), this);
  }

  stopKeepAlive() {
    clearInterval(this.keepAliveTimer);
    keepAliveTimers.unregister(this);
  }

  // What console.log shows: never the metadata (it holds the tokens).
  [inspect.custom]() {
    return `Session { id: '${this.id}', tls: ${this.tls}, closed: ${this.closed} }`;
  }

  deadline(timeoutMs) { return Date.now() + (timeoutMs ?? this.timeoutMs); }

  newRef() { this.nextRef += 1; return this.nextRef; }

  // Marks a TensorMeta or MeshMeta as this session's (OWNER); returns it.
  #mine(meta) {
    if (meta && typeof meta === 'object' && !(OWNER in meta)) {
      Object.defineProperty(meta, OWNER, { value: this.#mark });
    }
    return meta;
  }

  // Throws when h, an argument named `what` of `fn`, is a handle of another session, or
  // a bare ref (a number, a BigInt, an unmarked {ref}) this session did not hand out (0:
  // none): its ref would name another object, or none, in this one (wrong results, no error).
  // numbers false: a Number is no ref (a call's argument: a double).
  #own(h, fn, what, numbers = true) {
    const list = Array.isArray(h) ? h : [h];
    for (let i = 0; i < list.length; i += 1) {
      const x = list[i];
      const at = () => `meshd: ${fn}: ${what}${Array.isArray(h) ? `[${i}]` : ''}`;
      const mark = x !== null && typeof x === 'object' ? x[OWNER] : undefined;
      if (mark === this.#mark) continue;
      if (mark !== undefined) {
        throw new MeshdError('BAD_ARGUMENT', `${at()} (ref ${x.ref}) is of another session than this one: refs `
          + 'are per session, so it would name another object here; use handles of this session (move data with '
          + 'fetch and upload)', grpc.status.INVALID_ARGUMENT);
      }
      const ref = Session.#bareRef(x, numbers);
      if (ref === undefined || ref === 0 || (ref > this.#refBase && ref <= this.nextRef)) continue;
      const span = this.nextRef > this.#refBase ? `${this.#refBase + 1} to ${this.nextRef}` : 'none yet';
      throw new MeshdError('BAD_ARGUMENT', `${at()} (ref ${ref}) is not a ref this session handed out (its refs: `
        + `${span}): refs are per session, so one of another session, or a number never handed out, would name `
        + 'another object here, or none; use refs and handles of this session (move data with fetch and upload)',
      grpc.status.INVALID_ARGUMENT);
    }
  }

  // The ref a bare argument names (a BigInt, a Number unless numbers is false, an
  // object's .ref), else undefined (not a ref: a string, an Arg such as {ints}...).
  static #bareRef(x, numbers) {
    if (typeof x === 'bigint') return Number(x);
    if (typeof x === 'number') return numbers ? x : undefined;
    if (x === null || typeof x !== 'object' || !('ref' in x)) return undefined;
    const v = x.ref;
    if (typeof v === 'bigint' || typeof v === 'number' || (typeof v === 'string' && /^[0-9]+$/.test(v))) return Number(v);
    return undefined;
  }

  // Refs must reach the server in strictly increasing order (docs/protocol.md), and
  // they are taken in the order calls are issued. So every send that claims refs
  // (execute, upload) goes out in issue order: send() runs once the send issued
  // before it has been claimed by the server: a unary Execute answered, a pipelined
  // command queued for the Submit stream (which keeps its order), an Upload finished.
  // Without this, calls issued together (Promise.all) raced on separate calls, and
  // a ref that arrived after a higher one was refused REF_REUSED.
  // With a deadline (execute, fetch) the wait for the turn is bounded too: past it the
  // call rejects DEADLINE_EXCEEDED (marked NOT_SENT) and its send is skipped when the
  // turn comes, also where the turn came first, its deadline already past (the event
  // loop was busy: the timer had not run yet). setPipeline and close take their turn
  // here as well, so a call issued before them goes out before the pipeline changes.
  #inOrder(send, deadline, limitMs, what) {
    let timer;
    let cut = null; // the error the caller got when its turn did not come in time
    const idle = this.#steps === 0; // the turn comes at once (a microtask)
    const late = () => {
      const e = new MeshdError('DEADLINE_EXCEEDED', `${what} was not queued or sent within ${limitMs} ms: the calls `
        + 'issued before it had not gone out yet (an upload, a fetch not yet planned, or pipelined commands '
        + 'waiting for the server to read the Submit stream: flow control)', grpc.status.DEADLINE_EXCEEDED);
      e[NOT_SENT] = true;
      return e;
    };
    this.#steps += 1;
    const p = this.#order.then(() => {
      clearTimeout(timer);
      if (!cut && !idle && deadline !== undefined && Date.now() >= deadline) cut = late();
      if (cut) throw cut;
      return send();
    }).finally(() => { this.#steps -= 1; });
    this.#order = p.then(() => {}, () => {});
    if (deadline === undefined || idle) return p;
    return new Promise((resolve, reject) => {
      timer = setTimeout(() => {
        cut = late();
        reject(cut);
      }, Math.max(1, deadline - Date.now()));
      p.then(resolve, reject); // (after a cut, p rejects with it: a no-op)
    });
  }

  // close() was called (it may still run): the session takes no more calls.
  get #shut() { return this.closed || this.#closeCalled; }

  // What a call made once close() was called rejects with (it is not sent): NO_SESSION,
  // with the server's code for it (docs/protocol.md: UNAUTHENTICATED).
  static #noSession(what) {
    return new MeshdError('NO_SESSION', `${what}: the session is closed (close() was called)`,
      grpc.status.UNAUTHENTICATED);
  }

  // timeoutMs: the call's deadline from now (default: the session's timeoutMs).
  unary(method, request, { timeoutMs } = {}) {
    if (this.#shut) return Promise.reject(Session.#noSession(method));
    return this.#unary(method, request, this.deadline(timeoutMs));
  }

  // Every registered agent and how a client dials their port: ListAgents, every page
  // (each next_page_token followed to the last page; agent_tls is the same on each).
  // timeoutMs (default: the session's) bounds all the pages together; pageSize: the
  // rows a page may hold (0: the server's default, 4096). A server that answers a page
  // with nothing, or the token it was sent, and says more follow, is leading the client
  // on: INTERNAL, not a loop.
  async agents({ timeoutMs, pageSize = 0 } = {}) {
    if (this.#shut) throw Session.#noSession('ListAgents');
    const deadline = this.deadline(timeoutMs);
    const agents = [];
    let token = '';
    for (;;) {
      const r = await this.#unary('ListAgents', { page_size: pageSize, page_token: token }, deadline);
      agents.push(...r.agents);
      if (!r.next_page_token) return { agents, agent_tls: r.agent_tls };
      const why = r.next_page_token === token ? 'the same next_page_token again'
        : !r.agents.length ? 'an empty page with a next_page_token'
          : agents.length > AGENTS_MAX ? `over ${AGENTS_MAX} agents` : '';
      if (why) throw new MeshdError('INTERNAL', `ListAgents: the server's pages do not end (${why})`, grpc.status.INTERNAL);
      token = r.next_page_token;
    }
  }

  #unary(method, request, deadline) {
    // PlanTransfer answers a random 64-bit transfer_id, which a Number would round:
    // read with 64-bit integers as decimal strings (requests take strings or Numbers
    // either way), then every one but transfer_id and the shards' after_seq as Numbers.
    if (method !== 'PlanTransfer') return this.#unaryBy(method, request, deadline);
    return this.#unaryBy(method, request, deadline, this.#wideClient()).then(narrowPlan);
  }

  #wideClient() {
    if (!this.#wide) {
      const Wide = loadService(this.#protoFile ?? protoPath(), true);
      this.#wide = new Wide('meshd', grpc.credentials.createInsecure(), { channelOverride: this.client.getChannel() });
    }
    return this.#wide;
  }

  #unaryBy(method, request, deadline, client = this.client) {
    return new Promise((resolve, reject) => {
      // the channel is closed: grpc-js would throw its own plain Error
      if (this.closed) { reject(Session.#noSession(method)); return; }
      client[method](request, this.#md, { deadline }, (err, reply) => {
        if (err) {
          const e = MeshdError.fromRpc(err);
          if (!(err.metadata?.get(KIND_MD) ?? []).length) e[UNKINDED] = true;
          reject(e);
        } else resolve(reply);
      });
    });
  }

  // Runs one Command ({create_mesh: {...}} etc.; seq is filled in) and returns its
  // CommandResult; a rejected command throws a MeshdError with .kind. timeoutMs (default:
  // the session's) bounds everything the call waits for: its turn, the answers of a
  // pipeline turned off before it (unary), room in the pipeline's queue, its answer.
  // A command that never went out (no room in time) gives its seq and refs back when no
  // later call took any.
  async execute(command, { timeoutMs, [WEIGHT]: weight } = {}) {
    if (this.#shut) throw Session.#noSession(Object.keys(command)[0] ?? 'execute');
    this.seq += 1;
    const cmd = { seq: this.seq, ...command };
    // a symbol, which protobuf does not see: what the command weighs in a message
    cmd[WEIGHT] = weight ?? { bytes: weigh(command), sent: 0 };
    const limitMs = timeoutMs ?? this.timeoutMs;
    const deadline = Date.now() + limitMs; // from the call, not from its turn
    const what = `command seq ${cmd.seq}`;
    // A pipelined command is claimed in stream order once queued; its answer is awaited
    // outside the order (wrapped, so that the order does not wait for it).
    let sent;
    try {
      sent = await this.#inOrder(async () => {
        const pipe = this.#pipe;
        if (pipe) return this.#submit(pipe, cmd, deadline, limitMs, timeoutMs !== undefined || !!command.sync);
        await this.#drain(deadline, limitMs, what, true); // a pipeline turned off: its commands first
        return this.#unaryBy('Execute', cmd, deadline).catch((e) => {
          // No kind of the server's (a deadline, a dropped connection): it may have defined
          // the tensors and its answer been lost, and the caller has no handle to free them.
          if (e?.[UNKINDED]) this.#releaseLost([cmd]);
          throw e;
        });
      }, deadline, limitMs, what);
    } catch (e) {
      if (e?.[NOT_SENT]) this.#giveBack(cmd.seq, command);
      throw e;
    }
    // (taken out of the pipeline's queue at its deadline: never sent, as above)
    const res = QUEUED in sent ? await sent[QUEUED].catch((e) => {
      if (e?.[NOT_SENT]) this.#giveBack(cmd.seq, command);
      throw e;
    }) : sent;
    if (res.error && res.error.kind && res.error.kind !== 'ERROR_KIND_UNSPECIFIED') throw MeshdError.fromError(res.error);
    if (command.drop_borrow) this.#borrowEnded();
    for (const t of res.tensors ?? []) this.#mine(t);
    this.#mine(res.mesh);
    return res;
  }

  // Commands whose answers were lost (a unary Execute's, or those a Submit stream that
  // broke without a kind of the server's owed): the tensors they may have defined are released
  // (refs not live are skipped) in a turn of their own, after the calls issued so far,
  // before any issued from now on.
  #releaseLost(cmds) {
    const refs = [];
    for (const { seq, ...command } of cmds) {
      if (TENSOR_KINDS.includes(Object.keys(command)[0])) refs.push(...claims(command));
    }
    for (let i = 0; i < refs.length; i += RELEASE_BATCH) {
      const some = refs.slice(i, i + RELEASE_BATCH);
      this.#inOrder(() => this.#releaseHeld(some));
    }
    // A Borrow the server may have made (its origin then undroppable): DropBorrow of its
    // claimed ref ends it, or is refused UNKNOWN_REF if it never was (ignored: best effort).
    for (const { seq, ...command } of cmds) {
      const b = Number(command.borrow?.borrow);
      if (b > 0) this.#inOrder(() => this.#dropLostBorrow(b));
    }
  }

  async #dropLostBorrow(borrow) {
    try { // seq 0, unary: as #letGoInTurn's
      const res = await this.#unaryBy('Execute', { seq: 0, drop_borrow: { borrow } }, this.#cleanupDeadline());
      if (!Session.#refusal(res)) this.#borrowEnded();
    } catch {
      // best effort
    }
  }

  // A unary Execute's answer: the kind it was refused with ('' if accepted).
  static #refusal(res) {
    const kind = res?.error?.kind;
    return kind && kind !== 'ERROR_KIND_UNSPECIFIED' ? String(kind).replace(/^ERROR_KIND_/, '') : '';
  }

  // Releases the refs of lost answers, best effort (seq 0, unary: as #letGoInTurn's). The
  // server refuses a whole Release BORROWED when one of its refs is (a view of) a borrowed
  // tensor, releasing none: then each goes alone, and those refused BORROWED are held
  // until a borrow ends (#borrowEnded), as the Python client does.
  async #releaseHeld(refs) {
    const one = async (some) => {
      try {
        const res = await this.#unaryBy('Execute', { seq: 0, release: { refs: some } }, this.#cleanupDeadline());
        return Session.#refusal(res);
      } catch (e) {
        return e instanceof MeshdError ? e.kind : '';
      }
    };
    if (await one(refs) !== 'BORROWED') return;
    if (refs.length === 1) { this.#held.push(...refs); return; }
    for (const r of refs) if (await one([r]) === 'BORROWED') this.#held.push(r);
  }

  // A borrow ended: the refs held back by a Release refused BORROWED go again.
  #borrowEnded() {
    if (!this.#held.length || this.#shut) return;
    const refs = this.#held.splice(0);
    for (let i = 0; i < refs.length; i += RELEASE_BATCH) {
      const some = refs.slice(i, i + RELEASE_BATCH);
      this.#inOrder(() => this.#releaseHeld(some));
    }
  }

  // A command that did not go out: its seq, and the refs it would have claimed, are
  // taken again by the next call, unless a later call took one since.
  #giveBack(seq, command) {
    if (this.seq !== seq) return;
    this.seq -= 1;
    const refs = claims(command);
    if (refs.length && Math.max(...refs) === this.nextRef && Math.min(...refs) === this.nextRef - refs.length + 1) {
      this.nextRef -= refs.length;
    }
  }

  // ------------------------------------------------------------------ pipeline
  // With a pipeline, commands (execute, so call, factory, reduce, sync...) go on one
  // Submit stream, many to a message: whatever was issued before the event loop
  // turns (setImmediate), at most maxBatch (1..4096, default 256) to a message.
  // Each call still resolves or rejects with its own answer (a rejection goes to that
  // call only); issue many before awaiting them (e.g. Promise.all) and they share
  // messages. Upload, fetch, inspectUrl and close first wait for every answer
  // outstanding, so refs reach the server in order. The open stream keeps the
  // process (and the session) alive: close() the session.
  //
  // Flow control: a server whose session has too much work queued on its agents
  // (--session-max-queued) stops reading the stream. The client then holds at most
  // WRITES_MAX messages in the stream and 2 * maxBatch commands (QUEUE_BYTES) queued
  // behind them; a command that finds the queue full waits for room until its deadline,
  // then rejects DEADLINE_EXCEEDED, not queued (it never went out: calling again is
  // safe). A queued command whose deadline passes before it was handed to the stream is
  // taken out of the queue and rejects DEADLINE_EXCEEDED, never sent (it did not run:
  // calling again is safe). One handed to the stream whose answer did not come in time
  // rejects DEADLINE_EXCEEDED but may still run: it goes to the server once it reads
  // again, and every later call that must follow it waits for its answer.
  //
  // setPipeline(opts) with a pipeline on changes maxBatch for it; on a stream that
  // failed it opens a new one (after the answers of a pipeline turned off before).
  // setPipeline(null) turns it off (the stream ends after what is queued) and waits for
  // every answer, the session's timeoutMs at most: past it, DEADLINE_EXCEEDED (the
  // pipeline is off all the same; what is queued still goes out, and later calls wait
  // for those answers first).
  async setPipeline(opts = {}) {
    if (this.#shut) throw Session.#noSession('setPipeline');
    const maxBatch = opts?.maxBatch ?? 256;
    if (opts !== null && (!Number.isInteger(maxBatch) || maxBatch < 1 || maxBatch > 4096)) {
      throw new RangeError(`meshd: setPipeline: maxBatch must be an integer in 1..4096, got ${maxBatch}`);
    }
    await this.#inOrder(async () => {
      const limitMs = this.timeoutMs;
      const deadline = Date.now() + limitMs;
      const pipe = this.#pipe;
      if (opts === null) {
        this.#off();
        await this.#drain(deadline, limitMs, 'setPipeline(null)');
        return;
      }
      if (pipe && !pipe.broken) {
        pipe.maxBatch = maxBatch;
        if (pipe.queue.length >= maxBatch) this.#flush(pipe);
        this.#roomy(pipe);
        return;
      }
      if (this.closed) throw Session.#noSession('setPipeline'); // close() gave up waiting for this turn
      this.#pipe = null; // a failed stream: every command on it has its error
      await this.#drain(deadline, limitMs, 'setPipeline'); // the old streams' refs before the new one's
      this.#pipe = this.#open(maxBatch);
    });
  }

  #open(maxBatch) {
    const stream = this.client.Submit(this.#md);
    const pipe = { stream, maxBatch, queue: [], bytes: 0, writing: 0, pending: new Map(), late: new Set(),
      room: [], scheduled: false, broken: null, closing: false, ended: false, cancelled: false,
      messages: 0, commands: 0, replies: 0, watch: null };
    stream.on('data', (reply) => this.#answers(pipe, reply));
    // no kind of the server's: the answers it owed may be lost (#broke)
    const unkinded = (e) => Object.assign(e, { [UNKINDED]: true });
    stream.on('error', (err) => this.#over(pipe, err.code === undefined || typeof err.code !== 'number'
      ? unkinded(new MeshdError('UNAVAILABLE', `the Submit stream failed: ${err.message}`, grpc.status.UNAVAILABLE))
      : (err.metadata?.get(KIND_MD) ?? []).length ? MeshdError.fromRpc(err) : unkinded(MeshdError.fromRpc(err))));
    stream.on('end', () => this.#over(pipe, unkinded(new MeshdError('UNAVAILABLE',
      'the Submit stream ended before every command was answered', grpc.status.UNAVAILABLE))));
    return pipe;
  }

  // The pipeline goes off: its stream ends once what is queued went out; until it has
  // ended (its answers in) it stays among #old, which later calls wait for.
  #off() {
    const pipe = this.#pipe;
    if (!pipe) return;
    this.#pipe = null;
    if (pipe.broken) return;
    pipe.closing = true;
    this.#old.push(pipe);
    this.#flush(pipe);
  }

  // {commands, messages, replies, queued}: commands sent on the pipeline's stream, in
  // how many messages, answered in how many replies, and the commands queued on the
  // client, not yet handed to the stream (null without a pipeline).
  pipelineStats() {
    const p = this.#pipe;
    return p ? { commands: p.commands, messages: p.messages, replies: p.replies, queued: p.queue.length } : null;
  }

  // Whether the queue takes a command of weight w now.
  static #fits(pipe, w) {
    return !pipe.queue.length || (pipe.queue.length < 2 * pipe.maxBatch && pipe.bytes + w.bytes <= QUEUE_BYTES);
  }

  // Queues cmd (in its turn) once there is room, its deadline at most; returns its
  // answer, wrapped. A pipelined command's answer is awaited until its deadline: with a
  // timer of its own when the call gave a timeoutMs (and for a sync), else by the
  // pipeline's one sweep over the commands on the session's timeoutMs, oldest first (#watch).
  async #submit(pipe, cmd, deadline, limitMs, ownTimer) {
    if (pipe.broken) throw pipe.broken;
    if (cmd[WEIGHT].bytes > MESSAGE_MAX - 4096) { // it would end the stream for every call
      const e = new MeshdError('BAD_ARGUMENT', `command seq ${cmd.seq} takes about `
        + `${cmd[WEIGHT].bytes} bytes, more than a message may (${MESSAGE_MAX})`, grpc.status.INVALID_ARGUMENT, cmd.seq);
      e[NOT_SENT] = true;
      throw e;
    }
    if (!Session.#fits(pipe, cmd[WEIGHT])) await this.#room(pipe, cmd, deadline, limitMs);
    if (pipe.broken) throw pipe.broken;
    const answer = new Promise((resolve, reject) => {
      let timer;
      const done = (fn) => (v) => { if (timer) clearTimeout(timer); fn(v); };
      const entry = { resolve: done(resolve), reject: done(reject), timeoutMs: limitMs, cmd };
      if (!ownTimer) entry.deadline = deadline;
      pipe.pending.set(cmd.seq, entry);
      pipe.queue.push(cmd);
      pipe.bytes += cmd[WEIGHT].bytes;
      if (pipe.queue.length >= pipe.maxBatch) this.#flush(pipe);
      else if (!pipe.scheduled) {
        pipe.scheduled = true;
        setImmediate(() => this.#flush(pipe));
      }
      if (ownTimer) {
        timer = setTimeout(() => {
          if (pipe.pending.get(cmd.seq) !== entry) return;
          this.#expire(pipe, cmd.seq, entry);
          this.#settled(pipe);
        }, Math.max(1, deadline - Date.now()));
      } else {
        this.#watch(pipe);
      }
    });
    return { [QUEUED]: answer };
  }

  // Waits for room in the queue until deadline; DEADLINE_EXCEEDED (NOT_SENT) past it.
  // (Sends take their turns one at a time, so one command at most waits here.)
  #room(pipe, cmd, deadline, limitMs) {
    return new Promise((resolve, reject) => {
      const waiter = { w: cmd[WEIGHT] };
      const timer = setTimeout(() => {
        const i = pipe.room.indexOf(waiter);
        if (i < 0) return;
        pipe.room.splice(i, 1);
        const e = new MeshdError('DEADLINE_EXCEEDED', `pipeline: command seq ${cmd.seq} was not queued within `
          + `${limitMs} ms: the ${pipe.queue.length} commands queued before it did not go out (the server is not `
          + 'reading the Submit stream: flow control); they stay queued and go out once it reads again, '
          + 'each unless its deadline passes first', grpc.status.DEADLINE_EXCEEDED, cmd.seq);
        e[NOT_SENT] = true;
        reject(e);
      }, Math.max(1, deadline - Date.now()));
      waiter.go = () => { clearTimeout(timer); resolve(); };
      pipe.room.push(waiter);
    });
  }

  // Lets the first command waiting for room in (all of them when the stream failed).
  #roomy(pipe) {
    while (pipe.room.length && (pipe.broken || Session.#fits(pipe, pipe.room[0].w))) {
      pipe.room.shift().go();
      if (!pipe.broken) break;
    }
  }

  // No answer by its deadline: the command rejects. Still in the client's queue (the
  // stream took nothing more: flow control), it is taken out and never sent, so its
  // caller knows it did not run; handed to the stream, it may still run and its answer
  // come, with the errors it took (a sync's go to the next one).
  #expire(pipe, seq, entry) {
    pipe.pending.delete(seq);
    const i = pipe.queue.indexOf(entry.cmd); // near the head: the oldest wait there
    if (i >= 0) {
      pipe.queue.splice(i, 1);
      pipe.bytes -= entry.cmd[WEIGHT].bytes;
      const e = new MeshdError('DEADLINE_EXCEEDED', `pipeline: command seq ${seq} was not sent within `
        + `${entry.timeoutMs} ms: it waited in the client's queue (the server is not reading the Submit stream: `
        + 'flow control); it was taken out of the queue and never sent, so it did not run (calling again is safe)',
      grpc.status.DEADLINE_EXCEEDED, seq);
      e[NOT_SENT] = true;
      entry.reject(e);
      this.#flush(pipe); // its room to a command waiting; a pipeline turned off may end now
      return;
    }
    pipe.late.add(seq);
    entry.reject(new MeshdError('DEADLINE_EXCEEDED', `no answer to command seq ${seq} within `
      + `${entry.timeoutMs} ms (the server is slow or not reading the Submit stream: flow control; it stays `
      + 'queued and may still run)', grpc.status.DEADLINE_EXCEEDED, seq));
  }

  // One timer per pipeline, at the oldest deadline of the commands on the session's
  // timeoutMs (they were issued in seq order, so their deadlines are in that order too).
  // It does not keep the process alive.
  #watch(pipe) {
    if (pipe.watch || pipe.broken) return;
    let first;
    for (const p of pipe.pending.values()) if (p.deadline !== undefined) { first = p; break; }
    if (!first) return;
    pipe.watch = setTimeout(() => {
      pipe.watch = null;
      const now = Date.now();
      for (const [seq, p] of pipe.pending) {
        if (p.deadline === undefined) continue;
        if (p.deadline > now) break;
        this.#expire(pipe, seq, p);
      }
      this.#settled(pipe);
      this.#watch(pipe);
    }, Math.max(1, first.deadline - Date.now()));
    pipe.watch.unref?.();
  }

  // Hands queued commands to the stream while it takes them (WRITES_MAX messages not
  // yet written at most). A message holds at most maxBatch commands, and its Literals
  // at most BATCH_BYTES of data (the server's messages are at most 4 MiB) and
  // LITERAL_MAX_SENT to the agents (the server refuses a Literal past that). A pipeline
  // turned off ends its stream once its queue went out.
  #flush(pipe) {
    pipe.scheduled = false;
    while (pipe.queue.length && !pipe.broken && pipe.writing < WRITES_MAX) {
      let n = 0, bytes = 0, sent = 0;
      for (; n < pipe.queue.length && n < pipe.maxBatch; n++) {
        const w = pipe.queue[n][WEIGHT];
        if (n && (bytes + w.bytes > BATCH_BYTES || sent + w.sent > LITERAL_MAX_SENT)) break;
        bytes += w.bytes;
        sent += w.sent;
      }
      const cmds = pipe.queue.splice(0, n);
      pipe.bytes -= bytes;
      pipe.writing += 1;
      pipe.stream.write(cmds.length === 1 ? cmds[0] : { batch: cmds }, (err) => {
        pipe.writing -= 1;
        if (!err) this.#flush(pipe); // (a failed write fails the stream: 'error')
      });
      pipe.messages += 1;
      pipe.commands += cmds.length;
    }
    if (pipe.closing && !pipe.ended && !pipe.queue.length && !pipe.broken && !pipe.cancelled) {
      pipe.ended = true;
      pipe.stream.end();
    }
    this.#roomy(pipe);
  }

  #answers(pipe, reply) {
    pipe.replies += 1;
    const results = reply.results?.length ? reply.results : (reply.result ? [reply.result] : []);
    for (const r of results) {
      const seq = Number(r.seq);
      const p = pipe.pending.get(seq);
      if (!p && pipe.late.delete(seq)) { // one that timed out: a sync's errors go to the next
        for (const e of r.errors ?? []) this.#lateErrors.push(e);
        if (r.error && r.error.kind && r.error.kind !== 'ERROR_KIND_UNSPECIFIED') {
          // its caller got DEADLINE_EXCEEDED and may think it ran: say that it did not
          process.emitWarning(`meshd: pipelined command seq ${seq}, whose answer came after its deadline, `
            + `was rejected: ${MeshdError.fromError(r.error).message}`, 'MeshdWarning');
        }
        continue;
      }
      if (!p) {
        // seq 0: a whole message refused (this client never sends one such)
        if (seq === 0 && r.error) this.#broke(pipe, MeshdError.fromError(r.error));
        continue;
      }
      pipe.pending.delete(seq);
      p.resolve(r); // execute() turns an error into its MeshdError
    }
    this.#settled(pipe);
  }

  // The stream ended or failed. A pipeline turned off whose answers all came is done;
  // otherwise the commands still awaiting an answer get the stream's error.
  #over(pipe, err) {
    const i = this.#old.indexOf(pipe);
    if (i >= 0) this.#old.splice(i, 1);
    if (pipe.cancelled) return; // close() cancelled it, after giving its commands their error
    if (pipe.closing && pipe.pending.size + pipe.late.size === 0) return;
    this.#broke(pipe, err);
  }

  // The stream failed: every command awaiting an answer gets its error, and so do later
  // ones (setPipeline opens a new stream). Without a kind of the server's (a dropped
  // connection), the server may have run them, their answers lost: their tensors are released.
  #broke(pipe, err) {
    if (!pipe.broken) pipe.broken = err;
    if (pipe.watch) clearTimeout(pipe.watch);
    pipe.watch = null;
    if (err[UNKINDED]) this.#releaseLost([...pipe.pending.values()].map((p) => p.cmd));
    for (const p of pipe.pending.values()) p.reject(pipe.broken);
    pipe.pending.clear();
    pipe.late.clear();
    pipe.queue.length = 0;
    pipe.bytes = 0;
    this.#roomy(pipe);
    this.#settled(pipe);
  }

  #settled(pipe) {
    if (pipe.pending.size + pipe.late.size === 0 || pipe.broken) this.#wake();
  }

  // Commands sent (or queued) on any pipeline of this session that have no answer yet.
  #unanswered() {
    let n = 0;
    for (const p of this.#old) n += p.pending.size + p.late.size;
    if (this.#pipe) n += this.#pipe.pending.size + this.#pipe.late.size;
    return n;
  }

  #wake() {
    if (this.#unanswered()) return;
    for (const w of this.#drains.splice(0)) w();
  }

  // Sends what is queued and waits until every command sent has its answer (those of
  // pipelines turned off before too), until deadline: past it DEADLINE_EXCEEDED naming
  // what is left (marked NOT_SENT for a call that then does not go out: notSent).
  #drain(deadline, limitMs, what, notSent = false) {
    const pipes = this.#pipe ? [...this.#old, this.#pipe] : this.#old;
    if (!pipes.length) return undefined;
    for (const p of pipes) this.#flush(p);
    if (!this.#unanswered()) return undefined;
    return new Promise((resolve, reject) => {
      const waiter = () => { clearTimeout(timer); resolve(); };
      const timer = setTimeout(() => {
        const i = this.#drains.indexOf(waiter);
        if (i >= 0) this.#drains.splice(i, 1);
        let n = 0, first = Infinity, queued = 0;
        for (const p of this.#pipe ? [...this.#old, this.#pipe] : this.#old) {
          for (const seq of [...p.pending.keys(), ...p.late]) { n += 1; first = Math.min(first, seq); }
          queued += p.queue.length;
        }
        const e = new MeshdError('DEADLINE_EXCEEDED', `${what}: ${n} pipelined command(s) sent before it `
          + `(seq ${first} first) not answered within ${limitMs} ms, ${queued} of them still queued on `
          + 'the client (the server is slow or not reading the Submit stream: flow control); they go out and run '
          + 'once it reads again (one still on the client when its own deadline passes is taken out, never sent)',
        grpc.status.DEADLINE_EXCEEDED);
        if (notSent) e[NOT_SENT] = true;
        reject(e);
      }, Math.max(1, deadline - Date.now()));
      this.#drains.push(waiter);
    });
  }

  // -------------------------------------------------------------- conveniences
  async createMesh(dims) {
    const ref = this.newRef();
    const res = await this.execute({
      create_mesh: { ref, dims: Object.entries(dims).map(([name, size]) => ({ name, size })) },
    });
    this.#meshes.set(Number(res.mesh.ref), res.mesh);
    return res.mesh; // MeshMeta {ref, dims, ranks, literals}
  }

  // The sub-mesh of `parent` (a MeshMeta or its ref) at the given index of each named
  // dim, which goes away ({gpu: 0}: Monarch's mesh.slice(gpu=0)); returns its MeshMeta.
  async sliceMesh(parent, sel) {
    this.#own(parent, 'sliceMesh', 'parent');
    const ref = this.newRef();
    const selectors = Object.entries(sel).map(([dim, index]) => ({ dim, index }));
    const res = await this.execute({ slice_mesh: { ref, parent: parent?.ref ?? parent, selectors } });
    this.#meshes.set(Number(res.mesh.ref), res.mesh);
    return res.mesh;
  }

  // A Factory ({kind, mesh, shape, dtype, value, ...}); returns the result TensorMeta.
  async factory(f) {
    this.#own(f.mesh, 'factory', 'mesh');
    checkDtype('factory', f.dtype);
    const ref = this.newRef();
    const mesh = f.mesh?.ref ?? f.mesh; // a MeshMeta, as load and upload take, or its ref
    const res = await this.execute({ factory: { dtype: 'DTYPE_FLOAT32', ...f, mesh, ref } });
    return res.tensors[0];
  }

  // What the file at `url` holds, read by the first agent of `mesh` (InspectUrl):
  // {format, file_size, version, tensors: [{name, dtype, shape, offset, nbytes}], metadata_json}.
  inspectUrl(url, mesh = 0) {
    if (this.#shut) return Promise.reject(Session.#noSession('inspectUrl'));
    try { this.#own(mesh, 'inspectUrl', 'mesh'); } catch (e) { return Promise.reject(e); }
    return this.#inspect(url, mesh.ref ?? mesh, false);
  }

  // InspectUrl in its turn (after the calls issued before it, as fetch); sizeOnly: the
  // file's size and version only (format "raw"), what a raw load pins.
  #inspect(url, mesh, sizeOnly) {
    const limitMs = this.timeoutMs;
    const deadline = Date.now() + limitMs; // from the call, as fetch: its turn too
    return this.#inOrder(async () => {
      await this.#drain(deadline, limitMs, 'inspectUrl');
      return this.#unary('InspectUrl', { url, mesh, size_only: sizeOnly }, deadline);
    }, deadline, limitMs, 'inspectUrl');
  }

  // The version every rank of a raw load must read: the one the first agent of the mesh
  // sees now (InspectUrl size_only; its size is not pinned: a raw file of another size
  // says "check dtype and shape"). Without it each rank checked only its own look, and a
  // file rewritten between two ranks' requests loaded old bytes on one and new on the
  // other, with no error. A URL the agent cannot read now loads unpinned ('') and fails
  // on its ranks, naming each, as it always did; a closed session or a URL the server
  // does not allow fails here, as Python's meshd.load.
  async #rawVersion(url, mesh) {
    try {
      return (await this.#inspect(url, mesh, true)).version ?? '';
    } catch (e) {
      if (!(e instanceof MeshdError) || ['NO_SESSION', 'PERMISSION_DENIED'].includes(e.kind)) throw e;
      return '';
    }
  }

  // A tensor each agent of `mesh` fetches itself from `url` (docs/loading.md): raw bytes
  // with {dtype: 'DTYPE_FLOAT32', shape}, else a .npy or safetensors file's header says.
  // A safetensors file without `name` gives an object of every tensor's TensorMeta.
  // A checkpoint's safetensors index (model.safetensors.index.json) loads each tensor
  // from the file it names, relative to the index's URL (its query dropped).
  // {shard: 'gpu', dim} splits the tensor's dim over that mesh dim.
  async load(mesh, url, { dtype, shape, name, shard = '', dim = 0, stream = 0 } = {}) {
    this.#own(mesh, 'load', 'mesh');
    this.#own(stream, 'load', 'stream');
    checkDtype('load', dtype);
    const m = mesh.ref ?? mesh;
    // fi: what InspectUrl said of the file (its size and version, which the agents
    // check: a file rewritten since is refused); for raw bytes its version only
    const one = async (t, fi, from = url) => {
      const ref = this.newRef();
      // a negative dim counts from the end, as in Python's meshd.load
      const d = shard && dim < 0 && Array.isArray(t.shape) ? dim + t.shape.length : dim;
      const res = await this.execute({
        load: { ref, mesh: m, stream, url: from, dtype: t.dtype, shape: t.shape,
          offset: t.offset ?? 0, file_size: fi?.file_size ?? 0, version: fi?.version ?? '',
          shard, dim: d },
      });
      return res.tensors[0];
    };
    if (dtype !== undefined || shape !== undefined) {
      if (dtype === undefined || shape === undefined) throw new TypeError('meshd: raw bytes need both dtype and shape');
      if (name !== undefined) throw new TypeError('meshd: name picks a tensor of a safetensors file; raw bytes (dtype and shape) have none');
      return one({ dtype, shape }, { version: await this.#rawVersion(url, m) });
    }
    const info = await this.inspectUrl(url, m);
    if (info.format === 'safetensors_index') return this.#loadIndex(m, url, info, name, one);
    if (info.format === 'npy') {
      if (name !== undefined) throw new MeshdError('BAD_ARGUMENT', `name '${name}': ${url.split(/[?#]/)[0]} is a .npy file, one tensor without a name; leave name unset`, grpc.status.INVALID_ARGUMENT);
      return one(info.tensors[0], info);
    }
    if (name !== undefined) {
      const t = info.tensors.find((x) => x.name === name);
      if (!t) throw new MeshdError('BAD_ARGUMENT', `no tensor named '${name}' in ${url.split('?')[0]}; it holds: ${info.tensors.map((x) => x.name).join(', ')}`, grpc.status.INVALID_ARGUMENT);
      return one(t, info);
    }
    const out = {};
    await this.#loadAll(info.tensors.map((t) => [t.name, () => one(t, info)]), out);
    return out;
  }

  // Runs each [name, load] of a many-tensor load into out, in order. One refused (a dim
  // that does not split, the quota): the tensors loaded before it are dropped, as the
  // caller gets no handle to drop them with, and the error is thrown.
  // The error names the tensor refused.
  async #loadAll(loads, out) {
    const done = [];
    let at;
    try {
      for (const [name, load] of loads) {
        at = name;
        out[name] = await load();
        done.push(Number(out[name].ref));
      }
    } catch (err) {
      if (done.length) await this.execute({ drop: { refs: done } }).catch(() => {});
      if (err instanceof MeshdError && at) {
        const msg = err.message.startsWith(`${err.kind}: `) ? err.message.slice(err.kind.length + 2) : err.message;
        throw new MeshdError(err.kind, `tensor '${at}': ${msg}`, err.code, err.seq);
      }
      throw err;
    }
  }

  // load() through a safetensors index: each file it names inspected once, and it must
  // hold the tensors the index puts in it.
  async #loadIndex(m, url, info, name, one) {
    const shown = url.split(/[?#]/)[0];
    const wanted = name === undefined ? info.tensors : info.tensors.filter((x) => x.name === name);
    if (!wanted.length) throw new MeshdError('BAD_ARGUMENT', `no tensor named '${name}' in the index ${shown}; it holds: ${info.tensors.map((x) => x.name).join(', ')}`, grpc.status.INVALID_ARGUMENT);
    const byFile = new Map();
    for (const t of wanted) byFile.set(t.file, [...(byFile.get(t.file) ?? []), t.name]);
    const plan = []; // every file checked before anything loads
    for (const [file, names] of byFile) {
      const from = new URL(file, shown).href;
      const fi = await this.inspectUrl(from, m);
      for (const n of names) {
        const t = fi.format === 'safetensors' ? fi.tensors.find((x) => x.name === n) : undefined;
        if (!t) throw new MeshdError('BAD_ARGUMENT', `the index ${shown} puts '${n}' in ${from.split(/[?#]/)[0]}, which is ${fi.format === 'safetensors' ? 'a file without it' : 'no safetensors file'}`, grpc.status.INVALID_ARGUMENT);
        plan.push([n, t, fi, from]);
      }
    }
    const got = {};
    await this.#loadAll(plan.map(([n, t, fi, from]) => [n, () => one(t, fi, from)]), got);
    if (name !== undefined) return got[name];
    return Object.fromEntries(wanted.map((t) => [t.name, got[t.name]]));
  }

  // A catalogue op: args as toArg() reads them; returns the first result TensorMeta.
  async call(op, args = [], kwargs = {}, { stream = 0, timeoutMs } = {}) {
    args.forEach((a, i) => this.#own(a, `call '${op}'`, `argument ${i}`, false));
    for (const [name, v] of Object.entries(kwargs)) this.#own(v, `call '${op}'`, `argument '${name}'`, false);
    this.#own(stream, `call '${op}'`, 'stream');
    const ref = this.newRef();
    const res = await this.execute({
      call: {
        op, args: args.map(toArg),
        kwargs: Object.entries(kwargs).map(([name, v]) => ({ name, value: toArg(v) })),
        results: [ref], stream,
      },
    }, { timeoutMs });
    return res.tensors[0];
  }

  // Monarch's reduce(dims, reduction, scatter, mesh, _inplace, out).
  // mesh: a sub-mesh (MeshMeta or ref) holding one rank of each reduced group and none
  // of the reduced dims, e.g. sliceMesh(m, {gpu: 0}): the result lives there only.
  // out: a tensor of this session the result is written into (on `mesh` when given);
  // inplace: the result is written into the input. Either way no ref is made (ref 0):
  // the answer is that tensor's TensorMeta, nothing new to drop. The server checks them
  // (SHAPE_MISMATCH, DTYPE_MISMATCH, WRONG_MESH, BAD_ARGUMENT: its kind and message).
  async reduce(input, dims = [], reduction = 'sum', { scatter = false, stream = 0, mesh = 0, out = 0, inplace = false } = {}) {
    this.#own(input, 'reduce', 'input');
    this.#own(mesh, 'reduce', 'mesh');
    this.#own(out, 'reduce', 'out');
    this.#own(stream, 'reduce', 'stream');
    const into = !!out || !!inplace;
    const ref = into ? 0 : this.newRef();
    const res = await this.execute({
      reduce: {
        ref, input: input.ref ?? input, dims, reduction, scatter, stream, mesh: mesh?.ref ?? mesh,
        out: out?.ref ?? out, inplace: !!inplace,
      },
    });
    return res.tensors[0];
  }

  // Waits until everything issued so far ran; throws the first run-time error not
  // reported before (a MeshdError; .errors holds all this Sync reported). Past
  // timeoutMs (default: the session's) it throws kind DEADLINE_EXCEEDED.
  async sync({ timeoutMs } = {}) {
    const res = await this.execute({ sync: {} }, { timeoutMs });
    const all = [...this.#lateErrors.splice(0), ...(res.errors ?? [])];
    if (all.length) {
      const errors = all.map((e) => MeshdError.fromError(e));
      errors[0].errors = errors;
      throw errors[0];
    }
  }

  // Uploads a typed array as the same tensor (of `shape`) on every rank of `mesh`; with
  // perRank, `data` holds one local tensor of `shape` per mesh rank, in rank order. The
  // bytes go by the session's dataPath, straight from `data` (no copy of the whole).
  // One deadline (the session's timeoutMs) from the upload's turn bounds all of it: the
  // pipelined answers it waits for, the plan, the Writes and FinishUpload, and a
  // fallback to the proxy. Async: bad arguments reject, as every failure does (the
  // body up to #inOrder still runs at the call, so the ref order is the call order).
  async upload(mesh, shape, data, { stream = 0, perRank = false } = {}) {
    const dtype = Object.keys(DTYPES).find((k) => data instanceof DTYPES[k]);
    if (!dtype) throw new TypeError('meshd: upload takes a Float32Array, Float64Array or integer typed array');
    if (this.#shut) return Promise.reject(Session.#noSession('upload'));
    this.#own(mesh, 'upload', 'mesh');
    this.#own(stream, 'upload', 'stream');
    const bytes = Buffer.from(data.buffer, data.byteOffset, data.byteLength);
    const header = { ref: this.newRef(), mesh: mesh.ref ?? mesh, stream, shape, dtype, per_rank: perRank,
      total_bytes: bytes.length };
    // Taken now, below every later call's refs: a new plan's, should the grants of the
    // first have come too late, then the proxy's, should a direct plan have claimed
    // header.ref and then fallen back.
    this.newRef();
    const spare = this.newRef();
    return this.#inOrder(() => this.#upload(header, spare, bytes)).then((t) => this.#mine(t));
  }

  // A small tensor whose bytes travel in the command itself (a Literal,
  // docs/protocol.md), upload()'s arguments: a command like any other, pipelined with
  // the rest and answered at once, so a failure on the agents comes at the next sync.
  // The bytes are copied at the call. At most 1 MiB, and at most 8 MiB over the ranks
  // it goes to (its bytes times the mesh's ranks unless perRank): more is a RangeError
  // (upload() it). `mesh`: a MeshMeta, or the ref of one this session made (another
  // goes in a message of its own, and the server checks it). Where the server, or an
  // agent of the mesh (MeshMeta.literals false), predates Literal, it uploads; a
  // Literal refused for such an agent turns this session's Literals off.
  async literal(mesh, shape, data, { stream = 0, perRank = false } = {}) {
    const dtype = Object.keys(DTYPES).find((k) => data instanceof DTYPES[k]);
    if (!dtype) throw new TypeError('meshd: literal takes a Float32Array, Float64Array or integer typed array');
    if (this.#shut) throw Session.#noSession('literal');
    this.#own(mesh, 'literal', 'mesh');
    this.#own(stream, 'literal', 'stream');
    const n = data.byteLength;
    const meta = Array.isArray(mesh?.ranks) ? mesh : this.#meshes.get(Number(mesh?.ref ?? mesh));
    const sent = perRank ? n : meta ? n * (meta.ranks.length || 1) : LITERAL_MAX_SENT;
    if (n > LITERAL_MAX_BYTES || sent > LITERAL_MAX_SENT) {
      throw new RangeError(`meshd: literal: ${n} bytes (${sent} to the mesh's ranks in all) are more than a ` +
        `Literal carries (${LITERAL_MAX_BYTES}, ${LITERAL_MAX_SENT} over the ranks); upload() them`);
    }
    if (this.literals && meta?.literals !== false) {
      const bytes = Buffer.from(new Uint8Array(data.buffer, data.byteOffset, n)); // a copy
      try {
        const res = await this.execute({
          literal: { ref: this.newRef(), mesh: mesh?.ref ?? mesh, stream, shape, dtype, per_rank: perRank, data: bytes },
        }, { [WEIGHT]: { bytes: n, sent } });
        return res.tensors[0];
      } catch (e) { // an agent older than Literal joined a mesh: upload from now on
        if (!(e instanceof MeshdError) || e.kind !== 'UNAVAILABLE' || !e.message.includes('predates the Literal')) throw e;
        this.literals = false;
      }
    }
    return this.upload(mesh, shape, data, { stream, perRank });
  }

  // Runs in its turn (#inOrder): the session's later ref-claiming calls wait for it.
  async #upload(header, spare, bytes) {
    const limitMs = this.timeoutMs;
    const deadline = Date.now() + limitMs; // one for the whole upload, whichever path
    // the header's ref after every queued command's
    await this.#drain(deadline, limitMs, 'upload');
    if (this.#wanted()) {
      const tensor = await this.#directUpload(header, bytes, deadline, spare - 1);
      if (tensor !== PROXY) return tensor;
      header = { ...header, ref: spare }; // a plan claimed the old one
    }
    let tensor;
    try {
      tensor = await Session.#slot(() => this.#proxyUpload(header, bytes, deadline), deadline);
    } catch (e) {
      // No kind of the server's (a deadline, a dropped connection): it may have defined
      // the tensor and its answer been lost, and nobody else holds the ref to free it.
      if (e?.[UNKINDED]) await this.#letGoInTurn(header.ref, 'release');
      throw e;
    }
    this.transferStats.proxyUploads += 1;
    return tensor;
  }

  // Every chunk is handed to the stream at once, without waiting for 'drain': they are
  // views of `bytes`, not copies, and the stream (a Writable) takes one at a time,
  // serializing the next only when HTTP/2 took the last; a server that stops reading
  // leaves about one serialized chunk (CHUNK) held beyond the tensor, whatever its size
  // (test/client.test.mjs measures it).
  #proxyUpload(header, bytes, deadline) {
    return new Promise((resolve, reject) => {
      // the channel is closed (close() gave up waiting for this call's turn): grpc-js would throw its own plain Error
      if (this.closed) { reject(Session.#noSession('Upload')); return; }
      const call = this.client.Upload(this.#md, { deadline }, (err, reply) => {
        if (err) {
          const e = MeshdError.fromRpc(err);
          if (!(err.metadata?.get(KIND_MD) ?? []).length) e[UNKINDED] = true;
          reject(e);
        } else if (!reply.tensor) reject(new MeshdError('INTERNAL', 'Upload answered no TensorMeta', grpc.status.INTERNAL));
        else resolve(reply.tensor);
      });
      call.write({ header });
      // A per-rank upload's chunks end where a rank's slice ends: the server sends each on
      // to its agent as it came (a chunk across two slices is split and copied there).
      const slice = header.per_rank
        ? header.shape.reduce((a, d) => a * Number(d), 1) * DTYPES[header.dtype].BYTES_PER_ELEMENT : 0;
      for (let i = 0; i < bytes.length;) {
        const end = Math.min(i + CHUNK, bytes.length, slice > 0 ? (Math.floor(i / slice) + 1) * slice : Infinity);
        call.write({ data: bytes.subarray(i, end) });
        i = end;
      }
      call.end();
    });
  }

  // The local tensor at the rank named by coords ({gpu: 1}) as a typed array by dtype
  // (Float32Array for float32, Float64Array for float64, ..., a Uint16Array of the raw
  // bits for float16 and bfloat16), with .shape and .dtype set; another dtype rejects
  // UNIMPLEMENTED before its bytes are read.
  // Past timeoutMs (default: the session's) it rejects with kind DEADLINE_EXCEEDED: one
  // deadline for all it waits for (its turn, the pipelined answers before it, the bytes).
  // In issue order: after every call issued before it reached the server (pipelined:
  // and was answered), and before those issued after it: they wait until the server
  // planned the fetch, which fixes the value, not for its bytes (close() waits for them).
  async fetch(ref, coords = {}, { timeoutMs } = {}) {
    if (this.#shut) throw Session.#noSession('fetch');
    this.#own(ref, 'fetch', 'tensor');
    const request = {
      ref: ref.ref ?? ref,
      coords: Object.entries(coords).map(([dim, index]) => ({ dim, index })),
    };
    const limitMs = timeoutMs ?? this.timeoutMs;
    const deadline = Date.now() + limitMs; // one for the whole fetch, whichever path and every wait
    const seq = this.seq; // the last command issued before it (#directFetch)
    let fixed; // later calls may go
    const planned = new Promise((resolve) => { fixed = resolve; });
    let work;
    await this.#inOrder(() => {
      work = (async () => {
        try {
          await this.#drain(deadline, limitMs, 'fetch'); // the tensor's command answered first
          if (this.#wanted()) {
            const out = await this.#directFetch(request, deadline, fixed, seq);
            if (out !== PROXY) return out;
          }
          const out = await Session.#slot(() => this.#proxyFetch(request, deadline, fixed), deadline);
          this.transferStats.proxyFetches += 1;
          return out;
        } finally {
          fixed();
        }
      })();
      const forget = () => { this.#fetches.delete(work); };
      this.#fetches.add(work);
      work.then(forget, forget);
      return planned;
    }, deadline, limitMs, 'fetch');
    return work;
  }

  // fn() again while it rejects RESOURCE_EXHAUSTED with `refusal` in its message (refused
  // before any byte moved, so trying again is safe), waiting 5 ms, doubling to 200 ms, until
  // deadline; then that error goes to the caller.
  static async #retryRefused(fn, deadline, refusal) {
    for (let wait = 5; ; wait = Math.min(2 * wait, 200)) {
      try {
        return await fn();
      } catch (e) {
        if (!(e instanceof MeshdError) || e.code !== grpc.status.RESOURCE_EXHAUSTED
          || !e.message.includes(refusal) || Date.now() + wait >= deadline) throw e;
      }
      await new Promise((resolve) => { setTimeout(resolve, wait); });
    }
  }

  // start() again while it rejects for --session-max-transfers only (QUOTA, refused at its
  // start: the session's own transfers in flight end soon, e.g. fetches issued together), as
  // the Python client's retry_transfers_full.
  static #slot(start, deadline) {
    return Session.#retryRefused(start, deadline, '--session-max-transfers');
  }

  // read() again while it rejects only because its agent already has its most Reads waiting
  // for their seqs (QUOTA "... Reads already wait for seqs on this agent", agent/data.c
  // READ_WAITING_MAX): refused before any byte, its grant kept for a retry; the waiting
  // Reads end as their seqs run (as the Python client's _reads_full).
  static #readsFull(read, deadline) {
    return Session.#retryRefused(read, deadline, 'Reads already wait for seqs');
  }

  // fetch's typed array for meta: the type for its dtype (UNIMPLEMENTED for one this
  // client has none for), of its shape's elements.
  static #typed(meta, what) {
    const T = FETCH_TYPES[meta.dtype];
    if (!T) {
      throw new MeshdError('UNIMPLEMENTED', `${what}: this client has no typed array for ${meta.dtype} `
        + `(it reads ${Object.keys(FETCH_TYPES).join(', ')})`, grpc.status.UNIMPLEMENTED);
    }
    return T;
  }

  static #allocate(T, meta, what) {
    const n = meta.shape.reduce((a, b) => a * b, 1);
    if (!Number.isSafeInteger(n) || n < 0 || meta.shape.some((d) => !Number.isSafeInteger(d) || d < 0)) {
      throw new MeshdError('INTERNAL', `${what}: the TensorMeta's shape [${meta.shape}] is no tensor's`, grpc.status.INTERNAL);
    }
    let out;
    try {
      out = new T(n);
    } catch (e) {
      throw new MeshdError('RESOURCE_EXHAUSTED', `${what}: no room for ${n} elements of ${meta.dtype} `
        + `(shape [${meta.shape}]): ${e.message}`, grpc.status.RESOURCE_EXHAUSTED);
    }
    out.shape = meta.shape;
    out.dtype = meta.dtype;
    return out;
  }

  // The bytes land in one typed array made at the TensorMeta (no copy of the whole);
  // they must be exactly what its shape and dtype need (else INTERNAL).
  #proxyFetch(request, deadline, fixed = () => {}) {
    return new Promise((resolve, reject) => {
      if (this.closed) { reject(Session.#noSession('Fetch')); return; } // as #proxyUpload
      const call = this.client.Fetch(request, this.#md, { deadline });
      let out = null;
      let view = null;
      let got = 0;
      let over = false; // settled: what comes after (the cancel's CANCELLED) is ignored
      const fail = (e) => {
        if (over) return;
        over = true;
        reject(e);
        call.cancel();
      };
      const bad = (why) => new MeshdError('INTERNAL', `Fetch: ${why}`, grpc.status.INTERNAL);
      call.on('data', (c) => {
        fixed(); // the first message: the server planned it
        if (over) return;
        try {
          if (c.part === 'meta') {
            if (out) throw bad('a second TensorMeta');
            out = Session.#allocate(Session.#typed(c.meta, 'fetch'), c.meta, 'fetch');
            view = new Uint8Array(out.buffer, out.byteOffset, out.byteLength);
            return;
          }
          if (!out) throw bad('bytes before the TensorMeta');
          if (got + c.data.length > view.length) {
            throw bad(`more bytes than shape [${out.shape}] of ${out.dtype} holds (${view.length})`);
          }
          view.set(c.data, got);
          got += c.data.length;
        } catch (e) {
          fail(e);
        }
      });
      call.on('error', (err) => {
        if (over) return;
        over = true;
        reject(MeshdError.fromRpc(err));
      });
      call.on('end', () => {
        if (over) return;
        over = true;
        if (!out) reject(bad('the stream ended without a TensorMeta'));
        else if (got !== view.length) {
          reject(bad(`got ${got} bytes where shape [${out.shape}] of ${out.dtype} needs ${view.length}`));
        } else resolve(out);
      });
    });
  }

  // -------------------------------------------------------------- direct data path
  #fallback(reason) {
    this.transferStats.fallbacks += 1;
    this.transferStats.lastFallback = reason;
  }

  // Whether the next transfer tries the direct path.
  #wanted() {
    if (this.dataPath === 'proxy') return false;
    if (this.dataPath === 'direct') return true;
    let why = '';
    if (this.tls && this.#agentsPlain) why = 'the session is over TLS and the agents are reached in plaintext';
    else if (this.#refused) why = 'the server does not offer PlanTransfer (its --data-path is proxy)';
    else if (Date.now() < this.#offUntil) why = `an agent did not connect within ${DIRECT_CONNECT_MS} ms less than ${DIRECT_RETRY_MS / 1000} s ago`;
    if (why) this.#fallback(why);
    return !why;
  }

  // A ready client for the agent at address, or null when it does not connect in waitMs.
  // tls: the plan's AgentTls; with a CA the channel is TLS verified with it (under
  // server_name), the server's certificate only.
  async #agent(address, tls, waitMs) {
    const ca = tls?.ca_pem ?? '';
    const name = tls?.server_name ?? '';
    const key = JSON.stringify([address, ca, name]);
    const known = this.#agents.get(key);
    if (known) return known;
    const Agent = loadAgentService(this.#protoFile ?? protoPath());
    const options = {
      'grpc.enable_http_proxy': 0,
      'grpc.max_receive_message_length': 64 << 20,
      'grpc.max_send_message_length': 64 << 20,
      'grpc.use_local_subchannel_pool': 1, // a connection per agent of its own
    };
    if (ca && name) options['grpc.ssl_target_name_override'] = name;
    const creds = ca ? grpc.credentials.createSsl(Buffer.from(ca)) : grpc.credentials.createInsecure();
    if (this.closed) throw Session.#noSession('direct transfer');
    const c = new Agent(address, creds, options);
    this.#dialing.add(c);
    let up;
    const end = Date.now() + waitMs;
    try {
      up = await connected(c.getChannel(), end);
    } finally {
      this.#dialing.delete(c);
    }
    // close() gave up on this transfer meanwhile: the channel would outlive the session
    if (this.closed) { c.close(); throw Session.#noSession('direct transfer'); }
    if (!up) {
      c.close();
      // a failed attempt, not the wait's end: over TLS, whether the handshake is why
      const why = ca && Date.now() + 10 < end ? await tlsFailure(address, ca, name, end - Date.now()) : '';
      if (why) this.#handshakes.set(address, why);
      else this.#handshakes.delete(address);
      return null;
    }
    this.#handshakes.delete(address);
    if (this.#agents.has(key)) { c.close(); return this.#agents.get(key); }
    this.#agents.set(key, c);
    return c;
  }

  // A session over TLS keeps its bytes encrypted: when the plan says the agents speak
  // plaintext, auto takes the proxy (and remembers it) and direct throws UNAVAILABLE.
  // True: use the proxy. The caller abandons the plan either way.
  #plainForTls(plan, what) {
    if (!this.tls || plan.agent_tls?.ca_pem) return false;
    if (this.dataPath === 'direct') {
      throw new MeshdError('UNAVAILABLE', `direct ${what}: the session is over TLS and the plan's agents `
        + "speak plaintext: the tensor's bytes would travel unencrypted; use dataPath 'auto' (which "
        + "takes the proxy then) or 'proxy'", grpc.status.UNAVAILABLE);
    }
    this.#agentsPlain = true;
    this.#fallback('the session is over TLS and the agents are reached in plaintext');
    return true;
  }

  // The agents of a plan are dialled only at host:port addresses: another (unix:/path,
  // dns:///name...) would reach something else. auto takes the proxy, direct throws
  // UNAVAILABLE. True: use the proxy. The caller abandons the plan either way.
  #notHostPort(plan, what) {
    const bad = plan.shards.find((sh) => !hostPort(sh.address));
    if (!bad) return false;
    const why = `direct ${what}: the plan names ${JSON.stringify(bad.address)} as the agent of rank ${bad.rank}, `
      + 'not host:port; refusing to dial it';
    if (this.dataPath === 'direct') {
      throw new MeshdError('UNAVAILABLE', `${why}; use dataPath 'auto' or 'proxy'`, grpc.status.UNAVAILABLE);
    }
    this.#fallback(why);
    return true;
  }

  // The deadline of a call that undoes a transfer given up on (its own deadline may
  // have passed): without it the server holds the transfer's slot until the grants expire.
  #cleanupDeadline() { return Date.now() + Math.min(this.timeoutMs, CLEANUP_MS); }

  // PlanTransfer's reply (transfer_id and after_seq as decimal strings, which requests
  // take as they are), or null when auto should use the proxy (the server does not offer it).
  // again: a new plan for a transfer whose grants came too late (testPause).
  async #plan(request, deadline, again = false) {
    try {
      const plan = await Session.#slot(() => this.#unary('PlanTransfer', request, deadline), deadline);
      await testPause(again);
      return plan;
    } catch (e) {
      const notOffered = e.code === grpc.status.UNIMPLEMENTED
        || (e.code === grpc.status.FAILED_PRECONDITION && e.message.includes('--data-path'));
      if (this.dataPath === 'auto' && notOffered) {
        this.#refused = true;
        this.#fallback(`the server refused PlanTransfer: ${e.message}`);
        return null;
      }
      throw e;
    }
  }

  // Whether the deadline is what ended a wait of `wait` ms for an agent's connection: the
  // wait was cut short by it and it has passed (within a few ms of timer slack). A
  // connection attempt that failed at once (refused, a failed handshake), with time left,
  // is the agent's failure, however little time was left.
  static #cutShort(wait, deadline) {
    return wait < DIRECT_CONNECT_MS && Date.now() + 10 >= deadline;
  }

  // The agent of shard sh could not be reached: throws (direct, or the deadline was what
  // cut the wait short), else records the fallback (auto).
  #unreachable(what, sh, cut) {
    const tlsWhy = this.#handshakes.get(sh.address);
    const why = tlsWhy ? `direct ${what}: the TLS handshake with rank ${sh.rank}'s agent at ${sh.address} failed `
      + `(${tlsWhy}), verifying it with the plan's cluster CA under its name`
      : `direct ${what}: rank ${sh.rank}'s agent at ${sh.address} does not answer within ${DIRECT_CONNECT_MS} ms`;
    if (cut && !tlsWhy) {
      throw new MeshdError('DEADLINE_EXCEEDED', `direct ${what}: no connection to rank ${sh.rank}'s agent at ${sh.address} before the deadline`, grpc.status.DEADLINE_EXCEEDED);
    }
    if (this.dataPath === 'direct') {
      throw new MeshdError('UNAVAILABLE', `${why}; use dataPath 'auto' or 'proxy' from outside the cluster`, grpc.status.UNAVAILABLE);
    }
    this.#offUntil = Date.now() + DIRECT_RETRY_MS;
    this.#fallback(why);
  }

  // A broken connection (UNAVAILABLE, the agent gave no kind) is AGENT_LOST, as the
  // server says of the same break on the proxied path.
  // A grant refused as late or for a full table says so, not the agent's bare refusal
  // (which reads as an authentication problem, or names no flag): marked REFUSAL.
  static #shardError(what, sh, err) {
    const e = MeshdError.fromRpc(err);
    const broke = e.kind === 'UNAVAILABLE' && !(err.metadata?.get(KIND_MD) ?? []).length;
    const why = err.details ?? err.message;
    const at = `direct ${what}, rank ${sh.rank} (agent ${sh.address})`;
    if (err.code === grpc.status.PERMISSION_DENIED && why.includes(LATE_REFUSAL)) {
      return Object.assign(new MeshdError(e.kind, `${LATE_MSG} (${at}: ${why})`, e.code), { [REFUSAL]: 'late' });
    }
    if (err.code === grpc.status.RESOURCE_EXHAUSTED && why.includes(TABLE_FULL_REFUSAL)) {
      return Object.assign(new MeshdError(e.kind, `${at}: the agent has too many transfers in flight (its `
        + "--max-transfer-nonces table is full); retry later, or use the proxied path (dataPath 'proxy', "
        + `or 'auto', which takes it then) (${why})`, e.code), { [REFUSAL]: 'full' });
    }
    return new MeshdError(broke ? 'AGENT_LOST' : e.kind, `${at}: ${
      broke ? `the connection to its agent broke (${why}): the agent died or cannot be reached` : why}`, e.code);
  }

  #grantMd(sh) {
    const md = new grpc.Metadata();
    md.set(GRANT_MD, Buffer.from(sh.grant));
    return md;
  }

  // Why a direct upload's plan does not split the tensor over the mesh as it should
  // (docs/protocol.md: one shard per rank of the mesh, in its row-major order, each rank
  // once; with per_rank, shard i gets the i-th slice of the shape's bytes), else ''.
  // The ranks' order is checked where this session knows the mesh's MeshMeta.
  #splitMismatch(header, bytes, shards) {
    const ranks = shards.map((sh) => Number(sh.rank));
    const n = ranks.length;
    if (new Set(ranks).size !== n) return `names a rank twice (ranks ${ranks.join(', ')})`;
    const want = this.#meshes.get(Number(header.mesh))?.ranks?.map(Number);
    if (want?.length && (n !== want.length || ranks.some((r, i) => r !== want[i]))) {
      return `names ranks ${ranks.join(', ')} where mesh ${header.mesh} has ranks ${want.join(', ')}`;
    }
    if (header.per_rank) {
      const slice = header.shape.reduce((a, d) => a * Number(d), 1) * DTYPES[header.dtype].BYTES_PER_ELEMENT;
      if (slice * n !== bytes.length) {
        return `has ${n} shards for ${slice ? bytes.length / slice : 0} ranks' rows (${bytes.length} bytes, ${slice} a rank)`;
      }
    }
    return '';
  }

  // Every shard's bytes straight to its agent, all at once; the tensor's TensorMeta, or
  // PROXY to use the proxy (nothing was defined). The first shard that fails stops
  // the others (their Writes cancelled) and undoes the plan at once (FinishUpload
  // without receipts); the upload rejects with that shard's error, naming its rank.
  // Writes refused before any byte was stored because they started past their grants'
  // start-by time: the plan is undone and planned once more with retryRef (0: this is
  // that new plan); one refused because its agent's grant table is full: PROXY (auto).
  async #directUpload(header, bytes, deadline, retryRef = 0) {
    const plan = await this.#plan({ upload: header }, deadline, !retryRef);
    if (!plan) return PROXY;
    const { shards } = plan;
    let undone = false;
    // Undone at once; the session's slot is free. An upload that a FinishUpload had
    // finished (its answers lost, #finishUpload) is answered with its tensor: dropped.
    const abandon = async () => {
      if (undone) return;
      undone = true;
      let reply;
      try {
        reply = await this.#unaryBy('FinishUpload', { transfer_id: plan.transfer_id, receipts: [] },
          this.#cleanupDeadline());
      } catch {
        return;
      }
      if (reply?.tensor) await this.#letGoInTurn(Number(reply.tensor.ref), 'drop');
    };
    const wait = Math.min(DIRECT_CONNECT_MS, deadline - Date.now());
    let agents;
    try { // (agent.proto missing next to a protoPath: the slot goes back all the same)
      if (!shards.length) {
        throw new MeshdError('INTERNAL', 'direct upload: the plan names no shard', grpc.status.INTERNAL);
      }
      const mismatch = this.#splitMismatch(header, bytes, shards);
      if (mismatch) {
        throw new MeshdError('INTERNAL', `direct upload: the plan ${mismatch}; no byte was sent`, grpc.status.INTERNAL);
      }
      if (this.#plainForTls(plan, 'upload') || this.#notHostPort(plan, 'upload')) {
        await abandon();
        return PROXY;
      }
      agents = await Promise.all(shards.map((sh) => this.#agent(sh.address, plan.agent_tls, Math.max(1, wait))));
    } catch (e) {
      await abandon();
      throw e;
    }
    const bad = agents.findIndex((a) => !a);
    if (bad >= 0) {
      const cut = Session.#cutShort(wait, deadline); // (before abandon's own wait)
      await abandon();
      this.#unreachable('upload', shards[bad], cut);
      return PROXY;
    }
    const each = header.per_rank ? bytes.length / shards.length : bytes.length;
    const calls = []; // each Write's stop()
    let receipts;
    try {
      receipts = await Promise.all(shards.map((sh, i) => this.#writeShard(
        agents[i], sh, header.per_rank ? bytes.subarray(i * each, (i + 1) * each) : bytes, deadline, calls)));
    } catch (e) {
      for (const stop of calls) stop(); // (their CANCELLED goes nowhere: Promise.all has settled)
      await abandon();
      if (e?.[REFUSAL] === 'late' && retryRef && Date.now() < deadline) {
        return this.#directUpload({ ...header, ref: retryRef }, bytes, deadline); // (the plan claimed its ref)
      }
      if (e?.[REFUSAL] === 'full' && this.dataPath === 'auto') {
        this.#fallback(e.message);
        return PROXY;
      }
      throw e;
    }
    if (Date.now() >= deadline) { // a FinishUpload past it would not go out: undo instead
      await abandon();
      throw new MeshdError('DEADLINE_EXCEEDED', `direct upload: every shard written, no time left for FinishUpload `
        + `within ${this.timeoutMs} ms`, grpc.status.DEADLINE_EXCEEDED);
    }
    const fin = await this.#finishUpload(plan.transfer_id, receipts, deadline, abandon);
    if (!fin.tensor) {
      throw new MeshdError('INTERNAL', 'direct upload: FinishUpload answered no TensorMeta', grpc.status.INTERNAL);
    }
    this.transferStats.directUploads += 1;
    return fin.tensor;
  }

  // FinishUpload with every shard's receipt: its reply. When no answer came (the deadline
  // passed, the connection dropped), the upload may have finished all the same, its answer
  // lost: it is asked once more, with the cleanup deadline (the server answers a finished
  // upload's FinishUpload again, and finishes one it had not yet), so that the tensor is
  // not left defined behind the caller's back while the upload rejects. Still no answer:
  // the transfer is abandoned (the first call may not have reached the server, which
  // would keep the slot; should the first have finished it, that answer names the
  // tensor, which abandon drops) and the first error thrown; another error (the
  // transfer failed, or was undone) is thrown as it is.
  async #finishUpload(transferId, receipts, deadline, abandon) {
    const request = { transfer_id: transferId, receipts };
    const lost = (e) => e.code === grpc.status.DEADLINE_EXCEEDED || e.code === grpc.status.UNAVAILABLE;
    let first;
    try {
      return await this.#unaryBy('FinishUpload', request, deadline);
    } catch (e) {
      if (!(e instanceof MeshdError) || !lost(e)) throw e;
      first = e;
    }
    try {
      return await this.#unaryBy('FinishUpload', request, this.#cleanupDeadline());
    } catch (e) {
      if (!(e instanceof MeshdError) || !lost(e)) throw e; // failed, or undone: why
      await abandon();
      throw first;
    }
  }

  // Lets go of ref (or refs), best effort, with the cleanup deadline, from inside the caller's
  // turn (#inOrder), which execute() would wait for: by a unary Execute. how: 'drop'
  // (a tensor known to stand) or 'release' (one that may: the server skips a ref that
  // is not live).
  async #letGoInTurn(ref, how) {
    // Always a unary Execute, seq 0 (only echoed): a seq taken here would be above those of
    // the calls issued during the upload (execute takes its seq at the call), and on the
    // Submit stream, written before them, it would get them refused BAD_ARGUMENT. The
    // upload drained the pipeline and holds the turn: nothing pipelined is outstanding.
    try {
      await this.#unaryBy('Execute', { seq: 0, [how]: { refs: [].concat(ref) } }, this.#cleanupDeadline());
    } catch {
      // best effort: the upload rejects all the same
    }
  }

  // A Write of part to shard sh's agent; pushes to `calls` a stop() that cancels it.
  #writeShard(agent, sh, part, deadline, calls) {
    return new Promise((resolve, reject) => {
      let stopped = false;
      const call = agent.Write(this.#grantMd(sh), { deadline }, (err, r) => {
        if (err) reject(Session.#shardError('upload', sh, err));
        else resolve({ rank: sh.rank, bytes: r.bytes, receipt: r.receipt });
      });
      calls.push(() => { stopped = true; call.cancel(); });
      let off = 0;
      const pump = () => { // at most a chunk or two buffered: flow control paces the rest
        while (!stopped && off < part.length) {
          const piece = part.subarray(off, off + WRITE_CHUNK);
          off += piece.length;
          if (!call.write({ data: piece })) { call.once('drain', pump); return; }
        }
        if (!stopped) call.end();
      };
      pump();
    });
  }

  // The shard straight from its agent into one preallocated typed array, or PROXY to
  // use the proxy. A Read refused before any byte moved because it started past its
  // grant's start-by time is planned once more; one refused because its agent's grant
  // table is full goes through the proxy (auto). Either only while no command was issued
  // since the fetch was issued (seq: the last command issued before it; #sameValue);
  // else, and the second time late, it rejects saying so.
  async #directFetch(request, deadline, fixed, seq) {
    try {
      return await this.#fetchOnce(request, deadline, fixed, false);
    } catch (e) {
      const viaProxy = async (f) => {
        const out = await Session.#slot(() => this.#proxyFetch(request, deadline, f), deadline);
        this.transferStats.proxyFetches += 1;
        return out;
      };
      let again;
      if (e?.[REFUSAL] === 'late') {
        again = async (f) => { // (auto: the new plan may send it through the proxy, in this turn too)
          const out = await this.#fetchOnce(request, deadline, f, true);
          return out === PROXY ? viaProxy(f) : out;
        };
      } else if (e?.[REFUSAL] === 'full' && this.dataPath === 'auto') {
        again = (f) => { this.#fallback(e.message); return viaProxy(f); };
      }
      const out = again && Date.now() < deadline ? await this.#sameValue(seq, again, deadline) : undefined;
      if (out === undefined) throw e;
      return out;
    }
  }

  // start(fixed) in a turn of its own (#inOrder) when no command was issued after seq,
  // later calls waiting until it calls fixed() or settles; its result, else undefined.
  // A fetch's new plan, or the proxy, then fixes the value its first plan did: a command
  // issued after the fetch (which let later calls go once planned) could have changed it.
  async #sameValue(seq, start, deadline) {
    let work;
    await this.#inOrder(() => {
      if (this.seq !== seq) return undefined;
      let fixed;
      const planned = new Promise((resolve) => { fixed = resolve; });
      work = start(fixed);
      work.then(fixed, fixed);
      return planned;
    }, deadline, this.timeoutMs, 'fetch');
    return work;
  }

  // One plan of #directFetch (again: a new plan for a late grant), or PROXY.
  async #fetchOnce(request, deadline, fixed, again) {
    const plan = await this.#plan({ fetch: request }, deadline, again);
    if (!plan) return PROXY;
    // The Read's read_receipt (it took the snapshot): FinishFetch with it sends the
    // agent no DropSnapshot; a plan given up on goes without one (its snapshot is dropped).
    let receipt;
    const finish = (ms, readReceipt) => this.#unaryBy('FinishFetch',
      { transfer_id: plan.transfer_id, ...(readReceipt ? { read_receipt: readReceipt } : {}) },
      Date.now() + ms);
    let quieted = false;
    const quiet = () => { // the plan given up on: its slot goes back (once)
      if (quieted) return undefined;
      quieted = true;
      return finish(ABANDON_MS).catch(() => {});
    };
    let agent, out, view, sh, meta;
    try { // whatever fails before the Read gives the transfer's slot back
      if (plan.shards.length !== 1 || !plan.meta) {
        throw new MeshdError('INTERNAL', `direct fetch: the plan names ${plan.shards.length} shards`
          + `${plan.meta ? '' : ' and no TensorMeta'} (a fetch's names one)`, grpc.status.INTERNAL);
      }
      [sh] = plan.shards;
      ({ meta } = plan);
      const T = Session.#typed(meta, 'direct fetch');
      if (this.#plainForTls(plan, 'fetch') || this.#notHostPort(plan, 'fetch')) { await quiet(); return PROXY; }
      const wait = Math.min(DIRECT_CONNECT_MS, deadline - Date.now());
      agent = await this.#agent(sh.address, plan.agent_tls, Math.max(1, wait));
      if (!agent) {
        const cut = Session.#cutShort(wait, deadline); // (before quiet's own wait)
        await quiet();
        this.#unreachable('fetch', sh, cut);
        return PROXY;
      }
      out = Session.#allocate(T, meta, 'direct fetch');
      view = new Uint8Array(out.buffer, out.byteOffset, out.byteLength);
    } catch (e) {
      await quiet();
      throw e;
    }
    fixed(); // later calls may go: the plan fixed the value (from here a new plan, or the proxy, only by #sameValue)
    try {
      await Session.#readsFull(() => new Promise((resolve, reject) => {
        let got = 0;
        const call = agent.Read({ session_id: this.id, ref: request.ref, max_chunk_bytes: READ_CHUNK,
          after_seq: sh.after_seq }, this.#grantMd(sh), { deadline });
        call.on('data', (c) => {
          if (c.part !== 'data') { // the spec: the plan's meta said it, but for the receipt
            if (c.read_receipt?.length) receipt = c.read_receipt;
            return;
          }
          if (got + c.data.length > view.length) {
            call.cancel();
            reject(new MeshdError('INTERNAL', `direct fetch, rank ${sh.rank}: the agent sent more bytes than the TensorMeta's ${view.length}`, grpc.status.INTERNAL));
            return;
          }
          view.set(c.data, got);
          got += c.data.length;
        });
        call.on('error', (err) => reject(Session.#shardError('fetch', sh, err)));
        call.on('end', () => (got === view.length ? resolve() : reject(new MeshdError('INTERNAL',
          `direct fetch, rank ${sh.rank}: got ${got} bytes where the TensorMeta needs ${view.length}`, grpc.status.INTERNAL))));
      }), deadline);
    } catch (e) {
      await quiet();
      throw e;
    }
    try {
      await finish(Math.max(1, deadline - Date.now()), receipt); // throws if the value failed on any rank
    } catch (e) {
      // No answer: it may not have reached the server (little time was left, the connection
      // dropped), which would hold the slot and the agent's snapshot until the grant expires.
      if (e.code === grpc.status.DEADLINE_EXCEEDED || e.code === grpc.status.UNAVAILABLE) await quiet();
      throw e;
    }
    this.transferStats.directFetches += 1;
    return out;
  }

  // Every call issued before it goes out first, every pipelined command is answered
  // and every fetch issued before it has its bytes (the session's timeoutMs at most, from
  // the call: past it, the session still closes and close() rejects DEADLINE_EXCEEDED
  // naming what was left; the calls still waiting for those answers reject NO_SESSION).
  // Calls made once close() was called reject NO_SESSION without being sent.
  close() {
    if (this.closed) return Promise.resolve();
    this.#closeCalled = true;
    this.#closing ??= this.#close(); // a second call while it runs waits for the same
    return this.#closing;
  }

  async #close() {
    const limitMs = this.timeoutMs;
    const deadline = Date.now() + limitMs;
    let err;
    try {
      try {
        await this.#inOrder(async () => {
          this.#off(); // the stream ends after what is queued
          await this.#drain(deadline, limitMs, 'close');
        }, deadline, limitMs, 'close');
      } catch (e) {
        err = e;
      }
      try {
        await this.#fetched(deadline, limitMs); // the agents' channels and FinishFetch still needed
      } catch (e) {
        err ??= e;
      }
      this.stopKeepAlive();
      await this.#unaryBy('CloseSession', {}, Math.max(deadline, Date.now() + CLOSE_LAST_TRY_MS));
    } catch (e) {
      err ??= e;
    } finally {
      this.closed = true;
      this.stopKeepAlive();
      this.#abandon();
      this.client.close();
      for (const a of this.#agents.values()) a.close();
      this.#agents.clear();
      for (const a of this.#dialing) a.close();
    }
    if (err) throw err;
  }

  // Waits until every fetch in flight (issued before close()) settled, until deadline:
  // past it DEADLINE_EXCEEDED (the session closes under them all the same).
  async #fetched(deadline, limitMs) {
    if (!this.#fetches.size) return;
    let timer;
    const cut = await Promise.race([
      Promise.allSettled([...this.#fetches]).then(() => false),
      new Promise((resolve) => { timer = setTimeout(resolve, Math.max(1, deadline - Date.now()), true); }),
    ]);
    clearTimeout(timer);
    if (cut) {
      throw new MeshdError('DEADLINE_EXCEEDED', `close: ${this.#fetches.size} fetch(es) issued before it still `
        + `moving bytes after ${limitMs} ms; the session closed under them`, grpc.status.DEADLINE_EXCEEDED);
    }
  }

  // The session is closed: the streams still open end now, and a call still waiting for
  // an answer on one of them gets NO_SESSION (their CANCELLED is the client's own: not reported).
  #abandon() {
    for (const pipe of this.#pipe ? [...this.#old, this.#pipe] : [...this.#old]) {
      pipe.cancelled = true;
      pipe.broken ??= new MeshdError('NO_SESSION', 'the session is closed', grpc.status.UNAUTHENTICATED);
      for (const [seq, p] of pipe.pending) {
        p.reject(new MeshdError('NO_SESSION', `the session was closed before command seq ${seq} was answered`,
          grpc.status.UNAUTHENTICATED, seq));
      }
      pipe.pending.clear();
      pipe.late.clear();
      pipe.queue.length = 0;
      if (pipe.watch) clearTimeout(pipe.watch);
      this.#roomy(pipe);
      pipe.stream.cancel();
    }
    this.#old = [];
    this.#pipe = null;
    this.#wake();
  }
}

const MAX_TOKEN = 4096;

// A token is 1..4096 visible ASCII characters (what a tokens file line holds); the
// message names `what` and never shows the token.
function checkToken(token, what) {
  if (typeof token !== 'string') throw new TypeError(`meshd: ${what}: the token must be a string, got ${typeof token}`);
  if (token.length > MAX_TOKEN) throw new RangeError(`meshd: ${what}: the token is ${token.length} characters, more than ${MAX_TOKEN}`);
  const bad = [...token].findIndex((ch) => ch < '!' || ch > '~');
  if (bad >= 0) {
    throw new RangeError(`meshd: ${what}: the token has a character that is not visible ASCII at position ${bad} `
      + '(spaces, control characters and non-ASCII are not allowed)');
  }
}

// PEM bytes from a Buffer, a PEM string, or a file path; errors name `what`, never the contents.
function readPem(value, what) {
  if (value === undefined || value === null) return null;
  let data;
  let origin = what;
  if (Buffer.isBuffer(value) || value instanceof Uint8Array) data = Buffer.from(value);
  else if (typeof value === 'string' && value.includes('-----BEGIN')) data = Buffer.from(value);
  else if (typeof value === 'string') {
    try {
      data = readFileSync(value);
    } catch (e) {
      throw new Error(`meshd: ${what}: cannot read ${value}: ${e.code ?? e.message}`);
    }
    origin = `${what} (${value})`;
  } else throw new TypeError(`meshd: ${what}: expected a PEM Buffer or a file path, got ${typeof value}`);
  if (!data.includes('-----BEGIN')) throw new Error(`meshd: ${origin}: not PEM (no '-----BEGIN' line)`);
  return data;
}

// The hosts a gRPC target names ([] for a local socket).
function targetHosts(addr) {
  let a = addr.trim();
  if (a.startsWith('unix:') || a.startsWith('unix-abstract:')) return [];
  for (const scheme of ['dns:', 'ipv4:', 'ipv6:']) {
    if (a.startsWith(scheme)) {
      a = a.slice(scheme.length);
      if (a.startsWith('//')) { const slash = a.indexOf('/', 2); a = slash >= 0 ? a.slice(slash + 1) : a.slice(2); }
      break;
    }
  }
  return a.split(',').map((part) => {
    const p = part.trim();
    if (p.startsWith('[')) return p.slice(1, p.includes(']') ? p.indexOf(']') : undefined);
    if ((p.match(/:/g) ?? []).length === 1) return p.slice(0, p.indexOf(':'));
    return p; // no port, or a bare IPv6 address
  });
}

const LOOPBACK = new BlockList(); // IPv4-mapped IPv6 addresses match the IPv4 rule
LOOPBACK.addSubnet('127.0.0.0', 8, 'ipv4');
LOOPBACK.addAddress('::1', 'ipv6');

// True if every host addr names is loopback (localhost, 127.0.0.0/8, ::1) or it is a local socket.
export function isLoopback(addr) {
  return targetHosts(addr).every((host) => {
    const h = host.split('%')[0].toLowerCase();
    if (h === 'localhost') return true;
    const family = isIP(h);
    return family !== 0 && LOOPBACK.check(h, family === 4 ? 'ipv4' : 'ipv6'); // a name may resolve anywhere
  });
}

const envOf = (name) => process.env[name] || undefined; // empty counts as unset

// The channel credentials, channel options and base metadata of connect()'s options.
// tls unset (or null): TLS when $MESHD_TLS says so or any certificate option or server
// name (given or from the environment) is set; tls: true always; tls: false never, and
// then no MESHD_TLS* variable is read (a certificate option given with it is an error).
export function resolveSecurity(addr, { token, tls, rootCerts, certChain, privateKey,
  serverName, insecure = false } = {}) {
  let tok = token;
  if (tok === undefined || tok === null) {
    tok = envOf('MESHD_TOKEN');
    if (tok !== undefined) checkToken(tok, '$MESHD_TOKEN');
  } else if (tok === '') tok = undefined; // explicitly none: MESHD_TOKEN is not read
  else checkToken(tok, 'token');
  const off = tls === false; // explicitly plaintext: the environment does not turn TLS on
  if (off) {
    const given = Object.entries({ rootCerts, certChain, privateKey, serverName })
      .filter(([, v]) => v !== undefined && v !== null).map(([k]) => k);
    if (given.length) throw new Error(`meshd: tls: false was given with ${given.join(', ')}, which only TLS uses`);
  }
  const fromEnv = (env) => (off ? undefined : envOf(env));
  const pem = (v, what, env) => (v !== undefined && v !== null ? readPem(v, what) : readPem(fromEnv(env), `$${env}`));
  const roots = pem(rootCerts, 'rootCerts', 'MESHD_TLS_CA');
  const chain = pem(certChain, 'certChain', 'MESHD_TLS_CERT');
  const key = pem(privateKey, 'privateKey', 'MESHD_TLS_KEY');
  if (!chain !== !key) {
    const [have, miss] = chain ? ['certChain', 'privateKey'] : ['privateKey', 'certChain'];
    throw new Error(`meshd: ${have} was given without ${miss} (MESHD_TLS_CERT/MESHD_TLS_KEY): a client certificate needs both`);
  }
  const name = serverName ?? fromEnv('MESHD_TLS_SERVER_NAME');
  let useTls;
  if (tls === undefined || tls === null) { // $MESHD_TLS is read only when tls is not given
    const envTls = (envOf('MESHD_TLS') ?? '').toLowerCase();
    if (!['', '0', '1', 'true', 'false', 'yes', 'no'].includes(envTls)) {
      throw new Error(`meshd: $MESHD_TLS: expected 1/0/true/false/yes/no, got '${envTls}'`);
    }
    useTls = ['1', 'true', 'yes'].includes(envTls) || Boolean(roots || chain || name);
  } else useTls = Boolean(tls) || Boolean(roots || chain || name);
  if (tok && !useTls && !insecure && !isLoopback(addr)) {
    throw new Error(`meshd: refusing to send a token in plaintext to ${addr}, which is not a loopback address: `
      + 'connect with TLS (tls: true or rootCerts), or pass insecure: true to send it anyway');
  }
  const options = { 'grpc.enable_http_proxy': 0 };
  if (useTls && name) options['grpc.ssl_target_name_override'] = name;
  const creds = useTls ? grpc.credentials.createSsl(roots, key, chain) : grpc.credentials.createInsecure();
  const md = new grpc.Metadata();
  if (tok) md.set('authorization', `Bearer ${tok}`);
  return { creds, options, md, tls: useTls };
}

// Connects and creates a session. Security options: see the top of this file.
export async function connect(addr, { clientName = 'meshd-node', ttlSeconds = 0, quotaBytes = 0,
  timeoutMs = 60000, protoPath: file, token, tls, rootCerts, certChain, privateKey, serverName,
  insecure, dataPath = 'auto' } = {}) {
  checkDataPath(dataPath);
  const sec = resolveSecurity(addr, { token, tls, rootCerts, certChain, privateKey, serverName, insecure });
  const protoFile = file ?? protoPath();
  const Svc = loadService(protoFile);
  const client = new Svc(addr, sec.creds, { ...sec.options, 'grpc.per_rpc_retry_buffer_size': RETRY_BUFFER_BYTES });
  const reply = await new Promise((resolve, reject) => {
    client.CreateSession({ client_name: clientName, ttl_seconds: ttlSeconds, quota_bytes: quotaBytes },
      sec.md, { deadline: Date.now() + timeoutMs }, (err, r) => {
        if (err) reject(MeshdError.fromRpc(err));
        else resolve(r);
      });
  }).catch((e) => { client.close(); throw e; });
  return new Session(client, reply, timeoutMs, sec.md, { tls: sec.tls, dataPath, protoFile });
}

export { grpc };
