/* TensorService/InspectUrl: what a URL holds (a .npy or safetensors header),
 * read by one agent of the session's mesh, for clients that load tensors
 * from URLs (meshd.load; the Load command then has each agent fetch its
 * bytes). TensorService/LoadProgress: how many bytes of those loads the
 * agents fetched so far (progress bars), summed over each tensor's ranks. The URL is checked against the server's policy (--url-allow)
 * before any agent connects; the agent checks every address it connects to
 * against the same policy. The agent calls run on a helper thread, never on
 * a completion-queue thread; at most LOAD_INSPECTS_MAX InspectUrls and, apart,
 * LOAD_PROGRESS_MAX LoadProgress calls (LOAD_PROGRESS_PER_SESSION of one
 * session) run at once (more are refused RESOURCE_EXHAUSTED). */
#ifndef MESHD_LOAD_SERVICE_H
#define MESHD_LOAD_SERVICE_H

#include <stddef.h>

#include "agent_pool.h"
#include "rpc.h"
#include "session.h"
#include "url_policy.h"

#define LOAD_INSPECTS_MAX 16
#define LOAD_PROGRESS_MAX 64
#define LOAD_PROGRESS_PER_SESSION 8

typedef struct load_service load_service_t;

/* urls must outlive the service. NULL on OOM. */
load_service_t *load_service_create(agent_pool_t *pool, session_table_t *sessions,
                                    const url_policy_t *urls);
/* The rows (InspectUrl; static storage), *n their count. Register them with
 * the load_service_t * as arg; the service must outlive the server. */
const rpc_method_t *load_service_methods(size_t *n);
/* Waits for the helper threads still running, then frees. */
void load_service_destroy(load_service_t *ls);

#endif
