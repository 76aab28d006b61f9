"""The examples in clients/python/examples, run as users run them, against the test meshd."""

import os
import subprocess
import sys

import pytest

from conftest import REPO, _child_env

EXAMPLES = os.path.join(REPO, "clients", "python", "examples")


def run_example(name, *args, timeout=300):
    env = _child_env()
    env["PYTHONPATH"] = os.path.join(REPO, "clients", "python")
    env["XDG_CACHE_HOME"] = os.environ["XDG_CACHE_HOME"]  # reuse the generated protos
    return subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout)


def test_train_data_parallel(server, tmp_path):
    png = tmp_path / "loss.png"
    r = run_example("train_data_parallel.py", "--server", server[0], "--agents", "2",
                    "--steps", "5", "--plot", str(png))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    lines = r.stdout.splitlines()
    # steps/s, and the loss curve as a PNG (its signature, and not a blank few bytes)
    assert any(l.startswith("5 steps in ") and " steps/s " in l for l in lines), out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000, out
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


@pytest.mark.parametrize("hosts,gpus", [(1, 2), (2, 1)])
def test_train_mlp_overlaps_its_all_reduce_and_matches_numpy(server, hosts, gpus):
    r = run_example("train_mlp.py", "--server", server[0], "--hosts", str(hosts),
                    "--gpus", str(gpus), "--steps", "6")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    losses = [float(l.split()[3]) for l in r.stdout.splitlines() if l.startswith("step ")]
    assert len(losses) == 6 and losses[-1] < losses[0], out  # it learns
    assert "steps/s" in r.stdout and "matches numpy" in r.stdout, out
    r = run_example("train_mlp.py", "--server", server[0], "--steps", "2", "--tol", "0")
    assert r.returncode == 1 and "DOES NOT match numpy" in r.stdout, r.stdout + r.stderr


def test_the_readmes_first_example_runs(server, tmp_path):
    # clients/python/README.md's first block is what a new user pastes first; it mixed a
    # float64 array into a float32 matmul and failed with DTYPE_MISMATCH.
    with open(os.path.join(REPO, "clients", "python", "README.md")) as f:
        block = f.read().split("```python\n", 1)[1].split("```", 1)[0]
    assert '"127.0.0.1:50051"' in block, block
    script = tmp_path / "readme.py"
    script.write_text(block.replace('"127.0.0.1:50051"', repr(server[0])))
    env = _child_env()
    env["PYTHONPATH"] = os.path.join(REPO, "clients", "python")
    env["XDG_CACHE_HOME"] = os.environ["XDG_CACHE_HOME"]
    r = subprocess.run([sys.executable, str(script)], env=env, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    # y = (1 + xs) @ 1.T on gpu=1 (xs row 1 = [3, 4, 5]): 15s; the reduce over gpu: [3, 5, 7]
    assert "15." in r.stdout and "[3. 5. 7.]" in r.stdout, r.stdout
