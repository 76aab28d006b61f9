#!/usr/bin/env python3
"""Data-parallel logistic regression on meshd's agents, checked against numpy.

The dataset (two Gaussian blobs) is split into equal shards, one per rank of a
mesh `gpu=N`; the weights are replicated. Each step every rank computes the
forward pass, the binary cross-entropy and its gradients on its own shard, the
gradients are averaged over "gpu" with reduce(..., "avg"), and every rank
applies the same SGD update, so the replicas stay identical. Because the
shards are equal in size, the average of the per-shard mean gradients is the
full-batch gradient: at the end the weights must match plain numpy running the
same full-batch steps in one process.

    PYTHONPATH=clients/python /usr/bin/python3 \\
        clients/python/examples/train_data_parallel.py --server 127.0.0.1:50051 [--plot loss.png]

It prints the loss per step, the steps per second, and with --plot FILE writes the
loss curve (meshd's and numpy's) as a PNG (matplotlib, Debian's python3-matplotlib).
"""

import argparse
import sys
import time

import numpy as np

import meshd


def make_data(ranks, per_rank, features, seed):
    """ranks*per_rank points of two Gaussian blobs, labels 0/1, shuffled; float32."""
    rng = np.random.RandomState(seed)
    n = ranks * per_rank
    y = (np.arange(n) % 2).astype(np.float32)
    centers = rng.normal(0.0, 1.0, size=(2, features))
    X = centers[y.astype(int)] + rng.normal(0.0, 1.0, size=(n, features))
    order = rng.permutation(n)
    return X[order].astype(np.float32), y[order].reshape(n, 1)


def numpy_reference(X, y, w, b, steps, lr):
    """The same steps, full batch, in one process (float64): (w, b, loss per step)."""
    X, y, w, b = (a.astype(np.float64) for a in (X, y, w, b))
    losses = []
    for _ in range(steps):
        p = 1.0 / (1.0 + np.exp(-(X @ w + b)))
        losses.append(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))
        w = w - lr * (X.T @ (p - y) / len(X))
        b = b - lr * (p - y).mean(axis=0)
    return w, b, np.array(losses)


def accuracy(X, y, w, b):
    return float((((X @ w + b) > 0).astype(np.float32) == y).mean())


def plot(path, losses, losses_np, ranks):
    """The loss curve, meshd's beside numpy's, as a PNG at path."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib (Debian: apt-get install python3-matplotlib)")
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    steps = np.arange(1, len(losses) + 1)
    ax.plot(steps, losses, label=f"meshd, {ranks} ranks", linewidth=2)
    ax.plot(steps, losses_np, "--", label="numpy, one process")
    ax.set_xlabel("step")
    ax.set_ylabel("binary cross-entropy")
    ax.set_title("Data-parallel logistic regression")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    print(f"loss curve written to {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", required=True, help="meshd address, host:port")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--agents", type=int, default=4, help="mesh size: session.mesh(gpu=N)")
    ap.add_argument("--per-rank", type=int, default=256, help="examples per rank")
    ap.add_argument("--features", type=int, default=8)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-4, help="max |w - w_numpy| allowed")
    ap.add_argument("--plot", metavar="FILE", help="write the loss curve to FILE (PNG)")
    args = ap.parse_args()
    for name in ("steps", "agents", "per_rank", "features"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")

    N, D = args.agents, args.features
    X, y = make_data(N, args.per_rank, D, args.seed)
    w0 = np.random.RandomState(args.seed + 1).normal(0, 0.01, size=(D, 1)).astype(np.float32)
    b0 = np.zeros((1,), np.float32)

    with meshd.connect(args.server) as session:
        mesh = session.mesh(gpu=N)
        with mesh.activate():
            # rank i gets rows [i*per_rank, (i+1)*per_rank); w and b are replicated
            Xs = meshd.tensor(X.reshape(N, args.per_rank, D), shard="gpu")  # (n, D) per rank
            ys = meshd.tensor(y.reshape(N, args.per_rank, 1), shard="gpu")  # (n, 1) per rank
            Xs_T = Xs.T                          # a view of Xs, not a copy: never drop it alone
            sign, not_y = ys * 2 - 1, 1 - ys     # p(correct class) = p * sign + not_y
            w, b = meshd.tensor(w0), meshd.tensor(b0)

            losses = []
            t0 = time.perf_counter()
            for step in range(1, args.steps + 1):
                # forward, on every rank's own shard: p = sigmoid(X w + b)
                z = Xs @ w
                z.add_(b)
                p = z.sigmoid()                                    # (n, 1)

                # loss: binary cross-entropy = -mean log p(correct class), averaged over ranks
                q = p * sign
                q.add_(not_y)
                logq = q.log()
                shard_loss = logq.mean()
                loss = shard_loss.reduce("gpu", "avg")

                # gradients of the shard's mean loss, averaged over ranks (all-reduce)
                err = p.sub_(ys)                                   # p - y, in place
                gw = Xs_T @ err                                    # (D, 1), sum over the shard
                gw.reduce_("gpu", "avg")
                gb = err.mean(dim=0)                               # (1,)
                gb.reduce_("gpu", "avg")

                # SGD: every rank applies the same update, so the replicas stay identical
                w.sub_(gw.mul_(args.lr / args.per_rank))
                b.sub_(gb.mul_(args.lr))

                L = -float(meshd.fetch_shard(loss, gpu=0).result())
                losses.append(L)
                print(f"step {step} loss {L:.6f}", flush=True)
                # free this step's tensors so agent memory stays flat
                for t in (z, p, q, logq, shard_loss, loss, gw, gb):
                    t.drop()
                if step == 1:
                    session.sync()
                    mem_first = max(a["allocated_bytes"] for a in session.agents())
            session.sync()
            seconds = time.perf_counter() - t0
            mem_last = max(a["allocated_bytes"] for a in session.agents())

            w_dp = meshd.fetch_shard(w, gpu=0).result()
            b_dp = meshd.fetch_shard(b, gpu=0).result()
            w_last = meshd.fetch_shard(w, gpu=N - 1).result()

    print(f"final accuracy {accuracy(X, y, w_dp, b_dp):.4f} on {len(X)} examples "
          f"({N} ranks x {args.per_rank})")
    print(f"{args.steps} steps in {seconds:.2f} s: {args.steps / seconds:.1f} steps/s "
          f"(each step waits for its loss)")
    w_np, b_np, losses_np = numpy_reference(X, y, w0, b0, args.steps, args.lr)
    if args.plot:
        plot(args.plot, losses, losses_np, N)
    dw = float(np.max(np.abs(w_dp - w_np)))
    db = float(np.max(np.abs(b_dp - b_np)))
    dloss = float(np.max(np.abs(np.array(losses) - losses_np)))
    drank = float(np.max(np.abs(w_dp - w_last)))
    print(f"agent memory: {mem_first} bytes after step 1, {mem_last} after step {args.steps}")
    if mem_last != mem_first:
        print("agent memory grew during training: a tensor is not dropped")
    ok = max(dw, db, dloss, drank) <= args.tol and mem_last == mem_first
    print(f"{'matches' if ok else 'DOES NOT match'} numpy: max |Δw| = {dw:.3g}, |Δb| = {db:.3g}, "
          f"max |Δloss| = {dloss:.3g} (tolerance {args.tol:g}); replicas differ by {drank:.3g}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
