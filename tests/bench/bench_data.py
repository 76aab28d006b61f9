#!/usr/bin/python3
"""bench_data: how fast tensor bytes go up and down, as ratios to raw gRPC streaming
of the same bytes measured in the same run. Not a test (not run by ctest): run by
hand, e.g.

    MESHD_BIN_DIR=build/bin /usr/bin/python3 tests/bench/bench_data.py
    MESHD_BIN_DIR=build/bin /usr/bin/python3 tests/bench/bench_data.py --sizes 1,64 --agents 1

For each agent count it starts `meshd --local-agents N` (its own free port) and, for
each size, times:
- raw: grpcio streaming of the same bytes in --chunk-mib messages, client-streaming
  (the upload baseline) and server-streaming (the fetch baseline), against a
  bytes-in/bytes-out server in a child process (no protobuf, no meshd);
- wire: Upload and Fetch called with grpcio and meshd's protos (what any client pays);
- client: the Python client through the server (data_path="proxy"),
  meshd.tensor(array) + sync and fetch_shard(...).result();
- direct: the same calls with data_path="direct": the client streams straight to
  and from the agents with PlanTransfer grants, all shards in parallel.
With N agents the tensor is sharded: Upload per_rank (a 1/N slice per rank) and Fetch
of every shard, all in flight together. Each figure is the best MB/s of --rounds
runs (machines here are noisy), and its ratio to raw of the same direction and size,
whose rounds alternate with the path's (ratio: best over best; ratio_median: the
median over rounds of path over baseline of the same round), after one round of
each that is not measured (warm-up).
One JSON line per (agents, size, path, direction) on stdout.

Use Debian's /usr/bin/python3 (grpcio, numpy); generated modules come from
tests/integration/meshd_testlib.py."""

import argparse
import concurrent.futures
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import grpc
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))

import meshd_testlib as lib  # noqa: E402
from meshd.tensor import _data_field  # noqa: E402  (UploadChunk{data} packed by hand)

_SVC = "/meshd.v1.TensorService/"
MIB = 1 << 20
MAX_MSG = 64 * MIB
OPTS = [("grpc.max_receive_message_length", MAX_MSG), ("grpc.max_send_message_length", MAX_MSG),
        ("grpc.enable_http_proxy", 0)]


# ------------------------------------------------------------------ the raw baseline

def raw_server(port_file):
    """Child process: Sink (client stream of bytes -> total length), Source
    (a request "<count> <size>" -> count messages of size bytes) and Put (unary:
    bytes -> their length; bench_small.py's baseline)."""
    from concurrent import futures

    def sink(it, ctx):
        return str(sum(len(m) for m in it)).encode()

    def source(req, ctx):
        count, size = map(int, req.decode().split())
        block = bytes(size)
        for _ in range(count):
            yield block

    ident = (lambda b: b)
    handler = grpc.method_handlers_generic_handler("bench.Raw", {
        "Sink": grpc.stream_unary_rpc_method_handler(sink, ident, ident),
        "Source": grpc.unary_stream_rpc_method_handler(source, ident, ident),
        "Put": grpc.unary_unary_rpc_method_handler(lambda b, ctx: str(len(b)).encode(),
                                                  ident, ident),
    })
    srv = grpc.server(futures.ThreadPoolExecutor(4), options=OPTS)
    srv.add_generic_rpc_handlers((handler,))
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    with open(port_file + ".tmp", "w") as f:
        f.write(str(port))
    os.rename(port_file + ".tmp", port_file)
    srv.wait_for_termination()


def start_raw_server(work):
    port_file = os.path.join(work, "raw.port")
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--raw-server", port_file])
    deadline = time.monotonic() + 20
    while not os.path.exists(port_file):
        if time.monotonic() > deadline or p.poll() is not None:
            p.kill()
            raise RuntimeError("the raw server did not start")
        time.sleep(0.05)
    with open(port_file) as f:
        return p, int(f.read())


@contextlib.contextmanager
def raw_channel():
    """A channel to the raw server, which runs in a child process until the block ends."""
    work = tempfile.mkdtemp(prefix="meshd-bench-raw-")
    rawp, port = start_raw_server(work)
    try:
        ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTS)
        try:
            yield ch
        finally:
            ch.close()
    finally:
        rawp.terminate()
        rawp.wait(10)
        shutil.rmtree(work, ignore_errors=True)


def raw_upload(ch, nbytes, chunk):
    data = memoryview(bytes(chunk))
    fn = ch.stream_unary("/bench.Raw/Sink")
    n, rest = [], nbytes
    while rest:
        n.append(min(chunk, rest))
        rest -= n[-1]
    got = int(fn(iter(bytes(data[:k]) for k in n), timeout=600))
    assert got == nbytes, (got, nbytes)


def raw_fetch(ch, nbytes, chunk):
    fn = ch.unary_stream("/bench.Raw/Source")
    got = sum(len(m) for m in fn(f"{nbytes // chunk} {chunk}".encode(), timeout=600))
    assert got == nbytes // chunk * chunk


# ------------------------------------------------------------------ meshd, with its protos

def wire_upload(s, mesh, nagents, nbytes, chunk):
    t = lib.tensor_pb2()
    ref = s.new_ref()
    per = nbytes // nagents
    shape = [nagents, per // 4] if nagents > 1 else [per // 4]
    hdr = t.UploadHeader(ref=ref, mesh=mesh, shape=shape[1:] if nagents > 1 else shape,
                         dtype=lib.dtype("float32"), per_rank=nagents > 1, total_bytes=nbytes)
    block = bytes(chunk)

    def msgs():  # data chunks packed by hand (UploadChunk.data is field 2): no protobuf copy
        yield t.UploadChunk(header=hdr).SerializeToString()
        rest = nbytes
        while rest:
            k = min(chunk, rest)
            yield _data_field(block[:k] if k < chunk else block)
            rest -= k
    fn = s.ch.stream_unary(_SVC + "Upload", request_serializer=lambda b: b,
                           response_deserializer=t.UploadReply.FromString)
    fn(msgs(), metadata=s.metadata, timeout=600)
    return ref


def wire_fetch(s, ref, nagents, pool):
    t = lib.tensor_pb2()
    fn = s.ch.unary_stream(_SVC + "Fetch", request_serializer=lambda m: m.SerializeToString(),
                           response_deserializer=t.FetchChunk.FromString)

    def one(rank):
        req = t.FetchRequest(ref=ref, coords=[t.Coordinate(dim="gpu", index=rank)])
        return sum(len(c.data) for c in fn(req, metadata=s.metadata, timeout=600)
                   if c.WhichOneof("part") == "data")
    return sum(pool.map(one, range(nagents)))


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def best(fn, rounds):
    return min(timed(fn) for _ in range(rounds))


def paired(fn, rounds, raw_fn=None):
    """(best seconds of fn, best seconds of raw_fn, median over rounds of raw / fn
    seconds): each round of fn runs right after a round of the baseline raw_fn, so
    that both see the same machine (a baseline measured once, apart, drifts). One
    round of each first is not measured: a path's first transfer pays for its
    channels' flow-control windows growing and its buffers' first pages."""
    if raw_fn:
        raw_fn()
    fn()
    ts, rs, ratios = [], [], []
    for _ in range(rounds):
        r = timed(raw_fn) if raw_fn else None
        t = timed(fn)
        ts.append(t)
        if r is not None:
            rs.append(r)
            ratios.append(r / t)
    return min(ts), (min(rs) if rs else None), (statistics.median(ratios) if ratios else None)


def emit(out, **kw):
    print(json.dumps(kw), file=out, flush=True)


def run_agents(nagents, sizes, chunk, rounds, raw, paths, directions, out, flags=(), raw_ch=None):
    import meshd
    work = tempfile.mkdtemp(prefix="meshd-bench-data-")
    srv = lib.spawn("meshd", lib.MESHD, ["--listen", "127.0.0.1:0", "--local-agents",
                                         str(nagents), "--log-level", "warn"] + list(flags), work)
    pool = concurrent.futures.ThreadPoolExecutor(nagents)
    try:
        lib.wait_ready(srv, nagents)
        s = lib.Session(srv.port, "bench-data", timeout=600)
        mesh = s.run(lib.create_mesh(s.new_ref(), gpu=nagents)).mesh.ref
        clients = {p: meshd.connect(f"127.0.0.1:{srv.port}", client_name="bench-data",
                                    timeout=600, data_path="proxy" if p == "client" else "direct")
                   for p in paths if p in ("client", "direct")}
        cmeshes = {p: c.mesh(gpu=nagents) for p, c in clients.items()}
        for mib in sizes:
            nbytes = mib * MIB
            figures = {}
            base_fn = {"upload": (lambda: raw_upload(raw_ch, nbytes, chunk)) if raw_ch else None,
                       "fetch": (lambda: raw_fetch(raw_ch, nbytes, chunk)) if raw_ch else None}

            def measure(fn, direction, n=rounds):
                return paired(fn, n, base_fn[direction] if n == rounds else None)
            for path in paths:
                if path == "wire":
                    refs = []

                    def up():
                        refs.append(wire_upload(s, mesh, nagents, nbytes, chunk))
                        s.run(lib.sync())
                    figures[("wire", "upload")] = measure(
                        up, "upload", rounds if "upload" in directions else 1)
                    if "fetch" in directions:
                        figures[("wire", "fetch")] = measure(
                            lambda: wire_fetch(s, refs[-1], nagents, pool), "fetch")
                    s.run(lib.drop(*refs))
                elif path in ("client", "direct"):
                    client, cmesh = clients[path], cmeshes[path]
                    shape = (nagents, nbytes // nagents // 4) if nagents > 1 else (nbytes // 4,)
                    arr = np.ones(shape, np.float32)
                    held = []
                    with cmesh.activate():
                        def up():
                            held.append(meshd.tensor(arr, shard="gpu" if nagents > 1 else None))
                            client.sync()
                        figures[(path, "upload")] = measure(
                            up, "upload", rounds if "upload" in directions else 1)
                        x = held[-1]

                        def down():
                            futs = [meshd.fetch_shard(x, gpu=r) for r in range(nagents)]
                            for f in futs:
                                f.result()
                        if "fetch" in directions:
                            figures[(path, "fetch")] = measure(down, "fetch")
                    if path == "direct":
                        for d in directions:
                            assert client._direct.counts[d] > 0, f"the direct path was not taken ({d})"
                    for t in held:
                        t.drop()
                    del held, x, arr
            for (path, direction), (secs, raw_secs, median) in figures.items():
                if direction not in directions:
                    continue  # uploaded once, only to be fetched: no figure
                mbs = nbytes / secs / 1e6
                base = nbytes / raw_secs / 1e6 if raw_secs else raw.get((direction, mib))
                emit(out, bench="data", agents=nagents, mib=mib, path=path, direction=direction,
                     chunk_mib=chunk // MIB, mb_s=round(mbs, 1),
                     raw_mb_s=round(base, 1) if base else None,
                     ratio=round(mbs / base, 3) if base else None,
                     ratio_median=round(median, 3) if median else None)
        for c in clients.values():
            c.close()
        s.close()
        s.shut()
    finally:
        pool.shutdown()
        lib.stop(srv)
        shutil.rmtree(work, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,64,1024", help="MiB, comma separated")
    ap.add_argument("--agents", default="1,4", help="agent counts, comma separated")
    ap.add_argument("--chunk-mib", type=int, default=1, help="message size of wire and raw")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--paths", default="wire,client,direct")
    ap.add_argument("--directions", default="upload,fetch")
    ap.add_argument("extra", nargs="*", help="meshd flags (after --)")
    ap.add_argument("--raw-server", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.raw_server:
        return raw_server(a.raw_server)
    sizes = [int(x) for x in a.sizes.split(",")]
    chunk = a.chunk_mib * MIB
    raw = {}
    with raw_channel() as ch:
        for mib in sizes:
            nbytes = mib * MIB
            for direction, fn in (("upload", raw_upload), ("fetch", raw_fetch)):
                if direction not in a.directions.split(","):
                    continue
                # One whole transfer first, unmeasured, as paired() does: the first
                # one in each direction grows the windows (measured without it, the
                # raw fetch came out 3-5x slower than the same baseline paired).
                fn(ch, nbytes, chunk)
                secs = best(lambda: fn(ch, nbytes, chunk), a.rounds)
                raw[(direction, mib)] = nbytes / secs / 1e6
                emit(sys.stdout, bench="data", mib=mib, path="raw", direction=direction,
                     chunk_mib=a.chunk_mib, mb_s=round(raw[(direction, mib)], 1), ratio=1.0)
        # Each path's rounds alternate with rounds of the baseline (raw_mb_s, ratio and
        # ratio_median of its line); the lines above are the baseline alone, for charts.
        for n in (int(x) for x in a.agents.split(",")):
            run_agents(n, sizes, chunk, a.rounds, raw, a.paths.split(","),
                       a.directions.split(","), sys.stdout, a.extra, raw_ch=ch)


if __name__ == "__main__":
    main()
