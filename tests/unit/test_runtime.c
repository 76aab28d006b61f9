#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include "runtime.h"

/* A thread a library started before main blocked the signals (OpenBLAS starts
 * its workers when it loads): it blocks none. */
static void *foreign_thread(void *arg) {
  sigset_t none;
  sigemptyset(&none);
  pthread_sigmask(SIG_SETMASK, &none, NULL);
  int *stop = arg;
  while (!__atomic_load_n(stop, __ATOMIC_SEQ_CST)) usleep(1000);
  return NULL;
}

/* Regression: a SIGTERM sent to the process while the waiting thread is not in
 * runtime_wait_signal went to such a thread, whose default action ended the
 * process at once (no drain). It is passed on to the waiter now. */
Test(runtime, a_signal_taken_by_a_thread_that_blocks_none_reaches_the_waiter, .timeout = 20) {
  int stop = 0;
  pthread_t t;
  cr_assert_eq(pthread_create(&t, NULL, foreign_thread, &stop), 0);
  usleep(20000); /* its mask is set */
  runtime_block_signals();
  for (int i = 0; i < 3; i++) {
    int sig = (int[]){SIGTERM, SIGHUP, SIGINT}[i];
    cr_assert_eq(kill(getpid(), sig), 0); /* the waiter is not waiting: blocked here */
    usleep(20000);
    cr_assert_eq(runtime_wait_signal(5000), sig, "signal %d was not passed on", sig);
  }
  __atomic_store_n(&stop, 1, __ATOMIC_SEQ_CST);
  pthread_join(t, NULL);
}
