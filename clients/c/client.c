/* meshd C client library: meshd.h over core/rpc.h. */
#include "meshd.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grpc/health/v1/health.pb-c.h"
#include "meshd/v1/tensor_service.pb-c.h"
#include "rpc.h"
#include "status.h"

#define HEALTH_CHECK "/grpc.health.v1.Health/Check"
#define LIST_AGENTS "/meshd.v1.TensorService/ListAgents"

struct meshd_client {
  rpc_channel_t *ch;
  int timeout_ms;
  meshd_error_info_t last; /* strings point into the buffers below */
  char code_name[32];
  char kind[sizeof(((rpc_status_t *)0)->kind)];
  char message[sizeof(((rpc_status_t *)0)->message) + 64];
};

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
  snprintf(c->code_name, sizeof c->code_name, "%s",
           err == MESHD_E_RPC ? meshd_grpc_code_name((grpc_status_code)grpc_code) : "");
  snprintf(c->kind, sizeof c->kind, "%s", kind ? kind : "");
  c->last.err = err;
  c->last.grpc_code = err == MESHD_E_RPC ? grpc_code : 0;
  c->last.grpc_code_name = c->code_name;
  c->last.kind = c->kind;
  c->last.message = c->message;
}

const meshd_error_info_t *meshd_last_error(const meshd_client_t *client) {
  static const meshd_error_info_t null_client = {
      MESHD_E_INVALID, 0, "", "", "meshd_last_error: client is NULL"};
  return client ? &client->last : &null_client;
}

meshd_client_t *meshd_connect(const char *target, int timeout_ms, meshd_err_t *err) {
  meshd_err_t ret = MESHD_E_OK;
  meshd_client_t *c = NULL;

  if (!target || !*target || timeout_ms <= 0) {
    ret = MESHD_E_INVALID;
    goto out;
  }
  rpc_init(); /* counted; balanced in meshd_close or below */
  c = calloc(1, sizeof *c);
  if (!c) {
    ret = MESHD_E_NOMEM;
    rpc_shutdown();
    goto out;
  }
  c->timeout_ms = timeout_ms;
  set_error(c, MESHD_E_OK, 0, NULL, "%s", "");
  c->ch = rpc_channel_create(target, NULL);
  if (!c->ch || !rpc_channel_wait_ready(c->ch, timeout_ms)) {
    ret = MESHD_E_CONNECT;
    meshd_close(c);
    c = NULL;
  }
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
  free(client);
  rpc_shutdown();
}

/* One unary call with the client's deadline; records the failure if any. */
static meshd_err_t call(meshd_client_t *c, const char *method, const ProtobufCMessage *req,
                        const ProtobufCMessageDescriptor *desc, ProtobufCMessage **resp) {
  rpc_status_t st;
  memset(&st, 0, sizeof st);
  *resp = NULL;
  grpc_status_code code = rpc_unary(c->ch, method, req, desc, resp, NULL, 0, c->timeout_ms, &st);
  if (code == GRPC_STATUS_OK && *resp)
    return MESHD_E_OK;
  if (code == GRPC_STATUS_OK) { /* rpc.h promises a reply with OK; don't crash if not */
    set_error(c, MESHD_E_RPC, GRPC_STATUS_INTERNAL, NULL, "%s: OK status without a reply",
              method);
    return MESHD_E_RPC;
  }
  st.kind[sizeof st.kind - 1] = '\0';
  st.message[sizeof st.message - 1] = '\0';
  set_error(c, MESHD_E_RPC, code, st.kind, "%s", st.message);
  return MESHD_E_RPC;
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

meshd_err_t meshd_agents(meshd_client_t *client, meshd_agent_t **list, size_t *n) {
  meshd_err_t ret = MESHD_E_OK;
  ProtobufCMessage *resp = NULL;
  const Meshd__V1__ListAgentsReply *reply = NULL;
  meshd_agent_t *out = NULL;
  size_t count = 0;

  if (!client)
    return MESHD_E_INVALID;
  if (!list || !n) {
    set_error(client, MESHD_E_INVALID, 0, NULL, "meshd_agents: %s is NULL",
              !list ? "list" : "n");
    return MESHD_E_INVALID;
  }
  *list = NULL;
  *n = 0;
  Meshd__V1__ListAgentsRequest req = MESHD__V1__LIST_AGENTS_REQUEST__INIT;
  ret = call(client, LIST_AGENTS, &req.base, &meshd__v1__list_agents_reply__descriptor, &resp);
  if (ret != MESHD_E_OK)
    goto out;

  reply = (const Meshd__V1__ListAgentsReply *)resp;
  if (reply->n_agents == 0)
    goto out;
  out = calloc(reply->n_agents, sizeof *out);
  if (!out)
    goto nomem;
  for (; count < reply->n_agents; count++) {
    const Meshd__V1__AgentInfo *a = reply->agents[count];
    meshd_agent_t *dst = &out[count];
    dst->rank = a->rank;
    dst->memory_bytes = a->memory_bytes;
    dst->allocated_bytes = a->allocated_bytes;
    dst->healthy = a->healthy;
    dst->address = dup_str(a->address);
    dst->device = dup_str(a->device);
    dst->agent_id = dup_str(a->agent_id);
    if (!dst->address || !dst->device || !dst->agent_id) {
      count++; /* free this one's partial strings too */
      goto nomem;
    }
  }
  *list = out;
  *n = count;
  goto out;

nomem:
  set_error(client, MESHD_E_NOMEM, 0, NULL, "meshd_agents: out of memory copying %zu agents",
            reply->n_agents);
  meshd_agents_free(out, count);
  ret = MESHD_E_NOMEM;
out:
  if (resp)
    protobuf_c_message_free_unpacked(resp, NULL);
  return ret;
}

void meshd_agents_free(meshd_agent_t *list, size_t n) {
  if (!list)
    return;
  for (size_t i = 0; i < n; i++) {
    free(list[i].address);
    free(list[i].device);
    free(list[i].agent_id);
  }
  free(list);
}
