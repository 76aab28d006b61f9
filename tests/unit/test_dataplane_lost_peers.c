/* agent/dataplane/: the peers declared lost (dataplane_peer_lost) that a call
 * checks. The server sends PeerLost once per session with work on the lost
 * rank, so one loss is declared on a survivor as many times as there are such
 * sessions: those repeats must not push another lost peer, which a call in
 * progress still waits for, out of what calls check. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "dataplane/dataplane.h"

static const uint8_t SECRET[DP_SECRET_LEN] = "0123456789abcdef0123456789abcde";

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Member 0 of {0, 1} read the generation before its instruction checked its
 * peers (as run.c does); then rank 11 (member 1) is declared lost once, and
 * rank 99, of no group here, is declared lost 40 times (40 sessions had work
 * on it). The allreduce must fail at once with AGENT_LOST naming rank 11: it
 * waited the whole comm timeout for rank 11 to connect, then blamed it with
 * "did not connect". */
Test(dataplane_lost_peers, a_loss_is_not_forgotten_behind_repeats_of_another) {
  meshd_error_t err = {0};
  dataplane_t *dp = dataplane_start("127.0.0.1", 10, 3000, &err);
  cr_assert(dp, "dataplane_start: %s", err.msg);
  char me[64], gone[64] = "127.0.0.1:1";
  snprintf(me, sizeof me, "127.0.0.1:%d", dataplane_port(dp));
  uint32_t ranks[2] = {10, 11};
  const char *addrs[2] = {me, gone};
  uint64_t since = dataplane_generation(dp);
  dataplane_peer_lost(dp, gone, 11, "was lost at 12:00:00.000 UTC");
  for (int i = 0; i < 40; i++) dataplane_peer_lost(dp, "127.0.0.9:7000", 99, "was lost (other)");
  dp_group_t g = {.comm_id = 7, .call = 4, .ranks = ranks, .addrs = addrs, .n = 2, .me = 0,
                  .since = &since, .secret = SECRET};
  float buf[4] = {1, 2, 3, 4};
  int64_t t0 = now_ms();
  int rc = dp_allreduce(dp, &g, buf, 4, DTYPE_FLOAT32, RED_SUM, &err);
  int64_t took = now_ms() - t0;
  cr_assert_eq(rc, -1);
  cr_assert_eq(err.kind, ERR_AGENT_LOST, "%s (after %lld ms)", err.msg, (long long)took);
  cr_assert(strstr(err.msg, "rank 11") && strstr(err.msg, "12:00:00.000"), "%s", err.msg);
  cr_assert(took < 1000, "the loss ended the call after %lld ms", (long long)took);
  dataplane_stop(dp);
}
