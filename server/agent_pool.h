/* The pool of registered agents, indexed by world rank.
 *
 * Owned by main; every function is thread-safe. Agents enter on registration
 * (registry.c), turn healthy once the server's dial-back reached them, and leave
 * when their registration call ends. */
#ifndef MESHD_AGENT_POOL_H
#define MESHD_AGENT_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "meshd/v1/tensor_service.pb-c.h"
#include "rpc.h"

typedef struct agent_pool agent_pool_t;

/* Called (without pool locks held) whenever the count of healthy agents changes. */
typedef void (*agent_pool_changed_fn)(int healthy, void *arg);

typedef struct agent_desc {
  char agent_id[64];
  char address[256];
  char device[32];
  uint64_t memory_bytes;
  uint32_t data_port;
  uint32_t pid;
} agent_desc_t;

agent_pool_t *agent_pool_create(agent_pool_changed_fn changed, void *arg);
void agent_pool_destroy(agent_pool_t *pool);

/* Admits an agent: rank `requested` if >= 0 and free, else the lowest free rank.
 * Returns the rank, or -1 with a message in err when the requested rank is held
 * by another live agent or the id is already registered. */
int agent_pool_add(agent_pool_t *pool, const agent_desc_t *d, int requested, char *err,
                   size_t errlen);
/* Removes rank's agent if it is still `agent_id` (a newer agent may hold the rank). */
void agent_pool_remove(agent_pool_t *pool, uint32_t rank, const char *agent_id, const char *why);
/* Marks the agent healthy (dial-back answered, agent reports healthy) or not. */
void agent_pool_set_healthy(agent_pool_t *pool, uint32_t rank, const char *agent_id, bool healthy);
void agent_pool_set_allocated(agent_pool_t *pool, uint32_t rank, const char *agent_id,
                              uint64_t bytes);
/* Keeps the dial-back channel (the pool owns and destroys it from now on). */
void agent_pool_set_channel(agent_pool_t *pool, uint32_t rank, const char *agent_id,
                            rpc_channel_t *ch);
int agent_pool_healthy(agent_pool_t *pool);
int agent_pool_size(agent_pool_t *pool);
/* A snapshot for ListAgents: *out is an array of *n AgentInfo pointers, all
 * malloc'd; free with agent_pool_snapshot_free. Returns 0 or -1 (out of memory). */
int agent_pool_snapshot(agent_pool_t *pool, Meshd__V1__AgentInfo ***out, size_t *n);
void agent_pool_snapshot_free(Meshd__V1__AgentInfo **infos, size_t n);

#endif
