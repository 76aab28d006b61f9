/* Named device meshes: an NDSlice of world ranks with a name per dim.
 *
 * A root mesh ({host: 2, gpu: 4}) takes world ranks 0..k-1 (k = product of the
 * sizes) as a dense row-major slice; a sub-mesh comes from mesh_slice, where an
 * index drops its dim and a range keeps it (Monarch's DeviceMesh.slice).
 * Meshes are plain values (no pointers): copy them freely. Errors name the
 * command (CreateMesh / SliceMesh), the dim and what would fix it. */
#ifndef MESHD_MESH_H
#define MESHD_MESH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "error_kind.h"
#include "ndslice.h"

#define MESH_DIM_NAME_MAX 31

typedef struct mesh {
  uint64_t ref;
  int ndim; /* == slice.ndim */
  char names[NDSLICE_MAX_DIMS][MESH_DIM_NAME_MAX + 1];
  ndslice_t slice;
  /* The smallest capacity (bytes) an agent of the mesh registered with, as
   * the server saw it when the mesh was made (commands.c). 0: unknown, no
   * limit. A slice starts with its parent's. */
  uint64_t rank_capacity;
  /* Agent losses the pool had counted when the root mesh was made (a slice
   * keeps its parent's): a rank of it lost later breaks the mesh (commands.c
   * refuses its commands with AGENT_LOST). */
  uint64_t losses_seen;
} mesh_t;

/* One dim of a SliceMesh (the MeshSelector message). */
typedef struct mesh_selector {
  const char *dim;
  bool is_range; /* false: `index` fixes and drops the dim */
  int64_t index; /* -size..size-1 */
  int64_t start; /* Python slice rules: negative counts from the end */
  int64_t stop;  /* used when has_stop; clamped to the dim size */
  bool has_stop; /* false: to the end (Range.has_stop) */
  int64_t step;  /* given (has_step or nonzero): 1..the dim's size; else 1 */
  bool has_step; /* Range.has_step: a step of 0 was given */
} mesh_selector_t;

/* Root mesh over world ranks 0..k-1. names[i] must be identifiers
 * ([A-Za-z_][A-Za-z0-9_]*, at most 31 chars) and unique (BAD_DIM otherwise);
 * sizes >= 1; 1..8 dims. healthy_by_rank[r] (r < world) says whether rank r has
 * a healthy agent; every rank of the mesh must. Returns 0, or -1 with err. */
int mesh_create_root(uint64_t ref, const char *const names[], const int64_t sizes[], int ndim,
                     const bool *healthy_by_rank, size_t world, mesh_t *out, meshd_error_t *err);

/* mesh_create_root for a session that must avoid drained ranks:
 * drained_by_rank[r] (r < world; NULL: none is) marks them. When no rank of
 * 0..k-1 is drained this is mesh_create_root. Otherwise the mesh takes the
 * lowest run of k consecutive ranks o..o+k-1 that are all healthy and not
 * drained (a dense slice at offset o); with no such run, QUOTA naming the
 * drained ranks. */
int mesh_create_placed(uint64_t ref, const char *const names[], const int64_t sizes[], int ndim,
                       const bool *healthy_by_rank, const bool *drained_by_rank, size_t world,
                       mesh_t *out, meshd_error_t *err);

/* The dim's position, or -1. */
int mesh_find_dim(const mesh_t *m, const char *name);

/* 0 when a result of per_rank bytes on every rank fits in the mesh's
 * rank_capacity; else -1 with QUOTA naming the command, both sizes and what
 * to do. Checked before a command is accepted, so nothing runs for it. */
int mesh_check_capacity(const mesh_t *m, const char *cmd, uint64_t per_rank, meshd_error_t *err);

/* Applies the selectors in order to parent; each names a dim of parent at most
 * once. out may be parent. Returns 0, or -1 with err (BAD_DIM for unknown or
 * repeated dims, BAD_ARGUMENT for positions, steps below 1 or above the dim's
 * size, empty or non-rectangular results). No selectors copies the parent
 * under the new ref. */
int mesh_slice(const mesh_t *parent, uint64_t ref, const mesh_selector_t *sel, size_t nsel,
               mesh_t *out, meshd_error_t *err);

/* Number of ranks. */
size_t mesh_len(const mesh_t *m);
/* World ranks in row-major order into out[mesh_len(m)]; returns the count. */
size_t mesh_ranks(const mesh_t *m, uint32_t *out);
bool mesh_contains(const mesh_t *m, uint32_t rank);
/* Coordinate of world rank along dim, or -1 if the rank is not in the mesh or
 * dim is out of range. */
int64_t mesh_coord(const mesh_t *m, uint32_t rank, int dim);
/* "{host: 2, gpu: 4}" ("{}" for no dims), truncated to len. Returns buf. */
char *mesh_format(const mesh_t *m, char *buf, size_t len);

#endif
