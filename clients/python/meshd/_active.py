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
    """The ref of this thread's active stream for `session` (0: main); ValueError when
    the active stream is of another session (its ref names another stream, or none, in
    `session`: the work ran on main, silently)."""
    s = current("stream")
    if s is None:
        return 0
    if s.session is not session:
        raise ValueError(f"meshd: the active stream {s.name!r} is of session "
                         f"{getattr(s.session, 'id', None)!r}, another session than "
                         f"{getattr(session, 'id', None)!r}, whose work it would run; activate "
                         f"a stream of that session (session.stream(name)) instead")
    return s.ref
