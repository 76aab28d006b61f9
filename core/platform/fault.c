#include "fault.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int parse_num(const char *s, long long lo, long long hi, long long *out) {
  char *end;
  long long v = strtoll(s, &end, 10);
  if (!*s || *end || v < lo || v > hi) return -1;
  *out = v;
  return 0;
}

const char *const FAULT_AGENT_PLACES[] = {"reduce", "send", "call", "any", "hello", "write",
                                           "report", NULL};
const char *const FAULT_SERVER_PLACES[] = {"plan", "session", "remove", "finish", "expire", "drop",
                                            NULL};

int fault_parse(const char *spec, const char *const *places, fault_t *f, char *err, size_t errlen) {
  memset(f, 0, sizeof *f);
  f->rank = -1;
  char buf[256];
  if (!spec || strlen(spec) >= sizeof buf) {
    snprintf(err, errlen, "fault spec is empty or too long");
    return -1;
  }
  snprintf(buf, sizeof buf, "%s", spec);
  char *save = NULL, *part = strtok_r(buf, ",", &save);
  char *colon = part ? strchr(part, ':') : NULL;
  if (!colon) {
    snprintf(err, errlen, "fault spec '%s': expected WHERE:ACTION, e.g. reduce:hang", spec);
    return -1;
  }
  *colon = '\0';
  size_t k = 0;
  while (places[k] && strcmp(places[k], part)) k++;
  if (!places[k]) {
    char known[128] = "";
    for (size_t i = 0, len = 0; places[i] && len < sizeof known; i++)
      len += (size_t)snprintf(known + len, sizeof known - len, "%s%s", i ? ", " : "", places[i]);
    snprintf(err, errlen, "fault spec '%s': WHERE '%s' is not one of %s", spec, part, known);
    return -1;
  }
  snprintf(f->where, sizeof f->where, "%s", part);
  char *action = colon + 1, *eq = strchr(action, '=');
  if (eq) *eq = '\0';
  long long v = 0;
  bool hello = !strcmp(f->where, "hello");
  if (hello != (!strcmp(action, "old") && !eq)) {
    snprintf(err, errlen, "fault spec '%s': %s", spec,
             hello ? "hello takes the ACTION old alone" : "ACTION old goes with WHERE hello");
    return -1;
  }
  if (hello) f->action = FAULT_OLD;
  else if (!strcmp(action, "fail") && !eq) f->action = FAULT_FAIL;
  else if (!strcmp(action, "hang")) f->action = FAULT_HANG;
  else if (!strcmp(action, "slow") && eq) f->action = FAULT_SLOW;
  else {
    snprintf(err, errlen, "fault spec '%s': ACTION must be fail, hang[=MS] or slow=MS", spec);
    return -1;
  }
  /* A client's Write and a PlanTransfer's answer run on the rpc layer's
   * threads: a hang there would stall every caller, not wedge one step. */
  if (f->action == FAULT_HANG && (!strcmp(f->where, "write") || !strcmp(f->where, "plan"))) {
    snprintf(err, errlen, "fault spec '%s': %s takes fail or slow=MS, not hang (it runs on the "
             "server's call threads: use slow=MS for a late answer)", spec, f->where);
    return -1;
  }
  if (!strcmp(f->where, "remove") && f->action == FAULT_HANG) {
    snprintf(err, errlen, "fault spec '%s': remove takes fail or slow=MS, not hang", spec);
    return -1;
  }
  if (!strcmp(f->where, "session") && f->action != FAULT_SLOW) {
    snprintf(err, errlen, "fault spec '%s': session takes slow=MS only (a late CreateSession "
             "answer)", spec);
    return -1;
  }
  if (!strcmp(f->where, "report") && f->action != FAULT_SLOW) {
    snprintf(err, errlen, "fault spec '%s': report takes slow=MS only (each progress report "
             "held back)", spec);
    return -1;
  }
  if (!strcmp(f->where, "finish") && f->action != FAULT_SLOW) {
    snprintf(err, errlen, "fault spec '%s': finish takes slow=MS only (a FinishUpload held "
             "before it defines its tensor)", spec);
    return -1;
  }
  if (!strcmp(f->where, "drop") && f->action != FAULT_SLOW) {
    snprintf(err, errlen, "fault spec '%s': drop takes slow=MS only (a DropSnapshot held "
             "before it is sent)", spec);
    return -1;
  }
  if (!strcmp(f->where, "expire") && f->action != FAULT_FAIL) {
    snprintf(err, errlen, "fault spec '%s': expire takes fail only (a held grant request's "
             "fetch taken as past its expiry)", spec);
    return -1;
  }
  if (eq && parse_num(eq + 1, 0, 86400000, &v)) {
    snprintf(err, errlen, "fault spec '%s': '%s' is not a number of milliseconds", spec, eq + 1);
    return -1;
  }
  f->ms = (int)v;
  while ((part = strtok_r(NULL, ",", &save))) {
    char *e = strchr(part, '=');
    if (e) *e++ = '\0';
    long long n;
    if (!e || parse_num(e, 0, 1LL << 40, &n)) {
      snprintf(err, errlen, "fault spec '%s': option '%s' needs a number (rank=R, after=K, count=C)",
               spec, part);
      return -1;
    }
    if (!strcmp(part, "rank")) f->rank = n;
    else if (!strcmp(part, "after")) f->after = (uint64_t)n;
    else if (!strcmp(part, "count")) f->count = (uint64_t)n;
    else {
      snprintf(err, errlen, "fault spec '%s': unknown option '%s' (rank, after, count)", spec, part);
      return -1;
    }
  }
  return 0;
}

fault_action_t fault_hit(fault_t *f, const char *where, int64_t rank, int *ms) {
  if (!f || f->action == FAULT_NONE) return FAULT_NONE;
  bool any = !strcmp(f->where, "any") && /* the agent's instructions only */
             (!strcmp(where, "reduce") || !strcmp(where, "send"));
  if (!any && strcmp(f->where, where)) return FAULT_NONE;
  if (f->rank >= 0 && f->rank != rank) return FAULT_NONE;
  if (atomic_fetch_add(&f->seen, 1) < f->after) return FAULT_NONE;
  if (f->count && atomic_fetch_add(&f->fired, 1) >= f->count) return FAULT_NONE;
  *ms = f->ms;
  return f->action;
}
