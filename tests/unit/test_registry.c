/* server/registry.c: who may register (join tokens, a verified certificate),
 * bounded ranks, the call secret on the dial-back, dial-backs in parallel.
 * Against a fake agent in process: Hello answers only with the secret the
 * registration gave, Execute stays open. GetInfo over a pool larger than its
 * reply holds. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "agent_pool.h"
#include "fault.h"
#include "meshd.h"
#include "meshd/agent/v1/agent.pb-c.h"
#include "meshd/v1/agent_registry.pb-c.h"
#include "registry.h"
#include "rpc.h"
#include "secret.h"
#include "tensor_service.h"

#define TOKEN "join-token-0123456789abcdef"
#define SECRET "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"
/* Another attempt's secret (each attempt of a real agent has its own). */
#define SECRET2 "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100"
/* An attempt whose Hello the fake holds until the test lets it answer. */
#define SECRET_LATE "1111111111111111111111111111111111111111111111111111111111111111"

/* ---------------------------------------------------------------- fake agent */

static struct {
  rpc_server_t *srv;
  char target[64];
  atomic_int hellos, hellos_ok, executes_ok;
  /* The Hello with SECRET_LATE: held (late_held) until late_go, then answered
   * (late_answered). */
  atomic_bool late_held, late_go, late_answered;
  /* The last Execute call opened, kept (referenced) for a test to end. */
  _Atomic(rpc_call_t *) execute;
} fake;

static bool has_secret(rpc_call_t *call) {
  char v[128];
  return rpc_call_metadata(call, SECRET_AGENT_MD, v, sizeof v) &&
         (!strcmp(v, SECRET) || !strcmp(v, SECRET2) || !strcmp(v, SECRET_LATE));
}

static bool is_late(rpc_call_t *call) {
  char v[128];
  return rpc_call_metadata(call, SECRET_AGENT_MD, v, sizeof v) && !strcmp(v, SECRET_LATE);
}

static void fake_hello(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  const Meshd__Agent__V1__HelloRequest *req = (const void *)msg;
  atomic_fetch_add(&fake.hellos, 1);
  if (!has_secret(call)) {
    rpc_call_finish(call, GRPC_STATUS_UNAUTHENTICATED, NULL, "no secret");
    return;
  }
  bool late = is_late(call);
  if (late) { /* bounded: the test lets it go within seconds */
    atomic_store(&fake.late_held, true);
    int64_t end = rpc_now_ms() + 20000;
    while (!atomic_load(&fake.late_go) && rpc_now_ms() < end) usleep(2000);
  }
  atomic_fetch_add(&fake.hellos_ok, 1);
  Meshd__Agent__V1__HelloReply r = MESHD__AGENT__V1__HELLO_REPLY__INIT;
  r.agent_id = req->agent_id; /* answers as whoever was asked for */
  r.device = "cpu";
  rpc_call_reply(call, &r.base);
  if (late) atomic_store(&fake.late_answered, true);
}

static void fake_execute(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  if (!has_secret(call)) {
    rpc_call_finish(call, GRPC_STATUS_UNAUTHENTICATED, NULL, "no secret");
    return;
  }
  rpc_call_ref(call);
  rpc_call_t *old = atomic_exchange(&fake.execute, call);
  if (old) rpc_call_unref(old);
  atomic_fetch_add(&fake.executes_ok, 1);
}

static void fake_execute_message(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  if (!msg) rpc_call_finish(call, GRPC_STATUS_OK, NULL, "bye");
}

static const rpc_method_t fake_rows[] = {
    {.path = "/meshd.agent.v1.Agent/Hello", .kind = RPC_UNARY,
     .request = &meshd__agent__v1__hello_request__descriptor, .on_start = fake_hello},
    {.path = "/meshd.agent.v1.Agent/Execute", .kind = RPC_BIDI,
     .request = &meshd__agent__v1__instruction_batch__descriptor, .on_start = fake_execute,
     .on_message = fake_execute_message},
};

/* ---------------------------------------------------------------- registry */

static agent_pool_t *pool;
static registry_t *registry;
static rpc_server_t *reg_srv;
static char reg_target[64];
static secret_file_t *tokens;
static char token_path[4096];
/* What the next start_registry uses besides its arguments (a test sets them first). */
static fault_t reg_fault;
static bool reg_fault_on;
static int reg_dial_ms = 3000;
static int reg_sweep_ms; /* <= 0: REGISTRY_SWEEP_MS */
/* The pool's callbacks: the last healthy count it reported, and losses reported. */
static atomic_int pool_changed_last = -1, pool_on_lost;

static void pool_changed(int healthy, void *arg) { atomic_store(&pool_changed_last, healthy); }
static void pool_lost(const agent_lost_t *lost, void *arg) { atomic_fetch_add(&pool_on_lost, 1); }

/* --server-fault SPEC for the next start_registry. */
static void with_fault(const char *spec) {
  char err[256];
  cr_assert_eq(fault_parse(spec, FAULT_SERVER_PLACES, &reg_fault, err, sizeof err), 0, "%s", err);
  reg_fault_on = true;
}

static void start_registry(int max_agents, bool with_tokens, bool require_cert) {
  char err[512];
  if (with_tokens) {
    snprintf(token_path, sizeof token_path, "/tmp/meshd-test-registry-%d", (int)getpid());
    FILE *f = fopen(token_path, "w");
    cr_assert_not_null(f);
    fprintf(f, "# the current token, then the one being retired\n%s\nretiring-token-0123456789\n",
            TOKEN);
    fclose(f);
    tokens = secret_file_open("--join-token-file", token_path, err, sizeof err);
    cr_assert_not_null(tokens, "%s", err);
  }
  pool = agent_pool_create(&(agent_pool_callbacks_t){.changed = pool_changed,
                                                     .on_lost = pool_lost});
  agent_pool_set_max_agents(pool, max_agents);
  registry_opts_t o = {.server_id = "test-server", .dial_timeout_ms = reg_dial_ms,
                       .connect_timeout_ms = 2000, /* a busy CI machine */
                       .agent_timeout_ms = 3000, .max_agents = max_agents,
                       .join_tokens = tokens, .require_cluster_cert = require_cert,
                       .fault = reg_fault_on ? &reg_fault : NULL, .sweep_ms = reg_sweep_ms};
  registry = registry_create(pool, &o);
  cr_assert_not_null(registry);
  rpc_server_opts_t so = {.listen = "127.0.0.1:0", .threads = 2};
  reg_srv = rpc_server_create(&so, err, sizeof err);
  cr_assert_not_null(reg_srv, "%s", err);
  cr_assert_eq(registry_add_methods(registry, reg_srv), 0);
  int port = rpc_server_start(reg_srv, err, sizeof err);
  cr_assert_gt(port, 0, "%s", err);
  snprintf(reg_target, sizeof reg_target, "127.0.0.1:%d", port);
}

static void setup(void) {
  rpc_init();
  /* As meshd runs: every server on the process loop, where the registry must
   * not wait (an agent's removal goes to a thread, or to the sweeper). Four
   * threads: the fake may hold one (a late Hello). */
  cr_assert_eq(rpc_loop_start(4, NULL), 0);
  char err[256];
  rpc_server_opts_t so = {.listen = "127.0.0.1:0", .threads = 4}; /* one may hold a Hello */
  fake.srv = rpc_server_create(&so, err, sizeof err);
  cr_assert_not_null(fake.srv, "%s", err);
  cr_assert_eq(rpc_server_add_methods(fake.srv, fake_rows, 2, NULL), 0);
  int port = rpc_server_start(fake.srv, err, sizeof err);
  cr_assert_gt(port, 0, "%s", err);
  snprintf(fake.target, sizeof fake.target, "127.0.0.1:%d", port);
}

/* A TensorService on the pool (the GetInfo test), its client's channel and
 * connection: teardown ends them first, so that a failed assertion does not
 * leave them calling into a destroyed pool. */
static rpc_server_t *info_srv;
static rpc_channel_t *info_ch;
static meshd_client_t *info_client;

static void teardown(void) {
  meshd_close(info_client);
  rpc_channel_destroy(info_ch);
  rpc_server_destroy(info_srv);
  info_client = NULL, info_ch = NULL, info_srv = NULL;
  if (registry) registry_close_all(registry);
  rpc_server_destroy(reg_srv);
  registry_destroy(registry);
  agent_pool_destroy(pool);
  rpc_call_t *ex = atomic_exchange(&fake.execute, NULL);
  if (ex) rpc_call_unref(ex);
  rpc_server_destroy(fake.srv);
  secret_file_close(tokens);
  if (token_path[0]) unlink(token_path);
  rpc_shutdown();
}

TestSuite(registry, .init = setup, .fini = teardown, .timeout = 60);

/* ---------------------------------------------------------------- a client */

typedef struct reg_call {
  rpc_channel_t *ch;
  rpc_stream_t *s;
  int rank;          /* from RegisterAccepted, -1 if none came */
  rpc_status_t st;   /* when it ended */
} reg_call_t;

/* Sends a RegisterRequest on c's call. */
static void reg_hello(reg_call_t *c, const char *id, const char *address, int rank,
                      const char *secret) {
  Meshd__V1__RegisterRequest h = MESHD__V1__REGISTER_REQUEST__INIT;
  h.agent_id = (char *)id;
  h.address = (char *)address;
  h.device = "cpu";
  h.requested_rank = rank;
  h.call_secret = (char *)secret;
  Meshd__V1__AgentToServer m = MESHD__V1__AGENT_TO_SERVER__INIT;
  m.msg_case = MESHD__V1__AGENT_TO_SERVER__MSG_HELLO;
  m.hello = &h;
  rpc_stream_write(c->s, &m.base, false); /* fails when refused already: read the status */
}

/* Waits up to 5 s for RegisterAccepted (c->rank) or the call's end (c->st). */
static void reg_answer(reg_call_t *c) {
  ProtobufCMessage *out = NULL;
  int rc = rpc_stream_read(c->s, &meshd__v1__server_to_agent__descriptor, &out, 5000);
  if (rc == 1) {
    c->rank = (int)((Meshd__V1__ServerToAgent *)out)->accepted->rank;
    protobuf_c_message_free_unpacked(out, NULL);
    return;
  }
  cr_assert_neq(rc, -2, "no answer within 5 s");
  if (rc != 0) rpc_stream_cancel(c->s);
  rpc_stream_finish(c->s, &c->st);
}

/* Opens RegisterAgent with the token (NULL: none). */
static void reg_start(reg_call_t *c, const char *token) {
  memset(c, 0, sizeof *c);
  c->rank = -1;
  rpc_channel_opts_t co = {.connect_timeout_ms = 5000}; /* a busy CI machine */
  c->ch = rpc_channel_create(reg_target, &co);
  rpc_md_t md = {SECRET_JOIN_MD, token};
  c->s = rpc_stream_open(c->ch, "/meshd.v1.AgentRegistry/RegisterAgent", &md, token ? 1 : 0, 0);
  cr_assert_not_null(c->s);
}

/* reg_start, one RegisterRequest, and up to 5 s for RegisterAccepted or the end. */
static void reg_open(reg_call_t *c, const char *token, const char *id, const char *address,
                     int rank, const char *secret) {
  reg_start(c, token);
  reg_hello(c, id, address, rank, secret);
  reg_answer(c);
}

static void reg_close(reg_call_t *c) {
  rpc_stream_destroy(c->s);
  rpc_channel_destroy(c->ch);
}

static bool wait_healthy(int n, int timeout_ms) {
  int64_t end = rpc_now_ms() + timeout_ms;
  while (agent_pool_healthy(pool) < n) {
    if (rpc_now_ms() > end) return false;
    usleep(2000);
  }
  return true;
}

/* ---------------------------------------------------------------- who */

Test(registry, a_registration_without_the_join_token_is_refused_before_any_dial_back) {
  start_registry(8, true, false);
  const char *bad[] = {NULL, "", "wrong-token-0123456789", TOKEN "x", "join-token-0123456789abcdeF"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    reg_call_t c;
    reg_open(&c, bad[i], "rogue", fake.target, 0, SECRET);
    cr_assert_eq(c.rank, -1, "token %zu was admitted", i);
    cr_assert_eq(c.st.code, GRPC_STATUS_UNAUTHENTICATED, "token %zu: %d %s", i, c.st.code,
                 c.st.message);
    cr_assert(strstr(c.st.message, "join token"), "%s", c.st.message);
    reg_close(&c);
  }
  usleep(100000);
  cr_assert_eq(atomic_load(&fake.hellos), 0, "a refused registration was dialed back");
  cr_assert_eq(agent_pool_size(pool), 0);
}

Test(registry, the_join_token_admits_and_the_dial_back_carries_the_call_secret) {
  start_registry(8, true, false);
  reg_call_t c;
  reg_open(&c, TOKEN, "agent-a", fake.target, 3, SECRET);
  cr_assert_eq(c.rank, 3, "%d %s", c.st.code, c.st.message);
  cr_assert(wait_healthy(1, 5000), "the agent never turned healthy");
  cr_assert_eq(atomic_load(&fake.hellos_ok), 1);
  int64_t end = rpc_now_ms() + 5000; /* the link's call reaches the agent after it opened */
  while (atomic_load(&fake.executes_ok) < 1 && rpc_now_ms() < end) usleep(2000);
  cr_assert_eq(atomic_load(&fake.executes_ok), 1, "the Execute link carries the secret too");
  /* The pool hands the same secret to every other call (Fetch, Upload). */
  agent_target_t t;
  cr_assert_eq(agent_pool_target(pool, 3, 5000, &t), 0);
  cr_assert_str_eq(t.md[0].key, SECRET_AGENT_MD);
  cr_assert_str_eq(t.md[0].value, SECRET);
  cr_assert_str_eq(t.address, fake.target);
  cr_assert_not(t.opts.tls.on);
  reg_close(&c);

  /* A token being retired (second line of the file) still admits. */
  reg_open(&c, "retiring-token-0123456789", "agent-b", fake.target, -1, SECRET);
  cr_assert_eq(c.rank, 0, "%d %s", c.st.code, c.st.message);
  reg_close(&c);
}

Test(registry, a_rotated_token_file_admits_the_new_token_and_not_the_old) {
  start_registry(8, true, false);
  FILE *f = fopen(token_path, "w");
  cr_assert_not_null(f);
  fprintf(f, "fresh-token-0123456789abcdef\n");
  fclose(f);
  reg_call_t c;
  reg_open(&c, TOKEN, "agent-old", fake.target, -1, SECRET);
  cr_assert_eq(c.st.code, GRPC_STATUS_UNAUTHENTICATED, "%d %s", c.st.code, c.st.message);
  reg_close(&c);
  reg_open(&c, "fresh-token-0123456789abcdef", "agent-new", fake.target, -1, SECRET);
  cr_assert_eq(c.rank, 0, "%d %s", c.st.code, c.st.message);
  reg_close(&c);
}

Test(registry, without_a_verified_certificate_a_cluster_registry_refuses) {
  start_registry(8, false, true);
  cr_assert_not(registry_open(registry));
  reg_call_t c;
  reg_open(&c, NULL, "agent-a", fake.target, 0, SECRET);
  cr_assert_eq(c.st.code, GRPC_STATUS_UNAUTHENTICATED, "%d %s", c.st.code, c.st.message);
  cr_assert(strstr(c.st.message, "certificate"), "%s", c.st.message);
  reg_close(&c);
  cr_assert_eq(atomic_load(&fake.hellos), 0);
}

Test(registry, without_tokens_or_certificates_it_is_open) {
  start_registry(8, false, false);
  cr_assert(registry_open(registry));
  reg_call_t c;
  reg_open(&c, NULL, "agent-a", fake.target, 0, SECRET);
  cr_assert_eq(c.rank, 0, "%d %s", c.st.code, c.st.message);
  reg_close(&c);
}

/* ---------------------------------------------------------------- what */

Test(registry, a_registration_without_a_call_secret_is_refused) {
  start_registry(8, true, false);
  const char *bad[] = {NULL, "", "abc", SECRET "0", "zz112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    reg_call_t c;
    reg_open(&c, TOKEN, "agent-a", fake.target, 0, bad[i]);
    cr_assert_eq(c.st.code, GRPC_STATUS_INVALID_ARGUMENT, "secret %zu: %d %s", i, c.st.code,
                 c.st.message);
    cr_assert(strstr(c.st.message, "call_secret"), "%s", c.st.message);
    reg_close(&c);
  }
  cr_assert_eq(agent_pool_size(pool), 0);
}

Test(registry, ranks_are_bounded_by_max_agents) {
  start_registry(4, true, false);
  int bad[] = {4, 1 << 20, INT32_MAX, -2};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    reg_call_t c;
    reg_open(&c, TOKEN, "agent-x", fake.target, bad[i], SECRET);
    cr_assert_eq(c.st.code, GRPC_STATUS_INVALID_ARGUMENT, "rank %d: %d %s", bad[i], c.st.code,
                 c.st.message);
    cr_assert(strstr(c.st.message, "--max-agents"), "%s", c.st.message);
    reg_close(&c);
  }
  reg_call_t held[4];
  for (int i = 0; i < 4; i++) {
    char id[24];
    snprintf(id, sizeof id, "agent-%d", i);
    reg_open(&held[i], TOKEN, id, fake.target, -1, SECRET);
    cr_assert_eq(held[i].rank, i, "%d %s", held[i].st.code, held[i].st.message);
  }
  reg_call_t c;
  reg_open(&c, TOKEN, "agent-5", fake.target, -1, SECRET);
  cr_assert_eq(c.st.code, GRPC_STATUS_RESOURCE_EXHAUSTED, "%d %s", c.st.code, c.st.message);
  cr_assert(strstr(c.st.message, "--max-agents"), "%s", c.st.message);
  reg_close(&c);
  for (int i = 0; i < 4; i++) reg_close(&held[i]);
}

Test(registry, a_dead_agents_rank_is_not_taken_without_the_token) {
  start_registry(8, true, false);
  reg_call_t c;
  reg_open(&c, TOKEN, "agent-a", fake.target, 2, SECRET);
  cr_assert_eq(c.rank, 2);
  cr_assert(wait_healthy(1, 5000));
  reg_close(&c); /* the agent dies */
  int64_t end = rpc_now_ms() + 5000;
  while (agent_pool_size(pool) > 0 && rpc_now_ms() < end) usleep(2000);
  cr_assert_eq(agent_pool_size(pool), 0);
  reg_open(&c, NULL, "rogue", fake.target, 2, SECRET);
  cr_assert_eq(c.st.code, GRPC_STATUS_UNAUTHENTICATED);
  reg_close(&c);
  cr_assert_eq(agent_pool_size(pool), 0);
}

Test(registry, a_rank_asked_for_by_number_waits_for_its_replacement) {
  start_registry(8, true, false);
  reg_call_t c;
  reg_open(&c, TOKEN, "agent-a", fake.target, 0, SECRET);
  cr_assert_eq(c.rank, 0);
  reg_close(&c); /* rank 0's agent dies */
  int64_t end = rpc_now_ms() + 5000;
  while (agent_pool_size(pool) > 0 && rpc_now_ms() < end) usleep(2000);
  reg_call_t any, replacement;
  reg_open(&any, TOKEN, "agent-any", fake.target, -1, SECRET);
  cr_assert_eq(any.rank, 1, "an agent asking for any rank took the dead one's (%d)", any.rank);
  reg_open(&replacement, TOKEN, "agent-a2", fake.target, 0, SECRET);
  cr_assert_eq(replacement.rank, 0, "%d %s", replacement.st.code, replacement.st.message);
  reg_close(&any);
  reg_close(&replacement);
}

/* ---------------------------------------------------------------- dial-backs */

/* An "agent" whose Hello never answers: each dial-back to it takes the whole
 * dial timeout. */
static void silent_hello(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {}
static const rpc_method_t silent_row = {.path = "/meshd.agent.v1.Agent/Hello", .kind = RPC_UNARY,
                                        .request = &meshd__agent__v1__hello_request__descriptor,
                                        .on_start = silent_hello};

Test(registry, registrations_that_cannot_be_dialed_back_do_not_starve_a_real_one) {
  start_registry(128, true, false);
  registry_opts_t o = {.server_id = "test-server", .dial_timeout_ms = 1000,
                       .connect_timeout_ms = 2000, .agent_timeout_ms = 3000, .max_agents = 128,
                       .join_tokens = tokens};
  /* This test's registry dials with a 1 s timeout. */
  registry_close_all(registry);
  rpc_server_destroy(reg_srv);
  registry_destroy(registry);
  registry = registry_create(pool, &o);
  char err[256];
  rpc_server_opts_t so = {.listen = "127.0.0.1:0", .threads = 2};
  reg_srv = rpc_server_create(&so, err, sizeof err);
  cr_assert_eq(registry_add_methods(registry, reg_srv), 0);
  snprintf(reg_target, sizeof reg_target, "127.0.0.1:%d", rpc_server_start(reg_srv, err, sizeof err));
  rpc_server_t *silent = rpc_server_create(&so, err, sizeof err);
  cr_assert_eq(rpc_server_add_methods(silent, &silent_row, 1, NULL), 0);
  char silent_target[64];
  snprintf(silent_target, sizeof silent_target, "127.0.0.1:%d",
           rpc_server_start(silent, err, sizeof err));

  enum { NBOGUS = 48 };
  static reg_call_t bogus[NBOGUS];
  int64_t t0 = rpc_now_ms();
  for (int i = 0; i < NBOGUS; i++) {
    char id[32];
    snprintf(id, sizeof id, "bogus-%d", i);
    reg_open(&bogus[i], TOKEN, id, silent_target, -1, SECRET);
    cr_assert_geq(bogus[i].rank, 0, "%d %s", bogus[i].st.code, bogus[i].st.message);
  }
  reg_call_t real;
  reg_open(&real, TOKEN, "real", fake.target, 100, SECRET);
  cr_assert_eq(real.rank, 100);
  /* One at a time, the 48 dial-backs ahead of it would take 48 s; REGISTRY_DIALERS
   * at once, 3 rounds of the 1 s timeout. */
  cr_assert(wait_healthy(1, 8000), "the real agent waited behind the silent ones");
  int64_t took = rpc_now_ms() - t0;
  cr_assert_lt(took, 8000, "%lld ms", (long long)took);
  cr_log_info("a real registration behind %d silent ones: healthy after %lld ms", NBOGUS,
              (long long)took);
  reg_close(&real);
  for (int i = 0; i < NBOGUS; i++) reg_close(&bogus[i]);
  rpc_server_destroy(silent);
}

/* ---------------------------------------------------------------- loss (review-80) */

/* Once an agent is out of the pool (its rank has no address, no link, and gets no
 * instruction), a mesh made before must already see the rank lost: between the two
 * a command on that mesh passes command_check_mesh_alive and is emitted with an
 * empty data address for the rank, which the survivors refuse as BAD_ARGUMENT
 * ("group.addresses[k]: 0 characters") instead of failing as AGENT_LOST. */
typedef struct gap_watch {
  atomic_bool stop;
  atomic_int gaps, gone_seen;
  _Atomic uint64_t since;
} gap_watch_t;

static void *watch_gap(void *arg) {
  gap_watch_t *w = arg;
  while (!atomic_load(&w->stop)) {
    char addr[256];
    if (agent_pool_address(pool, 0, addr, sizeof addr) == 0) continue;
    atomic_fetch_add(&w->gone_seen, 1);
    uint32_t rank = 0;
    meshd_error_t e;
    if (agent_pool_check_lost(pool, &rank, 1, atomic_load(&w->since), "Test", &e) == 0)
      atomic_fetch_add(&w->gaps, 1);
  }
  return NULL;
}

Test(registry, an_agent_out_of_the_pool_is_already_counted_lost) {
  start_registry(8, true, false);
  gap_watch_t w = {0};
  for (int round = 0; round < 20; round++) {
    char id[32];
    snprintf(id, sizeof id, "agent-%d", round);
    reg_call_t c;
    int64_t end = rpc_now_ms() + 5000;
    for (;;) { /* the rank may still be being released by the last round's agent */
      reg_open(&c, TOKEN, id, fake.target, 0, SECRET);
      if (c.rank == 0 || rpc_now_ms() > end) break;
      reg_close(&c);
      usleep(5000);
    }
    cr_assert_eq(c.rank, 0, "%d %s", c.st.code, c.st.message);
    cr_assert(wait_healthy(1, 5000));
    uint64_t before = agent_pool_losses(pool);
    atomic_store(&w.since, before);
    atomic_store(&w.stop, false);
    pthread_t t;
    cr_assert_eq(pthread_create(&t, NULL, watch_gap, &w), 0);
    reg_close(&c); /* the agent leaves: its registration ends, the pool removes it */
    end = rpc_now_ms() + 5000;
    while ((agent_pool_size(pool) > 0 || agent_pool_losses(pool) == before) && rpc_now_ms() < end)
      usleep(1000);
    usleep(2000);
    atomic_store(&w.stop, true);
    pthread_join(t, NULL);
    cr_assert_gt(agent_pool_losses(pool), before, "the agent's loss was never counted");
  }
  cr_assert_gt(atomic_load(&w.gone_seen), 0);
  cr_assert_eq(atomic_load(&w.gaps), 0,
               "%d of %d looks at a rank whose agent was out of the pool found it not lost yet",
               atomic_load(&w.gaps), atomic_load(&w.gone_seen));
}

/* ---------------------------------------------------------------- a rank's next agent */

static bool wait_size(int n, int timeout_ms) {
  int64_t end = rpc_now_ms() + timeout_ms;
  while (agent_pool_size(pool) != n) {
    if (rpc_now_ms() > end) return false;
    usleep(2000);
  }
  return true;
}

/* The agent_id of rank's agent ("" if none), from the ListAgents snapshot. */
static void agent_at(uint32_t rank, char *id, size_t len) {
  Meshd__V1__AgentInfo **infos = NULL;
  size_t n = 0;
  cr_assert_eq(agent_pool_snapshot(pool, &infos, &n), 0);
  id[0] = '\0';
  for (size_t i = 0; i < n; i++)
    if (infos[i]->rank == rank) snprintf(id, len, "%s", infos[i]->agent_id);
  agent_pool_snapshot_free(infos, n);
}

/* An agent restarted at once (Kubernetes restarts a crashed container in about a
 * second) asks for its rank while the removal of the agent it replaces has yet to
 * run (held here 1 s): it was refused ("rank 0 is held by agent-a", then "still
 * being released") and had to retry. It waits for that removal instead; a live
 * agent's rank is refused as before. */
Test(registry, an_agent_restarted_at_once_gets_its_rank_while_the_old_removal_is_pending) {
  with_fault("remove:slow=1000");
  start_registry(8, true, false);
  reg_call_t a, b, c;
  reg_open(&a, TOKEN, "agent-a", fake.target, 0, SECRET);
  cr_assert_eq(a.rank, 0, "%d %s", a.st.code, a.st.message);
  cr_assert(wait_healthy(1, 5000));

  reg_open(&b, TOKEN, "agent-b", fake.target, 0, SECRET2); /* agent-a lives */
  cr_assert_eq(b.st.code, GRPC_STATUS_FAILED_PRECONDITION, "%d %s", b.st.code, b.st.message);
  cr_assert(strstr(b.st.message, "held by agent agent-a"), "%s", b.st.message);
  reg_close(&b);

  reg_close(&a); /* killed: its call breaks, its removal is pending */
  reg_open(&b, TOKEN, "agent-b", fake.target, 0, SECRET2);
  cr_assert_eq(b.rank, 0, "refused: %d %s", b.st.code, b.st.message);
  cr_assert(wait_healthy(1, 5000));
  char id[64];
  agent_at(0, id, sizeof id);
  cr_assert_str_eq(id, "agent-b");
  cr_assert_eq(agent_pool_losses(pool), 1, "agent-a's loss counted %llu times",
               (unsigned long long)agent_pool_losses(pool));

  /* The same agent registering again at once (its call broke): "agent-b is
   * already registered" until the removal ran. */
  reg_close(&b);
  reg_open(&c, TOKEN, "agent-b", fake.target, 0, SECRET);
  cr_assert_eq(c.rank, 0, "refused: %d %s", c.st.code, c.st.message);
  cr_assert(wait_healthy(1, 5000));
  cr_assert_eq(agent_pool_size(pool), 1);
  reg_close(&c);
}

/* A registration waiting for the removal of the agent gone from its rank
 * (take_over) is registered already: a second RegisterRequest on its call was
 * admitted as a new registration (its first try in the wait had cleared the
 * call's "being admitted" mark), at another rank; the wait then admitted the
 * first too, and the call's end removed only the last rank it got: the other
 * stayed in the pool for good, and its agent id could not register again. */
Test(registry, a_second_register_request_while_waiting_for_a_rank_is_refused) {
  with_fault("remove:slow=2000");
  start_registry(8, true, false);
  reg_call_t a, b;
  reg_open(&a, TOKEN, "agent-a", fake.target, 0, SECRET);
  cr_assert_eq(a.rank, 0, "%d %s", a.st.code, a.st.message);
  cr_assert(wait_healthy(1, 5000));
  reg_close(&a); /* its removal is held 2 s */

  reg_start(&b, TOKEN);
  reg_hello(&b, "agent-b", fake.target, 0, SECRET2); /* waits for rank 0 */
  usleep(300000); /* a dialer takes it and tries once (not an assertion: fixed, any time refuses) */
  reg_hello(&b, "agent-c", fake.target, -1, SECRET2);
  reg_answer(&b);
  cr_assert_eq(b.rank, -1, "the second RegisterRequest was admitted as rank %d", b.rank);
  cr_assert_eq(b.st.code, GRPC_STATUS_INVALID_ARGUMENT, "%d %s", b.st.code, b.st.message);
  cr_assert(strstr(b.st.message, "sent twice"), "%s", b.st.message);
  reg_close(&b);
  cr_assert(wait_size(0, 5000), "a rank of the refused call stayed in the pool");
}

static bool wait_takeovers(int n, int64_t until_ms) {
  while (registry_takeovers_waiting(registry) != n) {
    if (rpc_now_ms() > until_ms) return false;
    usleep(2000);
  }
  return true;
}

/* The server stops while a registration waits for the removal of the agent
 * gone from its rank (take_over): registry_close_all ended its call, but the
 * wait went on to its next look (the sweeper's period), holding a dialer. It
 * is woken and gives up at once. Here the sweeper's turn is a minute away and
 * the old agent's removal left to it (remove:fail): nothing but the close can
 * end the wait before its deadline, REGISTRY_TAKEOVER_MS on. */
Test(registry, closing_the_registry_ends_a_wait_for_a_rank_at_once) {
  with_fault("remove:fail");
  reg_sweep_ms = 60000;
  start_registry(8, true, false);
  reg_call_t a, b;
  reg_open(&a, TOKEN, "agent-a", fake.target, 0, SECRET);
  cr_assert_eq(a.rank, 0, "%d %s", a.st.code, a.st.message);
  cr_assert(wait_healthy(1, 5000));
  reg_close(&a); /* its removal waits for the sweeper's turn */
  int64_t end = rpc_now_ms() + 5000;
  while (registry_open_calls(registry) > 0 && rpc_now_ms() < end) usleep(2000);
  cr_assert_eq(registry_open_calls(registry), 0, "agent-a's call never ended");

  int64_t asked = rpc_now_ms(); /* the wait's deadline is REGISTRY_TAKEOVER_MS after this */
  reg_start(&b, TOKEN);
  reg_hello(&b, "agent-b", fake.target, 0, SECRET2);
  cr_assert(wait_takeovers(1, asked + 5000), "agent-b never waited for rank 0");
  registry_close_all(registry);
  cr_assert(wait_takeovers(0, asked + REGISTRY_TAKEOVER_MS - 1000),
            "the wait for rank 0 went on after the close (ended %s)",
            registry_takeovers_waiting(registry) ? "not yet" : "late");
  reg_answer(&b);
  cr_assert_eq(b.rank, -1);
  cr_assert_eq(b.st.code, GRPC_STATUS_UNAVAILABLE, "%d %s", b.st.code, b.st.message);
  cr_assert(strstr(b.st.message, "server shutting down"), "%s", b.st.message);
  reg_close(&b);
}

/* Its link broke (the Execute call ended): the agent is gone though its
 * registration call is still open until the sweeper's next turn. A replacement
 * asking for its rank ends that call itself and takes the rank. */
Test(registry, an_agent_whose_link_broke_is_replaced_without_waiting_for_the_sweeper) {
  with_fault("remove:slow=1000");
  start_registry(8, true, false);
  reg_call_t a, b;
  reg_open(&a, TOKEN, "agent-a", fake.target, 3, SECRET);
  cr_assert_eq(a.rank, 3);
  cr_assert(wait_healthy(1, 5000));
  int64_t end = rpc_now_ms() + 5000;
  while (!atomic_load(&fake.execute) && rpc_now_ms() < end) usleep(2000);
  rpc_call_t *ex = atomic_exchange(&fake.execute, NULL);
  cr_assert_not_null(ex);
  rpc_call_finish(ex, GRPC_STATUS_UNAVAILABLE, NULL, "the agent's link breaks");
  rpc_call_unref(ex);
  end = rpc_now_ms() + 5000;
  while (agent_pool_healthy(pool) > 0 && rpc_now_ms() < end) usleep(1000);
  cr_assert_eq(agent_pool_healthy(pool), 0);

  reg_open(&b, TOKEN, "agent-b", fake.target, 3, SECRET2);
  cr_assert_eq(b.rank, 3, "refused: %d %s", b.st.code, b.st.message);
  cr_assert(wait_healthy(1, 5000));
  /* agent-a's registration was ended, telling it to register again. */
  ProtobufCMessage *out = NULL;
  cr_assert_eq(rpc_stream_read(a.s, &meshd__v1__server_to_agent__descriptor, &out, 5000), 0);
  rpc_stream_finish(a.s, &a.st);
  cr_assert_eq(a.st.code, GRPC_STATUS_UNAVAILABLE, "%d %s", a.st.code, a.st.message);
  cr_assert(strstr(a.st.message, "register again"), "%s", a.st.message);
  cr_assert_eq(agent_pool_losses(pool), 1);
  reg_close(&a);
  reg_close(&b);
}

/* A lost agent is removed once, whichever thread removes it: a thread of its
 * own, or (no thread to be had: remove:fail) the sweeper's next turn. Removed,
 * its slot is free (ListAgents, the registered gauge), the healthy count (the
 * meshd_agents gauge, TensorService's health) says 0, a mesh with its rank sees
 * it lost, and its loss counts once. Removed twice, the second removal took the
 * slot of the agent's own next registration (same id, same rank). */
static void a_lost_agent_is_removed_once(const char *fault) {
  if (fault) with_fault(fault);
  start_registry(8, true, false);
  reg_call_t a, again;
  reg_open(&a, TOKEN, "agent-a", fake.target, 1, SECRET);
  cr_assert_eq(a.rank, 1);
  cr_assert(wait_healthy(1, 5000));
  uint64_t since = agent_pool_losses(pool);
  reg_close(&a);
  cr_assert(wait_size(0, 5000), "the lost agent was never removed");
  char id[64];
  agent_at(1, id, sizeof id);
  cr_assert_str_eq(id, "");
  cr_assert_eq(agent_pool_healthy(pool), 0);
  int64_t end = rpc_now_ms() + 5000; /* told after the removal's lock is let go */
  while (atomic_load(&pool_changed_last) != 0 && rpc_now_ms() < end) usleep(1000);
  cr_assert_eq(atomic_load(&pool_changed_last), 0);
  uint32_t rank = 1;
  meshd_error_t e;
  cr_assert_eq(agent_pool_check_lost(pool, &rank, 1, since, "Test", &e), -1,
               "a mesh with rank 1 does not see its agent lost");
  cr_assert_eq(agent_pool_losses(pool), since + 1);

  reg_open(&again, TOKEN, "agent-a", fake.target, 1, SECRET2);
  cr_assert_eq(again.rank, 1, "%d %s", again.st.code, again.st.message);
  cr_assert(wait_healthy(1, 5000));
  usleep(3 * REGISTRY_SWEEP_MS * 1000); /* a second removal would come at a sweeper's turn */
  cr_assert_eq(agent_pool_size(pool), 1, "the agent's next registration was removed");
  cr_assert_eq(agent_pool_healthy(pool), 1);
  cr_assert_eq(agent_pool_losses(pool), since + 1);
  cr_assert_eq(atomic_load(&pool_on_lost), 1, "the loss was reported %d times",
               atomic_load(&pool_on_lost));
  reg_close(&again);
}

Test(registry, a_lost_agent_is_removed_once_on_a_thread_of_its_own) {
  a_lost_agent_is_removed_once(NULL);
}

Test(registry, a_lost_agent_is_removed_once_by_the_sweeper_when_no_thread_can_be_had) {
  a_lost_agent_is_removed_once("remove:fail");
}

/* The dial-back of an attempt whose call has ended answers late, after the agent
 * registered again (same id, same rank) and its new registration was dialed back.
 * That old Hello installed its channel on the new registration, replacing its
 * Execute link: a loss (sessions' instructions on it failed AGENT_LOST) and a
 * second link. It acts on its own registration only, which is gone. */
Test(registry, a_late_dial_back_of_an_ended_attempt_leaves_the_next_registration_alone) {
  reg_dial_ms = 15000; /* the late Hello is held a few seconds at most */
  start_registry(8, true, false);
  reg_call_t a, b;
  reg_open(&a, TOKEN, "agent-x", fake.target, 0, SECRET_LATE);
  cr_assert_eq(a.rank, 0);
  int64_t end = rpc_now_ms() + 5000;
  while (!atomic_load(&fake.late_held) && rpc_now_ms() < end) usleep(2000);
  cr_assert(atomic_load(&fake.late_held), "the dial-back never came");
  reg_close(&a); /* the attempt ends while its Hello is out */
  cr_assert(wait_size(0, 5000));

  reg_open(&b, TOKEN, "agent-x", fake.target, 0, SECRET2);
  cr_assert_eq(b.rank, 0, "%d %s", b.st.code, b.st.message);
  cr_assert(wait_healthy(1, 5000));
  end = rpc_now_ms() + 5000;
  while (atomic_load(&fake.executes_ok) < 1 && rpc_now_ms() < end) usleep(2000);
  cr_assert_eq(atomic_load(&fake.executes_ok), 1);
  uint64_t losses = agent_pool_losses(pool);

  atomic_store(&fake.late_go, true);
  end = rpc_now_ms() + 5000;
  while (!atomic_load(&fake.late_answered) && rpc_now_ms() < end) usleep(2000);
  cr_assert(atomic_load(&fake.late_answered));
  /* What the old dial-back did with its answer shows within this bound: a new
   * Execute call at the fake, a loss in the pool. */
  end = rpc_now_ms() + 1500;
  while (atomic_load(&fake.executes_ok) == 1 && agent_pool_losses(pool) == losses &&
         rpc_now_ms() < end)
    usleep(2000);
  cr_assert_eq(agent_pool_losses(pool), losses, "the late dial-back replaced the link");
  cr_assert_eq(atomic_load(&fake.executes_ok), 1, "the late dial-back opened a second link");
  cr_assert_eq(agent_pool_healthy(pool), 1);
  agent_target_t t;
  cr_assert_eq(agent_pool_target(pool, 0, 5000, &t), 0);
  cr_assert_str_eq(t.secret, SECRET2);
  reg_close(&b);
}

/* ---------------------------------------------------------------- GetInfo */

/* Agents at ranks from..to-1, "agent-<rank>", reporting version 9.9.9 (no dial-back). */
static void add_agents(int from, int to) {
  for (int i = from; i < to; i++) {
    agent_desc_t d = {0};
    snprintf(d.agent_id, sizeof d.agent_id, "agent-%d", i);
    snprintf(d.address, sizeof d.address, "127.0.0.1:%d", 20000 + i);
    snprintf(d.device, sizeof d.device, "cpu");
    snprintf(d.version, sizeof d.version, "9.9.9");
    char err[256];
    cr_assert_eq(agent_pool_add(pool, &d, i, err, sizeof err), i, "%s", err);
  }
}

/* GetInfo on ch: the reply (free it), its packed size in *bytes. */
static Meshd__V1__GetInfoReply *get_info(rpc_channel_t *ch, size_t *bytes) {
  Meshd__V1__GetInfoRequest req = MESHD__V1__GET_INFO_REQUEST__INIT;
  ProtobufCMessage *out = NULL;
  rpc_status_t st;
  grpc_status_code code = rpc_unary(ch, "/meshd.v1.TensorService/GetInfo", &req.base,
                                    &meshd__v1__get_info_reply__descriptor, &out, NULL, 0, 10000,
                                    &st);
  cr_assert_eq(code, GRPC_STATUS_OK, "GetInfo: %s", st.message);
  *bytes = protobuf_c_message_get_packed_size(out);
  return (Meshd__V1__GetInfoReply *)out;
}

/* GetInfo answered every agent in one reply: past gRPC's 4 MiB (~8000 agents)
 * it failed for every caller. Now it holds the first 1024 by rank (the default --max-agents) and counts
 * the pool; past 1024 it says it is truncated, and the C client's
 * meshd_server_info (meshctl version) takes every agent from ListAgents. */
Test(registry, get_info_holds_the_first_1024_agents_and_counts_them_all) {
  start_registry(2048, false, false);
  char err[256];
  rpc_server_opts_t so = {.listen = "127.0.0.1:0", .threads = 2};
  info_srv = rpc_server_create(&so, err, sizeof err);
  cr_assert_not_null(info_srv, "%s", err);
  size_t nm;
  const rpc_method_t *rows = tensor_service_methods(&nm);
  cr_assert_eq(rpc_server_add_methods(info_srv, rows, nm, pool), 0);
  int port = rpc_server_start(info_srv, err, sizeof err);
  cr_assert_gt(port, 0, "%s", err);
  char target[64];
  snprintf(target, sizeof target, "127.0.0.1:%d", port);
  rpc_channel_opts_t co = {.connect_timeout_ms = 5000};
  info_ch = rpc_channel_create(target, &co);

  add_agents(0, 1024); /* exactly what the reply holds: every agent, not truncated */
  size_t bytes;
  Meshd__V1__GetInfoReply *r = get_info(info_ch, &bytes);
  cr_assert_eq(r->n_agents, 1024);
  cr_assert_not(r->agents_truncated);
  cr_assert_eq(r->agents_total, 1024);
  protobuf_c_message_free_unpacked(&r->base, NULL);

  add_agents(1024, 1100);
  agent_pool_set_healthy(pool, 7, "agent-7", 0, true);
  agent_pool_set_healthy(pool, 1080, "agent-1080", 0, true);
  meshd_error_t e;
  cr_assert_eq(agent_pool_set_drained(pool, 1099, true, &e), 0, "%s", e.msg);
  r = get_info(info_ch, &bytes);
  cr_assert_eq(r->n_agents, 1024, "%zu agents in GetInfo", r->n_agents);
  for (size_t i = 0; i < r->n_agents; i++) cr_assert_eq(r->agents[i]->rank, i);
  cr_assert_str_eq(r->agents[1023]->version, "9.9.9");
  cr_assert(r->agents_truncated);
  cr_assert_eq(r->agents_total, 1100);
  cr_assert_eq(r->agents_healthy, 2);
  cr_assert_eq(r->agents_drained, 1);
  cr_assert_lt(bytes, 1024 * 600, "GetInfo is %zu bytes", bytes);
  protobuf_c_message_free_unpacked(&r->base, NULL);

  meshd_err_t ce;
  info_client = meshd_connect(target, 5000, &ce);
  cr_assert_not_null(info_client, "meshd_connect: %d", (int)ce);
  meshd_server_info_t info;
  cr_assert_eq(meshd_server_info(info_client, &info), MESHD_E_OK, "%s",
               meshd_last_error(info_client)->message);
  cr_assert_eq(info.n_agents, 1100, "meshd_server_info: %zu agents", info.n_agents);
  for (size_t i = 0; i < info.n_agents; i++) {
    cr_assert_eq(info.agents[i].rank, i);
    cr_assert_str_eq(info.agents[i].version, "9.9.9");
  }
  cr_assert(info.agents[1099].drained && info.agents[1080].healthy && !info.agents[1081].healthy);
  meshd_server_info_free(&info);
}
