"""meshd.load: tensors whose bytes each agent fetches itself from a URL.

    w = meshd.load("https://host/model.safetensors", name="wte")        # one tensor
    sd = meshd.load("https://host/model.safetensors", shard="gpu", dim=0)  # {name: Tensor}
    x = meshd.load("file:///data/x.bin", dtype="float32", shape=(1024, 1024))  # raw bytes

No byte passes through the server or the client: the server checks the URL against
its --url-allow, then every agent of the active mesh fetches its own part (with HTTP
Range requests when sharded). For .npy and safetensors files one agent reads the
header first (TensorService/InspectUrl), so dtype and shape come from the file.
Failures of the transfer itself (404, timeouts, a file that changed) fail the tensor
on the agents, as any op's failure does: they surface at fetch or sync, never as a
half-filled tensor.
"""

from __future__ import annotations

import threading
import urllib.parse
import warnings
from typing import Any

import numpy as np

from . import _active, _progress
from ._progress import Progress
from .errors import MeshdError
from .mesh import Mesh
from .tensor import DType, Shape, Tensor, _dtype_from_value, _dtype_value, _shape, dtype_name


def inspect_url(url: str, mesh: Mesh | None = None) -> dict[str, Any]:
    """What the file at `url` holds, read by the first agent of the (active) mesh:
    {"format": "npy" | "safetensors" | "safetensors_index", "file_size": int,
     "version": str (its ETag or modification time, which loads check; "": none;
                     a file's also names which file it is on the inspecting host),
     "metadata": str, "tensors": {name: (dtype, shape, offset, nbytes)},
     "files": {name: file}} (name "" for .npy). A safetensors index
    (model.safetensors.index.json) names each tensor's file, relative to the index;
    its "tensors" values are then empty, and "files" is empty for the others."""
    mesh = mesh if mesh is not None else _active.mesh()
    s, pb = mesh.session, mesh.session._pb
    r = s._unary("InspectUrl", pb.InspectUrlRequest(url=url, mesh=mesh.ref), pb.InspectUrlReply)
    return {"format": r.format, "file_size": r.file_size, "version": r.version,
            "metadata": r.metadata_json,
            "tensors": {t.name: (_dtype_from_value(pb, t.dtype), tuple(t.shape), t.offset,
                                 t.nbytes) for t in r.tensors},
            "files": {t.name: t.file for t in r.tensors if t.file}}


def _names(names) -> str:
    return ", ".join(sorted(names)[:20]) + (" ..." if len(names) > 20 else "")


def _load_index(mesh, url, files, name, one):
    """The tensors a safetensors index names (one, with `name`), each loaded from its
    file, whose URL is the index's with the file name in place of its last segment
    (without the index's query: a presigned index URL does not sign the files). Every
    file is inspected once, and must hold the tensors the index puts in it, before any
    tensor loads."""
    if name is not None:
        if name not in files:
            raise KeyError(f"meshd.load: no tensor named {name!r} in the index {_redact(url)}; "
                           f"it holds: {_names(files)}")
        wanted = {name: files[name]}
    else:
        wanted = files
    base = urllib.parse.urlsplit(url)._replace(query="", fragment="").geturl()
    by_file: dict[str, list[str]] = {}
    for k, f in wanted.items():
        by_file.setdefault(f, []).append(k)
    plan = []  # every file checked before anything loads
    for f, keys in by_file.items():
        furl = urllib.parse.urljoin(base, f)
        info = inspect_url(furl, mesh)
        if info["format"] != "safetensors":
            raise MeshdError("BAD_ARGUMENT", f"meshd.load: the index {_redact(url)} names "
                             f"{_redact(furl)} as a safetensors file, but it is a "
                             f"{info['format']} file")
        missing = [k for k in keys if k not in info["tensors"]]
        if missing:
            raise MeshdError("BAD_ARGUMENT", f"meshd.load: the index {_redact(url)} puts "
                             f"{_names(missing)} in {_redact(furl)}, which does not hold "
                             f"{'it' if len(missing) == 1 else 'them'}; it holds: "
                             f"{_names(info['tensors'])}")
        plan += [(k, furl, info) for k in keys]
    out = {k: one(k, furl, info) for k, furl, info in plan}
    if name is not None:
        return out[name]
    return {k: out[k] for k in wanted}


def _load_one(mesh, url, dtype, shape, offset, file_size, shard, dim, version=""):
    s, pb = mesh.session, mesh.session._pb
    f = dict(mesh=mesh.ref, stream=_active.stream_ref(s), url=url,
             dtype=_dtype_value(pb, dtype), shape=_shape(shape), offset=int(offset),
             file_size=int(file_size), shard=shard or "", dim=int(dim), version=version)
    box = {}

    def build(ref):
        box["ref"] = ref
        return pb.Load(ref=ref, **f)
    res = s._execute("load", build, claim=1)
    return Tensor._from_result(s, res, 0, box["ref"])


_ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1,
             "int16": 2, "int32": 4, "int64": 8, "bool": 1}
POLL_INTERVAL = 0.25  # seconds between two LoadProgress calls of a watched load
# LoadProgress answers that a later look may not give (the server's helpers all busy,
# a slow answer): the poller looks again instead of stopping
_POLL_AGAIN = ("QUOTA", "DEADLINE_EXCEEDED")
_PROGRESS_REFS_MAX = 256  # refs in one LoadProgress, the most the server takes


def _silent(unanswered):
    """What the bar says of ranks that gave LoadProgress no answer in time (their bytes
    are missing from the count): "" when every rank answered."""
    ranks = sorted({u.rank for u in unanswered})
    if not ranks:
        return ""
    return "no answer from rank" + ("s " if len(ranks) > 1 else " ") + ", ".join(map(str, ranks))


def _watch(mesh, tensors, progress, desc):
    """Progress of loads the agents run on their own: a thread polls
    TensorService/LoadProgress until every tensor is in (the tracker completes), one
    failed or the session ends (it stops where it stood). Nothing when progress= shows
    nothing (False, or the automatic rule says no)."""
    if any(t.dtype not in _ITEMSIZE for t in tensors):  # "dtype 99" of a newer server:
        return None  # its size unknown, there is no total to show (the load goes on)
    ranks = 1
    for n in mesh.sizes.values():
        ranks *= n
    total = sum(int(np.prod(t.shape, dtype=np.int64)) * _ITEMSIZE[t.dtype] * ranks
                for t in tensors)
    tr = _progress.tracker(total, progress, desc)
    if not tr.active or not tensors:
        tr.close(ok=bool(tensors) and tr.active)
        return None
    s, pb = mesh.session, mesh.session._pb
    refs = [t.ref for t in tensors]  # in pieces: the server answers _PROGRESS_REFS_MAX a call
    reqs = [pb.LoadProgressRequest(refs=refs[i:i + _PROGRESS_REFS_MAX])
            for i in range(0, len(refs), _PROGRESS_REFS_MAX)]

    def look():
        loads, unanswered = [], []
        for q in reqs:
            r = s._unary("LoadProgress", q, pb.LoadProgressReply)
            loads += r.loads
            unanswered += r.unanswered
        return loads, unanswered

    def poll():
        ok = False
        try:
            while not s.closed:
                try:
                    loads, unanswered = look()
                except MeshdError as e:
                    if s.closed or e.kind in ("NO_SESSION", "UNKNOWN_REF", "DROPPED"):
                        raise  # the session ended, or its tensors were dropped: nothing to show
                    if e.kind not in _POLL_AGAIN:
                        warnings.warn(f"meshd.load: the progress of the load stopped showing "
                                      f"(the load goes on): {e}", RuntimeWarning, stacklevel=1)
                        raise
                    tr.note(f"no progress answer: {e.kind}")  # the server is busy: ask again
                    threading.Event().wait(POLL_INTERVAL)
                    continue
                if any(x.failed for x in loads):
                    break
                done = sum(x.done_bytes for x in loads)
                if done >= total:
                    ok = True
                    break
                tr.set(done)
                tr.note(_silent(unanswered))
                threading.Event().wait(POLL_INTERVAL)
        except (MeshdError, ValueError):  # ValueError: grpc's closed channel
            pass  # the session ended or the server went: the bar stops where it is
        finally:
            tr.close(ok)
    th = threading.Thread(target=poll, name="meshd-load-progress", daemon=True)
    th.start()
    return th


def load(url: str, *, dtype: DType | None = None, shape: Shape | None = None,
         name: str | None = None, shard: str | None = None, dim: int = 0,
         progress: Progress = None) -> Tensor | dict[str, Tensor]:
    """A tensor (or, for a safetensors file without `name`, a dict of every tensor in
    it) loaded by the agents of the active mesh, on the active stream.

    Raw bytes need `dtype` and `shape` (the file must hold exactly that many bytes).
    .npy and safetensors files give theirs in the header; `name` picks one tensor of
    a safetensors file. `shard="gpu"` splits each tensor's dim `dim` evenly over the
    mesh dim "gpu": each rank fetches and holds only its slice (the tensor's shape is
    the local one); without it every rank loads the whole tensor.

    `progress` (meshd._progress): None shows a tqdm bar on a terminal for loads of at
    least 64 MiB (over all ranks), False nothing, True always a bar, a callable
    progress(done_bytes, total_bytes) is called as the agents fetch. The load itself
    does not wait: a background thread polls the agents until the bytes are in. A bar
    names the ranks whose agents did not answer the last poll in time."""
    _progress.check(progress)
    if not isinstance(url, str) or not url:
        raise TypeError(f"meshd.load: url must be a non-empty str, got {url!r}")
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
        raise TypeError(f"meshd.load: dim must be an int, got {dim!r}")
    mesh = _active.mesh()
    if shard is not None and shard not in mesh.sizes:
        raise MeshdError.of_kind("BAD_DIM", f"meshd.load: shard dim {shard!r} is not a dim of "
                                 f"{mesh!r}")
    if (dtype is None) != (shape is None):
        raise TypeError("meshd.load: raw bytes need both dtype= and shape=; give neither for "
                        ".npy and safetensors files")
    if dtype is not None:
        if name is not None:
            raise TypeError("meshd.load: name= picks a tensor of a safetensors file; raw bytes "
                            "(dtype= and shape=) have none")
        d = dim
        if d < 0:  # from the end, as for .npy and safetensors files
            nd = len(_shape(shape))
            if shard is not None and d < -nd:
                raise ValueError(f"meshd.load: shape {tuple(_shape(shape))} has no dim {dim} to "
                                 "shard")
            d += nd
        # Every rank reads the version the first agent sees now (its size is not
        # pinned: a raw file of another size says "check dtype= and shape="). A URL the
        # agent cannot read now loads unpinned: the tensor then fails on its ranks,
        # naming each, as it always did.
        s, pb = mesh.session, mesh.session._pb
        try:
            version = s._unary("InspectUrl", pb.InspectUrlRequest(
                url=url, mesh=mesh.ref, size_only=True), pb.InspectUrlReply).version
        except MeshdError as e:
            if e.kind in ("NO_SESSION", "PERMISSION_DENIED"):
                raise
            version = ""
        t = _load_one(mesh, url, dtype_name(dtype), shape, 0, 0, shard, d, version=version)
        _watch(mesh, [t], progress, "load")
        return t
    info = inspect_url(url, mesh)

    def one(key, url=url, info=info):
        dt, sh, off, _ = info["tensors"][key]
        d = dim
        if shard is not None and not -len(sh) <= d < len(sh):
            raise ValueError(f"meshd.load: {key or url!r} has shape {sh}: no dim {dim} to shard")
        if d < 0:
            d += len(sh)
        try:
            return _load_one(mesh, url, dt, sh, off, info["file_size"], shard, d,
                             info.get("version", ""))
        except MeshdError as e:  # which tensor of a many-tensor load was refused
            if not key:
                raise
            raise MeshdError.of_kind(e.kind, f"tensor {key!r} of {_redact(url)}: {e.message}",
                                     e.code, e.seq) from None
    if info["format"] == "safetensors_index":
        out = _load_index(mesh, url, info["files"], name, one)
    elif info["format"] == "npy":
        if name is not None:
            raise TypeError("meshd.load: name= picks a tensor of a safetensors file; this is a "
                            ".npy file")
        out = one("")
    elif name is not None:
        if name not in info["tensors"]:
            have = _names(info["tensors"])
            raise KeyError(f"meshd.load: no tensor named {name!r} in {_redact(url)}; it holds: "
                           f"{have}")
        out = one(name)
    else:
        out = {k: one(k) for k in info["tensors"]}
    _watch(mesh, list(out.values()) if isinstance(out, dict) else [out], progress, "load")
    return out


def _redact(url):
    """The URL without credentials, query or fragment (as the agents' messages show it)."""
    url = url.split("?")[0].split("#")[0]  # first: a URL without a path has them too
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    host, slash, path = rest.partition("/")
    host = host.rpartition("@")[2]
    return scheme + sep + host + slash + path
