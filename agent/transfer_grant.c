/* Read and Write by a client holding a transfer grant instead of the server's
 * call secret (docs/protocol.md, Direct data path): the grant is checked
 * against the call it arrives on, and each one is accepted once.
 *
 * Taken nonces are kept until their grant's start-by time (after which a
 * grant not seen is refused as expired), in a table of at most
 * --max-transfer-nonces, at most --max-transfer-nonces-per-session of them
 * one session's (a quarter of the table unless set; so that one session's
 * burst of transfers cannot refuse every other session's); one given back for
 * a retry (QUOTA) is kept until its grant's expiry.
 *
 * A call a grant admitted ends at that grant's expiry if it still runs then
 * (transfer_grant_watch): one thread, started with the first such call,
 * sleeps until the earliest expiry and finishes the calls past theirs, so a
 * client that stalls mid-Write holds no allocation, and mid-Read no snapshot,
 * past the time its server forgets the transfer. */
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uthash.h>

#include "agent.h"
#include "grant.h"
#include "log.h"

/* The nonces one session holds in the table. */
typedef struct share {
  char session[64]; /* the grant's session id (cut: ids are at most 63 bytes) */
  size_t held;
  UT_hash_handle hh;
} share_t;

typedef struct seen {
  uint8_t nonce[GRANT_NONCE_LEN];
  int64_t forget_ms; /* forgotten from then on: the start-by time, or given back the expiry */
  size_t at;         /* its place in `order` */
  bool given_back;   /* kept for a retry of its grant */
  bool in_use;       /* given back, then taken again */
  bool revoked;      /* its server revoked the grant (RevokeGrants): never taken again */
  share_t *share;    /* its session's */
  UT_hash_handle hh;
} seen_t;

static const char *const result_names[GRANT_RESULT_COUNT] = {
    "accepted", "malformed", "bad_signature", "expired", "wrong_call", "reused", "table_full",
    "session_full", "unregistered", "revoked"};
static _Atomic uint64_t results[GRANT_RESULT_COUNT];

const char *transfer_grant_result_name(int r) {
  return r >= 0 && r < GRANT_RESULT_COUNT ? result_names[r] : "?";
}
uint64_t transfer_grant_results(int r) {
  return r >= 0 && r < GRANT_RESULT_COUNT ? atomic_load(&results[r]) : 0;
}

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
/* Taken nonces by nonce, and the same as a binary min-heap by forget time:
 * grants of different lifetimes (an older server's, forgotten at their expiry
 * 10 min on, among start-by times a minute on) are each forgotten when theirs
 * comes, whatever the order they came in; each take pays O(log n) for what it
 * adds and for what it forgets. */
static seen_t *seen;
static seen_t **order;
static size_t nseen, order_cap;
static share_t *shares;
static size_t max_nonces = TRANSFER_NONCES;
static size_t per_session_set; /* --max-transfer-nonces-per-session; 0: unset */
static log_limit_t refusals;

void transfer_grant_set_max_nonces(size_t n) { max_nonces = n ? n : TRANSFER_NONCES; }
void transfer_grant_set_max_nonces_per_session(size_t n) { per_session_set = n; }

/* One session's share of the table. Unset, a quarter of it whatever its size:
 * a fixed default (16384, a quarter of 65536) was no share at all in a table
 * of 16384 or fewer, and one session filled it for every other again. */
static size_t max_per_session(void) {
  if (per_session_set) return per_session_set < max_nonces ? per_session_set : max_nonces;
  return max_nonces >= 4 ? max_nonces / 4 : 1;
}

/* Nonces given back past their start-by time (forgotten meanwhile) are kept
 * beyond --max-transfer-nonces, up to this many more: each is a call's that
 * the table admitted, refused for a cause not its grant's (a Write that
 * waited for its session to open), and dropping it would turn its client's
 * retry into "expired". */
static size_t given_back_extra(void) { return max_nonces / 16 + 16; }

bool transfer_grant_call(rpc_call_t *call) {
  const rpc_identity_t *id = rpc_call_identity(call);
  return id && strcmp(id->name, "grant") == 0;
}

/* ---------------------------------------------------- order: the min-heap */

static void order_put(seen_t *e, size_t i) {
  order[i] = e;
  e->at = i;
}

static void order_up(size_t i) {
  seen_t *e = order[i];
  while (i > 0 && order[(i - 1) / 2]->forget_ms > e->forget_ms) {
    order_put(order[(i - 1) / 2], i);
    i = (i - 1) / 2;
  }
  order_put(e, i);
}

static void order_down(size_t i) {
  seen_t *e = order[i];
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= nseen) break;
    if (c + 1 < nseen && order[c + 1]->forget_ms < order[c]->forget_ms) c++;
    if (order[c]->forget_ms >= e->forget_ms) break;
    order_put(order[c], i);
    i = c;
  }
  order_put(e, i);
}

/* After e's forget time changed. */
static void order_fix(seen_t *e) {
  order_up(e->at);
  order_down(e->at);
}

/* ------------------------------------------------------------ the table */

static share_t *share_of(const char *session, bool add) {
  char key[sizeof ((share_t *)0)->session];
  snprintf(key, sizeof key, "%s", session ? session : "");
  share_t *s = NULL;
  HASH_FIND_STR(shares, key, s);
  if (!s && add && (s = calloc(1, sizeof *s))) {
    memcpy(s->session, key, sizeof key);
    HASH_ADD_STR(shares, session, s);
  }
  return s;
}

static void forget(seen_t *e) {
  seen_t *last = order[--nseen];
  if (last != e) {
    order_put(last, e->at);
    order_fix(last);
  }
  HASH_DEL(seen, e);
  if (--e->share->held == 0) {
    HASH_DEL(shares, e->share);
    free(e->share);
  }
  free(e);
}

/* The forgotten: every nonce whose time has come. */
static void sweep(int64_t now) {
  while (nseen && order[0]->forget_ms <= now) forget(order[0]);
}

/* A new entry (NULL out of memory). */
static seen_t *remember(const uint8_t *nonce, const char *session, int64_t forget_ms) {
  if (nseen == order_cap) {
    size_t cap = order_cap ? 2 * order_cap : 1024;
    seen_t **o = realloc(order, cap * sizeof *o);
    if (!o) return NULL;
    order = o;
    order_cap = cap;
  }
  seen_t *e = calloc(1, sizeof *e);
  share_t *s = e ? share_of(session, true) : NULL;
  if (!s) {
    free(e);
    return NULL;
  }
  memcpy(e->nonce, nonce, GRANT_NONCE_LEN);
  e->forget_ms = forget_ms;
  e->share = s;
  s->held++;
  HASH_ADD(hh, seen, nonce, GRANT_NONCE_LEN, e);
  order_put(e, nseen++);
  order_up(e->at);
  return e;
}

/* The table's entry of nonce (NULL: none), after forgetting those past
 * their time. Under mu. */
static seen_t *find_swept(const uint8_t *nonce, int64_t now) {
  sweep(now);
  seen_t *e = NULL;
  HASH_FIND(hh, seen, nonce, GRANT_NONCE_LEN, e);
  return e;
}

int transfer_nonce_take(const uint8_t *nonce, const char *session, int64_t forget_ms, int64_t now) {
  int rc = NONCE_TAKEN;
  pthread_mutex_lock(&mu);
  seen_t *e = find_swept(nonce, now);
  share_t *s = e ? NULL : share_of(session, false);
  if (e) {
    if (e->revoked) rc = NONCE_REVOKED;
    else if (!e->given_back || e->in_use) rc = NONCE_TAKEN_BEFORE;
    else e->in_use = true;
  } else if (forget_ms <= now) {
    rc = NONCE_LATE;
  } else if (nseen >= max_nonces) {
    rc = NONCE_TABLE_FULL;
  } else if (s && s->held >= max_per_session()) {
    rc = NONCE_SESSION_FULL;
  } else if (!remember(nonce, session, forget_ms)) {
    rc = NONCE_TABLE_FULL;
  }
  pthread_mutex_unlock(&mu);
  return rc;
}

void transfer_nonce_give_back(const uint8_t *nonce, const char *session, int64_t expiry_ms,
                              int64_t now) {
  pthread_mutex_lock(&mu);
  seen_t *e = find_swept(nonce, now);
  /* Forgotten meanwhile (its start-by time passed during its call): its
   * place was its own when it was taken, so a full table keeps it too, within
   * a bound. */
  if (!e && expiry_ms > now && nseen < max_nonces + given_back_extra())
    e = remember(nonce, session, expiry_ms);
  if (e && !e->revoked) {
    e->given_back = true;
    e->in_use = false;
    e->forget_ms = expiry_ms;
    order_fix(e);
  }
  pthread_mutex_unlock(&mu);
}

void transfer_nonce_revoke(const uint8_t *nonce, const char *session, int64_t forget_ms,
                          int64_t now) {
  pthread_mutex_lock(&mu);
  seen_t *e = find_swept(nonce, now);
  /* Beyond --max-transfer-nonces if need be: the server sends one per grant
   * it planned and revoked, a bound of its own, and a revocation dropped for
   * room would let the grant in. */
  if (!e) e = remember(nonce, session, forget_ms);
  if (e) {
    e->revoked = true;
    e->given_back = false;
    if (forget_ms > e->forget_ms) {
      e->forget_ms = forget_ms;
      order_fix(e);
    }
  }
  pthread_mutex_unlock(&mu);
  if (!e) log_error("agent", "out of memory revoking a transfer grant of session %.8s",
                    session ? session : "");
}

void transfer_grant_give_back(const uint8_t *nonce, const char *session, int64_t expiry_ms) {
  transfer_nonce_give_back(nonce, session, expiry_ms, grant_now_unix_ms());
}

void transfer_nonces_clear(void) {
  pthread_mutex_lock(&mu);
  while (nseen) forget(order[nseen - 1]);
  pthread_mutex_unlock(&mu);
}

#define REVOKED_MSG                                                                        \
  "transfer grant refused: revoked (the principal that planned the transfer lost its token at " \
  "a reload of the server's --auth-tokens)"

/* When a grant's nonce may be forgotten: its start-by time (0: an older
 * server's grant, its expiry). */
static int64_t start_by(const Meshd__Agent__V1__TransferGrant *g) {
  return g->start_by_unix_ms > 0 && g->start_by_unix_ms < g->expiry_unix_ms ? g->start_by_unix_ms
                                                                            : g->expiry_unix_ms;
}

static const char *dir_name(int d) {
  return d == GRANT_READ    ? "Read"
         : d == GRANT_WRITE ? "Write"
                                                                    : "no call";
}

static int refuse(rpc_call_t *call, int result, int code, char *msg, size_t msglen,
                  const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static int refuse(rpc_call_t *call, int result, int code, char *msg, size_t msglen,
                  const char *fmt, ...) {
  atomic_fetch_add(&results[result], 1);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, msglen, fmt, ap);
  va_end(ap);
  agent_log_refused(&refusals, call, msg, "grants");
  return code;
}

/* The call's grant, its signature checked with the current call secret: 0
 * with *out, or a refusal (counted and logged) with msg. */
static int open_grant(rpc_call_t *call, Meshd__Agent__V1__TransferGrant **out, char *msg,
                      size_t msglen) {
  *out = NULL;
  const int denied = GRPC_STATUS_PERMISSION_DENIED;
  uint8_t buf[GRANT_MAX_BYTES];
  long n = rpc_call_metadata_bin(call, GRANT_MD, buf, sizeof buf);
  if (n < 0 || (size_t)n > sizeof buf)
    return refuse(call, GRANT_MALFORMED, denied, msg, msglen, "transfer grant refused: malformed (%s)",
                  n < 0 ? "no " GRANT_MD " metadata" : "longer than 4096 bytes");
  char secret[SECRET_HEX_LEN + 1];
  if (agent_auth_secret(secret))
    return refuse(call, GRANT_UNREGISTERED, GRPC_STATUS_UNAVAILABLE, msg, msglen,
                  "transfer grant refused: this agent is not registered with a server now");
  int rc = grant_open(secret, buf, (size_t)n, out);
  memset(secret, 0, sizeof secret);
  if (rc == -1)
    return refuse(call, GRANT_BAD_SIGNATURE, denied, msg, msglen, "transfer grant refused: bad signature (it was not "
                  "issued by this agent's server, or it was altered)");
  if (rc)
    return refuse(call, GRANT_MALFORMED, denied, msg, msglen, "transfer grant refused: malformed (not a TransferGrant)");
  return 0;
}

/* Whether nonce is taken (used, or in use): 1; given back, free to take: 2;
 * revoked: 3; neither: 0. */
static int nonce_state(const uint8_t *nonce, int64_t now) {
  pthread_mutex_lock(&mu);
  seen_t *e = find_swept(nonce, now);
  int st = !e ? 0 : e->revoked ? 3 : e->given_back && !e->in_use ? 2 : 1;
  pthread_mutex_unlock(&mu);
  return st;
}

int transfer_grant_signed(rpc_call_t *call, char *msg, size_t msglen) {
  char secret[SECRET_HEX_LEN + 1];
  if (agent_auth_secret(secret)) return 1; /* the handler refuses it, UNAVAILABLE */
  memset(secret, 0, sizeof secret);
  Meshd__Agent__V1__TransferGrant *g = NULL;
  int code = open_grant(call, &g, msg, msglen);
  if (!code) {
    /* A signature proves the grant was issued, not that it is still good: an
     * expired grant is refused here, before its request is read; one whose
     * nonce was taken (used, or in use) is a stranger's until its handler
     * refuses it "reused" (or takes it, given back meanwhile), so that
     * replays of an old grant stay within --max-unauthenticated-requests. */
    int64_t now = grant_now_unix_ms();
    if (g->expiry_unix_ms <= now)
      code = refuse(call, GRANT_EXPIRED, GRPC_STATUS_PERMISSION_DENIED, msg, msglen,
                    "transfer grant refused: expired %lld ms ago; ask the server for a new one "
                    "(PlanTransfer)", (long long)(now - g->expiry_unix_ms));
    else if (g->nonce.len == GRANT_NONCE_LEN) {
      int st = nonce_state(g->nonce.data, now);
      if (st == 3)
        code = refuse(call, GRANT_REVOKED, GRPC_STATUS_PERMISSION_DENIED, msg, msglen, REVOKED_MSG);
      else if (st == 1)
        code = 1;
      else if (st == 0 && start_by(g) <= now) /* late, and not given back */
        code = refuse(call, GRANT_EXPIRED, GRPC_STATUS_PERMISSION_DENIED, msg, msglen,
                      "transfer grant refused: expired: its call did not start by its start-by "
                      "time (%lld ms ago); ask the server for a new one (PlanTransfer)",
                      (long long)(now - start_by(g)));
    }
  }
  if (g) protobuf_c_message_free_unpacked(&g->base, NULL);
  return code;
}

int transfer_grant_admit(rpc_call_t *call, int direction, const char *session, uint64_t ref,
                         uint64_t after_seq, Meshd__Agent__V1__TransferGrant **out, char *msg,
                         size_t msglen) {
  *out = NULL;
  const int denied = GRPC_STATUS_PERMISSION_DENIED;
  Meshd__Agent__V1__TransferGrant *g = NULL;
  int code = open_grant(call, &g, msg, msglen);
  if (code) return code;
  int64_t now = grant_now_unix_ms();
  int64_t rank = atomic_load(&agent_rank);
  if (g->expiry_unix_ms <= now)
    code = refuse(call, GRANT_EXPIRED, denied, msg, msglen, "transfer grant refused: expired %lld ms ago; ask the "
                  "server for a new one (PlanTransfer)", (long long)(now - g->expiry_unix_ms));
  else if ((int)g->direction != direction)
    code = refuse(call, GRANT_WRONG_CALL, denied, msg, msglen, "transfer grant refused: wrong direction (the grant "
                  "is for a %s, this call is a %s)", dir_name(g->direction), dir_name(direction));
  else if (rank < 0 || g->rank != (uint64_t)rank)
    code = refuse(call, GRANT_WRONG_CALL, denied, msg, msglen, "transfer grant refused: wrong rank (the grant is "
                  "for rank %u, this agent is rank %lld)", g->rank, (long long)rank);
  else if (session && strcmp(session, g->session_id) != 0)
    code = refuse(call, GRANT_WRONG_CALL, denied, msg, msglen, "transfer grant refused: wrong session (the grant "
                  "is for another session than the request's)");
  else if (session && ref != g->ref)
    code = refuse(call, GRANT_WRONG_CALL, denied, msg, msglen, "transfer grant refused: wrong ref (the grant is for "
                  "ref %llu, the request names ref %llu)", (unsigned long long)g->ref,
                  (unsigned long long)ref);
  else if (session && after_seq != g->after_seq)
    code = refuse(call, GRANT_WRONG_CALL, denied, msg, msglen, "transfer grant refused: wrong after_seq (the grant "
                  "is for seq %llu, the request names %llu)", (unsigned long long)g->after_seq,
                  (unsigned long long)after_seq);
  else if (direction == GRANT_WRITE && !g->spec)
    code = refuse(call, GRANT_MALFORMED, denied, msg, msglen, "transfer grant refused: malformed (a Write grant "
                  "without a spec)");
  else if (g->nonce.len != GRANT_NONCE_LEN)
    code = refuse(call, GRANT_MALFORMED, denied, msg, msglen, "transfer grant refused: malformed (nonce of %zu "
                  "bytes)", g->nonce.len);
  if (!code) {
    int t = transfer_nonce_take(g->nonce.data, g->session_id, start_by(g), now);
    if (t == NONCE_LATE)
      code = refuse(call, GRANT_EXPIRED, denied, msg, msglen, "transfer grant refused: expired: its "
                    "call did not start by its start-by time (%lld ms ago); ask the server for a "
                    "new one (PlanTransfer)", (long long)(now - start_by(g)));
    else if (t == NONCE_REVOKED)
      code = refuse(call, GRANT_REVOKED, denied, msg, msglen, REVOKED_MSG);
    else if (t == NONCE_TAKEN_BEFORE)
      code = refuse(call, GRANT_REUSED, denied, msg, msglen, "transfer grant refused: reused (each grant is "
                    "good for one call; ask the server for a new one)");
    else if (t == NONCE_TABLE_FULL)
      code = refuse(call, GRANT_TABLE_FULL, GRPC_STATUS_RESOURCE_EXHAUSTED, msg, msglen, "transfer "
                    "grant refused: %zu grants are in use on this agent already, the most "
                    "--max-transfer-nonces allows; retry later", max_nonces);
    else if (t == NONCE_SESSION_FULL)
      code = refuse(call, GRANT_SESSION_FULL, GRPC_STATUS_RESOURCE_EXHAUSTED, msg, msglen,
                    "transfer grant refused: %zu grants are in use on this agent already for this "
                    "session, the most --max-transfer-nonces-per-session allows (of "
                    "--max-transfer-nonces %zu for all sessions); retry later", max_per_session(),
                    max_nonces);
  }
  if (code) {
    protobuf_c_message_free_unpacked(&g->base, NULL);
    return code;
  }
  atomic_fetch_add(&results[GRANT_ACCEPTED], 1);
  *out = g;
  return 0;
}

/* ------------------------------------------------------------------ watch */

static pthread_mutex_t watch_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t watch_cond = PTHREAD_COND_INITIALIZER;
static grant_watch_t *watched; /* a doubly linked list, unordered */
static int64_t watch_wake_ms;  /* when the thread wakes next; 0: not before a signal */
static pthread_once_t watch_once = PTHREAD_ONCE_INIT;
static bool watch_running;
static bool watch_stopping;
static pthread_t watch_thread;
static _Atomic uint64_t watch_ended;

uint64_t transfer_grant_watch_ended(void) { return atomic_load(&watch_ended); }

static void unlink_locked(grant_watch_t *w) {
  if (w->prev) w->prev->next = w->next;
  else watched = w->next;
  if (w->next) w->next->prev = w->prev;
  w->prev = w->next = NULL;
  w->listed = false;
}

/* Finishes the calls past their expiry (under watch_mu: a handler's
 * transfer_grant_unwatch, before it lets go of its call, waits for that), and
 * returns the earliest expiry left, or 0. */
static int64_t watch_sweep_locked(int64_t now) {
  int64_t next = 0;
  for (grant_watch_t *w = watched, *n; w; w = n) {
    n = w->next;
    if (w->expiry_ms > now) {
      if (!next || w->expiry_ms < next) next = w->expiry_ms;
      continue;
    }
    unlink_locked(w);
    atomic_fetch_add(&watch_ended, 1);
    /* Not behind chunks a stalled reader does not take; ignored when the
     * call ended first. Runs no callback of the call here. */
    bool write = strcmp(w->what, "Write") == 0;
    rpc_call_abort(w->call, GRPC_STATUS_PERMISSION_DENIED, "PERMISSION_DENIED",
                    "%s: transfer grant expired before the %s finished (%lld ms ago by this "
                    "agent's clock); %s", w->what, w->what, (long long)(now - w->expiry_ms),
                    write ? "nothing was stored" : "the rest was not sent");
  }
  return next;
}

static void *watch_main(void *arg) {
  (void)arg;
  pthread_mutex_lock(&watch_mu);
  while (!watch_stopping) {
    int64_t next = watch_sweep_locked(grant_now_unix_ms());
    watch_wake_ms = next;
    if (!next) {
      pthread_cond_wait(&watch_cond, &watch_mu);
      continue;
    }
    /* CLOCK_REALTIME, the grants' clock (a condition variable's default),
     * less a test's shift of it (grant_clock_shift). */
    int64_t at = next - grant_clock_shift_ms();
    struct timespec ts = {.tv_sec = at / 1000, .tv_nsec = (long)(at % 1000) * 1000000};
    pthread_cond_timedwait(&watch_cond, &watch_mu, &ts);
  }
  pthread_mutex_unlock(&watch_mu);
  return NULL;
}

static void watch_start(void) {
  pthread_mutex_lock(&watch_mu);
  if (!watch_stopping && pthread_create(&watch_thread, NULL, watch_main, NULL) == 0) {
    pthread_setname_np(watch_thread, "grant-watch");
    watch_running = true;
  } else if (!watch_stopping) {
    log_error("agent", "cannot start the grant-watch thread: calls under transfer grants are "
              "not ended at their grants' expiry");
  }
  pthread_mutex_unlock(&watch_mu);
}

void transfer_grant_watch_stop(void) {
  pthread_mutex_lock(&watch_mu);
  bool join = watch_running;
  watch_stopping = true;
  watch_running = false;
  pthread_cond_signal(&watch_cond);
  pthread_mutex_unlock(&watch_mu);
  if (join) pthread_join(watch_thread, NULL);
}

void transfer_grant_watch(grant_watch_t *w, rpc_call_t *call, const char *what,
                          const uint8_t *nonce, int64_t expiry_ms) {
  pthread_once(&watch_once, watch_start);
  pthread_mutex_lock(&watch_mu);
  w->call = call;
  memcpy(w->nonce, nonce, GRANT_NONCE_LEN);
  w->what = what;
  w->expiry_ms = expiry_ms;
  w->prev = NULL;
  w->next = watched;
  if (watched) watched->prev = w;
  watched = w;
  w->listed = true;
  if (watch_running && (!watch_wake_ms || expiry_ms < watch_wake_ms)) {
    watch_wake_ms = expiry_ms;
    pthread_cond_signal(&watch_cond);
  }
  pthread_mutex_unlock(&watch_mu);
}

void transfer_grant_unwatch(grant_watch_t *w) {
  pthread_mutex_lock(&watch_mu);
  if (w->listed) unlink_locked(w);
  pthread_mutex_unlock(&watch_mu);
}

/* ------------------------------------------------------------ revocation */

/* Ends the running calls that a revoked nonce admitted (under watch_mu, as
 * an expiry does: their handlers' unwatch waits for it). */
static size_t watch_revoke(const uint8_t *nonce) {
  size_t ended = 0;
  pthread_mutex_lock(&watch_mu);
  for (grant_watch_t *w = watched, *n; w; w = n) {
    n = w->next;
    if (memcmp(w->nonce, nonce, GRANT_NONCE_LEN) != 0) continue;
    unlink_locked(w);
    ended++;
    bool write = strcmp(w->what, "Write") == 0;
    rpc_call_abort(w->call, GRPC_STATUS_PERMISSION_DENIED, "PERMISSION_DENIED",
                   "%s: transfer grant revoked during the %s (the principal that planned the "
                   "transfer lost its token at a reload of the server's --auth-tokens); %s",
                   w->what, w->what, write ? "nothing was stored" : "the rest was not sent");
  }
  pthread_mutex_unlock(&watch_mu);
  return ended;
}

void transfer_grants_revoke(const Meshd__Agent__V1__Instruction *ins) {
  const Meshd__Agent__V1__RevokeGrants *r = ins->revoke_grants;
  if (!r) return;
  int64_t now = grant_now_unix_ms();
  int64_t keep = r->keep_ms > 0 && r->keep_ms < REVOKE_KEEP_MAX_MS ? r->keep_ms : REVOKE_KEEP_MAX_MS;
  size_t ended = 0, n = 0;
  for (size_t i = 0; i < r->n_nonces; i++) {
    if (r->nonces[i].len != GRANT_NONCE_LEN) continue; /* validate refused it before */
    transfer_nonce_revoke(r->nonces[i].data, ins->session_id, now + keep, now);
    ended += watch_revoke(r->nonces[i].data);
    n++;
  }
  log_info("agent", "session %.8s: %zu transfer grant(s) revoked by the server (a tokens reload); "
           "%zu running Read/Write ended", ins->session_id ? ins->session_id : "", n, ended);
}
