/* meshd.v1.AgentRegistry: agents register on a long-lived bidi call.
 *
 * Who may register: a guard runs before the call's first message is read. With
 * cluster certificates the call must come over mTLS with a certificate the
 * port verified against the cluster CA; with join tokens its metadata must
 * carry one of them (SECRET_JOIN_MD; constant-time compare). Both may be
 * required. A call that cannot authenticate ends UNAUTHENTICATED at once, with
 * nothing admitted and nothing dialed, and is logged at warn with its peer
 * address (at most 10 lines per 10 s, then a count; the refusals of admitted
 * calls, a bad RegisterRequest, share that bound, and failed dial-backs have
 * one of their own). With neither, anyone who reaches the port may register
 * (registry_open says so; main warns).
 *
 * First message: RegisterRequest. Its requested_rank must be below max_agents,
 * and its call_secret 64 hex characters. The server admits the agent to the
 * pool, answers RegisterAccepted{rank}, and dials the agent back (Agent/Hello
 * with its id and the call secret, over cluster mTLS when configured: the
 * agent's certificate must name the cluster). Dial-backs run on a pool of
 * REGISTRY_DIALERS threads, each bounded by dial_timeout_ms, so registrations
 * whose addresses do not answer delay a real agent's by about their number /
 * REGISTRY_DIALERS times their timeout at most. The agent counts as healthy
 * once its Hello answered. The call's end removes the agent from the pool (on
 * a thread of its own, or at the sweeper's next turn).
 *
 * An agent restarted at once, or one that registers again right after its
 * link broke, finds its rank (or its id) still held by the agent it replaces
 * while that one's removal has yet to run. The registration then waits for
 * that removal (up to REGISTRY_TAKEOVER_MS, on a dialer) instead of being
 * refused: it takes a rank or id only from an agent whose registration call
 * has ended, or which was dialed back and has lost its link since (whose call
 * it ends, as the sweeper would). A live agent's rank is refused as before
 * (FAILED_PRECONDITION "rank N is held by agent ..."). A dial-back acts on its
 * own registration only (agent_desc_t.registration): the Hello of an attempt
 * that ended never installs its channel on the agent's next registration.
 *
 * Liveness: the dial-back channel, which the pool keeps for the agent's
 * Execute link, pings the agent every second and gives up after
 * agent_timeout_ms without an ack (a hung or SIGSTOPped agent, a silent
 * network); the link then breaks and the pool marks the agent unhealthy. The
 * registry's sweeper thread notices (it checks the pool every REGISTRY_SWEEP_MS)
 * and ends that agent's registration call with UNAVAILABLE, which removes it
 * from the pool; the agent, once it runs again, registers anew. The same holds
 * for a link that breaks for any other reason: an agent without a link is of
 * no use, and registering again gives it a fresh one. */
#ifndef MESHD_REGISTRY_H
#define MESHD_REGISTRY_H

#include <stdbool.h>
#include <stddef.h>

#include "agent_pool.h"
#include "fault.h"
#include "rpc.h"
#include "secret.h"

typedef struct registry registry_t;

#define REGISTRY_SWEEP_MS 250
#define REGISTRY_PING_MS 1000 /* keepalive period of the dial-back channels */
#define REGISTRY_DIALERS 16   /* dial-backs at once */
/* A registration call whose first message has not come this long after it
 * opened is ended (DEADLINE_EXCEEDED): an agent sends its RegisterRequest at
 * once; a stranger's silent calls would be held for ever. */
#define REGISTRY_FIRST_MESSAGE_MS 5000
/* The longest a registration waits for the removal of the gone agent whose
 * rank or id it asks for (a removal joins that agent's link threads). */
#define REGISTRY_TAKEOVER_MS 5000

typedef struct registry_opts {
  const char *server_id;
  int dial_timeout_ms;     /* bounds each dial-back's Hello */
  /* One connection attempt of a dial-back; <= 0: 100 ms plaintext (an address
   * that does not answer holds a dialer that long), 2 s with TLS. */
  int connect_timeout_ms;
  int agent_timeout_ms;    /* >= 1: keepalive ack timeout of dial-back channels (--agent-timeout) */
  int max_agents;          /* requested ranks must be below it (--max-agents); <= 0: the pool's */
  /* Who may register. join_tokens (NULL: none needed) must outlive the registry. */
  secret_file_t *join_tokens;
  bool require_cluster_cert; /* the call must come with a verified client certificate */
  rpc_tls_t agent_tls;       /* TLS of dial-back channels (cluster mTLS); strings must outlive it */
  /* --server-fault (tests; NULL: none), which must outlive the registry:
   * remove:slow=MS holds each agent's removal MS ms, remove:fail leaves it to
   * the sweeper's next turn (as when no thread can be had). */
  fault_t *fault;
  /* The sweeper's period, which is also how often a registration waiting for
   * a gone agent's removal (take_over) looks again unprompted; <= 0:
   * REGISTRY_SWEEP_MS. Tests set it long, so that only what wakes a waiting
   * registration (a removal, close_all) ends its wait before its deadline. */
  int sweep_ms;
} registry_opts_t;

/* pool must outlive the registry. Returns NULL if its threads cannot start. */
registry_t *registry_create(agent_pool_t *pool, const registry_opts_t *opts);
/* Adds RegisterAgent, guarded as above, to srv (before it starts). The
 * registry must outlive the server. Returns 0 or -1. */
int registry_add_methods(registry_t *r, rpc_server_t *srv);
/* True when anyone may register (no join token, no cluster certificate). */
bool registry_open(const registry_t *r);
/* Registration calls open now. */
int registry_open_calls(registry_t *r);
/* Ends every registration call with UNAVAILABLE "server shutting down", and
 * wakes the registrations waiting for a gone agent's removal: they give up at
 * once rather than at their next look (take_over). */
void registry_close_all(registry_t *r);
/* Registrations waiting now to take a gone agent's rank or id (take_over). */
int registry_takeovers_waiting(registry_t *r);
/* After the rpc server is shut down: stops the threads, frees. */
void registry_destroy(registry_t *r);

#endif
