#!/usr/bin/python3
"""Writes the seed corpus of fuzz_agent_instructions: realistic instruction
batches as the server emits them (factories, calls, one-member reduces,
borrow phases, local copies, deletes), each a packed InstructionBatch after
a 0x00 mode byte, and a few inputs for the target's structured builder
(mode byte 0x01).

    /usr/bin/python3 tests/fuzz/make_agent_instructions_corpus.py
"""

import os
import random
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(HERE, "corpus", "agent_instructions")

gen = tempfile.mkdtemp(prefix="meshd-fuzz-pb-")
api = os.path.join(ROOT, "api")
subprocess.run(["protoc", "--proto_path=" + api, "--python_out=" + gen,
                "meshd/v1/tensor_service.proto", "meshd/agent/v1/agent.proto"], check=True)
sys.path.insert(0, gen)
from meshd.agent.v1 import agent_pb2 as A  # noqa: E402
from meshd.v1 import tensor_service_pb2 as T  # noqa: E402

F32, I64 = T.DTYPE_FLOAT32, T.DTYPE_INT64


def spec(ref, shape, dtype=F32, storage=None):
    strides, s = [], 1
    for n in reversed(shape):
        strides.insert(0, s)
        s *= max(n, 1)
    return A.TensorSpec(ref=ref, shape=shape, strides=strides, dtype=dtype,
                        storage=storage if storage is not None else ref)


class Batch:
    def __init__(self, session="0123456789abcdef0123456789abcdef"):
        self.b = A.InstructionBatch()
        self.session = session

    def ins(self, stream=0, session=None):
        i = self.b.instructions.add()
        i.seq = len(self.b.instructions)
        i.session_id = session or self.session
        i.stream = stream
        return i

    def factory(self, ref, kind, shape, dtype=F32, stream=0, session=None, result=None, **kw):
        """result: the result's shape when it is not `shape` (arange, rank)."""
        i = self.ins(stream, session)
        i.factory.factory.CopyFrom(T.Factory(ref=ref, kind=kind, shape=shape, dtype=dtype, **kw))
        i.factory.result.CopyFrom(spec(ref, shape if result is None else result,
                                       I64 if kind == "rank" else dtype))
        return i

    def call(self, op, args, results, stream=0, kwargs=()):
        i = self.ins(stream)
        i.call.op = op
        for a in args:
            arg = i.call.args.add()
            if isinstance(a, tuple) and a[0] == "ref":
                arg.ref = a[1]
            elif isinstance(a, tuple) and a[0] == "refs":
                arg.refs.refs.extend(a[1])
            elif isinstance(a, list):
                arg.ints.values.extend(a)
            elif isinstance(a, bool):
                arg.b = a
            elif isinstance(a, int):
                arg.i = a
            elif isinstance(a, float):
                arg.f = a
        for name, v in kwargs:
            kw = i.call.kwargs.add(name=name)
            if isinstance(v, float):
                kw.value.f = v
            else:
                kw.value.i = v
        for r in results:
            i.call.results.add().CopyFrom(r)
        return i

    def reduce(self, red, inp, res, stream=0, ranks=(0,), **kw):
        i = self.ins(stream)
        i.reduce.reduce.CopyFrom(T.Reduce(reduction=red, input=inp.ref,
                                          ref=0 if kw.get("inplace") or kw.get("out") else res.ref,
                                          **kw))
        i.reduce.input.CopyFrom(inp)
        i.reduce.result.CopyFrom(res)
        i.reduce.group.ranks.extend(ranks)
        i.reduce.group.addresses.extend(f"127.0.0.1:{7000 + r}" for r in ranks)
        i.reduce.group.comm_id = 0x5eed
        return i

    def borrow(self, phase, stream, borrow=1, tensor=1, result=2, frm=0, to=1):
        i = self.ins(stream)
        i.borrow.CopyFrom(A.BorrowOp(phase=phase, borrow=borrow, tensor=tensor, result=result,
                                     from_stream=frm, to_stream=to))
        return i

    def delete(self, *refs, stream=0):
        self.ins(stream).delete_refs.refs.extend(refs)

    def bytes(self):
        return b"\x00" + self.b.SerializeToString()


def seeds():
    out = {}

    b = Batch()
    b.factory(1, "ones", [4])
    b.factory(2, "arange", [], result=[4], start=0, end=4, step=1)
    b.call("add", [("ref", 1), ("ref", 2)], [spec(3, [4])])
    b.call("mul", [("ref", 3), 2.0], [spec(4, [4])])
    b.call("sum", [("ref", 4)], [spec(5, [])])
    b.delete(1, 2)
    out["elementwise"] = b

    b = Batch()
    b.factory(1, "rand", [2, 3], seed=7, has_seed=True)
    b.factory(2, "randn", [3, 2], seed=8, has_seed=True)
    b.call("matmul", [("ref", 1), ("ref", 2)], [spec(3, [2, 2])])
    b.call("mm", [("ref", 1), ("ref", 2)], [spec(4, [2, 2])])
    b.call("softmax", [("ref", 3), 1], [spec(5, [2, 2])])
    b.call("transpose", [("ref", 1), 0, 1],
           [A.TensorSpec(ref=6, shape=[3, 2], strides=[1, 3], dtype=F32, storage=1)])
    b.call("clone", [("ref", 6)], [spec(7, [3, 2])])
    out["matmul_views"] = b

    b = Batch()
    b.factory(1, "ones", [4])
    b.reduce("sum", spec(1, [4]), spec(2, [4]))
    b.reduce("avg", spec(1, [4]), spec(3, [4]))
    b.reduce("stack", spec(1, [4]), spec(4, [1, 4]))
    b.factory(5, "full", [1, 4], value=3.0)
    b.reduce("max", spec(5, [1, 4]), spec(6, [4]), scatter=True)
    b.reduce("sum", spec(1, [4]), spec(1, [4]), inplace=True)
    b.factory(7, "zeros", [4])
    b.reduce("sum", spec(1, [4]), spec(7, [4]), out=7)
    b.factory(8, "ones", [4], dtype=I64)
    b.reduce("bxor", spec(8, [4], I64), spec(9, [4], I64))
    out["reduce_one_member"] = b

    b = Batch()
    b.factory(1, "ones", [4], stream=0)
    b.borrow(A.BorrowOp.CREATE, 0)
    b.call("add", [("ref", 2), 1.0], [spec(3, [4])], stream=1)
    b.borrow(A.BorrowOp.LAST_USE, 1)
    b.borrow(A.BorrowOp.DROP, 0)
    b.call("add_", [("ref", 1), 1.0], [spec(4, [4], storage=1)])
    out["borrow_phases"] = b

    b = Batch()
    b.factory(1, "ones", [2, 2])
    i = b.ins()
    i.send.CopyFrom(A.SendTensor(input=spec(1, [2, 2]), result=spec(2, [2, 2]), to_rank=0,
                                 from_rank=0, to_stream=1, comm_id=9))
    i = b.ins()
    i.send.CopyFrom(A.SendTensor(input=spec(1, [2, 2]), to_rank=1, from_rank=0, comm_id=9,
                                 peer_address="127.0.0.1:7001"))
    b.reduce("sum", spec(1, [2, 2]), spec(3, [2, 2]), ranks=(0, 1))
    out["sends_and_groups"] = b

    b = Batch()
    b.factory(1, "ones", [4])
    big = 1 << 31
    b.reduce("sum", spec(1, [big, big, big]), spec(2, [big, big, big]))
    b.call("add", [("ref", 2), ("ref", 1)], [spec(3, [4])])
    b.call("add", [("ref", 1), ("ref", 1)], [spec(1, [4])])
    out["planted_shape"] = b

    b = Batch()
    b.ins().status.SetInParent()
    b.ins(stream=3).create_stream.name = "side"
    i = b.factory(1, "rank", [], dtype=0, dim="x")
    i.factory.coordinate = 2
    lost = b.ins().peer_lost
    lost.rank = 1
    lost.data_address = "127.0.0.1:7001"
    lost.reason = "lost at 12:00:00.000 UTC"
    b.ins().end_session.SetInParent()
    b.factory(2, "zeros", [3], session="other-session")
    out["lifecycle"] = b

    b = Batch()
    b.factory(1, "arange", [], dtype=I64, result=[6], start=0, end=6, step=1)
    b.call("reshape", [("ref", 1), [2, 3]],
           [A.TensorSpec(ref=2, shape=[2, 3], strides=[3, 1], dtype=I64, storage=1)])
    b.call("cat", [("refs", [2, 2, 2]), 0], [spec(3, [6, 3], I64)])
    b.call("index_select", [("ref", 3), 0, ("ref", 1)], [spec(4, [6, 3], I64)])
    b.call("ne", [("ref", 1), 0], [spec(5, [6], T.DTYPE_BOOL)])
    b.call("where", [("ref", 5), ("ref", 1), 0], [spec(6, [6], I64)])
    b.call("stack", [("refs", [1, 1]), 1], [spec(7, [6, 2], I64)])
    out["views_lists_index"] = b

    b = Batch()  # literals: one that fits, one short, one read by an op
    i = b.ins()
    i.literal.CopyFrom(A.LiteralOp(result=spec(1, [2]), data=struct.pack("<2f", 1.5, -2.0)))
    i = b.ins()
    i.literal.CopyFrom(A.LiteralOp(result=spec(2, [4]), data=b"\x00" * 12))
    b.call("add", [("ref", 1), ("ref", 1)], [spec(3, [2])])
    out["literals"] = b

    rnd = random.Random(13)
    for k in range(6):
        out[f"structured_{k}"] = bytes([1] + [rnd.randrange(256) for _ in range(96 + 32 * k)])
    return out


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, b in seeds().items():
        data = b if isinstance(b, bytes) else b.bytes()
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
    print(f"{len(os.listdir(OUT))} files in {OUT}")


if __name__ == "__main__":
    main()
