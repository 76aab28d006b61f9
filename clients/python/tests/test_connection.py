"""A lost connection raises a clear error; connect() works again once a server is back."""
import signal

import numpy as np
import pytest

import meshd
from conftest import start_meshd, stop_meshd


def test_lost_connection_is_clear_and_connect_works_again():
    addr, proc = start_meshd(1, name="meshd-lost")
    try:
        s = meshd.connect(addr)
        m = s.mesh(gpu=1)
        with m.activate():
            x = meshd.ones((3,))
            assert np.array_equal(meshd.inspect(x, gpu=0), np.ones(3, np.float32))
        stop_meshd(proc, signal.SIGKILL)  # the server vanishes (its agents follow it)
        with pytest.raises(meshd.MeshdError) as e:
            with m.activate():
                meshd.inspect(x + 1, gpu=0)
        assert e.value.kind == "UNAVAILABLE", e.value
        assert str(e.value), "the error must say what happened"
    finally:
        stop_meshd(proc, signal.SIGKILL)
    addr2, proc = start_meshd(1, listen=addr, name="meshd-back")  # back on the same address
    try:
        with meshd.connect(addr2) as s2:
            with s2.mesh(gpu=1).activate():
                y = meshd.full((2,), 4.0) * 2
                assert np.array_equal(meshd.inspect(y, gpu=0), np.full(2, 8.0, np.float32))
    finally:
        stop_meshd(proc)
