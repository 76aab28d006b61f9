"""The compute matrix, end to end through the real server and 1, 2, 4 and 8 cpu agents:
every catalogue op against numpy, every reduce variant x reduction x dtype, to_mesh with
and without broadcast, borrows across streams, run-time failures, and data-plane sizes.

numpy is the reference; torch semantics (type promotion, defaults) where they differ."""

import glob
import math
import os
import re
import time

import numpy as np
import pytest

import meshd_testlib as lib
from meshd_testlib import (CommandError, DT, Ref, Refs, Session, borrow, drop_borrow, factory,
                           reduce, sync, to_mesh)
from test_compute import FetchError, fetch, upload, data_plane

# ================================================================ the op catalogue

_SCHEMA = re.compile(r'OP\(\s*"([a-z_0-9]+)\(')


def catalogue_ops():
    """Op names of every schema string in core/tensor/ops*.c (the table of ops_at)."""
    names = set()
    for path in glob.glob(os.path.join(lib.SOURCE_DIR, "core", "tensor", "ops*.c")):
        with open(path) as f:
            names |= set(_SCHEMA.findall(f.read()))
    return names


FACTORY_OPS = {"empty", "zeros", "ones", "full", "arange", "rand", "randn", "rank"}

rng = np.random.default_rng(42)
A = rng.standard_normal((3, 4)).astype(np.float32)
B = rng.standard_normal((3, 4)).astype(np.float32)
POS = (rng.random((3, 4)) + 0.5).astype(np.float32)
ROW = rng.standard_normal(4).astype(np.float32)
AI = rng.integers(-20, 20, (3, 4)).astype(np.int32)
BI = rng.integers(1, 20, (3, 4)).astype(np.int32)
MASK = rng.random((3, 4)) > 0.5
MASK2 = rng.random((3, 4)) > 0.5
M3 = rng.standard_normal((2, 3, 4)).astype(np.float32)
N3 = rng.standard_normal((2, 4, 5)).astype(np.float32)
C45 = rng.standard_normal((4, 5)).astype(np.float32)
IDX = np.array([2, 0, 2], np.int64)
GIDX = rng.integers(0, 4, (3, 2)).astype(np.int64)

_erf = np.vectorize(math.erf)


def gelu(x):
    return (0.5 * x * (1 + _erf(x / np.sqrt(2.0)))).astype(np.float32)


def softmax(x, d):
    e = np.exp(x - x.max(d, keepdims=True))
    return e / e.sum(d, keepdims=True)


class Ctx:
    """One session on a {gpu: 2} mesh with the inputs uploaded once."""

    def __init__(self, s):
        self.s = s
        self.m = s.mesh(gpu=2).ref
        self.r = {}
        for name, arr in dict(A=A, B=B, POS=POS, ROW=ROW, AI=AI, BI=BI, MASK=MASK, MASK2=MASK2,
                              M3=M3, N3=N3, C45=C45, IDX=IDX, GIDX=GIDX).items():
            self.r[name] = Ref(upload(s, self.m, arr))

    def __getattr__(self, k):
        r = self.__dict__.get("r", {})
        if k in r:
            return r[k]
        raise AttributeError(k)

    def op(self, name, *args, nresults=1, **kw):
        return [t.ref for t in self.s.op(name, *args, nresults=nresults, **kw)]

    def fresh(self, arr):
        return Ref(upload(self.s, self.m, arr))


# Each case: (op, label, fn(ctx) -> [(ref, expected)]).
CASES = []


def case(opname, label=""):
    def deco(fn):
        CASES.append((opname, label or opname, fn))
        return fn
    return deco


def one(c, opname, want, *args, **kw):
    return [(c.op(opname, *args, **kw)[0], want)]


def _binary(opname, f, scalar=2.0, ints=True):
    @case(opname, opname + "-tensor")
    def _t(c):
        return one(c, opname, f(A, B), c.A, c.B)

    @case(opname, opname + "-broadcast-scalar")
    def _b(c):
        out = one(c, opname, f(A, ROW), c.A, c.ROW)
        if scalar is not None:
            out += one(c, opname, f(A, np.float32(scalar)), c.A, scalar)
        return out

    if ints:
        @case(opname, opname + "-int32")
        def _i(c):
            return one(c, opname, f(AI, BI), c.AI, c.BI)


_binary("add", lambda x, y: x + y)
_binary("sub", lambda x, y: x - y)
_binary("mul", lambda x, y: x * y)
_binary("maximum", np.maximum, scalar=None)
_binary("minimum", np.minimum, scalar=None)
for _n, _f in (("eq", np.equal), ("ne", np.not_equal), ("lt", np.less), ("le", np.less_equal),
               ("gt", np.greater), ("ge", np.greater_equal)):
    _binary(_n, _f, scalar=0.0)


@case("eq", "compare-inexact-scalar")
def _compare_inexact(c):
    # numpy (and torch) cast 0.1 to the tensor's float32 / float16 before comparing
    x = np.array([0.1, 0.2, 0.3], np.float32)
    r = c.fresh(x)
    h = Ref(c.op("to", r, DT("float16"))[0])
    xh = x.astype(np.float16)
    return (one(c, "eq", x == 0.1, r, 0.1) + one(c, "gt", x > 0.1, r, 0.1)
            + one(c, "le", x <= 0.2, r, 0.2) + one(c, "eq", xh == 0.1, h, 0.1)
            + one(c, "lt", xh < 0.3, h, 0.3))


@case("add", "add-alpha")
def _add_alpha(c):
    return one(c, "add", A + 3 * B, c.A, c.B, alpha=3) + \
        one(c, "sub", AI - 2 * BI, c.AI, c.BI, alpha=2)


@case("div")
def _div(c):
    return (one(c, "div", A / POS, c.A, c.POS) + one(c, "div", A / 4, c.A, 4.0)
            + one(c, "div", (AI / BI).astype(np.float32), c.AI, c.BI)
            + one(c, "div", np.floor_divide(AI, BI), c.AI, c.BI, rounding_mode="floor")
            + one(c, "div", np.trunc(AI / BI).astype(np.int32), c.AI, c.BI,
                  rounding_mode="trunc"))


@case("pow")
def _pow(c):
    return one(c, "pow", POS ** B, c.POS, c.B) + one(c, "pow", A ** 2, c.A, 2.0)


for _n, _f in (("logical_and", np.logical_and), ("logical_or", np.logical_or)):
    @case(_n)
    def _l(c, _n=_n, _f=_f):
        return one(c, _n, _f(MASK, MASK2), c.MASK, c.MASK2)

for _n, _f in (("bitwise_and", np.bitwise_and), ("bitwise_or", np.bitwise_or),
               ("bitwise_xor", np.bitwise_xor)):
    @case(_n)
    def _bw(c, _n=_n, _f=_f):
        return (one(c, _n, _f(AI, BI), c.AI, c.BI) + one(c, _n, _f(AI, np.int32(6)), c.AI, 6)
                + one(c, _n, _f(MASK, MASK2), c.MASK, c.MASK2))

_UNARY = {
    "neg": (np.negative, True), "abs": (np.abs, True), "exp": (np.exp, False),
    "log": (np.log, False), "sqrt": (np.sqrt, False), "rsqrt": (lambda x: 1 / np.sqrt(x), False),
    "sin": (np.sin, False), "cos": (np.cos, False), "tanh": (np.tanh, False),
    "sigmoid": (lambda x: 1 / (1 + np.exp(-x)), False), "reciprocal": (lambda x: 1 / x, False),
    "relu": (lambda x: np.maximum(x, 0).astype(x.dtype), True), "gelu": (gelu, None),
    "silu": (lambda x: x / (1 + np.exp(-x)), None), "sign": (np.sign, True),
}
for _n, (_f, _ints) in _UNARY.items():
    @case(_n)
    def _u(c, _n=_n, _f=_f, _ints=_ints):
        src, ref = (POS, c.POS) if _n in ("log", "sqrt", "rsqrt") else (A, c.A)
        out = one(c, _n, _f(src), ref)
        if _ints is True:
            out += one(c, _n, _f(AI), c.AI)
        elif _ints is False:  # ints promote to float32
            bi = BI.astype(np.float32)
            out += one(c, _n, _f(bi).astype(np.float32), c.BI)
        return out


@case("logical_not")
def _lnot(c):
    return one(c, "logical_not", ~MASK, c.MASK) + one(c, "logical_not", AI == 0, c.AI)


@case("sum")
def _sum(c):
    return (one(c, "sum", A.sum(), c.A) + one(c, "sum", A.sum(1), c.A, [1])
            + one(c, "sum", A.sum(0, keepdims=True), c.A, [0], True)
            + one(c, "sum", M3.sum((0, 2)), c.M3, [0, 2])
            + one(c, "sum", AI.sum(1).astype(np.int64), c.AI, [1]))


@case("sum", "sum-dtype-casts-first")
def _sum_dtype(c):
    # numpy and torch cast the input to dtype= before summing
    f = np.array([[0.5, -0.5], [0.0, 0.0]], np.float32)
    i = np.array([[2049, 1], [3, 5]], np.int64)
    h = Ref(c.op("sum", c.fresh(i), [1], dtype=DT("float16"))[0])
    return (one(c, "sum", f.sum(1, dtype=bool), c.fresh(f), [1], dtype=DT("bool"))
            + one(c, "sum", i.sum(dtype=bool), c.fresh(i * [[1, -1], [0, 0]]), dtype=DT("bool"))
            + one(c, "to", i.sum(1, dtype=np.float16).astype(np.float32), h, DT("float32")))


@case("mean")
def _mean(c):
    return one(c, "mean", A.mean(), c.A) + one(c, "mean", A.mean(1, keepdims=True), c.A, [1], True)


@case("prod")
def _prod(c):
    return (one(c, "prod", POS.prod(), c.POS) + one(c, "prod", POS.prod(0), c.POS, 0)
            + one(c, "prod", BI.prod(1, keepdims=True).astype(np.int64), c.BI, 1, True))


for _n, _f, _af in (("max", np.max, np.argmax), ("min", np.min, np.argmin)):
    @case(_n)
    def _mm(c, _n=_n, _f=_f, _af=_af):
        v, i = c.op(_n, c.A, 1, nresults=2)
        vi, ii = c.op(_n, c.AI, 0, True, nresults=2)
        return (one(c, _n, _f(A), c.A) + [(v, _f(A, 1)), (i, _af(A, 1).astype(np.int64))]
                + [(vi, _f(AI, 0, keepdims=True)), (ii, _af(AI, 0)[None].astype(np.int64))])

for _n, _f in (("amax", np.max), ("amin", np.min)):
    @case(_n)
    def _am(c, _n=_n, _f=_f):
        return (one(c, _n, _f(M3, (0, 2)), c.M3, [0, 2])
                + one(c, _n, _f(AI, 1, keepdims=True), c.AI, [1], True))

for _n, _f in (("argmax", np.argmax), ("argmin", np.argmin)):
    @case(_n)
    def _arg(c, _n=_n, _f=_f):
        return (one(c, _n, np.int64(_f(A)), c.A)
                + one(c, _n, _f(AI, 1).astype(np.int64), c.AI, 1))


@case("softmax")
def _softmax(c):
    return one(c, "softmax", softmax(A, 1), c.A, 1) + one(c, "softmax", softmax(M3, 0), c.M3, 0)


@case("log_softmax")
def _log_softmax(c):
    return one(c, "log_softmax", np.log(softmax(A, 1)), c.A, 1)


@case("matmul")
def _matmul(c):
    return (one(c, "matmul", A @ C45, c.A, c.C45) + one(c, "matmul", M3 @ N3, c.M3, c.N3)
            + one(c, "matmul", A @ ROW, c.A, c.ROW))


@case("mm")
def _mmul(c):
    return one(c, "mm", A @ C45, c.A, c.C45)


@case("bmm")
def _bmm(c):
    return one(c, "bmm", M3 @ N3, c.M3, c.N3)


def _view_case(opname, want, *args):
    @case(opname)
    def _v(c):
        v = c.op(opname, c.M3, *args)[0]
        return [(v, want), (c.op("contiguous", Ref(v))[0], want),
                (c.op("clone", Ref(v))[0], want)]


_view_case("view", M3.reshape(6, 4), [6, 4])
_view_case("reshape", M3.reshape(4, -1), [4, -1])
_view_case("transpose", M3.transpose(0, 2, 1), 1, 2)
_view_case("permute", M3.transpose(2, 0, 1), [2, 0, 1])
_view_case("select", M3[:, 1], 1, 1)
_view_case("narrow", M3[:, :, 1:3], 2, 1, 2)
_view_case("slice", M3[:, 0:3:2], 1, 0, 3, 2)
_view_case("unsqueeze", M3[:, None], 1)
_view_case("expand", np.broadcast_to(M3, (3, 2, 3, 4)), [3, -1, 3, 4])


@case("t")
def _t(c):
    v = c.op("t", c.A)[0]
    return [(v, A.T), (c.op("contiguous", Ref(v))[0], A.T)]


@case("squeeze")
def _squeeze(c):
    u = c.op("unsqueeze", c.A, 0)[0]
    return one(c, "squeeze", A, Ref(u)) + one(c, "squeeze", A, Ref(u), [0])


@case("clone")
def _clone(c):
    return one(c, "clone", AI, c.AI)


@case("contiguous")
def _contig(c):
    return one(c, "contiguous", A, c.A)


@case("cat")
def _cat(c):
    return (one(c, "cat", np.concatenate([A, B, A]), Refs([c.A, c.B, c.A]))
            + one(c, "cat", np.concatenate([A, B], 1), Refs([c.A, c.B]), 1))


@case("stack")
def _stack(c):
    return (one(c, "stack", np.stack([A, B]), Refs([c.A, c.B]))
            + one(c, "stack", np.stack([AI, BI], 2), Refs([c.AI, c.BI]), 2))


@case("to")
def _to(c):
    return (one(c, "to", AI.astype(np.float32), c.AI, DT("float32"))
            + one(c, "to", A.astype(np.float64), c.A, DT("float64"))
            + one(c, "to", A, c.A, DT("float32")))


@case("cast")
def _cast(c):
    return (one(c, "cast", np.trunc(A * 5).astype(np.int32), c.fresh(A * 5), DT("int32"))
            + one(c, "cast", AI != 0, c.AI, DT("bool"))
            + one(c, "cast", MASK.astype(np.int64), c.MASK, DT("int64")))


@case("index_select")
def _index_select(c):
    return (one(c, "index_select", A[:, IDX], c.A, 1, c.IDX)
            + one(c, "index_select", AI[IDX], c.AI, 0, c.IDX))


@case("gather")
def _gather(c):
    return one(c, "gather", np.take_along_axis(A, GIDX, 1), c.A, 1, c.GIDX)


@case("where")
def _where(c):
    return (one(c, "where", np.where(MASK, A, B), c.MASK, c.A, c.B)
            + one(c, "where", np.where(MASK, A, np.float32(0)), c.MASK, c.A, 0.0)
            + one(c, "where", np.where(MASK, AI, BI), c.MASK, c.AI, c.BI))


@case("clamp")
def _clamp(c):
    return (one(c, "clamp", np.clip(A, -0.5, 0.5), c.A, -0.5, 0.5)
            + one(c, "clamp", np.maximum(A, 0).astype(np.float32), c.A, min=0.0)
            + one(c, "clamp", np.clip(AI, -3, 4), c.AI, -3, 4)
            + one(c, "clamp", np.minimum(A, B), c.A, None, c.B))


def _inplace(opname, want, src, *args, **kw):
    @case(opname)
    def _ip(c):
        x = c.fresh(src)
        r = c.op(opname, x, *[getattr(c, a) if isinstance(a, str) else a for a in args], **kw)[0]
        return [(r, want), (int(x), want)]


_inplace("add_", A + 2 * B, A, "B", alpha=2)
_inplace("sub_", AI - 5, AI, 5)
_inplace("mul_", A * ROW, A, "ROW")
_inplace("div_", A / POS, A, "POS")
_inplace("copy_", B, A, "B")
_inplace("fill_", np.full_like(AI, 7), AI, 7)
_inplace("zero_", np.zeros_like(A), A)
_inplace("clamp_", np.clip(A, -0.25, 0.25), A, -0.25, 0.25)


def _factory_checks(s):
    """The Factory kinds, checked on a {gpu: 2} mesh."""
    m = s.mesh(gpu=2).ref
    out = []
    t = lambda *a, **k: s.run(factory(s.new_ref(), m, *a, **k)).tensors[0].ref  # noqa: E731
    out.append((t("zeros", (2, 3)), np.zeros((2, 3), np.float32)))
    out.append((t("ones", (4,), "int32"), np.ones(4, np.int32)))
    out.append((t("full", (2, 2), "float64", value=2.5), np.full((2, 2), 2.5)))
    out.append((t("arange", (), "int64", start=0, end=5, step=1), np.arange(5)))
    out.append((t("arange", (), start=1, end=2, step=0.25), np.arange(1, 2, 0.25, np.float32)))
    out.append((t("rank", (), dim="gpu"), "rank"))
    e = t("empty", (3, 2), "int32")
    return out, e


# ================================================================ fixtures

@pytest.fixture(scope="module")
def ctx(shared_meshd):
    srv = shared_meshd(2)
    with Session(srv.port, "matrix-ops") as s:
        yield Ctx(s)


def _need_data_plane(s):
    if lib.shares_one_gpu(2):
        pytest.skip(f"the agents share one GPU ({lib.DEVICE}): NCCL needs a GPU per rank")
    if not data_plane(s):
        pytest.skip("agents report no data_port (no cpu data plane)")


def _close(got, want, what):
    want = np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, numpy {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, numpy {want.dtype}"
    if want.dtype.kind == "f":
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


# ================================================================ (1) every op

def test_every_catalogue_op_has_a_case():
    have = {c[0] for c in CASES} | FACTORY_OPS
    cat = catalogue_ops()
    assert len(cat) > 50, f"found only {len(cat)} schemas in core/tensor/ops*.c: has the table moved?"
    assert not (cat - have), f"catalogue ops without a numpy case here: {sorted(cat - have)}"
    assert not (have - cat), f"cases for ops no longer in the catalogue: {sorted(have - cat)}"


@pytest.mark.parametrize("opname,label,fn", CASES, ids=[c[1] for c in CASES])
def test_op_against_numpy(ctx, opname, label, fn):
    pairs = fn(ctx)
    for i, (ref, want) in enumerate(pairs):
        for g in (0, 1):
            _close(fetch(ctx.s, ref, gpu=g), want, f"{label}[{i}] rank {g}")


def test_int64_to_float32_rounds_like_numpy(ctx):
    # exact: numpy rounds int64 -> float32 once; through double these landed on a tie
    x = np.array([2**60 + 2**36 + 1, 2**53 + 1, -(2**62 + 2**38 + 1), 7], np.int64)
    r = ctx.fresh(x)
    for op in ("to", "cast"):
        got = fetch(ctx.s, ctx.op(op, r, DT("float32"))[0], gpu=1)
        np.testing.assert_array_equal(got, x.astype(np.float32), err_msg=op)


def test_mixed_dtypes_compute_in_the_common_dtype(ctx):
    # torch casts every operand to the common dtype, then computes in it: int64 + float32
    # is float32(int64) + float32 (16777217 + 1 is 16777216 + 1, a tie: 16777216), a
    # uint8 tensor against an int takes the int wrapped into uint8 (300 is 44)
    f32 = np.float32
    i = np.array([16777217, 2**60 + 2**36 + 1], np.int64)
    f = np.array([1, 0], f32)
    ri, rf = ctx.fresh(i), ctx.fresh(f)
    for g in (0, 1):
        np.testing.assert_array_equal(fetch(ctx.s, ctx.op("add", ri, rf)[0], gpu=g),
                                      i.astype(f32) + f, err_msg=f"int64 + float32 rank {g}")
        np.testing.assert_array_equal(fetch(ctx.s, ctx.op("add", ri, 1.0)[0], gpu=g),
                                      i.astype(f32) + f32(1), err_msg=f"int64 + 1.0 rank {g}")
    u8 = np.array([100, 44, 200], np.uint8)
    u = Ref(ctx.op("to", ctx.fresh(u8.astype(np.int32)), DT("uint8"))[0])
    w = np.uint8(300 % 256)
    for name, want in (("lt", u8 < w), ("eq", u8 == w), ("gt", u8 > w)):
        got = fetch(ctx.s, ctx.op(name, u, 300)[0], gpu=1)
        np.testing.assert_array_equal(got, want, err_msg=f"uint8 {name} 300")
    q = ctx.op("div", u, 300, rounding_mode="floor")[0]
    got = fetch(ctx.s, ctx.op("to", Ref(q), DT("int32"))[0], gpu=0)
    np.testing.assert_array_equal(got, (u8 // w).astype(np.int32), err_msg="uint8 // 300")


def test_factories(ctx):
    pairs, empty = _factory_checks(ctx.s)
    for ref, want in pairs:
        for g in (0, 1):
            _close(fetch(ctx.s, ref, gpu=g), np.int64(g) if isinstance(want, str) else want,
                   f"factory ref {ref} rank {g}")
    got = fetch(ctx.s, empty, gpu=1)
    assert got.shape == (3, 2) and got.dtype == np.int32


# ================================================================ (2) reduce variants

REDUCTIONS = ["sum", "avg", "product", "min", "max", "band", "bor", "bxor"]
NP_RED = {"sum": lambda x: x.sum(0), "avg": lambda x: x.mean(0), "product": lambda x: x.prod(0),
          "min": lambda x: x.min(0), "max": lambda x: x.max(0),
          "band": lambda x: np.bitwise_and.reduce(x, 0), "bor": lambda x: np.bitwise_or.reduce(x, 0),
          "bxor": lambda x: np.bitwise_xor.reduce(x, 0)}


def _rejected(reduction, dt):
    return (reduction == "avg" and dt == "int32") or (reduction in ("band", "bor", "bxor")
                                                      and dt == "float32")


def _parts(n, dt, shape, seed=0):
    r = np.random.default_rng(seed)
    if dt == "float32":
        return r.integers(1, 4, (n,) + shape).astype(np.float32)  # exact under every reduction
    return r.integers(1, 16, (n,) + shape).astype(np.int32)


def _red(s, x, **kw):
    return s.run(reduce(s.new_ref() if not (kw.get("inplace") or kw.get("out")) else 0, x,
                        **kw)).tensors[0].ref


@pytest.mark.parametrize("dt", ["float32", "int32"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("n", [2, 4])
def test_reduce_variants(shared_meshd, n, reduction, dt):
    srv = shared_meshd(n)
    with Session(srv.port, "matrix-reduce") as s:
        _need_data_plane(s)
        m = s.mesh(gpu=n).ref
        X = _parts(n, dt, (n, 3))          # rank r holds X[r], shape (n, 3)
        x = upload(s, m, X, per_rank=True)
        if _rejected(reduction, dt):
            e = s.fails("DTYPE_MISMATCH", reduce(s.new_ref(), x, dims=["gpu"], reduction=reduction),
                        "Reduce")
            assert reduction in e.message
            return
        f = NP_RED[reduction]
        want_all = f(X).astype(X.dtype)
        allred = _red(s, x, dims=["gpu"], reduction=reduction)
        scat = _red(s, x, dims=["gpu"], reduction=reduction, scatter=True)
        out = s.tensor(m, (n, 3), "zeros", dt).ref
        s.run(reduce(0, x, dims=["gpu"], reduction=reduction, out=out))
        y = upload(s, m, X, per_rank=True)
        s.run(reduce(0, y, dims=["gpu"], reduction=reduction, inplace=True))
        for g in range(n):
            _close(fetch(s, allred, gpu=g), want_all, f"allreduce rank {g}")
            _close(fetch(s, scat, gpu=g), want_all[g], f"reducescatter rank {g}")
            _close(fetch(s, out, gpu=g), want_all, f"out= rank {g}")
            _close(fetch(s, y, gpu=g), want_all, f"reduce_ rank {g}")


@pytest.mark.parametrize("dt", ["float32", "int32"])
@pytest.mark.parametrize("n", [2, 4])
def test_allgather_and_alltoall(shared_meshd, n, dt):
    srv = shared_meshd(n)
    with Session(srv.port, "matrix-stack") as s:
        _need_data_plane(s)
        m = s.mesh(gpu=n).ref
        X = _parts(n, dt, (n, 3), seed=1)
        x = upload(s, m, X, per_rank=True)
        ag = _red(s, x, dims=["gpu"], reduction="stack")
        a2a = _red(s, x, dims=["gpu"], reduction="stack", scatter=True)
        for g in range(n):
            _close(fetch(s, ag, gpu=g), X, f"allgather rank {g}")
            _close(fetch(s, a2a, gpu=g), X[:, g], f"alltoall rank {g}")


@pytest.mark.parametrize("dt", ["float32", "int32"])
def test_reduce_over_a_2d_mesh(shared_meshd, dt):
    srv = shared_meshd(4)
    with Session(srv.port, "matrix-2d") as s:
        _need_data_plane(s)
        m = s.mesh(host=2, gpu=2).ref
        X = _parts(4, dt, (5,), seed=2)    # rank (h, g) holds X[2h + g]
        x = upload(s, m, X, per_rank=True)
        X2 = X.reshape(2, 2, 5)
        for reduction in REDUCTIONS:
            if _rejected(reduction, dt):
                continue
            f = NP_RED[reduction]
            both = _red(s, x, dims=["host", "gpu"], reduction=reduction)
            every = _red(s, x, reduction=reduction)  # dims () = all dims
            host = _red(s, x, dims=["host"], reduction=reduction)
            gpu = _red(s, x, dims=["gpu"], reduction=reduction)
            for h in range(2):
                for g in range(2):
                    w = f(X).astype(X.dtype)
                    _close(fetch(s, both, host=h, gpu=g), w, f"{reduction} both ({h},{g})")
                    _close(fetch(s, every, host=h, gpu=g), w, f"{reduction} all ({h},{g})")
                    _close(fetch(s, host, host=h, gpu=g), f(X2[:, g]).astype(X.dtype),
                           f"{reduction} over host ({h},{g})")
                    _close(fetch(s, gpu, host=h, gpu=g), f(X2[h]).astype(X.dtype),
                           f"{reduction} over gpu ({h},{g})")
        e = s.fails("BAD_DIM", reduce(s.new_ref(), x, reduction="stack"), "Reduce")
        assert "one" in e.message


def test_allreduce_on_8_agents(shared_meshd):
    srv = shared_meshd(8)
    with Session(srv.port, "matrix-8") as s:
        _need_data_plane(s)
        m = s.mesh(gpu=8).ref
        X = np.random.default_rng(3).standard_normal((8, 1000)).astype(np.float32)
        x = upload(s, m, X, per_rank=True)
        r = _red(s, x, dims=["gpu"], reduction="sum")
        mx = _red(s, x, dims=["gpu"], reduction="max")
        for g in range(8):
            np.testing.assert_allclose(fetch(s, r, gpu=g), X.sum(0), rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(fetch(s, mx, gpu=g), X.max(0))


# Reduce onto a sub-mesh (issue 16): Monarch's reduce(..., mesh=), NotImplemented there.
# Each case: (mesh dims, reduced dims, target selection); rank r holds X[r].
ROOTED_CASES = {
    2: [({"gpu": 2}, ["gpu"], {"gpu": 1})],
    4: [({"host": 2, "gpu": 2}, ["gpu"], {"gpu": 1}),
        ({"host": 2, "gpu": 2}, ["host", "gpu"], {"host": 1, "gpu": 0})],
    8: [({"gpu": 8}, ["gpu"], {"gpu": 5}),
        ({"host": 2, "gpu": 4}, ["host"], {"host": 1})],
}


def _agent_bytes(s):
    return {a.rank: a.allocated_bytes for a in s.unary("ListAgents", lib.tensor_pb2().ListAgentsRequest(),
                                                       lib.tensor_pb2().ListAgentsReply).agents}


@pytest.mark.parametrize("n", [2, 4, 8])
def test_reduce_onto_a_sub_mesh(shared_meshd, n):
    srv = shared_meshd(n)
    with Session(srv.port, "matrix-rooted") as s:
        _need_data_plane(s)
        for dims_, over, sel in ROOTED_CASES[n]:
            m = s.mesh(**dims_).ref
            target = s.slice(m, **sel).ref
            names, sizes = list(dims_), list(dims_.values())
            kept = [d for d in names if d not in over]
            for dt in ("float32", "int32"):
                X = _parts(n, dt, (3,), seed=n)
                x = upload(s, m, X, per_rank=True)
                Xn = X.reshape(sizes + [3])
                axes = tuple(names.index(d) for d in over)
                for reduction in REDUCTIONS + ["stack"]:
                    cmd = reduce(s.new_ref(), x, dims=over, reduction=reduction, mesh=target)
                    if _rejected(reduction, dt):
                        s.fails("DTYPE_MISMATCH", cmd, "Reduce")
                        continue
                    if reduction == "stack":
                        if len(over) > 1:
                            s.fails("BAD_DIM", cmd, "Reduce")
                            continue
                        want = np.moveaxis(Xn, axes[0], len(kept))  # kept dims, then the group
                    else:
                        # the group's members in row-major order over the reduced dims
                        g = np.moveaxis(Xn, axes, tuple(range(len(kept), len(names))))
                        g = g.reshape([dims_[d] for d in kept] + [-1, 3])
                        want = _reduce_groups(NP_RED[reduction], g)
                    res = s.run(cmd).tensors[0]
                    assert res.mesh == target, f"{reduction}: the result is on mesh {res.mesh}"
                    for idx in np.ndindex(*[dims_[d] for d in kept]):
                        coords = dict(zip(kept, idx))
                        _close(fetch(s, res.ref, **coords), want[idx].astype(X.dtype),
                               f"{reduction} {dt} over {over} onto {sel} at {coords}")
            # out= on the target
            X = _parts(n, "float32", (3,), seed=7)
            x = upload(s, m, X, per_rank=True)
            out = s.tensor(target, (3,), "zeros", "float32").ref
            s.run(reduce(0, x, dims=over, reduction="sum", out=out, mesh=target))
            Xn = X.reshape(sizes + [3])
            want = Xn.sum(tuple(names.index(d) for d in over))
            for idx in np.ndindex(*[dims_[d] for d in kept]):
                _close(fetch(s, out, **dict(zip(kept, idx))), want[idx], f"out= onto {sel}")


def _reduce_groups(f, g):
    """f over axis -2 of g (..., members, 3), keeping the leading axes."""
    lead = g.shape[:-2]
    flat = g.reshape((-1,) + g.shape[-2:])
    return np.stack([f(part) for part in flat]).reshape(lead + (g.shape[-1],))


def test_reduce_onto_a_sub_mesh_keeps_nothing_elsewhere_and_checks_the_target(shared_meshd):
    srv = shared_meshd(4)
    with Session(srv.port, "matrix-rooted-checks") as s:
        _need_data_plane(s)
        m = s.mesh(host=2, gpu=2).ref
        x = s.tensor(m, (1 << 18,), "ones", "float32").ref  # 1 MiB per rank
        s.run(sync())
        before = _agent_bytes(s)
        t1 = s.slice(m, gpu=1).ref
        r = s.run(reduce(s.new_ref(), x, dims=["gpu"], mesh=t1)).tensors[0].ref
        s.run(sync())
        roots = {1, 3}  # (host, gpu=1)
        deadline = time.monotonic() + 10
        while True:
            grew = {k: v - before[k] for k, v in _agent_bytes(s).items()}
            if all(grew[k] >= 1 << 20 for k in roots) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for k in range(4):
            if k in roots:
                assert grew[k] >= 1 << 20, f"root rank {k} grew by {grew[k]} bytes"
            else:
                assert grew[k] == 0, f"rank {k}, outside the target, keeps {grew[k]} bytes"
        np.testing.assert_array_equal(fetch(s, r, host=1), np.full(1 << 18, 2, np.float32))
        with pytest.raises(FetchError) as fe:
            fetch(s, r, host=1, gpu=0)  # the result has no gpu dim
        assert "gpu" in fe.value.args[-1], fe.value.args
        # The target's checks, each naming what is wrong.
        h0 = s.slice(m, host=0).ref
        e = s.fails("BAD_ARGUMENT", reduce(s.new_ref(), x, dims=["gpu"], mesh=h0), "Reduce")
        assert "still has the reduced dim 'gpu'" in e.message, e.message
        pair = s.mesh(pair=2).ref
        e = s.fails("WRONG_MESH", reduce(s.new_ref(), x, dims=["gpu"], mesh=pair), "Reduce")
        assert "same reduced group" in e.message, e.message
        one = s.slice(m, host=0, gpu=0).ref
        e = s.fails("WRONG_MESH", reduce(s.new_ref(), x, dims=["gpu"], mesh=one), "Reduce")
        assert "1 rank(s)" in e.message and "2 group(s)" in e.message, e.message
        y = s.tensor(h0, (4,), "ones", "float32").ref
        elsewhere = s.slice(m, host=1, gpu=0).ref
        e = s.fails("WRONG_MESH", reduce(s.new_ref(), y, dims=["gpu"], mesh=elsewhere), "Reduce")
        assert "not a sub-mesh" in e.message and "rank 2" in e.message, e.message
        e = s.fails("BAD_ARGUMENT", reduce(s.new_ref(), x, dims=["gpu"], scatter=True, mesh=t1),
                    "Reduce")
        assert "scatter" in e.message
        e = s.fails("BAD_ARGUMENT", reduce(0, x, dims=["gpu"], inplace=True, mesh=t1), "Reduce")
        assert "in place" in e.message
        wrong_out = s.tensor(m, (1 << 18,), "zeros", "float32").ref
        e = s.fails("WRONG_MESH", reduce(0, x, dims=["gpu"], out=wrong_out, mesh=t1), "Reduce")
        assert "out" in e.message
        e = s.fails("UNKNOWN_REF", reduce(s.new_ref(), x, dims=["gpu"], mesh=x), "Reduce")
        assert "which is a tensor, not a mesh" in e.message, e.message
        # nothing already stored was lost
        np.testing.assert_array_equal(fetch(s, r, host=0), np.full(1 << 18, 2, np.float32))


# ================================================================ (3) to_mesh

def test_to_mesh_with_and_without_broadcast(shared_meshd):
    srv = shared_meshd(4)
    with Session(srv.port, "matrix-tomesh") as s:
        _need_data_plane(s)
        root = s.mesh(host=2, gpu=2).ref
        X = np.arange(4 * 6, dtype=np.float32).reshape(4, 2, 3)
        x = upload(s, root, X, per_rank=True)
        h0, h1 = s.slice(root, host=0).ref, s.slice(root, host=1).ref
        # without broadcast: host 1 -> host 0, rank by rank
        r = s.run(to_mesh(s.new_ref(), x, h0, selection={"host": 1})).tensors[0].ref
        for g in range(2):
            _close(fetch(s, r, gpu=g), X[2 + g], f"host1->host0 gpu {g}")
        # with broadcast: one gpu of host 0 -> every rank of host 1 and of the root
        y = s.run(to_mesh(s.new_ref(), x, h1, selection={"host": 0, "gpu": 1})).tensors[0].ref
        z = s.run(to_mesh(s.new_ref(), x, root, selection={"host": 1, "gpu": 0})).tensors[0].ref
        for g in range(2):
            _close(fetch(s, y, gpu=g), X[1], f"broadcast to host1 gpu {g}")
        for h in range(2):
            for g in range(2):
                _close(fetch(s, z, host=h, gpu=g), X[2], f"broadcast to root ({h},{g})")
        # int dtype, over a whole dim: host 0's gpus -> host 1's gpus
        xi = upload(s, root, X.astype(np.int32), per_rank=True)
        ri = s.run(to_mesh(s.new_ref(), xi, h1, selection={"host": 0})).tensors[0].ref
        for g in range(2):
            _close(fetch(s, ri, gpu=g), X[g].astype(np.int32), f"int32 host0->host1 gpu {g}")


def test_to_mesh_broadcast_down_a_chain_on_8_agents(shared_meshd):
    """One source to many destinations runs as a chain (BroadcastOp): every destination
    gets the bytes (2 MiB: many frames in flight along the chain), and a failed source
    fails every destination's copy, which Sync reports once."""
    srv = shared_meshd(8)
    with Session(srv.port, "matrix-chain") as s:
        _need_data_plane(s)
        m = s.mesh(gpu=8).ref
        X = np.random.default_rng(8).standard_normal((8, 1 << 19)).astype(np.float32)
        x = upload(s, m, X, per_rank=True)
        here = s.run(to_mesh(s.new_ref(), x, m, selection={"gpu": 3})).tensors[0].ref
        two = s.mesh(host=2, gpu=4).ref  # the same 8 ranks: 7 of them down a chain, one local
        both = s.run(to_mesh(s.new_ref(), x, two, selection={"gpu": 0})).tensors[0].ref
        for g in range(8):
            np.testing.assert_array_equal(fetch(s, here, gpu=g), X[3], err_msg=f"gpu {g}")
            np.testing.assert_array_equal(fetch(s, both, host=g // 4, gpu=g % 4), X[0],
                                          err_msg=f"({g // 4},{g % 4})")
        s.run(sync())
        gi = upload(s, m, np.array([[7]], np.int64))
        small = upload(s, m, np.zeros((8, 1, 4), np.float32), per_rank=True)
        bad = s.op("gather", Ref(small), 1, Ref(gi))[0].ref  # index 7 of 4: fails everywhere
        copies = s.run(to_mesh(s.new_ref(), bad, m, selection={"gpu": 5})).tensors[0].ref
        errs = s.run(sync()).errors
        assert len(errs) == 1 and "gather" in errs[0].message, errs
        for g in (0, 5, 7):
            with pytest.raises(FetchError) as e:
                fetch(s, copies, gpu=g)
            assert e.value.kind in ("DEPENDENT_FAILURE", "REMOTE_FAILURE"), e.value
        np.testing.assert_array_equal(fetch(s, here, gpu=6), X[3])  # nothing stored was lost


def nccl_host_of_its_own(rank):
    """An agent's environment that makes it a host of its own to NCCL. NCCL refuses two
    ranks on one GPU of one host ("Duplicate GPU detected"), and tells hosts apart by a
    hash of NCCL_HOSTID when set: agents sharing the one GPU of a test machine then join
    one communicator as separate hosts, over NCCL's socket transport on loopback (no
    InfiniBand probe, no multi-node NVLink: the two hosts are one GPU)."""
    return {"NCCL_HOSTID": f"meshd-test-agent-{rank}", "NCCL_SOCKET_IFNAME": "lo",
            "NCCL_IB_DISABLE": "1", "NCCL_MNNVL_ENABLE": "0"}


def test_nccl_paths_with_agents_sharing_one_gpu(meshd_server, agent):
    """Issue 16's NCCL paths, for a machine with one GPU (tests/gpu/run.sh), where the
    shared servers' agents skip every collective: all-reduce (native, and gathered where
    NCCL has no op), reduce-scatter, allgather, alltoall, reduce onto a sub-mesh whose
    root is member 1 (ncclReduce's root is the communicator's rank; the fallback gathers
    to it), the rooted gather (stack), and to_mesh with broadcast (ncclBroadcast: a chain
    needs two destinations besides the source, hence three agents) and without
    (send/recv). cuda:emulated runs the same calls on the data plane (a check of this
    test); the cpu agents' are the shared-server tests'."""
    if lib.DEVICE in ("cpu", "cuda"):
        pytest.skip("the shared-server tests cover these (no GPU shared by the agents)")
    n = 3
    srv = meshd_server(0, min_agents=n)
    for r in range(n):
        # a communicator NCCL cannot make fails its call well inside a Fetch's 30 s
        agent(srv.port, "--comm-timeout-ms", "15000", rank=r, env=nccl_host_of_its_own(r))
    lib.wait_ready(srv, n)
    with Session(srv.port, "matrix-nccl") as s:
        if not data_plane(s):
            pytest.skip("agents report no data_port (no data plane)")
        m = s.mesh(gpu=n).ref
        one = s.slice(m, gpu=1).ref
        for dt in ("float32", "int32"):
            X = _parts(n, dt, (n, 2), seed=16)  # rank r holds X[r]
            x = upload(s, m, X, per_rank=True)
            for reduction in ("sum", "max", "bor" if dt == "int32" else "avg"):
                want = NP_RED[reduction](X).astype(X.dtype)
                what = f"{reduction} {dt}"
                allred = _red(s, x, dims=["gpu"], reduction=reduction)
                scat = _red(s, x, dims=["gpu"], reduction=reduction, scatter=True)
                rooted = s.run(reduce(s.new_ref(), x, dims=["gpu"], reduction=reduction,
                                      mesh=one)).tensors[0].ref
                for g in range(n):
                    _close(fetch(s, allred, gpu=g), want, f"allreduce {what} rank {g}")
                    _close(fetch(s, scat, gpu=g), want[g], f"reduce_scatter {what} rank {g}")
                _close(fetch(s, rooted), want, f"reduce {what} onto rank 1")
            ag = _red(s, x, dims=["gpu"], reduction="stack")
            a2a = _red(s, x, dims=["gpu"], reduction="stack", scatter=True)
            gathered = s.run(reduce(s.new_ref(), x, dims=["gpu"], reduction="stack",
                                    mesh=one)).tensors[0].ref
            for g in range(n):
                _close(fetch(s, ag, gpu=g), X, f"allgather {dt} rank {g}")
                _close(fetch(s, a2a, gpu=g), X[:, g], f"alltoall {dt} rank {g}")
            _close(fetch(s, gathered), X, f"gather {dt} onto rank 1")
            zero = s.slice(m, gpu=0).ref
            moved = s.run(to_mesh(s.new_ref(), x, zero, selection={"gpu": 1})).tensors[0].ref
            spread = s.run(to_mesh(s.new_ref(), x, m, selection={"gpu": 1})).tensors[0].ref
            _close(fetch(s, moved), X[1], f"to_mesh {dt} rank 1 -> rank 0")
            for g in range(n):
                _close(fetch(s, spread, gpu=g), X[1], f"to_mesh {dt} broadcast rank {g}")
        assert not s.run(sync()).errors


# ================================================================ (4) borrows, streams

def test_borrow_on_a_side_stream_with_concurrent_main(s2m):
    s = s2m
    m = s.mesh(gpu=2).ref
    side = s.stream("side")
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    x = upload(s, m, a)
    h, b = s.new_ref(), s.new_ref()
    s.run(borrow(h, x, side, False, b))
    acc = Ref(x)
    side_res, main_res = Ref(h), Ref(x)
    for _ in range(20):  # interleave work on both streams
        side_res = Ref(s.op("mul", side_res, 1.5, stream=side)[0].ref)
        main_res = Ref(s.op("add", main_res, 1.0)[0].ref)
    s.run(drop_borrow(b))
    after = s.op("add_", acc, 100.0)[0].ref   # the origin is writable again
    for g in range(2):
        np.testing.assert_allclose(fetch(s, side_res, gpu=g), a * 1.5 ** 20, rtol=1e-5)
        np.testing.assert_allclose(fetch(s, main_res, gpu=g), a + 20, rtol=1e-6)
        np.testing.assert_allclose(fetch(s, after, gpu=g), a + 100, rtol=1e-6)


def test_mutable_borrow_written_on_side_is_seen_on_main(s2m):
    s = s2m
    m = s.mesh(gpu=2).ref
    side = s.stream("side-mut")
    a = np.arange(8, dtype=np.int32)
    x = upload(s, m, a)
    h, b = s.new_ref(), s.new_ref()
    s.run(borrow(h, x, side, True, b))
    for _ in range(10):
        s.op("add_", Ref(h), 3, stream=side, nresults=0)
    s.op("mul_", Ref(h), 2, stream=side, nresults=0)
    s.run(drop_borrow(b))
    r = s.op("add", Ref(x), 1)[0].ref
    for g in range(2):
        np.testing.assert_array_equal(fetch(s, x, gpu=g), (a + 30) * 2)
        np.testing.assert_array_equal(fetch(s, r, gpu=g), (a + 30) * 2 + 1)


# ================================================================ (5) errors

@pytest.fixture
def s2m(shared_meshd):
    srv = shared_meshd(2)
    with Session(srv.port, "matrix") as s:
        yield s


def test_failing_ops_remote_failure_sync_and_dependents(s2m):
    s = s2m
    m = s.mesh(gpu=2).ref
    x = upload(s, m, np.arange(12, dtype=np.float32).reshape(3, 4))
    gi = upload(s, m, np.array([[0, 9]], np.int64))
    bad = s.op("gather", Ref(x), 1, Ref(gi))[0].ref
    dep = s.op("mul", Ref(bad), 2.0)[0].ref
    dep2 = s.op("sum", Ref(dep))[0].ref
    ok = s.op("sum", Ref(x))[0].ref
    res = s.run(sync())
    kinds = [lib.kind_name(e.kind) for e in res.errors]
    assert kinds and set(kinds) == {"REMOTE_FAILURE"}, res
    assert all("gather" in e.message and "out of range" in e.message for e in res.errors), res
    assert list(s.run(sync()).errors) == [], "reported by one Sync only"
    with pytest.raises(FetchError) as e:
        fetch(s, bad, gpu=1)
    assert e.value.kind == "REMOTE_FAILURE"
    for d in (dep, dep2):
        with pytest.raises(FetchError) as e:
            fetch(s, d, gpu=0)
        assert e.value.kind == "DEPENDENT_FAILURE", e.value
    assert fetch(s, ok, gpu=0) == np.float32(66)
    # a failed input to a collective: the collective still completes, its result fails
    if data_plane(s) and not lib.shares_one_gpu(2):
        r = _red(s, bad, dims=["gpu"], reduction="sum")
        with pytest.raises(FetchError) as e:
            fetch(s, r, gpu=0)
        assert e.value.kind in ("DEPENDENT_FAILURE", "REMOTE_FAILURE"), e.value
        good = _red(s, x, dims=["gpu"], reduction="sum")
        np.testing.assert_array_equal(fetch(s, good, gpu=1),
                                      2 * np.arange(12, dtype=np.float32).reshape(3, 4))
        # onto a sub-mesh, with the input failed only off the target (rank gpu=1):
        # the root's result fails too, and Sync tells only the gather's failure
        s.run(sync())
        gi2 = upload(s, m, np.array([[[0, 1]], [[0, 9]]], np.int64), per_rank=True)
        half = s.op("gather", Ref(x), 1, Ref(gi2))[0].ref
        root = s.slice(m, gpu=0).ref
        onto = s.run(reduce(s.new_ref(), half, dims=["gpu"], mesh=root)).tensors[0].ref
        errs = s.run(sync()).errors
        assert len(errs) == 1 and "gather" in errs[0].message and "rank 1" in errs[0].message, errs
        with pytest.raises(FetchError) as e:
            fetch(s, onto)
        assert e.value.kind in ("DEPENDENT_FAILURE", "REMOTE_FAILURE"), e.value
        assert "index 9 is out of range" in str(e.value), e.value
        np.testing.assert_array_equal(fetch(s, x, gpu=1), np.arange(12, dtype=np.float32)
                                      .reshape(3, 4))


def test_allocation_over_the_agents_limit(meshd_server, agent):
    srv = meshd_server(0, min_agents=1)
    agent(srv.port, "--memory-bytes", str(1 << 20))
    lib.wait_ready(srv, 1)
    with Session(srv.port, "matrix-oom") as s:
        m = s.mesh(gpu=1).ref
        try:
            big = s.tensor(m, (1 << 20,), "zeros").ref  # 4 MiB on a 1 MiB agent
        except CommandError as e:
            assert e.kind == "QUOTA", e     # rejected up front
        else:
            with pytest.raises(FetchError) as e:
                fetch(s, big, gpu=0)
            assert e.value.kind in ("QUOTA", "REMOTE_FAILURE"), e.value
            assert re.search(r"allocate|memory|capacity|quota", e.value.message, re.I), e.value
        small = s.tensor(m, (16,), "ones").ref
        np.testing.assert_array_equal(fetch(s, small, gpu=0), np.ones(16, np.float32))
        y = s.op("add", Ref(small), 1.0)[0].ref
        np.testing.assert_array_equal(fetch(s, y, gpu=0), np.full(16, 2, np.float32))


# ================================================================ (6) data-plane sizes

SIZES = [0, 1, 1009, (4 << 20) // 4 + 3]


@pytest.mark.parametrize("size", SIZES, ids=["0", "1", "prime", "4MiB+3"])
def test_data_plane_sizes(s2m, size):
    s = s2m
    _need_data_plane(s)
    root = s.mesh(gpu=2).ref
    r = np.random.default_rng(size)
    X = r.integers(-100, 100, (2, size)).astype(np.float32)
    x = upload(s, root, X, per_rank=True, chunk=1 << 20)
    red = _red(s, x, dims=["gpu"], reduction="sum")
    dst = s.slice(root, gpu=slice(1, 2)).ref
    moved = s.run(to_mesh(s.new_ref(), x, dst, selection={"gpu": slice(0, 1)})).tensors[0].ref
    for g in range(2):
        got = fetch(s, red, gpu=g)
        assert got.shape == (size,)
        np.testing.assert_array_equal(got, X.sum(0))
    np.testing.assert_array_equal(fetch(s, moved, gpu=0), X[0])


def _both_ranks_fail(s):
    """A gather that fails on both ranks of a {gpu: 2} mesh; returns its command seq."""
    m = s.mesh(gpu=2).ref
    for i in range(4):           # commands that never reach an agent: the client seq runs ahead
        s.stream(f"pad{i}")
    x = upload(s, m, np.arange(12, dtype=np.float32).reshape(3, 4))
    gi = upload(s, m, np.array([[0, 9]], np.int64))
    ref = s.new_ref()
    seq = s.next_seq()
    s.execute_raw(s.command(lib.call("gather", Ref(x), 1, Ref(gi), results=[ref]), seq))
    return seq, list(s.run(sync()).errors)


def test_a_root_failure_on_every_rank_is_reported_once(s2m):
    _, errs = _both_ranks_fail(s2m)
    assert len(errs) == 1, [(e.seq, e.message) for e in errs]


def test_a_remote_failure_names_the_client_seq_of_the_command(s2m):
    s = s2m
    seq, errs = _both_ranks_fail(s)
    assert errs and all(e.seq == seq for e in errs), (seq, [(e.seq, e.message) for e in errs])
    ref = s._ref  # the gather's result
    t = s.run(lib.describe(ref)).tensors[0]
    assert t.error.seq == seq, t


def test_a_remote_failure_message_names_its_rank_once(s2m):
    _, errs = _both_ranks_fail(s2m)
    assert errs
    for e in errs:
        ranks = re.findall(r"\(rank (\d+)\)", e.message)
        assert len(ranks) == 1 and ranks[0] in ("0", "1"), e.message


def test_integer_division_by_zero_fails_on_the_agent(s2m):
    s = s2m
    m = s.mesh(gpu=2).ref
    a = upload(s, m, np.array([4, 5, 6], np.int32))
    z = upload(s, m, np.array([1, 0, 2], np.int32))
    bad = s.op("div", Ref(a), Ref(z), rounding_mode="floor")[0].ref
    ok = s.op("div", Ref(a), Ref(z))[0].ref  # true division: inf, not an error
    with pytest.raises(FetchError) as e:
        fetch(s, bad, gpu=0)
    assert e.value.kind == "REMOTE_FAILURE" and "division by zero" in e.value.message, e.value
    got = fetch(s, ok, gpu=1)
    assert got[0] == 4 and np.isinf(got[1]) and got[2] == 3
    assert [lib.kind_name(x.kind) for x in s.run(sync()).errors] == ["REMOTE_FAILURE"]


def test_one_agent(shared_meshd):
    srv = shared_meshd(1)
    with Session(srv.port, "matrix-1") as s:
        m = s.mesh(gpu=1).ref
        a = np.arange(6, dtype=np.float32).reshape(2, 3)
        x = upload(s, m, a)
        y = s.op("matmul", Ref(x), Ref(s.op("t", Ref(x))[0].ref))[0].ref
        r = _red(s, x, dims=["gpu"], reduction="max")
        g = _red(s, x, dims=["gpu"], reduction="stack")
        sc = _red(s, upload(s, m, a[:1]), dims=["gpu"], reduction="sum", scatter=True)
        t = s.run(to_mesh(s.new_ref(), x, m)).tensors[0].ref
        _close(fetch(s, y, gpu=0), a @ a.T, "matmul")
        _close(fetch(s, r, gpu=0), a, "allreduce of one")
        _close(fetch(s, g, gpu=0), a[None], "allgather of one")
        _close(fetch(s, sc, gpu=0), a[0], "reducescatter of one")
        _close(fetch(s, t, gpu=0), a, "to_mesh")


def test_cast_out_of_range_is_defined_and_harmless(s2m):
    """Like torch, a float -> int cast of NaN, +-inf or a huge value is not an error; its
    value is unspecified, but the agent must neither fail nor trip a sanitizer (checked
    at teardown) and must serve the next command."""
    s = s2m
    m = s.mesh(gpu=2).ref
    x = upload(s, m, np.array([np.nan, np.inf, -np.inf, 1e20, -1e20, 3.7, -2.5], np.float32))
    for dt, npdt in (("int32", np.int32), ("int64", np.int64),
                     ("bool", np.bool_)):
        r = s.op("cast", Ref(x), DT(dt))[0].ref
        got = fetch(s, r, gpu=1)
        assert got.dtype == npdt and got.shape == (7,)
        if dt != "bool":
            assert list(got[5:]) == [3, -2], (dt, got)
        else:
            assert got.all(), got  # every value is non-zero (NaN included, as in torch)
    assert list(s.run(sync()).errors) == []


def test_clamp_wraps_an_int_bound_into_a_narrow_int_tensor(ctx):
    # torch: clamp(uint8, min=-5) converts -5 to uint8 (Scalar::to<uint8_t>, two's
    # complement: 251), as the comparisons wrap 300 into 44; clamping in int64 left
    # the tensor as it was
    u8 = np.array([100, 44, 200], np.uint8)
    u = Ref(ctx.op("to", ctx.fresh(u8.astype(np.int32)), DT("uint8"))[0])
    def as_i32(ref, g):
        return fetch(ctx.s, ctx.op("to", Ref(ref), DT("int32"))[0], gpu=g)
    np.testing.assert_array_equal(as_i32(ctx.op("clamp", u, -5)[0], 1), [251, 251, 251],
                                  err_msg="uint8 clamp min=-5")
    np.testing.assert_array_equal(as_i32(ctx.op("clamp", u, max=-56)[0], 0), u8.astype(np.int32),
                                  err_msg="uint8 clamp max=-56 (200)")


def test_fill_with_a_0dim_view_of_self(ctx):
    # torch: x.fill_(x[1]) is allowed (fill_ clones a value that aliases self)
    a = np.array([1, 2, 3, 4], np.float32)
    x = ctx.fresh(a)
    v = ctx.op("select", x, 0, 1)[0]
    ctx.op("fill_", x, Ref(v))
    for g in (0, 1):
        np.testing.assert_array_equal(fetch(ctx.s, int(x), gpu=g), np.full(4, 2, np.float32),
                                      err_msg=f"x.fill_(x[1]) rank {g}")
