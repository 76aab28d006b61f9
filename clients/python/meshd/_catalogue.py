"""The server's op catalogue (TensorService/ListOps), read at connect: which names
`t.<op>(...)` and `meshd.ops.<op>(...)` may take, and each op's schema for help().
One per process, from the latest session that read one (a server's catalogue is its
version's); None until then, or from a server without ListOps: any name goes to the
server, which answers UNKNOWN_OP."""

from __future__ import annotations

from typing import Any

_ops: dict[str, Any] | None = None  # name -> OpInfo


def load(reply: Any) -> None:
    global _ops
    _ops = {op.name: op for op in reply.ops}


def names() -> list[str]:
    return sorted(_ops) if _ops is not None else []


def get(name: str) -> Any | None:
    """The op's OpInfo; None when the catalogue does not know it (or is not read)."""
    return _ops.get(name) if _ops is not None else None


def check(name: str, what: str) -> None:
    """AttributeError when the catalogue is read and has no op `name`."""
    if _ops is not None and name not in _ops:
        raise AttributeError(f"meshd: {what} has no attribute {name!r}, and the server's op "
                             f"catalogue has no op of that name (dir(meshd.ops) lists them)")


def doc(name: str) -> str | None:
    op = get(name)
    if op is None:
        return None
    flags = [f for f, on in (("a view of self", op.view), ("in place", op.inplace),
                             ("a factory", op.factory)) if on]
    return op.schema + (f"\n\n({', '.join(flags)})" if flags else "")
