/* meshctl: look at a running meshd from the command line.
 *
 * Exit status follows grpc_health_probe: 0 ok (SERVING), 2 could not connect,
 * 3 the call failed, 4 not serving. Usage errors exit 64 (EX_USAGE) so they
 * cannot be mistaken for "could not connect"; 1 is anything else (out of memory). */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "config.h"
#include "meshd.h"
#include "rpc.h"

enum {
  EXIT_OK = 0,
  EXIT_FAILURE_OTHER = 1,
  EXIT_CONNECT = 2,
  EXIT_RPC = 3,
  EXIT_NOT_SERVING = 4,
  EXIT_USAGE = 64,
};

#define SYNOPSIS "[--server ADDR] [--timeout-ms MS] COMMAND [ARGS]"

static const char *server;
static int64_t timeout_ms;

static const config_flag_t flags[] = {
    {"server", CONFIG_STRING, "127.0.0.1:50051", "meshd address, host:port", &server, 0, 0},
    {"timeout-ms", CONFIG_INT, "5000",
     "milliseconds to wait for the connection, then again for the call", &timeout_ms, 1,
     3600000},
};
#define NFLAGS (sizeof flags / sizeof flags[0])

static int cmd_health(meshd_client_t *c, int argc, char **argv);
static int cmd_agents(meshd_client_t *c, int argc, char **argv);

typedef struct command {
  const char *name;
  const char *args;
  const char *help;
  int max_args;
  int (*run)(meshd_client_t *c, int argc, char **argv);
} command_t;

static const command_t commands[] = {
    {"health", "[SERVICE]",
     "grpc.health.v1 Check of SERVICE (default \"\": the server); prints SERVING, "
     "NOT_SERVING, ...",
     1, cmd_health},
    {"agents", "", "table of the registered agents", 0, cmd_agents},
};
#define NCOMMANDS (sizeof commands / sizeof commands[0])

static void usage(FILE *out) {
  config_usage(out, "meshctl", SYNOPSIS, flags, NFLAGS);
  fprintf(out, "commands:\n");
  for (size_t i = 0; i < NCOMMANDS; i++) {
    char head[64];
    snprintf(head, sizeof head, "%s %s", commands[i].name, commands[i].args);
    fprintf(out, "  %-18s %s\n", head, commands[i].help);
  }
  fprintf(out, "exit status: 0 ok (SERVING), 2 cannot connect, 3 call failed, "
               "4 not serving, 64 usage error, 1 other error\n");
}

/* "error: WHAT: NOT_FOUND: unknown service" for the client's last failure. */
static int report(meshd_client_t *c, const char *what, meshd_err_t e) {
  const meshd_error_info_t *info = meshd_last_error(c);
  if (e == MESHD_E_RPC) {
    fprintf(stderr, "error: %s: %s", what, info->grpc_code_name);
    if (*info->kind)
      fprintf(stderr, " (%s)", info->kind);
    if (*info->message)
      fprintf(stderr, ": %s", info->message);
    fputc('\n', stderr);
    return EXIT_RPC;
  }
  fprintf(stderr, "error: %s: %s%s%s\n", what, meshd_strerror(e), *info->message ? ": " : "",
          info->message);
  return EXIT_FAILURE_OTHER;
}

static int cmd_health(meshd_client_t *c, int argc, char **argv) {
  int status = MESHD_HEALTH_UNKNOWN;
  meshd_err_t e = meshd_health(c, argc > 0 ? argv[0] : "", &status);
  if (e != MESHD_E_OK)
    return report(c, "health check failed", e);
  printf("%s\n", meshd_health_name(status));
  return status == MESHD_HEALTH_SERVING ? EXIT_OK : EXIT_NOT_SERVING;
}

/* 16728371200 -> "15.6GiB"; below 1 KiB exact ("512B"). */
static void human_bytes(uint64_t bytes, char *buf, size_t len) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) {
    snprintf(buf, len, "%" PRIu64 "B", bytes);
    return;
  }
  double v = (double)bytes;
  size_t u = 0;
  /* 1023.96 MiB would print as "1024.0MiB": move up a unit before that. */
  while (v >= 1023.95 && u + 1 < sizeof units / sizeof units[0]) {
    v /= 1024.0;
    u++;
  }
  snprintf(buf, len, "%.1f%s", v, units[u]);
}

static int cmd_agents(meshd_client_t *c, int argc, char **argv) {
  meshd_agent_t *agents = NULL;
  size_t n = 0;
  meshd_err_t e = meshd_agents(c, &agents, &n);
  if (e != MESHD_E_OK)
    return report(c, "listing agents failed", e);

  int w_addr = (int)strlen("ADDRESS"), w_dev = (int)strlen("DEVICE");
  for (size_t i = 0; i < n; i++) {
    int a = (int)strlen(agents[i].address), d = (int)strlen(agents[i].device);
    w_addr = a > w_addr ? a : w_addr;
    w_dev = d > w_dev ? d : w_dev;
  }
  printf("%-5s %-*s %-*s %-9s %-9s %s\n", "RANK", w_addr, "ADDRESS", w_dev, "DEVICE", "MEMORY",
         "ALLOCATED", "HEALTHY");
  for (size_t i = 0; i < n; i++) {
    char mem[32], alloc[32];
    human_bytes(agents[i].memory_bytes, mem, sizeof mem);
    human_bytes(agents[i].allocated_bytes, alloc, sizeof alloc);
    printf("%-5" PRIu32 " %-*s %-*s %-9s %-9s %s\n", agents[i].rank, w_addr, agents[i].address,
           w_dev, agents[i].device, mem, alloc, agents[i].healthy ? "yes" : "no");
  }
  if (n == 0)
    fprintf(stderr, "meshctl: no agents are registered with %s\n", server);
  meshd_agents_free(agents, n);
  return EXIT_OK;
}

static int run(int argc, char **argv) {
  char err[256];
  int npos = 0;

  int r = config_parse(flags, NFLAGS, argc, argv, &npos, err, sizeof err);
  if (r == 1) {
    usage(stdout);
    return EXIT_OK;
  }
  if (r < 0) {
    fprintf(stderr, "meshctl: %s\n", err);
    usage(stderr);
    return EXIT_USAGE;
  }
  if (npos == 0) {
    fprintf(stderr, "meshctl: missing COMMAND (one of: health, agents)\n");
    usage(stderr);
    return EXIT_USAGE;
  }
  const command_t *cmd = NULL;
  for (size_t i = 0; i < NCOMMANDS && !cmd; i++)
    if (strcmp(argv[1], commands[i].name) == 0)
      cmd = &commands[i];
  if (!cmd) {
    fprintf(stderr, "meshctl: unknown command '%s' (expected one of: health, agents)\n", argv[1]);
    usage(stderr);
    return EXIT_USAGE;
  }
  int nargs = npos - 1;
  if (nargs > cmd->max_args) {
    fprintf(stderr, "meshctl: %s: unexpected argument '%s' (usage: meshctl %s%s%s)\n",
            cmd->name, argv[2 + cmd->max_args], cmd->name, *cmd->args ? " " : "", cmd->args);
    usage(stderr);
    return EXIT_USAGE;
  }
  if (!server || !*server) {
    fprintf(stderr, "meshctl: --server: empty address (expected host:port)\n");
    usage(stderr);
    return EXIT_USAGE;
  }

  meshd_err_t e = MESHD_E_OK;
  meshd_client_t *c = meshd_connect(server, (int)timeout_ms, &e);
  if (!c) {
    if (e == MESHD_E_CONNECT) {
      fprintf(stderr, "error: cannot connect to %s: no connection within %" PRId64 " ms\n", server,
              timeout_ms);
      return EXIT_CONNECT;
    }
    fprintf(stderr, "error: cannot connect to %s: %s\n", server, meshd_strerror(e));
    return EXIT_FAILURE_OTHER;
  }
  r = cmd->run(c, nargs, argv + 2);
  meshd_close(c);
  return r;
}

int main(int argc, char **argv) {
  rpc_init();
  int r = run(argc, argv);
  fflush(stdout);
  rpc_shutdown();
  return r;
}
