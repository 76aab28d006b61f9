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
