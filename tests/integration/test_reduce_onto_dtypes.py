"""Reduce onto a sub-mesh (issue 16, item 5) for every dtype class the compute matrix
leaves out (float16, bfloat16, float64, int8, uint8, int16, int64, bool), small (direct
exchange) and large (ring, > 64 KiB per member), against numpy with torch's rules
(integer sums and products wrap; on bool sum/max are `or`, product/min are `and`)."""

import numpy as np
import pytest

from meshd_testlib import DT, Ref, Session, reduce
from test_compute import fetch, upload
from test_compute_matrix import _need_data_plane

REDUCTIONS = ["sum", "avg", "product", "min", "max", "band", "bor", "bxor"]
FLOATS = ("float16", "bfloat16", "float64")
INTS = ("int8", "uint8", "int16", "int64")


def _np_reduce(reduction, X, dt):
    """X: (members, ...) in the carrier dtype; the reduction over axis 0 as torch gives it."""
    if dt == "bool":
        B = X != 0
        f = {"sum": np.any, "max": np.any, "bor": np.any, "product": np.all, "min": np.all,
             "band": np.all, "bxor": lambda a, axis: np.bitwise_xor.reduce(a, axis)}[reduction]
        return f(B, axis=0)
    if dt in INTS:
        t = np.dtype(dt)
        Y = X.astype(t)
        with np.errstate(over="ignore"):
            return {"sum": lambda: np.sum(Y, 0, dtype=t), "product": lambda: np.prod(Y, 0, dtype=t),
                    "min": lambda: Y.min(0), "max": lambda: Y.max(0),
                    "band": lambda: np.bitwise_and.reduce(Y, 0),
                    "bor": lambda: np.bitwise_or.reduce(Y, 0),
                    "bxor": lambda: np.bitwise_xor.reduce(Y, 0)}[reduction]()
    # floats: small integers, exact in every one of them under every reduction
    return {"sum": lambda: X.sum(0), "avg": lambda: X.mean(0), "product": lambda: X.prod(0),
            "min": lambda: X.min(0), "max": lambda: X.max(0)}[reduction]()


def _rejected(reduction, dt):
    if reduction == "avg":
        return dt not in FLOATS
    return reduction in ("band", "bor", "bxor") and dt in FLOATS


def _parts(n, dt, count, seed):
    r = np.random.default_rng(seed)
    if dt in FLOATS:
        return r.integers(1, 3, (n, count)).astype(np.float32)
    if dt == "bool":
        return r.integers(0, 2, (n, count)).astype(np.int32)
    if dt == "uint8":
        return r.integers(0, 256, (n, count)).astype(np.int32)
    if dt == "int8":
        return r.integers(-128, 128, (n, count)).astype(np.int32)  # sums overflow int8
    if dt == "int16":
        return r.integers(-32768, 32768, (n, count)).astype(np.int32)
    return r.integers(-(1 << 40), 1 << 40, (n, count)).astype(np.int64)


@pytest.mark.parametrize("count", [5, 70000], ids=["direct", "ring"])
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_reduce_onto_a_sub_mesh_every_dtype(shared_meshd, n, count):
    srv = shared_meshd(n)
    with Session(srv.port, "rooted-dtypes") as s:
        _need_data_plane(s)
        m = s.mesh(gpu=n).ref
        root = n - 1
        target = s.slice(m, gpu=root).ref
        for dt in FLOATS + INTS + ("bool",):
            X = _parts(n, dt, count, seed=n * 7 + len(dt))
            carrier = upload(s, m, X, per_rank=True)
            x = s.op("to", Ref(carrier), DT(dt))[0].ref
            for reduction in REDUCTIONS + ["stack"]:
                cmd = reduce(s.new_ref(), x, dims=["gpu"], reduction=reduction, mesh=target)
                if reduction != "stack" and _rejected(reduction, dt):
                    s.fails("DTYPE_MISMATCH", cmd, "Reduce")
                    continue
                res = s.run(cmd).tensors[0]
                assert res.mesh == target
                back = "float32" if dt in FLOATS else ("bool" if dt == "bool" else "int64")
                got = fetch(s, s.op("to", Ref(res.ref), DT(back))[0].ref)
                if reduction == "stack":
                    want = X.astype(np.float32) if dt in FLOATS else (
                        X != 0 if dt == "bool" else X.astype(np.dtype(dt)).astype(np.int64))
                elif dt in FLOATS:
                    want = _np_reduce(reduction, X, dt).astype(np.float32)
                elif dt == "bool":
                    want = _np_reduce(reduction, X, dt)
                else:
                    want = _np_reduce(reduction, X, dt).astype(np.int64)
                what = f"{reduction} {dt} x{count} onto gpu={root} of {n}"
                assert got.shape == want.shape, f"{what}: shape {got.shape}, want {want.shape}"
                if dt in FLOATS:
                    np.testing.assert_allclose(got, want, rtol=1e-2, err_msg=what)
                else:
                    np.testing.assert_array_equal(got, want, err_msg=what)


def test_to_mesh_broadcast_where_a_destination_is_another_chains_source(shared_meshd):
    """Source ranks {1, 2} (x = 0, 1) to the 8 ranks of (x=2, y=4): rank 2 is a destination
    of rank 1's chain and the source of its own chain; rank 1 is a destination of itself.
    Also onto a side stream, and from the source mesh onto itself."""
    from meshd_testlib import to_mesh
    srv = shared_meshd(8)
    with Session(srv.port, "bcast-overlap") as s:
        _need_data_plane(s)
        line = s.mesh(x=8).ref
        X = np.arange(8 * 5, dtype=np.float32).reshape(8, 5)
        xl = upload(s, line, X, per_rank=True)
        src = s.slice(line, x=slice(1, 3)).ref
        part = s.run(to_mesh(s.new_ref(), xl, src, selection={"x": slice(1, 3)})).tensors[0].ref
        grid = s.mesh(x=2, y=4).ref
        side = s.stream("side")
        for stream in (0, side):
            r = s.run(to_mesh(s.new_ref(), part, grid, dst_stream=stream)).tensors[0].ref
            for x in range(2):
                for y in range(4):
                    np.testing.assert_array_equal(fetch(s, r, x=x, y=y), X[1 + x],
                                                  err_msg=f"stream {stream} ({x},{y})")
            same = s.run(to_mesh(s.new_ref(), part, src, dst_stream=stream)).tensors[0].ref
            for x in range(2):
                np.testing.assert_array_equal(fetch(s, same, x=x), X[1 + x])
