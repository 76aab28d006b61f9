"""The public API carries type hints (the package ships py.typed): every parameter and
return of meshd's public functions, classes and their public methods is annotated, and
each annotation resolves to a real type (a misspelt or unimported name fails here)."""

import inspect
import os
import sys
import typing

import meshd

PUBLIC_CLASSES = (meshd.Session, meshd.Stream, meshd.Borrow, meshd.Mesh, meshd.Tensor,
                  meshd.MeshdError)


def _public_callables():
    """(qualified name, function) of meshd.__all__'s functions, the public methods,
    properties and dunders of PUBLIC_CLASSES (operators, constructors) and meshd.ops'
    lookup."""
    out = [("meshd.ops.__getattr__", meshd.ops.__getattr__)]
    for name in meshd.__all__:
        obj = getattr(meshd, name)
        if inspect.isfunction(obj):
            out.append((f"meshd.{name}", obj))
    for cls in PUBLIC_CLASSES:
        for name, attr in vars(cls).items():
            if name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
                continue  # private; dunders (operators, __init__, ...) are public
            if isinstance(attr, property):
                attr = attr.fget
            elif isinstance(attr, classmethod):
                attr = attr.__func__
            if inspect.isfunction(attr):
                out.append((f"meshd.{cls.__name__}.{name}", inspect.unwrap(attr)))
    return out


def _hints(fn):
    # Annotations may name classes imported only for type checkers (if TYPE_CHECKING):
    # resolve them in the package's namespace as well as the function's module.
    ns = dict(vars(meshd))
    ns.update(vars(sys.modules[fn.__module__]))
    return typing.get_type_hints(fn, globalns=ns)


def test_public_api_is_fully_annotated_and_its_hints_resolve():
    checked = _public_callables()
    names = {n for n, _ in checked}
    assert {"meshd.connect", "meshd.fetch_shard", "meshd.load", "meshd.zeros",
            "meshd.Session.mesh", "meshd.Tensor.shape", "meshd.Mesh.rank",
            "meshd.Stream.borrow", "meshd.MeshdError.__init__"} <= names, sorted(names)
    missing = []
    for name, fn in checked:
        hints = _hints(fn)
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.name not in ("self", "cls")]
        missing += [f"{name}({p.name})" for p in params if p.name not in hints]
        if "return" not in hints:
            missing.append(f"{name} -> ?")
    assert not missing, "not annotated: " + ", ".join(missing)


def test_hints_say_what_the_calls_return():
    assert _hints(meshd.connect)["return"] is meshd.Session
    assert _hints(meshd.Session.mesh)["return"] is meshd.Mesh
    assert _hints(meshd.Mesh.rank)["return"] is meshd.Tensor  # a typing-only import, resolved
    assert _hints(meshd.Stream.borrow)["return"] == tuple[meshd.Tensor, meshd.Borrow]
    assert typing.get_origin(_hints(meshd.fetch_shard)["return"]).__name__ == "Future"


def test_the_package_ships_a_py_typed_marker():
    assert os.path.isfile(os.path.join(os.path.dirname(meshd.__file__), "py.typed"))
