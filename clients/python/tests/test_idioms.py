"""Monarch's idioms, written as a Monarch user writes them (issue 15): factories with
torch's size arguments, inspect of the first rank, Stream("name") and
get_active_stream(), Borrow as a context manager, Future.get(), local shape queries,
and check failures that are TypeError or ValueError too."""

import threading

import numpy as np
import pytest

import meshd


def test_factories_take_torch_sizes_and_keyword_options(mesh):
    assert meshd.rand(3, 4).shape == (3, 4)
    assert meshd.rand((3, 4)).shape == (3, 4)
    assert meshd.zeros(5).shape == (5,)
    assert meshd.ones([2, 2], dtype="int32").dtype == "int32"
    assert meshd.randn(2, 3, seed=1, dtype="float64").dtype == "float64"
    np.testing.assert_array_equal(meshd.inspect(meshd.rand(8, seed=3)),
                                  meshd.inspect(meshd.rand((8,), seed=3)))
    with pytest.raises(TypeError, match="by keyword"):
        meshd.zeros(3, "float32")
    assert meshd.rand(3, 4, 7).shape == (3, 4, 7)  # sizes, never a seed by position
    assert meshd.full((2,), 1.5, dtype="float64").dtype == "float64"


def test_inspect_without_coordinates_is_the_first_rank(session):
    m = session.mesh(host=1, gpu=2)
    with m.activate():
        t = meshd.tensor(np.array([[1, 2], [3, 4]], np.float32), shard="gpu")
        np.testing.assert_array_equal(meshd.inspect(t), [1, 2])
        assert meshd.fetch_shard(t).get(30).tolist() == [1, 2]   # Monarch's Future.get
        assert meshd.fetch_shard(t, gpu=1, host=0).result().tolist() == [3, 4]


def test_stream_by_name_and_the_active_stream(session, mesh):
    assert meshd.get_active_stream() is session.default_stream
    side = meshd.Stream("side")
    assert side.session is session and side.name == "side" and side.ref > 0
    with side.activate():
        assert meshd.get_active_stream() is side
        t = meshd.ones(2)
    assert t.stream is side
    err = []  # another thread has no active mesh
    th = threading.Thread(target=lambda: err.append(_stream_without_mesh()))
    th.start()
    th.join(10)
    assert isinstance(err[0], ValueError) and "no active mesh" in str(err[0]), err


def _stream_without_mesh():
    try:
        meshd.Stream("nowhere")
    except ValueError as e:
        return e
    return AssertionError("Stream(name) without an active mesh did not raise")


def test_borrow_is_a_context_manager(session, mesh):
    side = session.stream("side")
    t = meshd.ones(3)
    h, b = side.borrow(t, mutable=True)
    with b:
        with side.activate():
            h.add_(1)
        with pytest.raises(meshd.MeshdError):  # the origin is lent out mutably
            t + 1
    assert b.dropped and h.dropped
    np.testing.assert_array_equal(meshd.inspect(t + 0), [2, 2, 2])


def test_shape_queries_are_local(session, mesh, monkeypatch):
    t = meshd.zeros(2, 3, 4)
    t.shape  # resolved
    monkeypatch.setattr(session, "_unary", None)  # any call now would fail
    assert t.size() == (2, 3, 4) and t.size(1) == 3 and t.size(-1) == 4
    assert t.dim() == 3 and t.numel() == 24
    with pytest.raises(IndexError):
        t.size(3)


def test_check_failures_are_type_and_value_errors(session, mesh):
    other = session.mesh(gpu=1)
    a = meshd.ones(2)
    with other.activate():
        b = meshd.ones(2)
    with pytest.raises(TypeError) as e:  # Monarch: TypeError for mesh, stream and borrow checks
        a + b
    assert isinstance(e.value, meshd.MeshdError) and e.value.kind == "WRONG_MESH"
    with pytest.raises(ValueError) as e:
        a.reduce("nodim")
    assert isinstance(e.value, meshd.MeshdError) and e.value.kind == "BAD_DIM"
    a.drop()
    with pytest.raises(TypeError) as e:
        a + 1
    assert e.value.kind == "DROPPED"


def test_the_op_catalogue_comes_from_the_server(session, mesh):
    names = dir(meshd.ops)
    assert "add" in names and "relu" in names and "transpose" in names and len(names) > 50
    assert "add(" in meshd.ops.add.__doc__ and "Tensor" in meshd.ops.add.__doc__
    assert "(a view of self)" in meshd.ops.transpose.__doc__
    assert "(in place)" in meshd.ops.add_.__doc__
    t = meshd.ones(2, 3)
    assert "relu" in dir(t) and "size" in dir(t)
    assert t.relu.__doc__.startswith("relu(")
    with pytest.raises(AttributeError, match="catalogue"):
        meshd.ops.no_such_op
    with pytest.raises(AttributeError):
        t.device  # not an op: a local AttributeError, no call
    assert not hasattr(t, "requires_grad")
    np.testing.assert_array_equal(meshd.inspect(t.transpose(0, 1)), np.ones((3, 2)))


def test_reduce_over_a_pytree_keeps_its_structure(session, mesh):
    g = {"w": meshd.tensor(np.array([[1, 2], [3, 4]], np.float32), shard="gpu"),
         "b": [meshd.tensor(np.array([[1], [5]], np.float32), shard="gpu"), 7]}
    out = meshd.reduce(g, "gpu", "sum")
    assert set(out) == {"w", "b"} and isinstance(out["b"], list) and out["b"][1] == 7
    np.testing.assert_array_equal(meshd.inspect(out["w"], gpu=1), [4, 6])
    np.testing.assert_array_equal(meshd.inspect(out["b"][0], gpu=0), [6])
    t = meshd.tensor(np.array([[1], [2]], np.float32), shard="gpu")
    (same,) = meshd.reduce_((t,), "gpu", "avg")
    assert same is t
    np.testing.assert_array_equal(meshd.inspect(t, gpu=1), [1.5])


def test_sum_and_mean_methods_take_dtype_as_torch_and_the_server_message_say(session, mesh):
    # The server's check says "mean needs a floating dtype (pass dtype=float32 or cast
    # self)"; the methods took no dtype= (a TypeError), though the catalogue's
    # sum/mean have it and meshd.ops.mean(t, dtype=...) accepts it.
    a = meshd.arange(4)
    with pytest.raises(meshd.MeshdError, match="pass dtype=float32"):
        a.mean()
    m = a.mean(dtype="float32")
    assert m.dtype == "float32" and float(meshd.inspect(m)) == 1.5
    assert float(meshd.inspect(a.mean(0, dtype="float64"))) == 1.5
    s = a.sum(dtype="float64")
    assert s.dtype == "float64" and float(meshd.inspect(s)) == 6.0
    x = meshd.ones((2, 3), dtype="int32")
    np.testing.assert_array_equal(meshd.inspect(x.sum(dim=1, keepdim=True, dtype="int64")),
                                  [[3], [3]])
    assert x.sum().dtype == meshd.ops.sum(x).dtype  # unchanged without dtype=
