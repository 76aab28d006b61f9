/* Internal to clients/c: the direct data path (docs/protocol.md, Direct data
 * path). The server plans an upload or a fetch (PlanTransfer) and hands out
 * one grant per shard; the bytes then go straight between the caller's buffer
 * and each agent (Agent/Write, Agent/Read), all shards at once, one thread
 * each; FinishUpload (the agents' receipts) or FinishFetch ends it.
 *
 * One direct_t per session, used by the session's thread only (the shard
 * threads read its channels, never its table). Decisions, as the Python
 * client's (clients/python/meshd/direct.py): proxy never goes direct; direct
 * always does and fails when it cannot; auto goes direct unless the session
 * is over TLS and a plan said the agents speak plaintext (with cluster TLS
 * the plan's AgentTls says how to verify them), the server refused
 * PlanTransfer for its --data-path (remembered), or an agent did not connect
 * within DIRECT_CONNECT_MS in the last DIRECT_RETRY_MS; and a transfer whose
 * Read or Write an agent refused for its full grant table
 * (--max-transfer-nonces: too many direct transfers in flight there) takes
 * the proxy, that transfer only (direct fails saying so); a fallback is
 * counted and its reason kept (meshd_session_transfer_stats). */
#ifndef MESHD_CLIENT_DIRECT_H
#define MESHD_CLIENT_DIRECT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "meshd.h"
#include "meshd/v1/tensor_service.pb-c.h"
#include "rpc.h"

#define DIRECT_CONNECT_MS 1000
#define DIRECT_RETRY_MS 30000

/* A failure, for the caller to record on its client. */
typedef struct direct_err {
  meshd_err_t err;
  grpc_status_code code;
  char kind[32];
  char msg[768];
} direct_err_t;

void direct_err_set(direct_err_t *e, meshd_err_t err, grpc_status_code code, const char *kind,
                    const char *fmt, ...) __attribute__((format(printf, 5, 6)));

/* Whether a plan's agent address is host:port (a name, an IPv4 address or a
 * bracketed IPv6 one, a port of 1 to 5 digits), never a gRPC target such as
 * unix:/path or dns:///name that would dial something other than an agent. */
bool direct_host_port(const char *address);

/* A failed call's status as an error (DEADLINE_EXCEEDED: MESHD_E_DEADLINE),
 * its message after `prefix`. */
void direct_err_status(direct_err_t *e, const rpc_status_t *st, const char *prefix);

/* What a session's transfers need of it. */
typedef struct direct_session {
  rpc_channel_t *ch;  /* the server */
  const rpc_md_t *md; /* the session's metadata */
  size_t nmd;
  const char *id;
  int timeout_ms;     /* every call's deadline */
  bool tls;           /* the session is over TLS */
  /* An upload's mesh's ranks in row-major order, where the session knows them
   * (NULL: only the plan's own consistency is checked). */
  const uint32_t *mesh_ranks;
  size_t n_mesh_ranks;
  /* The session's next command seq (NULL: unknown): a fetch whose Read came
   * past its grant's start-by time is planned again only while it is the same
   * as at the first plan (a new plan snapshots the tensor as it stands then). */
  const uint64_t *next_seq;
  bool replan; /* an upload planned again after a late grant (direct_late_grant) */
} direct_session_t;

/* Why a direct upload's plan does not split it over the mesh as it should
 * (docs/protocol.md: one shard per rank of the mesh, in its row-major order,
 * each rank once; per_rank: shard i gets the i-th slice of `bytes`, `slice`
 * bytes each where known, else 0), written
 * to why (why[0] '\0': it does). mesh_ranks NULL: the order is not checked. */
void direct_plan_mismatch(const Meshd__V1__PlanTransferReply *p, bool per_rank, size_t bytes,
                          size_t slice, const uint32_t *mesh_ranks, size_t n_mesh_ranks, char *why,
                          size_t len);

/* Where one fetched local tensor goes: begin(meta) before any byte, then
 * data() for each piece in order (from a shard's thread when there are several
 * parts). Each returns 0, or -1 with e set (the fetch stops). begin may come
 * again, after bytes too: a direct fetch that fell back to the proxy once its
 * Reads had run (auto: an agent's grant table was full) begins every sink
 * anew, which starts over. */
typedef struct direct_sink {
  int (*begin)(void *arg, const Meshd__V1__TensorMeta *meta, direct_err_t *e);
  int (*data)(void *arg, const uint8_t *p, size_t n, direct_err_t *e);
  void *arg;
} direct_sink_t;

typedef enum {
  DIRECT_DONE,   /* moved directly */
  DIRECT_PROXY,  /* not taken: use the proxied Upload/Fetch */
  DIRECT_FAILED, /* e says why */
} direct_rc_t;

typedef struct direct direct_t;

direct_t *direct_create(void);
void direct_free(direct_t *d); /* NULL is ignored */
void direct_set_mode(direct_t *d, meshd_data_path_t mode);
void direct_stats(const direct_t *d, meshd_transfer_stats_t *out);
/* A transfer that went through the server. */
void direct_count_proxy(direct_t *d, bool upload);

/* Uploads `bytes` of data as header h (h->ref not yet used by any command).
 * *ref_spent: the ref was claimed by a plan (done or not): a proxied upload
 * after DIRECT_PROXY, or the next command, takes a new one. *defined (with
 * DIRECT_FAILED only): the server defined h->ref all the same (FinishUpload's
 * answers were lost, the abandon's said so); the caller, which has the
 * session's commands, drops it within direct_cleanup_ms. */
direct_rc_t direct_upload(direct_t *d, const direct_session_t *s, const Meshd__V1__UploadHeader *h,
                          const uint8_t *data, size_t bytes, bool *ref_spent, bool *defined,
                          direct_err_t *e);

/* Whether e is a transfer refused only because its Writes or Reads started
 * past their grants' start-by time (--transfer-grant-start-ms after the plan;
 * the process was paused between plan and transfer): nothing was stored or
 * read, the plan was given back, and a new plan would get grants good again.
 * Its message starts with "the transfer's grant expired before it started". */
bool direct_late_grant(const direct_err_t *e);

/* The time for a call that undoes a transfer: what is left until `end`
 * (rpc_now_ms), but at least a second, even past it. */
int direct_cleanup_ms(int64_t end);

/* Fetches n local tensors (reqs[i] into sinks[i]), all done by `end`
 * (rpc_now_ms); parts run in parallel. */
direct_rc_t direct_fetch(direct_t *d, const direct_session_t *s,
                         const Meshd__V1__FetchRequest *const *reqs, const direct_sink_t *sinks,
                         size_t n, int64_t end, direct_err_t *e);

/* Runs fn(arg, i) for i in [0, n): i < n - 1 on threads of a process-wide
 * pool (parked between calls), the last on the calling thread, which would
 * only wait meanwhile. Returns 0, or -1 if a thread could not start (the ones
 * started are waited for; fn did not run for the rest). */
int direct_parallel(size_t n, void (*fn)(void *arg, size_t i), void *arg);

/* n server-streaming calls (calls[i]: one request, then messages until the
 * status) read at once: the rpc layer's one pull thread takes their messages
 * and queues them, and the calling thread runs on_msg(arg, i, msg) for each
 * (packed; the helper frees it; 0 for the next, non-zero cancels the call and
 * no more of its messages are handed on) and then on_end(arg, i, code, st). A
 * thread per call took turns as gRPC's poller: 1.7 times the client CPU per GB
 * over 4 shards. Returns once every call ended (each has its own deadline,
 * timeout_ms); a call that cannot start ends at once with UNAVAILABLE. */
typedef struct direct_call {
  rpc_channel_t *ch;
  const char *method;
  const ProtobufCMessage *req;
  const rpc_md_t *md;
  size_t nmd;
} direct_call_t;
void direct_pull_all(size_t n, const direct_call_t *calls, int timeout_ms,
                     int (*on_msg)(void *arg, size_t i, rpc_bytes_t *msg),
                     void (*on_end)(void *arg, size_t i, grpc_status_code code,
                                    const rpc_status_t *st),
                     void *arg);

/* A message that rpc_bytes_is_field accepted: its bytes to k->data, piece by
 * piece as they lie in the message (the one copy). 0, or k->data's error. */
int direct_sink_field(const direct_sink_t *k, rpc_bytes_t *msg, direct_err_t *e);

/* Bytes per element of a DType (float16 and bfloat16: 2); 0 if unknown. */
size_t direct_dtype_bytes(int dtype);
/* The bytes of a TensorMeta's elements into *out (0 for an unknown dtype);
 * false when they overflow 64 bits (a server's shape is not to be trusted). */
bool direct_meta_bytes(const Meshd__V1__TensorMeta *m, uint64_t *out);

#endif
