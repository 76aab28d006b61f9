#!/usr/bin/env python3
"""A 2-layer MLP trained data-parallel on a {host, gpu} mesh, with its backward pass
written out by hand and the layer-2 gradients all-reduced on a side stream while the
main stream computes layer 1's; checked against numpy.

Each rank holds a shard of the data (split along "gpu"; hosts hold the same shards) and
a replica of the weights. Per step, on every rank:

    forward   h = relu(X W1 + b1),  out = h W2 + b2,  loss = mean((out - y)^2)
    backward  dout = 2 (out - y) / n
              gW2 = h^T dout, gb2 = sum(dout)        -> borrowed by the side stream,
                                                        all-reduced ("avg") there
              dh = (dout W2^T) * (h > 0)             <- meanwhile, on main
              gW1 = X^T dh,   gb1 = sum(dh)          -> all-reduced on main
    update    the borrows end (main waits for the side stream), then SGD

The shards are equal, so the average of the shards' gradients is the full-batch
gradient: the weights must match numpy running the same full-batch steps.

    PYTHONPATH=clients/python /usr/bin/python3 \\
        clients/python/examples/train_mlp.py --server 127.0.0.1:50051 [--hosts 1 --gpus 2]
"""

import argparse
import sys
import time

import numpy as np

import meshd


def make_data(n, features, seed):
    """n points, a smooth nonlinear target; float32."""
    rng = np.random.RandomState(seed)
    X = rng.normal(0, 1, size=(n, features)).astype(np.float32)
    a = rng.normal(0, 1, size=(features, 1))
    y = (np.sin(X @ a) + 0.1 * (X ** 2).sum(axis=1, keepdims=True)).astype(np.float32)
    return X, y


def init(features, hidden, seed):
    rng = np.random.RandomState(seed + 1)
    return (rng.normal(0, 1 / np.sqrt(features), size=(features, hidden)).astype(np.float32),
            np.zeros((hidden,), np.float32),
            rng.normal(0, 1 / np.sqrt(hidden), size=(hidden, 1)).astype(np.float32),
            np.zeros((1,), np.float32))


def numpy_reference(X, y, params, steps, lr):
    """The same steps, full batch, in one process (float64): (params, loss per step)."""
    X, y = X.astype(np.float64), y.astype(np.float64)
    W1, b1, W2, b2 = (p.astype(np.float64) for p in params)
    losses = []
    for _ in range(steps):
        h = np.maximum(X @ W1 + b1, 0)
        err = h @ W2 + b2 - y
        losses.append(float((err ** 2).mean()))
        dout = 2 * err / len(X)
        gW2, gb2 = h.T @ dout, dout.sum(axis=0)
        dh = (dout @ W2.T) * (h > 0)
        gW1, gb1 = X.T @ dh, dh.sum(axis=0)
        W1, b1, W2, b2 = W1 - lr * gW1, b1 - lr * gb1, W2 - lr * gW2, b2 - lr * gb2
    return (W1, b1, W2, b2), np.array(losses)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", required=True, help="meshd address, host:port")
    ap.add_argument("--hosts", type=int, default=1, help="mesh dim host")
    ap.add_argument("--gpus", type=int, default=2, help="mesh dim gpu: the data's shards")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--per-rank", type=int, default=128, help="examples per gpu shard")
    ap.add_argument("--features", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-4, help="max |param - numpy| allowed")
    args = ap.parse_args()
    for name in ("hosts", "gpus", "steps", "per_rank", "features", "hidden"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")

    G, n = args.gpus, args.per_rank
    X, y = make_data(G * n, args.features, args.seed)
    params0 = init(args.features, args.hidden, args.seed)
    dims = ("host", "gpu")

    with meshd.connect(args.server) as session:
        mesh = session.mesh(host=args.hosts, gpu=G)
        side = session.stream("grads")
        with mesh.activate():
            Xs = meshd.tensor(X.reshape(G, n, -1), shard="gpu")   # (n, D) per rank
            ys = meshd.tensor(y.reshape(G, n, 1), shard="gpu")    # (n, 1) per rank
            Xs_T = Xs.T
            W1, b1, W2, b2 = (meshd.tensor(p) for p in params0)
            losses = []
            t0 = time.perf_counter()
            for step in range(1, args.steps + 1):
                with session.pipeline():
                    # forward
                    z1 = Xs @ W1
                    z1.add_(b1)
                    h = z1.relu()
                    out = h @ W2
                    out.add_(b2)
                    err = out - ys
                    loss = (err * err).mean().reduce(dims, "avg")
                    # backward: layer 2's gradients first, handed to the side stream
                    dout = err * (2.0 / n)
                    gW2, gb2 = h.T @ dout, dout.sum(dim=0)
                    gW2_side, bw = side.borrow(gW2, mutable=True)
                    gb2_side, bb = side.borrow(gb2, mutable=True)
                    with side.activate():
                        gW2_side.reduce_(dims, "avg")
                        gb2_side.reduce_(dims, "avg")
                    # ... while main computes layer 1's and all-reduces them itself
                    dh = (dout @ W2.T) * h.sign()   # relu'(z1) = 1 where h > 0
                    gW1, gb1 = Xs_T @ dh, dh.sum(dim=0)
                    gW1.reduce_(dims, "avg")
                    gb1.reduce_(dims, "avg")
                    # the borrows end: main's next use of gW2, gb2 waits for the side stream
                    bw.drop()
                    bb.drop()
                    for p, g in ((W1, gW1), (b1, gb1), (W2, gW2), (b2, gb2)):
                        p.sub_(g.mul_(args.lr))
                L = float(meshd.inspect(loss))
                losses.append(L)
                print(f"step {step} loss {L:.6f}", flush=True)
            session.sync()
            seconds = time.perf_counter() - t0
            got = [meshd.inspect(p) for p in (W1, b1, W2, b2)]
            last = [meshd.inspect(p, host=args.hosts - 1, gpu=G - 1) for p in (W1, b1, W2, b2)]

    ref, losses_np = numpy_reference(X, y, params0, args.steps, args.lr)
    dparam = max(float(np.max(np.abs(g - r))) for g, r in zip(got, ref))
    dloss = float(np.max(np.abs(np.array(losses) - losses_np)))
    drank = max(float(np.max(np.abs(g - l))) for g, l in zip(got, last))
    print(f"{args.steps} steps in {seconds:.2f} s: {args.steps / seconds:.1f} steps/s "
          f"({args.hosts}x{G} ranks, {n} examples per shard)")
    ok = max(dparam, dloss, drank) <= args.tol
    print(f"{'matches' if ok else 'DOES NOT match'} numpy: max |Δparam| = {dparam:.3g}, "
          f"max |Δloss| = {dloss:.3g} (tolerance {args.tol:g}); replicas differ by {drank:.3g}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
