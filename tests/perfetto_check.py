"""Reads a trace `ncclscope export` wrote with Perfetto's own schema (the `perfetto` package's
perfetto_trace_pb2, generated from Perfetto's protos) and prints what the trace says, as JSON, for
tools_daemon.rs to compare with the spool: a field number or type ncclscope got wrong reads as
something else, or not at all, here."""
import json
import sys

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

trace = pb.Trace()
trace.ParseFromString(open(sys.argv[1], "rb").read())
names, attrs, tracks, pids = {}, {}, {}, {}
clock = {}
slices, primary = [], []
for p in trace.packet:
    seq = p.trusted_packet_sequence_id
    if p.HasField("clock_snapshot"):
        if p.clock_snapshot.HasField("primary_trace_clock"):
            primary.append(p.clock_snapshot.primary_trace_clock)
        for c in p.clock_snapshot.clocks:
            if c.is_incremental:
                clock[seq] = c.timestamp
    for n in p.interned_data.event_names:
        names[(seq, n.iid)] = n.name
    for n in p.interned_data.debug_annotation_names:
        attrs[(seq, n.iid)] = n.name
    if p.HasField("track_descriptor"):
        d = p.track_descriptor
        if d.HasField("process"):
            pids[d.uuid] = int(d.process.process_name.split(" pid ")[1].split(",")[0])
        else:
            tracks[d.uuid] = (d.parent_uuid, d.name)
    if p.HasField("track_event"):
        if p.HasField("timestamp_clock_id") and p.timestamp_clock_id == pb.BUILTIN_CLOCK_REALTIME:
            ts = p.timestamp
        else:
            clock[seq] += p.timestamp
            ts = clock[seq]
        e = p.track_event
        parent, track = tracks[e.track_uuid]
        if e.type == pb.TrackEvent.TYPE_SLICE_BEGIN and track.endswith(" collectives"):
            args = {attrs[(seq, a.name_iid)]: a.uint_value for a in e.debug_annotations}
            slices.append({
                "pid": pids[parent],
                "func": names[(seq, e.name_iid)],
                "seq": args["seq"],
                "start_unix_ns": ts,
                "flow_ids": [str(f) for f in e.flow_ids],
            })
print(json.dumps({"primary_trace_clock": primary, "slices": slices}))
