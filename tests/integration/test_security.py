"""The front door's security (docs/security.md): TLS and mTLS on the client port,
bearer tokens and principals (--auth-tokens), sessions owned by their principal,
the plaintext health port for probes, token reload on SIGHUP. Certificates come
from tests/support/make_certs.sh (the openssl CLI)."""

import os
import signal
import time

import grpc
import numpy as np
import pytest

import meshd_testlib as lib
from meshd_testlib import Session
import test_compute as tc

ALICE = "alice-0123456789abcdef"
BOB = "bob-0123456789abcdefgh"
ROOT = "root-0123456789abcdefg"
_SVC = "/meshd.v1.TensorService/"


def bearer(token):
    return (("authorization", f"Bearer {token}"),)


def read(path):
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("tokens") / "tokens"
    p.write_text(f"alice {ALICE}\nbob {BOB}\n# operators\nroot {ROOT} admin\n")
    return p


def _start(tmp, *flags, n=0, wait=True):
    args = ["--listen", "127.0.0.1:0", "--local-agents", str(n), "--min-agents", "0"]
    args += [str(f) for f in flags]
    p = lib.spawn("meshd", lib.MESHD, args, str(tmp))
    if wait:
        lib.wait_health(p.port, "", lib.SERVING(), proc=p.proc, log=p.log)
    return p


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokens_file):
    """meshd --auth-tokens with 2 local agents, plaintext, at most 3 sessions per principal."""
    tmp = tmp_path_factory.mktemp("secured")
    p = _start(tmp, "--auth-tokens", tokens_file, "--max-sessions-per-principal", 3, n=2)
    deadline = time.monotonic() + lib.REGISTER_TIMEOUT
    t = lib.tensor_pb2()
    while True:
        agents = lib.unary(p.port, _SVC + "ListAgents", t.ListAgentsRequest(), t.ListAgentsReply,
                           metadata=bearer(ALICE)).agents
        if len([a for a in agents if a.healthy]) == 2:
            break
        assert time.monotonic() < deadline, f"agents not ready: {agents}\n{lib.log_tail(p.log)}"
        time.sleep(0.1)
    yield p
    lib.stop(p)
    hit = lib.sanitizer_report(p.log)
    assert not hit, hit


def _raw_call(port, path, md=(), ch=None):
    """Empty request bytes to any method; returns (code, details)."""
    own = ch is None
    ch = ch or lib.channel(port)
    try:
        fn = ch.unary_unary(path, request_serializer=None, response_deserializer=None)
        fn(b"", metadata=md, timeout=5)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details()
    finally:
        if own:
            ch.close()


def _methods():
    t = lib.tensor_pb2()
    svc = t.DESCRIPTOR.services_by_name["TensorService"]
    return [m.name for m in svc.methods]


def test_every_client_method_needs_a_token(server):
    names = _methods()
    assert len(names) >= 9, names
    for name in names:
        code, details = _raw_call(server.port, _SVC + name)
        assert code == grpc.StatusCode.UNAUTHENTICATED, (name, code, details)
        assert "needs a bearer token" in details and name in details, (name, details)


@pytest.mark.parametrize("md", [
    (("authorization", "Bearer " + ALICE + "x"),),
    (("authorization", "Bearer " + ALICE[:-1]),),
    (("authorization", "Bearer " + ALICE.upper()),),
    (("authorization", "Basic " + ALICE),),
    (("authorization", ALICE),),
    (("authorization", "Bearer"),),
], ids=["extended", "truncated", "upper", "basic", "bare", "empty"])
def test_a_wrong_token_is_unauthenticated(server, md):
    code, details = _raw_call(server.port, _SVC + "CreateSession", md)
    assert code == grpc.StatusCode.UNAUTHENTICATED, (code, details)
    assert ALICE not in details and ALICE.upper() not in details


def test_reflection_needs_a_token_like_tensor_service(server):
    # grpcurl -H 'authorization: Bearer TOKEN' HOST:PORT list
    for version in ("v1", "v1alpha"):
        for md, needle in (((), "needs a bearer token"),
                           ((("authorization", "Bearer " + ALICE + "x"),), "not valid")):
            with lib.Reflection(server.port, metadata=md, version=version) as r:
                with pytest.raises(grpc.RpcError) as e:
                    r.list()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (version, e.value)
                assert needle in e.value.details() and "ServerReflection" in e.value.details()
        with lib.Reflection(server.port, metadata=bearer(ALICE), version=version) as r:
            assert "meshd.v1.TensorService" in r.list()
            resp = r.ask(file_containing_symbol="meshd.v1.TensorService.CreateSession")
            assert len(resp.file_descriptor_response.file_descriptor_proto) == 1, resp


def test_health_needs_no_token(server):
    assert lib.health_check(server.port) == lib.SERVING()
    assert lib.health_check(server.port, "meshd.v1.TensorService") == lib.SERVING()


def test_a_principal_computes(server):
    with Session(server.port, "alice-job", auth=bearer(ALICE)) as s:
        m = s.mesh(gpu=2).ref
        x = tc.upload(s, m, np.arange(6, dtype=np.float32).reshape(2, 3), per_rank=False)
        y = s.run(lib.reduce(s.new_ref(), x, dims=["gpu"])).tensors[0].ref
        np.testing.assert_array_equal(tc.fetch(s, y, gpu=1),
                                      2 * np.arange(6, dtype=np.float32).reshape(2, 3))
        s.close()


def _denied(fn):
    try:
        fn()
    except grpc.RpcError as e:
        return e.code(), e.details(), lib.trailer(e.trailing_metadata(), "meshd-error-kind")
    except lib.CommandError as e:
        return e.code, e.message, e.kind
    raise AssertionError("another principal's call was allowed")


def test_another_principal_cannot_use_a_session_even_with_its_token(server):
    t = lib.tensor_pb2()
    with Session(server.port, "alice-private", auth=bearer(ALICE)) as a:
        m = a.mesh(gpu=2).ref
        x = a.tensor(m, (4,), "ones").ref
        stolen = ((lib.SESSION_MD, a.id), (lib.TOKEN_MD, a.token)) + bearer(BOB)
        for name, req, reply in [("KeepAlive", t.KeepAliveRequest(), t.KeepAliveReply),
                                 ("CloseSession", t.CloseSessionRequest(), t.CloseSessionReply),
                                 ("Execute", a.command(lib.describe(x)), t.CommandResult)]:
            code, details, kind = _denied(lambda: lib.unary(server.port, _SVC + name, req, reply,
                                                            metadata=stolen))
            assert code == grpc.StatusCode.PERMISSION_DENIED, (name, code, details)
            assert kind == "PERMISSION_DENIED", (name, kind)
            assert "belongs to another principal" in details and "'bob'" in details, details
        fn = lib.channel(server.port).unary_stream(
            _SVC + "Fetch", request_serializer=lambda r: r.SerializeToString(),
            response_deserializer=t.FetchChunk.FromString)
        code, details, _ = _denied(lambda: list(fn(t.FetchRequest(ref=x), metadata=stolen, timeout=5)))
        assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
        # The owner's session is untouched.
        np.testing.assert_array_equal(tc.fetch(a, x, gpu=0), np.ones(4, np.float32))
        a.close()


def test_list_sessions_shows_a_principal_its_own_and_an_admin_all(server):
    with Session(server.port, "a1", auth=bearer(ALICE)) as a, \
            Session(server.port, "b1", auth=bearer(BOB)) as b:
        t = lib.tensor_pb2()

        def listed(token):
            r = lib.unary(server.port, _SVC + "ListSessions", t.ListSessionsRequest(),
                          t.ListSessionsReply, metadata=bearer(token))
            return {x.session_id: x.owner for x in r.sessions}
        mine = listed(ALICE)
        assert a.id in mine and b.id not in mine and set(mine.values()) == {"alice"}, mine
        assert b.id in listed(BOB) and a.id not in listed(BOB)
        everything = listed(ROOT)
        assert everything.get(a.id) == "alice" and everything.get(b.id) == "bob", everything
        a.close()
        b.close()


def test_a_principal_holds_at_most_its_session_limit(server):
    opened = [Session(server.port, f"many{i}", auth=bearer(BOB)) for i in range(3)]
    try:
        with pytest.raises(grpc.RpcError) as e:
            Session(server.port, "one-too-many", auth=bearer(BOB))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-sessions-per-principal (3)" in e.value.details(), e.value.details()
        with Session(server.port, "alice-still-can", auth=bearer(ALICE)) as a:  # others unaffected
            a.close()
    finally:
        for s in opened:
            s.close()
            s.shut()


def test_tokens_never_reach_the_log(server):
    text = lib.log_tail(server.log, 100000)
    for tok in (ALICE, BOB, ROOT):
        assert tok not in text
    assert "refused /meshd.v1.TensorService/" in text  # the refusals above are logged, by peer


def test_sighup_reloads_the_tokens_file(tmp_path):
    f = tmp_path / "tokens"
    f.write_text(f"alice {ALICE}\nbob {BOB}\n")
    p = _start(tmp_path, "--auth-tokens", f)
    try:
        assert _raw_call(p.port, _SVC + "ListSessions", bearer(BOB))[0] == grpc.StatusCode.OK
        f.write_text(f"alice {ALICE}\ncarol carol-0123456789abcdef\n")  # bob revoked, carol added
        os.kill(p.pid, signal.SIGHUP)
        deadline = time.monotonic() + 5
        while _raw_call(p.port, _SVC + "ListSessions", bearer(BOB))[0] == grpc.StatusCode.OK:
            assert time.monotonic() < deadline, "bob's token still works after SIGHUP"
            time.sleep(0.05)
        assert _raw_call(p.port, _SVC + "ListSessions",
                         bearer("carol-0123456789abcdef"))[0] == grpc.StatusCode.OK
        f.write_text("broken\n")  # a bad file keeps the principals in force
        os.kill(p.pid, signal.SIGHUP)
        time.sleep(0.5)
        assert p.proc.poll() is None, "SIGHUP stopped the server"
        assert _raw_call(p.port, _SVC + "ListSessions", bearer(ALICE))[0] == grpc.StatusCode.OK
        assert "line 1" in lib.log_tail(p.log)
    finally:
        assert lib.stop(p) == 0


def test_an_open_server_says_so_in_one_warning(tmp_path):
    p = _start(tmp_path)
    try:
        lines = [l for l in lib.log_tail(p.log, 1000).splitlines() if "this server is open" in l]
        assert len(lines) == 1 and "WARN" in lines[0], lines
        assert "no TLS" in lines[0] and "no --auth-tokens" in lines[0], lines
    finally:
        lib.stop(p)


def _tls_channel(port, pki, cert=None, key=None, host="localhost"):
    creds = grpc.ssl_channel_credentials(
        root_certificates=read(pki / "ca.pem"),
        private_key=read(key) if key else None,
        certificate_chain=read(cert) if cert else None)
    return grpc.secure_channel(f"{host}:{port}", creds, options=[("grpc.enable_http_proxy", 0)])


def test_tls_port_with_tokens_and_a_plaintext_health_port(tmp_path, pki, tokens_file):
    hport = lib.free_port()
    p = _start(tmp_path, "--tls-cert", pki / "server.pem", "--tls-key", pki / "server.key",
               "--auth-tokens", tokens_file, "--health-listen", f"127.0.0.1:{hport}", wait=False)
    try:
        lib.wait_health(hport, "", lib.SERVING(), proc=p.proc, log=p.log)  # kubelet-style probe
        with _tls_channel(p.port, pki) as ch:
            code, details = _raw_call(p.port, _SVC + "ListSessions", ch=ch)
            assert code == grpc.StatusCode.UNAUTHENTICATED, details
        with Session(p.port, "over-tls", ch=_tls_channel(p.port, pki), auth=bearer(ALICE)) as s:
            assert s.id
            s.close()
        code, _ = _raw_call(p.port, _SVC + "ListSessions", bearer(ALICE))  # plaintext to TLS
        assert code == grpc.StatusCode.UNAVAILABLE
        # The health port serves health only.
        code, details = _raw_call(hport, _SVC + "ListSessions", bearer(ALICE))
        assert code == grpc.StatusCode.UNIMPLEMENTED, (code, details)
        line = [l for l in lib.log_tail(p.log, 1000).splitlines() if "listening on" in l]
        assert line and "(TLS, bearer tokens)" in line[0], line
    finally:
        assert lib.stop(p) == 0


def test_mtls_needs_a_client_certificate_from_the_ca(tmp_path, pki, tokens_file):
    p = _start(tmp_path, "--tls-cert", pki / "server.pem", "--tls-key", pki / "server.key",
               "--tls-client-ca", pki / "ca.pem", "--auth-tokens", tokens_file, wait=False)
    try:
        with _tls_channel(p.port, pki) as ch:  # no client certificate
            code, _ = _raw_call(p.port, _SVC + "ListSessions", bearer(ALICE), ch=ch)
            assert code == grpc.StatusCode.UNAVAILABLE
        with _tls_channel(p.port, pki, pki / "rogue.pem", pki / "rogue.key") as ch:
            code, _ = _raw_call(p.port, _SVC + "ListSessions", bearer(ALICE), ch=ch)
            assert code == grpc.StatusCode.UNAVAILABLE
        with _tls_channel(p.port, pki, pki / "client.pem", pki / "client.key") as ch:
            t = lib.tensor_pb2()
            r = ch.unary_unary(_SVC + "ListSessions", request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=t.ListSessionsReply.FromString)(
                t.ListSessionsRequest(), metadata=bearer(ALICE), timeout=5)
            assert list(r.sessions) == []
    finally:
        assert lib.stop(p) == 0


def test_bad_tls_flags_fail_at_startup_naming_the_file(tmp_path, pki):
    r = lib.run(lib.MESHD, ["--listen", "127.0.0.1:0", "--tls-cert", str(pki / "server.key"),
                            "--tls-key", str(pki / "server.key")])
    assert r.returncode == 2 and "no PEM CERTIFICATE" in r.stderr and "server.key" in r.stderr, r.stderr
    r = lib.run(lib.MESHD, ["--listen", "127.0.0.1:0", "--tls-cert", str(pki / "server.pem")])
    assert r.returncode == 2 and "--tls-cert needs --tls-key" in r.stderr, r.stderr
    r = lib.run(lib.MESHD, ["--listen", "127.0.0.1:0", "--auth-tokens", "/nonexistent"])
    assert r.returncode == 2 and "cannot read '/nonexistent'" in r.stdout + r.stderr


def _rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_a_strangers_health_watches_hold_bounded_memory(tmp_path, tokens_file):
    """Health is open to strangers (no token): a Watch stream stays open as long as
    its client likes, so what one holds must not grow with what the stranger sent.
    A service name as long as --max-message-bytes allows (4 MiB) was kept (strdup'd)
    for the stream's life: 48 streams of one connection held ~100 MiB of the server."""
    p = _start(tmp_path, "--auth-tokens", tokens_file)
    h = lib.health_pb2()
    ch = grpc.insecure_channel(f"127.0.0.1:{p.port}",
                               options=[("grpc.max_send_message_length", 8 << 20)])
    watch = ch.unary_stream("/grpc.health.v1.Health/Watch",
                            request_serializer=h.HealthCheckRequest.SerializeToString,
                            response_deserializer=h.HealthCheckResponse.FromString)
    calls = []
    try:
        before = _rss_mib(p.pid)
        name = "x" * (2 << 20)
        for _ in range(48):
            call = watch(h.HealthCheckRequest(service=name), timeout=60)
            calls.append(call)
            try:  # the first answer (SERVICE_UNKNOWN), or the refusal: the server is done
                next(call)
            except grpc.RpcError as e:
                assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                    grpc.StatusCode.RESOURCE_EXHAUSTED), e
        grown = _rss_mib(p.pid) - before
        assert grown < 40, (f"48 Health/Watch streams of a stranger with 2 MiB service names "
                            f"grew meshd by {grown:.0f} MiB")
        # The probes' own use stays as it was.
        assert lib.health_check(p.port, "") == lib.SERVING()
        w = lib.Watch(p.port, "")
        try:
            assert lib.status_name(w.first()) == "SERVING"
        finally:
            w.close()
    finally:
        for c in calls:
            c.cancel()
        ch.close()
        lib.stop(p)


def test_a_stranger_cannot_open_health_watches_without_end(tmp_path, tokens_file):
    """Each Watch a stranger leaves open holds a call on the server (~13 KiB) for
    as long as the stranger likes, and connections are not bounded: the open
    Watch calls are (RESOURCE_EXHAUSTED past the bound), Check still answers."""
    p = _start(tmp_path, "--auth-tokens", tokens_file)
    h = lib.health_pb2()
    chans, calls = [], []
    try:
        for _ in range(3):
            ch = grpc.insecure_channel(f"127.0.0.1:{p.port}",
                                       options=[("grpc.use_local_subchannel_pool", 1)])
            chans.append(ch)
            watch = ch.unary_stream("/grpc.health.v1.Health/Watch",
                                    request_serializer=h.HealthCheckRequest.SerializeToString,
                                    response_deserializer=h.HealthCheckResponse.FromString)
            calls += [watch(h.HealthCheckRequest(service=""), timeout=60) for _ in range(600)]
        refused = 0
        for c in calls:
            try:
                next(c)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                refused += 1
        assert refused > 0, f"a stranger holds {len(calls)} Health/Watch calls open on meshd"
        assert lib.health_check(p.port, "") == lib.SERVING()
    finally:
        for c in calls:
            c.cancel()
        for ch in chans:
            ch.close()
        lib.stop(p)


def _h2_partial_unary_calls(port, path, streams, body_bytes):
    """A stranger's raw HTTP/2 connection (no token): `streams` calls to the unary
    `path`, each sending `body_bytes` of a message whose length prefix says 4000000,
    never finished. Returns the socket (kept open) and the bytes gRPC accepted."""
    import socket
    import struct

    def frame(typ, flags, sid, payload):
        return struct.pack(">I", len(payload))[1:] + bytes([typ, flags]) + struct.pack(">I", sid) + payload

    def lit(name, value):  # HPACK literal without indexing, new name, no Huffman (< 127 bytes)
        n, v = name.encode(), value.encode()
        return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v

    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, b"") + frame(4, 1, 0, b""))
    hdr = (lit(":method", "POST") + lit(":scheme", "http") + lit(":path", path) +
           lit(":authority", "meshd") + lit("content-type", "application/grpc") + lit("te", "trailers"))
    body = b"\x00" + struct.pack(">I", 4000000) + b"a" * (body_bytes - 5)
    sent = 0
    try:
        for i in range(streams):
            sid = 2 * i + 1
            s.sendall(frame(1, 4, sid, hdr))
            for off in range(0, len(body), 16384):
                s.sendall(frame(0, 0, sid, body[off:off + 16384]))
            sent += len(body)
    except (socket.timeout, OSError):
        pass  # the server stopped taking bytes: what it holds is bounded
    return s, sent


@pytest.mark.xfail(strict=True, reason="unbounded: a stranger's unfinished unary requests "
                   "are buffered by gRPC before any guard runs (see the review report)")
def test_a_stranger_without_a_token_holds_bounded_memory(tmp_path, tokens_file):
    """Every call but health needs a token, but a unary call reaches the guard only
    once its whole request arrived: until then gRPC buffers what the stream window
    admits (--stream-window-bytes, 64 KiB) on each of --max-streams-per-connection
    (1024) streams, on as many connections as the stranger opens. Three connections
    of 1000 unfinished ListSessions calls held ~90-100 MiB of meshd; five, 220-270."""
    p = _start(tmp_path, "--auth-tokens", tokens_file)
    socks = []
    try:
        before = _rss_mib(p.pid)
        accepted = 0
        for _ in range(5):
            s, sent = _h2_partial_unary_calls(p.port, _SVC + "ListSessions", 1000, 60000)
            socks.append(s)
            accepted += sent
        time.sleep(1.0)
        grown = _rss_mib(p.pid) - before
        assert grown < 64, (f"a stranger with no token made meshd hold {grown:.0f} MiB "
                            f"({accepted >> 20} MiB of unfinished requests on 5 connections)")
    finally:
        for s in socks:
            s.close()
        lib.stop(p)
