/* What the command path (command_service -> commands -> checks -> emit) carries
 * down to reach the agents. Owned by the command service. */
#ifndef MESHD_FRONTEND_H
#define MESHD_FRONTEND_H

#include "agent_pool.h"
#include "url_policy.h"

typedef struct frontend {
  agent_pool_t *pool; /* outlives the front end */
  const url_policy_t *urls; /* what Load may fetch (NULL: no loads); outlives it */
  /* The instruction bytes one command may queue: what one Submit message may
   * queue before it waits for room (command_service.c); 0: no bound. */
  uint64_t max_command_bytes;
} frontend_t;

#endif
