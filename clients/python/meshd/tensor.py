"""Tensor handles, factories, upload (meshd.tensor) and fetch (fetch_shard, inspect)."""

from __future__ import annotations

import builtins
import concurrent.futures
import itertools
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, Union

import grpc
import numpy as np
import numpy.typing as npt

from . import _active, _catalogue, _progress
from ._progress import Progress
from .errors import (KIND_MD, MeshdError, closed_channel, on_transfers_full, retry_transfers_full,
                     transfers_full)
from .mesh import Mesh, selectors
from .pipeline import _Pending, _varint

if TYPE_CHECKING:  # types only: session.py sits above this module
    from .session import Session, Stream

# What the public functions take (aliases for annotations):
DType = Union[str, np.dtype[Any], type]  # "float32", np.float32, np.dtype("float32")
Shape = Union[int, Sequence[int]]
Scalar = Union[int, float, np.integer, np.floating]
Operand = Union["Tensor", Scalar]
ArrayData = Union[npt.NDArray[Any], list, tuple, int, float]  # what meshd.tensor uploads
Coord = Union[int, np.integer]  # a mesh coordinate (fetch_shard's gpu=0)
_T = TypeVar("_T")

_SVC = "/meshd.v1.TensorService/"
_CHUNK = 1 << 20
# Tensors of at most this many bytes (all ranks' together) go as one Literal
# command instead of an Upload. The server takes up to 1 MiB (LITERAL_MAX_BYTES),
# but past 256 KiB the Upload was faster here (bench_small.py: 2.1-2.6x slower to
# 2.1x faster from 256 KiB to 1 MiB): the Upload relays its chunks without copies.
_LITERAL_MAX = 256 << 10
_LITERAL_MAX_SENT = 8 << 20  # ... and at most this many over all ranks (LITERAL_MAX_SENT_BYTES)

DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32",
          "int64", "bool")
_NP = {n: np.dtype(n).newbyteorder("<") for n in DTYPES if n != "bfloat16"}  # meshd's bytes
# numpy has no bfloat16: its elements travel as their 16 bits in a uint16 array.
_WIRE = dict(_NP, bfloat16=np.dtype(np.uint16).newbyteorder("<"))


def _bf16_bits(a: npt.NDArray[Any]) -> npt.NDArray[np.uint16]:
    """float values as bfloat16 bits, rounded to nearest even (NaN stays a quiet NaN)."""
    f = np.require(np.asarray(a, dtype=np.float32), requirements="C")  # 0-d stays 0-d
    u = f.view(np.uint32)
    bits = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
            >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        bits[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return bits


def _bf16_values(bits: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    """bfloat16 bits as float32 (exact: every bfloat16 is a float32)."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def dtype_name(d: DType) -> str:
    """A meshd dtype name from a name, numpy dtype or numpy type; ValueError if meshd lacks it."""
    if isinstance(d, str):
        if d in DTYPES:
            return d
        try:
            d = np.dtype(d)
        except TypeError:
            raise MeshdError.of_kind("BAD_ARGUMENT", f"meshd: unknown dtype {d!r}; meshd has "
                                     f"{', '.join(DTYPES)}") from None
    try:
        nd = np.dtype(d)
    except TypeError:
        raise TypeError(f"meshd: {d!r} is not a dtype") from None
    if nd.name not in _NP:
        raise MeshdError.of_kind("BAD_ARGUMENT", f"meshd: dtype {nd.name} is not supported; "
                                 f"meshd has {', '.join(DTYPES)}")
    return nd.name


def _dtype_value(pb, name):
    return pb.DType.Value("DTYPE_" + dtype_name(name).upper())


def _dtype_from_value(pb, v):
    try:
        return pb.DType.Name(v)[len("DTYPE_"):].lower()
    except ValueError:  # a dtype this client does not know (a newer server)
        return f"dtype {v}"


def _shape(shape):
    if isinstance(shape, int) and not isinstance(shape, bool):
        return [shape]
    try:
        out = list(shape)
    except TypeError:
        raise TypeError(f"meshd: a shape is an int or a sequence of ints, got {shape!r}") from None
    for s in out:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise TypeError(f"meshd: shape entries must be ints, got {s!r}")
    return [int(s) for s in out]


def _same_session(obj, session, what):
    """obj (a Tensor, Mesh or Stream) belongs to `session`; refs are per session, so one
    of another session would name something else (or nothing) in this one."""
    if obj.session is not session:
        raise ValueError(f"meshd: {what} is of another session than the tensor it is used with; "
                         f"refs are per session: move the data through numpy (fetch_shard, "
                         f"meshd.tensor) instead")


def _drop_counts(d) -> bool:
    """A drop marker: False, True, or a pipelined Drop's _Pending, which counts until its
    answer refused it."""
    if isinstance(d, bool):
        return d
    return not (d.done() and d._error is not None)


class Tensor:
    """A handle on a tensor that lives on every rank of a mesh."""

    __hash__ = object.__hash__

    def __init__(self, session: Session, ref: int, shape: Sequence[int], dtype: str,
                 mesh_ref: int, stream_ref: int, owned: bool = True) -> None:
        self.session, self.ref = session, ref
        self._shape, self._dtype = tuple(shape), dtype
        self._mesh, self._stream = mesh_ref, stream_ref
        self._pending = None  # (pipeline _Pending, index) until the answer is in
        # True once dropped; a pipelined Drop's _Pending until answered (_gone)
        self._dropped: bool | _Pending = False
        self._storage = None  # its memory's id (TensorMeta.storage), once its meta is in
        self._borrow = None  # a borrowed handle's Borrow (which it keeps alive)
        # The handle that made this ref: when it is garbage-collected the session
        # releases the ref (Session._release_later). A second handle on a ref
        # (an answer naming `out=`) is not owned.
        self._owned = owned

    def __del__(self) -> None:
        # Never a call from here: the ref joins the session's batch of releases.
        try:
            if self._owned and not self._gone():
                self.session._release_later(self.ref)
        except Exception:  # noqa: BLE001 - interpreter shutdown, half-made handles
            pass

    @classmethod
    def _from_meta(cls, session, meta, owned=True):
        t = cls(session, meta.ref, meta.shape, _dtype_from_value(session._pb, meta.dtype),
                meta.mesh, meta.stream, owned)
        t._storage = meta.storage or None
        return t

    @classmethod
    def _from_result(cls, session, res, index, ref):
        """The index-th result tensor of `res` (a CommandResult, or a pipelined _Pending
        whose metadata is filled in when its answer arrives: a handle even when the answer
        is in already, so a rejection is raised when the handle is read, never here)."""
        if isinstance(res, _Pending):
            t = cls.__new__(cls)
            t.session, t.ref = session, ref
            t._pending, t._dropped, t._owned = (res, index), False, True
            t._storage, t._borrow = None, None
            return t
        return cls._from_meta(session, res.tensors[index])

    def _resolve(self):
        p = self._pending
        if p is not None:
            # blocks (the session's timeout at most); raises if the command was rejected
            meta = p[0].result().tensors[p[1]]
            self._shape, self._dtype = tuple(meta.shape), _dtype_from_value(self.session._pb,
                                                                            meta.dtype)
            self._mesh, self._stream = meta.mesh, meta.stream
            self._storage = meta.storage or None
            self._pending = None

    @property
    def shape(self) -> tuple[int, ...]:
        self._resolve()
        return self._shape

    @property
    def dtype(self) -> str:
        self._resolve()
        return self._dtype

    @property
    def _mesh_ref(self):
        self._resolve()
        return self._mesh

    @property
    def _stream_ref(self):
        self._resolve()
        return self._stream

    def __repr__(self) -> str:
        return f"Tensor(ref={self.ref}, shape={self.shape}, dtype={self.dtype})"

    @property
    def mesh(self) -> Mesh | None:
        return self.session._meshes.get(self._mesh_ref)

    @property
    def stream(self) -> Stream | None:
        return self.session._streams.get(self._stream_ref)

    @property
    def dropped(self) -> bool:
        """This handle, or any alias of its memory (a view, its base), was dropped."""
        if self._gone():
            return True
        self._resolve()  # (its storage's id comes with its meta)
        return self.session._storage_dropped(self._storage)

    def _gone(self) -> bool:
        """Dropped: a pipelined Drop counts until its answer refused it (BORROWED):
        then the tensor lives on, and its handle releases it as any other."""
        return _drop_counts(self._dropped)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    # torch's shape queries, answered here from the shape (no call)
    def size(self, dim: int | None = None) -> tuple[int, ...] | int:
        """The shape, or the size of dim `dim` (negative counts from the end)."""
        if dim is None:
            return self.shape
        if not -self.ndim <= dim < max(self.ndim, 1):
            raise IndexError(f"meshd: dim {dim} is out of range for a {self.ndim}-d tensor")
        return self.shape[dim]

    def dim(self) -> int:
        """The number of dims (ndim)."""
        return self.ndim

    def numel(self) -> int:
        """The number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    def drop(self) -> None:
        """Frees the tensor (every alias of its storage); later use is DROPPED."""
        if self._gone():
            return
        pb = self.session._pb
        res = self.session._execute("drop", lambda _: pb.Drop(refs=[self.ref]))
        self._dropped = res if isinstance(res, _Pending) else True
        self.session._note_drop(self)

    # ------------------------------------------------------------ operators
    def _bin(self, op, other):
        _check_operand(other, op)
        return _call(op, self, other)

    def __add__(self, o: Operand) -> Tensor: return self._bin("add", o)
    def __radd__(self, o: Operand) -> Tensor: return self._bin("add", o)
    def __sub__(self, o: Operand) -> Tensor: return self._bin("sub", o)
    def __rsub__(self, o: Operand) -> Tensor:
        _check_operand(o, "sub")
        return _call("add", _call("neg", self), o)
    def __mul__(self, o: Operand) -> Tensor: return self._bin("mul", o)
    def __rmul__(self, o: Operand) -> Tensor: return self._bin("mul", o)
    def __truediv__(self, o: Operand) -> Tensor: return self._bin("div", o)
    def __rtruediv__(self, o: Operand) -> Tensor:
        _check_operand(o, "div")
        return _call("mul", _call("reciprocal", self), o)
    def __pow__(self, o: Operand) -> Tensor: return self._bin("pow", o)
    def __matmul__(self, o: Tensor) -> Tensor:
        if not isinstance(o, Tensor):
            raise TypeError(f"meshd: @ needs a Tensor, got {type(o).__name__}")
        return _call("matmul", self, o)
    def __neg__(self) -> Tensor: return _call("neg", self)
    def __abs__(self) -> Tensor: return _call("abs", self)
    # Comparisons are element-wise ops (bool tensors), as in torch and numpy.
    def __eq__(self, o: object) -> Tensor: return self._bin("eq", o)  # type: ignore[override]
    def __ne__(self, o: object) -> Tensor: return self._bin("ne", o)  # type: ignore[override]
    def __lt__(self, o: Operand) -> Tensor: return self._bin("lt", o)
    def __le__(self, o: Operand) -> Tensor: return self._bin("le", o)
    def __gt__(self, o: Operand) -> Tensor: return self._bin("gt", o)
    def __ge__(self, o: Operand) -> Tensor: return self._bin("ge", o)

    def __bool__(self) -> bool:
        raise TypeError("meshd: a Tensor has no truth value on the client; fetch it first")

    @property
    def T(self) -> Tensor:
        return _call("permute", self, list(range(self.ndim))[::-1])

    def __getitem__(self, idx: int | builtins.slice | tuple[int | builtins.slice, ...]) -> Tensor:
        if not isinstance(idx, tuple):
            idx = (idx,)
        out, dim = self, 0
        for i in idx:
            if isinstance(i, slice):
                for part in (i.start, i.stop, i.step):
                    if part is not None and (isinstance(part, bool) or not isinstance(part, int)):
                        raise TypeError(f"meshd: slice bounds must be ints, got {i!r}")
                out = _call("slice", out, dim, i.start, i.stop, 1 if i.step is None else i.step)
                dim += 1
            elif isinstance(i, int) and not isinstance(i, bool):
                out = _call("select", out, dim, i)
            else:
                raise TypeError(f"meshd: tensors are indexed by ints and slices, got {type(i).__name__}")
        return out

    # ------------------------------------------------------------ methods
    def sum(self, dim: int | Sequence[int] | None = None, keepdim: bool = False, *,
            dtype: DType | None = None) -> Tensor:
        kw = {} if dtype is None else {"dtype": dtype}  # torch's: the result's dtype
        return _call("sum", self, _dims(dim), keepdim, **kw)

    def mean(self, dim: int | Sequence[int] | None = None, keepdim: bool = False, *,
             dtype: DType | None = None) -> Tensor:
        kw = {} if dtype is None else {"dtype": dtype}  # e.g. the mean of an int tensor
        return _call("mean", self, _dims(dim), keepdim, **kw)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        # any catalogue op as a method: t.relu(), t.reshape([2, 3]), t.transpose(0, 1)
        if name.startswith("_"):
            raise AttributeError(name)
        _catalogue.check(name, "Tensor")
        op = _catalogue.get(name)
        if op is not None and op.factory:
            raise AttributeError(f"meshd: {name} makes a tensor from nothing; call it as "
                                 f"meshd.ops.{name}(...), not as a Tensor method")

        def method(*a: Any, **kw: Any) -> Any:
            return _call(name, self, *a, **kw)
        method.__name__ = name
        method.__doc__ = _catalogue.doc(name)
        return method

    def __dir__(self) -> list[str]:
        ops = [n for n in _catalogue.names() if not _catalogue.get(n).factory]
        return sorted(set(super().__dir__()) | set(ops))

    def reduce(self, dims: str | Sequence[str], reduction: str = "sum", scatter: bool = False,
               mesh: Mesh | None = None, _inplace: bool = False,
               out: Tensor | None = None) -> Tensor:
        """A collective over mesh dims (str or tuple; () means all): reduction "sum",
        "avg", "product", "min", "max", "band", "bor", "bxor" or "stack".
        mesh: a sub-mesh holding one member of each reduced group and none of the
        reduced dims (e.g. mesh.slice(gpu=0)): the result lives there only, the
        other members keep nothing (Monarch's reduce(..., mesh=)). The parameters are
        Monarch's, in its order: reduce(dims, reduction, scatter, mesh, _inplace, out)."""
        return self._reduce(dims, reduction, scatter, out, inplace=_inplace, mesh=mesh)

    def reduce_(self, dims: str | Sequence[str], reduction: str = "sum", scatter: bool = False,
                mesh: Mesh | None = None, out: Tensor | None = None) -> Tensor:
        """reduce() in place: returns this tensor. (A mesh= is refused: the input's mesh
        keeps its tensor.)"""
        return self._reduce(dims, reduction, scatter, out, inplace=True, mesh=mesh)

    def _reduce(self, dims, reduction, scatter, out, inplace, mesh=None):
        if isinstance(dims, str):
            dims = (dims,)
        try:
            dims = tuple(dims)
        except TypeError:  # reduce(0): a tensor dim where a mesh dim name goes
            raise TypeError(f"meshd: reduce dims are mesh dim names (a str or a sequence of "
                            f"str, () for all), got {dims!r}") from None
        if not all(isinstance(d, str) for d in dims):
            raise TypeError(f"meshd: reduce dims are mesh dim names, got {dims!r}")
        if out is not None and not isinstance(out, Tensor):
            raise TypeError(f"meshd: out must be a Tensor, got {type(out).__name__}")
        if mesh is not None and not isinstance(mesh, Mesh):
            raise TypeError(f"meshd: reduce's mesh must be a Mesh, got {type(mesh).__name__}")
        s, pb = self.session, self.session._pb
        if out is not None:
            _same_session(out, s, "reduce's out=")
        if mesh is not None:
            _same_session(mesh, s, "reduce's mesh=")
        stream = _active.stream_ref(s)
        box = {}

        def build(ref):
            box["ref"] = ref
            return pb.Reduce(
                ref=0 if inplace else ref, input=self.ref, dims=list(dims), reduction=reduction,
                scatter=bool(scatter), inplace=inplace, out=out.ref if out is not None else 0,
                stream=stream, mesh=mesh.ref if mesh is not None else 0)
        res = s._execute("reduce", build, claim=0 if inplace else 1)
        if inplace:
            return self
        if out is not None:  # the answer names the result (out, or a view of it): wait for it
            meta = res.tensors[0]
            return Tensor._from_meta(s, meta, owned=meta.ref == box["ref"])
        return Tensor._from_result(s, res, 0, box["ref"])

    def to_mesh(self, mesh: Mesh, stream: Stream | None = None) -> Tensor:
        """A copy of this tensor on `mesh` (on `stream`, default this tensor's)."""
        return _to_mesh(self, {}, mesh, stream)

    def slice_mesh(self, **sel: int | builtins.slice) -> _MeshSlice:
        """The part of this tensor on a sub-mesh, for `.to_mesh(...)`."""
        return _MeshSlice(self, sel)


class _MeshSlice:
    """`t.slice_mesh(**sel)`: the part of t on a sub-mesh, for `.to_mesh(...)`."""

    def __init__(self, t: Tensor, sel: dict[str, int | builtins.slice]) -> None:
        self.tensor, self.sel = t, sel

    def to_mesh(self, mesh: Mesh, stream: Stream | None = None) -> Tensor:
        return _to_mesh(self.tensor, self.sel, mesh, stream)


def _to_mesh(t, sel, mesh, stream):
    if not isinstance(mesh, Mesh):
        raise TypeError(f"meshd: to_mesh needs a Mesh, got {type(mesh).__name__}")
    s, pb = t.session, t.session._pb
    _same_session(mesh, s, "to_mesh's mesh")
    if stream is not None:
        _same_session(stream, s, "to_mesh's stream")
    dst_stream = t._stream_ref if stream is None else stream.ref
    sels = selectors(pb, sel)
    box = {}

    def build(ref):
        box["ref"] = ref
        return pb.ToMesh(ref=ref, input=t.ref, selection=sels, dst_mesh=mesh.ref,
                         dst_stream=dst_stream)
    res = s._execute("to_mesh", build, claim=1)
    return Tensor._from_result(s, res, 0, box["ref"])


def _dims(dim):
    if dim is None:
        return None
    if isinstance(dim, int) and not isinstance(dim, bool):
        return [dim]
    return list(dim)


def _check_operand(o, op):
    if isinstance(o, Tensor) or (isinstance(o, (int, float, bool, np.integer, np.floating))):
        return
    raise TypeError(f"meshd: {op} needs a Tensor or a scalar, got {type(o).__name__}")


# ---------------------------------------------------------------- calls

def _arg(pb, v, session, name=None):
    if isinstance(v, Tensor):
        _same_session(v, session, f"argument {name!r}" if name else "an argument")
        return pb.Arg(ref=v.ref)
    if v is None:
        return pb.Arg(none=True)
    if name == "dtype" or isinstance(v, (np.dtype, type)):
        return pb.Arg(dtype=_dtype_value(pb, v))
    if isinstance(v, (bool, np.bool_)):
        return pb.Arg(b=bool(v))
    if isinstance(v, (int, np.integer)):
        return pb.Arg(i=int(v))
    if isinstance(v, (float, np.floating)):
        return pb.Arg(f=float(v))
    if isinstance(v, str):
        return pb.Arg(s=v)
    if isinstance(v, (list, tuple)):
        if v and all(isinstance(x, Tensor) for x in v):
            for x in v:
                _same_session(x, session, f"a tensor in {name or 'a list argument'}")
            return pb.Arg(refs=pb.RefList(refs=[x.ref for x in v]))
        if all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in v):
            return pb.Arg(ints=pb.IntList(values=[int(x) for x in v]))
        raise TypeError(f"meshd: a list argument holds all Tensors or all ints, got {v!r}")
    if isinstance(v, np.ndarray):
        raise TypeError("meshd: a numpy array is not a Tensor; upload it with meshd.tensor(...)")
    raise TypeError(f"meshd: cannot pass {type(v).__name__} to an op")


def _session_of(args, kwargs):
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, Tensor):
            return v.session
        if isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, Tensor):
                    return x.session
    m = _active.current("mesh")
    if m is not None:
        return m.session
    raise ValueError("meshd: an op needs a Tensor argument or an active mesh")


def _call(op, *args, **kwargs):
    """A Call of catalogue op `op`; returns its result Tensor (a tuple for several)."""
    inplace = op.endswith("_") and "nresults" not in kwargs
    if "nresults" in kwargs:
        nresults = kwargs.pop("nresults")
    elif inplace:
        nresults = 0  # torch's in-place ops return their first argument
    elif op in ("max", "min") and (len(args) > 1 or "dim" in kwargs):
        nresults = 2  # (values, indices)
    else:
        nresults = 1
    s = _session_of(args, kwargs)
    pb = s._pb
    pargs = [_arg(pb, a, s) for a in args]
    pkw = [pb.Kwarg(name=k, value=_arg(pb, v, s, k)) for k, v in kwargs.items()]
    stream = _active.stream_ref(s)

    box = {}

    def build(refs):
        refs = [refs] if isinstance(refs, int) else list(refs or [])
        box["refs"] = refs
        return pb.Call(op=op, args=pargs, kwargs=pkw, results=refs, stream=stream)
    res = s._execute("call", build, claim=nresults)
    if isinstance(res, _Pending):
        outs = tuple(Tensor._from_result(s, res, i, r) for i, r in enumerate(box["refs"]))
    else:
        outs = tuple(Tensor._from_meta(s, m, owned=m.ref in box["refs"]) for m in res.tensors)
    if inplace and args and isinstance(args[0], Tensor):
        return args[0]
    if nresults == 1 and len(outs) == 1:
        return outs[0]
    return outs


# ---------------------------------------------------------------- factories

def _factory(kind, shape, dtype=None, mesh=None, value=0.0, seed=None, dim="", start=0.0,
             end=0.0, step=0.0):
    mesh = mesh if mesh is not None else _active.mesh()
    s, pb = mesh.session, mesh.session._pb
    f = dict(mesh=mesh.ref, stream=_active.stream_ref(s), kind=kind, shape=_shape(shape),
             value=float(value), dim=dim, start=float(start), end=float(end), step=float(step))
    if dtype is not None:
        f["dtype"] = _dtype_value(pb, dtype)
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise TypeError(f"meshd: seed must be a non-negative int, got {seed!r}")
        f["seed"], f["has_seed"] = int(seed), True
    box = {}

    def build(ref):
        box["ref"] = ref
        return pb.Factory(ref=ref, **f)
    res = s._execute("factory", build, claim=1)
    return Tensor._from_result(s, res, 0, box["ref"])


def _size(fn, size):
    """torch's size arguments: ints (zeros(3, 4)) or one sequence (zeros((3, 4)))."""
    if len(size) == 1 and not isinstance(size[0], (int, np.integer)):
        return size[0]  # a sequence: _shape checks it
    for n in size:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"meshd: {fn} takes its size as ints or one sequence of ints, got "
                            f"{n!r}; options go by keyword, e.g. {fn}(3, 4, dtype=\"float32\")")
    return tuple(size)


def zeros(*size: Shape, dtype: DType | None = None) -> Tensor:
    """zeros(3, 4) or zeros((3, 4)), on the active mesh and stream."""
    return _factory("zeros", _size("zeros", size), dtype)


def ones(*size: Shape, dtype: DType | None = None) -> Tensor:
    """ones(3, 4) or ones((3, 4)), on the active mesh and stream."""
    return _factory("ones", _size("ones", size), dtype)


def empty(*size: Shape, dtype: DType | None = None) -> Tensor:
    """empty(3, 4) or empty((3, 4)): values undefined."""
    return _factory("empty", _size("empty", size), dtype)


def full(size: Shape, fill_value: Scalar, *, dtype: DType | None = None) -> Tensor:
    """full((3, 4), 2.5), as torch.full: the fill value's kind gives the dtype when none
    is given (float32, int64 for an int, bool for a bool)."""
    if not isinstance(fill_value, (bool, int, float, np.bool_, np.integer, np.floating)):
        raise TypeError(f"meshd: full takes a number, got {type(fill_value).__name__}")
    if isinstance(fill_value, (bool, np.bool_)):
        dtype, fill_value = dtype if dtype is not None else "bool", float(fill_value)
    elif isinstance(fill_value, (int, np.integer)):
        if abs(int(fill_value)) > 1 << 53:  # Factory.value is a double
            raise ValueError(f"meshd: full's fill value {fill_value} is beyond 2**53, which a "
                             f"factory cannot carry exactly; upload a tensor instead")
        dtype = dtype if dtype is not None else "int64"  # torch.full: int64 for an int
    return _factory("full", size, dtype, value=fill_value)


def arange(start: Scalar, end: Scalar | None = None, step: Scalar = 1, *,
           dtype: DType | None = None) -> Tensor:
    """arange(end) or arange(start, end, step), as torch.arange (int64 for ints)."""
    if end is None:
        start, end = 0, start
    if dtype is None and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                             for v in (start, end, step)):
        dtype = "int64"  # torch.arange: int64 for int arguments
    return _factory("arange", (), dtype, start=start, end=end, step=step)


def rand(*size: Shape, seed: int | None = None, dtype: DType | None = None) -> Tensor:
    """Uniform [0, 1): rand(3, 4) or rand((3, 4)); seed (keyword) makes it repeatable."""
    return _factory("rand", _size("rand", size), dtype, seed=seed)


def randn(*size: Shape, seed: int | None = None, dtype: DType | None = None) -> Tensor:
    """Standard normal: randn(3, 4) or randn((3, 4)); seed (keyword) makes it repeatable."""
    return _factory("randn", _size("randn", size), dtype, seed=seed)


def _tree_map(fn: Callable[[Tensor], Any], tree: Any) -> Any:
    """fn on every Tensor of a pytree (lists, tuples, named tuples, dicts), the
    structure kept; other leaves stay as they are."""
    if isinstance(tree, Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return type(tree)((k, _tree_map(fn, v)) for k, v in tree.items())
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a named tuple
        return type(tree)(*(_tree_map(fn, v) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_tree_map(fn, v) for v in tree)
    return tree


def reduce(tensors: Any, dims: str | Sequence[str], reduction: str = "sum",
           scatter: bool = False, mesh: Mesh | None = None, _inplace: bool = False) -> Any:
    """Monarch's meshd.reduce: t.reduce(dims, reduction, scatter, mesh, _inplace) for
    every Tensor of the pytree `tensors` (lists, tuples, dicts of tensors, nested), in
    the same structure: e.g. every gradient of a model in one call, pipelined by the
    caller's block."""
    return _tree_map(lambda t: t.reduce(dims, reduction, scatter, mesh, _inplace), tensors)


def reduce_(tensors: Any, dims: str | Sequence[str], reduction: str = "sum",
            scatter: bool = False, mesh: Mesh | None = None) -> Any:
    """meshd.reduce in place: t.reduce_ on every Tensor of the pytree (Monarch's reduce_)."""
    return reduce(tensors, dims, reduction, scatter, mesh, _inplace=True)


# ---------------------------------------------------------------- data in and out

def tensor(data: ArrayData, shard: str | None = None, dtype: DType | None = None,
           progress: Progress = None) -> Tensor:
    """Uploads a numpy array to the active mesh: the same data to every rank, or with
    shard="dim", data[i] to the ranks at coordinate i along that dim.
    progress: None (a bar on a terminal for big arrays), False, True or a callable
    (done_bytes, total_bytes); see meshd._progress."""
    _progress.check(progress)
    mesh = _active.mesh()
    if not isinstance(data, np.ndarray):
        if isinstance(data, (list, tuple, int, float, bool)):
            data = np.asarray(data)
        else:
            raise TypeError(f"meshd.tensor takes a numpy array, got {type(data).__name__}")
    if dtype is not None and dtype_name(dtype) == "bfloat16":
        # uint16 data are bfloat16 bits already (inspect(t, raw=True) gives them);
        # anything else is converted, rounding to nearest even.
        # (in either byte order: a big-endian array is swapped below)
        bits = data.dtype.kind == "u" and data.dtype.itemsize == 2
        data = data if bits else _bf16_bits(data)
        name = "bfloat16"
    else:
        if dtype is not None:
            data = data.astype(dtype_name(dtype))
        name = dtype_name(data.dtype)
    if data.dtype.byteorder == ">" or (data.dtype.byteorder == "=" and sys.byteorder == "big"):
        data = data.astype(data.dtype.newbyteorder("<"))  # meshd's bytes are little-endian
    data = np.require(data, requirements="C")  # (ascontiguousarray makes a 0-d array 1-d)
    per_rank = shard is not None
    if per_rank:
        if shard not in mesh.sizes:
            raise MeshdError.of_kind("BAD_DIM", f"meshd: shard dim {shard!r} is not a dim of "
                                     f"{mesh!r}")
        n = mesh.sizes[shard]
        if data.ndim == 0 or data.shape[0] != n:
            raise MeshdError.of_kind("SHAPE_MISMATCH", f"meshd: shard={shard!r} needs "
                                     f"size({shard})={n} rows, got shape {data.shape}")
        axis = mesh.names.index(shard)
        coords = np.indices([mesh.sizes[d] for d in mesh.names]).reshape(len(mesh.names), -1)
        rows = coords[axis]  # the coordinate along `shard` of each rank, row-major
        # Each rank's bytes are a view of its row: nothing is copied, even where ranks
        # share a row.
        shape, pieces = data.shape[1:], [_bytes_of(data[r]) for r in rows]
    else:
        shape, pieces = data.shape, [_bytes_of(data)]
    s, pb = mesh.session, mesh.session._pb
    total = sum(len(p) for p in pieces)
    stream = _active.stream_ref(s)
    sent = total if per_rank else total * len(mesh.ranks)  # what the agents get in all
    if (total <= _LITERAL_MAX and sent <= _LITERAL_MAX_SENT and s._literals
            and mesh._literals and s._direct.mode != "direct"):
        try:
            return _literal(s, mesh, stream, shape, name, per_rank, pieces, total, sent, progress)
        except MeshdError as e:  # an agent of the mesh predates Literal: Upload from now on
            if e.kind != "UNAVAILABLE" or "predates the Literal" not in e.message:
                raise
            s._literals = False
    # The header is a message; data chunks are packed by hand (bytes already).
    fn = s._ch.stream_unary(
        _SVC + "Upload",
        request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
        response_deserializer=pb.UploadReply.FromString)
    if s.closed:
        raise s._closed_error()
    # One deadline, the session's timeout, for the pipeline's answers, a direct attempt
    # and the Upload (each took a whole timeout of its own)
    deadline = time.monotonic() + s.timeout
    with s._lock:  # the ref must reach the server in order with other commands
        s._flush_pipeline(max(deadline - time.monotonic(), 0.001))
        ref = s._new_ref()
        hdr = pb.UploadHeader(ref=ref, mesh=mesh.ref, stream=stream, shape=list(shape),
                              dtype=_dtype_value(pb, name), per_rank=per_rank,
                              total_bytes=total)
        # One bar (or callback) for every attempt: a direct one, its retry, the proxy.
        tr = _progress.tracker(total, progress, "upload")
        if s._direct.wanted():  # straight to the agents (meshd/direct.py)
            try:
                done = s._direct.upload(hdr, pieces, tr,
                                        timeout=max(deadline - time.monotonic(), 0.001))
            except BaseException:
                tr.close()
                raise
            if done is not None:
                return _uploaded(s, done[0].tensor, done[1])
            hdr.ref = ref = s._new_ref()  # the proxy instead; the plan may have claimed ref
            tr.again()

        aborted = []  # the progress callback's exception, raised in gRPC's thread

        def msgs():  # one chunk at a time: the client holds the array and one chunk
            yield pb.UploadChunk(header=hdr)
            for raw in pieces:
                for i in range(0, len(raw), _CHUNK):
                    if aborted:  # interrupted (below): no more
                        return
                    yield _data_field(raw[i:i + _CHUNK])
                    try:  # runs when gRPC takes the next message
                        tr.update(min(_CHUNK, len(raw) - i))
                    except BaseException as e:  # a short upload: the server refuses it
                        aborted.append(e)
                        return
        call = None
        wait = 0.005
        try:
            while True:
                call = fn.future(msgs(), metadata=s._md,
                                 timeout=max(deadline - time.monotonic(), 0.001))
                ended = queue.SimpleQueue()  # (not call.result(): see direct.Direct.upload)
                call.add_done_callback(ended.put)
                try:  # (the call ends by its deadline: the wait is bounded too)
                    ended.get(timeout=max(deadline - time.monotonic(), 0) + 5)
                except queue.Empty:
                    call.cancel()
                    s._release_later(ref)  # it may have defined the tensor, its answer lost
                    raise MeshdError("DEADLINE_EXCEEDED", "Upload: the call did not end by its "
                                     "deadline", grpc.StatusCode.DEADLINE_EXCEEDED) from None
                if (call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not aborted
                        and transfers_full(call) and time.monotonic() + wait < deadline):
                    # the session's own transfers hold every slot: they end soon (errors.py)
                    time.sleep(wait)
                    wait = min(wait * 2, 0.2)
                    hdr.ref = ref = s._new_ref()  # the next ref, whatever the refused one's fate
                    tr.again()  # (msgs() may have counted chunks of the refused call)
                    continue
                reply = call.result()
                break
        except grpc.RpcError as e:
            tr.close()
            if aborted:
                raise aborted[0] from None
            if not any(k == KIND_MD for k, _ in (e.trailing_metadata() or ())):
                # No kind of the server's (a deadline, a dropped connection): it may have
                # defined the tensor and its answer been lost; nobody else can release it
                # (a Release skips a ref that is not live).
                s._release_later(ref)
            raise MeshdError.from_rpc(e) from None
        except BaseException as e:  # KeyboardInterrupt: the server undoes a cancelled Upload
            aborted.append(e)  # msgs() sends no more
            if call is not None and not call.cancel() and call.code() == grpc.StatusCode.OK:
                s._release_later(ref)  # it ended just before: the caller gets no handle
            tr.close()
            if closed_channel(e):  # close() (another thread) closed the channel
                raise MeshdError("NO_SESSION", "the session is closed") from None
            raise
        if aborted:
            tr.close()
            raise aborted[0]
    return _uploaded(s, reply.tensor, tr)


def _uploaded(s, meta, tr):
    """The handle of an upload that succeeded, once its progress completes (tr closed
    ok); if the callback raises then, the caller gets no handle: the ref goes."""
    try:
        tr.close(ok=True)
    except BaseException:
        s._release_later(meta.ref)
        raise
    return Tensor._from_meta(s, meta)


def _literal(s, mesh, stream, shape, name, per_rank, pieces, total, sent, progress):
    """A small tensor as one Literal command: its bytes travel in the command, which
    is pipelined like any other (no Upload stream, no wait for the agents)."""
    pb = s._pb
    box = {}

    def build(ref):
        box["ref"] = ref
        head = pb.Literal(ref=ref, mesh=mesh.ref, stream=stream, shape=list(shape),
                          dtype=_dtype_value(pb, name), per_rank=per_rank)
        return _PackedLiteral(head.SerializeToString(), pieces, total, sent)
    tr = _progress.tracker(total, progress, "upload")
    try:
        res = s._execute("literal", build, claim=1)
    except BaseException:
        tr.close()
        raise
    try:
        tr.update(total)
        tr.close(ok=True)
    except BaseException:  # the callback's: the caller gets no handle, so the ref goes
        s._release_later(box["ref"])
        raise
    return Tensor._from_result(s, res, 0, box["ref"])


def _tag_len(field, n):
    """A length-delimited field's tag and length."""
    return _varint((field << 3) | 2) + _varint(n)


class _PackedLiteral:
    """Command{seq, literal} packed by hand around the array's bytes, which are
    copied once, into the message (through protobuf they were copied four times,
    each into fresh pages: 3 ms per MiB here). Session._execute sets seq."""

    __slots__ = ("seq", "sent", "_head", "_pieces", "_total")
    packed_command = True

    def __init__(self, head, pieces, total, sent):  # sent: to the agents, in all
        self.seq, self.sent, self._head, self._pieces, self._total = 0, sent, head, pieces, total

    def SerializeToString(self):  # noqa: N802 - protobuf's name, for Session._execute
        body = len(self._head) + len(_tag_len(7, self._total)) + self._total
        return b"".join([b"\x08", _varint(self.seq), _tag_len(24, body), self._head,
                         _tag_len(7, self._total), *self._pieces])


def _bytes_of(a):
    """The bytes of a C-contiguous array (or numpy scalar) as a flat memoryview, no copy."""
    return memoryview(a).cast("B") if np.size(a) else memoryview(b"")


def _data_field(chunk):
    """A message whose only field is `bytes data = 2` (UploadChunk.data), packed by
    hand around a memoryview slice: one copy of the bytes, none through protobuf."""
    n, head = len(chunk), bytearray(b"\x12")
    while True:
        head.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(head) + chunk


def _split_data_field(raw):
    """A FetchChunk packed as FetchChunk{data} alone: a memoryview of its bytes
    (no copy); None for anything else (the meta), which is unpacked as usual."""
    if not raw or raw[0] != 0x12:
        return None
    n = shift = 0
    for i in range(1, min(len(raw), 11)):
        n |= (raw[i] & 0x7F) << shift
        shift += 7
        if not raw[i] & 0x80:
            return memoryview(raw)[i + 1:] if i + 1 + n == len(raw) else None
    return None


def _fetch_open(t, coords, timeout=None):
    """Starts the Fetch and waits for its first message, which the server sends once
    it planned the Fetch: commands sent after it cannot change the value fetched.
    Returns (the call, that message); raises MeshdError."""
    return _fetch_start(t.session, _fetch_request(t, coords), timeout)


def _fetch_start(s, req, timeout=None):
    """_fetch_open of FetchRequest req on session s (a direct fetch that the proxy
    takes over: meshd/direct.py)."""
    pb = s._pb
    fn = s._ch.unary_stream(
        _SVC + "Fetch", request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=lambda raw: _split_data_field(raw) or pb.FetchChunk.FromString(raw))

    def start():
        call = fn(req, metadata=s._md, timeout=s.timeout if timeout is None else timeout)
        return call, next(call, None)
    try:  # a session with --session-max-transfers Fetches in flight waits for one to end
        return retry_transfers_full(start, s.timeout if timeout is None else timeout)
    except grpc.RpcError as e:
        raise MeshdError.from_rpc(e) from None


def _fetch_finish(s, call, first, progress=None, tr=None):
    """Reads session s's Fetch into one array, made from the meta (the first
    message): each chunk is copied once, into its place. progress: see
    meshd._progress; or tr, the tracker of a direct attempt that this Fetch takes
    over (its bar goes on)."""
    pb = s._pb
    out = flat = None
    got = 0
    try:
        for c in itertools.chain([first] if first is not None else [], call):
            if isinstance(c, memoryview) or c.WhichOneof("part") == "data":
                piece = c if isinstance(c, memoryview) else memoryview(c.data)
                if flat is None or got + len(piece) > len(flat):
                    raise MeshdError("INTERNAL", "Fetch: the server sent more bytes than the "
                                     "TensorMeta describes" if flat is not None else
                                     "Fetch: data before the TensorMeta")
                flat[got:got + len(piece)] = piece
                got += len(piece)
                tr.update(len(piece))
            elif out is None:
                name = _dtype_from_value(pb, c.meta.dtype)
                if name not in _WIRE:
                    raise ValueError(f"meshd: numpy has no {name}; convert the tensor first "
                                     f"(t.to(...))")
                out = np.empty(tuple(c.meta.shape), dtype=_WIRE[name])
                flat = memoryview(out).cast("B") if out.size else memoryview(bytearray())
                if tr is None:
                    tr = _progress.tracker(len(flat), progress, "fetch")
        if out is None:
            raise MeshdError("INTERNAL", "Fetch: the server sent no TensorMeta")
        if got != len(flat):
            raise MeshdError("INTERNAL", f"Fetch: got {got} bytes where the TensorMeta needs "
                             f"{len(flat)}")
        tr.close(ok=True)
    except grpc.RpcError as e:
        if tr is not None:
            tr.close()
        raise MeshdError.from_rpc(e) from None
    except BaseException:  # our own checks, or the progress callback's exception
        call.cancel()
        if tr is not None:
            tr.close()
        raise
    return out


def _fetch_request(t, coords):
    """The FetchRequest of t's shard at coords. wait_for_slot: with the session's
    transfer slots all taken, the server plans it anyway (its value fixed now) and
    only its bytes wait for a slot, so fetch_shard's place among the commands is
    fixed at once (an older server refuses it until a slot frees: Session._fetch_parked)."""
    pb = t.session._pb
    return pb.FetchRequest(ref=t.ref, coords=[pb.Coordinate(dim=k, index=v)
                                              for k, v in coords.items()],
                           wait_for_slot=True)


def _fetch_direct(t, d, coords, timeout, progress=None):
    """Plans a direct fetch now (ordered like a Fetch); returns what reads it, or None
    to use the proxied Fetch. timeout: seconds for the plan, the Read and FinishFetch
    together (as for the one proxied Fetch call)."""
    deadline = time.monotonic() + timeout
    planned = d.fetch_plan(_fetch_request(t, coords), deadline)
    if planned is None:
        return None
    try:
        name = _dtype_from_value(t.session._pb, planned[0].meta.dtype)
    except ValueError:  # a dtype this client does not know (a newer server)
        name = f"dtype {planned[0].meta.dtype}"
    if name not in _WIRE:
        d._finish_fetch(planned[0].transfer_id, quiet=True)
        raise ValueError(f"meshd: numpy has no {name}; convert the tensor first (t.to(...))")
    return lambda on_stop=None: d.fetch_finish(t.ref, planned, _WIRE[name], deadline, progress,
                                               on_stop)


class _Workers:
    """Daemon threads that read fetches (fetch_shard's work): an idle one takes the
    next, a new one starts only when none is idle, and one idle for IDLE_S ends.
    A thread started per fetch cost its caller Thread.start()'s wait for the new
    thread to run, which takes the GIL from the fetches already reading: 2-3 ms per
    shard here, and 4-agent fetches came 10-45% slower (tests/bench/bench_data.py)."""

    IDLE_S = 2.0

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._work: list = []  # fns not taken yet
        self._idle = 0  # threads waiting for work

    def run(self, fn) -> None:
        """Runs fn on a worker; raises (fn not run) if no thread could start for it."""
        with self._cv:
            self._work.append(fn)
            if self._idle >= len(self._work):  # an idle thread for each fn queued
                self._cv.notify()
                return
        try:
            threading.Thread(target=self._loop, name="meshd-fetch", daemon=True).start()
        except BaseException:  # (a thread limit; interpreter shutdown): not queued either,
            with self._cv:  # or the next fetch's thread would run it, long after
                if not any(w is fn for w in self._work):
                    return  # a worker took it meanwhile: it runs
                self._work = [w for w in self._work if w is not fn]
            raise

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._idle += 1
                while not self._work:
                    if not self._cv.wait(self.IDLE_S) and not self._work:
                        self._idle -= 1
                        return
                self._idle -= 1
                fn = self._work.pop(0)
            fn()  # (fetch_shard's fns hand every exception to their Future)
            del fn

    def _after_fork(self) -> None:  # the child has none of the parent's threads
        self.__init__()  # type: ignore[misc]


_workers = _Workers()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_workers._after_fork)


class Future(concurrent.futures.Future, Generic[_T]):  # type: ignore[type-arg]
    """A fetch's result to come: `.result(timeout)`, or Monarch's `.get(timeout)`."""

    def __init__(self) -> None:
        super().__init__()
        self._stop_lock = threading.Lock()
        self._stops: list = []  # what cancels the fetch's calls (inspect() interrupted)
        self._stopped = False

    def get(self, timeout: float | None = None) -> _T:
        return self.result(timeout)

    def _on_stop(self, fn) -> None:
        """fn cancels a call of the fetch: at _stop(), or now if that came already."""
        with self._stop_lock:
            if not self._stopped:
                self._stops.append(fn)
                return
        fn()

    def _stop(self) -> None:
        """Cancels the fetch's calls: it ends now, its transfer slot given back, instead
        of running on to its deadline for a caller that stopped waiting."""
        with self._stop_lock:
            self._stopped = True
            fns, self._stops = self._stops, []
        for fn in fns:
            fn()


def fetch_shard(t: Tensor, timeout: float | None = None, progress: Progress = None,
                raw: bool = False, **coords: Coord) -> Future[npt.NDArray[Any]]:
    """The local tensor at the rank named by coords, as a Future of a numpy.ndarray.
    timeout: seconds the Fetch may take (default: the session's timeout); past it the
    Future raises MeshdError kind DEADLINE_EXCEEDED. progress: None (a bar on a terminal
    for big tensors), False, True or a callable(done_bytes, total_bytes), called on the
    Fetch's thread; see meshd._progress. numpy has no bfloat16: a bfloat16 tensor comes
    back as float32 (exact), or with raw=True as its bits in a uint16 array (which
    meshd.tensor(bits, dtype="bfloat16") uploads as they are). Without coords: the
    first rank (coordinate 0 along every dim), as Monarch. The Future has Monarch's
    .get() too. It returns at once: the fetch is planned on its own thread, and the
    session's next command waits for that, so the value is the tensor's as the
    commands before this call left it. With the session's transfer slots all taken
    (--session-max-transfers, by transfers still reading) the server plans it all the
    same and only its bytes wait for a slot, so no command waits for those transfers,
    and a command never waits for a fetch's bytes. (A server older than that refuses
    the plan until a slot frees: such a fetch holds back only the commands that may
    write or end a tensor, an in-place op, out=, a drop, a borrow, a release.) (Mesh
    dims named "timeout", "progress" or "raw" cannot be given here.)"""
    _progress.check(progress)
    if not isinstance(t, Tensor):
        raise TypeError(f"meshd: fetch_shard takes a Tensor, got {type(t).__name__}")
    for k, v in coords.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"meshd: coordinate {k}= must be an int, got {v!r}")
    fut: Future[npt.NDArray[Any]] = Future()
    limit = t.session.timeout if timeout is None else timeout
    deadline = time.monotonic() + limit  # for the pipelined answers and the Fetch together
    try:
        # pipelined commands before it must have reached the server
        t.session._flush_pipeline(limit)
        t._resolve()  # a rejected pipelined command: its error (the ref was never defined)
    except MeshdError as e:
        fut.set_exception(e)
        return fut
    if not coords:  # Monarch: the first rank
        coords = {d: 0 for d in t.mesh.names}

    def values(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return _bf16_values(a) if a.dtype == np.uint16 and not raw else a  # only bfloat16
    s = t.session
    parked = []  # its plan waited for a transfer slot (an older server: Session._fetch_parked)

    def park():  # (once: a direct plan, then the proxy's Fetch, may each wait)
        if not parked:
            parked.append(True)
            s._fetch_parked()

    def place():
        """Plans the fetch (direct) or starts it (proxy), on the fetch's thread: what
        reads it. Commands wait meanwhile (Session._wait_fetches_placed): the value
        fetched is the tensor's as the commands before fetch_shard left it; once its
        plan waits for a transfer slot (park), only those that may write a tensor."""
        try:
            with on_transfers_full(park):
                return plan()
        finally:
            s._fetch_placed(bool(parked))

    def plan():
        """place()'s work: what reads the fetch."""
        left = max(deadline - time.monotonic(), 0.001)
        d = s._direct
        if d.wanted(deadline):  # straight from the agent (meshd/direct.py)
            work = _fetch_direct(t, d, coords, left, progress)
            if work is not None:
                return work
        try:
            call, first = _fetch_open(t, coords, left)
        except ValueError as e:
            if not closed_channel(e):
                raise
            raise MeshdError("NO_SESSION", "the session is closed") from None
        fut._on_stop(call.cancel)
        return lambda on_stop: _fetch_finish(s, call, first, progress)

    def run():
        try:
            fut.set_result(values(place()(fut._on_stop)))
        except BaseException as e:  # handed to .result()
            fut.set_exception(e)
    try:  # the session's next command waits until it is planned
        s._fetch_placing(deadline)
    except MeshdError as e:
        fut.set_exception(e)
        return fut
    fut.set_running_or_notify_cancel()  # running: cancel() cannot stop a fetch
    try:
        _workers.run(run)
    except BaseException:  # no thread for it: it is not planned, and nothing waits for it
        s._fetch_placed()
        raise
    return fut


def inspect(t: Tensor, timeout: float | None = None, progress: Progress = None,
            raw: bool = False, **coords: Coord) -> npt.NDArray[Any]:
    """fetch_shard(t, timeout, progress, raw, **coords).result()"""
    fut = fetch_shard(t, timeout, progress, raw, **coords)
    try:
        return fut.result()
    except BaseException:  # Ctrl-C: the fetch stops too (it would hold its slot)
        if not fut.done():
            fut._stop()
        raise
