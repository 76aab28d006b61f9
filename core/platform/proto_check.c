#include "proto_check.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#define FIELD_NUMBER_MAX 536870911u /* 2^29 - 1 */
/* Repeated fields of a message beyond this many get no [index] in the path. */
#define INDEXED_FIELDS 64

/* A message is walked twice only when it fails: first without the path, whose
 * formatting cost more than the walk itself, then with it for the message. */
typedef struct walk {
  bool naming;    /* keep the path and write err */
  char path[256]; /* "Command.call.args[1]" */
  size_t plen;
  char *err;
  size_t errlen;
} walk_t;

__attribute__((format(printf, 2, 3))) static int fail(walk_t *w, const char *fmt, ...) {
  if (!w->naming || !w->err || !w->errlen) return -1;
  int n = snprintf(w->err, w->errlen, "%s: ", w->path);
  if (n >= 0 && (size_t)n < w->errlen) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->err + n, w->errlen - (size_t)n, fmt, ap);
    va_end(ap);
  }
  return -1;
}

static bool read_varint(const uint8_t *p, size_t len, size_t *at, uint64_t *out) {
  uint64_t v = 0;
  for (int i = 0; i < 10; i++) {
    if (*at >= len) return false;
    uint8_t b = p[(*at)++];
    if (i == 9 && b > 1) return false; /* more than 64 bits */
    v |= (uint64_t)(b & 0x7f) << (7 * i);
    if (!(b & 0x80)) {
      *out = v;
      return true;
    }
  }
  return false;
}

/* Offset of the first byte that breaks "UTF-8 without NUL" (RFC 3629: no
 * overlong forms, no surrogates, nothing past U+10FFFF), or n. *nul says it
 * was a NUL; *bad is how many bytes of the offending sequence exist. */
static size_t first_bad(const uint8_t *s, size_t n, bool *nul, size_t *bad) {
  for (size_t i = 0; i < n;) {
    uint8_t c = s[i];
    if (c == 0) {
      *nul = true;
      return i;
    }
    if (c < 0x80) {
      i++;
      continue;
    }
    size_t k;
    uint32_t cp, min;
    if (c >= 0xc2 && c <= 0xdf) {
      k = 2, cp = c & 0x1fu, min = 0x80;
    } else if ((c & 0xf0) == 0xe0) {
      k = 3, cp = c & 0x0fu, min = 0x800;
    } else if (c >= 0xf0 && c <= 0xf4) {
      k = 4, cp = c & 0x07u, min = 0x10000;
    } else { /* a continuation byte, 0xc0/0xc1 (overlong) or 0xf5.. */
      *bad = 1;
      return i;
    }
    for (size_t j = 1; j < k; j++) {
      if (i + j >= n || (s[i + j] & 0xc0) != 0x80) {
        *bad = i + j >= n ? j : j + 1;
        return i;
      }
      cp = cp << 6 | (s[i + j] & 0x3fu);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
      *bad = k;
      return i;
    }
    i += k;
  }
  return n;
}

static int check_string(walk_t *w, const uint8_t *s, size_t n) {
  bool nul = false;
  size_t bad = 0, at = first_bad(s, n, &nul, &bad);
  if (at == n) return 0;
  if (nul) return fail(w, "embedded NUL at byte %zu; strings must be UTF-8 without NUL", at);
  char hex[24] = "";
  for (size_t j = 0, used = 0; j < bad && j < 4; j++)
    used += (size_t)snprintf(hex + used, sizeof hex - used, "%s0x%02x", j ? " " : "", s[at + j]);
  return fail(w, "invalid UTF-8 at byte %zu (%s); strings must be UTF-8 without NUL", at, hex);
}

/* Appends ".name" (and "[i]" for a repeated field) to the path. */
static void push(walk_t *w, const ProtobufCMessageDescriptor *d, const ProtobufCFieldDescriptor *f,
                 uint32_t *seen) {
  size_t cap = sizeof w->path;
  int n;
  size_t idx = (size_t)(f - d->fields);
  if (!w->naming) return;
  if (f->label == PROTOBUF_C_LABEL_REPEATED && idx < INDEXED_FIELDS)
    n = snprintf(w->path + w->plen, cap - w->plen, ".%s[%u]", f->name, seen[idx]++);
  else
    n = snprintf(w->path + w->plen, cap - w->plen, ".%s", f->name);
  if (n > 0) w->plen = w->plen + (size_t)n < cap ? w->plen + (size_t)n : cap - 1;
}

static int walk_message(walk_t *w, const ProtobufCMessageDescriptor *d, const uint8_t *p,
                        size_t len, int depth) {
  if (depth > PROTO_CHECK_MAX_DEPTH)
    return fail(w, "messages nested more than %d deep", PROTO_CHECK_MAX_DEPTH);
  uint32_t seen[INDEXED_FIELDS] = {0};
  size_t at = 0;
  while (at < len) {
    size_t tag_at = at;
    uint64_t key, n;
    if (!read_varint(p, len, &at, &key))
      return fail(w, "not a valid %s: a field tag at byte %zu is cut off", d->name, tag_at);
    uint64_t num = key >> 3;
    unsigned type = (unsigned)(key & 7);
    if (num == 0 || num > FIELD_NUMBER_MAX)
      return fail(w, "not a valid %s: field number %llu at byte %zu", d->name,
                  (unsigned long long)num, tag_at);
    switch (type) {
      case PROTOBUF_C_WIRE_TYPE_VARINT:
        if (!read_varint(p, len, &at, &n))
          return fail(w, "not a valid %s: field %llu's varint is cut off or longer than 64 bits",
                      d->name,
                      (unsigned long long)num);
        continue;
      case PROTOBUF_C_WIRE_TYPE_64BIT:
      case PROTOBUF_C_WIRE_TYPE_32BIT: {
        size_t k = type == PROTOBUF_C_WIRE_TYPE_64BIT ? 8 : 4;
        if (len - at < k)
          return fail(w, "not a valid %s: field %llu is cut off", d->name, (unsigned long long)num);
        at += k;
        continue;
      }
      case PROTOBUF_C_WIRE_TYPE_LENGTH_PREFIXED:
        break;
      default:
        return fail(w, "not a valid %s: field %llu has wire type %u (groups are not supported)",
                    d->name, (unsigned long long)num, type);
    }
    if (!read_varint(p, len, &at, &n) || n > len - at)
      return fail(w, "not a valid %s: field %llu runs past the end of its message", d->name,
                  (unsigned long long)num);
    const uint8_t *body = p + at;
    at += (size_t)n;
    const ProtobufCFieldDescriptor *f = protobuf_c_message_descriptor_get_field(d, (unsigned)num);
    if (!f || (f->type != PROTOBUF_C_TYPE_STRING && f->type != PROTOBUF_C_TYPE_MESSAGE))
      continue; /* unknown, bytes, or packed scalars */
    size_t saved = w->plen;
    push(w, d, f, seen);
    int rc = f->type == PROTOBUF_C_TYPE_STRING
                 ? check_string(w, body, (size_t)n)
                 : walk_message(w, f->descriptor, body, (size_t)n, depth + 1);
    if (w->naming) {
      w->plen = saved;
      w->path[saved] = '\0';
    }
    if (rc) return -1;
  }
  return 0;
}

int proto_check_strings(const ProtobufCMessageDescriptor *d, const uint8_t *data, size_t len,
                        char *err, size_t errlen) {
  walk_t w = {.naming = true, .path = "message", .err = err, .errlen = errlen};
  if (err && errlen) err[0] = '\0';
  if (!d || d->magic != PROTOBUF_C__MESSAGE_DESCRIPTOR_MAGIC) return fail(&w, "no message type");
  if (!data && len) return fail(&w, "no bytes");
  w.naming = false;
  if (walk_message(&w, d, data, len, 0) == 0) return 0;
  w.naming = true; /* again, for the message */
  int n = snprintf(w.path, sizeof w.path, "%s", d->short_name ? d->short_name : d->name);
  w.plen = n > 0 && (size_t)n < sizeof w.path ? (size_t)n : 0;
  return walk_message(&w, d, data, len, 0);
}
