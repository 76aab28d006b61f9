#include "url_allow.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <curl/curl.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

/* Addresses that are not on the public internet (RFC 6890 and successors).
 * A URL reaching one of these from an agent could read the cluster's own
 * services (cloud metadata at 169.254.169.254, internal APIs). */
static const struct {
  uint32_t net;
  int prefix;
  const char *what;
} v4_special[] = {
    {0x00000000, 8, "a 'this network' address (0.0.0.0/8)"},
    {0x0a000000, 8, "a private address (10.0.0.0/8)"},
    {0x64400000, 10, "a shared (carrier-grade NAT) address (100.64.0.0/10)"},
    {0xa9fe0000, 16, "a link-local address (169.254.0.0/16)"},
    {0xac100000, 12, "a private address (172.16.0.0/12)"},
    {0xc0000000, 24, "an IETF protocol address (192.0.0.0/24)"},
    {0xc0000200, 24, "a documentation address (192.0.2.0/24)"},
    {0xc0586300, 24, "a 6to4 relay address (192.88.99.0/24)"},
    {0xc0a80000, 16, "a private address (192.168.0.0/16)"},
    {0xc6120000, 15, "a benchmarking address (198.18.0.0/15)"},
    {0xc6336400, 24, "a documentation address (198.51.100.0/24)"},
    {0xcb007100, 24, "a documentation address (203.0.113.0/24)"},
    {0xe0000000, 4, "a multicast address (224.0.0.0/4)"},
    {0xf0000000, 4, "a reserved address (240.0.0.0/4)"},
};

/* An address as 16 bytes: IPv4 as ::ffff:a.b.c.d, so one form covers both. */
typedef struct {
  uint8_t b[16];
} addr_t;

static bool is_v4(const addr_t *a) {
  static const uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return memcmp(a->b, mapped, 12) == 0;
}

static uint32_t v4_of(const addr_t *a, int at) {
  return (uint32_t)a->b[at] << 24 | (uint32_t)a->b[at + 1] << 16 | (uint32_t)a->b[at + 2] << 8 |
         a->b[at + 3];
}

static bool prefix_match(const uint8_t *x, const uint8_t *net, int bits) {
  int full = bits / 8, rest = bits % 8;
  if (memcmp(x, net, (size_t)full) != 0) return false;
  return !rest || ((x[full] ^ net[full]) & (0xff00 >> rest) & 0xff) == 0;
}

static bool addr_from_sockaddr(const struct sockaddr *sa, addr_t *out) {
  memset(out, 0, sizeof *out);
  if (sa->sa_family == AF_INET) {
    out->b[10] = out->b[11] = 0xff;
    memcpy(out->b + 12, &((const struct sockaddr_in *)sa)->sin_addr, 4);
    return true;
  }
  if (sa->sa_family == AF_INET6) {
    memcpy(out->b, &((const struct sockaddr_in6 *)sa)->sin6_addr, 16);
    return true;
  }
  return false;
}

/* "10.0.0.0/8", "fd00::/8", or one address: into net and bits (of the 128). */
static bool parse_net(const char *s, addr_t *net, int *bits) {
  char buf[INET6_ADDRSTRLEN + 8];
  if (strlen(s) >= sizeof buf) return false;
  strcpy(buf, s);
  char *slash = strchr(buf, '/');
  long len = -1;
  if (slash) {
    char *end;
    *slash = 0;
    len = strtol(slash + 1, &end, 10);
    if (!isdigit((unsigned char)slash[1]) || *end) return false;
  }
  memset(net, 0, sizeof *net);
  if (inet_pton(AF_INET, buf, net->b + 12) == 1) {
    net->b[10] = net->b[11] = 0xff;
    if (len > 32) return false;
    *bits = 96 + (int)(len < 0 ? 32 : len);
    return true;
  }
  if (inet_pton(AF_INET6, buf, net->b) == 1 && len <= 128) {
    *bits = (int)(len < 0 ? 128 : len);
    return true;
  }
  return false;
}

static bool in_nets(const url_allow_t *a, const addr_t *x) {
  for (size_t i = 0; a && i < a->n_nets; i++) {
    addr_t net;
    int bits;
    if (parse_net(a->nets[i], &net, &bits) && prefix_match(x->b, net.b, bits)) return true;
  }
  return false;
}

/* NULL when x is public or loopback, else what it is. */
static const char *special_kind(const addr_t *x) {
  if (is_v4(x)) {
    uint32_t v = v4_of(x, 12);
    if (v >> 24 == 127) return NULL; /* loopback */
    for (size_t i = 0; i < sizeof v4_special / sizeof v4_special[0]; i++)
      if ((v ^ v4_special[i].net) >> (32 - v4_special[i].prefix) == 0) return v4_special[i].what;
    return NULL;
  }
  static const uint8_t loop[16] = {[15] = 1}, any[16] = {0};
  if (memcmp(x->b, loop, 16) == 0) return NULL;
  if (memcmp(x->b, any, 16) == 0) return "the unspecified address (::)";
  /* NAT64 and 6to4 carry an IPv4 address: that address decides. */
  static const uint8_t nat64[12] = {0, 0x64, 0xff, 0x9b};
  if (memcmp(x->b, nat64, 12) == 0 || (x->b[0] == 0x20 && x->b[1] == 0x02)) {
    addr_t v4 = {{[10] = 0xff, [11] = 0xff}};
    memcpy(v4.b + 12, x->b + (x->b[0] == 0x20 ? 2 : 12), 4);
    const char *k = special_kind(&v4);
    return k ? k : (v4_of(&v4, 12) >> 24 == 127 ? "a tunnel to a loopback address" : NULL);
  }
  if ((x->b[0] & 0xfe) == 0xfc) return "a unique local (private) address (fc00::/7)";
  if (x->b[0] == 0xfe && (x->b[1] & 0xc0) == 0x80) return "a link-local address (fe80::/10)";
  if (x->b[0] == 0xfe && (x->b[1] & 0xc0) == 0xc0) return "a site-local address (fec0::/10)";
  if (x->b[0] == 0xff) return "a multicast address (ff00::/8)";
  if (x->b[0] == 0x20 && x->b[1] == 0x01 && x->b[2] == 0x0d && x->b[3] == 0xb8)
    return "a documentation address (2001:db8::/32)";
  if (x->b[0] == 0x3f && x->b[1] == 0xff && (x->b[2] & 0xf0) == 0)
    return "a documentation address (3fff::/20)";
  /* Teredo (2001::/32), benchmarking (2001:2::/48), ORCHIDv2 (2001:20::/28) ... */
  if (x->b[0] == 0x20 && x->b[1] == 0x01 && x->b[2] < 0x02)
    return "an IETF protocol address (2001::/23)";
  if ((x->b[0] & 0xe0) != 0x20) return "not a global unicast address (2000::/3)";
  return NULL;
}

static bool address_ok(const url_allow_t *a, const addr_t *x, char *why, size_t n) {
  if (a && a->allow_private) return true;
  const char *kind = special_kind(x);
  if (!kind || in_nets(a, x)) return true;
  char text[INET6_ADDRSTRLEN];
  if (is_v4(x)) inet_ntop(AF_INET, x->b + 12, text, sizeof text);
  else inet_ntop(AF_INET6, x->b, text, sizeof text);
  snprintf(why, n, "%s is %s; allow it by listing its network in the URL allow list", text, kind);
  return false;
}

bool url_allow_address(const url_allow_t *a, const struct sockaddr *sa, char *why, size_t n) {
  addr_t x;
  if (!addr_from_sockaddr(sa, &x)) {
    snprintf(why, n, "address family %d is not IPv4 or IPv6", (int)sa->sa_family);
    return false;
  }
  return address_ok(a, &x, why, n);
}

static bool host_matches(const char *pattern, const char *host) {
  if (strcmp(pattern, "*") == 0) return true;
  if (strncmp(pattern, "*.", 2) == 0) {
    size_t hl = strlen(host), pl = strlen(pattern + 1); /* ".example.com" */
    return hl > pl && strcasecmp(host + hl - pl, pattern + 1) == 0;
  }
  return strcasecmp(pattern, host) == 0;
}

/* Whether path lies under root, as text ("/" holds everything). */
static bool under(const char *path, const char *root) {
  size_t n = strlen(root);
  while (n > 1 && root[n - 1] == '/') n--;
  if (n == 1 && root[0] == '/') return true;
  return strncmp(path, root, n) == 0 && (path[n] == '/' || path[n] == 0);
}

/* A file:// path: first as text (no "." or ".." segment, under a root), so
 * that where the file is not, or is not ours to see, nothing says whether it
 * exists; then, where the file is read (fd), opened, and the file opened
 * checked (its path with the links resolved under a root, a regular file):
 * the caller reads that descriptor, so the check holds for what is read even
 * if a link is swapped in meanwhile. */
static int check_file_path(const url_allow_t *a, CURLU *u, const char *shown, int *fd,
                           meshd_error_t *e) {
  if (!a || !a->n_file_roots) return 0;
  char *path = NULL, real[PATH_MAX], root[PATH_MAX];
  if (curl_url_get(u, CURLUPART_PATH, &path, CURLU_URLDECODE) != CURLUE_OK)
    return error_set(e, ERR_BAD_ARGUMENT, "fetch %s: its path does not decode", shown);
  int rc = 0;
  for (const char *seg = path; *seg && !rc; seg += strcspn(seg, "/")) {
    seg += strspn(seg, "/");
    size_t n = strcspn(seg, "/");
    if ((n == 1 && seg[0] == '.') || (n == 2 && seg[0] == '.' && seg[1] == '.'))
      rc = error_set(e, ERR_BAD_ARGUMENT, "fetch %s: the path has a '.' or '..' segment; write "
                     "it without", shown);
  }
  size_t i = 0;
  while (!rc && i < a->n_file_roots && !under(path, a->file_roots[i])) i++;
  if (!rc && i == a->n_file_roots)
    rc = error_set(e, ERR_PERMISSION_DENIED,
                   "fetch %s: the file is outside the directories the URL allow list gives",
                   shown);
  /* O_NONBLOCK: a FIFO's open would wait for a writer; it is refused below. */
  int f = rc || !fd ? -1 : open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  int open_errno = errno;
  curl_free(path);
  if (rc || !fd) return rc;
  if (f < 0) {
    if (open_errno == ENOENT || open_errno == ENOTDIR)
      return error_set(e, ERR_BAD_ARGUMENT, "fetch %s: no such file", shown);
    return error_set(e, ERR_BAD_ARGUMENT, "fetch %s: cannot open the file: %s", shown,
                     strerror(open_errno));
  }
  char link[64];
  snprintf(link, sizeof link, "/proc/self/fd/%d", f);
  ssize_t n = readlink(link, real, sizeof real - 1);
  struct stat st;
  if (n <= 0 || fstat(f, &st) != 0) {
    close(f);
    return error_set(e, ERR_UNAVAILABLE, "fetch %s: cannot tell where the file is: %s", shown,
                     strerror(errno));
  }
  real[n] = 0;
  for (i = 0; i < a->n_file_roots; i++)
    if (realpath(a->file_roots[i], root) && under(real, root)) break;
  if (i == a->n_file_roots) {
    close(f);
    return error_set(e, ERR_PERMISSION_DENIED,
                     "fetch %s: the file is outside the directories the URL allow list gives "
                     "(through a symbolic link)", shown);
  }
  if (!S_ISREG(st.st_mode)) {
    close(f);
    return error_set(e, ERR_BAD_ARGUMENT, "fetch %s: not a regular file", shown);
  }
  *fd = f;
  return 0;
}

int url_allow_check_url(const url_allow_t *a, const char *url, const char *shown, int *file_fd,
                        char *scheme, size_t scheme_cap, meshd_error_t *e) {
  if (file_fd) *file_fd = -1;
  static const char *const default_schemes[] = {"http", "https"};
  for (size_t i = 0; a && i < a->n_nets; i++) {
    addr_t net;
    int bits;
    if (!parse_net(a->nets[i], &net, &bits))
      return error_set(e, ERR_BAD_ARGUMENT,
                       "URL allow list: network '%.64s' is not an address or address/prefix such "
                       "as 10.1.0.0/16",
                       a->nets[i]);
  }
  CURLU *u = curl_url();
  char *s = NULL, *host = NULL;
  int rc = -1;
  if (!u) return error_set(e, ERR_QUOTA, "fetch %s: out of memory", shown);
  CURLUcode uc = curl_url_set(u, CURLUPART_URL, url, CURLU_NON_SUPPORT_SCHEME);
  if (uc != CURLUE_OK) {
    error_set(e, ERR_BAD_ARGUMENT, "fetch %s: not a URL: %s", shown, curl_url_strerror(uc));
    goto out;
  }
  curl_url_get(u, CURLUPART_SCHEME, &s, 0);
  for (char *p = s; p && *p; p++) *p = (char)tolower((unsigned char)*p);
  const char *const *schemes = a && a->n_schemes ? a->schemes : default_schemes;
  size_t n_schemes = a && a->n_schemes ? a->n_schemes : 2, i = 0;
  while (s && i < n_schemes && strcasecmp(schemes[i], s) != 0) i++;
  if (!s || i == n_schemes || strlen(s) >= scheme_cap) {
    char list[128] = "";
    for (size_t k = 0; k < n_schemes; k++)
      snprintf(list + strlen(list), sizeof list - strlen(list), "%s%.16s", k ? ", " : "",
               schemes[k]);
    error_set(e, ERR_PERMISSION_DENIED,
              "fetch %s: scheme '%.16s' is not allowed (allowed: %s; the server's --url-allow "
              "lists them)", shown, s ? s : "", list);
    goto out;
  }
  if (strcmp(s, "http") != 0 && strcmp(s, "https") != 0 && strcmp(s, "file") != 0) {
    error_set(e, ERR_BAD_ARGUMENT, "fetch %s: scheme '%.16s' is not supported (http, https, file)",
              shown, s);
    goto out;
  }
  strcpy(scheme, s);
  if (strcmp(s, "file") == 0) {
    rc = check_file_path(a, u, shown, file_fd, e);
    goto out;
  }
  if (curl_url_get(u, CURLUPART_HOST, &host, 0) != CURLUE_OK || !host || !*host) {
    error_set(e, ERR_BAD_ARGUMENT, "fetch %s: no host", shown);
    goto out;
  }
  /* "[::1]" and "example.com." name the same host as "::1" and "example.com". */
  char bare[256];
  size_t hl = strlen(host);
  const char *h = host;
  if (host[0] == '[' && hl > 2) h++, hl -= 2;
  if (hl >= sizeof bare) {
    error_set(e, ERR_BAD_ARGUMENT, "fetch %s: host name too long", shown);
    goto out;
  }
  memcpy(bare, h, hl);
  bare[hl] = 0;
  if (hl > 1 && bare[hl - 1] == '.') bare[hl - 1] = 0;
  /* A zone id only ends an IPv6 literal: in a name, '%' is part of what curl
   * resolves ("example.com%25.evil.example" is a host under evil.example). */
  char *zone = host[0] == '[' ? strchr(bare, '%') : NULL;
  if (zone) *zone = 0;
  bool host_ok = !a || !a->n_hosts;
  for (size_t k = 0; !host_ok && k < a->n_hosts; k++) host_ok = host_matches(a->hosts[k], bare);
  if (!host_ok) {
    error_set(e, ERR_PERMISSION_DENIED, "fetch %s: host '%.64s' is not in the URL allow list",
              shown, bare);
    goto out;
  }
  /* A host written as an address is refused here, before curl starts; names
   * are checked on the addresses they resolve to (the socket callback). */
  addr_t x;
  char why[200];
  if (inet_pton(AF_INET6, bare, x.b) == 1 ||
      (memset(&x, 0, sizeof x), x.b[10] = x.b[11] = 0xff, inet_pton(AF_INET, bare, x.b + 12) == 1)) {
    if (!address_ok(a, &x, why, sizeof why)) {
      error_set(e, ERR_PERMISSION_DENIED, "fetch %s: refused before connecting: %s", shown, why);
      goto out;
    }
  }
  rc = 0;
out:
  curl_free(s);
  curl_free(host);
  curl_url_cleanup(u);
  return rc;
}
