"""Prometheus metrics (docs/operations.md "Metrics"): meshd and meshd-agent serve
GET /metrics on --metrics-listen and write its port to --metrics-port-file; local
agents on --local-agent-metrics-port-base + rank. Structured logs: --log-format=json."""

import json
import os
import re
import signal
import socket
import sys
import time
import urllib.error
import urllib.request

import meshd_testlib as lib
from meshd_testlib import Ref, Session, borrow, drop, drop_borrow, reduce, sync
from test_transfers import fetch_floats, upload


def scrape(port, path="/metrics"):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return r.read().decode()


def value(text, series):
    """The value of one sample line, `series` written exactly as in the text; None if absent."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line[len(series) + 1:])
    return None


def port_of(path, p):
    return lib.read_port_file(str(path), p.proc, p.log)


# ---------------------------------------------------------------- exposition format

NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')
SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)")


def parse(text):
    """The families of a scrape, {name: {"help", "type", "samples": [(name, labels, value)]}},
    checked against the text format 0.0.4 as Prometheus reads it and meshd writes it: every
    family has one HELP and one TYPE before its samples, names and labels are well formed, a
    sample belongs to the family above it, `_total` ends counters' names and nothing else's,
    and a histogram's buckets are cumulative, end in +Inf, and _count is the +Inf bucket."""
    fams, cur = {}, None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_ = line[7:].partition(" ")
            assert NAME.fullmatch(name), line
            assert name not in fams, f"two HELP lines for {name}"
            assert help_.strip(), f"{name}: empty HELP"
            cur = fams[name] = {"name": name, "help": help_, "type": None, "samples": []}
        elif line.startswith("# TYPE "):
            name, typ = line[7:].split(" ")
            assert cur and cur["name"] == name and cur["type"] is None, f"TYPE out of place: {line}"
            assert typ in ("counter", "gauge", "histogram"), line
            cur["type"] = typ
        else:
            m = SAMPLE.fullmatch(line)
            assert m and cur and cur["type"], f"not a sample of a typed family: {line!r}"
            labels = dict(LABEL.findall(m[2] or ""))
            assert ",".join(f'{k}="{v}"' for k, v in labels.items()) == (m[2] or ""), line
            allowed = {cur["name"]} if cur["type"] != "histogram" else {
                cur["name"] + s for s in ("_bucket", "_sum", "_count")}
            assert m[1] in allowed, f"{m[1]} under family {cur['name']}"
            cur["samples"].append((m[1], labels, float(m[3])))
    for f in fams.values():
        assert f["name"].endswith("_total") == (f["type"] == "counter"), \
            f"{f['name']} is a {f['type']}: _total belongs to counters, and only to them"
        if f["type"] != "histogram":
            continue
        series = {}
        for name, labels, v in f["samples"]:
            key = tuple(sorted((k, x) for k, x in labels.items() if k != "le"))
            series.setdefault(key, []).append((name, labels.get("le"), v))
        for key, rows in series.items():
            buckets = [(float(le), v) for n, le, v in rows if n.endswith("_bucket")]
            assert buckets and buckets[-1][0] == float("inf"), f"{f['name']}{key}: no +Inf bucket"
            assert [b for b, _ in buckets] == sorted(b for b, _ in buckets), f"{f['name']}: le order"
            assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), \
                f"{f['name']}{key}: buckets not cumulative: {buckets}"
            counts = [v for n, _, v in rows if n.endswith("_count")]
            assert counts == [buckets[-1][1]], f"{f['name']}{key}: _count {counts} != +Inf bucket"
            assert len([n for n, _, _ in rows if n.endswith("_sum")]) == 1
    return fams


def sample(fams, name, **labels):
    """The value of the sample `name` with exactly these labels; None if absent."""
    fam = fams.get(re.sub(r"_(bucket|sum|count)$", "", name)) or fams.get(name)
    for n, ls, v in (fam or {"samples": []})["samples"]:
        if n == name and ls == labels:
            return v
    return None


def check_process(fams, pid):
    """The process_* and build_info families describe process `pid`."""
    assert fams["process_cpu_seconds_total"]["type"] == "counter"
    assert sample(fams, "process_resident_memory_bytes") > 1 << 20
    assert sample(fams, "process_open_fds") > 3
    start = sample(fams, "process_start_time_seconds")
    assert time.time() - 3600 < start <= time.time() + 1, start
    # the kernel's own account of the start, to the clock tick
    ticks = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    assert abs(start - (btime + lib.proc_starttime(pid) / ticks)) < 0.02, start
    (name, labels, v), = fams["meshd_build_info"]["samples"]
    assert v == 1 and set(labels) == {"version", "commit", "cuda"}, labels
    assert labels["cuda"] in ("true", "false")
    with open(os.path.join(lib.SOURCE_DIR, "VERSION")) as f:
        assert labels["version"] == f.read().strip()


def free_ports(n):
    """A base port with n free ports from it (bound together, then released)."""
    for _ in range(50):
        base = lib.free_port()
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError(f"no {n} consecutive free ports")


CALLS = 40


def test_server_metrics(meshd_server, tmp_path):
    pf = tmp_path / "metrics.port"
    base = free_ports(2)
    srv = meshd_server(2, "--metrics-listen", "127.0.0.1:0", "--metrics-port-file", pf,
                       "--local-agent-metrics-port-base", base, "--link-hold-ms", "50",
                       "--link-lone-ms", "0")
    lib.wait_ready(srv, 2)
    mport = port_of(pf, srv)
    text = scrape(mport)
    fams = parse(text)
    assert "# TYPE meshd_commands_total counter" in text
    assert "# TYPE meshd_command_duration_seconds histogram" in text
    assert value(text, 'meshd_agents{state="healthy"}') == 2
    assert value(text, 'meshd_agents{state="registered"}') == 2
    assert value(text, "meshd_sessions") == 0
    check_process(fams, srv.pid)
    assert fams["meshd_sync_duration_seconds"]["type"] == "histogram"
    assert fams["meshd_queued_instructions"]["type"] == "gauge"
    assert sample(fams, "meshd_agent_restarts_total") == 0
    assert sample(fams, "meshd_local_agents_failing") == 0
    syncs0 = sample(fams, "meshd_sync_duration_seconds_count")

    # Local agents serve their metrics on base + rank, as the agent they are.
    pids = {lib.child_rank(p): p for p in lib.agent_children(srv.pid)}
    for rank in range(2):
        afams = parse(scrape(base + rank))
        check_process(afams, pids[rank])
        assert afams["meshd_agent_allocated_bytes"]["type"] == "gauge"
        assert afams["meshd_collective_aborts_total"]["type"] == "counter"
        assert {ls["reason"] for _, ls, _ in afams["meshd_collective_aborts_total"]["samples"]} == \
            {"agent_lost", "timeout", "peer_aborted", "behind", "refused", "error"}

    with Session(srv.port, "metrics") as s:
        m = s.mesh(gpu=2).ref
        x = s.tensor(m, (3,))
        # Unary commands one at a time reach the agents in a few batches, not one each:
        # their instructions wait in the links (here up to 50 ms) for the next ones.
        links = parse(scrape(mport))
        for _ in range(CALLS):
            s.op("add", Ref(x.ref), Ref(x.ref))
        s.run(sync())
        after = parse(scrape(mport))
        sent = sample(after, "meshd_link_instructions_total") - \
            sample(links, "meshd_link_instructions_total")
        batches = sample(after, "meshd_link_batches_total") - \
            sample(links, "meshd_link_batches_total")
        assert sent >= 2 * CALLS + 2, sent  # a Call and a Sync per rank
        assert batches * 4 <= sent, f"{sent} instructions in {batches} batches"
        # A Drop of many tensors is one DeleteRefs per agent, not one per tensor.
        made = [s.tensor(m, (2,)).ref for _ in range(40)]
        s.run(sync())
        before = [sample(parse(scrape(base + r)), "meshd_agent_instructions_total") for r in range(2)]
        s.run(drop(*made))
        s.run(sync())
        grew = [sample(parse(scrape(base + r)), "meshd_agent_instructions_total") - before[r]
                for r in range(2)]
        assert grew == [1, 1], f"a Drop of 40 tensors took {grew} instructions per agent"
        s.fails("REF_REUSED", lib.create_mesh(m, gpu=2), "CreateMesh")
        text = scrape(mport)
        assert value(text, "meshd_sessions") == 1
        for _ in range(4):
            s.run(sync())
        # Bytes through Upload and Fetch (the proxy path), counted once as the client sent
        # and read them, however many ranks they went to or came from.
        moved = parse(scrape(mport))
        up = upload(s, m, [1.5] * 1000)
        assert fetch_floats(s, up.tensor.ref) == [1.5] * 1000
        after = parse(scrape(mport))
        for d in ("upload", "fetch"):
            grew = sample(after, "meshd_transfer_bytes_total", direction=d, path="proxy") - \
                sample(moved, "meshd_transfer_bytes_total", direction=d, path="proxy")
            assert grew == 4000, (d, grew)
            assert sample(after, "meshd_transfer_bytes_total", direction=d, path="direct") == 0
        s.close()
    assert value(text, 'meshd_commands_total{kind="Call",status="ok"}') == CALLS
    assert value(text, 'meshd_commands_total{kind="Factory",status="ok"}') == 41
    assert value(text, 'meshd_commands_total{kind="CreateMesh",status="ok"}') == 1
    assert value(text, 'meshd_commands_total{kind="CreateMesh",status="REF_REUSED"}') == 1
    assert value(text, 'meshd_command_duration_seconds_count{kind="Call"}') == CALLS
    assert value(text, 'meshd_command_duration_seconds_bucket{kind="Call",le="+Inf"}') == CALLS
    assert value(text, 'meshd_command_duration_seconds_sum{kind="Call"}') >= 0
    fams = parse(scrape(mport))
    assert sample(fams, "meshd_sessions") == 0
    assert sample(fams, "meshd_sync_duration_seconds_count") >= syncs0 + 4
    assert sample(fams, "meshd_sync_duration_seconds_sum") > 0
    assert sample(fams, "meshd_queued_instructions") >= 0

    try:
        scrape(mport, "/nope")
        raise AssertionError("expected 404")
    except urllib.error.HTTPError as e:
        assert e.code == 404

    # A local agent killed is started again, counted, and serves its metrics again.
    os.kill(pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 15
    while sample(parse(scrape(mport)), "meshd_agent_restarts_total") != 1:
        assert time.monotonic() < deadline, "meshd_agent_restarts_total did not reach 1"
        time.sleep(0.05)
    while True:
        new = {lib.child_rank(p): p for p in lib.agent_children(srv.pid)}.get(1)
        try:
            if new and new != pids[1]:
                check_process(parse(scrape(base + 1)), new)
                break
        except (urllib.error.URLError, ConnectionError, AssertionError):
            pass
        assert time.monotonic() < deadline, "the restarted agent serves no metrics"
        time.sleep(0.05)
    assert sample(parse(scrape(mport)), "meshd_agent_restarts_total") == 1


def test_local_agent_metrics_port_base_needs_local_agents():
    r = lib.run(lib.MESHD, ["--listen", "127.0.0.1:0", "--local-agent-metrics-port-base", "9100"])
    assert r.returncode == 2 and "--local-agent-metrics-port-base needs --local-agents" in r.stderr, r
    r = lib.run(lib.MESHD, ["--listen", "127.0.0.1:0", "--local-agents", "2",
                            "--local-agent-metrics-port-base", "65535"])
    assert r.returncode == 2 and "past port 65535" in r.stderr, r


def test_drop_borrow_frees_the_views_of_its_handle_on_the_agents(meshd_server):
    """A view of a borrow's handle holds the origin's memory on the agents: DropBorrow
    deletes it there too, so borrowing, viewing, dropping the borrow and the origin,
    over and over, leaves the agent's allocated bytes where they were."""
    base = free_ports(1)
    srv = meshd_server(1, "--local-agent-metrics-port-base", base)
    lib.wait_ready(srv, 1)
    allocated = lambda: value(scrape(base), "meshd_agent_allocated_bytes")  # noqa: E731
    with Session(srv.port, "borrow-views") as s:
        m = s.mesh(gpu=1)
        side = s.stream("side")
        s.run(sync())
        a0 = allocated()
        for _ in range(4):
            x = s.tensor(m.ref, (4, 1 << 18))  # 4 MiB
            h, b = s.new_ref(), s.new_ref()
            s.run(borrow(h, x.ref, side, False, b))
            s.op("select", Ref(h), 0, 1, stream=side)
            s.run(drop_borrow(b))
            s.run(drop(x.ref))
        s.run(sync())
        deadline = time.monotonic() + 5
        while allocated() > a0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert allocated() <= a0, f"{allocated() - a0} bytes still allocated on the agent"


def test_the_metrics_port_holds_few_connections_per_address(meshd_server, tmp_path):
    """A stranger opening many idle connections gets 16 held (the rest are closed at
    once), not a file descriptor each until the process runs out; once they go, scrapes
    work again."""
    pf = tmp_path / "metrics.port"
    srv = meshd_server(0, "--metrics-listen", "127.0.0.1:0", "--metrics-port-file", pf,
                       min_agents=0)
    mport = port_of(pf, srv)
    socks = []
    try:
        for _ in range(40):
            socks.append(socket.create_connection(("127.0.0.1", mport), timeout=5))
        time.sleep(0.5)
        closed = 0
        for sk in socks:
            sk.settimeout(0.2)
            try:
                closed += sk.recv(1) == b""
            except (socket.timeout, ConnectionResetError):
                closed += isinstance(sys.exc_info()[1], ConnectionResetError)
        assert closed >= 40 - 16, f"{40 - closed} of 40 idle connections held"
    finally:
        for sk in socks:
            sk.close()
    end = time.monotonic() + 10
    while True:
        try:
            assert "meshd_sessions" in scrape(mport)
            break
        except (urllib.error.URLError, ConnectionError):
            assert time.monotonic() < end, "no scrape after the connections closed"
            time.sleep(0.2)


def test_slow_requests_on_the_metrics_port_do_not_hold_it(meshd_server, tmp_path):
    """MHD's 10 s timeout is one of inactivity: a stranger that sends a header byte
    every second never completes a request and is never closed, and 64 such
    connections from 4 addresses (16 each) held every connection the port takes:
    every scrape timed out for as long as the stranger liked. A request's headers
    must now arrive within a bound (10 s), then the connection is closed."""
    import select
    pf = tmp_path / "metrics.port"
    srv = meshd_server(0, "--metrics-listen", "127.0.0.1:0", "--metrics-port-file", pf,
                       min_agents=0)
    mport = port_of(pf, srv)
    socks = []
    try:
        for ip in range(2, 6):
            for _ in range(16):
                sk = socket.socket()
                sk.bind((f"127.0.0.{ip}", 0))
                sk.settimeout(5)
                sk.connect(("127.0.0.1", mport))
                sk.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                socks.append(sk)
        import threading
        stop = threading.Event()
        closed = []

        def feed():  # a byte a second on each, for as long as the port takes them
            while not stop.wait(1.0):
                for sk in socks:
                    if sk in closed:
                        continue
                    try:
                        if select.select([sk], [], [], 0)[0] and sk.recv(1024) == b"":
                            raise ConnectionResetError
                        sk.sendall(b"a")
                    except OSError:
                        closed.append(sk)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        t0 = time.monotonic()
        scraped = False
        try:
            while time.monotonic() - t0 < 25 and not scraped:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics",
                                                timeout=2) as r:
                        scraped = "meshd_sessions" in r.read().decode()
                except (urllib.error.URLError, ConnectionError, TimeoutError, socket.timeout):
                    time.sleep(0.5)
        finally:
            stop.set()
            feeder.join(10)
        assert scraped, (f"no scrape in 25 s while {64 - len(closed)} connections sent a "
                         f"header byte a second")
        for sk in socks:  # the slow ones were closed, not served
            if sk not in closed and select.select([sk], [], [], 2.0)[0]:
                try:
                    if sk.recv(1024) == b"":
                        closed.append(sk)
                except OSError:
                    closed.append(sk)
        assert len(closed) == 64, f"{64 - len(closed)} slow connections still open"
    finally:
        for sk in socks:
            sk.close()


def test_agent_metrics(meshd_server, agent, tmp_path):
    srv = meshd_server(0, min_agents=2)
    ports = []
    for rank in range(2):
        pf = tmp_path / f"agent{rank}.metrics.port"
        a = agent(srv.port, "--metrics-listen", "127.0.0.1:0", "--metrics-port-file", pf, rank=rank)
        ports.append(port_of(pf, a))
    lib.wait_ready(srv, 2)
    before = [scrape(p) for p in ports]
    for text in before:
        assert "# TYPE meshd_agent_allocated_bytes gauge" in text
        assert "# TYPE meshd_agent_instructions_total counter" in text
        assert value(text, "meshd_collective_bytes_total") == 0

    with Session(srv.port, "agent-metrics") as s:
        m = s.mesh(gpu=2).ref
        x = s.tensor(m, (4,))  # float32 zeros: 16 bytes per agent
        s.run(reduce(s.new_ref(), x.ref, dims=["gpu"], reduction="sum"))
        s.run(sync())
        for p in ports:
            text = scrape(p)
            assert value(text, "meshd_agent_instructions_total") >= 2, text
            assert value(text, "meshd_agent_allocated_bytes") >= 16, text
            assert value(text, "meshd_collective_bytes_total") >= 16, text
    assert re.search(r"^meshd_agent_allocated_bytes \d", scrape(ports[0]), re.M)
    parse(scrape(ports[0]))


# ---------------------------------------------------------------- structured logs

TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z")


def test_json_logs(meshd_server):
    """--log-format=json (here MESHD_LOG_FORMAT): every line meshd and its local agent write (one log) is one JSON
    object with time, level, component and msg, and session, rank and seq where known."""
    # From the environment, as a container sets it; the local agent inherits that
    # environment but takes the server's format and no metrics port (the server's).
    mport = free_ports(1)
    srv = meshd_server(1, "--log-level=debug", env={
        "MESHD_LOG_FORMAT": "json", "MESHD_METRICS_LISTEN": f"127.0.0.1:{mport}"})
    lib.wait_ready(srv, 1)
    (agent_pid,) = lib.agent_children(srv.pid)
    argv = lib.proc_cmdline(agent_pid)
    assert argv[argv.index("--log-format") + 1] == "json" and "--metrics-listen=" in argv, argv
    assert "meshd_build_info" in scrape(mport)
    name = 'we"ird\\name \u00e9'  # a quote, a backslash, non-ASCII (control bytes: refused)
    with Session(srv.port, name) as s:
        m = s.mesh(gpu=1).ref
        x = s.tensor(m, (2,))
        s.fails("REF_REUSED", lib.factory(x.ref, m, shape=(2,)), "Factory")
        s.run(sync())
        s.close()
    assert lib.stop(srv) == 0
    with open(srv.log, "rb") as f:
        raw = f.read()
    lines = [json.loads(line) for line in raw.decode("utf-8").splitlines()]
    for e in lines:
        assert TIME.fullmatch(e["time"]), e
        assert e["level"] in ("debug", "info", "warn", "error"), e
        assert isinstance(e["component"], str) and e["component"] and isinstance(e["msg"], str), e
        assert set(e) <= {"time", "level", "component", "msg", "session", "rank", "seq",
                          "source"}, e
        assert isinstance(e.get("session", ""), str) and isinstance(e.get("rank", 0), int) and \
            isinstance(e.get("seq", 1), int) and e.get("seq", 1) > 0, e
    about = [e for e in lines if e.get("session") == s.id]
    assert any("created" in e["msg"] and name in e["msg"] for e in about), about
    assert any(e["component"] == "server" and "ended" in e["msg"] for e in about), about
    rejected = [e for e in about if "rejected" in e["msg"]]
    assert rejected and rejected[0]["seq"] > 0 and "REF_REUSED" in rejected[0]["msg"], about
    assert any(e["component"] == "agent" and e.get("rank") == 0 for e in lines)
    assert any(e["component"] == "supervisor" and e.get("rank") == 0 for e in lines)
    assert any(e["msg"] == "stopped" and e["component"] == "server" for e in lines)


def test_bad_log_format_stops_startup():
    for binary, args in ((lib.MESHD, ["--listen", "127.0.0.1:0"]),
                         (lib.AGENT, ["--server", "127.0.0.1:1"])):
        r = lib.run(binary, args + ["--log-format=yaml"])
        assert r.returncode == 2, r
        assert "--log-format: 'yaml' is not one of text, json" in r.stderr, r.stderr
        r = lib.run(binary, args, env={"MESHD_LOG_FORMAT": "yaml"})
        assert r.returncode == 2 and "'yaml' is not one of text, json" in r.stderr, r.stderr


def test_a_sync_is_counted_before_its_answer(meshd_server, tmp_path):
    """meshd_commands_total and meshd_command_duration_seconds count a Sync before the
    Sync is answered, as every other command: a client that scrapes right after its
    Sync's answer sees it. (A Sync whose wait was over at once was answered from
    wait_sync, and counted only after that.)"""
    pf = tmp_path / "metrics.port"
    srv = meshd_server(1, "--metrics-listen", "127.0.0.1:0", "--metrics-port-file", pf)
    lib.wait_ready(srv, 1)
    mport = port_of(pf, srv)
    with Session(srv.port, "sync-count") as s:
        missed = []
        for i in range(1, 301):
            s.run(sync())
            fams = parse(scrape(mport))
            n = sample(fams, "meshd_commands_total", kind="Sync", status="ok")
            d = sample(fams, "meshd_command_duration_seconds_count", kind="Sync")
            if n != i or d != i:
                missed.append((i, n, d))
                deadline = time.monotonic() + 5  # it comes, late: wait for it
                while sample(parse(scrape(mport)), "meshd_command_duration_seconds_count",
                             kind="Sync") != i:
                    assert time.monotonic() < deadline, f"Sync {i} never counted"
                    time.sleep(0.01)
        assert not missed, f"Syncs answered before they were counted: {missed[:5]} " \
            f"({len(missed)} of 300)"


def test_commands_refused_before_they_run_are_counted(meshd_server, tmp_path):
    """A command refused on its stream before it runs (a seq not above the last one, a
    batch inside a batch) is counted in meshd_commands_total with its error kind, as
    every other refused command: before, these refusals left no trace in the metrics."""
    from meshd_testlib import create_mesh
    pb = lib.tensor_pb2
    pf = tmp_path / "metrics.port"
    srv = meshd_server(1, "--metrics-listen", "127.0.0.1:0", "--metrics-port-file", pf)
    lib.wait_ready(srv, 1)
    mport = port_of(pf, srv)
    with Session(srv.port, "refused-count") as s:
        nested = pb().Command(seq=3, batch=[s.command(create_mesh(2, gpu=1), seq=2)])
        results, _, _ = s.submit([s.command(create_mesh(1, gpu=1), seq=4),
                                  s.command(create_mesh(5, gpu=1), seq=4),  # not above 4
                                  pb().Command(batch=[nested])])           # nests
        assert [r.HasField("error") for r in results] == [False, True, True], results
    fams = parse(scrape(mport))
    assert sample(fams, "meshd_commands_total", kind="CreateMesh", status="ok") == 1
    assert sample(fams, "meshd_commands_total", kind="CreateMesh", status="BAD_ARGUMENT") == 1
    refused = [(ls["kind"], v) for _, ls, v in fams["meshd_commands_total"]["samples"]
               if ls["status"] == "BAD_ARGUMENT"]
    assert sum(v for _, v in refused) == 2, refused
