"""Checks a tests/gpu/rfc_nccl/run.sh result directory instance by instance.

  check.py OUT CASES...

For each traced case (job rfc-CASE): every operation the driver ran on each rank (its `ops=` line) was
delivered to the OTLP receiver as one rank span, timed by the device hook, with an exec time plausible
for its size; each instance (commHash, collective, seq, replay) has one trace id that no other instance
uses, one root span, and both ranks' spans under that root; no span id is used twice. Prints the daemon's
non-zero loss counters. For `cost`: the median microseconds per all-reduce of each configuration and the
added time against no plugin. Exit status 1 when a traced case misses a goal (delivered < 99%, or any
wrong id, duplicate or implausible exec time; eager and graph6 need 100%). For a2a and pp (torch_p2p.py):
every operation per (rank, function, peer), device-timed, and each transfer's two sides in one trace
(`check_p2p`); they need 100%."""

import collections
import re
import statistics
import sys

VALUE = re.compile(r"(Int|String|Double|Bool)Value\((.*)\)\) \}\)$")


def attrs(span):
    """The fake collector prints each attribute value as Rust Debug text; back to Python values."""
    out = {}
    for k, v in span["attributes"].items():
        m = VALUE.search(v)
        if not m:
            continue
        kind, text = m.groups()
        out[k] = int(text) if kind == "Int" else float(text) if kind == "Double" else text.strip('"')
    return out


def load_spans(path):
    import json

    spans = collections.defaultdict(list)  # job -> spans
    with open(path) as f:
        for line in f:
            if not line.startswith("{"):
                continue
            s = json.loads(line)
            s["a"] = attrs(s)
            spans[s["a"].get("job.id", "")].append(s)
    return spans


def plausible(exec_ns, nbytes):
    """At least 200 ns and no faster than HBM (4.8 TB/s: 4.8e3 bytes per ns); at most 10 ms plus 10 GB/s.
    Far outside either, a number is not this collective's kernel time."""
    return max(200, nbytes / 4.8e3) <= exec_ns <= 10_000_000 + nbytes / 10


def check_case(name, driver_line, spans):
    want = int(re.search(r"ops=(\d+)", driver_line).group(1)) * 2 if driver_line else 0
    ranks = collections.Counter()
    trace_of = {}
    instances_of_trace = collections.defaultdict(set)
    roots = collections.Counter()
    children = collections.defaultdict(set)
    span_ids = collections.Counter()
    implausible, host_timed = [], 0
    for s in spans:
        a = s["a"]
        span_ids[s["span_id"]] += 1
        key = (a["nccl.comm_hash"], a["nccl.collective"], a["nccl.seq"], a["nccl.replay"])
        instances_of_trace[s["trace_id"]].add(key)
        trace_of.setdefault(key, set()).add(s["trace_id"])
        if "nccl.rank" not in a:
            roots[s["trace_id"]] += 1
            continue
        ranks[key + (a["nccl.rank"],)] += 1
        children[s["trace_id"]].add((a["nccl.rank"], s["parent_span_id"]))
        if a.get("nccl.timing_source") != "device_hook":
            host_timed += 1
        elif not plausible(a["nccl.exec_ns"], a["nccl.bytes"]):
            implausible.append((key, a["nccl.exec_ns"], a["nccl.bytes"]))
    delivered = len(ranks)
    twice = sum(1 for n in ranks.values() if n > 1)
    shared_traces = sum(1 for k in instances_of_trace.values() if len(k) > 1)
    split = sum(1 for t in trace_of.values() if len(t) > 1)
    reused_spans = sum(1 for n in span_ids.values() if n > 1)
    bad_roots = sum(1 for t in instances_of_trace if roots[t] != 1)
    root_id = {}
    for s in spans:
        if "nccl.rank" not in s["a"]:
            root_id[s["trace_id"]] = s["span_id"]
    one_rank = sum(1 for t, c in children.items() if {r for r, _ in c} != {0, 1})
    orphans = sum(1 for t, c in children.items() if any(p != root_id.get(t) for _, p in c))
    pct = 100.0 * delivered / want if want else 0.0
    print(f"{name}: {delivered}/{want} rank instances delivered ({pct:.2f}%), {twice} twice, "
          f"{host_timed} not device-timed, {len(implausible)} implausible exec; ids: {shared_traces} traces "
          f"shared by instances, {split} instances split over traces, {reused_spans} span ids reused, "
          f"{bad_roots} traces without exactly one root, {one_rank} traces missing a rank, "
          f"{orphans} traces with a rank span not under its root")
    for k in implausible[:5]:
        print("  implausible", k)
    goal = 100.0 if name in ("eager", "graph6") else 99.0
    return (pct >= goal and not (twice or implausible or shared_traces or split or reused_spans or bad_roots
                                 or orphans))


def check_p2p(name, driver, spans):
    """a2a / pp (torch_p2p.py): each rank's operations per (function, peer) against the rank spans the
    daemon delivered, every one device-timed with a plausible exec time, and each transfer (p2p trace)
    holding exactly its two sides: a Send on one rank and the Recv of its peer."""
    want = collections.Counter()  # (rank, function, peer or None) -> operations
    for line in driver.splitlines():
        m = re.match(r"rank=(\d+) (.*)", line)
        if not m:
            continue
        rank = int(m.group(1))
        # Stop at the versions: "torch=2.11.0+cu130 nccl=(2, 28, 9)" (the tuple holds spaces).
        for kv in m.group(2).split(" torch=")[0].split():
            k, v = kv.split("=")
            func, _, peer = k.partition(":")
            want[(rank, func, int(peer) if peer else None)] += int(v)
    got = collections.Counter()
    host_timed, replayed, implausible = collections.Counter(), collections.Counter(), []
    sides = collections.defaultdict(list)  # p2p trace -> (function, rank, peer)
    for s in spans:
        a = s["a"]
        if "nccl.rank" not in a:
            continue
        peer = a.get("nccl.peer") if a["nccl.collective"] in ("Send", "Recv") else None
        key = (a["nccl.rank"], a["nccl.collective"], peer)
        got[key] += 1
        replayed[key] += int(a.get("nccl.replay", 0)) > 0
        if a.get("nccl.timing_source") != "device_hook":
            host_timed[key] += 1
        elif not plausible(a["nccl.exec_ns"], a["nccl.bytes"]):
            implausible.append((key, a["nccl.exec_ns"], a["nccl.bytes"]))
        if peer is not None:
            sides[s["trace_id"]].append((a["nccl.collective"], a["nccl.rank"], peer))
    ok = True
    for key in sorted(set(want) | set(got), key=str):
        w, g = want[key], got[key]
        print(f"{name}: rank {key[0]} {key[1]}{'' if key[2] is None else f' peer {key[2]}'}: "
              f"{g}/{w} delivered ({replayed[key]} of them graph replays), {host_timed[key]} not device-timed")
        ok &= g == w and host_timed[key] == 0
    whole = sum(1 for v in sides.values()
                if sorted(f for f, _, _ in v) == ["Recv", "Send"]
                and {(r, p) for f, r, p in v if f == "Send"} == {(p, r) for f, r, p in v if f == "Recv"})
    print(f"{name}: {whole}/{len(sides)} transfers with exactly their send and recv side, "
          f"{len(implausible)} implausible exec")
    for k in implausible[:5]:
        print("  implausible", k)
    return ok and whole == len(sides) and not implausible


def cost(path):
    rows = collections.defaultdict(list)  # (cfg, bytes) -> [us]
    for line in open(path):
        m = re.match(r"(\S+) (\d+) \d+ .*us_per_op=([\d.]+)", line)
        if m:
            rows[(m.group(1), int(m.group(2)))].append(float(m.group(3)))
    print(f"{'bytes':>9} {'none us':>9} | {'device ring':>17} | {'host-mapped ring':>17} | {'KernelCh':>17}")
    for nbytes in sorted({b for _, b in rows}):
        base = statistics.median(rows[("none", nbytes)]) if rows[("none", nbytes)] else float("nan")
        line = f"{nbytes:>9} {base:>9.2f} |"
        for cfg in ("device", "host", "kernelch"):
            v = rows[(cfg, nbytes)]
            line += f" {statistics.median(v):>7.2f} {(statistics.median(v) / base - 1) * 100:+7.1f}% |" if v else \
                f" {'-':>17} |"
        print(line)


def check_profile(name, out):
    """torch_profile.py merged with `export --merge`: on each rank every NCCL kernel of the profiler's
    trace paired with a collective slice, and each slice inside its kernel as exported, or at most 1 us
    out (the merge's own measure, `ncclscope_alignment`: the shift that puts the most inside)."""
    import json

    ok = True
    for r in (0, 1):
        try:
            trace = json.load(open(f"{out}/{name}/rank{r}.pt.trace.json"))
            kernels = sum(1 for e in trace["traceEvents"]
                          if e.get("cat") == "kernel"
                          and e.get("name", "").startswith(("ncclDevKernel_", "ncclKernel_")))
            a = json.load(open(f"{out}/{name}/rank{r}.merged.json"))["ncclscope_alignment"]
        except (OSError, KeyError, ValueError) as e:
            print(f"{name} rank {r}: FAIL no merged trace ({e})")
            ok = False
            continue
        off = a.get("measured_offset_ns", 0)
        good = a.get("paired") == kernels and (a.get("inside_before") == kernels or abs(off) <= 1000)
        print(f"{name} rank {r}: {'ok' if good else 'FAIL'} {kernels} NCCL kernels, {a.get('paired')} "
              f"paired, {a.get('inside_before')} inside as exported, measured offset {off} ns "
              f"(applied {a.get('applied_offset_ns')})")
        ok &= good
    return ok


def main():
    out, *cases = sys.argv[1:]
    spans = load_spans(f"{out}/spans.jsonl")
    ok = True
    for c in cases:
        if c == "cost":
            cost(f"{out}/cost.txt")
            continue
        if c == "torchraw" or c.startswith("raw-"):  # recorded without the daemon: nothing to check here
            continue
        line = open(f"{out}/{c}.driver").read().strip()
        if c.startswith("profile"):
            ok &= check_profile(c, out)
            continue
        if c in ("a2a", "pp"):
            ok &= check_p2p(c, line, spans.get(f"rfc-{c}", []))
            continue
        ok &= check_case(c, line, spans.get(f"rfc-{c}", []))
    p2p_series = collections.Counter()  # (job, collective) -> instances in the exec-time histogram
    for line in open(f"{out}/metrics.txt"):
        if line.startswith("ncclscope_lost_total") and not line.rstrip().endswith(" 0"):
            print(" ", line.rstrip())
        m = re.match(r'ncclscope_collective_exec_time_microseconds_count\{(.*)\} (\S+)', line)
        if m and ('collective="Send"' in m.group(1) or 'collective="Recv"' in m.group(1)):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            p2p_series[(labels.get("job_id"), labels.get("collective"))] += int(float(m.group(2)))
    for c in [c for c in cases if c in ("a2a", "pp")]:
        for func in ("Send", "Recv"):
            n = p2p_series[(f"rfc-{c}", func)]
            print(f"{c}: ncclscope_collective_exec_time_microseconds{{collective=\"{func}\"}}: {n} instances")
            ok &= n > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
