"""The examples in clients/python/examples, run as users run them, against the test meshd."""

import os
import subprocess
import sys

from conftest import REPO, _child_env

EXAMPLES = os.path.join(REPO, "clients", "python", "examples")


def run_example(name, *args, timeout=300):
    env = _child_env()
    env["PYTHONPATH"] = os.path.join(REPO, "clients", "python")
    env["XDG_CACHE_HOME"] = os.environ["XDG_CACHE_HOME"]  # reuse the generated protos
    return subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout)


def test_train_data_parallel(server):
    r = run_example("train_data_parallel.py", "--server", server[0], "--agents", "2",
                    "--steps", "5")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    lines = r.stdout.splitlines()
    losses = [float(l.split()[3]) for l in lines if l.startswith("step ")]
    assert [l.split()[1] for l in lines if l.startswith("step ")] == ["1", "2", "3", "4", "5"], out
    assert losses[-1] < losses[0], out  # it learns
    assert any(l.startswith("final accuracy ") for l in lines), out
    assert any(l.startswith("matches numpy: max |Δw| = ") for l in lines), out


def test_train_data_parallel_fails_when_it_does_not_match(server):
    # an impossible tolerance: the check must fail, and say so, with a non-zero exit
    r = run_example("train_data_parallel.py", "--server", server[0], "--agents", "2",
                    "--steps", "2", "--tol", "0")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "DOES NOT match numpy" in r.stdout, r.stdout + r.stderr
