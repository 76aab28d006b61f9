#include "session_service.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "error_kind.h"
#include "fault.h"
#include "log.h"
#include "page_token.h"
#include "meshd/v1/tensor_service.pb-c.h"
#include "runtime.h"

static fault_t *create_fault; /* --server-fault session:...; NULL: none */

void session_service_set_fault(fault_t *f) { create_fault = f; }

static void fail(rpc_call_t *call, const meshd_error_t *e) {
  rpc_call_finish(call, error_kind_code(e->kind), error_kind_name(e->kind), "%s", e->msg);
}

/* "KeepAlive" from "/meshd.v1.TensorService/KeepAlive". */
static const char *short_method(const rpc_call_t *call) {
  const char *m = rpc_call_method(call);
  if (!m) return "this call";
  const char *slash = strrchr(m, '/');
  return slash ? slash + 1 : m;
}

/* The principal the call's guard admitted ("anonymous" on an open server). */
static const char *caller(rpc_call_t *call) {
  const rpc_identity_t *id = rpc_call_identity(call);
  return id ? id->name : "anonymous";
}

session_t *session_from_call(session_table_t *t, rpc_call_t *call) {
  char id[128], token[128];
  const char *method = short_method(call);
  bool has_id = rpc_call_metadata(call, SESSION_MD_ID, id, sizeof id) && id[0];
  bool has_token = rpc_call_metadata(call, SESSION_MD_TOKEN, token, sizeof token) && token[0];
  if (!has_id || !has_token) {
    rpc_call_finish(call, GRPC_STATUS_UNAUTHENTICATED, error_kind_name(ERR_NO_SESSION),
                    "%s needs the metadata %s%s%s: call CreateSession first and send its "
                    "session_id as %s and its token as %s with every call",
                    method, has_id ? "" : SESSION_MD_ID, !has_id && !has_token ? " and " : "",
                    has_token ? "" : SESSION_MD_TOKEN, SESSION_MD_ID, SESSION_MD_TOKEN);
    return NULL;
  }
  meshd_error_t e;
  /* The session's own token is not enough: it is the owner's. Checked in the
   * table, before the lease is renewed: a stranger's call changes nothing. */
  session_t *s = session_acquire_as(t, id, token, caller(call), &e);
  if (!s && e.kind == ERR_PERMISSION_DENIED) {
    rpc_call_finish(call, GRPC_STATUS_PERMISSION_DENIED, error_kind_name(ERR_PERMISSION_DENIED),
                    "%s: %s", method, e.msg);
    return NULL;
  }
  if (!s) {
    rpc_call_finish(call, GRPC_STATUS_UNAUTHENTICATED, error_kind_name(ERR_NO_SESSION), "%s: %s",
                    method, e.msg);
    return NULL;
  }
  return s;
}

static int check_create(const session_table_t *t, const Meshd__V1__CreateSessionRequest *r,
                        meshd_error_t *e) {
  if (!session_table_accepting(t))
    return error_set(e, ERR_UNAVAILABLE,
                     "CreateSession: the server is shutting down and takes no new sessions; "
                     "retry against another replica or after it restarts");
  const char *name = r->client_name ? r->client_name : "";
  size_t len = strlen(name);
  if (len > SESSION_CLIENT_NAME_MAX)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "CreateSession: client_name is %zu bytes; at most %d are allowed", len,
                     SESSION_CLIENT_NAME_MAX);
  for (size_t i = 0; i < len; i++) {
    unsigned char c = (unsigned char)name[i];
    if (c < 0x20 || c == 0x7f)
      return error_set(e, ERR_BAD_ARGUMENT,
                       "CreateSession: client_name has a control character (0x%02x) at byte %zu; "
                       "use printable text",
                       c, i);
  }
  if (r->ttl_seconds > SESSION_TTL_MAX_S)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "CreateSession: ttl_seconds %llu is too long; use 1..%d (7 days), or 0 for "
                     "the server's default of %llu",
                     (unsigned long long)r->ttl_seconds, SESSION_TTL_MAX_S,
                     (unsigned long long)session_table_default_ttl(t));
  uint64_t cap = session_table_default_quota(t);
  if (cap && r->quota_bytes > cap)
    return error_set(e, ERR_QUOTA,
                     "CreateSession: quota_bytes %llu is more than the %llu bytes a session may "
                     "hold on this server (--session-quota-bytes); ask for at most %llu, or 0 "
                     "for that much",
                     (unsigned long long)r->quota_bytes, (unsigned long long)cap,
                     (unsigned long long)cap);
  return 0;
}

static void create_session(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  session_table_t *t = arg;
  const Meshd__V1__CreateSessionRequest *r = (const Meshd__V1__CreateSessionRequest *)req;
  meshd_error_t e;
  session_t *s;
  if (check_create(t, r, &e) != 0 ||
      session_create(t, caller(call), r->client_name, r->ttl_seconds, r->quota_bytes, &s, &e) != 0) {
    fail(call, &e);
    return;
  }
  Meshd__V1__CreateSessionReply reply = MESHD__V1__CREATE_SESSION_REPLY__INIT;
  reply.session_id = s->id;
  reply.token = s->token;
  reply.ttl_seconds = s->ttl_s;
  char *features[] = {"literal"};
  reply.features = features;
  reply.n_features = sizeof features / sizeof *features;
  /* The call keeps the session's id: a call that ends cancelled (create_end)
   * never told its client the token, and the session is closed then rather
   * than left to hold a --max-sessions(-per-principal) slot until its ttl. */
  char *kept = strdup(s->id); /* none: it lingers until its ttl, as before */
  rpc_call_set_data(call, kept);
  int ms = 0;
  if (fault_hit(create_fault, "session", -1, &ms) == FAULT_SLOW) {
    log_warn("session", "CreateSession: answer held %d ms (injected fault)", ms);
    if (rpc_call_reply_after(call, &reply.base, ms) == 0) {
      session_release(s);
      return;
    }
  }
  rpc_call_reply(call, &reply.base);
  session_release(s);
}

/* A CreateSession's call is over. Cancelled (the client's deadline passed, it
 * gave up, its connection dropped before the status went out), its client
 * never learned the token: nobody can use or close the session, so it is
 * closed now, as CloseSession would, and its slot is free for the retry. */
static void create_end(rpc_call_t *call, bool cancelled, void *arg) {
  session_table_t *t = arg;
  char *id = rpc_call_data(call);
  rpc_call_set_data(call, NULL);
  if (!id) return;
  session_t *s = cancelled ? session_find(t, id) : NULL;
  if (s) {
    log_info("session", "CreateSession of session %s: its call was cancelled before the answer "
             "reached the client; the session is closed", s->id);
    session_close(t, s);
    session_unfind(s);
  }
  free(id);
}

static void close_session(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  session_table_t *t = arg;
  session_t *s = session_from_call(t, call);
  if (!s) return;
  session_close(t, s);
  session_release(s);
  Meshd__V1__CloseSessionReply reply = MESHD__V1__CLOSE_SESSION_REPLY__INIT;
  rpc_call_reply(call, &reply.base);
}

static void keep_alive(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  session_t *s = session_from_call(arg, call);
  if (!s) return;
  Meshd__V1__KeepAliveReply reply = MESHD__V1__KEEP_ALIVE_REPLY__INIT;
  reply.ttl_seconds = s->ttl_s;
  session_release(s);
  rpc_call_reply(call, &reply.base);
}

/* ListSessions shows a principal its own sessions; an admin sees every one.
 * Paged by the sessions' seq (page_token.h). */
#define LIST_SESSIONS_PAGE_DEFAULT 1000
#define LIST_SESSIONS_PAGE_MAX 5000

static void list_sessions(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {
  const Meshd__V1__ListSessionsRequest *r = (const Meshd__V1__ListSessionsRequest *)req;
  uint64_t after;
  bool token_ok = page_token_parse(r->page_token, session_table_epoch(arg), &after);
  size_t limit = page_size_of(r->page_size, LIST_SESSIONS_PAGE_DEFAULT, LIST_SESSIONS_PAGE_MAX);
  const rpc_identity_t *id = rpc_call_identity(call);
  bool all = !id || id->admin;
  session_info_t *v;
  size_t n;
  uint64_t next;
  int rc = token_ok ? session_list_page(arg, all ? NULL : id->name, after, limit, &v, &n, &next)
                    : -2;
  if (rc == -2) {
    meshd_error_t e;
    page_token_refuse(&e, "ListSessions");
    fail(call, &e);
    return;
  }
  if (rc != 0) {
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, NULL, "out of memory listing sessions");
    return;
  }
  Meshd__V1__SessionInfo *rows = n ? calloc(n, sizeof *rows) : NULL;
  Meshd__V1__SessionInfo **ptrs = n ? calloc(n, sizeof *ptrs) : NULL;
  if (n && (!rows || !ptrs)) {
    free(rows);
    free(ptrs);
    free(v);
    rpc_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, NULL, "out of memory listing sessions");
    return;
  }
  for (size_t i = 0; i < n; i++) {
    Meshd__V1__SessionInfo row = MESHD__V1__SESSION_INFO__INIT;
    row.session_id = v[i].id;
    row.owner = v[i].owner;
    row.client_name = v[i].client_name;
    row.bytes_held = v[i].bytes_held;
    row.live_tensors = v[i].live_tensors;
    row.idle_ms = v[i].idle_ms;
    row.queued_commands = v[i].queued_commands;
    row.commands = v[i].commands;
    row.age_ms = v[i].age_ms;
    rows[i] = row;
    ptrs[i] = &rows[i];
  }
  char token[PAGE_TOKEN_LEN];
  page_token_format(token, next, session_table_epoch(arg));
  Meshd__V1__ListSessionsReply reply = MESHD__V1__LIST_SESSIONS_REPLY__INIT;
  reply.sessions = ptrs;
  reply.n_sessions = n;
  reply.next_page_token = token;
  rpc_call_reply(call, &reply.base);
  free(ptrs);
  free(rows);
  free(v);
}

static const rpc_method_t methods[] = {
    {
        .path = "/meshd.v1.TensorService/CreateSession",
        .kind = RPC_UNARY,
        .request = &meshd__v1__create_session_request__descriptor,
        .on_start = create_session,
        .on_end = create_end,
    },
    {
        .path = "/meshd.v1.TensorService/CloseSession",
        .kind = RPC_UNARY,
        .request = &meshd__v1__close_session_request__descriptor,
        .on_start = close_session,
    },
    {
        .path = "/meshd.v1.TensorService/KeepAlive",
        .kind = RPC_UNARY,
        .request = &meshd__v1__keep_alive_request__descriptor,
        .on_start = keep_alive,
    },
    {
        .path = "/meshd.v1.TensorService/ListSessions",
        .kind = RPC_UNARY,
        .request = &meshd__v1__list_sessions_request__descriptor,
        .on_start = list_sessions,
    },
};

const rpc_method_t *session_service_methods(size_t *n) {
  *n = sizeof methods / sizeof methods[0];
  return methods;
}
