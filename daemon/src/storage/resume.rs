//! Per-segment resume state, one small JSON file per segment in `state_dir`. The segment's committed
//! tail survives a daemon restart inside the segment itself; this file carries what the records before
//! the tail defined (strings, communicators, calibration) and which operations after the tail were
//! already delivered, so a restarted daemon neither misreads nor double-counts what it re-reads
//! (together with the spool's record of what it holds from the saved position on). The engine's
//! state writer thread ([`crate::storage::state_writer`]) makes a state durable ([`store`], [`sync_dir`])
//! before the tail it describes is committed.
//!
//! Every type written to the file is defined here, apart from the in-memory structures they are
//! taken from and [`Desc`], the one description of a collective that the instance shares; and
//! `a_saved_state_keeps_its_format` pins the format: a change to the assembler's structures (or to
//! `Desc`) cannot change the file without failing it.

use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use ncclscope_proto::Gpu;
use serde::{Deserialize, Serialize};

use crate::instance::Desc;
use crate::storage::spool::Position;

/// What must survive a daemon restart to interpret a segment from its committed tail on: the saved
/// form of the assembler's dictionary (`assemble::dictionary::Dict`) and templates.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SavedDictionary {
    pub strings: Vec<(u16, String)>,
    pub func_names: Vec<(u32, u16)>,
    pub calibrations: Vec<(i32, Calibration)>,
    pub comms: Vec<CommInfo>,
    /// Graph templates and their replay cursors as of the committed tail.
    #[serde(default)]
    pub templates: Vec<SavedTemplate>,
    /// The p2p numbering as of the committed tail: (comm, peer, function string id, next number).
    #[serde(default)]
    pub p2p_seqs: Vec<(u32, i32, u16, u64)>,
    /// Per communicator, the p2p widths its items have not ruled out (bit i: 2^i channels), where
    /// they ruled out some: a communicator's width never changes, so what later items told holds at
    /// the tail too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub p2p_widths: Vec<(u32, u8)>,
}

/// A communicator as the process announced it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CommInfo {
    pub comm: u32,
    pub comm_hash: u64,
    pub rank: u32,
    pub nranks: u32,
    pub nnodes: u32,
    pub cuda_dev: i32,
    pub name: u16,
    pub device_hook: bool,
    /// Finalized; kept so that re-reading its records after a restart still resolves it.
    #[serde(default)]
    pub ended: bool,
    /// Stream position of the CommEnd: once committed, no record of it can be read again.
    #[serde(default)]
    pub ended_pos: u64,
    /// Its GPU, as the process announced it (saved only where there is one).
    #[serde(default, skip_serializing_if = "Option::is_none", with = "gpu")]
    pub gpu: Option<Gpu>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// Host (CLOCK_REALTIME) minus GPU (%globaltimer) at `host_ns`.
    pub offset_ns: i64,
    pub error_ns: u32,
    /// How fast the offset moved since the device's previous calibration (ppb of host time), and
    /// when this one was taken: the GPU's clock drifts against the host's by parts per million (10 ppm
    /// measured on an H100, 50 us between two calibrations 5 s apart), so a time is mapped with the
    /// offset of its own moment ([`Calibration::offset_at`]). 0 where unknown (a first calibration,
    /// a state saved by an older daemon).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub drift_ppb: i32,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub host_ns: u64,
    /// How far `drift_ppb` may be off (ppb): the two calibrations' errors over the time between
    /// them, or [`UNMEASURED_DRIFT_PPB`] for a device's first. [`Calibration::error_at`] grows the
    /// error by it with distance from the calibration. 0 in states saved by older daemons.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub drift_error_ppb: u32,
}

/// The drift assumed possible before a device's second calibration measures it: ten times the
/// 10.5 ppm measured on an H100 (docs/clock-alignment.md).
pub const UNMEASURED_DRIFT_PPB: u32 = 100_000;

/// Farthest a calibration's drift is carried from the moment it was taken: the plugin recalibrates
/// every few seconds, so a time further away than this was mapped by another calibration (or the
/// process stopped calibrating), and a drift carried for minutes is a guess.
const MAX_DRIFT_AGE_NS: i128 = 60_000_000_000;

impl Calibration {
    /// The offset for GPU time `gpu_ns`: this calibration's, moved by its drift from when it was
    /// taken to that moment (between the previous calibration and this one, the drift is the slope
    /// measured over exactly that interval; after it, the latest slope carried on, at most
    /// [`MAX_DRIFT_AGE_NS`]).
    pub fn offset_at(&self, gpu_ns: u64) -> i64 {
        if self.drift_ppb == 0 || self.host_ns == 0 || gpu_ns == 0 {
            return self.offset_ns;
        }
        let age = (gpu_ns as i128 + self.offset_ns as i128 - self.host_ns as i128)
            .clamp(-MAX_DRIFT_AGE_NS, MAX_DRIFT_AGE_NS);
        self.offset_ns + (age * self.drift_ppb as i128 / 1_000_000_000) as i64
    }

    /// The error of [`Calibration::offset_at`] for `gpu_ns`: the calibration's own, plus what the
    /// drift's uncertainty adds over the distance from the moment it was taken.
    pub fn error_at(&self, gpu_ns: u64) -> u32 {
        if self.host_ns == 0 || gpu_ns == 0 {
            return self.error_ns;
        }
        let age = (gpu_ns as i128 + self.offset_ns as i128 - self.host_ns as i128)
            .abs()
            .min(MAX_DRIFT_AGE_NS);
        let grown = self.error_ns as i128 + age * self.drift_error_ppb as i128 / 1_000_000_000;
        grown.min(u32::MAX as i128 - 1) as u32
    }

    /// Whether times are better mapped by the device's next calibration, due within a second: this
    /// is its first (the plugin takes the second 250 ms later), so its drift is not yet measured,
    /// and the next one interpolates between the two. Not for calibrations without their moment
    /// (older plugins), which come every 5 s.
    pub fn awaits_second(&self) -> bool {
        self.host_ns != 0 && self.drift_error_ppb == UNMEASURED_DRIFT_PPB
    }

    /// This calibration as the one after `previous` of the same device (None: its first): how far
    /// its drift may be off.
    pub fn after(mut self, previous: Option<&Calibration>) -> Calibration {
        self.drift_error_ppb = match previous {
            Some(p) if self.host_ns > p.host_ns && p.host_ns != 0 => {
                let sum = (p.error_ns as u128 + self.error_ns as u128) * 1_000_000_000;
                (sum / (self.host_ns - p.host_ns) as u128).min(u32::MAX as u128) as u32
            }
            _ => UNMEASURED_DRIFT_PPB,
        };
        self
    }
}

mod gpu {
    use ncclscope_proto::Gpu;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    /// As `[ordinal, "GPU-..."]`.
    pub fn serialize<S: Serializer>(gpu: &Option<Gpu>, s: S) -> Result<S::Ok, S::Error> {
        gpu.map(|g| (g.ordinal, g.uuid_text())).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Gpu>, D::Error> {
        let saved = Option::<(u32, String)>::deserialize(d)?;
        Ok(saved.and_then(|(ordinal, uuid)| Gpu::from_text(ordinal, &uuid)))
    }
}

/// A Coll/P2p captured into a CUDA graph: what its replayed instances are built from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CapturedOp {
    /// Stream position of its host event.
    pub pos: u64,
    /// Its `seq` made unique per function within the template: NCCL does not advance a captured
    /// collective's seqNumber unless KernelCh is in the mask, so several may share one.
    #[serde(flatten)]
    pub desc: Desc,
    /// Host time of its capture. A replay runs after its graph was captured and launched: a work item
    /// that started before this is not a replay of it (0 in states saved before it was kept: no bound).
    #[serde(default)]
    pub captured_ns: u64,
    /// The funcId its work items carried in the replays attributed so far (u32::MAX: they differed).
    /// A replayed operation runs the same device function every time: a work item with another
    /// funcId is not its.
    #[serde(default)]
    pub func_id: Option<u32>,
    /// A send's or receive's channels (a bit per channel: its round of NCCL's p2p schedule); None
    /// for a collective, which runs on channels 0..n_channels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub channels: Option<u64>,
    /// A receive fused with its round's send (captured just before it, in the same plan): that
    /// send's index in the template, whose work items on the channels they share are the receive's
    /// too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fused: Option<u32>,
}

/// Where the replays stand on one channel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplayCursor {
    /// Next position in the channel's captured operations; 0 between replays.
    pub pos: u32,
    /// Index of the current (or last) replay on the channel; 0 before the first.
    pub replay: u32,
    /// workCounter of the last item attributed to a replay.
    pub last_wc: u64,
}

/// One communicator's graph template as of the committed tail (the assembler's `Template`
/// without what it rebuilds on restore).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SavedTemplate {
    pub comm: u32,
    pub ops: Vec<CapturedOp>,
    /// (channel, cursor) of every channel the captured operations use.
    pub cursors: Vec<(u8, ReplayCursor)>,
    /// Work items at or after the committed tail that joined an eager operation starting before it:
    /// read again after a restart, they must not reach the cursors (their operation is not).
    #[serde(default)]
    pub eager_items: Vec<u64>,
    /// Work items at or after the committed tail dropped as ambiguous in a hold that began before it:
    /// read again after a restart, they are dropped again (the cursor is saved as the drop left it).
    #[serde(default)]
    pub ambiguous_items: Vec<u64>,
}

/// An operation in flight whose first record lies before the committed tail ("parked": see
/// `Assembler::park`), as of the read position `SegmentState::parked_upto`: its records from the
/// tail up to there are already in it; a restarted daemon continues it from here.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedOp {
    /// The plugin's operation id.
    pub id: u64,
    pub comm: u32,
    pub first_pos: u64,
    #[serde(flatten)]
    pub desc: Desc,
    pub enqueue_ns: u64,
    pub stop_ns: Option<u64>,
    /// (channel, GPU start, GPU stop) of the kernel work joined so far.
    pub channels: Vec<(u32, u64, u64)>,
    pub host_anchor: Option<i64>,
}

#[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SegmentState {
    /// The segment this belongs to (a reused file name with another owner is ignored).
    pub segment: String,
    /// Committed tail when written: the file is valid for a segment whose tail is this or later.
    pub tail: u64,
    pub dictionary: SavedDictionary,
    /// (operation id, position of its first record, sinks it was delivered to).
    pub delivered: Vec<(u64, u64, u8)>,
    /// The spool of the segment's job when this was written: whatever of the segment was spooled later
    /// lies past it (`None`: written without a spool, or by a daemon that did not record it).
    #[serde(default)]
    pub spool_mark: Option<Position>,
    /// Operations in flight that began before `tail` (absent when there are none, as in states
    /// written before they were kept).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parked: Vec<SavedOp>,
    /// Read position `parked` is as of: records before it are in them already.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub parked_upto: u64,
    /// What the tail passed unacknowledged (a forced commit) and was still in flight when this was
    /// written: a daemon killed now cannot send it again, so its successor counts it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub at_risk: AtRisk,
}

/// Spans and root spans whose records a segment's tail passed before the receiver acknowledged
/// them (counted once per root, by the first segment whose tail passed it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AtRisk {
    pub spans: u64,
    pub roots: u64,
}

fn is_zero<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

pub fn path(dir: &Path, segment: &str) -> PathBuf {
    dir.join(format!("{segment}.json"))
}

/// The state saved for `segment`, if any.
pub fn load(dir: &Path, segment: &str) -> io::Result<Option<SegmentState>> {
    let text = match std::fs::read(path(dir, segment)) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let state: SegmentState =
        serde_json::from_slice(&text).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    Ok((state.segment == segment).then_some(state))
}

/// Replaces the saved state atomically: written to a temporary file, synced, renamed over the
/// state. Durable once [`sync_dir`] has followed the rename.
pub fn store(dir: &Path, state: &SegmentState) -> io::Result<()> {
    let final_path = path(dir, &state.segment);
    let tmp = final_path.with_extension("json.tmp");
    // 0600 whatever the umask: a state names a user's job, communicators and strings.
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    f.write_all(&serde_json::to_vec(state).map_err(io::Error::other)?)?;
    f.sync_data()?;
    drop(f);
    std::fs::rename(&tmp, &final_path)
}

/// Makes the renames [`store`] did in `dir` durable: one sync for every state stored since the last.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

pub fn remove(dir: &Path, segment: &str) {
    let _ = std::fs::remove_file(path(dir, segment));
}

/// Segment names that have a state file (to clean up after segments that vanished meanwhile).
pub fn list(dir: &Path) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.filter_map(|e| {
        e.ok()?
            .file_name()
            .to_str()?
            .strip_suffix(".json")
            .map(str::to_string)
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ncclscope_proto::StrId;

    #[test]
    fn round_trip_and_owner_check() {
        let dir = tempfile::tempdir().unwrap();
        let s = SegmentState {
            segment: "p.1.2.3".into(),
            tail: 9,
            delivered: vec![(5, 10, 3)],
            ..Default::default()
        };
        store(dir.path(), &s).unwrap();
        let mode = std::fs::metadata(path(dir.path(), "p.1.2.3"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(
            mode & 0o777,
            0o600,
            "the daemon's alone, whatever the umask"
        );
        assert_eq!(load(dir.path(), "p.1.2.3").unwrap(), Some(s));
        assert_eq!(list(dir.path()), vec!["p.1.2.3".to_string()]);
        assert_eq!(load(dir.path(), "p.1.2.4").unwrap(), None);
        std::fs::write(path(dir.path(), "bad"), b"{").unwrap();
        assert!(load(dir.path(), "bad").is_err());
        remove(dir.path(), "p.1.2.3");
        assert_eq!(load(dir.path(), "p.1.2.3").unwrap(), None);
    }

    /// The file format, pinned: every field of every saved type, as a daemon of this version
    /// writes it and every earlier one (since the format last changed) reads it.
    const GOLDEN: &str = r#"{"segment":"ncclscope-job.0.41.7","tail":1024,"dictionary":{"strings":[[1,"AllReduce"],[2,"ncclFloat32"]],"func_names":[[42,3]],"calibrations":[[0,{"offset_ns":-1500,"error_ns":250}]],"comms":[{"comm":0,"comm_hash":2748,"rank":1,"nranks":2,"nnodes":1,"cuda_dev":0,"name":4,"device_hook":true,"ended":false,"ended_pos":0}],"templates":[{"comm":0,"ops":[{"pos":900,"seq":5,"is_p2p":false,"func":1,"datatype":2,"algo":5,"proto":6,"count":262144,"root":-1,"peer":-1,"n_channels":2,"captured_ns":1700000000000000000,"func_id":42}],"cursors":[[0,{"pos":0,"replay":3,"last_wc":77}],[1,{"pos":1,"replay":3,"last_wc":76}]],"eager_items":[1030],"ambiguous_items":[1040]}],"p2p_seqs":[[0,1,7,12]]},"delivered":[[2147549184,1000,3]],"spool_mark":{"seq":2,"offset":4096}}"#;

    #[test]
    fn a_saved_state_keeps_its_format() {
        let state = SegmentState {
            segment: "ncclscope-job.0.41.7".into(),
            tail: 1024,
            dictionary: SavedDictionary {
                strings: vec![(1, "AllReduce".into()), (2, "ncclFloat32".into())],
                func_names: vec![(42, 3)],
                calibrations: vec![(
                    0,
                    Calibration {
                        offset_ns: -1500,
                        error_ns: 250,
                        ..Default::default()
                    },
                )],
                comms: vec![CommInfo {
                    comm: 0,
                    comm_hash: 0xabc,
                    rank: 1,
                    nranks: 2,
                    nnodes: 1,
                    cuda_dev: 0,
                    name: 4,
                    device_hook: true,
                    ended: false,
                    ended_pos: 0,
                    gpu: None,
                }],
                templates: vec![SavedTemplate {
                    comm: 0,
                    ops: vec![CapturedOp {
                        channels: None,
                        fused: None,
                        pos: 900,
                        desc: Desc {
                            seq: 5,
                            is_p2p: false,
                            func: StrId(1),
                            datatype: StrId(2),
                            algo: StrId(5),
                            proto: StrId(6),
                            count: 1 << 18,
                            root: -1,
                            peer: -1,
                            n_channels: 2,
                        },
                        captured_ns: 1_700_000_000_000_000_000,
                        func_id: Some(42),
                    }],
                    cursors: vec![
                        (
                            0,
                            ReplayCursor {
                                pos: 0,
                                replay: 3,
                                last_wc: 77,
                            },
                        ),
                        (
                            1,
                            ReplayCursor {
                                pos: 1,
                                replay: 3,
                                last_wc: 76,
                            },
                        ),
                    ],
                    eager_items: vec![1030],
                    ambiguous_items: vec![1040],
                }],
                p2p_seqs: vec![(0, 1, 7, 12)],
                p2p_widths: vec![],
            },
            delivered: vec![(0x8001_0000, 1000, 3)],
            spool_mark: Some(Position {
                seq: 2,
                offset: 4096,
            }),
            parked: vec![],
            parked_upto: 0,
            at_risk: AtRisk::default(),
        };
        assert_eq!(serde_json::to_string(&state).unwrap(), GOLDEN);
        assert_eq!(serde_json::from_str::<SegmentState>(GOLDEN).unwrap(), state);
    }

    /// What was in flight behind the tail: added after the fields above, only when there is some.
    #[test]
    fn what_was_at_risk_keeps_its_format() {
        const AT_RISK: &str = r#"{"segment":"s.1.2.3","tail":50,"dictionary":{"strings":[],"func_names":[],"calibrations":[],"comms":[],"templates":[],"p2p_seqs":[]},"delivered":[],"spool_mark":null,"at_risk":{"spans":3,"roots":2}}"#;
        let state = SegmentState {
            segment: "s.1.2.3".into(),
            tail: 50,
            at_risk: AtRisk { spans: 3, roots: 2 },
            ..Default::default()
        };
        assert_eq!(serde_json::to_string(&state).unwrap(), AT_RISK);
        assert_eq!(
            serde_json::from_str::<SegmentState>(AT_RISK).unwrap(),
            state
        );
    }

    /// A communicator's GPU: added after the fields above, only where there is one (a state without
    /// one is written as before; a daemon before it ignores it).
    #[test]
    fn a_comms_gpu_keeps_its_format() {
        const COMM: &str = r#"{"comm":0,"comm_hash":1,"rank":0,"nranks":2,"nnodes":1,"cuda_dev":3,"name":0,"device_hook":false,"ended":false,"ended_pos":0,"gpu":[3,"GPU-5a5a5a5a-5a5a-5a5a-5a5a-5a5a5a5a5a5a"]}"#;
        let comm = CommInfo {
            comm: 0,
            comm_hash: 1,
            rank: 0,
            nranks: 2,
            nnodes: 1,
            cuda_dev: 3,
            name: 0,
            device_hook: false,
            ended: false,
            ended_pos: 0,
            gpu: Some(Gpu {
                ordinal: 3,
                uuid: [0x5a; 16],
            }),
        };
        assert_eq!(serde_json::to_string(&comm).unwrap(), COMM);
        assert_eq!(serde_json::from_str::<CommInfo>(COMM).unwrap(), comm);
    }

    /// Operations in flight before the tail: added after the fields above, only when there are some
    /// (so a state without them is written as before, and a daemon before them reads this one,
    /// ignoring them, as a state that only lacks the parked operations).
    #[test]
    fn parked_operations_keep_their_format() {
        const PARKED: &str = r#"{"segment":"s.1.2.3","tail":50,"dictionary":{"strings":[],"func_names":[],"calibrations":[],"comms":[],"templates":[],"p2p_seqs":[]},"delivered":[],"spool_mark":null,"parked":[{"id":7,"comm":0,"first_pos":40,"seq":3,"is_p2p":false,"func":1,"datatype":2,"algo":0,"proto":0,"count":16,"root":-1,"peer":-1,"n_channels":4,"enqueue_ns":100,"stop_ns":null,"channels":[[0,1000,1500],[2,1010,1490]],"host_anchor":-5}],"parked_upto":64}"#;
        let state = SegmentState {
            segment: "s.1.2.3".into(),
            tail: 50,
            parked: vec![SavedOp {
                id: 7,
                comm: 0,
                first_pos: 40,
                desc: Desc {
                    seq: 3,
                    func: StrId(1),
                    datatype: StrId(2),
                    count: 16,
                    root: -1,
                    peer: -1,
                    n_channels: 4,
                    ..Desc::default()
                },
                enqueue_ns: 100,
                stop_ns: None,
                channels: vec![(0, 1000, 1500), (2, 1010, 1490)],
                host_anchor: Some(-5),
            }],
            parked_upto: 64,
            ..SegmentState::default()
        };
        assert_eq!(serde_json::to_string(&state).unwrap(), PARKED);
        assert_eq!(serde_json::from_str::<SegmentState>(PARKED).unwrap(), state);
    }
}
