/* The agents' TCP transport (dataplane.h): connections.
 *
 * One TCP connection per (comm_id, ordered pair of agents), used in one
 * direction: the sender dials the receiver's data port, and the two prove the
 * group's secret to each other (wire.h: the receiver's challenge, the
 * sender's hello {to_rank, from_rank, comm_id, mac}, the receiver's ack); the
 * receiver's listener thread files the accepted socket under (comm_id,
 * from_rank, secret). So nobody has to decide who dials, two agents never race
 * to build the same link, and a ring step (send to next, receive from
 * previous) touches two sockets that are each driven in one direction. Both
 * ends cache their connection; after the handshake the only bytes that travel
 * "backwards" are an abort notice (transfer.c).
 *
 * Admission. The listener checks a hello against the groups of the calls in
 * progress here (dp__register). A hello for a call that has not started here
 * yet is held, unanswered, until it starts (the dialer waits for the ack), for
 * at most timeout_ms. A wrong mac, a malformed hello, a silent socket past
 * DP_HELLO_MS, or, past the cap on unproven sockets (DP_UNPROVEN_MAX) or out
 * of descriptors, one that made room for a newcomer (a silent one first:
 * dp_internal.h) is closed, counted by reason and logged (rate-limited); no byte after the hello
 * is ever read from it. Everything it sends before its ack, a member's dialer
 * treats as "dial again", so a stranger that crowds the listener delays a
 * member by a redial at most. That cap bounds what strangers hold, so it
 * cannot grow with a group: a collective that fans in (a gather's root, a
 * direct exchange) has every other member dial a late member at once, and
 * past the cap they would be closed and redial, again and again, until it
 * starts. A group whose call is known to be coming (dataplane_expect: its
 * instruction is queued here) lets its members' early hellos be proven
 * against its secret on arrival: those are held apart, at most one per
 * member of each known group, and strangers, who cannot prove a secret,
 * never reach them. A hello for a call that failed or was refused
 * here (failed_call_t), while no call of its comm runs, is acked and answered
 * at once with that call's abort instead of being held.
 *
 * Same host. Every data plane also listens on the abstract unix socket
 * "@meshd-dp:PORT" (PORT its TCP port). A dialer whose peer's address is its
 * own (a loopback address or one of its interfaces') dials that socket
 * instead, with the same handshake; anything short of an ack there (no such
 * socket, another agent behind the name) and it dials TCP as always. Such a
 * connection is `local`: it carries frames like TCP and can also pass memfds
 * (shm.c). A socket whose listener runs as another user is not dialed (anyone
 * on the host can bind a name first). Abstract sockets live in the network namespace, as the addresses
 * do, so "this address is mine" and "that socket is reachable" agree. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/sockios.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <openssl/rand.h>

#include "dp_internal.h"
#include "log.h"

/* An accepted socket not proven yet: reading its hello, or (parked) holding a
 * complete one for a call that has not registered here yet. Owned by the
 * listener thread. */
typedef struct pending {
  int fd;
  bool parked;
  size_t got;
  int64_t deadline; /* reading: DP_HELLO_MS after accept; parked: timeout_ms after */
  int64_t accepted;
  uint64_t seq; /* accept order */
  bool local; /* came in on the unix socket */
  bool proven; /* parked, proven for a known group: outside the cap (dp->held) */
  /* On which of the listener's lists (listener_t) it is, and its links there. */
  bool on[4];
  struct pending *prev[4], *next[4];
  uint8_t nonce[DP_NONCE_LEN];
  uint8_t hello[DP_HELLO_LEN];
  char from[64]; /* the peer's address, for the log */
} pending_t;

typedef struct scratch {
  struct scratch *next;
  size_t cap;
  uint8_t data[];
} scratch_t;

/* Ring scratch segments kept for the next ring (a fresh buffer's pages cost
 * a fault each): at most SCRATCH_KEEP, none over SCRATCH_KEEP_BYTES. A big
 * ring's segment (half a 1 GiB tensor over two members) is freed when its
 * call ends rather than held, outside --memory-bytes, for good. */
#define SCRATCH_KEEP 4
#define SCRATCH_KEEP_BYTES ((size_t)16 << 20)

uint8_t *dp__scratch_get(dataplane_t *dp, size_t bytes) {
  pthread_mutex_lock(&dp->mu);
  scratch_t *s = dp->spare;
  if (s) {
    dp->spare = s->next;
    dp->nspare--;
  }
  pthread_mutex_unlock(&dp->mu);
  if (s && s->cap < bytes) {
    free(s);
    s = NULL;
  }
  if (!s && (s = malloc(sizeof *s + bytes))) s->cap = bytes;
  return s ? s->data : NULL;
}

void dp__scratch_put(dataplane_t *dp, uint8_t *data) {
  if (!data) return;
  scratch_t *s = (scratch_t *)(data - offsetof(scratch_t, data));
  pthread_mutex_lock(&dp->mu);
  if (dp->nspare < SCRATCH_KEEP && s->cap <= SCRATCH_KEEP_BYTES) {
    s->next = dp->spare;
    dp->spare = s;
    dp->nspare++;
    s = NULL;
  }
  pthread_mutex_unlock(&dp->mu);
  free(s);
}

size_t dataplane_scratch_bytes(dataplane_t *dp) {
  size_t n = 0;
  if (!dp) return 0;
  pthread_mutex_lock(&dp->mu);
  for (scratch_t *s = dp->spare; s; s = s->next) n += s->cap;
  pthread_mutex_unlock(&dp->mu);
  return n;
}

static void wake_listener(dataplane_t *dp);

/* Closes fd, one of the data plane's descriptors: a listener out of them
 * (accept_one) tries again now, not at the end of its back-off. */
static void close_ours(dataplane_t *dp, int fd) {
  close(fd);
  atomic_fetch_add(&dp->fds_closed, 1);
  if (atomic_exchange(&dp->accept_waits, false)) wake_listener(dp);
}

static void conn_put_locked(dataplane_t *dp, conn_t *c) {
  if (--c->refs > 0) return;
  close_ours(dp, c->fd);
  if (c->held_rfd > 0) close_ours(dp, c->held_rfd - 1);
  free(c);
}

void dp__conn_put(dataplane_t *dp, conn_t *c) {
  if (!c) return;
  pthread_mutex_lock(&dp->mu);
  c->used_ms = dp__now_ms();
  conn_put_locked(dp, c);
  pthread_mutex_unlock(&dp->mu);
}

bool dp__conn_busy(dataplane_t *dp, const conn_t *c) {
  pthread_mutex_lock(&dp->mu);
  bool busy = c->refs > (c->linked ? 2 : 1);
  pthread_mutex_unlock(&dp->mu);
  return busy;
}

/* Unlinks c from `list` and shuts its socket down, so a call still using it fails. */
static void conn_unlink_locked(dataplane_t *dp, conn_t **list, conn_t *c) {
  for (conn_t **p = list; *p; p = &(*p)->next) {
    if (*p == c) {
      *p = c->next;
      c->linked = false;
      /* Bytes the peer has not taken would hold our FIN back behind them, and a
       * peer that later looks at this link would think it alive: reset it. */
      int unsent = 0;
      if (ioctl(c->fd, SIOCOUTQ, &unsent) == 0 && unsent > 0) {
        struct linger lg = {.l_onoff = 1, .l_linger = 0};
        setsockopt(c->fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
      }
      shutdown(c->fd, SHUT_RDWR);
      conn_put_locked(dp, c);
      return;
    }
  }
}

void dp__drop_comm(dataplane_t *dp, uint64_t comm_id) {
  pthread_mutex_lock(&dp->mu);
  conn_t **lists[2] = {&dp->ins, &dp->outs};
  for (int l = 0; l < 2; l++) {
    conn_t *c = *lists[l];
    while (c) {
      conn_t *next = c->next;
      if (c->comm_id == comm_id) conn_unlink_locked(dp, lists[l], c);
      c = next;
    }
  }
  pthread_mutex_unlock(&dp->mu);
}

/* The call an accepted link serves next, as far as this agent knows: that of
 * the next frame waiting on it (a header held by a call that fell behind, or
 * the first in the socket), else the latest known on it (last_call). Under
 * mu, on a link no call holds. */
static uint64_t next_call_locked(const conn_t *c) {
  uint8_t hdr[DP_HDR_LEN];
  if (c->held_len == DP_HDR_LEN) return dp__get64(c->held_hdr + 16);
  if (!c->skip_left && !c->held_len &&
      recv(c->fd, hdr, sizeof hdr, MSG_PEEK | MSG_DONTWAIT) == (ssize_t)sizeof hdr)
    return dp__get64(hdr + 16);
  return c->last_call;
}

void dp__abort_untaken(dataplane_t *dp, uint64_t comm_id, uint64_t call, uint32_t peer,
                       const uint8_t *secret, const char *why) {
  uint8_t frame[DP_HDR_LEN + DP_ABORT_MAX];
  size_t len = dp_wire_abort(frame, comm_id, call, why);
  pthread_mutex_lock(&dp->mu);
  for (conn_t *c = dp->ins, *next; c; c = next) {
    next = c->next;
    if (c->comm_id != comm_id || c->refs > 1 || (peer != DP_ANY_PEER && c->peer != peer) ||
        (secret && memcmp(c->secret, secret, DP_SECRET_LEN) != 0))
      continue;
    if (next_call_locked(c) > call) continue; /* a later call's */
    /* We only ever write aborts on a connection we receive on: safe at any
     * time. The link stays: frames of a later call its dialer may yet send
     * on it are read by our next call (this one's it skips). */
    ssize_t w = send(c->fd, frame, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)w;
    if (call == 0) /* unnumbered calls cannot tell them apart */
      conn_unlink_locked(dp, &dp->ins, c);
  }
  pthread_mutex_unlock(&dp->mu);
}

void dp__conn_discard(dataplane_t *dp, conn_t *c) {
  pthread_mutex_lock(&dp->mu);
  if (c->linked) { /* in one of the two tables; unlinking from the other is a no-op */
    conn_unlink_locked(dp, &dp->ins, c);
    if (c->linked) conn_unlink_locked(dp, &dp->outs, c);
  }
  pthread_mutex_unlock(&dp->mu);
}

int dp__call_enter(dataplane_t *dp, const char *what, meshd_error_t *err) {
  pthread_mutex_lock(&dp->mu);
  bool stopping = dp->stopping;
  if (!stopping) dp->active++;
  pthread_mutex_unlock(&dp->mu);
  if (stopping) return error_set(err, ERR_UNAVAILABLE, "%s: the data plane is stopping", what);
  return 0;
}

void dp__call_leave(dataplane_t *dp) {
  pthread_mutex_lock(&dp->mu);
  dp->active--;
  pthread_cond_broadcast(&dp->cv);
  pthread_mutex_unlock(&dp->mu);
}

bool dp__stopping(dataplane_t *dp) {
  pthread_mutex_lock(&dp->mu);
  bool s = dp->stopping;
  pthread_mutex_unlock(&dp->mu);
  return s;
}

/* ------------------------------------------------------------------ dialing */

static int split_addr(const char *addr, char *host, size_t hostlen, char *port, size_t portlen) {
  const char *colon = addr ? strrchr(addr, ':') : NULL;
  if (!colon || colon == addr || !colon[1]) return -1;
  const char *h = addr;
  size_t hl = (size_t)(colon - addr);
  if (h[0] == '[' && hl >= 2 && h[hl - 1] == ']') {
    h++;
    hl -= 2;
  }
  if (hl >= hostlen || strlen(colon + 1) >= portlen) return -1;
  memcpy(host, h, hl);
  host[hl] = '\0';
  strcpy(port, colon + 1);
  return 0;
}

/* ----------------------------------------------------------- lost peers */

static int check_lost_locked(dataplane_t *dp, const call_t *cl, meshd_error_t *err) {
  if (cl && atomic_load(&cl->dropped))
    return error_set(err, ERR_REMOTE_FAILURE,
                     "%s on comm %llu: the channel was closed on this agent while the call ran "
                     "(its session ended here, or another of the session's instructions failed "
                     "midway on it)",
                     cl->what, (unsigned long long)cl->comm_id);
  uint64_t gen = atomic_load(&dp->gen);
  if (!cl || !cl->g || gen == cl->gen) return 0;
  /* Every peer declared since the call began (one entry per address: a
   * loss declared again, once per session, does not push another out). */
  for (size_t k = 0; k < DP_DEAD_MAX; k++) {
    const dead_peer_t *d = &dp->dead[k];
    if (d->gen <= cl->gen) continue;
    for (size_t i = 0; i < cl->g->n; i++) {
      if (i == cl->g->me && cl->g->n > 1) continue;
      if (!cl->g->addrs[i] || strcmp(cl->g->addrs[i], d->addr) != 0) continue;
      return error_set(err, ERR_AGENT_LOST, "%s on comm %llu: rank %u at %s was lost (%s)",
                       cl->what, (unsigned long long)cl->comm_id, d->rank, d->addr, d->why);
    }
  }
  return 0;
}

int dp__check_lost(dataplane_t *dp, const call_t *cl, meshd_error_t *err) {
  if (!cl || !cl->g || (atomic_load(&dp->gen) == cl->gen && !atomic_load(&cl->dropped))) return 0;
  pthread_mutex_lock(&dp->mu);
  int rc = check_lost_locked(dp, cl, err);
  pthread_mutex_unlock(&dp->mu);
  return rc;
}

void dataplane_peer_lost(dataplane_t *dp, const char *addr, uint32_t rank, const char *why) {
  if (!dp || !addr || !*addr) return;
  pthread_mutex_lock(&dp->mu);
  uint64_t gen = atomic_load(&dp->gen);
  /* Its entry if it was declared before (PeerLost comes once per session
   * with work on it), else the oldest one's. */
  dead_peer_t *d = &dp->dead[0];
  for (size_t k = 0; k < DP_DEAD_MAX; k++) {
    if (dp->dead[k].gen && strcmp(dp->dead[k].addr, addr) == 0) {
      d = &dp->dead[k];
      break;
    }
    if (dp->dead[k].gen < d->gen) d = &dp->dead[k];
  }
  d->gen = gen + 1;
  d->rank = rank;
  snprintf(d->addr, sizeof d->addr, "%s", addr);
  snprintf(d->why, sizeof d->why, "%s", why && *why ? why : "declared lost by the server");
  atomic_store(&dp->gen, gen + 1);
  /* Its connections are of no use any more: calls blocked on them wake. */
  conn_t **lists[2] = {&dp->ins, &dp->outs};
  for (int l = 0; l < 2; l++)
    for (conn_t *c = *lists[l], *next; c; c = next) {
      next = c->next;
      if (strcmp(c->addr, addr) == 0) conn_unlink_locked(dp, lists[l], c);
    }
  pthread_cond_broadcast(&dp->cv);
  pthread_mutex_unlock(&dp->mu);
  log_info("dataplane", "rank %u at %s declared lost: %s", rank, addr, why ? why : "");
}

uint64_t dataplane_generation(dataplane_t *dp) { return dp ? atomic_load(&dp->gen) : 0; }

bool dp__abort_pending(dataplane_t *dp, const call_t *cl, char *why, size_t len) {
  bool found = false;
  pthread_mutex_lock(&dp->mu);
  for (conn_t *c = dp->ins; c && !found; c = c->next) {
    if (c->comm_id != cl->comm_id || c->refs > 1 || c->held_len || c->skip_left ||
        memcmp(c->secret, dp__link_secret(cl, c->peer), DP_SECRET_LEN) != 0)
      continue;
    uint8_t buf[DP_HDR_LEN + DP_ABORT_MAX];
    ssize_t r = recv(c->fd, buf, sizeof buf, MSG_PEEK | MSG_DONTWAIT);
    if (r < DP_HDR_LEN || dp__get32(buf) != DP_MAGIC_ABORT || dp__get64(buf + 16) < cl->call)
      continue;
    size_t n = dp__min(dp__min(dp__get32(buf + 4), DP_ABORT_MAX), (size_t)r - DP_HDR_LEN);
    snprintf(why, len, "rank %u aborted: %.*s", c->peer, (int)n, (const char *)buf + DP_HDR_LEN);
    found = true;
  }
  pthread_mutex_unlock(&dp->mu);
  return found;
}

bool dp__declared_lost(dataplane_t *dp, const char *addr) {
  bool lost = false;
  pthread_mutex_lock(&dp->mu);
  for (size_t k = 0; k < DP_DEAD_MAX && !lost; k++)
    lost = dp->dead[k].gen && strcmp(dp->dead[k].addr, addr) == 0;
  pthread_mutex_unlock(&dp->mu);
  return lost;
}

bool dp__superseded(dataplane_t *dp, const conn_t *c) {
  bool newer = false;
  pthread_mutex_lock(&dp->mu);
  for (conn_t *o = dp->ins; o && !newer; o = o->next)
    newer = o != c && o->comm_id == c->comm_id && o->peer == c->peer &&
            memcmp(o->secret, c->secret, DP_SECRET_LEN) == 0;
  pthread_mutex_unlock(&dp->mu);
  return newer;
}

/* Groups whose call is coming (dataplane_expect, below). */
static void known_free(known_group_t *k) {
  free(k->ranks);
  free(k->member_secrets);
}

static bool known_is(const known_group_t *k, const known_group_t *o) {
  return k->comm_id == o->comm_id && k->n == o->n &&
         memcmp(k->secret, o->secret, DP_SECRET_LEN) == 0 &&
         memcmp(k->ranks, o->ranks, k->n * sizeof *k->ranks) == 0 &&
         !k->member_secrets == !o->member_secrets &&
         (!k->member_secrets ||
          memcmp(k->member_secrets, o->member_secrets, k->n * DP_SECRET_LEN) == 0);
}

/* Drops known[i] (freed), keeping the others oldest first. Under mu. */
static void known_drop_locked(dataplane_t *dp, size_t i) {
  known_free(&dp->known[i]);
  memmove(&dp->known[i], &dp->known[i + 1], (dp->nknown - i - 1) * sizeof dp->known[0]);
  dp->nknown--;
}

/* The groups of comm_id are not coming any more (its session ended). Under mu. */
static void known_forget_locked(dataplane_t *dp, uint64_t comm_id) {
  for (size_t i = 0; i < dp->nknown;)
    if (dp->known[i].comm_id == comm_id) known_drop_locked(dp, i);
    else i++;
}

void dataplane_drop_link(dataplane_t *dp, uint64_t comm_id, uint32_t peer, bool outgoing) {
  if (!dp) return;
  pthread_mutex_lock(&dp->mu);
  conn_t **list = outgoing ? &dp->outs : &dp->ins;
  for (conn_t *c = *list, *next; c; c = next) {
    next = c->next;
    if (c->comm_id == comm_id && c->peer == peer) conn_unlink_locked(dp, list, c);
  }
  pthread_mutex_unlock(&dp->mu);
}

void dataplane_drop_comm(dataplane_t *dp, uint64_t comm_id) {
  if (!dp) return;
  /* Calls in progress on it fail, even one still waiting to connect. */
  pthread_mutex_lock(&dp->mu);
  for (size_t i = 0; i < dp->nregs; i++)
    if (dp->regs[i].comm_id == comm_id) atomic_store(&dp->reg_calls[i]->dropped, true);
  pthread_cond_broadcast(&dp->cv);
  pthread_mutex_unlock(&dp->mu);
  dp__drop_comm(dp, comm_id);
}

void dataplane_end_comm(dataplane_t *dp, uint64_t comm_id) {
  if (!dp) return;
  pthread_mutex_lock(&dp->mu);
  if (dp->nended == dp->capended) {
    size_t cap = dp->capended ? 2 * dp->capended : 16;
    uint64_t *e = realloc(dp->ended, cap * sizeof *e);
    if (e) { /* else best effort: a late call waits out its timeout */
      dp->ended = e;
      dp->capended = cap;
    }
  }
  if (dp->nended < dp->capended) dp->ended[dp->nended++] = comm_id;
  known_forget_locked(dp, comm_id);
  pthread_mutex_unlock(&dp->mu);
  dataplane_drop_comm(dp, comm_id);
}

void dataplane_forget_comm(dataplane_t *dp, uint64_t comm_id) {
  if (!dp) return;
  pthread_mutex_lock(&dp->mu);
  for (size_t i = 0; i < dp->nended;) /* every copy (a session closed twice) */
    if (dp->ended[i] == comm_id) dp->ended[i] = dp->ended[--dp->nended];
    else i++;
  known_forget_locked(dp, comm_id);
  pthread_mutex_unlock(&dp->mu);
}

static void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* Writes all of buf on a non-blocking socket before `deadline`. */
static int write_all(dataplane_t *dp, int fd, const uint8_t *buf, size_t len, int64_t deadline) {
  while (len > 0) {
    ssize_t w = send(fd, buf, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      buf += w;
      len -= (size_t)w;
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return -1;
    int64_t left = deadline - dp__now_ms();
    if (left <= 0 || dp__stopping(dp)) {
      errno = ETIMEDOUT;
      return -1;
    }
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    poll(&p, 1, (int)dp__min((size_t)left, 200));
  }
  return 0;
}

/* Connects to addr, retrying refused connections (the peer may not listen
 * yet) until deadline if retry_refused. Every address the host resolves to is
 * tried in turn (a dual-stack name whose peer listens on one family only).
 * Returns a non-blocking socket, or -1 with `why` set. */
static int dial(dataplane_t *dp, const call_t *cl, const char *addr, int64_t deadline,
                bool retry_refused, char *why, size_t whylen) {
  meshd_error_t lost;
  char host[DP_ADDR_MAX], port[16];
  if (split_addr(addr, host, sizeof host, port, sizeof port) != 0) {
    snprintf(why, whylen, "address is not host:port");
    return -1;
  }
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
  struct addrinfo *ai = NULL;
  int gai = getaddrinfo(host, port, &hints, &ai);
  if (gai != 0) {
    snprintf(why, whylen, "cannot resolve: %s", gai_strerror(gai));
    return -1;
  }
  int fd = -1, last_errno = 0;
  int backoff = 10;
  const struct addrinfo *at = ai;
  for (;;) {
    /* Past the deadline no connection is made: one made now would be closed
     * before its hello, which the peer counts as a malformed stranger. */
    if (deadline - dp__now_ms() <= 0) {
      last_errno = ETIMEDOUT;
      break;
    }
    fd = socket(at->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0 && at->ai_next) { /* a family this host lacks: the next address */
      last_errno = errno;
      at = at->ai_next;
      continue;
    }
    if (fd < 0) {
      last_errno = errno;
      break;
    }
    int rc = connect(fd, at->ai_addr, at->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      for (;;) {
        int64_t left = deadline - dp__now_ms();
        if (left <= 0 || dp__stopping(dp) || dp__check_lost(dp, cl, &lost)) {
          errno = ETIMEDOUT;
          break;
        }
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        int n = poll(&p, 1, (int)dp__min((size_t)left, 200));
        if (n > 0) {
          int soerr = 0;
          socklen_t sl = sizeof soerr;
          getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
          errno = soerr;
          rc = soerr == 0 ? 0 : -1;
          break;
        }
      }
    }
    if (rc == 0) break;
    last_errno = errno;
    close_ours(dp, fd);
    fd = -1;
    int64_t left = deadline - dp__now_ms();
    if (left <= 0 || dp__stopping(dp) || last_errno == ETIMEDOUT) break;
    if (at->ai_next) { /* the host's next address, at once */
      at = at->ai_next;
      continue;
    }
    at = ai;
    if (!retry_refused && last_errno == ECONNREFUSED) break;
    if (dp__check_lost(dp, cl, &lost)) break; /* the caller reports it */
    struct timespec ts = {0, (long)dp__min((size_t)backoff, (size_t)left) * 1000000L};
    nanosleep(&ts, NULL);
    if (backoff < 200) backoff *= 2;
  }
  freeaddrinfo(ai);
  if (fd < 0) {
    snprintf(why, whylen, "cannot connect: %s", strerror(last_errno ? last_errno : ETIMEDOUT));
    return -1;
  }
  set_nodelay(fd);
  return fd;
}

/* A dialed connection only ever receives an abort notice or EOF: readable means dead. */
static bool out_alive(const conn_t *c) {
  struct pollfd p = {.fd = c->fd, .events = POLLIN};
  return poll(&p, 1, 0) == 0;
}

/* An accepted connection is dead when its dialer hung up and nothing but a
 * goodbye is left to read: frames still unread (a send that ended before the
 * dialer closed the link idle; an older call's frames or abort, which the
 * next call skips) still belong to a call here. Under mu. */
static bool in_empty(const conn_t *c) {
  int avail = 0;
  return !c->held_len && !c->skip_left && (ioctl(c->fd, FIONREAD, &avail) != 0 || avail <= 0);
}

static bool in_dead(const conn_t *c, uint64_t call) {
  struct pollfd p = {.fd = c->fd, .events = POLLIN | POLLRDHUP};
  if (poll(&p, 1, 0) <= 0 || !(p.revents & (POLLRDHUP | POLLHUP | POLLERR))) return false;
  if ((p.revents & POLLERR) || in_empty(c)) return true;
  if (c->held_len || c->skip_left) return false;
  /* A goodbye, or an abort of a call older than `call` (a dialer's last
   * frame, ending a call the taker is past), is all that is left to read. */
  uint8_t hdr[DP_HDR_LEN];
  ssize_t r = recv(c->fd, hdr, sizeof hdr, MSG_PEEK | MSG_DONTWAIT);
  return r == (ssize_t)sizeof hdr &&
         (dp__get32(hdr) == DP_MAGIC_BYE ||
          (dp__get32(hdr) == DP_MAGIC_ABORT && dp__get64(hdr + 16) < call));
}

/* A dialed link on which the peer wrote aborts of calls older than `call`
 * (it failed them; the link stays open, dp__abort_untaken): read and
 * dropped, so that the link serves this call. Whether any was. Under mu, on a
 * link no call holds. */
static bool consume_stale_aborts(conn_t *c, uint64_t call) {
  bool any = false;
  for (;;) {
    uint8_t hdr[DP_HDR_LEN + DP_ABORT_MAX];
    if (recv(c->fd, hdr, DP_HDR_LEN, MSG_PEEK | MSG_DONTWAIT) != DP_HDR_LEN ||
        dp__get32(hdr) != DP_MAGIC_ABORT || dp__get64(hdr + 16) >= call)
      return any;
    size_t len = DP_HDR_LEN + dp__min(dp__get32(hdr + 4), DP_ABORT_MAX);
    if (recv(c->fd, hdr, len, MSG_PEEK | MSG_DONTWAIT) != (ssize_t)len) return any; /* not all here */
    if (recv(c->fd, hdr, len, MSG_DONTWAIT) != (ssize_t)len) return any;
    any = true;
  }
}

/* Past the cap (dataplane_max_links): closes idle dialed connections whose
 * peer hung up, then the least recently used idle ones, each after a goodbye
 * frame (at a frame boundary: idle) and a clean FIN, so that a receiver that
 * took it for a call dials us back in, rather than failing. */
static void trim_outs_locked(dataplane_t *dp) {
  size_t n = 0;
  for (conn_t *c = dp->outs; c; c = c->next) n++;
  if (n <= dp->max_outs) return;
  for (conn_t **p = &dp->outs; *p;) {
    conn_t *c = *p;
    struct pollfd pf = {.fd = c->fd, .events = POLLRDHUP};
    bool hung = poll(&pf, 1, 0) > 0 && (pf.revents & (POLLRDHUP | POLLHUP | POLLERR));
    if (c->refs > 1 || !hung) { /* an older call's abort alone: the link serves on */
      p = &c->next;
      continue;
    }
    *p = c->next;
    c->linked = false;
    conn_put_locked(dp, c);
    n--;
  }
  while (n > dp->max_outs) {
    conn_t **lru = NULL;
    for (conn_t **p = &dp->outs; *p; p = &(*p)->next) {
      int unsent = 0; /* bytes the peer has not taken: it still reads this link */
      if ((*p)->refs == 1 && (!lru || (*p)->used_ms < (*lru)->used_ms) &&
          ioctl((*p)->fd, SIOCOUTQ, &unsent) == 0 && unsent == 0)
        lru = p;
    }
    if (!lru) return; /* every one is in use */
    conn_t *c = *lru;
    *lru = c->next;
    c->linked = false;
    uint8_t bye[DP_HDR_LEN];
    dp_wire_frame(bye, DP_MAGIC_BYE, 0, c->comm_id, 0, c->seq);
    ssize_t w = send(c->fd, bye, sizeof bye, MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)w;
    shutdown(c->fd, SHUT_WR);
    conn_put_locked(dp, c);
    n--;
  }
}

/* Accepted connections no call holds whose peer hung up (it closed them idle,
 * or its session ended): closed, so they hold no descriptor until a call of
 * their comm looks. */
static void sweep_ins_locked(dataplane_t *dp) {
  for (conn_t **p = &dp->ins; *p;) {
    conn_t *c = *p;
    if (c->refs > 1 || !in_dead(c, 0)) {
      p = &c->next;
      continue;
    }
    *p = c->next;
    c->linked = false;
    conn_put_locked(dp, c);
  }
}

void dataplane_max_links(dataplane_t *dp, size_t n) {
  if (dp) dp->max_outs = n > 0 ? n : 1;
}

size_t dataplane_links(dataplane_t *dp) {
  size_t n = 0;
  if (!dp) return 0;
  pthread_mutex_lock(&dp->mu);
  for (conn_t *c = dp->outs; c; c = c->next) n++;
  for (conn_t *c = dp->ins; c; c = c->next) n++;
  pthread_mutex_unlock(&dp->mu);
  return n;
}


/* Reads exactly len bytes before deadline. 0; or -1 with errno ECONNRESET
 * (the peer closed it), ETIMEDOUT (deadline or stopping), ECANCELED (a member
 * of cl was declared lost). */
static int read_exact(dataplane_t *dp, const call_t *cl, int fd, uint8_t *buf, size_t len,
                      int64_t deadline) {
  meshd_error_t lost;
  size_t got = 0;
  while (got < len) {
    ssize_t r = recv(fd, buf + got, len - got, MSG_DONTWAIT);
    if (r > 0) {
      got += (size_t)r;
      continue;
    }
    if (r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      errno = ECONNRESET;
      return -1;
    }
    if (dp__check_lost(dp, cl, &lost)) {
      errno = ECANCELED;
      return -1;
    }
    int64_t left = deadline - dp__now_ms();
    if (left <= 0 || dp__stopping(dp)) {
      errno = ETIMEDOUT;
      return -1;
    }
    struct pollfd p = {.fd = fd, .events = POLLIN};
    poll(&p, 1, (int)dp__min((size_t)left, 200));
  }
  return 0;
}

/* The dialer's side of the handshake (wire.h) on a fresh connection to `peer`:
 * 0 once both sides proved cl's secret; 1 when the peer closed it before its
 * ack (dial again); -1 otherwise. why: what went wrong, to follow "rank R at
 * ADDR". */
static int handshake(dataplane_t *dp, const call_t *cl, int fd, uint32_t peer, int64_t deadline,
                     char *why, size_t whylen) {
  uint8_t challenge[DP_CHALLENGE_LEN], nonce_a[DP_NONCE_LEN], nonce_d[DP_NONCE_LEN];
  uint8_t hello[DP_HELLO_LEN], ack[DP_ACK_LEN];
  char bad[160];
  const char *step = "challenge";
  if (read_exact(dp, cl, fd, challenge, sizeof challenge, deadline) != 0) goto io;
  if (dp_wire_parse_challenge(challenge, sizeof challenge, nonce_a, bad, sizeof bad) != DP_PARSE_OK) {
    snprintf(why, whylen, "is not a data plane of this version: %s", bad);
    return -1;
  }
  if (RAND_bytes(nonce_d, sizeof nonce_d) != 1) {
    snprintf(why, whylen, "was not dialed: no randomness for a nonce");
    return -1;
  }
  const uint8_t *secret = dp__link_secret(cl, peer);
  dp_wire_hello(hello, peer, dp->rank, cl->comm_id, cl->call, nonce_d, nonce_a, secret);
  if (write_all(dp, fd, hello, sizeof hello, deadline) != 0) {
    if (errno == ETIMEDOUT) {
      snprintf(why, whylen, "did not take our hello: %s", strerror(errno));
      return -1;
    }
    errno = ECONNRESET;
    step = "hello";
    goto io;
  }
  step = "ack";
  if (read_exact(dp, cl, fd, ack, sizeof ack, deadline) != 0) goto io;
  if (!dp_wire_ack_proves(ack, sizeof ack, hello, nonce_a, secret)) {
    snprintf(why, whylen,
             "answered our hello without proving the group's secret: it is not a member of comm "
             "%llu",
             (unsigned long long)cl->comm_id);
    return -1;
  }
  return 0;
io:
  if (errno == ECONNRESET) {
    snprintf(why, whylen,
             "closed our connection at its %s, before proving the group's secret (it admits "
             "only members of a call it runs: is it running this one, with the same secret?)",
             step);
    return 1;
  }
  if (errno == ECANCELED) {
    snprintf(why, whylen, "was declared lost");
    return -1;
  }
  snprintf(why, whylen,
           "did not admit our connection within %d ms (waiting for its %s; is it running this "
           "call?)",
           dp__timeout(dp, cl ? cl->g : NULL), step);
  return -1;
}

/* The abstract unix socket of the data plane whose TCP port is `port`. */
static socklen_t local_name(struct sockaddr_un *sa, int port) {
  memset(sa, 0, sizeof *sa);
  sa->sun_family = AF_UNIX;
  int n = snprintf(sa->sun_path + 1, sizeof sa->sun_path - 1, "meshd-dp:%d", port);
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

static bool same_ip(const struct sockaddr *a, const struct sockaddr *b) {
  if (!a || !b || a->sa_family != b->sa_family) return false;
  if (a->sa_family == AF_INET)
    return ((const struct sockaddr_in *)a)->sin_addr.s_addr ==
           ((const struct sockaddr_in *)b)->sin_addr.s_addr;
  if (a->sa_family == AF_INET6)
    return memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr,
                  &((const struct sockaddr_in6 *)b)->sin6_addr, sizeof(struct in6_addr)) == 0;
  return false;
}

/* addr's port when its host is this host's (loopback, or an address of one
 * of our interfaces); -1 otherwise. */
static int local_port(const char *addr) {
  char host[DP_ADDR_MAX], port[16];
  if (split_addr(addr, host, sizeof host, port, sizeof port) != 0) return -1;
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                           .ai_flags = AI_NUMERICSERV};
  struct addrinfo *ai = NULL;
  if (getaddrinfo(host, port, &hints, &ai) != 0) return -1;
  bool mine = false;
  struct ifaddrs *ifs = NULL;
  for (struct addrinfo *a = ai; a && !mine; a = a->ai_next) {
    if (a->ai_family == AF_INET)
      mine = (ntohl(((struct sockaddr_in *)a->ai_addr)->sin_addr.s_addr) >> 24) == 127;
    else if (a->ai_family == AF_INET6)
      mine = IN6_IS_ADDR_LOOPBACK(&((struct sockaddr_in6 *)a->ai_addr)->sin6_addr);
    if (!mine && (ifs || getifaddrs(&ifs) == 0))
      for (struct ifaddrs *i = ifs; i && !mine; i = i->ifa_next) mine = same_ip(i->ifa_addr, a->ai_addr);
  }
  int p = mine ? atoi(port) : -1;
  if (ifs) freeifaddrs(ifs);
  freeaddrinfo(ai);
  return p > 0 && p < 65536 ? p : -1;
}

/* A connected unix socket to the same-host peer at addr, or -1. Only a
 * listener of our own user counts: anyone on the host may bind an abstract
 * name first, and one of another user must not stand between two agents
 * (nor fail their call): then TCP. */
static int dial_local(const char *addr) {
  int port = local_port(addr);
  if (port < 0) return -1;
  struct sockaddr_un sa;
  socklen_t len = local_name(&sa, port);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  struct ucred cr;
  socklen_t crlen = sizeof cr;
  if (fd >= 0 && (connect(fd, (struct sockaddr *)&sa, len) != 0 ||
                  getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &crlen) != 0 ||
                  cr.uid != geteuid())) {
    close(fd);
    fd = -1;
  }
  return fd;
}

conn_t *dp__get_out(dataplane_t *dp, const call_t *cl, uint32_t peer, const char *addr,
                    int64_t deadline, meshd_error_t *err) {
  const char *what = cl->what;
  uint64_t comm_id = cl->comm_id;
  pthread_mutex_lock(&dp->mu);
  for (conn_t *c = dp->outs; c; c = c->next) {
    if (c->comm_id != comm_id || c->peer != peer) continue;
    /* A kept link the peer closed after an abort of this call (it gave up on
     * us): taken all the same, so that the call fails at once on it with the
     * peer's root cause (transfer.c), instead of dialing a peer that no
     * longer runs this call. */
    uint8_t hdr[DP_HDR_LEN];
    bool alive = out_alive(c) || (consume_stale_aborts(c, cl->call) && out_alive(c));
    bool aborted = !alive && cl->call > 0 && /* unnumbered calls cannot tell */
                   recv(c->fd, hdr, sizeof hdr, MSG_PEEK | MSG_DONTWAIT) == DP_HDR_LEN &&
                   dp__get32(hdr) == DP_MAGIC_ABORT && dp__get64(hdr + 16) >= cl->call;
    if ((alive || aborted) && strcmp(c->addr, addr) == 0 &&
        memcmp(c->secret, dp__link_secret(cl, peer), DP_SECRET_LEN) == 0) {
      c->refs++;
      c->used_ms = dp__now_ms();
      pthread_mutex_unlock(&dp->mu);
      return c;
    }
    conn_unlink_locked(dp, &dp->outs, c);
    break;
  }
  pthread_mutex_unlock(&dp->mu);

  char why[200];
  int fd = dp->same_host ? dial_local(addr) : -1, backoff = 10;
  bool local = fd >= 0, redial = false;
  int hs = local ? handshake(dp, cl, fd, peer, deadline, why, sizeof why) : 0;
  if (hs != 0) {
    close_ours(dp, fd);
    fd = -1;
    local = false;
    if (dp__check_lost(dp, cl, err)) return NULL;
    if (dp__stopping(dp)) goto stopping;
    if (hs < 0 || deadline - dp__now_ms() <= 0) { /* refused, or no time left for TCP */
      error_set(err, ERR_REMOTE_FAILURE, "%s on comm %llu: rank %u at %s %s", what,
                (unsigned long long)comm_id, peer, addr, why);
      return NULL;
    }
    /* Closed unproven: crowded out, stopping, or another agent behind the
     * name. TCP, as a redial: a refusal there means the peer has stopped. */
    redial = true;
    struct timespec ts = {0, (long)backoff * 1000000L};
    nanosleep(&ts, NULL);
    backoff *= 2;
  }
  for (; !local; redial = true) {
    /* A peer that closed us unproven, then refuses us, has stopped. */
    fd = dial(dp, cl, addr, deadline, !redial, why, sizeof why);
    if (fd < 0 && dp__check_lost(dp, cl, err)) return NULL;
    if (fd < 0 && dp__stopping(dp)) goto stopping;
    if (fd < 0) {
      error_set(err, ERR_REMOTE_FAILURE, "%s on comm %llu: rank %u at %s is unreachable%s: %s",
                what, (unsigned long long)comm_id, peer, addr,
                redial ? " (it closed our connection, then stopped listening)" : "", why);
      return NULL;
    }
    hs = handshake(dp, cl, fd, peer, deadline, why, sizeof why);
    if (hs == 0) break;
    close_ours(dp, fd);
    if (dp__check_lost(dp, cl, err)) return NULL;
    if (dp__stopping(dp)) goto stopping;
    int64_t left = deadline - dp__now_ms();
    if (hs < 0 || left <= 0) {
      error_set(err, ERR_REMOTE_FAILURE, "%s on comm %llu: rank %u at %s %s", what,
                (unsigned long long)comm_id, peer, addr, why);
      return NULL;
    }
    /* It closed us unproven: it may have been crowded by strangers. Again. */
    struct timespec ts = {0, (long)dp__min((size_t)backoff, (size_t)left) * 1000000L};
    nanosleep(&ts, NULL);
    if (backoff < 200) backoff *= 2;
  }
  conn_t *c = calloc(1, sizeof *c);
  if (!c) {
    close_ours(dp, fd);
    error_set(err, ERR_QUOTA, "%s: out of memory", what);
    return NULL;
  }
  c->fd = fd;
  c->refs = 2;
  c->local = local;
  c->linked = true;
  c->comm_id = comm_id;
  c->peer = peer;
  memcpy(c->secret, dp__link_secret(cl, peer), DP_SECRET_LEN);
  snprintf(c->addr, sizeof c->addr, "%s", addr);
  c->used_ms = dp__now_ms();
  pthread_mutex_lock(&dp->mu);
  c->next = dp->outs;
  dp->outs = c;
  trim_outs_locked(dp);
  pthread_mutex_unlock(&dp->mu);
  return c;
stopping:
  error_set(err, ERR_UNAVAILABLE, "%s on comm %llu: the data plane is stopping", what,
            (unsigned long long)comm_id);
  return NULL;
}

/* True when a peer wrote on one of the call's send connections: its abort
 * notice or EOF. Polled while waiting for receive connections, so a failure
 * elsewhere in the group reaches a member that is still waiting for a peer. */
static bool watch_fired(const conn_t *const *watch, size_t nwatch, size_t *which) {
  for (size_t i = 0; i < nwatch; i++) {
    if (!watch[i]) continue;
    struct pollfd p = {.fd = watch[i]->fd, .events = POLLIN};
    if (poll(&p, 1, 0) > 0) {
      *which = i;
      return true;
    }
  }
  return false;
}

/* Waits until `peer` has dialed us on comm_id (the listener files it), or one
 * of `watch` fires (*fired set to its index, NULL returned, err untouched). */
conn_t *dp__get_in(dataplane_t *dp, const call_t *cl, uint32_t peer, const char *addr,
                   int64_t deadline, const conn_t *const *watch, size_t nwatch, size_t *fired,
                   meshd_error_t *err) {
  const char *what = cl->what;
  uint64_t comm_id = cl->comm_id;
  pthread_mutex_lock(&dp->mu);
  for (;;) {
    if (dp->stopping) {
      pthread_mutex_unlock(&dp->mu);
      error_set(err, ERR_UNAVAILABLE, "%s: the data plane is stopping", what);
      return NULL;
    }
    if (check_lost_locked(dp, cl, err)) {
      pthread_mutex_unlock(&dp->mu);
      return NULL;
    }
    conn_t *c = dp->ins;
    while (c && (c->comm_id != comm_id || c->peer != peer ||
                 memcmp(c->secret, dp__link_secret(cl, peer), DP_SECRET_LEN) != 0))
      c = c->next;
    /* (An unnumbered call cannot tell an abort's call: any is dead.) */
    if (c && c->refs == 1 && in_dead(c, cl->call ? cl->call : UINT64_MAX)) {
      conn_unlink_locked(dp, &dp->ins, c);
      continue;
    }
    if (c) {
      c->refs++;
      snprintf(c->addr, sizeof c->addr, "%s", addr);
      pthread_mutex_unlock(&dp->mu);
      return c;
    }
    if (fired && watch_fired(watch, nwatch, fired)) {
      pthread_mutex_unlock(&dp->mu);
      return NULL;
    }
    int64_t left = deadline - dp__now_ms();
    if (left <= 0) break;
    if (nwatch > 0 && left > 50) left = 50;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t ns = ts.tv_nsec + (left % 1000) * 1000000;
    ts.tv_sec += left / 1000 + ns / 1000000000;
    ts.tv_nsec = ns % 1000000000;
    pthread_cond_timedwait(&dp->cv, &dp->mu, &ts);
  }
  pthread_mutex_unlock(&dp->mu);
  error_set(err, ERR_REMOTE_FAILURE,
            "%s on comm %llu: rank %u at %s did not connect within %d ms (is it running this "
            "collective?)",
            what, (unsigned long long)comm_id, peer, addr, dp__timeout(dp, cl->g));
  return NULL;
}

/* --------------------------------------------------------- registrations */

/* The listener looks again at the hellos it holds (a call started, or one
 * was refused). */
static void wake_listener(dataplane_t *dp) {
  ssize_t w;
  do w = write(dp->wake[1], "r", 1);
  while (w < 0 && errno == EINTR);
}

int dp__register(dataplane_t *dp, call_t *cl, uint64_t *id, meshd_error_t *err) {
  *id = 0;
  pthread_mutex_lock(&dp->mu);
  if (dp->nregs == dp->capregs) {
    size_t cap = dp->capregs ? 2 * dp->capregs : 16;
    dp_wire_group_t *regs = realloc(dp->regs, cap * sizeof *regs);
    if (regs) dp->regs = regs;
    uint64_t *ids = regs ? realloc(dp->reg_ids, cap * sizeof *ids) : NULL;
    if (ids) dp->reg_ids = ids;
    call_t **calls = ids ? realloc(dp->reg_calls, cap * sizeof *calls) : NULL;
    if (calls) dp->reg_calls = calls;
    if (!regs || !ids || !calls) {
      pthread_mutex_unlock(&dp->mu);
      return error_set(err, ERR_QUOTA, "%s: out of memory", cl->what);
    }
    dp->capregs = cap;
  }
  dp->regs[dp->nregs] = (dp_wire_group_t){
      .comm_id = cl->comm_id, .ranks = cl->g->ranks, .n = cl->g->n,
      /* a refusal is registered for drops only: its hellos get the record's answer */
      .secret = cl->refusal ? NULL : cl->secret,
      .member_secrets = cl->refusal ? NULL : cl->g->pair_secrets, .call = cl->call};
  dp->reg_calls[dp->nregs] = cl;
  dp->reg_ids[dp->nregs++] = *id = ++dp->next_reg;
  for (size_t i = 0; i < dp->nended; i++) /* its session ended here: nobody comes */
    if (dp->ended[i] == cl->comm_id) atomic_store(&cl->dropped, true);
  bool wake = dp->parked > 0; /* the listener holds hellos: some may be this call's */
  pthread_mutex_unlock(&dp->mu);
  if (wake) wake_listener(dp);
  return 0;
}

void dp__unregister(dataplane_t *dp, uint64_t id) {
  if (id == 0) return;
  pthread_mutex_lock(&dp->mu);
  for (size_t i = 0; i < dp->nregs; i++) {
    if (dp->reg_ids[i] != id) continue;
    dp->regs[i] = dp->regs[dp->nregs - 1];
    dp->reg_ids[i] = dp->reg_ids[dp->nregs - 1];
    dp->reg_calls[i] = dp->reg_calls[dp->nregs - 1];
    dp->nregs--;
    break;
  }
  pthread_mutex_unlock(&dp->mu);
}

/* -------------------------------------------------------- known groups */

int dataplane_expect(dataplane_t *dp, const dp_group_t *g) {
  if (!dp || !g || !g->secret || !g->ranks || g->n < 2) return -1;
  known_group_t k = {.comm_id = g->comm_id, .n = g->n};
  k.ranks = malloc(g->n * sizeof *k.ranks);
  k.member_secrets = g->pair_secrets ? malloc(g->n * DP_SECRET_LEN) : NULL;
  if (!k.ranks || (g->pair_secrets && !k.member_secrets)) {
    known_free(&k);
    return -1;
  }
  memcpy(k.ranks, g->ranks, g->n * sizeof *k.ranks);
  memcpy(k.secret, g->secret, DP_SECRET_LEN);
  if (g->pair_secrets) memcpy(k.member_secrets, g->pair_secrets, g->n * DP_SECRET_LEN);
  pthread_mutex_lock(&dp->mu);
  /* Known already (a comm used call after call): the newest now. */
  for (size_t i = 0; i < dp->nknown; i++)
    if (known_is(&dp->known[i], &k)) {
      known_drop_locked(dp, i);
      break;
    }
  if (dp->nknown == DP_KNOWN_MAX) known_drop_locked(dp, 0);
  dp->known[dp->nknown++] = k;
  bool wake = dp->parked > 0; /* hellos held already may be its members' */
  pthread_mutex_unlock(&dp->mu);
  if (wake) wake_listener(dp);
  return 0;
}

size_t dataplane_parked(dataplane_t *dp, size_t *proven) {
  if (proven) *proven = 0;
  if (!dp) return 0;
  pthread_mutex_lock(&dp->mu);
  size_t n = (size_t)dp->parked;
  if (proven) *proven = dp->held;
  pthread_mutex_unlock(&dp->mu);
  return n;
}

/* -------------------------------------------------------- failed calls */

static void failed_calls_expire_locked(dataplane_t *dp, int64_t now, size_t keep) {
  size_t k = 0;
  for (size_t i = 0; i < dp->nfailed; i++) {
    /* Oldest first: beyond `keep`, the oldest go whatever their time. */
    if (dp->failed[i].until_ms <= now || dp->nfailed - i > keep) {
      free(dp->failed[i].ranks);
      free(dp->failed[i].member_secrets);
      continue;
    }
    dp->failed[k++] = dp->failed[i];
  }
  dp->nfailed = k;
}

void dp__failed_call_add(dataplane_t *dp, const dp_group_t *g, uint64_t last, const char *why) {
  if (g->call == 0 || !g->secret) return; /* unnumbered calls cannot tell one call's hellos
                                           * from the next's */
  uint32_t *ranks = malloc(g->n * sizeof *ranks);
  uint8_t *pairs = g->pair_secrets ? malloc(g->n * DP_SECRET_LEN) : NULL;
  if (!ranks || (g->pair_secrets && !pairs)) { /* a peer that dials us waits out its timeout */
    free(ranks);
    free(pairs);
    return;
  }
  memcpy(ranks, g->ranks, g->n * sizeof *ranks);
  if (pairs) memcpy(pairs, g->pair_secrets, g->n * DP_SECRET_LEN);
  int64_t now = dp__now_ms();
  pthread_mutex_lock(&dp->mu);
  failed_calls_expire_locked(dp, now, DP_FAILED_MAX - 1);
  failed_call_t *r = &dp->failed[dp->nfailed++];
  *r = (failed_call_t){.comm_id = g->comm_id, .call = g->call,
                       .last = last > g->call ? last : g->call, .ranks = ranks, .n = g->n,
                       .member_secrets = pairs,
                   .until_ms = now + dp__timeout(dp, g)};
  memcpy(r->secret, g->secret, DP_SECRET_LEN);
  snprintf(r->why, sizeof r->why, "%s", why && *why ? why : "it failed this call");
  bool wake = dp->parked > 0;
  pthread_mutex_unlock(&dp->mu);
  if (wake) wake_listener(dp);
}

/* Whether p's complete hello is for a call that failed here (or an older
 * one: the dialer is behind, and we are past it), from a member of its
 * group proving its secret: then *r is a copy of the latest such record
 * (its ranks not to be used). Not while a call of the comm runs here: that
 * call takes it as always (a refusal's own registration aside). Under mu. */
static bool failed_call_answers_locked(dataplane_t *dp, const pending_t *p, failed_call_t *r,
                                       uint8_t secret[DP_SECRET_LEN]) {
  dp_hello_t h;
  if (dp_wire_parse_hello(p->hello, p->got, &h, NULL, 0) != DP_PARSE_OK) return false;
  int64_t now = dp__now_ms();
  const failed_call_t *best = NULL;
  bool best_covers = false; /* best's calls include the hello's */
  for (size_t i = 0; i < dp->nfailed; i++) {
    const failed_call_t *f = &dp->failed[i];
    bool covers = h.call >= f->call;
    if (f->comm_id != h.comm_id || h.call > f->last || f->until_ms <= now ||
        (best && (best_covers > covers || (best_covers == covers && best->last >= f->last))))
      continue;
    dp_wire_group_t grp = {.comm_id = f->comm_id, .ranks = f->ranks, .n = f->n, .secret = f->secret,
                           .member_secrets = f->member_secrets};
    size_t which;
    if (dp_wire_admit(p->hello, p->got, dp->rank, p->nonce, &grp, 1, &which, NULL, 0) ==
        DP_ADMIT_OK) {
      best = f;
      best_covers = covers;
      memcpy(secret, dp_wire_secret_of(&grp, h.from), DP_SECRET_LEN);
    }
  }
  if (best) *r = *best;
  return best != NULL;
}

const char *dp_reject_name(dp_reject_t reason) {
  static const char *const names[] = {
#define XX(name, str) str,
      DP_REJECT_MAP(XX)
#undef XX
  };
  return (unsigned)reason < DP_REJECT_COUNT ? names[reason] : "?";
}

uint64_t dataplane_rejected(const dataplane_t *dp, dp_reject_t reason) {
  if (!dp || (unsigned)reason >= DP_REJECT_COUNT) return 0;
  return atomic_load(&((dataplane_t *)dp)->rejected[reason]);
}

uint64_t dataplane_withdrawn(const dataplane_t *dp) {
  return dp ? atomic_load(&((dataplane_t *)dp)->withdrawn) : 0;
}

const char *dp_abort_name(dp_abort_t reason) {
  static const char *const names[] = {
#define XX(name, str) str,
      DP_ABORT_MAP(XX)
#undef XX
  };
  return (unsigned)reason < DP_ABORT_COUNT ? names[reason] : "?";
}

uint64_t dataplane_aborts(const dataplane_t *dp, dp_abort_t reason) {
  if (!dp || (unsigned)reason >= DP_ABORT_COUNT) return 0;
  return atomic_load(&((dataplane_t *)dp)->aborts[reason]);
}

/* ----------------------------------------------------------------- listener */

#define LOG_WINDOW_MS 10000
#define LOG_LINES_PER_WINDOW 5

/* p no longer waits for its call: out of the counts. Under mu. */
static void unpark_locked(dataplane_t *dp, pending_t *p) {
  if (p->parked) dp->parked--;
  if (p->proven) dp->held--;
  p->parked = p->proven = false;
}

/* Closes an unproven socket. reason < 0: the peer withdrew (not a refusal). */
static void pending_close(dataplane_t *dp, pending_t *p, int reason, const char *why) {
  if (p->parked) {
    pthread_mutex_lock(&dp->mu);
    unpark_locked(dp, p);
    pthread_mutex_unlock(&dp->mu);
  }
  close_ours(dp, p->fd);
  p->fd = -1;
  if (reason < 0) { /* counted, not logged: under load members do it often */
    atomic_fetch_add(&dp->withdrawn, 1);
    return;
  }
  atomic_fetch_add(&dp->rejected[reason], 1);
  int64_t now = dp__now_ms();
  if (now - dp->log_window_ms >= LOG_WINDOW_MS) {
    if (dp->log_skipped > 0)
      log_warn("dataplane", "rank %u: %llu more refused connections were not logged", dp->rank,
               (unsigned long long)dp->log_skipped);
    dp->log_window_ms = now;
    dp->log_lines = 0;
    dp->log_skipped = 0;
  }
  if (dp->log_lines++ < LOG_LINES_PER_WINDOW)
    log_warn("dataplane", "rank %u refused a connection from %s (%s): %s", dp->rank, p->from,
             dp_reject_name((dp_reject_t)reason), why);
  else
    dp->log_skipped++;
}

/* Files an admitted socket under (comm_id, from, secret) for the call that
 * waits for it (or the next one). */
static void file_accepted(dataplane_t *dp, pending_t *p, const uint8_t *secret) {
  dp_hello_t h;
  dp_wire_parse_hello(p->hello, sizeof p->hello, &h, NULL, 0); /* admitted: well-formed */
  uint32_t from = h.from;
  uint64_t comm_id = h.comm_id;
  conn_t *c = calloc(1, sizeof *c);
  if (!c) {
    close_ours(dp, p->fd);
    return;
  }
  c->fd = p->fd;
  c->refs = 1;
  c->local = p->local;
  c->linked = true;
  c->comm_id = comm_id;
  c->last_call = h.call;
  c->peer = from;
  memcpy(c->secret, secret, DP_SECRET_LEN);
  snprintf(c->addr, sizeof c->addr, "rank %u", from);
  pthread_mutex_lock(&dp->mu);
  if (dp->stopping) { /* nothing will take it any more */
    pthread_mutex_unlock(&dp->mu);
    close_ours(dp, c->fd);
    free(c);
    return;
  }
  /* The peer dialed again: it sends nothing more on the link it had. That
   * one goes, unless frames on it are still to be read (a send that ended
   * before it closed the link idle), or a call reads it: then it stays ahead
   * of the new one, which get_in takes once it is done (oldest first). */
  for (conn_t *o = dp->ins; o; o = o->next) {
    if (o->comm_id == comm_id && o->peer == from &&
        memcmp(o->secret, secret, DP_SECRET_LEN) == 0 && o->refs == 1 && in_empty(o)) {
      conn_unlink_locked(dp, &dp->ins, o);
      break;
    }
  }
  sweep_ins_locked(dp);
  conn_t **tail = &dp->ins;
  while (*tail) tail = &(*tail)->next;
  c->next = NULL;
  *tail = c;
  pthread_cond_broadcast(&dp->cv);
  pthread_mutex_unlock(&dp->mu);
}

/* Room for one more held hello: one per member (but itself) of each known
 * group. Under mu. */
static bool held_room_locked(const dataplane_t *dp) {
  size_t max = 0;
  for (size_t i = 0; i < dp->nknown; i++) max += dp->known[i].n - 1;
  return dp->held < max;
}

/* Whether p's complete hello, for a call not started here, proves the
 * secret of a known group (dataplane_expect) for its comm and sender, with
 * room to hold it. Under mu. */
static bool known_proves_locked(dataplane_t *dp, const pending_t *p) {
  if (dp->nknown == 0 || !held_room_locked(dp)) return false;
  dp_wire_group_t grp[DP_KNOWN_MAX];
  for (size_t i = 0; i < dp->nknown; i++) {
    const known_group_t *k = &dp->known[i];
    /* call: no call runs here; a wrong mac is only "not proven" */
    grp[i] = (dp_wire_group_t){.comm_id = k->comm_id, .ranks = k->ranks, .n = k->n,
                               .secret = k->secret, .member_secrets = k->member_secrets,
                               .call = UINT64_MAX};
  }
  size_t which;
  return dp_wire_admit(p->hello, p->got, dp->rank, p->nonce, grp, dp->nknown, &which, NULL, 0) ==
         DP_ADMIT_OK;
}

/* Decides on p's hello so far (wire.h's dp_wire_admit against the calls in
 * progress). true while p stays pending (more to read, or parked). */
static bool pending_admit(dataplane_t *dp, pending_t *p) {
  char why[200] = "";
  size_t which = 0;
  uint8_t secret[DP_SECRET_LEN];
  failed_call_t failed;
  bool refuse = false;
  pthread_mutex_lock(&dp->mu);
  dp_admit_t a = dp_wire_admit(p->hello, p->got, dp->rank, p->nonce, dp->regs, dp->nregs, &which,
                               why, sizeof why);
  if (a == DP_ADMIT_OK) {
    dp_hello_t h;
    dp_wire_parse_hello(p->hello, p->got, &h, NULL, 0); /* admitted: well-formed */
    memcpy(secret, dp_wire_secret_of(&dp->regs[which], h.from), DP_SECRET_LEN);
  } else if (a == DP_ADMIT_UNKNOWN_GROUP && failed_call_answers_locked(dp, p, &failed, secret)) {
    a = DP_ADMIT_OK; /* no call here takes it, and its call failed here: acked, then told why */
    refuse = true;
  }
  if (a == DP_ADMIT_UNKNOWN_GROUP && !p->parked) { /* its call may not have started here yet */
    p->parked = true;
    p->deadline = p->accepted + dp->timeout_ms;
    dp->parked++;
  }
  if (a == DP_ADMIT_UNKNOWN_GROUP && !p->proven && known_proves_locked(dp, p)) {
    p->proven = true; /* a member of a group whose call is coming: held apart */
    dp->held++;
  }
  pthread_mutex_unlock(&dp->mu);
  switch (a) {
  case DP_ADMIT_MORE:
  case DP_ADMIT_UNKNOWN_GROUP: return true;
  case DP_ADMIT_MALFORMED: pending_close(dp, p, DP_REJECT_MALFORMED, why); return false;
  case DP_ADMIT_BAD_PROOF: pending_close(dp, p, DP_REJECT_BAD_PROOF, why); return false;
  case DP_ADMIT_OK: break;
  }
  /* No longer the listener's: out of its epoll set (the descriptor stays open). */
  epoll_ctl(dp->ep, EPOLL_CTL_DEL, p->fd, NULL);
  if (p->parked) {
    pthread_mutex_lock(&dp->mu);
    unpark_locked(dp, p);
    pthread_mutex_unlock(&dp->mu);
  }
  uint8_t ack[DP_ACK_LEN];
  dp_wire_ack(ack, p->hello, p->nonce, secret);
  /* A fresh socket whose peer read our challenge has room for 40 bytes. */
  if (send(p->fd, ack, sizeof ack, MSG_NOSIGNAL | MSG_DONTWAIT) != (ssize_t)sizeof ack) {
    close_ours(dp, p->fd);
    return false;
  }
  if (refuse) { /* as dp__abort_untaken writes it: the link stays for its dialer to close */
    uint8_t frame[DP_HDR_LEN + DP_ABORT_MAX];
    ssize_t w = send(p->fd, frame, dp_wire_abort(frame, failed.comm_id, failed.last, failed.why),
                     MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)w;
  }
  file_accepted(dp, p, secret);
  return false;
}

/* Reads what p's peer sent. true while p stays pending. */
static bool pending_read(dataplane_t *dp, pending_t *p) {
  char why[120];
  if (p->parked) { /* a member waiting for our ack sends nothing more */
    uint8_t byte;
    ssize_t r = recv(p->fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return true;
    if (r <= 0) pending_close(dp, p, -1, "withdrew"); /* gave up waiting for its call here */
    else pending_close(dp, p, DP_REJECT_MALFORMED, "sent bytes after its hello, before an ack");
    return false;
  }
  ssize_t r = recv(p->fd, p->hello + p->got, DP_HELLO_LEN - p->got, MSG_DONTWAIT);
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return true;
  if (r <= 0 && p->got == 0) { /* withdrew: a member that gave up dialing (its deadline
                                  * passed, its call ended) before our challenge reached it */
    pending_close(dp, p, -1, "closed before its hello");
    return false;
  }
  if (r <= 0) {
    snprintf(why, sizeof why, "closed the connection after %zu of the hello's %d bytes", p->got,
             DP_HELLO_LEN);
    pending_close(dp, p, DP_REJECT_MALFORMED, why);
    return false;
  }
  p->got += (size_t)r;
  return pending_admit(dp, p);
}

/* Takes a new socket: sends it a challenge. false if it is gone already. */
static bool pending_open(dataplane_t *dp, pending_t *p, int fd, const struct sockaddr_storage *ss,
                         int64_t now) {
  *p = (pending_t){.fd = fd, .accepted = now};
  p->deadline = now + (dp->timeout_ms < DP_HELLO_MS ? dp->timeout_ms : DP_HELLO_MS);
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (ss->ss_family == AF_INET) {
    const struct sockaddr_in *in = (const struct sockaddr_in *)ss;
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof host);
    port = ntohs(in->sin_port);
    snprintf(p->from, sizeof p->from, "%s:%d", host, port);
  } else if (ss->ss_family == AF_INET6) {
    const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)ss;
    inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof host);
    port = ntohs(in6->sin6_port);
    snprintf(p->from, sizeof p->from, "[%s]:%d", host, port);
  } else if (ss->ss_family == AF_UNIX) {
    p->local = true;
    snprintf(p->from, sizeof p->from, "a process on this host");
  } else {
    snprintf(p->from, sizeof p->from, "?");
  }
  uint8_t challenge[DP_CHALLENGE_LEN];
  if (RAND_bytes(p->nonce, sizeof p->nonce) != 1) {
    log_error("dataplane", "no randomness for a nonce: closing the connection from %s", p->from);
    close(fd);
    return false;
  }
  dp_wire_challenge(challenge, p->nonce);
  set_nodelay(fd);
  if (send(fd, challenge, sizeof challenge, MSG_NOSIGNAL | MSG_DONTWAIT) != (ssize_t)sizeof challenge) {
    close(fd);
    return false;
  }
  return true;
}

/* Out of kernel memory, or of descriptors with none of ours closing: how
 * long accepting pauses (a descriptor of ours closed wakes it at once). */
#define DP_ACCEPT_BACKOFF_MS 100
#define LISTENER_EVENTS 64 /* epoll events taken per wake-up */

/* The listener's pending sockets, each list oldest first (accept order), so
 * that whatever a wake-up needs is at a head and a wake-up costs what is
 * ready, not what is held (a stranger trickling bytes on a thousand sockets
 * made each one-byte segment cost a scan of them all). Every socket is on
 * READING or PARKED, and on those of the others its state puts it on. The
 * deadlines are the accept time plus one delay per list, so each list's head
 * is its next deadline. */
enum {
  PL_READING,  /* reading its hello: the next hello deadline first */
  PL_PARKED,   /* holding a complete hello: the next parked deadline first */
  PL_SILENT,   /* reading, nothing received yet: the first a full cap closes */
  PL_UNPROVEN, /* all but the held (proven) ones: the cap's count, the oldest */
  PL_COUNT
};

typedef struct plist {
  pending_t *head, *tail;
  size_t n;
} plist_t;

typedef struct listener {
  dataplane_t *dp;
  plist_t list[PL_COUNT];
  uint64_t seq;          /* the next accept's */
  bool listening;        /* the listening sockets are in the epoll set's interest */
  int64_t off_until;     /* out of descriptors or memory: not accepting until then */
  bool fd_wait;          /* ...of descriptors: until one of ours closes (accept_waits) */
  int64_t fd_evict_log;  /* the last "out of descriptors, closing" line */
  int64_t off_log;       /* the last "cannot accept" line */
} listener_t;

_Static_assert(PL_COUNT == sizeof ((pending_t *)0)->on, "pending_t's links, one per list");

/* p goes on list w after every one accepted before it (the tail, but for a
 * socket that parks behind one accepted later: walks back past those). */
static void plist_insert(listener_t *L, pending_t *p, int w) {
  plist_t *l = &L->list[w];
  pending_t *after = l->tail;
  while (after && after->seq > p->seq) after = after->prev[w];
  p->prev[w] = after;
  p->next[w] = after ? after->next[w] : l->head;
  if (p->next[w]) p->next[w]->prev[w] = p;
  else l->tail = p;
  if (after) after->next[w] = p;
  else l->head = p;
  p->on[w] = true;
  l->n++;
}

static void plist_remove(listener_t *L, pending_t *p, int w) {
  if (!p->on[w]) return;
  plist_t *l = &L->list[w];
  if (p->prev[w]) p->prev[w]->next[w] = p->next[w];
  else l->head = p->next[w];
  if (p->next[w]) p->next[w]->prev[w] = p->prev[w];
  else l->tail = p->prev[w];
  p->on[w] = false;
  l->n--;
}

/* After p was read or looked at again: gone (its descriptor closed or filed
 * by then), it leaves every list; else it moves to the lists its state puts
 * it on (parking, a first byte and a proof happen once each). */
static void pending_settle(listener_t *L, pending_t *p, bool alive) {
  if (!alive) {
    for (int w = 0; w < PL_COUNT; w++) plist_remove(L, p, w);
    free(p);
    return;
  }
  if (p->parked && p->on[PL_READING]) {
    plist_remove(L, p, PL_READING);
    plist_insert(L, p, PL_PARKED);
  }
  if (p->got > 0 || p->parked) plist_remove(L, p, PL_SILENT);
  if (p->proven) plist_remove(L, p, PL_UNPROVEN);
}

/* Closes p (counted as `reason`, logged with why) and forgets it. */
static void pending_drop(listener_t *L, pending_t *p, int reason, const char *why) {
  pending_close(L->dp, p, reason, why);
  pending_settle(L, p, false);
}

/* The listening sockets in the epoll set's interest, or left out of it (the
 * rest wait in the backlog). */
static void listen_set(listener_t *L, bool on) {
  if (L->listening == on) return;
  L->listening = on;
  dataplane_t *dp = L->dp;
  int *fds[2] = {&dp->lfd, &dp->ufd};
  for (int l = 0; l < 2; l++) {
    if (*fds[l] < 0) continue;
    struct epoll_event ev = {.events = on ? EPOLLIN : 0, .data.ptr = fds[l]};
    epoll_ctl(dp->ep, EPOLL_CTL_MOD, *fds[l], &ev);
  }
}

/* The unproven socket a newcomer may take the place of now: the oldest that
 * has sent nothing once DP_SILENT_GRACE_MS old, else the oldest once
 * DP_EVICT_GRACE_MS old, or as old as a silent one must be where that is
 * longer (a hello under way is kept no shorter than nothing; a held one,
 * proven, never goes). NULL while neither may go, and *until is when one may
 * (INT64_MAX: none is unproven). */
static pending_t *room_victim(const listener_t *L, int64_t now, int64_t *until) {
  pending_t *silent = L->list[PL_SILENT].head, *oldest = L->list[PL_UNPROVEN].head;
  int grace = atomic_load(&L->dp->silent_grace_ms);
  int64_t silent_at = silent ? silent->accepted + grace : INT64_MAX;
  int64_t oldest_at =
      oldest ? oldest->accepted + (grace > DP_EVICT_GRACE_MS ? grace : DP_EVICT_GRACE_MS)
             : INT64_MAX;
  *until = 0;
  if (silent_at <= now) return silent;
  if (oldest_at <= now) return oldest;
  *until = silent_at < oldest_at ? silent_at : oldest_at;
  return NULL;
}

/* Whether a newcomer may be accepted now, and in *victim the unproven socket
 * closed to make room for it (NULL: none, the cap is not full). With the cap
 * full, room_victim's; while none may go, false, and *until is when one may
 * (accepting pauses until then). */
static bool accept_room(const listener_t *L, int64_t now, pending_t **victim, int64_t *until) {
  *victim = NULL;
  *until = 0;
  if (L->list[PL_UNPROVEN].n < atomic_load(&L->dp->unproven_max)) return true;
  return (*victim = room_victim(L, now, until)) != NULL;
}

/* Closes victim for a newcomer (accept_room). */
static void pending_evict(listener_t *L, pending_t *victim, int64_t now) {
  char why[160];
  long long age = (long long)(now - victim->accepted);
  size_t cap = atomic_load(&L->dp->unproven_max);
  if (!victim->parked && victim->got == 0)
    snprintf(why, sizeof why, "sent nothing in %lld ms, with %zu unproven connections held", age,
             cap);
  else
    snprintf(why, sizeof why, "the oldest of more than %zu unproven connections (after %lld ms)",
             cap, age);
  pending_drop(L, victim, DP_REJECT_TOO_MANY_PENDING, why);
}

/* The process is out of descriptors (accept4: EMFILE, ENFILE) and a
 * connection waits: closes the unproven socket the cap would close first,
 * once its grace is over, as if the cap were full (a held one never goes), so
 * that a member's dial is not kept out by strangers holding every descriptor
 * until their hello deadlines. true if one was closed (accept again); else
 * *until is when one may be (INT64_MAX: none is unproven). */
static bool out_of_fds_evict(listener_t *L, int64_t now, int err, int64_t *until) {
  pending_t *victim = room_victim(L, now, until);
  if (!victim) return false;
  if (L->fd_evict_log == 0 || now - L->fd_evict_log >= LOG_WINDOW_MS) {
    log_warn("dataplane", "rank %u is out of file descriptors (%s): closing the oldest unproven "
             "connections to accept new ones", L->dp->rank, strerror(err));
    L->fd_evict_log = now;
  }
  char why[160];
  snprintf(why, sizeof why, "%s after %lld ms, closed for a newcomer: out of file descriptors",
           !victim->parked && victim->got == 0 ? "sent nothing" : "unproven",
           (long long)(now - victim->accepted));
  pending_drop(L, victim, DP_REJECT_TOO_MANY_PENDING, why);
  return true;
}

/* Whether a connection waits in listening socket lfd's backlog. */
static bool backlog_waits(int lfd) {
  int err = errno;
  struct pollfd p = {.fd = lfd, .events = POLLIN};
  bool waits = poll(&p, 1, 0) > 0 && (p.revents & POLLIN);
  errno = err;
  return waits;
}

/* Out of descriptors since fds_closed was `closed`: accepting pauses until a
 * descriptor of ours closes (close_ours wakes the listener), or the back-off
 * ends (one of another part of the process may free). false if one of ours
 * closed already: accept again now. */
static bool accept_wait_fd(listener_t *L, uint64_t closed) {
  dataplane_t *dp = L->dp;
  L->fd_wait = true;
  atomic_store(&dp->accept_waits, true);
  /* (a close before that store counted: seen here; one after it wakes us) */
  if (atomic_load(&dp->fds_closed) == closed) return true;
  atomic_store(&dp->accept_waits, false);
  L->fd_wait = false;
  L->off_until = 0;
  return false;
}

/* Takes one connection from listening socket lfd. false: none now (the
 * backlog is empty, or accepting pauses). */
static bool accept_one(listener_t *L, int lfd, int64_t now) {
  dataplane_t *dp = L->dp;
  pending_t *victim;
  int64_t until;
  if (!accept_room(L, now, &victim, &until)) return false; /* the rest wait in the backlog */
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  uint64_t closed = atomic_load(&dp->fds_closed);
  int fd = accept4(lfd, (struct sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (fd < 0) {
    bool no_fd = errno == EMFILE || errno == ENFILE;
    until = INT64_MAX;
    /* (accept4 fails so before it looks at the backlog: one must wait there) */
    if (no_fd && backlog_waits(lfd) && out_of_fds_evict(L, now, errno, &until)) return true;
    if (no_fd || errno == ENOBUFS || errno == ENOMEM) {
      int backoff = atomic_load(&dp->accept_backoff_ms);
      if (L->off_log == 0 || now - L->off_log >= LOG_WINDOW_MS) {
        L->off_log = now;
        log_warn("dataplane", "rank %u cannot accept connections: %s; trying again %s%d ms",
                 dp->rank, strerror(errno),
                 no_fd ? "when a descriptor of the data plane's closes, or in " : "in ", backoff);
      }
      L->off_until = now + backoff;
      if (until < L->off_until) L->off_until = until; /* an unproven one may go then */
    }
    return no_fd && !accept_wait_fd(L, closed);
  }
  if (victim) pending_evict(L, victim, now);
  pending_t *p = malloc(sizeof *p);
  if (!p) { /* out of memory: the new one goes */
    close(fd);
    atomic_fetch_add(&dp->rejected[DP_REJECT_TOO_MANY_PENDING], 1);
    return true;
  }
  if (!pending_open(dp, p, fd, &ss, now)) {
    free(p);
    return true;
  }
  struct epoll_event ev = {.events = EPOLLIN, .data.ptr = p};
  if (epoll_ctl(dp->ep, EPOLL_CTL_ADD, fd, &ev) != 0) { /* out of memory (or of watches) */
    close(fd);
    free(p);
    atomic_fetch_add(&dp->rejected[DP_REJECT_TOO_MANY_PENDING], 1);
    return true;
  }
  p->seq = L->seq++;
  plist_insert(L, p, PL_READING);
  plist_insert(L, p, PL_SILENT);
  plist_insert(L, p, PL_UNPROVEN);
  return true;
}

/* Closes the sockets past their deadline: the heads of READING and PARKED. */
static void pending_expire(listener_t *L, int64_t now) {
  char why[120];
  for (pending_t *p; (p = L->list[PL_READING].head) && now > p->deadline;) {
    snprintf(why, sizeof why, "sent %zu of the hello's %d bytes in %lld ms", p->got, DP_HELLO_LEN,
             (long long)(now - p->accepted));
    pending_drop(L, p, DP_REJECT_HELLO_TIMEOUT, why);
  }
  for (pending_t *p; (p = L->list[PL_PARKED].head) && now > p->deadline;) {
    snprintf(why, sizeof why, "its hello named no call that started here within %d ms",
             L->dp->timeout_ms);
    pending_drop(L, p, DP_REJECT_UNKNOWN_GROUP, why);
  }
}

/* A call started (or one was refused): the parked hellos, oldest first, may
 * be its members'. */
static void pending_readmit(listener_t *L) {
  for (pending_t *p = L->list[PL_PARKED].head, *next; p; p = next) {
    next = p->next[PL_PARKED];
    pending_settle(L, p, pending_admit(L->dp, p));
  }
}

/* How long the next wait may be: until the next deadline, or the end of a
 * pause in accepting (at most a second). */
static int listener_wait_ms(const listener_t *L, int64_t now, bool room, int64_t until) {
  int64_t next = L->off_until > now ? L->off_until : INT64_MAX;
  if (!room && until < next) next = until;
  for (int w = PL_READING; w <= PL_PARKED; w++)
    if (L->list[w].head && L->list[w].head->deadline < next) next = L->list[w].head->deadline;
  return next == INT64_MAX ? -1 : next <= now ? 0 : (int)dp__min((size_t)(next - now), 1000);
}

/* Accepts connections and runs their handshakes without ever blocking on one. */
static void *listener_main(void *arg) {
  listener_t L = {.dp = arg, .listening = true};
  dataplane_t *dp = L.dp;
  struct epoll_event evs[LISTENER_EVENTS];
  for (;;) {
    int64_t now = dp__now_ms(), until;
    pending_t *victim;
    bool room = accept_room(&L, now, &victim, &until);
    /* Out of file descriptors, a listener stays readable with nothing it can
     * accept: it is left out for a while instead of spinning. */
    listen_set(&L, L.off_until <= now && room);
    int n = epoll_wait(dp->ep, evs, LISTENER_EVENTS, listener_wait_ms(&L, now, room, until));
    if (n < 0 && errno != EINTR) break;
    bool registered = false, stop = false, ready[2] = {false, false};
    for (int i = 0; i < n; i++) {
      void *tag = evs[i].data.ptr;
      if (tag == &dp->wake[0]) {
        char buf[64];
        while (read(dp->wake[0], buf, sizeof buf) > 0) {
        }
        stop = dp__stopping(dp);
        registered = true; /* a call started: parked hellos may be its members' */
      } else if (tag == &dp->lfd || tag == &dp->ufd) {
        ready[tag == &dp->ufd] = true;
      } else { /* this batch frees no other socket than the one read */
        pending_settle(&L, tag, pending_read(dp, tag));
      }
    }
    if (stop) break;
    if (registered) pending_readmit(&L);
    /* Waiting for a descriptor: one of ours closed (close_ours took the flag
     * back), or the back-off is over; both mean try again now. */
    if (L.fd_wait && (!atomic_load(&dp->accept_waits) || L.off_until <= dp__now_ms())) {
      atomic_store(&dp->accept_waits, false);
      L.fd_wait = false;
      L.off_until = 0;
    }
    now = dp__now_ms();
    pending_expire(&L, now);
    /* A burst at most, then back to the pending ones: a flood of new
     * connections must not keep the hellos already here from being read. */
    for (int l = 0; l < 2; l++)
      for (int burst = 0; ready[l] && burst < DP_ACCEPT_BURST; burst++)
        if (!accept_one(&L, l ? dp->ufd : dp->lfd, now)) break;
  }
  for (int w = PL_READING; w <= PL_PARKED; w++)
    while (L.list[w].head) {
      pending_t *p = L.list[w].head;
      pending_close(dp, p, -1, "stopping");
      pending_settle(&L, p, false);
    }
  return NULL;
}

/* The default cap on unproven sockets (dp_internal.h): DP_UNPROVEN_MAX, or a
 * quarter of the descriptors this process may open where that is less, but
 * at least DP_UNPROVEN_MIN. */
static size_t unproven_cap(void) {
  struct rlimit r;
  if (getrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return DP_UNPROVEN_MAX;
  rlim_t quarter = r.rlim_cur / 4;
  if (quarter < DP_UNPROVEN_MIN) return DP_UNPROVEN_MIN;
  return quarter < DP_UNPROVEN_MAX ? (size_t)quarter : DP_UNPROVEN_MAX;
}

void dataplane_max_unproven(dataplane_t *dp, size_t n) {
  if (dp) atomic_store(&dp->unproven_max, n > 0 ? n : 1);
}

void dataplane_accept_backoff(dataplane_t *dp, int ms) {
  if (dp) atomic_store(&dp->accept_backoff_ms, ms > 0 ? ms : 1);
}

bool dataplane_accept_paused(dataplane_t *dp) { return dp && atomic_load(&dp->accept_waits); }

void dataplane_silent_grace(dataplane_t *dp, int ms) {
  if (dp) atomic_store(&dp->silent_grace_ms, ms > 0 ? ms : 0);
}

/* The listener's epoll set watches fd (-1: none), tagged with tag. */
static bool listener_watch(dataplane_t *dp, int fd, void *tag) {
  struct epoll_event ev = {.events = EPOLLIN, .data.ptr = tag};
  return fd < 0 || epoll_ctl(dp->ep, EPOLL_CTL_ADD, fd, &ev) == 0;
}

dataplane_t *dataplane_start(const char *host, uint32_t my_rank, int timeout_ms,
                             meshd_error_t *err) {
  dataplane_t *dp = calloc(1, sizeof *dp);
  struct addrinfo *ai = NULL;
  if (!dp) {
    error_set(err, ERR_UNAVAILABLE, "data plane: out of memory");
    return NULL;
  }
  dp->rank = my_rank;
  dp->timeout_ms = timeout_ms > 0 ? timeout_ms : 30000;
  dp->lfd = dp->ufd = dp->wake[0] = dp->wake[1] = dp->ep = -1;
  dp->same_host = true;
  dp->max_outs = DP_LINKS_DEFAULT;
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE};
  int gai = getaddrinfo(host, "0", &hints, &ai);
  if (gai != 0) {
    error_set(err, ERR_UNAVAILABLE, "data plane: cannot resolve listen host '%s': %s",
              host ? host : "(null)", gai_strerror(gai));
    goto fail;
  }
  dp->lfd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  int one = 1;
  if (dp->lfd < 0 || setsockopt(dp->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
      bind(dp->lfd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(dp->lfd, 512) != 0) {
    error_set(err, ERR_UNAVAILABLE, "data plane: cannot listen on %s: %s", host, strerror(errno));
    goto fail;
  }
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  getsockname(dp->lfd, (struct sockaddr *)&ss, &sl);
  dp->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                            : ((struct sockaddr_in *)&ss)->sin_port);
  struct sockaddr_un un;
  socklen_t unlen = local_name(&un, dp->port);
  dp->ufd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (dp->ufd >= 0 && (bind(dp->ufd, (struct sockaddr *)&un, unlen) != 0 || listen(dp->ufd, 512) != 0)) {
    /* Another data plane of this host has the port on another address: peers reach us by TCP. */
    log_info("dataplane", "rank %u: no same-host socket @%s: %s", my_rank, un.sun_path + 1,
             strerror(errno));
    close(dp->ufd);
    dp->ufd = -1;
  }
  if (pipe2(dp->wake, O_CLOEXEC | O_NONBLOCK) != 0) {
    error_set(err, ERR_UNAVAILABLE, "data plane: pipe: %s", strerror(errno));
    goto fail;
  }
  dp->unproven_max = unproven_cap();
  dp->silent_grace_ms = DP_SILENT_GRACE_MS;
  dp->accept_backoff_ms = DP_ACCEPT_BACKOFF_MS;
  if ((dp->ep = epoll_create1(EPOLL_CLOEXEC)) < 0 || !listener_watch(dp, dp->wake[0], &dp->wake[0]) ||
      !listener_watch(dp, dp->lfd, &dp->lfd) || !listener_watch(dp, dp->ufd, &dp->ufd)) {
    error_set(err, ERR_UNAVAILABLE, "data plane: epoll: %s", strerror(errno));
    goto fail;
  }
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&dp->cv, &ca);
  pthread_condattr_destroy(&ca);
  pthread_mutex_init(&dp->mu, NULL);
  if (pthread_create(&dp->listener, NULL, listener_main, dp) != 0) {
    error_set(err, ERR_UNAVAILABLE, "data plane: cannot start the listener thread");
    pthread_cond_destroy(&dp->cv);
    pthread_mutex_destroy(&dp->mu);
    goto fail;
  }
  freeaddrinfo(ai);
  return dp;
fail:
  if (ai) freeaddrinfo(ai);
  if (dp->lfd >= 0) close(dp->lfd);
  if (dp->ufd >= 0) close(dp->ufd);
  if (dp->wake[0] >= 0) close(dp->wake[0]);
  if (dp->wake[1] >= 0) close(dp->wake[1]);
  if (dp->ep >= 0) close(dp->ep);
  free(dp);
  return NULL;
}

int dataplane_port(const dataplane_t *dp) { return dp ? dp->port : -1; }

void dataplane_set_rank(dataplane_t *dp, uint32_t rank) {
  if (dp) atomic_store(&dp->rank, rank);
}

void dataplane_same_host(dataplane_t *dp, bool on) {
  if (dp) dp->same_host = on;
}

uint64_t dataplane_shm_received(const dataplane_t *dp, uint64_t *mapped) {
  dataplane_t *d = (dataplane_t *)dp;
  if (mapped) *mapped = d ? atomic_load(&d->shm_mapped) : 0;
  return d ? atomic_load(&d->shm_in) : 0;
}

void dataplane_shutdown(dataplane_t *dp) {
  if (!dp) return;
  pthread_mutex_lock(&dp->mu);
  bool first = !dp->stopping;
  dp->stopping = true;
  conn_t **lists[2] = {&dp->ins, &dp->outs};
  for (int l = 0; l < 2; l++)
    while (*lists[l]) conn_unlink_locked(dp, lists[l], *lists[l]);
  pthread_cond_broadcast(&dp->cv);
  while (dp->active > 0) pthread_cond_wait(&dp->cv, &dp->mu);
  pthread_mutex_unlock(&dp->mu);
  if (!first) return;
  ssize_t w;
  do w = write(dp->wake[1], "x", 1);
  while (w < 0 && errno == EINTR);
  pthread_join(dp->listener, NULL);
  close(dp->lfd); /* peers dialing us now are refused */
  if (dp->ufd >= 0) close(dp->ufd);
  dp->lfd = dp->ufd = -1;
}

void dataplane_stop(dataplane_t *dp) {
  if (!dp) return;
  dataplane_shutdown(dp);
  close(dp->wake[0]);
  close(dp->wake[1]);
  pthread_cond_destroy(&dp->cv);
  for (scratch_t *sc = dp->spare, *next; sc; sc = next) {
    next = sc->next;
    free(sc);
  }
  failed_calls_expire_locked(dp, INT64_MAX, 0);
  while (dp->nknown > 0) known_drop_locked(dp, dp->nknown - 1);
  free(dp->regs);
  free(dp->reg_ids);
  free(dp->reg_calls);
  free(dp->ended);
  close(dp->ep);
  pthread_mutex_destroy(&dp->mu);
  free(dp);
}
