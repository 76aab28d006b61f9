/* The server's command paths when an allocation fails midway: what was made
 * before the failure is taken back, so the command fails cleanly (QUOTA) and
 * leaves no half-made record behind (its refs are not claimed: a retry of the
 * same command reuses them).
 *
 * The allocation failure is made deterministic by interposing calloc in this
 * test binary: armed with N, the Nth calloc from then on fails. */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "borrow.h"

#if !defined(__SANITIZE_ADDRESS__)
extern void *__libc_calloc(size_t n, size_t size);
static atomic_int fail_in; /* > 0: calls to go until the failing one */

void *calloc(size_t n, size_t size) {
  if (atomic_load(&fail_in) > 0 && atomic_fetch_sub(&fail_in, 1) == 1) return NULL;
  return __libc_calloc(n, size);
}
#endif

#define SIDE 2

/* borrow_create made the borrow's record (1st calloc), then failed to make
 * its handle (2nd): the record stayed in the table, zeroed, counted as a
 * live borrow and unclaimed. A retry of the Borrow added a second record
 * under the same ref, and a DropBorrow of it read its NULL handle storage. */
Test(server_oom, a_borrow_whose_handle_cannot_be_made_leaves_no_record) {
#if defined(__SANITIZE_ADDRESS__)
  cr_skip_test("calloc is the sanitizer's");
#else
  objects_t *o = objects_create();
  cr_assert_not_null(o);
  meshd_error_t err = {0};
  cr_assert_not_null(objects_add_stream(o, SIDE, "side"));
  tensor_meta_t m = {.dtype = DTYPE_FLOAT32};
  cr_assert_eq(layout_contiguous(&m.layout, (const int64_t[]){4}, 1, 4, "test", &err), 0);
  obj_t *t = objects_new_tensor(o, 5, &m, 1, 0, 2);
  cr_assert_not_null(t);
  uint64_t live = objects_live_refs(o);

  atomic_store(&fail_in, 2);
  int rc = borrow_create(o, 7, 6, t, SIDE, true, &err);
  int left = atomic_exchange(&fail_in, 0);
  cr_assert_eq(left, 0, "the handle's allocation was not the 2nd calloc");
  cr_assert_eq(rc, -1);
  cr_assert_eq(err.kind, ERR_QUOTA, "%s", err.msg);
  cr_assert_null(objects_get(o, 7), "a half-made borrow record stays under ref 7");
  cr_assert_null(objects_get(o, 6));
  cr_assert_eq(objects_live_refs(o), live, "live refs %llu, were %llu",
               (unsigned long long)objects_live_refs(o), (unsigned long long)live);
  cr_assert_eq(t->tensor.storage->access, ACCESS_R | ACCESS_W, "the origin keeps its access");

  /* The retry works, and so does its drop. */
  cr_assert_eq(borrow_create(o, 7, 6, t, SIDE, true, &err), 0, "%s", err.msg);
  obj_t *b = objects_get(o, 7);
  cr_assert_not_null(b);
  cr_assert_eq(b->kind, OBJ_BORROW);
  cr_assert_eq(borrow_drop(o, b, 10, &err), 0, "%s", err.msg);
  cr_assert_eq(t->tensor.storage->access, ACCESS_R | ACCESS_W);
  cr_assert_eq(objects_live_refs(o), live);
  objects_destroy(o);
#endif
}
