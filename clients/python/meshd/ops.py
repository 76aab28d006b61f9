"""meshd.ops.<op>(...): any op of the server's catalogue, by name (a generic Call).

Tensors, numbers, strings, None, lists of ints and lists of tensors are passed as they
are; a `dtype=` keyword takes a dtype. In-place ops (`add_`, ...) return their first
argument; max/min with a dim return (values, indices); `nresults=` overrides the count."""

from collections.abc import Callable
from typing import Any

from .tensor import _call


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("_"):
        raise AttributeError(name)

    def op(*args: Any, **kwargs: Any) -> Any:
        return _call(name, *args, **kwargs)
    op.__name__ = name
    return op
