#!/usr/bin/python3
"""bench_small: the latency of making a small tensor from a numpy array, as a ratio to
a raw grpcio unary call carrying the same bytes in the same run. Not a test (not
run by ctest, bar bench.smoke's moment): run by hand, e.g.

    MESHD_BIN_DIR=build/bin /usr/bin/python3 tests/bench/bench_small.py
    MESHD_BIN_DIR=build/bin /usr/bin/python3 tests/bench/bench_small.py --kib 0.0625,64 --agents 1

For each agent count it starts `meshd --local-agents N` and, for each size (KiB, the
whole array; replicated to every rank), times `meshd.tensor(array)` followed by
`session.sync()` (the tensor is on every agent when it returns) on two paths:
- literal: one Literal command (docs/protocol.md, Data in and out), at every size up
  to the server's 1 MiB (the client sends one up to its _LITERAL_MAX, 256 KiB: where
  this path stops winning);
- upload: the same call with the Literal turned off, an Upload stream, as every size
  went before;
- pipelined: 32 literals in one `session.pipeline()` block, then sync, per tensor.
The baseline is a unary call of the same bytes to a bytes-in/length-out grpcio
server in a child process (bench_data.py's), whose calls alternate with the path's.
Each figure is the median of --calls calls in each of --rounds rounds, the best
round reported; "ratio" is the path's median over the baseline's (a time: lower is
better) and "speedup_vs_upload" the upload path's over this one's.
One JSON line per (agents, size, path) on stdout."""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "clients", "python"))

import bench_data  # noqa: E402  (its raw server: bench.Raw/Put)
import meshd  # noqa: E402
import meshd_testlib as lib  # noqa: E402

_tensor_module = sys.modules["meshd.tensor"]  # (meshd.tensor is also the function)


def median_us(fn, calls):
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def run_agents(n, sizes, calls, rounds, put, out):
    work = tempfile.mkdtemp(prefix="meshd-bench-small-")
    srv = lib.spawn("meshd", lib.MESHD, ["--listen", "127.0.0.1:0", "--local-agents", str(n),
                                         "--log-level", "warn"], work)
    try:
        lib.wait_ready(srv, n)
        with meshd.connect(f"127.0.0.1:{srv.port}", client_name="bench-small",
                           data_path="proxy") as s, s.mesh(gpu=n).activate():
            for kib in sizes:
                arr = np.ones(max(1, int(kib * 1024) // 4), np.float32)
                raw = arr.tobytes()
                held = []

                def limited(limit, fn):  # the client's threshold set for fn's calls
                    def run():
                        kept = _tensor_module._LITERAL_MAX
                        _tensor_module._LITERAL_MAX = limit
                        try:
                            fn()
                        finally:
                            _tensor_module._LITERAL_MAX = kept
                    return run

                def one():
                    held.append(meshd.tensor(arr))
                    s.sync()

                def piped():
                    with s.pipeline():
                        for _ in range(32):
                            held.append(meshd.tensor(arr))
                    s.sync()
                literal, upload = limited(1 << 20, one), limited(-1, one)
                piped = limited(1 << 20, piped)
                best = {}
                for _ in range(rounds):
                    for path, fn, k in (("literal", literal, calls), ("upload", upload, calls),
                                        ("pipelined", piped, max(2, calls // 8))):
                        fn()  # warm: channels, the first allocation of this size
                        base = median_us(lambda: put(raw), k)
                        us = median_us(fn, k) / (32 if path == "pipelined" else 1)
                        for t in held:
                            t.drop()
                        held.clear()
                        if path not in best or us / base < best[path][0] / best[path][1]:
                            best[path] = (us, base)
                for path, (us, base) in best.items():
                    up = best["upload"][0]
                    bench_data.emit(out, bench="small_upload", agents=n, kib=kib, path=path,
                                    p50_us=round(us, 1), raw_unary_p50_us=round(base, 1),
                                    ratio=round(us / base, 3), speedup_vs_upload=round(up / us, 2))
    finally:
        lib.stop(srv)
        shutil.rmtree(work, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kib", default="0.0625,4,64,256,1024", help="KiB, comma separated")
    ap.add_argument("--agents", default="1,4", help="agent counts, comma separated")
    ap.add_argument("--calls", type=int, default=64, help="calls per round")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    with bench_data.raw_channel() as ch:
        fn = ch.unary_unary("/bench.Raw/Put")
        for n in (int(x) for x in a.agents.split(",")):
            run_agents(n, [float(x) for x in a.kib.split(",")], a.calls, a.rounds,
                       lambda b: fn(b, timeout=60), sys.stdout)


if __name__ == "__main__":
    main()
