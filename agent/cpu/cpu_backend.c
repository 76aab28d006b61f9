/* The cpu backend: host memory, kernels that finish before they return, no
 * streams. */
#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <string.h>

#include "cpu_internal.h"
#include "kernel_family.h"

/* What the cache of freed tensors (below) holds at most: 2 GiB, or an 8th
 * of the agent's capacity when that is less. */
#define CACHE_MAX ((size_t)2 << 30)

static int cpu_open(backend_t *b, const char *device, meshd_error_t *err) {
  if (!device || strcmp(device, "cpu") != 0)
    return error_set(err, ERR_BAD_ARGUMENT, "cpu backend: device '%s' is not 'cpu'",
                     device ? device : "(null)");
  cpu_state_t *s = calloc(1, sizeof *s);
  if (!s) return error_set(err, ERR_UNAVAILABLE, "cpu backend: out of memory");
  pthread_mutex_init(&s->cache_mu, NULL);
  s->cache_max = CACHE_MAX;
  if (b->capacity && b->capacity / 8 < s->cache_max) s->cache_max = b->capacity / 8;
  b->impl = s;
  return 0;
}

static int cache_drain(cpu_state_t *s);

static void cpu_close(backend_t *b) {
  cpu_state_t *s = b->impl;
  cache_drain(s);
  pthread_mutex_destroy(&s->cache_mu);
  free(s);
  b->impl = NULL;
}

#define ALIGN 64

/* Tensors this large are private mappings of their own, not glibc's heap
 * (glibc's default mmap threshold, which runtime_tune_malloc raises to 8 MiB
 * for gRPC's buffers): aligned 1 MiB tensors of an Upload loop left holes in
 * the heaps of the threads that allocate them, each a little too small for
 * the next tensor, and an agent so held ~250 MB resident for 2 MiB of live
 * tensors, faulting each new heap page in (tests/unit/test_backend_kernels.c). */
#define MAP_FROM (128u << 10)
#define PAGE (4u << 10)

/* Tensors this large sit on 2 MiB pages where the kernel allows it
 * (transparent huge pages, "madvise" mode): filling one takes a page fault
 * per 2 MiB instead of per 4 KiB, which dominated an Upload's agent CPU
 * (page faults are dear on virtual machines). */
#define HUGE_FROM (4u << 20)
#define HUGE_PAGE (2u << 20)

/* A tensor of HUGE_FROM bytes or more is a whole private mapping of its own
 * (size: a multiple of HUGE_PAGE, on a HUGE_PAGE boundary), so a same-host
 * broadcast may map the source's pages over it (dp_group_t.mappable). */
static void *huge_map(size_t size) {
  size_t span = size + HUGE_PAGE;
  uint8_t *p = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return NULL;
  uint8_t *a = (uint8_t *)(((uintptr_t)p + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
  if (a > p) munmap(p, (size_t)(a - p));
  if (a + size < p + span) munmap(a + size, (size_t)(p + span - (a + size)));
  (void)madvise(a, size, MADV_HUGEPAGE); /* a hint */
  return a;
}

/* A mapping of size bytes, a multiple of align (block_align). One below
 * HUGE_FROM has its pages in at once (MAP_POPULATE): a tensor is written
 * whole, and one fault per 4 KiB page cost twice what populating them in one
 * call does (a fresh 256 KiB block, filled: 572 us faulted, 263 us populated,
 * on the 2-core VM here). Not huge ones: a page fault there fills 2 MiB, and
 * a same-host broadcast may map the source's pages over them. */
static void *block_map(size_t size, size_t align) {
  if (align == HUGE_PAGE) return huge_map(size);
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                 -1, 0);
  return p == MAP_FAILED ? NULL : p;
}

/* The alignment, and the multiple of which its size is, of a tensor of bytes. */
static size_t block_align(size_t bytes) {
  return bytes >= HUGE_FROM ? HUGE_PAGE : bytes >= MAP_FROM ? PAGE : ALIGN;
}

/* ---- memory: large tensors come from a small cache of freed ones ---------
 *
 * The kernel zeroes every page a process touches for the first time, and on
 * virtual machines each fault is dear: filling a fresh 64 MiB tensor cost an
 * Upload more CPU than moving its bytes. A freed tensor of MAP_FROM bytes or
 * more is kept (CPU_CACHE_SLOTS of them, cache_max bytes at most, the oldest
 * going first) and handed to the next tensor of the same rounded size: a
 * loop that uploads, computes and drops batches of one shape faults once.
 * Cached memory is not counted in `allocated` (no tensor holds it), but live
 * and cached bytes together stay within the capacity (the pod's memory limit,
 * where the agent runs in one): an allocation that would pass it frees the
 * oldest cached blocks first. One that finds no memory empties the cache and
 * tries again. */

static size_t rounded_size(size_t bytes, size_t align) {
  return bytes ? (bytes + align - 1) / align * align : align;
}

static void *cache_take(cpu_state_t *s, size_t size) {
  void *p = NULL;
  pthread_mutex_lock(&s->cache_mu);
  for (int i = s->ncache - 1; i >= 0; i--) /* the newest: its pages are the warmest */
    if (s->cache[i].size == size) {
      p = s->cache[i].p;
      atomic_fetch_sub(&s->cache_bytes, size);
      memmove(&s->cache[i], &s->cache[i + 1], (size_t)(s->ncache - i - 1) * sizeof s->cache[0]);
      s->ncache--;
      break;
    }
  pthread_mutex_unlock(&s->cache_mu);
  return p;
}

/* Takes the oldest cached blocks out (into out[], their count returned) until
 * `size` more bytes fit within `room` and a slot is free (size 0: until at
 * most `room` stay cached). Holds cache_mu; the caller frees them unlocked. */
static int evict_locked(cpu_state_t *s, size_t size, size_t room, cpu_block_t *out) {
  int n = 0;
  while (s->ncache > 0 && (atomic_load(&s->cache_bytes) + size > room ||
                           (size && s->ncache == CPU_CACHE_SLOTS))) {
    out[n++] = s->cache[0];
    atomic_fetch_sub(&s->cache_bytes, s->cache[0].size);
    memmove(&s->cache[0], &s->cache[1], (size_t)(s->ncache - 1) * sizeof s->cache[0]);
    s->ncache--;
  }
  return n;
}

/* Keeps p (size bytes) for a later alloc, or frees it. */
static void cache_put(cpu_state_t *s, void *p, size_t size) {
  cpu_block_t evicted[CPU_CACHE_SLOTS + 1];
  int nev = 0;
  pthread_mutex_lock(&s->cache_mu);
  if (size > s->cache_max) {
    evicted[nev++] = (cpu_block_t){p, size};
  } else {
    nev = evict_locked(s, size, s->cache_max, evicted);
    s->cache[s->ncache++] = (cpu_block_t){p, size};
    atomic_fetch_add(&s->cache_bytes, size);
  }
  pthread_mutex_unlock(&s->cache_mu);
  for (int i = 0; i < nev; i++) munmap(evicted[i].p, evicted[i].size);
}

/* Frees the oldest cached blocks until at most `room` bytes stay cached; how
 * many it freed. */
static int cache_trim(cpu_state_t *s, size_t room) {
  if (atomic_load(&s->cache_bytes) <= room) return 0; /* the common case: no lock */
  cpu_block_t evicted[CPU_CACHE_SLOTS];
  pthread_mutex_lock(&s->cache_mu);
  int nev = evict_locked(s, 0, room, evicted);
  pthread_mutex_unlock(&s->cache_mu);
  for (int i = 0; i < nev; i++) munmap(evicted[i].p, evicted[i].size);
  return nev;
}

static int cache_drain(cpu_state_t *s) { return cache_trim(s, 0); }

static void *cpu_alloc(backend_t *b, backend_stream_t *s, size_t bytes) {
  if (!backend_reserve(b, bytes)) return NULL;
  cpu_state_t *st = b->impl;
  bool mapped = bytes >= MAP_FROM;
  size_t align = block_align(bytes);
  size_t rounded = rounded_size(bytes, align);
  void *p = NULL;
  if (rounded < bytes) goto out; /* overflow */
  if (mapped && (p = cache_take(st, rounded))) return p;
  if (b->capacity) { /* live and cached bytes within the capacity */
    uint64_t live = atomic_load(&b->allocated);
    cache_trim(st, live < b->capacity ? b->capacity - live : 0);
  }
  if (mapped) {
    if (!(p = block_map(rounded, align)) && cache_drain(st)) p = block_map(rounded, align);
  } else if (!(p = aligned_alloc(align, rounded)) && cache_drain(st)) {
    p = aligned_alloc(align, rounded);
  }
out:
  if (!p) backend_unreserve(b, bytes);
  return p;
}

static void cpu_free(backend_t *b, void *ptr, size_t bytes) {
  if (!ptr) return;
  if (bytes >= MAP_FROM) cache_put(b->impl, ptr, rounded_size(bytes, block_align(bytes)));
  else free(ptr);
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

/* Streams are host threads here: the caller's thread is s's order. */
static int cpu_to_host(backend_t *b, backend_stream_t *s, const agent_tensor_t *t, void *dst,
                       meshd_error_t *err) {
  agent_storage_t st = {0};
  agent_tensor_t h = host_view(t, &st, dst);
  cpu_copy_broadcast(&h, t);
  return 0;
}

static int cpu_from_host(backend_t *b, backend_stream_t *s, agent_tensor_t *t, const void *src,
                         meshd_error_t *err) {
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

static int cpu_broadcast(backend_t *b, backend_stream_t *s, const dp_group_t *g, void *buf,
                         size_t bytes, meshd_error_t *e) {
  dp_group_t mine = *g;
  mine.mappable = bytes >= HUGE_FROM; /* buf is an allocation of bytes: its own mapping */
  return b->net ? dp_broadcast(b->net, &mine, buf, bytes, e) : no_net(e);
}

static int cpu_alltoall(backend_t *b, backend_stream_t *s, const dp_group_t *g, const void *in,
                        void *out, size_t count, dtype_t dtype, meshd_error_t *e) {
  return b->net ? dp_alltoall(b->net, g, in, out, count, dtype, e) : no_net(e);
}

static int cpu_send(backend_t *b, backend_stream_t *s, uint64_t session, uint64_t comm_id,
                    uint64_t call, const uint8_t *secret, uint32_t to_rank, const char *addr, const void *buf,
                    size_t bytes, meshd_error_t *e) {
  return b->net ? dp_send(b->net, comm_id, call, secret, to_rank, addr, buf, bytes, e) : no_net(e);
}

static int cpu_recv(backend_t *b, backend_stream_t *s, uint64_t session, uint64_t comm_id,
                    uint64_t call, const uint8_t *secret, uint32_t from_rank, const char *addr, void *buf,
                    size_t bytes, meshd_error_t *e) {
  return b->net ? dp_recv(b->net, comm_id, call, secret, from_rank, addr, buf, bytes, e) : no_net(e);
}

static void cpu_refuse(backend_t *b, const dp_group_t *g, dp_refuse_t what, uint64_t calls,
                   const char *why) {
  if (b->net) dp_refuse(b->net, g, what, calls, why, NULL);
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
    .broadcast = cpu_broadcast,
    .send = cpu_send,
    .recv = cpu_recv,
    .refuse = cpu_refuse,
    .session_end = NULL, /* the data plane drops a session's connections on its own */
};
