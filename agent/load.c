#include "load.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "agent.h"
#include "log.h"
#include "tensor_file.h"
#include "url_fetch.h"
#include "url_policy.h"

/* Bytes gathered before each copy into the tensor (one device copy per
 * STAGE_BYTES on a GPU, instead of one per network read). */
#define STAGE_BYTES (8u << 20)

/* "InspectUrl on rank 3: " in front of e's message. */
static int on_rank(meshd_error_t *e, const char *what) {
  char head[64];
  int64_t r = atomic_load(&agent_rank);
  if (r >= 0) snprintf(head, sizeof head, "%.20s on rank %" PRId64, what, r);
  else snprintf(head, sizeof head, "%.20s", what);
  error_prefix(e, head, ": ");
  return -1;
}

/* ------------------------------------------------------------------ Load */

/* "Load: " in front (the server adds the rank of a failure it reports). */
static int prefixed(meshd_error_t *e, const char *what) {
  error_prefix(e, what, ": ");
  return -1;
}

/* What Agent/LoadProgress reads: a ring of the latest loads. */
typedef struct tracked {
  char session[80];
  uint64_t ref;
  uint64_t total;
  _Atomic uint64_t done;
  _Atomic int state; /* 0 running, 1 done, 2 failed */
} tracked_t;

static pthread_mutex_t tracked_mu = PTHREAD_MUTEX_INITIALIZER;
static tracked_t tracked[LOAD_TRACKED];
static size_t tracked_next;

/* A slot for a starting load: a free one, else the oldest finished one, else
 * (LOAD_TRACKED loads running at once) none. */
static tracked_t *track(const char *session, uint64_t ref, uint64_t total) {
  pthread_mutex_lock(&tracked_mu);
  tracked_t *t = NULL;
  for (size_t i = 0; i < LOAD_TRACKED && !t; i++) {
    tracked_t *c = &tracked[(tracked_next + i) % LOAD_TRACKED];
    if (!c->session[0] || atomic_load(&c->state) != 0) {
      t = c;
      tracked_next = (tracked_next + i + 1) % LOAD_TRACKED;
    }
  }
  if (t) {
    snprintf(t->session, sizeof t->session, "%s", session);
    t->ref = ref;
    t->total = total;
    atomic_store(&t->done, 0);
    atomic_store(&t->state, 0);
  }
  pthread_mutex_unlock(&tracked_mu);
  return t;
}

static void track_end(tracked_t *t, bool ok) {
  if (!t) return;
  if (ok) atomic_store(&t->done, t->total);
  atomic_store(&t->state, ok ? 1 : 2);
}

typedef struct sink {
  backend_t *b;
  backend_stream_t *bs; /* the load's stream: the tensor's memory is in its order */
  agent_tensor_t *t;
  uint8_t *host;      /* the tensor's first byte when it is host memory (cpu), else NULL */
  tracked_t *progress;
  uint64_t counted;   /* bytes of this range counted in progress */
  uint64_t base;      /* the range's first byte in the tensor */
  uint8_t *stage;
  uint64_t stage_pos; /* range position of stage[0] */
  size_t staged;
} sink_t;

/* stage[0, staged) into the tensor at base + stage_pos. */
static int flush(sink_t *k, meshd_error_t *e) {
  if (!k->staged) return 0;
  agent_tensor_t v = {.storage = k->t->storage};
  v.meta.dtype = DTYPE_UINT8;
  v.meta.layout.ndim = 1;
  v.meta.layout.sizes[0] = (int64_t)k->staged;
  layout_make_contiguous(&v.meta.layout);
  v.meta.layout.offset = k->t->meta.layout.offset * (int64_t)dtype_size(k->t->meta.dtype) +
                         (int64_t)(k->base + k->stage_pos);
  int rc = k->b->ops->from_host(k->b, k->bs, &v, k->stage, e);
  k->stage_pos += k->staged;
  k->staged = 0;
  return rc;
}

static int sink_bytes(void *arg, uint64_t pos, const void *bytes, size_t n, meshd_error_t *e) {
  sink_t *k = arg;
  if (k->progress && pos + n > k->counted) { /* a retry counts nothing twice */
    atomic_fetch_add(&k->progress->done, pos + n - k->counted);
    k->counted = pos + n;
  }
  if (k->host) {
    memcpy(k->host + k->base + pos, bytes, n);
    return 0;
  }
  if (pos != k->stage_pos + k->staged) { /* a retry: the range comes again from pos */
    k->stage_pos = pos;
    k->staged = 0;
  }
  const uint8_t *p = bytes;
  while (n) {
    size_t take = STAGE_BYTES - k->staged < n ? STAGE_BYTES - k->staged : n;
    memcpy(k->stage + k->staged, p, take);
    k->staged += take, p += take, n -= take;
    if (k->staged == STAGE_BYTES && flush(k, e)) return -1;
  }
  return 0;
}

/* A split along a later dim is a range per row of the rank's block (tensor_file_
 * slice_t). Rows whose gaps are at most COALESCE_GAP are asked as one range
 * and the gaps read through: a request costs a round trip (tens of ms from an
 * object store), which reads more bytes than that gap; a 4096-row weight split
 * along dim 1 over 8 ranks was 4096 requests per rank, now one per COALESCE_SPAN. */
#define COALESCE_GAP (256u << 10)
#define COALESCE_SPAN (64ull << 20)

/* A request over `count` rows `stride` apart, of which the first `length`
 * bytes each are the rank's: those go to the sink at their place in the
 * tensor (row j's at j * length, past k->base), the rest is skipped. */
typedef struct gather {
  sink_t *k;
  uint64_t stride, length, count;
} gather_t;

static int gather_bytes(void *arg, uint64_t pos, const void *bytes, size_t n, meshd_error_t *e) {
  gather_t *g = arg;
  const uint8_t *p = bytes;
  while (n) {
    uint64_t j = pos / g->stride, within = pos % g->stride;
    if (j >= g->count) return 0; /* (the request ends with the last row's bytes) */
    uint64_t room = within < g->length ? g->length - within : g->stride - within;
    size_t take = room < n ? (size_t)room : n;
    if (within < g->length && sink_bytes(g->k, j * g->length + within, p, take, e)) return -1;
    p += take, n -= take, pos += take;
  }
  return 0;
}

static int fetch_slice(backend_t *b, backend_stream_t *bs, const Meshd__Agent__V1__LoadOp *op,
                       agent_tensor_t *t, tracked_t *progress, url_share_t *share,
                       bool (*stop)(void *), void *stop_arg, meshd_error_t *e);

/* The header of url (size bytes, the version o expects) parsed into *f, its
 * bytes in *head (the caller frees both, whatever the result): 64 KiB, then
 * at most once more what the header says it needs. 0, or -1 with e. */
static int read_header(const char *url, const url_fetch_opts_t *o, uint64_t size, uint8_t **head,
                       tensor_file_t *f, meshd_error_t *e) {
  char shown[512];
  url_redact(url, shown, sizeof shown);
  uint64_t need = TENSOR_FILE_PROBE_BYTES;
  int rc = TENSOR_FILE_NEED_MORE;
  tensor_file_opts_t fo = {.file_size = size};
  for (int round = 0; rc == TENSOR_FILE_NEED_MORE && round < 2; round++) {
    uint64_t len = need < size ? need : size;
    if (len > TENSOR_FILE_MAX_HEADER + 8u) len = TENSOR_FILE_MAX_HEADER + 8u;
    free(*head);
    if (!(*head = malloc(len ? len : 1)))
      return error_set(e, ERR_QUOTA, "out of memory for a %" PRIu64 "-byte header", len);
    if (len && url_fetch_range(url, 0, len, *head, o, NULL, e)) return -1;
    if (!len)
      return error_set(e, ERR_BAD_ARGUMENT, "%s is empty: no .npy or safetensors file", shown);
    rc = tensor_file_parse(*head, (size_t)len, &fo, f, &need, e);
    if (rc < 0) {
      error_prefix(e, shown, ": ");
      return -1;
    }
  }
  if (rc != TENSOR_FILE_OK)
    return error_set(e, ERR_BAD_ARGUMENT, "the header is longer than it said");
  return 0;
}

/* This rank's own copy of a file:// checkpoint (the same path on another
 * host's disk, with its own mtime): its size agreed already; its header must
 * hold the tensor where the inspection found it (dtype, shape, byte offset),
 * or the copy is another file. A tensor that is the whole file (raw bytes)
 * has no header: its size is all there is to compare. 0, or -1 with e. */
static int copy_agrees(const char *url, const url_fetch_opts_t *o, uint64_t size,
                       const tensor_file_entry_t *want, const char *shown, meshd_error_t *e) {
  if (want->offset == 0 && want->nbytes == size) return 0;
  uint8_t *head = NULL;
  tensor_file_t f = {0};
  int rc = read_header(url, o, size, &head, &f, e);
  bool found = false;
  for (size_t i = 0; rc == 0 && i < f.count && !found; i++) {
    const tensor_file_entry_t *t = &f.tensors[i];
    found = t->offset == want->offset && t->nbytes == want->nbytes && t->dtype == want->dtype &&
            t->ndim == want->ndim &&
            !memcmp(t->shape, want->shape, (size_t)t->ndim * sizeof *t->shape);
  }
  free(head);
  tensor_file_free(&f);
  if (rc) return -1;
  if (found) return 0;
  char sh[LAYOUT_SHAPE_BUF];
  layout_format_shape(want->shape, want->ndim, sh, sizeof sh);
  return error_set(e, ERR_BAD_ARGUMENT, "this rank's copy of %s is not the file inspected: its "
                   "header has no %s %s tensor at byte %" PRIu64 " (each host's copy must be the "
                   "same file)", shown, dtype_name(want->dtype), sh, want->offset);
}

/* Whether this rank may read the version it found (`version`, its own size
 * check's) of the one inspected (l->version): the same, or for file:// on
 * another machine or another file (a per-host copy, whose mtime is its own)
 * a copy that agrees (copy_agrees). The file the inspection read must still
 * be the version it read: a checkpoint saved again in place, or another file
 * renamed into its place (the same machine and device, another inode and
 * mtime), is refused (url_version_match). */
static int version_agrees(const Meshd__V1__Load *l, const char *version, const url_fetch_opts_t *o,
                          uint64_t size, const tensor_file_entry_t *ent, const char *shown,
                          meshd_error_t *e) {
  char mine[128];
  bool file = strncasecmp(l->url, "file:", 5) == 0;
  const char *id = file ? url_file_identity(l->url, mine, sizeof mine) : NULL;
  url_version_match_t m = url_version_match(l->version, version, id);
  if (m == URL_VERSION_SAME) return 0;
  if (m == URL_VERSION_COPY) return copy_agrees(l->url, o, size, ent, shown, e);
  return error_set(e, ERR_BAD_ARGUMENT, "%s changed since it was inspected (it was %s, now %s%s); "
                   "load it again", shown, l->version, *version ? version : "unmarked",
                   m == URL_VERSION_REPLACED ? ": another file on the same filesystem, put in its "
                   "place since, or a copy that did not keep the mtime" : "");
}

int load_run(backend_t *b, backend_stream_t *bs, const char *session,
             const Meshd__Agent__V1__LoadOp *op, agent_tensor_t *t, bool (*stop)(void *),
             void *stop_arg, meshd_error_t *e) {
  uint64_t bytes = (uint64_t)layout_numel(&t->meta.layout) * dtype_size(t->meta.dtype);
  tracked_t *p = track(session, op->result ? op->result->ref : 0, bytes);
  /* One connection for the load's size check and all its ranges (a range
   * per row when split along a later dim); NULL (no memory): one each. */
  url_share_t *share = url_share_new();
  int rc = fetch_slice(b, bs, op, t, p, share, stop, stop_arg, e);
  url_share_free(share);
  track_end(p, rc == 0);
  return rc;
}

static int fetch_slice(backend_t *b, backend_stream_t *bs, const Meshd__Agent__V1__LoadOp *op,
                       agent_tensor_t *t, tracked_t *progress, url_share_t *share,
                       bool (*stop)(void *), void *stop_arg, meshd_error_t *e) {
  const Meshd__V1__Load *l = op->load;
  url_allow_t allow;
  url_fetch_opts_t o;
  url_policy_from_proto(op->policy, &allow, &o);
  o.share = share;
  o.stop = stop;
  o.stop_arg = stop_arg;
  tensor_file_entry_t ent = {.name = (char *)"", .dtype = (dtype_t)l->dtype, .offset = l->offset};
  ent.ndim = (int)l->n_shape;
  uint64_t numel = 1;
  for (size_t i = 0; i < l->n_shape && i < LAYOUT_MAX_DIMS; i++) {
    ent.shape[i] = l->shape[i];
    numel *= (uint64_t)l->shape[i];
  }
  ent.nbytes = numel * dtype_size(ent.dtype);
  uint64_t want = l->file_size ? l->file_size : l->offset + ent.nbytes;
  uint64_t size = 0;
  char version[URL_VERSION_MAX];
  if (url_fetch_size_version(l->url, &o, &size, version, sizeof version, NULL, e))
    return prefixed(e, "Load");
  char shown[512];
  url_redact(l->url, shown, sizeof shown);
  if (size != want) {
    if (l->file_size)
      error_set(e, ERR_BAD_ARGUMENT,
                "%s is %" PRIu64 " bytes, but %" PRIu64 " when it was inspected: the file "
                "changed; load it again", shown, size, want);
    else {
      char sh[LAYOUT_SHAPE_BUF];
      layout_format_shape(ent.shape, ent.ndim, sh, sizeof sh);
      error_set(e, ERR_BAD_ARGUMENT,
                "%s is %" PRIu64 " bytes, but %s %s is %" PRIu64 " bytes: check dtype= and shape=",
                shown, size, dtype_name(ent.dtype), sh, l->offset + ent.nbytes);
    }
    return prefixed(e, "Load");
  }
  /* Every range carries the version this rank checked: a file saved again
   * between two of them fails the load instead of mixing two versions. */
  o.expect_version = version;
  o.expect_size = size; /* and the size: a server without validators still says it */
  /* Rewritten at the same size since the inspection (a checkpoint saved again):
   * each rank compares, so that none reads another version than the rest. */
  if (version_agrees(l, version, &o, size, &ent, shown, e)) return prefixed(e, "Load");
  tensor_file_slice_t sl = {.first = ent.offset, .length = ent.nbytes, .count = ent.nbytes ? 1 : 0};
  if (op->parts > 1 && tensor_file_shard(&ent, l->dim, op->parts, op->coordinate, &sl, e))
    return prefixed(e, "Load");
  if (sl.length * sl.count !=
      (uint64_t)layout_numel(&t->meta.layout) * dtype_size(t->meta.dtype)) {
    error_set(e, ERR_BAD_ARGUMENT, "this rank's slice of %s is %" PRIu64 " bytes, not the "
              "result's", shown, sl.length * sl.count);
    return prefixed(e, "Load");
  }
  sink_t k = {.b = b, .bs = bs, .t = t, .progress = progress};
  /* cpu: the tensor is host memory, where curl's bytes go straight. */
  if (b->ops == &cpu_backend_ops)
    k.host = (uint8_t *)t->storage->data + t->meta.layout.offset * (int64_t)dtype_size(t->meta.dtype);
  /* Rows per request: 1, or as many as fit in COALESCE_SPAN (and the fetch
   * limit) when the gaps between them are small. */
  uint64_t per = 1;
  if (sl.count > 1 && sl.stride - sl.length <= COALESCE_GAP) {
    uint64_t cap = o.max_bytes && o.max_bytes < COALESCE_SPAN ? o.max_bytes : COALESCE_SPAN;
    per = cap >= sl.length ? (cap - sl.length) / sl.stride + 1 : 1;
    if (per > sl.count) per = sl.count;
  }
  uint64_t stage = per * sl.length < STAGE_BYTES ? per * sl.length : STAGE_BYTES;
  if (sl.count && !k.host && !(k.stage = malloc((size_t)stage))) {
    error_set(e, ERR_QUOTA, "out of host memory for a %u-byte staging buffer", STAGE_BYTES);
    return prefixed(e, "Load");
  }
  for (uint64_t i = 0; i < sl.count; i += per) {
    tensor_file_range_t r = tensor_file_slice_range(&sl, i);
    uint64_t m = sl.count - i < per ? sl.count - i : per;
    gather_t g = {.k = &k, .stride = sl.stride, .length = sl.length, .count = m};
    k.base = i * sl.length;
    k.stage_pos = 0;
    k.staged = 0;
    k.counted = 0;
    int rc = m == 1 ? url_fetch_range_to(l->url, r.offset, r.length, sink_bytes, &k, &o, NULL, e)
                    : url_fetch_range_to(l->url, r.offset, (m - 1) * sl.stride + sl.length,
                                         gather_bytes, &g, &o, NULL, e);
    if (rc || flush(&k, e)) {
      free(k.stage);
      return prefixed(e, "Load");
    }
  }
  free(k.stage);
  return 0;
}

/* ------------------------------------------------------------------ LoadProgress */

#define PROGRESS_REFS_MAX 4096

void load_progress_start(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  (void)arg;
  const Meshd__Agent__V1__LoadProgressRequest *rq = (const Meshd__Agent__V1__LoadProgressRequest *)req;
  if (rq->n_refs > PROGRESS_REFS_MAX) {
    rpc_call_finish(call, GRPC_STATUS_INVALID_ARGUMENT, "BAD_ARGUMENT",
                    "LoadProgress: %zu refs, at most %d", rq->n_refs, PROGRESS_REFS_MAX);
    return;
  }
  size_t n = rq->n_refs;
  Meshd__V1__LoadProgress *v = calloc(n ? n : 1, sizeof *v);
  Meshd__V1__LoadProgress **pv = calloc(n ? n : 1, sizeof *pv);
  if (!v || !pv) {
    free(v);
    free(pv);
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA", "LoadProgress: out of memory");
    return;
  }
  pthread_mutex_lock(&tracked_mu);
  for (size_t i = 0; i < n; i++) {
    meshd__v1__load_progress__init(&v[i]);
    v[i].ref = rq->refs[i];
    pv[i] = &v[i];
    for (size_t j = 0; j < LOAD_TRACKED; j++) {
      tracked_t *t = &tracked[j];
      if (t->ref != rq->refs[i] || !t->session[0] || strcmp(t->session, rq->session_id)) continue;
      v[i].done_bytes = atomic_load(&t->done);
      v[i].total_bytes = t->total;
      v[i].failed = atomic_load(&t->state) == 2;
    }
  }
  pthread_mutex_unlock(&tracked_mu);
  Meshd__V1__LoadProgressReply reply = MESHD__V1__LOAD_PROGRESS_REPLY__INIT;
  reply.n_loads = n;
  reply.loads = pv;
  rpc_call_reply(call, &reply.base);
  free(v);
  free(pv);
}

/* ------------------------------------------------------------------ InspectUrl */

static _Atomic int inspecting;

typedef struct inspect {
  rpc_call_t *call; /* referenced */
  Meshd__Agent__V1__InspectUrlRequest *rq; /* owned copy */
} inspect_t;

static void inspect_fail(rpc_call_t *call, meshd_error_t *e) {
  on_rank(e, "InspectUrl");
  rpc_call_finish(call, error_kind_code(e->kind), error_kind_name(e->kind), "%s", e->msg);
}

/* An InspectUrl whose caller gave up (its deadline, INSPECT_CALL_MS on the
 * server) stops fetching: a server that sends a byte a second holds none of
 * the LOAD_INSPECTS_MAX slots past that. */
static bool inspect_gone(void *arg) { return rpc_call_ended(arg); }

/* The version an inspection answers: a file's "mtime S" followed by which
 * file it is on this machine (URL_FILE_MARK), so that the ranks reading their
 * own host's copy check that copy, not this one's mtime (version_agrees). */
static void mark_file(const char *url, const char *version, char *out, size_t n) {
  char id[128];
  int w = -1;
  if (strncmp(version, "mtime ", 6) == 0 && *url_file_identity(url, id, sizeof id))
    w = snprintf(out, n, "%s" URL_FILE_MARK "%s", version, id);
  if (w < 0 || (size_t)w >= n) /* (a cut mark would name no file: then unmarked, compared as is) */
    snprintf(out, n, "%s", version);
}

static void inspect_url(rpc_call_t *call, const Meshd__Agent__V1__InspectUrlRequest *rq) {
  url_allow_t allow;
  url_fetch_opts_t o;
  url_policy_from_proto(rq->policy, &allow, &o);
  o.stop = inspect_gone;
  o.stop_arg = call;
  o.share = url_share_new(); /* the HEAD and the header's reads on one connection */
  meshd_error_t e = {0};
  uint64_t size = 0;
  uint8_t *head = NULL;
  tensor_file_t f = {0};
  char version[URL_VERSION_MAX], marked[URL_VERSION_MAX];
  if (url_fetch_size_version(rq->url, &o, &size, version, sizeof version, NULL, &e)) goto fail;
  mark_file(rq->url, version, marked, sizeof marked);
  if (rq->size_only) { /* a raw load's: the version its ranks must all read */
    Meshd__V1__InspectUrlReply raw = MESHD__V1__INSPECT_URL_REPLY__INIT;
    raw.format = "raw";
    raw.file_size = size;
    raw.version = marked;
    raw.metadata_json = "";
    rpc_call_reply(call, &raw.base);
    url_share_free(o.share);
    return;
  }
  o.expect_version = version; /* the header read is of the version answered */
  o.expect_size = size;
  if (read_header(rq->url, &o, size, &head, &f, &e)) goto fail;
  Meshd__V1__InspectUrlReply reply = MESHD__V1__INSPECT_URL_REPLY__INIT;
  reply.format = f.format == TENSOR_FILE_NPY                   ? "npy"
                 : f.format == TENSOR_FILE_SAFETENSORS_INDEX ? "safetensors_index"
                                                             : "safetensors";
  reply.file_size = size;
  reply.version = marked;
  reply.metadata_json = f.metadata_json ? f.metadata_json : "";
  Meshd__V1__UrlTensor *ts = calloc(f.count ? f.count : 1, sizeof *ts);
  Meshd__V1__UrlTensor **tp = calloc(f.count ? f.count : 1, sizeof *tp);
  if (!ts || !tp) {
    free(ts);
    free(tp);
    error_set(&e, ERR_QUOTA, "out of memory for %zu tensors", f.count);
    goto fail;
  }
  for (size_t i = 0; i < f.count; i++) {
    meshd__v1__url_tensor__init(&ts[i]);
    ts[i].name = f.tensors[i].name;
    ts[i].dtype = (Meshd__V1__DType)f.tensors[i].dtype;
    ts[i].n_shape = (size_t)f.tensors[i].ndim;
    ts[i].shape = f.tensors[i].shape;
    ts[i].offset = f.tensors[i].offset;
    ts[i].nbytes = f.tensors[i].nbytes;
    ts[i].file = f.tensors[i].file ? f.tensors[i].file : "";
    tp[i] = &ts[i];
  }
  reply.n_tensors = f.count;
  reply.tensors = tp;
  size_t packed = protobuf_c_message_get_packed_size(&reply.base);
  if (packed > (size_t)rpc_call_max_message(call)) {
    char shown[512];
    error_set(&e, ERR_QUOTA, "%s names %zu tensors, whose description is %zu bytes: over the "
              "%d-byte --max-message-bytes; raise it on the agents and the server (a server's "
              "local agents take its own)",
              url_redact(rq->url, shown, sizeof shown), f.count, packed,
              rpc_call_max_message(call));
    free(ts);
    free(tp);
    goto fail;
  }
  rpc_call_reply(call, &reply.base);
  free(ts);
  free(tp);
  free(head);
  tensor_file_free(&f);
  url_share_free(o.share);
  return;
fail:
  free(head);
  tensor_file_free(&f);
  url_share_free(o.share);
  inspect_fail(call, &e);
}

static void *inspect_main(void *arg) {
  inspect_t *in = arg;
  pthread_setname_np(pthread_self(), "load-inspect");
  inspect_url(in->call, in->rq);
  protobuf_c_message_free_unpacked(&in->rq->base, NULL);
  rpc_call_unref(in->call);
  free(in);
  atomic_fetch_sub(&inspecting, 1);
  return NULL;
}

void load_inspect_start(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  (void)arg;
  if (atomic_fetch_add(&inspecting, 1) >= LOAD_INSPECTS_MAX) {
    atomic_fetch_sub(&inspecting, 1);
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA",
                    "InspectUrl: %d are running on this agent, the most it runs at once",
                    LOAD_INSPECTS_MAX);
    return;
  }
  /* The request belongs to the layer until on_start returns: a copy. */
  size_t len = protobuf_c_message_get_packed_size(req);
  uint8_t *buf = malloc(len ? len : 1);
  inspect_t *in = calloc(1, sizeof *in);
  if (buf && in) {
    protobuf_c_message_pack(req, buf);
    in->rq = meshd__agent__v1__inspect_url_request__unpack(NULL, len, buf);
  }
  free(buf);
  pthread_t th;
  pthread_attr_t at;
  pthread_attr_init(&at);
  pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
  if (in && in->rq) {
    in->call = call;
    rpc_call_ref(call);
    if (pthread_create(&th, &at, inspect_main, in) == 0) {
      pthread_attr_destroy(&at);
      return;
    }
    rpc_call_unref(call);
  }
  pthread_attr_destroy(&at);
  if (in && in->rq) protobuf_c_message_free_unpacked(&in->rq->base, NULL);
  free(in);
  atomic_fetch_sub(&inspecting, 1);
  rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA", "InspectUrl: out of memory");
}
