#include "tensor_service.h"

#include "meshd/v1/tensor_service.pb-c.h"

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

static const rpc_method_t methods[] = {
    {
        .path = "/meshd.v1.TensorService/ListAgents",
        .kind = RPC_UNARY,
        .request = &meshd__v1__list_agents_request__descriptor,
        .on_start = list_agents,
    },
};

const rpc_method_t *tensor_service_methods(size_t *n) {
  *n = sizeof methods / sizeof methods[0];
  return methods;
}
