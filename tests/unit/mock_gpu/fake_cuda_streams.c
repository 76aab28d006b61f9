/* The CUDA runtime as a stream simulator, and link stubs for what the cuda
 * backend calls but this suite does not run (fake_cuda_streams.h).
 *
 * One mutex and one condition variable guard every stream, event, gate and the
 * clock: the fake favours being obviously right over being fast. Workers run
 * an operation with the mutex released (a test's kernel may take its own
 * locks), and remove it from their queue only once it ran, so a stream with
 * an operation in progress is not drained. */
#include <pthread.h>
#include <string.h>

#include "cuda_blas.h"
#include "cuda_internal.h"
#include "cuda_nccl.h"
#include "fake_cuda_streams.h"

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static uint64_t ticks;

_Atomic int fake_query_error;
_Atomic int fake_event_error;

/* ------------------------------------------------------------------ the model */

/* One cudaEventRecord: the point in its stream's queue. Shared by the event
 * (its latest record), the queued record op and the waits on it; freed by the
 * last of them, so an event destroyed while pending stays valid for those. */
typedef struct mark {
  int refs;
  bool done;
} mark_t;

struct fake_gate {
  bool open;
  uint64_t opened_at;
};

typedef enum { OP_COPY, OP_SET, OP_MARK, OP_WAIT, OP_GATE, OP_CALL, OP_FREE, OP_ALLOC } op_kind_t;

typedef struct op {
  struct op *next;
  op_kind_t kind;
  void *dst;           /* COPY, SET, FREE, ALLOC */
  const void *src;     /* COPY */
  size_t n;            /* COPY, SET */
  int value;           /* SET */
  bool dst_dev, src_dev; /* which sides must be device memory when it runs */
  mark_t *mark;        /* MARK, WAIT: a reference */
  fake_gate_t *gate;   /* GATE */
  void (*fn)(void *);  /* CALL */
  void *arg;
} op_t;

struct CUstream_st {
  op_t *head, *tail; /* under mu; head is the op running or next to run */
  bool closing;      /* destroyed: the worker exits once drained */
  pthread_t worker;
  struct CUstream_st *next; /* the live streams, under mu */
};

struct CUevent_st {
  mark_t *last; /* the latest record; NULL: never recorded, complete */
};

/* The default pool: its address is all the backend sees. */
struct CUmemPoolHandle_st {
  int unused;
};
static struct CUmemPoolHandle_st pool;

static struct CUstream_st *streams;
static int streams_live, events_live;

#define MAX_GATES 32
static fake_gate_t gates[MAX_GATES];
static int ngates;

/* Which stream-ordered frees ran, and when (fake_freed_at). */
#define MAX_FREES 4096
static struct {
  const void *p;
  uint64_t at;
} frees[MAX_FREES];
static int nfrees;

/* Stream-ordered allocations whose allocating op has not run yet: their
 * memory exists (the pointer is returned at once, as CUDA does) but no
 * operation may touch it before the op ran, so a use on another stream that
 * is not ordered after the allocation aborts when the allocating stream is
 * held. Under mu. */
#define MAX_PENDING 256
static struct {
  const char *p; /* NULL: a free slot */
  size_t n;
} pending[MAX_PENDING];

/* Whether [p, p + n) overlaps an allocation whose op has not run. */
static bool pending_locked(const void *p, size_t n) {
  const char *c = p;
  for (int i = 0; i < MAX_PENDING; i++)
    if (pending[i].p && c < pending[i].p + pending[i].n && c + (n ? n : 1) > pending[i].p)
      return true;
  return false;
}

static void pending_add_locked(const void *p, size_t n) {
  int i = 0;
  while (i < MAX_PENDING && pending[i].p) i++;
  REQUIRE(i < MAX_PENDING);
  pending[i].p = p;
  pending[i].n = n ? n : 1;
}

static void pending_remove_locked(const void *p) {
  for (int i = 0; i < MAX_PENDING; i++)
    if (pending[i].p == p) pending[i].p = NULL;
}

/* Device memory an operation may touch now: live, and its allocation ran. */
static bool usable(const void *p, size_t n) {
  pthread_mutex_lock(&mu);
  bool pend = pending_locked(p, n);
  pthread_mutex_unlock(&mu);
  return !pend && fake_is_dev(p, n);
}

bool fake_dev_ready(const void *p, size_t bytes) { return usable(p, bytes); }

static void mark_drop_locked(mark_t *m) {
  if (m && --m->refs == 0) free(m);
}

static bool runnable_locked(const op_t *op) {
  switch (op->kind) {
  case OP_WAIT: return op->mark->done;
  case OP_GATE: return op->gate->open;
  default: return true;
  }
}

/* Runs op on the worker, without mu. Device sides are checked again here: a
 * free that ran before this op (an ordering bug) leaves them unregistered. */
static void run(op_t *op) {
  if (op->dst_dev) REQUIRE(usable(op->dst, op->n));
  if (op->src_dev) REQUIRE(usable(op->src, op->n));
  switch (op->kind) {
  case OP_COPY: memmove(op->dst, op->src, op->n); break;
  case OP_SET: memset(op->dst, op->value, op->n); break;
  case OP_CALL: op->fn(op->arg); break;
  case OP_FREE:
    REQUIRE(usable(op->dst, 1)); /* freed before its allocation ran: an ordering bug */
    fake_dev_free(op->dst);
    break;
  default: break; /* MARK, WAIT, GATE, ALLOC act on the fake's state, under mu */
  }
}

static void *worker(void *arg) {
  struct CUstream_st *s = arg;
  pthread_mutex_lock(&mu);
  for (;;) {
    while (!(s->head && runnable_locked(s->head)) && !(s->closing && !s->head))
      pthread_cond_wait(&cv, &mu);
    if (!s->head) break;
    op_t *op = s->head;
    pthread_mutex_unlock(&mu);
    run(op);
    pthread_mutex_lock(&mu);
    ticks++;
    if (op->kind == OP_MARK) op->mark->done = true;
    if (op->kind == OP_ALLOC) pending_remove_locked(op->dst);
    if (op->kind == OP_FREE) {
      REQUIRE(nfrees < MAX_FREES);
      frees[nfrees].p = op->dst;
      frees[nfrees++].at = ticks;
    }
    mark_drop_locked(op->mark);
    if (!(s->head = op->next)) s->tail = NULL;
    free(op);
    pthread_cond_broadcast(&cv);
  }
  pthread_mutex_unlock(&mu);
  return NULL;
}

static void enqueue_locked(cudaStream_t s, op_t *op) {
  REQUIRE(s); /* the backend never uses the legacy NULL stream */
  REQUIRE(!s->closing);
  if (s->tail) s->tail->next = op;
  else s->head = op;
  s->tail = op;
  pthread_cond_broadcast(&cv);
}

static void enqueue(cudaStream_t s, op_t o) {
  op_t *op = malloc(sizeof *op);
  REQUIRE(op);
  *op = o;
  op->next = NULL;
  pthread_mutex_lock(&mu);
  enqueue_locked(s, op);
  pthread_mutex_unlock(&mu);
}

/* A fresh record at the end of s's queue, with one reference for the caller. */
static mark_t *mark_queue_locked(cudaStream_t s) {
  mark_t *m = calloc(1, sizeof *m);
  op_t *op = calloc(1, sizeof *op);
  REQUIRE(m && op);
  m->refs = 2; /* the caller's and the op's */
  *op = (op_t){.kind = OP_MARK, .mark = m};
  enqueue_locked(s, op);
  return m;
}

/* Waits for m and drops the caller's reference. */
static void mark_wait_locked(mark_t *m) {
  while (!m->done) pthread_cond_wait(&cv, &mu);
  mark_drop_locked(m);
}

/* ------------------------------------------------------------------ test API */

uint64_t fake_now(void) {
  pthread_mutex_lock(&mu);
  uint64_t t = ticks;
  pthread_mutex_unlock(&mu);
  return t;
}

fake_gate_t *fake_gate_new(void) {
  pthread_mutex_lock(&mu);
  REQUIRE(ngates < MAX_GATES);
  fake_gate_t *g = &gates[ngates++];
  pthread_mutex_unlock(&mu);
  return g;
}

void fake_gate_queue(cudaStream_t s, fake_gate_t *g) {
  enqueue(s, (op_t){.kind = OP_GATE, .gate = g});
}

uint64_t fake_gate_open(fake_gate_t *g) {
  pthread_mutex_lock(&mu);
  if (!g->open) {
    g->open = true;
    g->opened_at = ++ticks;
    pthread_cond_broadcast(&cv);
  }
  uint64_t at = g->opened_at;
  pthread_mutex_unlock(&mu);
  return at;
}

void fake_gate_open_all(void) {
  for (int i = 0; i < MAX_GATES; i++) fake_gate_open(&gates[i]);
}

void fake_stream_call(cudaStream_t s, void (*fn)(void *), void *arg) {
  enqueue(s, (op_t){.kind = OP_CALL, .fn = fn, .arg = arg});
}

uint64_t fake_freed_at(const void *p) {
  uint64_t at = 0;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < nfrees; i++)
    if (frees[i].p == p) at = frees[i].at;
  pthread_mutex_unlock(&mu);
  return at;
}

int fake_streams_live(void) {
  pthread_mutex_lock(&mu);
  int n = streams_live;
  pthread_mutex_unlock(&mu);
  return n;
}

int fake_events_live(void) {
  pthread_mutex_lock(&mu);
  int n = events_live;
  pthread_mutex_unlock(&mu);
  return n;
}

/* ------------------------------------------------------------------ device */

cudaError_t cudaGetDeviceCount(int *count) {
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  REQUIRE(device == 0);
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device) {
  REQUIRE(device == 0);
  memset(prop, 0, sizeof *prop);
  snprintf(prop->name, sizeof prop->name, "Fake Streams GPU");
  prop->major = 9;
  prop->minor = 0;
  prop->totalGlobalMem = FAKE_DEVICE_BYTES;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *p, int device) {
  REQUIRE(device == 0);
  *p = &pool;
  return cudaSuccess;
}

cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t p, enum cudaMemPoolAttr attr, void *value) {
  REQUIRE(p == &pool && attr == cudaMemPoolAttrReleaseThreshold && value);
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b) {
  *free_b = *total_b = FAKE_DEVICE_BYTES;
  return cudaSuccess;
}

/* Every stream drained of what was queued before the call. */
cudaError_t cudaDeviceSynchronize(void) {
  pthread_mutex_lock(&mu);
  mark_t *marks[64];
  int n = 0;
  for (struct CUstream_st *s = streams; s; s = s->next) {
    if (s->closing) continue; /* its destroy drains it */
    REQUIRE(n < 64);
    marks[n++] = mark_queue_locked(s);
  }
  for (int i = 0; i < n; i++) mark_wait_locked(marks[i]);
  pthread_mutex_unlock(&mu);
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) { return cudaSuccess; }

const char *cudaGetErrorName(cudaError_t rc) {
  switch (rc) {
  case cudaSuccess: return "cudaSuccess";
  case cudaErrorNotReady: return "cudaErrorNotReady";
  case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
  case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
  default: return "cudaErrorFake";
  }
}

const char *cudaGetErrorString(cudaError_t rc) {
  switch (rc) {
  case cudaSuccess: return "no error";
  case cudaErrorNotReady: return "device not ready";
  case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
  case cudaErrorMemoryAllocation: return "out of memory";
  default: return "a fake CUDA error";
  }
}

/* ------------------------------------------------------------------ streams */

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *out, unsigned int flags) {
  REQUIRE(flags == cudaStreamNonBlocking);
  struct CUstream_st *s = calloc(1, sizeof *s);
  REQUIRE(s);
  REQUIRE(pthread_create(&s->worker, NULL, worker, s) == 0);
  pthread_mutex_lock(&mu);
  s->next = streams;
  streams = s;
  streams_live++;
  pthread_mutex_unlock(&mu);
  *out = s;
  return cudaSuccess;
}

/* CUDA lets queued work finish after the destroy returns; the fake waits for
 * it instead (a closed gate left on the stream holds the caller). */
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  REQUIRE(s);
  pthread_mutex_lock(&mu);
  s->closing = true;
  pthread_cond_broadcast(&cv);
  pthread_mutex_unlock(&mu);
  pthread_join(s->worker, NULL);
  pthread_mutex_lock(&mu);
  struct CUstream_st **p = &streams;
  while (*p != s) p = &(*p)->next;
  *p = s->next;
  streams_live--;
  pthread_mutex_unlock(&mu);
  free(s);
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  REQUIRE(s);
  pthread_mutex_lock(&mu);
  mark_wait_locked(mark_queue_locked(s));
  pthread_mutex_unlock(&mu);
  return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t s) {
  REQUIRE(s);
  if (fake_query_error) return (cudaError_t)fake_query_error;
  pthread_mutex_lock(&mu);
  bool drained = !s->head;
  pthread_mutex_unlock(&mu);
  return drained ? cudaSuccess : cudaErrorNotReady;
}

/* ------------------------------------------------------------------ events */

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *out, unsigned int flags) {
  REQUIRE(flags == cudaEventDisableTiming);
  if (fake_event_error) return (cudaError_t)fake_event_error;
  struct CUevent_st *e = calloc(1, sizeof *e);
  REQUIRE(e);
  pthread_mutex_lock(&mu);
  events_live++;
  pthread_mutex_unlock(&mu);
  *out = e;
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  REQUIRE(e);
  pthread_mutex_lock(&mu);
  mark_drop_locked(e->last); /* a pending record completes without it */
  events_live--;
  pthread_mutex_unlock(&mu);
  free(e);
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  REQUIRE(e && s);
  pthread_mutex_lock(&mu);
  mark_drop_locked(e->last);
  e->last = mark_queue_locked(s); /* the caller's reference is the event's */
  pthread_mutex_unlock(&mu);
  return cudaSuccess;
}

/* The event's latest record at the time of the call: a later record does not
 * move the wait. */
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int flags) {
  REQUIRE(s && e && flags == 0);
  pthread_mutex_lock(&mu);
  if (e->last) {
    op_t *op = calloc(1, sizeof *op);
    REQUIRE(op);
    *op = (op_t){.kind = OP_WAIT, .mark = e->last};
    e->last->refs++;
    enqueue_locked(s, op);
  }
  pthread_mutex_unlock(&mu);
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  REQUIRE(e);
  pthread_mutex_lock(&mu);
  if (e->last) {
    e->last->refs++;
    mark_wait_locked(e->last);
  }
  pthread_mutex_unlock(&mu);
  return cudaSuccess;
}

/* ------------------------------------------------------------------ memory */

cudaError_t cudaMallocFromPoolAsync(void **p, size_t bytes, cudaMemPool_t mp, cudaStream_t s) {
  REQUIRE(mp == &pool && s);
  *p = fake_dev_alloc(bytes);
  op_t *op = calloc(1, sizeof *op);
  REQUIRE(op);
  *op = (op_t){.kind = OP_ALLOC, .dst = *p};
  pthread_mutex_lock(&mu);
  pending_add_locked(*p, bytes);
  enqueue_locked(s, op);
  pthread_mutex_unlock(&mu);
  return cudaSuccess;
}

cudaError_t cudaFreeAsync(void *p, cudaStream_t s) {
  REQUIRE(fake_is_dev(p, 1));
  enqueue(s, (op_t){.kind = OP_FREE, .dst = p});
  return cudaSuccess;
}

/* Both sides are host memory to the fake; the kind says which must be
 * registered as device memory. */
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind,
                            cudaStream_t s) {
  REQUIRE(kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToHost ||
          kind == cudaMemcpyDeviceToDevice);
  op_t o = {.kind = OP_COPY, .dst = dst, .src = src, .n = n,
            .dst_dev = kind != cudaMemcpyDeviceToHost, .src_dev = kind != cudaMemcpyHostToDevice};
  if (o.dst_dev) REQUIRE(fake_is_dev(dst, n));
  if (o.src_dev) REQUIRE(fake_is_dev(src, n));
  enqueue(s, o);
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *dst, int value, size_t n, cudaStream_t s) {
  REQUIRE(fake_is_dev(dst, n));
  enqueue(s, (op_t){.kind = OP_SET, .dst = dst, .value = value, .n = n, .dst_dev = true});
  return cudaSuccess;
}

/* ------------------------------------------------------------------ link stubs */

/* The kernels (kernels_*.cu), cuBLAS and NCCL are other suites' business: a
 * call to one here is a test that strayed. */
#define STUB_KERNEL(name, kernel, ops, a, b)                          \
  int cuda_kernel_##kernel(const kernel_call_t *c, meshd_error_t *e) { \
    (void)c;                                                          \
    (void)e;                                                          \
    REQUIRE(!"cuda_kernel_" #kernel " is not faked");                 \
    return -1;                                                        \
  }
KERNEL_FAMILY_MAP(STUB_KERNEL, _, _)

kernel_family_t kernel_family_of(const op_def_t *op) {
  (void)op;
  REQUIRE(!"run_op is not faked");
  return KF_NONE;
}

/* A same-dtype, same-shape copy between any strides, in element order. */
typedef struct {
  char *dst;
  const char *src;
  layout_t dl, sl;
  size_t esz;
} strided_t;

static void strided_copy(void *arg) {
  strided_t *c = arg;
  int64_t idx[LAYOUT_MAX_DIMS] = {0};
  int64_t n = layout_numel(&c->dl);
  for (int64_t k = 0; k < n; k++) {
    int64_t d = c->dl.offset, s = c->sl.offset;
    for (int i = 0; i < c->dl.ndim; i++) {
      d += idx[i] * c->dl.strides[i];
      s += idx[i] * c->sl.strides[i];
    }
    /* Each element is checked as it is touched: a free that ran early shows. */
    REQUIRE(usable(c->dst + d * (int64_t)c->esz, c->esz));
    REQUIRE(usable(c->src + s * (int64_t)c->esz, c->esz));
    memcpy(c->dst + d * (int64_t)c->esz, c->src + s * (int64_t)c->esz, c->esz);
    for (int i = c->dl.ndim - 1; i >= 0 && ++idx[i] == c->dl.sizes[i]; i--) idx[i] = 0;
  }
  free(c);
}

/* The gather / scatter of non-contiguous host transfers: no casts, no
 * broadcasting. */
int cuda_copy_broadcast(backend_t *b, backend_stream_t *bs, agent_tensor_t *dst,
                        const agent_tensor_t *src, meshd_error_t *e) {
  (void)b;
  (void)e;
  REQUIRE(bs && dst->meta.dtype == src->meta.dtype);
  REQUIRE(layout_same_shape(&dst->meta.layout, &src->meta.layout));
  strided_t *c = malloc(sizeof *c);
  REQUIRE(c);
  *c = (strided_t){.dst = dst->storage->data, .src = src->storage->data,
                   .dl = dst->meta.layout, .sl = src->meta.layout,
                   .esz = dtype_size(dst->meta.dtype)};
  fake_stream_call(bs->s, strided_copy, c);
  return 0;
}

/* No matmul runs, so no stream has a cuBLAS handle to release. */
void cuda_blas_release(backend_t *b, backend_stream_t *bs) {
  (void)b;
  REQUIRE(!bs->blas && !bs->blas_ws);
}

void cuda_blas_close(backend_t *b) { REQUIRE(cuda_state(b)->blas_nidle == 0); }

struct cuda_comms {
  int unused;
};
static cuda_comms_t comms;

cuda_comms_t *cuda_comms_create(void) { return &comms; }
void cuda_comms_destroy(cuda_comms_t *c) { REQUIRE(c == &comms); }

#define NOT_FAKED(e, slot) error_set(e, ERR_REMOTE_FAILURE, "%s: not faked", slot)

int cuda_allreduce(backend_t *b, backend_stream_t *s, const dp_group_t *g, void *buf, size_t count,
                   dtype_t dtype, reduction_t op, meshd_error_t *err) {
  (void)b, (void)s, (void)g, (void)buf, (void)count, (void)dtype, (void)op;
  return NOT_FAKED(err, "allreduce");
}
int cuda_reduce_scatter(backend_t *b, backend_stream_t *s, const dp_group_t *g, const void *in,
                        void *out, size_t count, dtype_t dtype, reduction_t op, meshd_error_t *err) {
  (void)b, (void)s, (void)g, (void)in, (void)out, (void)count, (void)dtype, (void)op;
  return NOT_FAKED(err, "reduce_scatter");
}
int cuda_allgather(backend_t *b, backend_stream_t *s, const dp_group_t *g, const void *in, void *out,
                   size_t count, dtype_t dtype, meshd_error_t *err) {
  (void)b, (void)s, (void)g, (void)in, (void)out, (void)count, (void)dtype;
  return NOT_FAKED(err, "allgather");
}
int cuda_alltoall(backend_t *b, backend_stream_t *s, const dp_group_t *g, const void *in, void *out,
                  size_t count, dtype_t dtype, meshd_error_t *err) {
  (void)b, (void)s, (void)g, (void)in, (void)out, (void)count, (void)dtype;
  return NOT_FAKED(err, "alltoall");
}
int cuda_reduce_root(backend_t *b, backend_stream_t *s, const dp_group_t *g, size_t root,
                     void *buf, size_t count, dtype_t dtype, reduction_t op, meshd_error_t *err) {
  (void)b, (void)s, (void)g, (void)root, (void)buf, (void)count, (void)dtype, (void)op;
  return NOT_FAKED(err, "reduce_root");
}
int cuda_gather_root(backend_t *b, backend_stream_t *s, const dp_group_t *g, size_t root,
                     const void *in, void *out, size_t count, dtype_t dtype, meshd_error_t *err) {
  (void)b, (void)s, (void)g, (void)root, (void)in, (void)out, (void)count, (void)dtype;
  return NOT_FAKED(err, "gather_root");
}
int cuda_broadcast(backend_t *b, backend_stream_t *s, const dp_group_t *g, void *buf, size_t bytes,
                   meshd_error_t *err) {
  (void)b, (void)s, (void)g, (void)buf, (void)bytes;
  return NOT_FAKED(err, "broadcast");
}
int cuda_send(backend_t *b, backend_stream_t *s, uint64_t session, uint64_t comm_id, uint64_t call,
              const uint8_t *secret, uint32_t to_rank, const char *addr, const void *buf,
              size_t bytes, meshd_error_t *err) {
  (void)b, (void)s, (void)session, (void)comm_id, (void)call, (void)secret, (void)to_rank;
  (void)addr, (void)buf, (void)bytes;
  return NOT_FAKED(err, "send");
}
int cuda_recv(backend_t *b, backend_stream_t *s, uint64_t session, uint64_t comm_id, uint64_t call,
              const uint8_t *secret, uint32_t from_rank, const char *addr, void *buf, size_t bytes,
              meshd_error_t *err) {
  (void)b, (void)s, (void)session, (void)comm_id, (void)call, (void)secret, (void)from_rank;
  (void)addr, (void)buf, (void)bytes;
  return NOT_FAKED(err, "recv");
}
void cuda_refuse(backend_t *b, const dp_group_t *g, dp_refuse_t what, uint64_t calls,
                 const char *why) {
  (void)b, (void)g, (void)what, (void)calls, (void)why;
  REQUIRE(!"refuse is not faked");
}
void cuda_session_end(backend_t *b, uint64_t session) {
  (void)b, (void)session;
  REQUIRE(!"session_end is not faked");
}
void cuda_peer_lost(backend_t *b, uint64_t session, uint32_t rank) {
  (void)b, (void)session, (void)rank;
  REQUIRE(!"peer_lost is not faked");
}
