"""A unary Execute that reached the server but whose answer never came back (a deadline,
a dropped connection, Ctrl-C while it waited), and an answer the client cannot read (a
dtype newer than the client): the tensors the server defined must not stay live behind
the caller's back, holding the agents' memory and the session's quota until it ends.
Each test failed before the fix (a review of the client)."""

import gc
import warnings

import grpc
import numpy as np
import pytest
from test_direct_faults import _LostAnswer  # a call that reached the server, its answer lost
from test_interrupts_and_lost_answers import Interrupt, _live

import meshd


def _lose_execute_answers(s, monkeypatch, fault, field):
    """From now on the session's Execute calls of a `field` command reach the server,
    which runs them, and then raise `fault` instead of returning the answer."""
    real = s._ch.unary_unary
    calls = []

    def make(method, *a, **kw):
        fn = real(method, *a, **kw)
        if not method.endswith("/Execute"):
            return fn

        def execute(request, *ca, **ckw):
            reply = fn(request, *ca, **ckw)  # the server ran it and answered ...
            packed = getattr(request, "packed_command", False)  # a Literal, packed by hand
            if (field == "literal") if packed else request.HasField(field):
                calls.append(request.seq)
                raise fault()  # ... and the answer is lost
            return reply
        return execute
    monkeypatch.setattr(s._ch, "unary_unary", make)
    monkeypatch.setattr(s, "_calls", {})  # the cached callables: made again through `make`
    return calls


_COMMANDS = {  # field -> what makes one such command on the active mesh (x: a tensor)
    "factory": lambda x: meshd.zeros(1000),
    "call": lambda x: x + 1,
    "reduce": lambda x: x.reduce("gpu"),
    "literal": lambda x: meshd.tensor(np.arange(10, dtype=np.float32)),
}


@pytest.mark.parametrize("fault", [_LostAnswer, Interrupt], ids=["deadline", "ctrl-c"])
@pytest.mark.parametrize("field", sorted(_COMMANDS))
def test_a_command_whose_execute_answer_is_lost_leaves_no_tensor(server, monkeypatch, fault,
                                                                   field):
    with meshd.connect(server[0], timeout=20) as s:
        with s.mesh(gpu=2).activate():
            x = meshd.ones(4)
            s.sync()
            base = _live(s)
            calls = _lose_execute_answers(s, monkeypatch, fault, field)
            with pytest.raises((meshd.MeshdError, Interrupt)) as ei:
                _COMMANDS[field](x)
            monkeypatch.undo()
            assert calls, "the command was not sent as a unary Execute"
            if fault is _LostAnswer:
                assert ei.value.kind == "DEADLINE_EXCEEDED", ei.value
            s.sync()
            assert _live(s) == base, (f"the tensor the lost {field} answer defined is still "
                                      f"live")
            del x


def test_a_result_of_a_dtype_the_client_does_not_know_is_a_handle(server, monkeypatch):
    """A newer server's dtype (a number this client's enum lacks) in an accepted command's
    answer: meshd.zeros raised protobuf's ValueError ("Enum DType has no name defined for
    value 99") after the server had defined the tensor, which nobody could release. Now
    the handle is returned, names the dtype by its number, and releases its ref."""
    with meshd.connect(server[0], timeout=20) as s:
        with s.mesh(gpu=2).activate():
            s.sync()
            base = _live(s)
            real = s._ch.unary_unary

            def make(method, *a, **kw):
                fn = real(method, *a, **kw)
                if not method.endswith("/Execute"):
                    return fn

                def execute(request, *ca, **ckw):
                    reply = fn(request, *ca, **ckw)
                    for t in reply.tensors:
                        t.dtype = 99  # a dtype of a newer server
                    return reply
                return execute
            monkeypatch.setattr(s._ch, "unary_unary", make)
            monkeypatch.setattr(s, "_calls", {})
            t = meshd.zeros(1000)
            monkeypatch.undo()
            assert t.shape == (1000,)
            assert "99" in t.dtype, t.dtype
            assert "99" in repr(t)
            s.sync()
            assert _live(s) == base + 1
            del t
            gc.collect()
            s.sync()
            assert _live(s) == base, "the tensor of the unknown dtype is still live"


def test_a_sync_error_of_a_kind_the_client_does_not_know_is_a_meshd_error(server,
                                                                          monkeypatch):
    """A newer server's ErrorKind (a number this client's enum lacks) in a Sync's errors:
    sync() raised protobuf's ValueError ("Enum ErrorKind has no name defined for value
    999"), not the MeshdError with the server's message."""
    with meshd.connect(server[0], timeout=20) as s:
        real = s._ch.unary_unary

        def make(method, *a, **kw):
            fn = real(method, *a, **kw)
            if not method.endswith("/Execute"):
                return fn

            def execute(request, *ca, **ckw):
                reply = fn(request, *ca, **ckw)
                if request.HasField("sync"):
                    reply.errors.add(kind=999, message="a failure of a newer kind", seq=7)
                return reply
            return execute
        monkeypatch.setattr(s._ch, "unary_unary", make)
        monkeypatch.setattr(s, "_calls", {})
        with pytest.raises(meshd.MeshdError) as ei:
            s.sync()
        monkeypatch.undo()
        assert "999" in ei.value.kind, ei.value
        assert ei.value.message == "a failure of a newer kind"


def test_a_pipelined_rejection_of_a_kind_the_client_does_not_know(session, mesh,
                                                                   monkeypatch):
    """The same in a pipeline's answers: the reader thread died on the ValueError, so the
    block's later commands, accepted by the server, all failed "UNAVAILABLE: pipeline
    reader failed" and the rejection itself was never reported."""
    real = session._ch.stream_stream

    def unknown_kinds(reply):
        for res in list(reply.results) + [reply.result]:
            if res.HasField("error") and res.error.kind:
                res.error.kind = 999
        return reply

    class Replies:
        def __init__(self, it):
            self._it = it

        def __iter__(self):
            return self

        def __next__(self):
            return unknown_kinds(next(self._it))

        def __getattr__(self, name):
            return getattr(self._it, name)

    def make(method, *a, **kw):
        fn = real(method, *a, **kw)
        return lambda reqs, **ckw: Replies(fn(reqs, **ckw))
    monkeypatch.setattr(session._ch, "stream_stream", make)
    x = meshd.ones(4)
    with pytest.raises(meshd.MeshdError) as ei:
        with session.pipeline():
            bad = x.reshape([5])  # refused: 4 elements
            good = x + 1
            assert good.shape == (4,)  # answered after the rejection
            del bad
    monkeypatch.undo()
    assert "999" in ei.value.kind, ei.value
    assert np.array_equal(meshd.inspect(good), np.full(4, 2, np.float32))


def test_a_collected_view_of_a_borrowed_tensor_keeps_no_other_ref_live(session, mesh):
    """A view of a borrowed tensor (w[0], w.T: temporaries of any step) collected while
    the borrow lives: the server refuses a Release naming it (BORROWED, "or a view of
    it") and then releases nothing of that command. The client warned and forgot every
    ref of the batch: those tensors (10 here, up to 256) stayed live until the session
    ended. Now they are held back, and released once a borrow ends."""
    pb = session._pb

    def live():
        reply = session._unary("ListSessions", pb.ListSessionsRequest(), pb.ListSessionsReply)
        (row,) = [r for r in reply.sessions if r.session_id == session.id]
        return row.live_tensors
    side = session.stream("side")
    session.sync()
    base = live()
    w = meshd.ones(4, 4)
    h, b = side.borrow(w)
    others = [meshd.zeros(4) for _ in range(10)]
    v = w[0]  # a view of the borrowed storage
    del others, v
    gc.collect()
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        session.sync()  # its Release names v: BORROWED (the refs wait for the borrow's end)
    assert not [w for w in told if "releasing" in str(w.message)], [str(w.message) for w in told]
    b.drop()
    del h, b
    gc.collect()
    session.sync()
    assert live() == base + 1, "the tensors released with the view are still live"  # w
    del w
    gc.collect()
    session.sync()
    assert live() == base


def test_a_pipelined_release_naming_a_view_of_a_borrowed_tensor(session, mesh):
    """The same with the Release sent on a pipeline (its refusal comes to the reader
    thread: it was a warning, and the refs were forgotten)."""
    pb = session._pb

    def live():
        reply = session._unary("ListSessions", pb.ListSessionsRequest(), pb.ListSessionsReply)
        (row,) = [r for r in reply.sessions if r.session_id == session.id]
        return row.live_tensors
    side = session.stream("side")
    session.sync()
    base = live()
    w = meshd.ones(4, 4)
    h, b = side.borrow(w)
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        with session.pipeline():
            others = [meshd.zeros(4) for _ in range(10)]
            v = w[0]
            del others, v
            gc.collect()
            session.sync()  # the Release goes on the pipeline: BORROWED
    assert not [w for w in told if "BORROWED" in str(w.message)], [str(w.message) for w in told]
    b.drop()
    del h, b
    gc.collect()
    session.sync()
    assert live() == base + 1, "the tensors released with the view are still live"


# ------------------------------------------------------------ review-117

@pytest.mark.parametrize("fault", [_LostAnswer, Interrupt], ids=["deadline", "ctrl-c"])
def test_a_borrow_whose_answer_is_lost_does_not_pin_its_origin(server, monkeypatch, fault):
    """The server made the borrow and its answer was lost: the caller has no Borrow to
    drop, and the origin could never be dropped (BORROWED) until the session ended. The
    client now ends it (DropBorrow of the claimed ref) before its next command."""
    with meshd.connect(server[0], timeout=20) as s:
        with s.mesh(gpu=2).activate():
            x = meshd.ones(4)
            side = s.stream("side")
            s.sync()
            calls = _lose_execute_answers(s, monkeypatch, fault, "borrow")
            with pytest.raises((meshd.MeshdError, Interrupt)):
                side.borrow(x)
            monkeypatch.undo()
            assert calls, "the Borrow was not sent as a unary Execute"
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                x.drop()  # raised BORROWED
                s.sync()


def test_a_borrow_refused_before_the_server_made_it_sends_no_warning(server):
    """A Borrow whose Execute failed before the server ran it (UNAVAILABLE from the
    client's side, with no answer) may not exist: its DropBorrow refused UNKNOWN_REF
    is no news, and the session goes on without a warning."""
    with meshd.connect(server[0], timeout=20) as s:
        with s.mesh(gpu=2).activate():
            x = meshd.ones(4)
            side = s.stream("side")
            s.sync()
            real = s._unary

            def unsent(method, request, *a, **kw):
                if method == "Execute" and request.HasField("borrow"):
                    raise meshd.MeshdError("UNAVAILABLE", "connection reset (test)",
                                           grpc.StatusCode.UNAVAILABLE)
                return real(method, request, *a, **kw)
            s._unary = unsent
            with pytest.raises(meshd.MeshdError):
                side.borrow(x)
            del s._unary
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                x.drop()
                s.sync()


def test_a_refused_pipelined_borrow_sends_no_drop_borrow_warning(server):
    """A pipelined Borrow the server refused (here: a stream it never made) gives a
    Borrow object all the same; collected, it sent a DropBorrow for a borrow that never
    existed, and the next call warned "releasing 1 unused tensor ref(s) (a borrow)
    failed: UNKNOWN_REF"."""
    with meshd.connect(server[0], timeout=20) as s:
        with s.mesh(gpu=2).activate():
            x = meshd.ones(4)
            bogus = meshd.Stream(s, 999, "bogus")
            with pytest.raises(meshd.MeshdError):
                with s.pipeline():
                    h, b = bogus.borrow(x)
            del h, b
            gc.collect()
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                s.sync()
                x.drop()
                s.sync()
