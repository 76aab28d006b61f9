/* Fault injection, for tests of timeouts, aborts and lost answers without
 * kill: a process reads --fault (or MESHD_FAULT, as every flag) at start and
 * makes chosen steps fail, hang or run slowly. Each program names its places:
 *
 *   WHERE:ACTION[,rank=R][,after=K][,count=C]
 *   WHERE   the agent: reduce | send | any (collectives and sends), call
 *           (an op's Call: fail makes it fail as a kernel would), write (a
 *           client's Agent/Write under a grant: fail refuses it at once,
 *           slow=MS delays it), report (each progress report to the server:
 *           slow=MS holds it back that long), or hello (with ACTION old);
 *           the server: plan (a PlanTransfer's answer, once its transfer is
 *           in the table: slow=MS makes a client's deadline pass before it),
 *           session (a CreateSession's answer, once its session exists: slow=MS),
 *           remove (a lost agent's removal from the pool: slow=MS holds it,
 *           fail leaves it to the registry's sweeper, as when no thread can be had),
 *           finish (a FinishUpload once its receipts checked out, before it
 *           defines its tensor: slow=MS, so a tokens reload can come meanwhile)
 *           expire (a direct fetch's grant request held for a slot: fail makes
 *           the sweeper take its fetch as past its plan's expiry at its next
 *           pass, as --transfer-grant-ms would once it passed), drop (a
 *           DropSnapshot of a fetch that ends unread: slow=MS holds it MS ms
 *           before it is sent)
 *   ACTION  fail            the instruction fails (REMOTE_FAILURE "injected fault")
 *           hang[=MS]       it blocks, like a wedged device, until the session
 *                           learns of a lost peer or ends (or MS passes; default 1 h);
 *                           the agent's instructions only (write and plan run on
 *                           call threads: they refuse hang)
 *           slow=MS         it sleeps MS, then runs
 *           old             hello:old: the agent registers as a build older than
 *                           the Literal command (rolling-upgrade drills; the
 *                           server then sends it none)
 *   rank=R  only the agent of world rank R (all --local-agents share the env;
 *           the server ignores it)
 *   after=K skip the first K matching instructions; count=C fire at most C times
 *
 * e.g. MESHD_FAULT="reduce:hang,rank=1,count=1". */
#ifndef MESHD_FAULT_H
#define MESHD_FAULT_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum { FAULT_NONE, FAULT_FAIL, FAULT_HANG, FAULT_SLOW, FAULT_OLD } fault_action_t;

typedef struct fault {
  char where[16];
  fault_action_t action;
  int ms;
  int64_t rank; /* -1: every rank */
  uint64_t after, count; /* count 0: no limit */
  _Atomic uint64_t seen, fired;
} fault_t;

/* The places each program knows ("any" is the agent's reduce and send
 * instructions, the collectives and transfers; not call). */
extern const char *const FAULT_AGENT_PLACES[];  /* reduce, send, call, any, hello, write, report */
extern const char *const FAULT_SERVER_PLACES[]; /* plan, session, remove, finish, expire, drop */

/* Parses spec into *f, with WHERE one of places (NULL-terminated). 0, or -1
 * with a message naming what is wrong. */
int fault_parse(const char *spec, const char *const *places, fault_t *f, char *err, size_t errlen);
/* What to do for one step of kind `where` ("reduce", "send", "plan") on world
 * rank `rank` (-1 where ranks do not apply); counts it. f NULL: FAULT_NONE. */
fault_action_t fault_hit(fault_t *f, const char *where, int64_t rank, int *ms);

#endif
