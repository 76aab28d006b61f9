#include "url_fetch.h"

#include <curl/curl.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "url_allow.h"

#define URL_SHOWN 512
#define URL_REDACT_MAX 240 /* the longest URL a message quotes */

typedef enum { MODE_RANGE, MODE_ALL, MODE_HEAD, MODE_PROBE } req_mode_t;
/* Why the write callback stopped a transfer (curl then says CURLE_WRITE_ERROR). */
typedef enum { STOP_NONE, STOP_DONE, STOP_STATUS, STOP_FAIL } stop_t;
typedef enum { OUT_OK, OUT_REDIRECT, OUT_RETRY, OUT_FAIL } outcome_t;

/* One call's transfer. The request fields are set once; the rest per attempt. */
typedef struct xfer {
  CURL *curl;
  const url_allow_t *allow;
  req_mode_t mode;
  uint64_t offset, length; /* RANGE: the bytes asked; ALL: the buffer's size */
  uint8_t *buf;
  url_sink_fn sink; /* instead of buf */
  void *sink_arg;
  bool (*caller_stop)(void *arg); /* url_fetch_opts_t's stop */
  void *caller_stop_arg;
  uint64_t max_bytes;
  const char *expect; /* RANGE, ALL: url_fetch_opts_t's expect_version; NULL: any */
  uint64_t expect_size; /* RANGE: url_fetch_opts_t's expect_size; 0: any */
  struct curl_slist *headers; /* its If-Match or If-Unmodified-Since; owned by run() */
  const char *shown; /* the redacted URL of this hop */
  CURLSH *share;     /* url_fetch_opts_t's share, when this call holds it; NULL: none */
  /* per attempt */
  bool started;
  long status;
  uint64_t skip, got, skipped, seen;
  uint64_t total; /* PROBE and HEAD: the resource's length; UINT64_MAX unknown */
  stop_t stop;
  error_kind_t fail_kind;
  char why[300];
  char refused[240]; /* set by the socket callback */
  char version[URL_VERSION_MAX]; /* HEAD and PROBE: what identifies this version of it */
  bool http_4xx;     /* the attempt ended on a 4xx status (url_fetch_size falls back) */
  char errbuf[CURL_ERROR_SIZE];
} xfer_t;

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static CURLcode curl_init_rc;
static void curl_init(void) { curl_init_rc = curl_global_init(CURL_GLOBAL_DEFAULT); }

struct url_share {
  CURLSH *sh;
  atomic_flag busy;  /* a call holds it */
  char *allow_key;   /* the allow list of its first call (allow_key()); NULL before */
};

url_share_t *url_share_new(void) {
  pthread_once(&curl_once, curl_init);
  if (curl_init_rc != CURLE_OK) return NULL;
  url_share_t *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  atomic_flag_clear(&s->busy);
  /* No lock callbacks: one call at a time uses it (busy), and the flag's
   * atomics order one thread's use before the next one's. */
  if (!(s->sh = curl_share_init()) ||
      curl_share_setopt(s->sh, CURLSHOPT_SHARE, CURL_LOCK_DATA_CONNECT) != CURLSHE_OK ||
      curl_share_setopt(s->sh, CURLSHOPT_SHARE, CURL_LOCK_DATA_DNS) != CURLSHE_OK ||
      curl_share_setopt(s->sh, CURLSHOPT_SHARE, CURL_LOCK_DATA_SSL_SESSION) != CURLSHE_OK) {
    url_share_free(s);
    return NULL;
  }
  return s;
}

void url_share_free(url_share_t *s) {
  if (!s) return;
  if (s->sh) curl_share_cleanup(s->sh); /* closes the connections it kept */
  free(s->allow_key);
  free(s);
}

/* a's rules as text: two lists with the same text decide alike (NULL is the
 * zero list: both are the defaults). NULL when out of memory. */
static char *allow_key(const url_allow_t *a) {
  static const url_allow_t none;
  char *key = NULL;
  size_t n = 0;
  FILE *f = open_memstream(&key, &n);
  if (!f) return NULL;
  if (!a) a = &none;
  const char *const *lists[] = {a->schemes, a->hosts, a->nets, a->file_roots};
  size_t counts[] = {a->n_schemes, a->n_hosts, a->n_nets, a->n_file_roots};
  fprintf(f, "%d", (int)a->allow_private);
  for (size_t l = 0; l < 4; l++) {
    fprintf(f, ";%zu", counts[l]);
    for (size_t i = 0; i < counts[l]; i++) fprintf(f, ",%zu:%s", strlen(lists[l][i]), lists[l][i]);
  }
  if (fclose(f)) {
    free(key);
    return NULL;
  }
  return key;
}

/* s's connections for a call with allow list a: NULL where another thread's
 * call holds it, or its connections were opened under another list. */
static CURLSH *share_take(url_share_t *s, const url_allow_t *a) {
  if (!s || atomic_flag_test_and_set(&s->busy)) return NULL;
  char *key = allow_key(a);
  bool ok = key && (!s->allow_key || strcmp(key, s->allow_key) == 0);
  if (ok && !s->allow_key) s->allow_key = key, key = NULL;
  free(key);
  if (ok) return s->sh;
  atomic_flag_clear(&s->busy);
  return NULL;
}

/* From the parts curl itself reads (what it sends is what is hidden: curl takes
 * "https:///u:p@h" and "https:/u:p@h" too); of a URL curl does not parse, and
 * so never fetches, only the scheme shows. */
const char *url_redact(const char *url, char *out, size_t n) {
  if (!n) return out;
  CURLU *u = curl_url();
  char *scheme = NULL, *host = NULL, *port = NULL, *path = NULL;
  if (u && curl_url_set(u, CURLUPART_URL, url, CURLU_NON_SUPPORT_SCHEME) == CURLUE_OK &&
      curl_url_get(u, CURLUPART_SCHEME, &scheme, 0) == CURLUE_OK) {
    curl_url_get(u, CURLUPART_HOST, &host, 0); /* none for file:// */
    curl_url_get(u, CURLUPART_PORT, &port, 0); /* only one written in the URL */
    curl_url_get(u, CURLUPART_PATH, &path, 0);
    char full[1024];
    int len = snprintf(full, sizeof full, "%s://%s%s%s%s", scheme, host ? host : "",
                       port ? ":" : "", port ? port : "", path ? path : "");
    if (len >= (int)sizeof full) len = (int)sizeof full - 1;
    /* A long one keeps its start (scheme, host) and end (the file's name): the
     * messages that quote it must still have room for what follows it (the
     * HTTP status or curl's error, the rank) in every buffer on the way. */
    if (len > URL_REDACT_MAX) snprintf(out, n, "%.160s...%s", full, full + len - (URL_REDACT_MAX - 163));
    else snprintf(out, n, "%s", full);
  } else { /* credentials could sit anywhere in it: its scheme alone */
    size_t lead = strspn(url, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+.-");
    if (lead > 0 && lead < 32 && url[lead] == ':')
      snprintf(out, n, "%.*s:... (not shown: not a URL)", (int)lead, url);
    else
      snprintf(out, n, "... (not shown: not a URL)");
  }
  curl_free(scheme);
  curl_free(host);
  curl_free(port);
  curl_free(path);
  curl_url_cleanup(u);
  return out;
}

static void fail(xfer_t *x, error_kind_t kind, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void fail(xfer_t *x, error_kind_t kind, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(x->why, sizeof x->why, fmt, ap);
  va_end(ap);
  x->stop = STOP_FAIL;
  x->fail_kind = kind;
}

/* "bytes a-b/total" (*b_out, *a_out set) or "bytes * /total"; a total of "*"
 * is UINT64_MAX. A range that ends at or past its total ("bytes 0-9/5")
 * contradicts itself: false. */
static bool parse_content_range(const char *v, bool *has_range, uint64_t *a, uint64_t *b,
                                uint64_t *total) {
  if (strncasecmp(v, "bytes ", 6) != 0) return false;
  v += 6;
  char *end;
  *has_range = *v != '*';
  if (*has_range) {
    if (*v < '0' || *v > '9') return false;
    errno = 0;
    *a = strtoull(v, &end, 10);
    if (*end != '-' || end[1] < '0' || end[1] > '9') return false;
    *b = strtoull(end + 1, &end, 10);
    if (errno || *b < *a) return false;
    v = end;
  } else {
    v++;
  }
  if (*v++ != '/') return false;
  if (*v == '*') return *total = UINT64_MAX, v[1] == 0;
  if (*v < '0' || *v > '9') return false;
  errno = 0;
  *total = strtoull(v, &end, 10);
  return !errno && *end == 0 && !(*has_range && *total <= *b);
}

static const char *header(xfer_t *x, const char *name) {
  struct curl_header *h;
  return curl_easy_header(x->curl, name, 0, CURLH_HEADER, -1, &h) == CURLHE_OK ? h->value : NULL;
}

/* A 206's body of `body` bytes against its Content-Range: true where they
 * agree, else false and failed naming what the server did wrong. */
static bool body_matches_range(xfer_t *x, uint64_t body) {
  const char *cr = header(x, "Content-Range");
  bool has;
  uint64_t a = 0, b = 0, total;
  char what[64] = "an empty body";
  if (body) snprintf(what, sizeof what, "a body of %" PRIu64 " bytes", body);
  if (!cr || !parse_content_range(cr, &has, &a, &b, &total) || !has) {
    fail(x, ERR_UNAVAILABLE, "HTTP 206 with %s and without a valid Content-Range (\"%.64s\")", what,
         cr ? cr : "");
    return false;
  }
  if (b - a + 1 == body) return true;
  fail(x, ERR_UNAVAILABLE, "HTTP 206 with %s, but its Content-Range \"%.64s\" says %" PRIu64
       " bytes: the server's answer contradicts itself", what, cr, b - a + 1);
  return false;
}

/* A 206's range a-b against the one asked, first-last: it must start at the
 * first byte asked and end no later than the last (a shorter one is "fewer
 * bytes than asked" once its body is in). Else false and failed, quoting
 * what the server said: another range's bytes, or its total, are not ours. */
static bool range_is_asked(xfer_t *x, uint64_t first, uint64_t last, uint64_t a, uint64_t b,
                           const char *cr) {
  if (a == first && b <= last) return true;
  fail(x, ERR_UNAVAILABLE,
       "asked bytes %" PRIu64 "-%" PRIu64 ", the server answered bytes %" PRIu64 "-%" PRIu64
       " (HTTP 206, Content-Range \"%.64s\")",
       first, last, a, b, cr);
  return false;
}

static void printable(char *v) {
  for (; *v; v++)
    if (*v < 0x20 || *v > 0x7e) *v = '?';
}

/* "W/\"x\"" and "\"x\"" are one tag to a weak comparison (RFC 9110 8.8.3.2). */
static const char *opaque_tag(const char *etag) {
  return strncmp(etag, "W/", 2) == 0 ? etag + 2 : etag;
}

/* Whether the answer, where it names its version, names the one expected: a
 * server that ignored If-Match or If-Unmodified-Since serves another version
 * with a 200 or 206 and says so in its headers. */
static bool answer_is_expected(xfer_t *x) {
  char now[URL_VERSION_MAX] = "";
  if (strncmp(x->expect, "etag ", 5) == 0) {
    const char *etag = header(x, "ETag");
    if (!etag || !*etag) return true;
    snprintf(now, sizeof now, "etag %s", etag);
    printable(now);
    if (strcmp(opaque_tag(now + 5), opaque_tag(x->expect + 5)) == 0) return true;
  } else {
    curl_off_t t = -1;
    if (curl_easy_getinfo(x->curl, CURLINFO_FILETIME_T, &t) || t < 0) return true;
    snprintf(now, sizeof now, "mtime %lld", (long long)t);
    if (strcmp(now, x->expect) == 0) return true;
  }
  fail(x, ERR_BAD_ARGUMENT, "the resource changed during the load (it was %.100s, now %.100s); "
       "load it again", x->expect, now);
  return false;
}

/* Whether the resource's size an answer gives (UINT64_MAX: none) is the one
 * the caller checked, where it gave one: a file that grew or shrank since
 * is another version, validators or not. */
static bool size_is_expected(xfer_t *x, uint64_t total) {
  if (!x->expect_size || total == UINT64_MAX || total == x->expect_size) return true;
  fail(x, ERR_BAD_ARGUMENT, "the resource changed during the load (it was %" PRIu64 " bytes, "
       "now %" PRIu64 "); load it again", x->expect_size, total);
  return false;
}

/* The first body bytes of an answer: is it the answer asked for? */
static bool body_start(xfer_t *x) {
  curl_easy_getinfo(x->curl, CURLINFO_RESPONSE_CODE, &x->status);
  if (x->status >= 300) {
    x->stop = STOP_STATUS; /* its body is an error page: not ours */
    return false;
  }
  if (x->expect && x->status && !answer_is_expected(x)) return false;
  const char *cr = x->status ? header(x, "Content-Range") : NULL;
  bool has;
  uint64_t a = 0, b = 0, total;
  if (x->mode == MODE_PROBE) {
    curl_off_t len = -1;
    if (x->status == 206 && (!cr || !parse_content_range(cr, &has, &a, &b, &total) || !has)) {
      fail(x, ERR_UNAVAILABLE, "HTTP 206 without a valid Content-Range (\"%.64s\")", cr ? cr : "");
      return false;
    }
    /* Byte 0 was asked: another range's total may be another resource's. */
    if (x->status == 206 && !range_is_asked(x, 0, 0, a, b, cr)) return false;
    if (x->status == 206 &&
        !curl_easy_getinfo(x->curl, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &len) && len >= 0 &&
        !body_matches_range(x, (uint64_t)len))
      return false;
    if (x->status == 206) x->total = total;
    else if (x->status == 200 && !curl_easy_getinfo(x->curl, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &len) && len >= 0)
      x->total = (uint64_t)len;
    x->stop = STOP_DONE; /* the length is all a probe wants */
    return false;
  }
  if (x->mode != MODE_RANGE || x->status == 0) return true; /* file://: curl applied the range */
  if (x->status == 206) {
    if (!cr || !parse_content_range(cr, &has, &a, &b, &total) || !has) {
      fail(x, ERR_UNAVAILABLE, "HTTP 206 without a valid Content-Range (\"%.64s\")", cr ? cr : "");
      return false;
    }
    if (!range_is_asked(x, x->offset, x->offset + x->length - 1, a, b, cr)) return false;
    x->total = total;
    return size_is_expected(x, total);
  }
  /* Another 2xx: not the bytes asked, and nothing below would stop its body. */
  if (x->status != 200) {
    fail(x, ERR_UNAVAILABLE, "unexpected HTTP %ld", x->status);
    return false;
  }
  /* 200: the whole body; ours starts at offset. */
  if (x->offset + x->length > x->max_bytes) {
    fail(x, ERR_BAD_ARGUMENT,
         "the server ignored the Range request (HTTP 200 with the whole body); reading up to "
         "byte %" PRIu64 " would pass the %" PRIu64 "-byte limit",
         x->offset + x->length, x->max_bytes);
    return false;
  }
  curl_off_t len = -1;
  if (!curl_easy_getinfo(x->curl, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &len) && len >= 0 &&
      !size_is_expected(x, (uint64_t)len))
    return false;
  x->skip = x->offset;
  return true;
}

static size_t on_body(char *p, size_t size, size_t nmemb, void *arg) {
  xfer_t *x = arg;
  size_t n = size * nmemb, all = n;
  if (!x->started) {
    x->started = true;
    if (!body_start(x)) return 0;
  }
  x->seen += n;
  uint64_t drop = n < x->skip ? n : x->skip;
  x->skip -= drop, x->skipped += drop, p += drop, n -= (size_t)drop;
  uint64_t room = x->length - x->got;
  if (n > room) {
    if (x->mode == MODE_ALL) {
      fail(x, ERR_BAD_ARGUMENT, "the body is longer than the %" PRIu64 " bytes allowed", x->length);
      return 0;
    }
    if (x->status == 206) {
      fail(x, ERR_UNAVAILABLE, "the server sent more than the %" PRIu64 " bytes of its range",
           x->length);
      return 0;
    }
    n = (size_t)room;
  }
  if (x->sink) {
    meshd_error_t se = {0};
    if (n && x->sink(x->sink_arg, x->got, p, n, &se)) {
      fail(x, se.kind ? se.kind : ERR_REMOTE_FAILURE, "%s", se.msg);
      return 0;
    }
  } else {
    memcpy(x->buf + x->got, p, n);
  }
  x->got += n;
  if (x->mode == MODE_RANGE && x->got == x->length && x->status == 200) {
    x->stop = STOP_DONE; /* a Range-ignoring server's rest is not needed */
    return 0;
  }
  return all;
}

static curl_socket_t on_open_socket(void *arg, curlsocktype purpose, struct curl_sockaddr *a) {
  xfer_t *x = arg;
  if (!url_allow_address(x->allow, &a->addr, x->refused, sizeof x->refused))
    return CURL_SOCKET_BAD;
  return socket(a->family, a->socktype | SOCK_CLOEXEC, a->protocol);
}

static const char *status_text(long s) {
  switch (s) {
  case 400: return " (bad request)";
  case 401: return " (unauthorized)";
  case 403: return " (forbidden)";
  case 404: return " (not found)";
  case 410: return " (gone)";
  case 412: return " (precondition failed)";
  case 416: return " (range not satisfiable)";
  case 429: return " (too many requests)";
  case 500: return " (internal server error)";
  case 502: return " (bad gateway)";
  case 503: return " (service unavailable)";
  case 504: return " (gateway timeout)";
  default: return "";
  }
}

/* curl's own message, unless it quotes a secret part of the URL. */
static const char *curl_text(xfer_t *x, CURLcode cc, const char *url) {
  const char *q = strpbrk(url, "?#"), *at = strchr(url, '@');
  if (!x->errbuf[0]) return curl_easy_strerror(cc);
  if ((q && q[1] && strstr(x->errbuf, q + 1)) || (at && strchr(x->errbuf, '@')))
    return curl_easy_strerror(cc);
  return x->errbuf;
}

/* The resource's validator, as url_fetch_size_version gives it: its ETag, or
 * its modification time (Last-Modified; a file's mtime); "" when neither is
 * known. Bytes outside printable ASCII become '?'. */
static void take_version(xfer_t *x) {
  const char *etag = header(x, "ETag");
  curl_off_t t = -1;
  x->version[0] = '\0';
  /* A tag that does not fit whole, or holds bytes outside printable ASCII,
   * could not be sent back as it came (If-Match: a cut or '?'-mended tag
   * matches nothing, a 412 on every range): no validator, the mtime if any. */
  if (etag && *etag) {
    snprintf(x->version, sizeof x->version, "etag %s", etag);
    if (strlen(etag) + 5 >= sizeof x->version || !url_version_ok(x->version)) x->version[0] = '\0';
  }
  if (!x->version[0] && !curl_easy_getinfo(x->curl, CURLINFO_FILETIME_T, &t) && t >= 0)
    snprintf(x->version, sizeof x->version, "mtime %lld", (long long)t);
  printable(x->version);
}

static outcome_t http_outcome(xfer_t *x, bool http) {
  if (!x->status) curl_easy_getinfo(x->curl, CURLINFO_RESPONSE_CODE, &x->status);
  long s = x->status;
  if (!http) s = 200;
  if (s == 301 || s == 302 || s == 303 || s == 307 || s == 308) return OUT_REDIRECT;
  if (x->mode == MODE_PROBE && s == 416) { /* an empty resource: "bytes * /0" */
    const char *cr = header(x, "Content-Range");
    bool has;
    uint64_t a, b, total;
    if (cr && parse_content_range(cr, &has, &a, &b, &total) && !has) {
      take_version(x);
      return x->total = total, OUT_OK;
    }
  }
  if (s >= 500) {
    fail(x, ERR_UNAVAILABLE, "HTTP %ld%s", s, status_text(s));
    return OUT_RETRY;
  }
  if (s == 412 && x->expect) {
    fail(x, ERR_BAD_ARGUMENT, "the resource changed during the load (HTTP 412 Precondition "
         "Failed: it is no longer %.150s); load it again", x->expect);
    return OUT_FAIL;
  }
  if (s >= 400) {
    x->http_4xx = true;
    fail(x, s == 401 || s == 403 ? ERR_PERMISSION_DENIED : ERR_BAD_ARGUMENT, "HTTP %ld%s", s,
         status_text(s));
    if (s == 416) {
      const char *cr = header(x, "Content-Range");
      size_t l = strlen(x->why);
      snprintf(x->why + l, sizeof x->why - l, ": bytes %" PRIu64 "-%" PRIu64 " are past the end%s%s",
               x->offset, x->offset + x->length - 1, cr ? " (Content-Range: " : "",
               cr ? cr : "");
      if (cr) strncat(x->why, ")", sizeof x->why - strlen(x->why) - 1);
    }
    return OUT_FAIL;
  }
  if (s != 200 && s != 206 && !(x->mode == MODE_HEAD && s == 204)) {
    fail(x, ERR_UNAVAILABLE, "unexpected HTTP %ld", s);
    return OUT_FAIL;
  }
  /* A 206 with no body never reached body_start: nor its checks. */
  if (x->mode == MODE_PROBE && s == 206 && !x->started && !body_matches_range(x, 0))
    return OUT_FAIL;
  if (x->mode == MODE_RANGE && s == 206 && x->got < x->length && !body_matches_range(x, x->got))
    return OUT_FAIL;
  if (x->mode == MODE_RANGE && x->got < x->length) {
    char tot[48] = "";
    if (x->total != UINT64_MAX) snprintf(tot, sizeof tot, " of the %" PRIu64 "-byte resource", x->total);
    fail(x, ERR_BAD_ARGUMENT,
         "got %" PRIu64 " of the %" PRIu64 " bytes asked (bytes %" PRIu64 "-%" PRIu64 "%s): the "
         "resource is shorter",
         x->got, x->length, x->offset, x->offset + x->length - 1, tot);
    return OUT_FAIL;
  }
  if (x->mode == MODE_HEAD) {
    curl_off_t len = -1;
    if (!curl_easy_getinfo(x->curl, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &len) && len >= 0)
      x->total = (uint64_t)len;
  }
  if (x->mode == MODE_HEAD || x->mode == MODE_PROBE) take_version(x);
  return OUT_OK;
}

static outcome_t outcome(xfer_t *x, CURLcode cc, const char *url, bool http) {
  /* Only when no address was left to try: a name with a refused address and
   * an allowed one is fetched from the allowed one. */
  if (x->refused[0] && cc == CURLE_COULDNT_CONNECT) {
    fail(x, ERR_PERMISSION_DENIED, "refused before connecting: %s", x->refused);
    return OUT_FAIL;
  }
  if (cc == CURLE_WRITE_ERROR && x->stop == STOP_DONE) cc = CURLE_OK;
  if (cc == CURLE_WRITE_ERROR && x->stop == STOP_FAIL) return OUT_FAIL;
  if (cc == CURLE_OK || x->stop == STOP_STATUS) return http_outcome(x, http);
  const char *text = curl_text(x, cc, url);
  switch (cc) {
  case CURLE_OPERATION_TIMEDOUT:
    fail(x, ERR_DEADLINE_EXCEEDED, "timed out (curl: %s)", text);
    return OUT_FAIL;
  case CURLE_ABORTED_BY_CALLBACK:
    fail(x, ERR_NO_SESSION, "stopped by its caller after %" PRIu64 " bytes", x->seen);
    return OUT_FAIL;
  case CURLE_COULDNT_CONNECT:
    fail(x, ERR_UNAVAILABLE, "could not connect (curl: %s)", text);
    return OUT_FAIL;
  case CURLE_COULDNT_RESOLVE_HOST:
    fail(x, ERR_UNAVAILABLE, "could not resolve the host (curl: %s)", text);
    return OUT_FAIL;
  case CURLE_PARTIAL_FILE:
    fail(x, ERR_UNAVAILABLE, "the body was cut short after %" PRIu64 " bytes (curl: %s)", x->seen,
         text);
    return OUT_RETRY;
  case CURLE_RECV_ERROR:
  case CURLE_SEND_ERROR:
  case CURLE_GOT_NOTHING:
  case CURLE_HTTP2:
  case CURLE_HTTP2_STREAM:
    fail(x, ERR_UNAVAILABLE, "the connection failed (curl: %s)", text);
    return OUT_RETRY;
  case CURLE_FILESIZE_EXCEEDED:
    fail(x, ERR_BAD_ARGUMENT, "the body is longer than the %" PRIu64 " bytes allowed", x->length);
    return OUT_FAIL;
  case CURLE_FILE_COULDNT_READ_FILE:
    fail(x, ERR_BAD_ARGUMENT, "cannot read the file (curl: %s)", text);
    return OUT_FAIL;
  case CURLE_BAD_DOWNLOAD_RESUME:
  case CURLE_RANGE_ERROR:
    fail(x, ERR_BAD_ARGUMENT, "bytes %" PRIu64 "-%" PRIu64 " are past the end (curl: %s)",
         x->offset, x->offset + x->length - 1, text);
    return OUT_FAIL;
  default:
    fail(x, ERR_UNAVAILABLE, "curl: %s", text);
    return OUT_FAIL;
  }
}

static bool caller_stopped(const xfer_t *x) {
  return x->caller_stop && x->caller_stop(x->caller_stop_arg);
}

/* curl's progress callback: about once a second even while nothing flows. */
static int on_progress(void *arg, curl_off_t dltotal, curl_off_t dlnow, curl_off_t ultotal,
                       curl_off_t ulnow) {
  (void)dltotal, (void)dlnow, (void)ultotal, (void)ulnow;
  return caller_stopped(arg) ? 1 : 0; /* 1: CURLE_ABORTED_BY_CALLBACK */
}

static void set_hop_options(xfer_t *x, const char *url, const char *scheme,
                            const url_fetch_opts_t *o) {
  CURL *c = x->curl;
  char range[48];
  curl_easy_reset(c);
  curl_easy_setopt(c, CURLOPT_URL, url);
  curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, scheme);
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_PROXY, ""); /* the address checked is the one connected to */
  curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 0L);
  curl_easy_setopt(c, CURLOPT_OPENSOCKETFUNCTION, on_open_socket);
  curl_easy_setopt(c, CURLOPT_OPENSOCKETDATA, x);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(c, CURLOPT_BUFFERSIZE, 512L * 1024); /* fewer callbacks for bulk bytes */
  curl_easy_setopt(c, CURLOPT_WRITEDATA, x);
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, x->errbuf);
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, o->connect_timeout_ms);
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, o->timeout_ms);
  /* A server that stops sending mid-body, or drips, fails the attempt (a
   * timeout) even without timeout_ms, instead of holding the caller for ever. */
  curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, o->min_speed);
  curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, o->slow_s);
  curl_easy_setopt(c, CURLOPT_USERAGENT, "meshd-agent/" MESHD_VERSION);
  if (x->share && strcmp(scheme, "file") != 0) curl_easy_setopt(c, CURLOPT_SHARE, x->share);
  if (x->mode == MODE_RANGE || x->mode == MODE_PROBE) {
    uint64_t first = x->mode == MODE_RANGE ? x->offset : 0;
    uint64_t last = x->mode == MODE_RANGE ? x->offset + x->length - 1 : 0;
    snprintf(range, sizeof range, "%" PRIu64 "-%" PRIu64, first, last);
    curl_easy_setopt(c, CURLOPT_RANGE, range); /* curl copies it */
  }
  if (x->mode == MODE_HEAD) curl_easy_setopt(c, CURLOPT_NOBODY, 1L);
  if (x->mode == MODE_HEAD || x->mode == MODE_PROBE || x->expect)
    curl_easy_setopt(c, CURLOPT_FILETIME, 1L);
  if (x->headers) curl_easy_setopt(c, CURLOPT_HTTPHEADER, x->headers);
  if (x->mode == MODE_ALL) curl_easy_setopt(c, CURLOPT_MAXFILESIZE_LARGE, (curl_off_t)x->length);
  if (x->caller_stop) {
    curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, on_progress);
    curl_easy_setopt(c, CURLOPT_XFERINFODATA, x);
  }
}

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) && errno == EINTR) {
  }
}

/* The wait before a retry, looking at the caller's stop every 50 ms: false
 * once it says stop (a session closed during a 5 s backoff ends its load
 * now, not after it). */
static bool backoff_wait(const xfer_t *x, long ms) {
  while (ms > 0 && !caller_stopped(x)) {
    long step = ms < 50 ? ms : 50;
    sleep_ms(step);
    ms -= step;
  }
  return !caller_stopped(x);
}

static url_fetch_opts_t with_defaults(const url_fetch_opts_t *in) {
  url_fetch_opts_t o = in ? *in : (url_fetch_opts_t){0};
  if (o.connect_timeout_ms <= 0) o.connect_timeout_ms = 10000;
  if (o.timeout_ms < 0) o.timeout_ms = 0;
  if (o.min_speed <= 0) o.min_speed = URL_FETCH_MIN_SPEED;
  if (o.slow_s <= 0) o.slow_s = URL_FETCH_SLOW_S;
  if (o.max_retries < 0) o.max_retries = 0;
  if (o.backoff_ms <= 0) o.backoff_ms = 100;
  if (o.backoff_max_ms <= 0) o.backoff_max_ms = 5000;
  if (!o.max_bytes) o.max_bytes = URL_FETCH_MAX_BYTES;
  if (!o.max_redirects) o.max_redirects = 5;
  if (o.max_redirects < 0) o.max_redirects = 0;
  return o;
}

/* "Sun, 06 Nov 1994 08:49:37 GMT" (RFC 9110 5.6.7), whatever the locale;
 * false past year 9999. */
static bool http_date(long long secs, char *out, size_t n) {
  static const char days[][4] = {"Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"};
  static const char months[][4] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun",
                                   "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
  time_t t = (time_t)secs;
  struct tm tm;
  if (secs > 253402300799LL || !gmtime_r(&t, &tm)) return false;
  snprintf(out, n, "%s, %02d %s %04d %02d:%02d:%02d GMT", days[tm.tm_wday], tm.tm_mday,
           months[tm.tm_mon], tm.tm_year + 1900, tm.tm_hour, tm.tm_min, tm.tm_sec);
  return true;
}

/* x->expect checked, and its precondition header into x->headers. */
static int expect_headers(xfer_t *x, const char *shown, meshd_error_t *e) {
  const char *v = x->expect;
  char line[URL_VERSION_MAX + 32] = "", *end;
  const char *since = "If-Unmodified-Since: ";
  size_t k = strlen(since);
  long long secs = 0;
  if (strncmp(v, "etag ", 5) == 0 && v[5] && url_version_ok(v)) {
    if (strncmp(v + 5, "W/", 2) != 0) /* If-Match compares strongly: a weak tag never matches */
      snprintf(line, sizeof line, "If-Match: %s", v + 5);
  } else if (strncmp(v, "mtime ", 6) == 0 && v[6] >= '0' && v[6] <= '9' &&
             (errno = 0, secs = strtoll(v + 6, &end, 10), !errno && !*end) &&
             http_date(secs, line + k, sizeof line - k)) {
    memcpy(line, since, k);
  } else {
    return error_set(e, ERR_BAD_ARGUMENT, "fetch %s: expect_version '%.200s' is neither \"etag "
                     "TAG\" nor \"mtime SECONDS\" (what url_fetch_size_version gives)", shown, v);
  }
  if (line[0] && !(x->headers = curl_slist_append(NULL, line)))
    return error_set(e, ERR_QUOTA, "fetch %s: out of memory", shown);
  return 0;
}

/* file://: the file read must still be the version expected once its bytes
 * are in (a rewrite in place, before or during the read, moves its mtime).
 * Without file roots nothing was opened here: its mtime when curl opened it. */
static bool file_is_expected(xfer_t *x, int fd) {
  struct stat st;
  curl_off_t t = -1;
  char now[64] = "unknown";
  if (fd >= 0 && fstat(fd, &st) == 0) t = st.st_mtime;
  else if (fd < 0) curl_easy_getinfo(x->curl, CURLINFO_FILETIME_T, &t);
  if (t >= 0) snprintf(now, sizeof now, "mtime %lld", (long long)t);
  if (strcmp(now, x->expect) == 0) return true;
  fail(x, ERR_BAD_ARGUMENT, "the resource changed during the load (it was %.100s, now %s); load "
       "it again", x->expect, now);
  return false;
}

/* Runs x's request on url: allow-list checks, redirects, retries. */
static int run(xfer_t *x, const char *url0, const url_fetch_opts_t *o, url_fetch_info_t *info,
               meshd_error_t *e) {
  char shown[URL_SHOWN], asked[URL_SHOWN], target[URL_SHOWN], scheme[16];
  char *url = strdup(url0);
  int rc = -1, attempt = 0, hop = 0, file_fd = -1;
  url_redact(url0, shown, sizeof shown);
  x->shown = shown;
  x->allow = o->allow;
  x->caller_stop = o->stop;
  x->caller_stop_arg = o->stop_arg;
  pthread_once(&curl_once, curl_init);
  if (!url) return error_set(e, ERR_QUOTA, "fetch %s: out of memory", shown);
  if (curl_init_rc != CURLE_OK || !(x->curl = curl_easy_init())) {
    error_set(e, ERR_UNAVAILABLE, "fetch %s: libcurl did not start", shown);
    goto out;
  }
  x->share = share_take(o->share, o->allow);
  if (x->expect && !*x->expect) x->expect = NULL;
  if (x->expect && expect_headers(x, shown, e)) goto out;
  for (;; hop++) {
    /* A redirect's file:// path as text only: what a server redirects to
     * must not tell it which files exist here (refused just below anyway). */
    if (url_allow_check_url(o->allow, url, shown, hop == 0 ? &file_fd : NULL, scheme,
                            sizeof scheme, e))
      goto out;
    if (hop && strcmp(scheme, "http") != 0 && strcmp(scheme, "https") != 0) {
      error_set(e, ERR_PERMISSION_DENIED, "fetch %s: a redirect to scheme %s is not followed",
                shown, scheme);
      goto out;
    }
    bool http = strcmp(scheme, "file") != 0;
    /* A file checked open is read through that descriptor (curl opens the
     * magic link: the same file, whatever its path names by then). */
    char fd_url[48];
    if (file_fd >= 0) snprintf(fd_url, sizeof fd_url, "file:///proc/self/fd/%d", file_fd);
    set_hop_options(x, file_fd >= 0 ? fd_url : url, scheme, o);
    long backoff = o->backoff_ms;
    outcome_t out;
    for (attempt = 1;; attempt++) {
      x->started = false, x->status = 0, x->stop = STOP_NONE, x->http_4xx = false;
      x->skip = x->got = x->skipped = x->seen = 0;
      x->total = UINT64_MAX, x->refused[0] = x->why[0] = x->errbuf[0] = 0;
      out = outcome(x, curl_easy_perform(x->curl), url, http);
      if (out != OUT_RETRY || attempt > o->max_retries) break;
      if (!backoff_wait(x, backoff)) {
        char was[sizeof x->why];
        snprintf(was, sizeof was, "%s", x->why);
        fail(x, ERR_NO_SESSION, "stopped by its caller before a retry (it failed: %s)", was);
        out = OUT_FAIL;
        break;
      }
      backoff = backoff > o->backoff_max_ms / 2 ? o->backoff_max_ms : backoff * 2;
    }
    if (out == OUT_OK && x->expect && !http && !file_is_expected(x, file_fd))
      out = OUT_FAIL;
    if (out == OUT_OK) {
      rc = 0;
      break;
    }
    if (out != OUT_REDIRECT) {
      char tries[32] = "";
      if (attempt > 1) snprintf(tries, sizeof tries, " (%d attempts)", attempt);
      error_set(e, x->fail_kind, "fetch %s: %s%s", shown, x->why, tries);
      goto out;
    }
    char *next = NULL;
    curl_easy_getinfo(x->curl, CURLINFO_REDIRECT_URL, &next);
    if (!next) {
      error_set(e, ERR_UNAVAILABLE, "fetch %s: HTTP %ld redirect without a Location", shown,
                x->status);
      goto out;
    }
    if (hop >= o->max_redirects) {
      error_set(e, ERR_UNAVAILABLE, "fetch %s: more than %d redirects", shown, o->max_redirects);
      goto out;
    }
    free(url);
    if (!(url = strdup(next))) {
      error_set(e, ERR_QUOTA, "fetch %s: out of memory", shown);
      goto out;
    }
    /* The URL asked and where it led: a user who asked for one must see it. */
    url_redact(url0, asked, sizeof asked);
    url_redact(url, target, sizeof target);
    size_t tl = strlen(target);
    if (tl > 120 && strlen(asked) + tl > URL_REDACT_MAX + 60) /* room for what follows */
      snprintf(shown, sizeof shown, "%.240s (redirected to %.60s...%s)", asked, target,
               target + tl - 60);
    else
      snprintf(shown, sizeof shown, "%.240s (redirected to %.240s)", asked, target);
  }
out:
  if (info) {
    info->attempts = attempt;
    info->redirects = hop;
    info->status = x->status;
    info->bytes = x->got;
    info->skipped = x->skipped;
  }
  if (x->curl) curl_easy_cleanup(x->curl); /* its connection stays in the share, if any */
  x->curl = NULL;
  if (x->share) atomic_flag_clear(&o->share->busy); /* after the handle left it */
  x->share = NULL;
  curl_slist_free_all(x->headers);
  x->headers = NULL;
  if (file_fd >= 0) close(file_fd);
  free(url);
  return rc;
}

static int fetch_range(const char *url, uint64_t offset, uint64_t length, void *buf,
                       url_sink_fn sink, void *sink_arg, const url_fetch_opts_t *opts,
                       url_fetch_info_t *info, meshd_error_t *e) {
  url_fetch_opts_t o = with_defaults(opts);
  char shown[URL_SHOWN];
  if (info) memset(info, 0, sizeof *info);
  if (length > o.max_bytes)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "fetch %s: %" PRIu64 " bytes is more than one fetch may read (%" PRIu64 ")",
                     url_redact(url, shown, sizeof shown), length, o.max_bytes);
  if (offset > UINT64_MAX - length || offset + length > (uint64_t)INT64_MAX)
    return error_set(e, ERR_BAD_ARGUMENT, "fetch %s: range %" PRIu64 "+%" PRIu64 " overflows",
                     url_redact(url, shown, sizeof shown), offset, length);
  if (!length) {
    char scheme[16];
    int fd = -1, rc = url_allow_check_url(o.allow, url, url_redact(url, shown, sizeof shown), &fd,
                                          scheme, sizeof scheme, e);
    if (fd >= 0) close(fd);
    return rc;
  }
  xfer_t x = {.mode = MODE_RANGE, .offset = offset, .length = length, .buf = buf,
              .sink = sink, .sink_arg = sink_arg, .max_bytes = o.max_bytes,
              .expect = o.expect_version, .expect_size = o.expect_size};
  return run(&x, url, &o, info, e);
}

int url_fetch_range(const char *url, uint64_t offset, uint64_t length, void *buf,
                    const url_fetch_opts_t *o, url_fetch_info_t *info, meshd_error_t *e) {
  return fetch_range(url, offset, length, buf, NULL, NULL, o, info, e);
}

int url_fetch_range_to(const char *url, uint64_t offset, uint64_t length, url_sink_fn sink,
                       void *arg, const url_fetch_opts_t *o, url_fetch_info_t *info,
                       meshd_error_t *e) {
  return fetch_range(url, offset, length, NULL, sink, arg, o, info, e);
}

int url_fetch_all(const char *url, void *buf, size_t cap, size_t *got, const url_fetch_opts_t *opts,
                  url_fetch_info_t *info, meshd_error_t *e) {
  url_fetch_opts_t o = with_defaults(opts);
  if (info) memset(info, 0, sizeof *info);
  xfer_t x = {.mode = MODE_ALL, .length = cap < o.max_bytes ? cap : o.max_bytes, .buf = buf,
              .max_bytes = o.max_bytes, .expect = o.expect_version};
  *got = 0;
  int rc = run(&x, url, &o, info, e);
  if (!rc) *got = (size_t)x.got;
  return rc;
}

bool url_version_ok(const char *v) {
  size_t n = 0;
  for (; v[n]; n++)
    if (n + 1 >= URL_VERSION_MAX || v[n] < 0x20 || v[n] > 0x7e) return false;
  return true;
}

int url_fetch_size(const char *url, const url_fetch_opts_t *opts, uint64_t *size,
                   url_fetch_info_t *info, meshd_error_t *e) {
  return url_fetch_size_version(url, opts, size, NULL, 0, info, e);
}

int url_fetch_size_version(const char *url, const url_fetch_opts_t *opts, uint64_t *size,
                           char *version, size_t cap, url_fetch_info_t *info, meshd_error_t *e) {
  url_fetch_opts_t o = with_defaults(opts);
  if (info) memset(info, 0, sizeof *info);
  if (version && cap) version[0] = '\0';
  xfer_t x = {.mode = MODE_HEAD, .max_bytes = o.max_bytes};
  meshd_error_t head_err;
  int rc = run(&x, url, &o, info, &head_err);
  if (!rc && x.total != UINT64_MAX) {
    if (version && cap) snprintf(version, cap, "%s", x.version);
    return *size = x.total, 0;
  }
  /* Presigned URLs are signed for GET: their HEAD is refused (403). */
  if (rc && !x.http_4xx) {
    if (e) *e = head_err;
    return -1;
  }
  x = (xfer_t){.mode = MODE_PROBE, .max_bytes = o.max_bytes};
  if (run(&x, url, &o, info, e)) return -1;
  if (x.total == UINT64_MAX) {
    char shown[URL_SHOWN];
    return error_set(e, ERR_UNAVAILABLE,
                     "fetch %s: the server gives the length neither on HEAD (Content-Length) nor "
                     "on a range GET (Content-Range)",
                     url_redact(url, shown, sizeof shown));
  }
  *size = x.total;
  if (version && cap) snprintf(version, cap, "%s", x.version);
  return 0;
}

/* The kernel's boot id: one per running machine (containers on it share it),
 * read once. "" where /proc does not say. */
static char boot_id[64];
static pthread_once_t boot_once = PTHREAD_ONCE_INIT;
static void read_boot_id(void) {
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (!f) return;
  if (!fgets(boot_id, sizeof boot_id, f)) boot_id[0] = '\0';
  fclose(f);
  boot_id[strcspn(boot_id, "\r\n")] = '\0';
  printable(boot_id);
}

const char *url_file_identity(const char *url, char *out, size_t n) {
  if (!n) return out;
  out[0] = '\0';
  if (!url || strncasecmp(url, "file:", 5) != 0) return out;
  CURLU *u = curl_url();
  char *path = NULL;
  struct stat st;
  if (u && !curl_url_set(u, CURLUPART_URL, url, 0) &&
      !curl_url_get(u, CURLUPART_PATH, &path, CURLU_URLDECODE) && path && stat(path, &st) == 0) {
    pthread_once(&boot_once, read_boot_id);
    snprintf(out, n, "%s:%llu:%llu", boot_id, (unsigned long long)st.st_dev,
             (unsigned long long)st.st_ino);
  }
  curl_free(path);
  curl_url_cleanup(u);
  return out;
}

/* The "BOOT:DEV:" of identity id (n chars): its length, 0 where the boot id
 * is unknown ("" from a machine without /proc) or id is of another form. */
static size_t machine_and_device(const char *id, size_t n) {
  size_t last = n;
  while (last && id[last - 1] != ':') last--;
  const char *first = memchr(id, ':', n);
  if (!last || !first || first == id || (size_t)(first - id) + 1 >= last - 1) return 0;
  return last;
}

url_version_match_t url_version_match(const char *inspected, const char *mine,
                                      const char *identity) {
  if (!inspected || !*inspected) return URL_VERSION_SAME;
  const char *mark = identity ? strstr(inspected, URL_FILE_MARK) : NULL;
  size_t k = mark ? (size_t)(mark - inspected) : strlen(inspected);
  bool same = strlen(mine) == k && strncmp(inspected, mine, k) == 0;
  if (!mark) return same ? URL_VERSION_SAME : URL_VERSION_CHANGED;
  const char *id = mark + strlen(URL_FILE_MARK);
  size_t n = strcspn(id, " ");
  if (strlen(identity) == n && strncmp(id, identity, n) == 0)
    return same ? URL_VERSION_SAME : URL_VERSION_CHANGED;
  /* Another inode on the inspected machine's device: a copy there (cp -p,
   * rsync -t) keeps the mtime; a file renamed into place since has its own.
   * One of the same mtime is a COPY: its header is checked (its layout may
   * be another). */
  size_t m = machine_and_device(id, n);
  if (!same && m && machine_and_device(identity, strlen(identity)) == m &&
      strncmp(id, identity, m) == 0)
    return URL_VERSION_REPLACED;
  return URL_VERSION_COPY;
}
