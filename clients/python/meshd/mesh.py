"""Mesh: named dims over agent ranks (Monarch's DeviceMesh).

This module sits below meshd.tensor (which imports Mesh and selectors from here) and
imports nothing above it: a Mesh reaches the layers above through its session, as
slice() does with Session._execute and rank() with Session._factory."""

from __future__ import annotations

import builtins
import contextlib
from typing import TYPE_CHECKING, Any

from . import _active

if TYPE_CHECKING:  # types only: both sit above this module
    from .session import Session
    from .tensor import Tensor


def selectors(pb: Any, sel: dict[str, int | slice]) -> list[Any]:
    """{dim: int | slice} -> [MeshSelector]; an int drops the dim, a slice keeps it."""
    out = []
    for d, v in sel.items():
        if isinstance(v, slice):
            for part in (v.start, v.stop, v.step):
                if part is not None and (isinstance(part, bool) or not isinstance(part, int)):
                    raise TypeError(f"meshd: slice bounds for dim {d!r} must be ints, got {v!r}")
            r = pb.Range(start=v.start or 0)
            if v.step is not None:  # slice(0, 4, 0) is refused, as Python refuses it
                r.step, r.has_step = v.step, True
            if v.stop is not None:
                r.stop, r.has_stop = v.stop, True
            out.append(pb.MeshSelector(dim=d, range=r))
        elif isinstance(v, int) and not isinstance(v, bool):
            out.append(pb.MeshSelector(dim=d, index=v))
        else:
            raise TypeError(f"meshd: dim {d!r} takes an int or a slice, got {type(v).__name__}")
    return out


class Mesh:
    """A mesh of a Session. `.names` is a tuple, `.sizes` a dict {dim: size}."""

    def __init__(self, session: Session, meta: Any) -> None:
        self.session = session
        self.ref = meta.ref
        self.names = tuple(d.name for d in meta.dims)
        self.sizes = {d.name: d.size for d in meta.dims}
        self._literals = meta.literals  # every rank's agent runs Literal commands
        self.ranks = tuple(meta.ranks)

    def __repr__(self) -> str:
        return f"Mesh({', '.join(f'{n}={self.sizes[n]}' for n in self.names)})"

    def slice(self, **sel: int | builtins.slice) -> Mesh:
        """A sub-mesh: an int drops the dim, a slice(a, b) keeps it."""
        pb = self.session._pb
        meta = self.session._execute("slice_mesh", lambda ref: pb.SliceMesh(
            ref=ref, parent=self.ref, selectors=selectors(pb, sel)), claim=1).mesh
        return self.session._mesh_from(meta)

    def activate(self) -> contextlib.AbstractContextManager[Mesh]:
        """Context manager making this the thread's active mesh. Its work runs on the
        thread's innermost active stream, activated inside or outside this block (as in
        Monarch), else on main; an active stream of another session is refused
        (ValueError)."""
        return _active.push("mesh", self)

    def rank(self, dim: str) -> Tensor:
        """int64 scalar tensor holding each rank's coordinate along `dim`."""
        return self.session._factory("rank", (), mesh=self, dim=dim)
