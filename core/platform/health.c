/* grpc.health.v1.Health on the rpc layer.
 *
 * Lock order: health->mu, then a call's own lock (taken inside rpc_call_*).
 * Each Watch call is held in `watchers` with an rpc_call_ref until its on_end. */
#include "health.h"

/* Calls one connection to the health port may have open at once. */
#define HEALTH_PORT_STREAMS 16

#include <stdio.h>

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "grpc/health/v1/health.pb-c.h"
#include "log.h"

typedef struct service {
  struct service *next;
  char *name;
  health_status_t status;
} service_t;

typedef struct watcher {
  struct watcher *next;
  rpc_call_t *call;
  const struct port *port; /* the bound on Watch calls is per port */
  char *service;
  struct health *h;
  health_status_t sent; /* the last status queued */
  health_status_t latest;
  bool behind; /* a status is queued: latest goes when it has (watch_drained) */
} watcher_t;

/* One per server the methods were added to: their `arg`. */
typedef struct port {
  struct port *next;
  struct health *h;
} port_t;

struct health {
  pthread_mutex_t mu;
  service_t *services;
  watcher_t *watchers;
  port_t *ports;
  bool shutting_down;
};

static const char *const status_names[] = {"UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"};

const char *health_status_name(health_status_t s) {
  return (unsigned)s < sizeof status_names / sizeof *status_names ? status_names[s] : "INVALID";
}

static service_t *find_locked(health_t *h, const char *name) {
  for (service_t *s = h->services; s; s = s->next)
    if (strcmp(s->name, name) == 0) return s;
  return NULL;
}

static health_status_t get_locked(health_t *h, const char *name) {
  service_t *s = find_locked(h, name);
  return s ? s->status : HEALTH_SERVICE_UNKNOWN;
}

static void send_status(rpc_call_t *call, health_status_t st) {
  Grpc__Health__V1__HealthCheckResponse r = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
  r.status = (Grpc__Health__V1__HealthCheckResponse__ServingStatus)st;
  rpc_call_send(call, &r.base);
}

/* A client that does not read holds at most one queued status: later ones
 * wait as `latest` (Watch may skip intermediate statuses) and go when the
 * queue has drained. Under h->mu. */
static void watch_drained(rpc_call_t *call, void *arg);

static void watcher_send_locked(watcher_t *w, health_status_t st) {
  w->latest = st;
  if (w->behind) return;
  if (rpc_call_pending(w->call) > 0) {
    w->behind = rpc_call_when_drained(w->call, 0, watch_drained, w);
    if (w->behind) return;
  }
  w->sent = st;
  send_status(w->call, st);
}

static void watch_drained(rpc_call_t *call, void *arg) {
  watcher_t *w = arg; /* alive: on_end runs after this callback */
  health_t *h = w->h;
  pthread_mutex_lock(&h->mu);
  w->behind = false;
  if (!rpc_call_ended(call) && w->latest != w->sent) watcher_send_locked(w, w->latest);
  pthread_mutex_unlock(&h->mu);
}

health_status_t health_get(health_t *h, const char *service) {
  pthread_mutex_lock(&h->mu);
  health_status_t st = get_locked(h, service);
  pthread_mutex_unlock(&h->mu);
  return st;
}

void health_set(health_t *h, const char *service, health_status_t status) {
  pthread_mutex_lock(&h->mu);
  if (h->shutting_down) status = HEALTH_NOT_SERVING;
  service_t *s = find_locked(h, service);
  bool changed = !s || s->status != status;
  if (!s && (s = calloc(1, sizeof *s))) {
    s->name = strdup(service);
    s->next = h->services;
    h->services = s;
  }
  if (s) s->status = status;
  if (changed) {
    log_info("health", "%s is %s", *service ? service : "\"\"", health_status_name(status));
    for (watcher_t *w = h->watchers; w; w = w->next)
      if (strcmp(w->service, service) == 0) watcher_send_locked(w, status);
  }
  pthread_mutex_unlock(&h->mu);
}

int health_watchers(health_t *h) {
  pthread_mutex_lock(&h->mu);
  int n = 0;
  for (watcher_t *w = h->watchers; w; w = w->next) n++;
  pthread_mutex_unlock(&h->mu);
  return n;
}

static void on_check(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  health_t *h = ((port_t *)arg)->h;
  const Grpc__Health__V1__HealthCheckRequest *req = (const void *)msg;
  health_status_t st = health_get(h, req->service);
  if (st == HEALTH_SERVICE_UNKNOWN) {
    rpc_call_finish(call, GRPC_STATUS_NOT_FOUND, NULL, "unknown service \"%s\"", req->service);
    return;
  }
  Grpc__Health__V1__HealthCheckResponse r = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
  r.status = (Grpc__Health__V1__HealthCheckResponse__ServingStatus)st;
  rpc_call_reply(call, &r.base);
}

static void on_watch(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  const port_t *port = arg;
  health_t *h = port->h;
  const Grpc__Health__V1__HealthCheckRequest *req = (const void *)msg;
  /* Health is open to strangers and a Watch lasts as long as its client
   * likes: what it holds is bounded (the name it keeps, how many there are). */
  size_t len = strlen(req->service);
  if (len > HEALTH_SERVICE_MAX) {
    rpc_call_finish(call, GRPC_STATUS_INVALID_ARGUMENT, NULL,
                    "Watch: a service name of %zu bytes; names are at most %d", len,
                    HEALTH_SERVICE_MAX);
    return;
  }
  pthread_mutex_lock(&h->mu);
  int on_port = 0;
  for (watcher_t *o = h->watchers; o; o = o->next) on_port += o->port == port;
  if (!h->shutting_down && on_port >= HEALTH_WATCHERS_MAX) {
    pthread_mutex_unlock(&h->mu);
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, NULL,
                    "Watch: %d Watch calls are open on this port already; use Check",
                    HEALTH_WATCHERS_MAX);
    return;
  }
  health_status_t first = get_locked(h, req->service);
  send_status(call, first);
  if (h->shutting_down) {
    pthread_mutex_unlock(&h->mu);
    rpc_call_finish(call, GRPC_STATUS_UNAVAILABLE, NULL, "server shutting down");
    return;
  }
  watcher_t *w = calloc(1, sizeof *w);
  if (w && !(w->service = strdup(req->service))) { /* (health_set compares it) */
    free(w);
    w = NULL;
  }
  if (w) {
    w->call = call;
    w->port = port;
    w->h = h;
    w->sent = w->latest = first;
    w->next = h->watchers;
    h->watchers = w;
    rpc_call_ref(call);
    rpc_call_set_data(call, w);
  }
  pthread_mutex_unlock(&h->mu);
  if (!w) rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, NULL, "out of memory");
}

static void on_watch_end(rpc_call_t *call, bool cancelled, void *arg) {
  health_t *h = ((port_t *)arg)->h;
  watcher_t *w = rpc_call_data(call);
  if (!w) return;
  pthread_mutex_lock(&h->mu);
  for (watcher_t **p = &h->watchers; *p; p = &(*p)->next) {
    if (*p == w) {
      *p = w->next;
      break;
    }
  }
  pthread_mutex_unlock(&h->mu);
  free(w->service);
  free(w);
  rpc_call_unref(call);
}

health_t *health_create(void) {
  health_t *h = calloc(1, sizeof *h);
  if (!h) return NULL;
  pthread_mutex_init(&h->mu, NULL);
  return h;
}

static const rpc_method_t methods[] = {
    {
        .path = "/grpc.health.v1.Health/Check",
        .kind = RPC_UNARY,
        .request = &grpc__health__v1__health_check_request__descriptor,
        .on_start = on_check,
    },
    {
        .path = "/grpc.health.v1.Health/Watch",
        .kind = RPC_SERVER_STREAMING,
        .request = &grpc__health__v1__health_check_request__descriptor,
        .on_start = on_watch,
        .on_end = on_watch_end,
    },
};

int health_add_methods(health_t *h, rpc_server_t *srv) {
  return health_add_methods_guarded(h, srv, NULL, NULL);
}

int health_add_methods_guarded(health_t *h, rpc_server_t *srv, rpc_guard_fn guard,
                               void *guard_arg) {
  port_t *port = calloc(1, sizeof *port); /* freed by health_destroy, after the server */
  if (!port) return -1;
  port->h = h;
  pthread_mutex_lock(&h->mu);
  port->next = h->ports;
  h->ports = port;
  pthread_mutex_unlock(&h->mu);
  return rpc_server_add_methods_guarded(srv, methods, sizeof methods / sizeof methods[0], port,
                                        guard, guard_arg);
}

rpc_server_t *health_serve(health_t *h, const char *listen, const rpc_server_opts_t *limits,
                           char *err, size_t errlen) {
  /* Probes send a Check at a time (a Watch or two): a stranger's connection
   * keeps no more calls open than that, or than the operator allows. */
  int streams = limits->max_concurrent_streams;
  if (streams <= 0 || streams > HEALTH_PORT_STREAMS) streams = HEALTH_PORT_STREAMS;
  rpc_server_opts_t o = {.listen = listen, .threads = 1, .max_message_bytes = 4096,
                         .max_concurrent_streams = streams,
                         .max_connection_idle_ms = limits->max_connection_idle_ms,
                         .handshake_timeout_ms = limits->handshake_timeout_ms,
                         .max_unauthenticated_requests = limits->max_unauthenticated_requests,
                         .memory_bytes = limits->memory_bytes};
  rpc_server_t *srv = rpc_server_create(&o, err, errlen);
  if (!srv) return NULL;
  if (health_add_methods(h, srv) != 0 || rpc_server_start(srv, err, errlen) < 0) {
    if (!err[0]) snprintf(err, errlen, "cannot register the Health service");
    rpc_server_destroy(srv);
    return NULL;
  }
  return srv;
}

void health_shutdown(health_t *h) {
  pthread_mutex_lock(&h->mu);
  h->shutting_down = true;
  for (service_t *s = h->services; s; s = s->next) {
    if (s->status == HEALTH_NOT_SERVING) continue;
    s->status = HEALTH_NOT_SERVING;
    for (watcher_t *w = h->watchers; w; w = w->next)
      if (strcmp(w->service, s->name) == 0) send_status(w->call, HEALTH_NOT_SERVING);
  }
  for (watcher_t *w = h->watchers; w; w = w->next)
    rpc_call_finish(w->call, GRPC_STATUS_UNAVAILABLE, NULL, "server shutting down");
  pthread_mutex_unlock(&h->mu);
  log_info("health", "every service is NOT_SERVING: shutting down");
}

void health_destroy(health_t *h) {
  if (!h) return;
  for (service_t *s = h->services, *next; s; s = next) {
    next = s->next;
    free(s->name);
    free(s);
  }
  for (port_t *p = h->ports, *next; p; p = next) {
    next = p->next;
    free(p);
  }
  /* Watchers are gone: each on_end ran before the rpc server finished shutting down. */
  pthread_mutex_destroy(&h->mu);
  free(h);
}
