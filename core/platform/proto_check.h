/* Checks the string fields of a serialized protobuf message before anyone
 * trusts them: proto3 strings are UTF-8, and meshd reads them as C strings, so
 * an embedded NUL would cut "add\0evil" to "add".
 *
 *   char why[256];
 *   if (proto_check_strings(&meshd__v1__command__descriptor, bytes, len, why, sizeof why))
 *     refuse with INVALID_ARGUMENT, "%s", why
 *     ("Command.call.op: embedded NUL at byte 3; strings must be UTF-8 without NUL")
 *
 * The walk follows the descriptor into nested messages (oneof members and
 * repeated fields included; an element is named with its index,
 * "Command.call.args[1].s"), skips unknown fields, bytes and scalars, and
 * refuses nesting deeper than PROTO_CHECK_MAX_DEPTH. A pure function: no
 * allocation, no globals, safe on any bytes (a fuzzer may call it). */
#ifndef MESHD_PROTO_CHECK_H
#define MESHD_PROTO_CHECK_H

#include <protobuf-c/protobuf-c.h>
#include <stddef.h>
#include <stdint.h>

/* Message fields nested inside each other, the top-level message being depth 0. */
#define PROTO_CHECK_MAX_DEPTH 32

/* 0 when every string field of `data` (len bytes, a message of type d) is
 * valid UTF-8 without NUL. Otherwise -1 with err (errlen > 0; truncated to
 * errlen) naming the field path, the byte offset within the string and the
 * rule: "Command.reduce.dims[1]: invalid UTF-8 at byte 2 (0xc3 0x28)". Bytes
 * that are not a well-formed message (a truncated field, a group, a tag 0,
 * nesting too deep) are -1 too, with a message saying so. err may be NULL. */
int proto_check_strings(const ProtobufCMessageDescriptor *d, const uint8_t *data, size_t len,
                        char *err, size_t errlen);

#endif
