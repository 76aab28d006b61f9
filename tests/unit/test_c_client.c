/* The C client library (clients/c/meshd.h) and meshctl against a live
 * `meshd --local-agents 2` started from $MESHD_BIN_DIR on a free port; the
 * c_client_lease suite starts it with --session-ttl 2 --agent-timeout 60. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "direct.h"
#include "meshd.h"
#include "proc_threads.h"
#include "range_server.h"

#include "c_client_server.h"

/* start_server_with, its local agents under MESHD_FAULT=fault (agent/fault.h). */
static void start_server_fault(const char *fault, const char *const *extra) {
  setenv("MESHD_FAULT", fault, 1); /* the local agents inherit it */
  start_server_with(extra);
  unsetenv("MESHD_FAULT");
}

TestSuite(c_client, .init = start_server, .fini = stop_server, .timeout = 60);

/* A client of the suite's server whose calls wait timeout_ms at most. */
static meshd_client_t *connect_within(int timeout_ms) {
  meshd_err_t e;
  meshd_client_t *c = meshd_connect(target, timeout_ms, &e);
  cr_assert_not_null(c, "connect: %s", meshd_strerror(e));
  return c;
}

static meshd_client_t *connect_ok(void) { return connect_within(10000); }

/* A session named name on c and its mesh: 2 ranks along "gpu" (*m). */
static meshd_session_t *open_on_two_gpus(meshd_client_t *c, const char *name, meshd_ref_t *m) {
  meshd_session_t *s = meshd_session_open(c, name, NULL);
  cr_assert_not_null(s, "open %s: %s", name, meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_create_mesh(s, (const char *[]){"gpu"}, (int64_t[]){2}, 1, m),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  return s;
}

Test(c_client, compute_and_fetch) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, x = 0, y = 0, z = 0;
  meshd_session_t *s = open_on_two_gpus(c, "c-test", &m);
  const char *dims[] = {"gpu"};
  int64_t shape[] = {2, 3};
  cr_assert_eq(meshd_session_factory(s, m, "ones", shape, 2, 0, &x), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  meshd_arg_t args[2] = {{.type = MESHD_ARG_REF, .ref = x}, {.type = MESHD_ARG_FLOAT, .f = 1.5}};
  cr_assert_eq(meshd_session_call(s, "add", args, 2, &y), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_reduce(s, y, "gpu", "sum", &z), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert(m < x && x < y && y < z);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);

  int64_t at1[] = {1};
  meshd_values_t v;
  cr_assert_eq(meshd_session_fetch(s, z, dims, at1, 1, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(v.ndim, 2);
  cr_assert_eq(v.shape[0], 2);
  cr_assert_eq(v.shape[1], 3);
  cr_assert_eq(v.n, 6);
  for (size_t i = 0; i < v.n; i++)
    cr_assert_float_eq(v.values[i], 5.0, 1e-9);
  meshd_values_free(&v);
  cr_assert_null(v.values);

  /* Onto the sub-mesh at gpu=1: a 0-dim mesh, where the sum lives alone. */
  meshd_ref_t one = 0, w = 0, bad = 0;
  int64_t at[] = {1};
  cr_assert_eq(meshd_session_slice_mesh(s, m, dims, at, 1, &one), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_reduce_onto(s, y, "gpu", "max", one, &w), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_fetch(s, w, NULL, NULL, 0, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(v.ndim, 2);
  cr_assert_eq(v.n, 6);
  for (size_t i = 0; i < v.n; i++)
    cr_assert_float_eq(v.values[i], 2.5, 1e-9);
  meshd_values_free(&v);
  cr_assert_neq(meshd_session_reduce_onto(s, y, "gpu", "sum", m, &bad), MESHD_E_OK);
  cr_assert(strstr(meshd_last_error(c)->message, "still has the reduced dim 'gpu'"), "%s",
            meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_reduce_onto(s, y, "gpu", "sum", 0, &bad), MESHD_E_INVALID);

  /* The session shows up in ListSessions with its live tensors. */
  meshd_session_info_t *list = NULL;
  size_t n = 0;
  cr_assert_eq(meshd_sessions(c, &list, &n), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  bool found = false;
  uint64_t commands = 0;
  for (size_t i = 0; i < n; i++)
    if (strcmp(list[i].client_name, "c-test") == 0) {
      found = true;
      cr_assert_geq(list[i].live_tensors, 3);
      cr_assert_gt(list[i].bytes_held, 0);
      cr_assert_gt(strlen(list[i].session_id), 0);
      /* at least mesh, factory, call, reduce, sync */
      commands = list[i].commands;
      cr_assert_geq(commands, 5, "commands %llu", (unsigned long long)commands);
      cr_assert_str_eq(list[i].owner, "anonymous");
      cr_assert_lt(list[i].age_ms, 60000);
    }
  cr_assert(found, "session c-test not listed (%zu sessions)", n);
  meshd_sessions_free(list, n);
  /* One more Sync: one more command. */
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert_eq(meshd_sessions(c, &list, &n), MESHD_E_OK);
  for (size_t i = 0; i < n; i++)
    if (strcmp(list[i].client_name, "c-test") == 0)
      cr_assert_eq(list[i].commands, commands + 1, "commands %llu after %llu",
                   (unsigned long long)list[i].commands, (unsigned long long)commands);
  meshd_sessions_free(list, n);

  meshd_session_close(s);
  cr_assert_eq(meshd_sessions(c, &list, &n), MESHD_E_OK);
  for (size_t i = 0; i < n; i++)
    cr_assert_str_neq(list[i].client_name, "c-test", "closed session still listed");
  meshd_sessions_free(list, n);

  /* GetInfo: the server's build and both agents with the version they reported. */
  meshd_server_info_t info;
  cr_assert_eq(meshd_server_info(c, &info), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert_gt(strlen(info.version), 0);
  cr_assert_gt(strlen(info.commit), 0);
  cr_assert_gt(info.uptime_ms, 0);
  cr_assert_eq(info.n_agents, 2);
  for (size_t i = 0; i < info.n_agents; i++) {
    cr_assert_str_eq(info.agents[i].version, info.version);
    cr_assert_str_eq(info.agents[i].commit, info.commit);
    cr_assert_eq(info.agents[i].drained, false);
  }
  meshd_server_info_free(&info);
  cr_assert_null(info.version);

  /* DrainAgent: rank 1 drained and back; a rank with no agent is NOT_FOUND. */
  meshd_agent_t *a = NULL;
  cr_assert_eq(meshd_drain_agent(c, 1, true, &a), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert(a && a->rank == 1 && a->drained);
  meshd_agents_free(a, 1);
  meshd_agent_t *agents = NULL;
  cr_assert_eq(meshd_agents(c, &agents, &n), MESHD_E_OK);
  for (size_t i = 0; i < n; i++)
    cr_assert_eq(agents[i].drained, agents[i].rank == 1, "rank %u", agents[i].rank);
  meshd_agents_free(agents, n);
  cr_assert_eq(meshd_drain_agent(c, 1, false, NULL), MESHD_E_OK);
  cr_assert_eq(meshd_drain_agent(c, 7, true, &a), MESHD_E_RPC);
  cr_assert_null(a);
  cr_assert_str_eq(meshd_last_error(c)->grpc_code_name, "NOT_FOUND");
  cr_assert(strstr(meshd_last_error(c)->message, "rank 7"), "%s", meshd_last_error(c)->message);
  meshd_close(c);
}

/* Upload, streams, borrows, to_mesh, drop and release: the C parity of issue 15.
 * Values are fetched back; the session's live tensors and bytes show what
 * release and drop freed. */
static void session_row(meshd_client_t *c, const char *name, uint64_t *live, uint64_t *bytes) {
  meshd_session_info_t *list = NULL;
  size_t n = 0;
  cr_assert_eq(meshd_sessions(c, &list, &n), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  *live = *bytes = UINT64_MAX;
  for (size_t i = 0; i < n; i++)
    if (strcmp(list[i].client_name, name) == 0) {
      *live = list[i].live_tensors;
      *bytes = list[i].bytes_held;
    }
  meshd_sessions_free(list, n);
  cr_assert_neq(*live, UINT64_MAX, "session %s not listed", name);
}

Test(c_client, upload_streams_borrows_to_mesh_drop_release) {
  meshd_client_t *c = connect_ok();
  meshd_session_t *s = meshd_session_open(c, "c-parity", NULL);
  cr_assert_not_null(s);
  const char *dims[] = {"gpu"};
  int64_t two[] = {2}, one[] = {1};
  meshd_ref_t m2 = 0, m1 = 0;
  cr_assert_eq(meshd_session_create_mesh(s, dims, two, 1, &m2), MESHD_E_OK);
  cr_assert_eq(meshd_session_create_mesh(s, dims, one, 1, &m1), MESHD_E_OK);

  /* 2.5 MiB of float32: three messages through the server, two to each agent on the
   * direct path (auto takes it here). */
  size_t n = 5 * (1u << 17);
  float *data = malloc(n * sizeof *data);
  cr_assert_not_null(data);
  for (size_t i = 0; i < n; i++)
    data[i] = (float)(i % 1000);
  int64_t shape[] = {(int64_t)n};
  meshd_ref_t x = 0;
  cr_assert_eq(meshd_session_upload(s, m2, "float32", shape, 1, data, n * sizeof *data, &x),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  int64_t at1[] = {1}, at0[] = {0};
  meshd_values_t v;
  cr_assert_eq(meshd_session_fetch(s, x, dims, at1, 1, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(v.n, n);
  for (size_t i = 0; i < n; i += 4099)
    cr_assert_float_eq(v.values[i], (double)(i % 1000), 1e-9, "element %zu", i);
  meshd_values_free(&v);
  free(data);
  /* Bytes that disagree with the shape are refused, and name what was wrong. */
  float four[4] = {1, 2, 3, 4};
  meshd_ref_t bad = 0;
  int64_t three[] = {3};
  cr_assert_eq(meshd_session_upload(s, m2, "float32", three, 1, four, sizeof four, &bad),
               MESHD_E_RPC);
  cr_assert(strstr(meshd_last_error(c)->message, "total_bytes") ||
                strstr(meshd_last_error(c)->message, "bytes"),
            "%s", meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_upload(s, m2, "float33", three, 1, four, 12, &bad), MESHD_E_INVALID);

  /* A side stream borrows x mutably; the origin is lent out until the borrow ends. */
  meshd_ref_t side = 0, h = 0, b = 0, y = 0;
  cr_assert_eq(meshd_session_stream(s, "side", &side), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_borrow(s, x, side, true, &h, &b), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert(h < b && b == h + 1);
  meshd_arg_t args[2] = {{.type = MESHD_ARG_REF, .ref = x}, {.type = MESHD_ARG_FLOAT, .f = 1}};
  cr_assert_eq(meshd_session_call(s, "add", args, 2, &y), MESHD_E_RPC);
  cr_assert_str_eq(meshd_last_error(c)->kind, "BORROWED");
  cr_assert_eq(meshd_session_drop_borrow(s, b), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_call(s, "add", args, 2, &y), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);

  /* to_mesh: y copied onto another {gpu: 2} mesh; a {gpu: 1} tensor cannot go there. */
  meshd_ref_t m2b = 0, z = 0, w = 0;
  cr_assert_eq(meshd_session_create_mesh(s, dims, two, 1, &m2b), MESHD_E_OK);
  cr_assert_eq(meshd_session_to_mesh(s, y, m2b, &z), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_fetch(s, z, dims, at1, 1, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(v.n, n);
  cr_assert_float_eq(v.values[1001], 2.0, 1e-9); /* x[1001] = 1, plus 1 */
  meshd_values_free(&v);
  int64_t small[] = {4};
  cr_assert_eq(meshd_session_factory(s, m1, "full", small, 1, 3.0, &w), MESHD_E_OK);
  meshd_ref_t bad2 = 0;
  cr_assert_eq(meshd_session_to_mesh(s, w, m2, &bad2), MESHD_E_RPC);
  cr_assert(strstr(meshd_last_error(c)->message, "size 1 on the source"), "%s",
            meshd_last_error(c)->message);

  /* Release lets go of one handle; drop frees a storage with every alias. */
  uint64_t live0, bytes0, live1, bytes1;
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  session_row(c, "c-parity", &live0, &bytes0);
  meshd_ref_t gone[] = {y, 999999};
  cr_assert_eq(meshd_session_release(s, gone, 2), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  session_row(c, "c-parity", &live1, &bytes1);
  cr_assert_eq(live1, live0 - 1);
  cr_assert_eq(bytes1, bytes0 - 2 * n * sizeof(float));
  cr_assert_eq(meshd_session_fetch(s, y, dims, at0, 1, &v), MESHD_E_RPC);
  cr_assert_str_eq(meshd_last_error(c)->kind, "DROPPED");
  cr_assert_eq(meshd_session_drop(s, &x, 1), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  session_row(c, "c-parity", &live1, &bytes1);
  cr_assert_eq(live1, live0 - 2);
  cr_assert_eq(meshd_session_release(s, &m2, 1), MESHD_E_RPC); /* a mesh: refused */
  cr_assert_str_eq(meshd_last_error(c)->kind, "BAD_ARGUMENT");
  meshd_session_close(s);
  meshd_close(c);
}

typedef struct progress_log {
  uint64_t done[4096], total[4096];
  size_t n;
  pthread_t caller;  /* the thread that called the fetch */
  size_t elsewhere;  /* calls on any other thread */
} progress_log_t;

static void log_progress(void *user, uint64_t done, uint64_t total) {
  progress_log_t *l = user;
  if (!pthread_equal(pthread_self(), l->caller)) l->elsewhere++;
  if (l->n < 4096) {
    l->done[l->n] = done;
    l->total[l->n++] = total;
  }
}

/* meshd_session_fetch_with's callback: done grows, in the tensor's own dtype, and the
 * last call (only that one) has done == total; a failed fetch ends without it. It runs
 * on the calling thread (the streams are read on a thread of the library's). */
Test(c_client, fetch_progress_callback) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, x = 0;
  meshd_session_t *s = open_on_two_gpus(c, "c-progress", &m);
  const char *dims[] = {"gpu"};
  int64_t shape[] = {2 << 20}, at0[] = {0};
  cr_assert_eq(meshd_session_factory(s, m, "ones", shape, 1, 0, &x), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);

  static progress_log_t log;
  memset(&log, 0, sizeof log);
  log.caller = pthread_self();
  meshd_fetch_options_t o = MESHD_FETCH_OPTIONS_INIT;
  o.progress = log_progress;
  o.progress_user = &log;
  meshd_values_t v;
  cr_assert_eq(meshd_session_fetch_with(s, x, dims, at0, 1, &o, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(v.n, (size_t)(2 << 20));
  meshd_values_free(&v);
  const uint64_t total = 4ull * (2 << 20); /* float32 bytes */
  cr_assert_geq(log.n, 2, "%zu calls", log.n);
  cr_assert_eq(log.elsewhere, 0, "%zu of %zu calls on another thread", log.elsewhere, log.n);
  for (size_t i = 0; i < log.n; i++) {
    cr_assert_eq(log.total[i], total);
    cr_assert(i == 0 || log.done[i] > log.done[i - 1], "call %zu: %llu after %llu", i,
              (unsigned long long)log.done[i], (unsigned long long)log.done[i - 1]);
    cr_assert_eq(log.done[i] == total, i == log.n - 1, "call %zu of %zu: done == total", i,
                 log.n);
  }

  memset(&log, 0, sizeof log);
  log.caller = pthread_self();
  cr_assert_eq(meshd_session_fetch_with(s, 999, dims, at0, 1, &o, &v), MESHD_E_RPC);
  cr_assert_eq(log.n, 0);
  cr_assert_eq(meshd_session_fetch_with(s, x, dims, at0, 1, NULL, &v), MESHD_E_OK);
  meshd_values_free(&v);
  meshd_session_close(s);
  meshd_close(c);
}

Test(c_client, error_kinds) {
  meshd_client_t *c = connect_ok();
  meshd_session_t *s = meshd_session_open(c, "c-errors", NULL);
  cr_assert_not_null(s);
  const char *dims[] = {"gpu"};
  int64_t sizes[] = {2}, big[] = {5};
  meshd_ref_t m = 0, x = 0, y = 0;

  /* More ranks than healthy agents. */
  cr_assert_eq(meshd_session_create_mesh(s, dims, big, 1, &m), MESHD_E_RPC);
  const meshd_error_info_t *info = meshd_last_error(c);
  cr_assert_eq(info->err, MESHD_E_RPC);
  cr_assert_str_eq(info->kind, "BAD_ARGUMENT");
  cr_assert_str_eq(info->grpc_code_name, "INVALID_ARGUMENT");

  cr_assert_eq(meshd_session_create_mesh(s, dims, sizes, 1, &m), MESHD_E_OK);
  cr_assert_eq(meshd_session_factory(s, m, "zeros", (int64_t[]){4}, 1, 0, &x), MESHD_E_OK);
  meshd_arg_t arg = {.type = MESHD_ARG_REF, .ref = x};
  cr_assert_eq(meshd_session_call(s, "no_such_op", &arg, 1, &y), MESHD_E_RPC);
  cr_assert_str_eq(meshd_last_error(c)->kind, "UNKNOWN_OP");
  cr_assert_eq(y, 0, "a failed call must not bind a result");
  cr_assert(strstr(meshd_last_error(c)->message, "no_such_op"), "%s",
            meshd_last_error(c)->message);

  /* Unknown ref on fetch; missing coordinate. */
  meshd_values_t v;
  int64_t at0[] = {0};
  cr_assert_eq(meshd_session_fetch(s, 999, dims, at0, 1, &v), MESHD_E_RPC);
  cr_assert_str_eq(meshd_last_error(c)->kind, "UNKNOWN_REF");
  cr_assert_null(v.values);
  cr_assert_eq(meshd_session_fetch(s, x, NULL, NULL, 0, &v), MESHD_E_RPC);
  cr_assert_str_eq(meshd_last_error(c)->kind, "BAD_ARGUMENT");

  /* Argument checks never reach the server. */
  cr_assert_eq(meshd_session_call(s, "add", NULL, 1, &y), MESHD_E_INVALID);
  cr_assert_eq(meshd_last_error(c)->err, MESHD_E_INVALID);
  cr_assert_eq(meshd_session_sync(NULL), MESHD_E_INVALID);
  cr_assert_str_eq(meshd_strerror(MESHD_E_INVALID), "invalid argument");

  /* Still usable after errors. */
  cr_assert_eq(meshd_session_fetch(s, x, dims, at0, 1, &v), MESHD_E_OK);
  cr_assert_eq(v.n, 4);
  cr_assert_float_eq(v.values[3], 0.0, 1e-12);
  meshd_values_free(&v);
  meshd_session_close(s);
  meshd_session_close(NULL);
  meshd_close(c);
}

/* ---------------------------------------------------------------- pipeline */

static int64_t now_ms(void);

/* The session `name`'s accepted commands, as the server counts them (ListSessions:
 * a client call, which never flushes a session's pipeline). */
static uint64_t commands_of(meshd_client_t *c, const char *name) {
  meshd_session_info_t *list = NULL;
  size_t n = 0;
  cr_assert_eq(meshd_sessions(c, &list, &n), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  uint64_t v = UINT64_MAX;
  for (size_t i = 0; i < n; i++)
    if (strcmp(list[i].client_name, name) == 0)
      v = list[i].commands;
  meshd_sessions_free(list, n);
  cr_assert_neq(v, UINT64_MAX, "session %s not listed", name);
  return v;
}

/* Polls until the server counts `want` commands of session `name` (at most 5 s). */
static uint64_t await_commands(meshd_client_t *c, const char *name, uint64_t want) {
  uint64_t got = 0;
  for (int i = 0; i < 500 && (got = commands_of(c, name)) < want; i++)
    sleep_ms(10);
  return got;
}

static meshd_pipeline_stats_t pipe_stats(meshd_session_t *s) {
  meshd_pipeline_stats_t st;
  cr_assert_eq(meshd_session_pipeline_stats(s, &st), MESHD_E_OK);
  return st;
}

static void add_one(meshd_client_t *c, meshd_session_t *s, meshd_ref_t in, meshd_ref_t *out) {
  meshd_arg_t args[2] = {{.type = MESHD_ARG_REF, .ref = in}, {.type = MESHD_ARG_FLOAT, .f = 1.0}};
  cr_assert_eq(meshd_session_call(s, "add", args, 2, out), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
}

static double fetch_first(meshd_client_t *c, meshd_session_t *s, meshd_ref_t t) {
  const char *dims[] = {"gpu"};
  int64_t at[] = {1};
  meshd_values_t v;
  cr_assert_eq(meshd_session_fetch(s, t, dims, at, 1, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(v.n, 2);
  double x = v.values[0];
  meshd_values_free(&v);
  return x;
}

/* Commands wait in the queue until max_batch of them go as one Submit message;
 * a lone command goes by itself once max_delay_us passed; a fetch sends what is
 * queued first; a chain of commands over three batches runs in order. */
Test(c_client, pipeline_batches_delays_and_flushes_before_fetch) {
  meshd_client_t *c = connect_ok();
  meshd_session_t *s = meshd_session_open(c, "c-pipe", NULL);
  cr_assert_not_null(s);
  const char *dims[] = {"gpu"};
  int64_t two[] = {2};
  meshd_ref_t m = 0, x = 0, y[7] = {0};
  cr_assert_eq(meshd_session_create_mesh(s, dims, two, 1, &m), MESHD_E_OK);
  cr_assert_eq(meshd_session_factory(s, m, "ones", two, 1, 0, &x), MESHD_E_OK);
  uint64_t base = commands_of(c, "c-pipe");
  cr_assert_eq(base, 2);

  meshd_pipeline_options_t o = {.max_batch = 4, .max_delay_us = 30000000};
  cr_assert_eq(meshd_session_set_pipeline(s, &o), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  /* Three of four: held (the delay is 30 s), the calls return at once with refs. */
  y[0] = x;
  for (int i = 1; i <= 3; i++)
    add_one(c, s, y[i - 1], &y[i]);
  cr_assert(y[1] > x && y[2] > y[1] && y[3] > y[2]);
  sleep_ms(150);
  cr_assert_eq(commands_of(c, "c-pipe"), base, "queued commands reached the server early");
  cr_assert_eq(pipe_stats(s).messages_sent, 0);
  /* The fourth fills the batch: all four go in one message, answered in one reply. */
  add_one(c, s, y[3], &y[4]);
  cr_assert_eq(await_commands(c, "c-pipe", base + 4), base + 4);
  meshd_pipeline_stats_t st = pipe_stats(s);
  cr_assert_eq(st.commands_queued, 4);
  cr_assert_eq(st.commands_sent, 4);
  cr_assert_eq(st.messages_sent, 1);
  for (int i = 0; i < 500 && pipe_stats(s).commands_answered < 4; i++)
    sleep_ms(10);
  st = pipe_stats(s);
  cr_assert_eq(st.commands_answered, 4);
  cr_assert_eq(st.replies, 1, "%llu replies for one batch", (unsigned long long)st.replies);

  /* A lone command under a 20 ms delay reaches the server with no further call. */
  o = (meshd_pipeline_options_t){.max_batch = 256, .max_delay_us = 20000};
  cr_assert_eq(meshd_session_set_pipeline(s, &o), MESHD_E_OK);
  add_one(c, s, y[4], &y[5]);
  cr_assert_eq(await_commands(c, "c-pipe", base + 5), base + 5,
               "the delay did not send a lone queued command");
  st = pipe_stats(s);
  cr_assert_eq(st.messages_sent, 2);
  cr_assert_eq(st.delay_flushes, 1);

  /* Held again (30 s); the fetch sends it first and sees its result. */
  o.max_delay_us = 30000000;
  cr_assert_eq(meshd_session_set_pipeline(s, &o), MESHD_E_OK);
  add_one(c, s, y[5], &y[6]);
  cr_assert_float_eq(fetch_first(c, s, y[6]), 7.0, 1e-9); /* 1 + six adds, in order */
  st = pipe_stats(s);
  cr_assert_eq(st.messages_sent, 3);
  cr_assert_eq(st.commands_answered, 6);
  cr_assert_eq(st.rejected, 0);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);

  /* Limits out of range are named; off sends nothing more and goes back to Execute. */
  o = (meshd_pipeline_options_t){.max_batch = 5000};
  cr_assert_eq(meshd_session_set_pipeline(s, &o), MESHD_E_INVALID);
  cr_assert(strstr(meshd_last_error(c)->message, "max_batch is 5000"), "%s",
            meshd_last_error(c)->message);
  o = (meshd_pipeline_options_t){.max_delay_us = -1};
  cr_assert_eq(meshd_session_set_pipeline(s, &o), MESHD_E_INVALID);
  cr_assert(strstr(meshd_last_error(c)->message, "max_delay_us is -1"), "%s",
            meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_set_pipeline(s, NULL), MESHD_E_OK);
  cr_assert_eq(pipe_stats(s).commands_queued, 0);
  meshd_ref_t z = 0;
  meshd_arg_t arg = {.type = MESHD_ARG_REF, .ref = x};
  cr_assert_eq(meshd_session_call(s, "no_such_op", &arg, 1, &z), MESHD_E_RPC);
  cr_assert_eq(meshd_last_error(c)->seq, 0);
  meshd_session_close(s);
  meshd_close(c);
}

/* A rejected command in the middle of a batch: the calls after it still ran, and
 * the next call that needs an answer fails naming its seq (and a later one that
 * used its result); the call after that runs. */
Test(c_client, pipeline_reports_a_rejection_at_the_next_sync) {
  meshd_client_t *c = connect_ok();
  meshd_session_t *s = meshd_session_open(c, "c-pipe-err", NULL);
  cr_assert_not_null(s);
  const char *dims[] = {"gpu"};
  int64_t two[] = {2};
  meshd_ref_t m = 0, x = 0, a = 0, bad = 0, b = 0, worse = 0;
  cr_assert_eq(meshd_session_create_mesh(s, dims, two, 1, &m), MESHD_E_OK);
  cr_assert_eq(meshd_session_factory(s, m, "ones", two, 1, 0, &x), MESHD_E_OK);
  meshd_pipeline_options_t o = MESHD_PIPELINE_OPTIONS_INIT;
  o.max_delay_us = 30000000; /* all in one batch, sent by the sync */
  cr_assert_eq(meshd_session_set_pipeline(s, &o), MESHD_E_OK);

  add_one(c, s, x, &a);
  meshd_arg_t arg = {.type = MESHD_ARG_REF, .ref = a};
  cr_assert_eq(meshd_session_call(s, "no_such_op", &arg, 1, &bad), MESHD_E_OK);
  uint64_t bad_seq = meshd_session_last_seq(s);
  add_one(c, s, a, &b);
  add_one(c, s, bad, &worse); /* uses the rejected result: rejected too */
  uint64_t worse_seq = meshd_session_last_seq(s);
  cr_assert(bad_seq > 0 && worse_seq > bad_seq);

  cr_assert_eq(meshd_session_sync(s), MESHD_E_RPC);
  const meshd_error_info_t *info = meshd_last_error(c);
  cr_assert_eq(info->seq, bad_seq);
  cr_assert_str_eq(info->kind, "UNKNOWN_OP");
  char want[64];
  snprintf(want, sizeof want, "seq %llu was rejected", (unsigned long long)bad_seq);
  cr_assert(strstr(info->message, want), "%s", info->message);
  cr_assert(strstr(info->message, "no_such_op"), "%s", info->message);
  snprintf(want, sizeof want, "1 more rejected after it: seq %llu)", (unsigned long long)worse_seq);
  cr_assert(strstr(info->message, want), "%s", info->message);
  meshd_pipeline_stats_t st = pipe_stats(s);
  cr_assert_eq(st.messages_sent, 1);
  cr_assert_eq(st.commands_answered, 4);
  cr_assert_eq(st.rejected, 2);

  /* Reported once: the sync runs now, and what came after the rejection ran. */
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert_float_eq(fetch_first(c, s, b), 3.0, 1e-9);
  cr_assert_eq(commands_of(c, "c-pipe-err"), 2 + 2 + 1); /* setup, a and b, a sync */

  /* The server dies: the next call that needs an answer fails at once, naming the
   * stream, and so does every later one; close does not hang. (Its local agents
   * get SIGTERM when it dies.) */
  add_one(c, s, b, &a);
  cr_assert_eq(kill(server_pid, SIGKILL), 0);
  int status;
  cr_assert_eq(waitpid(server_pid, &status, 0), server_pid);
  server_pid = -1;
  int64_t t0 = now_ms();
  meshd_err_t err = meshd_session_sync(s);
  cr_assert(err == MESHD_E_RPC, "sync after the server died: %s", meshd_strerror(err));
  cr_assert(strstr(meshd_last_error(c)->message, "Submit stream"), "%s",
            meshd_last_error(c)->message);
  cr_assert_eq(meshd_last_error(c)->seq, 0);
  meshd_ref_t later = 0;
  meshd_arg_t one = {.type = MESHD_ARG_REF, .ref = b};
  cr_assert_eq(meshd_session_call(s, "relu", &one, 1, &later), MESHD_E_RPC);
  cr_assert(strstr(meshd_last_error(c)->message, "Submit stream"), "%s",
            meshd_last_error(c)->message);
  meshd_session_close(s);
  cr_assert_lt(now_ms() - t0, 5000, "a dead server held the pipeline for %lld ms",
               (long long)(now_ms() - t0));
  meshd_close(c);
}

/* Runs meshctl --server target run SCRIPT; returns its exit status, output in out/err. */
static int meshctl_run(const char *script, char *out, size_t outlen, char *err, size_t errlen) {
  char spath[128], opath[128], epath[128], bin[512];
  snprintf(spath, sizeof spath, "%s/script-%d.txt", dir, (int)getpid());
  snprintf(opath, sizeof opath, "%s/out-%d.txt", dir, (int)getpid());
  snprintf(epath, sizeof epath, "%s/err-%d.txt", dir, (int)getpid());
  snprintf(bin, sizeof bin, "%s/meshctl", bin_dir());
  FILE *f = fopen(spath, "w");
  cr_assert_not_null(f);
  fputs(script, f);
  fclose(f);
  pid_t pid = fork();
  cr_assert_geq(pid, 0);
  if (pid == 0) {
    int o = open(opath, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int e = open(epath, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (o < 0 || e < 0)
      _exit(126);
    dup2(o, 1);
    dup2(e, 2);
    execl(bin, bin, "--server", target, "--timeout-ms", "20000", "run", spath, (char *)NULL);
    _exit(127);
  }
  int st = 0;
  cr_assert_eq(waitpid(pid, &st, 0), pid);
  cr_assert(WIFEXITED(st));
  slurp(opath, out, outlen);
  slurp(epath, err, errlen);
  return WEXITSTATUS(st);
}

Test(c_client, meshctl_run_script) {
  char out[4096], err[4096];
  int rc = meshctl_run("# a smoke test\n"
                       "mesh m gpu=2\n"
                       "\n"
                       "x = ones m 2 3   # two by three\n"
                       "y = add x 1.5\n"
                       "z = reduce y gpu sum\n"
                       "h = full m 0.25 2\n"
                       "fetch z gpu=0\n"
                       "fetch h gpu=1\n"
                       "sync\n",
                       out, sizeof out, err, sizeof err);
  cr_assert_eq(rc, 0, "rc %d, stderr: %s", rc, err);
  cr_assert_str_eq(out, "z [2,3] 5 5 5 5 5 5\nh [2] 0.25 0.25\n", "stdout: %s", out);
}

Test(c_client, meshctl_run_script_uploads_borrows_and_releases) {
  char out[4096], err[4096];
  int rc = meshctl_run("mesh m gpu=2\n"
                       "mesh n gpu=2\n"
                       "x = tensor m 1 2 3\n"
                       "stream side\n"
                       "borrow h b x side mutable\n"
                       "drop_borrow b\n"
                       "y = to_mesh x n\n"
                       "v = t x\n"
                       "release x\n"
                       "fetch v gpu=1\n"
                       "fetch y gpu=0\n"
                       "drop y\n"
                       "fetch y gpu=0\n",
                       out, sizeof out, err, sizeof err);
  cr_assert_eq(rc, 3, "rc %d, stderr: %s", rc, err); /* EXIT_RPC: the last fetch, y was dropped */
  cr_assert_str_eq(out, "v [3] 1 2 3\ny [3] 1 2 3\n", "stdout: %s", out);
  cr_assert(strstr(err, "line 13: DROPPED"), "stderr: %s", err);
}

Test(c_client, meshctl_run_errors) {
  char out[4096], err[4096];
  int rc = meshctl_run("mesh m gpu=2\n"
                       "x = ones m 3\n"
                       "fetch x gpu=0\n"
                       "# comment\n"
                       "y = not_an_op x\n"
                       "fetch y gpu=0\n",
                       out, sizeof out, err, sizeof err);
  cr_assert_eq(rc, 3, "rc %d, stderr: %s", rc, err);
  cr_assert_str_eq(out, "x [3] 1 1 1\n");
  cr_assert(strncmp(err, "line 5: UNKNOWN_OP: ", 20) == 0, "stderr: %s", err);

  rc = meshctl_run("mesh m gpu=2\nfetch nope gpu=0\n", out, sizeof out, err, sizeof err);
  cr_assert_eq(rc, 3);
  cr_assert(strncmp(err, "line 2: SYNTAX: 'nope' is not defined", 37) == 0, "stderr: %s", err);

  rc = meshctl_run("mesh m gpu=2\nx = ones m 2 3\nw = ones m 4\ny = add x w\n", out, sizeof out,
                   err, sizeof err);
  cr_assert_eq(rc, 3);
  cr_assert(strncmp(err, "line 4: SHAPE_MISMATCH: ", 24) == 0, "stderr: %s", err);

  rc = meshctl_run("mesh m gpu=two\n", out, sizeof out, err, sizeof err);
  cr_assert_eq(rc, 3);
  cr_assert(strncmp(err, "line 1: SYNTAX: ", 16) == 0, "stderr: %s", err);
}

/* ------------------------------------------- keepalive and deadlines */

static void start_short_lease(void) {
  static const char *const flags[] = {"--session-ttl", "2", "--agent-timeout", "60", NULL};
  start_server_with(flags);
}

TestSuite(c_client_lease, .init = start_short_lease, .fini = stop_server, .timeout = 60);

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* The meshd-agent child of the server started with --rank rank, or -1. */
static pid_t agent_pid(int rank) {
  char want[16];
  snprintf(want, sizeof want, "%d", rank);
  for (int tries = 0; tries < 200; tries++) {
    char tasks[64];
    snprintf(tasks, sizeof tasks, "/proc/%d/task", (int)server_pid);
    DIR *d = opendir(tasks);
    struct dirent *e;
    while (d && (e = readdir(d))) {
      char path[400], kids[4096];
      if (e->d_name[0] == '.')
        continue;
      snprintf(path, sizeof path, "%s/%s/children", tasks, e->d_name);
      if (slurp(path, kids, sizeof kids) <= 0)
        continue;
      for (char *tok = strtok(kids, " \n"); tok; tok = strtok(NULL, " \n")) {
        char cmd[4096];
        snprintf(path, sizeof path, "/proc/%s/cmdline", tok);
        FILE *f = fopen(path, "r");
        if (!f)
          continue;
        size_t len = fread(cmd, 1, sizeof cmd - 1, f);
        fclose(f);
        cmd[len] = '\0';
        bool agent = strstr(cmd, "meshd-agent") != NULL, is_rank = false;
        for (size_t i = 0; i < len; i += strlen(cmd + i) + 1)
          if (strcmp(cmd + i, "--rank") == 0 && i + 7 < len && strcmp(cmd + i + 7, want) == 0)
            is_rank = true;
        if (agent && is_rank) {
          closedir(d);
          return (pid_t)atoi(tok);
        }
      }
    }
    if (d)
      closedir(d);
    sleep_ms(50);
  }
  return -1;
}

static void stop_agent(pid_t pid) {
  stopped_agent = pid;
  cr_assert_eq(kill(pid, SIGSTOP), 0);
  char path[64], stat[512];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  for (int i = 0; i < 500; i++) {
    const char *paren = slurp(path, stat, sizeof stat) > 0 ? strrchr(stat, ')') : NULL;
    if (paren && (paren[2] == 'T' || paren[2] == 't'))
      break;
    sleep_ms(10);
  }
  sleep_ms(200); /* every thread, not just the main one */
}

/* --session-ttl 2: the keepalive thread keeps a session that makes no call for 7 s;
 * close stops and joins it. */
Test(c_client_lease, idle_session_outlives_its_ttl) {
  meshd_client_t *c = connect_ok();
  meshd_err_t e;
  int before = proc_threads_named("meshd-keepalive");
  meshd_session_t *s = meshd_session_open(c, "c-idle", &e);
  cr_assert_not_null(s, "open: %s: %s", meshd_strerror(e), meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_ttl(s), 2);
  for (int i = 0; i < 100 && proc_threads_named("meshd-keepalive") == before; i++)
    sleep_ms(10);
  cr_assert_eq(proc_threads_named("meshd-keepalive"), before + 1, "no keepalive thread");

  const char *dims[] = {"gpu"};
  int64_t sizes[] = {2};
  meshd_ref_t m = 0, x = 0;
  cr_assert_eq(meshd_session_create_mesh(s, dims, sizes, 1, &m), MESHD_E_OK);
  sleep_ms(7000); /* no call from here for more than three leases */
  cr_assert_eq(meshd_session_factory(s, m, "full", (int64_t[]){3}, 1, 2.5, &x), MESHD_E_OK,
               "after 7 idle seconds: %s: %s", meshd_last_error(c)->kind,
               meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);

  meshd_session_close(s);
  cr_assert_eq(proc_threads_named("meshd-keepalive"), before, "the keepalive thread outlived close");
  meshd_session_info_t *list = NULL;
  size_t n = 0;
  cr_assert_eq(meshd_sessions(c, &list, &n), MESHD_E_OK);
  for (size_t i = 0; i < n; i++)
    cr_assert_str_neq(list[i].client_name, "c-idle", "closed session still listed");
  meshd_sessions_free(list, n);
  meshd_close(c);

  char log_path[128], log[1 << 16];
  snprintf(log_path, sizeof log_path, "%s/meshd.log", dir);
  cr_assert_gt(slurp(log_path, log, sizeof log), 0);
  cr_assert(strstr(log, "(c-idle) closed"), "%s", log);
  cr_assert_null(strstr(log, "(c-idle) expired"), "%s", log);
}

/* A wedged (SIGSTOPped) agent: Sync and Fetch with a 1 s deadline fail with
 * MESHD_E_DEADLINE at that deadline, and work again once it runs. */
Test(c_client_lease, sync_and_fetch_deadlines_on_a_wedged_agent) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, x = 0, y = 0;
  meshd_session_t *s = open_on_two_gpus(c, "c-deadline", &m);
  const char *dims[] = {"gpu"};
  int64_t at1[] = {1};
  cr_assert_eq(meshd_session_factory(s, m, "ones", (int64_t[]){4}, 1, 0, &x), MESHD_E_OK);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);

  pid_t pid = agent_pid(1);
  cr_assert_gt(pid, 0, "no rank-1 agent child of meshd %d", (int)server_pid);
  stop_agent(pid);
  meshd_arg_t args[2] = {{.type = MESHD_ARG_REF, .ref = x}, {.type = MESHD_ARG_FLOAT, .f = 1.0}};
  cr_assert_eq(meshd_session_call(s, "add", args, 2, &y), MESHD_E_OK); /* accepted at once */

  int64_t t0 = now_ms();
  cr_assert_eq(meshd_session_sync_timeout(s, 1000), MESHD_E_DEADLINE, "%s: %s",
               meshd_last_error(c)->grpc_code_name, meshd_last_error(c)->message);
  int64_t took = now_ms() - t0;
  cr_assert(took >= 900 && took < 3000, "a 1 s deadline took %lld ms", (long long)took);
  const meshd_error_info_t *info = meshd_last_error(c);
  cr_assert_eq(info->err, MESHD_E_DEADLINE);
  cr_assert_eq(info->grpc_code, 4);
  cr_assert_str_eq(info->grpc_code_name, "DEADLINE_EXCEEDED");
  cr_assert_str_eq(info->kind, "DEADLINE_EXCEEDED");
  cr_assert_str_eq(meshd_strerror(MESHD_E_DEADLINE), "the call's deadline passed");

  meshd_values_t v;
  t0 = now_ms();
  cr_assert_eq(meshd_session_fetch_timeout(s, y, dims, at1, 1, 1000, &v), MESHD_E_DEADLINE,
               "%s: %s", meshd_last_error(c)->grpc_code_name, meshd_last_error(c)->message);
  took = now_ms() - t0;
  cr_assert(took < 3000, "a 1 s fetch deadline took %lld ms", (long long)took);
  cr_assert_null(v.values);
  cr_assert_str_eq(meshd_last_error(c)->kind, "DEADLINE_EXCEEDED");

  /* a load's wait ends at its deadline too, though LoadProgress cannot answer (the
   * server asks the wedged agent); once it runs, the wait reports the load's failure */
  meshd_ref_t l = 0;
  meshd_load_options_t lo = {.dtype = "float32", .shape = (int64_t[]){4}, .ndim = 1};
  const char *url = "http://127.0.0.1:1/x.bin"; /* nothing listens: refused */
  cr_assert_eq(meshd_session_load(s, m, url, &lo, &l), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  meshd_wait_load_options_t w = MESHD_WAIT_LOAD_OPTIONS_INIT;
  w.timeout_ms = 1000;
  t0 = now_ms();
  cr_assert_eq(meshd_session_wait_load(s, &l, 1, &w), MESHD_E_DEADLINE, "%s",
               meshd_last_error(c)->message);
  took = now_ms() - t0;
  cr_assert(took >= 900 && took < 3000, "a 1 s wait took %lld ms", (long long)took);
  cr_assert(strstr(meshd_last_error(c)->message, "after 1000 ms"), "%s",
            meshd_last_error(c)->message);

  kill(pid, SIGCONT);
  stopped_agent = -1;
  cr_assert_eq(meshd_session_wait_load(s, &l, 1, NULL), MESHD_E_RPC);
  cr_assert(strstr(meshd_last_error(c)->message, url), "%s", meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_fetch(s, y, dims, at1, 1, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(v.n, 4);
  cr_assert_float_eq(v.values[0], 2.0, 1e-9);
  meshd_values_free(&v);
  meshd_session_close(s);
  meshd_close(c);
}

/* A wedged agent fills the session's queue (--session-max-queued), so the
 * server stops reading the Submit stream: a pipeline's calls end by the
 * client's timeout (1 s) instead of hanging in a write. One that finds the
 * batch full waits for room, which comes when the oldest commands queued
 * reach their deadline and are taken out, never sent; a Sync reports them,
 * and once the agent runs every command sent runs and the session goes on. */
Test(c_client_lease, a_pipeline_whose_server_stops_reading_ends_its_calls_by_the_timeout) {
  meshd_client_t *c = connect_within(1000);
  meshd_ref_t m = 0, x = 0, y = 0, first = 0, last = 0;
  meshd_session_t *s = open_on_two_gpus(c, "c-stall", &m);
  const char *dims[] = {"gpu"};
  int64_t at1[] = {1};
  cr_assert_eq(meshd_session_factory(s, m, "ones", (int64_t[]){4}, 1, 0, &x), MESHD_E_OK);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  meshd_pipeline_options_t po = {.max_batch = 64};
  cr_assert_eq(meshd_session_set_pipeline(s, &po), MESHD_E_OK);

  pid_t pid = agent_pid(1);
  cr_assert_gt(pid, 0);
  stop_agent(pid);
  meshd_arg_t args[2] = {{.type = MESHD_ARG_REF, .ref = x}, {.type = MESHD_ARG_FLOAT, .f = 1.0}};
  uint64_t queued = 0;
  int64_t took = 0;
  while (queued < 200000) { /* until one waited for the oldest to be taken out */
    int64_t t0 = now_ms();
    cr_assert_eq(meshd_session_call(s, "add", args, 2, &y), MESHD_E_OK, "after %llu commands: %s",
                 (unsigned long long)queued, meshd_last_error(c)->message);
    int64_t t = now_ms() - t0;
    took = t > took ? t : took;
    first = first ? first : y;
    last = y;
    if (pipe_stats(s).commands_queued < ++queued)
      break;
  }
  cr_assert_lt(took, 3000, "a call with a 1 s timeout took %lld ms", (long long)took);
  cr_assert_lt(queued, 200000, "no command was taken out at its deadline");
  cr_assert_gt(queued, 1024, "the server read only %llu commands", (unsigned long long)queued);

  int64_t t0 = now_ms();
  cr_assert_eq(meshd_session_sync_timeout(s, 1000), MESHD_E_DEADLINE, "%s",
               meshd_last_error(c)->message);
  took = now_ms() - t0;
  cr_assert_lt(took, 3000, "a 1 s sync took %lld ms", (long long)took);
  cr_assert(strstr(meshd_last_error(c)->message, "not sent within") &&
                strstr(meshd_last_error(c)->message, "never sent, so they did not run"),
            "%s", meshd_last_error(c)->message);
  cr_assert_gt(meshd_last_error(c)->seq, 0, "no seq for the first taken out");

  kill(pid, SIGCONT);
  stopped_agent = -1;
  meshd_err_t se = MESHD_E_DEADLINE;
  for (int i = 0; i < 30 && se == MESHD_E_DEADLINE; i++) /* 2,000 commands on a loaded machine */
    se = meshd_session_sync_timeout(s, 1000);
  cr_assert_eq(se, MESHD_E_OK, "%s", meshd_last_error(c)->message);
  meshd_pipeline_stats_t ps;
  cr_assert_eq(meshd_session_pipeline_stats(s, &ps), MESHD_E_OK);
  cr_assert_eq(ps.commands_answered, ps.commands_sent, "%llu of %llu sent answered",
               (unsigned long long)ps.commands_answered, (unsigned long long)ps.commands_sent);
  cr_assert_gt(ps.commands_sent, 1024, "%llu sent", (unsigned long long)ps.commands_sent);
  meshd_values_t v; /* the first one was sent and ran; the last one was taken out */
  cr_assert_eq(meshd_session_fetch(s, first, dims, at1, 1, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_float_eq(v.values[0], 2.0, 1e-9);
  meshd_values_free(&v);
  cr_assert_neq(meshd_session_fetch(s, last, dims, at1, 1, &v), MESHD_E_OK, "it ran");
  cr_assert_str_eq(meshd_last_error(c)->kind, "UNKNOWN_REF", "%s", meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_call(s, "add", args, 2, &y), MESHD_E_OK);
  cr_assert_eq(meshd_session_fetch(s, y, dims, at1, 1, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_float_eq(v.values[3], 2.0, 1e-9);
  meshd_values_free(&v);
  meshd_session_close(s);
  meshd_close(c);
}

/* A server that stops answering (SIGSTOPped) while a pipeline has commands
 * queued: meshd_session_close holds the caller about the client's timeout
 * (1 s), not once for the pipeline's flush, once for its half-close and once
 * more for CloseSession (3 s and more). */
Test(c_client_lease, closing_a_session_on_a_frozen_server_takes_one_timeout) {
  meshd_client_t *c = connect_within(1000);
  meshd_ref_t m = 0, x = 0, y = 0;
  meshd_session_t *s = open_on_two_gpus(c, "c-frozen", &m);
  cr_assert_eq(meshd_session_factory(s, m, "ones", (int64_t[]){4}, 1, 0, &x), MESHD_E_OK);
  meshd_pipeline_options_t po = {.max_batch = 64, .max_delay_us = 1000000};
  cr_assert_eq(meshd_session_set_pipeline(s, &po), MESHD_E_OK);
  stop_agent(server_pid); /* the server, and its agents keep running */
  meshd_arg_t args[2] = {{.type = MESHD_ARG_REF, .ref = x}, {.type = MESHD_ARG_FLOAT, .f = 1.0}};
  for (int i = 0; i < 10; i++)
    cr_assert_eq(meshd_session_call(s, "add", args, 2, &y), MESHD_E_OK, "%s",
                 meshd_last_error(c)->message);
  int64_t t0 = now_ms();
  meshd_session_close(s);
  int64_t took = now_ms() - t0;
  kill(server_pid, SIGCONT);
  stopped_agent = -1;
  cr_assert_lt(took, 1900, "closing took %lld ms with a 1000 ms timeout", (long long)took);
  meshd_close(c);
}

/* A server that reads nothing (SIGSTOPped): a Literal of 240 KB fills the
 * Submit stream's window and stays in flight; one queued after it waits in the
 * client's queue. A Sync that runs out of time takes it out, never sent, and
 * says so: once the server reads again the first one ran, the second did not
 * (its ref is unknown). It used to stay queued, go out later and run: a caller
 * that called again ran it twice. */
Test(c_client_lease, a_pipelined_command_still_queued_at_a_deadline_is_taken_out_never_sent) {
  meshd_client_t *c = connect_within(2000);
  meshd_session_t *s = meshd_session_open(c, "c-taken-out", NULL);
  cr_assert_not_null(s);
  const char *dims[] = {"gpu"};
  int64_t sizes[] = {2}, at1[] = {1}, n[] = {60000};
  meshd_ref_t m = 0, a = 0, b = 0;
  cr_assert_eq(meshd_session_create_mesh(s, dims, sizes, 1, &m), MESHD_E_OK);
  meshd_pipeline_options_t po = MESHD_PIPELINE_OPTIONS_INIT;
  cr_assert_eq(meshd_session_set_pipeline(s, &po), MESHD_E_OK);
  static float data[60000];
  for (int i = 0; i < 60000; i++)
    data[i] = 3.0f;
  stop_agent(server_pid);
  cr_assert_eq(meshd_session_literal(s, m, "float32", n, 1, data, sizeof data, NULL, &a),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  meshd_pipeline_stats_t ps = {0};
  for (int i = 0; i < 500 && !ps.commands_sent; i++) { /* the flusher took it: in flight */
    sleep_ms(2);
    cr_assert_eq(meshd_session_pipeline_stats(s, &ps), MESHD_E_OK);
  }
  cr_assert_eq(ps.commands_sent, 1);
  data[0] = 4.0f;
  cr_assert_eq(meshd_session_literal(s, m, "float32", n, 1, data, sizeof data, NULL, &b),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  uint64_t seq_b = meshd_session_last_seq(s);
  cr_assert_eq(meshd_session_sync_timeout(s, 200), MESHD_E_DEADLINE, "%s",
               meshd_last_error(c)->message);
  const meshd_error_info_t *ei = meshd_last_error(c);
  char want[128];
  snprintf(want, sizeof want,
           "1 command(s) queued from seq %llu to %llu were not sent within 200 ms",
           (unsigned long long)seq_b, (unsigned long long)seq_b);
  cr_assert(strstr(ei->message, want) && strstr(ei->message, "waited in the client's queue") &&
                strstr(ei->message, "never sent, so they did not run (calling again is safe)"),
            "%s", ei->message);
  cr_assert_eq(ei->seq, seq_b);
  kill(server_pid, SIGCONT);
  stopped_agent = -1;
  cr_assert_eq(meshd_session_sync_timeout(s, 20000), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_pipeline_stats(s, &ps), MESHD_E_OK);
  cr_assert_eq(ps.commands_sent, 1, "the Literal taken out was sent");
  meshd_values_t v;
  cr_assert_eq(meshd_session_fetch(s, a, dims, at1, 1, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_float_eq(v.values[0], 3.0, 1e-9);
  meshd_values_free(&v);
  cr_assert_neq(meshd_session_fetch(s, b, dims, at1, 1, &v), MESHD_E_OK, "the Literal taken "
                "out ran");
  cr_assert_str_eq(meshd_last_error(c)->kind, "UNKNOWN_REF", "%s", meshd_last_error(c)->message);
  meshd_session_close(s);
  meshd_close(c);
}

/* With the server SIGSTOPped (it reads nothing): a Literal of 240 KB that
 * fills the Submit stream's window, in flight (the flusher took it), and one
 * more after it, *b, which waits in the client's queue. Returns b's seq. */
static uint64_t literal_queued_behind_one_in_flight(meshd_client_t *c, meshd_session_t *s,
                                                    meshd_ref_t m, meshd_ref_t *a,
                                                    meshd_ref_t *b) {
  static float data[60000];
  int64_t n[] = {60000};
  for (int i = 0; i < 60000; i++)
    data[i] = 3.0f;
  meshd_pipeline_stats_t ps = pipe_stats(s);
  uint64_t sent = ps.commands_sent;
  stop_agent(server_pid);
  cr_assert_eq(meshd_session_literal(s, m, "float32", n, 1, data, sizeof data, NULL, a),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  for (int i = 0; i < 500 && ps.commands_sent == sent; i++) { /* the flusher took it */
    sleep_ms(2);
    ps = pipe_stats(s);
  }
  cr_assert_eq(ps.commands_sent, sent + 1);
  cr_assert_eq(meshd_session_literal(s, m, "float32", n, 1, data, sizeof data, NULL, b),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  return meshd_session_last_seq(s);
}

/* The server stopped: a pipelined command still in the client's queue at its
 * own deadline (the client's timeout, 1 s) is taken out there, never sent,
 * though no call waits for the answers (as in the Node client): it leaves
 * commands_queued, and the next call that needs an answer reports it
 * (MESHD_E_DEADLINE, its seq) and did not run; it did not run once the server
 * reads again either. It used to stay queued until a call's wait ran out, and
 * go out and run if the server read again first. */
Test(c_client, a_pipelined_command_queued_past_its_own_deadline_is_taken_out_with_no_call_waiting) {
  meshd_client_t *c = connect_within(1000);
  meshd_ref_t m = 0, a = 0, b = 0;
  meshd_session_t *s = open_on_two_gpus(c, "c-own-deadline", &m);
  meshd_pipeline_options_t po = MESHD_PIPELINE_OPTIONS_INIT;
  cr_assert_eq(meshd_session_set_pipeline(s, &po), MESHD_E_OK);
  uint64_t seq_b = literal_queued_behind_one_in_flight(c, s, m, &a, &b);
  meshd_pipeline_stats_t ps = pipe_stats(s);
  cr_assert_eq(ps.commands_queued, 2);
  for (int i = 0; i < 500 && ps.commands_queued == 2; i++) { /* 5 s: its deadline is 1 s */
    sleep_ms(10);
    ps = pipe_stats(s);
  }
  cr_assert_eq(ps.commands_queued, 1, "the Literal still queued past its deadline was not "
               "taken out (%llu queued)", (unsigned long long)ps.commands_queued);
  kill(server_pid, SIGCONT);
  stopped_agent = -1;
  cr_assert_eq(meshd_session_sync_timeout(s, 20000), MESHD_E_DEADLINE, "%s",
               meshd_last_error(c)->message);
  const meshd_error_info_t *ei = meshd_last_error(c);
  char want[128];
  snprintf(want, sizeof want,
           "1 command(s) queued from seq %llu to %llu were not sent within 1000 ms",
           (unsigned long long)seq_b, (unsigned long long)seq_b);
  cr_assert(strstr(ei->message, want) &&
                strstr(ei->message, "never sent, so they did not run (calling again is safe)"),
            "%s", ei->message);
  cr_assert_eq(ei->seq, seq_b);
  cr_assert_str_eq(ei->kind, "DEADLINE_EXCEEDED");
  cr_assert_eq(meshd_session_sync_timeout(s, 20000), MESHD_E_OK, "reported once: %s",
               meshd_last_error(c)->message);
  ps = pipe_stats(s);
  cr_assert_eq(ps.commands_sent, 1, "the Literal taken out was sent");
  cr_assert_eq(ps.commands_answered, 1);
  meshd_values_t v;
  cr_assert_neq(meshd_session_fetch(s, b, (const char *[]){"gpu"}, (int64_t[]){1}, 1, &v),
                MESHD_E_OK, "the Literal taken out ran");
  cr_assert_str_eq(meshd_last_error(c)->kind, "UNKNOWN_REF", "%s", meshd_last_error(c)->message);
  meshd_session_close(s);
  meshd_close(c);
}

/* A call that needs an answer runs out of time while a rejection waits to be
 * reported: it reports the rejection (the lower seq), and the command still
 * in the client's queue is taken out all the same, never sent, and named in
 * the message. It used to stay queued (and counted in commands_queued) and go
 * out later and run, though its caller's wait had run out. */
Test(c_client, a_flush_that_reports_a_rejection_takes_out_what_is_still_queued) {
  meshd_client_t *c = connect_within(5000);
  meshd_ref_t m = 0, x = 0, bad = 0, a = 0, b = 0;
  meshd_session_t *s = open_on_two_gpus(c, "c-rejected-and-unsent", &m);
  cr_assert_eq(meshd_session_factory(s, m, "ones", (int64_t[]){2}, 1, 0, &x), MESHD_E_OK);
  meshd_pipeline_options_t po = MESHD_PIPELINE_OPTIONS_INIT;
  cr_assert_eq(meshd_session_set_pipeline(s, &po), MESHD_E_OK);
  meshd_arg_t arg = {.type = MESHD_ARG_REF, .ref = x};
  cr_assert_eq(meshd_session_call(s, "no_such_op", &arg, 1, &bad), MESHD_E_OK);
  uint64_t bad_seq = meshd_session_last_seq(s);
  meshd_pipeline_stats_t ps = pipe_stats(s);
  for (int i = 0; i < 500 && !ps.rejected; i++) { /* answered, not yet reported */
    sleep_ms(10);
    ps = pipe_stats(s);
  }
  cr_assert_eq(ps.rejected, 1);
  uint64_t seq_b = literal_queued_behind_one_in_flight(c, s, m, &a, &b);
  cr_assert_eq(meshd_session_sync_timeout(s, 200), MESHD_E_RPC, "%s",
               meshd_last_error(c)->message);
  const meshd_error_info_t *ei = meshd_last_error(c);
  cr_assert_eq(ei->seq, bad_seq);
  cr_assert_str_eq(ei->kind, "UNKNOWN_OP");
  char want[128];
  snprintf(want, sizeof want,
           "; also: pipeline: 1 command(s) queued from seq %llu to %llu were not sent within "
           "200 ms", (unsigned long long)seq_b, (unsigned long long)seq_b);
  cr_assert(strstr(ei->message, want) && strstr(ei->message, "never sent"), "%s", ei->message);
  ps = pipe_stats(s);
  cr_assert_eq(ps.commands_queued, ps.commands_sent, "%llu queued, %llu sent: one left queued",
               (unsigned long long)ps.commands_queued, (unsigned long long)ps.commands_sent);
  kill(server_pid, SIGCONT);
  stopped_agent = -1;
  cr_assert_eq(meshd_session_sync_timeout(s, 20000), MESHD_E_OK, "reported once: %s",
               meshd_last_error(c)->message);
  meshd_values_t v;
  cr_assert_neq(meshd_session_fetch(s, b, (const char *[]){"gpu"}, (int64_t[]){1}, 1, &v),
                MESHD_E_OK, "the Literal taken out ran");
  cr_assert_str_eq(meshd_last_error(c)->kind, "UNKNOWN_REF", "%s", meshd_last_error(c)->message);
  meshd_session_close(s);
  meshd_close(c);
}

/* ------------------------------------------- connect options (no server) */

static char pki[128]; /* make_certs.sh's folder, for the suites below */

static void make_pki(void) {
  const char *src = getenv("MESHD_SOURCE_DIR");
  cr_assert(src && *src, "MESHD_SOURCE_DIR is not set (run through ctest)");
  snprintf(pki, sizeof pki, "/tmp/meshd-c-pki-XXXXXX");
  cr_assert_not_null(mkdtemp(pki));
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "bash '%s/tests/support/make_certs.sh' '%s' >/dev/null", src, pki);
  cr_assert_eq(system(cmd), 0, "make_certs.sh failed");
}

static void remove_pki(void) {
  char cmd[256];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", pki);
  if (pki[0] && system(cmd) != 0)
    fprintf(stderr, "could not remove %s\n", pki);
}

static const char *pki_file(const char *name) {
  static char path[4][256];
  static int next;
  char *p = path[next++ % 4];
  snprintf(p, sizeof path[0], "%s/%s", pki, name);
  return p;
}

/* meshd_connect_with; closes what it got. why gets the message. */
static meshd_err_t try_connect(const char *to, meshd_connect_options_t o, char *why,
                               size_t len) {
  meshd_err_t e = MESHD_E_OK;
  meshd_client_t *c = meshd_connect_with(to, &o, &e, why, len);
  cr_assert_eq(c == NULL, e != MESHD_E_OK, "a client and an error (%d) at once", e);
  meshd_close(c);
  return e;
}

#define SECRET "s3cret-TOKEN-a1b2c3"

TestSuite(c_client_options, .init = make_pki, .fini = remove_pki, .timeout = 60);

Test(c_client_options, token_goes_in_plaintext_only_to_loopback) {
  meshd_connect_options_t o = MESHD_CONNECT_OPTIONS_INIT;
  o.token = SECRET;
  o.timeout_ms = 100;
  char why[512];
  static const char *const remote[] = {
      "10.0.0.5:50051", "meshd.example:50051", "dns:///meshd.example:50051",
      "dns://8.8.8.8/localhost.example:1", "[2001:db8::1]:50051", "ipv4:127.0.0.1:1,10.0.0.1:1",
      "127.0.0.1.example.com:1", "[::ffff:10.0.0.1]:1", "2001:db8::1"};
  for (size_t i = 0; i < sizeof remote / sizeof remote[0]; i++) {
    cr_assert_eq(try_connect(remote[i], o, why, sizeof why), MESHD_E_INVALID, "%s: %s", remote[i],
                 why);
    cr_assert(strstr(why, "plaintext") && strstr(why, remote[i]), "%s: %s", remote[i], why);
    cr_assert_null(strstr(why, SECRET), "the message shows the token: %s", why);
  }
  /* Loopback and local sockets: the connection is tried (nothing listens: CONNECT). */
  static const char *const local[] = {"127.0.0.1:1",        "localhost:1",    "[::1]:1",
                                      "dns:///localhost:1", "ipv4:127.0.0.2:1", "unix:/nonexistent.sock",
                                      "[::ffff:127.0.0.1]:1", "LOCALHOST:1"};
  for (size_t i = 0; i < sizeof local / sizeof local[0]; i++)
    cr_assert_eq(try_connect(local[i], o, why, sizeof why), MESHD_E_CONNECT, "%s: %s", local[i],
                 why);
  /* TLS, or insecure: the rule does not apply (whatever the network answers). */
  o.tls_ca_file = pki_file("ca.pem");
  cr_assert_neq(try_connect("10.0.0.5:50051", o, why, sizeof why), MESHD_E_INVALID, "%s", why);
  o.tls_ca_file = NULL;
  o.insecure = true;
  cr_assert_neq(try_connect("10.0.0.5:50051", o, why, sizeof why), MESHD_E_INVALID, "%s", why);
  /* No token: nothing to protect. */
  o.insecure = false;
  o.token = "";
  cr_assert_neq(try_connect("10.0.0.5:50051", o, why, sizeof why), MESHD_E_INVALID, "%s", why);
}

/* fail_fast: a port where nothing listens is an error at once, not after timeout_ms. */
Test(c_client_options, fail_fast_on_a_refused_port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0); /* a port that is free: bound, never listened on */
  cr_assert_geq(fd, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  cr_assert_eq(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  socklen_t len = sizeof sa;
  cr_assert_eq(getsockname(fd, (struct sockaddr *)&sa, &len), 0);
  char where[64];
  snprintf(where, sizeof where, "127.0.0.1:%d", ntohs(sa.sin_port));
  meshd_connect_options_t o = MESHD_CONNECT_OPTIONS_INIT;
  o.timeout_ms = 30000;
  o.fail_fast = true;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  meshd_err_t e;
  char why[256] = "";
  meshd_client_t *c = meshd_connect_with(where, &o, &e, why, sizeof why);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  close(fd);
  double took = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
  cr_assert_null(c);
  cr_assert_eq(e, MESHD_E_CONNECT);
  cr_assert(strstr(why, "nothing listens there"), "%s", why);
  cr_assert_lt(took, 2.0, "took %.2f s with fail_fast", took);
}

Test(c_client_options, bad_options_are_named) {
  char why[512];
  char long_token[5000];
  memset(long_token, 'a', sizeof long_token - 1);
  long_token[sizeof long_token - 1] = '\0';
  static const char *const bad_tokens[] = {SECRET " x", SECRET "\n", "caf\xc3\xa9" SECRET,
                                           "\t" SECRET};
  meshd_connect_options_t o = MESHD_CONNECT_OPTIONS_INIT;
  for (size_t i = 0; i < sizeof bad_tokens / sizeof bad_tokens[0]; i++) {
    o.token = bad_tokens[i];
    cr_assert_eq(try_connect("127.0.0.1:1", o, why, sizeof why), MESHD_E_INVALID);
    cr_assert(strncmp(why, "token: ", 7) == 0 && strstr(why, "not visible ASCII"), "%s", why);
    cr_assert_null(strstr(why, SECRET), "the message shows the token: %s", why);
  }
  o.token = long_token;
  cr_assert_eq(try_connect("127.0.0.1:1", o, why, sizeof why), MESHD_E_INVALID);
  cr_assert_str_eq(why, "token: the token is 4999 bytes, more than 4096");

  o = (meshd_connect_options_t)MESHD_CONNECT_OPTIONS_INIT;
  o.tls_cert_file = pki_file("client.pem");
  cr_assert_eq(try_connect("127.0.0.1:1", o, why, sizeof why), MESHD_E_INVALID);
  cr_assert_str_eq(why, "tls_cert_file is set without tls_key_file: a client certificate needs both");
  o.tls_cert_file = NULL;
  o.tls_key_file = pki_file("client.key");
  cr_assert_eq(try_connect("127.0.0.1:1", o, why, sizeof why), MESHD_E_INVALID);
  cr_assert(strncmp(why, "tls_key_file is set without tls_cert_file", 41) == 0, "%s", why);

  o = (meshd_connect_options_t)MESHD_CONNECT_OPTIONS_INIT;
  o.tls_ca_file = "/nonexistent/ca.pem";
  cr_assert_eq(try_connect("127.0.0.1:1", o, why, sizeof why), MESHD_E_INVALID);
  cr_assert_str_eq(why, "tls_ca_file: cannot read /nonexistent/ca.pem: No such file or directory");
  o.tls_ca_file = pki_file("ca.key"); /* a key where a certificate belongs */
  cr_assert_eq(try_connect("127.0.0.1:1", o, why, sizeof why), MESHD_E_INVALID);
  cr_assert(strstr(why, "tls_ca_file: ") && strstr(why, "holds no PEM CERTIFICATE"), "%s", why);
  o.tls_ca_file = NULL;
  o.tls_cert_file = pki_file("client.pem");
  o.tls_key_file = pki_file("client.pem"); /* a certificate where the key belongs */
  cr_assert_eq(try_connect("127.0.0.1:1", o, why, sizeof why), MESHD_E_INVALID);
  cr_assert(strstr(why, "tls_key_file: ") && strstr(why, "holds no PEM PRIVATE KEY"), "%s", why);
  cr_assert_null(strstr(why, "BEGIN"), "the message quotes the file: %s", why);

  o = (meshd_connect_options_t)MESHD_CONNECT_OPTIONS_INIT;
  o.tls_server_name = "";
  cr_assert_eq(try_connect("127.0.0.1:1", o, why, sizeof why), MESHD_E_INVALID);
  cr_assert(strncmp(why, "tls_server_name is empty", 24) == 0, "%s", why);
  o.tls_server_name = NULL;
  o.timeout_ms = 0;
  cr_assert_eq(try_connect("127.0.0.1:1", o, why, sizeof why), MESHD_E_INVALID);
  cr_assert_str_eq(why, "timeout_ms is 0 (expected > 0)");
  o.timeout_ms = 100;
  cr_assert_eq(try_connect("", o, why, sizeof why), MESHD_E_INVALID);
  cr_assert_str_eq(why, "target is empty (expected host:port)");

  /* NULL options are the defaults; NULL err and errbuf are allowed. */
  meshd_err_t e = MESHD_E_OK;
  cr_assert_null(meshd_connect_with(NULL, NULL, &e, why, sizeof why));
  cr_assert_eq(e, MESHD_E_INVALID);
  cr_assert_null(meshd_connect_with("", NULL, NULL, NULL, 0));
}

/* ------------------------------------------- against a server with tokens and TLS */

#define ALICE "alice-7f3e9a0c5d1b2468"
#define BOB "bob-0c5d1b24687f3e9a"
#define WRONG "mallory-5d1b24687f3e9a0c"

static char tokens_flag_value[256];

/* The PKI, and a tokens file with two principals, in pki. */
static void make_pki_and_tokens(void) {
  make_pki();
  snprintf(tokens_flag_value, sizeof tokens_flag_value, "%s/tokens", pki);
  FILE *f = fopen(tokens_flag_value, "w");
  cr_assert_not_null(f);
  fprintf(f, "alice " ALICE "\nbob " BOB "\n");
  fclose(f);
}

static void stop_server_and_pki(void) {
  stop_server();
  remove_pki();
}

/* Plaintext (loopback) with tokens, 2 agents, sessions leased for 2 s. */
static void start_token_server(void) {
  make_pki_and_tokens();
  const char *const flags[] = {"--auth-tokens", tokens_flag_value, "--session-ttl", "2", NULL};
  start_server_full("2", flags, NULL); /* health needs no token */
}

TestSuite(c_client_tokens, .init = start_token_server, .fini = stop_server_and_pki, .timeout = 60);

static meshd_client_t *connect_token(const char *token) {
  meshd_connect_options_t o = MESHD_CONNECT_OPTIONS_INIT;
  o.token = token;
  o.timeout_ms = 10000;
  char why[512];
  meshd_err_t e;
  meshd_client_t *c = meshd_connect_with(target, &o, &e, why, sizeof why);
  cr_assert_not_null(c, "connect: %s: %s", meshd_strerror(e), why);
  return c;
}

/* The token travels on CreateSession, Execute, Fetch, ListSessions, ListAgents,
 * the keepalive thread's KeepAlive (the session idles past its 2 s lease) and
 * CloseSession; without it or with a wrong one every call is UNAUTHENTICATED. */
Test(c_client_tokens, every_call_carries_the_token) {
  meshd_client_t *c = connect_token(ALICE);
  meshd_err_t e;
  meshd_ref_t m = 0, x = 0, y = 0;
  meshd_session_t *s = open_on_two_gpus(c, "c-alice", &m);
  const char *dims[] = {"gpu"};
  int64_t at1[] = {1};
  cr_assert_eq(meshd_session_factory(s, m, "full", (int64_t[]){3}, 1, 2.0, &x), MESHD_E_OK);
  sleep_ms(3500); /* longer than the lease: only the keepalive thread keeps it */
  meshd_arg_t args[2] = {{.type = MESHD_ARG_REF, .ref = x}, {.type = MESHD_ARG_FLOAT, .f = 0.5}};
  cr_assert_eq(meshd_session_call(s, "add", args, 2, &y), MESHD_E_OK, "after idling: %s: %s",
               meshd_last_error(c)->kind, meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  meshd_values_t v;
  cr_assert_eq(meshd_session_fetch(s, y, dims, at1, 1, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(v.n, 3);
  cr_assert_float_eq(v.values[2], 2.5, 1e-9);
  meshd_values_free(&v);

  meshd_agent_t *agents = NULL;
  size_t n = 0;
  cr_assert_eq(meshd_agents(c, &agents, &n), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert_eq(n, 2);
  meshd_agents_free(agents, n);

  /* bob sees his sessions only: not alice's. */
  meshd_client_t *b = connect_token(BOB);
  meshd_session_info_t *list = NULL;
  cr_assert_eq(meshd_sessions(b, &list, &n), MESHD_E_OK, "%s", meshd_last_error(b)->message);
  for (size_t i = 0; i < n; i++)
    cr_assert_str_neq(list[i].client_name, "c-alice", "bob sees alice's session");
  meshd_sessions_free(list, n);
  cr_assert_eq(meshd_sessions(c, &list, &n), MESHD_E_OK);
  cr_assert_eq(n, 1);
  cr_assert_str_eq(list[0].client_name, "c-alice");
  meshd_sessions_free(list, n);
  meshd_close(b);
  meshd_session_close(s);
  meshd_close(c);

  static const char *const bad[] = {NULL, WRONG, ALICE "0", "ALICE-7F3E9A0C5D1B2468"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    meshd_client_t *u = connect_token(bad[i]);
    cr_assert_null(meshd_session_open(u, "c-nobody", &e));
    const meshd_error_info_t *info = meshd_last_error(u);
    cr_assert_eq(e, MESHD_E_RPC);
    cr_assert_str_eq(info->kind, "UNAUTHENTICATED", "%s: %s", info->kind, info->message);
    cr_assert_str_eq(info->grpc_code_name, "UNAUTHENTICATED");
    cr_assert(!bad[i] || !strstr(info->message, bad[i]), "the message shows the token");
    cr_assert_eq(meshd_sessions(u, &list, &n), MESHD_E_RPC);
    cr_assert_str_eq(meshd_last_error(u)->kind, "UNAUTHENTICATED");
    int status = -1;
    cr_assert_eq(meshd_health(u, "", &status), MESHD_E_OK, "health needs no token");
    meshd_close(u);
  }
}

/* TLS and tokens, 2 agents (they register on a plaintext loopback port of
 * their own, and speak plaintext). */
static void start_tls_server(void) {
  make_pki_and_tokens();
  static char cert[256], key[256];
  snprintf(cert, sizeof cert, "%s/server.pem", pki);
  snprintf(key, sizeof key, "%s/server.key", pki);
  const char *const flags[] = {"--tls-cert", cert, "--tls-key", key, "--auth-tokens",
                               tokens_flag_value, NULL};
  meshd_connect_options_t o = MESHD_CONNECT_OPTIONS_INIT;
  o.tls_ca_file = pki_file("ca.pem");
  start_server_full("2", flags, &o);
}

TestSuite(c_client_tls, .init = start_tls_server, .fini = stop_server_and_pki, .timeout = 60);

/* A client of the TLS server with alice's token; *o gets its options. */
static meshd_client_t *connect_tls_alice(meshd_connect_options_t *o) {
  *o = (meshd_connect_options_t)MESHD_CONNECT_OPTIONS_INIT;
  o->tls_ca_file = pki_file("ca.pem");
  o->token = ALICE;
  char why[512];
  meshd_err_t e;
  meshd_client_t *c = meshd_connect_with(target, o, &e, why, sizeof why);
  cr_assert_not_null(c, "connect: %s: %s", meshd_strerror(e), why);
  return c;
}

Test(c_client_tls, tls_with_a_token) {
  meshd_connect_options_t o;
  meshd_client_t *c = connect_tls_alice(&o);
  char why[512];
  meshd_err_t e;
  meshd_session_t *s = meshd_session_open(c, "c-tls", &e);
  cr_assert_not_null(s, "open: %s: %s", meshd_last_error(c)->kind, meshd_last_error(c)->message);
  /* Execute and Fetch get past the token check to their handlers. */
  meshd_ref_t m = 0;
  cr_assert_eq(meshd_session_create_mesh(s, (const char *[]){"gpu"}, (int64_t[]){3}, 1, &m),
               MESHD_E_RPC);
  cr_assert_str_eq(meshd_last_error(c)->kind, "BAD_ARGUMENT", "%s", meshd_last_error(c)->message);
  meshd_values_t v;
  cr_assert_eq(meshd_session_fetch(s, 7, NULL, NULL, 0, &v), MESHD_E_RPC);
  cr_assert_str_eq(meshd_last_error(c)->kind, "UNKNOWN_REF", "%s", meshd_last_error(c)->message);
  meshd_session_close(s);
  meshd_close(c);

  o.token = WRONG; /* TLS, the wrong token */
  c = meshd_connect_with(target, &o, &e, why, sizeof why);
  cr_assert_not_null(c, "%s", why);
  cr_assert_null(meshd_session_open(c, "c-tls", &e));
  cr_assert_str_eq(meshd_last_error(c)->kind, "UNAUTHENTICATED");
  meshd_close(c);

  /* Another CA, a name the certificate lacks, plaintext to a TLS port: no connection. */
  o.token = ALICE;
  o.timeout_ms = 1000;
  o.tls_ca_file = pki_file("rogue-ca.pem");
  cr_assert_eq(try_connect(target, o, why, sizeof why), MESHD_E_CONNECT, "%s", why);
  cr_assert(strstr(why, "with TLS"), "%s", why);
  o.tls_ca_file = pki_file("ca.pem");
  o.tls_server_name = "meshd.example";
  cr_assert_eq(try_connect(target, o, why, sizeof why), MESHD_E_CONNECT, "%s", why);
  o = (meshd_connect_options_t)MESHD_CONNECT_OPTIONS_INIT;
  o.token = ALICE;
  o.timeout_ms = 1000;
  cr_assert_eq(try_connect(target, o, why, sizeof why), MESHD_E_CONNECT, "%s", why);
  /* mTLS options against a server that does not ask for a certificate: fine. */
  o.tls_ca_file = pki_file("ca.pem");
  o.tls_cert_file = pki_file("client.pem");
  o.tls_key_file = pki_file("client.key");
  o.timeout_ms = 10000;
  cr_assert_eq(try_connect(target, o, why, sizeof why), MESHD_E_OK, "%s", why);
}

/* ------------------------------------------- loads from URLs */

static char load_dir[64], load_flag[128];

static void write_file(const char *name, const void *data, size_t n) {
  char path[256];
  snprintf(path, sizeof path, "%s/%s", load_dir, name);
  FILE *f = fopen(path, "wb");
  cr_assert_not_null(f, "%s", path);
  cr_assert_eq(fwrite(data, 1, n, f), n);
  fclose(f);
}

/* A .npy file (version 1.0) of float32 [2, 3] holding 0..5, and the same six
 * floats as raw bytes; a server whose agents may read file:// URLs there. */
static void start_load_server(void) {
  snprintf(load_dir, sizeof load_dir, "/tmp/meshd-c-load-XXXXXX");
  cr_assert_not_null(mkdtemp(load_dir));
  float v[6] = {0, 1, 2, 3, 4, 5};
  write_file("v.bin", v, sizeof v);
  char npy[128 + sizeof v];
  const char *dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  memcpy(npy, "\x93NUMPY\x01\x00\x76\x00", 10); /* header length 118: 10 + 118 = 128 */
  memset(npy + 10, ' ', 118);
  memcpy(npy + 10, dict, strlen(dict));
  npy[127] = '\n';
  memcpy(npy + 128, v, sizeof v);
  write_file("v.npy", npy, sizeof npy);
  snprintf(load_flag, sizeof load_flag, "--url-allow=file://%s,http://127.0.0.1", load_dir);
  /* --agent-timeout 30: tests here stop an agent (SIGSTOP) for about 3 s, which a
   * busy machine stretches past the default 3 s (then AGENT_LOST, not the test's
   * point: wait_load_looks_again_after_a_quota_answer failed so under ASan). */
  const char *const flags[] = {load_flag, "--agent-timeout", "30", NULL};
  start_server_with(flags);
}

static void stop_load_server(void) {
  stop_server();
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", load_dir);
  if (load_dir[0] && system(cmd) != 0)
    fprintf(stderr, "could not remove %s\n", load_dir);
}

TestSuite(c_client_load, .init = start_load_server, .fini = stop_load_server, .timeout = 60);

/* meshd_session_load: a .npy file's header gives dtype and shape; raw bytes
 * with a dtype and shape, sharded over the mesh; a URL outside the allow
 * list and a size mismatch fail with their kinds. */
Test(c_client_load, npy_raw_sharded_and_errors) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, a = 0, b = 0, bad = 0;
  meshd_session_t *s = open_on_two_gpus(c, "c-load", &m);
  const char *dims[] = {"gpu"};
  int64_t at0[] = {0}, at1[] = {1};
  char url[256];
  snprintf(url, sizeof url, "file://%s/v.npy", load_dir);
  cr_assert_eq(meshd_session_load(s, m, url, NULL, &a), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  meshd_values_t v;
  cr_assert_eq(meshd_session_fetch(s, a, dims, at1, 1, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(v.ndim, 2);
  cr_assert_eq(v.shape[0], 2);
  cr_assert_eq(v.shape[1], 3);
  for (size_t i = 0; i < 6; i++)
    cr_assert_float_eq(v.values[i], (double)i, 1e-9);
  meshd_values_free(&v);

  int64_t shape[] = {6};
  meshd_load_options_t o = {.dtype = "float32", .shape = shape, .ndim = 1, .shard = "gpu"};
  snprintf(url, sizeof url, "file://%s/v.bin", load_dir);
  cr_assert_eq(meshd_session_load(s, m, url, &o, &b), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_fetch(s, b, dims, at1, 1, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(v.n, 3);
  for (size_t i = 0; i < 3; i++)
    cr_assert_float_eq(v.values[i], 3.0 + (double)i, 1e-9);
  meshd_values_free(&v);

  cr_assert_eq(meshd_session_load(s, m, "file:///etc/passwd", &o, &bad), MESHD_E_RPC);
  cr_assert_str_eq(meshd_last_error(c)->kind, "PERMISSION_DENIED", "%s",
                   meshd_last_error(c)->message);
  int64_t wrong[] = {8};
  o.shape = wrong;
  o.shard = NULL;
  cr_assert_eq(meshd_session_load(s, m, url, &o, &bad), MESHD_E_OK);
  cr_assert_eq(meshd_session_fetch(s, bad, dims, at0, 1, &v), MESHD_E_RPC);
  cr_assert(strstr(meshd_last_error(c)->message, "24 bytes") != NULL, "%s",
            meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_RPC); /* the failure, reported once */
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  meshd_session_close(s);
  meshd_close(c);
}

/* Raw bytes (dtype and shape) with a name: refused, as Python and Node refuse
 * it, not loaded as the whole file with the name ignored (review-117). */
Test(c_client_load, a_name_with_raw_bytes_is_refused) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, t = 0;
  meshd_session_t *s = open_on_two_gpus(c, "c-load-name", &m);
  int64_t shape[] = {6};
  char url[256];
  snprintf(url, sizeof url, "file://%s/v.bin", load_dir);
  meshd_load_options_t o = {.dtype = "float32", .shape = shape, .ndim = 1, .name = "w"};
  cr_assert_eq(meshd_session_load(s, m, url, &o, &t), MESHD_E_INVALID, "%s",
               meshd_last_error(c)->message);
  cr_assert(strstr(meshd_last_error(c)->message, "name") != NULL, "%s",
            meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  meshd_session_close(s);
  meshd_close(c);
}

/* tests/support/range_http_server.py as a process (range_server_stop(pid,
 * *stdin_fd) ends it), whose URLs start with base. */
static pid_t start_range_server(int *stdin_fd, char *base, size_t len) {
  pid_t pid = -1;
  char why[1200];
  int port = range_server_start(&pid, stdin_fd, why, sizeof why);
  cr_assert_gt(port, 0, "%s", why);
  snprintf(base, len, "http://127.0.0.1:%d", port);
  return pid;
}

/* Rank 1's first op call runs 3 s (so rank 0 is done with a load issued after it
 * before rank 1 starts it); otherwise c_client_load's server. */
static void start_load_server_rank1_slow(void) {
  setenv("MESHD_FAULT", "call:slow=3000,rank=1,count=1", 1); /* the local agents inherit it */
  start_load_server();
  unsetenv("MESHD_FAULT");
}

TestSuite(c_client_load_pin, .init = start_load_server_rank1_slow, .fini = stop_load_server,
          .timeout = 60);

/* A raw load (dtype and shape) of a file rewritten between two ranks' requests:
 * rank 1 first runs a 3 s op, so rank 0 has read the file (whose first GET after
 * one HEAD turns it into version 2, other bytes) before rank 1 asks for it. Each
 * rank checked only its own request: rank 0 held version 1, rank 1 version 2, and
 * no error said so. Pinned (InspectUrl size_only before the load, as Python's
 * meshd.load), both ranks hold one version, or the load fails saying the file
 * changed. A URL the inspection cannot read still loads unpinned and fails on the
 * ranks, the last error left as it was. */
Test(c_client_load_pin, a_raw_load_pins_one_version_across_ranks) {
  int srv_in = -1;
  char base[64], url[256];
  pid_t srv = start_range_server(&srv_in, base, sizeof base);
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, x = 0, y = 0, t = 0;
  meshd_session_t *s = open_on_two_gpus(c, "c-load-pin", &m);
  const char *dims[] = {"gpu"};
  int64_t four[] = {4}, n[] = {4096};
  cr_assert_eq(meshd_session_factory(s, m, "zeros", four, 1, 0, &x), MESHD_E_OK);
  meshd_arg_t args[2] = {{.type = MESHD_ARG_REF, .ref = x}, {.type = MESHD_ARG_FLOAT, .f = 3}};
  cr_assert_eq(meshd_session_call(s, "mul", args, 2, &y), MESHD_E_OK, "%s", /* 3 s on rank 1 */
               meshd_last_error(c)->message);
  snprintf(url, sizeof url, "%s/versioned/raw/etag/1/%lld", base, (long long)n[0]);
  meshd_load_options_t o = {.dtype = "uint8", .shape = n, .ndim = 1};
  cr_assert_eq(meshd_session_load(s, m, url, &o, &t), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  meshd_values_t v[2] = {{0}};
  meshd_err_t rc = MESHD_E_OK;
  for (int64_t g = 0; g < 2 && rc == MESHD_E_OK; g++)
    rc = meshd_session_fetch(s, t, dims, &g, 1, &v[g]);
  if (rc != MESHD_E_OK) {
    cr_assert(strstr(meshd_last_error(c)->message, "changed"), "%s",
              meshd_last_error(c)->message);
  } else {
    cr_assert_eq(v[0].n, (size_t)n[0]);
    cr_assert_eq(v[1].n, (size_t)n[0]);
    cr_assert(memcmp(v[0].values, v[1].values, v[0].n * sizeof *v[0].values) == 0,
              "rank 0 and rank 1 loaded different versions of one file with no error");
  }
  meshd_values_free(&v[0]);
  meshd_values_free(&v[1]);
  range_server_stop(srv, srv_in);

  /* nothing listens there: the inspection fails, the load goes unpinned */
  if (rc != MESHD_E_OK) /* the failed load, reported once */
    cr_assert_eq(meshd_session_sync(s), MESHD_E_RPC);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  const meshd_error_info_t *before = meshd_last_error(c);
  meshd_err_t err = before->err;
  char was[256];
  snprintf(was, sizeof was, "%s", before->message);
  snprintf(url, sizeof url, "%s/gone.bin", base);
  cr_assert_eq(meshd_session_load(s, m, url, &o, &t), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(meshd_last_error(c)->err, err);
  cr_assert_str_eq(meshd_last_error(c)->message, was);
  int64_t at1[] = {1};
  cr_assert_eq(meshd_session_fetch(s, t, dims, at1, 1, &v[0]), MESHD_E_RPC);
  cr_assert(strstr(meshd_last_error(c)->message, "gone.bin") &&
                strstr(meshd_last_error(c)->message, "rank"),
            "%s", meshd_last_error(c)->message);
  meshd_session_close(s);
  meshd_close(c);
}

/* A session of its own polling LoadProgress until *stop (each look takes the
 * server's 2 s deadline while an agent is stopped: it holds a helper slot). */
typedef struct {
  meshd_client_t *c;
  meshd_session_t *s;
  meshd_ref_t t;
  atomic_int *stop;
} poller_t;

static void *poll_progress(void *arg) {
  poller_t *p = arg;
  meshd_load_progress_t out;
  while (!atomic_load(p->stop))
    if (meshd_session_load_progress(p->s, &p->t, 1, &out) != MESHD_E_OK)
      sleep_ms(5);
  return NULL;
}

typedef struct {
  atomic_int *stop;
  pid_t agent;
} release_t;

static void *release_later(void *arg) {
  release_t *r = arg;
  sleep_ms(2500);
  atomic_store(r->stop, 1);
  kill(r->agent, SIGCONT);
  return NULL;
}

#define POLLERS 64 /* the server's LoadProgress slots (LOAD_PROGRESS_MAX) */

/* LoadProgress answered QUOTA (every helper slot of the server busy with other
 * sessions' looks at a stopped agent): meshd_session_wait_load looks again, as
 * Python's poller does, instead of failing MESHD_E_RPC at once (review-117). */
Test(c_client_load, wait_load_looks_again_after_a_quota_answer, .timeout = 120) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, t = 0;
  meshd_session_t *s = open_on_two_gpus(c, "c-load-quota", &m);
  int64_t shape[] = {6};
  /* the pollers' loads do not end within the test (4 KiB sent at 10 bytes a second;
   * its HEAD answers at once, so a raw load's version inspection does not wait): every
   * look asks the agents, and waits 2 s for the stopped one */
  int rs_in = -1;
  char base[64], stuck[128], url[256];
  pid_t rs = start_range_server(&rs_in, base, sizeof base);
  snprintf(stuck, sizeof stuck, "%s/drip/1/4096", base);
  int64_t floats1k[] = {1024};
  meshd_load_options_t o = {.dtype = "float32", .shape = shape, .ndim = 1};
  meshd_load_options_t po = {.dtype = "float32", .shape = floats1k, .ndim = 1};
  atomic_int stop = 0;
  static poller_t pl[POLLERS];
  pthread_t th[POLLERS];
  for (int i = 0; i < POLLERS; i++) {
    pl[i] = (poller_t){connect_ok(), NULL, 0, &stop};
    meshd_ref_t pm = 0;
    pl[i].s = open_on_two_gpus(pl[i].c, "c-load-quota-poller", &pm);
    cr_assert_eq(meshd_session_load(pl[i].s, pm, stuck, &po, &pl[i].t), MESHD_E_OK);
  }
  pid_t agent = agent_pid(1);
  cr_assert_gt(agent, 0);
  stop_agent(agent);
  /* the waited load: in once the agent goes on */
  snprintf(url, sizeof url, "file://%s/v.bin", load_dir);
  cr_assert_eq(meshd_session_load(s, m, url, &o, &t), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  for (int i = 0; i < POLLERS; i++)
    cr_assert_eq(pthread_create(&th[i], NULL, poll_progress, &pl[i]), 0);
  sleep_ms(500); /* every slot taken */
  release_t r = {&stop, agent};
  pthread_t rel;
  cr_assert_eq(pthread_create(&rel, NULL, release_later, &r), 0);
  meshd_wait_load_options_t w = MESHD_WAIT_LOAD_OPTIONS_INIT;
  w.timeout_ms = 30000;
  w.interval_ms = 20;
  meshd_err_t rc = meshd_session_wait_load(s, &t, 1, &w);
  char msg[512];
  snprintf(msg, sizeof msg, "%s %s", meshd_last_error(c)->kind, meshd_last_error(c)->message);
  pthread_join(rel, NULL);
  stopped_agent = -1;
  for (int i = 0; i < POLLERS; i++) {
    pthread_join(th[i], NULL);
    meshd_session_close(pl[i].s);
    meshd_close(pl[i].c);
  }
  range_server_stop(rs, rs_in);
  cr_assert_eq(rc, MESHD_E_OK, "%s: %s", meshd_strerror(rc), msg);
  meshd_session_close(s);
  meshd_close(c);
}

/* A negative dim counts from the end, as Python's meshd.load takes it: the
 * .npy file's (2, 3) split along dim -2 (its rows), raw bytes (6) along -1. */
Test(c_client_load, a_negative_dim_counts_from_the_end) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, a = 0, b = 0;
  meshd_session_t *s = open_on_two_gpus(c, "c-load-negative-dim", &m);
  const char *dims[] = {"gpu"};
  int64_t at1[] = {1};
  char url[256];
  snprintf(url, sizeof url, "file://%s/v.npy", load_dir);
  meshd_load_options_t o = {.shard = "gpu", .dim = -2};
  cr_assert_eq(meshd_session_load(s, m, url, &o, &a), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  meshd_values_t v;
  cr_assert_eq(meshd_session_fetch(s, a, dims, at1, 1, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(v.n, 3);
  for (size_t i = 0; i < 3; i++)
    cr_assert_float_eq(v.values[i], 3.0 + (double)i, 1e-9);
  meshd_values_free(&v);
  int64_t shape[] = {6};
  meshd_load_options_t r = {.dtype = "float32", .shape = shape, .ndim = 1, .shard = "gpu",
                            .dim = -1};
  snprintf(url, sizeof url, "file://%s/v.bin", load_dir);
  cr_assert_eq(meshd_session_load(s, m, url, &r, &b), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_fetch(s, b, dims, at1, 1, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(v.n, 3);
  for (size_t i = 0; i < 3; i++)
    cr_assert_float_eq(v.values[i], 3.0 + (double)i, 1e-9);
  meshd_values_free(&v);
  meshd_session_close(s);
  meshd_close(c);
}

/* A safetensors file from its spec: the header's length (8 bytes, little
 * endian), the header, the data. */
static void write_safetensors(const char *name, const char *header, const uint8_t *data,
                              size_t n) {
  size_t hn = strlen(header);
  uint8_t *b = malloc(8 + hn + n);
  cr_assert_not_null(b);
  for (int i = 0; i < 8; i++) b[i] = (uint8_t)(hn >> (8 * i));
  memcpy(b + 8, header, hn);
  memcpy(b + 8 + hn, data, n);
  write_file(name, b, 8 + hn + n);
  free(b);
}

/* meshd_session_load through a checkpoint's safetensors index: the named
 * tensor comes from the file the index names (relative to it, the index's
 * query dropped); a name the index lacks, and an index that puts a tensor in a
 * file without it, fail with MESHD_E_INVALID naming the URLs. */
Test(c_client_load, a_tensor_through_a_safetensors_index) {
  /* shard-2.safetensors: "w" uint8 [2, 2] = 1..4, after a space-padded header. */
  const uint8_t w[4] = {1, 2, 3, 4};
  write_safetensors("shard-2.safetensors",
                    "{\"w\":{\"dtype\":\"U8\",\"shape\":[2,2],\"data_offsets\":[0,4]}}   ", w, 4);
  static const char index[] =
      "{\"metadata\": {\"total_size\": 4},\n \"weight_map\": {\"w\": \"shard-2.safetensors\", "
      "\"gone\": \"shard-2.safetensors\"}}\n";
  write_file("model.safetensors.index.json", index, strlen(index));

  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, t = 0, bad = 0;
  meshd_session_t *s = open_on_two_gpus(c, "c-load-index", &m);
  const char *dims[] = {"gpu"};
  int64_t at1[] = {1};
  char url[256];
  snprintf(url, sizeof url, "file://%s/model.safetensors.index.json?sig=x", load_dir);
  meshd_load_info_t info;
  meshd_load_options_t o = {.name = "w", .info = &info};
  cr_assert_eq(meshd_session_load(s, m, url, &o, &t), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_str_eq(info.dtype, "uint8");
  cr_assert_eq(info.ndim, 2);
  meshd_values_t v;
  cr_assert_eq(meshd_session_fetch(s, t, dims, at1, 1, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(v.n, 4);
  for (size_t i = 0; i < 4; i++)
    cr_assert_float_eq(v.values[i], (double)w[i], 1e-9);
  meshd_values_free(&v);

  o.name = "missing";
  cr_assert_eq(meshd_session_load(s, m, url, &o, &bad), MESHD_E_INVALID);
  cr_assert(strstr(meshd_last_error(c)->message, "no tensor named 'missing' in file://"),
            "%s", meshd_last_error(c)->message);
  o.name = "gone";
  cr_assert_eq(meshd_session_load(s, m, url, &o, &bad), MESHD_E_INVALID);
  cr_assert(strstr(meshd_last_error(c)->message, "puts 'gone' in file://") &&
                strstr(meshd_last_error(c)->message, "shard-2.safetensors, which is a file "
                                                      "without it"),
            "%s", meshd_last_error(c)->message);
  o.name = NULL; /* two tensors: name one */
  cr_assert_eq(meshd_session_load(s, m, url, &o, &bad), MESHD_E_INVALID);
  cr_assert(strstr(meshd_last_error(c)->message, "holds 2 tensors"), "%s",
            meshd_last_error(c)->message);
  /* An index of one tensor needs no name, though its file holds two. */
  const uint8_t vw[5] = {9, 1, 2, 3, 4};
  write_safetensors("both.safetensors",
                    "{\"v\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                    "\"w\":{\"dtype\":\"U8\",\"shape\":[2,2],\"data_offsets\":[1,5]}}", vw, 5);
  static const char one[] = "{\"weight_map\": {\"w\": \"both.safetensors\"}}";
  write_file("one.index.json", one, strlen(one));
  snprintf(url, sizeof url, "file://%s/one.index.json", load_dir);
  cr_assert_eq(meshd_session_load(s, m, url, &o, &t), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_fetch(s, t, dims, at1, 1, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(v.n, 4);
  for (size_t i = 0; i < 4; i++)
    cr_assert_float_eq(v.values[i], (double)w[i], 1e-9);
  meshd_values_free(&v);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  meshd_session_close(s);
  meshd_close(c);
}

/* What meshd_session_wait_load's progress callback saw. */
typedef struct seen_progress {
  int calls;
  uint64_t done, total; /* the last call's */
  bool backwards;       /* done went down, or total changed */
} seen_progress_t;

static void note_progress(void *user, uint64_t done, uint64_t total) {
  seen_progress_t *p = user;
  if (p->calls && (done < p->done || total != p->total))
    p->backwards = true;
  p->calls++;
  p->done = done;
  p->total = total;
}

/* Commands the session `name` had accepted (ListSessions). */
static uint64_t session_commands(meshd_client_t *c, const char *name) {
  meshd_session_info_t *list = NULL;
  size_t n = 0;
  cr_assert_eq(meshd_sessions(c, &list, &n), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  uint64_t commands = UINT64_MAX;
  for (size_t i = 0; i < n; i++)
    if (strcmp(list[i].client_name, name) == 0)
      commands = list[i].commands;
  meshd_sessions_free(list, n);
  cr_assert_neq(commands, UINT64_MAX, "no session named %s", name);
  return commands;
}

/* A load's info (dtype, local shape, bytes), its progress while meshd_session_wait_load
 * waits and once it is in, a failed load failing the wait with the agent's error, a
 * wait on a load that never ends sending no command (no Sync per look), and what the
 * progress calls refuse. */
Test(c_client_load, info_progress_and_wait) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, a = 0, b = 0, bad = 0;
  meshd_session_t *s = open_on_two_gpus(c, "c-load-progress", &m);
  char url[256];
  meshd_load_info_t info;
  memset(&info, 0x5a, sizeof info);
  meshd_load_options_t o = {.info = &info};
  snprintf(url, sizeof url, "file://%s/v.npy", load_dir);
  cr_assert_eq(meshd_session_load(s, m, url, &o, &a), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_str_eq(info.dtype, "float32");
  cr_assert_eq(info.ndim, 2);
  cr_assert_eq(info.shape[0], 2);
  cr_assert_eq(info.shape[1], 3);
  cr_assert_eq(info.bytes, 24);

  seen_progress_t seen = {0};
  meshd_wait_load_options_t w = MESHD_WAIT_LOAD_OPTIONS_INIT;
  w.progress = note_progress;
  w.progress_user = &seen;
  cr_assert_eq(meshd_session_wait_load(s, &a, 1, &w), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_geq(seen.calls, 2, "once at the start, once at the end");
  cr_assert_eq(seen.total, 48, "24 bytes on each of 2 ranks");
  cr_assert_eq(seen.done, 48);
  cr_assert(!seen.backwards);

  /* raw bytes sharded: each rank holds 3 floats; both loads looked at in one call */
  int64_t six[] = {6};
  meshd_load_options_t raw = {.dtype = "float32", .shape = six, .ndim = 1, .shard = "gpu",
                              .info = &info};
  snprintf(url, sizeof url, "file://%s/v.bin", load_dir);
  cr_assert_eq(meshd_session_load(s, m, url, &raw, &b), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(info.ndim, 1);
  cr_assert_eq(info.shape[0], 3);
  cr_assert_eq(info.bytes, 12);
  cr_assert_eq(meshd_session_wait_load(s, &b, 1, NULL), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  meshd_ref_t both[] = {a, b};
  meshd_load_progress_t p[2];
  cr_assert_eq(meshd_session_load_progress(s, both, 2, p), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(p[0].ref, a);
  cr_assert_eq(p[0].done_bytes, 48);
  cr_assert_eq(p[0].total_bytes, 48);
  cr_assert_eq(p[1].ref, b);
  cr_assert_eq(p[1].done_bytes, 24);
  cr_assert_eq(p[1].total_bytes, 24);
  cr_assert(!p[0].failed && !p[1].failed);

  /* 8 floats asked of a 24-byte file: the wait fails with the agents' error, once */
  int64_t eight[] = {8};
  raw.shape = eight;
  raw.shard = NULL;
  cr_assert_eq(meshd_session_load(s, m, url, &raw, &bad), MESHD_E_OK);
  seen = (seen_progress_t){0};
  cr_assert_eq(meshd_session_wait_load(s, &bad, 1, &w), MESHD_E_RPC);
  const meshd_error_info_t *e = meshd_last_error(c);
  cr_assert_str_eq(e->kind, "BAD_ARGUMENT", "%s", e->message);
  cr_assert(strstr(e->message, url) && strstr(e->message, "24 bytes") &&
                strstr(e->message, "rank"), "%s", e->message);
  cr_assert(seen.calls >= 1 && seen.total == 64 && seen.done < 64, "%d calls, %lu of %lu",
            seen.calls, (unsigned long)seen.done, (unsigned long)seen.total);
  cr_assert_eq(meshd_session_load_progress(s, &bad, 1, p), MESHD_E_OK);
  cr_assert(p[0].failed);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "reported once: %s", e->message);

  /* A load that does not end within the test (4 KiB sent at 10 bytes a second; its
   * HEAD answers at once, so the version inspection does not wait): the
   * wait looks at the progress only, so the session's command count (Syncs included)
   * stays where it was however long the wait, and the wait ends at its timeout. */
  int rs_in = -1;
  char base[64];
  pid_t rs = start_range_server(&rs_in, base, sizeof base);
  snprintf(url, sizeof url, "%s/drip/1/4096", base); /* 10 bytes a second */
  int64_t floats1k[] = {1024};
  raw.shape = floats1k;
  meshd_ref_t stuck = 0;
  cr_assert_eq(meshd_session_load(s, m, url, &raw, &stuck), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  uint64_t before = session_commands(c, "c-load-progress");
  meshd_wait_load_options_t slow = MESHD_WAIT_LOAD_OPTIONS_INIT;
  slow.timeout_ms = 1500;
  slow.interval_ms = 50;
  slow.progress = note_progress;
  slow.progress_user = &seen;
  seen = (seen_progress_t){0};
  cr_assert_eq(meshd_session_wait_load(s, &stuck, 1, &slow), MESHD_E_DEADLINE, "%s",
               meshd_last_error(c)->message);
  cr_assert(strstr(meshd_last_error(c)->message, "after 1500 ms"), "%s",
            meshd_last_error(c)->message);
  cr_assert_geq(seen.calls, 10, "a look every 50 ms for 1.5 s: %d", seen.calls);
  cr_assert_eq(session_commands(c, "c-load-progress"), before,
               "the wait sent commands (a Sync per look?)");
  static volatile sig_atomic_t stop = 1; /* as a SIGINT handler would set it */
  slow.stop = &stop;
  cr_assert_eq(meshd_session_wait_load(s, &stuck, 1, &slow), MESHD_E_CANCELLED);
  cr_assert_eq(meshd_last_error(c)->err, MESHD_E_CANCELLED);
  cr_assert(strstr(meshd_last_error(c)->message, "stopped by the caller"), "%s",
            meshd_last_error(c)->message);
  cr_assert_str_eq(meshd_strerror(MESHD_E_CANCELLED), "stopped by the caller");
  range_server_stop(rs, rs_in); /* the agents' requests are reset: the load fails */

  /* refusals: no refs, a ref the session lacks, a name a .npy file has not */
  cr_assert_eq(meshd_session_wait_load(s, NULL, 1, NULL), MESHD_E_INVALID);
  cr_assert(strstr(meshd_last_error(c)->message, "need at least one ref"));
  cr_assert_eq(meshd_session_load_progress(s, &a, 0, p), MESHD_E_INVALID);
  cr_assert_eq(meshd_session_load_progress(s, &a, 1, NULL), MESHD_E_INVALID);
  meshd_ref_t nowhere = 4242;
  cr_assert_eq(meshd_session_wait_load(s, &nowhere, 1, NULL), MESHD_E_RPC);
  cr_assert_str_eq(meshd_last_error(c)->kind, "UNKNOWN_REF", "%s", meshd_last_error(c)->message);
  snprintf(url, sizeof url, "file://%s/v.npy", load_dir);
  o.name = "w";
  cr_assert_eq(meshd_session_load(s, m, url, &o, &bad), MESHD_E_INVALID);
  cr_assert(strstr(meshd_last_error(c)->message, url) &&
                strstr(meshd_last_error(c)->message, ".npy file"),
            "%s", meshd_last_error(c)->message);
  meshd_session_close(s);
  meshd_close(c);
}

/* ------------------------------------------- the data path: direct and proxy */

/* n bytes that differ with position and seed. */
static void fill(uint8_t *p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++)
    p[i] = (uint8_t)(((uint32_t)i * 2654435761u + seed * 40503u) >> 13);
}

static meshd_transfer_stats_t stats_of(meshd_session_t *s) {
  meshd_transfer_stats_t st;
  cr_assert_eq(meshd_session_transfer_stats(s, &st), MESHD_E_OK);
  return st;
}

/* A per_rank uint8 upload of `each` bytes per rank onto mesh m (gpu=2), both
 * ranks fetched at once into buffers of their own, compared byte for byte.
 * Returns MESHD_E_OK, or the upload's or the fetch's failure. */
static meshd_err_t round_trip(meshd_session_t *s, meshd_ref_t m, size_t each, unsigned seed) {
  uint8_t *data = malloc(2 * each), *back0 = malloc(each), *back1 = malloc(each);
  cr_assert(data && back0 && back1);
  fill(data, 2 * each, seed);
  meshd_upload_options_t o = MESHD_UPLOAD_OPTIONS_INIT;
  o.per_rank = true;
  int64_t shape[] = {(int64_t)each};
  meshd_ref_t t = 0;
  const char *dims[] = {"gpu"};
  int64_t r0[] = {0}, r1[] = {1};
  meshd_fetch_part_t parts[2] = {{dims, r0, 1, back0, each, 0}, {dims, r1, 1, back1, each, 0}};
  meshd_err_t e = meshd_session_upload_with(s, m, "uint8", shape, 1, data, 2 * each, &o, &t);
  if (e == MESHD_E_OK) {
    e = meshd_session_fetch_bytes(s, t, parts, 2, NULL);
  }
  if (e == MESHD_E_OK) {
    cr_assert_eq(parts[0].nbytes, each);
    cr_assert_eq(parts[1].nbytes, each);
    cr_assert(memcmp(back0, data, each) == 0, "rank 0's bytes differ");
    cr_assert(memcmp(back1, data + each, each) == 0, "rank 1's bytes differ");
  }
  free(data);
  free(back0);
  free(back1);
  return e;
}

static meshd_session_t *session_on_mesh(meshd_client_t *c, meshd_ref_t *m) {
  meshd_session_t *s = meshd_session_open(c, "c-data-path", NULL);
  cr_assert_not_null(s);
  const char *dims[] = {"gpu"};
  int64_t sizes[] = {2};
  cr_assert_eq(meshd_session_create_mesh(s, dims, sizes, 1, m), MESHD_E_OK);
  return s;
}

/* A session on a {gpu: 2} mesh (*m) with the direct data path, whose
 * channels to both agents are open (one round trip): before an agent stops. */
static meshd_session_t *direct_session_with_channels(meshd_client_t *c, meshd_ref_t *m) {
  meshd_session_t *s = session_on_mesh(c, m);
  cr_assert_eq(meshd_session_set_data_path(s, MESHD_DATA_PATH_DIRECT), MESHD_E_OK);
  cr_assert_eq(round_trip(s, *m, 1000, 3), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  return s;
}

/* A per-rank upload of 2 x 48 MiB (far past what the sockets and windows
 * buffer) while the agent of rank `stopped` is SIGSTOPped; continued after.
 * Its result, *took its ms; the buffer is freed at once after it returns. */
static meshd_err_t upload_to_a_stopped_agent(meshd_session_t *s, meshd_ref_t m, int stopped,
                                             unsigned seed, int64_t *took) {
  pid_t pid = agent_pid(stopped);
  cr_assert_gt(pid, 0, "no rank-%d agent child of meshd %d", stopped, (int)server_pid);
  stop_agent(pid);
  size_t each = 48u << 20;
  uint8_t *data = malloc(2 * each);
  cr_assert_not_null(data);
  fill(data, 2 * each, seed);
  meshd_upload_options_t o = MESHD_UPLOAD_OPTIONS_INIT;
  o.per_rank = true;
  int64_t shape[] = {(int64_t)each};
  meshd_ref_t t = 0;
  int64_t t0 = now_ms();
  meshd_err_t rc = meshd_session_upload_with(s, m, "uint8", shape, 1, data, 2 * each, &o, &t);
  *took = now_ms() - t0;
  free(data);
  kill(pid, SIGCONT);
  stopped_agent = -1;
  return rc;
}

/* A direct upload's messages reference the caller's buffer. To an agent that
 * stops reading mid-transfer (SIGSTOPped), the upload ends by the client's
 * deadline, and returns only once gRPC let go of those messages (the
 * connection to that agent is closed if need be): the buffer is freed at once
 * after, which ASan would catch if anything still read it. A send that the
 * agent's flow control held outlived the deadline and a cancel in gRPC 1.51:
 * the client's pings to the agent end it. */
Test(c_client, a_direct_upload_to_an_agent_that_stops_reading_lets_go_of_the_buffer) {
  meshd_err_t e;
  meshd_client_t *c = meshd_connect(target, 3000, &e);
  cr_assert_not_null(c, "connect: %s", meshd_strerror(e));
  meshd_ref_t m = 0;
  meshd_session_t *s = direct_session_with_channels(c, &m);
  int64_t took = 0;
  meshd_err_t rc = upload_to_a_stopped_agent(s, m, 1, 5, &took);
  cr_assert_neq(rc, MESHD_E_OK, "an upload to a stopped agent succeeded");
  const char *msg = meshd_last_error(c)->message;
  cr_assert(strstr(msg, "rank 1"), "%s", msg);
  cr_assert_lt(took, 12000, "the upload took %lld ms (deadline 3000 ms): %s", (long long)took,
               msg);
  meshd_session_close(s);
  meshd_close(c);
}

/* The default server (--data-path=auto): DIRECT moves a sharded tensor straight
 * between the buffers and both agents (2 MiB a rank: several messages each way),
 * PROXY through the server, AUTO takes the direct path here; a directly
 * uploaded tensor computes and fetches as values; bad arguments are named. */
Test(c_client, data_paths_direct_proxy_auto) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0;
  meshd_session_t *s = session_on_mesh(c, &m);
  size_t each = (2u << 20) + 12;

  cr_assert_eq(meshd_session_set_data_path(s, MESHD_DATA_PATH_DIRECT), MESHD_E_OK);
  cr_assert_eq(round_trip(s, m, each, 1), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  meshd_transfer_stats_t st = stats_of(s);
  cr_assert_eq(st.direct_uploads, 1);
  cr_assert_eq(st.direct_fetches, 2);
  cr_assert_eq(st.proxy_uploads + st.proxy_fetches + st.fallbacks, 0);

  /* replicated, computed on the agents, fetched as values (direct) */
  float x[6] = {0, 1, 2, 3, 4, 5};
  int64_t shape[] = {2, 3};
  meshd_ref_t t = 0, y = 0;
  cr_assert_eq(meshd_session_upload(s, m, "float32", shape, 2, x, sizeof x, &t), MESHD_E_OK,
               "%s", meshd_last_error(c)->message);
  meshd_arg_t args[2] = {{.type = MESHD_ARG_REF, .ref = t}, {.type = MESHD_ARG_FLOAT, .f = 0.5}};
  cr_assert_eq(meshd_session_call(s, "add", args, 2, &y), MESHD_E_OK);
  const char *dims[] = {"gpu"};
  int64_t at1[] = {1};
  meshd_values_t v;
  cr_assert_eq(meshd_session_fetch(s, y, dims, at1, 1, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(v.n, 6);
  cr_assert_eq(v.ndim, 2);
  for (int i = 0; i < 6; i++)
    cr_assert_float_eq(v.values[i], i + 0.5, 1e-9);
  meshd_values_free(&v);
  st = stats_of(s);
  cr_assert_eq(st.direct_uploads, 2);
  cr_assert_eq(st.direct_fetches, 3);

  cr_assert_eq(meshd_session_set_data_path(s, MESHD_DATA_PATH_PROXY), MESHD_E_OK);
  cr_assert_eq(round_trip(s, m, each, 2), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  st = stats_of(s);
  cr_assert_eq(st.proxy_uploads, 1);
  cr_assert_eq(st.proxy_fetches, 2);
  cr_assert_eq(st.direct_uploads, 2);

  cr_assert_eq(meshd_session_set_data_path(s, MESHD_DATA_PATH_AUTO), MESHD_E_OK);
  cr_assert_eq(round_trip(s, m, 4096, 3), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  st = stats_of(s);
  cr_assert_eq(st.direct_uploads, 3, "auto: %s", st.last_fallback);
  cr_assert_eq(st.fallbacks, 0, "%s", st.last_fallback);

  /* a buffer too small is named, on either path */
  uint8_t small[8];
  int64_t at0[] = {0};
  meshd_fetch_part_t part = {dims, at0, 1, small, sizeof small, 0};
  cr_assert_eq(meshd_session_fetch_bytes(s, t, &part, 1, NULL), MESHD_E_INVALID);
  cr_assert(strstr(meshd_last_error(c)->message, "24 bytes, its buffer holds 8"), "%s",
            meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_set_data_path(s, (meshd_data_path_t)7), MESHD_E_INVALID);
  cr_assert(strstr(meshd_last_error(c)->message, "not a data path"));
  meshd_data_path_t p;
  cr_assert_eq(meshd_data_path_parse("direct", &p), MESHD_E_OK);
  cr_assert_eq(p, MESHD_DATA_PATH_DIRECT);
  cr_assert_eq(meshd_data_path_parse("fast", &p), MESHD_E_INVALID);
  cr_assert_str_eq(meshd_data_path_name(MESHD_DATA_PATH_PROXY), "proxy");

  /* still usable: more transfers than --session-max-transfers (8) ran, so
   * every one gave its slot back */
  cr_assert_eq(round_trip(s, m, 64, 10), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  meshd_session_close(s);
  meshd_close(c);
}

/* Agents that remember one transfer grant at a time (--max-transfer-nonces 1,
 * each until its start-by time, 60 s): after one direct transfer, an agent
 * refuses the next's Read or Write RESOURCE_EXHAUSTED before any byte moves. */
static void start_server_one_nonce(void) {
  setenv("MESHD_MAX_TRANSFER_NONCES", "1", 1); /* the local agents inherit it */
  start_server();
  unsetenv("MESHD_MAX_TRANSFER_NONCES");
}

TestSuite(c_client_nonces, .init = start_server_one_nonce, .fini = stop_server, .timeout = 60);

/* An agent whose grant table is full: auto takes the proxy for that transfer (a
 * fetch whose other part was read directly already starts that part over), direct
 * fails saying the agent (rank, address) has too many direct transfers in flight.
 * Both failed before with the agent's bare refusal. */
Test(c_client_nonces, a_full_grant_table_falls_back_on_auto_and_is_named_on_direct) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, one = 0, a = 0, b = 0, t = 0;
  meshd_session_t *s = session_on_mesh(c, &m);
  const char *dims[] = {"gpu"};
  int64_t at0[] = {0}, at1[] = {1}, three[] = {3};
  cr_assert_eq(meshd_session_slice_mesh(s, m, dims, at1, 1, &one), MESHD_E_OK);
  cr_assert_eq(meshd_session_factory(s, m, "full", three, 1, 2.5, &a), MESHD_E_OK);
  float x[3] = {1, 2, 3};
  cr_assert_eq(meshd_session_set_data_path(s, MESHD_DATA_PATH_DIRECT), MESHD_E_OK);
  cr_assert_eq(meshd_session_upload(s, one, "float32", three, 1, x, sizeof x, &b), MESHD_E_OK,
               "%s", meshd_last_error(c)->message); /* rank 1's table is full now */

  /* auto: rank 0's part is read directly, rank 1's refused; both through the server */
  cr_assert_eq(meshd_session_set_data_path(s, MESHD_DATA_PATH_AUTO), MESHD_E_OK);
  float p0[3] = {0}, p1[3] = {0};
  meshd_fetch_part_t parts[2] = {{dims, at0, 1, p0, sizeof p0, 0},
                                 {dims, at1, 1, p1, sizeof p1, 0}};
  cr_assert_eq(meshd_session_fetch_bytes(s, a, parts, 2, NULL), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(parts[0].nbytes, sizeof p0);
  cr_assert_eq(parts[1].nbytes, sizeof p1);
  for (int i = 0; i < 3; i++)
    cr_assert(p0[i] == 2.5f && p1[i] == 2.5f);
  meshd_transfer_stats_t st = stats_of(s);
  cr_assert_eq(st.proxy_fetches, 2);
  cr_assert_eq(st.fallbacks, 1);
  cr_assert(strstr(st.last_fallback, "rank 1") &&
                strstr(st.last_fallback, "too many direct transfers in flight"),
            "%s", st.last_fallback);
  /* rank 0's table is full too now: an upload and a fetch as values */
  cr_assert_eq(meshd_session_upload(s, m, "float32", three, 1, x, sizeof x, &t), MESHD_E_OK,
               "%s", meshd_last_error(c)->message);
  meshd_values_t v;
  cr_assert_eq(meshd_session_fetch(s, t, dims, at1, 1, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(v.n, 3);
  for (size_t i = 0; i < 3; i++)
    cr_assert_float_eq(v.values[i], x[i], 1e-9);
  meshd_values_free(&v);
  st = stats_of(s);
  cr_assert_eq(st.direct_uploads, 1);
  cr_assert_eq(st.proxy_uploads, 1);
  cr_assert_eq(st.proxy_fetches, 3);
  cr_assert_eq(st.fallbacks, 3, "%s", st.last_fallback);

  /* direct: refused, naming the agent and what to do */
  cr_assert_eq(meshd_session_set_data_path(s, MESHD_DATA_PATH_DIRECT), MESHD_E_OK);
  meshd_ref_t bad = 0;
  for (int fetch = 0; fetch < 2; fetch++) {
    meshd_err_t rc = fetch ? meshd_session_fetch(s, t, dims, at1, 1, &v)
                           : meshd_session_upload(s, m, "float32", three, 1, x, sizeof x, &bad);
    cr_assert_eq(rc, MESHD_E_RPC, "%s", meshd_last_error(c)->message);
    const meshd_error_info_t *e = meshd_last_error(c);
    cr_assert_str_eq(e->grpc_code_name, "RESOURCE_EXHAUSTED");
    cr_assert_str_eq(e->kind, "QUOTA");
    cr_assert(strstr(e->message, fetch ? "direct fetch, rank 1 (agent 127.0.0.1:"
                                       : "direct upload, rank ") &&
                  strstr(e->message, "(agent 127.0.0.1:") &&
                  strstr(e->message, "too many direct transfers in flight") &&
                  strstr(e->message, "--max-transfer-nonces") &&
                  strstr(e->message, "retry later"),
              "%s", e->message);
  }
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  meshd_session_close(s);
  meshd_close(c);
}

/* Several mesh dims reduced at once (meshd_session_reduce_dims), onto every
 * rank and onto a one-rank sub-mesh; bad dims are named before anything is
 * sent. A {host: 1, gpu: 2} mesh over the two agents, rank r holding r + 1. */
Test(c_client, reduce_over_several_dims_at_once_onto_a_sub_mesh) {
  meshd_client_t *c = connect_ok();
  meshd_session_t *s = meshd_session_open(c, "c-reduce-dims", NULL);
  cr_assert_not_null(s);
  const char *dims[] = {"host", "gpu"};
  int64_t sizes[] = {1, 2};
  meshd_ref_t m = 0, x = 0, all = 0, one = 0, onto = 0, bad = 0;
  cr_assert_eq(meshd_session_create_mesh(s, dims, sizes, 2, &m), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  float data[2 * 3] = {1, 1, 1, 2, 2, 2};
  int64_t shape[] = {3};
  meshd_upload_options_t uo = MESHD_UPLOAD_OPTIONS_INIT;
  uo.per_rank = true;
  cr_assert_eq(meshd_session_upload_with(s, m, "float32", shape, 1, data, sizeof data, &uo, &x),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_reduce_dims(s, x, dims, 2, "sum", 0, &all), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  int64_t at[] = {0, 1};
  cr_assert_eq(meshd_session_slice_mesh(s, m, dims, at, 2, &one), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_reduce_dims(s, x, dims, 2, "max", one, &onto), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  meshd_values_t v;
  int64_t r0[] = {0, 0};
  cr_assert_eq(meshd_session_fetch(s, all, dims, r0, 2, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(v.n, 3);
  for (size_t i = 0; i < v.n; i++)
    cr_assert_float_eq(v.values[i], 3.0, 1e-9, "sum over both dims, element %zu", i);
  meshd_values_free(&v);
  cr_assert_eq(meshd_session_fetch(s, onto, NULL, NULL, 0, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(v.n, 3);
  for (size_t i = 0; i < v.n; i++)
    cr_assert_float_eq(v.values[i], 2.0, 1e-9, "max onto gpu=1, element %zu", i);
  meshd_values_free(&v);
  /* the target still has one of the reduced dims: the server names it */
  meshd_ref_t row = 0;
  int64_t at_gpu[] = {1};
  const char *gpu[] = {"gpu"};
  cr_assert_eq(meshd_session_slice_mesh(s, m, gpu, at_gpu, 1, &row), MESHD_E_OK);
  cr_assert_neq(meshd_session_reduce_dims(s, x, dims, 2, "sum", row, &bad), MESHD_E_OK);
  cr_assert(strstr(meshd_last_error(c)->message, "reduced dim 'host'"), "%s",
            meshd_last_error(c)->message);
  const char *holes[] = {"host", ""};
  cr_assert_eq(meshd_session_reduce_dims(s, x, holes, 2, "sum", 0, &bad), MESHD_E_INVALID);
  cr_assert(strstr(meshd_last_error(c)->message, "dims[1] is empty"), "%s",
            meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_reduce_dims(s, x, NULL, 1, "sum", 0, &bad), MESHD_E_INVALID);
  cr_assert(strstr(meshd_last_error(c)->message, "dims is NULL"), "%s",
            meshd_last_error(c)->message);
  meshd_session_close(s);
  meshd_close(c);
}

/* Asserts that `t`'s 3 values at gpu=`rank` (-1: a mesh without dims) are want's. */
static void expect_three(meshd_client_t *c, meshd_session_t *s, meshd_ref_t t, int64_t rank,
                         const double want[3], const char *what) {
  const char *gpu[] = {"gpu"};
  meshd_values_t v;
  cr_assert_eq(meshd_session_fetch(s, t, gpu, &rank, rank >= 0, &v), MESHD_E_OK, "%s: %s", what,
               meshd_last_error(c)->message);
  cr_assert_eq(v.n, 3, "%s", what);
  for (size_t i = 0; i < 3; i++)
    cr_assert_float_eq(v.values[i], want[i], 1e-6, "%s, element %zu", what, i);
  meshd_values_free(&v);
}

/* Monarch's reduce(..., out=) and reduce_ (meshd_session_reduce_with): the
 * result is written into out (onto a sub-mesh too) or into the input, and
 * *result names that tensor; a bad out gets the server's kind, one of another
 * session is refused at the call. A {gpu: 2} mesh, rank 0 holding {1, 2, 3},
 * rank 1 {3, 4, 5}. */
Test(c_client, reduce_into_out_and_in_place) {
  meshd_client_t *c = connect_ok();
  meshd_session_t *s = meshd_session_open(c, "c-reduce-out", NULL);
  cr_assert_not_null(s);
  const char *gpu[] = {"gpu"};
  int64_t two[] = {2}, at0[] = {0}, shape[] = {3};
  meshd_ref_t m = 0, one = 0, x = 0, sum = 0, avg = 0, onto = 0, r = 0;
  cr_assert_eq(meshd_session_create_mesh(s, gpu, two, 1, &m), MESHD_E_OK);
  cr_assert_eq(meshd_session_slice_mesh(s, m, gpu, at0, 1, &one), MESHD_E_OK);
  float data[2 * 3] = {1, 2, 3, 3, 4, 5};
  meshd_upload_options_t uo = MESHD_UPLOAD_OPTIONS_INIT;
  uo.per_rank = true;
  cr_assert_eq(meshd_session_upload_with(s, m, "float32", shape, 1, data, sizeof data, &uo, &x),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  double want_sum[3], want_avg[3], want_max[3];
  for (int i = 0; i < 3; i++) {
    want_sum[i] = (double)data[i] + data[3 + i];
    want_avg[i] = want_sum[i] / 2;
    want_max[i] = data[i] > data[3 + i] ? data[i] : data[3 + i];
  }
  cr_assert_eq(meshd_session_factory(s, m, "zeros", shape, 1, 0, &sum), MESHD_E_OK);
  cr_assert_eq(meshd_session_factory(s, m, "zeros", shape, 1, 0, &avg), MESHD_E_OK);
  cr_assert_eq(meshd_session_factory(s, one, "zeros", shape, 1, 0, &onto), MESHD_E_OK);

  meshd_reduce_options_t o = MESHD_REDUCE_OPTIONS_INIT;
  o.out = sum;
  cr_assert_eq(meshd_session_reduce_with(s, x, gpu, 1, "sum", &o, &r), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(r, sum, "the result is out itself");
  o.out = avg;
  cr_assert_eq(meshd_session_reduce_with(s, x, gpu, 1, "avg", &o, &r), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  o = (meshd_reduce_options_t){.mesh = one, .out = onto};
  cr_assert_eq(meshd_session_reduce_with(s, x, gpu, 1, "max", &o, &r), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(r, onto);
  for (int64_t rank = 0; rank < 2; rank++) {
    expect_three(c, s, sum, rank, want_sum, "sum into out");
    expect_three(c, s, avg, rank, want_avg, "avg into out");
  }
  expect_three(c, s, onto, -1, want_max, "max into out on the sub-mesh");

  /* bad uses: the server's kind and message, nothing written */
  meshd_ref_t small = 0, foreign = 0;
  cr_assert_eq(meshd_session_factory(s, m, "zeros", two, 1, 0, &small), MESHD_E_OK);
  o = (meshd_reduce_options_t){.out = small};
  cr_assert_eq(meshd_session_reduce_with(s, x, gpu, 1, "sum", &o, &r), MESHD_E_RPC);
  cr_assert_str_eq(meshd_last_error(c)->kind, "SHAPE_MISMATCH", "%s",
                   meshd_last_error(c)->message);
  o = (meshd_reduce_options_t){.mesh = one, .out = sum}; /* out on the input's mesh */
  cr_assert_eq(meshd_session_reduce_with(s, x, gpu, 1, "sum", &o, &r), MESHD_E_RPC);
  cr_assert_str_eq(meshd_last_error(c)->kind, "WRONG_MESH", "%s", meshd_last_error(c)->message);
  o = (meshd_reduce_options_t){.out = sum, .inplace = true};
  cr_assert_eq(meshd_session_reduce_with(s, x, gpu, 1, "sum", &o, &r), MESHD_E_RPC);
  cr_assert_str_eq(meshd_last_error(c)->kind, "BAD_ARGUMENT");
  cr_assert(strstr(meshd_last_error(c)->message, "inplace and out cannot both be given"), "%s",
            meshd_last_error(c)->message);
  meshd_session_t *s2 = meshd_session_open(c, "c-reduce-out-2", NULL);
  cr_assert_not_null(s2);
  meshd_ref_t m2 = 0;
  cr_assert_eq(meshd_session_create_mesh(s2, gpu, two, 1, &m2), MESHD_E_OK);
  cr_assert_eq(meshd_session_factory(s2, m2, "zeros", shape, 1, 0, &foreign), MESHD_E_OK);
  o = (meshd_reduce_options_t){.out = foreign};
  cr_assert_eq(meshd_session_reduce_with(s, x, gpu, 1, "sum", &o, &r), MESHD_E_INVALID);
  cr_assert(strstr(meshd_last_error(c)->message, "out (ref"), "%s", meshd_last_error(c)->message);
  cr_assert(strstr(meshd_last_error(c)->message, "another session"), "%s",
            meshd_last_error(c)->message);
  meshd_session_close(s2);
  expect_three(c, s, sum, 1, want_sum, "out after the refused reduces");

  /* in place: the input holds the sum on every rank */
  o = (meshd_reduce_options_t){.inplace = true};
  cr_assert_eq(meshd_session_reduce_with(s, x, gpu, 1, "sum", &o, &r), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(r, x, "in place, the result is the input");
  for (int64_t rank = 0; rank < 2; rank++)
    expect_three(c, s, x, rank, want_sum, "sum in place");

  /* scatter: of the sum, a [2, 2] tensor, rank k keeps row k */
  int64_t four[] = {2, 2};
  float rows[2 * 4] = {1, 2, 3, 4, 10, 20, 30, 40};
  meshd_ref_t y = 0, part = 0;
  cr_assert_eq(meshd_session_upload_with(s, m, "float32", four, 2, rows, sizeof rows, &uo, &y),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  o = (meshd_reduce_options_t){.scatter = true};
  cr_assert_eq(meshd_session_reduce_with(s, y, gpu, 1, "sum", &o, &part), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  for (int64_t rank = 0; rank < 2; rank++) {
    meshd_values_t v;
    cr_assert_eq(meshd_session_fetch(s, part, gpu, &rank, 1, &v), MESHD_E_OK, "%s",
                 meshd_last_error(c)->message);
    cr_assert_eq(v.n, 2, "rank %lld keeps its row, got %zu", (long long)rank, v.n);
    for (size_t i = 0; i < 2; i++)
      cr_assert_float_eq(v.values[i], rows[2 * rank + i] + rows[4 + 2 * rank + i], 1e-6,
                         "scatter rank %lld element %zu", (long long)rank, i);
    meshd_values_free(&v);
  }
  o = (meshd_reduce_options_t){.scatter = true, .mesh = one};
  cr_assert_eq(meshd_session_reduce_with(s, y, gpu, 1, "sum", &o, &r), MESHD_E_RPC);
  cr_assert(strstr(meshd_last_error(c)->message, "scatter"), "%s", meshd_last_error(c)->message);

  /* stream: a tensor of a side stream reduces there, not on the default one */
  meshd_upload_options_t side = MESHD_UPLOAD_OPTIONS_INIT;
  side.per_rank = true;
  cr_assert_eq(meshd_session_stream(s, "side", &side.stream), MESHD_E_OK);
  meshd_ref_t z = 0, zs = 0;
  cr_assert_eq(meshd_session_upload_with(s, m, "float32", shape, 1, data, sizeof data, &side, &z),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  o = (meshd_reduce_options_t)MESHD_REDUCE_OPTIONS_INIT;
  cr_assert_eq(meshd_session_reduce_with(s, z, gpu, 1, "sum", &o, &r), MESHD_E_RPC);
  cr_assert_str_eq(meshd_last_error(c)->kind, "WRONG_STREAM", "%s", meshd_last_error(c)->message);
  o.stream = side.stream;
  cr_assert_eq(meshd_session_reduce_with(s, z, gpu, 1, "sum", &o, &zs), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  meshd_ref_t zsum = 0;
  cr_assert_eq(meshd_session_factory(s, m, "zeros", shape, 1, 0, &zsum), MESHD_E_OK);
  o = (meshd_reduce_options_t){.out = zsum, .stream = side.stream}; /* out on main */
  cr_assert_eq(meshd_session_reduce_with(s, z, gpu, 1, "sum", &o, &r), MESHD_E_RPC);
  cr_assert_str_eq(meshd_last_error(c)->kind, "WRONG_STREAM", "%s", meshd_last_error(c)->message);
  meshd_session_t *s3 = meshd_session_open(c, "c-reduce-out-3", NULL);
  cr_assert_not_null(s3);
  meshd_ref_t st3 = 0;
  cr_assert_eq(meshd_session_stream(s3, "other", &st3), MESHD_E_OK);
  o = (meshd_reduce_options_t){.stream = st3};
  cr_assert_eq(meshd_session_reduce_with(s, z, gpu, 1, "sum", &o, &r), MESHD_E_INVALID);
  cr_assert(strstr(meshd_last_error(c)->message, "stream (ref"), "%s",
            meshd_last_error(c)->message);
  meshd_session_close(s3);

  /* pipelined into out: queued, sent by the fetch, out itself as the result */
  meshd_pipeline_options_t po = {.max_batch = 256, .max_delay_us = 30000000};
  cr_assert_eq(meshd_session_set_pipeline(s, &po), MESHD_E_OK);
  meshd_ref_t pout = 0;
  cr_assert_eq(meshd_session_factory(s, m, "zeros", four, 2, 0, &pout), MESHD_E_OK);
  o = (meshd_reduce_options_t){.out = pout};
  cr_assert_eq(meshd_session_reduce_with(s, y, gpu, 1, "max", &o, &r), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(r, pout, "pipelined, the result is out itself");
  cr_assert_eq(pipe_stats(s).messages_sent, 0, "the reduce went out before the fetch");
  meshd_values_t v;
  int64_t rank1 = 1;
  cr_assert_eq(meshd_session_fetch(s, pout, gpu, &rank1, 1, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(v.n, 4);
  for (size_t i = 0; i < 4; i++)
    cr_assert_float_eq(v.values[i], rows[4 + i], 1e-6, "max into out, element %zu", i);
  meshd_values_free(&v);
  meshd_session_close(s);
  meshd_close(c);
}

/* meshctl --data-path=MODE run SCRIPT: exit status, stderr in err. */
static int meshctl_data_path(const char *mode, const char *script, char *err, size_t errlen) {
  char spath[128], epath[128], flag[64], bin[512];
  snprintf(spath, sizeof spath, "%s/dp-script-%d.txt", dir, (int)getpid());
  snprintf(epath, sizeof epath, "%s/dp-err-%d.txt", dir, (int)getpid());
  snprintf(flag, sizeof flag, "--data-path=%s", mode);
  snprintf(bin, sizeof bin, "%s/meshctl", bin_dir());
  FILE *f = fopen(spath, "w");
  cr_assert_not_null(f);
  fputs(script, f);
  fclose(f);
  pid_t pid = fork();
  cr_assert_geq(pid, 0);
  if (pid == 0) {
    int o = open("/dev/null", O_WRONLY);
    int e = open(epath, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (o < 0 || e < 0)
      _exit(126);
    dup2(o, 1);
    dup2(e, 2);
    execl(bin, bin, "--server", target, flag, "--timeout-ms", "20000", "run", spath, (char *)NULL);
    _exit(127);
  }
  int st = 0;
  cr_assert_eq(waitpid(pid, &st, 0), pid);
  cr_assert(WIFEXITED(st));
  slurp(epath, err, errlen);
  return WEXITSTATUS(st);
}

static void start_direct_only(void) {
  const char *const flags[] = {"--data-path=direct", NULL};
  start_server_with(flags);
}

TestSuite(c_client_direct_only, .init = start_direct_only, .fini = stop_server, .timeout = 60);

/* --data-path=direct refuses the proxied Upload and Fetch, so the bytes of
 * every transfer that succeeds here went straight to and from the agents, none
 * through the server: AUTO sessions and meshctl's default take that path. */
Test(c_client_direct_only, bytes_never_pass_through_the_server) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0;
  meshd_session_t *s = session_on_mesh(c, &m);
  cr_assert_eq(round_trip(s, m, (1u << 20) + 3, 4), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  meshd_transfer_stats_t st = stats_of(s);
  cr_assert_eq(st.direct_uploads, 1);
  cr_assert_eq(st.direct_fetches, 2);
  cr_assert_eq(meshd_session_set_data_path(s, MESHD_DATA_PATH_PROXY), MESHD_E_OK);
  cr_assert_eq(round_trip(s, m, 16, 5), MESHD_E_RPC);
  cr_assert(strstr(meshd_last_error(c)->message, "--data-path is direct"), "%s",
               meshd_last_error(c)->message);
  meshd_session_close(s);
  meshd_close(c);

  char err[4096];
  const char *script = "mesh m gpu=2\nx = tensor m 1 2 3\nfetch x gpu=1\n";
  int rc = meshctl_data_path("auto", script, err, sizeof err);
  cr_assert_eq(rc, 0, "rc %d, stderr: %s", rc, err);
  rc = meshctl_data_path("proxy", script, err, sizeof err);
  cr_assert_eq(rc, 3, "rc %d, stderr: %s", rc, err);
  cr_assert(strstr(err, "--data-path is direct"), "stderr: %s", err);
}

static void start_proxy_only(void) {
  const char *const flags[] = {"--data-path=proxy", NULL};
  start_server_with(flags);
}

TestSuite(c_client_proxy_only, .init = start_proxy_only, .fini = stop_server, .timeout = 60);

/* --data-path=proxy: AUTO uses the proxy (the reason recorded, the server not
 * asked again); DIRECT fails with the server's refusal. */
Test(c_client_proxy_only, auto_uses_the_proxy) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0;
  meshd_session_t *s = session_on_mesh(c, &m);
  cr_assert_eq(round_trip(s, m, 70000, 6), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert_eq(round_trip(s, m, 100, 7), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  meshd_transfer_stats_t st = stats_of(s);
  cr_assert_eq(st.direct_uploads + st.direct_fetches, 0);
  cr_assert_eq(st.proxy_uploads, 2);
  cr_assert_eq(st.proxy_fetches, 4);
  cr_assert_eq(st.fallbacks, 4);
  cr_assert(strstr(st.last_fallback, "--data-path is proxy"), "%s", st.last_fallback);
  cr_assert_eq(meshd_session_set_data_path(s, MESHD_DATA_PATH_DIRECT), MESHD_E_OK);
  cr_assert_eq(round_trip(s, m, 16, 8), MESHD_E_RPC);
  cr_assert_str_eq(meshd_last_error(c)->grpc_code_name, "FAILED_PRECONDITION");
  cr_assert(strstr(meshd_last_error(c)->message, "--data-path is proxy"), "%s",
            meshd_last_error(c)->message);
  meshd_session_close(s);
  meshd_close(c);
}

/* Cluster mTLS on the agents' port and TLS on the client port: a client
 * without a cluster certificate reaches the agents over TLS, verified with the
 * cluster CA the plan names (docs/security.md). --agent-timeout 10: a test
 * stops an agent for about 2 s. */
static meshd_connect_options_t cluster_tls_client(void) {
  meshd_connect_options_t o = MESHD_CONNECT_OPTIONS_INIT;
  o.tls_ca_file = pki_file("ca.pem");
  o.timeout_ms = 10000;
  return o;
}

static void start_cluster_tls(void) {
  make_pki();
  static char ca[256], cert[256], key[256], tcert[256], tkey[256];
  snprintf(ca, sizeof ca, "%s/cluster-ca.pem", pki);
  snprintf(cert, sizeof cert, "%s/cluster.pem", pki);
  snprintf(key, sizeof key, "%s/cluster.key", pki);
  snprintf(tcert, sizeof tcert, "%s/server.pem", pki);
  snprintf(tkey, sizeof tkey, "%s/server.key", pki);
  const char *const flags[] = {"--cluster-ca", ca, "--cluster-cert", cert, "--cluster-key", key,
                               "--cluster-listen", "127.0.0.1:0", "--tls-cert", tcert,
                               "--tls-key", tkey, "--agent-timeout", "10", NULL};
  meshd_connect_options_t o = cluster_tls_client();
  start_server_full("2", flags, &o);
}

static void stop_cluster_tls(void) {
  stop_server();
  remove_pki();
}

TestSuite(c_client_cluster_tls, .init = start_cluster_tls, .fini = stop_cluster_tls,
          .timeout = 60);

static meshd_client_t *connect_cluster_tls(void) {
  meshd_connect_options_t o = cluster_tls_client();
  char why[512];
  meshd_err_t e;
  meshd_client_t *c = meshd_connect_with(target, &o, &e, why, sizeof why);
  cr_assert_not_null(c, "connect: %s: %s", meshd_strerror(e), why);
  return c;
}

static void *resume_later(void *arg) {
  sleep_ms(2000); /* well past the client's 1 s connection wait, which starts at once */
  kill(*(pid_t *)arg, SIGCONT);
  return NULL;
}

/* A session over TLS goes direct, over TLS to the agents: sharded bytes both
 * ways (several messages each), nothing through the server, no fallback.
 * Then, in a new session, an agent that does not answer (SIGSTOPped: its port
 * accepts, no handshake follows): AUTO falls back to the proxy (the reason
 * recorded; not tried again for a while, so later transfers do not wait on
 * the connection) and the proxied transfers finish once it runs again; DIRECT
 * fails with UNAVAILABLE naming the rank and its address. */
Test(c_client_cluster_tls, direct_over_tls_and_fallback_when_an_agent_hangs) {
  meshd_client_t *c = connect_cluster_tls();
  meshd_ref_t m = 0;
  meshd_session_t *s = session_on_mesh(c, &m);
  cr_assert_eq(round_trip(s, m, (2u << 20) + 5, 8), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  meshd_transfer_stats_t st = stats_of(s);
  cr_assert_eq(st.direct_uploads, 1, "%s", st.last_fallback);
  cr_assert_eq(st.direct_fetches, 2);
  cr_assert_eq(st.proxy_uploads + st.proxy_fetches + st.fallbacks, 0, "%s", st.last_fallback);
  meshd_session_close(s);

  s = session_on_mesh(c, &m); /* no agent channels yet */
  pid_t pid = agent_pid(0); /* the first shard: its wait starts right after the plan */
  cr_assert_gt(pid, 0, "no rank-0 agent child of meshd %d", (int)server_pid);
  stop_agent(pid);
  pthread_t resumer;
  cr_assert_eq(pthread_create(&resumer, NULL, resume_later, &pid), 0);
  meshd_err_t rc = round_trip(s, m, 3000, 9);
  pthread_join(resumer, NULL);
  stopped_agent = -1;
  cr_assert_eq(rc, MESHD_E_OK, "%s", meshd_last_error(c)->message);
  st = stats_of(s);
  cr_assert_eq(st.direct_uploads + st.direct_fetches, 0);
  cr_assert_eq(st.proxy_uploads, 1);
  cr_assert_eq(st.proxy_fetches, 2);
  cr_assert_eq(st.fallbacks, 2);
  cr_assert(strstr(st.last_fallback, "did not connect"), "%s", st.last_fallback);
  int64_t t0 = now_ms();
  cr_assert_eq(round_trip(s, m, 100, 10), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert_lt(now_ms() - t0, 900, "a known unreachable agent was tried again");

  stop_agent(pid);
  cr_assert_eq(meshd_session_set_data_path(s, MESHD_DATA_PATH_DIRECT), MESHD_E_OK);
  rc = round_trip(s, m, 16, 11);
  kill(pid, SIGCONT);
  stopped_agent = -1;
  cr_assert_eq(rc, MESHD_E_RPC);
  const meshd_error_info_t *info = meshd_last_error(c);
  cr_assert_str_eq(info->grpc_code_name, "UNAVAILABLE");
  cr_assert(strstr(info->message, "direct upload: rank 0") &&
                strstr(info->message, "does not answer within 1000 ms"),
            "%s", info->message);
  /* the refused plan's ref stays unused; the session goes on by the proxy */
  cr_assert_eq(meshd_session_set_data_path(s, MESHD_DATA_PATH_PROXY), MESHD_E_OK);
  cr_assert_eq(round_trip(s, m, 100, 12), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  meshd_session_close(s);
  meshd_close(c);
}

/* A session over TLS never sends tensor bytes to plaintext agents: DIRECT
 * refuses the transfer (UNAVAILABLE, nothing defined), AUTO takes the proxy
 * and says why. */
Test(c_client_tls, a_tls_session_never_sends_to_plaintext_agents) {
  meshd_connect_options_t o;
  meshd_client_t *c = connect_tls_alice(&o);
  meshd_err_t e;
  meshd_session_t *s = meshd_session_open(c, "c-tls-direct", &e);
  cr_assert_not_null(s, "%s", meshd_last_error(c)->message);
  meshd_ref_t m = 0, t = 0;
  cr_assert_eq(meshd_session_create_mesh(s, (const char *[]){"gpu"}, (int64_t[]){2}, 1, &m),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_set_data_path(s, MESHD_DATA_PATH_DIRECT), MESHD_E_OK);
  float v[4] = {1, 2, 3, 4}, back[4] = {0};
  int64_t shape[] = {4};
  cr_assert_eq(meshd_session_upload(s, m, "float32", shape, 1, v, sizeof v, &t), MESHD_E_RPC);
  const meshd_error_info_t *info = meshd_last_error(c);
  cr_assert_str_eq(info->grpc_code_name, "UNAVAILABLE", "%s", info->message);
  cr_assert(strstr(info->message, "direct upload: the session is over TLS and the plan's agents "
                                  "speak plaintext"), "%s", info->message);
  cr_assert_eq(meshd_session_set_data_path(s, MESHD_DATA_PATH_AUTO), MESHD_E_OK);
  cr_assert_eq(meshd_session_upload(s, m, "float32", shape, 1, v, sizeof v, &t), MESHD_E_OK,
               "%s", meshd_last_error(c)->message);
  const char *dims[] = {"gpu"};
  int64_t r1[] = {1};
  meshd_fetch_part_t part = {dims, r1, 1, back, sizeof back, 0};
  cr_assert_eq(meshd_session_set_data_path(s, MESHD_DATA_PATH_DIRECT), MESHD_E_OK);
  cr_assert_eq(meshd_session_fetch_bytes(s, t, &part, 1, NULL), MESHD_E_RPC);
  cr_assert(strstr(meshd_last_error(c)->message, "direct fetch: the session is over TLS"), "%s",
            meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_set_data_path(s, MESHD_DATA_PATH_AUTO), MESHD_E_OK);
  cr_assert_eq(meshd_session_fetch_bytes(s, t, &part, 1, NULL), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(memcmp(back, v, sizeof v), 0);
  meshd_transfer_stats_t st = stats_of(s);
  cr_assert_eq(st.direct_uploads + st.direct_fetches, 0);
  cr_assert(strstr(st.last_fallback, "over TLS and the agents are reached in plaintext"), "%s",
            st.last_fallback);
  meshd_session_close(s);
  meshd_close(c);
}

/* A plan's agent address is dialled only when it is host:port: never a gRPC
 * target (unix:/path, dns:///name, "unix:123" is the socket file 123). */
Test(c_client_direct_addresses, only_host_port_addresses_are_dialled) {
  const char *good[] = {"127.0.0.1:50052", "agent-0.meshd-agents.ns.svc:50052", "[::1]:1",
                        "[fe80::1%eth0]:65535", "localhost:9"};
  const char *bad[] = {"unix:/tmp/evil.sock", "unix:123", "dns:///agent:50052", "ipv4:1.2.3.4:5",
                       "unix-abstract:x", "agent", "agent:", ":50052", "agent:123456",
                       "agent:12a", "[::1]", "[]:5", "a b:5", "agent:50052/x", "", NULL};
  for (size_t i = 0; i < sizeof good / sizeof good[0]; i++)
    cr_expect(direct_host_port(good[i]), "%s refused", good[i]);
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    cr_expect_not(direct_host_port(bad[i]), "%s accepted", bad[i] ? bad[i] : "(null)");
}

/* A fetch's byte count from the server's TensorMeta: a shape whose bytes
 * overflow 64 bits is refused (it wrapped: int8 [2^32, 2^32] was 0 bytes, a
 * fetch of it "succeeded" empty). */
Test(c_client_direct_addresses, a_shape_whose_bytes_overflow_is_refused) {
  int64_t fits[] = {2, 3}, wraps[] = {INT64_C(1) << 32, INT64_C(1) << 32},
          big[] = {INT64_C(1) << 31, INT64_C(1) << 31};
  Meshd__V1__TensorMeta m = MESHD__V1__TENSOR_META__INIT;
  uint64_t n = 7;
  m.dtype = MESHD__V1__DTYPE__DTYPE_FLOAT32;
  m.n_shape = 2;
  m.shape = fits;
  cr_assert(direct_meta_bytes(&m, &n));
  cr_assert_eq(n, 24);
  m.dtype = MESHD__V1__DTYPE__DTYPE_INT8;
  m.shape = wraps;
  cr_assert_not(direct_meta_bytes(&m, &n), "2^64 int8 elements fit in 64 bits?");
  m.shape = big; /* 2^62 bytes: fits */
  cr_assert(direct_meta_bytes(&m, &n));
  cr_assert_eq(n, UINT64_C(1) << 62);
  m.dtype = MESHD__V1__DTYPE__DTYPE_FLOAT64; /* 2^65 */
  cr_assert_not(direct_meta_bytes(&m, &n));
}

/* An upload that falls back to the proxy (auto: an agent that does not
 * answer) keeps the one deadline it started with: the proxied Upload, stuck
 * on the stopped agent, ends when it ends, not a whole timeout later. */
Test(c_client_lease, an_upload_that_falls_back_to_the_proxy_keeps_one_deadline) {
  meshd_err_t e;
  meshd_client_t *c = meshd_connect(target, 2000, &e);
  cr_assert_not_null(c, "connect: %s", meshd_strerror(e));
  meshd_ref_t m = 0, t = 0;
  meshd_session_t *s = session_on_mesh(c, &m);
  pid_t pid = agent_pid(0);
  cr_assert_gt(pid, 0, "no rank-0 agent child of meshd %d", (int)server_pid);
  stop_agent(pid);
  static uint8_t data[3000];
  int64_t shape[] = {(int64_t)sizeof data};
  int64_t t0 = now_ms();
  meshd_err_t rc = meshd_session_upload(s, m, "uint8", shape, 1, data, sizeof data, &t);
  int64_t took = now_ms() - t0;
  kill(pid, SIGCONT);
  stopped_agent = -1;
  cr_assert_neq(rc, MESHD_E_OK, "an upload to a stopped agent succeeded");
  meshd_transfer_stats_t st = stats_of(s);
  cr_assert_eq(st.fallbacks, 1, "the direct path was not tried first: %s", st.last_fallback);
  /* 1 s for the agent's connection, then the proxy: 3 s and more before. */
  cr_assert_lt(took, 2600, "the upload took %lld ms with a 2000 ms timeout", (long long)took);
  meshd_session_close(s);
  meshd_close(c);
}

/* More parts than the server's --session-max-transfers (8) in one
 * meshd_session_fetch_bytes: in waves, every part filled (the call failed
 * RESOURCE_EXHAUSTED on the ninth). */
Test(c_client_lease, a_fetch_of_more_parts_than_the_transfer_slots_goes_in_waves) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, t = 0;
  meshd_session_t *s = session_on_mesh(c, &m);
  uint8_t data[2 * 64];
  for (size_t i = 0; i < sizeof data; i++)
    data[i] = (uint8_t)(i * 7 + 1);
  meshd_upload_options_t uo = MESHD_UPLOAD_OPTIONS_INIT;
  uo.per_rank = true;
  int64_t shape[] = {64};
  cr_assert_eq(meshd_session_upload_with(s, m, "uint8", shape, 1, data, sizeof data, &uo, &t),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  enum { N = 19 };
  static uint8_t back[N][64];
  int64_t rank[N];
  const char *dims[] = {"gpu"};
  meshd_fetch_part_t parts[N];
  for (int i = 0; i < N; i++) {
    rank[i] = i % 2;
    parts[i] = (meshd_fetch_part_t){dims, &rank[i], 1, back[i], sizeof back[i], 0};
  }
  cr_assert_eq(meshd_session_fetch_bytes(s, t, parts, N, NULL), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  for (int i = 0; i < N; i++) {
    cr_assert_eq(parts[i].nbytes, 64, "part %d", i);
    cr_assert_eq(memcmp(back[i], data + 64 * rank[i], 64), 0, "part %d", i);
  }
  meshd_session_close(s);
  meshd_close(c);
}

static void start_three_transfers(void) {
  const char *const flags[] = {"--data-path=direct", "--session-max-transfers=3", NULL};
  start_server_with(flags);
}

TestSuite(c_client_three_transfers, .init = start_three_transfers, .fini = stop_server,
          .timeout = 60);

/* A direct fetch plans its parts at once (one round trip, not one a part).
 * Five parts against --session-max-transfers 3: two plans are refused, the
 * fetch fails naming the flag, and the three planned are finished all the
 * same: their slots come back (three parts fetch next, twice), and every
 * value is the one uploaded. */
Test(c_client_three_transfers, a_direct_fetch_whose_later_plans_are_refused_gives_every_slot_back) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, t = 0;
  meshd_session_t *s = session_on_mesh(c, &m);
  cr_assert_eq(meshd_session_set_data_path(s, MESHD_DATA_PATH_DIRECT), MESHD_E_OK);
  uint8_t data[2 * 100];
  for (size_t i = 0; i < sizeof data; i++)
    data[i] = (uint8_t)(i * 13 + 5);
  meshd_upload_options_t uo = MESHD_UPLOAD_OPTIONS_INIT;
  uo.per_rank = true;
  int64_t shape[] = {100};
  cr_assert_eq(meshd_session_upload_with(s, m, "uint8", shape, 1, data, sizeof data, &uo, &t),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  static uint8_t back[5][100];
  int64_t rank[5];
  const char *dims[] = {"gpu"};
  meshd_fetch_part_t parts[5];
  for (int i = 0; i < 5; i++) {
    rank[i] = i % 2;
    parts[i] = (meshd_fetch_part_t){dims, &rank[i], 1, back[i], sizeof back[i], 0};
  }
  cr_assert_eq(meshd_session_fetch_bytes(s, t, parts, 5, NULL), MESHD_E_RPC);
  cr_assert(strstr(meshd_last_error(c)->message, "--session-max-transfers (3)"), "%s",
            meshd_last_error(c)->message);
  for (int round = 0; round < 2; round++) {
    memset(back, 0, sizeof back);
    cr_assert_eq(meshd_session_fetch_bytes(s, t, parts, 3, NULL), MESHD_E_OK, "round %d: %s",
                 round, meshd_last_error(c)->message);
    for (int i = 0; i < 3; i++)
      cr_assert_eq(memcmp(back[i], data + 100 * rank[i], 100), 0, "round %d, part %d", round, i);
  }
  meshd_session_close(s);
  meshd_close(c);
}

/* Grants that must be presented within 100 ms of their plan; three transfers
 * a session at a time (so a plan not given back shows at once). */
static void start_late_grants(void) {
  const char *const flags[] = {"--data-path=direct", "--transfer-grant-start-ms=100",
                               "--session-max-transfers=3", NULL};
  start_server_with(flags);
}

TestSuite(c_client_late_grants, .init = start_late_grants, .fini = stop_server, .timeout = 60);

/* Both ranks of t (100 bytes each) fetched at once: MESHD_E_OK with the bytes
 * checked against want, or the fetch's failure. */
static meshd_err_t fetch_both(meshd_session_t *s, meshd_ref_t t, const uint8_t *want) {
  uint8_t back[2][100];
  memset(back, 0, sizeof back);
  const char *dims[] = {"gpu"};
  int64_t r0[] = {0}, r1[] = {1};
  meshd_fetch_part_t parts[2] = {{dims, r0, 1, back[0], 100, 0}, {dims, r1, 1, back[1], 100, 0}};
  meshd_err_t e = meshd_session_fetch_bytes(s, t, parts, 2, NULL);
  if (e == MESHD_E_OK)
    for (int i = 0; i < 2; i++)
      cr_assert_eq(memcmp(back[i], want + 100 * i, 100), 0, "rank %d's bytes differ", i);
  return e;
}

/* A direct upload or fetch whose Writes/Reads start past their grants'
 * start-by time (the process paused 300 ms after PlanTransfer answered:
 * MESHD_TEST_DIRECT_DELAY_MS, its first plan only) is refused by the agents
 * before any byte moved; the client gives the plan back and plans once more
 * (an upload with a new ref). It failed PERMISSION_DENIED "transfer grant
 * refused: expired: ...", which reads as an authentication problem. */
Test(c_client_late_grants, a_transfer_paused_past_its_grants_start_by_time_is_planned_again) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, t = 0, u = 0;
  meshd_session_t *s = session_on_mesh(c, &m);
  uint8_t data[2 * 100];
  for (size_t i = 0; i < sizeof data; i++)
    data[i] = (uint8_t)(i * 7 + 3);
  meshd_upload_options_t uo = MESHD_UPLOAD_OPTIONS_INIT;
  uo.per_rank = true;
  int64_t shape[] = {100};
  setenv("MESHD_TEST_DIRECT_DELAY_MS", "300,once", 1);
  meshd_err_t rc = meshd_session_upload_with(s, m, "uint8", shape, 1, data, sizeof data, &uo, &t);
  cr_assert_eq(rc, MESHD_E_OK, "%s", meshd_last_error(c)->message);
  for (int round = 0; round < 4; round++) /* more than 3: every plan's slot came back */
    cr_assert_eq(fetch_both(s, t, data), MESHD_E_OK, "round %d: %s", round,
                 meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_upload_with(s, m, "uint8", shape, 1, data, sizeof data, &uo, &u),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert_neq(t, u);
  unsetenv("MESHD_TEST_DIRECT_DELAY_MS");
  cr_assert_eq(fetch_both(s, u, data), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  meshd_transfer_stats_t st = stats_of(s);
  cr_assert_eq(st.direct_uploads, 2);
  cr_assert_eq(st.direct_fetches, 10);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  meshd_session_close(s);
  meshd_close(c);
}

/* Paused past the start-by time after its new plan too: the error says what
 * happened and what to do, not an authentication refusal, and the session
 * goes on working (its slots and refs were given back). */
Test(c_client_late_grants, a_transfer_paused_past_its_grants_start_by_time_twice_says_so) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, t = 0, u = 0;
  meshd_session_t *s = session_on_mesh(c, &m);
  uint8_t data[2 * 100];
  for (size_t i = 0; i < sizeof data; i++)
    data[i] = (uint8_t)(i * 11 + 1);
  meshd_upload_options_t uo = MESHD_UPLOAD_OPTIONS_INIT;
  uo.per_rank = true;
  int64_t shape[] = {100};
  cr_assert_eq(meshd_session_upload_with(s, m, "uint8", shape, 1, data, sizeof data, &uo, &t),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  static const char late[] = "the transfer's grant expired before it started";
  setenv("MESHD_TEST_DIRECT_DELAY_MS", "300", 1);
  for (int round = 0; round < 2; round++) {
    cr_assert_eq(fetch_both(s, t, data), MESHD_E_RPC);
    const char *msg = meshd_last_error(c)->message;
    cr_assert(strncmp(msg, late, strlen(late)) == 0 && strstr(msg, "call again"), "%s", msg);
    cr_assert_eq(meshd_session_upload_with(s, m, "uint8", shape, 1, data, sizeof data, &uo, &u),
                 MESHD_E_RPC);
    msg = meshd_last_error(c)->message;
    cr_assert(strncmp(msg, late, strlen(late)) == 0, "%s", msg);
  }
  unsetenv("MESHD_TEST_DIRECT_DELAY_MS");
  cr_assert_eq(fetch_both(s, t, data), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert_eq(round_trip(s, m, 100, 4), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  meshd_session_close(s);
  meshd_close(c);
}

/* ------------------------------------------------------------------ literals */

/* The bytes of `t` at rank gpu=`rank` (-1: a mesh without dims) into buf (cap
 * bytes); returns their count. */
static size_t fetch_rank(meshd_client_t *c, meshd_session_t *s, meshd_ref_t t, int64_t rank,
                         void *buf, size_t cap) {
  const char *dims[] = {"gpu"};
  meshd_fetch_part_t part = {dims, &rank, rank >= 0, buf, cap, 0};
  cr_assert_eq(meshd_session_fetch_bytes(s, t, &part, 1, NULL), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  return part.nbytes;
}

static uint64_t uploads_of(meshd_session_t *s) {
  meshd_transfer_stats_t st = stats_of(s);
  return st.direct_uploads + st.proxy_uploads;
}

/* A Literal is a command, not an upload: replicated, per rank and on a side
 * stream, its values arrive exact, and no Upload ran (the transfer counters);
 * pipelined, it waits in the queue with the other commands and is answered
 * with them. Bytes that disagree with the shape are named by the server; over
 * 1 MiB, the client names the bound and what to call instead. */
Test(c_client, a_literal_is_a_command_whose_bytes_arrive_exact) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0;
  meshd_session_t *s = session_on_mesh(c, &m);
  cr_assert(meshd_session_literals(s, m), "this server's agents all run Literals");

  float f[3] = {1.5f, -2.0f, 3.25f}, fb[3];
  int64_t three[] = {3}, two[] = {2};
  meshd_ref_t x = 0, y = 0, z = 0, w = 0;
  cr_assert_eq(meshd_session_literal(s, m, "float32", three, 1, f, sizeof f, NULL, &x),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  for (int r = 0; r < 2; r++) {
    cr_assert_eq(fetch_rank(c, s, x, r, fb, sizeof fb), sizeof f);
    cr_assert(memcmp(f, fb, sizeof f) == 0, "rank %d", r);
  }
  int64_t rows[4] = {10, -11, 1LL << 40, 21}, back[2];
  meshd_upload_options_t o = MESHD_UPLOAD_OPTIONS_INIT;
  o.per_rank = true;
  cr_assert_eq(meshd_session_literal(s, m, "int64", two, 1, rows, sizeof rows, &o, &y),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  for (int r = 0; r < 2; r++) {
    cr_assert_eq(fetch_rank(c, s, y, r, back, sizeof back), sizeof back);
    cr_assert(memcmp(back, rows + 2 * r, sizeof back) == 0, "rank %d got %lld %lld", r,
              (long long)back[0], (long long)back[1]);
  }
  meshd_upload_options_t side = MESHD_UPLOAD_OPTIONS_INIT;
  cr_assert_eq(meshd_session_stream(s, "side", &side.stream), MESHD_E_OK);
  uint8_t u[5] = {0, 1, 254, 255, 7}, ub[5];
  int64_t five[] = {5};
  cr_assert_eq(meshd_session_literal(s, m, "uint8", five, 1, u, sizeof u, &side, &z),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert_eq(fetch_rank(c, s, z, 1, ub, sizeof ub), sizeof u);
  cr_assert(memcmp(u, ub, sizeof u) == 0);
  cr_assert_eq(uploads_of(s), 0, "a Literal went as an upload");

  /* Refused: the server names the mismatch, and the ref stays free. */
  meshd_ref_t before = 0;
  cr_assert_eq(meshd_session_literal(s, m, "float32", five, 1, f, sizeof f, NULL, &before),
               MESHD_E_RPC);
  cr_assert_str_eq(meshd_last_error(c)->kind, "BAD_ARGUMENT");
  cr_assert(strstr(meshd_last_error(c)->message, "Literal: 12 bytes of data"), "%s",
            meshd_last_error(c)->message);
  size_t big = MESHD_LITERAL_MAX_BYTES + 1;
  uint8_t *lots = calloc(1, big);
  cr_assert_not_null(lots);
  int64_t nbig[] = {(int64_t)big};
  cr_assert_eq(meshd_session_literal(s, m, "uint8", nbig, 1, lots, big, NULL, &w),
               MESHD_E_INVALID);
  cr_assert(strstr(meshd_last_error(c)->message, "more than a Literal carries") &&
                strstr(meshd_last_error(c)->message, "meshd_session_upload_with"),
            "%s", meshd_last_error(c)->message);
  free(lots);
  cr_assert_eq(meshd_session_literal(s, m, "float33", three, 1, f, sizeof f, NULL, &w),
               MESHD_E_INVALID);

  /* Pipelined: queued with the call that uses it, sent by the fetch. */
  meshd_pipeline_options_t po = {.max_batch = 256, .max_delay_us = 30000000};
  cr_assert_eq(meshd_session_set_pipeline(s, &po), MESHD_E_OK);
  float g[2] = {4.0f, 0.5f};
  meshd_ref_t a = 0, b = 0;
  cr_assert_eq(meshd_session_literal(s, m, "float32", two, 1, g, sizeof g, NULL, &a),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert_eq(a, z + 1, "the refused Literals spent refs (%llu after %llu)",
               (unsigned long long)a, (unsigned long long)z);
  g[0] = 99.0f; /* queued: the literal holds its own copy */
  add_one(c, s, a, &b);
  meshd_pipeline_stats_t st = pipe_stats(s);
  cr_assert_eq(st.commands_queued, 2);
  cr_assert_eq(st.messages_sent, 0);
  float gb[2];
  cr_assert_eq(fetch_rank(c, s, b, 0, gb, sizeof gb), sizeof gb);
  cr_assert(gb[0] == 5.0f && gb[1] == 1.5f, "got %g %g", gb[0], gb[1]);
  st = pipe_stats(s);
  cr_assert_eq(st.messages_sent, 1);
  cr_assert_eq(st.rejected, 0);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert_eq(uploads_of(s), 0, "a Literal went as an upload");
  meshd_session_close(s);
  meshd_close(c);
}

static void start_old_rank1(void) { start_server_fault("hello:old,rank=1", NULL); }

TestSuite(c_client_old_agent, .init = start_old_rank1, .fini = stop_server, .timeout = 60);

/* A rolling upgrade: the agent of rank 1 registers as a build older than the
 * Literal command. A mesh with it says so (MeshMeta.literals), and a Literal
 * to it is uploaded instead, exact, pipelined or not; a slice without it still
 * gets commands. */
Test(c_client_old_agent, a_mesh_with_an_older_agent_gets_uploads) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, m0 = 0;
  meshd_session_t *s = session_on_mesh(c, &m);
  const char *dims[] = {"gpu"};
  int64_t at0[] = {0};
  cr_assert_eq(meshd_session_slice_mesh(s, m, dims, at0, 1, &m0), MESHD_E_OK);
  cr_assert(!meshd_session_literals(s, m), "a mesh with an older agent takes Literals");
  cr_assert(meshd_session_literals(s, m0), "rank 0's slice runs Literals");

  int32_t v[4] = {1, -2, 3, 1 << 30}, vb[4];
  int64_t four[] = {4};
  meshd_ref_t x = 0, y = 0, x1 = 0;
  cr_assert_eq(meshd_session_literal(s, m, "int32", four, 1, v, sizeof v, NULL, &x), MESHD_E_OK,
               "%s", meshd_last_error(c)->message);
  cr_assert_eq(uploads_of(s), 1);
  cr_assert_eq(fetch_rank(c, s, x, 1, vb, sizeof vb), sizeof v);
  cr_assert(memcmp(v, vb, sizeof v) == 0);
  cr_assert_eq(meshd_session_literal(s, m0, "int32", four, 1, v, sizeof v, NULL, &y), MESHD_E_OK,
               "%s", meshd_last_error(c)->message);
  cr_assert_eq(uploads_of(s), 1, "rank 0's slice got an upload");
  cr_assert_eq(fetch_rank(c, s, y, -1, vb, sizeof vb), sizeof v);
  cr_assert(memcmp(v, vb, sizeof v) == 0);

  meshd_pipeline_options_t po = {.max_batch = 256, .max_delay_us = 30000000};
  cr_assert_eq(meshd_session_set_pipeline(s, &po), MESHD_E_OK);
  cr_assert_eq(meshd_session_literal(s, m, "int32", four, 1, v, sizeof v, NULL, &x1),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert_eq(uploads_of(s), 2);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert_eq(pipe_stats(s).rejected, 0);
  cr_assert_eq(fetch_rank(c, s, x1, 1, vb, sizeof vb), sizeof v);
  cr_assert(memcmp(v, vb, sizeof v) == 0);
  /* A collective over both: rank 1 takes no pair secrets, so the group
   * proves the group's secret (docs/protocol.md), and it runs. */
  meshd_ref_t sum = 0;
  cr_assert_eq(meshd_session_reduce(s, x, "gpu", "sum", &sum), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert_eq(fetch_rank(c, s, sum, 0, vb, sizeof vb), sizeof v);
  for (int i = 0; i < 4; i++)
    cr_assert_eq(vb[i], (int32_t)(2u * (uint32_t)v[i]), "element %d after the reduce", i);
  meshd_session_close(s);
  meshd_close(c);
}

static void start_five(void) { start_server_full("5", NULL, NULL); }

TestSuite(c_client_five, .init = start_five, .fini = stop_server, .timeout = 90);

/* The Literals of one Submit message send at most 8 MiB to the agents together
 * (the server refuses the one past it): a pipeline whose next Literal would
 * pass that sends its batch first. Two 1,000,000-byte Literals on 5 ranks send
 * 10 MB: they go in two messages, and both are accepted, exact. */
Test(c_client_five, a_pipeline_keeps_its_batches_literals_under_the_servers_bound) {
  meshd_client_t *c = connect_ok();
  meshd_session_t *s = meshd_session_open(c, "c-literal-budget", NULL);
  cr_assert_not_null(s);
  const char *dims[] = {"gpu"};
  int64_t five[] = {5};
  meshd_ref_t m = 0, x[2] = {0};
  cr_assert_eq(meshd_session_create_mesh(s, dims, five, 1, &m), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  meshd_pipeline_options_t po = {.max_batch = 256, .max_delay_us = 30000000};
  cr_assert_eq(meshd_session_set_pipeline(s, &po), MESHD_E_OK);
  size_t n = 1000000;
  uint8_t *data = malloc(n), *back = malloc(n);
  cr_assert(data && back);
  int64_t shape[] = {(int64_t)n};
  for (int i = 0; i < 2; i++) {
    fill(data, n, 20 + (unsigned)i);
    cr_assert_eq(meshd_session_literal(s, m, "uint8", shape, 1, data, n, NULL, &x[i]),
                 MESHD_E_OK, "%s", meshd_last_error(c)->message);
  }
  meshd_pipeline_stats_t st = pipe_stats(s);
  cr_assert_eq(st.commands_queued, 2);
  cr_assert_eq(st.messages_sent, 1, "the first Literal did not go out before the second");
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  st = pipe_stats(s);
  cr_assert_eq(st.messages_sent, 2);
  cr_assert_eq(st.rejected, 0);
  for (int i = 0; i < 2; i++) {
    fill(data, n, 20 + (unsigned)i);
    cr_assert_eq(fetch_rank(c, s, x[i], 4, back, n), n);
    cr_assert(memcmp(data, back, n) == 0, "literal %d", i);
  }
  cr_assert_eq(uploads_of(s), 0);
  free(data);
  free(back);
  meshd_session_close(s);
  meshd_close(c);
}

/* A pipelined command bigger than a batch may be (a Release of 1.5 million
 * refs, 7 MB, past the server's 4 MiB --max-message-bytes) goes alone, after
 * the queue: that one call is refused, not the Submit stream with every
 * command batched with it; the command queued before it stands, and the
 * pipeline goes on. */
Test(c_client, an_oversized_pipelined_command_fails_alone) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, y = 0, z = 0;
  meshd_session_t *s = session_on_mesh(c, &m);
  meshd_pipeline_options_t po = {.max_batch = 256, .max_delay_us = 30000000};
  cr_assert_eq(meshd_session_set_pipeline(s, &po), MESHD_E_OK);
  int64_t four[] = {4};
  cr_assert_eq(meshd_session_factory(s, m, "ones", four, 1, 0, &y), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  size_t n = 1500000;
  meshd_ref_t *refs = malloc(n * sizeof *refs);
  cr_assert_not_null(refs);
  for (size_t i = 0; i < n; i++)
    refs[i] = (UINT64_C(1) << 30) + i; /* 5 bytes each */
  cr_assert_neq(meshd_session_release(s, refs, n), MESHD_E_OK, "a 7 MB Release went through");
  free(refs);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "the stream: %s", meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_factory(s, m, "ones", four, 1, 0, &z), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  const char *dims[] = {"gpu"};
  meshd_values_t v;
  cr_assert_eq(meshd_session_fetch(s, y, dims, (int64_t[]){1}, 1, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_float_eq(v.values[3], 1.0, 1e-9);
  meshd_values_free(&v);
  meshd_session_close(s);
  meshd_close(c);
}

static void start_small_messages(void) {
  const char *extra[] = {"--max-message-bytes", "64KiB", NULL};
  start_server_with(extra);
}

TestSuite(c_client_small_messages, .init = start_small_messages, .fini = stop_server,
          .timeout = 60);

/* A batch over the server's --max-message-bytes ends the Submit stream: the
 * next call that needs an answer says so, and setting the pipeline again
 * opens a new stream, on which the session goes on. */
Test(c_client_small_messages, setting_a_failed_pipeline_again_opens_a_new_stream) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, x = 0, y = 0;
  meshd_session_t *s = session_on_mesh(c, &m);
  meshd_pipeline_options_t po = {.max_batch = 256, .max_delay_us = 30000000};
  cr_assert_eq(meshd_session_set_pipeline(s, &po), MESHD_E_OK);
  size_t n = 100000;
  uint8_t *data = calloc(1, n);
  int64_t shape[] = {(int64_t)n}, four[] = {4};
  cr_assert_eq(meshd_session_literal(s, m, "uint8", shape, 1, data, n, NULL, &x), MESHD_E_OK,
               "%s", meshd_last_error(c)->message);
  cr_assert_neq(meshd_session_sync(s), MESHD_E_OK);
  cr_assert(strstr(meshd_last_error(c)->message, "Submit stream failed"), "%s",
            meshd_last_error(c)->message);
  cr_assert_neq(meshd_session_factory(s, m, "ones", four, 1, 0, &y), MESHD_E_OK,
                "a failed stream took a command");

  cr_assert_eq(meshd_session_set_pipeline(s, &po), MESHD_E_OK);
  cr_assert_eq(meshd_session_factory(s, m, "ones", four, 1, 0, &y), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert_eq(pipe_stats(s).commands_answered, 1, "not a new stream's counters");
  const char *dims[] = {"gpu"};
  meshd_values_t v;
  cr_assert_eq(meshd_session_fetch(s, y, dims, (int64_t[]){1}, 1, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_float_eq(v.values[3], 1.0, 1e-9);
  meshd_values_free(&v);
  free(data);
  meshd_session_close(s);
  meshd_close(c);
}

static void start_slow(void) {
  static const char *const extra[] = {"--session-max-queued", "2", NULL};
  start_server_fault("reduce:slow=1500", extra);
}

TestSuite(c_client_slow, .init = start_slow, .fini = stop_server, .timeout = 60);

/* A command whose call times out may still have been accepted (here the
 * server holds an Execute's answer while the session is over its flow bound,
 * past the client's 700 ms): its ref is skipped, so the next command does
 * not take it again and get REF_REUSED, as every later one did before. */
Test(c_client_slow, a_command_that_timed_out_does_not_leave_its_ref_for_the_next) {
  meshd_err_t e;
  meshd_client_t *c = meshd_connect(target, 700, &e);
  cr_assert_not_null(c, "connect: %s", meshd_strerror(e));
  meshd_ref_t m = 0, x = 0, r = 0, y = 0;
  meshd_session_t *s = session_on_mesh(c, &m);
  int64_t four[] = {4};
  cr_assert_eq(meshd_session_factory(s, m, "ones", four, 1, 0, &x), MESHD_E_OK);
  meshd_err_t rc = MESHD_E_OK;
  int n = 0;
  for (; n < 6 && rc == MESHD_E_OK; n++) /* 1.5 s each on the agents, a bound of 2 */
    rc = meshd_session_reduce(s, x, "gpu", "sum", &r);
  cr_assert_eq(rc, MESHD_E_DEADLINE, "reduce %d: %s (%s)", n, meshd_strerror(rc),
               meshd_last_error(c)->message);
  /* The held answer comes once the agents make room: then a new tensor. */
  for (int i = 0; i < 40; i++) {
    rc = meshd_session_factory(s, m, "zeros", four, 1, 0, &y);
    if (rc != MESHD_E_DEADLINE)
      break;
  }
  cr_assert_eq(rc, MESHD_E_OK, "%s: %s", meshd_strerror(rc), meshd_last_error(c)->message);
  cr_assert_gt(y, r);
  meshd_session_close(s);
  meshd_close(c);
}

/* meshd_session_fetch gives float16 and bfloat16 tensors as doubles, exact
 * (normal, subnormal, the largest, a sign): it refused them as unsupported. */
Test(c_client, fetch_gives_half_precision_values) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, h = 0, b = 0;
  meshd_session_t *s = session_on_mesh(c, &m);
  uint16_t half[4] = {0x3C00, 0xC100, 0x7BFF, 0x0001};
  uint16_t bf[4] = {0x3F80, 0xC020, 0x7F7F, 0x3A83};
  int64_t four[] = {4};
  cr_assert_eq(meshd_session_literal(s, m, "float16", four, 1, half, sizeof half, NULL, &h),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_literal(s, m, "bfloat16", four, 1, bf, sizeof bf, NULL, &b),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  const char *dims[] = {"gpu"};
  int64_t at1[] = {1};
  meshd_values_t v;
  cr_assert_eq(meshd_session_fetch(s, h, dims, at1, 1, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  double want_h[4] = {1.0, -2.5, 65504.0, 0x1p-24};
  cr_assert_eq(v.n, 4);
  for (int i = 0; i < 4; i++)
    cr_assert_eq(v.values[i], want_h[i], "float16 [%d]: %g, want %g", i, v.values[i], want_h[i]);
  meshd_values_free(&v);
  cr_assert_eq(meshd_session_fetch(s, b, dims, at1, 1, &v), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  double want_b[4] = {1.0, -2.5, 0x1.fep127, 0x1.06p-10};
  for (int i = 0; i < 4; i++)
    cr_assert_eq(v.values[i], want_b[i], "bfloat16 [%d]: %a, want %a", i, v.values[i], want_b[i]);
  meshd_values_free(&v);
  meshd_session_close(s);
  meshd_close(c);
}

/* Turning the pipeline off waits for its answers; a rejection that comes
 * after that wait's deadline but while the stream closes is still reported,
 * not dropped (here the server reads the bad command only once the first slow
 * reduce, 1.5 s, makes room under --session-max-queued 2; the wait is 1.2 s). */
Test(c_client_slow, turning_a_pipeline_off_reports_a_rejection_that_came_late) {
  meshd_err_t e;
  meshd_client_t *c = meshd_connect(target, 1200, &e);
  cr_assert_not_null(c, "connect: %s", meshd_strerror(e));
  meshd_ref_t m = 0, x = 0, r = 0, y = 0;
  meshd_session_t *s = session_on_mesh(c, &m);
  int64_t four[] = {4};
  cr_assert_eq(meshd_session_factory(s, m, "ones", four, 1, 0, &x), MESHD_E_OK);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  meshd_pipeline_options_t po = {.max_batch = 1};
  cr_assert_eq(meshd_session_set_pipeline(s, &po), MESHD_E_OK);
  for (int i = 0; i < 2; i++) /* the bound: the next command waits for the first */
    cr_assert_eq(meshd_session_reduce(s, x, "gpu", "sum", &r), MESHD_E_OK);
  meshd_arg_t args[1] = {{.type = MESHD_ARG_REF, .ref = x}};
  cr_assert_eq(meshd_session_call(s, "frobnicate", args, 1, &y), MESHD_E_OK);
  int64_t t0 = now_ms();
  e = meshd_session_set_pipeline(s, NULL);
  cr_assert_eq(e, MESHD_E_RPC, "%s: %s", meshd_strerror(e), meshd_last_error(c)->message);
  cr_assert_str_eq(meshd_last_error(c)->kind, "UNKNOWN_OP", "%s", meshd_last_error(c)->message);
  cr_assert_eq(meshd_last_error(c)->seq, meshd_session_last_seq(s));
  cr_assert_gt(now_ms() - t0, 1000, "the rejection came within the first wait: no late path");
  meshd_session_close(s);
  meshd_close(c);
}

static void start_faulty(void) { start_server_fault("reduce:fail", NULL); }

TestSuite(c_client_faulty, .init = start_faulty, .fini = stop_server, .timeout = 60);

/* A Sync reports each failure once: the ones after the first are named in the
 * message too (only the first was, and the rest were lost). */
Test(c_client_faulty, a_sync_names_every_failure_it_reports) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, x = 0, r1 = 0, r2 = 0;
  meshd_session_t *s = session_on_mesh(c, &m);
  int64_t four[] = {4};
  cr_assert_eq(meshd_session_factory(s, m, "ones", four, 1, 0, &x), MESHD_E_OK);
  cr_assert_eq(meshd_session_reduce(s, x, "gpu", "sum", &r1), MESHD_E_OK);
  cr_assert_eq(meshd_session_reduce(s, x, "gpu", "max", &r2), MESHD_E_OK);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_RPC);
  const char *msg = meshd_last_error(c)->message;
  cr_assert(strstr(msg, "injected fault") && strstr(msg, "(and 1 more:"), "%s", msg);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "reported twice: %s",
               meshd_last_error(c)->message);
  meshd_session_close(s);
  meshd_close(c);
}

/* A TCP proxy on 127.0.0.1 in front of the server, one thread per connection.
 * The first `limit` connections on which the client sends "FinishUpload" (a
 * path's first use on a connection is an HPACK literal) are cut: the server's bytes
 * after it are dropped, and the connection is closed once the server answered
 * (at most 3 s on). The client's call fails UNAVAILABLE although the server
 * processed it: an answer lost, with only real parts. */
#define PROXY_PUMPS 16
typedef struct {
  int lfd, port, server_port, limit;
  const char *key; /* what the client sends on a connection that is cut (< 64 bytes) */
  atomic_int stop, cuts;
  pthread_t acceptor;
  pthread_t pumps[PROXY_PUMPS];
  atomic_size_t npumps;
} cut_proxy_t;

typedef struct {
  cut_proxy_t *p;
  int cfd, sfd;
} pump_t;

static bool send_all(int fd, const char *b, size_t n) {
  while (n > 0) {
    ssize_t k = send(fd, b, n, MSG_NOSIGNAL);
    if (k <= 0)
      return false;
    b += k;
    n -= (size_t)k;
  }
  return true;
}

/* Whether one more connection may be cut (counted if so). */
static bool take_cut(cut_proxy_t *p) {
  int done = atomic_load(&p->cuts);
  while (done < p->limit)
    if (atomic_compare_exchange_weak(&p->cuts, &done, done + 1))
      return true;
  return false;
}

static void *pump_main(void *arg) {
  pump_t *pp = arg;
  const char *key = pp->p->key;
  size_t klen = strlen(key);
  enum { KEEP = 63, CHUNK = 65536 };
  char *buf = malloc(KEEP + CHUNK);
  size_t kept = 0; /* the client's last bytes, for a key split between reads */
  int64_t cut_at = 0, close_at = 0;
  struct pollfd f[2] = {{.fd = pp->cfd, .events = POLLIN}, {.fd = pp->sfd, .events = POLLIN}};
  while (buf && !atomic_load(&pp->p->stop) && !(close_at && now_ms() >= close_at)) {
    if (poll(f, 2, 20) <= 0)
      continue;
    if (f[0].revents) {
      ssize_t n = recv(pp->cfd, buf + kept, CHUNK, 0);
      if (n <= 0 || !send_all(pp->sfd, buf + kept, (size_t)n))
        break;
      size_t all = kept + (size_t)n;
      if (!cut_at && memmem(buf, all, key, klen) && take_cut(pp->p)) {
        cut_at = now_ms();
        close_at = cut_at + 3000;
      }
      kept = all < KEEP ? all : KEEP;
      memmove(buf, buf + all - kept, kept);
    }
    if (f[1].revents) {
      ssize_t n = recv(pp->sfd, buf + KEEP, CHUNK, 0);
      if (n <= 0)
        break;
      if (cut_at && close_at > now_ms() + 200)
        close_at = now_ms() + 200; /* the answer's frames all in, dropped */
      if (!cut_at && !send_all(pp->cfd, buf + KEEP, (size_t)n))
        break;
    }
  }
  close(pp->cfd);
  close(pp->sfd);
  free(buf);
  free(pp);
  return NULL;
}

static void *acceptor_main(void *arg) {
  cut_proxy_t *p = arg;
  struct pollfd f = {.fd = p->lfd, .events = POLLIN};
  while (!atomic_load(&p->stop)) {
    if (poll(&f, 1, 20) <= 0)
      continue;
    int cfd = accept(p->lfd, NULL, NULL);
    if (cfd < 0)
      continue;
    int sfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)p->server_port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    pump_t *pp = malloc(sizeof *pp);
    size_t i = atomic_load(&p->npumps);
    if (sfd < 0 || !pp || i == PROXY_PUMPS || connect(sfd, (void *)&a, sizeof a) != 0) {
      close(cfd);
      if (sfd >= 0)
        close(sfd);
      free(pp);
      continue;
    }
    *pp = (pump_t){p, cfd, sfd};
    if (pthread_create(&p->pumps[i], NULL, pump_main, pp) != 0) {
      close(cfd);
      close(sfd);
      free(pp);
      continue;
    }
    atomic_store(&p->npumps, i + 1);
  }
  return NULL;
}

static void proxy_start_key(cut_proxy_t *p, int limit, const char *key) {
  memset(p, 0, sizeof *p);
  p->limit = limit;
  p->key = key;
  p->server_port = atoi(strrchr(target, ':') + 1);
  p->lfd = socket(AF_INET, SOCK_STREAM, 0);
  cr_assert_geq(p->lfd, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  cr_assert_eq(bind(p->lfd, (void *)&a, sizeof a), 0);
  cr_assert_eq(listen(p->lfd, 16), 0);
  cr_assert_eq(getsockname(p->lfd, (void *)&a, &len), 0);
  p->port = ntohs(a.sin_port);
  cr_assert_eq(pthread_create(&p->acceptor, NULL, acceptor_main, p), 0);
}

static void proxy_start(cut_proxy_t *p, int limit) { proxy_start_key(p, limit, "FinishUpload"); }

static void proxy_stop(cut_proxy_t *p) {
  atomic_store(&p->stop, 1);
  pthread_join(p->acceptor, NULL);
  for (size_t i = 0; i < atomic_load(&p->npumps); i++)
    pthread_join(p->pumps[i], NULL);
  close(p->lfd);
}

/* A client of the server through proxy px. */
static meshd_client_t *connect_via(const cut_proxy_t *px) {
  char to[64];
  snprintf(to, sizeof to, "127.0.0.1:%d", px->port);
  meshd_err_t e;
  meshd_client_t *c = meshd_connect(to, 10000, &e);
  cr_assert_not_null(c, "connect: %s", meshd_strerror(e));
  return c;
}

/* The answer to a direct upload's FinishUpload is lost after the server
 * defined the tensor (the connection drops: UNAVAILABLE): the client asks
 * again, gets the same answer, and the upload succeeds, its bytes where they
 * belong. (It reported UNAVAILABLE, the tensor defined behind its back.) */
Test(c_client, a_direct_upload_whose_finish_answer_is_lost_asks_again) {
  cut_proxy_t px;
  proxy_start(&px, 1);
  meshd_client_t *c = connect_via(&px);
  meshd_ref_t m = 0;
  meshd_session_t *s = session_on_mesh(c, &m);
  cr_assert_eq(meshd_session_set_data_path(s, MESHD_DATA_PATH_DIRECT), MESHD_E_OK);
  meshd_err_t rc = round_trip(s, m, 1000, 11);
  cr_assert_eq(atomic_load(&px.cuts), 1, "no FinishUpload went through the proxy");
  cr_assert_eq(rc, MESHD_E_OK, "%s: %s", meshd_strerror(rc), meshd_last_error(c)->message);
  meshd_transfer_stats_t st = stats_of(s);
  cr_assert_eq(st.direct_uploads, 1);
  cr_assert_eq(st.proxy_uploads + st.fallbacks, 0, "%s", st.last_fallback);
  meshd_session_close(s);
  meshd_close(c);
  proxy_stop(&px);
}

/* Both FinishUpload answers are lost, the first after the server defined the
 * tensor: the abandon's answer carries it, and the client drops it before it
 * reports the failure. (The tensor stood, the caller told it did not.) */
Test(c_client, a_direct_upload_whose_finish_answers_are_both_lost_drops_the_tensor) {
  cut_proxy_t px;
  proxy_start(&px, 2);
  meshd_client_t *c = connect_via(&px);
  const char *name = "c-finish-lost-twice", *dims[] = {"gpu"};
  meshd_session_t *s = meshd_session_open(c, name, NULL);
  cr_assert_not_null(s);
  int64_t sizes[] = {2};
  meshd_ref_t m = 0;
  cr_assert_eq(meshd_session_create_mesh(s, dims, sizes, 1, &m), MESHD_E_OK);
  cr_assert_eq(meshd_session_set_data_path(s, MESHD_DATA_PATH_DIRECT), MESHD_E_OK);
  uint64_t live0, bytes0, live1, bytes1;
  session_row(c, name, &live0, &bytes0);
  meshd_err_t rc = round_trip(s, m, 1000, 12);
  cr_assert_eq(atomic_load(&px.cuts), 2, "%d FinishUpload connections cut, not 2",
               atomic_load(&px.cuts));
  cr_assert_neq(rc, MESHD_E_OK, "the upload succeeded although both answers were lost");
  cr_assert_str_eq(meshd_last_error(c)->grpc_code_name, "UNAVAILABLE", "%s",
                   meshd_last_error(c)->message); /* the first failure, not the drop's */
  session_row(c, name, &live1, &bytes1);
  cr_assert_eq(live1, live0, "the failed upload's tensor stands: %llu live tensors, not %llu",
               (unsigned long long)live1, (unsigned long long)live0);
  cr_assert_eq(bytes1, bytes0);
  rc = round_trip(s, m, 1000, 13);
  cr_assert_eq(rc, MESHD_E_OK, "%s: %s", meshd_strerror(rc), meshd_last_error(c)->message);
  meshd_session_close(s);
  meshd_close(c);
  proxy_stop(&px);
}

/* ------------------------------------------------------------ lost answers, deadlines, rejections */

/* PlanTransfer's answer is lost after the server claimed the upload's ref
 * (the connection drops: UNAVAILABLE). The ref is spent all the same, so the
 * session's next commands take later ones. (The client kept it, and every
 * later ref-making call was refused REF_REUSED, which takes no ref: for good.) */
Test(c_client, a_direct_upload_whose_plan_answer_is_lost_spends_its_ref) {
  cut_proxy_t px;
  proxy_start_key(&px, 1, "PlanTransfer");
  meshd_client_t *c = connect_via(&px);
  meshd_ref_t m = 0, t = 0, x = 0;
  meshd_session_t *s = session_on_mesh(c, &m);
  uint8_t data[1000];
  fill(data, sizeof data, 14);
  int64_t shape[] = {(int64_t)sizeof data}, four[] = {4};
  meshd_err_t rc = meshd_session_upload(s, m, "uint8", shape, 1, data, sizeof data, &t);
  cr_assert_eq(atomic_load(&px.cuts), 1, "no PlanTransfer went through the proxy");
  cr_assert_neq(rc, MESHD_E_OK, "the upload succeeded although its plan's answer was lost");
  rc = meshd_session_factory(s, m, "ones", four, 1, 0, &x);
  cr_assert_eq(rc, MESHD_E_OK, "the next command: %s: %s: %s", meshd_strerror(rc),
               meshd_last_error(c)->kind, meshd_last_error(c)->message);
  rc = round_trip(s, m, 1000, 15);
  cr_assert_eq(rc, MESHD_E_OK, "the next upload: %s: %s: %s", meshd_strerror(rc),
               meshd_last_error(c)->kind, meshd_last_error(c)->message);
  meshd_session_close(s);
  meshd_close(c);
  proxy_stop(&px);
}

/* The answer to a proxied Upload is lost after the server defined the tensor
 * (UNAVAILABLE): the caller, told it failed and given no ref, cannot free it;
 * the client lets go of it. (It stood, its bytes held on every rank, until the
 * session closed.) */
Test(c_client, a_proxied_upload_whose_answer_is_lost_leaves_no_tensor) {
  cut_proxy_t px;
  proxy_start_key(&px, 1, "TensorService/Upload");
  meshd_client_t *c = connect_via(&px);
  const char *name = "c-upload-lost", *dims[] = {"gpu"};
  meshd_session_t *s = meshd_session_open(c, name, NULL);
  cr_assert_not_null(s);
  int64_t sizes[] = {2};
  meshd_ref_t m = 0, t = 0;
  cr_assert_eq(meshd_session_create_mesh(s, dims, sizes, 1, &m), MESHD_E_OK);
  cr_assert_eq(meshd_session_set_data_path(s, MESHD_DATA_PATH_PROXY), MESHD_E_OK);
  uint64_t live0, bytes0, live1, bytes1;
  session_row(c, name, &live0, &bytes0);
  uint8_t data[1000];
  fill(data, sizeof data, 16);
  int64_t shape[] = {(int64_t)sizeof data};
  meshd_err_t rc = meshd_session_upload(s, m, "uint8", shape, 1, data, sizeof data, &t);
  cr_assert_eq(atomic_load(&px.cuts), 1, "no Upload went through the proxy");
  cr_assert_neq(rc, MESHD_E_OK, "the upload succeeded although its answer was lost");
  meshd_session_sync(s);
  session_row(c, name, &live1, &bytes1);
  cr_assert_eq(live1, live0, "the failed upload's tensor stands: %llu live tensors, not %llu",
               (unsigned long long)live1, (unsigned long long)live0);
  cr_assert_eq(bytes1, bytes0);
  meshd_session_close(s);
  meshd_close(c);
  proxy_stop(&px);
}

/* A proxied Upload whose deadline passes (the server waits on a stopped agent)
 * is MESHD_E_DEADLINE with kind DEADLINE_EXCEEDED, as meshd.h promises of every
 * call, never MESHD_E_RPC. */
Test(c_client_lease, a_proxied_upload_past_its_deadline_is_meshd_e_deadline) {
  meshd_err_t e;
  meshd_client_t *c = meshd_connect(target, 1000, &e);
  cr_assert_not_null(c, "connect: %s", meshd_strerror(e));
  meshd_ref_t m = 0, t = 0;
  meshd_session_t *s = session_on_mesh(c, &m);
  cr_assert_eq(meshd_session_set_data_path(s, MESHD_DATA_PATH_PROXY), MESHD_E_OK);
  pid_t pid = agent_pid(0);
  cr_assert_gt(pid, 0);
  stop_agent(pid);
  static uint8_t data[3000];
  int64_t shape[] = {(int64_t)sizeof data};
  meshd_err_t rc = meshd_session_upload(s, m, "uint8", shape, 1, data, sizeof data, &t);
  kill(pid, SIGCONT);
  stopped_agent = -1;
  const meshd_error_info_t *info = meshd_last_error(c);
  cr_assert_eq(rc, MESHD_E_DEADLINE, "%s (grpc %s, kind '%s'): %s", meshd_strerror(rc),
               info->grpc_code_name, info->kind, info->message);
  cr_assert_str_eq(info->kind, "DEADLINE_EXCEEDED");
  meshd_session_close(s);
  meshd_close(c);
}

/* A rejection that came before the Submit stream failed is still reported when
 * a queued call found the stream over and the caller set the pipeline again
 * (meshd.h's way back): it went with the old stream, unreported. */
Test(c_client_small_messages, a_rejection_before_the_stream_failed_survives_setting_it_again) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, x = 0, bad = 0, y = 0;
  meshd_session_t *s = session_on_mesh(c, &m);
  int64_t four[] = {4};
  cr_assert_eq(meshd_session_factory(s, m, "ones", four, 1, 0, &x), MESHD_E_OK);
  meshd_pipeline_options_t po = {.max_batch = 1, .max_delay_us = 30000000};
  cr_assert_eq(meshd_session_set_pipeline(s, &po), MESHD_E_OK);
  meshd_arg_t arg = {.type = MESHD_ARG_REF, .ref = x};
  cr_assert_eq(meshd_session_call(s, "no_such_op", &arg, 1, &bad), MESHD_E_OK);
  uint64_t bad_seq = meshd_session_last_seq(s);
  for (int i = 0; i < 300 && pipe_stats(s).rejected == 0; i++)
    sleep_ms(10);
  cr_assert_eq(pipe_stats(s).rejected, 1, "the rejection never came");
  size_t n = 100000; /* over --max-message-bytes: the server ends the stream */
  uint8_t *data = calloc(1, n);
  int64_t shape[] = {(int64_t)n};
  cr_assert_eq(meshd_session_literal(s, m, "uint8", shape, 1, data, n, NULL, &y), MESHD_E_OK,
               "%s", meshd_last_error(c)->message);
  free(data);
  meshd_err_t e = MESHD_E_OK;
  for (int i = 0; i < 300 && e == MESHD_E_OK; i++) {
    e = meshd_session_factory(s, m, "ones", four, 1, 0, &y);
    if (e == MESHD_E_OK)
      sleep_ms(10);
  }
  cr_assert_eq(e, MESHD_E_RPC, "%s", meshd_last_error(c)->message);
  cr_assert(strstr(meshd_last_error(c)->message, "Submit stream"), "%s",
            meshd_last_error(c)->message);
  meshd_err_t on = meshd_session_set_pipeline(s, &po);
  bool reported = on == MESHD_E_RPC && meshd_last_error(c)->seq == bad_seq;
  if (!reported) {
    cr_assert_eq(on, MESHD_E_OK, "%s", meshd_last_error(c)->message);
    e = meshd_session_sync(s);
    reported = e == MESHD_E_RPC && meshd_last_error(c)->seq == bad_seq;
  }
  cr_assert(reported, "seq %llu's UNKNOWN_OP was never reported (last: %s, seq %llu)",
            (unsigned long long)bad_seq, meshd_last_error(c)->message,
            (unsigned long long)meshd_last_error(c)->seq);
  meshd_session_close(s);
  meshd_close(c);
}

/* A call that needs an answer keeps one deadline, the wait for the pipeline's
 * answers included (meshd.h: "bounded by its deadline"): a Sync behind three
 * slow reduces (1.5 s each, a bound of 2: the third is read after 1.5 s) ends
 * at the client's 2 s, not 2 s after the queue was answered. */
Test(c_client_slow, a_sync_behind_a_pipeline_keeps_one_deadline) {
  meshd_err_t e;
  meshd_client_t *c = meshd_connect(target, 2000, &e);
  cr_assert_not_null(c, "connect: %s", meshd_strerror(e));
  meshd_ref_t m = 0, x = 0, r = 0;
  meshd_session_t *s = session_on_mesh(c, &m);
  int64_t four[] = {4};
  cr_assert_eq(meshd_session_factory(s, m, "ones", four, 1, 0, &x), MESHD_E_OK);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  meshd_pipeline_options_t po = {.max_batch = 1};
  cr_assert_eq(meshd_session_set_pipeline(s, &po), MESHD_E_OK);
  for (int i = 0; i < 3; i++)
    cr_assert_eq(meshd_session_reduce(s, x, "gpu", "sum", &r), MESHD_E_OK);
  int64_t t0 = now_ms();
  e = meshd_session_sync(s);
  int64_t took = now_ms() - t0;
  cr_assert_eq(e, MESHD_E_DEADLINE, "%s: %s", meshd_strerror(e), meshd_last_error(c)->message);
  cr_assert_lt(took, 2600, "a sync with a 2000 ms timeout took %lld ms", (long long)took);
  meshd_session_close(s);
  meshd_close(c);
}

/* rank 1's agent takes one Write, then refuses every other */
static void start_write_refused_rank1(void) { start_server_fault("write:fail,rank=1,after=1", NULL); }

TestSuite(c_client_write_fault, .init = start_write_refused_rank1, .fini = stop_server, .timeout = 60);

/* A direct upload whose rank-1 agent refuses its Write at once (an injected
 * fault) while rank 0's agent stops reading (SIGSTOPped): the first shard to
 * fail cancels the others (a healthy one would write its whole shard for
 * nothing), and the caller is told that cause, not the error of a shard it
 * stopped or of one that went on failing after (rank 0's, which came first in
 * rank order). It ends before the 10 s deadline; the session works after. */
Test(c_client_write_fault, a_direct_upload_ends_on_its_first_failed_shard) {
  meshd_err_t e;
  meshd_client_t *c = meshd_connect(target, 10000, &e);
  cr_assert_not_null(c, "connect: %s", meshd_strerror(e));
  meshd_ref_t m = 0;
  meshd_session_t *s = direct_session_with_channels(c, &m);
  int64_t took = 0;
  meshd_err_t rc = upload_to_a_stopped_agent(s, m, 0, 6, &took);
  cr_assert_neq(rc, MESHD_E_OK, "an upload whose rank 1 refused its Write succeeded");
  const char *msg = meshd_last_error(c)->message;
  cr_assert(strstr(msg, "rank 1") && strstr(msg, "injected fault"), "not the cause: %s", msg);
  cr_assert_lt(took, 9000, "the upload took %lld ms (deadline 10000 ms): %s", (long long)took,
               msg);
  /* rank 0, stopped 5 s, may have been declared lost: a new mesh uses its
   * replacement */
  meshd_ref_t x = 0, m2 = 0;
  int64_t four[] = {4}, two[] = {2};
  const char *dims[] = {"gpu"};
  int64_t t1 = now_ms();
  do {
    rc = meshd_session_create_mesh(s, dims, two, 1, &m2);
    if (rc == MESHD_E_OK)
      rc = meshd_session_factory(s, m2, "ones", four, 1, 0, &x);
    if (rc != MESHD_E_OK)
      sleep_ms(200);
  } while (rc != MESHD_E_OK && now_ms() - t1 < 20000);
  cr_assert_eq(rc, MESHD_E_OK, "the session after: %s", meshd_last_error(c)->message);
  meshd_session_close(s);
  meshd_close(c);
}

/* meshd.h promises that a failed meshd_session_fetch_bytes names the rank at
 * fault. A proxied fetch of two parts whose rank-1 agent is wedged ended
 * "Fetch: no answer within N ms", naming no part (the direct path names the
 * rank and its agent). */
Test(c_client_lease, a_proxied_fetch_that_times_out_names_its_part) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, x = 0;
  meshd_session_t *s = open_on_two_gpus(c, "c-proxy-part", &m);
  const char *dims[] = {"gpu"};
  int64_t at0[] = {0}, at1[] = {1};
  cr_assert_eq(meshd_session_factory(s, m, "ones", (int64_t[]){4}, 1, 0, &x), MESHD_E_OK);
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_set_data_path(s, MESHD_DATA_PATH_PROXY), MESHD_E_OK);
  pid_t pid = agent_pid(1);
  cr_assert_gt(pid, 0);
  stop_agent(pid);
  float b0[4], b1[4];
  meshd_fetch_part_t parts[2] = {{dims, at0, 1, b0, sizeof b0, 0}, {dims, at1, 1, b1, sizeof b1, 0}};
  meshd_fetch_options_t o = MESHD_FETCH_OPTIONS_INIT;
  o.timeout_ms = 1000;
  meshd_err_t rc = meshd_session_fetch_bytes(s, x, parts, 2, &o);
  kill(pid, SIGCONT);
  stopped_agent = -1;
  cr_assert_eq(rc, MESHD_E_DEADLINE, "%s: %s", meshd_strerror(rc), meshd_last_error(c)->message);
  const char *msg = meshd_last_error(c)->message;
  cr_assert(strstr(msg, "gpu=1") || strstr(msg, "rank 1"), "names no part: %s", msg);
  /* Part 0's agent runs: unless a loaded machine made it late too (then the
   * message names it as well), its bytes came. */
  if (!strstr(msg, "gpu=0"))
    cr_assert_eq(parts[0].nbytes, sizeof b0, "part 0 (its agent runs) got %zu bytes",
                 parts[0].nbytes);
  meshd_session_close(s);
  meshd_close(c);
}

static void *resume_server_later(void *arg) {
  sleep_ms(*(int *)arg);
  kill(server_pid, SIGCONT);
  return NULL;
}

/* An upload behind pipelined commands keeps one deadline, the client's
 * timeout, for their answers and the transfer (as the Python client's upload
 * and the Execute of a command behind a pipeline): here the answers come at
 * 700 ms (the server was paused) and the Write to the stopped rank-1 agent
 * then took a whole timeout of its own (1.7 s with a 1 s timeout). */
Test(c_client_lease, an_upload_behind_a_pipeline_keeps_one_deadline) {
  meshd_err_t e;
  meshd_client_t *c = meshd_connect(target, 1000, &e);
  cr_assert_not_null(c, "connect: %s", meshd_strerror(e));
  meshd_ref_t m = 0, x = 0, y = 0, t = 0;
  meshd_session_t *s = direct_session_with_channels(c, &m);
  cr_assert_eq(meshd_session_factory(s, m, "ones", (int64_t[]){4}, 1, 0, &x), MESHD_E_OK);
  meshd_pipeline_options_t po = {.max_batch = 64, .max_delay_us = 1000000};
  cr_assert_eq(meshd_session_set_pipeline(s, &po), MESHD_E_OK);
  pid_t pid = agent_pid(1);
  cr_assert_gt(pid, 0);
  stop_agent(pid);
  meshd_arg_t args[2] = {{.type = MESHD_ARG_REF, .ref = x}, {.type = MESHD_ARG_FLOAT, .f = 1.0}};
  cr_assert_eq(meshd_session_call(s, "add", args, 2, &y), MESHD_E_OK, "%s",
               meshd_last_error(c)->message);
  cr_assert_eq(kill(server_pid, SIGSTOP), 0);
  int later = 700;
  pthread_t th;
  cr_assert_eq(pthread_create(&th, NULL, resume_server_later, &later), 0);
  static uint8_t data[3000];
  int64_t shape[] = {(int64_t)sizeof data};
  int64_t t0 = now_ms();
  meshd_err_t rc = meshd_session_upload(s, m, "uint8", shape, 1, data, sizeof data, &t);
  int64_t took = now_ms() - t0;
  pthread_join(th, NULL);
  kill(pid, SIGCONT);
  stopped_agent = -1;
  cr_assert_eq(rc, MESHD_E_DEADLINE, "%s: %s", meshd_strerror(rc), meshd_last_error(c)->message);
  cr_assert_lt(took, 1450, "the upload took %lld ms with a 1000 ms timeout (%s)", (long long)took,
               meshd_last_error(c)->message);
  meshd_session_close(s);
  meshd_close(c);
}

/* ------------------------------- more Reads waiting on one agent than it keeps */

#define READS_FULL_SESSIONS 9
#define READS_FULL_FETCHES 8

/* One agent whose first 9 op calls on rank 0 run 4 s: the fetches of their
 * results wait on the agent for their seqs. */
static void start_slow_calls(void) {
  const char *const flags[] = {"--data-path=direct", NULL};
  setenv("MESHD_FAULT", "call:slow=4000,rank=0,count=9", 1); /* the local agent inherits it */
  start_server_full("1", flags, NULL);
  unsetenv("MESHD_FAULT");
}

TestSuite(c_client_reads_full, .init = start_slow_calls, .fini = stop_server, .timeout = 90);

typedef struct {
  meshd_client_t *c;
  meshd_session_t *s;
  meshd_ref_t y;
  float back[READS_FULL_FETCHES][16];
  meshd_err_t rc;
  char msg[512];
} reads_full_t;

static void *fetch_eight(void *arg) {
  reads_full_t *r = arg;
  const char *dims[] = {"gpu"};
  int64_t at0[] = {0};
  meshd_fetch_part_t parts[READS_FULL_FETCHES];
  for (int i = 0; i < READS_FULL_FETCHES; i++)
    parts[i] = (meshd_fetch_part_t){dims, at0, 1, r->back[i], sizeof r->back[i], 0};
  meshd_fetch_options_t o = MESHD_FETCH_OPTIONS_INIT;
  o.timeout_ms = 60000;
  r->rc = meshd_session_fetch_bytes(r->s, r->y, parts, READS_FULL_FETCHES, &o);
  if (r->rc != MESHD_E_OK)
    snprintf(r->msg, sizeof r->msg, "%s", meshd_last_error(r->c)->message);
  return NULL;
}

/* 9 sessions each fetch a value still being computed 8 times at once (their
 * --session-max-transfers), directly from one agent: 72 Reads wait for their
 * seq, past the 64 an agent lets wait. The agent refuses the rest
 * RESOURCE_EXHAUSTED "64 Reads already wait" and keeps their grants; the
 * client retries that refusal until its deadline (it failed the fetch before). */
Test(c_client_reads_full, more_direct_fetches_waiting_on_one_agent_than_it_keeps_all_succeed) {
  static reads_full_t r[READS_FULL_SESSIONS];
  pthread_t t[READS_FULL_SESSIONS];
  const char *dims[] = {"gpu"};
  int64_t sizes[] = {1}, shape[] = {16};
  for (int i = 0; i < READS_FULL_SESSIONS; i++) {
    meshd_err_t e;
    r[i].c = meshd_connect(target, 60000, &e);
    cr_assert_not_null(r[i].c, "connect: %s", meshd_strerror(e));
    r[i].s = meshd_session_open(r[i].c, "c-reads-full", &e);
    cr_assert_not_null(r[i].s, "open: %s", meshd_strerror(e));
    meshd_ref_t m = 0, x = 0;
    cr_assert_eq(meshd_session_create_mesh(r[i].s, dims, sizes, 1, &m), MESHD_E_OK, "%s",
                 meshd_last_error(r[i].c)->message);
    cr_assert_eq(meshd_session_factory(r[i].s, m, "ones", shape, 1, 0, &x), MESHD_E_OK, "%s",
                 meshd_last_error(r[i].c)->message);
    meshd_arg_t args[2] = {{.type = MESHD_ARG_REF, .ref = x}, {.type = MESHD_ARG_FLOAT, .f = 2}};
    cr_assert_eq(meshd_session_call(r[i].s, "add", args, 2, &r[i].y), MESHD_E_OK, "%s",
                 meshd_last_error(r[i].c)->message);
  }
  for (int i = 0; i < READS_FULL_SESSIONS; i++)
    cr_assert_eq(pthread_create(&t[i], NULL, fetch_eight, &r[i]), 0);
  for (int i = 0; i < READS_FULL_SESSIONS; i++)
    pthread_join(t[i], NULL);
  int failed = 0;
  const char *first = "";
  for (int i = 0; i < READS_FULL_SESSIONS; i++) {
    if (r[i].rc != MESHD_E_OK) {
      if (!failed++)
        first = r[i].msg;
      continue;
    }
    for (int k = 0; k < READS_FULL_FETCHES; k++)
      for (int j = 0; j < 16; j++)
        cr_assert_float_eq(r[i].back[k][j], 3.0f, 1e-6);
  }
  cr_assert_eq(failed, 0, "%d of %d sessions' fetches failed: %s", failed, READS_FULL_SESSIONS,
               first);
  for (int i = 0; i < READS_FULL_SESSIONS; i++) {
    meshd_session_close(r[i].s);
    meshd_close(r[i].c);
  }
}

/* ------------------------------- read receipts: no DropSnapshot after a direct fetch */

static int receipts_metrics_port; /* the one local agent's /metrics */

/* A port nothing listens on now (the kernel's pick, released). */
static int unused_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  cr_assert(fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
            getsockname(fd, (struct sockaddr *)&a, &len) == 0);
  close(fd);
  return ntohs(a.sin_port);
}

static int receipts_server_metrics_port;

static void start_receipts(void) {
  receipts_metrics_port = unused_port();
  receipts_server_metrics_port = unused_port();
  static char port[16], listen[32];
  snprintf(port, sizeof port, "%d", receipts_metrics_port);
  snprintf(listen, sizeof listen, "127.0.0.1:%d", receipts_server_metrics_port);
  const char *const flags[] = {"--data-path=direct", "--local-agent-metrics-port-base", port,
                               "--metrics-listen", listen, NULL};
  start_server_full("1", flags, NULL);
}

TestSuite(c_client_receipts, .init = start_receipts, .fini = stop_server, .timeout = 60);

/* The value of `series` (a name, with its labels if it has any) on the
 * /metrics of 127.0.0.1:port. */
static long metric_at(int port, const char *series) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port),
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  cr_assert(fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0, "metrics port %d",
            port);
  static const char get[] = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  cr_assert_eq(write(fd, get, sizeof get - 1), (ssize_t)sizeof get - 1);
  static char text[1 << 16];
  size_t got = 0;
  ssize_t n;
  while (got < sizeof text - 1 && (n = read(fd, text + got, sizeof text - 1 - got)) > 0)
    got += (size_t)n;
  close(fd);
  text[got] = '\0';
  char key[160];
  snprintf(key, sizeof key, "\n%s ", series);
  const char *line = strstr(text, key);
  cr_assert_not_null(line, "no %s in the /metrics of port %d: %.300s", series, port, text);
  return atol(line + strlen(key));
}

/* Counter `name` on the /metrics of 127.0.0.1:port, once the agents ran all
 * that session s sent. */
static long metric_after_sync(meshd_session_t *s, int port, const char *name) {
  cr_assert_eq(meshd_session_sync(s), MESHD_E_OK);
  return metric_at(port, name);
}

/* meshd_agent_instructions_total of the agent, once it ran all the session sent. */
static long agent_instructions_ran(meshd_session_t *s) {
  return metric_after_sync(s, receipts_metrics_port, "meshd_agent_instructions_total");
}

/* meshd_link_instructions_total of the server: the instructions it sent its
 * agents (a StatusRequest too, which the agent's count leaves out: it runs on
 * no stream). */
static long link_instructions_sent(meshd_session_t *s) {
  return metric_after_sync(s, receipts_server_metrics_port, "meshd_link_instructions_total");
}

/* A session named name on a mesh of one rank ("gpu": 1), in *m. */
static meshd_session_t *one_rank_session(meshd_client_t *c, const char *name, meshd_ref_t *m) {
  meshd_session_t *s = meshd_session_open(c, name, NULL);
  cr_assert_not_null(s, "%s", meshd_last_error(c)->message);
  cr_assert_eq(meshd_session_create_mesh(s, (const char *[]){"gpu"}, (int64_t[]){1}, 1, m),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  return s;
}

/* Rank 0's shard of x (4 float32) fetched: the values v. */
static void assert_fetches_four(meshd_client_t *c, meshd_session_t *s, meshd_ref_t x,
                                const float *v) {
  meshd_values_t back;
  cr_assert_eq(meshd_session_fetch(s, x, (const char *[]){"gpu"}, (int64_t[]){0}, 1, &back),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert_eq(back.n, 4);
  for (int k = 0; k < 4; k++)
    cr_assert_float_eq(back.values[k], v[k], 0);
  meshd_values_free(&back);
}

/* The C client hands its Read's receipt to FinishFetch: each direct fetch
 * costs its agent one Snapshot and no DropSnapshot (without the receipt, the
 * server drops the snapshot before answering: 2 instructions a fetch). */
Test(c_client_receipts, a_direct_fetch_hands_its_reads_receipt_and_its_agent_runs_no_drop) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, x = 0;
  meshd_session_t *s = one_rank_session(c, "c-receipts", &m);
  float v[4] = {1, 2, 3, 4};
  cr_assert_eq(meshd_session_upload(s, m, "float32", (int64_t[]){4}, 1, v, sizeof v, &x),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  long first = agent_instructions_ran(s);
  long syncs = agent_instructions_ran(s) - first; /* a sync's own */
  long before = agent_instructions_ran(s);
  for (int i = 0; i < 2; i++)
    assert_fetches_four(c, s, x, v);
  long ran = agent_instructions_ran(s) - before;
  meshd_transfer_stats_t st = stats_of(s);
  cr_assert_eq(st.direct_fetches, 2, "the fetches did not go direct: %s", st.last_fallback);
  cr_assert_eq(ran, 2 + syncs, "%ld instructions for 2 fetches (a sync: %ld): a DropSnapshot went "
               "with the receipt", ran - syncs, syncs);
  meshd_session_close(s);
  meshd_close(c);
}

/* A direct upload opens its session on its agent once, not per upload: the
 * server sent every upload's ranks a StatusRequest, an instruction on each
 * agent's link (taken there, and answered with a report) per upload, although
 * the session stays open on an agent until EndSession or the end of its
 * Execute link. */
Test(c_client_receipts, direct_uploads_open_the_session_on_their_agent_once) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, x = 0;
  meshd_session_t *s = one_rank_session(c, "c-upload-opens", &m);
  long before = link_instructions_sent(s); /* (the session has nothing on the agent yet) */
  float v[4] = {1, 2, 3, 4};
  cr_assert_eq(meshd_session_upload(s, m, "float32", (int64_t[]){4}, 1, v, sizeof v, &x),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  long after = link_instructions_sent(s);
  long syncs = link_instructions_sent(s) - after; /* a sync's own, now that the agent has it */
  cr_assert_eq(after - before - syncs, 1, "the session's first upload cost %ld instructions on "
               "its agent's link, not the one that opens the session there",
               after - before - syncs);
  before = link_instructions_sent(s);
  for (int i = 0; i < 3; i++) {
    v[0] = (float)(10 + i);
    cr_assert_eq(meshd_session_upload(s, m, "float32", (int64_t[]){4}, 1, v, sizeof v, &x),
                 MESHD_E_OK, "%s", meshd_last_error(c)->message);
  }
  long ran = link_instructions_sent(s) - before - syncs;
  cr_assert_eq(stats_of(s).direct_uploads, 4, "the uploads did not go direct: %s",
               stats_of(s).last_fallback);
  cr_assert_eq(ran, 0, "3 more uploads cost %ld instructions on the agent's link (a "
               "StatusRequest each)", ran);
  assert_fetches_four(c, s, x, v);
  meshd_session_close(s);
  meshd_close(c);
}

#define DIRECT_FETCHED "meshd_transfer_bytes_total{direction=\"fetch\",path=\"direct\"}"

/* What fetch_finished_mid_read's progress callback saw. */
typedef struct {
  long before;     /* the server's direct fetch bytes before the fetch */
  long want;       /* ...and its count once the fetch's FinishFetch was answered */
  int calls;
  bool mid_read;   /* at its first chunk, the FinishFetch was answered already */
} mid_read_t;

/* At the first chunk, with the rest of the Read still to come (the callback
 * runs inside the fetch, on the calling thread), waits up to 5 s for the
 * server to count the fetch's bytes: it does when FinishFetch answers. */
static void fetch_finished_mid_read(void *user, uint64_t done, uint64_t total) {
  mid_read_t *m = user;
  if (m->calls++ || done >= total)
    return;
  for (int64_t until = rpc_now_ms() + 5000; !m->mid_read && rpc_now_ms() < until;) {
    m->mid_read = metric_at(receipts_server_metrics_port, DIRECT_FETCHED) == m->want;
    if (!m->mid_read)
      nanosleep(&(struct timespec){0, 2000000}, NULL);
  }
}

/* A direct fetch sends its FinishFetch as soon as its Read's receipt arrives
 * (the Read's first message), beside the rest of the Read: the round trip came
 * after the Read's end (~0.25 ms of a 1 MiB fetch's ~1.8). Seen from inside the
 * fetch: at its first data chunk, with 1 MiB still to come, the server has
 * answered the FinishFetch (it counts a direct fetch's bytes then); before,
 * no FinishFetch went while the Read ran, and the callback waited in vain. */
Test(c_client_receipts, a_direct_fetch_finishes_while_its_read_still_runs) {
  meshd_client_t *c = connect_ok();
  meshd_ref_t m = 0, x = 0;
  meshd_session_t *s = one_rank_session(c, "c-finish-early", &m);
  enum { N = 512 * 1024 }; /* 2 MiB of float32: two 1 MiB chunks */
  float *v = malloc(N * sizeof *v);
  cr_assert_not_null(v);
  for (int i = 0; i < N; i++)
    v[i] = (float)i;
  cr_assert_eq(meshd_session_upload(s, m, "float32", (int64_t[]){N}, 1, v, N * sizeof *v, &x),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  mid_read_t seen = {.before = metric_after_sync(s, receipts_server_metrics_port, DIRECT_FETCHED)};
  seen.want = seen.before + (long)(N * sizeof *v);
  meshd_fetch_options_t o = MESHD_FETCH_OPTIONS_INIT;
  o.progress = fetch_finished_mid_read;
  o.progress_user = &seen;
  meshd_values_t back;
  cr_assert_eq(meshd_session_fetch_with(s, x, (const char *[]){"gpu"}, (int64_t[]){0}, 1, &o,
                                        &back),
               MESHD_E_OK, "%s", meshd_last_error(c)->message);
  cr_assert_eq(stats_of(s).direct_fetches, 1, "the fetch did not go direct: %s",
               stats_of(s).last_fallback);
  cr_assert_eq(back.n, (size_t)N);
  for (int i = 0; i < N; i++)
    cr_assert_float_eq(back.values[i], v[i], 0, "value %d", i);
  cr_assert(seen.calls >= 2, "the progress callback ran %d times", seen.calls);
  cr_assert(seen.mid_read, "the FinishFetch was not answered while the Read still ran (the "
            "server counted %ld direct fetch bytes, %ld after it)",
            metric_at(receipts_server_metrics_port, DIRECT_FETCHED) - seen.before,
            seen.want - seen.before);
  meshd_values_free(&back);
  free(v);
  meshd_session_close(s);
  meshd_close(c);
}

/* A direct upload's plan must name every rank of the mesh once, in the mesh's
 * row-major order, one slice each (docs/protocol.md, Direct data path), as the
 * Node client checks: a rank twice, ranks out of the mesh's order, a shard too
 * many or too few is refused before any byte moves. (Only the per-rank count
 * was checked: ranks swapped sent one rank's rows to the other.) */
Test(c_client, a_direct_upload_plan_that_does_not_match_the_mesh_is_refused) {
  Meshd__V1__ShardGrant g[3];
  Meshd__V1__ShardGrant *gp[3] = {&g[0], &g[1], &g[2]};
  for (int i = 0; i < 3; i++)
    meshd__v1__shard_grant__init(&g[i]);
  Meshd__V1__PlanTransferReply p = MESHD__V1__PLAN_TRANSFER_REPLY__INIT;
  p.shards = gp;
  const uint32_t mesh[] = {3, 5};
  char why[640];
  struct {
    uint32_t r[3];
    size_t n;
    bool per_rank, ok;
  } cases[] = {
      {{3, 5}, 2, true, true},      {{3, 5}, 2, false, true},
      {{5, 3}, 2, true, false},     {{5, 3}, 2, false, false}, /* out of the mesh's order */
      {{3, 3}, 2, true, false},     {{3, 3}, 2, false, false}, /* a rank twice, 5 skipped */
      {{3}, 1, true, false},        {{3, 5, 7}, 3, true, false}, /* too few, too many */
      {{0}, 0, false, false},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    for (size_t i = 0; i < cases[c].n; i++)
      g[i].rank = cases[c].r[i];
    p.n_shards = cases[c].n;
    direct_plan_mismatch(&p, cases[c].per_rank, 16, cases[c].per_rank ? 8 : 0, mesh, 2, why,
                         sizeof why);
    cr_assert_eq(why[0] == '\0', cases[c].ok, "case %zu: '%s'", c, why);
  }
  /* the mesh not known here: a rank twice and a split that does not fit still are */
  g[0].rank = g[1].rank = 0;
  p.n_shards = 2;
  direct_plan_mismatch(&p, true, 16, 8, NULL, 0, why, sizeof why);
  cr_assert(strstr(why, "names a rank twice"), "'%s'", why);
  g[1].rank = 1;
  p.n_shards = 1;
  direct_plan_mismatch(&p, true, 16, 8, NULL, 0, why, sizeof why);
  cr_assert(why[0], "one shard for two ranks' rows was accepted");
}
