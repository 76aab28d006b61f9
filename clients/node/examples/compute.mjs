// meshd from Node: create a mesh {gpu: 2}, upload a tensor (one slice per rank), compute
// (add, mul), reduce sum over gpu, fetch from rank 0 and rank 1, and check every value
// against the same computation in plain JS. Exits 1 on a mismatch.
//
//   node examples/compute.mjs --server 127.0.0.1:50051
import { connect } from '../meshd.mjs';

function arg(name, dflt) {
  const i = process.argv.indexOf(name);
  return i >= 0 && i + 1 < process.argv.length ? process.argv[i + 1] : dflt;
}

const server = arg('--server', '127.0.0.1:50051');
const N = 4;
const RANKS = 2;

function close(a, b) {
  return a.length === b.length && a.every((x, i) => Math.abs(x - b[i]) <= 1e-5 * Math.max(1, Math.abs(b[i])));
}

const s = await connect(server, { clientName: 'compute-example' });
let ok = true;
try {
  const mesh = await s.createMesh({ gpu: RANKS });
  console.log(`mesh ${mesh.ref}: ${mesh.dims.map((d) => `${d.name}=${d.size}`).join(' ')} ranks [${mesh.ranks}]`);

  // x: rank r holds [r*10 + 1, ..., r*10 + N]
  const local = Array.from({ length: RANKS }, (_, r) => Array.from({ length: N }, (_, i) => r * 10 + i + 1));
  const x = await s.upload(mesh, [N], Float32Array.from(local.flat()), { perRank: true });
  const three = await s.factory({ kind: 'full', mesh: mesh.ref, shape: [N], dtype: 'DTYPE_FLOAT32', value: 3 });
  const y = await s.call('add', [x, three]);   // x + 3
  const z = await s.call('mul', [y, 0.5]);     // (x + 3) * 0.5
  const total = await s.reduce(z, ['gpu'], 'sum');

  // The same in JS.
  const zJs = local.map((row) => row.map((v) => (v + 3) * 0.5));
  const totalJs = zJs[0].map((_, i) => zJs.reduce((acc, row) => acc + row[i], 0));

  for (let r = 0; r < RANKS; r++) {
    const zr = await s.fetch(z, { gpu: r });
    const tr = await s.fetch(total, { gpu: r });
    const good = close(zr, zJs[r]) && close(tr, totalJs) && zr instanceof Float32Array;
    ok &&= good;
    console.log(`rank ${r}: z = [${[...zr]}] sum over gpu = [${[...tr]}] expected [${totalJs}] ${good ? 'ok' : 'MISMATCH'}`);
  }
} finally {
  await s.close();
}
console.log(ok ? 'CHECK OK' : 'CHECK FAILED');
process.exit(ok ? 0 : 1);
