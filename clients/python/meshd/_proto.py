"""Python modules for meshd's .proto files.

Where they come from, first match wins:
1. $MESHD_PROTO_DIR set: generated with protoc from that api/ directory.
2. An installed package: meshd/_gen/, which setup.py generated at build time; no protoc
   runs at import.
3. A checkout (PYTHONPATH=clients/python): generated with protoc from the repository's
   api/ found relative to this package.
Generated modules land in a cache directory keyed by a hash of the .proto files
($XDG_CACHE_HOME/meshd/proto-<hash>, default ~/.cache), so a changed .proto regenerates
by itself, and are loaded under private names, so no top-level `grpc` or `meshd`
package is shadowed.

This module imports nothing of meshd at load time: setup.py loads it by path to
generate the shipped modules with the same FILES and the same protoc call."""

import hashlib
import importlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
import threading
from types import ModuleType

_HERE = os.path.dirname(os.path.abspath(__file__))
FILES = {  # module key -> path under api/
    "tensor": os.path.join("meshd", "v1", "tensor_service.proto"),
    "health": os.path.join("grpc", "health", "v1", "health.proto"),
}
_lock = threading.Lock()
_mods: dict[str, ModuleType] = {}


def module_name(key: str) -> str:
    """The generated module's name for a FILES key: "tensor" -> "tensor_service_pb2"."""
    return os.path.basename(FILES[key])[:-len(".proto")] + "_pb2"


def api_dir() -> str:
    d = os.environ.get("MESHD_PROTO_DIR")
    if d:
        return d
    return os.path.normpath(os.path.join(_HERE, "..", "..", "..", "api"))


def _paths(api: str) -> list[str]:
    """The FILES of `api`; ImportError naming the first one missing."""
    paths = [os.path.join(api, p) for p in FILES.values()]
    for p in paths:
        if not os.path.isfile(p):
            raise ImportError(f"meshd: {p} not found; set MESHD_PROTO_DIR to meshd's api/ "
                              "directory, or install the package (pip install ./clients/python), "
                              "which ships the generated modules")
    return paths


def run_protoc(api: str, out: str) -> None:
    """Writes the module of every FILES entry of `api` into directory `out`, flat (each
    file from its own directory, so modules have no package prefix). ImportError naming
    what is missing: a .proto file, or protoc."""
    paths = _paths(api)
    protoc = shutil.which("protoc")
    if protoc is None:
        raise ImportError("meshd: protoc not found on PATH, needed to generate the modules of "
                          f"{api} (Debian: protobuf-compiler); or install the package "
                          "(pip install ./clients/python), which ships them")
    for p in paths:
        subprocess.run([protoc, "--proto_path=" + os.path.dirname(p), "--python_out=" + out, p],
                       check=True)


def _cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "meshd")


def _generate() -> str:
    """The cache directory holding the modules generated from api_dir()."""
    api = api_dir()
    _paths(api)
    h = hashlib.sha256()
    for k in sorted(FILES):
        with open(os.path.join(api, FILES[k]), "rb") as f:
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
            run_protoc(api, tmp)
            try:
                os.rename(tmp, out)
            except OSError:
                if not os.path.isdir(out):  # lost a race only if someone else made it
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _shipped(key: str) -> ModuleType | None:
    """meshd/_gen's module for `key`, or None where the package has none (a checkout)."""
    target = f"{__package__}._gen.{module_name(key)}"
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name in (f"{__package__}._gen", target):
            return None
        raise


def _load(key: str) -> ModuleType:
    with _lock:
        if key not in _mods:
            mod = None if os.environ.get("MESHD_PROTO_DIR") else _shipped(key)
            if mod is None:
                out = _generate()
                name = module_name(key)
                spec = importlib.util.spec_from_file_location("_meshd_" + name,
                                                              os.path.join(out, name + ".py"))
                assert spec is not None and spec.loader is not None
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
            _mods[key] = mod
        return _mods[key]


def tensor_pb2() -> ModuleType:
    return _load("tensor")


def health_pb2() -> ModuleType:
    return _load("health")
