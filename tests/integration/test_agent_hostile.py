"""Agents validate every instruction, Read and Write (issue 13): raw grpcio stubs
call an agent's Agent/Read, Agent/Write and Agent/Execute directly with hostile
messages; each gets a clear error, nothing is stored, and the agent stays up and
keeps computing.

Agents serve Execute, Read and Write only to the server they registered with,
which sends the call secret agreed at registration as metadata on every call (a
stranger's calls get UNAUTHENTICATED before reaching the checks this module
tests). So the agents here register through a meshd_testlib.FakeRegistry, which
relays to the real server or stands in for it, and the test's calls carry the
secret it saw (meshd_testlib.agent_channel)."""

import threading
import time

import grpc
import numpy as np
import pytest

import meshd_testlib as lib
from meshd_testlib import Ref, Session
from test_compute import fetch, op, upload

_AGENT = "/meshd.agent.v1.Agent/"
BIG = 1 << 31

_agent_pb2 = None


def apb():
    """meshd.agent.v1 messages, generated next to testlib's flat tensor_service_pb2
    (agent.proto's import made flat too, so no top-level `meshd` package shadows the
    Python client)."""
    global _agent_pb2
    if _agent_pb2 is None:
        _agent_pb2 = lib.agent_pb2()
    return _agent_pb2


def spec(ref, shape, dtype="float32"):
    return apb().TensorSpec(ref=ref, shape=list(shape), dtype=lib.dtype(dtype))


def agent_write(ch, session, sp, data, timeout=20):
    A = apb()
    fn = ch.stream_unary(_AGENT + "Write", request_serializer=lambda m: m.SerializeToString(),
                         response_deserializer=A.WriteReply.FromString)
    msgs = [A.DataChunk(session_id=session, spec=sp)]
    msgs += [A.DataChunk(session_id=session, data=data[i:i + (1 << 20)])
             for i in range(0, len(data), 1 << 20)]
    return fn(iter(msgs), timeout=timeout)


def agent_read(ch, session, ref, after_seq=0, timeout=20):
    A = apb()
    fn = ch.unary_stream(_AGENT + "Read", request_serializer=lambda m: m.SerializeToString(),
                         response_deserializer=A.DataChunk.FromString)
    data = bytearray()
    for c in fn(A.ReadRequest(session_id=session, ref=ref, after_seq=after_seq),
                timeout=timeout):
        if c.WhichOneof("part") == "data":
            data += c.data
    return bytes(data)


def refused(fn, code, *needles):
    with pytest.raises(grpc.RpcError) as e:
        fn()
    assert e.value.code() == code, f"{e.value.code()}: {e.value.details()}"
    for n in needles:
        assert n in e.value.details(), f"{e.value.details()!r} lacks {n!r}"
    return e.value


def computes(s, m, value):
    """The session still computes on every rank of mesh m."""
    a = np.full((2, 3), value, np.float32)
    x = upload(s, m, a)
    y = op(s, "add", Ref(x), Ref(x))
    for g in range(2):
        np.testing.assert_array_equal(fetch(s, y, gpu=g), 2 * a)


def test_hostile_reads_and_writes_store_nothing_and_the_agents_compute_on(meshd_server, agent):
    srv = meshd_server(0, min_agents=2)
    relay = lib.FakeRegistry(upstream=srv.address)  # learns the agents' call secrets
    try:
        # Agents check shapes against the limits they are given (a server's local
        # agents get its --max-tensor-dims/--max-tensor-elements); rank 0's are low.
        agent(relay.port, "--max-tensor-elements", 1 << 20, "--max-tensor-dims", 3, rank=0)
        agent(relay.port, rank=1)
        lib.wait_ready(srv, 2)
        _hostile_reads_and_writes(srv, relay)
    finally:
        relay.close()


def test_local_agents_are_given_the_servers_tensor_limits(meshd_server):
    # What the server checks a command against, its agents check the instruction
    # against (the Write refusals above show an agent applying the flags).
    srv = lib.wait_ready(meshd_server(1, "--max-tensor-elements", 4096, "--max-tensor-dims", 5), 1)
    (pid,) = lib.agent_children(srv.pid)
    argv = lib.proc_cmdline(pid)
    assert argv[argv.index("--max-tensor-elements") + 1] == "4096", argv
    assert argv[argv.index("--max-tensor-dims") + 1] == "5", argv


def _hostile_reads_and_writes(srv, relay):
    with Session(srv.port, "hostile-data") as s:
        m = s.mesh(gpu=2).ref
        computes(s, m, 1.5)
        agents = sorted(lib.list_agents(srv.port), key=lambda a: a.rank)
        ch = lib.agent_channel(agents[0].address, relay.secret_md(agents[0].address))
        held = agents[0].allocated_bytes
        code = grpc.StatusCode

        # Sessions the server never opened on the agent: nothing is kept. 20 x 1 MiB
        # at once (the report's 176 MB stayed on the agent for good).
        errors = []

        def invent(i):
            try:
                agent_write(ch, f"invented{i:02d}", spec(1, [1 << 18]), bytes(1 << 20))
                errors.append(None)
            except grpc.RpcError as e:
                errors.append(e)
        threads = [threading.Thread(target=invent, args=(i,)) for i in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(e is not None and e.code() == code.FAILED_PRECONDITION for e in errors), \
            [e and (e.code(), e.details()) for e in errors]
        assert "is not open on this agent" in errors[0].details()
        refused(lambda: agent_read(ch, "invented00", 1), code.NOT_FOUND,
                "session invented00 is not open on this agent")

        # The right session, wrong bytes or specs: refused, naming the numbers.
        refused(lambda: agent_write(ch, s.id, spec(900, [4]), bytes(17)), code.INVALID_ARGUMENT,
                "got at least 17 bytes for tensor 900, which needs 16")
        refused(lambda: agent_write(ch, s.id, spec(901, [4]), bytes(3)), code.INVALID_ARGUMENT,
                "got 3 bytes for tensor 901, which needs 16")
        refused(lambda: agent_write(ch, s.id, spec(902, [BIG, BIG, BIG]), bytes(4)),
                code.INVALID_ARGUMENT, "Write.spec.shape", "exceeds 2^62 bytes")
        refused(lambda: agent_write(ch, s.id, apb().TensorSpec(ref=903, shape=[4], dtype=99),
                                    bytes(16)), code.INVALID_ARGUMENT, "unknown dtype 99")
        refused(lambda: agent_write(ch, "bad id\x01", spec(904, [4]), bytes(16)),
                code.INVALID_ARGUMENT, "session_id")
        refused(lambda: agent_write(ch, s.id, spec(0, [4]), bytes(16)), code.INVALID_ARGUMENT,
                "Write.spec: ref 0")
        # Within the hard bounds, beyond this agent's flags.
        refused(lambda: agent_write(ch, s.id, spec(905, [1 << 21]), bytes(4)),
                code.RESOURCE_EXHAUSTED, "2097152 elements", "--max-tensor-elements")
        refused(lambda: agent_write(ch, s.id, spec(906, [1, 1, 1, 1]), bytes(4)),
                code.RESOURCE_EXHAUSTED, "4 dims", "--max-tensor-dims")
        # A Read streams only a Snapshot its server sent: none here.
        for ref in (900, 901, 902, 903, 905, 906):
            refused(lambda: agent_read(ch, s.id, ref), code.NOT_FOUND,
                    f"no snapshot of tensor {ref} at seq 0")

        # Reads for seqs never sent, and for nonsense sessions, take no thread.
        refused(lambda: agent_read(ch, s.id, 1, after_seq=1 << 40), code.FAILED_PRECONDITION,
                "far beyond")
        refused(lambda: agent_read(ch, "x" * 100, 1), code.INVALID_ARGUMENT, "session_id")

        # Nothing of that is held, and the agents compute on.
        time.sleep(1.2)  # the next report carries allocated_bytes (polled every second)
        after = lib.list_agents(srv.port)[0]
        assert after.healthy and after.allocated_bytes <= held, (held, after.allocated_bytes)
        computes(s, m, -2.0)
        ch.close()


def test_hostile_instructions_fail_cleanly_and_the_agent_computes_on(agent):
    # The agent registers with a fake registry, whose Hello gives it its rank: the
    # test is its server, and its raw Execute call below the only one.
    with lib.FakeRegistry() as reg:
        ag = agent(reg.port)
        reg.wait()
        reg.hello()
        _hostile_instructions(ag, reg)


def _hostile_instructions(ag, reg):
    info = type("Info", (), {"rank": reg.last[1]})
    A = apb()
    ch = reg.channel()
    sess = "0123456789abcdef0123456789abcdef"
    batches = []
    reports = []
    done = threading.Event()
    seq = [0]

    def ins(**body):
        seq[0] += 1
        return A.Instruction(seq=seq[0], session_id=sess, **body)

    def requests():
        while True:
            b = batches.pop(0) if batches else None
            if b is None:
                if done.is_set():
                    return
                time.sleep(0.01)
                continue
            yield b

    def executed(through, timeout=10):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if reports and reports[-1].executed_through >= through:
                return
            time.sleep(0.01)
        raise AssertionError(f"the agent did not execute through {through}: {reports[-1:]}")

    stream = ch.stream_stream(_AGENT + "Execute",
                              request_serializer=lambda m: m.SerializeToString(),
                              response_deserializer=A.AgentReport.FromString)
    call = stream(requests(), timeout=60)
    ended = []

    def read_reports():
        try:
            for r in call:
                reports.append(r)
            ended.append(None)
        except grpc.RpcError as e:
            ended.append(e)
    reader = threading.Thread(target=read_reports, daemon=True)
    reader.start()

    T = lib.tensor_pb2()
    group1 = A.Group(ranks=[info.rank], addresses=["127.0.0.1:1"], comm_id=7)
    group2 = A.Group(ranks=[info.rank, info.rank], addresses=["127.0.0.1:1", "127.0.0.1:2"],
                     comm_id=7)
    big = [BIG, BIG, BIG]
    batches.append(A.InstructionBatch(instructions=[
        ins(factory=A.FactoryOp(factory=T.Factory(ref=1, kind="ones", shape=[4],
                                                  dtype=lib.dtype("float32")),
                                result=spec(1, [4]))),
        # The report's crash: a one-member reduce planting a [2^31]^3 tensor.
        ins(reduce=A.ReduceOp(reduce=T.Reduce(reduction="sum", input=1, ref=2),
                              input=spec(1, big), result=spec(2, big), group=group1)),
        ins(reduce=A.ReduceOp(reduce=T.Reduce(reduction="sum", input=1, ref=3),
                              input=spec(1, [4]), result=spec(3, [4]), group=group2)),
        ins(call=A.OpCall(op="add", args=[T.Arg(ref=1), T.Arg(ref=1)], results=[spec(4, [5])])),
        ins(call=A.OpCall(op="no_such_op", results=[spec(5, [4])])),
        ins(borrow=A.BorrowOp(phase=9, borrow=1, tensor=1, result=6)),
        ins(factory=A.FactoryOp(factory=T.Factory(ref=7, kind="zeros", shape=[-1]),
                                result=spec(7, [4]))),
        ins(send=A.SendTensor(input=spec(1, [4]), to_rank=info.rank + 1,
                              from_rank=info.rank + 5)),
        ins(call=A.OpCall(op="mul", args=[T.Arg(ref=1), T.Arg(f=3.0)], results=[spec(8, [4])])),
    ]))
    executed(seq[0])
    errors = {e.seq: e.message for r in reports for e in r.errors}
    time.sleep(0.3)
    errors.update({e.seq: e.message for r in reports for e in r.errors})
    assert "ReduceOp.input.shape" in errors.get(2, "") and "exceeds 2^62 bytes" in errors[2], errors
    assert "listed twice" in errors.get(3, ""), errors
    assert "results[0] is float32 [5]" in errors.get(4, ""), errors
    assert "unknown op 'no_such_op'" in errors.get(5, ""), errors
    assert "unknown phase 9" in errors.get(6, ""), errors
    assert "negative size -1" in errors.get(7, ""), errors
    assert "a send from rank" in errors.get(8, ""), errors
    assert 9 not in errors, errors

    # Reading the planted result is a clear error, not a SIGFPE; the rest reads fine.
    snaps = [ins(snapshot=A.Snapshot(ref=2)), ins(snapshot=A.Snapshot(ref=8)),
             ins(snapshot=A.Snapshot(ref=0))]
    batches.append(A.InstructionBatch(instructions=snaps))
    executed(seq[0])
    refused(lambda: agent_read(ch, sess, 2, after_seq=snaps[0].seq), grpc.StatusCode.ABORTED,
            "exceeds 2^62 bytes")
    got = agent_read(ch, sess, 8, after_seq=snaps[1].seq)
    assert np.frombuffer(got, np.float32).tolist() == [3.0] * 4
    # A snapshot is read once; a hostile Snapshot fails its own Read.
    refused(lambda: agent_read(ch, sess, 8, after_seq=snaps[1].seq), grpc.StatusCode.NOT_FOUND,
            "no snapshot of tensor 8")
    refused(lambda: agent_read(ch, sess, 0, after_seq=snaps[2].seq),
            grpc.StatusCode.INVALID_ARGUMENT, "Snapshot.ref: ref 0")

    batches.append(A.InstructionBatch(instructions=[ins(end_session=A.EndSession())]))
    executed(seq[0])
    done.set()
    reader.join(10)
    assert ended == [None], f"the Execute call ended with {ended}"
    assert ag.proc.poll() is None, "the agent died"
    ch.close()
