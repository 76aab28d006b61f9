/* The client commands of DESIGN §3: one handler per Command kind, in one table.
 *
 * A handler runs every check first and changes nothing unless the command is
 * accepted; then it claims the command's refs, updates the session's objects,
 * sends the agent instructions (emit.h) and fills the result. The caller holds
 * the session's lock. */
#ifndef MESHD_COMMANDS_H
#define MESHD_COMMANDS_H

#include "error_kind.h"
#include "frontend.h"
#include "meshd/v1/tensor_service.pb-c.h"
#include "objects.h"
#include "session.h"

#define CMD_MAX_ALLOCS 64

/* The most data one Literal command carries (tensor_service.proto): a rank's
 * instruction stays well under AGENT_LINK_MAX_INSTRUCTION (a link batch holds
 * up to AGENT_LINK_BATCH_BYTES of instructions, or one larger one alone). */
#define LITERAL_MAX_BYTES (1024 * 1024)
/* ... and over all its ranks (a replicated one sends its bytes to each): what
 * one command may add to the agents' queues beyond flow control's bound. */
#define LITERAL_MAX_SENT_BYTES (8 * 1024 * 1024)

/* A CommandResult and the memory behind its repeated fields. */
typedef struct cmd_out {
  Meshd__V1__CommandResult res;
  void *allocs[CMD_MAX_ALLOCS];
  int nallocs;
} cmd_out_t;

void cmd_out_init(cmd_out_t *out, uint64_t seq);
/* Frees what the result points to (not `out` itself). */
void cmd_out_free(cmd_out_t *out);
/* Sets out's Error from e (kind, message, gRPC code, seq). */
void cmd_out_error(cmd_out_t *out, const meshd_error_t *e);

/* Around the commands of one Submit batch, on the thread that runs them:
 * their Literals together send at most LITERAL_MAX_SENT_BYTES to the agents
 * (flow control holds a session back only between messages). */
void command_batch_begin(void);
void command_batch_end(void);

/* Runs `cmd` in session s (whose objects are `o`). Returns 0 if accepted
 * (out filled), -1 if rejected (e says why; nothing changed). */
int command_run(frontend_t *fe, session_t *s, objects_t *o, const Meshd__V1__Command *cmd,
                cmd_out_t *out, meshd_error_t *e);

/* Fills m from tensor t (shape, strides, dtype, mesh, stream, state); the
 * repeated fields point into dims, which holds 2 * ndim values. */
void command_tensor_meta(Meshd__V1__TensorMeta *m, const obj_t *t, int64_t *dims);

/* 0 when session s (objects o) may define n more refs of `kind`: every kind
 * counts against s->limits.max_refs, meshes and streams against their own
 * limits too. Otherwise -1 with QUOTA naming the command, the limit, its flag
 * and what to do. Checked before a command is accepted (Upload too). */
int command_check_limits(const session_t *s, const objects_t *o, obj_kind_t kind, size_t n,
                         const char *cmd, meshd_error_t *e);

/* Fails t (and its aliases) at command seq as a dependent of the failed
 * tensor root: DEPENDENT_FAILURE under root's command seq, naming the root. */
void command_inherit_failure(objects_t *o, obj_t *t, const obj_t *root, uint64_t seq);

/* "CreateMesh", "Call", ... for logs and messages. */
const char *command_name(const Meshd__V1__Command *cmd);
/* 0, or -1 with AGENT_LOST when an agent of the mesh was lost after the mesh
 * was made (mesh_t.losses_seen): such a mesh runs no new command. */
int command_check_mesh_alive(agent_pool_t *pool, const mesh_t *mesh, const char *cmd,
                             meshd_error_t *e);

#endif
