/* Matrix products in the cuda backend: cuBLAS (cuda_blas.c) and the functor
 * matmul it falls back on (kernels_matmul.cu). Private to agent/cuda/. */
#ifndef MESHD_CUDA_BLAS_H
#define MESHD_CUDA_BLAS_H

#include "cuda_internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* matmul mm bmm with one thread per output element: dot products accumulated
 * in double (floating dtypes; float32 and the 16-bit floats rounded through
 * float, as the cpu's loop) or wrapping int64 (integers), in the cpu's order,
 * so the bits equal the cpu backend's non-BLAS path. Any strides, batch
 * broadcasting and 1-D operands as kernels_linalg.c. Runs on the GPU and
 * emulated. 0, or -1 with e. */
int cuda_matmul_functor(const kernel_call_t *c, meshd_error_t *e);

/* Whether cuBLAS could be opened (done once, on first call; cuda_blas.c says
 * where it looks). If not, *why (when why is not NULL) is the loader's reason. */
bool cuda_blas_available(const char **why);

/* Gives back the cuBLAS handle and workspace the first matmul on bs made
 * (bs->blas, bs->blas_ws): the workspace is freed in bs's order and its bytes
 * go back to b's count (the first matmul reserved them: --memory-bytes); the
 * handle is kept for another stream's first matmul (cublasDestroy would
 * synchronise the whole device). Nothing when there are none. The backend
 * calls it from stream_destroy (and for its own stream at close), after
 * syncing bs. */
void cuda_blas_release(backend_t *b, backend_stream_t *bs);

/* Destroys the handles kept by cuda_blas_release (at the backend's close). */
void cuda_blas_close(backend_t *b);

#ifdef __cplusplus
}
#endif

#endif
