"""Server <-> agents (docs/operations.md "Cluster security"): nobody else can join or
drive an agent. An agent serves Hello/Execute/Read/Write only to the server it
registered with (the call secret); registration needs the join token or a cluster
certificate, is refused before any dial-back and logged with its peer; ranks are
bounded by --max-agents; --local-agents makes a private join token; cluster mTLS end
to end (certificates from tests/support/make_certs.sh), with the agent's plaintext
health port for probes."""

import os
import re
import stat
import sys
import threading
import time

import grpc
import numpy as np
import pytest

import chaos
import meshd_testlib as lib
from meshd_testlib import Session, reduce

TOKEN = "join-0123456789abcdef0123456789"
_AGENT = "/meshd.agent.v1.Agent/"
_REGISTER = "/meshd.v1.AgentRegistry/RegisterAgent"


def _token_file(tmp, name, token):
    p = tmp / name
    p.write_text(token + "\n")
    p.chmod(0o600)
    return p


def _serialize(m):
    return m.SerializeToString()


def _agent_calls(ch):
    """The four Agent methods as callables taking (metadata) and returning the status code."""
    a = lib.agent_pb2()

    def hello(md):
        ch.unary_unary(_AGENT + "Hello", request_serializer=_serialize,
                       response_deserializer=a.HelloReply.FromString)(
            a.HelloRequest(agent_id="x"), metadata=md, timeout=5)

    def read(md):
        list(ch.unary_stream(_AGENT + "Read", request_serializer=_serialize,
                             response_deserializer=a.DataChunk.FromString)(
            a.ReadRequest(session_id="s", ref=1), metadata=md, timeout=5))

    def write(md):
        chunks = [a.DataChunk(session_id="s", spec=a.TensorSpec(ref=1, shape=[4], strides=[1],
                                                                  dtype=1)),
                  a.DataChunk(session_id="s", data=b"\0" * 16)]
        ch.stream_unary(_AGENT + "Write", request_serializer=_serialize,
                        response_deserializer=a.WriteReply.FromString)(
            iter(chunks), metadata=md, timeout=5)

    def execute(md):
        batch = a.InstructionBatch(instructions=[a.Instruction(
            seq=1, session_id="s", status=a.StatusRequest())])
        list(ch.stream_stream(_AGENT + "Execute", request_serializer=_serialize,
                              response_deserializer=a.AgentReport.FromString)(
            iter([batch]), metadata=md, timeout=5))

    return {"Hello": hello, "Read": read, "Write": write, "Execute": execute}


def _code(fn, md):
    try:
        fn(md)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def _wait_log(proc, needle, timeout=10.0):
    deadline = time.monotonic() + timeout
    while needle not in proc.log_text():
        assert time.monotonic() < deadline, f"{needle!r} not logged within {timeout} s\n" \
                                            f"{lib.log_tail(proc.log)}"
        time.sleep(0.05)


def _lines(proc, needle):
    return [l for l in proc.log_text().splitlines() if needle in l]


def _compute_on_two_ranks(port):
    """A reduce over 2 ranks and Fetches from both: the pool computes."""
    with Session(port, "cluster-sec") as s:
        m = s.mesh(gpu=2).ref
        x = s.tensor(m, (4,), "ones").ref
        r = s.run(reduce(s.new_ref(), x, dims=["gpu"], reduction="sum")).tensors[0].ref
        for g in (0, 1):
            np.testing.assert_array_equal(chaos.fetch(s, r, gpu=g), np.full(4, 2.0, np.float32))
        s.close()


# ================================================================ an agent's port

def test_an_agent_serves_only_the_server_it_registered_with(agent):
    with lib.FakeRegistry() as reg:
        a = agent(reg.port, wait_registered=True)
        first = reg.wait()
        assert len(first.call_secret) == 64
        good = reg.metadata()
        with lib.channel(a.port) as ch:
            calls = _agent_calls(ch)
            wrong = ((lib.AGENT_SECRET_MD, "0" * 64),)
            longer = ((lib.AGENT_SECRET_MD, first.call_secret + "0"),)
            for name, fn in calls.items():
                for md in ((), wrong, longer, ((lib.AGENT_SECRET_MD, first.call_secret[:-1]),)):
                    assert _code(fn, md) == grpc.StatusCode.UNAUTHENTICATED, (name, md)
            # The server's secret is admitted: Hello answers, Read gets past the guard.
            assert reg.hello().agent_id == first.agent_id
            assert _code(calls["Read"], good) != grpc.StatusCode.UNAUTHENTICATED
        _wait_log(a, "refused /meshd.agent.v1.Agent/Read from ipv4:127.0.0.1:")
        # A new registration, a new secret: the old one no longer opens the agent.
        reg.drop()
        second = reg.wait()
        assert second.call_secret != first.call_secret
        with lib.channel(a.port) as ch:
            calls = _agent_calls(ch)
            assert _code(calls["Hello"], good) == grpc.StatusCode.UNAUTHENTICATED
            assert reg.hello().agent_id == second.agent_id


def test_a_strangers_execute_stream_does_not_take_the_rank_out(shared_meshd):
    srv = shared_meshd(2)
    target = chaos.agents_by_rank(srv.port)[0]
    a = lib.agent_pb2()
    with lib.channel(int(target.address.rsplit(":", 1)[1])) as ch:
        done = threading.Event()

        def nothing():
            done.wait(10)
            return
            yield

        call = ch.stream_stream(_AGENT + "Execute", request_serializer=_serialize,
                                response_deserializer=a.AgentReport.FromString)(nothing(), timeout=15)
        try:
            with pytest.raises(grpc.RpcError) as e:
                list(call)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
            time.sleep(1.0)  # what a replaced link would have needed to show
            ag = chaos.agents_by_rank(srv.port)
            assert ag[0].healthy and ag[1].healthy, lib.describe_agents(ag.values())
            assert ag[0].registered_unix_ms == target.registered_unix_ms, "rank 0 re-registered"
        finally:
            done.set()
            call.cancel()
    _compute_on_two_ranks(srv.port)


# ================================================================ registration

@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    """meshd --join-token-file with no agents of its own, --max-agents 8."""
    tmp = tmp_path_factory.mktemp("join")
    tf = _token_file(tmp, "join-token", TOKEN)
    p = lib.spawn("meshd", lib.MESHD, ["--listen", "127.0.0.1:0", "--min-agents", "0",
                                       "--max-agents", "8", "--join-token-file", str(tf)], str(tmp))
    lib.wait_health(p.port, "", lib.SERVING(), proc=p.proc, log=p.log)
    p.tmp, p.token_file = tmp, tf
    yield p
    lib.stop(p)
    hit = lib.sanitizer_report(p.log)
    assert not hit, hit
    assert TOKEN not in p.log_text(), "the join token was logged"


def _register_raw(port, token=None, rank=0, address="127.0.0.1:1"):
    """One RegisterAgent call; returns (code, details)."""
    reg = lib.registry_pb2()
    md = ((lib.JOIN_TOKEN_MD, token),) if token is not None else ()
    with lib.channel(port) as ch:
        fn = ch.stream_stream(_REGISTER, request_serializer=_serialize,
                              response_deserializer=reg.ServerToAgent.FromString)
        hello = reg.AgentToServer(hello=reg.RegisterRequest(
            agent_id=f"rogue-{time.monotonic_ns()}", address=address, device="cpu",
            requested_rank=rank, call_secret="a" * 64))
        try:
            list(fn(iter([hello]), metadata=md, timeout=5))
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            return e.code(), e.details()


def test_a_rogue_without_the_join_token_cannot_register(token_server, agent, tmp_path):
    srv = token_server
    # Raw calls: nothing, a wrong token, the token with a byte more.
    for tok, why in ((None, "no join token"), ("x" * 32, "wrong join token"),
                     (TOKEN + "0", "wrong join token")):
        code, details = _register_raw(srv.port, tok)
        assert code == grpc.StatusCode.UNAUTHENTICATED and why in details, (tok, code, details)
    _wait_log(srv, "registration from ipv4:127.0.0.1:")
    assert any("refused: no join token" in l for l in _lines(srv, "registration from ipv4:"))
    # A real agent without the token, and one with a wrong one, stay unregistered.
    a = agent(srv.port, wait_registered=False)
    b = agent(srv.port, "--join-token-file", _token_file(tmp_path, "bad", "y" * 32),
              wait_registered=False)
    _wait_log(a, "registration rejected by server")
    _wait_log(b, "wrong join token")
    assert lib.list_agents(srv.port) == []
    # The token admits.
    good = agent(srv.port, "--join-token-file", srv.token_file)
    assert [x.address for x in lib.list_agents(srv.port)] == [good.address]
    lib.stop(good)


def test_ranks_are_bounded_by_max_agents(token_server, agent):
    srv = token_server
    code, details = _register_raw(srv.port, TOKEN, rank=1 << 20)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "--max-agents" in details, details
    a = agent(srv.port, "--join-token-file", srv.token_file, "--rank", 8, wait_registered=False)
    _wait_log(a, "--max-agents")
    lib.wait_agents(srv.port, lambda ag: ag == [], what="no agent", log=srv.log)


def test_refusals_are_logged_at_a_bounded_rate(token_server):
    srv = token_server
    before = len(_lines(srv, "registration from ipv4:"))
    for _ in range(40):
        assert _register_raw(srv.port, "z" * 20)[0] == grpc.StatusCode.UNAUTHENTICATED
    time.sleep(0.2)
    logged = len(_lines(srv, "registration from ipv4:")) - before
    # At most 10 a window (10 s); the 40 may straddle two.
    assert logged <= 20, f"{logged} lines for 40 refusals"


def test_refusals_after_the_guard_are_logged_at_a_bounded_rate(meshd_server):
    """An open registry (no join token, no certificates) admits anyone to the call; what
    it then refuses (a bad RegisterRequest) is logged with the same bound as the guard's
    refusals, or a stranger writes one WARN line per call into the server's log."""
    srv = meshd_server(0, min_agents=0)
    before = len(_lines(srv, "registration from ipv4:"))
    for _ in range(40):
        code, details = _register_raw(srv.port, None, rank=1 << 20)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "--max-agents" in details, details
    time.sleep(0.2)
    logged = len(_lines(srv, "registration from ipv4:")) - before
    # At most 10 a window (10 s); the 40 may straddle two.
    assert 1 <= logged <= 20, f"{logged} lines for 40 refusals"
    # Well-formed requests whose address does not answer: admitted, then refused when
    # the dial-back fails; those lines are bounded too.
    reg = lib.registry_pb2()
    before = len(_lines(srv, "cannot dial agent rank"))
    with lib.channel(srv.port) as ch:
        fn = ch.stream_stream(_REGISTER, request_serializer=_serialize,
                              response_deserializer=reg.ServerToAgent.FromString)
        for _ in range(40):
            ended = threading.Event()

            def requests():  # the hello, then the call stays open until the server ends it
                yield reg.AgentToServer(hello=reg.RegisterRequest(
                    agent_id=f"rogue-{time.monotonic_ns()}", address="127.0.0.1:1",
                    device="cpu", requested_rank=-1, call_secret="a" * 64))
                ended.wait(5)
            try:
                list(fn(requests(), timeout=5))
                code, details = grpc.StatusCode.OK, ""
            except grpc.RpcError as e:
                code, details = e.code(), e.details()
            ended.set()
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "could not reach" in details, \
                (code, details)
    time.sleep(0.2)
    logged = len(_lines(srv, "cannot dial agent rank")) - before
    assert 1 <= logged <= 20, f"{logged} lines for 40 failed dial-backs"


def test_silent_registrations_are_ended_and_bounded(meshd_server, agent):
    """An open registry admits anyone to RegisterAgent: a stranger's calls that never send
    their RegisterRequest are ended after a bounded time, at most about
    --max-unauthenticated-requests of them are held once they waited 1 s (the oldest ended
    past it), and real agents register and compute meanwhile."""
    srv = meshd_server(0, "--max-unauthenticated-requests", "32", min_agents=0)
    reg = lib.registry_pb2()
    stop = threading.Event()

    def silent():  # opens the call, never sends a message
        stop.wait(60)
        return
        yield

    chans = [lib.channel(srv.port) for _ in range(4)]
    try:
        calls = []
        for ch in chans:
            fn = ch.stream_stream(_REGISTER, request_serializer=_serialize,
                                  response_deserializer=reg.ServerToAgent.FromString)
            calls += [fn(silent(), timeout=60) for _ in range(40)]
        # A stream gets 1 s for its first message before it can be the one cancelled
        # (honest bursts on a busy server are read late, not refused): past that, the
        # next call to come ends the oldest down to the bound at once.
        time.sleep(1.2)
        # Real agents register and compute while the stranger holds its calls.
        agent(srv.port, rank=0)
        agent(srv.port, rank=1)
        lib.wait_agents(srv.port, lambda a: len(lib.healthy_ranks(a)) == 2, what="2 agents")
        _compute_on_two_ranks(srv.port)
        # Past the bound, the oldest are ended at once ...
        deadline = time.monotonic() + 5
        while sum(c.done() for c in calls) < len(calls) - 32 and time.monotonic() < deadline:
            time.sleep(0.05)
        ended = [c for c in calls if c.done()]
        assert len(ended) >= len(calls) - 32, f"{len(calls) - len(ended)} silent calls held"
        evicted = [c for c in ended if "--max-unauthenticated-requests" in c.details()]
        assert len(evicted) >= len(calls) - 32, \
            f"only {len(evicted)} ended by the bound (the rest by the 5 s deadline)"
        # ... and every one within a bounded time, saying why.
        deadline = time.monotonic() + 15
        while not all(c.done() for c in calls) and time.monotonic() < deadline:
            time.sleep(0.05)
        held = [c for c in calls if not c.done()]
        assert not held, f"{len(held)} silent registration calls still open after 15 s"
        for c in calls:
            assert c.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                grpc.StatusCode.DEADLINE_EXCEEDED), (c.code(), c.details())
            assert ("RegisterRequest" in c.details() or
                    "--max-unauthenticated-requests" in c.details()), c.details()
        assert any("RegisterRequest" in c.details() for c in calls)
        # The agents were not disturbed.
        assert len(lib.healthy_ranks(lib.list_agents(srv.port))) == 2
        _compute_on_two_ranks(srv.port)
    finally:
        stop.set()
        for ch in chans:
            ch.close()


def test_local_agents_get_a_private_join_token(meshd_server, agent):
    srv = lib.wait_ready(meshd_server(1), 1)
    kids = lib.agent_children(srv.pid)
    (pid,) = kids
    argv = lib.proc_cmdline(pid)
    path = argv[argv.index("--join-token-file") + 1]
    token = open(path).read().strip()
    assert len(token) == 64 and not any(token in a for a in argv)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    # Nobody else has it: an agent of its own cannot join this server.
    stranger = agent(srv.port, wait_registered=False)
    _wait_log(stranger, "no join token")
    _wait_log(srv, "refused: no join token")
    assert token not in srv.log_text() and token not in stranger.log_text()
    lib.stop(stranger)
    assert lib.stop(srv) == 0
    assert not os.path.exists(os.path.dirname(path)), "the join token outlived meshd"


def test_a_secured_client_port_admits_only_its_local_agents(meshd_server, agent, pki, tmp_path):
    """--tls-cert: the registry is not on the TLS client port; local agents register on a
    loopback port of their own. --auth-tokens without a join token: only local agents."""
    hport = lib.free_port()
    key = tmp_path / "server.key"  # readable by every user: a warning names it
    key.write_bytes((pki / "server.key").read_bytes())
    key.chmod(0o644)
    srv = meshd_server(2, "--tls-cert", pki / "server.pem", "--tls-key", key,
                       "--health-listen", f"127.0.0.1:{hport}", wait_serving=False)
    lib.wait_health(hport, lib.TENSOR_SERVICE, lib.SERVING(), timeout=lib.REGISTER_TIMEOUT,
                    proc=srv.proc, log=srv.log)  # both local agents registered
    _wait_log(srv, "plaintext, loopback only: for the local agents")
    _wait_log(srv, f"TLS private key: '{key}' is readable by every user (mode 644)")
    creds = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes())
    with grpc.secure_channel(f"localhost:{srv.port}", creds) as ch:
        fn = ch.stream_stream(_REGISTER, request_serializer=lambda b: b,
                              response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as e:
            list(fn(iter([b""]), timeout=5))
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED, e.value
    # A session over TLS keeps its bytes encrypted: with plaintext agents auto takes the
    # proxy (the direct path is for agents on cluster mTLS, test_direct.py).
    sys.path.insert(0, os.path.join(lib.SOURCE_DIR, "clients", "python"))
    os.environ.setdefault("XDG_CACHE_HOME", str(tmp_path / "cache"))
    import meshd
    with meshd.connect(f"localhost:{srv.port}", root_certs=(pki / "ca.pem").read_bytes(),
                       timeout=30) as s:
        with s.mesh(gpu=2).activate():
            x = meshd.tensor(np.arange(4, dtype=np.float32))
            assert meshd.fetch_shard(x, gpu=1).result().tolist() == [0, 1, 2, 3]
        assert s._direct.counts == {"upload": 0, "fetch": 0}, s._direct.counts

    tokens = tmp_path / "principals"
    tokens.write_text("alice alice-0123456789abcdef\n")
    tokens.chmod(0o644)
    plain = meshd_server(0, "--auth-tokens", tokens, min_agents=0)
    stranger = agent(plain.port, wait_registered=False)
    _wait_log(stranger, "no join token")
    _wait_log(plain, "only its local agents can")
    _wait_log(plain, f"--auth-tokens: '{tokens}' is readable by every user (mode 644)")
    tokens.chmod(0o600)
    private = meshd_server(0, "--auth-tokens", tokens, min_agents=0)
    _wait_log(private, "only its local agents can")
    assert "readable by every user" not in open(private.log).read()


# ================================================================ cluster mTLS

def _cluster_flags(pki, cert="cluster", ca="cluster-ca"):
    return ["--cluster-ca", pki / f"{ca}.pem", "--cluster-cert", pki / f"{cert}.pem",
            "--cluster-key", pki / f"{cert}.key"]


def test_cluster_mtls_with_a_join_token_end_to_end(meshd_server, agent, pki, tmp_path):
    tf = _token_file(tmp_path, "join", TOKEN)
    cpf = tmp_path / "cluster.port"
    srv = meshd_server(2, *_cluster_flags(pki), "--join-token-file", tf,
                       "--cluster-listen", "127.0.0.1:0", "--cluster-port-file", cpf,
                       "--max-agents", 4)
    lib.wait_ready(srv, 2)
    cport = int(cpf.read_text())
    _compute_on_two_ranks(srv.port)
    # The client port does not serve the registry; its own port wants a certificate.
    assert _register_raw(srv.port, TOKEN)[0] == grpc.StatusCode.UNIMPLEMENTED
    assert _register_raw(cport, TOKEN)[0] == grpc.StatusCode.UNAVAILABLE  # plaintext to mTLS
    # A rogue with the rogue CA's certificate (same names) fails the handshake; one with
    # the real certificate but no join token is refused and logged with its peer.
    rogue = agent(cport, *_cluster_flags(pki, "rogue", "cluster-ca"), wait_registered=False)
    no_token = agent(cport, *_cluster_flags(pki), wait_registered=False)
    # A certificate the cluster CA signed for another name (a CA that signs users too),
    # with the join token: refused for its name.
    stranger = agent(cport, *_cluster_flags(pki, "stranger"), "--join-token-file", tf,
                     wait_registered=False)
    _wait_log(srv, "certificate verify failed")
    _wait_log(srv, "refused: no join token")
    _wait_log(no_token, "no join token")
    _wait_log(srv, "does not name the cluster")
    # The real thing, with a plaintext health port for probes.
    hpf = tmp_path / "health.port"
    good = agent(cport, *_cluster_flags(pki), "--join-token-file", tf, "--rank", 2,
                 "--health-listen", "127.0.0.1:0", "--health-port-file", hpf,
                 wait_registered=False)
    hport = lib.read_port_file(str(hpf), good.proc, good.log)
    lib.wait_health(hport, lib.AGENT_SERVICE, lib.SERVING(), timeout=lib.REGISTER_TIMEOUT,
                    proc=good.proc, log=good.log)
    with lib.channel(hport) as ch:  # health only
        assert _code(_agent_calls(ch)["Hello"], ()) == grpc.StatusCode.UNIMPLEMENTED
    # Healthy once the server's dial-back (mTLS, the call secret) answered.
    ag = lib.wait_agents(srv.port, lambda ag: lib.healthy_ranks(ag) == [0, 1, 2],
                         what="ranks 0..2 healthy", log=srv.log)
    ranks = {a.rank: a for a in ag}
    for p in (rogue, no_token, stranger):
        assert lib.proc_state(p.pid) not in (None, "Z"), "a refused agent exited"
    # The agents' own ports: plaintext fails; TLS without a client certificate is
    # refused on every call but a granted Read/Write; a certificate of another CA fails
    # the handshake; a cluster certificate gets as far as the call secret.
    for a in (ranks[0], ranks[2]):
        with grpc.insecure_channel(a.address) as ch:
            assert _code(_agent_calls(ch)["Hello"], ()) == grpc.StatusCode.UNAVAILABLE
        for cert, want in ((None, "cluster certificate"), ("rogue", None),
                           ("stranger", "does not name the cluster"),
                           ("cluster", "lacks that server's secret")):
            with _tls_channel(a.address, pki, cert) as ch:
                code, details = _status(_agent_calls(ch)["Read"], ())
                if want is None:
                    assert code == grpc.StatusCode.UNAVAILABLE, (cert, code, details)
                else:
                    assert code == grpc.StatusCode.UNAUTHENTICATED and want in details, \
                        (cert, code, details)
    lib.stop(good)
    assert TOKEN not in srv.log_text()


def _tls_channel(address, pki, cert=None):
    """TLS to an agent's port, verified with the cluster CA under the cluster name;
    with cert ("cluster", "rogue") presenting that client certificate."""
    ca = (pki / "cluster-ca.pem").read_bytes()
    keys = {} if cert is None else dict(private_key=(pki / f"{cert}.key").read_bytes(),
                                        certificate_chain=(pki / f"{cert}.pem").read_bytes())
    creds = grpc.ssl_channel_credentials(root_certificates=ca, **keys)
    return grpc.secure_channel(address, creds, options=[
        ("grpc.ssl_target_name_override", "meshd-cluster"), ("grpc.enable_http_proxy", 0),
        ("grpc.use_local_subchannel_pool", 1)])


def _status(fn, md):
    try:
        fn(md)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details() or ""


def _port_calls(ch):
    """Everything an agent's port serves besides Read and Write under a grant: the
    Agent methods, reflection and Health, as callables taking metadata."""
    calls = _agent_calls(ch)
    a, h, r = lib.agent_pb2(), lib.health_pb2(), lib.reflection_pb2()

    def unary(method, req):
        return lambda md: ch.unary_unary(method, request_serializer=_serialize,
                                         response_deserializer=lambda b: b)(req, metadata=md,
                                                                            timeout=5)

    def first(call):
        return next(iter(call))

    calls["InspectUrl"] = unary(_AGENT + "InspectUrl", a.InspectUrlRequest(url="http://127.0.0.1:1/x"))
    calls["LoadProgress"] = unary(_AGENT + "LoadProgress", a.LoadProgressRequest(session_id="s"))
    calls["Health/Check"] = unary("/grpc.health.v1.Health/Check", h.HealthCheckRequest())
    calls["Health/Watch"] = lambda md: first(ch.unary_stream(
        "/grpc.health.v1.Health/Watch", request_serializer=_serialize,
        response_deserializer=lambda b: b)(h.HealthCheckRequest(), metadata=md, timeout=5))
    calls["Reflection"] = lambda md: first(ch.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", request_serializer=_serialize,
        response_deserializer=lambda b: b)(iter([r.ServerReflectionRequest(list_services="*")]),
                                           metadata=md, timeout=5))
    return calls


def test_cluster_mtls_agents_admit_clients_without_a_certificate_only_to_granted_transfers(
        agent, pki):
    """With cluster mTLS an agent's port also takes TLS clients without a certificate
    (the direct data path), for Read and Write under a grant only: every Agent method,
    reflection and Health refuse such a client UNAUTHENTICATED even with the real call
    secret (learned here by a fake registry), and a forged grant is refused as ever. A
    client certificate of another CA fails the handshake; the cluster certificate with
    the secret is served."""
    tls = tuple((pki / n).read_bytes() for n in ("cluster.key", "cluster.pem", "cluster-ca.pem"))
    with lib.FakeRegistry(tls=tls) as reg:
        ag = agent(reg.port, *_cluster_flags(pki), wait_registered=False)
        hello = reg.wait()
        secret = reg.metadata()
        with _tls_channel(hello.address, pki) as ch:
            calls = _port_calls(ch)
            for name, fn in calls.items():
                for md in ((), secret):
                    code, details = _status(fn, md)
                    assert code == grpc.StatusCode.UNAUTHENTICATED and \
                        "cluster certificate" in details, (name, bool(md), code, details)
            # Read and Write reach the grant's checks without a certificate; a grant not
            # signed with the agent's secret goes no further.
            a = lib.agent_pb2()
            expiry = int(time.time() * 1000) + 60000
            for direction, call in ((1, "Read"), (2, "Write")):
                g = a.TransferGrant(session_id="s", ref=1, rank=0, direction=direction,
                                    expiry_unix_ms=expiry, nonce=bytes(16))
                md = (("meshd-transfer-grant-bin", g.SerializeToString() + bytes(32)),)
                if call == "Read":
                    fn = lambda md: list(ch.unary_stream(
                        _AGENT + "Read", request_serializer=_serialize,
                        response_deserializer=lambda b: b)(a.ReadRequest(session_id="s", ref=1),
                                                           metadata=md, timeout=5))
                else:
                    fn = lambda md: ch.stream_unary(
                        _AGENT + "Write", request_serializer=_serialize,
                        response_deserializer=lambda b: b)(iter([a.DataChunk(data=bytes(16))]),
                                                           metadata=md, timeout=5)
                code, details = _status(fn, md)
                assert code == grpc.StatusCode.PERMISSION_DENIED and "bad signature" in details, \
                    (call, code, details)
        with _tls_channel(hello.address, pki, "rogue") as ch:
            assert _status(_agent_calls(ch)["Hello"], secret)[0] == grpc.StatusCode.UNAVAILABLE
        with _tls_channel(hello.address, pki, "cluster") as ch:
            calls = _port_calls(ch)
            for name in ("Health/Check", "Reflection"):
                assert _status(calls[name], secret) == (grpc.StatusCode.OK, ""), name
            a = lib.agent_pb2()
            hello_call = ch.unary_unary(_AGENT + "Hello", request_serializer=_serialize,
                                        response_deserializer=a.HelloReply.FromString)
            assert hello_call(a.HelloRequest(agent_id=hello.agent_id), metadata=secret,
                              timeout=5).agent_id == hello.agent_id
            code, details = _status(calls["Hello"], ())
            assert code == grpc.StatusCode.UNAUTHENTICATED and "secret" in details, details
        _wait_log(ag, "no verified cluster certificate")


def _leaf(pki, name, cn, san):
    """A certificate the cluster CA signs, CN cn, subjectAltName san (None: none)."""
    import subprocess
    key, csr, pem, ext = (pki / f"{name}.{x}" for x in ("key", "csr", "pem", "ext"))
    subprocess.run(["openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                    "-nodes", "-subj", f"/CN={cn}", "-keyout", key, "-out", csr],
                   check=True, capture_output=True, timeout=60)
    ext.write_text((f"subjectAltName={san}\n" if san else "") +
                   "extendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n")
    subprocess.run(["openssl", "x509", "-req", "-in", csr, "-CA", pki / "cluster-ca.pem",
                    "-CAkey", pki / "cluster-ca.key", "-CAcreateserial", "-days", "2",
                    "-extfile", ext, "-out", pem], check=True, capture_output=True, timeout=60)


def test_a_common_name_counts_only_without_dns_names(agent, pki):
    """security.md: a cluster certificate names --cluster-name in a DNS subject alternative
    name, or in its common name when it has no DNS name (RFC 6125's rule, and what gRPC's
    own hostname check does). A CA that also signs users' certificates could give a user
    CN=meshd-cluster beside DNS:alice: that certificate was taken for a cluster peer on an
    agent's port (and the registry's). One with only the CN (an IP name beside it) is
    still a peer."""
    _leaf(pki, "cn-beside-san", "meshd-cluster", "DNS:alice,IP:127.0.0.1")
    _leaf(pki, "cn-only", "meshd-cluster", "IP:127.0.0.1")
    tls = tuple((pki / n).read_bytes() for n in ("cluster.key", "cluster.pem", "cluster-ca.pem"))
    a = lib.agent_pb2()
    with lib.FakeRegistry(tls=tls) as reg:
        agent(reg.port, *_cluster_flags(pki), wait_registered=False)
        hello = reg.wait()
        secret = reg.metadata()
        for cert, want in (("cn-beside-san", "does not name the cluster"), ("cn-only", None)):
            with _tls_channel(hello.address, pki, cert) as ch:
                call = ch.unary_unary(_AGENT + "Hello", request_serializer=_serialize,
                                      response_deserializer=a.HelloReply.FromString)
                code, details = _status(
                    lambda md: call(a.HelloRequest(agent_id=hello.agent_id), metadata=md,
                                    timeout=5), secret)
                if want is None:
                    assert code == grpc.StatusCode.OK, (cert, code, details)
                else:
                    assert code == grpc.StatusCode.UNAUTHENTICATED and want in details, \
                        (cert, code, details)


def test_cluster_flags_are_checked_at_startup(pki):
    for flags, want in (
            (_cluster_flags(pki)[:4], "--cluster-key"),
            (_cluster_flags(pki), "--cluster-listen"),
            (["--cluster-ca", pki / "cluster-ca.pem", "--cluster-cert", pki / "cluster.key",
              "--cluster-key", pki / "cluster.key", "--cluster-listen", "127.0.0.1:0"],
             "cluster.key"),
            (["--join-token-file", "/nonexistent"], "cannot read '/nonexistent'"),
            (["--max-agents", "2", "--local-agents", "3"], "--max-agents")):
        r = lib.run(lib.MESHD, ["--listen", "127.0.0.1:0"] + [str(f) for f in flags])
        assert r.returncode == 2 and want in r.stderr, (flags, r.stderr[-400:])
    r = lib.run(lib.AGENT, ["--server", "127.0.0.1:1"] + [str(f) for f in _cluster_flags(pki)[:2]])
    assert r.returncode == 2 and "--cluster-cert" in r.stderr, r.stderr[-400:]


def test_the_registry_ports_take_the_operators_connection_bounds(meshd_server, pki, tmp_path):
    """--cluster-listen (anyone may reach it) and the local agents' loopback registry
    port got none of --max-connection-idle and --max-streams-per-connection (nor
    --max-unauthenticated-requests): an idle stranger's connection stayed 10
    minutes and 1024 calls a connection stood whatever the operator set."""
    from test_security import assert_port_takes_the_connection_flags
    bounds = ["--max-connection-idle", 1, "--max-streams-per-connection", 4]
    tf = _token_file(tmp_path, "join", TOKEN)
    cpf = tmp_path / "cluster.port"
    srv = meshd_server(0, "--join-token-file", tf, "--cluster-listen", "127.0.0.1:0",
                       "--cluster-port-file", cpf, *bounds)
    assert_port_takes_the_connection_flags(int(cpf.read_text()), "--cluster-listen")
    # TLS on --listen: the local agents register on a loopback port of their own.
    hport = lib.free_port()
    srv = meshd_server(1, "--tls-cert", pki / "server.pem", "--tls-key", pki / "server.key",
                       "--health-listen", f"127.0.0.1:{hport}", *bounds, wait_serving=False)
    lib.wait_health(hport, lib.TENSOR_SERVICE, lib.SERVING(), timeout=lib.REGISTER_TIMEOUT,
                    proc=srv.proc, log=srv.log)
    _wait_log(srv, "plaintext, loopback only: for the local agents")
    m = re.search(r"port (\d+) \(plaintext, loopback only", srv.log_text())
    assert m, lib.log_tail(srv.log)
    assert_port_takes_the_connection_flags(int(m.group(1)), "the local agents' registry port")
    # Its local agent keeps its registration through it.
    time.sleep(1.5)
    lib.wait_health(hport, lib.TENSOR_SERVICE, lib.SERVING(), timeout=5, proc=srv.proc,
                    log=srv.log)
