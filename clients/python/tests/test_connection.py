"""A lost connection raises a clear error; connect() works again once a server is back."""
import os
import signal
import subprocess
import tempfile
import time

import numpy as np
import pytest

import meshd
from conftest import BIN_DIR, _child_env, _log_tail, _serving


def _start(listen, workdir):
    port_file = os.path.join(workdir, f"port-{time.monotonic_ns()}")
    log = open(os.path.join(workdir, "meshd.log"), "ab")
    proc = subprocess.Popen([os.path.join(BIN_DIR, "meshd"), "--listen", listen, "--local-agents",
                             "1", "--port-file", port_file], stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT, env=_child_env())
    log.close()
    end = time.monotonic() + 30
    while time.monotonic() < end:
        if os.path.exists(port_file):
            port = int(open(port_file).read())
            if _serving(port):
                return proc, port
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    pytest.fail("meshd did not start:\n" + _log_tail(os.path.join(workdir, "meshd.log")))


def _stop(proc, sig=signal.SIGTERM):
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_lost_connection_is_clear_and_connect_works_again():
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = _start("127.0.0.1:0", tmp)
        try:
            s = meshd.connect(f"127.0.0.1:{port}")
            m = s.mesh(gpu=1)
            with m.activate():
                x = meshd.ones((3,))
                assert np.array_equal(meshd.inspect(x, gpu=0), np.ones(3, np.float32))
            _stop(proc, signal.SIGKILL)  # the server vanishes (its agents follow it)
            with pytest.raises(meshd.MeshdError) as e:
                with m.activate():
                    meshd.inspect(x + 1, gpu=0)
            assert e.value.kind == "UNAVAILABLE", e.value
            assert str(e.value), "the error must say what happened"
        finally:
            _stop(proc, signal.SIGKILL)
        proc, port2 = _start(f"127.0.0.1:{port}", tmp)  # back on the same address
        try:
            with meshd.connect(f"127.0.0.1:{port2}") as s2:
                with s2.mesh(gpu=1).activate():
                    y = meshd.full((2,), 4.0) * 2
                    assert np.array_equal(meshd.inspect(y, gpu=0), np.full(2, 8.0, np.float32))
        finally:
            _stop(proc)
