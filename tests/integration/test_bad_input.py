"""Bad input at the protocol level (issue 13, point 9): what a hostile or broken
client can send with nothing but the public protos, method by method.

Every case talks raw grpcio to one server with 2 agents shared by the module:
malformed bytes for each method of TensorService, AgentRegistry and Health,
wrong sizes, huge repeated fields, hostile refs, Upload chunk abuse, unknown
enum values, unset oneofs, empty messages, calls on closed sessions. Each
asserts a clear error: the gRPC code, the meshd-error-kind trailer where meshd
sends one, and words of the message that name the field or value at fault.
After every case the same server and pool compute correctly: an Upload of one
slice per rank, a sum over the mesh and a Fetch from each rank give the exact
values (check_pool).

A Command.seq that goes down or repeats on one Submit stream is refused
(BAD_ARGUMENT): answers are matched by it."""

import importlib
import os
import struct
import subprocess

import grpc
import pytest

import meshd_testlib as lib

TS = "/meshd.v1.TensorService/"
REG = "/meshd.v1.AgentRegistry/RegisterAgent"
HEALTH = "/grpc.health.v1.Health/"
U64 = 2 ** 64 - 1
I63 = 2 ** 63 - 1
TIMEOUT = 10.0
# A length-delimited field 1 whose length runs past the end: no proto decodes it.
JUNK = b"\x0a\xff\xff\xff\xff\x0f" + b"\x01" * 8

def pb():
    return lib.tensor_pb2()


_reg_pb = []


def reg_pb():
    """agent_registry.proto's module, generated next to the testlib's (flat)."""
    if not _reg_pb:
        lib.tensor_pb2()
        api = os.path.join(lib.SOURCE_DIR, "api", "meshd", "v1")
        subprocess.run(["protoc", "--proto_path=" + api, "--python_out=" + lib._gen_dir,
                        os.path.join(api, "agent_registry.proto")], check=True)
        _reg_pb.append(importlib.import_module("agent_registry_pb2"))
    return _reg_pb[0]


def ser(m):
    return m if isinstance(m, bytes) else m.SerializeToString()


# ---------------------------------------------------------------- the module's server


class Ctx:
    """The shared server, a channel, and the pool check."""

    def __init__(self, srv):
        self.srv = srv
        self.port = srv.port
        self.ch = lib.channel(srv.port)
        self.checker = lib.Session(srv.port, "checker", timeout=TIMEOUT)
        self.check_mesh = self.checker.mesh(gpu=2).ref
        self.checks = 0

    def session(self, name="bad"):
        s = lib.Session(self.port, name, timeout=TIMEOUT)
        s.m = s.mesh(gpu=2).ref
        return s

    # -- raw calls: messages or bytes in, (reply or replies) out, RpcError raised

    def unary(self, method, req, md=(), timeout=TIMEOUT):
        fn = self.ch.unary_unary(method, request_serializer=ser, response_deserializer=None)
        return fn(req, metadata=md, timeout=timeout)

    def unary_stream(self, method, req, md=(), timeout=TIMEOUT):
        fn = self.ch.unary_stream(method, request_serializer=ser, response_deserializer=None)
        return list(fn(req, metadata=md, timeout=timeout))

    def stream_unary(self, method, reqs, md=(), timeout=TIMEOUT):
        fn = self.ch.stream_unary(method, request_serializer=ser, response_deserializer=None)
        return fn(iter(list(reqs)), metadata=md, timeout=timeout)

    def stream_stream(self, method, reqs, md=(), timeout=TIMEOUT):
        fn = self.ch.stream_stream(method, request_serializer=ser, response_deserializer=None)
        return list(fn(iter(list(reqs)), metadata=md, timeout=timeout))

    def check_pool(self):
        """Upload [1,2,3,4] to rank 0 and [10,20,30,40] to rank 1, sum over gpu, fetch
        from both ranks: exactly [11,22,33,44]. Then drop what it made."""
        s, t = self.checker, pb()
        ref = s.new_ref()
        raw = struct.pack("<8f", 1, 2, 3, 4, 10, 20, 30, 40)
        hdr = t.UploadHeader(ref=ref, mesh=self.check_mesh, shape=[4],
                             dtype=lib.dtype("float32"), per_rank=True)
        self.stream_unary(TS + "Upload", [t.UploadChunk(header=hdr), t.UploadChunk(data=raw)],
                          s.metadata)
        out = s.new_ref()
        s.run(lib.reduce(out, ref, ("gpu",), "sum"))
        for rank in (0, 1):
            req = t.FetchRequest(ref=out, coords=[t.Coordinate(dim="gpu", index=rank)])
            chunks = [t.FetchChunk.FromString(b)
                      for b in self.unary_stream(TS + "Fetch", req, s.metadata)]
            data = b"".join(c.data for c in chunks if c.WhichOneof("part") == "data")
            got = list(struct.unpack("<4f", data))
            assert got == [11.0, 22.0, 33.0, 44.0], f"rank {rank} after a bad input: {got}"
        s.run(lib.drop(ref, out))
        self.checks += 1


# Registration needs a join token (docs/operations.md "Cluster security"): the server
# and its local agents get this one, so that the registry's cases reach its checks.
JOIN_TOKEN = "bad-input-join-token-0123456789"
JOIN_MD = ((lib.JOIN_TOKEN_MD, JOIN_TOKEN),)


@pytest.fixture(scope="module")
def ctx(shared_meshd, tmp_path_factory):
    tf = tmp_path_factory.mktemp("join") / "token"
    tf.write_text(JOIN_TOKEN + "\n")
    tf.chmod(0o600)
    srv = shared_meshd(2, "--session-quota-bytes", "1GiB", "--join-token-file", tf)
    c = Ctx(srv)
    c.check_pool()
    yield c
    c.checker.shut()
    c.ch.close()


def fails(fn, code, *words, kind=None):
    """Runs fn, which must raise grpc.RpcError with `code` and a message holding
    every one of `words`; with kind, the meshd-error-kind trailer too."""
    try:
        got = fn()
    except grpc.RpcError as e:
        details = e.details() or ""
        assert e.code() == code, f"expected {code}, got {e.code()}: {details!r}"
        for w in words:
            assert w in details, f"the message does not name {w!r}: {details!r}"
        if kind is not None:
            assert lib.trailer(e.trailing_metadata(), lib.KIND_MD) == kind, \
                f"kind {lib.trailer(e.trailing_metadata(), lib.KIND_MD)!r}, expected {kind}: {details!r}"
        return e
    raise AssertionError(f"accepted ({got!r:.200}); expected {code} naming {words}")


def command_fails(ctx, s, field, msg, kind, *words, code=None):
    c = pb().Command(seq=s.next_seq())
    getattr(c, field).CopyFrom(msg)
    return fails(lambda: ctx.unary(TS + "Execute", c, s.metadata), code or lib.KIND_CODES[kind],
                 *words, kind=kind)


INVALID = grpc.StatusCode.INVALID_ARGUMENT
CASES = []


def case(name, *marks):
    def deco(fn):
        CASES.append(pytest.param(fn, id=name, marks=marks))
        return fn
    return deco


# ================================================================ malformed bytes, each method

def _session_md(ctx):
    s = ctx.session("junk")
    return s.metadata


for _m, _desc in (("CreateSession", "CreateSessionRequest"), ("CloseSession", "CloseSessionRequest"),
                  ("KeepAlive", "KeepAliveRequest"), ("ListAgents", "ListAgentsRequest"),
                  ("ListSessions", "ListSessionsRequest"), ("Execute", "Command")):
    def _junk_unary(ctx, m=_m, desc=_desc):
        fails(lambda: ctx.unary(TS + m, JUNK, _session_md(ctx)), INVALID, m, desc)
    case(f"junk-bytes-{_m}")(_junk_unary)


@case("junk-bytes-Submit")
def _(ctx):
    fails(lambda: ctx.stream_stream(TS + "Submit", [JUNK], _session_md(ctx)), INVALID,
          "Submit", "Command")


@case("junk-bytes-Upload")
def _(ctx):
    fails(lambda: ctx.stream_unary(TS + "Upload", [JUNK], _session_md(ctx)), INVALID,
          "Upload", "UploadChunk")


@case("junk-bytes-Fetch")
def _(ctx):
    fails(lambda: ctx.unary_stream(TS + "Fetch", JUNK, _session_md(ctx)), INVALID,
          "Fetch", "FetchRequest")


@case("junk-bytes-RegisterAgent")
def _(ctx):
    fails(lambda: ctx.stream_stream(REG, [JUNK], JOIN_MD), INVALID, "RegisterAgent", "AgentToServer")


@case("junk-bytes-Health-Check")
def _(ctx):
    fails(lambda: ctx.unary(HEALTH + "Check", JUNK), INVALID, "Check", "HealthCheckRequest")


@case("junk-bytes-Health-Watch")
def _(ctx):
    fails(lambda: ctx.unary_stream(HEALTH + "Watch", JUNK), INVALID, "Watch", "HealthCheckRequest")


@case("truncated-Command")
def _(ctx):
    s = ctx.session()
    c = s.command(lib.create_mesh(s.new_ref(), gpu=2)).SerializeToString()
    fails(lambda: ctx.unary(TS + "Execute", c[:-3], s.metadata), INVALID, "Execute", "Command")


@case("junk-after-a-good-command-on-Submit")
def _(ctx):
    s = ctx.session()
    good = s.command(lib.create_stream(s.new_ref(), "side"))
    fn = ctx.ch.stream_stream(TS + "Submit", request_serializer=ser,
                              response_deserializer=pb().SubmitReply.FromString)
    it = fn(iter([good, JUNK]), metadata=s.metadata, timeout=TIMEOUT)
    got = []
    e = fails(lambda: got.extend(it), INVALID, "Submit", "Command")
    got = [a for r in got for a in lib.answers(r)]
    assert [a.seq for a in got] == [good.seq] and not got[0].HasField("error"), (got, e)


@case("unknown-method")
def _(ctx):
    fails(lambda: ctx.unary(TS + "Steal", b""), grpc.StatusCode.UNIMPLEMENTED,
          "/meshd.v1.TensorService/Steal")


@case("message-over-the-limit")
def _(ctx):
    s = ctx.session()
    c = s.command(lib.create_stream(s.new_ref(), "x" * (5 << 20)))
    fails(lambda: ctx.unary(TS + "Execute", c, s.metadata), grpc.StatusCode.RESOURCE_EXHAUSTED,
          "larger than max", str(4 << 20))


# ================================================================ sessions and metadata

@case("no-session-metadata")
def _(ctx):
    c = pb().Command(seq=1, describe=pb().Describe(ref=1))
    fails(lambda: ctx.unary(TS + "Execute", c), grpc.StatusCode.UNAUTHENTICATED,
          "meshd-session", "meshd-token", kind="NO_SESSION")


@case("wrong-token")
def _(ctx):
    s = ctx.session()
    md = ((lib.SESSION_MD, s.id), (lib.TOKEN_MD, "0" * len(s.token)))
    fails(lambda: ctx.unary(TS + "KeepAlive", pb().KeepAliveRequest(), md),
          grpc.StatusCode.UNAUTHENTICATED, "KeepAlive", kind="NO_SESSION")


@case("another-sessions-id-with-own-token")
def _(ctx):
    a, b = ctx.session("a"), ctx.session("b")
    md = ((lib.SESSION_MD, a.id), (lib.TOKEN_MD, b.token))
    fails(lambda: ctx.unary(TS + "Execute", pb().Command(seq=1, describe=pb().Describe(ref=a.m)), md),
          grpc.StatusCode.UNAUTHENTICATED, "Execute", kind="NO_SESSION")


@case("session-id-and-token-3000-chars")
def _(ctx):
    md = ((lib.SESSION_MD, "a" * 3000), (lib.TOKEN_MD, "b" * 3000))
    fails(lambda: ctx.unary(TS + "KeepAlive", pb().KeepAliveRequest(), md),
          grpc.StatusCode.UNAUTHENTICATED, "KeepAlive", kind="NO_SESSION")


@case("metadata-over-grpcs-limit")
def _(ctx):
    # 24 KiB of headers: gRPC itself refuses them (past its 8 KiB default, the
    # server drops the connection), on a connection of the case's own (channels
    # to one target share one unless told not to).
    md = ((lib.SESSION_MD, "a" * 12000), (lib.TOKEN_MD, "b" * 12000))
    with grpc.insecure_channel(f"127.0.0.1:{ctx.port}", options=[
            ("grpc.enable_http_proxy", 0), ("grpc.use_local_subchannel_pool", 1)]) as ch:
        fn = ch.unary_unary(TS + "KeepAlive", request_serializer=ser, response_deserializer=None)
        try:
            fn(pb().KeepAliveRequest(), metadata=md, timeout=TIMEOUT)
            raise AssertionError("24 KiB of metadata was accepted")
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE,
                                grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAUTHENTICATED), e


def _closed(ctx):
    s = ctx.session("closing")
    t = ctx.session("keeper")  # its tensor: a ref the closed session never had
    ctx.unary(TS + "CloseSession", pb().CloseSessionRequest(), s.metadata)
    return s, t


@case("execute-on-a-closed-session")
def _(ctx):
    s, _ = _closed(ctx)
    c = pb().Command(seq=9, create_stream=pb().CreateStream(ref=100, name="late"))
    fails(lambda: ctx.unary(TS + "Execute", c, s.metadata), grpc.StatusCode.UNAUTHENTICATED,
          "Execute", kind="NO_SESSION")


@case("submit-on-a-closed-session")
def _(ctx):
    s, _ = _closed(ctx)
    c = pb().Command(seq=9, create_stream=pb().CreateStream(ref=100, name="late"))
    fails(lambda: ctx.stream_stream(TS + "Submit", [c], s.metadata),
          grpc.StatusCode.UNAUTHENTICATED, "Submit", kind="NO_SESSION")


@case("upload-on-a-closed-session")
def _(ctx):
    s, _ = _closed(ctx)
    hdr = pb().UploadHeader(ref=100, mesh=s.m, shape=[1], dtype=lib.dtype("float32"))
    fails(lambda: ctx.stream_unary(TS + "Upload", [pb().UploadChunk(header=hdr),
                                                   pb().UploadChunk(data=b"\0" * 4)], s.metadata),
          grpc.StatusCode.UNAUTHENTICATED, "Upload", kind="NO_SESSION")


@case("fetch-on-a-closed-session")
def _(ctx):
    s, _ = _closed(ctx)
    fails(lambda: ctx.unary_stream(TS + "Fetch", pb().FetchRequest(ref=s.m), s.metadata),
          grpc.StatusCode.UNAUTHENTICATED, "Fetch", kind="NO_SESSION")


@case("close-a-closed-session")
def _(ctx):
    s, _ = _closed(ctx)
    fails(lambda: ctx.unary(TS + "CloseSession", pb().CloseSessionRequest(), s.metadata),
          grpc.StatusCode.UNAUTHENTICATED, "CloseSession", kind="NO_SESSION")


@case("client-name-1MiB")
def _(ctx):
    fails(lambda: ctx.unary(TS + "CreateSession", pb().CreateSessionRequest(client_name="n" * (1 << 20))),
          INVALID, "client_name", str(1 << 20), kind="BAD_ARGUMENT")


@case("client-name-with-NUL")
def _(ctx):
    # The rpc layer refuses any string field holding a NUL (proto_check), naming it.
    fails(lambda: ctx.unary(TS + "CreateSession", pb().CreateSessionRequest(client_name="a\x00b")),
          INVALID, "client_name", "NUL")


@case("ttl-u64-max")
def _(ctx):
    fails(lambda: ctx.unary(TS + "CreateSession", pb().CreateSessionRequest(ttl_seconds=U64)),
          INVALID, "ttl_seconds", str(U64), kind="BAD_ARGUMENT")


@case("quota-above-the-servers-cap")
def _(ctx):
    # The module's server runs --session-quota-bytes 1GiB.
    fails(lambda: ctx.unary(TS + "CreateSession", pb().CreateSessionRequest(quota_bytes=1 << 40)),
          grpc.StatusCode.RESOURCE_EXHAUSTED, "quota_bytes", str(1 << 40), "--session-quota-bytes",
          kind="QUOTA")


@case("empty-CreateSession-is-accepted")
def _(ctx):
    r = pb().CreateSessionReply.FromString(ctx.unary(TS + "CreateSession", b""))
    assert len(r.session_id) == 32 and len(r.token) == 64 and r.ttl_seconds > 0, r


# ================================================================ commands: empty, unset, unknown

@case("empty-Command")
def _(ctx):
    s = ctx.session()
    fails(lambda: ctx.unary(TS + "Execute", b"", s.metadata), INVALID, "kind", kind="BAD_ARGUMENT")


@case("empty-CreateMesh")
def _(ctx):
    s = ctx.session()
    command_fails(ctx, s, "create_mesh", pb().CreateMesh(), "BAD_ARGUMENT", "CreateMesh", "ref")


@case("arg-oneof-unset")
def _(ctx):
    s = ctx.session()
    x = s.tensor(s.m, (2,)).ref
    c = pb().Call(op="add", args=[pb().Arg(ref=x), pb().Arg()], results=[s.new_ref()])
    command_fails(ctx, s, "call", c, "BAD_ARGUMENT", "add", "argument")


@case("kwarg-without-value")
def _(ctx):
    s = ctx.session()
    x = s.tensor(s.m, (2,)).ref
    c = pb().Call(op="add", args=[pb().Arg(ref=x), pb().Arg(ref=x)],
                  kwargs=[pb().Kwarg(name="alpha")], results=[s.new_ref()])
    command_fails(ctx, s, "call", c, "BAD_ARGUMENT", "alpha")


@case("selector-oneof-unset")
def _(ctx):
    s = ctx.session()
    c = pb().SliceMesh(ref=s.new_ref(), parent=s.m, selectors=[pb().MeshSelector(dim="gpu")])
    command_fails(ctx, s, "slice_mesh", c, "BAD_ARGUMENT", "SliceMesh", "gpu")


@case("factory-dtype-999")
def _(ctx):
    s = ctx.session()
    f = pb().Factory(ref=s.new_ref(), mesh=s.m, kind="zeros", shape=[2], dtype=999)
    command_fails(ctx, s, "factory", f, "BAD_ARGUMENT", "dtype", "999")


@case("factory-unknown-kind")
def _(ctx):
    s = ctx.session()
    f = pb().Factory(ref=s.new_ref(), mesh=s.m, kind="steal", shape=[2], dtype=1)
    command_fails(ctx, s, "factory", f, "BAD_ARGUMENT", "steal")


@case("call-dtype-arg-999")
def _(ctx):
    s = ctx.session()
    x = s.tensor(s.m, (2,)).ref
    c = pb().Call(op="to", args=[pb().Arg(ref=x), pb().Arg(dtype=999)], results=[s.new_ref()])
    command_fails(ctx, s, "call", c, "BAD_ARGUMENT", "999")


@case("reduce-unknown-reduction")
def _(ctx):
    s = ctx.session()
    x = s.tensor(s.m, (2,)).ref
    r = pb().Reduce(ref=s.new_ref(), input=x, reduction="steal")
    command_fails(ctx, s, "reduce", r, "BAD_ARGUMENT", "reduction", "steal")


@case("op-name-with-NUL")
def _(ctx):
    s = ctx.session()
    x = s.tensor(s.m, (2,)).ref
    c = pb().Call(op="add\x00evil", args=[pb().Arg(ref=x), pb().Arg(ref=x)], results=[s.new_ref()])
    fails(lambda: ctx.unary(TS + "Execute", pb().Command(seq=s.next_seq(), call=c), s.metadata),
          INVALID, "call.op", "NUL at byte 3")


@case("stream-name-not-utf8")
def _(ctx):
    s = ctx.session()
    c = pb().Command(seq=s.next_seq(), create_stream=pb().CreateStream(ref=s.new_ref(), name="x"))
    raw = c.SerializeToString().replace(b"\x12\x01x", b"\x12\x01\xff")
    fails(lambda: ctx.unary(TS + "Execute", raw, s.metadata), INVALID, "create_stream.name", "UTF-8")


@case("registration-agent-id-with-NUL")
def _(ctx):
    register_fails(ctx, [_hello(agent_id="rogue\x00agent")], INVALID, "agent_id", "NUL")


@case("op-name-1MiB")
def _(ctx):
    s = ctx.session()
    c = pb().Call(op="o" * (1 << 20), results=[s.new_ref()])
    e = command_fails(ctx, s, "call", c, "UNKNOWN_OP", "Call")
    assert len(e.details()) < 4096, f"the message echoes the whole name: {len(e.details())} chars"


@case("stream-name-1MiB")
def _(ctx):
    s = ctx.session()
    command_fails(ctx, s, "create_stream", pb().CreateStream(ref=s.new_ref(), name="s" * (1 << 20)),
                  "BAD_ARGUMENT", "CreateStream", "name")


# ================================================================ hostile refs

@case("ref-0")
def _(ctx):
    s = ctx.session()
    command_fails(ctx, s, "create_stream", pb().CreateStream(ref=0, name="zero"),
                  "BAD_ARGUMENT", "CreateStream", "ref")


@case("ref-u64-max-unknown")
def _(ctx):
    s = ctx.session()
    command_fails(ctx, s, "describe", pb().Describe(ref=U64), "UNKNOWN_REF", str(U64))


@case("ref-reused")
def _(ctx):
    s = ctx.session()
    command_fails(ctx, s, "create_stream", pb().CreateStream(ref=s.m, name="again"),
                  "REF_REUSED", "CreateStream", str(s.m))


@case("ref-going-backwards")
def _(ctx):
    s = ctx.session()
    s.run(lib.create_stream(50, "fifty"))
    command_fails(ctx, s, "create_stream", pb().CreateStream(ref=40, name="forty"),
                  "REF_REUSED", "CreateStream", "40")


@case("decreasing-refs-in-one-command")
def _(ctx):
    s = ctx.session()
    x = s.tensor(s.m, (4,)).ref
    b = pb().Borrow(ref=x + 20, input=x, stream=s.stream("side") and 0, borrow=x + 10)
    command_fails(ctx, s, "borrow", b, "REF_REUSED", "Borrow", str(x + 10))


@case("decreasing-command-seq")
def _(ctx):
    # Answers carry seq back to match them: one going down is a client bug.
    s = ctx.session()
    fn = ctx.ch.stream_stream(TS + "Submit", request_serializer=ser,
                              response_deserializer=pb().SubmitReply.FromString)
    cmds = [s.command(lib.create_stream(s.new_ref(), "a"), seq=50),
            s.command(lib.create_stream(s.new_ref(), "b"), seq=40)]
    replies = [a for r in fn(iter(cmds), metadata=s.metadata, timeout=TIMEOUT) for a in lib.answers(r)]
    assert replies[1].HasField("error"), f"seq 40 after seq 50 was accepted: {replies}"
    assert lib.kind_name(replies[1].error.kind) == "BAD_ARGUMENT", replies[1]
    assert "seq" in replies[1].error.message, replies[1]


@case("another-sessions-tensor")
def _(ctx):
    a, b = ctx.session("owner"), ctx.session("thief")
    x = a.tensor(a.m, (2,)).ref
    b.skip_to(x + 100)
    command_fails(ctx, b, "describe", pb().Describe(ref=x), "UNKNOWN_REF", str(x))
    c = pb().Call(op="add", args=[pb().Arg(ref=x), pb().Arg(ref=x)], results=[b.new_ref()])
    command_fails(ctx, b, "call", c, "UNKNOWN_REF", str(x))


@case("another-sessions-mesh")
def _(ctx):
    a, b = ctx.session("owner"), ctx.session("thief")
    f = pb().Factory(ref=a.m + 100, mesh=a.m + 1000, kind="zeros", shape=[2], dtype=1)
    b.skip_to(a.m + 100)
    command_fails(ctx, b, "factory", f, "UNKNOWN_REF", str(a.m + 1000))


@case("fetch-another-sessions-tensor")
def _(ctx):
    a, b = ctx.session("owner"), ctx.session("thief")
    x = a.tensor(a.m, (2,), "ones").ref
    req = pb().FetchRequest(ref=x, coords=[pb().Coordinate(dim="gpu", index=0)])
    fails(lambda: ctx.unary_stream(TS + "Fetch", req, b.metadata), grpc.StatusCode.NOT_FOUND,
          "Fetch", str(x), kind="UNKNOWN_REF")


@case("drop-500k-refs")
def _(ctx):
    s = ctx.session()
    d = pb().Drop(refs=list(range(10 ** 9, 10 ** 9 + 500000)))
    command_fails(ctx, s, "drop", d, "QUOTA", "Drop", "500000", "--max-command-refs")


@case("drop-4096-unknown-refs")
def _(ctx):
    s = ctx.session()
    d = pb().Drop(refs=list(range(10 ** 9, 10 ** 9 + 4096)))
    command_fails(ctx, s, "drop", d, "UNKNOWN_REF", "Drop", str(10 ** 9))


@case("release-500k-refs")
def _(ctx):
    s = ctx.session()
    r = pb().Release(refs=list(range(10 ** 9, 10 ** 9 + 500000)))
    command_fails(ctx, s, "release", r, "QUOTA", "Release", "500000", "--max-command-refs")


@case("release-a-mesh-with-a-tensor")
def _(ctx):
    s = ctx.session()
    x = s.tensor(s.m, (2,), "ones").ref
    command_fails(ctx, s, "release", pb().Release(refs=[x, s.m]), "BAD_ARGUMENT", "Release",
                  str(s.m), "mesh")
    live = pb().TensorState.Value("TENSOR_STATE_LIVE")
    assert s.describe(x).tensors[0].state == live  # released nothing: x is still there


# ================================================================ sizes, shapes, repeated fields

@case("mesh-100k-dims")
def _(ctx):
    s = ctx.session()
    m = pb().CreateMesh(ref=s.new_ref(), dims=[pb().Dim(name=f"d{i}", size=1) for i in range(100000)])
    command_fails(ctx, s, "create_mesh", m, "BAD_ARGUMENT", "CreateMesh")


@case("factory-100-dims")
def _(ctx):
    s = ctx.session()
    f = pb().Factory(ref=s.new_ref(), mesh=s.m, kind="zeros", shape=[1] * 100, dtype=1)
    command_fails(ctx, s, "factory", f, "BAD_ARGUMENT", "100")


@case("factory-negative-dim")
def _(ctx):
    s = ctx.session()
    f = pb().Factory(ref=s.new_ref(), mesh=s.m, kind="zeros", shape=[4, -3], dtype=1)
    command_fails(ctx, s, "factory", f, "BAD_ARGUMENT", "-3")


@case("factory-2^40-elements")
def _(ctx):
    s = ctx.session()
    f = pb().Factory(ref=s.new_ref(), mesh=s.m, kind="zeros", shape=[1 << 20, 1 << 20], dtype=6)
    command_fails(ctx, s, "factory", f, "QUOTA", "Factory", str(1 << 40), "--max-tensor-elements")


# ================================================================ loads from URLs

def _load(s, **kw):
    f = dict(ref=s.new_ref(), mesh=s.m, url="http://127.0.0.1:9/x.bin", dtype=1, shape=[4])
    f.update(kw)
    return pb().Load(**f)


for _name, _kw, _kind, _words in (
        ("load-no-dtype", dict(dtype=0), "BAD_ARGUMENT", ("Load", "dtype")),
        ("load-dtype-999", dict(dtype=999), "BAD_ARGUMENT", ("Load", "999")),
        ("load-empty-url", dict(url=""), "BAD_ARGUMENT", ("Load", "url")),
        ("load-9000-char-url", dict(url="http://127.0.0.1/" + "a" * 9000), "BAD_ARGUMENT",
         ("Load", "8192")),
        ("load-negative-dim-size", dict(shape=[4, -3]), "BAD_ARGUMENT", ("-3",)),
        ("load-2^40-elements", dict(shape=[1 << 20, 1 << 20]), "QUOTA", ("--max-tensor-elements",)),
        ("load-offset-overflows", dict(offset=U64), "BAD_ARGUMENT", ("Load", "offset")),
        ("load-past-the-file-end", dict(offset=100, file_size=110), "BAD_ARGUMENT",
         ("Load", "110-byte file")),
        ("load-shard-unknown-mesh-dim", dict(shard="host"), "BAD_DIM", ("Load", "'host'")),
        ("load-shard-dim-out-of-range", dict(shard="gpu", dim=3), "BAD_DIM", ("Load", "dim 3")),
        ("load-uneven-split", dict(shard="gpu", shape=[3]), "BAD_ARGUMENT",
         ("split evenly", "'gpu'")),
        ("load-file-scheme-not-allowed", dict(url="file:///etc/passwd"), "PERMISSION_DENIED",
         ("file",)),
        ("load-cloud-metadata-address", dict(url="http://169.254.169.254/latest/meta-data"),
         "PERMISSION_DENIED", ("169.254.169.254",)),
        ("load-gopher-scheme", dict(url="gopher://127.0.0.1/x"), "PERMISSION_DENIED", ("gopher",)),
        ("load-mesh-never-defined", dict(mesh=U64), "UNKNOWN_REF", ("Load", "mesh"))):
    def _load_case(ctx, kw=_kw, kind=_kind, words=_words):
        s = ctx.session()
        command_fails(ctx, s, "load", _load(s, **kw), kind, *words)
    case(_name)(_load_case)


@case("junk-bytes-InspectUrl")
def _(ctx):
    fails(lambda: ctx.unary(TS + "InspectUrl", JUNK, _session_md(ctx)), INVALID, "InspectUrl",
          "InspectUrlRequest")


@case("inspect-url-not-allowed-and-mesh-not-a-mesh")
def _(ctx):
    s = ctx.session()
    fails(lambda: ctx.unary(TS + "InspectUrl", pb().InspectUrlRequest(url="file:///etc/passwd"),
                            s.metadata), grpc.StatusCode.PERMISSION_DENIED, "file",
          kind="PERMISSION_DENIED")
    fails(lambda: ctx.unary(TS + "InspectUrl", pb().InspectUrlRequest(url="", mesh=s.m),
                            s.metadata), INVALID, "url", kind="BAD_ARGUMENT")
    fails(lambda: ctx.unary(TS + "InspectUrl",
                            pb().InspectUrlRequest(url="http://127.0.0.1:9/x.npy", mesh=U64),
                            s.metadata), grpc.StatusCode.NOT_FOUND, "InspectUrl", "mesh",
          kind="UNKNOWN_REF")


@case("inspect-url-connection-refused-names-the-url")
def _(ctx):
    s = ctx.session()
    e = fails(lambda: ctx.unary(TS + "InspectUrl",
                                pb().InspectUrlRequest(url="http://u:pw@127.0.0.1:9/x.npy?sig=S3CRET",
                                                       mesh=s.m), s.metadata),
              grpc.StatusCode.UNAVAILABLE, "127.0.0.1:9/x.npy", "rank", kind="UNAVAILABLE")
    assert ":pw" not in e.details() and "S3CRET" not in e.details(), e.details()


@case("call-200k-args")
def _(ctx):
    s = ctx.session()
    c = pb().Call(op="add", args=[pb().Arg(i=1)] * 200000, results=[s.new_ref()])
    command_fails(ctx, s, "call", c, "BAD_ARGUMENT", "add")


@case("reduce-100k-dims")
def _(ctx):
    s = ctx.session()
    x = s.tensor(s.m, (2,)).ref
    r = pb().Reduce(ref=s.new_ref(), input=x, dims=[f"d{i}" for i in range(100000)], reduction="sum")
    command_fails(ctx, s, "reduce", r, "BAD_DIM", "Reduce")


@case("slice-step-0")
def _(ctx):
    s = ctx.session()
    sel = pb().MeshSelector(dim="gpu", range=pb().Range(start=0, stop=2, has_stop=True, step=0,
                                                        has_step=True))
    command_fails(ctx, s, "slice_mesh", pb().SliceMesh(ref=s.new_ref(), parent=s.m, selectors=[sel]),
                  "BAD_ARGUMENT", "step")


@case("slice-step-2^63-1")
def _(ctx):
    s = ctx.session()
    sel = pb().MeshSelector(dim="gpu", range=pb().Range(start=0, step=I63))
    command_fails(ctx, s, "slice_mesh", pb().SliceMesh(ref=s.new_ref(), parent=s.m, selectors=[sel]),
                  "BAD_ARGUMENT", "step")


@case("slice-index-2^63-1")
def _(ctx):
    s = ctx.session()
    sel = pb().MeshSelector(dim="gpu", index=I63)
    command_fails(ctx, s, "slice_mesh", pb().SliceMesh(ref=s.new_ref(), parent=s.m, selectors=[sel]),
                  "BAD_ARGUMENT", "SliceMesh", str(I63))


@case("submit-1000-bad-commands-then-a-good-one")
def _(ctx):
    s = ctx.session()
    bad = [pb().Command(seq=i + 1, describe=pb().Describe(ref=U64)) for i in range(1000)]
    good = s.command(lib.create_stream(s.new_ref(), "after"), seq=1001)
    fn = ctx.ch.stream_stream(TS + "Submit", request_serializer=ser,
                              response_deserializer=pb().SubmitReply.FromString)
    replies = [a for r in fn(iter(bad + [good]), metadata=s.metadata, timeout=30) for a in lib.answers(r)]
    errs = [r for r in replies if r.HasField("error")]
    assert len(errs) == 1000 and all(lib.kind_name(e.error.kind) == "UNKNOWN_REF" for e in errs)
    assert [r.seq for r in replies] == list(range(1, 1002)), "one answer per command, in order"
    assert replies[-1].seq == 1001 and not replies[-1].HasField("error"), replies[-1]


# ================================================================ Upload chunk abuse

def _hdr(s, shape=(4,), **kw):
    kw.setdefault("dtype", lib.dtype("float32"))
    return pb().UploadChunk(header=pb().UploadHeader(ref=kw.pop("ref", None) or s.new_ref(),
                                                     mesh=kw.pop("mesh", s.m), shape=list(shape), **kw))


def _data(n):
    return pb().UploadChunk(data=b"\x01" * n)


def upload_fails(ctx, s, chunks, code, *words, kind=None):
    return fails(lambda: ctx.stream_unary(TS + "Upload", chunks, s.metadata), code, *words, kind=kind)


@case("upload-no-messages")
def _(ctx):
    s = ctx.session()
    upload_fails(ctx, s, [], INVALID, "Upload", "header", kind="BAD_ARGUMENT")


@case("upload-data-before-header")
def _(ctx):
    s = ctx.session()
    upload_fails(ctx, s, [_data(16), _hdr(s)], INVALID, "Upload", "before the header",
                 kind="BAD_ARGUMENT")


@case("upload-empty-chunk-first")
def _(ctx):
    s = ctx.session()
    upload_fails(ctx, s, [pb().UploadChunk(), _hdr(s), _data(16)], INVALID, "Upload", "header",
                 kind="BAD_ARGUMENT")


@case("upload-two-headers")
def _(ctx):
    s = ctx.session()
    upload_fails(ctx, s, [_hdr(s), _hdr(s), _data(16)], INVALID, "Upload", "second header",
                 kind="BAD_ARGUMENT")


@case("upload-too-many-bytes")
def _(ctx):
    s = ctx.session()
    upload_fails(ctx, s, [_hdr(s), _data(16), _data(1)], INVALID, "Upload", "16 bytes",
                 kind="BAD_ARGUMENT")


@case("upload-too-few-bytes")
def _(ctx):
    """Its Writes had opened: the ref is spent (a retry under it could meet the undo,
    which runs in stream order), and the error says so."""
    s = ctx.session()
    ref = s.new_ref()
    upload_fails(ctx, s, [_hdr(s, ref=ref), _data(15)], INVALID, "Upload", "15", "16",
                 f"ref {ref} is spent", kind="BAD_ARGUMENT")
    upload_fails(ctx, s, [_hdr(s, ref=ref), _data(16)], INVALID, "Upload", str(ref),
                 "already used", kind="REF_REUSED")


@case("upload-too-many-chunks")
def _(ctx):
    s = ctx.session()
    upload_fails(ctx, s, [_hdr(s)] + [_data(1)] * 17, INVALID, "Upload", "16 bytes",
                 kind="BAD_ARGUMENT")


@case("upload-wrong-total-bytes")
def _(ctx):
    s = ctx.session()
    upload_fails(ctx, s, [_hdr(s, total_bytes=17), _data(16)], INVALID, "total_bytes", "17", "16",
                 kind="BAD_ARGUMENT")


@case("upload-dtype-999")
def _(ctx):
    s = ctx.session()
    upload_fails(ctx, s, [_hdr(s, dtype=999), _data(16)], INVALID, "Upload", "dtype", "999",
                 kind="BAD_ARGUMENT")


@case("upload-negative-dim")
def _(ctx):
    s = ctx.session()
    upload_fails(ctx, s, [_hdr(s, shape=(4, -1)), _data(16)], INVALID, "Upload", "-1",
                 kind="BAD_ARGUMENT")


@case("upload-100-dims")
def _(ctx):
    s = ctx.session()
    upload_fails(ctx, s, [_hdr(s, shape=[1] * 100), _data(4)], INVALID, "Upload", "100",
                 kind="BAD_ARGUMENT")


@case("upload-2^40-elements")
def _(ctx):
    s = ctx.session()
    fails(lambda: ctx.stream_unary(TS + "Upload", [_hdr(s, shape=(1 << 20, 1 << 20)), _data(16)],
                                   s.metadata), grpc.StatusCode.RESOURCE_EXHAUSTED, "Upload",
          str(1 << 40), "--max-tensor-elements", kind="QUOTA")


@case("upload-unknown-mesh")
def _(ctx):
    s = ctx.session()
    upload_fails(ctx, s, [_hdr(s, mesh=U64), _data(16)], grpc.StatusCode.NOT_FOUND, "Upload",
                 "mesh", str(U64), kind="UNKNOWN_REF")


@case("upload-ref-0")
def _(ctx):
    s = ctx.session()
    upload_fails(ctx, s, [pb().UploadChunk(header=pb().UploadHeader(ref=0, mesh=s.m, shape=[4], dtype=1)),
                          _data(16)], INVALID, "Upload", "ref", kind="BAD_ARGUMENT")


@case("upload-ref-reused")
def _(ctx):
    s = ctx.session()
    upload_fails(ctx, s, [_hdr(s, ref=s.m), _data(16)], INVALID, "Upload", str(s.m),
                 kind="REF_REUSED")


@case("upload-onto-a-stream-ref-as-mesh")
def _(ctx):
    s = ctx.session()
    st = s.stream("side")
    upload_fails(ctx, s, [_hdr(s, mesh=st), _data(16)], grpc.StatusCode.NOT_FOUND, "Upload",
                 "mesh", str(st), kind="UNKNOWN_REF")


# ================================================================ Literal abuse

def _lit(s, n=16, shape=(4,), **kw):
    """A Literal of n bytes (float32 [4] needs 16) under a fresh ref."""
    kw.setdefault("dtype", lib.dtype("float32"))
    return "literal", pb().Literal(ref=kw.pop("ref", None) or s.new_ref(), mesh=kw.pop("mesh", s.m),
                                   shape=list(shape), data=b"\x01" * n, **kw)


def literal_fails(ctx, s, lit, kind, *words):
    """A rejected Literal defines nothing: its ref is unknown afterwards, and the
    session's tensors made before it keep their values."""
    keep = s.run(("literal", pb().Literal(ref=s.new_ref(), mesh=s.m, shape=[2],
                                          dtype=lib.dtype("int32"), data=struct.pack("<2i", 7, -7))))
    lit[1].ref = s.new_ref()  # above keep's
    e = s.fails(kind, lit)
    for w in words:
        assert w in e.message, f"the message does not name {w!r}: {e.message!r}"
    s.fails("UNKNOWN_REF", lib.describe(lit[1].ref))
    req = pb().FetchRequest(ref=keep.tensors[0].ref, coords=[pb().Coordinate(dim="gpu", index=1)])
    data = b"".join(pb().FetchChunk.FromString(b).data
                    for b in ctx.unary_stream(TS + "Fetch", req, s.metadata))
    assert struct.unpack("<2i", data) == (7, -7), "a rejected Literal changed a tensor made before it"


@case("literal-too-few-bytes")
def _(ctx):
    s = ctx.session()
    literal_fails(ctx, s, _lit(s, 15), "BAD_ARGUMENT", "Literal", "15", "16")


@case("literal-too-many-bytes")
def _(ctx):
    s = ctx.session()
    literal_fails(ctx, s, _lit(s, 17), "BAD_ARGUMENT", "Literal", "17", "16")


@case("literal-per-rank-one-slice-short")
def _(ctx):
    s = ctx.session()
    literal_fails(ctx, s, _lit(s, 16, per_rank=True), "BAD_ARGUMENT", "Literal", "16", "32",
                  "per rank")


@case("literal-over-1-MiB")
def _(ctx):
    s = ctx.session()
    literal_fails(ctx, s, _lit(s, (1 << 20) + 4, shape=((1 << 18) + 1,)), "BAD_ARGUMENT",
                  "Literal", str((1 << 20) + 4), "Upload")


@case("literal-shape-over-1-MiB-with-no-data")
def _(ctx):
    s = ctx.session()
    literal_fails(ctx, s, _lit(s, 0, shape=(1 << 19,)), "BAD_ARGUMENT", "Literal",
                  str(2 << 20), "Upload")


@case("literal-dtype-999")
def _(ctx):
    s = ctx.session()
    literal_fails(ctx, s, _lit(s, dtype=999), "BAD_ARGUMENT", "Literal", "dtype", "999")


@case("literal-negative-dim")
def _(ctx):
    s = ctx.session()
    literal_fails(ctx, s, _lit(s, shape=(4, -1)), "BAD_ARGUMENT", "Literal", "-1")


@case("literal-no-mesh")
def _(ctx):
    s = ctx.session()
    literal_fails(ctx, s, _lit(s, mesh=0), "BAD_ARGUMENT", "Literal", "mesh")


@case("literal-stream-ref-as-mesh")
def _(ctx):
    s = ctx.session()
    st = s.stream("side")
    literal_fails(ctx, s, _lit(s, mesh=st), "UNKNOWN_REF", "Literal", "mesh", str(st))


@case("literal-unknown-stream")
def _(ctx):
    s = ctx.session()
    literal_fails(ctx, s, _lit(s, stream=U64), "UNKNOWN_REF", "Literal", "stream", str(U64))


@case("literal-ref-reused")
def _(ctx):
    s = ctx.session()
    e = s.fails("REF_REUSED", _lit(s, ref=s.m))
    assert "Literal" in e.message and str(s.m) in e.message, e.message


@case("transfers-over-the-session-limit")
def _(ctx):
    s = ctx.session()
    fn = ctx.ch.stream_unary(TS + "Upload", request_serializer=ser, response_deserializer=None)
    import threading
    gate = threading.Event()

    def held():  # a header, then nothing until the gate opens
        yield _hdr(s)
        gate.wait(TIMEOUT)

    futs = [fn.future(held(), metadata=s.metadata, timeout=TIMEOUT) for _ in range(8)]
    try:
        # The ninth, once the eight are in (their headers answered by nothing yet).
        deadline = __import__("time").monotonic() + 5
        while True:
            try:
                ctx.stream_unary(TS + "Upload", [_hdr(s), _data(16)], s.metadata)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    assert "--session-max-transfers (8)" in e.details(), e.details()
                    assert lib.trailer(e.trailing_metadata(), lib.KIND_MD) == "QUOTA"
                    break
                raise
            assert __import__("time").monotonic() < deadline, "a ninth Upload was accepted"
    finally:
        gate.set()
        for f in futs:
            f.cancel()


# ================================================================ Fetch

def fetch_fails(ctx, s, req, code, *words, kind=None):
    return fails(lambda: ctx.unary_stream(TS + "Fetch", req, s.metadata), code, *words, kind=kind)


def _coord(dim="gpu", index=0):
    return pb().Coordinate(dim=dim, index=index)


@case("fetch-unknown-ref")
def _(ctx):
    s = ctx.session()
    fetch_fails(ctx, s, pb().FetchRequest(ref=U64, coords=[_coord()]), grpc.StatusCode.NOT_FOUND,
                "Fetch", str(U64), kind="UNKNOWN_REF")


@case("fetch-a-mesh")
def _(ctx):
    s = ctx.session()
    fetch_fails(ctx, s, pb().FetchRequest(ref=s.m, coords=[_coord()]), grpc.StatusCode.NOT_FOUND,
                "Fetch", f"ref {s.m}", "mesh, not a tensor", kind="UNKNOWN_REF")


@case("fetch-no-coords")
def _(ctx):
    s = ctx.session()
    x = s.tensor(s.m, (2,)).ref
    fetch_fails(ctx, s, pb().FetchRequest(ref=x), INVALID, "Fetch", "'gpu'", kind="BAD_ARGUMENT")


@case("fetch-coordinate-2^63-1")
def _(ctx):
    s = ctx.session()
    x = s.tensor(s.m, (2,)).ref
    fetch_fails(ctx, s, pb().FetchRequest(ref=x, coords=[_coord(index=I63)]), INVALID, "Fetch",
                str(I63), "'gpu'", kind="BAD_ARGUMENT")


@case("fetch-unknown-dim")
def _(ctx):
    s = ctx.session()
    x = s.tensor(s.m, (2,)).ref
    fetch_fails(ctx, s, pb().FetchRequest(ref=x, coords=[_coord("host")]), INVALID, "Fetch", "'host'",
                kind="BAD_DIM")


@case("fetch-dim-twice")
def _(ctx):
    s = ctx.session()
    x = s.tensor(s.m, (2,)).ref
    fetch_fails(ctx, s, pb().FetchRequest(ref=x, coords=[_coord(), _coord(index=1)]), INVALID,
                "Fetch", "twice", kind="BAD_DIM")


@case("fetch-100k-coords")
def _(ctx):
    s = ctx.session()
    x = s.tensor(s.m, (2,)).ref
    fetch_fails(ctx, s, pb().FetchRequest(ref=x, coords=[_coord(f"d{i}") for i in range(100000)]),
                INVALID, "Fetch", kind="BAD_DIM")


@case("fetch-dropped")
def _(ctx):
    s = ctx.session()
    x = s.tensor(s.m, (2,)).ref
    s.run(lib.drop(x))
    fetch_fails(ctx, s, pb().FetchRequest(ref=x, coords=[_coord()]),
                grpc.StatusCode.FAILED_PRECONDITION, "Fetch", str(x), "dropped", kind="DROPPED")


# ================================================================ AgentRegistry

def register_fails(ctx, msgs, code, *words, md=JOIN_MD):
    return fails(lambda: ctx.stream_stream(REG, msgs, md), code, *words)


def _hello(**kw):
    r = reg_pb()
    base = dict(agent_id="rogue-agent", address="127.0.0.1:1", device="cpu", requested_rank=-1,
                call_secret="a" * 64)
    base.update(kw)
    return r.AgentToServer(hello=r.RegisterRequest(**base))


@case("register-without-the-join-token")
def _(ctx):
    register_fails(ctx, [_hello()], grpc.StatusCode.UNAUTHENTICATED, "join token", md=())


@case("register-no-call-secret")
def _(ctx):
    register_fails(ctx, [_hello(call_secret="")], INVALID, "call_secret")


@case("register-empty-message")
def _(ctx):
    register_fails(ctx, [reg_pb().AgentToServer()], INVALID, "first message", "hello")


@case("register-status-before-hello")
def _(ctx):
    r = reg_pb()
    register_fails(ctx, [r.AgentToServer(status=r.AgentStatus(allocated_bytes=1))], INVALID,
                   "AgentStatus before RegisterRequest")


@case("register-no-agent-id")
def _(ctx):
    register_fails(ctx, [_hello(agent_id="")], INVALID, "agent_id")


@case("register-agent-id-10k")
def _(ctx):
    register_fails(ctx, [_hello(agent_id="a" * 10000)], INVALID, "agent_id", "63")


@case("register-escape-sequences")
def _(ctx):
    for field in ("agent_id", "address", "device"):
        register_fails(ctx, [_hello(**{field: "cpu\x1b[2J\x1b]0;owned\x07"})], INVALID,
                       "printable ASCII")


@case("register-no-address")
def _(ctx):
    register_fails(ctx, [_hello(address="")], INVALID, "address")


@case("register-address-not-host-port")
def _(ctx):
    # The server dials the advertised address back as a gRPC target: without a check a
    # stranger's "unix:/run/x.sock" made it dial a local Unix socket, "dns:///h:1" or
    # "ipv4:10.0.0.1:1" chose a resolver, and a missing or bad port was taken as given.
    for address in ("unix:/tmp/meshd-x.sock", "unix:5", "unix-abstract:x", "dns:///h:1",
                    "ipv4:10.0.0.1:1", "127.0.0.1", "127.0.0.1:", "127.0.0.1:0",
                    "127.0.0.1:70000", "127.0.0.1:http", ":5000", "::1:5000", "[::1:5000",
                    "a b:1", "user@host:1", "host/path:1", "h%2f:1"):
        register_fails(ctx, [_hello(address=address)], INVALID, "address", "host:port")


@case("register-no-device")
def _(ctx):
    register_fails(ctx, [_hello(device="")], INVALID, "device")


@case("register-rank-negative")
def _(ctx):
    register_fails(ctx, [_hello(requested_rank=-7)], INVALID, "requested_rank", "-7")


@case("register-rank-2^31-1")
def _(ctx):
    register_fails(ctx, [_hello(requested_rank=2 ** 31 - 1)], INVALID, "requested_rank",
                   str(2 ** 31 - 1))


@case("register-data-port-70000")
def _(ctx):
    # A port past 65535 was kept and handed to the other agents of every collective as
    # "host:70000": they failed to connect, far from the cause.
    for port in (65536, 70000, 2 ** 32 - 1):
        register_fails(ctx, [_hello(data_port=port)], INVALID, "data_port", str(port))


@case("register-a-live-agents-rank")
def _(ctx):
    register_fails(ctx, [_hello(requested_rank=0)], grpc.StatusCode.FAILED_PRECONDITION,
                   "rank 0", "held")


@case("register-a-live-agents-id")
def _(ctx):
    live = lib.list_agents(ctx.port)[0]
    register_fails(ctx, [_hello(agent_id=live.agent_id)], grpc.StatusCode.FAILED_PRECONDITION,
                   live.agent_id, "already registered")


# ================================================================ Health

@case("health-check-unknown-service")
def _(ctx):
    h = lib.health_pb2()
    fails(lambda: ctx.unary(HEALTH + "Check", h.HealthCheckRequest(service="steal.v1.Nothing")),
          grpc.StatusCode.NOT_FOUND, "steal.v1.Nothing")


@case("health-check-service-1MiB")
def _(ctx):
    h = lib.health_pb2()
    e = fails(lambda: ctx.unary(HEALTH + "Check", h.HealthCheckRequest(service="s" * (1 << 20))),
              grpc.StatusCode.NOT_FOUND)
    assert len(e.details()) < 4096, f"the message echoes the whole name: {len(e.details())} chars"


@case("health-watch-unknown-service")
def _(ctx):
    h = lib.health_pb2()
    fn = ctx.ch.unary_stream(HEALTH + "Watch", request_serializer=ser,
                             response_deserializer=h.HealthCheckResponse.FromString)
    it = fn(h.HealthCheckRequest(service="steal.v1.Nothing"), timeout=TIMEOUT)
    first = next(it)
    it.cancel()
    assert first.status == h.HealthCheckResponse.SERVICE_UNKNOWN, first


# ================================================================ the test

def test_there_are_at_least_50_cases():
    assert len(CASES) >= 50, len(CASES)


@pytest.mark.parametrize("bad", CASES)
def test_bad_input(ctx, bad):
    try:
        bad(ctx)
    finally:
        assert ctx.srv.proc.poll() is None, f"meshd exited with {ctx.srv.proc.returncode}"
        ctx.check_pool()
