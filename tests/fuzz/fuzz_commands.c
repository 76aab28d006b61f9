/* Fuzz target: the server's command path, protobuf decode + command_run, on a
 * real session table with a fake agent pool.
 *
 * The pool has 10 registered agents, ranks 0..7 healthy (ranks 4..7 with a
 * 16 MiB capacity, the others unknown), 8..9 not; none has an Execute link,
 * so every instruction the handlers emit is packed and then dropped, as
 * tests/unit/test_commands.c does. Each input runs in a session of its own,
 * closed and freed at its end (so leaks show per input).
 *
 * Input: a flag byte, then records framed as messages on a gRPC stream (a
 * kind byte and a 4-byte big-endian length, then the bytes):
 *   flags  bit 0: first run the prelude (CreateMesh 1 {host: 2, gpu: 4},
 *          SliceMesh 2 = 1[host=1], CreateStream 3 "side"); bits 1-2: the
 *          session's quota (none, 64 MiB, 4 KiB, 1 GiB); bit 3: small limits
 *          (refs, meshes, streams, refs per command; dims and elements per
 *          tensor), else none but the hard bounds; bit 4: the commands run as
 *          the commands of one Submit batch (command_batch_begin: its
 *          Literals' bound)
 *   kind 0 a meshd.v1.Command (Execute's request, one message of Submit),
 *          checked by proto_check_strings first as the rpc layer does
 *        1 a meshd.v1.Error as an agent reports it (its session_id set to
 *          this session unless it names one), from rank `len % 10`
 *        2 the loss of rank (first byte % 10), as the pool reports it
 * Checks per command: an accepted one answers with its seq and no error, its
 * new refs are defined, a mesh's ranks are healthy agents; a rejected one has
 * a kind and a message and changes nothing (refs, bytes, live tensors); the
 * session's bytes and live tensors match its storages (no wrap) and never
 * pass its quota; every tensor has a valid layout inside its storage, on a
 * mesh and stream of the session; every answer packs.
 * MESHD_FUZZ_VERBOSE=1 prints each command's outcome (to read a crash input). */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "command_service.h"
#include "dtype.h"
#include "commands.h"
#include "emit.h"
#include "fuzz_input.h"
#include "log.h"
#include "proto_check.h"

#define MAX_RECORDS 64
#define HEALTHY 8

static agent_pool_t *pool;
static frontend_t fe;
static command_service_t *cs;
static session_table_t *table;
static bool verbose; /* MESHD_FUZZ_VERBOSE=1: each command's outcome on stderr */

static void on_closed(session_t *s, session_end_t why, void *arg) {
  (void)why;
  if (cs) command_service_session_closed(cs, s);
}

static void destroy_objects(void *p) { objects_destroy(p); }

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  log_set_level(LOG_LEVEL_ERROR); /* every send fails: no links */
  verbose = getenv("MESHD_FUZZ_VERBOSE") && strcmp(getenv("MESHD_FUZZ_VERBOSE"), "1") == 0;
  pool = agent_pool_create(NULL);
  FZ_CHECK(pool, "agent_pool_create");
  for (int i = 0; i < 10; i++) {
    agent_desc_t d = {0};
    snprintf(d.agent_id, sizeof d.agent_id, "agent-%d", i);
    snprintf(d.address, sizeof d.address, "127.0.0.1:%d", 1000 + i);
    snprintf(d.device, sizeof d.device, "cpu");
    d.memory_bytes = i >= 4 ? 16u << 20 : 0;
    d.data_port = (uint32_t)(2000 + i);
    /* Agents past the healthy ones predate LiteralOp (a mesh over them is refused
     * anyway); the healthy ones run it. */
    d.instructions = i < HEALTHY ? MESHD__AGENT__V1__INSTRUCTION__BODY_LITERAL : 0;
    char msg[200];
    FZ_CHECK(agent_pool_add(pool, &d, i, msg, sizeof msg) == i, "%s", msg);
    if (i < HEALTHY) agent_pool_set_healthy(pool, (uint32_t)i, d.agent_id, 0, true);
  }
  FZ_CHECK(agent_pool_healthy(pool) == HEALTHY, "healthy agents");
  fe.pool = pool;
  table = session_table_create(300, 0, on_closed, NULL);
  FZ_CHECK(table, "session_table_create");
  cs = command_service_create(pool, table, NULL);
  FZ_CHECK(cs, "command_service_create");
  return 0;
}

/* ------------------------------------------------------------------ one command */

/* The refs a command defines, as commands.c claims them. */
static size_t new_refs(const Meshd__V1__Command *c, uint64_t *refs, size_t cap) {
  size_t n = 0;
  switch (c->kind_case) {
  case MESHD__V1__COMMAND__KIND_CREATE_MESH: refs[n++] = c->create_mesh->ref; break;
  case MESHD__V1__COMMAND__KIND_SLICE_MESH: refs[n++] = c->slice_mesh->ref; break;
  case MESHD__V1__COMMAND__KIND_CREATE_STREAM: refs[n++] = c->create_stream->ref; break;
  case MESHD__V1__COMMAND__KIND_FACTORY: refs[n++] = c->factory->ref; break;
  case MESHD__V1__COMMAND__KIND_TO_MESH: refs[n++] = c->to_mesh->ref; break;
  case MESHD__V1__COMMAND__KIND_REDUCE:
    if (c->reduce->ref) refs[n++] = c->reduce->ref;
    break;
  case MESHD__V1__COMMAND__KIND_BORROW:
    refs[n++] = c->borrow->ref;
    refs[n++] = c->borrow->borrow;
    break;
  case MESHD__V1__COMMAND__KIND_CALL:
    for (size_t i = 0; i < c->call->n_results && n < cap; i++) refs[n++] = c->call->results[i];
    break;
  default: break;
  }
  return n;
}

/* A tensor record the agents will get as a TensorSpec: a valid shape and dtype,
 * strides >= 0, on a mesh and stream of the session, and (for a storage of its
 * own) every element inside the storage's bytes. */
static void check_tensor(objects_t *o, const obj_t *t, const char *name) {
  tensor_meta_t tm;
  const tensor_meta_t *m = obj_meta(t, &tm);
  const layout_t *l = &m->layout;
  unsigned long long ref = (unsigned long long)t->ref;
  meshd_error_t e;
  FZ_CHECK(dtype_valid(m->dtype), "%s: tensor %llu has dtype %d", name, ref, (int)m->dtype);
  FZ_CHECK(layout_check_shape(NULL, l->sizes, l->ndim, dtype_size(m->dtype), &e) == 0,
           "%s: tensor %llu: %s", name, ref, e.msg);
  FZ_CHECK(l->offset >= 0, "%s: tensor %llu offset %lld", name, ref, (long long)l->offset);
  unsigned __int128 last = (unsigned __int128)l->offset;
  for (int d = 0; d < l->ndim; d++) {
    FZ_CHECK(l->strides[d] >= 0, "%s: tensor %llu stride %lld", name, ref, (long long)l->strides[d]);
    if (l->sizes[d]) last += (unsigned __int128)(l->sizes[d] - 1) * (uint64_t)l->strides[d];
  }
  const storage_t *st = t->tensor.storage;
  if (layout_numel(l) > 0 && !st->borrow)
    FZ_CHECK((last + 1) * dtype_size(m->dtype) <= st->bytes,
             "%s: tensor %llu reaches byte %.0f of its %llu-byte storage", name, ref,
             (double)((last + 1) * dtype_size(m->dtype)), (unsigned long long)st->bytes);
  const obj_t *mesh = objects_get(o, t->tensor.mesh);
  FZ_CHECK(mesh && mesh->kind == OBJ_MESH, "%s: tensor %llu is on mesh %llu, not a mesh", name, ref,
           (unsigned long long)t->tensor.mesh);
  const obj_t *stream = t->tensor.stream ? objects_get(o, t->tensor.stream) : NULL;
  FZ_CHECK(!t->tensor.stream || (stream && stream->kind == OBJ_STREAM),
           "%s: tensor %llu is on stream %llu, not a stream", name, ref,
           (unsigned long long)t->tensor.stream);
}

/* The session's books against its objects, summed in 128 bits: live_tensors
 * counts the tensor records, bytes the live storages' bytes on every rank, and
 * each storage's alias list holds exactly its live aliases; the mesh, stream
 * and borrow counts match the table and stay within the session's limits. */
static void check_accounting(const session_t *s, objects_t *o, const char *name) {
  storage_t *seen[512];
  size_t nseen = 0, tensors = 0;
  unsigned __int128 bytes = 0;
  obj_t *it;
  for (size_t i = 0; (it = refmap_next(&o->table, &i));) {
    if (it->kind != OBJ_TENSOR) continue;
    tensors++;
    check_tensor(o, it, name);
    storage_t *st = it->tensor.storage;
    bool known = false;
    for (size_t i = 0; i < nseen && !known; i++) known = seen[i] == st;
    if (known || nseen == sizeof seen / sizeof *seen) continue;
    seen[nseen++] = st;
    int aliases = 0;
    for (const obj_t *a = st->aliases; a; a = a->tensor.next_alias, aliases++)
      FZ_CHECK(a->tensor.storage == st, "%s: alias %llu of another storage", name,
               (unsigned long long)a->ref);
    FZ_CHECK(aliases == st->live_aliases && st->refs >= aliases, "%s: storage %llu has %d aliases, "
             "live_aliases %d, refs %d", name, (unsigned long long)st->id, aliases,
             st->live_aliases, st->refs);
    if (st->live_aliases > 0) bytes += (unsigned __int128)st->bytes * st->ranks;
  }
  FZ_CHECK(tensors == o->live_tensors, "%s: %zu tensor records, live_tensors %llu", name, tensors,
           (unsigned long long)o->live_tensors);
  uint64_t meshes = 0, streams = 0, borrows = 0;
  for (size_t i = 0; (it = refmap_next(&o->table, &i));) {
    meshes += it->kind == OBJ_MESH;
    streams += it->kind == OBJ_STREAM;
    borrows += it->kind == OBJ_BORROW;
  }
  FZ_CHECK(meshes == o->meshes && streams == o->streams && borrows == o->live_borrows,
           "%s: %llu meshes, %llu streams, %llu live borrows; counted %llu, %llu, %llu", name,
           (unsigned long long)meshes, (unsigned long long)streams, (unsigned long long)borrows,
           (unsigned long long)o->meshes, (unsigned long long)o->streams,
           (unsigned long long)o->live_borrows);
  const session_limits_t *lim = &s->limits;
  FZ_CHECK(!lim->max_refs || objects_live_refs(o) <= lim->max_refs, "%s: %llu live refs, limit %llu",
           name, (unsigned long long)objects_live_refs(o), (unsigned long long)lim->max_refs);
  FZ_CHECK(!lim->max_meshes || o->meshes <= lim->max_meshes, "%s: meshes past the limit", name);
  FZ_CHECK(!lim->max_streams || o->streams <= lim->max_streams, "%s: streams past the limit", name);
  if (nseen < sizeof seen / sizeof *seen)
    FZ_CHECK(bytes == o->bytes, "%s: storages hold %.0f bytes, the session counts %llu", name,
             (double)bytes, (unsigned long long)o->bytes);
}

static void check_answer(const cmd_out_t *out) {
  size_t len = meshd__v1__command_result__get_packed_size(&out->res);
  uint8_t *buf = malloc(len ? len : 1);
  FZ_CHECK(buf, "out of memory");
  FZ_CHECK(meshd__v1__command_result__pack(&out->res, buf) == len, "packed size");
  Meshd__V1__CommandResult *back = meshd__v1__command_result__unpack(NULL, len, buf);
  FZ_CHECK(back && back->seq == out->res.seq && back->n_tensors == out->res.n_tensors,
           "the answer does not read back");
  meshd__v1__command_result__free_unpacked(back, NULL);
  free(buf);
}

static void run_command(session_t *s, objects_t *o, const Meshd__V1__Command *c) {
  cmd_out_t out;
  meshd_error_t e;
  memset(&e, 0x5a, sizeof e);
  cmd_out_init(&out, c->seq);
  pthread_mutex_lock(&s->mu);
  uint64_t last_ref = atomic_load(&s->last_ref), bytes = o->bytes, live = o->live_tensors;
  uint64_t refs = objects_live_refs(o);
  int rc = command_run(&fe, s, o, c, &out, &e);
  const char *name = command_name(c);
  if (rc == 0) {
    FZ_CHECK(!out.res.error && out.res.seq == c->seq, "%s accepted with an error", name);
    uint64_t refs[OP_MAX_RESULTS + 64];
    size_t n = new_refs(c, refs, sizeof refs / sizeof *refs);
    for (size_t i = 0; i < n; i++)
      FZ_CHECK(refs[i] > last_ref && objects_get(o, refs[i]), "%s: new ref %llu is not defined",
               name, (unsigned long long)refs[i]);
    if (n) FZ_CHECK(atomic_load(&s->last_ref) == refs[n - 1], "%s: last ref", name);
    const Meshd__V1__MeshMeta *m = out.res.mesh;
    if (m) {
      size_t want = 1;
      for (size_t i = 0; i < m->n_dims; i++) want *= (size_t)m->dims[i]->size;
      FZ_CHECK(m->n_ranks == want, "%s: mesh of %zu ranks, dims say %zu", name, m->n_ranks, want);
      for (size_t i = 0; i < m->n_ranks; i++)
        FZ_CHECK(m->ranks[i] < HEALTHY, "%s: mesh rank %u has no healthy agent", name, m->ranks[i]);
    }
    if (c->kind_case == MESHD__V1__COMMAND__KIND_SYNC) { /* what command_service does next */
      size_t cap = o->ntouched ? o->ntouched : 1;
      uint32_t *ranks = malloc(sizeof *ranks * cap);
      uint64_t *seqs = malloc(sizeof *seqs * cap);
      FZ_CHECK(ranks && seqs, "out of memory");
      FZ_CHECK(emit_status(&fe, s, o, ranks, seqs, cap) <= cap, "emit_status");
      free(ranks);
      free(seqs);
    }
  } else {
    FZ_CHECK(rc == -1, "%s returned %d", name, rc);
    FZ_CHECK(e.kind != ERR_NONE && error_kind_code(e.kind) != GRPC_STATUS_OK, "%s refused with kind %d",
             name, (int)e.kind);
    FZ_CHECK(memchr(e.msg, '\0', sizeof e.msg) && e.msg[0], "%s refused without a message", name);
    FZ_CHECK(atomic_load(&s->last_ref) == last_ref, "%s refused but claimed a ref: %s", name, e.msg);
    FZ_CHECK(o->bytes == bytes && o->live_tensors == live && objects_live_refs(o) == refs,
             "%s refused but changed the session: %s",
             name, e.msg);
    cmd_out_error(&out, &e);
  }
  if (verbose)
    fprintf(stderr, "seq %llu %s: %s%s\n", (unsigned long long)c->seq, name,
            rc ? error_kind_name(e.kind) : "ok", rc ? e.msg : "");
  check_accounting(s, o, name);
  if (s->quota_bytes)
    FZ_CHECK(o->bytes <= s->quota_bytes, "session holds %llu bytes, quota %llu",
             (unsigned long long)o->bytes, (unsigned long long)s->quota_bytes);
  s->bytes_held = o->bytes;
  s->live_tensors = o->live_tensors;
  pthread_mutex_unlock(&s->mu);
  check_answer(&out);
  cmd_out_free(&out);
}

/* ------------------------------------------------------------------ prelude */

static void prelude(session_t *s, objects_t *o) {
  Meshd__V1__Dim d0 = MESHD__V1__DIM__INIT, d1 = MESHD__V1__DIM__INIT;
  d0.name = "host", d0.size = 2, d1.name = "gpu", d1.size = 4;
  Meshd__V1__Dim *dims[] = {&d0, &d1};
  Meshd__V1__CreateMesh cm = MESHD__V1__CREATE_MESH__INIT;
  cm.ref = 1, cm.n_dims = 2, cm.dims = dims;
  Meshd__V1__Command c = MESHD__V1__COMMAND__INIT;
  c.seq = 1, c.kind_case = MESHD__V1__COMMAND__KIND_CREATE_MESH, c.create_mesh = &cm;
  run_command(s, o, &c);

  Meshd__V1__MeshSelector sel = MESHD__V1__MESH_SELECTOR__INIT, *selp = &sel;
  sel.dim = "host", sel.sel_case = MESHD__V1__MESH_SELECTOR__SEL_INDEX, sel.index = 1;
  Meshd__V1__SliceMesh sm = MESHD__V1__SLICE_MESH__INIT;
  sm.ref = 2, sm.parent = 1, sm.n_selectors = 1, sm.selectors = &selp;
  c.seq = 2, c.kind_case = MESHD__V1__COMMAND__KIND_SLICE_MESH, c.slice_mesh = &sm;
  run_command(s, o, &c);

  Meshd__V1__CreateStream st = MESHD__V1__CREATE_STREAM__INIT;
  st.ref = 3, st.name = "side";
  c.seq = 3, c.kind_case = MESHD__V1__COMMAND__KIND_CREATE_STREAM, c.create_stream = &st;
  run_command(s, o, &c);
  FZ_CHECK(atomic_load(&s->last_ref) == 3, "the prelude was refused");
}

/* ------------------------------------------------------------------ agents' part */

static void agent_report(session_t *s, uint32_t rank, const uint8_t *p, size_t n) {
  Meshd__V1__Error *err = meshd__v1__error__unpack(NULL, n, p);
  if (!err) return;
  char *named = err->session_id;
  if (!named[0]) err->session_id = s->id;
  const Meshd__V1__Error *errs[] = {err};
  command_service_on_report(cs, rank, errs, 1);
  err->session_id = named;
  meshd__v1__error__free_unpacked(err, NULL);
}

static void agent_lost(uint32_t rank) {
  agent_lost_t l = {.rank = rank, .unix_ms = 1700000000000, .loss = 1};
  snprintf(l.agent_id, sizeof l.agent_id, "agent-%u", rank);
  agent_pool_data_address(pool, rank, l.data_address, sizeof l.data_address);
  command_service_on_agent_lost(cs, &l);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static const uint64_t quotas[] = {0, 64u << 20, 4096, 1u << 30};
  static const session_limits_t small = {
      .max_refs = 48, .max_meshes = 6, .max_streams = 3, .max_command_refs = 24};
  fz_t in = fz_open(data, size);
  uint8_t flags = fz_u8(&in);
  session_t *s;
  meshd_error_t e;
  bool limited = flags & 8;
  session_table_set_limits(table, limited ? &small : NULL);
  layout_set_limits(limited ? &(layout_limits_t){8, (int64_t)1 << 34} : NULL);
  FZ_CHECK(session_create(table, "fuzz", "fuzz", 0, quotas[(flags >> 1) & 3], &s, &e) == 0, "%s",
           e.msg);
  objects_t *o = objects_create();
  FZ_CHECK(o, "objects_create");
  pthread_mutex_lock(&s->mu);
  session_set_objects(s, o, destroy_objects);
  pthread_mutex_unlock(&s->mu);
  if (flags & 1) prelude(s, o);
  if (flags & 16) command_batch_begin();

  for (int k = 0; k < MAX_RECORDS && fz_left(&in) >= 5; k++) {
    uint8_t kind = fz_u8(&in);
    size_t len = (size_t)fz_u64_raw(&in, 1) << 24 | (size_t)fz_u64_raw(&in, 1) << 16 |
                 (size_t)fz_u64_raw(&in, 1) << 8 | (size_t)fz_u64_raw(&in, 1);
    if (len > fz_left(&in)) len = fz_left(&in);
    const uint8_t *p = data + in.at;
    in.at += len;
    switch (kind % 3) {
    case 0: {
      char why[256];
      if (proto_check_strings(&meshd__v1__command__descriptor, p, len, why, sizeof why)) {
        FZ_CHECK(why[0], "proto_check_strings refused without saying why");
        break; /* the rpc layer answers INVALID_ARGUMENT */
      }
      Meshd__V1__Command *c = meshd__v1__command__unpack(NULL, len, p);
      if (!c) break; /* the same */
      run_command(s, o, c);
      meshd__v1__command__free_unpacked(c, NULL);
      break;
    }
    case 1: agent_report(s, (uint32_t)(len % 10), p, len); break;
    default: agent_lost(len ? p[0] % 10u : 0); break;
    }
  }
  if (flags & 16) command_batch_end();

  FZ_CHECK(session_close(table, s), "session_close");
  session_release(s); /* the last reference: its objects go */
  FZ_CHECK(session_count(table) == 0, "sessions left open");
  return 0;
}
