/* ServerReflectionInfo: one response per request, in order, on the same
 * stream. The v1 and v1alpha messages have the same fields and numbers, so a
 * v1 response packs to the bytes of the v1alpha one: both methods answer with
 * v1 messages, and only requests are read per version. */
#include "reflection.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grpc/reflection/v1/reflection.pb-c.h"
#include "grpc/reflection/v1alpha/reflection.pb-c.h"
#include "reflection_index.h"

typedef Grpc__Reflection__V1__ServerReflectionRequest request_t;
typedef Grpc__Reflection__V1__ServerReflectionResponse response_t;
typedef Grpc__Reflection__V1alpha__ServerReflectionRequest alpha_request_t;

struct reflection {
  refl_index_t *ix;
  rpc_server_t *srv; /* whose services list_services names */
};

/* What a request asks, read from either version's message. protobuf-c
 * numbers a oneof's cases by their field numbers, the same in both versions. */
typedef struct ask {
  const char *host;
  int which; /* the oneof's field number: 3 file_by_filename ... 7 list_services; 0 none */
  const char *text;
  const char *ext_type;
  int32_t ext_number;
} ask_t;

enum { FILE_BY_FILENAME = 3, FILE_CONTAINING_SYMBOL, FILE_CONTAINING_EXTENSION,
       ALL_EXTENSION_NUMBERS_OF_TYPE, LIST_SERVICES };

static const char *text_of(int which, const char *filename, const char *symbol,
                           const char *ext_type, const char *list) {
  switch (which) {
    case FILE_BY_FILENAME: return filename;
    case FILE_CONTAINING_SYMBOL: return symbol;
    case ALL_EXTENSION_NUMBERS_OF_TYPE: return ext_type;
    case LIST_SERVICES: return list;
    default: return "";
  }
}

static ask_t ask_v1(const request_t *q) {
  ask_t a = {q->host, (int)q->message_request_case, "", "", 0};
  a.text = text_of(a.which, q->file_by_filename, q->file_containing_symbol,
                   q->all_extension_numbers_of_type, q->list_services);
  if (a.which == FILE_CONTAINING_EXTENSION && q->file_containing_extension) {
    a.ext_type = q->file_containing_extension->containing_type;
    a.ext_number = q->file_containing_extension->extension_number;
  }
  return a;
}

static ask_t ask_v1alpha(const alpha_request_t *q) {
  ask_t a = {q->host, (int)q->message_request_case, "", "", 0};
  a.text = text_of(a.which, q->file_by_filename, q->file_containing_symbol,
                   q->all_extension_numbers_of_type, q->list_services);
  if (a.which == FILE_CONTAINING_EXTENSION && q->file_containing_extension) {
    a.ext_type = q->file_containing_extension->containing_type;
    a.ext_number = q->file_containing_extension->extension_number;
  }
  return a;
}

/* The answer under construction: everything the response points to. */
typedef struct answer {
  response_t resp;
  request_t orig;
  Grpc__Reflection__V1__ExtensionRequest orig_ext;
  Grpc__Reflection__V1__FileDescriptorResponse files;
  Grpc__Reflection__V1__ExtensionNumberResponse numbers;
  Grpc__Reflection__V1__ListServiceResponse list;
  Grpc__Reflection__V1__ErrorResponse error;
  char message[512];
  void *owned[4]; /* freed after the send */
} answer_t;

__attribute__((format(printf, 3, 4))) static void error_answer(answer_t *an, int code,
                                                               const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(an->message, sizeof an->message, fmt, ap);
  va_end(ap);
  an->error.error_code = code;
  an->error.error_message = an->message;
  an->resp.message_response_case =
      GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_ERROR_RESPONSE;
  an->resp.error_response = &an->error;
}

/* roots and every file they import, as serialized FileDescriptorProtos. */
static void files_answer(const reflection_t *r, answer_t *an, const int *roots, size_t nroots) {
  size_t nf = refl_index_files(r->ix);
  int *files = malloc((nf ? nf : 1) * sizeof *files);
  ProtobufCBinaryData *blobs = malloc((nf ? nf : 1) * sizeof *blobs);
  an->owned[0] = files;
  an->owned[1] = blobs;
  if (!files || !blobs) {
    error_answer(an, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  size_t n = refl_index_closure(r->ix, roots, nroots, files);
  for (size_t i = 0; i < n; i++) {
    const uint8_t *bytes;
    size_t len;
    refl_index_file(r->ix, files[i], &bytes, &len);
    blobs[i] = (ProtobufCBinaryData){len, (uint8_t *)bytes};
  }
  an->files.n_file_descriptor_proto = n;
  an->files.file_descriptor_proto = blobs;
  an->resp.message_response_case =
      GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_FILE_DESCRIPTOR_RESPONSE;
  an->resp.file_descriptor_response = &an->files;
}

/* Each service with rows on the server ("/SERVICE/Method"), once, in the
 * order they were added. */
static void list_answer(const reflection_t *r, answer_t *an) {
  size_t np = rpc_server_paths(r->srv, NULL, 0);
  const char **paths = malloc((np ? np : 1) * sizeof *paths);
  Grpc__Reflection__V1__ServiceResponse *svc = malloc((np ? np : 1) * sizeof *svc);
  Grpc__Reflection__V1__ServiceResponse **ptrs = malloc((np ? np : 1) * sizeof *ptrs);
  an->owned[0] = paths;
  an->owned[1] = svc;
  an->owned[2] = ptrs;
  size_t room = 0;
  if (paths) {
    rpc_server_paths(r->srv, paths, np);
    for (size_t i = 0; i < np; i++) room += strlen(paths[i]) + 1;
  }
  char *names = malloc(room ? room : 1);
  an->owned[3] = names;
  if (!paths || !svc || !ptrs || !names) {
    error_answer(an, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  size_t n = 0;
  char *at = names;
  for (size_t i = 0; i < np; i++) {
    const char *p = paths[i] + (paths[i][0] == '/');
    const char *slash = strrchr(p, '/');
    size_t len = slash ? (size_t)(slash - p) : strlen(p);
    bool seen = false;
    for (size_t k = 0; k < n && !seen; k++)
      seen = strlen(svc[k].name) == len && memcmp(svc[k].name, p, len) == 0;
    if (seen) continue;
    memcpy(at, p, len);
    at[len] = '\0';
    grpc__reflection__v1__service_response__init(&svc[n]);
    svc[n].name = at;
    ptrs[n] = &svc[n];
    n++;
    at += len + 1;
  }
  an->list.n_service = n;
  an->list.service = ptrs;
  an->resp.message_response_case =
      GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_LIST_SERVICES_RESPONSE;
  an->resp.list_services_response = &an->list;
}

static void symbol_answer(const reflection_t *r, answer_t *an, const char *name) {
  size_t nf = refl_index_files(r->ix);
  int *roots = malloc((nf ? nf : 1) * sizeof *roots);
  an->owned[2] = roots;
  if (!roots) {
    error_answer(an, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  size_t n = refl_index_find_symbol(r->ix, name, roots, nf, NULL);
  if (n == 0)
    error_answer(an, GRPC_STATUS_NOT_FOUND, "symbol '%.300s' not found: this server's services "
                 "do not define it (give a full name: package.Service, package.Service.Method, "
                 "package.Message)", name);
  else
    files_answer(r, an, roots, n < nf ? n : nf);
}

static void answer(const reflection_t *r, const ask_t *a, answer_t *an) {
  switch (a->which) {
    case LIST_SERVICES:
      list_answer(r, an);
      return;
    case FILE_BY_FILENAME: {
      int f = refl_index_find_file(r->ix, a->text);
      if (f < 0)
        error_answer(an, GRPC_STATUS_NOT_FOUND, "file '%.300s' not found: this server's "
                     "descriptors hold no file of that name (names are relative to api/, e.g. "
                     "meshd/v1/tensor_service.proto)", a->text);
      else
        files_answer(r, an, &f, 1);
      return;
    }
    case FILE_CONTAINING_SYMBOL:
      symbol_answer(r, an, a->text);
      return;
    case FILE_CONTAINING_EXTENSION: {
      int f = refl_index_find_extension(r->ix, a->ext_type, a->ext_number);
      if (f < 0)
        error_answer(an, GRPC_STATUS_NOT_FOUND, "extension %d of '%.300s' not found: this "
                     "server's descriptors define no such extension", (int)a->ext_number,
                     a->ext_type);
      else
        files_answer(r, an, &f, 1);
      return;
    }
    case ALL_EXTENSION_NUMBERS_OF_TYPE: {
      refl_symbol_kind_t kind;
      if (!refl_index_find_symbol(r->ix, a->text, NULL, 0, &kind) || kind != REFL_MESSAGE) {
        error_answer(an, GRPC_STATUS_NOT_FOUND, "message type '%.300s' not found", a->text);
        return;
      }
      size_t n = refl_index_extension_numbers(r->ix, a->text, NULL, 0);
      int32_t *numbers = malloc((n ? n : 1) * sizeof *numbers);
      an->owned[0] = numbers;
      if (!numbers) {
        error_answer(an, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        return;
      }
      refl_index_extension_numbers(r->ix, a->text, numbers, n);
      an->numbers.base_type_name = (char *)(a->text[0] == '.' ? a->text + 1 : a->text);
      an->numbers.n_extension_number = n;
      an->numbers.extension_number = numbers;
      an->resp.message_response_case =
          GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_ALL_EXTENSION_NUMBERS_RESPONSE;
      an->resp.all_extension_numbers_response = &an->numbers;
      return;
    }
    default:
      error_answer(an, GRPC_STATUS_INVALID_ARGUMENT, "the request asks nothing: set one of "
                   "file_by_filename, file_containing_symbol, file_containing_extension, "
                   "all_extension_numbers_of_type, list_services");
      return;
  }
}

static void start(rpc_call_t *call, const ProtobufCMessage *req, void *arg) {}

static void on_message(rpc_call_t *call, const ProtobufCMessage *msg, void *arg) {
  const reflection_t *r = arg;
  if (!msg) { /* the client is done asking */
    rpc_call_finish(call, GRPC_STATUS_OK, NULL, "%s", "");
    return;
  }
  ask_t a = msg->descriptor == &grpc__reflection__v1alpha__server_reflection_request__descriptor
                ? ask_v1alpha((const alpha_request_t *)msg)
                : ask_v1((const request_t *)msg);
  answer_t an;
  grpc__reflection__v1__server_reflection_response__init(&an.resp);
  grpc__reflection__v1__server_reflection_request__init(&an.orig);
  grpc__reflection__v1__extension_request__init(&an.orig_ext);
  grpc__reflection__v1__file_descriptor_response__init(&an.files);
  grpc__reflection__v1__extension_number_response__init(&an.numbers);
  grpc__reflection__v1__list_service_response__init(&an.list);
  grpc__reflection__v1__error_response__init(&an.error);
  memset(an.owned, 0, sizeof an.owned);

  /* The request echoed back, as the standard servers do. */
  an.orig.host = (char *)a.host;
  an.resp.valid_host = (char *)a.host;
  an.resp.original_request = &an.orig;
  if (a.which >= FILE_BY_FILENAME && a.which <= LIST_SERVICES) {
    an.orig.message_request_case = (Grpc__Reflection__V1__ServerReflectionRequest__MessageRequestCase)a.which;
    char *text = (char *)a.text;
    switch (a.which) {
      case FILE_BY_FILENAME: an.orig.file_by_filename = text; break;
      case FILE_CONTAINING_SYMBOL: an.orig.file_containing_symbol = text; break;
      case ALL_EXTENSION_NUMBERS_OF_TYPE: an.orig.all_extension_numbers_of_type = text; break;
      case LIST_SERVICES: an.orig.list_services = text; break;
      default:
        an.orig_ext.containing_type = (char *)a.ext_type;
        an.orig_ext.extension_number = a.ext_number;
        an.orig.file_containing_extension = &an.orig_ext;
    }
  }
  answer(r, &a, &an);
  rpc_call_send(call, &an.resp.base);
  for (size_t i = 0; i < sizeof an.owned / sizeof an.owned[0]; i++) free(an.owned[i]);
}

static const rpc_method_t methods[] = {
    {
        .path = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        .kind = RPC_BIDI,
        .request = &grpc__reflection__v1__server_reflection_request__descriptor,
        .on_start = start,
        .on_message = on_message,
    },
    {
        .path = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        .kind = RPC_BIDI,
        .request = &grpc__reflection__v1alpha__server_reflection_request__descriptor,
        .on_start = start,
        .on_message = on_message,
    },
};

reflection_t *reflection_create(char *err, size_t errlen) {
  reflection_t *r = calloc(1, sizeof *r);
  if (!r) {
    snprintf(err, errlen, "out of memory");
    return NULL;
  }
  r->ix = refl_index_create(meshd_descriptor_set, meshd_descriptor_set_len, err, errlen);
  if (!r->ix) {
    free(r);
    return NULL;
  }
  return r;
}

int reflection_add_methods(reflection_t *r, rpc_server_t *srv, rpc_guard_fn guard,
                           void *guard_arg) {
  if (r->srv) return -1;
  r->srv = srv;
  return rpc_server_add_methods_guarded(srv, methods, sizeof methods / sizeof methods[0], r, guard,
                                        guard_arg);
}

void reflection_destroy(reflection_t *r) {
  if (!r) return;
  refl_index_destroy(r->ix);
  free(r);
}
