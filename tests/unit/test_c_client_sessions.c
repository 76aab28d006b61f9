/* Objects of another session in the C client: refs are numbered per session,
 * so two sessions made the same way hand out the same ref numbers, and a ref of
 * session B used in a call of session A named another object of A (wrong
 * results, no error). Every call that sends a ref refuses one of another
 * session (MESHD_E_INVALID naming the argument). Also: an unknown dtype is
 * BAD_ARGUMENT and a bad shard dim BAD_DIM (DESIGN.md section 6). Against a
 * live `meshd --local-agents 2`, as test_c_client.c. */
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

static pid_t server_pid = -1;
static pid_t stopped_agent = -1; /* SIGSTOPped by a test; SIGCONTed at teardown whatever happens */
static char dir[64];
static char target[64];

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static const char *bin_dir(void) {
  const char *d = getenv("MESHD_BIN_DIR");
  cr_assert(d && *d, "MESHD_BIN_DIR is not set (run through ctest)");
  return d;
}

/* Reads a whole small file into buf (NUL-terminated); returns its length or -1. */
static long slurp(const char *path, char *buf, size_t len) {
  FILE *f = fopen(path, "r");
  if (!f)
    return -1;
  size_t n = fread(buf, 1, len - 1, f);
  buf[n] = '\0';
  fclose(f);
  return (long)n;
}

static void stop_server(void);

/* A start that failed: the start of meshd's log on stderr, then the server
 * stopped and dir removed (Criterion runs no .fini after a failed .init). */
static void start_failed(void) {
  char path[128], text[4096];
  snprintf(path, sizeof path, "%s/meshd.log", dir);
  if (slurp(path, text, sizeof text) > 0)
    fprintf(stderr, "--- meshd log ---\n%s\n", text);
  stop_server();
}

/* meshd --local-agents `agents` and the NULL-terminated `extra` flags; ready
 * once TensorService is SERVING to a client connected with `o` (NULL: plaintext). */
static void start_server_full(const char *agents, const char *const *extra,
                              const meshd_connect_options_t *o) {
  char port_file[128], log_file[128], bin[512];
  snprintf(bin, sizeof bin, "%s/meshd", bin_dir()); /* before dir: it may fail */
  snprintf(dir, sizeof dir, "/tmp/meshd-c-client-XXXXXX");
  cr_assert_not_null(mkdtemp(dir));
  snprintf(port_file, sizeof port_file, "%s/port", dir);
  snprintf(log_file, sizeof log_file, "%s/meshd.log", dir);
  /* Its TMPDIR is dir: the join token directory it makes for its local agents
   * goes with dir (stop_server) even when a test SIGKILLs it. */
  extern char **environ;
  static char tmpdir_var[80];
  static char *envp[512];
  snprintf(tmpdir_var, sizeof tmpdir_var, "TMPDIR=%s", dir);
  size_t ne = 0;
  for (char **e = environ; *e && ne < 510; e++)
    if (strncmp(*e, "TMPDIR=", 7) != 0)
      envp[ne++] = *e;
  envp[ne++] = tmpdir_var;
  envp[ne] = NULL;
  server_pid = fork();
  cr_assert_geq(server_pid, 0);
  if (server_pid == 0) {
    int fd = open(log_file, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    const char *argv[24] = {bin, "--listen", "127.0.0.1:0", "--port-file", port_file,
                            "--local-agents", agents};
    size_t n = 7;
    for (size_t i = 0; extra && extra[i] && n < 23; i++)
      argv[n++] = extra[i];
    execve(bin, (char *const *)argv, envp);
    _exit(127);
  }
  char buf[64];
  int port = 0;
  for (int i = 0; i < 300 && port <= 0; i++) {
    if (slurp(port_file, buf, sizeof buf) > 0 && strchr(buf, '\n'))
      port = atoi(buf);
    else if (slurp(port_file, buf, sizeof buf) > 0 && i > 5)
      port = atoi(buf);
    if (port <= 0)
      sleep_ms(50);
  }
  if (port <= 0)
    start_failed();
  cr_assert_gt(port, 0, "meshd wrote no port file");
  snprintf(target, sizeof target, "127.0.0.1:%d", port);

  meshd_err_t e;
  meshd_connect_options_t plain = MESHD_CONNECT_OPTIONS_INIT;
  char why[512] = "";
  meshd_client_t *c = meshd_connect_with(target, o ? o : &plain, &e, why, sizeof why);
  if (!c)
    start_failed();
  cr_assert_not_null(c, "connect: %s: %s", meshd_strerror(e), why);
  int status = MESHD_HEALTH_UNKNOWN;
  for (int i = 0; i < 300; i++) {
    if (meshd_health(c, "meshd.v1.TensorService", &status) == MESHD_E_OK &&
        status == MESHD_HEALTH_SERVING)
      break;
    sleep_ms(50);
  }
  meshd_close(c);
  if (status != MESHD_HEALTH_SERVING)
    start_failed();
  cr_assert_eq(status, MESHD_HEALTH_SERVING, "TensorService never became SERVING");
}

static void start_server_with(const char *const *extra) { start_server_full("2", extra, NULL); }

static void start_server(void) { start_server_with(NULL); }

static void stop_server(void) {
  if (stopped_agent > 0)
    kill(stopped_agent, SIGCONT);
  if (server_pid > 0) {
    kill(server_pid, SIGTERM);
    int st;
    for (int i = 0; i < 100; i++) {
      if (waitpid(server_pid, &st, WNOHANG) == server_pid) {
        server_pid = -1;
        break;
      }
      sleep_ms(50);
    }
    if (server_pid > 0) {
      kill(server_pid, SIGKILL);
      waitpid(server_pid, &st, 0);
      server_pid = -1;
    }
  }
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (dir[0] && system(cmd) != 0)
    fprintf(stderr, "could not remove %s\n", dir);
}

TestSuite(c_sessions, .init = start_server, .fini = stop_server, .timeout = 60);

static meshd_client_t *connect_ok(void) {
  meshd_err_t e;
  meshd_client_t *c = meshd_connect(target, 10000, &e);
  cr_assert_not_null(c, "connect: %s", meshd_strerror(e));
  return c;
}

/* A session with a mesh gpu=2, a stream, and full(value) of shape [2] on it. */
typedef struct {
  meshd_session_t *s;
  meshd_ref_t mesh, slice, stream, x;
} world_t;

static world_t world(meshd_client_t *c, double value) {
  world_t w = {0};
  w.s = meshd_session_open(c, "c-sessions", NULL);
  cr_assert_not_null(w.s, "%s", meshd_last_error(c)->message);
  const char *dims[] = {"gpu"};
  int64_t sizes[] = {2}, at0[] = {0}, shape[] = {2};
  cr_assert_eq(meshd_session_create_mesh(w.s, dims, sizes, 1, &w.mesh), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_slice_mesh(w.s, w.mesh, dims, at0, 1, &w.slice), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_stream(w.s, "side", &w.stream), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_factory(w.s, w.mesh, "full", shape, 1, value, &w.x), MESHD_E_OK,
               "%s", meshd_last_error(c)->message);
  return w;
}

/* The call was refused by the client, naming `what`. */
#define expect_refused(c, call, what)                                                        \
  do {                                                                                       \
    meshd_err_t r_ = (call);                                                                 \
    cr_expect_eq(r_, MESHD_E_INVALID, "%s: got %s (%s), want MESHD_E_INVALID", #call,       \
                 meshd_strerror(r_), r_ ? meshd_last_error(c)->message : "no error");        \
    if (r_ == MESHD_E_INVALID) {                                                             \
      cr_expect(strstr(meshd_last_error(c)->message, "another session") &&                  \
                    strstr(meshd_last_error(c)->message, what),                              \
                "%s: %s", #call, meshd_last_error(c)->message);                              \
    }                                                                                        \
  } while (0)

static double first_value(meshd_client_t *c, meshd_session_t *s, meshd_ref_t t) {
  const char *dims[] = {"gpu"};
  int64_t at0[] = {0};
  meshd_values_t v;
  cr_assert_eq(meshd_session_fetch(s, t, dims, at0, 1, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_geq(v.n, 1);
  double x = v.values[0];
  meshd_values_free(&v);
  return x;
}

Test(c_sessions, objects_of_another_session_are_refused) {
  meshd_client_t *c = connect_ok();
  world_t a = world(c, 1.0), b = world(c, 10.0);
  const char *dims[] = {"gpu"};
  int64_t at0[] = {0}, shape[] = {2};
  float data[2] = {3, 3};
  meshd_ref_t out = 0, out2 = 0;

  /* Call arguments: a + b.x was a.x + a.x (2, not 11), without an error. */
  meshd_arg_t args[2] = {{.type = MESHD_ARG_REF, .ref = a.x}, {.type = MESHD_ARG_REF, .ref = b.x}};
  expect_refused(c, meshd_session_call(a.s, "add", args, 2, &out), "argument 1");
  expect_refused(c, meshd_session_factory(a.s, b.mesh, "ones", shape, 1, 0, &out), "mesh");
  expect_refused(c, meshd_session_slice_mesh(a.s, b.mesh, dims, at0, 1, &out), "parent");
  expect_refused(c, meshd_session_reduce(a.s, b.x, "gpu", "sum", &out), "input");
  expect_refused(c, meshd_session_reduce_onto(a.s, a.x, "gpu", "sum", b.slice, &out), "mesh");
  expect_refused(c, meshd_session_to_mesh(a.s, a.x, b.mesh, &out), "mesh");
  expect_refused(c, meshd_session_to_mesh(a.s, b.x, a.mesh, &out), "input");
  expect_refused(c, meshd_session_borrow(a.s, a.x, b.stream, false, &out, &out2), "stream");
  expect_refused(c, meshd_session_borrow(a.s, b.x, a.stream, false, &out, &out2), "input");
  expect_refused(c, meshd_session_upload(a.s, b.mesh, "float32", shape, 1, data, sizeof data, &out),
                 "mesh");
  meshd_upload_options_t uo = MESHD_UPLOAD_OPTIONS_INIT;
  uo.stream = b.stream;
  expect_refused(c, meshd_session_upload_with(a.s, a.mesh, "float32", shape, 1, data, sizeof data,
                                              &uo, &out),
                 "stream");
  expect_refused(c, meshd_session_literal(a.s, b.mesh, "float32", shape, 1, data, sizeof data,
                                          NULL, &out),
                 "mesh");
  meshd_load_options_t lo = {.dtype = "float32", .shape = shape, .ndim = 1};
  expect_refused(c, meshd_session_load(a.s, b.mesh, "http://127.0.0.1:9/none.bin", &lo, &out), "mesh");
  meshd_load_progress_t lp;
  expect_refused(c, meshd_session_load_progress(a.s, &b.x, 1, &lp), "refs[0]");
  meshd_values_t v;
  expect_refused(c, meshd_session_fetch(a.s, b.x, dims, at0, 1, &v), "tensor");
  float buf[2];
  meshd_fetch_part_t part = {dims, at0, 1, buf, sizeof buf, 0};
  expect_refused(c, meshd_session_fetch_bytes(a.s, b.x, &part, 1, NULL), "tensor");
  meshd_ref_t both[2] = {a.x, b.x};
  expect_refused(c, meshd_session_drop(a.s, both, 2), "refs[1]");
  expect_refused(c, meshd_session_release(a.s, &b.x, 1), "refs[0]");

  /* Nothing of a's was touched: a.x is still 1, b.x still 10. */
  cr_assert_eq(meshd_session_sync(a.s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_expect_float_eq(first_value(c, a.s, a.x), 1.0, 1e-9);
  cr_expect_float_eq(first_value(c, b.s, b.x), 10.0, 1e-9);
  /* ...and each session's own objects still work. */
  meshd_arg_t own[2] = {{.type = MESHD_ARG_REF, .ref = a.x}, {.type = MESHD_ARG_FLOAT, .f = 2}};
  cr_assert_eq(meshd_session_call(a.s, "add", own, 2, &out), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_expect_float_eq(first_value(c, a.s, out), 3.0, 1e-9);
  cr_assert_eq(meshd_session_to_mesh(b.s, b.x, b.mesh, &out), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_expect_float_eq(first_value(c, b.s, out), 10.0, 1e-9);
  meshd_session_close(b.s);
  meshd_session_close(a.s);
  meshd_close(c);
}

/* The same with a pipeline on: the refusal comes at the call, nothing is queued. */
Test(c_sessions, objects_of_another_session_are_refused_pipelined) {
  meshd_client_t *c = connect_ok();
  world_t a = world(c, 1.0), b = world(c, 10.0);
  cr_assert_eq(meshd_session_set_pipeline(a.s, &(meshd_pipeline_options_t)MESHD_PIPELINE_OPTIONS_INIT),
               MESHD_E_OK);
  meshd_ref_t out = 0;
  meshd_arg_t args[2] = {{.type = MESHD_ARG_REF, .ref = a.x}, {.type = MESHD_ARG_REF, .ref = b.x}};
  expect_refused(c, meshd_session_call(a.s, "add", args, 2, &out), "argument 1");
  expect_refused(c, meshd_session_drop(a.s, &b.x, 1), "refs[0]");
  expect_refused(c, meshd_session_drop_borrow(a.s, b.x), "borrow");
  cr_assert_eq(meshd_session_sync(a.s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_expect_float_eq(first_value(c, a.s, a.x), 1.0, 1e-9);
  meshd_session_close(b.s);
  meshd_session_close(a.s);
  meshd_close(c);
}

/* DESIGN.md section 6: unknown dtype -> BAD_ARGUMENT, a shard dim the mesh lacks -> BAD_DIM. */
Test(c_sessions, unknown_dtype_and_bad_shard_dim_have_their_kinds) {
  meshd_client_t *c = connect_ok();
  world_t a = world(c, 1.0);
  int64_t shape[] = {2};
  float data[2] = {1, 2};
  meshd_ref_t out = 0;
  cr_expect_eq(meshd_session_upload(a.s, a.mesh, "float33", shape, 1, data, sizeof data, &out),
               MESHD_E_INVALID);
  cr_expect_str_eq(meshd_last_error(c)->kind, "BAD_ARGUMENT", "%s", meshd_last_error(c)->message);
  cr_expect_eq(meshd_session_literal(a.s, a.mesh, "complex64", shape, 1, data, sizeof data, NULL,
                                     &out),
               MESHD_E_INVALID);
  cr_expect_str_eq(meshd_last_error(c)->kind, "BAD_ARGUMENT", "%s", meshd_last_error(c)->message);
  meshd_load_options_t lo = {.dtype = "float33", .shape = shape, .ndim = 1};
  cr_expect_eq(meshd_session_load(a.s, a.mesh, "http://127.0.0.1:9/none.bin", &lo, &out), MESHD_E_INVALID);
  cr_expect_str_eq(meshd_last_error(c)->kind, "BAD_ARGUMENT", "%s", meshd_last_error(c)->message);
  lo = (meshd_load_options_t){.dtype = "float32", .shape = shape, .ndim = 1, .shard = "nodim"};
  cr_expect_neq(meshd_session_load(a.s, a.mesh, "http://127.0.0.1:9/none.bin", &lo, &out), MESHD_E_OK);
  cr_expect_str_eq(meshd_last_error(c)->kind, "BAD_DIM", "%s", meshd_last_error(c)->message);
  meshd_session_close(a.s);
  meshd_close(c);
}
