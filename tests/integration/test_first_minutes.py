"""docs/operations.md "First 10 minutes": every command of its shell block, run.

The block is parsed from the document and its commands run in order, in an
environment that stands in for Docker Compose on one host:

  * docker/compose.yaml's services (those of no profile) are local processes,
    each with exactly its image's ENTRYPOINT and ENV (docker/*.Dockerfile, read
    by dockerfiles.py), its command and environment. Every container port a
    service listens on ("0.0.0.0:P") gets a free loopback port; a service name
    (server:50053, agent-2:50052) resolves to that service's port, and the host
    reaches only the ports compose publishes (localhost:50051). Secrets are the
    files docker/make-secrets.sh made, at /run/secrets/<name>; the tmpfs mounts
    (/tmp: HOME, TMPDIR, WORKDIR) are directories of their own.
  * `docker compose -f docker/compose.yaml up|ps|down`, `docker inspect -f
    '{{.State.Pid}}' CONTAINER` and `[sudo] kill -9 PID` are interpreted here: up
    starts the services (depends_on first), down stops them with SIGTERM and
    needs exit 0 within stop_grace_period, and a killed process is started again
    as `restart: unless-stopped` does, once the server has seen it go.
  * `meshctl` is the built binary, `curl -s URL` a plain HTTP GET, `grpcurl` the
    real one where it is on PATH, else a stand-in that does the same through
    gRPC server reflection (list, describe).
  * pipes into grep/head, `until CMD; do sleep N; done` (bounded), `$(...)` and
    comments are understood; any other command fails the test, so the
    document cannot drift from what was checked.

Each command must exit 0, and the outputs the walk-through is about are
checked: the services listed, TensorService described, 4 healthy agents in the
metrics and in `meshctl agents`, agent-2 killed and registered again.
"""

import os
import re
import shlex
import shutil
import signal
import subprocess
import time
import urllib.request

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool

import dockerfiles as df
import meshd_testlib as lib

SECTION = "First 10 minutes"
COMPOSE_FILE = "docker/compose.yaml"
UNTIL_TIMEOUT = 30.0
RESTART_DELAY = 0.1  # Docker's first restart-policy delay


# ---------------------------------------------------------------- the document

def section_commands():
    """The commands of the section's ```sh blocks: comments gone, continuations joined."""
    text = open(os.path.join(lib.SOURCE_DIR, "docs", "operations.md")).read()
    m = re.search(rf"^## {re.escape(SECTION)}\n(.*?)(?=^## )", text, re.M | re.S)
    assert m, f'docs/operations.md has no "## {SECTION}" section'
    blocks = re.findall(r"^```(?:sh|bash|console)\n(.*?)^```", m.group(1), re.M | re.S)
    assert blocks, f"{SECTION}: no ```sh block"
    cmds, cur = [], ""
    for line in "\n".join(blocks).splitlines():
        line = strip_comment(line).rstrip()
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        if cur.strip():
            cmds.append(cur.strip())
        cur = ""
    return cmds


def _outside_quotes(s):
    """Yields (index, char) of the characters of s outside '...' and "..."."""
    q = None
    for i, ch in enumerate(s):
        if q:
            if ch == q:
                q = None
        elif ch in "'\"":
            q = ch
        else:
            yield i, ch


def strip_comment(line):
    for i, ch in _outside_quotes(line):
        if ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def split_pipes(cmd):
    cuts = [i for i, ch in _outside_quotes(cmd) if ch == "|"]
    parts, start = [], 0
    for i in cuts:
        parts.append(cmd[start:i].strip())
        start = i + 1
    parts.append(cmd[start:].strip())
    return parts


# ---------------------------------------------------------------- compose stand-in

class Compose:
    def __init__(self, tmp, secrets_dir):
        self.tmp = str(tmp)
        self.secrets_dir = secrets_dir
        self.spec = df.load_compose()
        self.project = self.spec["name"]
        self.images = df.image_dockerfiles()
        self.services = {}  # name -> dict(spec, image, ports{container: local}, proc, log, ...)
        self.published = {}  # host port -> (service, container port)
        self.restarts = {}
        self.server = None
        self._given = set()

    def _listens(self, name, svc, image):
        words = list(svc.get("command") or []) + [str(v) for v in
                                                  {**image["env"], **(svc.get("environment") or {})}.values()]
        ports = {int(m.group(1)) for w in words for m in [re.fullmatch(r"0\.0\.0\.0:(\d+)", w)] if m}
        return {p: self._free_port() for p in sorted(ports)}

    def _free_port(self):
        """A free loopback port none of the services was given yet (all are given
        before any binds, so free_port alone could hand one out twice)."""
        while True:
            port = lib.free_port()
            if port not in self._given:
                self._given.add(port)
                return port

    def create(self):
        """Every default service (no profile): ports, directories, the published map."""
        for name, svc in self.spec["services"].items():
            if svc.get("profiles"):
                continue
            image = df.final(self.images[svc["image"].split(":")[0]])
            s = dict(name=name, spec=svc, image=image, ports=self._listens(name, svc, image),
                     proc=None, log=os.path.join(self.tmp, f"{name}.log"), tmpfs={})
            for t in svc.get("tmpfs", []):
                mount = t.split(":")[0]
                local = os.path.join(self.tmp, f"{name}-tmpfs{mount.replace('/', '-')}")
                os.makedirs(local, exist_ok=True)
                s["tmpfs"][mount] = local
            self.services[name] = s
            for p in svc.get("ports", []):
                host, _, cont = str(p).rpartition(":")
                ip, _, host = host.rpartition(":")  # "127.0.0.1:50051:50051": this host only
                assert ip in ("", "127.0.0.1"), f"{name}: publishes on {ip}"
                assert int(cont) in s["ports"], f"{name}: publishes {cont}, where it does not listen"
                self.published[int(host)] = (name, int(cont))
            if "--min-agents" in (svc.get("command") or []):
                self.server = s

    def resolve(self, name, addr):
        host, _, port = addr.rpartition(":")
        port = int(port)
        if host == "0.0.0.0":
            return f"127.0.0.1:{self.services[name]['ports'][port]}"
        assert host in self.services, f"{name}: {addr} names no service of {COMPOSE_FILE}"
        other = self.services[host]
        assert port in other["ports"], f"{name}: {addr}: {host} does not listen on {port}"
        return f"127.0.0.1:{other['ports'][port]}"

    def host_addr(self, addr):
        """A host-side address (localhost:P): only what compose publishes."""
        host, _, port = addr.rpartition(":")
        assert host in ("localhost", "127.0.0.1"), f"{addr}: the walk-through runs on the compose host"
        assert int(port) in self.published, f"{addr}: compose publishes no port {port}"
        name, cont = self.published[int(port)]
        return f"127.0.0.1:{self.services[name]['ports'][cont]}"

    def _path(self, s, value):
        m = re.fullmatch(r"/run/secrets/([\w.-]+)", value)
        if m:
            assert m.group(1) in s["spec"].get("secrets", []), f"{s['name']}: secret {m.group(1)} not granted"
            src = self.spec["secrets"][m.group(1)]["file"]
            assert src.startswith("./secrets/"), src
            return os.path.join(self.secrets_dir, src[len("./secrets/"):])
        for mount, local in s["tmpfs"].items():
            if value == mount or value.startswith(mount + "/"):
                return local + value[len(mount):]
        return value

    def _value(self, s, key, value):
        value = str(value)
        if re.fullmatch(r"[\w.-]+:\d+", value) and key != "MESHD_DEVICE":
            return self.resolve(s["name"], value)
        return self._path(s, value)

    def start(self, name):
        s = self.services[name]
        svc, image = s["spec"], s["image"]
        env = {k: self._value(s, k, v) for k, v in {**image["env"], **(svc.get("environment") or {})}.items()}
        argv = [os.path.join(lib.BIN_DIR, image["entrypoint"][0])] + image["entrypoint"][1:]
        argv += [self._value(s, "", w) if re.fullmatch(r"[\w.-]+:\d+", w) else w
                 for w in svc.get("command") or []]
        cwd = self._path(s, image["workdir"])
        assert svc.get("read_only") and cwd != image["workdir"], \
            f"{name}: read_only, but WORKDIR {image['workdir']} is no tmpfs"
        env["PATH"] = lib.BIN_DIR + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin")
        with open(s["log"], "ab") as logf:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                    env=lib.clean_env(env), cwd=cwd)
        lib._started.append(proc)
        s.update(proc=proc, argv=argv, started=time.monotonic())

    def up(self):
        assert not self.services, "up twice"
        self.create()
        done = set()

        def bring(name):
            if name in done:
                return
            for dep in self.services[name]["spec"].get("depends_on", {}):
                bring(dep)
            self.start(name)
            done.add(name)
        for name in self.services:
            bring(name)
        return ""

    def container(self, name):
        m = re.fullmatch(rf"{re.escape(self.project)}-(.+)-1", name)
        assert m and m.group(1) in self.services, f"no container {name} (project {self.project})"
        return self.services[m.group(1)]

    def ps(self, only=None):
        rows = [f"{'NAME':<20} {'SERVICE':<10} STATUS"]
        for name, s in self.services.items():
            if only and name not in only:
                continue
            if s["proc"] and s["proc"].poll() is None:
                status = f"Up {int(time.monotonic() - s['started'])} seconds"
            else:
                status = f"Exited ({s['proc'].returncode if s['proc'] else '-'})"
            rows.append(f"{self.project}-{name}-1".ljust(20) + f" {name:<10} {status}")
        return "\n".join(rows) + "\n"

    def kill(self, pid, sig):
        """A crash of a container's main process; restart: unless-stopped brings it back."""
        hit = [s for s in self.services.values() if s["proc"] and s["proc"].pid == pid]
        assert hit, f"kill {pid}: no container's process"
        s = hit[0]
        assert s["spec"].get("restart") == "unless-stopped", f"{s['name']}: restart {s['spec'].get('restart')}"
        os.kill(pid, sig)
        s["proc"].wait(10)
        cmd = s["spec"].get("command") or []
        if "--rank" in cmd and self.server is not s:
            # The container is dead once the server has seen it go: no command of
            # the walk-through can run before that.
            rank = int(cmd[cmd.index("--rank") + 1])
            lib.wait_agents(self.server["ports"][50051], lambda a: rank not in lib.healthy_ranks(a),
                            timeout=10, what=f"rank {rank} lost")
        time.sleep(RESTART_DELAY)
        self.start(s["name"])
        self.restarts[s["name"]] = self.restarts.get(s["name"], 0) + 1

    def down(self):
        for s in self.services.values():
            if s["proc"] and s["proc"].poll() is None:
                os.kill(s["proc"].pid, signal.SIGTERM)
        codes = {}
        for s in self.services.values():
            grace = int(str(s["spec"].get("stop_grace_period", "10s")).rstrip("s"))
            try:
                codes[s["name"]] = s["proc"].wait(grace)
            except subprocess.TimeoutExpired:
                s["proc"].kill()
                s["proc"].wait(10)
                codes[s["name"]] = "SIGKILL after stop_grace_period"
        bad = {k: v for k, v in codes.items() if v != 0}
        assert not bad, f"down: not exit 0 within stop_grace_period: {bad}\n" + "\n".join(
            f"--- {k} ---\n{lib.log_tail(self.services[k]['log'], 20)}" for k in bad)
        return ""

    def diagnose(self):
        """ps, ListAgents and the logs' tails: for a failure's message."""
        out = [self.ps()]
        try:
            out.append("\n".join(lib.describe_agents(lib.list_agents(self.server["ports"][50051]))))
        except (grpc.RpcError, TypeError) as e:
            out.append(f"ListAgents: {e}")
        for name, s in self.services.items():
            out.append(f"--- {name} ---\n{lib.log_tail(s['log'], 15)}")
        return "\n".join(out)

    def stop_all(self):
        for s in self.services.values():
            if s["proc"] and s["proc"].poll() is None:
                s["proc"].kill()
                s["proc"].wait(10)


# ---------------------------------------------------------------- grpcurl stand-in

def _pool(file_protos):
    pool = descriptor_pool.DescriptorPool()
    pending = {f.name: f for f in file_protos}
    while pending:
        added = False
        for name, f in list(pending.items()):
            if all(d not in pending for d in f.dependency):
                pool.Add(f)
                del pending[name]
                added = True
        assert added, f"reflection: unresolved imports among {sorted(pending)}"
    return pool


def grpcurl_standin(argv, addr_of):
    """grpcurl -plaintext ADDR list [SERVICE] | describe SYMBOL, through reflection."""
    args = list(argv)
    assert args and args[0] == "-plaintext", f"grpcurl {argv}: only -plaintext is stood in for"
    address, verb, rest = addr_of(args[1]), args[2], args[3:]
    with lib.Reflection(0, address=address) as r:
        if verb == "list" and not rest:
            return "".join(n + "\n" for n in sorted(r.list()))
        assert verb == "describe" and len(rest) == 1, f"grpcurl {argv}: not stood in for"
        symbol = rest[0]
        resp = r.ask(file_containing_symbol=symbol)
        assert resp.WhichOneof("message_response") == "file_descriptor_response", \
            f"grpcurl describe {symbol}: {resp.error_response}"
        protos = [descriptor_pb2.FileDescriptorProto.FromString(b)
                  for b in resp.file_descriptor_response.file_descriptor_proto]
        pool = _pool(protos)
    try:
        svc = pool.FindServiceByName(symbol)
    except KeyError:
        msg = pool.FindMessageTypeByName(symbol)
        lines = [f"{symbol} is a message:", f"message {msg.name} {{"]
        lines += [f"  {f.name} = {f.number};" for f in msg.fields]
        return "\n".join(lines + ["}"]) + "\n"
    lines = [f"{symbol} is a service:", f"service {svc.name} {{"]
    for m in svc.methods:
        cs = "stream " if m.client_streaming else ""
        ss = "stream " if m.server_streaming else ""
        lines.append(f"  rpc {m.name} ( {cs}.{m.input_type.full_name} ) returns "
                     f"( {ss}.{m.output_type.full_name} );")
    return "\n".join(lines + ["}"]) + "\n"


# ---------------------------------------------------------------- the interpreter

class Walk:
    def __init__(self, tmp):
        self.tmp = str(tmp)
        self.secrets_dir = os.path.join(self.tmp, "secrets")
        self.compose = Compose(tmp, self.secrets_dir)
        self.ran = []  # (kind, argv, output, rc)

    def sh(self, cmd):
        """One command line of the document: returns (output, exit status)."""
        m = re.fullmatch(r"until (.+?); do sleep (\d+); done", cmd)
        if m:
            deadline = time.monotonic() + UNTIL_TIMEOUT
            while True:
                out, rc = self.sh(m.group(1))
                if rc == 0:
                    return out, 0
                dead = [n for n, s in self.compose.services.items() if s["proc"].poll() is not None]
                assert not dead, f"{cmd}: {dead} exited\n{self.compose.diagnose()}"
                assert time.monotonic() < deadline, \
                    f"{cmd}: not true within {UNTIL_TIMEOUT} s: {out}\n{self.compose.diagnose()}"
                time.sleep(0.1)  # the document's pause, shortened
        # $(...) first, as the shell does.
        cmd = re.sub(r'"?\$\(([^()]*)\)"?', lambda s: shlex.quote(self.run_ok(s.group(1)).strip()), cmd)
        stages = split_pipes(cmd)
        out, rc = self.stage(shlex.split(stages[0]))
        for st in stages[1:]:
            argv = shlex.split(st)
            assert argv[0] in ("grep", "head", "tail", "wc"), f"{st}: not understood after a pipe"
            r = subprocess.run(argv, input=out, capture_output=True, text=True)
            out, rc = r.stdout, r.returncode
        return out, rc

    def run_ok(self, cmd):
        out, rc = self.sh(cmd)
        assert rc == 0, f"{cmd}: exit {rc}\n{out}"
        return out

    def stage(self, argv):
        c = self.compose
        if argv[0] == "sudo":
            argv = argv[1:]
        if argv[0] == "docker/make-secrets.sh":
            assert len(argv) == 1, argv
            r = subprocess.run([os.path.join(lib.SOURCE_DIR, "docker", "make-secrets.sh"), self.secrets_dir],
                               capture_output=True, text=True, timeout=60)
            return self.record("make-secrets", argv, r.stdout + r.stderr, r.returncode)
        if argv[:2] == ["docker", "compose"]:
            assert argv[2:4] == ["-f", COMPOSE_FILE], f"{argv}: docker compose -f {COMPOSE_FILE} ..."
            verb, rest = argv[4], argv[5:]
            if verb == "up":
                assert set(rest) <= {"-d", "--build"} and "-d" in rest, f"{argv}: up -d [--build]"
                return self.record("up", argv, c.up(), 0)
            if verb == "ps":
                return self.record("ps", argv, c.ps(rest), 0)
            if verb == "down":
                assert not rest, argv
                return self.record("down", argv, c.down(), 0)
            raise AssertionError(f"{argv}: docker compose {verb} is not stood in for")
        if argv[:2] == ["docker", "inspect"]:
            assert argv[2:4] == ["-f", "{{.State.Pid}}"] and len(argv) == 5, argv
            return self.record("inspect", argv, f"{c.container(argv[4])['proc'].pid}\n", 0)
        if argv[0] == "kill":
            assert len(argv) == 3 and argv[1] in ("-9", "-KILL"), argv
            c.kill(int(argv[2]), signal.SIGKILL)
            return self.record("kill", argv, "", 0)
        if argv[0] == "meshctl":
            args = list(argv[1:])
            assert args[0] == "--server", f"{argv}: --server first"
            args[1] = c.host_addr(args[1])
            r = subprocess.run([lib.MESHCTL] + args, capture_output=True, text=True, timeout=30,
                               env=lib.clean_env())
            return self.record("meshctl " + args[2], argv, r.stdout + r.stderr, r.returncode)
        if argv[0] == "grpcurl":
            real = shutil.which("grpcurl")
            if real:
                args = [c.host_addr(a) if re.fullmatch(r"localhost:\d+", a) else a for a in argv[1:]]
                r = subprocess.run([real] + args, capture_output=True, text=True, timeout=30)
                out, rc = r.stdout + r.stderr, r.returncode
            else:
                out, rc = grpcurl_standin(argv[1:], c.host_addr), 0
            return self.record("grpcurl " + argv[3], argv, out, rc)
        if argv[0] == "curl":
            assert argv[1] == "-s" and len(argv) == 3, f"{argv}: curl -s URL"
            m = re.fullmatch(r"(?:http://)?([\w.]+:\d+)(/.*)", argv[2])
            assert m, argv
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            with opener.open(f"http://{c.host_addr(m.group(1))}{m.group(2)}", timeout=10) as r:
                return self.record("curl", argv, r.read().decode(), 0 if r.status == 200 else 22)
        raise AssertionError(f"{' '.join(argv)}: the walk-through test does not know how to run this "
                             f"(tests/integration/test_first_minutes.py)")

    def record(self, kind, argv, out, rc):
        self.ran.append((kind, argv, out, rc))
        return out, rc

    def outputs(self, kind):
        return [o for k, _, o, rc in self.ran if k == kind and rc == 0]


def test_first_ten_minutes(tmp_path):
    cmds = section_commands()
    walk = Walk(tmp_path)
    try:
        for cmd in cmds:
            walk.run_ok(cmd)
    finally:
        walk.compose.stop_all()
        for s in walk.compose.services.values():
            if os.path.exists(s["log"]):
                assert lib.sanitizer_report(s["log"]) is None, lib.log_tail(s["log"])

    kinds = [k for k, *_ in walk.ran]
    # What the walk-through is for: each step is there and did what it says.
    for want in ("make-secrets", "up", "meshctl health", "grpcurl list", "grpcurl describe",
                 "meshctl agents", "meshctl sessions", "curl", "kill", "down"):
        assert want in kinds, f'"{SECTION}" no longer runs {want}'
    assert any("meshd.v1.TensorService" in o.split() and "grpc.reflection.v1.ServerReflection" in o.split()
               for o in walk.outputs("grpcurl list")), walk.outputs("grpcurl list")
    assert any("meshd.v1.TensorService is a service:" in o and re.search(r"rpc \w+ \(", o)
               for o in walk.outputs("grpcurl describe")), walk.outputs("grpcurl describe")
    assert any('meshd_agents{state="healthy"} 4' in o for o in walk.outputs("curl")), walk.outputs("curl")
    # After the kill: agent-2 started again, and the last table lists 4 healthy ranks.
    assert kinds.index("kill") < len(kinds) - 1 - kinds[::-1].index("meshctl agents")
    assert walk.compose.restarts == {"agent-2": 1}, walk.compose.restarts
    last = walk.outputs("meshctl agents")[-1]
    header, *lines = [line for line in last.splitlines() if line.strip()]
    healthy = header.split().index("HEALTHY")
    rows = [line.split() for line in lines]
    assert sorted(int(r[0]) for r in rows) == [0, 1, 2, 3], last
    assert all(r[healthy] == "yes" for r in rows), f"not all healthy:\n{last}"
    # The sessions are watched (two frames, then it ends by itself).
    watched = walk.outputs("meshctl sessions")
    assert watched and watched[-1].count("SESSION") == 2, watched
