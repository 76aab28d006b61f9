/* Stand-ins for NCCL, the CUDA runtime, the data plane and the cuda helpers
 * that cuda_nccl.c calls (fake_nccl_cuda.h). A broken contract (a host pointer
 * handed to NCCL, a wrong device, a bad config) aborts the process: the test
 * that provoked it fails as crashed. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda_internal.h"
#include "fake_device_memory.h"
#include "fake_nccl_cuda.h"

fake_counters_t fake;
atomic_int fake_never_join, fake_init_error, fake_op_error, fake_finalize_hangs, fake_stream_busy;
atomic_int fake_hold_rank1_inits;


/* ------------------------------------------- cuda helpers (cuda_device.c) */

int cuda_check(cuda_state_t *st, cudaError_t rc, const char *what, meshd_error_t *e) {
  (void)st;
  if (rc == cudaSuccess) return 0;
  return error_set(e, ERR_REMOTE_FAILURE, "%s: fake cuda error %d", what, (int)rc);
}

void cuda_mark_lost(cuda_state_t *st, const char *why) {
  fake.marked_lost++;
  if (!st->lost) {
    st->lost = true;
    snprintf(st->lost_why, sizeof st->lost_why, "%s", why);
  }
}

void *cuda_scratch_alloc(backend_t *b, backend_stream_t *bs, size_t bytes) {
  fake.scratch_live++;
  return fake_dev_alloc(bytes);
}

void cuda_scratch_free(backend_t *b, backend_stream_t *bs, void *p, size_t bytes) {
  REQUIRE(fake_is_dev(p, bytes));
  fake.scratch_live--;
  fake_dev_free(p);
}

int cuda_memcpy(backend_t *b, backend_stream_t *bs, void *dst, const void *src, size_t bytes,
                meshd_error_t *e) {
  fake.memcpy_calls++;
  memcpy(dst, src, bytes);
  return 0;
}

static bool is_int_dtype(dtype_t d) {
  return d == DTYPE_INT8 || d == DTYPE_UINT8 || d == DTYPE_INT16 || d == DTYPE_INT32 ||
         d == DTYPE_INT64 || d == DTYPE_BOOL;
}

static int64_t ld_i(dtype_t d, const void *p, size_t i) {
  switch (d) {
  case DTYPE_INT8: return ((const int8_t *)p)[i];
  case DTYPE_UINT8: case DTYPE_BOOL: return ((const uint8_t *)p)[i];
  case DTYPE_INT16: return ((const int16_t *)p)[i];
  case DTYPE_INT32: return ((const int32_t *)p)[i];
  default: return ((const int64_t *)p)[i];
  }
}

static void st_i(dtype_t d, void *p, size_t i, int64_t v) {
  switch (d) {
  case DTYPE_INT8: ((int8_t *)p)[i] = (int8_t)v; break;
  case DTYPE_UINT8: ((uint8_t *)p)[i] = (uint8_t)v; break;
  case DTYPE_BOOL: ((uint8_t *)p)[i] = v != 0; break;
  case DTYPE_INT16: ((int16_t *)p)[i] = (int16_t)v; break;
  case DTYPE_INT32: ((int32_t *)p)[i] = (int32_t)v; break;
  default: ((int64_t *)p)[i] = v; break;
  }
}

/* Floating min/max as the cpu data plane: a NaN on either side wins. */
static void reduce_floats(const void *in, void *out, size_t n, size_t count, dtype_t dtype,
                          reduction_t op) {
  REQUIRE(op == RED_MIN || op == RED_MAX);
  for (size_t j = 0; j < count; j++) {
    double acc = dtype == DTYPE_FLOAT32 ? ((const float *)in)[j] : ((const double *)in)[j];
    for (size_t k = 1; k < n; k++) {
      size_t i = k * count + j;
      double v = dtype == DTYPE_FLOAT32 ? ((const float *)in)[i] : ((const double *)in)[i];
      if (acc != acc || v != v) acc = acc != acc ? acc : v;
      else acc = (op == RED_MAX) == (v > acc) ? v : acc;
    }
    if (dtype == DTYPE_FLOAT32) ((float *)out)[j] = (float)acc;
    else ((double *)out)[j] = acc;
  }
}

/* The cpu data plane's semantics on the reductions the plan sends here:
 * integers, and floating min/max. */
int cuda_reduce_slices(backend_t *b, backend_stream_t *bs, const void *in, void *out, size_t n,
                       size_t count, dtype_t dtype, reduction_t op, meshd_error_t *e) {
  size_t esz = dtype_size(dtype);
  REQUIRE(is_int_dtype(dtype) || dtype == DTYPE_FLOAT32 || dtype == DTYPE_FLOAT64);
  REQUIRE(fake_is_dev(in, n * count * esz) && fake_is_dev(out, count * esz));
  fake.reduce_slices++;
  if (!is_int_dtype(dtype)) {
    reduce_floats(in, out, n, count, dtype, op);
    return 0;
  }
  for (size_t j = 0; j < count; j++) {
    int64_t acc = ld_i(dtype, in, j);
    for (size_t k = 1; k < n; k++) {
      int64_t v = ld_i(dtype, in, k * count + j);
      switch (op) {
      case RED_SUM: acc += v; break;
      case RED_PRODUCT: acc *= v; break;
      case RED_MIN: acc = v < acc ? v : acc; break;
      case RED_MAX: acc = v > acc ? v : acc; break;
      case RED_BAND: acc &= v; break;
      case RED_BOR: acc |= v; break;
      case RED_BXOR: acc ^= v; break;
      default: REQUIRE(!"an integer reduction the catalogue refuses (avg, stack)");
      }
    }
    st_i(dtype, out, j, acc);
  }
  return 0;
}

/* -------------------------------------------------------------- data plane */

typedef struct msg {
  struct msg *next;
  uint64_t chan, call;
  uint8_t secret[DP_SECRET_LEN]; /* a receiver with another secret never sees it */
  uint32_t from, to;
  size_t n;
  char data[];
} msg_t;
static pthread_mutex_t dp_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t dp_cv = PTHREAD_COND_INITIALIZER;
static msg_t *mailbox;

int dp_send(dataplane_t *dp, uint64_t comm_id, uint64_t call, const uint8_t *secret, uint32_t to_rank,
            const char *addr, const void *buf, size_t bytes, meshd_error_t *err) {
  msg_t *m = malloc(sizeof *m + bytes);
  REQUIRE(m && addr && secret);
  *m = (msg_t){.chan = comm_id, .call = call, .from = dp->rank, .to = to_rank, .n = bytes};
  memcpy(m->secret, secret, DP_SECRET_LEN);
  memcpy(m->data, buf, bytes);
  pthread_mutex_lock(&dp_mu);
  msg_t **p = &mailbox;
  while (*p) p = &(*p)->next;
  *p = m;
  pthread_cond_broadcast(&dp_cv);
  pthread_mutex_unlock(&dp_mu);
  return 0;
}

int dp_recv(dataplane_t *dp, uint64_t comm_id, uint64_t call, const uint8_t *secret, uint32_t from_rank,
            const char *addr, void *buf, size_t bytes, meshd_error_t *err) {
  REQUIRE(secret);
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += dp->timeout_ms / 1000;
  dl.tv_nsec += (long)(dp->timeout_ms % 1000) * 1000000L;
  if (dl.tv_nsec >= 1000000000L) {
    dl.tv_sec++;
    dl.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&dp_mu);
  for (;;) {
    for (msg_t **p = &mailbox; *p;) {
      msg_t *m = *p;
      if (m->chan != comm_id || m->from != from_rank || m->to != dp->rank ||
          memcmp(m->secret, secret, DP_SECRET_LEN) != 0) {
        p = &m->next;
        continue;
      }
      if (m->call > call) break; /* the real one fails as behind; this one waits */
      *p = m->next;
      if (m->call < call) { /* an older call's: skipped, as the data plane does */
        free(m);
        continue;
      }
      pthread_mutex_unlock(&dp_mu);
      REQUIRE(m->n == bytes);
      memcpy(buf, m->data, bytes);
      free(m);
      return 0;
    }
    if (pthread_cond_timedwait(&dp_cv, &dp_mu, &dl) == ETIMEDOUT) {
      pthread_mutex_unlock(&dp_mu);
      return error_set(err, ERR_REMOTE_FAILURE, "recv from rank %u timed out", from_rank);
    }
  }
}

/* Drops undelivered messages (called at the end of a test, for leak checkers). */
void fake_dp_drain(void) {
  pthread_mutex_lock(&dp_mu);
  while (mailbox) {
    msg_t *m = mailbox;
    mailbox = m->next;
    free(m);
  }
  pthread_mutex_unlock(&dp_mu);
}

/* The emulated device's path: cuda_nccl.c only delegates. */
int dp_allreduce(dataplane_t *dp, const dp_group_t *g, void *buf, size_t count, dtype_t dtype,
                 reduction_t op, meshd_error_t *err) {
  fake.dp_collectives++;
  return 0;
}
int dp_reduce_scatter(dataplane_t *dp, const dp_group_t *g, const void *in, void *out,
                      size_t count, dtype_t dtype, reduction_t op, meshd_error_t *err) {
  fake.dp_collectives++;
  return 0;
}
int dp_allgather(dataplane_t *dp, const dp_group_t *g, const void *in, void *out, size_t count,
                 dtype_t dtype, meshd_error_t *err) {
  fake.dp_collectives++;
  return 0;
}
int dp_alltoall(dataplane_t *dp, const dp_group_t *g, const void *in, void *out, size_t count,
                dtype_t dtype, meshd_error_t *err) {
  fake.dp_collectives++;
  return 0;
}
int dp_reduce_root(dataplane_t *dp, const dp_group_t *g, size_t root, void *buf, size_t count,
                   dtype_t dtype, reduction_t op, meshd_error_t *err) {
  fake.dp_collectives++;
  return 0;
}
int dp_gather_root(dataplane_t *dp, const dp_group_t *g, size_t root, const void *in, void *out,
                   size_t count, dtype_t dtype, meshd_error_t *err) {
  fake.dp_collectives++;
  return 0;
}
int dp_broadcast(dataplane_t *dp, const dp_group_t *g, void *buf, size_t bytes, meshd_error_t *err) {
  fake.dp_collectives++;
  return 0;
}
/* A refusal reaches the watches of its comm (every agent of a test shares
 * this fake data plane), as the real one reaches its peers' listeners. */
static _Atomic uint64_t refused_comm, refused_last;
static char refused_why[200];

int dp_refuse(dataplane_t *dp, const dp_group_t *g, dp_refuse_t what, uint64_t calls,
              const char *why, meshd_error_t *err) {
  pthread_mutex_lock(&dp_mu);
  snprintf(refused_why, sizeof refused_why, "rank %u did not take part: %s", dp->rank, why);
  pthread_mutex_unlock(&dp_mu);
  atomic_store(&refused_last, g->call + calls - 1);
  atomic_store(&refused_comm, g->comm_id);
  fake.dp_refusals++;
  return 0;
}

struct dp_watch {
  uint64_t comm_id, call;
};

dp_watch_t *dp_watch_begin(dataplane_t *dp, const dp_group_t *g) {
  dp_watch_t *w = malloc(sizeof *w);
  REQUIRE(w && g);
  w->comm_id = g->comm_id;
  w->call = g->call;
  fake.dp_watches++;
  return w;
}

bool dp_watch_fired(dataplane_t *dp, dp_watch_t *w, char *why, size_t len) {
  if (!w || atomic_load(&refused_comm) != w->comm_id || w->call > atomic_load(&refused_last))
    return false;
  pthread_mutex_lock(&dp_mu);
  snprintf(why, len, "aborted: %s", refused_why);
  pthread_mutex_unlock(&dp_mu);
  return true;
}

void dp_watch_end(dataplane_t *dp, dp_watch_t *w) { free(w); }

/* ------------------------------------------------------------ CUDA runtime */

typedef struct op op_t;
struct CUstream_st {
  int unused;
};
struct CUevent_st {
  op_t *op; /* the NCCL op it waits for; NULL: complete */
};
static _Thread_local op_t *last_op; /* the op this thread last enqueued */
static _Thread_local int cur_device = -1;

cudaError_t cudaSetDevice(int d) {
  cur_device = d;
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int flags) {
  REQUIRE(flags == cudaStreamNonBlocking);
  *s = calloc(1, sizeof **s);
  fake.streams_live++;
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  REQUIRE(s);
  free(s);
  fake.streams_live--;
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned int flags) {
  *e = calloc(1, sizeof **e);
  fake.events_live++;
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  REQUIRE(e);
  free(e);
  fake.events_live--;
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int flags) {
  REQUIRE(e); /* s NULL: the default stream (the tests' callers pass no stream) */
  fake.stream_waits++;
  return cudaSuccess;
}
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t s) { return cudaSuccess; }
cudaError_t cudaStreamQuery(cudaStream_t s) {
  return fake_stream_busy ? cudaErrorNotReady : cudaSuccess;
}
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p) {
  memset(a, 0, sizeof *a);
  a->type = fake_is_dev(p, 1) ? cudaMemoryTypeDevice : cudaMemoryTypeUnregistered;
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind k,
                            cudaStream_t s) {
  REQUIRE(k == cudaMemcpyHostToDevice || k == cudaMemcpyDeviceToHost);
  if (k == cudaMemcpyHostToDevice) REQUIRE(fake_is_dev(dst, n) && !fake_is_dev(src, 1));
  else REQUIRE(!fake_is_dev(dst, 1) && fake_is_dev(src, n));
  memcpy(dst, src, n);
  return cudaSuccess;
}

/* -------------------------------------------------------------------- NCCL */

#define MAX_RANKS FAKE_MAX_RANKS
#define MAX_OPS 64
#define MAX_RETIRED 256
typedef enum { K_ALLREDUCE = 1, K_REDUCE_SCATTER, K_ALLGATHER, K_P2P, K_REDUCE, K_BROADCAST } op_kind_t;
typedef struct {
  bool send;
  void *buf;
  size_t bytes;
  int peer;
} p2p_t;
struct op {
  op_kind_t kind;
  const void *in;
  void *out;
  size_t count;
  ncclDataType_t dt;
  ncclRedOp_t rop;
  int root; /* K_REDUCE, K_BROADCAST */
  p2p_t p[2 * MAX_RANKS];
  int np;
  int seq;
  bool done;
  ncclComm_t comm;
};
typedef struct clique {
  struct clique *next;
  ncclUniqueId id;
  int nranks, joined, refs;
  ncclComm_t members[MAX_RANKS];
  bool finalized[MAX_RANKS]; /* by rank: its member called ncclCommFinalize */
} clique_t;
struct ncclComm {
  clique_t *cl;
  int rank;
  int nops;
  op_t *ops[MAX_OPS]; /* indexed by seq: every member posts 0, 1, 2 ... */
  bool finalizing;
};
static pthread_mutex_t nccl_mu = PTHREAD_MUTEX_INITIALIZER;
static clique_t *cliques;
static ncclUniqueId retired[MAX_RETIRED]; /* ids whose every member is gone */
static int nretired;

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  static atomic_ullong counter;
  memset(id, 0, sizeof *id);
  unsigned long long v = ++counter;
  memcpy(id->internal, &v, sizeof v);
  fake.ids++;
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t *cfg) {
  REQUIRE(cfg && cfg->size == sizeof(ncclConfig_t) && cfg->magic == 0xcafebeef);
  REQUIRE(cfg->blocking == 0); /* the deadline needs a non-blocking init */
  REQUIRE(rank >= 0 && rank < nranks && nranks <= MAX_RANKS);
  REQUIRE(cur_device == FAKE_DEVICE);
  pthread_mutex_lock(&nccl_mu);
  for (int i = 0; i < nretired; i++)
    if (!memcmp(&retired[i], &id, sizeof id)) {
      pthread_mutex_unlock(&nccl_mu);
      *comm = NULL;
      return ncclSystemError; /* its root is gone: connection refused */
    }
  clique_t *c = cliques;
  while (c && memcmp(&c->id, &id, sizeof id)) c = c->next;
  if (!c) {
    c = calloc(1, sizeof *c);
    REQUIRE(c);
    c->id = id;
    c->nranks = nranks;
    c->next = cliques;
    cliques = c;
  }
  REQUIRE(c->nranks == nranks && !c->members[rank]);
  ncclComm_t nc = calloc(1, sizeof *nc);
  REQUIRE(nc);
  nc->cl = c;
  nc->rank = rank;
  c->members[rank] = nc;
  c->joined++;
  c->refs++;
  pthread_mutex_unlock(&nccl_mu);
  fake.inits++;
  fake.comms_live++;
  *comm = nc;
  return ncclInProgress;
}

/* As nccl.h: a finalize completes once the communicator is globally
 * quiescent, i.e. every member has called ncclCommFinalize (a member that
 * aborted instead never does). Under nccl_mu. */
static bool quiescent_locked(const clique_t *c) {
  for (int r = 0; r < c->nranks; r++)
    if (!c->finalized[r]) return false;
  return true;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t nc, ncclResult_t *async) {
  REQUIRE(nc);
  pthread_mutex_lock(&nccl_mu);
  if (nc->finalizing)
    *async = fake_finalize_hangs || !quiescent_locked(nc->cl) ? ncclInProgress : ncclSuccess;
  else if (fake_op_error && nc->nops > 0) *async = (ncclResult_t)fake_op_error;
  else if (fake_init_error) *async = (ncclResult_t)fake_init_error;
  else if (fake_never_join || nc->cl->joined < nc->cl->nranks) *async = ncclInProgress;
  else if (fake_hold_rank1_inits && nc->rank == 1 && nc->nops == 0) *async = ncclInProgress;
  else *async = ncclSuccess;
  pthread_mutex_unlock(&nccl_mu);
  return ncclSuccess;
}

static void comm_free_locked(ncclComm_t nc) {
  clique_t *c = nc->cl;
  c->members[nc->rank] = NULL;
  for (int i = 0; i < nc->nops; i++) free(nc->ops[i]);
  free(nc);
  if (--c->refs == 0) {
    for (clique_t **p = &cliques; *p; p = &(*p)->next)
      if (*p == c) {
        *p = c->next;
        break;
      }
    REQUIRE(nretired < MAX_RETIRED);
    retired[nretired++] = c->id;
    free(c);
  }
}

ncclResult_t ncclCommAbort(ncclComm_t nc) {
  REQUIRE(nc);
  pthread_mutex_lock(&nccl_mu);
  comm_free_locked(nc);
  pthread_mutex_unlock(&nccl_mu);
  fake.aborts++;
  fake.comms_live--;
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t nc) {
  REQUIRE(nc);
  pthread_mutex_lock(&nccl_mu);
  nc->finalizing = true;
  nc->cl->finalized[nc->rank] = true;
  pthread_mutex_unlock(&nccl_mu);
  fake.finalizes++;
  return ncclInProgress;
}

ncclResult_t ncclCommDestroy(ncclComm_t nc) {
  REQUIRE(nc);
  pthread_mutex_lock(&nccl_mu);
  REQUIRE(nc->finalizing); /* destroy follows a finished finalize */
  comm_free_locked(nc);
  pthread_mutex_unlock(&nccl_mu);
  fake.destroys++;
  fake.comms_live--;
  return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t r) {
  switch (r) {
  case ncclSystemError: return "fake system error";
  case ncclRemoteError: return "fake remote error";
  case ncclInternalError: return "fake internal error";
  default: return "fake nccl error";
  }
}
const char *ncclGetLastError(ncclComm_t c) { return c ? "fake last error" : ""; }

static _Thread_local bool in_group;
static _Thread_local op_t *group_op;

/* Publishes `o` on its communicator: from here on another member's thread may
 * run it, so every field is set before and nothing is written after. */
static op_t *publish(op_t *o) {
  ncclComm_t nc = o->comm;
  pthread_mutex_lock(&nccl_mu);
  REQUIRE(nc->nops < MAX_OPS);
  o->seq = nc->nops;
  nc->ops[nc->nops++] = o;
  pthread_mutex_unlock(&nccl_mu);
  last_op = o;
  return o;
}

static op_t *post(ncclComm_t nc, op_t fields) {
  op_t *o = malloc(sizeof *o);
  REQUIRE(o);
  *o = fields;
  o->comm = nc;
  return publish(o);
}

ncclResult_t ncclGroupStart(void) {
  REQUIRE(!in_group);
  in_group = true;
  group_op = NULL;
  return ncclSuccess;
}
ncclResult_t ncclGroupEnd(void) {
  REQUIRE(in_group);
  in_group = false;
  last_op = NULL;
  if (group_op) publish(group_op); /* the group's sends and receives, complete */
  group_op = NULL;
  return ncclInProgress; /* non-blocking communicators settle later */
}

static ncclResult_t p2p(bool send, const void *buf, size_t n, ncclDataType_t dt, int peer,
                        ncclComm_t nc) {
  REQUIRE(nc && dt == ncclUint8 && fake_is_dev(buf, n));
  REQUIRE(peer >= 0 && peer < nc->cl->nranks);
  p2p_t one = {send, (void *)buf, n, peer};
  if (!in_group) {
    op_t f = {.kind = K_P2P, .np = 1};
    f.p[0] = one;
    post(nc, f);
  } else {
    if (!group_op) {
      group_op = calloc(1, sizeof *group_op);
      REQUIRE(group_op);
      group_op->kind = K_P2P;
      group_op->comm = nc;
    }
    REQUIRE(group_op->comm == nc && group_op->np < 2 * MAX_RANKS);
    group_op->p[group_op->np++] = one;
  }
  fake.p2p_ops++;
  return ncclSuccess;
}
ncclResult_t ncclSend(const void *buf, size_t n, ncclDataType_t dt, int peer, ncclComm_t nc,
                      cudaStream_t s) {
  REQUIRE(s);
  return p2p(true, buf, n, dt, peer, nc);
}
ncclResult_t ncclRecv(void *buf, size_t n, ncclDataType_t dt, int peer, ncclComm_t nc,
                      cudaStream_t s) {
  REQUIRE(s);
  return p2p(false, buf, n, dt, peer, nc);
}

static size_t nccl_size(ncclDataType_t dt) {
  switch (dt) {
  case ncclInt8: case ncclUint8: return 1;
  case ncclFloat16: case ncclBfloat16: return 2;
  case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
  default: return 8;
  }
}

ncclResult_t ncclAllReduce(const void *in, void *out, size_t count, ncclDataType_t dt,
                           ncclRedOp_t op, ncclComm_t nc, cudaStream_t s) {
  REQUIRE(nc && s && fake_is_dev(in, count * nccl_size(dt)) && fake_is_dev(out, count * nccl_size(dt)));
  post(nc, (op_t){.kind = K_ALLREDUCE, .in = in, .out = out, .count = count, .dt = dt, .rop = op});
  fake.native_ops++;
  return ncclSuccess;
}
ncclResult_t ncclReduceScatter(const void *in, void *out, size_t count, ncclDataType_t dt,
                               ncclRedOp_t op, ncclComm_t nc, cudaStream_t s) {
  size_t bytes = count * nccl_size(dt);
  REQUIRE(nc && s && fake_is_dev(in, bytes * (size_t)nc->cl->nranks) && fake_is_dev(out, bytes));
  post(nc, (op_t){.kind = K_REDUCE_SCATTER, .in = in, .out = out, .count = count, .dt = dt, .rop = op});
  fake.native_ops++;
  return ncclSuccess;
}
ncclResult_t ncclAllGather(const void *in, void *out, size_t count, ncclDataType_t dt,
                           ncclComm_t nc, cudaStream_t s) {
  REQUIRE(nc && s && dt == ncclUint8);
  REQUIRE(fake_is_dev(in, count) && fake_is_dev(out, count * (size_t)nc->cl->nranks));
  post(nc, (op_t){.kind = K_ALLGATHER, .in = in, .out = out, .count = count, .dt = dt});
  fake.gather_ops++;
  return ncclSuccess;
}
/* Rooted, as NCCL: recvbuff is only used on the root (reduce), sendbuff only
 * on the root (broadcast); elsewhere it is neither checked nor touched. */
ncclResult_t ncclReduce(const void *in, void *out, size_t count, ncclDataType_t dt, ncclRedOp_t op,
                        int root, ncclComm_t nc, cudaStream_t s) {
  REQUIRE(nc && s && root >= 0 && root < nc->cl->nranks);
  size_t bytes = count * nccl_size(dt);
  REQUIRE(fake_is_dev(in, bytes) && (nc->rank != root || fake_is_dev(out, bytes)));
  post(nc, (op_t){.kind = K_REDUCE, .in = in, .out = out, .count = count, .dt = dt, .rop = op,
                  .root = root});
  fake.reduce_ops++;
  return ncclSuccess;
}
ncclResult_t ncclBroadcast(const void *in, void *out, size_t count, ncclDataType_t dt, int root,
                           ncclComm_t nc, cudaStream_t s) {
  REQUIRE(nc && s && root >= 0 && root < nc->cl->nranks);
  size_t bytes = count * nccl_size(dt);
  REQUIRE(fake_is_dev(out, bytes) && (nc->rank != root || fake_is_dev(in, bytes)));
  post(nc, (op_t){.kind = K_BROADCAST, .in = in, .out = out, .count = count, .dt = dt, .root = root});
  fake.broadcast_ops++;
  return ncclSuccess;
}

/* Native reductions on the types the suite uses. */
static double ld_n(ncclDataType_t dt, const void *p, size_t i) {
  switch (dt) {
  case ncclInt32: return ((const int32_t *)p)[i];
  case ncclInt64: return (double)((const int64_t *)p)[i];
  case ncclFloat32: return ((const float *)p)[i];
  case ncclFloat64: return ((const double *)p)[i];
  default: REQUIRE(!"dtype the fake does not reduce"); return 0;
  }
}
static void st_n(ncclDataType_t dt, void *p, size_t i, double v) {
  switch (dt) {
  case ncclInt32: ((int32_t *)p)[i] = (int32_t)v; break;
  case ncclInt64: ((int64_t *)p)[i] = (int64_t)v; break;
  case ncclFloat32: ((float *)p)[i] = (float)v; break;
  default: ((double *)p)[i] = v; break;
  }
}
static double combine(ncclRedOp_t op, double acc, double v) {
  switch (op) {
  case ncclSum: case ncclAvg: return acc + v;
  case ncclProd: return acc * v;
  case ncclMax: return v > acc ? v : acc;
  case ncclMin: return v < acc ? v : acc;
  default: REQUIRE(!"reduction the fake does not know"); return 0;
  }
}

/* Runs `o` on its clique once every member has posted its op of the same seq.
 * Under nccl_mu. */
static void try_run(op_t *o) {
  clique_t *c = o->comm->cl;
  op_t *all[MAX_RANKS] = {0};
  int n = c->nranks;
  if (fake_op_error) return;
  for (int r = 0; r < n; r++) {
    ncclComm_t m = c->members[r];
    if (!m || m->nops <= o->seq) return;
    all[r] = m->ops[o->seq];
    REQUIRE(all[r]->kind == o->kind); /* members disagree on the op order */
  }
  if (o->kind == K_REDUCE || o->kind == K_BROADCAST) /* members agree on the root and size */
    for (int r = 0; r < n; r++)
      REQUIRE(all[r]->root == all[0]->root && all[r]->count == all[0]->count &&
              all[r]->dt == all[0]->dt && all[r]->rop == all[0]->rop);
  if (o->kind == K_ALLREDUCE || o->kind == K_REDUCE_SCATTER || o->kind == K_REDUCE) {
    size_t cnt = all[0]->count;
    for (int r = 0; r < n; r++) REQUIRE(all[r]->count == cnt && all[r]->dt == all[0]->dt);
    size_t per = o->kind == K_REDUCE_SCATTER ? cnt * (size_t)n : cnt;
    double *acc = calloc(per, sizeof *acc);
    REQUIRE(acc);
    for (size_t i = 0; i < per; i++) {
      acc[i] = ld_n(all[0]->dt, all[0]->in, i);
      for (int r = 1; r < n; r++) acc[i] = combine(all[r]->rop, acc[i], ld_n(all[r]->dt, all[r]->in, i));
      if (all[0]->rop == ncclAvg) acc[i] /= n;
    }
    for (int r = 0; r < n; r++) {
      if (o->kind == K_REDUCE && r != all[0]->root) continue; /* only the root receives */
      for (size_t i = 0; i < cnt; i++)
        st_n(all[r]->dt, all[r]->out, i, acc[o->kind == K_REDUCE_SCATTER ? (size_t)r * cnt + i : i]);
    }
    free(acc);
  } else if (o->kind == K_BROADCAST) {
    op_t *src = all[all[0]->root];
    size_t bytes = src->count * nccl_size(src->dt);
    for (int r = 0; r < n; r++) memmove(all[r]->out, src->in, bytes);
  } else if (o->kind == K_ALLGATHER) {
    for (int r = 0; r < n; r++)
      for (int k = 0; k < n; k++) {
        REQUIRE(all[k]->count == all[r]->count);
        memcpy((char *)all[r]->out + (size_t)k * all[k]->count, all[k]->in, all[k]->count);
      }
  } else {
    int sends = 0, recvs = 0;
    for (int r = 0; r < n; r++)
      for (int i = 0; i < all[r]->np; i++) {
        p2p_t *rv = &all[r]->p[i];
        sends += rv->send;
        if (rv->send) continue;
        recvs++;
        fake.p2p_bytes_in[r] += (int)rv->bytes;
        op_t *so = all[rv->peer];
        int found = 0;
        for (int j = 0; j < so->np; j++)
          if (so->p[j].send && so->p[j].peer == r) {
            REQUIRE(so->p[j].bytes == rv->bytes);
            memcpy(rv->buf, so->p[j].buf, rv->bytes);
            found++;
          }
        REQUIRE(found == 1);
      }
    REQUIRE(sends == recvs); /* a send nobody receives would hang NCCL */
  }
  for (int r = 0; r < n; r++) all[r]->done = true;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  REQUIRE(e);
  e->op = last_op;
  last_op = NULL;
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t e) {
  REQUIRE(e);
  if (!e->op) return cudaSuccess;
  pthread_mutex_lock(&nccl_mu);
  if (!e->op->done) try_run(e->op);
  bool d = e->op->done;
  pthread_mutex_unlock(&nccl_mu);
  return d ? cudaSuccess : cudaErrorNotReady;
}
