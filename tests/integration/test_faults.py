"""Faults stay contained (issue 12): one session's stalled instruction never delays
another's, a lost agent fails only the sessions with work on it, at once, and the
pool serves new work as soon as the replacement registers.

Real binaries (`meshd --local-agents N`); stalls come from the agents' fault
injection (MESHD_FAULT, core/platform/fault.h), losses from SIGKILL of an agent the
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
from test_compute import FetchError, _agents, _kind, data_plane, fetch, pb, upload
from test_metrics import free_ports, parse, sample, scrape

ONES = np.ones(8, dtype=np.float32)
_SVC = "/meshd.v1.TensorService/"
_SVC_UPLOAD = _SVC + "Upload"


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
        # A ToMesh whose sender is the lost rank is refused too, although its
        # receiver (a new mesh on a survivor) is healthy.
        one = a.mesh(host=1).ref
        with pytest.raises(lib.CommandError) as e:
            a.run(lib.to_mesh(a.new_ref(), xa, one, selection={"gpu": 2}))
        assert e.value.kind == "AGENT_LOST" and "2" in e.value.message, e.value
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


def test_a_session_whose_work_all_ran_on_a_lost_agent_syncs_as_before(meshd_server, agent):
    """Session S ran (and synced) its work on an agent that another session's long
    instruction held back; the agent is lost and not replaced. S had no work there left,
    so it is not told, and its next Syncs answer OK: they waited for S's last seq on the
    rank, which the loss counts lost (the agent's own progress was behind it), and failed
    AGENT_LOST until an agent took the rank again."""
    srv = meshd_server(0, min_agents=2, wait_serving=False)
    env = {"MESHD_FAULT": "reduce:slow=30000,rank=0"}
    a0 = agent(srv.port, rank=0, env=env)
    agent(srv.port, rank=1)
    lib.wait_ready(srv, 2)
    with Session(srv.port, "T") as t, Session(srv.port, "S") as s:
        mt = t.mesh(gpu=1)
        x = t.tensor(mt.ref, (8,), kind="ones")
        t.run(sync(), timeout=10)
        t.run(reduce(t.new_ref(), x.ref, ["gpu"]))  # held 30 s on rank 0
        ms = s.mesh(gpu=2)
        y = s.tensor(ms.ref, (8,), kind="ones")
        s.run(lib.drop(y.ref))
        assert not s.run(sync(), timeout=10).errors
        os.kill(a0.pid, signal.SIGKILL)
        lib.wait_agents(srv.port, lambda ag: lib.healthy_ranks(ag) == [1], timeout=15,
                        what="rank 0 gone", log=srv.log)
        for _ in range(2):
            assert not s.run(sync(), timeout=10).errors
        s.tensor(s.slice(ms.ref, gpu=1).ref, (4,))  # on the survivor
        assert not s.run(sync(), timeout=10).errors


def test_a_sync_whose_only_work_on_a_lost_agent_was_its_own_check_does_not_claim_tensors(
        meshd_server, agent):
    """S dropped everything it had on rank 0; its next Sync's StatusRequest is all it has
    there when the agent is lost (stopped, then killed). The Sync fails AGENT_LOST, but
    its message must not say S's tensors on rank 0 are gone: S held none there."""
    srv = meshd_server(0, min_agents=2, wait_serving=False)
    a0 = agent(srv.port, rank=0)
    agent(srv.port, rank=1)
    lib.wait_ready(srv, 2)
    with Session(srv.port, "S") as s:
        ms = s.mesh(gpu=2)
        y = s.tensor(ms.ref, (8,), kind="ones")
        s.run(lib.drop(y.ref))
        assert not s.run(sync(), timeout=10).errors
        os.kill(a0.pid, signal.SIGSTOP)
        try:
            # SIGSTOP takes effect as each thread is next scheduled: on a loaded machine
            # the agent still ran the Sync's check when it was sent at once
            stop_by = time.monotonic() + 5
            while not lib.all_threads_stopped(a0.pid) and time.monotonic() < stop_by:
                time.sleep(0.01)
            assert lib.all_threads_stopped(a0.pid), "rank 0's agent did not stop"
            out = _sync_in_thread(s, timeout=20)
            time.sleep(0.3)
            assert "t" not in out, "the Sync answered while rank 0 was stopped"
        finally:
            os.kill(a0.pid, signal.SIGKILL)
        out["thread"].join(20)
        assert "error" in out or "result" in out, "the Sync did not answer within 20 s"
        errs = out["result"].errors if "result" in out else [out["error"]]
        msgs = " | ".join(getattr(e, "message", str(e)) for e in errs)
        assert errs and "rank 0" in msgs, msgs
        assert "tensors on it are gone" not in msgs, msgs
        assert "held no tensors" in msgs, msgs


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


def test_a_member_late_past_the_comm_timeout_never_mixes_two_reduces(meshd_server):
    """Rank 1 starts the first reduce 1.5 s late, with a 400 ms comm timeout: rank 0 gives
    up on it and runs the next reduces meanwhile. Every result is either failed or the
    exact sum of its own inputs, never a mix of two reduces (before the data plane's
    frames named their call, rank 1's first reduce paired with rank 0's fourth, and the
    two streams stayed shifted, every later result wrong and reported fine); and the
    later reduces, once rank 1 caught up, succeed."""
    env = {"MESHD_FAULT": "reduce:slow=1500,rank=1,count=1", "MESHD_COMM_TIMEOUT_MS": "400"}
    srv = lib.wait_ready(meshd_server(2, env=env), 2)
    with Session(srv.port, "late") as s, Session(srv.port, "bystander") as b:
        if not data_plane(s):
            pytest.skip("the agents report no data plane")
        m = s.mesh(gpu=2).ref
        n = 10
        ins = [np.full((2, 8), [[k + 1.0], [100.0 * (k + 1)]], dtype=np.float32)
               for k in range(n)]
        xs = [upload(s, m, a, per_rank=True) for a in ins]
        rs = [s.run(reduce(s.new_ref(), x, dims=["gpu"], reduction="sum")).tensors[0].ref
              for x in xs]
        # Another session's reduces on the same agents meanwhile: untouched.
        mb = b.mesh(gpu=2).ref
        bx = upload(b, mb, ins[1], per_rank=True)
        brs = [b.run(reduce(b.new_ref(), bx, dims=["gpu"], reduction="sum")).tensors[0].ref
               for _ in range(5)]
        assert list(b.run(sync(), timeout=30).errors) == []
        for r in brs:
            np.testing.assert_array_equal(fetch(b, r, gpu=1), ins[1][0] + ins[1][1])
        s.run(sync(), timeout=30)
        ok = []
        for k, r in enumerate(rs):
            for g in (0, 1):
                try:
                    got = fetch(s, r, gpu=g)
                except FetchError:
                    continue
                np.testing.assert_array_equal(got, ins[k][0] + ins[k][1],
                                              err_msg=f"reduce {k} on rank {g}")
                ok.append((k, g))
        assert (0, 1) not in ok, "the late rank's first reduce succeeded without its peer"
        assert (n - 1, 0) in ok and (n - 1, 1) in ok, f"rank 1 never caught up: {ok}"
        after = upload(s, m, ins[0], per_rank=True)
        r = s.run(reduce(s.new_ref(), after, dims=["gpu"], reduction="sum")).tensors[0].ref
        np.testing.assert_array_equal(fetch(s, r, gpu=1), ins[0][0] + ins[0][1])


def test_closing_a_session_ends_its_collective_waiting_for_a_peer_at_once(meshd_server):
    """Rank 1 hangs before a reduce (30 s comm timeout), so rank 0 waits in the data plane
    for it to connect. CloseSession must end that wait: rank 0 frees the session's tensors
    within seconds (its worker waited out the comm timeout, 30 s, holding them, before
    a dropped channel failed the calls still waiting to connect on it)."""
    env = {"MESHD_FAULT": "reduce:hang,rank=1,count=1", "MESHD_COMM_TIMEOUT_MS": "30000"}
    srv = lib.wait_ready(meshd_server(2, env=env), 2)

    def allocated():
        return {a.rank: a.allocated_bytes for a in lib.list_agents(srv.port)}

    base = allocated()
    s = Session(srv.port, "closing")
    try:
        if not data_plane(s):
            pytest.skip("the agents report no data plane")
        m = s.mesh(gpu=2).ref
        upload(s, m, np.ones(1 << 20, np.float32), chunk=1 << 20)  # 4 MiB on each rank
        x = upload(s, m, ONES)
        s.run(reduce(s.new_ref(), x, dims=["gpu"], reduction="sum"))
        time.sleep(0.5)  # rank 0 waits for rank 1's connection; rank 1 hangs
        assert allocated()[0] >= base[0] + (4 << 20)
    finally:
        s.close()
    t0 = time.monotonic()
    while allocated() != base and time.monotonic() - t0 < 40:
        time.sleep(0.05)
    took = time.monotonic() - t0
    assert allocated() == base, "the agents kept the closed session's tensors"
    assert took < 5, f"the agents freed the closed session's tensors after {took:.1f} s"


def test_a_collective_that_starts_after_its_session_closed_does_not_wait_out_the_timeout(
        meshd_server):
    """Both ranks have a reduce running (asleep before its collective, an injected slow
    step standing for a long staging copy or a cross-stream wait) when CloseSession comes;
    rank 0 first sleeps in a one-member reduce, so it skips the two-rank one, while rank 1
    wakes and joins its data plane call only after the close. That call must fail at once:
    it waited for rank 0 for the whole comm timeout (30 s), its worker holding the closed
    session's tensors."""
    env = {"MESHD_FAULT": "reduce:slow=3000,count=2", "MESHD_COMM_TIMEOUT_MS": "30000"}
    srv = lib.wait_ready(meshd_server(2, env=env), 2)

    def allocated():
        return {a.rank: a.allocated_bytes for a in lib.list_agents(srv.port)}

    base = allocated()
    s = Session(srv.port, "closed-before-join")
    try:
        if not data_plane(s):
            pytest.skip("the agents report no data plane")
        m = s.mesh(gpu=2).ref
        only0 = s.slice(m, gpu=slice(0, 1)).ref
        upload(s, m, np.ones(1 << 20, np.float32), chunk=1 << 20)  # 4 MiB on each rank
        x = upload(s, m, ONES)
        x0 = upload(s, only0, ONES)
        s.run(reduce(s.new_ref(), x0, dims=["gpu"], reduction="sum"))  # rank 0 sleeps 3 s
        s.run(reduce(s.new_ref(), x, dims=["gpu"], reduction="sum"))  # rank 1 sleeps 3 s
        time.sleep(0.5)
        assert allocated()[1] >= base[1] + (4 << 20)
    finally:
        s.close()
    t0 = time.monotonic()
    while allocated() != base and time.monotonic() - t0 < 45:
        time.sleep(0.05)
    took = time.monotonic() - t0
    assert allocated() == base, "the agents kept the closed session's tensors"
    # The sleeps end 2.5 s after the close; then the late call must fail at once.
    assert took < 8, f"the agents freed the closed session's tensors after {took:.1f} s"


def test_a_recv_whose_sender_is_lost_just_before_it_joins_fails_at_once(meshd_server):
    """Rank 1, the receiver of a ToMesh from rank 0, has checked its peer and is still
    getting ready for the transfer (an injected slow step standing for the result's
    allocation) when rank 0 is killed and the server tells rank 1 so. The recv that
    starts next must fail AGENT_LOST at once, as a collective does (it passes the
    generation it read before its check to the data plane): it waited for the dead
    sender's connection for the whole comm timeout (30 s), holding rank 1's stream."""
    env = {"MESHD_FAULT": "send:slow=2000,rank=1,count=1", "MESHD_COMM_TIMEOUT_MS": "30000"}
    srv = lib.wait_ready(meshd_server(2, env=env), 2)
    with Session(srv.port, "lost-before-recv", timeout=60) as s:
        if not data_plane(s):
            pytest.skip("the agents report no data plane")
        m = s.mesh(gpu=2).ref
        src = s.slice(m, gpu=slice(0, 1)).ref
        dst = s.slice(m, gpu=slice(1, 2)).ref
        x = upload(s, src, ONES)
        s.run(lib.to_mesh(s.new_ref(), x, dst))  # rank 1 sleeps 2 s, then receives
        time.sleep(0.3)
        victim = next(p for p in lib.agent_children(srv.pid) if lib.child_rank(p) == 0)
        t_kill = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        # Later work on rank 1's stream waits for the recv to end.
        after = upload(s, dst, np.arange(8, dtype=np.float32))
        np.testing.assert_array_equal(fetch(s, after, gpu=0), np.arange(8, dtype=np.float32))
        took = time.monotonic() - t_kill
        assert took < 8, f"rank 1's stream was held {took:.1f} s by a recv from a lost sender"


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


def test_an_agent_killed_mid_transfer_ends_its_transfers_and_spares_the_others(meshd_server):
    """Rank 2 is SIGKILLed while the server relays, for session a, an Upload to ranks
    0-2 and a Fetch from rank 2, both stopped halfway by their clients, and while
    session b's Upload to ranks 0-1 is halfway too. a's Upload and Fetch end with
    errors naming rank 2 within seconds (not at their 60 s deadlines); the survivors let
    go of a's partial tensor and its ref stays undefined; b's Upload finishes with its
    bytes; then a's next Upload on a new mesh lands on the replacement."""
    srv = lib.wait_ready(meshd_server(3, "--agent-timeout", 3), 3)
    t = lib.tensor_pb2()
    half = threading.Event()  # set by each transfer once it is halfway
    go = threading.Event()    # the kill happened: the clients go on
    chunk_a, chunk_b = b"\x03" * (1 << 20), b"\x05" * (1 << 20)
    each = 16 << 20           # per rank: more than the sockets and windows buffer

    def upload_stream(s, mesh, ref, nranks, chunk, out, key):
        fn = s.ch.stream_unary(_SVC_UPLOAD, request_serializer=lambda x: x.SerializeToString(),
                               response_deserializer=t.UploadReply.FromString)

        def chunks():
            yield t.UploadChunk(header=t.UploadHeader(ref=ref, mesh=mesh, shape=[each // 4],
                                                      dtype=lib.dtype("float32"), per_rank=True))
            total = nranks * each // len(chunk)
            for i in range(total):
                if i == total // 2:
                    out[key + "_half"] = True
                    half.set()
                    go.wait(30)
                yield t.UploadChunk(data=chunk)
        t0 = time.monotonic()
        try:
            out[key] = fn(chunks(), metadata=s.metadata, timeout=60)
        except grpc.RpcError as e:
            out[key] = e
        out[key + "_t"] = time.monotonic() - t0

    with Session(srv.port, "victim", timeout=60) as a, Session(srv.port, "bystander",
                                                               timeout=60) as b:
        ma, mb = a.mesh(gpu=3).ref, b.mesh(gpu=2).ref
        assert {x.rank for x in _agents(a).values()} == {0, 1, 2}
        big = a.run(lib.factory(a.new_ref(), ma, "full", (each // 4,), value=7.0)).tensors[0].ref
        assert list(a.run(sync(), timeout=30).errors) == []
        base = {r: ag.allocated_bytes for r, ag in _agents(a).items()}
        out = {}
        up_ref = a.new_ref()
        threads = [
            threading.Thread(target=upload_stream, args=(a, ma, up_ref, 3, chunk_a, out, "a")),
            threading.Thread(target=upload_stream, args=(b, mb, b.new_ref(), 2, chunk_b, out, "b")),
        ]
        # a's Fetch from rank 2 reads one chunk, then stops reading until the kill.
        fetch_fn = a.ch.unary_stream(_SVC + "Fetch",
                                     request_serializer=lambda x: x.SerializeToString(),
                                     response_deserializer=t.FetchChunk.FromString)

        def fetch_rank2():
            t0 = time.monotonic()
            got = 0
            try:
                for c in fetch_fn(t.FetchRequest(ref=big, coords=[t.Coordinate(dim="gpu", index=2)]),
                                  metadata=a.metadata, timeout=60):
                    got += len(c.data)
                    if got and not out.get("f_half"):
                        out["f_half"] = True
                        half.set()
                        go.wait(30)
                out["f"] = got
            except grpc.RpcError as e:
                out["f"] = e
            out["f_t"] = time.monotonic() - t0
        threads.append(threading.Thread(target=fetch_rank2))
        for th in threads:
            th.start()
        deadline = time.monotonic() + 30
        while not all(out.get(k) for k in ("a_half", "b_half", "f_half")):
            assert time.monotonic() < deadline, f"the transfers did not get halfway: {out}"
            half.wait(0.1)
        old_id = _agents(a)[2].agent_id
        victim = next(p for p in lib.agent_children(srv.pid) if lib.child_rank(p) == 2)
        os.kill(victim, signal.SIGKILL)
        go.set()
        for th in threads:
            th.join(30)
        assert not any(th.is_alive() for th in threads), f"a transfer hung after the kill: {out}"

        for key in ("a", "f"):
            e = out[key]
            assert isinstance(e, grpc.RpcError), f"{key}: ended without an error: {e!r}"
            assert "rank 2" in (e.details() or ""), f"{key}: {e.details()}"
            assert "agent died or cannot be reached" in e.details(), f"{key}: {e.details()}"
            assert _kind(e) == "AGENT_LOST", f"{key}: {_kind(e)}: {e.details()}"
            assert out[key + "_t"] < 20, f"{key} ended {out[key + '_t']:.1f} s after it began"
        assert not isinstance(out["b"], grpc.RpcError), f"b's Upload failed: {out['b'].details()}"
        got_b = fetch(b, out["b"].tensor.ref, gpu=1)
        assert got_b.shape == (each // 4,)
        np.testing.assert_array_equal(got_b, np.frombuffer(chunk_b[:4], np.float32)[0])
        # a's partial tensor: its ref stays undefined and the survivors let it go.
        a.fails("UNKNOWN_REF", lib.describe(up_ref))
        deadline = time.monotonic() + 10
        while True:
            now = {r: ag.allocated_bytes for r, ag in _agents(a).items() if r in (0, 1)}
            want = {0: base[0] + each, 1: base[1] + each}  # b's tensor, nothing of a's
            if now == want or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert now == want, f"survivors hold {now}, want {want} (a's partial upload left behind?)"
        # The pool recovers and a's next Upload, on a new mesh, lands on every rank.
        _replaced(a, 2, old_id)
        m2 = a.mesh(gpu=3).ref
        y = upload(a, m2, ONES)
        np.testing.assert_array_equal(fetch(a, y, gpu=2), ONES)
    print(f"upload ended after {out['a_t']:.2f} s: {out['a'].details()}; "
          f"fetch after {out['f_t']:.2f} s: {out['f'].details()}")


def test_an_in_place_op_given_self_by_keyword_fails_with_its_failed_input(meshd_server):
    """add_(self=a, other=r) where r is a reduce the agent fails, sent in the same
    message (the server cannot know yet): a fails with r on the agent and on the
    server, as add_(b, r) with b given by position does, and r keeps its own root;
    no stale value of a is fetched."""
    srv = lib.wait_ready(meshd_server(1, env=_fault("reduce:fail,count=1")), 1)
    with Session(srv.port, "kw-inplace") as s:
        m = s.mesh(gpu=1).ref
        x = upload(s, m, ONES)
        a, b = s.tensor(m, (8,)), s.tensor(m, (8,))
        s.run(sync())
        r = s.new_ref()
        cmds = [s.command(reduce(r, x, dims=["gpu"], reduction="sum")),
                s.command(lib.call("add_", self=lib.Ref(a.ref), other=lib.Ref(r))),
                s.command(lib.call("add_", lib.Ref(b.ref), lib.Ref(r)))]
        results, code, details = s.submit([pb().Command(batch=cmds)])
        assert code == grpc.StatusCode.OK, details
        assert all(not x.HasField("error") for x in results), results
        errs = s.run(sync(), timeout=20).errors
        assert any("injected fault" in e.message for e in errs), errs
        for t in (a.ref, b.ref, r):
            with pytest.raises(FetchError) as ei:
                fetch(s, t, gpu=0)
            want = "injected fault" if t == r else f"tensor {r}"
            assert want in str(ei.value), (t, ei.value)


def test_a_failed_in_place_write_fails_the_views_of_its_tensor_on_the_agent(meshd_server):
    """add_(a, r) with r failed on the agent, and a view v of a read in the same message
    (before the server hears of the failure): v fails with a on the agent, so y = v * 2
    fails too instead of being computed from a's stale bytes."""
    srv = lib.wait_ready(meshd_server(1, env=_fault("reduce:fail,count=1")), 1)
    with Session(srv.port, "views-fail") as s:
        m = s.mesh(gpu=1).ref
        x = upload(s, m, ONES)
        a = s.tensor(m, (8,))
        (v,) = s.op("narrow", lib.Ref(a.ref), 0, 2, 4)
        s.run(sync())
        r, y = s.new_ref(), s.new_ref()
        cmds = [s.command(reduce(r, x, dims=["gpu"], reduction="sum")),
                s.command(lib.call("add_", lib.Ref(a.ref), lib.Ref(r))),
                s.command(lib.call("mul", lib.Ref(v.ref), 2, results=[y]))]
        results, code, details = s.submit([pb().Command(batch=cmds)])
        assert code == grpc.StatusCode.OK, details
        assert [x.error.message for x in results if x.HasField("error")] == [], results
        s.run(sync(), timeout=20)
        for t in (a.ref, v.ref, y):
            with pytest.raises(FetchError) as ei:
                fetch(s, t, gpu=0)
            assert f"tensor {r}" in str(ei.value) or "injected fault" in str(ei.value), (t, ei.value)


def test_a_failed_write_through_a_mutable_borrow_fails_its_origin(meshd_server):
    """add_(h, r) on the borrowing stream, h a mutable borrow of t and r a reduce the
    agent fails, then DropBorrow, all in one message: t, whose memory the failed
    write left undefined, fails to fetch (Monarch's borrow carries the error back)."""
    srv = lib.wait_ready(meshd_server(1, env=_fault("reduce:fail,count=1")), 1)
    with Session(srv.port, "borrow-fail") as s:
        m = s.mesh(gpu=1).ref
        side = s.stream("side")
        t = s.tensor(m, (8,))
        xs = s.tensor(m, (8,), stream=side)
        s.run(sync())
        r, h, b = s.new_ref(), s.new_ref(), s.new_ref()
        cmds = [s.command(reduce(r, xs.ref, dims=["gpu"], reduction="sum", stream=side)),
                s.command(lib.borrow(h, t.ref, side, True, b)),
                s.command(lib.call("add_", lib.Ref(h), lib.Ref(r), stream=side)),
                s.command(lib.drop_borrow(b))]
        results, code, details = s.submit([pb().Command(batch=cmds)])
        assert code == grpc.StatusCode.OK, details
        assert [x.error.message for x in results if x.HasField("error")] == [], results
        s.run(sync(), timeout=20)
        with pytest.raises(FetchError) as ei:
            fetch(s, t.ref, gpu=0)
        assert f"tensor {r}" in str(ei.value) or "injected fault" in str(ei.value), ei.value
