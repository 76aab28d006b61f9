"""Per-thread active mesh and stream (Monarch's `mesh.activate()`, `stream.activate()`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # types only: this module sits below both
    from .mesh import Mesh
    from .session import Session

T = TypeVar("T")

_local = threading.local()


def _stack(name: str) -> list[Any]:
    s = getattr(_local, name, None)
    if s is None:
        s = []
        setattr(_local, name, s)
    return s


@contextlib.contextmanager
def push(name: str, value: T) -> Iterator[T]:
    s = _stack(name)
    s.append(value)
    try:
        yield value
    finally:
        s.pop()


def current(name: str) -> Any:
    s = _stack(name)
    return s[-1] if s else None


def mesh() -> Mesh:
    """The active mesh of this thread; ValueError when there is none."""
    m = current("mesh")
    if m is None:
        raise ValueError("meshd: no active mesh; use `with mesh.activate():`")
    return m


def stream_ref(session: Session) -> int:
    """The ref of this thread's active stream for `session` (0: main)."""
    s = current("stream")
    if s is None or s.session is not session:
        return 0
    return s.ref
