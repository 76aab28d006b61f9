/* meshd C client library: the only public face of clients/c.
 *
 * A meshd_client_t is one connection to a meshd server. Calls block until the
 * server answers or the client's timeout passes. A client may be used by one
 * thread at a time (its last error is per client); use one client per thread
 * for concurrency.
 *
 * Errors: every fallible function returns a meshd_err_t. After a failure,
 * meshd_last_error(client) says what went wrong; for MESHD_E_RPC that includes
 * the server's gRPC status code and message. A call whose deadline passed
 * (the client's timeout_ms, or the timeout given to a *_timeout function) is
 * MESHD_E_DEADLINE, with grpc_code DEADLINE_EXCEEDED and kind
 * "DEADLINE_EXCEEDED", never MESHD_E_RPC / UNAVAILABLE: the server may still
 * be working on it (a Sync waits on a hung agent).
 *
 * Ownership is written on each function. Strings passed in are only read during
 * the call. */
#ifndef MESHD_CLIENT_H
#define MESHD_CLIENT_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define MESHD_API __attribute__((visibility("default")))
#else
#define MESHD_API
#endif

/* ------------------------------------------------------------------ errors */

#define MESHD_ERR_MAP(XX)                                   \
  XX(OK, "ok")                                              \
  XX(CONNECT, "could not connect to the server")            \
  XX(RPC, "the call failed")                                \
  XX(INVALID, "invalid argument")                           \
  XX(NOMEM, "out of memory")                                \
  XX(DEADLINE, "the call's deadline passed")                \
  XX(CANCELLED, "stopped by the caller")

typedef enum {
#define XX(name, text) MESHD_E_##name,
  MESHD_ERR_MAP(XX)
#undef XX
} meshd_err_t;

/* A short description: "could not connect to the server". Static string;
 * "unknown error" for values outside the enum. */
MESHD_API const char *meshd_strerror(meshd_err_t err);

/* ----------------------------------------------------------------- process */

/* Process-wide setup and teardown of the library's transport (gRPC).
 * Optional: each client holds it for its own life (meshd_connect ..
 * meshd_close). A program that connects more than once calls
 * meshd_global_init() before its first meshd_ call, so the transport is not
 * torn down and set up again between clients, and meshd_global_shutdown() after
 * closing its last client. Counted and thread-safe: every init needs one
 * shutdown; the last shutdown releases the transport. */
MESHD_API void meshd_global_init(void);
MESHD_API void meshd_global_shutdown(void);

/* ------------------------------------------------------------------ client */

typedef struct meshd_client meshd_client_t;

/* Connects to `target` ("127.0.0.1:50051", "dns:///meshd:50051") in plaintext,
 * without a token, and waits up to timeout_ms (> 0) for the connection to be
 * ready. timeout_ms is also the deadline of every call made through the client.
 * meshd_connect_with below adds TLS, mTLS and a bearer token.
 *
 * Returns a client (free with meshd_close), or NULL with *err set (err may be
 * NULL): MESHD_E_INVALID for a NULL/empty target or timeout_ms <= 0,
 * MESHD_E_CONNECT if no connection was ready in time, MESHD_E_NOMEM. */
MESHD_API meshd_client_t *meshd_connect(const char *target, int timeout_ms, meshd_err_t *err);

/* How meshd_connect_with reaches the server (docs/security.md). Start from
 * MESHD_CONNECT_OPTIONS_INIT and set what you need; strings are read during the
 * call only (the client keeps its own copy of the token). The library reads no
 * environment variable: meshctl maps MESHD_TOKEN, MESHD_TLS_CA, ... onto these.
 *
 *   meshd_connect_options_t o = MESHD_CONNECT_OPTIONS_INIT;
 *   o.token = tok;                 // sent as `authorization: Bearer TOKEN` on every call
 *   o.tls_ca_file = "ca.pem";      // TLS, the server verified against ca.pem
 *   char why[256];
 *   meshd_client_t *c = meshd_connect_with("meshd.example:50051", &o, &err, why, sizeof why); */
typedef struct meshd_connect_options {
  int timeout_ms;              /* > 0: the connection wait (one attempt may take all of
                                  it) and every call's deadline */
  const char *token;           /* bearer token; NULL or "": none. 1..4096 visible ASCII
                                  characters (no spaces) */
  bool tls;                    /* TLS, verified against the system's roots */
  const char *tls_ca_file;     /* PEM roots that verify the server; implies tls */
  const char *tls_cert_file;   /* PEM client certificate for mTLS, with tls_key_file; */
  const char *tls_key_file;    /*   both or neither; imply tls */
  const char *tls_server_name; /* the name checked in the server's certificate instead of
                                  the target's host; implies tls */
  bool insecure;               /* send a token in plaintext to a non-loopback target
                                  (refused otherwise) */
  bool fail_fast;              /* give up at the first failed connection attempt (nothing
                                  listens, unreachable, TLS handshake failed) instead of
                                  retrying until timeout_ms: what a CLI wants */
} meshd_connect_options_t;

#define MESHD_CONNECT_OPTIONS_INIT {5000, NULL, false, NULL, NULL, NULL, NULL, false, false}

/* meshd_connect with options. NULL opts: MESHD_CONNECT_OPTIONS_INIT. Returns a
 * client, or NULL with *err set (err may be NULL) and, when errbuf is not NULL,
 * a message in errbuf (errlen bytes, NUL-terminated) that names the option at
 * fault and never quotes the token:
 * MESHD_E_INVALID for a NULL/empty target, timeout_ms <= 0, a malformed token,
 * a certificate without its key, an unreadable or non-PEM file, or a token
 * that would go in plaintext to a target that is not loopback (localhost,
 * 127.0.0.0/8, ::1, unix:) without `insecure`; MESHD_E_CONNECT if no
 * connection was ready in time (with TLS also: the handshake failed, e.g. the
 * server's certificate is not signed by tls_ca_file), and at once in a child
 * of fork() made while the parent held the transport (a client open, or
 * meshd_global_init): gRPC does not follow fork, so such a child execs, or the
 * parent forks before its first connect or after its last meshd_close;
 * MESHD_E_NOMEM. A server
 * that refuses the token is seen on the first call: MESHD_E_RPC with kind
 * "UNAUTHENTICATED" (another principal's session: "PERMISSION_DENIED"). */
MESHD_API meshd_client_t *meshd_connect_with(const char *target,
                                             const meshd_connect_options_t *opts,
                                             meshd_err_t *err, char *errbuf, size_t errlen);

/* Closes the connection and frees the client. NULL is ignored. Pointers
 * obtained from meshd_last_error become invalid. */
MESHD_API void meshd_close(meshd_client_t *client);

/* What the last failed call on a client reported. */
typedef struct meshd_error_info {
  meshd_err_t err;            /* MESHD_E_OK while no call has failed */
  int grpc_code;              /* MESHD_E_RPC, _DEADLINE: the gRPC status code; else 0 */
  const char *grpc_code_name; /* MESHD_E_RPC, _DEADLINE: "NOT_FOUND", "DEADLINE_EXCEEDED", ...; else "" */
  const char *kind;           /* meshd error kind ("WRONG_MESH") if the server sent one,
                                 "DEADLINE_EXCEEDED" for MESHD_E_DEADLINE; else "" */
  const char *message;        /* what went wrong ("unknown service"); "" when err is OK */
  uint64_t seq;               /* a pipelined command's rejection: that command's seq
                                 (meshd_session_last_seq); the first pipelined command
                                 taken out of the queue unsent at a deadline; else 0 */
} meshd_error_info_t;

/* The last failed call on `client` (successful calls leave it unchanged).
 * Never NULL. The struct and its strings belong to the client and stay valid
 * until the next call on it or meshd_close. A NULL client gets a static
 * MESHD_E_INVALID record. */
MESHD_API const meshd_error_info_t *meshd_last_error(const meshd_client_t *client);

/* ------------------------------------------------------------------ health */

/* grpc.health.v1 serving statuses, with their names as the proto spells them. */
#define MESHD_HEALTH_MAP(XX)  \
  XX(UNKNOWN, 0)              \
  XX(SERVING, 1)              \
  XX(NOT_SERVING, 2)          \
  XX(SERVICE_UNKNOWN, 3)

enum {
#define XX(name, value) MESHD_HEALTH_##name = value,
  MESHD_HEALTH_MAP(XX)
#undef XX
};

/* "SERVING", "NOT_SERVING", ...; "UNKNOWN" for values outside the map. Static. */
MESHD_API const char *meshd_health_name(int serving_status);

/* grpc.health.v1.Health/Check for `service` (NULL or "" : the server as a
 * whole; "meshd.v1.TensorService": SERVING only with enough healthy agents).
 * On MESHD_E_OK stores a MESHD_HEALTH_* value in *serving_status_out.
 * An unknown service is MESHD_E_RPC with grpc_code_name "NOT_FOUND". */
MESHD_API meshd_err_t meshd_health(meshd_client_t *client, const char *service,
                                   int *serving_status_out);

/* ------------------------------------------------------------------ agents */

/* One agent registered with the server. */
typedef struct meshd_agent {
  uint32_t rank;            /* world rank */
  char *address;            /* host:port of the agent's gRPC service */
  char *device;             /* "cpu", "cuda:0", ... */
  uint64_t memory_bytes;    /* capacity */
  uint64_t allocated_bytes; /* held now */
  bool healthy;
  char *agent_id;
  bool drained;             /* taken out of placement (meshd_drain_agent) */
  char *version;            /* the agent's build as it reported it; "" from older agents */
  char *commit;
  char *build_type;
  bool cuda;
  /* How a client of the direct data path dials the agents' port (ListAgents'
   * AgentTls, the same for every agent; meshd_agents only): NULL, NULL in
   * plaintext; with cluster mTLS the name their certificates carry and the
   * cluster CA's PEM. */
  char *tls_server_name;
  char *tls_ca_pem;
} meshd_agent_t;

/* meshd.v1.TensorService/ListAgents, every page (rank order). On MESHD_E_OK,
 * *list is an array of *n agents in the server's order, owned by the caller: free it with
 * meshd_agents_free(*list, *n). With no agents, *list = NULL and *n = 0.
 * On failure *list = NULL and *n = 0. */
MESHD_API meshd_err_t meshd_agents(meshd_client_t *client, meshd_agent_t **list, size_t *n);

/* Frees a list from meshd_agents, strings included. NULL is ignored. */
MESHD_API void meshd_agents_free(meshd_agent_t *list, size_t n);

/* meshd.v1.TensorService/DrainAgent: drain (true) or undrain (false) rank's
 * agent. Sessions created after a drain get no mesh on that rank; older ones
 * keep it. Admin principals only. A rank with no agent is MESHD_E_RPC with
 * grpc_code_name "NOT_FOUND". On MESHD_E_OK and agent_out != NULL,
 * *agent_out is the agent as it is now (free with meshd_agents_free(*agent_out, 1));
 * NULL on failure. */
MESHD_API meshd_err_t meshd_drain_agent(meshd_client_t *client, uint32_t rank, bool drain,
                                        meshd_agent_t **agent_out);

/* What a server is (GetInfo): its build, uptime and agents. */
typedef struct meshd_server_info {
  char *version, *commit, *build_type;
  bool cuda;
  uint64_t uptime_ms;
  meshd_agent_t *agents; /* n_agents (every agent, rank order), with the versions they reported */
  size_t n_agents;
} meshd_server_info_t;

/* meshd.v1.TensorService/GetInfo. On MESHD_E_OK fills *out (free with
 * meshd_server_info_free); on failure *out is zeroed. A server older than
 * GetInfo answers MESHD_E_RPC, grpc_code_name "UNIMPLEMENTED". GetInfo's reply
 * holds a pool's first 1024 agents only: for a larger pool the agents come from
 * ListAgents, every page (meshd_agents, and its errors). */
MESHD_API meshd_err_t meshd_server_info(meshd_client_t *client, meshd_server_info_t *out);
/* Frees what meshd_server_info put in *info and zeroes it. NULL is ignored. */
MESHD_API void meshd_server_info_free(meshd_server_info_t *info);

/* ---------------------------------------------------------------- sessions */

/* One client session held by the server (ListSessions). */
typedef struct meshd_session_info {
  char *session_id;
  char *client_name;
  uint64_t bytes_held;   /* bytes of live tensors, all agents */
  uint64_t live_tensors;
  uint64_t idle_ms;      /* since the session's last call; 0 while a call is in flight */
  char *owner;           /* the principal that created it */
  uint64_t commands;     /* commands accepted so far */
  uint64_t age_ms;       /* since CreateSession */
  uint64_t queued_commands;
} meshd_session_info_t;

/* meshd.v1.TensorService/ListSessions, every page. On MESHD_E_OK, *list is an array of *n
 * sessions owned by the caller: free it with meshd_sessions_free(*list, *n).
 * With none, *list = NULL and *n = 0; the same on failure. */
MESHD_API meshd_err_t meshd_sessions(meshd_client_t *client, meshd_session_info_t **list,
                                     size_t *n);

/* Frees a list from meshd_sessions, strings included. NULL is ignored. */
MESHD_API void meshd_sessions_free(meshd_session_info_t *list, size_t n);

/* A session of one client: meshes and tensors live in it, named by refs that the
 * session hands out (>= 1, increasing). Refs are per session: the n-th session
 * a process opens numbers them from n * 10^12 + 1 (the first from 1), and a
 * call given a ref of another session fails MESHD_E_INVALID naming the
 * argument (it would name another object here). Errors of session calls are recorded on
 * the client (meshd_last_error(client)); the kind is the server's error kind
 * ("UNKNOWN_OP", "SHAPE_MISMATCH", ...). A session is used by one thread at a
 * time and must be closed before its client.
 *
 * The keepalive thread: while a session is open, the library runs one
 * background thread for it (started by meshd_session_open, stopped and joined
 * by meshd_session_close) that sends KeepAlive on the client's connection
 * every third of the session's ttl (at least 250 ms apart), so a session that
 * makes no call for longer than its ttl is not expired by the server. It
 * touches nothing of the client but its connection (gRPC calls are
 * thread-safe): not the last error, not the session's refs. It ends by itself
 * when the server says the session is gone. Its name (Linux) is
 * "meshd-keepalive". */
typedef struct meshd_session meshd_session_t;
typedef uint64_t meshd_ref_t;

/* CreateSession with client_name `name` (NULL: "meshd-c"). Returns a session
 * (close with meshd_session_close), or NULL with *err set (err may be NULL) and
 * the details in meshd_last_error(client). The session borrows `client`. */
MESHD_API meshd_session_t *meshd_session_open(meshd_client_t *client, const char *name,
                                              meshd_err_t *err);

/* Stops the keepalive thread, sends what a pipeline has queued, CloseSession
 * (the server frees the session's tensors), joins the thread (it may finish a
 * KeepAlive in flight), then frees the handle: within about the client's
 * timeout in all, even from a server that stopped answering. NULL is ignored.
 * A failed CloseSession is not reported: the session expires. */
MESHD_API void meshd_session_close(meshd_session_t *session);

/* CreateMesh over dims names[i] of sizes[i] (ndims >= 1); *mesh_out gets its ref. */
MESHD_API meshd_err_t meshd_session_create_mesh(meshd_session_t *session,
                                                const char *const *names,
                                                const int64_t *sizes, size_t ndims,
                                                meshd_ref_t *mesh_out);

/* The sub-mesh of `parent` at index[i] along dims[i] (each such dim goes away,
 * Monarch's mesh.slice(gpu=0)); *mesh_out gets its ref. */
MESHD_API meshd_err_t meshd_session_slice_mesh(meshd_session_t *session, meshd_ref_t parent,
                                               const char *const *dims, const int64_t *index,
                                               size_t n, meshd_ref_t *mesh_out);

/* Factory `kind` (zeros ones full empty rand randn arange...) of float32 with
 * `shape` (ndim values, ndim may be 0) on every rank of `mesh`; `value` is used
 * by full. *out gets the tensor's ref. */
MESHD_API meshd_err_t meshd_session_factory(meshd_session_t *session, meshd_ref_t mesh,
                                            const char *kind, const int64_t *shape, size_t ndim,
                                            double value, meshd_ref_t *out);

/* What a load made: the tensor every rank holds once its bytes are in. */
typedef struct meshd_load_info {
  char dtype[16];     /* "float32", "bfloat16", ... */
  int64_t shape[16];  /* each rank's local shape (sharded: its slice) */
  size_t ndim;
  uint64_t bytes;     /* one rank's bytes: numel x dtype size (UINT64_MAX past 2^64) */
} meshd_load_info_t;

/* What meshd_session_load loads (docs/loading.md). Zeroed: a .npy file, or a
 * safetensors file holding one tensor, replicated on every rank. */
typedef struct meshd_load_options {
  /* Raw bytes: their dtype ("float32", "int64", "bfloat16", ...) and shape
   * (ndim sizes). NULL dtype: the file's header says (.npy, safetensors). */
  const char *dtype;
  const int64_t *shape;
  size_t ndim;
  const char *name;  /* a tensor of a safetensors file (NULL: its only one) */
  const char *shard; /* mesh dim to split over (NULL: every rank loads it all) */
  int dim;           /* the tensor dim split, with shard (< 0: from the end) */
  meshd_load_info_t *info; /* out (NULL: not wanted): filled when the call succeeds */
} meshd_load_options_t;

/* A tensor whose bytes every agent of `mesh` fetches itself from `url` (http,
 * https or file, as the server's --url-allow permits): no byte passes through
 * the server or the client. opts may be NULL. The header of a .npy or
 * safetensors file is read first by one agent (TensorService/InspectUrl);
 * errors there (404, a dtype meshd lacks) fail this call, and so does a name
 * the file lacks (MESHD_E_INVALID, naming the URL and the names it holds).
 * For raw bytes that agent reads only the version (InspectUrl size_only),
 * which every rank then loads: a file rewritten meanwhile fails the load
 * ("changed") instead of loading two versions; when it cannot read the URL
 * (a server that does not answer: once the client's timeout passed) the load
 * goes unpinned and fails on the ranks, naming each.
 * The call returns once the server accepted the load, before the agents
 * fetched; transfer failures on the agents fail the tensor: they surface at
 * sync, fetch or meshd_session_wait_load. *out gets the tensor's ref. */
MESHD_API meshd_err_t meshd_session_load(meshd_session_t *session, meshd_ref_t mesh,
                                         const char *url, const meshd_load_options_t *opts,
                                         meshd_ref_t *out);

/* How far the agents are with a load (TensorService/LoadProgress). */
typedef struct meshd_load_progress {
  meshd_ref_t ref;
  uint64_t done_bytes;  /* fetched so far, summed over the tensor's ranks */
  uint64_t total_bytes; /* the tensor's bytes on every rank together */
  bool failed;          /* the load failed on some rank (the error comes at sync) */
} meshd_load_progress_t;

/* One look, without waiting: out[i] for refs[i] (n >= 1 of them, any number:
 * asked 256 at a time). A rank that has not started counts 0; a rank's agent
 * remembers its latest 1024 loads, so an old finished load or a ref that is
 * not a load may read 0 done: meshd_session_wait_load is the one to trust for
 * "in". A ref that is not a live tensor of the session is the server's
 * UNKNOWN_REF (MESHD_E_RPC). */
MESHD_API meshd_err_t meshd_session_load_progress(meshd_session_t *session,
                                                  const meshd_ref_t *refs, size_t n,
                                                  meshd_load_progress_t *out);

/* Options of meshd_session_wait_load; start from MESHD_WAIT_LOAD_OPTIONS_INIT. */
typedef struct meshd_wait_load_options {
  int timeout_ms;  /* > 0 bounds the whole wait (MESHD_E_DEADLINE past it, the load goes
                      on); <= 0: none (the server's --url-timeout-ms and the agents'
                      60 s stall rule bound each load, a lost agent fails it) */
  int interval_ms; /* between two looks at the progress; <= 0: 250 */
  /* NULL: none. Called on the calling thread with done and total summed over
   * the refs (meshd_session_load_progress) after each look, the first at once,
   * and on success once more with done == total. Must not call the library. */
  void (*progress)(void *user, uint64_t done_bytes, uint64_t total_bytes);
  void *progress_user; /* passed to progress */
  /* NULL: none. A flag the caller's signal handler sets (SIGINT, SIGTERM): the
   * wait looks at it every 50 ms (every second once the loads are in and it
   * Syncs) and, once it is non-zero, returns
   * MESHD_E_CANCELLED; the load goes on until the session closes. */
  const volatile sig_atomic_t *stop;
  /* NULL: none. Called on the calling thread (with progress_user) after a look
   * that some ranks did not answer in time (LoadProgress's `unanswered`: their
   * bytes are missing from done), with those ranks ascending, n of them; then
   * once with n == 0 when every rank answers again. Must not call the library. */
  void (*silent)(void *user, const uint32_t *ranks, size_t n);
} meshd_wait_load_options_t;

#define MESHD_WAIT_LOAD_OPTIONS_INIT {0, 0, NULL, NULL, NULL, NULL}

/* Waits until everything the session issued so far ran, as meshd_session_sync
 * does, showing the progress of the loads `refs` (n >= 1) while it waits: a
 * LoadProgress every interval_ms (not a command: meshd_commands_total does not
 * count it) until every load is in, one failed or a rank's agent is lost,
 * then a Sync (re-sent each second while the rest of the session runs). MESHD_E_OK
 * once every rank holds them; a failed load fails it with the agent's error
 * (its kind, the URL without credentials, the HTTP status or curl's error, the
 * rank), reported once, as Sync reports it. opts may be NULL. */
MESHD_API meshd_err_t meshd_session_wait_load(meshd_session_t *session, const meshd_ref_t *refs,
                                              size_t n, const meshd_wait_load_options_t *opts);

/* One positional argument of meshd_session_call. */
typedef enum { MESHD_ARG_REF, MESHD_ARG_INT, MESHD_ARG_FLOAT } meshd_arg_type_t;
typedef struct meshd_arg {
  meshd_arg_type_t type;
  meshd_ref_t ref; /* MESHD_ARG_REF */
  int64_t i;       /* MESHD_ARG_INT */
  double f;        /* MESHD_ARG_FLOAT */
} meshd_arg_t;

/* Call of op `op` ("add", "mul", "relu", ...) with nargs positional arguments
 * and one result tensor, whose ref goes to *out. */
MESHD_API meshd_err_t meshd_session_call(meshd_session_t *session, const char *op,
                                         const meshd_arg_t *args, size_t nargs, meshd_ref_t *out);

/* Reduce `input` over mesh dim `dim` (NULL or "": every dim) with `reduction`
 * (sum avg product min max ...). *out gets the result's ref. */
MESHD_API meshd_err_t meshd_session_reduce(meshd_session_t *session, meshd_ref_t input,
                                           const char *dim, const char *reduction,
                                           meshd_ref_t *out);

/* meshd_session_reduce onto the sub-mesh `mesh` (Monarch's reduce(..., mesh=)):
 * a mesh holding one rank of each reduced group and none of the reduced dims,
 * e.g. a slice at gpu=0 for dim "gpu". The result lives there only. */
MESHD_API meshd_err_t meshd_session_reduce_onto(meshd_session_t *session, meshd_ref_t input,
                                                const char *dim, const char *reduction,
                                                meshd_ref_t mesh, meshd_ref_t *out);

/* Reduce `input` over the ndims mesh dims `dims` at once (ndims 0: every dim)
 * with `reduction`, onto the sub-mesh `mesh` (0: every rank of the input's
 * mesh keeps the result, as meshd_session_reduce; else as
 * meshd_session_reduce_onto, without any of the reduced dims). */
MESHD_API meshd_err_t meshd_session_reduce_dims(meshd_session_t *session, meshd_ref_t input,
                                                const char *const *dims, size_t ndims,
                                                const char *reduction, meshd_ref_t mesh,
                                                meshd_ref_t *out);

/* Options of meshd_session_reduce_with; start from MESHD_REDUCE_OPTIONS_INIT. */
typedef struct meshd_reduce_options {
  meshd_ref_t mesh; /* the sub-mesh the result goes to, as meshd_session_reduce_onto
                       (0: every rank of the input's mesh) */
  meshd_ref_t out;  /* 0: a new tensor; else a tensor of this session the result is
                       written into (Monarch's out=): of the result's shape and the
                       input's dtype, on the input's mesh, or on `mesh` when given */
  bool inplace;     /* the result is written into `input` itself (Monarch's reduce_);
                       not with out or mesh */
  bool scatter;     /* a reduce-scatter (Monarch's scatter=True): the input's dim 0 has
                       the reduced group's size, and rank k of each group keeps row k
                       of the result (without that dim); not with mesh */
  meshd_ref_t stream; /* the stream it runs on (0: the default stream): the input (and
                         out) must be on it, else WRONG_STREAM */
} meshd_reduce_options_t;

#define MESHD_REDUCE_OPTIONS_INIT {0, 0, false, false, 0}

/* meshd_session_reduce_dims with options (NULL: MESHD_REDUCE_OPTIONS_INIT):
 * Monarch's reduce(dims, reduction, mesh=, _inplace=, out=). *result gets the
 * result's ref: a new one, or out's, or input's in place (then no ref is made
 * and nothing new needs dropping). The server checks out and inplace: a bad
 * one (out of another shape or dtype, out not on the result's mesh, inplace
 * with out or mesh) is MESHD_E_RPC with its kind (SHAPE_MISMATCH,
 * DTYPE_MISMATCH, WRONG_MESH, BAD_ARGUMENT); an out of another session is
 * MESHD_E_INVALID, never sent. */
MESHD_API meshd_err_t meshd_session_reduce_with(meshd_session_t *session, meshd_ref_t input,
                                                const char *const *dims, size_t ndims,
                                                const char *reduction,
                                                const meshd_reduce_options_t *opts,
                                                meshd_ref_t *result);

/* A new stream named `name` (Monarch's Stream; the name is a label, which
 * other streams of the session may share); *out gets its ref. Commands
 * take stream refs where they name one; 0 is the default stream "main". */
MESHD_API meshd_err_t meshd_session_stream(meshd_session_t *session, const char *name,
                                           meshd_ref_t *out);

/* How tensor bytes travel (docs/protocol.md, Direct data path):
 *   AUTO   straight between the caller and the agents when the server offers it
 *          (PlanTransfer), the agents' port is TLS (cluster mTLS: verified with
 *          the CA the plan names) or the session is not over TLS, and every agent a
 *          transfer needs connects within 1 s; else through the server. An
 *          agent that did not connect is not tried again for 30 s; a server
 *          that refused PlanTransfer (--data-path=proxy) is not asked again.
 *          A transfer whose Read or Write an agent refused because it has
 *          too many direct transfers in flight (its --max-transfer-nonces
 *          table is full) goes through the server, that transfer only.
 *   DIRECT always straight to the agents: fails (MESHD_E_RPC, UNAVAILABLE,
 *          naming the rank and address) when an agent does not connect,
 *          (RESOURCE_EXHAUSTED, kind QUOTA, naming them: retry later) when an
 *          agent has too many direct transfers in flight, and with the
 *          server's FAILED_PRECONDITION under --data-path=proxy.
 *   PROXY  always through the server (Upload, Fetch).
 * Shards move in parallel, one thread each; memory stays bounded: uploads
 * stream from the caller's buffer, fetches write into the result. */
typedef enum {
  MESHD_DATA_PATH_AUTO,
  MESHD_DATA_PATH_DIRECT,
  MESHD_DATA_PATH_PROXY,
} meshd_data_path_t;

/* "auto", "direct", "proxy"; "unknown" outside the enum. Static. */
MESHD_API const char *meshd_data_path_name(meshd_data_path_t path);

/* Parses "auto", "direct" or "proxy" into *out; MESHD_E_INVALID for anything else. */
MESHD_API meshd_err_t meshd_data_path_parse(const char *name, meshd_data_path_t *out);

/* Sets the session's data path for its later uploads and fetches (a new
 * session: AUTO). Forcing a mode also forgets a past unreachable agent. */
MESHD_API meshd_err_t meshd_session_set_data_path(meshd_session_t *session,
                                                  meshd_data_path_t path);

/* What a session's transfers did, since it opened. */
typedef struct meshd_transfer_stats {
  uint64_t direct_uploads, direct_fetches; /* straight between client and agents */
  uint64_t proxy_uploads, proxy_fetches;   /* through the server */
  uint64_t fallbacks;                      /* AUTO transfers that went through the server
                                              for a reason other than a PROXY setting */
  char last_fallback[256];                 /* the last one's reason; "" if none */
} meshd_transfer_stats_t;

/* Copies the session's counters into *out. MESHD_E_INVALID for NULLs. */
MESHD_API meshd_err_t meshd_session_transfer_stats(const meshd_session_t *session,
                                                   meshd_transfer_stats_t *out);

/* Upload: `bytes` bytes of `dtype` ("float32", "int64", ...) with `shape` (ndim
 * sizes), the same on every rank of `mesh` (on the default stream). The bytes
 * go by the session's data path (meshd_session_set_data_path): straight to
 * every agent at once, or through the server in 1 MiB messages; the call
 * returns once every rank holds them. *out gets the tensor's ref. */
MESHD_API meshd_err_t meshd_session_upload(meshd_session_t *session, meshd_ref_t mesh,
                                           const char *dtype, const int64_t *shape, size_t ndim,
                                           const void *data, size_t bytes, meshd_ref_t *out);

/* Options of meshd_session_upload_with; start from MESHD_UPLOAD_OPTIONS_INIT. */
typedef struct meshd_upload_options {
  bool per_rank;      /* data holds one local tensor of `shape` per rank of the mesh, in
                         rank order (bytes = that many local tensors); else every rank
                         gets all of data */
  meshd_ref_t stream; /* 0: the default stream */
} meshd_upload_options_t;

#define MESHD_UPLOAD_OPTIONS_INIT {false, 0}

/* meshd_session_upload with options (NULL: MESHD_UPLOAD_OPTIONS_INIT). */
MESHD_API meshd_err_t meshd_session_upload_with(meshd_session_t *session, meshd_ref_t mesh,
                                                const char *dtype, const int64_t *shape,
                                                size_t ndim, const void *data, size_t bytes,
                                                const meshd_upload_options_t *opts,
                                                meshd_ref_t *out);

/* The most data one Literal carries, and the most its copies to the ranks may
 * come to in all (docs/protocol.md, Literal). */
#define MESHD_LITERAL_MAX_BYTES (1u << 20)
#define MESHD_LITERAL_MAX_SENT_BYTES (8u << 20)

/* Literal: a small tensor whose bytes travel in the command itself, the
 * arguments of meshd_session_upload_with. It is a command: it returns once
 * sent (with a pipeline, once queued: data is copied and may be reused at
 * once), in order with the session's other commands on its stream, and a
 * failure on the agents is reported by the next Sync. An upload of a few KiB
 * takes two round trips through the server and the agents; a Literal none.
 * At most MESHD_LITERAL_MAX_BYTES of data, and at most
 * MESHD_LITERAL_MAX_SENT_BYTES over the ranks it goes to (data times the
 * mesh's ranks unless per_rank): larger is MESHD_E_INVALID, naming the bound
 * (upload it). A pipeline batch's Literals stay within that bound together.
 * Where the server, or an agent of the mesh, predates Literal
 * (meshd_session_literals), it uploads instead, and returns once every rank
 * holds the bytes. (A mesh whose agent is replaced runs nothing more, so its
 * answer stays true; should the server still refuse a Literal for an older
 * agent, the session's Literals turn off: without a pipeline this call then
 * uploads, with one the refusal comes at the next call that needs an answer.)
 * *out gets the tensor's ref. */
MESHD_API meshd_err_t meshd_session_literal(meshd_session_t *session, meshd_ref_t mesh,
                                            const char *dtype, const int64_t *shape, size_t ndim,
                                            const void *data, size_t bytes,
                                            const meshd_upload_options_t *opts,
                                            meshd_ref_t *out);

/* Whether meshd_session_literal sends a command to `mesh` (true), or uploads
 * (false: the server lists no "literal" feature, or an agent of the mesh
 * predates it). Meshes made by this session are known; others count as true,
 * and the server checks. */
MESHD_API bool meshd_session_literals(const meshd_session_t *session, meshd_ref_t mesh);

/* Drop (Monarch's drop): frees each tensor's storage, every alias of it. */
MESHD_API meshd_err_t meshd_session_drop(meshd_session_t *session, const meshd_ref_t *refs,
                                         size_t n);

/* Release: lets go of each handle; a storage goes with its last ref, so a view
 * keeps its base's. Refs no longer live are skipped (docs/protocol.md). */
MESHD_API meshd_err_t meshd_session_release(meshd_session_t *session, const meshd_ref_t *refs,
                                            size_t n);

/* to_mesh: a copy of `input` on every rank of `mesh` (on the default stream);
 * *out gets its ref. */
MESHD_API meshd_err_t meshd_session_to_mesh(meshd_session_t *session, meshd_ref_t input,
                                            meshd_ref_t mesh, meshd_ref_t *out);

/* Borrows `input` onto `stream` (mutably or not): *handle gets the tensor to use
 * there, *borrow the borrow's ref for meshd_session_drop_borrow. */
MESHD_API meshd_err_t meshd_session_borrow(meshd_session_t *session, meshd_ref_t input,
                                           meshd_ref_t stream, bool is_mutable,
                                           meshd_ref_t *handle, meshd_ref_t *borrow);
/* Ends a borrow: its handle is dropped, the origin usable again. */
MESHD_API meshd_err_t meshd_session_drop_borrow(meshd_session_t *session, meshd_ref_t borrow);

/* The lease the server gave the session (seconds; CreateSession's ttl_seconds). */
MESHD_API uint64_t meshd_session_ttl(const meshd_session_t *session);

/* ---------------------------------------------------------------- pipeline */

/* Pipelining (opt-in per session; off by default). With it on, the commands
 * that return nothing the caller needs now are not sent one by one as unary
 * Execute calls: they are queued and go out together, as one batch Command on
 * one Submit stream per session (docs/protocol.md, Batches), and the call
 * returns at once with MESHD_E_OK. Those are meshd_session_call, _factory,
 * _reduce, _reduce_onto, _reduce_dims, _reduce_with, _to_mesh, _drop, _release, _borrow and _drop_borrow:
 * every ref they hand out is chosen by the library before the server answers.
 *
 * The queue goes out when it holds max_batch commands, when max_delay_us
 * passed since its first command (a background thread sends it: no further
 * call is needed), and before every call that needs an answer: _sync,
 * _fetch*, _upload*, _load, _create_mesh, _slice_mesh, _stream, turning the
 * pipeline off, and _close. Such a call first waits for the server's answer
 * to every queued command (bounded by its deadline). If the server rejected
 * any, the call does not run: it fails with MESHD_E_RPC and
 * meshd_last_error() names the first rejected command (lowest seq) in `seq`,
 * its error kind in `kind`, and the server's message with the seqs of later
 * rejections; the rejections are then forgotten, and calling again runs the
 * call. Commands after a rejected one still ran (the server runs each
 * command of a batch on its own; one that used the rejected command's
 * result is rejected too). Run-time failures on the agents are reported by
 * Sync, as without a pipeline. _close sends what is queued and drops the
 * rejections unreported.
 *
 * Threads: the session is still used by one thread at a time. A pipelined
 * session runs two more background threads ("meshd-pipe-rd" reads the
 * answers, "meshd-pipe-fl" sends a batch whose delay passed) that touch
 * neither the client's last error nor the session's refs. If the Submit
 * stream fails (the server went away), every later queued command and every
 * call that needs an answer fails with its status until the pipeline is set
 * again (which opens a new stream).
 *
 * Flow control: a server whose session has too much work queued on its agents
 * (--session-max-queued) stops reading the Submit stream. A queued command
 * then waits, within the client's timeout, for the full batch before it to go
 * out (or for those before it to reach their deadlines); past it the call
 * fails MESHD_E_DEADLINE and that command is not queued (its ref is not
 * taken: calling again later is safe). A command still in the client's
 * queue (not yet handed to the stream) at its deadline (its call's timeout)
 * is taken out there and never sent, so it did not run, whether a call
 * waits for the answers or none does (the "meshd-pipe-fl" thread, as in the
 * Node client): the next call that needs an answer reports it as it reports
 * a rejection (it fails MESHD_E_DEADLINE without running, `seq` the first
 * taken out, the message names their seqs; calling again is safe). A call
 * that needs an answer fails MESHD_E_DEADLINE at its own deadline; the
 * commands still queued then are taken out the same way and named in its
 * message (after a rejection it reports, too). Seqs then have gaps, their
 * refs stay unused, and a later command that uses one is refused by the
 * server (UNKNOWN_REF). Those handed to the stream may still run: they go
 * out once the server reads again, and the next call that needs an answer
 * waits for them. */
typedef struct meshd_pipeline_options {
  size_t max_batch; /* commands per Submit message, 1..4096 (0: 256); a batch
                       also goes out past 1 MiB */
  int max_delay_us; /* how long a queued command may wait for more to join it:
                       1..60,000,000 µs (0: 200) */
} meshd_pipeline_options_t;

#define MESHD_PIPELINE_OPTIONS_INIT {256, 200}

/* Turns the session's pipeline on with opts (NULL: off). On when it was on
 * already: the new limits apply from the next command, on a new stream if the
 * old one failed; a rejection the failed stream had received is reported then
 * (its error, returned; the new stream is open all the same). Off: what is
 * queued is sent and answered first, and a rejection among it is reported as
 * by a call that needs an answer (the pipeline is off all the same).
 * MESHD_E_INVALID for limits out of range (the message names the field). */
MESHD_API meshd_err_t meshd_session_set_pipeline(meshd_session_t *session,
                                                 const meshd_pipeline_options_t *opts);

/* What a session's pipeline did since it was turned on. */
typedef struct meshd_pipeline_stats {
  uint64_t commands_queued;   /* commands the session queued, less those taken
                                 out unsent at a deadline (queued less sent:
                                 what waits in the client's queue) */
  uint64_t commands_sent;     /* of those, written to the Submit stream */
  uint64_t messages_sent;     /* the Submit messages (batches) they went in */
  uint64_t delay_flushes;     /* of those, sent because max_delay_us passed */
  uint64_t commands_answered; /* answers received */
  uint64_t replies;           /* the SubmitReply messages they came in */
  uint64_t rejected;          /* answers that were rejections */
} meshd_pipeline_stats_t;

/* Copies the counters into *out (zeros while the pipeline is off).
 * MESHD_E_INVALID for NULLs. */
MESHD_API meshd_err_t meshd_session_pipeline_stats(const meshd_session_t *session,
                                                   meshd_pipeline_stats_t *out);

/* The Command.seq of the session's last command (queued or sent); 0 before
 * the first. A caller keeps it to match meshd_error_info_t.seq. */
MESHD_API uint64_t meshd_session_last_seq(const meshd_session_t *session);

/* Sync: waits until everything issued so far ran; fails with the first run-time
 * error not reported before (its kind in meshd_last_error). */
MESHD_API meshd_err_t meshd_session_sync(meshd_session_t *session);

/* meshd_session_sync with its own deadline: timeout_ms > 0 bounds the wait
 * (<= 0: the client's timeout). Past it: MESHD_E_DEADLINE; the work it waited
 * for goes on, and a later Sync reports its errors. */
MESHD_API meshd_err_t meshd_session_sync_timeout(meshd_session_t *session, int timeout_ms);

/* A fetched local tensor, converted to float64. Owned by the caller: free with
 * meshd_values_free. */
typedef struct meshd_values {
  double *values; /* n values, row-major (NULL when n == 0) */
  size_t n;
  int64_t *shape; /* ndim sizes (NULL when ndim == 0) */
  size_t ndim;
} meshd_values_t;

/* Fetch `tensor` from the rank at coordinate dims[i] = index[i] (ncoords of
 * them, one per dim of the tensor's mesh). On MESHD_E_OK fills *out (caller
 * frees with meshd_values_free); on failure *out is zeroed. */
MESHD_API meshd_err_t meshd_session_fetch(meshd_session_t *session, meshd_ref_t tensor,
                                          const char *const *dims, const int64_t *index,
                                          size_t ncoords, meshd_values_t *out);

/* meshd_session_fetch with its own deadline: timeout_ms > 0 bounds the whole
 * Fetch (<= 0: the client's timeout). Past it: MESHD_E_DEADLINE, *out zeroed. */
MESHD_API meshd_err_t meshd_session_fetch_timeout(meshd_session_t *session, meshd_ref_t tensor,
                                                  const char *const *dims, const int64_t *index,
                                                  size_t ncoords, int timeout_ms,
                                                  meshd_values_t *out);

/* Progress of a transfer: done_bytes of total_bytes moved so far. Called on the
 * calling thread, from inside the transfer: after each chunk that arrived (done
 * grows) and, on success only, once more at the end with done == total. total is
 * the tensor's size in its own dtype (not float64). Must not call the library. */
typedef void (*meshd_progress_fn)(void *user, uint64_t done_bytes, uint64_t total_bytes);

/* Options of meshd_session_fetch_with; start from MESHD_FETCH_OPTIONS_INIT. */
typedef struct meshd_fetch_options {
  int timeout_ms;             /* > 0 bounds the whole Fetch; <= 0: the client's timeout */
  meshd_progress_fn progress; /* NULL: none */
  void *progress_user;        /* passed to progress */
} meshd_fetch_options_t;

#define MESHD_FETCH_OPTIONS_INIT {0, NULL, NULL}

/* meshd_session_fetch with options (NULL: MESHD_FETCH_OPTIONS_INIT). */
MESHD_API meshd_err_t meshd_session_fetch_with(meshd_session_t *session, meshd_ref_t tensor,
                                               const char *const *dims, const int64_t *index,
                                               size_t ncoords, const meshd_fetch_options_t *opts,
                                               meshd_values_t *out);

/* One local tensor of meshd_session_fetch_bytes: the rank at dims[i] =
 * index[i] (ncoords of them), its bytes (row-major, in the tensor's dtype) into
 * buf, which holds cap bytes. */
typedef struct meshd_fetch_part {
  const char *const *dims;
  const int64_t *index;
  size_t ncoords;
  void *buf;
  size_t cap;
  size_t nbytes; /* out: the local tensor's size in bytes, written to buf */
} meshd_fetch_part_t;

/* Fetches `tensor` from nparts ranks at once (their streams read by one thread
 * of the library's), each straight into its part's buffer, by the session's
 * data path; more than 8 parts (the server's --session-max-transfers by
 * default) go in waves of 8. opts (NULL: defaults):
 * its timeout_ms bounds the whole call; progress is not called. A local tensor
 * larger than its part's cap is MESHD_E_INVALID naming both sizes. On failure
 * the buffers hold partial bytes and the error names the rank at fault. */
MESHD_API meshd_err_t meshd_session_fetch_bytes(meshd_session_t *session, meshd_ref_t tensor,
                                                meshd_fetch_part_t *parts, size_t nparts,
                                                const meshd_fetch_options_t *opts);

/* Frees what meshd_session_fetch put in *v and zeroes it. NULL is ignored. */
MESHD_API void meshd_values_free(meshd_values_t *v);

#ifdef __cplusplus
}
#endif

#endif
