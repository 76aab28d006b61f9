"""meshctl against a real meshd (docs/operations.md, "meshctl").

health exit codes as grpc_health_probe: 0 SERVING, 2 connection failed,
3 RPC failed (NOT_FOUND for an unknown service), 4 not serving.
"""

import os
import re
import subprocess

import pytest

import meshd_testlib as lib


def meshctl(server, *args, env=None, timeout_ms=3000):
    pre = ["--server", server] if server else []
    return lib.run(lib.MESHCTL, pre + ["--timeout-ms", str(timeout_ms)] + list(args), env=env,
                   timeout=30)


def _show(r):
    return f"rc={r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"


def test_health_serving_exit_0(meshd_server):
    srv = meshd_server()
    r = meshctl(srv.address, "health")
    assert r.returncode == 0, _show(r)
    assert "SERVING" in r.stdout, _show(r)


def test_health_default_service_is_process(meshd_server):
    srv = meshd_server()
    r = meshctl(srv.address, "health", "")
    assert r.returncode == 0, _show(r)


def test_health_connection_failed_exit_2():
    r = meshctl(f"127.0.0.1:{lib.free_port()}", "health", timeout_ms=2000)
    assert r.returncode == 2, _show(r)


def test_health_unknown_service_exit_3(meshd_server):
    srv = meshd_server()
    r = meshctl(srv.address, "health", "no.such.Service")
    assert r.returncode == 3, _show(r)


def test_health_not_serving_exit_4(meshd_server):
    srv = meshd_server(0, min_agents=3)
    r = meshctl(srv.address, "health", lib.TENSOR_SERVICE)
    assert r.returncode == 4, _show(r)
    assert "NOT_SERVING" in r.stdout, _show(r)


def test_health_tensor_service_serving_with_agents(meshd_server):
    srv = meshd_server(2)
    lib.wait_health(srv.port, lib.TENSOR_SERVICE, lib.SERVING(), timeout=lib.REGISTER_TIMEOUT,
                    proc=srv.proc, log=srv.log)
    r = meshctl(srv.address, "health", lib.TENSOR_SERVICE)
    assert r.returncode == 0, _show(r)


def test_server_from_env(meshd_server):
    srv = meshd_server()
    r = meshctl(None, "health", env={"MESHD_SERVER": srv.address})
    assert r.returncode == 0, _show(r)


def test_agent_health_with_meshctl(meshd_server, agent):
    srv = meshd_server()
    a = agent(srv.port)
    r = meshctl(a.address, "health", lib.AGENT_SERVICE)
    assert r.returncode == 0, _show(r)


def test_agents_lists_two_ranks(meshd_server):
    srv = meshd_server(2)
    lib.wait_agents(srv.port, lambda ag: lib.healthy_ranks(ag) == [0, 1],
                    what="ranks 0 and 1 healthy", log=srv.log)
    r = meshctl(srv.address, "agents")
    assert r.returncode == 0, _show(r)
    rows = [line.split() for line in r.stdout.splitlines()
            if re.match(r"^\s*\d+\s", line)]
    assert len(rows) == 2, _show(r)
    assert sorted(int(row[0]) for row in rows) == [0, 1], _show(r)
    for row in rows:
        assert any(col.startswith("127.0.0.1:") for col in row), _show(r)
        assert "cpu" in row, _show(r)



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


def test_fetch_progress_only_on_a_terminal(meshd_server, tmp_path):
    srv = meshd_server(2)
    lib.wait_health(srv.port, lib.TENSOR_SERVICE, lib.SERVING(), timeout=lib.REGISTER_TIMEOUT,
                    proc=srv.proc, log=srv.log)
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
    (("--data-path", "udp"), "--data-path: expected auto, direct or proxy, got 'udp'")])
def test_bad_progress_flags_are_usage_errors(args, says):
    r = meshctl("127.0.0.1:1", *args, "health")
    assert r.returncode == 64 and says in r.stderr, _show(r)
