/* The checks meshd_connect_with makes on its options (conn.h). */
#include "conn.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* One host (no brackets, no port) of a target. */
static bool host_is_loopback(const char *host, size_t len) {
  char buf[64];
  if (len == 0 || len >= sizeof buf)
    return false;
  memcpy(buf, host, len);
  buf[len] = '\0';
  char *zone = strchr(buf, '%'); /* fe80::1%eth0 */
  if (zone)
    *zone = '\0';
  if (strcasecmp(buf, "localhost") == 0)
    return true;
  unsigned char a[16];
  if (inet_pton(AF_INET, buf, a) == 1)
    return a[0] == 127;
  if (inet_pton(AF_INET6, buf, a) == 1) {
    static const unsigned char loop6[16] = {[15] = 1};
    static const unsigned char mapped[12] = {[10] = 0xff, [11] = 0xff};
    return memcmp(a, loop6, 16) == 0 || (memcmp(a, mapped, 12) == 0 && a[12] == 127);
  }
  return false;
}

bool conn_target_is_loopback(const char *target) {
  const char *t = target;
  if (strncmp(t, "unix:", 5) == 0 || strncmp(t, "unix-abstract:", 14) == 0)
    return true;
  static const char *const schemes[] = {"dns:", "ipv4:", "ipv6:"};
  for (size_t i = 0; i < sizeof schemes / sizeof schemes[0]; i++) {
    size_t n = strlen(schemes[i]);
    if (strncmp(t, schemes[i], n) == 0) {
      t += n;
      if (strncmp(t, "//", 2) == 0) { /* dns://authority/host:port */
        const char *slash = strchr(t + 2, '/');
        t = slash ? slash + 1 : t + 2;
      }
      break;
    }
  }
  /* ipv4:a:1,b:2 lists several addresses: each must be loopback. */
  do {
    const char *end = strchr(t, ',');
    size_t len = end ? (size_t)(end - t) : strlen(t);
    const char *host = t;
    size_t hlen = len;
    if (len > 0 && t[0] == '[') {
      const char *close = memchr(t, ']', len);
      host = t + 1;
      hlen = close ? (size_t)(close - host) : len - 1;
    } else {
      const char *colon = memchr(t, ':', len);
      if (colon && !memchr(colon + 1, ':', len - (size_t)(colon + 1 - t)))
        hlen = (size_t)(colon - t); /* host:port; more colons: a bare IPv6 address */
    }
    if (!host_is_loopback(host, hlen))
      return false;
    t = end ? end + 1 : NULL;
  } while (t);
  return true;
}

int conn_check_token(const char *token, const char *what, char *err, size_t errlen) {
  size_t n = strlen(token);
  if (n > CONN_MAX_TOKEN) {
    snprintf(err, errlen, "%s: the token is %zu bytes, more than %d", what, n, CONN_MAX_TOKEN);
    return -1;
  }
  for (size_t i = 0; i < n; i++)
    if (token[i] < '!' || token[i] > '~') {
      snprintf(err, errlen,
               "%s: the token has a character that is not visible ASCII at position %zu "
               "(spaces, control characters and non-ASCII are not allowed)",
               what, i);
      return -1;
    }
  return 0;
}

int conn_check_pem(const char *path, const char *label, const char *what, char *err,
                   size_t errlen) {
  FILE *f = fopen(path, "r");
  if (!f) {
    snprintf(err, errlen, "%s: cannot read %s: %s", what, path, strerror(errno));
    return -1;
  }
  /* PEM files are small: the first BEGIN line is within the first 64 KiB. */
  enum { CAP = 1 << 16 };
  char *buf = malloc(CAP);
  if (!buf) {
    fclose(f);
    snprintf(err, errlen, "%s: out of memory", what);
    return -1;
  }
  size_t n = fread(buf, 1, CAP - 1, f);
  bool read_err = ferror(f);
  fclose(f);
  if (read_err) {
    free(buf);
    snprintf(err, errlen, "%s: cannot read %s", what, path);
    return -1;
  }
  buf[n] = '\0';
  /* Any block's BEGIN line (`openssl ecparam -genkey` writes EC PARAMETERS first). */
  bool ok = false;
  for (const char *begin = strstr(buf, "-----BEGIN "); begin && !ok;
       begin = strstr(begin + 1, "-----BEGIN ")) {
    const char *eol = strchr(begin, '\n');
    const char *lab = strstr(begin, label);
    ok = lab && (!eol || lab < eol);
  }
  explicit_bzero(buf, n); /* it may have been a key */
  free(buf);
  if (!ok) {
    snprintf(err, errlen, "%s: %s holds no PEM %s", what, path, label);
    return -1;
  }
  return 0;
}

const char *conn_redact_url(const char *url, char *out, size_t n) {
  if (!n)
    return out;
  const char *sep = strstr(url, "://");
  size_t lead = 0; /* bytes of "scheme://" */
  if (sep && sep - url < 32 && (size_t)(sep - url) == strcspn(url, ":/?#@"))
    lead = (size_t)(sep - url) + 3;
  const char *auth = url + lead, *end = auth + strcspn(auth, "/?#");
  const char *at = NULL;
  for (const char *p = auth; p < end; p++)
    if (*p == '@')
      at = p;
  const char *host = at ? at + 1 : auth;
  const char *stop = host + strcspn(host, "?#");
  snprintf(out, n, "%.*s%.*s", (int)lead, url, (int)(stop - host), host);
  return out;
}
