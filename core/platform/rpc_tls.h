/* Internal to core/platform/rpc_*.c: gRPC credentials from rpc_tls_t. */
#ifndef MESHD_RPC_TLS_H
#define MESHD_RPC_TLS_H

#include <grpc/grpc_security.h>

#include "rpc.h"

/* What a TLS server keeps for its certificate fetcher; freed after the server. */
typedef struct rpc_tls_server rpc_tls_server_t;

/* Insecure credentials when tls is off; else SSL credentials that reload the
 * files when they change. NULL with err if the files are unusable. */
grpc_server_credentials *rpc_tls_server_creds(const rpc_tls_t *tls, rpc_tls_server_t **state,
                                              char *err, size_t errlen);
void rpc_tls_server_free(rpc_tls_server_t *t);

/* Insecure credentials when tls is off; NULL (logged) if the files are unusable. */
grpc_channel_credentials *rpc_tls_channel_creds(const rpc_tls_t *tls);

#endif
