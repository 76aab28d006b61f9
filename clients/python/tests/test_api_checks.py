"""The client's own checks against DESIGN.md §6: an object of another session is
refused before anything is sent (refs are per session: a ref of session B names
something else, or nothing, in session A), and client-side check failures carry the
kind DESIGN.md names (a MeshdError, still the builtin a Monarch user catches)."""

import numpy as np
import pytest

import meshd


@pytest.fixture
def two(server):
    """Two sessions on one server, each with a gpu=2 mesh and a tensor: their refs
    are the same numbers (each session's refs count from 1)."""
    with meshd.connect(server[0]) as a, meshd.connect(server[0]) as b:
        ma, mb = a.mesh(gpu=2), b.mesh(gpu=2)
        with ma.activate():
            ta = meshd.ones(2)
        with mb.activate():
            tb = meshd.zeros(2)
        assert (ma.ref, ta.ref) == (mb.ref, tb.ref)  # what makes a mix-up silent
        yield a, b, ma, mb, ta, tb


def test_list_of_tensors_of_another_session_is_refused(two):
    a, b, ma, mb, ta, tb = two
    with pytest.raises(ValueError, match="another session"):
        meshd.ops.cat([ta, tb])  # was: cat([ta, ta]), [1, 1, 1, 1], no error


def test_to_mesh_onto_a_mesh_of_another_session_is_refused(two):
    a, b, ma, mb, ta, tb = two
    with pytest.raises(ValueError, match="another session"):
        ta.to_mesh(mb)  # was: a copy on session a's own mesh 1
    with pytest.raises(ValueError, match="another session"):
        ta.slice_mesh(gpu=0).to_mesh(mb)
    with pytest.raises(ValueError, match="another session"):
        ta.to_mesh(ma, stream=b.stream("side"))


def test_borrow_of_a_tensor_of_another_session_is_refused(two):
    a, b, ma, mb, ta, tb = two
    side = b.stream("side")
    with pytest.raises(ValueError, match="another session"):
        side.borrow(ta)  # was: a borrow of session b's tensor with ta's ref (tb)


def test_reduce_with_out_or_mesh_of_another_session_is_refused(two):
    a, b, ma, mb, ta, tb = two
    with pytest.raises(ValueError, match="another session"):
        ta.reduce("gpu", out=tb)
    with pytest.raises(ValueError, match="another session"):
        ta.reduce("gpu", mesh=mb.slice(gpu=0))


def test_unknown_dtype_is_bad_argument(mesh):
    """DESIGN.md §6: unknown dtype -> BAD_ARGUMENT, as a negative shape is."""
    for d in ("floaty", "complex64", np.float128 if hasattr(np, "float128") else "U8"):
        with pytest.raises(meshd.MeshdError) as e:
            meshd.zeros(2, dtype=d)
        assert e.value.kind == "BAD_ARGUMENT" and "dtype" in e.value.message
        assert isinstance(e.value, ValueError)  # as before, for those who catch that
    with pytest.raises(meshd.MeshdError) as e:
        meshd.tensor(np.zeros(2, dtype=np.complex64))
    assert e.value.kind == "BAD_ARGUMENT"


def test_shard_dim_and_rows_have_kinds(mesh):
    """meshd.tensor(shard=), meshd.load(shard=): an unknown dim -> BAD_DIM, a wrong row count ->
    SHAPE_MISMATCH (DESIGN.md §6's kinds), still ValueErrors."""
    with pytest.raises(meshd.MeshdError) as e:
        meshd.tensor(np.zeros((2, 2)), shard="nope")
    assert e.value.kind == "BAD_DIM" and "'nope'" in e.value.message
    assert isinstance(e.value, ValueError)
    with pytest.raises(meshd.MeshdError) as e:
        meshd.tensor(np.zeros((3, 2)), shard="gpu")
    assert e.value.kind == "SHAPE_MISMATCH" and isinstance(e.value, ValueError)
    with pytest.raises(meshd.MeshdError) as e:  # checked before any URL is read
        meshd.load("file:///nonexistent.bin", dtype="float32", shape=(2,), shard="nope")
    assert e.value.kind == "BAD_DIM" and isinstance(e.value, ValueError)


def test_reduce_over_an_int_names_the_mistake(mesh):
    """reduce(0) (a tensor dim, torch's habit) said only "'int' object is not iterable"."""
    x = meshd.ones(2)
    with pytest.raises(TypeError, match="mesh dim names.*got 0"):
        x.reduce(0)


def test_stream_of_another_session_is_refused(two):
    """`with b_stream.activate(): with a_mesh.activate(): zeros(...)` ran on session a's
    main stream, silently (the active stream was ignored as of another session)."""
    a, b, ma, mb, ta, tb = two
    side = b.stream("side")
    with side.activate(), ma.activate():
        for make in (lambda: meshd.zeros(2), lambda: ta + 1,
                     lambda: meshd.tensor(np.ones(2, np.float32)), lambda: ta.reduce("gpu")):
            with pytest.raises(ValueError, match="another session") as e:
                make()
            assert "'side'" in str(e.value) and b.id in str(e.value), str(e.value)
    with ma.activate(), a.stream("side").activate():  # its own session's stream: fine
        assert meshd.zeros(2).stream.name == "side"
