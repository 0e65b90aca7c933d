//! Segments as they come and go: their loss counters, the end of their process, corruption.

use super::*;

/// Loss counters come from headers their owners write: one uid's segment can raise its own
/// figure to the maximum but never wrap it, nor raise the node's figure past its bound (see
/// `loss::UID_RATE_PER_SEC`), and a counter its owner lowers lowers nothing; each uid's own
/// figure is kept apart.
#[test]
fn no_segment_can_lower_or_wrap_another_uids_loss_counters() {
    use crate::loss::UID_RATE_PER_SEC;
    let dir = tempfile::tempdir().unwrap();
    let (mut e, _rx, _hub) = engine(dir.path());
    let (victim, hostile) = (producer(64), producer(64));
    let mut conns = Vec::new();
    let t0 = Instant::now();
    for (p, uid) in [(&victim, 1001), (&hostile, 1002)] {
        conns.push(hand_over_as(&mut e, p, SegmentKey { uid, ..key_of(p) }));
    }
    victim.segment().count(Counter::RingFull, 7);
    hostile.segment().count(Counter::RingFull, u64::MAX - 3);
    std::thread::sleep(Duration::from_millis(2));
    e.tick();
    let h = e.health();
    let bound = |since: Instant| since.elapsed().as_secs_f64() * UID_RATE_PER_SEC as f64;
    // The victim's 7 in full, the hostile uid's within its bound: not saturated at 2^64 - 1.
    let node = h.lost["ring_full"];
    assert!((7..=7 + bound(t0) as u64).contains(&node), "{node}");
    assert_eq!(h.plugin_lost_by_uid[&(1001, "ring_full")], 7);
    assert_eq!(
        h.plugin_lost_by_uid[&(1001, "queue_full")],
        0,
        "every stage"
    );
    // The hostile owner winds its counter back (wrapping add): nothing goes down.
    hostile.segment().count(Counter::RingFull, u64::MAX - 10);
    e.tick();
    let h = e.health();
    assert_eq!(h.plugin_lost_by_uid[&(1002, "ring_full")], u64::MAX - 3);
    assert_eq!(h.plugin_lost_by_uid[&(1001, "ring_full")], 7);
    assert!(h.lost["ring_full"] >= node);
    // Both processes end: their figures stay, per uid.
    drop(conns);
    let t0 = Instant::now();
    while e.health().segments > 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "segments not dropped"
        );
        e.tick();
    }
    let h = e.health();
    assert_eq!(h.plugin_lost_by_uid[&(1001, "ring_full")], 7);
    assert!(h.lost["ring_full"] < 1 << 53);
}

#[test]
fn the_end_of_a_processs_connection_drains_then_drops_its_segment() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = producer(64);
    write_dictionary(&mut p);
    write_colls(&mut p, 0..5);
    let (mut e, _rx, hub) = engine(dir.path());
    let mut live = hub.subscribe();
    let first = hand_over(&mut e, &p);
    e.tick();
    // Handed over again on a new connection (the plugin reconnected): the same segment, once.
    let second = hand_over(&mut e, &p);
    drop(first);
    write_colls(&mut p, 5..10);
    let t0 = Instant::now();
    while t0.elapsed() < LIVENESS_EVERY * 2 {
        e.tick();
    }
    assert_eq!(e.health().segments, 1, "still connected through the second");
    // The process ends: what it wrote last is still delivered, then the segment is dropped.
    write_colls(&mut p, 10..12);
    drop(second);
    tick_until_dropped(&mut e);
    let mut seen = Vec::new();
    while let Ok(c) = live.try_recv() {
        seen.push(c.inst.desc.seq);
    }
    assert_eq!(seen, (0..12).collect::<Vec<_>>());
    assert!(resume::list(dir.path()).is_empty(), "resume state removed");
}

#[test]
fn a_corrupt_segment_is_detached_counted_and_not_reattached() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = producer(64);
    let (mut e, _rx, _hub) = engine(dir.path());
    let _conn = hand_over(&mut e, &p);
    assert_eq!(e.health().segments, 1);
    // Someone else consumes and commits behind the engine's back, so the producer's cursor runs
    // more than a ring ahead of the engine's read cursor: corrupt.
    for _ in 0..64 {
        p.push(&Record::CommEnd {
            comm: 0,
            host_ns: 0,
        });
    }
    let raw = Segment::open(p.segment().fd().try_clone_to_owned().unwrap()).unwrap();
    let mut c = Consumer::new(raw);
    c.read(64, &mut Vec::new()).unwrap();
    c.commit(64);
    for _ in 0..64 {
        p.push(&Record::CommEnd {
            comm: 0,
            host_ns: 0,
        });
    }
    e.tick();
    assert_eq!(e.health().segments, 0);
    assert_eq!(e.health().lost.get("corrupt_segment"), Some(&1));
    let seg = Segment::open(p.segment().fd().try_clone_to_owned().unwrap()).unwrap();
    let again = e.attach(key_of(&p), seg, None);
    assert_eq!(again, Err("the segment was detached as corrupt".into()));
    assert_eq!(e.health().segments, 0, "not attached again");
}
