/* meshd.v1.TensorService: the client-facing method table.
 * Methods not in the table are answered UNIMPLEMENTED by the rpc layer. */
#ifndef MESHD_TENSOR_SERVICE_H
#define MESHD_TENSOR_SERVICE_H

#include <stddef.h>

#include "agent_pool.h"
#include "rpc.h"

#define TENSOR_SERVICE_NAME "meshd.v1.TensorService"

/* The rows (static storage), *n their count. Register them with the
 * agent_pool_t * as arg; the pool must outlive the server. */
const rpc_method_t *tensor_service_methods(size_t *n);

#endif
