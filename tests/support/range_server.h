/* tests/support/range_http_server.py as a child process, for the C tests that
 * fetch http:// URLs (url_fetch, the C client's loads). */
#ifndef MESHD_TEST_RANGE_SERVER_H
#define MESHD_TEST_RANGE_SERVER_H

#include <stddef.h>
#include <sys/types.h>

/* Starts $MESHD_SOURCE_DIR/tests/support/range_http_server.py (python3): its
 * port on 127.0.0.1, with *pid and *stdin_fd set (closing that fd ends it); or
 * -1 and why (MESHD_SOURCE_DIR unset, no pipe or fork, no port printed within
 * 10 s: a test fails, it does not hang). */
int range_server_start(pid_t *pid, int *stdin_fd, char *why, size_t why_len);

/* Ends it (SIGTERM, its stdin closed), and SIGKILL if it has not ended within 5 s. */
void range_server_stop(pid_t pid, int stdin_fd);

#endif
