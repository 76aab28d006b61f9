/* libFuzzer target: the data plane's wire format (agent/dataplane/wire.h), the
 * functions conn.c and transfer.c run on every byte a peer sends before it is
 * trusted: challenge and hello parsing, the acceptor's admission decision, the
 * dialer's ack check, frame-header classification.
 *
 * Input: byte 0 picks how the peer's bytes arrive (chunk size) and the
 * acceptor's rank; bytes 1..16 are the acceptor's nonce; the rest are what the
 * peer sent. Besides "no crash, no sanitizer report", it checks:
 *   - a hello refused as malformed on a prefix is refused on every longer one,
 *     and the decision does not depend on how the bytes were split;
 *   - an admitted hello is exactly the one dp_wire_hello makes with that group's
 *     secret (so nothing but the secret admits);
 *   - a hello made with the secret is admitted, and with any byte changed is not;
 *   - an ack is accepted only if it is the acceptor's;
 *   - a frame is "data" only if magic, comm, seq and length all match.
 *
 * Build (until tests/fuzz/CMakeLists.txt has meshd_fuzz_target):
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -D_GNU_SOURCE \
 *     -Iagent -Iagent/dataplane -Icore/tensor tests/fuzz/fuzz_dataplane.c \
 *     agent/dataplane/wire.c -lcrypto -o fuzz_dataplane
 *   ./fuzz_dataplane tests/fuzz/corpus/dataplane -runs=1000000 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dataplane/wire.h"

static const uint8_t SECRET_A[DP_SECRET_LEN] = "fuzz secret of group a.........";
static const uint8_t SECRET_B[DP_SECRET_LEN] = "fuzz secret of group b.........";

#define CHECK(cond) \
  do {              \
    if (!(cond)) abort(); \
  } while (0)

static void fuzz_hello(const uint8_t *in, size_t len, uint8_t sel, const uint8_t *nonce_a) {
  uint32_t me = sel & 3; /* the acceptor's rank, 0..3 */
  /* Groups the peer can hit: their comm_ids are the ones seeds use (1, 2). */
  static const uint32_t ranks_a[3] = {0, 1, 2}, ranks_b[2] = {1, 3};
  const dp_wire_group_t groups[2] = {{.comm_id = 1, .ranks = ranks_a, .n = 3, .secret = SECRET_A},
                                     {.comm_id = 2, .ranks = ranks_b, .n = 2, .secret = SECRET_B}};
  size_t n = len < DP_HELLO_LEN ? len : DP_HELLO_LEN;
  char why[200];
  size_t which = 99;

  /* As the listener reads: chunk by chunk, deciding after each. */
  size_t chunk = (size_t)(sel >> 2) % 9 + 1, got = 0;
  dp_admit_t a = DP_ADMIT_MORE;
  while (got < n && a == DP_ADMIT_MORE) {
    got += chunk < n - got ? chunk : n - got;
    a = dp_wire_admit(in, got, me, nonce_a, groups, 2, &which, why, sizeof why);
  }
  dp_admit_t whole = dp_wire_admit(in, n, me, nonce_a, groups, 2, &which, why, sizeof why);
  if (a == DP_ADMIT_MALFORMED) CHECK(whole == DP_ADMIT_MALFORMED); /* prefix-closed */
  else CHECK(whole == a);
  if (n < DP_HELLO_LEN) CHECK(whole == DP_ADMIT_MORE || whole == DP_ADMIT_MALFORMED);
  if (whole == DP_ADMIT_OK) {
    CHECK(which < 2);
    dp_hello_t h;
    CHECK(dp_wire_parse_hello(in, n, &h, NULL, 0) == DP_PARSE_OK);
    uint8_t again[DP_HELLO_LEN];
    dp_wire_hello(again, h.to, h.from, h.comm_id, h.call, in + 32, nonce_a, groups[which].secret);
    CHECK(memcmp(again, in, DP_HELLO_LEN) == 0);
    CHECK(h.to == me && h.from != me);
  }

  /* The dialer's side: the acceptor's challenge, then its ack. */
  uint8_t nonce[DP_NONCE_LEN];
  dp_parse_t c = dp_wire_parse_challenge(in, len, nonce, why, sizeof why);
  if (c == DP_PARSE_OK) CHECK(len >= DP_CHALLENGE_LEN && memcmp(nonce, in + 8, DP_NONCE_LEN) == 0);
  if (n == DP_HELLO_LEN) {
    uint8_t ack[DP_ACK_LEN];
    dp_wire_ack(ack, in, nonce_a, SECRET_A);
    const uint8_t *tail = in + DP_HELLO_LEN;
    size_t tl = len - DP_HELLO_LEN;
    if (dp_wire_ack_proves(tail, tl, in, nonce_a, SECRET_A)) CHECK(tl == DP_ACK_LEN && !memcmp(tail, ack, tl));
    CHECK(dp_wire_ack_proves(ack, sizeof ack, in, nonce_a, SECRET_A));
    CHECK(!dp_wire_ack_proves(ack, sizeof ack, in, nonce_a, SECRET_B));
  }
}

/* A hello made with the secret from fuzzed fields is admitted; changed, it is not. */
static void fuzz_made_hello(const uint8_t *in, size_t len, const uint8_t *nonce_a) {
  if (len < 20) return;
  static const uint32_t ranks[2] = {5, 6};
  const dp_wire_group_t g = {.comm_id = dp__get64(in), .ranks = ranks, .n = 2, .secret = SECRET_A};
  uint8_t hello[DP_HELLO_LEN];
  dp_wire_hello(hello, 5, 6, g.comm_id, dp__get64(in + 8), in + 4, nonce_a, SECRET_A);
  CHECK(dp_wire_admit(hello, sizeof hello, 5, nonce_a, &g, 1, NULL, NULL, 0) == DP_ADMIT_OK);
  size_t at = in[16] % DP_HELLO_LEN;
  uint8_t flip = in[17] ? in[17] : 1;
  hello[at] ^= flip;
  CHECK(dp_wire_admit(hello, sizeof hello, 5, nonce_a, &g, 1, NULL, NULL, 0) != DP_ADMIT_OK);
}

static void fuzz_frames(const uint8_t *in, size_t len, uint8_t sel) {
  for (size_t off = 0; off + DP_HDR_LEN <= len; off += DP_HDR_LEN) {
    const uint8_t *h = in + off;
    uint64_t comm = sel & 1 ? dp__get64(h + 8) : 7; /* sometimes the comm the frame names */
    uint64_t call = sel & 0x80 ? dp__get64(h + 16) : 3; /* and its call */
    uint64_t seq = sel & 2 ? dp__get64(h + 24) : 0;
    size_t want = sel & 4 ? dp__get32(h + 4) : (size_t)((sel >> 3) & 15) * 4096;
    size_t max = 1u << 20;
    dp_frame_t f;
    dp_frame_kind_t k = dp_wire_parse_frame(h, comm, call, seq, want, max, &f);
    bool data = f.magic == DP_MAGIC_DATA || f.magic == DP_MAGIC_SHM;
    switch (k) {
    case DP_FRAME_DATA:
      CHECK(f.magic == DP_MAGIC_DATA && f.comm_id == comm && f.call == call && f.seq == seq &&
            f.len == want);
      break;
    case DP_FRAME_ABORT: CHECK(f.magic == DP_MAGIC_ABORT && f.len <= DP_ABORT_MAX); break;
    case DP_FRAME_SHM:
      CHECK(f.magic == DP_MAGIC_SHM && f.comm_id == comm && f.call == call && f.seq == seq &&
            f.len == DP_SHM_PAYLOAD);
      break;
    case DP_FRAME_STALE:
    case DP_FRAME_AHEAD:
      CHECK(data && f.comm_id == comm && f.seq == seq &&
            (k == DP_FRAME_STALE ? f.call < call : f.call > call) &&
            (f.magic == DP_MAGIC_SHM ? f.len == DP_SHM_PAYLOAD : f.len <= max));
      break;
    case DP_FRAME_BYE: CHECK(f.magic == DP_MAGIC_BYE && f.comm_id == comm && f.len == 0); break;
    case DP_FRAME_FOREIGN:
      CHECK(!data || f.comm_id != comm);
      CHECK(f.magic != DP_MAGIC_BYE || f.comm_id != comm || f.len != 0);
      break;
    case DP_FRAME_SKEWED:
      CHECK(data && f.comm_id == comm);
      CHECK(f.seq != seq ||
            (f.magic == DP_MAGIC_SHM ? f.len != DP_SHM_PAYLOAD
                                     : f.call == call ? f.len != want : f.len > max));
      break;
    default: CHECK(0);
    }
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1 + DP_NONCE_LEN) return 0;
  uint8_t sel = data[0];
  const uint8_t *nonce_a = data + 1;
  const uint8_t *in = data + 1 + DP_NONCE_LEN;
  size_t len = size - 1 - DP_NONCE_LEN;
  /* Copies, so that ASan sees reads past what the peer sent. */
  uint8_t *copy = malloc(len ? len : 1);
  if (!copy) return 0;
  memcpy(copy, in, len);
  fuzz_hello(copy, len, sel, nonce_a);
  fuzz_made_hello(copy, len, nonce_a);
  fuzz_frames(copy, len, sel);
  free(copy);
  return 0;
}
