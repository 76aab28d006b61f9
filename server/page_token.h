/* Paged listings (ListSessions, ListAgents): one token format and one set of
 * rules for both (docs/protocol.md).
 *
 * A listing is ordered by a number every row keeps for its life (a session's
 * seq, an agent's rank + 1), >= 1. A page token is "SEQ.EPOCH": the decimal
 * number of the last row a page showed (no leading zero) and the listing's
 * epoch in 8 hex digits, drawn at random once per run, so that a token kept
 * across a restart is refused rather than read against another run's rows.
 * The next page starts after SEQ: rows added while a client pages appear on a
 * later page, rows gone drop out, none appears twice. */
#ifndef MESHD_PAGE_TOKEN_H
#define MESHD_PAGE_TOKEN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "error_kind.h"

/* Room for a token: 20 digits, '.', 8 hex digits, NUL. */
#define PAGE_TOKEN_LEN 32

/* A random epoch for a new listing (kernel randomness; 0 is as good as any). */
uint32_t page_token_new_epoch(void);
/* tok "" or NULL: *after 0 (the first page), true. A token of this epoch:
 * *after its SEQ, true. Anything else: false (the caller refuses it with
 * page_token_refuse). Whether SEQ was ever given is the listing's to say. */
bool page_token_parse(const char *tok, uint32_t epoch, uint64_t *after);
/* The token of a page whose last row was `last`; "" when last is 0 (the last page). */
void page_token_format(char out[PAGE_TOKEN_LEN], uint64_t last, uint32_t epoch);
/* Rows a page may hold: asked, or dflt when 0, at most max. */
size_t page_size_of(uint32_t asked, size_t dflt, size_t max);
/* INVALID_ARGUMENT for a token this run never gave, naming the method. Returns -1. */
int page_token_refuse(meshd_error_t *err, const char *method);

#endif
