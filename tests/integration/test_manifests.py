"""The Kubernetes manifests (docker/k8s/*.yaml) run against the real binaries.

The server Deployment and the agent StatefulSet (all its replicas, pods
meshd-agent-0..N-1) are started as local processes with exactly the command,
args and environment their containers declare (ConfigMap envFrom, downward-API
POD_NAME/POD_NAMESPACE). Only two things are rewritten:

  * the image's binary directory (/usr/local/bin, on PATH in the images) is
    replaced by $MESHD_BIN_DIR, put first on PATH;
  * network addresses: every declared containerPort is mapped to a free
    loopback port; "0.0.0.0:P" becomes 127.0.0.1:<map P>, Service names
    (meshd-registry:50051) and per-pod headless names
    (<pod>.meshd-agent.<ns>.svc:50052) become 127.0.0.1:<map of the port they
    select>. An address naming an undeclared port fails the test.

The container's environment starts from its image's ENV (the Dockerfile that
docker/compose.yaml builds under that image name), then ConfigMaps and env.
emptyDir volumes are fresh directories, and a path under one (the images'
HOME, TMPDIR, WORKDIR /tmp) is rewritten to it; the process runs in its
image's WORKDIR. With readOnlyRootFilesystem that WORKDIR, HOME and TMPDIR must
be on an emptyDir, and while it runs the process may hold no file open for
writing anywhere but an emptyDir (its stdout/stderr aside).

Secret volumes are written as the kubelet would (each item's file, its mode)
into a directory per pod, from the Secrets docs/operations.md tells operators to
create: meshd-cluster-tls (a cluster CA and certificate from
tests/support/make_certs.sh) and meshd-join-token; a path under a mount is
rewritten to that directory. Secret files must be mounted read-only and not be
world-readable.

Then every probe is performed the way the kubelet does it (grpc.health.v1
Check on the probe's port, mapped, with the probe's service), /metrics is
scraped on each declared metrics port (and the prometheus.io annotations), the
agents' gRPC port and the server's cluster port must refuse plaintext (cluster
mTLS is on), and SIGTERM must end every process with 0 within
terminationGracePeriodSeconds.
A flag the binary does not know (exit 2), a MESHD_* variable it does not read
(its --help lists every one), a wrong probe port or service, an address on an
undeclared port, or a metrics port nobody serves fails the test. All the
StatefulSet's replicas run (MESHD_MIN_AGENTS is one less: the one agent the
PodDisruptionBudget lets go). The client port wants the operators' tokens.
"""

import glob
import os
import re
import signal
import subprocess
import time
import urllib.request

import grpc
import pytest
import yaml

import dockerfiles
import meshd_testlib as lib

K8S_DIR = os.path.join(lib.SOURCE_DIR, "docker", "k8s")
DOCKER_DIR = os.path.join(lib.SOURCE_DIR, "docker")
NAMESPACE = "meshd-test"
IMAGE_BIN = "/usr/local/bin"


# ---------------------------------------------------------------- manifests

def cuda_built():
    out = subprocess.run([lib.AGENT, "--help"], capture_output=True, text=True).stdout
    return "cuda:emulated" in out


def load_objects():
    objs = []
    for path in sorted(glob.glob(os.path.join(K8S_DIR, "*.yaml"))):
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if doc and "kind" in doc and doc.get("kind") != "Kustomization":
                    objs.append(doc)
    return objs


def find(objs, kind, name=None):
    got = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    return got


def image_bin_dirs():
    """The directories the Dockerfiles install binaries into (must be IMAGE_BIN)."""
    dirs = set()
    for path in glob.glob(os.path.join(DOCKER_DIR, "*.Dockerfile")):
        for line in open(path):
            m = re.match(r"\s*COPY\s+--from=\S+\s+(.*)\s+(\S+)\s*$", line)
            if m and "bin" in m.group(1):
                dirs.add(m.group(2).rstrip("/"))
    return dirs


def selects(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def operator_secrets(tmp_path):
    """The Secrets docs/operations.md tells operators to create, by name and key."""
    pki = lib.make_pki(tmp_path / "pki")
    return {
        "meshd-cluster-tls": {"ca.crt": (pki / "cluster-ca.pem").read_bytes(),
                              "tls.crt": (pki / "cluster.pem").read_bytes(),
                              "tls.key": (pki / "cluster.key").read_bytes()},
        "meshd-join-token": {"token": (os.urandom(24).hex() + "\n").encode()},
        "meshd-auth-tokens": {"tokens": f"ops {OPS_TOKEN} admin\n".encode()},
    }


OPS_TOKEN = os.urandom(24).hex()


class Cluster:
    """The manifests, the port map and the processes started from them."""

    def __init__(self, tmp_path, secrets=None):
        self.objs = load_objects()
        self.secrets = secrets or {}
        self.tmp = str(tmp_path)
        self.config = {o["metadata"]["name"]: o.get("data", {}) for o in find(self.objs, "ConfigMap")}
        self.services = {o["metadata"]["name"]: o for o in find(self.objs, "Service")}
        self._given = set()
        self.pods = []  # dicts: name, workload, template, container, ports{decl->local}, proc, log

    # ------------------------------------------------ addresses

    def _container_port(self, pod, target):
        for p in pod["container"].get("ports", []):
            if target in (p["containerPort"], p.get("name")):
                return p["containerPort"]
        raise AssertionError(f"{pod['name']}: no containerPort {target!r} declared")

    def _local(self, pod, port):
        assert port in pod["ports"], (f"{pod['name']}: address uses port {port}, which "
                                      f"{pod['container']['name']} does not declare "
                                      f"(declared: {sorted(pod['ports'])})")
        return pod["ports"][port]

    def _service_target(self, svc_name, port):
        svc = self.services.get(svc_name)
        assert svc is not None, f"address names Service {svc_name!r}, which no manifest defines"
        sp = [p for p in svc["spec"]["ports"] if p["port"] == port]
        assert sp, f"Service {svc_name} has no port {port}"
        target = sp[0].get("targetPort", port)
        pods = [p for p in self.pods if selects(svc["spec"]["selector"], p["labels"])]
        assert pods, f"Service {svc_name} selects no pod"
        return svc, pods, target

    def resolve(self, pod, addr):
        """Rewrites one host:port the way the cluster would route it, onto loopback."""
        host, _, port = addr.rpartition(":")
        port = int(port)
        if host in ("0.0.0.0", "[::]", "::", ""):
            return f"127.0.0.1:{self._local(pod, port)}"
        parts = host.split(".")
        # <pod>.<headless service>.<ns>.svc[.cluster.local] or <service>[.<ns>[.svc...]]
        if len(parts) >= 2 and parts[1] in self.services and \
                self.services[parts[1]]["spec"].get("clusterIP") == "None":
            svc, pods, target = self._service_target(parts[1], port)
            if len(parts) > 2:
                assert parts[2] == NAMESPACE, f"{addr}: namespace {parts[2]} != {NAMESPACE}"
            hit = [p for p in pods if p["name"] == parts[0]]
            assert hit, f"{addr}: no pod {parts[0]} behind {parts[1]}"
            return f"127.0.0.1:{self._local(hit[0], self._container_port(hit[0], target))}"
        if len(parts) > 1:
            assert parts[1] == NAMESPACE, f"{addr}: namespace {parts[1]} != {NAMESPACE}"
        svc, pods, target = self._service_target(parts[0], port)
        assert len(pods) == 1, f"Service {parts[0]} selects {len(pods)} pods"
        return f"127.0.0.1:{self._local(pods[0], self._container_port(pods[0], target))}"

    # ------------------------------------------------ pods

    def _free_port(self):
        """A free loopback port no pod was given yet: all are given before any
        binds, so free_port alone could hand one out twice."""
        while True:
            port = lib.free_port()
            if port not in self._given:
                self._given.add(port)
                return port

    def add_pod(self, name, workload):
        tmpl = workload["spec"]["template"]
        containers = tmpl["spec"]["containers"]
        assert len(containers) == 1, f"{workload['metadata']['name']}: one container expected"
        c = containers[0]
        ports = {p["containerPort"]: self._free_port() for p in c.get("ports", [])}
        pod = dict(name=name, workload=workload, template=tmpl, container=c,
                   labels=tmpl["metadata"]["labels"], ports=ports, proc=None, log=None)
        pod["mounts"] = self._write_secrets(pod)
        pod["emptydirs"] = self._empty_dirs(pod)
        pod["mounts"].update(pod["emptydirs"])
        self.pods.append(pod)
        return pod

    def _write_secrets(self, pod):
        """The pod's Secret volumes as files: {mountPath: local directory}."""
        vols = {v["name"]: v for v in pod["template"]["spec"].get("volumes", [])}
        mounts = {}
        for m in pod["container"].get("volumeMounts", []):
            sec = vols.get(m["name"], {}).get("secret")
            if sec is None:
                continue
            name = sec["secretName"]
            assert name in self.secrets, f"{pod['name']}: Secret {name} is not one operators create"
            assert m.get("readOnly"), f"{pod['name']}: Secret {name} mounted writable"
            local = os.path.join(self.tmp, pod["name"] + "-" + m["name"])
            os.makedirs(local, exist_ok=True)
            data = self.secrets[name]
            items = sec.get("items") or [{"key": k, "path": k} for k in data]
            for it in items:
                assert it["key"] in data, f"{pod['name']}: Secret {name} has no key {it['key']}"
                mode = it.get("mode", sec.get("defaultMode", 0o644))
                assert mode & 0o007 == 0, f"{pod['name']}: {name}/{it['key']} is world-readable ({mode:o})"
                path = os.path.join(local, it["path"])
                with open(path, "wb") as f:
                    f.write(data[it["key"]])
                os.chmod(path, mode)
            mounts[m["mountPath"].rstrip("/")] = local
        return mounts

    def _empty_dirs(self, pod):
        """The pod's emptyDir volumes as fresh directories: {mountPath: local directory}."""
        vols = {v["name"]: v for v in pod["template"]["spec"].get("volumes", [])}
        out = {}
        for m in pod["container"].get("volumeMounts", []):
            if "emptyDir" in vols.get(m["name"], {}):
                local = os.path.join(self.tmp, pod["name"] + "-" + m["name"])
                os.makedirs(local, exist_ok=True)
                out[m["mountPath"].rstrip("/")] = local
        return out

    def image(self, pod):
        """The final stage of the Dockerfile compose.yaml builds as the container's image."""
        name = pod["container"]["image"].split(":")[0]
        images = dockerfiles.image_dockerfiles()
        assert name in images, f"{pod['name']}: image {name} is built by no docker/*.Dockerfile"
        return dockerfiles.final(images[name])

    def local_path(self, pod, value):
        """A path under one of the pod's Secret or emptyDir mounts, as made here; else value."""
        for mount, local in pod["mounts"].items():
            if value == mount or value.startswith(mount + "/"):
                return local + value[len(mount):]
        return value

    def writable_dir(self, pod, path):
        """path's directory here if it is on one of the pod's emptyDirs, else None."""
        for mount, local in pod["emptydirs"].items():
            if path == mount or path.startswith(mount + "/"):
                return local + path[len(mount):]
        return None

    def env_of(self, pod):
        c = pod["container"]
        env = dict(self.image(pod)["env"])
        for src in c.get("envFrom", []):
            ref = src["configMapRef"]["name"]
            assert ref in self.config, f"{c['name']}: envFrom ConfigMap {ref} not defined"
            env.update({k: str(v) for k, v in self.config[ref].items()})
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = str(e["value"])
            else:
                ref = e["valueFrom"]
                if "fieldRef" in ref:
                    field = ref["fieldRef"]["fieldPath"]
                    env[e["name"]] = {"metadata.name": pod["name"],
                                      "metadata.namespace": NAMESPACE}[field]
                else:
                    cm = ref["configMapKeyRef"]
                    env[e["name"]] = str(self.config[cm["name"]][cm["key"]])
        return env

    def argv_of(self, pod, env):
        c = pod["container"]
        # No command: the image's ENTRYPOINT. Both images' entrypoint is the binary.
        argv = list(c.get("command") or [])
        argv += list(c.get("args") or [])
        assert argv, f"{c['name']}: no command"
        out = []
        for a in argv:
            a = a.replace(IMAGE_BIN + "/", lib.BIN_DIR + "/")
            # Addresses inside a shell script, with its $VARS as the pod's shell would
            # expand them: host:port words that are cluster names.
            def sub(m):
                word = m.group(0)
                expanded = re.sub(r"\$\{(\w+)\}", lambda v: env.get(v.group(1), ""), word)
                return self.resolve(pod, expanded)
            a = re.sub(r"[\w${}.-]*\.svc(?:\.cluster\.local)?:\d+", sub, a)
            out.append(a)
        return out

    def known_env(self, argv):
        """The MESHD_* variables the container's binary reads (from its --help)."""
        if os.path.basename(argv[0]) in ("sh", "bash") and argv[1] == "-c":
            m = re.search(r"\bexec\s+(\S+)", argv[2])
            assert m, f"{argv}: a shell command that does not exec the binary"
            binary = m.group(1)
        else:
            binary = argv[0]
        path = binary if os.path.isabs(binary) else os.path.join(lib.BIN_DIR, binary)
        help_ = lib.run(path, ["--help"])
        assert help_.returncode == 0, f"{path} --help: {help_.returncode}\n{help_.stderr}"
        return set(re.findall(r"env (MESHD_\w+)", help_.stdout + help_.stderr))

    def start(self, pod):
        env = self.env_of(pod)
        known = self.known_env(self.argv_of(pod, env))
        unknown = sorted(k for k in env if k.startswith("MESHD_") and k not in known)
        assert not unknown, (f"{pod['container']['name']}: environment the binary does not read: "
                             f"{unknown} (known: {sorted(known)})")
        if env.get("MESHD_DEVICE", "").startswith("cuda:") and lib.gpu_count() == 0:
            # The one value this machine cannot honour: without a GPU the agent runs the
            # same backend emulated (or cpu in a build without it).
            env["MESHD_DEVICE"] = "cuda:emulated" if cuda_built() else "cpu"
        for k, v in list(env.items()):
            if (re.fullmatch(r"[\w.\-\[\]:]*:\d+", v) and not k.startswith("NCCL_")
                    and k != "MESHD_DEVICE"):
                env[k] = self.resolve(pod, v)
            else:
                env[k] = self.local_path(pod, env[k])
        argv = [self.local_path(pod, a) for a in self.argv_of(pod, env)]
        env["PATH"] = lib.BIN_DIR + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin")
        workdir = pod["container"].get("workingDir") or self.image(pod)["workdir"]
        cwd = self.local_path(pod, workdir)
        if pod["container"].get("securityContext", {}).get("readOnlyRootFilesystem"):
            # Where the process may write: its working directory, HOME and TMPDIR.
            for what, path in (("WORKDIR", workdir), ("HOME", env.get("HOME")),
                               ("TMPDIR", env.get("TMPDIR"))):
                assert path and self.writable_dir(pod, path if what == "WORKDIR" else
                                                  self._container_path(pod, path)), \
                    (f"{pod['name']}: readOnlyRootFilesystem, but {what} {path} is on no emptyDir "
                     f"(emptyDirs: {sorted(pod['emptydirs'])})")
        assert os.path.isdir(cwd), f"{pod['name']}: WORKDIR {workdir} is no directory here ({cwd})"
        log = os.path.join(self.tmp, f"{pod['name']}.log")
        with open(log, "wb") as logf:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf,
                                    stderr=subprocess.STDOUT, env=lib.clean_env(env),
                                    cwd=cwd)
        lib._started.append(proc)
        pod.update(proc=proc, log=log, argv=argv, env=env)
        return pod

    def _container_path(self, pod, local):
        """The path in the container of a path made here (local_path's inverse)."""
        for mount, loc in pod["mounts"].items():
            if local == loc or local.startswith(loc + "/"):
                return mount + local[len(loc):]
        return local

    def writes_outside(self, pod):
        """Files the process holds open for writing off its emptyDirs (stdout, stderr aside)."""
        pid = pod["proc"].pid
        bad = []
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                flags = int(open(f"/proc/{pid}/fdinfo/{fd}").read().split("flags:")[1].split()[0], 8)
            except (FileNotFoundError, IndexError):
                continue  # closed meanwhile
            if int(fd) in (1, 2) or not target.startswith("/") or flags & os.O_ACCMODE == os.O_RDONLY:
                continue
            if target.startswith("/dev/") or target.startswith("/proc/"):
                continue  # /dev/null, pipes' and eventfds' pseudo paths
            if not any(target == d or target.startswith(d + "/") for d in pod["emptydirs"].values()):
                bad.append(target)
        return bad

    def alive(self, pod):
        if pod["proc"].poll() is not None:
            raise AssertionError(
                f"{pod['name']}: {pod['argv']} exited with {pod['proc'].returncode} "
                f"(2 = a flag or variable the binary rejects)\n--- log ---\n{lib.log_tail(pod['log'])}")

    def stop_all(self):
        codes = {}
        for pod in self.pods:
            if pod["proc"] and pod["proc"].poll() is None:
                os.kill(pod["proc"].pid, signal.SIGTERM)
        for pod in self.pods:
            if not pod["proc"]:
                continue
            grace = pod["template"]["spec"].get("terminationGracePeriodSeconds", 30)
            try:
                pod["proc"].wait(grace)
            except subprocess.TimeoutExpired:
                pod["proc"].kill()
                pod["proc"].wait(10)
                codes[pod["name"]] = "SIGKILL after grace"
                continue
            codes[pod["name"]] = pod["proc"].returncode
        return codes


# ---------------------------------------------------------------- probes

def probe(cluster, pod, kind, timeout):
    """Runs the container's probe like the kubelet until it succeeds (or times out)."""
    spec = pod["container"].get(kind)
    assert spec is not None, f"{pod['name']}: no {kind}"
    assert "grpc" in spec, f"{pod['name']}: {kind} is not a gRPC probe"
    port = cluster._local(pod, spec["grpc"]["port"])
    service = spec["grpc"].get("service", "")
    deadline = time.monotonic() + timeout
    last = None
    while True:
        cluster.alive(pod)
        try:
            last = lib.status_name(lib.health_check(port, service,
                                                    timeout=spec.get("timeoutSeconds", 1)))
            if last == "SERVING":
                return
        except Exception as e:  # grpc.RpcError: not up yet, or NOT_FOUND for a wrong service
            last = getattr(e, "code", lambda: e)()
        if time.monotonic() > deadline:
            raise AssertionError(f"{pod['name']}: {kind} (port {spec['grpc']['port']}, "
                                 f"service {service!r}) never SERVING, last {last}\n"
                                 f"--- log ---\n{lib.log_tail(pod['log'])}")
        time.sleep(0.2)


def scrape(port):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return r.read().decode()


# ---------------------------------------------------------------- test

SERVER_METRICS = ["meshd_agents", "meshd_sessions", "meshd_commands_total", "meshd_build_info",
                  "process_start_time_seconds"]
AGENT_METRICS = ["meshd_agent_allocated_bytes", "meshd_agent_instructions_total",
                 "meshd_build_info", "process_start_time_seconds"]


def test_binary_dir_matches_images():
    assert image_bin_dirs() == {IMAGE_BIN}, image_bin_dirs()


def refuses_plaintext(port, method):
    """A plaintext call to an mTLS port fails before any method runs."""
    with lib.channel(port) as ch:
        try:
            ch.unary_unary(method, request_serializer=lambda b: b,
                           response_deserializer=lambda b: b)(b"", timeout=5)
        except grpc.RpcError as e:
            return e.code() == grpc.StatusCode.UNAVAILABLE
    return False


def test_manifests_run_as_declared(tmp_path):
    secrets = operator_secrets(tmp_path)
    cluster = Cluster(tmp_path, secrets)
    server_wl = find(cluster.objs, "Deployment", "meshd")
    agent_wl = find(cluster.objs, "StatefulSet", "meshd-agent")
    assert len(server_wl) == 1 and len(agent_wl) == 1
    server_wl, agent_wl = server_wl[0], agent_wl[0]
    replicas = agent_wl["spec"]["replicas"]
    assert server_wl["spec"]["replicas"] == 1
    pdb = find(cluster.objs, "PodDisruptionBudget", None)
    assert len(pdb) == 1 and pdb[0]["spec"]["maxUnavailable"] == 1, pdb
    assert int(cluster.config["meshd-server-config"]["MESHD_MIN_AGENTS"]) == replicas - 1, \
        "MESHD_MIN_AGENTS must be the agent StatefulSet's replicas less the one the PDB lets go"
    sts_name = agent_wl["metadata"]["name"]

    server = cluster.add_pod("meshd-7d9c5b-x1", server_wl)
    agents = [cluster.add_pod(f"{sts_name}-{i}", agent_wl) for i in range(replicas)]
    try:
        cluster.start(server)
        for a in agents:  # podManagementPolicy: Parallel
            cluster.start(a)
        startup_budget = lambda p: (p["container"]["startupProbe"].get("periodSeconds", 10) *
                                    p["container"]["startupProbe"].get("failureThreshold", 3))
        for pod in [server] + agents:
            probe(cluster, pod, "startupProbe", min(startup_budget(pod), 60))
            probe(cluster, pod, "livenessProbe", 10)
        for a in agents:
            probe(cluster, a, "readinessProbe", lib.REGISTER_TIMEOUT)
        probe(cluster, server, "readinessProbe", lib.REGISTER_TIMEOUT)
        assert server["container"]["readinessProbe"]["grpc"]["service"] == lib.TENSOR_SERVICE
        for a in agents:
            assert a["container"]["readinessProbe"]["grpc"]["service"] == lib.AGENT_SERVICE

        # The agents registered with their pod ordinal as rank.
        sgrpc = next(p["containerPort"] for p in server["container"]["ports"]
                     if p.get("name") == "grpc")
        # (The server is ready with replicas - 1: the last may still be dialed back.)
        by = time.monotonic() + lib.REGISTER_TIMEOUT
        while True:
            ranks = lib.healthy_ranks(lib.list_agents(server["ports"][sgrpc], token=OPS_TOKEN))
            if ranks == list(range(replicas)) or time.monotonic() > by:
                break
            time.sleep(0.1)
        assert ranks == list(range(replicas)), ranks
        # The client port wants a token: a stranger's call is refused.
        with pytest.raises(grpc.RpcError) as e:
            lib.list_agents(server["ports"][sgrpc])
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value

        # Metrics: the declared "metrics" port, the one the annotations point at.
        for pod, names in [(server, SERVER_METRICS)] + [(a, AGENT_METRICS) for a in agents]:
            mports = [p["containerPort"] for p in pod["container"]["ports"] if p.get("name") == "metrics"]
            assert len(mports) == 1, f"{pod['name']}: one containerPort named metrics"
            ann = pod["template"]["metadata"].get("annotations", {})
            assert ann.get("prometheus.io/scrape") == "true", f"{pod['name']}: scrape annotation"
            assert int(ann.get("prometheus.io/port")) == mports[0], f"{pod['name']}: prometheus.io/port"
            assert ann.get("prometheus.io/path", "/metrics") == "/metrics"
            text = scrape(pod["ports"][mports[0]])
            for n in names:
                assert re.search(rf"^# TYPE {n} ", text, re.M), f"{pod['name']}: no {n}\n{text}"
        smport = [p["containerPort"] for p in server["container"]["ports"] if p.get("name") == "metrics"][0]
        srv_text = scrape(server["ports"][smport])
        assert f'meshd_agents{{state="healthy"}} {replicas}' in srv_text, srv_text

        # Cluster mTLS is on: the agents' gRPC port and the server's registry port
        # refuse plaintext; the join token is in no log.
        for a in agents:
            assert refuses_plaintext(a["ports"][50052], "/meshd.agent.v1.Agent/Hello"), a["name"]
        cport = [p["containerPort"] for p in server["container"]["ports"] if p.get("name") == "cluster"]
        assert len(cport) == 1, "the server declares its cluster port"
        assert refuses_plaintext(server["ports"][cport[0]], "/meshd.v1.AgentRegistry/RegisterAgent")
        token = secrets["meshd-join-token"]["token"].decode().strip()
        for pod in [server] + agents:
            assert token not in open(pod["log"], errors="replace").read(), f"{pod['name']} logged the token"

        for pod in [server] + agents:
            cluster.alive(pod)
            if pod["container"].get("securityContext", {}).get("readOnlyRootFilesystem"):
                bad = cluster.writes_outside(pod)
                assert not bad, f"{pod['name']}: readOnlyRootFilesystem, but writes {bad}"
    finally:
        codes = cluster.stop_all()
    bad = {k: v for k, v in codes.items() if v != 0}
    assert not bad, (f"not exit 0 within terminationGracePeriodSeconds: {bad}\n" +
                     "\n".join(f"--- {p['name']} ---\n{lib.log_tail(p['log'], 20)}"
                               for p in cluster.pods if p["name"] in bad))
