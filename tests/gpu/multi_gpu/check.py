"""Checks one plugin run against what the daemon exported, and summarises the overhead runs.

  check.py overhead RESULTS_DIR                 -> table: none / plugin / plugin-no-daemon, medians
  check.py verify PERFETTO SPANS BENCH_JSONL RANKS   -> exit 1 on any failed check
"""

import collections
import json
import statistics
import sys


def load_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip().startswith("{")]


def overhead(results_dir):
    import glob
    import os

    runs = collections.defaultdict(lambda: collections.defaultdict(list))  # cfg -> bytes -> [row]
    for path in glob.glob(os.path.join(results_dir, "bench.*.jsonl")):
        cfg = os.path.basename(path).split(".")[1]
        for row in load_jsonl(path):
            runs[cfg][row["bytes"]].append(row)
    base = runs.get("none", {})
    print(f"{'bytes':>12} {'none us':>10} {'none GB/s':>10} | {'plugin':>16} | {'plugin, daemon stopped':>24}")
    worst = {"lat8": 0.0, "bw1m": 0.0}
    for nbytes in sorted(base):
        med = lambda cfg, k: statistics.median(r[k] for r in runs[cfg][nbytes])
        line = f"{nbytes:>12} {med('none', 'us'):>10.2f} {med('none', 'busbw_gbs'):>10.2f} |"
        for cfg in ("plugin", "nodaemon"):
            if nbytes not in runs.get(cfg, {}):
                line += f" {'-':>16} |"
                continue
            lat = (med(cfg, "us") / med("none", "us") - 1) * 100
            bw = (1 - med(cfg, "busbw_gbs") / med("none", "busbw_gbs")) * 100 if med("none", "busbw_gbs") else 0
            line += f" {med(cfg, 'us'):>8.2f} us {lat:+5.1f}% (bw -{bw:.2f}%) |"
            if nbytes == 8:
                worst["lat8"] = max(worst["lat8"], lat)
            if nbytes >= (1 << 20):
                worst["bw1m"] = max(worst["bw1m"], bw)
        print(line)
    print(f"worst latency overhead at 8 B: {worst['lat8']:+.2f}% (goal <= 2%); "
          f"worst busBW loss at >= 1 MiB: {worst['bw1m']:.2f}% (goal <= 0.5%)")


def verify(perfetto_path, spans_path, bench_path, ranks):
    ok = True

    def fail(msg):
        nonlocal ok
        ok = False
        print("FAIL:", msg)

    trace = json.load(open(perfetto_path))
    colls, channels = [], collections.Counter()
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        if e["cat"] == "collective":
            colls.append(e)
        elif e["cat"] == "channel":
            channels[(e["pid"], e["args"]["comm_hash"], e["args"]["seq"])] += 1
    allreduce = [c for c in colls if c["args"]["func"] == "AllReduce"]
    print(f"collectives exported: {len(colls)} ({len(allreduce)} AllReduce)")
    if not allreduce:
        fail("no AllReduce reached the daemon")
    missing = [c for c in allreduce if c["args"]["timing_source"] == "host"
               or channels[(c["pid"], c["args"]["comm_hash"], c["args"]["seq"])] != c["args"]["n_channels"]]
    print(f"AllReduce instances with a KernelCh timing for every channel: {len(allreduce) - len(missing)}/{len(allreduce)}")
    if missing:
        fail(f"{len(missing)} instances lack channel timings, e.g. {missing[0]['args']}")

    spans = [s for s in load_jsonl(spans_path) if "nccl.seq" in s["attributes"]]
    by_trace = collections.defaultdict(set)
    for s in spans:
        by_trace[s["trace_id"]].add(s["attributes"]["nccl.rank"])
    full = sum(1 for r in by_trace.values() if len(r) == ranks)
    print(f"traces: {len(by_trace)}, with spans of all {ranks} ranks: {full}")
    if not by_trace or full != len(by_trace):
        fail("not every trace holds the spans of every rank")

    # busBW: the daemon's (from kernel time) against the benchmark's (CUDA events over graph replays), at the
    # sizes where the kernel dominates (>= 64 MiB).
    bench = {r["bytes"]: r for r in load_jsonl(bench_path)}
    for nbytes, row in sorted(bench.items()):
        if nbytes < (64 << 20):
            continue
        mine = [c["args"]["busbw_gbs"] for c in allreduce if c["args"]["bytes"] == nbytes]
        if not mine:
            fail(f"no daemon instance of {nbytes} bytes")
            continue
        d = statistics.median(mine)
        diff = (d / row["busbw_gbs"] - 1) * 100
        print(f"busBW at {nbytes} B: daemon {d:.1f} GB/s, benchmark {row['busbw_gbs']:.1f} GB/s ({diff:+.1f}%)")
        if abs(diff) > 5:
            fail(f"busBW differs by {diff:+.1f}% at {nbytes} B (goal within 5%)")
    print("PASS" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1] == "overhead":
        overhead(sys.argv[2])
    else:
        sys.exit(verify(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])))
