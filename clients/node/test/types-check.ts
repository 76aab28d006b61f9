// Type-checked, never run: test/types.test.mjs compiles this file with tsc --strict
// against meshd.d.ts, imported by the package's name as a TypeScript user would. It
// uses the client the way examples/compute.mjs and the tests do; each
// `@ts-expect-error` line is a misuse the declarations must reject (tsc fails if one
// compiles cleanly). Everything sits in a function nothing calls, so running this
// file (a test runner that picks up .ts) connects to nothing.
import {
  connect, DATA_PATHS, DIRECT_CONNECT_MS, grpc, isLoopback, keepAlivePeriodMs, MeshdError, protoPath, resolveSecurity, Session,
} from 'meshd-client';
import type { DataPath, Fetched, MeshMeta, TensorMeta, TransferStats } from 'meshd-client';

const isMeta = (x: TensorMeta | Record<string, TensorMeta>): x is TensorMeta => typeof x.ref === 'number';

export async function usage(addr: string, url: string): Promise<number[]> {
  const s: Session = await connect(addr, {
    clientName: 'types-check', ttlSeconds: 30, timeoutMs: 5000, token: 'alice', rootCerts: 'ca.pem',
    certChain: Buffer.from('-----BEGIN'), privateKey: 'client.key', serverName: 'meshd', insecure: false,
    dataPath: 'auto',
  });
  try {
    const mesh: MeshMeta = await s.createMesh({ gpu: 2 });
    const dims: string = mesh.dims.map((d) => `${d.name}=${d.size}`).join(' ');
    const ranks: number[] = mesh.ranks;

    const x = await s.upload(mesh, [4], Float32Array.from([1, 2, 3, 4, 5, 6, 7, 8]), { perRank: true });
    const lit: TensorMeta = await s.literal(mesh, [2], Int32Array.from([1, 2, 3, 4]), { perRank: true, stream: 0 });
    const canLiteral: boolean = s.literals && mesh.literals;
    void [lit, canLiteral];
    const three = await s.factory({ kind: 'full', mesh: mesh.ref, shape: [4], dtype: 'DTYPE_FLOAT32', value: 3 });
    const y = await s.call('add', [x, three]);
    const z = await s.call('mul', [y, 0.5], { alpha: { i: 2 } }, { stream: 0 });
    const total = await s.reduce(z, ['gpu'], 'sum', { scatter: false });
    const into: TensorMeta = await s.reduce(z, ['gpu'], 'avg', { out: total, mesh: mesh.ref });
    await s.reduce(z, [], 'max', { inplace: true });
    void into;
    await s.sync({ timeoutMs: 5000 });
    s.setDataPath('direct');
    const path: DataPath = s.dataPath;
    const stats: TransferStats = s.transferStats;
    void [path, stats.directUploads + stats.fallbacks, stats.lastFallback.length, DATA_PATHS[0], DIRECT_CONNECT_MS];
    // @ts-expect-error not a data path
    s.setDataPath('fast');
    await s.setPipeline({ maxBatch: 64 });
    const ps = s.pipelineStats();
    if (ps) void [ps.commands + ps.messages + ps.replies + ps.queued];
    await s.setPipeline(null);
    // @ts-expect-error maxBatch is a number
    await s.setPipeline({ maxBatch: 'many' });

    const v: Fetched = await s.fetch(total, { gpu: 1 }, { timeoutMs: 1000 });
    const shape: number[] = v.shape;
    let values: number[] = [];
    if (v instanceof Float32Array) values = [...v];
    if (v instanceof Uint16Array && v.dtype === 'DTYPE_FLOAT16') values = [...v]; // the raw bits

    const info = await s.inspectUrl(url, mesh);
    const first: string = info.tensors[0].name + info.format + info.file_size;
    const raw: TensorMeta = await s.load(mesh, url, { dtype: 'DTYPE_UINT8', shape: [16] });
    const named: TensorMeta = await s.load(mesh.ref, url, { name: 'w', shard: 'gpu', dim: 1 });
    const any = await s.load(mesh, url, { shard: 'gpu', dim: 1 });
    const loaded = isMeta(any) ? [any] : Object.values(any);

    const { agents, agent_tls } = await s.unary('ListAgents', {});
    const paged = await s.unary('ListAgents', { page_size: 1, page_token: '' });
    const nextPage: string = paged.next_page_token;
    const every = await s.agents({ pageSize: 1, timeoutMs: 1000 });
    const listedRank: number = every.agents[0].rank + (every.agent_tls ? 1 : 0);
    const built: string = agents[0].version + agents[0].commit + agents[0].build_type;
    const drained: boolean = agents[0].drained || agents[0].cuda;
    const server = await s.unary('GetInfo', {});
    const up: number = server.uptime_ms + server.agents.length;
    const pool: number = server.agents_total + server.agents_healthy + server.agents_drained;
    const partial: boolean = server.agents_truncated;
    const back = await s.unary('DrainAgent', { rank: 1, drain: false });
    const { sessions } = await s.unary('ListSessions', {});
    const counted: number = sessions[0].commands + sessions[0].age_ms;
    const plan = await s.unary('PlanTransfer', { fetch: { ref: total.ref, coords: [{ dim: 'gpu', index: 0 }] } });
    const expires: number = plan.expiry_unix_ms;
    const id: string = plan.transfer_id;
    const after: string = plan.shards[0].after_seq;
    const planned: number | undefined = plan.meta?.ref;
    await s.unary('FinishFetch', { transfer_id: plan.transfer_id });
    const progress = await s.unary('LoadProgress', { refs: [1] });
    void [nextPage, listedRank, built, drained, up, pool, partial, back.agent?.drained, counted, expires, id, after, planned, agent_tls?.server_name,
      progress.unanswered[0]?.kind];
    // @ts-expect-error DrainAgent names a rank
    await s.unary('DrainAgent', { drain: true });
    const res = await s.execute({ drop: { refs: [raw.ref, named.ref] } });
    const failed: string | undefined = res.tensors[0]?.error?.kind;
    void [dims, ranks, shape, first, loaded, agents[0].device, failed, s.id, s.closed, s.keepAlivePeriodMs];

    try {
      await s.call('no_such_op', [x]);
    } catch (err) {
      if (err instanceof MeshdError && err.kind === 'UNKNOWN_OP') {
        const code: number | undefined = err.code;
        const all: MeshdError[] = err.errors ?? [];
        void [code, all, err.seq, err.code === grpc.status.INVALID_ARGUMENT];
      }
    }

    // @ts-expect-error misspelled option (timeoutMs)
    await s.sync({ timeout: 5000 });
    // @ts-expect-error a string where a number is required
    await s.fetch(total, { gpu: '1' });
    await s.factory({ kind: 'ones', mesh, shape: [2] }); // a MeshMeta or its ref
    // @ts-expect-error a mesh is a MeshMeta or a ref, not a name
    await s.factory({ kind: 'ones', mesh: 'gpu', shape: [2] });
    // @ts-expect-error no such factory kind
    await s.factory({ kind: 'one', mesh: mesh.ref, shape: [2] });
    // @ts-expect-error no such reduction
    await s.reduce(z, ['gpu'], 'mean');
    // @ts-expect-error inplace is a boolean
    await s.reduce(z, ['gpu'], 'sum', { inplace: 1 });
    // @ts-expect-error not a dtype name
    await s.load(mesh, url, { dtype: 'float32', shape: [2] });
    // @ts-expect-error Uint16Array has no meshd dtype
    await s.upload(mesh, [2], new Uint16Array(2));
    // @ts-expect-error Uint16Array has no meshd dtype
    await s.literal(mesh, [2], new Uint16Array(2));
    // @ts-expect-error fetch resolves to a typed array, not a plain array
    const wrong: number[] = await s.fetch(total, { gpu: 0 });
    // @ts-expect-error unary() knows the RPC names
    await s.unary('ListAgent', {});
    void wrong;
    return values;
  } finally {
    await s.close();
  }
}

export function helpers(): void {
  const sec = resolveSecurity('127.0.0.1:1', { token: '', tls: true, rootCerts: Buffer.from('pem') });
  const md: grpc.Metadata = sec.md;
  const tls: boolean = sec.tls;
  const period: number = keepAlivePeriodMs(30);
  const file: string = protoPath();
  const local: boolean = isLoopback('[::1]:50051');
  const e = new MeshdError('NO_SESSION', 'closed', grpc.status.UNAUTHENTICATED);
  const plain = resolveSecurity('127.0.0.1:1', { tls: false });
  const fromEnv = resolveSecurity('127.0.0.1:1', { tls: null });
  void [plain.tls, fromEnv.tls];
  const fromReply = MeshdError.fromError({ kind: 'ERROR_KIND_QUOTA', message: 'full', code: 8, seq: 3 });
  void [md, tls, period, file, local, e.kind, fromReply.seq];
  // @ts-expect-error misspelled option (rootCerts)
  resolveSecurity('h:1', { rootCert: 'ca.pem' });
  // @ts-expect-error ttlSeconds is a number
  void connect('h:1', { ttlSeconds: '30' });
  // @ts-expect-error dataPath is 'auto', 'direct' or 'proxy'
  void connect('h:1', { dataPath: 'udp' });
}
