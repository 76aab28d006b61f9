"""Server-wide admin listing and limits (docs/operations.md): ListSessions and
ListAgents are paged (page_size, page_token, next_page_token) and meshctl follows the
pages; --max-sessions bounds the open sessions of every principal together."""

import json

import grpc
import pytest

import meshd_testlib as lib
import test_meshctl as tm

_SVC = "/meshd.v1.TensorService/"


def _start(tmp, *flags):
    args = ["--listen", "127.0.0.1:0", "--local-agents", "0", "--min-agents", "0"]
    args += [str(f) for f in flags]
    p = lib.spawn("meshd", lib.MESHD, args, str(tmp))
    lib.wait_health(p.port, "", lib.SERVING(), proc=p.proc, log=p.log)
    return p


class _Raw:
    """CreateSession / CloseSession / ListSessions on one channel, bounded by deadlines."""

    def __init__(self, port):
        self.t = lib.tensor_pb2()
        self.ch = lib.channel(port)

    def _call(self, name, req, reply_cls, md=None):
        fn = self.ch.unary_unary(_SVC + name, request_serializer=lambda m: m.SerializeToString(),
                                 response_deserializer=reply_cls.FromString)
        return fn(req, timeout=10, metadata=md)

    def create(self, name="s"):
        r = self._call("CreateSession", self.t.CreateSessionRequest(client_name=name),
                       self.t.CreateSessionReply)
        return r.session_id, r.token

    def close(self, sid, tok):
        self._call("CloseSession", self.t.CloseSessionRequest(), self.t.CloseSessionReply,
                   md=(("meshd-session", sid), ("meshd-token", tok)))

    def page(self, size=0, token=""):
        return self._call("ListSessions",
                          self.t.ListSessionsRequest(page_size=size, page_token=token),
                          self.t.ListSessionsReply)

    def all_pages(self, size, between=None):
        seen, token, pages = [], "", 0
        while True:
            r = self.page(size, token)
            assert len(r.sessions) <= size
            seen += [s.session_id for s in r.sessions]
            pages += 1
            assert pages < 1000, "next_page_token never ran out"
            if not r.next_page_token:
                return seen, pages
            token = r.next_page_token
            if between:
                between(pages)


@pytest.fixture
def server(tmp_path):
    p = _start(tmp_path, "--max-sessions-per-principal", 0)
    yield p
    lib.stop(p)
    hit = lib.sanitizer_report(p.log)
    assert not hit, hit


def test_list_sessions_pages_show_every_session_once(server):
    raw = _Raw(server.port)
    made = [raw.create(f"p{i}") for i in range(23)]
    ids = [sid for sid, _ in made]
    seen, pages = raw.all_pages(5)
    assert seen == ids  # oldest first, each once
    assert pages == 5
    # a page that ends exactly at the last session says so (no empty extra page)
    seen, pages = raw.all_pages(23)
    assert seen == ids and pages == 1
    # no fields (an old client): the first page of the default size, all 23 here
    r = raw.page()
    assert [s.session_id for s in r.sessions] == ids and r.next_page_token == ""


def test_list_sessions_paging_while_sessions_come_and_go(server):
    raw = _Raw(server.port)
    made = [raw.create(f"p{i}") for i in range(12)]
    added = []
    closed = set()

    def churn(page):
        if page == 1:  # close one already shown, one not yet shown; open a new one
            raw.close(*made[1])
            raw.close(*made[8])
            closed.update({made[1][0], made[8][0]})
            added.append(raw.create("late1"))
        if page == 2:  # close the session the token points at
            raw.close(*made[7])
            closed.add(made[7][0])
            added.append(raw.create("late2"))

    seen, _ = raw.all_pages(4, between=churn)
    assert len(seen) == len(set(seen)), f"a session listed twice: {seen}"
    want = [sid for sid, _ in made if sid not in closed or sid in (made[1][0], made[7][0])]
    # made[1] and made[7] were listed before they closed; made[8] closed before its page
    assert seen == want + [sid for sid, _ in added], seen


@pytest.mark.parametrize("token", ["zzz", "-1", "0", "00012", "99999999999",
                                   "99999999999999999999999"])
def test_a_bad_page_token_is_invalid_argument(server, token):
    raw = _Raw(server.port)
    raw.create()
    with pytest.raises(grpc.RpcError) as e:
        raw.page(2, token)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert "page_token" in e.value.details()
    assert raw.page(2).sessions  # the server goes on


def test_a_token_of_another_run_or_never_given_is_invalid_argument(server):
    """A token carries the server run's epoch: one kept across a restart is refused
    (it would skip or repeat the new run's sessions), as is a seq this run never gave."""
    raw = _Raw(server.port)
    for _ in range(3):
        raw.create()
    tok = raw.page(1).next_page_token
    seq, _, epoch = tok.partition(".")
    assert seq.isdigit() and len(epoch) == 8, tok
    other = "%08x" % (int(epoch, 16) ^ 1)
    for bad in (f"{seq}.{other}", f"{int(seq) + 10**9}.{epoch}", seq, f"{seq}.{epoch}x"):
        with pytest.raises(grpc.RpcError) as e:
            raw.page(1, bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (bad, e.value.details())
        assert "restarted server starts over" in e.value.details()
    assert len(raw.page(1, tok).sessions) == 1


def test_page_size_is_capped(server):
    raw = _Raw(server.port)
    for i in range(3):
        raw.create()
    r = raw.page(2**32 - 1)
    assert len(r.sessions) == 3 and r.next_page_token == ""


def test_meshctl_sessions_follows_the_pages(server):
    raw = _Raw(server.port)
    ids = {raw.create(f"m{i}")[0] for i in range(1005)}  # past the default page of 1000
    r = tm.meshctl(f"127.0.0.1:{server.port}", "--output", "json", "sessions", timeout_ms=10000)
    assert r.returncode == 0, tm._show(r)
    assert r.stdout.count("\n") == 1, tm._show(r)  # one document
    rows = json.loads(r.stdout)["sessions"]
    got = [row.get("session_id") or row.get("id") for row in rows]
    assert len(got) == len(set(got)) == 1005, len(got)
    assert set(got) == ids


def test_max_sessions_bounds_every_principal_together(tmp_path):
    p = _start(tmp_path, "--max-sessions", 3, "--max-sessions-per-principal", 0)
    try:
        raw = _Raw(p.port)
        made = [raw.create() for _ in range(3)]
        with pytest.raises(grpc.RpcError) as e:
            raw.create("one-too-many")
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-sessions (3)" in e.value.details(), e.value.details()
        raw.close(*made[0])  # a slot given back is usable again
        raw.create("after-close")
    finally:
        assert lib.stop(p) == 0


# ------------------------------------------------------------------ ListAgents' pages

def _agents_page(port, size=0, token=""):
    t = lib.tensor_pb2()
    return lib.unary(port, _SVC + "ListAgents",
                     t.ListAgentsRequest(page_size=size, page_token=token), t.ListAgentsReply)


def _all_agent_pages(port, size):
    ranks, token, pages = [], "", 0
    while True:
        r = _agents_page(port, size, token)
        assert len(r.agents) <= size
        ranks += [a.rank for a in r.agents]
        pages += 1
        assert pages < 100, "next_page_token never ran out"
        if not r.next_page_token:
            return ranks, pages
        token = r.next_page_token


def test_list_agents_is_paged_by_rank(meshd_server, agent):
    """ListAgents answered every agent in one reply, past gRPC's 4 MiB at ~8000 agents
    where --max-agents allows 65,536. Paged by rank as ListSessions is by age: agents at
    ranks 4, 0 and 2 (registered in that order) come in rank order, each once."""
    srv = meshd_server(0, "--max-agents", 8, min_agents=0)
    for rank in (4, 0, 2):
        agent(srv.port, rank=rank)
    lib.wait_agents(srv.port, lambda ag: sorted(a.rank for a in ag) == [0, 2, 4], log=srv.log)
    assert _all_agent_pages(srv.port, 1) == ([0, 2, 4], 3)
    assert _all_agent_pages(srv.port, 2) == ([0, 2, 4], 2)
    assert _all_agent_pages(srv.port, 3) == ([0, 2, 4], 1)  # no empty page after the last
    r = _agents_page(srv.port)  # no fields (an older client): every agent, one page
    assert [a.rank for a in r.agents] == [0, 2, 4] and r.next_page_token == ""
    tok = _agents_page(srv.port, 1).next_page_token
    seq, _, epoch = tok.partition(".")
    assert seq == "1" and len(epoch) == 8, tok  # a row's number is its rank + 1
    other = "%08x" % (int(epoch, 16) ^ 1)
    for bad in ("zzz", "0", f"0.{epoch}", f"{seq}.{other}", f"9.{epoch}", f"{seq}.{epoch}x"):
        with pytest.raises(grpc.RpcError) as e:
            _agents_page(srv.port, 1, bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (bad, e.value.details())
        assert "ListAgents: page_token" in e.value.details(), e.value.details()
    # the last rank --max-agents allows is a token the server may give: an empty last page
    r = _agents_page(srv.port, 1, f"8.{epoch}")
    assert list(r.agents) == [] and r.next_page_token == ""
    assert [a.rank for a in _agents_page(srv.port, 5, tok).agents] == [2, 4]


def _paged_agents(agents, per_page):
    """A ListAgents handler answering `agents` per_page a page, by rank."""
    t = lib.tensor_pb2()

    def list_agents(request, context):
        start = int(request.page_token.split(".")[0]) if request.page_token else 0
        page = [a for a in agents if a.rank >= start][:per_page]
        more = page and page[-1].rank < agents[-1].rank
        return t.ListAgentsReply(agents=page,
                                 next_page_token=f"{page[-1].rank + 1}.00000000" if more else "")
    return list_agents


def test_meshctl_version_lists_every_agent_past_what_get_info_holds():
    """GetInfo holds a pool's first 1024 agents and says agents_truncated past them (one
    reply with every agent passed gRPC's 4 MiB at ~8,000 and failed for everyone).
    meshctl version (the C client's meshd_server_info) then takes the agents from
    ListAgents' pages: a fake server whose GetInfo holds 2 of 5 agents, ListAgents 2
    a page, shows all five, in text and in JSON."""
    t = lib.tensor_pb2()
    agents = [t.AgentInfo(rank=r, healthy=True, address=f"127.0.0.1:{9000 + r}", device="cpu",
                          version="9.9.9", commit="abc", build_type="Release") for r in range(5)]

    def get_info(request, context):
        return t.GetInfoReply(version="9.9.9", commit="abc", build_type="Release", uptime_ms=5,
                              agents=agents[:2], agents_truncated=True, agents_total=5,
                              agents_healthy=5)
    server, port = lib.fake_tensor_service(GetInfo=(get_info, t.GetInfoRequest),
                                        ListAgents=(_paged_agents(agents, 2), t.ListAgentsRequest))
    try:
        r = tm.meshctl(f"127.0.0.1:{port}", "--output", "json", "version")
        assert r.returncode == 0, tm._show(r)
        v = json.loads(r.stdout)
        assert [a["rank"] for a in v["agents"]] == [0, 1, 2, 3, 4], tm._show(r)
        assert all(a["version"] == "9.9.9" for a in v["agents"]), tm._show(r)
        r = tm.meshctl(f"127.0.0.1:{port}", "version")
        assert r.returncode == 0, tm._show(r)
        rows = [line for line in r.stdout.splitlines() if line.startswith("rank ")]
        assert [row.split(":")[0] for row in rows] == [f"rank {i}" for i in range(5)], tm._show(r)
    finally:
        server.stop(0)


def test_meshctl_agents_follows_the_pages():
    """meshctl agents (the C client's meshd_agents) asks for every page: a fake server
    that answers two agents a page lists all five; one that answers the same token
    again, or an empty page that says more follow, is an error, not a loop."""
    t = lib.tensor_pb2()
    agents = [t.AgentInfo(rank=r, healthy=True, address=f"127.0.0.1:{9000 + r}", device="cpu")
              for r in range(5)]
    mode = {"v": "pages"}
    pages = _paged_agents(agents, 2)

    def list_agents(request, context):
        if mode["v"] == "repeat":
            return t.ListAgentsReply(agents=agents[:1], next_page_token="1.00000000")
        if mode["v"] == "empty":
            return t.ListAgentsReply(next_page_token="7.00000000")
        return pages(request, context)

    server, port = lib.fake_tensor_service(ListAgents=(list_agents, t.ListAgentsRequest))
    try:
        r = tm.meshctl(f"127.0.0.1:{port}", "--output", "json", "agents")
        assert r.returncode == 0, tm._show(r)
        assert [a["rank"] for a in json.loads(r.stdout)["agents"]] == [0, 1, 2, 3, 4], tm._show(r)
        for m, says in (("repeat", "the same next_page_token again"),
                        ("empty", "an empty page with a next_page_token")):
            mode["v"] = m
            r = tm.meshctl(f"127.0.0.1:{port}", "agents", timeout_ms=5000)
            assert r.returncode != 0 and "pages do not end" in r.stderr and says in r.stderr, \
                tm._show(r)
    finally:
        server.stop(0)
