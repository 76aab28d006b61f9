#include "tensor_service.h"

#include <stdlib.h>

#include "build_info.h"
#include "meshd/v1/tensor_service.pb-c.h"
#include "ops.h"
#include "page_token.h"

/* When the method table was first asked for: main does so once at startup. */
static int64_t started_ms;

/* ListAgents is paged by rank (page_token.h). The default page holds 4096
 * agents: a pool of that many comes whole to a client that predates paging
 * (the default --max-agents is 1024), and the largest page, at most ~520 bytes
 * an agent, stays near 2 MiB, well inside gRPC's default 4 MiB a message,
 * where a single reply stopped fitting at ~8000 agents. */
#define LIST_AGENTS_PAGE_DEFAULT 4096
#define LIST_AGENTS_PAGE_MAX 4096

/* Every agent (a page of them), and how a client dials their addresses (the
 * direct data path; on every page). */
static void list_agents(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  agent_pool_t *pool = arg;
  const Meshd__V1__ListAgentsRequest *r = (const Meshd__V1__ListAgentsRequest *)req;
  uint64_t after, next = 0;
  meshd_error_t e;
  if (!page_token_parse(r->page_token, agent_pool_epoch(pool), &after)) {
    page_token_refuse(&e, "ListAgents");
    rpc_call_finish(call, error_kind_code(e.kind), error_kind_name(e.kind), "%s", e.msg);
    return;
  }
  size_t limit = page_size_of(r->page_size, LIST_AGENTS_PAGE_DEFAULT, LIST_AGENTS_PAGE_MAX);
  Meshd__V1__ListAgentsReply reply = MESHD__V1__LIST_AGENTS_REPLY__INIT;
  Meshd__V1__AgentTls tls = MESHD__V1__AGENT_TLS__INIT;
  char *ca = NULL, err[300];
  const char *name = NULL;
  if (agent_pool_client_tls(pool, &ca, &name, err, sizeof err) != 0) {
    rpc_call_finish(call, GRPC_STATUS_UNAVAILABLE, NULL,
                    "ListAgents: the agents' TLS CA for clients: %s", err);
    return;
  }
  if (ca) {
    tls.ca_pem = ca;
    tls.server_name = (char *)name;
    reply.agent_tls = &tls;
  }
  int rc = agent_pool_snapshot_page(pool, after, limit, &reply.agents, &reply.n_agents, &next);
  if (rc != 0) {
    free(ca);
    if (rc == -2) {
      page_token_refuse(&e, "ListAgents");
      rpc_call_finish(call, error_kind_code(e.kind), error_kind_name(e.kind), "%s", e.msg);
    } else {
      rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, NULL, "out of memory listing agents");
    }
    return;
  }
  char token[PAGE_TOKEN_LEN];
  page_token_format(token, next, agent_pool_epoch(pool));
  reply.next_page_token = token;
  rpc_call_reply(call, &reply.base);
  agent_pool_snapshot_free(reply.agents, reply.n_agents);
  free(ca);
}

/* GetInfo's agents: the first this many by rank, the default --max-agents, so
 * that a pool of the default size is never cut (clients that predate the
 * counts see every agent there). The reply stays bounded (~530 KiB at most,
 * ~520 bytes an agent) and never fails by the pool's size, where every agent in
 * one reply passed gRPC's 4 MiB at ~8000; agents_truncated and the counts say
 * what it left out (ListAgents has all). */
#define GET_INFO_AGENTS_MAX 1024

/* The server's build and uptime, the pool's counts, and its first agents (with
 * the version each reported). */
static void get_info(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  agent_pool_t *pool = arg;
  const build_info_t *b = build_info();
  Meshd__V1__GetInfoReply reply = MESHD__V1__GET_INFO_REPLY__INIT;
  reply.version = (char *)b->version;
  reply.commit = (char *)b->commit;
  reply.build_type = (char *)b->build_type;
  reply.cuda = b->cuda;
  int64_t up = rpc_now_ms() - started_ms;
  reply.uptime_ms = up > 0 ? (uint64_t)up : 0;
  agent_pool_census_t c = agent_pool_census(pool);
  reply.agents_total = c.total;
  reply.agents_healthy = c.healthy;
  reply.agents_drained = c.drained;
  uint64_t next = 0;
  if (agent_pool_snapshot_page(pool, 0, GET_INFO_AGENTS_MAX, &reply.agents, &reply.n_agents,
                               &next) != 0) {
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, NULL, "out of memory listing agents");
    return;
  }
  reply.agents_truncated = next != 0;
  rpc_call_reply(call, &reply.base);
  agent_pool_snapshot_free(reply.agents, reply.n_agents);
}

/* An operator's: admin principals only (every caller of an open server is one). */
static void drain_agent(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  agent_pool_t *pool = arg;
  const Meshd__V1__DrainAgentRequest *r = (const Meshd__V1__DrainAgentRequest *)req;
  const rpc_identity_t *id = rpc_call_identity(call);
  if (id && !id->admin) {
    rpc_call_finish(call, GRPC_STATUS_PERMISSION_DENIED, error_kind_name(ERR_PERMISSION_DENIED),
                    "DrainAgent: principal '%s' is not an admin; only a principal marked admin "
                    "in --auth-tokens may drain or undrain agents", id->name);
    return;
  }
  meshd_error_t e;
  if (agent_pool_set_drained(pool, r->rank, r->drain, &e) != 0) {
    rpc_call_finish(call, GRPC_STATUS_NOT_FOUND, NULL, "%s", e.msg);
    return;
  }
  /* rank's row alone (the page from rank on): not a copy of the whole pool. */
  Meshd__V1__AgentInfo **agents = NULL;
  size_t n = 0;
  uint64_t next;
  if (agent_pool_snapshot_page(pool, r->rank, 1, &agents, &n, &next) == -1) {
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, NULL, "out of memory listing agents");
    return;
  }
  Meshd__V1__DrainAgentReply reply = MESHD__V1__DRAIN_AGENT_REPLY__INIT;
  for (size_t i = 0; i < n; i++)
    if (agents[i]->rank == r->rank) reply.agent = agents[i];
  rpc_call_reply(call, &reply.base);
  agent_pool_snapshot_free(agents, n);
}

/* The catalogue as clients see it: every op's name, schema and flags. */
static void list_ops(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  size_t n = ops_count();
  Meshd__V1__OpInfo *info = calloc(n ? n : 1, sizeof *info);
  Meshd__V1__OpInfo **ptrs = calloc(n ? n : 1, sizeof *ptrs);
  if (!info || !ptrs) {
    free(info);
    free(ptrs);
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, NULL, "out of memory listing ops");
    return;
  }
  for (size_t i = 0; i < n; i++) {
    const op_def_t *op = ops_at(i);
    meshd__v1__op_info__init(&info[i]);
    info[i].name = (char *)op_name(op);
    info[i].schema = (char *)op_schema(op);
    info[i].view = op->is_view;
    info[i].inplace = op->is_inplace;
    info[i].factory = op->is_factory;
    ptrs[i] = &info[i];
  }
  Meshd__V1__ListOpsReply reply = MESHD__V1__LIST_OPS_REPLY__INIT;
  reply.ops = ptrs;
  reply.n_ops = n;
  rpc_call_reply(call, &reply.base);
  free(ptrs);
  free(info);
}

static const rpc_method_t methods[] = {
    {
        .path = "/meshd.v1.TensorService/ListAgents",
        .kind = RPC_UNARY,
        .request = &meshd__v1__list_agents_request__descriptor,
        .on_start = list_agents,
    },
    {
        .path = "/meshd.v1.TensorService/GetInfo",
        .kind = RPC_UNARY,
        .request = &meshd__v1__get_info_request__descriptor,
        .on_start = get_info,
    },
    {
        .path = "/meshd.v1.TensorService/DrainAgent",
        .kind = RPC_UNARY,
        .request = &meshd__v1__drain_agent_request__descriptor,
        .on_start = drain_agent,
    },
    {
        .path = "/meshd.v1.TensorService/ListOps",
        .kind = RPC_UNARY,
        .request = &meshd__v1__list_ops_request__descriptor,
        .on_start = list_ops,
    },
};

const rpc_method_t *tensor_service_methods(size_t *n) {
  if (!started_ms) started_ms = rpc_now_ms();
  *n = sizeof methods / sizeof methods[0];
  return methods;
}
