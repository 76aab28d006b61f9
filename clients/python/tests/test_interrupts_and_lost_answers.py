"""What a failure, a lost answer or a Ctrl-C leaves behind: no transfer planned or
tensor defined behind the caller's back, no pipeline waiting for a command it never
queued, the block's own exception kept over close()'s, fetch_shard's timeout bounding
the pool probe, and MeshdError (not grpc's ValueError) on a closed session. Each test
failed on the client before these were fixed (a review of the client)."""

import contextlib
import os
import signal
import socket
import threading
import time

import grpc
import numpy as np
import pytest
from conftest import start_meshd, stop_meshd
from test_direct_faults import _LostAnswer  # a call that reached the server, its answer lost
from test_keepalive import _agent_pid, _stopped

import meshd
from meshd import direct as _direct

MIB = 1 << 20


class Interrupt(BaseException):
    """Stands for KeyboardInterrupt (which would end pytest if it escaped)."""


def _live(s):
    pb = s._pb
    reply = s._unary("ListSessions", pb.ListSessionsRequest(), pb.ListSessionsReply)
    (row,) = [r for r in reply.sessions if r.session_id == s.id]
    return row.live_tensors


class _CtrlC:
    """A SIGINT this process sends itself `delay` s after start(), raising Interrupt
    where it lands; `fired`: when it was sent. A context manager: the handler is
    installed on entry, and the timer cancelled and the old handler back on exit."""

    def __init__(self, delay):
        self.fired = []
        self._timer = threading.Timer(delay, self._send)

    def _send(self):
        self.fired.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    @staticmethod
    def _raise(signum, frame):
        raise Interrupt()

    def start(self):
        self._timer.start()

    def __enter__(self):
        self._old = signal.signal(signal.SIGINT, self._raise)
        return self

    def __exit__(self, *exc):
        self._timer.cancel()
        signal.signal(signal.SIGINT, self._old)


@pytest.fixture(scope="module")
def one_slot():
    addr, proc = start_meshd(2, name="meshd-interrupts", flags=("--session-max-transfers", "1"))
    try:
        yield addr
    finally:
        stop_meshd(proc)


@pytest.fixture(scope="module")
def flow_server():
    addr, proc = start_meshd(2, name="meshd-interrupts-flow",
                             flags=("--session-max-queued", 2, "--agent-timeout", 60))
    try:
        yield addr, _agent_pid(proc.pid, 0)
    finally:
        stop_meshd(proc)


# ------------------------------------------------------------ 1: proxied Upload, answer lost

class _LostUploadFuture:
    """The Upload's future: the call runs for real (the server defines the tensor), and
    its answer is lost on the way back."""

    def __init__(self, real):
        self.real = real

    def add_done_callback(self, fn):
        self.real.add_done_callback(lambda _f: fn(self))

    def result(self, timeout=None):
        self.real.result(timeout)
        raise _LostAnswer()

    def cancel(self):
        return self.real.cancel()

    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_proxied_upload_whose_answer_is_lost_leaves_no_tensor(server, monkeypatch):
    """The C client's fix (a2b475d) on the Python side: the server defined the tensor,
    the answer was lost (the deadline passed, the connection dropped), meshd.tensor
    raises DEADLINE_EXCEEDED and nobody holds the ref. It must be released; it stayed
    live (agents' memory, the session's quota) until the session ended."""
    with meshd.connect(server[0], data_path="proxy", timeout=20) as s:
        with s.mesh(gpu=2).activate():
            s.sync()
            base = _live(s)
            real = s._ch.stream_unary

            def make(method, *a, **kw):
                fn = real(method, *a, **kw)
                if not method.endswith("/Upload"):
                    return fn

                class Lossy:
                    def future(self, *ca, **ckw):
                        return _LostUploadFuture(fn.future(*ca, **ckw))
                return Lossy()
            monkeypatch.setattr(s._ch, "stream_unary", make)
            with pytest.raises(meshd.MeshdError) as ei:
                meshd.tensor(np.ones(MIB, np.float32), progress=False)  # 4 MiB: an Upload
            monkeypatch.undo()
            assert ei.value.kind == "DEADLINE_EXCEEDED", ei.value
            s.sync()
            assert _live(s) == base, "the tensor the lost answer defined is still live"


# ------------------------------------------------------------ 2: a direct fetch that fails before its Read

class _NoMemory:
    """numpy for meshd.direct, whose np.empty fails as for a tensor larger than the
    client's memory (numpy raises MemoryError: 'Unable to allocate ...')."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def empty(shape, dtype=None):
        raise MemoryError(f"Unable to allocate array with shape {shape}")


@pytest.mark.parametrize("fault", ["memory", "dtype", "noshards"])
def test_a_direct_fetch_that_fails_before_reading_finishes_its_plan(one_slot, monkeypatch,
                                                                     fault):
    """memory: the result array cannot be allocated (a tensor larger than the client's
    RAM); dtype: a newer server names a dtype this client does not know; noshards: a
    buggy plan with no shard. Each must end the planned transfer (FinishFetch): it kept
    the session's transfer slot and the agent's snapshot until the grants expired
    (--transfer-grant-ms, 10 min), so the next fetch of a --session-max-transfers 1
    session failed QUOTA."""
    with meshd.connect(one_slot, data_path="direct", timeout=10) as s:
        with s.mesh(gpu=2).activate():
            a = np.arange(MIB, dtype=np.float32)
            t = meshd.tensor(a, progress=False)
            if fault == "memory":
                monkeypatch.setattr(_direct, "np", _NoMemory())
            else:
                real_plan = _direct.Direct.plan

                def odd(self, request, *args):
                    reply = real_plan(self, request, *args)
                    if request.HasField("fetch"):
                        if fault == "dtype":
                            reply.meta.dtype = 99
                        else:
                            del reply.shards[:]
                    return reply
                monkeypatch.setattr(_direct.Direct, "plan", odd)
            with pytest.raises(Exception) as ei:  # noqa: B017 - at the call or in the Future
                meshd.fetch_shard(t, gpu=0, timeout=5, progress=False).result(10)
            monkeypatch.undo()
            if fault == "noshards":
                assert isinstance(ei.value, meshd.MeshdError), repr(ei.value)
            got = meshd.fetch_shard(t, gpu=1, timeout=2, progress=False).result(10)
            np.testing.assert_array_equal(got, a)


# ------------------------------------------------------------ 3: Ctrl-C during FinishUpload

def test_an_upload_interrupted_during_finish_upload_leaves_no_tensor(one_slot, monkeypatch):
    """Ctrl-C while FinishUpload is under way (the server defines the tensor; the
    interrupt is raised as its answer comes back): Direct.upload's docstring says any
    exception tells the server at once, but the FinishUpload step only closes the bar.
    The tensor stayed live with no handle until the session ended."""
    with meshd.connect(one_slot, data_path="direct", timeout=20) as s:
        with s.mesh(gpu=2).activate():
            meshd.tensor(np.ones(MIB, np.float32), progress=False)  # the channels
            s.sync()
            base = _live(s)
            real = s._ch.unary_unary
            state = {"n": 0}  # FinishUpload calls so far (any callable)

            def make(method, *a, **kw):
                fn = real(method, *a, **kw)
                if not method.endswith("/FinishUpload"):
                    return fn

                def finish(*ca, **ckw):
                    reply = fn(*ca, **ckw)
                    state["n"] += 1
                    if state["n"] == 1:
                        raise Interrupt()
                    return reply
                return finish
            monkeypatch.setattr(s._ch, "unary_unary", make)
            with pytest.raises(Interrupt):
                meshd.tensor(np.arange(MIB, dtype=np.float32), progress=False)
            monkeypatch.undo()
            s.sync()
            assert _live(s) == base, "the interrupted upload's tensor is still live"


# ------------------------------------------------------------ 4: Ctrl-C while the pipeline queue is full

def test_ctrl_c_while_a_pipelined_send_waits_for_room(flow_server):
    """The server is not reading the Submit stream (its agent stopped), so a pipelined
    send waits for room in the client's queue; Ctrl-C lands there. Pipeline.send had
    registered the command's _Pending before the wait and leaves it behind, so the
    block's exit waits the whole session timeout for an answer to a command that was
    never queued, even though the server reads again at once, and reports a spurious
    DEADLINE_EXCEEDED."""
    addr, pid = flow_server
    with meshd.connect(addr, timeout=4) as s:
        with s.mesh(gpu=2).activate():
            arr = np.zeros(60000, np.float32)  # 240 KB Literals: the queue fills fast
            with _CtrlC(1.0) as ctrl_c:
                with pytest.raises(Interrupt) as ei:
                    with s.pipeline():
                        with _stopped(pid):  # resumes the agent as the interrupt passes
                            a = meshd.ones(2)
                            b = a + 1
                            s._pipe.flush(5)
                            ctrl_c.start()
                            for i in range(400):
                                meshd.tensor(arr + i)
                took = time.monotonic() - ctrl_c.fired[0]
            assert took < 2.5, f"the block ended {took:.2f} s after Ctrl-C (session timeout 4 s)"
            ctx = ei.value.__context__
            assert ctx is None or ctx.kind != "DEADLINE_EXCEEDED", ctx.errors
            np.testing.assert_array_equal(meshd.fetch_shard(b, gpu=1).result(10), [2.0, 2.0])


# ------------------------------------------------------------ 5: __exit__ and close()

def test_the_blocks_exception_is_not_replaced_by_close(monkeypatch):
    """`with meshd.connect(...) as s:` whose block raises while the server is gone:
    the caller gets its own exception, not close()'s UNAVAILABLE (an `except
    ValueError` around the block no longer caught it)."""
    addr, proc = start_meshd(1, name="meshd-interrupts-exit")
    try:
        s = meshd.connect(addr, timeout=5)
        with pytest.raises(Exception) as ei:  # noqa: B017
            with s:
                stop_meshd(proc, signal.SIGKILL)
                raise ValueError("the block's own")
        assert type(ei.value) is ValueError, repr(ei.value)
        assert s.closed
    finally:
        stop_meshd(proc)


# ------------------------------------------------------------ 6: fetch_shard(timeout) and the pool probe

def test_fetch_shard_timeout_bounds_the_auto_pool_probe(server, monkeypatch):
    """data_path="auto" probes every agent of the pool before the first transfer (and
    again every 30 s while one does not answer), synchronously in fetch_shard, each for
    CONNECT_TIMEOUT (1 s) whatever fetch_shard's timeout: fetch_shard(timeout=0.3)
    returned after 1 s (and ListAgents had the session's whole timeout). Here one
    agent's address is a listener that never speaks HTTP/2, as an agent not reachable
    from the client."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    target = f"127.0.0.1:{silent.getsockname()[1]}"
    try:
        with meshd.connect(server[0], data_path="auto", timeout=10) as s:
            with s.mesh(gpu=2).activate():
                x = meshd.tensor(np.arange(4, dtype=np.float32), progress=False)  # a Literal
                assert s._direct._pool_ok is None  # not probed yet
                real = s._unary

                def agents(method, request, reply_cls, *a, **kw):
                    reply = real(method, request, reply_cls, *a, **kw)
                    if method == "ListAgents":
                        reply.agents.add(rank=7, address=target, healthy=True)
                    return reply
                monkeypatch.setattr(s, "_unary", agents)
                t0 = time.monotonic()
                f = meshd.fetch_shard(x, gpu=1, timeout=0.3)
                took = time.monotonic() - t0
                monkeypatch.undo()
                with contextlib.suppress(meshd.MeshdError):
                    f.result(10)
                # unbounded, the probe alone waits CONNECT_TIMEOUT (1 s)
                assert took < 0.9, f"fetch_shard(timeout=0.3) took {took:.2f} s to return"
    finally:
        silent.close()


# ------------------------------------------------------------ 7: calls on a closed session

def test_transfers_on_a_closed_session_raise_meshd_errors(server):
    """A tensor that outlives its session: fetch_shard and an Upload-sized meshd.tensor
    raised grpc's bare ValueError('Cannot invoke RPC: Channel closed!'), synchronously
    (fetch_shard), where every command raises MeshdError NO_SESSION."""
    s = meshd.connect(server[0], data_path="auto")
    m = s.mesh(gpu=2)
    with m.activate():
        t = meshd.ones(2)
    s.close()
    with pytest.raises(meshd.MeshdError):
        meshd.fetch_shard(t, gpu=0).result(10)
    with m.activate():
        with pytest.raises(meshd.MeshdError) as ei:
            meshd.ones(2)
        assert ei.value.kind == "NO_SESSION", ei.value
        with pytest.raises(meshd.MeshdError):
            meshd.tensor(np.ones(MIB, np.float32), progress=False)


# ------------------------------------------------------------ 8: a proxied Upload and a full transfer table

def test_a_proxied_upload_waits_for_the_sessions_own_transfer_slot(one_slot):
    """errors.transfers_full: the session's own transfers end soon, so meshd.tensor
    and fetch_shard wait for a slot instead of failing. The proxied Upload did not: with
    the one slot held by a fetch of the same session (released 0.5 s later) meshd.tensor
    failed QUOTA at once, where the direct path's PlanTransfer waits."""
    import importlib
    _tensor = importlib.import_module("meshd.tensor")
    with meshd.connect(one_slot, data_path="proxy", timeout=10) as s:
        with s.mesh(gpu=2).activate():
            t = meshd.tensor(np.ones(4 * MIB, np.float32), progress=False)
            held, _ = _tensor._fetch_open(t, {"gpu": 0})  # a Fetch not read yet: the slot
            timer = threading.Timer(0.5, held.cancel)
            timer.start()
            try:
                a = np.arange(MIB, dtype=np.float32)
                x = meshd.tensor(a, progress=False)
            finally:
                timer.cancel()
                held.cancel()
            np.testing.assert_array_equal(meshd.fetch_shard(x, gpu=1).result(10), a)


# ------------------------------------------------------------ 9: Ctrl-C during the block's last flush

def test_ctrl_c_during_the_blocks_final_flush_keeps_its_commands_first(flow_server):
    """A block ends while the server is not reading (agent stopped); Ctrl-C while its
    exit waits for the answers. Pipeline.close() raised, so Session.pipeline() never set
    _drain: the queued commands still go out on the Submit stream, but the session's
    next unary command no longer waits for them: it claims a higher ref first, and the
    block's commands are then refused REF_REUSED (their tensors never exist)."""
    addr, pid = flow_server
    with meshd.connect(addr, timeout=4) as s:
        with s.mesh(gpu=2).activate():
            with _CtrlC(0.5) as ctrl_c:
                with _stopped(pid):
                    with pytest.raises(Interrupt):
                        with s.pipeline():
                            a = meshd.ones(2)
                            b = a + 1
                            s._pipe.flush(5)  # the flow window is full from here on
                            last = [meshd.ones(2) * i for i in range(1, 4)]  # queued
                            ctrl_c.start()  # fires in the block's final flush
                    waker = threading.Timer(1.0, os.kill, (pid, signal.SIGCONT))
                    waker.start()
                    z = meshd.ones(2) + 5
            np.testing.assert_array_equal(meshd.fetch_shard(b, gpu=0).result(10), [2.0, 2.0])
            np.testing.assert_array_equal(meshd.fetch_shard(last[-1], gpu=0).result(10),
                                          [3.0, 3.0])
            np.testing.assert_array_equal(meshd.fetch_shard(z, gpu=1).result(10), [6.0, 6.0])


# ------------------------------------------------------------ 10: grpc's words for a closed channel

def test_an_upload_whose_writes_start_after_close_is_cancelled(server, monkeypatch):
    """close() from another thread between an upload's plan and its Writes: the Write
    is refused by grpc with ValueError('Cannot invoke RPC: Channel closed!') (stream
    calls; unary ones say 'Cannot invoke RPC on closed channel!'), which
    direct._closed_channel does not recognise: the caller got that bare ValueError
    instead of MeshdError CANCELLED (the same for a Read)."""
    assert _direct._closed_channel(ValueError("Cannot invoke RPC: Channel closed!"))


def test_close_between_upload_plan_and_writes(server, monkeypatch):
    s = meshd.connect(server[0], data_path="direct", timeout=10)
    try:
        with s.mesh(gpu=2).activate():
            meshd.tensor(np.ones(MIB, np.float32), progress=False)  # the channels
            real = _direct.Direct._channels_for

            def closing(self, reply, what, deadline=None):
                chans = real(self, reply, what, deadline)
                self.session.close()  # another thread's close() lands here
                return chans
            monkeypatch.setattr(_direct.Direct, "_channels_for", closing)
            with pytest.raises(meshd.MeshdError) as ei:
                meshd.tensor(np.ones(MIB, np.float32), progress=False)
            assert ei.value.kind in ("CANCELLED", "NO_SESSION"), ei.value
    finally:
        s.close()


# ------------------------------------------------------------ review-117

def test_connect_interrupted_after_create_session_closes_the_session(server, monkeypatch):
    """A Ctrl-C (or an error) in connect() after CreateSession, here during the op
    catalogue's load: the session is closed at once, and the channel. It stayed alive
    (a row of ListSessions) until its lease ran out, the channel open."""
    from meshd import _catalogue, _conn
    channels = []
    real_open = _conn.open_channel

    def keep(*args, **kw):
        channels.append(real_open(*args, **kw))
        return channels[-1]

    def interrupted(_reply):
        raise Interrupt()
    monkeypatch.setattr(_conn, "open_channel", keep)
    monkeypatch.setattr(_catalogue, "load", interrupted)
    with pytest.raises(Interrupt):
        meshd.connect(server[0], client_name="review-117-interrupted")
    monkeypatch.undo()
    with meshd.connect(server[0]) as s:
        pb = s._pb
        rows = s._unary("ListSessions", pb.ListSessionsRequest(), pb.ListSessionsReply).sessions
        assert not [r for r in rows if r.client_name == "review-117-interrupted"], rows
    (ch,) = channels
    with pytest.raises(ValueError):  # grpc's refusal on a closed channel
        ch.unary_unary("/meshd.v1.TensorService/GetInfo")(b"", timeout=1)


@pytest.mark.parametrize("data_path", ["proxy", "direct"])
def test_ctrl_c_in_inspect_cancels_the_fetch_and_its_transfer_slot(one_slot, data_path):
    """Ctrl-C in meshd.inspect() stopped only the wait: the fetch thread read on to its
    deadline (30 s here), holding the session's one transfer slot, so the next fetch
    (3 s) failed. The fetch is cancelled now, its slot given back at once."""
    gate = threading.Event()
    with meshd.connect(one_slot, data_path=data_path, timeout=30) as s:
        with s.mesh(gpu=2).activate():
            big = meshd.tensor(np.ones(16 * MIB, np.float32), progress=False)  # 64 MiB
            small = meshd.tensor(np.arange(4, dtype=np.float32), progress=False)
            try:
                with _CtrlC(0.5) as c, pytest.raises(Interrupt):
                    c.start()
                    # a slow reader: 0.5 s a chunk
                    meshd.inspect(big, gpu=0, timeout=30, progress=lambda d, n: gate.wait(0.5))
                got = meshd.fetch_shard(small, gpu=1, timeout=3, progress=False).result(10)
            finally:
                gate.set()
            np.testing.assert_array_equal(got, np.arange(4, dtype=np.float32))


# ------------------------------------------------- a session dropped or closed meanwhile

def _io_threads():
    return [t for t in threading.enumerate() if t.name == "meshd-io" and t.is_alive()]


def test_a_session_dropped_without_close_ends_its_direct_io_loop(server):
    """Shards fetched together on the direct path run on the session's io loop, a
    thread of its own (meshd-io) with its grpc.aio channels. A session dropped without
    close() stopped its keepalive thread, but that loop ran on forever: every such
    session left a thread and its fds behind (5 sessions: 5 threads, 15 fds)."""
    import gc

    def one():
        s = meshd.connect(server[0], data_path="direct", timeout=20)
        with s.mesh(gpu=2).activate():
            t = meshd.tensor(np.ones(1 << 18, np.float32), progress=False)
            fs = [meshd.fetch_shard(t, gpu=g, progress=False) for g in (0, 1, 0, 1)]
            for f in fs:
                np.testing.assert_array_equal(f.result(20)[:2], [1.0, 1.0])
        assert s._direct._io._thread is not None  # the loop ran (the case under test)
        # s goes here, unclosed
    before = len(_io_threads())
    for _ in range(3):
        one()
    gc.collect()
    deadline = time.monotonic() + 10
    while len(_io_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
        gc.collect()
    assert len(_io_threads()) <= before, [t.name for t in _io_threads()]


@pytest.mark.parametrize("what", ["pipeline", "upload"])
def test_close_while_a_call_waits_for_the_session_lock(server, what):
    """close() from one thread while another thread's call waits for the session lock
    (held by a third thread's Sync or command, which close() then cancels): the waiting
    call passed the closed check before close(), then started its RPC on the closed
    channel: a pipeline block and a proxied Upload raised grpc's bare
    ValueError('Cannot invoke RPC: Channel closed!') instead of MeshdError NO_SESSION."""
    s = meshd.connect(server[0], data_path="proxy", timeout=10)
    got = []
    m = s.mesh(gpu=2)

    def call():
        try:
            with m.activate():
                if what == "pipeline":
                    with s.pipeline():
                        meshd.ones(2)
                else:
                    meshd.tensor(np.ones(MIB, np.float32), progress=False)
            got.append(None)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            got.append(e)
    th = threading.Thread(target=call)
    try:
        with s._lock:  # another thread's call in flight
            th.start()
            time.sleep(0.5)  # the call waits for the lock now
            s.close()
        th.join(20)
        assert not th.is_alive(), "the call hung"
    finally:
        s.close()
    (e,) = got
    assert isinstance(e, meshd.MeshdError), repr(e)
    assert e.kind == "NO_SESSION", e
