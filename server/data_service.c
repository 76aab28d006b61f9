#include "data_service.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "commands.h"
#include "log.h"
#include "meshd/agent/v1/agent.pb-c.h"
#include "objects.h"
#include "session_service.h"

/* A channel per Upload or Fetch, to a live agent: a connection attempt may
 * take seconds (a CPU-starved or briefly paused agent is not a lost one). */
static const rpc_channel_opts_t agent_channel_opts = {.connect_timeout_ms = 5000};

#define AGENT_CALL_MS 600000

struct data_service {
  agent_pool_t *pool;
  session_table_t *sessions;
  size_t chunk; /* bytes of data per message, well under the limit */
};

static void destroy_objects(void *p) { objects_destroy(p); }

static objects_t *objects_of(session_t *s) {
  if (!s->objects) session_set_objects(s, objects_create(), destroy_objects);
  return s->objects;
}

static void finish_error(rpc_call_t *call, const meshd_error_t *e) {
  rpc_call_finish(call, error_kind_code(e->kind), error_kind_name(e->kind), "%s", e->msg);
}


/* ------------------------------------------------------------------ upload */

typedef struct upload {
  data_service_t *ds;
  session_t *session;
  rpc_call_t *call;
  bool have_header, failed;
  uint64_t ref, mesh, stream;
  tensor_meta_t meta;
  bool per_rank;
  uint32_t *ranks;
  size_t nranks;
  uint8_t *buf;
  size_t each, total, got; /* bytes per rank, expected, received */
  _Atomic int owners;       /* the call, and the helper thread once it runs */
} upload_t;

static void upload_release(upload_t *u) {
  if (atomic_fetch_sub(&u->owners, 1) != 1) return;
  session_release(u->session);
  free(u->ranks);
  free(u->buf);
  free(u);
}

static void upload_fail(upload_t *u, error_kind_t kind, const char *fmt, const char *arg) {
  meshd_error_t e;
  error_set(&e, kind, fmt, arg);
  u->failed = true;
  finish_error(u->call, &e);
}

static void upload_start(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  data_service_t *ds = arg;
  session_t *s = session_from_call(ds->sessions, call);
  if (!s) return;
  upload_t *u = calloc(1, sizeof *u);
  if (!u) {
    session_release(s);
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA", "Upload: out of memory");
    return;
  }
  u->ds = ds;
  u->session = s;
  u->call = call;
  atomic_init(&u->owners, 1);
  rpc_call_set_data(call, u);
}

/* Every check of the header, under the session lock; nothing changes. */
static int upload_header(upload_t *u, const Meshd__V1__UploadHeader *h, meshd_error_t *e) {
  session_t *s = u->session;
  int rc = -1;
  pthread_mutex_lock(&s->mu);
  objects_t *o = objects_of(s);
  obj_t *m = NULL;
  if (!o) {
    error_set(e, ERR_QUOTA, "Upload: out of memory on the server");
    goto out;
  }
  if (session_check_refs(s, &h->ref, 1, e)) {
    error_prefix(e, "Upload", ": ");
    goto out;
  }
  if (command_check_limits(s, o, OBJ_TENSOR, 1, "Upload", e)) goto out;
  if (!(m = objects_expect(o, h->mesh, OBJ_MESH, "Upload: mesh", e))) goto out;
  if (h->stream && !objects_expect(o, h->stream, OBJ_STREAM, "Upload: stream", e)) goto out;
  if (!dtype_valid((dtype_t)h->dtype)) {
    error_set(e, ERR_BAD_ARGUMENT, "Upload: unknown dtype %d; name one of float32, ..., bool",
              (int)h->dtype);
    goto out;
  }
  u->meta.dtype = (dtype_t)h->dtype;
  if (layout_contiguous(&u->meta.layout, h->shape, (int64_t)h->n_shape, dtype_size(u->meta.dtype),
                        "Upload: shape", e))
    goto out;
  u->nranks = mesh_len(m->mesh);
  u->ranks = malloc(sizeof *u->ranks * (u->nranks ? u->nranks : 1));
  if (!u->ranks) {
    error_set(e, ERR_QUOTA, "Upload: out of memory on the server");
    goto out;
  }
  mesh_ranks(m->mesh, u->ranks);
  u->each = (size_t)layout_numel(&u->meta.layout) * dtype_size(u->meta.dtype);
  u->total = h->per_rank ? u->each * u->nranks : u->each;
  if (h->total_bytes && h->total_bytes != u->total) {
    error_set(e, ERR_SHAPE_MISMATCH,
              "Upload: total_bytes is %llu but shape and dtype%s need %zu bytes",
              (unsigned long long)h->total_bytes, h->per_rank ? " (per rank, times the mesh's ranks)" : "",
              u->total);
    goto out;
  }
  if (command_check_mesh_alive(u->ds->pool, m->mesh, "Upload", e) ||
      mesh_check_capacity(m->mesh, "Upload", u->each, e))
    goto out;
  if (s->quota_bytes && o->bytes + u->each * u->nranks > s->quota_bytes) {
    error_set(e, ERR_QUOTA, "Upload: the tensor needs %zu bytes across its mesh, but the session "
              "holds %llu of its %llu-byte quota; drop tensors you no longer need",
              u->each * u->nranks, (unsigned long long)o->bytes, (unsigned long long)s->quota_bytes);
    goto out;
  }
  rc = 0;
out:
  pthread_mutex_unlock(&s->mu);
  if (rc) return rc;
  u->ref = h->ref;
  u->mesh = h->mesh;
  u->stream = h->stream;
  u->per_rank = h->per_rank;
  if (!(u->buf = malloc(u->total ? u->total : 1)))
    return error_set(e, ERR_QUOTA, "Upload: out of memory on the server for %zu bytes", u->total);
  u->have_header = true;
  return 0;
}

/* One agent's copy through Agent/Write. */
static int write_rank(upload_t *u, uint32_t rank, const uint8_t *data, meshd_error_t *e) {
  char addr[256];
  if (agent_pool_address(u->ds->pool, rank, addr, sizeof addr))
    return error_set(e, ERR_AGENT_LOST, "Upload: rank %u has no agent", rank);
  rpc_channel_t *ch = rpc_channel_create(addr, &agent_channel_opts);
  rpc_stream_t *st = ch ? rpc_stream_open(ch, "/meshd.agent.v1.Agent/Write", NULL, 0, AGENT_CALL_MS) : NULL;
  int rc = -1;
  if (!st) {
    error_set(e, ERR_AGENT_LOST, "Upload: cannot call the agent of rank %u", rank);
    goto out;
  }
  Meshd__Agent__V1__TensorSpec sp = MESHD__AGENT__V1__TENSOR_SPEC__INIT;
  sp.ref = u->ref;
  sp.n_shape = sp.n_strides = (size_t)u->meta.layout.ndim;
  sp.shape = u->meta.layout.sizes;
  sp.strides = u->meta.layout.strides;
  sp.dtype = (Meshd__V1__DType)u->meta.dtype;
  Meshd__Agent__V1__DataChunk c = MESHD__AGENT__V1__DATA_CHUNK__INIT;
  c.session_id = u->session->id;
  c.part_case = MESHD__AGENT__V1__DATA_CHUNK__PART_SPEC;
  c.spec = &sp;
  int w = rpc_stream_write(st, &c.base, false);
  c.part_case = MESHD__AGENT__V1__DATA_CHUNK__PART_DATA;
  c.spec = NULL;
  for (size_t off = 0; w == 0 && off < u->each; off += u->ds->chunk) {
    size_t n = u->each - off < u->ds->chunk ? u->each - off : u->ds->chunk;
    c.data.data = (uint8_t *)data + off;
    c.data.len = n;
    w = rpc_stream_write(st, &c.base, false);
  }
  if (w == 0) rpc_stream_close_send(st);
  ProtobufCMessage *reply = NULL;
  while (rpc_stream_read(st, &meshd__agent__v1__write_reply__descriptor, &reply, 0) == 1) {
    protobuf_c_message_free_unpacked(reply, NULL);
    reply = NULL;
  }
  rpc_status_t status;
  if (rpc_stream_finish(st, &status) != GRPC_STATUS_OK) {
    error_set(e, status.code == GRPC_STATUS_RESOURCE_EXHAUSTED ? ERR_QUOTA : ERR_REMOTE_FAILURE,
              "Upload: the agent of rank %u refused the data: %s", rank, status.message);
    goto out;
  }
  rc = 0;
out:
  if (st) rpc_stream_destroy(st);
  if (ch) rpc_channel_destroy(ch);
  return rc;
}

/* Agents take data only for sessions open on them (docs/protocol.md): a
 * StatusRequest of the session opens it on each rank, ahead of the writes
 * (the agent waits briefly for it when the write overtakes it), and marks the
 * rank touched so that EndSession closes it there. */
static void upload_open(upload_t *u) {
  Meshd__Agent__V1__StatusRequest sr = MESHD__AGENT__V1__STATUS_REQUEST__INIT;
  Meshd__Agent__V1__Instruction ins = MESHD__AGENT__V1__INSTRUCTION__INIT;
  session_t *s = u->session;
  ins.session_id = s->id;
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_STATUS;
  ins.status = &sr;
  pthread_mutex_lock(&s->mu);
  objects_t *o = objects_of(s);
  for (size_t i = 0; o && i < u->nranks; i++) {
    uint64_t seq = 0;
    if (agent_pool_send(u->ds->pool, u->ranks[i], &ins, &seq) == 0) objects_sent(o, u->ranks[i], seq, 0);
  }
  pthread_mutex_unlock(&s->mu);
}

/* A write failed: the ranks written before it let go of the ref (which the
 * session never claimed, so a later command may define it). Holds s->mu. */
static void upload_undo(upload_t *u, objects_t *o, size_t written) {
  Meshd__Agent__V1__DeleteRefs d = MESHD__AGENT__V1__DELETE_REFS__INIT;
  Meshd__Agent__V1__Instruction ins = MESHD__AGENT__V1__INSTRUCTION__INIT;
  ins.session_id = u->session->id;
  ins.stream = u->stream;
  ins.body_case = MESHD__AGENT__V1__INSTRUCTION__BODY_DELETE_REFS;
  ins.delete_refs = &d;
  d.refs = &u->ref;
  d.n_refs = 1;
  for (size_t i = 0; i < written; i++) {
    uint64_t seq = 0;
    if (agent_pool_send(u->ds->pool, u->ranks[i], &ins, &seq) == 0) objects_sent(o, u->ranks[i], seq, 0);
  }
}

static void *upload_main(void *arg) {
  upload_t *u = arg;
  meshd_error_t e = {0};
  int rc = 0;
  size_t written = 0;
  upload_open(u);
  for (; rc == 0 && written < u->nranks; written++)
    rc = write_rank(u, u->ranks[written], u->buf + (u->per_rank ? written * u->each : 0), &e);
  session_t *s = u->session;
  obj_t *t = NULL;
  pthread_mutex_lock(&s->mu);
  objects_t *o = objects_of(s);
  for (size_t i = 0; o && i < u->nranks; i++) objects_touch(o, u->ranks[i]); /* EndSession frees it */
  if (rc != 0 && o) upload_undo(u, o, written);
  /* Checked again: the session's other commands ran meanwhile. */
  if (rc == 0 && session_check_refs(s, &u->ref, 1, &e) == 0 &&
      command_check_limits(s, o, OBJ_TENSOR, 1, "Upload", &e) == 0) {
    o->current_seq = 0; /* an upload is not a numbered command */
    t = objects_new_tensor(o, u->ref, &u->meta, u->mesh, u->stream, u->nranks);
    if (t) session_claim_ref(s, u->ref, NULL);
    else error_set(&e, ERR_QUOTA, "Upload: out of memory on the server");
    s->bytes_held = o->bytes;
    s->live_tensors = o->live_tensors;
  }
  Meshd__V1__UploadReply reply = MESHD__V1__UPLOAD_REPLY__INIT;
  Meshd__V1__TensorMeta meta;
  int64_t dims[2 * LAYOUT_MAX_DIMS];
  if (t) {
    command_tensor_meta(&meta, t, dims);
    reply.tensor = &meta;
    rpc_call_reply(u->call, &reply.base);
  }
  pthread_mutex_unlock(&s->mu);
  rpc_call_t *call = u->call;
  if (!t) finish_error(call, &e);
  upload_release(u);
  rpc_call_unref(call);
  return NULL;
}

static void upload_message(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  upload_t *u = rpc_call_data(call);
  if (!u || u->failed) return;
  meshd_error_t e;
  if (!msg) { /* everything arrived: hand the agent calls to a helper thread */
    if (!u->have_header) return upload_fail(u, ERR_BAD_ARGUMENT, "Upload: %s", "no header: the first message must be an UploadHeader");
    if (u->got != u->total) {
      char why[160];
      snprintf(why, sizeof why, "got %zu bytes of data but the header needs %zu", u->got, u->total);
      return upload_fail(u, ERR_SHAPE_MISMATCH, "Upload: %s", why);
    }
    rpc_call_ref(call);
    u->failed = true; /* no more messages are expected */
    atomic_fetch_add(&u->owners, 1);
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, upload_main, u) != 0) {
      atomic_fetch_sub(&u->owners, 1);
      rpc_call_unref(call);
      rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA", "Upload: out of threads");
    }
    pthread_attr_destroy(&attr);
    return;
  }
  const Meshd__V1__UploadChunk *c = (const void *)msg;
  if (c->part_case == MESHD__V1__UPLOAD_CHUNK__PART_HEADER) {
    if (u->have_header) return upload_fail(u, ERR_BAD_ARGUMENT, "Upload: %s", "a second header");
    if (upload_header(u, c->header, &e)) {
      u->failed = true;
      finish_error(call, &e);
    }
    return;
  }
  if (!u->have_header)
    return upload_fail(u, ERR_BAD_ARGUMENT, "Upload: %s", "data before the header: send the UploadHeader first");
  if (c->data.len > u->total - u->got) {
    char why[160];
    snprintf(why, sizeof why, "more data than the %zu bytes the header describes", u->total);
    return upload_fail(u, ERR_SHAPE_MISMATCH, "Upload: %s", why);
  }
  memcpy(u->buf + u->got, c->data.data, c->data.len);
  u->got += c->data.len;
}

static void upload_end(rpc_call_t *call, bool cancelled, void *arg) {
  upload_t *u = rpc_call_data(call);
  if (u) upload_release(u);
}

/* ------------------------------------------------------------------ fetch */

typedef struct fetch {
  data_service_t *ds;
  rpc_call_t *call;
  char session[SESSION_ID_LEN + 1];
  uint32_t rank;
  uint64_t ref, after_seq;
  session_t *sess;             /* referenced: re-checked once every rank caught up */
  watermark_target_t *targets; /* every rank of the tensor's mesh, at its last seq */
  size_t ntargets;
  Meshd__V1__TensorMeta meta;
  int64_t dims[2 * LAYOUT_MAX_DIMS];
} fetch_t;

typedef struct fetch_wait {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool done;
  watermark_result_t result;
  uint32_t lost;
} fetch_wait_t;

static void fetch_caught_up(watermark_result_t r, uint32_t lost, void *arg) {
  fetch_wait_t *w = arg;
  pthread_mutex_lock(&w->mu);
  w->done = true;
  w->result = r;
  w->lost = lost;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

/* Waits (on this helper thread) until every rank of the tensor's mesh ran what
 * was issued before the Fetch; a failure on any of them is then known to the
 * server (reports land before the watermark moves), so a value that failed on
 * any rank fails the Fetch from every rank. Returns 0, or -1 having answered. */
static int fetch_wait_all(fetch_t *f) {
  fetch_wait_t w = {.done = false};
  pthread_mutex_init(&w.mu, NULL);
  pthread_cond_init(&w.cv, NULL);
  uint32_t lost = 0;
  watermark_result_t r;
  for (;;) {
    w.done = false;
    r = watermark_wait_session(agent_pool_watermark(f->ds->pool), f->session, f->targets,
                               f->ntargets, fetch_caught_up, &w, NULL, &lost);
    if (r == WATERMARK_PENDING) {
      pthread_mutex_lock(&w.mu);
      while (!w.done) pthread_cond_wait(&w.cv, &w.mu);
      pthread_mutex_unlock(&w.mu);
      r = w.result;
      lost = w.lost;
    }
    if (r != WATERMARK_LOST || lost == f->rank) break;
    /* Another rank of the mesh was lost: its failures can no longer reach
     * us, but the shard asked for is on a survivor; wait for the others. */
    size_t k = 0;
    for (size_t i = 0; i < f->ntargets; i++)
      if (f->targets[i].rank != lost) f->targets[k++] = f->targets[i];
    if (k == f->ntargets) break;
    f->ntargets = k;
  }
  pthread_cond_destroy(&w.cv);
  pthread_mutex_destroy(&w.mu);
  if (r == WATERMARK_LOST) {
    /* The pool's wording names the rank and when it was lost. */
    meshd_error_t when = {0};
    agent_pool_check_lost(f->ds->pool, &lost, 1, 0, "Fetch", &when);
    rpc_call_finish(f->call, GRPC_STATUS_UNAVAILABLE, "AGENT_LOST",
                    "Fetch of tensor %llu: the agent of rank %u was lost before it computed it%s%s%s",
                    (unsigned long long)f->ref, lost, when.msg[0] ? " (" : "",
                    when.msg[0] ? when.msg : "", when.msg[0] ? ")" : "");
    return -1;
  }
  if (r != WATERMARK_REACHED) {
    rpc_call_finish(f->call, GRPC_STATUS_UNAVAILABLE, "UNAVAILABLE", "Fetch: the server is stopping");
    return -1;
  }
  meshd_error_t e = {0};
  pthread_mutex_lock(&f->sess->mu);
  objects_t *o = f->sess->objects;
  obj_t *t = o ? objects_get(o, f->ref) : NULL;
  if (t && t->kind == OBJ_TENSOR && t->tensor.state == TENSOR_FAILED)
    error_set(&e, t->tensor.fail_kind, "Fetch: tensor %llu failed: %s", (unsigned long long)f->ref,
              t->tensor.fail_msg ? t->tensor.fail_msg : "");
  pthread_mutex_unlock(&f->sess->mu);
  if (e.kind != ERR_NONE) {
    finish_error(f->call, &e);
    return -1;
  }
  return 0;
}

static void fetch_run(fetch_t *f) {
  if (fetch_wait_all(f)) return;
  char addr[256];
  if (agent_pool_address(f->ds->pool, f->rank, addr, sizeof addr)) {
    rpc_call_finish(f->call, GRPC_STATUS_UNAVAILABLE, "AGENT_LOST",
                    "Fetch: rank %u has no agent (it was lost); its tensors are gone", f->rank);
    return;
  }
  rpc_channel_t *ch = rpc_channel_create(addr, &agent_channel_opts);
  rpc_stream_t *st = rpc_stream_open(ch, "/meshd.agent.v1.Agent/Read", NULL, 0, AGENT_CALL_MS);
  Meshd__Agent__V1__ReadRequest rq = MESHD__AGENT__V1__READ_REQUEST__INIT;
  rq.session_id = f->session;
  rq.ref = f->ref;
  rq.max_chunk_bytes = (uint32_t)f->ds->chunk;
  rq.after_seq = f->after_seq;
  int rc = st ? rpc_stream_write(st, &rq.base, true) : -1;
  ProtobufCMessage *m = NULL;
  bool first = true;
  while (rc == 0 && rpc_stream_read(st, &meshd__agent__v1__data_chunk__descriptor, &m, 0) == 1) {
    const Meshd__Agent__V1__DataChunk *c = (const void *)m;
    Meshd__V1__FetchChunk out = MESHD__V1__FETCH_CHUNK__INIT;
    if (first) {
      out.part_case = MESHD__V1__FETCH_CHUNK__PART_META;
      out.meta = &f->meta;
      rpc_call_send(f->call, &out.base);
      first = false;
    }
    if (c->part_case == MESHD__AGENT__V1__DATA_CHUNK__PART_DATA) {
      while (rpc_call_pending(f->call) > 8 && !rpc_call_ended(f->call)) usleep(500);
      out.part_case = MESHD__V1__FETCH_CHUNK__PART_DATA;
      out.meta = NULL;
      out.data = c->data;
      rpc_call_send(f->call, &out.base);
    }
    protobuf_c_message_free_unpacked(m, NULL);
    m = NULL;
  }
  rpc_status_t status = {0};
  grpc_status_code code = st ? rpc_stream_finish(st, &status) : GRPC_STATUS_UNAVAILABLE;
  if (code == GRPC_STATUS_OK)
    rpc_call_finish(f->call, GRPC_STATUS_OK, NULL, "fetched");
  else
    rpc_call_finish(f->call, code, status.kind[0] ? status.kind : "AGENT_LOST",
                    "Fetch of tensor %llu from rank %u: %s", (unsigned long long)f->ref, f->rank,
                    st ? status.message : "cannot call the agent");
  if (st) rpc_stream_destroy(st);
  rpc_channel_destroy(ch);
}

static void fetch_free(fetch_t *f) {
  if (f->sess) session_release(f->sess);
  free(f->targets);
  free(f);
}

static void *fetch_main(void *arg) {
  fetch_t *f = arg;
  fetch_run(f);
  rpc_call_unref(f->call);
  fetch_free(f);
  return NULL;
}

/* Picks the rank and checks the tensor; fills f. Holds s->mu. */
static int fetch_plan(data_service_t *ds, session_t *s, const Meshd__V1__FetchRequest *rq,
                      fetch_t *f, meshd_error_t *e) {
  objects_t *o = objects_of(s);
  if (!o) return error_set(e, ERR_QUOTA, "Fetch: out of memory on the server");
  const tombstone_t *g = objects_dropped(o, rq->ref);
  if (g)
    return error_set(e, ERR_DROPPED, "Fetch: tensor %llu was dropped at command seq %llu",
                     (unsigned long long)rq->ref, (unsigned long long)g->seq);
  obj_t *t = objects_expect(o, rq->ref, OBJ_TENSOR, "Fetch: ref", e);
  if (!t) return -1;
  if (t->tensor.state == TENSOR_FAILED)
    return error_set(e, t->tensor.fail_kind, "Fetch: tensor %llu failed: %s",
                     (unsigned long long)t->ref, t->tensor.fail_msg ? t->tensor.fail_msg : "");
  const mesh_t *mesh = objects_get(o, t->tensor.mesh)->mesh;
  int64_t coords[NDSLICE_MAX_DIMS];
  bool given[NDSLICE_MAX_DIMS] = {0};
  for (size_t i = 0; i < rq->n_coords; i++) {
    int d = mesh_find_dim(mesh, rq->coords[i]->dim);
    char dims[200];
    if (d < 0 || given[d])
      return error_set(e, ERR_BAD_DIM, "Fetch: the tensor's mesh %s %s dim '%s'",
                       mesh_format(mesh, dims, sizeof dims), d < 0 ? "has no" : "was given twice the",
                       rq->coords[i]->dim);
    int64_t c = rq->coords[i]->index, n = mesh->slice.sizes[d];
    if (c < -n || c >= n)
      return error_set(e, ERR_BAD_ARGUMENT, "Fetch: coordinate %lld is out of range for dim '%s' "
                       "of size %lld", (long long)c, mesh->names[d], (long long)n);
    coords[d] = c < 0 ? c + n : c;
    given[d] = true;
  }
  char missing[200] = "";
  size_t len = 0;
  for (int d = 0; d < mesh->ndim; d++)
    if (!given[d] && len < sizeof missing)
      len += (size_t)snprintf(missing + len, sizeof missing - len, "%s'%s'", len ? ", " : "", mesh->names[d]);
  if (len)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "Fetch: give a coordinate for every dim of the tensor's mesh; missing %s",
                     missing);
  f->rank = (uint32_t)ndslice_rank_of(&mesh->slice, coords, NULL);
  f->ref = t->ref;
  meshd_error_t lost;
  if (agent_pool_check_lost(ds->pool, &f->rank, 1, mesh->losses_seen, "Fetch", &lost))
    return error_set(e, ERR_AGENT_LOST, "Fetch of tensor %llu: its shard is gone (%s)",
                     (unsigned long long)t->ref, lost.msg);
  /* The session's own last instruction there: the agent answers once the
   * session (not every session) ran through it. */
  f->after_seq = objects_last_seq(o, f->rank);
  size_t n = mesh_len(mesh);
  uint32_t *ranks = malloc(sizeof *ranks * (n ? n : 1));
  f->targets = malloc(sizeof *f->targets * (n ? n : 1));
  if (!ranks || !f->targets) {
    free(ranks);
    return error_set(e, ERR_QUOTA, "Fetch: out of memory on the server");
  }
  mesh_ranks(mesh, ranks);
  size_t k = 0;
  meshd_error_t ignored;
  for (size_t i = 0; i < n; i++) {
    /* A rank lost since the mesh was made will never catch up: its failures
     * are out of reach, the survivors' are waited for. */
    if (agent_pool_check_lost(ds->pool, &ranks[i], 1, mesh->losses_seen, "Fetch", &ignored))
      continue;
    f->targets[k++] = (watermark_target_t){ranks[i], objects_last_seq(o, ranks[i])};
  }
  f->ntargets = k;
  free(ranks);
  f->sess = s;
  session_ref(s);
  snprintf(f->session, sizeof f->session, "%s", s->id);
  command_tensor_meta(&f->meta, t, f->dims);
  return 0;
}

static void fetch_start(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  data_service_t *ds = arg;
  session_t *s = session_from_call(ds->sessions, call);
  if (!s) return;
  fetch_t *f = calloc(1, sizeof *f);
  meshd_error_t e;
  int rc = f ? 0 : error_set(&e, ERR_QUOTA, "Fetch: out of memory on the server");
  if (!rc) {
    pthread_mutex_lock(&s->mu);
    rc = fetch_plan(ds, s, (const Meshd__V1__FetchRequest *)req, f, &e);
    pthread_mutex_unlock(&s->mu);
  }
  session_release(s);
  if (rc) {
    if (f) fetch_free(f);
    finish_error(call, &e);
    return;
  }
  f->ds = ds;
  f->call = call;
  rpc_call_ref(call);
  pthread_t t;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  if (pthread_create(&t, &attr, fetch_main, f) != 0) {
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA", "Fetch: out of threads");
    rpc_call_unref(call);
    fetch_free(f);
  }
  pthread_attr_destroy(&attr);
}

/* ------------------------------------------------------------------ table */

data_service_t *data_service_create(agent_pool_t *pool, session_table_t *sessions,
                                    size_t max_message_bytes) {
  data_service_t *ds = calloc(1, sizeof *ds);
  if (!ds) return NULL;
  ds->pool = pool;
  ds->sessions = sessions;
  size_t limit = max_message_bytes ? max_message_bytes : 4u << 20;
  ds->chunk = limit > 2048 ? limit / 2 : 1024; /* room for the envelope */
  if (ds->chunk > (1u << 20)) ds->chunk = 1u << 20;
  return ds;
}

static const rpc_method_t methods[] = {
    {
        .path = "/meshd.v1.TensorService/Upload",
        .kind = RPC_CLIENT_STREAMING,
        .request = &meshd__v1__upload_chunk__descriptor,
        .on_start = upload_start,
        .on_message = upload_message,
        .on_end = upload_end,
    },
    {
        .path = "/meshd.v1.TensorService/Fetch",
        .kind = RPC_SERVER_STREAMING,
        .request = &meshd__v1__fetch_request__descriptor,
        .on_start = fetch_start,
    },
};

const rpc_method_t *data_service_methods(size_t *n) {
  *n = sizeof methods / sizeof methods[0];
  return methods;
}

void data_service_destroy(data_service_t *ds) { free(ds); }
