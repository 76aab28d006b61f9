/* Cross-stream borrows with Monarch's permissions.
 *
 * A read borrow leaves origin and borrower readable ("r"); a mutable borrow
 * needs write access on the origin, leaves it with none and the borrower "rw".
 * Dropping a borrow drops every alias of the borrowed tensor and restores the
 * origin's access once no borrow is left. Caller holds the session lock. */
#ifndef MESHD_BORROW_H
#define MESHD_BORROW_H

#include "objects.h"

/* Creates borrow `ref` of tensor `origin` onto `to_stream`, whose usable handle
 * is the new tensor `result`. BORROWED if the origin may not be borrowed so. */
int borrow_create(objects_t *o, uint64_t ref, uint64_t result, obj_t *origin, uint64_t to_stream,
                  bool is_mutable, meshd_error_t *e);
/* Drops the borrow and every alias of its handle (DROPPED at seq afterwards):
 * the borrow's record is freed, leaving a tombstone, so `borrow` is gone. */
int borrow_drop(objects_t *o, obj_t *borrow, uint64_t seq, meshd_error_t *e);
/* The live borrow holding `s` (origin side), for messages; 0 if none. */
uint64_t borrow_holder(objects_t *o, const storage_t *s);

#endif
