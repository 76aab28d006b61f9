"""data_path= on meshd.connect (meshd/direct.py): auto takes the direct path
against a local server, proxy never does, and a bad value is refused before any
connection is made. The protocol's refusals are in tests/integration/test_direct.py."""

import numpy as np
import pytest

import meshd


def test_bad_data_path_is_refused():
    with pytest.raises(ValueError, match="data_path must be one of auto, direct, proxy"):
        meshd.connect("127.0.0.1:1", data_path="fast")


@pytest.mark.parametrize("data_path,direct", [("auto", True), ("direct", True), ("proxy", False)])
def test_data_path_choice(server, data_path, direct):
    arr = np.arange(2 * 12, dtype=np.float32).reshape(2, 12)
    with meshd.connect(server[0], data_path=data_path) as s:
        with s.mesh(gpu=2).activate():
            x = meshd.tensor(arr, shard="gpu")
            got = [meshd.fetch_shard(x, gpu=g) for g in range(2)]
            assert [f.result().tolist() for f in got] == arr.tolist()
        n = 1 if direct else 0
        assert s._direct.counts == {"upload": n, "fetch": 2 * n}


@pytest.mark.parametrize("data_path", ["direct", "proxy"])
def test_a_sharded_upload_copies_no_rank_rows(server, data_path):
    """Each rank's bytes go out as views of its row (issue 14: the client does not
    copy): the Python heap never holds a second copy of the array, only a few chunks
    per shard in flight (numpy's and the client's allocations are traced by
    tracemalloc)."""
    import tracemalloc
    arr = np.arange(2 * (8 << 20), dtype=np.float32).reshape(2, -1)  # 64 MiB
    with meshd.connect(server[0], data_path=data_path) as s:
        with s.mesh(gpu=2).activate():
            meshd.tensor(arr[:, :4], shard="gpu")  # the first call's one-time setup
            tracemalloc.start()
            try:
                x = meshd.tensor(arr, shard="gpu")
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert peak < arr.nbytes / 4, f"{peak} bytes traced for a {arr.nbytes}-byte upload"
            for g in range(2):
                np.testing.assert_array_equal(meshd.fetch_shard(x, gpu=g).result(), arr[g])


class Stop(Exception):
    pass


def test_progress_callback_exception_aborts_a_direct_transfer(server, monkeypatch):
    """A progress callback that raises stops every shard of a direct upload (the ref
    stays undefined) and a direct fetch; the exception is what the caller sees, and
    the session goes on."""
    from meshd import _progress
    monkeypatch.setattr(_progress, "CALLBACK_INTERVAL", 0.0)
    a = np.ones(4 << 20, np.float32)  # 16 MiB: 8 messages per agent

    def stop(done, total):
        if done < total:
            raise Stop()
    with meshd.connect(server[0], data_path="direct") as s:
        with s.mesh(gpu=2).activate():
            with pytest.raises(Stop):
                meshd.tensor(a, progress=stop)
            assert s._direct.counts["upload"] == 0
            lost = meshd.Tensor(s, s._ref, a.shape, "float32", s._meshes and max(s._meshes), 0)
            with pytest.raises(meshd.MeshdError) as ei:
                (lost + 1).shape
            assert ei.value.kind == "UNKNOWN_REF", ei.value
            t = meshd.tensor(a[:8])
            with pytest.raises(Stop):
                meshd.fetch_shard(meshd.tensor(a), gpu=1, progress=stop).result()
            assert meshd.fetch_shard(t + 1, gpu=0).result().tolist() == [2.0] * 8


@pytest.mark.parametrize("data_path", ["direct", "proxy"])
def test_more_fetches_than_the_session_may_have_in_flight_wait_their_turn(data_path):
    """--session-max-transfers 2 and 12 fetch_shard Futures at once: each fetch waits
    for a slot of the session's own (the others are being read) instead of failing
    QUOTA, and every value is right."""
    from conftest import start_meshd, stop_meshd
    addr, proc = start_meshd(2, name=f"meshd-slots-{data_path}",
                             flags=("--session-max-transfers", "2"))
    try:
        with meshd.connect(addr, data_path=data_path) as s:
            with s.mesh(gpu=2).activate():
                a = np.arange(1 << 16, dtype=np.float32)
                t = meshd.tensor(a)
                futs = [meshd.fetch_shard(t, gpu=i % 2) for i in range(12)]
                for f in futs:
                    np.testing.assert_array_equal(f.result(), a)
    finally:
        stop_meshd(proc)
