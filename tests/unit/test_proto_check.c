/* core/platform/proto_check: string fields of wire bytes are UTF-8 without NUL,
 * named by their path; nesting is bounded; any bytes are safe. The messages are
 * written by hand as wire bytes (tag = field << 3 | wire type). */
#include <criterion/criterion.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "meshd/v1/tensor_service.pb-c.h"
#include "proto_check.h"

#define LEN(field) ((uint8_t)((field) << 3 | 2))
#define VARINT(field) ((uint8_t)((field) << 3))

typedef struct buf {
  uint8_t b[512];
  size_t n;
} buf_t;

static void put(buf_t *b, const void *p, size_t n) {
  cr_assert_leq(b->n + n, sizeof b->b);
  memcpy(b->b + b->n, p, n);
  b->n += n;
}

static void put_byte(buf_t *b, uint8_t c) { put(b, &c, 1); }

/* Field `field` holding `n` bytes (n < 128: a one-byte length). */
static void put_len(buf_t *b, unsigned field, const void *p, size_t n) {
  cr_assert_lt(n, 128);
  put_byte(b, LEN(field));
  put_byte(b, (uint8_t)n);
  put(b, p, n);
}

static void put_msg(buf_t *b, unsigned field, const buf_t *inner) {
  put_len(b, field, inner->b, inner->n);
}

static char why[256];

static int check(const ProtobufCMessageDescriptor *d, const buf_t *b) {
  memset(why, 'x', sizeof why);
  return proto_check_strings(d, b->b, b->n, why, sizeof why);
}

#define CMD (&meshd__v1__command__descriptor)

/* Command{call: Call{op: op[0..n)}} */
static buf_t call_op(const char *op, size_t n) {
  buf_t call = {0}, cmd = {0};
  put_len(&call, 1, op, n);
  put_msg(&cmd, 14, &call);
  return cmd;
}

Test(proto_check, the_nul_in_an_op_name_is_refused_naming_the_field_and_byte) {
  buf_t cmd = call_op("add\0evil", 8);
  cr_assert_eq(check(CMD, &cmd), -1);
  cr_assert_str_eq(why, "Command.call.op: embedded NUL at byte 3; strings must be UTF-8 without NUL");
  /* protobuf-c alone would hand the handler "add": why the check must run first */
  Meshd__V1__Command *m = meshd__v1__command__unpack(NULL, cmd.n, cmd.b);
  cr_assert_not_null(m);
  cr_assert_str_eq(m->call->op, "add");
  meshd__v1__command__free_unpacked(m, NULL);
}

Test(proto_check, valid_utf8_passes_at_every_width_and_boundary) {
  static const char *const ok[] = {
      "add", "", "h\xc3\xa9llo",           /* é */
      "\xdf\xbf",                          /* U+07FF, last 2-byte */
      "\xe0\xa0\x80",                      /* U+0800, first 3-byte */
      "\xed\x9f\xbf", "\xee\x80\x80",      /* either side of the surrogates */
      "\xef\xbf\xbf",                      /* U+FFFF */
      "\xf0\x90\x80\x80",                  /* U+10000 */
      "\xf4\x8f\xbf\xbf",                  /* U+10FFFF, the last code point */
      "\xf0\x9f\x98\x80 mixed \xe2\x82\xac"};
  for (size_t i = 0; i < sizeof ok / sizeof *ok; i++) {
    buf_t cmd = call_op(ok[i], strlen(ok[i]));
    cr_assert_eq(check(CMD, &cmd), 0, "case %zu refused: %s", i, why);
    cr_assert_str_eq(why, "", "err is cleared on success");
  }
}

Test(proto_check, invalid_utf8_is_refused_with_the_offset_and_the_bytes) {
  static const struct {
    const char *s, *want;
  } bad[] = {
      {"ab\xff", "at byte 2 (0xff)"},                     /* never valid */
      {"\x80", "at byte 0 (0x80)"},                       /* a lone continuation */
      {"a\xc0\x80", "at byte 1 (0xc0)"},                  /* overlong NUL */
      {"\xc1\xbf", "at byte 0 (0xc1)"},                   /* overlong */
      {"\xe0\x80\x80", "at byte 0 (0xe0 0x80 0x80)"},     /* overlong 3-byte */
      {"\xf0\x8f\xbf\xbf", "at byte 0 (0xf0 0x8f 0xbf 0xbf)"}, /* overlong 4-byte */
      {"\xed\xa0\x80", "at byte 0 (0xed 0xa0 0x80)"},     /* a surrogate */
      {"\xf4\x90\x80\x80", "at byte 0 (0xf4 0x90 0x80 0x80)"}, /* past U+10FFFF */
      {"\xf5\x80\x80\x80", "at byte 0 (0xf5)"},
      {"ok\xe2\x28\xa1", "at byte 2 (0xe2 0x28)"},        /* a broken sequence */
      {"ok\xe2\x82", "at byte 2 (0xe2 0x82)"},            /* cut off at the end */
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    buf_t cmd = call_op(bad[i].s, strlen(bad[i].s));
    cr_assert_eq(check(CMD, &cmd), -1, "case %zu accepted", i);
    char want[160];
    snprintf(want, sizeof want, "Command.call.op: invalid UTF-8 %s; strings must be UTF-8 without NUL",
             bad[i].want);
    cr_assert_str_eq(why, want, "case %zu", i);
  }
}

Test(proto_check, repeated_fields_and_oneof_members_are_named_with_their_index) {
  /* Call{op: "cat", args: [Arg{ref: 4}, Arg{refs: {}}, Arg{s: "a\0"}]} */
  buf_t a0 = {0}, a1 = {0}, a2 = {0}, call = {0}, cmd = {0};
  put_byte(&a0, VARINT(1));
  put_byte(&a0, 4);
  put_len(&a1, 9, "", 0);
  put_len(&a2, 7, "a\0", 2);
  put_len(&call, 1, "cat", 3);
  put_msg(&call, 2, &a0);
  put_msg(&call, 2, &a1);
  put_msg(&call, 2, &a2);
  put_msg(&cmd, 14, &call);
  cr_assert_eq(check(CMD, &cmd), -1);
  cr_assert_str_eq(why, "Command.call.args[2].s: embedded NUL at byte 1; strings must be UTF-8 without NUL");

  /* a Kwarg's name, then its value's string */
  buf_t v = {0}, kw = {0};
  call.n = cmd.n = 0;
  put_len(&v, 7, "\xc3", 1);
  put_len(&kw, 1, "alpha", 5);
  put_msg(&kw, 2, &v);
  put_len(&call, 1, "add", 3);
  put_msg(&call, 3, &kw);
  put_msg(&cmd, 14, &call);
  cr_assert_eq(check(CMD, &cmd), -1);
  cr_assert_str_eq(why, "Command.call.kwargs[0].value.s: invalid UTF-8 at byte 0 (0xc3); strings must be UTF-8 without NUL");

  /* Reduce.dims is a repeated string */
  buf_t red = {0};
  cmd.n = 0;
  put_len(&red, 3, "host", 4);
  put_len(&red, 3, "g\0pu", 4);
  put_msg(&cmd, 15, &red);
  cr_assert_eq(check(CMD, &cmd), -1);
  cr_assert_str_eq(why, "Command.reduce.dims[1]: embedded NUL at byte 1; strings must be UTF-8 without NUL");

  /* SliceMesh.selectors[1].dim, where the selector's oneof holds a Range */
  buf_t s0 = {0}, s1 = {0}, range = {0}, sm = {0};
  cmd.n = 0;
  put_len(&s0, 1, "host", 4);
  put_byte(&s0, VARINT(2));
  put_byte(&s0, 1);
  put_byte(&range, VARINT(3));
  put_byte(&range, 2);
  put_msg(&s1, 3, &range);
  put_len(&s1, 1, "gpu\0", 4);
  put_msg(&sm, 3, &s0);
  put_msg(&sm, 3, &s1);
  put_msg(&cmd, 11, &sm);
  cr_assert_eq(check(CMD, &cmd), -1);
  cr_assert_str_eq(why, "Command.slice_mesh.selectors[1].dim: embedded NUL at byte 3; strings must be UTF-8 without NUL");
}

Test(proto_check, other_messages_are_named_by_their_own_type) {
  buf_t req = {0};
  put_len(&req, 1, "me\0", 3);
  cr_assert_eq(check(&meshd__v1__create_session_request__descriptor, &req), -1);
  cr_assert_str_eq(why, "CreateSessionRequest.client_name: embedded NUL at byte 2; strings must be UTF-8 without NUL");
}

Test(proto_check, bytes_unknown_fields_and_scalars_are_not_strings) {
  /* UploadChunk.data is bytes: anything goes */
  buf_t chunk = {0};
  put_len(&chunk, 2, "\0\xff\xfe", 3);
  cr_assert_eq(check(&meshd__v1__upload_chunk__descriptor, &chunk), 0, "%s", why);
  /* an unknown length-delimited field, a fixed64, a fixed32, a varint, packed int64s */
  buf_t f = {0}, cmd = {0};
  put_len(&f, 5, "\x02\x03", 2); /* Factory.shape, packed */
  put_len(&f, 14, "\0\xff", 2); /* unknown to Factory */
  put_byte(&f, (uint8_t)(7 << 3 | 1)); /* Factory.value, a double */
  put(&f, "\0\0\0\0\0\0\xf0\x3f", 8);
  put_byte(&f, (uint8_t)(15 << 3 | 5));
  put(&f, "\xff\xff\xff\xff", 4);
  put_len(&f, 4, "zeros", 5);
  put_msg(&cmd, 13, &f);
  put_byte(&cmd, VARINT(1));
  put(&cmd, "\xff\xff\x03", 3); /* seq */
  cr_assert_eq(check(CMD, &cmd), 0, "%s", why);
}

Test(proto_check, malformed_bytes_are_refused_not_read_past) {
  static const struct {
    const char *bytes;
    size_t n;
    const char *want;
  } bad[] = {
      {"\x72\x06\x0a\x03" "add", 7, "Command: not a valid meshd.v1.Command: field 14 runs past the end"},
      {"\x72\x04\x0a\x03" "add", 7, "Command.call: not a valid meshd.v1.Call: field 1 runs past"},
      {"\x08", 1, "varint is cut off"},
      {"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\x7f", 11, "longer than 64 bits"}, /* > 64 bits */
      {"\xf9", 1, "field tag at byte 0 is cut off"},
      {"\x00\x01", 2, "field number 0 at byte 0"},
      {"\x0b\x0c", 2, "wire type 3 (groups are not supported)"},
      {"\x39\x01\x02", 3, "field 7 is cut off"}, /* a fixed64 with 2 bytes */
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    buf_t b = {0};
    put(&b, bad[i].bytes, bad[i].n);
    cr_assert_eq(check(CMD, &b), -1, "case %zu accepted", i);
    cr_assert(strstr(why, bad[i].want), "case %zu: '%s' lacks '%s'", i, why, bad[i].want);
  }
}

/* A message type that holds itself, to reach the depth bound (meshd's own
 * protos nest at most 5 deep). */
typedef struct node {
  ProtobufCMessage base;
  struct node *child;
  char *name;
} node_t;
static const ProtobufCMessageDescriptor node_descriptor;
static const ProtobufCFieldDescriptor node_fields[] = {
    {"child", 1, PROTOBUF_C_LABEL_NONE, PROTOBUF_C_TYPE_MESSAGE, 0, offsetof(node_t, child),
     &node_descriptor, NULL, 0, 0, NULL, NULL},
    {"name", 2, PROTOBUF_C_LABEL_NONE, PROTOBUF_C_TYPE_STRING, 0, offsetof(node_t, name), NULL,
     NULL, 0, 0, NULL, NULL},
};
static const unsigned node_by_name[] = {0, 1};
static const ProtobufCIntRange node_ranges[] = {{1, 0}, {0, 2}};
static const ProtobufCMessageDescriptor node_descriptor = {
    PROTOBUF_C__MESSAGE_DESCRIPTOR_MAGIC, "test.Node", "Node", "Node", "test", sizeof(node_t), 2,
    node_fields, node_by_name, 1, node_ranges, NULL, NULL, NULL, NULL};

/* `depth` children deep, the innermost named `name`. */
static buf_t nested(int depth, const char *name, size_t n) {
  buf_t b = {0};
  put_len(&b, 2, name, n);
  for (int i = 0; i < depth; i++) {
    buf_t outer = {0};
    put_msg(&outer, 1, &b);
    b = outer;
  }
  return b;
}

Test(proto_check, nesting_is_bounded) {
  buf_t b = nested(PROTO_CHECK_MAX_DEPTH, "leaf", 4);
  cr_assert_eq(check(&node_descriptor, &b), 0, "%s", why);
  b = nested(PROTO_CHECK_MAX_DEPTH, "le\0f", 4);
  cr_assert_eq(check(&node_descriptor, &b), -1);
  cr_assert(strstr(why, "Node.child.child.") == why, "%s", why);
  cr_assert(strstr(why, ".child.name: embedded NUL at byte 2"), "%s", why);
  b = nested(PROTO_CHECK_MAX_DEPTH + 1, "leaf", 4);
  cr_assert_eq(check(&node_descriptor, &b), -1);
  cr_assert(strstr(why, "messages nested more than 32 deep"), "%s", why);
}

Test(proto_check, a_short_or_missing_err_buffer_is_safe) {
  buf_t cmd = call_op("add\0evil", 8);
  cr_assert_eq(proto_check_strings(CMD, cmd.b, cmd.n, NULL, 0), -1);
  char small[12];
  memset(small, 'x', sizeof small);
  cr_assert_eq(proto_check_strings(CMD, cmd.b, cmd.n, small, sizeof small), -1);
  cr_assert_str_eq(small, "Command.cal");
  cr_assert_eq(proto_check_strings(CMD, NULL, 0, small, sizeof small), 0);
  cr_assert_eq(proto_check_strings(NULL, cmd.b, cmd.n, small, sizeof small), -1);
}

Test(proto_check, what_protobuf_c_packs_passes) {
  Meshd__V1__Command c = MESHD__V1__COMMAND__INIT;
  Meshd__V1__Call call = MESHD__V1__CALL__INIT;
  Meshd__V1__Arg a = MESHD__V1__ARG__INIT, *args[] = {&a};
  a.value_case = MESHD__V1__ARG__VALUE_S;
  a.s = "r\xc3\xa9sum\xc3\xa9";
  call.op = "add";
  call.n_args = 1;
  call.args = args;
  c.kind_case = MESHD__V1__COMMAND__KIND_CALL;
  c.call = &call;
  c.seq = 1u << 20;
  uint8_t wire[128];
  size_t n = meshd__v1__command__pack(&c, wire);
  cr_assert_eq(proto_check_strings(CMD, wire, n, why, sizeof why), 0, "%s", why);
}

Test(proto_check, random_bytes_never_crash) {
  uint64_t x = 0x9e3779b97f4a7c15ull;
  uint8_t b[64];
  int refused = 0;
  for (int round = 0; round < 20000; round++) {
    size_t n = (size_t)(x % sizeof b);
    for (size_t i = 0; i < n; i++) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      b[i] = (uint8_t)x;
    }
    refused += proto_check_strings(CMD, b, n, why, sizeof why) != 0;
    cr_assert_lt(strlen(why), sizeof why);
  }
  cr_assert_gt(refused, 0);
}

/* rpc_wire.c's arena: a batch of many commands, each with strings, repeated
 * fields and nested messages, unpacks into the arena as it does with malloc
 * (repacked byte for byte), in a handful of blocks; a message with a bad
 * string is refused the same way. Under ASan a block overrun shows here. */
#include <grpc/grpc.h>

#include "rpc_wire.h"

Test(proto_check, arena_unpack_matches_malloc_unpack) {
  grpc_init();
  enum { N = 600 };
  static Meshd__V1__Command cmds[N], *ptrs[N];
  static Meshd__V1__Call calls[N];
  static Meshd__V1__Arg args[N][2], *argp[N][2];
  static uint64_t results[N];
  static char ops[N][48];
  for (int i = 0; i < N; i++) {
    meshd__v1__command__init(&cmds[i]);
    meshd__v1__call__init(&calls[i]);
    for (int k = 0; k < 2; k++) {
      meshd__v1__arg__init(&args[i][k]);
      argp[i][k] = &args[i][k];
    }
    args[i][0].value_case = MESHD__V1__ARG__VALUE_REF;
    args[i][0].ref = (uint64_t)i + 1;
    args[i][1].value_case = MESHD__V1__ARG__VALUE_F;
    args[i][1].f = i * 0.5;
    snprintf(ops[i], sizeof ops[i], "op_%d%s", i, i % 7 ? "" : "_with_a_longer_name");
    calls[i].op = ops[i];
    calls[i].n_args = 2;
    calls[i].args = argp[i];
    results[i] = 1000u + (unsigned)i;
    calls[i].n_results = 1;
    calls[i].results = &results[i];
    cmds[i].seq = (uint64_t)i + 1;
    cmds[i].kind_case = MESHD__V1__COMMAND__KIND_CALL;
    cmds[i].call = &calls[i];
    ptrs[i] = &cmds[i];
  }
  Meshd__V1__Command batch = MESHD__V1__COMMAND__INIT;
  batch.n_batch = N;
  batch.batch = ptrs;
  size_t len = protobuf_c_message_get_packed_size(&batch.base);
  uint8_t *want = malloc(len), *got = malloc(len);
  protobuf_c_message_pack(&batch.base, want);
  grpc_byte_buffer *buf = wire_pack(&batch.base);
  char why[256];
  wire_arena_t *arena = NULL;
  ProtobufCMessage *m = wire_unpack_arena(buf, &meshd__v1__command__descriptor, why, sizeof why, &arena);
  cr_assert_not_null(m, "%s", why);
  cr_assert_not_null(arena);
  const Meshd__V1__Command *c = (const void *)m;
  cr_assert_eq(c->n_batch, N);
  cr_assert_str_eq(c->batch[7]->call->op, "op_7_with_a_longer_name");
  cr_assert_eq(c->batch[N - 1]->call->args[1]->f, (N - 1) * 0.5);
  cr_assert_eq(protobuf_c_message_get_packed_size(m), len);
  protobuf_c_message_pack(m, got);
  cr_assert_eq(memcmp(got, want, len), 0, "repacked bytes differ");
  wire_arena_free(arena);
  grpc_byte_buffer_destroy(buf);

  /* A NUL inside a string: refused with the field named, and nothing leaks. */
  calls[3].op = "ad";
  size_t n3 = protobuf_c_message_get_packed_size(&batch.base);
  uint8_t *bad = malloc(n3);
  protobuf_c_message_pack(&batch.base, bad);
  uint8_t *at = memmem(bad, n3, "\x02" "ad", 3); /* the op's length and bytes */
  cr_assert_not_null(at);
  at[2] = 0; /* "a\0": same length */
  grpc_slice s = grpc_slice_from_copied_buffer((const char *)bad, n3);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  arena = (wire_arena_t *)1;
  cr_assert_null(wire_unpack_arena(bb, &meshd__v1__command__descriptor, why, sizeof why, &arena));
  cr_assert_null(arena);
  cr_assert(strstr(why, "NUL") && strstr(why, "batch[3].call.op"), "%s", why);
  grpc_byte_buffer_destroy(bb);
  free(bad);
  free(want);
  free(got);
  grpc_shutdown();
}
