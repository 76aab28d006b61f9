/* gRPC server reflection (grpc.reflection.v1 and v1alpha ServerReflection) on
 * an rpc server, so that grpcurl and grpc_cli list and describe its services
 * without the .proto files:
 *
 *   reflection_t *r = reflection_create(err, sizeof err);
 *   reflection_add_methods(r, srv, auth_guard, auth);  // before rpc_server_start
 *   ... rpc_server_destroy(srv); reflection_destroy(r);
 *
 * Answers come from the FileDescriptorSet of api/ that the build embeds
 * (meshd_descriptor_set), indexed once (reflection_index.h). list_services
 * names exactly the services registered on that server (the reflection
 * services included); file_by_filename and file_containing_symbol return the
 * file with everything it imports; an unknown name is an error_response
 * NOT_FOUND on a stream that goes on. The guard is the port's: reflection is
 * as protected as the services it describes. */
#ifndef MESHD_REFLECTION_H
#define MESHD_REFLECTION_H

#include <stddef.h>

#include "rpc.h"

/* protoc --include_imports --include_source_info --descriptor_set_out over
 * every .proto under api/, built into the binary (api/CMakeLists.txt). */
extern const unsigned char meshd_descriptor_set[];
extern const size_t meshd_descriptor_set_len;

typedef struct reflection reflection_t;

/* Indexes the embedded set. NULL with err if it does not parse (a build bug). */
reflection_t *reflection_create(char *err, size_t errlen);
/* Registers both ServerReflectionInfo methods on srv behind guard (NULL:
 * open), before rpc_server_start. One reflection_t per server: it lists that
 * server's services. r must outlive srv. Returns 0, or -1 (already registered). */
int reflection_add_methods(reflection_t *r, rpc_server_t *srv, rpc_guard_fn guard,
                           void *guard_arg);
/* After the server is destroyed. NULL is a no-op. */
void reflection_destroy(reflection_t *r);

#endif
