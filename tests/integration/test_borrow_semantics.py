"""Borrows and streams against Monarch's semantics (MONARCH_ENGINE.md, Borrows):
values on the borrowing stream, refusals on the origin and views."""

import numpy as np
import pytest

import meshd_testlib as lib
from meshd_testlib import Ref, Session, borrow, call, drop_borrow
from test_compute import fetch, upload, FetchError


@pytest.fixture
def s2(shared_meshd):
    srv = shared_meshd(2)
    with Session(srv.port, "borrowsem") as s:
        yield s
    assert srv.proc.poll() is None, f"meshd exited ({srv.proc.returncode}) during the test"


def _b(s, t, stream, mutable):
    h, b = s.new_ref(), s.new_ref()
    s.run(borrow(h, t, stream, mutable, b))
    return h, b


def test_read_borrow_sees_origin_writes_in_order(s2):
    m = s2.mesh(gpu=2).ref
    side = s2.stream("side")
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = upload(s2, m, a)
    for _ in range(3):
        s2.run(call("add_", Ref(x), 1))
    h, b = _b(s2, x, side, False)
    (y,) = s2.op("mul", Ref(h), 2, stream=side)
    np.testing.assert_array_equal(fetch(s2, y.ref, gpu=1), (a + 3) * 2)
    s2.run(drop_borrow(b))
    s2.run(call("add_", Ref(x), 10))
    np.testing.assert_array_equal(fetch(s2, x, gpu=1), a + 13)
    np.testing.assert_array_equal(fetch(s2, y.ref, gpu=1), (a + 3) * 2)


def test_mutable_borrow_writes_reach_origin(s2):
    m = s2.mesh(gpu=2).ref
    side = s2.stream("side")
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = upload(s2, m, a)
    s2.run(call("add_", Ref(x), 1))
    h, b = _b(s2, x, side, True)
    s2.run(call("mul_", Ref(h), 3, stream=side))
    s2.run(drop_borrow(b))
    s2.run(call("add_", Ref(x), 1))
    np.testing.assert_array_equal(fetch(s2, x, gpu=1), (a + 1) * 3 + 1)


def test_borrow_of_view_refuses_base_write(s2):
    m = s2.mesh(gpu=2).ref
    side = s2.stream("side")
    x = upload(s2, m, np.zeros((2, 3), dtype=np.float32))
    (v,) = s2.op("transpose", Ref(x), 0, 1)
    h, b = _b(s2, v.ref, side, False)
    s2.fails("MUTATING_BORROW", call("add_", Ref(x), 1), "add_")
    s2.run(drop_borrow(b))
    h, b = _b(s2, v.ref, side, True)
    s2.fails("BORROWED", call("add", Ref(x), 1, results=[s2.new_ref()]), "add")
    s2.fails("BORROWED", call("add_", Ref(x), 1), "add_")
    s2.run(drop_borrow(b))


def test_nested_borrow(s2):
    m = s2.mesh(gpu=2).ref
    side, other = s2.stream("side"), s2.stream("other")
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = upload(s2, m, a)
    h, b = _b(s2, x, side, True)
    s2.run(call("add_", Ref(h), 1, stream=side))
    h2, b2 = _b(s2, h, other, False)
    (y,) = s2.op("mul", Ref(h2), 2, stream=other)
    s2.fails("MUTATING_BORROW", call("add_", Ref(h), 1, stream=side), "add_")
    s2.fails("BORROWED", drop_borrow(b), "DropBorrow")
    s2.run(drop_borrow(b2))
    s2.run(call("add_", Ref(h), 1, stream=side))
    s2.run(drop_borrow(b))
    np.testing.assert_array_equal(fetch(s2, y.ref, gpu=1), (a + 1) * 2)
    np.testing.assert_array_equal(fetch(s2, x, gpu=1), a + 2)


def test_borrow_back_onto_origin_stream(s2):
    m = s2.mesh(gpu=2).ref
    side = s2.stream("side")
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = upload(s2, m, a)
    h, b = _b(s2, x, side, True)
    h2, b2 = _b(s2, h, 0, True)
    s2.fails("BORROWED", call("add_", Ref(x), 1), "add_")
    s2.run(call("add_", Ref(h2), 1))
    s2.run(drop_borrow(b2))
    s2.run(call("mul_", Ref(h), 2, stream=side))
    s2.run(drop_borrow(b))
    np.testing.assert_array_equal(fetch(s2, x, gpu=1), (a + 1) * 2)


def test_fetch_after_drop_and_handle_use(s2):
    m = s2.mesh(gpu=2).ref
    side = s2.stream("side")
    x = upload(s2, m, np.zeros((2, 3), dtype=np.float32))
    h, b = _b(s2, x, side, False)
    s2.run(drop_borrow(b))
    with pytest.raises(FetchError) as e:
        fetch(s2, h, gpu=1)
    assert e.value.kind == "DROPPED", e.value
    s2.fails("DROPPED", call("add", Ref(h), 1, results=[s2.new_ref()], stream=side), "add")
    s2.fails("DROPPED", lib.reduce(s2.new_ref(), h, ["gpu"], stream=side), "Reduce")
    s2.fails("DROPPED", lib.to_mesh(s2.new_ref(), h, m), "ToMesh")
    s2.fails("DROPPED", borrow(s2.new_ref(), h, 0, False, s2.new_ref() + 1), "Borrow")


def test_reduce_and_to_mesh_respect_borrows(s2):
    m = s2.mesh(gpu=2).ref
    side = s2.stream("side")
    x = upload(s2, m, np.ones((2, 3), dtype=np.float32))
    out = upload(s2, m, np.ones((2, 3), dtype=np.float32))
    h, b = _b(s2, x, side, False)
    ho, bo = _b(s2, out, side, False)
    s2.fails("MUTATING_BORROW", lib.reduce(0, x, ["gpu"], inplace=True), "Reduce")
    s2.fails("MUTATING_BORROW", lib.reduce(0, x, ["gpu"], out=out), "Reduce")
    s2.run(drop_borrow(b))
    s2.run(drop_borrow(bo))
    h, b = _b(s2, x, side, True)
    s2.fails("BORROWED", lib.to_mesh(s2.new_ref(), x, m), "ToMesh")
    s2.fails("BORROWED", lib.reduce(s2.new_ref(), x, ["gpu"]), "Reduce")
    r = s2.new_ref()
    s2.run(lib.reduce(r, h, ["gpu"], stream=side))
    np.testing.assert_array_equal(fetch(s2, r, gpu=1), np.full((2, 3), 2, np.float32))


def _batch(s, *cmds):
    pb = lib.tensor_pb2()
    batch = [s.command(c) for c in cmds]
    results, code, details = s.submit([pb.Command(batch=batch)])
    assert [r.HasField("error") for r in results] == [False] * len(batch), (results, details)


@pytest.mark.parametrize("only_rank1", [True, False])
@pytest.mark.parametrize("how", ["drop_after_sync", "use_then_drop", "read_borrow"])
def test_failure_through_a_borrow_is_reported_once(s2, only_rank1, how):
    m = s2.mesh(gpu=2).ref
    side = s2.stream("side")
    xi = upload(s2, m, np.arange(6, dtype=np.float32).reshape(2, 3))
    if only_rank1:
        idx = upload(s2, m, np.array([[0, 1], [0, 7]], dtype=np.int64), per_rank=True)
    else:
        idx = upload(s2, m, np.array([0, 7], dtype=np.int64))
    y = upload(s2, m, np.zeros((2, 2), dtype=np.float32))
    if how == "read_borrow":
        bad = s2.new_ref()
        _batch(s2, call("index_select", Ref(xi), 1, Ref(idx), results=[bad]))
        errors = s2.run(lib.sync()).errors
        assert [lib.kind_name(e.kind) for e in errors] == ["REMOTE_FAILURE"], errors
        h, b = _b(s2, bad, side, False)
        (z,) = s2.op("add", Ref(h), 1, stream=side)
        s2.run(drop_borrow(b))
        errors = s2.run(lib.sync()).errors
        assert list(errors) == [], errors
        return
    h, b = _b(s2, y, side, True)
    xh, xb = _b(s2, xi, side, False)
    ih, ib = _b(s2, idx, side, False)
    bad = s2.new_ref()
    _batch(s2, call("index_select", Ref(xh), 1, Ref(ih), results=[bad], stream=side),
           call("copy_", Ref(h), Ref(bad), stream=side))
    errors = s2.run(lib.sync()).errors
    assert [lib.kind_name(e.kind) for e in errors] == ["REMOTE_FAILURE"], errors
    if how == "use_then_drop":
        s2.op("add", Ref(h), 1, stream=side)
    s2.run(drop_borrow(b))
    errors = s2.run(lib.sync()).errors
    assert list(errors) == [], errors
    (z,) = s2.op("add", Ref(y), 1)
    assert lib.kind_name(z.error.kind) == "DEPENDENT_FAILURE", z
    errors = s2.run(lib.sync()).errors
    assert list(errors) == [], errors


def test_borrow_hostile_refs(s2):
    m = s2.mesh(gpu=2).ref
    side = s2.stream("side")
    x = upload(s2, m, np.zeros((2, 3), dtype=np.float32))
    y = upload(s2, m, np.zeros((2, 3), dtype=np.float32))
    r = s2.new_ref()
    s2.fails("UNKNOWN_REF", borrow(r, x, y, False, r + 1), "Borrow")      # stream is a tensor
    s2.fails("UNKNOWN_REF", borrow(r + 2, side, side, False, r + 3), "Borrow")  # input a stream
    s2.fails("REF_REUSED", borrow(r + 4, x, side, False, r + 4), "Borrow")
    h, b = _b(s2, x, side, False)
    s2.fails("UNKNOWN_REF", drop_borrow(h), "DropBorrow")
    s2.fails("BAD_ARGUMENT", lib.drop(b), "Drop")
    s2.fails("BAD_ARGUMENT", lib.release(b), "Release")
    s2.fails("UNKNOWN_REF", call("add", Ref(b), 1, results=[s2.new_ref()], stream=side), "add")
    s2.run(drop_borrow(b))
    s2.fails("DROPPED", drop_borrow(b), "DropBorrow")
    s2.run(call("add_", Ref(x), 1))


def test_handle_written_then_moved_back_to_origin_stream(s2):
    m = s2.mesh(gpu=2).ref
    side = s2.stream("side")
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = upload(s2, m, a)
    h, b = _b(s2, x, side, True)
    s2.run(call("mul_", Ref(h), 5, stream=side))
    r = s2.new_ref()
    s2.run(lib.to_mesh(r, h, m, dst_stream=0))
    s2.run(lib.reduce(0, h, ["gpu"], inplace=True, stream=side))
    s2.run(drop_borrow(b))
    (z,) = s2.op("add", Ref(x), Ref(r))
    np.testing.assert_array_equal(fetch(s2, r, gpu=0), a * 5)
    np.testing.assert_array_equal(fetch(s2, z.ref, gpu=1), a * 10 + a * 5)
