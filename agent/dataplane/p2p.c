/* The agents' TCP transport (dataplane.h): point to point (to_mesh sends).
 * A failed transfer makes only its own link suspect: the other pairs on the
 * channel carry on. */
#include <stdio.h>

#include "dp_internal.h"

int dp_p2p(dataplane_t *dp, bool send, int timeout_ms, uint64_t comm_id, uint64_t call,
           const uint8_t *secret, uint32_t rank, const char *addr, void *buf, size_t bytes,
           meshd_error_t *err) {
  const char *what = send ? "send" : "recv";
  if (!dp || !addr || (!buf && bytes > 0) || !secret)
    return error_set(err, ERR_BAD_ARGUMENT,
                     "%s on comm %llu: needs a data plane, a peer address, a buffer and the "
                     "channel's secret (missing: %s)",
                     what, (unsigned long long)comm_id,
                     !dp ? "data plane" : !addr ? "address" : !secret ? "secret" : "buffer");
  if (dp__call_enter(dp, what, err) != 0) return -1;
  /* The peer as a one-member group. */
  const char *addrs[1] = {addr};
  dp_group_t peer = {.comm_id = comm_id, .call = call, .ranks = &rank, .addrs = addrs, .n = 1,
                     .secret = secret, .timeout_ms = timeout_ms};
  plan_t p;
  int rc = dp__plan_init(&p, dp, what, &peer, DTYPE_UINT8, RED_SUM, 1, 1, err);
  p.link_only = true;
  if (rc == 0) {
    p.msgs[0] = (msg_t){.buf = buf, .len = bytes};
    p.xs[0].msgs = p.msgs;
    p.xs[0].nmsgs = 1;
    rc = dp__plan_connect(&p, &peer, 0, 0, send, dp__now_ms() + dp__timeout(dp, &peer), err);
  }
  if (rc == 0) rc = dp__plan_run(&p, err);
  dp__plan_finish(&p, rc, err);
  dp__call_leave(dp);
  return rc;
}

int dp_send(dataplane_t *dp, uint64_t comm_id, uint64_t call, const uint8_t *secret,
            uint32_t to_rank, const char *addr, const void *buf, size_t bytes, meshd_error_t *err) {
  return dp_p2p(dp, true, 0, comm_id, call, secret, to_rank, addr, (void *)buf, bytes, err);
}

int dp_recv(dataplane_t *dp, uint64_t comm_id, uint64_t call, const uint8_t *secret,
            uint32_t from_rank, const char *addr, void *buf, size_t bytes, meshd_error_t *err) {
  return dp_p2p(dp, false, 0, comm_id, call, secret, from_rank, addr, buf, bytes, err);
}
