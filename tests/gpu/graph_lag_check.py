"""Compares a graph-lag run's delivered instances (ncclscope export --format otlp-json, from the spool)
with what the fake ranks produced (their JSON reports): every instance delivered at most once, with the
exec time its rank produced; prints produced / delivered / exact / wrong and the daemon's loss counters.
Exit status 1 on any wrong or duplicated instance. Run by graph_lag_run.sh."""

import json
import sys


def produced(report_path):
    """(pid, collective, seq, replay) -> exec ns of every eager or replayed operation with device work
    (NCCL numbers collectives per type: AllGather 0 is not AllReduce 0)."""
    report = json.load(open(report_path))
    ops = report["comms"][0]["ops"]
    capture_seq = next(o["seq"] for o in ops if o["captured"])
    index = {}
    out = {}
    for op in ops:
        if op["captured"] or not op["hook_items"]:
            continue
        if op["replay"] > 0:
            index[op["replay"]] = index.get(op["replay"], 0) + 1
            seq = capture_seq + index[op["replay"]] - 1
        else:
            seq = op["seq"]
        out[(report["pid"], op["func"], seq, op["replay"])] = max(i["gpu_stop"] - i["gpu_start"] for i in op["hook_items"])
    return out


def attrs(span):
    a = {}
    for kv in span.get("attributes", []):
        v = kv["value"]
        a[kv["key"]] = next(iter(v.values()))
    return a


def delivered(export_path):
    """(pid, collective, seq, replay) -> [(exec ns, timing source)] of every rank span in the export."""
    out = {}
    for line in open(export_path):
        req = json.loads(line)
        for rs in req.get("resourceSpans", []):
            for ss in rs.get("scopeSpans", []):
                for span in ss.get("spans", []):
                    a = attrs(span)
                    if "nccl.rank" not in a or "process.pid" not in a:
                        continue
                    key = (int(a["process.pid"]), a["nccl.collective"], int(a["nccl.seq"]),
                           int(a.get("nccl.replay", 0)))
                    out.setdefault(key, []).append((int(a["nccl.exec_ns"]), a.get("nccl.timing_source")))
    return out


def main():
    *reports, export_path, metrics_path = sys.argv[1:]
    want = {}
    for r in reports:
        want.update(produced(r))
    got = delivered(export_path)
    twice = [k for k, v in got.items() if len(v) > 1]
    unknown = [k for k in got if k not in want]
    timed = {k: v[0][0] for k, v in got.items() if k in want and v[0][1] == "device_hook"}
    exact = [k for k, e in timed.items() if e == want[k]]
    wrong = [k for k, e in timed.items() if e != want[k]]
    host = [k for k, v in got.items() if k in want and v[0][1] != "device_hook"]
    print(f"produced {len(want)} instances, delivered {len(got)}: {len(exact)} with the produced exec time, "
          f"{len(wrong)} with another, {len(host)} without device times (host-timed, counted incomplete), "
          f"{len(unknown)} never produced, {len(twice)} twice; not delivered {len(want) - len(got) + len(unknown)}")
    for k in (wrong + unknown)[:10]:
        print("  mismatch", k, "delivered", got[k], "produced", want.get(k))
    for line in open(metrics_path):
        if line.startswith("ncclscope_lost_total") and not line.rstrip().endswith(" 0"):
            print(" ", line.rstrip())
        if line.startswith("ncclscope_collectives_total "):
            print(" ", line.rstrip())
    return 1 if wrong or unknown or twice else 0


if __name__ == "__main__":
    sys.exit(main())
