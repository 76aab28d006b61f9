/* meshd C client library: the only public face of clients/c.
 *
 * A meshd_client_t is one connection to a meshd server. Calls block until the
 * server answers or the client's timeout passes. A client may be used by one
 * thread at a time (its last error is per client); use one client per thread
 * for concurrency.
 *
 * Errors: every fallible function returns a meshd_err_t. After a failure,
 * meshd_last_error(client) says what went wrong; for MESHD_E_RPC that includes
 * the server's gRPC status code and message.
 *
 * Ownership is written on each function. Strings passed in are only read during
 * the call. */
#ifndef MESHD_CLIENT_H
#define MESHD_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define MESHD_API __attribute__((visibility("default")))
#else
#define MESHD_API
#endif

/* ------------------------------------------------------------------ errors */

#define MESHD_ERR_MAP(XX)                                   \
  XX(OK, "ok")                                              \
  XX(CONNECT, "could not connect to the server")            \
  XX(RPC, "the call failed")                                \
  XX(INVALID, "invalid argument")                           \
  XX(NOMEM, "out of memory")

typedef enum {
#define XX(name, text) MESHD_E_##name,
  MESHD_ERR_MAP(XX)
#undef XX
} meshd_err_t;

/* A short description: "could not connect to the server". Static string;
 * "unknown error" for values outside the enum. */
MESHD_API const char *meshd_strerror(meshd_err_t err);

/* ------------------------------------------------------------------ client */

typedef struct meshd_client meshd_client_t;

/* Connects to `target` ("127.0.0.1:50051", "dns:///meshd:50051") and waits up
 * to timeout_ms (> 0) for the connection to be ready. timeout_ms is also the
 * deadline of every call made through the client.
 *
 * Returns a client (free with meshd_close), or NULL with *err set (err may be
 * NULL): MESHD_E_INVALID for a NULL/empty target or timeout_ms <= 0,
 * MESHD_E_CONNECT if no connection was ready in time, MESHD_E_NOMEM. */
MESHD_API meshd_client_t *meshd_connect(const char *target, int timeout_ms, meshd_err_t *err);

/* Closes the connection and frees the client. NULL is ignored. Pointers
 * obtained from meshd_last_error become invalid. */
MESHD_API void meshd_close(meshd_client_t *client);

/* What the last failed call on a client reported. */
typedef struct meshd_error_info {
  meshd_err_t err;            /* MESHD_E_OK while no call has failed */
  int grpc_code;              /* MESHD_E_RPC: the server's gRPC status code; else 0 */
  const char *grpc_code_name; /* MESHD_E_RPC: "NOT_FOUND", "UNAVAILABLE", ...; else "" */
  const char *kind;           /* meshd error kind ("WRONG_MESH") if the server sent one; else "" */
  const char *message;        /* what went wrong ("unknown service"); "" when err is OK */
} meshd_error_info_t;

/* The last failed call on `client` (successful calls leave it unchanged).
 * Never NULL. The struct and its strings belong to the client and stay valid
 * until the next call on it or meshd_close. A NULL client gets a static
 * MESHD_E_INVALID record. */
MESHD_API const meshd_error_info_t *meshd_last_error(const meshd_client_t *client);

/* ------------------------------------------------------------------ health */

/* grpc.health.v1 serving statuses, with their names as the proto spells them. */
#define MESHD_HEALTH_MAP(XX)  \
  XX(UNKNOWN, 0)              \
  XX(SERVING, 1)              \
  XX(NOT_SERVING, 2)          \
  XX(SERVICE_UNKNOWN, 3)

enum {
#define XX(name, value) MESHD_HEALTH_##name = value,
  MESHD_HEALTH_MAP(XX)
#undef XX
};

/* "SERVING", "NOT_SERVING", ...; "UNKNOWN" for values outside the map. Static. */
MESHD_API const char *meshd_health_name(int serving_status);

/* grpc.health.v1.Health/Check for `service` (NULL or "" : the server as a
 * whole; "meshd.v1.TensorService": SERVING only with enough healthy agents).
 * On MESHD_E_OK stores a MESHD_HEALTH_* value in *serving_status_out.
 * An unknown service is MESHD_E_RPC with grpc_code_name "NOT_FOUND". */
MESHD_API meshd_err_t meshd_health(meshd_client_t *client, const char *service,
                                   int *serving_status_out);

/* ------------------------------------------------------------------ agents */

/* One agent registered with the server. */
typedef struct meshd_agent {
  uint32_t rank;            /* world rank */
  char *address;            /* host:port of the agent's gRPC service */
  char *device;             /* "cpu", "cuda:0", ... */
  uint64_t memory_bytes;    /* capacity */
  uint64_t allocated_bytes; /* held now */
  bool healthy;
  char *agent_id;
} meshd_agent_t;

/* meshd.v1.TensorService/ListAgents. On MESHD_E_OK, *list is an array of *n
 * agents in the server's order, owned by the caller: free it with
 * meshd_agents_free(*list, *n). With no agents, *list = NULL and *n = 0.
 * On failure *list = NULL and *n = 0. */
MESHD_API meshd_err_t meshd_agents(meshd_client_t *client, meshd_agent_t **list, size_t *n);

/* Frees a list from meshd_agents, strings included. NULL is ignored. */
MESHD_API void meshd_agents_free(meshd_agent_t *list, size_t n);

#ifdef __cplusplus
}
#endif

#endif
