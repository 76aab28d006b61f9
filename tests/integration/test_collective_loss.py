"""Collectives on the cpu data plane when a member dies mid-call: a to_mesh
broadcast down a chain and a reduce onto a sub-mesh whose target rank is the one lost,
each while another session runs its own collectives on the same agents. Every member of
the failed call fails promptly with AGENT_LOST naming the lost rank, the bystander is
untouched, and the pool computes the right values (against numpy) once the rank is
replaced. Every wait is bounded."""

import os
import signal
import time

import numpy as np
import pytest

import meshd_testlib as lib
from meshd_testlib import Session, reduce, sync
from test_compute import FetchError, _agents, data_plane, fetch, upload
from test_faults import _fault, _replaced, _sync_in_thread


def _kill_rank(srv, rank):
    victim = next(p for p in lib.agent_children(srv.pid) if lib.child_rank(p) == rank)
    t = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    return t


def _bystander(b, n):
    """Session b's reduce over ranks 0..n-1: right values, no error."""
    mb = b.mesh(gpu=n).ref
    X = np.arange(n * 8, dtype=np.float32).reshape(n, 8)
    xb = upload(b, mb, X, per_rank=True)
    r = b.run(reduce(b.new_ref(), xb, dims=["gpu"], reduction="sum")).tensors[0].ref
    for g in range(n):
        np.testing.assert_array_equal(fetch(b, r, gpu=g), X.sum(0), err_msg=f"bystander gpu {g}")
    assert list(b.run(sync(), timeout=10).errors) == []


def _lost_promptly(pending, t_kill, rank):
    pending["thread"].join(timeout=10)
    assert "t" in pending, "the Sync was still blocked 10 s after the agent died"
    if "result" in pending:  # answered, reporting the loss among its errors
        errs = [e for e in pending["result"].errors if "AGENT_LOST" in str(e)]
        assert errs, f"the Sync reported no loss of rank {rank}: {pending}"
        e = lib.CommandError.__new__(lib.CommandError)
        e.kind, e.message = "AGENT_LOST", errs[0].message
    else:
        e = pending["error"]
    assert e.kind == "AGENT_LOST" and f"rank {rank}" in e.message, e
    took = pending["t"] - t_kill
    assert took < 2.0, f"AGENT_LOST took {took:.2f} s"


@pytest.mark.parametrize("size", [8, 3 << 20])  # frames, and (same host) a memfd
def test_a_broadcast_whose_last_destination_dies_fails_every_member_at_once(meshd_server,
                                                                             size):
    # Rank 1 (the chain's first hop) hangs before joining; ranks 0, 2, 3 wait in the
    # data plane; rank 3 (the end of the chain) is killed.
    srv = lib.wait_ready(meshd_server(4, env=_fault("send:hang,rank=1,count=1")), 4)
    with Session(srv.port, "victim") as a, Session(srv.port, "bystander") as b:
        if not data_plane(a):
            pytest.skip("the agents report no data plane")
        m = a.mesh(gpu=4).ref
        src = a.slice(m, gpu=0).ref
        X = np.random.default_rng(1).standard_normal(size).astype(np.float32)
        x = upload(a, src, X, chunk=1 << 20)
        a.run(lib.to_mesh(a.new_ref(), x, m))  # overlapping: rank 0 is source and destination
        pending = _sync_in_thread(a, timeout=20)
        time.sleep(0.5)
        assert "t" not in pending, f"the Sync returned before the loss: {pending}"
        old_id = _agents(a)[3].agent_id
        t_kill = _kill_rank(srv, 3)
        _lost_promptly(pending, t_kill, 3)
        _bystander(b, 3)
        t_reg = _replaced(a, 3, old_id)
        with Session(srv.port, "after") as c:
            mc = c.mesh(gpu=4).ref
            xc = upload(c, c.slice(mc, gpu=2).ref, X, chunk=1 << 20)
            y = c.run(lib.to_mesh(c.new_ref(), xc, mc)).tensors[0].ref
            for g in range(4):
                np.testing.assert_array_equal(fetch(c, y, gpu=g), X, err_msg=f"gpu {g}")
            assert list(c.run(sync(), timeout=10).errors) == []
        assert time.monotonic() - t_reg < 10


@pytest.mark.parametrize("reduction", ["sum", "stack"])
def test_a_reduce_onto_a_sub_mesh_whose_target_dies_fails_at_once(meshd_server, reduction):
    # Rank 0 hangs before joining; ranks 1 and 2 wait; rank 2, the target, is killed.
    srv = lib.wait_ready(meshd_server(3, env=_fault("reduce:hang,rank=0,count=1")), 3)
    with Session(srv.port, "victim") as a, Session(srv.port, "bystander") as b:
        if not data_plane(a):
            pytest.skip("the agents report no data plane")
        m = a.mesh(gpu=3).ref
        target = a.slice(m, gpu=2).ref
        X = np.arange(3 * 8, dtype=np.float32).reshape(3, 8)
        x = upload(a, m, X, per_rank=True)
        r = a.run(reduce(a.new_ref(), x, dims=["gpu"], reduction=reduction,
                         mesh=target)).tensors[0].ref
        pending = _sync_in_thread(a, timeout=20)
        time.sleep(0.5)
        assert "t" not in pending, f"the Sync returned before the loss: {pending}"
        old_id = _agents(a)[2].agent_id
        t_kill = _kill_rank(srv, 2)
        _lost_promptly(pending, t_kill, 2)
        with pytest.raises(FetchError) as e:
            fetch(a, r)
        assert e.value.kind in ("AGENT_LOST", "REMOTE_FAILURE"), e.value
        _bystander(b, 2)
        # The survivors' shards are intact.
        np.testing.assert_array_equal(fetch(a, x, gpu=1), X[1])
        a.run(sync(), timeout=10)  # may still report rank 0's injected hang (seq of the reduce)
        _replaced(a, 2, old_id)
        m2 = a.mesh(gpu=3).ref
        t2 = a.slice(m2, gpu=2).ref
        x2 = upload(a, m2, X, per_rank=True)
        r2 = a.run(reduce(a.new_ref(), x2, dims=["gpu"], reduction=reduction,
                          mesh=t2)).tensors[0].ref
        want = X.sum(0) if reduction == "sum" else X
        np.testing.assert_array_equal(fetch(a, r2), want)
        assert list(a.run(sync(), timeout=10).errors) == []


def _collective(a, kind, m, X, size):
    if kind == "broadcast":
        src = a.slice(m, gpu=0).ref
        x = upload(a, src, X[0], chunk=1 << 20)
        return a.run(lib.to_mesh(a.new_ref(), x, m)).tensors[0].ref
    x = upload(a, m, X, per_rank=True, chunk=1 << 20)
    if kind == "allreduce":
        return a.run(reduce(a.new_ref(), x, dims=["gpu"], reduction="sum")).tensors[0].ref
    if kind == "gather":
        return a.run(reduce(a.new_ref(), x, dims=["gpu"], reduction="stack")).tensors[0].ref
    t = a.slice(m, gpu=1).ref
    return a.run(reduce(a.new_ref(), x, dims=["gpu"], reduction="sum", mesh=t)).tensors[0].ref


@pytest.mark.parametrize("kind", ["broadcast", "allreduce", "gather", "rooted"])
@pytest.mark.parametrize("hang,kill", [(3, 0), (3, 1), (0, 3)])
@pytest.mark.parametrize("size", [16, 1 << 18])
def test_a_member_killed_in_a_collective_fails_every_member(meshd_server, kind, hang, kill, size):
    fault = ("send" if kind == "broadcast" else "reduce") + f":hang,rank={hang},count=1"
    srv = lib.wait_ready(meshd_server(4, env=_fault(fault)), 4)
    with Session(srv.port, "victim") as a, Session(srv.port, "bystander") as b:
        if not data_plane(a):
            pytest.skip("the agents report no data plane")
        m = a.mesh(gpu=4).ref
        X = np.random.default_rng(2).standard_normal((4, size)).astype(np.float32)
        survivors = [r for r in range(4) if r != kill]
        bm = b.mesh(gpu=4).ref
        lo = survivors[0] if survivors[1] - survivors[0] == 1 else survivors[1]
        bm = b.slice(bm, gpu=slice(lo, lo + 2)).ref
        BX = np.arange(16, dtype=np.float32).reshape(2, 8)
        bx = upload(b, bm, BX, per_rank=True)
        _collective(a, kind, m, X, size)
        pending = _sync_in_thread(a, timeout=20)
        time.sleep(0.5)
        assert "t" not in pending, f"the Sync returned before the loss: {pending}"
        old_id = _agents(a)[kill].agent_id
        t_kill = _kill_rank(srv, kill)
        _lost_promptly(pending, t_kill, kill)
        br = b.run(reduce(b.new_ref(), bx, dims=["gpu"], reduction="sum")).tensors[0].ref
        for g in range(2):
            np.testing.assert_array_equal(fetch(b, br, gpu=g), BX.sum(0))
        assert list(b.run(sync(), timeout=10).errors) == []
        _replaced(a, kill, old_id)
        a.run(sync(), timeout=10)
        m2 = a.mesh(gpu=4).ref
        r = _collective(a, kind, m2, X, size)
        want = {"broadcast": X[0], "allreduce": X.sum(0), "gather": X, "rooted": X.sum(0)}[kind]
        for g in ([1] if kind == "rooted" else range(4)):
            got = fetch(a, r, gpu=g) if kind != "rooted" else fetch(a, r)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"gpu {g}")
        assert list(a.run(sync(), timeout=10).errors) == []


def test_two_sessions_collectives_interleaved_never_cross_pair(meshd_server):
    import threading
    srv = lib.wait_ready(meshd_server(3, env=_fault("reduce:fail,rank=1,count=4")), 3)
    out = {}

    def work(name, seed):
        try:
            with Session(srv.port, name) as s:
                m = s.mesh(gpu=3).ref
                sub = s.slice(m, gpu=slice(0, 2)).ref
                rng = np.random.default_rng(seed)
                res = []
                for k in range(12):
                    size = [8, 1 << 15, 1 << 17][k % 3]
                    X = rng.integers(-50, 50, (3, size)).astype(np.float32)
                    x = upload(s, m, X, per_rank=True, chunk=1 << 20)
                    if k % 4 == 0:
                        r = s.run(reduce(s.new_ref(), x, dims=["gpu"], reduction="sum")).tensors[0].ref
                        res.append((r, X.sum(0), [0, 1, 2], {}))
                    elif k % 4 == 1:
                        t = s.slice(m, gpu=2).ref
                        r = s.run(reduce(s.new_ref(), x, dims=["gpu"], reduction="max",
                                         mesh=t)).tensors[0].ref
                        res.append((r, X.max(0), [None], {}))
                    elif k % 4 == 2:
                        r = s.run(reduce(s.new_ref(), x, dims=["gpu"], reduction="stack")).tensors[0].ref
                        res.append((r, X, [0, 2], {}))
                    else:
                        r = s.run(lib.to_mesh(s.new_ref(), x, sub, selection={"gpu": 2})).tensors[0].ref
                        res.append((r, X[2], [0, 1], {}))
                s.run(sync(), timeout=60)
                ok = 0
                for r, want, gs, _ in res:
                    for g in gs:
                        try:
                            got = fetch(s, r) if g is None else fetch(s, r, gpu=g)
                        except FetchError:
                            continue
                        np.testing.assert_array_equal(got, want, err_msg=f"{name} ref {r} gpu {g}")
                        ok += 1
                out[name] = ok
        except BaseException as e:  # noqa
            out[name] = e

    ths = [threading.Thread(target=work, args=(n, i), daemon=True) for i, n in enumerate("ab")]
    for t in ths:
        t.start()
    for t in ths:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in ths), "a session hung"
    for n in "ab":
        assert isinstance(out[n], int) and out[n] > 0, out


@pytest.mark.parametrize("kind", ["broadcast", "allreduce", "gather", "rooted"])
@pytest.mark.parametrize("late", [0, 1, 3])
def test_a_member_that_never_arrives_fails_the_call_naming_it(meshd_server, kind, late):
    where = "send" if kind == "broadcast" else "reduce"
    env = {"MESHD_FAULT": f"{where}:slow=3000,rank={late},count=1", "MESHD_COMM_TIMEOUT_MS": "800"}
    srv = lib.wait_ready(meshd_server(4, env=env), 4)
    with Session(srv.port, "late") as a:
        if not data_plane(a):
            pytest.skip("the agents report no data plane")
        m = a.mesh(gpu=4).ref
        X = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
        r = _collective(a, kind, m, X, 64)
        t0 = time.monotonic()
        res = a.run(sync(), timeout=15)
        took = time.monotonic() - t0
        errs = list(res.errors)
        assert errs, f"the {kind} succeeded without rank {late}"
        assert any(f"rank {late}" in e.message for e in errs), errs
        assert took < 6, took
        gs = [None] if kind == "rooted" else range(4)
        for g in gs:
            with pytest.raises(FetchError):
                fetch(a, r) if g is None else fetch(a, r, gpu=g)
        # and the next one, all present, is right
        r2 = _collective(a, kind, m, X, 64)
        want = {"broadcast": X[0], "allreduce": X.sum(0), "gather": X, "rooted": X.sum(0)}[kind]
        for g in gs:
            got = fetch(a, r2) if g is None else fetch(a, r2, gpu=g)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"gpu {g}")
        assert list(a.run(sync(), timeout=10).errors) == []
