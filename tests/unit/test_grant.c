/* core/platform/grant.c: transfer grants and write receipts (the direct data
 * path): what one key signs, another key, a flipped bit or a cut never passes. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

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

Test(grant, receipts_bind_nonce_ref_rank_and_bytes) {
  uint8_t nonce[GRANT_NONCE_LEN] = {9}, mac[GRANT_MAC_LEN];
  cr_assert_eq(grant_receipt(KEY, nonce, sizeof nonce, 5, 1, 4096, mac), 0);
  cr_assert(grant_receipt_ok(KEY, nonce, sizeof nonce, 5, 1, 4096, mac, sizeof mac));
  cr_assert_not(grant_receipt_ok(OTHER, nonce, sizeof nonce, 5, 1, 4096, mac, sizeof mac));
  cr_assert_not(grant_receipt_ok(KEY, nonce, sizeof nonce, 6, 1, 4096, mac, sizeof mac));
  cr_assert_not(grant_receipt_ok(KEY, nonce, sizeof nonce, 5, 2, 4096, mac, sizeof mac));
  cr_assert_not(grant_receipt_ok(KEY, nonce, sizeof nonce, 5, 1, 4095, mac, sizeof mac));
  cr_assert_not(grant_receipt_ok(KEY, nonce, sizeof nonce, 5, 1, 4096, mac, sizeof mac - 1));
  nonce[3] = 1;
  cr_assert_not(grant_receipt_ok(KEY, nonce, sizeof nonce, 5, 1, 4096, mac, sizeof mac));
}
