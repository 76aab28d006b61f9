/* Which backend serves a device name: one table for the agent's --device
 * check, its messages and the tests. */
#include <stdlib.h>
#include <string.h>

#include "backend.h"

static bool is_cpu(const char *d) { return !strcmp(d, "cpu"); }

#ifdef MESHD_HAVE_CUDA
/* "cuda:emulated", or "cuda:N" with N a decimal ordinal. */
static bool is_cuda(const char *d) {
  if (strncmp(d, "cuda:", 5) != 0) return false;
  const char *n = d + 5;
  if (!strcmp(n, "emulated")) return true;
  if (!*n || strlen(n) > 4) return false;
  for (; *n; n++)
    if (*n < '0' || *n > '9') return false;
  return true;
}
#endif

static const struct {
  bool (*match)(const char *device);
  const backend_ops_t *ops;
} backends[] = {
    {is_cpu, &cpu_backend_ops},
#ifdef MESHD_HAVE_CUDA
    {is_cuda, &cuda_backend_ops},
#endif
};

const backend_ops_t *backend_for_device(const char *device) {
  if (!device) return NULL;
  for (size_t i = 0; i < sizeof backends / sizeof backends[0]; i++)
    if (backends[i].match(device)) return backends[i].ops;
  return NULL;
}

const char *backend_devices_supported(void) {
#ifdef MESHD_HAVE_CUDA
  return "cpu, cuda:N, cuda:emulated";
#else
  return "cpu (this build has no cuda backend)";
#endif
}
