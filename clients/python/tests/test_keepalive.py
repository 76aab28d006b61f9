"""The session's background KeepAlive and the deadlines of sync() and fetch_shard()
(issue 12, points 4 and 7), against `meshd --session-ttl 2 --agent-timeout 60`.

A stopped (SIGSTOP) agent wedges the work of its rank; --agent-timeout 60 keeps the server
from declaring it lost during the test. Every test SIGCONTs it in a finally."""

import contextlib
import gc
import glob
import os
import signal
import threading
import time

import grpc
import numpy as np
import pytest

import meshd
from conftest import log_path, start_meshd, stop_meshd

TTL = 2


@pytest.fixture(scope="module")
def short_lease():
    """(address, Popen) of a meshd whose sessions expire after 2 idle seconds."""
    addr, proc = start_meshd(2, name="meshd-keepalive",
                             flags=("--session-ttl", TTL, "--agent-timeout", 60))
    try:
        yield addr, proc
    finally:
        stop_meshd(proc)


def _listed(addr, session_id):
    with meshd.connect(addr, client_name="observer") as obs:
        pb = obs._pb
        rows = obs._unary("ListSessions", pb.ListSessionsRequest(), pb.ListSessionsReply,
                          metadata=()).sessions
        return any(r.session_id == session_id for r in rows)


def _keepalive_threads():
    return [t for t in threading.enumerate() if t.name == "meshd-keepalive" and t.is_alive()]


def _agent_pid(server_pid, rank):
    """The meshd-agent child of server_pid started with --rank rank."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for path in glob.glob(f"/proc/{server_pid}/task/*/children"):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                with open(path) as f:
                    for pid in map(int, f.read().split()):
                        with open(f"/proc/{pid}/cmdline", "rb") as c:
                            args = c.read().split(b"\0")
                        if args[0].endswith(b"meshd-agent") and b"--rank" in args and \
                                args[args.index(b"--rank") + 1] == str(rank).encode():
                            return pid
        time.sleep(0.05)
    raise AssertionError(f"no rank-{rank} agent child of meshd {server_pid}")


@contextlib.contextmanager
def _stopped(pid):
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                    break
            time.sleep(0.01)
        time.sleep(0.2)  # every thread, not just the main one
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_an_idle_session_outlives_its_ttl_and_close_stops_the_keepalive(short_lease):
    addr, _ = short_lease
    # Other tests' sessions that were never closed stop theirs when collected: not
    # counted (only these two sessions' threads are).
    before = set(_keepalive_threads())
    s = meshd.connect(addr, client_name="idle-python")
    # The control: the same session without its keepalive thread expires in these 7 s.
    bare = meshd.connect(addr, client_name="bare-python")
    # A 1 s lease: kept too (its KeepAlives a third of it apart, not a whole lease).
    one = meshd.connect(addr, client_name="ttl1-python", ttl_seconds=1)
    try:
        assert s.ttl_seconds == TTL and one.ttl_seconds == 1
        assert set(_keepalive_threads()) - before == {s._ka_thread, bare._ka_thread,
                                                       one._ka_thread}
        bare._stop_keepalive()
        m, mb = s.mesh(gpu=2), bare.mesh(gpu=2)
        time.sleep(7.0)  # no call from this thread: > 3 leases
        with m.activate():
            x = meshd.full((3,), 2.0) + 1
            assert np.array_equal(meshd.inspect(x, gpu=1), np.full(3, 3.0, np.float32))
        s.sync()
        one.sync()
        with pytest.raises(meshd.MeshdError) as e:
            with mb.activate():
                meshd.ones((2,))
        assert e.value.kind == "NO_SESSION", e.value
    finally:
        one.close()
        bare.closed = True  # already gone on the server
        bare._ch.close()
        sid = s.id
        s.close()
    assert not s._ka_thread.is_alive(), "close() must stop and join the keepalive thread"
    assert not set(_keepalive_threads()) - before
    assert not _listed(addr, sid), "the closed session is still listed"
    time.sleep(2.5)  # nothing may keep or touch it after close
    with open(log_path("meshd-keepalive"), errors="replace") as f:
        lines = [line for line in f if sid in line]
    assert any("closed" in line for line in lines), lines
    assert not any("expired" in line for line in lines), lines


def test_a_session_dropped_without_close_stops_its_keepalive(short_lease):
    addr, _ = short_lease
    s = meshd.connect(addr, client_name="dropped-python")
    t, sid = s._ka_thread, s.id
    assert t.is_alive()
    del s
    gc.collect()
    t.join(5.0)
    assert not t.is_alive(), "a collected session's keepalive thread lives on"
    # Nothing keeps it alive any more: the server expires it after its lease.
    deadline = time.monotonic() + 10
    while _listed(addr, sid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _listed(addr, sid), "nothing should keep a dropped session alive"


def test_sync_and_fetch_deadlines_on_a_wedged_agent(short_lease):
    addr, proc = short_lease
    pid = _agent_pid(proc.pid, 1)
    with meshd.connect(addr, client_name="deadline-python") as s:
        m = s.mesh(gpu=2)
        with m.activate():
            x = meshd.ones((4,))
            s.sync(timeout=30)
            with _stopped(pid):
                y = x + 1  # accepted at once; rank 1 cannot run it
                t0 = time.monotonic()
                with pytest.raises(meshd.MeshdError) as e:
                    s.sync(timeout=1.0)
                took = time.monotonic() - t0
                assert e.value.kind == "DEADLINE_EXCEEDED", e.value
                assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, e.value
                assert 0.9 <= took < 1.0 + 2.0, f"sync(timeout=1.0) took {took:.2f} s"

                t0 = time.monotonic()
                fut = meshd.fetch_shard(y, timeout=1.0, gpu=1)
                with pytest.raises(meshd.MeshdError) as e:
                    fut.result(timeout=20)
                took = time.monotonic() - t0
                assert e.value.kind == "DEADLINE_EXCEEDED", e.value
                assert took < 1.0 + 2.0, f"fetch_shard(timeout=1.0) took {took:.2f} s"

                with s.pipeline():  # a pipelined Sync waits no longer than a unary one
                    z = y + 1
                    t0 = time.monotonic()
                    with pytest.raises(meshd.MeshdError) as e:
                        s.sync(timeout=1.0)
                    took = time.monotonic() - t0
                    assert e.value.kind == "DEADLINE_EXCEEDED", e.value
                    assert took < 1.0 + 2.0, f"pipelined sync(timeout=1.0) took {took:.2f} s"
                    os.kill(pid, signal.SIGCONT)  # the block's end waits for every answer
            s.sync(timeout=30)  # resumed: everything ran
            assert np.array_equal(meshd.inspect(y, gpu=1), np.full(4, 2.0, np.float32))
            assert np.array_equal(meshd.inspect(z, gpu=1), np.full(4, 3.0, np.float32))
