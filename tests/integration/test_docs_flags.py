"""docs/operations.md "Binaries and flags" against the binaries' --help: every flag of
`meshd` and `meshd-agent` is in its table and every row is a flag, with the same
default; every flag of `meshctl --help` is named in its section and every `--flag`
that section gives meshctl exists. The docs cannot drift from the code again."""

import os
import re
import subprocess

import pytest

import meshd_testlib as lib

# A default the table describes in words instead of the value --help prints: keyed by
# (binary, flag) to the value --help prints, so that a changed default fails here.
DESCRIBED = {
    ("meshd", "min-agents"): "-1",  # "`--local-agents`, or 1"
}

# Where operations.md's meshctl section states each default meshctl's --help prints.
MESHCTL_DEFAULTS = {
    "server": r"server default `([^`]+)`",
    "timeout-ms": r"`--timeout-ms` default (\d+)",
    "output": r"`--output (\w+)` \(default;",
    "progress-delay-ms": r"`--progress-delay-ms` \(default\s+(\d+)",
    "data-path": r"`--data-path [^`]*` \(`MESHD_DATA_PATH`, default `(\w+)`",
    "interval": r"`sessions --watch \[--interval S\][^`]*`[^(]*\(default (\d+)\)",
    "count": r"\(`--count`, default (\d+)",
    "dim": r"`--dim D` \(default (\d+)",
}

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


def _value(text):
    """A default as a comparable value: numbers and sizes (4MiB, 2^34) as numbers."""
    t = text.strip()
    m = re.fullmatch(r"(\d+)\^(\d+)", t)
    if m:
        return int(m.group(1)) ** int(m.group(2))
    m = re.fullmatch(r"(-?\d+(?:\.\d+)?)\s*([A-Za-z]*)", t)
    if m and m.group(2).lower() in _UNITS:
        return float(m.group(1)) * _UNITS[m.group(2).lower()]
    return t


def _help(binary):
    p = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=10)
    assert p.returncode == 0, p.stderr
    flags = {}
    for line in p.stdout.splitlines():
        m = re.match(r"  --([a-z0-9-]+)\b", line)
        if not m or m.group(1) == "help":
            continue
        d = re.search(r"\((?:env [A-Z0-9_]+)?(?:, )?(?:default ([^()]*))?\)$", line)
        flags[m.group(1)] = d.group(1) if d and d.group(1) is not None else None
    assert flags, p.stdout
    return flags


def _section(title_re):
    with open(os.path.join(lib.SOURCE_DIR, "docs", "operations.md")) as f:
        text = f.read()
    m = re.search(r"^### " + title_re + r".*?$(.*?)(?=^##)", text, re.M | re.S)
    assert m, f"docs/operations.md has no section {title_re}"
    return m.group(1)


def _table(title_re):
    rows = {}
    for line in _section(title_re).splitlines():
        if not line.startswith("| `--"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        for name in re.findall(r"`--([a-z0-9-]+)", cells[0]):
            assert name not in rows, f"--{name} twice in the table"
            rows[name] = cells[1]
    return rows


def _doc_default(cell):
    """The table's default without backticks and a trailing parenthesis:
    '17179869184 (2^34)' -> '17179869184', 'unset (open)' -> 'unset'."""
    return re.sub(r"\s*\(.*\)$", "", cell.replace("`", "")).strip()


@pytest.mark.parametrize("prog,title", [("meshd", r"`meshd` \(the server\)"),
                                        ("meshd-agent", r"`meshd-agent`")])
def test_operations_md_flag_table_matches_help(prog, title):
    binary = lib.MESHD if prog == "meshd" else lib.AGENT
    helped, table = _help(binary), _table(title)
    helped.pop("version", None)  # the common --version/--help lines, above the tables
    problems = []
    for name in sorted(set(helped) - set(table)):
        problems.append(f"--{name}: in --help, not in operations.md's table")
    for name in sorted(set(table) - set(helped)):
        problems.append(f"--{name}: in operations.md's table, not a flag of {prog}")
    for name in sorted(set(helped) & set(table)):
        code, doc = helped[name], _doc_default(table[name])
        if (prog, name) in DESCRIBED:
            if code != DESCRIBED[(prog, name)]:
                problems.append(f"--{name}: default {code} in --help; the table describes "
                                f"{DESCRIBED[(prog, name)]} as {table[name]!r}")
            continue
        if code is None:
            # unset: the table says so, or says in words what happens ("physical memory")
            if not (doc in ("unset", "required") or (" " in doc and _value(doc) == doc)):
                problems.append(f"--{name}: no default in --help, {table[name]!r} in the table")
        elif _value(code) != _value(doc):
            problems.append(f"--{name}: default {code} in --help, {table[name]!r} in the table")
    assert not problems, "\n".join(problems)


def test_operations_md_meshctl_section_names_its_flags():
    helped = _help(lib.MESHCTL)
    section = _section(r"`meshctl`")
    named = set(re.findall(r"--([a-z][a-z0-9-]+)", section))
    missing = sorted(f"--{n}" for n in set(helped) - named)
    assert not missing, f"meshctl flags operations.md's meshctl section does not name: {missing}"
    # Flags it names that meshctl lacks must be another binary's (the server's
    # --url-allow, an agent's --rank) and said so: none here may be meshctl's own.
    others = set(_help(lib.MESHD)) | set(_help(lib.AGENT)) | {"c-client"}  # bench_commands'
    unknown = sorted(f"--{n}" for n in named - set(helped) - others)
    assert not unknown, f"operations.md's meshctl section names flags no binary has: {unknown}"
    # The defaults it states are meshctl's, and it states each (a bool's false aside).
    problems = []
    for name, default in helped.items():
        if default in (None, "false"):
            continue
        if name not in MESHCTL_DEFAULTS:
            problems.append(f"--{name}: default {default}: no pattern here says where "
                            "operations.md states it")
            continue
        m = re.search(MESHCTL_DEFAULTS[name], section, re.S)
        if not m:
            problems.append(f"--{name}: operations.md does not state its default {default} "
                            f"(/{MESHCTL_DEFAULTS[name]}/)")
        elif _value(m.group(1)) != _value(default):
            problems.append(f"--{name}: default {default} in --help, {m.group(1)!r} in "
                            "operations.md")
    assert not problems, "\n".join(problems)


def test_demo_says_why_when_its_agents_cannot_start(tmp_path):
    """README's main job (.ci/demo) with agents that cannot start (a device this build
    lacks): it fails with meshd's log, which says why, not a bare NOT_SERVING."""
    root = tmp_path / "repo"
    (root / ".ci").mkdir(parents=True)
    (root / "build").mkdir()
    with open(os.path.join(lib.SOURCE_DIR, ".ci", "demo")) as f:
        (root / ".ci" / "demo").write_text(f.read())
    (root / ".ci" / "install-deps").write_text("true\n")  # installed, built: skip both
    os.symlink(lib.BIN_DIR, root / "build" / "bin")
    os.symlink(os.path.join(lib.SOURCE_DIR, "clients"), root / "clients")
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "cmake").write_text("#!/bin/sh\nexit 0\n")
    (stub / "cmake").chmod(0o755)
    env = lib.clean_env({"PATH": f"{stub}:{os.environ['PATH']}",
                         "MESHD_DEMO_DEVICE": "cuda:63", "MESHD_DEMO_STEPS": "1",
                         "MESHD_DEMO_WAIT_S": "3"})
    p = subprocess.run(["bash", str(root / ".ci" / "demo")], capture_output=True, text=True,
                       env=env, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "not SERVING" in out and "cuda:63" in out, out
