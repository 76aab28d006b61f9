"""Where meshd answers a program differently from Monarch's tensor engine
(../shared/reference/MONARCH_ENGINE.md §4, "Error model"): a failed value's users fail
with the root failure, naming it, however they reach it (an op, a borrow) and however
many steps away they are, and whenever the server learns of the failure.

Real binaries (`meshd --local-agents 2`); run-time failures come from index_select with
an index past the end, as in test_compute.py. Commands that must reach the server before
it learns of a failure go in one Submit batch: the agents get its instructions only once
the whole batch was accepted."""

import os
import sys

import numpy as np
import pytest

import meshd_testlib as lib
from meshd_testlib import Ref, Session, borrow, call, describe, reduce, sync
from test_compute import FetchError, fetch, upload

sys.path.insert(0, os.path.join(lib.SOURCE_DIR, "clients", "python"))

import meshd  # noqa: E402


def pb():
    return lib.tensor_pb2()


def state(s, ref):
    return pb().TensorState.Name(s.run(describe(ref)).tensors[0].state)


@pytest.fixture
def s2(shared_meshd):
    srv = shared_meshd(2)
    with Session(srv.port, "monarch") as s:
        s.srv = srv
        yield s
    assert srv.proc.poll() is None, f"meshd exited ({srv.proc.returncode}) during the test"


def _inputs(s, m, only_rank1=False):
    """x f32 [2,3] and an index [0, 7] (past the end of dim 1): index_select of them fails;
    only_rank1: rank 0 gets a valid index, so only rank 1 fails."""
    x = upload(s, m, np.arange(6, dtype=np.float32).reshape(2, 3))
    if only_rank1:
        idx = upload(s, m, np.array([[0, 1], [0, 7]], dtype=np.int64), per_rank=True)
    else:
        idx = upload(s, m, np.array([0, 7], dtype=np.int64))
    return x, idx


def _batch(s, *cmds):
    """The commands in one Submit message; every one must be accepted."""
    batch = [s.command(c) for c in cmds]
    results, code, details = s.submit([pb().Command(batch=batch)])
    assert [r.HasField("error") for r in results] == [False] * len(batch), (results, details)
    return batch


def test_a_borrow_of_a_value_that_fails_later_fails_on_every_rank(s2):
    """Monarch: borrow is new_node((r,), (t,)): the handle depends on the borrowed tensor,
    so it is errored when t is, and a fetch of it raises from every rank (DESIGN §3: "a
    borrow of a failed tensor gives a failed handle"). meshd does so when the server knew
    of the failure at the Borrow; when the Borrow came first, the agents fail the handle
    but never tell the server: it stays LIVE and a fetch from the rank where the op
    worked returns values."""
    m = s2.mesh(gpu=2).ref
    side = s2.stream("side")
    x, idx = _inputs(s2, m, only_rank1=True)
    bad, h, b = s2.new_ref(), s2.new_ref(), s2.new_ref()
    _batch(s2, call("index_select", Ref(x), 1, Ref(idx), results=[bad]),
           borrow(h, bad, side, False, b))
    errors = s2.run(sync()).errors
    assert [pb().ErrorKind.Name(e.kind) for e in errors] == ["ERROR_KIND_REMOTE_FAILURE"], errors
    assert state(s2, bad) == "TENSOR_STATE_FAILED"
    assert state(s2, h) == "TENSOR_STATE_FAILED", s2.run(describe(h))
    for g in (0, 1):
        with pytest.raises(FetchError) as e:
            fetch(s2, h, gpu=g)
        assert e.value.kind == "DEPENDENT_FAILURE", (g, e.value)
        assert "index_select" in e.value.message, (g, e.value)


@pytest.mark.parametrize("how", ["pairs", "broadcast"])
def test_a_to_mesh_of_a_value_that_fails_later_fails_on_every_rank(shared_meshd, how):
    """Monarch: to_mesh is new_node((r,), (t,)): the copy of a failed value is errored
    everywhere. A receiver whose source failed fails its copy but tells no one, so with
    the ToMesh accepted before the failure was known the copy stays LIVE on the server:
    fetched from a rank whose source was fine it returns values."""
    srv = shared_meshd(4)
    with Session(srv.port, "tomesh-fail") as s:
        if how == "pairs":  # ranks 0, 1 -> 2, 3; only rank 1's value fails
            M = s.mesh(host=2, gpu=2).ref
            src, dst = s.slice(M, host=0).ref, s.slice(M, host=1).ref
            x, idx = _inputs(s, src, only_rank1=True)
            healthy = {"gpu": 0}
        else:  # rank 0 -> ranks 1, 2, 3: a broadcast chain
            M = s.mesh(gpu=4).ref
            src, dst = s.slice(M, gpu=0).ref, s.slice(M, gpu=slice(1, 4)).ref
            x, idx = _inputs(s, src)
            healthy = {"gpu": 1}
        bad, moved = s.new_ref(), s.new_ref()
        _batch(s, call("index_select", Ref(x), 1, Ref(idx), results=[bad]),
               lib.to_mesh(moved, bad, dst))
        errors = s.run(sync()).errors
        assert [lib.kind_name(e.kind) for e in errors] == ["REMOTE_FAILURE"], errors
        assert state(s, moved) == "TENSOR_STATE_FAILED", s.run(describe(moved))
        with pytest.raises(FetchError) as e:
            fetch(s, moved, **healthy)
        assert e.value.kind == "DEPENDENT_FAILURE", e.value


def test_a_dependent_many_steps_away_still_names_the_root_failure(s2):
    """Monarch: every user of a failed value fails with DependentError(root): the root's
    error, however long the chain. meshd's server wraps the message once per step
    ("depends on tensor N, which failed at command seq S: ...") into 300 bytes, so five
    steps later the root's own error is cut away."""
    m = s2.mesh(gpu=2).ref
    x, idx = _inputs(s2, m)
    bad = s2.op("index_select", Ref(x), 1, Ref(idx))[0].ref
    root_seq = s2._seq
    s2.run(sync())  # the server knows: what follows fails on the server at once
    cur = bad
    for _ in range(8):
        cur = s2.op("add", Ref(cur), 1)[0].ref
    t = s2.run(describe(cur)).tensors[0]
    assert lib.kind_name(t.error.kind) == "DEPENDENT_FAILURE", t
    assert t.error.seq == root_seq, t.error
    assert "index 7 is out of range" in t.error.message, t.error.message
    assert f"tensor {bad}," in t.error.message, t.error.message
    with pytest.raises(FetchError) as e:
        fetch(s2, cur, gpu=0)
    assert e.value.kind == "DEPENDENT_FAILURE" and "index 7 is out of range" in e.value.message, \
        e.value


def test_a_dependent_names_the_root_command_however_early_it_was_issued(s2):
    """The same program must fail the same way whether the dependent reached the server
    before or after the root's failure: Error.seq is the root command's seq (DESIGN §6:
    DEPENDENT_FAILURE "naming the root op and its seq"). Issued before, meshd names the
    dependent's own seq, and the message an agent's internal instruction seq."""
    m = s2.mesh(gpu=2).ref
    x, idx = _inputs(s2, m)
    bad, dep = s2.new_ref(), s2.new_ref()
    cmds = _batch(s2, call("index_select", Ref(x), 1, Ref(idx), results=[bad]),
                  call("add", Ref(bad), 1, results=[dep]))
    root_seq = cmds[0].seq
    errors = s2.run(sync()).errors
    assert [e.seq for e in errors] == [root_seq], errors
    t = s2.run(describe(dep)).tensors[0]
    assert lib.kind_name(t.error.kind) == "DEPENDENT_FAILURE", t
    assert t.error.seq == root_seq, t.error
    assert f"command seq {root_seq}:" in t.error.message, t.error.message
    # ... as a dependent issued after the Sync says.
    late = s2.op("add", Ref(bad), 1)[0]
    assert late.error.seq == root_seq, late.error


def test_a_failed_in_place_reduce_names_its_own_command(meshd_server):
    """Monarch's controller reports the failing invocation (the reduce_), whose seq and
    traceback the user sees. So do Sync and Describe: each agent instruction carries its
    command's seq (Instruction.command_seq) and the agent's failure echoes it; the
    server filed a root failure under its tensor's birth (here an upload: seq 0)."""
    srv = lib.wait_ready(meshd_server(2, env={"MESHD_FAULT": "reduce:fail,rank=0,count=1",
                                              "MESHD_COMM_TIMEOUT_MS": "2000"}), 2)
    with Session(srv.port, "inplace") as s:
        m = s.mesh(gpu=2).ref
        x = upload(s, m, np.ones(4, dtype=np.float32))
        seq = 4711
        s.run(reduce(0, x, ["gpu"], inplace=True), seq=seq)
        errors = s.run(sync()).errors
        assert [lib.kind_name(e.kind) for e in errors] == ["REMOTE_FAILURE"], errors
        assert errors[0].seq == seq, errors
        t = s.run(describe(x)).tensors[0]
        assert t.error.seq == seq, t.error


def test_dropping_a_view_drops_its_base_in_the_client(shared_meshd):
    """Monarch's t.drop() drops every alias: base.dropped is True after view.drop()
    (clients/python/README.md: ".dropped | the same: every alias of the storage"). The
    server drops them all, and says which tensors share a storage (TensorMeta.storage):
    the client marked only the handle it was called on, so `if not x.dropped: x + 1`
    raised DROPPED. A borrow's drop drops its handle's views too; the origin lives."""
    srv = shared_meshd(2)
    with meshd.connect(f"127.0.0.1:{srv.port}") as s:
        mesh = s.mesh(gpu=2)
        with mesh.activate():
            x = meshd.ones((2, 3))
            v = x[0]
            v.drop()
            assert v.dropped
            assert x.dropped
            side = s.stream("side")
            y = meshd.ones((4,))
            h, b = side.borrow(y)
            with side.activate():
                hv = h[1:3]
            b.drop()
            assert h.dropped
            assert hv.dropped
            assert not y.dropped
            z = meshd.ones((2, 3))
            with s.pipeline():  # a pipelined drop of a view whose meta is not in yet
                w = z[1]
                w.drop()
            assert z.dropped and not y.dropped


def test_every_result_of_a_failed_op_fails_and_sync_tells_it_once(meshd_server):
    """Monarch fails every result of a failed invocation. max over a dim has two (values
    and indices); it fails on rank 0 (MESHD_FAULT call:fail): both are failed on the
    server (the indices stayed live there), under the max's own seq, and the next Sync
    reports the one root failure once."""
    srv = lib.wait_ready(meshd_server(2, env={"MESHD_FAULT": "call:fail,rank=0,count=1"}), 2)
    with Session(srv.port, "two-results") as s:
        m = s.mesh(gpu=2).ref
        x = upload(s, m, np.arange(6, dtype=np.float32).reshape(2, 3))
        values, indices = s.op("max", Ref(x), 1, nresults=2)
        errors = s.run(sync()).errors
        assert [lib.kind_name(e.kind) for e in errors] == ["REMOTE_FAILURE"], errors
        assert "injected fault" in errors[0].message, errors[0].message
        assert state(s, values.ref) == "TENSOR_STATE_FAILED"
        assert state(s, indices.ref) == "TENSOR_STATE_FAILED"
        err = s.run(describe(indices.ref)).tensors[0].error
        assert err.seq == errors[0].seq and "injected fault" in err.message, err


@pytest.mark.parametrize("drop", ["after_sync", "in_the_batch", "handle_then_borrow"])
def test_a_failure_written_into_a_mutable_borrow_fails_its_origin(s2, drop):
    """Monarch: a mutable borrow's last use makes the origin depend on the handle
    (new_node(origin_aliases, (r,))), so a failure written into the handle fails the
    origin (protocol.md, Failures). meshd did so only when the server learned of the
    handle's failure before the DropBorrow: dropped in the same batch (a client that
    drops the borrow right after writing it, `with b: h.copy_(...)`), or the handle
    dropped first (h.drop(), then b.drop()), the handle's report came for a dropped ref,
    the origin stayed LIVE and a fetch of it returned the stale values from every rank,
    although the agents had failed it (the same memory)."""
    m = s2.mesh(gpu=2).ref
    side = s2.stream("side")
    x, idx = _inputs(s2, m, only_rank1=True)
    y = upload(s2, m, np.zeros((2, 2), dtype=np.float32))
    h, b = s2.new_ref(), s2.new_ref()
    s2.run(borrow(h, y, side, True, b))
    xh, xb, ih, ib = s2.new_ref(), s2.new_ref(), s2.new_ref(), s2.new_ref()
    s2.run(borrow(xh, x, side, False, xb))
    s2.run(borrow(ih, idx, side, False, ib))
    bad = s2.new_ref()
    cmds = [call("index_select", Ref(xh), 1, Ref(ih), results=[bad], stream=side),
            call("copy_", Ref(h), Ref(bad), stream=side)]
    if drop == "in_the_batch":
        cmds.append(lib.drop_borrow(b))
    if drop == "handle_then_borrow":  # h.drop(), then b.drop()
        cmds += [lib.drop(h), lib.drop_borrow(b)]
    _batch(s2, *cmds)
    errors = s2.run(sync()).errors
    assert [lib.kind_name(e.kind) for e in errors] == ["REMOTE_FAILURE"], errors
    if drop == "after_sync":
        s2.run(lib.drop_borrow(b))
    assert state(s2, y) == "TENSOR_STATE_FAILED", s2.run(describe(y))
    for g in (0, 1):
        with pytest.raises(FetchError) as e:
            fetch(s2, y, gpu=g)
        assert e.value.kind == "DEPENDENT_FAILURE", (g, e.value)
        assert "index 7 is out of range" in e.value.message, (g, e.value)
    # ... and what reads it afterwards fails too, naming the root.
    dep = s2.op("add", Ref(y), 1)[0]
    assert lib.kind_name(dep.error.kind) == "DEPENDENT_FAILURE", dep


def test_a_failure_written_into_a_view_of_a_mutable_borrow_fails_its_origin(s2):
    """The same written through a view of the handle (v = h.T; v.copy_(bad)), the view and
    the handle dropped before the borrow, all in one batch: the DeleteRefs of v and h reach
    the agent before the borrow's last use, and the origin must still fail."""
    m = s2.mesh(gpu=2).ref
    side = s2.stream("side")
    x, idx = _inputs(s2, m, only_rank1=True)
    y = upload(s2, m, np.zeros((2, 2), dtype=np.float32))
    h, b = s2.new_ref(), s2.new_ref()
    s2.run(borrow(h, y, side, True, b))
    xh, xb, ih, ib = s2.new_ref(), s2.new_ref(), s2.new_ref(), s2.new_ref()
    s2.run(borrow(xh, x, side, False, xb))
    s2.run(borrow(ih, idx, side, False, ib))
    bad, v = s2.new_ref(), s2.new_ref()
    _batch(s2, call("index_select", Ref(xh), 1, Ref(ih), results=[bad], stream=side),
           call("transpose", Ref(h), 0, 1, results=[v], stream=side),
           call("copy_", Ref(v), Ref(bad), stream=side),
           lib.drop(v), lib.drop(h), lib.drop_borrow(b))
    errors = s2.run(sync()).errors
    assert [lib.kind_name(e.kind) for e in errors] == ["REMOTE_FAILURE"], errors
    assert state(s2, y) == "TENSOR_STATE_FAILED", s2.run(describe(y))
    for g in (0, 1):
        with pytest.raises(FetchError) as e:
            fetch(s2, y, gpu=g)
        assert "index 7 is out of range" in e.value.message, (g, e.value)


@pytest.mark.parametrize("only_rank1", [True, False])
def test_a_failure_written_into_a_mutable_borrow_of_a_view_fails_its_base_once(s2, only_rank1):
    """h mutably borrows v = x.T; a failed value copied into h fails v and x (one storage
    on the agents; v and x are aliases on the server), each once, naming the root; Sync
    lists the root once; a view w of x taken before fails too."""
    m = s2.mesh(gpu=2).ref
    side = s2.stream("side")
    xi, idx = _inputs(s2, m, only_rank1=only_rank1)
    x = upload(s2, m, np.zeros((2, 2), dtype=np.float32))
    v = s2.op("transpose", Ref(x), 0, 1)[0].ref
    w = s2.op("view", Ref(x), [4])[0].ref
    h, b = s2.new_ref(), s2.new_ref()
    s2.run(borrow(h, v, side, True, b))
    xh, xb, ih, ib = s2.new_ref(), s2.new_ref(), s2.new_ref(), s2.new_ref()
    s2.run(borrow(xh, xi, side, False, xb))
    s2.run(borrow(ih, idx, side, False, ib))
    bad = s2.new_ref()
    _batch(s2, call("index_select", Ref(xh), 1, Ref(ih), results=[bad], stream=side),
           call("copy_", Ref(h), Ref(bad), stream=side), lib.drop_borrow(b))
    errors = s2.run(sync()).errors
    assert [lib.kind_name(e.kind) for e in errors] == ["REMOTE_FAILURE"], errors
    for t in (v, x, w):
        assert state(s2, t) == "TENSOR_STATE_FAILED", (t, s2.run(describe(t)))
        for g in (0, 1):
            with pytest.raises(FetchError) as e:
                fetch(s2, t, gpu=g)
            assert "index 7 is out of range" in e.value.message, (t, g, e.value)
    assert list(s2.run(sync()).errors) == []
