"""session.pipeline() when things go wrong: a server that stops reading the Submit
stream (flow control), a stream that breaks, rejections and deadlines.

The server runs with `--session-max-queued 2 --agent-timeout 60`: with its rank-0 agent
stopped (SIGSTOP, SIGCONT in a finally) two commands fill the session's flow window and
the server reads nothing more from the Submit stream until the agent runs again.
Every wait is bounded: a hang fails the test instead of blocking the run."""

import contextlib
import gc
import sys
import threading
import time
import traceback
import warnings

import grpc
import numpy as np
import pytest

import meshd
from conftest import start_meshd, stop_meshd
from meshd.pipeline import _QUEUE_BYTES
from test_keepalive import _agent_pid, _stopped


@pytest.fixture(scope="module")
def slow_server():
    """(address, pid of the rank-0 agent) of a meshd whose sessions may queue two commands."""
    addr, proc = start_meshd(2, name="meshd-flow",
                             flags=("--session-max-queued", 2, "--agent-timeout", 60))
    try:
        yield addr, _agent_pid(proc.pid, 0)
    finally:
        stop_meshd(proc)


@contextlib.contextmanager
def _session(addr, timeout):
    with meshd.connect(addr, timeout=timeout) as s:
        m = s.mesh(gpu=2)
        with m.activate():
            yield s, m


def _bounded(fn, limit, mesh=None):
    """fn() on a thread (with `mesh` active there): its result, or its exception raised
    here; fails if it is still running after `limit` seconds (a hang)."""
    out = {}

    def run():
        try:
            with mesh.activate() if mesh is not None else contextlib.nullcontext():
                out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(limit)
    if th.is_alive():  # where it waits says why (the CI log shows it)
        stack = "".join(traceback.format_stack(sys._current_frames().get(th.ident)))
        raise AssertionError(f"still waiting after {limit} s, in:\n{stack}")
    if "error" in out:
        raise out["error"]
    return out["value"]


def _stall(s):
    """Two commands that fill the session's flow window while the agent is stopped: the
    server answers them, then reads no further message (in a block: what is sent after
    this goes in later messages)."""
    a = meshd.ones(2)
    b = a + 1
    if s._pipe is not None:
        s._pipe.flush(5)
    return b


def _fill_until_grpc_stops(q, send, full, limit=15):
    """send() until full() holds and gRPC stopped taking from the client's queue `q`: it
    took nothing for 0.5 s (its write is past the stream's flow-control window). gRPC's
    BDP probing may grow that window meanwhile, more so on a loaded machine: then it takes
    more and this fills again. Fails after `limit` seconds of gRPC taking."""
    deadline = time.monotonic() + limit
    while True:
        while not full():
            send()
        seen = (q.qsize(), q.nbytes)
        time.sleep(0.5)
        if (q.qsize(), q.nbytes) == seen:  # (only the caller's thread puts)
            return
        assert time.monotonic() < deadline, f"gRPC still takes after {limit} s"


def _get(t, **coords):
    return meshd.fetch_shard(t, timeout=20, **coords).result(20)


# ------------------------------------------------------------ close (bug 1)

def test_a_slow_server_at_block_end_keeps_the_queue_and_the_rejections(slow_server):
    """flush() at the block's end runs out of time: the rejection still comes first,
    a DEADLINE_EXCEEDED among .errors says what was left, and the commands still queued
    go out once the server reads again (nothing is cancelled)."""
    addr, pid = slow_server
    with _session(addr, timeout=1) as (s, m):
        def block():
            with _stopped(pid):
                with pytest.raises(meshd.MeshdError) as e:
                    with s.pipeline():
                        meshd.ones(2).reduce("nodim")  # BAD_DIM, answered at once
                        _stall(s)
                        last = [meshd.tensor(np.full(4, float(i), np.float32)) for i in range(6)]
                return e.value, last
        err, last = _bounded(block, 15, m)
        assert err.kind == "BAD_DIM", err
        assert "DEADLINE_EXCEEDED" in [x.kind for x in err.errors], err.errors
        np.testing.assert_array_equal(_bounded(lambda: _get(last[-1], gpu=0), 25), [5.0] * 4)


def test_everything_answered_and_the_half_close_read_late_is_no_error(slow_server):
    """Every command was answered, but the server reads the stream's end only once its
    agents caught up: the block ends without an error (no CANCELLED of the client's own)."""
    addr, pid = slow_server
    with _session(addr, timeout=1) as (s, m):
        def block():
            with _stopped(pid):
                with s.pipeline():
                    return _stall(s)
        b = _bounded(block, 10, m)
        np.testing.assert_array_equal(_bounded(lambda: _get(b, gpu=0), 25), [2.0, 2.0])


def test_the_blocks_own_exception_wins_and_chains_the_deferred_ones(slow_server):
    addr, pid = slow_server
    with _session(addr, timeout=1) as (s, m):
        def block():
            with _stopped(pid):
                with s.pipeline():
                    meshd.ones(2).reduce("nodim")
                    _stall(s)
                    meshd.ones(3)
                    raise KeyError("the block's own")
        with pytest.raises(KeyError) as e:
            _bounded(block, 10, m)
        chained = e.value.__context__
        assert isinstance(chained, meshd.MeshdError) and chained.kind == "BAD_DIM", chained
        assert "DEADLINE_EXCEEDED" in [x.kind for x in chained.errors], chained.errors


# ------------------------------------------------------------ bounded queue (bug 2)

def test_a_server_that_does_not_read_bounds_the_clients_queue(slow_server):
    """Literals of 240 KB to a server that reads nothing: the queue fills, then a send
    waits for room until its deadline. Room comes when those queued reach theirs (taken
    out, never sent): here they were queued with a longer timeout, so none comes and the
    send raises DEADLINE_EXCEEDED; that command was not queued and took no ref. Those
    before it go out once the server reads again."""
    addr, pid = slow_server
    with _session(addr, timeout=2) as (s, m):
        arr = np.zeros(60000, np.float32)

        def block():
            sent, peak = [], [0]

            def send():
                sent.append(meshd.tensor(arr + len(sent)))
                peak[0] = max(peak[0], p._q.nbytes)
            with s.pipeline() as p:
                with _stopped(pid):
                    _stall(s)
                    with pytest.raises(meshd.MeshdError) as e:
                        while len(sent) < 400:
                            s.timeout = 20  # those queued are due after the one that fails
                            _fill_until_grpc_stops(p._q, send, lambda: p._q.qsize() and (
                                p._q.nbytes + arr.nbytes + 1024 > _QUEUE_BYTES))
                            s.timeout = 1  # no room: raises (unless gRPC took some after all)
                            send()
                    s.timeout = 2
                    queued = p._q.qsize()
                    ref = s._ref
                after = meshd.tensor(arr - 1)
            return e.value, sent, queued, ref, after, peak[0]
        err, sent, queued, ref, after, peak = _bounded(block, 40, m)
        assert err.kind == "DEADLINE_EXCEEDED" and "not queued" in err.message, err
        assert 0 < queued and peak <= _QUEUE_BYTES, (len(sent), queued, peak)
        assert after.ref == ref + 1  # the refused command took no ref
        np.testing.assert_array_equal(_bounded(lambda: _get(sent[-1], gpu=1), 25),
                                      arr + len(sent) - 1)
        np.testing.assert_array_equal(_bounded(lambda: _get(after, gpu=0), 25), arr - 1)


def test_queued_commands_are_taken_out_at_their_own_deadline_whoever_waits(slow_server):
    """Literals of 240 KB to a server that reads nothing, until gRPC took some and two
    wait in the client's queue. At their own deadline (the session's timeout) every one
    still queued is taken out and never sent, as in the Node client: the last one while a
    thread other than the pipeline's reads its handle, the others with nobody waiting for
    their answer (DEADLINE_EXCEEDED says so; the end of the block raises those nobody
    read). Once the server reads again none of them ran (a command on the last one's ref
    is refused UNKNOWN_REF), while the one gRPC took before them ran. (They used to stay
    queued, go out later and run: only a wait of the pipelining thread took a command out,
    at that wait's end, and only the commands it waited for.)"""
    addr, pid = slow_server
    # (a timeout that leaves _fill_until_grpc_stops time before the first deadline)
    with _session(addr, timeout=4) as (s, m):
        arr = np.zeros(60000, np.float32)

        def block():
            ts = []
            with pytest.raises(meshd.MeshdError) as end:
                with s.pipeline() as p:
                    with _stopped(pid):
                        _stall(s)
                        # until gRPC took a batch (its write, past the stream's window,
                        # cannot end) and two more wait in the client's queue
                        _fill_until_grpc_stops(
                            p._q, lambda: ts.append(meshd.tensor(arr + len(ts))),
                            lambda: len(ts) >= 30 or len(ts) > p._q.qsize() >= 2, limit=2)
                        waiting = p._q.qsize()
                        with pytest.raises(meshd.MeshdError) as read:  # not the owner's wait
                            _bounded(lambda: ts[-1].shape, 10)
                        unread = [t._pending[0] for t in ts[len(ts) - waiting:-1]]
                        state = (waiting, p._q.qsize(), [q.done() for q in unread])
                    u = ts[-1] + 1  # the server reads again: refused, its operand never ran
                    s.sync(timeout=20)
            return ts, read.value, state, unread, u, end.value
        ts, read, (waiting, left, done), unread, u, end = _bounded(block, 30, m)
        assert len(ts) < 30, "the client's queue never held two commands"
        assert read.kind == "DEADLINE_EXCEEDED" and read.seq is not None, read
        assert read.message.startswith(f"pipeline: command seq {read.seq} was not sent within 4 s: "
                                       "it waited in the client's queue"), read
        assert "never sent, so it did not run" in read.message, read
        assert left == 0 and all(done), (waiting, left, done)  # none waited for, all out
        for q in unread:
            assert q._error.kind == "DEADLINE_EXCEEDED" and "never sent" in q._error.message
        with pytest.raises(meshd.MeshdError) as again:
            ts[-1].shape
        assert again.value is read
        # the block's end: those nobody read (lowest seq first), then u's refusal
        assert [e.kind for e in end.errors] == ["DEADLINE_EXCEEDED"] * len(unread) + [
            "UNKNOWN_REF"], end.errors
        assert end.errors[:-1] == [q._error for q in unread], end.errors
        assert str(ts[-1].ref) in end.errors[-1].message, end.errors
        i = len(ts) - waiting - 1  # the last one gRPC took
        np.testing.assert_array_equal(_bounded(lambda: _get(ts[i], gpu=1), 25), arr + i)


# ------------------------------------------------------------ one pipeline (bug 3)

class _SlowLock:
    """The session's lock, with a pause after each release: another thread gets in
    between two lock sections of one call."""

    def __init__(self):
        self._l = threading.Lock()

    def __enter__(self):
        self._l.acquire()

    def __exit__(self, *exc):
        self._l.release()
        time.sleep(0.05)


def test_two_threads_opening_a_pipeline_at_once_get_one(session, mesh):
    session._lock = _SlowLock()
    got, bar = {}, threading.Barrier(2)

    def worker(name):
        bar.wait()
        try:
            with session.pipeline() as p:
                time.sleep(0.2)
                got[name] = p
        except RuntimeError as e:
            got[name] = e
    ts = [threading.Thread(target=worker, args=(n,), daemon=True) for n in "AB"]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert sorted(type(v).__name__ for v in got.values()) == ["Pipeline", "RuntimeError"], got
    assert session._pipe is None


# ------------------------------------------------------------ deadlines (bugs 4, 5)

def test_sync_and_fetch_in_a_block_take_the_callers_timeout(slow_server):
    addr, pid = slow_server
    with _session(addr, timeout=3) as (s, m):
        def block():
            with s.pipeline():
                x = meshd.ones(2)
                with _stopped(pid):
                    _stall(s)
                    y = x * 3
                    t0 = time.monotonic()
                    with pytest.raises(meshd.MeshdError) as e1:
                        s.sync(timeout=0.3)  # one overall deadline, not 3 s per answer
                    short = time.monotonic() - t0
                    t0 = time.monotonic()
                    f = meshd.fetch_shard(y, gpu=0, timeout=0.3)  # the error comes in f
                    with pytest.raises(meshd.MeshdError) as e2:
                        f.result(5)
                    fetched = time.monotonic() - t0
                    waker = threading.Timer(3.5, _resume, (pid,))
                    waker.start()
                    t0 = time.monotonic()
                    s.sync(timeout=10)  # longer than the session's 3 s: it gets there
                    long = time.monotonic() - t0
            return e1.value, short, e2.value, fetched, long, y
        e1, short, e2, fetched, long, y = _bounded(block, 20, m)
        assert e1.kind == "DEADLINE_EXCEEDED" and short < 2, (e1, short)
        assert e2.kind == "DEADLINE_EXCEEDED" and fetched < 2, (e2, fetched)
        assert long > 3, long
        np.testing.assert_array_equal(_get(y, gpu=1), [3.0, 3.0])


def _resume(pid):
    import os
    import signal
    os.kill(pid, signal.SIGCONT)


def test_calls_that_need_an_answer_wait_the_sessions_timeout(slow_server):
    """mesh.slice, session.mesh and a handle's shape in a block wait for their answer
    at most the session's timeout (not forever) when the server does not read."""
    addr, pid = slow_server
    with _session(addr, timeout=1) as (s, m):
        kinds = []

        def block():
            with s.pipeline():
                with _stopped(pid):
                    _stall(s)
                    t = meshd.ones(3)
                    for call in (lambda: m.slice(gpu=0), lambda: s.mesh(gpu=1),
                                 lambda: t.shape, lambda: s.stream("side")):
                        t0 = time.monotonic()
                        try:
                            call()
                            kinds.append(("answered", time.monotonic() - t0))
                        except meshd.MeshdError as e:
                            kinds.append((e.kind, time.monotonic() - t0))
        with contextlib.suppress(meshd.MeshdError):
            _bounded(block, 20, m)
        assert [k for k, _ in kinds] == ["DEADLINE_EXCEEDED"] * 4, kinds
        assert all(dt < 3 for _, dt in kinds), kinds


# ------------------------------------------------------------ a dying stream (bugs 6, 8)

class _Alive:
    """A reader thread that took its last look at the pending answers but has not yet
    exited (the window in which a send used to slip through)."""

    def __init__(self, real):
        self.real = real

    def is_alive(self):
        return True

    def join(self, timeout=None):
        self.real.join(timeout)


def test_a_command_sent_as_the_stream_dies_is_answered(server):
    got = []
    with _session(server[0], timeout=2) as (s, m):
        with contextlib.suppress(meshd.MeshdError):
            with s.pipeline() as p:
                p._call.cancel()  # the stream dies
                p._reader.join(5)
                p._broken = None  # as when the server ends it without an error
                p._reader = _Alive(p._reader)
                try:
                    t = meshd.ones(2)
                    got.append(_bounded(lambda: t.shape, 5))
                except (meshd.MeshdError, AssertionError) as e:
                    got.append(e)
    assert isinstance(got[0], meshd.MeshdError), got
    assert got[0].kind != "DEADLINE_EXCEEDED", got


def test_a_broken_stream_is_reported_beside_rejections(session, mesh):
    with pytest.raises(meshd.MeshdError) as e:
        with session.pipeline() as p:
            meshd.ones(2).reduce("nodim")
            p.flush()
            p._q.put((b"\x0a\xff\x01", 0))  # not a Command: the server ends the stream
            p._reader.join(10)
    assert e.value.kind == "BAD_DIM", e.value
    assert [x.code for x in e.value.errors][1:] == [grpc.StatusCode.INVALID_ARGUMENT], \
        e.value.errors


# ------------------------------------------------------------ rejections (bugs 7, 10)

def test_a_rejected_literal_is_a_lazy_handle_whatever_the_timing(server):
    """A rejection is never raised at the call, even when its answer is already in when
    the handle is made; an error the caller got is not raised again at the block's end."""
    with _session(server[0], timeout=10) as (s, m):
        s2 = meshd.connect(server[0], quota_bytes=4096)
        try:
            with s2.mesh(gpu=2).activate():
                with s2.pipeline():
                    t = meshd.tensor(np.zeros(4096, np.float32),
                                     progress=lambda d, n: time.sleep(0.3))  # answer is in
                    with pytest.raises(meshd.MeshdError) as e:
                        t.shape
                    assert e.value.kind == "QUOTA", e.value
                # the block ended without raising the QUOTA the caller already got
        finally:
            s2.close()
        with pytest.raises(meshd.MeshdError) as e:
            with s.pipeline():
                bad = meshd.ones(2).reduce("nodim")
                with pytest.raises(meshd.MeshdError):
                    bad.shape
                bad2 = meshd.ones(2).reduce("nodim2")  # not read: raised at the end
        assert e.value.seq == bad2._pending[0].seq and len(e.value.errors) == 1, e.value.errors


def test_fetch_of_a_rejected_pipelined_tensor_reports_the_rejection(session, mesh):
    with pytest.raises(meshd.MeshdError):
        with session.pipeline():
            bad = meshd.ones(2).reduce("nodim")
    for coords in ({"gpu": 0}, {}):
        with pytest.raises(meshd.MeshdError) as e:
            meshd.fetch_shard(bad, timeout=10, **coords).result(10)
        assert e.value.kind == "BAD_DIM", e.value


# ------------------------------------------------------------ releases (bug 9)

def test_releases_lost_to_a_transport_error_are_sent_later(session, mesh, monkeypatch):
    ts = [meshd.ones(2) for _ in range(3)]
    refs = [t.ref for t in ts]
    del ts
    gc.collect()
    assert sorted(session._released) == sorted(refs)
    real = session._unary

    def failing(method, request, *a, **kw):
        if method == "Execute" and request.HasField("release"):
            raise meshd.MeshdError("UNAVAILABLE", "connection reset",
                                   grpc.StatusCode.UNAVAILABLE)
        return real(method, request, *a, **kw)
    monkeypatch.setattr(session, "_unary", failing)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session.sync()
    assert sorted(session._released) == sorted(refs)  # kept for the next try
    monkeypatch.setattr(session, "_unary", real)
    session.sync()
    assert not session._released
    with pytest.raises(meshd.MeshdError) as e:
        session._execute("call", lambda r: session._pb.Call(
            op="add", args=[session._pb.Arg(ref=refs[0]), session._pb.Arg(f=1.0)], results=[r],
            stream=0), claim=1)
    assert e.value.kind == "DROPPED", e.value
