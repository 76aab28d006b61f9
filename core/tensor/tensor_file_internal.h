/* Shared by tensor_file.c and the two format parsers; not part of the API. */
#ifndef MESHD_TENSOR_FILE_INTERNAL_H
#define MESHD_TENSOR_FILE_INTERNAL_H

#include <json-c/json.h>
#include <stdbool.h>

#include "tensor_file.h"

/* Names in messages are cut to this many bytes. */
#define TF_NAME_MAX 100

/* The parsers: same contract as tensor_file_parse, with opts filled in
 * (max_header_bytes never 0). On failure they leave *out freed. */
int npy_header_parse(const uint8_t *buf, size_t len, const tensor_file_opts_t *o,
                     tensor_file_t *out, uint64_t *need, meshd_error_t *e);
int safetensors_header_parse(const uint8_t *buf, size_t len, const tensor_file_opts_t *o,
                             tensor_file_t *out, uint64_t *need, meshd_error_t *e);
int safetensors_index_parse(const uint8_t *buf, size_t len, const tensor_file_opts_t *o,
                            tensor_file_t *out, uint64_t *need, meshd_error_t *e);

/* Tensor entry -> "shape" array: 3 levels; a little room, no deep recursion. */
#define JSON_DEPTH 8

/* The keys of one JSON object in `text` (json-c parsed it): the root's when
 * `within` is NULL, else those of the object that is the root's key `within`.
 * One that holds \u0000, or appears twice, is refused (json-c would cut it,
 * or keep the last of the two), with `ctx` leading the message, the key, where
 * it is and both its byte offsets. tensor_names: the keys are tensor names
 * (a header's root but its "__metadata__", an index's "weight_map"), not
 * other keys (an index's root), which the message says. */
int tensor_file_check_names(const char *ctx, const char *text, size_t n, const char *within,
                            bool tensor_names, meshd_error_t *e);
/* The JSON object in text[0..n), json-c strict; only bytes of `padding` may
 * follow it. ctx starts every message. *out: the caller's (json_object_put). */
int tensor_file_json(const char *ctx, const char *text, size_t n, const char *padding,
                     json_object **out, meshd_error_t *e);

/* Checks t's shape (layout_check_shape, the message starting with ctx) and
 * sets t->nbytes. */
int tensor_file_entry_finish(tensor_file_entry_t *t, const char *ctx, meshd_error_t *e);

#endif
