/* Flags and MESHD_* environment variables from one table.
 *
 * Each program describes its options once, as an array of config_flag_t. A flag
 * `--drain-seconds 5` (or `--drain-seconds=5`) may also be given as the
 * environment variable MESHD_DRAIN_SECONDS=5. Precedence: command line, then
 * environment, then the table's default. Strings are not copied: targets point
 * into argv, the environment or the table, which outlive the program's use. */
#ifndef MESHD_CONFIG_H
#define MESHD_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef enum {
  CONFIG_STRING, /* target: const char ** */
  CONFIG_INT,    /* target: int64_t *, checked against [min, max] */
  CONFIG_DOUBLE, /* target: double *, checked against [min, max] */
  CONFIG_BOOL,   /* target: bool *; "--flag" alone means true; values true/false/1/0/yes/no */
  CONFIG_BYTES,  /* target: uint64_t *; "512", "4KiB", "4MiB", "8GiB", "1K", "2M", "3G" */
} config_type_t;

typedef struct config_flag {
  const char *name;          /* "drain-seconds": --drain-seconds, MESHD_DRAIN_SECONDS */
  config_type_t type;
  const char *default_value; /* as it would be written on the command line; NULL = unset */
  const char *help;
  void *target;
  double min, max;           /* CONFIG_INT and CONFIG_DOUBLE; min == max means unchecked */
} config_flag_t;

/* Parses argv[1..argc) against the table, then the environment, then defaults.
 * Positional arguments (anything not starting with "--", and everything after a
 * lone "--") are moved to argv[1..] in order and their count stored in *npositional;
 * on success argv[1 + *npositional] is set to NULL.
 * `--name value` takes the next argument unless it starts with "--" (then: "needs a
 * value"; write `--name=--x`). A CONFIG_BOOL takes a value only as `--flag=value`.
 * An empty environment variable counts as unset. A flag with no value from any
 * source leaves its target as it was. npositional and err may be NULL.
 * Returns 0 on success, 1 if --help or -h was given (also after a bad flag earlier
 * on the line), 2 if --version was given (before any bad flag), -1 on error with a message naming the flag (or the environment
 * variable) and what was wrong in err: "--threads: 'x' is not an integer",
 * "MESHD_THREADS: 0 is out of range [1, 64]". */
int config_parse(const config_flag_t *flags, size_t nflags, int argc, char **argv,
                 int *npositional, char *err, size_t errlen);

/* Prints "usage: PROG SYNOPSIS" and one line per flag with its env name and default:
 * "  --threads N   help (env MESHD_THREADS, default 2)", then a "-h, --help" line. */
void config_usage(FILE *out, const char *prog, const char *synopsis,
                  const config_flag_t *flags, size_t nflags);

/* After a usage error: "usage: PROG SYNOPSIS" and a pointer to --help (not the
 * whole help, so the problem stays in sight). */
void config_usage_line(FILE *out, const char *prog, const char *synopsis);

/* "4MiB" -> 4194304. Decimal digits, then optionally B, or K/M/G/T/P/E alone or
 * with "iB" (powers of 1024, case-insensitive). false on junk or overflow; *out is
 * written only on success. */
bool config_parse_bytes(const char *text, uint64_t *out);

#endif
