/* The device backend behind one vtable (NCCL's ncclNet_t, curl's Curl_ssl):
 * `cpu` (agent/cpu/) is always built; `cuda` (agent/cuda/) plugs into the same
 * slots. Code outside a backend's folder never includes its headers.
 *
 * Tensors an agent holds are agent_tensor_t: a view (dtype + layout, exactly
 * the server's tensor_meta_t) on a reference-counted storage the backend
 * allocated. Every slot is required unless its comment says NULL is allowed. */
#ifndef MESHD_AGENT_BACKEND_H
#define MESHD_AGENT_BACKEND_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dataplane/dataplane.h"
#include "error_kind.h"
#include "ops.h"

typedef struct backend backend_t;

struct snapshot;

/* Device memory of one tensor and its views. */
typedef struct agent_storage {
  _Atomic int refs;
  backend_t *backend; /* frees it */
  void *data;         /* device pointer (host memory for cpu) */
  size_t bytes;
  _Atomic int pins;         /* snapshots reading it (snapshot.h): writers copy them aside */
  struct snapshot *pinned;  /* those snapshots (snapshot.c's lock) */
} agent_storage_t;

/* A tensor: `meta` first, so an op_value_t's tensor pointer (a tensor_meta_t *)
 * converts back to its agent_tensor_t. */
typedef struct agent_tensor {
  tensor_meta_t meta;     /* dtype + layout (offset and strides in elements) */
  agent_storage_t *storage;
} agent_tensor_t;

/* An ordered queue of work on the device (a CUDA stream; the calling thread
 * for cpu, whose kernels complete before they return). */
typedef struct backend_stream backend_stream_t;
/* A point recorded on a stream that another stream can wait for (a CUDA event). */
typedef struct backend_event backend_event_t;

typedef struct backend_ops {
  const char *name; /* "cpu", "cuda" */
  /* Opens the device ("cpu", "cuda:0"). Returns 0, or -1 with err. */
  int (*open)(backend_t *b, const char *device, meshd_error_t *err);
  void (*close)(backend_t *b);
  /* Device memory; NULL when out of memory or when `allocated` would pass
   * `capacity` (the caller reports QUOTA / RESOURCE_EXHAUSTED for that
   * command; the agent lives on). Adds bytes to `allocated`; free subtracts
   * them. `s` is the stream that uses the memory first (cuda: allocated in
   * that stream's order); NULL: ready for every stream when alloc returns.
   * free may come from any thread once every use of the memory has been
   * queued (on any stream): the backend orders the release after that work.
   * cpu: 64-byte aligned, not zeroed. */
  void *(*alloc)(backend_t *b, backend_stream_t *s, size_t bytes);
  void (*free)(backend_t *b, void *ptr, size_t bytes);
  /* Streams. NULL allowed for all three on backends without streams (cpu),
   * where s is always NULL. stream_sync waits until everything queued on s
   * has run: 0, or -1 with err when the device failed. stream_destroy waits
   * too. A NULL stream given to any slot means the backend's own stream, used
   * synchronously. */
  backend_stream_t *(*stream_create)(backend_t *b);
  void (*stream_destroy)(backend_t *b, backend_stream_t *s);
  int (*stream_sync)(backend_t *b, backend_stream_t *s, meshd_error_t *err);
  /* Whether the device still works: 0, or -1 with err once it is lost (the
   * agent then reports NOT_SERVING and exits). NULL: it cannot be lost (cpu). */
  int (*health)(backend_t *b, meshd_error_t *err);
  /* Runs catalogue op `a->op` on bound arguments whose tensors are
   * agent_tensor_t views (see agent_tensor_of), writing results[i], which the
   * caller allocated from the op's inferred metas (views already point into
   * their input's storage). Mutated inputs are written in place. Returns 0,
   * or -1 with err (REMOTE_FAILURE with a message naming the op, e.g. an
   * index out of range). `rank` and `coordinate` serve rank()/rand(). */
  int (*run_op)(backend_t *b, backend_stream_t *s, const op_args_t *a, agent_tensor_t **results,
                int nresults, const op_infer_t *inf, uint32_t mesh_rank, int64_t coordinate,
                meshd_error_t *err);
  /* Copies src into dst (same shape; any strides and dtypes: casts). */
  int (*copy)(backend_t *b, backend_stream_t *s, agent_tensor_t *dst, const agent_tensor_t *src,
              meshd_error_t *err);
  /* Host <-> device for Upload/Fetch, scalars and flags: dst/src are
   * row-major bytes of the whole tensor in its dtype (non-contiguous tensors
   * are gathered/scattered). Ordered after the work queued on s before the
   * call (NULL: the backend's own stream), and after nothing queued on any
   * other stream: one session's transfer does not wait for another's kernels.
   * So t's memory must be ready in s's order: allocated on s, or with a NULL
   * stream (ready for every stream), or ordered by an event (snapshot.c).
   * Synchronous: to_host's bytes are in dst, from_host's on the device for
   * every stream, when it returns. */
  int (*to_host)(backend_t *b, backend_stream_t *s, const agent_tensor_t *t, void *dst,
                 meshd_error_t *err);
  int (*from_host)(backend_t *b, backend_stream_t *s, agent_tensor_t *t, const void *src,
                   meshd_error_t *err);

  /* Events, for borrows: record a point on stream s; make stream t wait for it.
   * NULL on backends whose streams are host threads (cpu): the executor orders
   * those itself with per-stream progress counters. */
  backend_event_t *(*event_record)(backend_t *b, backend_stream_t *s);
  int (*event_wait)(backend_t *b, backend_stream_t *t, backend_event_t *ev); /* -1: not ordered */
  void (*event_destroy)(backend_t *b, backend_event_t *ev);

  /* Communicators: collectives and point-to-point between agents on the
   * backend's network (cpu: the TCP data plane, b->net; cuda: NCCL, which
   * bootstraps over b->net). Buffers are device memory, contiguous, allocated
   * on stream s (or ready for it); the call returns once the result is in
   * place on s's order. Semantics and failure rules as in
   * dataplane.h (every member calls with the same group and arguments; a
   * vanished peer fails every member within a timeout, never hangs).
   * Returns 0, or -1 with err; -1 with REMOTE_FAILURE when no network is set. */
  int (*allreduce)(backend_t *b, backend_stream_t *s, const dp_group_t *g, void *buf, size_t count,
                   dtype_t dtype, reduction_t op, meshd_error_t *err);
  int (*reduce_scatter)(backend_t *b, backend_stream_t *s, const dp_group_t *g, const void *in,
                        void *out, size_t count, dtype_t dtype, reduction_t op, meshd_error_t *err);
  int (*allgather)(backend_t *b, backend_stream_t *s, const dp_group_t *g, const void *in, void *out,
                   size_t count, dtype_t dtype, meshd_error_t *err);
  int (*alltoall)(backend_t *b, backend_stream_t *s, const dp_group_t *g, const void *in, void *out,
                  size_t count, dtype_t dtype, meshd_error_t *err);
  /* Rooted (reduce onto a sub-mesh): only member `root` (an index of g) ends
   * with the result (dp_reduce_root, dp_gather_root); NULL: the executor runs
   * allreduce or allgather and the others drop theirs. */
  int (*reduce_root)(backend_t *b, backend_stream_t *s, const dp_group_t *g, size_t root, void *buf,
                     size_t count, dtype_t dtype, reduction_t op, meshd_error_t *err);
  int (*gather_root)(backend_t *b, backend_stream_t *s, const dp_group_t *g, size_t root,
                     const void *in, void *out, size_t count, dtype_t dtype, meshd_error_t *err);
  /* Member 0's buf to every member of g (to_mesh's broadcast): cpu runs
   * dp_broadcast's pipelined chain over the data plane (buf must be a whole
   * allocation of `bytes`: between agents on one host a large one is mapped
   * over it from the source's memfd); cuda one ncclBroadcast from member 0
   * on the group's communicator (cuda_nccl.c; cuda:emulated keeps the data
   * plane's chain). */
  int (*broadcast)(backend_t *b, backend_stream_t *s, const dp_group_t *g, void *buf, size_t bytes,
                   meshd_error_t *err);
  /* Point to point: `session` is the key of the session the transfer
   * belongs to (dp_group_t.session); `call` the transfer's number on the
   * channel, the same at both ends (dp_group_t.call); `secret` the channel's
   * DP_SECRET_LEN bytes (SendTensor.secret, as dp_group_t.secret). */
  int (*send)(backend_t *b, backend_stream_t *s, uint64_t session, uint64_t comm_id,
              uint64_t call, const uint8_t *secret, uint32_t to_rank, const char *addr, const void *buf,
              size_t bytes, meshd_error_t *err);
  int (*recv)(backend_t *b, backend_stream_t *s, uint64_t session, uint64_t comm_id,
              uint64_t call, const uint8_t *secret, uint32_t from_rank, const char *addr, void *buf, size_t bytes,
              meshd_error_t *err);
  /* This member will not take part in a data plane call it was sent (a
   * collective or broadcast of g, or its side of a send or recv: g the
   * one-member group of the peer): it failed before it could. Tells the
   * peers why, so that they fail the call now instead of at the timeout
   * (dp_refuse, which it blocks in as the call would have). NULL allowed:
   * the peers wait out the timeout (cuda:N, whose peers wait in NCCL). */
  void (*refuse)(backend_t *b, const dp_group_t *g, dp_refuse_t what, uint64_t calls,
                   const char *why);
  /* The session with this key ended on this agent: release what its
   * collectives and sends kept (cuda: destroy its NCCL communicators). NULL
   * allowed. */
  void (*session_end)(backend_t *b, uint64_t session);
  /* The server declared `rank` lost for the session with this key: abort its
   * communicators that include the rank (a call waiting in one fails with
   * AGENT_LOST at once, not at the timeout). NULL allowed (cpu: the data
   * plane's dataplane_peer_lost does it). */
  void (*peer_lost)(backend_t *b, uint64_t session, uint32_t rank);
} backend_ops_t;

struct backend {
  const backend_ops_t *ops;
  void *impl;                 /* the backend's own state */
  _Atomic uint64_t allocated; /* bytes held now (reported to the server) */
  uint64_t capacity;          /* bytes it may hold (--memory-bytes); 0: no limit */
  int comm_timeout_ms;        /* --comm-timeout-ms, for communicators outside the data
                               * plane (cuda: NCCL); 0: the backend's default */
  dataplane_t *net;           /* the agents' TCP transport (dataplane/dataplane.h): the cpu
                               * and emulated communicators, NCCL's bootstrap; may be NULL */
};

/* The accounting every backend's alloc does before it allocates: adds bytes
 * to b->allocated, or returns false (adding nothing) when that would pass
 * b->capacity. backend_unreserve takes them back (free, a failed alloc).
 * C only: the .cu kernels never allocate. */
#ifndef __cplusplus
static inline bool backend_reserve(backend_t *b, size_t bytes) {
  uint64_t prev = atomic_fetch_add(&b->allocated, bytes);
  if (b->capacity && prev + bytes > b->capacity) {
    atomic_fetch_sub(&b->allocated, bytes);
    return false;
  }
  return true;
}
static inline void backend_unreserve(backend_t *b, size_t bytes) {
  atomic_fetch_sub(&b->allocated, bytes);
}
#endif

/* The cpu backend's table (agent/cpu/). */
extern const backend_ops_t cpu_backend_ops;
/* The cuda backend's table (agent/cuda/), in builds with MESHD_HAVE_CUDA.
 * Devices "cuda:N", and "cuda:emulated": the same kernels run on the host over
 * host memory, with the TCP data plane for communicators (tests on machines
 * without a GPU; slow). */
extern const backend_ops_t cuda_backend_ops;

/* The backend serving `device` ("cpu", "cuda:0", ...) in this build; NULL when
 * none does (backends.c). */
const backend_ops_t *backend_for_device(const char *device);
/* "cpu, cuda:N" — the device names this build serves, for messages. */
const char *backend_devices_supported(void);

/* The agent_tensor_t a bound tensor argument refers to. */
static inline agent_tensor_t *agent_tensor_of(const tensor_meta_t *m) {
  return (agent_tensor_t *)m;
}

#endif
