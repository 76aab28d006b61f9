/* Fault specs (core/platform/fault.c): what each place takes, and where a
 * spec fires. */
#include <criterion/criterion.h>
#include <string.h>

#include "fault.h"

static int parse(const char *spec, const char *const *places, fault_t *f, char *why) {
  return fault_parse(spec, places, f, why, 200);
}

/* write and plan run on call threads: hang was taken and then did nothing
 * (the step ran as if no fault was set); it is refused, naming slow=MS. */
Test(fault, hang_is_refused_where_a_step_runs_on_call_threads) {
  fault_t f;
  char why[200] = "";
  cr_assert_eq(parse("write:hang", FAULT_AGENT_PLACES, &f, why), -1);
  cr_assert(strstr(why, "write") && strstr(why, "slow=MS"), "%s", why);
  cr_assert_eq(parse("plan:hang=50", FAULT_SERVER_PLACES, &f, why), -1);
  cr_assert(strstr(why, "plan"), "%s", why);
  cr_assert_eq(parse("write:slow=20", FAULT_AGENT_PLACES, &f, why), 0, "%s", why);
  cr_assert_eq(parse("plan:fail", FAULT_SERVER_PLACES, &f, why), 0, "%s", why);
  cr_assert_eq(parse("reduce:hang,rank=1,count=1", FAULT_AGENT_PLACES, &f, why), 0, "%s", why);
  cr_assert_eq(f.action, FAULT_HANG);
  cr_assert_eq(f.rank, 1);
}

Test(fault, any_fires_for_collectives_and_sends_only) {
  fault_t f;
  char why[200] = "";
  int ms = 0;
  cr_assert_eq(parse("any:fail", FAULT_AGENT_PLACES, &f, why), 0, "%s", why);
  cr_assert_eq(fault_hit(&f, "reduce", 0, &ms), FAULT_FAIL);
  cr_assert_eq(fault_hit(&f, "send", 0, &ms), FAULT_FAIL);
  cr_assert_eq(fault_hit(&f, "call", 0, &ms), FAULT_NONE);
  cr_assert_eq(fault_hit(&f, "write", 0, &ms), FAULT_NONE);
  cr_assert_eq(fault_hit(&f, "report", 0, &ms), FAULT_NONE);
}

/* report holds each progress report back (tests of what waits for one): slow
 * only, since fail or hang would say nothing a held report does not. */
Test(fault, report_takes_slow_only) {
  fault_t f;
  char why[200] = "";
  int ms = 0;
  cr_assert_eq(parse("report:fail", FAULT_AGENT_PLACES, &f, why), -1);
  cr_assert(strstr(why, "report takes slow=MS only"), "%s", why);
  cr_assert_eq(parse("report:hang", FAULT_AGENT_PLACES, &f, why), -1);
  cr_assert_eq(parse("report:slow=30,rank=1", FAULT_AGENT_PLACES, &f, why), 0, "%s", why);
  cr_assert_eq(fault_hit(&f, "report", 0, &ms), FAULT_NONE);
  cr_assert_eq(fault_hit(&f, "report", 1, &ms), FAULT_SLOW);
  cr_assert_eq(ms, 30);
}

/* expire takes a held grant request's fetch as past its expiry: fail only
 * (a slow or hung expiry is no expiry); drop holds a DropSnapshot back: slow
 * only. The server's places alone. */
Test(fault, expire_takes_fail_and_drop_slow_only) {
  fault_t f;
  char why[200] = "";
  int ms = 0;
  cr_assert_eq(parse("expire:slow=10", FAULT_SERVER_PLACES, &f, why), -1);
  cr_assert(strstr(why, "expire takes fail only"), "%s", why);
  cr_assert_eq(parse("expire:fail", FAULT_AGENT_PLACES, &f, why), -1);
  cr_assert_eq(parse("expire:fail,count=1", FAULT_SERVER_PLACES, &f, why), 0, "%s", why);
  cr_assert_eq(fault_hit(&f, "expire", -1, &ms), FAULT_FAIL);
  cr_assert_eq(fault_hit(&f, "expire", -1, &ms), FAULT_NONE);
  cr_assert_eq(parse("drop:fail", FAULT_SERVER_PLACES, &f, why), -1);
  cr_assert(strstr(why, "drop takes slow=MS only"), "%s", why);
  cr_assert_eq(parse("drop:slow=300", FAULT_SERVER_PLACES, &f, why), 0, "%s", why);
  cr_assert_eq(fault_hit(&f, "drop", -1, &ms), FAULT_SLOW);
  cr_assert_eq(ms, 300);
}

Test(fault, unknown_places_and_actions_are_named) {
  fault_t f;
  char why[200] = "";
  cr_assert_eq(parse("plan:fail", FAULT_AGENT_PLACES, &f, why), -1);
  cr_assert(strstr(why, "'plan'") && strstr(why, "reduce"), "%s", why);
  cr_assert_eq(parse("reduce:explode", FAULT_AGENT_PLACES, &f, why), -1);
  cr_assert(strstr(why, "ACTION"), "%s", why);
  cr_assert_eq(parse("reduce:fail,after=x", FAULT_AGENT_PLACES, &f, why), -1);
  cr_assert(strstr(why, "after"), "%s", why);
}
