#include "session.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include <openssl/rand.h>

#include "log.h"
#include "page_token.h"
#include "rpc.h"

#define EXPIRE_PERIOD_MS 500

/* One slot of the open sessions in seq order; s NULL once it left. */
typedef struct seq_slot {
  uint64_t seq;
  session_t *s;
} seq_slot_t;

/* Open sessions by seq, for ListSessions' pages: a page finds where it starts
 * by binary search instead of walking every session before it. Appended at
 * creation (seqs only grow); a session that leaves empties its slot, the empty
 * slots are squeezed out once they are half of all, and the array halves when
 * less than a quarter of it is used (a burst of sessions does not keep its
 * memory once they are gone). */
typedef struct seq_index {
  seq_slot_t *v;
  size_t n, cap, empty;
} seq_index_t;

/* Open sessions per principal: CreateSession checks --max-sessions-per-principal
 * against this count instead of walking every session, and a non-admin's
 * ListSessions page walks this principal's own index, not everyone's. An entry
 * lives while its principal holds a session (each session points at its own). */
typedef struct owner_count {
  char owner[SESSION_OWNER_MAX + 1];
  uint64_t open;
  seq_index_t order; /* its open sessions */
  UT_hash_handle hh;
} owner_count_t;

struct session_table {
  pthread_mutex_t mu;
  pthread_cond_t wake; /* CLOCK_MONOTONIC; signalled to stop the thread */
  session_t *by_id;    /* uthash, in creation order; holds one ref each */
  owner_count_t *owners; /* uthash by owner: open sessions of each principal */
  seq_index_t order;     /* every open session (an admin's pages) */
  uint64_t default_ttl_s, default_quota;
  uint64_t max_per_owner; /* 0: none */
  uint64_t max_sessions;  /* 0: none */
  uint64_t last_seq;      /* the last session_t.seq given */
  uint32_t epoch;         /* random, per table: page tokens of another run are refused */
  session_limits_t limits;
  session_closed_fn on_closed;
  void *arg;
  pthread_t thread;
  bool stopping;
  _Atomic bool accepting;
};

/* Sessions taken out of the table under its lock, to be announced and
 * released after it is unlocked. */
typedef struct ended {
  session_t **v;
  size_t n, cap;
  session_t *one[16];
} ended_t;

static void ended_init(ended_t *e) {
  e->v = e->one;
  e->n = 0;
  e->cap = sizeof e->one / sizeof e->one[0];
}

static bool ended_push(ended_t *e, session_t *s) {
  if (e->n == e->cap) {
    size_t cap = e->cap * 2;
    session_t **v = malloc(cap * sizeof *v);
    if (!v) return false;
    memcpy(v, e->v, e->n * sizeof *v);
    if (e->v != e->one) free(e->v);
    e->v = v;
    e->cap = cap;
  }
  e->v[e->n++] = s;
  return true;
}

const char *session_end_name(session_end_t why) {
  switch (why) {
    case SESSION_END_CLOSED:
      return "closed";
    case SESSION_END_EXPIRED:
      return "expired";
    case SESSION_END_SHUTDOWN:
      return "server shutdown";
  }
  return "unknown";
}

/* ------------------------------------------------------------------ lifetime */

static void session_free(session_t *s) {
  if (s->destroy_objects) s->destroy_objects(s->objects);
  pthread_mutex_destroy(&s->mu);
  free(s);
}

/* A call's reference: counted in both. */
static void take_call_ref(session_t *s) {
  atomic_fetch_add(&s->refs, 1);
  atomic_fetch_add(&s->calls, 1);
}

/* The table's reference (after unlink_locked handed it over). */
static void drop_table_ref(session_t *s) {
  if (atomic_fetch_sub(&s->refs, 1) == 1) session_free(s);
}

void session_ref(session_t *s) { take_call_ref(s); }

void session_release(session_t *s) {
  if (!s) return;
  /* The lease restarts before the count drops: expiry, which reads the count
   * first, never sees 0 calls with the old time. */
  atomic_store(&s->last_used_ms, rpc_now_ms());
  atomic_fetch_sub(&s->calls, 1);
  drop_table_ref(s);
}

void session_hold(session_t *s) { atomic_fetch_add(&s->refs, 1); }

void session_detach(session_t *s) {
  atomic_store(&s->last_used_ms, rpc_now_ms());
  atomic_fetch_sub(&s->calls, 1);
}

void session_unhold(session_t *s) {
  if (s) drop_table_ref(s);
}

void session_attach(session_t *s) { atomic_fetch_add(&s->calls, 1); }

void session_unfind(session_t *s) {
  if (!s) return;
  atomic_fetch_sub(&s->calls, 1);
  drop_table_ref(s);
}

void session_touch(session_t *s) { atomic_store(&s->last_used_ms, rpc_now_ms()); }

void session_set_objects(session_t *s, void *objects, void (*destroy)(void *objects)) {
  s->objects = objects;
  s->destroy_objects = destroy;
}

/* ------------------------------------------------------------------ indexes (under t->mu) */

/* The fewest slots an index keeps once it has any (a principal's few sessions). */
#define SEQ_INDEX_MIN_CAP 8

/* Room in x for one more slot: 0, or -1 out of memory. */
static int index_reserve(seq_index_t *x) {
  if (x->n < x->cap) return 0;
  size_t cap = x->cap ? x->cap * 2 : SEQ_INDEX_MIN_CAP;
  seq_slot_t *v = realloc(x->v, cap * sizeof *v);
  if (!v) return -1;
  x->v = v;
  x->cap = cap;
  return 0;
}

/* After index_reserve: s has the highest seq yet. */
static void index_append(seq_index_t *x, session_t *s) {
  x->v[x->n++] = (seq_slot_t){.seq = s->seq, .s = s};
}

/* The first slot whose seq is above `after` (x->n when none is). */
static size_t index_first_after(const seq_index_t *x, uint64_t after) {
  size_t lo = 0, hi = x->n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (x->v[mid].seq <= after) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/* Halves the array while less than a quarter of it is used: growth doubles at
 * full, so a size near either bound does not flip between the two. A failed
 * shrink keeps the larger array (it still works). */
static void index_shrink(seq_index_t *x) {
  size_t cap = x->cap;
  while (cap > SEQ_INDEX_MIN_CAP && x->n < cap / 4) cap /= 2;
  if (cap == x->cap) return;
  seq_slot_t *v = realloc(x->v, cap * sizeof *v);
  if (!v) return;
  x->v = v;
  x->cap = cap;
}

static void index_remove(seq_index_t *x, const session_t *s) {
  size_t i = index_first_after(x, s->seq - 1);
  if (i == x->n || x->v[i].s != s) return; /* not in the index: nothing to do */
  x->v[i].s = NULL;
  if (++x->empty * 2 <= x->n) return;
  /* Squeezed once half are empty: each squeeze follows as many removals as
   * the slots it moves, so a removal costs O(1) on average. */
  size_t k = 0;
  for (size_t j = 0; j < x->n; j++)
    if (x->v[j].s) x->v[k++] = x->v[j];
  x->n = k;
  x->empty = 0;
  index_shrink(x);
}

static void index_free(seq_index_t *x) {
  free(x->v);
  *x = (seq_index_t){0};
}

static void free_owner(session_table_t *t, owner_count_t *c) {
  HASH_DEL(t->owners, c);
  index_free(&c->order);
  free(c);
}

/* A session that leaves the table leaves its principal's index and gives back
 * its count. */
static void uncount_owner(session_table_t *t, session_t *s) {
  owner_count_t *c = s->counted;
  s->counted = NULL;
  if (!c) return;
  index_remove(&c->order, s);
  if (--c->open == 0) free_owner(t, c);
}

/* Out of every index, marked closed: the one way a session leaves the table
 * (CloseSession, a cancelled CreateSession, expiry, destroy), so the counts
 * and the order stay right whichever way it ended. The table's reference
 * moves to the caller, who announces the end and then releases it. */
static void unlink_locked(session_table_t *t, session_t *s) {
  HASH_DEL(t->by_id, s);
  index_remove(&t->order, s);
  uncount_owner(t, s);
  atomic_store(&s->closed, true);
}

static void announce(session_table_t *t, session_t *s, session_end_t why) {
  int64_t idle = rpc_now_ms() - atomic_load(&s->last_used_ms);
  log_event(LOG_LEVEL_INFO, "session", &(log_fields_t){.session = s->id},
            "session %s (%s) %s after %lld ms idle", s->id,
            s->client_name[0] ? s->client_name : "unnamed", session_end_name(why), (long long)idle);
  if (t->on_closed) t->on_closed(s, why, t->arg);
}

static void announce_all(session_table_t *t, ended_t *e, session_end_t why) {
  for (size_t i = 0; i < e->n; i++) {
    announce(t, e->v[i], why);
    drop_table_ref(e->v[i]);
  }
  if (e->v != e->one) free(e->v);
}

/* ------------------------------------------------------------------ table */

static void *expire_thread(void *arg) {
  session_table_t *t = arg;
  pthread_mutex_lock(&t->mu);
  while (!t->stopping) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_nsec += EXPIRE_PERIOD_MS * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
      ts.tv_sec++;
      ts.tv_nsec -= 1000000000L;
    }
    pthread_cond_timedwait(&t->wake, &t->mu, &ts);
    if (t->stopping) break;
    pthread_mutex_unlock(&t->mu);
    session_expire(t, rpc_now_ms());
    pthread_mutex_lock(&t->mu);
  }
  pthread_mutex_unlock(&t->mu);
  return NULL;
}

session_table_t *session_table_create(uint64_t default_ttl_s, uint64_t default_quota_bytes,
                                      session_closed_fn on_closed, void *arg) {
  session_table_t *t = calloc(1, sizeof *t);
  if (!t) return NULL;
  t->default_ttl_s = default_ttl_s ? default_ttl_s : 300;
  t->default_quota = default_quota_bytes;
  t->on_closed = on_closed;
  t->arg = arg;
  t->epoch = page_token_new_epoch();
  atomic_store(&t->accepting, true);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&t->wake, &ca);
  pthread_condattr_destroy(&ca);
  pthread_mutex_init(&t->mu, NULL);
  if (pthread_create(&t->thread, NULL, expire_thread, t) != 0) {
    pthread_cond_destroy(&t->wake);
    pthread_mutex_destroy(&t->mu);
    free(t);
    return NULL;
  }
  return t;
}

void session_table_destroy(session_table_t *t) {
  if (!t) return;
  pthread_mutex_lock(&t->mu);
  t->stopping = true;
  pthread_cond_broadcast(&t->wake);
  pthread_mutex_unlock(&t->mu);
  pthread_join(t->thread, NULL);

  ended_t e;
  ended_init(&e);
  for (;;) {
    pthread_mutex_lock(&t->mu);
    session_t *s, *tmp;
    bool full = false;
    HASH_ITER(hh, t->by_id, s, tmp) {
      if (!ended_push(&e, s)) {
        full = true;
        break;
      }
      unlink_locked(t, s);
    }
    pthread_mutex_unlock(&t->mu);
    announce_all(t, &e, SESSION_END_SHUTDOWN);
    ended_init(&e);
    if (!full) break;
  }
  owner_count_t *c, *ctmp;
  HASH_ITER(hh, t->owners, c, ctmp) free_owner(t, c); /* none: each left with its last session */
  index_free(&t->order);
  pthread_cond_destroy(&t->wake);
  pthread_mutex_destroy(&t->mu);
  free(t);
}

uint64_t session_table_default_ttl(const session_table_t *t) { return t->default_ttl_s; }

uint64_t session_table_default_quota(const session_table_t *t) { return t->default_quota; }

void session_table_set_limits(session_table_t *t, const session_limits_t *limits) {
  pthread_mutex_lock(&t->mu);
  t->limits = limits ? *limits : (session_limits_t){0};
  pthread_mutex_unlock(&t->mu);
}

void session_table_set_accepting(session_table_t *t, bool accepting) {
  atomic_store(&t->accepting, accepting);
}

bool session_table_accepting(const session_table_t *t) { return atomic_load(&t->accepting); }

/* 2n hex chars of kernel randomness; no weak fallback for secrets. */
static int random_hex(char *out, size_t n) {
  unsigned char buf[SESSION_TOKEN_LEN / 2];
  size_t got = 0;
  while (got < n) {
    ssize_t r = getrandom(buf + got, n - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    got += (size_t)r;
  }
  static const char hex[] = "0123456789abcdef";
  for (size_t i = 0; i < n; i++) {
    out[2 * i] = hex[buf[i] >> 4];
    out[2 * i + 1] = hex[buf[i] & 15];
  }
  out[2 * n] = '\0';
  return 0;
}

void session_table_set_owner_limit(session_table_t *t, uint64_t max_per_owner) {
  pthread_mutex_lock(&t->mu);
  t->max_per_owner = max_per_owner;
  pthread_mutex_unlock(&t->mu);
}

uint32_t session_table_epoch(const session_table_t *t) { return t->epoch; }

void session_table_set_max_sessions(session_table_t *t, uint64_t max_sessions) {
  pthread_mutex_lock(&t->mu);
  t->max_sessions = max_sessions;
  pthread_mutex_unlock(&t->mu);
}

/* A session that never entered the table. */
static int discard_new(session_t *s) {
  pthread_mutex_destroy(&s->mu);
  free(s);
  return -1;
}

/* Under t->mu: the count of owner's open sessions, made (at 0) if there is
 * none, with room in its index for the session about to be added; NULL out of
 * memory (a count made here is not kept). */
static owner_count_t *owner_count_for(session_table_t *t, const char *owner) {
  owner_count_t *c;
  HASH_FIND_STR(t->owners, owner, c);
  if (!c) {
    c = calloc(1, sizeof *c);
    if (!c) return NULL;
    snprintf(c->owner, sizeof c->owner, "%s", owner);
    HASH_ADD_STR(t->owners, owner, c);
  }
  if (index_reserve(&c->order) == 0) return c;
  if (c->open == 0) free_owner(t, c);
  return NULL;
}

int session_create(session_table_t *t, const char *owner, const char *client_name, uint64_t ttl_s,
                   uint64_t quota_bytes, session_t **out, meshd_error_t *err) {
  session_t *s = calloc(1, sizeof *s);
  if (!s) return error_set(err, ERR_UNAVAILABLE, "CreateSession: out of memory");
  if (random_hex(s->token, SESSION_TOKEN_LEN / 2) != 0) {
    free(s);
    return error_set(err, ERR_UNAVAILABLE, "CreateSession: no randomness for a token: %s",
                     strerror(errno));
  }
  snprintf(s->owner, sizeof s->owner, "%s", owner && *owner ? owner : "anonymous");
  if (RAND_bytes(s->comm_key, sizeof s->comm_key) != 1) {
    free(s);
    return error_set(err, ERR_UNAVAILABLE, "CreateSession: no randomness for a data plane key");
  }
  snprintf(s->client_name, sizeof s->client_name, "%s", client_name ? client_name : "");
  s->ttl_s = ttl_s ? ttl_s : t->default_ttl_s;
  s->quota_bytes = quota_bytes ? quota_bytes : t->default_quota;
  s->created_ms = rpc_now_ms();
  atomic_store(&s->last_used_ms, s->created_ms);
  atomic_store(&s->refs, 2); /* the table's and the caller's (CreateSession's call) */
  atomic_store(&s->calls, 1);
  pthread_mutex_init(&s->mu, NULL);

  pthread_mutex_lock(&t->mu);
  owner_count_t *mine;
  HASH_FIND_STR(t->owners, s->owner, mine);
  uint64_t held = mine ? mine->open : 0;
  uint64_t open_now = HASH_COUNT(t->by_id);
  int refused = 0;
  if (t->max_per_owner && held >= t->max_per_owner)
    refused = error_set(err, ERR_QUOTA,
                        "CreateSession: principal '%s' already holds %llu open sessions, the most "
                        "--max-sessions-per-principal (%llu) allows; close sessions you no longer "
                        "use", s->owner, (unsigned long long)held,
                        (unsigned long long)t->max_per_owner);
  else if (t->max_sessions && open_now >= t->max_sessions)
    refused = error_set(err, ERR_QUOTA,
                        "CreateSession: the server holds %llu open sessions, the most "
                        "--max-sessions (%llu) allows; retry once sessions close",
                        (unsigned long long)open_now, (unsigned long long)t->max_sessions);
  if (refused) {
    pthread_mutex_unlock(&t->mu);
    return discard_new(s);
  }
  s->limits = t->limits;
  for (;;) {
    if (random_hex(s->id, SESSION_ID_LEN / 2) != 0) {
      pthread_mutex_unlock(&t->mu);
      error_set(err, ERR_UNAVAILABLE, "CreateSession: no randomness for an id: %s",
                strerror(errno));
      return discard_new(s);
    }
    session_t *dup;
    HASH_FIND_STR(t->by_id, s->id, dup);
    if (!dup) break;
  }
  if (index_reserve(&t->order) != 0 || !(mine = owner_count_for(t, s->owner))) {
    pthread_mutex_unlock(&t->mu);
    error_set(err, ERR_UNAVAILABLE, "CreateSession: out of memory");
    return discard_new(s);
  }
  s->seq = ++t->last_seq;
  HASH_ADD_STR(t->by_id, id, s);
  index_append(&t->order, s);
  index_append(&mine->order, s);
  mine->open++;
  s->counted = mine;
  pthread_mutex_unlock(&t->mu);
  log_event(LOG_LEVEL_INFO, "session", &(log_fields_t){.session = s->id},
            "session %s created by %s for '%s' (ttl %llu s, quota %llu bytes)", s->id,
            s->owner, s->client_name, (unsigned long long)s->ttl_s, (unsigned long long)s->quota_bytes);
  *out = s;
  return 0;
}

/* Same time whatever the contents; only the (public) length shows. */
static bool token_equal(const char *want, const char *got) {
  size_t n = strnlen(got, SESSION_TOKEN_LEN + 1);
  unsigned diff = n != SESSION_TOKEN_LEN;
  for (size_t i = 0; i < SESSION_TOKEN_LEN; i++)
    diff |= (unsigned)((unsigned char)want[i] ^ (unsigned char)(i < n ? got[i] : 0));
  return diff == 0;
}

static bool idle_past_ttl(const session_t *s, int64_t now_ms) {
  return atomic_load(&s->calls) == 0 &&
         now_ms - atomic_load(&s->last_used_ms) > (int64_t)s->ttl_s * 1000;
}

session_t *session_acquire(session_table_t *t, const char *id, const char *token,
                           meshd_error_t *err) {
  return session_acquire_as(t, id, token, NULL, err);
}

session_t *session_acquire_as(session_table_t *t, const char *id, const char *token,
                              const char *owner, meshd_error_t *err) {
  if (!id || !id[0] || !token || !token[0]) {
    error_set(err, ERR_NO_SESSION,
              "the call carries no %s: send the session id and token from CreateSession as "
              "metadata meshd-session and meshd-token",
              !id || !id[0] ? "session id" : "token");
    return NULL;
  }
  const char *more = strlen(id) > SESSION_ID_LEN ? "..." : "";
  int64_t now = rpc_now_ms();
  pthread_mutex_lock(&t->mu);
  session_t *s;
  HASH_FIND_STR(t->by_id, id, s);
  if (!s) {
    pthread_mutex_unlock(&t->mu);
    error_set(err, ERR_NO_SESSION,
              "no session '%.32s%s': it was closed, expired (idle past its ttl: %llu s unless "
              "CreateSession asked for another), or never existed; create a new one",
              id, more, (unsigned long long)t->default_ttl_s);
    return NULL;
  }
  if (!token_equal(s->token, token)) {
    pthread_mutex_unlock(&t->mu);
    error_set(err, ERR_NO_SESSION,
              "wrong token for session '%s': send the token CreateSession returned with this id",
              s->id);
    return NULL;
  }
  /* Before anything changes: another principal's call renews nothing. */
  if (owner && strcmp(s->owner, owner) != 0) {
    pthread_mutex_unlock(&t->mu);
    error_set(err, ERR_PERMISSION_DENIED,
              "session %.8s belongs to another principal; '%s' may use only the sessions it "
              "created", id, owner);
    return NULL;
  }
  if (idle_past_ttl(s, now)) {
    unlink_locked(t, s);
    pthread_mutex_unlock(&t->mu);
    error_set(err, ERR_NO_SESSION,
              "session '%s' expired after %llu s idle; create a new one (and call KeepAlive "
              "more often than every %llu s)",
              s->id, (unsigned long long)s->ttl_s, (unsigned long long)s->ttl_s);
    announce(t, s, SESSION_END_EXPIRED);
    drop_table_ref(s);
    return NULL;
  }
  take_call_ref(s);
  atomic_store(&s->last_used_ms, now);
  pthread_mutex_unlock(&t->mu);
  return s;
}

session_t *session_find(session_table_t *t, const char *id) {
  pthread_mutex_lock(&t->mu);
  session_t *s = NULL;
  if (id) HASH_FIND_STR(t->by_id, id, s);
  if (s) take_call_ref(s);
  pthread_mutex_unlock(&t->mu);
  return s;
}

bool session_close(session_table_t *t, session_t *s) {
  pthread_mutex_lock(&t->mu);
  if (atomic_load(&s->closed)) {
    pthread_mutex_unlock(&t->mu);
    return false;
  }
  unlink_locked(t, s);
  pthread_mutex_unlock(&t->mu);
  announce(t, s, SESSION_END_CLOSED);
  drop_table_ref(s);
  return true;
}

int session_expire(session_table_t *t, int64_t now_ms) {
  ended_t e;
  ended_init(&e);
  pthread_mutex_lock(&t->mu);
  session_t *s, *tmp;
  HASH_ITER(hh, t->by_id, s, tmp) {
    if (!idle_past_ttl(s, now_ms)) continue;
    if (!ended_push(&e, s)) break; /* out of memory: the rest wait for the next round */
    unlink_locked(t, s);
  }
  pthread_mutex_unlock(&t->mu);
  int n = (int)e.n;
  announce_all(t, &e, SESSION_END_EXPIRED);
  return n;
}

size_t session_count(session_table_t *t) {
  pthread_mutex_lock(&t->mu);
  size_t n = HASH_COUNT(t->by_id);
  pthread_mutex_unlock(&t->mu);
  return n;
}

/* Under t->mu. */
static void info_of(session_t *s, int64_t now, session_info_t *r) {
  memcpy(r->id, s->id, sizeof r->id);
  memcpy(r->owner, s->owner, sizeof r->owner);
  memcpy(r->client_name, s->client_name, sizeof r->client_name);
  r->bytes_held = atomic_load(&s->bytes_held);
  r->live_tensors = atomic_load(&s->live_tensors);
  r->queued_commands = atomic_load(&s->queued_commands);
  r->commands = atomic_load(&s->commands);
  r->age_ms = now > s->created_ms ? (uint64_t)(now - s->created_ms) : 0;
  int64_t idle = now - atomic_load(&s->last_used_ms);
  r->idle_ms = idle > 0 && atomic_load(&s->calls) == 0 ? (uint64_t)idle : 0;
  r->ttl_s = s->ttl_s;
  r->seq = s->seq;
}

int session_list(session_table_t *t, session_info_t **out, size_t *n) {
  *out = NULL;
  *n = 0;
  int64_t now = rpc_now_ms();
  pthread_mutex_lock(&t->mu);
  size_t count = HASH_COUNT(t->by_id);
  session_info_t *v = count ? calloc(count, sizeof *v) : NULL;
  if (count && !v) {
    pthread_mutex_unlock(&t->mu);
    return -1;
  }
  size_t i = 0;
  for (session_t *s = t->by_id; s; s = s->hh.next, i++) info_of(s, now, &v[i]);
  pthread_mutex_unlock(&t->mu);
  *out = v;
  *n = count;
  return 0;
}

int session_list_page(session_table_t *t, const char *owner, uint64_t after, size_t limit,
                      session_info_t **out, size_t *n, uint64_t *next) {
  *out = NULL;
  *n = 0;
  *next = 0;
  if (limit == 0) limit = 1;
  int64_t now = rpc_now_ms();
  pthread_mutex_lock(&t->mu);
  if (after > t->last_seq) {
    pthread_mutex_unlock(&t->mu);
    return -2;
  }
  /* A principal's page walks its own sessions only, whoever else holds many. */
  static const seq_index_t none; /* a principal with no open session */
  const seq_index_t *x = &t->order;
  size_t count = HASH_COUNT(t->by_id);
  if (owner) {
    owner_count_t *c;
    HASH_FIND_STR(t->owners, owner, c);
    x = c ? &c->order : &none;
    count = c ? c->open : 0;
  }
  size_t cap = count < limit ? count : limit;
  session_info_t *v = cap ? calloc(cap, sizeof *v) : NULL;
  if (cap && !v) {
    pthread_mutex_unlock(&t->mu);
    return -1;
  }
  size_t i = 0;
  for (size_t k = index_first_after(x, after); k < x->n; k++) {
    session_t *s = x->v[k].s;
    if (!s) continue;
    if (i == cap) {
      *next = v[i - 1].seq; /* another row follows */
      break;
    }
    info_of(s, now, &v[i++]);
  }
  pthread_mutex_unlock(&t->mu);
  if (!i) {
    free(v);
    v = NULL;
  }
  *out = v;
  *n = i;
  return 0;
}

size_t session_table_index_capacity(session_table_t *t, const char *owner) {
  pthread_mutex_lock(&t->mu);
  size_t cap = t->order.cap;
  if (owner) {
    owner_count_t *c;
    HASH_FIND_STR(t->owners, owner, c);
    cap = c ? c->order.cap : 0;
  }
  pthread_mutex_unlock(&t->mu);
  return cap;
}

/* ------------------------------------------------------------------ refs */

static int ref_error(uint64_t ref, uint64_t last, meshd_error_t *err) {
  char next[48];
  if (last == UINT64_MAX)
    snprintf(next, sizeof next, "none (every ref was used)");
  else
    snprintf(next, sizeof next, "%llu", (unsigned long long)last + 1);
  if (ref == 0)
    return error_set(err, ERR_BAD_ARGUMENT,
                     "ref 0 is not valid: refs start at 1 and must strictly increase; the next "
                     "free ref is %s",
                     next);
  return error_set(err, ERR_REF_REUSED,
                   "ref %llu was already used (or is lower than the last ref %llu): refs must "
                   "strictly increase; the next free ref is %s",
                   (unsigned long long)ref, (unsigned long long)last, next);
}

int session_check_ref(session_t *s, uint64_t ref, meshd_error_t *err) {
  uint64_t last = atomic_load(&s->last_ref);
  if (ref == 0 || ref <= last) return ref_error(ref, last, err);
  for (size_t i = 0; i < s->nuploading; i++)
    if (s->uploading[i] == ref)
      return error_set(err, ERR_REF_REUSED,
                       "ref %llu is being uploaded (an Upload of it is in flight): a ref names "
                       "one tensor; use another", (unsigned long long)ref);
  return 0;
}

int session_reserve_ref(session_t *s, uint64_t ref, meshd_error_t *err) {
  if (session_check_ref(s, ref, err)) return -1;
  if (s->nuploading == SESSION_UPLOADS_MAX)
    return error_set(err, ERR_QUOTA, "%d Uploads of this session are in flight, the most a "
                     "session may have", SESSION_UPLOADS_MAX);
  s->uploading[s->nuploading++] = ref;
  return 0;
}

void session_unreserve_ref(session_t *s, uint64_t ref) {
  for (size_t i = 0; i < s->nuploading; i++)
    if (s->uploading[i] == ref) {
      s->uploading[i] = s->uploading[--s->nuploading];
      return;
    }
}

int session_check_refs(session_t *s, const uint64_t *refs, size_t n, meshd_error_t *err) {
  for (size_t i = 0; i < n; i++) {
    if (session_check_ref(s, refs[i], err) != 0) return -1;
    if (i > 0 && refs[i] <= refs[i - 1])
      return error_set(err, ERR_REF_REUSED,
                       "ref %llu comes after ref %llu in this command: a command's new refs must "
                       "strictly increase too; the next free ref after them is %llu",
                       (unsigned long long)refs[i], (unsigned long long)refs[i - 1],
                       (unsigned long long)refs[i - 1] + 1);
  }
  return 0;
}

int session_claim_ref(session_t *s, uint64_t ref, meshd_error_t *err) {
  uint64_t last = atomic_load(&s->last_ref);
  for (;;) {
    if (ref == 0 || ref <= last) return ref_error(ref, last, err);
    if (atomic_compare_exchange_weak(&s->last_ref, &last, ref)) return 0;
  }
}

/* ------------------------------------------------------------------ quota */

static void human_bytes(uint64_t b, char *out, size_t len) {
  static const char *const unit[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (b < 1024) {
    snprintf(out, len, "%llu bytes", (unsigned long long)b);
    return;
  }
  double v = (double)b;
  int u = 0;
  while (v >= 1024 && u < 6) {
    v /= 1024;
    u++;
  }
  snprintf(out, len, "%.1f %s", v, unit[u]);
}

int session_charge(session_t *s, uint64_t bytes, const char *what, meshd_error_t *err) {
  uint64_t held = atomic_load(&s->bytes_held);
  for (;;) {
    uint64_t next;
    bool over = __builtin_add_overflow(held, bytes, &next);
    if (over || (s->quota_bytes && next > s->quota_bytes)) {
      char need[32], have[32], quota[32];
      human_bytes(bytes, need, sizeof need);
      human_bytes(held, have, sizeof have);
      human_bytes(s->quota_bytes, quota, sizeof quota);
      return error_set(err, ERR_QUOTA,
                       "%s needs %s but session %s already holds %s of its %s quota; drop "
                       "tensors or create the session with a larger quota_bytes",
                       what ? what : "this command", need, s->id, have, quota);
    }
    if (atomic_compare_exchange_weak(&s->bytes_held, &held, next)) return 0;
  }
}

void session_credit(session_t *s, uint64_t bytes) {
  uint64_t held = atomic_load(&s->bytes_held);
  for (;;) {
    uint64_t next = held > bytes ? held - bytes : 0;
    if (atomic_compare_exchange_weak(&s->bytes_held, &held, next)) return;
  }
}
