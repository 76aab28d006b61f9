"""grpc.health.v1.Health on meshd and meshd-agent, seen by grpcio as a third-party client.

docs/operations.md, "Health": "" is SERVING while the process accepts calls;
meshd.v1.TensorService only with at least --min-agents healthy agents;
meshd.agent.v1.Agent while the agent is registered with a server. Standard
semantics: Check on an unknown service is NOT_FOUND; Watch on one sends
SERVICE_UNKNOWN and stays open; Watch sends the current status at once.
"""

import signal

import grpc
import pytest

import meshd_testlib as lib


def test_check_default_service_serving(meshd_server):
    port, proc, log = meshd_server()
    assert lib.health_check(port, "") == lib.SERVING()


def test_check_unknown_service_not_found(meshd_server):
    port, _, _ = meshd_server()
    with pytest.raises(grpc.RpcError) as e:
        lib.health_check(port, "no.such.Service")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value.details()


def test_watch_unknown_service_stays_open(meshd_server, watches):
    port, _, _ = meshd_server()
    w = watches(port, "no.such.Service")
    assert lib.status_name(w.first()) == "SERVICE_UNKNOWN"
    ev = w.next(1.0)
    assert ev is None, f"Watch on an unknown service did not stay open: {ev}"
    # The server still answers other calls while the stream is open.
    assert lib.health_check(port, "") == lib.SERVING()


def test_watch_default_service_serving_at_once(meshd_server, watches):
    port, _, _ = meshd_server()
    w = watches(port, "")
    assert lib.status_name(w.first()) == "SERVING"
    ev = w.next(0.5)
    assert ev is None, f"Watch \"\" sent more than the current status, or ended: {ev}"


def test_tensor_service_follows_healthy_agents(meshd_server, agent, watches):
    srv = meshd_server(0, min_agents=2)
    assert lib.status_name(lib.health_check(srv.port, lib.TENSOR_SERVICE)) == "NOT_SERVING"
    w = watches(srv.port, lib.TENSOR_SERVICE)
    assert lib.status_name(w.first()) == "NOT_SERVING"

    a0 = agent(srv.port, rank=0)
    # One agent is not enough for --min-agents 2.
    lib.wait_agents(srv.port, lambda ag: lib.healthy_ranks(ag) == [0], what="rank 0 healthy",
                    log=srv.log)
    assert lib.status_name(lib.health_check(srv.port, lib.TENSOR_SERVICE)) == "NOT_SERVING"
    a1 = agent(srv.port, rank=1)
    w.wait_for(lib.SERVING(), lib.REGISTER_TIMEOUT)
    assert lib.health_check(srv.port, lib.TENSOR_SERVICE) == lib.SERVING()

    a1.signal(signal.SIGKILL)
    a1.proc.wait(10)
    # A killed process closes its socket; keepalive catches a silent peer in ~2 s.
    w.wait_for(lib.NOT_SERVING(), 10.0)
    assert lib.status_name(lib.health_check(srv.port, lib.TENSOR_SERVICE)) == "NOT_SERVING"
    assert lib.health_check(srv.port, "") == lib.SERVING(), "the process itself still serves"
    assert a0.proc.poll() is None


def test_tensor_service_min_agents_defaults_to_one(meshd_server, agent, watches):
    # --min-agents defaults to --local-agents, or 1.
    srv = meshd_server()
    assert lib.status_name(lib.health_check(srv.port, lib.TENSOR_SERVICE)) == "NOT_SERVING"
    w = watches(srv.port, lib.TENSOR_SERVICE)
    assert lib.status_name(w.first()) == "NOT_SERVING"
    agent(srv.port)
    w.wait_for(lib.SERVING(), lib.REGISTER_TIMEOUT)


def test_agent_health_via_its_port_file(meshd_server, agent):
    srv = meshd_server()
    a = agent(srv.port, wait_registered=False)
    assert a.port and a.port != srv.port
    lib.wait_health(a.port, "", lib.SERVING(), timeout=10.0, proc=a.proc, log=a.log)
    lib.wait_health(a.port, lib.AGENT_SERVICE, lib.SERVING(), timeout=lib.REGISTER_TIMEOUT,
                    proc=a.proc, log=a.log)
    with pytest.raises(grpc.RpcError) as e:
        lib.health_check(a.port, "no.such.Service")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_agent_service_not_serving_without_server(agent, watches):
    # An agent whose server is not there accepts calls ("" SERVING) but is not
    # registered (meshd.agent.v1.Agent NOT_SERVING).
    a = agent(lib.free_port(), wait_registered=False)
    lib.wait_health(a.port, "", lib.SERVING(), timeout=10.0, proc=a.proc, log=a.log)
    assert lib.status_name(lib.health_check(a.port, lib.AGENT_SERVICE)) == "NOT_SERVING"
    w = watches(a.port, lib.AGENT_SERVICE)
    assert lib.status_name(w.first()) == "NOT_SERVING"
    assert a.proc.poll() is None, "an agent keeps retrying when its server is absent"


def test_agent_service_follows_registration(meshd_server, agent, watches):
    srv = meshd_server()
    a = agent(srv.port)
    w = watches(a.port, lib.AGENT_SERVICE)
    assert lib.status_name(w.first()) == "SERVING"
    assert lib.stop(srv) == 0
    w.wait_for(lib.NOT_SERVING(), 10.0)
    assert a.proc.poll() is None, "the agent outlives its server and retries"
    assert lib.health_check(a.port, "") == lib.SERVING()
