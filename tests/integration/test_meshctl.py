"""meshctl against a real meshd (docs/operations.md, "meshctl").

health exit codes as grpc_health_probe: 0 SERVING, 2 connection failed,
3 RPC failed (NOT_FOUND for an unknown service), 4 not serving.
"""

import re

import meshd_testlib as lib


def meshctl(server, *args, env=None, timeout_ms=3000):
    pre = ["--server", server] if server else []
    return lib.run(lib.MESHCTL, pre + ["--timeout-ms", str(timeout_ms)] + list(args), env=env,
                   timeout=30)


def _show(r):
    return f"rc={r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"


def test_health_serving_exit_0(meshd_server):
    srv = meshd_server()
    r = meshctl(srv.address, "health")
    assert r.returncode == 0, _show(r)
    assert "SERVING" in r.stdout, _show(r)


def test_health_default_service_is_process(meshd_server):
    srv = meshd_server()
    r = meshctl(srv.address, "health", "")
    assert r.returncode == 0, _show(r)


def test_health_connection_failed_exit_2():
    r = meshctl(f"127.0.0.1:{lib.free_port()}", "health", timeout_ms=2000)
    assert r.returncode == 2, _show(r)


def test_health_unknown_service_exit_3(meshd_server):
    srv = meshd_server()
    r = meshctl(srv.address, "health", "no.such.Service")
    assert r.returncode == 3, _show(r)


def test_health_not_serving_exit_4(meshd_server):
    srv = meshd_server(0, min_agents=3)
    r = meshctl(srv.address, "health", lib.TENSOR_SERVICE)
    assert r.returncode == 4, _show(r)
    assert "NOT_SERVING" in r.stdout, _show(r)


def test_health_tensor_service_serving_with_agents(meshd_server):
    srv = meshd_server(2)
    lib.wait_health(srv.port, lib.TENSOR_SERVICE, lib.SERVING(), timeout=lib.REGISTER_TIMEOUT,
                    proc=srv.proc, log=srv.log)
    r = meshctl(srv.address, "health", lib.TENSOR_SERVICE)
    assert r.returncode == 0, _show(r)


def test_server_from_env(meshd_server):
    srv = meshd_server()
    r = meshctl(None, "health", env={"MESHD_SERVER": srv.address})
    assert r.returncode == 0, _show(r)


def test_agent_health_with_meshctl(meshd_server, agent):
    srv = meshd_server()
    a = agent(srv.port)
    r = meshctl(a.address, "health", lib.AGENT_SERVICE)
    assert r.returncode == 0, _show(r)


def test_agents_lists_two_ranks(meshd_server):
    srv = meshd_server(2)
    lib.wait_agents(srv.port, lambda ag: lib.healthy_ranks(ag) == [0, 1],
                    what="ranks 0 and 1 healthy", log=srv.log)
    r = meshctl(srv.address, "agents")
    assert r.returncode == 0, _show(r)
    rows = [line.split() for line in r.stdout.splitlines()
            if re.match(r"^\s*\d+\s", line)]
    assert len(rows) == 2, _show(r)
    assert sorted(int(row[0]) for row in rows) == [0, 1], _show(r)
    for row in rows:
        assert any(col.startswith("127.0.0.1:") for col in row), _show(r)
        assert "cpu" in row, _show(r)

