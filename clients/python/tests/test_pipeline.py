"""session.pipeline(): commands on one Submit stream, errors deferred to the end of the block."""

import json
import sys
import threading

import numpy as np
import pytest

import meshd
from conftest import start_meshd, stop_meshd
from test_examples import run_example


def get(t, **coords):
    return meshd.fetch_shard(t, **coords).result()


def _program(session):
    """The same commands, unary or pipelined; returns the tensors to compare."""
    x = meshd.arange(12.0).reshape([3, 4])
    y = meshd.full((3, 4), 2.0)
    z = (x + y) * y - 1
    z.add_(x)
    s = z.sum(dim=0)
    r = s.reduce("gpu", "sum")
    m = x @ y.T
    for _ in range(20):
        y = y + 1
    return z, s, r, m, y


def test_pipelined_results_equal_unary_results(session, mesh):
    want = [get(t, gpu=1) for t in _program(session)]
    with session.pipeline():
        got_t = _program(session)
        # handles come back at once; metadata is there once read (blocks if needed)
        assert got_t[0].shape == (3, 4) and got_t[0].dtype == "float32"
    got = [get(t, gpu=1) for t in got_t]
    for w, g in zip(want, got):
        np.testing.assert_array_equal(w, g)
    assert got_t[2].mesh is mesh and got_t[2].stream is session.default_stream


def test_fetch_and_sync_inside_the_block_flush(session, mesh):
    with session.pipeline():
        a = meshd.ones((2, 2))
        for _ in range(10):
            a = a * 2
        np.testing.assert_array_equal(get(a, gpu=0), np.full((2, 2), 1024, np.float32))
        session.sync()
        u = meshd.tensor(np.arange(4, dtype=np.float32))  # upload: its own RPC, after a flush
        v = u + a[0, 0]
    np.testing.assert_array_equal(get(v, gpu=1), np.arange(4) + 1024)


def test_rejection_raises_at_exit_with_kind_and_valid_commands_ran(session, mesh):
    with pytest.raises(meshd.MeshdError) as e:
        with session.pipeline():
            a = meshd.ones((2, 3))
            b = meshd.ones((4, 5))
            bad = a.reduce("nodim", "sum")        # BAD_DIM, deferred
            c = a + 41                            # valid, after the rejection
            bad2 = a @ b                          # SHAPE_MISMATCH (a second rejection)
            d = c * 2
    assert e.value.kind == "BAD_DIM", e.value
    assert [x.kind for x in e.value.errors][0] == "BAD_DIM"
    assert len(e.value.errors) == 2
    assert e.value.message.strip()
    np.testing.assert_array_equal(get(c, gpu=0), np.full((2, 3), 42, np.float32))
    np.testing.assert_array_equal(get(d, gpu=1), np.full((2, 3), 84, np.float32))
    with pytest.raises(meshd.MeshdError) as e2:
        bad.shape  # the rejected command's handle says why
    assert e2.value.kind == "BAD_DIM"
    del bad2
    # the session is fine afterwards, unary again
    np.testing.assert_array_equal(get(a + 1, gpu=0), np.full((2, 3), 2, np.float32))


def test_small_tensors_pipeline_and_big_batches_split(session, mesh, monkeypatch):
    """meshd.tensor of a small array is a Literal command: inside a pipeline block it
    waits for nothing. With the client's threshold raised to the server's bound (1 MiB),
    sixteen of 1 MiB queue 16 MiB; each Submit message stays under the server's 4 MiB
    limit (a batch ends at 1 MiB), and every value arrives exact, in order, with the
    ops between them."""
    monkeypatch.setattr(sys.modules["meshd.tensor"], "_LITERAL_MAX", 1 << 20)
    arrs = [np.full(1 << 18, i, np.float32) for i in range(16)]
    with session.pipeline():
        ts = [meshd.tensor(a) for a in arrs]
        total = ts[0]
        for t in ts[1:]:
            total = total + t
    for i in (0, 7, 15):
        np.testing.assert_array_equal(meshd.fetch_shard(ts[i], gpu=1).result(), arrs[i])
    np.testing.assert_array_equal(meshd.fetch_shard(total, gpu=0).result(), float(sum(range(16))))


def test_batches_end_at_1_mib_of_commands_and_8_mib_sent_in_order():
    """Pipeline._requests on a queue filled beforehand (no server): whatever is queued
    goes in one Submit message, which ends before 1 MiB of commands or 8 MiB that the
    commands' Literals send to the agents; the command that did not fit opens the
    next message. Nothing is lost or reordered, and the end mark ends the stream."""
    from meshd import _proto
    from meshd.pipeline import Pipeline, _Queue
    pb = _proto.tensor_pb2()

    def lit(seq, nbytes):
        return pb.Command(seq=seq, literal=pb.Literal(data=bytes(nbytes))).SerializeToString()
    queued = [(lit(1, 10), 10, 1), (lit(2, 600 << 10), 600 << 10, 2),
              (lit(3, 600 << 10), 600 << 10, 3), (lit(4, 10), 10, 4), (lit(5, 100), 5 << 20, 5),
              (lit(6, 100), 5 << 20, 6), (lit(7, 10), 10, 7)]
    p = Pipeline.__new__(Pipeline)
    p._q = _Queue()
    for m in queued:
        p._q.put(m)
    p._q.put(meshd.pipeline._END)
    seqs = []
    for raw in p._requests():
        c = pb.Command.FromString(raw)
        seqs.append([x.seq for x in c.batch] if c.batch else [c.seq])
    assert seqs == [[1, 2], [3, 4, 5], [6, 7]], seqs


def test_a_long_pipeline_of_reduces_past_the_message_byte_limit_just_runs():
    """A Reduce queues instructions for every rank of its group (about 1.3 KB over 4
    ranks, 3.4 MB over 256), and the pipeline batches whatever it queued while the
    server's flow control held the stream (up to 1024 commands a message). The server
    refused QUOTA the commands of one message past 4x the session's byte bound ("the
    most one message may"): a plain loop of reduces raised an error the user could not
    act on. Now such a batch is taken in parts, each waiting for room as separate
    messages would: every Reduce runs and the values are right."""
    addr, proc = start_meshd(4, name="meshd-big-batch",
                             flags=("--session-max-queued-bytes", "8KiB"),
                             env={"MESHD_FAULT": "reduce:slow=1"})
    try:
        out = {}

        def run():
            try:
                with meshd.connect(addr, timeout=60) as s:
                    m = s.mesh(gpu=4)
                    with m.activate():
                        x = meshd.ones((4,))
                        with s.pipeline():
                            ys = [x.reduce("gpu", "sum") for _ in range(600)]
                        out["values"] = [get(ys[i], gpu=i % 4) for i in (0, 299, 599)]
            except BaseException as e:  # noqa: BLE001 - handed to the test
                out["error"] = e
        th = threading.Thread(target=run, daemon=True)
        th.start()
        th.join(120)
        assert not th.is_alive(), "the pipeline did not end within 120 s"
        if "error" in out:
            raise out["error"]
        for v in out["values"]:
            np.testing.assert_array_equal(v, np.full(4, 4, np.float32))
    finally:
        stop_meshd(proc)


def test_an_exception_in_the_block_is_not_masked(session, mesh):
    with pytest.raises(ZeroDivisionError):
        with session.pipeline():
            meshd.ones((1,)).reduce("nodim")
            1 / 0
    assert get(meshd.ones((1,)), gpu=0)[0] == 1


def test_other_threads_stay_unary_and_in_order(session, mesh):
    out = {}
    with session.pipeline():
        x = meshd.ones((2,))
        for _ in range(50):
            x = x + 1

        def other():
            with mesh.activate():
                out["t"] = get(meshd.full((2,), 7.0) + 1, gpu=0)
        th = threading.Thread(target=other)
        th.start()
        th.join(60)
        y = x + 1
    np.testing.assert_array_equal(out["t"], [8, 8])
    np.testing.assert_array_equal(get(y, gpu=0), [52, 52])


def test_run_time_failure_in_the_block_shows_at_sync(session, mesh):
    x = meshd.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    idx = meshd.tensor(np.array([[0, 1], [0, 7]]), shard="gpu")  # rank 1 out of range
    with session.pipeline():
        bad = meshd.ops.index_select(x, 1, idx)   # accepted: fails on the agent
        dep = bad + 1
        ok = x * 2
    with pytest.raises(meshd.MeshdError) as e:
        session.sync()
    assert e.value.kind == "REMOTE_FAILURE" and "index_select" in e.value.message
    with pytest.raises(meshd.MeshdError) as e:
        get(dep, gpu=0)
    assert e.value.kind == "DEPENDENT_FAILURE"
    np.testing.assert_array_equal(get(ok, gpu=1), np.arange(6).reshape(2, 3) * 2)


def test_sync_inside_the_block_raises_run_time_failures(session, mesh):
    x = meshd.tensor(np.arange(3, dtype=np.float32))
    idx = meshd.tensor(np.array([5]))
    with session.pipeline():
        meshd.ops.index_select(x, 0, idx)
        with pytest.raises(meshd.MeshdError) as e:
            session.sync()
        assert e.value.kind == "REMOTE_FAILURE"


def test_a_nested_pipeline_joins_the_outer_one(session, mesh):
    with pytest.raises(meshd.MeshdError) as e:
        with session.pipeline() as outer:
            x = meshd.ones(2)
            with session.pipeline() as inner:
                assert inner is outer
                meshd.ones(1).reduce("nodim")  # rejected: raised at the outer block's end
                y = x + 1
            assert session._pipe is outer  # the inner block's end closed nothing
    assert e.value.kind == "BAD_DIM", e.value
    assert get(y, gpu=0).tolist() == [2.0, 2.0]


def test_a_pipeline_of_another_thread_is_refused(session, mesh):
    got = []
    with session.pipeline():
        def other():
            try:
                with session.pipeline():
                    pass
            except RuntimeError as e:
                got.append(e)
        t = threading.Thread(target=other)
        t.start()
        t.join(10)
    assert got and "another thread" in str(got[0]), got


@pytest.fixture(scope="module")
def server4():
    """A meshd with 4 local agents, for a {stage: 2, gpu: 2} mesh."""
    addr, proc = start_meshd(4, name="meshd4")
    try:
        yield addr
    finally:
        stop_meshd(proc)


def test_pipeline_stages_example(server4):
    r = run_example("pipeline_stages.py", "--server", server4)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "pipeline stages match numpy" in r.stdout, out


def test_pipeline_stages_example_fails_when_it_does_not_match(server4):
    r = run_example("pipeline_stages.py", "--server", server4, "--tol", "-1")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "DO NOT match numpy" in r.stdout, r.stdout + r.stderr


def test_bench_pipeline_runs(server):
    r = run_example("bench_pipeline.py", "--server", server[0], "--n", "100", "--rounds", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "speed-up" in r.stderr and "raw grpcio unary" in r.stderr, r.stdout + r.stderr
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert line["bench"] == "pipeline" and line["n"] == 100, line
    for k in ("unary", "raw_unary", "pipelined", "raw_stream"):
        assert line[f"{k}_per_s"] > 0, line
    assert line["unary_ratio"] > 0 and line["pipelined_ratio"] > 0, line
