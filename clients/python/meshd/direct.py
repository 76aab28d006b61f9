"""The direct data path (docs/protocol.md, Direct data path): the server plans an
upload or a fetch (PlanTransfer) and hands out one grant per shard; the client then
streams the bytes straight to or from each agent (Agent/Write, Agent/Read), all
shards in parallel, and tells the server (FinishUpload with the agents' receipts,
FinishFetch).

data_path (meshd.connect): "direct" always takes this path; "proxy" never does;
"auto" (default) takes it when the server offers PlanTransfer, the session is not
over TLS (the agents' channels here are plaintext) and every agent of the pool
answers a connection within CONNECT_TIMEOUT seconds (checked once per session and
address), else the proxied Upload/Fetch.

The agents' messages used here are packed by hand (a few fields): the Python client
generates only tensor_service.proto."""

import concurrent.futures
import threading
import time

import grpc
import numpy as np

from . import _progress
from .errors import MeshdError, retry_transfers_full

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


def _read_request(session_id, ref, max_chunk, after_seq):
    """meshd.agent.v1.ReadRequest packed."""
    sid = session_id.encode()
    return (b"\x0a" + _varint(len(sid)) + sid + b"\x10" + _varint(ref) + b"\x18" +
            _varint(max_chunk) + b"\x20" + _varint(after_seq))


class Direct:
    """A session's side of the direct path: its mode, channels to agents, and what it
    learned (whether the server offers PlanTransfer, which addresses answer)."""

    def __init__(self, session, mode):
        if mode not in DATA_PATHS:
            raise ValueError(f"meshd: data_path must be one of {', '.join(DATA_PATHS)}, got {mode!r}")
        self.session, self.mode = session, mode
        self._lock = threading.Lock()
        self._channels = {}
        self._unreachable = {}  # address -> time it failed
        self._offered = None  # None: not known yet; False: the server refused PlanTransfer
        self._pool_ok = None  # auto: every agent of the pool answered
        self._probed = 0.0  # when _pool_ok was last found
        self.counts = {"upload": 0, "fetch": 0}  # transfers that took the direct path

    def close(self):
        with self._lock:
            chans, self._channels = list(self._channels.values()), {}
        for ch in chans:
            ch.close()

    # ------------------------------------------------------------ reachability
    def _channel(self, address, timeout=CONNECT_TIMEOUT):
        """A ready channel to the agent at address, or None when it does not connect
        within timeout (remembered for a while)."""
        with self._lock:
            ch = self._channels.get(address)
            failed = self._unreachable.get(address)
        if ch is not None:
            return ch
        if failed is not None and time.monotonic() - failed < _UNREACHABLE_FOR:
            return None
        ch = grpc.insecure_channel(address, options=_OPTIONS)
        try:
            grpc.channel_ready_future(ch).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            ch.close()
            with self._lock:
                self._unreachable[address] = time.monotonic()
            return None
        with self._lock:
            other = self._channels.setdefault(address, ch)
        if other is not ch:
            ch.close()
        return other

    def _pool_reachable(self):
        """auto: whether every agent of the pool answers (probed in parallel, once; a
        failed probe is tried again after a while)."""
        if self._pool_ok is None or (not self._pool_ok and
                                     time.monotonic() - self._probed > _UNREACHABLE_FOR):
            self._probed = time.monotonic()
            try:
                addrs = [a["address"] for a in self.session.agents()]
            except MeshdError:
                return False
            with concurrent.futures.ThreadPoolExecutor(max(1, min(16, len(addrs)))) as ex:
                ok = all(ex.map(lambda a: self._channel(a) is not None, addrs))
            self._pool_ok = ok and bool(addrs)
        return self._pool_ok

    def wanted(self):
        """Whether the next transfer should try the direct path."""
        if self.mode == "proxy" or self.session.closed:
            return False
        if self.mode == "direct":
            return True
        # A session over TLS asked for its bytes encrypted: agents speak plaintext
        # to clients (the channels here are insecure), so auto keeps to the server.
        if self.session.tls:
            return False
        return self._offered is not False and self._pool_reachable()

    # ------------------------------------------------------------ server calls
    def plan(self, request):
        """PlanTransfer: its reply, or None when the server does not offer it (auto
        then uses the proxy). Raises MeshdError for a refused plan."""
        s = self.session
        fn = s._ch.unary_unary(_SVC + "PlanTransfer", request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=s._pb.PlanTransferReply.FromString)
        try:  # the session's own transfers in flight end soon: wait for one (errors.py)
            return retry_transfers_full(lambda: fn(request, metadata=s._md, timeout=s.timeout),
                                        s.timeout)
        except grpc.RpcError as e:
            not_offered = e.code() == grpc.StatusCode.UNIMPLEMENTED or (
                e.code() == grpc.StatusCode.FAILED_PRECONDITION and "--data-path" in (e.details() or ""))
            if self.mode == "auto" and not_offered:
                self._offered = False
                return None
            raise MeshdError.from_rpc(e) from None

    def _channels_for(self, shards):
        """A channel per shard, or None if an agent does not connect."""
        out = []
        for sh in shards:
            ch = self._channel(sh.address)
            if ch is None:
                return None
            out.append(ch)
        return out

    # ------------------------------------------------------------ upload
    def upload(self, hdr, raw, progress=None):
        """Uploads raw (a byte memoryview) as UploadHeader hdr (ref already chosen, the
        session lock held). Returns the UploadReply-like FinishUploadReply, or None
        when the direct path is not available (nothing was defined; the caller uses
        the proxy with a new ref). progress (meshd._progress) counts the array's bytes
        as the proxy does: with per_rank the bytes sent to all agents together, else
        the bytes every agent got (the slowest's)."""
        s, pb = self.session, self.session._pb
        reply = self.plan(pb.PlanTransferRequest(upload=hdr))
        if reply is None:
            return None
        chans = self._channels_for(reply.shards)
        if chans is None:
            self._abandon_upload(reply.transfer_id)
            if self.mode == "direct":
                raise MeshdError("UNAVAILABLE", "direct upload: an agent does not answer at "
                                 f"{', '.join(sh.address for sh in reply.shards)} within "
                                 f"{CONNECT_TIMEOUT} s; use data_path=\"auto\" or \"proxy\" from "
                                 "outside the cluster")
            self._pool_ok, self._probed = False, time.monotonic()
            return None
        n = len(reply.shards)
        each = len(raw) // n if hdr.per_rank and n else len(raw)
        from .tensor import _data_field
        tr = _progress.tracker(len(raw), progress, "upload")
        tr_lock = threading.Lock()  # one tracker call at a time, from any shard's thread
        aborted = []  # the progress callback's exception: every shard stops
        sent = [0] * n

        def write(i):
            sh = reply.shards[i]
            part = raw[i * each:(i + 1) * each] if hdr.per_rank else raw
            fn = chans[i].stream_unary(_AGENT + "Write", request_serializer=lambda b: b,
                                       response_deserializer=lambda b: b)

            def chunks():
                for off in range(0, len(part), _CHUNK):
                    if aborted:  # a short Write: the agent stores nothing
                        return
                    yield _data_field(part[off:off + _CHUNK])
                    try:  # runs when gRPC takes the next message
                        with tr_lock:
                            sent[i] += min(_CHUNK, len(part) - off)
                            tr.set(sum(sent) if hdr.per_rank else min(sent))
                    except BaseException as e:
                        aborted.append(e)
                        return
            out = _fields(fn(chunks(), metadata=((GRANT_MD, sh.grant),), timeout=s.timeout))
            return pb.WriteReceipt(rank=sh.rank, bytes=out.get(1, 0), receipt=out.get(2, b""))
        try:
            receipts, err = self._parallel(write, n)
            if aborted:
                receipts, err = [], aborted[0]
            res = self._finish_upload(reply.transfer_id, receipts, err)
        except BaseException:
            tr.close()  # the bar stops where it stood; the callback hears no more
            raise
        self.counts["upload"] += 1
        tr.close(ok=True)
        return res

    def _finish_upload(self, transfer_id, receipts, err):
        """FinishUpload; sent even when a Write failed (err), so that the server undoes
        the transfer at once; then err is raised."""
        s, pb = self.session, self.session._pb
        fin = s._ch.unary_unary(_SVC + "FinishUpload", request_serializer=lambda m: m.SerializeToString(),
                                response_deserializer=pb.FinishUploadReply.FromString)
        try:
            res = fin(pb.FinishUploadRequest(transfer_id=transfer_id,
                                             receipts=[r for r in receipts if r is not None]),
                      metadata=s._md, timeout=s.timeout)
        except grpc.RpcError as e:
            if err is not None:
                raise err from None
            raise MeshdError.from_rpc(e) from None
        if err is not None:
            raise err
        return res

    def _abandon_upload(self, transfer_id):
        s, pb = self.session, self.session._pb
        fin = s._ch.unary_unary(_SVC + "FinishUpload", request_serializer=lambda m: m.SerializeToString(),
                                response_deserializer=pb.FinishUploadReply.FromString)
        try:  # no receipts: the server undoes it and frees the session's slot at once
            fin(pb.FinishUploadRequest(transfer_id=transfer_id), metadata=s._md, timeout=s.timeout)
        except grpc.RpcError:
            pass

    @staticmethod
    def _parallel(fn, n):
        """fn(i) for i in range(n) on threads: (results, first MeshdError or None)."""
        out, err = [None] * n, None
        if n == 1:
            try:
                out[0] = fn(0)
            except grpc.RpcError as e:
                err = MeshdError.from_rpc(e)
            return out, err
        with concurrent.futures.ThreadPoolExecutor(n) as ex:
            jobs = [ex.submit(fn, i) for i in range(n)]
            for i, j in enumerate(jobs):
                try:
                    out[i] = j.result()
                except grpc.RpcError as e:
                    err = err or MeshdError.from_rpc(e)
        return out, err

    # ------------------------------------------------------------ fetch
    def fetch_plan(self, req, timeout):
        """PlanTransfer for a FetchRequest: (reply, channel), or None to use the proxy.
        Planned before it returns: later commands cannot change the value."""
        s, pb = self.session, self.session._pb
        reply = self.plan(pb.PlanTransferRequest(fetch=req))
        if reply is None:
            return None
        ch = self._channel(reply.shards[0].address)
        if ch is None:
            self._finish_fetch(reply.transfer_id, timeout, quiet=True)
            if self.mode == "direct":
                raise MeshdError("UNAVAILABLE", f"direct fetch: the agent at "
                                 f"{reply.shards[0].address} does not answer within "
                                 f"{CONNECT_TIMEOUT} s; use data_path=\"auto\" or \"proxy\"")
            self._pool_ok, self._probed = False, time.monotonic()
            return None
        return reply, ch

    def _finish_fetch(self, transfer_id, timeout, quiet=False):
        s, pb = self.session, self.session._pb
        fin = s._ch.unary_unary(_SVC + "FinishFetch", request_serializer=lambda m: m.SerializeToString(),
                                response_deserializer=pb.FinishFetchReply.FromString)
        try:
            fin(pb.FinishFetchRequest(transfer_id=transfer_id), metadata=s._md,
                timeout=s.timeout if timeout is None else timeout)
        except grpc.RpcError as e:
            if not quiet:
                raise MeshdError.from_rpc(e) from None

    def fetch_finish(self, ref, planned, np_dtype, timeout, progress=None):
        """Reads the planned shard into one preallocated array (each chunk copied once,
        into its place), then FinishFetch (which raises if the value failed on any
        rank)."""
        from .tensor import _split_data_field
        s = self.session
        reply, ch = planned
        sh = reply.shards[0]
        out = np.empty(tuple(reply.meta.shape), dtype=np_dtype)
        flat = memoryview(out).cast("B") if out.size else memoryview(bytearray())
        fn = ch.unary_stream(_AGENT + "Read", request_serializer=lambda b: b,
                             # False for the spec (grpc takes None for a failed decode)
                             response_deserializer=lambda raw: _split_data_field(raw) or False)
        got = 0
        tr = _progress.tracker(len(flat), progress, "fetch")
        call = fn(_read_request(s.id, ref, _READ_CHUNK, sh.after_seq),
                  metadata=((GRANT_MD, sh.grant),),
                  timeout=s.timeout if timeout is None else timeout)
        try:
            for piece in call:
                if piece is False:  # the spec: the plan's meta already said it
                    continue
                if got + len(piece) > len(flat):
                    raise MeshdError("INTERNAL", "direct fetch: the agent sent more bytes than "
                                     "the TensorMeta describes")
                flat[got:got + len(piece)] = piece
                got += len(piece)
                tr.update(len(piece))
            if got != len(flat):
                raise MeshdError("INTERNAL", f"direct fetch: got {got} bytes where the "
                                 f"TensorMeta needs {len(flat)}")
        except grpc.RpcError as e:
            tr.close()
            self._finish_fetch(reply.transfer_id, timeout, quiet=True)
            err = MeshdError.from_rpc(e)  # the agent's words: the rank is ours to say, as
            msg = err.message             # the server says it on the proxied path
            if "(rank " not in msg:
                msg = f"{msg} (rank {sh.rank})"
            raise MeshdError.of_kind(err.kind, msg, err.code) from None
        except BaseException:  # our checks, or the progress callback's exception
            call.cancel()
            tr.close()
            self._finish_fetch(reply.transfer_id, timeout, quiet=True)
            raise
        try:  # raises if the value failed on any rank of its mesh
            self._finish_fetch(reply.transfer_id, timeout)
        except BaseException:
            tr.close()
            raise
        self.counts["fetch"] += 1
        tr.close(ok=True)
        return out
