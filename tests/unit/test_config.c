#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"

/* A table shaped like meshd's. Targets start at sentinels so "untouched" shows. */
static const char *listen_addr;
static const char *port_file;
static int64_t threads;
static int64_t rank;
static int64_t min_agents;
static double ratio;
static bool verbose;
static bool enabled;
static uint64_t max_bytes;

static const config_flag_t flags[] = {
    {"listen", CONFIG_STRING, "0.0.0.0:50051", "gRPC address", &listen_addr, 0, 0},
    {"port-file", CONFIG_STRING, NULL, "write the bound port there", &port_file, 0, 0},
    {"threads", CONFIG_INT, "2", "completion-queue threads", &threads, 1, 64},
    {"rank", CONFIG_INT, "-1", "world rank", &rank, 0, 0},
    {"min-agents", CONFIG_INT, NULL, "agents needed", &min_agents, 0, 0},
    {"ratio", CONFIG_DOUBLE, "0.5", "a ratio", &ratio, 0, 1},
    {"verbose", CONFIG_BOOL, "false", "say more", &verbose, 0, 0},
    {"enabled", CONFIG_BOOL, "true", "on or off", &enabled, 0, 0},
    {"max-message-bytes", CONFIG_BYTES, "4MiB", "largest message", &max_bytes, 0, 0},
};
#define NFLAGS (sizeof flags / sizeof flags[0])

static const char *const env_names[] = {
    "MESHD_LISTEN", "MESHD_PORT_FILE", "MESHD_THREADS", "MESHD_RANK", "MESHD_MIN_AGENTS",
    "MESHD_RATIO",  "MESHD_VERBOSE",   "MESHD_ENABLED", "MESHD_MAX_MESSAGE_BYTES", "MESHD_BOGUS"};

static void reset(void) {
  for (size_t i = 0; i < sizeof env_names / sizeof env_names[0]; i++)
    unsetenv(env_names[i]);
  listen_addr = "sentinel";
  port_file = "sentinel";
  threads = rank = min_agents = -777;
  ratio = -777;
  verbose = enabled = false;
  max_bytes = 777;
}

TestSuite(config, .init = reset);

static char err[256];
static int npos;
static char *args[32];

/* Parses the NULL-terminated list; argv[0] is "prog". */
#define PARSE(...) parse_list((const char *[]){"prog", __VA_ARGS__, NULL})
#define PARSE0() parse_list((const char *[]){"prog", NULL})

static int parse_list(const char **list) {
  int argc = 0;
  while (list[argc]) {
    args[argc] = (char *)list[argc];
    argc++;
  }
  args[argc] = NULL;
  npos = -1;
  strcpy(err, "untouched");
  return config_parse(flags, NFLAGS, argc, args, &npos, err, sizeof err);
}

static void expect_error(int rc, const char *msg) {
  cr_assert_eq(rc, -1, "rc %d, err '%s'", rc, err);
  cr_assert_str_eq(err, msg);
}

/* ------------------------------------------------------------ defaults */

Test(config, defaults_apply_when_nothing_given) {
  cr_assert_eq(PARSE0(), 0, "%s", err);
  cr_assert_str_eq(listen_addr, "0.0.0.0:50051");
  cr_assert_eq(threads, 2);
  cr_assert_eq(rank, -1);
  cr_assert_float_eq(ratio, 0.5, 1e-12);
  cr_assert_not(verbose);
  cr_assert(enabled);
  cr_assert_eq(max_bytes, 4u << 20);
  cr_assert_eq(npos, 0);
}

Test(config, null_default_leaves_target_untouched) {
  cr_assert_eq(PARSE0(), 0);
  cr_assert_str_eq(port_file, "sentinel");
  cr_assert_eq(min_agents, -777);
}

/* ------------------------------------------------------------ argv forms */

Test(config, space_and_equals_forms) {
  cr_assert_eq(PARSE("--listen", "127.0.0.1:0", "--threads=8", "--port-file", "/tmp/p"), 0,
               "%s", err);
  cr_assert_str_eq(listen_addr, "127.0.0.1:0");
  cr_assert_eq(threads, 8);
  cr_assert_str_eq(port_file, "/tmp/p");
}

Test(config, strings_point_into_argv) {
  const char *list[] = {"prog", "--listen=x:2", NULL};
  char *argv[] = {(char *)list[0], (char *)list[1], NULL};
  cr_assert_eq(config_parse(flags, NFLAGS, 2, argv, &npos, err, sizeof err), 0);
  cr_assert_eq(listen_addr, list[1] + strlen("--listen="));
}

Test(config, equals_form_allows_empty_and_dashed_values) {
  cr_assert_eq(PARSE("--listen=", "--port-file=--odd"), 0, "%s", err);
  cr_assert_str_eq(listen_addr, "");
  cr_assert_str_eq(port_file, "--odd");
}

Test(config, value_may_start_with_a_single_dash) {
  cr_assert_eq(PARSE("--rank", "-5", "--ratio", "-0"), 0, "%s", err);
  cr_assert_eq(rank, -5);
  cr_assert_float_eq(ratio, 0.0, 1e-12);
}

Test(config, last_one_wins) {
  cr_assert_eq(PARSE("--threads", "3", "--threads=5", "--listen", "a", "--listen", "b"), 0);
  cr_assert_eq(threads, 5);
  cr_assert_str_eq(listen_addr, "b");
}

Test(config, int_without_range_takes_any_value) {
  cr_assert_eq(PARSE("--rank=-9223372036854775808"), 0, "%s", err);
  cr_assert_eq(rank, INT64_MIN);
  cr_assert_eq(PARSE("--rank=9223372036854775807"), 0, "%s", err);
  cr_assert_eq(rank, INT64_MAX);
}

Test(config, int_range_is_inclusive) {
  cr_assert_eq(PARSE("--threads=1"), 0);
  cr_assert_eq(threads, 1);
  cr_assert_eq(PARSE("--threads=64"), 0);
  cr_assert_eq(threads, 64);
}

Test(config, ints_are_decimal) {
  cr_assert_eq(PARSE("--threads=010"), 0);
  cr_assert_eq(threads, 10);
  expect_error(PARSE("--threads=0x10"), "--threads: '0x10' is not an integer");
}

Test(config, doubles) {
  cr_assert_eq(PARSE("--ratio", "0.25"), 0, "%s", err);
  cr_assert_float_eq(ratio, 0.25, 1e-12);
  cr_assert_eq(PARSE("--ratio=1e-1"), 0, "%s", err);
  cr_assert_float_eq(ratio, 0.1, 1e-12);
  cr_assert_eq(PARSE("--ratio=1"), 0, "%s", err);
  cr_assert_float_eq(ratio, 1.0, 1e-12);
}

/* ------------------------------------------------------------ bools */

Test(config, bool_alone_is_true) {
  cr_assert_eq(PARSE("--verbose"), 0, "%s", err);
  cr_assert(verbose);
}

Test(config, bool_alone_does_not_take_the_next_argument) {
  cr_assert_eq(PARSE("--verbose", "false"), 0, "%s", err);
  cr_assert(verbose);
  cr_assert_eq(npos, 1);
  cr_assert_str_eq(args[1], "false");
}

Test(config, bool_values) {
  static const struct {
    const char *text;
    bool want;
  } cases[] = {{"true", true}, {"false", false}, {"1", true},    {"0", false},
               {"yes", true},  {"no", false},    {"TRUE", true}, {"No", false}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char arg[64];
    snprintf(arg, sizeof arg, "--enabled=%s", cases[i].text);
    enabled = !cases[i].want;
    cr_assert_eq(PARSE(arg), 0, "%s: %s", arg, err);
    cr_assert_eq(enabled, cases[i].want, "%s", arg);

    reset();
    setenv("MESHD_VERBOSE", cases[i].text, 1);
    verbose = !cases[i].want;
    cr_assert_eq(PARSE0(), 0, "env %s: %s", cases[i].text, err);
    cr_assert_eq(verbose, cases[i].want, "env %s", cases[i].text);
    unsetenv("MESHD_VERBOSE");
  }
}

Test(config, bool_bad_value) {
  expect_error(PARSE("--verbose=maybe"),
               "--verbose: 'maybe' is not a boolean (true/false/1/0/yes/no)");
  expect_error(PARSE("--verbose="), "--verbose: '' is not a boolean (true/false/1/0/yes/no)");
}

/* ------------------------------------------------------------ bytes */

Test(config, bytes_flag) {
  cr_assert_eq(PARSE("--max-message-bytes", "8GiB"), 0, "%s", err);
  cr_assert_eq(max_bytes, 8ull << 30);
  cr_assert_eq(PARSE("--max-message-bytes=512"), 0, "%s", err);
  cr_assert_eq(max_bytes, 512);
}

Test(config, bytes_flag_bad_value) {
  expect_error(PARSE("--max-message-bytes=4QB"),
               "--max-message-bytes: '4QB' is not a byte size (e.g. 512, 4KiB, 8GiB)");
}

Test(config, parse_bytes_accepts) {
  static const struct {
    const char *text;
    uint64_t want;
  } cases[] = {
      {"0", 0},
      {"512", 512},
      {"512B", 512},
      {"4KiB", 4096},
      {"4kib", 4096},
      {"4MiB", 4ull << 20},
      {"8GiB", 8ull << 30},
      {"1K", 1024},
      {"1k", 1024},
      {"2M", 2ull << 20},
      {"3G", 3ull << 30},
      {"3g", 3ull << 30},
      {"1T", 1ull << 40},
      {"1TiB", 1ull << 40},
      {"2P", 2ull << 50},
      {"15E", 15ull << 60},
      {"18446744073709551615", UINT64_MAX},
      {"16777215T", 16777215ull << 40},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    uint64_t v = 12345;
    cr_assert(config_parse_bytes(cases[i].text, &v), "%s", cases[i].text);
    cr_assert_eq(v, cases[i].want, "%s: got %llu", cases[i].text, (unsigned long long)v);
  }
}

Test(config, parse_bytes_rejects) {
  static const char *const bad[] = {
      "",        "K",        "-1",  "+1",  " 1",      "1 ",  "1 KiB", "1.5G",
      "1KB",     "1Ki",      "1X",  "0x10", "1KiBB",  "1iB", "abc",   "4MiBs",
      "18446744073709551616", /* 2^64: overflow in the number */
      "16E",                  /* 2^64: overflow in the unit */
      "16777216T",            /* 2^64 */
      "99999999999999999999999",
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    uint64_t v = 12345;
    cr_assert_not(config_parse_bytes(bad[i], &v), "'%s' accepted", bad[i]);
    cr_assert_eq(v, 12345, "'%s' wrote the target", bad[i]);
  }
  cr_assert_not(config_parse_bytes(NULL, NULL));
}

/* ------------------------------------------------------------ positionals */

Test(config, positionals_are_compacted_in_order) {
  cr_assert_eq(PARSE("health", "--threads", "4", "svc", "-", "--verbose", "-x"), 0, "%s", err);
  cr_assert_eq(npos, 4);
  cr_assert_str_eq(args[1], "health");
  cr_assert_str_eq(args[2], "svc");
  cr_assert_str_eq(args[3], "-");
  cr_assert_str_eq(args[4], "-x");
  cr_assert_null(args[5]);
  cr_assert_str_eq(args[0], "prog");
  cr_assert_eq(threads, 4);
  cr_assert(verbose);
}

Test(config, double_dash_ends_flags) {
  cr_assert_eq(PARSE("--threads=4", "--", "--threads=9", "--bogus", "-h", "x"), 0, "%s", err);
  cr_assert_eq(threads, 4);
  cr_assert_eq(npos, 4);
  cr_assert_str_eq(args[1], "--threads=9");
  cr_assert_str_eq(args[2], "--bogus");
  cr_assert_str_eq(args[3], "-h");
  cr_assert_str_eq(args[4], "x");
}

Test(config, null_npositional_and_err_are_allowed) {
  char *argv[] = {"prog", "--threads=3", NULL};
  cr_assert_eq(config_parse(flags, NFLAGS, 2, argv, NULL, NULL, 0), 0);
  cr_assert_eq(threads, 3);
  char *bad[] = {"prog", "--bogus", NULL};
  cr_assert_eq(config_parse(flags, NFLAGS, 2, bad, NULL, NULL, 0), -1);
}

/* ------------------------------------------------------------ help */

Test(config, help) {
  cr_assert_eq(PARSE("-h"), 1);
  cr_assert_eq(PARSE("--help"), 1);
  cr_assert_eq(PARSE("--threads", "4", "--help"), 1);
  cr_assert_eq(PARSE("pos", "-h", "--threads=4"), 1);
}

Test(config, version) {
  cr_assert_eq(PARSE("--version"), 2);
  cr_assert_eq(PARSE("--threads", "4", "--version"), 2);
  expect_error(PARSE("--bogus", "--version"), "--bogus: unknown flag");
  cr_assert_eq(PARSE("--port-file", "--version"), -1, "a flag's missing value is not --version");
}

Test(config, help_wins_over_an_earlier_argv_error) {
  cr_assert_eq(PARSE("--bogus", "--help"), 1);
  cr_assert_eq(PARSE("--threads=x", "-h"), 1);
  cr_assert_eq(PARSE("--listen", "--help"), 1);
}

Test(config, help_is_not_seen_after_double_dash_or_as_a_value) {
  expect_error(PARSE("--bogus", "--", "-h"), "--bogus: unknown flag");
  cr_assert_eq(PARSE("--port-file", "-h"), 0, "%s", err);
  cr_assert_str_eq(port_file, "-h");
}

/* ------------------------------------------------------------ errors */

Test(config, unknown_flag) {
  expect_error(PARSE("--bogus"), "--bogus: unknown flag");
  expect_error(PARSE("--bogus=3"), "--bogus: unknown flag");
  expect_error(PARSE("--thread", "3"), "--thread: unknown flag");
  expect_error(PARSE("--threadsx=3"), "--threadsx: unknown flag");
}

Test(config, missing_value) {
  expect_error(PARSE("--listen"), "--listen: needs a value");
  expect_error(PARSE("--listen", "--threads", "3"), "--listen: needs a value");
  expect_error(PARSE("--threads"), "--threads: needs a value");
}

Test(config, not_an_integer) {
  expect_error(PARSE("--threads", "x"), "--threads: 'x' is not an integer");
  expect_error(PARSE("--threads=12abc"), "--threads: '12abc' is not an integer");
  expect_error(PARSE("--threads="), "--threads: '' is not an integer");
  expect_error(PARSE("--threads= 5"), "--threads: ' 5' is not an integer");
  expect_error(PARSE("--threads=1.5"), "--threads: '1.5' is not an integer");
}

Test(config, integer_out_of_range) {
  expect_error(PARSE("--threads", "0"), "--threads: 0 is out of range [1, 64]");
  expect_error(PARSE("--threads=65"), "--threads: 65 is out of range [1, 64]");
  expect_error(PARSE("--threads=-3"), "--threads: -3 is out of range [1, 64]");
  expect_error(PARSE("--rank=9223372036854775808"),
               "--rank: '9223372036854775808' is out of range");
}

Test(config, not_a_number) {
  expect_error(PARSE("--ratio=abc"), "--ratio: 'abc' is not a number");
  expect_error(PARSE("--ratio=0.5x"), "--ratio: '0.5x' is not a number");
  expect_error(PARSE("--ratio=nan"), "--ratio: 'nan' is not a number");
  expect_error(PARSE("--ratio=inf"), "--ratio: 'inf' is not a number");
  expect_error(PARSE("--ratio="), "--ratio: '' is not a number");
}

Test(config, double_out_of_range) {
  expect_error(PARSE("--ratio=1.5"), "--ratio: 1.5 is out of range [0, 1]");
  expect_error(PARSE("--ratio=-0.25"), "--ratio: -0.25 is out of range [0, 1]");
}

Test(config, first_error_is_reported) {
  expect_error(PARSE("--threads=0", "--bogus"), "--bogus: unknown flag");
  expect_error(PARSE("--threads=0", "--ratio=2"), "--threads: 0 is out of range [1, 64]");
}

Test(config, success_clears_err) {
  cr_assert_eq(PARSE0(), 0);
  cr_assert_str_eq(err, "");
}

/* ------------------------------------------------------------ environment */

Test(config, env_beats_default) {
  setenv("MESHD_THREADS", "7", 1);
  setenv("MESHD_LISTEN", "env:1", 1);
  setenv("MESHD_MAX_MESSAGE_BYTES", "1K", 1);
  setenv("MESHD_RATIO", "0.75", 1);
  setenv("MESHD_PORT_FILE", "/env/port", 1);
  cr_assert_eq(PARSE0(), 0, "%s", err);
  cr_assert_eq(threads, 7);
  cr_assert_str_eq(listen_addr, "env:1");
  cr_assert_eq(max_bytes, 1024);
  cr_assert_float_eq(ratio, 0.75, 1e-12);
  cr_assert_str_eq(port_file, "/env/port");
}

Test(config, dashes_become_underscores_in_env_names) {
  setenv("MESHD_MIN_AGENTS", "3", 1);
  cr_assert_eq(PARSE0(), 0, "%s", err);
  cr_assert_eq(min_agents, 3);
}

Test(config, argv_beats_env) {
  setenv("MESHD_THREADS", "7", 1);
  setenv("MESHD_LISTEN", "env:1", 1);
  cr_assert_eq(PARSE("--threads", "9", "--listen=argv:2"), 0, "%s", err);
  cr_assert_eq(threads, 9);
  cr_assert_str_eq(listen_addr, "argv:2");
}

Test(config, bad_env_is_ignored_when_argv_sets_the_flag) {
  setenv("MESHD_THREADS", "x", 1);
  cr_assert_eq(PARSE("--threads=4"), 0, "%s", err);
  cr_assert_eq(threads, 4);
}

Test(config, empty_env_counts_as_unset) {
  setenv("MESHD_THREADS", "", 1);
  cr_assert_eq(PARSE0(), 0, "%s", err);
  cr_assert_eq(threads, 2);
}

Test(config, env_errors_name_the_variable) {
  setenv("MESHD_THREADS", "x", 1);
  expect_error(PARSE0(), "MESHD_THREADS: 'x' is not an integer");
  setenv("MESHD_THREADS", "100", 1);
  expect_error(PARSE0(), "MESHD_THREADS: 100 is out of range [1, 64]");
  unsetenv("MESHD_THREADS");
  setenv("MESHD_VERBOSE", "perhaps", 1);
  expect_error(PARSE0(), "MESHD_VERBOSE: 'perhaps' is not a boolean (true/false/1/0/yes/no)");
  unsetenv("MESHD_VERBOSE");
  setenv("MESHD_MAX_MESSAGE_BYTES", "lots", 1);
  expect_error(PARSE0(),
               "MESHD_MAX_MESSAGE_BYTES: 'lots' is not a byte size (e.g. 512, 4KiB, 8GiB)");
}

Test(config, unknown_env_vars_are_ignored) {
  setenv("MESHD_BOGUS", "1", 1);
  cr_assert_eq(PARSE0(), 0, "%s", err);
}

Test(config, bad_default_is_reported) {
  int64_t v = 0;
  const config_flag_t bad[] = {{"count", CONFIG_INT, "many", "", &v, 0, 0}};
  unsetenv("MESHD_COUNT");
  char *argv[] = {"prog", NULL};
  cr_assert_eq(config_parse(bad, 1, 1, argv, &npos, err, sizeof err), -1);
  cr_assert_str_eq(err, "--count (default): 'many' is not an integer");
}

Test(config, empty_table_takes_positionals_and_rejects_flags) {
  char *argv[] = {"prog", "a", "b", NULL};
  cr_assert_eq(config_parse(NULL, 0, 3, argv, &npos, err, sizeof err), 0);
  cr_assert_eq(npos, 2);
  char *argv2[] = {"prog", "--x", NULL};
  cr_assert_eq(config_parse(NULL, 0, 2, argv2, &npos, err, sizeof err), -1);
  cr_assert_str_eq(err, "--x: unknown flag");
}

Test(config, error_message_is_truncated_to_errlen) {
  char small[8];
  char *argv[] = {"prog", "--bogus-flag", NULL};
  cr_assert_eq(config_parse(flags, NFLAGS, 2, argv, &npos, small, sizeof small), -1);
  cr_assert_str_eq(small, "--bogus");
}

/* ------------------------------------------------------------ usage */

Test(config, usage) {
  char *text = NULL;
  size_t len = 0;
  FILE *out = open_memstream(&text, &len);
  const config_flag_t few[] = {
      {"listen", CONFIG_STRING, "0.0.0.0:50051", "gRPC address", &listen_addr, 0, 0},
      {"port-file", CONFIG_STRING, NULL, "write the port", &port_file, 0, 0},
      {"threads", CONFIG_INT, "2", "threads", &threads, 1, 64},
      {"verbose", CONFIG_BOOL, NULL, "say more", &verbose, 0, 0},
      {"max-message-bytes", CONFIG_BYTES, "4MiB", "largest message", &max_bytes, 0, 0},
  };
  config_usage(out, "meshd", "[FLAGS]", few, sizeof few / sizeof few[0]);
  fclose(out);
  cr_assert_str_eq(text,
                   "usage: meshd [FLAGS]\n"
                   "  --listen VALUE              gRPC address (env MESHD_LISTEN, default 0.0.0.0:50051)\n"
                   "  --port-file VALUE           write the port (env MESHD_PORT_FILE)\n"
                   "  --threads N                 threads (env MESHD_THREADS, default 2)\n"
                   "  --verbose                   say more (env MESHD_VERBOSE)\n"
                   "  --max-message-bytes BYTES   largest message (env MESHD_MAX_MESSAGE_BYTES, default 4MiB)\n"
                   "  -h, --help                  show this help\n"
                   "  --version                   print the version and exit\n");
  free(text);
}

Test(config, usage_without_synopsis) {
  char *text = NULL;
  size_t len = 0;
  FILE *out = open_memstream(&text, &len);
  config_usage(out, "meshctl", NULL, NULL, 0);
  fclose(out);
  cr_assert_str_eq(text, "usage: meshctl\n  -h, --help   show this help\n"
                         "  --version    print the version and exit\n");
  free(text);
}

/* ------------------------------------------------------------ memory for agents */

#include "runtime.h"

static const char *write_tmp(const char *name, const char *text) {
  static char paths[4][64];
  static int next;
  char *p = paths[next++ % 4];
  snprintf(p, sizeof paths[0], "/tmp/meshd-test-%d-%s", (int)getpid(), name);
  FILE *f = fopen(p, "w");
  cr_assert_not_null(f);
  fputs(text, f);
  fclose(f);
  return p;
}

/* What a local agent's --memory-bytes is split from: the host's memory, or the
 * container's cgroup limit when smaller (the server passed host RAM, so agents
 * in an 8 GiB container on a large host each offered far more than it has, and
 * the kernel, not a QUOTA error, ended the work). */
Test(runtime, memory_is_the_cgroup_limit_when_smaller) {
  unsigned long long phys = runtime_memory_bytes_in(NULL, 0);
  cr_assert_gt(phys, 0);
  const char *v2 = write_tmp("max", "8589934592\n"), *none = write_tmp("none", "max\n"),
             *huge = write_tmp("huge", "9223372036854771712\n");
  const char *missing = "/tmp/meshd-test-no-such-file";
  unsigned long long want = phys < 8589934592ull ? phys : 8589934592ull;
  cr_assert_eq(runtime_memory_bytes_in((const char *[]){missing, v2}, 2), want);
  cr_assert_eq(runtime_memory_bytes_in((const char *[]){none}, 1), phys, "\"max\": no limit");
  cr_assert_eq(runtime_memory_bytes_in((const char *[]){huge}, 1), phys, "v1's huge: no limit");
  cr_assert_leq(runtime_memory_bytes(), phys);
  remove(v2);
  remove(none);
  remove(huge);
}

/* ------------------------------------------------------------ threads at exit */

#include <pthread.h>
#include <stdatomic.h>
#include <sys/wait.h>
#include <time.h>

static atomic_bool lingerer_go, lingerer_named;

static void nap_ms(long ms) { nanosleep(&(struct timespec){ms / 1000, ms % 1000 * 1000000}, NULL); }

static void *lingerer(void *arg) {
  (void)arg;
  atomic_store(&lingerer_named, true); /* runtime_spawn_detached named it before fn */
  while (!atomic_load(&lingerer_go)) nap_ms(1);
  nap_ms(50); /* still running a while after main lets go */
  return NULL;
}

static void *unnamed(void *arg) { /* a library's pool thread: lives to the end */
  (void)arg;
  for (;;) pause();
  return NULL;
}

/* A daemon's last step waits for its named threads still ending (their
 * thread-exit hooks free per-thread state the leak check would report), not
 * for unnamed ones (a library's pool, OpenBLAS's), and names those left. In a
 * forked child: the only thread there is the test's. */
Test(runtime, await_named_threads_waits_for_a_detached_thread_to_end) {
  pid_t pid = fork();
  cr_assert_geq(pid, 0);
  if (pid == 0) {
    char left[64];
    pthread_t t;
    int rc = runtime_await_named_threads(0, left, sizeof left) == 0 ? 0 : 10;
    if (!rc && pthread_create(&t, NULL, unnamed, NULL) != 0) rc = 11;
    if (!rc && runtime_spawn_detached("lingerer", lingerer, NULL) != 0) rc = 12;
    for (int ms = 0; !rc && !atomic_load(&lingerer_named); ms++) /* started: named */
      rc = ms == 10000 ? 15 : (nap_ms(1), 0);
    if (!rc && (runtime_await_named_threads(20, left, sizeof left) != 1 ||
                strcmp(left, "lingerer") != 0))
      rc = 13; /* not let go yet: it is left, by name; the unnamed one is not counted */
    atomic_store(&lingerer_go, true);
    if (!rc && runtime_await_named_threads(10000, left, sizeof left) != 0) rc = 14;
    _exit(rc);
  }
  int st = 0;
  cr_assert_eq(waitpid(pid, &st, 0), pid);
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child's step %d failed", WEXITSTATUS(st));
}
