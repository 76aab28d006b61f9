/* Accepted commands -> agent instructions (agent.proto), one per involved rank,
 * queued on that agent's Execute link in command order. Never waits for agents.
 * The caller holds the session lock; objects records which ranks the session
 * touched so that its end can free them. */
#ifndef MESHD_EMIT_H
#define MESHD_EMIT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "frontend.h"
#include "meshd/v1/tensor_service.pb-c.h"
#include "objects.h"
#include "session.h"

/* Load: each rank's coordinate along l->shard and the server's URL policy. */
void emit_load(frontend_t *fe, session_t *s, objects_t *o, const mesh_t *mesh, const obj_t *t,
               const Meshd__V1__Load *l);
/* Literal: each rank its bytes (its slice of l->data with per_rank). */
void emit_literal(frontend_t *fe, session_t *s, objects_t *o, const mesh_t *mesh, const obj_t *t,
                  const Meshd__V1__Literal *l);
void emit_factory(frontend_t *fe, session_t *s, objects_t *o, const mesh_t *mesh, const obj_t *t,
                  const Meshd__V1__Factory *f);
void emit_call(frontend_t *fe, session_t *s, objects_t *o, const mesh_t *mesh,
               const Meshd__V1__Call *call, obj_t *const *inputs, size_t ninputs,
               obj_t *const *results, size_t nresults, const op_infer_t *inf);
/* A lower bound on the instruction bytes a Reduce over groups of `group`
 * ranks of the mesh sends, over all its ranks: every rank's instruction lists
 * its group's members. 0 when below `cap` by any count (no work done then). */
uint64_t emit_reduce_bytes_min(frontend_t *fe, const mesh_t *mesh, int64_t group, uint64_t cap);
/* target: the sub-mesh that keeps the result (Reduce.mesh), or NULL. */
void emit_reduce(frontend_t *fe, session_t *s, objects_t *o, const mesh_t *mesh,
                 const mesh_t *target, const Meshd__V1__Reduce *r, const obj_t *in,
                 const obj_t *res, const int *dims, int ndims);
#define EMIT_SECRET_LEN 32 /* the agents' DP_SECRET_LEN */

/* The secret the members of one group of comm_id (a Reduce's group, a
 * broadcast chain, one sender and its receiver) prove to each other on the
 * data plane: HMAC-SHA256(the session's comm_key, comm_id and the members'
 * ranks in order). Per group, not per comm: the groups of one Reduce and the
 * pairs of a ToMesh share a comm_id, and a member of one must not pass for a
 * member of another. Derived whenever needed, stored nowhere. false (and
 * zeros, which agents refuse) if OpenSSL fails or n > REDUCE_GROUP_MAX. */
bool emit_group_secret(const session_t *s, uint64_t comm_id, const uint32_t *ranks, size_t n,
                       uint8_t out[EMIT_SECRET_LEN]);
/* The pair secrets of member `me` of a group (Group.pair_secrets): n entries of
 * EMIT_SECRET_LEN bytes, entry i HMAC-SHA256(comm_key, "pair", comm_id, the
 * smaller and the larger of ranks[me] and ranks[i]), entry me zeros. Only the
 * two members of a pair get its secret, so no member can pass for another on
 * the data plane. false (out unspecified) if OpenSSL fails. */
bool emit_pair_secrets(const session_t *s, uint64_t comm_id, const uint32_t *ranks, size_t n,
                       size_t me, uint8_t *out);
/* EMIT_DATA_PLANE_PAIRS: the data plane feature (RegisterRequest.data_plane)
 * of agents that take Group.pair_secrets. */
#define EMIT_DATA_PLANE_PAIRS 1

/* A broadcast chain is one collective group with its source: a chain of n
 * destinations goes as emit_chain_pieces(n) chains, one after another, piece
 * k of emit_chain_piece_len(n, k) destinations: each group within
 * REDUCE_GROUP_MAX members, each piece (n >= 2) at least 2 destinations. */
size_t emit_chain_pieces(size_t n);
size_t emit_chain_piece_len(size_t n, size_t k);

void emit_to_mesh(frontend_t *fe, session_t *s, objects_t *o, const mesh_t *src, const mesh_t *dst,
                  const obj_t *in, const obj_t *res);
void emit_borrow(frontend_t *fe, session_t *s, objects_t *o, const obj_t *borrow, const obj_t *origin,
                 const obj_t *handle, bool drop);
/* Refs per DeleteRefs instruction. */
#define EMIT_DELETE_BATCH 256
/* The refs one command deletes (Drop, Release), gathered in its order: one
 * DeleteRefs per run of refs on one mesh and stream, at most
 * EMIT_DELETE_BATCH each, so a Drop of 256 tensors is one instruction per
 * rank, not 256 (Release: each ref lets go of its storage; the agent frees
 * it with its last ref). Start zeroed; emit_delete_flush sends the last run. */
typedef struct emit_deletes {
  uint64_t mesh, stream;
  size_t n;
  uint64_t refs[EMIT_DELETE_BATCH];
} emit_deletes_t;
void emit_delete_add(frontend_t *fe, session_t *s, objects_t *o, emit_deletes_t *d,
                     uint64_t mesh, uint64_t stream, uint64_t ref);
void emit_delete_flush(frontend_t *fe, session_t *s, objects_t *o, emit_deletes_t *d);
/* Adds every alias of t's storage (Drop) to d. */
void emit_drop(frontend_t *fe, session_t *s, objects_t *o, emit_deletes_t *d, const obj_t *t);
/* StatusRequest to every rank the session touched; the seqs to wait for go to
 * ranks[]/seqs[] (capacity cap). Returns how many. */
size_t emit_status(frontend_t *fe, session_t *s, objects_t *o, uint32_t *ranks, uint64_t *seqs,
                   size_t cap);
/* EndSession to every rank the session touched. */
void emit_end_session(frontend_t *fe, session_t *s, objects_t *o);

/* PeerLost to every other rank the session touched: their work for it that
 * needs lost_rank fails at once instead of waiting for it. */
void emit_peer_lost(frontend_t *fe, session_t *s, objects_t *o, uint32_t lost_rank,
                    const char *data_address, const char *reason);

#endif
