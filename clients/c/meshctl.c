/* meshctl: look at a running meshd from the command line.
 *
 * Exit status follows grpc_health_probe: 0 ok (SERVING), 2 could not connect,
 * 3 the call failed, 4 not serving. Usage errors exit 64 (EX_USAGE) so they
 * cannot be mistaken for "could not connect"; 1 is anything else (out of memory).
 *
 * --output json: every command prints one JSON document on stdout (a failure
 * too: {"error": {"code", "message", ...}}, with the same exit status), and
 * `sessions --watch` one per frame (JSON lines). Messages for people stay on
 * stderr in both formats. */
#include <ctype.h>
#include <errno.h>
#include <json-c/json.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "build_info.h"
#include "conn.h" /* the library's own option checks, so errors name the flag */
#include "meshd.h"

enum {
  EXIT_OK = 0,
  EXIT_FAILURE_OTHER = 1,
  EXIT_CONNECT = 2,
  EXIT_RPC = 3,
  EXIT_NOT_SERVING = 4,
  EXIT_USAGE = 64,
};

#define SYNOPSIS "[--server ADDR] [--timeout-ms MS] [--token T | --token-file F] [--tls] " \
                 "[--tls-ca F] [--tls-cert F --tls-key F] [--output json|table] " \
                 "[--progress=true|false] [--data-path MODE] [--version] COMMAND [ARGS]"

static const char *server;
static int64_t timeout_ms;
static meshd_connect_options_t conn = MESHD_CONNECT_OPTIONS_INIT;
static char token_buf[CONN_MAX_TOKEN + 2]; /* from --token-file; wiped at exit */
static bool progress_on;                   /* --progress, else stderr is a terminal */
static int64_t progress_delay_ms;
static bool json_out;                      /* --output json */
static bool show_version;                  /* --version */
static bool watch;                         /* sessions --watch */
static double watch_interval_s;
static int64_t watch_count;                /* frames; 0: until Ctrl-C */
static const char *watch_flag_given;       /* the first of --watch, --interval, --count given */

/* The run's JSON document (--output json), printed once at the end, and the
 * first failure, added to it as "error". */
static json_object *doc;
static json_object *doc_error;
static meshd_data_path_t data_path; /* run's session */

/* ------------------------------------------------------------------ flags */

/* The flags as every meshd program takes them: `--name VALUE` or `--name=VALUE`
 * anywhere on the line (a value may not start with "--"; the last one given
 * wins), else the environment variable (empty counts as unset), else the
 * default. A flag with no default given empty (`--tls-cert=`) is unset, whatever
 * the environment says: a probe in a container whose MESHD_TLS_CERT is the
 * server's own certificate speaks plaintext that way. -h or --help anywhere before a lone "--" shows the usage, even after
 * a bad flag; "--" makes everything after it positional. */
typedef struct flag {
  const char *name, *metavar, *env, *default_value, *help;
  bool is_bool; /* `--name` alone is true; a value only as --name=VALUE */
} flag_t;

enum {
  FLAG_SERVER,
  FLAG_TIMEOUT_MS,
  FLAG_TOKEN,
  FLAG_TOKEN_FILE,
  FLAG_TLS,
  FLAG_TLS_CA,
  FLAG_TLS_CERT,
  FLAG_TLS_KEY,
  FLAG_TLS_SERVER_NAME,
  FLAG_INSECURE,
  FLAG_NO_PROGRESS,
  FLAG_PROGRESS,
  FLAG_PROGRESS_DELAY_MS,
  FLAG_OUTPUT,
  FLAG_VERSION,
  FLAG_WATCH,
  FLAG_INTERVAL,
  FLAG_COUNT,
  FLAG_DATA_PATH,
  FLAG_MESH, /* FLAG_MESH .. FLAG_DIM: `meshctl load` only */
  FLAG_DTYPE,
  FLAG_SHAPE,
  FLAG_NAME,
  FLAG_SHARD,
  FLAG_DIM,
  NFLAGS
};
static const flag_t flags[NFLAGS] = {
    [FLAG_SERVER] = {"server", "VALUE", "MESHD_SERVER", "127.0.0.1:50051",
                     "meshd address, host:port", false},
    [FLAG_TIMEOUT_MS] = {"timeout-ms", "N", "MESHD_TIMEOUT_MS", "5000",
                         "milliseconds to wait for the connection, then again for the call", false},
    [FLAG_TOKEN] = {"token", "TOKEN", "MESHD_TOKEN", NULL,
                    "bearer token sent on every call (ps shows a command line: prefer "
                    "the variable or --token-file)", false},
    [FLAG_TOKEN_FILE] = {"token-file", "FILE", "MESHD_TOKEN_FILE", NULL,
                         "read the bearer token from the first line of FILE", false},
    [FLAG_TLS] = {"tls", "", "MESHD_TLS", "false",
                  "TLS, the server verified against the system's roots", true},
    [FLAG_TLS_CA] = {"tls-ca", "FILE", "MESHD_TLS_CA", NULL,
                     "TLS, the server verified against the PEM roots in FILE", false},
    [FLAG_TLS_CERT] = {"tls-cert", "FILE", "MESHD_TLS_CERT", NULL,
                       "client certificate (PEM) for mTLS; needs --tls-key", false},
    [FLAG_TLS_KEY] = {"tls-key", "FILE", "MESHD_TLS_KEY", NULL,
                      "the client certificate's key (PEM)", false},
    [FLAG_TLS_SERVER_NAME] = {"tls-server-name", "NAME", "MESHD_TLS_SERVER_NAME", NULL,
                              "name checked in the server's certificate instead of the host", false},
    [FLAG_INSECURE] = {"insecure", "", NULL, "false",
                       "send the token even in plaintext to a non-loopback address", true},
    [FLAG_NO_PROGRESS] = {"no-progress", "", "MESHD_NO_PROGRESS", "false",
                          "no progress line on stderr for long transfers", true},
    [FLAG_PROGRESS] = {"progress", "", "MESHD_PROGRESS", NULL,
                       "progress line on stderr for long transfers: true even when stderr is "
                       "not a terminal, false never (unset: when stderr is a terminal)", true},
    [FLAG_PROGRESS_DELAY_MS] = {"progress-delay-ms", "N", "MESHD_PROGRESS_DELAY_MS", "1000",
                                "show a transfer's progress once it ran this long (only when "
                                "stderr is a terminal)", false},
    [FLAG_OUTPUT] = {"output", "FORMAT", "MESHD_OUTPUT", "table",
                     "table (for people) or json (one document on stdout; errors too)", false},
    [FLAG_VERSION] = {"version", "", NULL, "false", "print meshctl's own version and exit",
                      true},
    [FLAG_WATCH] = {"watch", "", NULL, "false",
                    "sessions: redraw the table every --interval seconds, like top", true},
    [FLAG_INTERVAL] = {"interval", "S", NULL, "2", "sessions --watch: seconds between frames",
                       false},
    [FLAG_COUNT] = {"count", "N", NULL, "0",
                    "sessions --watch: stop after N frames (0: at Ctrl-C)", false},
    [FLAG_DATA_PATH] = {"data-path", "MODE", "MESHD_DATA_PATH", "auto",
                        "how run's tensor bytes travel: auto (straight to the agents when "
                        "they answer, else through the server), direct or proxy", false},
    [FLAG_MESH] = {"mesh", "DIM=N,...", NULL, NULL,
                   "load: the mesh to load onto (unset: gpu=N over every healthy, undrained "
                   "agent)", false},
    [FLAG_DTYPE] = {"dtype", "T", NULL, NULL,
                    "load: raw bytes of dtype T (float32, bfloat16, int64, ...); needs --shape",
                    false},
    [FLAG_SHAPE] = {"shape", "N,N", NULL, NULL,
                    "load: the raw bytes' shape, e.g. 1024,1024 (\"\" for a scalar); needs "
                    "--dtype", false},
    [FLAG_NAME] = {"name", "NAME", NULL, NULL,
                   "load: the tensor NAME of a safetensors file (unset: the file's only one)",
                   false},
    [FLAG_SHARD] = {"shard", "DIM", NULL, NULL,
                    "load: split the tensor over mesh dim DIM, each rank fetching its slice "
                    "(unset: every rank loads all of it)", false},
    [FLAG_DIM] = {"dim", "D", NULL, "0", "load --shard: the tensor dim split", false},
};
static const char *load_given[NFLAGS]; /* --mesh .. --dim as given (NULL: not given) */
static const char *load_flag_given;    /* the first of them given */
#define TIMEOUT_MS_MIN 1
#define TIMEOUT_MS_MAX 3600000

static bool is_help(const char *arg) {
  return strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0;
}

/* After an error in argv: a -h/--help further on still wins. */
static bool help_follows(int from, int argc, char **argv) {
  for (int i = from; i < argc && strcmp(argv[i], "--") != 0; i++)
    if (is_help(argv[i]))
      return true;
  return false;
}

/* Flag f's value from the command line (`given`), else the environment, else
 * the default; `who` gets the source's name for errors: "--timeout-ms",
 * "MESHD_TIMEOUT_MS", "--timeout-ms (default)". */
static const char *flag_value(int f, const char *given, char *who, size_t wholen) {
  if (given) {
    snprintf(who, wholen, "--%s", flags[f].name);
    return *given || flags[f].default_value ? given : NULL;
  }
  const char *env = flags[f].env ? getenv(flags[f].env) : NULL;
  if (env && *env) {
    snprintf(who, wholen, "%s", flags[f].env);
    return env;
  }
  snprintf(who, wholen, "--%s (default)", flags[f].name);
  return flags[f].default_value;
}

/* `who` names the source in errors: "--timeout-ms", "MESHD_TIMEOUT_MS". */
static int parse_ms(const char *who, const char *text, long long min, long long max,
                    int64_t *out, char *err, size_t errlen) {
  char *end;
  if (!*text || isspace((unsigned char)*text))
    goto not_int;
  errno = 0;
  long long v = strtoll(text, &end, 10);
  if (*end)
    goto not_int;
  if (errno == ERANGE) {
    snprintf(err, errlen, "%s: '%s' is out of range", who, text);
    return -1;
  }
  if (v < min || v > max) {
    snprintf(err, errlen, "%s: %lld is out of range [%lld, %lld]", who, v, min, max);
    return -1;
  }
  *out = (int64_t)v;
  return 0;
not_int:
  snprintf(err, errlen, "%s: '%s' is not an integer", who, text);
  return -1;
}

/* A CONFIG_BOOL-style value: true/false/1/0/yes/no. */
static int set_bool(const char *who, const char *text, bool *out, char *err, size_t errlen) {
  static const char *const yes[] = {"true", "1", "yes"}, *const no[] = {"false", "0", "no"};
  for (size_t i = 0; i < 3; i++) {
    if (strcmp(text, yes[i]) == 0 || strcmp(text, no[i]) == 0) {
      *out = strcmp(text, yes[i]) == 0;
      return 0;
    }
  }
  snprintf(err, errlen, "%s: '%s' is not a boolean (true/false/1/0/yes/no)", who, text);
  return -1;
}

/* The first line of `path` (trailing blanks and newline cut) into token_buf. */
static int read_token_file(const char *who, const char *path, char *err, size_t errlen) {
  FILE *f = fopen(path, "r");
  if (!f) {
    snprintf(err, errlen, "%s: cannot read %s: %s", who, path, strerror(errno));
    return -1;
  }
  bool got = fgets(token_buf, sizeof token_buf, f) != NULL;
  fclose(f);
  size_t n = got ? strlen(token_buf) : 0;
  while (n > 0 && isspace((unsigned char)token_buf[n - 1]))
    token_buf[--n] = '\0';
  if (n == 0) {
    snprintf(err, errlen, "%s: %s holds no token on its first line", who, path);
    return -1;
  }
  if (n > CONN_MAX_TOKEN) {
    snprintf(err, errlen, "%s: the token in %s is longer than %d bytes", who, path,
             CONN_MAX_TOKEN);
    return -1;
  }
  conn.token = token_buf;
  return 0;
}

/* The token, TLS and --insecure flags into conn; files are checked here so
 * that errors name the flag or variable. `given` holds the command line's. */
static int set_security(const char **given, char *err, size_t errlen) {
  char who[64], who2[64];
  /* --token and --token-file: one of them, the command line's over the environment's. */
  const char *tok = flag_value(FLAG_TOKEN, given[FLAG_TOKEN], who, sizeof who);
  const char *file = flag_value(FLAG_TOKEN_FILE, given[FLAG_TOKEN_FILE], who2, sizeof who2);
  bool cli = given[FLAG_TOKEN] || given[FLAG_TOKEN_FILE];
  if (cli && !given[FLAG_TOKEN])
    tok = NULL;
  if (cli && !given[FLAG_TOKEN_FILE])
    file = NULL;
  if (tok && file) {
    snprintf(err, errlen, "%s and %s: give one of them", who, who2);
    return -1;
  }
  if (tok) {
    if (conn_check_token(tok, who, err, errlen) != 0)
      return -1;
    conn.token = tok;
  } else if (file) {
    if (read_token_file(who2, file, err, errlen) != 0 ||
        conn_check_token(conn.token, who2, err, errlen) != 0)
      return -1;
  }

  if (set_bool(who, flag_value(FLAG_TLS, given[FLAG_TLS], who, sizeof who), &conn.tls, err,
               errlen) != 0 ||
      set_bool(who, flag_value(FLAG_INSECURE, given[FLAG_INSECURE], who, sizeof who),
               &conn.insecure, err, errlen) != 0)
    return -1;
  static const struct {
    int flag;
    const char *label;
  } files[] = {{FLAG_TLS_CA, "CERTIFICATE"}, {FLAG_TLS_CERT, "CERTIFICATE"},
               {FLAG_TLS_KEY, "PRIVATE KEY"}};
  const char *paths[3];
  for (size_t i = 0; i < 3; i++) {
    paths[i] = flag_value(files[i].flag, given[files[i].flag], who, sizeof who);
    if (paths[i] && conn_check_pem(paths[i], files[i].label, who, err, errlen) != 0)
      return -1;
  }
  conn.tls_ca_file = paths[0];
  conn.tls_cert_file = paths[1];
  conn.tls_key_file = paths[2];
  if (!conn.tls_cert_file != !conn.tls_key_file) {
    snprintf(err, errlen, "--%s needs --%s (a client certificate needs both)",
             flags[conn.tls_cert_file ? FLAG_TLS_CERT : FLAG_TLS_KEY].name,
             flags[conn.tls_cert_file ? FLAG_TLS_KEY : FLAG_TLS_CERT].name);
    return -1;
  }
  conn.tls_server_name = flag_value(FLAG_TLS_SERVER_NAME, given[FLAG_TLS_SERVER_NAME], who,
                                    sizeof who);
  bool tls = conn.tls || conn.tls_ca_file || conn.tls_cert_file || conn.tls_server_name;
  if (conn.token && !tls && !conn.insecure && !conn_target_is_loopback(server)) {
    snprintf(err, errlen,
             "refusing to send the token in plaintext to %s, which is not a loopback address: "
             "use --tls-ca FILE or --tls, or --insecure to send it anyway",
             server);
    return -1;
  }
  return 0;
}

/* Sets server and timeout_ms from argv, the environment and the defaults, and
 * moves the positional arguments to argv[1..*npos]. Returns 0, 1 for help, or
 * -1 with a message naming the flag or variable in err. */
static int parse_flags(int argc, char **argv, int *npos, char *err, size_t errlen) {
  const char *given[NFLAGS] = {NULL};
  bool rest_positional = false;
  *npos = 0;
  err[0] = '\0';
  for (int i = 1; i < argc; i++) {
    char *arg = argv[i];
    if (rest_positional || strncmp(arg, "--", 2) != 0) {
      if (!rest_positional && strcmp(arg, "-h") == 0)
        return 1;
      argv[1 + (*npos)++] = arg;
      continue;
    }
    if (arg[2] == '\0') {
      rest_positional = true;
      continue;
    }
    if (strcmp(arg, "--help") == 0)
      return 1;
    const char *name = arg + 2;
    const char *eq = strchr(name, '=');
    size_t len = eq ? (size_t)(eq - name) : strlen(name);
    int f = 0;
    while (f < NFLAGS && !(strlen(flags[f].name) == len && !strncmp(flags[f].name, name, len)))
      f++;
    if (f == NFLAGS) {
      snprintf(err, errlen, "--%.*s: unknown flag", (int)len, name);
      return help_follows(i + 1, argc, argv) ? 1 : -1;
    }
    if (eq) {
      given[f] = eq + 1;
    } else if (flags[f].is_bool) {
      given[f] = "true";
    } else if (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) {
      given[f] = argv[++i];
    } else {
      snprintf(err, errlen, "--%s: needs a value", flags[f].name);
      return help_follows(i + 1, argc, argv) ? 1 : -1;
    }
  }
  if (1 + *npos < argc)
    argv[1 + *npos] = NULL;

  char who[64];
  server = flag_value(FLAG_SERVER, given[FLAG_SERVER], who, sizeof who);
  if (!*server) {
    snprintf(err, errlen, "%s: empty; expected host:port (default %s)", who,
             flags[FLAG_SERVER].default_value);
    return -1;
  }
  const char *text = flag_value(FLAG_TIMEOUT_MS, given[FLAG_TIMEOUT_MS], who, sizeof who);
  if (parse_ms(who, text, TIMEOUT_MS_MIN, TIMEOUT_MS_MAX, &timeout_ms, err, errlen) != 0)
    return -1;
  conn.timeout_ms = (int)timeout_ms;
  conn.fail_fast = true; /* a refused port is an error now, not after --timeout-ms */
  bool no_progress = false, forced = false;
  if (set_bool(who, flag_value(FLAG_NO_PROGRESS, given[FLAG_NO_PROGRESS], who, sizeof who),
               &no_progress, err, errlen) != 0)
    return -1;
  text = flag_value(FLAG_PROGRESS, given[FLAG_PROGRESS], who, sizeof who);
  if (text && set_bool(who, text, &forced, err, errlen) != 0)
    return -1;
  progress_on = text ? forced : !no_progress && isatty(STDERR_FILENO);
  text = flag_value(FLAG_PROGRESS_DELAY_MS, given[FLAG_PROGRESS_DELAY_MS], who, sizeof who);
  if (parse_ms(who, text, 0, TIMEOUT_MS_MAX, &progress_delay_ms, err, errlen) != 0)
    return -1;
  if (set_bool(who, flag_value(FLAG_VERSION, given[FLAG_VERSION], who, sizeof who), &show_version,
               err, errlen) != 0 ||
      set_bool(who, flag_value(FLAG_WATCH, given[FLAG_WATCH], who, sizeof who), &watch, err,
               errlen) != 0)
    return -1;
  text = flag_value(FLAG_INTERVAL, given[FLAG_INTERVAL], who, sizeof who);
  char *end;
  errno = 0;
  watch_interval_s = strtod(text, &end);
  if (!*text || *end || errno || !(watch_interval_s >= 0.05 && watch_interval_s <= 86400)) {
    snprintf(err, errlen, "%s: '%s' is not a number of seconds in [0.05, 86400]", who, text);
    return -1;
  }
  text = flag_value(FLAG_COUNT, given[FLAG_COUNT], who, sizeof who);
  if (parse_ms(who, text, 0, INT32_MAX, &watch_count, err, errlen) != 0)
    return -1;
  for (int f = FLAG_WATCH; f <= FLAG_COUNT && !watch_flag_given; f++)
    if (given[f])
      watch_flag_given = flags[f].name;
  for (int f = FLAG_MESH; f <= FLAG_DIM; f++) { /* checked by cmd_load */
    load_given[f] = given[f];
    if (given[f] && !load_flag_given)
      load_flag_given = flags[f].name;
  }
  text = flag_value(FLAG_DATA_PATH, given[FLAG_DATA_PATH], who, sizeof who);
  if (meshd_data_path_parse(text, &data_path) != MESHD_E_OK) {
    snprintf(err, errlen, "%s: expected auto, direct or proxy, got '%s'", who, text);
    return -1;
  }
  return set_security(given, err, errlen);
}

/* --output, first of all: it says how the other errors are printed. */
static int parse_output(int argc, char **argv, char *err, size_t errlen) {
  const char *given = NULL;
  for (int i = 1; i < argc && strcmp(argv[i], "--") != 0; i++) {
    if (strncmp(argv[i], "--output=", 9) == 0)
      given = argv[i] + 9;
    else if (strcmp(argv[i], "--output") == 0 && i + 1 < argc &&
             strncmp(argv[i + 1], "--", 2) != 0)
      given = argv[++i];
  }
  char who[64];
  const char *text = flag_value(FLAG_OUTPUT, given, who, sizeof who);
  if (strcmp(text, "json") == 0 || strcmp(text, "table") == 0) {
    json_out = text[0] == 'j';
    return 0;
  }
  snprintf(err, errlen, "%s: '%s' is not an output format (expected json or table)", who, text);
  return -1;
}

static int cmd_health(meshd_client_t *c, int argc, char **argv);
static int cmd_agents(meshd_client_t *c, int argc, char **argv);
static int cmd_sessions(meshd_client_t *c, int argc, char **argv);
static int cmd_run(meshd_client_t *c, int argc, char **argv);
static int cmd_version(meshd_client_t *c, int argc, char **argv);
static int cmd_drain(meshd_client_t *c, int argc, char **argv);
static int cmd_undrain(meshd_client_t *c, int argc, char **argv);
static int cmd_load(meshd_client_t *c, int argc, char **argv);

typedef struct command {
  const char *name;
  const char *args;
  const char *help;
  int min_args, max_args;
  int (*run)(meshd_client_t *c, int argc, char **argv);
} command_t;

static const command_t commands[] = {
    {"health", "[SERVICE]",
     "grpc.health.v1 Check of SERVICE (default \"\": the server); prints SERVING, "
     "NOT_SERVING, ...",
     0, 1, cmd_health},
    {"agents", "", "table of the registered agents (drained ones say so)", 0, 0, cmd_agents},
    {"sessions", "",
     "table of the client sessions (age, live tensors, bytes held, commands); "
     "--watch [--interval S] [--count N] redraws it like top, with commands/s",
     0, 0, cmd_sessions},
    {"run", "FILE", "run a line-based script (FILE or - for stdin) in a new session", 1, 1,
     cmd_run},
    {"load", "URL",
     "the agents fetch a tensor from URL themselves (http, https, file; .npy, safetensors, "
     "a safetensors index with --name, or raw bytes with --dtype and --shape), in a new "
     "session: waits until every rank holds "
     "it, prints ref, dtype, shape, bytes, seconds and MB/s, then ends the session",
     1, 1, cmd_load},
    {"version", "", "meshctl's, the server's and every agent's version and build", 0, 0,
     cmd_version},
    {"drain", "RANK",
     "take RANK's agent out of placement before maintenance: sessions created from now on get "
     "no mesh on it, older ones keep it (admin)",
     1, 1, cmd_drain},
    {"undrain", "RANK", "put a drained agent back into placement (admin)", 1, 1, cmd_undrain},
};
#define NCOMMANDS (sizeof commands / sizeof commands[0])

/* "health, agents, ... or undrain" */
static const char *command_names(void) {
  static char buf[160];
  size_t used = 0;
  for (size_t i = 0; i < NCOMMANDS; i++)
    used += (size_t)snprintf(buf + used, sizeof buf - used, "%s%s",
                             i == 0 ? "" : i + 1 == NCOMMANDS ? " or " : ", ", commands[i].name);
  return buf;
}

static void usage(FILE *out) {
  fprintf(out, "usage: meshctl %s\n", SYNOPSIS);
  const char *help_flag = "-h, --help";
  int width = (int)strlen(help_flag);
  for (int i = 0; i < NFLAGS; i++) {
    int w = 2 + (int)(strlen(flags[i].name) + 1 + strlen(flags[i].metavar));
    width = w > width ? w : width;
  }
  for (int i = 0; i < NFLAGS; i++) {
    int w = 2 + (int)(strlen(flags[i].name) + 1 + strlen(flags[i].metavar));
    char env[64] = "", def[64] = "";
    if (flags[i].env)
      snprintf(env, sizeof env, "env %s", flags[i].env);
    if (flags[i].default_value)
      snprintf(def, sizeof def, "%sdefault %s", *env ? ", " : "", flags[i].default_value);
    fprintf(out, "  --%s %s%*s   %s%s%s%s%s\n", flags[i].name, flags[i].metavar, width - w, "",
            flags[i].help, *env || *def ? " (" : "", env, def, *env || *def ? ")" : "");
  }
  fprintf(out, "  %-*s   show this help\n", width, help_flag);
  fprintf(out, "commands:\n");
  for (size_t i = 0; i < NCOMMANDS; i++) {
    char head[64];
    snprintf(head, sizeof head, "%s %s", commands[i].name, commands[i].args);
    fprintf(out, "  %-18s %s\n", head, commands[i].help);
  }
  fprintf(out, "exit status: 0 ok (SERVING), 2 cannot connect, 3 call failed, "
               "4 not serving, 64 usage error, 1 other error\n");
}

/* ------------------------------------------------------------------ output */

/* Prints o as one line of JSON and frees it. */
static void print_json(json_object *o) {
  puts(json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN | JSON_C_TO_STRING_NOSLASHESCAPE));
  fflush(stdout);
  json_object_put(o);
}

/* The run's document (created on first use). */
static json_object *the_doc(void) {
  if (!doc)
    doc = json_object_new_object();
  return doc;
}

/* Length of the well-formed UTF-8 sequence at s (RFC 3629: no overlongs, no
 * surrogates, nothing past U+10FFFF), 0 when the bytes there are not one. */
static size_t utf8_seq(const unsigned char *s) {
  unsigned char c = s[0];
  size_t n = c < 0x80 ? 1 : c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3
                                                    : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
  if (n == 0)
    return 0;
  for (size_t i = 1; i < n; i++)
    if ((s[i] & 0xc0) != 0x80)
      return 0;
  if ((c == 0xe0 && s[1] < 0xa0) || (c == 0xed && s[1] > 0x9f) || (c == 0xf0 && s[1] < 0x90) ||
      (c == 0xf4 && s[1] > 0x8f))
    return 0;
  return n;
}

/* A JSON string of v (NULL: ""). JSON is UTF-8: a byte that is not part of a
 * well-formed sequence (a name or message from a hostile server or client)
 * becomes U+FFFD, so the document always parses. */
static json_object *json_str(const char *v) {
  const unsigned char *u = (const unsigned char *)(v ? v : "");
  size_t bad = 0;
  for (size_t i = 0, k; u[i]; i += k ? k : 1)
    if (!(k = utf8_seq(u + i)))
      bad++;
  if (!bad)
    return json_object_new_string((const char *)u);
  char *clean = malloc(strlen((const char *)u) + 2 * bad + 1), *p = clean;
  if (!clean)
    return json_object_new_string("");
  for (size_t i = 0, k; u[i]; i += k ? k : 1) {
    if ((k = utf8_seq(u + i))) {
      memcpy(p, u + i, k);
      p += k;
    } else {
      memcpy(p, "\xef\xbf\xbd", 3);
      p += 3;
    }
  }
  *p = '\0';
  json_object *o = json_object_new_string(clean);
  free(clean);
  return o;
}

static void put_str(json_object *o, const char *key, const char *v) {
  json_object_object_add(o, key, json_str(v));
}
static void put_u64(json_object *o, const char *key, uint64_t v) {
  json_object_object_add(o, key, json_object_new_uint64(v));
}
static void put_bool(json_object *o, const char *key, bool v) {
  json_object_object_add(o, key, json_object_new_boolean(v));
}

/* Records the run's first failure for the JSON document: code is a gRPC code
 * name ("NOT_FOUND", "UNAVAILABLE" for no connection) or "USAGE", "INTERNAL";
 * kind the server's error kind or NULL. */
static void note_error(const char *code, const char *kind, const char *message, long line) {
  if (!json_out || doc_error)
    return;
  doc_error = json_object_new_object();
  put_str(doc_error, "code", code);
  put_str(doc_error, "message", message);
  if (kind && *kind)
    put_str(doc_error, "kind", kind);
  if (line > 0)
    json_object_object_add(doc_error, "line", json_object_new_int64(line));
}

/* A usage error (exit 64): the message on stderr, a usage line after it. */
static int usage_error(bool show_usage, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int usage_error(bool show_usage, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fprintf(stderr, "meshctl: %s\n", msg);
  if (show_usage) /* a usage line, not the whole help: the problem stays in sight */
    fprintf(stderr, "usage: meshctl %s\nrun 'meshctl --help' for every flag and command\n",
            SYNOPSIS);
  note_error("USAGE", NULL, msg, 0);
  return EXIT_USAGE;
}

/* "error: WHAT: NOT_FOUND: unknown service" for the client's last failure. */
static int report(meshd_client_t *c, const char *what, meshd_err_t e) {
  const meshd_error_info_t *info = meshd_last_error(c);
  char msg[1024];
  if (e == MESHD_E_RPC || e == MESHD_E_DEADLINE) { /* a timeout is an RPC failure (exit 3) */
    fprintf(stderr, "error: %s: %s", what, info->grpc_code_name);
    if (*info->kind && strcmp(info->kind, info->grpc_code_name) != 0) /* not twice */
      fprintf(stderr, " (%s)", info->kind);
    if (*info->message)
      fprintf(stderr, ": %s", info->message);
    fputc('\n', stderr);
    snprintf(msg, sizeof msg, "%s: %s", what, info->message);
    note_error(info->grpc_code_name, info->kind, msg, 0);
    return EXIT_RPC;
  }
  fprintf(stderr, "error: %s: %s%s%s\n", what, meshd_strerror(e), *info->message ? ": " : "",
          info->message);
  snprintf(msg, sizeof msg, "%s: %s%s%s", what, meshd_strerror(e), *info->message ? ": " : "",
           info->message);
  note_error(e == MESHD_E_NOMEM ? "RESOURCE_EXHAUSTED" : "INTERNAL", NULL, msg, 0);
  return EXIT_FAILURE_OTHER;
}

static int cmd_health(meshd_client_t *c, int argc, char **argv) {
  int status = MESHD_HEALTH_UNKNOWN;
  const char *service = argc > 0 ? argv[0] : "";
  meshd_err_t e = meshd_health(c, service, &status);
  if (e != MESHD_E_OK)
    return report(c, "health check failed", e);
  if (json_out) {
    put_str(the_doc(), "service", service);
    put_str(doc, "status", meshd_health_name(status));
  } else {
    printf("%s\n", meshd_health_name(status));
  }
  return status == MESHD_HEALTH_SERVING ? EXIT_OK : EXIT_NOT_SERVING;
}

/* 16728371200 -> "15.6GiB"; below 1 KiB exact ("512B"). */
static void human_bytes(uint64_t bytes, char *buf, size_t len) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) {
    snprintf(buf, len, "%" PRIu64 "B", bytes);
    return;
  }
  double v = (double)bytes;
  size_t u = 0;
  /* 1023.96 MiB would print as "1024.0MiB": move up a unit before that. */
  while (v >= 1023.95 && u + 1 < sizeof units / sizeof units[0]) {
    v /= 1024.0;
    u++;
  }
  snprintf(buf, len, "%.1f%s", v, units[u]);
}

/* 93784000 ms -> "1d2h" ; "3m4s"; "12.3s". */
static void human_duration(uint64_t ms, char *buf, size_t len) {
  uint64_t s = ms / 1000;
  if (s < 60)
    snprintf(buf, len, "%.1fs", (double)ms / 1000.0);
  else if (s < 3600)
    snprintf(buf, len, "%" PRIu64 "m%" PRIu64 "s", s / 60, s % 60);
  else if (s < 86400)
    snprintf(buf, len, "%" PRIu64 "h%" PRIu64 "m", s / 3600, s / 60 % 60);
  else
    snprintf(buf, len, "%" PRIu64 "d%" PRIu64 "h", s / 86400, s / 3600 % 24);
}

static json_object *agent_json(const meshd_agent_t *a) {
  json_object *o = json_object_new_object();
  put_u64(o, "rank", a->rank);
  put_str(o, "address", a->address);
  put_str(o, "device", a->device);
  put_str(o, "agent_id", a->agent_id);
  put_u64(o, "memory_bytes", a->memory_bytes);
  put_u64(o, "allocated_bytes", a->allocated_bytes);
  put_bool(o, "healthy", a->healthy);
  put_bool(o, "drained", a->drained);
  put_str(o, "version", a->version);
  put_str(o, "commit", a->commit);
  put_str(o, "build_type", a->build_type);
  put_bool(o, "cuda", a->cuda);
  return o;
}

/* ListAgents' AgentTls, as `agents` shows it: how a direct-path client dials
 * the agent; null in plaintext. */
static json_object *agent_tls_json(const meshd_agent_t *a) {
  if (!a->tls_ca_pem)
    return NULL;
  json_object *t = json_object_new_object();
  put_str(t, "server_name", a->tls_server_name);
  put_str(t, "ca_pem", a->tls_ca_pem);
  return t;
}

/* The agents table's TLS cell: the name the agents' certificates carry; "on"
 * when the server sends the CA but no name (a direct-path client then checks
 * the agent's address), which left the cell blank; "-" in plaintext. */
static const char *agent_tls_cell(const meshd_agent_t *a) {
  if (!a->tls_ca_pem)
    return "-";
  return a->tls_server_name && *a->tls_server_name ? a->tls_server_name : "on";
}

static int cmd_agents(meshd_client_t *c, int argc, char **argv) {
  (void)argc;
  (void)argv;
  meshd_agent_t *agents = NULL;
  size_t n = 0;
  meshd_err_t e = meshd_agents(c, &agents, &n);
  if (e != MESHD_E_OK)
    return report(c, "listing agents failed", e);

  if (json_out) {
    json_object *list = json_object_new_array();
    for (size_t i = 0; i < n; i++) {
      json_object *o = agent_json(&agents[i]);
      json_object_object_add(o, "tls", agent_tls_json(&agents[i]));
      json_object_array_add(list, o);
    }
    json_object_object_add(the_doc(), "agents", list);
  } else {
    int w_addr = (int)strlen("ADDRESS"), w_dev = (int)strlen("DEVICE"), w_tls = (int)strlen("TLS");
    for (size_t i = 0; i < n; i++) {
      int a = (int)strlen(agents[i].address), d = (int)strlen(agents[i].device);
      int t = (int)strlen(agent_tls_cell(&agents[i]));
      w_addr = a > w_addr ? a : w_addr;
      w_dev = d > w_dev ? d : w_dev;
      w_tls = t > w_tls ? t : w_tls;
    }
    printf("%-5s %-*s %-*s %-9s %-9s %-7s %-7s %-*s %s\n", "RANK", w_addr, "ADDRESS", w_dev,
           "DEVICE", "MEMORY", "ALLOCATED", "HEALTHY", "DRAINED", w_tls, "TLS", "VERSION");
    for (size_t i = 0; i < n; i++) {
      char mem[32], alloc[32];
      human_bytes(agents[i].memory_bytes, mem, sizeof mem);
      human_bytes(agents[i].allocated_bytes, alloc, sizeof alloc);
      printf("%-5" PRIu32 " %-*s %-*s %-9s %-9s %-7s %-7s %-*s %s\n", agents[i].rank, w_addr,
             agents[i].address, w_dev, agents[i].device, mem, alloc,
             agents[i].healthy ? "yes" : "no", agents[i].drained ? "yes" : "no", w_tls,
             agent_tls_cell(&agents[i]), *agents[i].version ? agents[i].version : "-");
    }
  }
  if (n == 0)
    fprintf(stderr, "meshctl: no agents are registered with %s\n", server);
  meshd_agents_free(agents, n);
  return EXIT_OK;
}

/* ------------------------------------------------------------------ sessions */

/* The signal (SIGINT, SIGTERM) that came during --watch or a load's wait; 0: none. */
static volatile sig_atomic_t interrupted;

/* The first signal is noted for the loop in progress to stop at its next look
 * and close its session. A second one ends meshctl at once, with a line and
 * exit 128 + the signal: the first may be waiting on a call that does not
 * answer (a load's Execute, a CloseSession), and Ctrl-C again was swallowed
 * until that call's --timeout-ms. Only async-signal-safe calls here. */
static void on_interrupt(int sig) {
  if (interrupted) {
    static const char msg[] = "meshctl: interrupted again; exiting now (a session "
                              "not yet closed ends at its lease)\n";
    ssize_t w = write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)w;
    _exit(128 + sig);
  }
  interrupted = sig;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* What --watch remembers of the previous frame to compute commands/s. */
typedef struct seen {
  meshd_session_info_t *list;
  size_t n;
  double at; /* now_s() of its ListSessions */
} seen_t;

/* Commands per second since the previous frame; < 0 when the session is new. */
static double rate(const seen_t *prev, const meshd_session_info_t *si, double at) {
  for (size_t i = 0; prev && i < prev->n; i++)
    if (strcmp(prev->list[i].session_id, si->session_id) == 0 && at > prev->at)
      return si->commands >= prev->list[i].commands
                 ? (double)(si->commands - prev->list[i].commands) / (at - prev->at)
                 : 0.0;
  return -1.0;
}

/* idle_ms is 0 while a call of the session is in flight. */
static const char *session_state(const meshd_session_info_t *si) {
  return si->idle_ms == 0 ? "busy" : "idle";
}

static json_object *sessions_json(const meshd_session_info_t *list, size_t n, const seen_t *prev,
                                  double at) {
  json_object *arr = json_object_new_array();
  for (size_t i = 0; i < n; i++) {
    const meshd_session_info_t *si = &list[i];
    json_object *o = json_object_new_object();
    put_str(o, "session_id", si->session_id);
    put_str(o, "owner", si->owner);
    put_str(o, "client_name", si->client_name);
    put_u64(o, "age_ms", si->age_ms);
    put_u64(o, "idle_ms", si->idle_ms);
    put_u64(o, "live_tensors", si->live_tensors);
    put_u64(o, "bytes_held", si->bytes_held);
    put_u64(o, "commands", si->commands);
    put_u64(o, "queued_commands", si->queued_commands);
    put_str(o, "state", session_state(si));
    if (prev) {
      double r = rate(prev, si, at);
      json_object_object_add(o, "commands_per_s", r < 0 ? NULL : json_object_new_double(r));
    }
    json_object_array_add(arr, o);
  }
  return arr;
}

static void sessions_table(const meshd_session_info_t *list, size_t n, const seen_t *prev,
                           double at) {
  int w_client = (int)strlen("CLIENT"), w_owner = (int)strlen("OWNER");
  for (size_t i = 0; i < n; i++) {
    int l = (int)strlen(list[i].client_name), o = (int)strlen(list[i].owner);
    w_client = l > w_client ? l : w_client;
    w_owner = o > w_owner ? o : w_owner;
  }
  printf("%-12s %-*s %-*s %-8s %-8s %-10s %-9s %-8s %-6s %s\n", "SESSION", w_owner, "OWNER",
         w_client, "CLIENT", "AGE", "TENSORS", "HELD", "COMMANDS", "CMD/S", "STATE", "IDLE");
  for (size_t i = 0; i < n; i++) {
    const meshd_session_info_t *si = &list[i];
    char held[32], age[32], cps[32] = "-";
    human_bytes(si->bytes_held, held, sizeof held);
    human_duration(si->age_ms, age, sizeof age);
    double r = prev ? rate(prev, si, at) : -1.0;
    if (r >= 0)
      snprintf(cps, sizeof cps, "%.1f", r);
    printf("%-12.12s %-*s %-*s %-8s %-8" PRIu64 " %-10s %-9" PRIu64 " %-8s %-6s %.1fs\n",
           si->session_id, w_owner, si->owner, w_client, si->client_name, age, si->live_tensors,
           held, si->commands, cps, session_state(si), (double)si->idle_ms / 1000.0);
  }
}

/* Sleeps s seconds unless Ctrl-C comes first. */
static void nap(double s) {
  double until = now_s() + s;
  while (!interrupted) {
    double left = until - now_s();
    if (left <= 0)
      break;
    if (left > 0.1)
      left = 0.1;
    struct timespec ts = {0, (long)(left * 1e9)};
    nanosleep(&ts, NULL);
  }
}

/* sessions --watch: a frame every interval until --count frames or Ctrl-C
 * (exit 0 both). On a terminal the screen is cleared before each frame; else
 * frames follow each other, a blank line between them (JSON: one per line). */
static int watch_sessions(meshd_client_t *c) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_interrupt;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  bool tty = isatty(STDOUT_FILENO);
  seen_t prev = {NULL, 0, 0};
  int r = EXIT_OK;
  for (int64_t frame = 1; !interrupted && (watch_count == 0 || frame <= watch_count); frame++) {
    if (frame > 1)
      nap(watch_interval_s);
    if (interrupted)
      break;
    meshd_session_info_t *list = NULL;
    size_t n = 0;
    meshd_err_t e = meshd_sessions(c, &list, &n);
    double at = now_s();
    if (e != MESHD_E_OK) {
      r = interrupted ? EXIT_OK : report(c, "listing sessions failed", e);
      break;
    }
    struct timespec wall;
    clock_gettime(CLOCK_REALTIME, &wall);
    if (json_out) {
      json_object *o = json_object_new_object();
      json_object_object_add(o, "frame", json_object_new_int64(frame));
      put_u64(o, "unix_ms", (uint64_t)wall.tv_sec * 1000 + (uint64_t)wall.tv_nsec / 1000000);
      json_object_object_add(o, "sessions", sessions_json(list, n, frame > 1 ? &prev : NULL, at));
      print_json(o);
    } else {
      char when[32];
      struct tm tm;
      time_t t = wall.tv_sec;
      localtime_r(&t, &tm);
      strftime(when, sizeof when, "%H:%M:%S", &tm);
      if (tty)
        fputs("\033[H\033[2J", stdout);
      else if (frame > 1)
        fputc('\n', stdout);
      printf("meshd %s  %s  %zu session%s  (every %gs; Ctrl-C ends)\n", server, when, n,
             n == 1 ? "" : "s", watch_interval_s);
      sessions_table(list, n, frame > 1 ? &prev : NULL, at);
      fflush(stdout);
    }
    meshd_sessions_free(prev.list, prev.n);
    prev = (seen_t){list, n, at};
  }
  meshd_sessions_free(prev.list, prev.n);
  return r;
}

static int cmd_sessions(meshd_client_t *c, int argc, char **argv) {
  (void)argc;
  (void)argv;
  if (watch)
    return watch_sessions(c);
  meshd_session_info_t *list = NULL;
  size_t n = 0;
  meshd_err_t e = meshd_sessions(c, &list, &n);
  if (e != MESHD_E_OK)
    return report(c, "listing sessions failed", e);
  if (json_out)
    json_object_object_add(the_doc(), "sessions", sessions_json(list, n, NULL, 0));
  else
    sessions_table(list, n, NULL, 0);
  if (n == 0)
    fprintf(stderr, "meshctl: no sessions on %s\n", server);
  meshd_sessions_free(list, n);
  return EXIT_OK;
}

/* ------------------------------------------------------------------ version, drain */

static json_object *build_json(const char *version, const char *commit, const char *build_type,
                               bool cuda) {
  json_object *o = json_object_new_object();
  put_str(o, "version", version);
  put_str(o, "commit", commit);
  put_str(o, "build_type", build_type);
  put_bool(o, "cuda", cuda);
  return o;
}

/* meshctl's own build: the first line of `version`, all of --version. */
static void print_own_version(void) {
  const build_info_t *b = build_info();
  if (json_out)
    json_object_object_add(the_doc(), "client",
                           build_json(b->version, b->commit, b->build_type, b->cuda));
  else
    build_info_print(stdout, "meshctl");
  fflush(stdout);
}

static int cmd_version(meshd_client_t *c, int argc, char **argv) {
  (void)argc;
  (void)argv;
  meshd_server_info_t info;
  meshd_err_t e = meshd_server_info(c, &info);
  if (e != MESHD_E_OK)
    return report(c, "GetInfo failed", e);
  if (json_out) {
    json_object *srv = build_json(info.version, info.commit, info.build_type, info.cuda);
    put_str(srv, "address", server);
    put_u64(srv, "uptime_ms", info.uptime_ms);
    json_object_object_add(the_doc(), "server", srv);
    json_object *list = json_object_new_array();
    for (size_t i = 0; i < info.n_agents; i++) {
      const meshd_agent_t *a = &info.agents[i];
      json_object *o = build_json(a->version, a->commit, a->build_type, a->cuda);
      put_u64(o, "rank", a->rank);
      put_str(o, "agent_id", a->agent_id);
      put_str(o, "address", a->address);
      json_object_array_add(list, o);
    }
    json_object_object_add(doc, "agents", list);
  } else {
    char up[32];
    human_duration(info.uptime_ms, up, sizeof up);
    printf("meshd %s (commit %s, %s, cuda backend: %s) at %s, up %s\n", info.version,
           info.commit, info.build_type, info.cuda ? "yes" : "no", server, up);
    for (size_t i = 0; i < info.n_agents; i++) {
      const meshd_agent_t *a = &info.agents[i];
      if (*a->version && *a->commit)
        printf("rank %" PRIu32 ": meshd-agent %s (commit %s, %s, cuda backend: %s) at %s\n",
               a->rank, a->version, a->commit, a->build_type, a->cuda ? "yes" : "no", a->address);
      else
        printf("rank %" PRIu32 ": meshd-agent %s (build not reported) at %s\n", a->rank,
               *a->version ? a->version : "of unknown version", a->address);
    }
  }
  meshd_server_info_free(&info);
  return EXIT_OK;
}

/* RANK of drain/undrain: 0, or a usage error (exit 64), checked before connecting. */
static int parse_rank(const char *cmd, const char *arg, unsigned long long *v) {
  char *end;
  errno = 0;
  *v = strtoull(arg, &end, 10);
  if (!*arg || *end || errno || !isdigit((unsigned char)*arg) || *v > UINT32_MAX)
    return usage_error(false, "%s: RANK '%s' is not a rank (an integer >= 0; meshctl agents "
                       "lists them)", cmd, arg);
  return 0;
}

static int drain_or_undrain(meshd_client_t *c, const char *cmd, const char *arg, bool drain) {
  unsigned long long v;
  int bad = parse_rank(cmd, arg, &v);
  if (bad)
    return bad;
  meshd_agent_t *a = NULL;
  meshd_err_t e = meshd_drain_agent(c, (uint32_t)v, drain, &a);
  if (e != MESHD_E_OK) {
    char what[64];
    snprintf(what, sizeof what, "%s rank %llu failed", cmd, v);
    return report(c, what, e);
  }
  if (json_out) {
    put_u64(the_doc(), "rank", v);
    put_bool(doc, "drained", drain);
    if (a) /* none when the rank's agent is away */
      json_object_object_add(doc, "agent", agent_json(a));
  } else
    printf(drain ? "rank %llu drained: sessions created from now on get no mesh on it; older "
                   "sessions keep using it until they end\n"
                 : "rank %llu undrained: back in placement\n",
           v);
  meshd_agents_free(a, a ? 1 : 0);
  return EXIT_OK;
}

static int cmd_drain(meshd_client_t *c, int argc, char **argv) {
  (void)argc;
  return drain_or_undrain(c, "drain", argv[0], true);
}

static int cmd_undrain(meshd_client_t *c, int argc, char **argv) {
  (void)argc;
  return drain_or_undrain(c, "undrain", argv[0], false);
}

/* ------------------------------------------------------------------ run */

#define MAX_TOKENS 32
#define MAX_NAMES 256

typedef struct script {
  meshd_client_t *c;
  meshd_session_t *s;
  size_t nnames;
  char *names[MAX_NAMES];
  meshd_ref_t refs[MAX_NAMES];
  char kind[64];     /* the failure: "SYNTAX", a server kind or a gRPC code name */
  char message[640];
  char code[32];     /* its gRPC code name ("" for SYNTAX and the like) */
  json_object *results; /* --output json: what fetch lines gave (owned by the document) */
} script_t;

static int script_fail(script_t *sc, const char *kind, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int script_fail(script_t *sc, const char *kind, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(sc->message, sizeof sc->message, fmt, ap);
  va_end(ap);
  snprintf(sc->kind, sizeof sc->kind, "%s", kind);
  return -1;
}

/* Records the library's last error. */
static int script_lib_fail(script_t *sc, meshd_err_t e) {
  const meshd_error_info_t *info = meshd_last_error(sc->c);
  snprintf(sc->code, sizeof sc->code, "%s", info->grpc_code_name);
  const char *kind = *info->kind                          ? info->kind
                     : e == MESHD_E_RPC && *info->grpc_code_name ? info->grpc_code_name
                                                                  : meshd_strerror(e);
  return script_fail(sc, kind, "%s", info->message);
}

static bool lookup(const script_t *sc, const char *name, meshd_ref_t *ref) {
  for (size_t i = sc->nnames; i-- > 0;)
    if (strcmp(sc->names[i], name) == 0) {
      *ref = sc->refs[i];
      return true;
    }
  return false;
}

static int need_ref(script_t *sc, const char *name, meshd_ref_t *ref) {
  if (lookup(sc, name, ref))
    return 0;
  return script_fail(sc, "SYNTAX", "'%s' is not defined (bind it with '%s = ...' first)", name,
                     name);
}

static int bind(script_t *sc, const char *name, meshd_ref_t ref) {
  for (size_t i = 0; i < sc->nnames; i++)
    if (strcmp(sc->names[i], name) == 0) {
      sc->refs[i] = ref;
      return 0;
    }
  if (sc->nnames == MAX_NAMES)
    return script_fail(sc, "SYNTAX", "more than %d names", MAX_NAMES);
  sc->names[sc->nnames] = strdup(name);
  if (!sc->names[sc->nnames])
    return script_fail(sc, "NOMEM", "out of memory");
  sc->refs[sc->nnames++] = ref;
  return 0;
}

static bool is_ident(const char *s) {
  if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || *s == '_'))
    return false;
  for (; *s; s++)
    if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') ||
          *s == '_'))
      return false;
  return true;
}

static bool parse_int(const char *s, int64_t *v) {
  char *end;
  errno = 0;
  long long x = strtoll(s, &end, 10);
  if (!*s || *end || errno)
    return false;
  *v = x;
  return true;
}

static bool parse_float(const char *s, double *v) {
  char *end;
  errno = 0;
  double x = strtod(s, &end);
  if (!*s || *end || errno)
    return false;
  *v = x;
  return true;
}

/* "gpu=2" -> ("gpu", 2); the token is split in place. */
static int parse_dim(script_t *sc, char *tok, const char **name, int64_t *v) {
  char *eq = strchr(tok, '=');
  if (!eq || eq == tok)
    return script_fail(sc, "SYNTAX", "expected DIM=N, got '%s'", tok);
  *eq = '\0';
  *name = tok;
  if (!parse_int(eq + 1, v))
    return script_fail(sc, "SYNTAX", "'%s=%s': N must be an integer", tok, eq + 1);
  return 0;
}

static int parse_shape(script_t *sc, char **tok, int n, int64_t *shape) {
  for (int i = 0; i < n; i++)
    if (!parse_int(tok[i], &shape[i]))
      return script_fail(sc, "SYNTAX", "shape size '%s' is not an integer", tok[i]);
  return 0;
}

/* ------------------------------------------------------------------ progress */

/* One transfer's progress line on stderr: "\rfetch x: 12.0MiB / 64.0MiB  18%  45.1 MB/s",
 * redrawn at most 5 times a second once the transfer ran --progress-delay-ms, and
 * ended with a newline. Only when progress_on (stderr is a terminal). */
typedef struct progress {
  const char *what;
  double start, last; /* CLOCK_MONOTONIC seconds */
  bool shown;
  char note[96];      /* after the figures: "  (no answer from rank 1)"; "" none */
  bool note_changed;  /* redraw at the next call, however recent the last */
  bool ended;         /* the complete line is out: a load's last look, then its Sync's
                         call, drew it twice */
} progress_t;

/* meshd_wait_load_options_t.silent: the ranks the last look did not hear from. */
static void show_silent(void *user, const uint32_t *ranks, size_t n) {
  progress_t *p = user;
  char note[sizeof p->note] = "";
  size_t len = 0;
  for (size_t i = 0; i < n && len < sizeof note; i++) {
    int k = snprintf(note + len, sizeof note - len, "%s%u", i ? ", " : "  (no answer from rank ",
                     ranks[i]);
    len += k > 0 ? (size_t)k : 0;
  }
  if (n && len < sizeof note) snprintf(note + len, sizeof note - len, ")");
  if (strcmp(note, p->note) != 0) {
    snprintf(p->note, sizeof p->note, "%s", note);
    p->note_changed = true;
  }
}

/* "12.0MiB / 64.0MiB  18%  45.1 MB/s"; an empty tensor (total 0: the server
 * knows the size before the first look) "0B  done", not "0B / 0B 100%". The
 * percentage in floating point: done * 100 wrapped past 2^64 / 100 (a figure
 * the server sends) into a wrong or negative one. */
static void progress_figures(uint64_t done, uint64_t total, double ran, char *buf, size_t len) {
  char d[32], n[32];
  human_bytes(done, d, sizeof d);
  if (total == 0) {
    snprintf(buf, len, "%s  done", d);
    return;
  }
  human_bytes(total, n, sizeof n);
  int pct = 100;
  if (done < total) { /* 99% at most until it is in, however the double rounds */
    double x = (double)done * 100.0 / (double)total;
    pct = x < 99.0 ? (int)x : 99;
  }
  snprintf(buf, len, "%s / %s %3d%%  %.1f MB/s", d, n, pct,
           ran > 0 ? (double)done / ran / 1e6 : 0.0);
}

static void show_progress(void *user, uint64_t done, uint64_t total) {
  progress_t *p = user;
  if (p->ended)
    return;
  double t = now_s(), ran = t - p->start;
  bool late = ran * 1000.0 >= (double)progress_delay_ms;
  if (done == total) p->note[0] = '\0'; /* complete: nothing is missing */
  bool redraw = p->note_changed && late;
  p->note_changed = false;
  if (!redraw && (done < total ? !late || (p->shown && t - p->last < 0.2) : !late && !p->shown))
    return;
  char figures[128];
  progress_figures(done, total, ran, figures, sizeof figures);
  /* Not a terminal (--progress=true into a log): no escape to clear the line. */
  static int tty = -1;
  if (tty < 0)
    tty = isatty(STDERR_FILENO);
  fprintf(stderr, "\r%s: %s%s%s%s", p->what, figures, p->note, tty ? "\033[K" : "",
          done == total ? "\n" : "");
  fflush(stderr);
  p->shown = done < total;
  p->ended = done == total;
  p->last = t;
}

static int run_fetch(script_t *sc, char **tok, int ntok) {
  meshd_ref_t ref = 0;
  const char *dims[MAX_TOKENS];
  int64_t idx[MAX_TOKENS];
  if (ntok < 2)
    return script_fail(sc, "SYNTAX", "usage: fetch NAME [DIM=I ...]");
  if (need_ref(sc, tok[1], &ref) < 0)
    return -1;
  for (int i = 2; i < ntok; i++)
    if (parse_dim(sc, tok[i], &dims[i - 2], &idx[i - 2]) < 0)
      return -1;
  meshd_values_t v;
  char what[128];
  snprintf(what, sizeof what, "fetch %s", tok[1]);
  progress_t p = {what, now_s(), 0, false, "", false, false};
  meshd_fetch_options_t o = MESHD_FETCH_OPTIONS_INIT;
  if (progress_on) {
    o.progress = show_progress;
    o.progress_user = &p;
  }
  meshd_err_t e = meshd_session_fetch_with(sc->s, ref, dims, idx, (size_t)(ntok - 2), &o, &v);
  if (p.shown) /* a failure: the error goes on its own line */
    fputc('\n', stderr);
  if (e != MESHD_E_OK)
    return script_lib_fail(sc, e);
  if (json_out) {
    json_object *o = json_object_new_object(), *shape = json_object_new_array(),
                *values = json_object_new_array_ext((int)(v.n < INT32_MAX ? v.n : INT32_MAX));
    put_str(o, "fetch", tok[1]);
    /* The coordinates apart: a dim may be named "shape" or "values". */
    json_object *coords = json_object_new_object();
    for (int i = 2; i < ntok; i++)
      json_object_object_add(coords, dims[i - 2], json_object_new_int64(idx[i - 2]));
    json_object_object_add(o, "coords", coords);
    for (size_t i = 0; i < v.ndim; i++)
      json_object_array_add(shape, json_object_new_int64(v.shape[i]));
    /* JSON has no NaN or infinity: those go as the strings Python and
     * JavaScript print for them. */
    for (size_t i = 0; i < v.n; i++) {
      double x = v.values[i];
      json_object_array_add(values, isfinite(x) ? json_object_new_double(x)
                                    : json_object_new_string(isnan(x) ? "NaN"
                                                             : x > 0 ? "Infinity"
                                                                     : "-Infinity"));
    }
    json_object_object_add(o, "shape", shape);
    json_object_object_add(o, "values", values);
    json_object_array_add(sc->results, o);
  } else {
    printf("%s [", tok[1]);
    for (size_t i = 0; i < v.ndim; i++)
      printf("%s%" PRId64, i ? "," : "", v.shape[i]);
    printf("]");
    for (size_t i = 0; i < v.n; i++)
      printf(" %.17g", v.values[i]);
    printf("\n");
    fflush(stdout);
  }
  meshd_values_free(&v);
  return 0;
}

/* ------------------------------------------------------------------ load */

/* What a load asks: meshd_load_options_t with the storage its pointers need. */
typedef struct load_req {
  meshd_load_options_t o;
  int64_t shape[16];
  bool has_dim;
} load_req_t;

/* "1024,1024" (or "" for a scalar) into q's shape. */
static int parse_sizes(const char *text, int64_t *out, size_t max, size_t *n) {
  *n = 0;
  if (!*text)
    return 0;
  for (const char *p = text;; p++) {
    char *end;
    errno = 0;
    long long v = isdigit((unsigned char)*p) ? strtoll(p, &end, 10) : -1;
    if (v < 0 || errno || *n == max || (*end && *end != ','))
      return -1;
    out[(*n)++] = v;
    if (!*end)
      return 0;
    p = end;
  }
}

/* One option of a load: key "dtype", "shape", "name", "shard" or "dim"; `who`
 * names it in errors ("--shape", "shape="). q keeps pointers into value. */
static int load_option(load_req_t *q, const char *key, const char *value, const char *who,
                       char *err, size_t errlen) {
  if (strcmp(key, "dtype") == 0) {
    if (!*value) {
      snprintf(err, errlen, "%s: expected a dtype (float32, bfloat16, int64, ...)", who);
      return -1;
    }
    q->o.dtype = value;
  } else if (strcmp(key, "shape") == 0) {
    if (parse_sizes(value, q->shape, 16, &q->o.ndim) != 0) {
      snprintf(err, errlen, "%s: '%s' is not a shape (at most 16 sizes >= 0 with commas, "
               "e.g. 1024,1024; \"\" for a scalar)", who, value);
      return -1;
    }
    q->o.shape = q->shape;
  } else if (strcmp(key, "name") == 0) {
    q->o.name = value;
  } else if (strcmp(key, "shard") == 0) {
    q->o.shard = value;
  } else if (strcmp(key, "dim") == 0) {
    int64_t d = 0;
    if (parse_ms(who, value, 0, 15, &d, err, errlen) != 0)
      return -1;
    q->o.dim = (int)d;
    q->has_dim = true;
  } else {
    snprintf(err, errlen, "%s: unknown option (expected dtype, shape, name, shard or dim)", who);
    return -1;
  }
  return 0;
}

/* The checks across options; `pre` is "--" for flags, "" for script words. */
static int load_check(const load_req_t *q, const char *pre, char *err, size_t errlen) {
  if (!q->o.dtype != !q->o.shape)
    snprintf(err, errlen, "%s%s needs %sshape%s: raw bytes need both; give neither for .npy "
             "and safetensors files", pre, q->o.dtype ? "dtype" : "shape", pre,
             q->o.dtype ? "" : " with its dtype");
  else if (q->o.name && q->o.dtype)
    snprintf(err, errlen, "%sname picks a tensor of a safetensors file; raw bytes (%sdtype, "
             "%sshape) have none", pre, pre, pre);
  else if (q->has_dim && !q->o.shard)
    snprintf(err, errlen, "%sdim: the tensor dim to split needs %sshard DIM", pre, pre);
  else
    return 0;
  return -1;
}

/* meshd_session_load, then meshd_session_wait_load with the progress line
 * ("what: DONE / TOTAL ..."); *ref is set once the load is accepted. SIGINT
 * and SIGTERM meanwhile end the wait (MESHD_E_CANCELLED, `interrupted` says
 * which), so that the caller closes the session instead of leaving it to its
 * lease; the default handlers are back on return. */
static meshd_err_t load_and_wait(meshd_session_t *s, meshd_ref_t mesh, const char *url,
                                 load_req_t *q, const char *what, meshd_ref_t *ref) {
  progress_t p = {what, now_s(), 0, false, "", false, false};
  struct sigaction sa, old_int, old_term;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_interrupt;
  sigemptyset(&sa.sa_mask);
  interrupted = 0;
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
  meshd_err_t e = meshd_session_load(s, mesh, url, &q->o, ref);
  if (e == MESHD_E_OK && !interrupted) {
    meshd_wait_load_options_t w = MESHD_WAIT_LOAD_OPTIONS_INIT;
    w.stop = &interrupted;
    if (progress_on) {
      w.progress = show_progress;
      w.silent = show_silent;
      w.progress_user = &p;
    }
    e = meshd_session_wait_load(s, ref, 1, &w);
  }
  sigaction(SIGINT, &old_int, NULL);
  sigaction(SIGTERM, &old_term, NULL);
  if (p.shown) /* a failure: the error goes on its own line */
    fputc('\n', stderr);
  return interrupted ? MESHD_E_CANCELLED : e;
}

/* A load stopped by a signal, its session closed: one line, exit 128 + the
 * signal. */
static int load_interrupted(const char *what) {
  const char *name = interrupted == SIGTERM ? "SIGTERM" : "SIGINT";
  char msg[640];
  snprintf(msg, sizeof msg, "%s: interrupted by %s; the session is closed, the load abandoned",
           what, name);
  fprintf(stderr, "error: %s\n", msg);
  note_error("CANCELLED", NULL, msg, 0);
  return 128 + (interrupted == SIGTERM ? SIGTERM : SIGINT);
}

/* NAME = EXPR: a factory, an upload, a load, a reduce or an op call. */
static int run_assign(script_t *sc, const char *name, char **tok, int ntok) {
  meshd_err_t e;
  meshd_ref_t out = 0, in = 0;
  int64_t shape[MAX_TOKENS];
  const char *what = tok[0];

  if (!is_ident(name))
    return script_fail(sc, "SYNTAX", "'%s' is not a name", name);
  if (ntok < 1)
    return script_fail(sc, "SYNTAX", "nothing after '='");
  if (strcmp(what, "zeros") == 0 || strcmp(what, "ones") == 0 || strcmp(what, "empty") == 0 ||
      strcmp(what, "rand") == 0 || strcmp(what, "randn") == 0) {
    if (ntok < 2)
      return script_fail(sc, "SYNTAX", "usage: NAME = %s MESH [SIZE ...]", what);
    if (need_ref(sc, tok[1], &in) < 0 || parse_shape(sc, tok + 2, ntok - 2, shape) < 0)
      return -1;
    e = meshd_session_factory(sc->s, in, what, shape, (size_t)(ntok - 2), 0, &out);
  } else if (strcmp(what, "full") == 0) {
    double value;
    if (ntok < 3)
      return script_fail(sc, "SYNTAX", "usage: NAME = full MESH VALUE [SIZE ...]");
    if (need_ref(sc, tok[1], &in) < 0)
      return -1;
    if (!parse_float(tok[2], &value))
      return script_fail(sc, "SYNTAX", "full: VALUE '%s' is not a number", tok[2]);
    if (parse_shape(sc, tok + 3, ntok - 3, shape) < 0)
      return -1;
    e = meshd_session_factory(sc->s, in, "full", shape, (size_t)(ntok - 3), value, &out);
  } else if (strcmp(what, "tensor") == 0) { /* float32 values, the same on every rank */
    if (ntok < 3)
      return script_fail(sc, "SYNTAX", "usage: NAME = tensor MESH VALUE [VALUE ...]");
    if (need_ref(sc, tok[1], &in) < 0)
      return -1;
    float values[MAX_TOKENS];
    for (int i = 2; i < ntok; i++) {
      double v;
      if (!parse_float(tok[i], &v))
        return script_fail(sc, "SYNTAX", "tensor: VALUE '%s' is not a number", tok[i]);
      if (isfinite(v) && fabs(v) > FLT_MAX) /* (float)v would be undefined */
        return script_fail(sc, "SYNTAX", "tensor: VALUE '%s' is outside float32's range", tok[i]);
      values[i - 2] = (float)v;
    }
    int64_t n = ntok - 2; /* a few values: a Literal command (an upload where one predates it) */
    e = meshd_session_literal(sc->s, in, "float32", &n, 1, values, (size_t)n * sizeof *values,
                              NULL, &out);
  } else if (strcmp(what, "load") == 0) {
    load_req_t q;
    char err[256], label[128];
    memset(&q, 0, sizeof q);
    if (ntok < 3)
      return script_fail(sc, "SYNTAX", "usage: NAME = load MESH URL [dtype=T shape=N,N] "
                         "[name=NAME] [shard=DIM [dim=D]]");
    if (need_ref(sc, tok[1], &in) < 0)
      return -1;
    for (int i = 3; i < ntok; i++) {
      char *eq = strchr(tok[i], '=');
      if (!eq || eq == tok[i])
        return script_fail(sc, "SYNTAX", "load: expected KEY=VALUE (dtype, shape, name, shard, "
                           "dim), got '%s'", tok[i]);
      *eq = '\0';
      char who[64];
      snprintf(who, sizeof who, "load: %.40s=", tok[i]);
      if (load_option(&q, tok[i], eq + 1, who, err, sizeof err) != 0)
        return script_fail(sc, "SYNTAX", "%s", err);
    }
    if (load_check(&q, "", err, sizeof err) != 0)
      return script_fail(sc, "SYNTAX", "load: %s", err);
    snprintf(label, sizeof label, "load %.100s", name);
    e = load_and_wait(sc->s, in, tok[2], &q, label, &out);
    if (e == MESHD_E_CANCELLED) /* the script stops; its session is closed after */
      return script_fail(sc, "CANCELLED", "load: interrupted by %s",
                         interrupted == SIGTERM ? "SIGTERM" : "SIGINT");
  } else if (strcmp(what, "to_mesh") == 0) {
    meshd_ref_t mesh = 0;
    if (ntok != 3)
      return script_fail(sc, "SYNTAX", "usage: NAME = to_mesh INPUT MESH");
    if (need_ref(sc, tok[1], &in) < 0 || need_ref(sc, tok[2], &mesh) < 0)
      return -1;
    e = meshd_session_to_mesh(sc->s, in, mesh, &out);
  } else if (strcmp(what, "reduce") == 0) {
    if (ntok != 4)
      return script_fail(sc, "SYNTAX", "usage: NAME = reduce INPUT DIM|all REDUCTION");
    if (need_ref(sc, tok[1], &in) < 0)
      return -1;
    e = meshd_session_reduce(sc->s, in, strcmp(tok[2], "all") == 0 ? NULL : tok[2], tok[3], &out);
  } else {
    meshd_arg_t args[MAX_TOKENS];
    for (int i = 1; i < ntok; i++) {
      memset(&args[i - 1], 0, sizeof args[i - 1]);
      if (parse_int(tok[i], &args[i - 1].i)) {
        args[i - 1].type = MESHD_ARG_INT;
      } else if (parse_float(tok[i], &args[i - 1].f)) {
        args[i - 1].type = MESHD_ARG_FLOAT;
      } else {
        args[i - 1].type = MESHD_ARG_REF;
        if (need_ref(sc, tok[i], &args[i - 1].ref) < 0)
          return -1;
      }
    }
    e = meshd_session_call(sc->s, what, args, (size_t)(ntok - 1), &out);
  }
  if (e != MESHD_E_OK)
    return script_lib_fail(sc, e);
  return bind(sc, name, out);
}

/* A script's sync: Syncs of at most a second each until the work is done or
 * --timeout-ms is over, so that Ctrl-C (cmd_run's handler) ends the wait within
 * a second and the session is closed, not left to its lease. */
static meshd_err_t script_sync(meshd_session_t *s) {
  double end = now_s() + (double)timeout_ms / 1000.0;
  for (;;) {
    double left_ms = (end - now_s()) * 1000.0;
    int step = left_ms > 1000.0 ? 1000 : left_ms > 1.0 ? (int)left_ms : 1;
    meshd_err_t e = meshd_session_sync_timeout(s, step);
    if (e != MESHD_E_DEADLINE || interrupted || now_s() >= end)
      return e;
  }
}

static int run_line(script_t *sc, char *line) {
  char *hash = strchr(line, '#');
  if (hash)
    *hash = '\0';
  char *tok[MAX_TOKENS + 1];
  int ntok = 0;
  for (char *save = NULL, *t = strtok_r(line, " \t\r\n", &save); t;
       t = strtok_r(NULL, " \t\r\n", &save)) {
    if (ntok == MAX_TOKENS)
      return script_fail(sc, "SYNTAX", "more than %d words", MAX_TOKENS);
    tok[ntok++] = t;
  }
  if (ntok == 0)
    return 0;
  if (ntok >= 2 && strcmp(tok[1], "=") == 0)
    return run_assign(sc, tok[0], tok + 2, ntok - 2);
  if (strcmp(tok[0], "mesh") == 0) {
    const char *names[MAX_TOKENS];
    int64_t sizes[MAX_TOKENS];
    meshd_ref_t ref;
    if (ntok < 3 || !is_ident(tok[1]))
      return script_fail(sc, "SYNTAX", "usage: mesh NAME DIM=N [DIM=N ...]");
    for (int i = 2; i < ntok; i++)
      if (parse_dim(sc, tok[i], &names[i - 2], &sizes[i - 2]) < 0)
        return -1;
    meshd_err_t e = meshd_session_create_mesh(sc->s, names, sizes, (size_t)(ntok - 2), &ref);
    if (e != MESHD_E_OK)
      return script_lib_fail(sc, e);
    return bind(sc, tok[1], ref);
  }
  if (strcmp(tok[0], "fetch") == 0)
    return run_fetch(sc, tok, ntok);
  if (strcmp(tok[0], "stream") == 0) {
    meshd_ref_t ref;
    if (ntok != 2 || !is_ident(tok[1]))
      return script_fail(sc, "SYNTAX", "usage: stream NAME");
    meshd_err_t e = meshd_session_stream(sc->s, tok[1], &ref);
    if (e != MESHD_E_OK)
      return script_lib_fail(sc, e);
    return bind(sc, tok[1], ref);
  }
  if (strcmp(tok[0], "borrow") == 0) { /* borrow HANDLE BORROW INPUT STREAM [mutable] */
    meshd_ref_t in = 0, stream = 0, handle = 0, borrow = 0;
    bool is_mutable = ntok == 6 && strcmp(tok[5], "mutable") == 0;
    if ((ntok != 5 && !is_mutable) || !is_ident(tok[1]) || !is_ident(tok[2]))
      return script_fail(sc, "SYNTAX", "usage: borrow HANDLE BORROW INPUT STREAM [mutable]");
    if (need_ref(sc, tok[3], &in) < 0 || need_ref(sc, tok[4], &stream) < 0)
      return -1;
    meshd_err_t e = meshd_session_borrow(sc->s, in, stream, is_mutable, &handle, &borrow);
    if (e != MESHD_E_OK)
      return script_lib_fail(sc, e);
    return bind(sc, tok[1], handle) < 0 ? -1 : bind(sc, tok[2], borrow);
  }
  if (strcmp(tok[0], "drop_borrow") == 0) {
    meshd_ref_t b = 0;
    if (ntok != 2)
      return script_fail(sc, "SYNTAX", "usage: drop_borrow BORROW");
    if (need_ref(sc, tok[1], &b) < 0)
      return -1;
    meshd_err_t e = meshd_session_drop_borrow(sc->s, b);
    return e == MESHD_E_OK ? 0 : script_lib_fail(sc, e);
  }
  if (strcmp(tok[0], "drop") == 0 || strcmp(tok[0], "release") == 0) {
    meshd_ref_t refs[MAX_TOKENS] = {0};
    if (ntok < 2)
      return script_fail(sc, "SYNTAX", "usage: %s NAME [NAME ...]", tok[0]);
    for (int i = 1; i < ntok; i++)
      if (need_ref(sc, tok[i], &refs[i - 1]) < 0)
        return -1;
    meshd_err_t e = tok[0][0] == 'd' ? meshd_session_drop(sc->s, refs, (size_t)(ntok - 1))
                                     : meshd_session_release(sc->s, refs, (size_t)(ntok - 1));
    return e == MESHD_E_OK ? 0 : script_lib_fail(sc, e);
  }
  if (strcmp(tok[0], "sync") == 0) {
    if (ntok != 1)
      return script_fail(sc, "SYNTAX", "usage: sync");
    meshd_err_t e = script_sync(sc->s);
    if (e != MESHD_E_OK && interrupted)
      return script_fail(sc, "CANCELLED", "sync: interrupted by %s; the session is closed",
                         interrupted == SIGTERM ? "SIGTERM" : "SIGINT");
    if (e == MESHD_E_DEADLINE) { /* gRPC's "Deadline Exceeded" said neither whose nor what now */
      snprintf(sc->code, sizeof sc->code, "DEADLINE_EXCEEDED");
      return script_fail(sc, "DEADLINE_EXCEEDED",
                         "sync: the work was not done within --timeout-ms (%lld ms); a larger "
                         "--timeout-ms waits longer",
                         (long long)timeout_ms);
    }
    if (e != MESHD_E_OK)
      return script_lib_fail(sc, e);
    return 0;
  }
  return script_fail(sc, "SYNTAX",
                     "unknown command '%s' (expected mesh, stream, fetch, sync, borrow, "
                     "drop_borrow, drop, release or NAME = ...)", tok[0]);
}

static int cmd_run(meshd_client_t *c, int argc, char **argv) {
  if (argc != 1)
    return usage_error(false, "run: missing FILE (a script path, or - for stdin)");
  bool use_stdin = strcmp(argv[0], "-") == 0;
  FILE *f = use_stdin ? stdin : fopen(argv[0], "r");
  if (!f)
    return usage_error(false, "run: cannot open %s: %s", argv[0], strerror(errno));
  script_t sc;
  memset(&sc, 0, sizeof sc);
  sc.c = c;
  if (json_out) {
    sc.results = json_object_new_array();
    json_object_object_add(the_doc(), "results", sc.results);
  }
  meshd_err_t e = MESHD_E_OK;
  sc.s = meshd_session_open(c, "meshctl", &e);
  int r = EXIT_OK;
  /* SIGINT and SIGTERM stop the script after its line (a sync within a second),
   * and the session is closed below instead of left to its lease with its
   * tensors; a second signal ends meshctl at once (on_interrupt), a load's
   * wait and handler in between included. */
  struct sigaction sa, old_int, old_term;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_interrupt;
  sigemptyset(&sa.sa_mask);
  interrupted = 0;
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
  if (!sc.s) {
    r = report(c, "cannot open a session", e);
  } else {
    meshd_session_set_data_path(sc.s, data_path);
    char line[4096];
    for (long lineno = 1; fgets(line, sizeof line, f); lineno++) {
      size_t len = strlen(line);
      /* A full buffer without the newline: the line fits when its end comes next. */
      int next = len == sizeof line - 1 && line[len - 1] != '\n' ? getc(f) : '\n';
      if (next != '\n' && next != EOF)
        script_fail(&sc, "SYNTAX", "line longer than %zu characters", sizeof line - 1);
      else if (!interrupted && run_line(&sc, line) == 0 && !interrupted)
        continue;
      if (interrupted && strcmp(sc.kind, "CANCELLED") != 0) {
        sc.code[0] = '\0';
        script_fail(&sc, "CANCELLED", "interrupted by %s; the session is closed",
                    interrupted == SIGTERM ? "SIGTERM" : "SIGINT");
      }
      fprintf(stderr, "line %ld: %s: %s\n", lineno, sc.kind, sc.message);
      /* A load a signal ended stops the script as the standalone load does. */
      bool cut = interrupted && strcmp(sc.kind, "CANCELLED") == 0;
      note_error(*sc.code ? sc.code : cut ? "CANCELLED" : "INVALID_ARGUMENT", sc.kind, sc.message,
                 lineno);
      r = cut ? 128 + (interrupted == SIGTERM ? SIGTERM : SIGINT) : EXIT_RPC;
      break;
    }
    if (r == EXIT_OK && interrupted) { /* while reading the script (stdin) */
      const char *sig = interrupted == SIGTERM ? "SIGTERM" : "SIGINT";
      char msg[128];
      snprintf(msg, sizeof msg, "interrupted by %s; the session is closed", sig);
      fprintf(stderr, "meshctl: run: %s\n", msg);
      note_error("CANCELLED", NULL, msg, 0);
      r = 128 + (interrupted == SIGTERM ? SIGTERM : SIGINT);
    } else if (r == EXIT_OK && ferror(f)) {
      fprintf(stderr, "meshctl: run: reading %s failed\n", argv[0]);
      note_error("INTERNAL", NULL, "reading the script failed", 0);
      r = EXIT_FAILURE_OTHER;
    }
  }
  meshd_session_close(sc.s);
  sigaction(SIGINT, &old_int, NULL);
  sigaction(SIGTERM, &old_term, NULL);
  for (size_t i = 0; i < sc.nnames; i++)
    free(sc.names[i]);
  if (!use_stdin)
    fclose(f);
  return r;
}

/* --mesh "gpu=2,host=4" into names and sizes (text is copied into buf). */
static int parse_mesh(const char *text, char *buf, size_t buflen, const char **names,
                      int64_t *sizes, size_t *n) {
  snprintf(buf, buflen, "%s", text);
  *n = 0;
  for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
    char *eq = strchr(t, '=');
    if (*n == 16 || !eq)
      return -1;
    *eq = '\0';
    if (!is_ident(t) || !parse_int(eq + 1, &sizes[*n]) || sizes[*n] < 1)
      return -1;
    names[(*n)++] = t;
  }
  return *n ? 0 : -1;
}

/* A failed load: exit 3, as a failed call. The library's own refusals (a name
 * the file lacks) come without a gRPC code: INVALID_ARGUMENT. */
static int load_failed(meshd_client_t *c, const char *what, meshd_err_t e) {
  if (e != MESHD_E_INVALID)
    return report(c, what, e);
  const meshd_error_info_t *info = meshd_last_error(c);
  char msg[1024];
  fprintf(stderr, "error: %s: %s\n", what, info->message);
  snprintf(msg, sizeof msg, "%s: %s", what, info->message);
  note_error("INVALID_ARGUMENT", NULL, msg, 0);
  return EXIT_RPC;
}

static int cmp_u32(const void *a, const void *b) {
  uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
  return (x > y) - (x < y);
}

/* meshctl load's flags, checked before it connects (load_flags). */
static load_req_t load_q;
static const char *load_dims[16];
static int64_t load_sizes[16];
static size_t load_ndims; /* 0: every healthy, undrained agent */
static char load_mesh_buf[256];

static int load_flags(char *err, size_t errlen) {
  char who[32];
  for (int f = FLAG_DTYPE; f <= FLAG_DIM; f++) {
    snprintf(who, sizeof who, "--%s", flags[f].name);
    if (load_given[f] && load_option(&load_q, flags[f].name, load_given[f], who, err, errlen))
      return -1;
  }
  if (load_check(&load_q, "--", err, errlen) != 0)
    return -1;
  if (load_given[FLAG_MESH] && parse_mesh(load_given[FLAG_MESH], load_mesh_buf,
                                          sizeof load_mesh_buf, load_dims, load_sizes,
                                          &load_ndims) != 0) {
    snprintf(err, errlen, "--mesh: '%s' is not a mesh (DIM=N with N >= 1, comma-separated, "
             "e.g. gpu=4 or host=2,gpu=4)", load_given[FLAG_MESH]);
    return -1;
  }
  return 0;
}

static int cmd_load(meshd_client_t *c, int argc, char **argv) {
  (void)argc;
  const char *url = argv[0];
  char shown[512], what[560];
  const char **names = load_dims;
  int64_t *sizes = load_sizes;
  size_t ndims = load_ndims;
  if (!ndims) { /* every agent that would take a mesh now */
    meshd_agent_t *agents = NULL;
    size_t n = 0, up = 0;
    meshd_err_t e = meshd_agents(c, &agents, &n);
    if (e != MESHD_E_OK)
      return report(c, "load: listing agents failed", e);
    /* A mesh takes consecutive ranks (the server places it on a run of
     * usable ones): the longest run, not every usable agent. */
    /* The usable ranks sorted (not an array indexed by rank: a rank is the
     * server's to say, and 0xffffffff wrapped a bound to 0). */
    uint32_t *usable = calloc(n ? n : 1, sizeof *usable);
    if (!usable) {
      meshd_agents_free(agents, n);
      fprintf(stderr, "error: load: out of memory\n");
      note_error("RESOURCE_EXHAUSTED", NULL, "load: out of memory", 0);
      return EXIT_FAILURE_OTHER;
    }
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
      if (agents[i].healthy && !agents[i].drained)
        usable[k++] = agents[i].rank;
    qsort(usable, k, sizeof *usable, cmp_u32);
    for (size_t i = 0, run = 0; i < k; i++) {
      if (i > 0 && usable[i] == usable[i - 1])
        continue; /* listed twice: one rank */
      run = i > 0 && usable[i] == usable[i - 1] + 1 ? run + 1 : 1;
      if (run > up)
        up = run;
    }
    free(usable);
    meshd_agents_free(agents, n);
    if (up == 0) {
      fprintf(stderr, "error: load: no healthy, undrained agent on %s to load onto "
              "(meshctl agents lists them)\n", server);
      /* A refused command (exit 3), not UNAVAILABLE: that code says "could not connect". */
      note_error("FAILED_PRECONDITION", NULL,
                 "load: no healthy, undrained agent to load onto (meshctl agents lists them)", 0);
      return EXIT_RPC;
    }
    names[0] = "gpu";
    sizes[0] = (int64_t)up;
    ndims = 1;
  }
  uint64_t ranks = 1;
  for (size_t i = 0; i < ndims; i++)
    ranks *= (uint64_t)sizes[i];
  conn_redact_url(url, shown, sizeof shown);
  snprintf(what, sizeof what, "load %s", shown);

  meshd_err_t e = MESHD_E_OK;
  meshd_session_t *s = meshd_session_open(c, "meshctl", &e);
  if (!s)
    return report(c, "cannot open a session", e);
  meshd_ref_t mesh = 0, ref = 0;
  meshd_load_info_t info;
  load_q.o.info = &info;
  int r = EXIT_OK;
  e = meshd_session_create_mesh(s, names, sizes, ndims, &mesh);
  if (e != MESHD_E_OK) {
    r = report(c, "load: creating the mesh failed", e);
    goto out;
  }
  const char *base = strrchr(shown, '/');
  char label[128];
  snprintf(label, sizeof label, "load %.100s", base && base[1] ? base + 1 : shown);
  double t0 = now_s();
  e = load_and_wait(s, mesh, url, &load_q, label, &ref);
  double secs = now_s() - t0;
  if (e == MESHD_E_CANCELLED) {
    meshd_session_close(s); /* first: the line says it is closed */
    s = NULL;
    r = load_interrupted(what);
    goto out;
  }
  if (e != MESHD_E_OK) {
    r = load_failed(c, what, e);
    goto out;
  }
  uint64_t fetched; /* sizes a server sends: capped at UINT64_MAX ("16.0EiB"), not wrapped */
  if (__builtin_mul_overflow(info.bytes, ranks, &fetched))
    fetched = UINT64_MAX;
  double mbps = secs > 0 ? (double)fetched / secs / 1e6 : 0.0;
  char shape[16 * 21 + 3] = "[";
  size_t used = 1;
  for (size_t i = 0; i < info.ndim; i++)
    used += (size_t)snprintf(shape + used, sizeof shape - used, "%s%" PRId64, i ? "," : "",
                             info.shape[i]);
  snprintf(shape + used, sizeof shape - used, "]");
  if (json_out) {
    json_object *o = the_doc(), *sh = json_object_new_array(), *m = json_object_new_object();
    put_str(o, "url", shown);
    put_u64(o, "ref", ref);
    put_str(o, "dtype", info.dtype);
    for (size_t i = 0; i < info.ndim; i++)
      json_object_array_add(sh, json_object_new_int64(info.shape[i]));
    json_object_object_add(o, "shape", sh);
    for (size_t i = 0; i < ndims; i++)
      json_object_object_add(m, names[i], json_object_new_int64(sizes[i]));
    json_object_object_add(o, "mesh", m);
    put_u64(o, "bytes", info.bytes);
    put_u64(o, "ranks", ranks);
    put_u64(o, "fetched_bytes", fetched);
    json_object_object_add(o, "seconds", json_object_new_double(secs));
    json_object_object_add(o, "mb_per_s", json_object_new_double(mbps));
  } else {
    char b[32], f[32];
    human_bytes(info.bytes, b, sizeof b);
    human_bytes(fetched, f, sizeof f);
    int w_shape = (int)strlen(shape) > 5 ? (int)strlen(shape) : 5;
    printf("%-5s %-9s %-*s %-9s %-5s %-9s %-8s %-8s %s\n", "REF", "DTYPE", w_shape, "SHAPE",
           "BYTES", "RANKS", "FETCHED", "SECONDS", "MB/S", "URL");
    printf("%-5" PRIu64 " %-9s %-*s %-9s %-5" PRIu64 " %-9s %-8.3f %-8.1f %s\n", ref, info.dtype,
           w_shape, shape, b, ranks, f, secs, mbps, shown);
  }
out:
  meshd_session_close(s);
  return r;
}

/* -h/--help: for people, on stdout; under --output json, which promises one
 * JSON document on stdout for every invocation, {"usage": TEXT} there and the
 * text for people on stderr (docs/operations.md). */
static void help(void) {
  if (!json_out) {
    usage(stdout);
    return;
  }
  char *text = NULL;
  size_t len = 0;
  FILE *mem = open_memstream(&text, &len);
  if (mem) {
    usage(mem);
    fclose(mem);
  }
  usage(stderr);
  json_object_object_add(the_doc(), "usage", json_object_new_string(text ? text : ""));
  free(text);
}

static int run(int argc, char **argv) {
  char err[256];
  int npos = 0;

  if (parse_output(argc, argv, err, sizeof err) != 0) { /* how to print the rest */
    if (help_follows(1, argc, argv)) {
      usage(stdout);
      return EXIT_OK;
    }
    return usage_error(true, "%s", err);
  }
  int r = parse_flags(argc, argv, &npos, err, sizeof err);
  if (r == 1) {
    help();
    return EXIT_OK;
  }
  if (r < 0)
    return usage_error(true, "%s", err);
  if (show_version) {
    print_own_version();
    return EXIT_OK;
  }
  if (npos == 0)
    return usage_error(true, "missing COMMAND (one of: %s)", command_names());
  const command_t *cmd = NULL;
  for (size_t i = 0; i < NCOMMANDS && !cmd; i++)
    if (strcmp(argv[1], commands[i].name) == 0)
      cmd = &commands[i];
  if (!cmd)
    return usage_error(true, "unknown command '%s' (expected one of: %s)", argv[1],
                       command_names());
  int nargs = npos - 1;
  if (nargs > cmd->max_args)
    return usage_error(true, "%s: unexpected argument '%s' (usage: meshctl %s%s%s)", cmd->name,
                       argv[2 + cmd->max_args], cmd->name, *cmd->args ? " " : "", cmd->args);
  if (nargs < cmd->min_args)
    return usage_error(true, "%s: missing %s (usage: meshctl %s %s)", cmd->name,
                       cmd->run == cmd_run    ? "FILE (a script path, or - for stdin)"
                       : cmd->run == cmd_load ? "URL (http://, https:// or file://)"
                                              : cmd->args,
                       cmd->name, cmd->args);
  if (watch_flag_given && cmd->run != cmd_sessions)
    return usage_error(true, "--%s: only `meshctl sessions` takes it, not %s", watch_flag_given,
                       cmd->name);
  if (watch_flag_given && !watch)
    return usage_error(true, "--%s: needs --watch", watch_flag_given);
  if (load_flag_given && cmd->run != cmd_load)
    return usage_error(true, "--%s: only `meshctl load` takes it, not %s", load_flag_given,
                       cmd->name);
  if (cmd->run == cmd_load && load_flags(err, sizeof err) != 0)
    return usage_error(false, "load: %s", err);
  if (!server || !*server)
    return usage_error(true, "--server: empty address (expected host:port)");
  /* A script that cannot be read is the caller's mistake, whatever the server. */
  if (cmd->run == cmd_run && strcmp(argv[2], "-") != 0 && access(argv[2], R_OK) != 0)
    return usage_error(false, "run: cannot open %s: %s", argv[2], strerror(errno));
  /* So is a mistyped RANK: exit 64 at once, not "cannot connect" first. */
  unsigned long long rank;
  if ((cmd->run == cmd_drain || cmd->run == cmd_undrain) && parse_rank(cmd->name, argv[2], &rank))
    return EXIT_USAGE;
  if (cmd->run == cmd_version)
    print_own_version();

  meshd_err_t e = MESHD_E_OK;
  char why[512];
  meshd_client_t *c = meshd_connect_with(server, &conn, &e, why, sizeof why);
  if (!c) {
    if (e == MESHD_E_CONNECT) {
      fprintf(stderr, "error: cannot connect: %s\n", why);
      note_error("UNAVAILABLE", NULL, why, 0);
      return EXIT_CONNECT;
    }
    if (e == MESHD_E_INVALID) /* an option meshctl was given: the plaintext-token rule */
      return usage_error(false, "%s", why);
    fprintf(stderr, "error: %s\n", why);
    note_error("INTERNAL", NULL, why, 0);
    return EXIT_FAILURE_OTHER;
  }
  r = cmd->run(c, nargs, argv + 2);
  meshd_close(c);
  return r;
}

int main(int argc, char **argv) {
  meshd_global_init();
  int r = run(argc, argv);
  explicit_bzero(token_buf, sizeof token_buf);
  if (doc_error)
    json_object_object_add(the_doc(), "error", doc_error);
  if (doc) /* --output json and not --watch: the run's one document */
    print_json(doc);
  fflush(stdout);
  meshd_global_shutdown();
  return r;
}
