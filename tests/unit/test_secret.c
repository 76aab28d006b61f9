/* core/platform/secret.c (join-token files, random secrets, compares) and the
 * agent's call-secret guard (agent/call_secret.c) on a real rpc server. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "agent.h"
#include "log.h"
#include "meshd/agent/v1/agent.pb-c.h"
#include "rpc.h"
#include "secret.h"

/* A channel to a live peer in this process: seconds to connect, since a loaded
 * machine (CI runs the sanitized suites on 2 cores) can take longer than the
 * 100 ms default to answer the first SETTINGS frame. */
static const rpc_channel_opts_t live_peer = {.connect_timeout_ms = 5000};


static char path[256];

static void write_file(const char *text) {
  FILE *f = fopen(path, "w");
  cr_assert_not_null(f);
  fputs(text, f);
  fclose(f);
  chmod(path, 0600);
}

static void setup(void) { snprintf(path, sizeof path, "/tmp/meshd-test-secret-%d", (int)getpid()); }
static void teardown(void) { unlink(path); }

TestSuite(secret, .init = setup, .fini = teardown, .timeout = 30);

Test(secret, random_secrets_are_hex_and_differ) {
  char a[SECRET_HEX_LEN + 1], b[SECRET_HEX_LEN + 1];
  cr_assert_eq(secret_random_hex(a), 0);
  cr_assert_eq(secret_random_hex(b), 0);
  cr_assert_eq(strlen(a), SECRET_HEX_LEN);
  cr_assert_eq(strspn(a, "0123456789abcdef"), SECRET_HEX_LEN);
  cr_assert_str_neq(a, b);
}

Test(secret, equal_compares_whole_strings) {
  cr_assert(secret_equal("abc", 3, "abc", 3));
  cr_assert_not(secret_equal("abc", 3, "abd", 3));
  cr_assert_not(secret_equal("abc", 3, "abcd", 4), "a longer string");
  cr_assert_not(secret_equal("abc", 3, "ab", 2), "a prefix");
  cr_assert_not(secret_equal("", 0, "a", 1));
}

Test(secret, a_token_file_holds_tokens_comments_and_blank_lines) {
  write_file("# rotation: the new one first\n\n  token-new-0123456789abc  \r\ntoken-old-0123456789abc\n");
  char err[512];
  secret_file_t *f = secret_file_open("--join-token-file", path, err, sizeof err);
  cr_assert_not_null(f, "%s", err);
  cr_assert(secret_file_check(f, "token-new-0123456789abc", 23));
  cr_assert(secret_file_check(f, "token-old-0123456789abc", 23));
  cr_assert_not(secret_file_check(f, "token-new-0123456789ab", 22));
  cr_assert_not(secret_file_check(f, "token-new-0123456789abcd", 24));
  cr_assert_not(secret_file_check(f, "# rotation: the new one first", 29));
  cr_assert_not(secret_file_check(f, "", 0));
  char first[64];
  cr_assert_eq(secret_file_first(f, first, sizeof first), 0);
  cr_assert_str_eq(first, "token-new-0123456789abc");
  cr_assert_eq(secret_file_first(f, first, 8), -1, "a buffer too small");
  secret_file_close(f);
}

Test(secret, a_bad_token_file_is_refused_naming_the_flag_file_and_line) {
  struct {
    const char *text, *want;
  } cases[] = {
      {"", "holds no token"},
      {"# only a comment\n", "holds no token"},
      {"short\n", "line 1: the token has 5 characters"},
      {"# c\ntwo words-0123456789abcdef\n", "line 2: a token is printable ASCII without spaces"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    write_file(cases[i].text);
    char err[512] = "";
    cr_assert_null(secret_file_open("--join-token-file", path, err, sizeof err), "case %zu", i);
    cr_assert(strstr(err, cases[i].want) && strstr(err, "--join-token-file") && strstr(err, path),
              "case %zu: %s", i, err);
  }
  char err[512];
  cr_assert_null(secret_file_open("--join-token-file", "/nonexistent/x", err, sizeof err));
  cr_assert(strstr(err, "cannot read '/nonexistent/x'"), "%s", err);
}

Test(secret, a_changed_file_is_read_again_and_a_broken_one_keeps_the_old_tokens) {
  write_file("first-token-0123456789\n");
  char err[512];
  secret_file_t *f = secret_file_open("--join-token-file", path, err, sizeof err);
  cr_assert_not_null(f, "%s", err);
  write_file("second-token-0123456789\n");
  cr_assert(secret_file_check(f, "second-token-0123456789", 23));
  cr_assert_not(secret_file_check(f, "first-token-0123456789", 22));
  write_file("bad\n"); /* too short: logged, the tokens before stay */
  cr_assert(secret_file_check(f, "second-token-0123456789", 23));
  secret_file_close(f);
}

Test(secret, a_temp_token_is_private_and_removed) {
  char p[4096], err[256];
  cr_assert_eq(secret_temp_make(p, sizeof p, err, sizeof err), 0, "%s", err);
  struct stat st, dst;
  cr_assert_eq(stat(p, &st), 0);
  cr_assert_eq(st.st_mode & 0777, 0600);
  char dir[4096];
  snprintf(dir, sizeof dir, "%s", p);
  *strrchr(dir, '/') = '\0';
  cr_assert_eq(stat(dir, &dst), 0);
  cr_assert_eq(dst.st_mode & 0777, 0700);
  secret_file_t *f = secret_file_open("t", p, err, sizeof err);
  cr_assert_not_null(f, "%s", err);
  char tok[128];
  cr_assert_eq(secret_file_first(f, tok, sizeof tok), 0);
  cr_assert_eq(strlen(tok), SECRET_HEX_LEN);
  secret_file_close(f);
  secret_temp_remove(p);
  cr_assert_neq(stat(p, &st), 0);
  cr_assert_neq(stat(dir, &dst), 0, "the directory is gone too");
}

Test(secret, log_allow_bounds_lines_per_window) {
  static log_limit_t l;
  int held = -1;
  for (int i = 0; i < 3; i++) cr_assert(log_allow(&l, 3, 200, &held));
  cr_assert_eq(held, 0);
  for (int i = 0; i < 5; i++) cr_assert_not(log_allow(&l, 3, 200, NULL));
  usleep(250000);
  cr_assert(log_allow(&l, 3, 200, &held));
  cr_assert_eq(held, 5, "the next line allowed says how many were held back");
}

/* ---------------------------------------------------------------- the agent's guard */

static agent_info_t info = {.id = "agent-under-test", .device = "cpu"};

static grpc_status_code hello(rpc_channel_t *ch, const char *secret, rpc_status_t *st) {
  Meshd__Agent__V1__HelloRequest req = MESHD__AGENT__V1__HELLO_REQUEST__INIT;
  req.agent_id = info.id;
  ProtobufCMessage *resp = NULL;
  rpc_md_t md = {SECRET_AGENT_MD, secret};
  grpc_status_code c = rpc_unary(ch, "/meshd.agent.v1.Agent/Hello", &req.base,
                                 &meshd__agent__v1__hello_reply__descriptor, &resp, &md,
                                 secret ? 1 : 0, 5000, st);
  if (resp) protobuf_c_message_free_unpacked(resp, NULL);
  return c;
}

Test(secret, the_agent_admits_only_the_current_call_secret) {
  rpc_init();
  rpc_server_opts_t o = {.listen = "127.0.0.1:0", .threads = 2};
  char err[256];
  rpc_server_t *srv = rpc_server_create(&o, err, sizeof err);
  cr_assert_not_null(srv, "%s", err);
  size_t n;
  const rpc_method_t *m = agent_service_methods(&n);
  cr_assert_eq(rpc_server_add_methods_guarded(srv, m, n, &info, agent_auth_guard, NULL), 0);
  int port = rpc_server_start(srv, err, sizeof err);
  cr_assert_gt(port, 0, "%s", err);
  char target[64];
  snprintf(target, sizeof target, "127.0.0.1:%d", port);
  rpc_channel_t *ch = rpc_channel_create(target, &live_peer);
  rpc_status_t st;

  /* Not registered: nobody. */
  cr_assert_eq(hello(ch, NULL, &st), GRPC_STATUS_UNAUTHENTICATED);
  cr_assert_eq(hello(ch, "", &st), GRPC_STATUS_UNAUTHENTICATED);

  char s1[SECRET_HEX_LEN + 1];
  cr_assert_eq(agent_auth_renew(s1), 0);
  cr_assert_eq(hello(ch, s1, &st), GRPC_STATUS_OK, "%s", st.message);
  char first[SECRET_HEX_LEN + 1];
  memcpy(first, s1, sizeof first);
  char longer[SECRET_HEX_LEN + 2];
  snprintf(longer, sizeof longer, "%s0", s1);
  cr_assert_eq(hello(ch, longer, &st), GRPC_STATUS_UNAUTHENTICATED);
  s1[SECRET_HEX_LEN - 1] = '\0';
  cr_assert_eq(hello(ch, s1, &st), GRPC_STATUS_UNAUTHENTICATED, "a prefix");
  cr_assert_eq(hello(ch, NULL, &st), GRPC_STATUS_UNAUTHENTICATED);
  cr_assert(strstr(st.message, SECRET_AGENT_MD), "%s", st.message);

  /* A new registration: the old secret is refused. */
  char s2[SECRET_HEX_LEN + 1];
  cr_assert_eq(agent_auth_renew(s2), 0);
  cr_assert_eq(hello(ch, first, &st), GRPC_STATUS_UNAUTHENTICATED);
  cr_assert_eq(hello(ch, s2, &st), GRPC_STATUS_OK, "%s", st.message);
  agent_auth_clear();
  cr_assert_eq(hello(ch, s2, &st), GRPC_STATUS_UNAUTHENTICATED, "after the registration ended");

  rpc_channel_destroy(ch);
  rpc_server_destroy(srv);
  rpc_shutdown();
}
