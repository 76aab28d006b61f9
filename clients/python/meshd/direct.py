"""The direct data path (docs/protocol.md, Direct data path): the server plans an
upload or a fetch (PlanTransfer) and hands out one grant per shard; the client then
streams the bytes straight to or from each agent (Agent/Write, Agent/Read), all
shards in parallel, and tells the server (FinishUpload with the agents' receipts,
FinishFetch).

data_path (meshd.connect): "direct" always takes this path; "proxy" never does;
"auto" (default) takes it when the server offers PlanTransfer, the agents' port is
TLS or the session is not (a session over TLS keeps its bytes encrypted), and every
agent of the pool answers a connection within CONNECT_TIMEOUT seconds (checked once
per session and address), else the proxied Upload/Fetch. With cluster mTLS the
server says how to verify the agents (AgentTls in ListAgents and in each plan: the
cluster CA and the name their certificates carry); the client presents no
certificate, its grants authenticate Read and Write.

The agents' messages used here are packed by hand (a few fields): the Python client
generates only tensor_service.proto."""

import asyncio
import concurrent.futures
import contextlib
import functools
import queue
import re
import threading
import time

import grpc
import numpy as np

from . import _progress
from .errors import KIND_MD, MeshdError, closed_channel, retry_transfers_full

_SVC = "/meshd.v1.TensorService/"
_AGENT = "/meshd.agent.v1.Agent/"
GRANT_MD = "meshd-transfer-grant-bin"
CONNECT_TIMEOUT = 1.0
DATA_PATHS = ("auto", "direct", "proxy")
# Write messages of 2 MiB (half the agents' default 4 MiB message limit): 1.2x the
# upload rate of 1 MiB here. Reads of 1 MiB: larger ones came slower (2 MiB 0.66x,
# 3 MiB 0.4x, one agent, 256 MiB, loopback).
_CHUNK = 2 << 20
_READ_CHUNK = 1 << 20
# How long an address found unreachable is not tried again (auto).
_UNREACHABLE_FOR = 30.0
_OPTIONS = [("grpc.enable_http_proxy", 0), ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            # one connection per agent of its own: shards in parallel do not share one
            ("grpc.use_local_subchannel_pool", 1)]
# What an agent's address in a plan or in ListAgents must look like: host:port (a
# name, an IPv4 address or a bracketed IPv6 one), never a gRPC target such as
# unix:/path or dns:///name, which would dial something other than the agent.
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+(%[A-Za-z0-9_.\-]+)?\]|[A-Za-z0-9_.\-]+):[0-9]{1,5}\Z")
# The calls that undo or close a transfer that failed or was interrupted (FinishUpload
# with no receipts, a quiet FinishFetch) get this long at most (or the session's
# timeout when shorter), whatever was left of the transfer's deadline: without them
# the server holds the transfer's slot and the agents its memory until the grants expire.
_CLEANUP_TIMEOUT = 5.0
# How much longer than its deadline a fetch read on the io loop is waited for (the
# Read itself ends at the deadline: this only bounds a wedged loop).
_IO_GRACE = 5.0


def _left(deadline):
    """Seconds left until deadline (time.monotonic()), at least a millisecond."""
    return max(deadline - time.monotonic(), 0.001)


# A host named as one of gRPC's target schemes reads as that scheme: "unix:123" is
# the socket file 123 (the C and Node clients refuse the same names).
_SCHEMES = {"unix", "unix-abstract", "ipv4", "ipv6", "dns", "vsock", "xds", "google-c2p"}


def _host_port(address):
    m = _HOST_PORT.match(address)
    return bool(m) and m.group(1).lower() not in _SCHEMES


_closed_channel = closed_channel  # (errors.py: grpc says it two ways)


def _closed_error(what):
    """The error of a transfer that the session's close() cut: kind CANCELLED, as a
    proxied transfer's whose channel closed under it."""
    return MeshdError("CANCELLED", f"{what}: the session was closed", grpc.StatusCode.CANCELLED)


def _shard_error(e, what, sh):
    """A shard's failed agent call (grpc.RpcError e) as a MeshdError that names the
    rank and the agent, which the agent's own words do not (the server says the rank on
    the proxied path). A broken connection says that the agent died or is unreachable."""
    err = MeshdError.from_rpc(e)
    kind, msg = err.kind, err.message
    if _late_grant(e):  # not an auth problem: say what happened and what to do
        msg = f"{_LATE_MSG} ({msg})"
    elif _nonces_full(e):  # not the session's quota: the agent's, for every client
        msg = f"{_NONCES_FULL_MSG} ({msg})"
    if kind == "UNAVAILABLE" and not any(k == KIND_MD for k, _ in (e.trailing_metadata() or ())):
        # AGENT_LOST, as the server says of the same break on the proxied path
        kind = "AGENT_LOST"
        msg = f"the connection to its agent broke ({msg}): the agent died or cannot be reached"
    return MeshdError.of_kind(kind, f"direct {what} of rank {sh.rank} (agent {sh.address}): {msg}",
                              err.code)


def _varint(n):
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _fields(raw):
    """{field number: value} of a packed message with varint and length-delimited
    fields only (the last value of a repeated field wins)."""
    out, i, n = {}, 0, len(raw)
    while i < n:
        key = shift = 0
        while True:
            b = raw[i]
            i += 1
            key |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        num, wt = key >> 3, key & 7
        v = shift = 0
        if wt in (0, 2):
            while True:
                b = raw[i]
                i += 1
                v |= (b & 0x7F) << shift
                shift += 7
                if not b & 0x80:
                    break
        if wt == 0:
            out[num] = v
        elif wt == 2:
            out[num] = bytes(raw[i:i + v])
            i += v
        else:
            raise ValueError(f"meshd: unexpected wire type {wt}")
    return out


def _tls_of(reply):
    """(ca_pem bytes, server_name) from a reply's AgentTls, or None: plaintext."""
    if not reply.HasField("agent_tls") or not reply.agent_tls.ca_pem:
        return None
    return reply.agent_tls.ca_pem.encode(), reply.agent_tls.server_name


class _IoLoop:
    """One asyncio event loop on a thread of its own, which reads every direct fetch
    of a session (grpc.aio): the shards of a sharded fetch then share one thread and
    one GIL holder instead of taking turns as threads, each with its own poller (4
    shards: 1.1-1.4 GB/s read and copied into place, where 4 threads got 0.86-0.97 on
    this machine). Its channels are its own, made on its thread. close() ends every
    read still running (their futures are cancelled) and starts no loop again."""

    def __init__(self):
        self._lock = threading.Lock()
        self._loop = None
        self._thread = None
        self._closed = False
        self._futures = set()  # run's futures not done yet (_lock)
        self._channels = {}  # (address, tls) -> grpc.aio channel; used on the loop only

    def _start_locked(self):
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run():
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()
        t = threading.Thread(target=run, name="meshd-io", daemon=True)
        t.start()
        ready.wait()
        self._loop, self._thread = loop, t

    def run(self, coro_fn, *args):
        """coro_fn(*args) on the loop: a concurrent.futures.Future of its result
        (cancelled if close() ends it). MeshdError CANCELLED once closed."""
        with self._lock:
            if self._closed:
                raise _closed_error("direct fetch")
            if self._loop is None:
                self._start_locked()
            fut = asyncio.run_coroutine_threadsafe(coro_fn(*args), self._loop)
            self._futures.add(fut)
        fut.add_done_callback(self._forget)
        return fut

    def _forget(self, fut):
        with self._lock:
            self._futures.discard(fut)

    def channel(self, address, tls):
        """On the loop: its channel to address (tls: _tls_of's)."""
        key = (address, tls)
        ch = self._channels.get(key)
        if ch is None:
            if tls is None:
                ch = grpc.aio.insecure_channel(address, options=_OPTIONS)
            else:
                opts = _OPTIONS + ([("grpc.ssl_target_name_override", tls[1])] if tls[1] else [])
                ch = grpc.aio.secure_channel(
                    address, grpc.ssl_channel_credentials(root_certificates=tls[0]), options=opts)
            self._channels[key] = ch
        return ch

    def _forked(self):
        """In a forked child: the loop's thread is the parent's; close() does nothing
        and run() refuses. Returns what the child must keep and never close."""
        self._lock = threading.Lock()
        kept = (self._loop, self._thread, self._channels, self._futures)
        self._loop = self._thread = None
        self._closed = True
        self._channels, self._futures = {}, set()
        return kept

    def close(self):
        """Cancels the reads running on the loop and waits for them to end (their
        calls cancelled), closes the channels, stops the loop."""
        with self._lock:
            self._closed = True
            loop, t, self._loop, self._thread = self._loop, self._thread, None, None
            futs = list(self._futures)
        if loop is None:
            return

        async def shutdown():
            me = asyncio.current_task()
            tasks = [x for x in asyncio.all_tasks() if x is not me]
            for x in tasks:
                x.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            chans, self._channels = list(self._channels.values()), {}
            for ch in chans:
                await ch.close()
        if threading.current_thread() is t:  # a progress callback on the loop closed the session
            loop.create_task(shutdown()).add_done_callback(lambda _: loop.stop())
            return
        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(5)
        except Exception:  # noqa: BLE001 - closing: nothing to tell
            pass
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
        if not t.is_alive():
            loop.close()
        for f in futs:  # a read the loop did not end in time: its waiter must not hang
            f.cancel()


_LATE_REFUSAL = "did not start by its start-by time"
_LATE_MSG = ("the transfer's grant expired before it started (the client was paused after its "
             "plan, an agent's clock was stepped, or, with an older server or agent, the clocks "
             "differ by more than --transfer-grant-start-ms); call again")


def _late_grant(e):
    """Whether an agent refused a Read or Write only because it started past its
    grant's start-by time (--transfer-grant-start-ms after the plan): nothing moved,
    and a new plan (PlanTransfer) gets grants that are good again."""
    return (e.code() == grpc.StatusCode.PERMISSION_DENIED
            and _LATE_REFUSAL in (e.details() or ""))


# An agent's refusal of a grant when its table of grants taken (--max-transfer-nonces,
# each kept until its start-by time) is full (agent/transfer_grant.c, table_full).
_NONCES_FULL = "grants are in use on this agent already"
_NONCES_FULL_MSG = ("the agent has too many transfers in flight (its --max-transfer-nonces "
                    "table of transfer grants is full); retry later or use data_path=\"proxy\"")


def _nonces_full(e):
    """Whether an agent refused a Read or Write (grpc.RpcError e) only because its
    table of grants taken is full: nothing moved, and the table empties only as those
    grants reach their start-by times (--transfer-grant-start-ms, a minute by default),
    longer than a transfer should wait, so auto takes the proxy for this transfer and
    direct fails saying so. (Not _reads_full's QUOTA, which is waited out.)"""
    return (e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and _NONCES_FULL in (e.details() or ""))


def _refused(err, code, words):
    """Whether err, a shard's error (_shard_error's MeshdError, or another exception),
    is its agent's refusal with status code whose message says words."""
    return isinstance(err, MeshdError) and err.code == code and words in err.message


def _reads_full(e):
    """Whether a Read was refused only because its agent already has its most Reads
    waiting for their seqs (QUOTA, agent/data.c READ_WAITING_MAX): nothing was read
    and the grant stays good, so the caller waits and retries it."""
    return (e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "Reads already wait for seqs" in (e.details() or ""))


def _read_request(session_id, ref, max_chunk, after_seq):
    """meshd.agent.v1.ReadRequest packed."""
    sid = session_id.encode()
    return (b"\x0a" + _varint(len(sid)) + sid + b"\x10" + _varint(ref) + b"\x18" +
            _varint(max_chunk) + b"\x20" + _varint(after_seq))


class _ReadSpec:
    """A Read's first message (DataChunk{spec}) as _read_call yields it: only its
    read_receipt matters here (the plan's meta said the rest)."""
    __slots__ = ("receipt",)

    def __init__(self, receipt):
        self.receipt = receipt


def _read_receipt_of(raw):
    """DataChunk.read_receipt (field 4) of a packed Read message, b"" if none: the
    agent's proof that the Read took its snapshot, which FinishFetch passes on so
    that the server sends no DropSnapshot."""
    try:
        receipt = _fields(raw).get(4, b"")
    except (IndexError, ValueError):  # not a DataChunk: as no receipt
        return b""
    return receipt if isinstance(receipt, bytes) else b""


class Direct:
    """A session's side of the direct path: its mode, channels to agents, and what it
    learned (whether the server offers PlanTransfer, which addresses answer)."""

    def __init__(self, session, mode):
        if mode not in DATA_PATHS:
            raise ValueError(f"meshd: data_path must be one of {', '.join(DATA_PATHS)}, got {mode!r}")
        self.session, self.mode = session, mode
        self._lock = threading.Lock()
        self._closed = False  # close() ran: no new channel (_lock)
        self._channels = {}  # (address, tls) -> channel
        self._unreachable = {}  # (address, tls) -> time it failed
        self._offered = None  # None: not known yet; False: the server refused PlanTransfer
        self._pool_ok = None  # auto: every agent of the pool answered
        self._probed = 0.0  # when _pool_ok was last found
        # One probe at a time: the fetches that start together wait for it (each made
        # its own, with a channel per agent that all but one closed again).
        self._probe_lock = threading.Lock()
        self.counts = {"upload": 0, "fetch": 0}  # transfers that took the direct path
        self._io = _IoLoop()  # reads fetches that run together
        self._reading = 0  # fetches reading now (_lock)
        self._fetch_req = {}  # planned fetches' (FetchRequest, session seq) by transfer_id (_lock)

    def close(self):
        """Ends the transfers in flight: reads on the io loop are cancelled, calls on
        the channels closed fail (each transfer's caller gets MeshdError CANCELLED)."""
        with self._lock:
            self._closed = True
            chans, self._channels = list(self._channels.values()), {}
        self._io.close()
        for ch in chans:
            ch.close()

    def _forked(self):
        """In a forked child (Session._forked): no transfer; returns the inherited
        channels and io loop state, which the child keeps and never closes."""
        self._lock, self._probe_lock = threading.Lock(), threading.Lock()
        self._closed = True
        kept, self._channels = self._channels, {}
        return kept, self._io._forked()

    # ------------------------------------------------------------ reachability
    def _channel(self, address, tls=None, timeout=CONNECT_TIMEOUT):
        """A ready channel to the agent at address (tls: _tls_of's, the server's
        certificate only), or None when it does not connect within timeout
        (remembered for a while, unless a deadline cut the wait short) or is not a
        host:port address."""
        if not _host_port(address):
            return None
        key = (address, tls)
        with self._lock:
            if self._closed:
                raise _closed_error("direct transfer")
            ch = self._channels.get(key)
            failed = self._unreachable.get(key)
        if ch is not None:
            return ch
        if failed is not None and time.monotonic() - failed < _UNREACHABLE_FOR:
            return None
        if tls is None:
            ch = grpc.insecure_channel(address, options=_OPTIONS)
        else:
            opts = _OPTIONS + ([("grpc.ssl_target_name_override", tls[1])] if tls[1] else [])
            ch = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=tls[0]),
                                     options=opts)
        try:
            grpc.channel_ready_future(ch).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            ch.close()
            if timeout >= CONNECT_TIMEOUT:  # the agent's fault, not a deadline's
                with self._lock:
                    self._unreachable[key] = time.monotonic()
            return None
        with self._lock:
            other = None if self._closed else self._channels.setdefault(key, ch)
        if other is not ch:
            ch.close()
        if other is None:
            raise _closed_error("direct transfer")
        return other

    def _probe_due(self):
        return self._pool_ok is None or (not self._pool_ok and
                                         time.monotonic() - self._probed > _UNREACHABLE_FOR)

    def _pool_reachable(self, deadline=None):
        """auto: whether every agent of the pool answers (probed in parallel, once; a
        failed probe is tried again after a while). A session over TLS asked for its
        bytes encrypted: with agents in plaintext it keeps to the server. deadline
        (time.monotonic()): the transfer's, which bounds the probe and the wait for
        another transfer's probe; a probe it cuts short answers False (the proxy)
        and is made again next time. One probe at a time: the others wait for it."""
        if not self._probe_due():
            return self._pool_ok
        if not self._probe_lock.acquire(timeout=-1 if deadline is None else _left(deadline)):
            return False  # another transfer's probe outlasted this one's deadline
        try:
            return self._probe(deadline) if self._probe_due() else self._pool_ok
        finally:
            self._probe_lock.release()

    def _probe(self, deadline):
        """_pool_reachable's probe (its lock held): ListAgents, then a connection to
        each agent, all at once."""
        self._probed = time.monotonic()
        s = self.session
        try:
            agents, reply = s._list_agents(None if deadline is None else _left(deadline))
        except MeshdError:
            return False
        tls = _tls_of(reply)
        if s.tls and tls is None:
            self._pool_ok = False
            return False
        wait = CONNECT_TIMEOUT if deadline is None else min(CONNECT_TIMEOUT, _left(deadline))
        addrs = [a.address for a in agents]
        with concurrent.futures.ThreadPoolExecutor(max(1, min(16, len(addrs)))) as ex:
            ok = all(ex.map(lambda a: self._channel(a, tls, timeout=wait) is not None, addrs))
        if not ok and wait < CONNECT_TIMEOUT:
            return False  # cut short by the deadline: not known yet
        self._pool_ok = ok and bool(addrs)
        return self._pool_ok

    def wanted(self, deadline=None):
        """Whether the next transfer should try the direct path (deadline: the
        transfer's, which bounds the pool's probe)."""
        if self.mode == "proxy" or self.session.closed:
            return False
        if self.mode == "direct":
            return True
        return self._offered is not False and self._pool_reachable(deadline)

    # ------------------------------------------------------------ server calls
    def plan(self, request, deadline):
        """PlanTransfer: its reply, or None when the server does not offer it (auto
        then uses the proxy). Raises MeshdError for a refused plan. deadline
        (time.monotonic()): the transfer's, for the call and for the waits while the
        session's transfer slots are all taken (as the proxy's Upload and Fetch)."""
        s = self.session
        fn = s._ch.unary_unary(_SVC + "PlanTransfer", request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=s._pb.PlanTransferReply.FromString)
        try:  # the session's own transfers in flight end soon: wait for one (errors.py)
            return retry_transfers_full(lambda: fn(request, metadata=s._md, timeout=_left(deadline)),
                                        _left(deadline))
        except grpc.RpcError as e:
            not_offered = e.code() == grpc.StatusCode.UNIMPLEMENTED or (
                e.code() == grpc.StatusCode.FAILED_PRECONDITION and "--data-path" in (e.details() or ""))
            if self.mode == "auto" and not_offered:
                self._offered = False
                return None
            raise MeshdError.from_rpc(e) from None
        except ValueError as e:
            if _closed_channel(e):
                raise _closed_error("PlanTransfer") from None
            raise

    def _channels_for(self, reply, what, deadline=None):
        """A channel per shard of a plan, or None (auto) to use the proxy instead: when
        the session is over TLS and the plan's agents speak plaintext (its bytes stay
        encrypted), when the plan names an address that is not host:port, or when an
        agent does not connect. data_path="direct" raises MeshdError UNAVAILABLE then.
        The caller abandons the plan either way. deadline (time.monotonic()): the
        transfer's, which also bounds the wait for a connection (then
        DEADLINE_EXCEEDED, whatever the data path)."""
        s, tls = self.session, _tls_of(reply)
        bad = next((sh for sh in reply.shards if not _host_port(sh.address)), None)
        hint = "use data_path=\"auto\" or \"proxy\""
        if s.tls and tls is None:
            why = ("the session is over TLS and the plan's agents speak plaintext: the "
                   "tensor's bytes would travel unencrypted; use data_path=\"proxy\" (or "
                   "\"auto\", which does so)")
        elif bad is not None:
            why = (f"the plan names {bad.address!r} as the agent of rank {bad.rank}, not "
                   f"host:port; refusing to dial it; {hint}")
        else:
            out = []
            for sh in reply.shards:
                wait = CONNECT_TIMEOUT if deadline is None else min(CONNECT_TIMEOUT, _left(deadline))
                ch = self._channel(sh.address, tls, timeout=wait)
                if ch is None and wait < CONNECT_TIMEOUT:
                    raise MeshdError("DEADLINE_EXCEEDED",
                                     f"direct {what}: no connection to the agent of rank "
                                     f"{sh.rank} at {sh.address} before the deadline",
                                     grpc.StatusCode.DEADLINE_EXCEEDED)
                if ch is None:
                    break
                out.append(ch)
            else:
                return out
            why = (f"the agent of rank {sh.rank} does not answer at {sh.address} within "
                   f"{CONNECT_TIMEOUT} s; {hint} from outside the cluster")
        if self.mode == "direct":
            raise MeshdError("UNAVAILABLE", f"direct {what}: {why}")
        self._pool_ok, self._probed = False, time.monotonic()
        return None

    # ------------------------------------------------------------ upload
    def _split_mismatch(self, hdr, pieces, shards):
        """Why a direct upload's plan does not split the tensor over the mesh as it
        should (docs/protocol.md: one shard per rank of the mesh, in its row-major
        order, each rank once; with per_rank, shard i gets the i-th rank's rows), else
        "". The ranks' order is checked where this session knows the mesh."""
        ranks = [int(sh.rank) for sh in shards]
        n = len(ranks)
        listed = ", ".join(map(str, ranks))
        if n == 0:
            return "names no shard"
        if len(set(ranks)) != n:
            return f"names a rank twice (ranks {listed})"
        mesh = self.session._meshes.get(hdr.mesh)
        want = [int(r) for r in mesh.ranks] if mesh is not None and mesh.ranks else None
        if want and ranks != want:
            return (f"names ranks {listed} where mesh {hdr.mesh} has ranks "
                    f"{', '.join(map(str, want))}")
        if hdr.per_rank and len(pieces) != n:
            return f"has {n} shards for {len(pieces)} ranks' rows"
        return ""

    def upload(self, hdr, pieces, tr, timeout=None, _late_retry=True):
        """Uploads pieces (byte memoryviews: one per rank with per_rank, else one) as
        UploadHeader hdr (ref already chosen, the session lock held). Returns
        (the UploadReply-like FinishUploadReply, tr, which the caller completes), or
        None when the direct path is not available, or (auto) an agent's table of
        grants is full (nothing was defined; the caller uses the proxy with a new ref
        and the same tr, tr.again()). tr (meshd._progress tracker, the caller's: one
        bar for every attempt) counts the array's bytes as the proxy does: with
        per_rank the bytes sent to all agents together, else the bytes every agent got
        (the slowest's); closed when this raises. timeout (default: the session's):
        seconds for the plan, the Writes and FinishUpload together, as the proxy's
        one Upload call. All shards' Writes run at once; the first that fails, the
        progress callback's exception or any exception here (KeyboardInterrupt)
        cancels every Write and the server is told at once (FinishUpload without
        receipts): it frees the session's transfer slot and undoes what the agents
        got."""
        s, pb = self.session, self.session._pb
        deadline = time.monotonic() + (s.timeout if timeout is None else timeout)
        reply = self.plan(pb.PlanTransferRequest(upload=hdr), deadline)
        if reply is None:
            return None
        mismatch = self._split_mismatch(hdr, pieces, reply.shards)
        if mismatch:  # before any dial: no byte goes to a rank not its own
            self._abandon_upload(reply.transfer_id)
            raise MeshdError("INTERNAL", f"direct upload: the plan {mismatch}; no byte was sent")
        try:
            chans = self._channels_for(reply, "upload", deadline)
        except BaseException:
            self._abandon_upload(reply.transfer_id)
            raise
        if chans is None:
            self._abandon_upload(reply.transfer_id)
            return None
        n = len(reply.shards)
        from .tensor import _data_field
        lock = threading.Lock()  # tr, sent, failed: from any shard's thread
        stop = threading.Event()  # set by the first error: every shard's chunks end
        failed = []  # the first error: a shard's MeshdError or the progress callback's
        calls = []  # the Writes started
        sent = [0] * n
        receipts = [None] * n

        def abort(e):
            with lock:
                if not failed:
                    failed.append(e)
                stop.set()
                started = list(calls)
            for c in started:  # (a call that ended already ignores it)
                c.cancel()

        def chunks(i, part):
            for off in range(0, len(part), _CHUNK):
                if stop.is_set():
                    return
                yield _data_field(part[off:off + _CHUNK])
                try:  # runs when gRPC takes the next message
                    with lock:
                        if stop.is_set():  # (tr may have gone on to another attempt)
                            return
                        sent[i] += min(_CHUNK, len(part) - off)
                        tr.set(sum(sent) if hdr.per_rank else min(sent))
                except BaseException as e:
                    abort(e)
                    return

        # The Writes that ended, one entry each (done): waited for here rather than in
        # call.result(), which holds the call's lock between its waits: an exception a
        # signal handler raises there (Ctrl-C) can leave that lock taken, and gRPC's
        # thread for the channel blocked on it for good. SimpleQueue.put never blocks.
        ended = queue.SimpleQueue()

        def done(i, call):  # on gRPC's thread when shard i's Write ended
            try:
                if not call.cancelled() and call.code() != grpc.StatusCode.OK:
                    abort(_shard_error(call, "upload", reply.shards[i]))  # the others stop now
            finally:
                ended.put(i)

        try:
            for i, sh in enumerate(reply.shards):
                if stop.is_set():
                    break
                fn = chans[i].stream_unary(_AGENT + "Write", request_serializer=lambda b: b,
                                           response_deserializer=lambda b: b)
                call = fn.future(chunks(i, pieces[i] if hdr.per_rank else pieces[0]),
                                 metadata=((GRANT_MD, sh.grant),), timeout=_left(deadline))
                calls.append(call)
                if stop.is_set():  # abort() may have missed it
                    call.cancel()
                call.add_done_callback(functools.partial(done, i))
            for _ in calls:  # (each Write ends by the deadline: the wait is bounded too)
                try:
                    ended.get(timeout=_left(deadline) + _IO_GRACE)
                except queue.Empty:
                    raise MeshdError("DEADLINE_EXCEEDED", "direct upload: the Writes did not end "
                                     "by the deadline", grpc.StatusCode.DEADLINE_EXCEEDED) from None
        except BaseException as e:  # KeyboardInterrupt, a closed channel: stop it all
            abort(e)
            with lock:
                tr.close()  # the bar stops where it stood; the callback hears no more
            self._abandon_upload(reply.transfer_id)
            if _closed_channel(e):
                raise _closed_error("direct upload") from None
            raise
        for i, call in enumerate(calls):
            sh = reply.shards[i]
            if call.cancelled():
                continue  # by abort: failed says why
            if call.code() != grpc.StatusCode.OK:
                abort(_shard_error(call, "upload", sh))
                continue
            try:
                out = _fields(call.result())
            except Exception as e:  # noqa: BLE001 - a reply we cannot read
                abort(MeshdError("INTERNAL", f"direct upload of rank {sh.rank} (agent "
                                 f"{sh.address}): its reply could not be read ({e!r})"))
                continue
            receipts[i] = pb.WriteReceipt(rank=sh.rank, bytes=out.get(1, 0), receipt=out.get(2, b""))
        if failed:  # (stop is set: no shard's thread updates tr any more)
            self._abandon_upload(reply.transfer_id)  # the server undoes it at once
            if (_refused(failed[0], grpc.StatusCode.PERMISSION_DENIED, _LATE_REFUSAL)
                    and _late_retry and _left(deadline) > 0):
                # The Writes started past their grants' start-by time (this process was
                # paused between plan and Write): nothing was stored. Planned once more,
                # with a new ref as the proxy's fallback takes (the plan claimed this
                # one), on the same bar.
                hdr.ref = s._new_ref()
                tr.again()
                return self.upload(hdr, pieces, tr, timeout=_left(deadline), _late_retry=False)
            if self.mode == "auto" and _refused(failed[0], grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                _NONCES_FULL):
                return None  # an agent's grant table is full: the proxy takes this upload
            tr.close()  # the bar stops where it stood; the callback hears no more
            raise failed[0]
        try:
            res = self._finish_upload(reply.transfer_id, receipts, deadline)
        except MeshdError:
            tr.close()
            raise
        except BaseException:  # Ctrl-C: it may have defined the tensor, or not been told
            tr.close()
            self._abandon_upload(reply.transfer_id)  # (a defined tensor comes back: released)
            raise
        self.counts["upload"] += 1
        return res, tr  # the caller completes tr (meshd.tensor._uploaded)

    def _finish_upload(self, transfer_id, receipts, deadline):
        """FinishUpload with every shard's receipt: the reply, or MeshdError.

        When no answer came (the deadline passed, the connection dropped), the upload
        may have finished all the same, its answer lost: it is asked once more (the
        server answers a finished upload's FinishUpload again, and finishes one it had
        not yet), so that the tensor is not left defined behind the caller's back while
        it raises. Still no answer, and the transfer is abandoned (the call may not have
        reached the server, which would keep the slot)."""
        s, pb = self.session, self.session._pb
        fin = s._ch.unary_unary(_SVC + "FinishUpload", request_serializer=lambda m: m.SerializeToString(),
                                response_deserializer=pb.FinishUploadReply.FromString)
        req = pb.FinishUploadRequest(transfer_id=transfer_id, receipts=receipts)
        lost = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
        try:
            try:
                return fin(req, metadata=s._md, timeout=_left(deadline))
            except grpc.RpcError as e:
                if e.code() not in lost:
                    raise MeshdError.from_rpc(e) from None
                first = e
            try:
                return fin(req, metadata=s._md, timeout=min(s.timeout, _CLEANUP_TIMEOUT))
            except grpc.RpcError as e:
                if e.code() in lost:
                    self._abandon_upload(transfer_id)
                    raise MeshdError.from_rpc(first) from None
                raise MeshdError.from_rpc(e) from None  # failed, or undone: why
        except ValueError as e:
            if _closed_channel(e):
                raise _closed_error("FinishUpload") from None
            raise

    def _abandon_upload(self, transfer_id):
        s, pb = self.session, self.session._pb
        fin = s._ch.unary_unary(_SVC + "FinishUpload", request_serializer=lambda m: m.SerializeToString(),
                                response_deserializer=pb.FinishUploadReply.FromString)
        try:  # no receipts: the server undoes it and frees the session's slot at once
            done = fin(pb.FinishUploadRequest(transfer_id=transfer_id), metadata=s._md,
                       timeout=min(s.timeout, _CLEANUP_TIMEOUT))
            if done.HasField("tensor"):  # it had finished, every answer lost: nobody holds it
                s._release_later(done.tensor.ref)
        except grpc.RpcError:
            pass
        except ValueError as e:  # the session was closed: the server ended it
            if not _closed_channel(e):
                raise

    # ------------------------------------------------------------ fetch
    def fetch_plan(self, req, deadline):
        """PlanTransfer for a FetchRequest: (reply, channel), or None to use the proxy.
        Planned before it returns: later commands cannot change the value. deadline
        (time.monotonic()): the fetch's. With the session's transfer slots all taken
        (req.wait_for_slot) the server plans it all the same and answers slot_pending:
        (reply, None), whose grant fetch_finish waits for (_fetch_grant)."""
        pb = self.session._pb
        reply = self.plan(pb.PlanTransferRequest(fetch=req), deadline)
        # The commands sent by the time it was planned (_given_back_unchanged): taken
        # after the answer, as commands that write no tensor may go during the plan
        # (Session._execute), and one that may write waits for it (fetch_shard's).
        seq = self.session._seq
        if reply is not None:
            with self._lock:
                self._fetch_req[reply.transfer_id] = (req, seq)
        if reply is None:
            return None
        if reply.slot_pending:
            return reply, None
        return self._fetch_channel(reply, deadline)

    def _fetch_grant(self, reply, deadline):
        """(reply, channel) for a fetch whose plan was answered slot_pending: its grant,
        PlanTransfer{fetch: FetchRequest{transfer_id}}, one call that the server holds
        until a slot frees for it, oldest waiting first (by deadline: past it the server
        undoes the fetch). A server older than that refuses it at once while the
        session's transfer slots are all taken, and it is asked again until one frees
        (Direct.plan's retry_transfers_full). The plan fixed its value, so the session's
        commands go meanwhile. None (auto: its agent does not answer) with the plan
        kept, for _fetch_by_proxy. Raises, the plan given back, when refused otherwise
        (DEADLINE_EXCEEDED naming the slots when none freed in time)."""
        pb = self.session._pb
        try:
            try:
                granted = self.plan(pb.PlanTransferRequest(fetch=pb.FetchRequest(
                    transfer_id=reply.transfer_id)), deadline)
            except MeshdError as e:
                if e.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                raise MeshdError("DEADLINE_EXCEEDED", "direct fetch: planned, it waited for one "
                                 "of the session's transfer slots until its deadline passed (its "
                                 "other transfers in flight hold all --session-max-transfers of "
                                 "them); read or end those first, or give it a longer timeout",
                                 grpc.StatusCode.DEADLINE_EXCEEDED) from None
            if granted is None:  # (auto, and the server no longer offers it)
                return None
            return self._fetch_channel(granted, deadline, give_back=False)
        except BaseException:
            self._finish_fetch(reply.transfer_id, quiet=True)
            raise

    def _fetch_channel(self, reply, deadline, give_back=True):
        """(reply, channel) of a fetch's plan with its grant; None (auto) to use the
        proxy, the plan given back unless give_back=False."""
        if len(reply.shards) != 1:
            self._finish_fetch(reply.transfer_id, quiet=True)
            raise MeshdError("INTERNAL", f"direct fetch: the plan has {len(reply.shards)} "
                             f"shards, not 1")
        try:
            chans = self._channels_for(reply, "fetch", deadline)
        except BaseException:
            self._finish_fetch(reply.transfer_id, quiet=True)
            raise
        if chans is None and give_back:
            self._finish_fetch(reply.transfer_id, quiet=True)
        return None if chans is None else (reply, chans[0])

    def _finish_fetch(self, transfer_id, deadline=None, quiet=False, receipt=b""):
        """FinishFetch by deadline; quiet (no deadline: a short one of its own) ends a
        fetch that failed and raises nothing. Past the deadline the transfer is ended
        quietly too (the call may not have reached the server, which would keep the
        slot). receipt: the Read's read_receipt (it took the snapshot: no
        DropSnapshot follows)."""
        with self._lock:  # (its plan's request is no longer wanted)
            self._fetch_req.pop(transfer_id, None)
        s, pb = self.session, self.session._pb
        fin = s._ch.unary_unary(_SVC + "FinishFetch", request_serializer=lambda m: m.SerializeToString(),
                                response_deserializer=pb.FinishFetchReply.FromString)
        try:
            fin(pb.FinishFetchRequest(transfer_id=transfer_id, read_receipt=receipt), metadata=s._md,
                timeout=min(s.timeout, _CLEANUP_TIMEOUT) if deadline is None else _left(deadline))
        except grpc.RpcError as e:
            if quiet:
                return
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._finish_fetch(transfer_id, quiet=True)
            raise MeshdError.from_rpc(e) from None
        except ValueError as e:
            if not _closed_channel(e):
                raise
            if not quiet:
                raise _closed_error("FinishFetch") from None

    def fetch_finish(self, ref, planned, np_dtype, deadline, progress=None, on_stop=None):
        """Reads the planned shard into one preallocated array (each chunk copied once,
        into its place), then FinishFetch (which raises if the value failed on any
        rank), both by deadline (time.monotonic(): the fetch's, as fetch_plan's).
        Called on the fetch's own thread: a fetch that reads alone reads there;
        one that starts while others read goes to the session's io loop (_IoLoop), so
        that the shards of a sharded fetch share a thread instead of taking turns.
        A fetch that the session's close() cuts raises MeshdError CANCELLED.
        on_stop(fn), if given, gets what cancels the read (tensor.Future._on_stop)."""
        reply, ch = planned
        try:  # (a tensor larger than this machine's memory: MemoryError)
            out = np.empty(tuple(reply.meta.shape), dtype=np_dtype)
            flat = memoryview(out).cast("B") if out.size else memoryview(bytearray())
            tr = _progress.tracker(len(flat), progress, "fetch")
        except BaseException:
            self._finish_fetch(reply.transfer_id, quiet=True)
            raise
        if ch is None:  # planned slot_pending: its grant, once a slot frees
            try:
                granted = self._fetch_grant(reply, deadline)
                if granted is None:  # its agent does not answer (auto): the server's Fetch
                    proxied = self._fetch_by_proxy(reply, tr, deadline, on_stop)
                    if proxied is None:
                        raise MeshdError("UNAVAILABLE", "direct fetch: its agent does not "
                                         "answer, and the session's commands since its plan "
                                         "may have changed the tensor: not fetched through "
                                         "the server either; use data_path=\"proxy\"")
                    return proxied
            except BaseException:
                tr.close()
                raise
            reply, ch = granted
        sh = reply.shards[0]
        what = f"direct fetch of rank {sh.rank} (agent {sh.address})"
        with self._lock:
            self._reading += 1
            together = self._reading > 1
        wait = 0.005
        replanned = False
        receipt = b""
        try:
            while True:
                try:
                    if together:  # another read runs: this one on the io loop
                        fut = self._io.run(self._read_async, reply, sh, ref, flat, tr, deadline)
                        if on_stop is not None:
                            on_stop(fut.cancel)
                        try:
                            receipt = fut.result(_left(deadline) + _IO_GRACE)
                        except concurrent.futures.TimeoutError:
                            fut.cancel()
                            raise MeshdError("DEADLINE_EXCEEDED", f"{what}: no end by its deadline",
                                             grpc.StatusCode.DEADLINE_EXCEEDED) from None
                        except concurrent.futures.CancelledError:  # close() ended it
                            raise _closed_error(what) from None
                    else:  # alone: here, a hop less (1 shard: 1.13-1.18 GB/s on the loop, 1.34 here)
                        receipt = self._read(ch, sh, ref, flat, tr, deadline, on_stop)
                    break
                except grpc.RpcError as e:
                    again = None if replanned else self._replan_late_fetch(e, reply, deadline)
                    if again is not None:  # its grant came too late: a new plan, once
                        reply, ch = again
                        sh = reply.shards[0]
                        replanned = True
                        continue
                    # The agent's bound on Reads waiting for their seq (64, all sessions):
                    # refused before any byte, its grant kept for a retry; the waiting
                    # Reads end as their seqs run. Again until the deadline.
                    if not _reads_full(e) or _left(deadline) <= wait:
                        raise
                time.sleep(wait)
                wait = min(wait * 2, 0.2)
        except grpc.RpcError as e:
            if self.mode == "auto" and _nonces_full(e):  # the proxy takes it over, if it may
                proxied = self._fetch_by_proxy(reply, tr, deadline, on_stop)
                if proxied is not None:
                    return proxied
            tr.close()
            self._finish_fetch(reply.transfer_id, quiet=True)
            raise _shard_error(e, "fetch", sh) from None
        except BaseException as e:  # our checks, or the progress callback's exception
            tr.close()
            self._finish_fetch(reply.transfer_id, quiet=True)
            if _closed_channel(e):
                raise _closed_error(what) from None
            raise
        finally:
            with self._lock:
                self._reading -= 1
        try:  # raises if the value failed on any rank of its mesh
            self._finish_fetch(reply.transfer_id, deadline, receipt=receipt)
        except BaseException:
            tr.close()
            raise
        self.counts["fetch"] += 1
        tr.close(ok=True)
        return out

    def _replan_late_fetch(self, e, reply, deadline):
        """(reply, channel) of a new plan for a fetch whose Read (grpc.RpcError e) was
        refused only because it started past its grant's start-by time (this process
        was paused between plan and Read: nothing was read), its old plan given back;
        else None. Only when no command was sent since the first plan (a new plan
        snapshots the tensor where the stream is now: a later in-place command would
        change the value; see _given_back_unchanged)."""
        if not _late_grant(e) or _left(deadline) <= 0:
            return None
        with self._given_back_unchanged(reply) as req:
            # (None: a command since, or auto and the direct path gone meanwhile)
            again = None if req is None else self.fetch_plan(req, deadline)
        if again is not None and again[1] is None:  # slot_pending: outside the lock
            pending = again[0]
            again = self._fetch_grant(pending, deadline)
            if again is None:  # (auto, its agent does not answer)
                self._finish_fetch(pending.transfer_id, quiet=True)
        return again

    @contextlib.contextmanager
    def _given_back_unchanged(self, reply):
        """Gives planned fetch reply's plan back (FinishFetch), then yields its
        FetchRequest with the session's commands held back (its lock) while the block
        plans it again or fetches it through the server, so that no command sent
        meanwhile changes the value it gets; or None (the lock not held) when a
        command was sent since its plan: the fetch cannot be made again with the
        value its plan snapshot. (A fetch's thread is not the caller's: fetch_shard
        returned, and the caller may send commands at once.) The plan goes first: its
        transfer slot may be what the lock's holder waits for (an upload's plan with
        --session-max-transfers taken)."""
        s = self.session
        with self._lock:
            req, seq = self._fetch_req.get(reply.transfer_id, (None, None))
        self._finish_fetch(reply.transfer_id, quiet=True)
        if req is None or seq != s._seq:  # (a cheap look first: no wait for the lock)
            yield None
            return
        with s._lock:
            yield req if seq == s._seq else None

    def _fetch_by_proxy(self, reply, tr, deadline, on_stop=None):
        """auto: the array of planned fetch reply, its plan given back, read by the
        proxied Fetch (on tr's bar, which goes on) instead of its Read, which its agent
        refused before any byte (the agent's grant table is full: _nonces_full); None
        (the caller raises that refusal) when a command was sent since its plan
        (_given_back_unchanged). Raises what the Fetch does."""
        from .tensor import _fetch_finish, _fetch_start
        s = self.session
        try:
            with self._given_back_unchanged(reply) as req:
                if req is None:
                    return None
                call, first = _fetch_start(s, req, _left(deadline))
        except BaseException as e:
            tr.close()
            if _closed_channel(e):
                raise _closed_error("Fetch") from None
            raise
        if on_stop is not None:
            on_stop(call.cancel)
        tr.again()
        return _fetch_finish(s, call, first, tr=tr)

    def _read_call(self, ch, sh, ref, deadline):
        """Agent/Read of the shard on ch (a channel of grpc or grpc.aio), by deadline."""
        from .tensor import _split_data_field
        fn = ch.unary_stream(_AGENT + "Read", request_serializer=lambda b: b,
                             # the spec: its receipt (grpc takes None for a failed decode)
                             response_deserializer=lambda raw: (_split_data_field(raw) or
                                                                _ReadSpec(_read_receipt_of(raw))))
        return fn(_read_request(self.session.id, ref, _READ_CHUNK, sh.after_seq),
                  metadata=((GRANT_MD, sh.grant),), timeout=_left(deadline))

    @staticmethod
    def _into(flat, got, piece, tr):
        """Copies a Read's message into place: the bytes now in flat."""
        if isinstance(piece, _ReadSpec):  # the spec: the plan's meta already said it
            return got
        if got + len(piece) > len(flat):
            raise MeshdError("INTERNAL", "direct fetch: the agent sent more bytes than the "
                             "TensorMeta describes")
        flat[got:got + len(piece)] = piece
        tr.update(len(piece))
        return got + len(piece)

    @staticmethod
    def _check_all(flat, got):
        if got != len(flat):
            raise MeshdError("INTERNAL", f"direct fetch: got {got} bytes where the TensorMeta "
                             f"needs {len(flat)}")

    def _read(self, ch, sh, ref, flat, tr, deadline, on_stop=None):
        """Agent/Read of the shard into flat on this thread, on ch (fetch_plan's): its
        read_receipt (b"" if none); raises grpc.RpcError, our MeshdError, or the
        progress callback's exception (the call then cancelled)."""
        call = self._read_call(ch, sh, ref, deadline)
        if on_stop is not None:
            on_stop(call.cancel)
        got, receipt = 0, b""
        try:
            for piece in call:
                if isinstance(piece, _ReadSpec):
                    receipt = piece.receipt
                got = self._into(flat, got, piece, tr)
            self._check_all(flat, got)
        except BaseException:  # (a call that failed is over: its cancel does nothing)
            call.cancel()
            raise
        return receipt

    async def _read_async(self, reply, sh, ref, flat, tr, deadline):
        """_read on the io loop."""
        call = self._read_call(self._io.channel(sh.address, _tls_of(reply)), sh, ref, deadline)
        got, receipt = 0, b""
        try:
            async for piece in call:
                if isinstance(piece, _ReadSpec):
                    receipt = piece.receipt
                got = self._into(flat, got, piece, tr)
            self._check_all(flat, got)
        except BaseException:  # (a call that failed is over: its cancel does nothing)
            call.cancel()
            raise
        return receipt
