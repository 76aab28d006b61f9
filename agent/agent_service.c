/* meshd.agent.v1.Agent: what the server calls on an agent it dialed back. */
#include <string.h>

#include "agent.h"
#include "backend.h"
#include "dataplane/dataplane.h"
#include "execute.h"
#include "grant.h"
#include "load.h"
#include "log.h"
#include "meshd/agent/v1/agent.pb-c.h"

/* The server registers an agent, then calls Hello with the id it was given: a
 * mismatch means the advertised address reached some other process (a stale
 * port, a wrong --advertise), and the server must not count this agent. */
static void hello(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  const agent_info_t *self = arg;
  const Meshd__Agent__V1__HelloRequest *req = (const Meshd__Agent__V1__HelloRequest *)msg;

  if (strcmp(req->agent_id, self->id) != 0) {
    log_warn("agent", "hello for agent %s (rank %u) reached agent %s", req->agent_id,
             req->rank, self->id);
    rpc_call_finish(call, GRPC_STATUS_FAILED_PRECONDITION, NULL,
                    "hello for agent %s reached agent %s", req->agent_id, self->id);
    return;
  }
  log_debug("agent", "hello from server %s for rank %u", req->server_id, req->rank);
  atomic_store(&agent_rank, (int64_t)req->rank);
  /* An agent started without --rank learns its rank here: its data plane too
   * (its peers address it by rank; collectives check it). */
  if (self->env.backend) dataplane_set_rank(self->env.backend->net, req->rank);
  registration_reached(call); /* readiness before the reply the server counts us on */

  Meshd__Agent__V1__HelloReply reply = MESHD__AGENT__V1__HELLO_REPLY__INIT;
  reply.agent_id = (char *)self->id;
  reply.device = (char *)self->device;
  reply.memory_bytes = self->memory_bytes;
  reply.allocated_bytes = self->env.backend ? atomic_load(&self->env.backend->allocated) : 0;
  /* Last: the server's estimate of our clock errs by what follows. */
  if (self->clock) reply.unix_ms = grant_now_unix_ms();
  rpc_call_reply(call, &reply.base);
}

_Atomic int64_t agent_rank = -1;

static const rpc_method_t methods[] = {
    {
        .path = "/meshd.agent.v1.Agent/Hello",
        .kind = RPC_UNARY,
        .request = &meshd__agent__v1__hello_request__descriptor,
        .on_start = hello,
    },
    {
        .path = "/meshd.agent.v1.Agent/Execute",
        .kind = RPC_BIDI,
        .request = &meshd__agent__v1__instruction_batch__descriptor,
        .on_start = execute_start,
        .on_message = execute_message,
        .on_end = execute_end,
    },
    {
        .path = "/meshd.agent.v1.Agent/Read",
        .kind = RPC_SERVER_STREAMING,
        .request = &meshd__agent__v1__read_request__descriptor,
        .on_start = data_read_start,
    },
    {
        .path = "/meshd.agent.v1.Agent/Write",
        .kind = RPC_CLIENT_STREAMING,
        .request = &meshd__agent__v1__data_chunk__descriptor,
        .on_start = data_write_start,
        .on_message = data_write_message,
        .on_end = data_write_end,
        .on_raw = data_write_raw,
    },
    {
        .path = "/meshd.agent.v1.Agent/InspectUrl",
        .kind = RPC_UNARY,
        .request = &meshd__agent__v1__inspect_url_request__descriptor,
        .on_start = load_inspect_start,
    },
    {
        .path = "/meshd.agent.v1.Agent/LoadProgress",
        .kind = RPC_UNARY,
        .request = &meshd__agent__v1__load_progress_request__descriptor,
        .on_start = load_progress_start,
    },
};

const rpc_method_t *agent_service_methods(size_t *n) {
  *n = sizeof methods / sizeof methods[0];
  return methods;
}
