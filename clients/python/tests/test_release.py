"""Tensor lifetime: a garbage-collected handle's ref is released (the Release
command), in batches, never one call per handle; views and borrows keep what they
need. The 100k-temporaries run is client.python_slow's (MESHD_SLOW_TESTS=1)."""

import gc
import os
import time
import warnings

import numpy as np
import pytest

import meshd
from meshd import session as _session


def _info(s):
    pb = s._pb
    reply = s._unary("ListSessions", pb.ListSessionsRequest(), pb.ListSessionsReply)
    (row,) = [r for r in reply.sessions if r.session_id == s.id]
    return row


class _Calls:
    """Counts the session's Execute calls and the Release commands among them."""

    def __init__(self, s, monkeypatch):
        self.execute = self.release = 0
        unary = s._unary

        def counting(method, request, *a, **kw):
            if method == "Execute":
                self.execute += 1
                self.release += request.WhichOneof("kind") == "release"
            return unary(method, request, *a, **kw)
        monkeypatch.setattr(s, "_unary", counting)


def test_collected_handles_are_released_in_batches(session, mesh, monkeypatch):
    x = meshd.ones((4,))
    session.sync()
    base = _info(session).live_tensors
    calls = _Calls(session, monkeypatch)
    n = 1000
    for _ in range(n):
        y = x + 1  # the previous y is collected here
    session.sync()
    # Every collected handle was released: only x and the last y are left.
    assert _info(session).live_tensors == base + 1
    # In batches: at most one Release per _RELEASE_BATCH handles, plus the Sync's.
    assert 1 <= calls.release <= n // _session._RELEASE_BATCH + 1, calls.release
    assert calls.execute == n + 1 + calls.release
    np.testing.assert_array_equal(meshd.fetch_shard(y, gpu=1).result(), np.full(4, 2, np.float32))


def test_a_view_keeps_its_storage_after_its_base_is_released(session, mesh):
    session.sync()
    base = _info(session)
    x = meshd.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    v = x.T
    del x
    gc.collect()
    session.sync()  # sends the Release of x
    mid = _info(session)
    assert mid.live_tensors == base.live_tensors + 1
    assert mid.bytes_held == base.bytes_held + 2 * 6 * 4  # 2 ranks: v still holds them
    np.testing.assert_array_equal(meshd.fetch_shard(v, gpu=0).result(),
                                  np.arange(6, dtype=np.float32).reshape(2, 3).T)
    del v
    session.sync()
    after = _info(session)
    assert (after.live_tensors, after.bytes_held) == (base.live_tensors, base.bytes_held)


def test_a_borrow_keeps_its_origin_until_dropped(session, mesh):
    side = session.stream("side")
    t = meshd.ones((4,))
    session.sync()
    base = _info(session).live_tensors
    h, b = side.borrow(t)
    del t
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a refused Release would warn
        session.sync()
    assert _info(session).live_tensors == base + 1  # origin and handle
    b.drop()
    del b, h
    gc.collect()
    session.sync()
    assert _info(session).live_tensors == base - 1


def test_pipelined_temporaries_are_released(session, mesh):
    x = meshd.ones((4,))
    session.sync()
    base = _info(session).live_tensors
    with session.pipeline():
        for _ in range(600):
            y = x * 2
    session.sync()
    assert _info(session).live_tensors == base + 1
    np.testing.assert_array_equal(meshd.fetch_shard(y, gpu=0).result(), np.full(4, 2, np.float32))


def test_failures_of_collected_results_are_told_once_each(session, mesh):
    """Each failing op's result is collected at once: its ranks' failure reports
    arrive before or after its Release, and Sync tells each root failure once."""
    x = meshd.tensor(np.arange(3, dtype=np.float32))
    idx = meshd.tensor(np.array([5]))
    for _ in range(50):
        meshd.ops.index_select(x, 0, idx)
    with pytest.raises(meshd.MeshdError) as e:
        session.sync()
    assert len(e.value.errors) == 50, e.value.errors
    assert all(err.kind == "REMOTE_FAILURE" for err in e.value.errors)
    session.sync()


def test_more_collected_handles_than_a_command_takes_are_all_released(session, mesh,
                                                                       monkeypatch):
    """5,000 handles collected between two commands: more refs than one command may
    name (--max-command-refs, 4,096 by default). They go in Releases of 256 refs each,
    every one is released, and no warning is given."""
    base = _info(session).live_tensors
    ts = [meshd.zeros((4,)) for _ in range(5000)]
    assert _info(session).live_tensors == base + 5000
    calls = _Calls(session, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del ts
        gc.collect()
        session.sync()
    assert calls.release == 5000 // _session._RELEASE_BATCH + 1, calls.release
    assert _info(session).live_tensors == base


def test_a_borrow_collected_with_its_handle_is_dropped_before_its_origin_goes(session, mesh):
    """The borrowed handle keeps its Borrow, the Borrow its origin: with the Borrow
    object gone, the origin is not released while the handle is used; with the handle
    gone too, the borrow is dropped before the origin's Release (which the server
    would refuse, BORROWED, with every other ref in it)."""
    side = session.stream("side")
    base = _info(session).live_tensors
    x = meshd.tensor(np.arange(4, dtype=np.float32))
    others = [meshd.zeros((4,)) for _ in range(10)]
    h, b = side.borrow(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del x, b, others
        gc.collect()
        session.sync()
        with side.activate():
            np.testing.assert_array_equal(meshd.inspect(h + 1, gpu=1), np.arange(4) + 1)
        gc.collect()
        session.sync()  # the temporary h + 1 is released
        assert _info(session).live_tensors == base + 2  # the origin and its borrowed handle
        del h
        gc.collect()
        session.sync()
    assert _info(session).live_tensors == base


def test_a_pipelined_drop_that_is_refused_leaves_the_handle_live(session, mesh):
    """A pipelined Drop is answered later: refused (the tensor is borrowed), the handle
    is not dropped after all, and it releases its tensor when collected."""
    side = session.stream("side")
    base = _info(session).live_tensors
    x = meshd.tensor(np.arange(4, dtype=np.float32))
    h, b = side.borrow(x)
    with pytest.raises(meshd.MeshdError, match="BORROWED|borrowed"):
        with session.pipeline():
            x.drop()
    assert not x.dropped
    b.drop()
    del x, h, b
    gc.collect()
    session.sync()
    assert _info(session).live_tensors == base


def test_dropped_handles_are_not_released_again(session, mesh, monkeypatch):
    calls = _Calls(session, monkeypatch)
    x = meshd.ones((4,))
    x.drop()
    del x
    gc.collect()
    session.sync()
    assert calls.release == 0


def _agent_pids(server_proc):
    out = []
    for tid in os.listdir(f"/proc/{server_proc.pid}/task"):
        try:
            with open(f"/proc/{server_proc.pid}/task/{tid}/children") as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return out


def _rss(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.skipif(os.environ.get("MESHD_SLOW_TESTS") != "1",
                    reason="client.python_slow's (MESHD_SLOW_TESTS=1)")
def test_100k_temporaries_keep_agent_memory_flat(server):
    """100k temporaries of 4 KiB in a loop (pipelined): the agents' tensor bytes stay
    at a few batches' worth, and their RSS does not grow with the count."""
    pids = _agent_pids(server[1])
    assert len(pids) == 2, pids
    with meshd.connect(server[0]) as s, s.mesh(gpu=2).activate():
        x = meshd.ones((1024,))
        s.sync()
        n, marks = 100_000, {}
        t0 = time.monotonic()
        with s.pipeline():
            for i in range(1, n + 1):
                y = x + 1
                if i in (n // 10, n):
                    s.sync()
                    marks[i] = (sum(a["allocated_bytes"] for a in s.agents()),
                                sum(_rss(p) for p in pids), _info(s).live_tensors)
        rate = n / (time.monotonic() - t0)
        (a10, r10, l10), (a100, r100, l100) = marks[n // 10], marks[n]
        print(f"100k temporaries: {rate:.0f}/s; agents' tensor bytes {a10} -> {a100}, "
              f"RSS {r10} -> {r100}, live tensors {l10} -> {l100}")
        assert l10 == l100 == 2, (l10, l100)       # x and the last y
        assert a100 <= a10 and a100 <= 2 * 2 * 4096, (a10, a100)
        assert r100 - r10 < 8 << 20, (r10, r100)     # 90k more temporaries: no growth
        np.testing.assert_array_equal(meshd.fetch_shard(y, gpu=0).result(),
                                      np.full(1024, 2, np.float32))
