/* server/session (the table) and server/session_service (its RPCs, served
 * in-process on 127.0.0.1:0). Criterion forks per test. */
#include <criterion/criterion.h>
#include <ctype.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"
#include "meshd/v1/tensor_service.pb-c.h"
#include "rpc.h"
#include "session.h"
#include "session_service.h"

/* A channel to a live peer in this process: seconds to connect, since a loaded
 * machine (CI runs the sanitized suites on 2 cores) can take longer than the
 * 100 ms default to answer the first SETTINGS frame. */
static const rpc_channel_opts_t live_peer = {.connect_timeout_ms = 5000};


static session_table_t *table;
static meshd_error_t err;

/* Checks made off the test's main thread (callbacks, worker threads), where
 * Criterion's asserts must not run: counted here, asserted at the end of
 * each test (an assert in .fini would not fail the test). */
static atomic_int offthread_failures;
#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      atomic_fetch_add(&offthread_failures, 1);                                \
    }                                                                          \
  } while (0)

#define ASSERT_NO_BAD()                             \
  cr_assert_eq(atomic_load(&offthread_failures), 0, \
               "checks failed off the main thread (see stderr)")

/* What on_closed saw. */
static atomic_int closed_calls, closed_why[3];
static atomic_int destroyed;

static void on_closed(session_t *s, session_end_t why, void *arg) {
  CHECK(arg == &closed_calls);
  CHECK(atomic_load(&s->closed));
  /* The table holds a reference during the callback, so the objects are alive
   * (under ASan a premature free shows up as a use-after-free here). */
  pthread_mutex_lock(&s->mu);
  CHECK(!s->objects || *(int *)s->objects == 42);
  pthread_mutex_unlock(&s->mu);
  atomic_fetch_add(&closed_calls, 1);
  atomic_fetch_add(&closed_why[why], 1);
}

static void destroy_objects(void *p) {
  CHECK(*(int *)p == 42);
  free(p);
  atomic_fetch_add(&destroyed, 1);
}

static void hang_objects(session_t *s) {
  int *p = malloc(sizeof *p);
  *p = 42;
  pthread_mutex_lock(&s->mu);
  session_set_objects(s, p, destroy_objects);
  pthread_mutex_unlock(&s->mu);
}

static void setup(void) {
  log_set_level(LOG_LEVEL_WARN);
  rpc_init();
  table = session_table_create(300, 0, on_closed, &closed_calls);
  cr_assert_not_null(table);
}

static void teardown(void) {
  session_table_destroy(table);
  rpc_shutdown();
}

TestSuite(session, .init = setup, .fini = teardown, .timeout = 30);

static session_t *create(const char *name, uint64_t ttl, uint64_t quota) {
  session_t *s = NULL;
  cr_assert_eq(session_create(table, "anonymous", name, ttl, quota, &s, &err), 0, "%s", err.msg);
  return s;
}

static bool all_hex(const char *s, size_t n) {
  if (strlen(s) != n) return false;
  for (size_t i = 0; i < n; i++)
    if (!isxdigit((unsigned char)s[i]) || isupper((unsigned char)s[i])) return false;
  return true;
}

static void expect_no_session(session_t *got, const char *needle) {
  cr_assert_null(got);
  cr_assert_eq(err.kind, ERR_NO_SESSION, "kind %s: %s", error_kind_name(err.kind), err.msg);
  cr_assert(strstr(err.msg, needle), "message '%s' lacks '%s'", err.msg, needle);
}

Test(session, create_and_acquire) {
  session_t *s = create("trainer", 0, 0);
  cr_assert(all_hex(s->id, SESSION_ID_LEN), "id %s", s->id);
  cr_assert(all_hex(s->token, SESSION_TOKEN_LEN), "token %s", s->token);
  cr_assert_str_eq(s->client_name, "trainer");
  cr_assert_eq(s->ttl_s, 300);
  cr_assert_eq(s->quota_bytes, 0);
  cr_assert_eq(session_count(table), 1);

  session_t *a = session_acquire(table, s->id, s->token, &err);
  cr_assert_eq(a, s, "%s", err.msg);
  session_release(a);
  session_release(s);
  cr_assert_eq(session_count(table), 1, "the table keeps the session while it is open");

  session_t *b = create("other", 60, 1024);
  cr_assert_str_neq(b->id, s->id);
  cr_assert_str_neq(b->token, s->token);
  cr_assert_eq(b->ttl_s, 60);
  cr_assert_eq(b->quota_bytes, 1024);
  session_release(b);
  cr_assert_eq(session_count(table), 2);
  ASSERT_NO_BAD();
}

Test(session, one_principal_holds_at_most_its_limit_of_sessions) {
  session_table_set_owner_limit(table, 2);
  session_t *a[3] = {NULL}, *b = NULL;
  cr_assert_eq(session_create(table, "alice", "a0", 0, 0, &a[0], &err), 0, "%s", err.msg);
  cr_assert_eq(session_create(table, "alice", "a1", 0, 0, &a[1], &err), 0, "%s", err.msg);
  cr_expect_eq(session_create(table, "alice", "a2", 0, 0, &a[2], &err), -1);
  cr_expect_eq(err.kind, ERR_QUOTA);
  cr_expect(strstr(err.msg, "'alice' already holds 2 open sessions") &&
            strstr(err.msg, "--max-sessions-per-principal (2)"), "%s", err.msg);
  cr_expect_eq(session_create(table, "bob", "b", 0, 0, &b, &err), 0, "another principal: %s", err.msg);
  cr_expect_str_eq(b->owner, "bob");
  session_close(table, a[0]); /* a closed session frees its place */
  cr_expect_eq(session_create(table, "alice", "a2", 0, 0, &a[2], &err), 0, "%s", err.msg);
  session_info_t *v;
  size_t n;
  cr_assert_eq(session_list(table, &v, &n), 0);
  cr_expect_eq(n, 3);
  int alices = 0;
  for (size_t i = 0; i < n; i++) alices += !strcmp(v[i].owner, "alice");
  cr_expect_eq(alices, 2);
  free(v);
  for (int i = 0; i < 3; i++) session_release(a[i]);
  session_release(b);
}

/* CreateSession checks --max-sessions-per-principal against a count kept as
 * sessions enter and leave (it walked every session). Each way a session ends
 * must give its principal's place back, once: closed (CloseSession, and a
 * CreateSession whose call was cancelled closes so), expired by the table's
 * sweep, expired by the acquire that found it idle. A principal's count that
 * forgot one end refuses it for good; one given back twice lets it past the cap. */
static void alice_admitted(session_t **s, uint64_t ttl) {
  cr_assert_eq(session_create(table, "alice", "a", ttl, 0, s, &err), 0, "%s", err.msg);
}

static void alice_refused(void) {
  session_t *s = NULL;
  cr_assert_eq(session_create(table, "alice", "over", 0, 0, &s, &err), -1,
               "a third session of alice's got past --max-sessions-per-principal 2");
  cr_assert_eq(err.kind, ERR_QUOTA);
  cr_assert(strstr(err.msg, "'alice' already holds 2 open sessions"), "%s", err.msg);
}

Test(session, a_principals_place_comes_back_however_its_session_ends) {
  session_table_set_owner_limit(table, 2);
  session_t *keep = NULL, *s = NULL, *bob = NULL;
  alice_admitted(&keep, 300);
  cr_assert_eq(session_create(table, "bob", "b", 0, 0, &bob, &err), 0, "%s", err.msg);

  alice_admitted(&s, 1); /* closed */
  alice_refused();
  session_close(table, s);
  cr_expect_not(session_close(table, s), "closed twice");
  session_release(s);

  alice_admitted(&s, 1); /* expired by the sweep */
  alice_refused();
  session_release(s);
  cr_assert_eq(session_expire(table, rpc_now_ms() + 1500), 1);

  alice_admitted(&s, 1); /* expired by the acquire that found it idle */
  alice_refused();
  char id[SESSION_ID_LEN + 1], token[SESSION_TOKEN_LEN + 1];
  strcpy(id, s->id);
  strcpy(token, s->token);
  session_release(s);
  atomic_store(&s->last_used_ms, rpc_now_ms() - 1500);
  expect_no_session(session_acquire(table, id, token, &err), "expired after 1 s idle");

  alice_admitted(&s, 300); /* and the cap still holds: each end gave back exactly one */
  alice_refused();
  cr_assert_eq(session_count(table), 3);
  session_release(s);
  session_release(keep);
  session_release(bob);
  ASSERT_NO_BAD();
}

/* ListSessions' pages come from an index by seq that drops closed sessions and
 * is squeezed as they add up: every page after any churn is the open sessions
 * after the token's seq, oldest first, once each. */
Test(session, pages_follow_seq_order_while_sessions_close) {
  enum { N = 300 };
  session_t *s[N];
  bool open[N];
  for (int i = 0; i < N; i++) {
    s[i] = create("p", 0, 0);
    open[i] = true;
    cr_assert_eq(s[i]->seq, (uint64_t)i + 1);
  }
  /* Close 2 of every 3, in an order that empties slots all over the index. */
  for (int i = N - 1; i >= 0; i--)
    if (i % 3) {
      session_close(table, s[i]);
      open[i] = false;
    }
  for (size_t size = 1; size <= 7; size += 3) {
    uint64_t after = 0;
    int want = 0, pages = 0;
    for (;;) {
      session_info_t *v;
      size_t n;
      uint64_t next;
      cr_assert_eq(session_list_page(table, NULL, after, size, &v, &n, &next), 0);
      cr_assert_leq(n, size);
      for (size_t k = 0; k < n; k++) {
        while (want < N && !open[want]) want++;
        cr_assert_lt(want, N, "a page shows more than the open sessions");
        cr_assert_str_eq(v[k].id, s[want]->id, "page %d row %zu", pages, k);
        want++;
      }
      free(v);
      pages++;
      if (!next) break;
      cr_assert_eq(next, s[want - 1]->seq);
      after = next;
    }
    while (want < N && !open[want]) want++;
    cr_assert_eq(want, N, "the pages left out open sessions (page size %zu)", size);
  }
  /* A token that names a closed session goes on from the next open one. */
  session_info_t *v;
  size_t n;
  uint64_t next;
  cr_assert_eq(session_list_page(table, NULL, s[1]->seq, 1, &v, &n, &next), 0);
  cr_assert_eq(n, 1);
  cr_assert_str_eq(v[0].id, s[3]->id);
  free(v);
  cr_assert_eq(session_list_page(table, NULL, N + 1, 1, &v, &n, &next), -2);
  for (int i = 0; i < N; i++) session_release(s[i]);
  ASSERT_NO_BAD();
}

static session_t *create_as(const char *owner) {
  session_t *s = NULL;
  cr_assert_eq(session_create(table, owner, "c", 0, 0, &s, &err), 0, "%s", err.msg);
  return s;
}

/* Every page of owner's sessions (NULL: an admin's listing) after `after`,
 * page size `size`: the rows must be want[0..nwant) in order, each once. */
static void expect_pages(const char *owner, uint64_t after, size_t size, session_t **want,
                         size_t nwant) {
  const char *label = owner ? owner : "admin";
  size_t got = 0;
  for (int pages = 0;; pages++) {
    cr_assert_lt(pages, 10000, "next never ran out");
    session_info_t *v;
    size_t n;
    uint64_t next;
    cr_assert_eq(session_list_page(table, owner, after, size, &v, &n, &next), 0);
    cr_assert_leq(n, size);
    for (size_t k = 0; k < n; k++, got++) {
      cr_assert_lt(got, nwant, "%s: more rows than its open sessions", label);
      cr_assert_str_eq(v[k].id, want[got]->id, "%s: row %zu (page size %zu)", label, got, size);
      if (owner) cr_assert_str_eq(v[k].owner, owner);
    }
    free(v);
    if (!next) break;
    cr_assert_eq(next, want[got - 1]->seq);
    after = next;
  }
  cr_assert_eq(got, nwant, "%s: the pages left out open sessions (page size %zu)", label, size);
}

/* A principal's pages come from its own index: with many principals' sessions
 * interleaved and some closed, each principal's pages are its open sessions
 * after the token's seq, oldest first, once each; a token naming another
 * principal's session (or a closed one) goes on after that seq, as before. */
Test(session, a_principals_pages_among_many_interleaved_principals) {
  enum { N = 600, P = 5 };
  static const char *const who[P] = {"p0", "p1", "p2", "p3", "p4"};
  session_t *s[N];
  int owner_of[N];
  unsigned r = 12345;
  for (int i = 0; i < N; i++) {
    r = r * 1103515245u + 12345u;
    owner_of[i] = (int)((r >> 16) % P);
    s[i] = create_as(who[owner_of[i]]);
  }
  bool open[N];
  for (int i = 0; i < N; i++) {
    open[i] = (i % 5) != 2 && (i % 7) != 3;
    if (!open[i]) session_close(table, s[i]);
  }
  session_t *mine[N];
  for (int p = 0; p < P; p++) {
    size_t m = 0;
    for (int i = 0; i < N; i++)
      if (open[i] && owner_of[i] == p) mine[m++] = s[i];
    cr_assert_gt(m, 50);
    for (size_t size = 1; size <= 10; size += 9) expect_pages(who[p], 0, size, mine, m);
    /* From a seq of another principal's session and of a closed one. */
    for (int i = 100; i < 110; i++) {
      size_t k = 0;
      while (k < m && mine[k]->seq <= s[i]->seq) k++;
      expect_pages(who[p], s[i]->seq, 4, mine + k, m - k);
    }
  }
  /* A principal with no session: one empty last page; a forged token is still refused. */
  expect_pages("nobody", 0, 3, NULL, 0);
  session_info_t *v;
  size_t n;
  uint64_t next;
  cr_assert_eq(session_list_page(table, "p1", N + 1, 1, &v, &n, &next), -2);
  cr_assert_eq(session_list_page(table, "nobody", N + 1, 1, &v, &n, &next), -2);
  for (int i = 0; i < N; i++) session_release(s[i]);
  ASSERT_NO_BAD();
}

/* After a burst of sessions closes, the seq indexes give their memory back:
 * a server that once held 10k sessions and holds 3 now keeps a few slots, not
 * 16k; a principal's index goes with its last session. */
Test(session, the_seq_index_gives_memory_back_after_a_burst) {
  enum { BURST = 10000 };
  session_t *keep[3];
  keep[0] = create_as("stays");
  session_t **burst = malloc(BURST * sizeof *burst);
  cr_assert_not_null(burst);
  for (int i = 0; i < BURST; i++) {
    burst[i] = create_as("burst");
    if (i == BURST / 2) keep[1] = create_as("stays");
  }
  keep[2] = create_as("stays");
  size_t peak = session_table_index_capacity(table, NULL);
  cr_assert_geq(peak, BURST + 3);
  size_t burst_peak = session_table_index_capacity(table, "burst");
  for (int i = 0; i < BURST; i++) {
    session_close(table, burst[i]);
    session_release(burst[i]);
  }
  free(burst);
  size_t now = session_table_index_capacity(table, NULL);
  cr_assert_leq(now, 64, "the index keeps %zu slots for 3 sessions (peak %zu)", now, peak);
  cr_assert_geq(burst_peak, BURST);
  cr_assert_leq(session_table_index_capacity(table, "stays"), 8);
  cr_assert_eq(session_table_index_capacity(table, "burst"), 0);
  expect_pages("stays", 0, 2, keep, 3);
  expect_pages(NULL, 0, 1, keep, 3); /* an admin's */
  /* It grows again as needed. */
  session_t *more[100];
  for (int i = 0; i < 100; i++) more[i] = create_as("stays");
  cr_assert_geq(session_table_index_capacity(table, NULL), 103);
  for (int i = 0; i < 100; i++) session_release(more[i]);
  for (int i = 0; i < 3; i++) session_release(keep[i]);
  ASSERT_NO_BAD();
}

Test(session, wrong_or_missing_credentials) {
  session_t *s = create("c", 0, 0);
  char bad[SESSION_TOKEN_LEN + 2];
  snprintf(bad, sizeof bad, "%s", s->token);
  bad[10] = bad[10] == 'a' ? 'b' : 'a';
  expect_no_session(session_acquire(table, s->id, bad, &err), "wrong token for session '");
  cr_assert(strstr(err.msg, s->id));
  cr_assert_null(strstr(err.msg, s->token), "the message must not leak the token");
  /* a prefix, an extension, an empty token */
  snprintf(bad, sizeof bad, "%.63s", s->token);
  expect_no_session(session_acquire(table, s->id, bad, &err), "wrong token");
  snprintf(bad, sizeof bad, "%s0", s->token);
  expect_no_session(session_acquire(table, s->id, bad, &err), "wrong token");
  expect_no_session(session_acquire(table, s->id, "", &err), "no token");
  expect_no_session(session_acquire(table, s->id, NULL, &err), "no token");
  expect_no_session(session_acquire(table, NULL, s->token, &err), "no session id");

  expect_no_session(session_acquire(table, "abc", s->token, &err),
                    "no session 'abc': it was closed, expired (idle past its ttl: 300 s unless "
                    "CreateSession asked for another), or never existed; create a new one");
  char longid[200];
  memset(longid, 'f', sizeof longid - 1);
  longid[sizeof longid - 1] = '\0';
  expect_no_session(session_acquire(table, longid, s->token, &err), "ffff...'");
  session_release(s);
  ASSERT_NO_BAD();
}

Test(session, close_runs_callback_once_and_objects_die_with_last_ref) {
  session_t *s = create("c", 0, 0);
  hang_objects(s);
  char id[SESSION_ID_LEN + 1], token[SESSION_TOKEN_LEN + 1];
  strcpy(id, s->id);
  strcpy(token, s->token);
  session_t *other = session_acquire(table, id, token, &err);
  cr_assert_not_null(other);

  cr_assert(session_close(table, s));
  cr_assert_eq(atomic_load(&closed_calls), 1);
  cr_assert_eq(atomic_load(&closed_why[SESSION_END_CLOSED]), 1);
  cr_assert_not(session_close(table, s), "a second close does nothing");
  cr_assert_eq(atomic_load(&closed_calls), 1);
  cr_assert_eq(session_count(table), 0);
  expect_no_session(session_acquire(table, id, token, &err), "no session");

  cr_assert_eq(atomic_load(&destroyed), 0, "two holders left");
  session_release(s);
  cr_assert_eq(atomic_load(&destroyed), 0, "one holder left");
  cr_assert(atomic_load(&other->closed));
  session_release(other);
  cr_assert_eq(atomic_load(&destroyed), 1);
  ASSERT_NO_BAD();
}

Test(session, expire_closes_idle_sessions) {
  session_t *s = create("short", 1, 0), *keep = create("long", 60, 0);
  hang_objects(s);
  int64_t now = rpc_now_ms();
  session_release(s);
  session_release(keep);
  cr_assert_eq(session_expire(table, now + 500), 0);
  cr_assert_eq(session_count(table), 2);
  cr_assert_eq(session_expire(table, now + 1500), 1);
  cr_assert_eq(atomic_load(&closed_why[SESSION_END_EXPIRED]), 1);
  cr_assert_eq(atomic_load(&destroyed), 1, "nobody held it, so its objects are gone");
  cr_assert_eq(session_count(table), 1);
  cr_assert_eq(session_expire(table, now + 1500), 0, "expired once");
  cr_assert_eq(atomic_load(&closed_calls), 1);
  ASSERT_NO_BAD();
}

Test(session, acquire_renews_the_lease) {
  session_t *s = create("c", 1, 0);
  atomic_store(&s->last_used_ms, rpc_now_ms() - 900);
  session_t *a = session_acquire(table, s->id, s->token, &err);
  cr_assert_not_null(a, "%s", err.msg);
  int64_t now = rpc_now_ms();
  cr_assert_geq(atomic_load(&s->last_used_ms), now - 5);
  session_release(a);
  cr_assert_eq(session_expire(table, now + 500), 0);

  atomic_store(&s->last_used_ms, rpc_now_ms() - 900);
  session_touch(s);
  cr_assert_eq(session_expire(table, rpc_now_ms() + 500), 0);
  session_release(s);
  ASSERT_NO_BAD();
}

Test(session, another_principals_acquire_changes_nothing) {
  session_t *s = NULL;
  cr_assert_eq(session_create(table, "alice", "c", 1, 0, &s, &err), 0, "%s", err.msg);
  session_release(s); /* CreateSession's call ended: s is idle */
  int64_t old = rpc_now_ms() - 900;
  atomic_store(&s->last_used_ms, old);
  cr_assert_null(session_acquire_as(table, s->id, s->token, "bob", &err));
  cr_assert_eq(err.kind, ERR_PERMISSION_DENIED, "kind %s: %s", error_kind_name(err.kind), err.msg);
  cr_assert(strstr(err.msg, "belongs to another principal") && strstr(err.msg, "'bob'"), "%s",
            err.msg);
  cr_assert_eq(atomic_load(&s->last_used_ms), old, "the stranger's call renewed the lease");
  cr_assert_eq(atomic_load(&s->calls), 0);
  session_t *a = session_acquire_as(table, s->id, s->token, "alice", &err);
  cr_assert_eq(a, s, "%s", err.msg);
  session_release(a);
  ASSERT_NO_BAD();
}

Test(session, acquire_of_an_idle_session_expires_it) {
  session_t *s = create("c", 1, 0);
  char id[SESSION_ID_LEN + 1], token[SESSION_TOKEN_LEN + 1];
  strcpy(id, s->id);
  strcpy(token, s->token);
  session_ref(s); /* keeps s readable once the table let it go */
  session_release(s);
  session_release(s); /* CreateSession's call and this one ended: s is idle */
  atomic_store(&s->last_used_ms, rpc_now_ms() - 1500);
  expect_no_session(session_acquire(table, id, token, &err), "expired after 1 s idle");
  cr_assert_eq(atomic_load(&closed_why[SESSION_END_EXPIRED]), 1);
  cr_assert_eq(session_count(table), 0);
  ASSERT_NO_BAD();
}

/* ------------------------------------------------------- calls in flight */

/* Issue 12: a session with a call in flight is never idle, however long the
 * call takes (a Sync waiting on a stopped agent past the ttl); its lease
 * restarts when the last call ends. */
Test(session, a_call_in_flight_is_never_idle) {
  session_t *s = create("busy", 1, 0);
  hang_objects(s);
  session_t *call = session_acquire(table, s->id, s->token, &err); /* e.g. a Sync */
  cr_assert_not_null(call, "%s", err.msg);
  session_release(s); /* CreateSession's call ended */
  cr_assert_eq(atomic_load(&s->calls), 1);
  atomic_store(&s->last_used_ms, rpc_now_ms() - 60000); /* last activity long ago */
  cr_assert_eq(session_expire(table, rpc_now_ms() + 60000), 0, "expired with a call in flight");
  cr_assert_eq(session_count(table), 1);

  /* Another call finds it (session_acquire expires idle sessions too), ends,
   * and the first one is still in flight. */
  session_t *other = session_acquire(table, call->id, call->token, &err);
  cr_assert_eq(other, s, "%s", err.msg);
  session_release(other);
  atomic_store(&s->last_used_ms, rpc_now_ms() - 60000);
  cr_assert_eq(session_expire(table, rpc_now_ms()), 0, "expired while a call is still in flight");

  session_info_t *v;
  size_t n;
  cr_assert_eq(session_list(table, &v, &n), 0);
  cr_assert_eq(n, 1);
  cr_assert_eq(v[0].idle_ms, 0, "a session with a call in flight is not idle");
  free(v);

  int64_t end = rpc_now_ms();
  session_release(call); /* the last call ends: the lease starts again now */
  cr_assert_eq(atomic_load(&s->calls), 0);
  cr_assert_geq(atomic_load(&s->last_used_ms), end);
  cr_assert_eq(session_expire(table, end + 500), 0, "the lease restarts at the call's end");
  cr_assert_eq(session_expire(table, rpc_now_ms() + 1500), 1);
  cr_assert_eq(atomic_load(&closed_why[SESSION_END_EXPIRED]), 1);
  cr_assert_eq(atomic_load(&destroyed), 1);
  ASSERT_NO_BAD();
}

/* A call that goes on after its handler returned (a pending Sync, a Fetch's
 * thread) holds a session_ref: that is a call in flight too. */
Test(session, a_ref_taken_by_a_call_counts_as_in_flight) {
  session_t *s = create("sync", 1, 0);
  session_ref(s);     /* the pending Sync */
  session_release(s); /* its RPC handler returned */
  atomic_store(&s->last_used_ms, rpc_now_ms() - 60000);
  cr_assert_eq(session_expire(table, rpc_now_ms()), 0);
  session_release(s); /* answered */
  cr_assert_eq(session_expire(table, rpc_now_ms() + 1500), 1);
  ASSERT_NO_BAD();
}

/* The table's own thread, over more than twice the ttl. */
Test(session, the_table_thread_keeps_a_session_with_a_call_in_flight) {
  session_t *s = create("long call", 1, 0);
  char id[SESSION_ID_LEN + 1], token[SESSION_TOKEN_LEN + 1];
  strcpy(id, s->id);
  strcpy(token, s->token);
  usleep(2600 * 1000); /* the thread looked 5 times, s idle since 2.6 s > ttl */
  cr_assert_eq(session_count(table), 1, "the session expired under a call in flight");
  cr_assert_eq(atomic_load(&closed_calls), 0);
  session_t *again = session_acquire(table, id, token, &err);
  cr_assert_eq(again, s, "%s", err.msg);
  session_release(again);
  session_release(s);
  /* The close callback runs after the table let the session go. */
  int64_t end = rpc_now_ms() + 5000;
  while ((session_count(table) > 0 || atomic_load(&closed_why[SESSION_END_EXPIRED]) == 0) &&
         rpc_now_ms() < end)
    usleep(10000);
  cr_assert_eq(session_count(table), 0, "idle past its ttl after the last call, yet not expired");
  cr_assert_eq(atomic_load(&closed_why[SESSION_END_EXPIRED]), 1);
  ASSERT_NO_BAD();
}

Test(session, the_table_thread_expires_sessions) {
  session_t *s = create("c", 1, 0);
  session_release(s);
  atomic_store(&s->last_used_ms, rpc_now_ms() - 5000); /* still held by the table */
  /* The close callback runs after the table let the session go. */
  int64_t end = rpc_now_ms() + 3000;
  while ((session_count(table) > 0 || atomic_load(&closed_why[SESSION_END_EXPIRED]) == 0) &&
         rpc_now_ms() < end)
    usleep(10000);
  cr_assert_eq(session_count(table), 0);
  cr_assert_eq(atomic_load(&closed_why[SESSION_END_EXPIRED]), 1);
  ASSERT_NO_BAD();
}

Test(session, destroy_is_prompt_and_closes_the_rest) {
  session_t *s = create("a", 0, 0), *held = create("b", 0, 0);
  hang_objects(held);
  session_release(s);
  usleep(50000); /* let the thread sleep in its wait */
  int64_t t0 = rpc_now_ms();
  session_table_destroy(table);
  table = session_table_create(300, 0, NULL, NULL); /* for teardown */
  cr_assert_lt(rpc_now_ms() - t0, 200, "destroy waited for the expiry period");
  cr_assert_eq(atomic_load(&closed_why[SESSION_END_SHUTDOWN]), 2);
  cr_assert(atomic_load(&held->closed));
  cr_assert_eq(atomic_load(&destroyed), 0);
  session_release(held); /* outlives its table */
  cr_assert_eq(atomic_load(&destroyed), 1);
  ASSERT_NO_BAD();
}

Test(session, refs_strictly_increase) {
  session_t *s = create("c", 0, 0);
  cr_assert_eq(session_claim_ref(s, 0, &err), -1);
  cr_assert_eq(err.kind, ERR_BAD_ARGUMENT);
  cr_assert(strstr(err.msg, "ref 0 is not valid: refs start at 1"), "%s", err.msg);
  cr_assert(strstr(err.msg, "the next free ref is 1"), "%s", err.msg);
  cr_assert_eq(session_claim_ref(s, 1, &err), 0);
  cr_assert_eq(session_claim_ref(s, 7, &err), 0);
  cr_assert_eq(session_check_ref(s, 5, &err), -1);
  cr_assert_eq(session_claim_ref(s, 5, &err), -1);
  cr_assert_eq(err.kind, ERR_REF_REUSED);
  cr_assert_str_eq(err.msg,
                   "ref 5 was already used (or is lower than the last ref 7): refs must "
                   "strictly increase; the next free ref is 8");
  cr_assert_eq(session_claim_ref(s, 7, &err), -1);
  cr_assert_eq(session_check_ref(s, 8, &err), 0);
  cr_assert_eq(session_check_ref(s, 8, &err), 0, "check does not claim");
  cr_assert_eq(session_claim_ref(s, 8, &err), 0);
  cr_assert_eq(session_check_refs(s, (const uint64_t[]){9, 10, 12}, 3, &err), 0, "%s", err.msg);
  cr_assert_eq(session_check_refs(s, (const uint64_t[]){9, 12, 12}, 3, &err), -1);
  cr_assert_eq(err.kind, ERR_REF_REUSED);
  cr_assert(strstr(err.msg, "ref 12 comes after ref 12 in this command"), "%s", err.msg);
  cr_assert_eq(session_check_refs(s, (const uint64_t[]){10, 3}, 2, &err), -1);
  cr_assert(strstr(err.msg, "ref 3 was already used (or is lower than the last ref 8)"), "%s",
            err.msg);
  cr_assert_eq(session_check_refs(s, NULL, 0, &err), 0);
  cr_assert_eq(session_claim_ref(s, UINT64_MAX, &err), 0);
  cr_assert_eq(session_claim_ref(s, 9, &err), -1);
  cr_assert(strstr(err.msg, "every ref was used"), "%s", err.msg);
  session_release(s);
  ASSERT_NO_BAD();
}

Test(session, quota) {
  session_t *s = create("c", 0, 8 << 20);
  cr_assert_eq(session_charge(s, 6 << 20, "Factory zeros ref 3", &err), 0);
  cr_assert_eq(session_charge(s, 4 << 20, "Factory zeros ref 4", &err), -1);
  cr_assert_eq(err.kind, ERR_QUOTA);
  cr_assert(strstr(err.msg, "Factory zeros ref 4 needs 4.0 MiB but session "), "%s", err.msg);
  cr_assert(strstr(err.msg, "already holds 6.0 MiB of its 8.0 MiB quota"), "%s", err.msg);
  cr_assert_eq(atomic_load(&s->bytes_held), 6 << 20);
  cr_assert_eq(session_charge(s, 2 << 20, "x", &err), 0, "exactly the quota is fine");
  session_credit(s, 3 << 20);
  cr_assert_eq(atomic_load(&s->bytes_held), 5 << 20);
  session_credit(s, 100 << 20);
  cr_assert_eq(atomic_load(&s->bytes_held), 0);
  session_release(s);

  session_t *u = create("unlimited", 0, 0);
  cr_assert_eq(session_charge(u, UINT64_MAX - 1, "x", &err), 0);
  cr_assert_eq(session_charge(u, 2, "x", &err), -1, "overflow is refused");
  session_release(u);
  ASSERT_NO_BAD();
}

Test(session, list_snapshot) {
  session_t *a = create("first", 0, 0), *b = create("second", 10, 0);
  atomic_store(&b->bytes_held, 123);
  atomic_store(&b->live_tensors, 4);
  session_info_t *v;
  size_t n;
  cr_assert_eq(session_list(table, &v, &n), 0);
  cr_assert_eq(n, 2);
  cr_assert_str_eq(v[0].id, a->id);
  cr_assert_str_eq(v[0].client_name, "first");
  cr_assert_str_eq(v[1].client_name, "second");
  cr_assert_eq(v[1].bytes_held, 123);
  cr_assert_eq(v[1].live_tensors, 4);
  cr_assert_eq(v[1].ttl_s, 10);
  cr_assert_lt(v[1].idle_ms, 1000);
  free(v);
  session_close(table, a);
  session_close(table, b);
  cr_assert_eq(session_list(table, &v, &n), 0);
  cr_assert_eq(n, 0);
  cr_assert_null(v);
  session_release(a);
  session_release(b);
  ASSERT_NO_BAD();
}

/* ---------------------------------------------------------------- threads */

typedef struct hammer {
  char id[SESSION_ID_LEN + 1], token[SESSION_TOKEN_LEN + 1];
  atomic_bool stop;
  atomic_int ok, refused, after_close_ok;
  atomic_bool closed_seen;
} hammer_t;

static void *acquirer(void *arg) {
  hammer_t *h = arg;
  while (!atomic_load(&h->stop)) {
    bool was_closed = atomic_load(&h->closed_seen);
    meshd_error_t e;
    session_t *s = session_acquire(table, h->id, h->token, &e);
    if (s) {
      atomic_fetch_add(&h->ok, 1);
      if (was_closed) atomic_fetch_add(&h->after_close_ok, 1);
      session_touch(s);
      session_release(s);
    } else {
      CHECK(e.kind == ERR_NO_SESSION);
      atomic_fetch_add(&h->refused, 1);
    }
  }
  return NULL;
}

typedef struct closer_arg {
  session_t *s;
  atomic_int *wins;
} closer_arg_t;

static void *closer(void *arg) {
  closer_arg_t *c = arg;
  if (session_close(table, c->s)) atomic_fetch_add(c->wins, 1);
  return NULL;
}

Test(session, concurrent_acquire_and_close) {
  for (int round = 0; round < 20; round++) {
    session_t *s = create("hammered", 0, 0);
    hang_objects(s);
    hammer_t h = {0};
    strcpy(h.id, s->id);
    strcpy(h.token, s->token);
    pthread_t th[6], cl[2];
    for (int i = 0; i < 6; i++) pthread_create(&th[i], NULL, acquirer, &h);
    while (atomic_load(&h.ok) < 50) sched_yield();
    atomic_int wins = 0;
    closer_arg_t arg = {s, &wins};
    for (int i = 0; i < 2; i++) pthread_create(&cl[i], NULL, closer, &arg);
    for (int i = 0; i < 2; i++) pthread_join(cl[i], NULL);
    atomic_store(&h.closed_seen, true);
    int refused = atomic_load(&h.refused);
    while (atomic_load(&h.refused) < refused + 50) sched_yield();
    atomic_store(&h.stop, true);
    for (int i = 0; i < 6; i++) pthread_join(th[i], NULL);
    cr_assert_eq(atomic_load(&wins), 1, "round %d: %d closers won", round, atomic_load(&wins));
    cr_assert_eq(atomic_load(&h.after_close_ok), 0, "acquired after close returned");
    cr_assert_eq(atomic_load(&destroyed), round, "objects live while the creator holds s");
    session_release(s);
    cr_assert_eq(atomic_load(&destroyed), round + 1);
  }
  cr_assert_eq(atomic_load(&closed_calls), 20);
  ASSERT_NO_BAD();
}

static void *churn(void *arg) {
  (void)arg;
  for (int i = 0; i < 200; i++) {
    session_t *s;
    meshd_error_t e;
    if (session_create(table, "anonymous", "churn", 1, 0, &s, &e) != 0) {
      CHECK(!"session_create");
      continue;
    }
    hang_objects(s);
    session_t *a = session_acquire(table, s->id, s->token, &e);
    CHECK(a == s || e.kind == ERR_NO_SESSION); /* the expirer may have been first */
    if (a) {
      CHECK(session_claim_ref(a, (uint64_t)i + 1, &e) == 0);
      session_release(a);
    }
    if (i % 2) session_close(table, s);
    session_release(s);
  }
  return NULL;
}

static void *expirer(void *arg) {
  atomic_bool *stop = arg;
  while (!atomic_load(stop)) session_expire(table, rpc_now_ms() + 5000);
  return NULL;
}

Test(session, concurrent_create_close_expire) {
  pthread_t th[4], ex;
  atomic_bool stop = false;
  pthread_create(&ex, NULL, expirer, &stop);
  for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, churn, NULL);
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  atomic_store(&stop, true);
  pthread_join(ex, NULL);
  session_expire(table, rpc_now_ms() + 5000);
  cr_assert_eq(session_count(table), 0);
  cr_assert_eq(atomic_load(&closed_calls), 800, "one callback per session");
  cr_assert_eq(atomic_load(&destroyed), 800);
  ASSERT_NO_BAD();
}

typedef struct claim_race {
  session_t *s;
  atomic_int claimed[1001];
} claim_race_t;

static void *claimer(void *arg) {
  claim_race_t *c = arg;
  meshd_error_t e;
  for (uint64_t r = 1; r <= 1000; r++)
    if (session_claim_ref(c->s, r, &e) == 0) atomic_fetch_add(&c->claimed[r], 1);
  return NULL;
}

Test(session, concurrent_ref_claims_never_hand_out_a_ref_twice) {
  claim_race_t *c = calloc(1, sizeof *c);
  c->s = create("c", 0, 0);
  pthread_t th[8];
  for (int i = 0; i < 8; i++) pthread_create(&th[i], NULL, claimer, c);
  for (int i = 0; i < 8; i++) pthread_join(th[i], NULL);
  for (int r = 1; r <= 1000; r++) cr_assert_leq(atomic_load(&c->claimed[r]), 1, "ref %d", r);
  cr_assert_eq(atomic_load(&c->s->last_ref), 1000);
  session_release(c->s);
  free(c);
  ASSERT_NO_BAD();
}

/* ---------------------------------------------------------------- RPCs */

static rpc_server_t *srv;
static rpc_channel_t *ch;

static void start_rpc(void) {
  rpc_server_opts_t opts = {.listen = "127.0.0.1:0", .threads = 2};
  char e[256];
  srv = rpc_server_create(&opts, e, sizeof e);
  cr_assert_not_null(srv, "%s", e);
  size_t n;
  const rpc_method_t *m = session_service_methods(&n);
  cr_assert_eq(n, 4);
  cr_assert_eq(rpc_server_add_methods(srv, m, n, table), 0);
  int port = rpc_server_start(srv, e, sizeof e);
  cr_assert_gt(port, 0, "%s", e);
  char target[64];
  snprintf(target, sizeof target, "127.0.0.1:%d", port);
  ch = rpc_channel_create(target, &live_peer);
}

static void stop_rpc(void) {
  rpc_channel_destroy(ch);
  rpc_server_shutdown(srv, 0);
  rpc_server_destroy(srv);
}

static grpc_status_code call(const char *method, const ProtobufCMessage *req,
                             const ProtobufCMessageDescriptor *desc, ProtobufCMessage **resp,
                             const char *id, const char *token, rpc_status_t *st) {
  rpc_md_t md[2];
  size_t nmd = 0;
  if (id) md[nmd++] = (rpc_md_t){SESSION_MD_ID, id};
  if (token) md[nmd++] = (rpc_md_t){SESSION_MD_TOKEN, token};
  char path[96];
  snprintf(path, sizeof path, "/meshd.v1.TensorService/%s", method);
  ProtobufCMessage *r = NULL;
  grpc_status_code code = rpc_unary(ch, path, req, desc, &r, md, nmd, 5000, st);
  if (resp)
    *resp = r;
  else if (r)
    protobuf_c_message_free_unpacked(r, NULL);
  return code;
}

static Meshd__V1__CreateSessionReply *create_rpc(const char *name, uint64_t ttl, rpc_status_t *st,
                                                 grpc_status_code *code) {
  Meshd__V1__CreateSessionRequest req = MESHD__V1__CREATE_SESSION_REQUEST__INIT;
  req.client_name = (char *)name;
  req.ttl_seconds = ttl;
  ProtobufCMessage *r;
  *code = call("CreateSession", &req.base, &meshd__v1__create_session_reply__descriptor, &r, NULL,
               NULL, st);
  return (Meshd__V1__CreateSessionReply *)r;
}

static grpc_status_code keep_alive(const char *id, const char *token, uint64_t *ttl,
                                   rpc_status_t *st) {
  Meshd__V1__KeepAliveRequest req = MESHD__V1__KEEP_ALIVE_REQUEST__INIT;
  ProtobufCMessage *r;
  grpc_status_code code =
      call("KeepAlive", &req.base, &meshd__v1__keep_alive_reply__descriptor, &r, id, token, st);
  if (r) {
    if (ttl) *ttl = ((Meshd__V1__KeepAliveReply *)r)->ttl_seconds;
    protobuf_c_message_free_unpacked(r, NULL);
  }
  return code;
}

static void expect_status(grpc_status_code code, const rpc_status_t *st, grpc_status_code want,
                          const char *kind, const char *needle) {
  cr_assert_eq(code, want, "code %d, want %d: %s", code, want, st->message);
  cr_assert_str_eq(st->kind, kind);
  cr_assert(strstr(st->message, needle), "message '%s' lacks '%s'", st->message, needle);
}

Test(session, rpc_lifecycle) {
  start_rpc();
  rpc_status_t st;
  grpc_status_code code;
  Meshd__V1__CreateSessionReply *rep = create_rpc("notebook", 0, &st, &code);
  cr_assert_eq(code, GRPC_STATUS_OK, "%s", st.message);
  cr_assert(all_hex(rep->session_id, SESSION_ID_LEN));
  cr_assert(all_hex(rep->token, SESSION_TOKEN_LEN));
  cr_assert_eq(rep->ttl_seconds, 300);

  uint64_t ttl = 0;
  cr_assert_eq(keep_alive(rep->session_id, rep->token, &ttl, &st), GRPC_STATUS_OK, "%s",
               st.message);
  cr_assert_eq(ttl, 300);

  code = keep_alive(NULL, NULL, NULL, &st);
  expect_status(code, &st, GRPC_STATUS_UNAUTHENTICATED, "NO_SESSION",
                "KeepAlive needs the metadata meshd-session and meshd-token: call CreateSession");
  code = keep_alive(rep->session_id, NULL, NULL, &st);
  expect_status(code, &st, GRPC_STATUS_UNAUTHENTICATED, "NO_SESSION",
                "KeepAlive needs the metadata meshd-token:");
  code = keep_alive(rep->session_id, "00", NULL, &st);
  expect_status(code, &st, GRPC_STATUS_UNAUTHENTICATED, "NO_SESSION",
                "KeepAlive: wrong token for session");

  Meshd__V1__ListSessionsRequest lreq = MESHD__V1__LIST_SESSIONS_REQUEST__INIT;
  ProtobufCMessage *lr;
  cr_assert_eq(call("ListSessions", &lreq.base, &meshd__v1__list_sessions_reply__descriptor, &lr,
                    NULL, NULL, &st),
               GRPC_STATUS_OK, "%s", st.message);
  Meshd__V1__ListSessionsReply *list = (Meshd__V1__ListSessionsReply *)lr;
  cr_assert_eq(list->n_sessions, 1);
  cr_assert_str_eq(list->sessions[0]->session_id, rep->session_id);
  cr_assert_str_eq(list->sessions[0]->client_name, "notebook");
  protobuf_c_message_free_unpacked(lr, NULL);

  Meshd__V1__CloseSessionRequest creq = MESHD__V1__CLOSE_SESSION_REQUEST__INIT;
  cr_assert_eq(call("CloseSession", &creq.base, &meshd__v1__close_session_reply__descriptor, NULL,
                    rep->session_id, rep->token, &st),
               GRPC_STATUS_OK, "%s", st.message);
  cr_assert_eq(atomic_load(&closed_why[SESSION_END_CLOSED]), 1);
  code = call("CloseSession", &creq.base, &meshd__v1__close_session_reply__descriptor, NULL,
              rep->session_id, rep->token, &st);
  expect_status(code, &st, GRPC_STATUS_UNAUTHENTICATED, "NO_SESSION", "CloseSession: no session '");
  code = keep_alive(rep->session_id, rep->token, NULL, &st);
  expect_status(code, &st, GRPC_STATUS_UNAUTHENTICATED, "NO_SESSION",
                "it was closed, expired (idle past its ttl: 300 s unless CreateSession asked "
                "for another), or never existed");
  protobuf_c_message_free_unpacked(&rep->base, NULL);
  stop_rpc();
  ASSERT_NO_BAD();
}

Test(session, rpc_create_validates) {
  start_rpc();
  rpc_status_t st;
  grpc_status_code code;
  Meshd__V1__CreateSessionReply *rep = create_rpc("x", SESSION_TTL_MAX_S + 1, &st, &code);
  cr_assert_null(rep);
  expect_status(code, &st, GRPC_STATUS_INVALID_ARGUMENT, "BAD_ARGUMENT",
                "CreateSession: ttl_seconds 604801 is too long; use 1..604800 (7 days), or 0 for "
                "the server's default of 300");
  rep = create_rpc("x", SESSION_TTL_MAX_S, &st, &code);
  cr_assert_eq(code, GRPC_STATUS_OK, "%s", st.message);
  cr_assert_eq(rep->ttl_seconds, SESSION_TTL_MAX_S);
  protobuf_c_message_free_unpacked(&rep->base, NULL);

  char name[SESSION_CLIENT_NAME_MAX + 2];
  memset(name, 'n', sizeof name - 1);
  name[sizeof name - 1] = '\0';
  rep = create_rpc(name, 0, &st, &code);
  expect_status(code, &st, GRPC_STATUS_INVALID_ARGUMENT, "BAD_ARGUMENT",
                "client_name is 129 bytes; at most 128 are allowed");
  name[SESSION_CLIENT_NAME_MAX] = '\0';
  rep = create_rpc(name, 0, &st, &code);
  cr_assert_eq(code, GRPC_STATUS_OK, "%s", st.message);
  protobuf_c_message_free_unpacked(&rep->base, NULL);

  rep = create_rpc("bad\nname", 0, &st, &code);
  expect_status(code, &st, GRPC_STATUS_INVALID_ARGUMENT, "BAD_ARGUMENT",
                "control character (0x0a) at byte 3");

  session_table_set_accepting(table, false);
  rep = create_rpc("late", 0, &st, &code);
  expect_status(code, &st, GRPC_STATUS_UNAVAILABLE, "UNAVAILABLE", "shutting down");
  cr_assert_eq(session_count(table), 2);
  stop_rpc();
  ASSERT_NO_BAD();
}

static Meshd__V1__CreateSessionReply *create_quota_rpc(uint64_t quota, rpc_status_t *st,
                                                       grpc_status_code *code) {
  Meshd__V1__CreateSessionRequest req = MESHD__V1__CREATE_SESSION_REQUEST__INIT;
  req.client_name = "q";
  req.quota_bytes = quota;
  ProtobufCMessage *r;
  *code = call("CreateSession", &req.base, &meshd__v1__create_session_reply__descriptor, &r, NULL,
               NULL, st);
  return (Meshd__V1__CreateSessionReply *)r;
}

static uint64_t quota_of(const Meshd__V1__CreateSessionReply *rep) {
  session_t *s = session_find(table, rep->session_id);
  cr_assert_not_null(s);
  uint64_t q = s->quota_bytes;
  session_release(s);
  return q;
}

/* --session-quota-bytes is the default and the cap: a session may not ask
 * for more (issue 13: it could choose its own, above the flag). */
Test(session, rpc_create_refuses_a_quota_above_the_servers) {
  session_table_destroy(table);
  table = session_table_create(300, 1000, on_closed, &closed_calls);
  cr_assert_eq(session_table_default_quota(table), 1000);
  start_rpc();
  rpc_status_t st;
  grpc_status_code code;
  Meshd__V1__CreateSessionReply *rep = create_quota_rpc(1001, &st, &code);
  cr_assert_null(rep);
  expect_status(code, &st, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA",
                "CreateSession: quota_bytes 1001 is more than the 1000 bytes a session may hold on "
                "this server (--session-quota-bytes); ask for at most 1000, or 0 for that much");
  cr_assert_eq(session_count(table), 0);
  rep = create_quota_rpc(UINT64_MAX, &st, &code);
  expect_status(code, &st, GRPC_STATUS_RESOURCE_EXHAUSTED, "QUOTA", "quota_bytes 18446744073709551615");
  rep = create_quota_rpc(1000, &st, &code);
  cr_assert_eq(code, GRPC_STATUS_OK, "%s", st.message);
  cr_assert_eq(quota_of(rep), 1000);
  protobuf_c_message_free_unpacked(&rep->base, NULL);
  rep = create_quota_rpc(10, &st, &code);
  cr_assert_eq(code, GRPC_STATUS_OK, "%s", st.message);
  cr_assert_eq(quota_of(rep), 10, "less than the cap is fine");
  protobuf_c_message_free_unpacked(&rep->base, NULL);
  rep = create_quota_rpc(0, &st, &code);
  cr_assert_eq(code, GRPC_STATUS_OK, "%s", st.message);
  cr_assert_eq(quota_of(rep), 1000, "0 takes the server's");
  protobuf_c_message_free_unpacked(&rep->base, NULL);
  stop_rpc();
  ASSERT_NO_BAD();
}

Test(session, rpc_create_takes_any_quota_without_a_cap) {
  start_rpc();
  rpc_status_t st;
  grpc_status_code code;
  Meshd__V1__CreateSessionReply *rep = create_quota_rpc(UINT64_MAX, &st, &code);
  cr_assert_eq(code, GRPC_STATUS_OK, "%s", st.message);
  cr_assert_eq(quota_of(rep), UINT64_MAX);
  protobuf_c_message_free_unpacked(&rep->base, NULL);
  stop_rpc();
  ASSERT_NO_BAD();
}

Test(session, limits_are_copied_into_each_new_session) {
  session_t *before = create("before", 0, 0);
  cr_assert_eq(before->limits.max_refs, 0, "no limits by default");
  session_table_set_limits(table, &(session_limits_t){.max_refs = 5, .max_meshes = 6,
                                                      .max_streams = 7, .max_command_refs = 8});
  session_t *s = create("after", 0, 0);
  cr_assert_eq(s->limits.max_refs, 5);
  cr_assert_eq(s->limits.max_meshes, 6);
  cr_assert_eq(s->limits.max_streams, 7);
  cr_assert_eq(s->limits.max_command_refs, 8);
  cr_assert_eq(before->limits.max_refs, 0, "a session keeps the limits it was made with");
  session_table_set_limits(table, NULL);
  session_t *again = create("again", 0, 0);
  cr_assert_eq(again->limits.max_streams, 0);
  session_release(before);
  session_release(s);
  session_release(again);
}
