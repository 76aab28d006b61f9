#include "fake_device_memory.h"

#include <pthread.h>

#define MAX_DEV 1024

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static char *ptrs[MAX_DEV];
static size_t lens[MAX_DEV];
static int live;

void *fake_dev_alloc(size_t bytes) {
  char *p = calloc(1, bytes ? bytes : 1);
  REQUIRE(p);
  pthread_mutex_lock(&mu);
  int i = 0;
  while (i < MAX_DEV && ptrs[i]) i++;
  REQUIRE(i < MAX_DEV);
  ptrs[i] = p;
  lens[i] = bytes ? bytes : 1;
  live++;
  pthread_mutex_unlock(&mu);
  return p;
}

void fake_dev_free(void *p) {
  if (!p) return; /* as free(NULL) */
  pthread_mutex_lock(&mu);
  int i = 0;
  while (i < MAX_DEV && ptrs[i] != p) i++;
  REQUIRE(i < MAX_DEV); /* freeing what was never allocated, or twice */
  ptrs[i] = NULL;
  live--;
  pthread_mutex_unlock(&mu);
  free(p);
}

bool fake_is_dev(const void *p, size_t bytes) {
  const char *c = p;
  bool r = false;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAX_DEV && !r; i++)
    r = ptrs[i] && c >= ptrs[i] && c + bytes <= ptrs[i] + lens[i];
  pthread_mutex_unlock(&mu);
  return r;
}

int fake_dev_live(void) {
  pthread_mutex_lock(&mu);
  int n = live;
  pthread_mutex_unlock(&mu);
  return n;
}
