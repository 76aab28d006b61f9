/* Per-session state on an agent: the ref table (ref -> local tensor or the
 * error that took its place) and the storages behind the tensors.
 *
 * Storages are refcounted: every table slot and every in-flight use holds one
 * reference; the last release frees the device memory (the backend's alloc
 * and free keep its `allocated` counter and enforce its capacity).
 * Thread-safe: the stream workers of one session share its table. */
#ifndef MESHD_AGENT_REFS_H
#define MESHD_AGENT_REFS_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "refmap.h"

/* A new storage of `bytes` bytes (at least 1 is allocated), first used on
 * stream s (NULL: ready for any stream; backend.h). NULL with err QUOTA
 * (RESOURCE_EXHAUSTED) when the backend refuses (out of memory or past its
 * capacity); `what` names the command for the message. */
agent_storage_t *storage_new(backend_t *b, backend_stream_t *s, size_t bytes, const char *what,
                             meshd_error_t *err);
void storage_retain(agent_storage_t *s);
/* NULL is a no-op. */
void storage_release(agent_storage_t *s);

/* A fresh contiguous tensor of meta's shape and dtype (meta's strides are
 * ignored: the result is row-major, offset 0). Returns 0 or -1 with err. */
int tensor_alloc(backend_t *b, backend_stream_t *s, const tensor_meta_t *meta, agent_tensor_t *out,
                 const char *what, meshd_error_t *err);
/* Bytes a tensor of this shape holds when contiguous. */
size_t tensor_nbytes(const tensor_meta_t *m);

/* The table keeps, per ref, its storage (or its failure) and its dtype and
 * layout packed (meta_pack.h): about 44 bytes for a 1-D tensor, plus the
 * storage (refs.c) and its bytes. */
typedef struct refs {
  pthread_mutex_t mu;
  refmap_t map; /* ref_slot records by ref */
  /* Refs deleted while not defined here (the server undid a failed transfer
   * before its Write finished): a Write may not define them after (the
   * REFS_UNDONE_MAX latest, oldest first; refs only increase, so no later
   * command reuses one). */
  uint64_t *undone;
  size_t nundone, undone_cap;
} refs_t;

#define REFS_UNDONE_MAX 4096

/* What a failed ref carries: the root failure it stands for. */
typedef struct ref_failure {
  error_kind_t kind; /* REMOTE_FAILURE, DEPENDENT_FAILURE, QUOTA */
  uint64_t root_seq; /* Execute seq of the root failure */
  uint64_t root_ref; /* the root's first result */
  /* Failed because another ref of its storage failed (fail_sharing_locked):
   * reported for that ref, not for this one. */
  bool by_sharing;
  char msg[600];
} ref_failure_t;

void refs_init(refs_t *r);
/* Releases every slot. */
void refs_clear(refs_t *r);
/* 0: *out is the tensor with its storage retained (storage_release it);
 * 1: the ref failed, *why says how (when why is not NULL);
 * -1: no such ref. */
int refs_get(refs_t *r, uint64_t ref, agent_tensor_t *out, ref_failure_t *why);
/* Defines or redefines ref as t (its storage is retained by the table). */
int refs_put(refs_t *r, uint64_t ref, const agent_tensor_t *t);
/* Defines or redefines ref as failed. */
int refs_fail(refs_t *r, uint64_t ref, const ref_failure_t *why);
/* refs_put for a Write: 2 (nothing defined) when ref was deleted before it. */
int refs_put_write(refs_t *r, uint64_t ref, const agent_tensor_t *t);
/* A failed ref's failure is no longer by_sharing: the server knows of it
 * (a borrow of it was taken after it failed: not the borrow's to report). */
void refs_told(refs_t *r, uint64_t ref);
void refs_delete(refs_t *r, uint64_t ref);
size_t refs_count(refs_t *r);

#endif
