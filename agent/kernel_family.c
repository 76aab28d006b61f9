#include "kernel_family.h"

#include <pthread.h>
#include <string.h>

#define MAX_OPS 256

static kernel_family_t by_id[MAX_OPS];
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void build(void) {
  static const struct {
    kernel_family_t family;
    const char *ops;
  } map[] = {
#define XX(name, kernel, ops, a, b) {KF_##name, ops},
      KERNEL_FAMILY_MAP(XX, _, _)
#undef XX
  };
  for (size_t k = 0; k < sizeof map / sizeof map[0]; k++) {
    const char *p = map[k].ops;
    while (*p) {
      size_t n = strcspn(p, " ");
      char name[OP_NAME_MAX];
      if (n < sizeof name) {
        memcpy(name, p, n);
        name[n] = '\0';
        const op_def_t *op = ops_find(name);
        if (op && op_id(op) >= 0 && op_id(op) < MAX_OPS) by_id[op_id(op)] = map[k].family;
      }
      p += n;
      p += strspn(p, " ");
    }
  }
}

kernel_family_t kernel_family_of(const op_def_t *op) {
  pthread_once(&once, build);
  int id = op ? op_id(op) : -1;
  return id >= 0 && id < MAX_OPS ? by_id[id] : KF_NONE;
}
