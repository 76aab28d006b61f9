"""Fixtures for the meshd integration tests (run with /usr/bin/python3 -m pytest).

meshd_server(local_agents=0, *flags, min_agents=None, env=None, listen=..., wait_serving=True)
    starts `meshd --listen 127.0.0.1:0 --port-file F`, reads F, waits for Health ""
    SERVING and returns a Process (unpacks as (port, proc, log_path)).
agent(server_port, *flags, rank=None, wait_registered=True)
    starts `meshd-agent --server 127.0.0.1:PORT --port-file F` and returns a Process.

Every process a fixture started is stopped at teardown, even when the test failed:
SIGTERM, then SIGKILL after a bound. The agents a meshd supervises are collected
from /proc/<pid>/task/*/children before it is stopped and must be gone after.
On failure the tail of every log is printed. A log holding a sanitizer report
(ASan, LSan, UBSan; local agents log into meshd's log) fails the test; so does one of
a process the test started with lib.spawn itself and that ended by its end.
"""

import os
import signal

import pytest

import meshd_testlib as lib


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """One test PKI per module (meshd_testlib.make_pki)."""
    return lib.make_pki(tmp_path_factory.mktemp("pki"))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "plain: checks what only a plain (unsanitized) build can show: a process's "
        "memory bound (ASan's quarantine and shadow make RSS say little) or a scale the "
        "sanitizers make too slow. CI's plain pass runs the marked tests "
        "(integration.python_plain), its sanitizer pass every test (those that can show "
        "nothing there skip themselves).")
    missing = [b for b in (lib.MESHD, lib.AGENT, lib.MESHCTL) if not os.access(b, os.X_OK)]
    config._meshd_missing = missing


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


def _failed(request):
    rep = getattr(request.node, "rep_call", None)
    return rep is None or rep.failed


@pytest.fixture(autouse=True)
def _spawned_logs_checked():
    """A process the test started with lib.spawn itself (not through a fixture, whose
    teardown checks its logs) and that ended by the test's end: a sanitizer report in
    its log fails the test. Those still running (a module's server) are checked where
    they are stopped."""
    first = len(lib.spawned)
    yield
    hits = [f"{p.kind} pid {p.pid}: sanitizer report: {hit}" for p in lib.spawned[first:]
            if p.proc.poll() is not None and (hit := lib.sanitizer_report(p.log))]
    assert not hits, "; ".join(hits)


@pytest.fixture(scope="session", autouse=True)
def _binaries(pytestconfig):
    # Without the binaries there is nothing to test: fail loudly rather than skip,
    # so that a ctest run on an incomplete build is red.
    missing = pytestconfig._meshd_missing
    assert not missing, (f"binaries not built: {missing} (MESHD_BIN_DIR={lib.BIN_DIR}); "
                         "build first, e.g. cmake --build build")
    lib.health_pb2()  # generate the Python modules once, early


class _Registry:
    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.servers = []
        self.agents = []

    def teardown(self, show_logs):
        problems = []
        for a in reversed(self.agents):
            lib.stop(a)
        for s in reversed(self.servers):
            kids = lib.agent_children(s.pid) if s.proc.poll() is None else {}
            lib.stop(s)
            left = lib.wait_gone(kids, 5.0)
            if left:
                problems.append(f"meshd pid {s.pid} exited ({s.proc.returncode}) but its agents "
                                f"{sorted(left)} survive")
                for pid in left:  # our own descendants: clean up, then report
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        for p in self.servers + self.agents:
            hit = lib.sanitizer_report(p.log)
            if hit:
                problems.append(f"{p.kind} pid {p.pid}: sanitizer report: {hit}")
        if show_logs or problems:
            for p in self.servers + self.agents:
                print(f"\n===== {p.kind} pid {p.pid} rc {p.proc.returncode}: {' '.join(p.args)}\n"
                      f"{lib.log_tail(p.log, 80)}")
        assert not problems, "; ".join(problems)


@pytest.fixture
def _procs(request, tmp_path):
    reg = _Registry(tmp_path)
    yield reg
    reg.teardown(_failed(request))


@pytest.fixture
def meshd_server(_procs):
    def start(local_agents=0, *flags, min_agents=None, env=None, listen="127.0.0.1:0",
              wait_serving=True):
        args = ["--listen", listen]
        if local_agents:
            args += ["--local-agents", str(local_agents)]
        if min_agents is not None:
            args += ["--min-agents", str(min_agents)]
        args += [str(f) for f in flags]
        p = lib.spawn("meshd", lib.MESHD, args, str(_procs.tmp), env=env)
        _procs.servers.append(p)
        if wait_serving:
            lib.wait_health(p.port, "", lib.SERVING(), proc=p.proc, log=p.log)
        return p
    return start


@pytest.fixture
def agent(_procs):
    def start(server_port, *flags, rank=None, wait_registered=True, env=None):
        args = ["--server", f"127.0.0.1:{server_port}", "--listen", "127.0.0.1:0"]
        if rank is not None:
            args += ["--rank", str(rank)]
        if lib.DEVICE != "cpu" and "--device" not in flags:
            args += ["--device", "cuda:0" if lib.DEVICE == "cuda" else lib.DEVICE]
        args += [str(f) for f in flags]
        p = lib.spawn("agent", lib.AGENT, args, str(_procs.tmp), env=env)
        _procs.agents.append(p)
        if wait_registered:
            lib.wait_health(p.port, lib.AGENT_SERVICE, lib.SERVING(), timeout=lib.REGISTER_TIMEOUT,
                            proc=p.proc, log=p.log)
        return p
    return start


@pytest.fixture
def watches():
    """Health Watch streams opened by the test; all cancelled at teardown."""
    opened = []

    def open_watch(port, service=""):
        w = lib.Watch(port, service)
        opened.append(w)
        return w
    yield open_watch
    for w in opened:
        w.close()


@pytest.fixture(scope="module")
def shared_meshd(request, tmp_path_factory):
    """meshd servers shared by the tests of one module (sessions keep the tests apart):
    shared_meshd(n, *flags, env=None) starts `meshd --local-agents n flags` (env added to
    its environment, as meshd_server's) on first use, waits until TensorService is SERVING
    with ranks 0..n-1 healthy, and returns the same Process afterwards. One that died is
    replaced (and the death reported at module teardown). Teardown stops them and checks
    them like meshd_server does."""
    reg = _Registry(tmp_path_factory.mktemp("shared"))
    servers = {}
    deaths = []
    failed_before = request.session.testsfailed

    def get(n=2, *flags, env=None):
        key = (n,) + tuple(str(f) for f in flags) + tuple(sorted((env or {}).items()))
        p = servers.get(key)
        if p is not None and p.proc.poll() is not None:
            deaths.append(f"shared meshd pid {p.pid} ({' '.join(p.args)}) died with "
                          f"{p.proc.returncode} during the module")
            p = None
        if p is None:
            args = ["--listen", "127.0.0.1:0", "--local-agents", str(n)]
            args += [str(f) for f in flags] + lib.device_flags(n)
            p = lib.spawn("meshd", lib.MESHD, args, str(reg.tmp), env=env)
            reg.servers.append(p)
            lib.wait_health(p.port, "", lib.SERVING(), proc=p.proc, log=p.log)
            lib.wait_ready(p, n)
            servers[key] = p
        return p
    yield get
    reg.teardown(bool(deaths) or request.session.testsfailed > failed_before)
    assert not deaths, "; ".join(deaths)
