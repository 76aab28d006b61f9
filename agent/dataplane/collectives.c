/* The agents' TCP transport (dataplane.h): collectives.
 *
 * Two exchanges carry every collective: the ring (for large buffers: 2(n-1)
 * steps of one segment each, pipelined chunk by chunk) and the direct exchange
 * (for small ones: every member sends to and receives from every other at
 * once). allreduce and reduce_scatter share one scaffold, reduce_over, that
 * picks between them; allgather and alltoall move bytes only. Every member
 * reduces the members' contributions in group order, so all ranks compute
 * bit-identical results. */
#include <stdlib.h>
#include <string.h>

#include "dp_internal.h"

static int check_group(dataplane_t *dp, const char *what, const dp_group_t *g, size_t count,
                       dtype_t dtype, meshd_error_t *err) {
  if (!dp || !g || !g->ranks || !g->addrs || g->n == 0 || g->me >= g->n)
    return error_set(err, ERR_BAD_ARGUMENT, "%s: the group is empty or does not contain this member",
                     what);
  if (g->ranks[g->me] != dp->rank)
    return error_set(err, ERR_BAD_ARGUMENT,
                     "%s: group member %zu is rank %u but this data plane is rank %u", what, g->me,
                     g->ranks[g->me], dp->rank);
  for (size_t i = 0; i < g->n; i++)
    if (!g->addrs[i])
      return error_set(err, ERR_BAD_ARGUMENT, "%s: group member %zu has no address", what, i);
  if (g->n > 1 && !g->secret)
    return error_set(err, ERR_BAD_ARGUMENT,
                     "%s on comm %llu: the group has no secret (its instruction lacks one), so "
                     "its members cannot prove they belong to it",
                     what, (unsigned long long)g->comm_id);
  size_t esz = dtype_size(dtype);
  if (esz == 0) return error_set(err, ERR_BAD_ARGUMENT, "%s: unknown dtype %d", what, (int)dtype);
  if (count > SIZE_MAX / esz / g->n)
    return error_set(err, ERR_BAD_ARGUMENT, "%s: %zu elements is too large", what, count);
  return 0;
}

/* This member has no memory for a buffer of its own in call g->call, which
 * its peers run: it refuses the call (dp_refuse), so that they fail at once
 * naming it and why, instead of waiting out timeout_ms for it and then
 * blaming a connection. -1 with err (QUOTA). */
static int out_of_memory(dataplane_t *dp, const char *what, const dp_group_t *g, size_t bytes,
                         meshd_error_t *err) {
  meshd_error_t e = {0};
  error_set(&e, ERR_QUOTA, "%s on comm %llu: out of memory for %zu bytes of its buffers on rank %u",
            what, (unsigned long long)g->comm_id, bytes, (unsigned)atomic_load(&dp->rank));
  if (g->n > 1) dp_refuse(dp, g, DP_REFUSE_GROUP, 1, e.msg, NULL);
  if (err) *err = e;
  return -1;
}

static int check_op(const char *what, reduction_t op, dtype_t dtype, meshd_error_t *err) {
  if (dp_reduce_check(op, dtype, err) == 0) return 0;
  if (err) error_prefix(err, what, ": ");
  return -1;
}

/* ------------------------------------------------------------- exchanges */

static size_t ring_back(size_t me, size_t back, size_t n) { return (me + n - back % n) % n; }

/* Ring over the n members on buf, `total` elements cut into n segments as
 * evenly as possible (segment i = [off[i], off[i+1])).
 * rs: n-1 reduce-scatter steps, after which member me holds segment me reduced;
 * ag: n-1 all-gather steps from "member i holds segment i". Send step k+1 is
 * gated on receive step k, which received (and reduced) the very segment it
 * sends, so chunks flow around the ring without waiting for whole steps. */
static int ring(dataplane_t *dp, const char *what, const dp_group_t *g, uint8_t *buf, size_t total,
                dtype_t dtype, reduction_t op, bool rs, bool ag, meshd_error_t *err) {
  size_t n = g->n, me = g->me, esz = dtype_size(dtype);
  size_t steps = (rs ? n - 1 : 0) + (ag ? n - 1 : 0);
  plan_t p;
  uint8_t *scratch = NULL;
  /* Its own buffers first: a member without them refuses the call before it
   * joins it, telling its peers (out_of_memory). */
  size_t *off = malloc((n + 1) * sizeof *off);
  if (!off) return out_of_memory(dp, what, g, (n + 1) * sizeof *off, err);
  size_t maxseg = 0;
  for (size_t i = 0; i <= n; i++) off[i] = i * (total / n) + i * (total % n) / n;
  for (size_t i = 0; i < n; i++) maxseg = off[i + 1] - off[i] > maxseg ? off[i + 1] - off[i] : maxseg;
  if (rs && !(scratch = dp__scratch_get(dp, maxseg > 0 ? maxseg * esz : 1))) {
    free(off);
    return out_of_memory(dp, what, g, maxseg * esz, err);
  }
  int rc = dp__plan_init(&p, dp, what, g, dtype, op, 2, 2 * steps, err);
  if (rc != 0) goto out;
  size_t next = (me + 1) % n, prev = (me + n - 1) % n;
  msg_t *sm = p.msgs, *rm = p.msgs + steps;
  for (size_t k = 0; k < steps; k++) {
    bool red = rs && k < n - 1;
    size_t t = red || !rs ? k : k - (n - 1); /* step within its phase */
    size_t sseg = red ? ring_back(me, t + 1, n) : ring_back(me, t, n);
    size_t rseg = red ? ring_back(me, t + 2, n) : ring_back(me, t + 1, n);
    sm[k] = (msg_t){.buf = buf + off[sseg] * esz, .len = (off[sseg + 1] - off[sseg]) * esz,
                    .gate = k > 0 ? &rm[k - 1].done : NULL};
    size_t rlen = (off[rseg + 1] - off[rseg]) * esz;
    rm[k] = red ? (msg_t){.buf = scratch, .len = rlen, .into = buf + off[rseg] * esz}
                : (msg_t){.buf = buf + off[rseg] * esz, .len = rlen};
  }
  p.xs[0].msgs = sm;
  p.xs[0].nmsgs = steps;
  p.xs[1].msgs = rm;
  p.xs[1].nmsgs = steps;
  int64_t deadline = dp__now_ms() + dp__timeout(dp, g);
  rc = dp__plan_connect(&p, g, 0, next, true, deadline, err);
  if (rc == 0) rc = dp__plan_connect(&p, g, 1, prev, false, deadline, err);
  if (rc == 0) rc = dp__plan_run(&p, err);
out:
  free(off);
  dp__scratch_put(dp, scratch);
  return dp__plan_finish(&p, rc, err);
}

/* Every member j != me is sent send + j * send_stride (send_stride 0: the
 * same bytes to all) and its bytes land at recv + j * bytes, all at once.
 * Dials every send connection first (that needs only the peer's listener),
 * then waits for every receive connection (that needs the peer in the call). */
static int direct(dataplane_t *dp, const char *what, const dp_group_t *g, dtype_t dtype,
                  const uint8_t *send, size_t send_stride, uint8_t *recv, size_t bytes,
                  meshd_error_t *err) {
  size_t n = g->n, np = n - 1;
  plan_t p;
  int rc = dp__plan_init(&p, dp, what, g, dtype, RED_SUM, 2 * np, 2 * np, err);
  if (rc != 0) return dp__plan_finish(&p, rc, err);
  for (size_t i = 0, j = 0; j < n; j++) {
    if (j == g->me) continue;
    p.msgs[2 * i] = (msg_t){.buf = (uint8_t *)send + j * send_stride, .len = bytes};
    p.msgs[2 * i + 1] = (msg_t){.buf = recv + j * bytes, .len = bytes};
    p.xs[2 * i].msgs = &p.msgs[2 * i];
    p.xs[2 * i + 1].msgs = &p.msgs[2 * i + 1];
    p.xs[2 * i].nmsgs = p.xs[2 * i + 1].nmsgs = 1;
    i++;
  }
  int64_t deadline = dp__now_ms() + dp__timeout(dp, g);
  for (int recv_pass = 0; recv_pass < 2 && rc == 0; recv_pass++)
    for (size_t i = 0, j = 0; j < n && rc == 0; j++) {
      if (j == g->me) continue;
      rc = dp__plan_connect(&p, g, 2 * i + (size_t)recv_pass, j, !recv_pass, deadline, err);
      i++;
    }
  if (rc == 0) rc = dp__plan_run(&p, err);
  return dp__plan_finish(&p, rc, err);
}

/* Every member but `root` sends its part, elements [off[me], off[me+1]) at
 * send; the root receives member j's part at recv + off[j] * esz (each on its
 * own connection, all at once). Parts may differ in size but none is empty. */
static int to_root(dataplane_t *dp, const char *what, const dp_group_t *g, size_t root,
                   dtype_t dtype, const uint8_t *send, uint8_t *recv, const size_t *off,
                   meshd_error_t *err) {
  size_t n = g->n, me = g->me, esz = dtype_size(dtype), nx = me == root ? n - 1 : 1;
  plan_t p;
  int rc = dp__plan_init(&p, dp, what, g, dtype, RED_SUM, nx, nx, err);
  if (rc != 0) return dp__plan_finish(&p, rc, err);
  int64_t deadline = dp__now_ms() + dp__timeout(dp, g);
  if (me != root) {
    p.msgs[0] = (msg_t){.buf = (uint8_t *)send, .len = (off[me + 1] - off[me]) * esz};
    p.xs[0].msgs = &p.msgs[0];
    p.xs[0].nmsgs = 1;
    rc = dp__plan_connect(&p, g, 0, root, true, deadline, err);
  } else {
    for (size_t i = 0, j = 0; j < n; j++) {
      if (j == root) continue;
      p.msgs[i] = (msg_t){.buf = recv + off[j] * esz, .len = (off[j + 1] - off[j]) * esz};
      p.xs[i].msgs = &p.msgs[i];
      p.xs[i].nmsgs = 1;
      i++;
    }
    for (size_t i = 0, j = 0; j < n && rc == 0; j++) {
      if (j == root) continue;
      rc = dp__plan_connect(&p, g, i++, j, false, deadline, err);
    }
  }
  if (rc == 0) rc = dp__plan_run(&p, err);
  return dp__plan_finish(&p, rc, err);
}

/* Reduces n slots of count elements, slot j = slots + j * bytes, in group
 * order into acc (which may be slot 0). */
static void reduce_slots(reduction_t op, dtype_t dtype, uint8_t *acc, const uint8_t *slots,
                         size_t n, size_t count) {
  size_t bytes = count * dtype_size(dtype);
  if (acc != slots) memmove(acc, slots, bytes);
  for (size_t i = 1; i < n; i++) dp_reduce_apply(op, dtype, acc, slots + i * bytes, count);
}

/* The scaffold of allreduce and reduce_scatter. Member j's contribution to
 * output slice i is in + i * in_stride on member j (in_stride 0: the whole
 * input, allreduce; count elements: reduce_scatter), and out (count elements)
 * becomes slice me reduced over the members. all: every member's out holds
 * the same (allreduce; in == out). Large ones ring over a working copy (the
 * output itself for allreduce), small ones exchange directly and reduce the
 * slots. */
static int reduce_over(dataplane_t *dp, const char *what, const dp_group_t *g, const uint8_t *in,
                       size_t in_stride, uint8_t *out, size_t count, dtype_t dtype,
                       reduction_t op, bool all, meshd_error_t *err) {
  size_t n = g->n, me = g->me, bytes = count * dtype_size(dtype);
  size_t ring_total = all ? count : n * count; /* elements the ring moves around */
  int rc;
  if (ring_total * dtype_size(dtype) > DP_DIRECT_MAX && ring_total >= n) {
    uint8_t *work = all ? out : malloc(n * bytes);
    if (!work) return out_of_memory(dp, what, g, n * bytes, err);
    if (!all) memcpy(work, in, n * bytes);
    rc = ring(dp, what, g, work, ring_total, dtype, op, true, all, err);
    if (rc == 0 && !all) memcpy(out, work + me * bytes, bytes);
    if (!all) free(work);
    return rc;
  }
  uint8_t *slots = malloc(n * bytes);
  if (!slots) return out_of_memory(dp, what, g, n * bytes, err);
  memcpy(slots + me * bytes, in + me * in_stride, bytes);
  rc = direct(dp, what, g, dtype, in, in_stride, slots, bytes, err);
  if (rc == 0) reduce_slots(op, dtype, out, slots, n, count);
  free(slots);
  return rc;
}

/* ------------------------------------------------------------- the calls */

int dp_allreduce(dataplane_t *dp, const dp_group_t *g, void *buf, size_t count, dtype_t dtype,
                 reduction_t op, meshd_error_t *err) {
  const char *what = "allreduce";
  if (check_group(dp, what, g, count, dtype, err) != 0) return -1;
  if (check_op(what, op, dtype, err) != 0) return -1;
  if (g->n == 1 || count == 0) return 0;
  if (dp__call_enter(dp, what, err) != 0) return -1;
  int rc = reduce_over(dp, what, g, buf, 0, buf, count, dtype, op, true, err);
  if (rc == 0) dp_reduce_finish(op, dtype, buf, count, g->n);
  dp__call_leave(dp);
  return rc;
}

int dp_reduce_scatter(dataplane_t *dp, const dp_group_t *g, const void *in, void *out, size_t count,
                      dtype_t dtype, reduction_t op, meshd_error_t *err) {
  const char *what = "reduce_scatter";
  if (check_group(dp, what, g, count, dtype, err) != 0) return -1;
  if (check_op(what, op, dtype, err) != 0) return -1;
  size_t bytes = count * dtype_size(dtype);
  if (count == 0) return 0;
  if (g->n == 1) {
    memmove(out, in, bytes);
    return 0;
  }
  if (dp__call_enter(dp, what, err) != 0) return -1;
  int rc = reduce_over(dp, what, g, in, bytes, out, count, dtype, op, false, err);
  if (rc == 0) dp_reduce_finish(op, dtype, out, count, g->n);
  dp__call_leave(dp);
  return rc;
}

int dp_allgather(dataplane_t *dp, const dp_group_t *g, const void *in, void *out, size_t count,
                 dtype_t dtype, meshd_error_t *err) {
  const char *what = "allgather";
  if (check_group(dp, what, g, count, dtype, err) != 0) return -1;
  size_t bytes = count * dtype_size(dtype), n = g->n, me = g->me;
  if (count == 0) return 0;
  uint8_t *o = out;
  memmove(o + me * bytes, in, bytes);
  if (n == 1) return 0;
  if (dp__call_enter(dp, what, err) != 0) return -1;
  int rc = bytes * n > DP_DIRECT_MAX
               ? ring(dp, what, g, o, n * count, dtype, RED_SUM, false, true, err)
               : direct(dp, what, g, dtype, o + me * bytes, 0, o, bytes, err);
  dp__call_leave(dp);
  return rc;
}

int dp_alltoall(dataplane_t *dp, const dp_group_t *g, const void *in, void *out, size_t count,
                dtype_t dtype, meshd_error_t *err) {
  const char *what = "alltoall";
  if (check_group(dp, what, g, count, dtype, err) != 0) return -1;
  size_t bytes = count * dtype_size(dtype), n = g->n, me = g->me;
  if (count == 0) return 0;
  memmove((uint8_t *)out + me * bytes, (const uint8_t *)in + me * bytes, bytes);
  if (n == 1) return 0;
  if (dp__call_enter(dp, what, err) != 0) return -1;
  int rc = direct(dp, what, g, dtype, in, bytes, out, bytes, err);
  dp__call_leave(dp);
  return rc;
}

/* Rooted: only the root ends with a result; the others' buffers are scratch.
 * Large ones reduce-scatter around the ring (half an allreduce) and send the
 * root their reduced segment; small ones send the root their whole buffer,
 * which reduces the slots in group order. */
int dp_reduce_root(dataplane_t *dp, const dp_group_t *g, size_t root, void *buf, size_t count,
                   dtype_t dtype, reduction_t op, meshd_error_t *err) {
  const char *what = "reduce";
  if (check_group(dp, what, g, count, dtype, err) != 0) return -1;
  if (check_op(what, op, dtype, err) != 0) return -1;
  if (root >= g->n)
    return error_set(err, ERR_BAD_ARGUMENT, "%s: root %zu is not a member of a group of %zu", what,
                     root, g->n);
  if (g->n == 1 || count == 0) return 0;
  size_t n = g->n, esz = dtype_size(dtype), bytes = count * esz;
  size_t *off = malloc((n + 1) * sizeof *off);
  uint8_t *slots = NULL;
  if (!off) return out_of_memory(dp, what, g, (n + 1) * sizeof *off, err);
  if (dp__call_enter(dp, what, err) != 0) {
    free(off);
    return -1;
  }
  int rc;
  uint8_t *b = buf;
  if (bytes > DP_DIRECT_MAX && count >= n) {
    for (size_t i = 0; i <= n; i++) off[i] = i * (count / n) + i * (count % n) / n;
    rc = ring(dp, what, g, b, count, dtype, op, true, false, err);
    if (rc == 0) rc = to_root(dp, what, g, root, dtype, b + off[g->me] * esz, b, off, err);
  } else {
    for (size_t i = 0; i <= n; i++) off[i] = i * count;
    if (g->me == root && !(slots = malloc(n * bytes))) {
      rc = out_of_memory(dp, what, g, n * bytes, err);
    } else {
      if (slots) memcpy(slots + root * bytes, b, bytes);
      rc = to_root(dp, what, g, root, dtype, b, slots, off, err);
      if (rc == 0 && slots) reduce_slots(op, dtype, b, slots, n, count);
    }
  }
  if (rc == 0 && g->me == root) dp_reduce_finish(op, dtype, b, count, n);
  dp__call_leave(dp);
  free(slots);
  free(off);
  return rc;
}

int dp_gather_root(dataplane_t *dp, const dp_group_t *g, size_t root, const void *in, void *out,
                   size_t count, dtype_t dtype, meshd_error_t *err) {
  const char *what = "gather";
  if (check_group(dp, what, g, count, dtype, err) != 0) return -1;
  if (root >= g->n)
    return error_set(err, ERR_BAD_ARGUMENT, "%s: root %zu is not a member of a group of %zu", what,
                     root, g->n);
  size_t n = g->n, bytes = count * dtype_size(dtype);
  if (count == 0) return 0;
  if (g->me == root) memmove((uint8_t *)out + root * bytes, in, bytes);
  if (n == 1) return 0;
  size_t *off = malloc((n + 1) * sizeof *off);
  if (!off) return out_of_memory(dp, what, g, (n + 1) * sizeof *off, err);
  for (size_t i = 0; i <= n; i++) off[i] = i * count;
  int rc = dp__call_enter(dp, what, err);
  if (rc == 0) {
    rc = to_root(dp, what, g, root, dtype, in, out, off, err);
    dp__call_leave(dp);
  }
  free(off);
  return rc;
}

/* The chain: member 0 sends buf to member 1, each member forwards to the next
 * what it has received while it receives (frame by frame, gated on the bytes
 * in), the last only receives. The source sends the bytes once however many
 * members there are; the time is one transfer plus a frame per hop. Between
 * members on one host the hop is a shared-memory frame (shm.c): the source
 * copies buf into a sealed memfd once, and every member passes the same
 * descriptor on and maps it over its buf (g->mappable) or copies it. */
int dp_broadcast(dataplane_t *dp, const dp_group_t *g, void *buf, size_t bytes, meshd_error_t *err) {
  const char *what = "broadcast";
  if (check_group(dp, what, g, bytes, DTYPE_UINT8, err) != 0) return -1;
  size_t n = g->n, me = g->me;
  if (n == 1 || bytes == 0) return 0;
  if (dp__call_enter(dp, what, err) != 0) return -1;
  bool recv = me > 0, send = me + 1 < n;
  size_t nx = (size_t)recv + (size_t)send;
  plan_t p;
  int rc = dp__plan_init(&p, dp, what, g, DTYPE_UINT8, RED_SUM, nx, nx, err);
  if (rc == 0) {
    size_t k = 0;
    bool shm = bytes >= DP_SHM_MIN && dp->same_host;
    if (recv) {
      p.msgs[k] = (msg_t){.buf = buf, .len = bytes, .shm = send ? &p.shm : NULL,
                          .map = g->mappable};
      p.xs[k].msgs = &p.msgs[k];
      p.xs[k].nmsgs = 1;
      k++;
    }
    if (send) {
      p.msgs[k] = (msg_t){.buf = buf, .len = bytes, .gate = recv ? &p.msgs[0].done : NULL,
                          .shm = shm ? &p.shm : NULL};
      p.xs[k].msgs = &p.msgs[k];
      p.xs[k].nmsgs = 1;
    }
    int64_t deadline = dp__now_ms() + dp__timeout(dp, g);
    /* Dial the next member first (that needs only its listener), then wait for the previous. */
    if (send) rc = dp__plan_connect(&p, g, recv ? 1 : 0, me + 1, true, deadline, err);
    if (rc == 0 && recv) rc = dp__plan_connect(&p, g, 0, me - 1, false, deadline, err);
    /* The source of a same-host hop copies its bytes once, for every member
     * down the chain (none: the bytes go as frames). */
    if (rc == 0 && shm && !recv && p.xs[0].c->local) p.shm = dp__shm_create(buf, bytes);
    if (rc == 0) rc = dp__plan_run(&p, err);
  }
  rc = dp__plan_finish(&p, rc, err);
  dp__call_leave(dp);
  return rc;
}
