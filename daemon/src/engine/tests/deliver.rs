//! Delivery: what the export queue refuses.

use super::*;

/// Issue 22: an instance the full export queue refuses is counted and remembered for re-sending
/// from the spool; a queued one still carries its segment's acknowledgement.
#[test]
fn instances_refused_by_a_full_export_queue_are_remembered_for_re_sending() {
    let dir = tempfile::tempdir().unwrap();
    let dropped = Arc::new(Dropped::new(crate::export::resend::MAX_REMEMBERED));
    let (mut e, mut queued) = exporting_engine(dir.path(), 1, Some(dropped.clone()));
    let mut p = producer(64);
    write_dictionary(&mut p);
    for seq in 0..3 {
        p.push(&coll_start(seq));
        p.push(&Record::OpStop {
            comm: 0,
            id: seq + 1,
            host_ns: 10 + seq,
        });
    }
    let _conn = hand_over(&mut e, &p);
    e.tick();
    assert_eq!(e.health().lost["export_queue_full"], 2);
    assert_eq!(dropped.held(), 2, "both refused instances remembered");
    let first = queued.try_recv().unwrap();
    assert_eq!(first.coll.inst.desc.seq, 0);
    assert!(
        first.acked.is_some(),
        "a live span is acknowledged to its segment"
    );
}
