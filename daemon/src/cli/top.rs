//! `ncclscope top`: a live view of the jobs on this node, refreshed every second from the daemon's
//! API: per-rank kernel time p50/p99, cross-rank skew, the current straggler, loss counters.
//! On a terminal it is a full-screen view (q, Esc or Ctrl-C quits); otherwise it prints one plain line
//! per communicator per refresh, for logs.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ncclscope_proto::api::{ListJobsResponse, RankStats, StatsResponse};
use ratatui::Frame;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Color, Modifier, Style, Stylize};
use ratatui::text::Line;
use ratatui::widgets::{Block, Paragraph, Row, Table};

use crate::api;
use crate::cli::stats::{fetch, shape, us};

#[derive(clap::Args)]
pub struct Args {
    /// Only this job (default: every job on this node).
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
    // A worker thread drives the gRPC connection while `show` blocks on the runtime's handle.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let opts = ViewOptions {
        job: args.job.unwrap_or_default(),
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

/// Runs the view until the user quits, `iterations` refreshes were shown, or `stop` is set (the demo
/// sets it when its ranks are done). Blocking: call it off the async runtime, with its handle.
pub fn show(
    rt: &tokio::runtime::Handle,
    socket: &Path,
    opts: &ViewOptions,
    stop: &AtomicBool,
) -> anyhow::Result<()> {
    let mut view = View::default();
    let mut refreshes = 0u64;
    let mut terminal = if opts.plain {
        None
    } else {
        Some(ratatui::try_init()?)
    };
    let result = (|| -> anyhow::Result<()> {
        loop {
            let (jobs, stats) = rt.block_on(fetch(socket, &opts.job, false))?;
            view.update(jobs, stats);
            refreshes += 1;
            match terminal.as_mut() {
                Some(t) => {
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
                if terminal.is_some() && event::poll(left.min(Duration::from_millis(100)))? {
                    if let Event::Key(k) = event::read()? {
                        let ctrl_c = k.code == KeyCode::Char('c')
                            && k.modifiers.contains(KeyModifiers::CONTROL);
                        if k.kind == KeyEventKind::Press
                            && (matches!(k.code, KeyCode::Char('q') | KeyCode::Esc) || ctrl_c)
                        {
                            return Ok(());
                        }
                    }
                } else if terminal.is_none() {
                    std::thread::sleep(left.min(Duration::from_millis(100)));
                }
            }
        }
    })();
    if terminal.is_some() {
        ratatui::restore();
    }
    result
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

/// What the view shows: the latest snapshots, and the stragglers computed from the change over the last
/// [`WINDOW`] refreshes (so "current" means the last few seconds, not the whole job).
#[derive(Default)]
pub struct View {
    pub jobs: ListJobsResponse,
    pub stats: StatsResponse,
    history: std::collections::VecDeque<Counts>,
    pub stragglers: Vec<Straggler>,
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
    }

    fn straggler_of(&self, r: &RankStats) -> bool {
        self.stragglers.iter().any(|s| {
            (s.uid, &s.job_id, s.comm_hash, s.rank) == (r.uid, &r.job_id, r.comm_hash, r.rank)
        })
    }

    /// One line per communicator: what `top` prints when not on a terminal.
    pub fn plain_lines(&self) -> Vec<String> {
        let now = utc_hms();
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

    pub fn draw(&self, f: &mut Frame, socket: &Path) {
        let job_w = self
            .jobs
            .jobs
            .iter()
            .map(|j| j.job_id.chars().count())
            .chain(self.stats.ranks.iter().map(|r| r.job_id.chars().count()))
            .max()
            .unwrap_or(0)
            .clamp(3, 40) as u16;
        let health = self.stats.health.clone().unwrap_or_default();
        let lost_total: u64 = health.lost.values().sum();
        let [head, jobs_area, ranks_area, colls_area, foot] = Layout::vertical([
            Constraint::Length(1),
            Constraint::Length(self.jobs.jobs.len().clamp(1, 6) as u16 + 3),
            Constraint::Min(6),
            Constraint::Length(10),
            Constraint::Length(2),
        ])
        .areas(f.area());
        f.render_widget(
            Line::from(format!(
                "ncclscope top — {}  segments {}  records {}  decode errors {}  lost {}  spans exported {}",
                socket.display(),
                health.segments,
                health.records_in,
                health.decode_errors,
                lost_total,
                health.spans_exported
            ))
            .bold(),
            head,
        );

        let header = |cells: &[&'static str]| {
            Row::new(cells.to_vec()).style(Style::new().add_modifier(Modifier::BOLD))
        };
        let job_rows = self.jobs.jobs.iter().map(|j| {
            let (comms, ranks) = shape(Some(j), &self.stats.ranks, j.uid, &j.job_id);
            Row::new(vec![
                j.job_id.clone(),
                if j.live {
                    "live".into()
                } else {
                    "ended".into()
                },
                ranks.to_string(),
                comms.to_string(),
                j.collectives.to_string(),
            ])
        });
        f.render_widget(
            Table::new(
                job_rows,
                [
                    Constraint::Length(job_w),
                    Constraint::Length(6),
                    Constraint::Length(6),
                    Constraint::Length(6),
                    Constraint::Length(12),
                ],
            )
            .header(header(&["JOB", "STATE", "RANKS", "COMMS", "COLLECTIVES"]))
            .block(Block::bordered().title(" jobs ")),
            jobs_area,
        );

        let rank_rows = self.stats.ranks.iter().map(|r| {
            let mark = self.straggler_of(r);
            let row = Row::new(vec![
                r.job_id.clone(),
                format!("{:016x}", r.comm_hash),
                r.rank.to_string(),
                r.collectives.to_string(),
                us(r.exec_p50_us),
                us(r.exec_p99_us),
                us(r.skew_p50_us),
                r.straggler_count.to_string(),
                r.lost.to_string(),
                if mark {
                    "◀ straggler".into()
                } else {
                    String::new()
                },
            ]);
            if mark {
                row.style(Style::new().fg(Color::Red).add_modifier(Modifier::BOLD))
            } else {
                row
            }
        });
        f.render_widget(
            Table::new(
                rank_rows,
                [
                    Constraint::Length(job_w),
                    Constraint::Length(16),
                    Constraint::Length(5),
                    Constraint::Length(9),
                    Constraint::Length(10),
                    Constraint::Length(10),
                    Constraint::Length(10),
                    Constraint::Length(8),
                    Constraint::Length(6),
                    Constraint::Length(12),
                ],
            )
            .header(header(&[
                "JOB", "COMM", "RANK", "COLLS", "EXEC p50", "EXEC p99", "SKEW p50", "LAST", "LOST",
                "",
            ]))
            .block(
                Block::bordered().title(
                    " ranks: kernel time, start skew vs earliest rank, times last to start ",
                ),
            ),
            ranks_area,
        );

        let coll_rows = self.stats.colls.iter().map(|c| {
            Row::new(vec![
                c.job_id.clone(),
                c.func.clone(),
                c.size_bucket.clone(),
                c.count.to_string(),
                us(c.exec_p50_us),
                us(c.exec_p99_us),
                format!("{:.1} GB/s", c.busbw_p50_gbs),
            ])
        });
        f.render_widget(
            Table::new(
                coll_rows,
                [
                    Constraint::Length(job_w),
                    Constraint::Length(14),
                    Constraint::Length(12),
                    Constraint::Length(9),
                    Constraint::Length(10),
                    Constraint::Length(10),
                    Constraint::Length(12),
                ],
            )
            .header(header(&[
                "JOB",
                "COLLECTIVE",
                "SIZE",
                "COUNT",
                "EXEC p50",
                "EXEC p99",
                "BUSBW p50",
            ]))
            .block(Block::bordered().title(" collectives ")),
            colls_area,
        );

        // Only the stages that lost something; all of them are in `ncclscope stats`.
        let mut lost: Vec<_> = health
            .lost
            .iter()
            .filter(|(_, v)| **v > 0)
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        lost.sort();
        if lost.is_empty() {
            lost.push("nothing".into());
        }
        let straggler = match self.stragglers.first() {
            Some(s) => format!(
                "STRAGGLER: rank {} (job {}, comm {:016x}): last to start in {} of the last {} collectives, skew p50 {}",
                s.rank,
                s.job_id,
                s.comm_hash,
                s.last_to_start,
                s.of,
                us(s.skew_p50_us)
            ),
            None => "no straggler".into(),
        };
        f.render_widget(
            Paragraph::new(vec![
                Line::from(straggler)
                    .style(Style::new().fg(Color::Red).add_modifier(Modifier::BOLD)),
                Line::from(format!(
                    "lost: {}  export errors {}    (q quits)",
                    lost.join(" "),
                    health.export_errors
                )),
            ]),
            foot,
        );
    }
}

/// UTC wall-clock time as HH:MM:SS for the plain lines.
fn utc_hms() -> String {
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

    #[test]
    fn the_screen_names_the_straggler() {
        let mut v = View::default();
        let jobs = ListJobsResponse {
            jobs: vec![Job {
                job_id: "j".into(),
                live: true,
                collectives: 150,
                ..Default::default()
            }],
        };
        v.update(jobs, ranks(150, [0, 0, 140, 10]));
        let mut t = Terminal::new(TestBackend::new(140, 30)).unwrap();
        t.draw(|f| v.draw(f, Path::new("/run/x.sock"))).unwrap();
        let screen: String = t
            .backend()
            .buffer()
            .content()
            .iter()
            .map(|c| c.symbol())
            .collect();
        assert!(screen.contains("STRAGGLER: rank 2 (job j"), "{screen}");
        assert!(screen.contains("◀ straggler"), "{screen}");
    }
}
