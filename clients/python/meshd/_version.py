"""meshd.__version__: the project's version, written once in the repository's top-level
VERSION file (CMakeLists.txt reads it too). A built package carries it in meshd/_gen,
which setup.py writes; from a checkout it is read from the repository; elsewhere it is
"0+unknown"."""

import os


def version() -> str:
    try:
        from ._gen import VERSION
        return str(VERSION)
    except ImportError:
        pass
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "VERSION")
    try:
        with open(path) as f:
            return f.readline().strip() or "0+unknown"
    except OSError:
        return "0+unknown"
