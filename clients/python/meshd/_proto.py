"""Python modules for meshd's .proto files, generated with protoc at import time.

The modules land in a cache directory keyed by a hash of the .proto files
($XDG_CACHE_HOME/meshd/proto-<hash>, default ~/.cache) and are loaded under private
names, so no top-level `grpc` or `meshd` package is shadowed. The api/ directory is
$MESHD_PROTO_DIR or the repository's api/ found relative to this package."""

import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
import threading

_HERE = os.path.dirname(os.path.abspath(__file__))
_FILES = {  # module key -> path under api/
    "tensor": os.path.join("meshd", "v1", "tensor_service.proto"),
    "health": os.path.join("grpc", "health", "v1", "health.proto"),
}
_lock = threading.Lock()
_mods = {}


def api_dir():
    d = os.environ.get("MESHD_PROTO_DIR")
    if d:
        return d
    return os.path.normpath(os.path.join(_HERE, "..", "..", "..", "api"))


def _cache_root():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "meshd")


def _generate():
    api = api_dir()
    paths = {k: os.path.join(api, p) for k, p in _FILES.items()}
    for p in paths.values():
        if not os.path.isfile(p):
            raise ImportError(f"meshd: {p} not found; set MESHD_PROTO_DIR to meshd's api/ directory")
    h = hashlib.sha256()
    for k in sorted(paths):
        with open(paths[k], "rb") as f:
            h.update(k.encode() + b"\0" + f.read() + b"\0")
    root = _cache_root()
    out = os.path.join(root, "proto-" + h.hexdigest()[:16])
    if not os.path.isdir(out):
        try:
            os.makedirs(root, exist_ok=True)
        except OSError:  # no writable cache: a private temp dir for this process
            root = tempfile.mkdtemp(prefix="meshd-proto-")
            out = os.path.join(root, "proto-" + h.hexdigest()[:16])
        tmp = tempfile.mkdtemp(prefix="tmp-proto-", dir=root)
        try:
            for p in paths.values():
                # flat: each file from its own directory, so modules have no package prefix
                subprocess.run(["protoc", "--proto_path=" + os.path.dirname(p),
                                "--python_out=" + tmp, p], check=True)
            try:
                os.rename(tmp, out)
            except OSError:
                if not os.path.isdir(out):  # lost a race only if someone else made it
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _load(key):
    with _lock:
        if key not in _mods:
            out = _generate()
            name = os.path.basename(_FILES[key])[:-len(".proto")] + "_pb2"
            spec = importlib.util.spec_from_file_location("_meshd_" + name, os.path.join(out, name + ".py"))
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            _mods[key] = mod
        return _mods[key]


def tensor_pb2():
    return _load("tensor")


def health_pb2():
    return _load("health")
