/* cuBLAS is opened on the first matmul that needs it (cuda/cuda_blas.c), not
 * when the agent starts: loading libcublasLt costs a process about 0.4 s of
 * CPU, which every agent of a cuda build, cpu agents included, used to pay.
 * The real library, no GPU needed: opening it runs no device code. */
#include <criterion/criterion.h>
#include <dlfcn.h>
#include <stdio.h>

#include <cublas_api.h>

#include "backend.h"
#include "cuda/cuda_blas.h"

static void *loaded_cublas(void) {
  char name[32];
  snprintf(name, sizeof name, "libcublas.so.%d", CUBLAS_VER_MAJOR);
  return dlopen(name, RTLD_NOW | RTLD_NOLOAD);
}

Test(cuda_blas_load, cublas_is_not_loaded_until_a_matmul_needs_it) {
  cr_assert_null(loaded_cublas(), "cuBLAS is loaded at start: is it linked again?");
  /* What an emulated agent does at start opens no cuBLAS either. */
  cr_assert_not_null(backend_for_device("cuda:emulated"));
  cr_assert_null(loaded_cublas());

  const char *why = "unset";
  cr_assert(cuda_blas_available(&why), "cuBLAS could not be opened: %s", why);
  cr_assert_str_eq(why, "");
  void *h = loaded_cublas();
  cr_assert_not_null(h, "cuda_blas_available said yes, but no libcublas is mapped");
  dlclose(h); /* the NOLOAD reference only */

  /* Once: the second call opens nothing more. */
  cr_assert(cuda_blas_available(NULL));
}
