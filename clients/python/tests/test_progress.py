"""progress= of uploads and fetches (meshd/_progress.py): callbacks, tqdm bars, the
automatic rule (THRESHOLD bytes and a terminal on stderr), and progress=False."""

import io
import time

import numpy as np
import pytest

import meshd
from meshd import _progress

N = 1 << 20  # float32 elements: 4 MiB, four of the client's upload chunks


@pytest.fixture
def fast_callbacks(monkeypatch):
    monkeypatch.setattr(_progress, "CALLBACK_INTERVAL", 0.0)


class FakeTqdm:
    """Stands in for the tqdm module: records every bar made, updated and closed."""

    def __init__(self):
        self.bars = []

    def tqdm(self, **kw):
        outer = self

        class Bar:
            def __init__(self):
                self.kw, self.n, self.closed, self.postfix = kw, 0, False, ""
                outer.bars.append(self)

            def update(self, n):
                self.n += n

            def set_postfix_str(self, text):
                self.postfix = text

            def close(self):
                self.closed = True
        return Bar()


@pytest.fixture
def fake_tqdm(monkeypatch):
    fake = FakeTqdm()
    monkeypatch.setattr(_progress, "_tqdm", fake)
    return fake


def _check_calls(calls, total):
    assert len(calls) >= 2, calls  # some calls while moving, then the last one
    assert all(t == total for _, t in calls), calls
    done = [d for d, _ in calls]
    assert all(a < b for a, b in zip(done, done[1:])), done
    assert done[-1] == total and done.count(total) == 1, done


def test_upload_and_fetch_callbacks_grow_to_total(mesh, fast_callbacks):
    a = np.arange(N, dtype=np.float32)
    up, down = [], []
    t = meshd.tensor(a, progress=lambda d, n: up.append((d, n)))
    _check_calls(up, a.nbytes)
    got = meshd.fetch_shard(t, gpu=1, progress=lambda d, n: down.append((d, n))).result()
    np.testing.assert_array_equal(got, a)
    _check_calls(down, a.nbytes)
    assert meshd.inspect(t, gpu=0, progress=False)[7] == 7.0


def test_per_rank_upload_callback(mesh, fast_callbacks):
    a = np.arange(2 * N, dtype=np.float32).reshape(2, N)
    calls = []
    t = meshd.tensor(a, shard="gpu", progress=lambda d, n: calls.append((d, n)))
    _check_calls(calls, a.nbytes)
    np.testing.assert_array_equal(meshd.inspect(t, gpu=1), a[1])


def test_callbacks_are_throttled(mesh, monkeypatch):
    monkeypatch.setattr(_progress, "CALLBACK_INTERVAL", 0.05)
    calls = []
    meshd.tensor(np.zeros(4 * N, np.float32),
                 progress=lambda d, n: calls.append((time.monotonic(), d)))
    assert calls[-1][1] == 16 * N
    gaps = [b[0] - a[0] for a, b in zip(calls[:-2], calls[1:-1])]  # the last is not throttled
    assert all(g >= 0.05 for g in gaps), gaps


def test_small_callback_transfers_still_end_at_total(mesh):
    calls = []
    t = meshd.tensor(np.ones(3, np.float32), progress=lambda d, n: calls.append((d, n)))
    assert calls == [(12, 12)]
    calls.clear()
    meshd.inspect(t, gpu=0, progress=lambda d, n: calls.append((d, n)))
    assert calls == [(12, 12)]


def test_progress_false_makes_no_bar_even_on_a_tty(mesh, fake_tqdm, monkeypatch):
    monkeypatch.setattr(_progress, "THRESHOLD", 0)
    monkeypatch.setattr(_progress, "_stderr_is_tty", lambda: True)
    t = meshd.tensor(np.ones(N, np.float32), progress=False)
    meshd.inspect(t, gpu=0, progress=False)
    assert fake_tqdm.bars == []
    meshd.inspect(t, gpu=0)  # the automatic rule, on a "terminal", over THRESHOLD
    assert len(fake_tqdm.bars) == 1 and fake_tqdm.bars[0].closed
    assert fake_tqdm.bars[0].n == 4 * N and fake_tqdm.bars[0].kw["unit"] == "B"


def test_progress_true_prints_a_tqdm_bar_off_a_terminal(mesh, capsys):
    t = meshd.tensor(np.ones(N, np.float32), progress=True)
    err = capsys.readouterr().err
    assert "upload" in err and "100%" in err and "4.00M" in err, err
    meshd.inspect(t, gpu=1, progress=True)
    err = capsys.readouterr().err
    assert "fetch" in err and "100%" in err, err


def test_automatic_rule_is_silent_off_a_terminal(mesh, capsys, monkeypatch, fake_tqdm):
    monkeypatch.setattr(_progress, "THRESHOLD", 0)
    t = meshd.tensor(np.ones(N, np.float32))  # capsys: stderr is not a tty
    meshd.inspect(t, gpu=0)
    assert fake_tqdm.bars == [] and capsys.readouterr().err == ""


def test_automatic_rule_needs_the_threshold(mesh, monkeypatch, fake_tqdm):
    monkeypatch.setattr(_progress, "_stderr_is_tty", lambda: True)
    monkeypatch.setattr(_progress, "THRESHOLD", 8 * N)
    t = meshd.tensor(np.ones(N, np.float32))  # 4 MiB < THRESHOLD
    assert fake_tqdm.bars == []
    monkeypatch.setattr(_progress, "THRESHOLD", 4 * N)
    meshd.inspect(t, gpu=0)
    assert len(fake_tqdm.bars) == 1 and fake_tqdm.bars[0].kw["desc"] == "fetch"


def test_without_tqdm_callbacks_still_work(mesh, monkeypatch, capsys):
    monkeypatch.setattr(_progress, "_tqdm", None)
    monkeypatch.setattr(_progress, "THRESHOLD", 0)
    monkeypatch.setattr(_progress, "_stderr_is_tty", lambda: True)
    calls = []
    t = meshd.tensor(np.ones(N, np.float32))
    meshd.inspect(t, gpu=0, progress=lambda d, n: calls.append(d))
    assert calls[-1] == 4 * N and capsys.readouterr().err == ""


def test_a_callback_exception_aborts_the_transfer(mesh, fast_callbacks):
    class Stop(Exception):
        pass

    def stop(done, total):
        raise Stop

    t = meshd.tensor(np.ones(N, np.float32))
    with pytest.raises(Stop):
        meshd.tensor(np.ones(N, np.float32), progress=stop)
    with pytest.raises(Stop):
        meshd.fetch_shard(t, gpu=0, progress=stop).result()
    assert meshd.inspect(t + 1, gpu=1)[0] == 2.0  # the session goes on


def test_a_callback_exception_on_a_small_tensor_lets_its_ref_go(session, mesh, fast_callbacks):
    """A tensor of at most 1 MiB goes as one Literal command, whose progress call comes
    after it was sent: a callback that raises there leaves the caller no handle, so
    the ref joins the session's next Release instead of living on until its end."""
    class Stop(Exception):
        pass

    def stop(done, total):
        raise Stop
    waiting = len(session._released)
    with pytest.raises(Stop):
        meshd.tensor(np.ones(4, np.float32), progress=stop)
    assert len(session._released) == waiting + 1
    assert meshd.inspect(meshd.tensor(np.ones(4, np.float32)) + 1, gpu=1)[0] == 2.0


@pytest.mark.parametrize("data_path", ["proxy", "direct"])
def test_a_callback_raising_at_the_end_of_an_upload_lets_its_ref_go(server, data_path,
                                                                    fast_callbacks):
    """The last progress call of an Upload comes once the tensor is defined: a callback
    that raises there leaves the caller no handle, so the ref is released (the server
    holds nothing more afterwards), through the server and straight to the agents."""
    class Stop(Exception):
        pass

    def at_the_end(done, total):
        if done == total:
            raise Stop
    with meshd.connect(server[0], data_path=data_path) as s, s.mesh(gpu=2).activate():
        s.sync()
        base = _live(s)
        with pytest.raises(Stop):
            meshd.tensor(np.ones(N, np.float32), progress=at_the_end)
        assert s._direct.counts["upload"] == (data_path == "direct")
        s.sync()
        assert _live(s) == base, "the tensor of the raising callback lives on"



def test_an_upload_planned_again_keeps_one_bar_and_one_count(fake_tqdm, fast_callbacks,
                                                             monkeypatch):
    """A direct upload whose Writes start past their grants' start-by time (the
    process paused between plan and Write: --transfer-grant-start-ms 200, a 0.5 s
    pause) is planned once more: its progress goes on, one bar and a callback that
    never goes back nor ends twice. (The retry made a second bar, its callback
    counting from 0 again.)"""
    from conftest import start_meshd, stop_meshd
    from meshd import direct as _direct
    real, pauses = _direct.Direct.plan, [0]

    def paused(self, request, deadline):  # the first plan of each upload below
        reply = real(self, request, deadline)
        if pauses[0] > 0:
            pauses[0] -= 1
            time.sleep(0.5)
        return reply
    monkeypatch.setattr(_direct.Direct, "plan", paused)
    addr, proc = start_meshd(1, name="meshd-late-progress",
                             flags=("--transfer-grant-start-ms", "200"))
    try:
        with meshd.connect(addr, data_path="direct", timeout=20) as s, s.mesh(gpu=1).activate():
            a = np.arange(N, dtype=np.float32)
            pauses[0] = 1
            t = meshd.tensor(a, progress=True)
            assert pauses[0] == 0 and s._direct.counts["upload"] == 1
            assert len(fake_tqdm.bars) == 1, [b.n for b in fake_tqdm.bars]
            bar = fake_tqdm.bars[0]
            assert bar.n == a.nbytes and bar.closed
            calls = []
            pauses[0] = 1
            t2 = meshd.tensor(a + 1, progress=lambda d, n: calls.append((d, n)))
            assert pauses[0] == 0 and s._direct.counts["upload"] == 2
            _check_calls(calls, a.nbytes)
            np.testing.assert_array_equal(meshd.inspect(t2 - t, gpu=0, progress=False),
                                          np.ones(N, np.float32))
    finally:
        stop_meshd(proc)

def _live(s):
    pb = s._pb
    reply = s._unary("ListSessions", pb.ListSessionsRequest(), pb.ListSessionsReply)
    (row,) = [r for r in reply.sessions if r.session_id == s.id]
    return row.live_tensors


@pytest.mark.parametrize("bad", ["yes", 1, 0.5])
def test_progress_takes_none_bools_or_callables(mesh, bad):
    with pytest.raises(TypeError, match="progress="):
        meshd.tensor(np.ones(3, np.float32), progress=bad)
    with pytest.raises(TypeError, match="progress="):
        meshd.fetch_shard(meshd.ones(3), gpu=0, progress=bad)


# ------------------------------------------------------- the tracker alone (load.py's)

def test_tracker_set_takes_absolute_values(fake_tqdm, fast_callbacks):
    calls = []
    with _progress.tracker(100, lambda d, n: calls.append(d), "load") as tr:
        for done in (10, 10, 5, 60, 250):  # repeats, a step back and an overshoot
            tr.set(done)
    assert calls == [10, 60, 100]
    with _progress.tracker(100, True, "load") as tr:
        tr.set(40)
        tr.update(20)
    bar = fake_tqdm.bars[-1]
    assert bar.n == 100 and bar.closed and bar.kw["desc"] == "load"


def test_a_note_follows_the_bar_until_it_completes(fake_tqdm, fast_callbacks):
    with _progress.tracker(100, True, "load") as tr:
        tr.note("no answer from rank 1")
        assert fake_tqdm.bars[-1].postfix == "no answer from rank 1"
        tr.set(50)
        tr.note("")
        assert fake_tqdm.bars[-1].postfix == ""
        tr.note("no answer from rank 3")
    assert fake_tqdm.bars[-1].postfix == ""  # complete: nothing is missing
    with pytest.raises(RuntimeError):
        with _progress.tracker(100, True, "load") as tr:
            tr.note("no answer from rank 2")
            raise RuntimeError("lost")
    assert fake_tqdm.bars[-1].postfix == "no answer from rank 2"  # stopped where it stood
    calls = []
    with _progress.tracker(100, lambda d, n: calls.append(d)) as tr:  # callbacks hear no note
        tr.note("no answer from rank 1")
        tr.set(50)
    assert calls == [50, 100]


def test_a_failure_closes_the_bar_and_ends_the_calls(fake_tqdm, fast_callbacks):
    calls = []
    with pytest.raises(RuntimeError):
        with _progress.tracker(100, True) as tr:
            tr.update(30)
            raise RuntimeError("lost")
    assert fake_tqdm.bars[0].closed and fake_tqdm.bars[0].n == 30
    with pytest.raises(RuntimeError):
        with _progress.tracker(100, lambda d, n: calls.append(d)) as tr:
            tr.update(30)
            raise RuntimeError("lost")
    tr.update(10)
    assert calls == [30]


def test_true_bar_goes_to_stderr_with_byte_units(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr("sys.stderr", buf)
    with _progress.tracker(3 << 20, True, "upload") as tr:
        tr.update(3 << 20)
    assert "upload" in buf.getvalue() and "3.00M" in buf.getvalue(), buf.getvalue()


def test_true_without_tqdm_warns_once_and_goes_on(monkeypatch):
    monkeypatch.setattr(_progress, "_tqdm", None)
    monkeypatch.setattr(_progress, "_warned", False)
    with pytest.warns(UserWarning, match="python3-tqdm"):
        with _progress.tracker(10, True) as tr:
            tr.update(10)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _progress.tracker(10, True).close(ok=True)
