/* The allow list of url_fetch.h (url_allow_t), as checks: of a URL before any
 * request, and of each address before curl connects to it. Internal to
 * url_fetch.c; its own file because it is the security boundary. */
#ifndef MESHD_URL_ALLOW_H
#define MESHD_URL_ALLOW_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/socket.h>

#include "url_fetch.h"

/* The URL's scheme and host against a (NULL: the defaults), a host written as
 * an address against the address rules, a file:// path against file_roots:
 * as text (no "." or ".." segment, under a root), and with file_fd (the
 * process that reads it: an agent) also opened, and the file opened checked
 * with its links resolved and as a regular file (a missing file is then
 * BAD_ARGUMENT "no such file"): *file_fd gets the descriptor to read, which
 * the caller closes, or -1 where nothing was opened (not a file:// URL, or no
 * file roots). *scheme gets the lowercase scheme ("https"). shown: the
 * redacted URL, for the messages. PERMISSION_DENIED or BAD_ARGUMENT
 * (malformed URL or list). */
int url_allow_check_url(const url_allow_t *a, const char *url, const char *shown, int *file_fd,
                        char *scheme, size_t scheme_cap, meshd_error_t *e);
/* Whether a connection to sa may be made; if not, why says so ("10.0.0.1 is a
 * private address (10.0.0.0/8)"). a's nets must have passed url_allow_check_url. */
bool url_allow_address(const url_allow_t *a, const struct sockaddr *sa, char *why, size_t n);

#endif
