/* Internal to core/platform/rpc_*.c: protobuf-c <-> grpc_byte_buffer, channel args. */
#ifndef MESHD_RPC_WIRE_H
#define MESHD_RPC_WIRE_H

#include <grpc/byte_buffer.h>
#include <stdbool.h>
#include <grpc/grpc.h>
#include <protobuf-c/protobuf-c.h>

#define RPC_DEFAULT_MAX_MESSAGE (4 * 1024 * 1024)

/* Packs msg into a new byte buffer (caller destroys). NULL only if msg is NULL. */
grpc_byte_buffer *wire_pack(const ProtobufCMessage *msg);
/* Unpacks buf as desc (caller frees with protobuf_c_message_free_unpacked).
 * NULL if the bytes are not a valid message. buf is not consumed. With `why`
 * (requests a server takes from strangers) the string fields are checked too
 * (proto_check.h): NULL with why naming the field when one is not UTF-8 or
 * holds a NUL; why stays "" when the bytes do not unpack at all. */
ProtobufCMessage *wire_unpack(grpc_byte_buffer *buf, const ProtobufCMessageDescriptor *desc,
                              char *why, size_t whylen);

/* wire_unpack into an arena: the message's parts are carved from a few large
 * blocks, so unpacking a batch of many instructions costs a few mallocs, and
 * freeing it (wire_arena_free, not protobuf_c_message_free_unpacked) a few
 * frees. *arena is NULL when the result is. */
typedef struct wire_arena wire_arena_t;
ProtobufCMessage *wire_unpack_arena(grpc_byte_buffer *buf, const ProtobufCMessageDescriptor *desc,
                                    char *why, size_t whylen, wire_arena_t **arena);
void wire_arena_free(wire_arena_t *a);

/* A small fixed-capacity builder for grpc_channel_args. */
typedef struct wire_args {
  grpc_arg args[24];
  grpc_channel_args ca;
} wire_args_t;
void wire_args_int(wire_args_t *a, const char *key, int value);
void wire_args_str(wire_args_t *a, const char *key, const char *value);
void wire_args_ptr(wire_args_t *a, const char *key, void *p, const grpc_arg_pointer_vtable *vt);
const grpc_channel_args *wire_args_done(wire_args_t *a);

/* Stops the client thread of pulls and duplexes (rpc_client.c); rpc_shutdown
 * calls it. */
void rpc_client_stop_thread(void);

/* Every tag on the process loop's queue (rpc_loop_start) begins with the
 * function its event goes to: the server's events are dispatched on the
 * loop's thread, the client's go to the client thread. */
typedef void (*rpc_loop_fn)(void *tag, bool ok);
typedef struct rpc_loop_tag {
  rpc_loop_fn fn;
} rpc_loop_tag_t;
void rpc_server_event(void *tag, bool ok);
/* Hands a client event taken off the loop's queue to the client thread. */
void rpc_client_forward(void *tag, bool ok);
/* The loop's queue and its thread count, or NULL if it does not run. */
grpc_completion_queue *rpc_loop_cq(int *threads);
/* Stops the loop once every server and client call is gone (rpc_shutdown). */
void rpc_loop_stop(void);

/* Absolute deadline timeout_ms from now; infinite for timeout_ms <= 0. */
gpr_timespec wire_deadline(int timeout_ms);

#endif
