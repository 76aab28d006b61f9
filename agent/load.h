/* Tensors from URLs on the agent (docs/loading.md): the LoadOp instruction's
 * bytes, and Agent/InspectUrl's header reads. Each agent fetches only its own
 * slice, with HTTP Range requests (url_fetch.h), under the policy the server
 * sent with the request (url_policy.h). */
#ifndef MESHD_AGENT_LOAD_H
#define MESHD_AGENT_LOAD_H

#include <stdbool.h>

#include "backend.h"
#include "meshd/agent/v1/agent.pb-c.h"
#include "rpc.h"

/* Loads whose progress Agent/LoadProgress can tell: the running ones and the
 * latest finished ones, LOAD_TRACKED in all (the oldest finished go first). */
#define LOAD_TRACKED 1024

/* At most this many InspectUrl calls run at once; more are refused. */
#define LOAD_INSPECTS_MAX 8

/* Fills t (allocated, with op->result's shape) with this rank's slice of the
 * tensor at op->load->url. First the file's size must be what the server
 * expects (raw: offset + the tensor's bytes; else the size InspectUrl saw):
 * another size means a wrong dtype or shape, or a file changed since. The
 * bytes go through a bounded staging buffer into the tensor wherever it
 * lives. 0, or -1 with e: its message names the URL (redacted) and rank, its
 * kind url_fetch's (BAD_ARGUMENT, PERMISSION_DENIED, DEADLINE_EXCEEDED,
 * UNAVAILABLE). The download ends as soon as stop(stop_arg) says so (the
 * session ended: nobody will read the tensor); NULL: never. */
int load_run(backend_t *b, backend_stream_t *bs, const char *session,
             const Meshd__Agent__V1__LoadOp *op, agent_tensor_t *t, bool (*stop)(void *),
             void *stop_arg, meshd_error_t *e);

/* Agent/LoadProgress's on_start: done and total bytes per ref (unary, no
 * I/O: answered on the calling thread). */
void load_progress_start(rpc_call_t *call, const ProtobufCMessage *req, void *arg);

/* Agent/InspectUrl's on_start: reads the URL's header on a helper thread and
 * answers a meshd.v1.InspectUrlReply. */
void load_inspect_start(rpc_call_t *call, const ProtobufCMessage *req, void *arg);

#endif
