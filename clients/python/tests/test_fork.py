"""A Session across os.fork() (PyTorch DataLoader workers, multiprocessing's "fork"):
the child shares the parent's gRPC connection (its socket and poller), but none of
its threads. A child that uses the inherited session gets MeshdError NO_SESSION at
once, saying to connect again; it can connect anew; and nothing the child does (use,
close(), garbage collection, exit) touches the parent's session, which keeps working.

Every child reports through a pipe and is SIGKILLed after CHILD_S: a hang fails the test."""

import gc
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import meshd
from conftest import REPO

CHILD_S = 10.0


def _in_child(fn, timeout=CHILD_S):
    """Runs fn() in a forked child; returns what it returned (JSON), or
    {"raised": repr} for an exception. The child is killed after timeout: an assertion."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without pytest's exit machinery
        code = 0
        try:
            os.close(r)
            try:
                out = fn()
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                out = {"raised": repr(e)}
            os.write(w, json.dumps(out).encode())
        except BaseException:  # noqa: BLE001
            code = 3
        finally:
            os._exit(code)
    os.close(w)
    data, deadline = b"", time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"the forked child hung (no answer within {timeout} s)")
            ready, _, _ = select.select([r], [], [], left)
            if ready:
                chunk = os.read(r, 1 << 16)
                if not chunk:
                    break
                data += chunk
    finally:
        os.close(r)
        for _ in range(50):  # reap it (killed if it hangs after answering)
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert data, "the forked child died without an answer"
    return json.loads(data)


def _outcome(call):
    """What call() gave: ["ok", repr] or [kind, message] of a MeshdError, ["raised", repr]."""
    try:
        return ["ok", repr(call())]
    except meshd.MeshdError as e:
        return [e.kind, e.message]
    except BaseException as e:  # noqa: BLE001
        return ["raised", repr(e)]


def _works(session):
    """The session still computes and fetches: (x + 1) summed over gpu."""
    m = session.mesh(gpu=2)
    with m.activate():
        x = meshd.tensor(np.arange(6, dtype=np.float32).reshape(2, 3), shard="gpu")
        y = (x + 1).reduce("gpu", "sum")
        got = meshd.fetch_shard(y, gpu=1).result(10)
        session.sync(10)
    assert np.array_equal(got, np.array([5, 7, 9], np.float32)), got
    return got.tolist()


def _listed(addr, session_id):
    with meshd.connect(addr, client_name="fork-observer") as obs:
        pb = obs._pb
        rows = obs._unary("ListSessions", pb.ListSessionsRequest(), pb.ListSessionsReply,
                          metadata=()).sessions
        return any(r.session_id == session_id for r in rows)


def test_child_gets_clear_error_and_can_connect_anew(server):
    addr = server[0]
    with meshd.connect(addr, timeout=5) as s:
        _works(s)  # the channel is connected and busy, as in a real program
        m = s.mesh(gpu=2)
        with m.activate():  # the child inherits the active mesh too
            x = meshd.tensor(np.ones((2, 3), np.float32), shard="gpu")
            s.sync(10)

            def child():
                out = {
                    "agents": _outcome(s.agents),
                    "mesh": _outcome(lambda: s.mesh(gpu=2)),
                    "tensor": _outcome(lambda: meshd.tensor(np.ones(3, np.float32))),
                    "op": _outcome(lambda: x + 1),
                    "fetch": _outcome(lambda: meshd.fetch_shard(x, gpu=0).result(5)),
                    "sync": _outcome(lambda: s.sync(5)),
                    "close": _outcome(s.close),
                }
                # no gRPC fork support here (grpcio's default): a new session is refused
                # at once (not hung); with GRPC_ENABLE_FORK_SUPPORT=1 it works
                # (test_child_interpreter_exit_leaves_parent_alone)
                out["fresh"] = _outcome(lambda: meshd.connect(addr, timeout=5))
                return out
            got = _in_child(child)
        assert "raised" not in got, got
        for what in ("agents", "mesh", "tensor", "op", "fetch", "sync"):
            kind, message = got[what]
            assert kind == "NO_SESSION", (what, got[what])
            assert "parent process" in message and "meshd.connect()" in message, (what, message)
        assert got["close"][0] == "ok", got["close"]  # nothing to close in the child
        assert got["fresh"][0] == "NO_SESSION" and "fork support is off" in got["fresh"][1]
        # The parent is untouched: its session, its channel, its tensors.
        assert _works(s) == [5.0, 7.0, 9.0]
        with m.activate():
            assert np.array_equal(meshd.fetch_shard(x + 1, gpu=0).result(10), np.full(3, 2.0))
        assert _listed(addr, s.id)


@pytest.mark.parametrize("how", ["untouched", "collected", "with_block"])
def test_child_exit_and_gc_leave_parent_session_alone(server, how):
    """The child never closes the parent's server-side session nor sends on its
    streams: whether it exits at once, drops and collects every handle (finalizers:
    Tensor releases, the session's own), or leaves a `with connect()` block."""
    addr = server[0]
    s = meshd.connect(addr, timeout=5)
    try:
        _works(s)
        m = s.mesh(gpu=2)
        with m.activate():
            kept = meshd.tensor(np.full((2, 3), 4, np.float32), shard="gpu")
            s.sync(10)
            if how == "untouched":
                got = _in_child(lambda: "ok")
            elif how == "collected":
                def child():
                    nonlocal s, m, kept
                    t = kept * 2  # noqa: F841 - refused in the child; collected below
                    del t
                    s = m = kept = None
                    gc.collect()
                    return "ok"
                got = _in_child(child)
            else:
                def child():
                    with s:
                        pass  # leaving the block closes: not the parent's session
                    return "ok"
                got = _in_child(child)
        assert got == "ok" or "raised" in got, got  # (the op above may raise: fine)
        time.sleep(0.5)  # anything the child sent has reached the server
        assert _listed(addr, s.id), "the child closed the parent's session"
        assert _works(s) == [5.0, 7.0, 9.0]
        with m.activate():
            assert np.array_equal(meshd.fetch_shard(kept, gpu=1).result(10), np.full(3, 4.0))
    finally:
        s.close()


def test_child_interpreter_exit_leaves_parent_alone(server, tmp_path):
    """A plain script with GRPC_ENABLE_FORK_SUPPORT=1 (gRPC's fork support on): the child connects
    anew and computes, then falls off its end (the interpreter's own finalization with
    the parent's session in its globals); then the parent uses its session."""
    script = tmp_path / "fork_exit.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        import numpy as np, meshd
        s = meshd.connect(sys.argv[1], timeout=5)
        m = s.mesh(gpu=2)
        ctx = m.activate(); ctx.__enter__()
        x = meshd.tensor(np.full((2, 3), 3, np.float32), shard="gpu")
        s.sync(10)
        pid = os.fork()
        if pid == 0:
            try:
                y = x + 1
            except meshd.MeshdError as e:
                print("child:", e.kind, "parent process" in e.message, flush=True)
            with meshd.connect(sys.argv[1], timeout=5) as mine:
                m2 = mine.mesh(gpu=2)
                with m2.activate():
                    z = meshd.tensor(np.full((2, 3), 2, np.float32), shard="gpu")
                    print("child fresh:", meshd.fetch_shard(z * 3, gpu=0).result(5).tolist(),
                          flush=True)
            sys.exit(0)
        for _ in range(100):  # 10 s at most, then it is killed
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, 9); os.waitpid(pid, 0); sys.exit("the child hung")
        time.sleep(0.5)
        print(meshd.fetch_shard(x + 1, gpu=1).result(10).tolist())
        s.sync(10)
        s.close()
        print("parent ok")
    """))
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "clients", "python"),
           "GRPC_ENABLE_FORK_SUPPORT": "1"}
    p = subprocess.run([sys.executable, str(script), server[0]], capture_output=True,
                       text=True, timeout=60, env=env)
    assert p.returncode == 0 and "parent ok" in p.stdout, (p.stdout, p.stderr[-3000:])
    assert "child: NO_SESSION True" in p.stdout, p.stdout
    assert "child fresh: [6.0, 6.0, 6.0]" in p.stdout, p.stdout
    assert "\n[4.0, 4.0, 4.0]" in p.stdout, p.stdout


def test_child_without_grpc_fork_support_is_refused_not_hung(server, tmp_path):
    """Without gRPC's fork support (grpcio's default): a child's connect() would hang and
    break the parent's connection; it is refused at once, and the parent keeps working."""
    script = tmp_path / "fork_nosupport.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        import numpy as np, meshd
        s = meshd.connect(sys.argv[1], timeout=5)
        s.agents()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                meshd.connect(sys.argv[1], timeout=5)
                msg = "connected"
            except meshd.MeshdError as e:
                msg = e.kind + ": " + e.message
            os.write(w, msg.encode()); os._exit(0)
        for _ in range(100):
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, 9); os.waitpid(pid, 0); sys.exit("the child hung")
        os.close(w); print(os.read(r, 4096).decode())
        print(len(s.agents())); s.close(); print("parent ok")
    """))
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "clients", "python"),
           "GRPC_ENABLE_FORK_SUPPORT": "0"}
    p = subprocess.run([sys.executable, str(script), server[0]], capture_output=True,
                       text=True, timeout=60, env=env)
    assert p.returncode == 0 and "parent ok" in p.stdout, (p.stdout, p.stderr[-3000:])
    assert "NO_SESSION" in p.stdout and "fork support is off" in p.stdout, p.stdout



def test_child_leaving_a_pipeline_block_opened_before_the_fork_does_not_wait():
    """A fork inside a pipeline() block whose commands are still unanswered (the rank-0
    agent is stopped, the server queues 2 commands a session): the child that leaves the block must not wait the session's
    timeout for answers that only the parent's threads can read (then raise
    DEADLINE_EXCEEDED); it ends at once, its session being the parent's. The parent's
    block then ends with every answer."""
    from conftest import start_meshd, stop_meshd
    from test_keepalive import _agent_pid, _stopped
    addr, proc = start_meshd(2, name="meshd-forkpipe", flags=("--session-max-queued", 2, "--agent-timeout", 60))
    try:
        with meshd.connect(addr, timeout=6) as s:
            m = s.mesh(gpu=2)
            agent = _agent_pid(proc.pid, 0)
            with m.activate():
                r, w = os.pipe()
                pid = -1
                with _stopped(agent):
                    try:
                        with s.pipeline():
                            x = meshd.tensor(np.ones((2, 3), np.float32), shard="gpu")
                            y = x + 1
                            s._pipe.flush(5)  # the 2 the server queues: it reads no more
                            z = [y * float(i) for i in range(3)]  # sent, unanswered
                            time.sleep(0.3)
                            pid = os.fork()
                            t0 = time.monotonic()
                            if pid:
                                os.kill(agent, signal.SIGCONT)  # the parent's block ends well
                        out = ["ok", ""]
                    except BaseException as e:  # noqa: BLE001 - the child reports it
                        if pid:
                            raise
                        out = [getattr(e, "kind", "raised"), getattr(e, "message", repr(e))]
                    finally:
                        if pid == 0:  # the child: report, and leave without pytest
                            try:
                                os.write(w, json.dumps(out + [time.monotonic() - t0]).encode())
                            finally:
                                os._exit(0)
                os.close(w)
                ready, _, _ = select.select([r], [], [], CHILD_S)
                data = os.read(r, 1 << 16) if ready else b""
                os.close(r)
                if not data:
                    os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                assert data, f"the forked child hung in its pipeline block's end ({CHILD_S} s)"
                got = json.loads(data)
                assert got[0] in ("ok", "NO_SESSION"), got
                assert got[2] < 2.0, got
                # the parent's block ended with its answers
                assert np.array_equal(meshd.fetch_shard(z[2], gpu=0).result(10), np.full(3, 4.0))
    finally:
        stop_meshd(proc)
