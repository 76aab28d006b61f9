"""Session, Stream and Borrow: the client's connection to meshd."""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, Literal

import grpc

from . import _active, _catalogue, _conn, _proto
from . import direct as _direct
from .errors import FORKED, ForkedChannel, MeshdError, closed_channel
from .mesh import Mesh
from ._conn import Pem
from .pipeline import Pipeline, _Pending
from .tensor import Tensor, _drop_counts, _factory as _tensor_factory

DataPath = Literal["auto", "direct", "proxy"]

_SVC = "/meshd.v1.TensorService/"
_OPTIONS = [("grpc.enable_http_proxy", 0), ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20)]


def _ser(m):
    return m.SerializeToString()


_KEEPALIVE_DEADLINE = 5.0  # seconds one background KeepAlive may take
# Refs of garbage-collected handles sent in one Release command: the session
# sends one when this many are waiting, and before every Sync.
_RELEASE_BATCH = 256
# How a call failed when its command may not have reached the server (no kind of the
# server's): a Release that failed so is sent again (refs no longer live are skipped).
_TRANSPORT_KINDS = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED")
# Commands whose claimed refs are all tensors (a Release may name them).
_TENSOR_FIELDS = ("factory", "call", "reduce", "to_mesh", "literal", "load")


# Every Session of this process (a forked child's hook refuses their use there), and,
# in a forked child, the gRPC objects it inherited: kept for good, never closed or
# collected (a close or a channel's finalizer would act on the parent's connection).
_sessions: weakref.WeakSet = weakref.WeakSet()
_fork_kept: list = []
_used_grpc = False  # a Session was made in this process (its gRPC core is in use)
_no_fork_support = False  # a forked child of such a process, without gRPC's fork support


def _after_fork_in_child():
    global _no_fork_support
    for s in list(_sessions):
        s._forked()
    _sessions.clear()
    if _used_grpc:
        from grpc._cython import cygrpc
        _no_fork_support = not cygrpc.is_fork_support_enabled()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# fetch_shard Futures being planned at once, at most (Session._fetch_placing): the
# 4 shards of a fetch over 4 agents all at once, and no unbounded threads.
_PLACING_MAX = 8
# Commands that only define new objects, or wait (Sync): they cannot change the
# value of a tensor an earlier fetch_shard reads, so they need not wait for a fetch
# whose plan waits for a transfer slot (Session._execute). Calls and reduces are
# told apart by their message (_may_write); anything else (Drop, Borrow, DropBorrow,
# Release, a kind this client does not know) may end or change a tensor.
_DEFINES_ONLY = frozenset(("create_mesh", "slice_mesh", "create_stream", "factory", "literal",
                           "load", "to_mesh", "sync", "describe"))


def _may_write(field, msg):
    """Whether Command field `field` with message msg may change or end a tensor that
    exists: an op the catalogue marks as writing a parameter (in place, "(a!)"), an op
    it does not know, a Reduce in place or into out=, and every kind not in
    _DEFINES_ONLY."""
    if field in _DEFINES_ONLY:
        return False
    if field == "call":
        op = _catalogue.get(msg.op)
        return op is None or op.inplace or "!" in op.schema
    if field == "reduce":
        return msg.inplace or msg.out != 0
    return True


def _left(deadline):
    """Seconds until deadline (time.monotonic()), at least 0."""
    return max(0.0, deadline - time.monotonic())


# ListAgents' page_size: 0 takes the server's default page (4096 agents, so a pool of
# up to that many comes in one call); the tests set a smaller one to see every page
# followed. _AGENTS_MAX: past any server's --max-agents, a list that never ends.
_AGENTS_PAGE = 0
_AGENTS_MAX = 1 << 20


def _keepalive_period(ttl_seconds):
    """Seconds between background KeepAlives: a third of the lease, at least 0.25 s
    (a floor of 1 s made it the whole lease of a 1 s session, which then expired)."""
    return max(0.25, (ttl_seconds or 300) / 3.0)


def _keepalive_loop(session_ref, stop, period, call, request, metadata, timeout):
    """Body of a Session's keepalive thread. It holds the session only weakly, so a
    session dropped without close() is still collected (its finalizer sets `stop`)."""
    while not stop.wait(period):
        s = session_ref()
        if s is None or s.closed:
            return
        del s
        try:
            call(request, metadata=metadata, timeout=timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                return  # the session is gone (closed or expired): nothing left to keep
            # UNAVAILABLE and the like: the next period tries again
        except ValueError:
            return  # the channel was closed under us


class Stream:
    """A stream of a Session (Monarch's Stream). `session.default_stream` is "main" (ref 0).
    `meshd.Stream("name")` makes a new stream of the active mesh's session, as Monarch's
    Stream("name") does (session.stream("name") is the same)."""

    def __init__(self, session: Session | str, ref: int | None = None,
                 name: str | None = None) -> None:
        if isinstance(session, str) and ref is None:  # Monarch's Stream("name")
            made = _active.mesh().session.stream(session)
            session, ref, name = made.session, made.ref, made.name
            session._streams[ref] = self  # this object is the stream's handle
        self.session, self.ref, self.name = session, ref, name

    def __repr__(self) -> str:  # the ref: several streams may share a name, as in Monarch
        return f"Stream({self.name!r}, ref={self.ref})"

    def activate(self) -> contextlib.AbstractContextManager[Stream]:
        """Context manager making this the thread's active stream."""
        return _active.push("stream", self)

    def borrow(self, t: Tensor, mutable: bool = False) -> tuple[Tensor, Borrow]:
        """Borrows tensor t onto this stream: returns (handle usable here, Borrow)."""
        if not isinstance(t, Tensor):
            raise TypeError(f"meshd: borrow takes a Tensor, got {type(t).__name__}")
        s, pb = self.session, self.session._pb
        if t.session is not s:  # its ref would name another tensor (or none) here
            raise ValueError(f"meshd: {self!r} is of another session than the tensor to "
                             f"borrow; a tensor is borrowed onto a stream of its own session")
        box = {}

        def build(refs):
            box["refs"] = refs
            b = pb.Borrow(ref=refs[0], input=t.ref, stream=self.ref, borrow=refs[1])
            setattr(b, "mutable", bool(mutable))
            return b
        res = s._execute("borrow", build, claim=2)
        handle = Tensor._from_result(s, res, 0, box["refs"][0])
        return handle, Borrow(s, box["refs"][1], handle, t)


class Borrow:
    """A borrow made by Stream.borrow: `.handle` is the borrowed tensor on that stream.
    `with borrow:` drops it when the block ends, as Monarch's."""

    def __init__(self, session: Session, ref: int, handle: Tensor,
                 origin: Tensor | None = None) -> None:
        self.session, self.ref, self.handle = session, ref, handle
        # The borrowed tensor's handle stays alive (and unreleased) while the borrow is,
        # and the borrow while its handle is: collected together, the borrow is dropped
        # before the origin is released (Session._send_release).
        self._origin = origin
        handle._borrow = self
        self.dropped = False

    def __del__(self) -> None:
        try:
            if not self.dropped:
                p = self.handle._pending  # a pipelined Borrow's (_Pending, index), if unread
                if p is not None and p[0].done() and p[0]._error is not None:
                    return  # refused: there is no borrow to drop
                self.session._borrow_collected(self.ref, maybe=p is not None and not p[0].done())
        except Exception:  # noqa: BLE001 - interpreter shutdown, half-made objects
            pass

    def __enter__(self) -> Borrow:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.drop()

    def drop(self) -> None:
        """Ends the borrow; the borrowed handle becomes DROPPED."""
        if self.dropped:
            return
        pb = self.session._pb
        self.session._execute("drop_borrow", lambda _: pb.DropBorrow(borrow=self.ref))
        self.dropped = True
        self.session._borrow_ended()
        self.handle._dropped = True
        self.session._note_drop(self.handle)  # its views too
        self.handle._borrow = None
        self._origin = None


class Session:
    """A meshd session (use as a context manager, or call close()).

    While it is open, a daemon thread ("meshd-keepalive") sends KeepAlive every third of
    the session's ttl (the server's answer), never more often than every 0.25 s, so a
    session that makes no call for longer than its ttl stays alive; close() stops and
    joins it, and a session garbage-collected without close() stops it too. `timeout`
    (seconds) is the deadline of every call; sync() and fetch_shard() take their own.

    Security (connect() documents the arguments): the bearer token travels as
    `authorization: Bearer ...` metadata on every call, streams and KeepAlive included;
    it is never part of a repr or an exception message."""

    def __init__(self, addr: str, client_name: str = "meshd-python", ttl_seconds: int = 0,
                 quota_bytes: int = 0, timeout: float = 60.0, token: str | None = None,
                 tls: bool = False, root_certs: Pem = None, cert_chain: Pem = None,
                 private_key: Pem = None, server_name: str | None = None, insecure: bool = False,
                 data_path: DataPath = "auto") -> None:
        global _used_grpc
        if _no_fork_support:  # a new channel would hang, and break the parent's connection
            raise MeshdError("NO_SESSION", "this process was forked from one that connected, "
                             "and gRPC's fork support is off (a new connection would hang and "
                             "break the parent's): connect in a process started with "
                             "multiprocessing's 'spawn' or 'forkserver', or set "
                             "GRPC_ENABLE_FORK_SUPPORT=1 before the parent imports grpc")
        self._direct = _direct.Direct(self, data_path)  # checks data_path first
        creds = _conn.resolve(addr, token=token, tls=tls, root_certs=root_certs,
                              cert_chain=cert_chain, private_key=private_key,
                              server_name=server_name, insecure=insecure)
        self._pb = _proto.tensor_pb2()
        self.addr, self.timeout = addr, timeout
        self.tls = creds.tls
        self._auth = creds.auth_metadata()  # () without a token
        self._ch = _conn.open_channel(addr, creds, _OPTIONS)
        _used_grpc = True
        self._calls: dict = {}  # (method, reply class) -> grpc callable
        self._lock = threading.Lock()
        self._close_lock = threading.RLock()  # (a signal handler may close inside a close)
        self._ref = 0
        self._seq = 0
        # fetch_shard Futures whose place among the commands is not fixed yet (their
        # plan or Fetch not answered): commands wait for them (_wait_fetches_placed);
        # _parked of them wait for a transfer slot (only writing commands wait for those;
        # a server that plans them without a slot, FetchRequest.wait_for_slot, answers at
        # once: none park until 64 less --session-max-transfers of them wait).
        self._placing = self._parked = 0
        self._placed = threading.Condition(threading.Lock())
        self._meshes = {}
        self._streams = {}
        self._pipe = None  # the open Pipeline (session.pipeline()), if any
        # A block's Pipeline that ended before all its answers came (a server not reading:
        # flow control): its commands are still sent; every call waits for them first.
        self._drain = None
        # Refs of garbage-collected handles, and borrows collected undropped, not yet
        # sent: deques, appended to by __del__ in any thread, emptied by popleft.
        # Dropped storages (TensorMeta.storage -> the drop's marker: True, or a pipelined
        # Drop's _Pending), and dropped handles whose meta (their storage) is not in yet.
        self._dropped_storages: dict = {}
        self._drops_unresolved: list = []
        self._released: collections.deque[int] = collections.deque()
        self._unborrowed: collections.deque[int] = collections.deque()
        # Refs of Releases the server refused BORROWED (one names a view of a borrowed
        # tensor, and then nothing of it is released): sent again once a borrow ends.
        self._held: collections.deque[int] = collections.deque()
        # Borrows that may not exist (a Borrow whose answer was lost, a pipelined one
        # unanswered when collected): their DropBorrow refused UNKNOWN_REF is no news.
        self._maybe_borrows: set = set()
        self.closed = False
        self._fork_child = False  # this is a forked child's copy (_forked)
        _sessions.add(self)
        pb = self._pb
        try:
            reply = self._unary("CreateSession", pb.CreateSessionRequest(
                client_name=client_name, ttl_seconds=ttl_seconds, quota_bytes=quota_bytes),
                pb.CreateSessionReply, metadata=())
        except BaseException:  # (KeyboardInterrupt too: the channel is ours to close)
            self._ch.close()
            raise
        try:
            self._open(reply)
        except BaseException:  # Ctrl-C or an error during ListOps or the catalogue's load
            self._abandon()
            raise

    def _open(self, reply):
        """The rest of __init__ once CreateSession answered."""
        pb = self._pb
        self.id, self._token = reply.session_id, reply.token
        self.ttl_seconds = reply.ttl_seconds
        # Small tensors go as Literal commands to a server that takes them (meshd.tensor);
        # False once one was refused for an agent older than the command.
        self._literals = "literal" in reply.features
        # Every call of the session sends this (Upload, Fetch, Submit and KeepAlive too).
        self._md = self._auth + (("meshd-session", self.id), ("meshd-token", self._token))
        self.default_stream = Stream(self, 0, "main")
        self._streams[0] = self.default_stream
        try:  # the op catalogue: t.<op> and meshd.ops.<op> know their names and schemas
            _catalogue.load(self._unary("ListOps", pb.ListOpsRequest(), pb.ListOpsReply,
                                        metadata=()))
        except MeshdError as e:  # not fatal: without it any name goes to the server
            if e.code != grpc.StatusCode.UNIMPLEMENTED:  # (an older server has no ListOps)
                warnings.warn(f"meshd: the op catalogue could not be read ({e}); op names "
                              f"are checked by the server only", RuntimeWarning, stacklevel=3)
        self._start_keepalive()

    def _abandon(self):
        """__init__ failed after CreateSession: the session is closed now, not left
        alive until its lease runs out, and the channel with it."""
        self.closed = True
        try:
            ka = getattr(self, "_ka_stop", None)
            if ka is not None:
                ka.set()
            if getattr(self, "_md", None) is not None:
                self._unary("CloseSession", self._pb.CloseSessionRequest(),
                            self._pb.CloseSessionReply,
                            timeout=min(self.timeout, _KEEPALIVE_DEADLINE))
        except Exception:  # noqa: BLE001 - best effort: the lease ends it otherwise
            pass
        finally:
            self._direct.close()
            self._ch.close()

    def _forked(self):
        """In a forked child (os.register_at_fork): the session is the parent's, and so
        is its connection (socket, poller), used by threads the child does not have.
        Every later use raises MeshdError NO_SESSION (FORKED); close(), handles
        collected and the session's finalizers send nothing and close nothing."""
        self.closed = True
        self._fork_child = True
        # Locks another thread may have held at the fork (the child has no such thread).
        self._lock, self._close_lock = threading.Lock(), threading.RLock()
        self._placing = self._parked = 0
        self._placed = threading.Condition(threading.Lock())
        _fork_kept.append((self._ch, self._calls, self._pipe, self._drain,
                           self._direct._forked()))
        self._ch, self._calls = ForkedChannel(), {}
        self._pipe = self._drain = None
        self._released.clear()
        self._unborrowed.clear()
        self._held.clear()

    def _closed_error(self):
        """The MeshdError of a call on a closed session (or a forked child's copy)."""
        return MeshdError("NO_SESSION", FORKED if self._fork_child else "the session is closed")

    def _start_keepalive(self):
        period = _keepalive_period(self.ttl_seconds)
        pb = self._pb
        call = self._ch.unary_unary(_SVC + "KeepAlive", request_serializer=_ser,
                                    response_deserializer=pb.KeepAliveReply.FromString)
        self._ka_stop = threading.Event()
        self._ka_thread = threading.Thread(
            target=_keepalive_loop, name="meshd-keepalive", daemon=True,
            args=(weakref.ref(self), self._ka_stop, period, call, pb.KeepAliveRequest(), self._md,
                  min(self.timeout, _KEEPALIVE_DEADLINE)))
        weakref.finalize(self, self._ka_stop.set)
        # ... and its direct fetches' io loop (a thread running forever, with its
        # channels): the loop holds nothing of the session, so it can be ended here.
        weakref.finalize(self, self._direct._io.close).atexit = False
        self._ka_thread.start()

    def _stop_keepalive(self):
        self._ka_stop.set()
        if self._ka_thread is not threading.current_thread():
            # At most the KeepAlive in flight; the thread ends right after it in any case.
            self._ka_thread.join(_KEEPALIVE_DEADLINE + 1.0)

    def __repr__(self) -> str:
        state = "closed" if getattr(self, "closed", False) else "open"
        return (f"Session(addr={self.addr!r}, id={getattr(self, 'id', None)!r}, tls={self.tls}, "
                f"token={'set' if self._auth else None}, {state})")

    # ------------------------------------------------------------ plumbing
    def _unary(self, method, request, reply_cls, metadata=None, timeout=None):
        """One unary call with the session's metadata, or with `metadata` (() for calls
        outside the session); the bearer token goes with either."""
        key = (method, reply_cls)
        fn = self._calls.get(key)
        if fn is None:  # one callable per method: making one costs as much as a small call
            fn = self._calls[key] = self._ch.unary_unary(
                _SVC + method, request_serializer=_ser, response_deserializer=reply_cls.FromString)
        try:
            return fn(request, metadata=self._md if metadata is None else self._auth + tuple(metadata),
                      timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as e:
            raise MeshdError.from_rpc(e) from None
        except ValueError as e:  # grpc's refusal on a channel close() closed
            if not closed_channel(e):
                raise
            raise MeshdError("NO_SESSION", "the session is closed") from None

    def _execute(self, field, build, claim=0, timeout=None):
        """Runs one Command under the session lock: `build` gets the claimed ref (claim=1),
        a list of refs (claim>1) or None, and returns the message for `field`. `timeout`
        (seconds, default the session's) is the deadline of all the call waits for: the
        pipelined answers before it, the fetch_shard plans before it, its room in the
        pipeline, the unary call."""
        if self.closed:
            raise self._closed_error()
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._lock:
            # (the refs it will claim: only a holder of this lock claims refs)
            refs = [self._ref + i + 1 for i in range(claim)]
            msg = build(refs[0] if claim == 1 else (refs or None))
            writes = _may_write(field, msg)
            self._wait_fetches_placed(deadline, writes)
            pipe = self._pipe
            mine = pipe is not None and pipe.owner == threading.get_ident()
            self._flush_drain(_left(deadline))
            if pipe is not None and not mine:
                pipe.flush(_left(deadline))  # keep refs reaching the server in order
            if mine and field == "sync":
                pipe.flush(_left(deadline))
            if (len(self._released) >= _RELEASE_BATCH or self._unborrowed
                    or (field == "sync" and self._released)) and (writes or not self._placing):
                # (a Release or DropBorrow ends tensors: with a fetch still waiting for
                # its plan, one goes with a later command that waited for it)
                self._send_release(pipe if mine else None)
            self._ref += claim
            self._seq += 1
            if getattr(msg, "packed_command", False):  # meshd.tensor's Literal, packed by hand
                cmd, cmd.seq = msg, self._seq
            else:
                cmd = self._pb.Command(seq=self._seq)
                getattr(cmd, field).CopyFrom(msg)
            if mine:
                try:  # a _Pending: its fields block until answered
                    return pipe.send(cmd, timeout=_left(deadline))
                except MeshdError:  # not queued: its refs and seq are not taken
                    self._ref -= claim
                    self._seq -= 1
                    raise
            try:
                return self._unary("Execute", cmd, self._pb.CommandResult,
                                   timeout=_left(deadline))
            except BaseException as e:
                # No answer of the server's (a deadline, a dropped connection, Ctrl-C): it
                # may have defined the tensors and the answer been lost; nobody else can
                # release them (a Release skips refs that are not live).
                if refs and field in _TENSOR_FIELDS and (
                        not isinstance(e, MeshdError) or (e.kind in _TRANSPORT_KINDS and
                                                          isinstance(e.code, grpc.StatusCode))):
                    for r in refs:
                        self._release_later(r)
                if field == "borrow" and (not isinstance(e, MeshdError) or (
                        e.kind in _TRANSPORT_KINDS and isinstance(e.code, grpc.StatusCode))):
                    # the server may have made the borrow (its origin then undroppable):
                    # a DropBorrow ends it, or is refused UNKNOWN_REF if it never was
                    self._borrow_collected(refs[1], maybe=True)
                raise

    def _fetch_placing(self, deadline):
        """A fetch_shard's place among the commands is being fixed (its plan or Fetch
        sent from its own thread; _fetch_placed() once answered or failed). At most
        _PLACING_MAX at once: beyond, the caller waits here (by deadline: MeshdError
        DEADLINE_EXCEEDED) as it waited for each plan before, instead of a thread per
        fetch polling for the session's transfer slots (--session-max-transfers)."""
        with self._placed:
            while self._placing >= _PLACING_MAX:
                if not self._placed.wait(_left(deadline)) and time.monotonic() >= deadline:
                    raise MeshdError("DEADLINE_EXCEEDED", f"fetch_shard: {_PLACING_MAX} fetches "
                                     "were still being planned at its deadline",
                                     grpc.StatusCode.DEADLINE_EXCEEDED)
            self._placing += 1

    def _fetch_parked(self):
        """A fetch being placed found the session's transfer slots all taken: its plan
        waits for one of the session's transfers to be read to its end."""
        with self._placed:
            self._parked += 1
            self._placed.notify_all()

    def _fetch_placed(self, parked=False):
        """A fetch is placed (or failed); parked: it was _fetch_parked."""
        with self._placed:
            self._placing -= 1
            self._parked -= 1 if parked else 0
            self._placed.notify_all()

    def _wait_fetches_placed(self, deadline, writes=True):
        """Waits (the caller holds self._lock, by deadline) until every fetch_shard
        before this command has its plan or Fetch answered: the server snapshots the
        tensor then, and a command sent before could change the value fetched. The
        fetches' own threads plan them, all at once, so fetch_shard returns at once
        (4 shards' plans one after another were 12% of a 64 MiB fetch). A command that
        writes no tensor (writes=False: _may_write) does not wait for the fetches
        whose plans wait for a transfer slot, which may take as long as the reads
        before them (16 big fetches with 8 slots: an add waited for 8 whole reads and
        failed DEADLINE_EXCEEDED); it waits for the plans in flight, quick, so the
        fetch's snapshot comes before it and does not wait for its work."""
        with self._placed:
            while self._placing - (0 if writes else self._parked) > 0:
                if not self._placed.wait(_left(deadline)) and time.monotonic() >= deadline:
                    slots = (f"; {self._parked} of them wait for a transfer slot "
                             f"(--session-max-transfers), which the transfers before them "
                             f"hold until read" if self._parked else "")
                    raise MeshdError("DEADLINE_EXCEEDED", "the command waited past its deadline "
                                     "for the fetches before it to be planned (fetch_shard)"
                                     + slots, grpc.StatusCode.DEADLINE_EXCEEDED)

    def _release_later(self, ref):
        """A handle of ref was garbage-collected (Tensor.__del__): the ref joins the next
        Release command. Only an append: __del__ may run in any thread, at any time."""
        if not self.closed:
            self._released.append(ref)

    def _borrow_collected(self, ref, maybe=False):
        """A Borrow was garbage-collected undropped (with its handle: the handle keeps
        it): a DropBorrow goes before the next Release, which may name its origin.
        maybe: the borrow may not exist (its DropBorrow refused UNKNOWN_REF is quiet)."""
        if not self.closed:
            if maybe:
                self._maybe_borrows.add(ref)
            self._unborrowed.append(ref)

    def _send_release(self, pipe):
        """DropBorrow of every collected borrow, then Release commands of every waiting
        ref, _RELEASE_BATCH at most each (a server takes --max-command-refs), in order
        with the session's other commands (the caller holds self._lock). It is
        housekeeping: a refusal is a warning, never an exception in the unrelated call
        that happened to send it."""
        pb = self._pb
        cmds = []
        if self._unborrowed:  # borrows end here: what they held goes after them
            self._borrow_ended()
        while self._unborrowed:
            self._seq += 1
            cmds.append(("borrow", pb.Command(seq=self._seq, drop_borrow=pb.DropBorrow(
                borrow=self._unborrowed.popleft()))))
        while self._released:
            refs = [self._released.popleft()
                    for _ in range(min(_RELEASE_BATCH, len(self._released)))]
            self._seq += 1
            cmds.append(("refs", pb.Command(seq=self._seq, release=pb.Release(refs=refs))))
        for i, (what, cmd) in enumerate(cmds):
            try:
                if pipe is not None:
                    p = pipe.send(cmd, quiet=True)
                    if what == "borrow" and cmd.drop_borrow.borrow in self._maybe_borrows:
                        self._maybe_borrows.discard(cmd.drop_borrow.borrow)
                        p._unknown_ok = True  # refused UNKNOWN_REF: it never existed
                    if what == "refs":  # refused BORROWED: held (the reader thread's)
                        p._refused_borrowed = lambda refs=list(cmd.release.refs): (
                            self._held.extend(refs))
                        p._taken_out = lambda refs=list(cmd.release.refs): (
                            self._released.extend(refs))
                    else:  # (a borrow that may not exist stays so)
                        p._taken_out = lambda b=cmd.drop_borrow.borrow, maybe=p._unknown_ok: (
                            self._borrow_collected(b, maybe))
                else:
                    self._unary("Execute", cmd, pb.CommandResult)
                    if what == "borrow":
                        self._maybe_borrows.discard(cmd.drop_borrow.borrow)
            except MeshdError as e:
                if pipe is not None or (e.kind in _TRANSPORT_KINDS
                                        and isinstance(e.code, grpc.StatusCode)):
                    # Not sent (a send raises only then), or perhaps not: this one and
                    # those after it go with a later call (a ref released twice is skipped).
                    for kind, later in reversed(cmds[i:]):
                        if kind == "borrow":
                            self._unborrowed.appendleft(later.drop_borrow.borrow)
                        else:
                            self._released.extendleft(reversed(later.release.refs))
                    return
                if what == "refs" and e.kind == "BORROWED":
                    self._held.extend(cmd.release.refs)  # they go once a borrow ends
                    continue
                if what == "borrow" and cmd.drop_borrow.borrow in self._maybe_borrows:
                    self._maybe_borrows.discard(cmd.drop_borrow.borrow)
                    if e.kind == "UNKNOWN_REF":
                        continue  # the borrow never was: nothing to drop
                n = len(cmd.release.refs) if what == "refs" else 1
                warnings.warn(f"meshd: releasing {n} unused tensor ref(s)"
                              f"{' (a borrow)' if what == 'borrow' else ''} failed: {e}",
                              RuntimeWarning, stacklevel=3)

    def _borrow_ended(self):
        """A borrow ended: the refs held back by a BORROWED Release go with the next one."""
        while self._held:
            self._released.append(self._held.popleft())

    def _flush_pipeline(self, timeout=None):
        """Waits for every pipelined answer (before Upload/Fetch, which are other RPCs),
        `timeout` seconds in all at most (None: the session's timeout)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        self._flush_drain(_left(deadline))
        pipe = self._pipe
        if pipe is not None:
            pipe.flush(_left(deadline))

    def _flush_drain(self, timeout):
        """Waits for the answers of a block that ended without them (Session._drain):
        its commands go before any later one. MeshdError DEADLINE_EXCEEDED past timeout."""
        d = self._drain
        if d is not None:
            d.flush(timeout)
            if self._drain is d:
                self._drain = None

    def _note_drop(self, t) -> None:
        """t was dropped: its storage, and so every alias of it, is."""
        if t._pending is None:
            if t._storage:
                self._dropped_storages[t._storage] = t._dropped
        else:
            self._drops_unresolved.append(t)

    def _storage_dropped(self, storage) -> bool:
        """Whether a drop of any alias of storage counts (Tensor.dropped)."""
        pending, self._drops_unresolved = self._drops_unresolved, []
        for t in pending:
            try:
                t._resolve()
            except MeshdError:  # its command was refused: nothing to drop
                continue
            self._note_drop(t)
        d = self._dropped_storages.get(storage) if storage else None
        return d is not None and _drop_counts(d)

    def _new_ref(self):
        """A fresh ref; callers that send it must hold self._lock across the send."""
        self._ref += 1
        return self._ref

    def _mesh_from(self, meta):
        m = Mesh(self, meta)
        self._meshes[m.ref] = m
        return m

    def _factory(self, kind, shape, **kw):
        """A Factory command's Tensor (meshd.tensor._factory): how a Mesh, whose module sits
        below meshd.tensor, makes tensors (Mesh.rank)."""
        return _tensor_factory(kind, shape, **kw)

    # ------------------------------------------------------------ public
    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        try:  # the block's own exception wins over close()'s (the server may be gone)
            self.close()
        except MeshdError as e:
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(f"meshd: closing the session failed too: {e!r}")

    def close(self) -> None:
        # One close at a time: a second thread waits for the first's, then finds it closed
        # (it sent CloseSession again and raised NO_SESSION).
        with self._close_lock:
            if self.closed:
                return
            self._stop_keepalive()
            try:
                self._unary("CloseSession", self._pb.CloseSessionRequest(),
                            self._pb.CloseSessionReply)
            finally:
                self.closed = True
                self._direct.close()
                self._ch.close()

    @contextlib.contextmanager
    def pipeline(self) -> Iterator[Pipeline]:
        """Pipelined mode: inside the block commands are sent on one Submit stream without
        waiting; tensors come back at once and get their metadata when the answer
        arrives. At the end every answer is awaited and the first rejection is raised
        as MeshdError (see meshd/pipeline.py). Only the opening thread pipelines; a block
        nested in it joins it (its commands are the outer block's, answered at its end),
        as Monarch's coalescing blocks nest."""
        if self.closed:
            raise self._closed_error()
        with self._lock:  # one check and one pipeline: another thread waits for this one
            outer = self._pipe
            if outer is not None and outer.owner != threading.get_ident():
                raise RuntimeError("meshd: another thread has a pipeline open on this session")
            if outer is None:
                self._flush_drain(self.timeout)
                try:
                    pipe = self._pipe = Pipeline(self)
                except ValueError as e:  # close() (another thread) closed the channel
                    if not closed_channel(e):
                        raise
                    raise MeshdError("NO_SESSION", "the session is closed") from None
        if outer is not None:
            yield outer
            return
        failed = None
        try:
            yield pipe
        except BaseException as e:
            failed = e
            raise
        finally:
            errs = None
            # A forked child leaving a block opened before the fork: its answers come to
            # the parent's threads alone (the parent's block awaits them), none to wait for.
            if not self._fork_child:
                with self._lock:
                    if self._pipe is pipe:
                        self._pipe = None
                    try:
                        errs = pipe.close()
                    finally:  # (Ctrl-C in close's wait too: what is queued still goes first)
                        if pipe.unanswered():  # the server is not reading: they still go
                            self._drain = pipe
            if errs:
                errs[0].errors = errs
                if failed is None:
                    raise errs[0]
                # The block's own exception wins; the deferred errors go with it.
                if failed.__context__ is None:
                    failed.__context__ = errs[0]
                elif hasattr(failed, "add_note"):  # Python 3.11+
                    failed.add_note(f"meshd: the pipeline block also had: {errs[0]!r}"
                                    + (f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""))

    def agents(self) -> list[dict[str, Any]]:
        """[{rank, address, device, memory_bytes, allocated_bytes, healthy, drained}, ...]"""
        agents, _ = self._list_agents()
        return [dict(rank=a.rank, address=a.address, device=a.device, memory_bytes=a.memory_bytes,
                     allocated_bytes=a.allocated_bytes, healthy=a.healthy, drained=a.drained)
                for a in agents]

    def _list_agents(self, timeout=None):
        """(every agent, the last page's reply) from ListAgents, which is paged: each
        next_page_token is followed to the last page (the reply's agent_tls is the same
        on every page). timeout (seconds, default the session's) bounds all the pages
        together. A server that answers a page with nothing, or the token it was sent,
        and says more follow, is leading the client on: INTERNAL, not a loop."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        agents, token = [], ""
        while True:
            reply = self._unary("ListAgents", self._pb.ListAgentsRequest(
                page_size=_AGENTS_PAGE, page_token=token), self._pb.ListAgentsReply,
                metadata=(), timeout=_left(deadline))
            agents += reply.agents
            if not reply.next_page_token:
                return agents, reply
            why = ("the same next_page_token again" if reply.next_page_token == token
                   else "an empty page with a next_page_token" if not reply.agents
                   else f"over {_AGENTS_MAX} agents" if len(agents) > _AGENTS_MAX else None)
            if why:
                raise MeshdError("INTERNAL", f"ListAgents: the server's pages do not end ({why})")
            token = reply.next_page_token

    def server_info(self) -> dict[str, Any]:
        """The server's build and uptime, and the version every agent reported (GetInfo):
        {version, commit, build_type, cuda, uptime_ms, agents: [{rank, version, commit,
        build_type, cuda}, ...]}, agents in rank order. GetInfo holds a pool's first 1024
        agents only (agents_truncated): a larger pool's come from ListAgents' pages."""
        r = self._unary("GetInfo", self._pb.GetInfoRequest(), self._pb.GetInfoReply, metadata=())
        agents = self._list_agents()[0] if r.agents_truncated else r.agents
        return dict(version=r.version, commit=r.commit, build_type=r.build_type, cuda=r.cuda,
                    uptime_ms=r.uptime_ms,
                    agents=[dict(rank=a.rank, version=a.version, commit=a.commit,
                                 build_type=a.build_type, cuda=a.cuda) for a in agents])

    def mesh(self, **dims: int) -> Mesh:
        """A root mesh, e.g. session.mesh(host=1, gpu=2)."""
        if not dims:
            raise ValueError("meshd: a mesh needs at least one dim, e.g. mesh(gpu=2)")
        for n, s in dims.items():
            if isinstance(s, bool) or not isinstance(s, int):
                raise TypeError(f"meshd: dim {n!r} size must be an int, got {type(s).__name__}")
        pb = self._pb
        meta = self._execute("create_mesh", lambda ref: pb.CreateMesh(
            ref=ref, dims=[pb.Dim(name=n, size=s) for n, s in dims.items()]), claim=1).mesh
        return self._mesh_from(meta)

    def stream(self, name: str) -> Stream:
        """A new stream of this session (Monarch's Stream(name)); activate() it to use it."""
        pb = self._pb
        box = {}

        def build(ref):
            box["ref"] = ref
            return pb.CreateStream(ref=ref, name=name)
        res = self._execute("create_stream", build, claim=1)
        if isinstance(res, _Pending):  # pipelined: its answer, within the session's timeout
            res.result()
        s = Stream(self, box["ref"], name)
        self._streams[s.ref] = s
        return s

    def sync(self, timeout: float | None = None) -> None:
        """Waits for everything issued so far; raises the first run-time error not
        reported before (a MeshdError; its `.errors` lists all this Sync reported).
        timeout: seconds to wait (default: the session's timeout); past it the Sync
        raises MeshdError kind DEADLINE_EXCEEDED (the work it waited for goes on)."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit  # for all it waits for, pipelined answers too
        res = self._execute("sync", lambda _: self._pb.Sync(), timeout=limit)
        if isinstance(res, _Pending):  # pipelined: wait for its answer, as long as unary would
            res = res.result(_left(deadline))
        if res.errors:
            errors = [MeshdError.from_error(self._pb, e) for e in res.errors]
            errors[0].errors = errors  # every error this Sync reported, the first raised
            raise errors[0]


def get_active_stream() -> Stream:
    """This thread's active stream: the innermost `stream.activate()`, else the active
    mesh's session's default stream "main"."""
    s = _active.current("stream")
    return s if s is not None else _active.mesh().session.default_stream


def connect(addr: str, token: str | None = None, tls: bool = False, root_certs: Pem = None,
            cert_chain: Pem = None, private_key: Pem = None, insecure: bool = False,
            data_path: DataPath = "auto", *, client_name: str = "meshd-python",
            ttl_seconds: int = 0, quota_bytes: int = 0, timeout: float = 60.0,
            server_name: str | None = None) -> Session:
    """Opens a Session on the meshd server at addr ("host:port").

    token: the bearer token (default $MESHD_TOKEN; "" for none), sent on every call.
    tls: TLS with the system's roots (also $MESHD_TLS=1). root_certs: the CA that
    verifies the server (default $MESHD_TLS_CA). cert_chain + private_key: a client
    certificate for mTLS (default $MESHD_TLS_CERT, $MESHD_TLS_KEY). Each of them takes
    PEM bytes or a file path, and implies tls=True. server_name: the name checked in the
    server's certificate instead of addr's host (default $MESHD_TLS_SERVER_NAME).
    A token is not sent in plaintext to a non-loopback address: ValueError, unless
    insecure=True. data_path: how tensor bytes move: "auto" (default) streams them
    straight to and from the agents when the server offers it, the agents' port is
    TLS (cluster mTLS) or the session is not, and the agents answer within 1 s, else
    through the server; "direct" always straight (MeshdError if it cannot);
    "proxy" always through the server (meshd/direct.py). client_name names the session
    in the server's logs; ttl_seconds its lease (0: the server's default), quota_bytes
    its memory quota (0: the server's), timeout (seconds) every call's deadline."""
    return Session(addr, token=token, tls=tls, root_certs=root_certs, cert_chain=cert_chain,
                   private_key=private_key, insecure=insecure, data_path=data_path,
                   client_name=client_name, ttl_seconds=ttl_seconds, quota_bytes=quota_bytes,
                   timeout=timeout, server_name=server_name)
