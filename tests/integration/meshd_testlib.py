"""Helpers for the meshd integration tests: generated protos, processes, health.

The tests treat meshd as a black box: they start the real binaries on free
loopback ports (``--listen 127.0.0.1:0 --port-file F``), talk to them with
grpcio as a third-party client would, and kill only the pids they started.

Environment (set by ctest through MESHD_TEST_ENV):
  MESHD_BIN_DIR     where meshd, meshd-agent and meshctl are
  MESHD_SOURCE_DIR  the source tree (for api/*.proto)
  MESHD_BUILD_DIR   the build tree (unused here except as a default for the bin dir)
  MESHD_TEST_DEVICE device of the shared servers' local agents (--local-agent-device):
                    unset = cpu; cuda:emulated; cuda (agent i on GPU i); cuda:N (all on GPU N)
"""

import asyncio
import atexit
import concurrent.futures
import contextlib
import glob
import importlib
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import grpc

# ---------------------------------------------------------------- locations

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_DIR = os.environ.get("MESHD_SOURCE_DIR") or os.path.normpath(os.path.join(HERE, "..", ".."))
BUILD_DIR = os.environ.get("MESHD_BUILD_DIR") or os.path.join(SOURCE_DIR, "build")
BIN_DIR = os.environ.get("MESHD_BIN_DIR") or os.path.join(BUILD_DIR, "bin")

MESHD = os.path.join(BIN_DIR, "meshd")
AGENT = os.path.join(BIN_DIR, "meshd-agent")
MESHCTL = os.path.join(BIN_DIR, "meshctl")

TENSOR_SERVICE = "meshd.v1.TensorService"
AGENT_SERVICE = "meshd.agent.v1.Agent"

# Upper bounds on waits (never assertions on speed).
START_TIMEOUT = 20.0     # a process writes its port file and turns SERVING
REGISTER_TIMEOUT = 20.0  # an agent registers and is dialled back
EXIT_TIMEOUT = 15.0      # a process exits after SIGTERM (when the test does not time it)

_CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]

# ---------------------------------------------------------------- devices

DEVICE = os.environ.get("MESHD_TEST_DEVICE", "") or "cpu"


def gpu_count():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def device_flags(n):
    """--local-agent-device for n local agents on DEVICE; skips the test when the machine
    cannot give each of the n agents its own GPU (DEVICE "cuda") ."""
    import pytest
    if DEVICE == "cpu":
        return []
    if DEVICE == "cuda" and gpu_count() < n:
        pytest.skip(f"needs {n} GPUs for {n} agents, this machine has {gpu_count()}")
    return ["--local-agent-device", DEVICE]


def shares_one_gpu(n):
    """n agents on the same GPU: NCCL refuses a communicator with two ranks on one device."""
    return n > 1 and DEVICE.startswith("cuda:") and DEVICE != "cuda:emulated"


# ---------------------------------------------------------------- generated protos

_pb = {}
_gen_dir = None


def _generate():
    """protoc --python_out into a private temp dir; health.proto flat so that no
    top-level `grpc` package shadows grpcio; tensor_service.proto flat too so that
    no top-level `meshd` package shadows the Python client."""
    global _gen_dir
    _gen_dir = tempfile.mkdtemp(prefix="meshd-it-pb-")
    atexit.register(shutil.rmtree, _gen_dir, True)
    api = os.path.join(SOURCE_DIR, "api")
    for proto_path, name in ((os.path.join(api, "grpc", "health", "v1"), "health.proto"),
                             (os.path.join(api, "meshd", "v1"), "tensor_service.proto")):
        subprocess.run(["protoc", "--proto_path=" + proto_path, "--python_out=" + _gen_dir,
                        os.path.join(proto_path, name)], check=True)
    # The agent-side protos flat as well: agent.proto's import of
    # meshd/v1/tensor_service.proto is rewritten to the flat file generated above.
    for rel, name in (("meshd/v1/agent_registry.proto", "agent_registry.proto"),
                      ("meshd/agent/v1/agent.proto", "agent.proto")):
        with open(os.path.join(api, rel)) as f:
            text = f.read().replace('import "meshd/v1/tensor_service.proto";',
                                    'import "tensor_service.proto";')
        with open(os.path.join(_gen_dir, name), "w") as f:
            f.write(text)
        subprocess.run(["protoc", "--proto_path=" + _gen_dir,
                        "--proto_path=" + os.path.join(api, "meshd", "v1"),
                        "--python_out=" + _gen_dir, os.path.join(_gen_dir, name)], check=True)
    # The reflection protos flat too (no top-level `grpc` package): v1 as
    # reflection.proto, v1alpha copied to reflection_v1alpha.proto.
    for version, name in (("v1", "reflection.proto"), ("v1alpha", "reflection_v1alpha.proto")):
        shutil.copy(os.path.join(api, "grpc", "reflection", version, "reflection.proto"),
                    os.path.join(_gen_dir, name))
        subprocess.run(["protoc", "--proto_path=" + _gen_dir, "--python_out=" + _gen_dir,
                        os.path.join(_gen_dir, name)], check=True)
    sys.path.insert(0, _gen_dir)
    _pb["health"] = importlib.import_module("health_pb2")
    _pb["reflection"] = importlib.import_module("reflection_pb2")
    _pb["reflection_v1alpha"] = importlib.import_module("reflection_v1alpha_pb2")
    _pb["tensor"] = importlib.import_module("tensor_service_pb2")
    _pb["registry"] = importlib.import_module("agent_registry_pb2")
    _pb["agent"] = importlib.import_module("agent_pb2")


def health_pb2():
    if not _pb:
        _generate()
    return _pb["health"]


def tensor_pb2():
    if not _pb:
        _generate()
    return _pb["tensor"]


def fake_tensor_service(**methods):
    """An in-process TensorService answering methods {name: (fn, request class)} (unary):
    a server that says what a test needs, hostile figures included. (server, port);
    server.stop(0) it."""
    t = tensor_pb2()  # noqa: F841 (the messages' module loaded before a handler needs it)
    handler = grpc.method_handlers_generic_handler("meshd.v1.TensorService", {
        name: grpc.unary_unary_rpc_method_handler(
            fn, request_deserializer=req.FromString,
            response_serializer=lambda m: m.SerializeToString())
        for name, (fn, req) in methods.items()})
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def registry_pb2():
    """meshd.v1.AgentRegistry's messages (agent_registry.proto)."""
    if not _pb:
        _generate()
    return _pb["registry"]


def agent_pb2():
    """meshd.agent.v1.Agent's messages (agent.proto)."""
    if not _pb:
        _generate()
    return _pb["agent"]


def reflection_pb2(version="v1"):
    """grpc.reflection.v1's (or v1alpha's) messages (api/grpc/reflection/)."""
    if not _pb:
        _generate()
    return _pb["reflection" if version == "v1" else "reflection_v1alpha"]


class Reflection:
    """One ServerReflectionInfo stream, driven as grpcurl drives it: ask() sends a
    request and returns its response (grpc.RpcError if the call ended instead).

        with lib.Reflection(port) as r:
            names = r.list()
            fdps = r.ask(file_containing_symbol="meshd.v1.TensorService").file_descriptor_response
    """

    def __init__(self, port, metadata=None, version="v1", timeout=10.0, address=None):
        self.pb = reflection_pb2(version)
        self._requests = queue.Queue()
        self._ch = grpc.insecure_channel(address or f"127.0.0.1:{port}", options=_CHANNEL_OPTIONS)
        fn = self._ch.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
            response_deserializer=self.pb.ServerReflectionResponse.FromString)
        self._call = fn(iter(self._requests.get, None), metadata=metadata, timeout=timeout)

    def send(self, request):
        """Queues a request (a message, or raw bytes) without waiting for the answer."""
        self._requests.put(request)

    def ask(self, request=None, **fields):
        self.send(request if request is not None else self.pb.ServerReflectionRequest(**fields))
        return next(self._call)

    def list(self):
        resp = self.ask(list_services="*")
        assert resp.WhichOneof("message_response") == "list_services_response", resp
        return [s.name for s in resp.list_services_response.service]

    def close(self):
        self._requests.put(None)
        self._call.cancel()
        self._ch.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def status_name(value):
    return health_pb2().HealthCheckResponse.ServingStatus.Name(value)


def SERVING():
    return health_pb2().HealthCheckResponse.SERVING


def NOT_SERVING():
    return health_pb2().HealthCheckResponse.NOT_SERVING


def SERVICE_UNKNOWN():
    return health_pb2().HealthCheckResponse.SERVICE_UNKNOWN


# ---------------------------------------------------------------- processes

_started = []  # every Popen this module started; the atexit net kills survivors
spawned = []  # every Process spawn() made, in order (conftest checks their logs)


def _kill_leftovers():
    for p in _started:
        if p.poll() is None:
            try:
                p.kill()
                p.wait(5)
            except Exception:
                pass


atexit.register(_kill_leftovers)


def clean_env(extra=None):
    """The environment for a child: no proxies (gRPC C-core honours http_proxy), no
    MESHD_* variables leaking in from the caller (ctest's MESHD_BIN_DIR included),
    plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if k.lower() not in ("http_proxy", "https_proxy", "grpc_proxy", "all_proxy")
           and not k.startswith("MESHD_")}
    if extra:
        env.update(extra)
    return env


def proc_starttime(pid):
    """Field 22 of /proc/PID/stat, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    rest = data[data.rindex(")") + 2:].split()
    return int(rest[19])


def proc_state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return data[data.rindex(")") + 2:].split()[0]


@contextlib.contextmanager
def range_http_server(root=None):
    """tests/support/range_http_server.py (serving `root` under /files/ when given): yields
    its base URL http://127.0.0.1:PORT; stopped at the end by closing its stdin (it serves
    until then), killed if it has not exited 5 s later."""
    script = os.path.join(SOURCE_DIR, "tests", "support", "range_http_server.py")
    p = subprocess.Popen(["/usr/bin/python3", script] + ([str(root)] if root else []),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        port = int(p.stdout.readline() or 0)
        assert port > 0, "the range server did not print its port"
        yield f"http://127.0.0.1:{port}"
    finally:
        p.stdin.close()
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        p.stdout.close()


def sanitized(pid):
    """Whether process pid runs a sanitizer build (ASan keeps freed memory in its
    quarantine and maps shadow memory, so its RSS says little)."""
    with open(f"/proc/{pid}/maps") as f:
        return "libasan" in f.read()


def rss_kib(pid):
    """VmRSS of process pid, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def all_threads_stopped(pid):
    """Every thread of pid is in the stopped state (SIGSTOP has taken effect)."""
    tids = glob.glob(f"/proc/{pid}/task/*")
    return bool(tids) and all(proc_state(f"{pid}/task/{os.path.basename(t)}") in ("T", "t")
                              for t in tids)


def make_pki(directory):
    """A test PKI in `directory` (tests/support/make_certs.sh: the client CA, the
    cluster CA, a rogue CA and their certificates); returns it as a pathlib.Path."""
    import pathlib
    subprocess.run(["bash", os.path.join(SOURCE_DIR, "tests/support/make_certs.sh"),
                    str(directory)], check=True, capture_output=True, timeout=60)
    return pathlib.Path(directory)


def proc_cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except (FileNotFoundError, ProcessLookupError):
        return []


def children(pid):
    """Direct children of pid (all its threads), as {pid: starttime}."""
    out = {}
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(path) as f:
                for tok in f.read().split():
                    c = int(tok)
                    st = proc_starttime(c)
                    if st is not None and proc_state(c) not in ("Z", "X"):
                        out[c] = st
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def agent_children(pid):
    """Live meshd-agent children of pid: {pid: starttime}."""
    return {c: st for c, st in children(pid).items()
            if any(os.path.basename(a) == "meshd-agent" for a in proc_cmdline(c)[:1])}


def child_rank(pid):
    """The --rank a supervised agent was started with, or None."""
    args = proc_cmdline(pid)
    for i, a in enumerate(args):
        if a == "--rank" and i + 1 < len(args):
            return int(args[i + 1])
        if a.startswith("--rank="):
            return int(a.split("=", 1)[1])
    return None


def alive(pid, starttime):
    """True if the process (pid, starttime) still exists and is not a zombie."""
    st = proc_starttime(pid)
    return st is not None and st == starttime and proc_state(pid) not in ("Z", "X")


def signal_if_alive(pid, starttime, sig):
    """Sends sig to the process (pid, starttime) if it still runs: not to a
    later process that got its pid, and no error when it ended meanwhile (a
    server gave the agent up and reaped it between the check and the kill)."""
    if alive(pid, starttime):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def poll_delays(first=0.005, most=0.05):
    """Sleep lengths for a polling loop: short at first (a process usually
    starts or ends within milliseconds), then at most `most` seconds."""
    d = first
    while True:
        yield d
        d = min(d * 2, most)


def wait_gone(pids, timeout):
    """Waits until none of {pid: starttime} is alive; returns the survivors."""
    deadline = time.monotonic() + timeout
    for delay in poll_delays():
        left = {p: st for p, st in pids.items() if alive(p, st)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(delay)


def log_tail(path, lines=60):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def read_port_file(path, proc, log_path, timeout=START_TIMEOUT):
    """Polls until path holds a port number and a newline; fails early if proc exits."""
    deadline = time.monotonic() + timeout
    for delay in poll_delays():
        try:
            with open(path) as f:
                text = f.read()
            if text.endswith("\n") and text.strip().isdigit():
                port = int(text.strip())
                assert 0 < port < 65536, f"port file {path} holds {text!r}"
                return port
        except FileNotFoundError:
            pass
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args[0]} exited with {proc.returncode} before writing "
                                 f"{path}\n--- log ---\n{log_tail(log_path)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{proc.args[0]} wrote no port to {path} within {timeout} s\n"
                                 f"--- log ---\n{log_tail(log_path)}")
        time.sleep(delay)


class Process:
    """A started binary: proc, port, log path. Unpacks as (port, proc, log)."""

    def __init__(self, kind, proc, port, log, port_file, args):
        self.kind, self.proc, self.port, self.log = kind, proc, port, log
        self.port_file, self.args = port_file, args

    def __iter__(self):
        return iter((self.port, self.proc, self.log))

    @property
    def pid(self):
        return self.proc.pid

    @property
    def address(self):
        return f"127.0.0.1:{self.port}"

    def log_text(self):
        try:
            with open(self.log, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def signal(self, sig):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)


def spawn(kind, binary, args, workdir, env=None, port_file=True, wait_port=True):
    """Starts binary with args (+ --port-file), stdout+stderr to a log in workdir.
    Its TMPDIR is workdir (unless env names one): what it makes there (meshd's
    --local-agents join token directory) goes with the test's temp dir even when the
    process is SIGKILLed and cannot remove it itself."""
    os.makedirs(workdir, exist_ok=True)
    env = dict(env or {})
    env.setdefault("TMPDIR", os.path.abspath(workdir))
    n = len(glob.glob(os.path.join(workdir, f"{kind}-*.log")))
    log = os.path.join(workdir, f"{kind}-{n}.log")
    pf = os.path.join(workdir, f"{kind}-{n}.port") if port_file else None
    argv = [binary] + list(args) + (["--port-file", pf] if pf else [])
    with open(log, "wb") as logf:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                env=clean_env(env))
    _started.append(proc)
    port = read_port_file(pf, proc, log) if (pf and wait_port) else None
    p = Process(kind, proc, port, log, pf, argv)
    spawned.append(p)
    return p


def stop(p, sig=signal.SIGTERM, timeout=EXIT_TIMEOUT):
    """Signals p and waits for it; SIGKILL after timeout. Returns the exit code."""
    if p.proc.poll() is None:
        try:
            os.kill(p.proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            p.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait(10)
    return p.proc.returncode


def run(binary, args, env=None, timeout=20):
    """Runs a short-lived command; returns CompletedProcess (text)."""
    return subprocess.run([binary] + list(args), stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, env=clean_env(env), timeout=timeout)


def _ephemeral_range():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


class DelayRelay:
    """127.0.0.1:self.port -> 127.0.0.1:target_port in a thread of its own: every
    byte towards the target is held `up` seconds, every byte back `down` seconds
    (order kept; throughput is the asyncio loop's, a few hundred MB/s). A server
    far away, or slow to answer, as its client sees it."""

    def __init__(self, target_port, up, down):
        self.target, self.delay = target_port, (up, down)
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        if not ready.wait(10):
            raise RuntimeError("the relay did not start")
        self.address = f"127.0.0.1:{self.port}"

    def _run(self, ready):
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    async def _pipe(self, r, w, delay):
        q = asyncio.Queue()

        async def send():
            while True:
                t, data = await q.get()
                if not data:
                    w.close()
                    return
                wait = t + delay - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                w.write(data)
                await w.drain()
        sender = asyncio.ensure_future(send())
        try:
            while True:
                data = await r.read(1 << 16)
                await q.put((time.monotonic(), data))
                if not data:
                    break
        except OSError:
            await q.put((time.monotonic(), b""))
        await sender

    async def _handle(self, cr, cw):
        ur, uw = await asyncio.open_connection("127.0.0.1", self.target)
        await asyncio.gather(self._pipe(cr, uw, self.delay[0]), self._pipe(ur, cw, self.delay[1]),
                             return_exceptions=True)

    async def _stop(self):
        self.server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.loop.stop()

    def close(self):
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop)
        self.thread.join(10)


def free_port():
    """A port nothing listens on, to be bound later by a process we start: taken
    below the kernel's ephemeral range, so that no other process's port-0 bind (an
    agent's data plane, any client socket) can land on it in between, as one did
    in test_first_minutes; bound and released to check it is free."""
    lo, _ = _ephemeral_range()
    import random
    for _ in range(200):
        port = random.randint(max(1024, lo - 12000), lo - 1)
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
        finally:
            s.close()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # the range below is full: any
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ---------------------------------------------------------------- grpc helpers

def channel(port):
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=_CHANNEL_OPTIONS)


def health_check(port, service="", timeout=5.0):
    """Health/Check; returns the ServingStatus value or raises grpc.RpcError."""
    h = health_pb2()
    with channel(port) as ch:
        call = ch.unary_unary("/grpc.health.v1.Health/Check",
                              request_serializer=h.HealthCheckRequest.SerializeToString,
                              response_deserializer=h.HealthCheckResponse.FromString)
        return call(h.HealthCheckRequest(service=service), timeout=timeout).status


def wait_health(port, service, want, timeout=START_TIMEOUT, proc=None, log=None):
    """Polls Check until it returns `want`; fails with the last answer otherwise."""
    deadline = time.monotonic() + timeout
    last = None
    for delay in poll_delays(0.01, 0.1):
        try:
            last = health_check(port, service, timeout=2.0)
            if last == want:
                return
            last = status_name(last)
        except grpc.RpcError as e:
            last = f"{e.code()}: {e.details()}"
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) while waiting for health "
                                 f"{service!r} = {status_name(want)}; last: {last}\n--- log ---\n"
                                 f"{log_tail(log) if log else ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"health {service!r} on port {port} not {status_name(want)} "
                                 f"within {timeout} s; last: {last}"
                                 + (f"\n--- log ---\n{log_tail(log)}" if log else ""))
        time.sleep(delay)


class Watch:
    """A Health/Watch stream read on a background thread.

    Messages go to a queue as ("msg", status); the end as ("end", grpc.StatusCode, details)."""

    def __init__(self, port, service=""):
        h = health_pb2()
        self._ch = channel(port)
        stream = self._ch.unary_stream("/grpc.health.v1.Health/Watch",
                                       request_serializer=h.HealthCheckRequest.SerializeToString,
                                       response_deserializer=h.HealthCheckResponse.FromString)
        self.call = stream(h.HealthCheckRequest(service=service))
        self.q = queue.Queue()
        self.seen = []
        self.end = None  # (code, details) once ended
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self):
        try:
            for m in self.call:
                self.q.put(("msg", m.status))
            self.q.put(("end", grpc.StatusCode.OK, ""))
        except grpc.RpcError as e:
            self.q.put(("end", e.code(), e.details()))

    def next(self, timeout):
        """The next event, ("msg", status) or ("end", code, details), or None on timeout."""
        try:
            ev = self.q.get(timeout=timeout)
        except queue.Empty:
            return None
        if ev[0] == "msg":
            self.seen.append(ev[1])
        else:
            self.end = (ev[1], ev[2])
        return ev

    def first(self, timeout=10.0):
        ev = self.next(timeout)
        assert ev is not None, f"Watch delivered nothing within {timeout} s"
        assert ev[0] == "msg", f"Watch ended before its first message: {ev[1]} {ev[2]!r}"
        return ev[1]

    def wait_for(self, want, timeout):
        """Reads until a message with status `want`; fails on the end or the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            ev = self.next(max(0.0, left)) if left > 0 else None
            if ev is None:
                raise AssertionError(f"Watch: no {status_name(want)} within {timeout} s; saw "
                                     f"{[status_name(s) for s in self.seen]}")
            if ev[0] == "end":
                raise AssertionError(f"Watch ended ({ev[1]}: {ev[2]!r}) before {status_name(want)}; "
                                     f"saw {[status_name(s) for s in self.seen]}")
            if ev[1] == want:
                return

    def wait_end(self, timeout):
        """Reads to the end; returns (code, details, statuses seen meanwhile) or fails."""
        deadline = time.monotonic() + timeout
        while self.end is None:
            left = deadline - time.monotonic()
            ev = self.next(left) if left > 0 else None
            if ev is None:
                raise AssertionError(f"Watch did not end within {timeout} s; saw "
                                     f"{[status_name(s) for s in self.seen]}")
        return self.end

    def close(self):
        try:
            self.call.cancel()
        except Exception:
            pass
        self._t.join(5)
        self._ch.close()


def unary(port, method, request, response_cls, timeout=5.0, serializer=None, metadata=None):
    """A unary call by full method path; raises grpc.RpcError."""
    with channel(port) as ch:
        call = ch.unary_unary(method,
                              request_serializer=serializer or (lambda m: m.SerializeToString()),
                              response_deserializer=response_cls.FromString)
        return call(request, timeout=timeout, metadata=metadata)


def list_agents(port, timeout=5.0, token=None):
    t = tensor_pb2()
    md = (("authorization", f"Bearer {token}"),) if token else None
    return list(unary(port, "/meshd.v1.TensorService/ListAgents", t.ListAgentsRequest(),
                      t.ListAgentsReply, timeout=timeout, metadata=md).agents)


def describe_agents(agents):
    return [f"rank={a.rank} id={a.agent_id} addr={a.address} healthy={a.healthy}" for a in agents]


def wait_agents(port, predicate, timeout=REGISTER_TIMEOUT, what="agents", log=None):
    """Polls ListAgents until predicate(agents) is true; returns the agents."""
    deadline = time.monotonic() + timeout
    last = None
    for delay in poll_delays(0.01, 0.1):
        try:
            agents = list_agents(port, timeout=2.0)
            if predicate(agents):
                return agents
            last = describe_agents(agents)
        except grpc.RpcError as e:
            last = f"{e.code()}: {e.details()}"
        if time.monotonic() > deadline:
            raise AssertionError(f"ListAgents: {what} not seen within {timeout} s; last: {last}"
                                 + (f"\n--- log ---\n{log_tail(log)}" if log else ""))
        time.sleep(delay)


def healthy_ranks(agents):
    return sorted(a.rank for a in agents if a.healthy)


SANITIZER_MARKS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:",
                   "WARNING: ThreadSanitizer")


def sanitizer_report(log_path, lines=40):
    """The first sanitizer report in the log, its first line and up to `lines` more
    (the stacks: a report at a process's exit is past any log tail's reach), or None."""
    try:
        with open(log_path, errors="replace") as f:
            text = f.read().splitlines()
    except FileNotFoundError:
        return None
    for i, line in enumerate(text):
        if any(m in line for m in SANITIZER_MARKS):
            report = text[i:i + 1 + lines]
            end = next((k for k, x in enumerate(report) if "SUMMARY:" in x), None)
            return "\n".join(report if end is None else report[:end + 1]).strip()
    return None


# ---------------------------------------------------------------- sessions and commands
#
# A small client for TensorService sessions and commands (docs/protocol.md):
#
#   s = Session(port, "it")                          # CreateSession; metadata on every call
#   m = s.run(create_mesh(s.new_ref(), gpu=2)).mesh  # Execute; raises CommandError if rejected
#   err = s.fails("BAD_DIM", slice_mesh(s.new_ref(), m.ref, nope=0))
#   results, code, details = s.submit([s.command(c) for c in cmds])
#
# Builders (create_mesh, factory, call, ...) return (oneof field, message) pairs;
# Session.command wraps one into a Command with a sequence number.

SESSION_MD = "meshd-session"
TOKEN_MD = "meshd-token"
KIND_MD = "meshd-error-kind"
_SVC = "/meshd.v1.TensorService/"

# docs/protocol.md "Error kinds -> gRPC status" (core/tensor/error_kind.h).
KIND_CODES = {
    "WRONG_MESH": grpc.StatusCode.INVALID_ARGUMENT,
    "WRONG_STREAM": grpc.StatusCode.INVALID_ARGUMENT,
    "REF_REUSED": grpc.StatusCode.INVALID_ARGUMENT,
    "BAD_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "SHAPE_MISMATCH": grpc.StatusCode.INVALID_ARGUMENT,
    "DTYPE_MISMATCH": grpc.StatusCode.INVALID_ARGUMENT,
    "BAD_DIM": grpc.StatusCode.INVALID_ARGUMENT,
    "DROPPED": grpc.StatusCode.FAILED_PRECONDITION,
    "BORROWED": grpc.StatusCode.FAILED_PRECONDITION,
    "MUTATING_BORROW": grpc.StatusCode.FAILED_PRECONDITION,
    "UNKNOWN_REF": grpc.StatusCode.NOT_FOUND,
    "UNKNOWN_OP": grpc.StatusCode.NOT_FOUND,
    "QUOTA": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "REMOTE_FAILURE": grpc.StatusCode.ABORTED,
    "DEPENDENT_FAILURE": grpc.StatusCode.ABORTED,
    "AGENT_LOST": grpc.StatusCode.UNAVAILABLE,
    "UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "NO_SESSION": grpc.StatusCode.UNAUTHENTICATED,
    "DEADLINE_EXCEEDED": grpc.StatusCode.DEADLINE_EXCEEDED,
    "UNAUTHENTICATED": grpc.StatusCode.UNAUTHENTICATED,
    "PERMISSION_DENIED": grpc.StatusCode.PERMISSION_DENIED,
}


def wait_ready(srv, n, timeout=REGISTER_TIMEOUT):
    """Waits until TensorService is SERVING and ranks 0..n-1 are registered and healthy."""
    if n:
        wait_health(srv.port, TENSOR_SERVICE, SERVING(), timeout=timeout, proc=srv.proc, log=srv.log)
        wait_agents(srv.port, lambda ag: healthy_ranks(ag)[:n] == list(range(n)), timeout=timeout,
                    what=f"ranks 0..{n - 1} healthy", log=srv.log)
    return srv


def kind_name(value):
    """ErrorKind enum value -> "WRONG_MESH"."""
    return tensor_pb2().ErrorKind.Name(value)[len("ERROR_KIND_"):]


def dtype(name_or_value):
    """"float32" / "DTYPE_FLOAT32" / 1 -> the DType value."""
    if isinstance(name_or_value, int):
        return name_or_value
    n = name_or_value.upper()
    return tensor_pb2().DType.Value(n if n.startswith("DTYPE_") else "DTYPE_" + n)


def trailer(md, key):
    for k, v in md or ():
        if k == key:
            return v
    return None


class CommandError(Exception):
    """A rejected call or command: the gRPC code (Execute) or Error.code (Submit), the
    kind (trailer meshd-error-kind, or Error.kind) and the message."""

    def __init__(self, code, kind, message, seq=None, via="Execute"):
        super().__init__(f"{via}: {code} {kind}: {message}")
        self.code, self.kind, self.message, self.seq, self.via = code, kind, message, seq, via

    @classmethod
    def from_rpc(cls, e, via="Execute"):
        return cls(e.code(), trailer(e.trailing_metadata(), KIND_MD), e.details() or "", via=via)

    @classmethod
    def from_result(cls, err):
        code = next((c for c in grpc.StatusCode if c.value[0] == err.code), err.code)
        return cls(code, kind_name(err.kind), err.message, seq=err.seq, via="Submit")


def expect_kind(err, kind, name=None):
    """Asserts that the CommandError err has kind `kind`, the gRPC code the protocol maps it
    to, and a non-empty message that names the command (`name`, when given)."""
    assert err.kind == kind, f"expected {kind}, got {err}"
    assert err.code == KIND_CODES[kind], f"{kind} travels as {KIND_CODES[kind]}, got {err}"
    assert err.message.strip(), f"{kind}: empty message ({err.via})"
    if name is not None:
        assert name in err.message, f"{kind}: the message does not name {name!r}: {err.message!r}"
    return err


class Ref(int):
    """A tensor argument of a Call (a plain int is an int64 scalar)."""


class Refs(list):
    """A list of tensors argument (cat, stack)."""


class DT(str):
    """A dtype argument of a Call, by name."""


def arg(v):
    t = tensor_pb2()
    if isinstance(v, t.Arg):
        return v
    if isinstance(v, Ref):
        return t.Arg(ref=int(v))
    if isinstance(v, Refs):
        return t.Arg(refs=t.RefList(refs=[int(x) for x in v]))
    if isinstance(v, DT):
        return t.Arg(dtype=dtype(str(v)))
    if v is None:
        return t.Arg(none=True)
    if isinstance(v, bool):
        return t.Arg(b=v)
    if isinstance(v, int):
        return t.Arg(i=v)
    if isinstance(v, float):
        return t.Arg(f=v)
    if isinstance(v, str):
        return t.Arg(s=v)
    if isinstance(v, (list, tuple)):
        return t.Arg(ints=t.IntList(values=list(v)))
    raise TypeError(f"no Arg for {v!r}")


def _dims(dims):
    t = tensor_pb2()
    items = dims.items() if isinstance(dims, dict) else dims
    return [t.Dim(name=n, size=s) for n, s in items]


def selectors(sel):
    """{dim: int | slice | MeshSelector} or [(dim, ...)] -> [MeshSelector]; an int is an index
    (drops the dim), a slice a Range (keeps it)."""
    t = tensor_pb2()
    out = []
    for d, v in (sel.items() if isinstance(sel, dict) else sel):
        if isinstance(v, t.MeshSelector):
            out.append(v)
        elif isinstance(v, slice):
            r = t.Range(start=v.start or 0)
            if v.step is not None:  # slice(0, 4, 0) is refused, as Python refuses it
                r.step, r.has_step = v.step, True
            if v.stop is not None:
                r.stop, r.has_stop = v.stop, True
            out.append(t.MeshSelector(dim=d, range=r))
        else:
            out.append(t.MeshSelector(dim=d, index=v))
    return out


def create_mesh(ref, dims=None, **kw):
    return "create_mesh", tensor_pb2().CreateMesh(ref=ref, dims=_dims(dims if dims is not None else kw))


def slice_mesh(ref, parent, sel=None, **kw):
    return "slice_mesh", tensor_pb2().SliceMesh(ref=ref, parent=parent,
                                                 selectors=selectors(sel if sel is not None else kw))


def create_stream(ref, name):
    return "create_stream", tensor_pb2().CreateStream(ref=ref, name=name)


def factory(ref, mesh, kind="zeros", shape=(), dtype_=None, stream=0, value=0.0, seed=None,
            dim="", start=0.0, end=0.0, step=0.0):
    f = tensor_pb2().Factory(ref=ref, mesh=mesh, stream=stream, kind=kind, shape=list(shape),
                             value=value, dim=dim, start=start, end=end, step=step)
    if dtype_ is not None:
        f.dtype = dtype(dtype_)
    if seed is not None:
        f.seed, f.has_seed = seed, True
    return "factory", f


def answers(reply):
    """The CommandResults of one SubmitReply: a batch's answers, or answers to
    commands sent one per message and answered together (results), or one (result)."""
    return list(reply.results) if reply.results else [reply.result]


def call(op, *args, results=(), stream=0, **kwargs):
    t = tensor_pb2()
    return "call", t.Call(op=op, args=[arg(a) for a in args],
                          kwargs=[t.Kwarg(name=k, value=arg(v)) for k, v in kwargs.items()],
                          results=list(results), stream=stream)


def reduce(ref, input, dims=(), reduction="sum", scatter=False, inplace=False, out=0, stream=0,
           mesh=0):
    return "reduce", tensor_pb2().Reduce(ref=ref, input=input, dims=list(dims), reduction=reduction,
                                         scatter=scatter, inplace=inplace, out=out, stream=stream,
                                         mesh=mesh)


def to_mesh(ref, input, dst_mesh, selection=None, dst_stream=0):
    return "to_mesh", tensor_pb2().ToMesh(ref=ref, input=input, dst_mesh=dst_mesh,
                                          selection=selectors(selection or {}),
                                          dst_stream=dst_stream)


def borrow(ref, input, stream, mutable, borrow_ref):
    b = tensor_pb2().Borrow(ref=ref, input=input, stream=stream, borrow=borrow_ref)
    setattr(b, "mutable", mutable)
    return "borrow", b


def drop_borrow(borrow_ref):
    return "drop_borrow", tensor_pb2().DropBorrow(borrow=borrow_ref)


def drop(*refs):
    return "drop", tensor_pb2().Drop(refs=list(refs))


def release(*refs):
    return "release", tensor_pb2().Release(refs=list(refs))


def sync(stream=None):
    s = tensor_pb2().Sync()
    if stream is not None:
        s.stream, s.has_stream = stream, True
    return "sync", s


def describe(ref):
    return "describe", tensor_pb2().Describe(ref=ref)


class Session:
    """One CreateSession'd session on its own channel. Refs come from new_ref() (strictly
    increasing; gaps are allowed), seqs from run()/command() unless given."""

    def __init__(self, port, client_name="it", ttl_seconds=0, quota_bytes=0, timeout=10.0,
                 ch=None, auth=()):
        """ch: a channel to use (e.g. TLS) instead of plaintext to 127.0.0.1:port; auth:
        metadata every call carries besides the session's, e.g. a bearer token."""
        t = tensor_pb2()
        self.port, self.timeout = port, timeout
        self.auth = tuple(auth)
        self.ch = ch or channel(port)
        reply = self.unary("CreateSession", t.CreateSessionRequest(
            client_name=client_name, ttl_seconds=ttl_seconds, quota_bytes=quota_bytes),
            t.CreateSessionReply, metadata=())
        self.id, self.token, self.ttl_seconds = reply.session_id, reply.token, reply.ttl_seconds
        self._ref = 0
        self._seq = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        # The session ends with its block (its tensors on shared agents go too), best
        # effort: a test may have closed it, let it expire, or stopped the server.
        try:
            t = tensor_pb2()
            self.unary("CloseSession", t.CloseSessionRequest(), t.CloseSessionReply, timeout=2)
        except (grpc.RpcError, ValueError):  # ValueError: the channel was shut already
            pass
        finally:
            self.shut()

    @property
    def metadata(self):
        return ((SESSION_MD, self.id), (TOKEN_MD, self.token)) + self.auth

    def shut(self):
        """Closes the channel (not the session; leaving a `with` block closes both)."""
        self.ch.close()

    def unary(self, method, request, reply_cls, metadata=None, timeout=None):
        """A unary TensorService call; metadata None means this session's. Raises grpc.RpcError."""
        fn = self.ch.unary_unary(_SVC + method, request_serializer=lambda m: m.SerializeToString(),
                                 response_deserializer=reply_cls.FromString)
        return fn(request, metadata=self.metadata if metadata is None else tuple(metadata) + self.auth,
                  timeout=timeout or self.timeout)

    def close(self, metadata=None):
        t = tensor_pb2()
        return self.unary("CloseSession", t.CloseSessionRequest(), t.CloseSessionReply, metadata)

    def keep_alive(self, metadata=None):
        t = tensor_pb2()
        return self.unary("KeepAlive", t.KeepAliveRequest(), t.KeepAliveReply, metadata)

    def list_sessions(self):
        t = tensor_pb2()
        return list(self.unary("ListSessions", t.ListSessionsRequest(), t.ListSessionsReply,
                               metadata=()).sessions)

    def info(self):
        """This session's row of ListSessions, or None."""
        return next((x for x in self.list_sessions() if x.session_id == self.id), None)

    def new_ref(self):
        self._ref += 1
        return self._ref

    def skip_to(self, ref):
        """Makes new_ref() continue after ref (for tests that pick refs by hand)."""
        self._ref = max(self._ref, ref)

    def next_seq(self):
        self._seq += 1
        return self._seq

    def command(self, cmd, seq=None):
        field, msg = cmd
        c = tensor_pb2().Command(seq=self.next_seq() if seq is None else seq)
        getattr(c, field).CopyFrom(msg)
        return c

    def execute_raw(self, command, metadata=None, timeout=None):
        """Execute on a Command; raises CommandError when rejected."""
        try:
            return self.unary("Execute", command, tensor_pb2().CommandResult, metadata, timeout)
        except grpc.RpcError as e:
            raise CommandError.from_rpc(e) from None

    def run(self, cmd, seq=None, timeout=None):
        return self.execute_raw(self.command(cmd, seq), timeout=timeout)

    def fails(self, kind, cmd, name=None, seq=None, timeout=None):
        """Runs cmd, which must be rejected with `kind` (and its code); returns the CommandError."""
        try:
            res = self.run(cmd, seq, timeout)
        except CommandError as e:
            return expect_kind(e, kind, name)
        raise AssertionError(f"{cmd[0]} {cmd[1]} was accepted ({res}); expected {kind}")

    def submit(self, commands, timeout=60.0, metadata=None):
        """Submit: sends every Command (pipelined, without waiting), half-closes, and reads
        to the end. Returns ([CommandResult], final code, details)."""
        t = tensor_pb2()
        fn = self.ch.stream_stream(_SVC + "Submit", request_serializer=lambda b: b,
                                   response_deserializer=t.SubmitReply.FromString)
        # Packed before the call: written as fast as grpcio goes, back to back.
        it = fn(iter([c.SerializeToString() for c in commands]),
                metadata=self.metadata if metadata is None else tuple(metadata) + self.auth,
                timeout=timeout)
        results = []
        self.submit_messages = 0  # SubmitReply messages read (a batch's answers come in one)
        try:
            for r in it:
                self.submit_messages += 1
                results.extend(answers(r))
            return results, it.code(), it.details()
        except grpc.RpcError as e:
            return results, e.code(), e.details()

    # -- conveniences returning metadata (each picks a fresh ref)

    def mesh(self, dims=None, **kw):
        return self.run(create_mesh(self.new_ref(), dims, **kw)).mesh

    def slice(self, parent, sel=None, **kw):
        return self.run(slice_mesh(self.new_ref(), parent, sel, **kw)).mesh

    def stream(self, name):
        ref = self.new_ref()
        self.run(create_stream(ref, name))
        return ref

    def tensor(self, mesh, shape=(), kind="zeros", dtype_="float32", **kw):
        return self.run(factory(self.new_ref(), mesh, kind, shape, dtype_, **kw)).tensors[0]

    def op(self, op, *args, nresults=1, stream=0, **kwargs):
        """A Call with nresults fresh result refs; returns the result TensorMetas."""
        res = self.run(call(op, *args, results=[self.new_ref() for _ in range(nresults)],
                            stream=stream, **kwargs))
        return list(res.tensors)

    def describe(self, ref):
        return self.run(describe(ref))

    def missing_ops(self, mesh, factories=(), calls=()):
        """Names from `factories` (Factory kinds) and `calls` (Call ops) that the server's op
        catalogue lacks. Probes change nothing: a Call with no arguments, a Factory with an
        invalid dtype; both reach the catalogue lookup before any other check that could pass."""
        missing = []
        for k in factories:
            try:
                self.run(factory(self._ref + 1, mesh, k, (1,), 999))
            except CommandError as e:
                if e.kind == "UNKNOWN_OP":
                    missing.append(k)
        for op in calls:
            try:
                self.run(call(op))
            except CommandError as e:
                if e.kind == "UNKNOWN_OP":
                    missing.append(op)
        return missing


# ---------------------------------------------------------------- an agent's own server
#
# An agent serves its Agent service (Hello, Execute, Read, Write) only to the server
# it registered with, which proves it with the call secret the agent sent in its
# RegisterRequest (docs/operations.md "Cluster security"). A test that drives an agent
# directly registers it with a FakeRegistry and uses the secret as the server would:
#
#   with FakeRegistry() as reg:
#       a = agent_fixture(reg.port)              # meshd-agent --server 127.0.0.1:PORT
#       hello = reg.wait()                       # its RegisterRequest
#       md = reg.metadata()                      # (("meshd-agent-secret", ...),)
#       reg.hello()                              # Agent/Hello as the server's dial-back
#       ... stub calls on a.address with metadata=md ...

AGENT_SECRET_MD = "meshd-agent-secret"
JOIN_TOKEN_MD = "meshd-join-token"


class FakeRegistry:
    """meshd.v1.AgentRegistry/RegisterAgent in process (grpcio): admits every agent
    (with `token` set, only those presenting it) as rank `rank` (or its requested rank),
    keeps its RegisterRequest, dials the agent back (Agent/Hello, as meshd does; not
    with `tls`), and holds the call open until close() or drop().

    With `upstream` (a real meshd's registry address) it admits nobody itself: it
    relays each registration to that server both ways and only keeps the
    RegisterRequest, so a test learns the call secret of agents a real server drives
    (`secret_md(address)`)."""

    def __init__(self, token=None, rank=0, upstream=None, tls=None):
        """tls: (key, certificate, ca) PEM bytes: the registry port is mTLS, as a
        server's --cluster-listen is."""
        self.token, self.rank, self.upstream = token, rank, upstream
        self.tls = tls
        self.by_address = {}
        self.registrations = queue.Queue()
        self.last = None
        self.refused = []
        self._stop = threading.Event()
        self._drop = threading.Event()
        reg = registry_pb2()
        handler = grpc.method_handlers_generic_handler("meshd.v1.AgentRegistry", {
            "RegisterAgent": grpc.stream_stream_rpc_method_handler(
                self._register, request_deserializer=reg.AgentToServer.FromString,
                response_serializer=lambda m: m.SerializeToString())})
        # Agents ping their registration call every second: allow it, as meshd does.
        opts = [("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 500),
                ("grpc.http2.max_ping_strikes", 0)]
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=16),
                                  options=opts)
        self.server.add_generic_rpc_handlers((handler,))
        if tls:
            creds = grpc.ssl_server_credentials([(tls[0], tls[1])], root_certificates=tls[2],
                                                require_client_auth=True)
            self.port = self.server.add_secure_port("127.0.0.1:0", creds)
        else:
            self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def address(self):
        return f"127.0.0.1:{self.port}"

    def _relay(self, requests, context):
        reg = registry_pb2()
        first = next(requests, None)
        if first is None:
            return
        md = [(k, v) for k, v in context.invocation_metadata() if k == JOIN_TOKEN_MD]
        ch = grpc.insecure_channel(self.upstream, options=_CHANNEL_OPTIONS + [
            ("grpc.keepalive_time_ms", 1000), ("grpc.keepalive_timeout_ms", 1000),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)])
        fn = ch.stream_stream("/meshd.v1.AgentRegistry/RegisterAgent",
                              request_serializer=lambda m: m.SerializeToString(),
                              response_deserializer=reg.ServerToAgent.FromString)

        def upward():
            yield first
            for m in requests:
                yield m
        call = fn(upward(), metadata=md)
        context.add_callback(call.cancel)
        try:
            for m in call:
                if m.WhichOneof("msg") == "accepted":
                    self.by_address[first.hello.address] = first.hello
                    self.registrations.put((first.hello, m.accepted.rank))
                yield m
        except grpc.RpcError as e:
            context.abort(e.code(), e.details() or "")
        finally:
            ch.close()

    def secret_md(self, address):
        """The call-secret metadata of the agent that registered with this address."""
        return ((AGENT_SECRET_MD, self.by_address[address].call_secret),)

    def _register(self, requests, context):
        if self.upstream:
            yield from self._relay(requests, context)
            return
        reg = registry_pb2()
        if self.token is not None:
            got = dict(context.invocation_metadata()).get(JOIN_TOKEN_MD)
            if got != self.token:
                self.refused.append(context.peer())
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong join token")
        first = next(requests, None)
        if first is None or first.WhichOneof("msg") != "hello":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "expected hello")
        hello = first.hello
        rank = hello.requested_rank if hello.requested_rank >= 0 else self.rank
        self.registrations.put((hello, rank))
        yield reg.ServerToAgent(accepted=reg.RegisterAccepted(rank=rank, server_id="fake"))
        if not self.tls:  # the dial-back, as meshd does: the agent is ready after it
            threading.Thread(target=self._dial_back, args=(hello, rank), daemon=True).start()
        while not self._stop.is_set() and not self._drop.is_set() and context.is_active():
            time.sleep(0.02)
        if self._drop.is_set():
            self._drop.clear()
            context.abort(grpc.StatusCode.UNAVAILABLE, "dropped by the test")

    def wait(self, timeout=REGISTER_TIMEOUT):
        """The next RegisterRequest (and keeps it as .last); fails after timeout."""
        try:
            self.last = self.registrations.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no agent registered with the fake registry within {timeout} s")
        return self.last[0]

    def metadata(self, hello=None):
        """What every call to the agent carries: its call secret."""
        return ((AGENT_SECRET_MD, (hello or self.last[0]).call_secret),)

    def _dial_back(self, hello, rank):
        try:
            self.hello(timeout=5.0, registered=(hello, rank))
        except grpc.RpcError:
            pass  # the registration ended meanwhile; the agent registers again

    def hello(self, timeout=5.0, registered=None):
        """Agent/Hello as the server's dial-back (sets the agent's rank); the reply."""
        hello, rank = registered or self.last
        a = agent_pb2()
        with grpc.insecure_channel(hello.address, options=_CHANNEL_OPTIONS) as ch:
            fn = ch.unary_unary("/meshd.agent.v1.Agent/Hello",
                                request_serializer=lambda m: m.SerializeToString(),
                                response_deserializer=a.HelloReply.FromString)
            return fn(a.HelloRequest(agent_id=hello.agent_id, rank=rank, server_id="fake"),
                      metadata=self.metadata(hello), timeout=timeout)

    def channel(self, hello=None):
        """A channel to the registered agent that sends its call secret on every call."""
        hello = hello or self.last[0]
        return agent_channel(hello.address, self.metadata(hello))

    def drop(self):
        """Ends the open registration (UNAVAILABLE): the agent registers again."""
        self._drop.set()

    def close(self):
        self._stop.set()
        self.server.stop(grace=0.5).wait(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _AddMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, md):
        self.md = tuple(md)

    def _details(self, d):
        return _CallDetails(d.method, d.timeout, tuple(d.metadata or ()) + self.md,
                            d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, cont, d, req):
        return cont(self._details(d), req)

    def intercept_unary_stream(self, cont, d, req):
        return cont(self._details(d), req)

    def intercept_stream_unary(self, cont, d, reqs):
        return cont(self._details(d), reqs)

    def intercept_stream_stream(self, cont, d, reqs):
        return cont(self._details(d), reqs)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = \
            credentials, wait_for_ready, compression


def agent_channel(address, md):
    """A plaintext channel to an agent that adds md (its call secret: FakeRegistry's
    metadata() or secret_md()) to every call."""
    ch = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
    return grpc.intercept_channel(ch, _AddMetadata(md))


# ---------------------------------------------------------------- files over HTTP, for loads

class HttpFiles:
    """An HTTP/1.1 server on a free loopback port serving the files of `root` as the
    agents' URL loads read them: HEAD, GET and single `Range: bytes=a-b` requests (206
    with Content-Range); a missing file is 404. A path under /trickle/ sends its body
    in 64 KiB pieces 20 ms apart (about 3 MB/s a request), for loads that take a while;
    under /slow/ 100 ms apart (about 0.6 MB/s), for loads still running seconds later.
    `sending` counts the bodies being written now (a reader that hangs up ends its
    own). Use as a context manager; url(name) gives the file's URL."""

    def __init__(self, root):
        import http.server
        import socketserver
        files = str(root)
        outer = self
        self._mu = threading.Lock()
        self.sending = 0  # bodies being written now

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_HEAD(self):
                self.do_GET()

            def do_GET(self):
                parts = self.path.split("?")[0].strip("/").split("/")
                pace = {"trickle": 0.02, "slow": 0.1}.get(parts[0], 0)
                trickle = pace > 0
                name = os.path.join(files, *parts[1 if trickle else 0:])
                if not os.path.isfile(name):
                    body, code, headers = b"not found", 404, []
                else:
                    with open(name, "rb") as f:
                        data = f.read()
                    code, first, last = 200, 0, len(data) - 1
                    rng = self.headers.get("Range", "")
                    if rng.startswith("bytes="):
                        a, b = rng[6:].split("-")
                        first, last, code = int(a), min(int(b or last), last), 206
                    body = data[first:last + 1]
                    headers = [("Accept-Ranges", "bytes")]
                    if code == 206:
                        headers.append(("Content-Range", f"bytes {first}-{last}/{len(data)}"))
                self.send_response(code)
                for k, v in headers + [("Content-Length", str(len(body)))]:
                    self.send_header(k, v)
                self.end_headers()
                if self.command == "HEAD":
                    return
                with outer._mu:
                    outer.sending += 1
                try:
                    for i in range(0, len(body), 65536):
                        self.wfile.write(body[i:i + 65536])
                        if trickle:
                            self.wfile.flush()
                            time.sleep(pace)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the reader went away: a load stopped
                finally:
                    with outer._mu:
                        outer.sending -= 1

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True

        self._srv = Server(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self._srv.server_address[1]}"
        self._thread = threading.Thread(target=self._srv.serve_forever, daemon=True)
        self._thread.start()

    def url(self, name):
        return f"{self.base}/{name}"

    def close(self):
        self._srv.shutdown()
        self._srv.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def safetensors_bytes(tensors):
    """A safetensors file from its spec, for numpy arrays {name: array}: the JSON
    header's length (u64 little-endian), the header (dtype, shape, data_offsets into the
    buffer), padded with spaces to 8 bytes, then the buffer."""
    import json
    import struct
    codes = {"float32": "F32", "float64": "F64", "float16": "F16", "int64": "I64",
             "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
    header, buf = {}, b""
    for k, a in tensors.items():
        raw = a.astype(a.dtype.newbyteorder("<")).tobytes()
        header[k] = {"dtype": codes[a.dtype.name], "shape": list(a.shape),
                     "data_offsets": [len(buf), len(buf) + len(raw)]}
        buf += raw
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + buf
