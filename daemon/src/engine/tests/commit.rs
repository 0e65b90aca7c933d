//! The commit point and the resume protocol: what the tail waits on, forced commits and parked
//! operations, durable states and spool batches, and restarts and kills at each step.

use super::*;

/// A burst longer than the ring (300 graph replays on a real GPU write ~2 M records/s) must not
/// wait on an operation that stays open: over half full, the tail moves past it, the producer
/// drops nothing, and the open operation is still delivered when it ends.
#[test]
fn a_ring_over_half_full_commits_past_an_open_operation_and_drops_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = producer(64);
    write_dictionary(&mut p);
    assert!(p.push(&coll_start(999_999)));
    let (mut e, _rx, _hub) = engine(dir.path());
    let _conn = hand_over(&mut e, &p);
    // 40 rounds of 8 collectives: 640 records through a 64-record ring.
    for round in 0..40 {
        write_colls(&mut p, round * 8..round * 8 + 8);
        e.tick();
        e.commit_all(true);
    }
    assert!(p.push(&Record::OpStop {
        comm: 0,
        id: 1_000_000,
        host_ns: 20,
    }));
    e.tick();
    let h = e.health();
    assert_eq!(p.segment().counter(Counter::RingFull), 0);
    assert_eq!(
        h.collectives,
        40 * 8 + 1,
        "every operation delivered, the open one too"
    );
    // Past it by a forced commit, or (where a round takes longer than `PARK_PRESSED`, as on a
    // loaded host) by parking it.
    assert!(h.forced_commits + h.parked_ops > 0);
    assert_eq!(h.lost.values().sum::<u64>(), 0, "{:?}", h.lost);
}

#[test]
fn a_restarted_engine_resumes_from_the_saved_state_without_duplicates() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = producer(64);
    let name = key_of(&p);
    write_dictionary(&mut p);
    write_colls(&mut p, 0..10);
    let (mut e1, _rx1, hub1) = engine(dir.path());
    let mut live = hub1.subscribe();
    let _conn1 = hand_over(&mut e1, &p);
    e1.tick();
    e1.commit_all(true);
    let mut seen = Vec::new();
    while let Ok(c) = live.try_recv() {
        seen.push(c.inst.desc.seq);
    }
    assert_eq!(seen, (0..10).collect::<Vec<_>>());
    let saved = std::fs::read(resume::path(dir.path(), &name.to_string())).unwrap();
    // Drained again with the same dictionary: the tail moves on, the saved state stays as it was.
    write_colls(&mut p, 10..20);
    e1.tick();
    e1.commit_all(true);
    assert_eq!(live.try_recv().unwrap().inst.desc.seq, 10);
    assert_eq!(
        std::fs::read(resume::path(dir.path(), &name.to_string())).unwrap(),
        saved
    );
    // The first engine goes away (tail committed): the dictionary records lie before the tail and
    // are not read again; only the saved state still knows them.
    drop(e1);
    write_colls(&mut p, 20..40);
    let (mut e2, _rx2, hub2) = engine(dir.path());
    let mut live = hub2.subscribe();
    let _conn2 = hand_over(&mut e2, &p);
    e2.tick();
    let mut seen = Vec::new();
    while let Ok(c) = live.try_recv() {
        assert_eq!(
            (c.view().func(), c.inst.comm_hash, c.inst.bytes),
            ("AllReduce", 5, 4),
            "dictionary restored"
        );
        seen.push(c.inst.desc.seq);
    }
    assert_eq!(
        seen,
        (20..40).collect::<Vec<_>>(),
        "nothing twice, nothing missing"
    );
}

const KILL_ENV: &str = "NCCLSCOPE_TEST_ENGINE_KILL";

/// Records per tick in the killed engine: the dictionary and four collectives, then six more.
const KILL_BATCH: usize = 12;

/// The real spool, and a SIGKILL of this process as soon as its `kill_at`-th append returned: the
/// engine dies after a batch is durable in the spool and before any state records it.
struct KillAfterAppend {
    spool: Spool,
    appends: usize,
    kill_at: usize,
}

impl Durable for KillAfterAppend {
    fn append(&mut self, batch: &[SpoolRun]) -> std::io::Result<()> {
        Durable::append(&mut self.spool, batch)?;
        self.appends += 1;
        if self.appends == self.kill_at {
            let me = rustix::process::getpid();
            rustix::process::kill_process(me, rustix::process::Signal::KILL)?;
        }
        Ok(())
    }

    fn index(&self) -> crate::storage::spool::SpoolIndex {
        self.spool.index()
    }
}

/// The engine that is killed, in a process of its own (this test binary run again by the test
/// below): it drains the test's segment, saving state after every tick, until the kill.
#[test]
#[ignore = "child process of a_daemon_killed_between_spooling_and_saving_state_records_nothing_twice"]
fn engine_killed_child() {
    let spec = std::env::var(KILL_ENV).expect("run by the kill test");
    let f: Vec<&str> = spec.split('|').collect();
    let (dir, segment, key, kill_at) = (std::path::Path::new(f[0]), f[1], f[2], f[3]);
    let spool = KillAfterAppend {
        spool: Spool::open(dir.join("spool"), SpoolLimits::default()).unwrap(),
        appends: 0,
        kill_at: kill_at.parse().unwrap(),
    };
    let (mut e, _rx, _hub) = engine_with(&dir.join("state"), Some(Box::new(spool)), KILL_BATCH);
    // The parent's segment, opened through its descriptor in /proc (the same memory file).
    let fd = std::fs::File::options()
        .read(true)
        .write(true)
        .open(segment)
        .unwrap();
    let seg = Segment::open(fd.into()).unwrap();
    let (_ours, theirs) = connection();
    e.attach(key.parse().unwrap(), seg, Some(theirs)).unwrap();
    for _ in 0..100 {
        e.tick();
        e.flush(Duration::from_secs(10));
        e.commit_all(true);
    }
    panic!("not killed");
}

#[test]
fn a_daemon_killed_between_spooling_and_saving_state_records_nothing_twice() {
    use std::os::unix::process::ExitStatusExt;
    // 1: killed at its first append (no state saved by a commit yet); 2: at its second (after a
    // commit saved the state for the first).
    for kill_at in [1, 2] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("state")).unwrap();
        let mut p = producer(64);
        write_dictionary(&mut p);
        write_colls(&mut p, 0..10);
        let fd_path = format!("/proc/{}/fd/{}", std::process::id(), {
            use std::os::fd::AsRawFd;
            p.segment().fd().as_raw_fd()
        });
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "engine::tests::commit::engine_killed_child",
            ])
            .env(
                KILL_ENV,
                format!(
                    "{}|{fd_path}|{}|{kill_at}",
                    dir.path().display(),
                    key_of(&p)
                ),
            )
            .stdout(std::process::Stdio::null())
            .status()
            .unwrap();
        assert_eq!(status.signal(), Some(9), "the child was killed: {status:?}");
        let spooled = |dir: &std::path::Path| -> Vec<u64> {
            crate::storage::spool::SpoolReader::open_dir(dir.join("spool"))
                .unwrap()
                .read_job(&job_j())
                .map(|c| c.unwrap().seq)
                .collect()
        };
        let before = spooled(dir.path()).len() as u64;
        assert_eq!(before, [4, 10][kill_at - 1], "spooled before the kill");

        // The process goes on; a new engine takes over from what the killed one left.
        write_colls(&mut p, 10..20);
        let spool = Spool::open(dir.path().join("spool"), SpoolLimits::default()).unwrap();
        let (mut e, rx, hub) =
            engine_with(&dir.path().join("state"), Some(Box::new(spool)), KILL_BATCH);
        let mut live = hub.subscribe();
        let _conn = hand_over(&mut e, &p);
        while e.tick() {}
        e.flush(Duration::from_secs(10));
        e.commit_all(true);
        e.snapshot(true);
        assert_eq!(
            spooled(dir.path()),
            (0..20).collect::<Vec<_>>(),
            "each instance spooled once (killed at append {kill_at})"
        );
        let mut published = Vec::new();
        while let Ok(c) = live.try_recv() {
            published.push(c.inst.desc.seq);
        }
        assert_eq!(published, (before..20).collect::<Vec<_>>());
        assert_eq!(e.health().collectives, 20 - before);
        let text = metrics::render_prometheus(&rx.borrow().families, &metrics::Exposition::FULL);
        let counted: f64 = text
            .lines()
            .filter(|l| l.starts_with("ncclscope_rank_collectives_total{"))
            .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
            .sum();
        assert_eq!(counted, (20 - before) as f64, "{text}");
    }
}

#[test]
fn a_kill_between_saving_state_and_committing_the_tail_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let state_dir = dir.path().join("state");
    std::fs::create_dir_all(&state_dir).unwrap();
    let mut p = producer(1024);
    write_dictionary(&mut p);
    write_colls(&mut p, 0..10);
    let spool = || Box::new(Spool::open(dir.path().join("spool"), SpoolLimits::default()).unwrap());
    let (mut e1, _rx1, _hub1) = engine_with(&state_dir, Some(spool()), 8192);
    let _conn1 = hand_over(&mut e1, &p);
    e1.tick();
    e1.flush(Duration::from_secs(10));
    e1.commit_all(true);
    write_colls(&mut p, 10..20);
    // No commit inside this tick: the next one is not due.
    e1.segments.list[0].commit.last_commit = Instant::now() + Duration::from_secs(60);
    e1.tick();
    e1.flush(Duration::from_secs(10));
    let committed = e1.segments.list[0].consumer.segment().tail();
    // What `commit` does first, without the second step: the state for the new tail is saved...
    let target = e1.segments.list[0].read_upto;
    assert!(target > committed);
    let end = e1.spool.as_ref().map(|s| s.end(&job_j()));
    let (cp, r) = e1.segments.list[0].split();
    cp.save_state(&r, &mut e1.states, target, end, Parked::Now)
        .unwrap();
    // ... and the daemon is killed before the tail is committed.
    drop(e1);
    assert_eq!(p.segment().tail(), committed);

    write_colls(&mut p, 20..30);
    let (mut e2, _rx2, hub2) = engine_with(&state_dir, Some(spool()), 8192);
    let mut live = hub2.subscribe();
    let _conn2 = hand_over(&mut e2, &p);
    assert_eq!(
        e2.segments.list[0].consumer.segment().tail(),
        target,
        "commit finished"
    );
    while e2.tick() {}
    e2.flush(Duration::from_secs(10));
    let mut seen = Vec::new();
    while let Ok(c) = live.try_recv() {
        assert_eq!(c.view().func(), "AllReduce", "dictionary restored");
        seen.push(c.inst.desc.seq);
    }
    assert_eq!(
        seen,
        (20..30).collect::<Vec<_>>(),
        "nothing twice, nothing missing"
    );
    assert_eq!(e2.health().lost.get("resume_state_missing"), Some(&0));
    let spooled: Vec<u64> = crate::storage::spool::SpoolReader::open_dir(dir.path().join("spool"))
        .unwrap()
        .read_job(&job_j())
        .map(|c| c.unwrap().seq)
        .collect();
    assert_eq!(spooled, (0..30).collect::<Vec<_>>());
}

/// One lost record costs at most its own operation, however long the run: a host event, a
/// kernel record and a stop each missing once in a run 10x the ring, at up to 20 records a
/// millisecond. The operations they belong to stay open (or never open), the tail moves past
/// them and every other operation is delivered. The producer waits for room rather than drop
/// (the tail's pace follows the state writer's fsyncs, slow on a loaded host): a tail held by a
/// lost record would never make room and fails the test at its deadline.
#[test]
fn a_lost_record_costs_its_own_operation_and_nothing_more() {
    const N: u64 = 2000;
    const NO_START: u64 = 500;
    const NO_KERNEL: u64 = 1000;
    const NO_STOP: u64 = 1500;
    let dir = tempfile::tempdir().unwrap();
    let mut p = producer(1024);
    write_dictionary(&mut p);
    p.push(&calibration());
    let (mut e, _rx, hub) = engine(dir.path());
    let mut live = hub.subscribe();
    let conn = hand_over(&mut e, &p);
    let deadline = Instant::now() + Duration::from_secs(20);
    for seq in 0..N {
        let channels: &[u32] = if seq == NO_KERNEL { &[0] } else { &[0, 1] };
        // Room for the collective's 4 records.
        while p.segment().capacity() - (p.segment().head() - p.segment().tail()) < 4 {
            assert!(Instant::now() < deadline, "the tail stopped at {seq}");
            e.tick();
            std::thread::sleep(Duration::from_millis(1));
        }
        coll_with_work(&mut p, seq, seq != NO_START, channels, seq != NO_STOP);
        if seq % 4 == 3 {
            e.tick();
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    drop(conn);
    tick_until_dropped(&mut e);
    let mut seen = Vec::new();
    while let Ok(c) = live.try_recv() {
        seen.push(c.inst.desc.seq);
    }
    seen.sort_unstable();
    let expected: Vec<u64> = (0..N).filter(|&s| s != NO_START).collect();
    assert_eq!(p.segment().counter(Counter::RingFull), 0);
    assert!(
        seen == expected,
        "{} delivered of {}",
        seen.len(),
        expected.len()
    );
    // The two that never completed are delivered at the process's end with what they have,
    // and counted; the one that never started has nothing to deliver.
    let lost = e.health().lost;
    assert_eq!(lost["incomplete"], 2, "{lost:?}");
}

/// A collective of `write_colls`'s communicator with kernel work on `channels` of 2 (op id seq +
/// 1), started unless `start` is false, stopped unless `stop` is false.
fn coll_with_work(p: &mut Producer, seq: u64, start: bool, channels: &[u32], stop: bool) {
    let c = Coll {
        n_channels: 2,
        ..coll(seq)
    };
    if start {
        assert!(p.push(&c.start()));
    }
    for &channel in channels {
        let gpu = (1000 * seq + 10, 1000 * seq + 500);
        assert!(p.push(&c.kernel(channel as u8, gpu, 10)));
    }
    if stop {
        assert!(p.push(&c.stop(20)));
    }
}

fn calibration() -> Record {
    fixture::calibration(0, 0, 100)
}

/// Issue 16: a record the plugin counts as lost (here an OpStop and a KernelCh) parks the
/// operations read so far at once: the tail moves past the two that can no longer complete,
/// rather than waiting on them until they time out while the ring fills. Without the count the
/// tail waits on the first of them (checked first). A gap the daemon sees itself (kernel work of
/// an operation whose start never came) does the same.
#[test]
fn a_counted_gap_parks_the_operations_read_so_far_and_frees_their_records() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = producer(1 << 12);
    write_dictionary(&mut p);
    p.push(&calibration());
    let (mut e, _rx, hub) = engine(dir.path());
    let mut live = hub.subscribe();
    let _conn = hand_over(&mut e, &p);
    for seq in 0..10 {
        coll_with_work(&mut p, seq, true, &[0, 1], true);
    }
    let no_stop = p.segment().head();
    coll_with_work(&mut p, 10, true, &[0, 1], false);
    coll_with_work(&mut p, 11, true, &[1], true);
    for seq in 12..20 {
        coll_with_work(&mut p, seq, true, &[0, 1], true);
    }
    e.tick();
    e.commit_all(true);
    assert_eq!(p.segment().tail(), no_stop, "no gap seen: the tail waits");
    assert_eq!(e.health().parked_ops, 0);

    // What the plugin does on dropping the two records: count them in the segment's header.
    p.segment().count(Counter::QueueFull, 2);
    e.tick();
    e.commit_all(true);
    assert_eq!(
        p.segment().tail(),
        p.segment().head(),
        "the tail moved past them"
    );
    assert_eq!(e.health().parked_ops, 2);
    let state = resume::load(dir.path(), &key_of(&p).to_string())
        .unwrap()
        .unwrap();
    let parked: Vec<u64> = state.parked.iter().map(|o| o.desc.seq).collect();
    assert_eq!(parked, [10, 11], "the resume state carries them");

    // Uncounted: an operation without its stop, then one whose start is missing.
    coll_with_work(&mut p, 20, true, &[0, 1], false);
    e.tick();
    e.commit_all(true);
    assert!(
        p.segment().tail() < p.segment().head(),
        "no gap seen: the tail waits"
    );
    coll_with_work(&mut p, 21, false, &[0, 1], true);
    for seq in 22..30 {
        coll_with_work(&mut p, seq, true, &[0, 1], true);
    }
    e.tick();
    e.commit_all(true);
    assert_eq!(
        p.segment().tail(),
        p.segment().head(),
        "the tail moved past it"
    );
    assert_eq!(e.health().parked_ops, 3);
    let mut seen: Vec<u64> = std::iter::from_fn(|| live.try_recv().ok())
        .map(|c| c.inst.desc.seq)
        .collect();
    seen.sort_unstable();
    let expected: Vec<u64> = (0..30).filter(|s| ![10, 11, 20, 21].contains(s)).collect();
    assert_eq!(seen, expected, "every other operation delivered");
}

/// A parked operation is continued by a restarted engine from the saved state: delivered once,
/// complete, with the kernel work read before and after the restart; also when the killed
/// engine had already spooled it but not saved a state saying so (the state dir unwritable
/// stands for the kill: the tail stays where the last state was saved).
#[test]
fn a_parked_operation_is_continued_after_a_restart_and_recorded_once() {
    for killed_after_spooling in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let state_dir = dir.path().join("state");
        std::fs::create_dir_all(&state_dir).unwrap();
        let spool = || Spool::open(dir.path().join("spool"), SpoolLimits::default()).unwrap();
        let mut p = producer(1 << 12);
        write_dictionary(&mut p);
        p.push(&calibration());
        let (mut e1, _rx, _hub) = engine_with(&state_dir, Some(Box::new(spool())), 1 << 12);
        let _conn1 = hand_over(&mut e1, &p);
        coll_with_work(&mut p, 0, true, &[0], false);
        for seq in 1..10 {
            coll_with_work(&mut p, seq, true, &[0, 1], true);
        }
        p.segment().count(Counter::QueueFull, 1);
        e1.tick();
        e1.flush(Duration::from_secs(10));
        e1.commit_all(true);
        assert_eq!(p.segment().tail(), p.segment().head());
        assert_eq!(e1.health().parked_ops, 1);
        // The rest of operation 0 (its record was late, not lost), then more.
        coll_with_work(&mut p, 0, false, &[1], true);
        for seq in 10..15 {
            coll_with_work(&mut p, seq, true, &[0, 1], true);
        }
        if killed_after_spooling {
            let away = dir.path().join("state.away");
            std::fs::rename(&state_dir, &away).unwrap();
            std::fs::write(&state_dir, b"not a directory").unwrap();
            e1.tick();
            e1.flush(Duration::from_secs(10));
            e1.commit_all(true);
            assert_eq!(e1.health().collectives, 15, "all spooled before the kill");
            std::fs::remove_file(&state_dir).unwrap();
            std::fs::rename(&away, &state_dir).unwrap();
        }
        drop(e1);
        let (mut e2, _rx, hub) = engine_with(&state_dir, Some(Box::new(spool())), 1 << 12);
        let mut live = hub.subscribe();
        let _conn2 = hand_over(&mut e2, &p);
        e2.tick();
        e2.flush(Duration::from_secs(10));
        e2.commit_all(true);
        let spooled: Vec<_> =
            crate::storage::spool::SpoolReader::open_dir(dir.path().join("spool"))
                .unwrap()
                .read_job(&job_j())
                .map(|c| c.unwrap())
                .collect();
        let mut seqs: Vec<u64> = spooled.iter().map(|c| c.seq).collect();
        seqs.sort_unstable();
        assert_eq!(
            seqs,
            (0..15).collect::<Vec<_>>(),
            "each once (killed after spooling: {killed_after_spooling})"
        );
        let op0 = spooled.iter().find(|c| c.seq == 0).unwrap();
        assert_eq!(
            op0.channels.len(),
            2,
            "work from before and after the restart"
        );
        let published: Vec<u64> = std::iter::from_fn(|| live.try_recv().ok())
            .map(|c| c.inst.desc.seq)
            .collect();
        match killed_after_spooling {
            true => assert!(published.is_empty(), "{published:?}"),
            false => assert_eq!(published, [0, 10, 11, 12, 13, 14]),
        }
        let mut lost = e2.health().lost;
        assert_eq!(lost.remove("queue_full"), Some(1));
        assert!(lost.values().all(|&n| n == 0), "{lost:?}");
    }
}

/// Group commit (issue 16 item 3): ingest does not wait for the spool. While the spool's append
/// is blocked (a slow fdatasync), ticks go on reading, assembling and counting, and the tail stays
/// at the first operation not yet durable; once the spool has them, the tail moves past them and
/// the spool holds each once, in completion order.
#[test]
fn ingest_goes_on_while_the_spool_syncs_and_the_tail_waits_for_it() {
    struct Gated {
        spool: Spool,
        open: Arc<AtomicBool>,
    }
    impl Durable for Gated {
        fn append(&mut self, batch: &[SpoolRun]) -> std::io::Result<()> {
            while !self.open.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(1));
            }
            Durable::append(&mut self.spool, batch)
        }

        fn index(&self) -> crate::storage::spool::SpoolIndex {
            self.spool.index()
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let open = Arc::new(AtomicBool::new(false));
    let spool = Gated {
        spool: Spool::open(dir.path().join("spool"), SpoolLimits::default()).unwrap(),
        open: open.clone(),
    };
    let (mut e, _rx, hub) = engine_with(dir.path(), Some(Box::new(spool)), 1 << 12);
    let mut live = hub.subscribe();
    let mut p = producer(1 << 12);
    write_dictionary(&mut p);
    let first = p.segment().head();
    let _conn = hand_over(&mut e, &p);
    for round in 0..3 {
        write_colls(&mut p, round * 10..round * 10 + 10);
        e.tick();
        e.commit_all(true);
        assert_eq!(e.health().collectives, round * 10 + 10, "ingest went on");
        assert_eq!(p.segment().tail(), first, "the tail waits for the spool");
    }
    assert!(
        live.try_recv().is_err(),
        "published once durable, not before"
    );
    open.store(true, Ordering::Release);
    assert!(e.flush(Duration::from_secs(10)));
    e.commit_all(true);
    assert_eq!(p.segment().tail(), p.segment().head());
    let spooled: Vec<u64> = crate::storage::spool::SpoolReader::open_dir(dir.path().join("spool"))
        .unwrap()
        .read_job(&job_j())
        .map(|c| c.unwrap().seq)
        .collect();
    assert_eq!(spooled, (0..30).collect::<Vec<_>>());
    let published: Vec<u64> = std::iter::from_fn(|| live.try_recv().ok())
        .map(|c| c.inst.desc.seq)
        .collect();
    assert_eq!(published, (0..30).collect::<Vec<_>>());
}

/// Issue 19: the resume state is durable before the tail it describes is committed, and ingest
/// does not wait for it. While the state writer is held (a slow fsync), ticks go on reading and
/// delivering, and the ring's tail stays where the last durable state is (none yet: where it
/// began); once the writer has caught up, the tail moves on, and an engine restarted from the
/// state on disk delivers each operation once.
#[test]
fn the_tail_waits_for_a_durable_state_and_ingest_does_not() {
    struct Gated {
        dir: state_writer::Dir,
        open: Arc<AtomicBool>,
    }
    impl state_writer::Store for Gated {
        fn store(&mut self, states: &[SegmentState]) -> Vec<(usize, std::io::Error)> {
            while !self.open.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(1));
            }
            self.dir.store(states)
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let mut p = producer(1 << 12);
    let name = key_of(&p).to_string();
    write_dictionary(&mut p);
    let (mut e, _rx, hub) = engine(dir.path());
    let open = Arc::new(AtomicBool::new(false));
    let gated = Gated {
        dir: state_writer::Dir(dir.path().to_path_buf()),
        open: open.clone(),
    };
    e.states = StateWriter::start(Box::new(gated)).unwrap();
    let mut live = hub.subscribe();
    let _conn = hand_over(&mut e, &p);
    for round in 0..3 {
        write_colls(&mut p, round * 10..round * 10 + 10);
        e.tick();
        std::thread::sleep(COMMIT_EVERY);
        e.tick();
        assert_eq!(e.health().collectives, round * 10 + 10, "ingest went on");
        assert_eq!(p.segment().tail(), 0, "the tail waits for a durable state");
    }
    assert_eq!(resume::load(dir.path(), &name).unwrap(), None);
    open.store(true, Ordering::Release);
    assert!(e.flush(Duration::from_secs(10)));
    assert_eq!(p.segment().tail(), p.segment().head(), "the tail moved on");
    let saved = resume::load(dir.path(), &name).unwrap().unwrap();
    assert!(saved.tail > 0 && saved.tail <= p.segment().tail());
    let published: Vec<u64> = std::iter::from_fn(|| live.try_recv().ok())
        .map(|c| c.inst.desc.seq)
        .collect();
    assert_eq!(published, (0..30).collect::<Vec<_>>());

    drop(e);
    write_colls(&mut p, 30..40);
    let (mut e2, _rx2, hub2) = engine(dir.path());
    let mut live = hub2.subscribe();
    let _conn2 = hand_over(&mut e2, &p);
    e2.tick();
    let seen: Vec<u64> = std::iter::from_fn(|| live.try_recv().ok())
        .inspect(|c| assert_eq!(c.view().func(), "AllReduce", "dictionary restored"))
        .map(|c| c.inst.desc.seq)
        .collect();
    assert_eq!(
        seen,
        (30..40).collect::<Vec<_>>(),
        "nothing twice, nothing missing"
    );
    assert_eq!(e2.health().lost["resume_state_missing"], 0);
}

/// A state that cannot be written (its directory gone, as a full disk) is counted and the tail
/// does not move; nothing the engine accepted is lost: once the directory is back, the next
/// commit saves again, the tail moves on, and a restart delivers each operation once.
#[test]
fn a_state_that_cannot_be_written_is_counted_and_saved_again() {
    let dir = tempfile::tempdir().unwrap();
    let state_dir = dir.path().join("state");
    std::fs::create_dir(&state_dir).unwrap();
    let mut p = producer(1 << 12);
    write_dictionary(&mut p);
    write_colls(&mut p, 0..10);
    let (mut e, _rx, _hub) = engine(&state_dir);
    let _conn = hand_over(&mut e, &p);
    std::fs::remove_dir(&state_dir).unwrap();
    e.tick();
    e.commit_all(true);
    assert_eq!(e.health().collectives, 10);
    assert!(e.health().lost["state_write_failed"] > 0);
    assert_eq!(p.segment().tail(), 0, "not committed without its state");

    std::fs::create_dir(&state_dir).unwrap();
    e.commit_all(true);
    assert_eq!(
        p.segment().tail(),
        p.segment().head(),
        "saved again, committed"
    );
    drop(e);
    write_colls(&mut p, 10..20);
    let (mut e2, _rx2, hub2) = engine(&state_dir);
    let mut live = hub2.subscribe();
    let _conn2 = hand_over(&mut e2, &p);
    e2.tick();
    let seen: Vec<u64> = std::iter::from_fn(|| live.try_recv().ok())
        .map(|c| c.inst.desc.seq)
        .collect();
    assert_eq!(
        seen,
        (10..20).collect::<Vec<_>>(),
        "nothing twice, nothing missing"
    );
}

/// Spans are at-least-once across a kill: an operation that started first but finished after
/// another (here on another communicator) keeps the tail at its first record until its span is
/// acknowledged, although it was emitted second.
#[test]
fn the_tail_waits_on_the_unacknowledged_operation_whose_records_come_first() {
    let dir = tempfile::tempdir().unwrap();
    let (mut e, _unread) = exporting_engine(dir.path(), 16, None);
    let mut p = producer(64);
    write_dictionary(&mut p);
    p.push(&comm_record(1, 6));
    let first = p.segment().head();
    p.push(&coll_start(0));
    let mut other = coll_start(1);
    if let Record::CollStart { comm, .. } = &mut other {
        *comm = 1;
    }
    p.push(&other);
    p.push(&Record::OpStop {
        comm: 1,
        id: 2,
        host_ns: 20,
    });
    p.push(&Record::OpStop {
        comm: 0,
        id: 1,
        host_ns: 30,
    });
    let _conn = hand_over(&mut e, &p);
    e.tick();
    e.commit_all(true);
    assert_eq!(e.health().collectives, 2);
    assert_eq!(p.segment().tail(), first, "neither span acknowledged");
}

/// Issue 37: a span or root whose records a forced commit passed before the receiver
/// acknowledged it cannot be sent again by a killed daemon's successor: each saved state says how
/// many are in flight and the successor counts them (`span_not_resent`, `root_not_resent`), once:
/// its own first state no longer carries them.
#[test]
fn spans_a_forced_commit_passed_unacknowledged_are_counted_by_the_successor() {
    let dir = tempfile::tempdir().unwrap();
    let exporting_engine = || exporting_engine(dir.path(), 1024, None);
    let mut p = producer(64);
    let name = key_of(&p).to_string();
    write_dictionary(&mut p);
    let (mut e1, mut queued) = exporting_engine();
    let _conn = hand_over(&mut e1, &p);
    // 20 rounds of 8 collectives through a 64-record ring; the collector acknowledges nothing.
    for round in 0..20 {
        write_colls(&mut p, round * 8..round * 8 + 8);
        e1.tick();
        e1.commit_all(true);
    }
    assert_eq!(p.segment().counter(Counter::RingFull), 0);
    assert!(e1.health().forced_commits > 0);
    let emitted = std::iter::from_fn(|| queued.try_recv().ok()).count() as u64;
    assert_eq!(emitted, 160, "every collective's span, carrying its root");
    // What the tail did not pass waits on its acknowledgement (2 records a collective).
    let st = resume::load(dir.path(), &name).unwrap().unwrap();
    let held = (p.segment().head() - st.tail) / 2;
    let passed = emitted - held;
    assert!(passed > 100, "{passed} passed");
    // A lone local rank's root is its own span (counted as one); roots shared by several local
    // ranks: `a_root_passed_by_several_ranks_tails_is_at_risk_once_until_it_settles`.
    assert_eq!(
        st.at_risk,
        resume::AtRisk {
            spans: passed,
            roots: 0
        }
    );
    drop(e1); // killed: nothing more is saved

    let (mut e2, _queued) = exporting_engine();
    let _conn = hand_over(&mut e2, &p);
    let lost = e2.health().lost;
    assert_eq!(lost["span_not_resent"], passed, "{lost:?}");
    e2.tick();
    e2.commit_all(true);
    drop(e2);
    let (mut e3, _queued) = exporting_engine();
    let _conn = hand_over(&mut e3, &p);
    let lost = e3.health().lost;
    assert_eq!(lost["span_not_resent"], 0, "counted once: {lost:?}");
    assert_eq!(lost["root_not_resent"], 0, "counted once: {lost:?}");
}

/// The root of a collective whose local ranks' tails a forced commit passed is at risk once (one
/// collective, one root), until it settles; a settled one is not.
#[test]
fn a_root_passed_by_several_ranks_tails_is_at_risk_once_until_it_settles() {
    let (mut rank0, mut rank1) = (Passed::default(), Passed::default());
    let (root, settled) = (RootWait::default(), RootWait::default());
    settled.settle();
    for p in [&mut rank0, &mut rank1] {
        p.root(root.clone());
        p.root(settled.clone());
    }
    let risk = |p: &mut Passed| p.at_risk(0).roots;
    assert_eq!(risk(&mut rank0) + risk(&mut rank1), 1);
    root.settle();
    assert_eq!(risk(&mut rank0) + risk(&mut rank1), 0);
}

#[test]
fn a_dictionary_that_keeps_changing_is_saved_at_a_bounded_rate_and_restart_safe() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = producer(64);
    let name = key_of(&p);
    let (mut e, _rx, _hub) = engine(dir.path());
    let _conn = hand_over(&mut e, &p);
    // A new string on every tick, for 200 ms.
    let (mut saves, mut last) = (0, None);
    let t0 = Instant::now();
    let mut id = 1;
    while t0.elapsed() < Duration::from_millis(200) && id < 4000 {
        if p.push(&Record::str(StrId(id), b"x")) {
            id += 1;
        }
        e.tick();
        let committed = p.segment().tail();
        let saved = std::fs::read(resume::path(dir.path(), &name.to_string())).ok();
        if let Some(text) = &saved {
            let st: SegmentState = serde_json::from_slice(text).unwrap();
            assert!(
                st.tail >= committed,
                "the tail runs behind the state on disk"
            );
        }
        if saved.is_some() && saved != last {
            saves += 1;
            last = saved;
        }
    }
    assert!(id > 50, "strings defined: {id}");
    assert!(
        saves <= 21,
        "{saves} state files written in 200 ms for {id} strings"
    );
    // The tail moved only with a saved dictionary that covers every record before it (once the
    // last state queued is durable, the ring's tail is its).
    assert!(e.flush(Duration::from_secs(10)));
    let st = resume::load(dir.path(), &name.to_string())
        .unwrap()
        .unwrap();
    assert_eq!(st.tail, p.segment().tail());
    assert!(st.dictionary.strings.len() as u64 >= st.tail);
}
