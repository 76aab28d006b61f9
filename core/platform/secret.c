#include "secret.h"

#include <errno.h>
#include <libgen.h>
#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <openssl/sha.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"

#define MAX_TOKENS 16
#define MAX_FILE_BYTES 65536

int secret_random_hex(char *out) {
  unsigned char b[SECRET_HEX_LEN / 2];
  out[0] = '\0';
  if (RAND_bytes(b, (int)sizeof b) != 1) return -1;
  static const char hex[] = "0123456789abcdef";
  for (size_t i = 0; i < sizeof b; i++) {
    out[2 * i] = hex[b[i] >> 4];
    out[2 * i + 1] = hex[b[i] & 15];
  }
  out[SECRET_HEX_LEN] = '\0';
  OPENSSL_cleanse(b, sizeof b);
  return 0;
}

bool secret_equal(const char *a, size_t alen, const char *b, size_t blen) {
  unsigned char da[SHA256_DIGEST_LENGTH], db[SHA256_DIGEST_LENGTH];
  SHA256((const unsigned char *)a, alen, da);
  SHA256((const unsigned char *)b, blen, db);
  /* Equal digests of unequal strings would be a SHA-256 collision. */
  return CRYPTO_memcmp(da, db, sizeof da) == 0;
}

/* ------------------------------------------------------------------ files */

struct secret_file {
  char *what, *path;
  pthread_mutex_t mu;
  char *tokens[MAX_TOKENS]; /* mu */
  size_t n;
  struct stat seen;         /* of the last read, good or not */
  bool failing;             /* the last re-read failed (logged) */
};

static void free_tokens(char **t, size_t n) {
  for (size_t i = 0; i < n; i++) {
    OPENSSL_cleanse(t[i], strlen(t[i]));
    free(t[i]);
  }
}

/* Parses the file into tokens[]. Returns the count (> 0) or -1 with err. */
static int read_tokens(const char *what, const char *path, char **tokens, struct stat *st,
                       char *err, size_t errlen) {
  FILE *f = fopen(path, "r");
  if (!f) {
    snprintf(err, errlen, "%s: cannot read '%s': %s", what, path, strerror(errno));
    return -1;
  }
  if (fstat(fileno(f), st) != 0 || st->st_size > MAX_FILE_BYTES) {
    snprintf(err, errlen, "%s: '%s' is larger than %d bytes", what, path, MAX_FILE_BYTES);
    fclose(f);
    return -1;
  }
  int n = 0, lineno = 0;
  char line[SECRET_TOKEN_MAX + 64];
  while (fgets(line, sizeof line, f)) {
    lineno++;
    size_t len = strlen(line);
    if (len == sizeof line - 1 && line[len - 1] != '\n') {
      snprintf(err, errlen, "%s: '%s' line %d: longer than %d characters", what, path, lineno,
               SECRET_TOKEN_MAX);
      goto fail;
    }
    char *s = line, *e = line + len;
    while (*s == ' ' || *s == '\t') s++;
    while (e > s && (e[-1] == '\n' || e[-1] == '\r' || e[-1] == ' ' || e[-1] == '\t')) e--;
    *e = '\0';
    if (!*s || *s == '#') continue;
    size_t tl = (size_t)(e - s);
    for (const char *p = s; p < e; p++) {
      if (*p < 0x21 || *p > 0x7e) {
        snprintf(err, errlen, "%s: '%s' line %d: a token is printable ASCII without spaces "
                 "(character %zu is not)", what, path, lineno, (size_t)(p - s) + 1);
        goto fail;
      }
    }
    if (tl < SECRET_TOKEN_MIN || tl > SECRET_TOKEN_MAX) {
      snprintf(err, errlen, "%s: '%s' line %d: the token has %zu characters; use %d to %d "
               "(e.g. openssl rand -hex 32)", what, path, lineno, tl, SECRET_TOKEN_MIN,
               SECRET_TOKEN_MAX);
      goto fail;
    }
    if (n == MAX_TOKENS) {
      snprintf(err, errlen, "%s: '%s' holds more than %d tokens", what, path, MAX_TOKENS);
      goto fail;
    }
    if (!(tokens[n] = strdup(s))) {
      snprintf(err, errlen, "%s: out of memory", what);
      goto fail;
    }
    n++;
  }
  OPENSSL_cleanse(line, sizeof line);
  fclose(f);
  if (n == 0) {
    snprintf(err, errlen, "%s: '%s' holds no token", what, path);
    return -1;
  }
  return n;
fail:
  OPENSSL_cleanse(line, sizeof line);
  fclose(f);
  free_tokens(tokens, (size_t)n);
  return -1;
}

static bool same_file(const struct stat *a, const struct stat *b) {
  return a->st_ino == b->st_ino && a->st_dev == b->st_dev && a->st_size == b->st_size &&
         a->st_mtim.tv_sec == b->st_mtim.tv_sec && a->st_mtim.tv_nsec == b->st_mtim.tv_nsec;
}

/* Re-reads the file if it changed since the last read. Under f->mu. */
static void refresh_locked(secret_file_t *f) {
  struct stat st;
  if (stat(f->path, &st) != 0 || same_file(&st, &f->seen)) return;
  char *fresh[MAX_TOKENS];
  char err[512];
  struct stat read_st;
  int n = read_tokens(f->what, f->path, fresh, &read_st, err, sizeof err);
  f->seen = st;
  if (n < 0) {
    if (!f->failing) log_error("secret", "%s; keeping the tokens read before", err);
    f->failing = true;
    return;
  }
  free_tokens(f->tokens, f->n);
  memcpy(f->tokens, fresh, (size_t)n * sizeof *fresh);
  f->n = (size_t)n;
  f->failing = false;
  log_info("secret", "%s: re-read '%s' (%d token%s)", f->what, f->path, n, n == 1 ? "" : "s");
}

void secret_warn_if_public(const char *what, const char *path) {
  struct stat st;
  if (path && stat(path, &st) == 0 && (st.st_mode & S_IROTH))
    log_warn("secret", "%s: '%s' is readable by every user (mode %03o); 0600, 0440 or 0400 "
             "keeps it to meshd", what, path, (unsigned)(st.st_mode & 0777));
}

secret_file_t *secret_file_open(const char *what, const char *path, char *err, size_t errlen) {
  secret_file_t *f = calloc(1, sizeof *f);
  if (!f || !(f->what = strdup(what)) || !(f->path = strdup(path))) {
    snprintf(err, errlen, "%s: out of memory", what);
    secret_file_close(f);
    return NULL;
  }
  pthread_mutex_init(&f->mu, NULL);
  int n = read_tokens(what, path, f->tokens, &f->seen, err, errlen);
  if (n < 0) {
    secret_file_close(f);
    return NULL;
  }
  f->n = (size_t)n;
  secret_warn_if_public(what, path);
  return f;
}

bool secret_file_check(secret_file_t *f, const char *token, size_t len) {
  if (!f || !token) return false;
  pthread_mutex_lock(&f->mu);
  refresh_locked(f);
  bool ok = false;
  for (size_t i = 0; i < f->n; i++) /* every token, always: no early exit */
    ok |= secret_equal(f->tokens[i], strlen(f->tokens[i]), token, len);
  pthread_mutex_unlock(&f->mu);
  return ok;
}

int secret_file_first(secret_file_t *f, char *buf, size_t len) {
  pthread_mutex_lock(&f->mu);
  refresh_locked(f);
  int rc = -1;
  if (f->n > 0 && strlen(f->tokens[0]) < len) {
    memcpy(buf, f->tokens[0], strlen(f->tokens[0]) + 1);
    rc = 0;
  }
  pthread_mutex_unlock(&f->mu);
  return rc;
}

const char *secret_file_path(const secret_file_t *f) { return f->path; }

void secret_file_close(secret_file_t *f) {
  if (!f) return;
  if (f->path) pthread_mutex_destroy(&f->mu);
  free_tokens(f->tokens, f->n);
  free(f->what);
  free(f->path);
  free(f);
}

/* ------------------------------------------------------------------ temp */

int secret_temp_make(char *path_out, size_t len, char *err, size_t errlen) {
  const char *tmp = getenv("TMPDIR");
  char dir[4096];
  if (snprintf(dir, sizeof dir, "%s/meshd-join-XXXXXX", tmp && *tmp ? tmp : "/tmp") >=
      (int)sizeof dir) {
    snprintf(err, errlen, "TMPDIR is too long");
    return -1;
  }
  if (!mkdtemp(dir)) { /* mode 0700 */
    snprintf(err, errlen, "cannot make a private directory %s: %s", dir, strerror(errno));
    return -1;
  }
  if (snprintf(path_out, len, "%s/join-token", dir) >= (int)len) {
    snprintf(err, errlen, "path too long");
    rmdir(dir);
    return -1;
  }
  char token[SECRET_HEX_LEN + 2];
  if (secret_random_hex(token) != 0) {
    snprintf(err, errlen, "no randomness (RAND_bytes failed)");
    rmdir(dir);
    return -1;
  }
  strcat(token, "\n");
  mode_t old = umask(077);
  FILE *f = fopen(path_out, "wx");
  umask(old);
  bool ok = f && fputs(token, f) >= 0;
  ok = (f && fclose(f) == 0) && ok;
  OPENSSL_cleanse(token, sizeof token);
  if (!ok) {
    snprintf(err, errlen, "cannot write %s: %s", path_out, strerror(errno));
    unlink(path_out);
    rmdir(dir);
    return -1;
  }
  chmod(path_out, 0600);
  return 0;
}

void secret_temp_remove(const char *path) {
  if (!path || !*path) return;
  unlink(path);
  char copy[4096];
  snprintf(copy, sizeof copy, "%s", path);
  rmdir(dirname(copy));
}
