/* The cuda backend's communicator slots (backend.h: allreduce .. session_end)
 * and the pure planning function behind them (cuda_nccl.c).
 *
 * Emulated devices delegate every slot to the TCP data plane (b->net), as the
 * cpu backend does. Real devices use NCCL: communicators are made lazily,
 * bootstrapped over b->net (member 0 makes the unique id and sends it to the
 * others on a channel derived from comm_id), cached per (session, comm_id,
 * members and their addresses), and aborted on failure or timeout
 * (cuda_state_t.comm_timeout_ms) so that the agent keeps serving. */
#ifndef MESHD_CUDA_NCCL_H
#define MESHD_CUDA_NCCL_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* How a reduction of `dtype` by `op` runs on NCCL. */
typedef enum {
  CUDA_PLAN_INVALID = 0, /* op is not defined on dtype (bitwise on floats, avg on bool) */
  CUDA_PLAN_NATIVE,      /* one NCCL reduction: nccl_dtype, nccl_op */
  CUDA_PLAN_GATHER,      /* move raw bytes (allgather / alltoall), then cuda_reduce_slices */
} cuda_plan_kind_t;

typedef struct cuda_nccl_plan {
  cuda_plan_kind_t kind;
  int nccl_dtype; /* ncclDataType_t when NATIVE, else -1 */
  int nccl_op;    /* ncclRedOp_t when NATIVE, else -1 */
} cuda_nccl_plan_t;

/* The plan for a reduction; semantics always those of agent/dataplane/reduce_ops.c
 * and its dtype rules core/tensor/reduction.h's (avg floating only). int16 and
 * bool have no NCCL type, bitwise ops no NCCL op, and NCCL's float min/max may
 * drop a NaN: those gather and reduce locally. */
cuda_nccl_plan_t cuda_nccl_plan(dtype_t dtype, reduction_t op);

/* The slots (backend.h). s may be NULL: the backend's own stream. */
int cuda_allreduce(backend_t *b, backend_stream_t *s, const dp_group_t *g, void *buf, size_t count,
                   dtype_t dtype, reduction_t op, meshd_error_t *err);
int cuda_reduce_scatter(backend_t *b, backend_stream_t *s, const dp_group_t *g, const void *in,
                        void *out, size_t count, dtype_t dtype, reduction_t op, meshd_error_t *err);
int cuda_allgather(backend_t *b, backend_stream_t *s, const dp_group_t *g, const void *in, void *out,
                   size_t count, dtype_t dtype, meshd_error_t *err);
int cuda_alltoall(backend_t *b, backend_stream_t *s, const dp_group_t *g, const void *in, void *out,
                  size_t count, dtype_t dtype, meshd_error_t *err);
/* Rooted (backend.h's reduce_root, gather_root, broadcast): `root` is an
 * index of g. reduce: ncclReduce in place on buf (a plan without a native
 * NCCL reduction gathers the raw bytes to the root, as cuda_gather_root, and
 * reduces there); only the root's buf changes. gather: a grouped send of
 * every member's `in` (count elements) to the root, which receives member i's
 * at slice i of `out` (n * count); the others' out is not touched (may be
 * NULL). broadcast: ncclBroadcast of member 0's buf (bytes) to every member,
 * on the group's communicator. */
int cuda_reduce_root(backend_t *b, backend_stream_t *s, const dp_group_t *g, size_t root,
                     void *buf, size_t count, dtype_t dtype, reduction_t op, meshd_error_t *err);
int cuda_gather_root(backend_t *b, backend_stream_t *s, const dp_group_t *g, size_t root,
                     const void *in, void *out, size_t count, dtype_t dtype, meshd_error_t *err);
int cuda_broadcast(backend_t *b, backend_stream_t *s, const dp_group_t *g, void *buf, size_t bytes,
                   meshd_error_t *err);
/* backend_ops_t.refuse: drops the cached communicator of the refused call (a
 * GPU's: the peers drop theirs), then the data plane's refusal, which reaches
 * peers waiting on the data plane (cuda:emulated, the NCCL bootstrap) and
 * peers waiting in NCCL, which watch the data plane meanwhile (dp_watch). */
void cuda_refuse(backend_t *b, const dp_group_t *g, dp_refuse_t what, uint64_t calls,
                   const char *why);
int cuda_send(backend_t *b, backend_stream_t *s, uint64_t session, uint64_t comm_id,
              uint64_t call, const uint8_t *secret, uint32_t to_rank, const char *addr, const void *buf,
              size_t bytes, meshd_error_t *err);
int cuda_recv(backend_t *b, backend_stream_t *s, uint64_t session, uint64_t comm_id,
              uint64_t call, const uint8_t *secret, uint32_t from_rank, const char *addr, void *buf, size_t bytes,
              meshd_error_t *err);
/* Destroys (or, when that errs or takes past comm_timeout_ms, aborts) every
 * communicator of the session: all finalized at once, then polled together,
 * since each finalize waits for the peers' (they may hold them in another
 * order). One in use by a call is aborted when that call lets it go. */
void cuda_session_end(backend_t *b, uint64_t session);
/* backend_ops_t.peer_lost: the session's communicators with `rank` are
 * flagged; the thread using one aborts it at once (AGENT_LOST). */
void cuda_peer_lost(backend_t *b, uint64_t session, uint32_t rank);

#ifdef __cplusplus
}
#endif

#endif
