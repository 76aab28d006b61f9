/* The cuda backend's vtable: device memory from the device's stream-ordered
 * pool, one CUDA stream per meshd stream, events for borrows, kernels in
 * kernels_*.cu, matmul on cuBLAS (cuda_blas.c), communicators on NCCL
 * (cuda_nccl.c). It calls down into those and into the device helpers they
 * share (cuda_device.c); none of them calls back into this file.
 *
 * Ordering rules (backend.h):
 * - a stream's kernels, copies and scratch memory are queued on its CUDA
 *   stream; a NULL stream means the backend's own stream, used synchronously;
 * - memory is allocated in the order of the stream that uses it first, and
 *   released on the backend's release stream after waiting (events) for
 *   every live stream: whoever drops the last reference, every use was
 *   queued before, so the release follows it on the device. Nothing else runs
 *   on the release stream, so nothing else waits for every stream (but the
 *   pool may make an allocation wait for the free whose memory it reuses);
 * - to_host / from_host copy on the stream they are given (the own stream
 *   for NULL) and wait for that copy only: one session's Fetch, flag or
 *   scalar does not wait for another session's kernels, nor for what its own
 *   stream queued after it (a snapshot's copies run on a stream of their own
 *   that waits for the snapshot's point: agent/snapshot.c).
 *
 * "cuda:emulated" runs the same code over host memory with kernels in host
 * loops and no CUDA calls at all (cuda_internal.h). */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_blas.h"
#include "cuda_internal.h"
#include "cuda_nccl.h"
#include "kernel_family.h"

/* ------------------------------------------------------------------ open / close */

static int parse_device(const char *device, bool *emulated, int *ordinal) {
  if (!device || strncmp(device, "cuda:", 5) != 0) return -1;
  const char *n = device + 5;
  if (!strcmp(n, "emulated")) {
    *emulated = true;
    *ordinal = -1;
    return 0;
  }
  char *end;
  errno = 0;
  long v = strtol(n, &end, 10);
  if (!*n || *end || errno || v < 0 || v > 1023) return -1;
  *emulated = false;
  *ordinal = (int)v;
  return 0;
}

static void state_free(cuda_state_t *st) {
  if (!st) return;
  if (st->own.s) cudaStreamDestroy(st->own.s);
  if (st->release.s) cudaStreamDestroy(st->release.s);
  pthread_mutex_destroy(&st->mu);
  free(st);
}

static int cuda_open(backend_t *b, const char *device, meshd_error_t *err) {
  bool emulated;
  int ordinal;
  if (parse_device(device, &emulated, &ordinal) != 0)
    return error_set(err, ERR_BAD_ARGUMENT,
                     "cuda backend: device '%s' is not 'cuda:N' or 'cuda:emulated'",
                     device ? device : "(null)");
  cuda_state_t *st = calloc(1, sizeof *st);
  if (!st) return error_set(err, ERR_UNAVAILABLE, "cuda backend: out of memory");
  pthread_mutex_init(&st->mu, NULL);
  st->emulated = emulated;
  st->device = ordinal;
  st->comm_timeout_ms = 30000;
  const char *t = getenv("MESHD_COMM_TIMEOUT_MS");
  if (b->comm_timeout_ms > 0) st->comm_timeout_ms = b->comm_timeout_ms; /* the agent's flag */
  else if (t && atoi(t) > 0) st->comm_timeout_ms = atoi(t);
  if (emulated) {
    snprintf(st->name, sizeof st->name, "cuda:emulated (kernels on the host)");
  } else {
    int count = 0;
    cudaError_t rc = cudaGetDeviceCount(&count);
    if (rc != cudaSuccess || ordinal >= count) {
      error_set(err, ERR_UNAVAILABLE, "cuda backend: no device %s: %s%s", device,
                rc != cudaSuccess ? cudaGetErrorString(rc) : "",
                rc == cudaErrorNoDevice || rc == cudaErrorInsufficientDriver
                    ? " (no NVIDIA GPU or driver here: serve --device cpu)"
                    : "");
      if (rc == cudaSuccess)
        snprintf(err->msg, sizeof err->msg, "cuda backend: no device %s: this machine has %d CUDA "
                 "device%s", device, count, count == 1 ? "" : "s");
      state_free(st);
      return -1;
    }
    struct cudaDeviceProp prop;
    size_t free_b = 0, total_b = 0;
    uint64_t keep = UINT64_MAX;
    if ((rc = cudaSetDevice(ordinal)) != cudaSuccess ||
        (rc = cudaGetDeviceProperties(&prop, ordinal)) != cudaSuccess ||
        (rc = cudaDeviceGetDefaultMemPool(&st->pool, ordinal)) != cudaSuccess ||
        (rc = cudaMemPoolSetAttribute(st->pool, cudaMemPoolAttrReleaseThreshold, &keep)) !=
            cudaSuccess ||
        (rc = cudaStreamCreateWithFlags(&st->own.s, cudaStreamNonBlocking)) != cudaSuccess ||
        (rc = cudaStreamCreateWithFlags(&st->release.s, cudaStreamNonBlocking)) != cudaSuccess ||
        (rc = cudaMemGetInfo(&free_b, &total_b)) != cudaSuccess) {
      error_set(err, ERR_UNAVAILABLE, "cuda backend: cannot open %s: %s", device,
                cudaGetErrorString(rc));
      state_free(st);
      return -1;
    }
    st->cc_major = prop.major;
    st->cc_minor = prop.minor;
    snprintf(st->name, sizeof st->name, "%.40s (%s, sm_%d%d)", prop.name, device, prop.major,
             prop.minor);
    /* The pool keeps what it freed (release threshold: no limit) so steady
     * workloads do not go back to the driver; the capacity is the device's
     * memory unless --memory-bytes asks for less. */
    if (!b->capacity || b->capacity > total_b) b->capacity = total_b;
  }
  if (!(st->comms = cuda_comms_create())) {
    state_free(st);
    return error_set(err, ERR_UNAVAILABLE, "cuda backend: out of memory");
  }
  b->impl = st;
  return 0;
}

static void cuda_close(backend_t *b) {
  cuda_state_t *st = cuda_state(b);
  if (!st) return;
  cuda_bind(st);
  cuda_comms_destroy(st->comms);
  if (!st->emulated) {
    cudaStreamSynchronize(st->own.s);
    cudaStreamSynchronize(st->release.s);
    cuda_blas_release(b, &st->own);
    cuda_blas_close(b);
  }
  state_free(st); /* destroys own and release */
  b->impl = NULL;
}

/* ------------------------------------------------------------------ ordering */

/* Makes stream `t` wait for everything queued so far on stream `s`. */
static cudaError_t stream_waits(cudaStream_t t, cudaStream_t s) {
  cudaEvent_t ev;
  cudaError_t r = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  if (r != cudaSuccess) return r;
  r = cudaEventRecord(ev, s);
  if (r == cudaSuccess) r = cudaStreamWaitEvent(t, ev, 0);
  cudaEventDestroy(ev); /* released once it completes */
  return r;
}

/* Makes the release stream wait for everything queued so far on every live
 * stream and the own one. Holds nothing on return. The first error is
 * checked after st->mu is let go: a sticky one marks the device lost, which
 * takes st->mu (it deadlocked on itself here, and every later free, stream
 * and health check with it). */
static int release_waits_for_all(cuda_state_t *st, meshd_error_t *e) {
  if (st->emulated) return 0;
  pthread_mutex_lock(&st->mu);
  cudaError_t first = stream_waits(st->release.s, st->own.s), r;
  for (backend_stream_t *s = st->streams; s; s = s->next) /* every one, even after a failure */
    if ((r = stream_waits(st->release.s, s->s)) != cudaSuccess && first == cudaSuccess) first = r;
  pthread_mutex_unlock(&st->mu);
  return cuda_check(st, first, "ordering streams", e);
}

/* Waits until what bs queued so far ran, and not for what other threads
 * queue on it meanwhile (the own stream is shared): an event after it. No
 * event to be had (out of resources), the whole stream: a caller takes a
 * return as "done", whatever it says (a borrow's fallback, the watermark). */
static int wait_queued(cuda_state_t *st, backend_stream_t *bs, meshd_error_t *e) {
  if (st->emulated) return 0;
  cudaEvent_t ev;
  cudaError_t r = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  if (r == cudaSuccess) {
    r = cudaEventRecord(ev, bs->s);
    if (r == cudaSuccess) r = cudaEventSynchronize(ev);
    cudaEventDestroy(ev);
    return cuda_check(st, r, "synchronize", e);
  }
  return cuda_check(st, cudaStreamSynchronize(bs->s), "synchronize", e);
}

static int sync_own(cuda_state_t *st, meshd_error_t *e) { return wait_queued(st, &st->own, e); }

/* ------------------------------------------------------------------ memory */

/* The memory behind alloc and free is the kernels' scratch (cuda_device.c),
 * with the ordering rules above on top. */
static void *cuda_alloc(backend_t *b, backend_stream_t *s, size_t bytes) {
  cuda_state_t *st = cuda_state(b);
  void *p = cuda_scratch_alloc(b, cuda_stream_of(b, s), bytes);
  meshd_error_t e;
  if (p && !s && sync_own(st, &e) != 0) {
    cuda_scratch_free(b, &st->own, p, bytes);
    p = NULL;
  }
  return p;
}

static void cuda_free(backend_t *b, void *ptr, size_t bytes) {
  if (!ptr) return;
  cuda_state_t *st = cuda_state(b);
  if (!st->emulated) {
    meshd_error_t e;
    cuda_bind(st);
    /* Unordered, the pool could hand the memory out while a kernel still uses
     * it: wait for the whole device instead (a failure there is sticky, the
     * device lost, and the memory no one's). */
    if (release_waits_for_all(st, &e) != 0) (void)cudaDeviceSynchronize();
  }
  cuda_scratch_free(b, &st->release, ptr, bytes);
}

/* ------------------------------------------------------------------ streams, events */

static backend_stream_t *cuda_stream_create(backend_t *b) {
  cuda_state_t *st = cuda_state(b);
  backend_stream_t *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  if (!st->emulated) {
    cuda_bind(st);
    if (cudaStreamCreateWithFlags(&s->s, cudaStreamNonBlocking) != cudaSuccess) {
      free(s);
      return NULL;
    }
  }
  pthread_mutex_lock(&st->mu);
  s->next = st->streams;
  if (st->streams) st->streams->prev = s;
  st->streams = s;
  pthread_mutex_unlock(&st->mu);
  return s;
}

static void cuda_stream_destroy(backend_t *b, backend_stream_t *s) {
  if (!s) return;
  cuda_state_t *st = cuda_state(b);
  if (!st->emulated) {
    cuda_bind(st);
    cudaStreamSynchronize(s->s);
    cuda_blas_release(b, s);
  }
  pthread_mutex_lock(&st->mu);
  if (s->prev) s->prev->next = s->next;
  else st->streams = s->next;
  if (s->next) s->next->prev = s->prev;
  pthread_mutex_unlock(&st->mu);
  if (!st->emulated) cudaStreamDestroy(s->s);
  free(s);
}

static int cuda_stream_sync(backend_t *b, backend_stream_t *s, meshd_error_t *err) {
  cuda_state_t *st = cuda_state(b);
  if (st->emulated) return 0;
  cuda_bind(st);
  return wait_queued(st, cuda_stream_of(b, s), err);
}

/* A file whose existence makes "cuda:emulated" report its device lost: the
 * tests' stand-in for a GPU falling off the bus. */
#define EMULATED_LOSS_ENV "MESHD_EMULATED_DEVICE_LOSS_FILE"

static int cuda_health(backend_t *b, meshd_error_t *err) {
  cuda_state_t *st = cuda_state(b);
  if (st->emulated) {
    const char *f = getenv(EMULATED_LOSS_ENV);
    if (f && *f && access(f, F_OK) == 0)
      return error_set(err, ERR_UNAVAILABLE, "cuda:emulated: device lost (%s exists)", f);
    return 0;
  }
  cuda_bind(st);
  size_t free_b, total_b;
  cudaError_t rc = cudaMemGetInfo(&free_b, &total_b);
  if (rc != cudaSuccess) cuda_check(st, rc, "device check", err);
  rc = cudaStreamQuery(st->own.s);
  if (rc != cudaSuccess && rc != cudaErrorNotReady) cuda_check(st, rc, "device check", err);
  pthread_mutex_lock(&st->mu);
  bool lost = st->lost;
  if (lost) error_set(err, ERR_UNAVAILABLE, "%s: device lost: %s", st->name, st->lost_why);
  pthread_mutex_unlock(&st->mu);
  return lost ? -1 : 0;
}

/* Events: a cudaEvent_t behind the opaque pointer; emulated streams are host
 * threads already ordered by the executor, so a placeholder. */
static char emulated_event;

static backend_event_t *cuda_event_record(backend_t *b, backend_stream_t *s) {
  cuda_state_t *st = cuda_state(b);
  if (st->emulated) return (backend_event_t *)&emulated_event;
  cuda_bind(st);
  cudaEvent_t ev;
  if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) return NULL;
  if (cudaEventRecord(ev, cuda_stream_of(b, s)->s) != cudaSuccess) {
    cudaEventDestroy(ev);
    return NULL;
  }
  return (backend_event_t *)ev;
}

static int cuda_event_wait(backend_t *b, backend_stream_t *t, backend_event_t *ev) {
  cuda_state_t *st = cuda_state(b);
  if (st->emulated || !ev) return 0;
  cuda_bind(st);
  meshd_error_t e;
  return cuda_check(st, cudaStreamWaitEvent(cuda_stream_of(b, t)->s, (cudaEvent_t)ev, 0),
                    "ordering streams", &e);
}

static void cuda_event_destroy(backend_t *b, backend_event_t *ev) {
  cuda_state_t *st = cuda_state(b);
  if (st->emulated || !ev) return;
  cuda_bind(st); /* a Read's thread may have made no other CUDA call */
  cudaEventDestroy((cudaEvent_t)ev);
}

/* ------------------------------------------------------------------ dispatch */

/* The kernel of each family (kernel_family.h). */
static const kernel_fn kernels[KF_COUNT] = KERNEL_FAMILY_TABLE(cuda_kernel_);

/* The kernel for op, or NULL for a view (which needs none) or an unknown op. */
static kernel_fn kernel_of(const op_def_t *op) { return kernels[kernel_family_of(op)]; }

static int cuda_run_op(backend_t *b, backend_stream_t *s, const op_args_t *a,
                       agent_tensor_t **results, int nresults, const op_infer_t *inf,
                       uint32_t mesh_rank, int64_t coordinate, meshd_error_t *err) {
  bool work = inf->nmutates > 0;
  for (int i = 0; i < inf->nresults; i++) work |= inf->results[i].alias_param < 0;
  if (!work) return 0;
  kernel_fn fn = kernel_of(a->op);
  if (!fn)
    return error_set(err, ERR_REMOTE_FAILURE, "%s: the cuda backend has no kernel for this op",
                     op_name(a->op));
  cuda_state_t *st = cuda_state(b);
  cuda_bind(st);
  kernel_call_t c = {.b = b, .bs = cuda_stream_of(b, s), .a = a, .res = results,
                     .nres = nresults, .inf = inf, .rank = mesh_rank, .coordinate = coordinate};
  int rc = fn(&c, err);
  if (!rc && !s) rc = sync_own(st, err);
  return rc;
}

static int cuda_copy(backend_t *b, backend_stream_t *s, agent_tensor_t *dst,
                     const agent_tensor_t *src, meshd_error_t *err) {
  if (!layout_same_shape(&dst->meta.layout, &src->meta.layout))
    return error_set(err, ERR_SHAPE_MISMATCH, "copy: source and destination shapes differ");
  cuda_state_t *st = cuda_state(b);
  cuda_bind(st);
  int rc = cuda_copy_broadcast(b, cuda_stream_of(b, s), dst, src, err);
  if (!rc && !s) rc = sync_own(st, err);
  return rc;
}

/* ------------------------------------------------------------------ host transfers */

static size_t nbytes(const agent_tensor_t *t) {
  return (size_t)layout_numel(&t->meta.layout) * dtype_size(t->meta.dtype);
}

static void *element0(const agent_tensor_t *t) {
  return (char *)t->storage->data + t->meta.layout.offset * (int64_t)dtype_size(t->meta.dtype);
}

/* A contiguous tensor of t's shape and dtype on `data` (borrowed storage). */
static agent_tensor_t contiguous_like(const agent_tensor_t *t, agent_storage_t *st, void *data) {
  agent_tensor_t c = {.meta = t->meta, .storage = st};
  layout_make_contiguous(&c.meta.layout);
  st->data = data;
  return c;
}

/* Both run on s's CUDA stream (cuda_stream_of), in its order, and wait for
 * their own copy only (wait_queued). */
static int cuda_to_host(backend_t *b, backend_stream_t *s, const agent_tensor_t *t, void *dst,
                        meshd_error_t *err) {
  cuda_state_t *st = cuda_state(b);
  backend_stream_t *bs = cuda_stream_of(b, s);
  size_t n = nbytes(t);
  agent_storage_t tmp_st = {0};
  if (st->emulated) {
    agent_tensor_t h = contiguous_like(t, &tmp_st, dst);
    return cuda_copy_broadcast(b, bs, &h, t, err);
  }
  cuda_bind(st);
  void *src = element0(t), *scratch = NULL;
  int rc = 0;
  if (!layout_is_contiguous(&t->meta.layout)) { /* gather on the device first */
    if (!(scratch = cuda_scratch_alloc(b, bs, n ? n : 1)))
      return error_set(err, ERR_QUOTA, "fetch: out of device memory gathering %zu bytes", n);
    agent_tensor_t c = contiguous_like(t, &tmp_st, scratch);
    rc = cuda_copy_broadcast(b, bs, &c, t, err);
    src = scratch;
  }
  if (!rc && n)
    rc = cuda_check(st, cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, bs->s),
                    "copy to host", err);
  cuda_scratch_free(b, bs, scratch, n ? n : 1);
  int rc2 = wait_queued(st, bs, rc ? NULL : err);
  return rc ? rc : rc2;
}

static int cuda_from_host(backend_t *b, backend_stream_t *s, agent_tensor_t *t, const void *src,
                          meshd_error_t *err) {
  cuda_state_t *st = cuda_state(b);
  backend_stream_t *bs = cuda_stream_of(b, s);
  size_t n = nbytes(t);
  agent_storage_t tmp_st = {0};
  if (st->emulated) {
    agent_tensor_t h = contiguous_like(t, &tmp_st, (void *)src);
    return cuda_copy_broadcast(b, bs, t, &h, err);
  }
  cuda_bind(st);
  int rc = 0;
  if (layout_is_contiguous(&t->meta.layout)) {
    if (n)
      rc = cuda_check(st, cudaMemcpyAsync(element0(t), src, n, cudaMemcpyHostToDevice, bs->s),
                      "copy from host", err);
  } else { /* scatter on the device */
    void *scratch = cuda_scratch_alloc(b, bs, n ? n : 1);
    if (!scratch)
      return error_set(err, ERR_QUOTA, "upload: out of device memory staging %zu bytes", n);
    rc = n ? cuda_check(st, cudaMemcpyAsync(scratch, src, n, cudaMemcpyHostToDevice, bs->s),
                        "copy from host", err)
           : 0;
    agent_tensor_t c = contiguous_like(t, &tmp_st, scratch);
    if (!rc) rc = cuda_copy_broadcast(b, bs, t, &c, err);
    cuda_scratch_free(b, bs, scratch, n ? n : 1);
  }
  int rc2 = wait_queued(st, bs, rc ? NULL : err);
  return rc ? rc : rc2;
}

/* ------------------------------------------------------------------ communicators */

/* The NCCL slots (cuda_nccl.c), entered with the device bound. */
static int c_allreduce(backend_t *b, backend_stream_t *s, const dp_group_t *g, void *buf,
                       size_t count, dtype_t dtype, reduction_t op, meshd_error_t *e) {
  cuda_bind(cuda_state(b));
  return cuda_allreduce(b, s, g, buf, count, dtype, op, e);
}

static int c_reduce_scatter(backend_t *b, backend_stream_t *s, const dp_group_t *g, const void *in,
                            void *out, size_t count, dtype_t dtype, reduction_t op,
                            meshd_error_t *e) {
  cuda_bind(cuda_state(b));
  return cuda_reduce_scatter(b, s, g, in, out, count, dtype, op, e);
}

static int c_allgather(backend_t *b, backend_stream_t *s, const dp_group_t *g, const void *in,
                       void *out, size_t count, dtype_t dtype, meshd_error_t *e) {
  cuda_bind(cuda_state(b));
  return cuda_allgather(b, s, g, in, out, count, dtype, e);
}

static int c_alltoall(backend_t *b, backend_stream_t *s, const dp_group_t *g, const void *in,
                      void *out, size_t count, dtype_t dtype, meshd_error_t *e) {
  cuda_bind(cuda_state(b));
  return cuda_alltoall(b, s, g, in, out, count, dtype, e);
}

/* Rooted and broadcast: emulated agents run the data plane's (a ring or
 * direct sends to the root; the chain); real ones NCCL's ncclReduce, a
 * grouped send/recv gather to the root, and ncclBroadcast from member 0 on
 * the group's communicator (cuda_nccl.c). */
static int c_reduce_root(backend_t *b, backend_stream_t *s, const dp_group_t *g, size_t root,
                         void *buf, size_t count, dtype_t dtype, reduction_t op, meshd_error_t *e) {
  cuda_bind(cuda_state(b));
  return cuda_reduce_root(b, s, g, root, buf, count, dtype, op, e);
}

static int c_gather_root(backend_t *b, backend_stream_t *s, const dp_group_t *g, size_t root,
                         const void *in, void *out, size_t count, dtype_t dtype, meshd_error_t *e) {
  cuda_bind(cuda_state(b));
  return cuda_gather_root(b, s, g, root, in, out, count, dtype, e);
}

static int c_broadcast(backend_t *b, backend_stream_t *s, const dp_group_t *g, void *buf,
                       size_t bytes, meshd_error_t *e) {
  cuda_bind(cuda_state(b));
  return cuda_broadcast(b, s, g, buf, bytes, e);
}

static int c_send(backend_t *b, backend_stream_t *s, uint64_t session, uint64_t comm_id,
                  uint64_t call, const uint8_t *secret, uint32_t to_rank, const char *addr, const void *buf,
                  size_t bytes, meshd_error_t *e) {
  cuda_bind(cuda_state(b));
  return cuda_send(b, s, session, comm_id, call, secret, to_rank, addr, buf, bytes, e);
}

static int c_recv(backend_t *b, backend_stream_t *s, uint64_t session, uint64_t comm_id,
                  uint64_t call, const uint8_t *secret, uint32_t from_rank, const char *addr, void *buf,
                  size_t bytes, meshd_error_t *e) {
  cuda_bind(cuda_state(b));
  return cuda_recv(b, s, session, comm_id, call, secret, from_rank, addr, buf, bytes, e);
}

static void c_session_end(backend_t *b, uint64_t session) {
  cuda_bind(cuda_state(b));
  cuda_session_end(b, session);
}

static void c_refuse(backend_t *b, const dp_group_t *g, dp_refuse_t what, uint64_t calls,
                   const char *why) {
  cuda_refuse(b, g, what, calls, why);
}

static void c_peer_lost(backend_t *b, uint64_t session, uint32_t rank) {
  cuda_bind(cuda_state(b));
  cuda_peer_lost(b, session, rank);
}

const backend_ops_t cuda_backend_ops = {
    .name = "cuda",
    .open = cuda_open,
    .close = cuda_close,
    .alloc = cuda_alloc,
    .free = cuda_free,
    .stream_create = cuda_stream_create,
    .stream_destroy = cuda_stream_destroy,
    .stream_sync = cuda_stream_sync,
    .health = cuda_health,
    .run_op = cuda_run_op,
    .copy = cuda_copy,
    .to_host = cuda_to_host,
    .from_host = cuda_from_host,
    .event_record = cuda_event_record,
    .event_wait = cuda_event_wait,
    .event_destroy = cuda_event_destroy,
    .allreduce = c_allreduce,
    .reduce_scatter = c_reduce_scatter,
    .allgather = c_allgather,
    .alltoall = c_alltoall,
    .reduce_root = c_reduce_root,
    .gather_root = c_gather_root,
    .broadcast = c_broadcast,
    .send = c_send,
    .recv = c_recv,
    .refuse = c_refuse,
    .session_end = c_session_end,
    .peer_lost = c_peer_lost,
};
