/* The cpu backend: host memory, kernels that finish before they return, no
 * streams. */
#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <string.h>

#include "cpu_internal.h"
#include "kernel_family.h"

static int cpu_open(backend_t *b, const char *device, meshd_error_t *err) {
  if (!device || strcmp(device, "cpu") != 0)
    return error_set(err, ERR_BAD_ARGUMENT, "cpu backend: device '%s' is not 'cpu'",
                     device ? device : "(null)");
  cpu_state_t *s = calloc(1, sizeof *s);
  if (!s) return error_set(err, ERR_UNAVAILABLE, "cpu backend: out of memory");
  b->impl = s;
  return 0;
}

static void cpu_close(backend_t *b) {
  free(b->impl);
  b->impl = NULL;
}

#define ALIGN 64

/* Tensors this large sit on 2 MiB pages where the kernel allows it
 * (transparent huge pages, "madvise" mode): filling one takes a page fault
 * per 2 MiB instead of per 4 KiB, which dominated an Upload's agent CPU
 * (page faults are dear on virtual machines). */
#define HUGE_FROM (4u << 20)
#define HUGE_PAGE (2u << 20)

static void *cpu_alloc(backend_t *b, backend_stream_t *s, size_t bytes) {
  if (!backend_reserve(b, bytes)) return NULL;
  size_t align = bytes >= HUGE_FROM ? HUGE_PAGE : ALIGN;
  size_t rounded = bytes ? (bytes + align - 1) / align * align : align;
  void *p = rounded >= bytes ? aligned_alloc(align, rounded) : NULL;
  if (!p) backend_unreserve(b, bytes);
  else if (align == HUGE_PAGE) (void)madvise(p, rounded, MADV_HUGEPAGE); /* a hint */
  return p;
}

static void cpu_free(backend_t *b, void *ptr, size_t bytes) {
  if (!ptr) return;
  free(ptr);
  backend_unreserve(b, bytes);
}

/* ---- dispatch ---- */

/* The kernel of each family (kernel_family.h). */
static const kernel_fn kernels[KF_COUNT] = KERNEL_FAMILY_TABLE(cpu_kernel_);

/* The kernel for op, or NULL for a view (which needs none) or an unknown op. */
static kernel_fn kernel_of(const op_def_t *op) { return kernels[kernel_family_of(op)]; }

static int cpu_run_op(backend_t *b, backend_stream_t *s, const op_args_t *a,
                      agent_tensor_t **results, int nresults, const op_infer_t *inf,
                      uint32_t mesh_rank, int64_t coordinate, meshd_error_t *err) {
  const op_def_t *op = a->op;
  /* Results that alias an input were built by the caller; only fresh ones and
   * mutated inputs need work. */
  bool work = inf->nmutates > 0;
  for (int i = 0; i < inf->nresults; i++) work |= inf->results[i].alias_param < 0;
  if (!work) return 0;
  kernel_fn fn = kernel_of(op);
  if (!fn)
    return error_set(err, ERR_REMOTE_FAILURE, "%s: the cpu backend has no kernel for this op",
                     op_name(op));
  kernel_call_t c = {.b = b, .bs = NULL, .a = a, .res = results, .nres = nresults, .inf = inf,
                     .rank = mesh_rank, .coordinate = coordinate};
  return fn(&c, err);
}

static int cpu_copy(backend_t *b, backend_stream_t *s, agent_tensor_t *dst,
                    const agent_tensor_t *src, meshd_error_t *err) {
  if (!layout_same_shape(&dst->meta.layout, &src->meta.layout))
    return error_set(err, ERR_SHAPE_MISMATCH, "copy: source and destination shapes differ");
  cpu_copy_broadcast(dst, src);
  return 0;
}

/* t's shape over host bytes, row-major. */
static agent_tensor_t host_view(const agent_tensor_t *t, agent_storage_t *st, void *data) {
  agent_tensor_t h = {.meta = t->meta, .storage = st};
  layout_make_contiguous(&h.meta.layout);
  st->data = data;
  return h;
}

static int cpu_to_host(backend_t *b, const agent_tensor_t *t, void *dst, meshd_error_t *err) {
  agent_storage_t st = {0};
  agent_tensor_t h = host_view(t, &st, dst);
  cpu_copy_broadcast(&h, t);
  return 0;
}

static int cpu_from_host(backend_t *b, agent_tensor_t *t, const void *src, meshd_error_t *err) {
  agent_storage_t st = {0};
  agent_tensor_t h = host_view(t, &st, (void *)src);
  cpu_copy_broadcast(t, &h);
  return 0;
}

/* ---- communicators: the TCP data plane (b->net) ------------------------- */

static int no_net(meshd_error_t *e) {
  return error_set(e, ERR_REMOTE_FAILURE,
                   "this agent has no data plane (it failed to start): collectives and sends "
                   "across agents are unavailable");
}

static int cpu_allreduce(backend_t *b, backend_stream_t *s, const dp_group_t *g, void *buf,
                         size_t count, dtype_t dtype, reduction_t op, meshd_error_t *e) {
  return b->net ? dp_allreduce(b->net, g, buf, count, dtype, op, e) : no_net(e);
}

static int cpu_reduce_scatter(backend_t *b, backend_stream_t *s, const dp_group_t *g, const void *in,
                              void *out, size_t count, dtype_t dtype, reduction_t op,
                              meshd_error_t *e) {
  return b->net ? dp_reduce_scatter(b->net, g, in, out, count, dtype, op, e) : no_net(e);
}

static int cpu_allgather(backend_t *b, backend_stream_t *s, const dp_group_t *g, const void *in,
                         void *out, size_t count, dtype_t dtype, meshd_error_t *e) {
  return b->net ? dp_allgather(b->net, g, in, out, count, dtype, e) : no_net(e);
}

static int cpu_reduce_root(backend_t *b, backend_stream_t *s, const dp_group_t *g, size_t root,
                           void *buf, size_t count, dtype_t dtype, reduction_t op, meshd_error_t *e) {
  return b->net ? dp_reduce_root(b->net, g, root, buf, count, dtype, op, e) : no_net(e);
}

static int cpu_gather_root(backend_t *b, backend_stream_t *s, const dp_group_t *g, size_t root,
                           const void *in, void *out, size_t count, dtype_t dtype, meshd_error_t *e) {
  return b->net ? dp_gather_root(b->net, g, root, in, out, count, dtype, e) : no_net(e);
}

static int cpu_alltoall(backend_t *b, backend_stream_t *s, const dp_group_t *g, const void *in,
                        void *out, size_t count, dtype_t dtype, meshd_error_t *e) {
  return b->net ? dp_alltoall(b->net, g, in, out, count, dtype, e) : no_net(e);
}

static int cpu_send(backend_t *b, backend_stream_t *s, uint64_t session, uint64_t comm_id,
                    const uint8_t *secret, uint32_t to_rank, const char *addr, const void *buf,
                    size_t bytes, meshd_error_t *e) {
  return b->net ? dp_send(b->net, comm_id, secret, to_rank, addr, buf, bytes, e) : no_net(e);
}

static int cpu_recv(backend_t *b, backend_stream_t *s, uint64_t session, uint64_t comm_id,
                    const uint8_t *secret, uint32_t from_rank, const char *addr, void *buf,
                    size_t bytes, meshd_error_t *e) {
  return b->net ? dp_recv(b->net, comm_id, secret, from_rank, addr, buf, bytes, e) : no_net(e);
}

const backend_ops_t cpu_backend_ops = {
    .name = "cpu",
    .open = cpu_open,
    .close = cpu_close,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .stream_create = NULL,
    .stream_destroy = NULL,
    .stream_sync = NULL,
    .health = NULL, /* host memory is never lost */
    .run_op = cpu_run_op,
    .copy = cpu_copy,
    .to_host = cpu_to_host,
    .from_host = cpu_from_host,
    .event_record = NULL, /* streams are host threads: the executor orders them */
    .event_wait = NULL,
    .event_destroy = NULL,
    .allreduce = cpu_allreduce,
    .reduce_scatter = cpu_reduce_scatter,
    .allgather = cpu_allgather,
    .alltoall = cpu_alltoall,
    .reduce_root = cpu_reduce_root,
    .gather_root = cpu_gather_root,
    .send = cpu_send,
    .recv = cpu_recv,
    .session_end = NULL, /* the data plane drops a session's connections on its own */
};
