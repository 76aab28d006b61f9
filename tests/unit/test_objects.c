/* server/objects: the per-session ref table, storages shared by views, drop,
 * failure and the live/bytes accounting. */
#include <criterion/criterion.h>
#include <malloc.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "objects.h"

static objects_t *o;
static meshd_error_t err;

static void setup(void) {
  o = objects_create();
  cr_assert_not_null(o);
  memset(&err, 0, sizeof err);
}

static void teardown(void) { objects_destroy(o); }

TestSuite(objects, .init = setup, .fini = teardown, .timeout = 30);

#define I64(...) ((const int64_t[]){__VA_ARGS__})

static tensor_meta_t meta(dtype_t d, const int64_t *sizes, int ndim) {
  tensor_meta_t m = {.dtype = d};
  cr_assert_eq(layout_contiguous(&m.layout, sizes, ndim, dtype_size(d), "test", &err), 0, "%s",
               err.msg);
  return m;
}

/* A [2, 3] float32 tensor (24 bytes a rank) on mesh 1, stream main, 4 ranks. */
static obj_t *tensor(uint64_t ref) {
  tensor_meta_t m = meta(DTYPE_FLOAT32, I64(2, 3), 2);
  obj_t *t = objects_new_tensor(o, ref, &m, 1, STREAM_MAIN, 4);
  cr_assert_not_null(t);
  return t;
}

static obj_t *view(uint64_t ref, obj_t *base) {
  tensor_meta_t m = meta(DTYPE_FLOAT32, I64(6), 1);
  obj_t *v = objects_new_view(o, ref, &m, base);
  cr_assert_not_null(v);
  return v;
}

static void expect_err(const void *got, error_kind_t kind, const char *needle) {
  cr_assert_null(got);
  cr_assert_eq(err.kind, kind, "kind %s: %s", error_kind_name(err.kind), err.msg);
  cr_assert(strstr(err.msg, needle), "message '%s' lacks '%s'", err.msg, needle);
}

Test(objects, new_tensor_records_meta_and_a_fresh_storage) {
  obj_t *t = tensor(5);
  cr_assert_eq(t->ref, 5);
  cr_assert_eq(t->kind, OBJ_TENSOR);
  cr_assert_eq(t->state, TENSOR_LIVE);
  cr_assert_eq(t->tensor.mesh, 1);
  cr_assert_eq(t->tensor.stream, STREAM_MAIN);
  tensor_meta_t tm;
  obj_meta(t, &tm);
  cr_assert_eq(tm.dtype, DTYPE_FLOAT32);
  cr_assert_eq(tm.layout.ndim, 2);
  cr_assert_eq(tm.layout.sizes[1], 3);
  storage_t *s = t->tensor.storage;
  cr_assert_not_null(s);
  cr_assert_eq(s->id, 5, "a storage is named after the tensor that created it");
  cr_assert_eq(s->access, ACCESS_R | ACCESS_W);
  cr_assert_eq(s->bytes, 24);
  cr_assert_eq(s->ranks, 4);
  cr_assert_eq(s->refs, 1);
  cr_assert_eq(s->live_aliases, 1);
  cr_assert_eq(s->aliases, t);
  cr_assert_null(t->tensor.next_alias);
  cr_assert_eq(s->borrow, 0);
  cr_assert_eq(o->live_tensors, 1);
  cr_assert_eq(o->bytes, 96, "bytes count every rank: 24 * 4");
  cr_assert_eq(objects_get(o, 5), t);
  cr_assert_null(objects_get(o, 6));

  tensor_meta_t m = meta(DTYPE_INT64, I64(3), 1);
  obj_t *u = objects_new_tensor(o, 6, &m, 2, STREAM_MAIN, 2);
  cr_assert_neq(u->tensor.storage, s, "every new tensor gets its own storage");
  cr_assert_eq(u->tensor.storage->bytes, 24);
  cr_assert_eq(o->live_tensors, 2);
  cr_assert_eq(o->bytes, 96 + 48);
}

Test(objects, zero_dim_and_empty_tensors) {
  tensor_meta_t scalar = meta(DTYPE_FLOAT64, I64(0), 0);
  obj_t *a = objects_new_tensor(o, 1, &scalar, 1, STREAM_MAIN, 3);
  cr_assert_eq(a->tensor.storage->bytes, 8, "a 0-dim tensor holds one element");
  tensor_meta_t empty = meta(DTYPE_FLOAT32, I64(0, 5), 2);
  obj_t *b = objects_new_tensor(o, 2, &empty, 1, STREAM_MAIN, 3);
  cr_assert_eq(b->tensor.storage->bytes, 0);
  cr_assert_eq(o->bytes, 24);
  cr_assert_eq(o->live_tensors, 2);
}

Test(objects, views_share_the_storage_and_count_no_bytes) {
  obj_t *t = tensor(1);
  obj_t *v = view(2, t);
  obj_t *w = view(3, v);
  storage_t *s = t->tensor.storage;
  cr_assert_eq(v->tensor.storage, s);
  cr_assert_eq(w->tensor.storage, s);
  cr_assert_eq(v->tensor.mesh, t->tensor.mesh, "a view lives on its base's mesh");
  cr_assert_eq(v->tensor.stream, t->tensor.stream);
  tensor_meta_t vm;
  cr_assert_eq(obj_meta(v, &vm)->layout.ndim, 1, "a view keeps its own layout");
  cr_assert_eq(s->refs, 3);
  cr_assert_eq(s->live_aliases, 3);
  cr_assert_eq(o->live_tensors, 3);
  cr_assert_eq(o->bytes, 96, "views add no bytes");
  /* every alias is on the storage's list */
  int seen = 0;
  for (obj_t *a = s->aliases; a; a = a->tensor.next_alias) {
    cr_assert(a == t || a == v || a == w);
    seen++;
  }
  cr_assert_eq(seen, 3);
}

Test(objects, dropping_any_alias_drops_the_storage) {
  obj_t *t = tensor(1);
  obj_t *v = view(2, t);
  view(3, t);
  obj_t *other = tensor(4);
  cr_assert_eq(o->live_tensors, 4);
  cr_assert_eq(o->bytes, 192);
  /* Monarch's drop drops every alias: dropping through the view frees all three */
  objects_drop_storage(o, v->tensor.storage, 9);
  for (uint64_t r = 1; r <= 3; r++) {
    cr_assert_null(objects_get(o, r), "ref %llu: the record is freed", (unsigned long long)r);
    const tombstone_t *g = objects_dropped(o, r);
    cr_assert_not_null(g, "ref %llu left no tombstone", (unsigned long long)r);
    cr_assert_eq(g->ref, r);
    cr_assert_eq(g->seq, 9, "the tombstone keeps the drop site");
    cr_assert_eq(g->borrow, 0);
  }
  cr_assert_eq(objects_get(o, 4), other, "other storages are untouched");
  cr_assert_null(objects_dropped(o, 4));
  cr_assert_eq(other->state, TENSOR_LIVE);
  cr_assert_eq(o->live_tensors, 1);
  cr_assert_eq(o->bytes, 96, "only the other tensor's bytes are left");

  objects_drop_storage(o, other->tensor.storage, 10);
  cr_assert_eq(o->live_tensors, 0);
  cr_assert_eq(o->bytes, 0);
  cr_assert_eq(objects_dropped(o, 4)->seq, 10);
  cr_assert_eq(objects_dropped(o, 1)->seq, 9, "earlier tombstones are kept");
}

Test(objects, tombstones_survive_growth) {
  /* Past the first table size (1024 slots at load 1/2) every tombstone must
   * still be found, and refs never defined must not be. */
  tensor_meta_t m = meta(DTYPE_INT8, I64(1), 1);
  for (uint64_t r = 1; r <= 3000; r++) {
    obj_t *t = objects_new_tensor(o, r * 7, &m, 1, STREAM_MAIN, 1);
    cr_assert_not_null(t);
    objects_drop_storage(o, t->tensor.storage, 10000 + r);
  }
  cr_assert_eq(o->live_tensors, 0);
  cr_assert_eq(o->bytes, 0);
  cr_assert_eq(o->ngraves, 3000);
  cr_assert_leq(o->ngraves * 2, o->gcap, "load stays under 1/2");
  for (uint64_t r = 1; r <= 3000; r++) {
    const tombstone_t *g = objects_dropped(o, r * 7);
    cr_assert(g && g->seq == 10000 + r, "ref %llu", (unsigned long long)(r * 7));
    cr_assert_null(objects_dropped(o, r * 7 + 1), "ref %llu was never defined", (unsigned long long)(r * 7 + 1));
  }
  cr_assert_null(objects_dropped(o, 0), "ref 0 is the empty-slot marker, never a tombstone");
}

Test(objects, a_long_session_keeps_only_its_recent_tombstones) {
  /* Memory stays flat however many tensors a session drops: past
   * OBJECTS_GRAVES_MAX the older half is let go; recent drops keep their site,
   * old ones are still known as "maybe dropped", new refs are unaffected. */
  tensor_meta_t m = meta(DTYPE_INT8, I64(1), 1);
  uint64_t n = 3 * OBJECTS_GRAVES_MAX;
  size_t cap_at_max = 0;
  for (uint64_t r = 1; r <= n; r++) {
    obj_t *t = objects_new_tensor(o, r, &m, 1, STREAM_MAIN, 1);
    cr_assert_not_null(t);
    objects_drop_storage(o, t->tensor.storage, 1000000 + r);
    cr_assert_leq(o->ngraves, OBJECTS_GRAVES_MAX);
    if (r == OBJECTS_GRAVES_MAX) cap_at_max = o->gcap;
  }
  cr_assert_leq(o->gcap, cap_at_max, "the table grew past the cap: %zu > %zu", o->gcap, cap_at_max);
  const tombstone_t *g = objects_dropped(o, n);
  cr_assert(g && g->seq == 1000000 + n, "the last drop keeps its site");
  cr_assert_null(objects_dropped(o, 1));
  cr_assert(objects_forgotten(o, 1), "an old drop is known as possibly dropped");
  meshd_error_t e = {0};
  cr_assert_null(objects_expect(o, 1, OBJ_TENSOR, "Call: input", &e));
  cr_assert_eq(e.kind, ERR_UNKNOWN_REF);
  cr_assert(strstr(e.msg, "dropped before"), "%s", e.msg);
  cr_assert_not(objects_forgotten(o, n + 1), "a ref never used is not forgotten");
  obj_t *t = objects_new_tensor(o, n + 1, &m, 1, STREAM_MAIN, 1);
  cr_assert_not_null(t);
  cr_assert_not(objects_forgotten(o, n + 1));
}

Test(objects, failure_marks_every_live_alias) {
  obj_t *t = tensor(1);
  obj_t *v = view(2, t);
  obj_t *other = tensor(4);
  objects_fail_tensor(o, v, 7, ERR_REMOTE_FAILURE, 6, "add: boom on rank 2");
  for (int i = 0; i < 2; i++) {
    obj_t *a = i ? v : t;
    cr_assert_eq(a->state, TENSOR_FAILED, "ref %llu", (unsigned long long)a->ref);
    cr_assert_eq(a->tensor.state_seq, 7);
    cr_assert_eq(obj_fail_kind(a), ERR_REMOTE_FAILURE);
    cr_assert_eq(obj_fail_root_seq(a), 6);
    cr_assert_str_eq(obj_fail_msg(a), "add: boom on rank 2");
  }
  cr_assert_neq(obj_fail_msg(t), obj_fail_msg(v), "each record owns its message");
  cr_assert_eq(other->state, TENSOR_LIVE, "other storages are untouched");
  cr_assert_null(other->tensor.fail);
  cr_assert_eq(o->live_tensors, 3, "failed tensors are still held");
  cr_assert_eq(o->bytes, 192);

  /* a failed tensor keeps its first (root) failure */
  objects_fail_tensor(o, t, 9, ERR_DEPENDENT_FAILURE, 8, "later");
  cr_assert_eq(obj_fail_kind(t), ERR_REMOTE_FAILURE);
  cr_assert_eq(obj_fail_root_seq(t), 6);
  cr_assert_str_eq(obj_fail_msg(t), "add: boom on rank 2");

  /* NULL message: an empty string, not a crash */
  objects_fail_tensor(o, other, 10, ERR_AGENT_LOST, 10, NULL);
  cr_assert_str_eq(obj_fail_msg(other), "");

  /* dropping failed tensors frees them like live ones (ASan: fail_msg freed) */
  objects_drop_storage(o, t->tensor.storage, 11);
  cr_assert_null(objects_get(o, 1));
  cr_assert_null(objects_get(o, 2));
  cr_assert_eq(o->live_tensors, 1);
  cr_assert_eq(o->bytes, 96);
}

Test(objects, a_view_made_after_a_failure_is_live) {
  /* Failure marks the aliases that exist; the caller (commands.c) fails new
   * results itself. */
  obj_t *t = tensor(1);
  objects_fail_tensor(o, t, 3, ERR_REMOTE_FAILURE, 3, "x");
  obj_t *v = view(2, t);
  cr_assert_eq(v->state, TENSOR_LIVE);
  cr_assert_eq(v->tensor.storage, t->tensor.storage);
}

Test(objects, meshes_are_copied_into_their_record) {
  bool healthy[4] = {true, true, true, true};
  mesh_t m;
  cr_assert_eq(mesh_create_root(9, (const char *const[]){"gpu"}, I64(4), 1, healthy, 4, &m, &err), 0,
               "%s", err.msg);
  obj_t *rec = objects_add_mesh(o, 9, &m);
  cr_assert_not_null(rec);
  cr_assert_eq(rec->kind, OBJ_MESH);
  cr_assert_neq(rec->mesh, &m, "the record owns a copy");
  memset(&m, 0, sizeof m);
  cr_assert_eq(rec->mesh->ref, 9);
  cr_assert_eq(mesh_len(rec->mesh), 4);
  cr_assert_str_eq(rec->mesh->names[0], "gpu");
  cr_assert_eq(objects_get(o, 9), rec);
}

Test(objects, expect_names_the_argument_and_the_kinds) {
  tensor(3);
  obj_t *m = objects_add(o, 1, OBJ_MESH);
  cr_assert_not_null(m);
  cr_assert_eq(m->kind, OBJ_MESH);
  cr_assert_not_null(objects_add_stream(o, 2, "side"));

  cr_assert_eq(objects_expect(o, 3, OBJ_TENSOR, "Call add: argument 'other'", &err), objects_get(o, 3));
  cr_assert_eq(objects_expect(o, 1, OBJ_MESH, "Factory: mesh", &err), m);
  expect_err(objects_expect(o, 7, OBJ_TENSOR, "Call add: argument 'other'", &err), ERR_UNKNOWN_REF,
             "Call add: argument 'other' is ref 7, which this session never defined");
  expect_err(objects_expect(o, 1, OBJ_TENSOR, "Call add: argument 'self'", &err), ERR_UNKNOWN_REF,
             "Call add: argument 'self' is ref 1, which is a mesh, not a tensor");
  expect_err(objects_expect(o, 3, OBJ_STREAM, "Sync: stream", &err), ERR_UNKNOWN_REF,
             "Sync: stream is ref 3, which is a tensor, not a stream");
  expect_err(objects_expect(o, 2, OBJ_MESH, "Factory: mesh", &err), ERR_UNKNOWN_REF,
             "is a stream, not a mesh");
  /* stream 0 is main: expect leaves it to the caller without an error */
  memset(&err, 0, sizeof err);
  cr_assert_null(objects_expect(o, STREAM_MAIN, OBJ_STREAM, "Sync: stream", &err));
  cr_assert_eq(err.kind, ERR_NONE);
}

Test(objects, stream_names_and_labels) {
  char buf[OBJ_STREAM_LABEL_MAX];
  cr_assert_not_null(objects_add_stream(o, 4, "side"));
  tensor(5);
  cr_assert_str_eq(objects_stream_name(o, STREAM_MAIN), "main");
  cr_assert_str_eq(objects_stream_name(o, 4), "side");
  cr_assert_str_eq(objects_stream_name(o, 5), "?", "a tensor is not a stream");
  cr_assert_str_eq(objects_stream_name(o, 99), "?");
  /* a name of one stream is its label; a shared one adds each stream's ref */
  cr_assert_str_eq(objects_stream_label(o, 4, buf, sizeof buf), "'side'");
  cr_assert_str_eq(objects_stream_label(o, STREAM_MAIN, buf, sizeof buf), "'main'");
  cr_assert_not_null(objects_add_stream(o, 6, "side"));
  cr_assert_not_null(objects_add_stream(o, 7, "sid"));
  cr_assert_str_eq(objects_stream_label(o, 4, buf, sizeof buf), "'side' (ref 4)");
  cr_assert_str_eq(objects_stream_label(o, 6, buf, sizeof buf), "'side' (ref 6)");
  cr_assert_str_eq(objects_stream_label(o, 7, buf, sizeof buf), "'sid'");
  cr_assert_str_eq(objects_stream_label(o, STREAM_MAIN, buf, sizeof buf), "'main'");
  cr_assert_not_null(objects_add_stream(o, 8, "main"));
  cr_assert_str_eq(objects_stream_label(o, STREAM_MAIN, buf, sizeof buf), "'main' (ref 0)");
  cr_assert_str_eq(objects_stream_label(o, 8, buf, sizeof buf), "'main' (ref 8)");
  cr_assert_eq(o->streams, 4);
  /* the longest name and ref fit */
  char longname[OBJ_STREAM_NAME_MAX + 1];
  memset(longname, 'x', OBJ_STREAM_NAME_MAX);
  longname[OBJ_STREAM_NAME_MAX] = '\0';
  cr_assert_not_null(objects_add_stream(o, UINT64_MAX - 1, longname));
  cr_assert_not_null(objects_add_stream(o, UINT64_MAX, longname));
  objects_stream_label(o, UINT64_MAX, buf, sizeof buf);
  cr_assert(strstr(buf, "' (ref 18446744073709551615)"), "%s", buf);
}

Test(objects, kind_names) {
  cr_assert_str_eq(obj_kind_name(OBJ_MESH), "mesh");
  cr_assert_str_eq(obj_kind_name(OBJ_STREAM), "stream");
  cr_assert_str_eq(obj_kind_name(OBJ_TENSOR), "tensor");
  cr_assert_str_eq(obj_kind_name(OBJ_BORROW), "borrow");
  cr_assert_str_eq(obj_kind_name((obj_kind_t)0), "object");
}

Test(objects, touched_ranks_grow_on_demand) {
  cr_assert_eq(o->ntouched, 0);
  cr_assert(objects_touch(o, 3));
  cr_assert_geq(o->ntouched, 4);
  cr_assert(objects_touch(o, 100));
  cr_assert_gt(o->ntouched, 100);
  cr_assert(objects_touch(o, 3), "touching twice is fine");
  for (size_t r = 0; r < o->ntouched; r++)
    cr_assert_eq(o->touched[r], r == 3 || r == 100, "rank %zu", r);
  cr_assert(objects_touch(o, 0));
  cr_assert_eq(o->touched[0], 1);
  cr_assert_eq(o->touched[1], 0);
}

Test(objects, destroy_frees_shared_storages_once) {
  /* Views, a failed record with a message, a dropped storage, a mesh and a
   * borrow-free session: under ASan a double free or leak shows here. */
  obj_t *t = tensor(1);
  view(2, t);
  obj_t *v = view(3, t);
  objects_fail_tensor(o, v, 4, ERR_REMOTE_FAILURE, 4, "x");
  cr_assert_eq(t->tensor.storage->refs, 3);
  obj_t *u = tensor(6);
  view(7, u);
  objects_drop_storage(o, u->tensor.storage, 8);
  bool healthy[2] = {true, true};
  mesh_t m;
  cr_assert_eq(mesh_create_root(9, (const char *const[]){"gpu"}, I64(2), 1, healthy, 2, &m, &err), 0);
  cr_assert_not_null(objects_add_mesh(o, 9, &m));
  objects_touch(o, 9);
}

/* refmap.h under churn: after every insert and remove, each key is found or not
 * as a plain array says (backward-shift deletion must keep every run whole). */
typedef struct rec {
  uint64_t ref;
  int payload;
} rec_t;

Test(objects, refmap_agrees_with_a_plain_array_under_churn) {
  enum { KEYS = 4096, STEPS = 60000 };
  static rec_t recs[KEYS];
  static bool in[KEYS];
  refmap_t m = {0};
  size_t n = 0;
  uint64_t x = 88172645463325252ull; /* xorshift64 */
  for (int step = 0; step < STEPS; step++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    size_t k = (size_t)(x % KEYS);
    /* Keys that collide in the low bits, and 0, exercise long runs and the edge. */
    uint64_t ref = (uint64_t)k << 20;
    if (in[k]) {
      cr_assert_eq(refmap_remove(&m, ref), &recs[k], "step %d", step);
      in[k] = false;
      n--;
    } else {
      recs[k] = (rec_t){ref, (int)k};
      cr_assert_eq(refmap_put(&m, &recs[k]), 0);
      in[k] = true;
      n++;
    }
    cr_assert_eq(m.n, n);
    if (step % 997 == 0 || step == STEPS - 1)
      for (size_t j = 0; j < KEYS; j++)
        cr_assert_eq(refmap_get(&m, (uint64_t)j << 20), in[j] ? &recs[j] : NULL, "step %d key %zu",
                     step, j);
  }
  size_t seen = 0;
  rec_t *r;
  for (size_t i = 0; (r = refmap_next(&m, &i));) {
    cr_assert(in[r->payload]);
    seen++;
  }
  cr_assert_eq(seen, n);
  cr_assert_null(refmap_remove(&m, 12345), "an absent key");
  cr_assert_leq(m.n * 4, m.cap * 3, "load over 3/4");
  refmap_free(&m);
}

/* Issue 16's goal: at most 256 bytes of server memory per live tensor. Heap in
 * use (glibc's count, chunk overheads included) for 100k live 1-D tensors of
 * their own storage, as bench_commands' memory case makes them; ASan's
 * allocator keeps no such count. */
Test(objects, a_live_tensor_costs_at_most_256_bytes) {
#if defined(__SANITIZE_ADDRESS__)
  cr_skip_test("the sanitizer's allocator does not count heap in use");
#else
  enum { N = 100000 };
  tensor_meta_t m = meta(DTYPE_FLOAT32, I64(4), 1);
  struct mallinfo2 before = mallinfo2();
  for (uint64_t r = 100; r < 100 + N; r++)
    cr_assert_not_null(objects_new_tensor(o, r, &m, 1, STREAM_MAIN, 1));
  struct mallinfo2 after = mallinfo2();
  double per = ((double)(after.uordblks + after.hblkhd) - (double)(before.uordblks + before.hblkhd)) / N;
  cr_log_info("server: %.1f bytes per live tensor", per);
  cr_assert_leq(per, 256.0, "%.1f bytes per live tensor", per);
  cr_assert_eq(o->live_tensors, N);
#endif
}

/* A session whose 256 unreported failures filled the list still keeps an
 * agent's loss noted after them (over the newest other failure): the Sync
 * waiting on that agent names the loss. Other failures past 256 are dropped. */
Test(objects, a_full_failure_list_still_keeps_an_agents_loss) {
  for (int i = 0; i < 300; i++) objects_note_failure(o, ERR_REMOTE_FAILURE, "kernel failed", (uint64_t)i + 1);
  cr_assert_eq(o->nunreported, 256);
  objects_note_failure(o, ERR_AGENT_LOST, "rank 1 lost", 0);
  objects_note_failure(o, ERR_AGENT_LOST, "rank 2 lost", 0);
  cr_assert_eq(o->nunreported, 256);
  cr_assert_eq(o->unreported[255].kind, ERR_AGENT_LOST);
  cr_assert_str_eq(o->unreported[255].msg, "rank 2 lost");
  cr_assert_eq(o->unreported[254].kind, ERR_AGENT_LOST);
  cr_assert_str_eq(o->unreported[254].msg, "rank 1 lost");
  cr_assert_eq(o->unreported[253].kind, ERR_REMOTE_FAILURE);
  cr_assert_eq(o->unreported_seq[253], 254);
}

Test(objects, a_dropped_tensors_failure_keeps_its_origin_within_a_bound) {
  /* A tombstone keeps where its tensor's failure came from (fetch_caught_up):
   * the record it failed with, or a rank's report after the drop; messages
   * are cut, and past OBJECTS_GRAVE_FAILS_MAX the older records go. */
  char big[1000];
  memset(big, 'x', sizeof big - 1);
  big[sizeof big - 1] = '\0';
  obj_t *t = tensor(1);
  o->report_rank = 1;
  o->report_seq = 5;
  o->report_command = 3;
  objects_fail_tensor(o, t, 3, ERR_REMOTE_FAILURE, 3, big);
  objects_drop_storage(o, t->tensor.storage, 9);
  const tombstone_t *g = objects_dropped(o, 1);
  cr_assert(g && g->failure_noted && g->fail);
  cr_assert_eq(g->fail->rank, 1);
  cr_assert_eq(g->fail->rank_seq, 5);
  cr_assert_eq(strlen(g->fail->msg), OBJECTS_GRAVE_FAIL_MSG);

  tensor(2);
  objects_drop_storage(o, objects_get(o, 2)->tensor.storage, 10);
  cr_assert_null(objects_dropped(o, 2)->fail, "a good tensor's tombstone has no failure");
  objects_dropped_failure_origin(o, 2, ERR_DEPENDENT_FAILURE, 0, 7, 4, "late");
  g = objects_dropped(o, 2);
  cr_assert(g->fail && g->fail->rank == 0 && g->fail->rank_seq == 7 && !g->fail->ranks);
  cr_assert_eq(g->fail->kind, ERR_DEPENDENT_FAILURE);
  cr_assert_str_eq(g->fail->msg, "late");
  objects_dropped_failure_origin(o, 2, ERR_REMOTE_FAILURE, 1, 6, 4, "same command");
  cr_assert_not(g->fail->ranks, "one command on two ranks is one origin");
  objects_dropped_failure_origin(o, 2, ERR_REMOTE_FAILURE, 1, 8, 6, "another");
  cr_assert(g->fail->ranks, "another command's on another rank: where is not known");
  objects_dropped_failure_origin(o, 99, ERR_REMOTE_FAILURE, 0, 7, 4, "never defined"); /* no-op */

  for (uint64_t r = 100; r < 100 + 3 * OBJECTS_GRAVE_FAILS_MAX; r++) {
    objects_fail_tensor(o, tensor(r), 3, ERR_REMOTE_FAILURE, 3, big);
    objects_drop_storage(o, objects_get(o, r)->tensor.storage, r);
    cr_assert_leq(o->ngrave_fails, OBJECTS_GRAVE_FAILS_MAX);
  }
  cr_assert_not_null(objects_dropped(o, 99 + 3 * OBJECTS_GRAVE_FAILS_MAX)->fail,
                     "the newest drop keeps its record");
  cr_assert_null(objects_dropped(o, 100)->fail, "an old one's was let go");
  cr_assert(objects_dropped(o, 100)->failure_noted, "but it is still known as failed");
}
