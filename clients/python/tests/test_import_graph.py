"""The modules of the meshd package import one another one way only: no import cycle,
counting imports inside functions too (a lazy import is still an edge of the graph), but
not those under `if TYPE_CHECKING:`, which only type checkers read (annotations name
classes of modules above, e.g. Mesh.rank -> Tensor)."""

import json
import os
import subprocess
import sys

from conftest import REPO, _child_env

CLIENT = os.path.join(REPO, "clients", "python")

# Run in a fresh interpreter: imports every module of the package (so each one imports
# cleanly), then reads the import statements of each imported file with ast, at any depth
# except under `if TYPE_CHECKING:`. Prints {module: {imported module: "file:line"}} and
# {module: [typing-only imported module]} as JSON.
_SCRIPT = r"""
import ast, importlib, json, os, pkgutil, sys
import meshd
names = ["meshd"] + [m.name for m in pkgutil.walk_packages(meshd.__path__, "meshd.")]
graph, files, skipped = {}, {}, {}
for name in names:
    mod = importlib.import_module(name)
    files[name] = mod.__file__
    pkg = name if hasattr(mod, "__path__") else name.rpartition(".")[0]
    edges = graph.setdefault(name, {})
    def edge(target, line):
        if target != name and target in names:
            edges.setdefault(target, f"{os.path.basename(mod.__file__)}:{line}")
    with open(mod.__file__) as f:
        tree = ast.parse(f.read(), mod.__file__)
    typing_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING",
                                                                    "typing.TYPE_CHECKING"):
            typing_only.update(id(n) for part in node.body for n in ast.walk(part))
    for node in ast.walk(tree):
        if id(node) in typing_only:
            if isinstance(node, ast.ImportFrom) and node.level:
                skipped.setdefault(name, []).append(node.module)
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")  # import meshd.x.y: its longest meshd prefix
                for i in range(len(parts), 0, -1):
                    if ".".join(parts[:i]) in names:
                        edge(".".join(parts[:i]), node.lineno)
                        break
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = ".".join(base[:len(base) - node.level + 1])
                target = base + ("." + node.module if node.module else "")
            else:
                target = node.module
            for a in node.names:  # from X import y: y may be a module of X
                edge(target + "." + a.name if target + "." + a.name in names else target,
                     node.lineno)
print(json.dumps({"graph": graph, "files": files, "typing_only": skipped}))
"""


def _cycle(graph):
    """One cycle of `graph` as a list of nodes (first == last), or None."""
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == "open":
                return stack[stack.index(m):] + [m]
            if m not in state:
                c = visit(m)
                if c:
                    return c
        stack.pop()
        state[n] = "done"
        return None

    for n in sorted(graph):
        if n not in state:
            c = visit(n)
            if c:
                return c
    return None


def test_cycle_finder():
    assert _cycle({"a": {"b": ""}, "b": {"c": ""}, "c": {}}) is None
    assert _cycle({"a": {"b": ""}, "b": {"c": ""}, "c": {"b": ""}}) == ["b", "c", "b"]


def test_package_import_graph_has_no_cycle():
    env = _child_env()
    env["PYTHONPATH"] = CLIENT
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    r = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, cwd=CLIENT,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    graph, files = out["graph"], out["files"]
    for name, path in files.items():  # the package of this tree, not an installed one
        assert os.path.realpath(path).startswith(os.path.realpath(CLIENT) + os.sep), (name, path)
    assert {"meshd", "meshd.mesh", "meshd.tensor", "meshd.session", "meshd.ops"} <= set(graph)
    assert graph["meshd.tensor"].keys() >= {"meshd.mesh"}, graph  # the parser sees imports
    # ... and leaves out only the typing-only ones: tensor names Session in annotations
    assert "session" in out["typing_only"]["meshd.tensor"], out["typing_only"]
    assert "meshd.session" not in graph["meshd.tensor"], graph
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(
        f"{a} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + " -> " + cycle[-1]
