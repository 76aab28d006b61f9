/* The Echo service (tests/proto/meshd/test/v1/echo.proto) served by the rpc layer,
 * for the rpc unit tests and the rpc benchmark.
 *
 * Unary:        replies text and payload, index 0, metadata = request metadata
 *               "x-echo" ("" if absent). fail_code != 0 ends the call with that
 *               code, fail_kind as the kind trailer (none if empty) and the
 *               message "echo failure: <text>". delay_ms > 0 answers that much
 *               later from the service's timer thread (the call is held with
 *               rpc_call_ref meanwhile).
 * ClientStream: at the client's half-close replies the concatenated texts of
 *               all messages with index = number of messages.
 * ServerStream: reply_count replies (text, payload, index 0..n-1), then OK; or,
 *               with fail_code, the fail_code status after the replies; or, with
 *               fail_code and delay_ms, rpc_call_abort(fail_code, fail_kind,
 *               "echo abort: <text>") that much later, whatever the client took.
 * Bidi:         replies to each message with its text and payload and
 *               index = messages received so far, this one included (1, 2, ...).
 *               A message with fail_code ends the call with that status. At the
 *               client's half-close it finishes OK.
 *
 * Counters count on_end callbacks, so they move after the call's status has
 * been sent; tests poll them. */
#ifndef MESHD_TEST_ECHO_SERVER_H
#define MESHD_TEST_ECHO_SERVER_H

#include <stddef.h>

#include "meshd/test/v1/echo.pb-c.h"
#include "rpc.h"

/* Short names for the generated meshd.test.v1 types. */
typedef Meshd__Test__V1__EchoRequest EchoRequest;
typedef Meshd__Test__V1__EchoReply EchoReply;
#define ECHO_REQUEST__INIT MESHD__TEST__V1__ECHO_REQUEST__INIT
#define ECHO_REPLY__INIT MESHD__TEST__V1__ECHO_REPLY__INIT
#define echo_request__descriptor meshd__test__v1__echo_request__descriptor
#define echo_reply__descriptor meshd__test__v1__echo_reply__descriptor

#define ECHO_UNARY "/meshd.test.v1.Echo/Unary"
#define ECHO_CLIENT_STREAM "/meshd.test.v1.Echo/ClientStream"
#define ECHO_SERVER_STREAM "/meshd.test.v1.Echo/ServerStream"
#define ECHO_BIDI "/meshd.test.v1.Echo/Bidi"

typedef struct echo_server echo_server_t;

/* Creates an rpc server from opts (rpc_init must have run), registers the Echo
 * methods and starts it. Returns NULL with a message in err on failure. */
echo_server_t *echo_server_start(const rpc_server_opts_t *opts, char *err, size_t errlen);
/* The same with a guard on every Echo method (rpc_server_add_methods_guarded);
 * Unary then replies metadata "identity:NAME" (what the guard admitted) when
 * the request has no "x-echo". */
echo_server_t *echo_server_start_guarded(const rpc_server_opts_t *opts, rpc_guard_fn guard,
                                         void *guard_arg, char *err, size_t errlen);
int echo_server_port(echo_server_t *es);
/* The underlying server, for rpc_server_* calls (active_calls, shutdown). The
 * echo server still owns it. */
rpc_server_t *echo_server_rpc(echo_server_t *es);
/* Shuts the rpc server down with this grace, drops the calls still waiting for
 * a delayed answer, and frees everything. NULL is a no-op. */
void echo_server_stop(echo_server_t *es, double grace_seconds);

/* on_start callbacks run, on_end callbacks run, and those with cancelled = true. */
int echo_server_calls_started(echo_server_t *es);
int echo_server_calls_ended(echo_server_t *es);
int echo_server_calls_cancelled(echo_server_t *es);
/* Delayed answers given (or aborts), whether or not their call was still open. */
int echo_server_delayed_answered(echo_server_t *es);

#endif
