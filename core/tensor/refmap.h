/* An index of records by ref, for tables of many small records (the server's
 * objects, an agent's refs): each record starts with its uint64_t ref, and
 * the index holds only pointers to them, 8 bytes a slot at a load of at most
 * 3/4 (open addressing, linear probing, deletion by backward shift: no
 * tombstones, so a table that drops as much as it adds stays as it is).
 *
 *   refmap_t m = {0};
 *   if (refmap_put(&m, rec)) oom();      // rec->ref must not be in m yet
 *   rec = refmap_get(&m, 7);             // NULL: absent
 *   refmap_remove(&m, 7);                // returns the record, or NULL
 *   for (size_t i = 0; (rec = refmap_next(&m, &i));) ...   // no changes meanwhile
 *   refmap_free(&m);                     // the index only, not the records
 *
 * Not thread-safe. */
#ifndef MESHD_REFMAP_H
#define MESHD_REFMAP_H

#include <stddef.h>
#include <stdint.h>

typedef struct refmap {
  void **slots;
  size_t cap; /* 0 or a power of two */
  size_t n;
} refmap_t;

void *refmap_get(const refmap_t *m, uint64_t ref);
/* 0, or -1 out of memory (m unchanged). */
int refmap_put(refmap_t *m, void *rec);
void *refmap_remove(refmap_t *m, uint64_t ref);
/* The record at or after slot *i, advancing *i past it; NULL at the end. */
void *refmap_next(const refmap_t *m, size_t *i);
void refmap_free(refmap_t *m);

#endif
