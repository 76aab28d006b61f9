"""meshd.ops.<op>(...): any op of the server's catalogue, by name (a generic Call).

Tensors, numbers, strings, None, lists of ints and lists of tensors are passed as they
are; a `dtype=` keyword takes a dtype. In-place ops (`add_`, ...) return their first
argument; max/min with a dim return (values, indices); `nresults=` overrides the count."""

from collections.abc import Callable
from typing import Any

from . import _catalogue
from .tensor import _call


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("_"):
        raise AttributeError(name)
    _catalogue.check(name, "meshd.ops")

    def op(*args: Any, **kwargs: Any) -> Any:
        return _call(name, *args, **kwargs)
    op.__name__ = op.__qualname__ = name
    op.__doc__ = _catalogue.doc(name)
    return op


def __dir__() -> list[str]:
    return _catalogue.names()
