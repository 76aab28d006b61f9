"""data_path= on meshd.connect (meshd/direct.py): auto takes the direct path
against a local server, proxy never does, and a bad value is refused before any
connection is made. The protocol's refusals are in tests/integration/test_direct.py."""

import contextlib
import importlib
import threading

import numpy as np
import pytest
from conftest import start_meshd, stop_meshd

import meshd


def test_bad_data_path_is_refused():
    with pytest.raises(ValueError, match="data_path must be one of auto, direct, proxy"):
        meshd.connect("127.0.0.1:1", data_path="fast")


@pytest.mark.parametrize("data_path,direct", [("auto", True), ("direct", True), ("proxy", False)])
def test_data_path_choice(server, data_path, direct):
    arr = np.arange(2 * (1 << 17), dtype=np.float32).reshape(2, -1)  # 1 MiB: not a Literal
    with meshd.connect(server[0], data_path=data_path) as s:
        with s.mesh(gpu=2).activate():
            x = meshd.tensor(arr, shard="gpu")
            got = [meshd.fetch_shard(x, gpu=g) for g in range(2)]
            assert [f.result().tolist() for f in got] == arr.tolist()
        n = 1 if direct else 0
        assert s._direct.counts == {"upload": n, "fetch": 2 * n}


def count_uploads(s, monkeypatch):
    """A list that grows by one for each Upload call session s makes (not its callables)."""
    uploads, real = [], s._ch.stream_unary

    def spy(method, *a, **kw):
        fn = real(method, *a, **kw)
        if not method.endswith("/Upload"):
            return fn

        class Counted:  # the client calls it, or its future() (meshd.tensor)
            def __call__(self, *ca, **ckw):
                uploads.append(method)
                return fn(*ca, **ckw)

            def future(self, *ca, **ckw):
                uploads.append(method)
                return fn.future(*ca, **ckw)
        return Counted()
    monkeypatch.setattr(s._ch, "stream_unary", spy)
    return uploads


@pytest.mark.parametrize("data_path", ["auto", "proxy", "direct"])
def test_tensors_of_at_most_256_kib_go_as_one_literal_command(server, data_path, monkeypatch):
    """meshd.tensor of at most 256 KiB (all ranks' bytes) sends one Literal command: no
    Upload call and no direct transfer, exact values on every rank; 4 bytes more
    takes the data path. data_path="direct" always takes the direct path."""
    with meshd.connect(server[0], data_path=data_path) as s:
        uploads = count_uploads(s, monkeypatch)
        with s.mesh(gpu=2).activate():
            whole = np.arange(1 << 16, dtype=np.float32)  # 256 KiB to each rank
            rows = np.arange(1 << 16, dtype=np.int32).reshape(2, -1)  # 128 KiB per rank
            x, y = meshd.tensor(whole), meshd.tensor(rows, shard="gpu")
            for g in range(2):
                np.testing.assert_array_equal(meshd.fetch_shard(x, gpu=g).result(), whole)
                np.testing.assert_array_equal(meshd.fetch_shard(y, gpu=g).result(), rows[g])
            literal = data_path != "direct"
            assert (len(uploads), s._direct.counts["upload"]) == ((0, 0) if literal else (0, 2))
            z = meshd.tensor(np.ones((1 << 16) + 1, dtype=np.float32))
            np.testing.assert_array_equal(meshd.fetch_shard(z, gpu=1).result(), 1.0)
        went = (len(uploads), s._direct.counts["upload"])
        assert went == {"auto": (0, 1), "proxy": (1, 0), "direct": (0, 3)}[data_path], went


def test_a_mesh_with_an_older_agent_gets_uploads(monkeypatch):
    """A rolling upgrade: the agent of rank 1 registers as a build older than the Literal
    command (MESHD_FAULT=hello:old). A mesh with it says so (MeshMeta.literals) and gets
    its small tensors as Uploads, pipelined or not; rank 0's slice still gets Literals."""
    addr, proc = start_meshd(2, name="old-agent", env={"MESHD_FAULT": "hello:old,rank=1"})
    try:
        with meshd.connect(addr, data_path="proxy") as s:
            uploads = count_uploads(s, monkeypatch)
            m = s.mesh(gpu=2)
            assert not m._literals, "a mesh with an older agent says it runs Literals"
            with m.activate():
                with s.pipeline():
                    x = meshd.tensor(np.arange(4, dtype=np.float32))
                    y = x + 1
                np.testing.assert_array_equal(meshd.fetch_shard(y, gpu=1).result(),
                                              np.arange(4) + 1)
            assert len(uploads) == 1
            m0 = m.slice(gpu=0)
            assert m0._literals, "rank 0's slice has no older agent"
            with m0.activate():
                z = meshd.tensor(np.arange(3, dtype=np.int64))
                np.testing.assert_array_equal(meshd.inspect(z), np.arange(3))
            assert len(uploads) == 1, "rank 0's slice got an Upload"
    finally:
        stop_meshd(proc)


def test_a_literal_refused_for_an_older_agent_falls_back_to_upload(server, monkeypatch):
    """A server refuses a Literal on a mesh with an agent older than the command (it
    would end that agent's link; tests/unit/test_commands.c): the client then sends
    that tensor, and every later one, as an Upload. Other refusals are raised."""
    from meshd import MeshdError
    with meshd.connect(server[0], data_path="proxy") as s:
        assert s._literals, "the server lists the literal feature"
        real, refused = s._execute, []

        def old_agents(field, build, claim=0, timeout=None):
            if field == "literal":
                refused.append(build(s._new_ref()))  # (the ref is spent, as on the server)
                raise MeshdError("UNAVAILABLE", "Literal: the agent at rank 1 (version 0.0.9) "
                                 "predates the Literal command; send the tensor with Upload")
            return real(field, build, claim, timeout)
        monkeypatch.setattr(s, "_execute", old_agents)
        with s.mesh(gpu=2).activate():
            a = np.arange(6, dtype=np.int16)
            x = meshd.tensor(a)
            y = meshd.tensor(a + 1)
            np.testing.assert_array_equal(meshd.fetch_shard(x, gpu=1).result(), a)
            np.testing.assert_array_equal(meshd.fetch_shard(y, gpu=0).result(), a + 1)
        assert len(refused) == 1 and not s._literals

    with meshd.connect(server[0], data_path="proxy") as s:
        real = s._execute

        def full(field, build, claim=0, timeout=None):
            if field == "literal":
                raise MeshdError("QUOTA", "Literal: the session holds its whole quota")
            return real(field, build, claim, timeout)
        monkeypatch.setattr(s, "_execute", full)
        with s.mesh(gpu=2).activate(), pytest.raises(MeshdError, match="quota"):
            meshd.tensor(np.ones(4, np.float32))


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



@pytest.mark.parametrize("data_path", ["direct", "proxy"])
def test_fetch_shard_returns_before_its_plan_and_commands_wait_for_it(server, data_path,
                                                                      monkeypatch):
    """fetch_shard no longer waits for its plan (direct) or its Fetch's first answer
    (proxy): the fetch's own thread does, the shards' all at once (one after another
    they were 12% of a 4-agent fetch). A command sent meanwhile waits for them, so
    the values fetched are the tensor's as the commands before fetch_shard left it.
    At most 8 at once: beyond, fetch_shard waits, as it did for each plan (a thread
    per fetch would poll for the session's transfer slots). (fetch_shard waited for
    each, here held: it did not return.)"""
    _tensor = importlib.import_module("meshd.tensor")
    gate = threading.Event()

    def held(real):
        def place(*args, **kw):
            assert gate.wait(5), "fetch_shard waited for its plan"
            return real(*args, **kw)
        return place
    monkeypatch.setattr(_tensor, "_fetch_direct", held(_tensor._fetch_direct))
    monkeypatch.setattr(_tensor, "_fetch_open", held(_tensor._fetch_open))
    a = np.arange(6, dtype=np.float32)
    with meshd.connect(server[0], data_path=data_path, timeout=20) as s:
        with s.mesh(gpu=2).activate():
            t = meshd.tensor(a)
            twice = t * 2
            futs = [meshd.fetch_shard(t, gpu=r) for r in (0, 1)]
            done = []
            cmd = threading.Thread(target=lambda: done.append(
                twice.reduce("gpu", "sum", out=t)))  # t := 4a, once both are planned
            cmd.start()
            cmd.join(0.3)
            assert not done and s._placing == 2
            gate.set()
            for f in futs:
                np.testing.assert_array_equal(f.result(20), a)
            cmd.join(20)
            assert done
            np.testing.assert_array_equal(meshd.inspect(t, gpu=1), a * 4)
            assert s._direct.counts["fetch"] == (3 if data_path == "direct" else 0)
            # At most 8 are planned at once: the 9th fetch_shard waits for one of them.
            gate.clear()
            futs = [meshd.fetch_shard(t, gpu=r % 2) for r in range(8)]
            ninth = []
            late = threading.Thread(target=lambda: ninth.append(meshd.fetch_shard(t, gpu=1)))
            late.start()
            late.join(0.3)
            assert not ninth and s._placing == 8
            gate.set()
            late.join(20)
            for f in futs + ninth:
                np.testing.assert_array_equal(f.result(20), a * 4)


@pytest.mark.parametrize("data_path", ["direct", "proxy"])
def test_fetches_waiting_for_a_transfer_slot_hold_no_command_back(server, data_path, monkeypatch):
    """The session's 8 transfer slots (the server's default) taken by 8 fetches being
    read (planned, not finished), then 9 fetch_shards: the server plans each at once,
    its value fixed, and only its bytes wait for a slot (FetchRequest.wait_for_slot).
    So the 9th fetch_shard (the session's 17th fetch) returns at once, where it waited
    for one of 8 plans that waited for a slot; an in-place write after them runs at
    once, where it waited (on its own deadline: DEADLINE_EXCEEDED) for the 8 reads;
    and every fetch still returns the value from before the write. Direct, each costs
    two PlanTransfer calls, its plan and its grant request, which the server holds
    until a slot frees (it refused it, and the client asked again and again)."""
    _tensor = importlib.import_module("meshd.tensor")
    _direct = importlib.import_module("meshd.direct")
    plans = []  # PlanTransfer calls made (each try of Direct.plan's)
    real_retry = _direct.retry_transfers_full

    def counted(start, timeout):
        def once():
            plans.append(1)
            return start()
        return real_retry(once, timeout)
    monkeypatch.setattr(_direct, "retry_transfers_full", counted)
    a = np.arange(6, dtype=np.float32)
    with meshd.connect(server[0], data_path=data_path, timeout=5) as s:
        pb = s._pb
        with s.mesh(gpu=2).activate():
            t = meshd.tensor(a)
            reading = [s._unary("PlanTransfer", pb.PlanTransferRequest(
                fetch=_tensor._fetch_request(t, {"gpu": i % 2})), pb.PlanTransferReply)
                for i in range(8)]
            futs = []
            plans.clear()  # (the tensor's upload planned one)
            try:
                starter = threading.Thread(target=lambda: futs.extend(
                    meshd.fetch_shard(t, gpu=i % 2, timeout=30) for i in range(9)))
                starter.start()
                starter.join(10)
                assert len(futs) == 9, (len(futs), s._placing, s._parked)
                with s._placed:  # every plan answered (bounded: 5 s), none parked
                    assert s._placed.wait_for(lambda: s._placing == 0, 5), (s._placing, s._parked)
                assert s._parked == 0
                t.add_(1)  # (a write: before, it waited for the 8 reads)
                s.sync()
                assert not [f for f in futs if f.done()]  # their bytes wait for a slot
            finally:
                for r in reading:  # (their reads end)
                    s._unary("FinishFetch", pb.FinishFetchRequest(transfer_id=r.transfer_id),
                             pb.FinishFetchReply)
                starter.join(30)
            for f in futs:
                np.testing.assert_array_equal(f.result(30), a)
            if data_path == "direct":  # a plan and a grant request each, no retry
                assert len(plans) == 2 * 9, len(plans)
            np.testing.assert_array_equal(meshd.inspect(t, gpu=1), a + 1)
            assert s._direct.counts["fetch"] == (10 if data_path == "direct" else 0)


def test_which_commands_wait_for_fetches_waiting_for_a_slot(server):
    """What may change or end a tensor a fetch waiting for its plan reads, and so waits
    for that plan: in-place ops (the catalogue's "(a!)"), ops the catalogue does not
    know, a Reduce in place or into out=, Drop, Borrow, DropBorrow, Release. Ops that
    make new tensors (views too), factories, literals, loads, to_mesh, Sync do not."""
    may_write = importlib.import_module("meshd.session")._may_write
    with meshd.connect(server[0]) as s:
        pb = s._pb
        for field, msg, writes in [
                ("call", pb.Call(op="add"), False), ("call", pb.Call(op="view"), False),
                ("call", pb.Call(op="add_"), True), ("call", pb.Call(op="zero_"), True),
                ("call", pb.Call(op="no_such_op"), True),
                ("reduce", pb.Reduce(ref=5), False), ("reduce", pb.Reduce(inplace=True), True),
                ("reduce", pb.Reduce(ref=5, out=3), True), ("factory", pb.Factory(), False),
                ("to_mesh", pb.ToMesh(), False), ("load", pb.Load(), False),
                ("sync", pb.Sync(), False), ("drop", pb.Drop(), True),
                ("borrow", pb.Borrow(), True), ("drop_borrow", pb.DropBorrow(), True),
                ("release", pb.Release(), True), ("a_newer_kind", None, True)]:
            assert may_write(field, msg) is writes, (field, msg)


def test_a_fetch_with_no_thread_to_plan_it_leaves_the_session_usable(server, monkeypatch):
    """fetch_shard counts its fetch as being planned (commands wait for it) before it
    queues the plan on a worker thread. A thread that could not start (a process at
    its thread limit; "can't create new thread at interpreter shutdown") left it
    counted: every later command waited its whole deadline and failed
    DEADLINE_EXCEEDED, and the queued plan ran on whichever fetch came next. Now
    fetch_shard raises that error and the session goes on."""
    _tensor = importlib.import_module("meshd.tensor")
    monkeypatch.setattr(_tensor, "_workers", _tensor._Workers())  # no idle thread
    real_start = threading.Thread.start

    def no_thread(self):
        if self.name == "meshd-fetch":
            raise RuntimeError("can't start new thread")
        return real_start(self)
    a = np.arange(4, dtype=np.float32)
    with meshd.connect(server[0], data_path="proxy", timeout=20) as s:
        with s.mesh(gpu=2).activate():
            t = meshd.tensor(a)
            monkeypatch.setattr(threading.Thread, "start", no_thread)
            with pytest.raises(RuntimeError, match="can't start new thread"):
                meshd.fetch_shard(t, gpu=0)
            monkeypatch.setattr(threading.Thread, "start", real_start)
            s.sync(timeout=2)  # (waited 2 s for the fetch, then DEADLINE_EXCEEDED)
            assert s._placing == 0 and not _tensor._workers._work
            np.testing.assert_array_equal(meshd.fetch_shard(t + 1, gpu=1).result(20), a + 1)


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


@pytest.mark.parametrize("data_path", ["direct", "proxy"])
def test_an_agent_killed_mid_transfer_fails_it_and_the_session_goes_on(data_path):
    """Rank 1's agent is SIGKILLed an eighth of the way through a fetch_shard from it,
    then through a sharded upload (the progress callback kills it; not halfway: the
    16 MiB left of a 32 MiB fetch could be in the sockets and gRPC's windows already,
    and a Read that delivered its last byte and receipt has succeeded). Each raises a MeshdError
    naming rank 1 within seconds; the upload's ref stays undefined; the survivor keeps
    nothing of it; and with --session-max-transfers 1 the next transfers still get the
    slot (a failed transfer gave it back): on a new mesh, once the supervisor replaced
    the agent, an upload and fetches round-trip."""
    import os
    import signal
    import time
    from conftest import start_meshd, stop_meshd
    from test_keepalive import _agent_pid
    from meshd import _progress
    addr, proc = start_meshd(2, name=f"meshd-kill-{data_path}",
                             flags=("--session-max-transfers", "1"))
    old = _progress.CALLBACK_INTERVAL
    _progress.CALLBACK_INTERVAL = 0.0
    try:
        with meshd.connect(addr, data_path=data_path, timeout=60) as s:
            def rank1():
                return next(a for a in s.agents() if a["rank"] == 1)

            def killer():
                pid = _agent_pid(proc.pid, 1)
                fired = []

                def cb(done, total):
                    if not fired and done >= total // 8:
                        fired.append(time.monotonic())
                        os.kill(pid, signal.SIGKILL)
                return cb, fired

            def replaced(address):
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    with contextlib.suppress(StopIteration):
                        a = rank1()
                        if a["healthy"] and a["address"] != address:
                            return
                    time.sleep(0.05)
                pytest.fail("rank 1 was not replaced within 30 s")

            big = np.arange(2 * (8 << 20), dtype=np.float32).reshape(2, -1)  # 32 MiB a rank
            m = s.mesh(gpu=2)
            with m.activate():
                t = meshd.tensor(big, shard="gpu")
                cb, fired = killer()
                before = rank1()["address"]
                with pytest.raises(meshd.MeshdError) as ei:
                    meshd.fetch_shard(t, gpu=1, progress=cb).result(timeout=30)
                assert fired, "the fetch ended before an eighth of it"
                took = time.monotonic() - fired[0]
                assert "rank 1" in str(ei.value), ei.value
                assert ei.value.kind == "AGENT_LOST", ei.value  # on either path
                assert took < 10, f"the fetch failed {took:.1f} s after the kill: {ei.value}"
                fetch_err = ei.value
            replaced(before)
            m2 = s.mesh(gpu=2)
            with m2.activate():
                survivor = next(a for a in s.agents() if a["rank"] == 0)["allocated_bytes"]
                cb, fired = killer()
                before = rank1()["address"]
                with pytest.raises(meshd.MeshdError) as ei:
                    meshd.tensor(big, shard="gpu", progress=cb)
                assert fired, "the upload ended before an eighth of it"
                took = time.monotonic() - fired[0]
                assert "rank 1" in str(ei.value), ei.value
                assert ei.value.kind == "AGENT_LOST", ei.value  # on either path
                assert took < 10, f"the upload failed {took:.1f} s after the kill: {ei.value}"
                print(f"{data_path}: fetch: {fetch_err}; upload: {ei.value}")
                undefined = meshd.Tensor(s, s._ref, big.shape[1:], "float32", m2.ref, 0)
                with pytest.raises(meshd.MeshdError) as e2:
                    (undefined + 1).shape
                assert e2.value.kind == "UNKNOWN_REF", e2.value
                deadline = time.monotonic() + 10
                while next(a for a in s.agents() if a["rank"] == 0)["allocated_bytes"] != survivor:
                    assert time.monotonic() < deadline, "rank 0 kept the failed upload's shard"
                    time.sleep(0.05)
            replaced(before)
            with s.mesh(gpu=2).activate():
                x = meshd.tensor(big[:, :1000], shard="gpu")
                for g in (0, 1):
                    np.testing.assert_array_equal(meshd.fetch_shard(x, gpu=g).result(timeout=30),
                                                  big[g, :1000])
    finally:
        _progress.CALLBACK_INTERVAL = old
        stop_meshd(proc)


def test_a_direct_upload_whose_plan_does_not_match_the_mesh_ranks_is_refused(server, monkeypatch):
    """A direct upload's plan must name every rank of the mesh once, in the mesh's
    row-major order (docs/protocol.md, Direct data path): one that does not (a shard too
    many or too few, a rank twice, ranks out of order: one rank's rows sent to another,
    or a rank skipped) is refused INTERNAL before any agent is dialled, and given back
    (FinishUpload without receipts), as the Node client does. (Only the per-rank count
    was checked: ranks swapped or a rank twice had the bytes written where the plan said.)"""
    arr = np.arange(2 * (1 << 17), dtype=np.float32).reshape(2, -1)  # 1 MiB: not a Literal
    with meshd.connect(server[0], data_path="direct") as s:
        d = s._direct
        real_plan, dials, abandons = d.plan, [], []
        real_channels, real_abandon = d._channels_for, d._abandon_upload
        bad = None  # shards -> the shards the plan names instead

        def plan(request, deadline):
            reply = real_plan(request, deadline)
            if reply is not None and request.HasField("upload") and bad is not None:
                shards = [type(sh)() for sh in reply.shards]
                for new, old in zip(shards, reply.shards):
                    new.CopyFrom(old)
                want = bad(shards)
                del reply.shards[:]
                reply.shards.extend(want)
            return reply

        def channels_for(*a, **kw):
            dials.append(1)
            return real_channels(*a, **kw)

        def abandon(tid):
            abandons.append(tid)
            return real_abandon(tid)
        monkeypatch.setattr(d, "plan", plan)
        monkeypatch.setattr(d, "_channels_for", channels_for)
        monkeypatch.setattr(d, "_abandon_upload", abandon)

        def renumbered(sh, rank):
            c = type(sh)()
            c.CopyFrom(sh)
            c.rank = rank
            return c
        with s.mesh(gpu=2).activate():
            cases = [
                ("sharded", lambda sh: [sh[1], sh[0]]),  # rank 0's rows to rank 1
                ("sharded", lambda sh: [sh[0], sh[0]]),  # a rank twice, one skipped
                ("sharded", lambda sh: [sh[0]]),  # too few
                ("sharded", lambda sh: sh + [renumbered(sh[0], 99)]),  # too many
                ("replicated", lambda sh: [sh[1], sh[0]]),  # out of the mesh's order
                ("replicated", lambda sh: [sh[0], sh[0]]),  # a rank twice
            ]
            for i, (kind, f) in enumerate(cases):
                bad = f
                before = len(abandons)
                with pytest.raises(meshd.MeshdError) as ei:
                    if kind == "sharded":
                        meshd.tensor(arr, shard="gpu")
                    else:
                        meshd.tensor(arr[0])
                assert ei.value.kind == "INTERNAL", (i, ei.value)
                assert "direct upload: the plan" in str(ei.value), (i, ei.value)
                assert not dials, f"case {i}: an agent was dialled for a plan that does not match the mesh"
                assert len(abandons) == before + 1, f"case {i}: the plan was not given back"
            bad = None
            x = meshd.tensor(arr, shard="gpu")  # the session's slot was given back
            for g in range(2):
                np.testing.assert_array_equal(meshd.fetch_shard(x, gpu=g).result(), arr[g])
