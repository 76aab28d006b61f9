/* Transfer grants: one-time permissions the server gives a client for one
 * Agent/Read or Agent/Write (docs/protocol.md, Direct data path), and the
 * receipts an agent hands back for a Write done under one.
 *
 * A grant on the wire is a packed meshd.agent.v1.TransferGrant followed by
 * GRANT_MAC_LEN bytes: HMAC-SHA256 keyed with the agent's call secret (its 64
 * hex characters as they are) over GRANT_LABEL || the packed message. A
 * receipt is HMAC-SHA256 with the same key over RECEIPT_LABEL || nonce ||
 * ref (8 bytes LE) || rank (4 bytes LE) || bytes (8 bytes LE); a Read's
 * receipt (the Read took its snapshot: no DropSnapshot need follow) the same
 * over READ_RECEIPT_LABEL with after_seq for bytes. The labels keep one kind
 * of MAC from passing for another. Only the server and that agent
 * know the key, so a client can neither forge nor alter either. */
#ifndef MESHD_GRANT_H
#define MESHD_GRANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "meshd/agent/v1/agent.pb-c.h"

/* Request metadata carrying a grant (binary: gRPC base64s it on the wire). */
#define GRANT_MD "meshd-transfer-grant-bin"
#define GRANT_MAC_LEN 32
#define GRANT_READ MESHD__AGENT__V1__TRANSFER_GRANT__DIRECTION__DIRECTION_READ
#define GRANT_WRITE MESHD__AGENT__V1__TRANSFER_GRANT__DIRECTION__DIRECTION_WRITE
#define GRANT_NONCE_LEN 16
#define GRANT_MAX_BYTES 4096
#define GRANT_LABEL "meshd-transfer-grant-v1"
#define RECEIPT_LABEL "meshd-write-receipt-v1"
#define READ_RECEIPT_LABEL "meshd-read-receipt-v1"

/* n bytes of the kernel's CSPRNG (getrandom) into buf: grants' nonces and
 * transfers' ids. OpenSSL's RAND_bytes cost 10-40 us a call in the server
 * (its DRBG behind the provider layer, cold), once or twice per plan; the
 * kernel's is the source OpenSSL seeds from. Returns 0, or -1 (no
 * randomness: nothing to fall back to). */
int grant_random(void *buf, size_t n);
/* g packed and signed with `secret` into a malloc'd buffer (*out, *len).
 * Returns 0, or -1 when out of memory or OpenSSL fails. */
int grant_issue(const char *secret, const Meshd__Agent__V1__TransferGrant *g, uint8_t **out,
                size_t *len);
/* Checks buf's MAC against `secret` (constant time) and unpacks it into *out
 * (free with protobuf_c_message_free_unpacked). Returns 0; -1 for a MAC that
 * does not match ("bad signature"), -2 for bytes that are no grant at all. */
int grant_open(const char *secret, const uint8_t *buf, size_t len,
               Meshd__Agent__V1__TransferGrant **out);
/* The receipt for a Write under a grant with `nonce`. Returns 0 or -1. */
int grant_receipt(const char *secret, const uint8_t *nonce, size_t nonce_len, uint64_t ref,
                  uint32_t rank, uint64_t bytes, uint8_t out[GRANT_MAC_LEN]);
/* Whether `mac` (mac_len bytes) is the receipt for these values; constant time. */
bool grant_receipt_ok(const char *secret, const uint8_t *nonce, size_t nonce_len, uint64_t ref,
                      uint32_t rank, uint64_t bytes, const uint8_t *mac, size_t mac_len);
/* The receipt for a Read under a grant with `nonce` that took its snapshot
 * (DataChunk.read_receipt). Returns 0 or -1. */
int grant_read_receipt(const char *secret, const uint8_t *nonce, size_t nonce_len, uint64_t ref,
                       uint32_t rank, uint64_t after_seq, uint8_t out[GRANT_MAC_LEN]);
/* Whether `mac` is that Read receipt; constant time. */
bool grant_read_receipt_ok(const char *secret, const uint8_t *nonce, size_t nonce_len,
                           uint64_t ref, uint32_t rank, uint64_t after_seq, const uint8_t *mac,
                           size_t mac_len);
/* The start-by time (start_by_unix_ms) of a grant issued now for grant_ms
 * that expires at expiry_ms: start_ms after issue (the server's
 * --transfer-grant-start-ms), or the expiry if sooner. Its agent remembers the
 * nonce only until then, so its table holds the grants of that window, not of
 * the whole grant_ms. */
static inline int64_t grant_start_by(int64_t expiry_ms, int64_t grant_ms, int64_t start_ms) {
  return start_ms > 0 && grant_ms > start_ms ? expiry_ms - grant_ms + start_ms : expiry_ms;
}
/* Milliseconds since the Unix epoch by this process's wall clock
 * (CLOCK_REALTIME, plus grant_clock_shift's test offset: none but in a test). */
int64_t grant_now_unix_ms(void);

/* Clocks (docs/protocol.md, Direct data path): the server issues a grant, its
 * agent checks its times, each by its own wall clock, and clocks drift apart
 * (NTP down, a VM resumed). So the server writes a grant's times in the
 * agent's clock: its own plus the agent's offset, measured when it dials the
 * agent back (Agent/Hello, whose reply carries the agent's clock) and kept
 * current by the agent's reports (AgentReport.unix_ms; grant_clock_t).
 *
 * The offset from a message the agent stamped agent_ms by its clock and the
 * server received at recv_ms by its own: agent_ms - recv_ms. The stamp was
 * taken before the message left, so this is a lower bound of the true
 * offset, off by the message's way to the server and no more (a midpoint of
 * a Hello's send and receive would also count the call's connection and TLS
 * handshake, on its way out only); a grant's times err early by that much,
 * never late: skew cannot let a grant live past its time. Clamped to
 * +-GRANT_OFFSET_MAX_MS; 0 when the agent sent no clock (agent_ms 0: an
 * older agent, checked by the server's clock as before). */
#define GRANT_OFFSET_MAX_MS (100LL * 366 * 24 * 3600 * 1000) /* a century */
int64_t grant_clock_offset(int64_t agent_ms, int64_t recv_ms);
/* An agent's offset as the server keeps it: every message that carries the
 * agent's clock (its Hello, then each AgentReport on its Execute link) gives
 * a sample, a lower bound (grant_clock_offset); a sample that waited in a
 * queue is lower by that wait. The estimate is the best (largest) sample of
 * the last one to two GRANT_CLOCK_WINDOW_MS windows (by the server's
 * monotonic clock), so a late sample does not shorten grants while a better
 * one came just before, a clock stepped forward counts from its first
 * sample, and one stepped back from at most two windows on (until then its
 * grants may outlive their time by the step). Zeroed: no sample yet (the
 * estimate 0: the server's times, as for an older agent). */
#define GRANT_CLOCK_WINDOW_MS 5000
typedef struct grant_clock {
  int64_t offset_ms;  /* the estimate, what grants use */
  int64_t window_ms;  /* when the current window began (monotonic; 0: no sample yet) */
  int64_t window_max; /* the best sample of the current window */
  int64_t prev_max;   /* ... of the window just before it */
  bool have_prev;     /* the window before held a sample and ended when this one began */
} grant_clock_t;
/* Takes one sample at now_mono_ms; returns the estimate (c->offset_ms). */
int64_t grant_clock_sample(grant_clock_t *c, int64_t sample_ms, int64_t now_mono_ms);
/* server_ms (the server's clock) in the agent's clock, given its offset; 0
 * stays 0 (a start_by_unix_ms of 0 means none). */
int64_t grant_agent_time(int64_t server_ms, int64_t offset_ms);
/* Test only: from now on grant_now_unix_ms runs shift_ms ahead of the wall
 * clock (the agent's MESHD_TEST_AGENT_CLOCK_SHIFT_MS, a skewed agent). */
void grant_clock_shift(int64_t shift_ms);
int64_t grant_clock_shift_ms(void);

#endif
