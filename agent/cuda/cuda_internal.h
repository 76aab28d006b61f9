/* Inside the cuda backend (agent/cuda/): its state, its streams, the kernel
 * entry points run_op dispatches to, and the device helpers (cuda_device.c)
 * that the kernels, cuBLAS and NCCL share. Included by the C files
 * (cuda_backend.c, cuda_device.c, cuda_blas.c, cuda_nccl.c) and, through
 * kernels.cuh, by the .cu kernels (C++): plain C types only.
 *
 * Calls go one way: cuda_backend.c (the vtable) calls down into the kernels,
 * cuda_blas.c and cuda_nccl.c, which call cuda_device.c; nothing calls back
 * into cuda_backend.c.
 *
 * Emulation. On device "cuda:emulated" (st->emulated) there is no GPU: memory
 * is host memory, streams and events are placeholders, and every kernel runs
 * its per-element functor in a loop on the calling thread (cuda_launch in
 * kernels.cuh) — the same code the GPU runs, so tests on machines without a
 * GPU exercise every kernel's logic. No CUDA runtime call may be made when
 * st->emulated; cuBLAS and NCCL are replaced by the functor matmul and the TCP
 * data plane. */
#ifndef MESHD_CUDA_INTERNAL_H
#define MESHD_CUDA_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

/* The core headers have no C++ guards: C linkage for everything below. */
#ifdef __cplusplus
extern "C" {
#endif

#include "backend.h"
#include "kernel_family.h"

/* One meshd stream: a CUDA stream (non-blocking w.r.t. the legacy stream). */
struct backend_stream {
  cudaStream_t s;  /* NULL when emulated */
  void *blas;      /* cublasHandle_t bound to s, made by the first matmul (cuda_blas.c) */
  void *blas_ws;   /* its workspace (device), blas_ws_bytes */
  size_t blas_ws_bytes;
  struct backend_stream *prev, *next; /* cuda_state_t.streams, under mu */
};

typedef struct cuda_comms cuda_comms_t; /* NCCL communicators (cuda_nccl.c) */

/* backend_t.impl of the cuda backend. */
typedef struct cuda_state {
  bool emulated;
  int device;                /* CUDA ordinal; -1 emulated */
  char name[64];             /* "NVIDIA H200 (cuda:0, sm_90)" or "cuda:emulated" */
  int cc_major, cc_minor;
  cudaMemPool_t pool;        /* the device's pool, release threshold set at open */
  backend_stream_t own;      /* the backend's stream: NULL stream arguments (a Write's memory) */
  backend_stream_t release;  /* frees: it waits for every stream, so nothing else may wait on it */
  pthread_mutex_t mu;        /* guards streams and own's queue order across threads */
  backend_stream_t *streams; /* live streams (not `own`) */
  uint64_t rand_offset;      /* running offset of unseeded draws (philox.h); under mu */
  cuda_comms_t *comms;
  /* cuBLAS handles of ended streams, kept for the next streams' first matmul:
   * cublasDestroy synchronises the whole device (every session's work), so a
   * stream's end gives its handle here instead (cuda_blas.c; under its lock). */
  void *blas_idle[16];
  int blas_nidle;
  int comm_timeout_ms;       /* a collective or communicator that takes longer is aborted */
  bool lost;                 /* a sticky CUDA error was seen: the device is unusable */
  char lost_why[200];
} cuda_state_t;

static inline cuda_state_t *cuda_state(backend_t *b) { return (cuda_state_t *)b->impl; }

/* The stream a slot should use: s, or the backend's own for NULL. */
static inline backend_stream_t *cuda_stream_of(backend_t *b, backend_stream_t *s) {
  return s ? s : &cuda_state(b)->own;
}

/* Whether kernel call c runs on "cuda:emulated" (see the top of this file). */
static inline bool cuda_emulated(const kernel_call_t *c) { return cuda_state(c->b)->emulated; }

/* ---- cuda_device.c: errors, binding, scratch memory, copies ---- */

/* Makes st's device current on the calling thread (CUDA's current device is
 * per thread); every slot calls it first. No-op when emulated. */
void cuda_bind(cuda_state_t *st);

/* 0 for cudaSuccess; else -1 with e: QUOTA for cudaErrorMemoryAllocation, else
 * REMOTE_FAILURE "<what>: <CUDA error string>". Sticky errors (the context is
 * dead: launch failures, illegal addresses, ECC) also mark the state lost, which
 * the health slot reports. `st` may be NULL. */
int cuda_check(cuda_state_t *st, cudaError_t rc, const char *what, meshd_error_t *e);
/* Takes the device as lost (health turns NOT_SERVING and the agent exits):
 * why is kept for the reports; the first reason stays. */
void cuda_mark_lost(cuda_state_t *st, const char *why);

/* Device memory in stream order on bs (host memory when emulated), counted in
 * b->allocated against b->capacity: kernels' temporaries, and what the alloc
 * slot hands out. NULL when out of memory or past the capacity. The free is
 * queued on bs. */
void *cuda_scratch_alloc(backend_t *b, backend_stream_t *bs, size_t bytes);
void cuda_scratch_free(backend_t *b, backend_stream_t *bs, void *p, size_t bytes);

/* Device-to-device (or host, emulated) memcpy / memset in bs's order. */
int cuda_memcpy(backend_t *b, backend_stream_t *bs, void *dst, const void *src, size_t bytes,
                meshd_error_t *e);
int cuda_memset(backend_t *b, backend_stream_t *bs, void *dst, int value, size_t bytes,
                meshd_error_t *e);

/* ---- kernels: one entry per family (kernel_family.h), as the cpu backend's ---- */

/* cuda_kernel_fill ... cuda_kernel_gather (kernels_*.cu; matmul in cuda_blas.c).
 * They run on c->bs, which is never NULL. */
KERNEL_FAMILY_DECLARE(cuda_kernel_)

/* kernels_tensor.cu: dst = src cast to dst's dtype, src broadcast to dst's
 * shape (right-aligned), any strides on both; in bs's order. */
int cuda_copy_broadcast(backend_t *b, backend_stream_t *bs, agent_tensor_t *dst,
                        const agent_tensor_t *src, meshd_error_t *e);

/* kernels_reduce.cu: out[j] = op over k < n of in[k * count + j] (n slices of
 * count elements, contiguous), with reduction_t semantics identical to the cpu
 * data plane's (agent/dataplane/reduce_ops.c; RED_AVG divides the sum by n). For
 * reductions NCCL lacks. */
int cuda_reduce_slices(backend_t *b, backend_stream_t *bs, const void *in, void *out, size_t n,
                       size_t count, dtype_t dtype, reduction_t op, meshd_error_t *e);

/* cuda_nccl.c: the communicator cache (the slots are in cuda_nccl.h). */
cuda_comms_t *cuda_comms_create(void);
/* Aborts and frees every communicator. */
void cuda_comms_destroy(cuda_comms_t *c);

#ifdef __cplusplus
}
#endif

#endif
