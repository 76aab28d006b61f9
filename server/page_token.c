#include "page_token.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>

uint32_t page_token_new_epoch(void) {
  uint32_t e = 0;
  while (getrandom(&e, sizeof e, 0) < 0 && errno == EINTR) {
  }
  return e;
}

bool page_token_parse(const char *tok, uint32_t epoch, uint64_t *after) {
  *after = 0;
  if (!tok || !tok[0]) return true;
  char want[16];
  snprintf(want, sizeof want, ".%08x", epoch);
  const char *dot = strchr(tok, '.');
  if (!dot || strcmp(dot, want) != 0) return false;
  size_t len = (size_t)(dot - tok);
  if (len == 0 || len > 20 || tok[0] == '0') return false;
  uint64_t v = 0;
  for (size_t i = 0; i < len; i++) {
    if (tok[i] < '0' || tok[i] > '9') return false;
    unsigned d = (unsigned)(tok[i] - '0');
    if (v > (UINT64_MAX - d) / 10) return false;
    v = v * 10 + d;
  }
  *after = v;
  return true;
}

void page_token_format(char out[PAGE_TOKEN_LEN], uint64_t last, uint32_t epoch) {
  out[0] = '\0';
  if (last) snprintf(out, PAGE_TOKEN_LEN, "%llu.%08x", (unsigned long long)last, epoch);
}

size_t page_size_of(uint32_t asked, size_t dflt, size_t max) {
  if (asked == 0) return dflt;
  return asked > max ? max : asked;
}

int page_token_refuse(meshd_error_t *err, const char *method) {
  return error_set(err, ERR_BAD_ARGUMENT,
                   "%s: page_token is not a next_page_token this server gave (a restarted "
                   "server starts over); send \"\" for the first page",
                   method);
}
