/* core/platform/grant.c: transfer grants and write receipts (the direct data
 * path): what one key signs, another key, a flipped bit or a cut never passes.
 * And the agent's table of the grants' nonces (agent/transfer_grant.c), on a
 * synthetic clock. */
#include <criterion/criterion.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "agent.h"
#include "grant.h"
#include "secret.h"

static const char *KEY = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
static const char *OTHER = "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100";

static uint8_t *issue(size_t *len) {
  static uint8_t nonce[GRANT_NONCE_LEN] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  Meshd__Agent__V1__TransferGrant g = MESHD__AGENT__V1__TRANSFER_GRANT__INIT;
  g.session_id = "abc";
  g.ref = 42;
  g.rank = 3;
  g.direction = GRANT_READ;
  g.expiry_unix_ms = 1234567890123;
  g.nonce.data = nonce;
  g.nonce.len = sizeof nonce;
  g.after_seq = 77;
  uint8_t *buf = NULL;
  cr_assert_eq(grant_issue(KEY, &g, &buf, len), 0);
  return buf;
}

Test(grant, round_trip) {
  size_t len;
  uint8_t *buf = issue(&len);
  Meshd__Agent__V1__TransferGrant *g = NULL;
  cr_assert_eq(grant_open(KEY, buf, len, &g), 0);
  cr_assert_str_eq(g->session_id, "abc");
  cr_assert_eq(g->ref, 42);
  cr_assert_eq(g->rank, 3);
  cr_assert_eq(g->direction, GRANT_READ);
  cr_assert_eq(g->expiry_unix_ms, 1234567890123);
  cr_assert_eq(g->after_seq, 77);
  cr_assert_eq(g->nonce.len, GRANT_NONCE_LEN);
  protobuf_c_message_free_unpacked(&g->base, NULL);
  free(buf);
}

Test(grant, every_flipped_bit_and_another_key_are_refused) {
  size_t len;
  uint8_t *buf = issue(&len);
  Meshd__Agent__V1__TransferGrant *g = NULL;
  cr_assert_eq(grant_open(OTHER, buf, len, &g), -1);
  cr_assert_null(g);
  for (size_t i = 0; i < len; i++)
    for (int b = 0; b < 8; b++) {
      buf[i] ^= (uint8_t)(1u << b);
      cr_assert_eq(grant_open(KEY, buf, len, &g), -1, "byte %zu bit %d", i, b);
      buf[i] ^= (uint8_t)(1u << b);
    }
  cr_assert_eq(grant_open(KEY, buf, len - 1, &g), -1); /* cut */
  cr_assert_eq(grant_open(KEY, buf, GRANT_MAC_LEN, &g), -2); /* no body */
  cr_assert_eq(grant_open(KEY, buf, 0, &g), -2);
  free(buf);
}

typedef int (*receipt_fn)(const char *, const uint8_t *, size_t, uint64_t, uint32_t, uint64_t,
                          uint8_t *);
typedef bool (*receipt_ok_fn)(const char *, const uint8_t *, size_t, uint64_t, uint32_t,
                              uint64_t, const uint8_t *, size_t);

/* A receipt made by `make` over (nonce, ref 5, rank 1, n) passes `ok` with
 * exactly those values and the same key, whole: any other key, ref, rank, n,
 * nonce or length fails. Leaves the receipt in mac. */
static void receipt_binds(receipt_fn make, receipt_ok_fn ok, uint64_t n,
                          uint8_t mac[GRANT_MAC_LEN]) {
  uint8_t nonce[GRANT_NONCE_LEN] = {9};
  cr_assert_eq(make(KEY, nonce, sizeof nonce, 5, 1, n, mac), 0);
  cr_assert(ok(KEY, nonce, sizeof nonce, 5, 1, n, mac, GRANT_MAC_LEN));
  cr_assert_not(ok(OTHER, nonce, sizeof nonce, 5, 1, n, mac, GRANT_MAC_LEN));
  cr_assert_not(ok(KEY, nonce, sizeof nonce, 6, 1, n, mac, GRANT_MAC_LEN));
  cr_assert_not(ok(KEY, nonce, sizeof nonce, 5, 2, n, mac, GRANT_MAC_LEN));
  cr_assert_not(ok(KEY, nonce, sizeof nonce, 5, 1, n - 1, mac, GRANT_MAC_LEN));
  cr_assert_not(ok(KEY, nonce, sizeof nonce, 5, 1, n + 1, mac, GRANT_MAC_LEN));
  cr_assert_not(ok(KEY, nonce, sizeof nonce, 5, 1, n, mac, GRANT_MAC_LEN - 1));
  cr_assert_not(ok(KEY, nonce, sizeof nonce, 5, 1, n, mac, 0));
  nonce[3] = 1;
  cr_assert_not(ok(KEY, nonce, sizeof nonce, 5, 1, n, mac, GRANT_MAC_LEN));
}

Test(grant, receipts_bind_nonce_ref_rank_and_bytes) {
  uint8_t mac[GRANT_MAC_LEN];
  receipt_binds(grant_receipt, grant_receipt_ok, 4096, mac);
}

/* A Read's receipt (its Read took the snapshot: FinishFetch sends no
 * DropSnapshot) binds the same and after_seq, and neither kind of receipt
 * passes for the other over the same values. */
Test(grant, read_receipts_bind_nonce_ref_rank_and_after_seq_and_are_no_write_receipts) {
  uint8_t nonce[GRANT_NONCE_LEN] = {9}, mac[GRANT_MAC_LEN], wmac[GRANT_MAC_LEN];
  receipt_binds(grant_read_receipt, grant_read_receipt_ok, 77, mac);
  cr_assert_not(grant_receipt_ok(KEY, nonce, sizeof nonce, 5, 1, 77, mac, sizeof mac));
  cr_assert_eq(grant_receipt(KEY, nonce, sizeof nonce, 5, 1, 77, wmac), 0);
  cr_assert_not(grant_read_receipt_ok(KEY, nonce, sizeof nonce, 5, 1, 77, wmac, sizeof wmac));
}

/* A write receipt as RFC 2104 has it, by OpenSSL's one-shot HMAC() (what
 * grant.c called for every MAC before it kept each secret's key states). */
static void receipt_by_hmac(const char *secret, uint64_t ref, uint8_t out[GRANT_MAC_LEN]) {
  uint8_t msg[sizeof RECEIPT_LABEL - 1 + GRANT_NONCE_LEN + 20] = {0}, *p = msg;
  memcpy(p, RECEIPT_LABEL, sizeof RECEIPT_LABEL - 1);
  p += sizeof RECEIPT_LABEL - 1;
  memset(p, 7, GRANT_NONCE_LEN); /* the nonce */
  p += GRANT_NONCE_LEN;
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(ref >> (8 * i)); /* ref; rank 2, bytes 9: */
  p[8] = 2;
  p[12] = 9;
  unsigned int n = 0;
  cr_assert_not_null(HMAC(EVP_sha256(), secret, (int)strlen(secret), msg, sizeof msg, out, &n));
  cr_assert_eq(n, GRANT_MAC_LEN);
}

#define MANY_SECRETS 200 /* over grant.c's 64 slots: each is taken by others between uses */
static char many[MANY_SECRETS][300];
static uint8_t many_mac[MANY_SECRETS][GRANT_MAC_LEN];

/* Secrets of a server's agents (64 hex characters) and, every tenth, of any
 * length up to 299 (longer than a SHA-256 block: RFC 2104 hashes those first;
 * longer than grant.c keeps: keyed each time), each with its receipt by HMAC(). */
static void many_secrets(void) {
  for (int i = 0; i < MANY_SECRETS; i++) {
    size_t len = i % 10 ? SECRET_HEX_LEN : (size_t)(1 + i * 3 % 299);
    for (size_t k = 0; k < len; k++) many[i][k] = "0123456789abcdef"[(i * 7 + k * 13 + k / 3) % 16];
    snprintf(many[i], 5, "%04x", i); /* distinct */
    many[i][4] = 'k';
    many[i][len] = '\0';
    receipt_by_hmac(many[i], (uint64_t)i, many_mac[i]);
  }
}

/* Whether secret i's receipt is its HMAC, and passes with i's secret only
 * (no Criterion assert: threads call it too). */
static bool receipt_is_hmacs(int i) {
  uint8_t mac[GRANT_MAC_LEN], nonce[GRANT_NONCE_LEN];
  memset(nonce, 7, sizeof nonce);
  return grant_receipt(many[i], nonce, sizeof nonce, (uint64_t)i, 2, 9, mac) == 0 &&
         memcmp(mac, many_mac[i], GRANT_MAC_LEN) == 0 &&
         grant_receipt_ok(many[i], nonce, sizeof nonce, (uint64_t)i, 2, 9, mac, sizeof mac) &&
         !grant_receipt_ok(many[(i + 1) % MANY_SECRETS], nonce, sizeof nonce, (uint64_t)i, 2, 9,
                           mac, sizeof mac);
}

/* Each secret's key states are kept (grant.c: a MAC no longer keys HMAC anew):
 * every MAC is still HMAC-SHA256 of its own secret, whatever secrets went
 * before it in the table (slots shared, taken over, taken back), of any length. */
Test(grant, every_mac_is_its_own_secrets_hmac_as_the_kept_keys_turn_over) {
  many_secrets();
  for (int round = 0; round < 3; round++)
    for (int k = 0; k < MANY_SECRETS; k++) {
      int i = round == 1 ? MANY_SECRETS - 1 - k : k;
      cr_assert(receipt_is_hmacs(i), "round %d, secret %d (%zu bytes)", round, i, strlen(many[i]));
    }
}

static void *macs_of_one_thread(void *arg) {
  int t = (int)(intptr_t)arg;
  intptr_t wrong = 0;
  for (int k = 0; k < 1000; k++) wrong += !receipt_is_hmacs((t * 31 + k * 17) % MANY_SECRETS);
  return (void *)wrong;
}

/* The kept keys are shared by the server's threads (plans, FinishUploads):
 * four at once, over secrets that take each other's slots, each get their
 * own secret's MAC. */
Test(grant, threads_at_once_each_get_their_own_secrets_mac) {
  many_secrets();
  pthread_t th[4];
  for (int t = 0; t < 4; t++)
    cr_assert_eq(pthread_create(&th[t], NULL, macs_of_one_thread, (void *)(intptr_t)t), 0);
  for (int t = 0; t < 4; t++) {
    void *wrong = NULL;
    pthread_join(th[t], &wrong);
    cr_assert_eq((intptr_t)wrong, 0, "thread %d: %ld of its 1000 MACs were not its secret's", t,
                 (long)(intptr_t)wrong);
  }
}

/* Nonces and ids come from the kernel (grant_random): every byte asked for
 * is filled, past getrandom's 256 bytes per call too. */
Test(grant, grant_random_fills_every_byte) {
  uint8_t a[1000], b[1000];
  memset(a, 0, sizeof a);
  memset(b, 0, sizeof b);
  cr_assert_eq(grant_random(a, sizeof a), 0);
  cr_assert_eq(grant_random(b, sizeof b), 0);
  cr_assert(memcmp(a, b, sizeof a) != 0);
  size_t zero_tail = 0; /* 1000 random bytes end in 16 zeros once in 2^128 */
  for (size_t i = sizeof a - 16; i < sizeof a; i++) zero_tail += a[i] == 0;
  cr_assert_lt(zero_tail, 16);
}

/* ------------------------------------------------------------ nonce table */

#define T0 1700000000000LL

static const uint8_t *nonce_of(int i) {
  static uint8_t n[GRANT_NONCE_LEN];
  memset(n, 0, sizeof n);
  memcpy(n, &i, sizeof i);
  n[15] = 0xa5;
  return n;
}

/* A table of max nonces (0: TRANSFER_NONCES), per_session of them one
 * session's at most (0: the default share; max: no share). */
static void table(size_t max, size_t per_session) {
  transfer_nonces_clear();
  transfer_grant_set_max_nonces(max);
  transfer_grant_set_max_nonces_per_session(per_session);
}

static void table_reset(void) { table(0, 0); }

/* A transfer refused QUOTA after its grant's start-by time (a Write that
 * waited for its session to open) gives its nonce back while the table is
 * full: it is kept, and the client's retry is admitted. It was dropped, and
 * the retry refused "expired: did not start by its start-by time". */
Test(nonce_table, a_nonce_given_back_into_a_full_table_is_kept, .fini = table_reset) {
  table(2, 2);
  cr_assert_eq(transfer_nonce_take(nonce_of(1), "s", T0 + 100, T0), NONCE_TAKEN);
  cr_assert_eq(transfer_nonce_take(nonce_of(2), "s", T0 + 1000, T0), NONCE_TAKEN);
  /* Past 1's start-by time: forgotten, and its place taken. */
  cr_assert_eq(transfer_nonce_take(nonce_of(3), "s", T0 + 1000, T0 + 150), NONCE_TAKEN);
  cr_assert_eq(transfer_nonce_take(nonce_of(4), "s", T0 + 1000, T0 + 150), NONCE_TABLE_FULL);
  transfer_nonce_give_back(nonce_of(1), "s", T0 + 10000, T0 + 160);
  cr_assert_eq(transfer_nonce_take(nonce_of(1), "s", T0 + 100, T0 + 200), NONCE_TAKEN,
               "the retry of a grant given back into a full table was refused");
  cr_assert_eq(transfer_nonce_take(nonce_of(1), "s", T0 + 100, T0 + 210), NONCE_TAKEN_BEFORE);
  /* Given back again, kept until the grant's expiry, then forgotten. */
  transfer_nonce_give_back(nonce_of(1), "s", T0 + 10000, T0 + 220);
  cr_assert_eq(transfer_nonce_take(nonce_of(1), "s", T0 + 100, T0 + 230), NONCE_TAKEN);
  cr_assert_eq(transfer_nonce_take(nonce_of(5), "s", T0 + 20000, T0 + 10001), NONCE_TAKEN);
  cr_assert_eq(transfer_nonce_take(nonce_of(1), "s", T0 + 100, T0 + 10002), NONCE_LATE);
}

/* A grant revoked by its server (RevokeGrants, at a tokens reload) is refused
 * whatever its state: never seen, taken and given back for a retry, and in a
 * full table; and the revocation outlives the nonce's start-by time, until
 * the time the server gave. */
Test(nonce_table, a_revoked_nonce_is_never_taken_again, .fini = table_reset) {
  table(2, 2);
  cr_assert_eq(transfer_nonce_take(nonce_of(1), "s", T0 + 100, T0), NONCE_TAKEN);
  transfer_nonce_give_back(nonce_of(1), "s", T0 + 10000, T0 + 10); /* a QUOTA refusal */
  cr_assert_eq(transfer_nonce_take(nonce_of(2), "s", T0 + 1000, T0 + 20), NONCE_TAKEN);
  /* The table is full: revoked anyway, the unseen 3 as well. */
  transfer_nonce_revoke(nonce_of(1), "s", T0 + 20000, T0 + 30);
  transfer_nonce_revoke(nonce_of(3), "s", T0 + 20000, T0 + 30);
  cr_assert_eq(transfer_nonce_take(nonce_of(1), "s", T0 + 100, T0 + 40), NONCE_REVOKED,
               "a grant given back for a retry was taken again after its revocation");
  cr_assert_eq(transfer_nonce_take(nonce_of(3), "s", T0 + 1000, T0 + 40), NONCE_REVOKED,
               "a grant never presented was taken after its revocation");
  transfer_nonce_give_back(nonce_of(1), "s", T0 + 10000, T0 + 50); /* no give-back undoes it */
  cr_assert_eq(transfer_nonce_take(nonce_of(1), "s", T0 + 100, T0 + 60), NONCE_REVOKED);
  /* Past its start-by time (1000) and its first forget time: still revoked. */
  cr_assert_eq(transfer_nonce_take(nonce_of(3), "s", T0 + 30000, T0 + 15000), NONCE_REVOKED);
  /* Forgotten at the time the server gave. */
  cr_assert_eq(transfer_nonce_take(nonce_of(3), "s", T0 + 30000, T0 + 20001), NONCE_TAKEN);
}

/* An older server's grant (start-by 0: its expiry, 10 min) taken first does
 * not hold the newer grants taken after it, whose start-by times pass long
 * before: they are forgotten then, and the table has room. It was full until
 * the old grant's expiry (the table was swept from its head, in the order
 * taken). */
Test(nonce_table, a_long_lived_nonce_does_not_hold_shorter_ones_behind_it, .fini = table_reset) {
  table(3, 3);
  cr_assert_eq(transfer_nonce_take(nonce_of(1), "s", T0 + 600000, T0), NONCE_TAKEN);
  cr_assert_eq(transfer_nonce_take(nonce_of(2), "s", T0 + 100, T0), NONCE_TAKEN);
  cr_assert_eq(transfer_nonce_take(nonce_of(3), "s", T0 + 200, T0), NONCE_TAKEN);
  cr_assert_eq(transfer_nonce_take(nonce_of(4), "s", T0 + 300, T0 + 50), NONCE_TABLE_FULL);
  for (int i = 4; i < 40; i++) /* each taken once the one before it is forgotten */
    cr_assert_eq(transfer_nonce_take(nonce_of(i), "s", T0 + 300 + 100 * i, T0 + 201 + 100 * i),
                 NONCE_TAKEN, "nonce %d: the table stayed full behind the long-lived one", i);
  /* The long-lived one is still remembered; the short ones past theirs are late. */
  cr_assert_eq(transfer_nonce_take(nonce_of(1), "s", T0 + 600000, T0 + 5000), NONCE_TAKEN_BEFORE);
  cr_assert_eq(transfer_nonce_take(nonce_of(2), "s", T0 + 100, T0 + 5000), NONCE_LATE);
}

/* One session taking grants as fast as it can holds at most its share
 * (--max-transfer-nonces-per-session) of the table: another session's
 * grants are still taken. Before, the first filled the whole table and every
 * other session's direct transfers were refused. */
Test(nonce_table, one_session_cannot_fill_the_table_for_another, .fini = table_reset) {
  table(8, 3);
  for (int i = 0; i < 3; i++)
    cr_assert_eq(transfer_nonce_take(nonce_of(i), "flood", T0 + 1000, T0), NONCE_TAKEN);
  for (int i = 3; i < 10; i++)
    cr_assert_eq(transfer_nonce_take(nonce_of(i), "flood", T0 + 1000, T0), NONCE_SESSION_FULL,
                 "nonce %d: a session took more than its share", i);
  for (int i = 10; i < 13; i++)
    cr_assert_eq(transfer_nonce_take(nonce_of(i), "other", T0 + 1000, T0), NONCE_TAKEN,
                 "nonce %d: refused to another session", i);
  /* Its share is free again as its nonces are forgotten. */
  cr_assert_eq(transfer_nonce_take(nonce_of(20), "flood", T0 + 3000, T0 + 1000), NONCE_TAKEN);
  /* The table's bound still holds over all sessions. */
  table(4, 3);
  for (int i = 0; i < 3; i++)
    cr_assert_eq(transfer_nonce_take(nonce_of(i), "a", T0 + 1000, T0), NONCE_TAKEN);
  cr_assert_eq(transfer_nonce_take(nonce_of(3), "b", T0 + 1000, T0), NONCE_TAKEN);
  cr_assert_eq(transfer_nonce_take(nonce_of(4), "c", T0 + 1000, T0), NONCE_TABLE_FULL);
}

/* Unset, a session's share is a quarter of the table whatever its size. It was
 * 16384, a quarter of the default table: with --max-transfer-nonces 16384 or
 * fewer there was no share, and one session filled the table for every other
 * again. Set, the share is taken as given, at most the whole table. */
Test(nonce_table, the_default_share_is_a_quarter_of_any_table, .fini = table_reset) {
  table(16, 0);
  for (int i = 0; i < 4; i++)
    cr_assert_eq(transfer_nonce_take(nonce_of(i), "flood", T0 + 1000, T0), NONCE_TAKEN);
  cr_assert_eq(transfer_nonce_take(nonce_of(4), "flood", T0 + 1000, T0), NONCE_SESSION_FULL,
               "a session took more than a quarter of a table of 16");
  cr_assert_eq(transfer_nonce_take(nonce_of(5), "other", T0 + 1000, T0), NONCE_TAKEN);
  table(3, 0); /* a quarter of a tiny table is still one */
  cr_assert_eq(transfer_nonce_take(nonce_of(0), "flood", T0 + 1000, T0), NONCE_TAKEN);
  cr_assert_eq(transfer_nonce_take(nonce_of(1), "flood", T0 + 1000, T0), NONCE_SESSION_FULL);
  table(16, 10); /* set: as given */
  for (int i = 0; i < 10; i++)
    cr_assert_eq(transfer_nonce_take(nonce_of(i), "flood", T0 + 1000, T0), NONCE_TAKEN);
  cr_assert_eq(transfer_nonce_take(nonce_of(10), "flood", T0 + 1000, T0), NONCE_SESSION_FULL);
  table(16, 1000); /* set above the table: the whole table */
  for (int i = 0; i < 16; i++)
    cr_assert_eq(transfer_nonce_take(nonce_of(i), "flood", T0 + 1000, T0), NONCE_TAKEN);
  cr_assert_eq(transfer_nonce_take(nonce_of(16), "flood", T0 + 1000, T0), NONCE_TABLE_FULL);
}

/* Nonces of mixed lifetimes, some given back (kept until a later expiry,
 * free to take once), each remembered exactly until its own time, whatever
 * the order taken. */
Test(nonce_table, every_nonce_is_forgotten_at_its_own_time, .fini = table_reset) {
  enum { N = 600 };
  static int64_t until[N];
  static bool free_once[N];
  table(N, N);
  uint32_t r = 12345;
  for (int i = 0; i < N; i++) {
    r = r * 1103515245u + 12345u;
    until[i] = T0 + 1 + (r >> 8) % 2000;
    cr_assert_eq(transfer_nonce_take(nonce_of(i), "s", until[i], T0), NONCE_TAKEN);
  }
  for (int i = 0; i < N; i += 5) {
    until[i] = T0 + 3000 + i;
    free_once[i] = true;
    transfer_nonce_give_back(nonce_of(i), "s", until[i], T0);
  }
  for (int64_t now = T0; now < T0 + 4000; now += 3) {
    r = r * 1103515245u + 12345u;
    int i = (int)((r >> 8) % N);
    int got = transfer_nonce_take(nonce_of(i), "s", until[i], now);
    int want = now >= until[i] ? NONCE_LATE : free_once[i] ? NONCE_TAKEN : NONCE_TAKEN_BEFORE;
    cr_assert_eq(got, want, "nonce %d at +%lld (until +%lld): %d, not %d", i,
                 (long long)(now - T0), (long long)(until[i] - T0), got, want);
    if (got == NONCE_TAKEN) free_once[i] = false;
  }
}

/* ---- clocks (grant.h, Clocks): a grant's times in its agent's clock ---- */

/* A Hello the agent stamps by its clock (real + skew) at real time `at`, whose
 * reply takes back_ms to come back: the offset the server measures. */
static int64_t measured(int64_t skew, int64_t at, int64_t back_ms) {
  return grant_clock_offset(at + skew, at + back_ms);
}

Test(clock, a_grant_is_good_on_an_agent_hours_off_and_never_lives_past_its_time) {
  const int64_t t0 = 1800000000000, grant_ms = 600000, start_ms = 60000, back = 7;
  const int64_t skews[] = {-7200000, -120000, -61000, 0, 61000, 120000, 7200000};
  for (size_t i = 0; i < sizeof skews / sizeof *skews; i++) {
    int64_t skew = skews[i], off = measured(skew, t0, back);
    cr_assert(off <= skew && off >= skew - back, "skew %lld: offset %lld", (long long)skew,
              (long long)off);
    /* Planned 5 s later by the server's clock; presented 1 s after that. */
    int64_t expiry = t0 + 5000 + grant_ms;
    int64_t g_expiry = grant_agent_time(expiry, off);
    int64_t g_start = grant_agent_time(grant_start_by(expiry, grant_ms, start_ms), off);
    int64_t agent_now = t0 + 6000 + skew;
    cr_assert(g_start > agent_now && g_expiry > agent_now, "skew %lld: refused at once",
              (long long)skew);
    /* By the agent's clock the grant ends when the server's does, or up to
     * the reply's way back earlier: never later. */
    cr_assert(g_expiry <= expiry + skew && g_expiry >= expiry + skew - back, "skew %lld",
              (long long)skew);
    cr_assert(g_start <= t0 + 5000 + start_ms + skew, "skew %lld", (long long)skew);
  }
}

Test(clock, an_older_agent_and_an_unset_start_by_keep_the_servers_times) {
  cr_assert_eq(grant_clock_offset(0, 1800000000000), 0); /* HelloReply without unix_ms */
  cr_assert_eq(grant_agent_time(1800000600000, 0), 1800000600000);
  cr_assert_eq(grant_agent_time(0, 120000), 0); /* start_by 0: none, not "long past" */
  cr_assert_eq(grant_start_by(1800000600000, 600000, 0), 1800000600000);
}

Test(clock, any_clock_an_agent_reports_is_clamped_without_overflow) {
  int64_t now = 1800000000000;
  cr_assert_eq(grant_clock_offset(INT64_MAX, now), GRANT_OFFSET_MAX_MS);
  cr_assert_eq(grant_clock_offset(-5, now), 0); /* before the epoch: no clock */
  cr_assert_eq(grant_clock_offset(1, INT64_MAX), -GRANT_OFFSET_MAX_MS);
  cr_assert_eq(grant_agent_time(INT64_MAX - 1, GRANT_OFFSET_MAX_MS), INT64_MAX);
  cr_assert_eq(grant_agent_time(INT64_MAX - 1, INT64_MAX), INT64_MAX);
  /* A time before the epoch is long past (1), never "none" (0) nor negative. */
  cr_assert_eq(grant_agent_time(now, INT64_MIN), 1);
  cr_assert_eq(grant_agent_time(now, -now), 1);
}

Test(clock, the_test_shift_moves_the_grant_clock_only) {
  struct timespec a, b;
  clock_gettime(CLOCK_REALTIME, &a);
  grant_clock_shift(-90000);
  int64_t shifted = grant_now_unix_ms();
  grant_clock_shift(0);
  clock_gettime(CLOCK_REALTIME, &b);
  int64_t lo = (int64_t)a.tv_sec * 1000 + a.tv_nsec / 1000000 - 90000;
  int64_t hi = (int64_t)b.tv_sec * 1000 + b.tv_nsec / 1000000 - 90000;
  cr_assert(shifted >= lo && shifted <= hi, "%lld not in [%lld, %lld]", (long long)shifted,
            (long long)lo, (long long)hi);
  cr_assert_eq(grant_clock_shift_ms(), 0);
}

Test(clock, the_estimate_keeps_the_best_recent_sample_and_follows_steps) {
  grant_clock_t c = {0};
  const int64_t W = GRANT_CLOCK_WINDOW_MS;
  int64_t t = 1000;
  cr_assert_eq(grant_clock_sample(&c, 120000, t), 120000); /* the Hello's */
  /* A report that waited 3 s in a queue: its sample is 3 s low, the estimate
   * keeps the better one (the grant is not cut by the wait). */
  cr_assert_eq(grant_clock_sample(&c, 117000, t += 100), 120000);
  /* The next window: the last one's best still counts. */
  cr_assert_eq(grant_clock_sample(&c, 117000, t += W), 120000);
  /* Stepped forward 30 s: at once. */
  cr_assert_eq(grant_clock_sample(&c, 150000, t += 100), 150000);
  /* Stepped back 140 s: once the windows holding the old samples are over
   * (at most two), never later. */
  int64_t est = grant_clock_sample(&c, 10000, t += 100);
  cr_assert_eq(est, 150000);
  int64_t step = t;
  while (est != 10000 && t - step <= 2 * W) est = grant_clock_sample(&c, 10000, t += 250);
  cr_assert_eq(est, 10000, "still %lld after %lld ms", (long long)est, (long long)(t - step));
  /* No sample for long: the last estimate stands; the next sample alone then. */
  cr_assert_eq(c.offset_ms, 10000);
  cr_assert_eq(grant_clock_sample(&c, 9000, t += 10 * W), 9000);
  cr_assert_eq(grant_clock_sample(&c, INT64_MAX, t += 1), GRANT_OFFSET_MAX_MS); /* clamped */
}

/* Windows follow one another: the estimate holds no sample older than two
 * windows (docs/protocol.md, Clocks: "the best sample of the last 5 to 10 s").
 * An agent idle for most of two windows after its clock stepped back, then
 * busy, had its old sample counted for up to three (a window began at the
 * first sample after the gap, and the one before it was kept a whole window
 * more), so its grants outlived their time by the step for 15 s, not 10. */
Test(clock, no_sample_older_than_two_windows_counts) {
  grant_clock_t c = {0};
  const int64_t W = GRANT_CLOCK_WINDOW_MS, t0 = 1000;
  cr_assert_eq(grant_clock_sample(&c, 150000, t0), 150000); /* its last report before the step */
  /* Stepped back 140 s; reports again just before two windows passed, then often. */
  for (int64_t t = t0 + 2 * W - 1; t < t0 + 4 * W; t += 250) {
    int64_t est = grant_clock_sample(&c, 10000, t);
    if (t - t0 > 2 * W)
      cr_assert_eq(est, 10000, "a sample %lld ms old still counts", (long long)(t - t0));
  }
}
