"""docs/operations.md "Metrics" against what meshd and meshd-agent serve: every family
either endpoint exposes is a row of the table, with its type, its labels and where it is
served, and every row exists there. The table cannot drift from the code."""

import os
import re

import meshd_testlib as lib
from meshd_testlib import Ref, Session, sync
from test_metrics import free_ports, parse, port_of, scrape


def _doc_table():
    """{name: (type, frozenset(labels), where)} from the Metrics section's table."""
    with open(os.path.join(lib.SOURCE_DIR, "docs", "operations.md")) as f:
        text = f.read()
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        names = re.findall(r"`([a-z_:][a-z0-9_:]*)(?:\{([^}]*)\})?`", cells[0])
        assert names, line
        types = [t.strip().rstrip("s") for t in cells[1].split(",")]
        assert all(t in ("counter", "gauge", "histogram") for t in types), line
        where = cells[2]
        assert where in ("server", "agent", "both"), line
        for i, (name, labels) in enumerate(names):
            typ = types[min(i, len(types) - 1)]
            assert name not in rows, f"{name}: two rows"
            rows[name] = (typ, frozenset(l.strip() for l in labels.split(",") if l.strip()),
                          where)
    assert rows
    return rows


def _served(fams):
    """{name: (type, labels or None when it has no sample yet)}."""
    out = {}
    for name, f in fams.items():
        labels = None
        for _, ls, _ in f["samples"]:
            keys = frozenset(k for k in ls if k != "le")
            assert labels is None or labels == keys, f"{name}: label sets {labels} and {keys}"
            labels = keys
        out[name] = (f["type"], labels)
    return out


def _compare(doc, served, where):
    want = {n: v for n, v in doc.items() if v[2] in (where, "both")}
    missing = sorted(set(want) - set(served))
    undocumented = sorted(set(served) - set(want))
    assert not missing, f"documented for the {where} and not served there: {missing}"
    assert not undocumented, f"served by the {where} and not in operations.md: {undocumented}"
    for name, (typ, labels) in served.items():
        dtyp, dlabels, _ = want[name]
        assert typ == dtyp, f"{name}: served as a {typ}, documented as a {dtyp}"
        if labels is not None:
            assert labels == dlabels, f"{name}: labels {sorted(labels)}, documented {sorted(dlabels)}"


def test_every_metric_is_documented_and_every_documented_metric_exists(meshd_server, tmp_path):
    doc = _doc_table()
    pf = tmp_path / "metrics.port"
    base = free_ports(2)
    srv = meshd_server(2, "--metrics-listen", "127.0.0.1:0", "--metrics-port-file", pf,
                       "--local-agent-metrics-port-base", base)
    lib.wait_ready(srv, 2)
    mport = port_of(pf, srv)
    # Some work, so that labelled families have samples to show their labels.
    with Session(srv.port, "docs-metrics") as s:
        m = s.mesh(gpu=2).ref
        x = s.tensor(m, (3,))
        s.op("add", Ref(x.ref), Ref(x.ref))
        s.run(sync())
        _compare(doc, _served(parse(scrape(mport))), "server")
        for rank in range(2):
            _compare(doc, _served(parse(scrape(base + rank))), "agent")
