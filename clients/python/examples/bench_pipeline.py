#!/usr/bin/env python3
"""Times N tiny adds sent one by one (unary Execute) and pipelined (one Submit stream),
and prints the speed-up.

    PYTHONPATH=clients/python /usr/bin/python3 \\
        clients/python/examples/bench_pipeline.py --server 127.0.0.1:50051 [--n 2000]
"""

import argparse
import sys
import time

import numpy as np

import meshd


def run(n, pipelined, session):
    x = meshd.zeros((4,))
    t0 = time.perf_counter()
    if pipelined:
        with session.pipeline():
            for _ in range(n):
                x = x + 1
    else:
        for _ in range(n):
            x = x + 1
    dt = time.perf_counter() - t0
    got = meshd.fetch_shard(x, gpu=0).result()
    if not np.array_equal(got, np.full(4, n, np.float32)):
        raise SystemExit(f"wrong result {got}")
    session.sync()
    return dt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", required=True)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--agents", type=int, default=2)
    args = ap.parse_args()
    with meshd.connect(args.server) as session:
        mesh = session.mesh(gpu=args.agents)
        with mesh.activate():
            run(50, False, session), run(50, True, session)  # warm up
            unary = run(args.n, False, session)
            piped = run(args.n, True, session)
    print(f"{args.n} adds: unary {unary:.3f} s ({args.n / unary:.0f}/s), pipelined {piped:.3f} s "
          f"({args.n / piped:.0f}/s), speed-up {unary / piped:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
