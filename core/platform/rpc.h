/* meshd's small layer over the gRPC C core (1.51) and protobuf-c.
 *
 * Server side: a service is a static const table of rpc_method_t (one row per
 * RPC), registered with the one pointer its callbacks get as `arg`:
 *
 *   static const rpc_method_t rows[] = {
 *       {.path = "/pkg.Svc/Get", .kind = RPC_UNARY, .request = &get_request__descriptor,
 *        .on_start = get},
 *   };
 *   rpc_server_add_methods(srv, rows, sizeof rows / sizeof rows[0], svc);
 *
 * The layer serves it from one shared completion queue polled by a pool of threads.
 * Handlers are callbacks; they never block a completion-queue thread. A handler
 * that needs to wait (for an agent, a timer) keeps a reference to the call and
 * answers later from any thread: every rpc_call_* function is thread-safe.
 *
 * Client side: blocking helpers (unary with deadline, streaming calls with
 * separate read and write sides that may be used from two threads at once).
 *
 * Messages are protobuf-c messages; the layer packs and unpacks them. */
#ifndef MESHD_RPC_H
#define MESHD_RPC_H

#include <grpc/status.h>
#include <protobuf-c/protobuf-c.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Trailing metadata key that carries a meshd error kind ("WRONG_MESH"). */
#define RPC_KIND_KEY "meshd-error-kind"

/* ================================================================== server */

typedef enum {
  RPC_UNARY,            /* request -> response */
  RPC_CLIENT_STREAMING, /* stream request -> response */
  RPC_SERVER_STREAMING, /* request -> stream response */
  RPC_BIDI,             /* stream request -> stream response */
} rpc_kind_t;

typedef struct rpc_call rpc_call_t;
typedef struct rpc_server rpc_server_t;

/* TLS for a port or a channel: PEM files, read when the server or channel is
 * made. A server re-reads its files when one of them changes (checked at each
 * new handshake), so certificates rotate without a restart.
 *
 * Server: cert_file + key_file are its certificate chain and key; ca_file,
 * when set, makes the port require client certificates signed by that CA
 * (mTLS), or with client_cert_optional ask for one and verify it when
 * presented but admit clients without (rpc_call_peer_verified tells the
 * calls apart; a certificate that does not verify still fails the
 * handshake). Channel: ca_file holds the roots that verify the server (NULL:
 * the system's), or ca_pem the same as PEM text; cert_file + key_file, when
 * set, are the client certificate presented for mTLS; server_name, when set,
 * is the name checked in the server's certificate instead of the target's
 * host (agents reached by IP carry one cluster-wide name). */
typedef struct rpc_tls {
  bool on;
  const char *ca_file;
  const char *cert_file;
  const char *key_file;
  const char *server_name;
  bool client_cert_optional; /* server */
  const char *ca_pem;        /* channel; instead of ca_file */
} rpc_tls_t;

/* Checks that the files `tls` names exist and hold PEM of the right kind (and
 * that ca_pem text holds a certificate), so a daemon fails at startup, and a
 * channel at creation, with a clear message rather than at its first
 * handshake. `what` prefixes the message ("--tls-cert"). server: cert and key
 * are required. Returns 0, or -1 with err. */
int rpc_tls_check(const rpc_tls_t *tls, bool server, char *err, size_t errlen);
/* The private key in key_file belongs to the (first) certificate in cert_file:
 * gRPC refuses a pair that does not only when a port opens or a channel
 * connects, in words that name neither file. Returns 0, or -1 with err. */
int rpc_tls_check_pair(const char *cert_file, const char *key_file, char *err, size_t errlen);
/* The PEM text in path (at most 16 MiB), checked to hold a block whose label
 * contains `label` ("CERTIFICATE"); caller frees. NULL with err naming `what`
 * and the path. */
char *rpc_tls_read_pem(const char *what, const char *path, const char *label, char *err,
                       size_t errlen);

/* Who a call's guard admitted (rpc_server_add_methods_guarded). */
typedef struct rpc_identity {
  char name[64];   /* a principal ("alice"), "agent", "anonymous" */
  bool admin;
  /* Admitted without proof of who calls (a probe; a transfer grant the
   * handler checks later): while its request is incomplete the call counts
   * as unauthenticated (rpc_server_opts_t.max_unauthenticated_requests), as
   * every call to a method without a guard does. */
  bool unauthenticated;
  /* What the guard checked, when it can be revoked later (a bearer token's
   * digest): rpc_server_end_calls_of asks again with it. */
  bool has_credential;
  uint8_t credential[32];
} rpc_identity_t;

/* Runs before on_start for every call to a guarded method, at its headers
 * (before any of its request is read), on a
 * completion-queue thread (so: quick, no blocking). Returns GRPC_STATUS_OK and
 * fills *id to admit the call; any other code refuses it with msg (nothing of
 * the call's handler runs). */
typedef grpc_status_code (*rpc_guard_fn)(rpc_call_t *call, void *guard_arg, rpc_identity_t *id,
                                         char *msg, size_t msglen);

/* One row of a server's method table. Rows hold no state: the `arg` every
 * callback gets is given to rpc_server_add_methods with the rows.
 *
 * Callback order for one call: on_start once; then, for streaming requests,
 * on_message for each request message and on_message(NULL) at the client's
 * half-close; then on_end once. Callbacks of one call never run concurrently,
 * and on_end runs after every other callback of that call has returned. A call
 * refused before on_start (its request does not decode) gets no callback at all. */
/* A packed message, not unpacked (see "Raw messages" below). */
struct grpc_byte_buffer;
typedef struct grpc_byte_buffer rpc_bytes_t;

typedef struct rpc_method {
  const char *path;                          /* "/meshd.v1.TensorService/Execute" */
  rpc_kind_t kind;
  const ProtobufCMessageDescriptor *request; /* requests are unpacked with it */
  /* Unary and server-streaming: `req` is the request. Streaming requests: NULL.
   * `req` belongs to the layer and is valid until the callback returns.
   * Unary handlers must eventually answer with rpc_call_reply or rpc_call_finish.
   * Required for every kind: a row without it is answered UNIMPLEMENTED. */
  void (*on_start)(rpc_call_t *call, const ProtobufCMessage *req, void *arg);
  /* Streaming requests only (may be NULL for other kinds). Owned by the layer. */
  void (*on_message)(rpc_call_t *call, const ProtobufCMessage *msg, void *arg);
  /* The call is over: status sent, or the peer cancelled / disconnected
   * (cancelled = true). May be NULL. Release handler state here. */
  void (*on_end)(rpc_call_t *call, bool cancelled, void *arg);
  /* Streaming requests, optional: sees each message packed before it is
   * unpacked; returns true having taken it (rpc_bytes_free it when done; the
   * next read is armed as after on_message), false to have it unpacked and
   * handed to on_message as usual. For relays that forward bulk bytes as
   * they came (rpc_bytes_is_field). */
  bool (*on_raw)(rpc_call_t *call, rpc_bytes_t *msg, void *arg);
  /* Streaming requests, optional: a message could not be unpacked, and the
   * layer ends the call with INVALID_ARGUMENT as soon as this returns. The
   * handler's last chance to send what it holds back (what it sends now goes
   * out before the status). */
  void (*on_refused)(rpc_call_t *call, void *arg);
} rpc_method_t;

/* Shortest interval between a client's pings the server accepts without a
 * strike (strikes never lead to GOAWAY anyway): agents ping their server and
 * the server pings its agents every second. */
#define RPC_SERVER_MIN_PING_MS 500

/* rpc_server_opts_t.max_unauthenticated_requests when <= 0. */
#define RPC_DEFAULT_MAX_UNAUTHENTICATED 16
#define RPC_DEFAULT_HANDSHAKE_TIMEOUT_MS 10000

typedef struct rpc_server_opts {
  const char *listen;          /* "127.0.0.1:0", "[::]:50051"; port 0 picks a free one */
  int threads;                 /* completion-queue threads; <= 0: 2 */
  int max_message_bytes;       /* both directions; <= 0: 4 MiB */
  /* Keepalive, after gRPC's guide (docs/operations.md): the server pings a
   * connection only while it has calls in flight (a client stuck in a long
   * call is noticed), never an idle one (a client that does not poll its
   * socket between calls, like Python's sync stack, would miss the ack and
   * lose the connection), rarely, and waits long for the ack. A connection
   * whose ack is late is closed, which ends its calls. Clients may ping down
   * to every RPC_SERVER_MIN_PING_MS and are never sent GOAWAY for pinging. */
  int keepalive_ms;            /* <= 0: 30000 */
  int keepalive_timeout_ms;    /* <= 0: 20000 */
  /* HTTP/2 receive window per stream: how many bytes a client may send ahead
   * of the handler's reads. <= 0: gRPC's adaptive window (BDP probing), which
   * grows to megabytes on a busy stream, so a fast client can park tens of
   * thousands of small messages in the server before a paused read
   * (rpc_call_pause_reads) slows it. > 0: fixed at this size (BDP probing off);
   * a larger message still goes through while a read waits for it (the window
   * is given back as it arrives), at up to a window per round trip. */
  int stream_window_bytes;
  rpc_tls_t tls;               /* .on: TLS (and mTLS with .ca_file) on this port */
  /* A connection with no call for this long is closed (GRPC_ARG_MAX_CONNECTION_IDLE_MS);
   * <= 0: 10 minutes. Clients reconnect on their next call. */
  int max_connection_idle_ms;
  /* A connection must finish its handshake (TLS, and the HTTP/2 preface with
   * its SETTINGS) within this long (GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS), else
   * it is closed: a stranger's silent connection holds an fd and ~20 KiB.
   * <= 0: RPC_DEFAULT_HANDSHAKE_TIMEOUT_MS (gRPC's own default is 120 s). */
  int handshake_timeout_ms;
  /* Calls one connection may have open at once; <= 0: 1024. */
  int max_concurrent_streams;
  /* A unary or server-streaming call's request is read only once its guard
   * admitted the caller (until then gRPC holds at most a stream window of it),
   * and a read makes gRPC take the whole message, up to max_message_bytes.
   * Calls that nothing authenticated (methods without a guard, identities
   * marked unauthenticated) may have at most this many requests incomplete
   * at once (a streaming request counts until its first message comes);
   * past it the oldest are cancelled RESOURCE_EXHAUSTED (a stream only once
   * it waited 1 s for its first message: honest bursts are read late, not
   * refused). What
   * strangers make the server hold before a guard: about this many messages.
   * <= 0: RPC_DEFAULT_MAX_UNAUTHENTICATED; never below 2 * max(4, 2 * threads)
   * + threads (the calls a burst of probes has queued ahead of its reads). */
  int max_unauthenticated_requests;
  /* gRPC's memory quota for this port (GRPC_ARG_RESOURCE_QUOTA): what its
   * connections' read buffers, HTTP/2 state and calls may take together.
   * Near it gRPC reads in smaller pieces, and past it closes connections
   * without calls (GOAWAY), then cancels calls (RESOURCE_EXHAUSTED "Buffers
   * full"), so strangers' connections cannot grow the process without bound.
   * 0: no quota (gRPC's default). */
  uint64_t memory_bytes;
  /* Runs on a completion-queue thread when no event is ready and it is about
   * to wait for one: where handlers that held work back to batch it (the
   * agents' links, corked until idle) let it go. NULL: none. */
  void (*before_wait)(void);
} rpc_server_opts_t;

/* On a completion-queue thread of a server with a before_wait hook: marks
 * that this thread holds work back, so it runs the hook before it next waits
 * (it looks for a ready event first only then), and returns true. Elsewhere
 * returns false: nothing would let the work go. */
bool rpc_server_hold_until_idle(void);

/* Creates a server. Returns NULL and a message in err on failure. */
rpc_server_t *rpc_server_create(const rpc_server_opts_t *opts, char *err, size_t errlen);
/* Adds n rows to the method table; every callback of these rows gets `arg`.
 * The rows, and what arg points to, must outlive the server. Before start only.
 * Returns 0, or -1 if a path is already registered. */
int rpc_server_add_methods(rpc_server_t *srv, const rpc_method_t *methods, size_t n, void *arg);
/* The same, with a guard that admits or refuses each call before on_start
 * (authentication). Rows added without a guard are open to every caller. */
int rpc_server_add_methods_guarded(rpc_server_t *srv, const rpc_method_t *methods, size_t n,
                                   void *arg, rpc_guard_fn guard, void *guard_arg);
/* Binds the port, starts the threads. Returns the bound port (> 0) or -1 with err
 * ("address already in use: 127.0.0.1:50051"). Unknown methods are answered with
 * UNIMPLEMENTED naming the method. */
int rpc_server_start(rpc_server_t *srv, char *err, size_t errlen);
int rpc_server_port(const rpc_server_t *srv);
/* The paths ("/pkg.Svc/Method") of every row added so far, in the order they
 * were added: how many, at most cap of them written to paths (the rows' own
 * strings). The table is fixed once the server has started. */
size_t rpc_server_paths(const rpc_server_t *srv, const char **paths, size_t cap);
/* Calls started and not yet ended (all methods). */
int rpc_server_active_calls(rpc_server_t *srv);
/* Ends every call started and not yet ended, except those of except_path
 * (NULL: none), as rpc_call_abort(code, kind, msg) would: what was queued for
 * them goes, their on_end runs as usual. How many. */
int rpc_server_end_calls(rpc_server_t *srv, const char *except_path, grpc_status_code code,
                         const char *kind, const char *msg);
/* Ends, as rpc_server_end_calls does, every call not yet ended whose guard's
 * identity has a credential that revoked(id, arg) says no longer holds (a
 * token removed at a reload); the status reads "principal 'NAME': msg".
 * revoked runs without the server's locks. How many. A call whose guard was
 * admitting it meanwhile (its identity not yet stored) is asked the same by
 * its own thread once the guard returns, and refused with that status
 * (nothing of it runs): revoked and arg must stay valid while the server
 * lives. */
int rpc_server_end_calls_of(rpc_server_t *srv,
                            bool (*revoked)(const rpc_identity_t *id, void *arg), void *arg,
                            grpc_status_code code, const char *kind, const char *msg);
/* Stops accepting new calls; calls already running go on. Idempotent. */
void rpc_server_stop_accepting(rpc_server_t *srv);
/* Waits up to grace_seconds for running calls to end, then cancels the rest,
 * stops and joins the threads. Every on_end has run when it returns. Idempotent;
 * implies stop_accepting. */
void rpc_server_shutdown(rpc_server_t *srv, double grace_seconds);
/* Frees the server; shuts it down first (grace 0) if needed. */
void rpc_server_destroy(rpc_server_t *srv);

/* --- calls: all thread-safe ------------------------------------------------ */

/* Queues a message on a server-streaming or bidi call (or the single response of
 * a client-streaming one). Packed at once; the caller keeps ownership of msg.
 * Returns 0, or -1 if the call has ended or a status is already queued. */
int rpc_call_send(rpc_call_t *call, const ProtobufCMessage *msg);
/* Ends the call with a status after every queued message is sent. `kind`, when
 * not NULL, travels as trailing metadata RPC_KIND_KEY. Later calls are ignored. */
void rpc_call_finish(rpc_call_t *call, grpc_status_code code, const char *kind,
                     const char *fmt, ...) __attribute__((format(printf, 4, 5)));
/* Ends the call with a status now: the messages queued and not yet handed
 * to gRPC are dropped, and when one is in flight (a peer that stopped reading
 * holds it back through flow control) or sends are held, the stream is reset
 * with the status instead (without the kind trailer). For a deadline of the
 * handler's own. Later calls, and a status already queued, win as with
 * rpc_call_finish. */
void rpc_call_abort(rpc_call_t *call, grpc_status_code code, const char *kind,
                    const char *fmt, ...) __attribute__((format(printf, 4, 5)));
/* rpc_call_send(msg) then rpc_call_finish(OK). */
void rpc_call_reply(rpc_call_t *call, const ProtobufCMessage *msg);
/* rpc_call_reply, ms from now, from a thread of its own (injected faults:
 * a late answer, while the handler's thread, maybe the server's only rpc
 * thread, goes on). 0, or -1 when it could not (answer now instead). */
int rpc_call_reply_after(rpc_call_t *call, const ProtobufCMessage *msg, int ms);
/* What is left of the deadline the client gave the call, in ms (0 once past);
 * -1: none. For a handler's own calls on its behalf. */
int64_t rpc_call_deadline_left_ms(const rpc_call_t *call);
/* The largest message the call's server sends (its max_message_bytes):
 * rpc_call_reply finishes the call with RESOURCE_EXHAUSTED ("QUOTA") instead
 * of sending a larger reply. */
int rpc_call_max_message(const rpc_call_t *c);
/* Messages queued and not yet sent: a handler producing many messages pauses
 * when this grows. Reads are not re-armed while it is above 64 (backpressure). */
size_t rpc_call_pending(rpc_call_t *call);
/* Flow control by the handler. Pauses nest: each pause needs one resume, from
 * any thread (a callback of the call, or another thread that holds a ref).
 *
 * rpc_call_pause_reads: no further request message is read until the last
 * resume; a read already in flight still delivers its message (a pause taken
 * inside on_message takes effect at once: the next read is armed only after
 * on_message returns). The client's writes back up through gRPC's flow control
 * once its window is full. Resuming re-arms the read. Streaming requests only.
 *
 * rpc_call_hold_sends: queued messages and the status wait until the last
 * release (a unary handler may answer now and let the answer go later).
 *
 * A call that ends (cancelled, deadline) while paused or held ends as usual:
 * on_end runs and what was held is dropped; a late resume/release is harmless. */
void rpc_call_pause_reads(rpc_call_t *call);
void rpc_call_resume_reads(rpc_call_t *call);
void rpc_call_hold_sends(rpc_call_t *call);
void rpc_call_release_sends(rpc_call_t *call);
/* For a handler that relays another stream (a Fetch from an agent's Read):
 * cb(call, arg) runs once, as a callback of the call (never at the same time as
 * its others, never after on_end), as soon as at most `below` messages are
 * queued, i.e. the peer has taken the rest through HTTP/2 flow control, or when
 * the call ends first (rpc_call_ended is then true). Returns true when the wait
 * is registered; false when there is nothing to wait for (at most `below`
 * queued already, or the call ended): cb is not called then. One wait per call;
 * a second replaces the first. The caller keeps whatever cb needs alive. */
bool rpc_call_when_drained(rpc_call_t *call, size_t below, void (*cb)(rpc_call_t *call, void *arg),
                           void *arg);
/* True once on_end has run or is about to. */
bool rpc_call_ended(rpc_call_t *call);
/* Request metadata value for key into buf (NUL-terminated, truncated to len-1).
 * Returns buf, or NULL if absent. */
const char *rpc_call_metadata(rpc_call_t *call, const char *key, char *buf, size_t len);
/* The same for a binary value (a "-bin" key, which gRPC has decoded): copies
 * at most len bytes and returns the value's full length, or -1 if absent. */
long rpc_call_metadata_bin(rpc_call_t *call, const char *key, void *buf, size_t len);
/* The peer's address as gRPC reports it ("ipv4:127.0.0.1:4242"). Caller frees. */
char *rpc_call_peer(rpc_call_t *call);
const char *rpc_call_method(const rpc_call_t *call);
/* What the method's guard admitted the call as; NULL for unguarded methods. */
const rpc_identity_t *rpc_call_identity(const rpc_call_t *call);
/* True if the call came over TLS with a client certificate the port verified. */
bool rpc_call_peer_verified(rpc_call_t *call);
/* The same, and the certificate names `name` (a DNS subject alternative name,
 * or its common name when it has no DNS name): a CA that signs more than one kind of certificate
 * (cluster peers, users) is told apart by the name. name NULL or "": verified. */
bool rpc_call_peer_named(rpc_call_t *call, const char *name);
/* One pointer of handler state, set in on_start. */
void rpc_call_set_data(rpc_call_t *call, void *data);
void *rpc_call_data(const rpc_call_t *call);
/* Inside on_message: the handler keeps the message it was given (and every
 * part of it), e.g. until work that points into it is done, and frees it with
 * rpc_kept_free; the layer does not free it. Streamed requests are unpacked
 * into an arena, so that is a few frees however many parts it has (never
 * protobuf_c_message_free_unpacked). NULL outside on_message. */
typedef struct rpc_kept rpc_kept_t;
rpc_kept_t *rpc_call_keep_message(rpc_call_t *call);
void rpc_kept_free(rpc_kept_t *kept);
/* Keeps the call alive past on_end (e.g. held in a list another thread walks).
 * Each rpc_call_ref needs one rpc_call_unref. Without a ref a handler must not
 * touch the call after on_end returns. */
void rpc_call_ref(rpc_call_t *call);
void rpc_call_unref(rpc_call_t *call);

/* ================================================================== client */

typedef struct rpc_channel rpc_channel_t;

typedef struct rpc_channel_opts {
  int max_message_bytes;   /* <= 0: 4 MiB */
  int keepalive_ms;        /* client pings this often; 0: gRPC's default (off) */
  int keepalive_timeout_ms;/* <= 0: 2000 */
  bool own_connection;     /* don't share the TCP connection with other channels */
  /* How long one connection attempt (TCP + HTTP/2 SETTINGS) may take; <= 0:
   * 100 ms, for channels that reconnect quickly to a peer that comes back.
   * A channel made for one call to a live peer wants seconds: with 100 ms a
   * peer slow for a moment fails the call (gRPC takes the minimum reconnect
   * backoff as the minimum connect timeout). */
  int connect_timeout_ms;
  rpc_tls_t tls;           /* .on: TLS to the server (see rpc_tls_t) */
  /* HTTP/2 receive window per stream, as rpc_server_opts_t's: how much a peer
   * may send on a call ahead of its reads. <= 0: gRPC's adaptive window, which
   * grows to megabytes per stream. */
  int stream_window_bytes;
} rpc_channel_opts_t;

typedef struct rpc_status {
  grpc_status_code code;
  char kind[32];           /* RPC_KIND_KEY trailing metadata, "" if none */
  char message[512];
} rpc_status_t;

/* Request metadata. A key ending in "-bin" carries binary bytes, which a C
 * string cannot: give its value as hex (2 digits a byte); the call sends the
 * bytes (gRPC base64s them on the wire). */
typedef struct rpc_md {
  const char *key;
  const char *value;
} rpc_md_t;

/* opts may be NULL. Fails (NULL) only when TLS files cannot be read
 * (rpc_tls_check says why); connection problems, a bad target included, show
 * up on calls (UNAVAILABLE) or in rpc_channel_wait_ready. */
rpc_channel_t *rpc_channel_create(const char *target, const rpc_channel_opts_t *opts);
void rpc_channel_destroy(rpc_channel_t *ch);
/* Connects now; true once READY, false on timeout or failure. */
bool rpc_channel_wait_ready(rpc_channel_t *ch, int timeout_ms);
/* Connects now and stops at the first failed attempt (nothing listens, the
 * host is unreachable or unknown, the TLS handshake failed) instead of
 * retrying until timeout_ms: for tools that should say so at once. */
typedef enum { RPC_CONNECT_READY, RPC_CONNECT_FAILED, RPC_CONNECT_TIMEOUT } rpc_connect_t;
rpc_connect_t rpc_channel_connect(rpc_channel_t *ch, int timeout_ms);
/* True once the channel is no longer READY (its connection closed: the server
 * went away or closed it as idle); false on timeout. */
bool rpc_channel_wait_idle(rpc_channel_t *ch, int timeout_ms);

/* Blocking unary call. On OK stores the unpacked reply in *resp (free with
 * protobuf_c_message_free_unpacked) and returns GRPC_STATUS_OK. Otherwise
 * returns the code, *resp = NULL, and st (may be NULL) says why. A reply that is
 * not a valid `resp_desc` message is INTERNAL. timeout_ms <= 0: no deadline. */
grpc_status_code rpc_unary(rpc_channel_t *ch, const char *method, const ProtobufCMessage *req,
                           const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp,
                           const rpc_md_t *md, size_t nmd, int timeout_ms, rpc_status_t *st);
/* rpc_unary that asks stop(stop_arg) every 100 ms while it waits and cancels
 * the call once it says true (then CANCELLED): a call made for a caller who
 * may give up first (the server's InspectUrl on its client's behalf). */
grpc_status_code rpc_unary_until(rpc_channel_t *ch, const char *method, const ProtobufCMessage *req,
                                 const ProtobufCMessageDescriptor *resp_desc,
                                 ProtobufCMessage **resp, const rpc_md_t *md, size_t nmd,
                                 int timeout_ms, bool (*stop)(void *arg), void *stop_arg,
                                 rpc_status_t *st);
/* rpc_unary_until sending req as it is packed (rpc_bytes_*; the caller keeps
 * it): on the wire one request message then the half-close, so it serves a
 * client-streaming method whose request fits one message, in one batch
 * instead of a stream's open, write, close, read and status one after
 * another (a client's direct Write of a 1 MiB shard). stop may be NULL. */
grpc_status_code rpc_unary_raw(rpc_channel_t *ch, const char *method, rpc_bytes_t *req,
                               const ProtobufCMessageDescriptor *resp_desc,
                               ProtobufCMessage **resp, const rpc_md_t *md, size_t nmd,
                               int timeout_ms, bool (*stop)(void *arg), void *stop_arg,
                               rpc_status_t *st);

/* A client-streaming, server-streaming or bidi call. One thread may read while
 * another writes; each side is used by one thread at a time. */
typedef struct rpc_stream rpc_stream_t;

/* Starts the call. timeout_ms <= 0: no deadline. Returns NULL only on a bad method. */
rpc_stream_t *rpc_stream_open(rpc_channel_t *ch, const char *method, const rpc_md_t *md,
                              size_t nmd, int timeout_ms);
/* Sends one message and waits until gRPC took it. `last` half-closes after it.
 * Returns 0, or -1 if the call is over (read the status with rpc_stream_finish). */
int rpc_stream_write(rpc_stream_t *s, const ProtobufCMessage *msg, bool last);
/* Half-closes without a message. Returns 0 or -1. */
int rpc_stream_close_send(rpc_stream_t *s);
/* Waits for the next message. Returns 1 with *out set (free with
 * protobuf_c_message_free_unpacked), 0 at the end of the stream, -1 if the
 * message does not unpack, -2 on timeout (the read stays armed; call again).
 * timeout_ms <= 0 waits without limit. */
int rpc_stream_read(rpc_stream_t *s, const ProtobufCMessageDescriptor *desc,
                    ProtobufCMessage **out, int timeout_ms);
/* Cancels the call (from any thread): blocked reads and writes return. */
void rpc_stream_cancel(rpc_stream_t *s);
/* Waits for the call's status (reads must have returned 0 or the call be
 * cancelled) and returns its code; st may be NULL. */
grpc_status_code rpc_stream_finish(rpc_stream_t *s, rpc_status_t *st);
/* Frees the stream; cancels it first if it is still running. */
void rpc_stream_destroy(rpc_stream_t *s);

/* A bidi call whose messages in are handed to a callback on the layer's
 * client thread (the one that serves pulls) instead of to a thread blocked in
 * a read: a process with many long-lived streams keeps few threads waiting in
 * gRPC, and each event wakes one of them (every thread that waits in gRPC
 * takes turns polling for all of them: with a reader per stream, most events
 * were handed from thread to thread).
 *
 *   d = rpc_duplex_open(ch, "/pkg.Svc/Link", md, 1, -1, &report__descriptor, got, arg);
 *   rpc_duplex_write(d, &batch.base);   // blocks until gRPC took it
 *   ...
 *   rpc_duplex_cancel(d);               // or the peer ends the call
 *   rpc_duplex_finish(d, &st);          // after got(d, NULL, arg)
 *   rpc_duplex_destroy(d);
 *
 * Reading starts at once: fn(d, msg, arg) runs for each message in order (fn
 * owns it), the next read is armed when fn returns, and fn(d, NULL, arg) runs
 * once at the end, when the status is in (a message that does not unpack ends
 * the call INTERNAL). fn must not block; it may call rpc_duplex_cancel. */
typedef struct rpc_duplex rpc_duplex_t;
typedef void (*rpc_duplex_fn)(rpc_duplex_t *d, ProtobufCMessage *msg, void *arg);
/* The call ends DEADLINE_EXCEEDED after timeout_ms (<= 0: no deadline).
 * Returns NULL on a bad method or out of memory; fn never ran then. */
rpc_duplex_t *rpc_duplex_open(rpc_channel_t *ch, const char *method, const rpc_md_t *md,
                              size_t nmd, int timeout_ms, const ProtobufCMessageDescriptor *desc,
                              rpc_duplex_fn fn, void *arg);
/* Sends one message and waits (not in gRPC) until gRPC took it; one writer at
 * a time. Returns 0, or -1 if the call is over. Never from fn. */
int rpc_duplex_write(rpc_duplex_t *d, const ProtobufCMessage *msg);
/* rpc_duplex_write that does not wait, for relays: starts sending msg (a
 * packed message, which the duplex takes), then half-closes if `close` (msg
 * NULL: the half-close alone). Once gRPC took them, sent(d, ok, arg) runs on
 * the client thread (ok false: the call is over; the status says why). One
 * send in flight at a time, rpc_duplex_write's included: returns -1 (msg
 * freed, sent never runs) when one is, or when the call is over. Any thread,
 * fn and sent too. */
typedef void (*rpc_duplex_sent_fn)(rpc_duplex_t *d, bool ok, void *arg);
int rpc_duplex_send_raw(rpc_duplex_t *d, rpc_bytes_t *msg, bool close, rpc_duplex_sent_fn sent);
/* Cancels the call, from any thread (fn too): a blocked write returns -1. */
void rpc_duplex_cancel(rpc_duplex_t *d);
/* How the call ended, from fn(d, NULL, arg) (or after rpc_duplex_finish);
 * st may be NULL. */
grpc_status_code rpc_duplex_status(rpc_duplex_t *d, rpc_status_t *st);
/* Waits until fn got NULL and returns how the call ended; st may be NULL.
 * Never from fn. */
grpc_status_code rpc_duplex_finish(rpc_duplex_t *d, rpc_status_t *st);
/* Gives the duplex back, with no write in flight; a call still running is
 * cancelled and fn is not called again (one running on the client thread may
 * still be finishing: an owner about to free what fn uses cancels and waits
 * in rpc_duplex_finish first). */
void rpc_duplex_destroy(rpc_duplex_t *d);

/* A server-streaming call read without a thread of its own, for relays: each
 * message is handed to a callback on the layer's client thread, and only when
 * asked for, so a reader that stops asking leaves the rest with the peer (its
 * sends back up through flow control; see stream_window_bytes).
 *
 *   p = rpc_pull_open(ch, "/pkg.Svc/Read", &req.base, &chunk__descriptor, NULL, 0, ms, got, arg);
 *   rpc_pull_next(p);            // got(p, msg, arg) runs later with the first message
 *
 * fn(p, msg, arg) runs once per rpc_pull_next: msg is the next message (fn owns
 * it: protobuf_c_message_free_unpacked), or NULL at the end of the stream, after
 * which rpc_pull_status says how the call ended (a message that does not unpack
 * ends it INTERNAL). fn runs on the client thread, which serves every pull of the
 * process: it must not block (it may call rpc_pull_next, _cancel, _destroy and
 * the server's rpc_call_* functions). */
typedef struct rpc_pull rpc_pull_t;
typedef void (*rpc_pull_fn)(rpc_pull_t *p, ProtobufCMessage *msg, void *arg);

/* Starts the call (sends req, half-closes). timeout_ms <= 0: no deadline.
 * Returns NULL only on a bad method or out of memory. */
rpc_pull_t *rpc_pull_open(rpc_channel_t *ch, const char *method, const ProtobufCMessage *req,
                          const ProtobufCMessageDescriptor *desc, const rpc_md_t *md, size_t nmd,
                          int timeout_ms, rpc_pull_fn fn, void *arg);
/* Asks for the next message: fn runs once, later, on the client thread. At most
 * one request at a time; none after fn got NULL. */
void rpc_pull_next(rpc_pull_t *p);
/* Cancels the call, from any thread: an asked-for message comes as NULL. */
void rpc_pull_cancel(rpc_pull_t *p);
/* How the call ended; valid once fn got NULL. st may be NULL. */
grpc_status_code rpc_pull_status(rpc_pull_t *p, rpc_status_t *st);
/* Gives the pull back, once fn got NULL (from inside fn too) or before the first
 * rpc_pull_next; a call still running is cancelled. fn runs no more. */
void rpc_pull_destroy(rpc_pull_t *p);

/* Raw messages, for relays: bytes passed on without unpacking and packing
 * them again. A protobuf `bytes` field alone in a message is its tag, its
 * length and the bytes, so a relay that checks that shape can forward a
 * DataChunk{data} as a FetchChunk{data} untouched (both field 2). */
/* A packed message of exactly one length-delimited field `field` of len
 * bytes, in one piece: *data points at the len bytes for the caller to fill.
 * NULL when out of memory. */
rpc_bytes_t *rpc_bytes_field(uint32_t field, size_t len, uint8_t **data);
/* The same message around the caller's own len bytes at `data`, referenced,
 * not copied (a sender that copies each chunk into a message spends a third
 * of its CPU on that). gRPC may hold a sent message's bytes past the write's
 * completion (until the transport wrote them): every message made with `hold`
 * counts there until gRPC lets it go, and the caller keeps `data` alive and
 * unchanged until rpc_hold_wait says none is held. NULL when out of memory. */
typedef struct rpc_hold rpc_hold_t;
rpc_bytes_t *rpc_bytes_field_ref(uint32_t field, const void *data, size_t len, rpc_hold_t *hold);
rpc_hold_t *rpc_hold_create(void); /* NULL when out of memory */
/* Waits until gRPC let go of every message made with h; false after
 * timeout_ms (< 0: no bound). A call ended does not let go of its messages at
 * once when its peer stopped reading: closing the connection does. */
bool rpc_hold_wait(rpc_hold_t *h, int timeout_ms);
/* Drops the caller's reference (h lives on while gRPC holds messages). */
void rpc_hold_release(rpc_hold_t *h);
/* Whether msg is exactly one length-delimited field `field` (its length in
 * *len): nothing before or after it, uncompressed. */
bool rpc_bytes_is_field(rpc_bytes_t *msg, uint32_t field, size_t *len);
/* For a msg that rpc_bytes_is_field accepted: fn(piece, n, arg) for each
 * piece of the field's bytes, in order, as they lie in the message (no copy).
 * Stops at the first fn that returns non-zero, and returns that. */
int rpc_bytes_field_visit(rpc_bytes_t *msg, int (*fn)(const uint8_t *piece, size_t n, void *arg),
                          void *arg);
/* msg unpacked as desc (protobuf_c_message_free_unpacked), NULL when it is
 * not one; msg is not consumed. */
ProtobufCMessage *rpc_bytes_unpack(rpc_bytes_t *msg, const ProtobufCMessageDescriptor *desc);
/* msg packed (a copy). */
rpc_bytes_t *rpc_bytes_pack(const ProtobufCMessage *msg);
/* A second message of msg's bytes, referenced, not copied (each is freed on
 * its own): one chunk sent on to many peers. */
rpc_bytes_t *rpc_bytes_share(rpc_bytes_t *msg);
/* A message of len packed bytes, copied. NULL when out of memory. */
rpc_bytes_t *rpc_bytes_copy(const void *data, size_t len);
/* NULL is a no-op. */
void rpc_bytes_free(rpc_bytes_t *msg);
/* rpc_call_send of a packed message, which the call owns from here on. */
int rpc_call_send_raw(rpc_call_t *call, rpc_bytes_t *msg);
/* rpc_stream_write of a packed message; msg stays the caller's (the call
 * sends a reference to the same bytes). */
int rpc_stream_write_raw(rpc_stream_t *s, rpc_bytes_t *msg);
/* rpc_stream_write_raw bounded by timeout_ms (< 0: no bound), for a peer that
 * may stop reading (flow control): 0 sent, -1 the call is over, -2 the time
 * passed first. Then the message stays in flight (gRPC holds its own reference
 * to the bytes) and the next write, or rpc_stream_write_wait, waits for it
 * before anything else goes out; destroying the stream ends it. */
int rpc_stream_write_raw_within(rpc_stream_t *s, rpc_bytes_t *msg, int timeout_ms);
/* Waits within timeout_ms (< 0: no bound) for a write left in flight: 0 it went
 * out (or none was), -1 the call is over, -2 still in flight. */
int rpc_stream_write_wait(rpc_stream_t *s, int timeout_ms);
/* rpc_stream_read of a message left packed: 1 with *out (rpc_bytes_free it),
 * 0 at the end of the stream, -2 on timeout (the read stays armed). */
int rpc_stream_read_raw(rpc_stream_t *s, rpc_bytes_t **out, int timeout_ms);
/* Copies msg's bytes (decompressed) into *buf, which holds *cap bytes and is
 * grown with realloc when it is too small (a reader reuses one buffer for
 * every message). Returns the message's length, or -1 out of memory (*buf,
 * perhaps grown, stays the caller's to free). */
long rpc_bytes_read(rpc_bytes_t *msg, uint8_t **buf, size_t *cap);
/* rpc_pull_open whose fn gets each message packed (fn owns it: rpc_bytes_free),
 * NULL at the end, as rpc_pull_fn does. */
typedef void (*rpc_pull_raw_fn)(rpc_pull_t *p, rpc_bytes_t *msg, void *arg);
rpc_pull_t *rpc_pull_open_raw(rpc_channel_t *ch, const char *method, const ProtobufCMessage *req,
                              const rpc_md_t *md, size_t nmd, int timeout_ms, rpc_pull_raw_fn fn,
                              void *arg);

/* ================================================================== misc */

/* gRPC init/shutdown, counted: every program and test calls rpc_init() once
 * before any other function here and rpc_shutdown() at the end. */
void rpc_init(void);
void rpc_shutdown(void);

/* One queue for the whole process (the meshd server), served by `threads`
 * threads that are its only pollers. With gRPC's epoll engine every thread
 * that waits on a polling queue takes turns at polling the sockets, and each
 * event hands the turn to another waiting thread: a wake and a context switch
 * or more per event, with a server's threads and the client thread all
 * waiting. On the loop a server's events are dispatched where they are
 * polled, and a pull's or duplex's go to the client thread (their callbacks
 * keep running there, one at a time). Servers created after this call use
 * the loop instead of threads of their own (their before_wait is the loop's),
 * and so do pulls and duplexes opened after it. Code on a loop thread (server
 * handlers, before_wait) must never wait for a pull's or duplex's progress:
 * only the loop can deliver it. Call after rpc_init, before any server or
 * call; rpc_shutdown stops it. 0, or -1 if no thread could start. */
int rpc_loop_start(int threads, void (*before_wait)(void));
/* Whether the caller is one of the loop's threads (where nothing may wait for
 * a pull's or duplex's progress). */
bool rpc_on_loop_thread(void);

/* Milliseconds on a monotonic clock. */
int64_t rpc_now_ms(void);

/* gRPC code name as grpc-status spells it: "INVALID_ARGUMENT"; "UNKNOWN" outside 0..16. */
const char *meshd_grpc_code_name(grpc_status_code c);

#endif
