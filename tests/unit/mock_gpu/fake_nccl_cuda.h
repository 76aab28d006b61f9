/* In-process stand-ins for NCCL, the CUDA runtime calls cuda_nccl.c makes, the
 * data plane (dp_send / dp_recv) and the cuda backend helpers it calls
 * (cuda_device.c's, and cuda_reduce_slices; fake_nccl_cuda.c), so that cuda_nccl.c's real-device path runs without a GPU
 * (test_cuda_nccl_mock_gpu.c). Agents are threads of one process.
 *
 * "Device memory" is host memory registered by fake_dev_alloc; NCCL calls and
 * device copies abort the process when handed anything else, which is how the
 * suite proves that host buffers are staged. Collectives complete when every
 * member of the clique has posted the same op (its n-th), as NCCL's kernels do;
 * a finalize once every member has called ncclCommFinalize (nccl.h: "globally
 * quiescent"), so that members finalizing in different orders would wait on
 * each other.
 * Counters are process-wide; Criterion runs each test in its own process. */
#ifndef MESHD_TEST_FAKE_NCCL_CUDA_H
#define MESHD_TEST_FAKE_NCCL_CUDA_H

#include <stdatomic.h>
#include <stddef.h>

#include <stdint.h>

#include <nccl.h>

#include "fake_device_memory.h"

#include "dataplane/dataplane.h"

/* The fake data plane of one agent: its rank and how long dp_recv waits. */
struct dataplane {
  uint32_t rank;
  int timeout_ms;
};

/* The only device the suite's agents use; NCCL init checks it is current. */
#define FAKE_DEVICE 1

/* The most members a fake communicator has. */
#define FAKE_MAX_RANKS 8

/* Frees data-plane messages nobody received (end of a test). */
void fake_dp_drain(void);

typedef struct {
  atomic_int ids, inits, aborts, destroys, finalizes; /* NCCL calls */
  atomic_int comms_live;                              /* inited, not aborted nor destroyed */
  atomic_int streams_live, events_live;               /* CUDA objects */
  atomic_int scratch_live;                            /* cuda_scratch_alloc not yet freed */
  atomic_int native_ops, gather_ops, p2p_ops;         /* ncclAllReduce/ReduceScatter, AllGather, Send/Recv */
  atomic_int reduce_ops, broadcast_ops;               /* ncclReduce, ncclBroadcast (rooted) */
  atomic_int p2p_bytes_in[FAKE_MAX_RANKS];            /* bytes ncclRecv delivered, per NCCL rank */
  atomic_int reduce_slices;                           /* cuda_reduce_slices */
  atomic_int memcpy_calls;                            /* cuda_memcpy */
  atomic_int dp_collectives; /* dp_allreduce .. dp_broadcast (emulated path) */
  atomic_int dp_refusals;    /* dp_refuse */
  atomic_int dp_watches;     /* dp_watch_begin: NCCL waits that watch for a refusal */
  atomic_int marked_lost;    /* cuda_mark_lost */
  atomic_int stream_waits;   /* cudaStreamWaitEvent */
} fake_counters_t;
extern fake_counters_t fake;

/* Knobs, set by a test before its agents start. */
extern atomic_int fake_never_join;     /* communicator init never completes */
extern atomic_int fake_init_error;     /* init completes with this ncclResult_t (0: none) */
extern atomic_int fake_op_error;       /* posted ops never complete; async error = this */
extern atomic_int fake_finalize_hangs; /* ncclCommFinalize never completes (else: once every
                                          member has called it) */
extern atomic_int fake_stream_busy;    /* cudaStreamQuery: never drained (NotReady) */
extern atomic_int fake_hold_rank1_inits; /* NCCL rank 1's inits do not complete while set
                                            (orders when members' communicators are made) */

#endif
