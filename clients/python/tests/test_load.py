"""meshd.load (issue 14 point 4): agents fetch tensors from URLs themselves.

A real meshd with 4 local agents; an HTTP server in this process serves files the
tests write (raw, .npy, and safetensors written byte for byte from its spec with
numpy), with Range requests, and misbehaves on the paths that say so. Every error
the issue lists is covered, and after each one the session and the pool still work.
"""

import hashlib
import http.server
import json
import os
import re
import signal
import socketserver
import struct
import subprocess
import threading
import time

import numpy as np
import pytest

import meshd
from conftest import BIN_DIR, _TMP, start_meshd, stop_meshd

FILES = os.path.join(_TMP, "load-files")


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    requests = []          # every path asked, in order
    flaky = {}             # path -> 500s still to answer

    def log_message(self, *a):
        pass

    def _send(self, code, body=b"", headers=()):
        self.send_response(code)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        path = self.path.split("?")[0]
        _Handler.requests.append(path)
        parts = path.strip("/").split("/")
        if parts[0] == "status":
            return self._send(int(parts[1]), b"no")
        if parts[0] == "slow":
            time.sleep(float(parts[1]))
            parts = parts[2:]
        if parts[0] == "flaky":
            left = _Handler.flaky.get(path, 0)
            if left:
                _Handler.flaky[path] = left - 1
                return self._send(500, b"try again")
            parts = parts[1:]
        trickle = parts[0] == "trickle"  # the body in 64 KiB pieces, 20 ms apart
        if trickle:
            parts = parts[1:]
        drip = parts[0] == "drip"  # the body in 100-byte pieces, 100 ms apart (1 KB/s)
        if drip:
            parts = parts[1:]
        truncated = parts[0] == "truncated"
        if truncated:
            parts = parts[1:]
        long_tag = parts[0] == "longtag"  # a 258-character ETag, and If-Match honoured
        if long_tag:
            parts = parts[1:]
        name = os.path.join(FILES, *parts)
        if not os.path.isfile(name):
            return self._send(404, b"not found")
        with open(name, "rb") as f:
            data = f.read()
        rng = self.headers.get("Range")
        code, first, last = 200, 0, len(data) - 1
        if rng and rng.startswith("bytes="):
            a, b = rng[6:].split("-")
            first, last = int(a), min(int(b) if b else len(data) - 1, len(data) - 1)
            code = 206
        body = data[first:last + 1]
        # a strong validator, as object stores give one: the content's hash
        tag = hashlib.sha256(data).hexdigest()
        tag = '"%s"' % (tag * 4 if long_tag else tag[:16])
        if long_tag and self.headers.get("If-Match", tag) != tag:
            return self._send(412, b"precondition failed")
        headers = [("Accept-Ranges", "bytes"), ("ETag", tag)]
        if code == 206:
            headers.append(("Content-Range", f"bytes {first}-{last}/{len(data)}"))
        if truncated and self.command == "GET":
            self.send_response(code)
            for k, v in headers:
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[:len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        if (trickle or drip) and self.command == "GET":
            self.send_response(code)
            for k, v in headers:
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            step, pause = (100, 0.1) if drip else (65536, 0.02)
            try:
                for i in range(0, len(body), step):
                    self.wfile.write(body[i:i + step])
                    self.wfile.flush()
                    time.sleep(pause)
            except OSError:
                self.close_connection = True
            return
        self._send(code, body, headers)


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


@pytest.fixture(scope="module")
def http_base():
    os.makedirs(FILES, exist_ok=True)
    srv = _Server(("127.0.0.1", 0), _Handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def load_server(http_base):
    os.makedirs(FILES, exist_ok=True)
    addr, proc = start_meshd(4, name="meshd-load", flags=(
        f"--url-allow=http://127.0.0.1,file://{FILES}", "--url-timeout-ms", "3000",
        "--url-retries", "3"))
    try:
        yield addr
    finally:
        stop_meshd(proc)


@pytest.fixture
def gpu4(load_server):
    with meshd.connect(load_server) as s:
        m = s.mesh(gpu=4)
        with m.activate():
            yield s


def write(name, data):
    with open(os.path.join(FILES, name), "wb") as f:
        f.write(data)
    return name


def safetensors_bytes(tensors, metadata=None):
    """A safetensors file from its spec: u64 little-endian header size, the JSON header
    (dtype, shape, data_offsets relative to the byte buffer), then the buffer."""
    codes = {"float32": "F32", "float64": "F64", "float16": "F16", "int64": "I64",
             "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
    header, buf = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for k, a in tensors.items():
        raw = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes()
        header[k] = {"dtype": codes[a.dtype.name], "shape": list(a.shape),
                     "data_offsets": [len(buf), len(buf) + len(raw)]}
        buf += raw
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + buf


def fetch(t, **coords):
    return meshd.fetch_shard(t, **coords).result()


def still_works():
    """The session and the pool after a failure: a command and a fetch succeed."""
    x = meshd.full((3,), 2.0) * 3
    for r in range(4):
        np.testing.assert_array_equal(fetch(x, gpu=r), np.full(3, 6.0, np.float32))


# ------------------------------------------------------------------ formats


def test_raw_bytes_replicated_and_sharded_over_4_agents(gpu4, http_base):
    a = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    write("raw.bin", a.tobytes())
    t = meshd.load(f"{http_base}/raw.bin", dtype="float32", shape=(8, 6))
    assert t.shape == (8, 6) and t.dtype == "float32"
    for r in range(4):
        np.testing.assert_array_equal(fetch(t, gpu=r), a)
    rows = meshd.load(f"{http_base}/raw.bin", dtype=np.float32, shape=(8, 6), shard="gpu", dim=0)
    assert rows.shape == (2, 6)
    for r in range(4):
        np.testing.assert_array_equal(fetch(rows, gpu=r), a[2 * r:2 * r + 2])
    b = np.arange(3 * 8, dtype=np.int16).reshape(3, 8)
    write("cols.bin", b.tobytes())
    cols = meshd.load(f"file://{FILES}/cols.bin", dtype="int16", shape=[3, 8], shard="gpu",
                      dim=1)
    assert cols.shape == (3, 2)
    for r in range(4):
        np.testing.assert_array_equal(fetch(cols, gpu=r), b[:, 2 * r:2 * r + 2])


def test_npy_header_gives_dtype_and_shape_and_a_column_split_uses_strided_ranges(gpu4, http_base):
    a = (np.arange(6 * 8, dtype=np.int64) * 3 - 7).reshape(6, 8)
    np.save(os.path.join(FILES, "a.npy"), a)
    t = meshd.load(f"{http_base}/a.npy")
    assert t.shape == (6, 8) and t.dtype == "int64"
    np.testing.assert_array_equal(fetch(t, gpu=3), a)
    before = len(_Handler.requests)
    cols = meshd.load(f"{http_base}/a.npy", shard="gpu", dim=1)
    assert cols.shape == (6, 2)
    for r in range(4):
        np.testing.assert_array_equal(fetch(cols, gpu=r), a[:, 2 * r:2 * r + 2])
    # One inspection (a size probe and a header read), then per rank a size probe and
    # one range: the rows of its column block 64 bytes apart are asked at once, the
    # gaps read through (one request per row cost a round trip each).
    asked = _Handler.requests[before:]
    assert len(asked) <= 3 + 4 * 2, asked


def test_a_column_split_of_many_rows_asks_one_range_per_rank(gpu4, http_base):
    """300 rows split along dim 1 over 4 ranks: each rank's 300 row pieces (8 bytes
    each, 24 bytes apart) come in one Range request, not 300; the values are the
    columns'. A split whose rows lie far apart still asks per row (gaps over 256 KiB)."""
    a = np.arange(300 * 8, dtype=np.float32).reshape(300, 8) * 0.5 - 3
    np.save(os.path.join(FILES, "rows.npy"), a)
    before = len(_Handler.requests)
    cols = meshd.load(f"{http_base}/rows.npy", shard="gpu", dim=1)
    for r in range(4):
        np.testing.assert_array_equal(fetch(cols, gpu=r), a[:, 2 * r:2 * r + 2])
    asked = _Handler.requests[before:]
    assert len(asked) <= 3 + 4 * 2, f"{len(asked)} requests: {asked[:12]}..."
    wide = np.arange(3 * (1 << 17), dtype=np.int32).reshape(3, 1 << 17)  # rows 512 KiB
    np.save(os.path.join(FILES, "wide.npy"), wide)
    before = len(_Handler.requests)
    w = meshd.load(f"{http_base}/wide.npy", shard="gpu", dim=1)
    for r in range(4):
        np.testing.assert_array_equal(fetch(w, gpu=r), np.split(wide, 4, axis=1)[r])
    asked = _Handler.requests[before:]
    assert len(asked) >= 4 * 3, f"gaps of 384 KiB read through: {asked}"


def test_file_urls_inside_the_allowed_directory(gpu4):
    a = np.linspace(0, 1, 12, dtype=np.float64).reshape(3, 4)
    np.save(os.path.join(FILES, "f.npy"), a)
    t = meshd.load(f"file://{FILES}/f.npy")
    np.testing.assert_array_equal(fetch(t, gpu=1), a)
    # outside the directory: refused the same whether the file exists or not (the
    # server checks the path as text: it names the agents' files, not its own)
    for url in ("file:///etc/hostname", "file:///etc/meshd-no-such-file.npy",
                f"file://{FILES}/../etc/x.npy"):
        for call in (lambda: meshd.load(url), lambda: meshd.load(url, dtype="uint8", shape=(1,))):
            with pytest.raises(meshd.MeshdError) as ei:
                call()
            assert ei.value.kind == "PERMISSION_DENIED", ei.value
            assert "outside the directories" in str(ei.value), ei.value


def test_safetensors_one_tensor_by_name_and_a_checkpoint_sharded_over_4_agents(gpu4, http_base):
    rng = np.random.default_rng(7)
    ckpt = {"wte": rng.standard_normal((16, 8)).astype(np.float32),
            "ln.bias": rng.standard_normal(8).astype(np.float32),
            "proj": rng.integers(-100, 100, (4, 12)).astype(np.int32),
            "half": rng.standard_normal((8, 4)).astype(np.float16)}
    write("model.safetensors", safetensors_bytes(ckpt, {"format": "pt"}))
    url = f"{http_base}/model.safetensors"
    info = meshd.inspect_url(url)
    assert info["format"] == "safetensors" and json.loads(info["metadata"]) == {"format": "pt"}
    assert info["tensors"]["proj"][:2] == ("int32", (4, 12))
    w = meshd.load(url, name="proj")
    np.testing.assert_array_equal(fetch(w, gpu=2), ckpt["proj"])
    sd = meshd.load(url, shard="gpu", dim=0)
    assert set(sd) == set(ckpt)
    for k, a in ckpt.items():
        n = a.shape[0] // 4
        assert sd[k].shape == (n,) + a.shape[1:]
        for r in range(4):
            np.testing.assert_array_equal(fetch(sd[k], gpu=r), a[r * n:(r + 1) * n])


def write_sharded_checkpoint(ckpt, files, index_name, subdir="ckpt"):
    """A checkpoint as huggingface's save_pretrained splits it: each file of `files`
    (file name -> tensor names) a safetensors file, and an index naming each tensor's
    file (written as json.dump indents it), all under FILES/subdir."""
    os.makedirs(os.path.join(FILES, subdir), exist_ok=True)
    weight_map, total = {}, 0
    for f, names in files.items():
        os.makedirs(os.path.dirname(os.path.join(FILES, subdir, f)), exist_ok=True)
        write(os.path.join(subdir, f), safetensors_bytes({k: ckpt[k] for k in names}))
        for k in names:
            weight_map[k] = f
            total += ckpt[k].nbytes
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write(os.path.join(subdir, index_name), json.dumps(index, indent=2).encode())
    return total


def test_a_checkpoint_split_over_files_loads_through_its_index_sharded_over_4_agents(gpu4,
                                                                                      http_base):
    rng = np.random.default_rng(11)
    ckpt = {"embed.weight": rng.standard_normal((16, 8)).astype(np.float32),
            "layers.0.attn.weight": rng.standard_normal((8, 8)).astype(np.float16),
            "layers.0.mlp.weight": rng.integers(-9, 9, (12, 4)).astype(np.int32),
            "layers.1.attn.weight": rng.standard_normal((4, 8)).astype(np.float32),
            "lm_head.weight": rng.standard_normal((8, 16)).astype(np.float64)}
    files = {"model-00001-of-00003.safetensors": ["embed.weight", "layers.0.attn.weight"],
             "model-00002-of-00003.safetensors": ["layers.0.mlp.weight", "layers.1.attn.weight"],
             "part/model-00003-of-00003.safetensors": ["lm_head.weight"]}
    total = write_sharded_checkpoint(ckpt, files, "model.safetensors.index.json")
    for base in (f"{http_base}/ckpt", f"file://{FILES}/ckpt"):
        url = f"{base}/model.safetensors.index.json"
        info = meshd.inspect_url(url)
        assert info["format"] == "safetensors_index"
        assert json.loads(info["metadata"]) == {"total_size": total}
        assert info["files"] == {k: f for f, ks in files.items() for k in ks}
        sd = meshd.load(url, shard="gpu", dim=0)
        assert list(sd) == list(ckpt), "the index's order"
        for k, a in ckpt.items():
            n = a.shape[0] // 4
            assert sd[k].shape == (n,) + a.shape[1:] and sd[k].dtype == a.dtype.name
            for r in range(4):
                np.testing.assert_array_equal(fetch(sd[k], gpu=r), a[r * n:(r + 1) * n])
        w = meshd.load(url, name="lm_head.weight")
        np.testing.assert_array_equal(fetch(w, gpu=3), ckpt["lm_head.weight"])
    # A query on the index's URL (a presigned one) is not passed on to its files.
    w = meshd.load(f"{http_base}/ckpt/model.safetensors.index.json?sig=abc", name="embed.weight")
    np.testing.assert_array_equal(fetch(w, gpu=0), ckpt["embed.weight"])


def test_a_bad_index_is_refused_with_what_is_wrong(gpu4, http_base):
    ckpt = {"a": np.arange(4, dtype=np.float32), "b": np.ones(4, np.float32)}
    write_sharded_checkpoint(ckpt, {"one.safetensors": ["a"]}, "bad.index.json", "badckpt")
    base = f"{http_base}/badckpt"
    with pytest.raises(KeyError, match="'zz'.*in the index .*bad.index.json.*it holds: a"):
        meshd.load(f"{base}/bad.index.json", name="zz")
    # The index puts a tensor in a file that does not hold it.
    write("badckpt/wrong.index.json", json.dumps(
        {"weight_map": {"a": "one.safetensors", "b": "one.safetensors"}}).encode())
    with pytest.raises(meshd.MeshdError) as ei:
        meshd.load(f"{base}/wrong.index.json")
    assert ei.value.kind == "BAD_ARGUMENT", ei.value
    assert "puts b in" in ei.value.message and "one.safetensors" in ei.value.message, ei.value
    # A file the index names that is not there: the agent's 404, naming it.
    write("badckpt/gone.index.json", json.dumps({"weight_map": {"a": "gone.safetensors"}}).encode())
    with pytest.raises(meshd.MeshdError) as ei:
        meshd.load(f"{base}/gone.index.json")
    assert "404" in ei.value.message and "gone.safetensors" in ei.value.message, ei.value
    # File names that would leave the index's directory, or name another host.
    for f in ("../model.safetensors", "/etc/passwd", "https://evil.example/x.safetensors"):
        write("badckpt/escape.index.json", json.dumps({"weight_map": {"a": f}}).encode())
        with pytest.raises(meshd.MeshdError) as ei:
            meshd.load(f"{base}/escape.index.json")
        assert ei.value.kind == "BAD_ARGUMENT", ei.value
        assert "safetensors index: tensor 'a': file" in ei.value.message, ei.value
    # JSON that is no index.
    write("badckpt/notindex.json", b'{"hello": "world"}\n')
    with pytest.raises(meshd.MeshdError, match="no \"weight_map\" object"):
        meshd.load(f"{base}/notindex.json")
    still_works()


def test_an_index_too_big_for_one_message_names_the_flag_and_the_flag_lets_it_through(
        gpu4, http_base):
    # 2,000 tensors (MoE checkpoints have tens of thousands): about 90 KB of reply.
    wm = {f"model.layers.{i // 20}.experts.{i % 20}.w": f"m-{i // 500:05d}-of-00004.safetensors"
          for i in range(2000)}
    write("big.index.json", json.dumps({"weight_map": wm}).encode())
    url = f"{http_base}/big.index.json"
    addr, proc = start_meshd(1, name="meshd-small-messages", flags=(
        "--url-allow=http://127.0.0.1", "--max-message-bytes", "64KiB"))
    try:
        with meshd.connect(addr) as s:
            with s.mesh(gpu=1).activate():
                with pytest.raises(meshd.MeshdError) as ei:
                    meshd.inspect_url(url)
                # The agent's own refusal: its limit is the server's (local agents take it).
                assert ei.value.kind == "QUOTA", ei.value
                assert "names 2000 tensors" in ei.value.message, ei.value
                assert "over the 65536-byte --max-message-bytes" in ei.value.message, ei.value
                x = meshd.full((2,), 3.0)
                np.testing.assert_array_equal(fetch(x, gpu=0), np.full(2, 3.0, np.float32))
    finally:
        stop_meshd(proc)
    info = meshd.inspect_url(url)  # the module's server: the default 4 MiB
    assert info["format"] == "safetensors_index" and info["files"] == wm


def test_loaded_tensors_compute_like_any_other(gpu4, http_base):
    a = np.arange(16, dtype=np.float32).reshape(4, 4)
    np.save(os.path.join(FILES, "c.npy"), a)
    t = meshd.load(f"{http_base}/c.npy", shard="gpu", dim=0)
    s = t.reduce("gpu", "sum")
    for r in range(4):
        np.testing.assert_array_equal(fetch(s, gpu=r), a.sum(axis=0, keepdims=True))


def test_5xx_is_retried(gpu4, http_base):
    a = np.arange(5, dtype=np.float32)
    write("retry.bin", a.tobytes())
    _Handler.flaky["/flaky/retry.bin"] = 2
    t = meshd.load(f"{http_base}/flaky/retry.bin", dtype="float32", shape=(5,))
    np.testing.assert_array_equal(fetch(t, gpu=0), a)


# ------------------------------------------------------------------ errors


def failure(t, rank=0):
    with pytest.raises(meshd.MeshdError) as ei:
        fetch(t, gpu=rank)
    return ei.value


def test_404_and_403_name_the_url_status_and_rank_without_credentials(gpu4, http_base):
    port = http_base.rsplit(":", 1)[1]
    t = meshd.load(f"http://user:hunter2@127.0.0.1:{port}/missing.bin?sig=SECRET",
                   dtype="float32", shape=(4,))
    e = failure(t, rank=2)
    assert "HTTP 404" in e.message and "/missing.bin" in e.message, e
    # "(rank 2)" from the server, or "direct fetch of rank 2 (agent ...)" when the fetch
    # reached the agent before its report of the failure reached the server.
    assert re.search(r"\brank \d\b", e.message), e
    assert "hunter2" not in e.message and "SECRET" not in e.message, e
    with pytest.raises(meshd.MeshdError) as ei:
        meshd.load(f"{http_base}/status/403")
    assert ei.value.kind == "PERMISSION_DENIED" and "403" in ei.value.message, ei.value
    still_works()


def test_size_mismatch_for_raw_bytes_fails_the_tensor_whole(gpu4, http_base):
    write("short.bin", np.zeros(10, np.float32).tobytes())
    t = meshd.load(f"{http_base}/short.bin", dtype="float32", shape=(12,))
    e = failure(t)
    assert e.kind == "BAD_ARGUMENT" and "40 bytes" in e.message and "48" in e.message, e
    still_works()


def test_a_file_changed_after_inspection_is_refused(gpu4, http_base):
    np.save(os.path.join(FILES, "moving.npy"), np.zeros((4, 4), np.float32))
    url = f"{http_base}/moving.npy"
    info = meshd.inspect_url(url)
    np.save(os.path.join(FILES, "moving.npy"), np.zeros((4, 5), np.float32))
    dt, shape, off, _ = info["tensors"][""]
    from meshd.load import _load_one
    t = _load_one(meshd._active.mesh(), url, dt, shape, off, info["file_size"], None, 0)
    e = failure(t, rank=1)
    assert "changed" in e.message and re.search(r"\(rank \d\)", e.message), e


def test_a_file_rewritten_at_the_same_size_is_refused(gpu4, http_base):
    """A checkpoint saved again in place, same size, between the inspection and the
    load: every rank compares the file's ETag (http) or modification time (file://)
    with the inspection's and refuses it, instead of reading another version."""
    from meshd.load import _load_one
    np.save(os.path.join(FILES, "resaved.npy"), np.zeros(16, np.float32))
    for url in (f"{http_base}/resaved.npy", f"file://{FILES}/resaved.npy"):
        info = meshd.inspect_url(url)
        assert info["version"].startswith("etag " if url.startswith("http") else "mtime "), info
        np.save(os.path.join(FILES, "resaved.npy"), np.ones(16, np.float32))
        st = os.stat(os.path.join(FILES, "resaved.npy"))
        os.utime(os.path.join(FILES, "resaved.npy"), (st.st_atime, st.st_mtime + 5))
        assert meshd.inspect_url(url)["file_size"] == info["file_size"]
        dt, shape, off, _ = info["tensors"][""]
        t = _load_one(meshd._active.mesh(), url, dt, shape, off, info["file_size"], None, 0,
                      info["version"])
        e = failure(t, rank=2)
        assert "changed since it was inspected" in e.message, e
        assert info["version"] in e.message, e
        # loaded afresh, it is the new one
        np.testing.assert_array_equal(fetch(meshd.load(url), gpu=3), np.ones(16, np.float32))
        np.save(os.path.join(FILES, "resaved.npy"), np.zeros(16, np.float32))
    still_works()


def test_truncated_body_is_retried_then_fails(gpu4, http_base):
    write("trunc.bin", np.ones(1024, np.float32).tobytes())
    t = meshd.load(f"{http_base}/truncated/trunc.bin", dtype="float32", shape=(1024,))
    e = failure(t)
    assert e.kind == "UNAVAILABLE" and "trunc.bin" in e.message, e
    still_works()


def test_timeout_and_connection_refused(gpu4, http_base):
    write("slow.bin", np.ones(4, np.float32).tobytes())
    t = meshd.load(f"{http_base}/slow/5/slow.bin", dtype="float32", shape=(4,))
    e = failure(t)
    assert e.kind == "DEADLINE_EXCEEDED" and "slow.bin" in e.message, e
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    t = meshd.load(f"http://127.0.0.1:{port}/x.bin", dtype="float32", shape=(4,))
    e = failure(t)
    assert e.kind == "UNAVAILABLE" and f"127.0.0.1:{port}/x.bin" in e.message, e
    still_works()


def test_a_server_that_drips_its_body_fails_the_load_under_url_min_speed(http_base):
    """Without --url-timeout-ms, a server sending a byte now and then held a load for
    ever (the check was "nothing at all for 60 s"); --url-min-speed over --url-slow-s
    fails it as a timeout naming the URL and the rate."""
    write("drip.bin", np.arange(4000, dtype=np.float32).tobytes())
    addr, proc = start_meshd(1, name="meshd-drip", flags=(
        "--url-allow=http://127.0.0.1", "--url-min-speed", "4096", "--url-slow-s", "1"))
    try:
        with meshd.connect(addr) as s:
            with s.mesh(gpu=1).activate():
                t0 = time.monotonic()
                t = meshd.load(f"{http_base}/drip/drip.bin", dtype="float32", shape=(4000,))
                e = failure(t)
                assert time.monotonic() - t0 < 8, e
                assert e.kind == "DEADLINE_EXCEEDED", e
                assert "drip/drip.bin" in e.message and "4096 bytes/sec" in e.message, e
                # above the rate the same server's body loads
                t = meshd.load(f"{http_base}/trickle/drip.bin", dtype="float32", shape=(4000,))
                assert (fetch(t, gpu=0) == np.arange(4000, dtype=np.float32)).all()
    finally:
        stop_meshd(proc)


def test_inspections_their_callers_gave_up_free_the_agents_slots(http_base):
    """Without --url-timeout-ms, an InspectUrl of a server that does not answer ends
    with its caller's deadline, on the server and on the agent (it polls its call
    while curl waits): eight such calls, the most an agent runs at once, do not keep
    the next one out for as long as the HTTP server stalls (30 s)."""
    os.makedirs(FILES, exist_ok=True)
    np.save(os.path.join(FILES, "inspect-me.npy"), np.arange(6, dtype=np.int16))
    addr, proc = start_meshd(1, name="meshd-inspect", flags=("--url-allow=http://127.0.0.1",))
    try:
        with meshd.connect(addr) as s:
            m = s.mesh(gpu=1)
            pb = s._pb

            def stalled(_):
                t0 = time.monotonic()
                with pytest.raises(meshd.MeshdError) as ei:
                    s._unary("InspectUrl", pb.InspectUrlRequest(
                        url=f"{http_base}/slow/30/inspect-me.npy", mesh=m.ref),
                        pb.InspectUrlReply, timeout=1.5)
                return ei.value, time.monotonic() - t0

            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(8) as pool:
                outs = list(pool.map(stalled, range(8)))
            for e, took in outs:
                assert e.kind == "DEADLINE_EXCEEDED", e
                assert took < 5, took
            t0 = time.monotonic()
            while True:  # the agent's slots come back within a poll or two
                try:
                    info = meshd.inspect_url(f"{http_base}/inspect-me.npy", mesh=m)
                    break
                except meshd.MeshdError as e:
                    assert e.kind == "QUOTA", e
                    assert time.monotonic() - t0 < 6, f"the slots are still taken: {e}"
                    time.sleep(0.2)
            assert info["format"] == "npy" and info["tensors"][""][1] == (6,), info
    finally:
        stop_meshd(proc)


def test_unsupported_dtype_and_a_name_not_in_the_file(gpu4, http_base):
    np.save(os.path.join(FILES, "cplx.npy"), np.zeros(3, np.complex64))
    with pytest.raises(meshd.MeshdError) as ei:
        meshd.load(f"{http_base}/cplx.npy")
    assert ei.value.kind == "BAD_ARGUMENT" and "cplx.npy" in ei.value.message, ei.value
    write("two.safetensors", safetensors_bytes({"a": np.zeros(2, np.float32),
                                                "b": np.ones(2, np.float32)}))
    with pytest.raises(KeyError, match="'c'.*it holds: a, b"):
        meshd.load(f"{http_base}/two.safetensors", name="c")
    still_works()


def test_urls_outside_the_allow_list_are_refused_before_any_agent_connects(gpu4, http_base):
    port = http_base.rsplit(":", 1)[1]
    before = len(_Handler.requests)
    for url in (f"http://localhost:{port}/raw.bin",            # host not listed
                f"https://127.0.0.1:{port}/raw.bin",           # scheme not listed
                "file:///etc/passwd",                          # outside the directory
                "http://169.254.169.254/latest/meta-data"):    # not listed either
        with pytest.raises(meshd.MeshdError) as ei:
            meshd.load(url, dtype="uint8", shape=(4,))
        assert ei.value.kind == "PERMISSION_DENIED", (url, ei.value)
        with pytest.raises(meshd.MeshdError) as ei:
            meshd.inspect_url(url)
        assert ei.value.kind == "PERMISSION_DENIED", (url, ei.value)
    assert len(_Handler.requests) == before
    still_works()


def test_shard_errors_are_checked_by_the_server(gpu4, http_base):
    write("odd.bin", np.zeros(6, np.float32).tobytes())
    with pytest.raises(meshd.MeshdError, match="does not split evenly"):
        meshd.load(f"{http_base}/odd.bin", dtype="float32", shape=(6,), shard="gpu")
    with pytest.raises(ValueError, match="not a dim"):
        meshd.load(f"{http_base}/odd.bin", dtype="float32", shape=(6,), shard="host")
    with pytest.raises(TypeError, match="dtype= and shape="):
        meshd.load(f"{http_base}/odd.bin", dtype="float32")
    still_works()


# ------------------------------------------------------------------ progress


def test_progress_callback_follows_the_agents_bytes(gpu4, http_base):
    a = np.arange(1 << 20, dtype=np.float32)  # 4 MiB, 64 pieces of 64 KiB: about 1.3 s
    write("trickle.bin", a.tobytes())
    calls, done = [], threading.Event()

    def cb(d, total):
        calls.append((d, total))
        if d == total:
            done.set()
    t = meshd.load(f"{http_base}/trickle/trickle.bin", dtype="float32", shape=(4, 1 << 18),
                   progress=cb)  # replicated: 4 ranks x 4 MiB
    assert done.wait(30), calls
    total = 16 << 20
    assert all(tt == total for _, tt in calls), calls
    assert [d for d, _ in calls] == sorted(set(d for d, _ in calls)), calls  # grows, no repeats
    assert len(calls) >= 3 and 0 < calls[0][0] < total and calls[-1][0] == total, calls
    np.testing.assert_array_equal(fetch(t, gpu=3), a.reshape(4, -1))


def _agent_of_rank(server_pid, rank):
    """The pid of the local agent meshd `server_pid` started with --rank `rank`."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode().split("\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == server_pid and "--rank" in args and args[args.index("--rank") + 1] == str(rank):
            return int(pid)
    return None


def test_progress_bar_names_a_rank_that_gives_no_answer(http_base, monkeypatch):
    """A stopped agent gives LoadProgress no answer (the server answers at its 2 s
    deadline without that rank): the bar says which rank, and clears the remark once
    the load is complete."""
    from meshd import _progress
    notes, closed = [], threading.Event()

    class Bar:
        def __init__(self, **kw):
            self.n = 0

        def update(self, n):
            self.n += n

        def set_postfix_str(self, text):
            notes.append(text)

        def close(self):
            closed.set()
    monkeypatch.setattr(_progress, "_tqdm", type("FakeTqdm", (), {"tqdm": staticmethod(Bar)}))
    addr, proc = start_meshd(2, name="meshd-silent", flags=("--url-allow=http://127.0.0.1",))
    victim = _agent_of_rank(proc.pid, 1)
    try:
        assert victim, "no rank-1 agent child"
        a = np.arange(1 << 20, dtype=np.float32)  # 4 MiB in 64 KiB pieces: about 1.3 s a rank
        write("silent.bin", a.tobytes())
        with meshd.connect(addr) as s, s.mesh(gpu=2).activate():
            t = meshd.load(f"{http_base}/trickle/silent.bin", dtype="float32", shape=(1 << 20,),
                           progress=True)
            os.kill(victim, signal.SIGSTOP)
            deadline = time.monotonic() + 20
            while "no answer from rank 1" not in notes:
                assert time.monotonic() < deadline, notes
                time.sleep(0.05)
            os.kill(victim, signal.SIGCONT)
            assert closed.wait(30), notes
            assert notes[-1] == "", notes
            np.testing.assert_array_equal(fetch(t, gpu=1), a)
    finally:
        if victim:
            try:
                os.kill(victim, signal.SIGCONT)
            except ProcessLookupError:
                pass
        stop_meshd(proc)


def test_progress_stops_without_completing_when_a_load_fails(gpu4, http_base):
    calls = []
    meshd.load(f"{http_base}/missing.bin", dtype="float32", shape=(4,), progress=lambda d, t:
               calls.append(d))
    with pytest.raises(meshd.MeshdError):
        meshd._active.mesh().session.sync()
    time.sleep(1)  # the poller saw the failure by now
    assert not calls or calls[-1] < 16, calls
    with pytest.raises(TypeError, match="progress="):
        meshd.load(f"{http_base}/raw.bin", dtype="float32", shape=(8, 6), progress="yes")
    still_works()


# ------------------------------------------------------------------ the cuda backend


def test_cuda_emulated_agents_load_through_their_staging_buffer(http_base):
    """cuda agents cannot take curl's bytes straight into device memory: they stage
    them (agent/load.c). On cuda:emulated (the cuda backend over host memory, mocking
    the GPU) a 12 MiB load crosses the 8 MiB staging buffer; skipped in builds
    without the cuda backend."""
    helptext = subprocess.run([os.path.join(BIN_DIR, "meshd-agent"), "--help"],
                              capture_output=True, text=True).stdout
    if "cuda:emulated" not in helptext:
        pytest.skip("this build has no cuda backend")
    a = np.arange(3 << 20, dtype=np.float32).reshape(4, -1)
    np.save(os.path.join(FILES, "big.npy"), a)
    addr, proc = start_meshd(2, name="meshd-load-cuda", flags=(
        "--local-agent-device", "cuda:emulated", "--url-allow=http://127.0.0.1"))
    try:
        with meshd.connect(addr) as s:
            with s.mesh(gpu=2).activate():
                t = meshd.load(f"{http_base}/big.npy")
                h = meshd.load(f"{http_base}/big.npy", shard="gpu", dim=1)
                np.testing.assert_array_equal(fetch(t, gpu=1), a)
                np.testing.assert_array_equal(fetch(h, gpu=1), a[:, a.shape[1] // 2:])
    finally:
        stop_meshd(proc)


def test_progress_ends_when_a_rank_of_the_load_is_lost(http_base, monkeypatch):
    """An agent killed mid-load (its replacement knows nothing of the load): the
    poller ends (the bar closes, not complete) instead of polling LoadProgress until the
    session closes, and a Sync says AGENT_LOST."""
    from meshd import _progress
    closed = threading.Event()
    seen = []

    class Bar:
        def __init__(self, **kw):
            self.n = 0

        def update(self, n):
            self.n += n
            seen.append(self.n)

        def set_postfix_str(self, text):
            pass

        def close(self):
            closed.set()
    monkeypatch.setattr(_progress, "_tqdm", type("FakeTqdm", (), {"tqdm": staticmethod(Bar)}))
    addr, proc = start_meshd(2, name="meshd-lost-load", flags=("--url-allow=http://127.0.0.1",))
    victim = _agent_of_rank(proc.pid, 1)
    try:
        assert victim, "no rank-1 agent child"
        a = np.arange(4 << 20, dtype=np.float32)  # 16 MiB in 64 KiB pieces: about 5 s a rank
        write("lost.bin", a.tobytes())
        with meshd.connect(addr) as s, s.mesh(gpu=2).activate():
            meshd.load(f"{http_base}/trickle/lost.bin", dtype="float32", shape=(4 << 20,),
                       progress=True)
            deadline = time.monotonic() + 20
            while not seen:  # under way
                assert time.monotonic() < deadline
                time.sleep(0.05)
            os.kill(victim, signal.SIGKILL)
            assert closed.wait(20), "the progress bar still polls a load whose rank is gone"
            with pytest.raises(meshd.MeshdError) as ei:
                s.sync(timeout=30)
            assert ei.value.kind == "AGENT_LOST", ei.value
    finally:
        stop_meshd(proc)


def test_a_file_whose_etag_is_longer_than_a_version_loads(gpu4, http_base):
    """An ETag too long to keep whole (RFC 9110 sets no bound) is no validator: cut,
    its If-Match would match nothing (412, "the resource changed ... load it again",
    whatever the file does). Such a file loads, checked by its size (and mtime)."""
    a = np.arange(6 * 8, dtype=np.float32).reshape(6, 8)
    np.save(os.path.join(FILES, "longtag.npy"), a)
    url = f"{http_base}/longtag/longtag.npy"
    info = meshd.inspect_url(url)
    assert info["tensors"][""][:2] == ("float32", (6, 8)), info
    t = meshd.load(url, shard="gpu", dim=1)
    for r in range(4):
        np.testing.assert_array_equal(fetch(t, gpu=r), a[:, 2 * r:2 * r + 2])


# ------------------------------------------------------------------ review-99


def test_progress_pollers_of_one_session_leave_room_for_other_sessions(http_base):
    """A LoadProgress that asks a stopped agent holds a server helper for its 2 s
    deadline. One session polling many loads at once (a poller per meshd.load) must
    not make InspectUrl and LoadProgress answer QUOTA to every other session."""
    np.save(os.path.join(FILES, "starve.npy"), np.arange(4, dtype=np.float32))
    write("starve.bin", np.zeros(4, np.float32).tobytes())
    addr, proc = start_meshd(2, name="meshd-starve", flags=("--url-allow=http://127.0.0.1",))
    victim = _agent_of_rank(proc.pid, 1)
    stop, threads = threading.Event(), []
    try:
        assert victim, "no rank-1 agent child"
        with meshd.connect(addr) as a, meshd.connect(addr) as b:
            ma, mb = a.mesh(gpu=2), b.mesh(gpu=2)
            os.kill(victim, signal.SIGSTOP)  # the loads below never finish on rank 1
            with ma.activate():
                ta = meshd.load(f"{http_base}/starve.bin", dtype="float32", shape=(4,),
                                progress=False)
            with mb.activate():
                tb = meshd.load(f"{http_base}/starve.bin", dtype="float32", shape=(4,),
                                progress=False)
            pb = a._pb

            def poll():
                while not stop.is_set():
                    try:
                        a._unary("LoadProgress", pb.LoadProgressRequest(refs=[ta.ref]),
                                 pb.LoadProgressReply, timeout=10)
                    except meshd.MeshdError:
                        time.sleep(0.01)
            threads = [threading.Thread(target=poll, daemon=True) for _ in range(40)]
            for th in threads:
                th.start()
            time.sleep(0.5)  # every helper slot a's pollers can take is taken
            info = meshd.inspect_url(f"{http_base}/starve.npy", mesh=mb)
            assert info["format"] == "npy", info
            r = b._unary("LoadProgress", pb.LoadProgressRequest(refs=[tb.ref]),
                         pb.LoadProgressReply, timeout=10)
            assert len(r.loads) == 1 and r.loads[0].ref == tb.ref, r
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=15)
        if victim:
            try:
                os.kill(victim, signal.SIGCONT)
            except ProcessLookupError:
                pass
        stop_meshd(proc)


def test_progress_goes_on_after_a_transient_error_of_one_poll(gpu4, http_base, monkeypatch):
    """One LoadProgress answered QUOTA (the server's helpers busy) or DEADLINE_EXCEEDED:
    the poller looks again, instead of stopping silently with the bar frozen."""
    a = np.arange(1 << 18, dtype=np.float32)  # 1 MiB in 64 KiB pieces, 20 ms apart
    write("transient.bin", a.tobytes())
    s = gpu4
    real, refused = s._unary, []

    def flaky(method, *args, **kw):
        if method == "LoadProgress" and len(refused) < 2:
            refused.append(method)
            raise meshd.MeshdError("QUOTA", "LoadProgress: this session has 8 progress calls "
                                   "running, the most it runs at once; retry")
        return real(method, *args, **kw)
    monkeypatch.setattr(s, "_unary", flaky)
    done = threading.Event()
    t = meshd.load(f"{http_base}/trickle/transient.bin", dtype="float32", shape=(1 << 18,),
                   progress=lambda d, total: d == total and done.set())
    assert done.wait(20), "the progress poller stopped at a QUOTA answer"
    assert len(refused) == 2
    np.testing.assert_array_equal(fetch(t, gpu=2), a)


def test_progress_poller_that_stops_on_an_error_says_so(gpu4, http_base, monkeypatch):
    """A poll refused for good (not a closed session): the user is told why the
    progress stopped, not left with a frozen bar."""
    write("permanent.bin", np.zeros(1 << 18, np.float32).tobytes())
    s = gpu4
    real = s._unary

    def broken(method, *args, **kw):
        if method == "LoadProgress":
            raise meshd.MeshdError("PERMISSION_DENIED", "LoadProgress: not for you")
        return real(method, *args, **kw)
    monkeypatch.setattr(s, "_unary", broken)
    import warnings
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        meshd.load(f"{http_base}/trickle/permanent.bin", dtype="float32", shape=(1 << 18,),
                   progress=lambda d, total: None)
        deadline = time.monotonic() + 10
        while not any("not for you" in str(w.message) for w in got):
            assert time.monotonic() < deadline, [str(w.message) for w in got]
            time.sleep(0.05)
    s.sync()


def test_a_refused_tensor_of_a_many_tensor_load_is_named(gpu4, http_base):
    """A safetensors file loaded whole (a dict) whose second tensor does not split over
    the mesh: the error names that tensor, not only its dim and size."""
    write("named.safetensors", safetensors_bytes({"fine": np.zeros((4, 2), np.float32),
                                                  "oddone": np.zeros((2, 3), np.float32)}))
    with pytest.raises(meshd.MeshdError, match="split evenly") as ei:
        meshd.load(f"{http_base}/named.safetensors", shard="gpu", dim=0)
    assert "'oddone'" in ei.value.message, ei.value
    still_works()


def test_raw_bytes_take_a_negative_dim_like_files(gpu4, http_base):
    """dim=-2 of a (8, 6) raw load is dim 0, as for a .npy file's (Python counts
    from the end everywhere else)."""
    a = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    write("rawneg.bin", a.tobytes())
    t = meshd.load(f"{http_base}/rawneg.bin", dtype="float32", shape=(8, 6), shard="gpu", dim=-2)
    assert t.shape == (2, 6), t.shape
    np.testing.assert_array_equal(fetch(t, gpu=3), a[6:])


def test_progress_of_a_checkpoint_of_more_than_256_tensors(gpu4, http_base):
    """A checkpoint of 300 tensors (an LLM's has hundreds) loaded whole with progress:
    the server answers at most 256 refs per LoadProgress, so the poller asks in
    pieces; the callback ends at the total instead of the bar never moving."""
    ts = {f"t{i:03d}": np.full(4, i, np.float32) for i in range(300)}
    write("many.safetensors", safetensors_bytes(ts))
    done, calls = threading.Event(), []

    def cb(d, total):
        calls.append((d, total))
        if d == total:
            done.set()
    out = meshd.load(f"{http_base}/many.safetensors", progress=cb)
    assert len(out) == 300
    assert done.wait(30), calls[-3:]
    assert calls[-1] == (300 * 16 * 4, 300 * 16 * 4), calls[-3:]
    np.testing.assert_array_equal(fetch(out["t299"], gpu=3), ts["t299"])


def test_progress_of_a_load_whose_dtype_the_client_does_not_know():
    """A newer server's dtype ("dtype 99"): _watch raised KeyError from its byte count
    (the load itself accepted); it shows nothing now, the load going on."""
    import importlib
    from types import SimpleNamespace
    _load = importlib.import_module("meshd.load")  # (meshd.load is the function)
    t = SimpleNamespace(dtype="dtype 99", shape=(4,), ref=7)
    mesh = SimpleNamespace(sizes={"gpu": 2}, session=None)
    assert _load._watch(mesh, [t], True, "load") is None
