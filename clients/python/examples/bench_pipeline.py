#!/usr/bin/env python3
"""Times N tiny adds sent one by one (unary Execute) and pipelined (one Submit stream),
each as a ratio to raw grpcio doing the same in the same run, and prints the speed-up.

    PYTHONPATH=clients/python /usr/bin/python3 \\
        clients/python/examples/bench_pipeline.py --server 127.0.0.1:50051 [--n 2000]

Baselines (the same server work, none of the client's): the same N adds as Command
messages built and serialized before the clock starts, sent by grpcio alone:
"raw unary" one Execute call each, "raw stream" on one Submit stream (every message
queued at once, the answers read to the end). The client's figures are rounds of
unary and pipelined adds; the best of --rounds is kept for each, and each client
round runs right after a round of its baseline. One JSON line goes to stdout too.
"""

import argparse
import json
import sys
import time

import numpy as np

import meshd


def run(n, pipelined, session):
    x = meshd.zeros((4,))
    session.sync()
    t0 = time.perf_counter()
    if pipelined:
        with session.pipeline():
            for _ in range(n):
                x = x + 1
    else:
        for _ in range(n):
            x = x + 1
    session.sync()
    dt = time.perf_counter() - t0
    got = meshd.fetch_shard(x, gpu=0).result()
    if not np.array_equal(got, np.full(4, n, np.float32)):
        raise SystemExit(f"wrong result {got}")
    return dt


def raw_commands(session, n):
    """n adds x + 1 (x a fresh zeros), serialized, with refs and seqs the session
    gives up to them, then a Sync."""
    x = meshd.zeros((4,))
    session.sync()
    pb = session._pb
    stream = session.default_stream.ref
    with session._lock:
        out, prev = [], x.ref
        for _ in range(n):
            session._ref += 1
            session._seq += 1
            ref = session._ref
            cmd = pb.Command(seq=session._seq, call=pb.Call(
                op="add", args=[pb.Arg(ref=prev), pb.Arg(f=1.0)], results=[ref], stream=stream))
            out.append(cmd.SerializeToString())
            prev = ref
        session._seq += 1
        sync = pb.Command(seq=session._seq, sync=pb.Sync()).SerializeToString()
    return x, out, sync


def raw_unary(session, n):
    x, cmds, sync = raw_commands(session, n)
    pb = session._pb
    fn = session._ch.unary_unary("/meshd.v1.TensorService/Execute",
                                 request_serializer=lambda b: b,
                                 response_deserializer=pb.CommandResult.FromString)
    t0 = time.perf_counter()
    for c in cmds:
        fn(c, metadata=session._md, timeout=60)
    fn(sync, metadata=session._md, timeout=60)
    return time.perf_counter() - t0


def raw_stream(session, n):
    x, cmds, sync = raw_commands(session, n)
    pb = session._pb
    fn = session._ch.stream_stream("/meshd.v1.TensorService/Submit",
                                   request_serializer=lambda b: b,
                                   response_deserializer=pb.SubmitReply.FromString)
    t0 = time.perf_counter()
    for _ in fn(iter(cmds + [sync]), metadata=session._md, timeout=120):
        pass
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", required=True)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    best = {"unary": 0.0, "raw_unary": 0.0, "pipelined": 0.0, "raw_stream": 0.0}
    with meshd.connect(args.server) as session:
        mesh = session.mesh(gpu=args.agents)
        with mesh.activate():
            run(50, False, session), run(50, True, session)  # warm up
            for _ in range(args.rounds):
                for name, fn in (("raw_unary", lambda: raw_unary(session, args.n)),
                                 ("unary", lambda: run(args.n, False, session)),
                                 ("raw_stream", lambda: raw_stream(session, args.n)),
                                 ("pipelined", lambda: run(args.n, True, session))):
                    best[name] = max(best[name], args.n / fn())
    unary_ratio = best["unary"] / best["raw_unary"]
    piped_ratio = best["pipelined"] / best["raw_stream"]
    print(f"{args.n} adds on {args.agents} agents, best of {args.rounds}:\n"
          f"  unary     {best['unary']:8.0f}/s  raw grpcio unary  {best['raw_unary']:8.0f}/s  "
          f"ratio {unary_ratio:.2f}\n"
          f"  pipelined {best['pipelined']:8.0f}/s  raw grpcio stream {best['raw_stream']:8.0f}/s  "
          f"ratio {piped_ratio:.2f}\n"
          f"  speed-up of the pipeline over unary {best['pipelined'] / best['unary']:.2f}x",
          file=sys.stderr)
    print(json.dumps({"bench": "pipeline", "agents": args.agents, "n": args.n,
                      **{f"{k}_per_s": round(v) for k, v in best.items()},
                      "unary_ratio": round(unary_ratio, 3),
                      "pipelined_ratio": round(piped_ratio, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
