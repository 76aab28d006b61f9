"""meshd.MeshdError: a rejected command or a run-time failure, with the server's kind."""

import grpc

KIND_MD = "meshd-error-kind"

# Fallback when a status carries no kind trailer (e.g. the server is unreachable).
# With a trailer the kind is the server's: UNAUTHENTICATED (no or a wrong bearer token),
# PERMISSION_DENIED (another principal's session), NO_SESSION (closed or expired).
_CODE_KINDS = {
    grpc.StatusCode.UNAVAILABLE: "UNAVAILABLE",
    grpc.StatusCode.UNAUTHENTICATED: "NO_SESSION",
    grpc.StatusCode.PERMISSION_DENIED: "PERMISSION_DENIED",
    grpc.StatusCode.DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED",  # the client's deadline passed
}


class MeshdError(Exception):
    """An error reported by meshd. `.kind` is the ErrorKind name ("WRONG_MESH", ...),
    `.message` the server's message, `.code` the gRPC status code (or its number on
    errors reported inside a result), `.seq` the command seq when known."""

    def __init__(self, kind, message, code=None, seq=None):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message, self.code, self.seq = kind, message, code, seq

    @classmethod
    def from_rpc(cls, e):
        kind = None
        for k, v in (e.trailing_metadata() or ()):
            if k == KIND_MD:
                kind = v
        if not kind:
            kind = _CODE_KINDS.get(e.code(), str(e.code().name))
        return cls(kind, e.details() or "", e.code())

    @classmethod
    def from_error(cls, pb, err):
        kind = pb.ErrorKind.Name(err.kind)
        if kind.startswith("ERROR_KIND_"):
            kind = kind[len("ERROR_KIND_"):]
        return cls(kind, err.message, err.code, err.seq or None)
