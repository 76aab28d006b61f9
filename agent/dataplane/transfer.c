/* The agents' TCP transport (dataplane.h): the transfer engine.
 *
 * Framing. A message is split into frames of at most DP_CHUNK bytes, each with a
 * header {magic, length, comm_id, call, seq}; seq counts frames on the
 * connection, so a desynchronised or misaddressed stream is detected rather
 * than misread. A zero-length message is one empty frame.
 *
 * Calls. `call` numbers the calls of a comm, the same on every member. A
 * member that starts a call after its peers gave up on it (it was more than
 * timeout_ms late) finds their frames of a later call: it fails at once
 * (DP_ABORT_BEHIND), keeping the header for the call it belongs to, aborting
 * nobody and closing only a connection it left mid-frame; its next calls do
 * the same until it reaches the peers' call. The peers skip its frames of
 * the older call (and, when it closed a connection on which they saw only
 * such frames, wait for it to dial again). So a late member never pairs with
 * the wrong call, and the group is back in step without a timeout per call.
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
 * cause on every connection of the call (both directions) and closes them, and
 * does the same on the comm's links of this call it had not taken yet (not on
 * a later call's: a peer that moved on keeps its next call); its peers fail at
 * once with that root cause, so every rank names the peer that really went
 * missing. The next call dials afresh where a link was closed. */
#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "dp_internal.h"

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

/* Reads the text of an abort frame whose header is f (best effort): whether
 * all of it came. */
static bool read_abort(int fd, const dp_frame_t *f, char *text, size_t textlen) {
  size_t len = dp__min(f->len, textlen - 1);
  size_t got = 0;
  int64_t deadline = dp__now_ms() + 200;
  while (got < len && dp__now_ms() < deadline) {
    ssize_t r = recv(fd, text + got, len - got, MSG_DONTWAIT);
    if (r > 0) got += (size_t)r;
    else if (r == 0 || (errno != EAGAIN && errno != EINTR)) break;
    else {
      struct pollfd p = {.fd = fd, .events = POLLIN};
      poll(&p, 1, 50);
    }
  }
  text[got] = '\0';
  return got == f->len;
}

/* A peer's abort of call `at` (ours, or a later one: a refusal covers an
 * instruction's calls, dp_refuse) ended this call. */
static int aborted(call_t *cl, const conn_t *c, uint64_t at, const char *text, meshd_error_t *err) {
  if (at > cl->upto) cl->upto = at;
  error_set(err, ERR_REMOTE_FAILURE, "%s on comm %llu: rank %u at %s aborted: %s", cl->what,
            (unsigned long long)cl->comm_id, c->peer, c->addr, text);
  snprintf(cl->root, sizeof cl->root, "%s", text);
  cl->abort_reason = DP_ABORT_PEER_ABORTED + 1;
  return -1;
}

/* Nothing of this call was written on x's link yet. */
static bool unwritten(const xfer_t *x) {
  return x->cur == 0 && !x->in_frame && (x->nmsgs == 0 || (x->msgs[0].done == 0 && x->msgs[0].frames == 0));
}

/* The peer closed a link we send on after an abort of an older call, before
 * this call wrote on it: it failed that call (it was late) and closed its
 * links, this one included, though we had kept it for this call. A fresh one
 * serves (redial_out). */
#define SEND_REDIAL (-3)

/* Whether the peer hung up fd, waiting up to ms for it. */
static bool hung_up(int fd, int ms) {
  struct pollfd p = {.fd = fd, .events = POLLRDHUP};
  return poll(&p, 1, ms) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

/* The peer wrote on a connection we only send on: an abort notice or EOF.
 * An older call's abort on a link the peer keeps open is only news of that
 * call (its writer failed it): 0, and the call goes on; one followed at once
 * by the close (the link was that call's) and nothing written of this call:
 * SEND_REDIAL. An abort of this call behind it is read too. */
static int send_side_closed(call_t *cl, xfer_t *x, meshd_error_t *err) {
  for (;;) {
    uint8_t hdr[DP_HDR_LEN];
    char text[DP_ABORT_MAX + 1];
    dp_frame_t f;
    ssize_t r = recv(x->c->fd, hdr, sizeof hdr, MSG_DONTWAIT | MSG_WAITALL);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && x->stale) {
      /* an older call's abort was all: the close follows it at once, or not */
      if (!hung_up(x->c->fd, 20)) return 0;
      if (unwritten(x)) return SEND_REDIAL;
      return peer_error(cl, x->c, err, "closed the connection (it failed or stopped)");
    }
    if (r != (ssize_t)sizeof hdr ||
        dp_wire_parse_frame(hdr, cl->comm_id, cl->call, 0, 0, 0, &f) != DP_FRAME_ABORT)
      return peer_error(cl, x->c, err, "closed the connection (it failed or stopped)");
    bool whole = read_abort(x->c->fd, &f, text, sizeof text);
    if (f.call >= cl->call || !whole) return aborted(cl, x->c, f.call, text, err);
    x->stale = true; /* and read on: a later abort, or the close */
  }
}

/* SEND_REDIAL: x's link goes, and a fresh one to the same peer is dialed. */
static int redial_out(call_t *cl, xfer_t *x, meshd_error_t *err) {
  dataplane_t *dp = cl->dp;
  char addr[DP_ADDR_MAX];
  snprintf(addr, sizeof addr, "%s", x->c->addr);
  uint32_t peer = x->c->peer;
  dp__conn_discard(dp, x->c);
  dp__conn_put(dp, x->c);
  x->stale = false;
  x->c = dp__get_out(dp, cl, peer, addr, dp__now_ms() + dp__timeout(dp, cl->g), err);
  if (x->c) return 0;
  snprintf(cl->root, sizeof cl->root, "%s", err ? err->msg : "no connection");
  return -1;
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
      size_t flen = dp__min(DP_CHUNK, m->len - m->done);
      size_t past = m->gate ? *m->gate : m->len;
      bool shm = m->shm && *m->shm >= 0 && x->c->local && m->done == 0 && past >= m->len;
      if (!shm && ((m->gate && past < m->done + flen) ||
                   (m->shm && *m->shm < 0 && x->c->local && past == 0 && m->len > 0))) {
        x->blocked = true;
        break;
      }
      if (shm) {
        flen = DP_SHM_PAYLOAD;
        dp__put64(x->pay, m->len);
      }
      dp_wire_frame(x->hdr, shm ? DP_MAGIC_SHM : DP_MAGIC_DATA, (uint32_t)flen, cl->comm_id,
                    cl->call, x->c->seq);
      x->shm = shm;
      x->flen = flen;
      x->hdr_done = x->fdone = 0;
      x->in_frame = true;
    }
    struct iovec iov[2];
    int k = 0;
    if (x->hdr_done < DP_HDR_LEN)
      iov[k++] = (struct iovec){x->hdr + x->hdr_done, DP_HDR_LEN - x->hdr_done};
    if (x->fdone < x->flen)
      iov[k++] = (struct iovec){(x->shm ? x->pay : m->buf + m->done) + x->fdone, x->flen - x->fdone};
    if (k > 0) {
      struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)k};
      dp_fd_ctl_t ctl;
      if (x->shm && x->hdr_done == 0 && x->fdone == 0) /* the memfd rides on the first byte */
        dp_wire_attach_fd(&mh, &ctl, *m->shm);
      ssize_t w = sendmsg(x->c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        int saved = errno;
        int rc = send_side_closed(cl, x, err);
        if (rc == 0) /* the send failed: the link is no use, whatever came on it */
          return peer_error(cl, x->c, err, "broke the connection: %s", strerror(saved));
        return rc;
      }
      size_t ww = (size_t)w, h = dp__min(ww, DP_HDR_LEN - x->hdr_done);
      moved += ww;
      x->hdr_done += h;
      x->fdone += ww - h;
    }
    if (x->hdr_done == DP_HDR_LEN && x->fdone == x->flen) {
      m->done = x->shm ? m->len : m->done + x->flen;
      m->frames++;
      x->c->seq++;
      x->in_frame = false;
    }
  }
  return (ssize_t)moved;
}

/* recv, keeping a descriptor that comes along on a local connection in
 * x->rfd (any beyond the first is closed and marks x->stray_fd). */
static ssize_t recv_some(xfer_t *x, void *buf, size_t len) {
  if (!x->c->local) return recv(x->c->fd, buf, len, MSG_DONTWAIT);
  union {
    struct cmsghdr h;
    char b[CMSG_SPACE(4 * sizeof(int))];
  } ctl;
  struct iovec iov = {buf, len};
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.b,
                      .msg_controllen = sizeof ctl.b};
  ssize_t r = recvmsg(x->c->fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (r < 0) return r;
  if (mh.msg_flags & MSG_CTRUNC) x->stray_fd = true;
  for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
    if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
    size_t n = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < n; i++) {
      int fd;
      memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof fd);
      if (x->rfd == 0) {
        x->rfd = fd + 1;
      } else {
        close(fd);
        x->stray_fd = true;
      }
    }
  }
  return r;
}

/* A descriptor received and not handed on is closed when the plan finishes
 * (dp__plan_finish), whatever ended the call. */
static void drop_rfd(xfer_t *x) {
  if (x->rfd > 0) close(x->rfd - 1);
  x->rfd = 0;
}

static int stray_fd(call_t *cl, xfer_t *x, meshd_error_t *err) {
  return peer_error(cl, x->c, err, "passed a file descriptor that no frame of ours asks for");
}

/* A shared-memory frame is in: its memfd lands in m->buf (shm.c), then is
 * kept in *m->shm for a send to pass on, or closed. */
static int shm_landed(call_t *cl, xfer_t *x, msg_t *m, meshd_error_t *err) {
  char why[200];
  uint64_t count = dp__get64(x->pay);
  if (count != m->len)
    return peer_error(cl, x->c, err, "sent shared memory of %llu bytes for a message of %zu",
                      (unsigned long long)count, m->len);
  if (x->rfd == 0)
    return peer_error(cl, x->c, err, "sent a shared-memory frame without its memfd");
  int fd = x->rfd - 1, landed = dp__shm_land(fd, m->buf, m->len, m->map, why, sizeof why);
  if (landed < 0) return peer_error(cl, x->c, err, "%s", why);
  atomic_fetch_add(&cl->dp->shm_in, 1);
  if (landed) atomic_fetch_add(&cl->dp->shm_mapped, 1);
  x->rfd = 0;
  if (m->shm && *m->shm < 0) *m->shm = fd;
  else close(fd);
  return 0;
}

/* A frame of a later call: this member is behind its group (transfer.c's
 * opening comment). The header (and its memfd) stay on the connection for
 * the call it belongs to. */
static int behind_at(call_t *cl, const conn_t *c, uint64_t at, meshd_error_t *err) {
  cl->abort_reason = DP_ABORT_BEHIND + 1;
  return peer_error(cl, c, err,
                    "is already at a later call of this comm (call %llu; this is call %llu): the "
                    "group gave up on this call before this member reached it (it ran more "
                    "than the comm timeout behind), so it fails here at once",
                    (unsigned long long)at, (unsigned long long)cl->call);
}

static int behind(call_t *cl, xfer_t *x, const dp_frame_t *f, meshd_error_t *err) {
  memcpy(x->c->held_hdr, x->hdr, DP_HDR_LEN);
  x->c->held_len = DP_HDR_LEN;
  x->c->held_rfd = x->rfd;
  x->rfd = 0;
  return behind_at(cl, x->c, f->call, err);
}

/* The peer closed a connection on which it sent nothing of this call: it
 * was behind and left a frame of an older call unfinished, it closed the
 * connection idle (a goodbye frame), or it has dialed another since (its
 * failed older call closed this one). It dials again for this call. */
#define RECV_REDIAL (-2)

static ssize_t recv_closed(call_t *cl, xfer_t *x, ssize_t r, meshd_error_t *err) {
  int saved = errno;
  if (!x->mine && x->stale) return RECV_REDIAL;
  if (!x->mine && dp__superseded(cl->dp, x->c)) {
    x->superseded = true; /* a failed peer's link, or one it closed for a later call */
    return RECV_REDIAL;
  }
  errno = saved;
  if (r == 0) return peer_error(cl, x->c, err, "closed the connection (it failed or stopped)");
  return peer_error(cl, x->c, err, "broke the connection: %s", strerror(errno));
}

static ssize_t recv_step(call_t *cl, xfer_t *x, meshd_error_t *err) {
  size_t moved = 0, esz = dtype_size(cl->dtype);
  uint8_t sink[16384];
  while (x->cur < x->nmsgs) {
    msg_t *m = &x->msgs[x->cur];
    if (!x->in_frame) {
      if (msg_done(m)) {
        x->cur++;
        continue;
      }
      if (x->c->skip_left) { /* the rest of a frame a call that fell behind was reading */
        x->flen = x->c->skip_left;
        x->c->skip_left = 0;
        x->fdone = 0;
        x->in_frame = x->skip = x->stale = true;
        x->shm = false;
        continue;
      }
      if (x->hdr_done == 0 && x->c->held_len) { /* header bytes such a call read */
        memcpy(x->hdr, x->c->held_hdr, x->c->held_len);
        x->hdr_done = x->c->held_len;
        x->c->held_len = 0;
        if (x->c->held_rfd) {
          drop_rfd(x);
          x->rfd = x->c->held_rfd;
          x->c->held_rfd = 0;
        }
      }
      if (x->hdr_done < DP_HDR_LEN) {
        ssize_t r = recv_some(x, x->hdr + x->hdr_done, DP_HDR_LEN - x->hdr_done);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        if (r <= 0) return recv_closed(cl, x, r, err);
        moved += (size_t)r;
        x->hdr_done += (size_t)r;
        if (x->hdr_done < DP_HDR_LEN) continue;
      }
      x->hdr_done = 0;
      size_t want = dp__min(DP_CHUNK, m->len - m->done);
      dp_frame_t f;
      dp_frame_kind_t kind =
          dp_wire_parse_frame(x->hdr, cl->comm_id, cl->call, x->c->seq, want, DP_CHUNK, &f);
      bool shm_magic = f.magic == DP_MAGIC_SHM;
      if (kind == DP_FRAME_DATA || kind == DP_FRAME_SHM || kind == DP_FRAME_STALE ||
          kind == DP_FRAME_AHEAD)
        x->c->last_call = f.call > x->c->last_call ? f.call : x->c->last_call;
      if (x->stray_fd || (x->rfd && !(shm_magic && (kind == DP_FRAME_SHM || kind == DP_FRAME_STALE ||
                                                    kind == DP_FRAME_AHEAD))))
        return stray_fd(cl, x, err);
      x->shm = kind == DP_FRAME_SHM || (kind == DP_FRAME_STALE && shm_magic);
      x->skip = kind == DP_FRAME_STALE;
      switch (kind) {
      case DP_FRAME_AHEAD: return behind(cl, x, &f, err);
      case DP_FRAME_BYE: /* its sender closed it idle: it dials again for this call */
        if (!x->mine) return RECV_REDIAL;
        return peer_error(cl, x->c, err, "closed the connection in the middle of this call");
      case DP_FRAME_STALE: x->stale = true; break;
      case DP_FRAME_SHM:
        if (m->into || m->done > 0)
          return peer_error(cl, x->c, err, "sent shared memory where %s was expected",
                            m->into ? "data to reduce" : "the rest of a message");
        break;
      case DP_FRAME_ABORT: {
        char text[DP_ABORT_MAX + 1];
        bool whole = read_abort(x->c->fd, &f, text, sizeof text);
        if (f.call < cl->call && !x->mine) { /* an older call's end: its sender dials again */
          if (!whole) return RECV_REDIAL;
          x->stale = true;
          continue;
        }
        return aborted(cl, x->c, f.call, text, err);
      }
      case DP_FRAME_FOREIGN:
        return peer_error(cl, x->c, err, "sent a frame that is not data for this comm");
      case DP_FRAME_SKEWED:
        return peer_error(cl, x->c, err,
                          "sent frame %llu of %u bytes where frame %llu of %zu bytes was expected "
                          "(do all members call with the same arguments?)",
                          (unsigned long long)f.seq, f.len, (unsigned long long)x->c->seq, want);
      case DP_FRAME_DATA: x->mine = true; break;
      }
      if (kind == DP_FRAME_SHM) x->mine = true;
      x->flen = f.len;
      x->fdone = 0;
      x->in_frame = true;
    }
    if (x->fdone < x->flen) {
      ssize_t r = x->shm    ? recv_some(x, x->pay + x->fdone, x->flen - x->fdone)
                  : x->skip ? recv(x->c->fd, sink, dp__min(sizeof sink, x->flen - x->fdone),
                                   MSG_DONTWAIT)
                            : recv(x->c->fd, m->buf + m->done + x->fdone, x->flen - x->fdone,
                                   MSG_DONTWAIT);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      if (r <= 0) return recv_closed(cl, x, r, err);
      moved += (size_t)r;
      x->fdone += (size_t)r;
    }
    if (x->fdone == x->flen && x->skip) { /* an older call's frame, dropped */
      if (x->stray_fd) return stray_fd(cl, x, err);
      drop_rfd(x);
      x->c->seq++;
      x->skip = x->shm = x->in_frame = false;
    } else if (x->fdone == x->flen && x->shm) {
      if (x->stray_fd) return stray_fd(cl, x, err);
      if (shm_landed(cl, x, m, err) != 0) return -1;
      m->done = m->len;
      m->frames++;
      x->c->seq++;
      x->in_frame = false;
    } else if (x->fdone == x->flen) {
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

/* x's peer closed a connection on which it sent only frames of an older call
 * (RECV_REDIAL): it is catching up, and dials again for this call. Waits for
 * that connection, as when the call began. */
static int redial_in(call_t *cl, xfer_t *x, meshd_error_t *err) {
  dataplane_t *dp = cl->dp;
  char addr[DP_ADDR_MAX];
  snprintf(addr, sizeof addr, "%s", x->c->addr);
  uint32_t peer = x->c->peer;
  drop_rfd(x);
  dp__conn_discard(dp, x->c);
  dp__conn_put(dp, x->c);
  int64_t deadline = dp__now_ms() + dp__timeout(dp, cl->g);
  x->c = dp__get_in(dp, cl, peer, addr, deadline, NULL, 0, NULL, err);
  bool superseded = x->superseded;
  x->in_frame = x->skip = x->shm = x->stale = x->stray_fd = x->superseded = false;
  x->hdr_done = x->flen = x->fdone = 0;
  /* A later call's link behind one that closed with nothing of this call: the
   * peer failed this call (mid-frame, so with no abort), or is past it. */
  if (x->c && x->c->last_call > cl->call && superseded)
    return peer_error(cl, x->c, err, "closed the connection before sending this call's data "
                                     "(it failed this call, or it is past it)");
  if (x->c && x->c->last_call > cl->call) return behind_at(cl, x->c, x->c->last_call, err);
  if (x->c) return 0;
  snprintf(cl->root, sizeof cl->root, "%s", err ? err->msg : "no connection");
  if (!cl->abort_reason && dp__now_ms() >= deadline) cl->abort_reason = DP_ABORT_TIMEOUT + 1;
  return -1;
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
  int64_t last = dp__now_ms();
  for (;;) {
    /* A member declared lost fails the call at once, whatever it waits for. */
    if (dp__check_lost(dp, cl, err)) {
      snprintf(cl->root, sizeof cl->root, "%s", err ? err->msg : "a member was lost");
      goto out;
    }
    /* Until nothing moves: a receive may have opened a send's gate. */
    bool moved = false, again = true;
    while (again) {
      again = false;
      for (size_t i = 0; i < nx; i++) {
        if (xs[i].cur >= xs[i].nmsgs) continue;
        ssize_t r = xs[i].send ? send_step(cl, &xs[i], err) : recv_step(cl, &xs[i], err);
        if (r == RECV_REDIAL && redial_in(cl, &xs[i], err) == 0) r = 1;
        if (r == SEND_REDIAL && redial_out(cl, &xs[i], err) == 0) r = 1;
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
    int64_t now = dp__now_ms();
    if (moved) last = now;
    if (dp__stopping(dp)) {
      error_set(err, ERR_UNAVAILABLE, "%s on comm %llu: the data plane is stopping", cl->what,
                (unsigned long long)cl->comm_id);
      snprintf(cl->root, sizeof cl->root, "rank %u stopped its data plane", dp->rank);
      goto out;
    }
    /* A connected peer that is silent may itself be waiting for an absent one;
     * give that wait (bounded by timeout_ms) a head start so that its abort,
     * which names the absent member, arrives before we blame the silent one. */
    int64_t timeout = dp__timeout(dp, cl->g), grace = timeout / 4 < 500 ? timeout / 4 : 500;
    int64_t left = last + timeout + grace - now;
    if (left <= 0) {
      xfer_t *w = &xs[which[0]]; /* name a peer we wait to hear from, if any */
      for (nfds_t i = 0; i < np; i++)
        if (!xs[which[i]].send) {
          w = &xs[which[i]];
          break;
        }
      cl->abort_reason = DP_ABORT_TIMEOUT + 1;
      peer_error(cl, w->c, err, "made no progress for %lld ms (%s)",
                 (long long)(timeout + grace),
                 w->send ? "not reading what we send" : "sent nothing");
      goto out;
    }
    int n = poll(pfds, np, (int)dp__min((size_t)left, 200));
    if (dp__check_lost(dp, cl, err)) { /* its connections were closed under us */
      snprintf(cl->root, sizeof cl->root, "%s", err ? err->msg : "a member was lost");
      goto out;
    }
    if (n < 0 && errno != EINTR) {
      error_set(err, ERR_UNAVAILABLE, "%s: poll: %s", cl->what, strerror(errno));
      goto out;
    }
    for (nfds_t i = 0; n > 0 && i < np; i++) {
      xfer_t *x = &xs[which[i]];
      if (x->send && (pfds[i].revents & (POLLIN | POLLHUP | POLLERR))) {
        int rc = send_side_closed(cl, x, err);
        if (rc == 0 || (rc == SEND_REDIAL && redial_out(cl, x, err) == 0)) break;
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
  uint8_t frame[DP_HDR_LEN + DP_ABORT_MAX];
  size_t len = dp_wire_abort(frame, cl->comm_id, dp__upto(cl), cl->root);
  for (size_t i = 0; i < nx; i++) {
    if (!xs[i].c || (xs[i].send && xs[i].in_frame)) continue;
    ssize_t w = send(xs[i].c->fd, frame, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)w;
  }
}

/* ------------------------------------------------------------------ plans */

int dp__plan_init(plan_t *p, dataplane_t *dp, const char *what, const dp_group_t *g, dtype_t dtype,
                  reduction_t op, size_t nx, size_t nmsgs, meshd_error_t *err) {
  memset(p, 0, sizeof *p);
  p->shm = -1;
  p->cl = (call_t){.dp = dp, .what = what, .g = g, .gen = g->since ? *g->since : atomic_load(&dp->gen),
                   .comm_id = g->comm_id, .call = g->call, .secret = g->secret, .dtype = dtype, .op = op};
  if (!g->secret)
    return error_set(err, ERR_BAD_ARGUMENT,
                     "%s on comm %llu: the group has no secret (its instruction lacks one), so "
                     "its members cannot prove they belong to it",
                     what, (unsigned long long)g->comm_id);
  p->xs = calloc(nx ? nx : 1, sizeof *p->xs);
  p->msgs = calloc(nmsgs ? nmsgs : 1, sizeof *p->msgs);
  p->nx = nx;
  if (!p->xs || !p->msgs) {
    /* Before it joined: its peers, which run the call, are told why at once
     * (dp_refuse) rather than waiting out timeout_ms for it. */
    free(p->xs);
    free(p->msgs);
    p->xs = NULL;
    p->msgs = NULL;
    meshd_error_t e = {0};
    error_set(&e, ERR_QUOTA, "%s on comm %llu: out of memory for its transfer plan on rank %u",
              what, (unsigned long long)g->comm_id, (unsigned)atomic_load(&dp->rank));
    dp_refuse_t kind = g->n > 1             ? DP_REFUSE_GROUP
                       : !strcmp(what, "send") ? DP_REFUSE_SEND
                                               : DP_REFUSE_RECV;
    dp_refuse(dp, g, kind, 1, e.msg, NULL);
    if (err) *err = e;
    return -1;
  }
  if (dp__register(dp, &p->cl, &p->reg, err) != 0) return -1;
  /* Its session ended here before it joined (dataplane_end_comm): at once. */
  if (atomic_load(&p->cl.dropped) && dp__check_lost(dp, &p->cl, err) != 0) {
    snprintf(p->cl.root, sizeof p->cl.root, "%s", err ? err->msg : "the channel was closed");
    return -1;
  }
  return 0;
}

/* Connects xs[k] (send to, or receive from, g's member `peer`). */
int dp__plan_connect(plan_t *p, const dp_group_t *g, size_t k, size_t peer, bool send,
                     int64_t deadline, meshd_error_t *err) {
  xfer_t *x = &p->xs[k];
  x->send = send;
  if (send) {
    x->c = dp__get_out(p->cl.dp, &p->cl, g->ranks[peer], g->addrs[peer], deadline, err);
  } else {
    for (bool again = true; again;) {
      again = false;
      const conn_t *watch[64];
      size_t nwatch = 0, fired = SIZE_MAX;
      for (size_t i = 0; i < p->nx && nwatch < 64; i++)
        if (p->xs[i].send && p->xs[i].c) watch[nwatch++] = p->xs[i].c;
      x->c = dp__get_in(p->cl.dp, &p->cl, g->ranks[peer], g->addrs[peer], deadline, watch, nwatch,
                        &fired, err);
      for (size_t i = 0; !x->c && fired != SIZE_MAX && i < p->nx; i++) {
        if (p->xs[i].c != watch[fired]) continue;
        int rc = send_side_closed(&p->cl, &p->xs[i], err);
        if (rc == SEND_REDIAL) rc = redial_out(&p->cl, &p->xs[i], err);
        if (rc != 0) return -1;
        again = true; /* an older call's news, or a fresh link to that peer: wait on */
        break;
      }
    }
  }
  /* A link its peer dialed for a later call (its hello said so): behind. */
  if (x->c && !send && x->c->last_call > p->cl.call)
    return behind_at(&p->cl, x->c, x->c->last_call, err);
  if (!x->c) {
    snprintf(p->cl.root, sizeof p->cl.root, "%s", err ? err->msg : "connection failed");
    /* The peer never came (or proved itself) before the deadline. */
    if (!p->cl.abort_reason && dp__now_ms() >= deadline && (!err || err->kind == ERR_REMOTE_FAILURE))
      p->cl.abort_reason = DP_ABORT_TIMEOUT + 1;
    return -1;
  }
  return 0;
}

int dp__plan_run(plan_t *p, meshd_error_t *err) { return run(&p->cl, p->xs, p->nx, err); }

/* After a failure, tells every peer of the call why, on each of its
 * connections (best effort). */
static void plan_abort(plan_t *p) {
  if (p->xs) send_aborts(&p->cl, p->xs, p->nx);
}

/* Counts the failed call once in dp->aborts: the reason set on the call, else
 * AGENT_LOST from err's kind, else ERROR (err may be NULL). */
static void plan_count_abort(plan_t *p, const meshd_error_t *err) {
  if (!p->cl.dp) return;
  dp_abort_t why = p->cl.abort_reason ? (dp_abort_t)(p->cl.abort_reason - 1)
                   : err && err->kind == ERR_AGENT_LOST ? DP_ABORT_AGENT_LOST
                                                        : DP_ABORT_ERROR;
  atomic_fetch_add(&p->cl.dp->aborts[why], 1);
}

/* Sends the rest of the frame x is in the middle of (its own bytes: they
 * were ready when it began), waiting up to timeout_ms for the peer to take
 * them. 0, or -1 (the connection is then torn). */
static int finish_frame(const call_t *cl, xfer_t *x) {
  dataplane_t *dp = cl->dp;
  const msg_t *m = &x->msgs[x->cur];
  const uint8_t *pay = x->shm ? x->pay : m->buf + m->done;
  int64_t deadline = dp__now_ms() + dp__timeout(dp, cl->g);
  while (x->hdr_done < DP_HDR_LEN || x->fdone < x->flen) {
    bool hdr = x->hdr_done < DP_HDR_LEN;
    const uint8_t *at = hdr ? x->hdr + x->hdr_done : pay + x->fdone;
    size_t len = hdr ? DP_HDR_LEN - x->hdr_done : x->flen - x->fdone;
    ssize_t w = send(x->c->fd, at, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      if (hdr) x->hdr_done += (size_t)w;
      else x->fdone += (size_t)w;
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return -1;
    int64_t left = deadline - dp__now_ms();
    if (left <= 0 || dp__stopping(dp)) return -1;
    struct pollfd pf = {.fd = x->c->fd, .events = POLLOUT};
    poll(&pf, 1, (int)dp__min((size_t)left, 200));
  }
  x->c->seq++;
  x->in_frame = false;
  return 0;
}

/* A call that fell behind its group leaves its connections for the call it
 * catches up with, aborting nobody: a frame it was sending is finished (its
 * peers skip it as an older call's, and one still at this call takes it as
 * it is); where it stopped reading, the next call goes on (the header bytes
 * it read, or the rest of a frame to skip). Only a connection it cannot
 * leave whole is closed. */
static void leave_behind(plan_t *p) {
  for (size_t i = 0; i < p->nx; i++) {
    xfer_t *x = &p->xs[i];
    if (!x->c) continue;
    bool whole = true;
    if (x->send && x->in_frame && (x->hdr_done > 0 || x->fdone > 0)) {
      whole = finish_frame(&p->cl, x) == 0;
    } else if (!x->send && x->in_frame) {
      whole = !x->shm; /* a shared-memory frame half read: rare, closed */
      if (whole) x->c->skip_left = x->flen - x->fdone;
    } else if (!x->send && x->hdr_done > 0) {
      memcpy(x->c->held_hdr, x->hdr, x->hdr_done);
      x->c->held_len = x->hdr_done;
      x->c->held_rfd = x->rfd;
      x->rfd = 0;
    }
    if (!whole) dp__conn_discard(p->cl.dp, x->c);
  }
}

int dp__plan_finish(plan_t *p, int rc, const meshd_error_t *err) {
  if (p->cl.dp) dp__unregister(p->cl.dp, p->reg);
  if (rc != 0 && p->xs) {
    plan_count_abort(p, err);
    if (p->cl.abort_reason == DP_ABORT_BEHIND + 1) {
      leave_behind(p);
    } else { /* its peers learn why, on its links and (a collective) on links of
              * this call it did not take yet; links a later call uses stay */
      plan_abort(p);
      for (size_t i = 0; i < p->nx; i++)
        if (p->xs[i].c) dp__conn_discard(p->cl.dp, p->xs[i].c);
      if (!p->link_only)
        dp__abort_untaken(p->cl.dp, p->cl.comm_id, dp__upto(&p->cl), DP_ANY_PEER, NULL,
                          p->cl.root);
      /* and a member that dials for it later, as well */
      dp__failed_call_add(p->cl.dp, p->cl.g, dp__upto(&p->cl), p->cl.root);
    }
  }
  if (p->xs)
    for (size_t i = 0; i < p->nx; i++) {
      drop_rfd(&p->xs[i]);
      dp__conn_put(p->cl.dp, p->xs[i].c);
    }
  if (p->shm >= 0) close(p->shm);
  free(p->xs);
  free(p->msgs);
  return rc;
}
