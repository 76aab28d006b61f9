/* Who may call this agent's Agent service: the server it registered with,
 * which proves it with the call secret the agent sent in its RegisterRequest. */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent.h"
#include "log.h"
#include "grant.h"
#include "secret.h"

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static char current[SECRET_HEX_LEN + 1]; /* "" : nobody */
static log_limit_t refusals;

int agent_auth_renew(char *out) {
  char fresh[SECRET_HEX_LEN + 1];
  if (secret_random_hex(fresh) != 0) {
    agent_auth_clear();
    return -1;
  }
  pthread_mutex_lock(&mu);
  memcpy(current, fresh, sizeof current);
  pthread_mutex_unlock(&mu);
  memcpy(out, fresh, sizeof fresh);
  return 0;
}

void agent_auth_clear(void) {
  pthread_mutex_lock(&mu);
  memset(current, 0, sizeof current);
  pthread_mutex_unlock(&mu);
}

int agent_auth_secret(char *out) {
  pthread_mutex_lock(&mu);
  memcpy(out, current, sizeof current);
  pthread_mutex_unlock(&mu);
  return out[0] ? 0 : -1;
}

/* Read and Write also take a client holding a transfer grant instead of the
 * secret; data.c checks the grant against the call (transfer_grant.c). */
static bool grant_method(rpc_call_t *call) {
  const char *m = rpc_call_method(call);
  return strcmp(m, "/meshd.agent.v1.Agent/Read") == 0 ||
         strcmp(m, "/meshd.agent.v1.Agent/Write") == 0;
}

/* Refused: logged (rate-limited) with the peer and why, msg for the caller. */
static grpc_status_code refuse(rpc_call_t *call, const char *why, char *msg, size_t msglen,
                               const char *fmt, ...) __attribute__((format(printf, 5, 6)));

static grpc_status_code refuse(rpc_call_t *call, const char *why, char *msg, size_t msglen,
                               const char *fmt, ...) {
  agent_log_refused(&refusals, call, why, "calls");
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, msglen, fmt, ap);
  va_end(ap);
  return GRPC_STATUS_UNAUTHENTICATED;
}

grpc_status_code agent_auth_guard(rpc_call_t *call, void *arg, rpc_identity_t *id, char *msg,
                                  size_t msglen) {
  const agent_info_t *self = arg;
  /* One byte more than a secret: a longer value stays longer once truncated. */
  char got[SECRET_HEX_LEN + 2];
  const char *v = rpc_call_metadata(call, SECRET_AGENT_MD, got, sizeof got);
  uint8_t probe[1];
  if (!v && grant_method(call) && rpc_call_metadata_bin(call, GRANT_MD, probe, 0) >= 0) {
    /* Its signature, expiry and nonce now, before the request is read (a
     * stranger's would be held until complete); the handler checks the rest
     * against it. */
    int code = transfer_grant_signed(call, msg, msglen);
    if (code > 1) return (grpc_status_code)code;
    snprintf(id->name, sizeof id->name, "grant");
    id->unauthenticated = code == 1;
    return GRPC_STATUS_OK;
  }
  /* The port admits clients without a certificate (for grants): everything
   * else is for the server, which holds a cluster certificate. */
  if (self && self->cluster_tls.on && !rpc_call_peer_verified(call))
    return refuse(call, "no verified cluster certificate", msg, msglen,
                  "this agent serves only the server it registered with; the call comes "
                  "without a cluster certificate (only Agent/Read and Agent/Write take a "
                  "transfer grant instead)");
  if (self && self->cluster_tls.on && !rpc_call_peer_named(call, self->cluster_tls.server_name))
    return refuse(call, "a certificate not naming the cluster", msg, msglen,
                  "this agent serves only the server it registered with; the call's "
                  "certificate, though signed by the cluster CA, does not name the cluster "
                  "(--cluster-name %s)", self->cluster_tls.server_name);
  char want[SECRET_HEX_LEN + 1];
  pthread_mutex_lock(&mu);
  memcpy(want, current, sizeof want);
  pthread_mutex_unlock(&mu);
  bool registered = want[0] != '\0';
  bool ok = registered && v && secret_equal(v, strlen(v), want, strlen(want));
  memset(want, 0, sizeof want);
  if (ok) {
    snprintf(id->name, sizeof id->name, "server");
    return GRPC_STATUS_OK;
  }
  return refuse(call,
                !v ? "no call secret" : registered ? "wrong call secret"
                                                   : "not registered with a server now",
                msg, msglen, "this agent serves only the server it registered with; the call "
                "lacks that server's secret (metadata %s)", SECRET_AGENT_MD);
}

void agent_log_refused(log_limit_t *limit, rpc_call_t *call, const char *why, const char *what) {
  int held = 0;
  if (!log_allow(limit, 10, 10000, &held)) return;
  char *peer = rpc_call_peer(call);
  log_warn("agent", "refused %s from %s: %s", rpc_call_method(call), peer ? peer : "?", why);
  if (held) log_warn("agent", "(and %d more %s refused in the last 10 s, not logged)", held, what);
  free(peer);
}

grpc_status_code agent_peer_guard(rpc_call_t *call, void *arg, rpc_identity_t *id, char *msg,
                                  size_t msglen) {
  const agent_info_t *self = arg;
  if (self && self->cluster_tls.on && !rpc_call_peer_named(call, self->cluster_tls.server_name))
    return refuse(call, "no verified cluster certificate naming the cluster", msg, msglen,
                  "this agent's port answers %s only to holders of a cluster certificate "
                  "(signed by the cluster CA, naming --cluster-name); probes use "
                  "--health-listen", rpc_call_method(call));
  snprintf(id->name, sizeof id->name, "peer");
  id->unauthenticated = !(self && self->cluster_tls.on); /* without cluster TLS: anyone */
  return GRPC_STATUS_OK;
}
