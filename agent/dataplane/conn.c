/* The agents' TCP transport (dataplane.h): connections.
 *
 * One TCP connection per (comm_id, ordered pair of agents), used in one
 * direction: the sender dials the receiver's data port and opens with a
 * handshake {magic, to_rank, from_rank, comm_id}; the receiver's listener thread
 * files the accepted socket under (comm_id, from_rank). So nobody has to decide
 * who dials, two agents never race to build the same link, and a ring step
 * (send to next, receive from previous) touches two sockets that are each
 * driven in one direction. Both ends cache their connection; the only bytes that
 * travel "backwards" are an abort notice (transfer.c). */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "dp_internal.h"
#include "log.h"

/* A handshake read in progress on an accepted socket. */
typedef struct pending {
  int fd;
  size_t got;
  int64_t deadline;
  uint8_t hello[DP_HELLO_LEN];
} pending_t;

typedef struct scratch {
  struct scratch *next;
  size_t cap;
  uint8_t data[];
} scratch_t;

#define SCRATCH_KEEP 4

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
  if (dp->nspare < SCRATCH_KEEP) {
    s->next = dp->spare;
    dp->spare = s;
    dp->nspare++;
    s = NULL;
  }
  pthread_mutex_unlock(&dp->mu);
  free(s);
}

static void conn_put_locked(conn_t *c) {
  if (--c->refs > 0) return;
  close(c->fd);
  free(c);
}

void dp__conn_put(dataplane_t *dp, conn_t *c) {
  if (!c) return;
  pthread_mutex_lock(&dp->mu);
  conn_put_locked(c);
  pthread_mutex_unlock(&dp->mu);
}

/* Unlinks c from `list` and shuts its socket down, so a call still using it fails. */
static void conn_unlink_locked(conn_t **list, conn_t *c) {
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
      conn_put_locked(c);
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
      if (c->comm_id == comm_id) conn_unlink_locked(lists[l], c);
      c = next;
    }
  }
  pthread_mutex_unlock(&dp->mu);
}

void dp__conn_discard(dataplane_t *dp, conn_t *c) {
  pthread_mutex_lock(&dp->mu);
  if (c->linked) { /* in one of the two tables; unlinking from the other is a no-op */
    conn_unlink_locked(&dp->ins, c);
    if (c->linked) conn_unlink_locked(&dp->outs, c);
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
  uint64_t gen = atomic_load(&dp->gen);
  if (!cl || !cl->g || gen == cl->gen) return 0;
  uint64_t from = gen - cl->gen > DP_DEAD_MAX ? gen - DP_DEAD_MAX : cl->gen;
  for (uint64_t k = from; k < gen; k++) {
    const dead_peer_t *d = &dp->dead[k % DP_DEAD_MAX];
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
  if (!cl || !cl->g || atomic_load(&dp->gen) == cl->gen) return 0;
  pthread_mutex_lock(&dp->mu);
  int rc = check_lost_locked(dp, cl, err);
  pthread_mutex_unlock(&dp->mu);
  return rc;
}

void dataplane_peer_lost(dataplane_t *dp, const char *addr, uint32_t rank, const char *why) {
  if (!dp || !addr || !*addr) return;
  pthread_mutex_lock(&dp->mu);
  uint64_t gen = atomic_load(&dp->gen);
  dead_peer_t *d = &dp->dead[gen % DP_DEAD_MAX];
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
      if (strcmp(c->addr, addr) == 0) conn_unlink_locked(lists[l], c);
    }
  pthread_cond_broadcast(&dp->cv);
  pthread_mutex_unlock(&dp->mu);
  log_info("dataplane", "rank %u at %s declared lost: %s", rank, addr, why ? why : "");
}

uint64_t dataplane_generation(dataplane_t *dp) { return dp ? atomic_load(&dp->gen) : 0; }

void dataplane_drop_comm(dataplane_t *dp, uint64_t comm_id) {
  if (dp) dp__drop_comm(dp, comm_id);
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
 * yet) until deadline. Returns a non-blocking socket, or -1 with `why` set. */
static int dial(dataplane_t *dp, const call_t *cl, const char *addr, int64_t deadline, char *why,
                size_t whylen) {
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
  for (;;) {
    fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      last_errno = errno;
      break;
    }
    int rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
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
    close(fd);
    fd = -1;
    int64_t left = deadline - dp__now_ms();
    if (left <= 0 || dp__stopping(dp) || last_errno == ETIMEDOUT) break;
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

/* An accepted connection whose peer hung up is no use for a new call, even if
 * bytes of an abandoned call are still buffered. */
static bool in_alive(const conn_t *c) {
  struct pollfd p = {.fd = c->fd, .events = POLLIN | POLLRDHUP};
  if (poll(&p, 1, 0) <= 0) return true;
  return !(p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

conn_t *dp__get_out(dataplane_t *dp, const call_t *cl, uint32_t peer, const char *addr,
                    int64_t deadline, meshd_error_t *err) {
  const char *what = cl->what;
  uint64_t comm_id = cl->comm_id;
  pthread_mutex_lock(&dp->mu);
  for (conn_t *c = dp->outs; c; c = c->next) {
    if (c->comm_id != comm_id || c->peer != peer) continue;
    if (out_alive(c) && strcmp(c->addr, addr) == 0) {
      c->refs++;
      pthread_mutex_unlock(&dp->mu);
      return c;
    }
    conn_unlink_locked(&dp->outs, c);
    break;
  }
  pthread_mutex_unlock(&dp->mu);

  char why[200];
  int fd = dial(dp, cl, addr, deadline, why, sizeof why);
  if (fd < 0 && dp__check_lost(dp, cl, err)) return NULL;
  if (fd < 0) {
    error_set(err, ERR_REMOTE_FAILURE, "%s on comm %llu: rank %u at %s is unreachable: %s", what,
              (unsigned long long)comm_id, peer, addr, why);
    return NULL;
  }
  uint8_t hello[DP_HELLO_LEN] = {0};
  dp__put32(hello, DP_MAGIC_HELLO);
  dp__put32(hello + 4, peer);
  dp__put32(hello + 8, dp->rank);
  dp__put64(hello + 16, comm_id);
  if (write_all(dp, fd, hello, sizeof hello, deadline) != 0) {
    error_set(err, ERR_REMOTE_FAILURE, "%s on comm %llu: rank %u at %s did not take a connection: %s",
              what, (unsigned long long)comm_id, peer, addr, strerror(errno));
    close(fd);
    return NULL;
  }
  conn_t *c = calloc(1, sizeof *c);
  if (!c) {
    close(fd);
    error_set(err, ERR_QUOTA, "%s: out of memory", what);
    return NULL;
  }
  c->fd = fd;
  c->refs = 2;
  c->linked = true;
  c->comm_id = comm_id;
  c->peer = peer;
  snprintf(c->addr, sizeof c->addr, "%s", addr);
  pthread_mutex_lock(&dp->mu);
  c->next = dp->outs;
  dp->outs = c;
  pthread_mutex_unlock(&dp->mu);
  return c;
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
    while (c && (c->comm_id != comm_id || c->peer != peer)) c = c->next;
    if (c && !in_alive(c)) {
      conn_unlink_locked(&dp->ins, c);
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
            what, (unsigned long long)comm_id, peer, addr, dp->timeout_ms);
  return NULL;
}

/* ----------------------------------------------------------------- listener */

static void file_accepted(dataplane_t *dp, pending_t *p) {
  uint32_t magic = dp__get32(p->hello), to = dp__get32(p->hello + 4), from = dp__get32(p->hello + 8);
  uint64_t comm_id = dp__get64(p->hello + 16);
  if (magic != DP_MAGIC_HELLO || to != dp->rank) {
    log_warn("agent", "data plane: dropped a connection that is not for rank %u (magic %08x, to %u)",
             dp->rank, magic, to);
    close(p->fd);
    return;
  }
  conn_t *c = calloc(1, sizeof *c);
  if (!c) {
    close(p->fd);
    return;
  }
  c->fd = p->fd;
  c->refs = 1;
  c->linked = true;
  c->comm_id = comm_id;
  c->peer = from;
  snprintf(c->addr, sizeof c->addr, "rank %u", from);
  pthread_mutex_lock(&dp->mu);
  if (dp->stopping) { /* nothing will take it any more */
    pthread_mutex_unlock(&dp->mu);
    close(c->fd);
    free(c);
    return;
  }
  for (conn_t *o = dp->ins; o; o = o->next) {
    if (o->comm_id == comm_id && o->peer == from) { /* the peer re-dialed: the old one is dead */
      conn_unlink_locked(&dp->ins, o);
      break;
    }
  }
  c->next = dp->ins;
  dp->ins = c;
  pthread_cond_broadcast(&dp->cv);
  pthread_mutex_unlock(&dp->mu);
}

/* Accepts connections and reads their handshakes without ever blocking on one. */
static void *listener_main(void *arg) {
  dataplane_t *dp = arg;
  pending_t pend[DP_PENDING_MAX];
  size_t np = 0;
  struct pollfd pfds[DP_PENDING_MAX + 2];
  for (;;) {
    pfds[0] = (struct pollfd){.fd = dp->wake[0], .events = POLLIN};
    pfds[1] = (struct pollfd){.fd = dp->lfd, .events = POLLIN};
    for (size_t i = 0; i < np; i++) pfds[i + 2] = (struct pollfd){.fd = pend[i].fd, .events = POLLIN};
    int n = poll(pfds, (nfds_t)(np + 2), np ? 100 : -1);
    if (n < 0 && errno != EINTR) break;
    if (pfds[0].revents) break;
    int64_t now = dp__now_ms();
    size_t keep = 0;
    for (size_t i = 0; i < np; i++) {
      pending_t *p = &pend[i];
      bool done = false, bad = false;
      if (pfds[i + 2].revents) {
        ssize_t r = recv(p->fd, p->hello + p->got, DP_HELLO_LEN - p->got, MSG_DONTWAIT);
        if (r > 0) p->got += (size_t)r;
        else if (r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) bad = true;
        done = p->got == DP_HELLO_LEN;
      }
      if (done) file_accepted(dp, p);
      else if (bad || now > p->deadline) close(p->fd);
      else pend[keep++] = *p;
    }
    np = keep;
    if (pfds[1].revents & POLLIN) {
      for (;;) {
        int fd = accept4(dp->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;
        if (np == DP_PENDING_MAX) {
          close(fd);
          continue;
        }
        set_nodelay(fd);
        pend[np++] = (pending_t){.fd = fd, .got = 0, .deadline = now + dp->timeout_ms};
      }
    }
  }
  for (size_t i = 0; i < np; i++) close(pend[i].fd);
  return NULL;
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
  dp->lfd = dp->wake[0] = dp->wake[1] = -1;
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
  if (pipe2(dp->wake, O_CLOEXEC) != 0) {
    error_set(err, ERR_UNAVAILABLE, "data plane: pipe: %s", strerror(errno));
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
  if (dp->wake[0] >= 0) close(dp->wake[0]);
  if (dp->wake[1] >= 0) close(dp->wake[1]);
  free(dp);
  return NULL;
}

int dataplane_port(const dataplane_t *dp) { return dp ? dp->port : -1; }

void dataplane_shutdown(dataplane_t *dp) {
  if (!dp) return;
  pthread_mutex_lock(&dp->mu);
  bool first = !dp->stopping;
  dp->stopping = true;
  conn_t **lists[2] = {&dp->ins, &dp->outs};
  for (int l = 0; l < 2; l++)
    while (*lists[l]) conn_unlink_locked(lists[l], *lists[l]);
  pthread_cond_broadcast(&dp->cv);
  while (dp->active > 0) pthread_cond_wait(&dp->cv, &dp->mu);
  pthread_mutex_unlock(&dp->mu);
  if (!first) return;
  ssize_t w;
  do w = write(dp->wake[1], "x", 1);
  while (w < 0 && errno == EINTR);
  pthread_join(dp->listener, NULL);
  close(dp->lfd); /* peers dialing us now are refused */
  dp->lfd = -1;
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
  pthread_mutex_destroy(&dp->mu);
  free(dp);
}
