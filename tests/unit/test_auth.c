/* Principals and bearer tokens (server/auth.h): the tokens file's rules, the
 * guard over real gRPC (an Echo server guarded by auth_guard), reload. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "auth.h"
#include "echo_server.h"
#include "rpc.h"

#define ALICE "alice-token-0123456789"
#define BOB "bob-token-abcdefghijkl"

static char path[64];

static void write_tokens(const char *text) {
  FILE *f = fopen(path, "w");
  cr_assert_not_null(f);
  fputs(text, f);
  fclose(f);
}

static void setup(void) {
  rpc_init();
  snprintf(path, sizeof path, "/tmp/meshd-tokens-XXXXXX");
  int fd = mkstemp(path);
  cr_assert_geq(fd, 0);
  close(fd);
}

static void teardown(void) {
  unlink(path);
  rpc_shutdown();
}

TestSuite(auth, .init = setup, .fini = teardown, .timeout = 30);

/* Echo/Unary with an optional authorization value; returns the code, and the
 * admitted identity ("identity:NAME") in who when OK. */
static grpc_status_code call(echo_server_t *es, const char *authorization, char *who, size_t len,
                             rpc_status_t *st) {
  char target[64];
  snprintf(target, sizeof target, "127.0.0.1:%d", echo_server_port(es));
  /* A live peer: a loaded machine may take over 100 ms to connect. */
  rpc_channel_t *ch = rpc_channel_create(target, &(rpc_channel_opts_t){.connect_timeout_ms = 5000});
  EchoRequest req = ECHO_REQUEST__INIT;
  req.text = "hi";
  rpc_md_t md = {"authorization", authorization};
  ProtobufCMessage *resp = NULL;
  grpc_status_code code = rpc_unary(ch, ECHO_UNARY, &req.base, &echo_reply__descriptor, &resp,
                                    &md, authorization ? 1 : 0, 5000, st);
  if (resp) {
    snprintf(who, len, "%s", ((EchoReply *)resp)->metadata);
    protobuf_c_message_free_unpacked(resp, NULL);
  }
  rpc_channel_destroy(ch);
  return code;
}

static echo_server_t *guarded(auth_t *a) {
  rpc_server_opts_t o = {.listen = "127.0.0.1:0"};
  char err[300] = "";
  echo_server_t *es = echo_server_start_guarded(&o, auth_guard, a, err, sizeof err);
  cr_assert_not_null(es, "%s", err);
  return es;
}

Test(auth, a_token_admits_its_principal_and_nothing_else_does) {
  write_tokens("# team tokens\nalice " ALICE "\n\nbob   " BOB "  admin  # ops\n");
  char err[300] = "";
  auth_t *a = auth_create(path, err, sizeof err);
  cr_assert_not_null(a, "%s", err);
  cr_expect(auth_enabled(a));
  echo_server_t *es = guarded(a);
  char who[80] = "";
  rpc_status_t st;
  cr_expect_eq(call(es, "Bearer " ALICE, who, sizeof who, &st), GRPC_STATUS_OK, "%s", st.message);
  cr_expect_str_eq(who, "identity:alice");
  cr_expect_eq(call(es, "bearer " BOB, who, sizeof who, &st), GRPC_STATUS_OK, "%s", st.message);
  cr_expect_str_eq(who, "identity:bob");

  cr_expect_eq(call(es, NULL, who, sizeof who, &st), GRPC_STATUS_UNAUTHENTICATED);
  cr_expect(strstr(st.message, "needs a bearer token") && strstr(st.message, "authorization"), "%s",
            st.message);
  const char *wrong[] = {"Bearer " ALICE "x", "Bearer alice-token-012345678", "Bearer ALICE-TOKEN-0123456789",
                         "Basic " ALICE, "Bearer ", ALICE};
  for (size_t i = 0; i < sizeof wrong / sizeof wrong[0]; i++) {
    cr_expect_eq(call(es, wrong[i], who, sizeof who, &st), GRPC_STATUS_UNAUTHENTICATED, "case %zu", i);
    cr_expect(strstr(st.message, "alice-token") == NULL, "a token was echoed: %s", st.message);
  }
  cr_expect_eq(echo_server_calls_started(es), 2, "a refused call reached the handler");
  echo_server_stop(es, 0);
  auth_destroy(a);
}

Test(auth, an_open_server_admits_everyone_as_the_anonymous_admin) {
  char err[300] = "";
  auth_t *a = auth_create(NULL, err, sizeof err);
  cr_assert_not_null(a);
  cr_expect_not(auth_enabled(a));
  echo_server_t *es = guarded(a);
  char who[80] = "";
  rpc_status_t st;
  cr_expect_eq(call(es, NULL, who, sizeof who, &st), GRPC_STATUS_OK);
  cr_expect_str_eq(who, "identity:anonymous");
  cr_expect_eq(auth_reload(a, err, sizeof err), 0);
  echo_server_stop(es, 0);
  auth_destroy(a);
}

Test(auth, a_bad_tokens_file_is_refused_naming_the_line) {
  const struct {
    const char *text, *want;
  } cases[] = {
      {"alice short\n", "line 1: the token must be 16-512"},
      {"alice " ALICE "\nalice " BOB "\n", "line 2: this name appears twice"},
      {"alice " ALICE "\nbob " ALICE "\n", "line 2: this token is also another principal's"},
      {"alice " ALICE " root\n", "line 1: the third word may only be 'admin'"},
      {"# c\nanonymous " ALICE "\n", "line 2: the name 'anonymous' is reserved"},
      {"al/ice " ALICE "\n", "line 1: the name must be"},
      {"alice\n", "line 1: expected NAME TOKEN [admin]"},
      {"alice " ALICE " admin extra\n", "line 1: more than NAME TOKEN [admin]"},
      {"# nobody\n\n", "no principals"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    write_tokens(cases[i].text);
    char err[300] = "";
    auth_t *a = auth_create(path, err, sizeof err);
    cr_expect_null(a, "case %zu was accepted", i);
    cr_expect(strstr(err, cases[i].want) != NULL, "case %zu: '%s' lacks '%s'", i, err, cases[i].want);
    cr_expect(strstr(err, path) != NULL, "case %zu: the file is not named: %s", i, err);
    cr_expect(strstr(err, "token-") == NULL, "case %zu: a token leaked into %s", i, err);
    auth_destroy(a);
  }
  char err[300] = "";
  cr_expect_null(auth_create("/nonexistent/tokens", err, sizeof err));
  cr_expect(strstr(err, "cannot read '/nonexistent/tokens'") != NULL, "%s", err);
}

Test(auth, reload_swaps_the_principals_and_a_bad_file_keeps_the_old) {
  write_tokens("alice " ALICE "\n");
  char err[300] = "";
  auth_t *a = auth_create(path, err, sizeof err);
  cr_assert_not_null(a, "%s", err);
  echo_server_t *es = guarded(a);
  char who[80];
  rpc_status_t st;
  cr_expect_eq(call(es, "Bearer " ALICE, who, sizeof who, &st), GRPC_STATUS_OK);

  write_tokens("bob " BOB " admin\n"); /* alice's token revoked, bob added */
  cr_expect_eq(auth_reload(a, err, sizeof err), 1, "%s", err);
  cr_expect_eq(call(es, "Bearer " ALICE, who, sizeof who, &st), GRPC_STATUS_UNAUTHENTICATED);
  cr_expect_eq(call(es, "Bearer " BOB, who, sizeof who, &st), GRPC_STATUS_OK);

  write_tokens("bob\n");
  cr_expect_eq(auth_reload(a, err, sizeof err), -1);
  cr_expect(strstr(err, "line 1") != NULL, "%s", err);
  cr_expect_eq(call(es, "Bearer " BOB, who, sizeof who, &st), GRPC_STATUS_OK,
               "a bad reload dropped the principals in force");
  echo_server_stop(es, 0);
  auth_destroy(a);
}
