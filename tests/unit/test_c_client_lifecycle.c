/* The C client as a user's program meets it: fork() after a client was made,
 * a session whose server restarted, NULL arguments. Against a live
 * `meshd --local-agents 2`, as test_c_client.c. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "meshd.h"

#include "c_client_server.h"

TestSuite(c_lifecycle, .init = start_server, .fini = stop_server, .timeout = 90);

static meshd_client_t *connect_ok(void) {
  meshd_err_t e;
  meshd_client_t *c = meshd_connect(target, 10000, &e);
  cr_assert_not_null(c, "connect: %s", meshd_strerror(e));
  return c;
}

/* The forked child's wait status, within 40 s (killed and failed past it). */
static int wait_child(pid_t pid) {
  int st = 0;
  pid_t w = 0;
  for (int i = 0; i < 400 && (w = waitpid(pid, &st, WNOHANG)) == 0; i++)
    sleep_ms(100);
  if (w == 0) {
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
    cr_assert_fail("the forked child hung");
  }
  return st;
}

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* A mesh gpu=2 with full(value) of shape [2] on it, then fetched at gpu=0 and
 * (fetch_bytes) at both ranks at once: every path that starts a library thread.
 * 0, or the step that failed. */
static int round_trip(meshd_client_t *c, double value, double *got) {
  meshd_session_t *s = meshd_session_open(c, "c-lifecycle", NULL);
  if (!s)
    return 1;
  const char *dims[] = {"gpu"};
  int64_t sizes[] = {2}, shape[] = {2}, at0[] = {0}, at1[] = {1};
  meshd_ref_t mesh = 0, x = 0;
  int rc = 0;
  if (meshd_session_create_mesh(s, dims, sizes, 1, &mesh) != MESHD_E_OK) {
    rc = 2;
    goto out;
  }
  if (meshd_session_factory(s, mesh, "full", shape, 1, value, &x) != MESHD_E_OK) {
    rc = 3;
    goto out;
  }
  meshd_values_t v;
  if (meshd_session_fetch(s, x, dims, at0, 1, &v) != MESHD_E_OK || v.n != 2) {
    rc = 4;
    goto out;
  }
  *got = v.values[0];
  meshd_values_free(&v);
  float b0[2], b1[2];
  meshd_fetch_part_t parts[2] = {{dims, at0, 1, b0, sizeof b0, 0}, {dims, at1, 1, b1, sizeof b1, 0}};
  if (meshd_session_fetch_bytes(s, x, parts, 2, NULL) != MESHD_E_OK || b1[1] != (float)value) {
    rc = 5;
    goto out;
  }
out:
  meshd_session_close(s);
  return rc;
}

/* A program that made a client (and fetched: the library's threads run), then
 * forks while it is open: gRPC does not follow fork, and a client of the child
 * waited forever (past its deadline) in its first call. The child is refused a
 * client at once, naming fork, instead of hanging. */
Test(c_lifecycle, a_child_forked_while_a_client_is_open_is_refused_not_hung) {
  meshd_client_t *c = connect_ok();
  double got = 0;
  cr_assert_eq(round_trip(c, 7.0, &got), 0, "parent: %s", meshd_last_error(c)->message);
  cr_assert_float_eq(got, 7.0, 1e-9);
  fflush(NULL);
  pid_t pid = fork();
  cr_assert_geq(pid, 0);
  if (pid == 0) {
    alarm(30); /* a hang ends the child with SIGALRM */
    meshd_err_t e = MESHD_E_OK;
    char why[512] = "";
    meshd_connect_options_t o = MESHD_CONNECT_OPTIONS_INIT;
    o.timeout_ms = 10000;
    meshd_client_t *c2 = meshd_connect_with(target, &o, &e, why, sizeof why);
    if (!c2)
      _exit(e == MESHD_E_CONNECT && strstr(why, "fork") ? 0 : 30);
    double g = 0; /* connected: it must then work */
    int rc = round_trip(c2, 5.0, &g);
    if (rc != 0) {
      fprintf(stderr, "child: step %d: %s\n", rc, meshd_last_error(c2)->message);
      _exit(10 + rc);
    }
    _exit(g == 5.0 ? 0 : 20);
  }
  int st = wait_child(pid);
  cr_assert(!WIFSIGNALED(st), "the forked child died of signal %d (%s)", WTERMSIG(st),
            WTERMSIG(st) == SIGALRM ? "it hung" : "a crash");
  cr_assert_eq(WEXITSTATUS(st), 0, "the forked child failed with %d", WEXITSTATUS(st));
  /* ...and the parent still works. */
  cr_assert_eq(round_trip(c, 3.0, &got), 0, "parent after fork: %s", meshd_last_error(c)->message);
  meshd_close(c);
}

/* Sync until the server answers something else than "no connection yet"
 * (a restarted server's port takes a reconnect), at most 15 s. */
static meshd_err_t sync_settled(meshd_client_t *c, meshd_session_t *s) {
  int64_t end = now_ms() + 15000;
  meshd_err_t r;
  for (;;) {
    r = meshd_session_sync_timeout(s, 3000);
    if (r == MESHD_E_OK || meshd_last_error(c)->kind[0] || now_ms() > end)
      return r;
    sleep_ms(200);
  }
}

/* The server restarted (same port, its sessions gone): a session of the old
 * one fails every call with NO_SESSION, pipelined or not, and closes within
 * about the client's timeout; nothing hangs. */
Test(c_lifecycle, a_session_of_a_restarted_server_gets_no_session) {
  meshd_err_t e;
  meshd_client_t *c = meshd_connect(target, 5000, &e);
  cr_assert_not_null(c, "connect: %s", meshd_strerror(e));
  meshd_session_t *s = meshd_session_open(c, "restart", NULL);
  meshd_session_t *p = meshd_session_open(c, "restart-pipe", NULL);
  cr_assert(s && p, "%s", meshd_last_error(c)->message);
  const char *dims[] = {"gpu"};
  int64_t sizes[] = {2}, shape[] = {2}, at0[] = {0};
  meshd_ref_t mesh = 0, pmesh = 0, x = 0, y = 0;
  cr_assert_eq(meshd_session_create_mesh(s, dims, sizes, 1, &mesh), MESHD_E_OK);
  cr_assert_eq(meshd_session_create_mesh(p, dims, sizes, 1, &pmesh), MESHD_E_OK);
  cr_assert_eq(meshd_session_factory(s, mesh, "ones", shape, 1, 0, &x), MESHD_E_OK);
  cr_assert_eq(meshd_session_set_pipeline(p, &(meshd_pipeline_options_t)MESHD_PIPELINE_OPTIONS_INIT),
               MESHD_E_OK);
  cr_assert_eq(meshd_session_factory(p, pmesh, "ones", shape, 1, 0, &y), MESHD_E_OK);
  cr_assert_eq(meshd_session_sync(p), MESHD_E_OK, "%s", meshd_last_error(c)->message);

  char port[16], listen[48];
  snprintf(port, sizeof port, "%s", strrchr(target, ':') + 1);
  snprintf(listen, sizeof listen, "127.0.0.1:%s", port);
  stop_server();
  const char *const flags[] = {"--listen", listen, NULL};
  start_server_with(flags);
  cr_assert_str_eq(strrchr(target, ':') + 1, port, "the server came back on another port");

  int64_t t0 = now_ms();
  cr_expect_neq(sync_settled(c, s), MESHD_E_OK);
  cr_expect_str_eq(meshd_last_error(c)->kind, "NO_SESSION", "%s: %s",
                   meshd_strerror(meshd_last_error(c)->err), meshd_last_error(c)->message);
  meshd_values_t v;
  cr_expect_neq(meshd_session_fetch(s, x, dims, at0, 1, &v), MESHD_E_OK);
  cr_expect_str_eq(meshd_last_error(c)->kind, "NO_SESSION", "fetch: %s",
                   meshd_last_error(c)->message);
  /* The pipelined one: its stream went with the old server; set again, its
   * calls get the new server's answer. */
  meshd_ref_t z = 0;
  meshd_session_call(p, "relu", (meshd_arg_t[]){{.type = MESHD_ARG_REF, .ref = y}}, 1, &z);
  cr_expect_neq(meshd_session_sync(p), MESHD_E_OK);
  meshd_session_set_pipeline(p, &(meshd_pipeline_options_t)MESHD_PIPELINE_OPTIONS_INIT);
  cr_expect_neq(sync_settled(c, p), MESHD_E_OK);
  cr_expect_str_eq(meshd_last_error(c)->kind, "NO_SESSION", "pipelined: %s",
                   meshd_last_error(c)->message);
  int64_t t1 = now_ms();
  meshd_session_close(p);
  meshd_session_close(s);
  cr_expect_lt(now_ms() - t1, 12000, "closing took %lld ms", (long long)(now_ms() - t1));
  cr_expect_lt(t1 - t0, 40000);
  /* The client itself still works. */
  double got = 0;
  cr_expect_eq(round_trip(c, 2.0, &got), 0, "%s", meshd_last_error(c)->message);
  meshd_close(c);
}

/* Every public function given a NULL output says so, naming it, in the
 * client's last error (not an earlier call's message). */
Test(c_lifecycle, null_outputs_are_named_in_the_last_error) {
  meshd_client_t *c = connect_ok();
  meshd_session_t *s = meshd_session_open(c, "nulls", NULL);
  cr_assert_not_null(s);
  int status;
  cr_assert_eq(meshd_health(c, "no.such.Service", &status), MESHD_E_RPC);
  cr_expect_eq(meshd_session_transfer_stats(s, NULL), MESHD_E_INVALID);
  cr_expect_eq(meshd_last_error(c)->err, MESHD_E_INVALID, "last error: %s",
               meshd_last_error(c)->message);
  cr_expect(strstr(meshd_last_error(c)->message, "out"), "%s", meshd_last_error(c)->message);
  cr_assert_eq(meshd_health(c, "no.such.Service", &status), MESHD_E_RPC);
  cr_expect_eq(meshd_session_pipeline_stats(s, NULL), MESHD_E_INVALID);
  cr_expect_eq(meshd_last_error(c)->err, MESHD_E_INVALID, "last error: %s",
               meshd_last_error(c)->message);
  cr_expect(strstr(meshd_last_error(c)->message, "out"), "%s", meshd_last_error(c)->message);
  meshd_session_close(s);
  meshd_close(c);
}

/* The same after the parent closed its last client: the transport was torn
 * down, the shard pool stays (its atfork handler lets the child start its own). */
Test(c_lifecycle, a_child_forked_after_the_last_close_can_fetch) {
  meshd_client_t *c = connect_ok();
  double got = 0;
  cr_assert_eq(round_trip(c, 7.0, &got), 0, "parent: %s", meshd_last_error(c)->message);
  meshd_close(c);
  fflush(NULL);
  pid_t pid = fork();
  cr_assert_geq(pid, 0);
  if (pid == 0) {
    alarm(30);
    meshd_err_t e;
    meshd_client_t *c2 = meshd_connect(target, 10000, &e);
    if (!c2)
      _exit(10);
    double g = 0;
    int rc = round_trip(c2, 5.0, &g);
    if (rc != 0)
      _exit(10 + rc);
    meshd_close(c2);
    _exit(g == 5.0 ? 0 : 20);
  }
  int st = wait_child(pid);
  cr_assert(!WIFSIGNALED(st), "the forked child died of signal %d", WTERMSIG(st));
  cr_assert_eq(WEXITSTATUS(st), 0, "the forked child failed with %d", WEXITSTATUS(st));
}
