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


def _start(tmp, *flags, n=0, wait=True, env=None):
    args = ["--listen", "127.0.0.1:0", "--local-agents", str(n), "--min-agents", "0"]
    args += [str(f) for f in flags]
    p = lib.spawn("meshd", lib.MESHD, args, str(tmp), env=env)
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


def test_another_principals_calls_do_not_keep_a_session_alive(server):
    # Bob holds alice's session id and token: his calls are refused, and must
    # leave the session as it was; in particular they must not renew its lease.
    t = lib.tensor_pb2()
    a = Session(server.port, "alice-short", ttl_seconds=1, auth=bearer(ALICE))
    try:
        stolen = ((lib.SESSION_MD, a.id), (lib.TOKEN_MD, a.token)) + bearer(BOB)
        end = time.monotonic() + 3.5  # well past alice's 1 s ttl (expiry runs every 0.5 s)
        while time.monotonic() < end:
            code, details, _ = _denied(lambda: lib.unary(
                server.port, _SVC + "KeepAlive", t.KeepAliveRequest(), t.KeepAliveReply,
                metadata=stolen))
            if code != grpc.StatusCode.PERMISSION_DENIED:
                break  # the session expired: what should happen
            time.sleep(0.2)
        # Alice's own first call since: her session is gone (idle > 1 s for 3.5 s).
        with pytest.raises(grpc.RpcError) as e:
            a.unary("KeepAlive", t.KeepAliveRequest(), t.KeepAliveReply, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
        assert "no session" in e.value.details() or "expired" in e.value.details(), e.value
    finally:
        a.shut()


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


def open_server(shared_meshd):
    """The module's meshd without TLS, --auth-tokens or agents (conftest.py's shared_meshd:
    checked for sanitizer reports at the module's end)."""
    return shared_meshd(0, "--min-agents", "0")


def test_an_open_server_says_so_in_one_warning(shared_meshd):
    p = open_server(shared_meshd)
    lines = [l for l in lib.log_tail(p.log, 1000).splitlines() if "this server is open" in l]
    assert len(lines) == 1 and "WARN" in lines[0], lines
    assert "no TLS" in lines[0] and "no --auth-tokens" in lines[0], lines


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


def test_a_key_that_is_not_the_certificates_fails_at_startup_naming_both(pki):
    """A --tls-key (or --cluster-key, or meshctl's --tls-key) that belongs to another
    certificate: gRPC refused the credentials when the port opened, and the operator read
    "cannot listen on ADDR (address in use, or not a valid address)" (exit 1), or from
    meshctl "nothing listens there" (exit 2). It is a bad flag: exit 2 (64 for meshctl)
    naming both files."""
    cases = (
        (lib.MESHD, ["--listen", "127.0.0.1:0", "--tls-cert", pki / "server.pem",
                     "--tls-key", pki / "client.key"], 2, ("server.pem", "client.key")),
        (lib.MESHD, ["--listen", "127.0.0.1:0", "--cluster-ca", pki / "cluster-ca.pem",
                     "--cluster-cert", pki / "cluster.pem", "--cluster-key", pki / "server.key",
                     "--cluster-listen", "127.0.0.1:0"], 2, ("cluster.pem", "server.key")),
        (lib.AGENT, ["--server", "127.0.0.1:1", "--listen", "127.0.0.1:0",
                     "--cluster-ca", pki / "cluster-ca.pem", "--cluster-cert", pki / "cluster.pem",
                     "--cluster-key", pki / "server.key"], 2, ("cluster.pem", "server.key")),
        (lib.MESHCTL, ["--server", "127.0.0.1:1", "--tls-cert", pki / "client.pem",
                       "--tls-key", pki / "server.key", "health"], 64, ("client.pem", "server.key")))
    for binary, args, rc, files in cases:
        r = lib.run(binary, [str(a) for a in args], timeout=20)
        out = r.stdout + r.stderr
        assert r.returncode == rc and "does not belong to the certificate" in out, (args, out[-600:])
        assert all(f in out for f in files) and "address in use" not in out, (args, out[-600:])


@pytest.mark.plain
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
        before = lib.rss_kib(p.pid) / 1024
        name = "x" * (2 << 20)
        for _ in range(48):
            call = watch(h.HealthCheckRequest(service=name), timeout=60)
            calls.append(call)
            try:  # the first answer (SERVICE_UNKNOWN), or the refusal: the server is done
                next(call)
            except grpc.RpcError as e:
                assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                    grpc.StatusCode.RESOURCE_EXHAUSTED), e
        grown = lib.rss_kib(p.pid) / 1024 - before
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


def test_a_stranger_cannot_open_health_watches_without_end(server):
    """Each Watch a stranger leaves open holds a call on the server (~13 KiB) for
    as long as the stranger likes, and connections are not bounded: the open
    Watch calls are (RESOURCE_EXHAUSTED past the bound), Check still answers.
    On the module's server (its log is checked at the module's end)."""
    p = server
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


def _h2_frame(typ, flags, sid, payload):
    import struct
    return struct.pack(">I", len(payload))[1:] + bytes([typ, flags]) + struct.pack(">I", sid) + payload


def _h2_request_headers(path, extra=()):
    def lit(name, value):  # HPACK literal without indexing, new name, no Huffman (< 127 bytes)
        n, v = name.encode(), value.encode()
        return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v
    return (lit(":method", "POST") + lit(":scheme", "http") + lit(":path", path) +
            lit(":authority", "meshd") + lit("content-type", "application/grpc") + lit("te", "trailers") +
            b"".join(lit(k, v) for k, v in extra))


def _h2_partial_unary_calls(port, path, streams, body_bytes):
    """A stranger's raw HTTP/2 connection (no token): `streams` calls to the unary
    `path`, each sending `body_bytes` of a message whose length prefix says 4000000,
    never finished. Returns the socket (kept open) and the bytes gRPC accepted."""
    import socket
    import struct

    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _h2_frame(4, 0, 0, b"") + _h2_frame(4, 1, 0, b""))
    hdr = _h2_request_headers(path)
    body = b"\x00" + struct.pack(">I", 4000000) + b"a" * (body_bytes - 5)
    sent = 0
    try:
        for i in range(streams):
            sid = 2 * i + 1
            s.sendall(_h2_frame(1, 4, sid, hdr))
            for off in range(0, len(body), 16384):
                s.sendall(_h2_frame(0, 0, sid, body[off:off + 16384]))
            sent += len(body)
    except (socket.timeout, OSError):
        pass  # the server stopped taking bytes: what it holds is bounded
    return s, sent


class _H2Stranger:
    """A raw HTTP/2 client without a token that keeps to flow control, as a careful
    stranger would: gRPC widens a stream's window to a whole message once a read
    waits for it, so one that announces a 4 MB message may send all of it."""

    def __init__(self, port, sock=None):
        """A new connection to port, or (sock) one already open, to read from."""
        import socket
        self.buf = b""
        self.conn_win, self.init_win = 65535, 65535
        self.win = {}
        self.ended = set()  # streams the server answered (END_STREAM) or reset
        self.closed = False
        self.settings = {}  # the server's SETTINGS, by identifier
        self.goaway = False  # the server sent GOAWAY
        self.sock = sock
        if sock is None:
            self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            self.sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _h2_frame(4, 0, 0, b""))
            self.pump(0.5)

    def pump(self, wait):
        """Reads and handles the frames that arrive within `wait` s; False if none."""
        import select
        import struct
        if self.closed or not select.select([self.sock], [], [], wait)[0]:
            return False
        try:
            data = self.sock.recv(1 << 20)
        except OSError:
            data = b""
        if not data:
            self.closed = True
            return False
        self.buf += data
        while len(self.buf) >= 9 and len(self.buf) >= 9 + int.from_bytes(self.buf[:3], "big"):
            n = int.from_bytes(self.buf[:3], "big")
            typ, flags = self.buf[3], self.buf[4]
            sid = struct.unpack(">I", self.buf[5:9])[0] & 0x7FFFFFFF
            payload, self.buf = self.buf[9:9 + n], self.buf[9 + n:]
            if typ == 4 and not flags & 1:  # SETTINGS
                for k in range(0, len(payload), 6):
                    ident, value = struct.unpack(">HI", payload[k:k + 6])
                    self.settings[ident] = value
                    if ident == 4:  # INITIAL_WINDOW_SIZE
                        for st in self.win:
                            self.win[st] += value - self.init_win
                        self.init_win = value
                self.sock.sendall(_h2_frame(4, 1, 0, b""))
            elif typ == 8:  # WINDOW_UPDATE
                inc = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
                if sid == 0:
                    self.conn_win += inc
                elif sid in self.win:
                    self.win[sid] += inc
            elif typ == 3 or (typ == 1 and flags & 1):  # RST_STREAM, or trailers
                self.ended.add(sid)
            elif typ == 6 and not flags & 1:  # PING
                self.sock.sendall(_h2_frame(6, 1, 0, payload))
            elif typ == 7:  # GOAWAY
                self.goaway = True
        return True

    def call(self, sid, path, message_bytes, announced=4000000, extra=()):
        """Opens a call and sends `message_bytes` of a message announced as
        `announced` bytes, as far as flow control lets it within a second.
        Returns the bytes sent."""
        import struct
        self.win[sid] = self.init_win
        self.sock.sendall(_h2_frame(1, 4, sid, _h2_request_headers(path, extra)))
        data = b"\x00" + struct.pack(">I", announced) + b"a" * (message_bytes - 5)
        off, stalled = 0, time.monotonic() + 1.0
        while off < len(data) and not self.closed and sid not in self.ended:
            n = min(16384, len(data) - off, self.win[sid], self.conn_win)
            if n <= 0:
                if not self.pump(0.2) and time.monotonic() > stalled:
                    break  # the server gives no more window: it reads no more of it
                continue
            self.sock.sendall(_h2_frame(0, 0, sid, data[off:off + n]))
            self.win[sid] -= n
            self.conn_win -= n
            off += n
            stalled = time.monotonic() + 1.0
            while self.pump(0):
                pass
        return off

    def close(self):
        self.sock.close()


def _idle_connection_closed(port, within):
    """True once the server sent GOAWAY to (or closed) a connection that opened
    no call, within `within` seconds."""
    st = _H2Stranger(port)
    try:
        deadline = time.monotonic() + within
        while not (st.goaway or st.closed) and time.monotonic() < deadline:
            st.pump(0.2)
        return st.goaway or st.closed
    finally:
        st.close()


def assert_port_takes_the_connection_flags(port, what):
    """A port started with --max-connection-idle 1 and --max-streams-per-connection
    4 announces 4 streams per connection and closes a connection without calls."""
    st = _H2Stranger(port)
    try:
        deadline = time.monotonic() + 5
        while 3 not in st.settings and time.monotonic() < deadline:
            st.pump(0.2)
        assert st.settings.get(3) == 4, (
            f"{what}: SETTINGS_MAX_CONCURRENT_STREAMS {st.settings.get(3)}, not "
            f"--max-streams-per-connection 4")
    finally:
        st.close()
    assert _idle_connection_closed(port, 6), (
        f"{what}: a connection without calls was still open 6 s later "
        f"(--max-connection-idle 1)")


@pytest.mark.plain
def test_a_stranger_without_a_token_holds_bounded_memory(tmp_path, tokens_file):
    """Every call but health needs a token. A unary call used to reach the guard only
    once its whole request arrived: until then gRPC held what the stream window
    admits (--stream-window-bytes, 64 KiB) on each of --max-streams-per-connection
    (1024) streams, on as many connections as the stranger opened (five connections
    of 1000 unfinished ListSessions calls held 215-300 MiB of meshd). Now the guard
    runs at the headers: each call ends (refused UNAUTHENTICATED, or reset by gRPC
    for the data that follows) while its request is unfinished, and meshd keeps a
    fraction of what was sent, gRPC's read buffers of the burst, freed when the
    connections close (35-100 MiB here, 150-170 MiB under the sanitizers)."""
    p = _start(tmp_path, "--auth-tokens", tokens_file)
    socks = []
    try:
        before = lib.rss_kib(p.pid) / 1024
        accepted = 0
        for _ in range(5):
            s, sent = _h2_partial_unary_calls(p.port, _SVC + "ListSessions", 1000, 60000)
            socks.append(s)
            accepted += sent
        time.sleep(1.0)
        grown = lib.rss_kib(p.pid) / 1024 - before
        assert grown < (accepted >> 20) * 3 / 4, (
            f"a stranger with no token made meshd hold {grown:.0f} MiB "
            f"({accepted >> 20} MiB of unfinished requests on 5 connections)")
        # Every call ended though no request was complete (before, gRPC kept
        # those it had not reset waiting for their 4 MB: 0-850 of 1000 ended).
        for s in socks:
            st = _H2Stranger(p.port, sock=s)
            deadline = time.monotonic() + 10
            while len(st.ended) < 1000 and time.monotonic() < deadline:
                st.pump(0.5)
            assert len(st.ended) == 1000, f"{len(st.ended)} of 1000 unfinished calls ended"
    finally:
        for s in socks:
            s.close()
        lib.stop(p)


def _healthy_agents(p):
    """p's agents once one is healthy (bounded by lib.REGISTER_TIMEOUT)."""
    t = lib.tensor_pb2()
    deadline = time.monotonic() + lib.REGISTER_TIMEOUT
    while True:
        agents = lib.unary(p.port, _SVC + "ListAgents", t.ListAgentsRequest(), t.ListAgentsReply,
                           metadata=bearer(ALICE)).agents
        if agents and agents[0].healthy:
            return agents
        assert time.monotonic() < deadline, f"no agent: {agents}\n{lib.log_tail(p.log)}"
        time.sleep(0.1)


def _flood_grows(port, path, pid, socks, conns=60, calls=1000, body=60000):
    """MiB that `conns` connections of `calls` unfinished `body`-byte calls to `path`
    (refused, or never completed) grew process pid by; the sockets stay open in socks.
    0 under the sanitizers, whose shadow memory and quarantine make RSS say little:
    there the flood is 8 connections (what they check is that it is memory-safe, the
    same code at any count; the plain pass runs these tests with the bound, @plain)."""
    sanitized = lib.sanitized(pid)
    if sanitized:
        conns = min(conns, 8)
    before = lib.rss_kib(pid) / 1024
    t0 = time.monotonic()
    for _ in range(conns):
        s, _sent = _h2_partial_unary_calls(port, path, calls, body)
        socks.append(s)
        assert time.monotonic() - t0 < 50, "the flood took too long"
    time.sleep(1.0)
    return 0 if sanitized else lib.rss_kib(pid) / 1024 - before


def _proxy_round_trip(p, name):
    """A token holder still moves 64 MiB through the proxy path, both ways."""
    with Session(p.port, name, auth=bearer(ALICE)) as s:
        m = s.mesh(gpu=1).ref
        big = np.arange(16 << 20, dtype=np.float32)
        x = tc.upload(s, m, big, per_rank=False, chunk=3 << 20)
        np.testing.assert_array_equal(tc.fetch(s, x, gpu=0), big)
        s.close()


@pytest.mark.plain
def test_a_strangers_many_connections_hold_bounded_memory(tmp_path, tokens_file):
    """What a burst of refused calls leaves in gRPC (its read buffers, ~6 MiB a
    connection of 1000 refused calls of 60 KB) stayed until the connection closed,
    and connections are not bounded: 60 such connections grew meshd by 270-400
    MiB, and more connections by more, without end. gRPC's memory quota
    (--rpc-memory-bytes) bounds it: near the quota gRPC reads in small pieces,
    past it it closes connections without calls (70-130 MiB grown here however
    many connections, most of it the allocator's). A token holder still moves
    64 MiB through the proxy path after the flood."""
    p = _start(tmp_path, "--auth-tokens", tokens_file, "--rpc-memory-bytes", "32MiB", n=1)
    _healthy_agents(p)
    socks = []
    try:
        grown = _flood_grows(p.port, _SVC + "ListSessions", p.pid, socks)
        assert grown < 180, (f"60 connections of a stranger's 1000 refused calls each grew "
                             f"meshd by {grown:.0f} MiB")
        assert lib.health_check(p.port, "") == lib.SERVING()
        _proxy_round_trip(p, "after-flood")
    finally:
        for s in socks:
            s.close()
        lib.stop(p)


@pytest.mark.plain
def test_a_strangers_many_connections_to_the_health_port_hold_bounded_memory(tmp_path):
    """The --health-listen port is open to anyone too, and its gRPC server had no
    memory quota: 60 connections of 1000 unfinished 60 KB Check calls each grew
    meshd by ~300 MiB (more connections, more), and ~160 MiB with the quota alone.
    It takes --rpc-memory-bytes as the other ports do, and a connection keeps at
    most 16 calls open (a probe sends one at a time): a few MiB. Probes are still
    answered after the flood."""
    hport = lib.free_port()
    p = _start(tmp_path, "--health-listen", f"127.0.0.1:{hport}", "--rpc-memory-bytes", "32MiB",
               wait=False)
    socks = []
    try:
        lib.wait_health(hport, "", lib.SERVING(), proc=p.proc, log=p.log)
        grown = _flood_grows(hport, "/grpc.health.v1.Health/Check", p.pid, socks)
        assert grown < 60, (f"60 connections of a stranger's 1000 unfinished calls each on "
                            f"the health port grew meshd by {grown:.0f} MiB")
        assert lib.health_check(hport, "") == lib.SERVING()
        assert lib.health_check(p.port, "") == lib.SERVING()
    finally:
        for s in socks:
            s.close()
        lib.stop(p)


@pytest.mark.plain
def test_a_stranger_that_keeps_to_flow_control_is_refused_at_the_headers(tmp_path, tokens_file):
    """A stranger that waits for window updates could send each call's whole
    announced message (up to --max-message-bytes, 4 MiB), and gRPC held it all
    before the guard saw the call: 64 calls of one connection grew meshd by ~250
    MiB (x 1024 streams x connections). Now each call is refused at its headers,
    and no window is given for its request."""
    p = _start(tmp_path, "--auth-tokens", tokens_file)
    st = _H2Stranger(p.port)
    try:
        before = lib.rss_kib(p.pid) / 1024
        sent = sum(st.call(2 * i + 1, _SVC + "ListSessions", 3999000) for i in range(64))
        time.sleep(0.5)
        grown = lib.rss_kib(p.pid) / 1024 - before
        assert grown < 32, (f"a stranger with no token made meshd hold {grown:.0f} MiB "
                            f"({sent >> 20} MiB of unfinished requests on one connection)")
        deadline = time.monotonic() + 10
        while len(st.ended) < 64 and time.monotonic() < deadline:
            st.pump(0.5)
        assert len(st.ended) == 64, f"{len(st.ended)} of 64 unfinished calls answered"
        assert lib.health_check(p.port, "") == lib.SERVING()
    finally:
        st.close()
        lib.stop(p)


@pytest.mark.plain
def test_a_strangers_unfinished_health_requests_are_bounded(tmp_path, tokens_file):
    """Health needs no token, so its requests are read for anyone: the calls whose
    request is still arriving are bounded (--max-unauthenticated-requests, 16 at
    least), the oldest cancelled RESOURCE_EXHAUSTED past it, so a stranger holds at
    most that many messages (here 16 x 1 MiB: 20-30 MiB grown, 40-45 under the
    sanitizers). 100 unfinished Check calls of 1 MiB each grew meshd by ~100 MiB
    before. Probes still get their answer."""
    p = _start(tmp_path, "--auth-tokens", tokens_file, "--max-message-bytes", "1MiB",
               "--max-unauthenticated-requests", 16)
    st = _H2Stranger(p.port)
    try:
        before = lib.rss_kib(p.pid) / 1024
        sent = sum(st.call(2 * i + 1, "/grpc.health.v1.Health/Check", 1000000, announced=1040000)
                   for i in range(100))
        time.sleep(0.5)
        while st.pump(0):
            pass
        grown = lib.rss_kib(p.pid) / 1024 - before
        assert grown < 64, (f"a stranger made meshd hold {grown:.0f} MiB with unfinished Health "
                            f"requests ({sent >> 20} MiB sent on one connection)")
        assert len(st.ended) >= 100 - 16, f"only {len(st.ended)} of 100 unfinished Checks ended"
        assert lib.health_check(p.port, "") == lib.SERVING()
    finally:
        st.close()
        lib.stop(p)


def test_the_health_port_takes_the_operators_connection_bounds(tmp_path):
    """--health-listen is open to anyone like --listen, but its gRPC server got
    none of --max-connection-idle, --max-streams-per-connection and
    --max-unauthenticated-requests: an idle stranger's connection stayed 10
    minutes, and 16 calls a connection and 16 unfinished requests stood whatever
    the operator set. They apply to it too (its streams never above its own 16)."""
    hport = lib.free_port()
    p = _start(tmp_path, "--health-listen", f"127.0.0.1:{hport}", "--max-connection-idle", 1,
               "--max-streams-per-connection", 4, "--max-unauthenticated-requests", 1,
               wait=False)
    strangers = []
    try:
        lib.wait_health(hport, "", lib.SERVING(), proc=p.proc, log=p.log)
        assert_port_takes_the_connection_flags(hport, "--health-listen")
        # --max-unauthenticated-requests 1 is raised to 2 x 4 + 1 (1 rpc-loop
        # thread): 12 unfinished Checks on 3 connections leave at most 9.
        for _ in range(3):
            st = _H2Stranger(hport)
            strangers.append(st)
            for i in range(4):
                st.call(2 * i + 1, "/grpc.health.v1.Health/Check", 1000, announced=4000)
        deadline = time.monotonic() + 5
        while sum(len(st.ended) for st in strangers) < 3 and time.monotonic() < deadline:
            for st in strangers:
                st.pump(0.1)
        ended = sum(len(st.ended) for st in strangers)
        assert ended >= 3, (f"{ended} of 12 unfinished Checks ended: the health port ignored "
                            f"--max-unauthenticated-requests (9 here)")
        assert lib.health_check(hport, "") == lib.SERVING()
    finally:
        for st in strangers:
            st.close()
        lib.stop(p)


def test_an_agents_health_port_takes_its_unauthenticated_bound(agent):
    """meshd-agent's --health-listen ignored its --max-unauthenticated-requests
    (16 unfinished Checks stood whatever was set)."""
    hport = lib.free_port()
    a = agent(lib.free_port(), "--health-listen", f"127.0.0.1:{hport}",
              "--max-unauthenticated-requests", 1, wait_registered=False)
    strangers = []
    try:
        lib.wait_health(hport, "", lib.SERVING(), proc=a.proc, log=a.log)
        for _ in range(3):
            st = _H2Stranger(hport)
            strangers.append(st)
            for i in range(4):
                st.call(2 * i + 1, "/grpc.health.v1.Health/Check", 1000, announced=4000)
        deadline = time.monotonic() + 5
        while sum(len(st.ended) for st in strangers) < 3 and time.monotonic() < deadline:
            for st in strangers:
                st.pump(0.1)
        ended = sum(len(st.ended) for st in strangers)
        assert ended >= 3, f"{ended} of 12 unfinished Checks ended (bound 9 here)"
        assert lib.health_check(hport, "") == lib.SERVING()
    finally:
        for st in strangers:
            st.close()
        lib.stop(a)


@pytest.mark.plain
def test_a_stranger_with_a_forged_grant_is_refused_at_the_headers(tmp_path, tokens_file):
    """An agent's Read takes a transfer grant instead of the call secret, and the
    guard let any grant through for the handler to check against the request: a
    stranger with a forged one could park unfinished Read requests of up to
    --max-message-bytes each in the agent (32 Reads: ~120 MiB). The guard now
    checks the grant's signature before the request is read. What still comes
    in is what the stream window lets through before the refusal arrives (the
    agent's port has gRPC's adaptive window, 4 MiB: 15-30 MiB here)."""
    import base64
    p = _start(tmp_path, "--auth-tokens", tokens_file, n=1)
    deadline = time.monotonic() + lib.REGISTER_TIMEOUT
    t = lib.tensor_pb2()
    while True:
        agents = lib.unary(p.port, _SVC + "ListAgents", t.ListAgentsRequest(), t.ListAgentsReply,
                           metadata=bearer(ALICE)).agents
        if agents and agents[0].healthy:
            break
        assert time.monotonic() < deadline, f"no agent: {agents}\n{lib.log_tail(p.log)}"
        time.sleep(0.1)
    agent_port = int(agents[0].address.rsplit(":", 1)[1])
    children = []
    for task in os.listdir(f"/proc/{p.pid}/task"):
        with open(f"/proc/{p.pid}/task/{task}/children") as f:
            children += [int(c) for c in f.read().split()]
    agent_pid = [c for c in children if b"meshd-agent" in open(f"/proc/{c}/cmdline", "rb").read()][0]
    forged = (("meshd-transfer-grant-bin", base64.b64encode(os.urandom(60)).decode().rstrip("=")),)
    st = _H2Stranger(agent_port)
    try:
        before = lib.rss_kib(agent_pid) / 1024
        sent = sum(st.call(2 * i + 1, "/meshd.agent.v1.Agent/Read", 3999000, extra=forged)
                   for i in range(32))
        time.sleep(0.5)
        grown = lib.rss_kib(agent_pid) / 1024 - before
        # (under the sanitizers 65 MiB was seen on a loaded machine: their shadow
        # and quarantine; the plain pass checks the bound that matters, @plain)
        bound = 96 if lib.sanitized(agent_pid) else 64
        assert grown < bound, (f"a stranger with a forged grant made an agent hold {grown:.0f} "
                               f"MiB ({sent >> 20} MiB of unfinished Read requests)")
        while len(st.ended) < 32 and st.pump(2):
            pass
        assert len(st.ended) == 32, f"{len(st.ended)} of 32 unfinished Reads answered"
    finally:
        st.close()
        lib.stop(p)


@pytest.mark.plain
def test_a_strangers_many_connections_to_an_agent_hold_bounded_memory(tmp_path, tokens_file):
    """An agent's port alike: each connection of 1000 Read calls without the call
    secret (refused at the headers) left gRPC's read buffers in the agent until it
    closed, without bound over connections (60: 220-240 MiB). The server's
    --rpc-memory-bytes goes to its local agents, whose gRPC quota bounds it."""
    p = _start(tmp_path, "--auth-tokens", tokens_file, "--rpc-memory-bytes", "32MiB", n=1)
    agents = _healthy_agents(p)
    agent_port = int(agents[0].address.rsplit(":", 1)[1])
    agent_pid = list(lib.agent_children(p.pid))[0]
    socks = []
    try:
        grown = _flood_grows(agent_port, "/meshd.agent.v1.Agent/Read", agent_pid, socks)
        assert grown < 180, (f"60 connections of a stranger's 1000 refused Reads each grew "
                             f"an agent by {grown:.0f} MiB")
        _proxy_round_trip(p, "after-agent-flood")
    finally:
        for s in socks:
            s.close()
        lib.stop(p)


def _open_submit(s, auth):
    """A bidi Submit of session s under `auth`, kept open: (queue of commands, replies)."""
    import queue
    q = queue.Queue()

    def gen():
        while True:
            c = q.get(timeout=30)  # bounded: grpc cancels the call if the test stalls
            if c is None:
                return
            yield c.SerializeToString()
    fn = s.ch.stream_stream(_SVC + "Submit", request_serializer=lambda b: b,
                            response_deserializer=lib.tensor_pb2().SubmitReply.FromString)
    md = ((lib.SESSION_MD, s.id), (lib.TOKEN_MD, s.token)) + tuple(auth)
    return q, fn(gen(), metadata=md, timeout=30)


def _submit_one(s, q, it):
    q.put(s.command(lib.create_stream(s.new_ref(), f"st{s._ref}")))
    got = lib.answers(next(it))
    assert not got[0].HasField("error"), got
    return got


def _plan_upload(s, mesh, n):
    """A planned direct upload of n float32 onto mesh (raw PlanTransfer)."""
    t = lib.tensor_pb2()
    return s.unary("PlanTransfer", t.PlanTransferRequest(upload=t.UploadHeader(
        ref=s.new_ref(), mesh=mesh.ref, shape=[n], dtype=lib.dtype("float32"),
        total_bytes=4 * n)), t.PlanTransferReply)


def _finish_upload(s, up, receipts=()):
    t = lib.tensor_pb2()
    return s.unary("FinishUpload", t.FinishUploadRequest(transfer_id=up.transfer_id,
                                                         receipts=list(receipts)),
                   t.FinishUploadReply)


def _log_has(log, text, count=1, seconds=10):
    """Waits (bounded) until text is in the log count times; whether it came."""
    deadline = time.monotonic() + seconds
    while lib.log_tail(log, 4000).count(text) < count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_sighup_cuts_off_a_revoked_principals_open_calls_and_planned_transfers(tmp_path):
    """kill -HUP without bob's token: bob's open Submit stream ends UNAUTHENTICATED naming
    the revocation, and the grants of his planned direct fetch and upload are revoked on
    their agents: neither moves a byte (they admitted one Read/Write until their start-by
    time). carol's token changed: her old-token stream ends, her session works with the
    new token, and what she planned under the old one is undone, its grants revoked too
    (it was kept until expiry). Her FinishUpload held across the reload (--server-fault
    finish:slow) does not define its tensor (it did, and its answer was lost). dave's
    token lost its admin flag: his stream ends too (to come back without admin rights).
    alice is untouched. bob's fetch whose FinishFetch waits (for rank 1, MESHD_FAULT
    call:hang) without its Read's receipt at the reload had left the table: the reload
    ended the call, but its snapshot's drop waits in its stream behind a command hung on
    rank 0, and its grant read the snapshot until its expiry; it is revoked too. His grant
    request held for a slot (--session-max-transfers 3) ends UNAUTHENTICATED."""
    from concurrent.futures import ThreadPoolExecutor
    from test_direct import agent_read, agent_write, refused
    carol_old, carol_new = "carol-0123456789abcdef", "carol-fedcba9876543210"
    dave = "dave-00112233445566778899"
    f = tmp_path / "tokens"
    f.write_text(f"alice {ALICE}\nbob {BOB}\ncarol {carol_old}\ndave {dave} admin\n")
    p = _start(tmp_path, "--auth-tokens", f, "--transfer-grant-ms", 60000,
               "--server-fault", "finish:slow=2500,count=1", "--session-max-transfers", 3, n=2,
               env={"MESHD_FAULT": "call:hang,count=1"})  # each agent's first op call
    try:
        deadline = time.monotonic() + lib.REGISTER_TIMEOUT
        t = lib.tensor_pb2()
        while len([a for a in lib.unary(p.port, _SVC + "ListAgents", t.ListAgentsRequest(),
                                        t.ListAgentsReply, metadata=bearer(ALICE)).agents
                   if a.healthy]) < 2:
            assert time.monotonic() < deadline, lib.log_tail(p.log)
            time.sleep(0.1)
        sa = Session(p.port, "a", auth=bearer(ALICE))
        sb = Session(p.port, "b", auth=bearer(BOB))
        sc = Session(p.port, "c", auth=bearer(carol_old))
        sd = Session(p.port, "d", auth=bearer(dave))
        streams = {}
        for name, s, tok in (("a", sa, ALICE), ("b", sb, BOB), ("c", sc, carol_old),
                             ("d", sd, dave)):
            q, it = _open_submit(s, bearer(tok))
            _submit_one(s, q, it)
            streams[name] = (s, q, it)
        m = sb.mesh(gpu=2)
        x = sb.tensor(m.ref, (8,))
        fetch = sb.unary("PlanTransfer", t.PlanTransferRequest(fetch=t.FetchRequest(
            ref=x.ref, coords=[t.Coordinate(dim="gpu", index=0)])), t.PlanTransferReply)
        shard = fetch.shards[0]
        up_b = _plan_upload(sb, m, 4)
        # bob's third: its FinishFetch waits for rank 1, whose first op call hangs, and the
        # snapshot's drop would wait on rank 0 behind the hung op after the plan
        m1 = sb.slice(m.ref, gpu=1)
        sb.op("add", lib.Ref(sb.tensor(m1.ref, (8,)).ref), 1)  # hangs rank 1
        y = sb.tensor(m.ref, (8,))
        unread = sb.unary("PlanTransfer", t.PlanTransferRequest(fetch=t.FetchRequest(
            ref=y.ref, coords=[t.Coordinate(dim="gpu", index=0)])), t.PlanTransferReply)
        sb.op("add", lib.Ref(y.ref), 1)  # hangs rank 0, after the Snapshot
        plan_fn = sb.ch.unary_unary(_SVC + "PlanTransfer",
                                    request_serializer=lambda m: m.SerializeToString(),
                                    response_deserializer=t.PlanTransferReply.FromString)
        grant_req = lambda p: t.PlanTransferRequest(fetch=t.FetchRequest(transfer_id=p.transfer_id))
        finish_fn = sb.ch.unary_unary(_SVC + "FinishFetch",
                                      request_serializer=lambda m: m.SerializeToString(),
                                      response_deserializer=t.FinishFetchReply.FromString)
        fin = finish_fn.future(t.FinishFetchRequest(transfer_id=unread.transfer_id),
                               metadata=sb.metadata, timeout=30)

        def finishing():  # its FinishFetch took it (a grant request then finds nothing)
            try:
                plan_fn(grant_req(unread), metadata=sb.metadata, timeout=5)
            except grpc.RpcError as e:
                assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), e
                return e.code() == grpc.StatusCode.NOT_FOUND
            raise AssertionError("a fetch planned with its grant got another")
        deadline = time.monotonic() + 10
        while not finishing():
            assert time.monotonic() < deadline and not fin.done(), "FinishFetch did not wait"
            time.sleep(0.02)
        # his fourth waits for a slot: of two grant requests one is held, the other refused
        waits = sb.unary("PlanTransfer", t.PlanTransferRequest(fetch=t.FetchRequest(
            ref=x.ref, coords=[t.Coordinate(dim="gpu", index=0)], wait_for_slot=True)),
            t.PlanTransferReply)
        assert waits.slot_pending, waits
        two = [plan_fn.future(grant_req(waits), metadata=sb.metadata, timeout=30) for _ in range(2)]
        deadline = time.monotonic() + 10
        while not any(g.done() for g in two):
            assert time.monotonic() < deadline, "neither grant request was answered"
            time.sleep(0.02)
        held_grant = [g for g in two if not g.done()]
        assert len(held_grant) == 1, [g.exception() for g in two]
        e = [g for g in two if g.done()][0].exception()
        assert e and e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
        assert "waits for a slot already" in e.details(), e.details()
        mc = sc.mesh(gpu=2)
        up_c = _plan_upload(sc, mc, 4)
        # carol's second upload is written, and its FinishUpload held when the reload comes
        up_held = _plan_upload(sc, mc, 4)
        receipts = [t.WriteReceipt(rank=sh.rank, bytes=16, receipt=agent_write(sh, bytes(16)).receipt)
                    for sh in up_held.shards]
        pool = ThreadPoolExecutor(1)
        held = pool.submit(_finish_upload, sc, up_held, receipts)
        assert _log_has(p.log, "FinishUpload: held"), lib.log_tail(p.log)

        f.write_text(f"alice {ALICE}\ncarol {carol_new}\ndave {dave}\n")  # bob revoked, ...
        os.kill(p.pid, signal.SIGHUP)
        assert _log_has(p.log, "SIGHUP: ended"), lib.log_tail(p.log)
        with pytest.raises(grpc.RpcError) as e:
            held.result(timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
        pool.shutdown()
        for call in (fin, held_grant[0]):  # (the rpc layer's end, or the revocation's)
            e = call.exception(timeout=10)
            assert e and e.code() == grpc.StatusCode.UNAUTHENTICATED, e
            assert "revoked at a reload of --auth-tokens" in e.details(), e.details()
        # the agents hear of it on their Execute links: bob's two fetches and upload, carol's
        # two uploads (bounded: the old code never says it; the refusals below then fail)
        _log_has(p.log, "transfer grant(s) revoked by the server", count=8)

        for name in ("b", "c", "d"):
            s, q, it = streams[name]
            with pytest.raises(grpc.RpcError) as e:
                _submit_one(s, q, it)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, e.value)
            assert "revoked at a reload" in e.value.details(), e.value.details()
        s, q, it = streams["a"]  # another principal's stream goes on
        _submit_one(s, q, it)
        q.put(None)
        assert list(it) == [] and it.code() == grpc.StatusCode.OK
        # carol's session, with her new token: unary calls and a new stream
        sc.auth = bearer(carol_new)
        assert not sc.run(lib.create_stream(sc.new_ref(), "after")).HasField("error")
        q, it = _open_submit(sc, bearer(carol_new))
        _submit_one(sc, q, it)
        q.put(None)
        list(it)
        # no grant planned under a revoked token moves a byte
        denied = grpc.StatusCode.PERMISSION_DENIED
        refused(lambda: agent_read(shard, sb.id, x.ref), denied, "revoked")
        refused(lambda: agent_read(unread.shards[0], sb.id, y.ref), denied, "revoked")
        for up in (up_b, up_c):
            for sh in up.shards:
                refused(lambda: agent_write(sh, bytes(16)), denied, "revoked")
        # carol's uploads under her old token are undone: her new token finishes neither
        for up in (up_c, up_held):
            with pytest.raises(grpc.RpcError) as e:
                _finish_upload(sc, up)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value
        for s in (sa, sb, sc, sd):
            s.shut()
    finally:
        assert lib.stop(p) == 0


def _silent_connections(port, n, magic=False):
    """n connections to port that send nothing (or, magic, only the HTTP/2 client
    magic without its SETTINGS): a stranger's half-open handshakes."""
    import socket
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        if magic:
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        s.setblocking(False)
        socks.append(s)
    return socks


def _open_after(socks, within):
    """How many of socks the server has not closed `within` seconds from now."""
    import select
    open_ = set(socks)
    deadline = time.monotonic() + within
    while open_ and time.monotonic() < deadline:
        for s in select.select(list(open_), [], [], 0.2)[0]:
            try:
                while True:
                    if not s.recv(65536):
                        open_.discard(s)
                        break
            except BlockingIOError:
                pass
            except OSError:
                open_.discard(s)
    return len(open_)


def test_a_strangers_silent_connections_are_closed_after_the_handshake_timeout(tmp_path):
    """A connection that never sends its HTTP/2 preface (or only the magic, no
    SETTINGS) was kept for gRPC's default handshake timeout, 120 s, on every gRPC
    port: 2000 such connections held 2000 fds and ~40 MiB (~19 KiB each) of meshd
    or of an agent for two minutes, renewed at will. --handshake-timeout (default
    10 s, passed to local agents) closes them; legitimate calls go on meanwhile."""
    hport = lib.free_port()
    p = _start(tmp_path, "--health-listen", f"127.0.0.1:{hport}", "--handshake-timeout", 1, n=1,
               wait=False)
    socks = []
    try:
        lib.wait_health(p.port, "", lib.SERVING(), proc=p.proc, log=p.log)
        agent_port = int(_healthy_agents(p)[0].address.rsplit(":", 1)[1])
        for port in (p.port, hport, agent_port):
            socks += _silent_connections(port, 20) + _silent_connections(port, 20, magic=True)
        assert lib.health_check(p.port, "") == lib.SERVING()
        assert lib.health_check(hport, "") == lib.SERVING()
        left = _open_after(socks, 6)
        assert left == 0, f"{left} of {len(socks)} silent connections still open 6 s later " \
                          f"(--handshake-timeout 1)"
        assert lib.health_check(p.port, "") == lib.SERVING()
    finally:
        for s in socks:
            s.close()
        lib.stop(p)


def test_a_silent_connection_is_closed_by_default_within_seconds(shared_meshd):
    """Without the flag: 10 s, not gRPC's 120 s."""
    p = open_server(shared_meshd)
    socks = []
    try:
        socks = _silent_connections(p.port, 5)
        left = _open_after(socks, 15)
        assert left == 0, f"{left} of 5 silent connections still open 15 s later"
    finally:
        for s in socks:
            s.close()


def _open_files_soft_limit(pid):
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                soft = line.split()[3]
                return -1 if soft == "unlimited" else int(soft)
    raise AssertionError(f"no 'Max open files' in /proc/{pid}/limits")


def test_daemons_raise_their_open_files_limit_to_the_hard_one(tmp_path):
    """A soft limit of 1,024 open files (many containers' default) let a few hundred
    strangers' connections refuse clients and agents: meshd and its agents raise the
    soft limit to the hard one (at most 2^20) at start."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard if hard != resource.RLIM_INFINITY else 1 << 20, 1 << 20)
    if want <= 256:
        pytest.skip(f"the hard limit ({hard}) leaves nothing to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # inherited by what starts now
    try:
        p = _start(tmp_path, n=1, wait=False)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        lib.wait_ready(p, 1)
        assert _open_files_soft_limit(p.pid) == want
        kids = lib.agent_children(p.pid)
        assert kids, "no local agent"
        for kid in kids:
            assert _open_files_soft_limit(kid) == want, kid
    finally:
        assert lib.stop(p) == 0
