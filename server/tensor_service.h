/* meshd.v1.TensorService: the client-facing method table.
 * Methods not in the table are answered UNIMPLEMENTED by the rpc layer. */
#ifndef MESHD_TENSOR_SERVICE_H
#define MESHD_TENSOR_SERVICE_H

#include <stddef.h>

#include "agent_pool.h"
#include "rpc.h"

#define TENSOR_SERVICE_NAME "meshd.v1.TensorService"

/* The rows, bound to pool (which must outlive the server). Call once. */
const rpc_method_t *tensor_service_methods(agent_pool_t *pool, size_t *n);

#endif
