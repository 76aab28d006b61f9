/* Internal to clients/c: a session's pipeline (meshd.h,
 * meshd_session_set_pipeline). Commands are packed, as they are queued, into
 * one growing buffer that is the body of a batch Command (Command.batch = 30,
 * docs/protocol.md): each command is the field's tag, its length and its
 * bytes. The buffer goes out as one Submit message when it holds max_batch
 * commands (or 1 MiB), when max_delay_us passed since its first command (the
 * flusher thread), or when the session needs an answer (pipeline_flush).
 *
 * Threads: the session's thread queues and flushes; "meshd-pipe-fl" sends
 * batches whose delay passed and takes a command still queued at its
 * deadline out of the batch, never sent (the pipeline's one timer: its waits
 * end by the earliest deadline queued); "meshd-pipe-rd" reads the
 * SubmitReplies. `mu`
 * guards the buffer, the counters and the rejections; `wmu` the stream's
 * write side and is taken before `mu`, so batches reach the stream in the
 * order they were cut. The background threads never touch the client's last
 * error: rejections wait in the pipeline until the session's thread asks.
 *
 * Hot path: no allocation per command (each has a mark in an array that
 * grows with the batch: its seq, deadline and end). A batch costs one copy into a gRPC
 * buffer; a reply is read into a reused buffer and scanned in place for each
 * answer's seq and error; only a rejected command's answer is unpacked. */
#ifndef MESHD_CLIENT_PIPELINE_H
#define MESHD_CLIENT_PIPELINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "direct.h" /* direct_err_t: a failure for the session to record */
#include "meshd.h"
#include "rpc.h"

/* Flush when the queued bytes pass this, whatever max_batch says: the
 * server's messages are at most 4 MiB. */
#define PIPELINE_MAX_BYTES (1u << 20)
#define PIPELINE_MAX_BATCH 4096 /* the server's limit per batch */
/* What the Literals of one Submit message may send the agents together (the
 * server's bound, MESHD_LITERAL_MAX_SENT_BYTES). */
#define PIPELINE_MAX_SENT MESHD_LITERAL_MAX_SENT_BYTES

typedef struct pipeline pipeline_t;

/* Opens the session's Submit stream (its metadata md) and starts the two
 * threads. NULL with e set when it cannot. */
pipeline_t *pipeline_open(rpc_channel_t *ch, const rpc_md_t *md, size_t nmd, size_t max_batch,
                          int max_delay_us, direct_err_t *e);

/* New limits, from the next queued command on. */
void pipeline_set(pipeline_t *p, size_t max_batch, int max_delay_us);

/* Queues cmd, whose seq is `seq` (above every seq queued before). `sent`:
 * what cmd, a Literal, sends the agents in all (0 for other commands); the
 * batch goes out first if its Literals would pass PIPELINE_MAX_SENT with it.
 * Sends the batch when it is full. cmd's deadline is timeout_ms (> 0) from
 * now: still queued then (the server stopped reading: flow control), it is
 * taken out, never sent, and the next pipeline_flush reports it. A full
 * batch that neither goes out nor loses commands to their deadlines within
 * timeout_ms leaves cmd out: -1 with e (MESHD_E_DEADLINE), so the queue
 * stays bounded. 0, or -1 with e
 * when the stream is over (it says why; nothing more can be queued). 1 (not
 * queued) for a command of more than PIPELINE_MAX_BYTES: the caller sends it
 * alone (Execute), where a server whose --max-message-bytes it passes refuses
 * that call, not the stream and every command batched with it. */
int pipeline_queue(pipeline_t *p, const ProtobufCMessage *cmd, uint64_t seq, uint64_t sent,
                   int timeout_ms, direct_err_t *e);

/* Sends what is queued and waits up to timeout_ms (> 0) for every answer
 * (a server that is not reading leaves the batch queued or in flight).
 * When the wait timed out, the commands still queued, never handed to the
 * stream, are taken out (they never run), and the answers of those sent
 * still come (a later flush waits for them). Then hands over the rejections
 * and the commands taken out unsent (here or, earlier, at their own
 * deadlines): 0 when there were none; -1 with e naming the one of lowest
 * seq (MESHD_E_RPC for a rejection, with how many followed; MESHD_E_DEADLINE
 * for commands taken out, with their seqs; asynchronous reports, seq 0,
 * last) and the other kind after it, *seq its seq; they are then forgotten.
 * -1 also when the wait timed out (MESHD_E_DEADLINE, *seq 0), or when the
 * stream ended (*seq 0). */
int pipeline_flush(pipeline_t *p, int timeout_ms, direct_err_t *e, uint64_t *seq);

/* Whether rejections or commands taken out wait to be handed over
 * (pipeline_flush). */
bool pipeline_rejections(pipeline_t *p);

/* True once the stream failed or ended: nothing more can be queued. */
bool pipeline_over(pipeline_t *p);

/* The pipeline's counters. */
void pipeline_stats(pipeline_t *p, meshd_pipeline_stats_t *out);

/* Flushes, half-closes the stream, waits for its end (cancels it past
 * timeout_ms, one deadline for all of it), joins the threads and frees p: at
 * most about timeout_ms, even with a server that stopped reading. Returns
 * that flush's result (pipeline_flush: 0, or -1 with e and *seq; e and seq
 * may be NULL: dropped). NULL p is ignored (0). */
int pipeline_close(pipeline_t *p, int timeout_ms, direct_err_t *e, uint64_t *seq);

#endif
