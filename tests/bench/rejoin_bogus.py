#!/usr/bin/python3
"""rejoin_bogus: how long a real agent takes to rejoin while bogus registrations
are in flight. Not a test (not run by ctest): run by hand, e.g.

    MESHD_BIN_DIR=build/bin /usr/bin/python3 tests/bench/rejoin_bogus.py --bogus 100

Starts `meshd` (with a join token when the build has --join-token-file, so the
bogus registrations authenticate: the worst case, an insider or a leaked token)
and one real agent at rank 0. Each round SIGKILLs the agent, opens --bogus
RegisterAgent calls whose address is unreachable, and starts a new agent at
rank 0; the figure is the time from the new agent's start to rank 0 healthy in
ListAgents. Bogus caller i asks for rank i + 1 (--any-rank: any free rank, so they
also race the real agent for its vacated rank). A bogus call that the server ends is opened again at once, so that
--bogus stay in flight for the whole round (--once: each registers once, a burst).

Unreachable (--target): `tarpit` (default) is a local port that accepts TCP
connections and never speaks (the server's HTTP/2 handshake waits for its
connect timeout); `refused` is a closed local port; `blackhole` is 192.0.2.1
(TEST-NET-1, nothing answers where it is routed).

Prints one JSON line per round and a summary line."""

import argparse
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))

import grpc  # noqa: E402

import meshd_testlib as lib  # noqa: E402

REGISTER = "/meshd.v1.AgentRegistry/RegisterAgent"


class Tarpit:
    """Accepts connections and holds them without a byte."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4096)
        self.port = self.sock.getsockname()[1]
        self.held = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(c)


class Bogus:
    """n RegisterAgent calls kept in flight (re-opened as soon as one ends)."""

    def __init__(self, server, n, address, token, once=False, any_rank=False):
        self.server, self.address, self.token, self.once = server, address, token, once
        self.any_rank = any_rank
        self.stop = threading.Event()
        self.opened = 0
        self.codes = {}
        self.mu = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True)
                        for i in range(n)]
        for t in self.threads:
            t.start()

    def _loop(self, i):
        reg = lib.registry_pb2()
        md = (("meshd-join-token", self.token),) if self.token else ()
        ch = grpc.insecure_channel(self.server, options=[("grpc.enable_http_proxy", 0)])
        fn = ch.stream_stream(REGISTER, request_serializer=lambda m: m.SerializeToString(),
                              response_deserializer=reg.ServerToAgent.FromString)
        k = 0
        while not self.stop.is_set():
            k += 1
            hello = reg.AgentToServer(hello=reg.RegisterRequest(
                agent_id=f"bogus-{i}-{k}-{os.getpid()}", address=self.address, device="cpu",
                requested_rank=-1 if self.any_rank else 1 + i, call_secret="0" * 64))
            done = self.stop

            def reqs():
                yield hello
                done.wait(60)

            call = fn(reqs(), metadata=md, timeout=60)
            with self.mu:
                self.opened += 1
            try:
                for _ in call:
                    pass
                code = call.code()
            except grpc.RpcError as e:
                code = e.code()
            with self.mu:
                self.codes[code.name] = self.codes.get(code.name, 0) + 1
            if self.once:
                break
            if code == grpc.StatusCode.UNAUTHENTICATED:
                time.sleep(0.05)
        ch.close()

    def close(self):
        self.stop.set()
        for t in self.threads:
            t.join(10)


def agents(port):
    return {a.rank: a for a in lib.list_agents(port, timeout=5.0)}


def wait_rank(port, pred, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            a = agents(port).get(0)
            if pred(a):
                return True
        except grpc.RpcError:
            pass
        time.sleep(0.01)
    return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bogus", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--target", choices=("tarpit", "refused", "blackhole"), default="tarpit")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--any-rank", action="store_true",
                    help="bogus callers ask for any free rank (they then race the real agent "
                         "for its vacated rank 0) rather than ranks 1..N")
    ap.add_argument("--once", action="store_true",
                    help="each bogus caller registers once per round (a burst), not again and again")
    a = ap.parse_args()

    work = tempfile.mkdtemp(prefix="meshd-rejoin-")
    helptext = lib.run(lib.MESHD, ["--help"]).stdout
    token = None
    extra = []
    if "join-token-file" in helptext:
        token = os.urandom(16).hex()
        tf = os.path.join(work, "join-token")
        with open(tf, "w") as f:
            f.write(token + "\n")
        os.chmod(tf, 0o600)
        extra = ["--join-token-file", tf]
    srv = lib.spawn("meshd", lib.MESHD, ["--listen", "127.0.0.1:0", "--min-agents", "1"] + extra,
                    work)
    lib.wait_health(srv.port, "", lib.SERVING(), proc=srv.proc, log=srv.log)
    server = f"127.0.0.1:{srv.port}"

    def start_agent():
        return lib.spawn("agent", lib.AGENT, ["--server", server, "--listen", "127.0.0.1:0",
                                              "--rank", "0"] + extra, work)

    if a.target == "tarpit":
        pit = Tarpit()
        address = f"127.0.0.1:{pit.port}"
    elif a.target == "refused":
        address = f"127.0.0.1:{lib.free_port()}"
    else:
        address = "192.0.2.1:4000"

    ag = start_agent()
    assert wait_rank(srv.port, lambda x: x is not None and x.healthy, 20), lib.log_tail(srv.log)
    times = []
    try:
        for r in range(a.rounds):
            assert wait_rank(srv.port, lambda x: x is not None and x.healthy, a.timeout), \
                "rank 0 did not come back"
            old = agents(srv.port)[0].agent_id
            os.kill(ag.pid, signal.SIGKILL)
            ag.proc.wait(10)
            assert wait_rank(srv.port, lambda x: x is None or x.agent_id != old, 20)
            bogus = Bogus(server, a.bogus, address, token, a.once, a.any_rank) if a.bogus else None
            time.sleep(0.3)  # let them reach the server
            t0 = time.monotonic()
            ag = start_agent()
            ok = wait_rank(srv.port, lambda x: x is not None and x.healthy and x.agent_id != old,
                           a.timeout)
            dt = time.monotonic() - t0
            if bogus:
                bogus.close()
            line = {"round": r, "rejoin_s": round(dt, 3) if ok else None,
                    "bogus_opened": bogus.opened if bogus else 0,
                    "bogus_ends": bogus.codes if bogus else {}}
            print(json.dumps(line), flush=True)
            times.append(dt if ok else float("inf"))
    finally:
        lib.stop(ag)
        lib.stop(srv)
    print(json.dumps({"bogus": a.bogus, "target": a.target, "once": a.once,
                      "any_rank": a.any_rank, "token": bool(token),
                      "rounds": len(times), "median_s": round(statistics.median(times), 3),
                      "max_s": round(max(times), 3)}), flush=True)


if __name__ == "__main__":
    main()
