#include "rpc_wire.h"

#include "proto_check.h"

#include <grpc/byte_buffer_reader.h>
#include <openssl/crypto.h>
#include <grpc/slice.h>
#include <grpc/support/log.h>
#include <grpc/support/time.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "log.h"
#include "rpc.h"
#include "runtime.h"

grpc_byte_buffer *wire_pack(const ProtobufCMessage *msg) {
  if (!msg) return NULL;
  size_t len = protobuf_c_message_get_packed_size(msg);
  grpc_slice s = grpc_slice_malloc(len);
  protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(s));
  grpc_byte_buffer *buf = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  return buf;
}

/* Blocks of an arena: the first sized from the packed message, each next
 * twice the last (or the request, if larger). */
typedef struct arena_block {
  struct arena_block *next;
  size_t cap, used;
  max_align_t data[];
} arena_block_t;

/* Messages below this many packed bytes get a first block of 8 times that. */
#define ARENA_SMALL (64 * 1024)

struct wire_arena {
  ProtobufCAllocator allocator; /* first: protobuf-c's allocator_data is the arena */
  arena_block_t *head;
  size_t next_cap;
};

static void *arena_alloc(void *data, size_t n) {
  wire_arena_t *a = data;
  n = (n + sizeof(max_align_t) - 1) / sizeof(max_align_t) * sizeof(max_align_t);
  arena_block_t *b = a->head;
  if (!b || b->cap - b->used < n) {
    size_t cap = a->next_cap > n ? a->next_cap : n;
    if (!(b = malloc(sizeof *b + cap))) return NULL;
    b->cap = cap;
    b->used = 0;
    b->next = a->head;
    a->head = b;
    a->next_cap = cap * 2;
  }
  void *p = (char *)b->data + b->used;
  b->used += n;
  return p;
}

static void arena_free(void *data, void *p) {
  (void)data, (void)p; /* freed with the arena */
}

void wire_arena_free(wire_arena_t *a) {
  if (!a) return;
  for (arena_block_t *b = a->head, *next; b; b = next) {
    next = b->next;
    free(b);
  }
  free(a);
}

/* unpack: protobuf_c_message_unpack with the allocator (NULL: malloc's). */
static ProtobufCMessage *unpack(grpc_byte_buffer *buf, const ProtobufCMessageDescriptor *desc,
                                char *why, size_t whylen, ProtobufCAllocator *allocator) {
  grpc_byte_buffer_reader r;
  if (why && whylen) why[0] = '\0';
  if (!buf || !grpc_byte_buffer_reader_init(&r, buf)) return NULL;
  grpc_slice s = grpc_byte_buffer_reader_readall(&r);
  grpc_byte_buffer_reader_destroy(&r);
  ProtobufCMessage *msg =
      protobuf_c_message_unpack(desc, allocator, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
  /* protobuf-c reads strings as C strings: "add\0evil" would become "add". */
  if (msg && why &&
      proto_check_strings(desc, GRPC_SLICE_START_PTR(s), GRPC_SLICE_LENGTH(s), why, whylen) != 0) {
    protobuf_c_message_free_unpacked(msg, allocator);
    msg = NULL;
  }
  grpc_slice_unref(s);
  return msg;
}

ProtobufCMessage *wire_unpack(grpc_byte_buffer *buf, const ProtobufCMessageDescriptor *desc,
                              char *why, size_t whylen) {
  return unpack(buf, desc, why, whylen, NULL);
}

ProtobufCMessage *wire_unpack_arena(grpc_byte_buffer *buf, const ProtobufCMessageDescriptor *desc,
                                    char *why, size_t whylen, wire_arena_t **arena) {
  *arena = NULL;
  wire_arena_t *a = calloc(1, sizeof *a);
  if (!a) return NULL;
  a->allocator = (ProtobufCAllocator){arena_alloc, arena_free, a};
  /* Unpacked, a batch of tiny instructions takes about 7 times its packed bytes
   * (structs, pointers), a chunk of tensor bytes barely more than them. Small
   * messages get room for the first at once; a large one starts at its size
   * and a quarter, since 8 times a 1 MiB chunk is past malloc's mmap threshold
   * (runtime_tune_malloc): a fresh mapping, faulted page by page, per chunk. */
  size_t len = buf ? grpc_byte_buffer_length(buf) : 0;
  a->next_cap = len < ARENA_SMALL ? len * 8 + 1024 : len + len / 4 + 1024;
  ProtobufCMessage *msg = unpack(buf, desc, why, whylen, &a->allocator);
  if (!msg) {
    wire_arena_free(a);
    return NULL;
  }
  *arena = a;
  return msg;
}

void wire_args_int(wire_args_t *a, const char *key, int value) {
  size_t n = a->ca.num_args;
  if (n >= sizeof a->args / sizeof a->args[0]) return;
  a->args[n].type = GRPC_ARG_INTEGER;
  a->args[n].key = (char *)key;
  a->args[n].value.integer = value;
  a->ca.num_args = n + 1;
}

void wire_args_str(wire_args_t *a, const char *key, const char *value) {
  size_t n = a->ca.num_args;
  if (n >= sizeof a->args / sizeof a->args[0]) return;
  a->args[n].type = GRPC_ARG_STRING;
  a->args[n].key = (char *)key;
  a->args[n].value.string = (char *)value;
  a->ca.num_args = n + 1;
}

void wire_args_ptr(wire_args_t *a, const char *key, void *p, const grpc_arg_pointer_vtable *vt) {
  size_t n = a->ca.num_args;
  if (n >= sizeof a->args / sizeof a->args[0]) return;
  a->args[n].type = GRPC_ARG_POINTER;
  a->args[n].key = (char *)key;
  a->args[n].value.pointer.p = p;
  a->args[n].value.pointer.vtable = vt;
  a->ca.num_args = n + 1;
}

const grpc_channel_args *wire_args_done(wire_args_t *a) {
  a->ca.args = a->args;
  return &a->ca;
}

gpr_timespec wire_deadline(int timeout_ms) {
  if (timeout_ms <= 0) return gpr_inf_future(GPR_CLOCK_MONOTONIC);
  return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
}

static pthread_mutex_t init_mu = PTHREAD_MUTEX_INITIALIZER;
static int init_count;

/* gRPC's own messages go through our log, in our format: its errors are
 * usually a second view of something we report (a failed bind), so they are
 * warnings, and its info chatter is debug. */
static void grpc_log(gpr_log_func_args *a) {
  log_level_t level = a->severity == GPR_LOG_SEVERITY_ERROR  ? LOG_LEVEL_WARN
                      : a->severity == GPR_LOG_SEVERITY_INFO ? LOG_LEVEL_DEBUG
                                                             : LOG_LEVEL_DEBUG;
  log_write(level, "grpc", a->file, a->line, "%s", a->message);
}

void rpc_init(void) {
  pthread_mutex_lock(&init_mu);
  if (init_count == 0) {
    gpr_set_log_function(grpc_log);
    /* OpenSSL (gRPC's TLS) frees its globals at exit unless told not to, and a
     * gRPC thread that made a TLS handshake may still be running then (an agent
     * stopped while it retries a refused registration): its per-thread random
     * generators, freed by a thread-exit hook that the clean-up removed, leak.
     * Kept, they stay reachable, and the kernel takes them with the process.
     * First call wins; a process that used OpenSSL before this keeps its choice. */
    OPENSSL_init_crypto(OPENSSL_INIT_NO_ATEXIT, NULL);
  }
  if (init_count++ == 0) grpc_init();
  pthread_mutex_unlock(&init_mu);
}

void rpc_shutdown(void) {
  pthread_mutex_lock(&init_mu);
  if (init_count > 0 && --init_count == 0) {
    rpc_loop_stop(); /* its last client events go to the client thread */
    rpc_client_stop_thread();
    /* Blocking: grpc_shutdown may leave its clean-up to a thread of its own,
     * which a process that exits next (meshctl after a failed TLS handshake,
     * with retries still in flight) tears down mid-way: SIGSEGV at exit. */
    grpc_shutdown_blocking();
  }
  pthread_mutex_unlock(&init_mu);
}

int64_t rpc_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

const char *meshd_grpc_code_name(grpc_status_code c) {
  switch (c) {
  case GRPC_STATUS_OK: return "OK";
  case GRPC_STATUS_CANCELLED: return "CANCELLED";
  case GRPC_STATUS_UNKNOWN: return "UNKNOWN";
  case GRPC_STATUS_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
  case GRPC_STATUS_DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
  case GRPC_STATUS_NOT_FOUND: return "NOT_FOUND";
  case GRPC_STATUS_ALREADY_EXISTS: return "ALREADY_EXISTS";
  case GRPC_STATUS_PERMISSION_DENIED: return "PERMISSION_DENIED";
  case GRPC_STATUS_RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
  case GRPC_STATUS_FAILED_PRECONDITION: return "FAILED_PRECONDITION";
  case GRPC_STATUS_ABORTED: return "ABORTED";
  case GRPC_STATUS_OUT_OF_RANGE: return "OUT_OF_RANGE";
  case GRPC_STATUS_UNIMPLEMENTED: return "UNIMPLEMENTED";
  case GRPC_STATUS_INTERNAL: return "INTERNAL";
  case GRPC_STATUS_UNAVAILABLE: return "UNAVAILABLE";
  case GRPC_STATUS_DATA_LOSS: return "DATA_LOSS";
  case GRPC_STATUS_UNAUTHENTICATED: return "UNAUTHENTICATED";
  default:
    /* The gRPC spec treats codes outside 0..16 as UNKNOWN. */
    return "UNKNOWN";
  }
}

/* ------------------------------------------------------------------ raw messages */

static size_t varint_put(uint8_t *p, uint64_t v) {
  size_t n = 0;
  do {
    p[n++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
    v >>= 7;
  } while (v);
  return n;
}

/* A varint at p[0..len): its value and size, 0 when it does not end there. */
static size_t varint_get(const uint8_t *p, size_t len, uint64_t *v) {
  *v = 0;
  for (size_t i = 0; i < len && i < 10; i++) {
    *v |= (uint64_t)(p[i] & 0x7f) << (7 * i);
    if (!(p[i] & 0x80)) return i + 1;
  }
  return 0;
}

rpc_bytes_t *rpc_bytes_field(uint32_t field, size_t len, uint8_t **data) {
  enum { ALIGN = 16 };
  uint8_t head[20];
  size_t h = varint_put(head, ((uint64_t)field << 3) | 2);
  h += varint_put(head + h, len);
  /* Refcounted even when small: an inlined slice's bytes live in the slice
   * struct itself, which the buffer copies, so *data would point at ours.
   * The bytes start 16-byte aligned (a tensor's elements are read into
   * them): the header sits just before, in a sub-slice of the same memory. */
  grpc_slice whole = grpc_slice_malloc_large(ALIGN + h + len);
  uint8_t *base = GRPC_SLICE_START_PTR(whole);
  size_t pad = (ALIGN - ((uintptr_t)(base + h) % ALIGN)) % ALIGN;
  memcpy(base + pad, head, h);
  *data = base + pad + h;
  /* Our reference to `whole` moves to the sub-slice (grpc_slice_sub would
   * copy a short one inline, away from *data). */
  grpc_slice s = grpc_slice_sub_no_ref(whole, pad, pad + h + len);
  grpc_byte_buffer *buf = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s); /* the buffer holds its own reference to the same bytes */
  return buf;
}

struct rpc_hold {
  pthread_mutex_t mu;
  pthread_cond_t released;
  size_t refs; /* the caller's, and one per message gRPC holds */
  size_t held; /* messages gRPC holds */
};

rpc_hold_t *rpc_hold_create(void) {
  rpc_hold_t *h = calloc(1, sizeof *h);
  if (!h) return NULL;
  pthread_mutex_init(&h->mu, NULL);
  pthread_cond_init(&h->released, NULL);
  h->refs = 1;
  return h;
}

static void hold_unref_locked(rpc_hold_t *h) { /* unlocks; frees after the last */
  bool last = --h->refs == 0;
  pthread_mutex_unlock(&h->mu);
  if (!last) return;
  pthread_cond_destroy(&h->released);
  pthread_mutex_destroy(&h->mu);
  free(h);
}

static void hold_let_go(void *arg) { /* gRPC freed a message's referenced bytes */
  rpc_hold_t *h = arg;
  pthread_mutex_lock(&h->mu);
  if (--h->held == 0) pthread_cond_broadcast(&h->released);
  hold_unref_locked(h);
}

bool rpc_hold_wait(rpc_hold_t *h, int timeout_ms) {
  struct timespec dl;
  if (timeout_ms >= 0) runtime_deadline(&dl, CLOCK_REALTIME, timeout_ms);
  pthread_mutex_lock(&h->mu);
  int rc = 0;
  while (h->held > 0 && rc == 0)
    rc = timeout_ms < 0 ? pthread_cond_wait(&h->released, &h->mu)
                        : pthread_cond_timedwait(&h->released, &h->mu, &dl);
  bool none = h->held == 0;
  pthread_mutex_unlock(&h->mu);
  return none;
}

void rpc_hold_release(rpc_hold_t *h) {
  if (!h) return;
  pthread_mutex_lock(&h->mu);
  hold_unref_locked(h);
}

rpc_bytes_t *rpc_bytes_field_ref(uint32_t field, const void *data, size_t len, rpc_hold_t *hold) {
  uint8_t head[20];
  size_t h = varint_put(head, ((uint64_t)field << 3) | 2);
  h += varint_put(head + h, len);
  pthread_mutex_lock(&hold->mu);
  hold->refs++;
  hold->held++;
  pthread_mutex_unlock(&hold->mu);
  /* The slice's destroy runs once gRPC and we both let go of it (for len 0
   * at once, below). */
  grpc_slice s[2] = {grpc_slice_from_copied_buffer((const char *)head, h),
                     grpc_slice_new_with_user_data((void *)data, len, hold_let_go, hold)};
  grpc_byte_buffer *buf = grpc_raw_byte_buffer_create(s, 2);
  grpc_slice_unref(s[0]);
  grpc_slice_unref(s[1]);
  return buf;
}

rpc_bytes_t *rpc_bytes_pack(const ProtobufCMessage *msg) { return wire_pack(msg); }

rpc_bytes_t *rpc_bytes_share(rpc_bytes_t *msg) { return grpc_byte_buffer_copy(msg); }

rpc_bytes_t *rpc_bytes_copy(const void *data, size_t len) {
  grpc_slice s = grpc_slice_from_copied_buffer(data, len);
  grpc_byte_buffer *buf = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  return buf;
}

/* The field's tag and length: two varints at the start of msg, which may lie
 * across slices (a message's first slice can be as short as the network read
 * that ended in it). How many bytes they take, or 0 when they do not parse. */
static size_t field_head(rpc_bytes_t *msg, uint64_t *tag, uint64_t *size) {
  uint8_t head[20];
  size_t h = 0;
  const grpc_slice_buffer *sb = &msg->data.raw.slice_buffer;
  for (size_t i = 0; i < sb->count && h < sizeof head; i++) {
    size_t n = GRPC_SLICE_LENGTH(sb->slices[i]);
    if (n > sizeof head - h) n = sizeof head - h;
    memcpy(head + h, GRPC_SLICE_START_PTR(sb->slices[i]), n);
    h += n;
  }
  size_t a, b;
  if (!(a = varint_get(head, h, tag)) || !(b = varint_get(head + a, h - a, size))) return 0;
  return a + b;
}

bool rpc_bytes_is_field(rpc_bytes_t *msg, uint32_t field, size_t *len) {
  if (!msg || msg->type != GRPC_BB_RAW || msg->data.raw.compression != GRPC_COMPRESS_NONE ||
      msg->data.raw.slice_buffer.count == 0)
    return false;
  uint64_t tag, size;
  size_t h = field_head(msg, &tag, &size);
  if (!h || tag != (((uint64_t)field << 3) | 2) || size > SIZE_MAX - h ||
      h + size != grpc_byte_buffer_length(msg))
    return false;
  *len = (size_t)size;
  return true;
}

int rpc_bytes_field_visit(rpc_bytes_t *msg, int (*fn)(const uint8_t *piece, size_t n, void *arg),
                          void *arg) {
  grpc_slice_buffer *sb = &msg->data.raw.slice_buffer;
  uint64_t tag, size;
  size_t skip = sb->count ? field_head(msg, &tag, &size) : 0; /* the tag and the length */
  for (size_t i = 0; i < sb->count; i++) {
    const uint8_t *p = GRPC_SLICE_START_PTR(sb->slices[i]);
    size_t n = GRPC_SLICE_LENGTH(sb->slices[i]);
    if (skip >= n) {
      skip -= n;
      continue;
    }
    int rc = fn(p + skip, n - skip, arg);
    skip = 0;
    if (rc) return rc;
  }
  return 0;
}

ProtobufCMessage *rpc_bytes_unpack(rpc_bytes_t *msg, const ProtobufCMessageDescriptor *desc) {
  return wire_unpack(msg, desc, NULL, 0);
}

long rpc_bytes_read(rpc_bytes_t *msg, uint8_t **buf, size_t *cap) {
  size_t len = grpc_byte_buffer_length(msg); /* the bytes as received */
  grpc_byte_buffer_reader r;
  if (!grpc_byte_buffer_reader_init(&r, msg)) return -1;
  size_t n = 0;
  grpc_slice s;
  long ret = 0;
  while (grpc_byte_buffer_reader_next(&r, &s)) {
    size_t sl = GRPC_SLICE_LENGTH(s);
    if (n + sl > *cap) {
      size_t want = n + sl > len ? n + sl : len; /* decompressed can be longer */
      size_t c = *cap * 2 > want ? *cap * 2 : want;
      uint8_t *p = realloc(*buf, c);
      if (!p) {
        grpc_slice_unref(s);
        ret = -1;
        break;
      }
      *buf = p;
      *cap = c;
    }
    memcpy(*buf + n, GRPC_SLICE_START_PTR(s), sl);
    n += sl;
    grpc_slice_unref(s);
  }
  grpc_byte_buffer_reader_destroy(&r);
  return ret < 0 ? -1 : (long)n;
}

void rpc_bytes_free(rpc_bytes_t *msg) {
  if (msg) grpc_byte_buffer_destroy(msg);
}
