#include "range_server.h"

#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

int range_server_start(pid_t *pid, int *stdin_fd, char *why, size_t why_len) {
  const char *src = getenv("MESHD_SOURCE_DIR");
  if (!src || !*src) {
    snprintf(why, why_len, "MESHD_SOURCE_DIR is not set (run through ctest)");
    return -1;
  }
  char script[1024];
  snprintf(script, sizeof script, "%s/tests/support/range_http_server.py", src);
  int in[2], out[2];
  if (pipe(in) != 0) {
    snprintf(why, why_len, "pipe failed");
    return -1;
  }
  if (pipe(out) != 0) {
    close(in[0]), close(in[1]);
    snprintf(why, why_len, "pipe failed");
    return -1;
  }
  *pid = fork();
  if (*pid < 0) {
    close(in[0]), close(in[1]), close(out[0]), close(out[1]);
    snprintf(why, why_len, "fork failed");
    return -1;
  }
  if (*pid == 0) {
    dup2(in[0], 0);
    dup2(out[1], 1);
    close(in[0]), close(in[1]), close(out[0]), close(out[1]);
    execl("/usr/bin/python3", "python3", script, (char *)NULL);
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  *stdin_fd = in[1];
  char line[32] = {0};
  size_t n = 0;
  struct pollfd pf = {out[0], POLLIN, 0};
  while (n < sizeof line - 1 && poll(&pf, 1, 10000) == 1 && read(out[0], line + n, 1) == 1 &&
         line[n] != '\n')
    n++;
  close(out[0]);
  int port = atoi(line);
  if (port <= 0) {
    snprintf(why, why_len, "the range server did not print its port (%s)", script);
    range_server_stop(*pid, *stdin_fd);
    return -1;
  }
  return port;
}

void range_server_stop(pid_t pid, int stdin_fd) {
  close(stdin_fd);
  kill(pid, SIGTERM); /* at once: its stdin's end alone takes it ~20 ms, once per test */
  for (int i = 0; i < 500 && waitpid(pid, NULL, WNOHANG) == 0; i++)
    nanosleep(&(struct timespec){0, 10 * 1000000L}, NULL);
  if (kill(pid, SIGKILL) == 0)
    waitpid(pid, NULL, 0);
}
