/* The cuda backend's vtable (cuda_backend.c) and device helpers (cuda_device.c)
 * on device "cuda:0", over a fake CUDA runtime whose streams run their queued
 * work in order and asynchronously to the host (fake_cuda_streams.c). The
 * suite is about ordering: what a host transfer waits for (the work queued
 * before it on its own stream, nothing on any other), what a free waits for
 * (every stream), that an event orders a snapshot-style read, and that
 * stream_sync, stream_destroy and health wait for what they should.
 *
 * A stream is held with a closed gate. Whatever might block runs on a helper
 * thread that the test waits for a bounded time, then every gate opens, so a
 * wrong wait fails the test instead of hanging it. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_internal.h"
#include "fake_cuda_streams.h"

/* How long a call that must not wait gets to return, and how long one that
 * must wait is watched before its gate opens (far longer than any fake op). */
#define RETURN_MS 3000
#define HOLD_MS 150

#define N 64 /* int32 elements of a test tensor */
#define BYTES (N * sizeof(int32_t))

static backend_t B;

static void setup(void) {
  memset(&B, 0, sizeof B);
  B.ops = &cuda_backend_ops;
  B.capacity = (uint64_t)1 << 20;
  meshd_error_t e;
  cr_assert_eq(B.ops->open(&B, "cuda:0", &e), 0, "%s", e.msg);
}

static void teardown(void) {
  fake_gate_open_all(); /* a failed test may have left one closed */
  if (B.impl) B.ops->close(&B);
}

TestSuite(cuda_backend_mock_gpu, .init = setup, .fini = teardown, .timeout = 20);

/* ------------------------------------------------------------------ tensors */

/* 1-D int32 tensors of N elements on memory from the alloc slot. The
 * tests' tensors are few: a static pool, its storages freed by their test. */
static agent_tensor_t tensors[8];
static agent_storage_t storages[8];
static int ntensors;

static agent_tensor_t *tensor_on(backend_stream_t *s) {
  cr_assert_lt(ntensors, 8);
  agent_tensor_t *t = &tensors[ntensors];
  agent_storage_t *st = &storages[ntensors++];
  meshd_error_t e;
  t->meta.dtype = DTYPE_INT32;
  cr_assert_eq(layout_contiguous(&t->meta.layout, (const int64_t[]){N}, 1, 4, "test", &e), 0);
  st->refs = 1;
  st->backend = &B;
  st->bytes = BYTES;
  cr_assert_not_null(st->data = B.ops->alloc(&B, s, BYTES));
  t->storage = st;
  return t;
}

static void tensor_free(agent_tensor_t *t) {
  B.ops->free(&B, t->storage->data, t->storage->bytes);
  t->storage->data = NULL;
}

static void pattern(int32_t *v, int32_t base) {
  for (int i = 0; i < N; i++) v[i] = base + i;
}

static void expect_pattern(const int32_t *v, int32_t base, const char *what) {
  for (int i = 0; i < N; i++)
    cr_assert_eq(v[i], base + i, "%s: element %d is %d, want %d", what, i, v[i], base + i);
}

/* ------------------------------------------------------------------ kernels */

/* A kernel writing base + i into a tensor's memory, in stream order. */
typedef struct {
  int32_t *p;
  int32_t base;
  atomic_bool ran;
} fill_t;

static void fill_kernel(void *arg) {
  fill_t *f = arg;
  REQUIRE(fake_dev_ready(f->p, BYTES)); /* allocated and not freed yet: ordered both ways */
  pattern(f->p, f->base);
  f->ran = true;
}

static void queue_fill(backend_stream_t *s, fill_t *f, agent_tensor_t *t, int32_t base) {
  *f = (fill_t){.p = t->storage->data, .base = base};
  fake_stream_call(s->s, fill_kernel, f);
}

/* A kernel copying a tensor's memory out, in stream order. */
typedef struct {
  const int32_t *p;
  int32_t seen[N];
} read_t;

static void read_kernel(void *arg) {
  read_t *r = arg;
  REQUIRE(fake_dev_ready(r->p, BYTES));
  memcpy(r->seen, r->p, BYTES);
}

/* ------------------------------------------------------------------ calls on a helper thread */

typedef enum { TO_HOST, FROM_HOST, STREAM_SYNC, STREAM_DESTROY, FREE, HEALTH } call_kind_t;

typedef struct {
  call_kind_t kind;
  backend_stream_t *s;
  agent_tensor_t *t;
  void *host; /* N int32 */
  int rc;
  meshd_error_t e;
  atomic_bool done;
  pthread_t th;
} call_t;

static void *call_run(void *arg) {
  call_t *c = arg;
  switch (c->kind) {
  case TO_HOST: c->rc = B.ops->to_host(&B, c->s, c->t, c->host, &c->e); break;
  case FROM_HOST: c->rc = B.ops->from_host(&B, c->s, c->t, c->host, &c->e); break;
  case STREAM_SYNC: c->rc = B.ops->stream_sync(&B, c->s, &c->e); break;
  case STREAM_DESTROY: B.ops->stream_destroy(&B, c->s); break;
  case FREE: B.ops->free(&B, c->t->storage->data, c->t->storage->bytes); break;
  case HEALTH: c->rc = B.ops->health(&B, &c->e); break;
  }
  c->done = true;
  return NULL;
}

static void call_start(call_t *c) {
  c->done = false;
  cr_assert_eq(pthread_create(&c->th, NULL, call_run, c), 0);
}

/* Whether the call returned within ms. */
static bool returned_within(call_t *c, int ms) {
  for (int i = 0; i < ms && !c->done; i++) usleep(1000);
  return c->done;
}

/* Joins the call: open the gates that could hold it first. */
static void call_join(call_t *c) {
  pthread_join(c->th, NULL);
  cr_assert_eq(c->rc, 0, "%s", c->e.msg);
}

static void to_host(backend_stream_t *s, agent_tensor_t *t, int32_t *out) {
  meshd_error_t e;
  cr_assert_eq(B.ops->to_host(&B, s, t, out, &e), 0, "%s", e.msg);
}

static void from_host(backend_stream_t *s, agent_tensor_t *t, int32_t base) {
  int32_t v[N];
  pattern(v, base);
  meshd_error_t e;
  cr_assert_eq(B.ops->from_host(&B, s, t, v, &e), 0, "%s", e.msg);
}

static backend_stream_t *own_stream(void) { return &cuda_state(&B)->own; }

/* ------------------------------------------------------------------ 1: another stream's work */

/* A transfer on stream a (NULL: the own stream) returns while another stream
 * is held: it waits for nothing queued there. */
static void transfer_beside_held_stream(call_kind_t kind, bool own) {
  backend_stream_t *a = own ? NULL : B.ops->stream_create(&B);
  backend_stream_t *other = B.ops->stream_create(&B);
  cr_assert(other && (own || a));
  agent_tensor_t *t = tensor_on(a);
  from_host(a, t, 10);
  fake_gate_t *g = fake_gate_new();
  fake_gate_queue(other->s, g);

  int32_t host[N];
  pattern(host, 20);
  call_t c = {.kind = kind, .s = a, .t = t, .host = host};
  call_start(&c);
  bool returned = returned_within(&c, RETURN_MS);
  fake_gate_open(g);
  call_join(&c);
  cr_assert(returned, "%s on %s waited for another, held, stream",
            kind == TO_HOST ? "to_host" : "from_host", own ? "the own stream" : "stream A");

  int32_t got[N];
  to_host(a, t, got);
  expect_pattern(kind == TO_HOST ? host : got, kind == TO_HOST ? 10 : 20, "tensor");
  tensor_free(t);
  B.ops->stream_destroy(&B, other);
  if (a) B.ops->stream_destroy(&B, a);
}

Test(cuda_backend_mock_gpu, to_host_does_not_wait_for_other_streams) {
  transfer_beside_held_stream(TO_HOST, false);
}

Test(cuda_backend_mock_gpu, from_host_does_not_wait_for_other_streams) {
  transfer_beside_held_stream(FROM_HOST, false);
}

Test(cuda_backend_mock_gpu, own_stream_to_host_does_not_wait_for_other_streams) {
  transfer_beside_held_stream(TO_HOST, true);
}

Test(cuda_backend_mock_gpu, own_stream_from_host_does_not_wait_for_other_streams) {
  transfer_beside_held_stream(FROM_HOST, true);
}

/* t's N elements as an 8 x 8 transposed view: not contiguous. */
static agent_tensor_t transposed(const agent_tensor_t *t) {
  agent_tensor_t tr = *t;
  tr.meta.layout.ndim = 2;
  tr.meta.layout.sizes[0] = tr.meta.layout.sizes[1] = 8;
  tr.meta.layout.strides[0] = 1;
  tr.meta.layout.strides[1] = 8;
  return tr;
}

/* A transposed view goes through the device gather / scatter (scratch memory
 * on the device): neither waits for another stream either. */
Test(cuda_backend_mock_gpu, strided_transfers_do_not_wait_for_other_streams) {
  backend_stream_t *a = B.ops->stream_create(&B), *other = B.ops->stream_create(&B);
  agent_tensor_t *t = tensor_on(a);
  agent_tensor_t tr = transposed(t);
  fake_gate_t *g = fake_gate_new();
  fake_gate_queue(other->s, g);

  int32_t up[N], down[N];
  pattern(up, 0);
  call_t c = {.kind = FROM_HOST, .s = a, .t = &tr, .host = up};
  call_start(&c);
  bool up_returned = returned_within(&c, RETURN_MS);
  call_t d = {.kind = TO_HOST, .s = a, .t = &tr, .host = down};
  if (up_returned) call_start(&d);
  bool down_returned = up_returned && returned_within(&d, RETURN_MS);
  fake_gate_open(g);
  call_join(&c);
  if (up_returned) call_join(&d);
  cr_assert(up_returned, "a strided from_host waited for another stream");
  cr_assert(down_returned, "a strided to_host waited for another stream");
  expect_pattern(down, 0, "round trip through the transposed view");

  int32_t flat[N]; /* the storage holds the transpose */
  to_host(a, t, flat);
  for (int i = 0; i < 8; i++)
    for (int j = 0; j < 8; j++) cr_assert_eq(flat[j * 8 + i], up[i * 8 + j]);
  tensor_free(t);
  B.ops->stream_destroy(&B, other);
  B.ops->stream_destroy(&B, a);
}

/* ------------------------------------------------------------------ 2, 3: its own stream's work */

/* to_host waits for the work queued before it on its stream: a held kernel's
 * bytes are what it returns. */
static void to_host_after_held_kernel(bool own) {
  backend_stream_t *a = own ? NULL : B.ops->stream_create(&B);
  backend_stream_t *q = own ? own_stream() : a;
  agent_tensor_t *t = tensor_on(a);
  from_host(a, t, 0);
  fake_gate_t *g = fake_gate_new();
  fake_gate_queue(q->s, g);
  fill_t f;
  queue_fill(q, &f, t, 100);

  int32_t out[N];
  call_t c = {.kind = TO_HOST, .s = a, .t = t, .host = out};
  call_start(&c);
  bool early = returned_within(&c, HOLD_MS);
  fake_gate_open(g);
  call_join(&c);
  cr_assert_not(early, "to_host returned before the work queued before it on its stream ran");
  cr_assert(f.ran);
  expect_pattern(out, 100, "to_host after the kernel");
  tensor_free(t);
  if (a) B.ops->stream_destroy(&B, a);
}

Test(cuda_backend_mock_gpu, to_host_waits_for_its_stream) { to_host_after_held_kernel(false); }

/* The gather of a strided to_host, and its scratch memory's release, follow
 * the held kernel too (the gather aborts on scratch freed before it ran). */
Test(cuda_backend_mock_gpu, strided_to_host_waits_for_its_stream) {
  backend_stream_t *a = B.ops->stream_create(&B);
  agent_tensor_t *t = tensor_on(a);
  agent_tensor_t tr = transposed(t);
  fake_gate_t *g = fake_gate_new();
  fake_gate_queue(a->s, g);
  fill_t f;
  queue_fill(a, &f, t, 0);

  int32_t out[N];
  call_t c = {.kind = TO_HOST, .s = a, .t = &tr, .host = out};
  call_start(&c);
  bool early = returned_within(&c, HOLD_MS);
  fake_gate_open(g);
  call_join(&c);
  cr_assert_not(early, "a strided to_host returned before the work queued before it ran");
  for (int i = 0; i < 8; i++)
    for (int j = 0; j < 8; j++) cr_assert_eq(out[i * 8 + j], j * 8 + i);
  tensor_free(t);
  B.ops->stream_destroy(&B, a);
}

Test(cuda_backend_mock_gpu, own_stream_to_host_waits_for_the_own_stream) {
  to_host_after_held_kernel(true);
}

/* from_host's bytes are on the device for the work queued after it. */
Test(cuda_backend_mock_gpu, from_host_precedes_later_work_on_its_stream) {
  backend_stream_t *a = B.ops->stream_create(&B);
  agent_tensor_t *t = tensor_on(a);
  from_host(a, t, 30);
  read_t r = {.p = t->storage->data};
  fake_stream_call(a->s, read_kernel, &r);
  meshd_error_t e;
  cr_assert_eq(B.ops->stream_sync(&B, a, &e), 0, "%s", e.msg);
  expect_pattern(r.seen, 30, "a kernel after from_host");
  tensor_free(t);
  B.ops->stream_destroy(&B, a);
}

/* from_host lands after the work queued before it on its stream: a held
 * kernel's write does not overwrite the upload later. */
Test(cuda_backend_mock_gpu, from_host_follows_earlier_work_on_its_stream) {
  backend_stream_t *a = B.ops->stream_create(&B);
  agent_tensor_t *t = tensor_on(a);
  fake_gate_t *g = fake_gate_new();
  fake_gate_queue(a->s, g);
  fill_t f;
  queue_fill(a, &f, t, 100);

  int32_t up[N];
  pattern(up, 40);
  call_t c = {.kind = FROM_HOST, .s = a, .t = t, .host = up};
  call_start(&c);
  bool early = returned_within(&c, HOLD_MS);
  fake_gate_open(g);
  call_join(&c);
  cr_assert_not(early, "from_host returned before the work queued before it on its stream ran");
  int32_t out[N];
  to_host(a, t, out);
  expect_pattern(out, 40, "the upload, after the kernel's write");
  tensor_free(t);
  B.ops->stream_destroy(&B, a);
}

/* ------------------------------------------------------------------ 4: frees */

/* Memory a held kernel on another stream uses is released only after that
 * kernel ran (the kernel itself aborts if it finds the memory freed). */
static void free_after_held_use(bool alloc_on_user) {
  backend_stream_t *user = B.ops->stream_create(&B);
  agent_tensor_t *t = tensor_on(alloc_on_user ? user : NULL);
  void *p = t->storage->data;
  fake_gate_t *g = fake_gate_new();
  fake_gate_queue(user->s, g);
  fill_t f;
  queue_fill(user, &f, t, 7);

  call_t c = {.kind = FREE, .t = t};
  call_start(&c);
  (void)returned_within(&c, HOLD_MS); /* whether a free blocks is the backend's choice */
  uint64_t opened = fake_gate_open(g);
  call_join(&c);
  t->storage->data = NULL;
  cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
  cr_assert(f.ran);
  cr_assert_neq(fake_freed_at(p), 0, "the free never ran");
  cr_assert_gt(fake_freed_at(p), opened, "the free ran before the held kernel using the memory");
  B.ops->stream_destroy(&B, user);
}

Test(cuda_backend_mock_gpu, free_waits_for_the_stream_it_was_allocated_on) {
  free_after_held_use(true);
}

Test(cuda_backend_mock_gpu, free_waits_for_every_stream) { free_after_held_use(false); }

/* ------------------------------------------------------------------ 5: events */

/* A snapshot-style read: stream `reader` waits for an event recorded on a,
 * and a transfer on reader waits for the work a queued before the event
 * (held by gate `before`), not for what a queued after it (held by `after`),
 * and returns the bytes as of the event. */
Test(cuda_backend_mock_gpu, to_host_after_event_reads_the_recorded_point) {
  backend_stream_t *a = B.ops->stream_create(&B);
  agent_tensor_t *t = tensor_on(a);
  from_host(a, t, 0);
  fake_gate_t *before = fake_gate_new(), *after = fake_gate_new();
  fake_gate_queue(a->s, before);
  fill_t f1, f2;
  queue_fill(a, &f1, t, 50);
  backend_event_t *ev = B.ops->event_record(&B, a);
  cr_assert_not_null(ev);
  fake_gate_queue(a->s, after);
  queue_fill(a, &f2, t, 60);

  backend_stream_t *reader = B.ops->stream_create(&B);
  cr_assert_eq(B.ops->event_wait(&B, reader, ev), 0);
  int32_t out[N];
  call_t c = {.kind = TO_HOST, .s = reader, .t = t, .host = out};
  call_start(&c);
  bool early = returned_within(&c, HOLD_MS);
  fake_gate_open(before);
  bool returned = returned_within(&c, RETURN_MS);
  bool overwritten = f2.ran;
  fake_gate_open(after);
  call_join(&c);
  cr_assert_not(early, "to_host after the event did not wait for the work before it");
  cr_assert(returned, "to_host after the event waited for the work queued after it");
  cr_assert_not(overwritten);
  expect_pattern(out, 50, "the bytes as of the event");

  to_host(a, t, out);
  expect_pattern(out, 60, "the bytes after the held kernel");
  B.ops->event_destroy(&B, ev);
  tensor_free(t);
  B.ops->stream_destroy(&B, reader);
  B.ops->stream_destroy(&B, a);
}

/* An event recorded on a stream orders another stream after the work
 * queued before it: a kernel on t sees a's held write. */
Test(cuda_backend_mock_gpu, event_wait_orders_a_stream_after_the_record) {
  backend_stream_t *a = B.ops->stream_create(&B), *t2 = B.ops->stream_create(&B);
  agent_tensor_t *t = tensor_on(a);
  fake_gate_t *g = fake_gate_new();
  fake_gate_queue(a->s, g);
  fill_t f;
  queue_fill(a, &f, t, 70);
  backend_event_t *ev = B.ops->event_record(&B, a);
  cr_assert_eq(B.ops->event_wait(&B, t2, ev), 0);
  B.ops->event_destroy(&B, ev); /* while pending: released once it completes */
  read_t r = {.p = t->storage->data};
  fake_stream_call(t2->s, read_kernel, &r);
  fake_gate_open(g);
  meshd_error_t e;
  cr_assert_eq(B.ops->stream_sync(&B, t2, &e), 0, "%s", e.msg);
  expect_pattern(r.seen, 70, "a kernel after the event wait");
  tensor_free(t);
  B.ops->stream_destroy(&B, t2);
  B.ops->stream_destroy(&B, a);
}

/* ------------------------------------------------------------------ streams, health */

/* stream_sync waits for its stream, and only for it. */
Test(cuda_backend_mock_gpu, stream_sync_waits_for_its_stream_only) {
  backend_stream_t *a = B.ops->stream_create(&B), *other = B.ops->stream_create(&B);
  fake_gate_t *ga = fake_gate_new(), *go = fake_gate_new();
  fake_gate_queue(a->s, ga);
  fake_gate_queue(other->s, go);
  call_t c = {.kind = STREAM_SYNC, .s = a};
  call_start(&c);
  bool early = returned_within(&c, HOLD_MS);
  fake_gate_open(ga);
  bool returned = returned_within(&c, RETURN_MS);
  fake_gate_open(go);
  call_join(&c);
  cr_assert_not(early, "stream_sync returned with its stream held");
  cr_assert(returned, "stream_sync waited for another stream");
  B.ops->stream_destroy(&B, other);
  B.ops->stream_destroy(&B, a);
}

/* stream_destroy waits for the work queued on the stream (backend.h). */
Test(cuda_backend_mock_gpu, stream_destroy_waits_for_its_work) {
  int before = fake_streams_live(); /* the backend's own */
  backend_stream_t *a = B.ops->stream_create(&B);
  agent_tensor_t *t = tensor_on(a);
  fake_gate_t *g = fake_gate_new();
  fake_gate_queue(a->s, g);
  fill_t f;
  queue_fill(a, &f, t, 1);
  call_t c = {.kind = STREAM_DESTROY, .s = a};
  call_start(&c);
  bool early = returned_within(&c, HOLD_MS);
  fake_gate_open(g);
  call_join(&c);
  cr_assert_not(early, "stream_destroy returned with work queued");
  cr_assert(f.ran);
  cr_assert_eq(fake_streams_live(), before);
  tensor_free(t);
}

/* health neither waits for a busy device nor takes it as lost; a sticky
 * error makes it report the device lost, for good. */
Test(cuda_backend_mock_gpu, health_reports_a_sticky_error_and_not_a_busy_stream) {
  fake_gate_t *g = fake_gate_new();
  fake_gate_queue(own_stream()->s, g);
  call_t c = {.kind = HEALTH};
  call_start(&c);
  bool returned = returned_within(&c, RETURN_MS);
  fake_gate_open(g);
  call_join(&c);
  cr_assert(returned, "health waited for the own stream");

  fake_query_error = cudaErrorIllegalAddress;
  meshd_error_t e;
  cr_assert_eq(B.ops->health(&B, &e), -1);
  cr_assert_eq(e.kind, ERR_UNAVAILABLE);
  cr_assert(strstr(e.msg, "device lost") && strstr(e.msg, "illegal memory access"), "%s", e.msg);
  fake_query_error = cudaSuccess;
  cr_assert_eq(B.ops->health(&B, &e), -1, "a lost device stays lost");
}

/* ------------------------------------------------------------------ 6: open, close */

Test(cuda_backend_mock_gpu, open_refuses_a_missing_device_and_caps_the_capacity) {
  backend_t other = {.ops = &cuda_backend_ops};
  meshd_error_t e;
  cr_assert_eq(other.ops->open(&other, "cuda:1", &e), -1);
  cr_assert_eq(e.kind, ERR_UNAVAILABLE);
  cr_assert(strstr(e.msg, "has 1 CUDA device"), "%s", e.msg);
  cr_assert_eq(other.ops->open(&other, "cuda:0", &e), 0, "%s", e.msg);
  cr_assert_eq(other.capacity, FAKE_DEVICE_BYTES, "no --memory-bytes: the device's memory");
  other.ops->close(&other);
  cr_assert_eq(B.capacity, (uint64_t)1 << 20, "--memory-bytes below the device's is kept");
}

/* Streams, events (one destroyed while pending) and memory on every kind of
 * stream, released in the agent's order: nothing is left after close. */
Test(cuda_backend_mock_gpu, close_leaves_nothing) {
  backend_stream_t *a = B.ops->stream_create(&B), *b2 = B.ops->stream_create(&B);
  agent_tensor_t *ta = tensor_on(a), *tb = tensor_on(b2), *tn = tensor_on(NULL);
  from_host(a, ta, 1);
  from_host(b2, tb, 2);
  from_host(NULL, tn, 3);
  fake_gate_t *g = fake_gate_new();
  fake_gate_queue(a->s, g);
  backend_event_t *pending = B.ops->event_record(&B, a);
  backend_event_t *done = B.ops->event_record(&B, b2);
  cr_assert(pending && done);
  cr_assert_eq(B.ops->event_wait(&B, b2, pending), 0);
  B.ops->event_destroy(&B, pending);
  fake_gate_open(g);
  B.ops->event_destroy(&B, done);
  tensor_free(ta);
  tensor_free(tb);
  tensor_free(tn);
  B.ops->stream_destroy(&B, a);
  B.ops->stream_destroy(&B, b2);
  B.ops->close(&B);
  cr_assert_null(B.impl);
  cr_assert_eq(fake_streams_live(), 0);
  cr_assert_eq(fake_events_live(), 0);
  cr_assert_eq(fake_dev_live(), 0);
  cr_assert_eq(atomic_load(&B.allocated), 0);
}

/* ------------------------------------------------------------------ review: sticky errors */

/* A device that failed (a sticky error: every CUDA call returns it) while a
 * free orders the release stream: release_waits_for_all holds st->mu and its
 * cuda_check marks the device lost, which takes st->mu again. The free must
 * return, and health must then report the device lost (it takes st->mu too). */
Test(cuda_backend_mock_gpu, a_sticky_error_while_ordering_a_free_does_not_deadlock) {
  agent_tensor_t *t = tensor_on(NULL);
  fake_event_error = cudaErrorIllegalAddress;
  call_t f = {.kind = FREE, .t = t};
  call_start(&f);
  bool freed = returned_within(&f, RETURN_MS);
  cr_assert(freed, "the free hangs: cuda_mark_lost relocks st->mu under release_waits_for_all");
  pthread_join(f.th, NULL);
  t->storage->data = NULL;
  call_t h = {.kind = HEALTH};
  call_start(&h);
  cr_assert(returned_within(&h, RETURN_MS), "health hangs on st->mu");
  pthread_join(h.th, NULL);
  cr_assert_eq(h.rc, -1, "health must report the device lost");
  fake_event_error = 0;
}

/* stream_sync is the executor's and session_state_wait_stream's host-side
 * fallback ("no event to be had: wait on the host instead"): when the device
 * cannot make an event (out of resources, not sticky), it must still wait for
 * the stream, not return at once (its callers go on either way). */
Test(cuda_backend_mock_gpu, stream_sync_without_an_event_still_waits) {
  backend_stream_t *a = B.ops->stream_create(&B);
  cr_assert_not_null(a);
  fake_gate_t *g = fake_gate_new();
  fake_gate_queue(a->s, g);
  fake_event_error = cudaErrorMemoryAllocation;
  call_t c = {.kind = STREAM_SYNC, .s = a};
  call_start(&c);
  bool early = returned_within(&c, HOLD_MS);
  fake_gate_open(g);
  pthread_join(c.th, NULL);
  fake_event_error = 0;
  cr_assert(!early, "stream_sync returned (rc %d: %s) while its stream was held", c.rc, c.e.msg);
  B.ops->stream_destroy(&B, a);
}

/* ------------------------------------------------------------------ allocation order */

/* Memory allocated on a held stream exists at once, but is usable only in
 * that stream's order: another stream that waits on an event recorded after
 * the allocation may copy into it once the stream moves, not before. */
Test(cuda_backend_mock_gpu, memory_allocated_on_a_held_stream_is_used_after_an_event) {
  backend_stream_t *a = B.ops->stream_create(&B), *b = B.ops->stream_create(&B);
  cr_assert(a && b);
  fake_gate_t *g = fake_gate_new();
  fake_gate_queue(a->s, g);
  agent_tensor_t *t = tensor_on(a); /* its allocation waits behind the gate */
  backend_event_t *ev = B.ops->event_record(&B, a);
  cr_assert_eq(B.ops->event_wait(&B, b, ev), 0);
  int32_t v[N];
  pattern(v, 90);
  call_t c = {.kind = FROM_HOST, .s = b, .t = t, .host = v};
  call_start(&c);
  bool early = returned_within(&c, HOLD_MS);
  fake_gate_open(g);
  call_join(&c);
  cr_assert_not(early, "from_host on b ran before a's allocation (the gate was closed)");
  int32_t out[N];
  to_host(b, t, out);
  expect_pattern(out, 90, "uploaded on b after a's allocation");
  B.ops->event_destroy(&B, ev);
  tensor_free(t);
  B.ops->stream_destroy(&B, b);
  B.ops->stream_destroy(&B, a);
}

/* The check above is real: the same copy with no event between the streams
 * touches memory whose allocation has not run, and the fake aborts. */
Test(cuda_backend_mock_gpu, memory_used_before_its_allocation_ran_is_caught, .signal = SIGABRT) {
  backend_stream_t *a = B.ops->stream_create(&B), *b = B.ops->stream_create(&B);
  cr_assert(a && b);
  fake_gate_t *g = fake_gate_new();
  fake_gate_queue(a->s, g);
  agent_tensor_t *t = tensor_on(a);
  int32_t v[N];
  pattern(v, 91);
  meshd_error_t e;
  B.ops->from_host(&B, b, t, v, &e); /* unordered: aborts in b's worker */
  fake_gate_open(g);
}

/* The agent's --comm-timeout-ms (backend_t.comm_timeout_ms) bounds the NCCL
 * waits, as it bounds the data plane's: the flag is not only its environment
 * form (MESHD_COMM_TIMEOUT_MS), and the command line beats the environment. */
Test(cuda_backend_mock_gpu, the_agents_comm_timeout_bounds_the_nccl_waits) {
  B.ops->close(&B);
  setenv("MESHD_COMM_TIMEOUT_MS", "60000", 1);
  B.comm_timeout_ms = 1234;
  meshd_error_t e;
  cr_assert_eq(B.ops->open(&B, "cuda:0", &e), 0, "%s", e.msg);
  cr_expect_eq(cuda_state(&B)->comm_timeout_ms, 1234);
  B.ops->close(&B);
  B.comm_timeout_ms = 0; /* none given: the environment, else 30 s */
  cr_assert_eq(B.ops->open(&B, "cuda:0", &e), 0, "%s", e.msg);
  cr_expect_eq(cuda_state(&B)->comm_timeout_ms, 60000);
  B.ops->close(&B);
  unsetenv("MESHD_COMM_TIMEOUT_MS");
  cr_assert_eq(B.ops->open(&B, "cuda:0", &e), 0, "%s", e.msg);
  cr_expect_eq(cuda_state(&B)->comm_timeout_ms, 30000);
}
