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

static rpc_method_t methods[] = {
    {"/meshd.v1.TensorService/ListAgents", RPC_UNARY, &meshd__v1__list_agents_request__descriptor,
     list_agents, NULL, NULL, NULL},
};

const rpc_method_t *tensor_service_methods(agent_pool_t *pool, size_t *n) {
  for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++) methods[i].arg = pool;
  *n = sizeof methods / sizeof methods[0];
  return methods;
}
