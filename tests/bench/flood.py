#!/usr/bin/python3
"""flood: many clients pipelining work into one meshd for a long time, while the
server's memory is sampled. Not a test (not run by ctest): run by hand, e.g.

    MESHD_BIN_DIR=build/bin /usr/bin/python3 tests/bench/flood.py --seconds 600

Starts `meshd --local-agents A` (its own free port, --metrics-listen on another),
then C client processes. Each opens a session, makes a mesh over every agent and
keeps one Submit stream full for --seconds: Factory (ones [N]), Call add(x, 1.0),
and every --batch pairs a Drop of them all, so tensors are freed as fast as they
are made; the replies are read as they come. At the end each client sends a Sync
and reports how long it took. With --session-commands a client moves to a new
session every so many commands (Sync, CloseSession, CreateSession).

Every --every seconds one JSON line on stdout: the server's VmRSS (and the
agents' together), its meshd_queued_commands and meshd_flow_waiting, and the
replies the clients got so far. The last line summarises: first, min, max and
last server RSS, the clients' totals and their Sync times. Extra meshd flags go
after `--` (e.g. `-- --session-max-queued 1024`).

Use Debian's /usr/bin/python3 (grpcio); generated modules come from
tests/integration/meshd_testlib.py."""

import argparse
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))

import meshd_testlib as lib  # noqa: E402

_SVC = "/meshd.v1.TensorService/"


def rss_kib(pid, key="VmRSS"):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def metric(port, name):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


# ---------------------------------------------------------------- one client (a process)

def one_session(idx, port, nagents, stop_at, limit, batch, size, counter, state):
    """One session's run: a Submit stream until stop_at (or `limit` commands, 0: no
    limit), then a Sync, then CloseSession. Returns (stream code, Sync ms, Sync errors)."""
    t = lib.tensor_pb2()
    s = lib.Session(port, f"flood-{idx}", timeout=60)
    m = s.mesh(gpu=nagents).ref
    sent0 = state["sent"]

    def commands():
        live = []
        while time.monotonic() < stop_at and not (limit and state["sent"] - sent0 >= limit):
            x, y = s.new_ref(), s.new_ref()
            yield s.command(lib.factory(x, m, "ones", (size,), "float32"))
            yield s.command(lib.call("add", lib.Ref(x), 1.0, results=[y]))
            live += [x, y]
            state["sent"] += 2
            if len(live) >= 2 * batch:
                yield s.command(lib.drop(*live))
                live = []
                state["sent"] += 1
        if live:
            yield s.command(lib.drop(*live))
            state["sent"] += 1

    fn = s.ch.stream_stream(_SVC + "Submit", request_serializer=lambda c: c.SerializeToString(),
                            response_deserializer=t.SubmitReply.FromString)
    call = fn(commands(), metadata=s.metadata, timeout=max(0, stop_at - time.monotonic()) + 600)
    code = "OK"
    try:
        for r in call:
            state["replies"] += 1
            with counter.get_lock():
                counter.value += 1
            if r.result.HasField("error"):
                state["errors"] += 1
                if not state["first_error"]:
                    state["first_error"] = f"{lib.kind_name(r.result.error.kind)}: {r.result.error.message}"
    except Exception as e:  # grpc.RpcError
        code = str(getattr(e, "code", lambda: e)())
    t0 = time.monotonic()
    try:
        errs = s.run(lib.sync(), timeout=600).errors
        sync_ms, sync_errors = (time.monotonic() - t0) * 1000, len(errs)
    except Exception as e:
        sync_ms, sync_errors = None, str(e)
    try:
        s.close()
    except Exception:
        pass
    s.shut()
    return code, sync_ms, sync_errors


def client_main(idx, port, nagents, seconds, session_commands, batch, size, counter, out):
    stop_at = time.monotonic() + seconds
    state = {"sent": 0, "replies": 0, "errors": 0, "first_error": ""}
    sessions, codes, syncs, sync_errors = 0, set(), [], 0
    while time.monotonic() < stop_at:
        code, ms, errs = one_session(idx, port, nagents, stop_at, session_commands, batch, size,
                                     counter, state)
        sessions += 1
        codes.add(code)
        if ms is not None:
            syncs.append(ms)
        if errs:
            sync_errors += 1
    out.put({"client": idx, "sessions": sessions, "sent": state["sent"],
             "replies": state["replies"], "errors": state["errors"],
             "first_error": state["first_error"], "stream": ",".join(sorted(codes)),
             "final_sync_ms": syncs[-1] if syncs else None,
             "sync_ms_max": max(syncs) if syncs else None, "sync_errors": sync_errors})


# ---------------------------------------------------------------- main

def main():
    argv = sys.argv[1:]
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--every", type=float, default=5)
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64, help="(x, y) pairs per Drop")
    ap.add_argument("--session-commands", type=int, default=0,
                    help="a client closes its session and opens a new one after this many "
                         "commands (0: one session for the whole run). A session keeps a "
                         "tombstone per dropped ref, so its server memory grows with its age")
    ap.add_argument("--size", type=int, default=16384,
                    help="float32 elements per tensor (16384: the agents, not the clients, set the pace)")
    a = ap.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="meshd-flood-")
    pf, mpf, log = (os.path.join(tmp, n) for n in ("port", "metrics.port", "meshd.log"))
    args = [lib.MESHD, "--listen", "127.0.0.1:0", "--port-file", pf, "--local-agents",
            str(a.agents), "--metrics-listen", "127.0.0.1:0", "--metrics-port-file", mpf] + extra
    with open(log, "w") as logf:
        srv = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, env=lib.clean_env())
    try:
        port = lib.read_port_file(pf, srv, log)
        mport = lib.read_port_file(mpf, srv, log)
        lib.wait_health(port, lib.TENSOR_SERVICE, lib.SERVING(), proc=srv, log=log)
        agents = list(lib.agent_children(srv.pid))
        print(json.dumps({"flood": "start", "meshd_pid": srv.pid, "port": port, "agents": a.agents,
                          "clients": a.clients, "seconds": a.seconds, "meshd_flags": extra,
                          "log": log}), flush=True)

        # Spawned, not forked: this process already runs gRPC, which does not
        # survive a fork.
        ctx = mp.get_context("spawn")
        counter = ctx.Value("q", 0)
        out = ctx.Queue()
        procs = [ctx.Process(target=client_main,
                            args=(i, port, a.agents, a.seconds, a.session_commands, a.batch,
                                  a.size, counter, out))
                 for i in range(a.clients)]
        t0 = time.monotonic()
        for p in procs:
            p.start()
        samples = []
        next_at = t0
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if now >= next_at:
                rss = rss_kib(srv.pid)
                ag = sum(v for v in (rss_kib(p) for p in agents) if v)
                row = {"t": round(now - t0, 1), "server_rss_kib": rss, "agents_rss_kib": ag,
                       "queued_commands": metric(mport, "meshd_queued_commands"),
                       "flow_waiting": metric(mport, "meshd_flow_waiting"),
                       "replies": counter.value}
                samples.append(row)
                print(json.dumps(row), flush=True)
                next_at += a.every
            time.sleep(0.2)
        hwm = rss_kib(srv.pid, "VmHWM")
        clients = []
        for p in procs:
            p.join()
        for _ in procs:
            try:
                clients.append(out.get(timeout=5))
            except Exception:
                break
        clients.sort(key=lambda c: c["client"])
        for c in clients:
            print(json.dumps(c), flush=True)
        rs = [s["server_rss_kib"] for s in samples if s["server_rss_kib"]]
        syncs = [c["final_sync_ms"] for c in clients if c["final_sync_ms"] is not None]
        print(json.dumps({
            "flood": "summary", "seconds": round(time.monotonic() - t0, 1), "samples": len(rs),
            "server_rss_first_kib": rs[0] if rs else None,
            "server_rss_min_kib": min(rs) if rs else None,
            "server_rss_max_kib": max(rs) if rs else None,
            "server_rss_last_kib": rs[-1] if rs else None,
            "server_vmhwm_kib": hwm,
            "replies": sum(c["replies"] for c in clients),
            "errors": sum(c["errors"] for c in clients),
            "commands_per_s": round(sum(c["replies"] for c in clients) / a.seconds, 1),
            "final_sync_ms_max": max(syncs) if syncs else None,
            "sync_ms_max": max((c["sync_ms_max"] for c in clients if c["sync_ms_max"] is not None),
                               default=None),
            "sessions": sum(c["sessions"] for c in clients),
            "clients_ok": sum(1 for c in clients if c["stream"] == "OK" and c["sync_errors"] == 0),
        }), flush=True)
    finally:
        srv.send_signal(signal.SIGTERM)
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait()


if __name__ == "__main__":
    main()
