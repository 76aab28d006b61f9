/* TLS credentials for rpc servers and channels (rpc_tls_t in rpc.h).
 *
 * A server's credentials come from a certificate-config fetcher that gRPC
 * calls at each new handshake: it re-reads the PEM files when one of their
 * modification times changed, so rotating a Secret's files takes effect for
 * new connections without a restart. A file that fails to load keeps the
 * previous config (and logs once per change). */
#include <errno.h>
#include <grpc/grpc_security.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "log.h"
#include "rpc.h"
#include "rpc_tls.h"
#include "secret.h"

static char *read_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  char *buf = NULL;
  if (fseek(f, 0, SEEK_END) == 0) {
    long n = ftell(f);
    if (n >= 0 && n < (1L << 24) && fseek(f, 0, SEEK_SET) == 0) {
      buf = malloc((size_t)n + 1);
      if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
      }
      if (buf) buf[n] = '\0';
    }
  }
  fclose(f);
  return buf;
}

/* text has a "-----BEGIN ... label ... -----END" block: any of its blocks
 * (`openssl ecparam -genkey` writes EC PARAMETERS before the EC PRIVATE KEY). */
static bool holds_pem(const char *text, const char *label) {
  for (const char *begin = strstr(text, "-----BEGIN "); begin;
       begin = strstr(begin + 1, "-----BEGIN ")) {
    const char *end = strstr(begin, "-----END ");
    const char *lab = strstr(begin, label);
    if (!end) return false;
    if (lab && lab < end) return true;
  }
  return false;
}

char *rpc_tls_read_pem(const char *what, const char *path, const char *label, char *err,
                       size_t errlen) {
  char *pem = read_file(path);
  if (!pem) {
    snprintf(err, errlen, "%s: cannot read '%s': %s", what, path,
             errno ? strerror(errno) : "too large");
    return NULL;
  }
  if (!holds_pem(pem, label)) {
    snprintf(err, errlen, "%s: '%s' holds no PEM %s", what, path, label);
    free(pem);
    return NULL;
  }
  return pem;
}

/* No passphrase (gRPC takes no encrypted key): never a prompt on the terminal. */
static int no_passphrase(char *buf, int size, int rwflag, void *u) {
  (void)buf, (void)size, (void)rwflag, (void)u;
  return -1;
}

int rpc_tls_check_pair(const char *cert_file, const char *key_file, char *err, size_t errlen) {
  FILE *cf = fopen(cert_file, "r"), *kf = fopen(key_file, "r");
  X509 *cert = cf ? PEM_read_X509(cf, NULL, no_passphrase, NULL) : NULL;
  EVP_PKEY *key = kf ? PEM_read_PrivateKey(kf, NULL, no_passphrase, NULL) : NULL;
  int rc = 0;
  if (!cert || !key) {
    snprintf(err, errlen, "TLS: '%s' holds no %s that parses%s", !cert ? cert_file : key_file,
             !cert ? "certificate" : "private key", !cert ? "" : " (an encrypted key is not "
             "supported)");
    rc = -1;
  } else if (X509_check_private_key(cert, key) != 1) {
    snprintf(err, errlen, "TLS: the key in '%s' does not belong to the certificate in '%s'",
             key_file, cert_file);
    rc = -1;
  }
  ERR_clear_error();
  X509_free(cert);
  EVP_PKEY_free(key);
  if (cf) fclose(cf);
  if (kf) fclose(kf);
  return rc;
}

int rpc_tls_check(const rpc_tls_t *t, bool server, char *err, size_t errlen) {
  if (!t || !t->on) return 0;
  if (server && (!t->cert_file || !t->key_file)) {
    snprintf(err, errlen, "TLS on a server needs both a certificate and a key file");
    return -1;
  }
  if (!server && !t->cert_file != !t->key_file) {
    snprintf(err, errlen, "a client certificate needs its key, and a key its certificate");
    return -1;
  }
  const struct { const char *path, *label; } files[] = {
      {t->ca_file, "CERTIFICATE"}, {t->cert_file, "CERTIFICATE"}, {t->key_file, "PRIVATE KEY"}};
  for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
    if (!files[i].path) continue;
    char *pem = rpc_tls_read_pem("TLS", files[i].path, files[i].label, err, errlen);
    if (!pem) return -1;
    free(pem);
  }
  if (t->cert_file && t->key_file && rpc_tls_check_pair(t->cert_file, t->key_file, err, errlen))
    return -1;
  if (server) secret_warn_if_public("TLS private key", t->key_file);
  /* gRPC would take roots it cannot load and fail every connection later. */
  if (t->ca_pem && !holds_pem(t->ca_pem, "CERTIFICATE")) {
    snprintf(err, errlen, "TLS: the CA certificates given as text hold no PEM CERTIFICATE");
    return -1;
  }
  return 0;
}

/* ------------------------------------------------------------------ server */

struct rpc_tls_server {
  char *ca_file, *cert_file, *key_file;
  pthread_mutex_t mu;
  struct timespec mtime[3]; /* of ca, cert, key when last loaded */
  bool loaded;
  bool failing;             /* the last reload failed (logged once) */
};

static struct timespec mtime_of(const char *path) {
  struct stat st;
  if (!path || stat(path, &st) != 0) return (struct timespec){0, 0};
  return st.st_mtim;
}

static bool same_time(struct timespec a, struct timespec b) {
  return a.tv_sec == b.tv_sec && a.tv_nsec == b.tv_nsec;
}

/* A new config from the files, or NULL with err. */
static grpc_ssl_server_certificate_config *load_config(const rpc_tls_server_t *t, char *err,
                                                       size_t errlen) {
  char *ca = NULL, *cert = NULL, *key = NULL;
  grpc_ssl_server_certificate_config *cfg = NULL;
  if (t->ca_file &&
      !(ca = rpc_tls_read_pem("TLS client CA", t->ca_file, "CERTIFICATE", err, errlen)))
    goto out;
  if (!(cert = rpc_tls_read_pem("TLS certificate", t->cert_file, "CERTIFICATE", err, errlen)))
    goto out;
  if (!(key = rpc_tls_read_pem("TLS key", t->key_file, "PRIVATE KEY", err, errlen))) goto out;
  /* gRPC takes a pair that does not belong together, then refuses it at the
   * handshake and keeps the old one, in words that name neither file. */
  if (rpc_tls_check_pair(t->cert_file, t->key_file, err, errlen) != 0) goto out;
  grpc_ssl_pem_key_cert_pair pair = {key, cert};
  /* gRPC 1.51 asserts on a fetched config without roots even when it never
   * asks for client certificates: without a client CA its own chain stands
   * in, unused (the port is GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE). */
  cfg = grpc_ssl_server_certificate_config_create(ca ? ca : cert, &pair, 1);
  if (!cfg) snprintf(err, errlen, "TLS: gRPC refused the certificate or key");
out:
  free(ca);
  free(cert);
  free(key);
  return cfg;
}

/* Every time in mtimes is over a second before `seen` (a clock read before
 * they were taken): a later write gets a different time, however coarse the
 * file system's timestamps. */
static bool settled(const struct timespec mtimes[3], struct timespec seen) {
  for (int i = 0; i < 3; i++)
    if (mtimes[i].tv_sec + 1 >= seen.tv_sec) return false;
  return true;
}

static grpc_ssl_certificate_config_reload_status fetch(void *arg,
                                                       grpc_ssl_server_certificate_config **out) {
  rpc_tls_server_t *t = arg;
  struct timespec seen;
  clock_gettime(CLOCK_REALTIME, &seen); /* before the stat: see settled() */
  struct timespec now[3] = {mtime_of(t->ca_file), mtime_of(t->cert_file), mtime_of(t->key_file)};
  pthread_mutex_lock(&t->mu);
  grpc_ssl_certificate_config_reload_status rc = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_UNCHANGED;
  bool changed = !t->loaded;
  for (int i = 0; i < 3; i++) changed = changed || !same_time(now[i], t->mtime[i]);
  if (changed) {
    char err[300];
    grpc_ssl_server_certificate_config *cfg = load_config(t, err, sizeof err);
    if (cfg) {
      if (t->loaded) log_info("rpc", "TLS: reloaded %s (certificate files changed)", t->cert_file);
      *out = cfg;
      memcpy(t->mtime, now, sizeof now);
      t->loaded = true;
      t->failing = false;
      rc = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_NEW;
    } else {
      if (!t->failing) log_error("rpc", "%s; keeping the certificates loaded before", err);
      t->failing = true;
      /* Retry at the next change, not each handshake; but a file changed
       * within the last second may still be being written (truncate, then
       * write) and finish within the same timestamp tick: retried until its
       * time is older than that. */
      if (settled(now, seen)) memcpy(t->mtime, now, sizeof now);
      rc = t->loaded ? GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_UNCHANGED
                     : GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_FAIL;
    }
  }
  pthread_mutex_unlock(&t->mu);
  return rc;
}

static char *dup_or_null(const char *s) { return s ? strdup(s) : NULL; }

void rpc_tls_server_free(rpc_tls_server_t *t) {
  if (!t) return;
  free(t->ca_file);
  free(t->cert_file);
  free(t->key_file);
  pthread_mutex_destroy(&t->mu);
  free(t);
}

grpc_server_credentials *rpc_tls_server_creds(const rpc_tls_t *tls, rpc_tls_server_t **state,
                                              char *err, size_t errlen) {
  *state = NULL;
  if (!tls || !tls->on) return grpc_insecure_server_credentials_create();
  if (rpc_tls_check(tls, true, err, errlen) != 0) return NULL;
  rpc_tls_server_t *t = calloc(1, sizeof *t);
  if (!t) {
    snprintf(err, errlen, "out of memory");
    return NULL;
  }
  pthread_mutex_init(&t->mu, NULL);
  t->ca_file = dup_or_null(tls->ca_file);
  t->cert_file = dup_or_null(tls->cert_file);
  t->key_file = dup_or_null(tls->key_file);
  /* The first fetch happens now, in gRPC: check the files here for a message. */
  grpc_ssl_server_certificate_config *probe = load_config(t, err, errlen);
  if (!probe) {
    rpc_tls_server_free(t);
    return NULL;
  }
  grpc_ssl_server_certificate_config_destroy(probe);
  grpc_ssl_client_certificate_request_type req =
      !tls->ca_file                ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
      : tls->client_cert_optional ? GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY
                                  : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  grpc_ssl_server_credentials_options *o =
      grpc_ssl_server_credentials_create_options_using_config_fetcher(req, fetch, t);
  grpc_server_credentials *creds = o ? grpc_ssl_server_credentials_create_with_options(o) : NULL;
  if (!creds) {
    snprintf(err, errlen, "TLS: gRPC could not make server credentials from %s", tls->cert_file);
    rpc_tls_server_free(t);
    return NULL;
  }
  *state = t;
  return creds;
}

/* ------------------------------------------------------------------ channel */

grpc_channel_credentials *rpc_tls_channel_creds(const rpc_tls_t *tls) {
  if (!tls || !tls->on) return grpc_insecure_credentials_create();
  char err[300];
  if (rpc_tls_check(tls, false, err, sizeof err) != 0) {
    log_error("rpc", "%s", err);
    return NULL;
  }
  char *ca = tls->ca_pem ? strdup(tls->ca_pem) : tls->ca_file ? read_file(tls->ca_file) : NULL;
  char *cert = tls->cert_file ? read_file(tls->cert_file) : NULL;
  char *key = tls->key_file ? read_file(tls->key_file) : NULL;
  grpc_ssl_pem_key_cert_pair pair = {key, cert};
  grpc_channel_credentials *creds =
      grpc_ssl_credentials_create(ca, cert && key ? &pair : NULL, NULL, NULL);
  free(ca);
  free(cert);
  free(key);
  return creds;
}
