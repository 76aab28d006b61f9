/* Monarch's InputChecker: every tensor a command reads or writes must be live,
 * on the command's mesh and stream, and have the access the command needs.
 * Failed tensors pass (their dependents fail at run time, DEPENDENT_FAILURE). */
#ifndef MESHD_CHECKS_H
#define MESHD_CHECKS_H

#include "objects.h"

typedef struct tensor_use {
  obj_t *t;
  const char *what;  /* "argument 'self'", "input", "out" */
  bool write;        /* mutated in place */
} tensor_use_t;

/* `cmd` names the command for messages ("Call add", "Reduce"). *mesh is the
 * mesh the command runs on: 0 on entry means "the first tensor's mesh" and is
 * filled in. `stream` is the stream it runs on (0 = main). */
int check_uses(objects_t *o, const char *cmd, const tensor_use_t *uses, size_t n, uint64_t *mesh,
               uint64_t stream, meshd_error_t *e);

/* A tensor reference that must be live (not dropped); UNKNOWN_REF / DROPPED. */
obj_t *check_tensor(objects_t *o, const char *cmd, const char *what, uint64_t ref,
                    meshd_error_t *e);

#endif
