"""The direct data path (meshd/direct.py) when things go wrong: a session closed
while fetches read, an upload interrupted (Ctrl-C) or failing on one shard, a
fetch_shard timeout, Future.cancel(), and plans the client must not follow (a
TLS session's bytes to plaintext agents, an address that is not host:port).

Every wait is bounded; tensors are 16 MiB at most, slowed down where a test needs
a transfer still running (a progress callback that sleeps, CALLBACK_INTERVAL 0)."""

import asyncio
import importlib
import os
import signal
import threading
import time

import grpc
import numpy as np
import pytest
from conftest import start_meshd, stop_meshd

import meshd
from meshd import _progress
from meshd import direct as _direct

_tensor = importlib.import_module("meshd.tensor")  # (meshd.tensor is the function)

MIB = 1 << 20


@pytest.fixture(scope="module")
def one_slot():
    """The address of a meshd whose sessions may have one transfer in flight
    (--session-max-transfers 1): a transfer that keeps its slot shows at once."""
    addr, proc = start_meshd(2, name="meshd-direct-faults", flags=("--session-max-transfers", "1"))
    try:
        yield addr
    finally:
        stop_meshd(proc)


@pytest.fixture
def fast_callbacks(monkeypatch):
    monkeypatch.setattr(_progress, "CALLBACK_INTERVAL", 0.0)


def _allocated(s):
    return {a["rank"]: a["allocated_bytes"] for a in s.agents()}


def _wait_allocated_at_most(s, before, limit=5.0):
    """Waits (limit seconds at most) until no agent holds more than before."""
    deadline = time.monotonic() + limit
    while True:
        now = _allocated(s)
        if all(now[r] <= before[r] for r in before):
            return
        assert time.monotonic() < deadline, f"the agents still hold {now} (before: {before})"
        time.sleep(0.05)


def _slow(per_call):
    """A progress callback that sleeps per_call seconds each time: a transfer that lasts."""
    def cb(done, total):
        time.sleep(per_call)
    return cb


# ------------------------------------------------------------ bug 1: close() during fetches

def test_close_ends_direct_fetches_in_flight(server, fast_callbacks):
    """close() while four direct fetches read (the first on its own thread, the others on
    the session's io loop): every Future resolves at once with MeshdError (CANCELLED, as
    on the proxied path), no thread stays behind, and the io loop is not started again."""
    before = {t.ident for t in threading.enumerate()}
    s = meshd.connect(server[0], data_path="direct")
    try:
        with s.mesh(gpu=2).activate():
            t = meshd.tensor(np.ones(4 * MIB, np.float32), progress=False)  # 16 MiB
            futs = [meshd.fetch_shard(t, gpu=g % 2, progress=_slow(0.05)) for g in range(4)]
            time.sleep(0.1)
            assert s._direct._io._loop is not None, "no fetch was read on the io loop"
    finally:
        t0 = time.monotonic()
        s.close()
    errors = []
    for f in futs:
        with pytest.raises(meshd.MeshdError) as ei:
            f.result(timeout=max(0.1, t0 + 5 - time.monotonic()))
        errors.append(ei.value)
    assert time.monotonic() - t0 < 5
    assert all(e.kind in ("CANCELLED", "NO_SESSION") for e in errors), errors
    deadline = time.monotonic() + 5
    while True:
        left = [t.name for t in threading.enumerate() if t.ident not in before
                and (t.name == "meshd-io" or t.name.endswith("(run)"))]
        if not left:
            break
        assert time.monotonic() < deadline, f"threads left behind: {left}"
        time.sleep(0.05)
    with pytest.raises(meshd.MeshdError) as ei:  # a fetch planned before close() reaching it
        s._direct._io.run(asyncio.sleep, 0)
    assert ei.value.kind == "CANCELLED"
    assert s._direct._io._loop is None, "the io loop started again after close()"


# ------------------------------------------------------------ bug 2: interrupted uploads

class Interrupt(BaseException):
    """What the test's SIGINT handler raises (KeyboardInterrupt would end pytest if it
    escaped)."""


@pytest.mark.parametrize("data_path", ["direct", "proxy"])
def test_an_interrupted_upload_frees_its_slot_and_memory_at_once(one_slot, data_path,
                                                                 fast_callbacks):
    """SIGINT (Ctrl-C) while an upload streams: the exception comes at once, not after
    the whole upload, and the server is told: the session's one transfer slot is free
    for the next upload and the agents hold nothing of it (before: both until the
    grants expired, or the proxied Upload's deadline)."""
    fired, calls = [], []

    def cb(done, total):  # on gRPC's thread; slows the upload to 200 ms a chunk
        calls.append(done)
        if len(calls) == 2:  # (the caller waits by then)
            fired.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)

    def handler(signum, frame):
        raise Interrupt()
    with meshd.connect(one_slot, data_path=data_path, timeout=20) as s:
        with s.mesh(gpu=2).activate():
            before = _allocated(s)
            old = signal.signal(signal.SIGINT, handler)
            try:
                with pytest.raises(Interrupt):
                    meshd.tensor(np.ones(4 * MIB, np.float32), progress=cb)  # 16 MiB a rank
                took = time.monotonic() - fired[0]
            finally:
                signal.signal(signal.SIGINT, old)
            assert took < 0.8, f"the interrupt came {took:.2f} s after the signal"
            _wait_allocated_at_most(s, before)
            s.timeout = 3
            t0 = time.monotonic()
            while True:  # (the server ends a cancelled Upload soon, not at once)
                try:
                    x = meshd.tensor(np.arange(MIB, dtype=np.float32), progress=False)
                    break
                except meshd.MeshdError as e:
                    if e.kind != "QUOTA" or time.monotonic() - t0 > 2:
                        raise
                    time.sleep(0.05)
            assert time.monotonic() - t0 < 2, "the next upload waited for the transfer slot"
            np.testing.assert_array_equal(meshd.fetch_shard(x, gpu=1).result(10),
                                          np.arange(MIB, dtype=np.float32))


def test_a_shard_error_that_is_no_meshd_error_abandons_the_upload(one_slot, monkeypatch):
    """An unexpected exception on one shard (here: a Write's reply that cannot be read)
    is a MeshdError naming the rank, and the transfer is abandoned at once (its slot
    free, nothing kept on the agents); before, the bare exception left both held."""
    def garbled(raw):
        raise ValueError("garbled WriteReply")
    with meshd.connect(one_slot, data_path="direct", timeout=20) as s:
        with s.mesh(gpu=2).activate():
            before = _allocated(s)
            monkeypatch.setattr(_direct, "_fields", garbled)
            with pytest.raises(meshd.MeshdError) as ei:
                meshd.tensor(np.ones(MIB, np.float32), progress=False)
            monkeypatch.undo()
            assert ei.value.kind == "INTERNAL" and "rank" in str(ei.value), ei.value
            _wait_allocated_at_most(s, before)
            s.timeout = 3
            x = meshd.tensor(np.ones(MIB, np.float32), progress=False)
            assert meshd.fetch_shard(x, gpu=0).result(10)[0] == 1.0
            assert s._direct.counts["upload"] == 1


# ------------------------------------------------------------ bug 5: one shard fails

def test_a_failing_shard_stops_the_others_at_once(server, monkeypatch):
    """Rank 1's Write is refused at once (its grant altered): rank 0's stops too instead
    of streaming the whole tensor first. Chunks are made 20 ms apart; 16 MiB is 8 of
    them per rank."""
    made = []
    real_data_field = _tensor._data_field

    def slow_data_field(chunk):
        made.append(1)
        time.sleep(0.02)
        return real_data_field(chunk)
    real_plan = _direct.Direct.plan

    def bad_grant(self, request, *a):
        reply = real_plan(self, request, *a)
        if request.HasField("upload") and len(reply.shards) == 2:
            reply.shards[1].grant = bytes(len(reply.shards[1].grant))
        return reply
    with meshd.connect(server[0], data_path="direct", timeout=20) as s:
        with s.mesh(gpu=2).activate():
            monkeypatch.setattr(_tensor, "_data_field", slow_data_field)
            monkeypatch.setattr(_direct.Direct, "plan", bad_grant)
            with pytest.raises(meshd.MeshdError) as ei:
                meshd.tensor(np.ones(4 * MIB, np.float32), progress=False)
            monkeypatch.undo()
            assert ei.value.kind == "PERMISSION_DENIED" and "rank 1" in str(ei.value), ei.value
            assert len(made) <= 5, f"{len(made)} chunks made after rank 1 failed"
            x = meshd.tensor(np.ones(MIB, np.float32), progress=False)
            assert meshd.fetch_shard(x, gpu=1).result(10)[0] == 1.0


# ------------------------------------------------------------ bug 3: one deadline

def test_fetch_shard_timeout_bounds_the_wait_for_a_transfer_slot(one_slot):
    """fetch_shard(timeout=0.5) while the session's one transfer slot is taken fails
    after about 0.5 s (before: the session's timeout): DEADLINE_EXCEEDED naming the
    slots, its grant request held by the server until then (a server that refuses it
    at once, as before, leaves QUOTA, the last refusal)."""
    with meshd.connect(one_slot, data_path="direct", timeout=4) as s:
        with s.mesh(gpu=2).activate():
            t = meshd.tensor(np.ones(4 * MIB, np.float32), progress=False)
            # a proxied Fetch not read: the slot (16 MiB: more than flow control lets by)
            held, _ = _tensor._fetch_open(t, {"gpu": 0})
            try:
                t0 = time.monotonic()
                with pytest.raises(meshd.MeshdError) as ei:
                    meshd.fetch_shard(t, gpu=1, timeout=0.5).result(10)
                took = time.monotonic() - t0
            finally:
                held.cancel()
            assert ei.value.kind == "DEADLINE_EXCEEDED", ei.value
            assert "--session-max-transfers" in ei.value.message, ei.value
            assert took < 1.5, f"fetch_shard(timeout=0.5) failed after {took:.2f} s"


def _record_deadlines(s, monkeypatch):
    """[(method, absolute deadline)] of every call the session's direct transfers make
    from now on (PlanTransfer, FinishUpload, FinishFetch, Agent/Write, Agent/Read)."""
    seen = []

    class Recorded:
        def __init__(self, method, fn):
            self.method, self.fn = method, fn

        def _note(self, kw):
            if kw.get("timeout") is not None:
                seen.append((self.method.rsplit("/", 1)[-1], time.monotonic() + kw["timeout"]))

        def __call__(self, *a, **kw):
            self._note(kw)
            return self.fn(*a, **kw)

        def future(self, *a, **kw):
            self._note(kw)
            return self.fn.future(*a, **kw)

    def spy(ch, kind):
        real = getattr(ch, kind)

        def make(method, *a, **kw):
            fn = real(method, *a, **kw)
            if any(w in method for w in ("PlanTransfer", "Finish", "Agent/")):
                return Recorded(method, fn)
            return fn
        monkeypatch.setattr(ch, kind, make)
    spy(s._ch, "unary_unary")
    for ch in s._direct._channels.values():
        spy(ch, "stream_unary")
        spy(ch, "unary_stream")
    return seen


class _LostAnswer(grpc.RpcError):
    """What a FinishUpload whose answer never came raises: the server did finish it."""

    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self):
        return "Deadline Exceeded (the test dropped the answer)"

    def trailing_metadata(self):
        return ()


def _lose_finish_answers(s, monkeypatch, n):
    """From now on the session's FinishUpload calls reach the server, but the first n
    answers are lost on their way back (_LostAnswer). Returns the list of calls made."""
    real = s._ch.unary_unary
    calls = []

    def make(method, *a, **kw):
        fn = real(method, *a, **kw)
        if not method.endswith("/FinishUpload"):
            return fn

        def finish(*ca, **ckw):
            calls.append(method)
            reply = fn(*ca, **ckw)  # the server answers ...
            if len(calls) <= n:
                raise _LostAnswer()  # ... and the answer is lost
            return reply
        return finish
    monkeypatch.setattr(s._ch, "unary_unary", make)
    return calls


def test_an_upload_whose_finish_answer_is_lost_asks_again(one_slot, monkeypatch):
    """The first FinishUpload reaches the server, which defines the tensor, but its answer
    is lost (DEADLINE_EXCEEDED here). The client asks again and gets the same answer:
    meshd.tensor returns the tensor, exact. It raised before, leaving the tensor defined
    behind the caller's back (holding the agents' memory) until the session ended."""
    with meshd.connect(one_slot, data_path="direct", timeout=30) as s:
        with s.mesh(gpu=2).activate():
            meshd.tensor(np.ones(2 * MIB, np.float32), progress=False)  # the channels
            calls = _lose_finish_answers(s, monkeypatch, 1)
            arr = np.arange(2 * MIB, dtype=np.float32)
            t = meshd.tensor(arr, progress=False)
            monkeypatch.undo()
            assert len(calls) == 2, calls
            for g in (0, 1):
                assert np.array_equal(meshd.fetch_shard(t, gpu=g).result(30), arr), g


def test_an_upload_whose_finish_answers_are_all_lost_leaves_nothing_behind(one_slot,
                                                                             monkeypatch):
    """Both FinishUpload answers are lost (the server finished the upload on the first), so
    the client abandons the transfer; the server answers that FinishUpload too with the
    tensor, which nobody holds: the client releases it, and meshd.tensor raises with the
    agents' memory back where it was (it stayed taken until the session ended)."""
    with meshd.connect(one_slot, data_path="direct", timeout=30) as s:
        with s.mesh(gpu=2).activate():
            kept = meshd.tensor(np.ones(2 * MIB, np.float32), progress=False)  # the channels
            s.sync()
            before = _allocated(s)
            calls = _lose_finish_answers(s, monkeypatch, 2)
            with pytest.raises(meshd.MeshdError) as ei:
                meshd.tensor(np.arange(2 * MIB, dtype=np.float32), progress=False)
            monkeypatch.undo()
            assert ei.value.kind == "DEADLINE_EXCEEDED", ei.value
            assert len(calls) == 3, calls
            s.sync()
            _wait_allocated_at_most(s, before)
            assert kept.shape == (2 * MIB,)


def test_a_direct_transfer_has_one_deadline(one_slot, monkeypatch, fast_callbacks):
    """Every call of a direct fetch (PlanTransfer, Read, FinishFetch) runs under the one
    deadline of fetch_shard's timeout, and every call of a direct upload (PlanTransfer,
    the Writes, FinishUpload) under the session's timeout counted from the upload's
    start, as the proxy's one call (before: each call got the whole timeout again)."""
    with meshd.connect(one_slot, data_path="direct", timeout=30) as s:
        with s.mesh(gpu=2).activate():
            t = meshd.tensor(np.ones(2 * MIB, np.float32), progress=False)  # the channels
            seen = _record_deadlines(s, monkeypatch)
            t0 = time.monotonic()
            meshd.fetch_shard(t, gpu=1, timeout=10, progress=_slow(0.05)).result(20)
            meshd.tensor(np.ones(2 * MIB, np.float32), progress=_slow(0.05))
            took = time.monotonic() - t0
            monkeypatch.undo()
    fetch, upload = seen[:3], seen[3:]
    assert [m for m, _ in fetch] == ["PlanTransfer", "Read", "FinishFetch"], seen
    assert [m for m, _ in upload] == ["PlanTransfer", "Write", "Write", "FinishUpload"], seen
    assert took > 0.2, "the transfers were too quick to tell"
    for calls, limit in ((fetch, 10), (upload, 30)):
        ends = [d for _, d in calls]
        assert max(ends) - min(ends) < 0.05, f"more than one deadline: {calls}"
        assert max(ends) <= t0 + limit + took + 0.05, calls


def test_a_proxied_upload_after_a_direct_attempt_keeps_the_one_deadline(server, monkeypatch):
    """An upload whose direct attempt took a while and fell back to the proxy (an agent
    that did not answer in time) sends its Upload under what is left of the session's
    timeout, and the attempt itself ran under that deadline (each had a whole timeout)."""
    with meshd.connect(server[0], data_path="auto", timeout=5) as s:
        with s.mesh(gpu=2).activate():
            got = {}

            def slow_attempt(hdr, pieces, progress=None, timeout=None):
                got["direct"] = timeout
                time.sleep(1.0)
                return None  # the proxy instead

            monkeypatch.setattr(s._direct, "wanted", lambda: True)
            monkeypatch.setattr(s._direct, "upload", slow_attempt)
            real = s._ch.stream_unary

            class Spy:
                def __init__(self, fn):
                    self.fn = fn

                def future(self, *a, **kw):
                    got.setdefault("upload", kw.get("timeout"))
                    return self.fn.future(*a, **kw)

            monkeypatch.setattr(s._ch, "stream_unary", lambda *a, **kw: Spy(real(*a, **kw)))
            t = meshd.tensor(np.ones(MIB, np.float32), progress=False)  # 4 MiB: no Literal
            monkeypatch.undo()
            assert meshd.inspect(t, gpu=1)[0] == 1.0
    assert got["direct"] is not None and got["direct"] <= 5.0, got
    assert got["upload"] is not None and got["upload"] < 4.2, got


# ------------------------------------------------------------ bug 4: Future.cancel()

@pytest.mark.parametrize("data_path", ["direct", "proxy"])
def test_a_fetch_future_cannot_be_cancelled_and_its_thread_raises_nothing(server, data_path,
                                                                          monkeypatch):
    """A fetch_shard Future is running from the start: cancel() says False and the value
    still comes (before: True, then InvalidStateError in the fetch's thread)."""
    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    with meshd.connect(server[0], data_path=data_path) as s:
        with s.mesh(gpu=2).activate():
            a = np.arange(MIB, dtype=np.float32)
            t = meshd.tensor(a, progress=False)
            f = meshd.fetch_shard(t, gpu=1)
            assert f.cancel() is False
            np.testing.assert_array_equal(f.result(10), a)
            assert not f.cancelled()
    time.sleep(0.1)
    assert not raised, [r.exc_value for r in raised]


# ------------------------------------------------------------ an agent's grant table full

def _refused_full(e):
    """An agent's full grant table said as direct.py says it: its rank, its agent,
    what is full and what to do."""
    msg = e.message
    assert ("rank 0 (agent 127.0.0.1:" in msg and "too many transfers in flight" in msg
            and "--max-transfer-nonces" in msg and 'data_path="proxy"' in msg), msg


@pytest.mark.parametrize("data_path", ["auto", "direct"])
def test_a_full_agent_grant_table_takes_the_proxy_or_says_so(data_path, monkeypatch):
    """An agent keeps each direct grant it took until the grant's start-by time (a
    minute here) in a table of --max-transfer-nonces (2 here); full, it refuses the
    next Read or Write RESOURCE_EXHAUSTED before any byte moves. auto: that upload and
    that fetch go through the server instead (right values), unless a command was
    sent since the fetch's plan (a Fetch now could read a later value); direct: the
    error names the rank and its agent, says the table is full and what to do. Both
    failed before with the agent's bare refusal ("2 grants are in use ...")."""
    addr, proc = start_meshd(1, name=f"meshd-nonces-{data_path}",
                             env={"MESHD_MAX_TRANSFER_NONCES": "2",  # all of it one session's
                                  "MESHD_MAX_TRANSFER_NONCES_PER_SESSION": "2"})
    try:
        with meshd.connect(addr, data_path=data_path, timeout=20) as s:
            with s.mesh(gpu=1).activate():
                a = np.arange(1 << 17, dtype=np.float32)  # 512 KiB: an upload, no Literal
                t = meshd.tensor(a, progress=False)  # the table: a Write's grant ...
                np.testing.assert_array_equal(meshd.fetch_shard(t, gpu=0).result(20), a)  # a Read's
                assert s._direct.counts == {"upload": 1, "fetch": 1}, s._direct.counts
                if data_path == "direct":
                    for move in (lambda: meshd.tensor(a + 1, progress=False),
                                 lambda: meshd.fetch_shard(t, gpu=0).result(20)):
                        with pytest.raises(meshd.MeshdError) as e:
                            move()
                        _refused_full(e.value)
                    assert (t * 2).shape == a.shape  # the session goes on
                    s.sync()
                    return
                b = meshd.tensor(a + 1, progress=False)
                np.testing.assert_array_equal(meshd.fetch_shard(b, gpu=0).result(20), a + 1)
                np.testing.assert_array_equal(meshd.inspect(t, gpu=0), a)
                assert s._direct.counts == {"upload": 1, "fetch": 1}, s._direct.counts
                # The Read held until a command went after the plan: refused, said so.
                gate = threading.Event()
                real = _direct.Direct._read

                def held(self, *args, **kw):
                    assert gate.wait(20)
                    return real(self, *args, **kw)
                monkeypatch.setattr(_direct.Direct, "_read", held)
                f = meshd.fetch_shard(t, gpu=0)
                t2 = t * 2
                gate.set()
                with pytest.raises(meshd.MeshdError) as e:
                    f.result(20)
                _refused_full(e.value)
                monkeypatch.undo()
                np.testing.assert_array_equal(meshd.inspect(t2, gpu=0), a * 2)
    finally:
        stop_meshd(proc)


# ------------------------------------------------------------ plans not to follow

def test_a_tls_session_never_sends_to_plaintext_agents(server):
    """A session over TLS keeps its bytes encrypted, checked on every plan: with agents in
    plaintext data_path="direct" refuses the transfer (MeshdError UNAVAILABLE, nothing
    sent, the plan abandoned) and "auto" takes the proxy even after a direct transfer.
    (The local server speaks plaintext: the session says TLS as one over TLS would.)"""
    a = np.arange(MIB, dtype=np.float32)
    with meshd.connect(server[0], data_path="direct") as s:
        with s.mesh(gpu=2).activate():
            t = meshd.tensor(a, progress=False)
            s.tls = True
            with pytest.raises(meshd.MeshdError) as ei:
                meshd.tensor(a, progress=False)
            assert ei.value.kind == "UNAVAILABLE" and "plaintext" in str(ei.value), ei.value
            with pytest.raises(meshd.MeshdError) as ei:
                meshd.fetch_shard(t, gpu=1).result(10)
            assert ei.value.kind == "UNAVAILABLE" and "plaintext" in str(ei.value), ei.value
            assert s._direct.counts == {"upload": 1, "fetch": 0}
            s.tls = False
            np.testing.assert_array_equal(meshd.fetch_shard(t, gpu=1).result(10), a)
    with meshd.connect(server[0], data_path="auto") as s:
        with s.mesh(gpu=2).activate():
            t = meshd.tensor(a, progress=False)
            assert s._direct.counts == {"upload": 1, "fetch": 0}
            s.tls = True
            np.testing.assert_array_equal(meshd.fetch_shard(t, gpu=1).result(10), a)
            u = meshd.tensor(a + 1, progress=False)
            np.testing.assert_array_equal(meshd.fetch_shard(u, gpu=0).result(10), a + 1)
            assert s._direct.counts == {"upload": 1, "fetch": 0}, "plaintext under TLS"


def test_plan_addresses_must_be_host_port(one_slot, monkeypatch):
    """An agent address that is a gRPC target of another kind (unix:, dns:///...) is not
    dialled: data_path="direct" fails clearly (and frees the slot), "auto" uses the
    proxy."""
    for good in ("127.0.0.1:5000", "[::1]:50051", "agent-3.cluster.local:9000"):
        assert _direct._host_port(good), good
    for bad in ("unix:/tmp/x.sock", "unix-abstract:x", "dns:///a:1", "ipv4:1.2.3.4:5",
                "a:b", "host", "127.0.0.1:5000/x", "unix:123", "DNS:53"):
        assert not _direct._host_port(bad), bad
    real_plan = _direct.Direct.plan
    target = "unix:/tmp/meshd-direct-faults-nowhere.sock"

    def elsewhere(self, request, *a):
        reply = real_plan(self, request, *a)
        reply.shards[0].address = target
        return reply
    a = np.arange(MIB, dtype=np.float32)
    for data_path in ("direct", "auto"):
        with meshd.connect(one_slot, data_path=data_path, timeout=3) as s:
            with s.mesh(gpu=2).activate():
                s._direct.wanted()  # auto: the pool probed (with its real addresses)
                monkeypatch.setattr(_direct.Direct, "plan", elsewhere)
                if data_path == "direct":
                    with pytest.raises(meshd.MeshdError) as ei:
                        meshd.tensor(a, progress=False)
                    assert ei.value.kind == "UNAVAILABLE" and "host:port" in str(ei.value), ei.value
                    monkeypatch.undo()
                    x = meshd.tensor(a, progress=False)  # the slot is free
                else:
                    x = meshd.tensor(a, progress=False)
                    monkeypatch.undo()
                    assert s._direct.counts["upload"] == 0
                np.testing.assert_array_equal(meshd.fetch_shard(x, gpu=1).result(10), a)
                assert not any(addr == target for addr, _ in
                               list(s._direct._channels) + list(s._direct._unreachable))


def test_the_wait_for_an_agents_connection_ends_at_the_transfers_deadline(one_slot, monkeypatch):
    """The first connection to an agent may take CONNECT_TIMEOUT (1 s); a fetch_shard
    with a shorter timeout ends at its own deadline, DEADLINE_EXCEEDED, not a second
    later, and the agent is not remembered as unreachable for it. (A listener that
    accepts and never speaks HTTP/2 stands in for an agent that does not answer.)"""
    import socket
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    target = f"127.0.0.1:{silent.getsockname()[1]}"
    real_plan = _direct.Direct.plan

    def silent_agent(self, request, *a):
        reply = real_plan(self, request, *a)
        reply.shards[0].address = target
        return reply
    try:
        with meshd.connect(one_slot, data_path="direct", timeout=10) as s:
            with s.mesh(gpu=2).activate():
                x = meshd.tensor(np.arange(4, dtype=np.float32), progress=False)
                monkeypatch.setattr(_direct.Direct, "plan", silent_agent)
                t0 = time.monotonic()
                with pytest.raises(meshd.MeshdError) as ei:
                    meshd.fetch_shard(x, gpu=1, timeout=0.3).result(10)
                took = time.monotonic() - t0
                monkeypatch.undo()
                assert ei.value.kind == "DEADLINE_EXCEEDED", ei.value
                assert "before the deadline" in str(ei.value), ei.value
                assert took < 0.8, f"{took:.2f} s for a 0.3 s fetch"
                assert not any(addr == target for addr, _ in s._direct._unreachable)
                # the slot came back: the next fetch goes through
                np.testing.assert_array_equal(meshd.fetch_shard(x, gpu=1).result(10),
                                              np.arange(4, dtype=np.float32))
    finally:
        silent.close()


def _read_shard(s, plan, ref):
    """One Agent/Read of plan's first shard under its grant: the bytes read."""
    sh = plan.shards[0]
    with grpc.insecure_channel(sh.address) as ch:
        return sum(len(p) for p in s._direct._read_call(ch, sh, ref, time.monotonic() + 10)
                   if not isinstance(p, _direct._ReadSpec))


@pytest.mark.parametrize("read", [True, False])
def test_a_fetch_finished_without_its_read_lets_the_snapshot_go(server, read):
    """PlanTransfer(fetch) has the agent take a Snapshot, which pins the tensor's memory
    until a Read takes it. A client that abandons the plan before reading (fetch_plan: no
    channel to the agent, the proxy instead) ends it with FinishFetch: the Snapshot goes
    too, and dropping the tensor frees its memory. (It stayed pinned until 64 later
    snapshots pushed it out or the session ended.) read=True: the plan read, then
    finished."""
    with meshd.connect(server[0], data_path="direct", timeout=20) as s:
        with s.mesh(gpu=2).activate():
            warm = meshd.tensor(np.ones(MIB, np.float32), progress=False)
            s.sync()
            before = _allocated(s)
            x = meshd.tensor(np.arange(4 * MIB, dtype=np.float32), progress=False)  # 16 MiB
            pb = s._pb
            plan = s._ch.unary_unary("/meshd.v1.TensorService/PlanTransfer",
                                     request_serializer=lambda m: m.SerializeToString(),
                                     response_deserializer=pb.PlanTransferReply.FromString)
            p = plan(pb.PlanTransferRequest(fetch=pb.FetchRequest(
                ref=x.ref, coords=[pb.Coordinate(dim="gpu", index=0)])), metadata=s._md,
                timeout=10)
            if read:
                assert _read_shard(s, p, x.ref) == 16 * MIB
            s._direct._finish_fetch(p.transfer_id, quiet=True)  # what fetch_plan does
            x.drop()
            s.sync()
            _wait_allocated_at_most(s, before)
            assert warm.shape == (MIB,)
