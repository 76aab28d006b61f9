/* grpc.health.v1.Health (core/platform/health.c) served by the rpc layer over
 * 127.0.0.1, with Watch clients that read or do not. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "grpc/health/v1/health.pb-c.h"
#include "health.h"
#include "log.h"
#include "rpc.h"

#define WATCH "/grpc.health.v1.Health/Watch"

static void setup(void) { rpc_init(); }
static void teardown(void) { rpc_shutdown(); }

TestSuite(health, .init = setup, .fini = teardown, .timeout = 120);

static rpc_server_t *serve(health_t *h) {
  rpc_server_opts_t o = {.listen = "127.0.0.1:0", .threads = 2};
  char err[300] = "";
  rpc_server_t *srv = rpc_server_create(&o, err, sizeof err);
  cr_assert_not_null(srv, "rpc_server_create: %s", err);
  cr_assert_eq(health_add_methods(h, srv), 0);
  cr_assert_gt(rpc_server_start(srv, err, sizeof err), 0, "rpc_server_start: %s", err);
  return srv;
}

static rpc_channel_t *dial(rpc_server_t *srv) {
  char target[64];
  snprintf(target, sizeof target, "127.0.0.1:%d", rpc_server_port(srv));
  rpc_channel_opts_t co = {.connect_timeout_ms = 5000};
  rpc_channel_t *ch = rpc_channel_create(target, &co);
  cr_assert_not_null(ch);
  return ch;
}

static rpc_stream_t *watch(rpc_channel_t *ch, const char *service) {
  rpc_stream_t *s = rpc_stream_open(ch, WATCH, NULL, 0, 60000);
  cr_assert_not_null(s);
  Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  req.service = (char *)service;
  cr_assert_eq(rpc_stream_write(s, &req.base, true), 0);
  return s;
}

/* The next status on s: >= 0, -2 on timeout, -1 at the end of the stream. */
static int next_status(rpc_stream_t *s, int timeout_ms) {
  ProtobufCMessage *m = NULL;
  int r = rpc_stream_read(s, &grpc__health__v1__health_check_response__descriptor, &m, timeout_ms);
  if (r == -2) return -2;
  if (r != 1) return -1;
  int st = (int)((Grpc__Health__V1__HealthCheckResponse *)m)->status;
  protobuf_c_message_free_unpacked(m, NULL);
  return st;
}

/* A Watch client that stops reading (a stranger: Health needs no token) got
 * every status change queued for it in the server's outbox, without limit:
 * 200000 changes of a flapping service made 200000 messages held in meshd's
 * memory for that one call (and so for each of up to 1024 such calls). Watch
 * semantics let the server skip intermediate statuses: the client that reads
 * again gets a bounded backlog and then the latest status. */
Test(health, a_watch_that_does_not_read_holds_a_bounded_backlog_and_gets_the_latest) {
  health_t *h = health_create();
  health_set(h, "svc", HEALTH_SERVING);
  rpc_server_t *srv = serve(h);
  rpc_channel_t *ch = dial(srv);
  rpc_stream_t *s = watch(ch, "svc");
  cr_assert_eq(next_status(s, 5000), HEALTH_SERVING);
  log_level_t level = log_get_level();
  log_set_level(LOG_LEVEL_WARN); /* a line per change otherwise */
  const int changes = 200000;
  for (int i = 0; i < changes; i++)
    health_set(h, "svc", i % 2 == 0 ? HEALTH_NOT_SERVING : HEALTH_SERVING);
  log_set_level(level);
  int n = 0, last = -1;
  for (;;) {
    int st = next_status(s, 2000);
    if (st < 0) break;
    last = st;
    n++;
  }
  cr_expect_eq(last, HEALTH_SERVING, "the latest status (SERVING) was not the last sent: %d",
               last);
  cr_expect_lt(n, changes / 4, "%d of %d changes were queued for a client that did not read", n,
               changes);
  rpc_stream_destroy(s);
  rpc_channel_destroy(ch);
  health_shutdown(h);
  rpc_server_shutdown(srv, 0);
  rpc_server_destroy(srv);
  health_destroy(h);
}

/* The client port and the health port share one health_t: a stranger who
 * opened HEALTH_WATCHERS_MAX Watch calls on one port denied Watch on the
 * other (RESOURCE_EXHAUSTED), e.g. the probes of the dedicated health port.
 * The bound is per port. */
Test(health, watches_on_one_port_do_not_use_up_the_other_ports_bound) {
  health_t *h = health_create();
  health_set(h, "", HEALTH_SERVING);
  rpc_server_t *a = serve(h), *b = serve(h);
  rpc_channel_t *cha = dial(a), *chb = dial(b);
  static rpc_stream_t *held[HEALTH_WATCHERS_MAX];
  for (int i = 0; i < HEALTH_WATCHERS_MAX; i++) {
    held[i] = watch(cha, "");
    cr_assert_eq(next_status(held[i], 5000), HEALTH_SERVING, "Watch %d on port a", i);
  }
  rpc_stream_t *s = watch(chb, "");
  int st = next_status(s, 5000);
  rpc_status_t why = {0};
  if (st < 0) rpc_stream_finish(s, &why);
  cr_expect_eq(st, HEALTH_SERVING, "Watch on port b refused: %d %s", why.code, why.message);
  rpc_stream_destroy(s);
  for (int i = 0; i < HEALTH_WATCHERS_MAX; i++) rpc_stream_destroy(held[i]);
  rpc_channel_destroy(cha);
  rpc_channel_destroy(chb);
  health_shutdown(h);
  rpc_server_shutdown(a, 0);
  rpc_server_shutdown(b, 0);
  rpc_server_destroy(a);
  rpc_server_destroy(b);
  health_destroy(h);
}
