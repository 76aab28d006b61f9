// TypeScript declarations for meshd.mjs (read that file's header first: proto lookup,
// security options, keepalive). TypeScript finds them through package.json ("types",
// "exports"), so import the package by name: `import { connect } from 'meshd-client'`.
//
// Replies are what @grpc/proto-loader makes with meshd.mjs's options (keepCase: true,
// longs: Number, enums: String, defaults: true, oneofs: true): field names as in
// api/meshd/v1/tensor_service.proto, 64-bit integers as numbers, enums as their names,
// every scalar and repeated field present (0, '', false, []), an unset message field
// null, and a oneof named by a string field (FetchChunk.part: 'meta' | 'data').
// test/types-check.ts holds these declarations to the API as the examples use it.
/// <reference types="node" />
import * as grpc from '@grpc/grpc-js';
import { inspect } from 'node:util';

export { grpc };

// ------------------------------------------------------------------ enums

export type DType =
  | 'DTYPE_UNSPECIFIED' | 'DTYPE_FLOAT32' | 'DTYPE_FLOAT64' | 'DTYPE_FLOAT16' | 'DTYPE_BFLOAT16'
  | 'DTYPE_INT8' | 'DTYPE_UINT8' | 'DTYPE_INT16' | 'DTYPE_INT32' | 'DTYPE_INT64' | 'DTYPE_BOOL';

/** ErrorKind names without their `ERROR_KIND_` prefix: what MeshdError.kind holds. */
export type ErrorKind =
  | 'UNSPECIFIED' | 'WRONG_MESH' | 'WRONG_STREAM' | 'DROPPED' | 'BORROWED' | 'MUTATING_BORROW'
  | 'UNKNOWN_REF' | 'REF_REUSED' | 'UNKNOWN_OP' | 'BAD_ARGUMENT' | 'SHAPE_MISMATCH'
  | 'DTYPE_MISMATCH' | 'BAD_DIM' | 'QUOTA' | 'REMOTE_FAILURE' | 'DEPENDENT_FAILURE'
  | 'AGENT_LOST' | 'NO_SESSION' | 'UNAVAILABLE' | 'DEADLINE_EXCEEDED' | 'UNAUTHENTICATED'
  | 'PERMISSION_DENIED';

/** The proto's ErrorKind enum as a reply carries it ("ERROR_KIND_UNKNOWN_OP"). */
export type ErrorKindName = `ERROR_KIND_${ErrorKind}`;

export type TensorState =
  | 'TENSOR_STATE_UNSPECIFIED' | 'TENSOR_STATE_LIVE' | 'TENSOR_STATE_DROPPED' | 'TENSOR_STATE_FAILED';

/** Factory.kind (server/commands.c's factory_kinds). */
export type FactoryKind = 'empty' | 'zeros' | 'ones' | 'full' | 'arange' | 'rand' | 'randn' | 'rank';

/** Reduce.reduction (core/tensor/reduction.h); band/bor/bxor: integer and bool dtypes only. */
export type Reduction = 'sum' | 'avg' | 'product' | 'min' | 'max' | 'band' | 'bor' | 'bxor' | 'stack';

// ------------------------------------------------------------------ replies

/** The proto's Error message (named so as not to hide the global Error). */
export interface ProtoError {
  kind: ErrorKindName;
  message: string;
  /** the gRPC status code the error maps to */
  code: number;
  /** the failing (root) command's seq; 0 when unknown */
  seq: number;
  ref: number;
  session_id: string;
  /** agent -> server reports only */
  command_seq: number;
}

export interface Dim { name: string; size: number }

export interface TensorMeta {
  ref: number;
  shape: number[];
  dtype: DType;
  strides: number[];
  mesh: number;
  stream: number;
  state: TensorState;
  /** why it is failed or dropped */
  error: ProtoError | null;
  storage_offset: number;
  /** the id of its memory, shared by its aliases (a Drop of one drops all); 0: an older server */
  storage: number;
}

export interface MeshMeta {
  ref: number;
  dims: Dim[];
  /** world ranks, row-major over dims */
  ranks: number[];
  /** every rank's agent runs Literal commands */
  literals: boolean;
}

export interface CommandResult {
  seq: number;
  /** set when the command was rejected (execute() throws it instead) */
  error: ProtoError | null;
  tensors: TensorMeta[];
  /** CreateMesh / SliceMesh */
  mesh: MeshMeta | null;
  /** Sync: run-time errors not reported before */
  errors: ProtoError[];
}

export interface UrlTensor {
  /** safetensors key; '' for .npy */
  name: string;
  dtype: DType;
  shape: number[];
  offset: number;
  nbytes: number;
  /** a safetensors index's entry: the file that holds it, relative to the index */
  file: string;
}

export interface InspectUrlReply {
  format: 'npy' | 'safetensors' | 'safetensors_index';
  file_size: number;
  /** in header order */
  tensors: UrlTensor[];
  /** safetensors __metadata__, or '' */
  metadata_json: string;
  /** its ETag ("etag ...") or modification time ("mtime ..."), which a load checks; '' none */
  version: string;
}

export interface CreateSessionReply {
  session_id: string; token: string; ttl_seconds: number;
  /** what the server takes beyond the base protocol, e.g. 'literal' */
  features: string[];
}
export interface KeepAliveReply { ttl_seconds: number }

export interface AgentInfo {
  rank: number; address: string; device: string; memory_bytes: number; allocated_bytes: number;
  healthy: boolean; agent_id: string; data_port: number; registered_unix_ms: number;
  /** taken out of placement by DrainAgent (sessions created since get no mesh on it) */
  drained: boolean;
  /** what the agent reported at registration ('' from an agent too old to say) */
  version: string; commit: string; build_type: string; cuda: boolean;
}
export interface SessionInfo {
  session_id: string; client_name: string; bytes_held: number; live_tensors: number;
  idle_ms: number; queued_commands: number; owner: string;
  /** commands accepted so far (a batch counts each of its commands) */
  commands: number;
  /** since CreateSession */
  age_ms: number;
}
/** What the server is (GetInfo): its build, how long it has run, the pool's counts and its
 * first agents (rank order, 1024 at most). Every agent: `Session.agents()` (ListAgents, paged). */
export interface GetInfoReply {
  version: string; commit: string; build_type: string; cuda: boolean; uptime_ms: number;
  /** every agent unless agents_truncated: then the 256 of the lowest ranks */
  agents: AgentInfo[];
  /** more agents are registered than `agents` holds */
  agents_truncated: boolean;
  /** registered agents, those healthy, those drained (0 from a server older than these) */
  agents_total: number; agents_healthy: number; agents_drained: number;
}
/** LoadProgress: a rank that did not answer in time. */
export interface LoadProgressRank { rank: number; kind: ErrorKindName; message: string }
export interface OpInfo { name: string; schema: string; view: boolean; inplace: boolean; factory: boolean }
export interface LoadProgress { ref: number; done_bytes: number; total_bytes: number; failed: boolean }

/** after_seq: 64 bits, as a decimal string (unary('PlanTransfer') gives every other integer as a number) */
export interface ShardGrant { rank: number; address: string; grant: Buffer; after_seq: string }
/** How to dial the agents' data port over TLS (unset: plaintext). */
export interface AgentTls { ca_pem: string; server_name: string }
export interface PlanTransferReply {
  /** 64 bits, as a decimal string (a Number would round it) */
  transfer_id: string; shards: ShardGrant[]; meta: TensorMeta | null; expiry_unix_ms: number;
  agent_tls: AgentTls | null;
}

/** What upload() takes; the dtype follows the array (Uint8Array: DTYPE_UINT8). */
export type UploadArray =
  | Float32Array | Float64Array | Int8Array | Uint8Array | Int16Array | Int32Array | BigInt64Array;
/**
 * What fetch() resolves to: the local tensor's bytes as a typed array by dtype, upload()'s
 * arrays and, for DTYPE_FLOAT16 and DTYPE_BFLOAT16, a Uint16Array of the raw bits (JS has
 * no such floats: decode them yourself). Another dtype rejects with MeshdError UNIMPLEMENTED.
 */
export type FetchArray = UploadArray | Uint16Array;
/** Narrow it with instanceof (`v instanceof Float32Array`); DTYPE_BOOL is a Uint8Array,
 * float16 and bfloat16 a Uint16Array (tell them apart by .dtype). */
export type Fetched = FetchArray & { shape: number[]; dtype: DType };

// ------------------------------------------------------------------ requests

/** A tensor or mesh: its ref, or anything with .ref (a TensorMeta, a MeshMeta). Refs are
 * per session: a TensorMeta or MeshMeta another session handed out, or a bare ref this
 * session did not hand out (another session's, one never handed out), is refused
 * (MeshdError BAD_ARGUMENT naming the argument). */
export type Ref = number | { ref: number };

/**
 * One argument of call(): a number is a double (`f`), a boolean `b`, a string `s`,
 * null/undefined `none`, a bigint or a TensorMeta (an object with .ref and more) a
 * tensor ref, a number[] an int list, a TensorMeta[] a tensor list (cat, stack); an Arg
 * object passes through as it is.
 */
export type CallArg =
  | number | boolean | string | null | undefined | bigint | number[] | TensorMeta | TensorMeta[] | Arg;

/** The proto's Arg: exactly one of its fields. */
export type Arg =
  | { ref: number } | { f: number } | { i: number } | { b: boolean } | { ints: { values: number[] } }
  | { dtype: DType } | { s: string } | { none: true } | { refs: { refs: number[] } };

export interface MeshSelector {
  dim: string;
  index?: number;
  range?: { start?: number; stop?: number; step?: number; has_stop?: boolean; has_step?: boolean };
}

/** A Factory; factory() fills in ref, and dtype when not given. */
export interface FactoryOptions {
  kind: FactoryKind;
  /** the mesh: its MeshMeta or its ref */
  mesh: MeshMeta | number;
  shape?: number[];
  /** default 'DTYPE_FLOAT32' */
  dtype?: DType;
  /** 0: main, the session's default stream */
  stream?: number;
  /** full */
  value?: number;
  /** rand / randn, with has_seed: true */
  seed?: number;
  has_seed?: boolean;
  /** rank: the mesh dim whose coordinate is wanted */
  dim?: string;
  /** arange */
  start?: number;
  end?: number;
  step?: number;
}

export interface PipelineOptions {
  /** commands per Submit message, 1..4096 (default 256); the client queues at most twice
   * as many (and 2 MiB) behind the messages the stream has not taken yet */
  maxBatch?: number;
}

export interface PipelineStats {
  /** commands handed to the Submit stream */
  commands: number;
  /** the messages they went in */
  messages: number;
  /** the SubmitReply messages their answers came in */
  replies: number;
  /** commands queued on the client, not yet handed to the stream (flow control) */
  queued: number;
}

/** One Command for execute(): exactly one kind; seq is filled in. */
export type Command =
  | { create_mesh: { ref: number; dims: Dim[] } }
  | { slice_mesh: { ref: number; parent: number; selectors: MeshSelector[] } }
  | { create_stream: { ref: number; name: string } }
  | { factory: FactoryOptions & { ref: number } }
  | { call: { op: string; args?: Arg[]; kwargs?: { name: string; value: Arg }[]; results: number[]; stream?: number } }
  | { reduce: { ref: number; input: number; dims?: string[]; reduction: Reduction; scatter?: boolean; inplace?: boolean; out?: number; stream?: number; mesh?: number } }
  | { to_mesh: { ref: number; input: number; selection?: MeshSelector[]; dst_mesh: number; dst_stream?: number } }
  | { borrow: { ref: number; input: number; stream?: number; mutable?: boolean; borrow: number } }
  | { drop_borrow: { borrow: number } }
  | { drop: { refs: number[] } }
  | { release: { refs: number[] } }
  | { sync: { stream?: number; has_stream?: boolean } }
  | { describe: { ref: number } }
  | { load: { ref: number; mesh: number; url: string; dtype: DType; shape: number[]; stream?: number; offset?: number; file_size?: number; version?: string; shard?: string; dim?: number } }
  | { literal: { ref: number; mesh: number; stream?: number; shape: number[]; dtype: DType; per_rank?: boolean; data: Uint8Array } };

/** The unary RPCs unary() can make: [request, reply]. */
export interface UnaryMethods {
  CreateSession: [{ client_name?: string; ttl_seconds?: number; quota_bytes?: number }, CreateSessionReply];
  CloseSession: [Record<string, never>, Record<string, never>];
  KeepAlive: [Record<string, never>, KeepAliveReply];
  /** paged: follow next_page_token ("" on the last page), or call agents() */
  ListAgents: [{ page_size?: number; page_token?: string }, { agents: AgentInfo[]; agent_tls: AgentTls | null; next_page_token: string }];
  GetInfo: [Record<string, never>, GetInfoReply];
  /** admin principals only; drain false puts the rank back */
  DrainAgent: [{ rank: number; drain?: boolean }, { agent: AgentInfo | null }];
  ListSessions: [{ page_size?: number; page_token?: string }, { sessions: SessionInfo[]; next_page_token: string }];
  ListOps: [Record<string, never>, { ops: OpInfo[] }];
  Execute: [Command & { seq: number }, CommandResult];
  InspectUrl: [{ url: string; mesh?: number }, InspectUrlReply];
  LoadProgress: [{ refs: number[] }, { loads: LoadProgress[]; unanswered: LoadProgressRank[] }];
  PlanTransfer: [object, PlanTransferReply];
  FinishUpload: [{ transfer_id: string | number; receipts: { rank: number; bytes: number; receipt: Uint8Array }[] }, { tensor: TensorMeta | null }];
  FinishFetch: [{ transfer_id: string | number }, Record<string, never>];
}

/** Per-call options: the deadline from now (default: the session's timeoutMs). */
export interface CallOptions { timeoutMs?: number }

/** load()'s options; raw bytes need both dtype and shape (of the whole tensor). */
export interface LoadOptions {
  dtype?: DType;
  shape?: number[];
  /** the safetensors key to load */
  name?: string;
  /** mesh dim to split `dim` over; '' (default): every rank loads it all */
  shard?: string;
  /** the tensor dim split with shard (default 0) */
  dim?: number;
  /** default 0, the main stream */
  stream?: number;
}

// ------------------------------------------------------------------ errors

/**
 * An Error from meshd: `kind` is the ErrorKind name without its prefix ("UNKNOWN_OP"),
 * or a gRPC status name ("UNAVAILABLE", or "CODE_n") when the server sent none;
 * `code` the gRPC status code; `seq` the failing command when known.
 */
export class MeshdError extends Error {
  constructor(kind: string, message: string, code?: number, seq?: number);
  name: 'MeshdError';
  kind: ErrorKind | (string & {});
  code: number | undefined;
  seq: number | undefined;
  /** sync() only: every error that Sync reported, this one first. */
  errors?: MeshdError[];
  /** From a failed gRPC call: the kind from its `meshd-error-kind` trailer. */
  static fromRpc(err: Pick<grpc.ServiceError, 'code' | 'message'> & Partial<Pick<grpc.ServiceError, 'details' | 'metadata'>>): MeshdError;
  /** From an Error message in a reply (CommandResult.error or .errors). */
  static fromError(e: Pick<ProtoError, 'kind' | 'message' | 'code'> & { seq?: number }): MeshdError;
}

// ------------------------------------------------------------------ functions

/** The tensor_service.proto connect() loads: under $MESHD_SOURCE_DIR, else the source tree's; throws if neither exists. */
export function protoPath(): string;

/** KeepAlive period for a lease of ttlSeconds (0 or absent: 300): a third of it, at least 250 ms. */
export function keepAlivePeriodMs(ttlSeconds?: number): number;

/** True if every host `addr` names is loopback (localhost, 127.0.0.0/8, ::1) or it is a local socket. */
export function isLoopback(addr: string): boolean;

/** A PEM certificate or key: its bytes, a PEM string, or a file path. */
export type Pem = Buffer | Uint8Array | string;

/** Security options; each unset one comes from its environment variable. */
export interface SecurityOptions {
  /** bearer token (1..4096 visible ASCII); unset or null: $MESHD_TOKEN; '': none */
  token?: string | null;
  /**
   * TLS with the system's roots; any certificate option or serverName implies it. Unset (or
   * null): $MESHD_TLS=1, or any MESHD_TLS_* certificate or name variable, turns it on;
   * false: plaintext, no MESHD_TLS* variable read (a certificate option with it throws).
   */
  tls?: boolean | null;
  /** the CA that verifies the server ($MESHD_TLS_CA) */
  rootCerts?: Pem | null;
  /** client certificate for mTLS, with privateKey ($MESHD_TLS_CERT) */
  certChain?: Pem | null;
  /** ($MESHD_TLS_KEY) */
  privateKey?: Pem | null;
  /** the name the server's certificate must hold ($MESHD_TLS_SERVER_NAME) */
  serverName?: string;
  /** send a token in plaintext to an address that is not loopback (default false) */
  insecure?: boolean;
}

export interface ResolvedSecurity {
  creds: grpc.ChannelCredentials;
  options: { 'grpc.enable_http_proxy': number; 'grpc.ssl_target_name_override'?: string };
  /** base metadata: `authorization: Bearer TOKEN` when there is a token */
  md: grpc.Metadata;
  tls: boolean;
}

/** The channel credentials, channel options and base metadata of connect()'s options; throws on bad ones. */
export function resolveSecurity(addr: string, options?: SecurityOptions): ResolvedSecurity;

/**
 * How upload and fetch bytes travel (docs/protocol.md, Direct data path): 'auto' straight
 * between this process and the agents when the server offers it (PlanTransfer), the
 * agents' port is TLS (cluster mTLS) or the session is not over TLS, and the agents connect
 * within DIRECT_CONNECT_MS, else through the server; 'direct' always straight (fails when it
 * cannot: UNAVAILABLE naming the rank); 'proxy' always through the server (Upload, Fetch).
 * A transfer whose grants came too late (--transfer-grant-start-ms) is planned once more,
 * then fails "the transfer's grant expired before it started ..."; one an agent refuses
 * because its --max-transfer-nonces table is full: 'auto' takes the proxy, 'direct' fails.
 */
export type DataPath = 'auto' | 'direct' | 'proxy';

/** The data paths, in that order. */
export const DATA_PATHS: readonly DataPath[];

/** How long (ms) an agent may take to accept a connection before auto uses the proxy. */
export const DIRECT_CONNECT_MS: number;

/** What a session's transfers did since it opened. */
export interface TransferStats {
  /** straight between this process and the agents */
  directUploads: number;
  directFetches: number;
  /** through the server */
  proxyUploads: number;
  proxyFetches: number;
  /** auto transfers that went through the server for a reason (not a 'proxy' setting) */
  fallbacks: number;
  /** the last one's reason; '' if none */
  lastFallback: string;
}

export interface ConnectOptions extends SecurityOptions {
  /** default 'meshd-node' */
  clientName?: string;
  /** session lease; 0 (default): the server's --session-ttl */
  ttlSeconds?: number;
  /** 0 (default): the server's default quota */
  quotaBytes?: number;
  /** every call's deadline unless given per call (default 60000) */
  timeoutMs?: number;
  /** tensor_service.proto (default: protoPath()); agent.proto is found beside its api/ folder */
  protoPath?: string;
  /** default 'auto'; a RangeError for anything else */
  dataPath?: DataPath;
}

/** Connects to `addr` (host:port or a gRPC target) and creates a session. */
export function connect(addr: string, options?: ConnectOptions): Promise<Session>;

// ------------------------------------------------------------------ Session

/** The gRPC client connect() made (methods by RPC name, untyped). */
export type TensorServiceClient = InstanceType<grpc.ServiceClientConstructor>;

/** An open session; make one with connect(). Seqs are handed out from 1; refs from
 * (n mod 9000) * 10^12 + 1 for the n-th session of the process (from 0), so a bare ref of
 * another session (or one never handed out) is refused by every call that takes one. */
export class Session {
  /** Used by connect(); baseMd is copied, then carries the session's id and token. */
  constructor(client: TensorServiceClient, reply: CreateSessionReply, timeoutMs: number,
    baseMd?: grpc.Metadata, options?: { tls?: boolean; dataPath?: DataPath; protoFile?: string });

  client: TensorServiceClient;
  id: string;
  /** the lease the server granted */
  ttlSeconds: number;
  /** default deadline of every call, from now */
  timeoutMs: number;
  tls: boolean;
  /** the last ref handed out (the span's start before the first) */
  nextRef: number;
  /** the last command's seq */
  seq: number;
  closed: boolean;
  /** the server takes Literal commands (its features list 'literal') */
  literals: boolean;
  /** how upload and fetch move bytes; change with setDataPath() */
  readonly dataPath: DataPath;
  /** counters of the session's transfers by path */
  readonly transferStats: TransferStats;
  keepAliveTimer: NodeJS.Timeout;
  keepAlivePeriodMs: number;

  /** Sets the data path of later transfers (forcing one forgets an unreachable agent); a RangeError for an unknown one. */
  setDataPath(mode: DataPath): void;
  /** Starts the unref'd KeepAlive timer (the constructor does). */
  startKeepAlive(): void;
  /** Stops it (close() does). */
  stopKeepAlive(): void;
  /** Never shows the metadata (it holds the tokens). */
  [inspect.custom](): string;
  /** Date.now() + timeoutMs (default: the session's). */
  deadline(timeoutMs?: number): number;
  /** The next ref. */
  newRef(): number;

  /** Every registered agent (ListAgents, every page followed) and how to dial their port;
   * timeoutMs bounds all the pages, pageSize is a page's rows (0: the server's default). */
  agents(options?: { timeoutMs?: number; pageSize?: number }): Promise<{ agents: AgentInfo[]; agent_tls: AgentTls | null }>;
  /** One unary RPC with the session's metadata; a failure rejects with a MeshdError
   * (NO_SESSION, not sent, once close() was called, as every call of the session). */
  unary<M extends keyof UnaryMethods>(method: M, request: UnaryMethods[M][0], options?: CallOptions): Promise<UnaryMethods[M][1]>;
  /**
   * Runs one Command and returns its CommandResult; a rejected command throws a MeshdError
   * with .kind. timeoutMs (default: the session's) bounds all the call waits for: its turn
   * after the calls issued before it, room in the pipeline's queue, its answer; past it
   * kind DEADLINE_EXCEEDED (a command that was not queued, or was taken out of the pipeline's
   * queue unsent, gives its seq and refs back when no later call took any).
   */
  execute(command: Command, options?: CallOptions): Promise<CommandResult>;
  /**
   * Later commands go on one Submit stream, many to a message (what was issued before the
   * event loop turns, at most maxBatch, about 1 MiB); each still settles with its own answer.
   * Upload, fetch, inspectUrl and close wait for every outstanding answer first. A server that
   * stops reading the stream (flow control) fills a bounded queue: a command that finds it full
   * waits until its deadline, then rejects DEADLINE_EXCEEDED, not queued; one queued whose
   * deadline passes before the stream took it is taken out and rejects DEADLINE_EXCEEDED,
   * never sent (it did not run). With a pipeline on,
   * options change maxBatch (a failed stream is replaced). null: back to unary Execute once
   * every answer is in, the session's timeoutMs at most (then DEADLINE_EXCEEDED, the pipeline
   * off all the same: what is queued still goes out, each before its own deadline, and later
   * calls wait for it first).
   * The open stream keeps the process alive: close() the session when done.
   */
  setPipeline(options?: PipelineOptions | null): Promise<void>;
  /** What the pipeline sent and got back; null without one. */
  pipelineStats(): PipelineStats | null;

  /** A mesh of the named dims and sizes ({gpu: 2}). */
  createMesh(dims: Record<string, number>): Promise<MeshMeta>;
  /** The sub-mesh of `parent` at an index of each named dim, which goes away ({gpu: 0}). */
  sliceMesh(parent: MeshMeta | Ref, sel: Record<string, number>): Promise<MeshMeta>;
  /** A tensor made by a factory; returns its TensorMeta. */
  factory(f: FactoryOptions): Promise<TensorMeta>;
  /** What the file at `url` holds, read by the first agent of `mesh` (default 0: any agent). */
  inspectUrl(url: string, mesh?: Ref): Promise<InspectUrlReply>;
  /**
   * A tensor each agent of `mesh` fetches itself from `url` (docs/loading.md): raw bytes
   * with {dtype, shape}, else what a .npy or safetensors header says. A safetensors file
   * without `name` gives every tensor's TensorMeta by name. Raw bytes ask InspectUrl for the
   * file's version first (unpinned if it fails), which every rank checks.
   */
  load(mesh: Ref, url: string, options: LoadOptions & { dtype: DType; shape: number[] }): Promise<TensorMeta>;
  load(mesh: Ref, url: string, options: LoadOptions & { name: string }): Promise<TensorMeta>;
  load(mesh: Ref, url: string, options?: LoadOptions): Promise<TensorMeta | Record<string, TensorMeta>>;
  /** A catalogue op (ListOps) on args and kwargs; returns the first result's TensorMeta.
   * timeoutMs (default: the session's): past it without an answer, DEADLINE_EXCEEDED. */
  call(op: string, args?: CallArg[], kwargs?: Record<string, CallArg>, options?: { stream?: number; timeoutMs?: number }): Promise<TensorMeta>;
  /**
   * Reduces `input` over mesh dims (default []: every dim) with `reduction` (default 'sum'):
   * Monarch's reduce(dims, reduction, scatter, mesh, _inplace, out). `mesh`: a sub-mesh holding
   * one rank of each reduced group and none of the reduced dims (the result lives there only).
   * `out`: a tensor of this session the result is written into (on `mesh` when given);
   * `inplace`: the result is written into `input`. With either, the answer is that tensor
   * (no new ref). A bad one rejects with the server's kind (SHAPE_MISMATCH, DTYPE_MISMATCH,
   * WRONG_MESH, BAD_ARGUMENT); an `out` of another session is refused unsent.
   */
  reduce(input: Ref, dims?: string[], reduction?: Reduction, options?: { scatter?: boolean; stream?: number; mesh?: MeshMeta | Ref; out?: Ref; inplace?: boolean }): Promise<TensorMeta>;
  /**
   * Waits until everything issued so far ran; rejects with the first run-time error not
   * reported before (.errors holds all), or kind DEADLINE_EXCEEDED past timeoutMs.
   */
  sync(options?: CallOptions): Promise<void>;
  /**
   * Uploads `data` as the same tensor of `shape` on every rank of `mesh`; with perRank,
   * one local tensor of `shape` per rank, in rank order. The bytes go by dataPath, all
   * shards at once (the first shard to fail stops the others and undoes the upload); one
   * deadline, the session's timeoutMs, for all of it (a direct upload's FinishUpload that
   * got no answer is asked once more, within min(timeoutMs, 5 s), so that a tensor the
   * server defined is not left behind a rejection). Throws (synchronously) a TypeError
   * for an array of no meshd dtype.
   */
  upload(mesh: Ref, shape: number[], data: UploadArray, options?: { stream?: number; perRank?: boolean }): Promise<TensorMeta>;
  /**
   * upload()'s arguments as one Literal command: the bytes (copied at the call) travel in
   * the command, pipelined and answered at once; a failure on the agents comes at the next
   * sync(). At most 1 MiB, and 8 MiB over the mesh's ranks (a MeshMeta, or the ref of one
   * this session made): more is a RangeError. Uploads where the server or the mesh
   * (MeshMeta.literals) predates Literal; a refusal for such an agent turns `literals` off.
   */
  literal(mesh: Ref | MeshMeta, shape: number[], data: UploadArray, options?: { stream?: number; perRank?: boolean }): Promise<TensorMeta>;
  /**
   * The local tensor at the rank named by coords (an index for every mesh dim: {gpu: 1})
   * as a typed array by dtype (float16, bfloat16: a Uint16Array of the raw bits), with
   * .shape and .dtype; kind DEADLINE_EXCEEDED past timeoutMs
   * (one deadline for the whole fetch: its turn, the pipelined answers it waits for, a
   * fallback to the proxy included).
   */
  fetch(ref: Ref, coords?: Record<string, number>, options?: CallOptions): Promise<Fetched>;
  /**
   * Closes the session and its channel once the calls issued before it went out, every
   * pipelined answer came and every fetch issued before it has its bytes (the session's
   * timeoutMs at most: past it the session closes all the same and close() rejects
   * DEADLINE_EXCEEDED); a second call waits for the first. Every call made once close()
   * was called (awaited or not) rejects NO_SESSION (code UNAUTHENTICATED) without being sent.
   */
  close(): Promise<void>;
}
