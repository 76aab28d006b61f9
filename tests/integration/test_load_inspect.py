"""InspectUrl's helper calls end with their client's call."""
import atexit
import os
import shutil
import sys
import tempfile
import time

import grpc
import pytest

import meshd_testlib as lib

sys.path.insert(0, os.path.join(lib.SOURCE_DIR, "clients", "python"))
if not os.environ.get("XDG_CACHE_HOME"):
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="meshd-load-cache-")
    atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)
import meshd  # noqa: E402

SVC = "/meshd.v1.TensorService/"


@pytest.fixture
def range_server():
    with lib.range_http_server() as url:
        yield url


def test_cancelled_inspections_give_their_slots_back(shared_meshd, range_server):
    """A client that cancels its InspectUrl (Ctrl-C; no deadline) must not keep the
    server's call to the agent, and so the agent's inspection of a slow URL, running:
    8 such (the agent's limit) refused every later InspectUrl on that rank, of every
    session, for up to 120 s with QUOTA."""
    srv = shared_meshd(1)
    with meshd.connect(f"127.0.0.1:{srv.port}", timeout=30) as s:
        pb = s._pb
        fn = s._ch.unary_unary(SVC + "InspectUrl", request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=pb.InspectUrlReply.FromString)
        slow = f"{range_server}/slow/60000/64"
        calls = [fn.future(pb.InspectUrlRequest(url=slow), metadata=s._md) for _ in range(10)]
        time.sleep(1.5)  # every one reached its agent
        for c in calls:
            c.cancel()
        time.sleep(1.0)  # the cancellations reach the server and the agent
        # a quick inspection now: the cancelled ones hold no slot
        try:
            fn(pb.InspectUrlRequest(url=f"{range_server}/bytes/64"), metadata=s._md, timeout=20)
        except grpc.RpcError as e:
            assert e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
            # /bytes/64 is no tensor file: a BAD_ARGUMENT about its header is the answer
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
