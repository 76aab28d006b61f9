"""A Reduce's out= is a mutated input, as Monarch has it (ts = [self, out]): a failed out
fails the result, also under a ref of its own (it was answered LIVE), as a Call's does."""
import numpy as np
import pytest

import meshd_testlib as lib
from meshd_testlib import Ref, Session, reduce, sync
from test_compute import op, upload


def pb():
    return lib.tensor_pb2()


def state(s, ref):
    return pb().TensorState.Name(s.describe(ref).tensors[0].state)


@pytest.fixture
def s2(shared_meshd):
    srv = shared_meshd(2)
    with Session(srv.port, "reduce-out") as s:
        s.srv = srv
        yield s
    assert srv.proc.poll() is None, f"meshd exited ({srv.proc.returncode}) during the test"


def _failed(s, m):
    """A tensor of shape (2,) that fails at run time (index_select past the end)."""
    x = upload(s, m, np.arange(6, dtype=np.float32).reshape(3, 2))
    idx = upload(s, m, np.array([0, 7], dtype=np.int64))
    bad = op(s, "index_select", Ref(x), 0, Ref(idx))  # shape (2, 2)
    s.run(sync())
    assert state(s, bad) == "TENSOR_STATE_FAILED"
    return bad


def test_reduce_into_a_failed_out_under_a_new_ref_is_not_reported_live(s2):
    """reduce(x, out=bad) names `out` as a mutated input (Monarch: ts=[self, out]); the
    result under its own ref is a view of `out`'s failed storage and must be failed too."""
    m = s2.mesh(gpu=2).ref
    bad = _failed(s2, m)
    x = s2.tensor(m, (2, 2), kind="ones").ref
    r = s2.new_ref()
    res = s2.run(reduce(r, x, ["gpu"], reduction="sum", out=bad))
    got = pb().TensorState.Name(res.tensors[0].state)
    assert state(s2, bad) == "TENSOR_STATE_FAILED"
    assert got == "TENSOR_STATE_FAILED", res  # its storage (bad) is failed
    assert state(s2, r) == "TENSOR_STATE_FAILED"


def test_call_into_a_failed_out_is_failed_for_comparison(s2):
    """The same thing through Call (add.out with out=bad): the result is failed."""
    m = s2.mesh(gpu=2).ref
    bad = _failed(s2, m)
    x = s2.tensor(m, (2, 2), kind="ones").ref
    res = s2.op("add_", Ref(bad), Ref(x))
    assert pb().TensorState.Name(res[0].state) == "TENSOR_STATE_FAILED", res

