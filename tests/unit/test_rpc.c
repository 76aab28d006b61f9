/* The rpc layer (core/platform/rpc.h): an in-process Echo server and client on
 * 127.0.0.1:0. Criterion forks per test, so each test initialises gRPC. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <grpc/byte_buffer.h>
#include <grpc/slice.h>

#include "echo_server.h"
#include "proc_threads.h"
#include "rpc.h"

/* A channel to a live peer in this process: seconds to connect, since a loaded
 * machine (CI runs the sanitized suites on 2 cores) can take longer than the
 * 100 ms default to answer the first SETTINGS frame. */
static const rpc_channel_opts_t live_peer = {.connect_timeout_ms = 5000};


static echo_server_t *es;
static rpc_channel_t *ch;
static char target[64];

static void start_server(int max_message_bytes) {
  rpc_server_opts_t opts = {.listen = "127.0.0.1:0", .threads = 2,
                            .max_message_bytes = max_message_bytes};
  char err[256] = "";
  es = echo_server_start(&opts, err, sizeof err);
  cr_assert_not_null(es, "echo_server_start: %s", err);
  cr_assert_gt(echo_server_port(es), 0);
  snprintf(target, sizeof target, "127.0.0.1:%d", echo_server_port(es));
  /* A live peer: a loaded machine may take over 100 ms to connect. */
  ch = rpc_channel_create(target, &(rpc_channel_opts_t){.connect_timeout_ms = 5000});
  cr_assert_not_null(ch);
}

static void stop_server(void) {
  if (ch) rpc_channel_destroy(ch);
  ch = NULL;
  echo_server_stop(es, 0);
  es = NULL;
}

static void setup(void) {
  rpc_init();
  start_server(0);
}

static void teardown(void) {
  stop_server();
  rpc_shutdown();
}

TestSuite(rpc, .init = setup, .fini = teardown, .timeout = 30);

/* Polls a counter until it reaches want; returns its last value. */
static int wait_counter(int (*get)(echo_server_t *), int want, int timeout_ms) {
  int64_t end = rpc_now_ms() + timeout_ms;
  int v;
  while ((v = get(es)) < want && rpc_now_ms() < end) usleep(2000);
  return v;
}

static int wait_active(int want, int timeout_ms) {
  int64_t end = rpc_now_ms() + timeout_ms;
  int v;
  while ((v = rpc_server_active_calls(echo_server_rpc(es))) != want && rpc_now_ms() < end)
    usleep(2000);
  return v;
}

/* A status the layer must overwrite: every byte set, strings not terminated
 * early, so a field the layer forgets to fill shows up as garbage. */
static void poison_status(rpc_status_t *st) {
  memset(st, 'Z', sizeof *st);
  st->code = (grpc_status_code)-12345;
  st->kind[sizeof st->kind - 1] = '\0';
  st->message[sizeof st->message - 1] = '\0';
}

static grpc_status_code call_unary(rpc_channel_t *c, const char *method, const EchoRequest *req,
                                   EchoReply **rep, const rpc_md_t *md, size_t nmd,
                                   int timeout_ms, rpc_status_t *st) {
  static EchoReply sentinel;
  *rep = &sentinel; /* must come back NULL on failure */
  poison_status(st);
  return rpc_unary(c, method, &req->base, &echo_reply__descriptor, (ProtobufCMessage **)rep, md,
                   nmd, timeout_ms, st);
}

static void free_reply(EchoReply *rep) {
  if (rep) protobuf_c_message_free_unpacked(&rep->base, NULL);
}

static void assert_unary_ok(const char *text) {
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = (char *)text;
  EchoReply *rep;
  rpc_status_t st;
  grpc_status_code code = call_unary(ch, ECHO_UNARY, &req, &rep, NULL, 0, 5000, &st);
  cr_assert_eq(code, GRPC_STATUS_OK, "unary '%s': code %d (%s)", text, code, st.message);
  cr_assert_not_null(rep);
  cr_assert_str_eq(rep->text, text);
  free_reply(rep);
}

/* ---------------------------------------------------------------- unary */

Test(rpc, unary_ok) {
  EchoRequest req = ECHO_REQUEST__INIT;
  uint8_t payload[6] = {0, 1, 2, 0xff, 0, 7};
  req.text = "hello";
  req.payload.data = payload;
  req.payload.len = sizeof payload;
  EchoReply *rep;
  rpc_status_t st;
  grpc_status_code code = call_unary(ch, ECHO_UNARY, &req, &rep, NULL, 0, 5000, &st);
  cr_assert_eq(code, GRPC_STATUS_OK, "code %d: %s", code, st.message);
  cr_assert_not_null(rep);
  cr_assert_str_eq(rep->text, "hello");
  cr_assert_eq(rep->payload.len, sizeof payload);
  cr_assert_arr_eq(rep->payload.data, payload, sizeof payload);
  cr_assert_eq(rep->index, 0);
  cr_assert_str_eq(rep->metadata, "", "no x-echo was sent, got '%s'", rep->metadata);
  free_reply(rep);

  cr_assert_eq(wait_counter(echo_server_calls_ended, 1, 2000), 1, "on_end did not run once");
  cr_assert_eq(echo_server_calls_started(es), 1);
  cr_assert_eq(echo_server_calls_cancelled(es), 0, "a completed call reported cancelled");
  cr_assert_eq(wait_active(0, 2000), 0);

  /* No deadline at all. */
  code = call_unary(ch, ECHO_UNARY, &req, &rep, NULL, 0, 0, &st);
  cr_assert_eq(code, GRPC_STATUS_OK, "timeout 0: code %d: %s", code, st.message);
  cr_assert_str_eq(rep->text, "hello");
  free_reply(rep);
}

Test(rpc, metadata_round_trip) {
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "md";
  rpc_md_t md[2] = {{"x-other", "not-this-one"}, {"x-echo", "round-trip-42"}};
  EchoReply *rep;
  rpc_status_t st;
  grpc_status_code code = call_unary(ch, ECHO_UNARY, &req, &rep, md, 2, 5000, &st);
  cr_assert_eq(code, GRPC_STATUS_OK, "code %d: %s", code, st.message);
  cr_assert_str_eq(rep->metadata, "round-trip-42");
  free_reply(rep);

  /* rpc_call_metadata truncates to its buffer (256 in the echo server). */
  char long_value[400];
  memset(long_value, 'v', sizeof long_value - 1);
  long_value[sizeof long_value - 1] = '\0';
  rpc_md_t lmd = {"x-echo", long_value};
  code = call_unary(ch, ECHO_UNARY, &req, &rep, &lmd, 1, 5000, &st);
  cr_assert_eq(code, GRPC_STATUS_OK, "code %d: %s", code, st.message);
  cr_assert_eq(strlen(rep->metadata), 255, "got %zu bytes", strlen(rep->metadata));
  cr_assert_eq(strncmp(rep->metadata, long_value, 255), 0);
  free_reply(rep);

  /* A "-bin" key: hex given, bytes sent (NULs included), read back as bytes. */
  rpc_md_t bmd = {"x-echo-bin", "00ff10000a"};
  code = call_unary(ch, ECHO_UNARY, &req, &rep, &bmd, 1, 5000, &st);
  cr_assert_eq(code, GRPC_STATUS_OK, "code %d: %s", code, st.message);
  cr_assert_str_eq(rep->metadata, "bin:5:00ff10000a");
  free_reply(rep);

  /* The next call on the same channel carries no metadata: nothing sticks. */
  code = call_unary(ch, ECHO_UNARY, &req, &rep, NULL, 0, 5000, &st);
  cr_assert_eq(code, GRPC_STATUS_OK);
  cr_assert_str_eq(rep->metadata, "");
  free_reply(rep);
}

Test(rpc, error_status_with_kind) {
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "boom";
  req.fail_code = GRPC_STATUS_FAILED_PRECONDITION;
  req.fail_kind = "WRONG_MESH";
  EchoReply *rep;
  rpc_status_t st;
  grpc_status_code code = call_unary(ch, ECHO_UNARY, &req, &rep, NULL, 0, 5000, &st);
  cr_assert_eq(code, GRPC_STATUS_FAILED_PRECONDITION, "code %d", code);
  cr_assert_null(rep, "*resp must be NULL on failure");
  cr_assert_eq(st.code, GRPC_STATUS_FAILED_PRECONDITION);
  cr_assert_str_eq(st.kind, "WRONG_MESH");
  cr_assert_str_eq(st.message, "echo failure: boom");

  /* Without a kind the trailer is absent and st.kind is empty. */
  req.text = "no kind";
  req.fail_code = GRPC_STATUS_NOT_FOUND;
  req.fail_kind = "";
  code = call_unary(ch, ECHO_UNARY, &req, &rep, NULL, 0, 5000, &st);
  cr_assert_eq(code, GRPC_STATUS_NOT_FOUND);
  cr_assert_null(rep);
  cr_assert_eq(st.code, GRPC_STATUS_NOT_FOUND);
  cr_assert_str_eq(st.kind, "", "kind must be empty, got '%.31s'", st.kind);
  cr_assert_str_eq(st.message, "echo failure: no kind");
  cr_assert_eq(wait_counter(echo_server_calls_ended, 2, 2000), 2);
  cr_assert_eq(echo_server_calls_cancelled(es), 0, "a call ended by a status is not cancelled");

  /* grpc-message is percent-encoded on the wire: it must come back verbatim. */
  req.text = "100% \xc3\xbcnicode, tab\tand newline\n%41";
  req.fail_code = GRPC_STATUS_INTERNAL;
  code = call_unary(ch, ECHO_UNARY, &req, &rep, NULL, 0, 5000, &st);
  cr_assert_eq(code, GRPC_STATUS_INTERNAL);
  cr_assert_str_eq(st.message, "echo failure: 100% \xc3\xbcnicode, tab\tand newline\n%41");

  /* Too long for rpc_status_t: truncated, still terminated. */
  char long_text[1200];
  memset(long_text, 'm', sizeof long_text - 1);
  long_text[sizeof long_text - 1] = '\0';
  char long_kind[64];
  memset(long_kind, 'K', sizeof long_kind - 1);
  long_kind[sizeof long_kind - 1] = '\0';
  req.text = long_text;
  req.fail_kind = long_kind;
  code = call_unary(ch, ECHO_UNARY, &req, &rep, NULL, 0, 5000, &st);
  cr_assert_eq(code, GRPC_STATUS_INTERNAL);
  cr_assert_eq(strlen(st.message), sizeof st.message - 1, "message length %zu",
               strlen(st.message));
  cr_assert_eq(strncmp(st.message, "echo failure: mmmm", 18), 0);
  cr_assert_eq(strlen(st.kind), sizeof st.kind - 1, "kind length %zu", strlen(st.kind));
  cr_assert_eq(strncmp(st.kind, long_kind, sizeof st.kind - 1), 0);
}

typedef struct {
  int delay_ms;
  int fail_code;
  grpc_status_code code;
  char text[64];
  char metadata[64];
  char message[512];
  int64_t elapsed_ms;
} delayed_call_t;

static void *delayed_call_thread(void *p) {
  delayed_call_t *d = p;
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "later";
  req.delay_ms = d->delay_ms;
  req.fail_code = d->fail_code;
  rpc_md_t md = {"x-echo", "held"};
  EchoReply *rep;
  rpc_status_t st;
  int64_t t0 = rpc_now_ms();
  d->code = call_unary(ch, ECHO_UNARY, &req, &rep, &md, 1, 5000, &st);
  d->elapsed_ms = rpc_now_ms() - t0;
  if (d->code == GRPC_STATUS_OK) {
    snprintf(d->text, sizeof d->text, "%s", rep->text);
    snprintf(d->metadata, sizeof d->metadata, "%s", rep->metadata);
    free_reply(rep);
  } else {
    snprintf(d->message, sizeof d->message, "%s", st.message);
  }
  return NULL;
}

Test(rpc, delayed_answer_from_another_thread) {
  /* Delays long enough that "not queued behind them" holds on a loaded machine
   * (CI runs this beside the sanitized Python suites: 261 ms for a quick call
   * was seen). */
  delayed_call_t ok = {.delay_ms = 1500},
                 bad = {.delay_ms = 1200, .fail_code = GRPC_STATUS_ABORTED};
  pthread_t t1, t2;
  pthread_create(&t1, NULL, delayed_call_thread, &ok);
  pthread_create(&t2, NULL, delayed_call_thread, &bad);
  /* While both wait, the server answers other calls at once. */
  usleep(50 * 1000);
  int64_t t0 = rpc_now_ms();
  assert_unary_ok("meanwhile");
  int64_t quick = rpc_now_ms() - t0;
  cr_assert_eq(wait_active(2, 1000), 2, "the two delayed calls are open");
  pthread_join(t1, NULL);
  pthread_join(t2, NULL);
  cr_assert_lt(quick, 1000, "a quick call took %lld ms while others were delayed", (long long)quick);

  cr_assert_eq(ok.code, GRPC_STATUS_OK, "code %d: %s", ok.code, ok.message);
  cr_assert_str_eq(ok.text, "later");
  cr_assert_str_eq(ok.metadata, "held");
  cr_assert_geq(ok.elapsed_ms, 1495, "answered after %lld ms", (long long)ok.elapsed_ms);
  cr_assert_lt(ok.elapsed_ms, 4500);

  cr_assert_eq(bad.code, GRPC_STATUS_ABORTED, "code %d", bad.code);
  cr_assert_str_eq(bad.message, "echo failure: later");
  cr_assert_geq(bad.elapsed_ms, 1195);

  cr_assert_eq(wait_counter(echo_server_calls_ended, 3, 2000), 3);
  cr_assert_eq(echo_server_calls_cancelled(es), 0);
}

Test(rpc, unknown_method_is_unimplemented) {
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "x";
  EchoReply *rep;
  rpc_status_t st;
  grpc_status_code code =
      call_unary(ch, "/meshd.test.v1.Echo/Nope", &req, &rep, NULL, 0, 5000, &st);
  cr_assert_eq(code, GRPC_STATUS_UNIMPLEMENTED, "code %d: %s", code, st.message);
  cr_assert_null(rep);
  cr_assert_eq(st.code, GRPC_STATUS_UNIMPLEMENTED);
  cr_assert_not_null(strstr(st.message, "/meshd.test.v1.Echo/Nope"),
                     "message does not name the method: '%s'", st.message);

  /* The same for a streaming call to an unknown method. */
  rpc_stream_t *s = rpc_stream_open(ch, "/meshd.test.v1.Echo/NopeStream", NULL, 0, 5000);
  cr_assert_not_null(s);
  ProtobufCMessage *m = NULL;
  int r = rpc_stream_read(s, &echo_reply__descriptor, &m, 5000);
  cr_assert_eq(r, 0, "read on an unimplemented stream returned %d", r);
  poison_status(&st);
  code = rpc_stream_finish(s, &st);
  cr_assert_eq(code, GRPC_STATUS_UNIMPLEMENTED, "code %d: %s", code, st.message);
  cr_assert_not_null(strstr(st.message, "/meshd.test.v1.Echo/NopeStream"), "'%s'", st.message);
  rpc_stream_destroy(s);

  assert_unary_ok("still serving");
}

Test(rpc, malformed_request_is_invalid_argument) {
  /* EchoReply.metadata is field 4 as a length-delimited string; in EchoRequest
   * field 4 is the varint fail_code, so the bytes do not parse. */
  EchoReply bogus = ECHO_REPLY__INIT;
  bogus.metadata = "not a varint";
  uint8_t buf[64];
  size_t n = protobuf_c_message_pack(&bogus.base, buf);
  ProtobufCMessage *check = protobuf_c_message_unpack(&echo_request__descriptor, NULL, n, buf);
  cr_assert_null(check, "test premise: the bytes must not unpack as EchoRequest");

  ProtobufCMessage *rep = (ProtobufCMessage *)&bogus;
  rpc_status_t st;
  poison_status(&st);
  grpc_status_code code =
      rpc_unary(ch, ECHO_UNARY, &bogus.base, &echo_reply__descriptor, &rep, NULL, 0, 5000, &st);
  cr_assert_eq(code, GRPC_STATUS_INVALID_ARGUMENT, "code %d: %s", code, st.message);
  cr_assert_null(rep);
  cr_assert_eq(st.code, GRPC_STATUS_INVALID_ARGUMENT);
  cr_assert_neq(st.message[0], '\0', "the status should say what was wrong");
  cr_assert_eq(echo_server_calls_started(es), 0, "on_start ran for an unparsable request");
  cr_assert_eq(echo_server_calls_ended(es), 0, "on_end ran for a call whose on_start never ran");

  /* Malformed bytes on a stream end that stream the same way. */
  rpc_stream_t *s = rpc_stream_open(ch, ECHO_BIDI, NULL, 0, 5000);
  cr_assert_not_null(s);
  cr_assert_eq(rpc_stream_write(s, &bogus.base, false), 0);
  ProtobufCMessage *m = NULL;
  int r = rpc_stream_read(s, &echo_reply__descriptor, &m, 5000);
  cr_assert_eq(r, 0, "read returned %d", r);
  code = rpc_stream_finish(s, &st);
  cr_assert_eq(code, GRPC_STATUS_INVALID_ARGUMENT, "bidi: code %d: %s", code, st.message);
  rpc_stream_destroy(s);

  assert_unary_ok("still serving");
}

static grpc_status_code echo_payload(rpc_channel_t *c, size_t len, rpc_status_t *st) {
  uint8_t *payload = malloc(len);
  cr_assert_not_null(payload);
  for (size_t i = 0; i < len; i++) payload[i] = (uint8_t)(i * 31 + 7);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "big";
  req.payload.data = payload;
  req.payload.len = len;
  EchoReply *rep;
  grpc_status_code code = call_unary(c, ECHO_UNARY, &req, &rep, NULL, 0, 10000, st);
  if (code == GRPC_STATUS_OK) {
    cr_assert_eq(rep->payload.len, len);
    cr_assert_arr_eq(rep->payload.data, payload, len);
    free_reply(rep);
  } else {
    cr_assert_null(rep);
  }
  free(payload);
  return code;
}

Test(rpc, message_over_server_limit_is_resource_exhausted) {
  stop_server();
  start_server(64 * 1024);
  rpc_status_t st;
  grpc_status_code code = echo_payload(ch, 60 * 1024, &st);
  cr_assert_eq(code, GRPC_STATUS_OK, "60 KiB under a 64 KiB limit: code %d: %s", code,
               st.message);
  code = echo_payload(ch, 100 * 1024, &st);
  cr_assert_eq(code, GRPC_STATUS_RESOURCE_EXHAUSTED, "100 KiB: code %d: %s", code, st.message);
  cr_assert_eq(st.code, GRPC_STATUS_RESOURCE_EXHAUSTED);
  /* The server keeps serving, on the same connection. */
  assert_unary_ok("after the big one");
  code = echo_payload(ch, 1000, &st);
  cr_assert_eq(code, GRPC_STATUS_OK);
}

/* A reply over the server's own limit (the request fit: the reply adds the
 * x-echo metadata's value) is refused by rpc_call_reply with kind QUOTA and a
 * message naming the method, the size and the limit, where gRPC's send would
 * fail the call with a bare RESOURCE_EXHAUSTED. */
Test(rpc, reply_over_server_limit_is_quota_naming_the_limit) {
  stop_server();
  start_server(64 * 1024);
  size_t len = 64 * 1024 - 16;
  uint8_t *payload = calloc(1, len);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.payload.data = payload;
  req.payload.len = len;
  cr_assert_leq(protobuf_c_message_get_packed_size(&req.base), 64 * 1024);
  char value[200];
  memset(value, 'v', sizeof value - 1);
  value[sizeof value - 1] = '\0';
  rpc_md_t md = {"x-echo", value};
  EchoReply *rep = NULL;
  rpc_status_t st;
  grpc_status_code code = call_unary(ch, ECHO_UNARY, &req, &rep, &md, 1, 5000, &st);
  cr_assert_eq(code, GRPC_STATUS_RESOURCE_EXHAUSTED, "code %d: %s", code, st.message);
  cr_assert_str_eq(st.kind, "QUOTA", "%s", st.message);
  cr_assert(strstr(st.message, "/meshd.test.v1.Echo/Unary: the reply is ") &&
                strstr(st.message, "bytes, over this process's 65536-byte message limit"),
            "%s", st.message);
  cr_assert_null(rep);
  assert_unary_ok("after the refused reply");
  free(payload);
}

Test(rpc, message_over_channel_limit_is_resource_exhausted) {
  rpc_channel_opts_t o = {.max_message_bytes = 64 * 1024, .connect_timeout_ms = 5000};
  rpc_channel_t *small = rpc_channel_create(target, &o);
  rpc_status_t st;
  grpc_status_code code = echo_payload(small, 100 * 1024, &st);
  cr_assert_eq(code, GRPC_STATUS_RESOURCE_EXHAUSTED, "code %d: %s", code, st.message);
  code = echo_payload(small, 1000, &st);
  cr_assert_eq(code, GRPC_STATUS_OK, "code %d: %s", code, st.message);
  rpc_channel_destroy(small);
}

/* ---------------------------------------------------------------- streams */

Test(rpc, client_streaming) {
  static const char *parts[] = {"al", "pha", "-", "be", "ta"};
  rpc_stream_t *s = rpc_stream_open(ch, ECHO_CLIENT_STREAM, NULL, 0, 5000);
  cr_assert_not_null(s);
  for (int i = 0; i < 5; i++) {
    EchoRequest req = ECHO_REQUEST__INIT;
    req.text = (char *)parts[i];
    cr_assert_eq(rpc_stream_write(s, &req.base, false), 0, "write %d", i);
  }
  cr_assert_eq(rpc_stream_close_send(s), 0);
  EchoReply *rep = NULL;
  int r = rpc_stream_read(s, &echo_reply__descriptor, (ProtobufCMessage **)&rep, 5000);
  cr_assert_eq(r, 1, "read returned %d", r);
  cr_assert_str_eq(rep->text, "alpha-beta");
  cr_assert_eq(rep->index, 5);
  free_reply(rep);
  r = rpc_stream_read(s, &echo_reply__descriptor, (ProtobufCMessage **)&rep, 5000);
  cr_assert_eq(r, 0, "one reply only, then the end; got %d", r);
  rpc_status_t st;
  cr_assert_eq(rpc_stream_finish(s, &st), GRPC_STATUS_OK, "%s", st.message);
  rpc_stream_destroy(s);

  /* One message carrying the half-close, then none at all. */
  s = rpc_stream_open(ch, ECHO_CLIENT_STREAM, NULL, 0, 5000);
  EchoRequest last = ECHO_REQUEST__INIT;
  last.text = "only";
  cr_assert_eq(rpc_stream_write(s, &last.base, true), 0);
  r = rpc_stream_read(s, &echo_reply__descriptor, (ProtobufCMessage **)&rep, 5000);
  cr_assert_eq(r, 1);
  cr_assert_str_eq(rep->text, "only");
  cr_assert_eq(rep->index, 1);
  free_reply(rep);
  cr_assert_eq(rpc_stream_read(s, &echo_reply__descriptor, (ProtobufCMessage **)&rep, 5000), 0);
  cr_assert_eq(rpc_stream_finish(s, NULL), GRPC_STATUS_OK);
  rpc_stream_destroy(s);

  s = rpc_stream_open(ch, ECHO_CLIENT_STREAM, NULL, 0, 5000);
  cr_assert_eq(rpc_stream_close_send(s), 0);
  r = rpc_stream_read(s, &echo_reply__descriptor, (ProtobufCMessage **)&rep, 5000);
  cr_assert_eq(r, 1);
  cr_assert_str_eq(rep->text, "");
  cr_assert_eq(rep->index, 0);
  free_reply(rep);
  cr_assert_eq(rpc_stream_finish(s, NULL), GRPC_STATUS_OK);
  rpc_stream_destroy(s);
  cr_assert_eq(wait_counter(echo_server_calls_ended, 3, 2000), 3);
}

Test(rpc, server_streaming_1000) {
  rpc_stream_t *s = rpc_stream_open(ch, ECHO_SERVER_STREAM, NULL, 0, 10000);
  cr_assert_not_null(s);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "tick";
  req.reply_count = 1000;
  cr_assert_eq(rpc_stream_write(s, &req.base, true), 0);
  for (int i = 0; i < 1000; i++) {
    EchoReply *rep = NULL;
    int r = rpc_stream_read(s, &echo_reply__descriptor, (ProtobufCMessage **)&rep, 5000);
    cr_assert_eq(r, 1, "reply %d: read returned %d", i, r);
    cr_assert_eq(rep->index, i, "reply %d has index %d", i, rep->index);
    cr_assert_str_eq(rep->text, "tick");
    free_reply(rep);
  }
  ProtobufCMessage *m = NULL;
  cr_assert_eq(rpc_stream_read(s, &echo_reply__descriptor, &m, 5000), 0);
  rpc_status_t st;
  cr_assert_eq(rpc_stream_finish(s, &st), GRPC_STATUS_OK, "%s", st.message);
  rpc_stream_destroy(s);
  cr_assert_eq(wait_counter(echo_server_calls_ended, 1, 2000), 1);
  cr_assert_eq(echo_server_calls_cancelled(es), 0);
}

Test(rpc, server_streaming_error_after_replies) {
  rpc_stream_t *s = rpc_stream_open(ch, ECHO_SERVER_STREAM, NULL, 0, 5000);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "partial";
  req.reply_count = 3;
  req.fail_code = GRPC_STATUS_DATA_LOSS;
  req.fail_kind = "LOST";
  cr_assert_eq(rpc_stream_write(s, &req.base, true), 0);
  for (int i = 0; i < 3; i++) {
    EchoReply *rep = NULL;
    cr_assert_eq(rpc_stream_read(s, &echo_reply__descriptor, (ProtobufCMessage **)&rep, 5000),
                 1, "replies queued before the status arrive first (%d)", i);
    cr_assert_eq(rep->index, i);
    free_reply(rep);
  }
  ProtobufCMessage *m = NULL;
  cr_assert_eq(rpc_stream_read(s, &echo_reply__descriptor, &m, 5000), 0);
  rpc_status_t st;
  poison_status(&st);
  cr_assert_eq(rpc_stream_finish(s, &st), GRPC_STATUS_DATA_LOSS);
  cr_assert_eq(st.code, GRPC_STATUS_DATA_LOSS);
  cr_assert_str_eq(st.kind, "LOST");
  cr_assert_str_eq(st.message, "echo failure: partial");
  rpc_stream_destroy(s);
}

/* rpc_call_abort on a stream whose client reads nothing: 64 MiB of replies
 * are queued, more than flow control lets through, so a status behind them
 * (rpc_call_finish) would wait for the client; the abort ends the call on the
 * server at once (on_end runs with the client still not reading), and the
 * client then finds the status, the message in it, after fewer replies. */
Test(rpc, abort_ends_a_stream_its_client_stopped_reading) {
  enum { N = 64, MIB = 1 << 20 };
  uint8_t *payload = calloc(1, MIB);
  rpc_stream_t *s = rpc_stream_open(ch, ECHO_SERVER_STREAM, NULL, 0, 20000);
  cr_assert_not_null(s);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "stalled";
  req.payload.data = payload;
  req.payload.len = MIB - 64;
  req.reply_count = N;
  req.fail_code = GRPC_STATUS_PERMISSION_DENIED;
  req.fail_kind = "PERMISSION_DENIED";
  req.delay_ms = 300;
  cr_assert_eq(rpc_stream_write(s, &req.base, true), 0);
  cr_assert_eq(wait_counter(echo_server_calls_ended, 1, 5000), 1,
               "the aborted call did not end while its client read nothing");
  int got = 0;
  for (;;) {
    EchoReply *rep = NULL;
    int r = rpc_stream_read(s, &echo_reply__descriptor, (ProtobufCMessage **)&rep, 5000);
    if (r != 1) break;
    got++;
    free_reply(rep);
  }
  rpc_status_t st;
  poison_status(&st);
  cr_assert_eq(rpc_stream_finish(s, &st), GRPC_STATUS_PERMISSION_DENIED, "%d: %s", st.code,
               st.message);
  cr_assert_str_eq(st.message, "echo abort: stalled");
  cr_assert_lt(got, N, "all %d replies came: nothing was dropped", got);
  rpc_stream_destroy(s);
  free(payload);
}

/* With nothing queued the abort is an ordinary status, kind trailer and all. */
Test(rpc, abort_with_nothing_queued_sends_the_status_and_kind) {
  rpc_stream_t *s = rpc_stream_open(ch, ECHO_SERVER_STREAM, NULL, 0, 5000);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "idle";
  req.fail_code = GRPC_STATUS_DATA_LOSS;
  req.fail_kind = "LOST";
  req.delay_ms = 50;
  cr_assert_eq(rpc_stream_write(s, &req.base, true), 0);
  ProtobufCMessage *m = NULL;
  cr_assert_eq(rpc_stream_read(s, &echo_reply__descriptor, &m, 5000), 0);
  rpc_status_t st;
  poison_status(&st);
  cr_assert_eq(rpc_stream_finish(s, &st), GRPC_STATUS_DATA_LOSS);
  cr_assert_str_eq(st.kind, "LOST");
  cr_assert_str_eq(st.message, "echo abort: idle");
  rpc_stream_destroy(s);
  cr_assert_eq(wait_counter(echo_server_calls_ended, 1, 2000), 1);
}

enum { BIDI_N = 10000 };

typedef struct {
  rpc_stream_t *s;
  int written, write_err;
  int read, bad_index, bad_text, end_code;
} bidi_run_t;

static void *bidi_writer(void *p) {
  bidi_run_t *b = p;
  for (int i = 0; i < BIDI_N; i++) {
    char text[16];
    snprintf(text, sizeof text, "m%05d", i);
    EchoRequest req = ECHO_REQUEST__INIT;
    req.text = text;
    if (rpc_stream_write(b->s, &req.base, i == BIDI_N - 1) != 0) {
      b->write_err = i + 1;
      return NULL;
    }
    b->written++;
  }
  return NULL;
}

static void *bidi_reader(void *p) {
  bidi_run_t *b = p;
  for (;;) {
    EchoReply *rep = NULL;
    int r = rpc_stream_read(b->s, &echo_reply__descriptor, (ProtobufCMessage **)&rep, 10000);
    if (r != 1) {
      b->end_code = r;
      return NULL;
    }
    char want[16];
    snprintf(want, sizeof want, "m%05d", b->read);
    if (rep->index != b->read + 1 && !b->bad_index) b->bad_index = b->read + 1;
    if (strcmp(rep->text, want) != 0 && !b->bad_text) b->bad_text = b->read + 1;
    b->read++;
    free_reply(rep);
  }
}

Test(rpc, bidi_10000_pipelined) {
  bidi_run_t b = {.s = rpc_stream_open(ch, ECHO_BIDI, NULL, 0, 20000)};
  cr_assert_not_null(b.s);
  pthread_t w, r;
  pthread_create(&r, NULL, bidi_reader, &b);
  pthread_create(&w, NULL, bidi_writer, &b);
  pthread_join(w, NULL);
  pthread_join(r, NULL);
  rpc_status_t st;
  grpc_status_code code = rpc_stream_finish(b.s, &st);
  rpc_stream_destroy(b.s);
  cr_assert_eq(b.write_err, 0, "write %d failed", b.write_err);
  cr_assert_eq(b.written, BIDI_N);
  cr_assert_eq(b.read, BIDI_N, "read %d replies", b.read);
  cr_assert_eq(b.end_code, 0, "the stream ended with read %d", b.end_code);
  cr_assert_eq(b.bad_index, 0, "reply %d out of order", b.bad_index);
  cr_assert_eq(b.bad_text, 0, "reply %d has the wrong text", b.bad_text);
  cr_assert_eq(code, GRPC_STATUS_OK, "code %d: %s", code, st.message);
  cr_assert_eq(wait_counter(echo_server_calls_ended, 1, 2000), 1);
  cr_assert_eq(echo_server_calls_cancelled(es), 0);
}

Test(rpc, bidi_error_midstream) {
  rpc_stream_t *s = rpc_stream_open(ch, ECHO_BIDI, NULL, 0, 5000);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "one";
  cr_assert_eq(rpc_stream_write(s, &req.base, false), 0);
  req.text = "two";
  req.fail_code = GRPC_STATUS_OUT_OF_RANGE;
  cr_assert_eq(rpc_stream_write(s, &req.base, false), 0);
  EchoReply *rep = NULL;
  cr_assert_eq(rpc_stream_read(s, &echo_reply__descriptor, (ProtobufCMessage **)&rep, 5000), 1);
  cr_assert_str_eq(rep->text, "one");
  free_reply(rep);
  cr_assert_eq(rpc_stream_read(s, &echo_reply__descriptor, (ProtobufCMessage **)&rep, 5000), 0);
  rpc_status_t st;
  cr_assert_eq(rpc_stream_finish(s, &st), GRPC_STATUS_OUT_OF_RANGE);
  cr_assert_str_eq(st.message, "echo failure: two");
  cr_assert_str_eq(st.kind, "");
  rpc_stream_destroy(s);
  cr_assert_eq(wait_counter(echo_server_calls_ended, 1, 2000), 1);
}

static void *cancel_later(void *p) {
  usleep(200 * 1000);
  rpc_stream_cancel(p);
  return NULL;
}

Test(rpc, client_cancel_mid_bidi) {
  rpc_stream_t *s = rpc_stream_open(ch, ECHO_BIDI, NULL, 0, 0);
  cr_assert_not_null(s);
  for (int i = 0; i < 3; i++) {
    EchoRequest req = ECHO_REQUEST__INIT;
    req.text = "c";
    cr_assert_eq(rpc_stream_write(s, &req.base, false), 0);
    EchoReply *rep = NULL;
    cr_assert_eq(rpc_stream_read(s, &echo_reply__descriptor, (ProtobufCMessage **)&rep, 5000), 1);
    cr_assert_eq(rep->index, i + 1);
    free_reply(rep);
  }
  cr_assert_eq(echo_server_calls_ended(es), 0, "the call is still open");
  cr_assert_eq(rpc_server_active_calls(echo_server_rpc(es)), 1);

  /* A read blocked without a timeout returns when another thread cancels. */
  pthread_t t;
  pthread_create(&t, NULL, cancel_later, s);
  int64_t t0 = rpc_now_ms();
  ProtobufCMessage *m = NULL;
  int r = rpc_stream_read(s, &echo_reply__descriptor, &m, 0);
  int64_t took = rpc_now_ms() - t0;
  pthread_join(t, NULL);
  cr_assert(r == 0 || r == -1, "read after cancel returned %d", r);
  cr_assert_lt(took, 3000, "blocked read took %lld ms to notice the cancel", (long long)took);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "after cancel";
  cr_assert_eq(rpc_stream_write(s, &req.base, false), -1, "write after cancel must fail");
  rpc_status_t st;
  cr_assert_eq(rpc_stream_finish(s, &st), GRPC_STATUS_CANCELLED, "code %d: %s", st.code,
               st.message);
  rpc_stream_destroy(s);

  cr_assert_eq(wait_counter(echo_server_calls_cancelled, 1, 5000), 1,
               "server on_end did not see cancelled=true");
  cr_assert_eq(echo_server_calls_ended(es), 1);
  cr_assert_eq(wait_active(0, 2000), 0);
}

Test(rpc, deadline_exceeded_on_delayed_unary) {
  /* Connected first: on a loaded machine the first call's connect alone can
   * outlast the deadline, and a call that never left has no server end. */
  assert_unary_ok("connect");
  cr_assert_eq(wait_counter(echo_server_calls_ended, 1, 5000), 1);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "slow";
  req.delay_ms = 3000; /* far past the deadline, even on a loaded machine */
  EchoReply *rep;
  rpc_status_t st;
  int64_t t0 = rpc_now_ms();
  grpc_status_code code = call_unary(ch, ECHO_UNARY, &req, &rep, NULL, 0, 150, &st);
  int64_t took = rpc_now_ms() - t0;
  cr_assert_eq(code, GRPC_STATUS_DEADLINE_EXCEEDED, "code %d: %s", code, st.message);
  cr_assert_null(rep);
  cr_assert_eq(st.code, GRPC_STATUS_DEADLINE_EXCEEDED);
  cr_assert_geq(took, 140, "returned after %lld ms", (long long)took);
  /* Not held until the answer (3 s): 2.45 s of slack for a loaded machine. */
  cr_assert_lt(took, 2600, "returned after %lld ms: not at its deadline", (long long)took);
  cr_assert_eq(wait_counter(echo_server_calls_cancelled, 1, 3000), 1,
               "server on_end did not see the deadline as a cancellation");

  /* The channel serves other calls meanwhile; the held call is answered
   * after it ended (a no-op), then released. */
  assert_unary_ok("after the deadline");
  cr_assert_eq(wait_counter(echo_server_delayed_answered, 1, 8000), 1);
  assert_unary_ok("after the late answer");
  cr_assert_eq(wait_counter(echo_server_calls_ended, 4, 2000), 4);
}

Test(rpc, stream_read_timeout_keeps_read_armed) {
  rpc_stream_t *s = rpc_stream_open(ch, ECHO_BIDI, NULL, 0, 10000);
  cr_assert_not_null(s);
  ProtobufCMessage *m = NULL;
  int64_t t0 = rpc_now_ms();
  int r = rpc_stream_read(s, &echo_reply__descriptor, &m, 150);
  int64_t took = rpc_now_ms() - t0;
  cr_assert_eq(r, -2, "read with nothing to read returned %d", r);
  cr_assert_geq(took, 140, "timed out after %lld ms", (long long)took);
  /* A read that never timed out would be ended by the stream's 10 s deadline. */
  cr_assert_lt(took, 5000, "timed out after %lld ms", (long long)took);

  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "late";
  cr_assert_eq(rpc_stream_write(s, &req.base, false), 0);
  EchoReply *rep = NULL;
  r = rpc_stream_read(s, &echo_reply__descriptor, (ProtobufCMessage **)&rep, 5000);
  cr_assert_eq(r, 1, "the message after a timed-out read: %d", r);
  cr_assert_str_eq(rep->text, "late");
  cr_assert_eq(rep->index, 1);
  free_reply(rep);

  /* Time out again, then the message that was in flight during the timeout. */
  cr_assert_eq(rpc_stream_read(s, &echo_reply__descriptor, &m, 50), -2);
  req.text = "later";
  req.delay_ms = 0;
  cr_assert_eq(rpc_stream_write(s, &req.base, true), 0);
  r = rpc_stream_read(s, &echo_reply__descriptor, (ProtobufCMessage **)&rep, 5000);
  cr_assert_eq(r, 1);
  cr_assert_str_eq(rep->text, "later");
  cr_assert_eq(rep->index, 2, "no message lost or duplicated by the timeouts");
  free_reply(rep);
  cr_assert_eq(rpc_stream_read(s, &echo_reply__descriptor, &m, 5000), 0);
  cr_assert_eq(rpc_stream_finish(s, NULL), GRPC_STATUS_OK);
  rpc_stream_destroy(s);
}

/* ---------------------------------------------------------------- lifecycle */

Test(rpc, shutdown_with_open_bidi_stream) {
  rpc_stream_t *s = rpc_stream_open(ch, ECHO_BIDI, NULL, 0, 0);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "open";
  cr_assert_eq(rpc_stream_write(s, &req.base, false), 0);
  EchoReply *rep = NULL;
  cr_assert_eq(rpc_stream_read(s, &echo_reply__descriptor, (ProtobufCMessage **)&rep, 5000), 1);
  free_reply(rep);
  cr_assert_eq(rpc_server_active_calls(echo_server_rpc(es)), 1);

  int64_t t0 = rpc_now_ms();
  rpc_server_shutdown(echo_server_rpc(es), 0.5);
  int64_t took = rpc_now_ms() - t0;
  cr_assert_lt(took, 1500, "shutdown with grace 0.5 s took %lld ms", (long long)took);
  cr_assert_geq(took, 450, "shutdown did not wait for the grace period (%lld ms)",
                (long long)took);
  cr_assert_eq(echo_server_calls_ended(es), 1, "on_end must have run when shutdown returns");
  cr_assert_eq(rpc_server_active_calls(echo_server_rpc(es)), 0);

  ProtobufCMessage *m = NULL;
  int r = rpc_stream_read(s, &echo_reply__descriptor, &m, 3000);
  cr_assert(r == 0 || r == -1, "client read after server shutdown returned %d", r);
  rpc_status_t st;
  grpc_status_code code = rpc_stream_finish(s, &st);
  cr_assert_neq(code, GRPC_STATUS_OK, "the client must not see OK for a cut stream");
  rpc_stream_destroy(s);

  /* Idempotent: a second shutdown returns at once. */
  t0 = rpc_now_ms();
  rpc_server_shutdown(echo_server_rpc(es), 5);
  cr_assert_lt(rpc_now_ms() - t0, 500);
}

Test(rpc, port_in_use_fails) {
  char listen[64], err[256] = "", port[16];
  snprintf(listen, sizeof listen, "127.0.0.1:%d", echo_server_port(es));
  snprintf(port, sizeof port, "%d", echo_server_port(es));
  rpc_server_opts_t opts = {.listen = listen, .threads = 1};
  rpc_server_t *second = rpc_server_create(&opts, err, sizeof err);
  cr_assert_not_null(second, "%s", err);
  int got = rpc_server_start(second, err, sizeof err);
  cr_assert_eq(got, -1, "a second server on %s started (port %d)", listen, got);
  cr_assert_neq(err[0], '\0', "no error message");
  cr_assert_not_null(strstr(err, port), "the error should name the address: '%s'", err);
  rpc_server_destroy(second);

  err[0] = '\0';
  echo_server_t *third = echo_server_start(&opts, err, sizeof err);
  cr_assert_null(third, "echo_server_start on a used port succeeded");
  cr_assert_neq(err[0], '\0');

  /* The first server still owns the port and answers, also on a new connection. */
  assert_unary_ok("first server");
  rpc_channel_opts_t co = {.own_connection = true, .connect_timeout_ms = 5000};
  rpc_channel_t *fresh = rpc_channel_create(target, &co);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "fresh";
  EchoReply *rep;
  rpc_status_t st;
  for (int i = 0; i < 20; i++) {
    cr_assert_eq(call_unary(fresh, ECHO_UNARY, &req, &rep, NULL, 0, 5000, &st), GRPC_STATUS_OK);
    free_reply(rep);
  }
  rpc_channel_destroy(fresh);
  cr_assert_eq(wait_counter(echo_server_calls_ended, 21, 2000), 21);
}

static int closed_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  cr_assert_geq(fd, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
  socklen_t len = sizeof a;
  cr_assert_eq(getsockname(fd, (struct sockaddr *)&a, &len), 0);
  close(fd); /* never listened: connections are refused */
  return ntohs(a.sin_port);
}

Test(rpc, channel_wait_ready) {
  cr_assert(rpc_channel_wait_ready(ch, 5000), "a live server must become READY");

  char closed[64];
  snprintf(closed, sizeof closed, "127.0.0.1:%d", closed_port());
  rpc_channel_t *dead = rpc_channel_create(closed, NULL);
  cr_assert_not_null(dead, "creating a channel never fails for a valid target");
  int64_t t0 = rpc_now_ms();
  bool ready = rpc_channel_wait_ready(dead, 500);
  int64_t took = rpc_now_ms() - t0;
  cr_assert_not(ready, "READY against a closed port %s", closed);
  cr_assert_lt(took, 3000, "wait_ready(500) took %lld ms", (long long)took);

  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "nobody";
  EchoReply *rep;
  rpc_status_t st;
  grpc_status_code code = call_unary(dead, ECHO_UNARY, &req, &rep, NULL, 0, 2000, &st);
  cr_assert(code == GRPC_STATUS_UNAVAILABLE || code == GRPC_STATUS_DEADLINE_EXCEEDED,
            "unary to a closed port: code %d (%s)", code, st.message);
  rpc_channel_destroy(dead);
}

enum { CONC_THREADS = 8, CONC_CALLS = 100 };

static void *concurrent_caller(void *p) {
  intptr_t id = (intptr_t)p;
  for (int i = 0; i < CONC_CALLS; i++) {
    char text[32];
    snprintf(text, sizeof text, "t%ld-%d", (long)id, i);
    EchoRequest req = ECHO_REQUEST__INIT;
    req.text = text;
    EchoReply *rep;
    rpc_status_t st;
    if (call_unary(ch, ECHO_UNARY, &req, &rep, NULL, 0, 5000, &st) != GRPC_STATUS_OK)
      return (void *)(intptr_t)(i + 1);
    int same = strcmp(rep->text, text) == 0;
    free_reply(rep);
    if (!same) return (void *)(intptr_t)(-(i + 1));
  }
  return NULL;
}

Test(rpc, unary_from_many_threads) {
  pthread_t t[CONC_THREADS];
  for (intptr_t i = 0; i < CONC_THREADS; i++)
    pthread_create(&t[i], NULL, concurrent_caller, (void *)i);
  for (int i = 0; i < CONC_THREADS; i++) {
    void *ret;
    pthread_join(t[i], &ret);
    cr_assert_null(ret, "thread %d: call %ld failed (negative: wrong reply)", i, (long)(intptr_t)ret);
  }
  cr_assert_eq(wait_counter(echo_server_calls_ended, CONC_THREADS * CONC_CALLS, 3000),
               CONC_THREADS * CONC_CALLS);
  cr_assert_eq(echo_server_calls_cancelled(es), 0);
}

enum { OPEN_STREAMS = 64 };

Test(rpc, many_open_streams) {
  rpc_stream_t *s[OPEN_STREAMS];
  for (int i = 0; i < OPEN_STREAMS; i++) {
    s[i] = rpc_stream_open(ch, ECHO_BIDI, NULL, 0, 10000);
    cr_assert_not_null(s[i]);
    char text[16];
    snprintf(text, sizeof text, "s%d", i);
    EchoRequest req = ECHO_REQUEST__INIT;
    req.text = text;
    cr_assert_eq(rpc_stream_write(s[i], &req.base, false), 0, "stream %d", i);
  }
  for (int i = 0; i < OPEN_STREAMS; i++) {
    char text[16];
    snprintf(text, sizeof text, "s%d", i);
    EchoReply *rep = NULL;
    int r = rpc_stream_read(s[i], &echo_reply__descriptor, (ProtobufCMessage **)&rep, 5000);
    cr_assert_eq(r, 1, "stream %d of %d open: read %d", i, OPEN_STREAMS, r);
    cr_assert_str_eq(rep->text, text);
    free_reply(rep);
  }
  cr_assert_eq(wait_active(OPEN_STREAMS, 2000), OPEN_STREAMS);
  for (int i = 0; i < OPEN_STREAMS; i++) {
    cr_assert_eq(rpc_stream_close_send(s[i]), 0);
    ProtobufCMessage *m = NULL;
    cr_assert_eq(rpc_stream_read(s[i], &echo_reply__descriptor, &m, 5000), 0);
    cr_assert_eq(rpc_stream_finish(s[i], NULL), GRPC_STATUS_OK);
    rpc_stream_destroy(s[i]);
  }
  cr_assert_eq(wait_counter(echo_server_calls_ended, OPEN_STREAMS, 2000), OPEN_STREAMS);
  cr_assert_eq(echo_server_calls_cancelled(es), 0);
}

enum { BP_N = 20000, BP_PAYLOAD = 1024 };

typedef struct {
  rpc_stream_t *s;
  atomic_int written;
  int err;
} bp_writer_t;

static void *bp_writer(void *p) {
  bp_writer_t *w = p;
  static uint8_t payload[BP_PAYLOAD];
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "bp";
  req.payload.data = payload;
  req.payload.len = sizeof payload;
  for (int i = 0; i < BP_N; i++) {
    if (rpc_stream_write(w->s, &req.base, i == BP_N - 1) != 0) {
      w->err = i + 1;
      return NULL;
    }
    atomic_fetch_add(&w->written, 1);
  }
  return NULL;
}

/* A client that writes and does not read: the server stops reading once its
 * outbox is full, the writer blocks, and all resumes when the client reads. */
Test(rpc, bidi_backpressure_resumes) {
  bp_writer_t w = {.s = rpc_stream_open(ch, ECHO_BIDI, NULL, 0, 20000)};
  pthread_t t;
  pthread_create(&t, NULL, bp_writer, &w);
  usleep(500 * 1000);
  int before = atomic_load(&w.written);
  cr_assert_lt(before, BP_N, "all %d KiB were taken without the client reading: no backpressure",
               BP_N * BP_PAYLOAD / 1024);
  int n = 0, r;
  EchoReply *rep = NULL;
  while ((r = rpc_stream_read(w.s, &echo_reply__descriptor, (ProtobufCMessage **)&rep, 5000)) == 1) {
    n++;
    cr_assert_eq(rep->index, n);
    free_reply(rep);
  }
  pthread_join(t, NULL);
  cr_assert_eq(r, 0, "read ended with %d after %d replies", r, n);
  cr_assert_eq(w.err, 0, "write %d failed", w.err);
  cr_assert_eq(n, BP_N);
  cr_assert_eq(rpc_stream_finish(w.s, NULL), GRPC_STATUS_OK);
  rpc_stream_destroy(w.s);
}

Test(rpc, stream_destroy_cancels) {
  rpc_stream_t *s = rpc_stream_open(ch, ECHO_BIDI, NULL, 0, 0);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "x";
  cr_assert_eq(rpc_stream_write(s, &req.base, false), 0);
  EchoReply *rep = NULL;
  cr_assert_eq(rpc_stream_read(s, &echo_reply__descriptor, (ProtobufCMessage **)&rep, 5000), 1);
  free_reply(rep);
  rpc_stream_destroy(s); /* neither finished nor cancelled */
  cr_assert_eq(wait_counter(echo_server_calls_cancelled, 1, 5000), 1,
               "destroying a running stream must cancel the call");
  cr_assert_eq(echo_server_calls_ended(es), 1);
}

Test(rpc, stop_accepting_keeps_running_calls) {
  rpc_stream_t *s = rpc_stream_open(ch, ECHO_BIDI, NULL, 0, 10000);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "before";
  cr_assert_eq(rpc_stream_write(s, &req.base, false), 0);
  EchoReply *rep = NULL;
  cr_assert_eq(rpc_stream_read(s, &echo_reply__descriptor, (ProtobufCMessage **)&rep, 5000), 1);
  free_reply(rep);

  rpc_server_stop_accepting(echo_server_rpc(es));
  rpc_server_stop_accepting(echo_server_rpc(es)); /* idempotent */

  req.text = "after";
  cr_assert_eq(rpc_stream_write(s, &req.base, false), 0);
  cr_assert_eq(rpc_stream_read(s, &echo_reply__descriptor, (ProtobufCMessage **)&rep, 5000), 1,
               "a running stream must go on after stop_accepting");
  cr_assert_str_eq(rep->text, "after");
  cr_assert_eq(rep->index, 2);
  free_reply(rep);

  rpc_channel_opts_t co = {.own_connection = true, .connect_timeout_ms = 5000};
  rpc_channel_t *fresh = rpc_channel_create(target, &co);
  EchoRequest ureq = ECHO_REQUEST__INIT;
  ureq.text = "new";
  rpc_status_t st;
  grpc_status_code code = call_unary(fresh, ECHO_UNARY, &ureq, &rep, NULL, 0, 2000, &st);
  cr_assert_neq(code, GRPC_STATUS_OK, "a new call was accepted after stop_accepting");
  rpc_channel_destroy(fresh);

  cr_assert_eq(rpc_stream_close_send(s), 0);
  ProtobufCMessage *m = NULL;
  cr_assert_eq(rpc_stream_read(s, &echo_reply__descriptor, &m, 5000), 0);
  cr_assert_eq(rpc_stream_finish(s, &st), GRPC_STATUS_OK, "%s", st.message);
  rpc_stream_destroy(s);
}

/* A handler holding an rpc_call_ref past the grace period (a delayed answer
 * still waiting) must not hold up shutdown: the call is cancelled, on_end runs,
 * and the ref is dropped later. */
Test(rpc, shutdown_with_held_call) {
  delayed_call_t held = {.delay_ms = 3000};
  pthread_t t;
  pthread_create(&t, NULL, delayed_call_thread, &held);
  cr_assert_eq(wait_active(1, 2000), 1, "the delayed call did not start");
  int64_t t0 = rpc_now_ms();
  rpc_server_shutdown(echo_server_rpc(es), 0.3);
  int64_t took = rpc_now_ms() - t0;
  pthread_join(t, NULL);
  cr_assert_lt(took, 1300, "shutdown with grace 0.3 s took %lld ms while a handler held a ref",
               (long long)took);
  cr_assert_eq(echo_server_calls_ended(es), 1, "on_end must have run when shutdown returns");
  cr_assert_eq(echo_server_calls_cancelled(es), 1);
  cr_assert_neq(held.code, GRPC_STATUS_OK, "the cut call must not look answered");
  cr_assert_lt(held.elapsed_ms, 2500, "the client waited %lld ms", (long long)held.elapsed_ms);
}

/* ---------------------------------------------------------- registration */

/* Replies with the text its registration's arg points to. */
static void named_start(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  EchoReply rep = ECHO_REPLY__INIT;
  rep.text = (char *)arg;
  rpc_call_reply(call, &rep.base);
}

static const rpc_method_t named_rows[] = {
    {
        .path = "/meshd.test.v1.Named/Unary",
        .kind = RPC_UNARY,
        .request = &echo_request__descriptor,
        .on_start = named_start,
    },
};

/* One const table, two servers, two args: each call gets its own server's arg. */
Test(rpc, arg_is_given_per_registration) {
  char names[2][8] = {"first", "second"};
  rpc_server_t *srv[2];
  rpc_channel_t *c[2];
  for (int i = 0; i < 2; i++) {
    rpc_server_opts_t o = {.listen = "127.0.0.1:0", .threads = 1};
    char err[256] = "";
    srv[i] = rpc_server_create(&o, err, sizeof err);
    cr_assert_not_null(srv[i], "%s", err);
    cr_assert_eq(rpc_server_add_methods(srv[i], named_rows, 1, names[i]), 0);
    cr_assert_eq(rpc_server_add_methods(srv[i], named_rows, 1, names[i]), -1,
                 "a path registered twice must be refused");
    int port = rpc_server_start(srv[i], err, sizeof err);
    cr_assert_gt(port, 0, "%s", err);
    char t[64];
    snprintf(t, sizeof t, "127.0.0.1:%d", port);
    c[i] = rpc_channel_create(t, &live_peer);
  }
  for (int i = 0; i < 2; i++) {
    EchoRequest req = ECHO_REQUEST__INIT;
    EchoReply *rep;
    rpc_status_t st;
    grpc_status_code code =
        call_unary(c[i], "/meshd.test.v1.Named/Unary", &req, &rep, NULL, 0, 5000, &st);
    cr_assert_eq(code, GRPC_STATUS_OK, "server %d: code %d: %s", i, code, st.message);
    cr_assert_str_eq(rep->text, names[i]);
    free_reply(rep);
  }
  for (int i = 0; i < 2; i++) {
    rpc_channel_destroy(c[i]);
    rpc_server_destroy(srv[i]);
  }
}

/* ---------------------------------------------------------- code names */

Test(rpc_code_name, as_grpc_status_spells_them) {
  static const char *const want[17] = {
      "OK",           "CANCELLED",          "UNKNOWN",           "INVALID_ARGUMENT",
      "DEADLINE_EXCEEDED", "NOT_FOUND",     "ALREADY_EXISTS",    "PERMISSION_DENIED",
      "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",    "OUT_OF_RANGE",
      "UNIMPLEMENTED", "INTERNAL",          "UNAVAILABLE",       "DATA_LOSS",
      "UNAUTHENTICATED"};
  for (int c = 0; c <= 16; c++)
    cr_assert_str_eq(meshd_grpc_code_name((grpc_status_code)c), want[c], "code %d", c);
  cr_assert_str_eq(meshd_grpc_code_name((grpc_status_code)17), "UNKNOWN");
  cr_assert_str_eq(meshd_grpc_code_name((grpc_status_code)-1), "UNKNOWN");
}

/* ---------------------------------------------------------- pause and hold */

/* A server whose handlers pause their reads or hold their answers, and leave
 * the matching resume/release to the test (from its own thread, as a flow
 * control callback would). Bidi: replies to each message with index = messages
 * received so far; "pause" pauses reads once, "pause2" twice. Unary: holds
 * sends, then answers at once. */
static rpc_server_t *psrv;
static rpc_channel_t *pch;
static atomic_int p_received, p_ended, p_cancelled;
static rpc_call_t *_Atomic p_call; /* referenced */

static void p_bidi_message(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  (void)arg;
  if (!msg) {
    rpc_call_finish(call, GRPC_STATUS_OK, NULL, "done");
    return;
  }
  const EchoRequest *req = (const EchoRequest *)msg;
  int n = atomic_fetch_add(&p_received, 1) + 1;
  int pauses = strcmp(req->text, "pause") == 0 ? 1 : strcmp(req->text, "pause2") == 0 ? 2 : 0;
  for (int i = 0; i < pauses; i++) rpc_call_pause_reads(call);
  if (pauses) {
    rpc_call_ref(call);
    atomic_store(&p_call, call);
  }
  EchoReply rep = ECHO_REPLY__INIT;
  rep.text = req->text;
  rep.index = n;
  rpc_call_send(call, &rep.base);
}

static void p_unary(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  (void)arg;
  rpc_call_hold_sends(call);
  rpc_call_ref(call);
  atomic_store(&p_call, call);
  EchoReply rep = ECHO_REPLY__INIT;
  rep.text = ((const EchoRequest *)msg)->text;
  rpc_call_reply(call, &rep.base);
}

static void p_start(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  (void)call, (void)msg, (void)arg;
}

static void p_end(rpc_call_t *call, bool cancelled, void *arg) {
  (void)call, (void)arg;
  atomic_fetch_add(&p_ended, 1);
  if (cancelled) atomic_fetch_add(&p_cancelled, 1);
}

/* Hold: answers nothing while it reads; answers every message it read (in
 * order) only when the layer refuses one, as meshd's Submit holds answers. */
static atomic_int h_read;
static void h_message(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  (void)call, (void)arg;
  if (msg) atomic_fetch_add(&h_read, 1);
}
static void h_refused(rpc_call_t *call, void *arg) {
  (void)arg;
  int n = atomic_exchange(&h_read, 0);
  for (int i = 1; i <= n; i++) {
    EchoReply rep = ECHO_REPLY__INIT;
    rep.text = "held";
    rep.index = i;
    rpc_call_send(call, &rep.base);
  }
}

static const rpc_method_t pause_rows[] = {
    {.path = "/meshd.test.v1.Pause/Bidi", .kind = RPC_BIDI, .request = &echo_request__descriptor,
     .on_start = p_start, .on_message = p_bidi_message, .on_end = p_end},
    {.path = "/meshd.test.v1.Pause/Unary", .kind = RPC_UNARY, .request = &echo_request__descriptor,
     .on_start = p_unary, .on_end = p_end},
    {.path = "/meshd.test.v1.Pause/Hold", .kind = RPC_BIDI, .request = &echo_request__descriptor,
     .on_start = p_start, .on_message = h_message, .on_end = p_end, .on_refused = h_refused},
};

static void pause_setup(void) {
  rpc_init();
  /* A fixed 64 KiB window, as meshd runs it: a paused stream backs its client up soon. */
  rpc_server_opts_t o = {.listen = "127.0.0.1:0", .threads = 2, .stream_window_bytes = 65536};
  char err[256] = "";
  psrv = rpc_server_create(&o, err, sizeof err);
  cr_assert_not_null(psrv, "%s", err);
  cr_assert_eq(rpc_server_add_methods(psrv, pause_rows, 3, NULL), 0);
  int port = rpc_server_start(psrv, err, sizeof err);
  cr_assert_gt(port, 0, "%s", err);
  char t[64];
  snprintf(t, sizeof t, "127.0.0.1:%d", port);
  pch = rpc_channel_create(t, &live_peer);
}

static void pause_teardown(void) {
  rpc_channel_destroy(pch);
  rpc_server_destroy(psrv);
  rpc_shutdown();
}

TestSuite(rpc_pause, .init = pause_setup, .fini = pause_teardown, .timeout = 30);

/* Waits for the handler to hand over its call; returns it (the test's ref). */
static rpc_call_t *take_call(void) {
  int64_t end = rpc_now_ms() + 5000;
  rpc_call_t *c;
  while (!(c = atomic_exchange(&p_call, NULL)) && rpc_now_ms() < end) usleep(1000);
  cr_assert_not_null(c, "the handler did not pause");
  return c;
}

static void write_text(rpc_stream_t *s, const char *text) {
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = (char *)text;
  cr_assert_eq(rpc_stream_write(s, &req.base, false), 0, "write '%s'", text);
}

static void expect_reply(rpc_stream_t *s, int index) {
  EchoReply *rep = NULL;
  int r = rpc_stream_read(s, &echo_reply__descriptor, (ProtobufCMessage **)&rep, 5000);
  cr_assert_eq(r, 1, "reply %d: read %d", index, r);
  cr_assert_eq(rep->index, index);
  free_reply(rep);
}

static int received_after(int ms) {
  usleep((useconds_t)ms * 1000);
  return atomic_load(&p_received);
}

Test(rpc_pause, paused_reads_resume_from_another_thread) {
  rpc_stream_t *s = rpc_stream_open(pch, "/meshd.test.v1.Pause/Bidi", NULL, 0, 10000);
  write_text(s, "pause");
  for (int i = 0; i < 5; i++) write_text(s, "x");
  expect_reply(s, 1);
  rpc_call_t *c = take_call();
  cr_assert_eq(received_after(300), 1, "a paused call reads nothing");
  rpc_call_resume_reads(c);
  for (int i = 2; i <= 6; i++) expect_reply(s, i);
  cr_assert_eq(atomic_load(&p_received), 6);
  cr_assert_eq(rpc_stream_close_send(s), 0);
  ProtobufCMessage *m = NULL;
  cr_assert_eq(rpc_stream_read(s, &echo_reply__descriptor, &m, 5000), 0);
  cr_assert_eq(rpc_stream_finish(s, NULL), GRPC_STATUS_OK);
  rpc_stream_destroy(s);
  rpc_call_resume_reads(c); /* one resume too many is harmless */
  rpc_call_unref(c);
}

/* A message that does not unpack ends a stream with INVALID_ARGUMENT, but
 * what the handler sends from on_refused goes out first: the answers it held
 * for the good messages before the bad one are not lost. */
Test(rpc_pause, a_refused_message_lets_the_handler_send_what_it_held_first) {
  rpc_stream_t *s = rpc_stream_open(pch, "/meshd.test.v1.Pause/Hold", NULL, 0, 10000);
  write_text(s, "a");
  write_text(s, "b");
  EchoReply bogus = ECHO_REPLY__INIT; /* metadata (field 4) is not EchoRequest's varint */
  bogus.metadata = "not a varint";
  cr_assert_eq(rpc_stream_write(s, &bogus.base, false), 0);
  expect_reply(s, 1);
  expect_reply(s, 2);
  ProtobufCMessage *m = NULL;
  cr_assert_eq(rpc_stream_read(s, &echo_reply__descriptor, &m, 5000), 0);
  rpc_status_t st;
  cr_assert_eq(rpc_stream_finish(s, &st), GRPC_STATUS_INVALID_ARGUMENT, "%s", st.message);
  rpc_stream_destroy(s);
}

Test(rpc_pause, pauses_nest) {
  rpc_stream_t *s = rpc_stream_open(pch, "/meshd.test.v1.Pause/Bidi", NULL, 0, 10000);
  write_text(s, "pause2");
  write_text(s, "x");
  expect_reply(s, 1);
  rpc_call_t *c = take_call();
  rpc_call_resume_reads(c);
  cr_assert_eq(received_after(300), 1, "one of two pauses left: still paused");
  rpc_call_resume_reads(c);
  expect_reply(s, 2);
  rpc_stream_destroy(s);
  rpc_call_unref(c);
}

typedef struct {
  rpc_stream_t *s;
  int n;
  atomic_int written;
} flood_t;

static void *flood_writer(void *p) {
  flood_t *f = p;
  static uint8_t payload[64 * 1024];
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "x";
  req.payload.data = payload;
  req.payload.len = sizeof payload;
  for (int i = 0; i < f->n; i++) {
    if (rpc_stream_write(f->s, &req.base, false) != 0) break;
    atomic_fetch_add(&f->written, 1);
  }
  return NULL;
}

/* The point of pausing: the client's writes block once the stream's window
 * is full, instead of the server buffering whatever the client sends. */
Test(rpc_pause, paused_stream_backs_the_client_up) {
  flood_t f = {.s = rpc_stream_open(pch, "/meshd.test.v1.Pause/Bidi", NULL, 0, 20000), .n = 64};
  write_text(f.s, "pause");
  expect_reply(f.s, 1);
  rpc_call_t *c = take_call();
  pthread_t t;
  pthread_create(&t, NULL, flood_writer, &f);
  usleep(500 * 1000);
  int written = atomic_load(&f.written);
  cr_assert_lt(written, 16, "%d of 64 messages of 64 KiB written into a paused stream", written);
  cr_assert_eq(atomic_load(&p_received), 1);
  rpc_call_resume_reads(c);
  pthread_join(t, NULL);
  cr_assert_eq(atomic_load(&f.written), 64);
  for (int i = 2; i <= 65; i++) expect_reply(f.s, i);
  rpc_stream_destroy(f.s);
  rpc_call_unref(c);
}

/* A 64 KiB EchoRequest, packed (the bytes are copied: a writer's reference). */
static rpc_bytes_t *packed_64k(void) {
  char *text = malloc(65537);
  memset(text, 'w', 65536);
  text[65536] = '\0';
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = text;
  uint8_t *b = malloc(protobuf_c_message_get_packed_size(&req.base));
  size_t n = protobuf_c_message_pack(&req.base, b);
  rpc_bytes_t *m = rpc_bytes_copy(b, n);
  free(b);
  free(text);
  return m;
}

/* A Bidi stream whose handler paused its reads; *c: that call (the test's ref). */
static rpc_stream_t *paused_stream(rpc_call_t **c) {
  rpc_stream_t *s = rpc_stream_open(pch, "/meshd.test.v1.Pause/Bidi", NULL, 0, 20000);
  write_text(s, "pause");
  expect_reply(s, 1);
  *c = take_call();
  return s;
}

/* Writes 64 KiB messages into a paused stream, each within 150 ms, until one
 * does not go out in time; returns how many did. */
static int write_until_stuck(rpc_stream_t *s, rpc_bytes_t *m) {
  for (int i = 0; i < 64; i++) {
    int64_t t0 = rpc_now_ms();
    int rc = rpc_stream_write_raw_within(s, m, 150);
    if (rc == -2) {
      cr_assert_lt(rpc_now_ms() - t0, 2000, "a write bounded by 150 ms took %lld ms",
                   (long long)(rpc_now_ms() - t0));
      return i;
    }
    cr_assert_eq(rc, 0, "write %d: %d", i, rc);
  }
  cr_assert_fail("64 messages of 64 KiB went into a paused stream");
  return -1;
}

Test(rpc_pause, a_bounded_write_into_a_paused_stream_stays_in_flight_until_reads_resume) {
  rpc_call_t *c;
  rpc_stream_t *s = paused_stream(&c);
  rpc_bytes_t *m = packed_64k();
  int went = write_until_stuck(s, m);
  /* The next writer waits for the one in flight, within its own bound. */
  int64_t t0 = rpc_now_ms();
  cr_assert_eq(rpc_stream_write_raw_within(s, m, 100), -2);
  cr_assert_lt(rpc_now_ms() - t0, 2000);
  cr_assert_eq(rpc_stream_write_wait(s, 0), -2, "still in flight: nobody reads");
  cr_assert_eq(atomic_load(&p_received), 1);
  rpc_call_resume_reads(c);
  cr_assert_eq(rpc_stream_write_wait(s, 5000), 0, "the write in flight goes once reads resume");
  cr_assert_eq(rpc_stream_write_raw_within(s, m, 5000), 0);
  /* Each message once, in order: the one left in flight was not sent twice. */
  for (int i = 2; i <= went + 3; i++) {
    EchoReply *rep = NULL;
    cr_assert_eq(rpc_stream_read(s, &echo_reply__descriptor, (ProtobufCMessage **)&rep, 5000), 1,
                 "reply %d of %d", i, went + 3);
    cr_assert_eq(rep->index, i);
    cr_assert_eq(strlen(rep->text), 65536);
    free_reply(rep);
  }
  cr_assert_eq(atomic_load(&p_received), went + 3);
  rpc_stream_destroy(s);
  rpc_bytes_free(m);
  rpc_call_unref(c);
}

Test(rpc_pause, destroying_a_stream_with_a_write_in_flight_ends_it) {
  rpc_call_t *c;
  rpc_stream_t *s = paused_stream(&c);
  rpc_bytes_t *m = packed_64k();
  write_until_stuck(s, m);
  int64_t t0 = rpc_now_ms();
  rpc_stream_destroy(s); /* cancels: the write in flight fails, nothing waits for the reader */
  cr_assert_lt(rpc_now_ms() - t0, 2000);
  int64_t end = rpc_now_ms() + 5000;
  while (atomic_load(&p_ended) < 1 && rpc_now_ms() < end) usleep(1000);
  cr_assert_eq(atomic_load(&p_cancelled), 1);
  rpc_call_resume_reads(c);
  rpc_call_unref(c);
  rpc_bytes_free(m);
}

Test(rpc_pause, cancel_while_paused_ends_the_call) {
  rpc_stream_t *s = rpc_stream_open(pch, "/meshd.test.v1.Pause/Bidi", NULL, 0, 10000);
  write_text(s, "pause");
  write_text(s, "x");
  expect_reply(s, 1);
  rpc_call_t *c = take_call();
  rpc_stream_cancel(s);
  int64_t end = rpc_now_ms() + 5000;
  while (atomic_load(&p_ended) < 1 && rpc_now_ms() < end) usleep(1000);
  cr_assert_eq(atomic_load(&p_ended), 1, "on_end runs although reads are paused");
  cr_assert_eq(atomic_load(&p_cancelled), 1);
  cr_assert(rpc_call_ended(c));
  rpc_call_resume_reads(c); /* late: harmless */
  cr_assert_eq(received_after(100), 1);
  rpc_stream_destroy(s);
  rpc_call_unref(c);
  cr_assert_eq(rpc_server_active_calls(psrv), 0);
}

typedef struct {
  int timeout_ms;
  grpc_status_code code;
  char text[32];
  int64_t elapsed_ms;
  atomic_bool done;
} held_call_t;

static void *held_unary(void *p) {
  held_call_t *h = p;
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "held";
  EchoReply *rep = NULL;
  rpc_status_t st;
  int64_t t0 = rpc_now_ms();
  h->code = call_unary(pch, "/meshd.test.v1.Pause/Unary", &req, &rep, NULL, 0, h->timeout_ms, &st);
  h->elapsed_ms = rpc_now_ms() - t0;
  if (rep) {
    snprintf(h->text, sizeof h->text, "%s", rep->text);
    free_reply(rep);
  }
  atomic_store(&h->done, true);
  return NULL;
}

Test(rpc_pause, held_answer_goes_on_release) {
  held_call_t h = {.timeout_ms = 10000};
  pthread_t t;
  pthread_create(&t, NULL, held_unary, &h);
  rpc_call_t *c = take_call();
  usleep(300 * 1000);
  cr_assert_not(atomic_load(&h.done), "a held answer was sent");
  rpc_call_release_sends(c);
  pthread_join(t, NULL);
  cr_assert_eq(h.code, GRPC_STATUS_OK);
  cr_assert_str_eq(h.text, "held");
  cr_assert_geq(h.elapsed_ms, 290);
  rpc_call_unref(c);
}

Test(rpc_pause, deadline_while_held_ends_the_call) {
  /* Connected first by a call answered in time: on a loaded machine the
   * connect alone can outlast a 200 ms deadline, and the call never arrives. */
  held_call_t warm = {.timeout_ms = 5000};
  pthread_t t;
  pthread_create(&t, NULL, held_unary, &warm);
  rpc_call_t *c = take_call();
  rpc_call_release_sends(c);
  rpc_call_unref(c);
  pthread_join(t, NULL);
  cr_assert_eq(warm.code, GRPC_STATUS_OK);

  held_call_t h = {.timeout_ms = 200};
  pthread_create(&t, NULL, held_unary, &h);
  c = take_call();
  pthread_join(t, NULL);
  cr_assert_eq(h.code, GRPC_STATUS_DEADLINE_EXCEEDED);
  int64_t end = rpc_now_ms() + 5000;
  while (atomic_load(&p_ended) < 2 && rpc_now_ms() < end) usleep(1000);
  cr_assert_eq(atomic_load(&p_cancelled), 1);
  rpc_call_release_sends(c); /* late: harmless */
  rpc_call_unref(c);
}

/* ------------------------------------------------------------------ pulls */

typedef struct pull_log {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int got;          /* messages, in order of index */
  int bad_order;    /* a message whose index was not `got` */
  bool ended;
  bool keep_asking; /* ask for the next message from inside the callback */
  rpc_status_t st;
} pull_log_t;

/* The suite's channel gives a connection attempt 100 ms, which a loaded or
 * sanitized run can miss; pulls are meant for calls to a live peer. */
static rpc_channel_t *pull_channel(void) {
  rpc_channel_opts_t o = {.connect_timeout_ms = 5000};
  rpc_channel_t *c = rpc_channel_create(target, &o);
  cr_assert_not_null(c);
  cr_assert(rpc_channel_wait_ready(c, 10000), "cannot connect to %s", target);
  return c;
}

static void pull_log_init(pull_log_t *l, bool keep_asking) {
  memset(l, 0, sizeof *l);
  pthread_mutex_init(&l->mu, NULL);
  pthread_cond_init(&l->cv, NULL);
  l->keep_asking = keep_asking;
}

static void pull_got(rpc_pull_t *p, ProtobufCMessage *m, void *arg) {
  pull_log_t *l = arg;
  pthread_mutex_lock(&l->mu);
  if (!m) {
    rpc_pull_status(p, &l->st);
    l->ended = true;
  } else {
    if (((EchoReply *)m)->index != l->got) l->bad_order++;
    l->got++;
    protobuf_c_message_free_unpacked(m, NULL);
  }
  pthread_cond_broadcast(&l->cv);
  pthread_mutex_unlock(&l->mu);
  if (m && l->keep_asking) rpc_pull_next(p);
}

/* Waits until the log has `got` messages (or ended); returns what it has. */
static int pull_wait(pull_log_t *l, int got, bool until_end, int timeout_ms) {
  int64_t end = rpc_now_ms() + timeout_ms;
  pthread_mutex_lock(&l->mu);
  while ((until_end ? !l->ended : l->got < got && !l->ended) && rpc_now_ms() < end) {
    pthread_mutex_unlock(&l->mu);
    usleep(2000);
    pthread_mutex_lock(&l->mu);
  }
  int n = l->got;
  pthread_mutex_unlock(&l->mu);
  return n;
}

Test(rpc, pull_reads_in_order_to_the_status) {
  rpc_channel_t *pc = pull_channel();
  pull_log_t l;
  pull_log_init(&l, true);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "tick";
  req.reply_count = 1000;
  rpc_pull_t *p = rpc_pull_open(pc, ECHO_SERVER_STREAM, &req.base, &echo_reply__descriptor, NULL, 0,
                                10000, pull_got, &l);
  cr_assert_not_null(p);
  rpc_pull_next(p);
  cr_assert_eq(pull_wait(&l, 1000, true, 10000), 1000);
  cr_assert(l.ended);
  cr_assert_eq(l.bad_order, 0);
  cr_assert_eq(l.st.code, GRPC_STATUS_OK, "%s", l.st.message);
  rpc_pull_destroy(p);
  rpc_channel_destroy(pc);
  cr_assert_eq(wait_counter(echo_server_calls_ended, 1, 10000), 1);
}

Test(rpc, pull_gives_the_error_status_and_kind) {
  rpc_channel_t *pc = pull_channel();
  pull_log_t l;
  pull_log_init(&l, true);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "partial";
  req.reply_count = 3;
  req.fail_code = GRPC_STATUS_DATA_LOSS;
  req.fail_kind = "LOST";
  rpc_pull_t *p = rpc_pull_open(pc, ECHO_SERVER_STREAM, &req.base, &echo_reply__descriptor, NULL, 0,
                                5000, pull_got, &l);
  rpc_pull_next(p);
  cr_assert_eq(pull_wait(&l, 3, true, 5000), 3);
  cr_assert_eq(l.st.code, GRPC_STATUS_DATA_LOSS);
  cr_assert_str_eq(l.st.kind, "LOST");
  cr_assert_str_eq(l.st.message, "echo failure: partial");
  rpc_pull_destroy(p);
  rpc_channel_destroy(pc);
}

/* One message per rpc_pull_next, nothing more until asked. */
Test(rpc, pull_delivers_only_what_was_asked_for) {
  rpc_channel_t *pc = pull_channel();
  pull_log_t l;
  pull_log_init(&l, false);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "one";
  req.reply_count = 5;
  rpc_pull_t *p = rpc_pull_open(pc, ECHO_SERVER_STREAM, &req.base, &echo_reply__descriptor, NULL, 0,
                                5000, pull_got, &l);
  rpc_pull_next(p);
  cr_assert_eq(pull_wait(&l, 1, false, 5000), 1);
  usleep(100000);
  cr_assert_eq(pull_wait(&l, 1, false, 0), 1, "a message came without being asked for");
  for (int i = 2; i <= 5; i++) {
    rpc_pull_next(p);
    cr_assert_eq(pull_wait(&l, i, false, 5000), i);
  }
  cr_assert(!l.ended);
  rpc_pull_next(p);
  pull_wait(&l, 0, true, 5000);
  cr_assert(l.ended);
  cr_assert_eq(l.st.code, GRPC_STATUS_OK);
  rpc_pull_destroy(p);
  rpc_channel_destroy(pc);
}

Test(rpc, pull_cancel_ends_with_null_and_the_server_sees_it) {
  rpc_channel_t *pc = pull_channel();
  pull_log_t l;
  pull_log_init(&l, false);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "slow";
  req.delay_ms = 5000; /* unary answered late: the call stays open */
  rpc_pull_t *p = rpc_pull_open(pc, ECHO_UNARY, &req.base, &echo_reply__descriptor, NULL, 0, 10000,
                                pull_got, &l);
  rpc_pull_next(p);
  cr_assert_eq(wait_counter(echo_server_calls_started, 1, 10000), 1);
  cr_assert(!l.ended);
  rpc_pull_cancel(p);
  pull_wait(&l, 0, true, 2000);
  cr_assert(l.ended, "a cancelled pull must hand fn NULL");
  cr_assert_eq(l.st.code, GRPC_STATUS_CANCELLED);
  rpc_pull_destroy(p);
  rpc_channel_destroy(pc);
  cr_assert_eq(wait_counter(echo_server_calls_cancelled, 1, 10000), 1);
}

Test(rpc, pull_destroyed_unasked_cancels_the_call) {
  rpc_channel_t *pc = pull_channel();
  pull_log_t l;
  pull_log_init(&l, false);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "never read";
  req.delay_ms = 5000;
  rpc_pull_t *p = rpc_pull_open(pc, ECHO_UNARY, &req.base, &echo_reply__descriptor, NULL, 0, 10000,
                                pull_got, &l);
  cr_assert_eq(wait_counter(echo_server_calls_started, 1, 10000), 1);
  rpc_pull_destroy(p);
  rpc_channel_destroy(pc);
  cr_assert_eq(wait_counter(echo_server_calls_cancelled, 1, 10000), 1);
  cr_assert(!l.ended);
  cr_assert_eq(l.got, 0);
}

/* ------------------------------------------------------------------ duplexes */

/* The bidi echo numbers its replies from 1. */
static void duplex_got(rpc_duplex_t *d, ProtobufCMessage *m, void *arg) {
  (void)d;
  pull_log_t *l = arg;
  pthread_mutex_lock(&l->mu);
  if (!m) {
    cr_assert_not(l->ended, "a second end");
    l->ended = true;
  } else {
    if (((EchoReply *)m)->index != l->got + 1) l->bad_order++;
    l->got++;
    protobuf_c_message_free_unpacked(m, NULL);
  }
  pthread_cond_broadcast(&l->cv);
  pthread_mutex_unlock(&l->mu);
}

Test(rpc, duplex_hands_each_message_in_order_to_its_callback_then_the_end) {
  rpc_channel_t *pc = pull_channel();
  pull_log_t l;
  pull_log_init(&l, false);
  rpc_duplex_t *d = rpc_duplex_open(pc, ECHO_BIDI, NULL, 0, -1, &echo_reply__descriptor, duplex_got, &l);
  cr_assert_not_null(d);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "tick";
  for (int i = 0; i < 500; i++) cr_assert_eq(rpc_duplex_write(d, &req.base), 0, "write %d", i);
  cr_assert_eq(pull_wait(&l, 500, false, 10000), 500);
  cr_assert_eq(l.bad_order, 0);
  cr_assert_not(l.ended);
  req.text = "last";
  req.fail_code = GRPC_STATUS_OUT_OF_RANGE;
  cr_assert_eq(rpc_duplex_write(d, &req.base), 0);
  pull_wait(&l, 0, true, 10000);
  cr_assert(l.ended, "the peer's end never reached the callback");
  rpc_status_t st;
  cr_assert_eq(rpc_duplex_finish(d, &st), GRPC_STATUS_OUT_OF_RANGE);
  cr_assert_str_eq(st.message, "echo failure: last");
  cr_assert_eq(rpc_duplex_write(d, &req.base), -1, "a write after the end");
  rpc_duplex_destroy(d);
  rpc_channel_destroy(pc);
  cr_assert_eq(wait_counter(echo_server_calls_ended, 1, 10000), 1);
}

/* rpc_duplex_send_raw chained from its own sent callback, as the server's
 * Upload relay does: every message goes once, in order, then the half-close;
 * a second send while one is in flight is refused. */
typedef struct {
  pull_log_t log;
  int next, total, sent_ok, sent_failed;
  int beside; /* what a send beside the one in flight got */
  rpc_bytes_t *shared; /* every message is a reference to these bytes */
} sender_t;

static void send_next(rpc_duplex_t *d, bool ok, void *arg) {
  sender_t *s = arg;
  pthread_mutex_lock(&s->log.mu);
  if (ok) s->sent_ok++;
  else s->sent_failed++;
  bool more = ok && s->next <= s->total;
  bool close = more && s->next == s->total;
  int n = s->next++;
  pthread_mutex_unlock(&s->log.mu);
  if (!more) return;
  rpc_duplex_send_raw(d, close ? NULL : rpc_bytes_share(s->shared), close, send_next);
  /* The send just started cannot have ended: its end comes on this thread. */
  if (n == 2) s->beside = rpc_duplex_send_raw(d, rpc_bytes_share(s->shared), false, send_next);
}

static void sender_got(rpc_duplex_t *d, ProtobufCMessage *m, void *arg) {
  duplex_got(d, m, &((sender_t *)arg)->log);
}

Test(rpc, duplex_send_raw_goes_in_order_without_waiting_then_half_closes) {
  rpc_channel_t *pc = pull_channel();
  sender_t s = {.total = 200};
  pull_log_init(&s.log, false);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "raw";
  s.shared = rpc_bytes_pack(&req.base);
  rpc_duplex_t *d = rpc_duplex_open(pc, ECHO_BIDI, NULL, 0, 10000, &echo_reply__descriptor,
                                    sender_got, &s);
  cr_assert_not_null(d);
  s.next = 1;
  s.beside = 1;
  cr_assert_eq(rpc_duplex_send_raw(d, rpc_bytes_share(s.shared), false, send_next), 0);
  pull_wait(&s.log, 0, true, 10000);
  cr_assert(s.log.ended, "the echo never ended: the half-close did not go");
  cr_assert_eq(rpc_duplex_status(d, NULL), GRPC_STATUS_OK);
  cr_assert_eq(s.beside, -1, "a second send beside one in flight was not refused");
  cr_assert_eq(s.log.bad_order, 0);
  cr_assert_eq(s.log.got, s.total, "every message echoed once");
  cr_assert_eq(s.sent_failed, 0);
  cr_assert_eq(rpc_duplex_send_raw(d, rpc_bytes_share(s.shared), false, send_next), -1,
               "a send after the end");
  rpc_duplex_destroy(d);
  rpc_bytes_free(s.shared);
  rpc_channel_destroy(pc);
}

/* A duplex with a deadline ends DEADLINE_EXCEEDED when the peer never ends it. */
Test(rpc, duplex_with_a_timeout_ends_at_its_deadline) {
  rpc_channel_t *pc = pull_channel();
  pull_log_t l;
  pull_log_init(&l, false);
  int64_t t0 = rpc_now_ms();
  rpc_duplex_t *d = rpc_duplex_open(pc, ECHO_BIDI, NULL, 0, 300, &echo_reply__descriptor,
                                    duplex_got, &l);
  pull_wait(&l, 0, true, 10000);
  cr_assert(l.ended, "the deadline never ended the call");
  cr_assert_eq(rpc_duplex_status(d, NULL), GRPC_STATUS_DEADLINE_EXCEEDED);
  cr_assert_geq(rpc_now_ms() - t0, 250);
  rpc_duplex_destroy(d);
  rpc_channel_destroy(pc);
}

/* The duplex's messages come on the rpc layer's client thread; the server's
 * workers are named too (operations.md, Troubleshooting: which thread is which). */
static char duplex_thread[16];

static void duplex_got_named(rpc_duplex_t *d, ProtobufCMessage *m, void *arg) {
  if (m && !duplex_thread[0]) pthread_getname_np(pthread_self(), duplex_thread, sizeof duplex_thread);
  duplex_got(d, m, arg);
}

Test(rpc, the_layers_threads_are_named) {
  cr_assert_eq(proc_threads_named("rpc-server"), 2, "the echo server runs 2 workers");
  cr_assert_eq(proc_threads_named("rpc-client"), 0, "no pull or duplex yet");
  rpc_channel_t *pc = pull_channel();
  pull_log_t l;
  pull_log_init(&l, false);
  rpc_duplex_t *d =
      rpc_duplex_open(pc, ECHO_BIDI, NULL, 0, -1, &echo_reply__descriptor, duplex_got_named, &l);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "who";
  cr_assert_eq(rpc_duplex_write(d, &req.base), 0);
  cr_assert_eq(pull_wait(&l, 1, false, 10000), 1);
  cr_assert_str_eq(duplex_thread, "rpc-client");
  cr_assert_eq(proc_threads_named("rpc-client"), 1);
  rpc_duplex_cancel(d);
  rpc_duplex_finish(d, NULL);
  rpc_duplex_destroy(d);
  rpc_channel_destroy(pc);
}

/* An owner frees what fn uses as soon as rpc_duplex_finish returns (the
 * server's links do): finish must wait for fn(NULL) to return, not only for
 * the end to be due. A slow end callback shows it. */
typedef struct {
  pull_log_t log;
  atomic_bool end_started, end_returned;
} slow_end_t;

static void duplex_got_slow_end(rpc_duplex_t *d, ProtobufCMessage *m, void *arg) {
  slow_end_t *se = arg;
  if (!m) {
    atomic_store(&se->end_started, true);
    usleep(300 * 1000);
    atomic_store(&se->end_returned, true);
  }
  duplex_got(d, m, &se->log);
}

Test(rpc, duplex_finish_returns_after_the_end_callback_returned) {
  rpc_channel_t *pc = pull_channel();
  slow_end_t se = {0};
  pull_log_init(&se.log, false);
  rpc_duplex_t *d =
      rpc_duplex_open(pc, ECHO_BIDI, NULL, 0, -1, &echo_reply__descriptor, duplex_got_slow_end, &se);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "one";
  cr_assert_eq(rpc_duplex_write(d, &req.base), 0);
  cr_assert_eq(pull_wait(&se.log, 1, false, 10000), 1);
  rpc_duplex_cancel(d);
  int64_t end = rpc_now_ms() + 10000;
  while (!atomic_load(&se.end_started) && rpc_now_ms() < end) usleep(1000);
  cr_assert(atomic_load(&se.end_started), "the end callback never ran");
  cr_assert_eq(rpc_duplex_finish(d, NULL), GRPC_STATUS_CANCELLED);
  cr_assert(atomic_load(&se.end_returned), "finish returned while the end callback still ran");
  rpc_duplex_destroy(d);
  rpc_channel_destroy(pc);
}

static void *cancel_duplex_later(void *d) {
  usleep(100 * 1000);
  rpc_duplex_cancel(d);
  return NULL;
}

/* A cancel from another thread ends the reads (the callback gets its end) and
 * fails the writes; the server sees the cancel. */
Test(rpc, duplex_cancel_ends_the_call_for_both_sides) {
  rpc_channel_t *pc = pull_channel();
  pull_log_t l;
  pull_log_init(&l, false);
  rpc_duplex_t *d = rpc_duplex_open(pc, ECHO_BIDI, NULL, 0, -1, &echo_reply__descriptor, duplex_got, &l);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "one";
  cr_assert_eq(rpc_duplex_write(d, &req.base), 0);
  cr_assert_eq(pull_wait(&l, 1, false, 10000), 1);
  pthread_t t;
  pthread_create(&t, NULL, cancel_duplex_later, d);
  pull_wait(&l, 0, true, 10000);
  pthread_join(t, NULL);
  cr_assert(l.ended);
  cr_assert_eq(rpc_duplex_finish(d, NULL), GRPC_STATUS_CANCELLED);
  cr_assert_eq(rpc_duplex_write(d, &req.base), -1);
  rpc_duplex_destroy(d);
  rpc_channel_destroy(pc);
  cr_assert_eq(wait_counter(echo_server_calls_cancelled, 1, 10000), 1);
}

/* A duplex given back while its call runs cancels it, and its callback runs
 * no more. */
Test(rpc, duplex_destroyed_while_running_cancels_the_call) {
  rpc_channel_t *pc = pull_channel();
  pull_log_t l;
  pull_log_init(&l, false);
  rpc_duplex_t *d = rpc_duplex_open(pc, ECHO_BIDI, NULL, 0, -1, &echo_reply__descriptor, duplex_got, &l);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "one";
  cr_assert_eq(rpc_duplex_write(d, &req.base), 0);
  cr_assert_eq(pull_wait(&l, 1, false, 10000), 1);
  rpc_duplex_destroy(d);
  rpc_channel_destroy(pc);
  cr_assert_eq(wait_counter(echo_server_calls_cancelled, 1, 10000), 1);
  usleep(50 * 1000);
  cr_assert_not(l.ended, "the callback ran after the duplex was given back");
}

/* ------------------------------------------------------------------ drain waits */

/* A server-streaming handler that queues reply_count replies of its payload and
 * waits for them to drain: d_fired counts the callbacks, d_fired_ended those
 * that saw the call ended, d_ended_before those that ran after on_end. */
static rpc_server_t *dsrv;
static rpc_channel_t *dch;
static atomic_int d_fired, d_fired_ended, d_ended_before, d_ends, d_registered;

static void d_drained(rpc_call_t *call, void *arg) {
  (void)arg;
  if (atomic_load(&d_ends)) atomic_fetch_add(&d_ended_before, 1);
  atomic_fetch_add(&d_fired, 1);
  if (rpc_call_ended(call)) atomic_fetch_add(&d_fired_ended, 1);
  else rpc_call_finish(call, GRPC_STATUS_OK, NULL, "drained");
}

static void d_start(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  (void)arg;
  const EchoRequest *req = (const EchoRequest *)msg;
  EchoReply rep = ECHO_REPLY__INIT;
  rep.payload = req->payload;
  for (int i = 0; i < req->reply_count; i++) {
    rep.index = i;
    rpc_call_send(call, &rep.base);
  }
  if (rpc_call_when_drained(call, 0, d_drained, NULL)) atomic_fetch_add(&d_registered, 1);
  else rpc_call_finish(call, GRPC_STATUS_OK, NULL, "nothing to wait for");
}

static void d_end(rpc_call_t *call, bool cancelled, void *arg) {
  (void)call, (void)cancelled, (void)arg;
  atomic_fetch_add(&d_ends, 1);
}

static const rpc_method_t drain_rows[] = {
    {.path = "/meshd.test.v1.Drain/Stream", .kind = RPC_SERVER_STREAMING,
     .request = &echo_request__descriptor, .on_start = d_start, .on_end = d_end},
};

static void drain_setup(void) {
  rpc_init();
  rpc_server_opts_t o = {.listen = "127.0.0.1:0", .threads = 2};
  char err[256] = "";
  dsrv = rpc_server_create(&o, err, sizeof err);
  cr_assert_not_null(dsrv, "%s", err);
  cr_assert_eq(rpc_server_add_methods(dsrv, drain_rows, 1, NULL), 0);
  int port = rpc_server_start(dsrv, err, sizeof err);
  cr_assert_gt(port, 0, "%s", err);
  char t[64];
  snprintf(t, sizeof t, "127.0.0.1:%d", port);
  /* A client that reads nothing takes only its 64 KiB window. */
  rpc_channel_opts_t co = {.stream_window_bytes = 65536, .connect_timeout_ms = 5000};
  dch = rpc_channel_create(t, &co);
}

static void drain_teardown(void) {
  rpc_channel_destroy(dch);
  rpc_server_destroy(dsrv);
  rpc_shutdown();
}

TestSuite(rpc_drain, .init = drain_setup, .fini = drain_teardown, .timeout = 30);

static int wait_atomic(atomic_int *v, int want, int timeout_ms) {
  int64_t end = rpc_now_ms() + timeout_ms;
  while (atomic_load(v) < want && rpc_now_ms() < end) usleep(2000);
  return atomic_load(v);
}

static rpc_stream_t *open_drain(int replies, size_t payload_bytes, uint8_t *payload) {
  rpc_stream_t *s = rpc_stream_open(dch, "/meshd.test.v1.Drain/Stream", NULL, 0, 10000);
  cr_assert_not_null(s);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.reply_count = replies;
  req.payload.data = payload;
  req.payload.len = payload_bytes;
  cr_assert_eq(rpc_stream_write(s, &req.base, true), 0);
  return s;
}

Test(rpc_drain, fires_once_the_client_read_the_queue) {
  static uint8_t payload[256 * 1024];
  rpc_stream_t *s = open_drain(8, sizeof payload, payload);
  cr_assert_eq(wait_atomic(&d_registered, 1, 10000), 1);
  usleep(300000);
  cr_assert_eq(atomic_load(&d_fired), 0, "2 MiB cannot drain through a 64 KiB window unread");
  for (int i = 0; i < 8; i++) {
    EchoReply *rep = NULL;
    cr_assert_eq(rpc_stream_read(s, &echo_reply__descriptor, (ProtobufCMessage **)&rep, 5000), 1);
    cr_assert_eq(rep->index, i);
    protobuf_c_message_free_unpacked(&rep->base, NULL);
  }
  ProtobufCMessage *m = NULL;
  cr_assert_eq(rpc_stream_read(s, &echo_reply__descriptor, &m, 5000), 0);
  rpc_status_t st;
  cr_assert_eq(rpc_stream_finish(s, &st), GRPC_STATUS_OK, "%s", st.message);
  cr_assert_str_eq(st.message, "drained");
  rpc_stream_destroy(s);
  cr_assert_eq(atomic_load(&d_fired), 1);
  cr_assert_eq(atomic_load(&d_fired_ended), 0);
}

Test(rpc_drain, not_registered_when_nothing_is_queued) {
  rpc_stream_t *s = open_drain(0, 0, NULL);
  rpc_status_t st;
  ProtobufCMessage *m = NULL;
  cr_assert_eq(rpc_stream_read(s, &echo_reply__descriptor, &m, 5000), 0);
  cr_assert_eq(rpc_stream_finish(s, &st), GRPC_STATUS_OK);
  cr_assert_str_eq(st.message, "nothing to wait for");
  rpc_stream_destroy(s);
  cr_assert_eq(atomic_load(&d_registered), 0);
}

Test(rpc_drain, fires_before_on_end_when_the_client_leaves) {
  static uint8_t payload[256 * 1024];
  rpc_stream_t *s = open_drain(8, sizeof payload, payload);
  cr_assert_eq(wait_atomic(&d_registered, 1, 10000), 1);
  usleep(100000);
  rpc_stream_cancel(s);
  cr_assert_eq(wait_atomic(&d_ends, 1, 5000), 1);
  cr_assert_eq(atomic_load(&d_fired), 1, "a pending drain wait must fire when the call ends");
  cr_assert_eq(atomic_load(&d_fired_ended), 1);
  cr_assert_eq(atomic_load(&d_ended_before), 0, "the drain callback ran after on_end");
  rpc_stream_destroy(s);
}

/* Raw messages (rpc_bytes_*): what a relay forwards without unpacking. */
Test(rpc, a_one_field_message_is_built_recognised_and_unpacks_as_the_message) {
  size_t sizes[] = {0, 5, 127, 128, 300, 1 << 20};
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    uint8_t *data = NULL;
    rpc_bytes_t *m = rpc_bytes_field(2, sizes[i], &data);
    cr_assert_not_null(m);
    for (size_t k = 0; k < sizes[i]; k++) data[k] = (uint8_t)(k * 7 + i);
    size_t len = 99;
    cr_assert(rpc_bytes_is_field(m, 2, &len), "%zu bytes", sizes[i]);
    cr_assert_eq(len, sizes[i]);
    cr_assert_not(rpc_bytes_is_field(m, 1, &len), "another field number");
    /* Echo's EchoRequest has `payload` as field 2 (bytes). */
    Meshd__Test__V1__EchoRequest *r =
        (void *)rpc_bytes_unpack(m, &meshd__test__v1__echo_request__descriptor);
    cr_assert_not_null(r);
    cr_assert_eq(r->payload.len, sizes[i]);
    for (size_t k = 0; k < sizes[i]; k++) cr_assert_eq(r->payload.data[k], (uint8_t)(k * 7 + i));
    protobuf_c_message_free_unpacked(&r->base, NULL);
    rpc_bytes_free(m);
  }
  /* Field 2 with anything before or after it is not the bare field. */
  Meshd__Test__V1__EchoRequest q = MESHD__TEST__V1__ECHO_REQUEST__INIT;
  uint8_t payload[3] = {1, 2, 3};
  q.payload.data = payload;
  q.payload.len = 3;
  q.reply_count = 4;
  uint8_t buf[64];
  size_t n = protobuf_c_message_pack(&q.base, buf);
  uint8_t *data;
  rpc_bytes_t *m = rpc_bytes_field(2, n, &data); /* a field holding a packed message */
  memcpy(data, buf, n);
  size_t len;
  cr_assert(rpc_bytes_is_field(m, 2, &len));
  rpc_bytes_free(m);
  q.text = "x";
  q.reply_count = 0;
  n = protobuf_c_message_pack(&q.base, buf); /* text (1) then payload (2) */
  grpc_slice s = grpc_slice_from_copied_buffer((const char *)buf, n);
  m = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  cr_assert_not(rpc_bytes_is_field(m, 2, &len), "a field before it");
  rpc_bytes_free(m);
  q.text = "";
  q.reply_count = 4;
  n = protobuf_c_message_pack(&q.base, buf); /* payload (2) then reply_count (3) */
  s = grpc_slice_from_copied_buffer((const char *)buf, n);
  m = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  cr_assert_not(rpc_bytes_is_field(m, 2, &len), "a field after it");
  rpc_bytes_free(m);
  cr_assert_not(rpc_bytes_is_field(NULL, 2, &len));
}

static int visit_collect(const uint8_t *piece, size_t n, void *arg) {
  uint8_t **at = arg;
  memcpy(*at, piece, n);
  *at += n;
  return 0;
}

/* A received message comes in slices as the network cut it: its first slice
 * may end inside the tag or the length. Such a message is still the bare
 * field (a relay that missed it unpacked a copy, and a reader that counted
 * only recognised chunks came up short), and the visit skips the head
 * across the cut. */
Test(rpc, a_one_field_message_is_recognised_when_its_head_spans_slices) {
  uint8_t payload[300], wire[310], out[300];
  for (size_t k = 0; k < sizeof payload; k++) payload[k] = (uint8_t)(k * 13 + 1);
  Meshd__Test__V1__EchoRequest q = MESHD__TEST__V1__ECHO_REQUEST__INIT;
  q.payload.data = payload;
  q.payload.len = sizeof payload;
  size_t n = protobuf_c_message_pack(&q.base, wire); /* tag (1 byte), length (2), bytes */
  cr_assert_eq(n, 303);
  for (size_t cut1 = 1; cut1 <= 4; cut1++)
    for (size_t cut2 = cut1; cut2 <= 5; cut2++) { /* three slices: [0,cut1) [cut1,cut2) [cut2,n) */
      grpc_slice sl[3] = {grpc_slice_from_copied_buffer((const char *)wire, cut1),
                          grpc_slice_from_copied_buffer((const char *)wire + cut1, cut2 - cut1),
                          grpc_slice_from_copied_buffer((const char *)wire + cut2, n - cut2)};
      rpc_bytes_t *m = grpc_raw_byte_buffer_create(sl, 3);
      for (int i = 0; i < 3; i++) grpc_slice_unref(sl[i]);
      size_t len = 0;
      cr_assert(rpc_bytes_is_field(m, 2, &len), "cut at %zu and %zu", cut1, cut2);
      cr_assert_eq(len, sizeof payload);
      memset(out, 0, sizeof out);
      uint8_t *at = out;
      cr_assert_eq(rpc_bytes_field_visit(m, visit_collect, &at), 0);
      cr_assert_eq(at - out, (ptrdiff_t)sizeof payload, "cut at %zu and %zu", cut1, cut2);
      cr_assert_arr_eq(out, payload, sizeof payload, "cut at %zu and %zu", cut1, cut2);
      rpc_bytes_free(m);
    }
  /* Cut short inside the length: not a field. */
  grpc_slice sl = grpc_slice_from_copied_buffer((const char *)wire, 2);
  rpc_bytes_t *m = grpc_raw_byte_buffer_create(&sl, 1);
  grpc_slice_unref(sl);
  size_t len;
  cr_assert_not(rpc_bytes_is_field(m, 2, &len));
  rpc_bytes_free(m);
}

Test(rpc, a_one_field_messages_bytes_are_aligned_for_any_element) {
  for (size_t len = 0; len < 300; len += 7) {
    uint8_t *data = NULL;
    rpc_bytes_t *m = rpc_bytes_field(2, len, &data);
    cr_assert_eq((uintptr_t)data % 16, 0, "%zu bytes at %p", len, (void *)data);
    memset(data, 0xab, len);
    size_t got;
    cr_assert(rpc_bytes_is_field(m, 2, &got));
    cr_assert_eq(got, len);
    Meshd__Test__V1__EchoRequest *r =
        (void *)rpc_bytes_unpack(m, &meshd__test__v1__echo_request__descriptor);
    cr_assert_not_null(r);
    cr_assert_eq(r->payload.len, len);
    for (size_t k = 0; k < len; k++) cr_assert_eq(r->payload.data[k], 0xab);
    protobuf_c_message_free_unpacked(&r->base, NULL);
    rpc_bytes_free(m);
  }
}

/* rpc_stream_read_raw hands a reply over packed; rpc_bytes_read copies any
 * message, in however many slices it came, into one reused buffer that grows. */
/* rpc_bytes_field_ref: a message around the caller's bytes, not a copy of
 * them. Its hold counts it until gRPC lets go (and the sender's own
 * reference); the bytes arrive whole, and a change to the caller's buffer
 * after the send shows that they were not copied when the message was made. */
Test(rpc, a_message_can_reference_the_callers_bytes_until_grpc_lets_go) {
  static uint8_t data[300000];
  for (size_t k = 0; k < sizeof data; k++) data[k] = (uint8_t)(k * 31 + 7);
  rpc_hold_t *h = rpc_hold_create();
  cr_assert_not_null(h);
  cr_assert(rpc_hold_wait(h, 0), "nothing held yet");
  rpc_bytes_t *m = rpc_bytes_field_ref(2, data, sizeof data, h);
  cr_assert_not_null(m);
  size_t len = 0;
  cr_assert(rpc_bytes_is_field(m, 2, &len));
  cr_assert_eq(len, sizeof data);
  cr_assert_not(rpc_hold_wait(h, 0), "the message is held");
  data[5] = 0xee; /* referenced, not copied: the message sees it */

  rpc_stream_t *s = rpc_stream_open(ch, ECHO_BIDI, NULL, 0, 5000);
  cr_assert_not_null(s);
  cr_assert_eq(rpc_stream_write_raw(s, m), 0);
  rpc_bytes_free(m);
  cr_assert_eq(rpc_stream_close_send(s), 0);
  ProtobufCMessage *got = NULL;
  cr_assert_eq(rpc_stream_read(s, &echo_reply__descriptor, &got, 5000), 1);
  EchoReply *rep = (EchoReply *)got;
  cr_assert_eq(rep->payload.len, sizeof data);
  cr_assert_eq(rep->payload.data[5], 0xee);
  cr_assert_arr_eq(rep->payload.data, data, sizeof data);
  free_reply(rep);
  cr_assert_eq(rpc_stream_finish(s, NULL), GRPC_STATUS_OK);
  rpc_stream_destroy(s);
  cr_assert(rpc_hold_wait(h, 5000), "gRPC still holds the message after the call");
  rpc_hold_release(h);

  /* Let go of before it was sent: the hold is free at once. */
  h = rpc_hold_create();
  m = rpc_bytes_field_ref(2, data, 10, h);
  rpc_bytes_free(m);
  cr_assert(rpc_hold_wait(h, 0));
  rpc_hold_release(h);
}

Test(rpc, raw_stream_reads_into_one_growing_buffer) {
  rpc_stream_t *s = rpc_stream_open(ch, ECHO_BIDI, NULL, 0, 5000);
  cr_assert_not_null(s);
  static char big[100000];
  memset(big, 'x', sizeof big - 1);
  const char *texts[] = {"one", big, "three"};
  uint8_t *buf = NULL;
  size_t cap = 0;
  for (size_t i = 0; i < 3; i++) {
    EchoRequest req = ECHO_REQUEST__INIT;
    req.text = (char *)texts[i];
    cr_assert_eq(rpc_stream_write(s, &req.base, i == 2), 0);
    rpc_bytes_t *m = NULL;
    cr_assert_eq(rpc_stream_read_raw(s, &m, 5000), 1);
    long n = rpc_bytes_read(m, &buf, &cap);
    cr_assert_eq(n, (long)grpc_byte_buffer_length(m));
    cr_assert_geq(cap, (size_t)n);
    rpc_bytes_free(m);
    EchoReply *rep = (EchoReply *)protobuf_c_message_unpack(&echo_reply__descriptor, NULL,
                                                             (size_t)n, buf);
    cr_assert_not_null(rep);
    cr_assert_str_eq(rep->text, texts[i]);
    free_reply(rep);
  }
  rpc_bytes_t *m = NULL;
  cr_assert_eq(rpc_stream_read_raw(s, &m, 5000), 0, "the end of the stream");
  cr_assert_null(m);
  cr_assert_eq(rpc_stream_finish(s, NULL), GRPC_STATUS_OK);
  rpc_stream_destroy(s);

  /* Three slices, read into a buffer already big enough: no growth. */
  grpc_slice parts[3] = {grpc_slice_from_copied_string("ab"), grpc_slice_from_copied_string("cde"),
                         grpc_slice_from_copied_string("f")};
  m = grpc_raw_byte_buffer_create(parts, 3);
  for (int i = 0; i < 3; i++) grpc_slice_unref(parts[i]);
  uint8_t *before = buf;
  size_t cap_before = cap;
  cr_assert_eq(rpc_bytes_read(m, &buf, &cap), 6);
  cr_assert_eq(memcmp(buf, "abcdef", 6), 0);
  cr_assert(buf == before && cap == cap_before);
  rpc_bytes_free(m);
  free(buf);
}

/* A guard that takes its time (an auth check) while the client gives up: the
 * call's end comes during the guard. The handler must then see on_start and
 * on_end both, or neither: once a call started without its end (the agent's
 * Write leaked its state that way under load). */
static grpc_status_code slow_guard(rpc_call_t *call, void *arg, rpc_identity_t *id, char *why,
                                   size_t whylen) {
  (void)call, (void)arg, (void)id, (void)why, (void)whylen;
  usleep(300 * 1000);
  return GRPC_STATUS_OK;
}

Test(rpc_guard, a_call_that_ends_during_its_guard_still_gets_its_end) {
  rpc_init();
  rpc_server_opts_t opts = {.listen = "127.0.0.1:0", .threads = 2};
  char err[256] = "";
  echo_server_t *gs = echo_server_start_guarded(&opts, slow_guard, NULL, err, sizeof err);
  cr_assert_not_null(gs, "%s", err);
  char t[64];
  snprintf(t, sizeof t, "127.0.0.1:%d", echo_server_port(gs));
  rpc_channel_t *c = rpc_channel_create(t, &live_peer);
  cr_assert(rpc_channel_wait_ready(c, 5000), "the server is not ready");
  /* Whether a call whose client gave up during the guard starts at all is a
   * race (the server may see the cancel first: then neither callback runs,
   * and CI once saw none of 3 start); each that starts must end. */
  for (int i = 0; i < 6; i++) {
    rpc_stream_t *s = rpc_stream_open(c, ECHO_CLIENT_STREAM, NULL, 0, 100); /* gives up in 100 ms */
    cr_assert_not_null(s);
    rpc_stream_finish(s, NULL);
    rpc_stream_destroy(s);
  }
  /* And one that waits for its guard: it starts and ends. */
  rpc_stream_t *s = rpc_stream_open(c, ECHO_CLIENT_STREAM, NULL, 0, 5000);
  cr_assert_not_null(s);
  rpc_stream_close_send(s);
  EchoReply *rep = NULL;
  while (rpc_stream_read(s, &echo_reply__descriptor, (ProtobufCMessage **)&rep, 5000) == 1)
    free_reply(rep);
  cr_assert_eq(rpc_stream_finish(s, NULL), GRPC_STATUS_OK);
  rpc_stream_destroy(s);
  cr_assert_gt(echo_server_calls_started(gs), 0, "no call reached its handler");
  int64_t end = rpc_now_ms() + 5000;
  while (echo_server_calls_ended(gs) < echo_server_calls_started(gs) && rpc_now_ms() < end)
    usleep(10 * 1000);
  cr_assert_eq(echo_server_calls_ended(gs), echo_server_calls_started(gs),
               "%d calls started, %d ended", echo_server_calls_started(gs),
               echo_server_calls_ended(gs));
  rpc_channel_destroy(c);
  echo_server_stop(gs, 0);
  rpc_shutdown();
}

/* ---------------------------------------------------------- review-82 */

/* rpc.h promises a drain callback runs "as a callback of the call (never at
 * the same time as its others)". A bidi handler that registers the wait in
 * on_message and is still inside on_message when the write completes: the
 * write's completion is taken by the other completion-queue thread, which ran
 * the drain callback at once, concurrently with on_message. */
static rpc_server_t *dcsrv;
static atomic_int dc_in_message, dc_overlap, dc_fired, dc_registered;

static void dc_drained(rpc_call_t *call, void *arg) {
  (void)call, (void)arg;
  if (atomic_load(&dc_in_message)) atomic_fetch_add(&dc_overlap, 1);
  atomic_fetch_add(&dc_fired, 1);
}

static void dc_message(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  (void)arg;
  if (!msg) {
    rpc_call_finish(call, GRPC_STATUS_OK, NULL, "done");
    return;
  }
  atomic_store(&dc_in_message, 1);
  EchoReply rep = ECHO_REPLY__INIT;
  rep.text = "r";
  rpc_call_hold_sends(call); /* queued, not yet written: the wait registers */
  rpc_call_send(call, &rep.base);
  if (rpc_call_when_drained(call, 0, dc_drained, NULL)) atomic_fetch_add(&dc_registered, 1);
  rpc_call_release_sends(call); /* the write goes; its completion lands on the other thread */
  usleep(300 * 1000);            /* the handler is still busy (test-side sleep) */
  atomic_store(&dc_in_message, 0);
}

static void dc_start(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  (void)call, (void)msg, (void)arg;
}

static const rpc_method_t dc_rows[] = {
    {.path = "/meshd.test.v1.DrainCb/Bidi", .kind = RPC_BIDI, .request = &echo_request__descriptor,
     .on_start = dc_start, .on_message = dc_message},
};

Test(rpc_review, drain_callback_never_runs_during_on_message, .timeout = 30) {
  rpc_init();
  rpc_server_opts_t o = {.listen = "127.0.0.1:0", .threads = 2};
  char err[256] = "";
  dcsrv = rpc_server_create(&o, err, sizeof err);
  cr_assert_not_null(dcsrv, "%s", err);
  cr_assert_eq(rpc_server_add_methods(dcsrv, dc_rows, 1, NULL), 0);
  int port = rpc_server_start(dcsrv, err, sizeof err);
  cr_assert_gt(port, 0, "%s", err);
  char t[64];
  snprintf(t, sizeof t, "127.0.0.1:%d", port);
  rpc_channel_t *c = rpc_channel_create(t, &live_peer);
  rpc_stream_t *s = rpc_stream_open(c, "/meshd.test.v1.DrainCb/Bidi", NULL, 0, 10000);
  cr_assert_not_null(s);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "x";
  cr_assert_eq(rpc_stream_write(s, &req.base, true), 0);
  ProtobufCMessage *m = NULL;
  while (rpc_stream_read(s, &echo_reply__descriptor, &m, 5000) == 1) protobuf_c_message_free_unpacked(m, NULL);
  cr_assert_eq(rpc_stream_finish(s, NULL), GRPC_STATUS_OK);
  rpc_stream_destroy(s);
  cr_assert_eq(atomic_load(&dc_registered), 1);
  cr_assert_eq(wait_atomic(&dc_fired, 1, 5000), 1);
  cr_assert_eq(atomic_load(&dc_overlap), 0,
               "the drain callback ran while on_message of the same call was running");
  rpc_channel_destroy(c);
  rpc_server_destroy(dcsrv);
  rpc_shutdown();
}

/* rpc_stream_write_raw_within(s, msg, T) is "bounded by timeout_ms", yet it
 * waits up to T for the write left in flight and then up to T again for its
 * own: a write left in flight that goes at 0.75 T, followed by one the peer
 * does not take, returns after about 1.75 T. */
static rpc_bytes_t *packed_text_payload(const char *text, size_t payload) {
  uint8_t *pl = calloc(1, payload);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = (char *)text;
  req.payload.data = pl;
  req.payload.len = payload;
  uint8_t *b = malloc(protobuf_c_message_get_packed_size(&req.base));
  size_t n = protobuf_c_message_pack(&req.base, b);
  rpc_bytes_t *m = rpc_bytes_copy(b, n);
  free(b);
  free(pl);
  return m;
}

static void *resume_later(void *p) {
  usleep(300 * 1000);
  rpc_call_resume_reads(p); /* the handler reads one "pause" message and pauses again */
  return NULL;
}

Test(rpc_pause, a_bounded_write_returns_within_its_bound_when_one_was_in_flight) {
  rpc_call_t *c;
  rpc_stream_t *s = paused_stream(&c);
  rpc_bytes_t *m = packed_text_payload("pause", 65536);
  write_until_stuck(s, m); /* one 64 KiB write left in flight, behind unread "pause"s */
  rpc_bytes_t *big = packed_text_payload("x", 256 * 1024);
  pthread_t th;
  pthread_create(&th, NULL, resume_later, c);
  int64_t t0 = rpc_now_ms();
  int rc = rpc_stream_write_raw_within(s, big, 400);
  int64_t took = rpc_now_ms() - t0;
  pthread_join(th, NULL);
  rpc_call_t *again = take_call(); /* the handler's ref from its second pause */
  cr_assert(rc == 0 || rc == -2, "rc %d", rc);
  /* (unbounded, it waits for the in-flight write, which the handler's second
   * pause never lets end: 1 s of slack for a loaded machine still tells) */
  cr_assert_lt(took, 400 + 1000, "a write bounded by 400 ms took %lld ms (rc %d)",
               (long long)took, rc);
  rpc_stream_destroy(s);
  rpc_bytes_free(m);
  rpc_bytes_free(big);
  rpc_call_unref(again);
  rpc_call_unref(c);
}

/* ---------------------------------------------------------- review-110 */

/* A unary call whose client gives up while its guard runs: the CLOSE comes
 * during the guard (another completion-queue thread takes it) and leaves the
 * end to the guard's thread. The guard admits; the call's request read then
 * fails on the cancelled call, and nothing ended the call: it stayed counted
 * in rpc_server_active_calls (and its memory and grpc_call were never given
 * back, which held the server's shutdown for its 5 s bound). */
Test(rpc_guard, a_unary_call_that_ends_during_its_guard_is_given_back) {
  rpc_init();
  rpc_server_opts_t opts = {.listen = "127.0.0.1:0", .threads = 2};
  char err[256] = "";
  echo_server_t *gs = echo_server_start_guarded(&opts, slow_guard, NULL, err, sizeof err);
  cr_assert_not_null(gs, "%s", err);
  char t[64];
  snprintf(t, sizeof t, "127.0.0.1:%d", echo_server_port(gs));
  rpc_channel_t *c = rpc_channel_create(t, &live_peer);
  cr_assert(rpc_channel_wait_ready(c, 5000), "the server is not ready");
  for (int i = 0; i < 3; i++) {
    EchoRequest req = ECHO_REQUEST__INIT;
    req.text = "late";
    ProtobufCMessage *resp = NULL;
    grpc_status_code code =
        rpc_unary(c, ECHO_UNARY, &req.base, &echo_reply__descriptor, &resp, NULL, 0, 100, NULL);
    if (resp) protobuf_c_message_free_unpacked(resp, NULL);
    cr_assert_eq(code, GRPC_STATUS_DEADLINE_EXCEEDED, "code %d", code);
    usleep(400 * 1000); /* the guard (300 ms) returns */
  }
  rpc_server_t *srv = echo_server_rpc(gs);
  int64_t end = rpc_now_ms() + 3000;
  while (rpc_server_active_calls(srv) > 0 && rpc_now_ms() < end) usleep(10 * 1000);
  cr_assert_eq(rpc_server_active_calls(srv), 0,
               "%d call(s) cancelled during their guard are still counted active",
               rpc_server_active_calls(srv));
  int64_t t0 = rpc_now_ms();
  rpc_channel_destroy(c);
  echo_server_stop(gs, 0);
  cr_expect_lt(rpc_now_ms() - t0, 3000, "the server's shutdown took %lld ms",
               (long long)(rpc_now_ms() - t0));
  rpc_shutdown();
}

/* ------------------------------------------------------------------ the process loop */

/* rpc_loop_start: one queue and one thread for every server and every pull
 * and duplex of the process (the meshd server runs this way). */
static void loop_hook(void) {}

static echo_server_t *loop_echo(char *tgt, size_t len) {
  rpc_server_opts_t opts = {.listen = "127.0.0.1:0", .threads = 2};
  char err[256] = "";
  echo_server_t *s = echo_server_start(&opts, err, sizeof err);
  cr_assert_not_null(s, "echo_server_start: %s", err);
  snprintf(tgt, len, "127.0.0.1:%d", echo_server_port(s));
  return s;
}

Test(rpc_loop, every_server_and_call_is_served_by_the_loops_one_thread, .timeout = 60) {
  rpc_init();
  cr_assert_eq(rpc_loop_start(1, loop_hook), 0);
  cr_assert_not(rpc_on_loop_thread());
  char ta[64], tb[64];
  echo_server_t *a = loop_echo(ta, sizeof ta), *b = loop_echo(tb, sizeof tb);
  /* One poller: the servers' threads are the loop's (their .threads is not used). */
  cr_assert_eq(proc_threads_named("rpc-server"), 0, "a server on the loop started threads");
  cr_assert_eq(proc_threads_named("rpc-loop"), 1);

  /* A pull on a channel that has not connected yet: its pick waits in gRPC
   * with the call's queue as its pollset (a queue that does not poll fails
   * there, a gRPC assertion). */
  rpc_channel_t *ca = rpc_channel_create(ta, &(rpc_channel_opts_t){.connect_timeout_ms = 5000});
  pull_log_t pl;
  pull_log_init(&pl, true);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "tick";
  req.reply_count = 200;
  rpc_pull_t *p = rpc_pull_open(ca, ECHO_SERVER_STREAM, &req.base, &echo_reply__descriptor, NULL,
                                0, 10000, pull_got, &pl);
  cr_assert_not_null(p);
  rpc_pull_next(p);
  cr_assert_eq(pull_wait(&pl, 200, true, 10000), 200);
  cr_assert_eq(pl.bad_order, 0);
  cr_assert_eq(pl.st.code, GRPC_STATUS_OK, "%s", pl.st.message);
  rpc_pull_destroy(p);
  cr_assert_eq(proc_threads_named("rpc-client"), 1, "the pull's events go to the client thread");

  /* A duplex to b stays open while a is shut down with a call still open. */
  rpc_channel_t *cb = rpc_channel_create(tb, &(rpc_channel_opts_t){.connect_timeout_ms = 5000});
  pull_log_t dl;
  pull_log_init(&dl, false);
  rpc_duplex_t *d = rpc_duplex_open(cb, ECHO_BIDI, NULL, 0, -1, &echo_reply__descriptor,
                                    duplex_got, &dl);
  cr_assert_not_null(d);
  EchoRequest one = ECHO_REQUEST__INIT;
  one.text = "before";
  cr_assert_eq(rpc_duplex_write(d, &one.base), 0);
  cr_assert_eq(pull_wait(&dl, 1, false, 10000), 1);
  rpc_stream_t *held = rpc_stream_open(ca, ECHO_BIDI, NULL, 0, 10000);
  cr_assert_not_null(held);
  EchoRequest h = ECHO_REQUEST__INIT;
  h.text = "held";
  cr_assert_eq(rpc_stream_write(held, &h.base, false), 0);
  int64_t t0 = rpc_now_ms();
  echo_server_stop(a, 0); /* cancels the held call; waits for its last event on the loop */
  cr_assert_lt(rpc_now_ms() - t0, 5000, "a's shutdown took %lld ms", (long long)(rpc_now_ms() - t0));
  one.text = "after";
  cr_assert_eq(rpc_duplex_write(d, &one.base), 0);
  cr_assert_eq(pull_wait(&dl, 2, false, 10000), 2, "b stopped answering when a was shut down");

  rpc_duplex_cancel(d);
  rpc_duplex_finish(d, NULL);
  rpc_duplex_destroy(d);
  rpc_stream_destroy(held);
  rpc_channel_destroy(ca);
  rpc_channel_destroy(cb);
  echo_server_stop(b, 0);
  rpc_shutdown();
  cr_assert_eq(proc_threads_named("rpc-loop"), 0, "rpc_shutdown left the loop running");
}

/* A peer that accepts the TCP connection and never says a word of HTTP/2
 * (a wrong port, a stuck process): a stream opened on it with no deadline,
 * as an agent's registration is, must come back with an error, not hang in
 * rpc_stream_open's wait for its headers to go out. */
typedef struct {
  rpc_channel_t *ch;
  atomic_int done;
  int wrote, read;
  grpc_status_code code;
} silent_open_t;

static void *silent_open(void *p) {
  silent_open_t *so = p;
  rpc_stream_t *s = rpc_stream_open(so->ch, ECHO_BIDI, NULL, 0, 0);
  if (s) {
    EchoRequest req = ECHO_REQUEST__INIT;
    req.text = "anyone?";
    so->wrote = rpc_stream_write(s, &req.base, false);
    ProtobufCMessage *m = NULL;
    so->read = rpc_stream_read(s, &echo_reply__descriptor, &m, 0);
    if (m) protobuf_c_message_free_unpacked(m, NULL);
    rpc_status_t st;
    so->code = rpc_stream_finish(s, &st);
    rpc_stream_destroy(s);
  }
  atomic_store(&so->done, 1);
  return NULL;
}

Test(rpc, stream_to_a_silent_peer_without_deadline_ends, .timeout = 30) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  cr_assert_geq(fd, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
  cr_assert_eq(listen(fd, 16), 0); /* the kernel accepts; nobody answers */
  socklen_t len = sizeof a;
  cr_assert_eq(getsockname(fd, (struct sockaddr *)&a, &len), 0);
  char silent[64];
  snprintf(silent, sizeof silent, "127.0.0.1:%d", ntohs(a.sin_port));
  silent_open_t so = {.ch = rpc_channel_create(silent, NULL)};
  cr_assert_not_null(so.ch);
  pthread_t t;
  pthread_create(&t, NULL, silent_open, &so);
  int64_t t0 = rpc_now_ms();
  while (!atomic_load(&so.done) && rpc_now_ms() - t0 < 20000) usleep(20 * 1000);
  int64_t took = rpc_now_ms() - t0;
  cr_assert(atomic_load(&so.done), "a stream to a silent peer %s still waits after %lld ms",
            silent, (long long)took);
  pthread_join(t, NULL);
  cr_assert_neq(so.code, GRPC_STATUS_OK, "a silent peer cannot answer OK");
  cr_assert_neq(so.read, 1);
  rpc_channel_destroy(so.ch);
  close(fd);
}

/* ---------------------------------------------------------- review-214 */

/* A guard that admits "bob" with a credential, once the test opens its gate:
 * a bearer token checked against the tokens a reload is about to replace. */
typedef struct gate {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool entered, open;
} gate_t;

static grpc_status_code gated_guard(rpc_call_t *call, void *arg, rpc_identity_t *id, char *why,
                                    size_t whylen) {
  (void)call, (void)why, (void)whylen;
  gate_t *g = arg;
  pthread_mutex_lock(&g->mu);
  g->entered = true;
  pthread_cond_broadcast(&g->cv);
  int64_t end = rpc_now_ms() + 5000; /* bounded: a test that fails does not hang */
  while (!g->open && rpc_now_ms() < end) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 10 * 1000000L;
    if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    pthread_cond_timedwait(&g->cv, &g->mu, &ts);
  }
  pthread_mutex_unlock(&g->mu);
  snprintf(id->name, sizeof id->name, "bob");
  id->has_credential = true;
  memset(id->credential, 7, sizeof id->credential);
  return GRPC_STATUS_OK;
}

static bool every_token_revoked(const rpc_identity_t *id, void *arg) {
  (void)id, (void)arg;
  return true;
}

/* A reload's rpc_server_end_calls_of that runs while a call's guard is
 * admitting it (the token checked against the old tokens, the identity not
 * stored yet) cannot see that call: the call was then served under a revoked
 * token. It is asked again once its guard returns, and refused. */
Test(rpc_guard, a_call_admitted_while_its_token_is_revoked_is_refused) {
  rpc_init();
  gate_t g = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
  rpc_server_opts_t opts = {.listen = "127.0.0.1:0", .threads = 2};
  char err[256] = "";
  echo_server_t *gs = echo_server_start_guarded(&opts, gated_guard, &g, err, sizeof err);
  cr_assert_not_null(gs, "%s", err);
  char t[64];
  snprintf(t, sizeof t, "127.0.0.1:%d", echo_server_port(gs));
  rpc_channel_t *c = rpc_channel_create(t, &live_peer);
  cr_assert(rpc_channel_wait_ready(c, 5000), "the server is not ready");
  rpc_stream_t *s = rpc_stream_open(c, ECHO_CLIENT_STREAM, NULL, 0, 5000);
  cr_assert_not_null(s);
  pthread_mutex_lock(&g.mu);
  int64_t end = rpc_now_ms() + 5000;
  while (!g.entered && rpc_now_ms() < end) {
    pthread_mutex_unlock(&g.mu);
    usleep(1000);
    pthread_mutex_lock(&g.mu);
  }
  bool entered = g.entered;
  pthread_mutex_unlock(&g.mu);
  cr_assert(entered, "the call's guard never ran");
  int ended = rpc_server_end_calls_of(echo_server_rpc(gs), every_token_revoked, NULL,
                                      GRPC_STATUS_UNAUTHENTICATED, "UNAUTHENTICATED",
                                      "revoked at a reload");
  cr_assert_eq(ended, 0, "the call in its guard has no identity yet: nothing to end");
  pthread_mutex_lock(&g.mu);
  g.open = true;
  pthread_cond_broadcast(&g.cv);
  pthread_mutex_unlock(&g.mu);
  rpc_stream_close_send(s);
  EchoReply *rep = NULL;
  while (rpc_stream_read(s, &echo_reply__descriptor, (ProtobufCMessage **)&rep, 5000) == 1)
    free_reply(rep);
  rpc_status_t st;
  cr_assert_eq(rpc_stream_finish(s, &st), GRPC_STATUS_UNAUTHENTICATED,
               "the call admitted across the revocation ran: %d %s", st.code, st.message);
  cr_assert(strstr(st.message, "principal 'bob': revoked at a reload"), "%s", st.message);
  rpc_stream_destroy(s);
  cr_assert_eq(echo_server_calls_started(gs), 0, "its handler ran");
  rpc_channel_destroy(c);
  echo_server_stop(gs, 0);
  rpc_shutdown();
}
