"""Prometheus metrics (docs/operations.md "Metrics"): meshd and meshd-agent serve
GET /metrics on --metrics-listen and write its port to --metrics-port-file."""

import re
import urllib.error
import urllib.request

import meshd_testlib as lib
from meshd_testlib import Ref, Session, reduce, sync


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


def test_server_metrics(meshd_server, tmp_path):
    pf = tmp_path / "metrics.port"
    srv = meshd_server(2, "--metrics-listen", "127.0.0.1:0", "--metrics-port-file", pf)
    lib.wait_ready(srv, 2)
    mport = port_of(pf, srv)
    text = scrape(mport)
    assert "# TYPE meshd_commands_total counter" in text
    assert "# TYPE meshd_command_duration_seconds histogram" in text
    assert value(text, 'meshd_agents{state="healthy"}') == 2
    assert value(text, 'meshd_agents{state="registered"}') == 2
    assert value(text, "meshd_sessions") == 0

    with Session(srv.port, "metrics") as s:
        m = s.mesh(gpu=2).ref
        x = s.tensor(m, (3,))
        for _ in range(3):
            s.op("add", Ref(x.ref), Ref(x.ref))
        s.fails("REF_REUSED", lib.create_mesh(m, gpu=2), "CreateMesh")
        text = scrape(mport)
        assert value(text, "meshd_sessions") == 1
        s.close()
    assert value(text, 'meshd_commands_total{kind="Call",status="ok"}') == 3
    assert value(text, 'meshd_commands_total{kind="Factory",status="ok"}') == 1
    assert value(text, 'meshd_commands_total{kind="CreateMesh",status="ok"}') == 1
    assert value(text, 'meshd_commands_total{kind="CreateMesh",status="REF_REUSED"}') == 1
    assert value(text, 'meshd_command_duration_seconds_count{kind="Call"}') == 3
    assert value(text, 'meshd_command_duration_seconds_bucket{kind="Call",le="+Inf"}') == 3
    assert value(text, 'meshd_command_duration_seconds_sum{kind="Call"}') >= 0
    assert value(scrape(mport), "meshd_sessions") == 0

    try:
        scrape(mport, "/nope")
        raise AssertionError("expected 404")
    except urllib.error.HTTPError as e:
        assert e.code == 404


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
        assert "# TYPE meshd_agent_bytes_allocated gauge" in text
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
            assert value(text, "meshd_agent_bytes_allocated") >= 16, text
            assert value(text, "meshd_collective_bytes_total") >= 16, text
    assert re.search(r"^meshd_agent_bytes_allocated \d", scrape(ports[0]), re.M)
