/* The cuda backend's device helpers (cuda_internal.h): CUDA errors mapped to
 * meshd's and the sticky ones that mark the device lost, binding the device to
 * the calling thread, stream-ordered device memory counted against the
 * capacity, and device copies. The kernels, cuda_blas.c, cuda_nccl.c and the
 * vtable (cuda_backend.c) all call down to here; this file calls none of them.
 * Emulated ("cuda:emulated"): host memory and host copies, no CUDA call. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"
#include "log.h"

/* ------------------------------------------------------------------ errors */

static bool sticky(cudaError_t rc) {
  switch (rc) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorECCUncorrectable:
    case cudaErrorDevicesUnavailable:
    case cudaErrorUnknown:
    case cudaErrorContextIsDestroyed:
    case cudaErrorLaunchTimeout:
      return true;
    default:
      return false;
  }
}

int cuda_check(cuda_state_t *st, cudaError_t rc, const char *what, meshd_error_t *e) {
  if (rc == cudaSuccess) return 0;
  if (rc == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError(); /* not sticky: clear it for this thread */
    return error_set(e, ERR_QUOTA, "%s: out of device memory", what);
  }
  if (st && sticky(rc)) {
    char why[sizeof st->lost_why];
    snprintf(why, sizeof why, "%s: %s (%s)", what, cudaGetErrorString(rc), cudaGetErrorName(rc));
    cuda_mark_lost(st, why);
  }
  return error_set(e, ERR_REMOTE_FAILURE, "%s: %s (%s)", what, cudaGetErrorString(rc),
                   cudaGetErrorName(rc));
}

void cuda_mark_lost(cuda_state_t *st, const char *why) {
  pthread_mutex_lock(&st->mu);
  if (!st->lost) {
    st->lost = true;
    snprintf(st->lost_why, sizeof st->lost_why, "%s", why);
  }
  pthread_mutex_unlock(&st->mu);
}

void cuda_bind(cuda_state_t *st) {
  static _Thread_local int bound = -1;
  if (st->emulated || bound == st->device) return;
  if (cudaSetDevice(st->device) == cudaSuccess) bound = st->device;
}

/* ------------------------------------------------------------------ memory */

#define EMU_ALIGN 256

static void *raw_alloc(backend_t *b, backend_stream_t *bs, size_t bytes) {
  cuda_state_t *st = cuda_state(b);
  if (!bytes) bytes = 1;
  if (st->emulated) {
    size_t rounded = (bytes + EMU_ALIGN - 1) / EMU_ALIGN * EMU_ALIGN;
    return rounded >= bytes ? aligned_alloc(EMU_ALIGN, rounded) : NULL;
  }
  cuda_bind(st);
  void *p = NULL;
  cudaError_t rc = cudaMallocFromPoolAsync(&p, bytes, st->pool, bs->s);
  if (rc != cudaSuccess) {
    (void)cudaGetLastError();
    return NULL;
  }
  return p;
}

void *cuda_scratch_alloc(backend_t *b, backend_stream_t *bs, size_t bytes) {
  if (!backend_reserve(b, bytes)) return NULL;
  void *p = raw_alloc(b, bs, bytes);
  if (!p) backend_unreserve(b, bytes);
  return p;
}

void cuda_scratch_free(backend_t *b, backend_stream_t *bs, void *p, size_t bytes) {
  if (!p) return;
  cuda_state_t *st = cuda_state(b);
  if (st->emulated) {
    free(p);
  } else {
    cudaError_t rc = cudaFreeAsync(p, bs->s);
    if (rc != cudaSuccess) { /* still held: it stays counted, or the pool would overcommit */
      meshd_error_t e;
      cuda_check(st, rc, "free", &e);
      log_warn("cuda", "cannot free %zu bytes of device memory: %s", bytes, e.msg);
      return;
    }
  }
  backend_unreserve(b, bytes);
}

int cuda_memcpy(backend_t *b, backend_stream_t *bs, void *dst, const void *src, size_t bytes,
                meshd_error_t *e) {
  cuda_state_t *st = cuda_state(b);
  if (!bytes || dst == src) return 0;
  if (st->emulated) {
    memmove(dst, src, bytes);
    return 0;
  }
  return cuda_check(st, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, bs->s),
                    "device copy", e);
}

int cuda_memset(backend_t *b, backend_stream_t *bs, void *dst, int value, size_t bytes,
                meshd_error_t *e) {
  cuda_state_t *st = cuda_state(b);
  if (!bytes) return 0;
  if (st->emulated) {
    memset(dst, value, bytes);
    return 0;
  }
  return cuda_check(st, cudaMemsetAsync(dst, value, bytes, bs->s), "device memset", e);
}
