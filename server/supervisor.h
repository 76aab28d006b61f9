/* `meshd --local-agents N`: N meshd-agent processes as direct children.
 *
 * Agent i runs `AGENT --server SERVER --listen 127.0.0.1:0 --rank i --device cpu`, plus
 * --log-level, --log-format, --metrics-listen HOST:BASE+i (or empty: off, whatever
 * the environment they inherit says), --join-token-file and
 * the --cluster-* flags when set (never a secret in argv).
 * A child that exits is restarted within 2 s (at once, then with a backoff of up
 * to 1 s if it keeps dying). One that exits within 5 s of its start
 * SUPERVISOR_FAIL_AFTER times in a row is "failing": an error is logged once,
 * naming its last exit, it is retried every SUPERVISOR_FAILING_RETRY_MS, and it
 * stops failing once it has run 5 s. Children get SIGTERM if meshd dies
 * (PR_SET_PDEATHSIG), so no agent outlives its supervisor. */
#ifndef MESHD_SUPERVISOR_H
#define MESHD_SUPERVISOR_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#define SUPERVISOR_FAIL_AFTER 5
#define SUPERVISOR_FAILING_RETRY_MS 5000

typedef struct supervisor supervisor_t;

typedef struct supervisor_opts {
  const char *agent_binary;  /* path of meshd-agent */
  const char *server;        /* host:port the agents register with */
  int count;
  uint64_t memory_bytes;     /* each agent's reported capacity; 0: the agent's default */
  const char *log_level;     /* passed on */
  const char *log_format;    /* passed on (NULL: the agent's default) */
  /* metrics_port_base > 0: agent i serves metrics on metrics_host:base+i
   * (metrics_host NULL: 127.0.0.1; "": every address). */
  const char *metrics_host;
  int metrics_port_base;
  /* Called (from the watch thread) each time an agent that exited is started
   * again; may be NULL. */
  void (*on_restart)(int rank, void *arg);
  /* Called (from the watch thread) when agent `rank` starts or stops failing;
   * `failing_now` counts the ranks failing after the change. May be NULL. */
  void (*on_failing)(int rank, bool failing, int failing_now, void *arg);
  void *arg;  /* of on_restart and on_failing */
  /* Passed on as --device, except "cuda": agent i serves cuda:i. With "cuda:K"
   * and count > 1 each agent gets --memory-share=count. */
  const char *device;
  /* Passed on when set: how the agents prove who they are (server/cluster.h). */
  const char *join_token_file;
  const char *cluster_ca, *cluster_cert, *cluster_key, *cluster_name;
  int64_t max_tensor_dims, max_tensor_elements; /* the server's, passed on; 0: the default */
  uint64_t max_message_bytes;                    /* the server's, passed on; 0: the default */
  uint64_t rpc_memory_bytes;                     /* the server's, passed on; 0: the default */
  double handshake_timeout;                      /* the server's, passed on; 0: the default */
  bool reflection;           /* passed on as --reflection=true|false (the server's setting) */
} supervisor_opts_t;

/* Starts the agents and the thread that watches them. NULL (and a log line) if
 * the binary is missing or a thread cannot start. */
supervisor_t *supervisor_start(const supervisor_opts_t *opts);
/* The pid of agent i now (0 while it is being restarted). */
pid_t supervisor_pid(supervisor_t *s, int i);
/* SIGTERM to every agent, SIGKILL after timeout_s, reaps them all, frees. */
void supervisor_stop(supervisor_t *s, double timeout_s);

#endif
