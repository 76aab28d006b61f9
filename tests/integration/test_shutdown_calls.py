"""SIGTERM with calls in flight (docs/operations.md "Lifecycle"): a Sync blocked on
work that will not finish is answered, once --drain-seconds passed, with UNAVAILABLE
naming the shutdown (not a bare cancel or a reset connection), and meshd exits 0
within its drain plus the agents' stop, leaving no agent behind. Bounded waits."""

import os
import signal
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest

import meshd_testlib as lib
from meshd_testlib import Session, sync
from test_compute import FetchError, fetch, upload


def test_sigterm_answers_a_blocked_sync_with_unavailable_naming_the_shutdown(meshd_server):
    drain = 2
    srv = lib.wait_ready(meshd_server(2, "--drain-seconds", drain,
                                      env={"MESHD_FAULT": "call:hang,rank=0,count=1"}), 2)
    kids = lib.agent_children(srv.pid)
    busy = Session(srv.port, "busy")
    idle = Session(srv.port, "idle")
    try:
        m = busy.mesh(gpu=2).ref
        x = upload(busy, m, np.ones(4, dtype=np.float32))
        busy.run(lib.call("add_", lib.Ref(x), 1.0))  # hangs on rank 0 (for an hour)
        out = {}

        def run():
            try:
                out["result"] = busy.run(sync(), timeout=30)
            except lib.CommandError as e:
                out["error"] = e
            out["t"] = time.monotonic()

        got = {}

        def run_fetch():
            try:
                got["result"] = fetch(busy, x, gpu=0)
            except FetchError as e:
                got["error"] = e
            got["t"] = time.monotonic()

        th = threading.Thread(target=run, daemon=True)
        th.start()
        tf = threading.Thread(target=run_fetch, daemon=True)
        tf.start()
        time.sleep(0.5)
        assert "t" not in out and "t" not in got, (out, got)
        t0 = time.monotonic()
        os.kill(srv.pid, signal.SIGTERM)
        th.join(drain + 8)
        assert "t" in out, f"the Sync was not answered {drain + 8} s after SIGTERM"
        e = out.get("error")
        assert e is not None, f"the blocked Sync succeeded: {out}"
        assert e.code == grpc.StatusCode.UNAVAILABLE, (e.code, str(e))
        assert e.kind == "UNAVAILABLE" and "shutting down" in e.message, str(e)
        tf.join(2)
        assert "t" in got, "the Fetch was not answered after the Sync was"
        e = got.get("error")
        assert e is not None, f"the blocked Fetch succeeded: {got}"
        assert e.code == grpc.StatusCode.UNAVAILABLE, (e.code, str(e))
        assert e.kind == "UNAVAILABLE" and "shutting down" in e.message, str(e)
        try:
            rc = srv.proc.wait(max(0.1, drain + 8 - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"meshd still running {drain + 8} s after SIGTERM\n"
                                 f"{lib.log_tail(srv.log)}")
        assert rc == 0, f"exit code {rc}\n{lib.log_tail(srv.log)}"
        assert not lib.wait_gone(kids, 2.0), "agents outlived meshd"
    finally:
        busy.shut()
        idle.shut()


def test_sigterm_to_an_agent_mid_instruction_then_its_return(meshd_server, watches, tmp_path):
    """SIGTERM to a local agent whose instruction hangs: the Sync waiting on it fails
    AGENT_LOST at once (not after the agent's drain), readiness (--min-agents 2) turns
    NOT_SERVING and back once the agent was restarted, and once the session is closed
    the gauges are back at zero."""
    from test_metrics import parse, sample, scrape
    pf = tmp_path / "metrics.port"
    srv = lib.wait_ready(meshd_server(2, "--min-agents", 2, "--metrics-listen", "127.0.0.1:0",
                                      "--metrics-port-file", pf,
                                      env={"MESHD_FAULT": "call:hang,rank=0,count=1"}), 2)
    mport = lib.read_port_file(str(pf), srv.proc, srv.log)
    kid0 = next(p for p in lib.agent_children(srv.pid) if lib.child_rank(p) == 0)
    w = watches(srv.port, lib.TENSOR_SERVICE)
    assert lib.status_name(w.first()) == "SERVING"
    s = Session(srv.port, "victim")
    try:
        m = s.mesh(gpu=2).ref
        x = upload(s, m, np.ones(4, dtype=np.float32))
        s.run(lib.call("add_", lib.Ref(x), 1.0))  # hangs on rank 0
        out = {}

        def run():
            try:
                out["result"] = s.run(sync(), timeout=30)
            except lib.CommandError as e:
                out["error"] = e
            out["t"] = time.monotonic()

        th = threading.Thread(target=run, daemon=True)
        th.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        os.kill(kid0, signal.SIGTERM)
        th.join(10)
        assert "t" in out, "the Sync was not answered 10 s after its agent's SIGTERM"
        assert out["t"] - t0 < 2.0, f"AGENT_LOST took {out['t'] - t0:.1f} s"
        assert "error" in out and out["error"].kind == "AGENT_LOST", out
        w.wait_for(lib.NOT_SERVING(), 5)
        w.wait_for(lib.SERVING(), 20)
        s.close()
    finally:
        s.shut()
    deadline = time.monotonic() + 5
    while True:
        fams = parse(scrape(mport))
        got = {n: sample(fams, n) for n in ("meshd_sessions", "meshd_queued_commands",
                                            "meshd_queued_instructions", "meshd_flow_waiting",
                                            "meshd_queued_instruction_bytes")}
        got["healthy"] = sample(fams, "meshd_agents", state="healthy")
        got["restarts"] = sample(fams, "meshd_agent_restarts_total")
        want = {n: 0 for n in got}
        want.update(healthy=2, restarts=1)
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert got == want, f"{got}\n{lib.log_tail(srv.log)}"



def _open_streams(s, m):
    """Opens a Submit stream (one command answered, then idle) and an Upload that sent
    its header and a quarter of its bytes; returns (submit call, upload future, closers)."""
    import queue
    from test_compute import pb
    t = lib.tensor_pb2()
    reqs, ups = queue.Queue(), queue.Queue()
    reqs.put(s.command(lib.create_stream(s.new_ref(), "side")).SerializeToString())

    def gen(q):
        while True:
            r = q.get()
            if r is None:
                return
            yield r
    sub = s.ch.stream_stream("/meshd.v1.TensorService/Submit", request_serializer=lambda b: b,
                             response_deserializer=t.SubmitReply.FromString)
    call = sub(gen(reqs), metadata=s.metadata, timeout=30)
    next(call)
    hdr = pb().UploadHeader(ref=s.new_ref(), mesh=m, shape=[1 << 16],
                            dtype=lib.dtype("float32"), total_bytes=4 << 16)
    ups.put(pb().UploadChunk(header=hdr))
    ups.put(pb().UploadChunk(data=bytes(1 << 16)))
    up = s.ch.stream_unary("/meshd.v1.TensorService/Upload",
                           request_serializer=lambda m: m.SerializeToString(),
                           response_deserializer=pb().UploadReply.FromString)
    fut = up.future(gen(ups), metadata=s.metadata, timeout=30)
    return call, fut, lambda: (reqs.put(None), ups.put(None))


def _sigterm_with_open_streams(meshd_server):
    """SIGTERM (--drain-seconds 1) with an open Submit stream and an Upload mid-stream;
    returns {"submit"|"upload": (code, kind, details)} once meshd exited 0."""
    from test_compute import _kind
    drain = 1
    srv = lib.wait_ready(meshd_server(2, "--drain-seconds", drain), 2)
    s = Session(srv.port, "streams")
    ends = {}
    try:
        call, fut, close = _open_streams(s, s.mesh(gpu=2).ref)
        time.sleep(0.5)
        os.kill(srv.pid, signal.SIGTERM)
        try:
            for _ in call:
                pass
            ends["submit"] = (grpc.StatusCode.OK, "", "")
        except grpc.RpcError as e:
            ends["submit"] = (e.code(), _kind(e), e.details())
        try:
            fut.result(timeout=drain + 8)
            ends["upload"] = (grpc.StatusCode.OK, "", "")
        except grpc.RpcError as e:
            ends["upload"] = (e.code(), _kind(e), e.details())
        close()
        assert srv.proc.wait(drain + 8) == 0, lib.log_tail(srv.log)
    finally:
        s.shut()
    return ends


def test_sigterm_ends_an_upload_mid_stream_with_unavailable_naming_the_shutdown(meshd_server):
    """Past the drain meshd stops its agents before it cancels the calls left: an Upload
    still open must not be told its agent died (AGENT_LOST, "the agent died or cannot
    be reached"): the server is shutting down."""
    code, kind, details = _sigterm_with_open_streams(meshd_server)["upload"]
    assert (code, kind) == (grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE"), (code, kind, details)
    assert "shutting down" in details, details


def test_sigterm_ends_an_open_submit_stream_with_unavailable_naming_the_shutdown(meshd_server):
    """An idle Submit stream still open after the drain ends with UNAVAILABLE naming the
    shutdown and the flag (gRPC's own cancel said only "Cancelling all calls", no
    meshd-error-kind)."""
    code, kind, details = _sigterm_with_open_streams(meshd_server)["submit"]
    assert (code, kind) == (grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE"), (code, kind, details)
    assert "shutting down" in details, details
