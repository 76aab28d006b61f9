"""The package as users install it: `pip install --no-index --no-build-isolation
./clients/python` into a fresh venv outside the repository, then used from outside it
with nothing of the checkout (no PYTHONPATH, no protoc on PATH, an empty cache): the
proto modules and the version are the ones setup.py shipped in meshd/_gen."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

from conftest import REPO, _child_env, log_path

CLIENT = os.path.join(REPO, "clients", "python")
EXAMPLE = os.path.join(CLIENT, "examples", "train_data_parallel.py")

# Run by the venv's python from a directory outside the repository.
_PROBE = r"""
import json, os, meshd, meshd._proto as p
print(json.dumps({"version": meshd.__version__, "file": meshd.__file__,
                  "tensor": p.tensor_pb2().__name__, "health": p.health_pb2().__name__,
                  "typed": os.path.isfile(os.path.join(os.path.dirname(meshd.__file__), "py.typed"))}))
"""


def _project_version():
    with open(os.path.join(REPO, "VERSION")) as f:
        return f.readline().strip()


def _run(cmd, env, cwd, timeout):
    r = subprocess.run(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, f"{cmd} exited with {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def _outside_env(tmp, venv):
    """The environment of a user of the venv: no PYTHONPATH or MESHD_* (_child_env drops
    those), a fresh HOME and cache, pip offline and without config or cache. The build
    needs protoc on PATH; the caller takes it away for what runs after."""
    env = {k: v for k, v in _child_env().items() if not k.startswith("PYTHON")}
    env.update(PATH=os.path.join(venv, "bin") + os.pathsep + env.get("PATH", ""),
               HOME=os.path.join(tmp, "home"),
               XDG_CACHE_HOME=os.path.join(tmp, "cache"), PYTHONDONTWRITEBYTECODE="1",
               PIP_CONFIG_FILE=os.devnull, PIP_NO_CACHE_DIR="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_ROOT_USER_ACTION="ignore")
    return env


def test_pip_install_outside_the_checkout_runs_an_example_without_protoc(server):
    tmp = tempfile.mkdtemp(prefix="meshd-install-test-")
    try:
        assert not os.path.realpath(tmp).startswith(os.path.realpath(REPO) + os.sep)
        venv, work = os.path.join(tmp, "venv"), os.path.join(tmp, "work")
        os.makedirs(work)
        # --without-pip: the venv runs Debian's pip from the system site-packages (the
        # version ensurepip would copy in), which saves the seconds of copying it.
        _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv],
             _child_env(), tmp, 60)
        env = _outside_env(tmp, venv)
        py = os.path.join(venv, "bin", "python")
        _run([py, "-m", "pip", "install", "-q", "--no-index", "--no-build-isolation", CLIENT],
             env, work, 120)
        env["PATH"] = os.path.join(venv, "bin")  # from here on no protoc
        assert shutil.which("protoc", path=env["PATH"]) is None

        got = json.loads(_run([py, "-c", _PROBE], env, work, 60).stdout)
        site = os.path.join(os.path.realpath(venv), "lib")
        assert os.path.realpath(got["file"]).startswith(site + os.sep), got  # not the checkout
        assert got["version"] == _project_version(), got
        assert got["tensor"] == "meshd._gen.tensor_service_pb2", got  # shipped, not generated
        assert got["health"] == "meshd._gen.health_pb2", got
        assert got["typed"], got
        with open(log_path("meshd"), errors="replace") as f:  # the C binaries' version too
            assert f"meshd {got['version']} (server " in f.read()

        shutil.copy(EXAMPLE, work)  # run as a user's own script, away from the checkout
        r = _run([py, os.path.basename(EXAMPLE), "--server", server[0], "--agents", "2",
                  "--steps", "2"], env, work, 120)
        assert "matches numpy: max |Δw| = " in r.stdout, r.stdout + r.stderr
        assert not os.path.exists(os.path.join(env["XDG_CACHE_HOME"], "meshd"))  # nothing generated
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_build_outside_a_checkout_names_what_is_missing(tmp_path):
    """setup.py in a copy of clients/python alone (not an sdist, no repository around it)
    fails with a message naming the file it lacks and the two ways that work."""
    copy = tmp_path / "python"
    shutil.copytree(os.path.join(CLIENT, "meshd"), copy / "meshd",
                    ignore=shutil.ignore_patterns("__pycache__", "_gen"))
    for f in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(CLIENT, f), copy)
    r = subprocess.run([sys.executable, "setup.py", "--version"], cwd=copy, env=_child_env(),
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0, r.stdout
    assert "VERSION" in r.stderr and str(copy) in r.stderr, r.stderr
    assert "pip install ./clients/python" in r.stderr, r.stderr
    (copy / "VERSION").write_text("9.9.9\n")  # the version found: now the .proto files lack
    r = subprocess.run([sys.executable, "setup.py", "build_py", "--build-lib", str(tmp_path / "b")],
                       cwd=copy, env=_child_env(), stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0, r.stdout
    assert os.path.join("api", "meshd", "v1", "tensor_service.proto") in r.stderr, r.stderr
