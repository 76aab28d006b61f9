#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/).

    /usr/bin/python3 tests/fuzz/make_corpus.py

Seeds are realistic inputs in each target's own format (see the comment at the
top of fuzz_<target>.c), plus a few broken ones. Protobuf messages are built
with the Python modules protoc generates from api/ into a temporary directory.
Files this script writes are named seed-*; crash inputs added by hand
(crash-*) and inputs a campaign found (cov-*) are left alone. Rerun it after
changing a target's input format.
"""

import glob
import importlib.util
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
API = os.path.join(ROOT, "api")


def load_proto():
    out = tempfile.mkdtemp(prefix="meshd-fuzz-proto-")
    try:
        proto = os.path.join(API, "meshd", "v1", "tensor_service.proto")
        subprocess.run(["protoc", "--proto_path=" + os.path.dirname(proto), "--python_out=" + out,
                        proto], check=True)
        spec = importlib.util.spec_from_file_location(
            "tensor_service_pb2", os.path.join(out, "tensor_service_pb2.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        shutil.rmtree(out, ignore_errors=True)


pb = load_proto()


def write(target, seeds):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    for old in glob.glob(os.path.join(d, "seed-*")):
        os.remove(old)
    for name, data in seeds:
        assert re.fullmatch(r"[a-z0-9_]+", name), name
        with open(os.path.join(d, "seed-" + name), "wb") as f:
            f.write(data)
    print(f"{target}: {len(seeds)} seeds")


# ---------------------------------------------------------------- commands

def frame(kind, payload):
    """A record as fuzz_commands.c reads it: a gRPC message frame."""
    return bytes([kind]) + struct.pack(">I", len(payload)) + payload


class Script:
    """Commands for fuzz_commands: seqs count up from 10 (the prelude uses 1..3)."""

    def __init__(self, prelude=True, quota=0, limits=False, batch=False):
        self.flags = (1 if prelude else 0) | (quota << 1) | (8 if limits else 0) | (16 if batch else 0)
        self.records = []
        self.seq = 10

    def cmd(self, **kind):
        c = pb.Command(seq=self.seq, **kind)
        self.seq += 1
        self.records.append(frame(0, c.SerializeToString()))
        return self

    def raw(self, kind, payload):
        self.records.append(frame(kind, payload))
        return self

    def report(self, rank, **err):
        """An agent's report from rank (the record's length picks it: len % 10)."""
        self.records.append(frame(1, pad_error(pb.Error(**err), rank)))
        return self

    def lost(self, rank):
        self.records.append(frame(2, bytes([rank])))
        return self

    def bytes(self):
        return bytes([self.flags]) + b"".join(self.records)


def pad_error(err, rank):
    """err serialized with a message grown until its length is rank mod 10."""
    base = err.message
    for extra in range(0, 20):
        err.message = base + " " * extra
        data = err.SerializeToString()
        if len(data) % 10 == rank:
            return data
    raise AssertionError("no padding found")


def ints(*v):
    return pb.Arg(ints=pb.IntList(values=list(v)))


def ref(r):
    return pb.Arg(ref=r)


def refs(*r):
    return pb.Arg(refs=pb.RefList(refs=list(r)))


def call(op, args=(), kwargs=None, results=(), stream=0):
    kw = [pb.Kwarg(name=k, value=v) for k, v in (kwargs or {}).items()]
    return dict(call=pb.Call(op=op, args=list(args), kwargs=kw, results=list(results), stream=stream))


def factory(ref_, mesh=1, kind="zeros", shape=(2, 3), dtype=0, **kw):
    return dict(factory=pb.Factory(ref=ref_, mesh=mesh, kind=kind, shape=list(shape), dtype=dtype, **kw))


F32, F64, I64, BOOL = 1, 2, 9, 10


def sel_index(dim, i):
    return pb.MeshSelector(dim=dim, index=i)


def sel_range(dim, start, stop=None, step=0):
    r = pb.Range(start=start, step=step)
    if stop is not None:
        r.stop, r.has_stop = stop, True
    return pb.MeshSelector(dim=dim, range=r)


def command_seeds():
    s = []
    # Factories, an op, a reduce across the mesh, describe, drop, sync.
    s.append(("pipeline", Script()
              .cmd(**factory(10, shape=(4, 4)))
              .cmd(**call("add", [ref(10), ref(10)], results=[11]))
              .cmd(reduce=pb.Reduce(ref=12, input=11, dims=["gpu"], reduction="sum"))
              .cmd(describe=pb.Describe(ref=12))
              .cmd(drop=pb.Drop(refs=[10, 11]))
              .cmd(describe=pb.Describe(ref=10))
              .cmd(sync=pb.Sync())
              .bytes()))
    # Every factory kind, on a mesh made here (no prelude).
    sc = Script(prelude=False)
    sc.cmd(create_mesh=pb.CreateMesh(ref=1, dims=[pb.Dim(name="dp", size=2), pb.Dim(name="tp", size=2)]))
    sc.cmd(slice_mesh=pb.SliceMesh(ref=2, parent=1, selectors=[sel_range("tp", 0, 1)]))
    sc.cmd(**factory(3, mesh=1, kind="empty", shape=(3,), dtype=F64))
    sc.cmd(**factory(4, mesh=2, kind="ones", shape=(2, 2), dtype=I64))
    sc.cmd(**factory(5, mesh=1, kind="full", shape=(2,), value=7.5))
    sc.cmd(**factory(6, mesh=1, kind="arange", shape=(), start=0, end=10, step=2))
    sc.cmd(**factory(7, mesh=1, kind="rand", shape=(3, 3), seed=42, has_seed=True))
    sc.cmd(**factory(8, mesh=1, kind="randn", shape=(3,)))
    sc.cmd(**factory(9, mesh=1, kind="rank", shape=(), dim="tp"))
    sc.cmd(describe=pb.Describe(ref=2))
    s.append(("factories", sc.bytes()))
    # Views, in-place ops and their aliasing checks.
    s.append(("views_inplace", Script()
              .cmd(**factory(10, shape=(2, 3)))
              .cmd(**call("view", [ref(10), ints(3, 2)], results=[11]))
              .cmd(**call("transpose", [ref(10), pb.Arg(i=0), pb.Arg(i=1)], results=[12]))
              .cmd(**call("select", [ref(10), pb.Arg(i=0), pb.Arg(i=1)], results=[13]))
              .cmd(**call("slice", [ref(10)], {"dim": pb.Arg(i=1), "start": pb.Arg(i=1)}, results=[14]))
              .cmd(**call("expand", [ref(13), ints(4, 3)], results=[15]))
              .cmd(**call("add_", [ref(10), pb.Arg(f=1.0)]))
              .cmd(**call("copy_", [ref(12), ref(11)]))
              .cmd(**call("mul_", [ref(15), pb.Arg(i=2)]))
              .cmd(**call("zero_", [ref(14)], results=[16]))
              .cmd(**call("contiguous", [ref(12)], results=[17]))
              .bytes()))
    # Lists, keywords, several results, dtypes as strings.
    s.append(("lists_kwargs", Script()
              .cmd(**factory(10, shape=(2, 3)))
              .cmd(**factory(11, shape=(2, 3), dtype=I64))
              .cmd(**call("cat", [refs(10, 10)], {"dim": pb.Arg(i=1)}, results=[12]))
              .cmd(**call("stack", [refs(10, 10, 10)], results=[13]))
              .cmd(**call("max", [ref(10)], {"dim": pb.Arg(i=1), "keepdim": pb.Arg(b=True)}, results=[14, 15]))
              .cmd(**call("sum", [ref(10), ints(0, 1)], {"dtype": pb.Arg(dtype=F64)}, results=[16]))
              .cmd(**call("to", [ref(11), pb.Arg(s="float32")], results=[17]))
              .cmd(**call("where", [ref(11), ref(10), pb.Arg(f=0.0)], results=[18]))
              .cmd(**call("clamp", [ref(10)], {"min": pb.Arg(f=-1.0), "max": pb.Arg(none=True)}, results=[19]))
              .cmd(**call("index_select", [ref(10), pb.Arg(i=1), ref(11)], results=[20]))
              .cmd(**call("matmul", [ref(10), ref(13)], results=[21]))
              .bytes()))
    # Streams and borrows: borrow onto a stream, use, drop the borrow, drop.
    # Literals: replicated, per rank, on a stream, then read; one short, one too long.
    s.append(("literals", Script(batch=True)
              .cmd(literal=pb.Literal(ref=10, mesh=1, shape=[2, 2], dtype=F32,
                                      data=struct.pack("<4f", 1, 2, 3, 4)))
              .cmd(literal=pb.Literal(ref=11, mesh=1, shape=[2], dtype=I64, per_rank=True,
                                      data=struct.pack("<4q", 1, 2, 3, 4)))
              .cmd(**call("add", [ref(10), ref(10)], results=[12]))
              .cmd(literal=pb.Literal(ref=13, mesh=1, shape=[3], dtype=BOOL, data=b"\x01\x00"))
              .cmd(literal=pb.Literal(ref=14, mesh=1, shape=[], dtype=F64, data=b"\x00" * 16))
              .cmd(reduce=pb.Reduce(ref=15, input=11, dims=["gpu"], reduction="sum"))
              .cmd(sync=pb.Sync())
              .bytes()))
    s.append(("borrows", Script()
              .cmd(**factory(10, shape=(4,)))
              .cmd(borrow=pb.Borrow(ref=11, input=10, stream=3, mutable=False, borrow=12))
              .cmd(**call("neg", [ref(11)], results=[13], stream=3))
              .cmd(**call("add_", [ref(10), pb.Arg(f=1.0)]))
              .cmd(drop=pb.Drop(refs=[10]))
              .cmd(drop_borrow=pb.DropBorrow(borrow=12))
              .cmd(borrow=pb.Borrow(ref=14, input=10, stream=3, mutable=True, borrow=15))
              .cmd(**call("mul_", [ref(14), pb.Arg(f=2.0)], stream=3))
              .cmd(drop_borrow=pb.DropBorrow(borrow=15))
              .cmd(sync=pb.Sync(stream=3, has_stream=True))
              .cmd(drop=pb.Drop(refs=[10, 13]))
              .bytes()))
    # Moving between meshes, reductions of every kind.
    s.append(("to_mesh_reduce", Script()
              .cmd(**factory(10, shape=(2, 2)))
              .cmd(to_mesh=pb.ToMesh(ref=11, input=10, selection=[sel_index("host", 1)], dst_mesh=2))
              .cmd(reduce=pb.Reduce(ref=12, input=10, dims=["host"], reduction="avg", scatter=False))
              .cmd(reduce=pb.Reduce(input=10, reduction="max", inplace=True))
              .cmd(**factory(13, shape=(2, 2)))
              .cmd(reduce=pb.Reduce(input=10, out=13, dims=["host", "gpu"], reduction="sum"))
              .cmd(reduce=pb.Reduce(ref=14, input=11, dims=["gpu"], reduction="stack"))
              .cmd(**factory(15, shape=(8, 2)))
              .cmd(reduce=pb.Reduce(ref=16, input=15, dims=["gpu"], reduction="sum", scatter=True))
              .cmd(sync=pb.Sync())
              .bytes()))
    # Failures from agents: a root failure, then work that depends on it; a loss.
    s.append(("agent_failures", Script()
              .cmd(**factory(10, shape=(2,)))
              .report(3, kind=14, message="cpu kernel failed", ref=10, seq=1)
              .cmd(**call("add", [ref(10), pb.Arg(i=1)], results=[11]))
              .cmd(describe=pb.Describe(ref=11))
              .report(5, kind=15, message="depends", ref=11)
              .report(0, kind=0, message="(rank 0) no ref")
              .lost(6)
              .cmd(sync=pb.Sync())
              .cmd(**factory(12, mesh=2, shape=(2,)))
              .bytes()))
    # Quota of 4 KiB, and an agent capacity of 16 MiB.
    s.append(("quota", Script(quota=2)
              .cmd(**factory(10, shape=(16,)))
              .cmd(**factory(11, shape=(1024,)))
              .cmd(**factory(12, mesh=2, shape=(1 << 23,)))
              .cmd(drop=pb.Drop(refs=[10]))
              .cmd(**factory(13, shape=(64,)))
              .bytes()))
    # Broken and hostile commands: every one must be refused cleanly.
    bad = Script()
    bad.cmd()  # no kind
    bad.cmd(**factory(3))  # ref reused
    bad.cmd(**factory(0))  # ref 0
    bad.cmd(**call("add\0evil", [ref(3)], results=[20]))
    bad.cmd(**call("nosuchop", [], results=[21]))
    bad.cmd(**call("zeros", [ints(2)], results=[22]))
    bad.cmd(**factory(23, shape=(1 << 31, 1 << 31, 1 << 31)))
    bad.cmd(**factory(24, shape=(-1,)))
    bad.cmd(**factory(25, kind="weird"))
    bad.cmd(**factory(26, dtype=99))
    bad.cmd(slice_mesh=pb.SliceMesh(ref=27, parent=1, selectors=[sel_range("gpu", 0, 4, (1 << 63) - 1)]))
    bad.cmd(slice_mesh=pb.SliceMesh(ref=28, parent=1, selectors=[sel_index("gpu", 9)]))
    bad.cmd(slice_mesh=pb.SliceMesh(ref=29, parent=1, selectors=[sel_index("gpu", 0), sel_index("gpu", 1)]))
    bad.cmd(create_mesh=pb.CreateMesh(ref=30, dims=[pb.Dim(name="x", size=1 << 40)]))
    bad.cmd(create_mesh=pb.CreateMesh(ref=31, dims=[pb.Dim(name="9bad", size=2)]))
    # accepted since names are labels: a second "side" (the prelude made ref 3)
    bad.cmd(create_stream=pb.CreateStream(ref=32, name="side"))
    bad.cmd(drop=pb.Drop(refs=[1]))
    bad.cmd(borrow=pb.Borrow(ref=34, input=1, stream=3, borrow=33))
    bad.cmd(to_mesh=pb.ToMesh(ref=35, input=999, dst_mesh=2))
    bad.cmd(reduce=pb.Reduce(ref=36, input=1, reduction="median"))
    bad.cmd(drop_borrow=pb.DropBorrow(borrow=3))
    bad.cmd(sync=pb.Sync(stream=1, has_stream=True))
    bad.raw(0, b"\x08\x01\x72\x05\x0a\x03ad")  # truncated Call
    bad.raw(0, b"\xff\xff\xff")  # not a message
    bad.raw(1, b"\x10")  # truncated Error
    s.append(("rejections", bad.bytes()))
    # The session and tensor limits (fuzz_commands.c: 48 refs, 6 meshes, 3 streams,
    # 24 refs per command, 8 dims, 2^34 elements).
    lim = Script(limits=True)
    for i in range(4):
        lim.cmd(create_stream=pb.CreateStream(ref=10 + i, name=f"s{i}"))
    for i in range(5):
        lim.cmd(slice_mesh=pb.SliceMesh(ref=20 + i, parent=1, selectors=[sel_index("gpu", i % 4)]))
    lim.cmd(**factory(30, shape=(1,) * 9))
    lim.cmd(**factory(31, shape=(1 << 20, 1 << 15)))
    for i in range(40):
        lim.cmd(**factory(40 + i, shape=(2,)))
    lim.cmd(drop=pb.Drop(refs=list(range(40, 70))))
    lim.cmd(drop=pb.Drop(refs=list(range(40, 60))))
    lim.cmd(**factory(90, shape=(2,)))
    s.append(("limits", lim.bytes()))
    # Many refs and results in one Call; a long Drop.
    many = Script()
    many.cmd(**factory(10, shape=(2,)))
    many.cmd(**call("add", [ref(10)] * 20, results=list(range(11, 31))))
    many.cmd(**call("cat", [refs(*([10] * 70))], results=[40]))
    many.cmd(drop=pb.Drop(refs=list(range(1, 60))))
    s.append(("large_lists", many.bytes()))
    s += every_op_seeds()
    return s


def every_op_seeds():
    """One Call per op of the catalogue, on tensors like fuzz_ops_bind.c's fixed ones,
    split into files of 12 ops."""
    setup = Script()
    setup.cmd(**factory(10, shape=(2, 3)))
    setup.cmd(**factory(11, shape=(3,)))
    setup.cmd(**factory(12, shape=()))
    setup.cmd(**factory(13, shape=(2, 3), dtype=I64))
    setup.cmd(**factory(14, shape=(2, 1), dtype=BOOL))
    setup.cmd(**factory(15, shape=(4, 2, 3), dtype=3))
    setup.cmd(**call("t", [ref(10)], results=[16]))
    setup.cmd(**call("expand", [ref(11), ints(2, 3)], results=[17]))
    remap = {1: 10, 2: 11, 3: 12, 4: 13, 5: 14, 6: 15, 7: 16, 8: 17}
    seeds, sc, result = [], None, 100
    for i, (name, sig) in enumerate(op_names()):
        if i % 12 == 0:
            if sc:
                seeds.append((f"every_op_{len(seeds)}", sc.bytes()))
            sc = Script()
            sc.records = list(setup.records)
            sc.seq = setup.seq
        params = parse_params(sig)
        args = [default_arg(t, n) for t, n, has_def, kw in params if not has_def and not kw]
        for a in args:
            if a.HasField("ref"):
                a.ref = remap[a.ref]
            elif a.HasField("refs"):
                a.refs.refs[:] = [remap[r] for r in a.refs.refs]
        if all(t.rstrip("?") not in ("Tensor", "Tensor[]", "Tensor|Scalar") for t, *_ in params):
            kind_args = dict(shape=(2,), dim="gpu") if name != "arange" else dict(start=0, end=4, step=1)
            sc.cmd(**factory(result, kind=name, **kind_args))
        else:
            nres = 2 if name in ("max", "min") else 1
            sc.cmd(**call(name, args, results=list(range(result, result + nres))))
        result += 2
    seeds.append((f"every_op_{len(seeds)}", sc.bytes()))
    return seeds


def dictionary(path, words):
    """A libFuzzer dictionary (-dict=): each word as a protobuf string would carry it."""
    with open(path, "w") as f:
        f.write("# Written by make_corpus.py: names the targets' inputs use.\n")
        for w in sorted(set(words)):
            f.write('"%s"\n' % w)
    print(f"{os.path.relpath(path, ROOT)}: {len(set(words))} words")


def words():
    names = [n for n, _ in op_names()]
    params = [p[1] for _, sig in op_names() for p in parse_params(sig)]
    return names + params + [
        "empty", "zeros", "ones", "full", "arange", "rand", "randn", "rank",
        "sum", "avg", "product", "min", "max", "band", "bor", "bxor", "stack",
        "host", "gpu", "dp", "tp", "side", "main",
        "float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64",
        "bool", "floor", "trunc", "tanh", "none"]


# ---------------------------------------------------------------- ops_bind

def op_names():
    """(name, parameter list) of every op in core/tensor/ops.c's table, in order."""
    with open(os.path.join(ROOT, "core", "tensor", "ops.c")) as f:
        text = f.read()
    ops = []
    for m in re.finditer(r'OP\(((?:\s*"[^"]*")+)', text):
        schema = "".join(re.findall(r'"([^"]*)"', m.group(1)))
        name, rest = schema.split("(", 1)
        depth, end = 1, 0
        for end, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        ops.append((name, rest[:end]))
    return ops


def default_arg(ptype, pname):
    """A plausible value for a schema parameter, for the fixed tensors of fuzz_ops_bind.c
    (ref 1: float32 [2, 3], 2: float32 [3], 3: float32 [], 4: int64 [2, 3], 5: bool [2, 1],
    6: float16 [4, 2, 3], 7: the transpose of 1, 8: 1 expanded)."""
    t = ptype.rstrip("?")
    if t.startswith("Tensor[]"):
        return refs(1, 1)
    if t.startswith("Tensor"):
        return ref(4 if pname == "index" else 5 if pname == "condition" else 1)
    if t == "Scalar":
        return pb.Arg(f=2.0)
    if t == "int[]":
        return ints(3, 2) if pname in ("size", "shape") else ints(1, 0) if pname == "dims" else ints(1)
    if t == "int":
        return pb.Arg(i=1 if pname in ("dim1", "length", "index", "end") else 0)
    if t == "float":
        return pb.Arg(f=0.5)
    if t == "bool":
        return pb.Arg(b=False)
    if t == "ScalarType":
        return pb.Arg(dtype=F64)
    if t == "str":
        return pb.Arg(s="gpu" if pname == "dim" else "none")
    raise AssertionError(ptype)


def parse_params(sig):
    params, kwonly = [], False
    for p in re.split(r",\s*", sig):
        p = p.strip()
        if not p:
            continue
        if p == "*":
            kwonly = True
            continue
        m = re.match(r"([A-Za-z\[\]|?]+)(?:\([a-z!]+\))?\??\s+([a-z_0-9]+)(=.*)?", p)
        assert m, p
        params.append((m.group(1), m.group(2), m.group(3) is not None, kwonly))
    return params


def ops_seeds():
    s = []
    for name, sig in op_names():
        params = parse_params(sig)
        args = [default_arg(t, n) for t, n, has_def, kw in params if not has_def and not kw]
        c = pb.Call(op=name, args=args, results=[100])
        s.append((f"call_{name}", b"\x01" + c.SerializeToString()))
        kwargs = [pb.Kwarg(name=n, value=default_arg(t, n)) for t, n, has_def, kw in params if has_def]
        if kwargs:
            c = pb.Call(op=name, args=args, kwargs=kwargs, results=[100])
            s.append((f"call_{name}_kwargs", b"\x01" + c.SerializeToString()))
    # Odd ones: a strided view, an unknown ref, wrong kinds, a NUL in the name.
    s.append(("view_of_transpose", b"\x01" + pb.Call(op="view", args=[ref(7), ints(6)]).SerializeToString()))
    s.append(("expanded_inplace", b"\x01" + pb.Call(op="add_", args=[ref(8), ref(1)]).SerializeToString()))
    s.append(("unknown_ref", b"\x01" + pb.Call(op="neg", args=[ref(99)]).SerializeToString()))
    s.append(("wrong_kinds", b"\x01" + pb.Call(op="sum", args=[pb.Arg(s="x"), pb.Arg(f=1.5)]).SerializeToString()))
    s.append(("nul_name", b"\x01" + pb.Call(op="add\0x", args=[ref(1), ref(1)]).SerializeToString()))
    s.append(("big_shape", b"\x01" + pb.Call(op="expand", args=[ref(3), ints(*([1 << 40] * 3))]).SerializeToString()))
    s.append(("truncated", b"\x01\x0a\x05ad"))
    # The byte-built form: op index, then choices (fuzz_ops_bind.c gen_call).
    for op in range(0, len(op_names()), 7):
        s.append((f"built_{op}", bytes([0, op, 2, 1, 2, 3, 2, 0, 2, 3, 0, 1, 3, 5, 0, 1, 4, 6, 1])))
    return s


# ---------------------------------------------------------------- shapes

def shape_seeds():
    """Choice streams as fuzz_shapes.c reads them: a case byte (layout 0,
    broadcast 1, wrap_dim 2, ndslice 3, mesh 4), then its arguments."""
    s = []
    # layout: ndim byte, sizes (byte < 200: value % 9), element size index, ctx flag, ...
    s.append(("layout_2x3", bytes([0, 2, 2, 3, 2, 1, 1])))
    s.append(("layout_empty_big", bytes([0, 3, 0, 240, 0x46, 240, 0x46, 3, 1])))
    s.append(("layout_scalar", bytes([0, 0, 0, 1, 1])))
    s.append(("broadcast", bytes([1, 2, 3, 0, 2, 0, 3, 1, 0, 4, 0, 2, 0, 3, 0, 1])))
    s.append(("broadcast_mismatch", bytes([1, 1, 1, 0, 3, 0, 2])))
    s.append(("wrap_dim", bytes([2, 0x3f, 3, 0, 2, 7, 0, 1])))
    # ndslice: dense flag, ndim, sizes; then rounds of at/select
    s.append(("ndslice_dense", bytes([3, 1, 3, 2, 3, 4, 0, 0, 1, 1, 0, 1, 0, 0, 1, 2])))
    s.append(("ndslice_strided", bytes([3, 0, 3, 0, 0, 2, 1, 1, 2, 1, 3, 1, 5, 0, 1, 0, 0])))
    # mesh: ndim, (name, size) per dim, the path byte (>= 64: CreateMesh), world, holes,
    # capacity (flag, value), bytes per rank, then slices: nsel, (name, index/range...)
    # per selector, ref
    s.append(("mesh_host_gpu", bytes([4, 2, 0, 2, 8, 4, 200, 8, 0, 1, 8, 1, 0, 1, 9, 1, 8, 0, 9, 0, 1, 3, 0])))
    s.append(("mesh_range_step", bytes([4, 2, 0, 2, 8, 8, 200, 16, 0, 0, 0x4a, 9, 1, 8, 0, 9, 1, 8, 10, 2, 0])))
    s.append(("mesh_big", bytes([4, 3, 0, 8, 8, 8, 16, 8, 10, 1, 8, 2, 0, 1, 0, 8, 0, 0x4e])))
    s.append(("mesh_bad_names", bytes([4, 2, 7, 3, 0x39, 0x61, 0x62, 2, 0, 2, 200, 8, 0])))
    return s


def main():
    write("commands", command_seeds())
    write("ops_bind", ops_seeds())
    write("shapes", shape_seeds())
    dictionary(os.path.join(HERE, "meshd.dict"), words())


if __name__ == "__main__":
    sys.exit(main())
