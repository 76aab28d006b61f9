"""docker/*.Dockerfile, docker/compose.yaml and docker/k8s checked statically (no
Docker daemon here; test_manifests.py and test_first_minutes.py run what they
declare as local processes).

  * every image's final stage runs as a fixed non-root uid:gid (the user it
    creates), with HOME, TMPDIR and WORKDIR on /tmp, and carries the OCI labels;
    its version label is the VERSION file's;
  * the runtime stages install exactly the packages whose libraries the
    binaries they copy link (readelf NEEDED, owners from dpkg here);
  * the CPU agent image is Debian bookworm all through and installs nothing of
    CUDA or NVIDIA; the server image neither;
  * compose: the default agents run the CPU image, the gpu profile's the CUDA
    image with a GPU reserved, every service as that uid with a read-only root,
    /tmp a tmpfs, no capabilities, no new privileges;
  * k8s: every pod and container has the securityContext to match, and /tmp an
    emptyDir;
  * every image's HEALTHCHECK, run with the image's environment against its
    ENTRYPOINT started with that environment and TLS on its gRPC port, is healthy.
"""

import functools
import os
import re
import shutil
import subprocess
import time

import pytest

import dockerfiles as df
import meshd_testlib as lib
from test_manifests import load_objects

# Runs no meshd code of its own: the plain pass runs it (integration.python_plain); a
# sanitized build leaves this file out (CMakeLists.txt).
pytestmark = pytest.mark.plain

OCI = ["title", "description", "version", "revision", "source", "licenses"]
GPU_WORDS = re.compile(r"cuda|nvidia|nccl|cublas|cudnn|nvrtc|tensorrt", re.I)
# Provided by every base image (glibc, the compiler runtime).
BASE_PKGS = {"libc6", "libgcc-s1", "libstdc++6"}


def version_file():
    return open(os.path.join(lib.SOURCE_DIR, "VERSION")).read().strip()


def uid_gid(user):
    m = re.fullmatch(r"(\d+):(\d+)", user or "")
    assert m, f"USER {user!r}: a numeric uid:gid (k8s runAsNonRoot checks numbers)"
    return int(m.group(1)), int(m.group(2))


@pytest.mark.parametrize("path", df.dockerfiles(), ids=os.path.basename)
def test_final_stage_non_root_with_oci_labels(path):
    st = df.final(path)
    uid, gid = uid_gid(st["user"])
    assert uid != 0 and gid != 0, f"{path}: runs as root"
    run = " ".join(st["run"])
    assert re.search(rf"groupadd\b[^&]*--gid {gid}\b", run), f"{path}: creates no group {gid}"
    assert re.search(rf"useradd\b[^&]*--uid {uid}\b[^&]*--gid", run), f"{path}: creates no user {uid}"
    # The one writable place on a read-only root: /tmp (tmpfs / emptyDir).
    for k in ("HOME", "TMPDIR"):
        assert st["env"].get(k) == "/tmp", f"{path}: ENV {k} should be /tmp, got {st['env'].get(k)}"
    assert st["workdir"] == "/tmp", f"{path}: WORKDIR {st['workdir']}"
    for key in OCI:
        v = st["labels"].get(f"org.opencontainers.image.{key}")
        assert v, f"{path}: no org.opencontainers.image.{key} label"
    assert st["labels"]["org.opencontainers.image.version"] == version_file(), \
        f"{path}: ARG VERSION default {st['args'].get('VERSION')!r} != VERSION file {version_file()!r}"
    assert "${REVISION}" in open(path).read() and "REVISION" in st["args"], \
        f"{path}: org.opencontainers.image.revision from a build ARG REVISION"
    assert st["entrypoint"] and st["entrypoint"][0] in ("meshd", "meshd-agent")


def test_cpu_agent_image_is_debian_without_cuda():
    images = df.image_dockerfiles()
    for name in ("meshd-agent-cpu", "meshd-server"):
        path = images[name]
        stages = df.parse(path)
        for st in stages:
            assert re.fullmatch(r"debian:bookworm(-slim)?", st["base"]), f"{path}: FROM {st['base']}"
            bad = [p for p in df.apt_installs(st) if GPU_WORDS.search(p)]
            assert not bad, f"{path}: installs {bad}"
        assert stages[-1]["base"] == "debian:bookworm-slim", path
        build = " ".join(stages[0]["run"])
        assert "-DMESHD_WITH_CUDA=OFF" in build, f"{path}: build without the cuda backend"
        assert not GPU_WORDS.search(" ".join(stages[-1]["env"])), path


@functools.lru_cache(maxsize=None)
def soname_packages(binary):
    """{soname: Debian package} of what the binary links directly (readelf NEEDED)."""
    needed = re.findall(r"\(NEEDED\).*\[(.+)\]", lib.run("/usr/bin/readelf", ["-d", binary]).stdout)
    paths = {}
    for line in lib.run("/usr/bin/ldd", [binary]).stdout.splitlines():
        m = re.match(r"\s*(\S+) => (/\S+)", line) or \
            re.match(r"\s*(/\S+/(\S+)) \(", line)  # the dynamic loader: thread-locals need it
        if m and "=>" in line:
            paths[m.group(1)] = os.path.realpath(m.group(2))
        elif m:
            paths[m.group(2)] = os.path.realpath(m.group(1))
    # One dpkg -S for all (0.3 s a call); merged-/usr systems list some under /lib.
    cands = sorted({c for so in needed for c in (paths[so], re.sub(r"^/usr", "", paths[so]))})
    r = subprocess.run(["dpkg", "-S"] + cands, capture_output=True, text=True)
    owner = {}
    for line in r.stdout.splitlines():
        pkg, _, path = line.partition(": ")
        owner[path.strip()] = pkg.split(":")[0]
    return {so: owner.get(paths[so]) or owner.get(re.sub(r"^/usr", "", paths[so])) for so in needed}


@pytest.mark.skipif(not shutil.which("dpkg") or not os.path.exists("/usr/bin/readelf"),
                    reason="needs dpkg and readelf (Debian)")
@pytest.mark.parametrize("path", df.dockerfiles(), ids=os.path.basename)
def test_runtime_packages_are_what_the_binaries_link(path):
    st = df.final(path)
    installed = set(df.apt_installs(st))
    binaries = set()
    for c in st["copies"]:
        binaries |= {os.path.basename(w) for w in c.split()[1:-1] if "/bin/" in w}
    assert binaries, f"{path}: copies no binary"
    ubuntu = "ubuntu" in st["base"]
    for b in sorted(binaries):
        for so, pkg in soname_packages(os.path.join(lib.BIN_DIR, b)).items():
            if GPU_WORDS.search(so) or GPU_WORDS.search(pkg or ""):
                continue  # this build's cuda backend: the CUDA image's base has it
            if re.match(r"lib(asan|ubsan|lsan|tsan)\.so", so):
                continue  # a sanitizer build (CI's); images are built without
            assert pkg, f"{b} links {so}, which no Debian package here provides"
            if pkg in BASE_PKGS:
                continue
            # Ubuntu 24.04 renamed libraries for 64-bit time_t: libfoo1 -> libfoo1t64.
            ok = pkg in installed or (ubuntu and pkg + "t64" in installed)
            assert ok, f"{path}: {b} links {so} from {pkg}, which the runtime stage does not install"


def test_compose_cpu_by_default_gpu_profile_cuda():
    compose = df.load_compose()
    images = df.image_dockerfiles()
    cpu_df, gpu_df = images["meshd-agent-cpu"], images["meshd-agent"]
    default, gpu = {}, {}
    for name, svc in compose["services"].items():
        if "--rank" not in svc.get("command", []):
            continue
        rank = int(svc["command"][svc["command"].index("--rank") + 1])
        dfile = os.path.normpath(os.path.join(df.DOCKER_DIR, svc["build"]["context"],
                                              svc["build"]["dockerfile"]))
        if not svc.get("profiles"):
            assert dfile == cpu_df, f"{name}: a default agent runs {dfile}"
            assert svc["environment"]["MESHD_DEVICE"] == "cpu", name
            assert "deploy" not in svc, f"{name}: a CPU agent reserves devices"
            default[rank] = name
        else:
            assert svc["profiles"] == ["gpu"], f"{name}: profiles {svc['profiles']}"
            assert dfile == gpu_df, f"{name}: a gpu agent runs {dfile}"
            assert svc["environment"]["MESHD_DEVICE"].startswith("cuda:"), name
            devs = svc["deploy"]["resources"]["reservations"]["devices"]
            assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])
                       and d.get("count") == 1 for d in devs), f"{name}: no GPU reserved"
            gpu[rank] = name
    assert sorted(default) == [0, 1, 2, 3], default
    assert sorted(gpu) == sorted(default), f"gpu profile ranks {sorted(gpu)}"
    server = compose["services"]["server"]
    assert "--metrics-listen" in server["command"], "the walk-through scrapes the server"
    mport = server["command"][server["command"].index("--metrics-listen") + 1].rsplit(":", 1)[1]
    assert any(p.split(":")[-1] == mport for p in server["ports"]), "metrics port published"
    # The client port takes no token in compose: published to this host only.
    assert "--auth-tokens" not in server["command"]
    assert all(str(p).startswith("127.0.0.1:") for p in server["ports"]), server["ports"]


def test_compose_services_non_root_read_only():
    compose = df.load_compose()
    images = df.image_dockerfiles()
    for name, svc in compose["services"].items():
        st = df.final(images[svc["image"].split(":")[0]])
        assert svc.get("user") == st["user"], f"{name}: user {svc.get('user')} != image USER {st['user']}"
        assert svc.get("read_only") is True, f"{name}: read_only"
        tmpfs = [t.split(":")[0] for t in svc.get("tmpfs", [])]
        for k in ("HOME", "TMPDIR"):
            assert st["env"][k] in tmpfs, f"{name}: {k}={st['env'][k]} is not a tmpfs ({tmpfs})"
        assert svc.get("cap_drop") == ["ALL"], f"{name}: cap_drop"
        assert "no-new-privileges:true" in svc.get("security_opt", []), f"{name}: no-new-privileges"
        assert svc.get("restart") == "unless-stopped", f"{name}: restart"


def test_k8s_security_context():
    objs = load_objects()
    images = df.image_dockerfiles()
    workloads = [o for o in objs if o.get("spec", {}).get("template", {}).get("spec")]
    assert len(workloads) == 2
    for w in workloads:
        spec = w["spec"]["template"]["spec"]
        name = w["metadata"]["name"]
        psc = spec.get("securityContext", {})
        assert psc.get("runAsNonRoot") is True, f"{name}: runAsNonRoot"
        assert psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", f"{name}: seccompProfile"
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            st = df.final(images[c["image"].split(":")[0]])
            uid, gid = uid_gid(st["user"])
            assert (psc.get("runAsUser"), psc.get("runAsGroup"), psc.get("fsGroup")) == (uid, gid, gid), \
                f"{name}: runAsUser/runAsGroup/fsGroup != the image's {uid}:{gid}"
            csc = c.get("securityContext", {})
            assert csc.get("allowPrivilegeEscalation") is False, f"{name}/{c['name']}"
            assert csc.get("readOnlyRootFilesystem") is True, f"{name}/{c['name']}"
            assert csc.get("capabilities", {}).get("drop") == ["ALL"], f"{name}/{c['name']}"
            assert not csc.get("privileged") and not csc.get("capabilities", {}).get("add")
            empty = [m["mountPath"] for m in c.get("volumeMounts", [])
                     if "emptyDir" in vols.get(m["name"], {})]
            for k in ("HOME", "TMPDIR"):
                assert st["env"][k] in empty, f"{name}: {k}={st['env'][k]} is not an emptyDir ({empty})"


@pytest.mark.parametrize("path", df.dockerfiles(), ids=os.path.basename)
def test_healthcheck_is_healthy_with_tls_on_the_grpc_port(path, tmp_path):
    """Docker runs HEALTHCHECK inside the container, with the image's environment (and
    whatever the operator added, e.g. the server's MESHD_TLS_CERT/KEY). Here: the
    ENTRYPOINT with the image's ENV, every address in it and in the HEALTHCHECK moved
    to one free loopback port each, and TLS on its gRPC port (the server's
    certificate; the agents' cluster mTLS). The HEALTHCHECK must pass, and fail once
    the process is gone."""
    st = df.final(path)
    hc, entry = st["healthcheck"], st["entrypoint"]
    assert hc and hc[0] == "meshctl", f"HEALTHCHECK {hc}: meshctl, which every image ships"
    ports = {}

    def local(addr):
        host, _, port = addr.rpartition(":")
        assert host in ("0.0.0.0", "127.0.0.1"), addr
        return f"127.0.0.1:{ports.setdefault(port, lib.free_port())}"

    env = {k: local(v) if re.fullmatch(r"[\d.]+:\d+", v) else v for k, v in st["env"].items()
           if k.startswith("MESHD_")}
    pki = lib.make_pki(tmp_path / "pki")
    if entry == ["meshd"]:
        env.update(MESHD_TLS_CERT=str(pki / "server.pem"), MESHD_TLS_KEY=str(pki / "server.key"))
    else:
        assert entry == ["meshd-agent"], entry
        env.update(MESHD_CLUSTER_CA=str(pki / "cluster-ca.pem"),
                   MESHD_CLUSTER_CERT=str(pki / "cluster.pem"),
                   MESHD_CLUSTER_KEY=str(pki / "cluster.key"),
                   MESHD_SERVER=f"127.0.0.1:{lib.free_port()}", MESHD_DEVICE="cpu")
    proc = lib.spawn("image", os.path.join(lib.BIN_DIR, entry[0]), [], str(tmp_path), env=env,
                     port_file=False)
    argv = [local(a) if re.fullmatch(r"127\.0\.0\.1:\d+", a) else a for a in hc[1:]]
    deadline = time.monotonic() + lib.START_TIMEOUT
    while True:
        r = lib.run(lib.MESHCTL, argv, env=env)
        if r.returncode == 0 or time.monotonic() > deadline or proc.proc.poll() is not None:
            break
        time.sleep(0.2)
    assert r.returncode == 0 and r.stdout.strip() == "SERVING", \
        f"HEALTHCHECK {hc} -> {argv}: rc {r.returncode}\n{r.stdout}{r.stderr}\n" \
        f"{lib.log_tail(proc.log)}"
    assert lib.stop(proc) == 0, lib.log_tail(proc.log)
    r = lib.run(lib.MESHCTL, argv, env=env)
    assert r.returncode != 0, "healthy with the process gone: it probed something else"
