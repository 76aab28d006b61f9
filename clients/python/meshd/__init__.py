# Intra-package imports, bottom-up; each module imports only modules on lines above it:
#   errors, _active, _conn, _proto, _progress: no meshd module
#   pipeline -> errors;  mesh -> _active  (Mesh.rank makes tensors via Session._factory)
#   tensor -> _active, _progress, errors, mesh, pipeline
#   ops -> tensor;  load -> _active, _progress, errors, tensor;  session -> _active, _conn, _proto, errors, mesh, pipeline, tensor
#   meshd (this file) -> ops, errors, load, mesh, session, tensor  (tests/test_import_graph.py)
"""meshd: Python client for the meshd tensor engine, with Monarch's names.

    import meshd
    with meshd.connect("127.0.0.1:50051") as session:
        mesh = session.mesh(gpu=2)
        with mesh.activate():
            x = meshd.ones((2, 3)) + 1
            print(meshd.fetch_shard(x, gpu=0).result())

    # a server with TLS and tokens (token also from $MESHD_TOKEN):
    meshd.connect("meshd.example:50051", token=tok, root_certs="ca.pem")
"""

from . import ops
from .errors import MeshdError
from .load import inspect_url, load
from .mesh import Mesh
from .session import Borrow, Session, Stream, connect
from .tensor import (DTYPES, Tensor, arange, empty, fetch_shard, full, inspect, ones, rand, randn,
                     tensor, zeros)

__all__ = ["connect", "Session", "Mesh", "Stream", "Borrow", "Tensor", "MeshdError", "ops",
           "zeros", "ones", "full", "empty", "arange", "rand", "randn", "tensor", "fetch_shard",
           "inspect", "DTYPES", "load", "inspect_url"]
