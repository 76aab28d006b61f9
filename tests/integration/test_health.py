"""grpc.health.v1.Health and gRPC server reflection on meshd and meshd-agent, seen by
grpcio as a third-party client.

docs/operations.md, "Health": "" is SERVING while the process accepts calls;
meshd.v1.TensorService only with at least --min-agents healthy agents;
meshd.agent.v1.Agent while the agent is registered with a server that dialed it
back. Standard
semantics: Check on an unknown service is NOT_FOUND; Watch on one sends
SERVICE_UNKNOWN and stays open; Watch sends the current status at once.

docs/operations.md, "Reflection": grpc.reflection.v1 and v1alpha list exactly the
services of the port and describe them from the descriptors built into the binary,
behind the port's own authentication; --reflection=false turns them off (local
agents follow their server).
"""

import signal
import socket
import time

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

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


def test_agent_not_ready_while_the_server_cannot_dial_it_back(meshd_server, agent, watches):
    # An agent the server cannot reach (a wrong --advertise, a NetworkPolicy that
    # drops the dial-back) has a rank for a moment, but the server never counts it:
    # its readiness must not say SERVING meanwhile (the kubelet would mark the pod
    # Ready, and the PodDisruptionBudget count it, while the server lists it
    # unhealthy). Here the advertised port accepts connections and never answers,
    # so each dial-back waits out the server's 3 s.
    srv = meshd_server(0, min_agents=1)
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    try:
        a = agent(srv.port, "--advertise", f"127.0.0.1:{hole.getsockname()[1]}",
                  wait_registered=False)
        w = watches(a.port, lib.AGENT_SERVICE)
        assert lib.status_name(w.first()) == "NOT_SERVING"
        deadline = time.monotonic() + 8.0
        while time.monotonic() < deadline:
            w.next(max(0.0, deadline - time.monotonic()))
            assert w.end is None, w.end
        assert "SERVING" not in [lib.status_name(s) for s in w.seen], \
            f"readiness SERVING although the server never reached the agent: " \
            f"{[lib.status_name(s) for s in w.seen]}"
        assert "cannot dial agent rank" in open(srv.log, errors="replace").read()
        assert lib.healthy_ranks(lib.list_agents(srv.port)) == []
    finally:
        hole.close()


# ---------------------------------------------------------------- reflection

SERVER_SERVICES = {"meshd.v1.TensorService", "meshd.v1.AgentRegistry", "grpc.health.v1.Health",
                   "grpc.reflection.v1.ServerReflection",
                   "grpc.reflection.v1alpha.ServerReflection"}
NOT_FOUND, INVALID_ARGUMENT = 5, 3


def _pool(fdps):
    """A DescriptorPool of only these serialized FileDescriptorProtos (imports first)."""
    files = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in fdps]
    pool, added = descriptor_pool.DescriptorPool(), set()
    while len(added) < len(files):
        ready = [f for f in files if f.name not in added and set(f.dependency) <= added]
        assert ready, f"imports missing from the answer: {[(f.name, list(f.dependency)) for f in files]}"
        for f in ready:
            pool.Add(f)
            added.add(f.name)
    return pool


def test_reflection_lists_and_describes_like_grpcurl(meshd_server):
    srv = meshd_server(0, min_agents=0)
    with lib.Reflection(srv.port) as r:
        # grpcurl list
        names = r.list()
        assert sorted(names) == sorted(SERVER_SERVICES), names
        # grpcurl describe meshd.v1.TensorService: descriptors from the server alone.
        resp = r.ask(file_containing_symbol="meshd.v1.TensorService")
        assert resp.WhichOneof("message_response") == "file_descriptor_response", resp
        assert resp.original_request.file_containing_symbol == "meshd.v1.TensorService"
        fdps = resp.file_descriptor_response.file_descriptor_proto
        pool = _pool(fdps)
        svc = pool.FindServiceByName("meshd.v1.TensorService")
        sdp = descriptor_pb2.ServiceDescriptorProto()
        svc.CopyToProto(sdp)
        methods = {m.name: m for m in sdp.method}
        assert methods["Submit"].client_streaming and methods["Submit"].server_streaming
        assert not methods["Fetch"].client_streaming and methods["Fetch"].server_streaming
        assert methods["Execute"].input_type == ".meshd.v1.Command"
        assert methods["Execute"].output_type == ".meshd.v1.CommandResult"
        assert not methods["Execute"].client_streaming and not methods["Execute"].server_streaming
        # A message class made from the served descriptors round-trips, and its bytes
        # are meshd's own Command.
        Command = message_factory.MessageFactory(pool).GetPrototype(
            pool.FindMessageTypeByName("meshd.v1.Command"))
        cmd = Command(seq=7)
        cmd.sync.stream = 3
        cmd.batch.add(seq=8).describe.ref = 9
        wire = cmd.SerializeToString()
        assert Command.FromString(wire) == cmd
        real = lib.tensor_pb2().Command.FromString(wire)
        assert (real.seq, real.sync.stream, real.batch[0].describe.ref) == (7, 3, 9)
        assert real.WhichOneof("kind") == "sync"

        # A method, a field and a nested enum's value find their files too; a file
        # comes with its imports, each once.
        for symbol, want in (("meshd.agent.v1.Agent.Execute", "meshd/agent/v1/agent.proto"),
                             ("meshd.v1.Command.seq", "meshd/v1/tensor_service.proto"),
                             ("grpc.health.v1.HealthCheckResponse.SERVING",
                              "grpc/health/v1/health.proto")):
            fdps = r.ask(file_containing_symbol=symbol).file_descriptor_response.file_descriptor_proto
            assert descriptor_pb2.FileDescriptorProto.FromString(fdps[0]).name == want, symbol
        fdps = r.ask(file_by_filename="meshd/agent/v1/agent.proto") \
            .file_descriptor_response.file_descriptor_proto
        got = [descriptor_pb2.FileDescriptorProto.FromString(b).name for b in fdps]
        assert got == ["meshd/agent/v1/agent.proto", "meshd/v1/tensor_service.proto"], got

        # Unknown names: NOT_FOUND naming them, and the stream goes on.
        for req, needle in ((dict(file_containing_symbol="meshd.v1.Nope"), "meshd.v1.Nope"),
                            (dict(file_by_filename="nope.proto"), "nope.proto"),
                            (dict(all_extension_numbers_of_type="meshd.v1.Nope"), "meshd.v1.Nope")):
            err = r.ask(**req).error_response
            assert err.error_code == NOT_FOUND and needle in err.error_message, (req, err)
        ext = r.pb.ExtensionRequest(containing_type="meshd.v1.Command", extension_number=100)
        err = r.ask(file_containing_extension=ext).error_response
        assert err.error_code == NOT_FOUND and "meshd.v1.Command" in err.error_message, err
        nums = r.ask(all_extension_numbers_of_type="meshd.v1.Command").all_extension_numbers_response
        assert nums.base_type_name == "meshd.v1.Command" and list(nums.extension_number) == []
        err = r.ask(r.pb.ServerReflectionRequest(host="x")).error_response
        assert err.error_code == INVALID_ARGUMENT and "list_services" in err.error_message, err
        assert sorted(r.list()) == sorted(SERVER_SERVICES)

    # v1alpha, as older clients ask.
    with lib.Reflection(srv.port, version="v1alpha") as r:
        assert sorted(r.list()) == sorted(SERVER_SERVICES)
        fdps = r.ask(file_containing_symbol="meshd.v1.TensorService.Submit") \
            .file_descriptor_response.file_descriptor_proto
        assert _pool(fdps).FindMethodByName("meshd.v1.TensorService.Submit")

    # Bytes that are no request end the call INVALID_ARGUMENT, naming why.
    for junk, needle in ((b"\xff\xff", "not a valid"),
                         (b"\x22\x03a\x00b", "embedded NUL")):
        with lib.Reflection(srv.port) as r:
            with pytest.raises(grpc.RpcError) as e:
                r.ask(junk)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
            assert needle in e.value.details(), e.value.details()
    assert lib.health_check(srv.port, "") == lib.SERVING()


def test_reflection_off_on_the_server_and_its_local_agents(meshd_server):
    srv = meshd_server(1, "--reflection=false")
    lib.wait_ready(srv, 1)
    agents = lib.list_agents(srv.port)
    for where in (dict(port=srv.port), dict(port=None, address=agents[0].address)):
        with lib.Reflection(**where) as r:
            with pytest.raises(grpc.RpcError) as e:
                r.list()
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED, (where, e.value)


def test_reflection_on_an_agent_takes_its_call_secret(agent):
    with lib.FakeRegistry() as reg:
        a = agent(reg.port)
        reg.wait()
        with lib.Reflection(a.port) as r:
            with pytest.raises(grpc.RpcError) as e:
                r.list()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
        with lib.Reflection(a.port, metadata=reg.metadata()) as r:
            assert sorted(r.list()) == sorted({lib.AGENT_SERVICE, "grpc.health.v1.Health",
                                               "grpc.reflection.v1.ServerReflection",
                                               "grpc.reflection.v1alpha.ServerReflection"})
            fdps = r.ask(file_containing_symbol=lib.AGENT_SERVICE) \
                .file_descriptor_response.file_descriptor_proto
            assert _pool(fdps).FindServiceByName(lib.AGENT_SERVICE).methods_by_name["Execute"]
