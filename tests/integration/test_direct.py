"""The direct data path (issue 14 point 3; docs/protocol.md, Direct data path): the
Python client streams tensor bytes straight to and from the agents with grants the
server issues (PlanTransfer); agents refuse forged, expired, reused and misdirected
grants, and the server defines an upload only on its agents' receipts. In every
case of refusal the session and the pool go on working."""

import atexit
import json
import os
import re
import shutil
import sys
import tempfile

import grpc
import numpy as np
import pytest

import meshd_testlib as lib

sys.path.insert(0, os.path.join(lib.SOURCE_DIR, "clients", "python"))
if not os.environ.get("XDG_CACHE_HOME"):  # the client's generated modules: a cache of our own
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="meshd-direct-cache-")
    atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)
import meshd  # noqa: E402
from meshd import direct as _direct  # noqa: E402

AGENT = "/meshd.agent.v1.Agent/"
SVC = "/meshd.v1.TensorService/"


def connect(srv, data_path="auto", **kw):
    return meshd.connect(f"127.0.0.1:{srv.port}", data_path=data_path, timeout=30, **kw)


def plan(s, timeout=10, future=False, **what):
    """A raw PlanTransfer (upload=UploadHeader or fetch=FetchRequest); future: its
    grpc future instead of its answer."""
    pb = s._pb
    fn = s._ch.unary_unary(SVC + "PlanTransfer", request_serializer=lambda m: m.SerializeToString(),
                           response_deserializer=pb.PlanTransferReply.FromString)
    call = fn.future if future else fn
    return call(pb.PlanTransferRequest(**what), metadata=s._md, timeout=timeout)


def plan_fetch(s, t, **coords):
    pb = s._pb
    return plan(s, fetch=pb.FetchRequest(ref=t.ref, coords=[pb.Coordinate(dim=k, index=v)
                                                             for k, v in coords.items()]))


def _tensor_and_waiting_fetch(s):
    """(arr, t, req): six float32 on a one-rank mesh, and a FetchRequest of rank 0's
    shard that waits for a slot (wait_for_slot)."""
    pb = s._pb
    arr = np.arange(6, dtype=np.float32)
    with s.mesh(gpu=1).activate():
        t = meshd.tensor(arr)
    return arr, t, pb.FetchRequest(ref=t.ref, coords=[pb.Coordinate(dim="gpu", index=0)],
                                   wait_for_slot=True)


def plan_upload(s, mesh, arr):
    """(reply, ref) of a planned replicated float32 upload of arr onto mesh."""
    pb = s._pb
    with s._lock:
        ref = s._new_ref()
    hdr = pb.UploadHeader(ref=ref, mesh=mesh.ref, shape=list(arr.shape),
                          dtype=pb.DType.Value("DTYPE_FLOAT32"), total_bytes=arr.nbytes)
    return plan(s, upload=hdr), ref


def finish(s, method, req, reply_cls):
    fn = s._ch.unary_unary(SVC + method, request_serializer=lambda m: m.SerializeToString(),
                           response_deserializer=reply_cls.FromString)
    return fn(req, metadata=s._md, timeout=30)


def _agent_channel(address, creds=None, options=()):
    """A channel of its own to an agent: plaintext, or TLS with creds."""
    opts = [("grpc.use_local_subchannel_pool", 1)] + list(options)
    if creds is None:
        return grpc.insecure_channel(address, options=opts)
    return grpc.secure_channel(address, creds, options=opts)


def agent_read(shard, session_id, ref, after_seq=None, grant=None, creds=None, options=()):
    """Agent/Read under a grant (b"": none): the data bytes, or raises grpc.RpcError."""
    a = lib.agent_pb2()
    with _agent_channel(shard.address, creds, options) as ch:
        fn = ch.unary_stream(AGENT + "Read", request_serializer=lambda m: m.SerializeToString(),
                             response_deserializer=a.DataChunk.FromString)
        req = a.ReadRequest(session_id=session_id, ref=ref, max_chunk_bytes=1 << 20,
                            after_seq=shard.after_seq if after_seq is None else after_seq)
        g = shard.grant if grant is None else grant
        md = ((_direct.GRANT_MD, g),) if g else ()
        return b"".join(c.data for c in fn(req, metadata=md, timeout=10)
                        if c.WhichOneof("part") == "data")


def agent_write(shard, data, grant=None, creds=None, options=()):
    """Agent/Write under a grant: the WriteReply, or raises grpc.RpcError."""
    a = lib.agent_pb2()
    with _agent_channel(shard.address, creds, options) as ch:
        fn = ch.stream_unary(AGENT + "Write", request_serializer=lambda m: m.SerializeToString(),
                             response_deserializer=a.WriteReply.FromString)
        md = ((_direct.GRANT_MD, shard.grant if grant is None else grant),)
        return fn(iter([a.DataChunk(data=data)]), metadata=md, timeout=10)


def refused(fn, code, text):
    """fn's grpc.RpcError, with code (None: any) and text in its details."""
    with pytest.raises(grpc.RpcError) as ei:
        fn()
    e = ei.value
    assert code is None or e.code() == code, (e.code(), e.details())
    assert text in e.details(), e.details()
    return e


def flipped(grant, at):
    b = bytearray(grant)
    b[at] ^= 0x01
    return bytes(b)


def still_works(s, mesh):
    """A command and a fetch (the direct path, then the proxy) in the same session."""
    with mesh.activate():
        x = meshd.arange(6, dtype="float32")
        y = x * 3
        n = mesh.sizes[mesh.names[0]]
        for r in range(n):
            assert meshd.fetch_shard(y, **{mesh.names[0]: r}).result().tolist() == \
                [0.0, 3.0, 6.0, 9.0, 12.0, 15.0]
    with connect_like(s, "proxy") as p:
        m = p.mesh(gpu=1)
        with m.activate():
            assert meshd.fetch_shard(meshd.ones((2,)), gpu=0).result().tolist() == [1.0, 1.0]


def connect_like(s, data_path):
    return meshd.connect(s.addr, data_path=data_path, timeout=30)


def test_a_sessions_fetches_finished_unread_keep_at_most_64_grants_on_record(shared_meshd):
    """A direct fetch finished without its Read's receipt keeps its grant on record until
    the grant's expiry (10 minutes), for a tokens reload to revoke it: a client planning
    and finishing fetches it never reads grew that record without bound (each one a
    server allocation, walked under the data service's lock every 200 ms). Past 64 of a
    session's, the oldest is revoked on its agent at once, as a reload would."""
    srv = shared_meshd(2)
    with connect(srv, "direct") as s:
        pb = s._pb
        with s.mesh(gpu=2).activate():
            x = meshd.tensor(np.arange(4, dtype=np.float32))
        plans = []
        for _ in range(65):
            p = plan_fetch(s, x, gpu=0)
            finish(s, "FinishFetch", pb.FinishFetchRequest(transfer_id=p.transfer_id),
                   pb.FinishFetchReply)  # no receipt: its grant stays on record
            plans.append(p)
        # a fetch of the session's, after the 65th FinishFetch: the agent has its
        # instructions up to there, a revocation among them (each grant reads once)
        assert meshd.fetch_shard(x, gpu=0).result().tolist() == [0.0, 1.0, 2.0, 3.0]
        refused(lambda: agent_read(plans[0].shards[0], s.id, x.ref),
                grpc.StatusCode.PERMISSION_DENIED, "revoked")
        # the 64 newer ones stay on record (not revoked): the second's Read finds no snapshot
        e = refused(lambda: agent_read(plans[1].shards[0], s.id, x.ref), None, "")
        assert "revoked" not in e.details(), e.details()


@pytest.mark.parametrize("agents", [1, 4])
def test_direct_round_trip(meshd_server, shared_meshd, agents):
    """Replicated and sharded uploads and fetches take the direct path (both ways),
    with every rank's values right, for float32, int64, float16 and an empty tensor;
    the daemons then exit with no thread left behind."""
    # one agent: the module's server; four: one of its own (no other test needs four)
    srv = shared_meshd(1) if agents == 1 else lib.wait_ready(meshd_server(agents), agents)
    with connect(srv, "direct") as s:
        mesh = s.mesh(gpu=agents)
        rng = np.random.default_rng(7)
        with mesh.activate():
            rep = rng.standard_normal((300, 70)).astype(np.float32)  # 84 KB: one chunk
            big = rng.standard_normal((3 << 20) // 4).astype(np.float32)  # 3 MiB: 3 chunks
            shard = rng.integers(-1000, 1000, size=(agents, 5, 33), dtype=np.int64)
            half = rng.standard_normal((agents, 17)).astype(np.float16)
            t_rep, t_big = meshd.tensor(rep), meshd.tensor(big)
            t_shard, t_half = meshd.tensor(shard, shard="gpu"), meshd.tensor(half, shard="gpu")
            t_empty = meshd.tensor(np.zeros((0, 4), np.float32))
            futs = []
            for r in range(agents):
                futs.append((rep, meshd.fetch_shard(t_rep, gpu=r)))
                futs.append((big, meshd.fetch_shard(t_big, gpu=r)))
                futs.append((shard[r], meshd.fetch_shard(t_shard, gpu=r)))
                futs.append((half[r], meshd.fetch_shard(t_half, gpu=r)))
            for want, f in futs:
                got = f.result()
                assert got.dtype == want.dtype and got.shape == want.shape
                assert np.array_equal(got, want)
            # 16 fetches in flight (3 MiB ones among them): those that started while
            # another read ran were read on the session's io loop (direct.py, _IoLoop)
            assert s._direct._io._loop is not None, "no fetch was read on the io loop"
            assert meshd.fetch_shard(t_empty, gpu=0).result().shape == (0, 4)
            # computed on the agents from directly uploaded inputs, fetched directly
            z = (t_rep + 1) * 2
            assert np.allclose(meshd.fetch_shard(z, gpu=agents - 1).result(), (rep + 1) * 2)
        assert s._direct.counts["upload"] == 5, s._direct.counts
        assert s._direct.counts["fetch"] == 4 * agents + 2, s._direct.counts
        if agents == 4:  # a 2-D mesh: sharded along gpu, replicated along host
            m2 = s.mesh(host=2, gpu=2)
            b = rng.standard_normal((2, 3, 5)).astype(np.float64)
            with m2.activate():
                t = meshd.tensor(b, shard="gpu")
                for h in range(2):
                    for g in range(2):
                        assert np.array_equal(meshd.fetch_shard(t, host=h, gpu=g).result(), b[g])
    if agents == 4:  # its own server: each daemon ends with no thread of its own left
        # (the agents' grant watch, which the direct Reads and Writes started)
        assert lib.stop(srv) == 0
        log = srv.log_text()
        assert log.count("agent: stopped") == 4, log[-3000:]
        assert "still running at exit" not in log, log[-3000:]


def test_agents_refuse_bad_grants(shared_meshd):
    """A forged grant (one flipped byte, in its body or its MAC), a grant for another
    ref or session, a read grant on a Write (and the reverse), and a grant used twice
    are refused PERMISSION_DENIED naming the check; the Agent's other methods still
    want the call secret; afterwards the session and the pool work."""
    srv = shared_meshd(2)
    with connect(srv, "direct") as s:
        mesh = s.mesh(gpu=2)
        with mesh.activate():
            arr = np.arange(16, dtype=np.float32)
            x = meshd.tensor(arr)
            other = meshd.tensor(arr + 100)
        reply = plan_fetch(s, x, gpu=1)
        sh = reply.shards[0]
        assert sh.rank == 1 and list(reply.meta.shape) == [16]
        denied = grpc.StatusCode.PERMISSION_DENIED
        for at in (3, len(sh.grant) - 1):  # the body, the MAC
            refused(lambda: agent_read(sh, s.id, x.ref, grant=flipped(sh.grant, at)), denied,
                    "bad signature")
        refused(lambda: agent_read(sh, s.id, other.ref), denied, "wrong ref")
        refused(lambda: agent_read(sh, s.id, x.ref, after_seq=sh.after_seq + 1), denied,
                "wrong after_seq")
        refused(lambda: agent_read(sh, "0" * len(s.id), x.ref), denied, "wrong session")
        refused(lambda: agent_write(sh, arr.tobytes()), denied, "wrong direction")
        # none of those used it up: the grant still reads once, and only once
        assert np.frombuffer(agent_read(sh, s.id, x.ref), np.float32).tolist() == arr.tolist()
        refused(lambda: agent_read(sh, s.id, x.ref), denied, "reused")
        finish(s, "FinishFetch", s._pb.FinishFetchRequest(transfer_id=reply.transfer_id),
               s._pb.FinishFetchReply)

        # a write grant on a Read; rank 0's grant at rank 1's agent (signed with
        # another agent's secret, so it fails before its rank is even read)
        up, ref = plan_upload(s, mesh, arr)
        by_rank = {g.rank: g for g in up.shards}
        refused(lambda: agent_read(by_rank[0], s.id, ref, after_seq=0), denied, "wrong direction")
        wrong_agent = type(by_rank[0])(rank=0, address=by_rank[1].address, grant=by_rank[0].grant)
        refused(lambda: agent_write(wrong_agent, arr.tobytes()), denied, "bad signature")
        # a grant cannot replace the call secret for Execute or Hello
        a = lib.agent_pb2()
        with grpc.insecure_channel(by_rank[0].address) as ch:
            fn = ch.unary_unary(AGENT + "Hello", request_serializer=lambda m: m.SerializeToString(),
                                response_deserializer=a.HelloReply.FromString)
            refused(lambda: fn(a.HelloRequest(agent_id="x"), timeout=5,
                               metadata=((_direct.GRANT_MD, by_rank[0].grant),)),
                    grpc.StatusCode.UNAUTHENTICATED, "secret")
        receipts = []
        for g in up.shards:
            w = agent_write(g, arr.tobytes())
            assert w.bytes == arr.nbytes and len(w.receipt) == 32
            receipts.append(s._pb.WriteReceipt(rank=g.rank, bytes=w.bytes, receipt=w.receipt))
        refused(lambda: agent_write(up.shards[0], arr.tobytes()), denied, "reused")
        done = finish(s, "FinishUpload", s._pb.FinishUploadRequest(
            transfer_id=up.transfer_id, receipts=receipts), s._pb.FinishUploadReply)
        assert done.tensor.ref == ref and list(done.tensor.shape) == [16]
        # its answer lost, a client asks again: the same answer (it once was "no pending
        # upload", and the client raised with its tensor defined behind its back) ...
        again = finish(s, "FinishUpload", s._pb.FinishUploadRequest(
            transfer_id=up.transfer_id), s._pb.FinishUploadReply)
        assert again.tensor == done.tensor, again
        # ... while the tensor stands: dropped, it is not found
        meshd.Tensor(s, ref, (16,), "float32", mesh.ref, 0).drop()
        s.sync()
        refused(lambda: finish(s, "FinishUpload", s._pb.FinishUploadRequest(
            transfer_id=up.transfer_id), s._pb.FinishUploadReply),
            grpc.StatusCode.NOT_FOUND, "the tensor was dropped since")
        still_works(s, mesh)


def test_expired_grants_are_refused_and_undone(meshd_server):
    """With --transfer-grant-ms 600, a grant used late is refused as expired (Read and
    Write); an upload never finished is undone: its ref stays undefined, FinishUpload
    no longer knows it, and the session's transfer slots come back."""
    srv = meshd_server(2, "--transfer-grant-ms", "600", "--session-max-transfers", "2")
    lib.wait_ready(srv, 2)
    with connect(srv, "direct") as s:
        mesh = s.mesh(gpu=2)
        with mesh.activate():
            arr = np.arange(8, dtype=np.float32)
            x = meshd.tensor(arr)
        reply = plan_fetch(s, x, gpu=0)
        up, ref = plan_upload(s, mesh, arr)
        # both slots taken: a third transfer is refused naming the flag
        refused(lambda: plan_fetch(s, x, gpu=1), grpc.StatusCode.RESOURCE_EXHAUSTED,
                "--session-max-transfers")
        import time
        time.sleep(0.9)
        denied = grpc.StatusCode.PERMISSION_DENIED
        refused(lambda: agent_read(reply.shards[0], s.id, x.ref), denied, "expired")
        refused(lambda: agent_write(up.shards[0], arr.tobytes()), denied, "expired")
        time.sleep(2.5)  # the server undoes it past the expiry (and a slack)
        refused(lambda: finish(s, "FinishUpload", s._pb.FinishUploadRequest(
            transfer_id=up.transfer_id), s._pb.FinishUploadReply),
            grpc.StatusCode.NOT_FOUND, "no pending upload")
        with mesh.activate():
            t = meshd.Tensor(s, ref, (8,), "float32", mesh.ref, 0)
            with pytest.raises(meshd.MeshdError) as ei:
                (t + 1).shape
            assert ei.value.kind == "UNKNOWN_REF" and "never defined" in str(ei.value), ei.value
        still_works(s, mesh)


def test_a_planned_transfer_does_not_hold_its_sessions_lease(shared_meshd):
    """A client that plans a direct fetch and upload and then goes away: its session
    expires at its ttl, not at the grants' expiry (10 min by default). The plans keep
    the session's memory, not its lease; a client moving bytes keeps the lease with
    KeepAlive (every meshd client does), and a FinishFetch waiting holds it as a call.
    The module's server: its grants' 10 minutes are far past the 1 s ttl."""
    srv = shared_meshd(2)
    pb = lib.tensor_pb2()
    with lib.Session(srv.port, "planner", ttl_seconds=1) as s:
        m = s.mesh(gpu=2)
        x = s.tensor(m.ref, (8,))
        s.unary("PlanTransfer", pb.PlanTransferRequest(fetch=pb.FetchRequest(
            ref=x.ref, coords=[pb.Coordinate(dim="gpu", index=0)])), pb.PlanTransferReply)
        s.unary("PlanTransfer", pb.PlanTransferRequest(upload=pb.UploadHeader(
            ref=s.new_ref(), mesh=m.ref, shape=[8], dtype=pb.DType.Value("DTYPE_FLOAT32"),
            total_bytes=32)), pb.PlanTransferReply)
        import time
        end = time.monotonic() + 10
        while s.info() is not None:
            assert time.monotonic() < end, "the session outlived its 1 s lease by 10 s"
            time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as e:
            s.keep_alive()
        assert lib.trailer(e.value.trailing_metadata(), lib.KIND_MD) == "NO_SESSION", e.value


def test_a_plan_whose_answer_is_lost_gives_its_slot_back_when_its_call_ends(meshd_server):
    """A PlanTransfer whose client gave up before the answer came (its 0.5 s deadline
    passed while the server held the answer: --server-fault plan:slow) never told the
    client its transfer's id, so nobody will finish it. The server undoes it when the
    call ends, not at the grants' expiry (60 s here): the session's one transfer slot
    (--session-max-transfers 1) is free again within seconds, after a lost upload plan
    and a lost fetch plan alike; the lost upload's ref stays undefined, and the session
    works."""
    import time
    srv = meshd_server(2, "--transfer-grant-ms", "60000", "--session-max-transfers", "1",
                       "--server-fault", "plan:slow=1500,count=2")
    lib.wait_ready(srv, 2)
    pb = lib.tensor_pb2()
    with lib.Session(srv.port, "lost-plans") as s:
        m = s.mesh(gpu=2)
        x = s.tensor(m.ref, (8,), kind="ones")
        fetch = pb.PlanTransferRequest(fetch=pb.FetchRequest(
            ref=x.ref, coords=[pb.Coordinate(dim="gpu", index=1)]))
        lost_ref = s.new_ref()
        upload = pb.PlanTransferRequest(upload=pb.UploadHeader(
            ref=lost_ref, mesh=m.ref, shape=[8], dtype=pb.DType.Value("DTYPE_FLOAT32"),
            total_bytes=32))
        def admitted(req, timeout):
            """PlanTransfer, asked again while the session's slot is taken (8 s at most)."""
            end = time.monotonic() + 8
            while True:
                try:
                    return s.unary("PlanTransfer", req, pb.PlanTransferReply, timeout=timeout)
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise
                    assert "--session-max-transfers" in err.details(), err.details()
                    assert time.monotonic() < end, \
                        "a lost plan held the session's transfer slot 8 s (until its grants expire)"
                    time.sleep(0.1)

        # the two plans held by the fault are lost; each frees the slot once the
        # server's answer finds its call over, so the next one gets in
        for lost in (upload, fetch):
            with pytest.raises(grpc.RpcError) as e:
                admitted(lost, 0.5)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.value
        # a plan whose answer came is the client's to finish, as ever
        reply = admitted(fetch, 10)
        s.unary("FinishFetch", pb.FinishFetchRequest(transfer_id=reply.transfer_id),
                pb.FinishFetchReply, timeout=10)
        e = s.fails("UNKNOWN_REF", lib.call("add", lib.Ref(lost_ref), 1.0, results=[s.new_ref()]))
        assert "never defined" in str(e), e
        assert s.op("add", lib.Ref(x.ref), 1.0)[0].ref
    assert "the direct upload is undone" in open(srv.log).read()


def _agent_metric(port, name):
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no {name} on the agent's /metrics")


def _until(fn, seconds, what):
    import time
    end = time.monotonic() + seconds
    while not fn():
        assert time.monotonic() < end, what
        time.sleep(0.05)


def test_a_stalled_direct_write_or_read_ends_at_its_grants_expiry(meshd_server):
    """A client that stalls mid-Write or mid-Read under a grant holds nothing past the
    grant's expiry: the agent ends the call then (PERMISSION_DENIED naming the expiry;
    the client's own deadline is far later), and frees the half-written tensor and the
    snapshot the Read held of a tensor dropped meanwhile (meshd_agent_allocated_bytes),
    though neither client moves; the Read stops short; both are counted
    (meshd_transfer_calls_expired_total); the ref stays undefined and the session
    works."""
    import threading
    import time
    mport = lib.free_port()
    srv = meshd_server(1, "--transfer-grant-ms", "2500", "--local-agent-metrics-port-base",
                       str(mport))
    lib.wait_ready(srv, 1)
    a = lib.agent_pb2()
    denied = grpc.StatusCode.PERMISSION_DENIED
    with connect(srv, "direct") as s:
        mesh = s.mesh(gpu=1)
        big = np.arange(16 << 20, dtype=np.float32)  # 64 MiB: more than gRPC buffers
        with mesh.activate():
            x = meshd.tensor(big)
            s.sync()
        alloc0 = _agent_metric(mport, "meshd_agent_allocated_bytes")
        up, ref = plan_upload(s, mesh, big[:1 << 20])  # 4 MiB
        rd = plan_fetch(s, x, gpu=0)
        t0 = time.monotonic()
        stall = threading.Event()

        def chunks():
            yield a.DataChunk(data=big[:1 << 18].tobytes())  # a quarter
            stall.wait(30)

        with _agent_channel(up.shards[0].address) as wch, \
                _agent_channel(rd.shards[0].address) as rch:
            write = wch.stream_unary(AGENT + "Write",
                                     request_serializer=lambda m: m.SerializeToString(),
                                     response_deserializer=a.WriteReply.FromString)
            wf = write.future(chunks(), metadata=((_direct.GRANT_MD, up.shards[0].grant),),
                              timeout=20)
            read = rch.unary_stream(AGENT + "Read",
                                    request_serializer=lambda m: m.SerializeToString(),
                                    response_deserializer=a.DataChunk.FromString)
            it = read(a.ReadRequest(session_id=s.id, ref=x.ref, max_chunk_bytes=1 << 20,
                                    after_seq=rd.shards[0].after_seq),
                      metadata=((_direct.GRANT_MD, rd.shards[0].grant),), timeout=20)
            got = sum(len(c.data) for c in [next(it), next(it)])
            # while the Write stalls, the agent holds its whole tensor; the Read holds
            # x's bytes (its snapshot) after x is dropped
            _until(lambda: _agent_metric(mport, "meshd_agent_allocated_bytes") >= alloc0 + (4 << 20),
                   2, "the stalled Write's tensor was never allocated")
            x.drop()
            s.sync()
            assert _agent_metric(mport, "meshd_agent_allocated_bytes") >= alloc0 + (4 << 20)
            with pytest.raises(grpc.RpcError) as ei:
                wf.result(timeout=15)
            took = time.monotonic() - t0
            assert ei.value.code() == denied, (ei.value.code(), ei.value.details())
            assert "transfer grant expired before the Write finished" in ei.value.details()
            assert "nothing was stored" in ei.value.details()
            assert 2.0 < took < 6.0, took  # at the 2.5 s expiry, not the 20 s deadline
            # both let go at the expiry, though neither client moved since
            _until(lambda: _agent_metric(mport, "meshd_agent_allocated_bytes") <= alloc0 - big.nbytes,
                   3, "the stalled Write's tensor or the stalled Read's snapshot is still held")
            stall.set()
            # the Read, not read meanwhile, was reset at its expiry too
            with pytest.raises(grpc.RpcError) as ei:
                for c in it:
                    got += len(c.data)
            assert ei.value.code() == denied, (ei.value.code(), ei.value.details())
            assert "transfer grant expired before the Read finished" in ei.value.details()
            assert got < big.nbytes, got
        assert _agent_metric(mport, "meshd_transfer_calls_expired_total") == 2
        with mesh.activate():
            t = meshd.Tensor(s, ref, (1 << 20,), "float32", mesh.ref, 0)
            with pytest.raises(meshd.MeshdError) as ei:
                (t + 1).shape
            assert ei.value.kind == "UNKNOWN_REF", ei.value
        still_works(s, mesh)


def test_finish_upload_after_an_agent_was_replaced_says_agent_lost(meshd_server):
    """Receipts signed by an agent that was lost and replaced since the plan: FinishUpload
    says AGENT_LOST naming the rank (not a bad receipt), the ref stays undefined, and a
    new mesh on the replacement works."""
    import signal
    import time
    srv = meshd_server(2)
    lib.wait_ready(srv, 2)
    with connect(srv, "direct") as s:
        mesh = s.mesh(gpu=2)
        arr = np.arange(16, dtype=np.float32)
        up, ref = plan_upload(s, mesh, arr)
        receipts = []
        for g in up.shards:
            w = agent_write(g, arr.tobytes())
            receipts.append(s._pb.WriteReceipt(rank=g.rank, bytes=w.bytes, receipt=w.receipt))
        victim = next(p for p in lib.agent_children(srv.pid) if lib.child_rank(p) == 1)
        old = {a.rank: a.agent_id for a in s._unary("ListAgents", s._pb.ListAgentsRequest(),
                                                     s._pb.ListAgentsReply, metadata=()).agents}
        os.kill(victim, signal.SIGKILL)
        end = time.monotonic() + 20
        while True:
            now = {a.rank: a for a in s._unary("ListAgents", s._pb.ListAgentsRequest(),
                                                s._pb.ListAgentsReply, metadata=()).agents}
            if now.get(1) and now[1].agent_id != old[1] and now[1].healthy:
                break
            assert time.monotonic() < end, "rank 1 was not replaced"
            time.sleep(0.05)
        e = refused(lambda: finish(s, "FinishUpload", s._pb.FinishUploadRequest(
            transfer_id=up.transfer_id, receipts=receipts), s._pb.FinishUploadReply),
            grpc.StatusCode.UNAVAILABLE, "rank 1")
        assert "does not verify" not in e.details(), e.details()
        md = dict(e.trailing_metadata() or ())
        assert md.get("meshd-error-kind") == "AGENT_LOST", md
        m2 = s.mesh(gpu=2)
        still_works(s, m2)


def test_forged_or_missing_receipts_leave_the_ref_undefined(shared_meshd):
    """FinishUpload with a forged receipt, a short count or none at all is refused
    and undoes the upload: a command on the ref fails UNKNOWN_REF; a later upload and
    commands work."""
    srv = shared_meshd(2)
    with connect(srv, "direct") as s:
        mesh = s.mesh(gpu=2)
        arr = np.arange(32, dtype=np.float32)
        for case in ("forged", "short", "missing"):
            up, ref = plan_upload(s, mesh, arr)
            receipts = []
            for g in up.shards:
                w = agent_write(g, arr.tobytes())
                receipt = flipped(w.receipt, 5) if case == "forged" and g.rank == 1 else w.receipt
                n = w.bytes - 4 if case == "short" else w.bytes
                receipts.append(s._pb.WriteReceipt(rank=g.rank, bytes=n, receipt=receipt))
            if case == "missing":
                receipts = receipts[:1]
            want = {"forged": "does not verify", "short": "receipt is for",
                    "missing": "no receipt for rank 1"}[case]
            e = refused(lambda: finish(s, "FinishUpload", s._pb.FinishUploadRequest(
                transfer_id=up.transfer_id, receipts=receipts), s._pb.FinishUploadReply),
                grpc.StatusCode.INVALID_ARGUMENT, want)
            assert f"tensor {ref} stays undefined" in e.details(), e.details()
            with mesh.activate():
                t = meshd.Tensor(s, ref, (32,), "float32", mesh.ref, 0)
                with pytest.raises(meshd.MeshdError) as ei:
                    (t * 2).shape
                assert ei.value.kind == "UNKNOWN_REF", ei.value
                with pytest.raises(meshd.MeshdError) as ei:
                    meshd.fetch_shard(t, gpu=0).result()
                assert ei.value.kind == "UNKNOWN_REF", ei.value
        with mesh.activate():
            y = meshd.tensor(arr) + 1
            assert meshd.fetch_shard(y, gpu=1).result().tolist() == (arr + 1).tolist()
        still_works(s, mesh)


def test_data_path_flag(meshd_server):
    """--data-path=proxy refuses PlanTransfer and the client (auto) falls back to the
    proxy; data_path="direct" then fails clearly. --data-path=direct refuses the
    proxied Upload and Fetch; auto clients use the direct path there. A small tensor
    is a Literal command under every setting (docs/protocol.md, Data in and out)."""
    srv = meshd_server(2, "--data-path=proxy")
    lib.wait_ready(srv, 2)
    arr = np.arange(1 << 17, dtype=np.int32)  # 512 KiB: an Upload, not a Literal
    with connect(srv) as s:
        mesh = s.mesh(gpu=2)
        refused(lambda: plan(s, fetch=s._pb.FetchRequest(ref=1)),
                grpc.StatusCode.FAILED_PRECONDITION, "the server's --data-path is proxy")
        with mesh.activate():
            x = meshd.tensor(arr)
            assert meshd.fetch_shard(x * 2, gpu=1).result().tolist() == (arr * 2).tolist()
        assert s._direct.counts == {"upload": 0, "fetch": 0}
    with connect(srv, "direct") as s:
        with s.mesh(gpu=2).activate():
            with pytest.raises(meshd.MeshdError) as ei:
                meshd.tensor(arr)
            assert "--data-path is proxy" in str(ei.value)

    srv2 = meshd_server(2, "--data-path=direct")
    lib.wait_ready(srv2, 2)
    with connect(srv2, "proxy") as s:
        with s.mesh(gpu=2).activate():
            with pytest.raises(meshd.MeshdError) as ei:
                meshd.tensor(arr)
            assert "--data-path is direct" in str(ei.value)
            small = meshd.tensor(arr[:10])  # a Literal: taken (fetched below, directly)
            s.sync()
            assert small.shape == (10,)
    with connect(srv2) as s:
        with s.mesh(gpu=2).activate():
            x = meshd.tensor(arr)
            assert meshd.fetch_shard(x + 1, gpu=0).result().tolist() == (arr + 1).tolist()
            small = meshd.tensor(arr[:10])
            assert meshd.fetch_shard(small, gpu=1).result().tolist() == arr[:10].tolist()
        assert s._direct.counts == {"upload": 1, "fetch": 2}


def test_auto_falls_back_when_agents_are_unreachable(shared_meshd, monkeypatch):
    """A client that cannot connect to the agents (here: every agent address made
    unreachable for it) uses the proxied path in auto mode."""
    srv = shared_meshd(2)
    real = _direct.Direct._channel

    def unreachable(self, address, tls=None, timeout=_direct.CONNECT_TIMEOUT):
        return real(self, "127.0.0.1:1", tls, timeout=0.2)
    monkeypatch.setattr(_direct.Direct, "_channel", unreachable)
    arr = np.arange(6, dtype=np.float64)
    with connect(srv) as s:
        with s.mesh(gpu=2).activate():
            x = meshd.tensor(arr)
            assert meshd.fetch_shard(x, gpu=1).result().tolist() == arr.tolist()
        assert s._direct.counts == {"upload": 0, "fetch": 0}


def test_direct_over_cluster_mtls(meshd_server, pki, tmp_path):
    """Cluster mTLS on the agents' port and TLS on the client port: a client without a
    cluster certificate still moves the bytes directly, over TLS to the agents (verified
    with the cluster CA the server hands out; the bytes never go in plaintext), sharded
    both ways. On that TLS port a Read or Write without a grant, or with a forged one,
    is refused; plaintext does not connect."""
    hport = lib.free_port()
    srv = meshd_server(2, "--cluster-ca", pki / "cluster-ca.pem", "--cluster-cert",
                       pki / "cluster.pem", "--cluster-key", pki / "cluster.key",
                       "--cluster-listen", "127.0.0.1:0", "--tls-cert", pki / "server.pem",
                       "--tls-key", pki / "server.key", "--health-listen", f"127.0.0.1:{hport}",
                       wait_serving=False)
    lib.wait_health(hport, lib.TENSOR_SERVICE, lib.SERVING(), timeout=lib.REGISTER_TIMEOUT,
                    proc=srv.proc, log=srv.log)
    ca = (pki / "ca.pem").read_bytes()
    with meshd.connect(f"localhost:{srv.port}", root_certs=ca, timeout=30) as s:
        assert s.tls
        mesh = s.mesh(gpu=2)
        arr = np.arange(2 * 70000, dtype=np.float32).reshape(2, 70000)
        with mesh.activate():
            t = meshd.tensor(arr, shard="gpu")
            for r in range(2):
                np.testing.assert_array_equal(meshd.fetch_shard(t, gpu=r).result(), arr[r])
        assert s._direct.counts == {"upload": 1, "fetch": 2}, s._direct.counts
        assert all(tls is not None for _, tls in s._direct._channels), "a plaintext agent channel"
        reply = plan_fetch(s, t, gpu=1)
        sh = reply.shards[0]
        assert reply.agent_tls.server_name == "meshd-cluster"
        assert reply.agent_tls.ca_pem == (pki / "cluster-ca.pem").read_text()
        creds = grpc.ssl_channel_credentials(root_certificates=reply.agent_tls.ca_pem.encode())
        opts = [("grpc.ssl_target_name_override", "meshd-cluster")]
        denied = grpc.StatusCode.PERMISSION_DENIED
        refused(lambda: agent_read(sh, s.id, t.ref, grant=flipped(sh.grant, 3), creds=creds,
                                   options=opts), denied, "bad signature")
        refused(lambda: agent_read(sh, s.id, t.ref, grant=b"", creds=creds, options=opts),
                grpc.StatusCode.UNAUTHENTICATED, "cluster certificate")
        refused(lambda: agent_write(sh, arr[1].tobytes(), creds=creds, options=opts), denied,
                "wrong direction")
        refused(lambda: agent_read(sh, s.id, t.ref), grpc.StatusCode.UNAVAILABLE, "")
        got = np.frombuffer(agent_read(sh, s.id, t.ref, creds=creds, options=opts), np.float32)
        np.testing.assert_array_equal(got, arr[1])
        finish(s, "FinishFetch", s._pb.FinishFetchRequest(transfer_id=reply.transfer_id),
               s._pb.FinishFetchReply)
    # meshctl agents shows the same AgentTls: a TLS column, and both fields in JSON
    tls = ["--server", f"127.0.0.1:{srv.port}", "--tls-server-name", "localhost",  # no DNS
           "--tls-ca", str(pki / "ca.pem"), "--timeout-ms", "10000"]
    r = lib.run(lib.MESHCTL, tls + ["agents"], timeout=30)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    col = lines[0].split().index("TLS")
    assert [ln.split()[col] for ln in lines[1:]] == ["meshd-cluster"] * 2, r.stdout
    r = lib.run(lib.MESHCTL, tls + ["--output", "json", "agents"], timeout=30)
    agents = json.loads(r.stdout)["agents"]
    assert r.returncode == 0 and len(agents) == 2, r.stdout
    assert all(a["tls"] == {"server_name": "meshd-cluster",
                            "ca_pem": (pki / "cluster-ca.pem").read_text()} for a in agents), agents


def test_grant_metrics(meshd_server, agent, tmp_path):
    """meshd_transfer_grants_total{result} counts what became of the grants an agent
    was shown: accepted, bad_signature, wrong_call, reused; the server's
    meshd_transfer_bytes_total{path="direct"} the bytes of finished transfers."""
    import urllib.request
    from test_metrics import parse, sample, scrape
    spf = tmp_path / "server.metrics.port"
    srv = meshd_server(0, "--metrics-listen", "127.0.0.1:0", "--metrics-port-file", spf,
                       min_agents=1)
    smport = lib.read_port_file(str(spf), srv.proc, srv.log)
    pf = tmp_path / "agent.metrics.port"
    a = agent(srv.port, "--metrics-listen", "127.0.0.1:0", "--metrics-port-file", pf, rank=0)
    mport = lib.read_port_file(str(pf), a.proc, a.log)
    lib.wait_ready(srv, 1)

    def counts():
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith('meshd_transfer_grants_total{result="'):
                name = line.split('"')[1]
                out[name] = float(line.rsplit(" ", 1)[1])
        return out
    assert counts()["accepted"] == 0
    with connect(srv, "direct") as s:
        mesh = s.mesh(gpu=1)
        with mesh.activate():
            x = meshd.tensor(np.arange(4, dtype=np.float32))  # a Write
            assert meshd.fetch_shard(x, gpu=0).result().tolist() == [0, 1, 2, 3]  # a Read
        reply = plan_fetch(s, x, gpu=0)
        sh = reply.shards[0]
        denied = grpc.StatusCode.PERMISSION_DENIED
        refused(lambda: agent_read(sh, s.id, x.ref, grant=flipped(sh.grant, 2)), denied,
                "bad signature")
        refused(lambda: agent_read(sh, s.id, x.ref + 1), denied, "wrong ref")
        agent_read(sh, s.id, x.ref)
        refused(lambda: agent_read(sh, s.id, x.ref), denied, "reused")
    fams = parse(scrape(smport))
    for d in ("upload", "fetch"):  # 16 bytes each; a planned Read never finished is not counted
        assert sample(fams, "meshd_transfer_bytes_total", direction=d, path="direct") == 16, d
        assert sample(fams, "meshd_transfer_bytes_total", direction=d, path="proxy") == 0, d
    got = counts()
    assert got["accepted"] == 3 and got["bad_signature"] == 1 and got["wrong_call"] == 1 \
        and got["reused"] == 1 and got["expired"] == 0, got


def _read_with_receipt(sh, session_id, ref):
    """Agent/Read under sh's grant: (the data bytes, the spec's read_receipt)."""
    a = lib.agent_pb2()
    with _agent_channel(sh.address) as ch:
        fn = ch.unary_stream(AGENT + "Read", request_serializer=lambda m: m.SerializeToString(),
                             response_deserializer=a.DataChunk.FromString)
        req = a.ReadRequest(session_id=session_id, ref=ref, max_chunk_bytes=1 << 20,
                            after_seq=sh.after_seq)
        got = list(fn(req, metadata=((_direct.GRANT_MD, sh.grant),), timeout=10))
    return (b"".join(c.data for c in got if c.WhichOneof("part") == "data"),
            got[0].read_receipt)


def test_finish_fetch_with_the_reads_receipt_sends_no_drop_snapshot(meshd_server):
    """A direct Read takes its snapshot and answers, with its spec, a receipt that says
    so (signed by its agent); FinishFetch carrying it (by hand, and as the Python
    client passes it on) sends the agent no DropSnapshot
    (it cost every direct fetch an instruction on the agent's link and a run there,
    for nothing). A plan given back unread, or finished with a receipt that does not
    verify, still drops its snapshot, before FinishFetch answers: counted by the
    agent's meshd_agent_instructions_total, the session synced after each step; the
    snapshots are gone either way (meshd_agent_allocated_bytes after a drop)."""
    mport = lib.free_port()
    srv = meshd_server(1, "--local-agent-metrics-port-base", str(mport))
    lib.wait_ready(srv, 1)
    with connect(srv, "direct") as s:
        pb = s._pb
        mesh = s.mesh(gpu=1)
        arr = np.arange(1 << 16, dtype=np.float32)
        with mesh.activate():
            x = meshd.tensor(arr)
        s.sync()

        def ran():  # instructions the agent ran so far, once it ran all it was sent
            s.sync()
            return _agent_metric(mport, "meshd_agent_instructions_total")

        def fetch(receipt=None, read=True):
            reply = plan_fetch(s, x, gpu=0)  # its Snapshot
            sh = reply.shards[0]
            if read:
                data, got = _read_with_receipt(sh, s.id, x.ref)
                assert np.frombuffer(data, np.float32).tolist() == arr.tolist()
                assert len(got) == 32, got
                receipt = got if receipt is None else receipt
            finish(s, "FinishFetch", pb.FinishFetchRequest(transfer_id=reply.transfer_id,
                                                           read_receipt=receipt or b""),
                   pb.FinishFetchReply)

        syncs = -ran() + ran()  # what a sync itself sends (none, as it stands)
        n = ran()
        for _ in range(3):
            fetch()
        assert ran() - n == 3 + syncs, "a DropSnapshot went with the receipt"
        n = ran()
        with mesh.activate():  # the Python client passes its Reads' receipts on too
            for _ in range(2):
                assert meshd.fetch_shard(x, gpu=0).result().tolist() == arr.tolist()
        assert ran() - n == 2 + syncs, "a DropSnapshot went with the Python client's receipt"
        n = ran()
        fetch(read=False)  # given back unread: its snapshot is dropped
        assert ran() - n == 2 + syncs
        n = ran()
        fetch(receipt=bytes(32))  # read, but a forged receipt: dropped, as without one
        assert ran() - n == 2 + syncs
        with mesh.activate():
            x.drop()
        s.sync()
        _until(lambda: _agent_metric(mport, "meshd_agent_allocated_bytes") == 0, 10,
               "a snapshot still holds the dropped tensor")
        still_works(s, mesh)


def test_finish_fetch_with_the_reads_receipt_does_not_wait_for_that_agents_report(meshd_server):
    """The Read's receipt proves what FinishFetch waited for on the fetched rank: its
    agent ran the session through the plan's Snapshot, with the value good there.
    FinishFetch carrying it no longer waits for that agent's progress report, which
    can come well after the Read (70 ms once in ~300 back-to-back 1 MiB fetches on a
    loaded machine, the whole fetch being ~2 ms). Each report is held back here
    (MESHD_FAULT report:slow): a one-rank tensor's FinishFetch answers at once; on a
    two-rank mesh the other rank is still waited for (a value that failed there fails
    the fetch), so the same FinishFetch runs into its deadline."""
    srv = meshd_server(2, env={"MESHD_FAULT": "report:slow=30000"})
    lib.wait_ready(srv, 2)
    with connect(srv, "direct") as s:
        pb = s._pb
        arr = np.arange(64, dtype=np.float32)

        def uploaded(mesh):
            up, ref = plan_upload(s, mesh, arr)
            receipts = []
            for g in up.shards:
                w = agent_write(g, arr.tobytes())
                receipts.append(pb.WriteReceipt(rank=g.rank, bytes=w.bytes, receipt=w.receipt))
            finish(s, "FinishUpload", pb.FinishUploadRequest(transfer_id=up.transfer_id,
                                                             receipts=receipts),
                   pb.FinishUploadReply)
            return meshd.Tensor(s, ref, arr.shape, "float32", mesh.ref, 0)

        def finish_fetch(t, timeout, want=arr):
            reply = plan_fetch(s, t, gpu=0)
            data, receipt = _read_with_receipt(reply.shards[0], s.id, t.ref)
            assert np.frombuffer(data, np.float32).tolist() == want.tolist()
            fn = s._ch.unary_unary(SVC + "FinishFetch",
                                   request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=pb.FinishFetchReply.FromString)
            return lambda: fn(pb.FinishFetchRequest(transfer_id=reply.transfer_id,
                                                    read_receipt=receipt),
                              metadata=s._md, timeout=timeout)

        one = s.mesh(gpu=1)
        for _ in range(2):  # each answered without a report of its Snapshot
            finish_fetch(uploaded(one), 10)()
        two = s.mesh(gpu=2)
        x = uploaded(two)
        with two.activate():
            y = x * 2  # a seq on each rank before the plan, which rank 1 reports late
        s._flush_pipeline()
        refused(finish_fetch(y, 0.5, arr * 2), grpc.StatusCode.DEADLINE_EXCEEDED, "")


def test_a_finished_transfer_gives_its_slot_back_before_the_answer(meshd_server):
    """With --session-max-transfers 1, each planned upload and fetch can start the moment
    the previous one's FinishUpload or FinishFetch answered: the server frees the slot
    before it answers (it once freed it after, and a fast client was refused)."""
    srv = meshd_server(1, "--session-max-transfers", "1")
    lib.wait_ready(srv, 1)
    with connect(srv, "direct") as s:
        mesh = s.mesh(gpu=1)
        arr = np.arange(64, dtype=np.float32)
        for i in range(30):
            up, ref = plan_upload(s, mesh, arr + i)
            g = up.shards[0]
            w = agent_write(g, (arr + i).tobytes())
            finish(s, "FinishUpload", s._pb.FinishUploadRequest(transfer_id=up.transfer_id,
                   receipts=[s._pb.WriteReceipt(rank=g.rank, bytes=w.bytes, receipt=w.receipt)]),
                   s._pb.FinishUploadReply)
            t = meshd.Tensor(s, ref, (64,), "float32", mesh.ref, 0)
            fr = plan_fetch(s, t, gpu=0)
            got = np.frombuffer(agent_read(fr.shards[0], s.id, ref), np.float32)
            np.testing.assert_array_equal(got, arr + i)
            finish(s, "FinishFetch", s._pb.FinishFetchRequest(transfer_id=fr.transfer_id),
                   s._pb.FinishFetchReply)


def test_fetches_waiting_for_a_slot_are_planned_at_once(meshd_server):
    """--session-max-transfers 1, its slot held by a planned fetch. A fetch with
    wait_for_slot is planned at once all the same (its value fixed, no slot taken):
    PlanTransfer answers slot_pending (no grant), a Fetch sends its meta; so the
    client's next command, an in-place write, runs while they wait. The grant request
    is held while the slot is taken (it was refused, and clients polled): one whose
    deadline passes ends DEADLINE_EXCEEDED and its fetch is undone (its place among
    the waiting ones comes back); the queued Fetch streams once the slot frees and
    the held request is answered with the grant after it, both with the value from
    before the write. Fetches wait so at most while the session's unread snapshots
    fit what its agents keep (64); one whose call ends while it waits frees its
    place. Without wait_for_slot: refused, as before (older clients). A session
    closed while a grant request is held ends it NO_SESSION. One whose plan expires
    while it is held (--server-fault expire:fail, once: the sweeper takes it as past
    --transfer-grant-ms, which a short flag raced with the request's arrival) ends
    NOT_FOUND naming the flag, its fetch undone."""
    import time
    srv = meshd_server(1, "--session-max-transfers", "1", "--server-fault", "expire:fail,count=1")
    lib.wait_ready(srv, 1)
    with connect(srv, "direct") as s:
        pb = s._pb
        arr, t, req = _tensor_and_waiting_fetch(s)
        hold = plan_fetch(s, t, gpu=0)
        assert not hold.slot_pending and len(hold.shards) == 1
        refused(lambda: plan_fetch(s, t, gpu=0), grpc.StatusCode.RESOURCE_EXHAUSTED,
                "--session-max-transfers (1)")
        pending = plan(s, fetch=req)
        assert pending.slot_pending and not pending.shards, pending
        assert list(pending.meta.shape) == [6] and pending.transfer_id, pending
        expiring = plan(s, fetch=req)
        grant_req = pb.FetchRequest(transfer_id=expiring.transfer_id)
        refused(lambda: plan(s, fetch=grant_req, timeout=10), grpc.StatusCode.NOT_FOUND,
                "waited for a transfer slot past its plan's expiry (--transfer-grant-ms 600000)")
        refused(lambda: plan(s, fetch=grant_req), grpc.StatusCode.NOT_FOUND, "no pending fetch")
        fn = s._ch.unary_stream(SVC + "Fetch", request_serializer=lambda m: m.SerializeToString(),
                                response_deserializer=pb.FetchChunk.FromString)
        queued = [fn(req, metadata=s._md, timeout=30) for _ in range(2)]
        for q in queued:
            assert next(q).WhichOneof("part") == "meta"  # planned, without the slot
        t.add_(1)  # after them in the stream
        s.sync()
        grant_of = lambda p, **kw: plan(s, fetch=pb.FetchRequest(transfer_id=p.transfer_id), **kw)
        # Held, not refused; past its deadline its fetch is undone (a second request
        # finds it held until the server saw the call end, then nothing).
        doomed = plan(s, fetch=req)
        refused(lambda: grant_of(doomed, timeout=0.5), grpc.StatusCode.DEADLINE_EXCEEDED, "")

        def doomed_gone():
            e = refused(lambda: grant_of(doomed, timeout=5), None, "")
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:  # (one request at a time)
                assert "waits for a slot already" in e.details(), e.details()
                return False
            assert e.code() == grpc.StatusCode.NOT_FOUND, (e.code(), e.details())
            return "no pending fetch" in e.details()
        _until(doomed_gone, 5, "the fetch of a grant request past its deadline was not undone")
        granting = grant_of(pending, timeout=30, future=True)  # held until the slot is its
        # 1 slot + 63 waiting (the undone one's place back): what the agent keeps
        # unread; the next is refused.
        more = [plan(s, fetch=req) for _ in range(60)]
        assert all(m.slot_pending for m in more)
        refused(lambda: plan(s, fetch=req), grpc.StatusCode.RESOURCE_EXHAUSTED,
                "63 planned fetches waiting for a slot")
        queued[1].cancel()  # its place frees once its call ended
        end = time.monotonic() + 5
        while True:
            try:
                more.append(plan(s, fetch=req))
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
                assert time.monotonic() < end, "the cancelled Fetch kept its place"
                time.sleep(0.02)
        for m in more:  # given back unread: their snapshots go
            finish(s, "FinishFetch", pb.FinishFetchRequest(transfer_id=m.transfer_id),
                   pb.FinishFetchReply)
        assert not granting.done()  # (the slot is still held)
        agent_read(hold.shards[0], s.id, t.ref)
        finish(s, "FinishFetch", pb.FinishFetchRequest(transfer_id=hold.transfer_id),
               pb.FinishFetchReply)
        data = b"".join(c.data for c in queued[0] if c.WhichOneof("part") == "data")
        np.testing.assert_array_equal(np.frombuffer(data, np.float32), arr)
        granted = granting.result(10)  # the slot, once the queued Fetch's end gave it back
        assert not granted.slot_pending and len(granted.shards) == 1
        assert granted.transfer_id == pending.transfer_id
        got = agent_read(granted.shards[0], s.id, t.ref)
        np.testing.assert_array_equal(np.frombuffer(got, np.float32), arr)
        finish(s, "FinishFetch", pb.FinishFetchRequest(transfer_id=pending.transfer_id),
               pb.FinishFetchReply)
        refused(lambda: grant_of(pending), grpc.StatusCode.NOT_FOUND, "no pending fetch")
        # The slot is free: a fetch without wait_for_slot gets it at once.
        again = plan_fetch(s, t, gpu=0)
        assert not again.slot_pending and len(again.shards) == 1
        finish(s, "FinishFetch", pb.FinishFetchRequest(transfer_id=again.transfer_id),
               pb.FinishFetchReply)
        with s.mesh(gpu=1).activate():
            assert meshd.inspect(t, gpu=0).tolist() == (arr + 1).tolist()
    s2 = connect(srv, "direct")  # closed while its grant requests are held
    try:
        pb = s2._pb
        with s2.mesh(gpu=1).activate():
            t2 = meshd.tensor(arr)
        req = pb.FetchRequest(ref=t2.ref, coords=[pb.Coordinate(dim="gpu", index=0)],
                              wait_for_slot=True)
        assert not plan(s2, fetch=req).slot_pending  # the slot
        waiting = [plan(s2, fetch=req) for _ in range(3)]
        held = [plan(s2, fetch=pb.FetchRequest(transfer_id=w.transfer_id), timeout=30,
                     future=True) for w in waiting]
        ended = held.pop()  # its fetch ended (FinishFetch) while it is held: it ends too
        finish(s2, "FinishFetch", pb.FinishFetchRequest(transfer_id=waiting[-1].transfer_id),
               pb.FinishFetchReply)
        e = ended.exception(10)
        assert e is not None and e.code() == grpc.StatusCode.NOT_FOUND, e
        # (or, had the FinishFetch overtaken the request: no pending fetch)
        assert re.search("was finished [(]FinishFetch[)] while this grant request waited|"
                         "no pending fetch", e.details()), e.details()
        # (CloseSession alone: the channel, whose close would cancel them, stays)
        s2._unary("CloseSession", pb.CloseSessionRequest(), pb.CloseSessionReply)
        for h in held:
            e = h.exception(10)
            assert e is not None and e.code() == grpc.StatusCode.UNAUTHENTICATED, e
            assert "was closed while fetch" in e.details(), e.details()
    finally:
        s2._abandon()  # (its channel; the session is closed already)


def test_a_fetch_that_ends_unread_gives_its_slot_back_after_its_snapshots_drop(meshd_server):
    """A session's slots and its fetches waiting for one are together what an agent
    keeps unread (64 snapshots; a 65th lets the oldest go). A fetch that ended unread
    (its FinishFetch cut short by its deadline here, MESHD_FAULT report:slow holding the
    wait) gave its slot back before its DropSnapshot was sent: the session's next plan,
    on that slot, sent its Snapshot first (the drop held here, --server-fault drop:slow),
    the agent held 65, and the oldest waiting fetch's snapshot was gone when its turn
    came ("no snapshot"). The slot comes back once the drop is sent, which the agent
    then runs first."""
    import time
    srv = meshd_server(1, "--session-max-transfers", "1", "--threads", "2",  # one held
                       "--server-fault", "drop:slow=300,count=1",
                       env={"MESHD_FAULT": "report:slow=30000"})
    lib.wait_ready(srv, 1)
    with connect(srv, "direct") as s:
        pb = s._pb
        arr, t, req = _tensor_and_waiting_fetch(s)

        def finish_read(p):  # with its receipt: a one-rank fetch is answered at once
            data, receipt = _read_with_receipt(p.shards[0], s.id, t.ref)
            np.testing.assert_array_equal(np.frombuffer(data, np.float32), arr)
            finish(s, "FinishFetch", pb.FinishFetchRequest(transfer_id=p.transfer_id,
                                                           read_receipt=receipt),
                   pb.FinishFetchReply)
        first = plan_fetch(s, t, gpu=0)
        waiting = [plan(s, fetch=req) for _ in range(63)]
        assert all(w.slot_pending for w in waiting)
        finish_read(first)
        unread = plan_fetch(s, t, gpu=0)  # the slot: 63 + 1 snapshots kept
        fn = s._ch.unary_unary(SVC + "FinishFetch", request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=pb.FinishFetchReply.FromString)
        refused(lambda: fn(pb.FinishFetchRequest(transfer_id=unread.transfer_id), metadata=s._md,
                           timeout=0.3), grpc.StatusCode.DEADLINE_EXCEEDED, "")
        end = time.monotonic() + 10
        while True:  # the slot, once the server saw the call end (and sent the drop)
            try:
                nxt = plan_fetch(s, t, gpu=0)
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
                assert time.monotonic() < end, "the cut-short FinishFetch kept its slot"
                time.sleep(0.01)
        finish_read(nxt)
        oldest = plan(s, fetch=pb.FetchRequest(transfer_id=waiting[0].transfer_id))
        assert not oldest.slot_pending and len(oldest.shards) == 1, oldest
        finish_read(oldest)


def test_reads_fit_an_agents_smaller_message_limit(meshd_server, agent):
    """An agent with --max-message-bytes 256KiB: a fetch whose client asks for 1 MiB
    chunks (the Python client's) gets them cut to fit, on the direct path and through
    the server, instead of a bare RESOURCE_EXHAUSTED from gRPC."""
    srv = meshd_server(0, "--min-agents", 1)
    agent(srv.port, "--max-message-bytes", "256KiB")
    lib.wait_ready(srv, 1)
    a = np.arange(3 << 18, dtype=np.float32)  # 3 MiB
    for path in ("direct", "proxy"):
        with connect(srv, path) as s:
            with s.mesh(gpu=1).activate():
                big = meshd.arange(3 << 18, dtype="float32")  # made on the agent
                got = meshd.fetch_shard(big, gpu=0).result(timeout=30)
                np.testing.assert_array_equal(got, a)


def test_a_read_refused_quota_keeps_its_grant_for_a_retry(meshd_server):
    """An agent lets at most 64 Reads wait for their seq (32 of one session at most); a
    direct Read past them is refused RESOURCE_EXHAUSTED / QUOTA. That refusal is not about the grant, so the
    grant is not used up: the client retries it once the waiting Reads left and gets
    its bytes (it was refused "reused" before, the real cause lost)."""
    import time
    # rank 0's first two op calls run 6 s: a fetch of their results waits for them
    srv = meshd_server(2, "--session-max-transfers", "64",
                       env={"MESHD_FAULT": "call:slow=6000,rank=0,count=2"})
    lib.wait_ready(srv, 2)
    with connect(srv, "direct") as s, connect(srv, "direct") as s2:
        arr = np.arange(8, dtype=np.float32)
        mesh = s.mesh(gpu=2)
        with mesh.activate():
            y = meshd.tensor(arr) * 3  # held 6 s on rank 0
        mesh2 = s2.mesh(gpu=2)
        with mesh2.activate():
            z = meshd.tensor(arr) * 3  # and this one
        a = lib.agent_pb2()
        # 32 of each session's: the most one session may have waiting there
        plans = ([(s, y, plan_fetch(s, y, gpu=0)) for _ in range(32)] +
                 [(s2, z, plan_fetch(s2, z, gpu=0)) for _ in range(32)])
        last = plan_fetch(s2, z, gpu=0).shards[0]
        with _agent_channel(last.address) as ch:
            fn = ch.unary_stream(AGENT + "Read", request_serializer=lambda m: m.SerializeToString(),
                                 response_deserializer=a.DataChunk.FromString)
            waiting = [fn(a.ReadRequest(session_id=ses.id, ref=t.ref, max_chunk_bytes=1 << 20,
                                        after_seq=p.shards[0].after_seq),
                          metadata=((_direct.GRANT_MD, p.shards[0].grant),), timeout=30)
                       for ses, t, p in plans]
            time.sleep(1.0)  # the 64 wait on the agent now
            e = refused(lambda: agent_read(last, s2.id, z.ref),
                        grpc.StatusCode.RESOURCE_EXHAUSTED, "64 Reads already wait")
            assert lib.trailer(e.trailing_metadata(), lib.KIND_MD) == "QUOTA", e
            for c in waiting:
                c.cancel()
            end = time.monotonic() + 10
            while True:  # the cancelled Reads leave within a poll (100 ms) each
                try:
                    got = agent_read(last, s2.id, z.ref)
                    break
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, \
                        (err.code(), err.details())
                    assert time.monotonic() < end, "the waiting Reads did not leave in 10 s"
                    time.sleep(0.1)
        assert np.frombuffer(got, np.float32).tolist() == (arr * 3).tolist()
        refused(lambda: agent_read(last, s2.id, z.ref), grpc.StatusCode.PERMISSION_DENIED,
                "reused")


_PLAN_CLIENT = r"""
import sys, grpc
port, req, md = sys.argv[1], bytes.fromhex(sys.argv[2]), eval(sys.argv[3])
ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.enable_http_proxy", 0)])
fn = ch.unary_unary("/meshd.v1.TensorService/PlanTransfer")
print("calling", flush=True)
fn(req, metadata=md, timeout=60)
print("answered", flush=True)
"""


def test_a_plan_whose_client_dies_before_the_answer_gives_its_slot_back(meshd_server):
    """A PlanTransfer whose client process dies (SIGKILL: its connection drops, no
    cancel is sent, its deadline is a minute off) while the server holds the answer
    (--server-fault plan:slow) never told anyone the transfer's id: the call ends
    cancelled when the connection drops, and the server gives the session's one slot
    (--session-max-transfers 1) back then, not at the grants' expiry (60 s)."""
    import signal
    import subprocess
    import time
    srv = meshd_server(2, "--transfer-grant-ms", "60000", "--session-max-transfers", "1",
                       "--server-fault", "plan:slow=2500,count=1")
    lib.wait_ready(srv, 2)
    pb = lib.tensor_pb2()
    with lib.Session(srv.port, "dead-planner") as s:
        m = s.mesh(gpu=2)
        x = s.tensor(m.ref, (8,), kind="ones")
        fetch = pb.PlanTransferRequest(fetch=pb.FetchRequest(
            ref=x.ref, coords=[pb.Coordinate(dim="gpu", index=1)]))
        p = subprocess.Popen([sys.executable, "-c", _PLAN_CLIENT, str(srv.port),
                              fetch.SerializeToString().hex(), repr(tuple(s.metadata))],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert p.stdout.readline().strip() == "calling"
            deadline = time.monotonic() + 10
            while "answer held" not in open(srv.log).read():
                assert time.monotonic() < deadline, "the plan never reached the fault"
                time.sleep(0.05)
            p.send_signal(signal.SIGKILL)
            p.wait(10)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        end = time.monotonic() + 8
        while True:
            try:
                reply = s.unary("PlanTransfer", fetch, pb.PlanTransferReply, timeout=10)
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
                assert time.monotonic() < end, \
                    "a plan whose client died held the session's transfer slot 8 s"
                time.sleep(0.1)
        s.unary("FinishFetch", pb.FinishFetchRequest(transfer_id=reply.transfer_id),
                pb.FinishFetchReply, timeout=10)
    assert "the direct fetch is undone" in open(srv.log).read()


def test_finish_upload_is_accepted_within_2_s_past_the_grants_expiry(meshd_server):
    """docs/protocol.md, Limits and expiry: an upload is undone 2 s after its grants'
    expiry, and FinishUpload is accepted until then (the receipts prove the Writes
    finished before the expiry by the agents' clocks); after, it is NOT_FOUND."""
    import time
    srv = meshd_server(2, "--transfer-grant-ms", "1500")
    lib.wait_ready(srv, 2)
    with connect(srv, "direct") as s:
        mesh = s.mesh(gpu=2)
        arr = np.arange(8, dtype=np.float32)
        for late, ok in ((0.6, True), (3.0, False)):
            up, ref = plan_upload(s, mesh, arr)
            receipts = [s._pb.WriteReceipt(rank=g.rank, bytes=w.bytes, receipt=w.receipt)
                        for g in up.shards for w in [agent_write(g, arr.tobytes())]]
            wait = up.expiry_unix_ms / 1000 + late - time.time()
            time.sleep(max(0.0, wait))
            req = s._pb.FinishUploadRequest(transfer_id=up.transfer_id, receipts=receipts)
            if ok:
                r = finish(s, "FinishUpload", req, s._pb.FinishUploadReply)
                assert list(r.tensor.shape) == [8], r
            else:
                refused(lambda: finish(s, "FinishUpload", req, s._pb.FinishUploadReply),
                        grpc.StatusCode.NOT_FOUND, "no pending upload")


def test_a_burst_of_direct_fetches_from_one_agent_all_succeed(shared_meshd):
    """8 sessions each fetch 8 tensors (their --session-max-transfers) directly from
    one agent at once: 64 granted Reads arrive together. A grant whose signature
    the agent's guard checked at the headers authenticates its call, so none of
    them counts against --max-unauthenticated-requests (16, for strangers: Health)
    while its request is read; every fetch gets its bytes (none is cancelled
    RESOURCE_EXHAUSTED "the oldest is cancelled", which no client retries)."""
    import threading
    srv = shared_meshd(1)
    nsess, ntens = 8, 8
    sessions = [connect(srv, "direct") for _ in range(nsess)]
    try:
        tensors = []  # (session, mesh, [(want, tensor)])
        for i, s in enumerate(sessions):
            mesh = s.mesh(gpu=1)
            with mesh.activate():
                ts = []
                for j in range(ntens):
                    want = (np.arange(1000 + j, dtype=np.float32) + 1000 * i)
                    ts.append((want, meshd.tensor(want) * 1))  # computed on the agent
            tensors.append((s, mesh, ts))
        go = threading.Barrier(nsess + 1, timeout=30)
        results = [None] * nsess

        def fetch_all(i):
            s, mesh, ts = tensors[i]
            try:
                with mesh.activate():
                    go.wait()
                    futs = [(want, meshd.fetch_shard(t, gpu=0)) for want, t in ts]
                    results[i] = [(want, f.result(timeout=60)) for want, f in futs]
            except BaseException as e:  # noqa: BLE001 (reported below)
                results[i] = e

        threads = [threading.Thread(target=fetch_all, args=(i,), daemon=True)
                   for i in range(nsess)]
        for t in threads:
            t.start()
        go.wait()
        for t in threads:
            t.join(90)
            assert not t.is_alive(), "a session's fetches hung"
        for i, r in enumerate(results):
            assert not isinstance(r, BaseException), f"session {i}: {r!r}"
            for want, got in r:
                np.testing.assert_array_equal(got, want)
        for s in sessions:
            assert s._direct.counts["fetch"] == ntens, s._direct.counts
    finally:
        for s in sessions:
            s.close()


def test_granted_reads_whose_requests_are_still_arriving_are_not_cancelled(meshd_server):
    """24 direct Reads under valid grants whose requests are held back after their
    headers (a slow or busy client: the agent has admitted them, their requests are
    not read yet) are more than the agent's --max-unauthenticated-requests (16).
    They are authenticated by their grants' signatures, not strangers: once the
    requests come, each Read gets its bytes; none was cancelled as 'the oldest'."""
    import threading
    import time
    n = 24
    srv = meshd_server(1, "--session-max-transfers", n)
    lib.wait_ready(srv, 1)
    a = lib.agent_pb2()
    with connect(srv, "direct") as s:
        arr = np.arange(100, dtype=np.float32)
        with s.mesh(gpu=1).activate():
            y = meshd.tensor(arr) * 3
        shards = [plan_fetch(s, y, gpu=0).shards[0] for _ in range(n)]
        release = threading.Event()

        def held(req):
            assert release.wait(20), "never released"
            yield req

        with _agent_channel(shards[0].address) as ch:
            # a server-streaming method called as a bidi one: the headers go at once,
            # the request only when the iterator yields it
            fn = ch.stream_stream(AGENT + "Read", request_serializer=lambda m: m.SerializeToString(),
                                  response_deserializer=a.DataChunk.FromString)
            calls = [fn(held(a.ReadRequest(session_id=s.id, ref=y.ref, max_chunk_bytes=1 << 20,
                                           after_seq=sh.after_seq)),
                        metadata=((_direct.GRANT_MD, sh.grant),), timeout=30)
                     for sh in shards]
            time.sleep(1.5)  # every call's headers are at the agent, its guard has run
            release.set()
            got, errors = [], []
            for c in calls:
                try:
                    got.append(b"".join(m.data for m in c if m.WhichOneof("part") == "data"))
                except grpc.RpcError as e:
                    errors.append((e.code(), e.details()))
        assert not errors, f"{len(errors)} of {n} granted Reads failed: {errors[:3]}"
        for b in got:
            assert np.frombuffer(b, np.float32).tolist() == (arr * 3).tolist()


def _replay_held(shard, session_id, ref, n, release):
    """n Agent/Read calls presenting shard's grant whose requests are held back
    until release is set: their calls, and the channel to close."""
    a = lib.agent_pb2()

    def held(req):
        assert release.wait(20), "never released"
        yield req

    ch = _agent_channel(shard.address)
    fn = ch.stream_stream(AGENT + "Read", request_serializer=lambda m: m.SerializeToString(),
                          response_deserializer=a.DataChunk.FromString)
    calls = [fn(held(a.ReadRequest(session_id=session_id, ref=ref, max_chunk_bytes=1 << 20,
                                   after_seq=shard.after_seq)),
                metadata=((_direct.GRANT_MD, shard.grant),), timeout=30)
             for _ in range(n)]
    return calls, ch


@pytest.mark.parametrize("how", ["used", "expired"])
def test_replayed_used_or_expired_grants_are_not_authenticated(meshd_server, shared_meshd, how):
    """A grant already used, or expired, replayed on 24 Reads whose requests are held
    back (an old user's, or one sniffed off plaintext agent traffic) does not pass
    the agent's guard as authenticated: its calls are strangers' and at most
    --max-unauthenticated-requests (16) of them wait for their requests (the others
    are refused at their headers, or cancelled as the oldest); none gets data."""
    import threading
    import time
    n = 24
    if how == "expired":
        srv = lib.wait_ready(meshd_server(1, "--transfer-grant-ms", "600"), 1)
    else:
        srv = shared_meshd(1)
    with connect(srv, "direct") as s:
        arr = np.arange(16, dtype=np.float32)
        with s.mesh(gpu=1).activate():
            y = meshd.tensor(arr) * 3
        sh = plan_fetch(s, y, gpu=0).shards[0]
        if how == "used":
            assert np.frombuffer(agent_read(sh, s.id, y.ref), np.float32).tolist() == \
                (arr * 3).tolist()
        else:
            time.sleep(0.9)
        release = threading.Event()
        calls, ch = _replay_held(sh, s.id, y.ref, n, release)
        try:
            time.sleep(1.5)  # every call's headers are at the agent, its guard has run
            pending = sum(1 for c in calls if not c.done())
            release.set()
            outcomes = []
            for c in calls:
                try:
                    outcomes.append(("data", len(list(c))))
                except grpc.RpcError as e:
                    outcomes.append((e.code(), e.details()))
        finally:
            release.set()
            ch.close()
        assert pending <= 16, (f"{pending} of {n} replayed Reads ({how} grant) wait for their "
                               f"requests, past --max-unauthenticated-requests 16: {outcomes[:2]}")
        want = "reused" if how == "used" else "expired"
        for o in outcomes:
            assert o[0] in (grpc.StatusCode.PERMISSION_DENIED,
                            grpc.StatusCode.RESOURCE_EXHAUSTED), o
            assert want in o[1] or "--max-unauthenticated-requests" in o[1], o
        with s.mesh(gpu=1).activate():
            assert meshd.fetch_shard(y, gpu=0).result(timeout=30).tolist() == (arr * 3).tolist()


def test_more_direct_fetches_waiting_on_one_agent_than_it_keeps_all_succeed(meshd_server):
    """9 sessions each fetch a tensor still being computed 8 times at once (their
    --session-max-transfers), directly from one agent: 72 Reads wait for their seq,
    past the 64 an agent lets wait. The agent refuses the rest RESOURCE_EXHAUSTED /
    QUOTA "64 Reads already wait" and keeps their grants for a retry; the client
    retries that refusal until its deadline (it failed the user's fetch before)."""
    import threading
    nsess, nfetch = 9, 8
    # rank 0's first 9 op calls (each session's y) run 4 s: fetches of y wait for them
    srv = meshd_server(1, env={"MESHD_FAULT": f"call:slow=4000,rank=0,count={nsess}"})
    lib.wait_ready(srv, 1)
    sessions = [connect(srv, "direct") for _ in range(nsess)]
    try:
        arr = np.arange(64, dtype=np.float32)
        made = []
        for s in sessions:
            mesh = s.mesh(gpu=1)
            with mesh.activate():
                made.append((mesh, meshd.tensor(arr) * 3))
        results = [None] * nsess

        def fetch_all(i):
            mesh, y = made[i]
            try:
                with mesh.activate():
                    futs = [meshd.fetch_shard(y, gpu=0) for _ in range(nfetch)]
                    results[i] = [f.result(timeout=60) for f in futs]
            except BaseException as e:  # noqa: BLE001 (reported below)
                results[i] = e

        threads = [threading.Thread(target=fetch_all, args=(i,), daemon=True)
                   for i in range(nsess)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
            assert not t.is_alive(), "a session's fetches hung"
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        assert not failed, f"{len(failed)} sessions' fetches failed: {failed[:2]}"
        for r in results:
            for got in r:
                assert got.tolist() == (arr * 3).tolist()
    finally:
        for s in sessions:
            s.close()
def test_a_write_after_its_upload_was_undone_says_dropped(shared_meshd):
    """FinishUpload without rank 1's receipt undoes the upload (DeleteRefs on every
    rank); rank 1's Write under its grant that only then finishes stores nothing and is
    refused FAILED_PRECONDITION with a kind (DROPPED), not a bare status a client can
    only call UNKNOWN or AGENT_LOST."""
    srv = shared_meshd(2)
    with connect(srv, "direct") as s:
        mesh = s.mesh(gpu=2)
        arr = np.arange(16, dtype=np.float32)
        up, ref = plan_upload(s, mesh, arr)
        g0, g1 = sorted(up.shards, key=lambda g: g.rank)
        w = agent_write(g0, arr.tobytes())
        receipts = [s._pb.WriteReceipt(rank=g0.rank, bytes=w.bytes, receipt=w.receipt)]
        refused(lambda: finish(s, "FinishUpload", s._pb.FinishUploadRequest(
            transfer_id=up.transfer_id, receipts=receipts), s._pb.FinishUploadReply),
            grpc.StatusCode.INVALID_ARGUMENT, "no receipt for rank 1")
        # A fetch from rank 1 after the undo: its DeleteRefs ran there by then.
        with mesh.activate():
            assert meshd.fetch_shard(meshd.ones((2,)), gpu=1).result().tolist() == [1.0, 1.0]
        e = refused(lambda: agent_write(g1, arr.tobytes()), grpc.StatusCode.FAILED_PRECONDITION,
                    "deleted on this agent before the write finished")
        md = dict(e.trailing_metadata() or ())
        assert md.get("meshd-error-kind") == "DROPPED", md
        still_works(s, mesh)


def test_finish_fetch_fails_for_a_value_that_failed_before_the_plan_though_dropped_since(
        meshd_server):
    """y fails on rank 1 (its op call hangs 2 s, then fails) before a fetch of rank 0's
    shard is planned; the client reads rank 0's bytes and drops y, and rank 1's report
    lands after the drop. FinishFetch must still fail with y's failure (a value that
    failed on any rank before the plan fails the fetch from every rank), as it does
    when y is not dropped."""
    srv = meshd_server(2, env={"MESHD_FAULT": "call:hang=2000,rank=1,count=1"})
    lib.wait_ready(srv, 2)
    with connect(srv, "direct") as s:
        mesh = s.mesh(gpu=2)
        with mesh.activate():
            y = meshd.ones((4,), dtype="float32") * 2
        p = plan_fetch(s, y, gpu=0)
        assert agent_read(p.shards[0], s.id, y.ref) == np.full(4, 2, np.float32).tobytes()
        y.drop()
        with pytest.raises(meshd.MeshdError):
            s.sync(timeout=30)  # rank 1's failure, reported after the drop
        e = refused(lambda: finish(s, "FinishFetch", s._pb.FinishFetchRequest(
            transfer_id=p.transfer_id), s._pb.FinishFetchReply), grpc.StatusCode.ABORTED,
            "injected hang")
        md = dict(e.trailing_metadata() or ())
        assert md.get("meshd-error-kind") == "REMOTE_FAILURE", md


@pytest.mark.plain
def test_a_closed_sessions_finished_direct_upload_does_not_pin_the_session(meshd_server):
    """A finished direct upload's record stays until its grants' expiry (to answer a
    repeated FinishUpload), holding its session: a closed session with a direct upload
    kept everything it defined (its object table) on the server for --transfer-grant-ms
    (10 minutes by default), so a server churning such sessions grew by the sessions'
    tables for 10 minutes. Closing the session lets them go."""
    if os.environ.get("MESHD_SANITIZED"):
        pytest.skip("a sanitized meshd's RSS holds freed memory back (ASan's quarantine)")
    srv = meshd_server(2)  # default grants: 600 s, far beyond the test
    lib.wait_ready(srv, 2)
    big = np.ones((300, 300), np.float32)  # 360 KB: an Upload, not a Literal

    def one_session():
        with connect(srv, "direct") as s:
            mesh = s.mesh(gpu=2)
            with mesh.activate():
                meshd.tensor(big)
                with s.pipeline():
                    keep = [meshd.zeros(1) for _ in range(1000)]  # a table of 1000 objects
                s.sync(timeout=30)
            assert s._direct.counts["upload"] == 1, s._direct.counts
            del keep

    for _ in range(5):  # warm-up
        one_session()
    before = lib.rss_kib(srv.pid)
    n = 40
    for _ in range(n):
        one_session()
    grown = lib.rss_kib(srv.pid) - before
    # each closed session's table is freed (and its memory reused by the next); kept,
    # each adds its 1000 objects (several hundred KB)
    assert grown < 4 * 1024, (f"server RSS grew by {grown} KiB over {n} closed sessions "
                              f"({grown * 1024 // n} bytes per session)")


def test_sustained_small_direct_fetches_never_fill_the_agents_nonce_table(meshd_server):
    """An agent remembers each grant's nonce only until the grant's start-by time
    (--transfer-grant-start-ms after issue), not its expiry (--transfer-grant-ms):
    a loop of small direct fetches (a training loop fetching its loss each step)
    that does more of them within --transfer-grant-ms than the agent's table holds
    (--max-transfer-nonces, 8 here) keeps working. It was refused
    RESOURCE_EXHAUSTED "8 grants are in use on this agent already" from the 9th
    fetch on (with the default 65,536: past ~109 fetches a second for 10 min)."""
    import time
    srv = meshd_server(1, "--transfer-grant-ms", "60000", "--transfer-grant-start-ms", "300",
                       env={"MESHD_MAX_TRANSFER_NONCES": "8",  # all of it one session's
                            "MESHD_MAX_TRANSFER_NONCES_PER_SESSION": "8"})
    lib.wait_ready(srv, 1)
    with connect(srv, "direct") as s:
        mesh = s.mesh(gpu=1)
        with mesh.activate():
            for i in range(32):
                want = np.arange(4, dtype=np.float32) + i
                t = meshd.tensor(want) * 1
                got = meshd.fetch_shard(t, gpu=0).result(timeout=30)
                np.testing.assert_array_equal(got, want)
                time.sleep(0.15)  # (a Write and a Read each) at most ~6 grants within 300 ms
        assert s._direct.counts["fetch"] == 32, s._direct.counts
        # A used grant stays refused: reused before its start-by time, expired after.
        with mesh.activate():
            x = meshd.tensor(np.arange(4, dtype=np.float32))
        sh = plan_fetch(s, x, gpu=0).shards[0]
        agent_read(sh, s.id, x.ref)
        refused(lambda: agent_read(sh, s.id, x.ref), grpc.StatusCode.PERMISSION_DENIED, "reused")
        time.sleep(0.6)
        refused(lambda: agent_read(sh, s.id, x.ref), grpc.StatusCode.PERMISSION_DENIED, "start")
        # One never presented before its start-by time is refused too.
        late = plan_fetch(s, x, gpu=0).shards[0]
        time.sleep(0.6)
        refused(lambda: agent_read(late, s.id, x.ref), grpc.StatusCode.PERMISSION_DENIED, "start")


def test_one_session_cannot_fill_an_agents_nonce_table_for_another(meshd_server):
    """A session whose grants the agent keeps until their start-by time (60 s here)
    holds at most --max-transfer-nonces-per-session (3) of the agent's table
    (--max-transfer-nonces, 6): past it its direct Reads are refused RESOURCE_EXHAUSTED
    naming both flags, and another session's uploads and fetches still go directly.
    Before, the first session filled the table and the other's were refused."""
    srv = meshd_server(1, "--session-max-transfers", "64",
                       env={"MESHD_MAX_TRANSFER_NONCES": "6",
                            "MESHD_MAX_TRANSFER_NONCES_PER_SESSION": "3"})
    lib.wait_ready(srv, 1)
    with connect(srv, "direct") as a, connect(srv, "direct") as b:
        with a.mesh(gpu=1).activate():
            x = meshd.tensor(np.arange(4, dtype=np.float32))  # 1 grant: a Write
        flood = None
        for _ in range(8):
            try:
                agent_read(plan_fetch(a, x, gpu=0).shards[0], a.id, x.ref)
            except grpc.RpcError as e:
                flood = e
                break
        assert flood is not None, "8 Reads of one session were all admitted"
        with b.mesh(gpu=1).activate():  # 2 grants: a Write and a Read
            want = np.arange(4, dtype=np.float32) + 1
            t = meshd.tensor(want)
            np.testing.assert_array_equal(meshd.fetch_shard(t, gpu=0).result(timeout=30), want)
        assert b._direct.counts["upload"] == 1 and b._direct.counts["fetch"] == 1, b._direct.counts
        assert flood.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (flood.code(), flood.details())
        assert "--max-transfer-nonces-per-session" in flood.details(), flood.details()


def _pause_after_plans(monkeypatch, n, seconds=0.5):
    """Direct.plan sleeps `seconds` after each of its next n answers: the client was
    paused (a debugger, SIGSTOP, a laptop lid) between the plan and the transfer."""
    import time
    real, left = _direct.Direct.plan, [n]

    def paused(self, request, deadline):
        reply = real(self, request, deadline)
        if left[0] > 0:
            left[0] -= 1
            time.sleep(seconds)
        return reply
    monkeypatch.setattr(_direct.Direct, "plan", paused)
    return left


@pytest.fixture
def start_by_200ms(shared_meshd):
    """A "direct" session and its mesh on one agent whose grants must be presented
    within 200 ms of their plan (--transfer-grant-start-ms 200): a transfer paused
    (_pause_after_plans) 0.5 s between its plan and its Write/Read starts too late.
    The server is the module's (each test its own session)."""
    srv = shared_meshd(1, "--transfer-grant-start-ms", "200")
    with connect(srv, "direct") as s:
        yield s, s.mesh(gpu=1)


def test_a_transfer_paused_past_its_grants_start_by_time_is_planned_again(start_by_200ms,
                                                                             monkeypatch):
    """A direct upload or fetch whose Write/Read starts past its grants' start-by
    time (--transfer-grant-start-ms after the plan) is refused by the agent before any
    byte moved; the client gives the plan back and plans once more (an upload with a
    new ref), within the call's deadline. It failed PERMISSION_DENIED "transfer grant
    refused: expired: its call did not start by its start-by time", which reads as
    an authentication problem."""
    s, mesh = start_by_200ms
    want = np.arange(6, dtype=np.float32)
    with mesh.activate():
        left = _pause_after_plans(monkeypatch, 1)
        t = meshd.tensor(want)
        assert left[0] == 0
        np.testing.assert_array_equal(meshd.fetch_shard(t, gpu=0).result(timeout=30), want)
        left = _pause_after_plans(monkeypatch, 1)
        np.testing.assert_array_equal(meshd.fetch_shard(t, gpu=0).result(timeout=30), want)
        assert left[0] == 0
    assert s._direct.counts["upload"] == 1 and s._direct.counts["fetch"] == 2, s._direct.counts
    still_works(s, mesh)


def _grant(shard):
    """A shard's grant as its agent reads it (the packed message before its 32-byte MAC)."""
    return lib.agent_pb2().TransferGrant.FromString(shard.grant[:-32])


@pytest.mark.parametrize("shift_ms,fault", [(120000, None), (-120000, None),
                                            (-120000, "hello:old")])
def test_direct_transfers_on_an_agent_whose_clock_is_off(meshd_server, shift_ms, fault):
    """An agent whose clock runs 2 min ahead of or behind the server's (NTP down, a VM
    resumed; MESHD_TEST_AGENT_CLOCK_SHIFT_MS): the server writes its grants' times in
    the agent's clock, the offset measured at its dial-back (Hello) and its reports, so direct
    uploads and fetches go through, and a grant ends by the agent's clock when the
    server's expiry says, up to the estimate's error early, never later. Before, an
    agent 60 s ahead refused every grant ("did not start by its start-by time"), and
    one behind kept grants alive 2 min past their time. An older agent (hello:old,
    no clock in its Hello) gets the server's times, as before."""
    env = {"MESHD_TEST_AGENT_CLOCK_SHIFT_MS": str(shift_ms)}
    if fault:
        env["MESHD_FAULT"] = fault
    srv = meshd_server(1, env=env)
    lib.wait_ready(srv, 1)
    with connect(srv, "direct") as s:
        mesh = s.mesh(gpu=1)
        want = np.arange(6, dtype=np.float32)
        with mesh.activate():
            t = meshd.tensor(want)
            np.testing.assert_array_equal(meshd.fetch_shard(t, gpu=0).result(timeout=30), want)
        assert s._direct.counts["upload"] == 1 and s._direct.counts["fetch"] == 1, s._direct.counts
        reply = plan_fetch(s, t, gpu=0)
        g = _grant(reply.shards[0])
        offset = g.expiry_unix_ms - reply.expiry_unix_ms
        said = r"its clock is 1[12]\d\.\d s %s the server's" % (
            "ahead of" if shift_ms > 0 else "behind")  # 2 min, less the estimate's error
        if fault:  # no clock from the agent: the server's times
            assert offset == 0, offset
            assert "its clock is" not in srv.log_text()
        else:  # a lower bound of the agent's offset, off by its messages' way to the server
            assert shift_ms - 10000 <= offset <= shift_ms, offset
            assert re.search(said, srv.log_text()), said
        # the defaults: start by 60 s after the plan, of a 600 s grant
        assert g.expiry_unix_ms - g.start_by_unix_ms == 540000, g
        np.testing.assert_array_equal(
            np.frombuffer(agent_read(reply.shards[0], s.id, t.ref), np.float32), want)


def test_a_transfer_paused_past_its_grants_start_by_time_twice_says_so(start_by_200ms, monkeypatch):
    """Paused past the start-by time on its new plan too (or a command changed what a
    new plan would read): the error says what happened, not an authentication
    refusal, and the session goes on working."""
    s, mesh = start_by_200ms
    want = np.arange(6, dtype=np.float32)
    with mesh.activate():
        t = meshd.tensor(want)
        _pause_after_plans(monkeypatch, 2)
        with pytest.raises(meshd.MeshdError) as e:
            meshd.fetch_shard(t, gpu=0).result(timeout=30)
        assert "grant expired before it started" in e.value.message, e.value.message
        _pause_after_plans(monkeypatch, 2)
        with pytest.raises(meshd.MeshdError) as e:
            meshd.tensor(want)
        assert "grant expired before it started" in e.value.message, e.value.message
        monkeypatch.undo()
        np.testing.assert_array_equal(meshd.fetch_shard(t, gpu=0).result(timeout=30), want)
    still_works(s, mesh)


def test_a_fetch_read_on_the_io_loop_paused_past_its_start_by_time_is_planned_again(
        start_by_200ms, monkeypatch):
    """A fetch whose Read starts while another fetch reads goes to the session's io
    loop (direct._IoLoop); paused past its grant's start-by time, it too is planned
    once more and reads the value, and paused on its new plan too, it says what
    happened (the grant expired before it started), not PERMISSION_DENIED alone."""
    import threading
    import time
    s, mesh = start_by_200ms
    want = np.arange(6, dtype=np.float32)
    with mesh.activate():
        t = meshd.tensor(want)
        gate = threading.Event()  # the first fetch reads (on its own thread) until set
        real = _direct.Direct._read

        def held(self, *args, **kw):
            assert gate.wait(30)
            return real(self, *args, **kw)
        monkeypatch.setattr(_direct.Direct, "_read", held)
        first = meshd.fetch_shard(t, gpu=0)
        until = time.monotonic() + 10
        while s._direct._reading < 1:
            assert time.monotonic() < until, "the first fetch never started its Read"
            time.sleep(0.01)
        left = _pause_after_plans(monkeypatch, 1)
        np.testing.assert_array_equal(meshd.fetch_shard(t, gpu=0).result(timeout=30), want)
        assert left[0] == 0
        assert s._direct._io._loop is not None  # (it read on the io loop)
        _pause_after_plans(monkeypatch, 2)
        with pytest.raises(meshd.MeshdError) as e:
            meshd.fetch_shard(t, gpu=0).result(timeout=30)
        assert "grant expired before it started" in e.value.message, e.value.message
        gate.set()  # (its grant is late by now too: planned again on its thread)
        np.testing.assert_array_equal(first.result(timeout=30), want)
    assert s._direct.counts["fetch"] == 2, s._direct.counts
    monkeypatch.undo()
    still_works(s, mesh)


def test_a_fetch_planned_again_holds_back_commands_until_it_is(start_by_200ms, monkeypatch):
    """A fetch re-planned past its start-by time runs on the fetch's thread, while the
    caller, whose fetch_shard returned, may send commands: one that changes the tensor
    waits until the new plan has snapshot it, and the fetch gets the value of the
    commands before fetch_shard. (The seq was checked, then a command sent meanwhile
    changed the value the new plan read: here 2x the array instead of it.)"""
    import threading
    import time
    s, mesh = start_by_200ms
    want = np.arange(6, dtype=np.float32)
    with mesh.activate():
        t = meshd.tensor(want)
        twice = t * 2
        real, calls, sent = _direct.Direct.fetch_plan, [], []

        def replan_with_a_command_under_way(self, req, deadline):
            calls.append(req)
            if len(calls) == 2:  # the re-plan, on the fetch's thread
                w = threading.Thread(target=lambda: sent.append(
                    twice.reduce("gpu", "sum", out=t)))
                w.start()
                w.join(0.5)  # (a command that does not wait for it ends in ms)
            return real(self, req, deadline)
        monkeypatch.setattr(_direct.Direct, "fetch_plan", replan_with_a_command_under_way)
        _pause_after_plans(monkeypatch, 1)
        np.testing.assert_array_equal(meshd.fetch_shard(t, gpu=0).result(timeout=30), want)
        assert len(calls) == 2, len(calls)
        monkeypatch.undo()
        until = time.monotonic() + 10
        while not sent:
            assert time.monotonic() < until, "the command never went"
            time.sleep(0.01)
        np.testing.assert_array_equal(meshd.fetch_shard(t, gpu=0).result(timeout=30), want * 2)
