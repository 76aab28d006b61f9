#!/usr/bin/python3
"""list_sessions: what a non-admin's ListSessions costs the server while other
principals hold many sessions (docs/operations.md). Not a test (not run by
ctest): run by hand, e.g.

    MESHD_BIN_DIR=build/bin /usr/bin/python3 tests/bench/list_sessions.py \
        --others 10000 --mine 3 --pages 2000 [-- extra meshd flags]

Starts `meshd --auth-tokens` (no agents, no session caps) with principals
`me`, `other` and the admin `root`. `me` creates --mine sessions first, then
`other` --others sessions: each of `me`'s listings (the default page size, one
page) starts before every other session. Then `me` asks for --pages pages and
the admin for --admin-pages first pages of --admin-page-size rows. Prints one
JSON line per phase with meshd's CPU seconds (user + system, /proc) and the
calls' wall time."""

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))

import meshd_testlib as lib  # noqa: E402

_SVC = "/meshd.v1.TensorService/"
TOKENS = {"me": "me-0123456789abcdefghij", "other": "other-0123456789abcdefgh",
          "root": "root-0123456789abcdefgh"}


def cpu_s(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--others", type=int, default=10000)
    ap.add_argument("--mine", type=int, default=3)
    ap.add_argument("--pages", type=int, default=2000)
    ap.add_argument("--admin-pages", type=int, default=2000)
    ap.add_argument("--admin-page-size", type=int, default=10)
    ap.add_argument("extra", nargs="*")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="list-sessions-")
    tokens = os.path.join(tmp, "tokens")
    with open(tokens, "w") as f:
        for name, tok in TOKENS.items():
            f.write(f"{name} {tok}{' admin' if name == 'root' else ''}\n")
    args = ["--listen", "127.0.0.1:0", "--local-agents", "0", "--min-agents", "0",
            "--auth-tokens", tokens, "--max-sessions", "0",
            "--max-sessions-per-principal", "0"] + a.extra
    p = lib.spawn("meshd", lib.MESHD, args, tmp)
    t = lib.tensor_pb2()
    try:
        lib.wait_health(p.port, "", lib.SERVING(), proc=p.proc, log=p.log)
        ch = lib.channel(p.port)

        def call(name, req, reply):
            return ch.unary_unary(_SVC + name, request_serializer=lambda m: m.SerializeToString(),
                                  response_deserializer=reply.FromString)

        create = call("CreateSession", t.CreateSessionRequest, t.CreateSessionReply)
        listing = call("ListSessions", t.ListSessionsRequest, t.ListSessionsReply)

        def md(who):
            return (("authorization", f"Bearer {TOKENS[who]}"),)

        def make(who, n):
            for i in range(0, n, 256):  # 256 calls in flight at a time
                fs = [create.future(t.CreateSessionRequest(client_name=f"{who}{k}"), timeout=30,
                                    metadata=md(who)) for k in range(i, min(n, i + 256))]
                for fu in fs:
                    fu.result()

        def measure(phase, who, calls, req, rows):
            c0, w0 = cpu_s(p.pid), time.monotonic()
            for _ in range(calls):
                r = listing(req, timeout=30, metadata=md(who))
                assert len(r.sessions) == rows, (phase, len(r.sessions))
            c1, w1 = cpu_s(p.pid), time.monotonic()
            print(json.dumps({"phase": phase, "calls": calls, "server_cpu_s": round(c1 - c0, 3),
                              "wall_s": round(w1 - w0, 3),
                              "server_cpu_us_per_call": round((c1 - c0) * 1e6 / calls, 1)}),
                  flush=True)

        make("me", a.mine)
        c0 = cpu_s(p.pid)
        make("other", a.others)
        print(json.dumps({"phase": "create others", "sessions": a.others,
                          "server_cpu_s": round(cpu_s(p.pid) - c0, 3)}), flush=True)
        measure("non-admin pages", "me", a.pages, t.ListSessionsRequest(), a.mine)
        measure("admin first pages", "root", a.admin_pages,
                t.ListSessionsRequest(page_size=a.admin_page_size), a.admin_page_size)
    finally:
        lib.stop(p)


if __name__ == "__main__":
    main()
