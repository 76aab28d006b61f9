#!/usr/bin/env python3
"""Pipeline stages on two sub-meshes with to_mesh, and a side stream with a borrow
overlapping communication with compute; checked against numpy.

A root mesh {stage: 2, gpu: 2} (4 agents) is sliced into stage 0 and stage 1, each a
{gpu: 2} mesh. For every micro-batch, stage 0 computes activations
h = relu(x @ W1) on its own shard (data-parallel over gpu), sends them to stage 1
with to_mesh, and stage 1 computes y = h @ W2 and z = tanh(y) on the main stream.
Meanwhile a side stream borrows y (read-only) and all-reduces it over gpu
(communication) while main goes on with tanh (compute). Everything after the
uploads is sent in one `with session.pipeline():` block.

    PYTHONPATH=clients/python /usr/bin/python3 \\
        clients/python/examples/pipeline_stages.py --server 127.0.0.1:50051
"""

import argparse
import sys

import numpy as np

import meshd


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", required=True, help="meshd address, host:port (4 agents)")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="rows per rank per micro-batch")
    ap.add_argument("--features", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-4, help="max |meshd - numpy| allowed")
    args = ap.parse_args()

    M, B, D, H, G = args.micro_batches, args.batch, args.features, args.hidden, 2
    rng = np.random.RandomState(args.seed)
    X = rng.normal(size=(M, G, B, D)).astype(np.float32)      # micro-batch, gpu shard, rows
    W1 = (rng.normal(size=(D, H)) / np.sqrt(D)).astype(np.float32)
    W2 = (rng.normal(size=(H, D)) / np.sqrt(H)).astype(np.float32)

    with meshd.connect(args.server) as session:
        mesh = session.mesh(stage=2, gpu=G)
        stage0, stage1 = mesh.slice(stage=0), mesh.slice(stage=1)
        side = session.stream("side")
        with stage0.activate():
            xs = [meshd.tensor(X[m], shard="gpu") for m in range(M)]
            w1 = meshd.tensor(W1)
        with stage1.activate():
            w2 = meshd.tensor(W2)

        zs, totals = [], []
        with session.pipeline():
            for m in range(M):
                h = meshd.ops.relu(xs[m] @ w1)                # stage 0: activations
                h1 = h.to_mesh(stage1)                         # send to stage 1
                y = h1 @ w2                                    # stage 1
                yb, borrow = side.borrow(y, mutable=False)
                with side.activate():
                    totals.append(yb.reduce("gpu", "sum"))     # comm on the side stream...
                zs.append(y.tanh())                            # ...while main computes
                borrow.drop()
                h.drop()
                h1.drop()
            session.sync()
        got_z = [[meshd.fetch_shard(z, gpu=g).result() for g in range(G)] for z in zs]
        got_t = [meshd.fetch_shard(t, gpu=1).result() for t in totals]
        on_side = all(t.stream is side for t in totals) and all(z.mesh is stage1 for z in zs)

    Y = np.maximum(X.astype(np.float64) @ W1, 0) @ W2          # (M, G, B, D)
    err_z = max(float(np.max(np.abs(got_z[m][g] - np.tanh(Y[m, g]))))
                for m in range(M) for g in range(G))
    err_t = max(float(np.max(np.abs(got_t[m] - Y[m].sum(axis=0)))) for m in range(M))
    ok = max(err_z, err_t) <= args.tol and on_side
    print(f"{M} micro-batches, stage 0 -> stage 1 via to_mesh, side-stream all-reduce of a "
          f"borrow: max |Δz| = {err_z:.3g}, max |Δsum| = {err_t:.3g} (tolerance {args.tol:g})")
    print("pipeline stages match numpy" if ok else "pipeline stages DO NOT match numpy")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
