"""The Python client against a real meshd with 2 local cpu agents; numpy is the reference."""

import os
import sys
import threading

import numpy as np
import pytest

import meshd
from meshd.tensor import _call


def get(t, **coords):
    return meshd.fetch_shard(t, **coords).result()


def raises_kind(kind, fn, *a, **kw):
    with pytest.raises(meshd.MeshdError) as e:
        fn(*a, **kw)
    assert e.value.kind == kind, e.value
    assert e.value.message.strip()
    return e.value


# ================================================================ session, meshes

def test_protos_are_generated_into_the_cache(session):
    root = os.path.join(os.environ["XDG_CACHE_HOME"], "meshd")
    assert any(d.startswith("proto-") for d in os.listdir(root))


def test_agents(session):
    ag = session.agents()
    assert sorted(a["rank"] for a in ag)[:2] == [0, 1]
    for a in ag:
        assert set(a) == {"rank", "address", "device", "memory_bytes", "allocated_bytes", "healthy",
                          "drained"}
        assert a["healthy"] and a["device"] == "cpu" and a["memory_bytes"] > 0
        assert a["drained"] is False
    info = session.server_info()
    assert info["version"] == meshd.__version__ and info["commit"] and info["uptime_ms"] > 0
    assert sorted(a["rank"] for a in info["agents"]) == sorted(a["rank"] for a in ag)
    assert all(a["version"] == info["version"] and a["commit"] == info["commit"]
               for a in info["agents"]), info


def test_server_info_lists_every_agent_when_get_info_holds_only_the_first(session, monkeypatch):
    """GetInfo holds a pool's first 1024 agents (a reply with every agent passed gRPC's
    4 MiB at ~8,000 and failed); agents_truncated says more are registered. Here the
    real reply is cut to its first agent and marked so: server_info() still lists every agent,
    from ListAgents, with the versions they reported."""
    ranks = [a["rank"] for a in session.agents()]
    assert len(ranks) >= 2, ranks
    real, asked = session._unary, []

    def first_only(method, request, *a, **kw):
        asked.append(method)
        r = real(method, request, *a, **kw)
        if method == "GetInfo":
            assert not r.agents_truncated and r.agents_total == len(r.agents) == len(ranks), r
            del r.agents[1:]
            r.agents_truncated = True
        return r
    monkeypatch.setattr(session, "_unary", first_only)
    info = session.server_info()
    assert [a["rank"] for a in info["agents"]] == ranks, info
    assert all(a["version"] == info["version"] for a in info["agents"]), info
    assert asked == ["GetInfo", "ListAgents"], asked


def test_agents_and_the_pool_probe_follow_every_page(server, monkeypatch):
    """ListAgents is paged (4096 agents a page unless asked otherwise): a client that
    read one reply saw only a large pool's first page. Here every ListAgents is cut to
    pages of one agent: agents() and the direct path's probe of the pool (which also
    reads AgentTls from ListAgents) still see both agents."""
    with meshd.connect(server[0], data_path="auto") as s:
        real, tokens = s._unary, []

        def one_a_page(method, request, *a, **kw):
            if method == "ListAgents":
                request.page_size = 1
                tokens.append(request.page_token)
            return real(method, request, *a, **kw)
        monkeypatch.setattr(s, "_unary", one_a_page)
        ag = s.agents()
        assert sorted(a["rank"] for a in ag) == [0, 1] and len(tokens) == 2, (ag, tokens)
        probed, channel = [], s._direct._channel

        def probe(address, tls=None, **kw):
            probed.append(address)
            return channel(address, tls, **kw)
        monkeypatch.setattr(s._direct, "_channel", probe)
        assert s._direct._pool_reachable() is True
        assert sorted(probed) == sorted(a["address"] for a in ag)


def test_fetches_starting_together_share_one_pool_probe(server, monkeypatch):
    """data_path="auto" probes the pool at the first transfer. 8 fetch_shards at once
    plan on 8 threads, and each probed it (8 ListAgents, a channel per agent each,
    all but one closed again); now one probes and the others wait for its answer."""
    with meshd.connect(server[0], data_path="auto", timeout=20) as s:
        with s.mesh(gpu=2).activate():
            x = meshd.tensor(np.arange(4, dtype=np.float32), progress=False)  # a Literal
            real, listed, gate = s._unary, [], threading.Event()

            def held(method, request, *a, **kw):
                if method == "ListAgents":
                    listed.append(request.page_token)
                    assert gate.wait(10), "ListAgents held too long"
                return real(method, request, *a, **kw)
            entered, probe = threading.Condition(), s._direct._pool_reachable

            def counted(*a, **kw):
                with entered:
                    entered.n = getattr(entered, "n", 0) + 1
                    entered.notify_all()
                return probe(*a, **kw)
            monkeypatch.setattr(s, "_unary", held)
            monkeypatch.setattr(s._direct, "_pool_reachable", counted)
            futs = [meshd.fetch_shard(x, gpu=i % 2) for i in range(8)]
            with entered:  # every fetch asked whether to go direct (bounded: 10 s)
                assert entered.wait_for(lambda: getattr(entered, "n", 0) == 8, 10)
            gate.set()
            for f in futs:
                np.testing.assert_array_equal(f.result(20), np.arange(4, dtype=np.float32))
            assert listed == [""], f"{len(listed)} ListAgents for one probe"
            assert s._direct._pool_ok is True and s._direct.counts["fetch"] == 8


@pytest.mark.parametrize("rows,says", [(1, "the same next_page_token again"),
                                       (0, "an empty page with a next_page_token")])
def test_agents_refuse_pages_that_do_not_end(session, monkeypatch, rows, says):
    """A server (hostile, or broken) whose ListAgents pages say more follow forever:
    INTERNAL naming why, not a loop."""
    pb = session._pb

    def endless(method, request, reply_cls, *a, **kw):
        assert method == "ListAgents"
        return pb.ListAgentsReply(agents=[pb.AgentInfo(rank=0)] * rows,
                                  next_page_token="7.00000000")
    monkeypatch.setattr(session, "_unary", endless)
    e = raises_kind("INTERNAL", session.agents)
    assert "ListAgents: the server's pages do not end" in e.message and says in e.message, e


def test_mesh_names_sizes_slice_rank(session):
    m = session.mesh(host=1, gpu=2)
    assert m.names == ("host", "gpu") and m.sizes == {"host": 1, "gpu": 2}
    sub = m.slice(gpu=1)
    assert sub.names == ("host",) and sub.sizes == {"host": 1}
    keep = m.slice(gpu=slice(1, None))
    assert keep.names == ("host", "gpu") and keep.sizes == {"host": 1, "gpu": 1}
    r = m.rank("gpu")
    assert r.shape == () and r.dtype == "int64" and r.mesh is m
    assert get(r, host=0, gpu=0) == 0 and get(r, host=0, gpu=1) == 1
    with pytest.raises(TypeError):
        m.slice(gpu="0")
    # A step, as in Python, is 1 when left out and never 0; nor beyond the dim.
    assert m.slice(gpu=slice(0, None, 2)).sizes == {"host": 1, "gpu": 1}
    assert "step 0" in raises_kind("BAD_ARGUMENT", m.slice, gpu=slice(0, 2, 0)).message
    raises_kind("BAD_ARGUMENT", m.slice, gpu=slice(0, None, 3))


def test_context_manager_and_close(server):
    with meshd.connect(server[0]) as s:
        m = s.mesh(gpu=2)
        assert s.default_stream.name == "main"
    assert s.closed
    raises_kind("NO_SESSION", s.mesh, gpu=2)
    s.close()  # twice is fine
    with m.activate():
        raises_kind("NO_SESSION", meshd.zeros, (1,))


def test_close_from_two_threads_at_once_closes_once_and_raises_in_neither(server):
    """Two threads closing one session at once (a worker and the main thread at
    shutdown): one CloseSession goes; neither raises (the second found
    NO_SESSION), and each returns once the session is closed."""
    import threading
    for _ in range(5):
        s = meshd.connect(server[0])
        s.mesh(gpu=2)
        start, errors, done = threading.Barrier(2), [], []

        def close():
            start.wait(10)
            try:
                s.close()
                done.append(s.closed)
            except Exception as e:  # noqa: BLE001 - the test reports it
                errors.append(e)
        threads = [threading.Thread(target=close) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert done == [True, True], done


# ================================================================ factories, upload, fetch

def test_factories(mesh):
    z = meshd.zeros((2, 3))
    assert z.shape == (2, 3) and z.dtype == "float32" and z.mesh is mesh
    assert z.stream is mesh.session.default_stream
    np.testing.assert_array_equal(get(z, gpu=1), np.zeros((2, 3), np.float32))
    np.testing.assert_array_equal(get(meshd.ones(4, dtype="int32"), gpu=0), np.ones(4, np.int32))
    f = meshd.full((2,), 2.5, dtype=np.float64)
    assert f.dtype == "float64"
    np.testing.assert_array_equal(get(f, gpu=0), np.full(2, 2.5))
    # torch.full: the fill value's kind gives the dtype (int64, bool, float32)
    i = meshd.full((2,), 3)
    assert i.dtype == "int64"
    np.testing.assert_array_equal(get(i, gpu=0), np.full(2, 3, np.int64))
    b = meshd.full((2,), True)
    assert b.dtype == "bool"
    np.testing.assert_array_equal(get(b, gpu=1), np.full(2, True))
    assert meshd.full((1,), 3.0).dtype == "float32"
    assert meshd.full((1,), 3, dtype="float16").dtype == "float16"
    with pytest.raises(ValueError, match="beyond 2"):
        meshd.full((1,), 2**60)
    assert meshd.empty((3, 1)).shape == (3, 1)
    a = meshd.arange(5)
    assert a.dtype == "int64"
    np.testing.assert_array_equal(get(a, gpu=1), np.arange(5))
    np.testing.assert_allclose(get(meshd.arange(1.0, 2.0, 0.25), gpu=0), np.arange(1, 2, 0.25))


def test_rand_seeds(mesh):
    r1, r2 = meshd.rand((64,), seed=7), meshd.rand((64,), seed=7)
    a0, a1 = get(r1, gpu=0), get(r1, gpu=1)
    np.testing.assert_array_equal(a0, get(r2, gpu=0))
    assert not np.array_equal(a0, a1) and (a0 >= 0).all() and (a0 < 1).all()
    n1, n2 = meshd.randn((32,)), meshd.randn((32,))  # fresh seeds
    assert not np.array_equal(get(n1, gpu=0), get(n2, gpu=0))
    np.testing.assert_array_equal(get(meshd.randn((8,), seed=3), gpu=1),
                                  get(meshd.randn((8,), seed=3), gpu=1))


def test_upload(mesh):
    a = np.arange(12, dtype=np.float64).reshape(3, 4) / 7
    t = meshd.tensor(a)
    assert t.shape == (3, 4) and t.dtype == "float64"
    for g in range(2):
        np.testing.assert_array_equal(get(t, gpu=g), a)
    b = np.arange(2 * 5, dtype=np.int64).reshape(2, 5)
    s = meshd.tensor(b, shard="gpu")
    assert s.shape == (5,)
    np.testing.assert_array_equal(get(s, gpu=0), b[0])
    np.testing.assert_array_equal(get(s, gpu=1), b[1])
    np.testing.assert_array_equal(meshd.inspect(s, gpu=1), b[1])
    big = np.random.default_rng(0).standard_normal((2, 700, 1000))  # 11 MB: chunked
    bt = meshd.tensor(big, shard="gpu")
    np.testing.assert_array_equal(get(bt, gpu=1), big[1])
    assert get(meshd.tensor(np.array([True, False])), gpu=0).dtype == np.bool_


@pytest.mark.parametrize("big", [False, True], ids=["literal", "upload"])
def test_a_big_endian_array_keeps_its_values(mesh, big, monkeypatch):
    """meshd's bytes are little-endian: an array of '>f4' or '>i8' is swapped on the way
    (it went as it lay, and came back as other numbers)."""
    if big:
        monkeypatch.setattr(sys.modules["meshd.tensor"], "_LITERAL_MAX", -1)
    for a in (np.array([1.5, -2.0, 3.25], dtype=">f4"), np.arange(6, dtype=">i8").reshape(2, 3)):
        got = get(meshd.tensor(a), gpu=1)
        np.testing.assert_array_equal(got, a)
        assert got.dtype == a.dtype.newbyteorder("<"), got.dtype


@pytest.mark.parametrize("big", [False, True], ids=["literal", "upload"])
def test_a_0_dim_array_keeps_its_shape(mesh, big, monkeypatch):
    """A 0-d array (or numpy scalar) is a 0-d tensor, as torch.tensor(3.5) is, whether
    it goes as a Literal or an Upload (np.ascontiguousarray had made it [1])."""
    if big:
        monkeypatch.setattr(sys.modules["meshd.tensor"], "_LITERAL_MAX", -1)
    for a, dtype in ((np.float64(3.5), None), (np.array(7, np.int32), None), (2.5, "bfloat16")):
        t = meshd.tensor(a, dtype=dtype)
        assert t.shape == (), (a, t.shape)
        got = get(t, gpu=1)
        assert got.shape == () and got == a, (a, got)


def test_upload_shard_on_a_two_dim_mesh(session):
    m = session.mesh(host=1, gpu=2)
    b = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    with m.activate():
        t = meshd.tensor(b, shard="gpu")
    np.testing.assert_array_equal(get(t, host=0, gpu=1), b[1])
    with m.activate():
        t = meshd.tensor(b[:1], shard="host")
    np.testing.assert_array_equal(get(t, host=0, gpu=1), b[0])


def test_client_side_type_and_value_errors(mesh, session):
    x = meshd.ones((2,))
    with pytest.raises(TypeError):
        x + [1, 2]
    with pytest.raises(TypeError):
        meshd.ops.add(x, [x, 1])
    with pytest.raises(TypeError):
        meshd.ops.add(x, np.ones(2))
    with pytest.raises(ValueError):
        meshd.tensor(np.ones(2, np.complex64))
    with pytest.raises(ValueError):
        meshd.zeros((2,), dtype="complex64")
    with pytest.raises(ValueError):
        meshd.tensor(np.ones((3, 2)), shard="gpu")   # 3 rows for 2 ranks
    with pytest.raises(ValueError):
        meshd.tensor(np.ones((2, 2)), shard="host")  # no such dim
    with pytest.raises(TypeError):
        meshd.zeros("2x3")
    with pytest.raises(TypeError):
        meshd.fetch_shard(x, gpu="0")
    with pytest.raises(TypeError):
        bool(x)
    with pytest.raises(TypeError):
        x.reduce(0)


def test_no_active_mesh(session):
    with pytest.raises(ValueError):
        meshd.zeros((2,))


# ================================================================ compute

def test_operators_against_numpy(mesh):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.uniform(1, 2, (3, 4)).astype(np.float32)
    x, y = meshd.tensor(a), meshd.tensor(b)
    close = dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(get(x + y, gpu=0), a + b, **close)
    np.testing.assert_allclose(get(x - y, gpu=1), a - b, **close)
    np.testing.assert_allclose(get(x * y, gpu=0), a * b, **close)
    np.testing.assert_allclose(get(x / y, gpu=0), a / b, **close)
    np.testing.assert_allclose(get(y ** 2, gpu=0), b ** 2, **close)
    np.testing.assert_allclose(get(-x, gpu=0), -a, **close)
    np.testing.assert_allclose(get(x + 1, gpu=0), a + 1, **close)
    np.testing.assert_allclose(get(2 + x, gpu=0), a + 2, **close)
    np.testing.assert_allclose(get(1 - x, gpu=0), 1 - a, **close)
    np.testing.assert_allclose(get(3 * x, gpu=1), 3 * a, **close)
    np.testing.assert_allclose(get(1 / y, gpu=1), 1 / b, **close)
    np.testing.assert_allclose(get(x @ y.T, gpu=1), a @ b.T, **close)
    assert (x @ y.T).shape == (3, 3) and y.T.shape == (4, 3)
    np.testing.assert_array_equal(get(x < y, gpu=0), a < b)
    np.testing.assert_array_equal(get(x >= 0, gpu=0), a >= 0)
    np.testing.assert_array_equal(get(x == x, gpu=0), np.ones((3, 4), bool))
    np.testing.assert_array_equal(get(x != y, gpu=0), a != b)
    np.testing.assert_array_equal(get(x <= y, gpu=0), a <= b)
    np.testing.assert_array_equal(get(x > y, gpu=0), a > b)
    assert (x < y).dtype == "bool"


def test_indexing_and_reductions(mesh):
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    x = meshd.tensor(a)
    np.testing.assert_array_equal(get(x[1], gpu=0), a[1])
    np.testing.assert_array_equal(get(x[-1], gpu=0), a[-1])
    np.testing.assert_array_equal(get(x[:, 1:], gpu=1), a[:, 1:])
    np.testing.assert_array_equal(get(x[0, ::2, 1], gpu=1), a[0, ::2, 1])
    assert x[0, 1:].shape == (2, 4)
    with pytest.raises(TypeError):
        x["a"]
    np.testing.assert_allclose(get(x.sum(), gpu=0), a.sum())
    np.testing.assert_allclose(get(x.sum(dim=0), gpu=0), a.sum(0))
    np.testing.assert_allclose(get(x.sum(dim=(0, 2), keepdim=True), gpu=0),
                               a.sum((0, 2), keepdims=True))
    np.testing.assert_allclose(get(x.mean(dim=1), gpu=1), a.mean(1), rtol=1e-6)
    np.testing.assert_array_equal(get(x.reshape([6, 4]), gpu=0), a.reshape(6, 4))
    np.testing.assert_array_equal(get(x.transpose(0, 2), gpu=0), a.transpose(2, 1, 0))


def test_generic_ops(mesh):
    a = np.array([[-1.0, 2.0], [3.0, -4.0]], np.float32)
    x = meshd.tensor(a)
    np.testing.assert_array_equal(get(meshd.ops.relu(x), gpu=0), np.maximum(a, 0))
    np.testing.assert_allclose(get(meshd.ops.exp(x), gpu=1), np.exp(a), rtol=1e-6)
    e = np.exp(a - a.max(1, keepdims=True))
    np.testing.assert_allclose(get(meshd.ops.softmax(x, 1), gpu=0), e / e.sum(1, keepdims=True),
                               rtol=1e-5)
    np.testing.assert_array_equal(get(meshd.ops.cat([x, x], 0), gpu=0), np.concatenate([a, a]))
    np.testing.assert_array_equal(get(meshd.ops.clamp(x, min=0.0, max=2.5), gpu=0),
                                  np.clip(a, 0, 2.5))
    c = meshd.ops.to(x, dtype="int64")
    assert c.dtype == "int64"
    np.testing.assert_array_equal(get(c, gpu=1), a.astype(np.int64))
    np.testing.assert_array_equal(get(x.abs(), gpu=1), np.abs(a))
    assert x.to("int64").dtype == "int64" and meshd.ops.cast(x, np.float64).dtype == "float64"
    np.testing.assert_array_equal(get(x.to(np.int32), gpu=0), a.astype(np.int32))
    raises_kind("BAD_ARGUMENT", meshd.ops.zeros, [2])  # factories are Factory commands


# ================================================================ collectives, to_mesh

def test_reduce(mesh):
    b = np.arange(2 * 3, dtype=np.float32).reshape(2, 3)
    x = meshd.tensor(b, shard="gpu")
    s = x.reduce("gpu")
    for g in range(2):
        np.testing.assert_array_equal(get(s, gpu=g), b.sum(0))
    np.testing.assert_array_equal(get(x.reduce((), "max"), gpu=0), b.max(0))
    np.testing.assert_array_equal(get(x.reduce(("gpu",), reduction="avg"), gpu=1), b.mean(0))
    st = x.reduce("gpu", "stack")
    assert st.shape == (2, 3)
    np.testing.assert_array_equal(get(st, gpu=1), b)
    out = meshd.zeros((3,))
    x.reduce("gpu", out=out)
    np.testing.assert_array_equal(get(out, gpu=0), b.sum(0))
    y = meshd.tensor(b, shard="gpu")
    assert y.reduce_("gpu") is y
    np.testing.assert_array_equal(get(y, gpu=1), b.sum(0))


def test_reduce_takes_monarchs_arguments_in_monarchs_order(mesh):
    """Monarch's Tensor.reduce(dims, reduction, scatter, mesh, _inplace, out) and
    reduce_(dims, reduction, scatter, mesh), and the pytree forms: a Monarch program
    passing mesh 4th by position runs unchanged (it was out there: a TypeError), and an
    in-place reduce onto a mesh is refused by the server, not silently done in place."""
    b = np.arange(2 * 3, dtype=np.float32).reshape(2, 3)
    x = meshd.tensor(b, shard="gpu")
    root = mesh.slice(gpu=0)
    s = x.reduce("gpu", "sum", False, root)
    assert s.mesh is root
    np.testing.assert_array_equal(get(s), b.sum(0))
    g, = meshd.reduce([x], "gpu", "stack", False, root)
    np.testing.assert_array_equal(get(g), b)
    for inplace in (lambda: x.reduce_("gpu", "sum", False, root),
                    lambda: meshd.reduce_([x], "gpu", "sum", False, root),
                    lambda: meshd.reduce([x], "gpu", "sum", False, root, True)):
        with pytest.raises(meshd.MeshdError, match="in place onto mesh"):
            inplace()
    np.testing.assert_array_equal(get(x, gpu=1), b[1])  # untouched
    assert x.reduce("gpu", "sum", False, None, True) is x  # _inplace, Monarch's 5th
    np.testing.assert_array_equal(get(x, gpu=1), b.sum(0))


def test_reduce_onto_a_sub_mesh(mesh):
    b = np.arange(2 * 3, dtype=np.float32).reshape(2, 3)
    x = meshd.tensor(b, shard="gpu")
    root = mesh.slice(gpu=1)
    s = x.reduce("gpu", mesh=root)
    assert s.mesh is root and s.shape == (3,)
    np.testing.assert_array_equal(get(s), b.sum(0))
    g, = meshd.reduce([x], "gpu", "stack", mesh=root)
    np.testing.assert_array_equal(get(g), b)
    with pytest.raises(meshd.MeshdError, match="still has the reduced dim 'gpu'") as e:
        x.reduce("gpu", mesh=mesh)
    assert isinstance(e.value, ValueError)
    with pytest.raises(TypeError, match="must be a Mesh"):
        x.reduce("gpu", mesh=root.ref)


def test_reduce_scatter(mesh):
    b = np.arange(2 * 2 * 3, dtype=np.float32).reshape(2, 2, 3)  # rank i holds b[i] (2, 3)
    x = meshd.tensor(b, shard="gpu")
    r = x.reduce("gpu", scatter=True)
    total = b.sum(0)
    for g in range(2):
        np.testing.assert_array_equal(get(r, gpu=g).reshape(-1), total[g])


def test_to_mesh(session, mesh):
    b = np.array([[1, 2], [3, 4]], np.int64)
    x = meshd.tensor(b, shard="gpu")
    other = session.mesh(gpu=2)
    y = x.to_mesh(other)
    assert y.mesh is other and y.stream is x.stream
    np.testing.assert_array_equal(get(y, gpu=1), b[1])
    one = mesh.slice(gpu=1)
    z = x.slice_mesh(gpu=0).to_mesh(one)
    assert z.mesh is one
    np.testing.assert_array_equal(get(z), b[0])
    side = session.stream("side")
    w = x.to_mesh(other, stream=side)
    assert w.stream is side


# ================================================================ streams, borrows, drop

def test_streams_and_borrows(session, mesh):
    side = session.stream("side")
    assert side.name == "side" and side is not session.default_stream
    x = meshd.ones((2,))
    xb, borrow = side.borrow(x)
    assert xb.stream is side
    raises_kind("WRONG_STREAM", lambda: xb + 1)  # main is active
    with side.activate():
        y = xb * 3
        assert y.stream is side
        raises_kind("WRONG_STREAM", lambda: x + 1)
    np.testing.assert_array_equal(get(y, gpu=0), np.full(2, 3, np.float32))
    raises_kind("BORROWED", x.drop)
    borrow.drop()
    assert xb.dropped and borrow.dropped
    with side.activate():
        e = raises_kind("DROPPED", lambda: xb + 1)
    assert "seq" in e.message
    x.drop()
    assert x.dropped


def test_streams_sharing_a_name_are_distinct(session, mesh):
    # Monarch's Stream(name) is a label: two modules that each make Stream("side")
    # get two streams, each running its own work in order (meshd refused the second).
    a, b = meshd.Stream("side"), session.stream("side")
    assert a.name == b.name == "side" and a.ref != b.ref
    assert repr(a) != repr(b) and str(a.ref) in repr(a)
    with a.activate():
        x = meshd.ones(2)
        x.add_(1)
        x.mul_(3)  # (1 + 1) * 3
    with b.activate():
        y = meshd.ones(2)
        y.mul_(3)
        y.add_(1)  # 1 * 3 + 1
    assert x.stream is a and y.stream is b
    with a.activate():
        e = raises_kind("WRONG_STREAM", lambda: x + y)
    assert f"'side' (ref {b.ref})" in e.message and f"'side' (ref {a.ref})" in e.message, e.message
    yb, borrow = a.borrow(y, mutable=True)  # from one "side" onto the other
    with b.activate():
        raises_kind("BORROWED", lambda: y + 1)
    with a.activate():
        z = x + yb
        yb.add_(1)
    borrow.drop()
    np.testing.assert_array_equal(get(z, gpu=1), np.full(2, 10, np.float32))
    np.testing.assert_array_equal(get(y, gpu=0), np.full(2, 5, np.float32))


def test_mutable_borrow_twice_is_borrowed(session, mesh):
    side, other = session.stream("s1"), session.stream("s2")
    x = meshd.zeros((2,))
    _, b = side.borrow(x, mutable=True)
    raises_kind("BORROWED", other.borrow, x, mutable=True)
    b.drop()
    _, b2 = other.borrow(x, mutable=True)
    b2.drop()
    with pytest.raises(TypeError):
        side.borrow([x])


def test_drop(mesh):
    x = meshd.ones((2,))
    y = x + 1
    assert not x.dropped
    x.drop()
    assert x.dropped
    x.drop()  # twice: no-op
    e = raises_kind("DROPPED", lambda: x + 1)
    assert "seq" in e.message
    np.testing.assert_array_equal(get(y, gpu=0), np.full(2, 2, np.float32))


# ================================================================ errors

def test_check_failures_raise_at_the_call(session, mesh):
    x = meshd.ones((2, 3))
    other = session.mesh(gpu=2)
    with other.activate():
        o = meshd.ones((2, 3))
    raises_kind("WRONG_MESH", lambda: x + o)
    raises_kind("SHAPE_MISMATCH", lambda: x @ x)
    with pytest.raises(AttributeError, match="catalogue"):  # known locally: no call
        meshd.ops.no_such_op
    raises_kind("UNKNOWN_OP", _call, "no_such_op", x)  # the server checks it too
    raises_kind("BAD_DIM", x.reduce, "host")
    raises_kind("BAD_ARGUMENT", x.reduce, "gpu", "median")
    raises_kind("SHAPE_MISMATCH", x.reduce, "gpu", out=meshd.zeros((5,)))
    raises_kind("BAD_ARGUMENT", meshd.zeros, (-1,))
    raises_kind("DTYPE_MISMATCH", x.reduce, "gpu", "bor")
    raises_kind("SHAPE_MISMATCH", x.to_mesh, session.mesh(gpu=1))
    raises_kind("BAD_DIM", meshd.fetch_shard(x, gpu=0, host=0).result)
    # a rejected command changes nothing: the session goes on
    np.testing.assert_array_equal(get(x + 1, gpu=0), np.full((2, 3), 2, np.float32))


def test_quota(server):
    with meshd.connect(server[0], quota_bytes=1024) as s:
        with s.mesh(gpu=2).activate():
            meshd.zeros((16,))
            raises_kind("QUOTA", meshd.zeros, (1024,))


def test_runtime_failures(mesh, session):
    x = meshd.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    idx = meshd.tensor(np.array([[0, 1], [0, 7]]), shard="gpu")  # rank 1 out of range
    bad = meshd.ops.index_select(x, 1, idx)   # accepted: the failure happens on the agent
    dep = bad + 1
    with pytest.raises(meshd.MeshdError) as e:
        session.sync()
    assert e.value.kind == "REMOTE_FAILURE" and "index_select" in e.value.message
    session.sync()  # reported once
    for g in (0, 1):
        raises_kind("REMOTE_FAILURE", get, bad, gpu=g)
    for g in (0, 1):  # a value that failed on any rank raises on fetch from every rank
        raises_kind("DEPENDENT_FAILURE", get, dep, gpu=g)
    np.testing.assert_array_equal(get(x + 1, gpu=0), np.arange(6).reshape(2, 3) + 1)


# ================================================================ threads

def test_one_session_from_several_threads(session):
    meshes = [session.mesh(gpu=2) for _ in range(4)]
    errors, results = [], {}

    def work(i):
        try:
            with meshes[i].activate():
                side = session.stream(f"t{i}")
                acc = meshd.full((3,), float(i))
                for _ in range(20):
                    acc = acc + 1
                with side.activate():
                    z = meshd.zeros((1,))
                assert z.stream is side and acc.mesh is meshes[i]
                results[i] = get(acc, gpu=i % 2)
        except BaseException as e:  # reported below
            errors.append(e)
    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    for i in range(4):
        np.testing.assert_array_equal(results[i], np.full(3, i + 20, np.float32))


# ================================================================ more

def test_sync_lists_every_new_error(mesh, session):
    x = meshd.tensor(np.arange(3, dtype=np.float32))
    idx = meshd.tensor(np.array([5]))
    meshd.ops.index_select(x, 0, idx)
    meshd.ops.index_select(x, 0, idx)
    with pytest.raises(meshd.MeshdError) as e:
        session.sync()
    assert e.value.kind == "REMOTE_FAILURE" and e.value.seq
    assert len(e.value.errors) == 2 and e.value.errors[0] is e.value
    assert all(err.kind == "REMOTE_FAILURE" for err in e.value.errors)
    session.sync()


def test_factories_and_uploads_use_the_active_stream(session, mesh):
    side = session.stream("side")
    with side.activate():
        z = meshd.zeros((2,))
        u = meshd.tensor(np.ones(2, np.float32))
        r = mesh.rank("gpu")
        w = z + u + r
    assert z.stream is side and u.stream is side and w.stream is side
    np.testing.assert_array_equal(get(w, gpu=1), np.full(2, 2, np.float32))


def test_proto_dir_override(tmp_path):
    """MESHD_PROTO_DIR names api/; a missing one is an ImportError naming the path."""
    import subprocess
    import sys
    api = os.path.normpath(os.path.join(os.path.dirname(meshd.__file__), "..", "..", "..", "api"))
    code = ("import meshd._proto as p; print(p.tensor_pb2().DType.Name(1))")
    env = dict(os.environ, MESHD_PROTO_DIR=api, XDG_CACHE_HOME=str(tmp_path / "c"),
               PYTHONDONTWRITEBYTECODE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "DTYPE_FLOAT32", out.stderr
    assert [d for d in os.listdir(tmp_path / "c" / "meshd") if d.startswith("proto-")]
    env["MESHD_PROTO_DIR"] = str(tmp_path / "nowhere")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "ImportError" in out.stderr and "nowhere" in out.stderr


def test_inplace_ops_and_multiple_results(mesh):
    a = np.array([[1.0, 5.0], [7.0, 2.0]], np.float32)
    x = meshd.tensor(a)
    assert meshd.ops.add_(x, 1) is x
    assert x.mul_(2) is x
    np.testing.assert_array_equal(get(x, gpu=1), (a + 1) * 2)
    v, i = meshd.ops.max(x, 1)
    np.testing.assert_array_equal(get(v, gpu=0), ((a + 1) * 2).max(1))
    np.testing.assert_array_equal(get(i, gpu=0), a.argmax(1))
    assert i.dtype == "int64"
    np.testing.assert_array_equal(get(meshd.ops.max(x), gpu=0), ((a + 1) * 2).max())
    x.zero_()
    np.testing.assert_array_equal(get(x, gpu=0), np.zeros((2, 2), np.float32))


def test_a_fetch_is_the_value_where_it_was_asked_for(mesh):
    """fetch_shard's Future holds the tensor as the code before it left it: in-place
    writes after it, even before the Future is read, change only later fetches
    (Monarch's order; before, the Fetch could be planned after them)."""
    x = meshd.tensor(np.ones((256, 256), np.float32))
    futures = []
    for i in range(4):
        futures.append(meshd.fetch_shard(x, gpu=i % 2))
        x.add_(1)
    meshd.ops.mul_(x, 2)
    for i, f in enumerate(futures):
        np.testing.assert_array_equal(f.result(), np.full((256, 256), 1.0 + i, np.float32))
    np.testing.assert_array_equal(get(x, gpu=0), np.full((256, 256), 10.0, np.float32))


def test_grpcs_bare_deadline_message_says_whose_deadline():
    """gRPC's own "Deadline Exceeded" (no kind of the server's) becomes a
    DEADLINE_EXCEEDED MeshdError that says which deadline passed; a server's own
    message is kept as it is."""
    import grpc

    class Lost(grpc.RpcError):
        def __init__(self, details, trailers=()):
            self._details, self._trailers = details, trailers

        def code(self):
            return grpc.StatusCode.DEADLINE_EXCEEDED

        def details(self):
            return self._details

        def trailing_metadata(self):
            return self._trailers

    e = meshd.MeshdError.from_rpc(Lost("Deadline Exceeded"))
    assert e.kind == "DEADLINE_EXCEEDED"
    assert "the session's timeout, or the timeout= given" in str(e), str(e)
    mine = meshd.MeshdError.from_rpc(Lost("Sync: waited 5 s", (("meshd-error-kind",
                                                                  "DEADLINE_EXCEEDED"),)))
    assert "Sync: waited 5 s" in str(mine) and "session's timeout" not in str(mine), str(mine)
