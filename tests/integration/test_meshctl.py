"""meshctl against a real meshd (docs/operations.md, "meshctl").

health exit codes as grpc_health_probe: 0 SERVING, 2 connection failed,
3 RPC failed (NOT_FOUND for an unknown service), 4 not serving.
"""

import json
import os
import re
import signal
import subprocess
import time

import pytest

import meshd_testlib as lib


def meshctl(server, *args, env=None, timeout_ms=3000):
    pre = ["--server", server] if server else []
    return lib.run(lib.MESHCTL, pre + ["--timeout-ms", str(timeout_ms)] + list(args), env=env,
                   timeout=30)


def _show(r):
    return f"rc={r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"


# Most tests share the module's servers (conftest.py's shared_meshd; sessions keep them
# apart): shared_meshd(2) with two local agents, and this one without agents, whose
# TensorService is NOT_SERVING (--min-agents 3) while the process is SERVING.
def no_agents_server(shared_meshd):
    return shared_meshd(0, "--min-agents", "3")


def test_health_serving_exit_0(shared_meshd):
    srv = shared_meshd(2)
    r = meshctl(srv.address, "health")
    assert r.returncode == 0, _show(r)
    assert "SERVING" in r.stdout, _show(r)


def test_health_default_service_is_process(shared_meshd):
    srv = shared_meshd(2)
    r = meshctl(srv.address, "health", "")
    assert r.returncode == 0, _show(r)


def test_a_server_slow_to_answer_the_handshake_is_reached(shared_meshd):
    # Each connection attempt of the C client had 100 ms (gRPC's minimum connect
    # timeout, set for the agents' fast reconnects): a server whose first bytes
    # take longer (TLS on a busy host, a far region) was "cannot connect" at once.
    srv = shared_meshd(2)
    link = lib.DelayRelay(srv.port, 0, 0.3)  # the server's bytes come 0.3 s late
    try:
        t0 = time.monotonic()
        r = meshctl(link.address, "health", timeout_ms=10000)
        took = time.monotonic() - t0
        assert r.returncode == 0 and "SERVING" in r.stdout, _show(r)
        assert took < 8, f"{took:.1f} s through a link 0.3 s slow"
        # A refused port still fails at once (fail fast), not after --timeout-ms.
        t0 = time.monotonic()
        r = meshctl(f"127.0.0.1:{lib.free_port()}", "health", timeout_ms=10000)
        assert r.returncode == 2 and "cannot connect" in r.stderr, _show(r)
        assert time.monotonic() - t0 < 5, "a refused port waited for --timeout-ms"
    finally:
        link.close()


def test_health_connection_failed_exit_2():
    r = meshctl(f"127.0.0.1:{lib.free_port()}", "health", timeout_ms=2000)
    assert r.returncode == 2, _show(r)


def test_health_unknown_service_exit_3(shared_meshd):
    srv = shared_meshd(2)
    r = meshctl(srv.address, "health", "no.such.Service")
    assert r.returncode == 3, _show(r)


def test_health_not_serving_exit_4(shared_meshd):
    srv = no_agents_server(shared_meshd)
    r = meshctl(srv.address, "health", lib.TENSOR_SERVICE)
    assert r.returncode == 4, _show(r)
    assert "NOT_SERVING" in r.stdout, _show(r)


def test_health_tensor_service_serving_with_agents(shared_meshd):
    srv = shared_meshd(2)  # SERVING with ranks 0 and 1 healthy
    r = meshctl(srv.address, "health", lib.TENSOR_SERVICE)
    assert r.returncode == 0, _show(r)


def test_server_from_env(shared_meshd):
    srv = shared_meshd(2)
    r = meshctl(None, "health", env={"MESHD_SERVER": srv.address})
    assert r.returncode == 0, _show(r)


def test_agent_health_with_meshctl(shared_meshd):
    srv = shared_meshd(2)
    address = lib.list_agents(srv.port)[0].address  # a local agent's own port
    r = meshctl(address, "health", lib.AGENT_SERVICE)
    assert r.returncode == 0, _show(r)


def test_agents_lists_two_ranks(shared_meshd):
    srv = shared_meshd(2)  # ranks 0 and 1 healthy
    r = meshctl(srv.address, "agents")
    assert r.returncode == 0, _show(r)
    rows = [line.split() for line in r.stdout.splitlines()
            if re.match(r"^\s*\d+\s", line)]
    assert len(rows) == 2, _show(r)
    assert sorted(int(row[0]) for row in rows) == [0, 1], _show(r)
    head = r.stdout.splitlines()[0].split()
    assert head[head.index("DRAINED") + 1] == "TLS", _show(r)
    for row in rows:
        assert any(col.startswith("127.0.0.1:") for col in row), _show(r)
        assert "cpu" in row, _show(r)
        assert row[head.index("TLS")] == "-", _show(r)  # plaintext agents


def test_agents_tls_cell_is_never_blank():
    """A server that sends the agents' CA but no server name (`--cluster-name ""`, or an
    older server) left the TLS cell blank, the columns after it shifted; it says `on`
    (a direct-path client checks the agent's address), `-` in plaintext."""
    t = lib.tensor_pb2()
    agent = t.AgentInfo(rank=0, healthy=True, address="127.0.0.1:9000", device="cpu",
                        version="9.9.9")
    tls = {"v": t.AgentTls(ca_pem="-----BEGIN CERTIFICATE-----\n", server_name="")}

    def list_agents(request, context):
        return t.ListAgentsReply(agents=[agent], agent_tls=tls["v"])

    server, port = lib.fake_tensor_service(ListAgents=(list_agents, t.ListAgentsRequest))
    try:
        for v, cell in ((tls["v"], "on"), (t.AgentTls(), "-"),
                        (t.AgentTls(ca_pem="x", server_name="meshd-cluster"), "meshd-cluster")):
            tls["v"] = v
            r = meshctl(f"127.0.0.1:{port}", "agents")
            assert r.returncode == 0, _show(r)
            head, row = r.stdout.splitlines()
            cols = dict(zip(head.split(), row.split()))
            assert cols["TLS"] == cell and cols["VERSION"] == "9.9.9", _show(r)
    finally:
        server.stop(0)


# ------------------------------------------------- TLS, mTLS and bearer tokens
# One server of each kind for the tests below: plaintext with tokens and 2 agents (a
# script computes), TLS with tokens and mTLS with tokens (no agents: local agents
# register on the client port, which they cannot do over TLS yet).

ALICE = "alice-7f3e9a0c5d1b2468"
BOB = "bob-0c5d1b24687f3e9a"
WRONG = "mallory-5d1b24687f3e9a0c"
SCRIPT = "mesh m gpu=2\nx = ones m 2 3\ny = add x 1.5\nz = reduce y gpu sum\nfetch z gpu=1\nsync\n"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """{"pki", "tokens", "plain", "tls", "mtls"}: the PKI folder, the tokens file, and
    the addresses of the three servers."""
    tmp = tmp_path_factory.mktemp("meshctl-auth")
    pki = lib.make_pki(tmp / "pki")
    tokens = tmp / "tokens"
    tokens.write_text(f"alice {ALICE}\nbob {BOB}\n")
    tls = ["--tls-cert", pki / "server.pem", "--tls-key", pki / "server.key", "--min-agents", 0]
    procs = {}
    try:
        for name, n, flags in (("plain", 2, []), ("tls", 0, tls),
                               ("mtls", 0, tls + ["--tls-client-ca", pki / "ca.pem"])):
            args = ["--listen", "127.0.0.1:0", "--local-agents", n, "--auth-tokens", tokens] + flags
            procs[name] = lib.spawn(f"meshd-{name}", lib.MESHD, [str(a) for a in args], str(tmp))
        lib.wait_health(procs["plain"].port, lib.TENSOR_SERVICE, lib.SERVING(),  # agents up
                        timeout=lib.REGISTER_TIMEOUT, proc=procs["plain"].proc, log=procs["plain"].log)
        yield {"pki": pki, "tokens": tokens,
               **{k: f"127.0.0.1:{p.port}" for k, p in procs.items()}}
    finally:
        for p in procs.values():
            lib.stop(p)
    for p in procs.values():
        hit = lib.sanitizer_report(p.log)
        assert not hit, hit
        with open(p.log, errors="replace") as f:
            log = f.read()
        assert ALICE not in log and BOB not in log and WRONG not in log, p.log


def test_token_script_and_tables(secured, tmp_path):
    script = tmp_path / "s.txt"
    script.write_text(SCRIPT)
    r = meshctl(secured["plain"], "--token", ALICE, "run", str(script), timeout_ms=20000)
    assert r.returncode == 0, _show(r)
    assert r.stdout == "z [2,3] 5 5 5 5 5 5\n", _show(r)
    r = meshctl(secured["plain"], "agents", env={"MESHD_TOKEN": BOB})
    assert r.returncode == 0 and len(re.findall(r"(?m)^\d+\s+127\.0\.0\.1:", r.stdout)) == 2, _show(r)
    token_file = tmp_path / "token"
    token_file.write_text(ALICE + "\n")
    r = meshctl(secured["plain"], "--token-file", str(token_file), "sessions")
    assert r.returncode == 0, _show(r)
    r = meshctl(secured["plain"], "sessions", env={"MESHD_TOKEN_FILE": str(token_file)})
    assert r.returncode == 0, _show(r)


@pytest.mark.parametrize("args,env", [
    ((), None), (("--token", WRONG), None), ((), {"MESHD_TOKEN": WRONG}),
    (("--token", ALICE.upper()), None)])
def test_no_or_a_wrong_token_is_unauthenticated(secured, args, env):
    r = meshctl(secured["plain"], *args, "sessions", env=env)
    assert r.returncode == 3, _show(r)
    assert "UNAUTHENTICATED" in r.stderr, _show(r)
    assert WRONG not in r.stderr + r.stdout and ALICE.upper() not in r.stderr, _show(r)
    r = meshctl(secured["plain"], *args, "health", env=env)  # health needs no token
    assert r.returncode == 0, _show(r)


def test_tls_with_a_token(secured):
    pki = secured["pki"]
    ca = str(pki / "ca.pem")
    r = meshctl(secured["tls"], "--tls-ca", ca, "--token", ALICE, "sessions")
    assert r.returncode == 0, _show(r)
    r = meshctl(secured["tls"], "sessions", env={"MESHD_TLS_CA": ca, "MESHD_TOKEN": BOB})
    assert r.returncode == 0, _show(r)
    r = meshctl(secured["tls"], "--tls-ca", ca, "--tls-server-name", "localhost", "--token", ALICE,
                "health")
    assert r.returncode == 0 and "SERVING" in r.stdout, _show(r)
    r = meshctl(secured["tls"], "--tls-ca", ca, "--token", WRONG, "sessions")
    assert r.returncode == 3 and "UNAUTHENTICATED" in r.stderr, _show(r)
    # The server's certificate does not carry that name; another CA; no TLS at all: the
    # connection fails (exit 2) before any token is sent.
    for args in (("--tls-ca", ca, "--tls-server-name", "meshd.example"),
                 ("--tls-ca", str(pki / "rogue-ca.pem")), ()):
        r = meshctl(secured["tls"], *args, "--token", ALICE, "sessions", timeout_ms=1000)
        assert r.returncode == 2 and "cannot connect" in r.stderr, _show(r)
        assert "UNAUTHENTICATED" not in r.stderr and ALICE not in r.stderr, _show(r)


def test_mtls_with_and_without_a_client_certificate(secured):
    pki = secured["pki"]
    ca, cert, key = (str(pki / f) for f in ("ca.pem", "client.pem", "client.key"))
    r = meshctl(secured["mtls"], "--tls-ca", ca, "--tls-cert", cert, "--tls-key", key,
                "--token", ALICE, "sessions")
    assert r.returncode == 0, _show(r)
    r = meshctl(secured["mtls"], "sessions",
                env={"MESHD_TLS_CA": ca, "MESHD_TLS_CERT": cert, "MESHD_TLS_KEY": key,
                     "MESHD_TOKEN": ALICE})
    assert r.returncode == 0, _show(r)
    r = meshctl(secured["mtls"], "--tls-ca", ca, "--tls-cert", cert, "--tls-key", key, "sessions")
    assert r.returncode == 3 and "UNAUTHENTICATED" in r.stderr, _show(r)  # a cert is no token
    for args in ((), ("--tls-cert", str(pki / "rogue.pem"), "--tls-key", str(pki / "rogue.key"))):
        r = meshctl(secured["mtls"], "--tls-ca", ca, *args, "--token", ALICE, "sessions",
                    timeout_ms=1000)
        assert r.returncode == 2 and "cannot connect" in r.stderr, _show(r)


def test_token_is_not_sent_in_plaintext_to_a_remote_address(secured):
    for server in ("10.0.0.5:50051", "meshd.example:50051", "[2001:db8::1]:50051"):
        r = meshctl(server, "--token", ALICE, "health")
        assert r.returncode == 64, _show(r)
        assert "refusing to send the token in plaintext" in r.stderr and ALICE not in r.stderr, _show(r)
        r = meshctl(server, "health", env={"MESHD_TOKEN": ALICE})
        assert r.returncode == 64 and "plaintext" in r.stderr, _show(r)


@pytest.mark.parametrize("args,says", [
    (("--token", "two words"), "--token: the token has a character that is not visible ASCII"),
    (("--token", ALICE, "--token-file", "/x"), "--token and --token-file: give one of them"),
    (("--token-file", "/nonexistent"), "--token-file: cannot read /nonexistent"),
    (("--tls-ca", "/nonexistent"), "--tls-ca: cannot read /nonexistent"),
    (("--tls-cert", "CERT"), "--tls-cert needs --tls-key"),
    (("--tls=maybe",), "--tls: 'maybe' is not a boolean"),
])
def test_bad_security_flags_are_usage_errors(secured, args, says):
    args = tuple(str(secured["pki"] / "client.pem") if a == "CERT" else a for a in args)
    r = meshctl("127.0.0.1:1", *args, "health")
    assert r.returncode == 64, _show(r)
    assert says in r.stderr, _show(r)
    assert "two words" not in r.stderr, _show(r)


# ------------------------------------------------- progress of long transfers
# A fetch in a script draws "\rfetch NAME: DONE / TOTAL  P%  R MB/s" on stderr once it ran
# --progress-delay-ms (0 here: every fetch), only when stderr is a terminal; --no-progress
# (or MESHD_NO_PROGRESS) turns it off.

BIG = "mesh m gpu=2\nx = ones m 262144\nfetch x gpu=1\n"  # 1 MiB of float32


def _meshctl_on_pty(srv, *args):
    """meshctl with stderr on a pseudo-terminal: (returncode, stdout, what the terminal got)."""
    master, slave = os.openpty()
    try:
        p = subprocess.Popen([lib.MESHCTL, "--server", srv.address, "--timeout-ms", "20000"]
                             + list(args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=slave, env=lib.clean_env())
        os.close(slave)
        slave = None
        out = p.stdout.read()
        p.wait(30)
        term = b""
        while True:
            try:
                got = os.read(master, 65536)
            except OSError:  # EIO: the child is gone and everything was read
                break
            if not got:
                break
            term += got
        return p.returncode, out.decode(), term.decode(errors="replace")
    finally:
        os.close(master)
        if slave is not None:
            os.close(slave)


def test_fetch_progress_only_on_a_terminal(shared_meshd, tmp_path):
    srv = shared_meshd(2)
    script = tmp_path / "big.txt"
    script.write_text(BIG)
    expected = "x [262144]" + " 1" * 262144 + "\n"

    rc, out, term = _meshctl_on_pty(srv, "--progress-delay-ms", "0", "run", str(script))
    assert rc == 0 and out == expected, term
    assert re.search(r"\rfetch x: .*1\.0MiB / 1\.0MiB 100%  [0-9.]+ MB/s", term), repr(term)
    assert term.endswith("\n"), repr(term)

    for args, env in [(("--no-progress",), None), (("--no-progress=true",), None),
                      ((), {"MESHD_NO_PROGRESS": "1"})]:
        master_args = ("--progress-delay-ms=0",) + args + ("run", str(script))
        if env is None:
            rc, out, term = _meshctl_on_pty(srv, *master_args)
            assert rc == 0 and out == expected and term == "", (args, repr(term))
        r = meshctl(srv.address, *master_args, env=env, timeout_ms=20000)
        assert r.returncode == 0 and r.stdout == expected and r.stderr == "", _show(r)

    r = meshctl(srv.address, "--progress-delay-ms=0", "run", str(script), timeout_ms=20000)
    assert r.returncode == 0 and r.stdout == expected, _show(r)
    assert r.stderr == "", _show(r)  # stderr is a pipe: no progress


@pytest.mark.parametrize("args,says", [
    (("--progress-delay-ms", "-1"), "--progress-delay-ms: -1 is out of range"),
    (("--progress-delay-ms", "soon"), "--progress-delay-ms: 'soon' is not an integer"),
    (("--no-progress=maybe",), "--no-progress: 'maybe' is not a boolean"),
    (("--data-path", "udp"), "--data-path: expected auto, direct or proxy, got 'udp'"),
    (("--server=",), "--server: empty; expected host:port")])
def test_bad_progress_flags_are_usage_errors(args, says):
    r = meshctl("127.0.0.1:1", *args, "health")
    assert r.returncode == 64 and says in r.stderr, _show(r)


def test_a_script_that_cannot_be_opened_is_a_usage_error_before_any_connection():
    """meshctl run with a file that does not exist says so (exit 64, naming the file),
    without a server to connect to: the file is checked before the connection."""
    r = meshctl("127.0.0.1:1", "run", "/nonexistent/steps.txt", timeout_ms=500)
    assert r.returncode == 64, _show(r)
    assert "cannot open /nonexistent/steps.txt" in r.stderr, _show(r)


# ------------------------------------------------- --output json, version, watch, drain
# One shared server with 2 local agents for these (sessions keep the tests apart; the drain
# test puts its rank back).

def _json(r):
    assert r.stdout.count("\n") == 1, _show(r)  # one document, on one line
    return json.loads(r.stdout)


def _version():
    with open(os.path.join(lib.SOURCE_DIR, "VERSION")) as f:
        return f.read().strip()


def test_json_output_of_every_command(shared_meshd, tmp_path):
    srv = shared_meshd(2)
    with lib.Session(srv.port, client_name="json-test") as s:
        r = meshctl(srv.address, "--output", "json", "agents")
        assert r.returncode == 0, _show(r)
        agents = _json(r)["agents"]
        assert sorted(a["rank"] for a in agents) == [0, 1], _show(r)
        for a in agents:
            assert a["healthy"] is True and a["drained"] is False and a["device"] == "cpu", a
            assert a["address"].startswith("127.0.0.1:") and a["memory_bytes"] > 0, a
            assert a["version"] == _version() and a["commit"], a
            assert "tls" in a and a["tls"] is None, a  # plaintext agents (mTLS: test_direct)

        r = meshctl(srv.address, "--output=json", "sessions", env={"MESHD_OUTPUT": "table"})
        assert r.returncode == 0, _show(r)
        row = next(x for x in _json(r)["sessions"] if x["session_id"] == s.id)
        assert row["client_name"] == "json-test" and row["owner"] == "anonymous", row
        for key in ("age_ms", "idle_ms", "live_tensors", "bytes_held", "commands", "state"):
            assert key in row, row

        r = meshctl(srv.address, "health", env={"MESHD_OUTPUT": "json"})
        assert r.returncode == 0 and _json(r) == {"service": "", "status": "SERVING"}, _show(r)

        script = tmp_path / "s.txt"
        script.write_text(SCRIPT)
        r = meshctl(srv.address, "--output", "json", "run", str(script), timeout_ms=20000)
        assert r.returncode == 0, _show(r)
        assert _json(r) == {"results": [{"fetch": "z", "coords": {"gpu": 1}, "shape": [2, 3],
                                         "values": [5.0] * 6}]}, _show(r)
        # Strict JSON: NaN and infinities as strings; a dim named like a field stays apart.
        script.write_text("mesh m values=2\nw = tensor m nan inf -inf 1\nfetch w values=0\n")
        r = meshctl(srv.address, "--output", "json", "run", str(script), timeout_ms=20000)
        assert r.returncode == 0, _show(r)
        doc = json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"{c} in {r.stdout}"))
        assert doc == {"results": [{"fetch": "w", "coords": {"values": 0}, "shape": [4],
                                    "values": ["NaN", "Infinity", "-Infinity", 1.0]}]}, doc
        script.write_text("mesh m gpu=2\nw = tensor m 1e300\n")
        r = meshctl(srv.address, "--output", "json", "run", str(script), timeout_ms=20000)
        assert r.returncode == 3 and "outside float32's range" in _json(r)["error"]["message"], \
            _show(r)
        script.write_text("mesh m gpu=2\nx = nosuchop m\n")
        r = meshctl(srv.address, "--output", "json", "run", str(script), timeout_ms=20000)
        assert r.returncode == 3, _show(r)
        err = _json(r)["error"]
        assert err["line"] == 2 and err["code"] == "NOT_FOUND" and "nosuchop" in err["message"], r

        r = meshctl(srv.address, "--output", "json", "version")
        assert r.returncode == 0, _show(r)
        v = _json(r)
        assert v["client"]["version"] == v["server"]["version"] == _version(), v
        assert v["server"]["uptime_ms"] > 0 and v["server"]["address"] == srv.address, v
        assert sorted(a["rank"] for a in v["agents"]) == [0, 1], v
        assert all(a["version"] == _version() and a["commit"] == v["server"]["commit"]
                   for a in v["agents"]), v
        r = meshctl(srv.address, "version")
        assert r.returncode == 0, _show(r)
        assert re.match(rf"meshctl {re.escape(_version())} \(commit \S+, \S+, cuda backend: "
                        r"(yes|no)\)\nmeshd ", r.stdout), _show(r)
        assert len(re.findall(r"(?m)^rank [01]: meshd-agent ", r.stdout)) == 2, _show(r)

    r = meshctl(None, "--version")  # no server needed
    assert r.returncode == 0 and r.stdout.startswith(f"meshctl {_version()} (commit "), _show(r)
    r = meshctl(None, "--output", "json", "--version")
    assert r.returncode == 0 and _json(r)["client"]["version"] == _version(), _show(r)

    for args in (("--output", "yaml", "agents"), ("--output=", "health"), ("--output", "yaml")):
        r = meshctl(srv.address, *args)
        assert r.returncode == 64 and r.stdout == "", _show(r)
        assert "is not an output format (expected json or table)" in r.stderr, _show(r)
    r = meshctl(srv.address, "agents", env={"MESHD_OUTPUT": "yaml"})
    assert r.returncode == 64 and "MESHD_OUTPUT: 'yaml'" in r.stderr, _show(r)
    r = meshctl(srv.address, "--output", "json", "nosuchcommand")
    assert r.returncode == 64 and _json(r)["error"]["code"] == "USAGE", _show(r)


def test_a_refused_port_fails_at_once():
    port = lib.free_port()  # nothing listens there
    for fmt in ("table", "json"):
        t0 = time.monotonic()
        r = meshctl(f"127.0.0.1:{port}", "--output", fmt, "agents", timeout_ms=30000)
        took = time.monotonic() - t0
        assert r.returncode == 2 and "cannot connect" in r.stderr, _show(r)
        assert took < 3.0, f"{took:.1f} s for a refused port with --timeout-ms 30000"
        if fmt == "json":
            assert _json(r)["error"]["code"] == "UNAVAILABLE", _show(r)


@pytest.mark.parametrize("cmd", ["drain", "undrain"])
def test_a_bad_rank_is_a_usage_error_before_any_connection(cmd):
    # A mistyped RANK is the operator's mistake whatever the server: exit 64 naming
    # it, at once, as for load's flags and run's script; not "cannot connect"
    # (exit 2) after the connection attempt, which sends them looking at the network.
    port = lib.free_port()  # nothing listens there
    for fmt in ("table", "json"):
        t0 = time.monotonic()
        r = meshctl(f"127.0.0.1:{port}", "--output", fmt, cmd, "x3", timeout_ms=30000)
        took = time.monotonic() - t0
        assert r.returncode == 64 and "RANK 'x3' is not a rank" in r.stderr, _show(r)
        assert "cannot connect" not in r.stderr, _show(r)
        assert took < 3.0, f"{took:.1f} s for a usage error"
        if fmt == "json":
            assert _json(r)["error"]["code"] == "USAGE", _show(r)


def test_a_server_that_accepts_but_never_answers_is_not_called_absent(shared_meshd):
    # A hung or stopped meshd (SIGSTOP, a paused container): the kernel still
    # accepts its connections, nothing answers. meshctl gives up after --timeout-ms
    # (exit 2), and must not send the operator looking for a process that is not
    # running ("nothing listens there"). The module's server without agents (no
    # agent's link to it is stalled by the stop); it goes on after SIGCONT.
    srv = no_agents_server(shared_meshd)
    os.kill(srv.pid, signal.SIGSTOP)
    try:
        for fmt in ("table", "json"):
            t0 = time.monotonic()
            r = meshctl(srv.address, "--output", fmt, "health", timeout_ms=1500)
            took = time.monotonic() - t0
            assert r.returncode == 2 and "cannot connect" in r.stderr, _show(r)
            assert took < 10, f"{took:.1f} s with --timeout-ms 1500"
            assert "nothing listens" not in r.stderr, _show(r)
            assert "within 1500 ms" in r.stderr, _show(r)
            if fmt == "json":
                err = _json(r)["error"]
                assert err["code"] == "UNAVAILABLE" and "within 1500 ms" in err["message"], r
    finally:
        os.kill(srv.pid, signal.SIGCONT)
    r = meshctl(srv.address, "health")
    assert r.returncode == 0, _show(r)


def test_sessions_watch_frames_and_rates(shared_meshd):
    srv = shared_meshd(2)
    with lib.Session(srv.port, client_name="watched") as s:
        mesh = s.new_ref()
        s.run(lib.create_mesh(mesh, gpu=2))
        p = subprocess.Popen([lib.MESHCTL, "--server", srv.address, "--output", "json", "sessions",
                              "--watch", "--interval", "1", "--count", "2"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=lib.clean_env())
        try:
            first = json.loads(p.stdout.readline())
            # Ten commands between the two frames.
            s.submit([s.command(lib.factory(s.new_ref(), mesh, "ones", [4])) for _ in range(10)])
            second = json.loads(p.stdout.readline())
            rest = p.stdout.read()
            assert p.wait(10) == 0, p.stderr.read()
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert rest == "", rest
        assert (first["frame"], second["frame"]) == (1, 2)
        row1 = next(x for x in first["sessions"] if x["session_id"] == s.id)
        row2 = next(x for x in second["sessions"] if x["session_id"] == s.id)
        assert "commands_per_s" not in row1, row1
        # All ten ran before frame 2 unless the machine is very slow: then some of them.
        ran = row2["commands"] - row1["commands"]
        assert row1["commands"] == 1 and 0 < ran <= 10, (row1, row2)
        assert 0 < row2["commands_per_s"] <= ran / 0.5, row2
        if ran == 10:  # memory: ten tensors of 4 float32 on 2 ranks
            assert row2["live_tensors"] == 10 and row2["bytes_held"] == 10 * 2 * 16, row2
        assert row2["age_ms"] > row1["age_ms"], (row1, row2)

        # Not a terminal: frames one after another, a blank line between them.
        r = meshctl(srv.address, "sessions", "--watch", "--interval", "0.1", "--count", "2")
        assert r.returncode == 0, _show(r)
        frames = r.stdout.split("\n\n")
        assert len(frames) == 2 and "\033[" not in r.stdout, _show(r)
        for f in frames:
            lines = f.strip().splitlines()
            assert lines[0].startswith(f"meshd {srv.address} ") and lines[1].startswith("SESSION"), f
            assert any(line.startswith(s.id[:12]) and "watched" in line for line in lines), f

    # Without --count it runs until Ctrl-C, which ends it with exit 0.
    p = subprocess.Popen([lib.MESHCTL, "--server", srv.address, "--output", "json", "sessions",
                          "--watch", "--interval", "0.1"], stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=lib.clean_env())
    try:
        assert json.loads(p.stdout.readline())["frame"] == 1
        p.send_signal(signal.SIGINT)
        assert p.wait(10) == 0, p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()

    for args in (("agents", "--watch"), ("sessions", "--count", "2"),
                 ("sessions", "--watch", "--interval", "0")):
        r = meshctl(srv.address, *args)
        assert r.returncode == 64, _show(r)


def test_drain_keeps_new_sessions_off_a_rank(shared_meshd, secured):
    srv = shared_meshd(2)
    old = lib.Session(srv.port, client_name="before-drain")
    try:
        r = meshctl(srv.address, "drain", "0")
        assert r.returncode == 0 and "rank 0 drained" in r.stdout, _show(r)
        r = meshctl(srv.address, "--output", "json", "agents")
        assert {a["rank"]: a["drained"] for a in _json(r)["agents"]} == {0: True, 1: False}, r
        r = meshctl(srv.address, "agents")
        assert re.search(r"(?m)^0 .* yes +yes +- +\S+$", r.stdout), _show(r)

        with lib.Session(srv.port, client_name="after-drain") as new:
            res = new.run(lib.create_mesh(new.new_ref(), gpu=1))
            assert list(res.mesh.ranks) == [1], res
            err = new.fails("QUOTA", lib.create_mesh(new.new_ref(), gpu=2))
            assert "rank 0 is drained" in err.message, err.message
        # The session from before the drain keeps rank 0, and it still computes.
        mesh = old.new_ref()
        assert list(old.run(lib.create_mesh(mesh, gpu=2)).mesh.ranks) == [0, 1]
        x = old.new_ref()
        old.run(lib.factory(x, mesh, "ones", [3]))
        old.run(lib.sync())

        r = meshctl(srv.address, "--output", "json", "undrain", "0")
        doc = _json(r)
        assert r.returncode == 0 and doc["rank"] == 0 and doc["drained"] is False, _show(r)
        assert doc["agent"]["rank"] == 0 and doc["agent"]["drained"] is False, _show(r)
        with lib.Session(srv.port, client_name="after-undrain") as new:
            assert list(new.run(lib.create_mesh(new.new_ref(), gpu=1)).mesh.ranks) == [0]
    finally:
        meshctl(srv.address, "undrain", "0")
        old.shut()

    r = meshctl(srv.address, "--output", "json", "drain", "9")
    assert r.returncode == 3, _show(r)
    err = _json(r)["error"]
    assert err["code"] == "NOT_FOUND" and "rank 9 has no agent" in err["message"], err
    r = meshctl(srv.address, "drain", "-1")
    assert r.returncode == 64 and "RANK '-1' is not a rank" in r.stderr, _show(r)
    r = meshctl(srv.address, "drain")
    assert r.returncode == 64 and "drain: missing RANK" in r.stderr, _show(r)
    # Only admin principals drain: alice is not one.
    r = meshctl(secured["plain"], "--token", ALICE, "drain", "0")
    assert r.returncode == 3 and "PERMISSION_DENIED" in r.stderr, _show(r)
    assert "not an admin" in r.stderr, _show(r)
    r = meshctl(secured["plain"], "--token", ALICE, "--output", "json", "agents")
    assert not any(a["drained"] for a in _json(r)["agents"]), _show(r)


def test_progress_true_forces_the_line_and_false_hides_it(shared_meshd, tmp_path):
    srv = shared_meshd(2)
    script = tmp_path / "big.txt"
    script.write_text(BIG)
    r = meshctl(srv.address, "--progress=true", "--progress-delay-ms", "0", "run", str(script),
                timeout_ms=20000)
    assert r.returncode == 0, _show(r)
    assert re.search(r"(?m)^fetch x: .*1\.0MiB / 1\.0MiB 100%  [0-9.]+ MB/s$", r.stderr), r.stderr
    r = meshctl(srv.address, "--progress-delay-ms", "0", "run", str(script), timeout_ms=20000,
                env={"MESHD_PROGRESS": "true"})
    assert r.returncode == 0 and "fetch x:" in r.stderr, _show(r)
    rc, out, term = _meshctl_on_pty(srv, "--progress=false", "--progress-delay-ms=0", "run",
                                    str(script))
    assert rc == 0 and out.startswith("x [262144] 1 1") and term == "", repr(term)
    r = meshctl(srv.address, "--progress=maybe", "health")
    assert r.returncode == 64 and "--progress: 'maybe' is not a boolean" in r.stderr, _show(r)


# ------------------------------------------------- load: the agents fetch a tensor from a URL
# `meshctl load URL` and the script's `NAME = load MESH URL ...` (docs/operations.md), against
# files served over HTTP with Range requests (lib.HttpFiles) to the shared 2-agent server,
# whose default --url-allow admits loopback http.

@pytest.fixture(scope="module")
def load_files(tmp_path_factory):
    """An HTTP server over a folder holding a .npy file, a safetensors checkpoint, raw bytes
    and 2 MiB of raw float32 (served slowly under /trickle/); yields (HttpFiles, arrays)."""
    import numpy as np
    root = tmp_path_factory.mktemp("meshctl-load")
    arrays = {"x.npy": np.arange(6, dtype=np.float32).reshape(2, 3),
              "wte": np.arange(32, dtype=np.int16).reshape(4, 8),
              "bias": np.ones(5, dtype=np.float64),
              "raw.bin": np.arange(12, dtype=np.int32),
              "two.bin": np.zeros(1 << 19, dtype=np.float32)}
    np.save(root / "x.npy", arrays["x.npy"])
    (root / "model.safetensors").write_bytes(
        lib.safetensors_bytes({"wte": arrays["wte"], "bias": arrays["bias"]}))
    (root / "raw.bin").write_bytes(arrays["raw.bin"].tobytes())
    (root / "two.bin").write_bytes(arrays["two.bin"].tobytes())
    (root / "empty.bin").write_bytes(b"")
    with lib.HttpFiles(root) as files:
        yield files, arrays


def test_load_prints_what_every_rank_holds(shared_meshd, load_files):
    srv = shared_meshd(2)
    files, a = load_files
    x = a["x.npy"]
    r = meshctl(srv.address, "load", files.url("x.npy"))
    assert r.returncode == 0 and r.stderr == "", _show(r)
    head, row = r.stdout.splitlines()
    assert head.split() == ["REF", "DTYPE", "SHAPE", "BYTES", "RANKS", "FETCHED", "SECONDS",
                            "MB/S", "URL"], _show(r)
    cols = row.split()
    assert cols[1:6] == ["float32", "[2,3]", f"{x.nbytes}B", "2", f"{2 * x.nbytes}B"], _show(r)
    assert float(cols[6]) > 0 and cols[8] == files.url("x.npy"), _show(r)

    r = meshctl(srv.address, "--output", "json", "load", files.url("x.npy"))
    assert r.returncode == 0, _show(r)
    doc = _json(r)
    assert doc["dtype"] == "float32" and doc["shape"] == list(x.shape), doc
    assert doc["bytes"] == x.nbytes and doc["ranks"] == 2 and doc["mesh"] == {"gpu": 2}, doc
    assert doc["fetched_bytes"] == 2 * x.nbytes and doc["url"] == files.url("x.npy"), doc
    assert doc["seconds"] > 0 and doc["mb_per_s"] == pytest.approx(
        doc["fetched_bytes"] / doc["seconds"] / 1e6, rel=1e-6), doc

    # one tensor of a checkpoint, split over the mesh; raw bytes with their dtype and shape
    wte = a["wte"]
    r = meshctl(srv.address, "--output", "json", "load", files.url("model.safetensors"),
                "--name", "wte", "--shard", "gpu", "--dim", "1")
    doc = _json(r)
    assert r.returncode == 0 and doc["dtype"] == "int16" and doc["shape"] == [4, 4], _show(r)
    assert doc["bytes"] == wte.nbytes // 2 and doc["fetched_bytes"] == wte.nbytes, doc
    r = meshctl(srv.address, "--output", "json", "load", files.url("raw.bin"), "--dtype",
                "int32", "--shape", "3,4", "--mesh", "gpu=1")
    doc = _json(r)
    assert r.returncode == 0 and doc["shape"] == [3, 4] and doc["ranks"] == 1, _show(r)
    assert doc["bytes"] == a["raw.bin"].nbytes and doc["mesh"] == {"gpu": 1}, doc


def test_load_without_a_mesh_takes_the_longest_run_of_usable_ranks(meshd_server, load_files):
    """Without --mesh, load makes a mesh of consecutive usable ranks: with rank 1 of 3
    drained, one rank (0 or 2), not two (no two consecutive ones are usable)."""
    srv = lib.wait_ready(meshd_server(3), 3)
    files, a = load_files
    addr = f"127.0.0.1:{srv.port}"
    r = meshctl(addr, "drain", "1")
    assert r.returncode == 0, _show(r)
    r = meshctl(addr, "--output", "json", "load", files.url("x.npy"))
    assert r.returncode == 0, _show(r)
    doc = _json(r)
    assert doc["mesh"] == {"gpu": 1} and doc["ranks"] == 1, doc


def test_load_progress_line_forced_and_hidden(shared_meshd, load_files, tmp_path):
    srv = shared_meshd(2)
    files, a = load_files
    # 2 MiB a rank at about 3 MB/s: the agents are still fetching at the first looks
    r = meshctl(srv.address, "--progress", "--progress-delay-ms", "0", "load",
                files.url("trickle/two.bin"), "--dtype", "float32", "--shape", str(1 << 19),
                timeout_ms=20000)
    assert r.returncode == 0, _show(r)
    lines = r.stderr.split("\n")  # lib.run reads "\r" as a line end
    seen = [int(m.group(1)) for m in (re.match(r"load two\.bin: .* +(\d+)%  [0-9.]+ MB/s$", ln)
                                      for ln in lines) if m]
    assert seen and seen[-1] == 100 and any(p < 100 for p in seen), repr(r.stderr)
    assert seen == sorted(seen), repr(r.stderr)
    assert re.search(r"\nload two\.bin: 4\.0MiB / 4\.0MiB 100%  [0-9.]+ MB/s\n$", r.stderr), \
        repr(r.stderr)
    assert r.stdout.count("\n") == 2, _show(r)  # the summary stays on stdout

    # a script's load line draws its own, named after what it binds
    script = tmp_path / "load.txt"
    script.write_text(f"mesh m gpu=2\nw = load m {files.url('x.npy')}\ny = add w 1\n"
                      f"fetch y gpu=1\n")
    r = meshctl(srv.address, "--progress", "--progress-delay-ms", "0", "run", str(script))
    assert r.returncode == 0 and r.stdout == "y [2,3] 1 2 3 4 5 6\n", _show(r)
    assert re.search(r"(?m)^load w: 48B / 48B 100%  [0-9.]+ MB/s$", r.stderr), repr(r.stderr)

    # --no-progress: nothing even on a terminal; without it the terminal gets the line
    args = ("--progress-delay-ms=0", "load", files.url("x.npy"))
    rc, out, term = _meshctl_on_pty(srv, "--no-progress", *args)
    assert rc == 0 and "float32" in out and term == "", repr(term)
    rc, out, term = _meshctl_on_pty(srv, *args)
    assert rc == 0 and "load x.npy: 48B / 48B 100%" in term, repr(term)


def test_progress_of_an_empty_tensor_says_done_not_0_of_0(shared_meshd, load_files, tmp_path):
    """A load or fetch of a tensor with no bytes drew `0B / 0B 100%`; it says `0B  done`."""
    srv = shared_meshd(2)
    files, _ = load_files
    script = tmp_path / "empty.txt"
    script.write_text(f"mesh m gpu=2\ne = load m {files.url('empty.bin')} dtype=float32 shape=0\n"
                      f"fetch e gpu=0\n")
    r = meshctl(srv.address, "--progress", "--progress-delay-ms", "0", "run", str(script))
    assert r.returncode == 0 and r.stdout == "e [0]\n", _show(r)
    assert "0B / 0B" not in r.stderr, repr(r.stderr)
    assert re.search(r"(?m)^load e: 0B  done$", r.stderr), repr(r.stderr)
    assert re.search(r"(?m)^fetch e: 0B  done$", r.stderr), repr(r.stderr)


def _fake_load_server(shape, progress, hang_load=None):
    """A TensorService that takes a session, a mesh and a load of a float32 tensor of
    `shape` (what the server says, however large), answers LoadProgress with the
    (done, total) pairs of `progress` in turn (the last one again after them), and
    Syncs. hang_load: an Event the Load's Execute sets, then waits up to 10 s.
    (server, port)."""
    import threading
    t = lib.tensor_pb2()
    looks = iter(progress)
    last = [progress[-1]]

    def create_session(request, context):
        return t.CreateSessionReply(session_id="fake", token="fake-token", ttl_seconds=300)

    def execute(request, context):
        kind = request.WhichOneof("kind")
        if kind == "create_mesh":
            return t.CommandResult(seq=request.seq, mesh=t.MeshMeta(ref=1, ranks=[0, 1]))
        if kind == "load":
            if hang_load is not None:
                hang_load.set()
                threading.Event().wait(10)
            return t.CommandResult(seq=request.seq, tensors=[t.TensorMeta(
                ref=2, shape=shape, dtype=t.DTYPE_FLOAT32, mesh=1)])
        return t.CommandResult(seq=request.seq)

    def load_progress(request, context):
        done, total = next(looks, last[0])
        return t.LoadProgressReply(loads=[t.LoadProgress(ref=r, done_bytes=done,
                                                         total_bytes=total)
                                          for r in request.refs])

    return lib.fake_tensor_service(
        CreateSession=(create_session, t.CreateSessionRequest),
        CloseSession=(lambda rq, ctx: t.CloseSessionReply(), t.CloseSessionRequest),
        KeepAlive=(lambda rq, ctx: t.KeepAliveReply(ttl_seconds=300), t.KeepAliveRequest),
        Execute=(execute, t.Command),
        LoadProgress=(load_progress, t.LoadProgressRequest))


def test_load_figures_a_server_sends_past_2_64_do_not_wrap():
    """A server's shape sizes the load (BYTES, FETCHED) and its LoadProgress the line:
    [2^61] float32 on 2 ranks is 2^64 bytes, which wrapped FETCHED to 0B, and done
    past 2^64 / 100 wrapped the percentage (done * 100); [2^62] wrapped BYTES to 0.
    Capped at 2^64 - 1 and computed in floating point: 16.0EiB and 33%."""
    big = (1 << 64) - 1
    shape = [1 << 61]
    server, port = _fake_load_server(shape, [(big // 3, big), (big, big)])
    try:
        r = meshctl(f"127.0.0.1:{port}", "--progress", "--progress-delay-ms", "0", "load",
                    "http://127.0.0.1:1/w.bin", "--dtype", "float32", "--shape", str(1 << 61),
                    "--mesh", "gpu=2")
        assert r.returncode == 0, _show(r)
        head, row = r.stdout.splitlines()
        cols = dict(zip(head.split(), row.split()))
        assert cols["BYTES"] == "8.0EiB" and cols["FETCHED"] == "16.0EiB", _show(r)
        assert re.search(r"(?m)^load w\.bin: 5\.3EiB / 16\.0EiB  33%", r.stderr), repr(r.stderr)
        assert len(re.findall(r"(?m)^load w\.bin: 16\.0EiB / 16\.0EiB 100%", r.stderr)) == 1, \
            repr(r.stderr)  # once: the last look's line was drawn again after the Sync
        r = meshctl(f"127.0.0.1:{port}", "--output", "json", "load", "http://127.0.0.1:1/w.bin",
                    "--dtype", "float32", "--shape", str(1 << 61), "--mesh", "gpu=2")
        doc = _json(r)
        assert r.returncode == 0 and doc["bytes"] == 1 << 63 and doc["fetched_bytes"] == big, doc
        shape[0] = 1 << 62  # one rank's bytes past 2^64 (the client's product wrapped to 0)
        r = meshctl(f"127.0.0.1:{port}", "--output", "json", "load", "http://127.0.0.1:1/w.bin",
                    "--dtype", "float32", "--shape", str(1 << 62), "--mesh", "gpu=2")
        doc = _json(r)
        assert r.returncode == 0 and doc["bytes"] == big and doc["fetched_bytes"] == big, doc
    finally:
        server.stop(0)


def test_a_second_ctrl_c_ends_run_while_a_load_does_not_answer(tmp_path):
    """Ctrl-C during a `run` script's load whose Execute the server does not answer:
    the first stops the script at the call's end; a second was swallowed (the load's
    handler, then run's own) and meshctl waited out --timeout-ms. The second ends it
    at once: a line, exit 130."""
    import threading
    at_load = threading.Event()
    server, port = _fake_load_server([4], [(16, 16)], hang_load=at_load)
    script = tmp_path / "s.txt"
    script.write_text("mesh m gpu=2\nx = load m http://127.0.0.1:1/w.bin dtype=float32 shape=4\n")
    p = subprocess.Popen([lib.MESHCTL, "--server", f"127.0.0.1:{port}", "--timeout-ms", "20000",
                          "run", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=lib.clean_env(None))
    try:
        assert at_load.wait(10), p.poll()
        p.send_signal(signal.SIGINT)
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(0.3)  # the first waits for the call (at most --timeout-ms)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=5)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        server.stop(0)
    assert p.returncode == 130, f"rc={p.returncode}\n{out}\n{err}"
    assert "meshctl: interrupted again; exiting now" in err, err


def _agent_of_rank(srv, rank):
    """(pid, starttime) of the local agent meshd srv started with --rank `rank`."""
    by = time.monotonic() + 10
    victim = None
    while victim is None and time.monotonic() < by:
        victim = next((p for p in lib.agent_children(srv.pid) if lib.child_rank(p) == rank),
                      None)
    assert victim, f"no rank-{rank} agent child of meshd {srv.pid}"
    return victim, lib.proc_starttime(victim)


def test_load_progress_names_a_stopped_rank_within_its_deadline(shared_meshd, load_files):
    """LoadProgress asks every rank at once under one deadline (about 2 s): with rank 1's
    agent SIGSTOPped while a load runs it still answers in bounded time, with rank 0's
    bytes and a note naming rank 1; once the agent resumes the answers are whole again."""
    srv = shared_meshd(2, "--agent-timeout", "60")  # the stopped agent stays registered
    files, _ = load_files
    t = lib.tensor_pb2()
    victim, started = _agent_of_rank(srv, 1)
    with lib.Session(srv.port, "progress-stop") as s:
        m = s.mesh(gpu=2)
        s.tensor(m.ref, (1,))  # both ranks set their backend up (it joins the peers): after
        s.run(lib.sync())      # that rank 0's load needs nothing of rank 1
        ref = s.new_ref()

        def look():
            t0 = time.monotonic()
            r = s.unary("LoadProgress", t.LoadProgressRequest(refs=[ref]), t.LoadProgressReply,
                        timeout=30)
            return r, time.monotonic() - t0

        os.kill(victim, signal.SIGSTOP)
        try:
            stop_by = time.monotonic() + 10
            while not lib.all_threads_stopped(victim) and time.monotonic() < stop_by:
                time.sleep(0.01)
            # queued to the stopped rank 1; rank 0 fetches its 2 MiB (0.65 s at the least)
            s.run(("load", t.Load(ref=ref, mesh=m.ref, url=files.url("trickle/two.bin"),
                                  dtype=1, shape=[1 << 19])))
            r, took = look()
            late, _ = look()  # 2 s on: rank 0 has all its part in (0.65 s), rank 1 still none
        finally:
            lib.signal_if_alive(victim, started, signal.SIGCONT)
        assert took < 4.0, f"LoadProgress took {took:.1f} s with rank 1 stopped"
        assert [u.rank for u in r.unanswered] == [1], r
        u = r.unanswered[0]
        assert u.kind == t.ERROR_KIND_DEADLINE_EXCEEDED, r
        assert "rank 1: no answer within 2000 ms" in u.message, u.message
        total = r.loads[0].total_bytes
        assert total == 2 * (2 << 20) and r.loads[0].done_bytes <= total // 2, r  # rank 0's
        assert late.loads[0].done_bytes == total // 2, late
        assert [u.rank for u in late.unanswered] == [1], late
        # resumed: both ranks answer again and the load completes
        by = time.monotonic() + 20
        while time.monotonic() < by:
            r, _ = look()
            if not r.unanswered and r.loads[0].done_bytes == total:
                break
            time.sleep(0.05)
        assert not r.unanswered and r.loads[0].done_bytes == total, r


def test_load_progress_line_names_a_rank_that_gives_no_answer(shared_meshd, load_files):
    """`meshctl load`'s progress line names a rank whose agent gives LoadProgress no
    answer (SIGSTOPped: "(no answer from rank 1)"), and drops the remark once it answers
    again; the load then completes."""
    srv = shared_meshd(2, "--agent-timeout", "60")  # the stopped agent stays registered
    files, _ = load_files
    victim, started = _agent_of_rank(srv, 1)
    p = subprocess.Popen([lib.MESHCTL, "--server", srv.address, "--timeout-ms", "60000",
                          "--progress=true", "--progress-delay-ms=0", "load",
                          files.url("slow/two.bin"), "--dtype", "float32", "--shape",
                          str(1 << 19)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err = b""
    try:
        by = time.monotonic() + 10
        while b"MB/s" not in err and time.monotonic() < by:  # the first look is in
            err += os.read(p.stderr.fileno(), 4096)
        os.kill(victim, signal.SIGSTOP)
        by = time.monotonic() + 20
        while b"(no answer from rank 1)" not in err and time.monotonic() < by and \
                p.poll() is None:
            err += os.read(p.stderr.fileno(), 4096)
        os.kill(victim, signal.SIGCONT)
        out, rest = p.communicate(timeout=60)
        err += rest
    finally:
        lib.signal_if_alive(victim, started, signal.SIGCONT)
        if p.poll() is None:
            p.kill()
            p.wait()
    text = err.decode()
    assert p.returncode == 0, f"rc={p.returncode}\n{out}\n{text}"
    assert "(no answer from rank 1)" in text, text
    assert "(no answer" not in text.split("\r")[-1], text  # complete: the remark is gone


@pytest.mark.parametrize("how", ["load", "run"])
def test_load_interrupted_closes_its_session(shared_meshd, load_files, tmp_path, how):
    """SIGINT during `meshctl load`'s wait: one line, exit 130, and the session is closed
    at once (not left to its lease). The same from a `run` script's load (it exited 3,
    its JSON code INVALID_ARGUMENT)."""
    srv = shared_meshd(2)
    files, _ = load_files
    if how == "load":
        args = ["load", files.url("slow/two.bin"), "--dtype", "float32", "--shape", str(1 << 19)]
    else:
        script = tmp_path / "s.txt"
        script.write_text(f"mesh m gpu=2\nx = load m {files.url('slow/two.bin')} dtype=float32 "
                          f"shape={1 << 19}\n")
        args = ["--output", "json", "run", str(script)]
    with lib.Session(srv.port, "watcher") as w:
        def ours():
            return [x for x in w.list_sessions() if x.client_name == "meshctl"]
        assert not ours(), ours()
        p = subprocess.Popen([lib.MESHCTL, "--server", srv.address, "--timeout-ms", "20000"] + args,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            by = time.monotonic() + 10
            while time.monotonic() < by and not any(x.commands >= 2 for x in ours()):
                time.sleep(0.02)  # the mesh and the load are in: it waits
            assert any(x.commands >= 2 for x in ours()), (ours(), p.poll(), p.communicate(timeout=10) if p.poll() is not None else '')
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=10)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert p.returncode == 130, f"rc={p.returncode}\n{out}\n{err}"
        if how == "load":
            assert err.count("\n") == 1 and "interrupted by SIGINT; the session is closed" in err, err
            assert err.startswith(f"error: load {files.url('slow/two.bin')}: "), err
            assert out == "", out
        else:
            assert "load: interrupted by SIGINT" in err, err
            e = json.loads(out)["error"]
            assert e["code"] == "CANCELLED" and e["line"] == 2, e
        assert not ours(), ours()
    # The agents stop downloading for the closed session (at curl's next progress
    # look, about a second), rather than finish the ~3.5 s file for nobody.
    by = time.monotonic() + 3
    while files.sending and time.monotonic() < by:
        time.sleep(0.05)
    assert files.sending == 0, f"{files.sending} download(s) still running after the session closed"


def test_ctrl_c_during_a_run_scripts_sync_closes_its_session(meshd_server, tmp_path):
    """SIGINT while a `run` script's sync waits (rank 1 hangs in a reduce): meshctl died
    of the signal at once and left its session, with its tensors on the agents, to its
    lease (300 s); as a load's Ctrl-C does, it now closes the session and exits 130."""
    env = {"MESHD_FAULT": "reduce:hang,rank=1,count=1", "MESHD_COMM_TIMEOUT_MS": "30000"}
    srv = lib.wait_ready(meshd_server(2, env=env), 2)
    script = tmp_path / "s.txt"
    script.write_text("mesh m gpu=2\nx = ones m 1024\ny = reduce x gpu sum\nsync\n")
    with lib.Session(srv.port, "watcher") as w:
        def ours():
            return [x for x in w.list_sessions() if x.client_name == "meshctl"]
        p = subprocess.Popen([lib.MESHCTL, "--server", srv.address, "--timeout-ms", "20000",
                              "--output", "json", "run", str(script)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            by = time.monotonic() + 10
            while time.monotonic() < by and not any(x.commands >= 4 for x in ours()):
                time.sleep(0.02)  # mesh, ones, reduce and the sync are in: it waits
            assert any(x.commands >= 4 for x in ours()), (ours(), p.poll())
            time.sleep(0.2)
            p.send_signal(signal.SIGINT)
            t0 = time.monotonic()
            out, err = p.communicate(timeout=10)
            took = time.monotonic() - t0
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert p.returncode == 130, f"rc={p.returncode}\n{out}\n{err}"
        assert took < 5, f"meshctl took {took:.1f} s to stop"
        assert "line 4: CANCELLED: sync: interrupted by SIGINT" in err, err
        e = json.loads(out)["error"]
        assert e["code"] == "CANCELLED" and e["line"] == 4, e
        assert not ours(), ours()


def test_ctrl_c_while_run_reads_stdin_closes_its_session(shared_meshd):
    """`meshctl run -` waiting for its next line: Ctrl-C closes the session, exit 130
    (the handler the script's calls need must not turn it into an EOF, exit 0)."""
    srv = shared_meshd(2)
    with lib.Session(srv.port, "watcher") as w:
        def ours():
            return [x for x in w.list_sessions() if x.client_name == "meshctl"]
        p = subprocess.Popen([lib.MESHCTL, "--server", srv.address, "run", "-"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        try:
            p.stdin.write("mesh m gpu=2\nx = ones m 4\n")
            p.stdin.flush()
            by = time.monotonic() + 10
            while time.monotonic() < by and not any(x.commands >= 2 for x in ours()):
                time.sleep(0.02)
            assert any(x.commands >= 2 for x in ours()), (ours(), p.poll())
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=10)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert p.returncode == 130, f"rc={p.returncode}\n{out}\n{err}"
        assert "interrupted by SIGINT; the session is closed" in err, err
        assert not ours(), ours()


def test_a_run_scripts_sync_past_timeout_ms_names_the_flag(meshd_server, tmp_path):
    """A sync still waiting at --timeout-ms (5 s by default: any real script's work) said
    gRPC's bare "Deadline Exceeded"; it names the flag that bounds it."""
    env = {"MESHD_FAULT": "reduce:hang,rank=1,count=1", "MESHD_COMM_TIMEOUT_MS": "30000"}
    srv = lib.wait_ready(meshd_server(2, env=env), 2)
    script = tmp_path / "s.txt"
    script.write_text("mesh m gpu=2\nx = ones m 4\ny = reduce x gpu sum\nsync\n")
    r = meshctl(srv.address, "run", str(script), timeout_ms=1500)
    assert r.returncode == 3, _show(r)
    assert "line 4: DEADLINE_EXCEEDED: sync: the work was not done within --timeout-ms " \
           "(1500 ms)" in r.stderr, _show(r)


def test_load_errors_name_the_url(shared_meshd, load_files, tmp_path):
    srv = shared_meshd(2)
    files, _ = load_files
    # 404 on the agents (raw bytes: no header to read first), then on the header read
    missing = files.url("missing.bin")
    r = meshctl(srv.address, "load", files.base.replace("http://", "http://u:secret@")
                + "/missing.bin?sig=secret", "--dtype", "float32", "--shape", "2")
    assert r.returncode == 3 and r.stdout == "", _show(r)
    assert f"error: load {missing}: INVALID_ARGUMENT (BAD_ARGUMENT): " in r.stderr, _show(r)
    assert "HTTP 404" in r.stderr and "(rank " in r.stderr, _show(r)
    assert "secret" not in r.stderr, _show(r)  # credentials and query stripped
    r = meshctl(srv.address, "--output", "json", "load", files.url("missing.npy"))
    err = _json(r)["error"]
    assert r.returncode == 3 and err["code"] == "INVALID_ARGUMENT", _show(r)
    assert err["kind"] == "BAD_ARGUMENT" and "HTTP 404" in err["message"], err
    assert files.url("missing.npy") in err["message"].split(": ", 1)[1], err  # the server's part

    # a name the checkpoint lacks: the URL and the names it holds
    url = files.url("model.safetensors")
    r = meshctl(srv.address, "load", url, "--name", "wpe")
    assert r.returncode == 3, _show(r)
    assert f"no tensor named 'wpe' in {url}; it holds: wte, bias" in r.stderr, _show(r)
    r = meshctl(srv.address, "--output", "json", "load", url)
    err = _json(r)["error"]
    assert r.returncode == 3 and err["code"] == "INVALID_ARGUMENT", _show(r)
    assert f"{url} holds 2 tensors (wte, bias); name one" in err["message"], err

    # a script stops at the failing load line, with the agents' message
    script = tmp_path / "bad.txt"
    script.write_text(f"mesh m gpu=2\nw = load m {missing} dtype=int8 shape=4\nfetch w gpu=0\n")
    r = meshctl(srv.address, "--output", "json", "run", str(script))
    err = _json(r)["error"]
    assert r.returncode == 3 and err["line"] == 2 and err["kind"] == "BAD_ARGUMENT", _show(r)
    assert missing in err["message"] and "HTTP 404" in err["message"], err


@pytest.fixture
def versioned_files(tmp_path):
    """tests/support/range_http_server.py over a folder holding x.npy (float32 [4, 196608]:
    rows of 768 KiB, so that half a row's gap to the next is over the agents' 256 KiB
    coalescing bound and a split along dim 1 reads one range per row): its
    /files/KEY/HOW/H/x.npy serves a new version (validators) from the first GET after H
    HEADs on; yields (the base URL, the array)."""
    import numpy as np
    a = np.arange(4 * 196608, dtype=np.float32).reshape(4, 196608)
    np.save(tmp_path / "x.npy", a)
    with lib.range_http_server(tmp_path) as url:
        yield f"{url}/files", a


def test_load_fails_when_the_file_changes_between_its_ranges(shared_meshd, versioned_files):
    """A file saved again in place mid-load, after every rank checked its version: each
    range carries the version (If-Match, If-Unmodified-Since), and an answer of another
    version (412, or a server that ignores them and says so in its headers) fails the load
    rather than leaving it half old, half new."""
    srv = shared_meshd(2)
    base, a = versioned_files
    # split along dim 1, each rank reads one range per row; H = 3 HEADs (the inspection's,
    # one per rank) see version 1, then one more range, then the file changes
    for how, says in (("etag", "HTTP 412 Precondition Failed: it is no longer etag "),
                      ("mtime-lax", "it was mtime 1700000000, now mtime 1700000060")):
        url = f"{base}/c-{how}/{how}/3/x.npy"
        r = meshctl(srv.address, "--output", "json", "load", url, "--shard", "gpu", "--dim", "1")
        assert r.returncode == 3, _show(r)  # not a tensor of two versions
        err = _json(r)["error"]
        assert err["kind"] == "BAD_ARGUMENT", err
        assert f"{url}: the resource changed during the load (" in err["message"], err
        assert says in err["message"] and "load it again" in err["message"], err
    # the same sharded load of a file that stays put passes its preconditions
    r = meshctl(srv.address, "--output", "json", "load", f"{base}/same/etag/99/x.npy",
                "--shard", "gpu", "--dim", "1")
    doc = _json(r)
    assert r.returncode == 0 and doc["shape"] == [4, a.shape[1] // 2], _show(r)
    assert doc["fetched_bytes"] == a.nbytes, doc


@pytest.mark.parametrize("args,says", [
    (("load", "http://h/x", "--dtype", "float32"), "load: --dtype needs --shape"),
    (("load", "http://h/x", "--shape", "2,x", "--dtype", "int8"),
     "load: --shape: '2,x' is not a shape"),
    (("load", "http://h/x", "--dtype", "int8", "--shape", "2", "--name", "w"),
     "load: --name picks a tensor of a safetensors file"),
    (("load", "http://h/x", "--dim", "1"), "load: --dim: the tensor dim to split needs --shard"),
    (("load", "http://h/x", "--mesh", "gpu=0"), "load: --mesh: 'gpu=0' is not a mesh"),
    (("load",), "load: missing URL"),
    (("health", "--shard", "gpu"), "--shard: only `meshctl load` takes it, not health")])
def test_load_usage_errors(args, says):
    r = meshctl("127.0.0.1:1", *args)
    assert r.returncode == 64 and says in r.stderr, _show(r)


def test_load_survives_a_server_that_lists_absurd_ranks():
    """meshctl load without --mesh sizes the mesh from ListAgents' longest run of usable
    ranks. A rank is the server's to say: 0xffffffff wrapped the array's bound to 0 and
    meshctl wrote past it (SIGSEGV); 0x7fffffff allocated 2 GiB. A fake server lists
    such ranks and then refuses the session: meshctl reports that, exit 3."""
    import grpc
    t = lib.tensor_pb2()
    agents = [t.AgentInfo(rank=r, healthy=True, address=f"127.0.0.1:{9000 + i}")
              for i, r in enumerate([0xFFFFFFFF, 0x7FFFFFFF, 3, 3, 5, 6])]

    def list_agents(request, context):
        return t.ListAgentsReply(agents=agents)

    def create_session(request, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, "this fake serves no sessions")

    server, port = lib.fake_tensor_service(
        ListAgents=(list_agents, t.ListAgentsRequest),
        CreateSession=(create_session, t.CreateSessionRequest))
    try:
        r = meshctl(f"127.0.0.1:{port}", "load", "file:///tmp/nowhere.npy")
    finally:
        server.stop(0)
    assert r.returncode == 3, _show(r)
    assert "cannot open a session" in r.stderr and "serves no sessions" in r.stderr, _show(r)


def test_load_error_with_a_long_url_keeps_its_status_and_rank(shared_meshd, load_files):
    """A 404 on a URL whose path is long (~490 characters, under the 8192 a Load takes):
    the message still names the HTTP status and the rank."""
    srv = shared_meshd(2)
    files, _ = load_files
    url = files.url("d" * 700 + "/missing.bin")
    r = meshctl(srv.address, "load", url, "--dtype", "float32", "--shape", "2")
    assert r.returncode == 3, _show(r)
    assert "HTTP 404" in r.stderr and "(rank " in r.stderr, _show(r)


def test_inspect_error_with_a_long_url_keeps_its_status_and_rank(shared_meshd, load_files):
    """The same through InspectUrl (no --dtype: the header is read first)."""
    srv = shared_meshd(2)
    files, _ = load_files
    url = files.url("d" * 700 + "/missing.npy")
    r = meshctl(srv.address, "load", url)
    assert r.returncode == 3, _show(r)
    assert "HTTP 404" in r.stderr and "rank 0" in r.stderr, _show(r)


# ------------------------------------------------- operators' edge cases (review 100)

def test_load_with_no_usable_agent_is_a_refused_command_not_unavailable(shared_meshd):
    """A server with no agent: `meshctl load` without --mesh has nothing to load onto. That
    is a refused command (exit 3) whose JSON code is not UNAVAILABLE: operations.md keeps
    UNAVAILABLE for "could not connect" (exit 2), and a script telling the two apart by the
    code took a reachable server for an absent one."""
    srv = no_agents_server(shared_meshd)
    addr = f"127.0.0.1:{srv.port}"
    r = meshctl(addr, "load", "file:///tmp/nowhere.npy")
    assert r.returncode == 3, _show(r)
    assert "no healthy, undrained agent" in r.stderr and "meshctl agents" in r.stderr, _show(r)
    r = meshctl(addr, "--output", "json", "load", "file:///tmp/nowhere.npy")
    assert r.returncode == 3, _show(r)
    err = _json(r)["error"]
    assert err["code"] == "FAILED_PRECONDITION", err
    assert "no healthy, undrained agent" in err["message"], err


_FAIL_CALLOC = r"""
#include <stddef.h>
#include <stdlib.h>
extern void *__libc_calloc(size_t, size_t);
void *calloc(size_t n, size_t size) {
  /* meshctl load's array of usable ranks for a server that lists 777 agents */
  if (n == 777 && size == 4) return NULL;
  return __libc_calloc(n, size);
}
"""


def test_load_out_of_memory_still_prints_its_json_document(tmp_path):
    """--output json prints one document for every command, a failure included. meshctl
    load's out-of-memory path (its array of usable ranks) printed nothing on stdout and
    exited 3 (a call failed) where report() says out of memory is exit 1 and
    RESOURCE_EXHAUSTED. A fake server lists 777 agents and an LD_PRELOAD shim fails that
    one allocation."""
    import shutil
    cc = shutil.which("cc")
    if not cc:
        pytest.skip("no C compiler for the allocation shim")
    if "libasan" in subprocess.run(["ldd", lib.MESHCTL], capture_output=True, text=True).stdout:
        pytest.skip("a sanitizer build owns calloc")
    src = tmp_path / "failcalloc.c"
    src.write_text(_FAIL_CALLOC)
    so = tmp_path / "failcalloc.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(so), str(src)], check=True, timeout=60)
    t = lib.tensor_pb2()
    agents = [t.AgentInfo(rank=i, healthy=True, address=f"127.0.0.1:{9000 + i}")
              for i in range(777)]

    def list_agents(request, context):
        return t.ListAgentsReply(agents=agents)

    server, port = lib.fake_tensor_service(ListAgents=(list_agents, t.ListAgentsRequest))
    env = {"LD_PRELOAD": str(so)}
    try:
        r = meshctl(f"127.0.0.1:{port}", "--output", "json", "load", "file:///tmp/nowhere.npy",
                    env=env)
    finally:
        server.stop(0)
    assert "out of memory" in r.stderr, _show(r)
    assert r.returncode == 1, _show(r)
    err = _json(r)["error"]
    assert err["code"] == "RESOURCE_EXHAUSTED" and "out of memory" in err["message"], err


def test_run_takes_a_4095_character_line_with_or_without_its_newline(shared_meshd, tmp_path):
    """run reads a script line into 4096 bytes: 4095 characters fit. A last line of 4095
    characters without a newline was refused as "longer than 4094 characters" (and one with
    its newline too); a longer line is still refused, naming the limit."""
    srv = shared_meshd(2)
    addr = f"127.0.0.1:{srv.port}"
    long_comment = "#" + "x" * 4094
    assert len(long_comment) == 4095
    for name, text in (("last.txt", "sync\n" + long_comment),
                       ("middle.txt", long_comment + "\nsync\n")):
        script = tmp_path / name
        script.write_text(text)
        r = meshctl(addr, "run", str(script))
        assert r.returncode == 0 and r.stderr == "", (name, _show(r))
    script = tmp_path / "over.txt"
    script.write_text("sync\n" + long_comment + "x\nsync\n")
    r = meshctl(addr, "run", str(script))
    assert r.returncode == 3 and "line 2: SYNTAX: line longer than 4095 characters" in r.stderr, \
        _show(r)


def test_every_column_of_the_sessions_table_is_documented(shared_meshd):
    """operations.md's `sessions` entry names the table's columns by the headers meshctl
    prints: CMD/S (commands per second, `-` outside --watch's later frames) was in the
    table and in no document."""
    srv = shared_meshd(2)
    r = meshctl(f"127.0.0.1:{srv.port}", "sessions")
    assert r.returncode == 0, _show(r)
    header = r.stdout.splitlines()[0].split()
    assert "CMD/S" in header, _show(r)
    with open(os.path.join(lib.SOURCE_DIR, "docs", "operations.md")) as f:
        doc = f.read()
    entry = doc[doc.index("- `sessions` — "):doc.index("- `sessions --watch")]
    missing = [h for h in header if f"`{h}`" not in entry]
    assert not missing, f"columns not in operations.md's sessions entry: {missing}\n{entry}"


def test_an_ec_key_file_that_starts_with_its_parameters_is_a_key(pki, tmp_path):
    """`openssl ecparam -genkey` writes an EC PARAMETERS block before the EC PRIVATE KEY.
    meshd's and meshctl's startup checks looked at the first PEM block only and refused
    the file: "holds no PEM PRIVATE KEY" (meshd exit 2, meshctl 64), though gRPC takes it."""
    import subprocess as sp
    key, csr, crt, ext = (tmp_path / n for n in ("ecp.key", "ecp.csr", "ecp.pem", "ecp.ext"))
    sp.run(["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-out", key], check=True,
           capture_output=True, timeout=60)
    assert key.read_text().startswith("-----BEGIN EC PARAMETERS-----")
    sp.run(["openssl", "req", "-new", "-key", key, "-subj", "/CN=ecp", "-out", csr], check=True,
           capture_output=True, timeout=60)
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                   "extendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n")
    sp.run(["openssl", "x509", "-req", "-in", csr, "-CA", pki / "ca.pem", "-CAkey", pki / "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", ext, "-out", crt], check=True,
           capture_output=True, timeout=60)
    args = ["--listen", "127.0.0.1:0", "--tls-cert", crt, "--tls-key", key,
            "--tls-client-ca", pki / "ca.pem", "--min-agents", 0]
    p = lib.spawn("meshd-ecp", lib.MESHD, [str(a) for a in args], str(tmp_path))
    try:
        r = meshctl(f"127.0.0.1:{p.port}", "--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(crt),
                    "--tls-key", str(key), "health")
        assert r.returncode == 0 and r.stdout == "SERVING\n", _show(r)
    finally:
        lib.stop(p)


@pytest.mark.plain
def test_sessions_lists_a_reply_over_4_mib_the_server_allows(meshd_server):
    """A server whose --max-message-bytes is raised above 4 MiB sends a ListSessions reply
    that large (here ~23,000 sessions with 128-character client names, ~4.3 MB). The
    Python and Node clients take replies up to 64 MiB; meshctl kept gRPC's 4 MiB default
    and failed with gRPC's bare "Received message larger than max (N vs. 4194304)", which
    names no flag, so an operator could not list the sessions of a busy server at all.
    ListSessions is now paged (1000 rows by default), so the listing is many small
    replies that meshctl follows; --max-sessions 0 lifts the server-wide cap."""
    if os.environ.get("MESHD_SANITIZED"):
        pytest.skip("23,000 sessions: the plain pass covers the client's limit")
    import concurrent.futures
    import grpc
    srv = meshd_server(0, "--max-sessions-per-principal", "0", "--max-sessions", "0",
                       "--max-message-bytes", "16MiB",
                       "--session-ttl", "600")
    t = lib.tensor_pb2()
    n = 23000
    chans = [lib.channel(srv.port) for _ in range(4)]
    fns = [ch.unary_unary("/meshd.v1.TensorService/CreateSession",
                          request_serializer=lambda m: m.SerializeToString(),
                          response_deserializer=t.CreateSessionReply.FromString) for ch in chans]
    req = t.CreateSessionRequest(client_name="n" * 128)
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        ids = list(ex.map(lambda i: fns[i % 4](req, timeout=30).session_id, range(n)))
    assert len(set(ids)) == n
    big = grpc.insecure_channel(srv.address, options=[("grpc.enable_http_proxy", 0),
                                                      ("grpc.max_receive_message_length", 64 << 20)])
    chans.append(big)
    reply = big.unary_unary("/meshd.v1.TensorService/ListSessions",
                            request_serializer=lambda m: m.SerializeToString(),
                            response_deserializer=t.ListSessionsReply.FromString)(
                                t.ListSessionsRequest(), timeout=30)
    assert len(reply.sessions) == 1000 and reply.next_page_token, reply.ByteSize()
    r = lib.run(lib.MESHCTL, ["--server", srv.address, "--timeout-ms", "20000", "--output=json",
                              "sessions"], timeout=60)
    assert r.returncode == 0, _show(r)[:2000]
    assert len(json.loads(r.stdout)["sessions"]) == n
    for ch in chans:
        ch.close()



def test_json_output_stays_utf8_whatever_bytes_a_name_holds(shared_meshd, tmp_path):
    """JSON is UTF-8 (RFC 8259) and --output json promises one document a script can
    parse. meshctl copied strings into it byte for byte: a server (hostile, or a fake)
    whose ListSessions names a client b'bad\\xff\\xfe\\xc0\\xafq\\\\"', or a script
    line with a Latin-1 byte that `run`'s error message quotes, gave a document that
    json.loads (or any strict parser) refuses. Bytes that are not UTF-8 come out as
    U+FFFD; quotes and backslashes stay escaped."""
    import concurrent.futures
    import grpc
    t = lib.tensor_pb2()
    placeholder = "bad____q__"
    evil = b'bad\xff\xfe\xc0\xafq\\"'
    assert len(evil) == len(placeholder)
    row = t.ListSessionsReply(sessions=[t.SessionInfo(session_id="s1", owner="anonymous",
                                                      client_name=placeholder)])
    raw = row.SerializeToString().replace(placeholder.encode(), evil)

    handler = grpc.method_handlers_generic_handler("meshd.v1.TensorService", {
        "ListSessions": grpc.unary_unary_rpc_method_handler(
            lambda request, context: raw, request_deserializer=lambda b: b,
            response_serializer=lambda b: b)})
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        r = subprocess.run([lib.MESHCTL, "--server", f"127.0.0.1:{port}", "--timeout-ms", "5000",
                            "--output=json", "sessions"], stdin=subprocess.DEVNULL,
                           capture_output=True, env=lib.clean_env(None), timeout=30)
    finally:
        server.stop(0)
    assert r.returncode == 0, r
    doc = json.loads(r.stdout)  # bytes: strict UTF-8
    name = doc["sessions"][0]["client_name"]
    assert name == "bad\ufffd\ufffd\ufffd\ufffdq\\\"", name

    srv = shared_meshd(2)
    script = tmp_path / "s.txt"
    script.write_bytes(b"fetch caf\xe9\n")
    r = subprocess.run([lib.MESHCTL, "--server", srv.address, "--timeout-ms", "5000",
                        "--output=json", "run", str(script)], stdin=subprocess.DEVNULL,
                       capture_output=True, env=lib.clean_env(None), timeout=30)
    assert r.returncode == 3, r
    err = json.loads(r.stdout)["error"]
    assert err["line"] == 1 and "'caf\ufffd' is not defined" in err["message"], err


def test_help_under_output_json_is_one_json_document():
    """--output json promises one JSON document on stdout for every invocation (--version
    and usage errors keep it): --help too, the help text itself for people on stderr."""
    for args in (["--output", "json", "--help"], ["--help", "--output=json"],
                 ["--output", "json", "--bogus", "-h"]):
        r = meshctl(None, *args)
        assert r.returncode == 0, _show(r)
        doc = _json(r)
        assert doc["usage"].startswith("usage: meshctl ") and "--output" in doc["usage"], _show(r)
        assert r.stderr.startswith("usage: meshctl "), _show(r)
    r = meshctl(None, "--help")  # the table (default) output: plain help on stdout, as before
    assert r.returncode == 0 and r.stdout.startswith("usage: meshctl ") and not r.stderr, _show(r)
