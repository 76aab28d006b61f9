#!/usr/bin/python3
"""plot_commands: bench_commands' JSON lines as a chart, so that its figures can be
seen at a glance: pipelined commands/s by agent count (and --batch), with the raw
bidi stream of the same run drawn as a line; and unary latency, meshd's Execute
p50/p99 beside the echo server's unary p50/p99 of the same run. Run by hand, e.g.

    build/bin/bench_commands --agents 1,4 > cmds.jsonl
    build/bin/bench_commands --agents 1,4 --batch 256 --skip-baseline >> cmds.jsonl
    /usr/bin/python3 tests/bench/plot_commands.py cmds.jsonl -o docs/bench_commands.png

Needs Debian's python3-matplotlib."""

import argparse
import json
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(files):
    rows = []
    for name in files:
        with (sys.stdin if name == "-" else open(name)) as f:
            rows += [json.loads(line) for line in f if line.strip().startswith("{")]
    return rows


def finite(v):
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def plot_throughput(ax, cmds, rpc):
    agents = sorted({int(r["agents"]) for r in cmds})
    batches = sorted({int(r.get("batch", 1)) for r in cmds})
    width = 0.8 / max(len(batches), 1)
    for k, b in enumerate(batches):
        ys = [max([r["commands_per_s"] for r in cmds if int(r["agents"]) == n
                   and int(r.get("batch", 1)) == b] or [0]) for n in agents]
        xs = [x + (k - (len(batches) - 1) / 2) * width for x in range(len(agents))]
        ax.bar(xs, ys, width, label=f"meshd, {b} command{'s' if b > 1 else ''} per message")
    bidi = [r["bidi_msgs_per_s"] for r in rpc if finite(r.get("bidi_msgs_per_s"))]
    if bidi:
        ax.axhline(max(bidi), color="k", linestyle="--", label="raw gRPC bidi stream, msgs/s")
    ax.set_xticks(range(len(agents)), [f"{n} agent{'s' if n > 1 else ''}" for n in agents])
    ax.set_ylabel("commands/s")
    ax.set_title("pipelined tiny commands (Submit stream)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)


def plot_latency(ax, cmds, rpc):
    bars = []
    # The echo measured in rounds alternating with Execute's (bench_commands), else the
    # rpc baseline's, measured apart at the start of the run.
    for r in cmds:
        if finite(r.get("baseline_unary_p50_us")):
            bars.append(("raw gRPC\necho", r["baseline_unary_p50_us"],
                         r.get("baseline_unary_p99_us")))
            break
    for r in rpc if not bars else []:
        if finite(r.get("unary_1_p50_us")):
            bars.append(("raw gRPC\necho", r["unary_1_p50_us"], r.get("unary_1_p99_us")))
            break
    seen = set()
    for r in cmds:  # one bar per agent count: the first run's
        n = int(r["agents"])
        if finite(r.get("unary_execute_p50_us")) and n not in seen:
            seen.add(n)
            bars.append((f"meshd Execute,\n{n} agent{'s' if n > 1 else ''}",
                         r["unary_execute_p50_us"], r.get("unary_execute_p99_us")))
    xs = range(len(bars))
    ax.bar([x - 0.2 for x in xs], [b[1] for b in bars], 0.4, label="p50")
    ax.bar([x + 0.2 for x in xs], [b[2] if finite(b[2]) else 0 for b in bars], 0.4, label="p99")
    ax.set_xticks(list(xs), [b[0] for b in bars], fontsize=8)
    ax.set_ylabel("µs per call")
    ax.set_title("unary latency, one call at a time")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="JSON lines files ('-': stdin)")
    ap.add_argument("-o", "--output", default="bench_commands.png")
    a = ap.parse_args()
    rows = load(a.files)
    cmds = [r for r in rows if r.get("bench") == "commands" and finite(r.get("commands_per_s"))]
    rpc = [r for r in rows if r.get("bench") == "rpc"]
    if not cmds:
        sys.exit("plot_commands: no bench_commands lines")
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    plot_throughput(axes[0], cmds, rpc)
    plot_latency(axes[1], cmds, rpc)
    fig.suptitle("meshd's front-end vs raw gRPC (same run)")
    fig.tight_layout()
    fig.savefig(a.output, dpi=110)
    print(f"plot_commands: wrote {a.output}")


if __name__ == "__main__":
    main()
