"""docker/*.Dockerfile and docker/compose.yaml read statically (no daemon here).

parse(path) returns the stages of a Dockerfile, each a dict: name, base (FROM),
args ({name: default}, ARG), env ({name: value}, ENV, with the ARG defaults
expanded), labels (LABEL, likewise), user (last USER), workdir, run (the RUN
commands' text), copies (COPY lines), entrypoint, cmd and healthcheck (the
HEALTHCHECK's CMD; exec forms, parsed).
Only the forms docker/*.Dockerfile use: KEY=VALUE pairs for ENV and LABEL.
"""

import glob
import json
import os
import re
import shlex

import yaml

import meshd_testlib as lib

DOCKER_DIR = os.path.join(lib.SOURCE_DIR, "docker")


def dockerfiles():
    return sorted(glob.glob(os.path.join(DOCKER_DIR, "*.Dockerfile")))


def _instructions(text):
    lines, cur = [], ""
    for raw in text.splitlines():
        if not cur and (raw.lstrip().startswith("#") or not raw.strip()):
            continue
        if raw.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        if raw.rstrip().endswith("\\"):
            cur += raw.rstrip()[:-1] + " "
            continue
        cur += raw
        lines.append(cur.strip())
        cur = ""
    if cur.strip():
        lines.append(cur.strip())
    for line in lines:
        word, _, rest = line.partition(" ")
        yield word.upper(), rest.strip()


def _expand(value, args):
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), ""), value)


def _pairs(rest, args):
    out = {}
    for word in shlex.split(rest):
        k, eq, v = word.partition("=")
        assert eq, f"only KEY=VALUE forms are understood here: {rest!r}"
        out[k] = _expand(v, args)
    return out


def parse(path):
    stages = []
    global_args = {}
    for word, rest in _instructions(open(path).read()):
        if word == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.I)
            stages.append(dict(name=m.group(2), base=m.group(1), args={}, env={}, labels={},
                               user=None, workdir="/", run=[], copies=[], entrypoint=None,
                               cmd=None, healthcheck=None))
            continue
        if not stages:
            if word == "ARG":
                k, _, v = rest.partition("=")
                global_args[k] = v
            continue
        st = stages[-1]
        if word == "ARG":
            k, _, v = rest.partition("=")
            st["args"][k] = v.strip('"') if v else global_args.get(k, "")
        elif word == "ENV":
            st["env"].update(_pairs(rest, {**st["args"], **st["env"]}))
        elif word == "LABEL":
            st["labels"].update(_pairs(rest, st["args"]))
        elif word == "USER":
            st["user"] = rest
        elif word == "WORKDIR":
            st["workdir"] = os.path.join(st["workdir"], rest)
        elif word == "RUN":
            st["run"].append(rest)
        elif word == "COPY":
            st["copies"].append(rest)
        elif word in ("ENTRYPOINT", "CMD"):
            st[word.lower()] = json.loads(rest)
        elif word == "HEALTHCHECK":
            m = re.search(r"\bCMD\s+(\[.*\])\s*$", rest)
            assert m, f"HEALTHCHECK without an exec-form CMD: {rest!r}"
            st["healthcheck"] = json.loads(m.group(1))
    return stages


def final(path):
    return parse(path)[-1]


def apt_installs(stage):
    """The packages a stage's RUN lines install with apt-get install."""
    pkgs = []
    for run in stage["run"]:
        for part in re.split(r"&&|;", run):
            words = part.split()
            if words[:2] == ["apt-get", "install"]:
                pkgs += [w for w in words[2:] if not w.startswith("-")]
    return pkgs


def load_compose():
    with open(os.path.join(DOCKER_DIR, "compose.yaml")) as f:
        return yaml.safe_load(f)  # PyYAML resolves the << merge keys


def image_dockerfiles():
    """{image name without tag: Dockerfile path}, from compose.yaml's build sections."""
    out = {}
    for svc in load_compose()["services"].values():
        if "build" in svc:
            out[svc["image"].split(":")[0]] = os.path.normpath(
                os.path.join(DOCKER_DIR, svc["build"]["context"], svc["build"]["dockerfile"]))
    return out
