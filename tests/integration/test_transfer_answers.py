"""What a transfer's answer promises is in place when the client gets it: the session's
transfer slot and the server's relay bound are given back before the answer (a client
starts its next transfer on it), a FinishUpload asked again while the first is handled
gets the same answer, and a direct fetch gives back no relay it never took."""

import concurrent.futures
import os
import threading
import time

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


def test_a_fetch_is_not_failed_by_a_command_sent_after_its_plan(meshd_server):
    """A fetch reads the tensor as the commands before its plan left it (its Snapshot;
    protocol.md, Fetch and Direct data path), so a command sent after the plan that fails
    the tensor in place does not fail the fetch: the agent's Read gives the value, and
    FinishFetch must not then refuse it with the later command's failure. Twice: an in-place
    add_ that fails on the agent (MESHD_FAULT call:fail), and one the server fails at once
    because its other input had failed (DEPENDENT_FAILURE); each on both ranks of the mesh.
    (FinishFetch failed with either: it checked only whether the tensor was failed by the
    time every rank caught up, so a client whose fetch_shard returned a good value raised
    the error of a later command.)"""
    srv = lib.wait_ready(meshd_server(2, env={"MESHD_FAULT": "call:fail,count=1"}), 2)
    t = lib.tensor_pb2()
    ones = b"\x00\x00\x80\x3f" * 4
    with lib.Session(srv.port, "later-failure", timeout=30) as s:
        m = s.mesh(gpu=2).ref
        for case in ("the agent fails it", "the server fails it"):
            x = s.tensor(m, (4,), "ones").ref
            if case == "the agent fails it":
                p = _plan_fetch(s, x, gpu=1)
                s.run(lib.call("add_", lib.Ref(x), lib.Ref(x)))  # the injected failure
                errors = s.run(lib.sync()).errors
                assert [lib.kind_name(e.kind) for e in errors] == ["REMOTE_FAILURE"], errors
                failed = x
            else:
                p = _plan_fetch(s, x, gpu=1)
                s.run(lib.call("add_", lib.Ref(x), lib.Ref(failed)))  # failed by the server
                s.run(lib.sync())
            state = s.run(lib.describe(x)).tensors[0].state
            assert t.TensorState.Name(state) == "TENSOR_STATE_FAILED", (case, state)
            assert agent_read(p.shards[0], s.id, x) == ones, case
            try:
                s.unary("FinishFetch", t.FinishFetchRequest(transfer_id=p.transfer_id),
                        t.FinishFetchReply)
            except grpc.RpcError as e:
                raise AssertionError(f"{case} after the plan: FinishFetch failed: "
                                     f"{e.code()} {e.details()}") from None


def test_a_proxied_fetch_is_not_failed_by_a_command_sent_after_its_first_message(meshd_server):
    """The same for Fetch through the server: a client that waited for its first message
    (the meta: the Fetch is planned) and then sends an in-place add_ that fails gets the
    value, even when that failure lands while the Fetch still waits for the ranks to catch
    up (a slow matmul queued before it keeps the wait open). (It failed with the add_'s
    error whenever the failure landed first.)"""
    srv = lib.wait_ready(meshd_server(2, env={"MESHD_FAULT": "call:fail,after=3,count=1"}), 2)
    t = lib.tensor_pb2()
    with lib.Session(srv.port, "later-failure-proxy", timeout=60) as s:
        m = s.mesh(gpu=2).ref
        a = s.tensor(m, (1024, 1024), "ones").ref
        x = s.tensor(m, (4,), "ones").ref
        fn = s.ch.unary_stream("/meshd.v1.TensorService/Fetch", request_serializer=lambda q: q.SerializeToString(),
                               response_deserializer=t.FetchChunk.FromString)
        for _ in range(3):  # slow, and not failed (after=3): the next call fails
            s.op("matmul", lib.Ref(a), lib.Ref(a))
        it = fn(t.FetchRequest(ref=x, coords=[t.Coordinate(dim="gpu", index=1)]),
                metadata=s.metadata, timeout=60)
        assert next(it).WhichOneof("part") == "meta"
        s.run(lib.call("add_", lib.Ref(x), lib.Ref(x)))  # fails on both ranks
        try:
            data = b"".join(c.data for c in it)
        except grpc.RpcError as e:
            raise AssertionError(f"the Fetch failed: {e.code()} {e.details()}") from None
        assert data == b"\x00\x00\x80\x3f" * 4
        errors = s.run(lib.sync()).errors
        assert [lib.kind_name(e.kind) for e in errors] == ["REMOTE_FAILURE"], errors


@pytest.mark.skipif(not os.environ.get("MESHD_LONG_TESTS"),
                    reason="11 minutes: set MESHD_LONG_TESTS=1")
def test_a_proxied_fetch_outlives_ten_minutes_under_its_clients_deadline(meshd_server):
    """A Fetch read slowly (its client's deadline 15 min) is not ended at 10 min by the
    server's own deadline on its call to the agent (AGENT_CALL_MS), which the client
    neither chose nor sees: it failed DEADLINE_EXCEEDED, kind AGENT_LOST, 'Deadline
    Exceeded', from a healthy agent. (The same deadline is on an Upload's Writes.)"""
    srv = lib.wait_ready(meshd_server(1), 1)
    t = lib.tensor_pb2()
    with lib.Session(srv.port, "slow-reader", timeout=900) as s:
        m = s.mesh(gpu=1).ref
        x = s.tensor(m, (4 << 20,), "ones").ref  # 16 MiB: more than the relay holds
        fn = s.ch.unary_stream("/meshd.v1.TensorService/Fetch",
                               request_serializer=lambda q: q.SerializeToString(),
                               response_deserializer=t.FetchChunk.FromString)
        it = fn(t.FetchRequest(ref=x, coords=[t.Coordinate(dim="gpu", index=0)]),
                metadata=s.metadata, timeout=900)
        assert next(it).WhichOneof("part") == "meta"
        time.sleep(610)
        try:
            n = sum(len(c.data) for c in it)
        except grpc.RpcError as e:
            raise AssertionError(f"the Fetch failed: {e.code()} {e.details()}") from None
        assert n == 16 << 20


def _finish_fetch(s, p):
    t = lib.tensor_pb2()
    return s.unary("FinishFetch", t.FinishFetchRequest(transfer_id=p.transfer_id),
                   t.FinishFetchReply)


def _kinds(errors):
    return [lib.kind_name(e.kind) for e in errors]


def test_finish_fetch_fails_for_a_value_failed_before_its_plan_though_dropped_since(meshd_server):
    """y fails on rank 1 (its add hangs 1.5 s, then fails) before a fetch of rank 0's shard is
    planned; the client reads rank 0's bytes and drops y. Whether rank 1's report lands before
    the drop (y was failed when dropped) or after it, FinishFetch fails with y's failure, as it
    does when y is not dropped (protocol.md: a value that failed on any rank fails the fetch
    from every rank). (It answered OK: with y gone, fetch_caught_up found nothing failed.)"""
    srv = lib.wait_ready(meshd_server(2, env={"MESHD_FAULT": "call:hang=1500,rank=1,count=2"}), 2)
    twos = b"\x00\x00\x00\x40" * 4
    with lib.Session(srv.port, "failed-then-dropped", timeout=30) as s:
        m = s.mesh(gpu=2).ref
        for case in ("report before the drop", "report after the drop"):
            x = s.tensor(m, (4,), "ones").ref
            y = s.op("add", lib.Ref(x), lib.Ref(x))[0].ref  # hangs on rank 1, then fails
            p = _plan_fetch(s, y, gpu=0)
            assert agent_read(p.shards[0], s.id, y) == twos, case
            if case == "report before the drop":
                errors = s.run(lib.sync()).errors
                s.run(lib.drop(y))
            else:
                s.run(lib.drop(y))
                errors = s.run(lib.sync()).errors
            assert _kinds(errors) == ["REMOTE_FAILURE"], (case, errors)
            with pytest.raises(grpc.RpcError) as e:
                _finish_fetch(s, p)
            assert e.value.code() == grpc.StatusCode.ABORTED, (case, e.value)
            assert "injected hang" in e.value.details(), (case, e.value.details())
            kind = lib.trailer(e.value.trailing_metadata(), "meshd-error-kind")
            assert kind == "REMOTE_FAILURE", (case, kind)


def test_finish_fetch_succeeds_for_a_value_failed_after_its_plan_and_dropped_since(meshd_server):
    """The converse: x is good when the fetch is planned; an in-place add_ sent after the plan
    fails on rank 1 (hangs 1.5 s, then fails), and x is dropped, before or after that report
    lands. The Snapshot holds the value from before the add_, so FinishFetch succeeds (a
    tombstone that only remembers "it failed" would fail it)."""
    srv = lib.wait_ready(meshd_server(2, env={"MESHD_FAULT": "call:hang=1500,rank=1,count=2"}), 2)
    ones = b"\x00\x00\x80\x3f" * 4
    with lib.Session(srv.port, "planned-then-failed", timeout=30) as s:
        m = s.mesh(gpu=2).ref
        for case in ("report before the drop", "report after the drop"):
            x = s.tensor(m, (4,), "ones").ref
            p = _plan_fetch(s, x, gpu=0)
            s.run(lib.call("add_", lib.Ref(x), lib.Ref(x)))  # after the plan: fails on rank 1
            if case == "report before the drop":
                errors = s.run(lib.sync()).errors
                s.run(lib.drop(x))
            else:
                s.run(lib.drop(x))
                errors = s.run(lib.sync()).errors
            assert _kinds(errors) == ["REMOTE_FAILURE"], (case, errors)
            assert agent_read(p.shards[0], s.id, x) == ones, case
            try:
                _finish_fetch(s, p)
            except grpc.RpcError as e:
                raise AssertionError(f"{case}: FinishFetch failed: {e.code()} {e.details()}") \
                    from None


def test_a_proxied_fetch_fails_for_a_value_failed_before_it_though_dropped_while_it_waits(
        meshd_server):
    """The same through the server: a Fetch of rank 0's shard of y, whose add hangs 1.5 s on
    rank 1 and then fails, waits for rank 1 to catch up; the client drops y meanwhile (after
    the Fetch's first message), so rank 1's report lands after the drop. The Fetch must fail
    with y's failure, not stream rank 0's bytes."""
    srv = lib.wait_ready(meshd_server(2, env={"MESHD_FAULT": "call:hang=1500,rank=1,count=1"}), 2)
    t = lib.tensor_pb2()
    with lib.Session(srv.port, "proxied-dropped", timeout=30) as s:
        m = s.mesh(gpu=2).ref
        x = s.tensor(m, (4,), "ones").ref
        y = s.op("add", lib.Ref(x), lib.Ref(x))[0].ref  # hangs on rank 1, then fails
        fn = s.ch.unary_stream("/meshd.v1.TensorService/Fetch",
                               request_serializer=lambda q: q.SerializeToString(),
                               response_deserializer=t.FetchChunk.FromString)
        it = fn(t.FetchRequest(ref=y, coords=[t.Coordinate(dim="gpu", index=0)]),
                metadata=s.metadata, timeout=30)
        assert next(it).WhichOneof("part") == "meta"
        s.run(lib.drop(y))
        with pytest.raises(grpc.RpcError) as e:
            b"".join(c.data for c in it)
        assert e.value.code() == grpc.StatusCode.ABORTED, e.value
        assert "injected hang" in e.value.details(), e.value.details()
        assert lib.trailer(e.value.trailing_metadata(), "meshd-error-kind") == "REMOTE_FAILURE"
        assert _kinds(s.run(lib.sync()).errors) == ["REMOTE_FAILURE"]


def test_finish_fetch_of_a_view_fails_for_its_base_failed_before_the_plan_though_dropped_since(
        meshd_server):
    """v is a view of x; an in-place add_ of x (sent before the fetch of v is planned) hangs
    1.5 s on rank 1, then fails; the client reads rank 0's bytes of v and drops x (and with it
    v, the same storage) before rank 1's report, which names x, lands. FinishFetch of v must
    fail with that failure, as it does when the report lands first (every alias fails) or
    nothing is dropped. (Each alias had its own tombstone: the late report gave x's one a
    failure record, v's none, and FinishFetch answered OK with bytes that failed on rank 1.)"""
    srv = lib.wait_ready(meshd_server(
        2, env={"MESHD_FAULT": "call:hang=1500,rank=1,after=1,count=1"}), 2)
    with lib.Session(srv.port, "view-of-failed-dropped", timeout=30) as s:
        m = s.mesh(gpu=2).ref
        x = s.tensor(m, (2, 2), "ones").ref
        (v,) = s.op("transpose", lib.Ref(x), 0, 1)  # rank 1's first call: not faulted
        s.run(lib.call("add_", lib.Ref(x), lib.Ref(x)))  # hangs on rank 1, then fails
        p = _plan_fetch(s, v.ref, gpu=0)
        assert agent_read(p.shards[0], s.id, v.ref) == b"\x00\x00\x00\x40" * 4
        s.run(lib.drop(x))  # v goes with it
        assert _kinds(s.run(lib.sync()).errors) == ["REMOTE_FAILURE"]
        with pytest.raises(grpc.RpcError) as e:
            _finish_fetch(s, p)
        assert e.value.code() == grpc.StatusCode.ABORTED, e.value
        assert "injected" in e.value.details(), e.value.details()


def test_a_late_failure_of_a_released_tensor_fails_its_live_views(meshd_server):
    """The same with x released (not dropped) while its view v stays live: the add_ of x
    fails on rank 1 after the Release. Its storage was written by a failed in-place op, so v
    fails (as when the report lands before the Release: every alias fails), and a fetch of v
    planned before the report fails too. (v stayed LIVE: Describe said so, and FinishFetch of
    rank 0's shard answered OK.)"""
    srv = lib.wait_ready(meshd_server(
        2, env={"MESHD_FAULT": "call:hang=1500,rank=1,after=1,count=1"}), 2)
    t = lib.tensor_pb2()
    with lib.Session(srv.port, "view-of-failed-released", timeout=30) as s:
        m = s.mesh(gpu=2).ref
        x = s.tensor(m, (2, 2), "ones").ref
        (v,) = s.op("transpose", lib.Ref(x), 0, 1)
        s.run(lib.call("add_", lib.Ref(x), lib.Ref(x)))  # hangs on rank 1, then fails
        p = _plan_fetch(s, v.ref, gpu=0)
        assert agent_read(p.shards[0], s.id, v.ref) == b"\x00\x00\x00\x40" * 4
        s.run(lib.release(x))
        assert _kinds(s.run(lib.sync()).errors) == ["REMOTE_FAILURE"]
        state = s.run(lib.describe(v.ref)).tensors[0].state
        assert t.TensorState.Name(state) == "TENSOR_STATE_FAILED", state
        with pytest.raises(grpc.RpcError) as e:
            _finish_fetch(s, p)
        assert e.value.code() == grpc.StatusCode.ABORTED, e.value


def test_a_read_borrow_of_a_failed_tensor_does_not_move_its_failure_before_a_fetch(
        meshd_server):
    """x is good when a fetch of rank 0's shard is planned; an add_ sent after the plan fails
    on both ranks (one command: one origin), so FinishFetch succeeds (the Snapshot holds the
    value from before it). A read borrow of the failed x, taken and dropped before the
    FinishFetch, changes nothing: its last use on each agent reports x's failure again (under
    the DropBorrow's seq), which is no new failure. (The server took the second rank's
    report of another command as 'failed on several ranks, where unknown', and FinishFetch
    failed with the add_'s failure.)"""
    srv = lib.wait_ready(meshd_server(2, env={"MESHD_FAULT": "call:fail"}), 2)
    ones = b"\x00\x00\x80\x3f" * 4
    with lib.Session(srv.port, "read-borrow-of-failed", timeout=30) as s:
        m = s.mesh(gpu=2).ref
        side = s.stream("side")
        x = s.tensor(m, (4,), "ones").ref
        p = _plan_fetch(s, x, gpu=0)
        s.run(lib.call("add_", lib.Ref(x), lib.Ref(x)))  # after the plan: fails on both ranks
        assert _kinds(s.run(lib.sync()).errors) == ["REMOTE_FAILURE"]
        h, b = s.new_ref(), s.new_ref()
        s.run(lib.borrow(h, x, side, False, b))
        s.run(lib.drop_borrow(b))
        assert _kinds(s.run(lib.sync()).errors) == []
        assert agent_read(p.shards[0], s.id, x) == ones
        try:
            _finish_fetch(s, p)
        except grpc.RpcError as e:
            raise AssertionError(f"FinishFetch failed: {e.code()} {e.details()}") from None


@pytest.mark.parametrize("mutable", [False, True])
def test_a_borrow_of_a_tensor_failed_through_its_view_does_not_move_its_failure_before_a_fetch(
        meshd_server, mutable):
    """The same with x failed through its view v: an add_ of v (after the plan) fails on
    both ranks; the agents fail x with it (the same storage: by_sharing), the server fails
    x as v's alias. A borrow of x, taken and dropped, reports nothing new: x's failure was
    told with v's. (Its last use reported x again on each rank, under the DropBorrow's
    command: the server took it as 'failed on several ranks', and FinishFetch of x failed
    with the add_'s failure, though the Snapshot holds the value from before it.)"""
    srv = lib.wait_ready(meshd_server(2, env={"MESHD_FAULT": "call:fail,after=1"}), 2)
    ones = b"\x00\x00\x80\x3f" * 4
    with lib.Session(srv.port, "borrow-of-failed-via-view", timeout=30) as s:
        m = s.mesh(gpu=2).ref
        side = s.stream("side")
        x = s.tensor(m, (2, 2), "ones").ref
        (v,) = s.op("transpose", lib.Ref(x), 0, 1)  # each rank's first call: not faulted
        p = _plan_fetch(s, x, gpu=0)
        s.run(lib.call("add_", lib.Ref(v.ref), lib.Ref(v.ref)))  # after the plan: fails
        assert _kinds(s.run(lib.sync()).errors) == ["REMOTE_FAILURE"]
        h, b = s.new_ref(), s.new_ref()
        s.run(lib.borrow(h, x, side, mutable, b))
        s.run(lib.drop_borrow(b))
        assert _kinds(s.run(lib.sync()).errors) == []
        assert agent_read(p.shards[0], s.id, x) == ones
        try:
            _finish_fetch(s, p)
        except grpc.RpcError as e:
            raise AssertionError(f"FinishFetch failed: {e.code()} {e.details()}") from None
