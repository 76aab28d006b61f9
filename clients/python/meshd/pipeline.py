"""Pipelined mode: `with session.pipeline():` sends commands on one Submit stream
without waiting for their answers (DESIGN.md §6).

Design (the simplest correct one):
- Refs are chosen by the client, so a command's result refs are known at send time.
  Ops inside the block return Tensor handles at once; their metadata (shape, dtype,
  mesh, stream) is filled in from the answer when it arrives. Reading `.shape` etc.
  before then blocks until that one answer is in (and raises its MeshdError if the
  command was rejected).
- Commands whose answer the client needs right away (mesh, slice, stream creation)
  just wait for their own answer; they still travel on the stream, in order.
- Upload, Fetch and Sync first flush: wait for every answer sent so far (Upload and
  Fetch are separate RPCs, so this keeps refs reaching the server in order).
- Rejections are collected; at the end of the block every answer is awaited, the
  stream is closed, and the first rejection (lowest seq) is raised as MeshdError
  (all of them in its `.errors`). Asynchronous run-time errors the server reports on
  the stream (seq 0) are raised the same way, after rejections.
- Only the thread that opened the pipeline uses it; other threads keep using unary
  Execute, after flushing the pipeline so refs stay in order.
"""

import queue
import threading
import warnings

import grpc

from .errors import MeshdError

_SVC = "/meshd.v1.TensorService/"
_END = object()
_BATCH_MAX = 1024  # commands per Submit message (the server takes up to 4096)
# Bytes per Submit message past which a batch ends (Literal commands carry up to
# 1 MiB each; the server takes messages up to its --max-message-bytes, 4 MiB).
_BATCH_BYTES = 1 << 20
# What the Literals of one message may send to the agents together (a replicated
# one sends its bytes to every rank): the server's LITERAL_MAX_SENT_BYTES.
_BATCH_SENT = 8 << 20
_BATCH_TAG = bytes([(30 << 3) | 2, 1])  # Command.batch = 30, length-delimited (a 2-byte varint)


def _varint(n):
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _batch(packed):
    """A Command{batch: [...]} from its commands, each already serialized: the
    repeated field is their bytes, each behind its tag and length."""
    return b"".join(_BATCH_TAG + _varint(len(c)) + c for c in packed)


class _Pending:
    """The answer to one pipelined command; attribute reads block until it arrived."""

    __slots__ = ("seq", "_event", "_result", "_error", "_quiet")

    def __init__(self, seq):
        self.seq = seq
        self._quiet = False
        self._event = threading.Event()
        self._result = None
        self._error = None

    def _set(self, result=None, error=None):
        self._result, self._error = result, error
        self._event.set()

    def done(self):
        return self._event.is_set()

    def wait(self, timeout=None):
        if not self._event.wait(timeout):
            raise MeshdError("DEADLINE_EXCEEDED", f"no answer to pipelined command seq "
                             f"{self.seq} within {timeout} s", grpc.StatusCode.DEADLINE_EXCEEDED,
                             self.seq)

    def result(self, timeout=None):
        """The CommandResult; raises the command's MeshdError if it was rejected."""
        self.wait(timeout)
        if self._error is not None:
            raise self._error
        return self._result

    # the fields callers of Session._execute read
    @property
    def tensors(self):
        return self.result().tensors

    @property
    def mesh(self):
        return self.result().mesh

    @property
    def errors(self):
        return self.result().errors


class Pipeline:
    """One open Submit stream of a Session; made by Session.pipeline()."""

    def __init__(self, session):
        self.session = session
        self.owner = threading.get_ident()
        self._q = queue.Queue()
        self._pending = {}          # seq -> _Pending, not yet answered
        self._plock = threading.Lock()
        self._errors = []           # rejections (MeshdError), in order of arrival
        self._async_errors = []     # seq-0 reports
        self._broken = None         # MeshdError when the stream itself failed
        pb = session._pb
        fn = session._ch.stream_stream(_SVC + "Submit",
                                       request_serializer=lambda b: b,  # queued packed
                                       response_deserializer=pb.SubmitReply.FromString)
        self._call = fn(self._requests(), metadata=session._md)
        self._reader = threading.Thread(target=self._read, name="meshd-pipeline", daemon=True)
        self._reader.start()

    def _requests(self):
        """The Submit stream's messages: whatever is queued when gRPC asks for the next
        one goes as one batch Command (up to _BATCH_MAX), so a fast caller sends few
        messages and a slow one loses no time waiting for a batch to fill."""
        carry = None  # the (packed command, bytes it sends) that did not fit the last batch
        while True:
            m, carry = (carry, None) if carry is not None else (self._q.get(), None)
            if m is _END:
                return
            batch, size, sent, end = [m[0]], len(m[0]), m[1], False
            while len(batch) < _BATCH_MAX and size < _BATCH_BYTES:
                try:
                    m = self._q.get_nowait()
                except queue.Empty:
                    break
                if m is _END:
                    end = True
                    break
                if size + len(m[0]) > _BATCH_BYTES or sent + m[1] > _BATCH_SENT:
                    carry = m
                    break
                batch.append(m[0])
                size, sent = size + len(m[0]), sent + m[1]
            yield batch[0] if len(batch) == 1 else _batch(batch)
            if end:
                return

    def _read(self):
        pb = self.session._pb
        try:
            for reply in self._call:
                if reply.results:  # a batch's answers
                    for res in reply.results:
                        self._answer(pb, res)
                else:
                    self._answer(pb, reply.result)
        except grpc.RpcError as e:
            self._broken = MeshdError.from_rpc(e)
        except Exception as e:  # noqa: BLE001 - reported to every waiter
            self._broken = MeshdError("UNAVAILABLE", f"pipeline reader failed: {e!r}")
        finally:
            err = self._broken or MeshdError("UNAVAILABLE", "the Submit stream ended before "
                                             "answering every command")
            with self._plock:
                left, self._pending = list(self._pending.values()), {}
            for p in left:
                p._set(error=err)

    def _answer(self, pb, res):
        if res.seq == 0:
            if res.HasField("error"):
                self._async_errors.append(MeshdError.from_error(pb, res.error))
            return
        with self._plock:
            p = self._pending.pop(res.seq, None)
        if p is None:
            return
        if res.HasField("error") and res.error.kind != 0:
            e = MeshdError.from_error(pb, res.error)
            e.seq = res.seq
            if e.kind == "UNAVAILABLE" and "predates the Literal" in e.message:
                self.session._literals = False  # an older agent: later tensors upload
            if not p._quiet:
                self._errors.append(e)
            else:
                warnings.warn(f"meshd: {e}", RuntimeWarning, stacklevel=1)
            p._set(error=e)
        else:
            p._set(result=res)

    def send(self, cmd, quiet=False):
        """Queues one Command (its seq set); returns its _Pending. quiet: a rejection
        is not raised at the end of the block (the session's Release housekeeping)."""
        if self._broken is not None:
            raise self._broken
        p = _Pending(cmd.seq)
        p._quiet = quiet
        with self._plock:
            self._pending[cmd.seq] = p
        if not self._reader.is_alive():
            with self._plock:
                self._pending.pop(cmd.seq, None)
            raise self._broken or MeshdError("UNAVAILABLE", "the Submit stream is closed")
        self._q.put((cmd.SerializeToString(), getattr(cmd, "sent", 0)))
        return p

    def flush(self, timeout=None):
        """Waits for the answer to every command sent so far (errors stay deferred)."""
        with self._plock:
            waiting = list(self._pending.values())
        for p in waiting:
            p.wait(timeout if timeout is not None else self.session.timeout)

    def close(self):
        """Flushes, ends the stream; returns the deferred errors (rejections first)."""
        try:
            self.flush()
        finally:
            self._q.put(_END)
            self._reader.join(self.session.timeout)
            if self._reader.is_alive():
                self._call.cancel()
                self._reader.join(5)
        errs = sorted(self._errors, key=lambda e: e.seq or 0) + self._async_errors
        if not errs and self._broken is not None and self._broken.code != grpc.StatusCode.OK:
            errs = [self._broken]
        return errs
