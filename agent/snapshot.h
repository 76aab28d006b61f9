/* What an Agent/Read streams: a tensor as one point of its stream's order
 * left it (the Snapshot instruction), read out chunk by chunk.
 *
 * A snapshot holds no copy while nothing writes the memory it reads: it
 * pins the storage, and the Read copies chunks out of it as the peer takes
 * them. An instruction about to write a pinned storage (an in-place op, a
 * reduce into it) first calls snapshot_before_write, which copies each
 * snapshot pinned on it to host memory (only the snapshot's own elements)
 * and unpins it; the write then goes ahead in place. So a Fetch never sees
 * a later write, an unread Fetch holds no copy of a tensor nobody writes, and
 * a writer never waits for a reader (a client that fetches, writes, then
 * syncs before it reads the fetch would deadlock otherwise).
 *
 *   snapshot_t *s = snapshot_pin(backend, bs, &t, &err); // worker, at the Snapshot
 *   snapshot_before_write(backend, storage, &err);  // worker, before a write
 *   snapshot_read(s, off, n, buf, &err);            // Read, chunk by chunk
 *   snapshot_release(s);                            // Read done, session end
 *
 * Thread-safe: a read and a write's copy of the same snapshot take turns. */
#ifndef MESHD_AGENT_SNAPSHOT_H
#define MESHD_AGENT_SNAPSHOT_H

#include <stddef.h>

#include "backend.h"

typedef struct snapshot snapshot_t;

/* Pins t (its view: dtype, layout, storage) as stream bs's work queued so far
 * leaves it: reads are ordered after that point, and after nothing queued
 * later on any stream. NULL with err when out of memory or the device cannot
 * mark the point. */
snapshot_t *snapshot_pin(backend_t *b, backend_stream_t *bs, const agent_tensor_t *t,
                         meshd_error_t *err);
/* The pinned view's dtype and layout. */
const tensor_meta_t *snapshot_meta(const snapshot_t *s);
/* Bytes the snapshot's elements take row-major. */
size_t snapshot_bytes(const snapshot_t *s);
/* Copies bytes [off, off + n) of the snapshot's row-major elements into dst;
 * off and n are multiples of the element size. 0, or -1 with err. */
int snapshot_read(snapshot_t *s, size_t off, size_t n, void *dst, meshd_error_t *err);
/* Before a write into st: every snapshot pinned on it moves to host memory
 * (a copy of its elements) and lets go of st. 0, or -1 with err (QUOTA: no
 * host memory for a copy; the write must not happen). Free when nothing is
 * pinned on st. */
int snapshot_before_write(backend_t *b, agent_storage_t *st, meshd_error_t *err);
/* NULL is a no-op. */
void snapshot_release(snapshot_t *s);
/* Host copies made by snapshot_before_write in this process (tests). */
uint64_t snapshot_copies(void);

#endif
