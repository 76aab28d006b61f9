/* The rpc layer's security: TLS and mTLS ports and channels (rpc_tls_t),
 * certificate rotation, and method guards (rpc_server_add_methods_guarded).
 * Real gRPC over 127.0.0.1 with a throwaway PKI made once per process by
 * tests/support/make_certs.sh (the openssl CLI). */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/socket.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "echo_server.h"
#include "rpc.h"

/* A channel to a live peer in this process: seconds to connect, since a loaded
 * machine (CI runs the sanitized suites on 2 cores) can take longer than the
 * 100 ms default to answer the first SETTINGS frame. */
static const rpc_channel_opts_t live_peer = {.connect_timeout_ms = 5000};


static char pki[512]; /* the folder make_certs.sh filled */

static const char *pki_file(const char *name) {
  static char paths[8][600];
  static int next;
  char *p = paths[next++ % 8];
  snprintf(p, sizeof paths[0], "%s/%s", pki, name);
  return p;
}

static void make_pki(void) {
  const char *src = getenv("MESHD_SOURCE_DIR");
  cr_assert_not_null(src, "MESHD_SOURCE_DIR is not set (ctest sets it)");
  char dir[] = "/tmp/meshd-pki-XXXXXX";
  cr_assert_not_null(mkdtemp(dir));
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "bash %s/tests/support/make_certs.sh %s >/dev/null", src, dir);
  cr_assert_eq(system(cmd), 0, "make_certs.sh failed");
  snprintf(pki, sizeof pki, "%s", dir);
}

static void remove_pki(void) {
  if (!pki[0]) return;
  char cmd[700];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", pki);
  if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", pki);
}

static void setup(void) {
  rpc_init();
  make_pki();
}

static void teardown(void) {
  remove_pki();
  rpc_shutdown();
}

TestSuite(rpc_tls, .init = setup, .fini = teardown, .timeout = 60);

static echo_server_t *start(rpc_tls_t tls, rpc_guard_fn guard, void *guard_arg) {
  rpc_server_opts_t o = {.listen = "127.0.0.1:0", .threads = 2, .tls = tls};
  char err[300] = "";
  echo_server_t *es = echo_server_start_guarded(&o, guard, guard_arg, err, sizeof err);
  cr_assert_not_null(es, "echo_server_start: %s", err);
  return es;
}

/* One Echo/Unary call on a fresh channel; returns its code, the reply's
 * metadata field in md (when OK) and the status message in st. */
static grpc_status_code call_echo(echo_server_t *es, rpc_tls_t tls, const rpc_md_t *md, size_t nmd,
                                  char *reply_md, size_t len, rpc_status_t *st) {
  char target[64];
  snprintf(target, sizeof target, "localhost:%d", echo_server_port(es));
  rpc_channel_opts_t co = {.tls = tls, .connect_timeout_ms = 2000};
  rpc_channel_t *ch = rpc_channel_create(target, &co);
  cr_assert_not_null(ch, "rpc_channel_create");
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "hi";
  ProtobufCMessage *resp = NULL;
  grpc_status_code code =
      rpc_unary(ch, ECHO_UNARY, &req.base, &echo_reply__descriptor, &resp, md, nmd, 5000, st);
  if (resp) {
    if (reply_md) snprintf(reply_md, len, "%s", ((EchoReply *)resp)->metadata);
    protobuf_c_message_free_unpacked(resp, NULL);
  }
  rpc_channel_destroy(ch);
  return code;
}

static rpc_tls_t server_tls(bool mtls) {
  return (rpc_tls_t){.on = true, .cert_file = pki_file("server.pem"),
                     .key_file = pki_file("server.key"), .ca_file = mtls ? pki_file("ca.pem") : NULL};
}

Test(rpc_tls, a_tls_port_serves_a_client_that_trusts_its_ca) {
  echo_server_t *es = start(server_tls(false), NULL, NULL);
  rpc_status_t st;
  rpc_tls_t client = {.on = true, .ca_file = pki_file("ca.pem")};
  cr_expect_eq(call_echo(es, client, NULL, 0, NULL, 0, &st), GRPC_STATUS_OK, "%s", st.message);
  echo_server_stop(es, 0);
}

Test(rpc_tls, a_tls_port_refuses_plaintext_and_untrusted_clients) {
  echo_server_t *es = start(server_tls(false), NULL, NULL);
  rpc_status_t st;
  cr_expect_eq(call_echo(es, (rpc_tls_t){0}, NULL, 0, NULL, 0, &st), GRPC_STATUS_UNAVAILABLE,
               "plaintext to a TLS port: %s", st.message);
  rpc_tls_t rogue = {.on = true, .ca_file = pki_file("rogue-ca.pem")};
  cr_expect_eq(call_echo(es, rogue, NULL, 0, NULL, 0, &st), GRPC_STATUS_UNAVAILABLE,
               "a client that does not trust the server's CA: %s", st.message);
  echo_server_stop(es, 0);
}

Test(rpc_tls, mtls_requires_a_client_certificate_from_the_ca) {
  echo_server_t *es = start(server_tls(true), NULL, NULL);
  rpc_status_t st;
  rpc_tls_t bare = {.on = true, .ca_file = pki_file("ca.pem")};
  cr_expect_neq(call_echo(es, bare, NULL, 0, NULL, 0, &st), GRPC_STATUS_OK,
                "no client certificate was admitted");
  rpc_tls_t rogue = {.on = true, .ca_file = pki_file("ca.pem"), .cert_file = pki_file("rogue.pem"),
                     .key_file = pki_file("rogue.key")};
  cr_expect_neq(call_echo(es, rogue, NULL, 0, NULL, 0, &st), GRPC_STATUS_OK,
                "a certificate from another CA was admitted");
  rpc_tls_t good = {.on = true, .ca_file = pki_file("ca.pem"), .cert_file = pki_file("client.pem"),
                    .key_file = pki_file("client.key")};
  cr_expect_eq(call_echo(es, good, NULL, 0, NULL, 0, &st), GRPC_STATUS_OK, "%s", st.message);
  echo_server_stop(es, 0);
}

/* Names the caller by whether the port verified a client certificate. */
static grpc_status_code peer_guard(rpc_call_t *call, void *arg, rpc_identity_t *id, char *msg,
                                   size_t len) {
  (void)arg, (void)msg, (void)len;
  snprintf(id->name, sizeof id->name, "%s", rpc_call_peer_verified(call) ? "verified" : "bare");
  return GRPC_STATUS_OK;
}

/* client_cert_optional: a client without a certificate is served (and told
 * apart), one with the CA's certificate is verified, one from another CA fails
 * the handshake. The bare client's roots come as PEM text (ca_pem). */
Test(rpc_tls, an_optional_client_certificate_is_verified_when_presented) {
  rpc_tls_t tls = server_tls(true);
  tls.client_cert_optional = true;
  echo_server_t *es = start(tls, peer_guard, NULL);
  rpc_status_t st;
  char md[64] = "", pem[8192];
  FILE *f = fopen(pki_file("ca.pem"), "r");
  cr_assert_not_null(f);
  pem[fread(pem, 1, sizeof pem - 1, f)] = '\0';
  fclose(f);
  rpc_tls_t bare = {.on = true, .ca_pem = pem};
  cr_expect_eq(call_echo(es, bare, NULL, 0, md, sizeof md, &st), GRPC_STATUS_OK, "%s", st.message);
  cr_expect_str_eq(md, "identity:bare");
  rpc_tls_t good = {.on = true, .ca_pem = pem, .cert_file = pki_file("client.pem"),
                    .key_file = pki_file("client.key")};
  cr_expect_eq(call_echo(es, good, NULL, 0, md, sizeof md, &st), GRPC_STATUS_OK, "%s", st.message);
  cr_expect_str_eq(md, "identity:verified");
  rpc_tls_t rogue = {.on = true, .ca_pem = pem, .cert_file = pki_file("rogue.pem"),
                     .key_file = pki_file("rogue.key")};
  cr_expect_eq(call_echo(es, rogue, NULL, 0, NULL, 0, &st), GRPC_STATUS_UNAVAILABLE,
               "a certificate from another CA was admitted: %s", st.message);
  /* Roots that are no PEM fail at once, not at every connection. */
  rpc_tls_t wrong_roots = {.on = true, .ca_pem = "not a PEM"};
  char err[300] = "";
  cr_expect_neq(rpc_tls_check(&wrong_roots, false, err, sizeof err), 0);
  cr_expect(strstr(err, "hold no PEM CERTIFICATE"), "%s", err);
  cr_expect_null(rpc_channel_create("localhost:1", &(rpc_channel_opts_t){.tls = wrong_roots}));
  echo_server_stop(es, 0);
}

Test(rpc_tls, server_name_checks_a_cluster_wide_name) {
  rpc_tls_t cluster = {.on = true, .cert_file = pki_file("cluster.pem"),
                       .key_file = pki_file("cluster.key")};
  echo_server_t *es = start(cluster, NULL, NULL);
  rpc_status_t st;
  rpc_tls_t right = {.on = true, .ca_file = pki_file("cluster-ca.pem"), .server_name = "meshd-cluster"};
  cr_expect_eq(call_echo(es, right, NULL, 0, NULL, 0, &st), GRPC_STATUS_OK, "%s", st.message);
  rpc_tls_t wrong = {.on = true, .ca_file = pki_file("cluster-ca.pem"), .server_name = "other-name"};
  cr_expect_eq(call_echo(es, wrong, NULL, 0, NULL, 0, &st), GRPC_STATUS_UNAVAILABLE,
               "a certificate without the expected name was accepted");
  echo_server_stop(es, 0);
}

Test(rpc_tls, certificates_rotate_without_a_restart) {
  /* The server starts with the test CA's certificate, then its files are
   * replaced by the rogue CA's: new connections see the new certificate. */
  char cert[600], key[600], cmd[4096];
  snprintf(cert, sizeof cert, "%s/live.pem", pki);
  snprintf(key, sizeof key, "%s/live.key", pki);
  snprintf(cmd, sizeof cmd, "cp %s %s && cp %s %s", pki_file("server.pem"), cert,
           pki_file("server.key"), key);
  cr_assert_eq(system(cmd), 0);
  echo_server_t *es = start((rpc_tls_t){.on = true, .cert_file = cert, .key_file = key}, NULL, NULL);
  rpc_status_t st;
  rpc_tls_t old_ca = {.on = true, .ca_file = pki_file("ca.pem")};
  rpc_tls_t new_ca = {.on = true, .ca_file = pki_file("rogue-ca.pem"), .server_name = "localhost"};
  cr_assert_eq(call_echo(es, old_ca, NULL, 0, NULL, 0, &st), GRPC_STATUS_OK, "%s", st.message);
  /* rogue.pem names meshd-cluster and localhost: good enough as a server cert */
  snprintf(cmd, sizeof cmd, "sleep 0.05 && cp %s %s.new && cp %s %s.new && mv %s.new %s && mv %s.new %s",
           pki_file("rogue.pem"), cert, pki_file("rogue.key"), key, key, key, cert, cert);
  cr_assert_eq(system(cmd), 0);
  cr_expect_eq(call_echo(es, new_ca, NULL, 0, NULL, 0, &st), GRPC_STATUS_OK,
               "after rotation: %s", st.message);
  cr_expect_eq(call_echo(es, old_ca, NULL, 0, NULL, 0, &st), GRPC_STATUS_UNAVAILABLE,
               "the old certificate is still served");
  echo_server_stop(es, 0);
}

Test(rpc_tls, a_missing_or_wrong_file_fails_at_creation_with_its_name) {
  rpc_server_opts_t o = {.listen = "127.0.0.1:0",
                         .tls = {.on = true, .cert_file = "/nonexistent/cert.pem",
                                 .key_file = pki_file("server.key")}};
  char err[300] = "";
  cr_expect_null(rpc_server_create(&o, err, sizeof err));
  cr_expect(strstr(err, "/nonexistent/cert.pem") != NULL, "message: %s", err);
  o.tls.cert_file = pki_file("server.key"); /* a key where a certificate belongs */
  err[0] = '\0';
  cr_expect_null(rpc_server_create(&o, err, sizeof err));
  cr_expect(strstr(err, "no PEM CERTIFICATE") != NULL, "message: %s", err);
  rpc_tls_t half = {.on = true, .cert_file = pki_file("client.pem")};
  cr_expect_eq(rpc_tls_check(&half, false, err, sizeof err), -1);
  cr_expect_null(rpc_channel_create("localhost:1", &(rpc_channel_opts_t){.tls = half}));
}

/* A guard that admits "Bearer good" as alice and names what was wrong otherwise. */
static grpc_status_code token_guard(rpc_call_t *call, void *arg, rpc_identity_t *id, char *msg,
                                    size_t len) {
  int *calls = arg;
  (*calls)++;
  char auth[128];
  if (!rpc_call_metadata(call, "authorization", auth, sizeof auth)) {
    snprintf(msg, len, "%s needs authorization metadata", rpc_call_method(call));
    return GRPC_STATUS_UNAUTHENTICATED;
  }
  if (strcmp(auth, "Bearer good") != 0) {
    snprintf(msg, len, "that token is not allowed here");
    return GRPC_STATUS_PERMISSION_DENIED;
  }
  snprintf(id->name, sizeof id->name, "alice");
  return GRPC_STATUS_OK;
}

Test(rpc_tls, a_guard_admits_or_refuses_before_the_handler) {
  int guard_calls = 0;
  echo_server_t *es = start((rpc_tls_t){0}, token_guard, &guard_calls);
  rpc_status_t st;
  char md[64] = "";
  cr_expect_eq(call_echo(es, (rpc_tls_t){0}, NULL, 0, md, sizeof md, &st),
               GRPC_STATUS_UNAUTHENTICATED);
  cr_expect(strstr(st.message, "/meshd.test.v1.Echo/Unary needs authorization") != NULL, "%s",
            st.message);
  cr_expect_str_eq(st.kind, "UNAUTHENTICATED");
  rpc_md_t bad = {"authorization", "Bearer bad"};
  cr_expect_eq(call_echo(es, (rpc_tls_t){0}, &bad, 1, md, sizeof md, &st),
               GRPC_STATUS_PERMISSION_DENIED);
  cr_expect_str_eq(st.kind, "PERMISSION_DENIED");
  cr_expect_eq(echo_server_calls_started(es), 0, "a refused call reached its handler");
  rpc_md_t good = {"authorization", "Bearer good"};
  cr_expect_eq(call_echo(es, (rpc_tls_t){0}, &good, 1, md, sizeof md, &st), GRPC_STATUS_OK, "%s",
               st.message);
  cr_expect_str_eq(md, "identity:alice");
  cr_expect_eq(guard_calls, 3);
  echo_server_stop(es, 0);
}

Test(rpc_tls, a_guard_refuses_a_stream_before_its_first_message) {
  int guard_calls = 0;
  echo_server_t *es = start((rpc_tls_t){0}, token_guard, &guard_calls);
  char target[64];
  snprintf(target, sizeof target, "127.0.0.1:%d", echo_server_port(es));
  rpc_channel_t *ch = rpc_channel_create(target, &live_peer);
  rpc_stream_t *s = rpc_stream_open(ch, ECHO_BIDI, NULL, 0, 5000);
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "x";
  (void)rpc_stream_write(s, &req.base, false);
  ProtobufCMessage *out = NULL;
  cr_expect_eq(rpc_stream_read(s, &echo_reply__descriptor, &out, 5000), 0);
  rpc_status_t st;
  grpc_status_code code = rpc_stream_finish(s, &st);
  /* Seen once under CI load: another code. Its words say which race it was. */
  cr_expect_eq(code, GRPC_STATUS_UNAUTHENTICATED, "status %d: %s", (int)code, st.message);
  rpc_stream_destroy(s);
  rpc_channel_destroy(ch);
  cr_expect_eq(echo_server_calls_started(es), 0);
  echo_server_stop(es, 0);
}

Test(rpc_tls, an_idle_connection_is_closed_after_the_idle_limit) {
  rpc_server_opts_t o = {.listen = "127.0.0.1:0", .max_connection_idle_ms = 300};
  char err[300] = "";
  echo_server_t *es = echo_server_start(&o, err, sizeof err);
  cr_assert_not_null(es, "%s", err);
  char target[64];
  snprintf(target, sizeof target, "127.0.0.1:%d", echo_server_port(es));
  rpc_channel_t *ch = rpc_channel_create(target, &live_peer);
  cr_assert(rpc_channel_wait_ready(ch, 3000));
  /* GOAWAY after 300 ms idle: the channel leaves READY by itself. */
  cr_expect(rpc_channel_wait_idle(ch, 3000), "the idle connection was kept");
  rpc_channel_destroy(ch);
  echo_server_stop(es, 0);
}

/* ---------------------------------------------------------- review-110 */

/* One call_echo with stderr (the log) going to a file; returns what was logged. */
static char *logged_during_call(echo_server_t *es, rpc_tls_t tls, grpc_status_code *code) {
  char path[] = "/tmp/meshd-tls-log-XXXXXX";
  int fd = mkstemp(path);
  cr_assert_geq(fd, 0);
  int saved = dup(2);
  dup2(fd, 2);
  rpc_status_t st;
  *code = call_echo(es, tls, NULL, 0, NULL, 0, &st);
  dup2(saved, 2);
  close(saved);
  static char text[8192];
  ssize_t n = pread(fd, text, sizeof text - 1, 0);
  text[n > 0 ? n : 0] = '\0';
  close(fd);
  unlink(path);
  fprintf(stderr, "%s", text);
  return text;
}

/* A certificate replaced by one its key does not belong to (a rotation that
 * copied the certificate and forgot the key, or the wrong key): gRPC cannot
 * use the pair and keeps serving the old certificate, yet the log said
 * "TLS: reloaded ..." and named neither file; the operator learnt of it at
 * the next restart (rpc_tls_check_pair refuses the pair) or when the old
 * certificate expired. It says which key and certificate do not belong
 * together, and that the old certificates stay; a later fix of the key loads. */
Test(rpc_tls, a_rotated_certificate_without_its_key_is_refused_by_name) {
  char cert[600], key[600], cmd[4096];
  snprintf(cert, sizeof cert, "%s/live.pem", pki);
  snprintf(key, sizeof key, "%s/live.key", pki);
  snprintf(cmd, sizeof cmd, "cp %s %s && cp %s %s", pki_file("server.pem"), cert,
           pki_file("server.key"), key);
  cr_assert_eq(system(cmd), 0);
  echo_server_t *es = start((rpc_tls_t){.on = true, .cert_file = cert, .key_file = key}, NULL, NULL);
  rpc_tls_t old_ca = {.on = true, .ca_file = pki_file("ca.pem")};
  rpc_tls_t new_ca = {.on = true, .ca_file = pki_file("rogue-ca.pem"), .server_name = "localhost"};
  rpc_status_t st;
  cr_assert_eq(call_echo(es, old_ca, NULL, 0, NULL, 0, &st), GRPC_STATUS_OK, "%s", st.message);
  snprintf(cmd, sizeof cmd, "sleep 0.05 && cp %s %s.new && mv %s.new %s", pki_file("rogue.pem"),
           cert, cert, cert);
  cr_assert_eq(system(cmd), 0);
  grpc_status_code code;
  const char *log = logged_during_call(es, old_ca, &code);
  cr_expect_eq(code, GRPC_STATUS_OK, "the old certificate is no longer served");
  cr_expect(strstr(log, "reloaded") == NULL, "a pair gRPC cannot use was logged as reloaded:\n%s",
            log);
  cr_expect(strstr(log, "does not belong") != NULL && strstr(log, key) != NULL,
            "the log does not name the key that does not belong:\n%s", log);
  /* The key follows: the pair loads. */
  snprintf(cmd, sizeof cmd, "sleep 0.05 && cp %s %s.new && mv %s.new %s", pki_file("rogue.key"),
           key, key, key);
  cr_assert_eq(system(cmd), 0);
  cr_expect_eq(call_echo(es, new_ca, NULL, 0, NULL, 0, &st), GRPC_STATUS_OK,
               "after the key followed: %s", st.message);
  echo_server_stop(es, 0);
}

/* ---------------------------------------------------------- review-119 */

/* Both files' modification times set to `at` (one timestamp tick). */
static void set_mtimes(const char *a, const char *b, struct timespec at) {
  struct timespec ts[2] = {at, at};
  cr_assert_eq(utimensat(AT_FDCWD, a, ts, 0), 0);
  cr_assert_eq(utimensat(AT_FDCWD, b, ts, 0), 0);
}

/* A rotation that rewrites the files in place (truncate, then write: cp onto
 * the live file, a ConfigMap tool) seen half-written by a handshake: the
 * reload fails and keeps the old certificates, but recorded the files' times
 * anyway; the write that completed the files within the same timestamp tick
 * left the times unchanged, so the new certificate was never loaded (until
 * the files changed again, possibly never). */
Test(rpc_tls, a_rotation_seen_half_written_loads_once_complete_in_the_same_tick) {
  char cert[600], key[600], cmd[4096];
  snprintf(cert, sizeof cert, "%s/live.pem", pki);
  snprintf(key, sizeof key, "%s/live.key", pki);
  snprintf(cmd, sizeof cmd, "cp %s %s && cp %s %s", pki_file("server.pem"), cert,
           pki_file("server.key"), key);
  cr_assert_eq(system(cmd), 0);
  echo_server_t *es = start((rpc_tls_t){.on = true, .cert_file = cert, .key_file = key}, NULL, NULL);
  rpc_tls_t old_ca = {.on = true, .ca_file = pki_file("ca.pem")};
  rpc_tls_t new_ca = {.on = true, .ca_file = pki_file("rogue-ca.pem"), .server_name = "localhost"};
  rpc_status_t st;
  cr_assert_eq(call_echo(es, old_ca, NULL, 0, NULL, 0, &st), GRPC_STATUS_OK, "%s", st.message);
  /* Half-written: the new key, the certificate truncated. */
  struct timespec tick;
  clock_gettime(CLOCK_REALTIME, &tick);
  snprintf(cmd, sizeof cmd, "cat %s > %s && : > %s", pki_file("rogue.key"), key, cert);
  cr_assert_eq(system(cmd), 0);
  set_mtimes(cert, key, tick);
  cr_expect_eq(call_echo(es, old_ca, NULL, 0, NULL, 0, &st), GRPC_STATUS_OK,
               "half-written files: the old certificate is no longer served: %s", st.message);
  /* Complete, in the same tick. */
  snprintf(cmd, sizeof cmd, "cat %s > %s", pki_file("rogue.pem"), cert);
  cr_assert_eq(system(cmd), 0);
  set_mtimes(cert, key, tick);
  cr_expect_eq(call_echo(es, new_ca, NULL, 0, NULL, 0, &st), GRPC_STATUS_OK,
               "the completed rotation was never loaded: %s", st.message);
  echo_server_stop(es, 0);
}

/* Connections arrive while the server is destroyed: each accepted one makes
 * gRPC call the certificate fetcher, whose state rpc_server_destroy frees
 * (rpc_tls_server_free) right after the credentials. Run under ASan or
 * valgrind: a fetch after the free is a use after free. */
typedef struct {
  int port;
  atomic_bool stop;
} knocker_t;

static void *knock(void *arg) {
  knocker_t *k = arg;
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)k->port),
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  while (!atomic_load(&k->stop)) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) continue;
    (void)connect(fd, (struct sockaddr *)&a, sizeof a);
    close(fd);
  }
  return NULL;
}

Test(rpc_tls, a_tls_server_destroyed_while_connections_arrive) {
  for (int i = 0; i < 10; i++) {
    echo_server_t *es = start(server_tls(false), NULL, NULL);
    knocker_t k = {.port = echo_server_port(es)};
    pthread_t th[2];
    for (int j = 0; j < 2; j++) cr_assert_eq(pthread_create(&th[j], NULL, knock, &k), 0);
    usleep(20000);
    echo_server_stop(es, 0);
    atomic_store(&k.stop, true);
    for (int j = 0; j < 2; j++) pthread_join(th[j], NULL);
  }
}
