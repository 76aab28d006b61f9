/* In-process stand-ins for the cuBLAS and CUDA runtime calls cuda_blas.c makes
 * and for the cuda backend pieces it calls (fake_cublas_cuda.c), so that its
 * cuBLAS path runs without a GPU (test_cuda_blas_mock_gpu.c).
 *
 * The GEMM follows cuBLAS's column-major contract: it checks every argument
 * cuBLAS checks (leading dimensions, types against the compute type) and that
 * each operand's whole extent lies inside one device allocation, then
 * multiplies on the host in double. "Device memory" is host memory from
 * fake_dev_alloc. Process-wide state: Criterion runs each test in its own
 * process. */
#ifndef MESHD_TEST_FAKE_CUBLAS_CUDA_H
#define MESHD_TEST_FAKE_CUBLAS_CUDA_H

#include <stdatomic.h>
#include <stddef.h>

#include <cublas_v2.h>

#include "fake_device_memory.h"

typedef struct {
  int handles_live, creates;     /* cublasCreate / Destroy */
  int scratch_live, scratch_allocs;
  int workspaces_live;           /* cudaMalloc'd and not freed */
  int device_syncs;              /* cudaMalloc / cudaFree / cublasDestroy: each synchronises the whole device */
  cudaStream_t last_free_stream; /* of the last cudaFreeAsync */
  int gemms;                     /* cublasGemmStridedBatchedEx calls */
  int functor_calls;             /* cuda_matmul_functor */
  int copy_calls;                /* cuda_copy_broadcast */
  int get_last_error_calls;      /* cudaGetLastError */
  cublasComputeType_t last_compute;
  cudaDataType last_type;
  cudaStream_t last_stream;      /* the handle's stream at the last GEMM */
  cublasMath_t last_math;        /* the handle's math mode at the last GEMM */
  size_t last_ws_bytes;          /* the handle's workspace at the last GEMM */
} fake_counters_t;
extern fake_counters_t fake;

/* Knobs, set by a test before it multiplies. */
extern cublasStatus_t fake_create_status; /* cublasCreate returns it */
extern cublasStatus_t fake_gemm_status;   /* the GEMM returns it (without computing) */
extern int fake_malloc_fails;             /* cudaMalloc fails with cudaErrorMemoryAllocation */
extern int fake_scratch_fails_after;      /* cuda_scratch_alloc returns NULL after this many (-1: never) */

#endif
