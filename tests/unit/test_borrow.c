/* server/borrow: cross-stream borrows with Monarch's StorageAliases permissions. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "borrow.h"

static objects_t *o;
static meshd_error_t err;

/* Streams: 0 main, 2 "side", 3 "other". Tensors start at ref 5. */
#define SIDE 2
#define OTHER 3

static void add_stream(uint64_t ref, const char *name) {
  cr_assert_not_null(objects_add_stream(o, ref, name));
}

static void setup(void) {
  o = objects_create();
  cr_assert_not_null(o);
  memset(&err, 0, sizeof err);
  add_stream(SIDE, "side");
  add_stream(OTHER, "other");
}

static void teardown(void) { objects_destroy(o); }

TestSuite(borrow, .init = setup, .fini = teardown, .timeout = 30);

static obj_t *tensor(uint64_t ref, uint64_t stream) {
  tensor_meta_t m = {.dtype = DTYPE_FLOAT32};
  cr_assert_eq(layout_contiguous(&m.layout, (const int64_t[]){4}, 1, 4, "test", &err), 0);
  obj_t *t = objects_new_tensor(o, ref, &m, 1, stream, 2);
  cr_assert_not_null(t);
  return t;
}

static obj_t *view(uint64_t ref, obj_t *base) {
  tensor_meta_t m;
  obj_t *v = objects_new_view(o, ref, obj_meta(base, &m), base);
  cr_assert_not_null(v);
  return v;
}

/* Borrow `origin` onto stream as handle `handle`, borrow ref `bref`. */
static obj_t *borrow_ok(uint64_t handle, uint64_t bref, obj_t *origin, uint64_t stream, bool mut) {
  cr_assert_eq(borrow_create(o, bref, handle, origin, stream, mut, &err), 0, "%s", err.msg);
  obj_t *b = objects_get(o, bref);
  cr_assert_not_null(b);
  cr_assert_eq(b->kind, OBJ_BORROW);
  return b;
}

static void expect_err(int rc, error_kind_t kind, const char *needle) {
  cr_assert_eq(rc, -1);
  cr_assert_eq(err.kind, kind, "kind %s: %s", error_kind_name(err.kind), err.msg);
  cr_assert(strstr(err.msg, needle), "message '%s' lacks '%s'", err.msg, needle);
}

/* A rejected borrow defines neither its handle nor its borrow ref. */
static void expect_rejected(uint64_t handle, uint64_t bref, obj_t *origin, uint64_t stream, bool mut,
                            error_kind_t kind, const char *needle) {
  storage_t *s = origin->tensor.storage;
  unsigned access = s->access;
  int reads = s->read_borrows, refs = s->refs;
  uint64_t mb = s->mutable_borrow, live = o->live_tensors;
  expect_err(borrow_create(o, bref, handle, origin, stream, mut, &err), kind, needle);
  cr_assert_null(objects_get(o, handle), "a rejected borrow defines no handle");
  cr_assert_null(objects_get(o, bref), "a rejected borrow defines no borrow");
  cr_assert_eq(s->access, access);
  cr_assert_eq(s->read_borrows, reads);
  cr_assert_eq(s->mutable_borrow, mb);
  cr_assert_eq(s->refs, refs);
  cr_assert_eq(o->live_tensors, live);
}

Test(borrow, read_borrow_leaves_both_sides_readable) {
  obj_t *t = tensor(5, STREAM_MAIN);
  uint64_t bytes = o->bytes;
  obj_t *b = borrow_ok(6, 7, t, SIDE, false);
  obj_t *h = objects_get(o, 6);
  cr_assert_not_null(h);
  cr_assert_eq(h->kind, OBJ_TENSOR);
  cr_assert_eq(h->state, TENSOR_LIVE);
  cr_assert_eq(h->tensor.stream, SIDE, "the handle lives on the borrowing stream");
  cr_assert_eq(h->tensor.mesh, t->tensor.mesh);
  tensor_meta_t hm, tm;
  cr_assert_eq(obj_meta(h, &hm)->dtype, obj_meta(t, &tm)->dtype);
  cr_assert(layout_same_shape(&hm.layout, &tm.layout));
  cr_assert_neq(h->tensor.storage, t->tensor.storage);
  cr_assert_eq(h->tensor.storage->borrow, 7, "the handle's storage knows its borrow");
  cr_assert_eq(t->tensor.storage->access, ACCESS_R, "origin: r");
  cr_assert_eq(h->tensor.storage->access, ACCESS_R, "borrower: r");
  cr_assert_eq(t->tensor.storage->read_borrows, 1);
  cr_assert_eq(t->tensor.storage->mutable_borrow, 0);
  cr_assert_eq(o->bytes, bytes, "the handle is the origin's memory: no new bytes");
  cr_assert_eq(o->live_tensors, 2);

  cr_assert_eq(b->borrow.origin, 5);
  cr_assert_eq(b->borrow.result, 6);
  cr_assert_eq(b->borrow.origin_storage, t->tensor.storage);
  cr_assert_not(b->borrow.is_mutable);
  cr_assert_eq(b->borrow.from_stream, STREAM_MAIN);
  cr_assert_eq(b->borrow.to_stream, SIDE);
  cr_assert_eq(objects_get(o, 7), b);
  cr_assert_null(objects_dropped_borrow(o, 7));
  cr_assert_eq(borrow_holder(o, t->tensor.storage), 7);

  /* a second read borrow (another stream) is fine */
  borrow_ok(8, 9, t, OTHER, false);
  cr_assert_eq(t->tensor.storage->read_borrows, 2);
  cr_assert_eq(t->tensor.storage->access, ACCESS_R);
}

Test(borrow, mutable_borrow_moves_all_access_to_the_handle) {
  obj_t *t = tensor(5, STREAM_MAIN);
  obj_t *b = borrow_ok(6, 7, t, SIDE, true);
  obj_t *h = objects_get(o, 6);
  cr_assert_eq(t->tensor.storage->access, 0, "origin: no access");
  cr_assert_eq(h->tensor.storage->access, ACCESS_R | ACCESS_W, "borrower: rw");
  cr_assert_eq(t->tensor.storage->mutable_borrow, 7);
  cr_assert_eq(t->tensor.storage->read_borrows, 0);
  cr_assert(b->borrow.is_mutable);
  cr_assert_eq(borrow_holder(o, t->tensor.storage), 7);
}

Test(borrow, conflicting_borrows_are_borrowed) {
  obj_t *t = tensor(5, STREAM_MAIN);
  obj_t *v = view(6, t);
  borrow_ok(10, 11, t, SIDE, true);
  expect_rejected(12, 13, t, OTHER, true, ERR_BORROWED, "tensor 5 (or a view of it) is mutably borrowed by borrow 11");
  expect_rejected(12, 13, t, OTHER, false, ERR_BORROWED, "mutably borrowed by borrow 11");
  /* a view shares the storage, and so the borrow */
  expect_rejected(12, 13, v, OTHER, false, ERR_BORROWED, "Borrow: tensor 6 (or a view of it) is mutably borrowed by borrow 11");

  obj_t *u = tensor(20, STREAM_MAIN);
  borrow_ok(21, 22, u, SIDE, false);
  expect_rejected(23, 24, u, OTHER, true, ERR_BORROWED,
                  "cannot borrow tensor 20 mutably because it (or a view) is already being borrowed "
                  "non-mutably (1 read borrow)");
  borrow_ok(25, 26, u, OTHER, false);
  expect_rejected(27, 28, u, OTHER, true, ERR_BORROWED, "(2 read borrows)");
}

Test(borrow, read_only_handle_cannot_be_borrowed_mutably) {
  obj_t *t = tensor(5, STREAM_MAIN);
  borrow_ok(6, 7, t, SIDE, false);
  obj_t *h = objects_get(o, 6);
  expect_rejected(8, 9, h, OTHER, true, ERR_BORROWED,
                  "Borrow: tensor 6 is a read-only borrow (borrow 7) and cannot be borrowed mutably");
}

Test(borrow, same_stream_is_bad_argument) {
  obj_t *t = tensor(5, SIDE);
  expect_rejected(6, 7, t, SIDE, false, ERR_BAD_ARGUMENT,
                  "Borrow: tensor 5 is already on stream 'side'; borrow it onto another stream");
  obj_t *m = tensor(8, STREAM_MAIN);
  expect_rejected(9, 10, m, STREAM_MAIN, true, ERR_BAD_ARGUMENT, "already on stream 'main'");
}

Test(borrow, drop_restores_access_only_when_the_last_borrow_is_gone) {
  obj_t *t = tensor(5, STREAM_MAIN);
  obj_t *b1 = borrow_ok(6, 7, t, SIDE, false);
  obj_t *b2 = borrow_ok(8, 9, t, OTHER, false);
  cr_assert_eq(borrow_drop(o, b1, 30, &err), 0, "%s", err.msg);
  cr_assert_eq(t->tensor.storage->access, ACCESS_R, "one read borrow is still live");
  cr_assert_eq(t->tensor.storage->read_borrows, 1);
  cr_assert_eq(borrow_holder(o, t->tensor.storage), 9, "the live borrow is the holder");
  cr_assert_null(objects_get(o, 7), "a dropped borrow's record is freed");
  cr_assert_eq(objects_dropped_borrow(o, 7)->seq, 30, "its tombstone keeps the drop site");
  cr_assert_null(objects_dropped(o, 7), "a borrow's tombstone is not a tensor's");
  cr_assert_eq(borrow_drop(o, b2, 31, &err), 0, "%s", err.msg);
  cr_assert_eq(t->tensor.storage->access, ACCESS_R | ACCESS_W);
  cr_assert_eq(t->tensor.storage->read_borrows, 0);
  cr_assert_eq(borrow_holder(o, t->tensor.storage), 0);
  cr_assert_eq(t->state, TENSOR_LIVE, "dropping a borrow does not drop its origin");

  obj_t *m = borrow_ok(40, 41, t, SIDE, true);
  cr_assert_eq(borrow_drop(o, m, 42, &err), 0, "%s", err.msg);
  cr_assert_eq(t->tensor.storage->access, ACCESS_R | ACCESS_W);
  cr_assert_eq(t->tensor.storage->mutable_borrow, 0);
  /* and it can be borrowed mutably again */
  borrow_ok(43, 44, t, SIDE, true);
}

Test(borrow, drop_drops_the_handle_and_its_aliases) {
  obj_t *t = tensor(5, STREAM_MAIN);
  obj_t *b = borrow_ok(6, 7, t, SIDE, true);
  obj_t *hv = view(8, objects_get(o, 6));
  cr_assert_eq(hv->tensor.stream, SIDE);
  cr_assert_eq(o->live_tensors, 3);
  cr_assert_eq(borrow_drop(o, b, 50, &err), 0, "%s", err.msg);
  for (uint64_t r = 6; r <= 8; r += 2) {
    cr_assert_null(objects_get(o, r), "ref %llu is freed", (unsigned long long)r);
    const tombstone_t *g = objects_dropped(o, r);
    cr_assert_not_null(g, "ref %llu left no tombstone", (unsigned long long)r);
    cr_assert_eq(g->seq, 50);
    cr_assert_eq(g->borrow, 7, "the tombstone names the borrow that dropped it");
  }
  cr_assert_null(objects_dropped(o, 5));
  cr_assert_eq(t->state, TENSOR_LIVE);
  cr_assert_eq(o->live_tensors, 1);
  cr_assert_eq(o->bytes, 32, "only the origin's bytes (16 * 2 ranks)");
}

Test(borrow, double_drop_is_dropped) {
  obj_t *t = tensor(5, STREAM_MAIN);
  obj_t *b = borrow_ok(6, 7, t, SIDE, false);
  cr_assert_eq(borrow_drop(o, b, 30, &err), 0);
  cr_assert_null(objects_expect(o, 7, OBJ_BORROW, "DropBorrow: borrow", &err));
  cr_assert_eq(err.kind, ERR_DROPPED, "%s", err.msg);
  cr_assert_str_eq(err.msg, "DropBorrow: borrow 7 was already dropped by command 30");
  cr_assert_null(objects_expect(o, 7, OBJ_TENSOR, "Call neg: argument 'self'", &err));
  cr_assert_str_eq(err.msg, "Call neg: argument 'self' is ref 7, which is a borrow (dropped by "
                            "command 30), not a tensor");
  cr_assert_eq(t->tensor.storage->read_borrows, 0);
  cr_assert_eq(t->tensor.storage->access, ACCESS_R | ACCESS_W);
}

Test(borrow, a_borrow_and_drop_loop_keeps_no_record) {
  /* Every dropped borrow and handle leaves only a 24-byte tombstone (which
   * OBJECTS_GRAVES_MAX bounds): the table keeps what it had, and
   * the origin's storage is held by the origin alone. */
  obj_t *t = tensor(5, STREAM_MAIN);
  size_t before = o->table.n; /* the mesh, the streams and the origin */
  uint64_t live = objects_live_refs(o);
  for (uint64_t r = 6; r < 6 + 2 * 1000; r += 2) {
    obj_t *b = borrow_ok(r, r + 1, t, SIDE, (r / 2) % 2 == 0);
    cr_assert_eq(borrow_drop(o, b, r, &err), 0, "%s", err.msg);
  }
  cr_assert_eq(o->table.n, before, "records: %zu, %zu before", o->table.n, before);
  cr_assert_eq(t->tensor.storage->refs, 1, "dropped borrows still hold the origin's storage");
  cr_assert_eq(o->live_borrows, 0);
  cr_assert_eq(objects_live_refs(o), live);
  cr_assert_eq(t->tensor.storage->access, ACCESS_R | ACCESS_W);
}

Test(borrow, handle_dropped_before_the_borrow) {
  /* The client may drop the handle itself; dropping the borrow later still
   * restores the origin. */
  obj_t *t = tensor(5, STREAM_MAIN);
  obj_t *b = borrow_ok(6, 7, t, SIDE, true);
  objects_drop_storage(o, objects_get(o, 6)->tensor.storage, 20);
  cr_assert_null(objects_get(o, 6));
  cr_assert_eq(t->tensor.storage->access, 0, "the borrow still holds the origin");
  cr_assert_eq(borrow_drop(o, b, 21, &err), 0, "%s", err.msg);
  cr_assert_eq(objects_dropped(o, 6)->seq, 20, "the handle keeps its own drop site");
  cr_assert_eq(t->tensor.storage->access, ACCESS_R | ACCESS_W);
}

Test(borrow, dropping_the_outer_borrow_first) {
  /* t --read--> h --read--> h2. Dropping the outer borrow frees h's record;
   * the inner borrow keeps h's storage alive and can still be dropped. */
  obj_t *t = tensor(5, STREAM_MAIN);
  obj_t *outer = borrow_ok(6, 7, t, SIDE, false);
  obj_t *inner = borrow_ok(8, 9, objects_get(o, 6), OTHER, false);
  cr_assert_eq(borrow_drop(o, outer, 10, &err), 0, "%s", err.msg);
  cr_assert_null(objects_get(o, 6));
  cr_assert_eq(inner->borrow.origin_storage->read_borrows, 1, "the inner borrow's storage lives on");
  cr_assert_eq(borrow_drop(o, inner, 11, &err), 0, "%s", err.msg);
  cr_assert_null(objects_get(o, 8));
  cr_assert_eq(t->tensor.storage->access, ACCESS_R | ACCESS_W);
}

Test(borrow, nested_read_borrow_keeps_a_read_handle_read_only) {
  /* t --read--> h (side) --read--> h2 (other). Dropping the inner borrow must
   * not make the read-only handle h writable. */
  obj_t *t = tensor(5, STREAM_MAIN);
  borrow_ok(6, 7, t, SIDE, false);
  obj_t *h = objects_get(o, 6);
  obj_t *inner = borrow_ok(8, 9, h, OTHER, false);
  cr_assert_eq(h->tensor.storage->access, ACCESS_R);
  cr_assert_eq(borrow_drop(o, inner, 10, &err), 0, "%s", err.msg);
  cr_assert_eq(h->tensor.storage->access, ACCESS_R,
               "a read borrow's handle stays read-only after its own borrow is dropped");
  cr_assert_eq(t->tensor.storage->access, ACCESS_R, "the outer borrow is still live");
}

Test(borrow, nested_mutable_borrow_of_a_mutable_handle) {
  obj_t *t = tensor(5, STREAM_MAIN);
  borrow_ok(6, 7, t, SIDE, true);
  obj_t *h = objects_get(o, 6);
  obj_t *inner = borrow_ok(8, 9, h, OTHER, true);
  cr_assert_eq(h->tensor.storage->access, 0);
  cr_assert_eq(objects_get(o, 8)->tensor.storage->access, ACCESS_R | ACCESS_W);
  cr_assert_eq(borrow_drop(o, inner, 10, &err), 0, "%s", err.msg);
  cr_assert_eq(h->tensor.storage->access, ACCESS_R | ACCESS_W, "the mutable handle is rw again");
  cr_assert_eq(t->tensor.storage->access, 0, "the origin is still lent out");
}

Test(borrow, read_borrow_of_a_mutable_handle_names_the_read_borrow) {
  /* A mutable handle that is read-borrowed cannot be borrowed mutably: the
   * reason is the live read borrow, not that the handle is read-only. */
  obj_t *t = tensor(5, STREAM_MAIN);
  borrow_ok(6, 7, t, SIDE, true);
  obj_t *h = objects_get(o, 6);
  borrow_ok(8, 9, h, OTHER, false);
  expect_rejected(10, 11, h, STREAM_MAIN, true, ERR_BORROWED,
                  "already being borrowed non-mutably (1 read borrow)");
}
