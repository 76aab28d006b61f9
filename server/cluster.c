#include "cluster.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "runtime.h"

struct cluster {
  cluster_opts_t o;
  rpc_tls_t agent_tls;      /* channels to agents */
  secret_file_t *tokens;
  char temp_token[4096];    /* the --local-agents token file ("" if none) */
  rpc_server_t *srv;        /* the registry's own port */
  int port;
  char own_addr[300];       /* "127.0.0.1:PORT" local agents dial */
};

int cluster_check(const cluster_opts_t *o, char *err, size_t errlen) {
  int n = !!o->ca + !!o->cert + !!o->key;
  if (n != 0 && n != 3) {
    snprintf(err, errlen, "--cluster-ca, --cluster-cert and --cluster-key go together (missing: %s)",
             !o->ca ? "--cluster-ca" : !o->cert ? "--cluster-cert" : "--cluster-key");
    return -1;
  }
  if (n == 3 && (!o->listen || !*o->listen)) {
    snprintf(err, errlen, "--cluster-cert: with cluster certificates the agent registry is served "
             "on a port of its own: give --cluster-listen ADDR (e.g. 0.0.0.0:50053)");
    return -1;
  }
  if (!o->name || !*o->name) {
    snprintf(err, errlen, "--cluster-name must not be empty");
    return -1;
  }
  rpc_tls_t t = {.on = n == 3, .ca_file = o->ca, .cert_file = o->cert, .key_file = o->key};
  char why[300];
  if (rpc_tls_check(&t, true, why, sizeof why) != 0) {
    snprintf(err, errlen, "--cluster-ca/--cluster-cert/--cluster-key: %s", why);
    return -1;
  }
  return 0;
}

/* The --local-agents token goes at exit whichever way main returns. */
static char temp_at_exit[4096];
static void remove_temp_at_exit(void) { secret_temp_remove(temp_at_exit); }

cluster_t *cluster_create(const cluster_opts_t *o, char *err, size_t errlen) {
  cluster_t *c = calloc(1, sizeof *c);
  if (!c) {
    snprintf(err, errlen, "out of memory");
    return NULL;
  }
  c->o = *o;
  bool certs = o->ca != NULL;
  c->agent_tls = (rpc_tls_t){.on = certs, .ca_file = o->ca, .cert_file = o->cert,
                             .key_file = o->key, .server_name = o->name};
  const char *path = o->join_token_file && *o->join_token_file ? o->join_token_file : NULL;
  if (!path && !certs && (o->local_agents || o->client_tls || o->client_auth)) {
    if (secret_temp_make(c->temp_token, sizeof c->temp_token, err, errlen) != 0) {
      free(c);
      return NULL;
    }
    path = c->temp_token;
    snprintf(temp_at_exit, sizeof temp_at_exit, "%s", c->temp_token);
    atexit(remove_temp_at_exit);
  }
  if (path && !(c->tokens = secret_file_open(path == c->temp_token ? "the local agents' join token"
                                                                   : "--join-token-file",
                                             path, err, errlen))) {
    cluster_destroy(c);
    return NULL;
  }
  return c;
}

void cluster_registry_opts(const cluster_t *c, registry_opts_t *out) {
  out->join_tokens = c->tokens;
  out->require_cluster_cert = c->agent_tls.on;
  out->agent_tls = c->agent_tls;
}

const rpc_tls_t *cluster_agent_tls(const cluster_t *c) { return &c->agent_tls; }

int cluster_serve_registry(cluster_t *c, registry_t *r, rpc_server_t *client_srv, char *err,
                           size_t errlen) {
  bool own = c->o.listen && *c->o.listen;
  if (!own && !c->o.client_tls) {
    if (registry_add_methods(r, client_srv) == 0) return 0;
    snprintf(err, errlen, "cannot add the agent registry");
    return -1;
  }
  if (!own && !c->o.local_agents) return 0; /* nowhere: cluster_log_policy says so */
  /* Agents speak plaintext or cluster mTLS, never the client port's TLS: local
   * agents get a loopback port (their join token guards it). */
  const char *listen = own ? c->o.listen : "127.0.0.1:0";
  rpc_server_opts_t so = {.listen = listen,
                          .threads = c->o.threads,
                          .max_message_bytes = c->o.max_message_bytes,
                          .max_connection_idle_ms = c->o.max_connection_idle_ms,
                          .handshake_timeout_ms = c->o.handshake_timeout_ms,
                          .max_concurrent_streams = c->o.max_concurrent_streams,
                          .max_unauthenticated_requests = c->o.max_unauthenticated_requests,
                          .memory_bytes = c->o.memory_bytes,
                          .tls = {.on = c->agent_tls.on, .ca_file = c->o.ca,
                                  .cert_file = c->o.cert, .key_file = c->o.key}};
  char why[300] = "";
  c->srv = rpc_server_create(&so, why, sizeof why);
  if (c->srv && registry_add_methods(r, c->srv) != 0) snprintf(why, sizeof why, "cannot add it");
  else if (c->srv && (c->port = rpc_server_start(c->srv, why, sizeof why)) > 0) {
    if (own && c->o.port_file && runtime_write_port_file(c->o.port_file, c->port) != 0) {
      snprintf(err, errlen, "cannot write --cluster-port-file %s", c->o.port_file);
      return -1;
    }
    runtime_local_address(listen, c->port, c->own_addr, sizeof c->own_addr);
    log_info("server", "agent registry on %s, port %d (%s)", listen, c->port,
             c->agent_tls.on ? "mTLS: cluster certificates only"
             : own           ? "plaintext"
                             : "plaintext, loopback only: for the local agents");
    return 0;
  }
  snprintf(err, errlen, "%s: %s", own ? "--cluster-listen" : "the local agents' registry port", why);
  return -1;
}

void cluster_local_target(const cluster_t *c, const char *client_addr, char *out, size_t len) {
  snprintf(out, len, "%s", c->srv ? c->own_addr : client_addr);
}

const char *cluster_join_token_file(const cluster_t *c) {
  return c->tokens ? secret_file_path(c->tokens) : NULL;
}

bool cluster_has_own_port(const cluster_t *c) { return c->srv != NULL; }

void cluster_log_policy(const cluster_t *c, const char *client_addr) {
  const char *where = c->srv ? c->own_addr : client_addr;
  bool own = c->o.listen && *c->o.listen;
  if (!own && c->o.client_tls && !c->o.local_agents)
    log_warn("server", "no agent can register: the client port is TLS and there is no "
             "--cluster-listen (agents register in plaintext with a join token, or with cluster "
             "certificates, on a port of their own)");
  else if (c->agent_tls.on || c->tokens)
    log_info("server", "agents register at %s %s%s%s", where,
             c->agent_tls.on ? "with a certificate from the cluster CA" : "",
             c->agent_tls.on && c->tokens ? " and " : "",
             !c->tokens ? ""
             : c->temp_token[0] ? "with a join token the server made: only its local agents can"
                                : "with a join token from --join-token-file");
  else
    log_warn("server", "agent registration is OPEN: any process that reaches %s can join as an "
             "agent and receive sessions' data; give --join-token-file FILE, or --cluster-ca, "
             "--cluster-cert and --cluster-key", where);
}

void cluster_shutdown(cluster_t *c, double grace_seconds) {
  if (c && c->srv) rpc_server_shutdown(c->srv, grace_seconds);
}

void cluster_destroy(cluster_t *c) {
  if (!c) return;
  rpc_server_destroy(c->srv);
  secret_file_close(c->tokens);
  secret_temp_remove(c->temp_token);
  free(c);
}
