/* meshd C client library: meshd.h over core/platform/rpc.h. */
#include "meshd.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

#include "conn.h"
#include "direct.h"
#include "pipeline.h"
#include "grpc/health/v1/health.pb-c.h"
#include "meshd/v1/tensor_service.pb-c.h"
#include "rpc.h"

#define HEALTH_CHECK "/grpc.health.v1.Health/Check"
#define LIST_AGENTS "/meshd.v1.TensorService/ListAgents"

struct meshd_client {
  rpc_channel_t *ch;
  int timeout_ms;
  bool tls;
  char *bearer;   /* "Bearer TOKEN", or NULL; wiped before it is freed */
  rpc_md_t md[1]; /* sent on every call: authorization (when there is a token) */
  size_t nmd;
  meshd_error_info_t last; /* strings point into the buffers below */
  char code_name[32];
  char kind[sizeof(((rpc_status_t *)0)->kind)];
  char message[sizeof(((rpc_status_t *)0)->message) + 64];
};

/* A client's last error, kept across a call whose failure is not news to the
 * caller (its strings point into the client's buffers, restored with it). */
typedef struct {
  meshd_error_info_t last;
  char code_name[32];
  char kind[sizeof(((rpc_status_t *)0)->kind)];
  char message[sizeof(((rpc_status_t *)0)->message) + 64];
} saved_error_t;

static void error_save(const meshd_client_t *c, saved_error_t *o) {
  o->last = c->last;
  memcpy(o->code_name, c->code_name, sizeof o->code_name);
  memcpy(o->kind, c->kind, sizeof o->kind);
  memcpy(o->message, c->message, sizeof o->message);
}

static void error_restore(meshd_client_t *c, const saved_error_t *o) {
  c->last = o->last;
  memcpy(c->code_name, o->code_name, sizeof c->code_name);
  memcpy(c->kind, o->kind, sizeof c->kind);
  memcpy(c->message, o->message, sizeof c->message);
}

const char *meshd_strerror(meshd_err_t err) {
  switch (err) {
#define XX(name, text) \
  case MESHD_E_##name: \
    return text;
    MESHD_ERR_MAP(XX)
#undef XX
  }
  return "unknown error";
}

const char *meshd_health_name(int serving_status) {
  switch (serving_status) {
#define XX(name, value)    \
  case MESHD_HEALTH_##name: \
    return #name;
    MESHD_HEALTH_MAP(XX)
#undef XX
  }
  return "UNKNOWN";
}

static void set_error(meshd_client_t *c, meshd_err_t err, int grpc_code, const char *kind,
                      const char *fmt, ...) __attribute__((format(printf, 5, 6)));

static void set_error(meshd_client_t *c, meshd_err_t err, int grpc_code, const char *kind,
                      const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->message, sizeof c->message, fmt, ap);
  va_end(ap);
  bool has_code = err == MESHD_E_RPC || err == MESHD_E_DEADLINE;
  snprintf(c->code_name, sizeof c->code_name, "%s",
           has_code ? meshd_grpc_code_name((grpc_status_code)grpc_code) : "");
  snprintf(c->kind, sizeof c->kind, "%s", kind ? kind : "");
  c->last.err = err;
  c->last.grpc_code = has_code ? grpc_code : 0;
  c->last.grpc_code_name = c->code_name;
  c->last.kind = c->kind;
  c->last.message = c->message;
  c->last.seq = 0;
}

const meshd_error_info_t *meshd_last_error(const meshd_client_t *client) {
  static const meshd_error_info_t null_client = {
      MESHD_E_INVALID, 0, "", "", "meshd_last_error: client is NULL", 0};
  return client ? &client->last : &null_client;
}

/* fork(): gRPC does not follow it. A child forked while the library's
 * transport was up (a client open, or meshd_global_init held) inherits it half
 * there: its calls wait, past every deadline, for pollers that stayed in the
 * parent. Such a child is refused a client (meshd_connect_with) at once. */
static atomic_int transport_holds;
static atomic_bool forked_live;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void atfork_child(void) {
  if (atomic_load(&transport_holds) > 0)
    atomic_store(&forked_live, true);
}

static void atfork_register(void) { pthread_atfork(NULL, NULL, atfork_child); }

static void transport_hold(void) {
  pthread_once(&atfork_once, atfork_register);
  atomic_fetch_add(&transport_holds, 1);
  rpc_init();
}

static void transport_release(void) {
  rpc_shutdown();
  atomic_fetch_sub(&transport_holds, 1);
}

void meshd_global_init(void) { transport_hold(); }

void meshd_global_shutdown(void) { transport_release(); }

meshd_client_t *meshd_connect(const char *target, int timeout_ms, meshd_err_t *err) {
  meshd_connect_options_t o = MESHD_CONNECT_OPTIONS_INIT;
  o.timeout_ms = timeout_ms;
  return meshd_connect_with(target, &o, err, NULL, 0);
}

static void errbuf_set(char *buf, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void errbuf_set(char *buf, size_t len, const char *fmt, ...) {
  if (!buf || len == 0)
    return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, len, fmt, ap);
  va_end(ap);
}

/* The option checks of meshd_connect_with; fills tls. Returns 0, or -1 with msg. */
static int check_options(const char *target, const meshd_connect_options_t *o, rpc_tls_t *tls,
                         char *msg, size_t len) {
  if (!target || !*target) {
    snprintf(msg, len, "target is %s (expected host:port)", target ? "empty" : "NULL");
    return -1;
  }
  if (o->timeout_ms <= 0) {
    snprintf(msg, len, "timeout_ms is %d (expected > 0)", o->timeout_ms);
    return -1;
  }
  bool token = o->token && *o->token;
  if (token && conn_check_token(o->token, "token", msg, len) != 0)
    return -1;
  if (!o->tls_cert_file != !o->tls_key_file) {
    snprintf(msg, len, "%s is set without %s: a client certificate needs both",
             o->tls_cert_file ? "tls_cert_file" : "tls_key_file",
             o->tls_cert_file ? "tls_key_file" : "tls_cert_file");
    return -1;
  }
  if ((o->tls_ca_file && conn_check_pem(o->tls_ca_file, "CERTIFICATE", "tls_ca_file", msg, len)) ||
      (o->tls_cert_file &&
       conn_check_pem(o->tls_cert_file, "CERTIFICATE", "tls_cert_file", msg, len)) ||
      (o->tls_key_file && conn_check_pem(o->tls_key_file, "PRIVATE KEY", "tls_key_file", msg, len)))
    return -1;
  if (o->tls_cert_file && o->tls_key_file &&
      rpc_tls_check_pair(o->tls_cert_file, o->tls_key_file, msg, len) != 0)
    return -1;
  if (o->tls_server_name && !*o->tls_server_name) {
    snprintf(msg, len, "tls_server_name is empty (NULL: check the target's host)");
    return -1;
  }
  *tls = (rpc_tls_t){.on = o->tls || o->tls_ca_file || o->tls_cert_file || o->tls_server_name,
                     .ca_file = o->tls_ca_file,
                     .cert_file = o->tls_cert_file,
                     .key_file = o->tls_key_file,
                     .server_name = o->tls_server_name};
  if (token && !tls->on && !o->insecure && !conn_target_is_loopback(target)) {
    snprintf(msg, len,
             "refusing to send a token in plaintext to %s, which is not a loopback address: "
             "use TLS (tls, tls_ca_file), or set insecure to send it anyway",
             target);
    return -1;
  }
  return 0;
}

meshd_client_t *meshd_connect_with(const char *target, const meshd_connect_options_t *opts,
                                   meshd_err_t *err, char *errbuf, size_t errlen) {
  static const meshd_connect_options_t defaults = MESHD_CONNECT_OPTIONS_INIT;
  const meshd_connect_options_t *o = opts ? opts : &defaults;
  meshd_err_t ret = MESHD_E_OK;
  meshd_client_t *c = NULL;
  rpc_tls_t tls;
  char msg[512];

  errbuf_set(errbuf, errlen, "%s", "");
  if (check_options(target, o, &tls, msg, sizeof msg) != 0) {
    errbuf_set(errbuf, errlen, "%s", msg);
    ret = MESHD_E_INVALID;
    goto out;
  }
  if (atomic_load(&forked_live)) {
    errbuf_set(errbuf, errlen,
               "this process is a child of fork() made while its parent had a meshd client open "
               "(or meshd_global_init held): gRPC does not follow fork, and a client here would "
               "hang; fork before the first connect or after the last meshd_close, or exec");
    ret = MESHD_E_CONNECT;
    goto out;
  }
  transport_hold(); /* counted; balanced in meshd_close or below */
  c = calloc(1, sizeof *c);
  if (!c) {
    transport_release();
    goto nomem;
  }
  c->timeout_ms = o->timeout_ms;
  c->tls = tls.on;
  set_error(c, MESHD_E_OK, 0, NULL, "%s", "");
  if (o->token && *o->token) {
    size_t n = strlen("Bearer ") + strlen(o->token) + 1;
    c->bearer = malloc(n);
    if (!c->bearer) {
      meshd_close(c);
      c = NULL;
      goto nomem;
    }
    snprintf(c->bearer, n, "Bearer %s", o->token);
    c->md[c->nmd++] = (rpc_md_t){"authorization", c->bearer};
  }
  /* One connection attempt may take the whole wait: a TLS handshake on a busy
   * host or a server a long round trip away outlasts rpc's 100 ms default (and
   * with fail_fast, one attempt is all there is). A refused port still fails at
   * once. Replies up to 64 MiB, as the Python and Node clients take: a server
   * whose --max-message-bytes is raised sends a ListSessions or ListAgents that
   * large, and gRPC's 4 MiB default refused it naming no flag. */
  rpc_channel_opts_t copts = {.tls = tls, .connect_timeout_ms = o->timeout_ms, /* > 0: checked */
                              .max_message_bytes = 64 << 20};
  c->ch = rpc_channel_create(target, &copts);
  if (!c->ch) { /* out of memory, or TLS files that changed since they were checked */
    meshd_close(c);
    c = NULL;
    if (!tls.on)
      goto nomem;
    errbuf_set(errbuf, errlen, "the TLS files could not be loaded");
    ret = MESHD_E_INVALID;
  } else {
    int64_t t0 = rpc_now_ms();
    rpc_connect_t how = o->fail_fast ? rpc_channel_connect(c->ch, o->timeout_ms)
                                     : rpc_channel_wait_ready(c->ch, o->timeout_ms)
                                         ? RPC_CONNECT_READY
                                         : RPC_CONNECT_TIMEOUT;
    /* The one attempt ran out its time (connect_timeout_ms is timeout_ms): the
     * port accepted and nothing answered (a stopped or overloaded server), or the
     * packets went nowhere; not "nothing listens", which is a quick refusal. */
    if (how == RPC_CONNECT_FAILED && rpc_now_ms() - t0 >= (int64_t)o->timeout_ms * 9 / 10)
      how = RPC_CONNECT_TIMEOUT;
    const char *tls_hint = tls.on ? " (with TLS: is the server up, does it speak TLS, and is its "
                                    "certificate valid for that name and signed by the CA?)"
                                  : "";
    if (how == RPC_CONNECT_FAILED)
      errbuf_set(errbuf, errlen,
                 "the connection to %s failed: nothing listens there, or it is unreachable%s",
                 target, tls_hint);
    else if (how == RPC_CONNECT_TIMEOUT)
      errbuf_set(errbuf, errlen,
                 "no connection to %s within %d ms: no answer there (a stopped or overloaded "
                 "server, or a host that drops the packets)%s",
                 target, o->timeout_ms, tls_hint);
    if (how != RPC_CONNECT_READY) {
      ret = MESHD_E_CONNECT;
      meshd_close(c);
      c = NULL;
    }
  }
  goto out;
nomem:
  errbuf_set(errbuf, errlen, "out of memory");
  ret = MESHD_E_NOMEM;
out:
  if (err)
    *err = ret;
  return c;
}

void meshd_close(meshd_client_t *client) {
  if (!client)
    return;
  if (client->ch)
    rpc_channel_destroy(client->ch);
  if (client->bearer) {
    explicit_bzero(client->bearer, strlen(client->bearer));
    free(client->bearer);
  }
  free(client);
  transport_release();
}

/* A failed call's status on the client: a passed deadline is MESHD_E_DEADLINE. */
static meshd_err_t set_status(meshd_client_t *c, grpc_status_code code, const char *kind,
                              const char *msg) {
  if (code == GRPC_STATUS_DEADLINE_EXCEEDED) {
    set_error(c, MESHD_E_DEADLINE, code, "DEADLINE_EXCEEDED", "%s", msg);
    return MESHD_E_DEADLINE;
  }
  set_error(c, MESHD_E_RPC, code, kind, "%s", msg);
  return MESHD_E_RPC;
}

/* One unary call with deadline timeout_ms (<= 0: the client's) and metadata md;
 * records the failure if any. */
static meshd_err_t call_md_timeout(meshd_client_t *c, const char *method,
                                   const ProtobufCMessage *req,
                                   const ProtobufCMessageDescriptor *desc, ProtobufCMessage **resp,
                                   const rpc_md_t *md, size_t nmd, int timeout_ms) {
  rpc_status_t st;
  memset(&st, 0, sizeof st);
  *resp = NULL;
  grpc_status_code code = rpc_unary(c->ch, method, req, desc, resp, md, nmd,
                                    timeout_ms > 0 ? timeout_ms : c->timeout_ms, &st);
  if (code == GRPC_STATUS_OK && *resp)
    return MESHD_E_OK;
  if (code == GRPC_STATUS_OK) { /* rpc.h promises a reply with OK; don't crash if not */
    set_error(c, MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL, "%s: OK status without a reply",
              method);
    return MESHD_E_RPC;
  }
  st.kind[sizeof st.kind - 1] = '\0';
  st.message[sizeof st.message - 1] = '\0';
  return set_status(c, code, st.kind, st.message);
}

static meshd_err_t call_md(meshd_client_t *c, const char *method, const ProtobufCMessage *req,
                           const ProtobufCMessageDescriptor *desc, ProtobufCMessage **resp,
                           const rpc_md_t *md, size_t nmd) {
  return call_md_timeout(c, method, req, desc, resp, md, nmd, 0);
}

static meshd_err_t call(meshd_client_t *c, const char *method, const ProtobufCMessage *req,
                        const ProtobufCMessageDescriptor *desc, ProtobufCMessage **resp) {
  return call_md(c, method, req, desc, resp, c->md, c->nmd);
}

meshd_err_t meshd_health(meshd_client_t *client, const char *service, int *serving_status_out) {
  meshd_err_t ret = MESHD_E_OK;
  ProtobufCMessage *resp = NULL;

  if (!client)
    return MESHD_E_INVALID;
  if (!serving_status_out) {
    set_error(client, MESHD_E_INVALID, 0, NULL, "meshd_health: serving_status_out is NULL");
    return MESHD_E_INVALID;
  }
  Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  req.service = (char *)(service ? service : "");
  ret = call(client, HEALTH_CHECK, &req.base, &grpc__health__v1__health_check_response__descriptor,
             &resp);
  if (ret != MESHD_E_OK)
    goto out;
  *serving_status_out = (int)((Grpc__Health__V1__HealthCheckResponse *)resp)->status;
out:
  if (resp)
    protobuf_c_message_free_unpacked(resp, NULL);
  return ret;
}

static char *dup_str(const char *s) { return strdup(s ? s : ""); }

/* 0, or -1 out of memory (dst's strings that were copied are set: free them). */
static int copy_agent(meshd_agent_t *dst, const Meshd__V1__AgentInfo *a) {
  dst->rank = a->rank;
  dst->memory_bytes = a->memory_bytes;
  dst->allocated_bytes = a->allocated_bytes;
  dst->healthy = a->healthy;
  dst->drained = a->drained;
  dst->cuda = a->cuda;
  dst->address = dup_str(a->address);
  dst->device = dup_str(a->device);
  dst->agent_id = dup_str(a->agent_id);
  dst->version = dup_str(a->version);
  dst->commit = dup_str(a->commit);
  dst->build_type = dup_str(a->build_type);
  return dst->address && dst->device && dst->agent_id && dst->version && dst->commit &&
                 dst->build_type
             ? 0
             : -1;
}

/* *list gets n copies (NULL when n is 0). 0, or -1 out of memory (nothing kept). */
static int copy_agents(meshd_agent_t **list, Meshd__V1__AgentInfo *const *agents, size_t n) {
  *list = NULL;
  if (n == 0) return 0;
  meshd_agent_t *out = calloc(n, sizeof *out);
  if (!out) return -1;
  for (size_t i = 0; i < n; i++)
    if (copy_agent(&out[i], agents[i]) != 0) {
      meshd_agents_free(out, i + 1);
      return -1;
    }
  *list = out;
  return 0;
}

/* ---------------------------------------------------------------- paged listings */

/* Rows past any server's bound (--max-agents is at most 65,536; sessions are
 * bounded by memory): a list that long is a server leading the client on. */
#define MESHD_AGENTS_MAX (1u << 20)
#define MESHD_SESSIONS_MAX (1u << 24)

/* Room in *v (*cap elements of size elem) for need; new elements zeroed. 0, or -1
 * out of memory (*v as it was). */
static int grow_rows(void **v, size_t *cap, size_t need, size_t elem) {
  if (need <= *cap)
    return 0;
  size_t want = need < *cap * 2 ? *cap * 2 : need;
  char *grown = realloc(*v, want * elem);
  if (!grown)
    return -1;
  memset(grown + *cap * elem, 0, (want - *cap) * elem);
  *v = grown;
  *cap = want;
  return 0;
}

/* ListSessions and ListAgents are paged (docs/protocol.md): after a page of
 * `rows` rows (`total` so far) that answered next_page_token `next`, *token is
 * the token to ask the next page with, NULL after the last page. `sent`: the
 * token this page was asked with (NULL for the first). A page that shows
 * nothing yet says more follow, the token it was sent again, or a list past
 * max rows: a server leading the client on, not a list (MESHD_E_RPC). */
static meshd_err_t next_page(meshd_client_t *c, const char *fn, const char *method,
                             const char *next, const char *sent, size_t rows, size_t total,
                             size_t max, char **token) {
  *token = NULL;
  if (!next || !next[0])
    return MESHD_E_OK;
  bool again = sent && !strcmp(sent, next);
  if (rows == 0 || again || total > max) {
    char why[64];
    if (again)
      snprintf(why, sizeof why, "the same next_page_token again");
    else if (rows == 0)
      snprintf(why, sizeof why, "an empty page with a next_page_token");
    else
      snprintf(why, sizeof why, "over %zu rows", max);
    set_error(c, MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL,
              "%s: the server's %s pages do not end (%s)", fn, method, why);
    return MESHD_E_RPC;
  }
  *token = dup_str(next);
  if (!*token) {
    set_error(c, MESHD_E_NOMEM, 0, NULL, "%s: out of memory", fn);
    return MESHD_E_NOMEM;
  }
  return MESHD_E_OK;
}

/* One page's agents appended to out[*count...], each with the page's AgentTls.
 * 0, or -1 out of memory (*count counts the agent whose strings were partly copied). */
static int take_agents(meshd_agent_t *out, size_t *count, const Meshd__V1__ListAgentsReply *r) {
  const Meshd__V1__AgentTls *tls = r->agent_tls;
  bool has_tls = tls && tls->ca_pem && *tls->ca_pem;
  for (size_t i = 0; i < r->n_agents; i++) {
    meshd_agent_t *a = &out[(*count)++];
    if (copy_agent(a, r->agents[i]) != 0 ||
        (has_tls && (!(a->tls_server_name = dup_str(tls->server_name)) ||
                     !(a->tls_ca_pem = dup_str(tls->ca_pem)))))
      return -1;
  }
  return 0;
}

meshd_err_t meshd_agents(meshd_client_t *client, meshd_agent_t **list, size_t *n) {
  ProtobufCMessage *resp = NULL;
  meshd_agent_t *out = NULL;
  size_t count = 0, cap = 0;
  char *token = NULL, *sent = NULL;

  if (!client)
    return MESHD_E_INVALID;
  if (!list || !n) {
    set_error(client, MESHD_E_INVALID, 0, NULL, "meshd_agents: %s is NULL",
              !list ? "list" : "n");
    return MESHD_E_INVALID;
  }
  *list = NULL;
  *n = 0;
  meshd_err_t ret;
  do {
    Meshd__V1__ListAgentsRequest req = MESHD__V1__LIST_AGENTS_REQUEST__INIT;
    if (token)
      req.page_token = token;
    ret = call(client, LIST_AGENTS, &req.base, &meshd__v1__list_agents_reply__descriptor, &resp);
    free(sent);
    sent = token; /* kept: a server answering the same token again leads nowhere */
    token = NULL;
    if (ret != MESHD_E_OK)
      break;
    const Meshd__V1__ListAgentsReply *reply = (const Meshd__V1__ListAgentsReply *)resp;
    if (grow_rows((void **)&out, &cap, count + reply->n_agents, sizeof *out) != 0 ||
        take_agents(out, &count, reply) != 0) {
      set_error(client, MESHD_E_NOMEM, 0, NULL, "meshd_agents: out of memory copying %zu agents",
                count + reply->n_agents);
      ret = MESHD_E_NOMEM;
    } else {
      ret = next_page(client, "meshd_agents", "ListAgents", reply->next_page_token, sent,
                      reply->n_agents, count, MESHD_AGENTS_MAX, &token);
    }
    protobuf_c_message_free_unpacked(resp, NULL);
    resp = NULL;
  } while (ret == MESHD_E_OK && token);
  free(sent);
  if (ret != MESHD_E_OK) {
    meshd_agents_free(out, count);
    return ret;
  }
  *list = out;
  *n = count;
  return MESHD_E_OK;
}

void meshd_agents_free(meshd_agent_t *list, size_t n) {
  if (!list)
    return;
  for (size_t i = 0; i < n; i++) {
    free(list[i].address);
    free(list[i].device);
    free(list[i].agent_id);
    free(list[i].version);
    free(list[i].commit);
    free(list[i].build_type);
    free(list[i].tls_server_name);
    free(list[i].tls_ca_pem);
  }
  free(list);
}

meshd_err_t meshd_drain_agent(meshd_client_t *client, uint32_t rank, bool drain,
                              meshd_agent_t **agent_out) {
  if (!client)
    return MESHD_E_INVALID;
  if (agent_out)
    *agent_out = NULL;
  ProtobufCMessage *resp = NULL;
  Meshd__V1__DrainAgentRequest req = MESHD__V1__DRAIN_AGENT_REQUEST__INIT;
  req.rank = rank;
  req.drain = drain;
  meshd_err_t ret = call(client, "/meshd.v1.TensorService/DrainAgent", &req.base,
                         &meshd__v1__drain_agent_reply__descriptor, &resp);
  if (ret != MESHD_E_OK)
    return ret;
  const Meshd__V1__DrainAgentReply *reply = (const Meshd__V1__DrainAgentReply *)resp;
  if (agent_out && reply->agent && copy_agents(agent_out, &reply->agent, 1) != 0) {
    set_error(client, MESHD_E_NOMEM, 0, NULL, "meshd_drain_agent: out of memory");
    ret = MESHD_E_NOMEM;
  }
  protobuf_c_message_free_unpacked(resp, NULL);
  return ret;
}

meshd_err_t meshd_server_info(meshd_client_t *client, meshd_server_info_t *out) {
  if (!client)
    return MESHD_E_INVALID;
  if (!out) {
    set_error(client, MESHD_E_INVALID, 0, NULL, "meshd_server_info: out is NULL");
    return MESHD_E_INVALID;
  }
  memset(out, 0, sizeof *out);
  ProtobufCMessage *resp = NULL;
  Meshd__V1__GetInfoRequest req = MESHD__V1__GET_INFO_REQUEST__INIT;
  meshd_err_t ret = call(client, "/meshd.v1.TensorService/GetInfo", &req.base,
                         &meshd__v1__get_info_reply__descriptor, &resp);
  if (ret != MESHD_E_OK)
    return ret;
  const Meshd__V1__GetInfoReply *r = (const Meshd__V1__GetInfoReply *)resp;
  out->version = dup_str(r->version);
  out->commit = dup_str(r->commit);
  out->build_type = dup_str(r->build_type);
  out->cuda = r->cuda;
  out->uptime_ms = r->uptime_ms;
  /* GetInfo holds a large pool's first 1024 agents only (agents_truncated):
   * then every agent comes from ListAgents' pages. */
  bool all = !r->agents_truncated;
  if (!out->version || !out->commit || !out->build_type ||
      (all && copy_agents(&out->agents, r->agents, r->n_agents) != 0)) {
    meshd_server_info_free(out);
    set_error(client, MESHD_E_NOMEM, 0, NULL, "meshd_server_info: out of memory");
    ret = MESHD_E_NOMEM;
  } else if (all) {
    out->n_agents = r->n_agents;
  } else if ((ret = meshd_agents(client, &out->agents, &out->n_agents)) != MESHD_E_OK) {
    meshd_server_info_free(out);
  }
  protobuf_c_message_free_unpacked(resp, NULL);
  return ret;
}

void meshd_server_info_free(meshd_server_info_t *info) {
  if (!info)
    return;
  free(info->version);
  free(info->commit);
  free(info->build_type);
  meshd_agents_free(info->agents, info->n_agents);
  memset(info, 0, sizeof *info);
}

/* ---------------------------------------------------------------- sessions */

#define TS "/meshd.v1.TensorService/"

/* One page's sessions appended to out[*count...]. 0, or -1 out of memory
 * (*count counts the row whose strings were partly copied). */
static int take_sessions(meshd_session_info_t *out, size_t *count,
                         const Meshd__V1__ListSessionsReply *r) {
  for (size_t i = 0; i < r->n_sessions; i++) {
    const Meshd__V1__SessionInfo *si = r->sessions[i];
    meshd_session_info_t *d = &out[(*count)++];
    d->bytes_held = si->bytes_held;
    d->live_tensors = si->live_tensors;
    d->idle_ms = si->idle_ms;
    d->commands = si->commands;
    d->age_ms = si->age_ms;
    d->queued_commands = si->queued_commands;
    d->session_id = dup_str(si->session_id);
    d->client_name = dup_str(si->client_name);
    d->owner = dup_str(si->owner);
    if (!d->session_id || !d->client_name || !d->owner)
      return -1;
  }
  return 0;
}

meshd_err_t meshd_sessions(meshd_client_t *client, meshd_session_info_t **list, size_t *n) {
  ProtobufCMessage *resp = NULL;
  meshd_session_info_t *out = NULL;
  size_t count = 0, cap = 0;
  char *token = NULL, *sent = NULL;

  if (!client)
    return MESHD_E_INVALID;
  if (!list || !n) {
    set_error(client, MESHD_E_INVALID, 0, NULL, "meshd_sessions: %s is NULL",
              !list ? "list" : "n");
    return MESHD_E_INVALID;
  }
  *list = NULL;
  *n = 0;
  meshd_err_t ret;
  do {
    Meshd__V1__ListSessionsRequest req = MESHD__V1__LIST_SESSIONS_REQUEST__INIT;
    if (token)
      req.page_token = token;
    ret = call(client, TS "ListSessions", &req.base, &meshd__v1__list_sessions_reply__descriptor,
               &resp);
    free(sent);
    sent = token; /* kept: a server answering the same token again leads nowhere */
    token = NULL;
    if (ret != MESHD_E_OK)
      break;
    const Meshd__V1__ListSessionsReply *reply = (const Meshd__V1__ListSessionsReply *)resp;
    if (grow_rows((void **)&out, &cap, count + reply->n_sessions, sizeof *out) != 0 ||
        take_sessions(out, &count, reply) != 0) {
      set_error(client, MESHD_E_NOMEM, 0, NULL, "meshd_sessions: out of memory");
      ret = MESHD_E_NOMEM;
    } else {
      ret = next_page(client, "meshd_sessions", "ListSessions", reply->next_page_token, sent,
                      reply->n_sessions, count, MESHD_SESSIONS_MAX, &token);
    }
    protobuf_c_message_free_unpacked(resp, NULL);
    resp = NULL;
  } while (ret == MESHD_E_OK && token);
  free(sent);
  if (ret != MESHD_E_OK) {
    meshd_sessions_free(out, count);
    return ret;
  }
  *list = out;
  *n = count;
  return MESHD_E_OK;
}

void meshd_sessions_free(meshd_session_info_t *list, size_t n) {
  if (!list)
    return;
  for (size_t i = 0; i < n; i++) {
    free(list[i].session_id);
    free(list[i].client_name);
    free(list[i].owner);
  }
  free(list);
}

/* Refs are numbered per session and handed to the caller as bare numbers: so
 * that a ref of another session (which names another object here, or none:
 * wrong results, no error) is refused at the call, the n-th session a process
 * opens numbers its refs from (n mod REF_TAGS) * REF_SPAN + 1: the first 1,
 * 2, ..., the second 1000000000001, ... (decimal: "session 1, ref 1"). */
#define REF_SPAN 1000000000000ULL
#define REF_TAGS 9000u /* REF_TAGS * REF_SPAN < 2^53: refs stay exact as doubles (JSON, JavaScript) */
static atomic_uint_fast64_t sessions_opened;

struct meshd_session {
  meshd_client_t *client;
  char *id;
  char *token;
  rpc_md_t md[3]; /* the client's (authorization), then meshd-session, meshd-token */
  size_t nmd;
  meshd_ref_t next_ref;
  uint64_t ref_tag; /* its refs are ref_tag * REF_SPAN + 1, + 2, ... (own_ref) */
  /* The last execute_keep's Execute failed in flight (a deadline, a broken
   * connection): the server may have taken its refs (refs_taken). */
  bool sent_unsure;
  uint64_t next_seq;
  uint64_t ttl_s;
  /* The keepalive thread (meshd.h). ka_stop is under ka_mu; the thread reads
   * only client->ch, md and ka_period_ms besides. */
  pthread_t ka_thread;
  bool ka_started;
  pthread_mutex_t ka_mu;
  pthread_cond_t ka_cv; /* CLOCK_MONOTONIC */
  bool ka_stop;
  int ka_period_ms;
  direct_t *direct; /* the data path's state (direct.h) */
  pipeline_t *pipe; /* the Submit pipeline while it is on (pipeline.h) */
  bool literals;    /* the server lists the "literal" feature */
  /* The meshes this session made, by increasing ref: what a Literal to each
   * sends in all, and whether its agents run Literals (MeshMeta). */
  struct mesh_info {
    meshd_ref_t ref;
    uint64_t ranks;
    bool literals;
    uint32_t *rank_ids; /* its ranks in row-major order (NULL: not kept) */
  } *meshes;
  size_t nmeshes, meshes_cap;
};

static void deadline_in(struct timespec *ts, int ms) {
  clock_gettime(CLOCK_MONOTONIC, ts);
  ts->tv_sec += ms / 1000;
  ts->tv_nsec += (long)(ms % 1000) * 1000000L;
  if (ts->tv_nsec >= 1000000000L) {
    ts->tv_sec++;
    ts->tv_nsec -= 1000000000L;
  }
}

/* Sends KeepAlive every ka_period_ms until meshd_session_close stops it or the
 * server says the session is gone. Failures are not recorded on the client: its
 * last error belongs to the session's own thread. */
static void *keepalive_main(void *arg) {
  meshd_session_t *s = arg;
  prctl(PR_SET_NAME, "meshd-keepalive"); /* what ps -T and /proc/.../comm show */
  /* Short, so that meshd_session_close, which joins this thread, never waits long. */
  int timeout_ms = s->client->timeout_ms < 5000 ? s->client->timeout_ms : 5000;
  pthread_mutex_lock(&s->ka_mu);
  while (!s->ka_stop) {
    struct timespec at;
    deadline_in(&at, s->ka_period_ms);
    while (!s->ka_stop && pthread_cond_timedwait(&s->ka_cv, &s->ka_mu, &at) != ETIMEDOUT) {
    }
    if (s->ka_stop)
      break;
    pthread_mutex_unlock(&s->ka_mu);
    Meshd__V1__KeepAliveRequest req = MESHD__V1__KEEP_ALIVE_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    grpc_status_code code = rpc_unary(s->client->ch, TS "KeepAlive", &req.base,
                                      &meshd__v1__keep_alive_reply__descriptor, &resp, s->md, s->nmd,
                                      timeout_ms, NULL);
    if (resp)
      protobuf_c_message_free_unpacked(resp, NULL);
    pthread_mutex_lock(&s->ka_mu);
    if (code == GRPC_STATUS_UNAUTHENTICATED)
      break; /* closed or expired: nothing left to keep; other failures: next period */
  }
  pthread_mutex_unlock(&s->ka_mu);
  return NULL;
}

static void session_free(meshd_session_t *s) {
  if (s->pipe)
    pipeline_close(s->pipe, s->client->timeout_ms, NULL, NULL);
  if (s->ka_started) {
    pthread_mutex_lock(&s->ka_mu);
    s->ka_stop = true;
    pthread_cond_signal(&s->ka_cv);
    pthread_mutex_unlock(&s->ka_mu);
    pthread_join(s->ka_thread, NULL);
    pthread_cond_destroy(&s->ka_cv);
    pthread_mutex_destroy(&s->ka_mu);
  }
  direct_free(s->direct);
  for (size_t i = 0; i < s->nmeshes; i++)
    free(s->meshes[i].rank_ids);
  free(s->meshes);
  free(s->id);
  free(s->token);
  free(s);
}

/* Starts the keepalive thread; false if it cannot. */
static bool keepalive_start(meshd_session_t *s) {
  uint64_t period = (s->ttl_s ? s->ttl_s : 300) * 1000 / 3;
  /* (A floor of 1 s was the whole lease of a 1 s session, which then expired.) */
  s->ka_period_ms = period < 250 ? 250 : period > INT32_MAX ? INT32_MAX : (int)period;
  pthread_mutex_init(&s->ka_mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&s->ka_cv, &ca);
  pthread_condattr_destroy(&ca);
  if (pthread_create(&s->ka_thread, NULL, keepalive_main, s) != 0) {
    pthread_cond_destroy(&s->ka_cv);
    pthread_mutex_destroy(&s->ka_mu);
    return false;
  }
  s->ka_started = true;
  return true;
}

uint64_t meshd_session_ttl(const meshd_session_t *s) { return s ? s->ttl_s : 0; }

meshd_session_t *meshd_session_open(meshd_client_t *client, const char *name, meshd_err_t *err) {
  ProtobufCMessage *resp = NULL;
  meshd_session_t *s = NULL;
  meshd_err_t ret;

  if (!client) {
    ret = MESHD_E_INVALID;
    goto out;
  }
  Meshd__V1__CreateSessionRequest req = MESHD__V1__CREATE_SESSION_REQUEST__INIT;
  req.client_name = (char *)(name && *name ? name : "meshd-c");
  ret = call(client, TS "CreateSession", &req.base, &meshd__v1__create_session_reply__descriptor,
             &resp);
  if (ret != MESHD_E_OK)
    goto out;
  const Meshd__V1__CreateSessionReply *reply = (const Meshd__V1__CreateSessionReply *)resp;
  s = calloc(1, sizeof *s);
  if (s) {
    s->id = dup_str(reply->session_id);
    s->token = dup_str(reply->token);
    s->direct = direct_create();
  }
  if (!s || !s->id || !s->token || !s->direct) {
    if (s) {
      session_free(s);
      s = NULL;
    }
    /* The server's session goes too, rather than wait out its lease. */
    rpc_md_t md[3];
    size_t nmd = 0;
    for (size_t i = 0; i < client->nmd; i++)
      md[nmd++] = client->md[i];
    md[nmd++] = (rpc_md_t){"meshd-session", reply->session_id};
    md[nmd++] = (rpc_md_t){"meshd-token", reply->token};
    Meshd__V1__CloseSessionRequest creq = MESHD__V1__CLOSE_SESSION_REQUEST__INIT;
    ProtobufCMessage *cresp = NULL;
    if (call_md(client, TS "CloseSession", &creq.base, &meshd__v1__close_session_reply__descriptor,
                &cresp, md, nmd) == MESHD_E_OK)
      protobuf_c_message_free_unpacked(cresp, NULL);
    set_error(client, MESHD_E_NOMEM, 0, NULL, "meshd_session_open: out of memory");
    ret = MESHD_E_NOMEM;
    goto out;
  }
  s->client = client;
  for (size_t i = 0; i < client->nmd; i++)
    s->md[s->nmd++] = client->md[i];
  s->md[s->nmd++] = (rpc_md_t){"meshd-session", s->id};
  s->md[s->nmd++] = (rpc_md_t){"meshd-token", s->token};
  s->ref_tag = atomic_fetch_add(&sessions_opened, 1) % REF_TAGS;
  s->next_ref = s->ref_tag * REF_SPAN + 1;
  s->next_seq = 1;
  s->ttl_s = reply->ttl_seconds;
  for (size_t i = 0; i < reply->n_features; i++)
    if (reply->features[i] && strcmp(reply->features[i], "literal") == 0)
      s->literals = true;
  if (!keepalive_start(s)) {
    meshd_session_close(s); /* the server's session too */
    s = NULL;
    set_error(client, MESHD_E_NOMEM, 0, NULL, "meshd_session_open: cannot start its keepalive thread");
    ret = MESHD_E_NOMEM;
  }
out:
  if (resp)
    protobuf_c_message_free_unpacked(resp, NULL);
  if (err)
    *err = ret;
  return s;
}

#define CLOSE_LAST_TRY_MS 250

void meshd_session_close(meshd_session_t *s) {
  if (!s)
    return;
  ProtobufCMessage *resp = NULL;
  if (s->ka_started) { /* no KeepAlive after (or racing) the close */
    pthread_mutex_lock(&s->ka_mu);
    s->ka_stop = true;
    pthread_cond_signal(&s->ka_cv);
    pthread_mutex_unlock(&s->ka_mu);
  }
  /* One deadline, the client's timeout, for all of it: what is queued runs
   * before the session goes (its rejections go unreported), then
   * CloseSession, with at least CLOSE_LAST_TRY_MS should the pipeline have
   * taken the rest (a frozen server held a close three timeouts). */
  int64_t end = rpc_now_ms() + s->client->timeout_ms;
  pipeline_close(s->pipe, s->client->timeout_ms, NULL, NULL);
  s->pipe = NULL;
  int64_t left = end - rpc_now_ms();
  Meshd__V1__CloseSessionRequest req = MESHD__V1__CLOSE_SESSION_REQUEST__INIT;
  saved_error_t saved; /* not reported: keep the last error */
  error_save(s->client, &saved);
  if (call_md_timeout(s->client, TS "CloseSession", &req.base,
                      &meshd__v1__close_session_reply__descriptor, &resp, s->md, s->nmd,
                      left > CLOSE_LAST_TRY_MS ? (int)left : CLOSE_LAST_TRY_MS) == MESHD_E_OK)
    protobuf_c_message_free_unpacked(resp, NULL);
  error_restore(s->client, &saved);
  session_free(s);
}

/* "ERROR_KIND_WRONG_MESH" -> "WRONG_MESH". */
static const char *kind_name(int kind) {
  const ProtobufCEnumValue *v =
      protobuf_c_enum_descriptor_get_value(&meshd__v1__error_kind__descriptor, kind);
  if (!v || kind == 0)
    return "";
  return strncmp(v->name, "ERROR_KIND_", 11) == 0 ? v->name + 11 : v->name;
}

static meshd_err_t record(meshd_client_t *c, const direct_err_t *e) {
  set_error(c, e->err, e->code, e->kind, "%s", e->msg);
  return e->err;
}

/* Before a call that needs an answer: the pipeline's queue sent and answered
 * (within timeout_ms, <= 0: the client's), and its rejections reported. */
static meshd_err_t sync_point(meshd_session_t *s, int timeout_ms) {
  if (!s->pipe)
    return MESHD_E_OK;
  direct_err_t e = {0};
  uint64_t seq = 0;
  if (pipeline_flush(s->pipe, timeout_ms > 0 ? timeout_ms : s->client->timeout_ms, &e, &seq) == 0)
    return MESHD_E_OK;
  record(s->client, &e);
  s->client->last.seq = seq;
  if (strstr(s->client->message, "predates the Literal"))
    s->literals = false; /* an older agent joined a mesh: later Literals upload */
  return e.err;
}

/* ------------------------------------------------------------------ meshes */

static struct mesh_info *mesh_find(const meshd_session_t *s, meshd_ref_t ref) {
  size_t lo = 0, hi = s->nmeshes; /* refs increase: a binary search */
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (s->meshes[mid].ref == ref)
      return &s->meshes[mid];
    if (s->meshes[mid].ref < ref)
      lo = mid + 1;
    else
      hi = mid;
  }
  return NULL;
}

/* Keeps what the server said of a mesh this session made. Out of memory: not
 * kept (a Literal to it is then checked by the server alone). */
static void mesh_remember(meshd_session_t *s, const Meshd__V1__MeshMeta *m) {
  if (!m || (s->nmeshes && s->meshes[s->nmeshes - 1].ref >= m->ref))
    return;
  if (s->nmeshes == s->meshes_cap) {
    size_t cap = s->meshes_cap ? s->meshes_cap * 2 : 8;
    struct mesh_info *v = realloc(s->meshes, cap * sizeof *v);
    if (!v)
      return;
    s->meshes = v;
    s->meshes_cap = cap;
  }
  uint32_t *ids = m->n_ranks ? malloc(m->n_ranks * sizeof *ids) : NULL;
  if (ids)
    memcpy(ids, m->ranks, m->n_ranks * sizeof *ids);
  s->meshes[s->nmeshes++] = (struct mesh_info){m->ref, m->n_ranks, m->literals, ids};
}

/* What a Literal of `bytes` sends the agents in all: bytes on each rank of the
 * mesh, or once over them (per_rank); bytes alone for a mesh not known here. */
static uint64_t literal_sent(const meshd_session_t *s, meshd_ref_t mesh, bool per_rank,
                             size_t bytes) {
  const struct mesh_info *m = per_rank ? NULL : mesh_find(s, mesh);
  return (uint64_t)bytes * (m && m->ranks ? m->ranks : 1);
}

bool meshd_session_literals(const meshd_session_t *s, meshd_ref_t mesh) {
  if (!s || !s->literals)
    return false;
  const struct mesh_info *m = mesh_find(s, mesh);
  return !m || m->literals;
}

/* The commands a pipeline queues: every ref they make is known before the answer. */
static bool pipelined(Meshd__V1__Command__KindCase kind) {
  switch (kind) {
  case MESHD__V1__COMMAND__KIND_CALL:
  case MESHD__V1__COMMAND__KIND_FACTORY:
  case MESHD__V1__COMMAND__KIND_REDUCE:
  case MESHD__V1__COMMAND__KIND_TO_MESH:
  case MESHD__V1__COMMAND__KIND_DROP:
  case MESHD__V1__COMMAND__KIND_RELEASE:
  case MESHD__V1__COMMAND__KIND_BORROW:
  case MESHD__V1__COMMAND__KIND_DROP_BORROW:
  case MESHD__V1__COMMAND__KIND_LITERAL:
    return true;
  default:
    return false;
  }
}

/* Execute one command with deadline timeout_ms (<= 0: the client's); a result
 * carrying an error counts as a failed call. keep (may be NULL) gets the
 * result of a successful call, for the caller to free. With a pipeline, a
 * command that needs no answer is queued instead (keep is left alone), and any
 * other waits for the queue first. */
static meshd_err_t execute_keep(meshd_session_t *s, Meshd__V1__Command *cmd, int timeout_ms,
                                ProtobufCMessage **keep) {
  ProtobufCMessage *resp = NULL;
  cmd->seq = s->next_seq++;
  s->sent_unsure = false;
  if (s->pipe) {
    if (pipelined(cmd->kind_case)) {
      direct_err_t e = {0};
      uint64_t sent = cmd->kind_case == MESHD__V1__COMMAND__KIND_LITERAL
                          ? literal_sent(s, cmd->literal->mesh, cmd->literal->per_rank,
                                         cmd->literal->data.len)
                          : 0;
      int rc = pipeline_queue(s->pipe, &cmd->base, cmd->seq, sent,
                              timeout_ms > 0 ? timeout_ms : s->client->timeout_ms, &e);
      if (rc <= 0)
        return rc == 0 ? MESHD_E_OK : record(s->client, &e);
      /* rc 1, over a batch's bytes: an Execute of its own, after the queue */
    }
    int64_t t0 = rpc_now_ms();
    int budget = timeout_ms > 0 ? timeout_ms : s->client->timeout_ms;
    meshd_err_t ret = sync_point(s, budget);
    if (ret != MESHD_E_OK)
      return ret;
    int64_t left = budget - (rpc_now_ms() - t0); /* one deadline for the wait and the call */
    timeout_ms = left < 1 ? 1 : (int)left;
  }
  meshd_err_t ret = call_md_timeout(s->client, TS "Execute", &cmd->base,
                                    &meshd__v1__command_result__descriptor, &resp, s->md, s->nmd,
                                    timeout_ms);
  if (ret != MESHD_E_OK) {
    /* A status of the server's own carries its kind: the command was refused
     * and took nothing. A deadline, or a call gRPC ended (no kind), may have
     * been accepted. */
    s->sent_unsure = ret == MESHD_E_DEADLINE || !s->client->kind[0];
    return ret;
  }
  const Meshd__V1__CommandResult *r = (const Meshd__V1__CommandResult *)resp;
  const Meshd__V1__Error *e = r->error ? r->error : (r->n_errors > 0 ? r->errors[0] : NULL);
  if (e && (e->kind != 0 || (e->message && *e->message))) {
    set_error(s->client, MESHD_E_RPC, e->code ? e->code : GRPC_STATUS_UNKNOWN, kind_name(e->kind),
              "%s", e->message ? e->message : "");
    /* A Sync reports every failure since the last one, once: the rest are
     * named after the first, as far as the message holds them. */
    size_t more = r->error ? 0 : r->n_errors - 1;
    if (more) {
      char *msg = s->client->message;
      size_t len = strlen(msg), cap = sizeof s->client->message;
      len += (size_t)snprintf(msg + len, cap - len, " (and %zu more:", more);
      for (size_t i = 1; i < r->n_errors && len + 1 < cap; i++)
        len += (size_t)snprintf(msg + len, cap - len, "%s %s: %s", i > 1 ? ";" : "",
                                kind_name(r->errors[i]->kind),
                                r->errors[i]->message ? r->errors[i]->message : "");
      if (len + 1 < cap)
        snprintf(msg + len, cap - len, ")");
    }
    ret = MESHD_E_RPC;
  }
  if (ret == MESHD_E_OK && keep)
    *keep = resp;
  else
    protobuf_c_message_free_unpacked(resp, NULL);
  return ret;
}

static meshd_err_t execute_timeout(meshd_session_t *s, Meshd__V1__Command *cmd, int timeout_ms) {
  return execute_keep(s, cmd, timeout_ms, NULL);
}

static meshd_err_t execute(meshd_session_t *s, Meshd__V1__Command *cmd) {
  return execute_timeout(s, cmd, 0);
}

/* The n refs from s->next_ref that a command made are taken once it
 * succeeded, and also when its call failed in flight: the server may have
 * accepted it, and a ref it took would be refused REF_REUSED to every later
 * command (refs may skip). A command the server refused took none. */
static void refs_taken(meshd_session_t *s, meshd_err_t ret, uint64_t n) {
  if (ret == MESHD_E_OK || s->sent_unsure)
    s->next_ref += n;
}

/* execute_new() of CreateMesh or SliceMesh, which keeps the MeshMeta. */
static meshd_err_t execute_mesh(meshd_session_t *s, Meshd__V1__Command *cmd, meshd_ref_t *out) {
  ProtobufCMessage *resp = NULL;
  meshd_err_t ret = execute_keep(s, cmd, 0, &resp);
  if (ret == MESHD_E_OK) {
    mesh_remember(s, ((const Meshd__V1__CommandResult *)resp)->mesh);
    protobuf_c_message_free_unpacked(resp, NULL);
    *out = s->next_ref;
  }
  refs_taken(s, ret, 1);
  return ret;
}

/* execute() of a command that makes ref s->next_ref: on success *out gets it. */
static meshd_err_t execute_new(meshd_session_t *s, Meshd__V1__Command *cmd, meshd_ref_t *out) {
  meshd_err_t ret = execute(s, cmd);
  if (ret == MESHD_E_OK)
    *out = s->next_ref;
  refs_taken(s, ret, 1);
  return ret;
}

static bool check_out(meshd_session_t *s, const void *out, const char *fn) {
  if (out)
    return true;
  set_error(s->client, MESHD_E_INVALID, 0, NULL, "%s: output pointer is NULL", fn);
  return false;
}

/* Whether `ref` (0: none) may be a ref of session s; else MESHD_E_INVALID is
 * recorded, naming fn's argument `what` (index: its place in a list, or -1). */
static bool own_ref(meshd_session_t *s, const char *fn, const char *what, long index,
                    meshd_ref_t ref) {
  if (ref == 0 || ref / REF_SPAN == s->ref_tag)
    return true;
  char at[32] = "";
  if (index >= 0)
    snprintf(at, sizeof at, "[%ld]", index);
  set_error(s->client, MESHD_E_INVALID, 0, NULL,
            "%s: %s%s (ref %llu) is of another session than this one: refs are per session, "
            "so it would name another object here; use refs this session handed out (move "
            "data with fetch and upload)",
            fn, what, at, (unsigned long long)ref);
  return false;
}

static bool own_refs(meshd_session_t *s, const char *fn, const char *what,
                     const meshd_ref_t *refs, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!own_ref(s, fn, what, (long)i, refs[i]))
      return false;
  return true;
}

meshd_err_t meshd_session_create_mesh(meshd_session_t *s, const char *const *names,
                                      const int64_t *sizes, size_t ndims, meshd_ref_t *mesh_out) {
  if (!s)
    return MESHD_E_INVALID;
  if (!check_out(s, mesh_out, "meshd_session_create_mesh"))
    return MESHD_E_INVALID;
  if (ndims == 0 || ndims > 16 || !names || !sizes) {
    set_error(s->client, MESHD_E_INVALID, 0, NULL,
              "meshd_session_create_mesh: need 1 to 16 dims with names and sizes");
    return MESHD_E_INVALID;
  }
  Meshd__V1__Dim dims[16];
  Meshd__V1__Dim *pdims[16];
  for (size_t i = 0; i < ndims; i++) {
    meshd__v1__dim__init(&dims[i]);
    dims[i].name = (char *)names[i];
    dims[i].size = sizes[i];
    pdims[i] = &dims[i];
  }
  Meshd__V1__CreateMesh cm = MESHD__V1__CREATE_MESH__INIT;
  cm.ref = s->next_ref;
  cm.n_dims = ndims;
  cm.dims = pdims;
  Meshd__V1__Command cmd = MESHD__V1__COMMAND__INIT;
  cmd.kind_case = MESHD__V1__COMMAND__KIND_CREATE_MESH;
  cmd.create_mesh = &cm;
  return execute_mesh(s, &cmd, mesh_out);
}

meshd_err_t meshd_session_slice_mesh(meshd_session_t *s, meshd_ref_t parent, const char *const *dims,
                                     const int64_t *index, size_t n, meshd_ref_t *mesh_out) {
  if (!s)
    return MESHD_E_INVALID;
  if (!check_out(s, mesh_out, "meshd_session_slice_mesh"))
    return MESHD_E_INVALID;
  if (n > 16 || (n && (!dims || !index))) {
    set_error(s->client, MESHD_E_INVALID, 0, NULL,
              "meshd_session_slice_mesh: need 0 to 16 dims with their indices");
    return MESHD_E_INVALID;
  }
  if (!own_ref(s, "meshd_session_slice_mesh", "parent", -1, parent))
    return MESHD_E_INVALID;
  Meshd__V1__MeshSelector sel[16];
  Meshd__V1__MeshSelector *psel[16];
  for (size_t i = 0; i < n; i++) {
    meshd__v1__mesh_selector__init(&sel[i]);
    sel[i].dim = (char *)dims[i];
    sel[i].sel_case = MESHD__V1__MESH_SELECTOR__SEL_INDEX;
    sel[i].index = index[i];
    psel[i] = &sel[i];
  }
  Meshd__V1__SliceMesh sm = MESHD__V1__SLICE_MESH__INIT;
  sm.ref = s->next_ref;
  sm.parent = parent;
  sm.n_selectors = n;
  sm.selectors = psel;
  Meshd__V1__Command cmd = MESHD__V1__COMMAND__INIT;
  cmd.kind_case = MESHD__V1__COMMAND__KIND_SLICE_MESH;
  cmd.slice_mesh = &sm;
  return execute_mesh(s, &cmd, mesh_out);
}

meshd_err_t meshd_session_factory(meshd_session_t *s, meshd_ref_t mesh, const char *kind,
                                  const int64_t *shape, size_t ndim, double value,
                                  meshd_ref_t *out) {
  if (!s)
    return MESHD_E_INVALID;
  if (!check_out(s, out, "meshd_session_factory"))
    return MESHD_E_INVALID;
  if (!kind || (ndim > 0 && !shape)) {
    set_error(s->client, MESHD_E_INVALID, 0, NULL, "meshd_session_factory: kind or shape is NULL");
    return MESHD_E_INVALID;
  }
  if (!own_ref(s, "meshd_session_factory", "mesh", -1, mesh))
    return MESHD_E_INVALID;
  Meshd__V1__Factory f = MESHD__V1__FACTORY__INIT;
  f.ref = s->next_ref;
  f.mesh = mesh;
  f.kind = (char *)kind;
  f.n_shape = ndim;
  f.shape = (int64_t *)shape;
  f.dtype = MESHD__V1__DTYPE__DTYPE_FLOAT32;
  f.value = value;
  Meshd__V1__Command cmd = MESHD__V1__COMMAND__INIT;
  cmd.kind_case = MESHD__V1__COMMAND__KIND_FACTORY;
  cmd.factory = &f;
  return execute_new(s, &cmd, out);
}

static int dtype_by_name(const char *name) {
  char up[32] = "DTYPE_";
  size_t n = strlen(name);
  if (n == 0 || n > sizeof up - 7)
    return 0;
  for (size_t i = 0; i < n; i++)
    up[6 + i] = (char)((name[i] >= 'a' && name[i] <= 'z') ? name[i] - 32 : name[i]);
  const ProtobufCEnumValue *v =
      protobuf_c_enum_descriptor_get_value_by_name(&meshd__v1__dtype__descriptor, up);
  return v && v->value ? v->value : 0;
}

/* The load's result tensor into *info. */
static void load_info(const Meshd__V1__CommandResult *r, meshd_load_info_t *info) {
  memset(info, 0, sizeof *info);
  if (r->n_tensors < 1)
    return;
  const Meshd__V1__TensorMeta *t = r->tensors[0];
  const ProtobufCEnumValue *v =
      protobuf_c_enum_descriptor_get_value(&meshd__v1__dtype__descriptor, (int)t->dtype);
  const char *name = v && strncmp(v->name, "DTYPE_", 6) == 0 ? v->name + 6 : "";
  for (size_t i = 0; name[i] && i + 1 < sizeof info->dtype; i++)
    info->dtype[i] = (char)(name[i] >= 'A' && name[i] <= 'Z' ? name[i] + 32 : name[i]);
  info->ndim = t->n_shape < 16 ? t->n_shape : 16;
  info->bytes = direct_dtype_bytes(t->dtype);
  for (size_t i = 0; i < info->ndim; i++) {
    info->shape[i] = t->shape[i];
    /* A shape is the server's to say: past 2^64 bytes the product wrapped (to
     * 0 for [2^62] float32); UINT64_MAX says "too large" instead. */
    if (__builtin_mul_overflow(info->bytes, t->shape[i] > 0 ? (uint64_t)t->shape[i] : 0,
                               &info->bytes))
      info->bytes = UINT64_MAX;
  }
}

/* "no tensor named 'x' in URL; it holds: a, b, c ..." */
static void name_missing(meshd_session_t *s, const char *url, const char *name,
                         const Meshd__V1__InspectUrlReply *r) {
  char where[512], have[384] = "";
  conn_redact_url(url, where, sizeof where);
  size_t used = 0;
  for (size_t i = 0; i < r->n_tensors && used < sizeof have; i++)
    used += (size_t)snprintf(have + used, sizeof have - used, "%s%s", i ? ", " : "",
                             r->tensors[i]->name);
  if (used >= sizeof have)
    memcpy(have + sizeof have - 5, " ...", 5);
  if (name && r->format && strcmp(r->format, "npy") == 0)
    set_error(s->client, MESHD_E_INVALID, 0, NULL,
              "meshd_session_load: name '%s': %s is a .npy file, one tensor without a name; "
              "leave name unset", name, where);
  else if (name)
    set_error(s->client, MESHD_E_INVALID, 0, NULL,
              "meshd_session_load: no tensor named '%s' in %s; it holds: %s", name, where, have);
  else
    set_error(s->client, MESHD_E_INVALID, 0, NULL,
              "meshd_session_load: %s holds %zu tensors (%s); name one", where, r->n_tensors,
              have);
}

/* The tensor named `name` of an InspectUrl reply (NULL: its only one), or NULL. */
static const Meshd__V1__UrlTensor *find_url_tensor(const Meshd__V1__InspectUrlReply *r,
                                                   const char *name) {
  for (size_t i = 0; i < r->n_tensors; i++)
    if (name ? strcmp(r->tensors[i]->name, name) == 0 : r->n_tensors == 1)
      return r->tensors[i];
  return NULL;
}

/* t of the safetensors index at index_url: InspectUrl of its file, whose URL
 * is the index's with t->file in place of its last path segment (and without
 * the index's query: a presigned index URL does not sign the files). *resp
 * gets that file's reply whenever there is one (the caller frees it); on
 * success *found is t's tensor in it and *file_url its URL (the caller's). */
static meshd_err_t inspect_index_file(meshd_session_t *s, meshd_ref_t mesh, const char *index_url,
                                      const Meshd__V1__UrlTensor *t, ProtobufCMessage **resp,
                                      const Meshd__V1__UrlTensor **found, char **file_url) {
  size_t base = strcspn(index_url, "?#");
  const char *host = strstr(index_url, "://");
  size_t dir = base;
  while (dir > 0 && index_url[dir - 1] != '/')
    dir--;
  bool no_path = !host || dir <= (size_t)(host - index_url) + 3;
  size_t n = (no_path ? base + 1 : dir) + strlen(t->file) + 1;
  char *u = malloc(n);
  if (!u) {
    set_error(s->client, MESHD_E_NOMEM, 0, NULL, "meshd_session_load: out of memory");
    return MESHD_E_NOMEM;
  }
  if (no_path)
    snprintf(u, n, "%.*s/%s", (int)base, index_url, t->file);
  else
    snprintf(u, n, "%.*s%s", (int)dir, index_url, t->file);
  Meshd__V1__InspectUrlRequest rq = MESHD__V1__INSPECT_URL_REQUEST__INIT;
  rq.url = u;
  rq.mesh = mesh;
  meshd_err_t ret = call_md(s->client, TS "InspectUrl", &rq.base,
                            &meshd__v1__inspect_url_reply__descriptor, resp, s->md, s->nmd);
  const Meshd__V1__InspectUrlReply *r = (const Meshd__V1__InspectUrlReply *)*resp;
  bool safetensors = ret == MESHD_E_OK && r->format && strcmp(r->format, "safetensors") == 0;
  const Meshd__V1__UrlTensor *ft = safetensors ? find_url_tensor(r, t->name) : NULL;
  if (ret == MESHD_E_OK && !ft) {
    char where[512], file[512];
    conn_redact_url(index_url, where, sizeof where);
    conn_redact_url(u, file, sizeof file);
    set_error(s->client, MESHD_E_INVALID, 0, NULL,
              "meshd_session_load: the index %s puts '%s' in %s, which is %s", where, t->name,
              file, safetensors ? "a file without it" : "no safetensors file");
    ret = MESHD_E_INVALID;
  }
  if (ret != MESHD_E_OK) {
    free(u);
    return ret;
  }
  *found = ft;
  *file_url = u;
  return MESHD_E_OK;
}

/* The version every rank of a raw load (dtype and shape) reads: InspectUrl
 * size_only, the first agent's now. Unpinned, each rank checked only its own
 * request: a file rewritten between two ranks' requests loaded old bytes on
 * one rank and new on another, with no error. *resp gets the reply (the
 * caller frees it; its version goes into the Load), or stays NULL when the
 * inspection failed: the load then goes unpinned and a URL the agent cannot
 * read fails on its ranks, naming each, as it always did (the last error is
 * left as it was). Only a session refused (NO_SESSION, PERMISSION_DENIED: the
 * URL's policy too) fails the load here, as Python's meshd.load does. */
static meshd_err_t raw_version(meshd_session_t *s, meshd_ref_t mesh, const char *url,
                               ProtobufCMessage **resp) {
  Meshd__V1__InspectUrlRequest rq = MESHD__V1__INSPECT_URL_REQUEST__INIT;
  rq.url = (char *)url;
  rq.mesh = mesh;
  rq.size_only = true;
  saved_error_t saved;
  error_save(s->client, &saved);
  meshd_err_t ret = call_md(s->client, TS "InspectUrl", &rq.base,
                            &meshd__v1__inspect_url_reply__descriptor, resp, s->md, s->nmd);
  if (ret == MESHD_E_OK)
    return MESHD_E_OK;
  if (ret == MESHD_E_RPC && (strcmp(s->client->kind, "NO_SESSION") == 0 ||
                             strcmp(s->client->kind, "PERMISSION_DENIED") == 0))
    return ret;
  error_restore(s->client, &saved);
  return MESHD_E_OK;
}

meshd_err_t meshd_session_load(meshd_session_t *s, meshd_ref_t mesh, const char *url,
                               const meshd_load_options_t *opts, meshd_ref_t *out) {
  if (!s)
    return MESHD_E_INVALID;
  if (!check_out(s, out, "meshd_session_load"))
    return MESHD_E_INVALID;
  meshd_load_options_t o = opts ? *opts : (meshd_load_options_t){0};
  if (!url || !*url || (o.dtype && o.ndim > 0 && !o.shape) || (!o.dtype && o.shape)) {
    set_error(s->client, MESHD_E_INVALID, 0, NULL,
              "meshd_session_load: need a url, and a shape with a dtype (raw bytes) or neither");
    return MESHD_E_INVALID;
  }
  if (o.dtype && o.name) { /* as Python's and Node's: not silently the whole file */
    set_error(s->client, MESHD_E_INVALID, 0, NULL,
              "meshd_session_load: name '%s' picks a tensor of a safetensors file; raw bytes "
              "(dtype and shape) have none", o.name);
    return MESHD_E_INVALID;
  }
  if (!own_ref(s, "meshd_session_load", "mesh", -1, mesh))
    return MESHD_E_INVALID;
  Meshd__V1__Load l = MESHD__V1__LOAD__INIT;
  l.mesh = mesh;
  l.url = (char *)url;
  l.shard = (char *)(o.shard ? o.shard : "");
  l.dim = o.dim;
  ProtobufCMessage *resp = NULL, *result = NULL;
  char *file_url = NULL;
  if (o.dtype) {
    if (!(l.dtype = (Meshd__V1__DType)dtype_by_name(o.dtype))) {
      set_error(s->client, MESHD_E_INVALID, 0, "BAD_ARGUMENT",
                "meshd_session_load: unknown dtype '%s'", o.dtype);
      return MESHD_E_INVALID;
    }
    l.n_shape = o.ndim;
    l.shape = (int64_t *)o.shape;
    meshd_err_t ret = raw_version(s, mesh, url, &resp);
    if (ret != MESHD_E_OK)
      return ret;
    if (resp) /* its size is not pinned: a raw file of another size fails on the ranks */
      l.version = ((const Meshd__V1__InspectUrlReply *)resp)->version;
  } else {
    Meshd__V1__InspectUrlRequest rq = MESHD__V1__INSPECT_URL_REQUEST__INIT;
    rq.url = (char *)url;
    rq.mesh = mesh;
    meshd_err_t ret = call_md(s->client, TS "InspectUrl", &rq.base,
                              &meshd__v1__inspect_url_reply__descriptor, &resp, s->md, s->nmd);
    if (ret != MESHD_E_OK)
      return ret;
    const Meshd__V1__InspectUrlReply *r = (const Meshd__V1__InspectUrlReply *)resp;
    const Meshd__V1__UrlTensor *t = find_url_tensor(r, o.name);
    if (!t) {
      name_missing(s, url, o.name, r);
      protobuf_c_message_free_unpacked(resp, NULL);
      return MESHD_E_INVALID;
    }
    if (r->format && strcmp(r->format, "safetensors_index") == 0) {
      /* A checkpoint's index: the tensor is in the file it names. */
      ProtobufCMessage *file_resp = NULL;
      ret = inspect_index_file(s, mesh, url, t, &file_resp, &t, &file_url);
      protobuf_c_message_free_unpacked(resp, NULL); /* the index's */
      resp = file_resp;
      if (ret != MESHD_E_OK) {
        if (resp)
          protobuf_c_message_free_unpacked(resp, NULL);
        return ret;
      }
      r = (const Meshd__V1__InspectUrlReply *)resp;
      l.url = file_url;
    }
    l.dtype = t->dtype;
    l.n_shape = t->n_shape;
    l.shape = t->shape;
    l.offset = t->offset;
    l.file_size = r->file_size;
    l.version = r->version; /* a file rewritten at the same size since: refused by the agents */
  }
  if (l.shard[0] && l.dim < 0) /* from the end, as Python's meshd.load takes it */
    l.dim += (int32_t)l.n_shape;
  l.ref = s->next_ref;
  Meshd__V1__Command cmd = MESHD__V1__COMMAND__INIT;
  cmd.kind_case = MESHD__V1__COMMAND__KIND_LOAD;
  cmd.load = &l;
  meshd_err_t ret = execute_keep(s, &cmd, 0, o.info ? &result : NULL);
  if (resp)
    protobuf_c_message_free_unpacked(resp, NULL);
  free(file_url);
  if (result) {
    load_info((const Meshd__V1__CommandResult *)result, o.info);
    protobuf_c_message_free_unpacked(result, NULL);
  }
  if (ret == MESHD_E_OK)
    *out = s->next_ref;
  refs_taken(s, ret, 1);
  return ret;
}

#define LOAD_PROGRESS_MAX 256 /* refs per LoadProgress (the server's limit) */
#define WAIT_STOP_MS 50         /* meshd_session_wait_load looks at opts->stop this often */
#define WAIT_SYNC_STEP_MS 1000  /* its Syncs once the loads are in, between looks at stop */

/* Ranks a LoadProgress left unanswered, ascending and each once. */
typedef struct {
  uint32_t *v;
  size_t n, cap;
} rank_set_t;

static void rank_set_add(rank_set_t *r, uint32_t rank) {
  size_t i = 0;
  while (i < r->n && r->v[i] < rank) i++;
  if (i < r->n && r->v[i] == rank) return;
  if (r->n == r->cap) {
    size_t cap = r->cap ? 2 * r->cap : 8;
    uint32_t *v = realloc(r->v, cap * sizeof *v);
    if (!v) return; /* the list is a courtesy: shorter when out of memory */
    r->v = v;
    r->cap = cap;
  }
  memmove(r->v + i + 1, r->v + i, (r->n - i) * sizeof *r->v);
  r->v[i] = rank;
  r->n++;
}

/* LoadProgress of n >= 1 refs, each call bounded by timeout_ms (<= 0: the client's).
 * lost (may be NULL) is set when the server named a rank whose agent is lost;
 * silent (may be NULL) gets every rank it named. */
static meshd_err_t load_progress(meshd_session_t *s, const meshd_ref_t *refs, size_t n,
                                 meshd_load_progress_t *out, int timeout_ms, bool *lost,
                                 rank_set_t *silent) {
  for (size_t at = 0; at < n; at += LOAD_PROGRESS_MAX) {
    Meshd__V1__LoadProgressRequest rq = MESHD__V1__LOAD_PROGRESS_REQUEST__INIT;
    rq.n_refs = n - at < LOAD_PROGRESS_MAX ? n - at : LOAD_PROGRESS_MAX;
    rq.refs = (uint64_t *)(refs + at);
    ProtobufCMessage *resp = NULL;
    meshd_err_t ret = call_md_timeout(s->client, TS "LoadProgress", &rq.base,
                                      &meshd__v1__load_progress_reply__descriptor, &resp, s->md,
                                      s->nmd, timeout_ms);
    if (ret != MESHD_E_OK)
      return ret;
    const Meshd__V1__LoadProgressReply *r = (const Meshd__V1__LoadProgressReply *)resp;
    if (r->n_loads != rq.n_refs) {
      set_error(s->client, MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL,
                "LoadProgress: asked for %zu refs, the server answered %zu", rq.n_refs,
                r->n_loads);
      protobuf_c_message_free_unpacked(resp, NULL);
      return MESHD_E_RPC;
    }
    for (size_t i = 0; i < r->n_loads; i++)
      out[at + i] = (meshd_load_progress_t){refs[at + i], r->loads[i]->done_bytes,
                                            r->loads[i]->total_bytes, r->loads[i]->failed};
    for (size_t i = 0; i < r->n_unanswered; i++) {
      if (lost) *lost |= r->unanswered[i]->kind == MESHD__V1__ERROR_KIND__ERROR_KIND_AGENT_LOST;
      if (silent) rank_set_add(silent, r->unanswered[i]->rank);
    }
    protobuf_c_message_free_unpacked(resp, NULL);
  }
  return MESHD_E_OK;
}

meshd_err_t meshd_session_load_progress(meshd_session_t *s, const meshd_ref_t *refs, size_t n,
                                        meshd_load_progress_t *out) {
  if (!s)
    return MESHD_E_INVALID;
  if (!check_out(s, out, "meshd_session_load_progress"))
    return MESHD_E_INVALID;
  if (n == 0 || !refs) {
    set_error(s->client, MESHD_E_INVALID, 0, NULL,
              "meshd_session_load_progress: need at least one ref (got %zu, refs %s)", n,
              refs ? "set" : "NULL");
    return MESHD_E_INVALID;
  }
  if (!own_refs(s, "meshd_session_load_progress", "refs", refs, n))
    return MESHD_E_INVALID;
  return load_progress(s, refs, n, out, 0, NULL, NULL);
}

static int64_t mono_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static meshd_err_t wait_stopped(meshd_session_t *s, uint64_t done, uint64_t total) {
  set_error(s->client, MESHD_E_CANCELLED, 0, NULL,
            "meshd_session_wait_load: stopped by the caller with %llu of %llu bytes in; the load "
            "goes on until the session closes", (unsigned long long)done, (unsigned long long)total);
  return MESHD_E_CANCELLED;
}

static meshd_err_t wait_late(meshd_session_t *s, uint64_t done, uint64_t total, int timeout_ms) {
  set_error(s->client, MESHD_E_DEADLINE, GRPC_STATUS_DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED",
            "meshd_session_wait_load: %llu of %llu bytes in after %d ms; the load goes on",
            (unsigned long long)done, (unsigned long long)total, timeout_ms);
  return MESHD_E_DEADLINE;
}

/* Sleeps ms, in pieces short enough to see *stop soon. False if stopped. */
static bool nap_ms(int ms, const volatile sig_atomic_t *stop) {
  int64_t until = mono_ms() + ms;
  for (;;) {
    if (stop && *stop)
      return false;
    int64_t left = until - mono_ms();
    if (left <= 0)
      return true;
    struct timespec ts = {0, (long)(left < WAIT_STOP_MS ? left : WAIT_STOP_MS) * 1000000L};
    nanosleep(&ts, NULL);
  }
}

meshd_err_t meshd_session_wait_load(meshd_session_t *s, const meshd_ref_t *refs, size_t n,
                                    const meshd_wait_load_options_t *opts) {
  static const meshd_wait_load_options_t defaults = MESHD_WAIT_LOAD_OPTIONS_INIT;
  if (!s)
    return MESHD_E_INVALID;
  if (n == 0 || !refs) {
    set_error(s->client, MESHD_E_INVALID, 0, NULL,
              "meshd_session_wait_load: need at least one ref (got %zu, refs %s)", n,
              refs ? "set" : "NULL");
    return MESHD_E_INVALID;
  }
  if (!own_refs(s, "meshd_session_wait_load", "refs", refs, n))
    return MESHD_E_INVALID;
  const meshd_wait_load_options_t *o = opts ? opts : &defaults;
  int interval = o->interval_ms > 0 ? o->interval_ms : 250;
  int64_t deadline = o->timeout_ms > 0 ? mono_ms() + o->timeout_ms : 0;
  meshd_load_progress_t *p = malloc(n * sizeof *p);
  if (!p) {
    set_error(s->client, MESHD_E_NOMEM, 0, NULL, "meshd_session_wait_load: out of memory");
    return MESHD_E_NOMEM;
  }
  uint64_t done = 0, total = 0;
  meshd_err_t ret;
  rank_set_t silent = {0};
  bool told_silent = false; /* o->silent last heard of some ranks */
  /* Looks only (LoadProgress, not a command) until every load is in, one
   * failed or a rank's agent is lost; then Syncs, which wait for the rest of
   * the session and report a failure. A look that times out, or that is
 * refused QUOTA (the server's helpers busy), is no news. */
  for (;;) {
    if (o->stop && *o->stop) {
      ret = wait_stopped(s, done, total);
      goto out;
    }
    int64_t left = deadline ? deadline - mono_ms() : 0;
    if (deadline && left <= 0) {
      ret = wait_late(s, done, total, o->timeout_ms);
      goto out;
    }
    bool lost = false;
    silent.n = 0;
    ret = load_progress(s, refs, n, p, deadline && left < INT32_MAX ? (int)left : 0, &lost,
                        &silent);
    if (ret == MESHD_E_OK) {
      if (o->silent && (silent.n || told_silent))
        o->silent(o->progress_user, silent.v, silent.n);
      told_silent = silent.n > 0;
      bool settled = lost;
      done = total = 0;
      for (size_t i = 0; i < n; i++) {
        done += p[i].done_bytes;
        total += p[i].total_bytes;
        settled |= p[i].failed;
      }
      if (!settled) {
        settled = true;
        for (size_t i = 0; i < n; i++)
          settled &= p[i].done_bytes >= p[i].total_bytes;
      }
      if (o->progress)
        o->progress(o->progress_user, done < total ? done : total, total);
      if (settled)
        break;
    } else if (ret != MESHD_E_DEADLINE &&
               !(ret == MESHD_E_RPC && strcmp(s->client->kind, "QUOTA") == 0)) {
      goto out; /* (QUOTA: the server's progress helpers are busy; look again) */
    }
    if (!nap_ms(interval, o->stop)) {
      ret = wait_stopped(s, done, total);
      goto out;
    }
  }
  for (;;) {
    int step = WAIT_SYNC_STEP_MS;
    if (deadline) {
      int64_t left = deadline - mono_ms();
      if (left <= 0) {
        ret = wait_late(s, done, total, o->timeout_ms);
        goto out;
      }
      step = left < step ? (int)left : step;
    }
    ret = meshd_session_sync_timeout(s, step);
    if (ret != MESHD_E_DEADLINE)
      break;
    if (o->stop && *o->stop) {
      ret = wait_stopped(s, done, total);
      goto out;
    }
  }
  if (ret == MESHD_E_OK && o->progress)
    o->progress(o->progress_user, total, total);
out:
  free(silent.v);
  free(p);
  return ret;
}

meshd_err_t meshd_session_call(meshd_session_t *s, const char *op, const meshd_arg_t *args,
                               size_t nargs, meshd_ref_t *out) {
  if (!s)
    return MESHD_E_INVALID;
  if (!check_out(s, out, "meshd_session_call"))
    return MESHD_E_INVALID;
  if (!op || !*op || nargs > 32 || (nargs > 0 && !args)) {
    set_error(s->client, MESHD_E_INVALID, 0, NULL,
              "meshd_session_call: need an op name and at most 32 arguments");
    return MESHD_E_INVALID;
  }
  Meshd__V1__Arg a[32];
  Meshd__V1__Arg *pa[32];
  for (size_t i = 0; i < nargs; i++) {
    meshd__v1__arg__init(&a[i]);
    switch (args[i].type) {
    case MESHD_ARG_REF:
      char what[32];
      snprintf(what, sizeof what, "argument %zu", i);
      if (!own_ref(s, "meshd_session_call", what, -1, args[i].ref))
        return MESHD_E_INVALID;
      a[i].value_case = MESHD__V1__ARG__VALUE_REF;
      a[i].ref = args[i].ref;
      break;
    case MESHD_ARG_INT:
      a[i].value_case = MESHD__V1__ARG__VALUE_I;
      a[i].i = args[i].i;
      break;
    case MESHD_ARG_FLOAT:
      a[i].value_case = MESHD__V1__ARG__VALUE_F;
      a[i].f = args[i].f;
      break;
    default:
      set_error(s->client, MESHD_E_INVALID, 0, NULL, "meshd_session_call: argument %zu: bad type",
                i);
      return MESHD_E_INVALID;
    }
    pa[i] = &a[i];
  }
  uint64_t result = s->next_ref;
  Meshd__V1__Call c = MESHD__V1__CALL__INIT;
  c.op = (char *)op;
  c.n_args = nargs;
  c.args = pa;
  c.n_results = 1;
  c.results = &result;
  Meshd__V1__Command cmd = MESHD__V1__COMMAND__INIT;
  cmd.kind_case = MESHD__V1__COMMAND__KIND_CALL;
  cmd.call = &c;
  return execute_new(s, &cmd, out);
}

static meshd_err_t reduce_cmd(meshd_session_t *s, const char *fn, meshd_ref_t input,
                              const char *const *dims, size_t ndims, const char *reduction,
                              const meshd_reduce_options_t *o, meshd_ref_t *out) {
  if (!s)
    return MESHD_E_INVALID;
  if (!check_out(s, out, fn))
    return MESHD_E_INVALID;
  if (!reduction || !*reduction) {
    set_error(s->client, MESHD_E_INVALID, 0, NULL, "%s: reduction is empty", fn);
    return MESHD_E_INVALID;
  }
  if (ndims && !dims) {
    set_error(s->client, MESHD_E_INVALID, 0, NULL, "%s: dims is NULL with ndims %zu", fn, ndims);
    return MESHD_E_INVALID;
  }
  for (size_t i = 0; i < ndims; i++)
    if (!dims[i] || !*dims[i]) {
      set_error(s->client, MESHD_E_INVALID, 0, NULL, "%s: dims[%zu] is %s", fn, i,
                dims[i] ? "empty" : "NULL");
      return MESHD_E_INVALID;
    }
  if (!own_ref(s, fn, "input", -1, input) || !own_ref(s, fn, "mesh", -1, o->mesh) ||
      !own_ref(s, fn, "out", -1, o->out) || !own_ref(s, fn, "stream", -1, o->stream))
    return MESHD_E_INVALID;
  /* Into out, or into the input: the result is a tensor the caller holds, so
   * no ref is made (ref 0: the server's answer names that tensor). The server
   * checks the pair (its kinds and messages are the ones to pass on). */
  bool into = o->out || o->inplace;
  Meshd__V1__Reduce r = MESHD__V1__REDUCE__INIT;
  r.ref = into ? 0 : s->next_ref;
  r.input = input;
  r.reduction = (char *)reduction;
  r.mesh = o->mesh;
  r.out = o->out;
  r.inplace = o->inplace;
  r.scatter = o->scatter;
  r.stream = o->stream;
  r.n_dims = ndims;
  r.dims = (char **)dims;
  Meshd__V1__Command cmd = MESHD__V1__COMMAND__INIT;
  cmd.kind_case = MESHD__V1__COMMAND__KIND_REDUCE;
  cmd.reduce = &r;
  if (!into)
    return execute_new(s, &cmd, out);
  meshd_err_t ret = execute(s, &cmd);
  if (ret == MESHD_E_OK)
    *out = o->inplace ? input : o->out;
  return ret;
}

meshd_err_t meshd_session_reduce(meshd_session_t *s, meshd_ref_t input, const char *dim,
                                 const char *reduction, meshd_ref_t *out) {
  const char *dims[1] = {dim};
  const meshd_reduce_options_t o = MESHD_REDUCE_OPTIONS_INIT;
  return reduce_cmd(s, "meshd_session_reduce", input, dims, dim && *dim ? 1 : 0, reduction, &o,
                    out);
}

meshd_err_t meshd_session_reduce_onto(meshd_session_t *s, meshd_ref_t input, const char *dim,
                                      const char *reduction, meshd_ref_t mesh, meshd_ref_t *out) {
  if (s && !mesh) {
    set_error(s->client, MESHD_E_INVALID, 0, NULL, "meshd_session_reduce_onto: mesh is 0");
    return MESHD_E_INVALID;
  }
  const char *dims[1] = {dim};
  const meshd_reduce_options_t o = {.mesh = mesh};
  return reduce_cmd(s, "meshd_session_reduce_onto", input, dims, dim && *dim ? 1 : 0, reduction,
                    &o, out);
}

meshd_err_t meshd_session_reduce_dims(meshd_session_t *s, meshd_ref_t input,
                                      const char *const *dims, size_t ndims,
                                      const char *reduction, meshd_ref_t mesh, meshd_ref_t *out) {
  const meshd_reduce_options_t o = {.mesh = mesh};
  return reduce_cmd(s, "meshd_session_reduce_dims", input, dims, ndims, reduction, &o, out);
}

meshd_err_t meshd_session_reduce_with(meshd_session_t *s, meshd_ref_t input,
                                      const char *const *dims, size_t ndims,
                                      const char *reduction, const meshd_reduce_options_t *opts,
                                      meshd_ref_t *result) {
  const meshd_reduce_options_t none = MESHD_REDUCE_OPTIONS_INIT;
  return reduce_cmd(s, "meshd_session_reduce_with", input, dims, ndims, reduction,
                    opts ? opts : &none, result);
}

meshd_err_t meshd_session_stream(meshd_session_t *s, const char *name, meshd_ref_t *out) {
  if (!s)
    return MESHD_E_INVALID;
  if (!check_out(s, out, "meshd_session_stream"))
    return MESHD_E_INVALID;
  if (!name || !*name) {
    set_error(s->client, MESHD_E_INVALID, 0, NULL, "meshd_session_stream: name is empty");
    return MESHD_E_INVALID;
  }
  Meshd__V1__CreateStream cs = MESHD__V1__CREATE_STREAM__INIT;
  cs.ref = s->next_ref;
  cs.name = (char *)name;
  Meshd__V1__Command cmd = MESHD__V1__COMMAND__INIT;
  cmd.kind_case = MESHD__V1__COMMAND__KIND_CREATE_STREAM;
  cmd.create_stream = &cs;
  return execute_new(s, &cmd, out);
}

/* Drop or Release of refs[0..n). */
static meshd_err_t refs_command(meshd_session_t *s, const meshd_ref_t *refs, size_t n,
                                bool release, const char *fn) {
  if (!s)
    return MESHD_E_INVALID;
  if (n && !refs) {
    set_error(s->client, MESHD_E_INVALID, 0, NULL, "%s: refs is NULL", fn);
    return MESHD_E_INVALID;
  }
  if (!own_refs(s, fn, "refs", refs, n))
    return MESHD_E_INVALID;
  Meshd__V1__Drop d = MESHD__V1__DROP__INIT;
  Meshd__V1__Release r = MESHD__V1__RELEASE__INIT;
  Meshd__V1__Command cmd = MESHD__V1__COMMAND__INIT;
  if (release) {
    r.refs = (uint64_t *)refs;
    r.n_refs = n;
    cmd.kind_case = MESHD__V1__COMMAND__KIND_RELEASE;
    cmd.release = &r;
  } else {
    d.refs = (uint64_t *)refs;
    d.n_refs = n;
    cmd.kind_case = MESHD__V1__COMMAND__KIND_DROP;
    cmd.drop = &d;
  }
  return execute(s, &cmd);
}

meshd_err_t meshd_session_drop(meshd_session_t *s, const meshd_ref_t *refs, size_t n) {
  return refs_command(s, refs, n, false, "meshd_session_drop");
}

meshd_err_t meshd_session_release(meshd_session_t *s, const meshd_ref_t *refs, size_t n) {
  return refs_command(s, refs, n, true, "meshd_session_release");
}

meshd_err_t meshd_session_to_mesh(meshd_session_t *s, meshd_ref_t input, meshd_ref_t mesh,
                                  meshd_ref_t *out) {
  if (!s)
    return MESHD_E_INVALID;
  if (!check_out(s, out, "meshd_session_to_mesh"))
    return MESHD_E_INVALID;
  if (!own_ref(s, "meshd_session_to_mesh", "input", -1, input) ||
      !own_ref(s, "meshd_session_to_mesh", "mesh", -1, mesh))
    return MESHD_E_INVALID;
  Meshd__V1__ToMesh t = MESHD__V1__TO_MESH__INIT;
  t.ref = s->next_ref;
  t.input = input;
  t.dst_mesh = mesh;
  Meshd__V1__Command cmd = MESHD__V1__COMMAND__INIT;
  cmd.kind_case = MESHD__V1__COMMAND__KIND_TO_MESH;
  cmd.to_mesh = &t;
  return execute_new(s, &cmd, out);
}

meshd_err_t meshd_session_borrow(meshd_session_t *s, meshd_ref_t input, meshd_ref_t stream,
                                 bool is_mutable, meshd_ref_t *handle, meshd_ref_t *borrow) {
  if (!s)
    return MESHD_E_INVALID;
  if (!check_out(s, handle, "meshd_session_borrow") || !check_out(s, borrow, "meshd_session_borrow"))
    return MESHD_E_INVALID;
  if (!own_ref(s, "meshd_session_borrow", "input", -1, input) ||
      !own_ref(s, "meshd_session_borrow", "stream", -1, stream))
    return MESHD_E_INVALID;
  Meshd__V1__Borrow b = MESHD__V1__BORROW__INIT;
  b.ref = s->next_ref;
  b.borrow = s->next_ref + 1;
  b.input = input;
  b.stream = stream;
  b.mutable_ = is_mutable;
  Meshd__V1__Command cmd = MESHD__V1__COMMAND__INIT;
  cmd.kind_case = MESHD__V1__COMMAND__KIND_BORROW;
  cmd.borrow = &b;
  meshd_err_t ret = execute(s, &cmd);
  if (ret == MESHD_E_OK) {
    *handle = s->next_ref;
    *borrow = s->next_ref + 1;
  }
  refs_taken(s, ret, 2);
  return ret;
}

meshd_err_t meshd_session_drop_borrow(meshd_session_t *s, meshd_ref_t borrow) {
  if (!s)
    return MESHD_E_INVALID;
  if (!own_ref(s, "meshd_session_drop_borrow", "borrow", -1, borrow))
    return MESHD_E_INVALID;
  Meshd__V1__DropBorrow d = MESHD__V1__DROP_BORROW__INIT;
  d.borrow = borrow;
  Meshd__V1__Command cmd = MESHD__V1__COMMAND__INIT;
  cmd.kind_case = MESHD__V1__COMMAND__KIND_DROP_BORROW;
  cmd.drop_borrow = &d;
  return execute(s, &cmd);
}

#define UPLOAD_CHUNK (1u << 20)

const char *meshd_data_path_name(meshd_data_path_t path) {
  switch (path) {
  case MESHD_DATA_PATH_AUTO:
    return "auto";
  case MESHD_DATA_PATH_DIRECT:
    return "direct";
  case MESHD_DATA_PATH_PROXY:
    return "proxy";
  }
  return "unknown";
}

meshd_err_t meshd_data_path_parse(const char *name, meshd_data_path_t *out) {
  static const meshd_data_path_t all[] = {MESHD_DATA_PATH_AUTO, MESHD_DATA_PATH_DIRECT,
                                          MESHD_DATA_PATH_PROXY};
  for (size_t i = 0; name && out && i < sizeof all / sizeof all[0]; i++)
    if (strcmp(name, meshd_data_path_name(all[i])) == 0) {
      *out = all[i];
      return MESHD_E_OK;
    }
  return MESHD_E_INVALID;
}

meshd_err_t meshd_session_set_data_path(meshd_session_t *s, meshd_data_path_t path) {
  if (!s)
    return MESHD_E_INVALID;
  if (path != MESHD_DATA_PATH_AUTO && path != MESHD_DATA_PATH_DIRECT &&
      path != MESHD_DATA_PATH_PROXY) {
    set_error(s->client, MESHD_E_INVALID, 0, NULL,
              "meshd_session_set_data_path: %d is not a data path (expected "
              "MESHD_DATA_PATH_AUTO, _DIRECT or _PROXY)", (int)path);
    return MESHD_E_INVALID;
  }
  direct_set_mode(s->direct, path);
  return MESHD_E_OK;
}

meshd_err_t meshd_session_transfer_stats(const meshd_session_t *s, meshd_transfer_stats_t *out) {
  if (!s)
    return MESHD_E_INVALID;
  if (!out) {
    set_error(s->client, MESHD_E_INVALID, 0, NULL, "meshd_session_transfer_stats: out is NULL");
    return MESHD_E_INVALID;
  }
  direct_stats(s->direct, out);
  return MESHD_E_OK;
}

/* What direct.c needs of the session. */
static direct_session_t session_view(const meshd_session_t *s, int timeout_ms) {
  return (direct_session_t){.ch = s->client->ch, .md = s->md, .nmd = s->nmd, .id = s->id,
                            .timeout_ms = timeout_ms > 0 ? timeout_ms : s->client->timeout_ms,
                            .tls = s->client->tls, .next_seq = &s->next_seq};
}

/* A per_rank upload's bytes per rank (0: replicated, or unknown): its
 * chunks end where a rank's slice ends, so the server sends each on to its
 * agent as it came (a chunk across two slices is split and copied there, and
 * a small tensor's slices go one after another instead of at once). */
static size_t upload_slice_bytes(const Meshd__V1__UploadHeader *h) {
  if (!h->per_rank)
    return 0;
  uint64_t b = direct_dtype_bytes(h->dtype);
  for (size_t i = 0; i < h->n_shape && b; i++) {
    if (h->shape[i] < 0 || (h->shape[i] && b > UINT64_MAX / (uint64_t)h->shape[i]))
      return 0;
    b *= (uint64_t)h->shape[i];
  }
  return b <= SIZE_MAX ? (size_t)b : 0;
}

/* The next chunk's bytes at off of `bytes`: at most `chunk`, and not past the
 * end of the slice (of `slice` bytes; 0: none) it starts in. */
static size_t upload_chunk_bytes(size_t off, size_t bytes, size_t slice, size_t chunk) {
  size_t n = bytes - off < chunk ? bytes - off : chunk;
  if (slice) {
    size_t to_end = slice - off % slice;
    if (to_end < n)
      n = to_end;
  }
  return n;
}

/* The proxied Upload of header h, within timeout_ms. */
static meshd_err_t proxy_upload(meshd_session_t *s, Meshd__V1__UploadHeader *h, const void *data,
                                size_t bytes, int timeout_ms) {
  Meshd__V1__UploadChunk first = MESHD__V1__UPLOAD_CHUNK__INIT;
  first.part_case = MESHD__V1__UPLOAD_CHUNK__PART_HEADER;
  first.header = h;
  rpc_stream_t *st = rpc_stream_open(s->client->ch, TS "Upload", s->md, s->nmd, timeout_ms);
  if (!st) {
    set_error(s->client, MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL, "Upload: cannot open the call");
    return MESHD_E_RPC;
  }
  int rc = rpc_stream_write(st, &first.base, bytes == 0);
  size_t slice = upload_slice_bytes(h);
  for (size_t off = 0, n; rc == 0 && off < bytes; off += n) {
    n = upload_chunk_bytes(off, bytes, slice, UPLOAD_CHUNK);
    Meshd__V1__UploadChunk c = MESHD__V1__UPLOAD_CHUNK__INIT;
    c.part_case = MESHD__V1__UPLOAD_CHUNK__PART_DATA;
    c.data.data = (uint8_t *)data + off;
    c.data.len = n;
    /* The last chunk half-closes with it: one write, not a second one that
     * waits for the first to go out. */
    rc = rpc_stream_write(st, &c.base, off + n == bytes);
  }
  ProtobufCMessage *m = NULL;
  while (rpc_stream_read(st, &meshd__v1__upload_reply__descriptor, &m, timeout_ms) == 1) {
    protobuf_c_message_free_unpacked(m, NULL);
    m = NULL;
  }
  rpc_status_t status;
  meshd_err_t ret = MESHD_E_OK;
  if (rpc_stream_finish(st, &status) != GRPC_STATUS_OK) {
    char msg[sizeof status.message + 16];
    snprintf(msg, sizeof msg, "Upload: %s", status.message);
    ret = set_status(s->client, status.code, status.kind, msg); /* a deadline: _DEADLINE */
  }
  rpc_stream_destroy(st);
  return ret;
}

meshd_err_t meshd_session_upload(meshd_session_t *s, meshd_ref_t mesh, const char *dtype,
                                 const int64_t *shape, size_t ndim, const void *data,
                                 size_t bytes, meshd_ref_t *out) {
  return meshd_session_upload_with(s, mesh, dtype, shape, ndim, data, bytes, NULL, out);
}

/* The arguments of an upload or a Literal (fn names it): *dt gets the dtype,
 * *opts the defaults when NULL. */
static bool check_tensor_args(meshd_session_t *s, const char *fn, meshd_ref_t mesh,
                              const char *dtype, const int64_t *shape, size_t ndim,
                              const void *data, size_t bytes, meshd_ref_t *out,
                              const meshd_upload_options_t **opts, int *dt) {
  static const meshd_upload_options_t defaults = MESHD_UPLOAD_OPTIONS_INIT;
  if (!*opts)
    *opts = &defaults;
  if (!check_out(s, out, fn))
    return false;
  *dt = dtype ? dtype_by_name(dtype) : 0;
  if (!*dt || (ndim && !shape) || (bytes && !data) || ndim > 16) {
    set_error(s->client, MESHD_E_INVALID, 0, !*dt ? "BAD_ARGUMENT" : NULL,
              "%s: need a known dtype (got '%s'), at most 16 dims with a shape, and data for %zu "
              "bytes", fn, dtype ? dtype : "(null)", bytes);
    return false;
  }
  return own_ref(s, fn, "mesh", -1, mesh) && own_ref(s, fn, "opts->stream", -1, (*opts)->stream);
}

/* Lets go of the tensor of an upload the caller was told failed, which holds
 * no ref to free it with: a direct upload's that the server defined all the
 * same (drop: it is live), or a proxied upload's whose answer may have been
 * lost (release: skipped by the server when the ref is not live). Best effort,
 * within the cleanup time left until `end`; the upload's error stays the last
 * one. */
static void let_go_stray(meshd_session_t *s, uint64_t ref, int64_t end, bool drop) {
  saved_error_t saved;
  error_save(s->client, &saved);
  Meshd__V1__Drop d = MESHD__V1__DROP__INIT;
  Meshd__V1__Release r = MESHD__V1__RELEASE__INIT;
  Meshd__V1__Command cmd = MESHD__V1__COMMAND__INIT;
  if (drop) {
    d.refs = &ref;
    d.n_refs = 1;
    cmd.kind_case = MESHD__V1__COMMAND__KIND_DROP;
    cmd.drop = &d;
  } else {
    r.refs = &ref;
    r.n_refs = 1;
    cmd.kind_case = MESHD__V1__COMMAND__KIND_RELEASE;
    cmd.release = &r;
  }
  execute_timeout(s, &cmd, direct_cleanup_ms(end));
  error_restore(s->client, &saved);
}

meshd_err_t meshd_session_upload_with(meshd_session_t *s, meshd_ref_t mesh, const char *dtype,
                                      const int64_t *shape, size_t ndim, const void *data,
                                      size_t bytes, const meshd_upload_options_t *opts,
                                      meshd_ref_t *out) {
  int dt = 0;
  if (!s || !check_tensor_args(s, "meshd_session_upload", mesh, dtype, shape, ndim, data, bytes, out,
                               &opts, &dt))
    return MESHD_E_INVALID;
  /* One deadline for the whole upload: the queued commands' answers, a
   * fallback to the proxy included. */
  int64_t end = rpc_now_ms() + s->client->timeout_ms;
  meshd_err_t ret = sync_point(s, 0); /* the upload's ref comes after the queued ones' */
  if (ret != MESHD_E_OK)
    return ret;
  Meshd__V1__UploadHeader h = MESHD__V1__UPLOAD_HEADER__INIT;
  h.ref = s->next_ref;
  h.mesh = mesh;
  h.stream = opts->stream;
  h.shape = (int64_t *)shape;
  h.n_shape = ndim;
  h.dtype = (Meshd__V1__DType)dt;
  h.per_rank = opts->per_rank;
  h.total_bytes = bytes;
  int64_t left = end - rpc_now_ms();
  direct_session_t view = session_view(s, left < 1 ? 1 : (int)left);
  const struct mesh_info *mi = mesh_find(s, mesh);
  if (mi && mi->rank_ids) { /* the plan's shards are checked against them */
    view.mesh_ranks = mi->rank_ids;
    view.n_mesh_ranks = (size_t)mi->ranks;
  }
  direct_err_t e = {0};
  bool spent = false, defined = false;
  direct_rc_t rc = direct_upload(s->direct, &view, &h, data, bytes, &spent, &defined, &e);
  if (spent) /* the plan claimed the ref, done or not: nothing else may take it */
    s->next_ref++;
  left = end - rpc_now_ms();
  if (rc == DIRECT_FAILED && spent && !defined && direct_late_grant(&e) && left > 0) {
    /* The Writes started past their grants' start-by time (this process was
     * paused between plan and Write): nothing was stored, the plan was given
     * back. Planned once more, with a new ref (the plan claimed this one). */
    h.ref = s->next_ref;
    view.timeout_ms = (int)left;
    view.replan = true;
    e = (direct_err_t){0};
    rc = direct_upload(s->direct, &view, &h, data, bytes, &spent, &defined, &e);
    if (spent)
      s->next_ref++;
  }
  if (rc == DIRECT_FAILED) {
    if (defined)
      let_go_stray(s, h.ref, end, true);
    return record(s->client, &e);
  }
  if (rc == DIRECT_PROXY) {
    left = end - rpc_now_ms();
    if (left <= 0) {
      set_error(s->client, MESHD_E_DEADLINE, GRPC_STATUS_DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED",
                "Upload: the deadline passed before the proxied upload could start (the direct "
                "path was tried first and fell back)");
      return MESHD_E_DEADLINE;
    }
    h.ref = s->next_ref;
    ret = proxy_upload(s, &h, data, bytes, (int)left);
    /* A failed Upload whose Writes had opened spends its ref (the server says
     * so); the next call takes a later one either way (refs may skip). */
    s->next_ref++;
    if (ret != MESHD_E_OK) {
      /* No status of the server's own (a deadline, a dropped connection): it
       * may have defined the tensor and its answer been lost. */
      if (ret == MESHD_E_DEADLINE || !s->client->kind[0])
        let_go_stray(s, h.ref, end, false);
      return ret;
    }
    direct_count_proxy(s->direct, true);
  }
  *out = h.ref;
  return MESHD_E_OK;
}

meshd_err_t meshd_session_literal(meshd_session_t *s, meshd_ref_t mesh, const char *dtype,
                                  const int64_t *shape, size_t ndim, const void *data,
                                  size_t bytes, const meshd_upload_options_t *opts,
                                  meshd_ref_t *out) {
  int dt = 0;
  if (!s || !check_tensor_args(s, "meshd_session_literal", mesh, dtype, shape, ndim, data, bytes, out,
                               &opts, &dt))
    return MESHD_E_INVALID;
  uint64_t sent = literal_sent(s, mesh, opts->per_rank, bytes);
  if (bytes > MESHD_LITERAL_MAX_BYTES || sent > MESHD_LITERAL_MAX_SENT_BYTES) {
    set_error(s->client, MESHD_E_INVALID, 0, NULL,
              "meshd_session_literal: %zu bytes (%llu to the mesh's ranks in all) are more than a "
              "Literal carries (%u bytes, %u over the ranks); upload them with "
              "meshd_session_upload_with", bytes, (unsigned long long)sent,
              MESHD_LITERAL_MAX_BYTES, MESHD_LITERAL_MAX_SENT_BYTES);
    return MESHD_E_INVALID;
  }
  if (meshd_session_literals(s, mesh)) {
    Meshd__V1__Literal l = MESHD__V1__LITERAL__INIT;
    l.ref = s->next_ref;
    l.mesh = mesh;
    l.stream = opts->stream;
    l.shape = (int64_t *)shape;
    l.n_shape = ndim;
    l.dtype = (Meshd__V1__DType)dt;
    l.per_rank = opts->per_rank;
    l.data = (ProtobufCBinaryData){bytes, (uint8_t *)data};
    Meshd__V1__Command cmd = MESHD__V1__COMMAND__INIT;
    cmd.kind_case = MESHD__V1__COMMAND__KIND_LITERAL;
    cmd.literal = &l;
    saved_error_t saved;
    error_save(s->client, &saved); /* a refusal followed by a good upload is no error */
    meshd_err_t ret = execute_new(s, &cmd, out);
    /* An agent older than Literal joined a mesh: this session uploads from now
     * on (a pipelined refusal comes at the next call that needs an answer,
     * which turns them off the same way: sync_point). */
    if (ret != MESHD_E_RPC || strcmp(s->client->kind, "UNAVAILABLE") != 0 ||
        !strstr(s->client->message, "predates the Literal"))
      return ret;
    s->literals = false;
    ret = meshd_session_upload_with(s, mesh, dtype, shape, ndim, data, bytes, opts, out);
    if (ret == MESHD_E_OK)
      error_restore(s->client, &saved);
    return ret;
  }
  return meshd_session_upload_with(s, mesh, dtype, shape, ndim, data, bytes, opts, out);
}

meshd_err_t meshd_session_sync_timeout(meshd_session_t *s, int timeout_ms) {
  if (!s)
    return MESHD_E_INVALID;
  Meshd__V1__Sync sy = MESHD__V1__SYNC__INIT;
  Meshd__V1__Command cmd = MESHD__V1__COMMAND__INIT;
  cmd.kind_case = MESHD__V1__COMMAND__KIND_SYNC;
  cmd.sync = &sy;
  return execute_timeout(s, &cmd, timeout_ms);
}

meshd_err_t meshd_session_sync(meshd_session_t *s) { return meshd_session_sync_timeout(s, 0); }

void meshd_values_free(meshd_values_t *v) {
  if (!v)
    return;
  free(v->values);
  free(v->shape);
  memset(v, 0, sizeof *v);
}

static size_t dtype_size(int dt) {
  switch (dt) {
  case MESHD__V1__DTYPE__DTYPE_FLOAT64:
  case MESHD__V1__DTYPE__DTYPE_INT64:
    return 8;
  case MESHD__V1__DTYPE__DTYPE_FLOAT32:
  case MESHD__V1__DTYPE__DTYPE_INT32:
    return 4;
  case MESHD__V1__DTYPE__DTYPE_INT16:
  case MESHD__V1__DTYPE__DTYPE_FLOAT16:
  case MESHD__V1__DTYPE__DTYPE_BFLOAT16:
    return 2;
  case MESHD__V1__DTYPE__DTYPE_INT8:
  case MESHD__V1__DTYPE__DTYPE_UINT8:
  case MESHD__V1__DTYPE__DTYPE_BOOL:
    return 1;
  default:
    return 0;
  }
}

/* IEEE half and bfloat16 (little-endian bits) as doubles: exact. */
static double half_value(uint16_t h) {
  int exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  double v = exp == 0    ? ldexp(man, -24)
             : exp == 31 ? (man ? NAN : INFINITY)
                         : ldexp(man | 0x400, exp - 25);
  return h & 0x8000 ? -v : v;
}

static double bfloat16_value(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static double load_value(int dt, const uint8_t *p) {
  uint16_t bits = (uint16_t)(p[0] | p[1] << 8);
  switch (dt) {
  case MESHD__V1__DTYPE__DTYPE_FLOAT16: return half_value(bits);
  case MESHD__V1__DTYPE__DTYPE_BFLOAT16: return bfloat16_value(bits);
  case MESHD__V1__DTYPE__DTYPE_FLOAT64: { double v; memcpy(&v, p, 8); return v; }
  case MESHD__V1__DTYPE__DTYPE_FLOAT32: { float v; memcpy(&v, p, 4); return v; }
  case MESHD__V1__DTYPE__DTYPE_INT64: { int64_t v; memcpy(&v, p, 8); return (double)v; }
  case MESHD__V1__DTYPE__DTYPE_INT32: { int32_t v; memcpy(&v, p, 4); return v; }
  case MESHD__V1__DTYPE__DTYPE_INT16: { int16_t v; memcpy(&v, p, 2); return v; }
  case MESHD__V1__DTYPE__DTYPE_INT8: return (int8_t)*p;
  default: return *p; /* uint8, bool */
  }
}

meshd_err_t meshd_session_fetch(meshd_session_t *s, meshd_ref_t tensor, const char *const *dims,
                                const int64_t *index, size_t ncoords, meshd_values_t *out) {
  return meshd_session_fetch_timeout(s, tensor, dims, index, ncoords, 0, out);
}

meshd_err_t meshd_session_fetch_timeout(meshd_session_t *s, meshd_ref_t tensor,
                                        const char *const *dims, const int64_t *index,
                                        size_t ncoords, int timeout_ms, meshd_values_t *out) {
  meshd_fetch_options_t o = MESHD_FETCH_OPTIONS_INIT;
  o.timeout_ms = timeout_ms;
  return meshd_session_fetch_with(s, tensor, dims, index, ncoords, &o, out);
}

/* Whether a data chunk of len bytes may come now: after the meta, within
 * the bytes it describes. False having set e. */
static bool fetch_data_fits(direct_err_t *e, bool have_meta, uint64_t got, uint64_t want,
                            size_t len) {
  if (!len || (have_meta && got + len <= want)) return true;
  direct_err_set(e, MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL, "Fetch: %s",
                 have_meta ? "more bytes than the TensorMeta describes"
                           : "data before the TensorMeta");
  return false;
}

/* Proxied Fetches of n local tensors, each into its sink, read at once
 * (direct_pull_all). */
typedef struct {
  const direct_sink_t *k;
  direct_err_t *e;
  bool have_meta;
  uint64_t want, got;
} proxy_part_t;

typedef struct {
  proxy_part_t *parts;
  int timeout_ms;
} proxy_fetch_t;

/* A message of part i: a data chunk's bytes go to the sink from where they
 * lie in the message, the one copy; the rest (the meta) is unpacked.
 * Non-zero stops the part. */
static int proxy_msg(void *arg, size_t i, rpc_bytes_t *raw) {
  proxy_part_t *p = &((proxy_fetch_t *)arg)->parts[i];
  const direct_sink_t *k = p->k;
  direct_err_t *e = p->e;
  size_t len = 0;
  bool stop = false;
  if (rpc_bytes_is_field(raw, MESHD__V1__FETCH_CHUNK__PART_DATA, &len)) {
    stop = !fetch_data_fits(e, p->have_meta, p->got, p->want, len) ||
           (len && direct_sink_field(k, raw, e) != 0);
    p->got += len;
    return stop;
  }
  ProtobufCMessage *m = rpc_bytes_unpack(raw, &meshd__v1__fetch_chunk__descriptor);
  const Meshd__V1__FetchChunk *ch = (const Meshd__V1__FetchChunk *)m;
  if (!m) {
    direct_err_set(e, MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL,
                   "Fetch: the server sent a message that is not a FetchChunk");
    return 1;
  }
  if (ch->part_case == MESHD__V1__FETCH_CHUNK__PART_META && ch->meta && !p->have_meta) {
    p->have_meta = true;
    if (!direct_meta_bytes(ch->meta, &p->want)) {
      direct_err_set(e, MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL,
                     "Fetch: the server's shape holds more than 2^64 bytes");
      stop = true;
    } else {
      stop = k->begin(k->arg, ch->meta, e) != 0;
    }
  } else if (ch->part_case == MESHD__V1__FETCH_CHUNK__PART_DATA) { /* with other fields */
    stop = !fetch_data_fits(e, p->have_meta, p->got, p->want, ch->data.len) ||
           (ch->data.len && k->data(k->arg, ch->data.data, ch->data.len, e) != 0);
    p->got += ch->data.len;
  }
  protobuf_c_message_free_unpacked(m, NULL);
  return stop;
}

/* How part i's Fetch ended; the first error of the part stands. */
static void proxy_end(void *arg, size_t i, grpc_status_code code, const rpc_status_t *st) {
  proxy_fetch_t *f = arg;
  proxy_part_t *p = &f->parts[i];
  direct_err_t *e = p->e;
  if (e->err != MESHD_E_OK) /* a part its message stopped: its error is set already */
    return;
  if (code == GRPC_STATUS_DEADLINE_EXCEEDED) {
    direct_err_set(e, MESHD_E_DEADLINE, GRPC_STATUS_DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED",
                   "Fetch: no answer within %d ms", f->timeout_ms);
  } else if (code != GRPC_STATUS_OK) {
    rpc_status_t rs = *st;
    rs.kind[sizeof rs.kind - 1] = '\0';
    rs.message[sizeof rs.message - 1] = '\0';
    direct_err_status(e, &rs, "");
  } else if (!p->have_meta) {
    direct_err_set(e, MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL, "Fetch: no metadata in the reply");
  } else if (p->got != p->want) {
    direct_err_set(e, MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL,
                   "Fetch: got %llu bytes where the TensorMeta needs %llu",
                   (unsigned long long)p->got, (unsigned long long)p->want);
  }
}

/* Every part's proxied Fetch at once; errs[i] says how part i ended. */
static int proxy_fetch_all(meshd_session_t *s, const Meshd__V1__FetchRequest *const *reqs,
                           const direct_sink_t *sinks, size_t n, int timeout_ms,
                           direct_err_t *errs) {
  proxy_fetch_t f = {calloc(n, sizeof(proxy_part_t)), timeout_ms};
  direct_call_t *calls = calloc(n, sizeof *calls);
  if (!f.parts || !calls) {
    free(f.parts);
    free(calls);
    return -1;
  }
  for (size_t i = 0; i < n; i++) {
    f.parts[i] = (proxy_part_t){.k = &sinks[i], .e = &errs[i]};
    calls[i] = (direct_call_t){s->client->ch, TS "Fetch", &reqs[i]->base, s->md, s->nmd};
  }
  direct_pull_all(n, calls, timeout_ms, proxy_msg, proxy_end, &f);
  free(calls);
  free(f.parts);
  return 0;
}

/* A proxied fetch's failure names the parts that failed, by their coordinates
 * (the server's message may not: a deadline is the client's own): e holds the
 * first failure; " (the local tensor at gpu=1)", or with several failed,
 * " (the local tensors at gpu=0; gpu=1)". */
static void name_parts(direct_err_t *e, const Meshd__V1__FetchRequest *const *reqs,
                       const direct_err_t *errs, size_t n) {
  char where[256] = "";
  size_t k = 0, failed = 0;
  for (size_t p = 0; p < n && k < sizeof where; p++) {
    if (errs[p].err == MESHD_E_OK) continue;
    const Meshd__V1__FetchRequest *r = reqs[p];
    if (failed++) k += (size_t)snprintf(where + k, sizeof where - k, "; ");
    for (size_t i = 0; i < r->n_coords && k < sizeof where; i++)
      k += (size_t)snprintf(where + k, sizeof where - k, "%s%s=%lld", i ? "," : "",
                            r->coords[i]->dim ? r->coords[i]->dim : "",
                            (long long)r->coords[i]->index);
  }
  size_t len = strlen(e->msg);
  if (k && len < sizeof e->msg)
    snprintf(e->msg + len, sizeof e->msg - len, " (the local tensor%s at %s)",
             failed > 1 ? "s" : "", where);
}

/* n local tensors into their sinks by the session's data path, in parallel;
 * the first failure is recorded on the client. */
static meshd_err_t fetch_parts(meshd_session_t *s, const Meshd__V1__FetchRequest *const *reqs,
                               const direct_sink_t *sinks, size_t n, int timeout_ms) {
  if (timeout_ms <= 0)
    timeout_ms = s->client->timeout_ms;
  int64_t end = rpc_now_ms() + timeout_ms; /* one deadline for the whole fetch */
  meshd_err_t ret = sync_point(s, timeout_ms); /* the tensor may be a queued command's */
  if (ret != MESHD_E_OK)
    return ret;
  direct_session_t view = session_view(s, timeout_ms);
  direct_err_t e = {0};
  direct_rc_t rc = direct_fetch(s->direct, &view, reqs, sinks, n, end, &e);
  if (rc == DIRECT_PROXY) {
    int64_t left = end - rpc_now_ms(); /* one deadline for the whole fetch */
    timeout_ms = left < 1 ? 1 : (int)left;
    direct_err_t *errs = calloc(n, sizeof *errs);
    if (!errs) {
      set_error(s->client, MESHD_E_NOMEM, 0, NULL, "Fetch: out of memory");
      return MESHD_E_NOMEM;
    }
    /* The sinks start over at their next begin: a direct fetch that fell back
     * after its Reads (an agent's grant table full) may have begun them. */
    if (proxy_fetch_all(s, reqs, sinks, n, timeout_ms, errs) != 0)
      direct_err_set(&e, MESHD_E_NOMEM, 0, NULL, "Fetch: out of memory");
    for (size_t i = 0; i < n && e.err == MESHD_E_OK; i++)
      e = errs[i];
    if (e.err != MESHD_E_OK)
      name_parts(&e, reqs, errs, n);
    free(errs);
    if (e.err == MESHD_E_OK)
      for (size_t i = 0; i < n; i++)
        direct_count_proxy(s->direct, false);
  }
  return e.err == MESHD_E_OK ? MESHD_E_OK : record(s->client, &e);
}

/* The coordinates of a fetch as a FetchRequest (co, pco: 16 each). */
static bool fetch_request(meshd_session_t *s, meshd_ref_t tensor, const char *const *dims,
                          const int64_t *index, size_t ncoords, Meshd__V1__Coordinate *co,
                          Meshd__V1__Coordinate **pco, Meshd__V1__FetchRequest *req) {
  if (ncoords > 16 || (ncoords > 0 && (!dims || !index))) {
    set_error(s->client, MESHD_E_INVALID, 0, NULL,
              "meshd_session_fetch: need at most 16 coordinates with dims and indexes");
    return false;
  }
  if (!own_ref(s, "meshd_session_fetch", "tensor", -1, tensor))
    return false;
  for (size_t i = 0; i < ncoords; i++) {
    meshd__v1__coordinate__init(&co[i]);
    co[i].dim = (char *)dims[i];
    co[i].index = index[i];
    pco[i] = &co[i];
  }
  meshd__v1__fetch_request__init(req);
  req->ref = tensor;
  req->n_coords = ncoords;
  req->coords = pco;
  return true;
}

/* meshd_session_fetch's sink: converts to float64 as the bytes come. */
typedef struct {
  meshd_values_t *out;
  const meshd_fetch_options_t *opts;
  int dtype;
  size_t es;
  uint64_t total, done;
  uint8_t carry[8]; /* an element split between two pieces */
  size_t ncarry;
} values_sink_t;

static int values_begin(void *arg, const Meshd__V1__TensorMeta *meta, direct_err_t *e) {
  values_sink_t *v = arg;
  meshd_values_free(v->out); /* a second begin starts over (direct_sink_t) */
  v->done = 0;
  v->ncarry = 0;
  v->dtype = meta->dtype;
  v->es = dtype_size(meta->dtype);
  if (v->es == 0) {
    direct_err_set(e, MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL, "Fetch: unsupported dtype");
    return -1;
  }
  v->total = v->es;
  for (size_t i = 0; i < meta->n_shape; i++) {
    uint64_t d = meta->shape[i] > 0 ? (uint64_t)meta->shape[i] : 0;
    /* A shape no answer could fill (a server's error): one double per element
     * must stay addressable. */
    if (d && v->total > (SIZE_MAX / sizeof(double)) / d) {
      direct_err_set(e, MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL,
                     "Fetch: the tensor's shape is too large to hold here");
      return -1;
    }
    v->total *= d;
  }
  if (meta->n_shape > 0) {
    v->out->shape = malloc(meta->n_shape * sizeof *v->out->shape);
    if (!v->out->shape)
      goto nomem;
    memcpy(v->out->shape, meta->shape, meta->n_shape * sizeof *v->out->shape);
    v->out->ndim = meta->n_shape;
  }
  if (v->total > 0 && !(v->out->values = malloc(v->total / v->es * sizeof *v->out->values)))
    goto nomem;
  return 0;
nomem:
  direct_err_set(e, MESHD_E_NOMEM, 0, NULL, "Fetch: out of memory");
  return -1;
}

static int values_data(void *arg, const uint8_t *p, size_t n, direct_err_t *e) {
  (void)e;
  values_sink_t *v = arg;
  v->done += n;
  while (n > 0 && v->ncarry > 0) { /* finish the split element first */
    v->carry[v->ncarry++] = *p++;
    n--;
    if (v->ncarry == v->es) {
      v->out->values[v->out->n++] = load_value(v->dtype, v->carry);
      v->ncarry = 0;
    }
  }
  size_t whole = n / v->es;
  for (size_t i = 0; i < whole; i++)
    v->out->values[v->out->n++] = load_value(v->dtype, p + i * v->es);
  memcpy(v->carry, p + whole * v->es, n - whole * v->es);
  v->ncarry = n - whole * v->es;
  if (v->opts->progress && v->done < v->total)
    v->opts->progress(v->opts->progress_user, v->done, v->total);
  return 0;
}

meshd_err_t meshd_session_fetch_with(meshd_session_t *s, meshd_ref_t tensor,
                                     const char *const *dims, const int64_t *index,
                                     size_t ncoords, const meshd_fetch_options_t *opts,
                                     meshd_values_t *out) {
  static const meshd_fetch_options_t defaults = MESHD_FETCH_OPTIONS_INIT;
  if (!opts)
    opts = &defaults;
  if (!s)
    return MESHD_E_INVALID;
  if (!check_out(s, out, "meshd_session_fetch"))
    return MESHD_E_INVALID;
  memset(out, 0, sizeof *out);
  Meshd__V1__Coordinate co[16];
  Meshd__V1__Coordinate *pco[16];
  Meshd__V1__FetchRequest req;
  if (!fetch_request(s, tensor, dims, index, ncoords, co, pco, &req))
    return MESHD_E_INVALID;
  values_sink_t v = {.out = out, .opts = opts};
  direct_sink_t k = {values_begin, values_data, &v};
  const Meshd__V1__FetchRequest *reqs[1] = {&req};
  meshd_err_t ret = fetch_parts(s, reqs, &k, 1, opts->timeout_ms);
  if (ret != MESHD_E_OK)
    meshd_values_free(out);
  else if (opts->progress)
    opts->progress(opts->progress_user, v.total, v.total);
  return ret;
}

/* meshd_session_fetch_bytes's sink: the bytes into the part's buffer. */
typedef struct {
  meshd_fetch_part_t *part;
  size_t rank_hint; /* the part's index, for messages */
} bytes_sink_t;

static int bytes_begin(void *arg, const Meshd__V1__TensorMeta *meta, direct_err_t *e) {
  bytes_sink_t *b = arg;
  uint64_t total = 0;
  b->part->nbytes = 0; /* a second begin starts over (direct_sink_t) */
  if (direct_dtype_bytes(meta->dtype) == 0) {
    direct_err_set(e, MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL, "Fetch: unsupported dtype %d",
                   meta->dtype);
    return -1;
  }
  if (!direct_meta_bytes(meta, &total)) {
    direct_err_set(e, MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL,
                   "Fetch: the server's shape holds more than 2^64 bytes");
    return -1;
  }
  if (total > b->part->cap) {
    direct_err_set(e, MESHD_E_INVALID, 0, NULL,
                   "meshd_session_fetch_bytes: part %zu's local tensor is %llu bytes, its buffer "
                   "holds %zu", b->rank_hint, (unsigned long long)total, b->part->cap);
    return -1;
  }
  return 0;
}

static int bytes_data(void *arg, const uint8_t *p, size_t n, direct_err_t *e) {
  (void)e;
  bytes_sink_t *b = arg;
  memcpy((uint8_t *)b->part->buf + b->part->nbytes, p, n); /* begin checked the size */
  b->part->nbytes += n;
  return 0;
}

#define FETCH_WAVE 8 /* the server's --session-max-transfers by default */

meshd_err_t meshd_session_fetch_bytes(meshd_session_t *s, meshd_ref_t tensor,
                                      meshd_fetch_part_t *parts, size_t nparts,
                                      const meshd_fetch_options_t *opts) {
  if (!s)
    return MESHD_E_INVALID;
  if (!parts || nparts == 0 || nparts > 1024) {
    set_error(s->client, MESHD_E_INVALID, 0, NULL,
              "meshd_session_fetch_bytes: need 1 to 1024 parts (got %zu%s)", nparts,
              parts ? "" : ", parts is NULL");
    return MESHD_E_INVALID;
  }
  meshd_err_t ret = MESHD_E_NOMEM;
  Meshd__V1__Coordinate(*co)[16] = calloc(nparts, sizeof *co);
  Meshd__V1__Coordinate *(*pco)[16] = calloc(nparts, sizeof *pco);
  Meshd__V1__FetchRequest *req = calloc(nparts, sizeof *req);
  const Meshd__V1__FetchRequest **reqs = calloc(nparts, sizeof *reqs);
  bytes_sink_t *b = calloc(nparts, sizeof *b);
  direct_sink_t *k = calloc(nparts, sizeof *k);
  if (!co || !pco || !req || !reqs || !b || !k) {
    set_error(s->client, MESHD_E_NOMEM, 0, NULL, "meshd_session_fetch_bytes: out of memory");
    goto out;
  }
  for (size_t i = 0; i < nparts; i++) {
    parts[i].nbytes = 0;
    if (!parts[i].buf && parts[i].cap) {
      set_error(s->client, MESHD_E_INVALID, 0, NULL,
                "meshd_session_fetch_bytes: part %zu has cap %zu and no buf", i, parts[i].cap);
      ret = MESHD_E_INVALID;
      goto out;
    }
    if (!fetch_request(s, tensor, parts[i].dims, parts[i].index, parts[i].ncoords, co[i], pco[i],
                       &req[i])) {
      ret = MESHD_E_INVALID;
      goto out;
    }
    reqs[i] = &req[i];
    b[i] = (bytes_sink_t){&parts[i], i};
    k[i] = (direct_sink_t){bytes_begin, bytes_data, &b[i]};
  }
  /* In waves: the server takes at most --session-max-transfers (8 by
   * default) of a session's transfers at once, and more parts than that
   * failed the call outright. One deadline for all of them. */
  int timeout_ms = opts && opts->timeout_ms > 0 ? opts->timeout_ms : s->client->timeout_ms;
  int64_t end = rpc_now_ms() + timeout_ms;
  ret = MESHD_E_OK;
  for (size_t i = 0; i < nparts && ret == MESHD_E_OK; i += FETCH_WAVE) {
    int64_t left = end - rpc_now_ms();
    if (left <= 0) {
      set_error(s->client, MESHD_E_DEADLINE, GRPC_STATUS_DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED",
                "meshd_session_fetch_bytes: the deadline passed after %zu of %zu parts", i,
                nparts);
      ret = MESHD_E_DEADLINE;
      break;
    }
    size_t wave = nparts - i < FETCH_WAVE ? nparts - i : FETCH_WAVE;
    ret = fetch_parts(s, reqs + i, k + i, wave, (int)left);
  }
out:
  free(co);
  free(pco);
  free(req);
  free(reqs);
  free(b);
  free(k);
  return ret;
}

/* ---------------------------------------------------------------- pipeline */

meshd_err_t meshd_session_set_pipeline(meshd_session_t *s, const meshd_pipeline_options_t *opts) {
  if (!s)
    return MESHD_E_INVALID;
  if (!opts) {
    if (!s->pipe)
      return MESHD_E_OK;
    meshd_err_t ret = sync_point(s, 0);
    direct_err_t e = {0};
    uint64_t seq = 0;
    /* Past a timed-out wait, what close still hears is reported, not dropped. */
    if (pipeline_close(s->pipe, s->client->timeout_ms, &e, &seq) != 0 &&
        ret == MESHD_E_DEADLINE && e.err != MESHD_E_DEADLINE) {
      ret = record(s->client, &e);
      s->client->last.seq = seq;
    }
    s->pipe = NULL;
    return ret;
  }
  size_t batch = opts->max_batch ? opts->max_batch : 256;
  int delay = opts->max_delay_us ? opts->max_delay_us : 200;
  if (batch > PIPELINE_MAX_BATCH) {
    set_error(s->client, MESHD_E_INVALID, 0, NULL,
              "meshd_session_set_pipeline: max_batch is %zu (expected 1..%d, 0: 256)", batch,
              PIPELINE_MAX_BATCH);
    return MESHD_E_INVALID;
  }
  if (delay < 0 || delay > 60000000) {
    set_error(s->client, MESHD_E_INVALID, 0, NULL,
              "meshd_session_set_pipeline: max_delay_us is %d (expected 1..60000000, 0: 200)",
              delay);
    return MESHD_E_INVALID;
  }
  meshd_err_t heard = MESHD_E_OK;
  if (s->pipe && pipeline_over(s->pipe)) { /* a new stream: the old one failed */
    /* What it was told before it failed is reported, not dropped with it. */
    if (pipeline_rejections(s->pipe))
      heard = sync_point(s, 0);
    pipeline_close(s->pipe, s->client->timeout_ms, NULL, NULL);
    s->pipe = NULL;
  }
  if (s->pipe) {
    pipeline_set(s->pipe, batch, delay);
    return MESHD_E_OK;
  }
  direct_err_t e = {0};
  s->pipe = pipeline_open(s->client->ch, s->md, s->nmd, batch, delay, &e);
  return !s->pipe ? record(s->client, &e) : heard;
}

meshd_err_t meshd_session_pipeline_stats(const meshd_session_t *s, meshd_pipeline_stats_t *out) {
  if (!s)
    return MESHD_E_INVALID;
  if (!out) {
    set_error(s->client, MESHD_E_INVALID, 0, NULL, "meshd_session_pipeline_stats: out is NULL");
    return MESHD_E_INVALID;
  }
  memset(out, 0, sizeof *out);
  if (s->pipe)
    pipeline_stats(s->pipe, out);
  return MESHD_E_OK;
}

uint64_t meshd_session_last_seq(const meshd_session_t *s) { return s ? s->next_seq - 1 : 0; }
