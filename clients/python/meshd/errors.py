"""meshd.MeshdError: a rejected command or a run-time failure, with the server's kind."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import grpc

KIND_MD = "meshd-error-kind"

# Fallback when a status carries no kind trailer (e.g. the server is unreachable).
# With a trailer the kind is the server's: UNAUTHENTICATED (no or a wrong bearer token),
# PERMISSION_DENIED (another principal's session), NO_SESSION (closed or expired).
_CODE_KINDS = {
    grpc.StatusCode.UNAVAILABLE: "UNAVAILABLE",
    grpc.StatusCode.UNAUTHENTICATED: "NO_SESSION",
    grpc.StatusCode.PERMISSION_DENIED: "PERMISSION_DENIED",
    grpc.StatusCode.DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED",  # the client's deadline passed
}


class MeshdError(Exception):
    """An error reported by meshd. `.kind` is the ErrorKind name ("WRONG_MESH", ...),
    `.message` the server's message, `.code` the gRPC status code (or its number on
    errors reported inside a result), `.seq` the command seq when known. `.errors`: every
    error the call that raised it reported (a Sync, a pipeline), this one first."""

    def __init__(self, kind: str, message: str, code: grpc.StatusCode | int | None = None,
                 seq: int | None = None) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind, self.message, self.code, self.seq = kind, message, code, seq
        self.errors: list[MeshdError] = [self]

    @classmethod
    def of_kind(cls, kind: str, message: str, code: grpc.StatusCode | int | None = None,
                seq: int | None = None) -> MeshdError:
        """The error of `kind` as the class a Monarch user catches (see _BUILTIN)."""
        return _BUILTIN.get(kind, cls)(kind, message, code, seq)

    @classmethod
    def from_rpc(cls, e: Any) -> MeshdError:
        """From a grpc.RpcError that is also a grpc.Call (code, details, trailers)."""
        kind = None
        for k, v in (e.trailing_metadata() or ()):
            if k == KIND_MD:
                kind = v
        details = e.details() or ""
        if not kind:
            kind = _CODE_KINDS.get(e.code(), str(e.code().name))
            if details == "Deadline Exceeded":  # gRPC's own words: say whose deadline
                details = ("the call's deadline passed (the session's timeout, or the "
                           "timeout= given): Deadline Exceeded")
        return cls.of_kind(kind, details, e.code())

    @classmethod
    def from_error(cls, pb: Any, err: Any) -> MeshdError:
        """From an Error message of module `pb` (tensor_service_pb2)."""
        try:
            kind = pb.ErrorKind.Name(err.kind)
        except ValueError:  # a kind this client does not know (a newer server)
            kind = f"kind {err.kind}"
        if kind.startswith("ERROR_KIND_"):
            kind = kind[len("ERROR_KIND_"):]
        return cls.of_kind(kind, err.message, err.code, err.seq or None)


class MeshdTypeError(MeshdError, TypeError):
    """A mesh, stream or borrow check failed: Monarch raises TypeError for these."""


class MeshdValueError(MeshdError, ValueError):
    """An argument was wrong (shape, dtype, dim, ...): Monarch raises ValueError."""


# Kinds raised as both MeshdError and the builtin a Monarch user catches.
_BUILTIN = {k: MeshdTypeError for k in ("WRONG_MESH", "WRONG_STREAM", "DROPPED", "BORROWED",
                                        "MUTATING_BORROW")}
_BUILTIN.update({k: MeshdValueError for k in ("BAD_ARGUMENT", "SHAPE_MISMATCH",
                                              "DTYPE_MISMATCH", "BAD_DIM", "UNKNOWN_OP")})


# A session used in a process forked from the one that opened it (meshd/session.py).
FORKED = ("the session belongs to the parent process (this process is a fork of the one "
          "that connected, and shares its connection); call meshd.connect() again in the child")


class ForkedChannel:
    """A forked child's stand-in for its inherited gRPC channel: every call is refused
    with MeshdError NO_SESSION (FORKED) before anything is sent; close() does nothing."""

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise MeshdError("NO_SESSION", FORKED)

    unary_unary = unary_stream = stream_unary = stream_stream = _refuse
    subscribe = unsubscribe = _refuse

    def close(self) -> None:
        pass


def closed_channel(e):
    """Whether e is grpc's refusal to start a call on a closed channel (the session
    was closed): 'Cannot invoke RPC on closed channel!' (unary calls) or 'Cannot
    invoke RPC: Channel closed!' (streaming calls, grpcio 1.51)."""
    return isinstance(e, ValueError) and ("closed channel" in str(e)
                                          or "Channel closed" in str(e))


def transfers_full(e):
    """Whether a refused transfer (grpc.RpcError) only met --session-max-transfers: the
    session's own transfers in flight end soon (their threads read them), so the caller
    waits and tries again (meshd.tensor, fetch_shard) instead of failing."""
    return (e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "--session-max-transfers" in (e.details() or ""))


# What this thread's retry_transfers_full calls at their first refusal (on_transfers_full).
_slot_wait = threading.local()


@contextlib.contextmanager
def on_transfers_full(fn):
    """Within the block, this thread's retry_transfers_full calls fn() when it first
    finds the session's transfer slots all taken, before it waits: a fetch_shard's
    plan that waits so no longer holds back the session's commands that write no
    tensor (Session._fetch_parked). A thread-local, not a parameter, so that the
    calls between (Direct.fetch_plan, Direct.plan, the Fetch's start) keep theirs."""
    before = getattr(_slot_wait, "fn", None)
    _slot_wait.fn = fn
    try:
        yield
    finally:
        _slot_wait.fn = before


def retry_transfers_full(start, timeout):
    """start() again while it raises a grpc.RpcError for which transfers_full holds,
    waiting 5 ms, doubling to 200 ms, for at most `timeout` seconds (None: 60); then
    the error goes to the caller. At the first such refusal it tells the thread's
    on_transfers_full hook, if any."""
    import time
    deadline = time.monotonic() + (60 if timeout is None else timeout)
    wait = 0.005
    told = False
    while True:
        try:
            return start()
        except grpc.RpcError as e:
            if not transfers_full(e) or time.monotonic() + wait > deadline:
                raise
        if not told:
            told = True
            hook = getattr(_slot_wait, "fn", None)
            if hook is not None:
                hook()
        time.sleep(wait)
        wait = min(wait * 2, 0.2)
