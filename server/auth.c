/* Principals and bearer tokens (auth.h). */
#include "auth.h"

#include <ctype.h>
#include <errno.h>
#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "log.h"
#include "secret.h"

typedef struct principal {
  char name[AUTH_NAME_MAX + 1];
  unsigned char digest[SHA256_DIGEST_LENGTH];
  bool admin;
} principal_t;

typedef struct principals {
  principal_t *v;
  size_t n;
} principals_t;

struct auth {
  char *file; /* NULL: open */
  pthread_rwlock_t lock;
  principals_t set;
  pthread_mutex_t log_mu;
  int64_t last_refusal_log_ms;
  unsigned refusals_unlogged;
};

static bool name_ok(const char *s, size_t n) {
  if (n == 0 || n > AUTH_NAME_MAX) return false;
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)s[i];
    if (!isalnum(c) && c != '-' && c != '_' && c != '.' && c != '@') return false;
  }
  return true;
}

static bool token_chars_ok(const char *s, size_t n) {
  for (size_t i = 0; i < n; i++)
    if ((unsigned char)s[i] <= 0x20 || (unsigned char)s[i] >= 0x7f) return false;
  return true;
}

/* Next whitespace-separated word of *p within the line [*p, end). */
static bool next_word(const char **p, const char *end, const char **w, size_t *n) {
  const char *s = *p;
  while (s < end && (*s == ' ' || *s == '\t' || *s == '\r')) s++;
  if (s >= end) return false;
  const char *e = s;
  while (e < end && *e != ' ' && *e != '\t' && *e != '\r') e++;
  *w = s;
  *n = (size_t)(e - s);
  *p = e;
  return true;
}

/* Parses the file's text into *out. Returns the count or -1 with err naming
 * the line (never the token). */
static int parse(const char *file, const char *text, principals_t *out, char *err, size_t errlen) {
  principals_t set = {0};
  size_t cap = 0;
  int line = 0;
  for (const char *p = text; *p;) {
    const char *end = strchr(p, '\n');
    if (!end) end = p + strlen(p);
    line++;
    const char *hash = memchr(p, '#', (size_t)(end - p));
    const char *stop = hash ? hash : end;
    const char *cur = p, *w[4];
    size_t wn[4];
    int words = 0;
    while (words < 4 && next_word(&cur, stop, &w[words], &wn[words])) words++;
    p = *end ? end + 1 : end;
    if (words == 0) continue;
    const char *why = NULL;
    if (words < 2) why = "expected NAME TOKEN [admin]";
    else if (words > 3) why = "more than NAME TOKEN [admin]";
    else if (!name_ok(w[0], wn[0])) why = "the name must be 1-63 of A-Z a-z 0-9 - _ . @";
    else if (wn[1] < AUTH_TOKEN_MIN || wn[1] > AUTH_TOKEN_MAX || !token_chars_ok(w[1], wn[1]))
      why = "the token must be 16-512 printable characters without spaces";
    else if (words == 3 && !(wn[2] == 5 && !strncmp(w[2], "admin", 5)))
      why = "the third word may only be 'admin'";
    if (!why && wn[0] == strlen(AUTH_ANONYMOUS) && !strncmp(w[0], AUTH_ANONYMOUS, wn[0]))
      why = "the name 'anonymous' is reserved for an open server";
    principal_t pr = {.admin = words == 3};
    if (!why) {
      memcpy(pr.name, w[0], wn[0]);
      SHA256((const unsigned char *)w[1], wn[1], pr.digest);
      for (size_t i = 0; i < set.n && !why; i++) {
        if (!strcmp(set.v[i].name, pr.name)) why = "this name appears twice";
        else if (!CRYPTO_memcmp(set.v[i].digest, pr.digest, sizeof pr.digest))
          why = "this token is also another principal's";
      }
    }
    if (why) {
      snprintf(err, errlen, "--auth-tokens %s line %d: %s", file, line, why);
      free(set.v);
      return -1;
    }
    if (set.n == cap) {
      cap = cap ? cap * 2 : 8;
      principal_t *v = realloc(set.v, cap * sizeof *v);
      if (!v) {
        free(set.v);
        snprintf(err, errlen, "--auth-tokens %s: out of memory", file);
        return -1;
      }
      set.v = v;
    }
    set.v[set.n++] = pr;
  }
  if (set.n == 0) {
    snprintf(err, errlen, "--auth-tokens %s: no principals (lines NAME TOKEN [admin])", file);
    return -1;
  }
  *out = set;
  return (int)set.n;
}

static int load(auth_t *a, char *err, size_t errlen) {
  FILE *f = fopen(a->file, "r");
  if (!f) {
    snprintf(err, errlen, "--auth-tokens: cannot read '%s': %s", a->file, strerror(errno));
    return -1;
  }
  secret_warn_if_public("--auth-tokens", a->file);
  char *text = NULL;
  size_t cap = 0, len = 0;
  char buf[4096];
  size_t got;
  while ((got = fread(buf, 1, sizeof buf, f)) > 0) {
    if (len + got + 1 > cap) {
      cap = (len + got + 1) * 2;
      char *t = realloc(text, cap);
      if (!t) break;
      text = t;
    }
    memcpy(text + len, buf, got);
    len += got;
  }
  fclose(f);
  if (!text) text = calloc(1, 1);
  else text[len] = '\0';
  principals_t set;
  int n = text ? parse(a->file, text, &set, err, errlen) : -1;
  if (text) OPENSSL_cleanse(text, len);
  free(text);
  if (n < 0) return -1;
  pthread_rwlock_wrlock(&a->lock);
  principals_t old = a->set;
  a->set = set;
  pthread_rwlock_unlock(&a->lock);
  free(old.v);
  return n;
}

auth_t *auth_create(const char *tokens_file, char *err, size_t errlen) {
  auth_t *a = calloc(1, sizeof *a);
  if (!a) {
    snprintf(err, errlen, "out of memory");
    return NULL;
  }
  pthread_rwlock_init(&a->lock, NULL);
  pthread_mutex_init(&a->log_mu, NULL);
  if (tokens_file && *tokens_file) {
    a->file = strdup(tokens_file);
    if (!a->file || load(a, err, errlen) < 0) {
      auth_destroy(a);
      return NULL;
    }
  }
  return a;
}

void auth_destroy(auth_t *a) {
  if (!a) return;
  free(a->file);
  free(a->set.v);
  pthread_rwlock_destroy(&a->lock);
  pthread_mutex_destroy(&a->log_mu);
  free(a);
}

bool auth_enabled(const auth_t *a) { return a && a->file; }

int auth_reload(auth_t *a, char *err, size_t errlen) {
  if (!auth_enabled(a)) return 0;
  return load(a, err, errlen);
}

/* Whether id's token is still its principal's (and, with admin, with the same
 * admin flag). Holds a->lock. */
static bool holds_locked(const auth_t *a, const rpc_identity_t *id, bool admin) {
  bool ok = false;
  for (size_t i = 0; i < a->set.n; i++)
    if (!strcmp(a->set.v[i].name, id->name) && (!admin || a->set.v[i].admin == id->admin) &&
        !CRYPTO_memcmp(a->set.v[i].digest, id->credential, sizeof id->credential))
      ok = true;
  return ok;
}

static bool revoked(auth_t *a, const rpc_identity_t *id, bool admin) {
  if (!auth_enabled(a) || !id->has_credential) return false;
  pthread_rwlock_rdlock(&a->lock);
  bool ok = holds_locked(a, id, admin);
  pthread_rwlock_unlock(&a->lock);
  return !ok;
}

/* (A token that lost or gained admin: its calls end, to come back as it is now.) */
bool auth_call_revoked(const rpc_identity_t *id, void *arg) { return revoked(arg, id, true); }

bool auth_token_revoked(const rpc_identity_t *id, void *arg) { return revoked(arg, id, false); }

bool auth_pin(auth_t *a, const rpc_identity_t *const *ids, size_t n) {
  if (!auth_enabled(a)) return true;
  pthread_rwlock_rdlock(&a->lock);
  for (size_t i = 0; i < n; i++)
    if (ids[i] && ids[i]->has_credential && !holds_locked(a, ids[i], false)) {
      pthread_rwlock_unlock(&a->lock);
      return false;
    }
  return true;
}

void auth_unpin(auth_t *a) {
  if (auth_enabled(a)) pthread_rwlock_unlock(&a->lock);
}

/* One warn line per second at most, with how many were not logged. */
static void log_refusal(auth_t *a, rpc_call_t *call, const char *why) {
  int64_t now = rpc_now_ms();
  pthread_mutex_lock(&a->log_mu);
  bool log_now = now - a->last_refusal_log_ms >= 1000;
  unsigned skipped = a->refusals_unlogged;
  if (log_now) {
    a->last_refusal_log_ms = now;
    a->refusals_unlogged = 0;
  } else {
    a->refusals_unlogged++;
  }
  pthread_mutex_unlock(&a->log_mu);
  if (!log_now) return;
  char *peer = rpc_call_peer(call);
  log_warn("auth", "refused %s from %s: %s%s", rpc_call_method(call), peer ? peer : "?", why,
           skipped ? " (and more refusals not logged)" : "");
  free(peer);
}

grpc_status_code auth_guard(rpc_call_t *call, void *arg, rpc_identity_t *id, char *msg,
                            size_t msglen) {
  auth_t *a = arg;
  if (!auth_enabled(a)) {
    snprintf(id->name, sizeof id->name, "%s", AUTH_ANONYMOUS);
    id->admin = true;
    return GRPC_STATUS_OK;
  }
  char value[AUTH_TOKEN_MAX + 16];
  const char *m = rpc_call_method(call);
  if (!rpc_call_metadata(call, "authorization", value, sizeof value)) {
    snprintf(msg, msglen, "%s needs a bearer token: send the metadata 'authorization: Bearer "
             "TOKEN' with a token from the server's --auth-tokens file", m);
    log_refusal(a, call, "no bearer token");
    return GRPC_STATUS_UNAUTHENTICATED;
  }
  size_t len = strlen(value);
  if (len < 7 || strncasecmp(value, "Bearer ", 7) != 0) {
    snprintf(msg, msglen, "%s: the authorization metadata must be 'Bearer TOKEN'", m);
    OPENSSL_cleanse(value, sizeof value);
    log_refusal(a, call, "authorization is not 'Bearer TOKEN'");
    return GRPC_STATUS_UNAUTHENTICATED;
  }
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256((const unsigned char *)value + 7, len - 7, digest);
  OPENSSL_cleanse(value, sizeof value);
  /* Every entry is compared, whatever matched, so the time says nothing. */
  size_t found = SIZE_MAX;
  pthread_rwlock_rdlock(&a->lock);
  for (size_t i = 0; i < a->set.n; i++) {
    int diff = CRYPTO_memcmp(a->set.v[i].digest, digest, sizeof digest);
    size_t mask = (size_t)0 - (size_t)(diff == 0);
    found = (found & ~mask) | (i & mask);
  }
  if (found != SIZE_MAX) {
    snprintf(id->name, sizeof id->name, "%s", a->set.v[found].name);
    id->admin = a->set.v[found].admin;
    id->has_credential = true;
    memcpy(id->credential, digest, sizeof id->credential);
  }
  pthread_rwlock_unlock(&a->lock);
  if (found == SIZE_MAX) {
    snprintf(msg, msglen, "%s: the bearer token is not valid (unknown, or revoked)", m);
    log_refusal(a, call, "a bearer token that matches no principal");
    return GRPC_STATUS_UNAUTHENTICATED;
  }
  return GRPC_STATUS_OK;
}
