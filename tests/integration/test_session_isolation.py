"""One session's hung instruction on an agent holds nothing of another session's,
and its end frees what it held there (docs/protocol.md "Progress per session").
Stalls come from the agents' fault injection (MESHD_FAULT); every wait is bounded."""

import time

import grpc
import numpy as np
import pytest

import meshd_testlib as lib
from meshd_testlib import Ref, Session, call, factory, sync
from test_compute import fetch, upload


def _allocated(port):
    return {a.rank: a.allocated_bytes for a in lib.list_agents(port)}


def _wait_allocated(port, want, timeout):
    t0 = time.monotonic()
    while _allocated(port) != want and time.monotonic() - t0 < timeout:
        time.sleep(0.05)
    return time.monotonic() - t0


def test_a_hung_call_holds_no_other_session_and_its_close_frees_its_memory(meshd_server):
    env = {"MESHD_FAULT": "call:hang,rank=0,count=1"}
    srv = lib.wait_ready(meshd_server(2, env=env), 2)
    base = _allocated(srv.port)
    a = Session(srv.port, "hung")
    try:
        ma = a.mesh(gpu=2).ref
        big = upload(a, ma, np.ones(1 << 20, np.float32), chunk=1 << 20)  # 4 MiB each rank
        a.run(sync(), timeout=10)
        a.run(call("add", Ref(big), Ref(big), results=[a.new_ref()]))  # hangs on rank 0
        time.sleep(0.3)
        with Session(srv.port, "other") as b:
            mb = b.mesh(gpu=2).ref
            lat = []
            for i in range(30):
                t0 = time.monotonic()
                x = upload(b, mb, np.full(8, i, np.float32))
                y = b.new_ref()
                b.run(call("add", Ref(x), Ref(x), results=[y]))
                assert list(b.run(sync(), timeout=5).errors) == []
                np.testing.assert_array_equal(fetch(b, y, gpu=0), np.full(8, 2 * i, np.float32))
                lat.append(time.monotonic() - t0)
            assert max(lat) < 2, f"session b was held {max(lat):.1f} s by a's hung call"
            with pytest.raises(lib.CommandError) as e:
                a.run(sync(), timeout=0.5)
            assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, e.value
            bbase = _allocated(srv.port)
            assert bbase[0] >= base[0] + (4 << 20)
            a.close()
            a = None
            # a's tensors go, b's stay
            b_bytes = {r: v for r, v in bbase.items()}
            t0 = time.monotonic()
            while time.monotonic() - t0 < 5 and _allocated(srv.port)[0] > base[0] + (1 << 20) + 4096:
                time.sleep(0.05)
            now = _allocated(srv.port)
            assert now[0] < base[0] + (1 << 20), f"closed session's memory kept: {now} vs {base}"
            # b still works after a's hung call ended
            x = upload(b, mb, np.full(8, 3, np.float32))
            np.testing.assert_array_equal(fetch(b, x, gpu=0), np.full(8, 3, np.float32))
            assert list(b.run(sync(), timeout=5).errors) == []
    finally:
        if a is not None:
            a.close()


def test_a_session_expiring_while_its_two_streams_hang_frees_its_memory(meshd_server):
    env = {"MESHD_FAULT": "call:hang,rank=0,count=2"}
    srv = lib.wait_ready(meshd_server(2, "--session-ttl", "2", env=env), 2)
    base = _allocated(srv.port)
    a = Session(srv.port, "expires", ttl_seconds=2)
    ma = a.mesh(gpu=2).ref
    s1 = a.stream("side")
    big = upload(a, ma, np.ones(1 << 20, np.float32), chunk=1 << 20)
    a.run(sync(), timeout=10)
    a.run(call("add", Ref(big), Ref(big), results=[a.new_ref()]))
    side = a.run(factory(a.new_ref(), ma, "ones", (1 << 20,), "float32", stream=s1)).tensors[0].ref
    a.run(call("mul", Ref(side), Ref(side), results=[a.new_ref()], stream=s1))
    time.sleep(0.3)
    assert _allocated(srv.port)[0] >= base[0] + (8 << 20)
    end = time.monotonic() + 10
    while time.monotonic() < end and a.info() is not None:
        time.sleep(0.1)
    assert a.info() is None
    took = _wait_allocated(srv.port, base, 5)
    assert _allocated(srv.port) == base, f"expired session's memory kept after {took:.1f} s"
    time.sleep(0.5)
    assert _allocated(srv.port) == base, "the hung calls' end brought memory back"
    with Session(srv.port, "after") as b:
        mb = b.mesh(gpu=2).ref
        x = upload(b, mb, np.full(8, 3, np.float32))
        np.testing.assert_array_equal(fetch(b, x, gpu=0), np.full(8, 3, np.float32))
