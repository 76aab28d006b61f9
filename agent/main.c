/* meshd-agent: one process per device. Serves the Agent and Health services,
 * registers with the server, and on SIGTERM/SIGINT drains and exits 0. */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "agent.h"
#include "backend.h"
#include "dataplane/dataplane.h"
#include "execute.h"
#include "executor.h"
#include "build_info.h"
#include "config.h"
#include "health.h"
#include "layout.h"
#include "log.h"
#include "metrics.h"
#include "fault.h"
#include "grant.h"
#include "reflection.h"
#include "rpc.h"
#include "runtime.h"

#define PROG "meshd-agent"
#define SYNOPSIS "--server HOST:PORT [options]"

typedef struct options {
  const char *server;
  const char *listen;
  const char *advertise;
  const char *port_file;
  const char *device;
  int64_t rank;
  int64_t memory_share;
  uint64_t memory_bytes;
  double drain_seconds, handshake_timeout;
  double server_timeout;
  int64_t threads;
  uint64_t max_message_bytes, rpc_memory_bytes;
  int64_t max_unauthenticated_requests;
  int64_t max_transfer_nonces;
  int64_t max_transfer_nonces_per_session;
  const char *log_level;
  const char *log_format;
  const char *metrics_listen;
  const char *metrics_port_file;
  const char *fault;
  int64_t comm_timeout_ms;
  int64_t data_max_unproven;
  const char *cluster_ca, *cluster_cert, *cluster_key, *cluster_name;
  const char *join_token_file;
  const char *health_listen, *health_port_file;
  int64_t max_tensor_dims, max_tensor_elements;
  bool reflection;
  bool same_host_data;
} options_t;

static options_t opt;
static fault_t fault;
static bool fault_on;

/* Only the devices this build serves (tests and people read --help to know). */
#ifdef MESHD_HAVE_CUDA
#define DEVICE_HELP \
  "device to serve: cpu, cuda:N (GPU N), cuda:emulated (cuda kernels on the host, for tests)"
#else
#define DEVICE_HELP "device to serve: cpu (this build has no cuda backend)"
#endif

static const config_flag_t flags[] = {
    {"server", CONFIG_STRING, NULL, "where to register (required)", &opt.server, 0, 0},
    {"listen", CONFIG_STRING, "127.0.0.1:0", "the agent's gRPC address; port 0 picks a free port",
     &opt.listen, 0, 0},
    {"advertise", CONFIG_STRING, NULL,
     "address the server dials back (default: host of --listen + bound port)", &opt.advertise,
     0, 0},
    {"port-file", CONFIG_STRING, NULL, "write the bound port there", &opt.port_file, 0, 0},
    {"device", CONFIG_STRING, "cpu", DEVICE_HELP, &opt.device, 0, 0},
    {"rank", CONFIG_INT, "-1", "ask for this world rank; -1: any free rank", &opt.rank, -1,
     INT32_MAX},
    {"memory-bytes", CONFIG_BYTES, NULL,
     "capacity reported to the server (default: physical memory, or the GPU's)", &opt.memory_bytes, 0, 0},
    {"memory-share", CONFIG_INT, "1",
     "without --memory-bytes, report 1/N of the device's memory: N agents on one GPU "
     "(meshd --local-agents N --local-agent-device cuda:K passes it)", &opt.memory_share, 1, 256},
    {"server-timeout", CONFIG_DOUBLE, "20",
     "a server that acknowledges no keepalive ping for this many seconds is taken as gone, and "
     "the agent registers again (one that exits closes the connection: noticed at once)",
     &opt.server_timeout, 1, 3600},
    {"drain-seconds", CONFIG_DOUBLE, "5", "on SIGTERM/SIGINT, how long running calls may finish",
     &opt.drain_seconds, 0, 3600},
    {"threads", CONFIG_INT, "2", "completion-queue threads", &opt.threads, 1, 256},
    {"max-message-bytes", CONFIG_BYTES, "4MiB", "largest gRPC message in either direction",
     &opt.max_message_bytes, 0, 0},
    {"max-unauthenticated-requests", CONFIG_INT, "16",
     "requests of callers no guard authenticated (Health without cluster TLS) still arriving at "
     "once, each up to --max-message-bytes; past it the oldest is cancelled",
     &opt.max_unauthenticated_requests, 1, 65536},
    {"handshake-timeout", CONFIG_DOUBLE, "10",
     "close a connection (gRPC and health ports) that has not finished its TLS and HTTP/2 "
     "handshake within this many seconds", &opt.handshake_timeout, 0.1, 3600},
    {"max-transfer-nonces", CONFIG_INT, "65536",
     "transfer grants (direct data path) this agent remembers at once, each until its grant's "
     "start-by time; past it a grant is refused RESOURCE_EXHAUSTED", &opt.max_transfer_nonces, 1,
     16777216},
    {"max-transfer-nonces-per-session", CONFIG_INT, NULL,
     "of those, the most one session's grants may hold, so that one session's transfers "
     "cannot refuse every other session's; past it its grants are refused RESOURCE_EXHAUSTED. "
     "Unset: a quarter of --max-transfer-nonces; at or above it: no share",
     &opt.max_transfer_nonces_per_session, 1, 16777216},
    {"rpc-memory-bytes", CONFIG_BYTES, "1GiB",
     "memory gRPC may take for this port's connections (read buffers, calls) before it closes "
     "idle ones and then cancels calls (0: no bound)", &opt.rpc_memory_bytes, 0, 0},
    {"log-level", CONFIG_STRING, "info", "debug, info, warn, error", &opt.log_level, 0, 0},
    {"log-format", CONFIG_STRING, "text", "text, or json (one object per line)", &opt.log_format,
     0, 0},
    {"metrics-listen", CONFIG_STRING, NULL,
     "serve Prometheus metrics at http://ADDR/metrics (default: off)", &opt.metrics_listen, 0, 0},
    {"metrics-port-file", CONFIG_STRING, NULL, "write the metrics port there",
     &opt.metrics_port_file, 0, 0},
    {"comm-timeout-ms", CONFIG_INT, "30000",
     "a collective or send fails when a peer moves no byte for this long", &opt.comm_timeout_ms,
     100, 3600000},
    {"data-max-unproven", CONFIG_INT, NULL,
     "data port: accepted connections not proven yet (strangers' among them) held at once; past "
     "it one that sent nothing, else the oldest, is closed for each newcomer. Unset: 1024, or a "
     "quarter of the fd limit where that is less, but at least 64",
     &opt.data_max_unproven, 1, 1048576},
    {"same-host-data", CONFIG_BOOL, "true",
     "reach data planes of this host over their unix socket, passing large broadcasts as "
     "shared memory mapped by every destination; false: TCP to every peer", &opt.same_host_data,
     0, 0},
    {"cluster-ca", CONFIG_STRING, NULL,
     "cluster mTLS (with --cluster-cert and --cluster-key): the CA of the server's and agents' "
     "cluster certificates; the Agent port then admits only its certificates", &opt.cluster_ca, 0, 0},
    {"cluster-cert", CONFIG_STRING, NULL, "this agent's cluster certificate (PEM)",
     &opt.cluster_cert, 0, 0},
    {"cluster-key", CONFIG_STRING, NULL, "its private key (PEM)", &opt.cluster_key, 0, 0},
    {"cluster-name", CONFIG_STRING, "meshd-cluster",
     "with cluster mTLS: the name the server's certificate must carry", &opt.cluster_name, 0, 0},
    {"join-token-file", CONFIG_STRING, NULL,
     "a file whose first line is the token the server wants at registration", &opt.join_token_file,
     0, 0},
    {"health-listen", CONFIG_STRING, NULL,
     "also serve grpc.health.v1 alone, in plaintext, on this address (probes; default: off)",
     &opt.health_listen, 0, 0},
    {"health-port-file", CONFIG_STRING, NULL, "write the --health-listen port there",
     &opt.health_port_file, 0, 0},
    {"max-tensor-dims", CONFIG_INT, "16", "dims a tensor may have (the server's value)",
     &opt.max_tensor_dims, 1, 16},
    {"max-tensor-elements", CONFIG_INT, "17179869184",
     "elements one tensor may have here (default 2^34; the server's value)",
     &opt.max_tensor_elements, 1, (double)(1LL << 62)},
    {"reflection", CONFIG_BOOL, "true",
     "serve gRPC server reflection (grpcurl list/describe) on --listen, to callers the Agent "
     "service admits", &opt.reflection, 0, 0},
    {"fault", CONFIG_STRING, NULL,
     "fault injection for tests, e.g. reduce:hang,rank=1 or hello:old (see core/platform/fault.h)",
     &opt.fault, 0, 0},
};
#define NFLAGS (sizeof flags / sizeof flags[0])

__attribute__((format(printf, 1, 2))) static int usage_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "%s: ", PROG);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  config_usage_line(stderr, PROG, SYNOPSIS);
  return 2;
}

/* Returns -1 to go on, else the exit code. */
static int parse_options(int argc, char **argv) {
  char err[256];
  int npos = 0;
  int rc = config_parse(flags, NFLAGS, argc, argv, &npos, err, sizeof err);
  if (rc == 2) {
    build_info_print(stdout, "meshd-agent");
    return 0;
  }
  if (rc == 1) {
    config_usage(stdout, PROG, SYNOPSIS, flags, NFLAGS);
    return 0;
  }
  if (rc < 0)
    return usage_error("%s", err);
  if (npos > 0)
    return usage_error("unexpected argument '%s'", argv[1]);
  if (!opt.server || !*opt.server)
    return usage_error("--server is required (or MESHD_SERVER)");
  if (!backend_for_device(opt.device))
    return usage_error("--device: '%s' is not a device this build serves (%s)", opt.device,
                       backend_devices_supported());
  if (opt.max_message_bytes < 1024 || opt.max_message_bytes > INT_MAX)
    return usage_error("--max-message-bytes: must be between 1KiB and 2GiB-1");
  log_level_t level;
  if (!log_parse_level(opt.log_level, &level))
    return usage_error("--log-level: '%s' is not one of debug, info, warn, error",
                       opt.log_level);
  log_set_level(level);
  log_format_t log_format;
  if (!log_parse_format(opt.log_format, &log_format))
    return usage_error("--log-format: '%s' is not one of text, json", opt.log_format);
  log_set_format(log_format);
  int ncluster = !!opt.cluster_ca + !!opt.cluster_cert + !!opt.cluster_key;
  if (ncluster != 0 && ncluster != 3)
    return usage_error("--cluster-ca, --cluster-cert and --cluster-key go together (missing: %s)",
                       !opt.cluster_ca ? "--cluster-ca" : !opt.cluster_cert ? "--cluster-cert"
                                                                            : "--cluster-key");
  /* A port file of a port not opened would never be written. */
  if (opt.metrics_port_file && *opt.metrics_port_file &&
      !(opt.metrics_listen && *opt.metrics_listen))
    return usage_error("--metrics-port-file needs --metrics-listen (the port it would hold)");
  if (opt.health_port_file && *opt.health_port_file && !(opt.health_listen && *opt.health_listen))
    return usage_error("--health-port-file needs --health-listen (the port it would hold)");
  if (!opt.cluster_name || !*opt.cluster_name)
    return usage_error("--cluster-name must not be empty");
  if (opt.fault && *opt.fault) {
    if (fault_parse(opt.fault, FAULT_AGENT_PLACES, &fault, err, sizeof err) != 0)
      return usage_error("--fault: %s", err);
    fault_on = true;
  }
  return -1;
}

static double allocated_gauge(void *arg) {
  backend_t *b = arg;
  return (double)atomic_load(&b->allocated);
}
static double sessions_gauge(void *arg) {
  (void)arg;
  return (double)executor_open_sessions();
}
static double instructions_fn(void *arg) {
  return (double)atomic_load(&((agent_stats_t *)arg)->instructions);
}
static double collective_bytes_fn(void *arg) {
  return (double)atomic_load(&((agent_stats_t *)arg)->collective_bytes);
}

/* One series of meshd_dataplane_rejected_total. */
typedef struct rejected_series {
  dataplane_t *dp;
  dp_reject_t reason;
} rejected_series_t;
static double rejected_fn(void *arg) {
  const rejected_series_t *r = arg;
  return (double)dataplane_rejected(r->dp, r->reason);
}
static double withdrawn_fn(void *arg) { return (double)dataplane_withdrawn(arg); }

/* One series of meshd_collective_aborts_total. */
typedef struct aborts_series {
  dataplane_t *dp;
  dp_abort_t reason;
} aborts_series_t;
static double aborts_fn(void *arg) {
  const aborts_series_t *a = arg;
  return (double)dataplane_aborts(a->dp, a->reason);
}

/* meshd_dataplane_shm_messages_total{landing="mapped"|"copied"}. */
static double shm_mapped_fn(void *arg) {
  uint64_t mapped = 0;
  dataplane_shm_received(arg, &mapped);
  return (double)mapped;
}
static double shm_copied_fn(void *arg) {
  uint64_t mapped = 0, all = dataplane_shm_received(arg, &mapped);
  return (double)(all - mapped);
}

/* One series of meshd_transfer_grants_total. */
static int grant_series[GRANT_RESULT_COUNT];
static double grants_fn(void *arg) { return (double)transfer_grant_results(*(const int *)arg); }
static double grant_calls_expired_fn(void *arg) {
  (void)arg;
  return (double)transfer_grant_watch_ended();
}

/* SIGUSR1 ends the server's Execute call as a broken link would (fault drills:
 * tests/integration/chaos.py "cut"); the agent then registers again. */
static _Atomic bool usr1_stop;
static void *usr1_thread(void *arg) {
  sigset_t s;
  sigemptyset(&s);
  sigaddset(&s, SIGUSR1);
  for (;;) {
    int sig = 0;
    if (sigwait(&s, &sig) != 0 || atomic_load(&usr1_stop)) return NULL;
    if (!execute_cut("the agent got SIGUSR1: its link to the server is cut"))
      log_info("agent", "SIGUSR1: no Execute call to cut");
  }
}

/* A thread started before main blocked SIGUSR1 (OpenBLAS's workers: the
 * library starts them when it loads) would take it with its default action,
 * which ends the agent; caught there, it goes on to usr1_thread. */
static pthread_t usr1_tid;
static void usr1_forward(int sig) {
  int saved = errno;
  if (!atomic_load(&usr1_stop)) pthread_kill(usr1_tid, sig);
  errno = saved;
}

/* Test only (docs/operations.md, Clocks): MESHD_TEST_AGENT_CLOCK_SHIFT_MS runs
 * this agent's clock for grants that many ms ahead of the machine's (negative:
 * behind), so that a test on one machine sees an agent whose clock is off. */
static void test_clock_shift(void) {
  const char *v = getenv("MESHD_TEST_AGENT_CLOCK_SHIFT_MS");
  if (!v || !*v) return;
  char *end = NULL;
  errno = 0;
  long long ms = strtoll(v, &end, 10);
  if (errno || *end || ms > GRANT_OFFSET_MAX_MS || ms < -GRANT_OFFSET_MAX_MS) {
    log_warn("agent", "MESHD_TEST_AGENT_CLOCK_SHIFT_MS=%s is not a number of ms (within a "
             "century); ignored", v);
    return;
  }
  grant_clock_shift(ms);
  log_warn("agent", "MESHD_TEST_AGENT_CLOCK_SHIFT_MS: this agent's clock for transfer grants "
           "runs %lld ms off the machine's (a test setting)", ms);
}

int main(int argc, char **argv) {
  int rc = parse_options(argc, argv);
  if (rc >= 0)
    return rc;

  /* Instructions are checked as the server checks commands (agent/validate.c). */
  layout_set_limits(&(layout_limits_t){(int)opt.max_tensor_dims, opt.max_tensor_elements});
  static agent_info_t info;
  runtime_random_hex(info.id, 16);
  info.server = opt.server;
  info.server_timeout_ms = (int)(opt.server_timeout * 1000);
  info.device = opt.device;
  const backend_ops_t *ops = backend_for_device(opt.device);
  /* A GPU's capacity is its memory (the backend reads it at open); host
   * backends default to physical memory. */
  bool gpu = ops != &cpu_backend_ops && strcmp(opt.device, "cuda:emulated") != 0;
  info.memory_bytes = opt.memory_bytes ? opt.memory_bytes : gpu ? 0 : runtime_memory_bytes();
  if (!opt.memory_bytes) info.memory_bytes /= (uint64_t)opt.memory_share; /* the GPU's: below */
  info.requested_rank = (int32_t)opt.rank;
  info.instructions = MESHD__AGENT__V1__INSTRUCTION__BODY_REVOKE_GRANTS; /* the newest body it runs */
  info.data_plane = 1; /* Group.pair_secrets */
  info.clock = true;   /* HelloReply.unix_ms: grants in this agent's clock */
  int unused_ms;
  if (fault_on && fault_hit(&fault, "hello", opt.rank, &unused_ms) == FAULT_OLD) {
    info.instructions = MESHD__AGENT__V1__INSTRUCTION__BODY_LITERAL - 1; /* drills: an older build */
    info.data_plane = 0;
    info.clock = false;
  }
  test_clock_shift();
  if (opt.rank >= 0) atomic_store(&agent_rank, opt.rank);
  if (opt.rank >= 0) log_set_rank(opt.rank);

  char err[256];
  bool cluster = opt.cluster_ca != NULL;
  if (cluster) {
    info.cluster_tls = (rpc_tls_t){.on = true, .ca_file = opt.cluster_ca,
                                   .cert_file = opt.cluster_cert, .key_file = opt.cluster_key,
                                   .server_name = opt.cluster_name};
    if (rpc_tls_check(&info.cluster_tls, true, err, sizeof err) != 0)
      return usage_error("--cluster-ca/--cluster-cert/--cluster-key: %s", err);
  }
  if (opt.join_token_file && *opt.join_token_file &&
      !(info.join_token = secret_file_open("--join-token-file", opt.join_token_file, err,
                                           sizeof err)))
    return usage_error("%s", err);

  /* Before rpc_init, so every thread gRPC starts inherits the mask. */
  runtime_block_signals();
  sigset_t usr1;
  sigemptyset(&usr1);
  sigaddset(&usr1, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &usr1, NULL);
  bool usr1_started = pthread_create(&usr1_tid, NULL, usr1_thread, NULL) == 0;
  if (usr1_started) {
    struct sigaction sa = {.sa_handler = usr1_forward};
    sigfillset(&sa.sa_mask);
    sigaction(SIGUSR1, &sa, NULL);
  }

  runtime_tune_malloc();
  runtime_raise_fd_limit();
  transfer_grant_set_max_nonces((size_t)opt.max_transfer_nonces);
  transfer_grant_set_max_nonces_per_session((size_t)opt.max_transfer_nonces_per_session);
  rpc_init();
  rc = 1;
  static backend_t backend;
  static agent_stats_t stats;
  dataplane_t *dp = NULL;
  bool backend_open = false, device_lost = false;
  health_t *health = health_create();
  registration_t *reg = NULL;
  metrics_registry_t *metrics = NULL;
  metrics_http_t *metrics_http = NULL;
  rpc_server_t *health_srv = NULL;
  reflection_t *reflection = NULL;
  /* With cluster certificates the Agent port is TLS with this agent's cluster
   * certificate. A client certificate is verified when presented but not
   * required: clients of the direct data path hold none, and reach only Read
   * and Write under a grant; every other call needs a verified cluster
   * certificate as well as the call secret (agent_auth_guard, agent_peer_guard). */
  rpc_server_opts_t sopts = {
      .listen = opt.listen,
      .threads = (int)opt.threads,
      .max_message_bytes = (int)opt.max_message_bytes,
      .max_unauthenticated_requests = (int)opt.max_unauthenticated_requests,
      .handshake_timeout_ms = (int)(opt.handshake_timeout * 1000),
      .memory_bytes = opt.rpc_memory_bytes,
      .tls = {.on = cluster, .ca_file = opt.cluster_ca, .cert_file = opt.cluster_cert,
              .key_file = opt.cluster_key, .client_cert_optional = true},
  };
  rpc_server_t *srv = rpc_server_create(&sopts, err, sizeof err);
  if (!srv) {
    log_error("agent", "cannot create the gRPC server: %s", err);
    goto out;
  }
  size_t nmethods;
  const rpc_method_t *methods = agent_service_methods(&nmethods);
  if (health_add_methods_guarded(health, srv, agent_peer_guard, &info) != 0 ||
      rpc_server_add_methods_guarded(srv, methods, nmethods, &info, agent_auth_guard, &info) !=
          0) {
    log_error("agent", "cannot register the Health and Agent services");
    goto out;
  }
  /* Reflection is as closed as the Agent service (the call secret, cluster mTLS). */
  if (opt.reflection &&
      (!(reflection = reflection_create(err, sizeof err)) ||
       reflection_add_methods(reflection, srv, agent_auth_guard, &info) != 0)) {
    log_error("agent", "cannot serve reflection: %s", reflection ? "already registered" : err);
    goto out;
  }
  health_set(health, AGENT_HEALTH_SERVICE, HEALTH_NOT_SERVING);
  int port = rpc_server_start(srv, err, sizeof err);
  if (port <= 0) {
    log_error("agent", "%s", err);
    goto out;
  }
  health_set(health, "", HEALTH_SERVING);
  if (opt.health_listen && *opt.health_listen) {
    health_srv = health_serve(health, opt.health_listen, &sopts, err, sizeof err);
    if (!health_srv) {
      log_error("agent", "--health-listen: %s", err);
      goto out;
    }
    int hport = rpc_server_port(health_srv);
    if (opt.health_port_file && runtime_write_port_file(opt.health_port_file, hport) != 0) {
      log_error("agent", "cannot write --health-port-file %s: %s", opt.health_port_file,
                strerror(errno));
      goto out;
    }
    log_info("agent", "health (plaintext, grpc.health.v1 only) on %s, port %d", opt.health_listen,
             hport);
  }

  /* The device first: an agent without its device must not register. */
  meshd_error_t merr = {0};
  backend.ops = ops;
  backend.capacity = info.memory_bytes;
  backend.comm_timeout_ms = (int)opt.comm_timeout_ms; /* NCCL's waits: as the data plane's */
  if (backend.ops->open(&backend, info.device, &merr) != 0) {
    log_error("agent", "cannot open device %s: %s", info.device, merr.msg);
    goto out;
  }
  backend_open = true;
  if (gpu && !opt.memory_bytes) backend.capacity /= (uint64_t)opt.memory_share;
  info.memory_bytes = backend.capacity;

  if (opt.advertise)
    snprintf(info.address, sizeof info.address, "%s", opt.advertise);
  else
    runtime_local_address(opt.listen, port, info.address, sizeof info.address);
  if (opt.port_file && *opt.port_file && runtime_write_port_file(opt.port_file, port) != 0) {
    log_error("agent", "cannot write --port-file %s: %s", opt.port_file, strerror(errno));
    goto out;
  }
  if (fault_on) log_warn("agent", "fault injection on: %s", opt.fault);
  log_info("agent", "agent %s listening on port %d (%s), advertising %s, device %s, memory %" PRIu64
           " bytes, pid %d", info.id, port,
           cluster ? "TLS: a cluster certificate for all but Read/Write under a grant"
                   : "plaintext; calls need the call secret",
           info.address, info.device, info.memory_bytes, (int)getpid());
  log_info("agent", "registering with %s %s", opt.server,
           cluster && info.join_token ? "over cluster mTLS, with a join token"
           : cluster                  ? "over cluster mTLS"
           : info.join_token          ? "with a join token"
                                      : "without credentials (the server must be open to that)");

  /* The data plane (the device is open already): bound where the agent
   * listens (in Kubernetes a wildcard: the advertised name need not resolve
   * yet, nor to this pod's new address), reached at the advertised host. */
  char host[200], bind_host[200];
  runtime_host_of(info.address, host, sizeof host);
  runtime_host_of(opt.listen, bind_host, sizeof bind_host);
  if (!bind_host[0]) snprintf(bind_host, sizeof bind_host, "0.0.0.0"); /* ":port" */
  dp = dataplane_start(bind_host, opt.rank >= 0 ? (uint32_t)opt.rank : 0,
                       (int)opt.comm_timeout_ms, &merr);
  if (!dp) { /* of no use to a mesh of several agents: a restart tries again */
    log_error("agent", "cannot start the data plane on %s: %s", bind_host, merr.msg);
    goto out;
  }
  dataplane_same_host(dp, opt.same_host_data);
  if (opt.data_max_unproven > 0) dataplane_max_unproven(dp, (size_t)opt.data_max_unproven);
  info.data_port = (uint32_t)dataplane_port(dp);
  backend.net = dp; /* the cpu backend's communicators run on it */
  snprintf(info.data_address, sizeof info.data_address, "%s:%u", host, info.data_port);
  log_info("agent", "data plane on %s (bound on %s)", info.data_address, bind_host);
  info.env = (run_env_t){.backend = &backend, .data_address = info.data_address,
                         .rank = &agent_rank, .stats = &stats, .fault = fault_on ? &fault : NULL};

  if (opt.metrics_listen && *opt.metrics_listen) {
    metrics = metrics_create();
    if (!metrics) {
      log_error("agent", "--metrics-listen: out of memory");
      goto out;
    }
    metrics_define_std(metrics);
    metrics_define(metrics, "meshd_agent_allocated_bytes", METRIC_GAUGE,
                   "Device memory the agent holds now, in bytes.");
    metrics_set_fn(metrics, "meshd_agent_allocated_bytes", NULL, allocated_gauge, &backend);
    metrics_define(metrics, "meshd_agent_sessions", METRIC_GAUGE,
                   "Sessions the agent holds state for (opened by their first instruction, "
                   "ended by the server's EndSession).");
    metrics_set_fn(metrics, "meshd_agent_sessions", NULL, sessions_gauge, NULL);
    metrics_define(metrics, "meshd_agent_instructions_total", METRIC_COUNTER,
                   "Instructions the agent has run.");
    metrics_set_fn(metrics, "meshd_agent_instructions_total", NULL, instructions_fn, &stats);
    metrics_define(metrics, "meshd_collective_bytes_total", METRIC_COUNTER,
                   "Bytes the agent contributed to collectives over several agents and to sends.");
    metrics_set_fn(metrics, "meshd_collective_bytes_total", NULL, collective_bytes_fn,
                   &stats);
    static rejected_series_t rejected[DP_REJECT_COUNT];
    metrics_define(metrics, "meshd_dataplane_rejected_total", METRIC_COUNTER,
                   "Data port connections closed before they proved group membership, by reason.");
    for (int r = 0; dp && r < DP_REJECT_COUNT; r++) {
      rejected[r] = (rejected_series_t){dp, (dp_reject_t)r};
      metrics_set_fn(metrics, "meshd_dataplane_rejected_total",
                     (const char *[]){"reason", dp_reject_name((dp_reject_t)r), NULL}, rejected_fn,
                     &rejected[r]);
    }
    if (dp) {
      metrics_define(metrics, "meshd_dataplane_withdrawn_total", METRIC_COUNTER,
                     "Data port connections their dialer closed before it proved group "
                     "membership (a member that gave up dialing or waiting, or a probe).");
      metrics_set_fn(metrics, "meshd_dataplane_withdrawn_total", NULL, withdrawn_fn, dp);
    }
    static aborts_series_t aborts[DP_ABORT_COUNT];
    metrics_define(metrics, "meshd_collective_aborts_total", METRIC_COUNTER,
                   "Collectives and sends that failed here after they began, by reason.");
    for (int r = 0; dp && r < DP_ABORT_COUNT; r++) {
      aborts[r] = (aborts_series_t){dp, (dp_abort_t)r};
      metrics_set_fn(metrics, "meshd_collective_aborts_total",
                     (const char *[]){"reason", dp_abort_name((dp_abort_t)r), NULL}, aborts_fn,
                     &aborts[r]);
    }
    metrics_define(metrics, "meshd_dataplane_shm_messages_total", METRIC_COUNTER,
                   "Broadcasts received from agents on this host as shared memory, by landing: "
                   "mapped copy-on-write over the tensor, or copied into it.");
    if (dp) {
      metrics_set_fn(metrics, "meshd_dataplane_shm_messages_total",
                     (const char *[]){"landing", "mapped", NULL}, shm_mapped_fn, dp);
      metrics_set_fn(metrics, "meshd_dataplane_shm_messages_total",
                     (const char *[]){"landing", "copied", NULL}, shm_copied_fn, dp);
    }
    metrics_define(metrics, "meshd_transfer_grants_total", METRIC_COUNTER,
                   "Transfer grants presented to Read and Write (direct data path), by result.");
    for (int r = 0; r < GRANT_RESULT_COUNT; r++) {
      grant_series[r] = r;
      metrics_set_fn(metrics, "meshd_transfer_grants_total",
                     (const char *[]){"result", transfer_grant_result_name(r), NULL}, grants_fn,
                     &grant_series[r]);
    }
    metrics_define(metrics, "meshd_transfer_calls_expired_total", METRIC_COUNTER,
                   "Reads and Writes under a transfer grant still running at the grant's expiry, "
                   "ended then (PERMISSION_DENIED).");
    metrics_set_fn(metrics, "meshd_transfer_calls_expired_total", NULL, grant_calls_expired_fn,
                   NULL);
    metrics_http = metrics_http_start(metrics, opt.metrics_listen, err, sizeof err);
    if (!metrics_http) {
      log_error("agent", "--metrics-listen: %s", err);
      goto out;
    }
    if (opt.metrics_port_file && *opt.metrics_port_file &&
        runtime_write_port_file(opt.metrics_port_file, metrics_http_port(metrics_http)) != 0) {
      log_error("agent", "cannot write --metrics-port-file %s: %s", opt.metrics_port_file,
                strerror(errno));
      goto out;
    }
    log_info("agent", "metrics on http://%s/metrics (port %d)", opt.metrics_listen,
             metrics_http_port(metrics_http));
  }

  reg = registration_start(&info, health);
  if (!reg)
    goto out;

  /* Until a signal, or until the device is lost: then NOT_SERVING and a
   * non-zero exit, so that the orchestrator restarts the agent. */
  int sig;
  while ((sig = runtime_wait_signal(1000)) == 0) {
    if (backend.ops->health && backend.ops->health(&backend, &merr) != 0) break;
  }
  device_lost = sig == 0;
  if (device_lost) {
    log_error("agent", "device %s lost: %s; reporting NOT_SERVING and exiting", info.device,
              merr.msg);
    health_set(health, AGENT_HEALTH_SERVICE, HEALTH_NOT_SERVING);
    health_set(health, "", HEALTH_NOT_SERVING);
    rc = 1;
  } else {
    log_info("agent", "%s: shutting down (drain %.1f s)", strsignal(sig), opt.drain_seconds);
    rc = 0;
  }

out:
  health_shutdown(health);
  registration_stop(reg);
  if (srv) {
    /* Without its device the agent has nothing left to finish: a short drain,
     * long enough for Watch streams to see NOT_SERVING. */
    rpc_server_shutdown(srv, device_lost && opt.drain_seconds > 1 ? 1 : opt.drain_seconds);
    rpc_server_destroy(srv);
  }
  rpc_server_destroy(health_srv);
  reflection_destroy(reflection);
  health_destroy(health);
  if (usr1_started) {
    atomic_store(&usr1_stop, true);
    pthread_kill(usr1_tid, SIGUSR1);
    pthread_join(usr1_tid, NULL);
  }
  secret_file_close(info.join_token);
  metrics_http_stop(metrics_http);
  metrics_destroy(metrics);
  /* The data plane first fails the collectives and sends that wait on it and
   * refuses new ones, so that workers blocked on a peer drain at once. Workers
   * of the ended calls still run and release storages: the data plane and the
   * backend outlive them (a stuck one keeps both: the process exits anyway). */
  dataplane_shutdown(dp);
  bool idle = executor_wait_all_freed(5000) == 0;
  if (idle) data_stop(); /* every Read ended: its helpers only park (a stuck one: left, as below) */
  if (idle) transfer_grant_watch_stop(); /* no Read or Write left to end */
  if (dp && idle) dataplane_stop(dp);
  if (backend_open && idle) backend.ops->close(&backend);
  else if (backend_open) log_warn("agent", "workers still running at exit: the device is left open");
  rpc_shutdown();
  runtime_await_exit_threads("agent", idle ? EXIT_THREADS_WAIT_MS : 0); /* a stuck worker stays */
  if (rc == 0)
    log_info("agent", "stopped");
  return rc;
}
