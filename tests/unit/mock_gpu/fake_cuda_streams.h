/* A fake CUDA runtime that behaves like a GPU's streams, for the cuda
 * backend's real-device path (cuda_backend.c, cuda_device.c) on a machine
 * without one (test_cuda_backend_mock_gpu.c). fake_cuda_streams.c defines the
 * runtime calls those files make, and link stubs for the kernels, cuBLAS and
 * NCCL, which this suite does not run.
 *
 * Each stream is a worker thread running its queued operations in order,
 * asynchronously to the host: copies, memsets, event records and waits,
 * stream-ordered frees, and the test's own gates and "kernels". Holding a
 * stream with a closed gate shows what the backend waits for: a host call that
 * should not wait returns while the gate is closed; one that should does not.
 *
 * Device memory is fake_device_memory.c's. Every operation that touches it
 * checks, when queued and again when it runs, that it lies in a live
 * allocation: memory freed in the wrong order (before work that uses it ran)
 * aborts the process, and the test fails as crashed. So does the NULL stream,
 * which the backend never uses. Process-wide state: Criterion runs each test
 * in its own process. */
#ifndef MESHD_TEST_FAKE_CUDA_STREAMS_H
#define MESHD_TEST_FAKE_CUDA_STREAMS_H

#include <stdatomic.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "fake_device_memory.h"

/* The fake device: cuda:0 only, with this much memory (cudaMemGetInfo). */
#define FAKE_DEVICE_BYTES ((size_t)1 << 30)

/* The fake's clock: one tick per operation a stream ran and per gate opened,
 * so a test can tell which of two things happened first. */
uint64_t fake_now(void);

/* A gate holds every stream it is queued on until the test opens it. Gates
 * are static (a few per test), never freed; opening one twice is harmless. */
typedef struct fake_gate fake_gate_t;
fake_gate_t *fake_gate_new(void);
void fake_gate_queue(cudaStream_t s, fake_gate_t *g);
/* Returns the tick at which the gate opened (the first time). */
uint64_t fake_gate_open(fake_gate_t *g);
/* Opens every gate made so far: a failing test calls it so nothing hangs. */
void fake_gate_open_all(void);

/* Queues fn(arg) on s, a kernel of the test's own: it runs on the stream's
 * worker thread in s's order. It must not wait for any stream. */
void fake_stream_call(cudaStream_t s, void (*fn)(void *), void *arg);

/* The tick at which the stream-ordered free (cudaFreeAsync) of p ran; 0 while
 * it has not. The latest such free when p's address was reused. */
uint64_t fake_freed_at(const void *p);

/* Whether an operation may touch [p, p + bytes) now: device memory whose
 * stream-ordered allocation already ran on its stream (a test's kernel
 * checks it: memory used on a stream not ordered after its allocation is an
 * ordering bug, caught when the allocating stream is held). */
bool fake_dev_ready(const void *p, size_t bytes);

/* CUDA objects created and not destroyed yet. */
int fake_streams_live(void);
int fake_events_live(void);

/* Knob: cudaStreamQuery returns this error when it is not cudaSuccess (a
 * device that failed, as a sticky error reports it). */
extern _Atomic int fake_query_error;
/* Knob: cudaEventCreateWithFlags fails with this error when it is not
 * cudaSuccess (a sticky one: the device is lost). */
extern _Atomic int fake_event_error;

#endif
