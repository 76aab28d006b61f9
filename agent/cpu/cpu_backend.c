/* The cpu backend: host memory, kernels that finish before they return, no
 * streams. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"

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

static void *cpu_alloc(backend_t *b, backend_stream_t *s, size_t bytes) {
  uint64_t prev = atomic_fetch_add(&b->allocated, bytes);
  if (b->capacity && prev + bytes > b->capacity) {
    atomic_fetch_sub(&b->allocated, bytes);
    return NULL;
  }
  size_t rounded = bytes ? (bytes + ALIGN - 1) / ALIGN * ALIGN : ALIGN;
  void *p = rounded >= bytes ? aligned_alloc(ALIGN, rounded) : NULL;
  if (!p) atomic_fetch_sub(&b->allocated, bytes);
  return p;
}

static void cpu_free(backend_t *b, void *ptr, size_t bytes) {
  if (!ptr) return;
  free(ptr);
  atomic_fetch_sub(&b->allocated, bytes);
}

/* ---- dispatch ---- */

static const struct {
  const char *name;
  cpu_kernel_fn fn;
} kernels[] = {
    {"empty", cpu_kernel_fill}, {"zeros", cpu_kernel_fill}, {"ones", cpu_kernel_fill},
    {"full", cpu_kernel_fill}, {"arange", cpu_kernel_arange}, {"rand", cpu_kernel_rand},
    {"randn", cpu_kernel_rand}, {"rank", cpu_kernel_rank},
    {"add", cpu_kernel_binary}, {"sub", cpu_kernel_binary}, {"mul", cpu_kernel_binary},
    {"div", cpu_kernel_binary}, {"pow", cpu_kernel_binary}, {"maximum", cpu_kernel_binary},
    {"minimum", cpu_kernel_binary}, {"eq", cpu_kernel_binary}, {"ne", cpu_kernel_binary},
    {"lt", cpu_kernel_binary}, {"le", cpu_kernel_binary}, {"gt", cpu_kernel_binary},
    {"ge", cpu_kernel_binary}, {"logical_and", cpu_kernel_binary},
    {"logical_or", cpu_kernel_binary}, {"bitwise_and", cpu_kernel_binary},
    {"bitwise_or", cpu_kernel_binary}, {"bitwise_xor", cpu_kernel_binary},
    {"add_", cpu_kernel_binary}, {"sub_", cpu_kernel_binary}, {"mul_", cpu_kernel_binary},
    {"div_", cpu_kernel_binary},
    {"neg", cpu_kernel_unary}, {"abs", cpu_kernel_unary}, {"exp", cpu_kernel_unary},
    {"log", cpu_kernel_unary}, {"sqrt", cpu_kernel_unary}, {"rsqrt", cpu_kernel_unary},
    {"sin", cpu_kernel_unary}, {"cos", cpu_kernel_unary}, {"tanh", cpu_kernel_unary},
    {"sigmoid", cpu_kernel_unary}, {"reciprocal", cpu_kernel_unary},
    {"relu", cpu_kernel_unary}, {"gelu", cpu_kernel_unary}, {"silu", cpu_kernel_unary},
    {"sign", cpu_kernel_unary}, {"logical_not", cpu_kernel_unary},
    {"sum", cpu_kernel_reduce}, {"mean", cpu_kernel_reduce}, {"prod", cpu_kernel_reduce},
    {"max", cpu_kernel_reduce}, {"min", cpu_kernel_reduce}, {"amax", cpu_kernel_reduce},
    {"amin", cpu_kernel_reduce}, {"argmax", cpu_kernel_reduce}, {"argmin", cpu_kernel_reduce},
    {"softmax", cpu_kernel_softmax}, {"log_softmax", cpu_kernel_softmax},
    {"matmul", cpu_kernel_matmul}, {"mm", cpu_kernel_matmul}, {"bmm", cpu_kernel_matmul},
    {"clone", cpu_kernel_copy}, {"contiguous", cpu_kernel_copy}, {"to", cpu_kernel_copy},
    {"cast", cpu_kernel_copy}, {"copy_", cpu_kernel_copy}, {"reshape", cpu_kernel_copy}, {"cat", cpu_kernel_cat},
    {"stack", cpu_kernel_stack}, {"index_select", cpu_kernel_index_select},
    {"gather", cpu_kernel_gather}, {"where", cpu_kernel_where}, {"clamp", cpu_kernel_clamp},
    {"clamp_", cpu_kernel_clamp}, {"fill_", cpu_kernel_fill_}, {"zero_", cpu_kernel_fill_},
};

#define MAX_OPS 256
static cpu_kernel_fn by_id[MAX_OPS];
static pthread_once_t by_id_once = PTHREAD_ONCE_INIT;

static void build_by_id(void) {
  for (size_t k = 0; k < sizeof kernels / sizeof kernels[0]; k++) {
    const op_def_t *op = ops_find(kernels[k].name);
    if (op && op_id(op) >= 0 && op_id(op) < MAX_OPS) by_id[op_id(op)] = kernels[k].fn;
  }
}

/* The kernel for op, or NULL for a view (which needs none) or an unknown op. */
static cpu_kernel_fn kernel_of(const op_def_t *op) {
  pthread_once(&by_id_once, build_by_id);
  int id = op_id(op);
  return id >= 0 && id < MAX_OPS ? by_id[id] : NULL;
}

static int cpu_run_op(backend_t *b, backend_stream_t *s, const op_args_t *a,
                      agent_tensor_t **results, int nresults, const op_infer_t *inf,
                      uint32_t mesh_rank, int64_t coordinate, meshd_error_t *err) {
  const op_def_t *op = a->op;
  /* Results that alias an input were built by the caller; only fresh ones and
   * mutated inputs need work. */
  bool work = inf->nmutates > 0;
  for (int i = 0; i < inf->nresults; i++) work |= inf->results[i].alias_param < 0;
  if (!work) return 0;
  cpu_kernel_fn fn = kernel_of(op);
  if (!fn)
    return error_set(err, ERR_REMOTE_FAILURE, "%s: the cpu backend has no kernel for this op",
                     op_name(op));
  cpu_call_t c = {b, a, results, nresults, inf, mesh_rank, coordinate};
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
                         size_t count, dtype_t dtype, dp_reduce_t op, meshd_error_t *e) {
  return b->net ? dp_allreduce(b->net, g, buf, count, dtype, op, e) : no_net(e);
}

static int cpu_reduce_scatter(backend_t *b, backend_stream_t *s, const dp_group_t *g, const void *in,
                              void *out, size_t count, dtype_t dtype, dp_reduce_t op,
                              meshd_error_t *e) {
  return b->net ? dp_reduce_scatter(b->net, g, in, out, count, dtype, op, e) : no_net(e);
}

static int cpu_allgather(backend_t *b, backend_stream_t *s, const dp_group_t *g, const void *in,
                         void *out, size_t count, dtype_t dtype, meshd_error_t *e) {
  return b->net ? dp_allgather(b->net, g, in, out, count, dtype, e) : no_net(e);
}

static int cpu_alltoall(backend_t *b, backend_stream_t *s, const dp_group_t *g, const void *in,
                        void *out, size_t count, dtype_t dtype, meshd_error_t *e) {
  return b->net ? dp_alltoall(b->net, g, in, out, count, dtype, e) : no_net(e);
}

static int cpu_send(backend_t *b, backend_stream_t *s, uint64_t session, uint64_t comm_id,
                    uint32_t to_rank, const char *addr, const void *buf, size_t bytes,
                    meshd_error_t *e) {
  return b->net ? dp_send(b->net, comm_id, to_rank, addr, buf, bytes, e) : no_net(e);
}

static int cpu_recv(backend_t *b, backend_stream_t *s, uint64_t session, uint64_t comm_id,
                    uint32_t from_rank, const char *addr, void *buf, size_t bytes,
                    meshd_error_t *e) {
  return b->net ? dp_recv(b->net, comm_id, from_rank, addr, buf, bytes, e) : no_net(e);
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
    .send = cpu_send,
    .recv = cpu_recv,
    .session_end = NULL, /* the data plane drops a session's connections on its own */
};
