#include "grant.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* HMAC-SHA256(secret, label || a || b). */
static int mac2(const char *secret, const char *label, const uint8_t *a, size_t alen,
                const uint8_t *b, size_t blen, uint8_t out[GRANT_MAC_LEN]) {
  int rc = -1;
  unsigned char *buf = malloc(strlen(label) + alen + blen + 1);
  if (!buf) return -1;
  size_t n = strlen(label);
  memcpy(buf, label, n);
  if (alen) memcpy(buf + n, a, alen);
  if (blen) memcpy(buf + n + alen, b, blen);
  unsigned int outlen = 0;
  if (HMAC(EVP_sha256(), secret, (int)strlen(secret), buf, n + alen + blen, out, &outlen) &&
      outlen == GRANT_MAC_LEN)
    rc = 0;
  free(buf);
  return rc;
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
