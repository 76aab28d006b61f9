"""Starts one real `meshd --local-agents 2` for the client tests and kills only that pid.

MESHD_BIN_DIR names the directory with meshd and meshd-agent (ctest sets it);
default: <repo>/build/bin."""

import atexit
import os
import shutil
import signal
import subprocess
import tempfile
import time

import grpc
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", "..", ".."))
BIN_DIR = os.environ.get("MESHD_BIN_DIR") or os.path.join(REPO, "build", "bin")

_TMP = tempfile.mkdtemp(prefix="meshd-client-test-")
atexit.register(shutil.rmtree, _TMP, True)
os.environ.setdefault("XDG_CACHE_HOME", os.path.join(_TMP, "cache"))  # generated protos

import meshd  # noqa: E402
from meshd import _conn, _proto  # noqa: E402


def _child_env():
    return {k: v for k, v in os.environ.items()
            if k.lower() not in ("http_proxy", "https_proxy", "grpc_proxy", "all_proxy")
            and not k.startswith("MESHD_")}


def _log_tail(path, n=60):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except FileNotFoundError:
        return "(no log)"


def _serving(port, connect=None):
    """TensorService SERVING; `connect`: meshd.connect's security arguments (TLS)."""
    h = _proto.health_pb2()
    addr = f"127.0.0.1:{port}"
    creds = _conn.resolve(addr, env={}, **(connect or {}))
    with _conn.open_channel(addr, creds, [("grpc.enable_http_proxy", 0)]) as ch:
        fn = ch.unary_unary("/grpc.health.v1.Health/Check",
                            request_serializer=lambda m: m.SerializeToString(),
                            response_deserializer=h.HealthCheckResponse.FromString)
        try:
            st = fn(h.HealthCheckRequest(service="meshd.v1.TensorService"), timeout=2).status
        except grpc.RpcError:
            return False
        return st == h.HealthCheckResponse.SERVING


def start_meshd(agents, listen="127.0.0.1:0", name="meshd", flags=(), connect=None, env=None):
    """Starts meshd with `agents` local agents (and more `flags`); returns (address, Popen)
    once TensorService is SERVING and that many agents are healthy. Its log is
    log_path(name). `connect`: the meshd.connect arguments that server needs (token,
    root_certs, ...) to check that. `env`: MESHD_* variables for it and its agents."""
    binary = os.path.join(BIN_DIR, "meshd")
    assert os.access(binary, os.X_OK), f"no meshd at {binary}; set MESHD_BIN_DIR"
    port_file = os.path.join(_TMP, f"{name}-{time.monotonic_ns()}.port")
    log = log_path(name)
    with open(log, "ab") as logf:
        proc = subprocess.Popen([binary, "--listen", listen, "--local-agents", str(agents),
                                 "--port-file", port_file] + [str(f) for f in flags],
                                stdin=subprocess.DEVNULL,
                                stdout=logf, stderr=subprocess.STDOUT,
                                # TMPDIR: its join token's directory goes with _TMP
                                # even if it is SIGKILLed
                                env={**_child_env(), "TMPDIR": _TMP, **(env or {})})
    try:
        deadline = time.monotonic() + 30
        port = None
        while True:
            assert proc.poll() is None, f"meshd exited with {proc.returncode}\n{_log_tail(log)}"
            assert time.monotonic() < deadline, f"meshd not ready within 30 s\n{_log_tail(log)}"
            if port is None:
                try:
                    with open(port_file) as f:
                        text = f.read()
                    if text.endswith("\n") and text.strip().isdigit():
                        port = int(text)
                except FileNotFoundError:
                    pass
            if port is not None and _serving(port, connect):
                with meshd.connect(f"127.0.0.1:{port}", **(connect or {})) as s:
                    if len([a for a in s.agents() if a["healthy"]]) >= agents:
                        return f"127.0.0.1:{port}", proc
            time.sleep(0.1)
    except BaseException:
        stop_meshd(proc, signal.SIGKILL)
        raise


def log_path(name):
    """Where start_meshd(name=name) logs."""
    return os.path.join(_TMP, f"{name}.log")


def stop_meshd(proc, sig=signal.SIGTERM):
    """Stops a meshd this test process started (SIGKILL after 20 s)."""
    if proc.poll() is None:
        os.kill(proc.pid, sig)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture(scope="session")
def server():
    """(address, Popen) of a meshd with 2 local agents, SERVING."""
    addr, proc = start_meshd(2)
    try:
        yield addr, proc
    finally:
        stop_meshd(proc)


@pytest.fixture
def session(server):
    with meshd.connect(server[0]) as s:
        yield s


@pytest.fixture
def mesh(session):
    m = session.mesh(gpu=2)
    with m.activate():
        yield m


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report carries the tails of the meshd logs written while it ran
    (the logs' folder goes when the run ends, and a flaky failure in CI is otherwise
    left without the server's side of it)."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    since = time.time() - max(report.duration, 0) - 5
    for name in sorted(os.listdir(_TMP)):
        path = os.path.join(_TMP, name)
        if name.endswith(".log") and os.path.getmtime(path) >= since:
            report.sections.append((f"meshd log {name} (last 80 lines)", _log_tail(path, 80)))
