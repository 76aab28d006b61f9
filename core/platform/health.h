/* grpc.health.v1.Health (Check and Watch) with the standard semantics.
 *
 * Service "" is the process itself. Check on an unknown service is NOT_FOUND;
 * Watch on one sends SERVICE_UNKNOWN and stays open, then sends the status when
 * the service appears. Watch sends the current status at once and every change. */
#ifndef MESHD_HEALTH_H
#define MESHD_HEALTH_H

#include "rpc.h"

typedef enum {
  HEALTH_UNKNOWN = 0,
  HEALTH_SERVING = 1,
  HEALTH_NOT_SERVING = 2,
  HEALTH_SERVICE_UNKNOWN = 3,
} health_status_t;

typedef struct health health_t;

/* Health answers strangers (no token, plaintext probes): a Watch keeps its
 * service name for its life, so names past this many bytes are refused
 * (INVALID_ARGUMENT), and past this many open Watch calls on one server (all
 * services) a new one is refused (RESOURCE_EXHAUSTED). A Watch whose client
 * does not read holds one queued status at most: it gets the latest later. */
#define HEALTH_SERVICE_MAX 256
#define HEALTH_WATCHERS_MAX 1024

health_t *health_create(void);
/* Registers Check and Watch on srv (before rpc_server_start). Returns 0 or -1. */
int health_add_methods(health_t *h, rpc_server_t *srv);
/* The same behind a guard (rpc_server_add_methods_guarded): for a port whose
 * other callers are not all entitled to the status. */
int health_add_methods_guarded(health_t *h, rpc_server_t *srv, rpc_guard_fn guard,
                               void *guard_arg);
/* A plaintext server on `listen` that serves only Health (kubelet gRPC
 * probes speak plaintext, so a TLS port needs this beside it). Started; stop
 * it with rpc_server_shutdown + rpc_server_destroy. NULL with err on failure.
 * limits: the operator's bounds on what strangers may take of a port, as the
 * other ports get them (strangers reach this one too): its memory_bytes
 * (--rpc-memory-bytes), max_connection_idle_ms, max_unauthenticated_requests
 * and max_concurrent_streams (never above the port's own 16) are used; its
 * other fields are not. */
rpc_server_t *health_serve(health_t *h, const char *listen, const rpc_server_opts_t *limits,
                           char *err, size_t errlen);
/* Sets a service's status and pushes it to its watchers if it changed. */
void health_set(health_t *h, const char *service, health_status_t status);
/* HEALTH_SERVICE_UNKNOWN if the service was never set. */
health_status_t health_get(health_t *h, const char *service);
/* Number of open Watch calls (all services). */
int health_watchers(health_t *h);
/* Shutdown: every service NOT_SERVING (pushed), then every Watch call ends with
 * UNAVAILABLE "server shutting down". Later Watch calls get NOT_SERVING then end. */
void health_shutdown(health_t *h);
/* After the rpc server is shut down. */
void health_destroy(health_t *h);

const char *health_status_name(health_status_t s);

#endif
