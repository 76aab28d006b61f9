#include "reflection_index.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "descriptor_subset.pb-c.h"

typedef Google__Protobuf__FileDescriptorProto file_proto_t;
typedef Google__Protobuf__DescriptorProto message_proto_t;
typedef Google__Protobuf__EnumDescriptorProto enum_proto_t;
typedef Google__Protobuf__FieldDescriptorProto field_proto_t;

typedef struct symbol {
  char *name;
  int file;
  refl_symbol_kind_t kind;
} symbol_t;

typedef struct extension {
  char *extendee; /* without the leading dot */
  int32_t number;
  int file;
} extension_t;

typedef struct file {
  char *name;
  const uint8_t *bytes; /* into the set */
  size_t len;
  int *deps;
  size_t ndeps;
} file_t;

struct refl_index {
  file_t *files;
  size_t nfiles;
  symbol_t *syms;
  size_t nsyms, symcap;
  extension_t *exts;
  size_t nexts, extcap;
  /* While building: the file being walked, and the first error. */
  int cur;
  char *err;
  size_t errlen;
  bool failed;
};

const char *refl_symbol_kind_name(refl_symbol_kind_t k) {
  switch (k) {
#define X(e, s) \
  case e: return s;
    REFL_SYMBOL_KINDS(X)
#undef X
  }
  return "?";
}

__attribute__((format(printf, 2, 3))) static void fail(refl_index_t *ix, const char *fmt, ...) {
  if (ix->failed) return;
  ix->failed = true;
  if (!ix->err || !ix->errlen) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(ix->err, ix->errlen, fmt, ap);
  va_end(ap);
}

/* "scope.name", or "name" at the top level; NULL (and the index failed) when
 * the descriptor has no name or memory ran out. */
static char *join(refl_index_t *ix, const char *scope, const char *name, const char *what) {
  if (!name || !*name) {
    fail(ix, "descriptor set: %s: a %s without a name", ix->files[ix->cur].name, what);
    return NULL;
  }
  size_t a = scope ? strlen(scope) : 0, b = strlen(name);
  char *s = malloc(a + b + 2);
  if (!s) {
    fail(ix, "out of memory");
    return NULL;
  }
  if (a) {
    memcpy(s, scope, a);
    s[a++] = '.';
  }
  memcpy(s + a, name, b + 1);
  return s;
}

/* Takes `name` (malloc'd; NULL is ignored). */
static void add_symbol(refl_index_t *ix, char *name, refl_symbol_kind_t kind) {
  if (!name) return;
  if (ix->nsyms == ix->symcap) {
    size_t cap = ix->symcap ? ix->symcap * 2 : 256;
    symbol_t *s = realloc(ix->syms, cap * sizeof *s);
    if (!s) {
      free(name);
      fail(ix, "out of memory");
      return;
    }
    ix->syms = s;
    ix->symcap = cap;
  }
  ix->syms[ix->nsyms++] = (symbol_t){name, ix->cur, kind};
}

static void add_extensions(refl_index_t *ix, const char *scope, field_proto_t **f, size_t n) {
  for (size_t i = 0; i < n; i++) {
    add_symbol(ix, join(ix, scope, f[i]->name, "extension"), REFL_EXTENSION);
    const char *extendee = f[i]->extendee ? f[i]->extendee : "";
    if (*extendee == '.') extendee++;
    if (ix->nexts == ix->extcap) {
      size_t cap = ix->extcap ? ix->extcap * 2 : 16;
      extension_t *e = realloc(ix->exts, cap * sizeof *e);
      if (!e) {
        fail(ix, "out of memory");
        return;
      }
      ix->exts = e;
      ix->extcap = cap;
    }
    char *copy = strdup(extendee);
    if (!copy) {
      fail(ix, "out of memory");
      return;
    }
    ix->exts[ix->nexts++] = (extension_t){copy, f[i]->number, ix->cur};
  }
}

/* Enum values are siblings of their enum (C++ scoping, as protoc names them),
 * and also found under the enum's own name, as people write them. */
static void add_enums(refl_index_t *ix, const char *scope, enum_proto_t **e, size_t n) {
  for (size_t i = 0; i < n; i++) {
    char *full = join(ix, scope, e[i]->name, "enum");
    if (!full) return;
    for (size_t v = 0; v < e[i]->n_value; v++) {
      add_symbol(ix, join(ix, scope, e[i]->value[v]->name, "enum value"), REFL_ENUM_VALUE);
      add_symbol(ix, join(ix, full, e[i]->value[v]->name, "enum value"), REFL_ENUM_VALUE);
    }
    add_symbol(ix, full, REFL_ENUM);
  }
}

static void add_messages(refl_index_t *ix, const char *scope, message_proto_t **m, size_t n) {
  for (size_t i = 0; i < n && !ix->failed; i++) {
    char *full = join(ix, scope, m[i]->name, "message");
    if (!full) return;
    for (size_t k = 0; k < m[i]->n_field; k++)
      add_symbol(ix, join(ix, full, m[i]->field[k]->name, "field"), REFL_FIELD);
    for (size_t k = 0; k < m[i]->n_oneof_decl; k++)
      add_symbol(ix, join(ix, full, m[i]->oneof_decl[k]->name, "oneof"), REFL_ONEOF);
    add_messages(ix, full, m[i]->nested_type, m[i]->n_nested_type);
    add_enums(ix, full, m[i]->enum_type, m[i]->n_enum_type);
    add_extensions(ix, full, m[i]->extension, m[i]->n_extension);
    add_symbol(ix, full, REFL_MESSAGE);
  }
}

static void add_file(refl_index_t *ix, const file_proto_t *f) {
  const char *pkg = f->package && *f->package ? f->package : NULL;
  if (pkg) add_symbol(ix, join(ix, NULL, pkg, "package"), REFL_PACKAGE);
  add_messages(ix, pkg, f->message_type, f->n_message_type);
  add_enums(ix, pkg, f->enum_type, f->n_enum_type);
  add_extensions(ix, pkg, f->extension, f->n_extension);
  for (size_t i = 0; i < f->n_service; i++) {
    char *svc = join(ix, pkg, f->service[i]->name, "service");
    if (!svc) return;
    for (size_t k = 0; k < f->service[i]->n_method; k++)
      add_symbol(ix, join(ix, svc, f->service[i]->method[k]->name, "method"), REFL_METHOD);
    add_symbol(ix, svc, REFL_SERVICE);
  }
}

static bool read_varint(const uint8_t *p, size_t len, size_t *at, uint64_t *out) {
  uint64_t v = 0;
  for (int i = 0; i < 10 && *at < len; i++) {
    uint8_t b = p[(*at)++];
    v |= (uint64_t)(b & 0x7f) << (7 * i);
    if (!(b & 0x80)) {
      *out = v;
      return true;
    }
  }
  return false;
}

/* The set's files as byte ranges: a FileDescriptorSet is field 1, repeated. */
static void split_set(refl_index_t *ix, const uint8_t *set, size_t len) {
  size_t cap = 0;
  for (size_t at = 0; at < len && !ix->failed;) {
    size_t start = at;
    uint64_t tag = 0, n = 0;
    if (!read_varint(set, len, &at, &tag) || tag != ((1u << 3) | 2u) ||
        !read_varint(set, len, &at, &n) || n > len - at) {
      fail(ix, "descriptor set: byte %zu: expected a FileDescriptorSet's `file` (field 1, "
           "length-delimited, within the %zu bytes)", start, len);
      return;
    }
    if (ix->nfiles == cap) {
      cap = cap ? cap * 2 : 16;
      file_t *f = realloc(ix->files, cap * sizeof *f);
      if (!f) {
        fail(ix, "out of memory");
        return;
      }
      ix->files = f;
    }
    ix->files[ix->nfiles++] = (file_t){NULL, set + at, (size_t)n, NULL, 0};
    at += (size_t)n;
  }
}

static int by_name(const void *a, const void *b) {
  const symbol_t *x = a, *y = b;
  int c = strcmp(x->name, y->name);
  return c ? c : (x->file > y->file) - (x->file < y->file);
}

static void check_unique(refl_index_t *ix) {
  for (size_t i = 1; i < ix->nsyms && !ix->failed; i++) {
    const symbol_t *a = &ix->syms[i - 1], *b = &ix->syms[i];
    if (strcmp(a->name, b->name) != 0) continue;
    if (a->kind == REFL_PACKAGE && b->kind == REFL_PACKAGE && a->file != b->file) continue;
    fail(ix, "descriptor set: '%s' is defined twice (a %s in %s, a %s in %s)", a->name,
         refl_symbol_kind_name(a->kind), ix->files[a->file].name, refl_symbol_kind_name(b->kind),
         ix->files[b->file].name);
  }
}

/* Reads each file, indexes its names and resolves its imports. */
static void index_files(refl_index_t *ix) {
  file_proto_t **protos = calloc(ix->nfiles ? ix->nfiles : 1, sizeof *protos);
  if (!protos) {
    fail(ix, "out of memory");
    return;
  }
  for (size_t i = 0; i < ix->nfiles && !ix->failed; i++) {
    file_t *f = &ix->files[i];
    protos[i] = google__protobuf__file_descriptor_proto__unpack(NULL, f->len, f->bytes);
    if (!protos[i]) {
      fail(ix, "descriptor set: file #%zu is not a valid FileDescriptorProto", i + 1);
      break;
    }
    if (!protos[i]->name || !*protos[i]->name) {
      fail(ix, "descriptor set: file #%zu has no name", i + 1);
      break;
    }
    if (refl_index_find_file(ix, protos[i]->name) >= 0) {
      fail(ix, "descriptor set: two files are named %s", protos[i]->name);
      break;
    }
    if (!(f->name = strdup(protos[i]->name))) fail(ix, "out of memory");
  }
  for (size_t i = 0; i < ix->nfiles && !ix->failed; i++) {
    ix->cur = (int)i;
    add_file(ix, protos[i]);
    file_t *f = &ix->files[i];
    f->deps = calloc(protos[i]->n_dependency ? protos[i]->n_dependency : 1, sizeof *f->deps);
    if (!f->deps) {
      fail(ix, "out of memory");
      break;
    }
    for (size_t d = 0; d < protos[i]->n_dependency; d++) {
      int k = refl_index_find_file(ix, protos[i]->dependency[d]);
      if (k < 0) {
        fail(ix, "descriptor set: %s imports %s, which the set does not hold (protoc "
             "--include_imports)", f->name, protos[i]->dependency[d]);
        break;
      }
      f->deps[f->ndeps++] = k;
    }
  }
  for (size_t i = 0; i < ix->nfiles; i++)
    if (protos[i]) google__protobuf__file_descriptor_proto__free_unpacked(protos[i], NULL);
  free(protos);
}

refl_index_t *refl_index_create(const uint8_t *set, size_t len, char *err, size_t errlen) {
  refl_index_t *ix = calloc(1, sizeof *ix);
  if (!ix) {
    if (err && errlen) snprintf(err, errlen, "out of memory");
    return NULL;
  }
  ix->err = err;
  ix->errlen = errlen;
  split_set(ix, set, len);
  if (!ix->failed) index_files(ix);
  if (!ix->failed) {
    if (ix->nsyms) qsort(ix->syms, ix->nsyms, sizeof *ix->syms, by_name);
    check_unique(ix);
  }
  ix->err = NULL;
  ix->errlen = 0;
  if (ix->failed) {
    refl_index_destroy(ix);
    return NULL;
  }
  return ix;
}

void refl_index_destroy(refl_index_t *ix) {
  if (!ix) return;
  for (size_t i = 0; i < ix->nfiles; i++) {
    free(ix->files[i].name);
    free(ix->files[i].deps);
  }
  for (size_t i = 0; i < ix->nsyms; i++) free(ix->syms[i].name);
  for (size_t i = 0; i < ix->nexts; i++) free(ix->exts[i].extendee);
  free(ix->files);
  free(ix->syms);
  free(ix->exts);
  free(ix);
}

size_t refl_index_files(const refl_index_t *ix) { return ix->nfiles; }

const char *refl_index_file(const refl_index_t *ix, int i, const uint8_t **bytes, size_t *len) {
  if (i < 0 || (size_t)i >= ix->nfiles) return NULL;
  if (bytes) *bytes = ix->files[i].bytes;
  if (len) *len = ix->files[i].len;
  return ix->files[i].name;
}

int refl_index_find_file(const refl_index_t *ix, const char *name) {
  for (size_t i = 0; i < ix->nfiles; i++)
    if (ix->files[i].name && strcmp(ix->files[i].name, name) == 0) return (int)i;
  return -1;
}

size_t refl_index_find_symbol(const refl_index_t *ix, const char *name, int *files, size_t cap,
                              refl_symbol_kind_t *kind) {
  if (*name == '.') name++;
  size_t lo = 0, hi = ix->nsyms; /* the first entry not below name */
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (strcmp(ix->syms[mid].name, name) < 0) lo = mid + 1;
    else hi = mid;
  }
  size_t n = 0;
  for (size_t i = lo; i < ix->nsyms && strcmp(ix->syms[i].name, name) == 0; i++, n++) {
    if (n < cap) files[n] = ix->syms[i].file;
    if (kind) *kind = ix->syms[i].kind;
  }
  return n;
}

int refl_index_find_extension(const refl_index_t *ix, const char *extendee, int32_t number) {
  if (*extendee == '.') extendee++;
  for (size_t i = 0; i < ix->nexts; i++)
    if (ix->exts[i].number == number && strcmp(ix->exts[i].extendee, extendee) == 0)
      return ix->exts[i].file;
  return -1;
}

size_t refl_index_extension_numbers(const refl_index_t *ix, const char *extendee,
                                    int32_t *numbers, size_t cap) {
  if (*extendee == '.') extendee++;
  size_t n = 0;
  for (size_t i = 0; i < ix->nexts; i++) {
    if (strcmp(ix->exts[i].extendee, extendee) != 0) continue;
    if (n < cap) numbers[n] = ix->exts[i].number;
    n++;
  }
  return n;
}

static bool listed(const int *out, size_t n, int f) {
  for (size_t i = 0; i < n; i++)
    if (out[i] == f) return true;
  return false;
}

size_t refl_index_closure(const refl_index_t *ix, const int *roots, size_t nroots, int *out) {
  size_t n = 0;
  for (size_t i = 0; i < nroots; i++)
    if (roots[i] >= 0 && (size_t)roots[i] < ix->nfiles && !listed(out, n, roots[i]))
      out[n++] = roots[i];
  /* Breadth first: out doubles as the queue. */
  for (size_t q = 0; q < n; q++) {
    const file_t *f = &ix->files[out[q]];
    for (size_t d = 0; d < f->ndeps; d++)
      if (!listed(out, n, f->deps[d])) out[n++] = f->deps[d];
  }
  return n;
}
