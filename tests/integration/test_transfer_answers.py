"""What a transfer's answer promises is in place when the client gets it: the session's
transfer slot and the server's relay bound are given back before the answer (a client
starts its next transfer on it), a FinishUpload asked again while the first is handled
gets the same answer, and a direct fetch gives back no relay it never took."""

import concurrent.futures
import threading

import grpc
import pytest

import meshd_testlib as lib
from test_direct import agent_read, agent_write  # noqa: E402  (also puts clients/python on the path)
from test_transfers import _HeldUpload  # noqa: E402


def _plan_fetch(s, ref, gpu=0):
    t = lib.tensor_pb2()
    return s.unary("PlanTransfer", t.PlanTransferRequest(fetch=t.FetchRequest(
        ref=ref, coords=[t.Coordinate(dim="gpu", index=gpu)])), t.PlanTransferReply)


def _direct_fetch(s, ref, gpu=0):
    t = lib.tensor_pb2()
    p = _plan_fetch(s, ref, gpu)
    data = agent_read(p.shards[0], s.id, ref)
    s.unary("FinishFetch", t.FinishFetchRequest(transfer_id=p.transfer_id), t.FinishFetchReply)
    return data


def test_finish_fetch_gives_back_no_relay_it_never_took(meshd_server):
    """--max-relayed-transfers 1 under --data-path auto: a direct fetch (PlanTransfer,
    Agent/Read, FinishFetch) relays nothing, so it leaves the bound as it was: one held
    Upload fills it, and another session's Upload is refused QUOTA. (FinishFetch gave back
    a relay it never took: after each direct fetch one more proxied transfer got through,
    past the server's memory bound.)"""
    srv = meshd_server(2, "--max-relayed-transfers", "1")
    lib.wait_ready(srv, 2)
    with lib.Session(srv.port, "a", timeout=30) as a, lib.Session(srv.port, "b", timeout=30) as b:
        ma, mb = a.mesh(gpu=2).ref, b.mesh(gpu=2).ref
        x = a.tensor(ma, (4,), "ones").ref
        assert len(_direct_fetch(a, x)) == 16
        held = _HeldUpload(a, ma, 64 * 1024)
        held.held(a.new_ref())
        try:
            other = _HeldUpload(b, mb, 64 * 1024)
            with pytest.raises(grpc.RpcError) as e:
                other.whole(b.new_ref())
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
            assert "--max-relayed-transfers (1)" in e.value.details(), e.value.details()
        finally:
            assert not isinstance(held.release(), grpc.RpcError)


def test_a_proxied_upload_gives_its_slot_back_before_it_answers(meshd_server):
    """--session-max-transfers 1: each Upload starts the moment the one before answered,
    and is never refused: the slot goes back before the answer. (It went back in on_end,
    after the status: 3 of 300 were refused QUOTA. The clients do not retry an Upload.)
    Chance-based on the old code: a miss does not prove the order."""
    srv = meshd_server(2, "--session-max-transfers", "1")
    lib.wait_ready(srv, 2)
    with lib.Session(srv.port, "seq", timeout=30) as s:
        m = s.mesh(gpu=2).ref
        up = _HeldUpload(s, m, 4096)
        refused = []
        for i in range(300):
            try:
                up.whole(s.new_ref())
            except grpc.RpcError as e:
                refused.append((i, e.code(), e.details()))
        assert not refused, f"{len(refused)} of 300 refused, first: {refused[0]}"


def test_a_proxied_fetch_gives_its_slot_back_before_it_ends(meshd_server):
    """The same for Fetch: a client that read a Fetch to its end (its status came) starts
    the next at once and is never refused '--session-max-transfers' (4 of 300 were)."""
    srv = meshd_server(2, "--session-max-transfers", "1")
    lib.wait_ready(srv, 2)
    t = lib.tensor_pb2()
    with lib.Session(srv.port, "seq", timeout=30) as s:
        m = s.mesh(gpu=2).ref
        x = s.tensor(m, (4,), "ones").ref
        fn = s.ch.unary_stream("/meshd.v1.TensorService/Fetch",
                               request_serializer=lambda q: q.SerializeToString(),
                               response_deserializer=t.FetchChunk.FromString)
        req = t.FetchRequest(ref=x, coords=[t.Coordinate(dim="gpu", index=0)])
        refused = []
        for i in range(300):
            try:
                for _ in fn(req, metadata=s.metadata, timeout=30):
                    pass
            except grpc.RpcError as e:
                refused.append((i, e.code(), e.details()))
        assert not refused, f"{len(refused)} of 300 refused, first: {refused[0]}"


def test_a_finish_upload_asked_twice_at_once_gets_the_same_answer_twice(meshd_server):
    """A FinishUpload repeated while the first is still being handled (the client's
    deadline passed while the server worked on it: the case the clients' retry is for)
    gets the tensor too: it waits for the first's outcome. (The transfer was out of the
    table for the whole check, so the second found nothing, NOT_FOUND "no pending upload",
    in 1-3 of 100 rounds; the client raised while the first defined the tensor behind its
    back.) Two calls at once, many times (the server has 2 completion-queue threads)."""
    srv = meshd_server(1)
    lib.wait_ready(srv, 1)
    t = lib.tensor_pb2()
    arr = b"\x00\x00\x80\x3f" * 64  # 64 float32 ones
    bad = []
    with lib.Session(srv.port, "twice", timeout=30) as s, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        m = s.mesh(gpu=1).ref
        fin = s.ch.unary_unary("/meshd.v1.TensorService/FinishUpload",
                               request_serializer=lambda q: q.SerializeToString(),
                               response_deserializer=t.FinishUploadReply.FromString)
        for i in range(100):
            ref = s.new_ref()
            hdr = t.UploadHeader(ref=ref, mesh=m, shape=[64], dtype=lib.dtype("float32"),
                                 total_bytes=len(arr))
            p = s.unary("PlanTransfer", t.PlanTransferRequest(upload=hdr), t.PlanTransferReply)
            g = p.shards[0]
            w = agent_write(g, arr)
            req = t.FinishUploadRequest(transfer_id=p.transfer_id, receipts=[
                t.WriteReceipt(rank=g.rank, bytes=w.bytes, receipt=w.receipt)])
            go = threading.Barrier(2)

            def one():
                go.wait(5)
                try:
                    return fin(req, metadata=s.metadata, timeout=30).tensor.ref
                except grpc.RpcError as e:
                    return (e.code(), e.details())
            got = [f.result() for f in [pool.submit(one), pool.submit(one)]]
            if got != [ref, ref]:
                bad.append((i, got))
    assert not bad, f"{len(bad)} of 100: {bad[:3]}"
