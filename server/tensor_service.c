#include "tensor_service.h"

#include <stdlib.h>

#include "meshd/v1/tensor_service.pb-c.h"
#include "ops.h"

static void list_agents(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  agent_pool_t *pool = arg;
  Meshd__V1__ListAgentsReply reply = MESHD__V1__LIST_AGENTS_REPLY__INIT;
  if (agent_pool_snapshot(pool, &reply.agents, &reply.n_agents) != 0) {
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, NULL, "out of memory listing agents");
    return;
  }
  rpc_call_reply(call, &reply.base);
  agent_pool_snapshot_free(reply.agents, reply.n_agents);
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
        .path = "/meshd.v1.TensorService/ListOps",
        .kind = RPC_UNARY,
        .request = &meshd__v1__list_ops_request__descriptor,
        .on_start = list_ops,
    },
};

const rpc_method_t *tensor_service_methods(size_t *n) {
  *n = sizeof methods / sizeof methods[0];
  return methods;
}
