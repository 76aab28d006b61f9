/* meshd: the front-end server. Serves TensorService, AgentRegistry and Health,
 * optionally supervises local CPU agents, drains on SIGTERM/SIGINT. */
#include <errno.h>
#include <libgen.h>
#include <limits.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "agent_link.h"
#include "agent_pool.h"
#include "auth.h"
#include "cluster.h"
#include "command_service.h"
#include "build_info.h"
#include "config.h"
#include "health.h"
#include "layout.h"
#include "log.h"
#include "metrics.h"
#include "reflection.h"
#include "registry.h"
#include "rpc.h"
#include "runtime.h"
#include "session.h"
#include "session_service.h"
#include "supervisor.h"
#include "data_service.h"
#include "fault.h"
#include "load_service.h"
#include "tensor_service.h"

typedef struct options {
  const char *listen, *port_file, *agent_binary, *log_level, *log_format, *metrics_listen;
  const char *metrics_port_file;
  int64_t local_agent_metrics_port_base;
  const char *local_agent_device;
  const char *tls_cert, *tls_key, *tls_client_ca, *auth_tokens, *health_listen;
  int64_t max_sessions, max_sessions_per_principal, max_streams_per_connection, max_unauthenticated_requests;
  double max_connection_idle, handshake_timeout;
  int64_t local_agents, min_agents, threads, session_ttl, session_max_queued, max_queued;
  int64_t link_hold_ms, link_lone_ms;
  int64_t max_tensor_dims, max_tensor_elements, session_max_refs, session_max_meshes;
  int64_t session_max_streams, max_command_refs;
  int64_t session_max_transfers, transfer_grant_ms, transfer_grant_start_ms, max_relayed_transfers;
  const char *data_path;
  double drain_seconds, agent_timeout;
  uint64_t max_message_bytes, session_quota_bytes, session_max_queued_bytes, max_queued_bytes;
  uint64_t stream_window_bytes, rpc_memory_bytes;
  int64_t max_agents;
  const char *cluster_ca, *cluster_cert, *cluster_key, *cluster_name, *cluster_listen;
  const char *cluster_port_file, *join_token_file;
  const char *url_allow;
  const char *server_fault;
  uint64_t url_max_bytes;
  int64_t url_connect_timeout_ms, url_timeout_ms, url_retries, url_min_speed, url_slow_s;
  bool reflection;
} options_t;

static options_t opt;
static fault_t server_fault; /* --server-fault */
static bool server_fault_on;

static const config_flag_t flags[] = {
    {"listen", CONFIG_STRING, "0.0.0.0:50051", "gRPC address; port 0 picks a free port", &opt.listen, 0, 0},
    {"port-file", CONFIG_STRING, NULL, "write the bound port here once serving", &opt.port_file, 0, 0},
    {"local-agents", CONFIG_INT, "0", "start and supervise N agents on loopback", &opt.local_agents, 0, 256},
    {"local-agent-device", CONFIG_STRING, "cpu",
     "device of --local-agents: cpu, cuda (agent i serves cuda:i), cuda:N (all on GPU N) or cuda:emulated", &opt.local_agent_device, 0, 0},
    {"agent-binary", CONFIG_STRING, NULL, "meshd-agent to run (default: next to meshd)", &opt.agent_binary, 0, 0},
    {"min-agents", CONFIG_INT, "-1",
     "TensorService is SERVING with at least N healthy agents (-1: --local-agents, or 1)", &opt.min_agents, -1, 1 << 20},
    {"drain-seconds", CONFIG_DOUBLE, "10", "on SIGTERM, how long running calls may finish", &opt.drain_seconds, 0, 3600},
    {"threads", CONFIG_INT, "1",
     "rpc threads, the only ones that poll the sockets (1: the fewest handoffs per call; more "
     "for many busy connections on many cores)", &opt.threads, 1, 64},
    {"link-hold-ms", CONFIG_INT, "20",
     "how long an agent's link may hold instructions back to send them with more: a Submit "
     "batch's, a unary Execute's (a Sync or Fetch sends them at once); 0: never",
     &opt.link_hold_ms, 0, 60000},
    {"link-lone-ms", CONFIG_INT, "1",
     "a unary Execute's instructions that no other instruction joined in this long go to the "
     "agents at once instead of waiting out --link-hold-ms; 0: they wait",
     &opt.link_lone_ms, 0, 60000},
    {"max-message-bytes", CONFIG_BYTES, "4MiB", "largest gRPC message in either direction", &opt.max_message_bytes, 0, 0},
    {"stream-window-bytes", CONFIG_BYTES, "64KiB",
     "bytes a client may send on a stream ahead of the server's reads (0: gRPC's adaptive window)",
     &opt.stream_window_bytes, 0, 0},
    {"agent-timeout", CONFIG_DOUBLE, "3",
     "an agent that answers no keepalive ping for this many seconds is lost", &opt.agent_timeout, 1, 3600},
    {"session-ttl", CONFIG_INT, "300", "session lease in seconds", &opt.session_ttl, 1, 86400 * 7},
    {"session-quota-bytes", CONFIG_BYTES, "0",
     "per-session byte quota: the default, and the most CreateSession may ask for (0: unlimited)",
     &opt.session_quota_bytes, 0, 0},
    {"session-max-refs", CONFIG_INT, "65536",
     "live refs a session may hold: tensors and views, meshes, streams, borrows (0: no bound)",
     &opt.session_max_refs, 0, 1LL << 40},
    {"session-max-meshes", CONFIG_INT, "4096",
     "meshes a session may make (CreateMesh, SliceMesh; they last as long as it) (0: no bound)",
     &opt.session_max_meshes, 0, 1LL << 40},
    {"session-max-streams", CONFIG_INT, "32",
     "streams a session may make (each is a thread on every agent it runs on) (0: no bound)",
     &opt.session_max_streams, 0, 1LL << 20},
    {"max-command-refs", CONFIG_INT, "4096", "refs one command may list (a Drop's) (0: no bound)",
     &opt.max_command_refs, 0, 1LL << 40},
    {"max-tensor-dims", CONFIG_INT, "16", "dims a tensor may have", &opt.max_tensor_dims, 1, 16},
    {"max-tensor-elements", CONFIG_INT, "17179869184",
     "elements one tensor may have on one rank (default 2^34)", &opt.max_tensor_elements, 1,
     (double)(1LL << 62)},
    {"session-max-queued", CONFIG_INT, "1024",
     "flow control: commands a session may have accepted and not yet run on the agents before "
     "its Submit stream stops reading (0: no bound)", &opt.session_max_queued, 0, 1LL << 40},
    {"session-max-queued-bytes", CONFIG_BYTES, "64MiB",
     "flow control: the same bound on those commands' instruction bytes, over all their ranks (0: none)",
     &opt.session_max_queued_bytes, 0, 0},
    {"session-max-transfers", CONFIG_INT, "8",
     "Upload and Fetch calls a session may have in flight at once; more are refused "
     "RESOURCE_EXHAUSTED (0: 64, the most: what an agent keeps of a session's fetches)",
     &opt.session_max_transfers, 0, DATA_TRANSFERS_MAX},
    {"max-relayed-transfers", CONFIG_INT, "128",
     "Upload and Fetch calls the server relays at once over all sessions (each queues up to "
     "8 MiB); more are refused RESOURCE_EXHAUSTED (0: no bound)",
     &opt.max_relayed_transfers, 0, 1 << 20},
    {"data-path", CONFIG_STRING, "auto",
     "how tensor bytes move: direct (clients stream straight to and from the agents with "
     "PlanTransfer grants; Upload and Fetch are refused), proxy (through the server only; "
     "PlanTransfer is refused) or auto (both; clients that cannot reach the agents use the proxy); "
     "small tensors in Literal commands (at most 1 MiB each) go through the server under each",
     &opt.data_path, 0, 0},
    {"transfer-grant-ms", CONFIG_INT, "600000",
     "how long a direct transfer's grants are good for, in ms; an upload not finished by then "
     "is undone", &opt.transfer_grant_ms, 100, 86400000},
    {"transfer-grant-start-ms", CONFIG_INT, "60000",
     "a direct transfer's call must start this soon after its plan (its agent remembers the "
     "grant's nonce this long); it may then run until --transfer-grant-ms",
     &opt.transfer_grant_start_ms, 100, 86400000},
    {"server-fault", CONFIG_STRING, NULL,
     "fault injection for tests: plan:slow=MS holds each PlanTransfer's answer MS ms once its "
     "transfer is planned (a lost answer), plan:fail loses it; session:slow=MS holds each "
     "CreateSession's answer MS ms once its session exists; remove:slow=MS holds each lost "
     "agent's removal from the pool MS ms, remove:fail leaves it to the registry's sweeper; "
     "finish:slow=MS holds each FinishUpload MS ms once its receipts checked out "
     "(see core/platform/fault.h)",
     &opt.server_fault, 0, 0},
    {"max-queued", CONFIG_INT, "8192",
     "flow control: the bound over all sessions together (0: none)", &opt.max_queued, 0, 1LL << 40},
    {"max-queued-bytes", CONFIG_BYTES, "256MiB",
     "flow control: the bound on instruction bytes over all sessions (0: none)", &opt.max_queued_bytes, 0, 0},
    {"tls-cert", CONFIG_STRING, NULL, "serve TLS on --listen with this PEM certificate chain "
     "(with --tls-key; files re-read when they change)", &opt.tls_cert, 0, 0},
    {"tls-key", CONFIG_STRING, NULL, "the PEM private key of --tls-cert", &opt.tls_key, 0, 0},
    {"tls-client-ca", CONFIG_STRING, NULL,
     "also require client certificates signed by this PEM CA (mTLS; needs --tls-cert)",
     &opt.tls_client_ca, 0, 0},
    {"auth-tokens", CONFIG_STRING, NULL,
     "principals, one per line 'NAME TOKEN [admin]'; every call but health must carry "
     "'authorization: Bearer TOKEN' (re-read on SIGHUP)", &opt.auth_tokens, 0, 0},
    {"health-listen", CONFIG_STRING, NULL,
     "also serve only grpc.health.v1, in plaintext, here (kubelet probes when --listen is TLS)",
     &opt.health_listen, 0, 0},
    {"max-sessions", CONFIG_INT, "10000",
     "open sessions the server may hold, every principal together (0: no bound)",
     &opt.max_sessions, 0, 1LL << 32},
    {"max-sessions-per-principal", CONFIG_INT, "256",
     "open sessions one principal may hold (0: no bound)", &opt.max_sessions_per_principal, 0,
     1 << 24},
    {"max-connection-idle", CONFIG_DOUBLE, "600",
     "close a connection (any port) with no call for this many seconds", &opt.max_connection_idle,
     1, 86400},
    {"handshake-timeout", CONFIG_DOUBLE, "10",
     "close a connection (any gRPC port; local agents take it) that has not finished its TLS "
     "and HTTP/2 handshake within this many seconds", &opt.handshake_timeout, 0.1, 3600},
    {"max-streams-per-connection", CONFIG_INT, "1024",
     "calls one connection (any port; the health port at most 16) may have open at once",
     &opt.max_streams_per_connection, 1,
     1 << 20},
    {"max-unauthenticated-requests", CONFIG_INT, "16",
     "requests of callers no guard authenticated (Health) still arriving at once, each up to "
     "--max-message-bytes; past it the oldest is cancelled", &opt.max_unauthenticated_requests,
     1, 65536},
    {"rpc-memory-bytes", CONFIG_BYTES, "1GiB",
     "memory gRPC may take for a port's connections (read buffers, calls: the client port, "
     "--health-listen, "
     "--cluster-listen each; local agents take it) before it closes idle ones, then cancels "
     "calls (0: no bound)", &opt.rpc_memory_bytes, 0, 0},
    {"max-agents", CONFIG_INT, "1024", "the pool's size: agents may register as ranks 0..N-1",
     &opt.max_agents, 1, 65536},
    {"join-token-file", CONFIG_STRING, NULL,
     "agents must present a token from this file (one per line) to register (else, with local "
     "agents, --auth-tokens or --tls-cert, the server makes one only its local agents get)",
     &opt.join_token_file, 0, 0},
    {"cluster-ca", CONFIG_STRING, NULL,
     "cluster mTLS (with --cluster-cert, --cluster-key, --cluster-listen): the CA of the agents' "
     "and the server's cluster certificates", &opt.cluster_ca, 0, 0},
    {"cluster-cert", CONFIG_STRING, NULL, "the server's cluster certificate (PEM)", &opt.cluster_cert, 0, 0},
    {"cluster-key", CONFIG_STRING, NULL, "its private key (PEM)", &opt.cluster_key, 0, 0},
    {"cluster-name", CONFIG_STRING, "meshd-cluster",
     "with cluster mTLS: the name agents' certificates must carry", &opt.cluster_name, 0, 0},
    {"cluster-listen", CONFIG_STRING, NULL,
     "serve the agent registry here (mTLS with cluster certificates) and not on --listen "
     "(default: on --listen when it is plaintext; required with cluster certificates)",
     &opt.cluster_listen, 0, 0},
    {"cluster-port-file", CONFIG_STRING, NULL, "write the --cluster-listen port here", &opt.cluster_port_file, 0, 0},
    {"url-allow", CONFIG_STRING, NULL,
     "what meshd.load URLs agents may fetch, comma-separated: none, http://HOSTS, https://HOSTS "
     "(HOSTS: *, *.example.com, example.com), file:///DIR, net:CIDR (a private network), private "
     "(any address) (default: http and https to public hosts and loopback)", &opt.url_allow, 0, 0},
    {"url-max-bytes", CONFIG_BYTES, "16GiB", "most bytes one rank of one tensor's load fetches",
     &opt.url_max_bytes, 0, 0},
    {"url-connect-timeout-ms", CONFIG_INT, "10000", "a load's connection timeout",
     &opt.url_connect_timeout_ms, 1, 3600000},
    {"url-timeout-ms", CONFIG_INT, "0",
     "a load's timeout for one request, the whole transfer (0: none)", &opt.url_timeout_ms, 0,
     86400000},
    {"url-min-speed", CONFIG_INT, "1024",
     "bytes/s a load's request must average over --url-slow-s seconds, else it fails as a timeout "
     "(a server that drips bytes cannot hold a load for ever)", &opt.url_min_speed, 1, 1LL << 30},
    {"url-slow-s", CONFIG_INT, "60", "the window --url-min-speed is measured over",
     &opt.url_slow_s, 1, 3600},
    {"url-retries", CONFIG_INT, "3",
     "retries of a load's request after 5xx, resets and bodies cut short, with backoff",
     &opt.url_retries, 0, 100},
    {"reflection", CONFIG_BOOL, "true",
     "serve gRPC server reflection (grpcurl list/describe) on --listen, behind the same bearer "
     "tokens as TensorService, and on the --local-agents' ports", &opt.reflection, 0, 0},
    {"log-level", CONFIG_STRING, "info", "debug, info, warn, error", &opt.log_level, 0, 0},
    {"log-format", CONFIG_STRING, "text",
     "text, or json (one object per line); --local-agents use the same", &opt.log_format, 0, 0},
    {"metrics-listen", CONFIG_STRING, NULL, "serve Prometheus metrics at http://ADDR/metrics (default: off)",
     &opt.metrics_listen, 0, 0},
    {"local-agent-metrics-port-base", CONFIG_INT, "0",
     "local agent i serves its metrics on port PORT+i, on the host of --metrics-listen "
     "(default 127.0.0.1) (0: off)", &opt.local_agent_metrics_port_base, 0, 65535},
    {"metrics-port-file", CONFIG_STRING, NULL, "write the metrics port here once serving", &opt.metrics_port_file, 0, 0},
};
#define NFLAGS (sizeof flags / sizeof flags[0])

static const char *synopsis = "[--listen ADDR] [--local-agents N] [flags]";

typedef struct server_state {
  health_t *health;
  int min_agents;
  command_service_t *commands;
  metrics_series_t *agent_restarts; /* NULL: not counted */
  int local_agents;
  _Atomic int local_failing; /* local agents the supervisor reports failing */
} server_state_t;

static void agent_restarted(int rank, void *arg) {
  (void)rank;
  server_state_t *st = arg;
  metrics_series_inc(st->agent_restarts, 1);
}

/* Liveness ("") says whether this process can do its work: with every local
 * agent failing (a wrong --local-agent-device, a broken binary) it cannot, and
 * an orchestrator that restarts it shows the loop (CrashLoopBackOff). One rank
 * failing out of several shows in readiness and the metric, not liveness:
 * restarting the server would end the sessions the others serve. */
static void agent_failing(int rank, bool failing, int failing_now, void *arg) {
  (void)rank;
  (void)failing;
  server_state_t *st = arg;
  atomic_store(&st->local_failing, failing_now);
  health_set(st->health, "",
             failing_now >= st->local_agents ? HEALTH_NOT_SERVING : HEALTH_SERVING);
}

static double local_failing_gauge(void *arg) {
  return atomic_load(&((server_state_t *)arg)->local_failing);
}

/* Root failures agents report become failed tensors and Sync answers. */
static void agent_reported(uint32_t rank, const agent_link_report_t *r, void *arg) {
  server_state_t *st = arg;
  if (r->n_errors && st->commands)
    command_service_on_report(st->commands, rank, r->errors, r->n_errors);
}

/* An agent is gone: the sessions with work on it hear of it at once. */
static void agent_lost(const agent_lost_t *l, void *arg) {
  server_state_t *st = arg;
  if (agent_links_stopping()) { /* not a loss: the server is stopping them */
    log_event(LOG_LEVEL_INFO, "server", &(log_fields_t){LOG_RANK(l->rank)},
              "rank %u (agent %s) left as the server stops", l->rank, l->agent_id);
    return;
  }
  if (st->commands) command_service_on_agent_lost(st->commands, l);
}

/* A session ended (closed, expired, shutdown): its agents free what it held. */
static void session_closed(session_t *s, session_end_t why, void *arg) {
  server_state_t *st = arg;
  log_event(LOG_LEVEL_INFO, "server", &(log_fields_t){.session = s->id},
            "session %.8s (%s) ended: %s", s->id, s->client_name, session_end_name(why));
  if (st->commands) command_service_session_closed(st->commands, s);
}

static void agents_changed(int healthy, void *arg) {
  server_state_t *st = arg;
  health_set(st->health, TENSOR_SERVICE_NAME,
             healthy >= st->min_agents ? HEALTH_SERVING : HEALTH_NOT_SERVING);
}

static void default_agent_binary(char *out, size_t len) {
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) {
    snprintf(out, len, "meshd-agent");
    return;
  }
  self[n] = '\0';
  snprintf(out, len, "%s/meshd-agent", dirname(self));
}

static double sessions_gauge(void *arg) { return (double)session_count(arg); }
static double agents_healthy_gauge(void *arg) { return agent_pool_healthy(arg); }
static double agents_registered_gauge(void *arg) { return agent_pool_size(arg); }
static double queued_instructions_gauge(void *arg) { return (double)agent_pool_totals(arg).pending; }
/* A completion-queue thread about to wait: the answers and instructions it
 * held back to batch them go now (answers first: they are older). */
static void before_wait(void) {
  command_service_before_wait();
  agent_link_uncork_idle();
}

static double link_batches_counter(void *arg) { return (double)agent_pool_totals(arg).batches; }
static double link_instructions_counter(void *arg) {
  return (double)agent_pool_totals(arg).instructions;
}

/* The port files this process wrote: a startup that fails after writing one
 * (a port taken further on) must not leave it naming a port nobody serves. */
static const char *port_files_written[3];
static bool started;
static void port_file_written(const char *path) {
  for (size_t i = 0; i < sizeof port_files_written / sizeof port_files_written[0]; i++)
    if (!port_files_written[i]) {
      port_files_written[i] = path;
      return;
    }
}
static void remove_port_files_at_exit(void) {
  if (started) return;
  for (size_t i = 0; i < sizeof port_files_written / sizeof port_files_written[0]; i++)
    if (port_files_written[i]) unlink(port_files_written[i]);
}

static int usage_error(const char *prog, const char *msg) {
  fprintf(stderr, "meshd: %s\n", msg);
  config_usage_line(stderr, prog, synopsis);
  return 2;
}

int main(int argc, char **argv) {
  char err[512];
  int npos = 0;
  int rc = config_parse(flags, NFLAGS, argc, argv, &npos, err, sizeof err);
  if (rc == 2) {
    build_info_print(stdout, "meshd");
    return 0;
  }
  if (rc == 1) {
    config_usage(stdout, "meshd", synopsis, flags, NFLAGS);
    return 0;
  }
  if (rc < 0) return usage_error("meshd", err);
  if (npos > 0) {
    snprintf(err, sizeof err, "unexpected argument '%s'", argv[1]);
    return usage_error("meshd", err);
  }
  log_level_t level;
  if (!log_parse_level(opt.log_level, &level)) {
    snprintf(err, sizeof err, "--log-level: '%s' is not one of debug, info, warn, error", opt.log_level);
    return usage_error("meshd", err);
  }
  log_format_t log_format;
  if (!log_parse_format(opt.log_format, &log_format)) {
    snprintf(err, sizeof err, "--log-format: '%s' is not one of text, json", opt.log_format);
    return usage_error("meshd", err);
  }
  if (opt.local_agent_metrics_port_base > 0 &&
      opt.local_agent_metrics_port_base + opt.local_agents - 1 > 65535) {
    snprintf(err, sizeof err, "--local-agent-metrics-port-base: %lld + %lld agents runs past port 65535",
             (long long)opt.local_agent_metrics_port_base, (long long)opt.local_agents);
    return usage_error("meshd", err);
  }
  if (opt.local_agent_metrics_port_base > 0 && opt.local_agents == 0)
    return usage_error("meshd", "--local-agent-metrics-port-base needs --local-agents");
  data_path_t data_path = DATA_PATH_AUTO;
  if (!strcmp(opt.data_path, "direct")) data_path = DATA_PATH_DIRECT;
  else if (!strcmp(opt.data_path, "proxy")) data_path = DATA_PATH_PROXY;
  else if (strcmp(opt.data_path, "auto")) {
    snprintf(err, sizeof err, "--data-path: '%s' is not one of direct, proxy, auto", opt.data_path);
    return usage_error("meshd", err);
  }
  /* The agent checks the device against its build; here only the spelling. */
  if (strcmp(opt.local_agent_device, "cpu") && strcmp(opt.local_agent_device, "cuda") &&
      strncmp(opt.local_agent_device, "cuda:", 5)) {
    snprintf(err, sizeof err, "--local-agent-device: '%s' is not one of cpu, cuda, cuda:N, "
             "cuda:emulated", opt.local_agent_device);
    return usage_error("meshd", err);
  }
  if (opt.stream_window_bytes > INT_MAX) {
    snprintf(err, sizeof err, "--stream-window-bytes: %llu is out of range [0, 2GiB)",
             (unsigned long long)opt.stream_window_bytes);
    return usage_error("meshd", err);
  }
  if (opt.max_message_bytes < 1024 || opt.max_message_bytes > INT_MAX) {
    snprintf(err, sizeof err, "--max-message-bytes: %llu is out of range [1KiB, 2GiB)",
             (unsigned long long)opt.max_message_bytes);
    return usage_error("meshd", err);
  }
  if ((opt.tls_cert != NULL) != (opt.tls_key != NULL))
    return usage_error("meshd", opt.tls_cert ? "--tls-cert needs --tls-key" : "--tls-key needs --tls-cert");
  if (opt.tls_client_ca && !opt.tls_cert)
    return usage_error("meshd", "--tls-client-ca needs --tls-cert and --tls-key (mTLS is TLS first)");
  rpc_tls_t tls = {.on = opt.tls_cert != NULL, .cert_file = opt.tls_cert, .key_file = opt.tls_key,
                   .ca_file = opt.tls_client_ca};
  if (rpc_tls_check(&tls, true, err, sizeof err) != 0) return usage_error("meshd", err);
  /* A port file of a port not opened would never be written: a script
   * waiting for it would wait for ever. */
  static const struct { const char *file, *listen; } needs[] = {
      {"--cluster-port-file", "--cluster-listen"}, {"--metrics-port-file", "--metrics-listen"}};
  const char *const have[][2] = {{opt.cluster_port_file, opt.cluster_listen},
                                 {opt.metrics_port_file, opt.metrics_listen}};
  for (size_t i = 0; i < sizeof needs / sizeof needs[0]; i++)
    if (have[i][0] && *have[i][0] && !(have[i][1] && *have[i][1])) {
      snprintf(err, sizeof err, "%s needs %s (the port it would hold)", needs[i].file,
               needs[i].listen);
      return usage_error("meshd", err);
    }
  log_set_level(level);
  log_set_format(log_format);
  int min_agents = opt.min_agents >= 0 ? (int)opt.min_agents
                                       : (opt.local_agents > 0 ? (int)opt.local_agents : 1);
  if (min_agents > opt.max_agents || opt.local_agents > opt.max_agents) {
    snprintf(err, sizeof err, "--max-agents %lld is below --%s %lld", (long long)opt.max_agents,
             opt.local_agents > opt.max_agents ? "local-agents" : "min-agents",
             opt.local_agents > opt.max_agents ? (long long)opt.local_agents : (long long)min_agents);
    return usage_error("meshd", err);
  }
  cluster_opts_t copts = {.ca = opt.cluster_ca, .cert = opt.cluster_cert, .key = opt.cluster_key,
                          .name = opt.cluster_name, .listen = opt.cluster_listen,
                          .port_file = opt.cluster_port_file, .join_token_file = opt.join_token_file,
                          .local_agents = opt.local_agents > 0, .client_tls = tls.on,
                          .client_auth = opt.auth_tokens != NULL, .threads = (int)opt.threads,
                          .max_message_bytes = (int)opt.max_message_bytes,
                          .max_connection_idle_ms = (int)(opt.max_connection_idle * 1000),
                          .handshake_timeout_ms = (int)(opt.handshake_timeout * 1000),
                          .max_concurrent_streams = (int)opt.max_streams_per_connection,
                          .max_unauthenticated_requests = (int)opt.max_unauthenticated_requests,
                          .memory_bytes = opt.rpc_memory_bytes};
  if (cluster_check(&copts, err, sizeof err) != 0) return usage_error("meshd", err);

  if (opt.server_fault && *opt.server_fault) {
    char why[400];
    if (fault_parse(opt.server_fault, FAULT_SERVER_PLACES, &server_fault, why, sizeof why) != 0) {
      snprintf(err, sizeof err, "--server-fault: %s", why);
      return usage_error("meshd", err);
    }
    server_fault_on = true;
    log_warn("meshd", "fault injection on: %s", opt.server_fault);
  }
  url_policy_t urls;
  meshd_error_t ue;
  if (url_policy_parse(opt.url_allow, &urls, &ue)) return usage_error("meshd", ue.msg);
  urls.opts.max_bytes = opt.url_max_bytes ? opt.url_max_bytes : URL_FETCH_MAX_BYTES;
  urls.opts.connect_timeout_ms = (long)opt.url_connect_timeout_ms;
  urls.opts.timeout_ms = (long)opt.url_timeout_ms;
  urls.opts.max_retries = (int)opt.url_retries;
  urls.opts.min_speed = (long)opt.url_min_speed;
  urls.opts.slow_s = (long)opt.url_slow_s;

  runtime_block_signals();
  runtime_tune_malloc();
  runtime_raise_fd_limit();
  rpc_init();
  /* One queue and its threads for every port and every call to the agents:
   * the fewest handoffs between threads per call (rpc.h; docs/architecture.md,
   * "Threads"). */
  if (rpc_loop_start((int)opt.threads, before_wait) != 0) {
    log_error("server", "cannot start the rpc threads");
    rpc_shutdown();
    return 1;
  }
  auth_t *auth = auth_create(opt.auth_tokens, err, sizeof err);
  if (!auth) {
    log_error("server", "%s", err);
    return 2;
  }
  cluster_t *cluster = cluster_create(&copts, err, sizeof err);
  if (!cluster) {
    log_error("server", "%s", err);
    auth_destroy(auth);
    return 2;
  }

  char server_id[33];
  runtime_random_hex(server_id, 16);
  server_state_t state = {health_create(), min_agents, NULL, NULL, (int)opt.local_agents, 0};
  agent_pool_callbacks_t pool_cb = {.changed = agents_changed, .on_report = agent_reported,
                                     .on_lost = agent_lost, .arg = &state};
  agent_link_set_hold_ms((int)opt.link_hold_ms);
  agent_link_set_lone_ms((int)opt.link_lone_ms);
  agent_pool_t *pool = agent_pool_create(&pool_cb);
  registry_opts_t ropts = {.server_id = server_id, .dial_timeout_ms = 3000,
                           .agent_timeout_ms = (int)(opt.agent_timeout * 1000),
                           .max_agents = (int)opt.max_agents,
                           .fault = server_fault_on ? &server_fault : NULL};
  cluster_registry_opts(cluster, &ropts);
  if (pool) {
    agent_pool_set_max_agents(pool, (int)opt.max_agents);
    agent_pool_set_agent_tls(pool, cluster_agent_tls(cluster));
  }
  registry_t *registry = pool ? registry_create(pool, &ropts) : NULL;
  layout_set_limits(&(layout_limits_t){(int)opt.max_tensor_dims, opt.max_tensor_elements});
  session_table_t *sessions =
      session_table_create((uint64_t)opt.session_ttl, opt.session_quota_bytes, session_closed, &state);
  if (sessions)
    session_table_set_limits(sessions, &(session_limits_t){
                                           .max_refs = (uint64_t)opt.session_max_refs,
                                           .max_meshes = (uint64_t)opt.session_max_meshes,
                                           .max_streams = (uint64_t)opt.session_max_streams,
                                           .max_command_refs = (uint64_t)opt.max_command_refs});
  flow_limits_t limits = {.session_commands = (uint64_t)opt.session_max_queued,
                          .session_bytes = opt.session_max_queued_bytes,
                          .total_commands = (uint64_t)opt.max_queued,
                          .total_bytes = opt.max_queued_bytes};
  state.commands = sessions ? command_service_create(pool, sessions, &limits) : NULL;
  if (state.commands) command_service_set_urls(state.commands, &urls);
  data_service_t *data = sessions ? data_service_create(pool, sessions, opt.max_message_bytes,
                                                               (int)opt.session_max_transfers) : NULL;
  if (data) data_service_set_path(data, data_path, opt.transfer_grant_ms);
  if (data) data_service_set_grant_start(data, opt.transfer_grant_start_ms);
  if (data) data_service_set_max_relays(data, (int)opt.max_relayed_transfers);
  if (data && server_fault_on) data_service_set_fault(data, &server_fault);
  if (data) data_service_set_auth(data, auth);
  if (server_fault_on) session_service_set_fault(&server_fault);
  load_service_t *loads = sessions ? load_service_create(pool, sessions, &urls) : NULL;
  /* Keepalive: the rpc layer's defaults (30 s, ack within 20 s, only while
   * calls are in flight; rpc.h). Agents are watched on the dial-back channel
   * (--agent-timeout), not by pinging their registration call. */
  session_table_set_owner_limit(sessions, (uint64_t)opt.max_sessions_per_principal);
  session_table_set_max_sessions(sessions, (uint64_t)opt.max_sessions);
  rpc_server_opts_t so = {.listen = opt.listen,
                          .threads = (int)opt.threads,
                          .max_message_bytes = (int)opt.max_message_bytes,
                          .stream_window_bytes = (int)opt.stream_window_bytes,
                          .tls = tls,
                          .max_connection_idle_ms = (int)(opt.max_connection_idle * 1000),
                          .handshake_timeout_ms = (int)(opt.handshake_timeout * 1000),
                          .max_concurrent_streams = (int)opt.max_streams_per_connection,
                          .max_unauthenticated_requests = (int)opt.max_unauthenticated_requests,
                          .memory_bytes = opt.rpc_memory_bytes,
                          .before_wait = before_wait};
  rpc_server_t *srv = rpc_server_create(&so, err, sizeof err);
  if (!srv || !state.health || !pool || !registry || !sessions || !state.commands || !data || !loads) {
    log_error("server", "cannot start: %s", srv ? "out of memory" : err);
    return 1;
  }
  size_t n;
  /* Before any agent can register (with --cluster-listen the registry's port starts
   * in cluster_serve_registry): from then on agents_changed has the last word. */
  health_set(state.health, "", HEALTH_SERVING);
  health_set(state.health, TENSOR_SERVICE_NAME, min_agents == 0 ? HEALTH_SERVING : HEALTH_NOT_SERVING);
  /* The registry has its own guard (join token, cluster certificate), on the
   * client port or a port of its own (cluster.h). */
  atexit(remove_port_files_at_exit); /* whichever way a failed startup returns */
  if (cluster_serve_registry(cluster, registry, srv, err, sizeof err) != 0) {
    log_error("server", "%s", err);
    rpc_server_destroy(srv);
    return 1;
  }
  if (opt.cluster_listen && *opt.cluster_listen && opt.cluster_port_file)
    port_file_written(opt.cluster_port_file);
  /* Every client-facing method is guarded; Health stays open. */
  const rpc_method_t *m = tensor_service_methods(&n);
  rpc_server_add_methods_guarded(srv, m, n, pool, auth_guard, auth);
  m = session_service_methods(&n);
  rpc_server_add_methods_guarded(srv, m, n, sessions, auth_guard, auth);
  m = command_service_methods(&n);
  rpc_server_add_methods_guarded(srv, m, n, state.commands, auth_guard, auth);
  m = data_service_methods(&n);
  rpc_server_add_methods_guarded(srv, m, n, data, auth_guard, auth);
  m = load_service_methods(&n);
  rpc_server_add_methods_guarded(srv, m, n, loads, auth_guard, auth);
  health_add_methods(state.health, srv);
  /* Reflection describes what the port serves, to whoever may call it. */
  reflection_t *reflection = opt.reflection ? reflection_create(err, sizeof err) : NULL;
  if (opt.reflection &&
      (!reflection || reflection_add_methods(reflection, srv, auth_guard, auth) != 0)) {
    log_error("server", "cannot serve reflection: %s", reflection ? "already registered" : err);
    rpc_server_destroy(srv);
    return 1;
  }

  int port = rpc_server_start(srv, err, sizeof err);
  if (port < 0) {
    log_error("server", "%s", err);
    rpc_server_destroy(srv);
    return 1;
  }
  rpc_server_t *health_srv = NULL;
  if (opt.health_listen && *opt.health_listen) {
    /* Strangers reach it too: the client port's bounds apply to it. */
    health_srv = health_serve(state.health, opt.health_listen, &so, err, sizeof err);
    if (!health_srv) {
      log_error("server", "--health-listen: %s", err);
      rpc_server_destroy(srv);
      return 1;
    }
    log_info("server", "plaintext health on %s (port %d)", opt.health_listen,
             rpc_server_port(health_srv));
  }
  metrics_registry_t *metrics = NULL;
  metrics_http_t *metrics_http = NULL;
  if (opt.metrics_listen && *opt.metrics_listen) {
    metrics = metrics_create();
    if (metrics) {
      metrics_define_std(metrics);
      command_service_set_metrics(state.commands, metrics);
      data_service_set_metrics(data, metrics);
      metrics_define(metrics, "meshd_queued_instructions", METRIC_GAUGE,
                     "Instructions sent to agents and not yet reported run, all agents.");
      metrics_set_fn(metrics, "meshd_queued_instructions", NULL, queued_instructions_gauge, pool);
      metrics_define(metrics, "meshd_link_batches_total", METRIC_COUNTER,
                     "InstructionBatch messages written to the agents (all ranks).");
      metrics_set_fn(metrics, "meshd_link_batches_total", NULL, link_batches_counter, pool);
      metrics_define(metrics, "meshd_link_instructions_total", METRIC_COUNTER,
                     "Instructions written to the agents (all ranks); divided by "
                     "meshd_link_batches_total, the mean batch.");
      metrics_set_fn(metrics, "meshd_link_instructions_total", NULL, link_instructions_counter,
                     pool);
      metrics_define(metrics, "meshd_agent_restarts_total", METRIC_COUNTER,
                     "Local agents (--local-agents) started again after they exited.");
      state.agent_restarts = metrics_series(metrics, "meshd_agent_restarts_total", NULL);
      metrics_define(metrics, "meshd_local_agents_failing", METRIC_GAUGE,
                     "Local agents (--local-agents) that keep exiting right after their "
                     "start; with all of them failing, liveness (\"\") is NOT_SERVING.");
      metrics_set_fn(metrics, "meshd_local_agents_failing", NULL, local_failing_gauge, &state);
      metrics_define(metrics, "meshd_sessions", METRIC_GAUGE, "Open sessions.");
      metrics_set_fn(metrics, "meshd_sessions", NULL, sessions_gauge, sessions);
      metrics_define(metrics, "meshd_agents", METRIC_GAUGE,
                     "Agents: registered with the server, and of those healthy.");
      metrics_set_fn(metrics, "meshd_agents", (const char *[]){"state", "healthy", NULL},
                     agents_healthy_gauge, pool);
      metrics_set_fn(metrics, "meshd_agents", (const char *[]){"state", "registered", NULL},
                     agents_registered_gauge, pool);
      metrics_http = metrics_http_start(metrics, opt.metrics_listen, err, sizeof err);
    }
    if (!metrics_http) {
      log_error("server", "--metrics-listen: %s", metrics ? err : "out of memory");
      rpc_server_shutdown(srv, 0);
      rpc_server_destroy(srv);
      return 1;
    }
    if (opt.metrics_port_file && runtime_write_port_file(opt.metrics_port_file, metrics_http_port(metrics_http)) != 0) {
      log_error("server", "cannot write --metrics-port-file %s: %s", opt.metrics_port_file, strerror(errno));
      rpc_server_shutdown(srv, 0);
      rpc_server_destroy(srv);
      return 1;
    }
    if (opt.metrics_port_file) port_file_written(opt.metrics_port_file);
    log_info("server", "metrics on http://%s/metrics (port %d)", opt.metrics_listen, metrics_http_port(metrics_http));
  }
  /* Once every port serves: a port file left by a startup that failed past it
   * (--metrics-listen taken) named a port nobody served. */
  if (opt.port_file && runtime_write_port_file(opt.port_file, port) != 0) {
    log_error("server", "cannot write --port-file %s: %s", opt.port_file, strerror(errno));
    rpc_server_shutdown(srv, 0);
    rpc_server_destroy(srv);
    return 1;
  }
  if (opt.port_file) port_file_written(opt.port_file);
  log_info("server", "meshd %s (server %s) listening on %s, port %d (%s, %s); TensorService needs "
           "%d agent(s)", MESHD_VERSION, server_id, opt.listen, port,
           !tls.on ? "plaintext" : tls.ca_file ? "mTLS" : "TLS",
           auth_enabled(auth) ? "bearer tokens" : "no tokens", min_agents);
  if (!auth_enabled(auth) || !tls.on)
    log_warn("server", "this server is open: %s%s%s; anyone who reaches port %d %s. For local work "
             "only (see docs/security.md)", !tls.on ? "no TLS (--tls-cert/--tls-key)" : "",
             !tls.on && !auth_enabled(auth) ? " and " : "",
             !auth_enabled(auth) ? "no --auth-tokens" : "", port,
             !auth_enabled(auth) ? "can use and read every session" : "can read its traffic");

  char client_addr[300];
  runtime_local_address(opt.listen, port, client_addr, sizeof client_addr);
  cluster_log_policy(cluster, client_addr);

  supervisor_t *sup = NULL;
  if (opt.local_agents > 0) {
    static char binary[PATH_MAX], server_addr[300]; /* the supervisor keeps pointers */
    if (opt.agent_binary) snprintf(binary, sizeof binary, "%s", opt.agent_binary);
    else default_agent_binary(binary, sizeof binary);
    cluster_local_target(cluster, client_addr, server_addr, sizeof server_addr);
    /* The host's memory, or this container's limit when smaller (the agents
     * share the server's cgroup), is shared among cpu agents; a GPU agent's
     * capacity is its GPU's. */
    uint64_t total = runtime_memory_bytes();
    bool gpu = !strncmp(opt.local_agent_device, "cuda", 4) &&
               strcmp(opt.local_agent_device, "cuda:emulated") != 0;
    static char metrics_host[256]; /* the supervisor keeps a pointer */
    runtime_host_of(opt.metrics_listen, metrics_host, sizeof metrics_host);
    supervisor_opts_t sopts = {.agent_binary = binary,
                               .server = server_addr,
                               .count = (int)opt.local_agents,
                               .memory_bytes = gpu ? 0 : total / (uint64_t)opt.local_agents,
                               .log_level = opt.log_level,
                               .log_format = opt.log_format,
                               .metrics_host = opt.metrics_listen && *opt.metrics_listen ? metrics_host : NULL,
                               .metrics_port_base = (int)opt.local_agent_metrics_port_base,
                               .on_restart = agent_restarted,
                               .on_failing = agent_failing,
                               .arg = &state,
                               .device = opt.local_agent_device,
                               .join_token_file = cluster_join_token_file(cluster),
                               .cluster_ca = opt.cluster_ca,
                               .cluster_cert = opt.cluster_cert,
                               .cluster_key = opt.cluster_key,
                               .cluster_name = opt.cluster_name,
                               .max_tensor_dims = opt.max_tensor_dims,
                               .max_tensor_elements = opt.max_tensor_elements,
                               .max_message_bytes = opt.max_message_bytes,
                               .rpc_memory_bytes = opt.rpc_memory_bytes,
                               .handshake_timeout = opt.handshake_timeout,
                               .reflection = opt.reflection};
    sup = supervisor_start(&sopts);
    if (!sup) {
      rpc_server_shutdown(srv, 0); /* its port files go at exit: nobody will serve them */
      rpc_server_destroy(srv);
      return 1;
    }
  }

  started = true;

  int sig;
  while ((sig = runtime_wait_signal(1000)) == 0 || sig == SIGHUP) {
    if (sig != SIGHUP) continue;
    int count = auth_reload(auth, err, sizeof err);
    if (count < 0) log_error("server", "SIGHUP: %s; the principals loaded before stay", err);
    else if (auth_enabled(auth)) {
      log_info("server", "SIGHUP: reloaded %d principal(s) from %s", count, opt.auth_tokens);
      /* A token removed cuts its holder off now, not at its calls' end: its
       * calls end (one admitted meanwhile too: the rpc layer asks again), and
       * the direct transfers planned under it are undone, their grants
       * revoked on the agents. */
      int ended = rpc_server_end_calls_of(srv, auth_call_revoked, auth,
                                          GRPC_STATUS_UNAUTHENTICATED, "UNAUTHENTICATED",
                                          "its bearer token was revoked at a reload of "
                                          "--auth-tokens (SIGHUP); call again with a valid token");
      int undone = data ? data_service_revoke(data, auth_token_revoked, auth) : 0;
      if (ended || undone)
        log_info("server", "SIGHUP: ended %d call(s) and undid %d planned transfer(s) of revoked "
                 "tokens", ended, undone);
    }
    else log_info("server", "SIGHUP: no --auth-tokens to reload");
  }
  log_info("server", "%s: draining for up to %.1f s", strsignal(sig), opt.drain_seconds);

  health_shutdown(state.health);
  session_table_set_accepting(sessions, false);
  rpc_server_stop_accepting(srv);
  int64_t deadline = rpc_now_ms() + (int64_t)(opt.drain_seconds * 1000);
  int on_client_port = cluster_has_own_port(cluster) ? 0 : 1;
  /* The calls in flight first: a registration that ends between the two
   * reads then makes the loop wait longer, never stop early under a client's
   * call (read the other way round, it counted the agent's call as gone from
   * the registry but not yet from the server). */
  for (;;) {
    int active = rpc_server_active_calls(srv);
    if (active <= on_client_port * registry_open_calls(registry) || rpc_now_ms() >= deadline)
      break;
    usleep(20000);
  }
  /* What is still running is told why it ends before the agents stop (their
   * links breaking under a waiting Sync or Fetch read as a lost agent). */
  char why[160];
  snprintf(why, sizeof why, "the server is shutting down: this call was still running when its "
           "--drain-seconds (%.1f s) passed; call again once it is back", opt.drain_seconds);
  int ended = rpc_server_end_calls(srv, "/meshd.v1.AgentRegistry/RegisterAgent",
                                   GRPC_STATUS_UNAVAILABLE, "UNAVAILABLE", why);
  if (ended > 0) log_info("server", "%d call(s) still running after the drain: ended", ended);
  agent_links_server_stopping();
  supervisor_stop(sup, 3.0);
  registry_close_all(registry);
  metrics_http_stop(metrics_http);
  int64_t left = deadline - rpc_now_ms();
  cluster_shutdown(cluster, 1.0);
  rpc_server_shutdown(srv, left > 1000 ? (double)left / 1000 : 1.0);
  if (health_srv) {
    rpc_server_shutdown(health_srv, 0);
    rpc_server_destroy(health_srv);
  }
  registry_destroy(registry);
  rpc_server_destroy(srv);
  reflection_destroy(reflection);
  cluster_destroy(cluster);
  data_service_destroy(data); /* its pending transfers hold sessions */
  session_table_destroy(sessions);
  command_service_destroy(state.commands);
  load_service_destroy(loads);
  url_policy_free(&urls);
  agent_pool_destroy(pool);
  health_destroy(state.health);
  metrics_destroy(metrics);
  auth_destroy(auth);
  rpc_shutdown();
  runtime_await_exit_threads("server", EXIT_THREADS_WAIT_MS);
  log_info("server", "stopped");
  return 0;
}
