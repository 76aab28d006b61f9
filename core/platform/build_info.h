/* What this binary is: version, source commit, build type, whether the cuda
 * backend was built. Filled in at configure time (build_info.c.in); read by
 * --version, the GetInfo RPC and meshd_build_info. */
#ifndef MESHD_BUILD_INFO_H
#define MESHD_BUILD_INFO_H

#include <stdbool.h>
#include <stdio.h>

typedef struct build_info {
  const char *version;    /* VERSION, e.g. "0.1.0" */
  const char *commit;     /* `git rev-parse --short=12 HEAD` at configure time, or "unknown" */
  const char *build_type; /* CMAKE_BUILD_TYPE, e.g. "Release" */
  bool cuda;              /* the cuda backend is built into this tree */
} build_info_t;

const build_info_t *build_info(void);

/* "PROG 0.1.0 (commit 0123abcd4567, Release, cuda backend: no)\n" to out: what
 * --version prints. */
void build_info_print(FILE *out, const char *prog);

#endif
