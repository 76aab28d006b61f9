"""meshd.load gives every rank exactly numpy's values: .npy in each dtype meshd reads,
safetensors with many tensors, sharded along each dim over 2, 3 and 4 ranks, and a
checkpoint split over files through its index."""
import atexit
import json
import os
import shutil
import struct
import sys
import tempfile

import numpy as np
import pytest

import meshd_testlib as lib

sys.path.insert(0, os.path.join(lib.SOURCE_DIR, "clients", "python"))
if not os.environ.get("XDG_CACHE_HOME"):
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="meshd-load-cache-")
    atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)
import meshd  # noqa: E402
from meshd.errors import MeshdError  # noqa: E402

NPY_DTYPES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
              "bool")


def sample(dtype, shape, seed=0):
    r = np.random.default_rng(seed)
    n = int(np.prod(shape, dtype=np.int64))
    if dtype == "bool":
        return (r.integers(0, 2, n) == 1).reshape(shape)
    if dtype.startswith("float"):
        return r.standard_normal(n).astype(dtype).reshape(shape)
    info = np.iinfo(dtype)
    return r.integers(info.min, info.max, n, dtype=dtype, endpoint=True).reshape(shape)


def same(got, want):
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.tobytes() == want.tobytes(), (got, want)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("load-values")
    with lib.HttpFiles(root) as f:
        yield root, f


def fetch(t, **coords):
    return meshd.fetch_shard(t, timeout=30, **coords).get()


@pytest.mark.parametrize("dtype", NPY_DTYPES)
def test_npy_every_dtype_byte_for_byte(shared_meshd, files, dtype):
    root, f = files
    srv = shared_meshd(2)
    with meshd.connect(srv.address, timeout=30) as s, s.mesh(gpu=2).activate():
        for shape in [(3, 5), (), (0,), (1, 4), (4, 1, 2), (2, 0, 3)]:
            a = sample(dtype, shape)
            name = f"{dtype}-{'x'.join(map(str, shape)) or 'scalar'}.npy"
            np.save(root / name, a)
            t = meshd.load(f.url(name))
            for g in range(2):
                same(fetch(t, gpu=g), a)


def test_npy_fortran_and_big_endian_are_right_or_refused(shared_meshd, files):
    root, f = files
    srv = shared_meshd(2)
    with meshd.connect(srv.address, timeout=30) as s, s.mesh(gpu=2).activate():
        a = np.asfortranarray(sample("float32", (3, 4)))
        np.save(root / "fortran.npy", a)
        with pytest.raises(MeshdError, match="fortran_order"):
            meshd.load(f.url("fortran.npy"))
        # one dim > 1: the same bytes either way
        b = np.asfortranarray(sample("int32", (1, 6, 1)))
        np.save(root / "fortran1.npy", b)
        same(fetch(meshd.load(f.url("fortran1.npy"))), np.ascontiguousarray(b))
        c = sample("float64", (2, 3)).astype(">f8")
        np.save(root / "big.npy", c)
        with pytest.raises(MeshdError, match="big-endian"):
            meshd.load(f.url("big.npy"))
        d = sample("uint8", (2, 3)).astype(">u1")
        np.save(root / "bigu1.npy", d)
        same(fetch(meshd.load(f.url("bigu1.npy"))), d.astype("u1"))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_sharded_along_every_dim(shared_meshd, files, n):
    root, f = files
    srv = shared_meshd(4)
    shape = (2 * n, 3 * n, n)
    a = sample("int32", shape, seed=n)
    np.save(root / f"shard{n}.npy", a)
    (root / f"shard{n}.bin").write_bytes(a.tobytes())
    with meshd.connect(srv.address, timeout=30) as s, s.mesh(gpu=n).activate():
        for dim in range(-3, 3):
            for t in (meshd.load(f.url(f"shard{n}.npy"), shard="gpu", dim=dim),
                      meshd.load(f.url(f"shard{n}.bin"), dtype="int32", shape=shape,
                                 shard="gpu", dim=dim)):
                parts = np.split(a, n, axis=dim)
                for g in range(n):
                    same(fetch(t, gpu=g), parts[g])
        # a size that does not divide: refused, with the sizes named
        b = sample("float32", (n + 1, 2))
        np.save(root / f"odd{n}.npy", b)
        with pytest.raises(MeshdError, match="evenly"):
            fetch(meshd.load(f.url(f"odd{n}.npy"), shard="gpu", dim=0))


def test_sharded_over_a_2d_mesh(shared_meshd, files):
    root, f = files
    srv = shared_meshd(4)
    a = sample("int16", (4, 6), seed=7)
    np.save(root / "two_d.npy", a)
    with meshd.connect(srv.address, timeout=30) as s, s.mesh(host=2, gpu=2).activate():
        for dim in (0, 1):
            t = meshd.load(f.url("two_d.npy"), shard="gpu", dim=dim)
            parts = np.split(a, 2, axis=dim)
            for h in range(2):
                for g in range(2):
                    same(fetch(t, host=h, gpu=g), parts[g])
            t = meshd.load(f.url("two_d.npy"), shard="host", dim=dim)
            for h in range(2):
                for g in range(2):
                    same(fetch(t, host=h, gpu=g), parts[h])


def raw_safetensors(header, data):
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def test_safetensors_many_tensors_any_order_padding_metadata(shared_meshd, files):
    root, f = files
    srv = shared_meshd(2)
    arrays = {"b.weird \"name\"\\/\u00e9": sample("float32", (3, 4), 1),
              "a": sample("int64", (2, 2), 2),
              "z": sample("uint8", (5,), 3),
              "flag": sample("bool", (2, 3), 4),
              "h": sample("float16", (4, 2), 5),
              "empty": np.zeros((0, 3), np.int8),
              "scalar": np.array(3.5, np.float64),
              "i16": sample("int16", (2, 2), 6)}
    codes = {"float32": "F32", "float64": "F64", "float16": "F16", "int64": "I64",
             "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
    # data in reverse order of the header, with gaps of junk between tensors
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for k, a in reversed(list(arrays.items())):
        data += b"\xab" * 5
        header[k] = {"dtype": codes[a.dtype.name], "shape": list(a.shape),
                     "data_offsets": [len(data), len(data) + a.nbytes]}
        data += a.tobytes()
    (root / "many.safetensors").write_bytes(raw_safetensors(header, data))
    # bfloat16: its bits, split along dim 1
    bits = np.array([0x3f80, 0xc000, 0x7f80, 0x0001, 0x4049, 0x0000, 0xffff, 0x8000],
                    np.uint16).reshape(2, 4)
    (root / "bf16.safetensors").write_bytes(raw_safetensors(
        {"w": {"dtype": "BF16", "shape": [2, 4], "data_offsets": [0, 16]}}, bits.tobytes()))
    with meshd.connect(srv.address, timeout=30) as s, s.mesh(gpu=2).activate():
        sd = meshd.load(f.url("many.safetensors"))
        assert set(sd) == set(arrays)
        for k, a in arrays.items():
            for g in range(2):
                same(fetch(sd[k], gpu=g), a)
        w = meshd.load(f.url("bf16.safetensors"), name="w", shard="gpu", dim=1)
        for g in range(2):
            raw = meshd.fetch_shard(w, timeout=30, raw=True, gpu=g).get()
            same(raw.astype(np.uint16), np.split(bits, 2, axis=1)[g])


def test_checkpoint_index_over_files(shared_meshd, files):
    root, f = files
    srv = shared_meshd(2)
    a = {"l0.w": sample("float32", (4, 6), 11), "l1.w": sample("float32", (6, 4), 12),
         "emb": sample("int32", (8, 2), 13)}
    (root / "ck").mkdir()
    (root / "ck" / "m-1.safetensors").write_bytes(
        lib.safetensors_bytes({"l1.w": a["l1.w"], "l0.w": a["l0.w"]}))
    (root / "ck" / "m-2.safetensors").write_bytes(lib.safetensors_bytes({"emb": a["emb"]}))
    (root / "ck" / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": 1}, "weight_map": {"emb": "m-2.safetensors",
                                                      "l0.w": "m-1.safetensors",
                                                      "l1.w": "m-1.safetensors"}}))
    with meshd.connect(srv.address, timeout=30) as s, s.mesh(gpu=2).activate():
        sd = meshd.load(f.url("ck/model.safetensors.index.json"), shard="gpu", dim=0)
        assert list(sd) == ["emb", "l0.w", "l1.w"]
        for k, v in a.items():
            for g in range(2):
                same(fetch(sd[k], gpu=g), np.split(v, 2, axis=0)[g])


def test_checkpoint_index_naming_a_tensor_twice_is_refused(shared_meshd, files):
    """json-c keeps the last of duplicate keys: the index is refused, naming the
    tensor and the index's URL, instead of loading it from one of its files."""
    root, f = files
    srv = shared_meshd(2)
    (root / "dup").mkdir()
    for n in ("m-1", "m-2"):
        (root / "dup" / (n + ".safetensors")).write_bytes(
            lib.safetensors_bytes({"w": sample("float32", (2, 2), 1)}))
    (root / "dup" / "model.safetensors.index.json").write_text(
        '{"weight_map": {"w": "m-1.safetensors", "w": "m-2.safetensors"}}')
    with meshd.connect(srv.address, timeout=30) as s, s.mesh(gpu=2).activate():
        with pytest.raises(MeshdError) as ei:
            meshd.load(f.url("dup/model.safetensors.index.json"))
    msg = str(ei.value)
    assert "dup/model.safetensors.index.json" in msg, msg
    assert "the name 'w' appears more than once" in msg, msg


def test_sliced_meshes_npy_versions_and_many_rows(shared_meshd, files):
    root, f = files
    srv = shared_meshd(4)
    a = sample("float32", (300, 8), seed=21)
    for v in [(1, 0), (2, 0), (3, 0)]:
        with open(root / f"v{v[0]}.npy", "wb") as fh:
            np.lib.format.write_array(fh, a, version=v)
    big = sample("float64", (4, 1 << 19), seed=22)  # 16 MiB
    np.save(root / "big.npy", big)
    with meshd.connect(srv.address, timeout=60) as s:
        m4 = s.mesh(gpu=4)
        for sl in (slice(1, 3), slice(0, 4, 2), slice(2, 4)):
            with m4.slice(gpu=sl).activate():
                for v in (1, 2, 3):
                    for dim in (0, 1):
                        t = meshd.load(f.url(f"v{v}.npy"), shard="gpu", dim=dim)
                        for g in range(2):
                            same(fetch(t, gpu=g), np.split(a, 2, axis=dim)[g])
        with m4.activate():
            for dim in (0, 1):
                t = meshd.load(f.url("big.npy"), shard="gpu", dim=dim)
                for g in range(4):
                    same(fetch(t, gpu=g), np.split(big, 4, axis=dim)[g])


def test_raw_bytes_from_a_server_that_ignores_range(shared_meshd):
    srv = shared_meshd(2)
    with lib.range_http_server() as base:
        n = 4096
        body = np.array([(i * 7 + 3) % 256 for i in range(n)], np.uint8)
        with meshd.connect(srv.address, timeout=60) as s, s.mesh(gpu=2).activate():
            for path in ("norange", "bytes", "nohead"):
                url = f"{base}/{path}/{n}"
                for dim in (0, 1, 2):
                    t = meshd.load(url, dtype="uint8", shape=(16, 16, 16), shard="gpu", dim=dim)
                    for g in range(2):
                        same(fetch(t, gpu=g), np.split(body.reshape(16, 16, 16), 2, axis=dim)[g])
                t = meshd.load(url, dtype="int16", shape=(2048,))
                same(fetch(t, gpu=1), body.view("<i2"))


def test_file_urls_sharded(shared_meshd, tmp_path_factory):
    root = tmp_path_factory.mktemp("load-file-urls")
    srv = shared_meshd(2, "--url-allow", f"file://{root}")
    a = sample("int16", (6, 4, 2), seed=31)
    np.save(root / "x.npy", a)
    st = {"w": sample("float32", (4, 6), 32), "b": sample("int8", (2,), 33)}
    (root / "m.safetensors").write_bytes(lib.safetensors_bytes(st))
    with meshd.connect(srv.address, timeout=60) as s, s.mesh(gpu=2).activate():
        for dim in (0, 1, 2):
            t = meshd.load(f"file://{root}/x.npy", shard="gpu", dim=dim)
            for g in range(2):
                same(fetch(t, gpu=g), np.split(a, 2, axis=dim)[g])
        sd = meshd.load(f"file://{root}/m.safetensors", shard="gpu", dim=0)
        for k, v in st.items():
            for g in range(2):
                same(fetch(sd[k], gpu=g), np.split(v, 2, axis=0)[g])


def test_safetensors_header_past_the_first_read(shared_meshd, files):
    root, f = files
    srv = shared_meshd(2)
    st = {f"model.layers.{i}.{'x' * 150}": np.full((2,), i, np.int32) for i in range(500)}
    (root / "wide.safetensors").write_bytes(lib.safetensors_bytes(st))
    assert (root / "wide.safetensors").stat().st_size > 70000
    with meshd.connect(srv.address, timeout=60) as s, s.mesh(gpu=2).activate():
        info = meshd.inspect_url(f.url("wide.safetensors"))
        assert list(info["tensors"]) == list(st)
        k = list(st)[-1]
        same(fetch(meshd.load(f.url("wide.safetensors"), name=k, shard="gpu", dim=0), gpu=1),
             st[k][1:])


def test_safetensors_names_given_twice_or_holding_nul_are_refused(shared_meshd, files):
    """json-c keeps the last of duplicate keys and cuts a key at \\u0000: two tensors of
    one name (or of names equal up to a NUL) would silently become one."""
    root, f = files
    srv = shared_meshd(2)
    w = '{"dtype": "F32", "shape": [2], "data_offsets": [%d, %d]}'
    cases = {
        "dup.safetensors": ('{"w": %s, "w": %s}' % (w % (0, 8), w % (8, 16)),
                            "'w' appears more than once"),
        "dupesc.safetensors": ('{"w": %s, "\\u0077": %s}' % (w % (0, 8), w % (8, 16)),
                               "'w' appears more than once"),
        "nul2.safetensors": ('{"a\\u0000x": %s, "a\\u0000y": %s}' % (w % (0, 8), w % (8, 16)),
                             "\\u0000"),
        "nul.safetensors": ('{"a\\u0000x": %s}' % (w % (0, 8)), "\\u0000"),
    }
    with meshd.connect(srv.address, timeout=30) as s, s.mesh(gpu=2).activate():
        for name, (header, needle) in cases.items():
            h = header.encode()
            h += b" " * (-len(h) % 8)
            (root / name).write_bytes(struct.pack("<Q", len(h)) + h + bytes(16))
            for fn in (lambda: meshd.inspect_url(f.url(name)), lambda: meshd.load(f.url(name))):
                with pytest.raises(MeshdError) as e:
                    fn()
                msg = str(e.value)
                assert needle in msg and name in msg, (name, msg)


def test_raw_bytes_through_redirects_and_retries(shared_meshd):
    srv = shared_meshd(2)
    with lib.range_http_server() as base:
        n = 4096
        body = np.array([(i * 7 + 3) % 256 for i in range(n)], np.uint8).reshape(16, 16, 16)
        with meshd.connect(srv.address, timeout=60) as s, s.mesh(gpu=2).activate():
            for i, path in enumerate(["redirect/bytes", "flaky/k{}/2", "reset/r{}/2",
                                      "redirect/nohead"]):
                for dim in (0, 2):
                    url = f"{base}/{path.format(f'{i}{dim}')}/{n}"
                    t = meshd.load(url, dtype="uint8", shape=(16, 16, 16), shard="gpu", dim=dim)
                    for g in range(2):
                        same(fetch(t, gpu=g), np.split(body, 2, axis=dim)[g])


def test_ranges_past_the_staging_buffer(shared_meshd, files):
    """Ranges longer than the agents' 8 MiB staging buffer (cuda agents), not a multiple
    of it, whole and split."""
    root, f = files
    srv = shared_meshd(2)
    a = sample("uint8", (2, 9_000_011), seed=41)
    np.save(root / "long.npy", a)
    with meshd.connect(srv.address, timeout=120) as s, s.mesh(gpu=2).activate():
        t = meshd.load(f.url("long.npy"))
        for g in range(2):
            same(fetch(t, gpu=g), a)
        t = meshd.load(f.url("long.npy"), shard="gpu", dim=0)
        for g in range(2):
            same(fetch(t, gpu=g), a[g:g + 1])


def test_versioned_files_every_range_checked(shared_meshd, tmp_path):
    """Loads through a server with an ETag (If-Match on every range) or only a
    Last-Modified (If-Unmodified-Since), split along a later dim (a range per row)."""
    a = sample("float32", (6, 4), seed=51)
    np.save(tmp_path / "v.npy", a)
    st = {"w": sample("int64", (2, 6), 52), "b": sample("float16", (4,), 53)}
    (tmp_path / "v.safetensors").write_bytes(lib.safetensors_bytes(st))
    srv = shared_meshd(2)
    with lib.range_http_server(tmp_path) as base:
        with meshd.connect(srv.address, timeout=60) as s, s.mesh(gpu=2).activate():
            for how in ("etag", "mtime"):
                url = f"{base}/files/k{how}/{how}/100000/"
                for dim in (0, 1):
                    t = meshd.load(url + "v.npy", shard="gpu", dim=dim)
                    for g in range(2):
                        same(fetch(t, gpu=g), np.split(a, 2, axis=dim)[g])
                sd = meshd.load(url + "v.safetensors", shard="gpu", dim=-1)
                for k, v in st.items():
                    for g in range(2):
                        same(fetch(sd[k], gpu=g), np.split(v, 2, axis=-1)[g])


def test_python_messages_hide_the_query_of_a_url_without_a_path():
    """meshd.load's own messages (a missing name, a refused tensor of a many-tensor
    load) show the URL as the agents do: no credentials, query or fragment, also
    when the URL has no path (the query held a presigned signature)."""
    from meshd.load import _redact
    for url, shown in [("https://host?X-Amz-Signature=SECRET", "https://host"),
                       ("https://u:pw@host?sig=SECRET", "https://host"),
                       ("https://host#tok=SECRET", "https://host"),
                       ("https://host?sig=a/b", "https://host"),
                       ("https://host?sig=a@evil/b", "https://host"),
                       ("https://u:pw@host/p/m.safetensors?q=1#f", "https://host/p/m.safetensors"),
                       ("file:///data/x.npy", "file:///data/x.npy"),
                       ("host/x?y", "host/x")]:
        assert _redact(url) == shown, (url, _redact(url))


def test_load_in_a_pipeline_block_after_its_mesh(shared_meshd, files):
    """meshd.load's InspectUrl is another RPC than the pipelined commands: it must go
    after them (as Upload and Fetch do), else the server may not know the mesh yet."""
    root, f = files
    srv = shared_meshd(4)
    a = sample("int32", (4, 2), seed=61)
    np.save(root / "piped.npy", a)
    with meshd.connect(srv.address, timeout=30) as s:
        for _ in range(20):
            with s.pipeline():
                m = s.mesh(gpu=4).slice(gpu=slice(1, 3))
                with m.activate():
                    t = meshd.load(f.url("piped.npy"), shard="gpu", dim=0)
            for g in range(2):
                same(fetch(t, gpu=g), np.split(a, 2)[g])


def _exact_or_clear_error(t, parts, url, n):
    """Each rank's value is numpy's part, or the load fails naming the URL: never other
    bytes."""
    for g in range(n):
        try:
            got = fetch(t, gpu=g)
        except MeshdError as e:
            msg = str(e)
            assert url.split("//", 1)[1].split("/", 1)[1] in msg and "rank" in msg, msg
            return msg
        same(got, parts[g])
    return None


@pytest.mark.parametrize("path", ["crshift", "short206", "long206", "norange", "bytes"])
def test_misbehaving_servers_give_numpy_or_an_error(shared_meshd, path):
    """Coalesced ranges (a split along a later dim) and whole ranges against a server
    that answers another range, fewer or more bytes, or the whole body; 1- and 8-byte
    dtypes, odd shapes, empty parts."""
    srv = shared_meshd(2)
    cases = [("uint8", (3, 10, 7)), ("int64", (5, 2, 3)), ("uint8", (7, 2)),
             ("float64", (1, 4, 1)), ("uint8", (2, 0, 3)), ("int8", (0, 4))]
    with lib.range_http_server() as base:
        with meshd.connect(srv.address, timeout=60) as s, s.mesh(gpu=2).activate():
            for dtype, shape in cases:
                nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
                url = f"{base}/{path}/{nbytes}"
                a = np.frombuffer(bytes((i * 7 + 3) % 256 for i in range(nbytes)),
                                  dtype).reshape(shape)
                for dim in range(len(shape)):
                    if shape[dim] % 2:
                        continue
                    t = meshd.load(url, dtype=dtype, shape=shape, shard="gpu", dim=dim)
                    msg = _exact_or_clear_error(t, np.split(a, 2, axis=dim), url, 2)
                    if path in ("bytes", "norange"):
                        assert msg is None, msg


def _same_or_changed(t, n, gpus):
    """Every rank's bytes of one load are one version (all equal), or the load failed
    saying the file changed: never rank 0 old and rank 1 new."""
    got = []
    try:
        for g in range(gpus):
            got.append(fetch(t, gpu=g))
    except MeshdError as e:
        assert "changed" in str(e), e
        return
    for g in range(1, gpus):
        assert got[g].tobytes() == got[0].tobytes(), (
            f"rank 0 and rank {g} loaded different versions of one file with no error")


def test_raw_load_pins_one_version_across_ranks(meshd_server):
    """A raw load (dtype=, shape=) rewritten between two ranks' requests: rank 1's
    first op call runs 3 s, so rank 0 has read the file (whose first GET turns it into
    version 2) before rank 1 asks for its size. Each rank checked only its own HEAD:
    rank 0 held version 1, rank 1 version 2, and no error said so."""
    n = 4096
    srv = meshd_server(2, *lib.device_flags(2),
                       env={"MESHD_FAULT": "call:slow=3000,rank=1,count=2"})
    lib.wait_ready(srv, 2)
    with lib.range_http_server() as base:
        with meshd.connect(srv.address, timeout=60) as s, s.mesh(gpu=2).activate():
            for how in ("etag", "mtime-lax"):
                meshd.tensor(np.zeros(4, np.float32)) * 3  # held 3 s on rank 1
                # H = 1: rank 0's first GET (after its HEAD, or the inspection's)
                # changes the file, before rank 1's HEAD
                t = meshd.load(f"{base}/versioned/raw{how}/{how}/1/{n}", dtype="uint8",
                               shape=(n,))
                _same_or_changed(t, n, 2)


def test_file_loads_read_each_hosts_own_copy(shared_meshd, tmp_path_factory):
    """A checkpoint copied to every host's disk (file:///data/ckpt on each node): each
    copy has its own mtime, and the ranks reading another copy than the inspected one
    refused the load, "changed since it was inspected". Here rank 0 inspects and loads
    the file, then rank 1 loads the same tensors from another file at that path. One
    put in its place by a rename since (same size and header, other bytes, mtime + 5 s)
    is refused on rank 1, naming it: on the inspecting host's filesystem another file
    with another mtime is a replaced one (it loaded unnoticed). A copy that kept the
    mtime (cp -p, rsync -t; another host's copy keeps its own) loads where it holds
    each tensor as inspected (dtype, shape, offset); where its header says otherwise,
    or its size differs, it fails on rank 1, naming it. (The file inspected, saved
    again in place, stays refused: test_a_file_rewritten_at_the_same_size_is_refused
    in clients/python/tests/test_load.py.)"""
    from meshd.load import _load_one
    root = tmp_path_factory.mktemp("load-copies")
    srv = shared_meshd(2, "--url-allow", f"file://{root}")
    a, b = sample("float32", (4, 2), 41), sample("float32", (2, 2), 42)
    path, raw = root / "ckpt.safetensors", root / "raw.bin"
    header = {"a": {"dtype": "F32", "shape": [4, 2], "data_offsets": [0, 32]},
              "b": {"dtype": "F32", "shape": [2, 2], "data_offsets": [32, 48]}}
    path.write_bytes(raw_safetensors(header, a.tobytes() + b.tobytes()))
    raw.write_bytes(a.tobytes())
    inspected = {p: os.stat(p).st_mtime for p in (path, raw)}

    def copy_to(dst, data, later=0):
        """dst replaced by another file holding data, with the inspected mtime + later."""
        tmp = root / "copy.tmp"
        tmp.write_bytes(data)
        os.utime(tmp, (inspected[dst], inspected[dst] + later))
        os.replace(tmp, dst)

    with meshd.connect(srv.address, timeout=60) as s, s.mesh(gpu=2).activate() as m:
        url, raw_url = f"file://{path}", f"file://{raw}"
        info = meshd.inspect_url(url)  # on rank 0, the mesh's first
        raw_version = s._unary("InspectUrl", s._pb.InspectUrlRequest(
            url=raw_url, mesh=m.ref, size_only=True), s._pb.InspectUrlReply).version
        assert info["version"].startswith("mtime ") and " file " in info["version"], info

        def load(rank, name):
            dt, shape, off, _ = info["tensors"][name]
            return _load_one(m.slice(gpu=rank), url, dt, shape, off, info["file_size"],
                             None, 0, info["version"])

        def load_raw(rank):
            return _load_one(m.slice(gpu=rank), raw_url, "float32", (4, 2), 0, 0, None, 0,
                             raw_version)

        same(fetch(load(0, "a")), a)  # rank 0 reads the file inspected
        same(fetch(load_raw(0)), a)
        copy_to(path, raw_safetensors(header, (a * 2).tobytes() + b.tobytes()), later=5)
        copy_to(raw, (a * 2).tobytes(), later=5)
        for t, version in ((load(1, "a"), info["version"]), (load_raw(1), raw_version)):
            with pytest.raises(MeshdError) as ei:
                fetch(t)
            msg = str(ei.value)
            assert "rank 1" in msg and "changed since it was inspected" in msg, msg
            assert version in msg and "another file" in msg, msg
        header["b"]["dtype"] = "I32"  # a copy that kept the mtime: b's dtype differs
        copy_to(path, raw_safetensors(header, a.tobytes() + b.tobytes()))
        copy_to(raw, a.tobytes())
        same(fetch(load(1, "a")), a)  # (the session goes on after the refusals)
        same(fetch(load_raw(1)), a)
        with pytest.raises(MeshdError) as ei:
            fetch(load(1, "b"))
        msg = str(ei.value)
        assert "rank 1" in msg and "copy of" in msg and "float32 [2, 2]" in msg, msg
        copy_to(raw, a.tobytes()[:16])  # a copy of another size
        with pytest.raises(MeshdError, match=r"16 bytes.*rank 1|rank 1.*16 bytes"):
            fetch(load_raw(1))


def test_a_range_of_another_total_size_fails_the_load(shared_meshd):
    """A server with no ETag or Last-Modified whose file grew after the size check:
    HEAD says 100 bytes, every range's Content-Range says /200. Ranges within the old
    size pass every other check: the load must fail, not read a file that changed."""
    srv = shared_meshd(2)
    with lib.range_http_server() as base:
        with meshd.connect(srv.address, timeout=60) as s, s.mesh(gpu=2).activate():
            for shard in (None, "gpu"):
                t = meshd.load(f"{base}/headlies/100/200", dtype="uint8", shape=(100,),
                               shard=shard)
                with pytest.raises(MeshdError, match="changed during the load"):
                    fetch(t, gpu=1)
