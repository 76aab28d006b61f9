#!/usr/bin/python3
"""bench.smoke (ctest): every benchmark under tests/bench, and the Python client's
bench_pipeline, run for a moment (--seconds 0.2 and the like) so that none of them
rots; then the two plotting scripts on what they printed. A benchmark fails this
test if it exits non-zero, prints a line that is not JSON, or leaves out a figure
it should report (each must be a positive number). The figures themselves mean
nothing at this length: the full runs are by hand (tests/bench/README in each
file's header).

    MESHD_BIN_DIR=build/bin /usr/bin/python3 tests/bench/smoke.py
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
BIN = os.environ.get("MESHD_BIN_DIR") or os.path.join(REPO, "build", "bin")
PY = "/usr/bin/python3"

# (name, argv, {bench name: figures each of its lines must have as positive numbers})
RUNS = [
    ("bench_rpc", [os.path.join(BIN, "bench_rpc"), "--seconds", "0.2", "--warmup", "0.05"],
     {"rpc": ["unary_1_calls_per_s", "unary_1_p50_us", "bidi_msgs_per_s"]}),
    ("bench_commands", [os.path.join(BIN, "bench_commands"), "--seconds", "0.2", "--warmup", "0.05",
                        "--agents", "1", "--batch", "16", "--live-tensors", "2000",
                        "--memory-seconds", "10", "--c-client"],
     {"rpc": ["bidi_msgs_per_s"],
      "commands": ["commands_per_s", "ratio_to_bidi", "unary_execute_p50_us",
                   "unary_p50_ratio_to_echo", "server_cpu_us_per_command"],
      "c_client": ["commands_per_s", "ratio_to_bidi", "ratio_to_raw_commands",
                   "commands_per_message"],
      "memory": ["rss_bytes_per_tensor", "agents_rss_bytes_per_tensor"]}),
    ("bench_compute", [os.path.join(BIN, "bench_compute"), "--seconds", "0.05", "--min-bytes", "1024",
                       "--max-bytes", "65536", "--members", "2", "--broadcast-bytes", "1048576",
                       "--broadcast-dests", "2", "--skip-kernels", "--skip-commands"],
     {"loopback_tcp": ["bytes_per_s"], "allreduce": ["us_per_call", "busbw_gb_per_s"],
      "broadcast": ["p2p_ms", "chain_ms", "chain_ratio_to_p2p"]}),
    ("bench_data", [os.path.join(BIN, "bench_data"), "--sizes", "1", "--agents", "1", "--rounds", "1"],
     {"data": ["mb_s", "ratio"]}),
    ("bench_data.py", [PY, os.path.join(HERE, "bench_data.py"), "--sizes", "1", "--agents", "1",
                       "--rounds", "1"],
     {"data": ["mb_s", "ratio"]}),
    ("bench_small.py", [PY, os.path.join(HERE, "bench_small.py"), "--kib", "4", "--agents", "1",
                        "--calls", "2", "--rounds", "1"],
     {"small_upload": ["p50_us", "raw_unary_p50_us", "ratio", "speedup_vs_upload"]}),
    ("bench_wan.py", [PY, os.path.join(HERE, "bench_wan.py"), "--rtt-ms", "4", "--mib", "4",
                      "--rounds", "1", "--windows", "default"],
     {"wan": ["mb_s", "loopback_mb_s", "ratio"]}),
    ("bench_load.py", [PY, os.path.join(HERE, "bench_load.py"), "--sizes", "1", "--agents", "1",
                       "--rounds", "1"],
     {"load": ["mb_s", "ratio"]}),
]


_TMPDIR = None  # main's temp dir: every benchmark's TMPDIR, removed however they ended


def env():
    e = {k: v for k, v in os.environ.items()
         if k.lower() not in ("http_proxy", "https_proxy", "grpc_proxy", "all_proxy")}
    e["MESHD_BIN_DIR"] = BIN
    if _TMPDIR:
        e["TMPDIR"] = _TMPDIR
    e["PYTHONPATH"] = os.path.join(REPO, "clients", "python")
    return e


def check(name, out, want):
    """Every stdout line is JSON; each bench in `want` printed a line, with its figures > 0."""
    seen = {}
    for line in out.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise AssertionError(f"{name}: a line that is not JSON: {line[:200]!r}")
        seen.setdefault(row.get("bench"), []).append(row)
    for bench, figures in want.items():
        assert bench in seen, f"{name}: no '{bench}' line (got {sorted(map(str, seen))})"
        for row in seen[bench]:
            for f in figures:
                v = row.get(f)
                assert isinstance(v, (int, float)) and v > 0, f"{name}: {bench}.{f} = {v!r}: {row}"
    return [json.dumps(r) for rows in seen.values() for r in rows]


def run(name, argv, want, timeout=120):
    t0 = time.monotonic()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env())
    assert p.returncode == 0, f"{name} exited {p.returncode}:\n{p.stderr[-3000:]}"
    lines = check(name, p.stdout, want)
    print(f"bench.smoke: {name} ok in {time.monotonic() - t0:.1f} s", flush=True)
    return lines


def pipeline(tmp):
    """bench_pipeline.py against a meshd of our own (2 local agents), stopped by its pid."""
    port_file = os.path.join(tmp, "port")
    log = open(os.path.join(tmp, "meshd.log"), "w")
    srv = subprocess.Popen([os.path.join(BIN, "meshd"), "--listen", "127.0.0.1:0", "--port-file",
                            port_file, "--local-agents", "2"], stdout=log, stderr=log, env=env())
    try:
        deadline = time.monotonic() + 30
        while not (os.path.exists(port_file) and open(port_file).read().strip()):
            assert srv.poll() is None and time.monotonic() < deadline, "meshd did not start"
            time.sleep(0.05)
        addr = f"127.0.0.1:{open(port_file).read().strip()}"
        argv = [PY, os.path.join(REPO, "clients", "python", "examples", "bench_pipeline.py"),
                "--server", addr, "--n", "100", "--rounds", "1"]
        # Until the agents registered, the server refuses (UNAVAILABLE, or a mesh with
        # no healthy agent): tried again then, for at most 15 s.
        for attempt in range(60):
            p = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env())
            waiting = "UNAVAILABLE" in p.stderr or "is healthy" in p.stderr
            if p.returncode == 0 or not waiting or attempt == 59:
                break
            time.sleep(0.25)
        assert p.returncode == 0, f"bench_pipeline exited {p.returncode}:\n{p.stderr[-3000:]}"
        check("bench_pipeline", p.stdout,
              {"pipeline": ["unary_per_s", "raw_unary_per_s", "pipelined_per_s", "unary_ratio"]})
        print("bench.smoke: bench_pipeline ok", flush=True)
    finally:
        srv.send_signal(signal.SIGTERM)
        try:
            srv.wait(timeout=30)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait()
        log.close()


def main():
    global _TMPDIR
    lines = []
    with tempfile.TemporaryDirectory(prefix="meshd-bench-smoke-") as tmp:
        _TMPDIR = tmp
        for name, argv, want in RUNS:
            lines += run(name, argv, want)
        pipeline(tmp)
        jsonl = os.path.join(tmp, "all.jsonl")
        with open(jsonl, "w") as f:
            f.write("\n".join(lines) + "\n")
        for script, png in (("plot_data.py", "data.png"), ("plot_commands.py", "commands.png")):
            out = os.path.join(tmp, png)
            p = subprocess.run([PY, os.path.join(HERE, script), jsonl, "-o", out],
                               capture_output=True, text=True, timeout=120, env=env())
            assert p.returncode == 0, f"{script} exited {p.returncode}:\n{p.stderr[-3000:]}"
            with open(out, "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n", f"{script} wrote no PNG"
            print(f"bench.smoke: {script} ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
