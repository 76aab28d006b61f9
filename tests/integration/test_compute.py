"""Agents compute: data in (Upload), ops, data out (Fetch), run-time errors, memory.

Real binaries (`meshd --local-agents N`), numpy as the reference. Collectives and
to_mesh across agents need the cpu data plane; those tests skip, saying so, while
the agents report no data port."""

import os
import signal
import time

import grpc
import numpy as np
import pytest

import meshd_testlib as lib
from meshd_testlib import (Ref, Session, call, create_mesh, drop, factory, reduce, slice_mesh,
                           describe, sync, to_mesh)

_SVC = "/meshd.v1.TensorService/"
DT = {np.dtype("float32"): "float32", np.dtype("float64"): "float64",
      np.dtype("int64"): "int64", np.dtype("int32"): "int32", np.dtype("bool"): "bool"}
NP = {v: k for k, v in DT.items()}


def pb():
    return lib.tensor_pb2()


class FetchError(Exception):
    def __init__(self, code, kind, message):
        super().__init__(f"{code} {kind}: {message}")
        self.code, self.kind, self.message = code, kind, message


def _kind(e):
    return dict(e.trailing_metadata() or ()).get("meshd-error-kind", "")


def upload(s, mesh, arr, per_rank=False, chunk=1 << 16):
    """Uploads arr (or, per_rank, arr[i] to the mesh's i-th rank); returns the ref."""
    arr = np.ascontiguousarray(arr)
    ref = s.new_ref()
    shape = arr.shape[1:] if per_rank else arr.shape
    hdr = pb().UploadHeader(ref=ref, mesh=mesh, shape=list(shape),
                            dtype=lib.dtype(DT[arr.dtype]), per_rank=per_rank,
                            total_bytes=arr.nbytes)
    data = arr.tobytes()
    msgs = [pb().UploadChunk(header=hdr)] + [pb().UploadChunk(data=data[i:i + chunk])
                                             for i in range(0, len(data), chunk)]
    fn = s.ch.stream_unary(_SVC + "Upload", request_serializer=lambda m: m.SerializeToString(),
                           response_deserializer=pb().UploadReply.FromString)
    reply = fn(iter(msgs), metadata=s.metadata, timeout=30)
    assert reply.tensor.ref == ref
    return ref


def fetch(s, ref, **coords):
    fn = s.ch.unary_stream(_SVC + "Fetch", request_serializer=lambda m: m.SerializeToString(),
                           response_deserializer=pb().FetchChunk.FromString)
    req = pb().FetchRequest(ref=ref, coords=[pb().Coordinate(dim=k, index=v)
                                             for k, v in coords.items()])
    meta, data = None, bytearray()
    try:
        for c in fn(req, metadata=s.metadata, timeout=30):
            if c.WhichOneof("part") == "meta":
                meta = c.meta
            else:
                data += c.data
    except grpc.RpcError as e:
        raise FetchError(e.code(), _kind(e), e.details()) from None
    dt = NP[pb().DType.Name(meta.dtype)[len("DTYPE_"):].lower()]
    return np.frombuffer(bytes(data), dtype=dt).reshape(tuple(meta.shape))


def op(s, name, *args, **kw):
    return s.op(name, *args, **kw)[0].ref


def data_plane(s):
    return all(a.data_port for a in s.unary("ListAgents", pb().ListAgentsRequest(),
                                            pb().ListAgentsReply, metadata=()).agents)


@pytest.fixture
def s2(shared_meshd):
    srv = shared_meshd(2)
    with Session(srv.port, "compute2") as s:
        yield s


@pytest.fixture
def s4(shared_meshd):
    srv = shared_meshd(4)
    with Session(srv.port, "compute4") as s:
        yield s


# ================================================================ data in and out

def test_upload_fetch_roundtrip_on_every_rank(s2):
    m = s2.mesh(gpu=2).ref
    a = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    x = upload(s2, m, a)
    for g in range(2):
        np.testing.assert_array_equal(fetch(s2, x, gpu=g), a)


def test_upload_per_rank_and_large_chunks(s2):
    m = s2.mesh(gpu=2).ref
    a = np.random.default_rng(0).standard_normal((2, 300, 1000)).astype(np.float64)  # 4.8 MB
    x = upload(s2, m, a, per_rank=True, chunk=1 << 20)
    np.testing.assert_array_equal(fetch(s2, x, gpu=0), a[0])
    np.testing.assert_array_equal(fetch(s2, x, gpu=1), a[1])


def test_fetch_needs_every_dim(s2):
    m = s2.mesh(host=1, gpu=2).ref
    x = upload(s2, m, np.zeros(3, np.float32))
    with pytest.raises(FetchError) as e:
        fetch(s2, x, gpu=0)
    assert e.value.kind == "BAD_ARGUMENT" and "'host'" in e.value.message


# ================================================================ compute

def test_elementwise_matmul_sum_views(s2):
    m = s2.mesh(gpu=2).ref
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.standard_normal((3, 4)).astype(np.float32)
    x, y = upload(s2, m, a), upload(s2, m, b)
    np.testing.assert_allclose(fetch(s2, op(s2, "add", Ref(x), Ref(y)), gpu=1), a + b, rtol=1e-6)
    np.testing.assert_allclose(fetch(s2, op(s2, "mul", Ref(x), Ref(y)), gpu=0), a * b, rtol=1e-6)
    t = op(s2, "transpose", Ref(y), 0, 1)
    np.testing.assert_allclose(fetch(s2, op(s2, "matmul", Ref(x), Ref(t)), gpu=0), a @ b.T,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fetch(s2, op(s2, "sum", Ref(x), [1]), gpu=1), a.sum(1), rtol=1e-5)
    c = op(s2, "contiguous", Ref(t))
    np.testing.assert_array_equal(fetch(s2, c, gpu=0), b.T)
    np.testing.assert_array_equal(fetch(s2, t, gpu=1), b.T)


def test_in_place_between_views_of_one_tensor(s2):
    """Views that share no element (columns, every other row) may be written from each other,
    as in torch, with torch's values; views that share some are refused (clone first)."""
    m = s2.mesh(gpu=2).ref
    a = np.arange(16, dtype=np.float32).reshape(4, 4)
    x = upload(s2, m, a)
    want = a.copy()
    op(s2, "copy_", Ref(op(s2, "select", Ref(x), 1, 0)), Ref(op(s2, "select", Ref(x), 1, 1)))
    want[:, 0] = want[:, 1]
    even, odd = op(s2, "slice", Ref(x), 0, 0, 4, 2), op(s2, "slice", Ref(x), 0, 1, 4, 2)
    op(s2, "add_", Ref(even), Ref(odd))
    want[::2] += want[1::2]
    op(s2, "copy_", Ref(op(s2, "slice", Ref(x), 1, 2, 4)), Ref(op(s2, "slice", Ref(x), 1, 0, 2)))
    want[:, 2:] = want[:, :2]
    for g in range(2):
        np.testing.assert_array_equal(fetch(s2, x, gpu=g), want)
    dst, src = op(s2, "slice", Ref(x), 0, 1), op(s2, "slice", Ref(x), 0, 0, 3)
    e = s2.fails("BAD_ARGUMENT", call("copy_", Ref(dst), Ref(src), results=[s2.new_ref()]))
    assert "clone the input first" in str(e)
    np.testing.assert_array_equal(fetch(s2, x, gpu=0), want)


def test_factories_and_rand_determinism(s2):
    m = s2.mesh(gpu=2).ref
    z = s2.tensor(m, (2, 3), "ones").ref
    np.testing.assert_array_equal(fetch(s2, z, gpu=1), np.ones((2, 3), np.float32))
    r1 = s2.tensor(m, (64,), "rand", seed=7).ref
    r2 = s2.tensor(m, (64,), "rand", seed=7).ref
    a0, a1 = fetch(s2, r1, gpu=0), fetch(s2, r1, gpu=1)
    np.testing.assert_array_equal(a0, fetch(s2, r2, gpu=0))  # same seed, same rank: same values
    assert not np.array_equal(a0, a1)                         # ranks draw different streams
    assert (a0 >= 0).all() and (a0 < 1).all()


def test_rand_is_the_same_across_agents(shared_meshd):
    """Rank r of a mesh gets the stream (seed, r) whichever agent holds it."""
    srv = shared_meshd(4)
    with Session(srv.port, "rand") as s:
        root = s.mesh(gpu=4).ref
        sub = s.slice(root, gpu=lib.rng(2, 4)).ref if hasattr(lib, "rng") else None
        a = s.tensor(root, (16,), "randn", seed=3).ref
        b = s.tensor(root, (16,), "randn", seed=3).ref
        for g in range(4):
            np.testing.assert_array_equal(fetch(s, a, gpu=g), fetch(s, b, gpu=g))
        del sub


# ================================================================ errors

def test_failing_op_is_remote_failure_and_dependents_depend(s2):
    m = s2.mesh(gpu=2).ref
    x = upload(s2, m, np.arange(6, dtype=np.float32).reshape(2, 3))
    idx = upload(s2, m, np.array([0, 7], dtype=np.int64))
    bad = op(s2, "index_select", Ref(x), 1, Ref(idx))
    dep = op(s2, "add", Ref(bad), 1)
    ok = op(s2, "add", Ref(x), 1)
    with pytest.raises(FetchError) as e:
        fetch(s2, bad, gpu=0)
    assert e.value.kind == "REMOTE_FAILURE" and "index_select" in e.value.message
    with pytest.raises(FetchError) as e:
        fetch(s2, dep, gpu=1)
    assert e.value.kind == "DEPENDENT_FAILURE"
    np.testing.assert_array_equal(fetch(s2, ok, gpu=0), np.arange(6).reshape(2, 3) + 1)


def test_sync_reports_a_one_rank_failure_once_and_the_tensor_fails_everywhere(s2):
    m = s2.mesh(gpu=2).ref
    x = upload(s2, m, np.arange(6, dtype=np.float32).reshape(2, 3))
    # rank 0 gets valid indices, rank 1 an index past the end: only rank 1 fails.
    idx = upload(s2, m, np.array([[0, 1], [0, 7]], dtype=np.int64), per_rank=True)
    bad = op(s2, "index_select", Ref(x), 1, Ref(idx))
    first = s2.run(sync())
    kinds = [pb().ErrorKind.Name(e.kind) for e in first.errors]
    assert kinds == ["ERROR_KIND_REMOTE_FAILURE"], first
    assert "index_select" in first.errors[0].message and "rank 1" in first.errors[0].message
    assert list(s2.run(sync()).errors) == [], "a root failure is reported by one Sync only"
    t = s2.run(describe(bad)).tensors[0]
    assert pb().TensorState.Name(t.state) == "TENSOR_STATE_FAILED", t
    # A value that failed on any rank raises on fetch from every rank.
    for g in (0, 1):
        with pytest.raises(FetchError) as e:
            fetch(s2, bad, gpu=g)
        assert e.value.kind == "REMOTE_FAILURE", (g, e.value)
    # Readers accepted after the report fail at once on the server, naming the root.
    dep = op(s2, "add", Ref(bad), 1)
    t = s2.run(describe(dep)).tensors[0]
    assert pb().ErrorKind.Name(t.error.kind) == "ERROR_KIND_DEPENDENT_FAILURE", t


def test_fetch_from_a_healthy_rank_fails_when_another_rank_failed(s2):
    # No Sync first: the Fetch itself must wait for every rank of the mesh.
    m = s2.mesh(gpu=2).ref
    x = upload(s2, m, np.arange(6, dtype=np.float32).reshape(2, 3))
    idx = upload(s2, m, np.array([[0, 1], [0, 7]], dtype=np.int64), per_rank=True)
    bad = op(s2, "index_select", Ref(x), 1, Ref(idx))
    with pytest.raises(FetchError) as e:
        fetch(s2, bad, gpu=0)  # rank 0 computed it fine; rank 1 failed
    assert e.value.kind == "REMOTE_FAILURE" and "rank 1" in e.value.message, e.value


# ================================================================ memory

def _allocated(s):
    agents = s.unary("ListAgents", pb().ListAgentsRequest(), pb().ListAgentsReply,
                     metadata=()).agents
    return sum(a.allocated_bytes for a in agents)


def _wait_allocated(s, want, timeout=10):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if _allocated(s) == want:
            return True
        time.sleep(0.05)
    return _allocated(s) == want


def test_drop_and_close_free_agent_memory(meshd_server):
    srv = meshd_server(2)
    lib.wait_health(srv.port, "meshd.v1.TensorService", lib.SERVING(), timeout=lib.REGISTER_TIMEOUT)
    with Session(srv.port, "mem") as s:
        assert _wait_allocated(s, 0)
        m = s.mesh(gpu=2).ref
        x = s.tensor(m, (1000,), "zeros").ref
        y = upload(s, m, np.ones(500, np.float64))
        s.run(sync())
        assert _wait_allocated(s, 2 * (4000 + 4000))
        s.run(drop(x))
        s.run(sync())
        assert _wait_allocated(s, 2 * 4000)
        z = s.tensor(m, (10,), "ones").ref
        s.run(sync())
        assert _allocated(s) > 0
        s.close()
        assert _wait_allocated(s, 0), f"{_allocated(s)} bytes still held after CloseSession"
        del y, z


# ================================================================ collectives, to_mesh

def test_reduce_over_a_group_of_one_is_local(s2):
    m = s2.mesh(host=2, gpu=1).ref
    a = np.arange(4, dtype=np.float32)
    x = upload(s2, m, a)
    r = s2.run(reduce(s2.new_ref(), x, dims=["gpu"], reduction="sum")).tensors[0].ref
    np.testing.assert_array_equal(fetch(s2, r, host=1, gpu=0), a)


def test_to_mesh_same_rank_is_a_copy(s2):
    m = s2.mesh(gpu=2).ref
    a = np.arange(6, dtype=np.float32)
    x = upload(s2, m, a)
    r = s2.run(to_mesh(s2.new_ref(), x, m)).tensors[0].ref
    np.testing.assert_array_equal(fetch(s2, r, gpu=1), a)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("reduction", ["sum", "avg", "stack"])
def test_reduce_across_agents(shared_meshd, n, reduction):
    srv = shared_meshd(n)
    with Session(srv.port, "reduce") as s:
        if not data_plane(s):
            pytest.skip("agents report no data_port: the data plane (agent/dataplane/) "
                        "is not built yet")
        m = s.mesh(gpu=n).ref
        parts = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
        x = upload(s, m, parts, per_rank=True)
        r = s.run(reduce(s.new_ref(), x, dims=["gpu"], reduction=reduction)).tensors[0].ref
        want = {"sum": parts.sum(0), "avg": parts.mean(0), "stack": parts}[reduction]
        for g in range(n):
            np.testing.assert_allclose(fetch(s, r, gpu=g), want, rtol=1e-6)


def test_to_mesh_between_agents_and_broadcast(shared_meshd):
    srv = shared_meshd(4)
    with Session(srv.port, "tomesh") as s:
        if not data_plane(s):
            pytest.skip("agents report no data_port: the data plane (agent/dataplane/) "
                        "is not built yet")
        root = s.mesh(host=2, gpu=2).ref
        a = np.arange(8, dtype=np.float32).reshape(4, 2)
        x = upload(s, root, a, per_rank=True)
        h0 = s.slice(root, host=0).ref
        h1 = s.slice(root, host=1).ref
        src = s.run(to_mesh(s.new_ref(), x, h1, selection={"host": 0})).tensors[0].ref
        for g in range(2):
            np.testing.assert_array_equal(fetch(s, src, gpu=g), a[g])
        # broadcast: a tensor on host 0's gpu 1 goes to every rank of the root mesh
        one = s.slice(h0, gpu=1).ref
        y = upload(s, one, np.full(3, 5, np.float32))
        b = s.run(to_mesh(s.new_ref(), y, root)).tensors[0].ref
        for h in range(2):
            for g in range(2):
                np.testing.assert_array_equal(fetch(s, b, host=h, gpu=g), np.full(3, 5, np.float32))


def test_to_mesh_broadcast_on_one_host_maps_one_copy_per_destination(meshd_server, agent,
                                                                      tmp_path):
    """Agents on one host pass a large broadcast as one sealed memfd that every destination
    maps copy-on-write (docs/architecture.md, "Same-host data plane"): each gets the source's
    bytes, then writes its own into them in place without touching the others' or the
    source's, and each counts the message as mapped."""
    if lib.DEVICE != "cpu":
        pytest.skip(f"the same-host mapping is the cpu backend's (agents on {lib.DEVICE})")
    from test_metrics import scrape, value
    srv = meshd_server(0, min_agents=4)
    mports = {}
    for rank in range(4):
        pf = tmp_path / f"agent{rank}.metrics.port"
        a = agent(srv.port, "--metrics-listen", "127.0.0.1:0", "--metrics-port-file", pf,
                  rank=rank)
        mports[rank] = lib.read_port_file(str(pf), a.proc, a.log)
    lib.wait_ready(srv, 4)

    def mapped(rank):
        return value(scrape(mports[rank]),
                     'meshd_dataplane_shm_messages_total{landing="mapped"}') or 0

    with Session(srv.port, "same-host") as s:
        if not data_plane(s):
            pytest.skip("agents report no data_port")
        root = s.mesh(gpu=4).ref
        src = s.slice(root, gpu=0).ref
        n = 3 << 20  # 12 MiB of float32: a tensor the cpu backend keeps in its own mapping
        a = np.random.default_rng(4).standard_normal(n).astype(np.float32)
        y = upload(s, src, a, chunk=1 << 20)
        before = {r: mapped(r) for r in range(4)}
        b = s.run(to_mesh(s.new_ref(), y, root)).tensors[0].ref
        for g in range(4):
            np.testing.assert_array_equal(fetch(s, b, gpu=g), a, err_msg=f"gpu {g}")
        for r in range(1, 4):  # rank 0 holds the source: its copy is local
            assert mapped(r) == before[r] + 1, (r, before, mapped(r))
        k = upload(s, root, np.arange(4, dtype=np.float32).reshape(4, 1) * np.ones((1, n), np.float32),
                   per_rank=True, chunk=1 << 20)
        s.op("add_", Ref(b), Ref(k))
        s.run(sync())
        for g in range(4):
            np.testing.assert_array_equal(fetch(s, b, gpu=g), a + g, err_msg=f"gpu {g} after add_")
        np.testing.assert_array_equal(fetch(s, y), a, err_msg="the source changed")


# ================================================================ a replaced agent

def _agents(s):
    return {a.rank: a for a in s.unary("ListAgents", pb().ListAgentsRequest(),
                                       pb().ListAgentsReply, metadata=()).agents}


def test_a_lost_agent_breaks_its_meshes_and_its_replacement_serves_new_ones(meshd_server):
    srv = lib.wait_ready(meshd_server(2), 2)
    with Session(srv.port, "old") as s:
        m = s.mesh(gpu=2).ref
        x = upload(s, m, np.ones(4, dtype=np.float32))
        s.run(sync())
        old_id = _agents(s)[1].agent_id
        victim = next(p for p in lib.agent_children(srv.pid) if lib.child_rank(p) == 1)
        os.kill(victim, signal.SIGKILL)
        end = time.monotonic() + 20   # the supervisor restarts it; wait for the new one
        while time.monotonic() < end:
            a = _agents(s).get(1)
            if a and a.agent_id != old_id and a.healthy:
                break
            time.sleep(0.05)
        else:
            pytest.fail("rank 1 was not replaced by a healthy agent")
        # The old mesh includes the lost rank: new commands on it are refused
        # at once, naming the rank and what to do, and nothing is claimed.
        with pytest.raises(lib.CommandError) as e:
            s.run(reduce(s.new_ref(), x, dims=["gpu"], reduction="sum"))
        assert e.value.kind == "AGENT_LOST", e.value
        assert "rank 1" in str(e.value) and "create a new mesh" in str(e.value), e.value
        # The next Sync reports the loss once; the shard on the survivor is intact.
        errs = s.run(sync()).errors
        assert [pb().ErrorKind.Name(e.kind) for e in errs] == ["ERROR_KIND_AGENT_LOST"], errs
        assert "rank 1" in errs[0].message, errs
        assert list(s.run(sync()).errors) == [], "a loss is reported by one Sync only"
        np.testing.assert_array_equal(fetch(s, x, gpu=0), np.ones(4, dtype=np.float32))
        with pytest.raises(FetchError) as e:
            fetch(s, x, gpu=1)
        assert e.value.kind == "AGENT_LOST", e.value
        # A new mesh in the same session uses the replacement.
        m2 = s.mesh(gpu=2).ref
        y = upload(s, m2, np.arange(4, dtype=np.float32))
        r = s.run(reduce(s.new_ref(), y, dims=["gpu"], reduction="sum")).tensors[0].ref
        np.testing.assert_array_equal(fetch(s, r, gpu=1), 2 * np.arange(4, dtype=np.float32))
    # The same agents serve a new session normally.
    with Session(srv.port, "new") as s2:
        m = s2.mesh(gpu=2).ref
        y = upload(s2, m, np.arange(4, dtype=np.float32))
        r = s2.run(reduce(s2.new_ref(), y, dims=["gpu"], reduction="sum")).tensors[0].ref
        np.testing.assert_array_equal(fetch(s2, r, gpu=1), 2 * np.arange(4, dtype=np.float32))


def test_agents_started_without_a_rank_run_collectives(meshd_server, agent):
    """Two agents started without --rank (the server gives them ranks 0 and 1 in its
    Hello): a Reduce over both, and a ToMesh from rank 0 to rank 1, work. Their data
    planes kept the rank they started with (0 for both), so every collective of a rank
    other than 0 was refused and the Sync waited out its deadline."""
    srv = meshd_server(0, "--min-agents", 2)
    agent(srv.port)
    agent(srv.port)
    lib.wait_ready(srv, 2)
    with Session(srv.port, "no-rank-flags") as s:
        assert sorted(_agents(s)) == [0, 1]
        m = s.mesh(gpu=2).ref
        x = upload(s, m, np.arange(4, dtype=np.float32))
        r = s.run(reduce(s.new_ref(), x, dims=["gpu"], reduction="sum")).tensors[0].ref
        assert list(s.run(sync(), timeout=20).errors) == []
        for g in (0, 1):
            np.testing.assert_array_equal(fetch(s, r, gpu=g), 2 * np.arange(4, dtype=np.float32))
        one = s.slice(m, gpu=0).ref
        y = upload(s, one, np.full(3, 5, np.float32))
        dst = s.slice(m, gpu=1).ref
        b = s.run(to_mesh(s.new_ref(), y, dst)).tensors[0].ref
        assert list(s.run(sync(), timeout=20).errors) == []
        np.testing.assert_array_equal(fetch(s, b), np.full(3, 5, np.float32))
