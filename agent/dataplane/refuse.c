/* The agents' TCP transport (dataplane.h): a member that will not take part
 * in a call it was sent (dp_refuse).
 *
 * Without it, a member that fails before it joins a collective (no memory
 * for its staging copy or its result, no device stream) reports its own
 * error, but its peers wait for it until timeout_ms and then fail with a
 * timeout that names it without saying why. A refusal reaches each way a
 * peer can wait for this member:
 *   - a peer waiting for our connection: we dial it for the call (or take the
 *     link we keep to it) and send an abort frame, as a member that failed
 *     mid-call does on its links; every peer at once, on up to
 *     REFUSE_THREADS threads, so that one still busy before the call holds
 *     up only its own notice;
 *   - a peer sending to us on a link it keeps: dp__abort_untaken writes the
 *     abort on that link, where its sender reads it (a send's peer does not
 *     send to us for it: its links to us carry its own sends);
 *   - a peer that dials us for the call, now or later: the refusal record
 *     (conn.c) acks its hello and answers with the abort.
 * Each peer fails the call at once (PEER_ABORTED) with our reason, and the
 * failure spreads through the group as any abort does (transfer.c). */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "dp_internal.h"

/* Writes the abort frame of `call` carrying why on the link c we dialed, at a
 * frame boundary (no call holds it): 0, 1 when the link broke (a kept one
 * the peer closed), or -1 past the deadline. */
static int write_abort(dataplane_t *dp, conn_t *c, uint64_t call, const char *why,
                       int64_t deadline) {
  uint8_t frame[DP_HDR_LEN + DP_ABORT_MAX];
  size_t len = dp_wire_abort(frame, c->comm_id, call, why), done = 0;
  while (done < len) {
    ssize_t w = send(c->fd, frame + done, len - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      done += (size_t)w;
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return 1;
    int64_t left = deadline - dp__now_ms();
    if (left <= 0 || dp__stopping(dp)) return -1;
    struct pollfd pf = {.fd = c->fd, .events = POLLOUT};
    poll(&pf, 1, (int)dp__min((size_t)left, 200));
  }
  return 0;
}

/* The refusal's dials, shared by its threads: each takes the next member. */
typedef struct notice {
  dataplane_t *dp;
  const dp_group_t *g;
  const call_t *cl;
  bool group;
  uint64_t last;
  const char *text;
  int64_t deadline;
  _Atomic size_t next;
  pthread_mutex_t mu;
  meshd_error_t err; /* the first member that could not be told (mu) */
} notice_t;

/* Tells member i: dials it (or takes our kept link to it) and writes the
 * abort there. The link stays: the peer, which fails on it, closes it, and a
 * later call of the peer's on it skips it, as any older call's abort. A link
 * another call of ours is sending on (a channel's transfer from another
 * stream) is not written on: frames of two calls would interleave. */
static void tell(notice_t *nt, size_t i) {
  const dp_group_t *g = nt->g;
  meshd_error_t e = {0};
  /* A kept link the peer closed: once more on a fresh one (a peer that left
   * the call answers that with its own abort, conn.c). */
  for (int tries = 0; tries < 2; tries++) {
    conn_t *c = dp__get_out(nt->dp, nt->cl, g->ranks[i], g->addrs[i], nt->deadline, &e);
    if (!c) break;
    if (dp__conn_busy(nt->dp, c)) {
      dp__conn_put(nt->dp, c);
      break;
    }
    int w = write_abort(nt->dp, c, nt->last, nt->text, nt->deadline);
    if (w != 0) dp__conn_discard(nt->dp, c);
    dp__conn_put(nt->dp, c);
    if (w < 0)
      error_set(&e, ERR_REMOTE_FAILURE,
                "%s on comm %llu: rank %u at %s did not take the notice within %d ms",
                nt->cl->what, (unsigned long long)g->comm_id, g->ranks[i], g->addrs[i],
                dp__timeout(nt->dp, g));
    if (w <= 0) break;
  }
  if (e.kind == ERR_NONE) return;
  pthread_mutex_lock(&nt->mu);
  if (nt->err.kind == ERR_NONE) nt->err = e;
  pthread_mutex_unlock(&nt->mu);
}

static void *tell_main(void *arg) {
  notice_t *nt = arg;
  for (size_t i; (i = atomic_fetch_add(&nt->next, 1)) < nt->g->n;) {
    /* Not ourselves, nor a member declared lost (it runs nothing: a dial
     * would wait out the deadline, and every peer knows of the loss). */
    if ((nt->group && i == nt->g->me) || dp__declared_lost(nt->dp, nt->g->addrs[i])) continue;
    tell(nt, i);
  }
  return NULL;
}

/* Peers told at once: a member that has not reached the call yet holds up
 * only its own notice. */
#define REFUSE_THREADS 16

int dp_refuse(dataplane_t *dp, const dp_group_t *g, dp_refuse_t what, uint64_t calls,
              const char *why, meshd_error_t *err) {
  bool group = what == DP_REFUSE_GROUP;
  if (!dp || !g || !g->ranks || !g->addrs || g->n == 0 || !g->secret ||
      (group && g->me >= g->n) || (!group && g->n != 1))
    return error_set(err, ERR_BAD_ARGUMENT,
                     "refusal: needs a data plane and a group with its secret that contains this "
                     "member (or, for a send or recv, the one peer)");
  if (group && g->n == 1) return 0; /* nobody waits */
  const char *name = group ? "refusal" : what == DP_REFUSE_SEND ? "send" : "recv";
  if (dp__call_enter(dp, name, err) != 0) return -1;
  char text[DP_ABORT_MAX + 1];
  snprintf(text, sizeof text, "rank %u did not take part: %s", atomic_load(&dp->rank),
           why && *why ? why : "it failed before it could");
  /* The notices carry the last of the calls: a peer fails at any of them. */
  uint64_t last = g->call + (calls > 1 ? calls - 1 : 0);
  dp__failed_call_add(dp, g, last, text);
  /* Links a sender keeps to us: a group's, or a recv's from its one peer
   * (its secret tells that direction from the peer's sends the other way;
   * a send's peer sends nothing to us for it). */
  if (what != DP_REFUSE_SEND)
    dp__abort_untaken(dp, g->comm_id, last, group ? DP_ANY_PEER : g->ranks[0],
                      group ? NULL : g->secret, text);
  call_t cl = {.dp = dp, .what = name, .g = g,
               .gen = g->since ? *g->since : atomic_load(&dp->gen), .comm_id = g->comm_id,
               .call = g->call, .secret = g->secret, .refusal = true};
  /* Registered as a call, so that the comm's drop (the session ended) ends
   * its dials as it ends a call's; hellos still get the record's answer
   * (conn.c). */
  uint64_t reg = 0;
  dp__register(dp, &cl, &reg, NULL); /* out of memory: its dials end only at the deadline */
  notice_t nt = {.dp = dp, .g = g, .cl = &cl, .group = group, .last = last, .text = text,
                 .deadline = dp__now_ms() + dp__timeout(dp, g)};
  pthread_mutex_init(&nt.mu, NULL);
  /* A recv's peer only ever dials us: the record and its link tell it. */
  if (what != DP_REFUSE_RECV) {
    pthread_t th[REFUSE_THREADS];
    size_t nth = 0, want = g->n - (group ? 1 : 0);
    while (nth + 1 < want && nth < REFUSE_THREADS && pthread_create(&th[nth], NULL, tell_main, &nt) == 0)
      nth++;
    tell_main(&nt);
    for (size_t i = 0; i < nth; i++) pthread_join(th[i], NULL);
  }
  pthread_mutex_destroy(&nt.mu);
  dp__unregister(dp, reg);
  atomic_fetch_add(&dp->aborts[DP_ABORT_REFUSED], 1);
  dp__call_leave(dp);
  if (nt.err.kind == ERR_NONE) return 0;
  if (err) *err = nt.err;
  return -1;
}

/* ------------------------------------------------------------------ watches */

struct dp_watch {
  call_t cl;       /* registered: members' hellos for the comm are admitted */
  uint64_t reg;
  int64_t next_ms; /* dp_watch_fired looks again from then on */
};

dp_watch_t *dp_watch_begin(dataplane_t *dp, const dp_group_t *g) {
  if (!dp || !g || !g->ranks || !g->secret || g->n == 0) return NULL;
  dp_watch_t *w = calloc(1, sizeof *w);
  if (!w) return NULL;
  w->cl = (call_t){.dp = dp, .what = "watch", .g = g, .gen = atomic_load(&dp->gen),
                   .comm_id = g->comm_id, .call = g->call, .secret = g->secret};
  if (dp__register(dp, &w->cl, &w->reg, NULL) != 0) {
    free(w);
    return NULL;
  }
  return w;
}

bool dp_watch_fired(dataplane_t *dp, dp_watch_t *w, char *why, size_t len) {
  if (!w) return false;
  /* Its session ended here (dataplane_end_comm; or another instruction of it
   * failed midway, dataplane_drop_comm): the wait outside the data plane ends
   * now, as a call on the comm does, not at the comm timeout. */
  if (atomic_load(&w->cl.dropped)) {
    snprintf(why, len, "the channel was closed on this agent (its session ended here, or another "
                       "of the session's instructions failed midway on it)");
    return true;
  }
  int64_t now = dp__now_ms();
  if (now < w->next_ms) return false;
  w->next_ms = now + 1;
  return dp__abort_pending(dp, &w->cl, why, len);
}

void dp_watch_end(dataplane_t *dp, dp_watch_t *w) {
  if (!w) return;
  dp__unregister(dp, w->reg);
  free(w);
}
