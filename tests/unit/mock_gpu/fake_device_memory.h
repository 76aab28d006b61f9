/* "Device memory" for the mock-GPU suites: host memory registered on
 * allocation, so that a fake CUDA, NCCL or cuBLAS call can check that a pointer
 * it is handed lies inside one device allocation (and abort when it does not:
 * the test that provoked it fails as crashed). Thread-safe. */
#ifndef MESHD_TEST_FAKE_DEVICE_MEMORY_H
#define MESHD_TEST_FAKE_DEVICE_MEMORY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

/* Aborts with the broken condition named: a fake's contract was broken. */
#define REQUIRE(cond)                                                                   \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      fprintf(stderr, "%s:%d: fake contract broken: %s\n", __FILE__, __LINE__, #cond); \
      abort();                                                                          \
    }                                                                                   \
  } while (0)

/* Zeroed memory of `bytes` (at least 1), registered as device memory. */
void *fake_dev_alloc(size_t bytes);
/* Unregisters and frees; aborts for memory never allocated, or freed twice. */
void fake_dev_free(void *p);
/* Whether [p, p + bytes) lies inside one live device allocation. */
bool fake_is_dev(const void *p, size_t bytes);
/* Device allocations not freed yet. */
int fake_dev_live(void);

#endif
