/* The cpu agents' TCP data plane (agent/dataplane.h).
 *
 * Connections. One TCP connection per (comm_id, ordered pair of agents), used in
 * one direction: the sender dials the receiver's data port and opens with a
 * handshake {magic, to_rank, from_rank, comm_id}; the receiver's listener thread
 * files the accepted socket under (comm_id, from_rank). So nobody has to decide
 * who dials, two agents never race to build the same link, and a ring step
 * (send to next, receive from previous) touches two sockets that are each
 * driven in one direction. Both ends cache their connection; the only bytes that
 * travel "backwards" are an abort notice (below).
 *
 * Framing. A message is split into frames of at most DP_CHUNK bytes, each with a
 * header {magic, length, comm_id, seq}; seq counts frames on the connection, so a
 * desynchronised or misaddressed stream is detected rather than misread. A
 * zero-length message is one empty frame.
 *
 * Progress. Every call runs its transfers in one thread on non-blocking sockets
 * with poll(2): all sends and receives of a call progress together (full
 * duplex). Received chunks are reduced as they complete, and a ring step's send
 * is gated on the previous step's received-and-reduced bytes, so the ring is
 * pipelined chunk by chunk across steps.
 *
 * Failure. Every wait is bounded by timeout_ms of *inactivity* (no byte moved),
 * so a large transfer may take longer than the timeout but a vanished or absent
 * peer fails the call. A rank that fails writes an abort frame carrying the root
 * cause on every connection of the call (both directions), then closes all of
 * the comm's connections; its peers fail at once with that root cause, so every
 * rank names the peer that really went missing. The next call on the comm dials
 * afresh. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "dataplane_internal.h"
#include "log.h"

#define DP_CHUNK ((size_t)1 << 20)      /* bytes per frame */
#define DP_DIRECT_MAX ((size_t)64 << 10) /* ring above this many bytes per member */
#define DP_MAGIC_HELLO 0x4d445048u     /* "MDPH" */
#define DP_MAGIC_DATA 0x4d445044u      /* "MDPD" */
#define DP_MAGIC_ABORT 0x4d445041u     /* "MDPA" */
#define DP_HELLO_LEN 24
#define DP_HDR_LEN 24
#define DP_ABORT_MAX 480 /* bytes of root cause carried in an abort frame */
#define DP_PENDING_MAX 256
#define DP_ADDR_MAX 96

/* ------------------------------------------------------------------ helpers */

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
  return v;
}
static uint64_t get64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}

static size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

/* ------------------------------------------------------------------- types */

/* A connection, owned by its table (while linked) and by each call using it:
 * refs counts both; the last put closes the socket. */
typedef struct conn {
  struct conn *next;
  int fd;
  int refs;
  bool linked;
  uint64_t comm_id;
  uint32_t peer;
  uint64_t seq; /* frames sent (dialed conn) or received (accepted conn) */
  char addr[DP_ADDR_MAX];
} conn_t;

typedef struct pending {
  int fd;
  size_t got;
  int64_t deadline;
  uint8_t hello[DP_HELLO_LEN];
} pending_t;

struct dataplane {
  uint32_t rank;
  int timeout_ms;
  int port;
  int lfd;
  int wake[2];
  pthread_t listener;
  pthread_mutex_t mu;
  pthread_cond_t cv; /* an accepted connection was filed; a call left; stopping */
  conn_t *ins;       /* accepted: we receive from (comm_id, peer) */
  conn_t *outs;      /* dialed: we send to (comm_id, peer) */
  bool stopping;
  int active; /* calls in progress */
  /* Ring scratch buffers kept between calls: a fresh 100 MB malloc per call
   * would page-fault (and zero) every page again. One per concurrent call. */
  struct scratch *spare;
  int nspare;
};

typedef struct scratch {
  struct scratch *next;
  size_t cap;
  uint8_t data[];
} scratch_t;

#define SCRATCH_KEEP 4

static uint8_t *scratch_get(dataplane_t *dp, size_t bytes) {
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

static void scratch_put(dataplane_t *dp, uint8_t *data) {
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

static void conn_put(dataplane_t *dp, conn_t *c) {
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

static void drop_comm(dataplane_t *dp, uint64_t comm_id) {
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

static int call_enter(dataplane_t *dp, const char *what, meshd_error_t *err) {
  pthread_mutex_lock(&dp->mu);
  bool stopping = dp->stopping;
  if (!stopping) dp->active++;
  pthread_mutex_unlock(&dp->mu);
  if (stopping) return error_set(err, ERR_UNAVAILABLE, "%s: the data plane is stopping", what);
  return 0;
}

static void call_leave(dataplane_t *dp) {
  pthread_mutex_lock(&dp->mu);
  dp->active--;
  pthread_cond_broadcast(&dp->cv);
  pthread_mutex_unlock(&dp->mu);
}

static bool is_stopping(dataplane_t *dp) {
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
    int64_t left = deadline - now_ms();
    if (left <= 0 || is_stopping(dp)) {
      errno = ETIMEDOUT;
      return -1;
    }
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    poll(&p, 1, (int)min_sz((size_t)left, 200));
  }
  return 0;
}

/* Connects to addr, retrying refused connections (the peer may not listen
 * yet) until deadline. Returns a non-blocking socket, or -1 with `why` set. */
static int dial(dataplane_t *dp, const char *addr, int64_t deadline, char *why, size_t whylen) {
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
        int64_t left = deadline - now_ms();
        if (left <= 0 || is_stopping(dp)) {
          errno = ETIMEDOUT;
          break;
        }
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        int n = poll(&p, 1, (int)min_sz((size_t)left, 200));
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
    int64_t left = deadline - now_ms();
    if (left <= 0 || is_stopping(dp) || last_errno == ETIMEDOUT) break;
    struct timespec ts = {0, (long)min_sz((size_t)backoff, (size_t)left) * 1000000L};
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

static conn_t *get_out(dataplane_t *dp, const char *what, uint64_t comm_id, uint32_t peer,
                       const char *addr, int64_t deadline, meshd_error_t *err) {
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
  int fd = dial(dp, addr, deadline, why, sizeof why);
  if (fd < 0) {
    error_set(err, ERR_REMOTE_FAILURE, "%s on comm %llu: rank %u at %s is unreachable: %s", what,
              (unsigned long long)comm_id, peer, addr, why);
    return NULL;
  }
  uint8_t hello[DP_HELLO_LEN] = {0};
  put32(hello, DP_MAGIC_HELLO);
  put32(hello + 4, peer);
  put32(hello + 8, dp->rank);
  put64(hello + 16, comm_id);
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
static conn_t *get_in(dataplane_t *dp, const char *what, uint64_t comm_id, uint32_t peer,
                      const char *addr, int64_t deadline, const conn_t *const *watch,
                      size_t nwatch, size_t *fired, meshd_error_t *err) {
  pthread_mutex_lock(&dp->mu);
  for (;;) {
    if (dp->stopping) {
      pthread_mutex_unlock(&dp->mu);
      error_set(err, ERR_UNAVAILABLE, "%s: the data plane is stopping", what);
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
    int64_t left = deadline - now_ms();
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
  uint32_t magic = get32(p->hello), to = get32(p->hello + 4), from = get32(p->hello + 8);
  uint64_t comm_id = get64(p->hello + 16);
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
    int64_t now = now_ms();
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

void dataplane_stop(dataplane_t *dp) {
  if (!dp) return;
  pthread_mutex_lock(&dp->mu);
  dp->stopping = true;
  conn_t **lists[2] = {&dp->ins, &dp->outs};
  for (int l = 0; l < 2; l++)
    while (*lists[l]) conn_unlink_locked(lists[l], *lists[l]);
  pthread_cond_broadcast(&dp->cv);
  while (dp->active > 0) pthread_cond_wait(&dp->cv, &dp->mu);
  pthread_mutex_unlock(&dp->mu);
  ssize_t w;
  do w = write(dp->wake[1], "x", 1);
  while (w < 0 && errno == EINTR);
  pthread_join(dp->listener, NULL);
  close(dp->lfd);
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

/* ------------------------------------------------------------ transfer engine */

/* One message on a connection. Send: buf[0, len) leaves in frames, frame k only
 * once *gate >= its end (gate NULL: all ready). Receive: frames land in buf; with
 * `into`, each completed frame is then reduced into `into` at the same offset. */
typedef struct msg {
  uint8_t *buf;
  size_t len;
  uint8_t *into;
  const size_t *gate;
  size_t done; /* bytes sent, or received (and reduced) */
  size_t frames;
} msg_t;

/* A sequence of messages on one connection in one direction. */
typedef struct xfer {
  conn_t *c;
  bool send;
  msg_t *msgs;
  size_t nmsgs, cur;
  bool in_frame, blocked;
  uint8_t hdr[DP_HDR_LEN];
  size_t hdr_done, flen, fdone;
} xfer_t;

typedef struct call {
  dataplane_t *dp;
  const char *what;
  uint64_t comm_id;
  dtype_t dtype;
  dp_reduce_t op;
  char root[sizeof ((meshd_error_t *)0)->msg]; /* the root cause, passed on in abort frames */
} call_t;

static bool msg_done(const msg_t *m) { return m->done == m->len && m->frames > 0; }

static int peer_error(call_t *cl, const conn_t *c, meshd_error_t *err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int peer_error(call_t *cl, const conn_t *c, meshd_error_t *err, const char *fmt, ...) {
  char detail[400];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  error_set(err, ERR_REMOTE_FAILURE, "%s on comm %llu: rank %u at %s %s", cl->what,
            (unsigned long long)cl->comm_id, c->peer, c->addr, detail);
  snprintf(cl->root, sizeof cl->root, "%s", err ? err->msg : detail);
  return -1;
}

/* Reads an abort frame's text that the peer may have left on c (best effort). */
static bool read_abort(int fd, const uint8_t *hdr, char *text, size_t textlen) {
  if (get32(hdr) != DP_MAGIC_ABORT) return false;
  size_t len = min_sz(get32(hdr + 4), DP_ABORT_MAX);
  size_t got = 0;
  int64_t deadline = now_ms() + 200;
  while (got < len && now_ms() < deadline) {
    ssize_t r = recv(fd, text + got, len - got, MSG_DONTWAIT);
    if (r > 0) got += (size_t)r;
    else if (r == 0 || (errno != EAGAIN && errno != EINTR)) break;
    else {
      struct pollfd p = {.fd = fd, .events = POLLIN};
      poll(&p, 1, 50);
    }
  }
  text[min_sz(got, textlen - 1)] = '\0';
  return true;
}

static int aborted(call_t *cl, const conn_t *c, const char *text, meshd_error_t *err) {
  error_set(err, ERR_REMOTE_FAILURE, "%s on comm %llu: rank %u at %s aborted: %s", cl->what,
            (unsigned long long)cl->comm_id, c->peer, c->addr, text);
  snprintf(cl->root, sizeof cl->root, "%s", text);
  return -1;
}

/* The peer wrote on a connection we only send on: an abort notice or EOF. */
static int send_side_closed(call_t *cl, xfer_t *x, meshd_error_t *err) {
  uint8_t hdr[DP_HDR_LEN];
  char text[DP_ABORT_MAX + 1];
  ssize_t r = recv(x->c->fd, hdr, sizeof hdr, MSG_DONTWAIT | MSG_WAITALL);
  if (r == (ssize_t)sizeof hdr && read_abort(x->c->fd, hdr, text, sizeof text))
    return aborted(cl, x->c, text, err);
  return peer_error(cl, x->c, err, "closed the connection (it failed or stopped)");
}

/* Moves what it can without blocking; returns bytes moved or -1. */
static ssize_t send_step(call_t *cl, xfer_t *x, meshd_error_t *err) {
  size_t moved = 0;
  x->blocked = false;
  while (x->cur < x->nmsgs) {
    msg_t *m = &x->msgs[x->cur];
    if (!x->in_frame) {
      if (msg_done(m)) {
        x->cur++;
        continue;
      }
      size_t flen = min_sz(DP_CHUNK, m->len - m->done);
      if (m->gate && *m->gate < m->done + flen) {
        x->blocked = true;
        break;
      }
      put32(x->hdr, DP_MAGIC_DATA);
      put32(x->hdr + 4, (uint32_t)flen);
      put64(x->hdr + 8, cl->comm_id);
      put64(x->hdr + 16, x->c->seq);
      x->flen = flen;
      x->hdr_done = x->fdone = 0;
      x->in_frame = true;
    }
    struct iovec iov[2];
    int k = 0;
    if (x->hdr_done < DP_HDR_LEN)
      iov[k++] = (struct iovec){x->hdr + x->hdr_done, DP_HDR_LEN - x->hdr_done};
    if (x->fdone < x->flen)
      iov[k++] = (struct iovec){m->buf + m->done + x->fdone, x->flen - x->fdone};
    if (k > 0) {
      struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)k};
      ssize_t w = sendmsg(x->c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        return send_side_closed(cl, x, err);
      }
      size_t ww = (size_t)w, h = min_sz(ww, DP_HDR_LEN - x->hdr_done);
      moved += ww;
      x->hdr_done += h;
      x->fdone += ww - h;
    }
    if (x->hdr_done == DP_HDR_LEN && x->fdone == x->flen) {
      m->done += x->flen;
      m->frames++;
      x->c->seq++;
      x->in_frame = false;
    }
  }
  return (ssize_t)moved;
}

static ssize_t recv_step(call_t *cl, xfer_t *x, meshd_error_t *err) {
  size_t moved = 0, esz = dtype_size(cl->dtype);
  while (x->cur < x->nmsgs) {
    msg_t *m = &x->msgs[x->cur];
    if (!x->in_frame) {
      if (msg_done(m)) {
        x->cur++;
        continue;
      }
      ssize_t r = recv(x->c->fd, x->hdr + x->hdr_done, DP_HDR_LEN - x->hdr_done, MSG_DONTWAIT);
      if (r == 0) return peer_error(cl, x->c, err, "closed the connection (it failed or stopped)");
      if (r < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        return peer_error(cl, x->c, err, "broke the connection: %s", strerror(errno));
      }
      moved += (size_t)r;
      x->hdr_done += (size_t)r;
      if (x->hdr_done < DP_HDR_LEN) continue;
      x->hdr_done = 0;
      char text[DP_ABORT_MAX + 1];
      if (read_abort(x->c->fd, x->hdr, text, sizeof text)) return aborted(cl, x->c, text, err);
      size_t want = min_sz(DP_CHUNK, m->len - m->done), flen = get32(x->hdr + 4);
      uint64_t seq = get64(x->hdr + 16);
      if (get32(x->hdr) != DP_MAGIC_DATA || get64(x->hdr + 8) != cl->comm_id)
        return peer_error(cl, x->c, err, "sent a frame that is not data for this comm");
      if (seq != x->c->seq || flen != want)
        return peer_error(cl, x->c, err,
                          "sent frame %llu of %zu bytes where frame %llu of %zu bytes was expected "
                          "(do all members call with the same arguments?)",
                          (unsigned long long)seq, flen, (unsigned long long)x->c->seq, want);
      x->flen = flen;
      x->fdone = 0;
      x->in_frame = true;
    }
    if (x->fdone < x->flen) {
      ssize_t r = recv(x->c->fd, m->buf + m->done + x->fdone, x->flen - x->fdone, MSG_DONTWAIT);
      if (r == 0) return peer_error(cl, x->c, err, "closed the connection (it failed or stopped)");
      if (r < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        return peer_error(cl, x->c, err, "broke the connection: %s", strerror(errno));
      }
      moved += (size_t)r;
      x->fdone += (size_t)r;
    }
    if (x->fdone == x->flen) {
      if (m->into && x->flen > 0)
        dp_reduce_apply(cl->op, cl->dtype, m->into + m->done, m->buf + m->done, x->flen / esz);
      m->done += x->flen;
      m->frames++;
      x->c->seq++;
      x->in_frame = false;
    }
  }
  return (ssize_t)moved;
}

/* Runs every transfer to completion, or fails after timeout_ms without progress. */
static int run(call_t *cl, xfer_t *xs, size_t nx, meshd_error_t *err) {
  dataplane_t *dp = cl->dp;
  struct pollfd *pfds = calloc(nx ? nx : 1, sizeof *pfds);
  size_t *which = calloc(nx ? nx : 1, sizeof *which);
  int ret = -1;
  if (!pfds || !which) {
    error_set(err, ERR_QUOTA, "%s: out of memory", cl->what);
    snprintf(cl->root, sizeof cl->root, "%s", err ? err->msg : "out of memory");
    goto out;
  }
  int64_t last = now_ms();
  for (;;) {
    /* Until nothing moves: a receive may have opened a send's gate. */
    bool moved = false, again = true;
    while (again) {
      again = false;
      for (size_t i = 0; i < nx; i++) {
        if (xs[i].cur >= xs[i].nmsgs) continue;
        ssize_t r = xs[i].send ? send_step(cl, &xs[i], err) : recv_step(cl, &xs[i], err);
        if (r < 0) goto out;
        again |= r > 0;
      }
      moved |= again;
    }
    nfds_t np = 0;
    for (size_t i = 0; i < nx; i++) {
      if (xs[i].cur >= xs[i].nmsgs) continue;
      short ev = POLLIN; /* on a send connection: the peer's abort notice or EOF */
      if (xs[i].send && !xs[i].blocked) ev |= POLLOUT;
      pfds[np] = (struct pollfd){.fd = xs[i].c->fd, .events = ev};
      which[np++] = i;
    }
    if (np == 0) break;
    int64_t now = now_ms();
    if (moved) last = now;
    if (is_stopping(dp)) {
      error_set(err, ERR_UNAVAILABLE, "%s on comm %llu: the data plane is stopping", cl->what,
                (unsigned long long)cl->comm_id);
      snprintf(cl->root, sizeof cl->root, "rank %u stopped its data plane", dp->rank);
      goto out;
    }
    /* A connected peer that is silent may itself be waiting for an absent one;
     * give that wait (bounded by timeout_ms) a head start so that its abort,
     * which names the absent member, arrives before we blame the silent one. */
    int64_t grace = dp->timeout_ms / 4 < 500 ? dp->timeout_ms / 4 : 500;
    int64_t left = last + dp->timeout_ms + grace - now;
    if (left <= 0) {
      xfer_t *w = &xs[which[0]]; /* name a peer we wait to hear from, if any */
      for (nfds_t i = 0; i < np; i++)
        if (!xs[which[i]].send) {
          w = &xs[which[i]];
          break;
        }
      peer_error(cl, w->c, err, "made no progress for %lld ms (%s)",
                 (long long)(dp->timeout_ms + grace),
                 w->send ? "not reading what we send" : "sent nothing");
      goto out;
    }
    int n = poll(pfds, np, (int)min_sz((size_t)left, 200));
    if (n < 0 && errno != EINTR) {
      error_set(err, ERR_UNAVAILABLE, "%s: poll: %s", cl->what, strerror(errno));
      goto out;
    }
    for (nfds_t i = 0; n > 0 && i < np; i++) {
      xfer_t *x = &xs[which[i]];
      if (x->send && (pfds[i].revents & (POLLIN | POLLHUP | POLLERR))) {
        send_side_closed(cl, x, err);
        goto out;
      }
    }
  }
  ret = 0;
out:
  free(pfds);
  free(which);
  return ret;
}

/* After a failure: tell every peer of the call why, on each connection of the
 * call (best effort, skipping a send connection we are mid-frame on). */
static void send_aborts(call_t *cl, xfer_t *xs, size_t nx) {
  size_t len = min_sz(strlen(cl->root), DP_ABORT_MAX);
  uint8_t frame[DP_HDR_LEN + DP_ABORT_MAX];
  put32(frame, DP_MAGIC_ABORT);
  put32(frame + 4, (uint32_t)len);
  put64(frame + 8, cl->comm_id);
  put64(frame + 16, 0);
  memcpy(frame + DP_HDR_LEN, cl->root, len);
  for (size_t i = 0; i < nx; i++) {
    if (!xs[i].c || (xs[i].send && xs[i].in_frame)) continue;
    ssize_t w = send(xs[i].c->fd, frame, DP_HDR_LEN + len, MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)w;
  }
}

/* ------------------------------------------------------------- collectives */

/* The connections of a call: xs[2*i] sends to peer slot i, xs[2*i+1] receives. */
typedef struct plan {
  call_t cl;
  xfer_t *xs;
  size_t nx;
  msg_t *msgs;
} plan_t;

static int plan_init(plan_t *p, dataplane_t *dp, const char *what, uint64_t comm_id, dtype_t dtype,
                     dp_reduce_t op, size_t nx, size_t nmsgs, meshd_error_t *err) {
  memset(p, 0, sizeof *p);
  p->cl = (call_t){.dp = dp, .what = what, .comm_id = comm_id, .dtype = dtype, .op = op};
  p->xs = calloc(nx ? nx : 1, sizeof *p->xs);
  p->msgs = calloc(nmsgs ? nmsgs : 1, sizeof *p->msgs);
  p->nx = nx;
  if (!p->xs || !p->msgs) return error_set(err, ERR_QUOTA, "%s: out of memory", what);
  return 0;
}

/* Connects xs[k] (send to, or receive from, g's member `peer`). */
static int plan_connect(plan_t *p, const dp_group_t *g, size_t k, size_t peer, bool send,
                        int64_t deadline, meshd_error_t *err) {
  xfer_t *x = &p->xs[k];
  x->send = send;
  if (send) {
    x->c = get_out(p->cl.dp, p->cl.what, p->cl.comm_id, g->ranks[peer], g->addrs[peer], deadline,
                   err);
  } else {
    const conn_t *watch[64];
    size_t nwatch = 0, fired = SIZE_MAX;
    for (size_t i = 0; i < p->nx && nwatch < 64; i++)
      if (p->xs[i].send && p->xs[i].c) watch[nwatch++] = p->xs[i].c;
    x->c = get_in(p->cl.dp, p->cl.what, p->cl.comm_id, g->ranks[peer], g->addrs[peer], deadline,
                  watch, nwatch, &fired, err);
    if (!x->c && fired != SIZE_MAX) {
      for (size_t i = 0; i < p->nx; i++)
        if (p->xs[i].c == watch[fired]) return send_side_closed(&p->cl, &p->xs[i], err);
    }
  }
  if (!x->c) {
    snprintf(p->cl.root, sizeof p->cl.root, "%s", err ? err->msg : "connection failed");
    return -1;
  }
  return 0;
}

/* Dials every send connection first (that needs only the peer's listener), then
 * waits for every receive connection (that needs the peer to be in the call). */
static int plan_connect_all(plan_t *p, const dp_group_t *g, const size_t *peers, size_t npeers,
                            meshd_error_t *err) {
  int64_t deadline = now_ms() + p->cl.dp->timeout_ms;
  for (size_t i = 0; i < npeers; i++)
    if (plan_connect(p, g, 2 * i, peers[i], true, deadline, err) != 0) return -1;
  for (size_t i = 0; i < npeers; i++)
    if (plan_connect(p, g, 2 * i + 1, peers[i], false, deadline, err) != 0) return -1;
  return 0;
}

static int plan_finish(plan_t *p, int rc) {
  if (rc != 0 && p->xs) { /* then close the comm: the next call starts from fresh links */
    send_aborts(&p->cl, p->xs, p->nx);
    drop_comm(p->cl.dp, p->cl.comm_id);
  }
  if (p->xs)
    for (size_t i = 0; i < p->nx; i++) conn_put(p->cl.dp, p->xs[i].c);
  free(p->xs);
  free(p->msgs);
  return rc;
}

static int check_group(dataplane_t *dp, const char *what, const dp_group_t *g, size_t count,
                       dtype_t dtype, size_t mult, meshd_error_t *err) {
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
  size_t esz = dtype_size(dtype);
  if (esz == 0) return error_set(err, ERR_BAD_ARGUMENT, "%s: unknown dtype %d", what, (int)dtype);
  if (count > SIZE_MAX / esz / mult / g->n)
    return error_set(err, ERR_BAD_ARGUMENT, "%s: %zu elements is too large", what, count);
  return 0;
}

static int check_op(const char *what, dp_reduce_t op, dtype_t dtype, meshd_error_t *err) {
  if (dp_reduce_check(op, dtype, err) == 0) return 0;
  if (err) error_prefix(err, what, ": ");
  return -1;
}

static size_t ring_back(size_t me, size_t back, size_t n) { return (me + n - back % n) % n; }

/* Ring over n members on buf, segment i = [off[i], off[i+1]) elements.
 * rs: n-1 reduce-scatter steps, after which member me holds segment me reduced;
 * ag: n-1 all-gather steps from "member i holds segment i". Send step k+1 is
 * gated on receive step k, which received (and reduced) the very segment it
 * sends, so chunks flow around the ring without waiting for whole steps. */
static int ring(dataplane_t *dp, const char *what, const dp_group_t *g, uint8_t *buf,
                const size_t *off, dtype_t dtype, dp_reduce_t op, bool rs, bool ag,
                meshd_error_t *err) {
  size_t n = g->n, me = g->me, esz = dtype_size(dtype);
  size_t steps = (rs ? n - 1 : 0) + (ag ? n - 1 : 0);
  plan_t p;
  uint8_t *scratch = NULL;
  int rc = plan_init(&p, dp, what, g->comm_id, dtype, op, 2, 2 * steps, err);
  if (rc != 0) goto out;
  size_t maxseg = 0;
  for (size_t i = 0; i < n; i++) maxseg = off[i + 1] - off[i] > maxseg ? off[i + 1] - off[i] : maxseg;
  if (rs && !(scratch = scratch_get(dp, maxseg > 0 ? maxseg * esz : 1))) {
    rc = error_set(err, ERR_QUOTA, "%s: out of memory", what);
    goto out;
  }
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
  size_t peers[2] = {next, prev};
  int64_t deadline = now_ms() + dp->timeout_ms;
  rc = plan_connect(&p, g, 0, peers[0], true, deadline, err);
  if (rc == 0) rc = plan_connect(&p, g, 1, peers[1], false, deadline, err);
  if (rc == 0) rc = run(&p.cl, p.xs, 2, err);
out:
  scratch_put(dp, scratch);
  return plan_finish(&p, rc);
}

/* Every member sends sends[j] to member j and receives recvs[j] from it, all at once. */
static int direct(dataplane_t *dp, const char *what, const dp_group_t *g, dtype_t dtype,
                  uint8_t *const *sends, uint8_t *const *recvs, size_t bytes, meshd_error_t *err) {
  size_t n = g->n, np = n - 1;
  plan_t p;
  int rc = plan_init(&p, dp, what, g->comm_id, dtype, DP_SUM, 2 * np, 2 * np, err);
  size_t *peers = calloc(np ? np : 1, sizeof *peers);
  if (rc == 0 && !peers) rc = error_set(err, ERR_QUOTA, "%s: out of memory", what);
  if (rc != 0) goto out;
  for (size_t i = 0, j = 0; j < n; j++) {
    if (j == g->me) continue;
    peers[i] = j;
    p.msgs[2 * i] = (msg_t){.buf = sends[j], .len = bytes};
    p.msgs[2 * i + 1] = (msg_t){.buf = recvs[j], .len = bytes};
    p.xs[2 * i].msgs = &p.msgs[2 * i];
    p.xs[2 * i + 1].msgs = &p.msgs[2 * i + 1];
    p.xs[2 * i].nmsgs = p.xs[2 * i + 1].nmsgs = 1;
    i++;
  }
  rc = plan_connect_all(&p, g, peers, np, err);
  if (rc == 0) rc = run(&p.cl, p.xs, p.nx, err);
out:
  free(peers);
  return plan_finish(&p, rc);
}

static size_t *even_offsets(size_t n, size_t count) {
  size_t *off = malloc((n + 1) * sizeof *off);
  if (off)
    for (size_t i = 0; i <= n; i++) off[i] = i * (count / n) + i * (count % n) / n;
  return off;
}

static size_t *equal_offsets(size_t n, size_t count) {
  size_t *off = malloc((n + 1) * sizeof *off);
  if (off)
    for (size_t i = 0; i <= n; i++) off[i] = count * i;
  return off;
}

/* Reduces member slots in group order (slot me = mine), so every rank computes
 * bit-identical results. */
static void reduce_slots(dp_reduce_t op, dtype_t dtype, uint8_t *acc, uint8_t *const *slots,
                         size_t n, size_t count) {
  size_t bytes = count * dtype_size(dtype);
  if (acc != slots[0]) memmove(acc, slots[0], bytes);
  for (size_t i = 1; i < n; i++) dp_reduce_apply(op, dtype, acc, slots[i], count);
}

int dp_allreduce(dataplane_t *dp, const dp_group_t *g, void *buf, size_t count, dtype_t dtype,
                 dp_reduce_t op, meshd_error_t *err) {
  const char *what = "allreduce";
  if (check_group(dp, what, g, count, dtype, 1, err) != 0) return -1;
  if (check_op(what, op, dtype, err) != 0) return -1;
  size_t esz = dtype_size(dtype), bytes = count * esz, n = g->n;
  if (n == 1 || count == 0) return 0;
  if (call_enter(dp, what, err) != 0) return -1;
  int rc = -1;
  if (bytes > DP_DIRECT_MAX && count >= n) {
    size_t *off = even_offsets(n, count);
    rc = off ? ring(dp, what, g, buf, off, dtype, op, true, true, err)
             : error_set(err, ERR_QUOTA, "%s: out of memory", what);
    free(off);
  } else {
    uint8_t *store = malloc(bytes * n);
    uint8_t **slots = malloc(n * sizeof *slots), **sends = malloc(n * sizeof *sends);
    if (store && slots && sends) {
      for (size_t i = 0; i < n; i++) {
        slots[i] = i == g->me ? (uint8_t *)buf : store + i * bytes;
        sends[i] = buf;
      }
      rc = direct(dp, what, g, dtype, sends, slots, bytes, err);
      if (rc == 0) {
        reduce_slots(op, dtype, store + g->me * bytes, slots, n, count);
        memcpy(buf, store + g->me * bytes, bytes);
      }
    } else {
      rc = error_set(err, ERR_QUOTA, "%s: out of memory", what);
    }
    free(store);
    free(slots);
    free(sends);
  }
  if (rc == 0) dp_reduce_finish(op, dtype, buf, count, n);
  call_leave(dp);
  return rc;
}

int dp_reduce_scatter(dataplane_t *dp, const dp_group_t *g, const void *in, void *out, size_t count,
                      dtype_t dtype, dp_reduce_t op, meshd_error_t *err) {
  const char *what = "reduce_scatter";
  if (check_group(dp, what, g, count, dtype, 1, err) != 0) return -1;
  if (check_op(what, op, dtype, err) != 0) return -1;
  size_t esz = dtype_size(dtype), bytes = count * esz, n = g->n, me = g->me;
  if (count == 0) return 0;
  if (n == 1) {
    memmove(out, in, bytes);
    return 0;
  }
  if (call_enter(dp, what, err) != 0) return -1;
  int rc = -1;
  uint8_t *work = malloc(bytes * n);
  if (!work) {
    rc = error_set(err, ERR_QUOTA, "%s: out of memory", what);
  } else if (bytes * n > DP_DIRECT_MAX) {
    memcpy(work, in, bytes * n);
    size_t *off = equal_offsets(n, count);
    rc = off ? ring(dp, what, g, work, off, dtype, op, true, false, err)
             : error_set(err, ERR_QUOTA, "%s: out of memory", what);
    free(off);
    if (rc == 0) memcpy(out, work + me * bytes, bytes);
  } else {
    uint8_t **slots = malloc(n * sizeof *slots), **sends = malloc(n * sizeof *sends);
    if (slots && sends) {
      for (size_t i = 0; i < n; i++) {
        slots[i] = work + i * bytes;
        sends[i] = (uint8_t *)in + i * bytes;
      }
      memcpy(slots[me], sends[me], bytes);
      rc = direct(dp, what, g, dtype, sends, slots, bytes, err);
      if (rc == 0) reduce_slots(op, dtype, out, slots, n, count);
    } else {
      rc = error_set(err, ERR_QUOTA, "%s: out of memory", what);
    }
    free(slots);
    free(sends);
  }
  free(work);
  if (rc == 0) dp_reduce_finish(op, dtype, out, count, n);
  call_leave(dp);
  return rc;
}

int dp_allgather(dataplane_t *dp, const dp_group_t *g, const void *in, void *out, size_t count,
                 dtype_t dtype, meshd_error_t *err) {
  const char *what = "allgather";
  if (check_group(dp, what, g, count, dtype, 1, err) != 0) return -1;
  size_t esz = dtype_size(dtype), bytes = count * esz, n = g->n, me = g->me;
  if (count == 0) return 0;
  uint8_t *o = out;
  memmove(o + me * bytes, in, bytes);
  if (n == 1) return 0;
  if (call_enter(dp, what, err) != 0) return -1;
  int rc = -1;
  if (bytes * n > DP_DIRECT_MAX) {
    size_t *off = equal_offsets(n, count);
    rc = off ? ring(dp, what, g, o, off, dtype, DP_SUM, false, true, err)
             : error_set(err, ERR_QUOTA, "%s: out of memory", what);
    free(off);
  } else {
    uint8_t **slots = malloc(n * sizeof *slots), **sends = malloc(n * sizeof *sends);
    if (slots && sends) {
      for (size_t i = 0; i < n; i++) {
        slots[i] = o + i * bytes;
        sends[i] = o + me * bytes;
      }
      rc = direct(dp, what, g, dtype, sends, slots, bytes, err);
    } else {
      rc = error_set(err, ERR_QUOTA, "%s: out of memory", what);
    }
    free(slots);
    free(sends);
  }
  call_leave(dp);
  return rc;
}

int dp_alltoall(dataplane_t *dp, const dp_group_t *g, const void *in, void *out, size_t count,
                dtype_t dtype, meshd_error_t *err) {
  const char *what = "alltoall";
  if (check_group(dp, what, g, count, dtype, 1, err) != 0) return -1;
  size_t esz = dtype_size(dtype), bytes = count * esz, n = g->n, me = g->me;
  if (count == 0) return 0;
  memmove((uint8_t *)out + me * bytes, (const uint8_t *)in + me * bytes, bytes);
  if (n == 1) return 0;
  if (call_enter(dp, what, err) != 0) return -1;
  int rc = -1;
  uint8_t **slots = malloc(n * sizeof *slots), **sends = malloc(n * sizeof *sends);
  if (slots && sends) {
    for (size_t i = 0; i < n; i++) {
      slots[i] = (uint8_t *)out + i * bytes;
      sends[i] = (uint8_t *)in + i * bytes;
    }
    rc = direct(dp, what, g, dtype, sends, slots, bytes, err);
  } else {
    rc = error_set(err, ERR_QUOTA, "%s: out of memory", what);
  }
  free(slots);
  free(sends);
  call_leave(dp);
  return rc;
}

/* ------------------------------------------------------------ point to point */

static int p2p(dataplane_t *dp, bool send, uint64_t comm_id, uint32_t rank, const char *addr,
               void *buf, size_t bytes, meshd_error_t *err) {
  const char *what = send ? "send" : "recv";
  if (!dp || !addr || (!buf && bytes > 0))
    return error_set(err, ERR_BAD_ARGUMENT, "%s: needs a data plane, a peer address and a buffer",
                     what);
  if (call_enter(dp, what, err) != 0) return -1;
  plan_t p;
  int rc = plan_init(&p, dp, what, comm_id, DTYPE_UINT8, DP_SUM, 1, 1, err);
  if (rc == 0) {
    p.msgs[0] = (msg_t){.buf = buf, .len = bytes};
    p.xs[0] = (xfer_t){.send = send, .msgs = p.msgs, .nmsgs = 1};
    int64_t deadline = now_ms() + dp->timeout_ms;
    p.xs[0].c = send ? get_out(dp, what, comm_id, rank, addr, deadline, err)
                     : get_in(dp, what, comm_id, rank, addr, deadline, NULL, 0, NULL, err);
    if (!p.xs[0].c) {
      snprintf(p.cl.root, sizeof p.cl.root, "%s", err ? err->msg : "connection failed");
      rc = -1;
    }
  }
  if (rc == 0) rc = run(&p.cl, p.xs, 1, err);
  if (rc != 0 && p.xs && p.xs[0].c) {
    /* Only this pair's link is suspect; other pairs on the channel carry on. */
    send_aborts(&p.cl, p.xs, 1);
    pthread_mutex_lock(&dp->mu);
    conn_t *c = p.xs[0].c;
    if (c->linked) conn_unlink_locked(send ? &dp->outs : &dp->ins, c);
    pthread_mutex_unlock(&dp->mu);
  }
  plan_finish(&p, 0);
  call_leave(dp);
  return rc;
}

int dp_send(dataplane_t *dp, uint64_t comm_id, uint32_t to_rank, const char *addr, const void *buf,
            size_t bytes, meshd_error_t *err) {
  return p2p(dp, true, comm_id, to_rank, addr, (void *)buf, bytes, err);
}

int dp_recv(dataplane_t *dp, uint64_t comm_id, uint32_t from_rank, const char *addr, void *buf,
            size_t bytes, meshd_error_t *err) {
  return p2p(dp, false, comm_id, from_rank, addr, buf, bytes, err);
}
