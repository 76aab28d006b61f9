#include "refmap.h"

#include <stdlib.h>
#include <string.h>

static uint64_t key(const void *rec) {
  uint64_t k;
  memcpy(&k, rec, sizeof k);
  return k;
}

static size_t home(uint64_t ref, size_t cap) {
  return (size_t)((ref * 0x9e3779b97f4a7c15ull) >> 32) & (cap - 1);
}

/* The slot holding ref, or the empty slot where it would go. */
static size_t find(void *const *slots, size_t cap, uint64_t ref) {
  size_t i = home(ref, cap);
  while (slots[i] && key(slots[i]) != ref) i = (i + 1) & (cap - 1);
  return i;
}

void *refmap_get(const refmap_t *m, uint64_t ref) {
  return m->cap ? m->slots[find(m->slots, m->cap, ref)] : NULL;
}

static int grow(refmap_t *m) {
  size_t cap = m->cap ? m->cap * 2 : 16;
  void **slots = calloc(cap, sizeof *slots);
  if (!slots) return -1;
  for (size_t i = 0; i < m->cap; i++)
    if (m->slots[i]) slots[find(slots, cap, key(m->slots[i]))] = m->slots[i];
  free(m->slots);
  m->slots = slots;
  m->cap = cap;
  return 0;
}

int refmap_put(refmap_t *m, void *rec) {
  if ((m->n + 1) * 4 > m->cap * 3 && grow(m)) return -1;
  m->slots[find(m->slots, m->cap, key(rec))] = rec;
  m->n++;
  return 0;
}

void *refmap_remove(refmap_t *m, uint64_t ref) {
  if (!m->cap) return NULL;
  size_t mask = m->cap - 1, i = find(m->slots, m->cap, ref);
  void *rec = m->slots[i];
  if (!rec) return NULL;
  /* Backward shift: pull each later record of the run whose home does not
   * lie in (i, j] into the hole, so every record stays reachable from its home. */
  for (size_t j = (i + 1) & mask; m->slots[j]; j = (j + 1) & mask) {
    size_t h = home(key(m->slots[j]), m->cap);
    if (((j - h) & mask) >= ((j - i) & mask)) {
      m->slots[i] = m->slots[j];
      i = j;
    }
  }
  m->slots[i] = NULL;
  m->n--;
  return rec;
}

void *refmap_next(const refmap_t *m, size_t *i) {
  while (*i < m->cap) {
    void *rec = m->slots[(*i)++];
    if (rec) return rec;
  }
  return NULL;
}

void refmap_free(refmap_t *m) {
  free(m->slots);
  *m = (refmap_t){0};
}
