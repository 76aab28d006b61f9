/* Internal to clients/c: the checks meshd_connect_with makes on its options
 * before it opens a channel (meshd.h, "Security"). */
#ifndef MESHD_CLIENT_CONN_H
#define MESHD_CLIENT_CONN_H

#include <stdbool.h>
#include <stddef.h>

/* Longest bearer token accepted (bytes). */
#define CONN_MAX_TOKEN 4096

/* True if every host `target` names is loopback (localhost, 127.0.0.0/8, ::1,
 * ::ffff:127.x) or it is a local socket ("unix:..."). Names other than
 * "localhost" are not loopback: they may resolve anywhere. */
bool conn_target_is_loopback(const char *target);

/* A token is 1..CONN_MAX_TOKEN visible ASCII characters (no spaces): what a
 * tokens file line holds and an HTTP/2 header carries. Returns 0, or -1 with a
 * message that names `what` and never quotes the token. */
int conn_check_token(const char *token, const char *what, char *err, size_t errlen);

/* Checks that `path` (named `what` in errors: "tls_ca_file") can be read and
 * starts a PEM block whose label holds `label` ("CERTIFICATE", "PRIVATE KEY").
 * Returns 0, or -1 with err. */
int conn_check_pem(const char *path, const char *label, const char *what, char *err,
                   size_t errlen);

/* url for a message (meshd_session_load's errors, meshctl load): "https://host/path",
 * without "user:password@", "?query" (presigned URLs carry their signature there)
 * or "#fragment"; the agents' rule (core/url url_redact). Truncated to n. */
const char *conn_redact_url(const char *url, char *out, size_t n);

#endif
