#!/usr/bin/python3
"""plot_data: bench_data's JSON lines (bench_data.py and the C bench_data) as a
chart: MB/s by size and path, one panel per direction and agent count, with the
raw gRPC baseline of the same run drawn as a line; bench_load.py's lines, when
given, as one more panel (meshd.load by agent count, curl as the line). Run by
hand, e.g.

    /usr/bin/python3 tests/bench/bench_data.py > data.jsonl
    build/bin/bench_data >> data.jsonl
    /usr/bin/python3 tests/bench/bench_load.py >> data.jsonl
    /usr/bin/python3 tests/bench/plot_data.py data.jsonl -o docs/bench_data.png

Needs Debian's python3-matplotlib."""

import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PATHS = ("wire", "client", "direct", "c", "c_direct")
LABELS = {"wire": "grpcio + meshd protos", "client": "Python client (proxy)",
          "direct": "Python client (direct)", "c": "C rpc layer (proxy)",
          "c_direct": "C rpc layer (direct)"}


def load(files):
    rows = []
    for name in files:
        with (sys.stdin if name == "-" else open(name)) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    row = json.loads(line)
                    if row.get("bench") in ("data", "load") and row.get("mb_s") is not None:
                        rows.append(row)
    return rows


def plot_load(ax, rows):
    """meshd.load MB/s per size, a bar per agent count; curl of the same file as the line."""
    sizes = sorted({int(r["mib"]) for r in rows})
    agents = sorted({int(r["agents"]) for r in rows if r["path"] == "load"})
    width = 0.8 / max(len(agents), 1)
    for k, n in enumerate(agents):
        ys = [max([r["mb_s"] for r in rows if r["path"] == "load" and int(r["agents"]) == n
                   and int(r["mib"]) == m] or [0]) for m in sizes]
        xs = [x + (k - (len(agents) - 1) / 2) * width for x in range(len(sizes))]
        ax.bar(xs, ys, width, label=f"meshd.load, {n} agent{'s' if n > 1 else ''}"
               f"{' (sharded)' if n > 1 else ''}")
    curl = [max([r["mb_s"] for r in rows if r["path"] == "curl" and int(r["mib"]) == m]
                or [float("nan")]) for m in sizes]
    ax.plot(range(len(sizes)), curl, "k--o", label="curl -o /dev/null")
    ax.set_xticks(range(len(sizes)), [f"{m} MiB" for m in sizes])
    ax.set_ylabel("MB/s")
    ax.set_title("URL load (agents fetch over HTTP) vs curl, same run")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="JSON lines files ('-': stdin)")
    ap.add_argument("-o", "--output", default="bench_data.png")
    a = ap.parse_args()
    both = load(a.files)
    rows = [r for r in both if r["bench"] == "data"]
    loads = [r for r in both if r["bench"] == "load"]
    if not rows:
        sys.exit("plot_data: no bench_data lines")
    agents = sorted({int(r["agents"]) for r in rows if "agents" in r})
    sizes = sorted({int(r["mib"]) for r in rows})
    paths = [p for p in PATHS if any(r["path"] == p for r in rows)]
    nrows = len(agents) + (1 if loads else 0)
    fig, axes = plt.subplots(nrows, 2, figsize=(11, 3.6 * nrows), squeeze=False)
    if loads:
        plot_load(axes[-1][0], loads)
        axes[-1][1].axis("off")
    width = 0.8 / max(len(paths), 1)
    for i, n in enumerate(agents):
        for j, direction in enumerate(("upload", "fetch")):
            ax = axes[i][j]
            for k, path in enumerate(paths):
                ys = []
                for m in sizes:
                    got = [r["mb_s"] for r in rows if r["path"] == path and int(r["mib"]) == m
                           and r["direction"] == direction and int(r.get("agents", 0)) == n]
                    ys.append(max(got) if got else 0)
                xs = [x + (k - (len(paths) - 1) / 2) * width for x in range(len(sizes))]
                ax.bar(xs, ys, width, label=LABELS.get(path, path))
            raw = []
            for m in sizes:
                got = [r["mb_s"] for r in rows if r["path"] == "raw" and int(r["mib"]) == m
                       and r["direction"] == direction]
                raw.append(max(got) if got else float("nan"))
            ax.plot(range(len(sizes)), raw, "k--o", label="raw gRPC streaming")
            ax.set_xticks(range(len(sizes)), [f"{m} MiB" for m in sizes])
            ax.set_ylabel("MB/s")
            ax.set_title(f"{direction}, {n} agent{'s' if n > 1 else ''}"
                         f"{' (sharded)' if n > 1 else ''}")
            ax.grid(axis="y", alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    fig.suptitle("meshd transfers (through the server and direct) vs raw gRPC streaming (the faster "
                 "of the C and grpcio baselines, same run)")
    fig.tight_layout()
    fig.savefig(a.output, dpi=110)
    print(f"plot_data: wrote {a.output}")


if __name__ == "__main__":
    main()
