/* What an Agent/Read streams (agent/snapshot.c): any view read out in chunks
 * of any size gives exactly the backend's row-major to_host bytes; a write
 * after the pin never shows; nothing is copied until a write comes. On the
 * cpu backend, and on cuda:emulated where the build has it. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "refs.h"
#include "snapshot.h"

static void open_backend(backend_t *b, const char *device) {
  *b = (backend_t){.ops = backend_for_device(device)};
  meshd_error_t e = {0};
  cr_assert_not_null(b->ops, "%s", device);
  cr_assert_eq(b->ops->open(b, device, &e), 0, "%s: %s", device, e.msg);
}

/* A [5, 7, 3] float32 tensor holding 0, 1, 2, ... row-major. */
static agent_tensor_t arange(backend_t *b) {
  agent_tensor_t t = {0};
  t.meta.dtype = DTYPE_FLOAT32;
  t.meta.layout.ndim = 3;
  t.meta.layout.sizes[0] = 5;
  t.meta.layout.sizes[1] = 7;
  t.meta.layout.sizes[2] = 3;
  layout_make_contiguous(&t.meta.layout);
  meshd_error_t e = {0};
  cr_assert_eq(tensor_alloc(b, NULL, &t.meta, &t, "test", &e), 0, "%s", e.msg);
  float v[105];
  for (int i = 0; i < 105; i++) v[i] = (float)i;
  cr_assert_eq(b->ops->from_host(b, NULL, &t, v, &e), 0, "%s", e.msg);
  return t;
}

/* Views of base: each with its own sizes, strides and offset. */
static int views(const agent_tensor_t *base, agent_tensor_t *out) {
  int n = 0;
  out[n++] = *base; /* contiguous */
  agent_tensor_t v = *base; /* transposed: [3, 7, 5] */
  v.meta.layout.sizes[0] = 3, v.meta.layout.sizes[2] = 5;
  v.meta.layout.strides[0] = 1, v.meta.layout.strides[2] = 21;
  out[n++] = v;
  v = *base; /* x[1:4, ::2, 1:] : [3, 4, 2] at offset 22 */
  v.meta.layout.offset = 22;
  v.meta.layout.sizes[0] = 3, v.meta.layout.sizes[1] = 4, v.meta.layout.sizes[2] = 2;
  v.meta.layout.strides[1] = 6;
  out[n++] = v;
  v = *base; /* a broadcast row: [4, 3] with stride 0 */
  v.meta.layout.ndim = 2;
  v.meta.layout.sizes[0] = 4, v.meta.layout.sizes[1] = 3;
  v.meta.layout.strides[0] = 0, v.meta.layout.strides[1] = 1;
  v.meta.layout.offset = 9;
  out[n++] = v;
  v = *base; /* 0-d: element 50 */
  v.meta.layout.ndim = 0;
  v.meta.layout.offset = 50;
  out[n++] = v;
  v = *base; /* empty: [5, 0, 3] */
  v.meta.layout.sizes[1] = 0;
  out[n++] = v;
  return n;
}

static void reads_match_to_host(const char *device) {
  backend_t b;
  open_backend(&b, device);
  agent_tensor_t base = arange(&b), v[8];
  int nv = views(&base, v);
  meshd_error_t e = {0};
  for (int i = 0; i < nv; i++) {
    size_t bytes = tensor_nbytes(&v[i].meta);
    float want[105] = {0}, got[105];
    if (bytes) cr_assert_eq(b.ops->to_host(&b, NULL, &v[i], want, &e), 0, "%s", e.msg);
    snapshot_t *s = snapshot_pin(&b, NULL, &v[i], &e);
    cr_assert_eq(snapshot_bytes(s), bytes);
    size_t chunks[] = {4, 8, 12, 20, 28, 84, 400, 4096};
    for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
      memset(got, 0xff, sizeof got);
      for (size_t off = 0; off < bytes; off += chunks[c]) {
        size_t n = bytes - off < chunks[c] ? bytes - off : chunks[c];
        cr_assert_eq(snapshot_read(s, off, n, (char *)got + off, &e), 0, "%s", e.msg);
      }
      cr_assert_eq(memcmp(got, want, bytes), 0, "%s: view %d read in %zu-byte chunks differs",
                   device, i, chunks[c]);
    }
    cr_assert_neq(snapshot_read(s, bytes, 4, got, &e), 0, "a read past the end is refused");
    snapshot_release(s);
  }
  cr_assert_eq(atomic_load(&base.storage->refs), 1, "every snapshot let go of the storage");
  cr_assert_eq(atomic_load(&base.storage->pins), 0);
  storage_release(base.storage);
  cr_assert_eq(atomic_load(&b.allocated), 0);
  b.ops->close(&b);
}

Test(snapshot, chunked_reads_of_any_view_give_the_row_major_bytes) {
  reads_match_to_host("cpu");
  if (backend_for_device("cuda:emulated")) reads_match_to_host("cuda:emulated");
}

Test(snapshot, a_write_after_the_pin_never_shows_and_copies_only_then) {
  backend_t b;
  open_backend(&b, "cpu");
  agent_tensor_t base = arange(&b), v[8];
  views(&base, v);
  meshd_error_t e = {0};
  uint64_t copies0 = snapshot_copies();
  snapshot_t *whole = snapshot_pin(&b, NULL, &v[0], &e), *part = snapshot_pin(&b, NULL, &v[2], &e);
  float head[4];
  cr_assert_eq(snapshot_read(whole, 0, 16, head, &e), 0);
  cr_assert_eq(head[3], 3.0f);
  cr_assert_eq(snapshot_copies(), copies0, "reading copies nothing");
  cr_assert_eq(atomic_load(&base.storage->pins), 2);

  /* A writer comes: both snapshots move to host memory, then it writes. */
  cr_assert_eq(snapshot_before_write(&b, base.storage, &e), 0, "%s", e.msg);
  cr_assert_eq(snapshot_copies(), copies0 + 2);
  cr_assert_eq(atomic_load(&base.storage->pins), 0);
  cr_assert_eq(atomic_load(&base.storage->refs), 1, "the snapshots hold copies, not the storage");
  memset(base.storage->data, 0, 105 * sizeof(float));
  cr_assert_eq(snapshot_before_write(&b, base.storage, &e), 0, "nothing pinned: free");
  cr_assert_eq(snapshot_copies(), copies0 + 2);

  float got[105];
  cr_assert_eq(snapshot_read(whole, 0, 105 * 4, got, &e), 0);
  for (int i = 0; i < 105; i++) cr_assert_eq(got[i], (float)i);
  cr_assert_eq(snapshot_read(part, 4, 8, got, &e), 0);
  cr_assert_eq(got[0], 23.0f); /* x[1, 0, 2] */
  cr_assert_eq(got[1], 28.0f); /* x[1, 2, 1] */
  snapshot_release(whole);
  snapshot_release(part);

  /* A snapshot released before any write leaves nothing pinned. */
  snapshot_t *late = snapshot_pin(&b, NULL, &v[1], &e);
  snapshot_release(late);
  cr_assert_eq(atomic_load(&base.storage->pins), 0);
  cr_assert_null(base.storage->pinned);
  cr_assert_eq(snapshot_before_write(&b, base.storage, &e), 0);
  cr_assert_eq(snapshot_copies(), copies0 + 2);
  storage_release(base.storage);
  cr_assert_eq(atomic_load(&b.allocated), 0);
  b.ops->close(&b);
}
