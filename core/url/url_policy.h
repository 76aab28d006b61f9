/* The server's --url-allow and --url-* flags as one policy: parsed once at
 * startup, checked by the server before any agent connects, and sent to the
 * agents with each load (agent.proto UrlPolicy), which check every address
 * they connect to against it.
 *
 *   url_policy_t p;
 *   if (url_policy_parse("https://example.com,net:10.1.0.0/16", &p, &e)) die(&e);
 *   if (url_policy_check(&p, url, &e)) reject(&e);   before any agent connects
 *   Meshd__Agent__V1__UrlPolicy wire;  url_policy_to_proto(&p, &wire);  borrows p
 *   ...
 *   url_policy_free(&p);
 *
 * --url-allow is a comma-separated list of:
 *   none              no loads at all (the other items are refused with it)
 *   http://HOSTS      the scheme, to hosts matching HOSTS ("*": any, "*.x.com":
 *   https://HOSTS     subdomains of x.com, "x.com": that host). Host patterns
 *                     apply to every scheme listed.
 *   file:///DIR       file:// paths inside DIR (on the agent's own disk)
 *   net:CIDR          a non-public network connections may reach
 *   private           any address (turns the address check off)
 * Without the flag: http and https to any public host, and loopback. */
#ifndef MESHD_URL_POLICY_H
#define MESHD_URL_POLICY_H

#include <stdbool.h>

#include "error_kind.h"
#include "meshd/agent/v1/agent.pb-c.h"
#include "url_fetch.h"

#define URL_POLICY_MAX_ITEMS 64

typedef struct url_policy {
  bool disabled;               /* "none" */
  bool any_host;               /* some scheme listed with "*" */
  url_allow_t allow;           /* its arrays point into the fields below */
  url_fetch_opts_t opts;       /* allow points at .allow */
  char *text;                  /* the flag's copy the arrays point into */
  const char *schemes[4], *hosts[URL_POLICY_MAX_ITEMS], *nets[URL_POLICY_MAX_ITEMS],
      *roots[URL_POLICY_MAX_ITEMS];
} url_policy_t;

/* spec: the --url-allow value, NULL or "" for the defaults. opts' limits
 * (timeouts, retries, max_bytes) are set to the defaults here; the caller
 * overrides them from its flags. BAD_ARGUMENT naming the item at fault. */
int url_policy_parse(const char *spec, url_policy_t *p, meshd_error_t *e);
void url_policy_free(url_policy_t *p);
/* The URL against the policy, with no connection: scheme, host pattern,
 * hosts written as addresses, file roots. PERMISSION_DENIED or BAD_ARGUMENT
 * with the URL redacted. */
int url_policy_check(const url_policy_t *p, const char *url, meshd_error_t *e);
/* The policy as sent to agents; out borrows p's strings. */
void url_policy_to_proto(const url_policy_t *p, Meshd__Agent__V1__UrlPolicy *out);
/* What an agent was sent, as url_fetch options: *allow and *o borrow w's
 * strings. A missing policy (NULL) is the defaults. */
void url_policy_from_proto(const Meshd__Agent__V1__UrlPolicy *w, url_allow_t *allow,
                           url_fetch_opts_t *o);

#endif
