#!/usr/bin/python3
"""bench_load: meshd.load's bytes/s as a ratio to `curl -o /dev/null` of the same file
from the same HTTP server, measured in the same run (machines here are noisy). Not a
test (not run by ctest): run by hand, e.g.

    MESHD_BIN_DIR=build/bin /usr/bin/python3 tests/bench/bench_load.py
    MESHD_BIN_DIR=build/bin /usr/bin/python3 tests/bench/bench_load.py --sizes 64 --agents 1

It writes a float32 file of each size, serves it from a child process (a threaded
HTTP server that answers Range requests with sendfile, so that the server is not what
is measured), and times, best of --rounds:
- curl: `curl -s -o /dev/null URL` (the baseline: one connection, the whole file);
- load: meshd.load(url, dtype, shape) on a mesh of N agents, replicated (N = 1) or
  sharded along dim 0 (N > 1: each agent fetches its 1/N with a Range request), until
  a sync says every agent has it. MB/s counts the file's bytes once.
One JSON line per (agents, size, path) on stdout; ratio = load MB/s / curl MB/s.

Use Debian's /usr/bin/python3; curl must be on PATH."""

import argparse
import http.server
import json
import os
import shutil
import socketserver
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))

import meshd_testlib as lib  # noqa: E402

MIB = 1 << 20


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    root = "."

    def log_message(self, *a):
        pass

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        name = os.path.join(self.root, os.path.basename(self.path))
        try:
            f = open(name, "rb")
        except OSError:
            self.send_error(404)
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            first, last, code = 0, size - 1, 200
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes="):
                a, b = rng[6:].split("-")
                first, last, code = int(a), min(int(b) if b else size - 1, size - 1), 206
            self.send_response(code)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(last - first + 1))
            if code == 206:
                self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
            self.end_headers()
            if self.command == "GET":
                self.wfile.flush()
                off, left = first, last - first + 1
                while left:
                    n = os.sendfile(self.connection.fileno(), f.fileno(), off, min(left, 64 * MIB))
                    if n <= 0:
                        break
                    off, left = off + n, left - n


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


def http_server(root, port_file):
    """Child process: serves root until killed."""
    _Handler.root = root
    srv = _Server(("127.0.0.1", 0), _Handler)
    with open(port_file + ".tmp", "w") as f:
        f.write(f"{srv.server_address[1]}\n")
    os.rename(port_file + ".tmp", port_file)
    srv.serve_forever()


def best(fn, rounds):
    out = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def emit(**kw):
    print(json.dumps(kw), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64,1024", help="MiB, comma separated")
    ap.add_argument("--agents", default="1,4", help="agent counts, comma separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--http-server", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.http_server:
        return http_server(*a.http_server)
    import meshd
    work = tempfile.mkdtemp(prefix="meshd-bench-load-")
    port_file = os.path.join(work, "http.port")
    hp = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--http-server", work,
                           port_file])
    try:
        while not os.path.exists(port_file):
            assert hp.poll() is None, "the HTTP server exited"
            time.sleep(0.05)
        with open(port_file) as f:
            base = f"http://127.0.0.1:{int(f.read())}"
        sizes = [int(x) for x in a.sizes.split(",")]
        curl = {}
        for mib in sizes:
            name = f"x{mib}.bin"
            with open(os.path.join(work, name), "wb") as f:
                f.write(np.ones(mib * MIB // 4, np.float32).tobytes())
            url = f"{base}/{name}"
            secs = best(lambda: subprocess.run(["curl", "-s", "-f", "-o", "/dev/null", url],
                                               check=True), a.rounds)
            curl[mib] = mib * MIB / secs / 1e6
            emit(bench="load", mib=mib, path="curl", mb_s=round(curl[mib], 1), ratio=1.0)
        for n in (int(x) for x in a.agents.split(",")):
            srv = lib.spawn("meshd", lib.MESHD, ["--listen", "127.0.0.1:0", "--local-agents",
                                                 str(n), "--log-level", "warn"], work)
            try:
                lib.wait_ready(srv, n)
                with meshd.connect(f"127.0.0.1:{srv.port}", timeout=600) as s:
                    with s.mesh(gpu=n).activate():
                        for mib in sizes:
                            url = f"{base}/x{mib}.bin"
                            shape = (n, mib * MIB // 4 // n)

                            def load():
                                t = meshd.load(url, dtype="float32", shape=shape,
                                               shard="gpu" if n > 1 else None, dim=0)
                                s.sync()
                                t.drop()
                                s.sync()
                            load()  # warm: page cache, agent allocator
                            secs = best(load, a.rounds)
                            mbs = mib * MIB / secs / 1e6
                            emit(bench="load", agents=n, mib=mib, path="load", mb_s=round(mbs, 1),
                                 curl_mb_s=round(curl[mib], 1), ratio=round(mbs / curl[mib], 3))
            finally:
                lib.stop(srv)
    finally:
        hp.terminate()
        hp.wait(10)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
