/* TensorService/Upload and TensorService/Fetch: tensor bytes between a client
 * and the agents, proxied through the server (DESIGN §3).
 *
 * Upload (client stream: UploadHeader, then row-major bytes) defines a tensor
 * like a Factory, on every rank of a mesh: the same bytes everywhere, or with
 * per_rank one slice per rank in the mesh's row-major order. Fetch (server
 * stream) returns one rank's local tensor: a TensorMeta, then its bytes, once
 * that agent ran everything sent to it before the Fetch. An Upload's agent calls
 * run on a helper thread once its data is in, never on a completion-queue
 * thread; a Fetch relays the agent's chunks as the client reads them, with no
 * thread of its own. A session has at most max_transfers of these calls in
 * flight; more are refused RESOURCE_EXHAUSTED (QUOTA), but for a fetch with
 * wait_for_slot: planned at once, its bytes wait for a slot (at most
 * DATA_TRANSFERS_MAX - max_transfers such fetches per session): a proxied
 * Fetch's relay, a direct one's grant request (PlanTransfer with its
 * transfer_id, held until then). */
#ifndef MESHD_DATA_SERVICE_H
#define MESHD_DATA_SERVICE_H

#include <stddef.h>

#include "agent_pool.h"
#include "rpc.h"
#include "session.h"

typedef struct data_service data_service_t;

/* --data-path: which ways tensor bytes may take (docs/protocol.md, Direct
 * data path). PROXY: Upload and Fetch only (PlanTransfer is refused); DIRECT:
 * PlanTransfer only (Upload and Fetch are refused); AUTO: both, the client
 * chooses. */
typedef enum { DATA_PATH_AUTO, DATA_PATH_DIRECT, DATA_PATH_PROXY } data_path_t;

/* What an agent keeps of one session's Fetches at once (its unread snapshots,
 * agent/session_state.h, and its Reads waiting for their seq): more in flight
 * would fail the oldest there. --session-max-transfers is at most this. */
#define DATA_TRANSFERS_MAX 64

/* max_message_bytes: the server's limit (chunks stay under it). max_transfers:
 * Upload and Fetch calls one session may have in flight (0 or more: DATA_TRANSFERS_MAX). */
data_service_t *data_service_create(agent_pool_t *pool, session_table_t *sessions,
                                    size_t max_message_bytes, int max_transfers);
/* The data path (default AUTO) and how long a direct transfer's grants live
 * (grant_ms > 0; default 10 minutes). Before the server starts. */
/* Grants' start-by window (--transfer-grant-start-ms; default 60000). */
void data_service_set_grant_start(data_service_t *ds, int64_t start_ms);
void data_service_set_path(data_service_t *ds, data_path_t path, int64_t grant_ms);
/* Upload and Fetch calls the server relays at once, over all sessions (each
 * holds up to 8 MiB of queued chunks): more are refused QUOTA naming
 * --max-relayed-transfers. 0: no bound. Before the server starts. */
void data_service_set_max_relays(data_service_t *ds, int max_relays);
/* Fault injection for tests (fault.h, --server-fault): "plan" delays or
 * fails a PlanTransfer's answer once its transfer is in the table, "finish"
 * delays a FinishUpload, "expire" expires a held grant request's fetch,
 * "drop" delays a DropSnapshot. f
 * outlives ds; NULL: none. Before the server starts. */
struct fault;
void data_service_set_fault(data_service_t *ds, struct fault *f);
/* Counts tensor bytes moved in meshd_transfer_bytes_total{direction,path}
 * (upload/fetch, proxy/direct). Before the server starts; m outlives ds. */
struct metrics_registry;
void data_service_set_metrics(data_service_t *ds, struct metrics_registry *m);
/* The rows (Upload, Fetch, PlanTransfer, FinishUpload, FinishFetch; static storage), *n their count. Register them with
 * the data_service_t * as arg; the service must outlive the server. */
const rpc_method_t *data_service_methods(size_t *n);
/* After a tokens reload: every planned direct transfer whose plan call's
 * identity revoked(id, arg) says lost its token (auth_token_revoked) has its
 * grants revoked on its agents (RevokeGrants on the Execute link: a grant not
 * yet used is refused, a Read or Write it admitted ends) and is undone: an
 * upload as at its expiry (its ref deleted on its ranks, again at expiry,
 * FinishUpload refused), a fetch's snapshot dropped (FinishFetch refused);
 * a fetch that FinishFetch took without its Read's receipt has its grant
 * revoked too, until the grant's expiry.
 * An upload a FinishUpload is checking is waited for (its pin, set with
 * data_service_set_auth, sees the reload). How many were undone. */
int data_service_revoke(data_service_t *ds, bool (*revoked)(const rpc_identity_t *id, void *arg),
                        void *arg);
/* The tokens, for FinishUpload: it defines its tensor only while neither its
 * own token nor its plan's is revoked (auth_pin). NULL (default): unchecked.
 * Before the server starts; auth outlives ds. */
struct auth;
void data_service_set_auth(data_service_t *ds, struct auth *auth);
void data_service_destroy(data_service_t *ds);

#endif
