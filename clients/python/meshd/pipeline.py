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
  the stream (seq 0) are raised the same way, after rejections, then the stream's own
  failure. A rejection the caller already got (reading a handle) is not raised again.
- Flow control: a server that stops reading the stream (--session-max-queued) makes
  the client's queue fill; it is bounded (_QUEUE_MAX commands, _QUEUE_BYTES), and a
  command that finds it full waits for room up to the session's timeout (room comes
  when those queued go out or reach their deadlines), then raises DEADLINE_EXCEEDED
  without being queued (its ref is not taken). A command still in
  the client's queue at its own deadline (its call's start plus the session's timeout,
  or the call's) is taken out of it there, as the Node client does: by the pipeline's
  one timer thread, whichever thread waits for its answer, or none. It was never sent,
  so it did not run: reading its handle raises DEADLINE_EXCEEDED "never sent" (calling
  again is safe), and a handle nobody read raises it at the end of the block, as a
  rejection does. A wait of the pipelining thread for answers that runs out of time
  first (reading a handle, sync, fetch, the end of the block, with a shorter timeout)
  takes the commands it waited for out of the queue the same way, and says so. A later
  command that used a ref one of them would have defined is then refused by the server
  as usual (UNKNOWN_REF), and seqs have gaps. Those gRPC took (a batch taken is sent, even while
  it is written) may still run: at the end of a block whose answers did not all come
  within the timeout, the block raises DEADLINE_EXCEEDED (after its rejections) and the
  stream is left to finish: they go out once the server reads again, and the session's
  next call waits for those answers first (Session._drain).
- Every wait for an answer has a deadline: the session's timeout, or the caller's
  (sync(timeout=...), fetch_shard(timeout=...)) for all the answers it waits for.
- Only the thread that opened the pipeline uses it; other threads keep using unary
  Execute, after flushing the pipeline so refs stay in order.
"""

import collections
import math
import queue
import threading
import time
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
# What the client queues ahead of the message gRPC is writing: two batches' worth. A
# server that stops reading (flow control) stops the queue here, not in memory.
_QUEUE_MAX = 2 * _BATCH_MAX
_QUEUE_BYTES = 2 * _BATCH_BYTES


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


class _Queue(queue.Queue):
    """The packed commands gRPC has not taken yet, (bytes, bytes it sends, seq, deadline)
    each, bounded by put_within; the end mark (_END) always goes in. gRPC takes them a
    batch at a time (take_batch); take_out and take_due remove commands that never went
    out, under the same lock, so a command is either still here or in a batch gRPC has
    (sent). wait_due is the pipeline's timer: it sleeps until the earliest deadline."""

    def __init__(self):
        super().__init__()
        self.timer_cv = threading.Condition(self.mutex)  # wait_due's
        self.timer_at = math.inf  # when wait_due wakes (inf: when a command comes)

    def _init(self, maxsize):
        super()._init(maxsize)
        self.nbytes = 0

    def _put(self, item):
        super()._put(item)
        if item is not _END:
            self.nbytes += len(item[0])

    def _get(self):
        item = super()._get()
        if item is not _END:
            self.nbytes -= len(item[0])
        return item

    def put_within(self, item, deadline, stopped):
        """Queues item once there is room for it (an empty queue always has), waiting
        until `deadline` (time.monotonic()); False if there was none by then or
        stopped() holds (the stream ended: nothing takes from the queue)."""
        with self.not_full:
            while self._qsize() and (self._qsize() >= _QUEUE_MAX
                                     or self.nbytes + len(item[0]) > _QUEUE_BYTES):
                left = deadline - time.monotonic()
                if left <= 0 or stopped():
                    return False
                self.not_full.wait(left)
            self._put(item)
            self.unfinished_tasks += 1
            self.not_empty.notify()
            if item[3] < self.timer_at:  # sooner than the timer wakes (or it sleeps)
                self.timer_at = item[3]
                self.timer_cv.notify()
            return True

    def take_batch(self):
        """The next Submit message's commands (their bytes), waiting for the first: what
        is queued, up to _BATCH_MAX, _BATCH_BYTES and _BATCH_SENT (the first always
        goes); the one that does not fit stays at the head. _END once it is the head."""
        with self.not_empty:
            while not self._qsize():
                self.not_empty.wait()
            q = self.queue
            if q[0] is _END:
                self._get()
                return _END
            batch, size, sent = [], 0, 0
            while q and q[0] is not _END and len(batch) < _BATCH_MAX:
                m = q[0]
                if batch and (size + len(m[0]) > _BATCH_BYTES or sent + m[1] > _BATCH_SENT):
                    break
                self._get()
                batch.append(m[0])
                size, sent = size + len(m[0]), sent + m[1]
            self.not_full.notify_all()
            return batch

    def _remove(self, gone):
        """Takes the commands for which gone(item) holds out (under mutex; one pass);
        returns their seqs, in queue order."""
        keep, seqs = collections.deque(), []
        for m in self.queue:
            if m is not _END and gone(m):
                seqs.append(m[2])
                self.nbytes -= len(m[0])
            else:
                keep.append(m)
        if seqs:
            self.queue = keep
            self.not_full.notify_all()
        return seqs

    def take_out(self, seqs):
        """Removes the commands of these seqs that are still queued (gRPC did not take
        them: never sent); returns the seqs removed, in queue order."""
        with self.mutex:
            return self._remove(lambda m: m[2] in seqs)

    def take_due(self):
        """Removes the queued commands whose deadline passed (never sent); their seqs."""
        with self.mutex:
            now = time.monotonic()
            return self._remove(lambda m: m[3] <= now)

    def wait_due(self, stopped):
        """Sleeps until a queued command's deadline passed (True) or stopped() holds
        (False, once notified: stop_timer). No busy loop: it wakes at the earliest
        deadline queued, or when a command with an earlier one comes (put_within)."""
        with self.mutex:
            while not stopped():
                now = time.monotonic()
                self.timer_at = min((m[3] for m in self.queue if m is not _END),
                                    default=math.inf)
                if self.timer_at <= now:
                    return True
                self.timer_cv.wait(None if self.timer_at == math.inf else self.timer_at - now)
            return False

    def stop_timer(self):
        """Wakes wait_due to look at its stopped() again."""
        with self.mutex:
            self.timer_cv.notify()


def _deadline_error(what, limit, seq=None):
    return MeshdError("DEADLINE_EXCEEDED", f"{what} within {limit:.3g} s",
                      grpc.StatusCode.DEADLINE_EXCEEDED, seq)


# (the Node client's words, for a command still in the client's queue at its deadline)
_NEVER_SENT = ("it waited in the client's queue (the server is not reading the Submit stream: "
               "flow control); it was taken out of the queue and never sent, so it did not run "
               "(calling again is safe)")


def _never_sent_error(seq, limit):
    return MeshdError("DEADLINE_EXCEEDED", f"pipeline: command seq {seq} was not sent within "
                      f"{limit:.3g} s: {_NEVER_SENT}", grpc.StatusCode.DEADLINE_EXCEEDED, seq)


class _Pending:
    """The answer to one pipelined command; attribute reads block until it arrived, at
    most the session's timeout (`timeout`)."""

    __slots__ = ("seq", "_event", "_result", "_error", "_quiet", "_timeout", "_refused_borrowed",
                 "_unknown_ok", "_pipe", "_taken_out", "_limit")

    def __init__(self, seq, timeout=None, pipe=None, limit=None):
        self.seq = seq
        self._pipe = pipe  # its Pipeline: a wait that runs out takes it out of the queue
        self._quiet = False
        self._timeout = timeout
        self._limit = timeout if limit is None else limit  # its send's: its deadline's
        self._refused_borrowed = None  # a Release's: called if it is refused BORROWED
        self._unknown_ok = False  # a DropBorrow of a borrow that may not exist: quiet
        self._taken_out = None  # housekeeping's: called if it is taken out, never sent
        self._event = threading.Event()
        self._result = None
        self._error = None

    def _set(self, result=None, error=None):
        self._result, self._error = result, error
        self._pipe = None  # nothing to take out any more (and an unread handle keeps no stream)
        self._event.set()

    def done(self):
        return self._event.is_set()

    def wait(self, timeout=None):
        """Waits for the answer, `timeout` seconds at most (None: the session's)."""
        timeout = self._timeout if timeout is None else timeout
        if not self._event.wait(timeout):
            pipe = self._pipe
            if (pipe is not None and pipe._take_out([self], timeout)) or self._event.is_set():
                return  # never sent (its error is set: result() raises it), or just answered
            raise _deadline_error(f"no answer to pipelined command seq {self.seq} (the server "
                                  f"is slow or not reading the Submit stream: flow control; it "
                                  f"stays queued and may still run)", timeout, self.seq)

    def result(self, timeout=None):
        """The CommandResult; raises the command's MeshdError if it was rejected (which
        the end of the block then does not raise again)."""
        self.wait(timeout)
        if self._error is not None:
            self._error._reported = True
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
        self._q = _Queue()
        self._pending = {}          # seq -> _Pending, not yet answered
        self._plock = threading.Lock()
        self._done = False          # the reader ended: nothing more is answered (_plock)
        self._closed = False        # close() collected the errors (_plock)
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
        # The one timer of the pipeline: commands still queued at their deadline go. It
        # ends with the reader (after the block, what is left queued still goes out).
        self._timer_stop = False
        self._timer = threading.Thread(target=self._expire, name="meshd-pipeline-timer",
                                       daemon=True)
        self._timer.start()

    def _requests(self):
        """The Submit stream's messages: whatever is queued when gRPC asks for the next
        one goes as one batch Command (up to _BATCH_MAX), so a fast caller sends few
        messages and a slow one loses no time waiting for a batch to fill. gRPC asks
        for the next once it wrote the last: a server that does not read leaves the
        rest in the queue (where a wait that runs out can still take them out)."""
        while True:
            batch = self._q.take_batch()
            if batch is _END:
                return
            yield batch[0] if len(batch) == 1 else _batch(batch)

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
            with self._plock:  # send() looks under the same lock: none is left behind
                self._done = True
                left, self._pending = list(self._pending.values()), {}
                if left and self._broken is None:  # ended early: the block says so
                    self._broken = err
            for p in left:
                p._set(error=err)
            with self._q.not_full:  # a send waiting for room: nothing takes from the queue
                self._q.not_full.notify_all()
            self._stop_timer()  # every command has its error: nothing to take out

    def _answer(self, pb, res):
        if res.seq == 0:
            if res.HasField("error"):
                self._async_errors.append(MeshdError.from_error(pb, res.error))
            return
        rejected = res.HasField("error") and res.error.kind != 0
        e = None
        if rejected:
            e = MeshdError.from_error(pb, res.error)
            e.seq = res.seq
        with self._plock:
            p = self._pending.pop(res.seq, None)
            late = self._closed  # the block ended before this answer came
            if p is not None and e is not None and not p._quiet and not late:
                self._errors.append(e)
        if p is None:
            return
        if e is not None:
            if e.kind == "UNAVAILABLE" and "predates the Literal" in e.message:
                self.session._literals = False  # an older agent: later tensors upload
            if p._refused_borrowed is not None and e.kind == "BORROWED":
                p._refused_borrowed()  # its refs go again once a borrow ends
            elif (p._quiet or late) and not (p._unknown_ok and e.kind == "UNKNOWN_REF"):
                warnings.warn(f"meshd: {e}" + (" (answered after its pipeline block ended)"
                                               if late and not p._quiet else ""),
                              RuntimeWarning, stacklevel=1)
            p._set(error=e)
        else:
            p._set(result=res)

    def _ended(self):
        """The error of a send after the stream ended (raised to its caller, so not
        again at the end of the block)."""
        e = self._broken or MeshdError("UNAVAILABLE", "the Submit stream is closed")
        e._reported = True
        return e

    def send(self, cmd, quiet=False, timeout=None):
        """Queues one Command (its seq set); returns its _Pending. quiet: a rejection
        is not raised at the end of the block (the session's Release housekeeping).
        A full queue (the server is not reading) is waited on `timeout` seconds at most
        (None: the session's), the command's deadline (room comes as those queued reach
        theirs, _expire); then MeshdError DEADLINE_EXCEEDED, the command not queued. A stream that ended raises its error; that command is not queued either."""
        limit = self.session.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit  # for room, and in the queue (_expire)
        p = _Pending(cmd.seq, self.session.timeout, self, limit)
        p._quiet = quiet
        with self._plock:
            if self._done:
                raise self._ended()
            self._pending[cmd.seq] = p
        try:
            queued = self._q.put_within((cmd.SerializeToString(), getattr(cmd, "sent", 0),
                                         cmd.seq, deadline), deadline, lambda: self._done)
        except BaseException:  # Ctrl-C while waiting for room: it was not queued
            with self._plock:
                self._pending.pop(cmd.seq, None)
            raise
        if not queued:
            with self._plock:
                self._pending.pop(cmd.seq, None)
                if self._done:
                    raise self._ended()
            raise _deadline_error(f"pipeline: command seq {cmd.seq} was not queued: the "
                                  f"{self._q.qsize()} commands queued before it did not go out "
                                  f"(the server is not reading the Submit stream: flow control; "
                                  f"they stay queued and go out once it reads again, each "
                                  f"unless its deadline passes first)",
                                  limit, cmd.seq)
        return p

    def unanswered(self):
        """How many commands sent have no answer yet."""
        with self._plock:
            return len(self._pending)

    def _take_out(self, waited, limit):
        """A wait of `limit` seconds for these _Pendings ran out: those still in the
        client's queue are taken out (never sent, they did not run) and get that error,
        when the waiting thread pipelines them (another thread's wait leaves the
        owner's commands alone: it was not their caller; their deadlines take them
        out, _expire). Returns the seqs taken out."""
        if threading.get_ident() != self.owner:
            return []
        seqs = {p.seq for p in waited if not p.done()}
        return self._never_sent(lambda: self._q.take_out(seqs), limit, report=False)

    def _expire(self):
        """The timer thread: each command still queued at its deadline is taken out, never
        sent, whoever waits for its answer. Nobody may read its handle, so its error is
        kept for the end of the block too (not raised again if a read raised it)."""
        while self._q.wait_due(lambda: self._timer_stop):
            self._never_sent(self._q.take_due, None, report=True)

    def _stop_timer(self):
        self._timer_stop = True
        self._q.stop_timer()

    def _never_sent(self, take, limit, report):
        """Takes commands out of the queue (take(): their seqs) and fails each with its
        never-sent error (limit: the wait's, None: each command's own). Their _Pendings
        leave _pending and get their error under _plock, so a wait that finds nothing to
        take out finds its answer set. report: the errors are raised at the end of the
        block (quiet housekeeping's excepted). Returns the seqs taken out."""
        done = []
        with self._plock:
            for seq in take():
                p = self._pending.pop(seq, None)
                if p is None:  # (the stream ended: its error is set already)
                    continue
                e = _never_sent_error(seq, p._limit if limit is None else limit)
                if report and not p._quiet and not self._closed:
                    self._errors.append(e)
                elif report and not p._quiet:  # (the block ended: Ctrl-C in its last flush)
                    warnings.warn(f"meshd: {e} (after its pipeline block ended)",
                                  RuntimeWarning, stacklevel=1)
                p._set(error=e)
                done.append(p)
        for p in done:
            if p._taken_out is not None:
                p._taken_out()  # a Release or DropBorrow: it goes again with a later call
        return [p.seq for p in done]

    def flush(self, timeout=None):
        """Waits for the answer to every command sent so far (errors stay deferred),
        `timeout` seconds in all at most (None: the session's timeout); then MeshdError
        DEADLINE_EXCEEDED: those gRPC took may still run, those still in the client's
        queue are taken out (the pipelining thread's wait: see _take_out)."""
        limit = self.session.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._plock:
            waiting = list(self._pending.values())
        for p in waiting:
            if not p._event.wait(max(0.0, deadline - time.monotonic())):
                gone = self._take_out(waiting, limit)
                left = [q for q in waiting if not q.done() or q.seq in gone]
                sent = len(left) - len(gone)
                if gone:
                    shown = ", ".join(str(q) for q in gone[:6]) + (", ..." if len(gone) > 6 else "")
                    what = (f"{len(gone)} of them (seq {shown}) waited in the client's queue (the "
                            f"server is not reading the Submit stream: flow control); they were "
                            f"taken out of the queue and never sent, so they did not run (calling "
                            f"again is safe)" + (f"; the other {sent} were sent and may still run"
                                                 if sent else ""))
                else:
                    what = (f"{self._q.qsize()} of them still queued on the client (the server is "
                            f"slow or not reading the Submit stream: flow control; they go out "
                            f"and run once it reads again)")
                raise MeshdError("DEADLINE_EXCEEDED",
                                 f"pipeline: {len(left)} of the commands sent (seq {left[0].seq} "
                                 f"first) were not answered within {limit:.3g} s, {what}",
                                 grpc.StatusCode.DEADLINE_EXCEEDED, left[0].seq)

    def close(self):
        """Flushes and ends the stream (its end goes after what is queued); returns the
        deferred errors: the rejections (lowest seq first), the server's asynchronous
        reports, the stream's failure, then DEADLINE_EXCEEDED if answers were missing
        at the session's timeout. It never cancels the stream: what is still queued goes
        out when the server reads again, and the stream ends after it."""
        deadline = time.monotonic() + self.session.timeout
        late = None
        try:
            self.flush(self.session.timeout)
        except MeshdError as e:
            late = e
        finally:
            self._q.put(_END)
            if late is None:  # the server ends the stream once it read the end
                self._reader.join(max(0.0, deadline - time.monotonic()))
            with self._plock:
                self._closed = True
                errs = sorted(self._errors, key=lambda e: e.seq or 0) + self._async_errors
            b = self._broken
            if b is not None and b.code != grpc.StatusCode.OK:
                errs.append(b)
            if late is not None:
                errs.append(late)
            errs = [e for e in errs if not getattr(e, "_reported", False)]
        return errs
