/* The server's side of cluster security (docs/operations.md "Cluster
 * security"): who may register as an agent, how the server reaches agents, and
 * where the AgentRegistry is served.
 *
 *   --cluster-ca/--cluster-cert/--cluster-key  mTLS between server and agents:
 *       the registry's port requires a client certificate from the cluster CA;
 *       the server dials agents back with its cluster certificate and checks
 *       theirs against the CA and --cluster-name (agents are reached by IP).
 *       The registry then needs a port of its own (--cluster-listen): the
 *       client port's TLS, if any, is another CA's.
 *   --join-token-file  a token (or several, for rotation) an agent must present.
 *       Without it and without certificates, a server with --local-agents, or
 *       whose client port is secured (--tls-cert, --auth-tokens), makes one: a
 *       random token in a 0600 file in a private temp dir, given to its local
 *       agents with --join-token-file and removed at exit. Nobody else has it,
 *       so registration is closed to all but the local agents.
 *   --cluster-listen   AgentRegistry on its own port and not on the client port.
 *       Without it the registry shares the client port when that is plaintext;
 *       when it is TLS, local agents get a loopback port of their own and
 *       agents elsewhere cannot register (logged).
 * Only a server with none of these (plaintext, no tokens) is open to any agent:
 * for local work, said at startup in one warning line.
 *
 * Owned by main, from option checking to exit. */
#ifndef MESHD_CLUSTER_H
#define MESHD_CLUSTER_H

#include <stdbool.h>
#include <stddef.h>

#include "registry.h"
#include "rpc.h"
#include "secret.h"

typedef struct cluster_opts {
  const char *ca, *cert, *key; /* all or none */
  const char *name;            /* the name cluster certificates carry */
  const char *listen;          /* the registry's own port; NULL: the client port */
  const char *port_file;       /* write the bound --cluster-listen port there */
  const char *join_token_file;
  bool local_agents;           /* --local-agents > 0 */
  bool client_tls, client_auth; /* the client port has TLS, bearer tokens */
  int threads, max_message_bytes;
  /* rpc_server_opts_t's of its own port, as the client port's (strangers reach it) */
  int max_connection_idle_ms, handshake_timeout_ms, max_concurrent_streams, max_unauthenticated_requests;
  uint64_t memory_bytes;        /* rpc_server_opts_t.memory_bytes of its own port */
} cluster_opts_t;

typedef struct cluster cluster_t;

/* Checks flag combinations and files. 0, or -1 with err naming the flag. */
int cluster_check(const cluster_opts_t *o, char *err, size_t errlen);
/* Reads the join tokens (or makes the --local-agents one). NULL with err. */
cluster_t *cluster_create(const cluster_opts_t *o, char *err, size_t errlen);
/* What the registry needs: tokens, the certificate rule, the dial-back TLS. */
void cluster_registry_opts(const cluster_t *c, registry_opts_t *out);
/* TLS of every channel to an agent (.on false without certificates). */
const rpc_tls_t *cluster_agent_tls(const cluster_t *c);
/* Serves the registry: on its own started port (--cluster-listen, or loopback
 * for local agents when the client port is TLS), on client_srv (not started
 * yet), or nowhere (client TLS, no local agents, no --cluster-listen). 0, or
 * -1 with err. */
int cluster_serve_registry(cluster_t *c, registry_t *r, rpc_server_t *client_srv, char *err,
                           size_t errlen);
/* "127.0.0.1:PORT" local agents register at, given the client port's address. */
void cluster_local_target(const cluster_t *c, const char *client_addr, char *out, size_t len);
/* The join token file local agents are given (NULL: none). */
const char *cluster_join_token_file(const cluster_t *c);
/* True when the registry has a port of its own (--cluster-listen). */
bool cluster_has_own_port(const cluster_t *c);
/* Says at startup who may register (one warning line when anyone may). */
void cluster_log_policy(const cluster_t *c, const char *client_addr);
/* Stops the registry's own port (after registry_close_all). */
void cluster_shutdown(cluster_t *c, double grace_seconds);
/* Removes the --local-agents token (also removed at exit if main returns
 * without this), frees. NULL: no-op. */
void cluster_destroy(cluster_t *c);

#endif
