/* Fuzz target: the URL checks a load's URL meets before any agent connects
 * (core/url: url_policy_check on the server, url_allow_check_url, url_redact
 * in every message that quotes a URL) and the --url-allow parser.
 *
 * Input: byte 0 picks the policy: one of a few fixed --url-allow values, or
 * (when its low 3 bits are 7) a spec read from the input up to the first NUL;
 * the rest, up to its first NUL, is the URL a client sent. Besides "no crash,
 * no sanitizer report", it checks:
 *   - url_redact's text is terminated within its buffer and never shows the
 *     URL's password or query (when curl finds one that is not also a part of
 *     what is shown: the host, the port or the path);
 *   - a refusal has a kind and a terminated message, which quotes the URL
 *     only redacted;
 *   - under a policy without "private" or nets, an accepted URL whose host is
 *     an IPv4 literal is public or loopback (a second, independent reading
 *     of the address: inet_pton on curl's host);
 *   - under a policy with host patterns, an accepted http(s) URL's host, all
 *     of it as curl reads it (the name curl resolves), matches one. */
#include <arpa/inet.h>
#include <curl/curl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "fuzz_input.h"
#include "url_fetch.h"
#include "url_policy.h"

static const char *const specs[] = {
    "", "https://*", "http://*,https://*.example.com", "https://example.com,net:10.1.0.0/16",
    "file:///data,https://*", "private,http://*", "none",
};

/* Whether the IPv4 address (host order) is one the default policy refuses. */
static bool v4_special(uint32_t v) {
  uint8_t a = (uint8_t)(v >> 24), b = (uint8_t)(v >> 16), c = (uint8_t)(v >> 8);
  if (a == 127) return false;
  return a == 0 || a == 10 || (a == 100 && (b & 0xc0) == 64) || (a == 169 && b == 254) ||
         (a == 172 && (b & 0xf0) == 16) || (a == 192 && b == 0 && (c == 0 || c == 2)) ||
         (a == 192 && b == 88 && c == 99) || (a == 192 && b == 168) ||
         (a == 198 && (b & 0xfe) == 18) || (a == 198 && b == 51 && c == 100) ||
         (a == 203 && b == 0 && c == 113) || a >= 224;
}

/* part (curl's reading of url) must not show in `shown` unless it is also in
 * what is shown of the URL (scheme://host:port/path, as curl reads them);
 * parts under `min` bytes are not checked (a short one can be a word of the
 * message's own text). */
static void check_hidden(CURLU *u, CURLUPart which, const char *what, const char *shown,
                         size_t min) {
  char *part = NULL, *scheme = NULL, *host = NULL, *path = NULL, *port = NULL;
  if (curl_url_get(u, which, &part, 0) != CURLUE_OK || !part || strlen(part) < min ||
      strchr(part, '.')) { /* a '.' could meet the "..." of a long URL's cut */
    curl_free(part);
    return;
  }
  curl_url_get(u, CURLUPART_SCHEME, &scheme, 0);
  curl_url_get(u, CURLUPART_HOST, &host, 0);
  curl_url_get(u, CURLUPART_PATH, &path, 0);
  curl_url_get(u, CURLUPART_PORT, &port, 0);
  static char full[8192];
  snprintf(full, sizeof full, "%s://%s%s%s%s", scheme ? scheme : "", host ? host : "",
           port ? ":" : "", port ? port : "", path ? path : "");
  FZ_CHECK(strstr(full, part) || !strstr(shown, part), "the %s '%s' shows in '%s'", what, part,
           shown);
  curl_free(part);
  curl_free(scheme);
  curl_free(host);
  curl_free(path);
  curl_free(port);
}

/* host (curl's, less a trailing dot) against the policy's patterns, read
 * apart from url_allow.c: "*", "*.suffix" (a proper subdomain) or the name. */
static bool host_listed(const url_allow_t *a, const char *host) {
  size_t hl = strlen(host);
  if (hl > 1 && host[hl - 1] == '.') hl--;
  for (size_t i = 0; i < a->n_hosts; i++) {
    const char *pat = a->hosts[i];
    size_t pl = strlen(pat);
    if (strcmp(pat, "*") == 0) return true;
    if (pat[0] == '*' && pat[1] == '.') {
      if (hl > pl - 1 && strncasecmp(host + hl - (pl - 1), pat + 1, pl - 1) == 0) return true;
    } else if (hl == pl && strncasecmp(host, pat, pl) == 0) {
      return true;
    }
  }
  return false;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fz_t in = fz_open(data, size);
  uint8_t sel = fz_u8(&in);
  char specbuf[256], url[4096];
  const char *spec = specs[(sel >> 3) % (sizeof specs / sizeof specs[0])];
  if ((sel & 7) == 7) {
    size_t k = 0;
    while (!fz_done(&in) && k < sizeof specbuf - 1) {
      char c = (char)fz_u8(&in);
      if (!c) break;
      specbuf[k++] = c;
    }
    specbuf[k] = 0;
    spec = specbuf;
  }
  size_t k = 0;
  while (!fz_done(&in) && k < sizeof url - 1) {
    char c = (char)fz_u8(&in);
    if (!c) break;
    url[k++] = c;
  }
  url[k] = 0;

  char shown[512]; /* url_fetch.c's URL_SHOWN */
  memset(shown, 'x', sizeof shown);
  url_redact(url, shown, sizeof shown);
  FZ_CHECK(memchr(shown, 0, sizeof shown), "url_redact left its text unterminated");
  CURLU *u = curl_url();
  if (u && curl_url_set(u, CURLUPART_URL, url, CURLU_NON_SUPPORT_SCHEME) == CURLUE_OK) {
    check_hidden(u, CURLUPART_PASSWORD, "password", shown, 6);
    check_hidden(u, CURLUPART_QUERY, "query", shown, 6);
  }

  url_policy_t p;
  meshd_error_t e = {0};
  if (url_policy_parse(spec, &p, &e)) {
    FZ_CHECK(e.kind != ERR_NONE && e.msg[0], "--url-allow refused without a message");
    FZ_CHECK(memchr(e.msg, 0, sizeof e.msg), "unterminated message");
    curl_url_cleanup(u);
    return 0;
  }
  /* What the agents are sent reads back as the same allow list. */
  Meshd__Agent__V1__UrlPolicy w;
  url_policy_to_proto(&p, &w);
  url_allow_t back;
  url_fetch_opts_t o;
  url_policy_from_proto(&w, &back, &o);
  FZ_CHECK(back.n_schemes == p.allow.n_schemes && back.n_hosts == p.allow.n_hosts &&
               back.n_nets == p.allow.n_nets && back.n_file_roots == p.allow.n_file_roots &&
               back.allow_private == p.allow.allow_private,
           "the policy sent to agents differs");

  meshd_error_t ce = {0};
  int rc = url_policy_check(&p, url, &ce);
  if (rc) {
    FZ_CHECK(ce.kind == ERR_PERMISSION_DENIED || ce.kind == ERR_BAD_ARGUMENT,
             "refused with kind %d: %s", (int)ce.kind, ce.msg);
    FZ_CHECK(memchr(ce.msg, 0, sizeof ce.msg) && ce.msg[0], "refusal without a message");
    if (u) {
      check_hidden(u, CURLUPART_PASSWORD, "password", ce.msg, 16);
      check_hidden(u, CURLUPART_QUERY, "query", ce.msg, 16);
    }
  } else if (u) {
    char *host = NULL, *scheme = NULL;
    curl_url_get(u, CURLUPART_SCHEME, &scheme, 0);
    bool web = scheme && (strcasecmp(scheme, "http") == 0 || strcasecmp(scheme, "https") == 0);
    curl_free(scheme);
    if (web) curl_url_get(u, CURLUPART_HOST, &host, 0);
    if (host && p.allow.n_hosts && host[0] != '[')
      FZ_CHECK(host_listed(&p.allow, host), "URL %s to host '%s' accepted by --url-allow=%s",
               shown, host, spec);
    if (!p.allow.allow_private && !p.allow.n_nets && host) {
      struct in_addr a;
      if (inet_pton(AF_INET, host, &a) == 1)
        FZ_CHECK(!v4_special(ntohl(a.s_addr)), "URL %s to a special address %s accepted", shown,
                 host);
    }
    curl_free(host);
  }
  url_policy_free(&p);
  curl_url_cleanup(u);
  return 0;
}
