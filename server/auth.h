/* Who may call the client-facing services: principals and their bearer tokens.
 *
 * `--auth-tokens FILE` holds one principal per line, `NAME TOKEN [admin]`
 * ('#' starts a comment). A call carries `authorization: Bearer TOKEN`; the
 * guard (auth_guard, for rpc_server_add_methods_guarded) admits it as that
 * principal or refuses it UNAUTHENTICATED. Tokens are kept only as SHA-256
 * digests, compared in constant time against every entry, and never logged.
 * auth_reload (SIGHUP) swaps in a new file atomically; a file that does not
 * parse leaves the old principals in force.
 *
 * Without a tokens file the server is open: every caller is the admin
 * principal "anonymous" (local work; main.c warns at startup). */
#ifndef MESHD_SERVER_AUTH_H
#define MESHD_SERVER_AUTH_H

#include <stdbool.h>
#include <stddef.h>

#include "rpc.h"

#define AUTH_ANONYMOUS "anonymous"
#define AUTH_NAME_MAX 63
#define AUTH_TOKEN_MIN 16
#define AUTH_TOKEN_MAX 512

typedef struct auth auth_t;

/* tokens_file NULL or "": open. Otherwise the file must parse (err names the
 * line and what is wrong). Returns NULL with err on failure. */
auth_t *auth_create(const char *tokens_file, char *err, size_t errlen);
void auth_destroy(auth_t *a);
bool auth_enabled(const auth_t *a);
/* Re-reads the tokens file. Returns the number of principals, or -1 with err
 * (the old ones stay). A no-op returning 0 when open. */
int auth_reload(auth_t *a, char *err, size_t errlen);

/* After a reload: whether the call admitted as id can no longer be (its
 * token removed, or now another's, its principal's gone, or its admin flag
 * changed). For
 * rpc_server_end_calls_of (arg: the auth_t). */
bool auth_call_revoked(const rpc_identity_t *id, void *auth);
/* After a reload: whether id's token is no longer its principal's (removed,
 * or the principal gone; an admin flag changed does not count). What a direct
 * transfer planned under it follows (data_service_revoke). */
bool auth_token_revoked(const rpc_identity_t *id, void *auth);
/* Whether each of ids (NULL, or without a credential: passed) still holds
 * its token, as auth_token_revoked says; if so the principals stay as they
 * are (a reload waits) until auth_unpin, which must follow a true and only
 * that. So a step that must not happen for a token revoked (FinishUpload
 * defining its tensor) is done either before a reload or not at all. */
bool auth_pin(auth_t *a, const rpc_identity_t *const *ids, size_t n);
void auth_unpin(auth_t *a);

/* The guard for client-facing methods (guard_arg: the auth_t). */
grpc_status_code auth_guard(rpc_call_t *call, void *auth, rpc_identity_t *id, char *msg,
                            size_t msglen);

#endif
