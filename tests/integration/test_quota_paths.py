"""Every path that makes tensor bytes is held to the session's quota_bytes, and a drop
(also of a failed tensor: a Load whose file is missing) gives the bytes back, on the
server's count and the agents'."""

import time

import grpc

import meshd_testlib as lib
from meshd_testlib import Session, drop, factory, reduce, to_mesh, sync

SVC = "/meshd.v1.TensorService/"


def _allocated(port):
    return sum(a.allocated_bytes for a in lib.list_agents(port))


def _upload(s, mesh, n):
    t = lib.tensor_pb2()
    hdr = t.UploadHeader(ref=s.new_ref(), mesh=mesh, shape=[n], dtype=lib.dtype("float32"))
    fn = s.ch.stream_unary(SVC + "Upload", request_serializer=lambda m: m.SerializeToString(),
                           response_deserializer=t.UploadReply.FromString)
    return fn(iter([t.UploadChunk(header=hdr), t.UploadChunk(data=b"\0" * (4 * n))]),
              metadata=s.metadata, timeout=20)


def test_quota_over_every_path_and_drops_give_it_back(shared_meshd, tmp_path_factory):
    root = tmp_path_factory.mktemp("quota-load")
    srv = shared_meshd(2, "--url-allow", f"file://{root}")
    Q = 8000
    with Session(srv.port, "quota-paths", quota_bytes=Q, timeout=20) as s:
        m = s.mesh(gpu=2).ref
        base = _allocated(srv.port)
        pb = lib.tensor_pb2()
        # A Load of a missing file: accepted (the agents find out), fails, and its drop
        # gives its 2 x 2000 bytes back.
        ld = s.new_ref()
        s.run(("load", pb.Load(ref=ld, mesh=m, url=f"file://{root}/missing.bin",
                               dtype=lib.dtype("float32"), shape=[500])))
        s.run(sync(), timeout=30)
        s.run(drop(ld))
        assert s.info().bytes_held == 0, s.info()
        # The full quota is usable: 2 x 4000 bytes.
        x = s.tensor(m, (1000,))
        for cmd, name in [(factory(s.new_ref(), m, "zeros", (1,), "float32"), "Factory"),
                          (reduce(s.new_ref(), x.ref, ["gpu"], reduction="stack"), "Reduce"),
                          (to_mesh(s.new_ref(), x.ref, m), "ToMesh"),
                          (("literal", pb.Literal(ref=s.new_ref(), mesh=m, shape=[1],
                                                  dtype=lib.dtype("float32"),
                                                  data=b"\0" * 4)), "Literal")]:
            e = s.fails("QUOTA", cmd, name)
            assert "quota" in e.message, e.message
        try:
            _upload(s, m, 1)
            raise AssertionError("an Upload past the quota was taken")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "quota" in e.details()
        s.run(drop(x.ref))
        s.run(sync(), timeout=30)
        assert s.info().bytes_held == 0, s.info()
        r = _upload(s, m, 1000)  # the full quota again, through an Upload
        s.run(drop(r.tensor.ref))
        s.run(sync(), timeout=30)
        deadline = time.monotonic() + 10
        while _allocated(srv.port) != base and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _allocated(srv.port) == base, _allocated(srv.port) - base
