//! `ncclscope top`: a live view of the jobs on this node, refreshed from the daemon's API: per-rank
//! kernel time p50/p99, cross-rank skew, the current straggler, loss counters.
//!
//! On a terminal it is a full-screen view that opens a job into its communicators, a communicator
//! into its ranks and collectives, and a rank into its channels (from the daemon's live Watch
//! stream); rows sort by exec time, skew or losses and scroll; `?` lists the keys. Every column is
//! as wide as its widest value, and columns that do not fit are left out whole, so no value is ever
//! cut (80x24 included). A daemon that goes away (a restart) is shown and reconnected to, not fatal.
//! Off a terminal it prints one plain line per communicator per refresh, for logs.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ncclscope_proto::api::{Collective, ListJobsResponse, RankStats, StatsResponse, WatchRequest};
use ratatui::Frame;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Alignment, Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style, Stylize};
use ratatui::text::Line;
use ratatui::widgets::{Block, Cell, Clear, Paragraph, Row, Table, TableState};

use crate::api;
use crate::cli::stats::{fetch, shape, us};

#[derive(clap::Args)]
pub struct Args {
    /// Only this job (default: every job on this node); an error if the daemon has no such job.
    #[arg(long)]
    pub job: Option<String>,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 1.0)]
    pub interval: f64,
    /// Plain lines even on a terminal.
    #[arg(long)]
    pub plain: bool,
    /// Stop after this many refreshes (default: until quit).
    #[arg(long)]
    pub iterations: Option<u64>,
    /// The daemon's query API socket.
    #[arg(long, env = api::API_SOCKET_ENV, default_value = api::DEFAULT_API_SOCKET)]
    pub api_socket: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    // A worker thread drives the gRPC connections while `show` blocks on the runtime's handle.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let job = args.job.unwrap_or_default();
    // Once, up front: a wrong socket or a job that is not there is an error, not an empty screen
    // (later, a daemon that went away is a restart to wait out).
    rt.block_on(fetch(&args.api_socket, &job, !job.is_empty()))?;
    let opts = ViewOptions {
        job,
        interval: Duration::from_secs_f64(args.interval.max(0.1)),
        plain: args.plain || !std::io::stdout().is_terminal(),
        iterations: args.iterations,
    };
    show(
        rt.handle(),
        &args.api_socket,
        &opts,
        &AtomicBool::new(false),
    )
}

pub struct ViewOptions {
    /// Empty: every job.
    pub job: String,
    pub interval: Duration,
    pub plain: bool,
    pub iterations: Option<u64>,
}

/// How long one refresh waits for the daemon before it counts as unreachable.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs the view until the user quits, `iterations` refreshes were shown, or `stop` is set (the demo
/// sets it when its ranks are done). Blocking: call it off the async runtime, with its handle.
pub fn show(
    rt: &tokio::runtime::Handle,
    socket: &Path,
    opts: &ViewOptions,
    stop: &AtomicBool,
) -> anyhow::Result<()> {
    let mut view = View {
        open_job: Some(opts.job.clone()).filter(|j| !j.is_empty()),
        ..View::default()
    };
    let mut refreshes = 0u64;
    let mut terminal = if opts.plain {
        None
    } else {
        Some(ratatui::try_init()?)
    };
    let mut watch = Watch::default();
    let result = (|| -> anyhow::Result<()> {
        loop {
            let fetched = rt.block_on(async {
                tokio::time::timeout(FETCH_TIMEOUT, fetch(socket, &opts.job, false)).await
            });
            match fetched {
                Ok(Ok((jobs, stats))) => view.update(jobs, stats),
                Ok(Err(e)) => view.unreachable(&e),
                Err(_) => view.unreachable(&anyhow::anyhow!(
                    "no answer within {} s",
                    FETCH_TIMEOUT.as_secs()
                )),
            }
            refreshes += 1;
            match terminal.as_mut() {
                Some(t) => {
                    watch.follow(rt, socket, &view);
                    t.draw(|f| view.draw(f, socket))?;
                }
                None => {
                    for line in view.plain_lines() {
                        println!("{line}");
                    }
                }
            }
            if opts.iterations.is_some_and(|n| refreshes >= n) || stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            let deadline = Instant::now() + opts.interval;
            while let Some(left) = deadline.checked_duration_since(Instant::now()) {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let Some(t) = terminal.as_mut() else {
                    std::thread::sleep(left.min(Duration::from_millis(100)));
                    continue;
                };
                if event::poll(left.min(Duration::from_millis(100)))?
                    && let Event::Key(k) = event::read()?
                    && k.kind == KeyEventKind::Press
                {
                    let ctrl_c =
                        k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
                    if ctrl_c || view.key(k.code) == Action::Quit {
                        return Ok(());
                    }
                    watch.follow(rt, socket, &view);
                    t.draw(|f| view.draw(f, socket))?;
                }
            }
        }
    })();
    if terminal.is_some() {
        ratatui::restore();
    }
    result
}

/// The Watch stream behind the channel view: open while a communicator or one of its ranks is shown,
/// reopened after a daemon restart.
#[derive(Default)]
struct Watch {
    of: Option<(JobKey, u64)>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Watch {
    fn follow(&mut self, rt: &tokio::runtime::Handle, socket: &Path, view: &View) {
        let want = match &view.level {
            Level::Comm(job, comm) | Level::Rank(job, comm, _) => Some((job.clone(), *comm)),
            Level::Jobs | Level::Job(_) => None,
        };
        if want == self.of {
            return;
        }
        if let Some(t) = self.task.take() {
            t.abort();
        }
        *view.channels.lock().unwrap_or_else(|e| e.into_inner()) = Channels::default();
        self.of = want.clone();
        let Some(((uid, job_id), comm)) = want else {
            return;
        };
        let (socket, into) = (socket.to_path_buf(), view.channels.clone());
        self.task = Some(rt.spawn(async move {
            loop {
                if let Ok(mut client) = api::connect(&socket).await {
                    let req = WatchRequest {
                        job_id: job_id.clone(),
                        uid: Some(uid),
                    };
                    if let Ok(stream) = client.watch(req).await {
                        let mut stream = stream.into_inner();
                        while let Ok(Some(c)) = stream.message().await {
                            if c.comm_hash == comm {
                                into.lock().unwrap_or_else(|e| e.into_inner()).add(&c);
                            }
                        }
                    }
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }));
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

/// Samples per channel kept for its percentiles.
const CHANNEL_SAMPLES: usize = 512;

/// Per (rank, channel) of the watched communicator: what its kernel work took, from the instances
/// seen since the view opened it.
#[derive(Debug, Default)]
pub struct Channels {
    by: BTreeMap<(u32, u32), ChannelSeries>,
}

#[derive(Debug, Default)]
struct ChannelSeries {
    instances: u64,
    work_items: u64,
    /// (kernel time, start after the instance's first channel), ns; the newest [`CHANNEL_SAMPLES`].
    recent: VecDeque<(u64, u64)>,
}

impl Channels {
    pub fn add(&mut self, c: &Collective) {
        let first = c
            .channels
            .iter()
            .map(|w| w.start_unix_ns)
            .min()
            .unwrap_or(0);
        for w in &c.channels {
            let s = self.by.entry((c.rank, w.channel)).or_default();
            s.instances += 1;
            s.work_items += u64::from(w.work_items);
            if s.recent.len() == CHANNEL_SAMPLES {
                s.recent.pop_front();
            }
            s.recent.push_back((
                w.end_unix_ns.saturating_sub(w.start_unix_ns),
                w.start_unix_ns.saturating_sub(first),
            ));
        }
    }
}

/// The value at quantile `q` of `v` (sorted here), in microseconds; NaN when empty.
fn quantile_us(mut v: Vec<u64>, q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_unstable();
    v[((v.len() - 1) as f64 * q).round() as usize] as f64 / 1000.0
}

/// A duration given in microseconds, in at most 8 characters: "213.0us", "3.15ms", "12.30s".
fn dur(us: f64) -> String {
    if us.is_nan() {
        "-".into()
    } else if us < 1000.0 {
        format!("{us:.1}us")
    } else if us < 1e6 {
        format!("{:.2}ms", us / 1e3)
    } else {
        format!("{:.2}s", us / 1e6)
    }
}

/// A job: the uid that ran it and its id.
type JobKey = (u32, String);

/// Where the view is: the jobs, one job's communicators, one communicator's ranks and collectives,
/// one rank's channels.
#[derive(Clone, Debug, Default, PartialEq)]
enum Level {
    #[default]
    Jobs,
    Job(JobKey),
    Comm(JobKey, u64),
    Rank(JobKey, u64, u32),
}

/// What a row stands for (kept across refreshes, so the selection follows its row when rows reorder).
#[derive(Clone, Debug, PartialEq)]
enum Key {
    Job(JobKey),
    Comm(u64),
    Rank(u32),
    Channel(u32),
    /// A rank's sends to or receives from one peer (not opened further).
    Peer,
}

/// Row order: as the daemon lists them, or the largest first.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Sort {
    #[default]
    Name,
    Exec,
    Skew,
    Lost,
}

impl Sort {
    fn next(self) -> Sort {
        match self {
            Sort::Name => Sort::Exec,
            Sort::Exec => Sort::Skew,
            Sort::Skew => Sort::Lost,
            Sort::Lost => Sort::Name,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Sort::Name => "name",
            Sort::Exec => "exec time",
            Sort::Skew => "skew",
            Sort::Lost => "losses",
        }
    }
}

/// What a key asks of the view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Quit,
    Stay,
}

/// A column: its header, whether its values are numbers (right-aligned), and how long it stays when
/// the screen is narrow (higher stays longer; the first column always stays).
struct Col {
    name: &'static str,
    right: bool,
    keep: u8,
}

const fn col(name: &'static str, right: bool, keep: u8) -> Col {
    Col { name, right, keep }
}

/// One row of a table with what it sorts by.
struct Item {
    key: Key,
    cells: Vec<String>,
    exec: f64,
    skew: f64,
    lost: u64,
    straggler: bool,
}

/// Whether the daemon answered the last refresh; since when it has not.
struct Unreachable {
    since: String,
    error: String,
}

/// The straggler of one communicator in the last refresh interval.
#[derive(Clone, Debug, PartialEq)]
pub struct Straggler {
    pub uid: u32,
    pub job_id: String,
    pub comm_hash: u64,
    pub rank: u32,
    /// Collectives in the window in which this rank was the last to start, and the window's total.
    pub last_to_start: u64,
    pub of: u64,
    pub skew_p50_us: f64,
}

/// Refreshes over which the current straggler is judged: long enough to smooth out a rank that was
/// late once, short enough to follow a change within seconds.
const WINDOW: usize = 10;

/// (uid, job, communicator, rank) -> (times last to start, collectives), as of one refresh.
type Counts = HashMap<(u32, String, u64, u32), (u64, u64)>;

/// What the view shows: the latest snapshots, the stragglers computed from the change over the last
/// [`WINDOW`] refreshes (so "current" means the last few seconds, not the whole job), and where the
/// user is.
#[derive(Default)]
pub struct View {
    pub jobs: ListJobsResponse,
    pub stats: StatsResponse,
    history: VecDeque<Counts>,
    pub stragglers: Vec<Straggler>,
    level: Level,
    sort: Sort,
    selected: usize,
    selected_key: Option<Key>,
    table: TableState,
    /// Rows the main table showed at the last draw (a page for PageUp/PageDown).
    page: usize,
    help: bool,
    /// `--job`: opened as soon as the daemon lists it.
    open_job: Option<String>,
    unreachable: Option<Unreachable>,
    channels: Arc<Mutex<Channels>>,
}

impl View {
    pub fn update(&mut self, jobs: ListJobsResponse, stats: StatsResponse) {
        let mut best: HashMap<(u32, String, u64), Straggler> = HashMap::new();
        let mut totals: HashMap<(u32, String, u64), u64> = HashMap::new();
        for r in &stats.ranks {
            let key = (r.uid, r.job_id.clone(), r.comm_hash, r.rank);
            let (prev_last, prev_colls) = self
                .history
                .front()
                .and_then(|h| h.get(&key).copied())
                .unwrap_or((0, 0));
            let d_last = r.straggler_count.saturating_sub(prev_last);
            let d_colls = r.collectives.saturating_sub(prev_colls);
            let comm = (r.uid, r.job_id.clone(), r.comm_hash);
            let total = totals.entry(comm.clone()).or_default();
            *total = (*total).max(d_colls);
            if d_last > 0 && best.get(&comm).is_none_or(|b| d_last > b.last_to_start) {
                best.insert(
                    comm,
                    Straggler {
                        uid: r.uid,
                        job_id: r.job_id.clone(),
                        comm_hash: r.comm_hash,
                        rank: r.rank,
                        last_to_start: d_last,
                        of: 0,
                        skew_p50_us: r.skew_p50_us,
                    },
                );
            }
        }
        // Idle communicators keep their last straggler; active ones get the new one.
        let mut stragglers: Vec<Straggler> =
            self.stragglers
                .drain(..)
                .filter(|s| !best.contains_key(&(s.uid, s.job_id.clone(), s.comm_hash)))
                .filter(|s| {
                    stats.ranks.iter().any(|r| {
                        r.uid == s.uid && r.job_id == s.job_id && r.comm_hash == s.comm_hash
                    })
                })
                .collect();
        for (comm, mut s) in best {
            s.of = totals[&comm].max(s.last_to_start);
            stragglers.push(s);
        }
        stragglers
            .sort_by(|a, b| (a.uid, &a.job_id, a.comm_hash).cmp(&(b.uid, &b.job_id, b.comm_hash)));
        let now: Counts = stats
            .ranks
            .iter()
            .map(|r| {
                (
                    (r.uid, r.job_id.clone(), r.comm_hash, r.rank),
                    (r.straggler_count, r.collectives),
                )
            })
            .collect();
        self.history.push_back(now);
        if self.history.len() > WINDOW {
            self.history.pop_front();
        }
        self.stragglers = stragglers;
        self.jobs = jobs;
        self.stats = stats;
        self.unreachable = None;
        if self.level == Level::Jobs
            && let Some(job) = self.open_job.take()
        {
            let keys: Vec<JobKey> = self.job_keys().into_iter().filter(|k| k.1 == job).collect();
            match keys.as_slice() {
                [one] => self.level = Level::Job(one.clone()),
                // Not listed yet (demo starts before its ranks register); several uids: pick one.
                [] => self.open_job = Some(job),
                _ => {}
            }
        }
    }

    fn straggler_of(&self, r: &RankStats) -> bool {
        self.stragglers.iter().any(|s| {
            (s.uid, &s.job_id, s.comm_hash, s.rank) == (r.uid, &r.job_id, r.comm_hash, r.rank)
        })
    }

    /// One line per communicator: what `top` prints when not on a terminal.
    pub fn plain_lines(&self) -> Vec<String> {
        let now = utc_hms();
        if let Some(u) = &self.unreachable {
            return vec![format!(
                "{now} daemon unreachable since {}, reconnecting: {}",
                u.since, u.error
            )];
        }
        let mut lines = Vec::new();
        let mut comms: Vec<(u32, &str, u64)> = self
            .stats
            .ranks
            .iter()
            .map(|r| (r.uid, r.job_id.as_str(), r.comm_hash))
            .collect();
        comms.dedup();
        for (uid, job, comm) in comms {
            let ranks: Vec<&RankStats> = self
                .stats
                .ranks
                .iter()
                .filter(|r| (r.uid, r.job_id.as_str(), r.comm_hash) == (uid, job, comm))
                .collect();
            let colls: u64 = ranks.iter().map(|r| r.collectives).max().unwrap_or(0);
            let p50 = ranks.iter().map(|r| r.exec_p50_us).fold(f64::NAN, f64::min);
            let p99 = ranks.iter().map(|r| r.exec_p99_us).fold(f64::NAN, f64::max);
            let lost: u64 = ranks.iter().map(|r| r.lost).sum();
            let straggler = match self
                .stragglers
                .iter()
                .find(|s| (s.uid, s.job_id.as_str(), s.comm_hash) == (uid, job, comm))
            {
                Some(s) => format!(
                    "straggler rank {} (last to start in {}/{} recent, skew p50 {})",
                    s.rank,
                    s.last_to_start,
                    s.of,
                    us(s.skew_p50_us)
                ),
                None => "no straggler".to_string(),
            };
            lines.push(format!(
                "{now} job {job} comm {comm:016x}: {} ranks, {colls} collectives, exec p50 {} p99 {}, {straggler}, lost {lost}",
                ranks.len(),
                us(p50),
                us(p99)
            ));
        }
        if lines.is_empty() {
            lines.push(format!("{now} no collectives yet"));
        }
        lines
    }

    /// The daemon did not answer: shown in the header until it does again.
    pub fn unreachable(&mut self, e: &anyhow::Error) {
        let since = match self.unreachable.take() {
            Some(u) => u.since,
            None => utc_hms(),
        };
        self.unreachable = Some(Unreachable {
            since,
            error: e.root_cause().to_string(),
        });
    }

    /// Every job, as the daemon lists them, then any only the statistics still hold.
    fn job_keys(&self) -> Vec<JobKey> {
        let mut keys: Vec<JobKey> = (self.jobs.jobs.iter())
            .map(|j| (j.uid, j.job_id.clone()))
            .collect();
        for r in &self.stats.ranks {
            if !keys.iter().any(|k| k.0 == r.uid && k.1 == r.job_id) {
                keys.push((r.uid, r.job_id.clone()));
            }
        }
        keys
    }

    fn ranks_of<'a>(&'a self, job: &'a JobKey) -> impl Iterator<Item = &'a RankStats> + 'a {
        (self.stats.ranks.iter()).filter(move |r| r.uid == job.0 && r.job_id == job.1)
    }

    fn straggler_in(&self, job: &JobKey, comm: Option<u64>) -> Option<&Straggler> {
        self.stragglers.iter().find(|s| {
            (s.uid, &s.job_id) == (job.0, &job.1) && comm.is_none_or(|c| c == s.comm_hash)
        })
    }

    /// The current table's columns and rows, in the chosen order.
    fn items(&self) -> (Vec<Col>, Vec<Item>) {
        let max = |v: &mut dyn Iterator<Item = f64>| v.fold(f64::NAN, f64::max);
        let (cols, mut items) = match &self.level {
            Level::Jobs => {
                let cols = vec![
                    col("JOB", false, 9),
                    col("UID", true, 1),
                    col("STATE", false, 4),
                    col("RANKS", true, 6),
                    col("COMMS", true, 5),
                    col("COLLS", true, 7),
                    col("EXEC p50", true, 8),
                    col("SKEW p50", true, 8),
                    col("LOST", true, 7),
                ];
                let items: Vec<Item> = (self.job_keys().into_iter())
                    .map(|key| {
                        let job =
                            (self.jobs.jobs.iter()).find(|j| (j.uid, &j.job_id) == (key.0, &key.1));
                        let ranks: Vec<&RankStats> = self.ranks_of(&key).collect();
                        let (comms, nranks) = shape(job, &self.stats.ranks, key.0, &key.1);
                        let colls = job.map_or(0, |j| j.collectives);
                        let exec = max(&mut ranks.iter().map(|r| r.exec_p50_us));
                        let skew = max(&mut ranks.iter().map(|r| r.skew_p50_us));
                        let lost: u64 = ranks.iter().map(|r| r.lost).sum();
                        let live = job.is_some_and(|j| j.live);
                        Item {
                            cells: vec![
                                key.1.clone(),
                                key.0.to_string(),
                                if live { "live" } else { "ended" }.into(),
                                nranks.to_string(),
                                comms.to_string(),
                                colls.to_string(),
                                dur(exec),
                                dur(skew),
                                lost.to_string(),
                            ],
                            key: Key::Job(key),
                            exec,
                            skew,
                            lost,
                            straggler: false,
                        }
                    })
                    .collect();
                (cols, items)
            }
            Level::Job(job) => {
                let cols = vec![
                    col("COMM", false, 9),
                    col("NAME", false, 1),
                    col("RANKS", true, 6),
                    col("COLLS", true, 7),
                    col("EXEC p50", true, 8),
                    col("EXEC p99", true, 5),
                    col("SKEW p50", true, 8),
                    col("STRAGGLER", false, 6),
                    col("LOST", true, 7),
                ];
                let listed = (self.jobs.jobs.iter())
                    .find(|j| (j.uid, &j.job_id) == (job.0, &job.1))
                    .map(|j| j.communicators.as_slice())
                    .unwrap_or_default();
                let mut hashes: Vec<u64> = listed.iter().map(|c| c.comm_hash).collect();
                for r in self.ranks_of(job) {
                    if !hashes.contains(&r.comm_hash) {
                        hashes.push(r.comm_hash);
                    }
                }
                let items: Vec<Item> = (hashes.into_iter())
                    .map(|comm| {
                        let ranks: Vec<&RankStats> =
                            self.ranks_of(job).filter(|r| r.comm_hash == comm).collect();
                        let name = (listed.iter())
                            .find(|c| c.comm_hash == comm && !c.name.is_empty())
                            .map_or("-", |c| c.name.as_str());
                        let exec = max(&mut ranks.iter().map(|r| r.exec_p50_us));
                        let skew = max(&mut ranks.iter().map(|r| r.skew_p50_us));
                        let lost: u64 = ranks.iter().map(|r| r.lost).sum();
                        Item {
                            cells: vec![
                                format!("{comm:016x}"),
                                name.to_string(),
                                ranks.len().to_string(),
                                ranks
                                    .iter()
                                    .map(|r| r.collectives)
                                    .max()
                                    .unwrap_or(0)
                                    .to_string(),
                                dur(exec),
                                dur(max(&mut ranks.iter().map(|r| r.exec_p99_us))),
                                dur(skew),
                                self.straggler_in(job, Some(comm))
                                    .map_or("-".into(), |s| format!("rank {}", s.rank)),
                                lost.to_string(),
                            ],
                            key: Key::Comm(comm),
                            exec,
                            skew,
                            lost,
                            straggler: false,
                        }
                    })
                    .collect();
                (cols, items)
            }
            Level::Comm(job, comm) => {
                let cols = vec![
                    col("RANK", true, 9),
                    col("COLLS", true, 6),
                    col("EXEC p50", true, 8),
                    col("EXEC p99", true, 5),
                    col("SKEW p50", true, 8),
                    col("LAST", true, 4),
                    col("LOST", true, 7),
                    col("", false, 3),
                ];
                let items: Vec<Item> = (self.ranks_of(job).filter(|r| r.comm_hash == *comm))
                    .map(|r| {
                        let straggler = self.straggler_of(r);
                        Item {
                            cells: vec![
                                r.rank.to_string(),
                                r.collectives.to_string(),
                                dur(r.exec_p50_us),
                                dur(r.exec_p99_us),
                                dur(r.skew_p50_us),
                                r.straggler_count.to_string(),
                                r.lost.to_string(),
                                if straggler { "◀ straggler" } else { "" }.into(),
                            ],
                            key: Key::Rank(r.rank),
                            exec: r.exec_p50_us,
                            skew: r.skew_p50_us,
                            lost: r.lost,
                            straggler,
                        }
                    })
                    .collect();
                (cols, items)
            }
            Level::Rank(_, _, rank) => {
                let cols = vec![
                    col("CHANNEL", true, 9),
                    col("INSTANCES", true, 6),
                    col("WORK/INST", true, 3),
                    col("KERNEL p50", true, 8),
                    col("KERNEL p99", true, 5),
                    col("START p50", true, 7),
                ];
                let channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
                let mut items: Vec<Item> = (channels.by.range((*rank, 0)..=(*rank, u32::MAX)))
                    .map(|(&(_, ch), s)| {
                        let exec = quantile_us(s.recent.iter().map(|x| x.0).collect(), 0.5);
                        let skew = quantile_us(s.recent.iter().map(|x| x.1).collect(), 0.5);
                        Item {
                            cells: vec![
                                ch.to_string(),
                                s.instances.to_string(),
                                format!("{:.1}", s.work_items as f64 / s.instances.max(1) as f64),
                                dur(exec),
                                dur(quantile_us(s.recent.iter().map(|x| x.0).collect(), 0.99)),
                                format!("+{}", dur(skew)),
                            ],
                            key: Key::Channel(ch),
                            exec,
                            skew,
                            lost: 0,
                            straggler: false,
                        }
                    })
                    .collect();
                // Its sends and receives per peer, below the channels: "Send→3" in the first
                // column, transfers as instances, exec times as kernel times.
                let (job, comm) = match &self.level {
                    Level::Rank(job, comm, _) => (job, *comm),
                    _ => unreachable!("in the rank level"),
                };
                let peers = (self.stats.p2p.iter()).filter(|p| {
                    (p.uid, &p.job_id, p.comm_hash, p.rank) == (job.0, &job.1, comm, *rank)
                });
                items.extend(peers.map(|p| {
                    // Host-timed transfers have no exec time: "-", not 0.
                    let exec = |v: f64| (p.device_timed > 0).then_some(v);
                    Item {
                        cells: vec![
                            format!(
                                "{}{}{}",
                                p.func,
                                if p.func == "Send" { "→" } else { "←" },
                                p.peer
                            ),
                            p.transfers.to_string(),
                            "-".into(),
                            exec(p.exec_p50_us).map_or("-".into(), dur),
                            exec(p.exec_p99_us).map_or("-".into(), dur),
                            "-".into(),
                        ],
                        key: Key::Peer,
                        exec: exec(p.exec_p50_us).unwrap_or(f64::NAN),
                        skew: f64::NAN,
                        lost: 0,
                        straggler: false,
                    }
                }));
                (cols, items)
            }
        };
        let desc = |v: f64| if v.is_nan() { f64::NEG_INFINITY } else { -v };
        match self.sort {
            Sort::Name => {}
            Sort::Exec => items.sort_by(|a, b| desc(a.exec).total_cmp(&desc(b.exec))),
            Sort::Skew => items.sort_by(|a, b| desc(a.skew).total_cmp(&desc(b.skew))),
            Sort::Lost => items.sort_by_key(|i| std::cmp::Reverse(i.lost)),
        }
        (cols, items)
    }

    /// Handles a key; `Quit` when the view should end.
    pub fn key(&mut self, code: KeyCode) -> Action {
        if self.help {
            // Any key closes the help; q still quits.
            self.help = false;
            return if code == KeyCode::Char('q') {
                Action::Quit
            } else {
                Action::Stay
            };
        }
        let (_, items) = self.items();
        let last = items.len().saturating_sub(1);
        let page = self.page.max(1);
        match code {
            KeyCode::Char('q') => return Action::Quit,
            KeyCode::Esc if self.level == Level::Jobs => return Action::Quit,
            KeyCode::Char('?') => self.help = true,
            KeyCode::Char('s') => self.sort = self.sort.next(),
            KeyCode::Esc | KeyCode::Backspace | KeyCode::Left | KeyCode::Char('h') => self.up(),
            KeyCode::Enter | KeyCode::Right | KeyCode::Char('l') => {
                if let Some(item) = items.get(self.selected) {
                    self.open(item.key.clone());
                }
                return Action::Stay;
            }
            KeyCode::Up | KeyCode::Char('k') => self.selected = self.selected.saturating_sub(1),
            KeyCode::Down | KeyCode::Char('j') => self.selected = (self.selected + 1).min(last),
            KeyCode::PageUp => self.selected = self.selected.saturating_sub(page),
            KeyCode::PageDown => self.selected = (self.selected + page).min(last),
            KeyCode::Home | KeyCode::Char('g') => self.selected = 0,
            KeyCode::End | KeyCode::Char('G') => self.selected = last,
            _ => return Action::Stay,
        }
        if !matches!(
            code,
            KeyCode::Esc | KeyCode::Backspace | KeyCode::Left | KeyCode::Char('h')
        ) {
            self.selected_key = items.get(self.selected).map(|i| i.key.clone());
        }
        Action::Stay
    }

    fn open(&mut self, key: Key) {
        self.level = match (&self.level, key) {
            (Level::Jobs, Key::Job(job)) => Level::Job(job),
            (Level::Job(job), Key::Comm(comm)) => Level::Comm(job.clone(), comm),
            (Level::Comm(job, comm), Key::Rank(rank)) => Level::Rank(job.clone(), *comm, rank),
            _ => return,
        };
        self.selected = 0;
        self.selected_key = None;
        self.table = TableState::default();
    }

    /// One level up, with the row just left selected.
    fn up(&mut self) {
        let (level, key) = match &self.level {
            Level::Jobs => return,
            Level::Job(job) => (Level::Jobs, Key::Job(job.clone())),
            Level::Comm(job, comm) => (Level::Job(job.clone()), Key::Comm(*comm)),
            Level::Rank(job, comm, rank) => (Level::Comm(job.clone(), *comm), Key::Rank(*rank)),
        };
        self.level = level;
        self.selected_key = Some(key);
        self.table = TableState::default();
    }

    pub fn draw(&mut self, f: &mut Frame, socket: &Path) {
        let area = f.area();
        let width = area.width as usize;
        let [head, path, main, foot] = Layout::vertical([
            Constraint::Length(1),
            Constraint::Length(1),
            Constraint::Min(3),
            Constraint::Length(2),
        ])
        .areas(area);
        let health = self.stats.health.clone().unwrap_or_default();
        let header = match &self.unreachable {
            Some(u) => Line::from(fit_line(
                &[
                    format!("daemon unreachable since {}, reconnecting", u.since),
                    u.error.clone(),
                ],
                width,
            ))
            .style(Style::new().fg(Color::Red).add_modifier(Modifier::BOLD)),
            None => Line::from(fit_line(
                &[
                    "ncclscope top".into(),
                    format!("segments {}", health.segments),
                    format!("lost {}", health.lost.values().sum::<u64>()),
                    format!("records {}", health.records_in),
                    format!("spans exported {}", health.spans_exported),
                    socket.display().to_string(),
                ],
                width,
            ))
            .bold(),
        };
        f.render_widget(header, head);

        let here = match &self.level {
            Level::Jobs => "jobs".to_string(),
            Level::Job(j) => format!("job {}", j.1),
            Level::Comm(j, c) => format!("job {} ▸ comm {c:016x}", j.1),
            Level::Rank(j, c, r) => format!("job {} ▸ comm {c:016x} ▸ rank {r}", j.1),
        };
        f.render_widget(
            Line::from(fit_line(
                &[
                    here,
                    format!("sort: {} (s)", self.sort.label()),
                    "? keys".into(),
                ],
                width,
            )),
            path,
        );

        let (cols, items) = self.items();
        if let Some(key) = &self.selected_key
            && let Some(i) = items.iter().position(|i| &i.key == key)
        {
            self.selected = i;
        }
        self.selected = self.selected.min(items.len().saturating_sub(1));
        self.selected_key = items.get(self.selected).map(|i| i.key.clone());
        self.table
            .select((!items.is_empty()).then_some(self.selected));
        let (main, colls_area) = match &self.level {
            Level::Comm(job, comm) => {
                let colls: Vec<_> = (self.stats.colls.iter())
                    .filter(|c| (c.uid, &c.job_id, c.comm_hash) == (job.0, &job.1, *comm))
                    .collect();
                let h = (colls.len() as u16 + 3).min(main.height / 2).max(3);
                let [ranks, below] =
                    Layout::vertical([Constraint::Min(3), Constraint::Length(h)]).areas(main);
                (ranks, Some((below, colls)))
            }
            _ => (main, None),
        };
        let title = match &self.level {
            Level::Jobs => " jobs ".to_string(),
            Level::Job(_) => " communicators ".to_string(),
            Level::Comm(..) => " ranks: kernel time, start skew, times last to start ".to_string(),
            Level::Rank(..) if items.is_empty() => {
                " channels: waiting for collectives ".to_string()
            }
            Level::Rank(..) => " channels, since opened ".to_string(),
        };
        self.page = main.height.saturating_sub(3) as usize;
        let rows: Vec<(Vec<String>, Style)> = (items.iter())
            .map(|i| {
                let style = if i.straggler {
                    Style::new().fg(Color::Red).add_modifier(Modifier::BOLD)
                } else {
                    Style::new()
                };
                (i.cells.clone(), style)
            })
            .collect();
        let main_table = fitted_table(
            &cols,
            &rows,
            main.width.saturating_sub(2 + SELECTED.len() as u16),
            &title,
        )
        .row_highlight_style(Style::new().add_modifier(Modifier::REVERSED))
        .highlight_symbol(SELECTED);
        f.render_stateful_widget(main_table, main, &mut self.table);
        if let Some((area, mut colls)) = colls_area {
            let cols = [
                col("COLLECTIVE", false, 9),
                col("SIZE", false, 7),
                col("COUNT", true, 6),
                col("EXEC p50", true, 8),
                col("EXEC p99", true, 5),
                col("BUSBW p50", true, 4),
            ];
            if self.sort == Sort::Exec {
                colls.sort_by(|a, b| b.exec_p50_us.total_cmp(&a.exec_p50_us));
            }
            let shown = area.height.saturating_sub(3) as usize;
            let rows: Vec<(Vec<String>, Style)> = (colls.iter().take(shown))
                .map(|c| {
                    let cells = vec![
                        c.func.clone(),
                        c.size_bucket.clone(),
                        c.count.to_string(),
                        dur(c.exec_p50_us),
                        dur(c.exec_p99_us),
                        format!("{:.1}GB/s", c.busbw_p50_gbs),
                    ];
                    (cells, Style::new())
                })
                .collect();
            let title = match colls.len().saturating_sub(shown) {
                0 => " collectives ".to_string(),
                more => format!(" collectives ({more} more) "),
            };
            f.render_widget(
                fitted_table(&cols, &rows, area.width.saturating_sub(2), &title),
                area,
            );
        }

        let straggler = match &self.level {
            Level::Jobs => self.stragglers.first(),
            Level::Job(j) => self.straggler_in(j, None),
            Level::Comm(j, c) | Level::Rank(j, c, _) => self.straggler_in(j, Some(*c)),
        };
        let straggler = match straggler {
            Some(s) => Line::from(fit_line(
                &[
                    format!("STRAGGLER rank {}", s.rank),
                    format!("last to start in {} of the last {}", s.last_to_start, s.of),
                    format!("skew p50 {}", dur(s.skew_p50_us)),
                    format!("comm {:016x}", s.comm_hash),
                    format!("job {}", s.job_id),
                ],
                width,
            ))
            .style(Style::new().fg(Color::Red).add_modifier(Modifier::BOLD)),
            None => Line::from("no straggler"),
        };
        let keys = fit_line(
            &[
                "q quit".into(),
                "? keys".into(),
                "↑↓ select".into(),
                "⏎ open".into(),
                "⌫ back".into(),
                "s sort".into(),
                format!("export errors {}", health.export_errors),
            ],
            width,
        );
        f.render_widget(Paragraph::new(vec![straggler, Line::from(keys)]), foot);
        if self.help {
            draw_help(f, area);
        }
    }
}

/// The mark before the selected row.
const SELECTED: &str = "▶ ";

/// The keys, over the view.
fn draw_help(f: &mut Frame, area: Rect) {
    let lines = [
        "↑ ↓  j k      select a row",
        "PgUp PgDn     a page up or down",
        "Home End g G  first, last row",
        "Enter → l     open: a job's communicators,",
        "              a communicator's ranks and",
        "              collectives, a rank's channels",
        "Bksp ← h Esc  back up one level",
        "s             sort: name, exec time, skew, losses",
        "?             these keys (any key closes)",
        "q  Ctrl-C     quit (Esc at the top, too)",
    ];
    let w = (lines.iter().map(|l| l.chars().count()).max().unwrap_or(0) as u16 + 4).min(area.width);
    let h = (lines.len() as u16 + 2).min(area.height);
    let r = Rect {
        x: area.x + (area.width - w) / 2,
        y: area.y + (area.height - h) / 2,
        width: w,
        height: h,
    };
    f.render_widget(Clear, r);
    f.render_widget(
        Paragraph::new(
            lines
                .iter()
                .map(|l| Line::from(format!(" {l}")))
                .collect::<Vec<_>>(),
        )
        .block(Block::bordered().title(" keys ")),
        r,
    );
}

/// A bordered table whose columns fit `width` cells: each as wide as its widest value or header;
/// while they do not fit, the column kept least long is left out whole (never the first).
fn fitted_table<'a>(
    cols: &[Col],
    rows: &[(Vec<String>, Style)],
    width: u16,
    title: &str,
) -> Table<'a> {
    let widths: Vec<u16> = (cols.iter().enumerate())
        .map(|(i, c)| {
            (rows.iter().map(|r| r.0[i].chars().count()))
                .chain([c.name.chars().count()])
                .max()
                .unwrap_or(0) as u16
        })
        .collect();
    let mut shown: Vec<usize> = (0..cols.len()).collect();
    let total = |shown: &[usize]| -> u16 {
        shown.iter().map(|&i| widths[i]).sum::<u16>() + shown.len().saturating_sub(1) as u16
    };
    while total(&shown) > width && shown.len() > 1 {
        let least = (shown.iter().skip(1).copied())
            .min_by_key(|&i| (cols[i].keep, std::cmp::Reverse(i)))
            .expect("more than one column");
        shown.retain(|&i| i != least);
    }
    let cell = |i: usize, text: String| {
        let line = Line::from(text);
        Cell::from(if cols[i].right {
            line.alignment(Alignment::Right)
        } else {
            line
        })
    };
    let header = Row::new(shown.iter().map(|&i| cell(i, cols[i].name.to_string())))
        .style(Style::new().add_modifier(Modifier::BOLD));
    let body: Vec<Row> = (rows.iter())
        .map(|(cells, style)| {
            Row::new(shown.iter().map(|&i| cell(i, cells[i].clone()))).style(*style)
        })
        .collect();
    Table::new(body, shown.iter().map(|&i| Constraint::Length(widths[i])))
        .header(header)
        .column_spacing(1)
        .block(Block::bordered().title(title.to_string()))
}

/// `parts` joined by two spaces, each whole or not at all, within `width` cells.
fn fit_line(parts: &[String], width: usize) -> String {
    let mut out = String::new();
    let mut used = 0;
    for p in parts {
        let n = p.chars().count() + if used == 0 { 0 } else { 2 };
        if used + n <= width {
            if used > 0 {
                out.push_str("  ");
            }
            out.push_str(p);
            used += n;
        }
    }
    out
}

/// UTC wall-clock time as HH:MM:SS for the plain lines (`top`'s and `cluster`'s).
pub fn utc_hms() -> String {
    let secs = ncclscope_proto::now_ns() / 1_000_000_000;
    format!(
        "{:02}:{:02}:{:02}",
        secs / 3600 % 24,
        secs / 60 % 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use ncclscope_proto::api::Job;
    use ratatui::Terminal;
    use ratatui::backend::TestBackend;

    fn ranks(colls: u64, last: [u64; 4]) -> StatsResponse {
        StatsResponse {
            ranks: (0..4)
                .map(|rank| RankStats {
                    job_id: "j".into(),
                    comm_hash: 1,
                    rank,
                    collectives: colls,
                    straggler_count: last[rank as usize],
                    skew_p50_us: 10.0 * f64::from(rank),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn the_current_straggler_is_the_rank_last_to_start_in_the_last_interval() {
        let mut v = View::default();
        // Over the whole job rank 1 was last most often, but in the last interval rank 3 was.
        v.update(ListJobsResponse::default(), ranks(100, [0, 90, 0, 10]));
        assert_eq!(v.stragglers[0].rank, 1);
        v.update(ListJobsResponse::default(), ranks(150, [0, 92, 0, 58]));
        assert_eq!(
            (
                v.stragglers[0].rank,
                v.stragglers[0].last_to_start,
                v.stragglers[0].of
            ),
            (3, 48, 50)
        );
        // No new collectives: the last straggler stays.
        v.update(ListJobsResponse::default(), ranks(150, [0, 92, 0, 58]));
        assert_eq!(v.stragglers[0].rank, 3);
        assert!(
            v.plain_lines()[0].contains("straggler rank 3 (last to start in 48/50 recent"),
            "{:?}",
            v.plain_lines()
        );
    }

    /// The screen as lines of text.
    fn screen(v: &mut View, w: u16, h: u16) -> Vec<String> {
        let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
        t.draw(|f| v.draw(f, Path::new("/run/ncclscope/api.sock")))
            .unwrap();
        let cells: Vec<String> = (t.backend().buffer().content().iter())
            .map(|c| c.symbol().to_string())
            .collect();
        cells.chunks(w as usize).map(|l| l.concat()).collect()
    }

    /// Issue 20: at 80x24 values were cut mid-cell ("3145.7 u", "ReduceScatt"), and the only keys
    /// quit. Each level shows its values whole; Enter opens a job, then a communicator; `s` sorts.
    #[test]
    fn drills_down_sorts_and_fits_80x24_without_cutting_a_value() {
        let mut v = View::default();
        let jobs = ListJobsResponse {
            jobs: vec![Job {
                job_id: "train-llama-70b".into(),
                live: true,
                collectives: 150,
                ..Default::default()
            }],
        };
        let mut stats = ranks(150, [0, 0, 140, 10]);
        for r in &mut stats.ranks {
            r.job_id = "train-llama-70b".into();
            r.comm_hash = 0x5eed0ddec0ffee01;
            r.exec_p50_us = 3145.7 - 100.0 * f64::from(r.rank);
            r.exec_p99_us = 52428.8;
        }
        stats.colls = vec![ncclscope_proto::api::CollStats {
            job_id: "train-llama-70b".into(),
            comm_hash: 0x5eed0ddec0ffee01,
            func: "ReduceScatter".into(),
            size_bucket: "<=256MiB".into(),
            count: 1572,
            exec_p50_us: 2883.6,
            exec_p99_us: 3932.2,
            busbw_p50_gbs: 53.2,
            ..Default::default()
        }];
        v.update(jobs, stats);
        let s = screen(&mut v, 80, 24).join("\n");
        assert!(s.contains("train-llama-70b") && s.contains("3.15ms"), "{s}");

        assert_eq!(v.key(KeyCode::Enter), Action::Stay);
        let s = screen(&mut v, 80, 24).join("\n");
        assert!(
            s.contains("5eed0ddec0ffee01") && s.contains("rank 2"),
            "{s}"
        );

        v.key(KeyCode::Enter);
        let lines = screen(&mut v, 80, 24);
        let s = lines.join("\n");
        for whole in [
            "3.15ms",
            "2.85ms",
            "52.43ms",
            "ReduceScatter",
            "<=256MiB",
            "2.88ms",
            "53.2GB/s",
        ] {
            assert!(s.contains(whole), "{whole} missing or cut:\n{s}");
        }
        assert!(
            s.contains("◀ straggler") && s.contains("STRAGGLER rank 2"),
            "{s}"
        );
        // Sorted by exec time: rank 0 (the slowest kernels) first; by skew: rank 3.
        let first_rank = |lines: &[String]| {
            let row = lines
                .iter()
                .find(|l| l.contains("▶"))
                .expect("a selected row");
            row.split_whitespace().nth(1).unwrap().to_string()
        };
        v.key(KeyCode::Char('s'));
        let lines = screen(&mut v, 80, 24);
        assert!(lines[1].contains("sort: exec time"), "{}", lines[1]);
        v.key(KeyCode::Home);
        assert_eq!(first_rank(&screen(&mut v, 80, 24)), "0");
        v.key(KeyCode::Char('s'));
        v.key(KeyCode::Home);
        assert_eq!(first_rank(&screen(&mut v, 80, 24)), "3");

        v.key(KeyCode::Char('?'));
        assert!(
            screen(&mut v, 80, 24)
                .join("\n")
                .contains("sort: name, exec time, skew, losses")
        );
        v.key(KeyCode::Char('x'));
        v.key(KeyCode::Backspace);
        assert!(screen(&mut v, 80, 24)[1].starts_with("job train-llama-70b  "));
        v.key(KeyCode::Esc);
        v.key(KeyCode::Esc);
        assert_eq!(v.key(KeyCode::Esc), Action::Quit, "Esc at the top quits");
    }

    /// A rank's drill-down lists its sends and receives per peer below its channels.
    #[test]
    fn a_rank_shows_its_sends_and_receives_per_peer() {
        let mut v = View::default();
        let mut stats = ranks(10, [0; 4]);
        // The receives host-timed (no exec time), the sends GPU-timed.
        stats.p2p = [("Send", 2, 41.5, 12), ("Recv", 0, 0.0, 0)]
            .map(
                |(func, peer, exec, device_timed)| ncclscope_proto::api::P2pStats {
                    job_id: "j".into(),
                    comm_hash: 1,
                    rank: 1,
                    func: func.into(),
                    peer,
                    transfers: 12,
                    exec_p50_us: exec,
                    exec_p99_us: exec,
                    device_timed,
                    ..Default::default()
                },
            )
            .into();
        v.update(ListJobsResponse::default(), stats);
        for _ in 0..2 {
            v.key(KeyCode::Enter); // the job, its communicator
        }
        v.key(KeyCode::Down);
        v.key(KeyCode::Enter); // rank 1
        let lines = screen(&mut v, 80, 24);
        let row = |head: &str| {
            (lines.iter())
                .find(|l| l.split_whitespace().any(|w| w == head))
                .map(|l| l.split_whitespace().map(String::from).collect::<Vec<_>>())
        };
        let send = row("Send→2").unwrap_or_else(|| panic!("{}", lines.join("\n")));
        assert!(
            send.contains(&"12".to_string()) && send.iter().any(|w| w.starts_with("41.5")),
            "{send:?}"
        );
        let recv = row("Recv←0").unwrap_or_else(|| panic!("{}", lines.join("\n")));
        assert!(
            !recv.iter().any(|w| w.starts_with('0') && w.len() > 1),
            "host-timed: no exec time shown, not 0: {recv:?}"
        );
    }

    /// A daemon that went away is a state of the view, not the end of it.
    #[test]
    fn an_unreachable_daemon_is_shown_and_cleared_by_the_next_answer() {
        let mut v = View::default();
        v.unreachable(&anyhow::anyhow!("connection refused"));
        let s = screen(&mut v, 80, 24);
        assert!(
            s[0].contains("daemon unreachable since") && s[0].contains("connection refused"),
            "{}",
            s[0]
        );
        assert!(v.plain_lines()[0].contains("daemon unreachable since"));
        v.update(ListJobsResponse::default(), ranks(1, [0; 4]));
        assert!(screen(&mut v, 80, 24)[0].starts_with("ncclscope top"));
        assert!(v.plain_lines()[0].contains("job j comm"));
    }
}
