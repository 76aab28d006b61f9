/* The symbol index behind gRPC server reflection (reflection.h): which file of
 * a FileDescriptorSet defines a fully-qualified name, and which files that
 * file needs.
 *
 *   refl_index_t *ix = refl_index_create(set, set_len, err, sizeof err);
 *   int roots[8], files[...];   // files: room for refl_index_files(ix)
 *   size_t n = refl_index_find_symbol(ix, "meshd.v1.TensorService.Submit", roots, 8, NULL);
 *   n = refl_index_closure(ix, roots, n, files);  // roots first, then their imports, each once
 *   for (i < n) name = refl_index_file(ix, files[i], &bytes, &len);  // a FileDescriptorProto
 *
 * Names are what protoc calls full names, without the leading dot: packages
 * ("meshd.v1"), messages and nested messages ("pkg.Outer.Inner"), fields and
 * oneofs ("pkg.Msg.field"), enums, enum values (siblings of their enum, as in
 * C++: "pkg.VALUE"; "pkg.Enum.VALUE" is accepted too), services, methods
 * ("pkg.Svc.Method") and extensions. A package may be spread over several
 * files; every other name is defined by one.
 *
 * Pure: built once from the set's bytes, read-only afterwards (any number of
 * threads may query it at once). File bytes point into the set, which must
 * outlive the index. */
#ifndef MESHD_REFLECTION_INDEX_H
#define MESHD_REFLECTION_INDEX_H

#include <stddef.h>
#include <stdint.h>

#define REFL_SYMBOL_KINDS(X)    \
  X(REFL_PACKAGE, "package")    \
  X(REFL_MESSAGE, "message")    \
  X(REFL_FIELD, "field")        \
  X(REFL_ONEOF, "oneof")        \
  X(REFL_ENUM, "enum")          \
  X(REFL_ENUM_VALUE, "enum value") \
  X(REFL_SERVICE, "service")    \
  X(REFL_METHOD, "method")      \
  X(REFL_EXTENSION, "extension")

typedef enum {
#define X(e, s) e,
  REFL_SYMBOL_KINDS(X)
#undef X
} refl_symbol_kind_t;

const char *refl_symbol_kind_name(refl_symbol_kind_t k);

typedef struct refl_index refl_index_t;

/* Indexes a serialized google.protobuf.FileDescriptorSet (protoc
 * --descriptor_set_out --include_imports). NULL with err when the bytes are not
 * one, a file has no name, two files share a name, two files define the same
 * symbol, or a file imports one the set does not hold. */
refl_index_t *refl_index_create(const uint8_t *set, size_t len, char *err, size_t errlen);
/* NULL is a no-op. */
void refl_index_destroy(refl_index_t *ix);

/* Files in the set; they are numbered 0..n-1 in the set's order. */
size_t refl_index_files(const refl_index_t *ix);
/* File i's name; *bytes and *len (either may be NULL) its serialized
 * FileDescriptorProto, as the set holds it. */
const char *refl_index_file(const refl_index_t *ix, int i, const uint8_t **bytes, size_t *len);
/* The file named `name` ("meshd/v1/tensor_service.proto"), or -1. */
int refl_index_find_file(const refl_index_t *ix, const char *name);

/* The files that define `name` (one leading dot is ignored): how many (0: no
 * such symbol; more than one only for a package), at most cap of them written
 * to files, and its kind in *kind (may be NULL). */
size_t refl_index_find_symbol(const refl_index_t *ix, const char *name, int *files, size_t cap,
                              refl_symbol_kind_t *kind);

/* The file defining extension `number` of message `extendee`, or -1. */
int refl_index_find_extension(const refl_index_t *ix, const char *extendee, int32_t number);
/* The numbers of every extension of message `extendee` the set defines: how
 * many, at most cap written to numbers (in the set's order). */
size_t refl_index_extension_numbers(const refl_index_t *ix, const char *extendee,
                                    int32_t *numbers, size_t cap);

/* roots, then every file they import, directly or not, each once: written to
 * out (room for refl_index_files(ix)); returns how many. Roots out of range
 * are skipped. */
size_t refl_index_closure(const refl_index_t *ix, const int *roots, size_t nroots, int *out);

#endif
