#include "grant.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

/* HMAC-SHA256 with each secret's key blocks hashed once. A plan signs a grant
 * per shard and a FinishUpload checks a receipt per shard, each with its
 * agent's call secret; keying HMAC anew each time (HMAC() hashes the key's
 * inner and outer blocks, and OpenSSL 3 fetches SHA-256 from its provider)
 * was most of a MAC's cost, ~4 us of ~4.5 here, several per 1 MiB direct
 * upload. So SHA-256 after each secret's inner block (key ^ ipad) and outer
 * block (key ^ opad) is kept in a small table, by secret, and every MAC
 * starts from copies of those two states (RFC 2104: the same MAC). The table
 * holds what the process holds already (the server its agents' call secrets,
 * an agent its own) and at most KEY_SLOTS of them: a secret that finds its
 * slot taken by another replaces it (its states are made again, as every
 * MAC made them before). */
#define KEY_SLOTS 64
#define HMAC_BLOCK 64 /* SHA-256's block */
#define KEY_SECRET_MAX 128 /* longer secrets are keyed each time, not kept */
typedef struct {
  bool ready;                      /* inner and outer are secret's */
  char secret[KEY_SECRET_MAX + 1];
  EVP_MD_CTX *inner, *outer;      /* SHA-256 after key ^ ipad, after key ^ opad */
} key_slot_t;

static pthread_mutex_t keys_mu = PTHREAD_MUTEX_INITIALIZER;
static key_slot_t keys[KEY_SLOTS];
static EVP_MD *sha256;
static pthread_once_t sha256_once = PTHREAD_ONCE_INIT;

static void sha256_fetch(void) { sha256 = EVP_MD_fetch(NULL, "SHA256", NULL); }

/* c := SHA-256 after one block of the key XOR pad (RFC 2104's K ^ ipad or
 * K ^ opad; a key longer than a block is its digest). */
static int key_block(EVP_MD_CTX *c, const uint8_t *key, size_t len, uint8_t pad) {
  uint8_t k[HMAC_BLOCK] = {0};
  unsigned int n = 0;
  int ok = 1;
  if (len > HMAC_BLOCK) ok = EVP_Digest(key, len, k, &n, sha256, NULL);
  else memcpy(k, key, len);
  for (size_t i = 0; i < HMAC_BLOCK; i++) k[i] ^= pad;
  ok = ok && EVP_DigestInit_ex(c, sha256, NULL) && EVP_DigestUpdate(c, k, sizeof k);
  OPENSSL_cleanse(k, sizeof k);
  return ok ? 0 : -1;
}

static int key_states(const char *secret, EVP_MD_CTX *inner, EVP_MD_CTX *outer) {
  const uint8_t *k = (const uint8_t *)secret;
  size_t len = strlen(secret);
  return key_block(inner, k, len, 0x36) || key_block(outer, k, len, 0x5c) ? -1 : 0;
}

static size_t key_slot_of(const char *secret) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a: secrets are random already */
  for (const char *p = secret; *p; p++) h = (h ^ (uint8_t)*p) * 1099511628211ull;
  return (size_t)(h % KEY_SLOTS);
}

/* inner, outer := the secret's two states, from its slot (made there first
 * when it holds another secret or none). */
static int key_start(const char *secret, EVP_MD_CTX *inner, EVP_MD_CTX *outer) {
  size_t len = strlen(secret);
  if (len > KEY_SECRET_MAX) return key_states(secret, inner, outer);
  key_slot_t *k = &keys[key_slot_of(secret)];
  int rc = 0;
  pthread_mutex_lock(&keys_mu);
  if (!k->ready || strlen(k->secret) != len || CRYPTO_memcmp(k->secret, secret, len) != 0) {
    if (!k->inner) k->inner = EVP_MD_CTX_new();
    if (!k->outer) k->outer = EVP_MD_CTX_new();
    OPENSSL_cleanse(k->secret, sizeof k->secret);
    rc = k->inner && k->outer ? key_states(secret, k->inner, k->outer) : -1;
    k->ready = rc == 0;
    if (rc == 0) memcpy(k->secret, secret, len + 1);
  }
  if (rc == 0)
    rc = EVP_MD_CTX_copy_ex(inner, k->inner) && EVP_MD_CTX_copy_ex(outer, k->outer) ? 0 : -1;
  pthread_mutex_unlock(&keys_mu);
  return rc;
}

/* HMAC-SHA256(secret, label || a || b). */
static int mac2(const char *secret, const char *label, const uint8_t *a, size_t alen,
                const uint8_t *b, size_t blen, uint8_t out[GRANT_MAC_LEN]) {
  pthread_once(&sha256_once, sha256_fetch);
  if (!sha256) return -1;
  EVP_MD_CTX *inner = EVP_MD_CTX_new(), *outer = EVP_MD_CTX_new();
  uint8_t h[GRANT_MAC_LEN];
  unsigned int n = 0, m = 0;
  int rc = inner && outer && key_start(secret, inner, outer) == 0 &&
                   EVP_DigestUpdate(inner, label, strlen(label)) &&
                   (!alen || EVP_DigestUpdate(inner, a, alen)) &&
                   (!blen || EVP_DigestUpdate(inner, b, blen)) &&
                   EVP_DigestFinal_ex(inner, h, &n) && n == sizeof h &&
                   EVP_DigestUpdate(outer, h, sizeof h) && EVP_DigestFinal_ex(outer, out, &m) &&
                   m == GRANT_MAC_LEN
               ? 0
               : -1;
  OPENSSL_cleanse(h, sizeof h);
  EVP_MD_CTX_free(inner); /* (cleanses its state) */
  EVP_MD_CTX_free(outer);
  return rc;
}

int grant_random(void *buf, size_t n) {
  uint8_t *p = buf;
  for (size_t got = 0; got < n;) {
    ssize_t r = getrandom(p + got, n - got, 0);
    if (r < 0 && errno != EINTR) return -1;
    if (r > 0) got += (size_t)r;
  }
  return 0;
}

int grant_issue(const char *secret, const Meshd__Agent__V1__TransferGrant *g, uint8_t **out,
                size_t *len) {
  size_t n = protobuf_c_message_get_packed_size(&g->base);
  uint8_t *buf = malloc(n + GRANT_MAC_LEN);
  if (!buf) return -1;
  protobuf_c_message_pack(&g->base, buf);
  if (mac2(secret, GRANT_LABEL, buf, n, NULL, 0, buf + n)) {
    free(buf);
    return -1;
  }
  *out = buf;
  *len = n + GRANT_MAC_LEN;
  return 0;
}

int grant_open(const char *secret, const uint8_t *buf, size_t len,
               Meshd__Agent__V1__TransferGrant **out) {
  *out = NULL;
  if (len <= GRANT_MAC_LEN || len > GRANT_MAX_BYTES) return -2;
  uint8_t want[GRANT_MAC_LEN];
  size_t n = len - GRANT_MAC_LEN;
  if (mac2(secret, GRANT_LABEL, buf, n, NULL, 0, want)) return -1;
  bool ok = CRYPTO_memcmp(want, buf + n, GRANT_MAC_LEN) == 0;
  OPENSSL_cleanse(want, sizeof want);
  if (!ok) return -1;
  *out = meshd__agent__v1__transfer_grant__unpack(NULL, n, buf);
  return *out ? 0 : -2;
}

static void put_le(uint8_t *p, uint64_t v, int n) {
  for (int i = 0; i < n; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* HMAC-SHA256(secret, label || nonce || ref (8 LE) || rank (4 LE) || n (8 LE)):
 * a Write's receipt (n: its bytes) or a Read's (n: its after_seq). */
static int receipt_of(const char *secret, const char *label, const uint8_t *nonce,
                      size_t nonce_len, uint64_t ref, uint32_t rank, uint64_t n,
                      uint8_t out[GRANT_MAC_LEN]) {
  uint8_t tail[20];
  put_le(tail, ref, 8);
  put_le(tail + 8, rank, 4);
  put_le(tail + 12, n, 8);
  return mac2(secret, label, nonce, nonce_len, tail, sizeof tail, out);
}

static bool receipt_is(const char *secret, const char *label, const uint8_t *nonce,
                       size_t nonce_len, uint64_t ref, uint32_t rank, uint64_t n,
                       const uint8_t *mac, size_t mac_len) {
  uint8_t want[GRANT_MAC_LEN];
  if (mac_len != GRANT_MAC_LEN ||
      receipt_of(secret, label, nonce, nonce_len, ref, rank, n, want))
    return false;
  bool ok = CRYPTO_memcmp(want, mac, GRANT_MAC_LEN) == 0;
  OPENSSL_cleanse(want, sizeof want);
  return ok;
}

int grant_receipt(const char *secret, const uint8_t *nonce, size_t nonce_len, uint64_t ref,
                  uint32_t rank, uint64_t bytes, uint8_t out[GRANT_MAC_LEN]) {
  return receipt_of(secret, RECEIPT_LABEL, nonce, nonce_len, ref, rank, bytes, out);
}

bool grant_receipt_ok(const char *secret, const uint8_t *nonce, size_t nonce_len, uint64_t ref,
                      uint32_t rank, uint64_t bytes, const uint8_t *mac, size_t mac_len) {
  return receipt_is(secret, RECEIPT_LABEL, nonce, nonce_len, ref, rank, bytes, mac, mac_len);
}

int grant_read_receipt(const char *secret, const uint8_t *nonce, size_t nonce_len, uint64_t ref,
                       uint32_t rank, uint64_t after_seq, uint8_t out[GRANT_MAC_LEN]) {
  return receipt_of(secret, READ_RECEIPT_LABEL, nonce, nonce_len, ref, rank, after_seq, out);
}

bool grant_read_receipt_ok(const char *secret, const uint8_t *nonce, size_t nonce_len,
                           uint64_t ref, uint32_t rank, uint64_t after_seq, const uint8_t *mac,
                           size_t mac_len) {
  return receipt_is(secret, READ_RECEIPT_LABEL, nonce, nonce_len, ref, rank, after_seq, mac,
                    mac_len);
}

static _Atomic int64_t clock_shift_ms;

void grant_clock_shift(int64_t shift_ms) { atomic_store(&clock_shift_ms, shift_ms); }
int64_t grant_clock_shift_ms(void) { return atomic_load(&clock_shift_ms); }

int64_t grant_now_unix_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000 + atomic_load(&clock_shift_ms);
}

static int64_t clamp_offset(int64_t ms) {
  return ms > GRANT_OFFSET_MAX_MS    ? GRANT_OFFSET_MAX_MS
         : ms < -GRANT_OFFSET_MAX_MS ? -GRANT_OFFSET_MAX_MS
                                     : ms;
}

int64_t grant_clock_offset(int64_t agent_ms, int64_t recv_ms) {
  if (agent_ms <= 0) return 0;
  int64_t d; /* whatever int64 the agent sent: no overflow */
  if (__builtin_sub_overflow(agent_ms, recv_ms, &d)) d = agent_ms > recv_ms ? INT64_MAX : INT64_MIN;
  return clamp_offset(d);
}

int64_t grant_agent_time(int64_t server_ms, int64_t offset_ms) {
  if (server_ms == 0) return 0;
  int64_t t;
  if (__builtin_add_overflow(server_ms, clamp_offset(offset_ms), &t)) t = INT64_MAX;
  /* A time before the epoch is one long past: 1, not 0 (which means none). */
  return t > 0 ? t : 1;
}

int64_t grant_clock_sample(grant_clock_t *c, int64_t sample_ms, int64_t now_mono_ms) {
  sample_ms = clamp_offset(sample_ms);
  int64_t age = now_mono_ms - c->window_ms;
  if (!c->window_ms || age >= GRANT_CLOCK_WINDOW_MS) { /* a new window */
    /* The one right after the current window, or after a gap of a window or
     * more one from now: one begun at now after a shorter gap kept the window
     * before it (samples up to two windows old then) a whole window more. */
    bool next = c->window_ms && age < 2 * GRANT_CLOCK_WINDOW_MS;
    c->have_prev = next;
    c->prev_max = c->window_max;
    c->window_ms = next ? c->window_ms + GRANT_CLOCK_WINDOW_MS : now_mono_ms ? now_mono_ms : 1;
    c->window_max = sample_ms;
  } else if (sample_ms > c->window_max) {
    c->window_max = sample_ms;
  }
  c->offset_ms = c->have_prev && c->prev_max > c->window_max ? c->prev_max : c->window_max;
  return c->offset_ms;
}
