#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define ENV_PREFIX "MESHD_"
#define ENV_NAME_MAX 128

static void set_err(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void set_err(char *err, size_t errlen, const char *fmt, ...) {
  if (!err || errlen == 0)
    return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, errlen, fmt, ap);
  va_end(ap);
}

/* "drain-seconds" -> "MESHD_DRAIN_SECONDS". false if it does not fit. */
static bool env_name(const char *flag, char *out, size_t outlen) {
  size_t plen = strlen(ENV_PREFIX);
  if (plen + strlen(flag) + 1 > outlen)
    return false;
  memcpy(out, ENV_PREFIX, plen);
  for (size_t i = 0; flag[i]; i++)
    out[plen + i] = flag[i] == '-' ? '_' : (char)toupper((unsigned char)flag[i]);
  out[plen + strlen(flag)] = '\0';
  return true;
}

bool config_parse_bytes(const char *text, uint64_t *out) {
  if (!text || !isdigit((unsigned char)*text))
    return false;
  uint64_t v = 0;
  const char *p = text;
  for (; isdigit((unsigned char)*p); p++) {
    unsigned d = (unsigned)(*p - '0');
    if (v > (UINT64_MAX - d) / 10)
      return false;
    v = v * 10 + d;
  }
  static const char units[] = "KMGTPE";
  unsigned shift = 0;
  if (*p) {
    const char *u = strchr(units, toupper((unsigned char)*p));
    if (u) {
      shift = 10 * (unsigned)(u - units + 1);
      p++;
      if (strcasecmp(p, "iB") == 0)
        p += 2;
    } else if (strcasecmp(p, "B") == 0) {
      p++;
    }
  }
  if (*p)
    return false;
  if (shift && v > (UINT64_MAX >> shift))
    return false;
  if (out)
    *out = v << shift;
  return true;
}

static bool parse_bool(const char *text, bool *out) {
  static const char *const yes[] = {"true", "1", "yes"};
  static const char *const no[] = {"false", "0", "no"};
  for (size_t i = 0; i < sizeof yes / sizeof yes[0]; i++) {
    if (strcasecmp(text, yes[i]) == 0) {
      *out = true;
      return true;
    }
    if (strcasecmp(text, no[i]) == 0) {
      *out = false;
      return true;
    }
  }
  return false;
}

static bool out_of_range(const config_flag_t *f, double v) {
  return f->min != f->max && (v < f->min || v > f->max);
}

/* Converts `text` into f->target. `who` names the source in errors:
 * "--threads", "MESHD_THREADS". */
static int apply(const config_flag_t *f, const char *who, const char *text, char *err,
                 size_t errlen) {
  char *end;
  switch (f->type) {
  case CONFIG_STRING:
    *(const char **)f->target = text;
    return 0;
  case CONFIG_INT: {
    if (!*text || isspace((unsigned char)*text))
      goto not_int;
    errno = 0;
    long long v = strtoll(text, &end, 10);
    if (*end)
      goto not_int;
    if (errno == ERANGE) {
      set_err(err, errlen, "%s: '%s' is out of range", who, text);
      return -1;
    }
    if (out_of_range(f, (double)v)) {
      set_err(err, errlen, "%s: %lld is out of range [%.0f, %.0f]", who, v, f->min, f->max);
      return -1;
    }
    *(int64_t *)f->target = (int64_t)v;
    return 0;
  not_int:
    set_err(err, errlen, "%s: '%s' is not an integer", who, text);
    return -1;
  }
  case CONFIG_DOUBLE: {
    double v = 0;
    if (*text && !isspace((unsigned char)*text)) {
      errno = 0;
      v = strtod(text, &end);
    }
    if (!*text || isspace((unsigned char)*text) || *end || !isfinite(v) || errno == ERANGE) {
      set_err(err, errlen, "%s: '%s' is not a number", who, text);
      return -1;
    }
    if (out_of_range(f, v)) {
      set_err(err, errlen, "%s: %g is out of range [%g, %g]", who, v, f->min, f->max);
      return -1;
    }
    *(double *)f->target = v;
    return 0;
  }
  case CONFIG_BOOL:
    if (!parse_bool(text, (bool *)f->target)) {
      set_err(err, errlen, "%s: '%s' is not a boolean (true/false/1/0/yes/no)", who, text);
      return -1;
    }
    return 0;
  case CONFIG_BYTES:
    if (!config_parse_bytes(text, (uint64_t *)f->target)) {
      set_err(err, errlen, "%s: '%s' is not a byte size (e.g. 512, 4KiB, 8GiB)", who, text);
      return -1;
    }
    return 0;
  }
  set_err(err, errlen, "--%s: unknown flag type %d", f->name, (int)f->type);
  return -1;
}

static const config_flag_t *find_flag(const config_flag_t *flags, size_t nflags,
                                      const char *name, size_t len) {
  for (size_t i = 0; i < nflags; i++)
    if (strlen(flags[i].name) == len && strncmp(flags[i].name, name, len) == 0)
      return &flags[i];
  return NULL;
}

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

int config_parse(const config_flag_t *flags, size_t nflags, int argc, char **argv,
                 int *npositional, char *err, size_t errlen) {
  int ret = -1;
  int npos = 0;
  /* Per flag, the last value given on the command line (or NULL). */
  const char **given = calloc(nflags ? nflags : 1, sizeof *given);
  if (!given) {
    set_err(err, errlen, "out of memory");
    return -1;
  }
  if (err && errlen)
    err[0] = '\0';

  bool rest_positional = false;
  for (int i = 1; i < argc; i++) {
    char *arg = argv[i];
    if (rest_positional || strncmp(arg, "--", 2) != 0) {
      if (!rest_positional && strcmp(arg, "-h") == 0) {
        ret = 1;
        goto out;
      }
      argv[1 + npos++] = arg;
      continue;
    }
    if (arg[2] == '\0') {
      rest_positional = true;
      continue;
    }
    if (strcmp(arg, "--help") == 0) {
      ret = 1;
      goto out;
    }
    if (strcmp(arg, "--version") == 0) {
      ret = 2;
      goto out;
    }
    const char *name = arg + 2;
    const char *eq = strchr(name, '=');
    size_t name_len = eq ? (size_t)(eq - name) : strlen(name);
    const config_flag_t *f = find_flag(flags, nflags, name, name_len);
    if (!f) {
      set_err(err, errlen, "--%.*s: unknown flag", (int)name_len, name);
      ret = help_follows(i + 1, argc, argv) ? 1 : -1;
      goto out;
    }
    const char *value;
    if (eq) {
      value = eq + 1;
    } else if (f->type == CONFIG_BOOL) {
      value = "true";
    } else if (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) {
      value = argv[++i];
    } else {
      set_err(err, errlen, "--%s: needs a value", f->name);
      ret = help_follows(i + 1, argc, argv) ? 1 : -1;
      goto out;
    }
    given[f - flags] = value;
  }

  for (size_t k = 0; k < nflags; k++) {
    const config_flag_t *f = &flags[k];
    char who[ENV_NAME_MAX + 2];
    const char *value = given[k];
    if (value) {
      snprintf(who, sizeof who, "--%s", f->name);
    } else {
      if (!env_name(f->name, who, sizeof who)) {
        set_err(err, errlen, "--%s: flag name too long", f->name);
        goto out;
      }
      value = getenv(who);
      /* An empty variable counts as unset. */
      if (!value || !*value) {
        value = f->default_value;
        snprintf(who, sizeof who, "--%s (default)", f->name);
      }
    }
    if (value && apply(f, who, value, err, errlen) != 0)
      goto out;
  }
  ret = 0;
  if (1 + npos < argc)
    argv[1 + npos] = NULL;

out:
  if (ret == 1 && err && errlen)
    err[0] = '\0';
  if (npositional)
    *npositional = npos;
  free(given);
  return ret;
}

static const char *metavar(config_type_t type) {
  switch (type) {
  case CONFIG_STRING:
    return "VALUE";
  case CONFIG_INT:
    return "N";
  case CONFIG_DOUBLE:
    return "X";
  case CONFIG_BYTES:
    return "BYTES";
  case CONFIG_BOOL:
    break;
  }
  return NULL;
}

void config_usage_line(FILE *out, const char *prog, const char *synopsis) {
  fprintf(out, "usage: %s %s\nrun '%s --help' for every flag\n", prog, synopsis, prog);
}

void config_usage(FILE *out, const char *prog, const char *synopsis,
                  const config_flag_t *flags, size_t nflags) {
  if (synopsis && *synopsis)
    fprintf(out, "usage: %s %s\n", prog, synopsis);
  else
    fprintf(out, "usage: %s\n", prog);

  const char *help_flag = "-h, --help";
  int width = (int)strlen(help_flag);
  for (size_t i = 0; i < nflags; i++) {
    const char *mv = metavar(flags[i].type);
    int w = 2 + (int)strlen(flags[i].name) + (mv ? 1 + (int)strlen(mv) : 0);
    if (w > width)
      width = w;
  }
  for (size_t i = 0; i < nflags; i++) {
    const config_flag_t *f = &flags[i];
    const char *mv = metavar(f->type);
    char env[ENV_NAME_MAX];
    int w = 2 + (int)strlen(f->name) + (mv ? 1 + (int)strlen(mv) : 0);
    fprintf(out, "  --%s%s%s%*s   %s", f->name, mv ? " " : "", mv ? mv : "", width - w, "",
            f->help ? f->help : "");
    const char *sep = f->help && *f->help ? " " : "";
    const char *def = f->default_value;
    if (def && !*def)
      def = "\"\"";
    if (env_name(f->name, env, sizeof env))
      fprintf(out, "%s(env %s%s%s)", sep, env, def ? ", default " : "", def ? def : "");
    else if (def)
      fprintf(out, "%s(default %s)", sep, def);
    fputc('\n', out);
  }
  fprintf(out, "  %-*s   show this help\n", width, help_flag);
  fprintf(out, "  %-*s   print the version and exit\n", width, "--version");
}
