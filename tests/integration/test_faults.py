"""Faults stay contained (issue 12): one session's stalled instruction never delays
another's, a lost agent fails only the sessions with work on it, at once, and the
pool serves new work as soon as the replacement registers.

Real binaries (`meshd --local-agents N`); stalls come from the agents' fault
injection (MESHD_FAULT, agent/fault.h), losses from SIGKILL of an agent the
server supervises. Every wait is bounded, so a hang fails the test."""

import os
import signal
import threading
import time

import grpc
import numpy as np
import pytest

import meshd_testlib as lib
from meshd_testlib import Session, reduce, sync
from test_compute import FetchError, _agents, data_plane, fetch, pb, upload
from test_metrics import free_ports, parse, sample, scrape

ONES = np.ones(8, dtype=np.float32)


def _fault(spec):
    # --local-agents inherit the server's environment; a short comm timeout
    # bounds the waits of peers of a member that failed on its own.
    return {"MESHD_FAULT": spec, "MESHD_COMM_TIMEOUT_MS": "2000"}


def _sync_in_thread(s, timeout):
    """Starts s's Sync on a thread; returns a dict that gets 'result' or 'error' and 't'."""
    out = {}

    def run():
        try:
            out["result"] = s.run(sync(), timeout=timeout)
        except lib.CommandError as e:
            out["error"] = e
        out["t"] = time.monotonic()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    out["thread"] = th
    return out


def _replaced(s, rank, old_id, timeout=20):
    """Waits until `rank` has a healthy agent other than old_id; returns when it saw it."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        a = _agents(s).get(rank)
        if a and a.agent_id != old_id and a.healthy:
            return time.monotonic()
        time.sleep(0.02)
    pytest.fail(f"rank {rank} was not replaced by a healthy agent within {timeout} s")


def test_a_hung_collective_delays_no_other_session(meshd_server, tmp_path):
    pf = tmp_path / "metrics.port"
    srv = lib.wait_ready(meshd_server(2, "--metrics-listen", "127.0.0.1:0", "--metrics-port-file",
                                      pf, env=_fault("reduce:hang,rank=1,count=1")), 2)
    with Session(srv.port, "stuck") as a, Session(srv.port, "other") as b:
        if not data_plane(a):
            pytest.skip("the agents report no data plane")
        ma = a.mesh(gpu=2).ref
        xa = upload(a, ma, ONES)
        a.run(reduce(a.new_ref(), xa, dims=["gpu"], reduction="sum"))  # hangs on rank 1
        with pytest.raises(lib.CommandError) as e:
            a.run(sync(), timeout=1.0)
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, e.value
        # The hung reduce and the Sync's status request behind it are queued on rank 1.
        mport = lib.read_port_file(str(pf), srv.proc, srv.log)
        assert sample(parse(scrape(mport)), "meshd_queued_instructions") >= 2
        # Session b uses the same two agents, collectives included, meanwhile.
        t0 = time.monotonic()
        mb = b.mesh(gpu=2).ref
        xb = upload(b, mb, np.arange(8, dtype=np.float32))
        r = b.run(reduce(b.new_ref(), xb, dims=["gpu"], reduction="sum")).tensors[0].ref
        for g in (0, 1):
            np.testing.assert_array_equal(fetch(b, r, gpu=g), 2 * np.arange(8, dtype=np.float32))
        assert list(b.run(sync(), timeout=5).errors) == []
        took = time.monotonic() - t0
        assert took < 3, f"another session's hung collective delayed this one by {took:.1f} s"
        # The stuck session is still stuck (its Fetch waits for its own work).
        with pytest.raises(lib.CommandError) as e:
            a.run(sync(), timeout=0.5)
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, e.value


def test_a_lost_agent_fails_only_its_sessions_at_once_and_the_pool_recovers(meshd_server):
    # Rank 0 hangs in session a's collective, so a has work in flight on every
    # rank when rank 2 dies; session b uses ranks 0 and 1 only.
    base = free_ports(3)
    srv = lib.wait_ready(meshd_server(3, "--local-agent-metrics-port-base", base,
                                      env=_fault("reduce:hang,rank=0,count=1")), 3)
    with Session(srv.port, "victim") as a, Session(srv.port, "bystander") as b:
        if not data_plane(a):
            pytest.skip("the agents report no data plane")
        ma = a.mesh(gpu=3).ref
        xa = upload(a, ma, ONES)
        a.run(reduce(a.new_ref(), xa, dims=["gpu"], reduction="sum"))
        mb = b.mesh(gpu=2).ref
        xb = upload(b, mb, np.arange(8, dtype=np.float32))
        assert list(b.run(sync(), timeout=5).errors) == []
        pending = _sync_in_thread(a, timeout=15)
        time.sleep(0.3)
        assert "t" not in pending, f"session a's Sync returned before the loss: {pending}"
        old_id = _agents(a)[2].agent_id
        victim = next(p for p in lib.agent_children(srv.pid) if lib.child_rank(p) == 2)
        t_kill = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        pending["thread"].join(timeout=10)
        assert "t" in pending, "session a's Sync still blocked 10 s after its agent died"
        took = pending["t"] - t_kill
        assert "error" in pending and pending["error"].kind == "AGENT_LOST", pending
        assert "rank 2" in pending["error"].message, pending["error"]
        assert took < 1.0, f"AGENT_LOST took {took:.2f} s"
        # Rank 1, in the collective with the lost rank, aborted it and counted why.
        deadline = time.monotonic() + 5
        while sample(parse(scrape(base + 1)), "meshd_collective_aborts_total",
                     reason="agent_lost") != 1:
            assert time.monotonic() < deadline, "rank 1 counted no agent_lost abort"
            time.sleep(0.05)
        # The bystander saw nothing: no error, right values, collectives still work.
        r = b.run(reduce(b.new_ref(), xb, dims=["gpu"], reduction="sum")).tensors[0].ref
        np.testing.assert_array_equal(fetch(b, r, gpu=1), 2 * np.arange(8, dtype=np.float32))
        assert list(b.run(sync(), timeout=5).errors) == []
        # The victim's session stays usable: its shards on survivors are intact,
        # the broken mesh refuses new work, the next Sync has nothing more to say.
        np.testing.assert_array_equal(fetch(a, xa, gpu=1), ONES)
        with pytest.raises(lib.CommandError) as e:
            a.run(reduce(a.new_ref(), xa, dims=["gpu"], reduction="sum"))
        assert e.value.kind == "AGENT_LOST" and "create a new mesh" in e.value.message, e.value
        with pytest.raises(FetchError) as e:
            fetch(a, xa, gpu=2)
        assert e.value.kind == "AGENT_LOST", e.value
        # The pool recovers: a new session computes on every rank soon after
        # the replacement registers.
        t_reg = _replaced(a, 2, old_id)
        with Session(srv.port, "after") as c:
            mc = c.mesh(gpu=3).ref
            xc = upload(c, mc, np.arange(8, dtype=np.float32))
            rc = c.run(reduce(c.new_ref(), xc, dims=["gpu"], reduction="sum")).tensors[0].ref
            for g in (0, 1, 2):
                np.testing.assert_array_equal(fetch(c, rc, gpu=g),
                                              3 * np.arange(8, dtype=np.float32))
            assert list(c.run(sync(), timeout=5).errors) == []
        ready = time.monotonic() - t_reg
        assert ready < 2.0, f"a new session needed {ready:.2f} s after the replacement registered"
        # And the victim's own new mesh uses the replacement.
        m2 = a.mesh(gpu=3).ref
        y = upload(a, m2, ONES)
        r2 = a.run(reduce(a.new_ref(), y, dims=["gpu"], reduction="sum")).tensors[0].ref
        np.testing.assert_array_equal(fetch(a, r2, gpu=2), 3 * ONES)


@pytest.mark.parametrize("action", ["fail", "slow=300"])
def test_injected_collective_faults_fail_or_delay_only_that_collective(meshd_server, action):
    srv = lib.wait_ready(meshd_server(2, env=_fault(f"reduce:{action},rank=1,count=1")), 2)
    with Session(srv.port, "f") as s:
        if not data_plane(s):
            pytest.skip("the agents report no data plane")
        m = s.mesh(gpu=2).ref
        x = upload(s, m, ONES)
        r1 = s.run(reduce(s.new_ref(), x, dims=["gpu"], reduction="sum")).tensors[0].ref
        r2 = s.run(reduce(s.new_ref(), x, dims=["gpu"], reduction="sum")).tensors[0].ref
        errs = s.run(sync(), timeout=20).errors
        if action == "fail":
            # One root failure, on rank 1; its peer still takes part (as for any
            # failed input), so the next collective on the same comm is unharmed.
            assert len(errs) == 1 and "injected fault" in errs[0].message, errs
            with pytest.raises(FetchError):
                fetch(s, r1, gpu=0)
        else:
            assert list(errs) == []
            np.testing.assert_array_equal(fetch(s, r1, gpu=0), 2 * ONES)
        np.testing.assert_array_equal(fetch(s, r2, gpu=1), 2 * ONES)


def test_a_sync_whose_client_gave_up_holds_nothing(meshd_server):
    # The Sync waits on a hung collective; its clients give up (a unary
    # deadline, a cancelled Submit stream). The server withdraws the unary
    # wait, so the session's lease runs again and the session expires; the
    # Submit stream's pending Sync outlives its stream safely (ASan would see
    # a use after free) and is answered to no one once the hang ends.
    srv = lib.wait_ready(meshd_server(2, "--session-ttl", "2",
                                      env=_fault("reduce:hang,rank=1,count=1")), 2)
    with Session(srv.port, "gives-up", ttl_seconds=2) as a:
        if not data_plane(a):
            pytest.skip("the agents report no data plane")
        m = a.mesh(gpu=2).ref
        x = upload(a, m, ONES)
        a.run(reduce(a.new_ref(), x, dims=["gpu"], reduction="sum"))
        with pytest.raises(lib.CommandError) as e:
            a.run(sync(), timeout=0.5)
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, e.value
        results, code, _ = a.submit([a.command(sync())], timeout=0.5)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and results == [], (code, results)
        # Nothing holds the session now: it expires at its lease.
        end = time.monotonic() + 8
        while time.monotonic() < end and a.info() is not None:
            time.sleep(0.2)
        assert a.info() is None, "a Sync nobody waits for kept the session alive"
    # The server is fine, and a new session works.
    with Session(srv.port, "after") as b:
        mb = b.mesh(gpu=2).ref
        y = upload(b, mb, ONES)
        r = b.run(reduce(b.new_ref(), y, dims=["gpu"], reduction="sum")).tensors[0].ref
        np.testing.assert_array_equal(fetch(b, r, gpu=0), 2 * ONES)
