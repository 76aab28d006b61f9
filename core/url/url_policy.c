#include "url_policy.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "url_allow.h"

/* url_fetch_opts_t's defaults for loads (the flags override them). */
#define CONNECT_MS 10000
#define RETRIES 3

static int bad(meshd_error_t *e, const char *item, const char *why) {
  return error_set(e, ERR_BAD_ARGUMENT, "--url-allow: '%s': %s", item, why);
}

static bool has(const char *const *v, size_t n, const char *s) {
  for (size_t i = 0; i < n; i++)
    if (strcmp(v[i], s) == 0) return true;
  return false;
}

static int add_scheme(url_policy_t *p, const char *s) {
  if (!has(p->schemes, p->allow.n_schemes, s)) p->schemes[p->allow.n_schemes++] = s;
  return 0;
}

static int item(url_policy_t *p, char *it, meshd_error_t *e) {
  if (strcmp(it, "none") == 0) return p->disabled = true, 0;
  if (strcmp(it, "private") == 0) return p->allow.allow_private = true, 0;
  if (strncmp(it, "net:", 4) == 0) {
    if (!it[4]) return bad(e, it, "expected net:CIDR, e.g. net:10.1.0.0/16");
    if (p->allow.n_nets == URL_POLICY_MAX_ITEMS) return bad(e, it, "too many networks");
    p->nets[p->allow.n_nets++] = it + 4;
    return 0;
  }
  char *sep = strstr(it, "://");
  if (!sep) return bad(e, it, "expected none, private, net:CIDR, http://HOSTS, https://HOSTS or file:///DIR");
  *sep = 0;
  const char *rest = sep + 3;
  if (strcmp(it, "file") == 0) {
    *sep = ':';
    if (rest[0] != '/' || !rest[1]) return bad(e, it, "expected file:///DIR, an absolute directory");
    if (p->allow.n_file_roots == URL_POLICY_MAX_ITEMS) return bad(e, it, "too many directories");
    p->roots[p->allow.n_file_roots++] = rest;
    return add_scheme(p, "file");
  }
  if (strcmp(it, "http") != 0 && strcmp(it, "https") != 0) {
    *sep = ':';
    return bad(e, it, "schemes are http, https and file");
  }
  const char *scheme = strcmp(it, "http") == 0 ? "http" : "https";
  *sep = ':';
  if (!*rest || strchr(rest, '/')) return bad(e, it, "expected SCHEME://HOSTS, e.g. https://*.example.com or https://*");
  if (strcmp(rest, "*") != 0) {
    if (p->allow.n_hosts == URL_POLICY_MAX_ITEMS) return bad(e, it, "too many host patterns");
    if (!has(p->hosts, p->allow.n_hosts, rest)) p->hosts[p->allow.n_hosts++] = rest;
  } else {
    p->any_host = true;
  }
  return add_scheme(p, scheme);
}

int url_policy_parse(const char *spec, url_policy_t *p, meshd_error_t *e) {
  memset(p, 0, sizeof *p);
  p->opts.connect_timeout_ms = CONNECT_MS;
  p->opts.max_retries = RETRIES;
  p->opts.max_bytes = URL_FETCH_MAX_BYTES;
  if (spec && *spec) {
    if (!(p->text = strdup(spec))) return error_set(e, ERR_QUOTA, "--url-allow: out of memory");
    char *save = NULL;
    for (char *it = strtok_r(p->text, ",", &save); it; it = strtok_r(NULL, ",", &save))
      if (item(p, it, e)) return url_policy_free(p), -1;
    if (p->disabled && (p->allow.n_schemes || p->allow.n_nets || p->allow.allow_private)) {
      url_policy_free(p);
      return error_set(e, ERR_BAD_ARGUMENT, "--url-allow: 'none' cannot be listed with other items");
    }
    if (!p->disabled && !p->allow.n_schemes) {
      url_policy_free(p);
      return error_set(e, ERR_BAD_ARGUMENT,
                       "--url-allow: no scheme listed (add http://HOSTS, https://HOSTS or "
                       "file:///DIR)");
    }
    /* "*" for one scheme and patterns for another: patterns apply to all, so
     * "*" wins (the list is of hosts, not of scheme and host pairs). */
    if (p->any_host) p->allow.n_hosts = 0;
  }
  p->allow.schemes = p->schemes;
  p->allow.hosts = p->hosts;
  p->allow.nets = p->nets;
  p->allow.file_roots = p->roots;
  p->opts.allow = &p->allow;
  /* Malformed networks are refused now, not at the first load. */
  if (p->allow.n_nets) {
    char scheme[16];
    meshd_error_t ce;
    if (url_allow_check_url(&p->allow, "https://example.com/", "--url-allow", NULL, scheme,
                            sizeof scheme, &ce) && ce.kind == ERR_BAD_ARGUMENT) {
      url_policy_free(p);
      return error_set(e, ERR_BAD_ARGUMENT, "%s", ce.msg);
    }
  }
  return 0;
}

void url_policy_free(url_policy_t *p) {
  free(p->text);
  memset(p, 0, sizeof *p);
}

int url_policy_check(const url_policy_t *p, const char *url, meshd_error_t *e) {
  char shown[512], scheme[16];
  url_redact(url, shown, sizeof shown);
  if (p->disabled)
    return error_set(e, ERR_PERMISSION_DENIED,
                     "load %s: this server loads no URLs (--url-allow=none)", shown);
  /* Here, before any agent connects: a file:// path names the agents' files,
   * not ours, so it is checked as text. */
  return url_allow_check_url(&p->allow, url, shown, NULL, scheme, sizeof scheme, e);
}

void url_policy_to_proto(const url_policy_t *p, Meshd__Agent__V1__UrlPolicy *w) {
  meshd__agent__v1__url_policy__init(w);
  w->n_schemes = p->allow.n_schemes;
  w->schemes = (char **)p->schemes;
  w->n_hosts = p->allow.n_hosts;
  w->hosts = (char **)p->hosts;
  w->n_nets = p->allow.n_nets;
  w->nets = (char **)p->nets;
  w->allow_private = p->allow.allow_private;
  w->n_file_roots = p->allow.n_file_roots;
  w->file_roots = (char **)p->roots;
  w->connect_timeout_ms = p->opts.connect_timeout_ms;
  w->timeout_ms = p->opts.timeout_ms;
  w->max_retries = p->opts.max_retries;
  w->max_bytes = p->opts.max_bytes;
  w->min_speed = p->opts.min_speed;
  w->slow_s = p->opts.slow_s;
}

void url_policy_from_proto(const Meshd__Agent__V1__UrlPolicy *w, url_allow_t *a,
                           url_fetch_opts_t *o) {
  memset(a, 0, sizeof *a);
  memset(o, 0, sizeof *o);
  o->allow = a;
  if (!w) return;
  a->schemes = (const char *const *)w->schemes;
  a->n_schemes = w->n_schemes;
  a->hosts = (const char *const *)w->hosts;
  a->n_hosts = w->n_hosts;
  a->nets = (const char *const *)w->nets;
  a->n_nets = w->n_nets;
  a->allow_private = w->allow_private;
  a->file_roots = (const char *const *)w->file_roots;
  a->n_file_roots = w->n_file_roots;
  o->connect_timeout_ms = w->connect_timeout_ms;
  o->timeout_ms = w->timeout_ms;
  o->max_retries = w->max_retries;
  o->max_bytes = w->max_bytes;
  o->min_speed = (long)w->min_speed;
  o->slow_s = (long)w->slow_s;
}
