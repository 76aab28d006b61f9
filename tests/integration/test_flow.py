"""Flow control on Submit and Execute (issue 12, point 5): a client that submits faster
than the agents run is slowed, the server never holds more than its bound of accepted
work per session, and a Sync, a CloseSession or an agent's loss always releases a
paused stream.

Real binaries (`meshd --local-agents 1 --session-max-queued B`); the agent is made
slow with fault injection (MESHD_FAULT="reduce:slow=MS", core/platform/fault.h), so that each
Reduce takes MS on the agent while the server accepts it in microseconds. Every wait
is bounded, so a hang fails the test."""

import os
import signal
import threading
import time

import numpy as np
import pytest

import meshd_testlib as lib
from meshd_testlib import Session, drop, reduce, sync
from test_compute import fetch, pb, upload
from test_metrics import port_of, scrape, value

_SVC = "/meshd.v1.TensorService/"
BOUND = 64
ONES = np.ones(8, dtype=np.float32)


def _over_the_server_bound(shared_meshd):
    """The module's server whose bound of queued commands over all sessions (--max-queued 4)
    one session's slow Reduces (0.8 s each) overrun; each test its own sessions, its work
    done by its end."""
    return shared_meshd(1, "--max-queued", 4, env={"MESHD_FAULT": "reduce:slow=800"})


def _server(meshd_server, slow_ms, *flags):
    env = {"MESHD_FAULT": f"reduce:slow={slow_ms}"}
    return lib.wait_ready(meshd_server(1, "--session-max-queued", BOUND, *flags, env=env), 1)


class Sampler:
    """Polls the session's queued_commands (ListSessions) on its own channel."""

    def __init__(self, port, session_id, period=0.01):
        self.s = Session(port, "sampler")
        self.id, self.period = session_id, period
        self.values = []
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while not self.stop.is_set():
            row = next((x for x in self.s.list_sessions() if x.session_id == self.id), None)
            if row is not None:
                self.values.append(row.queued_commands)
            time.sleep(self.period)

    def close(self):
        self.stop.set()
        self.t.join(10)
        self.s.shut()
        return self.values


class Pipeline:
    """One Submit stream fed from a generator on grpc's sending thread; records when
    each command was handed over and collects the replies on a reader thread."""

    def __init__(self, s, commands, timeout=120):
        self.s = s
        self.commands = commands
        self.sent = 0
        self.sent_done = None
        self.results = []
        self.code = None
        self.t0 = time.monotonic()
        fn = s.ch.stream_stream(_SVC + "Submit", request_serializer=lambda m: m.SerializeToString(),
                                response_deserializer=pb().SubmitReply.FromString)
        self.call = fn(self._gen(), metadata=s.metadata, timeout=timeout)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _gen(self):
        for c in self.commands:
            yield c
            self.sent += 1
        self.sent_done = time.monotonic() - self.t0

    def _read(self):
        try:
            for r in self.call:
                self.results.extend(lib.answers(r))
            self.code = self.call.code()
        except Exception as e:  # grpc.RpcError
            self.code = getattr(e, "code", lambda: e)()
        self.end = time.monotonic() - self.t0

    def join(self, timeout):
        self.reader.join(timeout)
        assert not self.reader.is_alive(), (
            f"the Submit stream did not end within {timeout} s: {self.sent} sent, "
            f"{len(self.results)} answered")


def _reduces(s, x, n, drop_every=100):
    """n Reduces of x (each a fresh result), dropping the results every drop_every."""
    out, pending = [], []
    for _ in range(n):
        r = s.new_ref()
        out.append(s.command(reduce(r, x, dims=["gpu"], reduction="sum")))
        pending.append(r)
        if len(pending) == drop_every:
            out.append(s.command(drop(*pending)))
            pending = []
    return out, pending


def test_a_fast_submitter_is_slowed_and_the_server_holds_at_most_its_bound(meshd_server):
    # 1 ms per Reduce on the agent: 4000 take >= 4 s; the server takes each in
    # microseconds. A 16 KiB stream window holds some 500 of them, so the
    # client's last send waits until most of the work ran (unbounded, this
    # client sends everything in about a second, a fifth of the run).
    srv = _server(meshd_server, 1, "--stream-window-bytes", "16KiB")
    n = 4050
    with Session(srv.port, "flood") as s:
        m = s.mesh(gpu=1).ref
        x = upload(s, m, ONES)
        s.run(sync())
        cmds, last = _reduces(s, x, n)
        cmds.append(s.command(sync()))
        sampler = Sampler(srv.port, s.id)
        p = Pipeline(s, cmds)
        p.join(120)
        values = sampler.close()
        assert p.code == lib.grpc.StatusCode.OK, p.code
        assert len(p.results) == len(cmds)
        assert [r.seq for r in p.results] == [c.seq for c in cmds], "one answer per command, in order"
        bad = [r for r in p.results if r.HasField("error")]
        assert not bad, bad[:3]
        assert not p.results[-1].errors, p.results[-1].errors

        print(f"flow: {n} Reduces; peak queued {max(values or [0])}; all sent after "
              f"{p.sent_done:.2f} s of {p.end:.2f} s")
        assert values, "the sampler saw nothing"
        assert max(values) <= BOUND + 1, f"queued_commands peaked at {max(values)} (bound {BOUND})"
        assert max(values) >= BOUND // 2, f"the window never filled: peak {max(values)}"
        # Without backpressure the last send leaves at once; with it the client
        # waits for the agent to work through what sits beyond the window.
        assert p.sent_done > 0.5 * p.end, (
            f"all {n} commands were sent after {p.sent_done:.2f} s of {p.end:.2f} s")

        t0 = time.monotonic()
        s.run(sync(), timeout=10)
        assert time.monotonic() - t0 < 1.0, "a Sync after the stream ended waited for work"
        assert s.info().queued_commands == 0
        np.testing.assert_array_equal(fetch(s, last[-1], gpu=0), ONES)


def test_execute_answers_are_held_while_the_session_is_over(meshd_server):
    srv = _server(meshd_server, 20)
    with Session(srv.port, "unary") as s:
        m = s.mesh(gpu=1).ref
        x = upload(s, m, ONES)
        s.run(sync())
        # Fill the window from a Submit stream (it pauses), then run Executes:
        # each is accepted and answered once the agent has made room.
        cmds, _ = _reduces(s, x, 3 * BOUND, drop_every=1000)
        p = Pipeline(s, cmds)
        end = time.monotonic() + 20
        while (s.info().queued_commands < BOUND) and time.monotonic() < end:
            time.sleep(0.01)
        assert s.info().queued_commands >= BOUND, "the window never filled"
        t0 = time.monotonic()
        r = s.run(reduce(s.new_ref(), x, dims=["gpu"], reduction="sum"), timeout=30)
        held = time.monotonic() - t0
        assert r.tensors, r
        assert held > 0.1, f"an Execute into a full window was answered after {held:.3f} s"
        p.join(60)
        assert p.code == lib.grpc.StatusCode.OK, p.code
        assert s.info().queued_commands <= BOUND + 2


def _paused_stream(srv, s, n=2000):
    """A Submit stream of n slow Reduces, once the server has paused it (its window full)."""
    m = s.mesh(gpu=1).ref
    x = upload(s, m, ONES)
    s.run(sync())
    cmds, _ = _reduces(s, x, n, drop_every=1000)
    p = Pipeline(s, cmds, timeout=60)
    watcher = Session(srv.port, "watcher")
    end = time.monotonic() + 20
    while time.monotonic() < end:
        row = next((r for r in watcher.list_sessions() if r.session_id == s.id), None)
        if row and row.queued_commands >= BOUND:
            break
        time.sleep(0.01)
    else:
        pytest.fail("the stream never filled its window")
    return p, watcher


def test_close_session_releases_a_paused_stream(meshd_server):
    srv = _server(meshd_server, 50)  # 2000 x 50 ms: 100 s of work, were it run
    with Session(srv.port, "closing") as s:
        p, watcher = _paused_stream(srv, s)
        t0 = time.monotonic()
        s.close()
        p.join(15)
        took = time.monotonic() - t0
        watcher.shut()
        # The rest was read and refused at once.
        kinds = {lib.kind_name(r.error.kind) for r in p.results if r.HasField("error")}
        assert kinds == {"NO_SESSION"}, kinds
        assert len(p.results) == p.sent == len(p.commands), (len(p.results), p.sent)
        assert took < 10, f"the stream ended {took:.1f} s after CloseSession"


def test_agent_loss_releases_a_paused_stream(meshd_server):
    srv = _server(meshd_server, 50)
    with Session(srv.port, "lost") as s:
        p, watcher = _paused_stream(srv, s)
        victim = next(iter(lib.agent_children(srv.pid)))
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        p.join(30)
        took = time.monotonic() - t0
        watcher.shut()
        kinds = {lib.kind_name(r.error.kind) for r in p.results if r.HasField("error")}
        assert "AGENT_LOST" in kinds, kinds
        assert len(p.results) == p.sent, (len(p.results), p.sent)
        assert took < 20, f"the stream ended {took:.1f} s after the agent was killed"
        assert s.info().queued_commands <= BOUND


def test_cancelled_paused_stream_leaves_no_wait_behind(meshd_server, tmp_path):
    pf = tmp_path / "metrics.port"
    srv = lib.wait_ready(meshd_server(1, "--session-max-queued", BOUND, "--metrics-listen",
                                      "127.0.0.1:0", "--metrics-port-file", pf,
                                      env={"MESHD_FAULT": "reduce:slow=50"}), 1)
    mport = port_of(pf, srv)
    with Session(srv.port, "cancel") as s:
        p, watcher = _paused_stream(srv, s)
        text = scrape(mport)
        assert value(text, "meshd_flow_waiting") == 1, "the stream waits for room"
        assert value(text, "meshd_flow_waits_total") >= 1
        assert value(text, "meshd_queued_commands") >= BOUND
        p.call.cancel()
        p.join(10)
        end = time.monotonic() + 10
        while value(scrape(mport), "meshd_flow_waiting") != 0 and time.monotonic() < end:
            time.sleep(0.05)
        assert value(scrape(mport), "meshd_flow_waiting") == 0, "the cancelled stream's wait is gone"
        # The session lives on and works: its queue drains, a Sync returns.
        errs = s.run(sync(), timeout=30).errors
        assert list(errs) == []
        assert s.info().queued_commands == 0
        assert value(scrape(mport), "meshd_queued_commands") == 0
        watcher.shut()


def _batch_answered(s, n):
    """(x, the Pipeline) once one Submit message of n Reduces of x has every answer."""
    m = s.mesh(gpu=1).ref
    x = upload(s, m, ONES)
    s.run(sync())
    cmds, _ = _reduces(s, x, n, drop_every=1000)
    p = Pipeline(s, [pb().Command(batch=cmds)], timeout=60)
    end = time.monotonic() + 20
    while len(p.results) < len(cmds) and time.monotonic() < end:
        time.sleep(0.01)
    assert len(p.results) == len(cmds), "the batch was not answered whole"
    return x, p


def test_a_batch_over_the_bound_waits_once_and_its_cancel_leaves_no_wait(meshd_server,
                                                                          tmp_path):
    """One Submit message with 2x the bound of slow Reduces: every command of it is
    accepted (a batch is read whole), its stream waits for room once, not once per
    command past the bound, and cancelling it leaves no wait behind."""
    pf = tmp_path / "metrics.port"
    srv = lib.wait_ready(meshd_server(1, "--session-max-queued", BOUND, "--metrics-listen",
                                      "127.0.0.1:0", "--metrics-port-file", pf,
                                      env={"MESHD_FAULT": "reduce:slow=20"}), 1)
    mport = port_of(pf, srv)
    with Session(srv.port, "batch") as s:
        x, p = _batch_answered(s, 2 * BOUND)
        assert value(scrape(mport), "meshd_flow_waiting") == 1, "one wait for the stream"
        p.call.cancel()
        p.join(10)
        end = time.monotonic() + 5
        while value(scrape(mport), "meshd_flow_waiting") != 0 and time.monotonic() < end:
            time.sleep(0.05)
        assert value(scrape(mport), "meshd_flow_waiting") == 0, "the cancelled stream's wait is gone"
        errs = s.run(sync(), timeout=60).errors
        assert list(errs) == []


def test_an_execute_held_for_room_holds_its_sessions_lease(meshd_server):
    """An Execute whose answer waits for room is a call in flight: the session does not
    expire under it (ttl 2 s, no KeepAlive, the agent busy for longer), and the
    answer comes once the agent made room."""
    srv = _server(meshd_server, 40, "--session-ttl", "2")
    with Session(srv.port, "held-lease") as s:
        # 7.7 s of work queued on a stream, 3x the bound: an Execute then waits for
        # room for about 5 s (the queue down to the bound), past the 2 s ttl
        x, p = _batch_answered(s, 3 * BOUND)
        p.call.cancel()  # its commands stay queued on the agent
        p.join(10)
        t0 = time.monotonic()
        r = s.run(reduce(s.new_ref(), x, dims=["gpu"], reduction="sum"), timeout=30)
        held = time.monotonic() - t0
        assert r.tensors, r
        assert held > 3.5, f"the Execute was answered after {held:.1f} s (the session expired?)"
        # the session lived through it
        assert list(s.run(sync(), timeout=30).errors) == []


def test_commands_that_queue_nothing_on_the_agents_are_not_held(meshd_server):
    """Describe, CreateMesh and SliceMesh send the agents nothing: they are not queued
    work, so a session whose one slow Reduce runs for 3 s answers a bound's worth and
    more of them at once (they were counted, and from the bound on each waited for the
    Reduce), on Execute and on a Submit stream, and ListSessions counts only the Reduce."""
    srv = _server(meshd_server, 3000)
    with Session(srv.port, "metadata") as s:
        m = s.mesh(gpu=1).ref
        x = upload(s, m, ONES)
        s.run(sync())
        t0 = time.monotonic()
        s.run(reduce(s.new_ref(), x, dims=["gpu"], reduction="sum"))
        worst = 0.0
        for i in range(BOUND + 8):
            t = time.monotonic()
            s.run(lib.describe(x) if i % 2 else lib.slice_mesh(s.new_ref(), m, gpu=0), timeout=30)
            worst = max(worst, time.monotonic() - t)
        assert worst < 1.0, f"a command that queues nothing waited {worst:.2f} s behind the Reduce"
        cmds = [s.command(lib.create_mesh(s.new_ref(), gpu=1)) for _ in range(2 * BOUND)]
        results, code, _ = s.submit(cmds, timeout=30)
        assert code == lib.grpc.StatusCode.OK and len(results) == len(cmds), code
        assert not [r for r in results if r.HasField("error")]
        assert s.info().queued_commands <= 1, s.info().queued_commands
        took = time.monotonic() - t0
        assert took < 2.5, f"the metadata commands waited for the Reduce: {took:.2f} s"
        assert list(s.run(sync(), timeout=30).errors) == []
        assert s.info().queued_commands == 0


def test_a_sync_waiting_when_its_session_closes_is_not_answered_ok(meshd_server):
    """CloseSession ends the session's work still queued on the agents (EndSession), so a
    Sync that was waiting for that work must not say it ran: both a Submit stream's Sync
    and an Execute's are answered NO_SESSION, at once (they were answered OK, with no
    error, though 3 s of Reduces never ran)."""
    srv = _server(meshd_server, 100)
    with Session(srv.port, "closing-sync") as s, Session(srv.port, "other") as other:
        m = s.mesh(gpu=1).ref
        x = upload(s, m, ONES)
        s.run(sync())
        cmds, _ = _reduces(s, x, 30, drop_every=1000)
        p = Pipeline(s, cmds + [s.command(sync())], timeout=30)
        out = {}

        def execute_sync():
            try:
                out["result"] = s.run(sync(), timeout=30)
            except lib.CommandError as e:
                out["error"] = e
        end = time.monotonic() + 10
        while len(p.results) < len(cmds) and time.monotonic() < end:
            time.sleep(0.01)
        assert len(p.results) == len(cmds), "the Reduces were not all answered"
        th = threading.Thread(target=execute_sync, daemon=True)
        th.start()
        time.sleep(0.3)
        assert th.is_alive() and len(p.results) == len(cmds), "a Sync returned before the close"
        t0 = time.monotonic()
        s.close()
        p.join(10)
        th.join(10)
        assert not th.is_alive(), "the Execute Sync was not answered after CloseSession"
        assert time.monotonic() - t0 < 2.0
        last = p.results[-1]
        assert last.seq == p.commands[-1].seq, last
        assert last.HasField("error"), f"the Submit Sync was answered OK after the close: {last}"
        assert lib.kind_name(last.error.kind) == "NO_SESSION", last.error
        assert "closed" in last.error.message, last.error
        assert "result" not in out, f"the Execute Sync was answered OK after the close: {out}"
        lib.expect_kind(out["error"], "NO_SESSION", "Sync")
        # Another session on the same agent goes on.
        mo = other.mesh(gpu=1).ref
        xo = upload(other, mo, ONES)
        assert list(other.run(sync(), timeout=10).errors) == []
        np.testing.assert_array_equal(fetch(other, xo, gpu=0), ONES)


def _until(cond, limit, what):
    end = time.monotonic() + limit
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    assert cond(), what


def test_the_rest_of_a_big_message_goes_with_its_stream_or_its_session(meshd_server, tmp_path):
    """The rest of a Submit message past 4x the byte bound waits for room: a stream
    cancelled meanwhile leaves no wait behind and the session goes on; a session closed
    meanwhile answers the rest NO_SESSION and its stream ends, at once; a server stopped
    meanwhile exits after its drain, cleanly (a sanitized build reports nothing)."""
    pf = tmp_path / "metrics.port"
    srv = lib.wait_ready(meshd_server(1, "--session-max-queued-bytes", "16KiB",
                                      "--metrics-listen", "127.0.0.1:0",
                                      "--metrics-port-file", pf, "--drain-seconds", "1",
                                      env={"MESHD_FAULT": "reduce:slow=5"}), 1)
    mport = port_of(pf, srv)
    with Session(srv.port, "rest-cancel") as s, Session(srv.port, "rest-close") as s2:
        for sess, close in ((s, False), (s2, True)):
            m = sess.mesh(gpu=1).ref
            x = upload(sess, m, ONES)
            sess.run(sync())
            cmds, _ = _reduces(sess, x, 3000, drop_every=5000)
            p = Pipeline(sess, [pb().Command(batch=cmds)], timeout=60)
            _until(lambda: len(p.results) > 0 and value(scrape(mport), "meshd_flow_waiting") == 1,
                   10, "the first part was not answered, or the rest does not wait")
            n = len(p.results)
            assert 0 < n < len(cmds) and not any(r.HasField("error") for r in p.results)
            if not close:
                p.call.cancel()
                p.join(10)
                _until(lambda: value(scrape(mport), "meshd_flow_waiting") == 0, 5,
                       "the cancelled stream's rest still waits")
                assert list(sess.run(sync(), timeout=60).errors) == []
                assert value(scrape(mport), "meshd_queued_commands") == 0
                continue
            t0 = time.monotonic()
            sess.close()
            p.join(10)
            assert time.monotonic() - t0 < 3.0
            assert p.code == lib.grpc.StatusCode.OK, p.code
            assert [r.seq for r in p.results] == [c.seq for c in cmds], "answers lost or out of order"
            rest = p.results[n:]
            assert rest and all(r.HasField("error") and lib.kind_name(r.error.kind) == "NO_SESSION"
                                for r in rest[-10:]), rest[-1]
            _until(lambda: value(scrape(mport), "meshd_flow_waiting") == 0, 5, "a wait is left")
        # The server stops while a rest waits: it exits at once, cleanly.
        with Session(srv.port, "rest-stop") as s3:
            m = s3.mesh(gpu=1).ref
            x = upload(s3, m, ONES)
            s3.run(sync())
            cmds, _ = _reduces(s3, x, 3000, drop_every=5000)
            p = Pipeline(s3, [pb().Command(batch=cmds)], timeout=60)
            _until(lambda: len(p.results) > 0 and value(scrape(mport), "meshd_flow_waiting") == 1,
                   10, "the rest does not wait")
            t0 = time.monotonic()
            assert lib.stop(srv, timeout=20) == 0
            assert time.monotonic() - t0 < 5
            p.join(10)


def test_one_big_message_is_taken_in_parts_under_the_byte_bound(meshd_server, tmp_path):
    """Flow control held a Submit stream only between its messages, and a Reduce's
    instructions grow with its group (4 ranks here: about 1.3 KB a command). One message
    of 4096 Reduces with --session-max-queued-bytes 1MiB queued 5.5 MB; then the commands
    past 4 MiB were refused QUOTA ("the most one message may"), which a client's
    pipeline (batches of up to 1024) hit with no way to act on it. Now the server takes
    such a batch in parts: past 4 MiB of a message's instructions, the rest waits for
    room (the session under its bound) as a next message would. Every command is
    accepted and answered in order, the server never has more than its bound and one
    part queued, and the stream goes on."""
    pf = tmp_path / "metrics.port"
    srv = lib.wait_ready(meshd_server(4, "--session-max-queued-bytes", "1MiB",
                                      "--metrics-listen", "127.0.0.1:0",
                                      "--metrics-port-file", pf), 4)
    mport = port_of(pf, srv)
    with Session(srv.port, "big-batch") as s:
        m = s.mesh(gpu=4).ref
        x = upload(s, m, ONES)
        s.run(sync())
        waits0 = value(scrape(mport), "meshd_flow_waits_total")
        cmds = [s.command(reduce(s.new_ref(), x, dims=["gpu"], reduction="sum"))
                for _ in range(4096)]
        p = Pipeline(s, [pb().Command(batch=cmds)], timeout=120)
        peak = 0.0
        end = time.monotonic() + 90
        while len(p.results) < len(cmds) and time.monotonic() < end:
            peak = max(peak, value(scrape(mport), "meshd_queued_instruction_bytes"))
            time.sleep(0.005)
        assert len(p.results) == len(cmds), f"the batch was not answered whole: {len(p.results)}"
        assert [r.seq for r in p.results] == [c.seq for c in cmds], "answers out of order"
        refused = [r.error for r in p.results if r.HasField("error")]
        assert not refused, f"{len(refused)} refused, the first: {refused[0]}"
        assert value(scrape(mport), "meshd_flow_waits_total") > waits0, "the batch never waited"
        assert peak <= (5 << 20) + (64 << 10), f"{peak} bytes queued against a 1 MiB bound"
        assert list(s.run(sync(), timeout=60).errors) == []
        p.call.cancel()
        p.join(10)
        res, code, details = s.submit([pb().Command(batch=[
            s.command(reduce(s.new_ref(), x, dims=["gpu"], reduction="sum")) for _ in range(8)])])
        assert len(res) == 8 and not any(r.HasField("error") for r in res), (code, details)


def test_one_reduce_too_big_to_queue_alone_is_refused_saying_so(meshd_server):
    """A batch waits for room in parts, but one command is not split: a Reduce whose own
    instructions exceed what one message may queue (4x the byte bound: every rank's
    lists its group, ranks squared) is refused QUOTA naming its size and the bound,
    alone or in a batch; a smaller Reduce of the same mesh runs, and so does the rest
    of the batch."""
    srv = lib.wait_ready(meshd_server(4, "--session-max-queued-bytes", "128"), 4)
    with Session(srv.port, "too-big") as s:
        m = s.mesh(host=2, gpu=2).ref
        x = upload(s, m, ONES)
        s.run(sync())
        with pytest.raises(lib.CommandError) as e:
            s.run(reduce(s.new_ref(), x, dims=[], reduction="sum"))
        lib.expect_kind(e.value, "QUOTA", "Reduce")
        msg = e.value.message
        assert "this one command" in msg and "groups of 4 ranks" in msg and "512" in msg, msg
        ok = s.new_ref()
        res, code, details = s.submit([pb().Command(batch=[
            s.command(reduce(s.new_ref(), x, dims=[], reduction="sum")),
            s.command(reduce(ok, x, dims=["gpu"], reduction="sum"))])])
        assert len(res) == 2, (code, details)
        assert res[0].HasField("error") and "this one command" in res[0].error.message, res[0]
        assert not res[1].HasField("error"), res[1]
        assert list(s.run(sync(), timeout=30).errors) == []
        np.testing.assert_array_equal(fetch(s, ok, host=1, gpu=0), 2 * ONES)



def test_another_sessions_burst_does_not_refuse_a_literal(shared_meshd):
    """The server-wide bound (--max-queued) makes every session that submits wait, but
    it must not refuse them: a Literal sent by Execute in session B, while session A's
    slow Reduces hold the whole server over its bound, is accepted and answered once
    there is room (it was refused QUOTA "the server has more queued ... send it again",
    so one client's burst failed another client's plain meshd.tensor())."""
    import struct
    from test_transfers import fetch_floats, literal
    srv = _over_the_server_bound(shared_meshd)
    with Session(srv.port, "burst", timeout=30) as a, Session(srv.port, "bystander",
                                                                timeout=30) as b:
        ma = a.mesh(gpu=1).ref
        x = upload(a, ma, ONES)
        a.run(sync())
        cmds, _ = _reduces(a, x, 5, drop_every=1000)
        p = Pipeline(a, cmds + [a.command(sync())], timeout=60)
        # A's Sync checkpoints its 6 commands: the whole server is over its bound of 4
        _until(lambda: len(p.results) >= len(cmds), 10, "A's Reduces were not answered")
        time.sleep(0.2)
        assert len(p.results) == len(cmds), "A's Sync returned before its Reduces ran"
        mb = b.mesh(gpu=1).ref
        y = b.new_ref()
        res = b.run(literal(y, mb, struct.pack("<2f", 3, 4), (2,)), timeout=30)
        assert res.tensors, res
        assert fetch_floats(b, y) == [3.0, 4.0]
        p.join(30)
        assert not p.results[-1].HasField("error"), p.results[-1]


def test_another_sessions_backlog_does_not_hold_a_sync(shared_meshd):
    """A Sync waits for its own session's work only (protocol.md, progress per
    session): session B, whose work all ran, is answered at once while session A's
    slow Reduces hold the whole server over --max-queued (B's Execute Sync was held
    for room until A's backlog drained: 4 s here, forever behind a stalled session)."""
    srv = _over_the_server_bound(shared_meshd)
    with Session(srv.port, "burst", timeout=30) as a, Session(srv.port, "bystander",
                                                                timeout=30) as b:
        ma = a.mesh(gpu=1).ref
        x = upload(a, ma, ONES)
        a.run(sync())
        mb = b.mesh(gpu=1).ref
        y = upload(b, mb, ONES)
        b.run(sync())
        cmds, _ = _reduces(a, x, 5, drop_every=1000)
        p = Pipeline(a, cmds + [a.command(sync())], timeout=60)
        # A's Sync checkpoints its 6 commands: the whole server is over its bound of 4
        _until(lambda: len(p.results) >= len(cmds), 10, "A's Reduces were not answered")
        t0 = time.monotonic()
        assert list(b.run(sync(), timeout=30).errors) == []
        took = time.monotonic() - t0
        assert len(p.results) == len(cmds), "A's Sync returned before B's: no backlog to test"
        assert took < 1.5, f"B's Sync waited {took:.1f} s for session A's work"
        np.testing.assert_array_equal(fetch(b, y, gpu=0), ONES)
        p.join(30)
        assert not p.results[-1].HasField("error"), p.results[-1]
