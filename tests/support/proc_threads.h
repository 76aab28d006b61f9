/* What /proc says about this process's threads, for tests that check which
 * threads exist (by the names meshd gives them). */
#ifndef MESHD_TEST_PROC_THREADS_H
#define MESHD_TEST_PROC_THREADS_H

/* Threads of this process named `name` (/proc/self/task/N/comm); -1 when
 * /proc cannot be read. */
int proc_threads_named(const char *name);

#endif
