#!/usr/bin/python3
"""stranger_conns: how much of meshd's memory a stranger's burst of refused calls
on many connections holds (docs/security.md "Before the guard"). Not a test (not
run by ctest): run by hand, e.g.

    MESHD_BIN_DIR=build/bin /usr/bin/python3 tests/bench/stranger_conns.py \
        --conns 30 --calls 1000 [-- extra meshd flags]

Starts `meshd --auth-tokens` (no agents), opens --conns raw HTTP/2 connections
with no token, and on each sends --calls unary ListSessions calls whose
--body bytes of request never finish (refused UNAUTHENTICATED at the headers).
With --agent, one local agent, and the calls are Agent/Read calls without the
call secret on the agent's port (the agent's VmRSS is measured). --env K=V
sets a variable for meshd and its local agents (MESHD_RPC_MEMORY_BYTES=64MiB).
Prints one JSON line per connection (meshd's VmRSS) and a summary; the
connections stay open until the end."""

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))

import meshd_testlib as lib  # noqa: E402
import test_security as ts  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conns", type=int, default=30)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--body", type=int, default=60000)
    ap.add_argument("--agent", action="store_true")
    ap.add_argument("--env", action="append", default=[])
    ap.add_argument("extra", nargs="*")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="stranger-conns-")
    tokens = os.path.join(tmp, "tokens")
    with open(tokens, "w") as f:
        f.write(f"alice {ts.ALICE}\n")
    args = ["--listen", "127.0.0.1:0", "--local-agents", "1" if a.agent else "0",
            "--min-agents", "0", "--auth-tokens", tokens] + a.extra
    p = lib.spawn("meshd", lib.MESHD, args, tmp, env=dict(e.split("=", 1) for e in a.env))
    lib.wait_health(p.port, "", lib.SERVING(), proc=p.proc, log=p.log)
    port, pid, path = p.port, p.pid, ts._SVC + "ListSessions"
    if a.agent:
        t = lib.tensor_pb2()
        deadline = time.monotonic() + lib.REGISTER_TIMEOUT
        while True:
            agents = lib.unary(p.port, ts._SVC + "ListAgents", t.ListAgentsRequest(),
                               t.ListAgentsReply, metadata=ts.bearer(ts.ALICE)).agents
            if agents and agents[0].healthy:
                break
            assert time.monotonic() < deadline, "no agent"
            time.sleep(0.1)
        port = int(agents[0].address.rsplit(":", 1)[1])
        pid = list(lib.agent_children(p.pid))[0]
        path = "/meshd.agent.v1.Agent/Read"
    socks = []
    t0 = time.monotonic()
    try:
        before = ts._rss_mib(pid)
        sent = 0
        for i in range(a.conns):
            s, n = ts._h2_partial_unary_calls(port, path, a.calls, a.body)
            socks.append(s)
            sent += n
            print(json.dumps({"conn": i + 1, "sent_mib": sent >> 20,
                              "rss_mib": round(ts._rss_mib(pid), 1),
                              "t": round(time.monotonic() - t0, 1)}), flush=True)
        time.sleep(1.0)
        after = ts._rss_mib(pid)
        ok = lib.health_check(p.port, "") == lib.SERVING()
        print(json.dumps({"before_mib": round(before, 1), "after_mib": round(after, 1),
                          "grown_mib": round(after - before, 1), "sent_mib": sent >> 20,
                          "serving": ok, "seconds": round(time.monotonic() - t0, 1)}))
    finally:
        for s in socks:
            s.close()
        time.sleep(1.0)
        print(json.dumps({"after_close_mib": round(ts._rss_mib(pid), 1)}))
        lib.stop(p)


if __name__ == "__main__":
    main()
