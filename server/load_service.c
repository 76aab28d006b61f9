#include "load_service.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "commands.h"
#include "log.h"
#include "runtime.h"
#include "meshd/agent/v1/agent.pb-c.h"
#include "objects.h"
#include "session_service.h"

#define AGENT_CONNECT_MS 5000
/* An inspection reads at most two header pieces; the transfer timeout of the
 * policy bounds each, this the whole call. */
#define INSPECT_CALL_MS 120000
/* The largest InspectUrl reply taken from an agent (whose own limit is its
 * --max-message-bytes), as much as the Python client takes. */
#define INSPECT_REPLY_MAX (64 << 20)

struct load_service {
  agent_pool_t *pool;
  session_table_t *sessions;
  const url_policy_t *urls;
  pthread_mutex_t mu;
  pthread_cond_t idle;
  int running;    /* helper threads, both kinds */
  int inspecting; /* of which InspectUrl's (at most LOAD_INSPECTS_MAX) */
  /* The session of each running LoadProgress ("": a free slot): progress looks
   * have slots of their own, at most LOAD_PROGRESS_PER_SESSION a session, so
   * that one session's pollers of a hung agent (each look waits 2 s) keep
   * neither InspectUrl nor other sessions' looks out. */
  char progress_of[LOAD_PROGRESS_MAX][SESSION_ID_LEN + 1];
};

typedef struct inspect {
  load_service_t *ls;
  rpc_call_t *call; /* referenced */
  uint32_t rank;
  char *url;
  bool size_only;
} inspect_t;

static void finish_error(rpc_call_t *call, const meshd_error_t *e) {
  rpc_call_finish(call, error_kind_code(e->kind), error_kind_name(e->kind), "%s", e->msg);
}

/* Gives back a helper's slot: an InspectUrl's (slot < 0) or LoadProgress slot. */
static void done(load_service_t *ls, int slot) {
  pthread_mutex_lock(&ls->mu);
  if (slot < 0) ls->inspecting--;
  else ls->progress_of[slot][0] = '\0';
  if (--ls->running == 0) pthread_cond_broadcast(&ls->idle);
  pthread_mutex_unlock(&ls->mu);
}

/* Runs fn(arg) on a detached helper thread that owns a reference to call and
 * a slot (fn ends with rpc_call_unref and done(ls, *slot)): with session NULL
 * one of the LOAD_INSPECTS_MAX InspectUrl slots (*slot = -1), else one of the
 * LOAD_PROGRESS_MAX LoadProgress slots, LOAD_PROGRESS_PER_SESSION at most for
 * that session. 0, or -1 having answered the call (no slot, no thread): the
 * caller then frees arg. */
static int spawn(load_service_t *ls, rpc_call_t *call, const char *what, const char *session,
                 int *slot, void *(*fn)(void *), void *arg) {
  pthread_mutex_lock(&ls->mu);
  bool room = false;
  int mine = 0, free_slot = -1;
  if (!session) {
    room = ls->inspecting < LOAD_INSPECTS_MAX;
    if (room) ls->inspecting++;
  } else {
    for (int i = 0; i < LOAD_PROGRESS_MAX; i++) {
      if (!ls->progress_of[i][0]) {
        if (free_slot < 0) free_slot = i;
      } else if (strcmp(ls->progress_of[i], session) == 0) {
        mine++;
      }
    }
    room = free_slot >= 0 && mine < LOAD_PROGRESS_PER_SESSION;
    if (room) snprintf(ls->progress_of[free_slot], sizeof ls->progress_of[free_slot], "%s", session);
  }
  *slot = session ? free_slot : -1;
  if (room) ls->running++;
  pthread_mutex_unlock(&ls->mu);
  if (!room) {
    if (!session)
      rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA",
                      "%s: %d inspections are running, the most this server runs at once; "
                      "retry", what, LOAD_INSPECTS_MAX);
    else if (mine >= LOAD_PROGRESS_PER_SESSION)
      rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA",
                      "%s: this session has %d progress calls running, the most it runs at "
                      "once; retry", what, LOAD_PROGRESS_PER_SESSION);
    else
      rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA",
                      "%s: %d progress calls are running, the most this server runs at once; "
                      "retry", what, LOAD_PROGRESS_MAX);
    return -1;
  }
  rpc_call_ref(call);
  if (runtime_spawn_detached("load-progress", fn, arg) == 0) return 0;
  rpc_call_unref(call);
  done(ls, *slot);
  rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA", "%s: out of threads", what);
  return -1;
}

/* The agent's call ends with its caller's: a client that gave up (or set a
 * short deadline) holds no inspection, here or on the agent, past that. */
static int inspect_ms(rpc_call_t *call) {
  int64_t left = rpc_call_deadline_left_ms(call);
  return left >= 0 && left < INSPECT_CALL_MS ? (int)(left ? left : 1) : INSPECT_CALL_MS;
}

/* The client of an InspectUrl gave up: its agent's call is cancelled, which
 * stops the agent's fetch and frees its inspection slot (a call left to run
 * held one for up to INSPECT_CALL_MS). */
static bool client_gone(void *call) { return rpc_call_ended(call); }

static void *inspect_main(void *arg) {
  inspect_t *in = arg;
  load_service_t *ls = in->ls;
  agent_target_t t;
  rpc_channel_t *ch = NULL;
  Meshd__Agent__V1__InspectUrlRequest rq = MESHD__AGENT__V1__INSPECT_URL_REQUEST__INIT;
  Meshd__Agent__V1__UrlPolicy policy;
  url_policy_to_proto(ls->urls, &policy);
  rq.url = in->url;
  rq.policy = &policy;
  rq.size_only = in->size_only;
  ProtobufCMessage *reply = NULL;
  rpc_status_t st = {0};
  bool targeted = agent_pool_target(ls->pool, in->rank, AGENT_CONNECT_MS, &t) == 0;
  /* The reply is as large as the agent's --max-message-bytes lets it be (an index
   * of a big checkpoint names every tensor); rpc_call_reply then holds it to ours. */
  if (targeted) t.opts.max_message_bytes = INSPECT_REPLY_MAX;
  if (!targeted || !(ch = rpc_channel_create(t.address, &t.opts))) {
    rpc_call_finish(in->call, GRPC_STATUS_UNAVAILABLE, "AGENT_LOST",
                    "InspectUrl: rank %u has no agent", in->rank);
  } else if (rpc_unary_until(ch, "/meshd.agent.v1.Agent/InspectUrl", &rq.base,
                             &meshd__v1__inspect_url_reply__descriptor, &reply, t.md, 1,
                             inspect_ms(in->call), client_gone, in->call,
                             &st) != GRPC_STATUS_OK) {
    /* The agent's kind and message are the answer (they name the URL and rank). */
    if (st.kind[0])
      rpc_call_finish(in->call, st.code, st.kind, "%s", st.message);
    else /* gRPC's own: say whose */
      rpc_call_finish(in->call, st.code,
                      st.code == GRPC_STATUS_RESOURCE_EXHAUSTED ? "QUOTA" : "AGENT_LOST",
                      "InspectUrl: rank %u: %s", in->rank, st.message);
  } else {
    rpc_call_reply(in->call, reply);
  }
  if (reply) protobuf_c_message_free_unpacked(reply, NULL);
  if (ch) rpc_channel_destroy(ch);
  rpc_call_unref(in->call);
  free(in->url);
  free(in);
  done(ls, -1);
  return NULL;
}

/* The rank that reads: the mesh's first, or with no mesh the first healthy one. */
static int pick_rank(load_service_t *ls, session_t *s, uint64_t mesh_ref, uint32_t *rank,
                     meshd_error_t *e) {
  if (mesh_ref) {
    int rc = -1;
    pthread_mutex_lock(&s->mu);
    objects_t *o = s->objects;
    obj_t *m = o ? objects_expect(o, mesh_ref, OBJ_MESH, "InspectUrl: mesh", e) : NULL;
    if (!o) error_set(e, ERR_BAD_ARGUMENT, "InspectUrl: mesh %llu: the session has no meshes",
                      (unsigned long long)mesh_ref);
    if (m && mesh_len(m->mesh)) {
      uint32_t *r = malloc(sizeof *r * mesh_len(m->mesh));
      if (r) {
        mesh_ranks(m->mesh, r);
        *rank = r[0];
        rc = 0;
        free(r);
      } else {
        error_set(e, ERR_QUOTA, "InspectUrl: out of memory");
      }
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
  }
  size_t world = 0;
  bool *healthy = agent_pool_healthy_map(ls->pool, &world);
  for (size_t r = 0; healthy && r < world; r++)
    if (healthy[r]) {
      free(healthy);
      *rank = (uint32_t)r;
      return 0;
    }
  free(healthy);
  return error_set(e, ERR_AGENT_LOST, "InspectUrl: no healthy agent");
}

static void inspect_start(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  load_service_t *ls = arg;
  const Meshd__V1__InspectUrlRequest *rq = (const Meshd__V1__InspectUrlRequest *)req;
  session_t *s = session_from_call(ls->sessions, call);
  if (!s) return;
  meshd_error_t e = {0};
  uint32_t rank = 0;
  int rc = -1;
  if (!rq->url || !*rq->url) error_set(&e, ERR_BAD_ARGUMENT, "InspectUrl: the url is empty");
  else if (strlen(rq->url) > 8192)
    error_set(&e, ERR_BAD_ARGUMENT, "InspectUrl: the url is %zu characters; at most 8192",
              strlen(rq->url));
  else if (!url_policy_check(ls->urls, rq->url, &e))
    rc = pick_rank(ls, s, rq->mesh, &rank, &e);
  session_release(s);
  if (rc) {
    finish_error(call, &e);
    return;
  }
  inspect_t *in = calloc(1, sizeof *in);
  char *url = strdup(rq->url);
  if (!in || !url) {
    free(in);
    free(url);
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA", "InspectUrl: out of memory");
    return;
  }
  *in = (inspect_t){.ls = ls, .call = call, .rank = rank, .url = url, .size_only = rq->size_only};
  int slot;
  if (spawn(ls, call, "InspectUrl", NULL, &slot, inspect_main, in)) {
    free(in);
    free(url);
  }
}

/* ------------------------------------------------------------------ LoadProgress */

#define PROGRESS_REFS_MAX 256

/* One overall deadline for a look: every rank is asked at once, and whatever
 * has not answered by then is named in the reply instead of holding it up. */
#define PROGRESS_DEADLINE_MS 2000
/* After the deadline, what the calls still running get before they are
 * cancelled (gRPC ends them at the deadline itself; this only bounds a
 * straggling completion). */
#define PROGRESS_SLACK_MS 500

typedef struct progress progress_t;

/* One rank's Agent/LoadProgress, read as a pull (rpc.h): its callback runs on
 * the rpc layer's client thread, so the ranks are asked concurrently without a
 * thread each. */
typedef struct progress_ask {
  progress_t *p;
  uint32_t rank;
  size_t k;                 /* refs asked */
  uint64_t *refs;           /* [k] */
  size_t *which;            /* [k]: index into p->v */
  rpc_channel_t *ch;
  rpc_pull_t *pull;
  ProtobufCMessage *reply;  /* under p->mu */
  bool ended;               /* under p->mu: the pull delivered its end */
  rpc_status_t st;          /* the call's status, once ended */
} progress_ask_t;

struct progress {
  load_service_t *ls;
  int slot; /* its LoadProgress slot (spawn) */
  rpc_call_t *call; /* referenced */
  char session[80];
  size_t n;
  Meshd__V1__LoadProgress *v; /* per ref: total and failed known, done summed */
  uint32_t *ranks;            /* every rank of every ref's mesh, deduplicated */
  size_t nranks;
  bool *on;                   /* [ref * nranks + rank index]: the ref lives there */
  /* [rank index]: the rank ran everything the session sent it, so it holds its
   * part of each ref that did not fail (a failure is recorded before the
   * watermark moves): counted whole without asking its agent, which keeps only
   * its latest loads in mind. */
  bool *ran;
  uint64_t *share;            /* [ref]: its bytes on one rank */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  size_t pending;             /* asks whose pull has not ended */
};

static void progress_free(progress_t *p) {
  free(p->v);
  free(p->ranks);
  free(p->on);
  free(p->ran);
  free(p->share);
  free(p);
}

static void ask_got(rpc_pull_t *pull, ProtobufCMessage *msg, void *arg) {
  progress_ask_t *a = arg;
  progress_t *p = a->p;
  if (msg) {
    pthread_mutex_lock(&p->mu);
    if (a->reply) protobuf_c_message_free_unpacked(msg, NULL); /* a unary call: one */
    else a->reply = msg;
    pthread_mutex_unlock(&p->mu);
    rpc_pull_next(pull); /* the end and the status */
    return;
  }
  rpc_status_t st;
  rpc_pull_status(pull, &st);
  pthread_mutex_lock(&p->mu);
  a->st = st;
  a->ended = true;
  if (--p->pending == 0) pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
}

/* Starts rank's ask; false (with a->st saying why) when it could not. */
static bool ask_start(load_service_t *ls, progress_ask_t *a, const char *session) {
  agent_target_t t;
  if (agent_pool_target(ls->pool, a->rank, AGENT_CONNECT_MS, &t)) {
    a->st = (rpc_status_t){.code = GRPC_STATUS_UNAVAILABLE, .kind = "AGENT_LOST"};
    snprintf(a->st.message, sizeof a->st.message,
             "LoadProgress: rank %u has no agent; its loads fail on their own", a->rank);
    return false;
  }
  Meshd__Agent__V1__LoadProgressRequest rq = MESHD__AGENT__V1__LOAD_PROGRESS_REQUEST__INIT;
  rq.session_id = (char *)session;
  rq.n_refs = a->k;
  rq.refs = a->refs;
  if ((a->ch = rpc_channel_create(t.address, &t.opts)))
    a->pull = rpc_pull_open(a->ch, "/meshd.agent.v1.Agent/LoadProgress", &rq.base,
                            &meshd__v1__load_progress_reply__descriptor, t.md, 1,
                            PROGRESS_DEADLINE_MS, ask_got, a);
  if (!a->pull) {
    a->st = (rpc_status_t){.code = GRPC_STATUS_RESOURCE_EXHAUSTED, .kind = "QUOTA"};
    snprintf(a->st.message, sizeof a->st.message,
             "LoadProgress: rank %u: could not start the call (out of memory)", a->rank);
    return false;
  }
  return true;
}

/* Adds a's answer to p->v, or says in *note why there is none (false). */
static bool ask_collect(progress_t *p, progress_ask_t *a, Meshd__V1__LoadProgressRank *note) {
  const Meshd__V1__LoadProgressReply *r = (const Meshd__V1__LoadProgressReply *)a->reply;
  if (a->ended && a->st.code == GRPC_STATUS_OK && r) {
    for (size_t j = 0; j < r->n_loads && j < a->k; j++) {
      Meshd__V1__LoadProgress *v = &p->v[a->which[j]];
      v->done_bytes += r->loads[j]->done_bytes;
      v->failed |= r->loads[j]->failed;
    }
    return true;
  }
  meshd__v1__load_progress_rank__init(note);
  note->rank = a->rank;
  char *msg = malloc(sizeof a->st.message + 160);
  if (!msg) return false;
  if (!a->ended || a->st.code == GRPC_STATUS_DEADLINE_EXCEEDED || a->st.code == GRPC_STATUS_CANCELLED) {
    note->kind = MESHD__V1__ERROR_KIND__ERROR_KIND_DEADLINE_EXCEEDED;
    snprintf(msg, sizeof a->st.message + 160,
             "LoadProgress: rank %u: no answer within %d ms (its agent is hung, stopped or "
             "overloaded); its bytes are not counted", a->rank, PROGRESS_DEADLINE_MS);
  } else if (strncmp(a->st.message, "LoadProgress: rank", 18) == 0) {
    note->kind = strcmp(a->st.kind, "AGENT_LOST") == 0 ? MESHD__V1__ERROR_KIND__ERROR_KIND_AGENT_LOST
                                                       : MESHD__V1__ERROR_KIND__ERROR_KIND_QUOTA;
    snprintf(msg, sizeof a->st.message + 160, "%s", a->st.message);
  } else {
    note->kind = a->st.code == GRPC_STATUS_UNAVAILABLE ? MESHD__V1__ERROR_KIND__ERROR_KIND_AGENT_LOST
                                                       : MESHD__V1__ERROR_KIND__ERROR_KIND_REMOTE_FAILURE;
    snprintf(msg, sizeof a->st.message + 160, "LoadProgress: rank %u: %s: %s", a->rank,
             meshd_grpc_code_name(a->st.code), a->st.message[0] ? a->st.message : "no details");
  }
  note->message = msg;
  return false;
}

static void *progress_main(void *arg) {
  progress_t *p = arg;
  load_service_t *ls = p->ls;
  progress_ask_t *asks = calloc(p->nranks ? p->nranks : 1, sizeof *asks);
  size_t nasks = 0;
  Meshd__V1__LoadProgressRank *notes = NULL;
  Meshd__V1__LoadProgressRank **pn = NULL;
  size_t nnotes = 0;
  bool oom = !asks; /* then some ranks were not asked: no answer rather than a short one */
  for (size_t r = 0; asks && r < p->nranks; r++) {
    progress_ask_t *a = &asks[nasks];
    *a = (progress_ask_t){.p = p, .rank = p->ranks[r]};
    a->refs = malloc(sizeof *a->refs * (p->n ? p->n : 1));
    a->which = malloc(sizeof *a->which * (p->n ? p->n : 1));
    if (!a->refs || !a->which) {
      free(a->refs);
      free(a->which);
      oom = true;
      break;
    }
    for (size_t i = 0; i < p->n; i++) {
      if (!p->on[i * p->nranks + r] || p->v[i].failed) continue;
      if (p->ran[r]) p->v[i].done_bytes += p->share[i];
      else a->which[a->k] = i, a->refs[a->k++] = p->v[i].ref;
    }
    nasks++;
    if (!a->k) {
      a->ended = true;
      a->reply = NULL;
      a->st.code = GRPC_STATUS_OK; /* nothing to ask: no note */
      continue;
    }
    pthread_mutex_lock(&p->mu);
    p->pending++;
    pthread_mutex_unlock(&p->mu);
    if (ask_start(ls, a, p->session)) {
      rpc_pull_next(a->pull);
    } else {
      pthread_mutex_lock(&p->mu);
      p->pending--;
      a->ended = true;
      pthread_mutex_unlock(&p->mu);
    }
  }
  /* Every call carries the deadline; wait for it (and a little), then cancel
   * what still runs, which ends it at once. */
  struct timespec ts;
  runtime_deadline(&ts, CLOCK_REALTIME, PROGRESS_DEADLINE_MS + PROGRESS_SLACK_MS);
  pthread_mutex_lock(&p->mu);
  while (p->pending && pthread_cond_timedwait(&p->cv, &p->mu, &ts) == 0) {
  }
  for (size_t i = 0; p->pending && i < nasks; i++)
    if (asks[i].pull && !asks[i].ended) rpc_pull_cancel(asks[i].pull);
  while (p->pending) pthread_cond_wait(&p->cv, &p->mu);
  pthread_mutex_unlock(&p->mu);

  notes = calloc(nasks ? nasks : 1, sizeof *notes);
  pn = calloc(nasks ? nasks : 1, sizeof *pn);
  for (size_t i = 0; i < nasks; i++) {
    progress_ask_t *a = &asks[i];
    if (a->k && notes && pn && !ask_collect(p, a, &notes[nnotes]) && notes[nnotes].message) {
      pn[nnotes] = &notes[nnotes];
      nnotes++;
    }
    if (a->reply) protobuf_c_message_free_unpacked(a->reply, NULL);
    if (a->pull) rpc_pull_destroy(a->pull);
    if (a->ch) rpc_channel_destroy(a->ch);
    free(a->refs);
    free(a->which);
  }
  free(asks);
  Meshd__V1__LoadProgress **pv = calloc(p->n ? p->n : 1, sizeof *pv);
  if (pv && notes && pn && !oom) {
    for (size_t i = 0; i < p->n; i++) {
      if (p->v[i].done_bytes > p->v[i].total_bytes) p->v[i].done_bytes = p->v[i].total_bytes;
      pv[i] = &p->v[i];
    }
    Meshd__V1__LoadProgressReply reply = MESHD__V1__LOAD_PROGRESS_REPLY__INIT;
    reply.n_loads = p->n;
    reply.loads = pv;
    reply.n_unanswered = nnotes;
    reply.unanswered = pn;
    rpc_call_reply(p->call, &reply.base);
  } else {
    rpc_call_finish(p->call, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA", "LoadProgress: out of memory");
  }
  for (size_t i = 0; i < nnotes; i++) free(notes[i].message);
  free(notes);
  free(pn);
  free(pv);
  rpc_call_unref(p->call);
  pthread_mutex_destroy(&p->mu);
  pthread_cond_destroy(&p->cv);
  int slot = p->slot;
  progress_free(p);
  done(ls, slot);
  return NULL;
}

/* Each ref's total and ranks, under the session lock. */
static int progress_plan(load_service_t *ls, session_t *s, const Meshd__V1__LoadProgressRequest *rq,
                         progress_t *p, meshd_error_t *e) {
  int rc = -1;
  pthread_mutex_lock(&s->mu);
  objects_t *o = s->objects;
  uint32_t *mr = NULL;
  p->v = calloc(rq->n_refs ? rq->n_refs : 1, sizeof *p->v);
  size_t world = 0;
  for (size_t i = 0; o && i < rq->n_refs; i++) {
    obj_t *t = objects_get(o, rq->refs[i]);
    obj_t *m = t && t->kind == OBJ_TENSOR ? objects_get(o, t->tensor.mesh) : NULL;
    if (m && m->kind == OBJ_MESH) {
      size_t n = mesh_len(m->mesh);
      uint32_t *r = malloc(sizeof *r * (n ? n : 1));
      if (r) {
        mesh_ranks(m->mesh, r);
        for (size_t j = 0; j < n; j++)
          if (r[j] + 1 > world) world = r[j] + 1;
        free(r);
      }
    }
  }
  if (!p->v || !(p->ranks = calloc(world ? world : 1, sizeof *p->ranks)) ||
      !(p->on = calloc((rq->n_refs ? rq->n_refs : 1) * (world ? world : 1), sizeof *p->on)) ||
      !(p->ran = calloc(world ? world : 1, sizeof *p->ran)) ||
      !(p->share = calloc(rq->n_refs ? rq->n_refs : 1, sizeof *p->share))) {
    error_set(e, ERR_QUOTA, "LoadProgress: out of memory");
    goto out;
  }
  p->n = rq->n_refs;
  p->nranks = world;
  watermark_t *wm = agent_pool_watermark(ls->pool);
  for (size_t r = 0; r < world; r++) {
    p->ranks[r] = (uint32_t)r;
    uint64_t last = o ? objects_last_seq(o, (uint32_t)r) : 0;
    p->ran[r] = last && watermark_reached(wm, (uint32_t)r, s->id, last);
    /* Someone asks how far the rank got: what its link holds back goes now. */
    if (last && !p->ran[r]) agent_pool_flush(ls->pool, (uint32_t)r);
  }
  for (size_t i = 0; i < rq->n_refs; i++) {
    meshd__v1__load_progress__init(&p->v[i]);
    p->v[i].ref = rq->refs[i];
    obj_t *t = o ? objects_expect(o, rq->refs[i], OBJ_TENSOR, "LoadProgress: ref", e) : NULL;
    if (!t) {
      if (!o) error_set(e, ERR_UNKNOWN_REF, "LoadProgress: ref %llu: the session has no tensors",
                        (unsigned long long)rq->refs[i]);
      goto out;
    }
    obj_t *m = objects_get(o, t->tensor.mesh);
    size_t n = m && m->kind == OBJ_MESH ? mesh_len(m->mesh) : 0;
    free(mr);
    if (!(mr = malloc(sizeof *mr * (n ? n : 1)))) {
      error_set(e, ERR_QUOTA, "LoadProgress: out of memory");
      goto out;
    }
    if (n) mesh_ranks(m->mesh, mr);
    for (size_t j = 0; j < n; j++) p->on[i * world + mr[j]] = true;
    p->share[i] = obj_nbytes(t);
    p->v[i].total_bytes = obj_nbytes(t) * n;
    p->v[i].failed = t->state == TENSOR_FAILED;
    /* A rank of its mesh lost since the mesh was made: its shard there is gone
     * and a replacement agent knows nothing of the load, which can never be
     * in; failed, so that a waiting client stops looking (and Syncs). */
    meshd_error_t lost = {0};
    if (!p->v[i].failed && n && command_check_mesh_alive(ls->pool, m->mesh, "LoadProgress", &lost) &&
        lost.kind == ERR_AGENT_LOST)
      p->v[i].failed = true;
  }
  rc = 0;
out:
  free(mr);
  pthread_mutex_unlock(&s->mu);
  return rc;
}

static void progress_start(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  load_service_t *ls = arg;
  const Meshd__V1__LoadProgressRequest *rq = (const Meshd__V1__LoadProgressRequest *)req;
  session_t *s = session_from_call(ls->sessions, call);
  if (!s) return;
  meshd_error_t e = {0};
  progress_t *p = calloc(1, sizeof *p);
  int rc = -1;
  if (!p) error_set(&e, ERR_QUOTA, "LoadProgress: out of memory");
  else if (rq->n_refs > PROGRESS_REFS_MAX)
    error_set(&e, ERR_BAD_ARGUMENT, "LoadProgress: %zu refs, at most %d", rq->n_refs,
              PROGRESS_REFS_MAX);
  else if ((rc = progress_plan(ls, s, rq, p, &e)) == 0)
    snprintf(p->session, sizeof p->session, "%s", s->id);
  session_release(s);
  if (rc) {
    if (p) progress_free(p);
    finish_error(call, &e);
    return;
  }
  p->ls = ls;
  p->call = call;
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->cv, NULL);
  if (spawn(ls, call, "LoadProgress", p->session, &p->slot, progress_main, p)) {
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    progress_free(p);
  }
}

static const rpc_method_t methods[] = {
    {.path = "/meshd.v1.TensorService/InspectUrl",
     .kind = RPC_UNARY,
     .request = &meshd__v1__inspect_url_request__descriptor,
     .on_start = inspect_start},
    {.path = "/meshd.v1.TensorService/LoadProgress",
     .kind = RPC_UNARY,
     .request = &meshd__v1__load_progress_request__descriptor,
     .on_start = progress_start},
};

const rpc_method_t *load_service_methods(size_t *n) {
  *n = sizeof methods / sizeof *methods;
  return methods;
}

load_service_t *load_service_create(agent_pool_t *pool, session_table_t *sessions,
                                    const url_policy_t *urls) {
  load_service_t *ls = calloc(1, sizeof *ls);
  if (!ls) return NULL;
  ls->pool = pool;
  ls->sessions = sessions;
  ls->urls = urls;
  pthread_mutex_init(&ls->mu, NULL);
  pthread_cond_init(&ls->idle, NULL);
  return ls;
}

void load_service_destroy(load_service_t *ls) {
  if (!ls) return;
  pthread_mutex_lock(&ls->mu);
  while (ls->running) pthread_cond_wait(&ls->idle, &ls->mu);
  pthread_mutex_unlock(&ls->mu);
  pthread_mutex_destroy(&ls->mu);
  pthread_cond_destroy(&ls->idle);
  free(ls);
}
