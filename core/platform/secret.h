/* Shared secrets between meshd and its agents: join tokens (who may register)
 * and the call secret an agent gives the server it registers with (who may
 * call the agent). Both processes compile in the metadata keys below.
 *
 *   secret_file_t *tokens = secret_file_open("--join-token-file", path, err, sizeof err);
 *   if (!secret_file_check(tokens, presented, strlen(presented))) -> UNAUTHENTICATED
 *
 * Nothing here logs a secret. Randomness is OpenSSL's RAND_bytes; compares are
 * constant-time (CRYPTO_memcmp over SHA-256 digests, so the lengths of the
 * compared strings leak nothing either). */
#ifndef MESHD_SECRET_H
#define MESHD_SECRET_H

#include <stdbool.h>
#include <stddef.h>

/* Request metadata: the agent's call secret, on every call the server makes to
 * an agent (Hello, Execute, Read, Write). */
#define SECRET_AGENT_MD "meshd-agent-secret"
/* Request metadata: the join token, on RegisterAgent. */
#define SECRET_JOIN_MD "meshd-join-token"

/* A call secret: 32 random bytes as 64 lowercase hex characters. */
#define SECRET_HEX_LEN 64
/* Join tokens: printable ASCII without spaces (they travel as metadata). */
#define SECRET_TOKEN_MIN 16
#define SECRET_TOKEN_MAX 512

/* 32 bytes from RAND_bytes as hex into out (SECRET_HEX_LEN + 1 bytes).
 * Returns 0, or -1 when the CSPRNG fails (out is then ""). */
int secret_random_hex(char *out);
/* a[0..alen) == b[0..blen), in time independent of where they differ. */
bool secret_equal(const char *a, size_t alen, const char *b, size_t blen);

/* Logs a warning when the file at path (what: the flag naming it) is readable
 * by every user: a token or a private key there is anyone's on that host. */
void secret_warn_if_public(const char *what, const char *path);

/* A file of tokens, one per line; blank lines and lines starting with '#' are
 * skipped, surrounding whitespace is trimmed. Several tokens allow rotation:
 * the server accepts each; an agent presents the first. The file is read again
 * whenever its inode, size or modification time change (a rotated Kubernetes
 * Secret), checked on each use; a read that fails or finds no valid token keeps
 * the tokens read before (logged once per change). Thread-safe. */
typedef struct secret_file secret_file_t;

/* Reads path now. `what` names the flag in messages ("--join-token-file").
 * NULL with err naming the flag, the file and what is wrong (unreadable, no
 * token, a token too short or with a space on line N). */
secret_file_t *secret_file_open(const char *what, const char *path, char *err, size_t errlen);
/* True if token[0..len) equals one of the file's tokens (each compared in constant time). */
bool secret_file_check(secret_file_t *f, const char *token, size_t len);
/* The first token into buf (NUL-terminated). Returns 0, or -1 if buf is too small. */
int secret_file_first(secret_file_t *f, char *buf, size_t len);
const char *secret_file_path(const secret_file_t *f);
/* NULL: no-op. */
void secret_file_close(secret_file_t *f);

/* A private file holding one fresh token (secret_random_hex): a new directory
 * made by mkdtemp under $TMPDIR (or /tmp), mode 0700, with the file "join-token"
 * in it, mode 0600. path_out gets the file's path (>= 4096 bytes advised).
 * Returns 0, or -1 with err. Remove both with secret_temp_remove. */
int secret_temp_make(char *path_out, size_t len, char *err, size_t errlen);
/* Removes a file made by secret_temp_make and its directory. */
void secret_temp_remove(const char *path);

#endif
