#!/usr/bin/python3
"""transfer_abuse: what unread Fetches cost the server and its agents, and how fast
transfers run. Not a test (not run by ctest): run by hand, e.g.

    MESHD_BIN_DIR=build/bin /usr/bin/python3 tests/bench/transfer_abuse.py
    MESHD_BIN_DIR=build/bin /usr/bin/python3 tests/bench/transfer_abuse.py -- --session-max-transfers 64

Starts `meshd --local-agents 2` (its own free port), makes one float32 tensor of
--mib MiB per session on rank 0, then opens --fetches Fetch calls of it spread
over --sessions sessions, none of which is ever read. After --hold seconds it
samples the server's VmRSS (and each agent's), runs a health check and another
session's small compute (ones, reduce, fetch), and counts how the Fetches ended
so far (still open, refused with RESOURCE_EXHAUSTED, ...) and agents the server
lost meanwhile (from its log). Then it cancels them
and times --rounds Fetches and Uploads of the same size read to the end, one at a
time, in MiB/s. One JSON object on stdout. Extra meshd flags go after `--`.

Use Debian's /usr/bin/python3 (grpcio); generated modules come from
tests/integration/meshd_testlib.py."""

import argparse
import json
import os
import sys
import tempfile
import time

import grpc

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))

import meshd_testlib as lib  # noqa: E402

_SVC = "/meshd.v1.TensorService/"


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def threads(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return None


def open_fetch(s, ref, timeout=120, ch=None):
    t = lib.tensor_pb2()
    fn = (ch or s.ch).unary_stream(_SVC + "Fetch", request_serializer=lambda m: m.SerializeToString(),
                           response_deserializer=t.FetchChunk.FromString)
    return fn(t.FetchRequest(ref=ref, coords=[t.Coordinate(dim="gpu", index=0)]),
              metadata=s.metadata, timeout=timeout)


def fetch_all(s, ref):
    n = 0
    for c in open_fetch(s, ref):
        if c.WhichOneof("part") == "data":
            n += len(c.data)
    return n


def upload(s, mesh, nbytes, chunk=1 << 20):
    t = lib.tensor_pb2()
    ref = s.new_ref()
    raw = bytes(nbytes)
    hdr = t.UploadHeader(ref=ref, mesh=mesh, shape=[nbytes // 4], dtype=lib.dtype("float32"),
                         total_bytes=nbytes)
    msgs = [t.UploadChunk(header=hdr)] + [t.UploadChunk(data=raw[i:i + chunk])
                                          for i in range(0, nbytes, chunk)]
    fn = s.ch.stream_unary(_SVC + "Upload", request_serializer=lambda m: m.SerializeToString(),
                           response_deserializer=t.UploadReply.FromString)
    fn(iter(msgs), metadata=s.metadata, timeout=120)
    return ref


def small_compute(port):
    """ones [4] on both ranks, sum-reduce over gpu, fetch rank 0: [2, 2, 2, 2]."""
    s = lib.Session(port, "probe", timeout=20)
    try:
        m = s.mesh(gpu=2).ref
        x = s.tensor(m, (4,), "ones").ref
        r = s.new_ref()
        s.run(lib.reduce(r, x, ("gpu",), "sum"))
        data = b"".join(c.data for c in open_fetch(s, r, timeout=20) if c.WhichOneof("part") == "data")
        import struct
        return list(struct.unpack("<4f", data))
    finally:
        s.close()
        s.shut()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fetches", type=int, default=60)
    ap.add_argument("--sessions", type=int, default=1)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--hold", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("extra", nargs="*", help="meshd flags (after --)")
    a = ap.parse_args()

    work = tempfile.mkdtemp(prefix="meshd-transfer-")
    srv = lib.spawn("meshd", lib.MESHD, ["--listen", "127.0.0.1:0", "--local-agents", "2",
                                         "--log-level", "warn"] + a.extra, work)
    out = {"flags": a.extra, "fetches": a.fetches, "sessions": a.sessions, "mib": a.mib}
    try:
        lib.wait_ready(srv, 2)
        agents = sorted(lib.agent_children(srv.pid))
        nbytes = a.mib << 20
        sessions = []
        for i in range(a.sessions):
            s = lib.Session(srv.port, f"abuse-{i}", timeout=60)
            m = s.run(lib.create_mesh(s.new_ref(), gpu=2)).mesh.ref
            x = s.tensor(m, (nbytes // 4,), "ones").ref
            sessions.append((s, m, x))
        out["before"] = {"server_mib": rss_mib(srv.pid), "agents_mib": [rss_mib(p) for p in agents],
                         "server_threads": threads(srv.pid)}
        calls = []
        # An attacker keeps its receive window small (no BDP probing): what it does not
        # read stays on the server's side of the connection.
        abuse_ch = grpc.insecure_channel(srv.address, options=[
            ("grpc.enable_http_proxy", 0), ("grpc.http2.bdp_probe", 0),
            ("grpc.http2.lookahead_bytes", 65536)])
        for i in range(a.fetches):
            s, _, x = sessions[i % len(sessions)]
            calls.append(open_fetch(s, x, ch=abuse_ch))
        peak = {"server_mib": 0, "agents_mib": [0] * len(agents), "client_mib": 0}
        stop_at = time.monotonic() + a.hold
        while time.monotonic() < stop_at:
            peak["server_mib"] = max(peak["server_mib"], rss_mib(srv.pid) or 0)
            peak["agents_mib"] = [max(x, rss_mib(p) or 0) for x, p in zip(peak["agents_mib"], agents)]
            peak["client_mib"] = max(peak["client_mib"], rss_mib(os.getpid()) or 0)
            time.sleep(0.2)
        out["peak"] = peak
        out["during"] = {"server_mib": rss_mib(srv.pid), "agents_mib": [rss_mib(p) for p in agents],
                         "server_threads": threads(srv.pid),
                         "agent_threads": [threads(p) for p in agents]}
        t0 = time.monotonic()
        try:
            lib.health_check(srv.port, lib.TENSOR_SERVICE, timeout=5)
            out["during"]["health"] = "ok"
        except grpc.RpcError as e:
            out["during"]["health"] = f"{e.code()}: {e.details()}"
        out["during"]["health_ms"] = round((time.monotonic() - t0) * 1000, 1)
        t0 = time.monotonic()
        try:
            out["during"]["compute"] = small_compute(srv.port)
        except Exception as e:  # reported, not raised: this is a measurement
            out["during"]["compute"] = f"failed: {e}"
        out["during"]["compute_ms"] = round((time.monotonic() - t0) * 1000, 1)
        ended = {}
        for c in calls:
            if c.done():
                k = str(c.code())
                ended[k] = ended.get(k, 0) + 1
        out["during"]["ended"] = ended
        out["during"]["open"] = sum(1 for c in calls if not c.done())
        refused = [c for c in calls if c.done() and c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]
        if refused:
            out["during"]["refusal"] = refused[0].details()
        for c in calls:
            c.cancel()
        abuse_ch.close()
        time.sleep(1.0)
        out["after_cancel"] = {"server_mib": rss_mib(srv.pid),
                               "agents_mib": [rss_mib(p) for p in agents],
                               "server_threads": threads(srv.pid),
                               "agent_threads": [threads(p) for p in agents]}

        with open(srv.log, errors="replace") as f:
            out["agents_lost"] = sum(1 for line in f if " was lost at " in line)
        if out["agents_lost"]:  # the mesh is gone: a fresh session for the timings
            s = lib.Session(srv.port, "timing", timeout=60)
            m = s.run(lib.create_mesh(s.new_ref(), gpu=2)).mesh.ref
            x = s.tensor(m, (nbytes // 4,), "ones").ref
            sessions.append((s, m, x))
        s, m, x = sessions[-1] if out["agents_lost"] else sessions[0]
        fetch_all(s, x)  # warm up
        t0 = time.monotonic()
        for _ in range(a.rounds):
            assert fetch_all(s, x) == nbytes
        dt = time.monotonic() - t0
        out["fetch_mib_s"] = round(a.rounds * a.mib / dt, 1)
        t0 = time.monotonic()
        for _ in range(a.rounds):
            r = upload(s, m, nbytes)
            s.run(lib.drop(r))
        dt = time.monotonic() - t0
        out["upload_mib_s"] = round(a.rounds * a.mib / dt, 1)
        out["end"] = {"server_mib": rss_mib(srv.pid), "agents_mib": [rss_mib(p) for p in agents]}
        for s, _, _ in sessions:
            s.shut()
    finally:
        lib.stop(srv)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
