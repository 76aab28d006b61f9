#!/usr/bin/python3
"""bench_wan: the Python client's proxied Upload and Fetch from a client a round trip
away, through a relay that delays every byte by half of --rtt-ms each way, against the
same transfers over plain loopback in the same run (ratio = relayed / loopback MB/s).
Run once per server stream window (--windows: meshd's --stream-window-bytes values;
"default" passes none), so the window's cost to a far client shows.

    /usr/bin/python3 tests/bench/bench_wan.py [--rtt-ms 50] [--mib 64] [--rounds 3]
                                             [--windows default,0]

The relay (meshd_testlib.DelayRelay) is in this process (asyncio, one thread): it caps what it can carry at a
few hundred MB/s, so the figures are meaningful only well below that. One JSON line
per (window, direction) on stdout; progress on stderr. Not a test: run by hand
(bench.smoke runs it for a moment)."""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "clients", "python"))

import meshd_testlib as lib  # noqa: E402

MIB = 1 << 20


def transfers(meshd, addr, arr, rounds):
    """Best seconds of (upload + sync, fetch) of arr through the server at addr."""
    c = meshd.connect(addr, client_name="bench-wan", timeout=600, data_path="proxy")
    up = down = float("inf")
    try:
        with c.mesh(gpu=1).activate():
            for _ in range(rounds + 1):  # the first round warms the connection, unmeasured
                t0 = time.monotonic()
                t = meshd.tensor(arr)
                c.sync()
                t1 = time.monotonic()
                meshd.fetch_shard(t, gpu=0).result()
                t2 = time.monotonic()
                t.drop()
                if _ > 0:
                    up, down = min(up, t1 - t0), min(down, t2 - t1)
    finally:
        c.close()
    return up, down


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rtt-ms", type=float, default=50)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--windows", default="default,0")
    a = ap.parse_args()
    import meshd
    arr = np.ones(a.mib * MIB // 4, np.float32)
    for window in a.windows.split(","):
        flags = [] if window == "default" else ["--stream-window-bytes", window]
        work = tempfile.mkdtemp(prefix="meshd-bench-wan-")
        srv = lib.spawn("meshd", lib.MESHD, ["--listen", "127.0.0.1:0", "--local-agents", "1",
                                             "--log-level", "warn"] + flags, work)
        relay = None
        try:
            lib.wait_ready(srv, 1)
            relay = lib.DelayRelay(srv.port, a.rtt_ms / 2000, a.rtt_ms / 2000)
            print(f"bench_wan: window {window}: loopback, then {a.rtt_ms} ms away",
                  file=sys.stderr, flush=True)
            near = transfers(meshd, f"127.0.0.1:{srv.port}", arr, a.rounds)
            far = transfers(meshd, f"127.0.0.1:{relay.port}", arr, a.rounds)
            for i, direction in enumerate(("upload", "fetch")):
                mbs, base = arr.nbytes / far[i] / 1e6, arr.nbytes / near[i] / 1e6
                print(json.dumps({"bench": "wan", "window": window, "rtt_ms": a.rtt_ms,
                                  "mib": a.mib, "direction": direction, "mb_s": round(mbs, 1),
                                  "loopback_mb_s": round(base, 1),
                                  "ratio": round(mbs / base, 3)}), flush=True)
        finally:
            if relay:
                relay.close()
            lib.stop(srv)
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
