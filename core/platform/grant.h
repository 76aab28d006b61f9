/* Transfer grants: one-time permissions the server gives a client for one
 * Agent/Read or Agent/Write (docs/protocol.md, Direct data path), and the
 * receipts an agent hands back for a Write done under one.
 *
 * A grant on the wire is a packed meshd.agent.v1.TransferGrant followed by
 * GRANT_MAC_LEN bytes: HMAC-SHA256 keyed with the agent's call secret (its 64
 * hex characters as they are) over GRANT_LABEL || the packed message. A
 * receipt is HMAC-SHA256 with the same key over RECEIPT_LABEL || nonce ||
 * ref (8 bytes LE) || rank (4 bytes LE) || bytes (8 bytes LE). The labels keep
 * one kind of MAC from passing for the other. Only the server and that agent
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
/* The start-by time (start_by_unix_ms) of a grant issued now for grant_ms
 * that expires at expiry_ms: start_ms after issue (the server's
 * --transfer-grant-start-ms), or the expiry if sooner. Its agent remembers the
 * nonce only until then, so its table holds the grants of that window, not of
 * the whole grant_ms. */
static inline int64_t grant_start_by(int64_t expiry_ms, int64_t grant_ms, int64_t start_ms) {
  return start_ms > 0 && grant_ms > start_ms ? expiry_ms - grant_ms + start_ms : expiry_ms;
}
/* Milliseconds since the Unix epoch (what expiry_unix_ms counts). */
int64_t grant_now_unix_ms(void);

#endif
