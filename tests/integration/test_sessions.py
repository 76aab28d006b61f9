"""Sessions over real gRPC (DESIGN §2 "Session", docs/protocol.md "Conventions"):
CreateSession / CloseSession / KeepAlive / ListSessions, the meshd-session and
meshd-token metadata, isolation, lease expiry."""

import re
import time

import grpc
import pytest

import meshd_testlib as lib
from meshd_testlib import Session, create_mesh, describe, slice_mesh


def _tensor_pb():
    return lib.tensor_pb2()


def _no_session(fn, what):
    """fn() must fail UNAUTHENTICATED with kind NO_SESSION; returns the message."""
    try:
        fn()
    except grpc.RpcError as e:
        err = lib.CommandError.from_rpc(e)
    except lib.CommandError as e:
        err = e
    else:
        raise AssertionError(f"{what} succeeded; expected UNAUTHENTICATED / NO_SESSION")
    lib.expect_kind(err, "NO_SESSION")
    return err.message


def _wait_gone(s, timeout):
    """Polls ListSessions (which touches no session) until s is not listed; returns the
    seconds it took, or fails after timeout."""
    t0 = time.monotonic()
    while True:
        if s.info() is None:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"session {s.id} still listed {timeout} s later: {s.info()}")
        time.sleep(0.1)


# ---------------------------------------------------------------- create / metadata

def test_create_session_returns_id_and_token(shared_meshd):
    srv = shared_meshd(2)
    with Session(srv.port, "alice") as a, Session(srv.port, "bob") as b:
        for s in (a, b):
            assert s.id and s.token, (s.id, s.token)
            assert s.ttl_seconds > 0
        assert a.id != b.id and a.token != b.token
        # Both work at once.
        a.run(create_mesh(a.new_ref(), gpu=2))
        b.run(create_mesh(b.new_ref(), gpu=1))


def test_session_ttl_defaults_to_the_flag_and_can_be_asked_for(meshd_server):
    srv = lib.wait_ready(meshd_server(0, "--session-ttl", 77, min_agents=0), 0)
    with Session(srv.port) as s:
        assert s.ttl_seconds == 77
        assert s.keep_alive().ttl_seconds == 77
    with Session(srv.port, ttl_seconds=5) as s:
        assert s.ttl_seconds == 5
        assert s.keep_alive().ttl_seconds == 5


@pytest.mark.parametrize("req,what", [
    (dict(client_name="a\nb"), "control character"),
    (dict(client_name="x" * 129), "client_name"),
    (dict(ttl_seconds=8 * 86400), "ttl_seconds"),
], ids=["control-char-name", "long-name", "ttl-over-7-days"])
def test_create_session_rejects_bad_fields(shared_meshd, req, what):
    srv = shared_meshd(2)
    t = _tensor_pb()
    with lib.channel(srv.port) as ch:
        fn = ch.unary_unary("/meshd.v1.TensorService/CreateSession",
                            request_serializer=lambda m: m.SerializeToString(),
                            response_deserializer=t.CreateSessionReply.FromString)
        with pytest.raises(grpc.RpcError) as ei:
            fn(t.CreateSessionRequest(**req), timeout=5)
    err = lib.expect_kind(lib.CommandError.from_rpc(ei.value), "BAD_ARGUMENT", "CreateSession")
    assert what in err.message, err.message


def test_calls_without_session_metadata_are_unauthenticated(shared_meshd):
    srv = shared_meshd(2)
    t = _tensor_pb()
    with Session(srv.port) as s:
        cmd = s.command(create_mesh(1, gpu=1))
        msg = _no_session(lambda: s.execute_raw(cmd, metadata=()), "Execute without metadata")
        assert lib.SESSION_MD in msg and lib.TOKEN_MD in msg and "Execute" in msg, msg
        msg = _no_session(lambda: s.execute_raw(cmd, metadata=((lib.SESSION_MD, s.id),)),
                          "Execute without a token")
        assert lib.TOKEN_MD in msg, msg
        msg = _no_session(lambda: s.execute_raw(cmd, metadata=((lib.TOKEN_MD, s.token),)),
                          "Execute without a session id")
        assert lib.SESSION_MD in msg, msg
        _no_session(lambda: s.keep_alive(metadata=()), "KeepAlive without metadata")
        _no_session(lambda: s.close(metadata=()), "CloseSession without metadata")
        # Submit: the stream ends with the status.
        results, code, details = s.submit([cmd], metadata=())
        assert results == [] and code == grpc.StatusCode.UNAUTHENTICATED, (results, code, details)
        # Nothing of the above reached the session: ref 1 is still free.
        assert s.execute_raw(cmd).mesh.ref == 1


def test_wrong_token_or_unknown_session_is_unauthenticated(shared_meshd):
    srv = shared_meshd(2)
    with Session(srv.port) as a, Session(srv.port) as b:
        cmd = a.command(create_mesh(1, gpu=1))
        flipped = ("0" if a.token[0] != "0" else "1") + a.token[1:]
        for md, what in [
            (((lib.SESSION_MD, a.id), (lib.TOKEN_MD, flipped)), "one character off"),
            (((lib.SESSION_MD, a.id), (lib.TOKEN_MD, a.token[:-1])), "one character short"),
            (((lib.SESSION_MD, a.id), (lib.TOKEN_MD, b.token)), "another session's token"),
            (((lib.SESSION_MD, "f" * len(a.id)), (lib.TOKEN_MD, a.token)), "an unknown id"),
            (((lib.SESSION_MD, "x" * 1000), (lib.TOKEN_MD, "y" * 1000)), "oversized values"),
        ]:
            msg = _no_session(lambda: a.execute_raw(cmd, metadata=md), f"Execute with {what}")
            assert a.token not in msg and b.token not in msg, f"a token leaked into {msg!r}"
            _no_session(lambda: a.keep_alive(metadata=md), f"KeepAlive with {what}")
        # The real session is untouched.
        assert a.execute_raw(cmd).mesh.ranks == [0]


def test_close_session_then_use_is_unauthenticated(shared_meshd):
    srv = shared_meshd(2)
    with Session(srv.port, "closer") as s:
        s.run(create_mesh(s.new_ref(), gpu=2))
        assert s.info() is not None
        s.close()
        assert s.info() is None, "a closed session is still listed"
        _no_session(lambda: s.run(describe(1)), "Execute after CloseSession")
        _no_session(lambda: s.keep_alive(), "KeepAlive after CloseSession")
        _no_session(lambda: s.close(), "a second CloseSession")
        results, code, _ = s.submit([s.command(describe(1))])
        assert code == grpc.StatusCode.UNAUTHENTICATED and not results, (code, results)


def test_sessions_are_isolated(shared_meshd):
    srv = shared_meshd(2)
    with Session(srv.port, "a") as a, Session(srv.port, "b") as b:
        ma = a.run(create_mesh(5, gpu=2)).mesh
        assert ma.ref == 5
        # B knows nothing of A's ref 5 ...
        b.fails("UNKNOWN_REF", describe(5), "Describe")
        b.fails("UNKNOWN_REF", slice_mesh(6, 5, gpu=0), "SliceMesh")
        # ... and has its own ref space: ref 1 and ref 5 are free there.
        assert b.run(create_mesh(1, gpu=1)).mesh.ref == 1
        assert b.run(create_mesh(5, gpu=2)).mesh.ranks == [0, 1]
        # A's refs are unaffected by B's.
        a.fails("REF_REUSED", create_mesh(5, gpu=1), "CreateMesh")
        assert a.run(describe(5)).mesh.ranks == [0, 1]
        a.fails("UNKNOWN_REF", describe(1), "Describe")
        # A's id with B's token opens nothing; closing A leaves B alone.
        _no_session(lambda: a.execute_raw(a.command(describe(5)),
                                          metadata=((lib.SESSION_MD, a.id), (lib.TOKEN_MD, b.token))),
                    "A's id with B's token")
        a.close()
        assert b.run(describe(5)).mesh.ref == 5


# ---------------------------------------------------------------- lease

def test_keepalive_keeps_a_session_past_its_ttl(meshd_server):
    srv = lib.wait_ready(meshd_server(2, "--session-ttl", 2), 2)
    with Session(srv.port, "kept") as s, Session(srv.port, "left") as idle:
        s.run(create_mesh(s.new_ref(), gpu=2))
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5.0:   # two and a half ttls, KeepAlive ten times per ttl
            assert s.keep_alive().ttl_seconds == 2
            time.sleep(0.2)
        # The idle one is gone by now (bounded poll), the kept one is not.
        _wait_gone(idle, 10.0)
        assert s.info() is not None
        assert s.run(describe(1)).mesh.ranks == [0, 1]


def test_lease_expiry_ends_the_session(meshd_server):
    srv = lib.wait_ready(meshd_server(2, "--session-ttl", 1), 2)
    with Session(srv.port, "short") as s:
        s.run(create_mesh(s.new_ref(), gpu=2))
        took = _wait_gone(s, 10.0)   # ttl 1 s; the bound is slack, not a speed claim
        msg = _no_session(lambda: s.run(describe(1)), "Execute after expiry")
        assert s.id in msg or "expired" in msg or "no session" in msg, msg
        _no_session(lambda: s.keep_alive(), "KeepAlive after expiry")
        print(f"session gone {took:.2f} s after its last use")
    # The server is fine afterwards.
    with Session(srv.port) as s2:
        assert s2.run(create_mesh(1, gpu=2)).mesh.ranks == [0, 1]


def test_agents_restarting_do_not_keep_an_idle_session_alive(meshd_server):
    """An idle session expires on time while an agent crash-loops: each loss (SIGKILL,
    the supervisor restarts it) tells the sessions with work on it, and that lookup
    must not count as the session's use. (It renewed every session's lease, so with an
    agent lost more often than the ttl, abandoned sessions never expired.)"""
    import os
    import signal
    srv = lib.wait_ready(meshd_server(2, "--session-ttl", 2), 2)
    with Session(srv.port, "abandoned") as s:
        s.run(create_mesh(s.new_ref(), gpu=2))
        t0 = time.monotonic()
        kills = 0
        while s.info() is not None:
            assert time.monotonic() - t0 < 12, \
                f"the idle session outlived its 2 s ttl by far ({kills} agent losses meanwhile)"
            pid = next((p for p in lib.agent_children(srv.pid) if lib.child_rank(p) == 1), None)
            if pid:
                os.kill(pid, signal.SIGKILL)
                kills += 1
            time.sleep(0.7)
        took = time.monotonic() - t0
        assert kills >= 2, f"only {kills} losses before it expired: the test proved nothing"
        print(f"expired {took:.1f} s after its last use, through {kills} agent losses")


def test_per_session_ttl_overrides_the_default(shared_meshd):
    srv = shared_meshd(2)   # default --session-ttl 300
    with Session(srv.port, "short", ttl_seconds=1) as short, Session(srv.port, "long") as long_:
        _wait_gone(short, 10.0)
        assert long_.info() is not None
        msg = _no_session(lambda: short.keep_alive(), "KeepAlive after expiry")
        # review-123: the message quoted the server's default ttl as the session's own
        assert "after 300 s idle" not in msg, msg
        long_.keep_alive()


def test_the_testlib_session_block_closes_its_session(shared_meshd):
    # review-123: Session.__exit__ closed only the channel, leaving every test's session
    # (and its tensors on the shared agents) to its lease (300 s by default).
    srv = shared_meshd(2)
    with Session(srv.port, "block") as s:
        s.run(create_mesh(s.new_ref(), gpu=2))
    with Session(srv.port, "watcher") as w:
        assert s.id not in [x.session_id for x in w.list_sessions()], "still open after its block"
    with Session(srv.port, "closed-inside") as s:  # closed already: the block still ends quietly
        s.close()


def test_a_call_after_the_lease_ran_out_does_not_revive_it(meshd_server):
    # Idle longer than its ttl means gone, whether or not the periodic sweep has run yet.
    srv = lib.wait_ready(meshd_server(0, "--session-ttl", 1, min_agents=0), 0)
    with Session(srv.port) as s:
        time.sleep(1.6)
        _no_session(lambda: s.keep_alive(), "KeepAlive 1.6 s after the last use (ttl 1 s)")


# ---------------------------------------------------------------- ListSessions

def test_list_sessions_shows_client_names(shared_meshd):
    srv = shared_meshd(2)
    with Session(srv.port, "alice") as a, Session(srv.port, "bob") as b:
        rows = {x.session_id: x for x in a.list_sessions()}
        assert rows[a.id].client_name == "alice"
        assert rows[b.id].client_name == "bob"
        for s in (a, b):
            assert rows[s.id].live_tensors == 0 and rows[s.id].bytes_held == 0
        # No token leaks through the listing.
        text = str(a.list_sessions())
        assert a.token not in text and b.token not in text


def test_list_sessions_counts_live_tensors_and_bytes(shared_meshd):
    srv = shared_meshd(2)
    with Session(srv.port, "counter") as s:
        m = s.mesh(gpu=2)
        missing = s.missing_ops(m.ref, factories=("zeros",))
        if missing:
            pytest.skip(f"op catalogue not there yet: {missing}")
        x = s.tensor(m.ref, (2, 3), dtype_="float32")    # 24 bytes on each of 2 ranks
        y = s.tensor(m.ref, (4,), dtype_="int64")        # 32 bytes on each of 2 ranks
        row = s.info()
        assert row.client_name == "counter"
        assert row.live_tensors == 2, row
        assert row.bytes_held == 2 * (24 + 32), row
        s.run(lib.drop(x.ref))
        row = s.info()
        assert (row.live_tensors, row.bytes_held) == (1, 2 * 32), row
        s.run(lib.drop(y.ref))
        row = s.info()
        assert (row.live_tensors, row.bytes_held) == (0, 0), row


def test_list_sessions_needs_no_metadata_and_session_calls_do(shared_meshd):
    srv = shared_meshd(2)
    t = _tensor_pb()
    with Session(srv.port) as s:
        assert any(x.session_id == s.id for x in s.list_sessions())
        assert re.fullmatch(r"[0-9a-f]+", s.id), s.id
        reply = lib.unary(srv.port, "/meshd.v1.TensorService/ListSessions", t.ListSessionsRequest(),
                          t.ListSessionsReply)
        assert any(x.session_id == s.id for x in reply.sessions)


def test_a_create_session_whose_answer_is_lost_frees_its_slot(meshd_server):
    """A CreateSession whose client never got the answer (its 0.5 s deadline passed
    while the server held the answer: --server-fault session:slow; or the client
    cancelled the call) never told anyone the session's token: nobody can use or close
    that session. The server closes it when the call ends cancelled, so a retry is not
    refused QUOTA by --max-sessions-per-principal 1 for the lost session's ttl (an hour
    here); a session whose answer came is kept."""
    srv = meshd_server(0, "--max-sessions-per-principal", "1",
                       "--server-fault", "session:slow=1500,count=2")
    pb = _tensor_pb()
    path = "/meshd.v1.TensorService/CreateSession"
    req = pb.CreateSessionRequest(client_name="lost-answer", ttl_seconds=3600)

    def admitted(timeout=5):
        """CreateSession, asked again while the principal's one slot is taken (8 s at most)."""
        end = time.monotonic() + 8
        while True:
            try:
                return lib.unary(srv.port, path, req, pb.CreateSessionReply, timeout=timeout)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                assert "--max-sessions-per-principal" in err.details(), err.details()
                assert time.monotonic() < end, \
                    "a CreateSession whose answer was lost still holds the principal's slot"
                time.sleep(0.1)

    # 1: the client's deadline passes while the answer is held
    with pytest.raises(grpc.RpcError) as e:
        lib.unary(srv.port, path, req, pb.CreateSessionReply, timeout=0.5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.value
    end = time.monotonic() + 8
    while lib.unary(srv.port, "/meshd.v1.TensorService/ListSessions",
                    pb.ListSessionsRequest(), pb.ListSessionsReply).sessions:
        assert time.monotonic() < end, \
            "the session whose CreateSession answer was lost is still open 8 s later"
        time.sleep(0.1)
    # 2: the client gives up (cancels) while the answer is held
    with lib.channel(srv.port) as ch:
        call = ch.unary_unary(path, request_serializer=lambda m: m.SerializeToString(),
                              response_deserializer=pb.CreateSessionReply.FromString)
        fut = call.future(req, timeout=30)
        time.sleep(0.5)
        assert fut.cancel(), "the held CreateSession answered early"
    # the retry gets the slot, and its session (whose answer came) works and stays
    reply = admitted()
    md = (("meshd-session", reply.session_id), ("meshd-token", reply.token))
    time.sleep(1.6)  # past the fault's hold: nothing closes an answered session
    lib.unary(srv.port, "/meshd.v1.TensorService/KeepAlive", pb.KeepAliveRequest(),
              pb.KeepAliveReply, metadata=md)
    listed = lib.unary(srv.port, "/meshd.v1.TensorService/ListSessions",
                       pb.ListSessionsRequest(), pb.ListSessionsReply).sessions
    assert [s.session_id for s in listed] == [reply.session_id], listed
    log = open(srv.log).read()
    assert log.count("its call was cancelled before the answer reached the client") == 2, \
        lib.log_tail(srv.log)


def test_the_per_principal_cap_gives_a_place_back_however_a_session_ends(meshd_server,
                                                                          tmp_path):
    """--max-sessions-per-principal 2 counts each principal's open sessions as they open
    and end (CreateSession walked every session to count them). A place comes back when
    the session is closed and when its lease runs out, once each: the cap still holds
    afterwards. A principal whose token a SIGHUP revoked keeps its sessions until their
    lease (docs/security.md): re-admitted, it still has only the places they left."""
    import os
    import signal
    alice, bob = "alice-0123456789abcdef", "bob-0123456789abcdefgh"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {alice}\nbob {bob}\n")
    srv = meshd_server(0, "--auth-tokens", tokens, "--max-sessions-per-principal", 2,
                       min_agents=0)
    pb = _tensor_pb()

    def call(tok, method, req, reply_cls, md=()):
        return lib.unary(srv.port, "/meshd.v1.TensorService/" + method, req, reply_cls,
                         metadata=(("authorization", f"Bearer {tok}"),) + tuple(md))

    def create(tok, ttl=3600):
        r = call(tok, "CreateSession", pb.CreateSessionRequest(ttl_seconds=ttl),
                 pb.CreateSessionReply)
        return r.session_id, r.token

    def refused(tok, who):
        with pytest.raises(grpc.RpcError) as e:
            create(tok)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
        assert f"'{who}' already holds 2 open sessions" in e.value.details(), e.value.details()

    def listed(tok):
        return {s.session_id for s in call(tok, "ListSessions", pb.ListSessionsRequest(),
                                           pb.ListSessionsReply).sessions}

    def wait_expired(tok, sid):
        end = time.monotonic() + 10
        while sid in listed(tok):
            assert time.monotonic() < end, f"session {sid} outlived its lease (2 or 3 s) by 7 s or more"
            time.sleep(0.1)

    def reload(text, bob_works):
        tokens.write_text(text)
        os.kill(srv.pid, signal.SIGHUP)
        end = time.monotonic() + 10
        while True:
            try:
                listed(bob)
                works = True
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e.details()
                works = False
            if works == bob_works:
                return
            assert time.monotonic() < end, f"bob's token {'not ' * bob_works}in force 10 s after SIGHUP"
            time.sleep(0.05)

    # closed
    a1 = create(alice)
    a2 = create(alice, ttl=2)
    refused(alice, "alice")
    call(alice, "CloseSession", pb.CloseSessionRequest(), pb.CloseSessionReply,
         md=(("meshd-session", a1[0]), ("meshd-token", a1[1])))
    create(alice)
    refused(alice, "alice")
    # expired
    wait_expired(alice, a2[0])
    create(alice)
    refused(alice, "alice")  # each end gave back one place, not more
    # revoked at SIGHUP, then expired
    create(bob)
    b2 = create(bob, ttl=3)
    reload(f"alice {alice}\n", bob_works=False)
    reload(f"alice {alice}\nbob {bob}\n", bob_works=True)
    refused(bob, "bob")  # the revoked token's sessions still hold their places
    wait_expired(bob, b2[0])
    create(bob)
    refused(bob, "bob")
