/* Bytes of a URL into a caller's buffer: a range [offset, offset + length) or
 * the whole body, over http, https or file, with libcurl's easy API. For
 * tensors the agents load from URLs (tensor_file.h says which bytes).
 *
 *   url_allow_t allow = {.schemes = (const char *[]){"https"}, .n_schemes = 1};
 *   url_fetch_opts_t o = {.allow = &allow, .timeout_ms = 60000, .max_retries = 3};
 *   uint64_t size;  meshd_error_t e;
 *   if (url_fetch_size(url, &o, &size, NULL, &e) ||
 *       url_fetch_range(url, off, len, buf, &o, NULL, &e)) reject(&e);
 *
 * What a URL may reach (url_allow_t): its scheme must be allowed, its host must
 * match a pattern when patterns are given, and every address curl connects to
 * (checked in the socket-open callback, after DNS, so a name that resolves to a
 * private address now and a public one before is still refused) must be public
 * or loopback unless allowed. Redirects are followed by this module, each hop
 * checked the same way. Environment proxies are ignored: the address checked is
 * the one connected to.
 *
 * Retries: a 5xx status, a reset or closed connection, or a body cut short
 * are retried after backoff_ms, doubling up to backoff_max_ms, at most
 * max_retries times. Not retried: 4xx, timeouts, refused connections, refusals
 * by the allow list, answers of the wrong size, a resource that changed
 * (expect_version).
 *
 * Errors name the URL without credentials, query or fragment (url_redact):
 * BAD_ARGUMENT for a malformed URL, a 4xx other than 401/403, an answer of the
 * wrong size, more than max_bytes; PERMISSION_DENIED for the allow list and
 * 401/403; DEADLINE_EXCEEDED for a timeout; UNAVAILABLE for connection
 * failures and 5xx after the retries. Thread-safe: every call has its own
 * curl handle. Calls reuse no connection of another call unless they share a
 * url_share_t (below): the ranges of one load do. */
#ifndef MESHD_URL_FETCH_H
#define MESHD_URL_FETCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "error_kind.h"

/* What URLs may reach. Pointers are borrowed for the call. */
typedef struct url_allow {
  /* Schemes allowed ("http", "https", "file"); none given: http and https.
   * file:// reads the agent's own files, so it must be named. */
  const char *const *schemes;
  size_t n_schemes;
  /* Host patterns, matched without case: "example.com" that host only,
   * "*.example.com" its subdomains (not itself), "*" any. None given: any host. */
  const char *const *hosts;
  size_t n_hosts;
  /* Networks a connection may reach although not public, e.g. "10.1.0.0/16",
   * "fd00::/8". Loopback (127/8, ::1) is always allowed. */
  const char *const *nets;
  size_t n_nets;
  bool allow_private; /* any address: turns the address check off */
  /* Directories a file:// path must lie in after resolving symlinks and "..";
   * none given: any path. */
  const char *const *file_roots;
  size_t n_file_roots;
} url_allow_t;

/* Connections, DNS answers and TLS sessions kept from one call for the next:
 * the ranges of one load (one per row when it is split along a later dim)
 * then share a connection instead of opening one each, a TCP and a TLS
 * handshake per row.
 *
 *   url_share_t *s = url_share_new();      // NULL (no memory): calls run unshared
 *   url_fetch_opts_t o = {.allow = &allow, .share = s};
 *   for (...) url_fetch_range_to(url, off[i], len, sink, arg, &o, NULL, &e);
 *   url_share_free(s);                     // closes its connections
 *
 * Nothing it keeps skips a check. curl reuses a connection only for the same
 * scheme, host name and port, and the socket callback checked its address
 * when it was opened; a redirect to another host opens and checks its own.
 * A share is bound to the allow list of its first call (by content): a call
 * with another list runs without it, since its connections were checked
 * against the first list's addresses. The checks of the URL as text (scheme,
 * host patterns) run on every call and hop, shared or not. file:// does not
 * use it.
 *
 * A kept connection the server has closed meanwhile is not an error: curl
 * notices it before the request, or, when the close crosses the request and
 * not a byte of an answer came, sends the request again on a new connection
 * within the same attempt (neither a retry nor a body cut short).
 *
 * One call uses a share at a time: curl cannot share connections between
 * threads running at once, so it takes no lock callbacks. A call that finds
 * it in use by another thread runs without it (correct, only unshared). Calls
 * from different threads one after the other are fine. Owned by its creator;
 * url_share_free(NULL) does nothing; no call may be using it then. */
typedef struct url_share url_share_t;
url_share_t *url_share_new(void);
void url_share_free(url_share_t *s);

/* Zero fields take the defaults in brackets. */
typedef struct url_fetch_opts {
  const url_allow_t *allow; /* NULL: http and https to public or loopback addresses */
  long connect_timeout_ms;  /* per connection [10000] */
  long timeout_ms;          /* per attempt, the whole transfer [0: none] */
  /* An attempt that averages fewer than min_speed bytes/s over slow_s
   * seconds fails as a timeout (DEADLINE_EXCEEDED, not retried), whatever
   * timeout_ms says: a server that drips a byte now and then cannot hold a
   * load for ever. */
  long min_speed; /* bytes per second [URL_FETCH_MIN_SPEED] */
  long slow_s;    /* seconds [URL_FETCH_SLOW_S] */
  int max_retries;          /* after the first attempt [0]; negative: 0 */
  long backoff_ms;          /* before the first retry [100] */
  long backoff_max_ms;      /* the longest wait [5000] */
  uint64_t max_bytes;       /* most body bytes one call reads [URL_FETCH_MAX_BYTES] */
  int max_redirects;        /* [5]; negative: none followed */
  /* Polled while a transfer runs (at least once a second, stalled or not)
   * and every 50 ms of a retry's backoff; true ends the call at once with NO_SESSION ("stopped
   * by its caller"), not retried. NULL: never. */
  bool (*stop)(void *arg);
  void *stop_arg;
  /* The version the resource must still have, as url_fetch_size_version gave
   * it ("etag X", "mtime S"); NULL or "": any. For the ranges of one load, so
   * that a file saved again in place between two of them is not read half
   * old, half new. Range and whole-body GETs send If-Match: X (not for a weak
   * W/ tag, which If-Match never matches) or If-Unmodified-Since: S as an
   * HTTP date, on every hop and retry. A 412, or an answer whose own ETag or
   * Last-Modified is another one (a server that ignores preconditions;
   * checked before any byte reaches the caller), fails the call with
   * BAD_ARGUMENT, "the resource changed during the load", not retried. An
   * answer without the validator passes. file://: the file's mtime, read after
   * its bytes (without file_roots: when curl opened it), must still be S (a
   * rewrite within that same second is not seen). Another form is
   * BAD_ARGUMENT. Borrowed for the call. */
  const char *expect_version;
  /* The resource's size as the caller checked it (url_fetch_size); 0: not
   * known. A range answer (206) whose Content-Range total is another size, or
   * a whole body (200) of another Content-Length, fails the call with
   * BAD_ARGUMENT, "the resource changed during the load", not retried: a
   * server that names no validator still says its length. */
  uint64_t expect_size;
  /* Connections kept between calls (url_share_t above); NULL: each call its
   * own. Borrowed for the call. */
  url_share_t *share;
} url_fetch_opts_t;

#define URL_FETCH_MAX_BYTES ((uint64_t)1 << 34) /* 16 GiB */
#define URL_FETCH_MIN_SPEED 1024
#define URL_FETCH_SLOW_S 60

/* What a call did, for logs and tests. */
typedef struct url_fetch_info {
  int attempts;         /* requests sent for the final URL, retries included */
  int redirects;        /* hops followed */
  long status;          /* last HTTP status (0 for file://) */
  uint64_t bytes;       /* body bytes stored in the buffer */
  uint64_t skipped;     /* bytes read and dropped: a server that ignored Range */
} url_fetch_info_t;

/* Stores bytes [offset, offset + length) of url in buf (length bytes). A server
 * that ignores the Range (200 with the whole body) is read from the start,
 * dropping the bytes before offset, if offset + length <= max_bytes; else it is
 * refused. Fewer bytes than length (the resource is shorter) is an error.
 * info may be NULL. 0 or -1 with *e set. */
int url_fetch_range(const char *url, uint64_t offset, uint64_t length, void *buf,
                    const url_fetch_opts_t *o, url_fetch_info_t *info, meshd_error_t *e);
/* Where url_fetch_range_to puts the bytes: bytes [pos, pos + n) of the range,
 * in order. A retry starts again at pos 0 (the bytes come again). Nonzero
 * with *e set: the call stops and fails with e's kind and message. */
typedef int (*url_sink_fn)(void *arg, uint64_t pos, const void *bytes, size_t n, meshd_error_t *e);
/* url_fetch_range, handing the bytes to sink as they arrive instead of
 * storing them: for destinations that are not plain memory (a device). */
int url_fetch_range_to(const char *url, uint64_t offset, uint64_t length, url_sink_fn sink,
                       void *arg, const url_fetch_opts_t *o, url_fetch_info_t *info,
                       meshd_error_t *e);
/* The whole body into buf (cap bytes); *got its length. A body longer than cap
 * or max_bytes is an error. */
int url_fetch_all(const char *url, void *buf, size_t cap, size_t *got, const url_fetch_opts_t *o,
                  url_fetch_info_t *info, meshd_error_t *e);
/* The resource's length: HEAD and its Content-Length, or, where HEAD is refused
 * or gives none, a GET of byte 0 and the total in its Content-Range. */
int url_fetch_size(const char *url, const url_fetch_opts_t *o, uint64_t *size,
                   url_fetch_info_t *info, meshd_error_t *e);
/* The same, and the resource's validator into version (cap bytes): "etag X"
 * (its ETag, quotes and all), else "mtime S" (Last-Modified, or a file's
 * modification time, in Unix seconds), else "" (nothing says). Loads compare
 * it with what the inspection saw, so that a file rewritten at the same size
 * is not read half old, half new. Printable ASCII, under URL_VERSION_MAX. */
#define URL_VERSION_MAX 200
int url_fetch_size_version(const char *url, const url_fetch_opts_t *o, uint64_t *size,
                           char *version, size_t cap, url_fetch_info_t *info, meshd_error_t *e);
/* Whether v could be such a validator (printable ASCII, under URL_VERSION_MAX). */
bool url_version_ok(const char *v);
/* Which file a file:// URL names on this machine, into out (n bytes): "BOOT:DEV:INO"
 * (the kernel's boot_id, the file's device and inode), so that two agents can
 * tell whether they read the same file or each its own copy (a checkpoint
 * copied to every host's disk). "" for another scheme or a file not found;
 * returns out. Nothing here is a check: the fetch checks the path itself. */
const char *url_file_identity(const char *url, char *out, size_t n);

/* A file:// inspection's version: "mtime S" URL_FILE_MARK "BOOT:DEV:INO" (the
 * identity of the file it read), so that each rank can tell that file from its
 * own host's copy. */
#define URL_FILE_MARK " file "
/* What a rank's file is to the one inspected, for a load's version check. */
typedef enum {
  URL_VERSION_SAME,     /* the version inspected: read it */
  URL_VERSION_CHANGED,  /* the file inspected, at another version (saved again in place) */
  URL_VERSION_REPLACED, /* another file of another mtime on the inspected machine's device:
                           put in its place since (a rename), or a copy that kept no mtime */
  URL_VERSION_COPY,     /* another file (another host's, or one whose mtime was kept):
                           the caller checks that it agrees (size, header) */
} url_version_match_t;
/* inspected: the inspection's version (Load.version); mine: this rank's own
 * (url_fetch_size_version); identity: this rank's url_file_identity, NULL for
 * a URL that is not file://. An empty inspected version is SAME (nothing to
 * compare). Of a marked version only "BOOT:DEV:INO" is read: what a later
 * agent adds after it (" key value") is ignored, and a mark of another form
 * names another file (COPY). Without a boot id (no /proc), two files are never
 * known to share a machine: another inode is a COPY, as another host's. */
url_version_match_t url_version_match(const char *inspected, const char *mine,
                                      const char *identity);

/* url for a message: "https://host/path", without "user:password@", "?query"
 * (presigned URLs carry their signature there) or "#fragment". Truncated to n. */
const char *url_redact(const char *url, char *out, size_t n);

#endif
