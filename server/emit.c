#include "emit.h"

#include <stdlib.h>
#include <string.h>

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "log.h"
#include "meshd/agent/v1/agent.pb-c.h"
#include "reduction.h"

typedef Meshd__Agent__V1__Instruction instr_t;
typedef Meshd__Agent__V1__TensorSpec spec_t;

#define EMIT_ADDR_MAX 288 /* "host:port" of a data plane */

/* A TensorSpec with room for its shape and strides. */
typedef struct spec_buf {
  spec_t sp;
  int64_t dims[2 * LAYOUT_MAX_DIMS];
} spec_buf_t;

static spec_t *spec_of(spec_buf_t *b, const obj_t *t) {
  spec_t *sp = &b->sp;
  tensor_meta_t m;
  obj_meta(t, &m);
  size_t n = (size_t)m.layout.ndim;
  meshd__agent__v1__tensor_spec__init(sp);
  sp->ref = t->ref;
  sp->n_shape = sp->n_strides = n;
  sp->shape = b->dims;
  sp->strides = b->dims + n;
  memcpy(sp->shape, m.layout.sizes, n * sizeof *sp->shape);
  memcpy(sp->strides, m.layout.strides, n * sizeof *sp->strides);
  sp->storage_offset = m.layout.offset;
  sp->dtype = (Meshd__V1__DType)m.dtype;
  sp->storage = t->tensor.storage->id;
  return sp;
}

static void init_instr(instr_t *ins, session_t *s, uint64_t stream) {
  meshd__agent__v1__instruction__init(ins);
  ins->session_id = s->id;
  ins->stream = stream;
  /* the client command it is part of: the agent's failures name it */
  const objects_t *o = s->objects;
  ins->command_seq = o ? o->current_seq : 0;
}

/* Queues a packed instruction (owned; NULL: it did not pack) on rank's link and
 * records it in the session: its seq, and its bytes for flow control. Returns
 * the seq, 0 if it was not sent. */
static uint64_t push(frontend_t *fe, objects_t *o, uint32_t rank, agent_link_msg_t *m) {
  size_t len = m ? agent_link_msg_len(m) : 0;
  uint64_t seq = 0;
  /* Touched first, or not sent: an untouched rank never gets EndSession, and
   * the session would stay open on it. */
  if (!objects_touch(o, rank)) {
    if (m) agent_link_msg_free(m);
    return 0;
  }
  if (agent_pool_send_msg(fe->pool, rank, m, &seq) != 0) return 0;
  objects_sent(o, rank, seq, len);
  return seq;
}

static void warn_dropped(uint32_t rank, const char *session) {
  log_warn("emit", "no live link to rank %u: instruction for session %s dropped (the agent is "
           "gone; its tensors will report AGENT_LOST)", rank, session);
}

static void send_to(frontend_t *fe, objects_t *o, uint32_t rank, instr_t *ins) {
  if (!push(fe, o, rank, agent_link_pack(ins))) warn_dropped(rank, ins->session_id);
}

/* The mesh's world ranks (malloc'd, row-major); NULL on OOM. */
static uint32_t *ranks_of(const mesh_t *mesh, size_t *n) {
  *n = mesh_len(mesh);
  uint32_t *r = malloc(sizeof *r * (*n ? *n : 1));
  if (r) mesh_ranks(mesh, r);
  return r;
}

/* The same instruction to every rank of the mesh: packed once, copied per rank. */
static void send_to_mesh(frontend_t *fe, objects_t *o, const mesh_t *mesh, instr_t *ins) {
  size_t n;
  uint32_t *ranks = ranks_of(mesh, &n);
  agent_link_msg_t *packed = agent_link_pack(ins);
  for (size_t i = 0; ranks && i < n; i++) {
    agent_link_msg_t *m = packed ? agent_link_msg_clone(packed) : NULL;
    if (!push(fe, o, ranks[i], m)) warn_dropped(ranks[i], ins->session_id);
  }
  agent_link_msg_free(packed);
  free(ranks);
}

void emit_factory(frontend_t *fe, session_t *s, objects_t *o, const mesh_t *mesh, const obj_t *t,
                  const Meshd__V1__Factory *f) {
  instr_t ins;
  init_instr(&ins, s, f->stream);
  Meshd__Agent__V1__FactoryOp op = MESHD__AGENT__V1__FACTORY_OP__INIT;
  spec_buf_t result;
  op.factory = (Meshd__V1__Factory *)f;
  op.result = spec_of(&result, t);
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_FACTORY;
  ins.factory = &op;
  int dim = f->dim && *f->dim ? mesh_find_dim(mesh, f->dim) : -1;
  size_t n;
  uint32_t *ranks = ranks_of(mesh, &n);
  for (size_t i = 0; ranks && i < n; i++) {
    /* Each rank's own coordinate (rank(dim)) and position (its RNG stream). */
    op.coordinate = dim >= 0 ? mesh_coord(mesh, ranks[i], dim) : 0;
    op.mesh_rank = (uint32_t)i;
    send_to(fe, o, ranks[i], &ins);
  }
  free(ranks);
}

void emit_literal(frontend_t *fe, session_t *s, objects_t *o, const mesh_t *mesh, const obj_t *t,
                  const Meshd__V1__Literal *l) {
  instr_t ins;
  init_instr(&ins, s, l->stream);
  Meshd__Agent__V1__LiteralOp op = MESHD__AGENT__V1__LITERAL_OP__INIT;
  spec_buf_t result;
  op.result = spec_of(&result, t);
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_LITERAL;
  ins.literal = &op;
  if (!l->per_rank) {
    op.data = l->data;
    send_to_mesh(fe, o, mesh, &ins);
    return;
  }
  size_t n;
  uint32_t *ranks = ranks_of(mesh, &n);
  size_t each = n ? l->data.len / n : 0; /* checked: n slices of exactly this size */
  for (size_t i = 0; ranks && i < n; i++) {
    op.data = (ProtobufCBinaryData){each, each ? l->data.data + i * each : NULL}; /* (NULL when empty) */
    send_to(fe, o, ranks[i], &ins);
  }
  free(ranks);
}

void emit_load(frontend_t *fe, session_t *s, objects_t *o, const mesh_t *mesh, const obj_t *t,
               const Meshd__V1__Load *l) {
  instr_t ins;
  init_instr(&ins, s, l->stream);
  Meshd__Agent__V1__LoadOp op = MESHD__AGENT__V1__LOAD_OP__INIT;
  Meshd__Agent__V1__UrlPolicy policy;
  url_policy_to_proto(fe->urls, &policy);
  spec_buf_t result;
  op.load = (Meshd__V1__Load *)l;
  op.result = spec_of(&result, t);
  op.policy = &policy;
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_LOAD;
  ins.load = &op;
  int dim = l->shard && *l->shard ? mesh_find_dim(mesh, l->shard) : -1;
  op.parts = dim >= 0 ? mesh->slice.sizes[dim] : 1;
  size_t n;
  uint32_t *ranks = ranks_of(mesh, &n);
  for (size_t i = 0; ranks && i < n; i++) {
    op.coordinate = dim >= 0 ? mesh_coord(mesh, ranks[i], dim) : 0;
    op.rank = ranks[i];
    send_to(fe, o, ranks[i], &ins);
  }
  free(ranks);
}

void emit_call(frontend_t *fe, session_t *s, objects_t *o, const mesh_t *mesh,
               const Meshd__V1__Call *call, obj_t *const *inputs, size_t ninputs,
               obj_t *const *results, size_t nresults, const op_infer_t *inf) {
  spec_buf_t in_specs[64], out_specs[OP_MAX_RESULTS]; /* commands.c: at most 64 inputs */
  spec_t *in_ptrs[64], *out_ptrs[OP_MAX_RESULTS];
  uint64_t mutates[OP_MAX_RESULTS];
  if (ninputs > 64) ninputs = 64;
  for (size_t i = 0; i < ninputs; i++) in_ptrs[i] = spec_of(&in_specs[i], inputs[i]);
  for (size_t i = 0; i < nresults; i++) out_ptrs[i] = spec_of(&out_specs[i], results[i]);
  Meshd__Agent__V1__OpCall op = MESHD__AGENT__V1__OP_CALL__INIT;
  op.op = call->op;
  op.n_args = call->n_args;
  op.args = call->args;
  op.n_kwargs = call->n_kwargs;
  op.kwargs = call->kwargs;
  op.n_inputs = ninputs;
  op.inputs = in_ptrs;
  op.n_results = nresults;
  op.results = out_ptrs;
  size_t nm = 0;
  for (int i = 0; i < inf->nmutates && nm < OP_MAX_RESULTS; i++) mutates[nm++] = (uint64_t)inf->mutates[i];
  op.n_mutates = nm;
  op.mutates = mutates;
  instr_t ins;
  init_instr(&ins, s, call->stream);
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_CALL;
  ins.call = &op;
  send_to_mesh(fe, o, mesh, &ins);
}


/* HMAC-SHA256(s->comm_key, `len` bytes). false only if OpenSSL fails. */
static bool keyed(const session_t *s, const uint8_t *msg, size_t len, uint8_t out[32]) {
  unsigned int outlen = 32;
  return HMAC(EVP_sha256(), s->comm_key, sizeof s->comm_key, msg, len, out, &outlen) != NULL;
}

/* A stable id for a communicator of session s: keyed by the session's secret
 * key over `parts` (which clients choose), so that no client can steer its
 * comm_id onto another session's. Falls back to FNV-1a if OpenSSL fails. */
static uint64_t comm_id_of(const session_t *s, const uint64_t *parts, size_t n) {
  uint8_t msg[8 * 8], mac[32]; /* every part: a broadcast's fifth, its source, was left out */
  size_t len = 0;
  for (size_t i = 0; i < n && len + 8 <= sizeof msg; i++)
    for (int b = 0; b < 8; b++) msg[len++] = (uint8_t)(parts[i] >> (8 * b));
  uint64_t h = 1469598103934665603ull;
  if (keyed(s, msg, len, mac)) {
    memcpy(&h, mac, sizeof h);
    return h;
  }
  for (const char *p = s->id; *p; p++) h = (h ^ (uint8_t)*p) * 1099511628211ull;
  for (size_t i = 0; i < n; i++) h = (h ^ parts[i]) * 1099511628211ull;
  return h;
}

bool emit_group_secret(const session_t *s, uint64_t comm_id, const uint32_t *ranks, size_t n,
                       uint8_t out[EMIT_SECRET_LEN]) {
  uint8_t msg[8 + 4 * REDUCE_GROUP_MAX];
  size_t len = 0;
  for (int b = 0; b < 8; b++) msg[len++] = (uint8_t)(comm_id >> (8 * b));
  for (size_t i = 0; i < n && n <= REDUCE_GROUP_MAX; i++)
    for (int b = 0; b < 4; b++) msg[len++] = (uint8_t)(ranks[i] >> (8 * b));
  if (n <= REDUCE_GROUP_MAX && keyed(s, msg, len, out)) return true;
  memset(out, 0, EMIT_SECRET_LEN);
  log_error("emit", "session %.8s: cannot derive the data plane secret of comm %llu", s->id,
            (unsigned long long)comm_id);
  return false;
}

bool emit_pair_secrets(const session_t *s, uint64_t comm_id, const uint32_t *ranks, size_t n,
                       size_t me, uint8_t *out) {
  for (size_t i = 0; i < n; i++) {
    uint8_t *entry = out + i * EMIT_SECRET_LEN;
    if (i == me) {
      memset(entry, 0, EMIT_SECRET_LEN);
      continue;
    }
    uint32_t a = ranks[me] < ranks[i] ? ranks[me] : ranks[i], b = ranks[me] ^ ranks[i] ^ a;
    uint8_t msg[4 + 8 + 4 + 4] = {'p', 'a', 'i', 'r'};
    for (int k = 0; k < 8; k++) msg[4 + k] = (uint8_t)(comm_id >> (8 * k));
    for (int k = 0; k < 4; k++) {
      msg[12 + k] = (uint8_t)(a >> (8 * k));
      msg[16 + k] = (uint8_t)(b >> (8 * k));
    }
    if (!keyed(s, msg, sizeof msg, entry)) return false;
  }
  return true;
}

/* Group.pair_secrets of member `me` into buf (n * EMIT_SECRET_LEN bytes), when
 * every member takes them; else none (they prove the group's secret). */
static ProtobufCBinaryData pair_secrets(frontend_t *fe, const session_t *s, uint64_t comm_id,
                                        const uint32_t *ranks, size_t n, size_t me, uint8_t *buf) {
  if (!buf || n < 2 || agent_pool_data_plane(fe->pool, ranks, n) < EMIT_DATA_PLANE_PAIRS ||
      !emit_pair_secrets(s, comm_id, ranks, n, me, buf))
    return (ProtobufCBinaryData){0, NULL};
  return (ProtobufCBinaryData){n * EMIT_SECRET_LEN, buf};
}

/* The communicator of (session, mesh, dims, stream): a Reduce. */
static uint64_t comm_id(const session_t *s, uint64_t mesh, uint32_t dimmask, uint64_t stream) {
  uint64_t parts[3] = {mesh, dimmask, stream};
  return comm_id_of(s, parts, 3);
}

/* The channel of a ToMesh: (session, the agent losses it was told of, both
 * streams). An agent that lost its Execute link but lives on (a cut stream,
 * SIGSTOP then SIGCONT) still runs the instructions it had queued, and comes
 * back at the same data address: after a loss the session's sends must not
 * share a channel with those, or an orphaned receive takes (or shifts by one
 * message) what a new send meant for a new one. Reduces need no such count:
 * their communicator names the mesh, and a mesh with a lost rank is refused. */
static uint64_t to_mesh_comm_id(const session_t *s, uint64_t losses, uint64_t in_stream,
                                uint64_t res_stream) {
  uint64_t parts[4] = {0x746f6d657368ull /* "tomesh" */, losses, in_stream, res_stream};
  return comm_id_of(s, parts, 4);
}

uint64_t emit_reduce_bytes_min(frontend_t *fe, const mesh_t *mesh, int64_t group, uint64_t cap) {
  uint64_t n = (uint64_t)mesh_len(mesh), g = (uint64_t)group;
  /* Per member at most its rank, address and pair secret with their tags. */
  if (!cap || n * g < cap / (EMIT_ADDR_MAX + EMIT_SECRET_LEN + 16)) return 0;
  size_t nr;
  uint32_t *ranks = ranks_of(mesh, &nr);
  if (!ranks || !nr) {
    free(ranks);
    return 0;
  }
  /* Per member at least: its rank (one byte of a packed field), its data
   * address (a string: tag, length, bytes; all alike), its pair secret. */
  char addr[EMIT_ADDR_MAX];
  uint64_t member = 3 + strlen(agent_pool_data_address(fe->pool, ranks[0], addr, sizeof addr));
  if (g > 1 && agent_pool_data_plane(fe->pool, ranks, nr) >= EMIT_DATA_PLANE_PAIRS)
    member += EMIT_SECRET_LEN;
  free(ranks);
  return n * g * member;
}

void emit_reduce(frontend_t *fe, session_t *s, objects_t *o, const mesh_t *mesh,
                 const mesh_t *target, const Meshd__V1__Reduce *r, const obj_t *in,
                 const obj_t *res, const int *dims, int ndims) {
  spec_buf_t in_buf, res_buf;
  spec_t *in_spec = spec_of(&in_buf, in), *res_spec = spec_of(&res_buf, res);
  uint32_t mask = 0;
  int64_t group_size = 1;
  for (int i = 0; i < ndims; i++) {
    mask |= 1u << dims[i];
    group_size *= mesh->slice.sizes[dims[i]];
  }
  uint32_t *group = malloc(sizeof *group * (size_t)group_size);
  uint8_t *pairs = malloc((size_t)group_size * EMIT_SECRET_LEN);
  char **addrs = calloc((size_t)group_size, sizeof *addrs);
  char *addr_buf = malloc((size_t)group_size * EMIT_ADDR_MAX);
  size_t n;
  uint32_t *ranks = ranks_of(mesh, &n);
  if (!group || !pairs || !ranks || !addrs || !addr_buf) goto out;
  for (int64_t k = 0; k < group_size; k++) addrs[k] = addr_buf + k * EMIT_ADDR_MAX;
  Meshd__Agent__V1__Group g = MESHD__AGENT__V1__GROUP__INIT;
  g.comm_id = comm_id(s, mesh->ref, mask, r->stream);
  g.call = ++o->calls;
  uint8_t secret[EMIT_SECRET_LEN];
  g.ranks = group;
  g.n_ranks = (size_t)group_size;
  g.addresses = addrs;
  g.n_addresses = (size_t)group_size;
  Meshd__Agent__V1__ReduceOp op = MESHD__AGENT__V1__REDUCE_OP__INIT;
  op.reduce = (Meshd__V1__Reduce *)r;
  op.input = in_spec;
  op.result = res_spec;
  op.group = &g;
  op.rooted = target != NULL;
  instr_t ins;
  init_instr(&ins, s, r->stream);
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_REDUCE;
  ins.reduce = &op;
  for (size_t i = 0; i < n; i++) {
    /* The group: ranks sharing every coordinate outside the reduced dims, in
     * row-major order over the reduced dims. */
    int64_t coords[NDSLICE_MAX_DIMS];
    ndslice_coords(&mesh->slice, ranks[i], coords);
    for (int64_t k = 0; k < group_size; k++) {
      int64_t rest = k;
      for (int d = ndims - 1; d >= 0; d--) {
        coords[dims[d]] = rest % mesh->slice.sizes[dims[d]];
        rest /= mesh->slice.sizes[dims[d]];
      }
      group[k] = (uint32_t)ndslice_rank_of(&mesh->slice, coords, NULL);
      agent_pool_data_address(fe->pool, group[k], addrs[k], EMIT_ADDR_MAX);
      if (target && mesh_contains(target, group[k])) op.root = (uint32_t)k; /* one per group */
    }
    /* The groups of one Reduce share its comm_id; each proves its own secret. */
    g.secret = emit_group_secret(s, g.comm_id, group, (size_t)group_size, secret)
                   ? (ProtobufCBinaryData){sizeof secret, secret}
                   : (ProtobufCBinaryData){0, NULL};
    size_t me = 0;
    while (me + 1 < (size_t)group_size && group[me] != ranks[i]) me++;
    g.pair_secrets = pair_secrets(fe, s, g.comm_id, group, (size_t)group_size, me, pairs);
    send_to(fe, o, ranks[i], &ins);
  }
out:
  free(pairs);
  free(group);
  free(addrs);
  free(addr_buf);
  free(ranks);
}

/* One source to several destinations: a chain (BroadcastOp) in destination
 * order, on a channel of its own, so that the source sends the bytes once. */
static void emit_broadcast(frontend_t *fe, session_t *s, objects_t *o, const obj_t *in,
                           const obj_t *res, spec_t *in_spec, spec_t *res_spec, uint32_t from,
                           const uint32_t *to, size_t nto) {
  size_t n = nto + 1;
  uint32_t *ranks = malloc(n * sizeof *ranks);
  uint8_t *pairs = malloc(n * EMIT_SECRET_LEN);
  char **addrs = calloc(n, sizeof *addrs);
  char *addr_buf = malloc(n * EMIT_ADDR_MAX);
  if (!ranks || !addrs || !addr_buf) goto out;
  ranks[0] = from;
  memcpy(ranks + 1, to, nto * sizeof *ranks);
  for (size_t k = 0; k < n; k++) {
    addrs[k] = addr_buf + k * EMIT_ADDR_MAX;
    agent_pool_data_address(fe->pool, ranks[k], addrs[k], EMIT_ADDR_MAX);
  }
  uint64_t parts[5] = {0x746f6d657368ull /* "tomesh" */, o->losses, in->tensor.stream,
                       res->tensor.stream, (1ull << 32) | from};
  Meshd__Agent__V1__Group g = MESHD__AGENT__V1__GROUP__INIT;
  g.comm_id = comm_id_of(s, parts, 5);
  g.call = ++o->calls;
  uint8_t secret[EMIT_SECRET_LEN];
  if (emit_group_secret(s, g.comm_id, ranks, n, secret))
    g.secret = (ProtobufCBinaryData){sizeof secret, secret};
  g.ranks = ranks;
  g.n_ranks = n;
  g.addresses = addrs;
  g.n_addresses = n;
  Meshd__Agent__V1__BroadcastOp op = MESHD__AGENT__V1__BROADCAST_OP__INIT;
  op.input = in_spec;
  op.result = res_spec;
  op.group = &g;
  for (size_t k = 0; k < n; k++) {
    instr_t ins;
    init_instr(&ins, s, k == 0 ? in->tensor.stream : res->tensor.stream);
    ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_BROADCAST;
    ins.broadcast = &op;
    g.pair_secrets = pair_secrets(fe, s, g.comm_id, ranks, n, k, pairs);
    send_to(fe, o, ranks[k], &ins);
  }
out:
  free(pairs);
  free(ranks);
  free(addrs);
  free(addr_buf);
}

size_t emit_chain_pieces(size_t n) {
  return (n + REDUCE_GROUP_MAX - 2) / (REDUCE_GROUP_MAX - 1);
}

size_t emit_chain_piece_len(size_t n, size_t k) {
  size_t pieces = emit_chain_pieces(n);
  return n / pieces + (k < n % pieces);
}

void emit_to_mesh(frontend_t *fe, session_t *s, objects_t *o, const mesh_t *src, const mesh_t *dst,
                  const obj_t *in, const obj_t *res) {
  spec_buf_t in_buf, res_buf;
  spec_t *in_spec = spec_of(&in_buf, in), *res_spec = spec_of(&res_buf, res);
  size_t n;
  uint32_t *dranks = ranks_of(dst, &n);
  uint32_t *froms = malloc((n ? n : 1) * sizeof *froms), *chain = malloc((n ? n : 1) * sizeof *chain);
  bool *done = calloc(n ? n : 1, sizeof *done);
  if (!dranks || !froms || !chain || !done) goto out;
  for (size_t i = 0; i < n; i++) {
    /* Positional pairing: the source rank at the destination rank's coordinates
     * of the shared dims; dims only the destination has are broadcast. */
    int64_t sc[NDSLICE_MAX_DIMS];
    for (int d = 0; d < src->ndim; d++)
      sc[d] = mesh_coord(dst, dranks[i], mesh_find_dim(dst, src->names[d]));
    froms[i] = (uint32_t)ndslice_rank_of(&src->slice, sc, NULL);
  }
  for (size_t i = 0; i < n; i++) {
    if (done[i]) continue;
    uint32_t from = froms[i];
    if (dranks[i] != from) { /* every other destination of this source, in order */
      size_t nchain = 0;
      for (size_t j = i; j < n; j++)
        if (!done[j] && froms[j] == from && dranks[j] != from) chain[nchain++] = dranks[j];
      if (nchain >= 2) {
        for (size_t k = 0, at = 0; k < emit_chain_pieces(nchain); k++) {
          size_t len = emit_chain_piece_len(nchain, k);
          emit_broadcast(fe, s, o, in, res, in_spec, res_spec, from, chain + at, len);
          at += len;
        }
        for (size_t j = i; j < n; j++)
          if (froms[j] == from && dranks[j] != from) done[j] = true;
        continue;
      }
    }
    done[i] = true;
    Meshd__Agent__V1__SendTensor st = MESHD__AGENT__V1__SEND_TENSOR__INIT;
    st.from_rank = from;
    st.to_rank = dranks[i];
    st.to_stream = res->tensor.stream;
    st.comm_id = to_mesh_comm_id(s, o->losses, in->tensor.stream, res->tensor.stream);
    st.call = ++o->calls;
    instr_t ins;
    if (from == dranks[i]) { /* same process: a local copy */
      st.input = in_spec;
      st.result = res_spec;
      init_instr(&ins, s, in->tensor.stream);
      ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_SEND;
      ins.send = &st;
      send_to(fe, o, from, &ins);
      continue;
    }
    char peer[EMIT_ADDR_MAX];
    /* The channel is the session's; the secret is this pair's alone. */
    uint8_t secret[EMIT_SECRET_LEN];
    if (emit_group_secret(s, st.comm_id, (uint32_t[]){from, dranks[i]}, 2, secret))
      st.secret = (ProtobufCBinaryData){sizeof secret, secret};
    st.peer_address = peer;
    st.input = in_spec;
    agent_pool_data_address(fe->pool, dranks[i], peer, sizeof peer);
    init_instr(&ins, s, in->tensor.stream);
    ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_SEND;
    ins.send = &st;
    send_to(fe, o, from, &ins);
    st.input = NULL;
    st.result = res_spec;
    agent_pool_data_address(fe->pool, from, peer, sizeof peer);
    init_instr(&ins, s, res->tensor.stream);
    ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_SEND;
    ins.send = &st;
    send_to(fe, o, dranks[i], &ins);
  }
out:
  free(dranks);
  free(froms);
  free(chain);
  free(done);
}

void emit_borrow(frontend_t *fe, session_t *s, objects_t *o, const obj_t *borrow, const obj_t *origin,
                 const obj_t *handle, bool drop) {
  const borrow_obj_t *b = &borrow->borrow;
  Meshd__Agent__V1__BorrowOp op = MESHD__AGENT__V1__BORROW_OP__INIT;
  op.borrow = borrow->ref;
  op.tensor = b->origin;
  op.result = b->result;
  op.from_stream = b->from_stream;
  op.to_stream = b->to_stream;
  const mesh_t *mesh = objects_get(o, origin->tensor.mesh)->mesh;
  instr_t ins;
  if (drop) {
    op.phase = MESHD__AGENT__V1__BORROW_OP__PHASE__LAST_USE;
    init_instr(&ins, s, b->to_stream);
    ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_BORROW;
    ins.borrow = &op;
    send_to_mesh(fe, o, mesh, &ins);
    op.phase = MESHD__AGENT__V1__BORROW_OP__PHASE__DROP;
  } else {
    op.phase = MESHD__AGENT__V1__BORROW_OP__PHASE__CREATE;
  }
  init_instr(&ins, s, b->from_stream);
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_BORROW;
  ins.borrow = &op;
  send_to_mesh(fe, o, mesh, &ins);
  (void)handle;
}

/* One DeleteRefs of refs[0..n) to every rank of mesh, on stream. */
static void emit_delete_refs(frontend_t *fe, session_t *s, objects_t *o, uint64_t mesh,
                             uint64_t stream, uint64_t *refs, size_t n) {
  if (!n) return;
  Meshd__Agent__V1__DeleteRefs d = MESHD__AGENT__V1__DELETE_REFS__INIT;
  d.refs = refs;
  d.n_refs = n;
  instr_t ins;
  init_instr(&ins, s, stream);
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_DELETE_REFS;
  ins.delete_refs = &d;
  send_to_mesh(fe, o, objects_get(o, mesh)->mesh, &ins);
}

void emit_delete_add(frontend_t *fe, session_t *s, objects_t *o, emit_deletes_t *d,
                     uint64_t mesh, uint64_t stream, uint64_t ref) {
  if (d->n && (d->n == EMIT_DELETE_BATCH || mesh != d->mesh || stream != d->stream))
    emit_delete_flush(fe, s, o, d);
  d->mesh = mesh;
  d->stream = stream;
  d->refs[d->n++] = ref;
}

void emit_delete_flush(frontend_t *fe, session_t *s, objects_t *o, emit_deletes_t *d) {
  emit_delete_refs(fe, s, o, d->mesh, d->stream, d->refs, d->n);
  d->n = 0;
}

void emit_drop(frontend_t *fe, session_t *s, objects_t *o, emit_deletes_t *d, const obj_t *t) {
  for (const obj_t *a = t->tensor.storage->aliases; a; a = a->tensor.next_alias)
    emit_delete_add(fe, s, o, d, t->tensor.mesh, t->tensor.stream, a->ref);
}

size_t emit_status(frontend_t *fe, session_t *s, objects_t *o, uint32_t *ranks, uint64_t *seqs,
                   size_t cap) {
  Meshd__Agent__V1__StatusRequest sr = MESHD__AGENT__V1__STATUS_REQUEST__INIT;
  instr_t ins;
  init_instr(&ins, s, 0);
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_STATUS;
  ins.status = &sr;
  size_t k = 0;
  for (size_t r = 0; r < o->ntouched && k < cap; r++) {
    if (!o->touched[r]) continue;
    uint64_t seq = push(fe, o, (uint32_t)r, agent_link_pack(&ins));
    /* No link to the rank now (its agent is going): the session's last
     * instruction there is waited for instead, which fails the wait if it
     * was lost with the link (watermark_lost), though the loss may not be
     * noted on the session yet. */
    if (!seq) seq = o->last_seq ? o->last_seq[r] : 0;
    if (!seq) continue;
    ranks[k] = (uint32_t)r;
    seqs[k++] = seq;
  }
  return k;
}

void emit_end_session(frontend_t *fe, session_t *s, objects_t *o) {
  Meshd__Agent__V1__EndSession end = MESHD__AGENT__V1__END_SESSION__INIT;
  instr_t ins;
  init_instr(&ins, s, 0);
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_END_SESSION;
  ins.end_session = &end;
  for (size_t r = 0; r < o->ntouched; r++)
    if (o->touched[r]) agent_pool_send(fe->pool, (uint32_t)r, &ins, NULL);
}

void emit_peer_lost(frontend_t *fe, session_t *s, objects_t *o, uint32_t lost_rank,
                    const char *data_address, const char *reason) {
  Meshd__Agent__V1__PeerLost pl = MESHD__AGENT__V1__PEER_LOST__INIT;
  pl.rank = lost_rank;
  pl.data_address = (char *)(data_address ? data_address : "");
  pl.reason = (char *)(reason ? reason : "");
  instr_t ins;
  init_instr(&ins, s, 0);
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_PEER_LOST;
  ins.peer_lost = &pl;
  for (size_t r = 0; r < o->ntouched; r++) {
    if (r == lost_rank || !o->touched[r]) continue;
    push(fe, o, (uint32_t)r, agent_link_pack(&ins));
  }
}
