"""Process lifecycle and robustness of meshd (docs/operations.md: "Agents and the
server", "Lifecycle", "Binaries and flags")."""

import os
import re
import signal
import subprocess
import time
import urllib.request

import grpc
import pytest

import meshd_testlib as lib


# ---------------------------------------------------------------- supervised agents

def _wait_children(srv, n, timeout=lib.REGISTER_TIMEOUT):
    deadline = time.monotonic() + timeout
    while True:
        kids = lib.agent_children(srv.pid)
        if len(kids) == n or time.monotonic() > deadline:
            return kids
        time.sleep(0.05)


def test_local_agents_are_children_with_ranks(meshd_server):
    srv = meshd_server(2)
    lib.wait_health(srv.port, lib.TENSOR_SERVICE, lib.SERVING(), timeout=lib.REGISTER_TIMEOUT,
                    proc=srv.proc, log=srv.log)
    agents = lib.wait_agents(srv.port, lambda ag: lib.healthy_ranks(ag) == [0, 1],
                             what="ranks 0 and 1 healthy", log=srv.log)
    kids = _wait_children(srv, 2)
    assert sorted(lib.child_rank(p) for p in kids) == [0, 1], \
        {p: lib.proc_cmdline(p) for p in kids}
    for a in agents:
        assert a.device == "cpu"
        assert a.address.startswith("127.0.0.1:"), a.address
        assert a.memory_bytes > 0
        assert a.agent_id
    # Each agent leads a process group of its own: a Ctrl-C to meshd's group (the
    # terminal's) reaches meshd alone, which drains its sessions before it stops them.
    for p in kids:
        assert os.getpgid(p) == p != os.getpgid(srv.proc.pid), (p, os.getpgid(p))


def _blas_threads(pids):
    """OPENBLAS_NUM_THREADS in each process's environment (None where unset)."""
    out = []
    for p in pids:
        with open(f"/proc/{p}/environ", "rb") as f:
            env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        v = env.get(b"OPENBLAS_NUM_THREADS")
        out.append(v.decode() if v is not None else None)
    return out


def test_local_agents_share_the_cores_between_their_blas_threads(meshd_server, monkeypatch):
    """OpenBLAS (the cpu backend's matmul) starts a thread per core in every process,
    and its idle threads spin after each call: N local agents ran N x cores threads on
    the same cores. Each gets cores / N (at least 1) unless meshd's environment sets
    OPENBLAS_NUM_THREADS, which then reaches the agents as it is."""
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    srv = meshd_server(2)
    want = str(max(1, os.cpu_count() // 2))
    assert _blas_threads(_wait_children(srv, 2)) == [want, want]
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    srv = meshd_server(1)
    assert _blas_threads(_wait_children(srv, 1)) == ["3"]


def test_sigkilled_agent_is_dropped_and_restarted(meshd_server):
    srv = meshd_server(2)
    before = lib.wait_agents(srv.port, lambda ag: lib.healthy_ranks(ag) == [0, 1],
                             what="ranks 0 and 1 healthy", log=srv.log)
    kids = _wait_children(srv, 2)
    victim = next(p for p in kids if lib.child_rank(p) == 0)
    old_id = next(a.agent_id for a in before if a.rank == 0)

    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()

    # Dropped: the old registration is gone or unhealthy within 2 s.
    def dropped(agents):
        return not any(a.agent_id == old_id and a.healthy for a in agents)
    lib.wait_agents(srv.port, dropped, timeout=2.0, what=f"agent {old_id} (rank 0) dropped",
                    log=srv.log)
    assert time.monotonic() - killed_at <= 2.5  # wait_agents' own bound, plus one poll

    # Restarted: a new child with --rank 0 (new pid), registered again as rank 0.
    deadline = time.monotonic() + 15.0
    while True:
        kids2 = lib.agent_children(srv.pid)
        new = [p for p in kids2 if lib.child_rank(p) == 0 and p != victim]
        if new or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert new, f"no new rank-0 agent child within 15 s; children: " \
                f"{ {p: lib.proc_cmdline(p) for p in kids2} }\n{lib.log_tail(srv.log)}"
    after = lib.wait_agents(
        srv.port, lambda ag: any(a.rank == 0 and a.healthy and a.agent_id != old_id for a in ag),
        timeout=15.0, what="a new rank-0 agent", log=srv.log)
    assert lib.healthy_ranks(after) == [0, 1], lib.describe_agents(after)
    lib.wait_health(srv.port, lib.TENSOR_SERVICE, lib.SERVING(), timeout=10.0, log=srv.log)


def _wait_log(srv, pattern, timeout):
    """The first match of pattern in srv's log within timeout s, or a failure with its tail."""
    deadline = time.monotonic() + timeout
    while True:
        with open(srv.log, errors="replace") as f:
            m = re.search(pattern, f.read())
        if m:
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"no /{pattern}/ in meshd's log within {timeout} s\n{lib.log_tail(srv.log)}")
        time.sleep(0.05)


def test_local_agents_that_keep_exiting_are_failing_and_liveness_says_when_all_are(
        meshd_server, tmp_path):
    """A local agent that keeps exiting right after its start (a wrong device, a broken
    binary) is "failing": an error names its rank and last exit, and it is retried every
    5 s rather than every second. Liveness ("") turns NOT_SERVING only when every local
    agent fails (restarting the server would end the sessions the others serve), and
    SERVING again once one has run 5 s."""
    # The agents run through a wrapper that exits 3 while a file says its rank must fail.
    wrapper = tmp_path / "agent-wrapper"
    wrapper.write_text(f"""#!/bin/sh
prev=; rank=
for a in "$@"; do [ "$prev" = --rank ] && rank=$a; prev=$a; done
if [ -e "{tmp_path}/fail-$rank" ]; then echo "rank $rank: told to fail" >&2; exit 3; fi
exec "{lib.AGENT}" "$@"
""")
    wrapper.chmod(0o755)
    (tmp_path / "fail-1").touch()
    pf = tmp_path / "metrics.port"
    srv = meshd_server(2, "--agent-binary", wrapper, "--metrics-listen", "127.0.0.1:0",
                       "--metrics-port-file", pf, min_agents=1)

    def failing_gauge():
        port = int(pf.read_text())
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return float(re.search(r"^meshd_local_agents_failing (\S+)$", r.read().decode(),
                                   re.M).group(1))

    m = _wait_log(srv, r"agent rank 1 keeps exiting within 5 s of its start \(5 times in a row, "
                       r"the last with exit code 3\): failing", timeout=15.0)
    lib.wait_agents(srv.port, lambda ag: lib.healthy_ranks(ag) == [0], what="rank 0 healthy",
                    log=srv.log)
    assert lib.health_check(srv.port, "") == lib.SERVING(), "one of two failing is not liveness"
    assert failing_gauge() == 1
    failing_at = time.monotonic()

    # Rank 0 fails too: nothing this server supervises can run.
    (tmp_path / "fail-0").touch()
    victim = next(p for p in _wait_children(srv, 1) if lib.child_rank(p) == 0)
    os.kill(victim, signal.SIGKILL)
    lib.wait_health(srv.port, "", lib.NOT_SERVING(), timeout=15.0, log=srv.log)
    assert failing_gauge() == 2

    # Rank 1 was retried every 5 s meanwhile, not every second: at most 2 starts in 6 s.
    time.sleep(max(0.0, failing_at + 6.0 - time.monotonic()))
    with open(srv.log, errors="replace") as f:
        later = f.read()[m.end():]
    assert 1 <= len(re.findall(r"agent rank 1 \(pid \d+\) exited", later)) <= 2, later

    # Rank 1 may run again: once it has run 5 s, liveness is SERVING.
    (tmp_path / "fail-1").unlink()
    lib.wait_health(srv.port, "", lib.SERVING(), timeout=20.0, log=srv.log)
    _wait_log(srv, r"agent rank 1 \(pid \d+\) has run 5 s: no longer failing", timeout=1.0)
    lib.wait_agents(srv.port, lambda ag: lib.healthy_ranks(ag) == [1], what="rank 1 healthy",
                    log=srv.log)
    assert failing_gauge() == 1


def test_local_agents_on_one_gpu_each_report_their_share_of_it(meshd_server, tmp_path):
    """`--local-agent-device cuda:K` puts every local agent on GPU K: each gets
    --memory-share=N and reports 1/N of the device's memory, not each the whole of it.
    No GPU here: a wrapper records the arguments and runs the agent on cpu, whose
    memory the share divides the same way."""
    wrapper = tmp_path / "agent-wrapper"
    wrapper.write_text(f"""#!/bin/sh
echo "$@" >> "{tmp_path}/args"
args=; for a in "$@"; do [ "$a" = cuda:0 ] && a=cpu; args="$args $a"; done
exec "{lib.AGENT}" $args
""")
    wrapper.chmod(0o755)
    srv = meshd_server(2, "--agent-binary", wrapper, "--local-agent-device", "cuda:0")
    shared = lib.wait_agents(srv.port, lambda ag: lib.healthy_ranks(ag) == [0, 1],
                             what="ranks 0 and 1 healthy", log=srv.log)
    lines = (tmp_path / "args").read_text().splitlines()
    assert len(lines) == 2 and all("--device cuda:0" in ln and "--memory-share=2" in ln
                                   for ln in lines), lines
    # One cpu agent alone reports the whole (meshd gives cpu agents total / N).
    one = meshd_server(1)
    whole = lib.wait_agents(one.port, lambda ag: lib.healthy_ranks(ag) == [0], what="rank 0",
                            log=one.log)[0].memory_bytes
    assert [a.memory_bytes for a in shared] == [whole // 2] * 2, (whole, lib.describe_agents(shared))


def test_an_idle_connection_does_not_hold_up_the_stop(meshd_server):
    """A client connected with no call in flight (here an HTTP/2 peer that never
    answers the server's GOAWAY, the worst case of an idle channel) must not keep
    meshd waiting through --drain-seconds: with no call left, the connections
    are closed at once."""
    import socket
    drain = 20
    srv = meshd_server(1, "--drain-seconds", drain)
    idle = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    try:
        # The HTTP/2 preface and an empty SETTINGS frame: a live connection to gRPC.
        idle.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
        time.sleep(0.3)
        os.kill(srv.pid, signal.SIGTERM)
        try:
            rc = srv.proc.wait(drain / 2)
        except subprocess.TimeoutExpired:
            pytest.fail(f"meshd still running {drain / 2} s after SIGTERM with only an idle "
                        f"connection open (--drain-seconds {drain})\n{lib.log_tail(srv.log)}")
        assert rc == 0, f"exit code {rc}\n{lib.log_tail(srv.log)}"
    finally:
        idle.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_drains_and_exits_zero(meshd_server, watches, sig):
    drain = 2
    srv = meshd_server(2, "--drain-seconds", drain)
    lib.wait_health(srv.port, lib.TENSOR_SERVICE, lib.SERVING(), timeout=lib.REGISTER_TIMEOUT,
                    proc=srv.proc, log=srv.log)
    kids = _wait_children(srv, 2)
    assert len(kids) == 2
    w_default = watches(srv.port, "")
    w_tensor = watches(srv.port, lib.TENSOR_SERVICE)
    assert lib.status_name(w_default.first()) == "SERVING"
    assert lib.status_name(w_tensor.first()) == "SERVING"

    os.kill(srv.pid, sig)
    t0 = time.monotonic()
    for w in (w_default, w_tensor):
        w.wait_for(lib.NOT_SERVING(), drain + 2)
        code, details, = w.wait_end(drain + 2)
        assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
    try:
        rc = srv.proc.wait(max(0.1, drain + 2 - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        pytest.fail(f"meshd still running {drain + 2} s after {sig.name} "
                    f"(--drain-seconds {drain})\n{lib.log_tail(srv.log)}")
    assert rc == 0, f"exit code {rc}\n{lib.log_tail(srv.log)}"
    left = lib.wait_gone(kids, 1.0)
    assert not left, f"agents {sorted(left)} outlived meshd"
    # The local agents stop with the server: not a loss, and no warning says so (the
    # server logs their links' end at info, when it sees it before it exits).
    warns = [ln for ln in srv.log_text().splitlines() if " WARN " in ln and "lost" in ln]
    assert not warns, warns


def test_sigkilled_meshd_leaves_no_agents(meshd_server):
    # PR_SET_PDEATHSIG: children get SIGTERM if meshd dies.
    srv = meshd_server(2)
    lib.wait_agents(srv.port, lambda ag: lib.healthy_ranks(ag) == [0, 1],
                    what="ranks 0 and 1 healthy", log=srv.log)
    kids = _wait_children(srv, 2)
    assert len(kids) == 2
    srv.signal(signal.SIGKILL)
    srv.proc.wait(10)
    left = lib.wait_gone(kids, 10.0)
    assert not left, f"agents {sorted(left)} survived a SIGKILLed meshd"


def test_a_sigkilled_meshds_join_token_stays_in_the_tests_temp_dir(meshd_server, tmp_path):
    """meshd removes the join token directory it makes for --local-agents when it
    exits, but not when it is SIGKILLed: the fixtures give it TMPDIR=tmp_path, so that
    directory goes with the test's own (one /tmp/meshd-join-* a killed server, before)."""
    srv = meshd_server(1)
    kids = _wait_children(srv, 1)
    args = lib.proc_cmdline(next(iter(kids)))
    token = args[args.index("--join-token-file") + 1]
    assert os.path.commonpath([token, str(tmp_path)]) == str(tmp_path), token
    srv.signal(signal.SIGKILL)
    srv.proc.wait(10)
    assert not lib.wait_gone(kids, 10.0)
    assert os.path.exists(token), "a SIGKILLed meshd removed its token: nothing to test"


def test_agent_survives_server_restart(meshd_server, agent):
    first = meshd_server()
    a = agent(first.port)
    agents = lib.wait_agents(first.port, lambda ag: len(ag) == 1 and ag[0].healthy,
                             what="one healthy agent", log=first.log)
    agent_id = agents[0].agent_id
    port = first.port
    assert lib.stop(first) == 0, lib.log_tail(first.log)

    second = meshd_server(0, listen=f"127.0.0.1:{port}")
    assert second.port == port
    again = lib.wait_agents(
        port, lambda ag: any(x.agent_id == agent_id and x.healthy for x in ag),
        timeout=lib.REGISTER_TIMEOUT, what=f"agent {agent_id} registered again", log=second.log)
    assert len(again) == 1, lib.describe_agents(again)
    assert a.proc.poll() is None
    lib.wait_health(a.port, lib.AGENT_SERVICE, lib.SERVING(), timeout=10.0, log=a.log)
    lib.wait_health(port, lib.TENSOR_SERVICE, lib.SERVING(), timeout=10.0, log=second.log)


def test_second_server_on_a_taken_port_fails(meshd_server, tmp_path):
    # SO_REUSEPORT is off: a second meshd on the same port must not start serving.
    first = meshd_server()
    try:
        r = lib.run(lib.MESHD, ["--listen", f"127.0.0.1:{first.port}",
                                "--port-file", str(tmp_path / "second.port")], timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a second meshd on the taken port {first.port} kept running")
    assert r.returncode != 0, f"second meshd on port {first.port} exited 0\n{r.stderr}"
    assert lib.health_check(first.port, "") == lib.SERVING()


def test_a_metrics_port_that_fails_leaves_no_port_file(tmp_path):
    """--port-file was written as soon as the client port served, before --metrics-listen
    was tried: with the metrics port taken, meshd exited 1 and left the file naming a port
    nobody serves (an orchestrator waiting on it connected to nothing)."""
    import socket
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    pf = tmp_path / "meshd.port"
    try:
        try:
            r = lib.run(lib.MESHD, ["--listen", "127.0.0.1:0", "--port-file", str(pf),
                                    "--metrics-listen", f"127.0.0.1:{taken.getsockname()[1]}"],
                        timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail("meshd kept running with its --metrics-listen port taken")
    finally:
        taken.close()
    assert r.returncode != 0, r.stderr
    assert "metrics-listen" in r.stderr, r.stderr
    assert not pf.exists(), f"a stale --port-file is left: {pf.read_text()!r}\n{r.stderr}"


@pytest.mark.parametrize("fail", ["metrics-taken", "client-taken", "port-file-unwritable"])
def test_a_startup_failure_leaves_none_of_the_port_files(tmp_path, fail):
    """--cluster-port-file is written when the registry's port serves, --metrics-port-file
    when the metrics port does, both before the client port, --metrics-listen and
    --port-file are tried: a startup that failed past them exited 1 and left them naming
    ports nobody serves (only --port-file was looked after)."""
    import socket
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    busy = f"127.0.0.1:{taken.getsockname()[1]}"
    cpf, mpf, pf = tmp_path / "cluster.port", tmp_path / "metrics.port", tmp_path / "meshd.port"
    args = ["--listen", busy if fail == "client-taken" else "127.0.0.1:0",
            "--cluster-listen", "127.0.0.1:0", "--cluster-port-file", str(cpf),
            "--port-file", str(tmp_path / "no-such-dir" / "meshd.port")
            if fail == "port-file-unwritable" else str(pf)]
    if fail != "metrics-taken":
        args += ["--metrics-listen", "127.0.0.1:0", "--metrics-port-file", str(mpf)]
    else:
        args += ["--metrics-listen", busy]
    try:
        try:
            r = lib.run(lib.MESHD, args, timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"meshd kept running ({fail})")
    finally:
        taken.close()
    assert r.returncode != 0, r.stderr
    left = [f.name for f in (cpf, mpf, pf) if f.exists()]
    assert not left, f"stale port files left ({fail}): {left}\n{r.stderr}"


# ---------------------------------------------------------------- flags and env

BINARIES = {"meshd": lambda: lib.MESHD, "meshd-agent": lambda: lib.AGENT,
            "meshctl": lambda: lib.MESHCTL}
# Flags that exist on every binary: meshd and meshd-agent have --threads; meshctl --timeout-ms.
NUMERIC_FLAG = {"meshd": "--threads", "meshd-agent": "--threads", "meshctl": "--timeout-ms"}
# Safe args so that a binary that wrongly accepts a bad flag does not bind 50051 or hang.
SAFE_ARGS = {"meshd": ["--listen", "127.0.0.1:0"],
             "meshd-agent": ["--server", "127.0.0.1:1", "--listen", "127.0.0.1:0"],
             "meshctl": ["--server", "127.0.0.1:1"]}
# A usage error exits 2 for the daemons; meshctl uses 64 (EX_USAGE) because 2
# already means "could not connect" in its grpc_health_probe-style codes.
USAGE_EXIT = {"meshd": 2, "meshd-agent": 2, "meshctl": 64}


def _run_bad(binary, args, env=None):
    try:
        return lib.run(BINARIES[binary](), SAFE_ARGS[binary] + args, env=env, timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{binary} {' '.join(args)}: still running after 10 s (bad flag accepted)")


@pytest.mark.parametrize("binary", list(BINARIES))
def test_unknown_flag_is_a_usage_error(binary):
    r = _run_bad(binary, ["--no-such-flag", "1"] + (["health"] if binary == "meshctl" else []))
    assert r.returncode == USAGE_EXIT[binary], (r.returncode, r.stderr)
    assert "no-such-flag" in r.stderr, r.stderr


@pytest.mark.parametrize("binary,args", [
    ("meshd", ["--listen", "127.0.0.1:99999"]),
    ("meshd", ["--health-listen", "127.0.0.1:65536"]),
    ("meshd", ["--metrics-listen", "127.0.0.1:70000"]),
    ("meshd-agent", ["--listen", "127.0.0.1:65537"]),
], ids=["listen", "health-listen", "metrics-listen", "agent-listen"])
def test_a_port_past_65535_is_refused_at_startup(binary, args):
    """gRPC and getaddrinfo take a port modulo 65536: `--listen 127.0.0.1:99999` served on
    port 34463 (logged as "listening on 127.0.0.1:99999, port 34463"), 65536 on a random
    port, 65537 on port 1. The process must stop at startup naming the address."""
    r = _run_bad(binary, args)
    assert r.returncode != 0, (r.returncode, r.stderr)
    assert args[1] in r.stderr and "out of range" in r.stderr, r.stderr


@pytest.mark.parametrize("binary", list(BINARIES))
def test_a_bad_flag_prints_a_usage_line_and_a_pointer_to_help(binary):
    """operations.md: a bad flag prints the problem and a usage line (not the whole --help,
    which buried the problem under 60 lines of flags) and says where the rest is."""
    r = _run_bad(binary, ["--no-such-flag", "1"] + (["health"] if binary == "meshctl" else []))
    assert r.returncode == USAGE_EXIT[binary], (r.returncode, r.stderr)
    lines = r.stderr.splitlines()
    assert "no-such-flag" in lines[0], r.stderr
    assert [l for l in lines if l.startswith("usage: ")] == [lines[1]], r.stderr
    assert f"{binary} --help" in r.stderr and len(lines) <= 3, r.stderr
    assert "show this help" not in r.stderr, r.stderr


@pytest.mark.parametrize("binary", list(BINARIES))
def test_non_numeric_flag_is_a_usage_error(binary):
    flag = NUMERIC_FLAG[binary]
    r = _run_bad(binary, [flag, "abc"] + (["health"] if binary == "meshctl" else []))
    assert r.returncode == USAGE_EXIT[binary], (r.returncode, r.stderr)
    assert flag.lstrip("-") in r.stderr, r.stderr


@pytest.mark.parametrize("args,named", [
    (["--local-agents", "257"], "local-agents"),      # out of range (0..256)
    (["--local-agents", "-1"], "local-agents"),
    (["--drain-seconds"], "drain-seconds"),           # missing value
    (["--max-message-bytes", "lots"], "max-message-bytes"),
    (["--session-max-transfers", "65"], "session-max-transfers"),  # what agents keep: 64
    (["--metrics-port-file", "/tmp/m.port"], "needs --metrics-listen"),
    (["--cluster-port-file", "/tmp/c.port"], "needs --cluster-listen"),
], ids=["out-of-range", "negative", "missing-value", "bad-bytes", "over-the-agents",
        "metrics-port-file-alone", "cluster-port-file-alone"])
def test_meshd_bad_flag_values_exit_2(args, named):
    r = _run_bad("meshd", args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert named in r.stderr, r.stderr


@pytest.mark.parametrize("args,named", [
    (["--metrics-port-file", "/tmp/m.port"], "needs --metrics-listen"),
    (["--health-port-file", "/tmp/h.port"], "needs --health-listen"),
], ids=["metrics-port-file-alone", "health-port-file-alone"])
def test_agent_port_file_without_its_port_exits_2(args, named):
    r = _run_bad("meshd-agent", args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert named in r.stderr, r.stderr


def test_meshd_bad_env_value_exits_2():
    # Every flag is also an environment variable; a bad value there is as bad.
    r = _run_bad("meshd", [], env={"MESHD_THREADS": "abc"})
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "threads" in r.stderr.lower(), r.stderr


@pytest.mark.parametrize("binary", list(BINARIES))
def test_help_exits_0(binary):
    r = lib.run(BINARIES[binary](), ["--help"], timeout=10)
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert "usage" in (r.stdout + r.stderr).lower()


@pytest.mark.parametrize("binary", list(BINARIES))
def test_version_names_the_version_file_and_the_build(binary):
    r = lib.run(BINARIES[binary](), ["--version"], timeout=10)
    assert r.returncode == 0, (r.returncode, r.stderr)
    with open(os.path.join(lib.SOURCE_DIR, "VERSION")) as f:
        version = f.read().strip()
    assert re.fullmatch(re.escape(binary) + " " + re.escape(version) +
                        r" \(commit ([0-9a-f]{7,40}|unknown), \w+, cuda backend: (yes|no)\)\n",
                        r.stdout), r.stdout


def test_env_local_agents_like_flag(meshd_server):
    srv = meshd_server(env={"MESHD_LOCAL_AGENTS": "1"})
    agents = lib.wait_agents(srv.port, lambda ag: lib.healthy_ranks(ag) == [0],
                             what="one healthy agent from MESHD_LOCAL_AGENTS=1", log=srv.log)
    assert len(agents) == 1
    # --min-agents defaults to the local agent count (1).
    lib.wait_health(srv.port, lib.TENSOR_SERVICE, lib.SERVING(), timeout=10.0, log=srv.log)
    assert len(_wait_children(srv, 1)) == 1


def test_flag_beats_env(meshd_server):
    srv = meshd_server(1, env={"MESHD_LOCAL_AGENTS": "2"})
    lib.wait_agents(srv.port, lambda ag: lib.healthy_ranks(ag) == [0], what="rank 0 healthy",
                    log=srv.log)
    time.sleep(1.0)  # give a wrongly started second agent the time to show up
    agents = lib.list_agents(srv.port)
    assert len(agents) == 1, lib.describe_agents(agents)
    assert len(lib.agent_children(srv.pid)) == 1


# ---------------------------------------------------------------- bad calls

def test_unknown_method_unimplemented(meshd_server):
    port, _, _ = meshd_server()
    t = lib.tensor_pb2()
    for method in ("/meshd.v1.TensorService/NoSuchMethod", "/no.such.Service/Call"):
        with pytest.raises(grpc.RpcError) as e:
            lib.unary(port, method, t.ListAgentsRequest(), t.ListAgentsReply)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED, (method, e.value.details())
    assert lib.health_check(port, "") == lib.SERVING()


def test_invalid_protobuf_is_invalid_argument(meshd_server):
    port, _, _ = meshd_server()
    t = lib.tensor_pb2()
    with pytest.raises(grpc.RpcError) as e:
        lib.unary(port, "/meshd.v1.TensorService/ListAgents", b"\xff\xff\xff", t.ListAgentsReply,
                  serializer=lambda x: x)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    # Same for the health service, then both still work.
    h = lib.health_pb2()
    with pytest.raises(grpc.RpcError) as e:
        lib.unary(port, "/grpc.health.v1.Health/Check", b"\xff\xff\xff", h.HealthCheckResponse,
                  serializer=lambda x: x)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert lib.health_check(port, "") == lib.SERVING()
    lib.list_agents(port)


def test_message_over_limit_resource_exhausted(meshd_server):
    limit = 1024
    port, _, _ = meshd_server(0, "--max-message-bytes", limit)
    t = lib.tensor_pb2()
    # A valid ListAgentsRequest (one unknown length-delimited field 15) of ~2 KiB:
    # only the size makes it wrong.
    payload = b"\x7a" + bytes([0xd0, 0x0f]) + b"x" * 2000   # field 15, len 2000
    assert len(payload) > limit
    with pytest.raises(grpc.RpcError) as e:
        lib.unary(port, "/meshd.v1.TensorService/ListAgents", payload, t.ListAgentsReply,
                  serializer=lambda x: x)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    # A small valid message with an unknown field is fine, and the server still serves.
    lib.unary(port, "/meshd.v1.TensorService/ListAgents", b"\x7a\x02xx", t.ListAgentsReply,
              serializer=lambda x: x)
    assert lib.health_check(port, "") == lib.SERVING()


def _cuda_built():
    out = subprocess.run([lib.AGENT, "--help"], capture_output=True, text=True).stdout
    return "cuda:emulated" in out


def test_agent_that_loses_its_device_reports_not_serving_and_exits(meshd_server, agent, watches,
                                                                   tmp_path):
    """A simulated device loss (the emulated cuda device's stand-in for a GPU falling off the
    bus): the agent turns NOT_SERVING, exits non-zero so that its orchestrator restarts it,
    and the server stops counting it."""
    if not _cuda_built():
        pytest.skip("this build has no cuda backend (its emulated device simulates the loss)")
    srv = meshd_server(0, min_agents=1, wait_serving=False)
    lost = tmp_path / "device-lost"
    a = agent(srv.port, "--device", "cuda:emulated",
              env={"MESHD_EMULATED_DEVICE_LOSS_FILE": str(lost)})
    lib.wait_health(srv.port, lib.TENSOR_SERVICE, lib.SERVING(), timeout=lib.REGISTER_TIMEOUT,
                    log=srv.log)
    w = watches(a.port, lib.AGENT_SERVICE)
    assert w.first() == lib.SERVING()
    lost.write_text("")
    ev = w.next(10.0)
    assert ev is not None, "the agent neither reported NOT_SERVING nor ended the Watch"
    assert ev[0] == "end" or ev[1] == lib.NOT_SERVING(), ev
    rc = a.proc.wait(timeout=lib.EXIT_TIMEOUT)
    assert rc != 0, "a lost device must end the agent with a failure status"
    with open(a.log) as f:
        log = f.read()
    assert "device cuda:emulated lost" in log and "NOT_SERVING" in log, lib.log_tail(a.log)
    lib.wait_health(srv.port, lib.TENSOR_SERVICE, lib.NOT_SERVING(), timeout=lib.REGISTER_TIMEOUT,
                    log=srv.log)


def test_agent_stopped_while_a_collective_waits_exits_promptly(meshd_server, agent):
    """SIGTERM while the agent's worker waits in a collective for a peer that is stopped
    (SIGSTOP), with more collectives queued behind it: the data plane fails the waiting call
    and every later one at once, and stays allocated until the workers are gone (issue 12,
    exit without races). The agent exits 0 right after its drain, not after the executor
    wait, and no sanitizer sees a use after free."""
    srv = meshd_server(0, min_agents=2, wait_serving=False)
    a0 = agent(srv.port, "--drain-seconds", "1", rank=0)
    a1 = agent(srv.port, "--drain-seconds", "1", rank=1)
    lib.wait_health(srv.port, lib.TENSOR_SERVICE, lib.SERVING(), timeout=lib.REGISTER_TIMEOUT,
                    log=srv.log)
    s = lib.Session(srv.port, "exit-race")
    m = s.mesh(gpu=2).ref
    x = s.tensor(m, (1024,)).ref
    s.run(lib.sync(), timeout=30)
    os.kill(a1.pid, signal.SIGSTOP)
    try:
        stop_by = time.monotonic() + 10
        while not lib.all_threads_stopped(a1.pid) and time.monotonic() < stop_by:
            time.sleep(0.01)
        for _ in range(3):   # accepted at once: the server never waits for agents
            s.run(lib.reduce(s.new_ref(), x, dims=["gpu"], reduction="sum"))
        time.sleep(0.5)      # rank 0's worker now waits for rank 1 in the first one
        t0 = time.monotonic()
        a0.signal(signal.SIGTERM)
        rc = a0.proc.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        os.kill(a1.pid, signal.SIGKILL)
    assert rc == 0, lib.log_tail(a0.log)
    assert took < 1 + 3.0, f"the agent took {took:.1f} s to exit after a 1 s drain"
    assert lib.sanitizer_report(a0.log) is None, lib.log_tail(a0.log)


def test_local_agents_do_not_take_the_servers_outputs_from_its_environment(meshd_server,
                                                                           tmp_path):
    """Every flag is also a MESHD_* variable, which local agents inherit: the server's
    MESHD_PORT_FILE and MESHD_HEALTH_LISTEN are its own. The agents neither write its
    port file nor bind its health port (they exited and were restarted forever, and the
    port file held an agent's port)."""
    stray = tmp_path / "stray.port"
    hport = lib.free_port()
    srv = meshd_server(2, env={"MESHD_PORT_FILE": str(stray),
                               "MESHD_HEALTH_LISTEN": f"127.0.0.1:{hport}"})
    lib.wait_ready(srv, 2)
    # (the harness's --port-file wins for the server itself)
    assert not stray.exists(), f"an agent wrote {stray.read_text()!r} into the server's port file"
    kids = lib.agent_children(srv.pid)
    time.sleep(1.0)
    assert lib.agent_children(srv.pid) == kids, "agents were restarted"
    assert lib.health_check(hport, "") == lib.SERVING()  # the server's, on its port
