//! `ncclscope export --job J -o FILE`: a job's spooled collective instances as a Perfetto trace
//! (protobuf, or Chrome JSON) or OTLP/JSON, read through the daemon's API (during or after the job), or straight from a spool
//! directory with `--spool DIR` when no daemon runs.

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use ncclscope_proto::api::{Collective, ExportRequest, Job, ListJobsRequest, ResourceRequest};
use opentelemetry_proto::tonic::resource::v1::Resource;

use crate::api;
use crate::config::{Config, Overrides};
use crate::export::node_clocks::{self, NodeClock, NodeEnds};
use crate::export::otlp_json::OtlpJsonWriter;
use crate::export::perfetto::PerfettoWriter;
use crate::export::perfetto_proto::PerfettoProtoWriter;
use crate::storage::spool::{Evicted, Origin, Spool, SpoolLimits, SpoolReader};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Perfetto's protobuf trace (open in ui.perfetto.dev): interned names, delta timestamps, several
    /// times smaller than the JSON.
    Perfetto,
    /// Chrome/Perfetto trace JSON (ui.perfetto.dev or chrome://tracing; for scripts and older tools).
    PerfettoJson,
    /// OTLP/JSON lines (the OpenTelemetry Collector's otlpjsonfile format): the spans the live export sends.
    OtlpJson,
    /// A spool directory holding exactly the exported instances (lossless): what `--spool` reads,
    /// e.g. one per node, to combine into one trace across the nodes.
    Spool,
}

#[derive(clap::Args)]
pub struct Args {
    /// The job to export.
    #[arg(long, required_unless_present = "slurm_job")]
    pub job: Option<String>,
    /// Instead of --job: every job of the uid whose processes ran in this Slurm job (SLURM_JOB_ID,
    /// which the plugin records whatever job id the tasks chose), only that Slurm job's instances.
    #[arg(long, value_name = "SLURM_JOB_ID", conflicts_with = "job")]
    pub slurm_job: Option<String>,
    /// The uid that ran the job. Users export their own jobs only; root may export any and must name
    /// the uid when several ran a job of that name.
    #[arg(long)]
    pub uid: Option<u32>,
    /// Output file.
    #[arg(short = 'o', long)]
    pub output: PathBuf,
    #[arg(long, value_enum, default_value_t = Format::Perfetto)]
    pub format: Format,
    /// Read this spool directory directly instead of asking the daemon (e.g. while it is down).
    /// Several (one per node: the Epilog's `<host>.spool` copies, or each node's spool): one trace
    /// of the job across them, each node's clock estimated from the collectives and shifted onto
    /// the first's, the estimates written into the trace.
    #[arg(long)]
    pub spool: Vec<PathBuf>,
    /// Only instances that end at or after this time: RFC 3339 in UTC (2026-12-05T23:10:00Z) or a
    /// duration before now (90s, 15m, 2h, 1d). Default: from the job's start.
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    pub since: Option<u64>,
    /// Only instances that start at or before this time (as --since). Default: to its end.
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    pub until: Option<u64>,
    /// Only these ranks (repeat or comma-separate). Default: every rank.
    #[arg(long, value_name = "RANK", value_delimiter = ',')]
    pub rank: Vec<u32>,
    /// Only these communicators: a hash (16 hex digits or a prefix of them) or a name (repeat or
    /// comma-separate). Default: every communicator.
    #[arg(long, value_name = "COMM", value_delimiter = ',')]
    pub comm: Vec<String>,
    /// A PyTorch profiler trace (`prof.export_chrome_trace`, Kineto's JSON) to add the job's
    /// collectives to, one process per rank with its communicators' and channels' tracks, each
    /// instance's straggler marked; the output is that trace with them (JSON). The job's instances
    /// are held in memory: narrow it with --since/--until/--rank to the profiled window.
    #[arg(long, value_name = "TRACE", conflicts_with = "format")]
    pub merge: Option<PathBuf>,
    /// What --merge does with the offset it measures between the job's collectives and the NCCL
    /// kernels the trace holds (every kernel contains its collective's work on one clock): `correct`
    /// shifts the collectives onto the trace's clock, `check` refuses past 1 us and writes nothing,
    /// `off` does not look. Both refuse past 1 ms (another run's trace, a clock step).
    #[arg(long, value_enum, default_value_t = Align::Correct, requires = "merge")]
    pub align: Align,
    /// The daemon's query API socket. Several (one per node's daemon): one trace across them, as
    /// with several --spool.
    #[arg(long, env = api::API_SOCKET_ENV, default_value = api::DEFAULT_API_SOCKET)]
    pub api_socket: Vec<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Align {
    Correct,
    Check,
    Off,
}

/// Which instances an export writes; the default keeps all.
#[derive(Clone, Debug, Default)]
pub struct Filter {
    /// Unix ns: an instance that ends before `since` or starts after `until` is left out.
    pub since: Option<u64>,
    pub until: Option<u64>,
    pub ranks: Vec<u32>,
    /// Hash prefixes (lowercase hex) or names.
    pub comms: Vec<String>,
}

impl Filter {
    pub fn keeps(&self, c: &Collective) -> bool {
        let (start, end) = crate::export::perfetto::extent(c);
        let hash = format!("{:016x}", c.comm_hash);
        self.since.is_none_or(|t| end >= t)
            && self.until.is_none_or(|t| start <= t)
            && (self.ranks.is_empty() || self.ranks.contains(&c.rank))
            && (self.comms.is_empty()
                || (self.comms.iter())
                    .any(|s| s == &c.comm_name || hash.starts_with(&s.to_ascii_lowercase())))
    }
}

/// `--since`/`--until`: RFC 3339 in UTC ("2026-12-05T23:10:00Z", fractions of a second allowed), or a
/// duration before now ("90s", "15m", "2h", "1d"); Unix ns.
pub fn parse_time(s: &str) -> Result<u64, String> {
    let bad =
        || format!("{s:?} is neither a UTC time like 2026-12-05T23:10:00Z nor a duration like 15m");
    let unit = |u: &str| match u {
        "s" => Some(1),
        "m" => Some(60),
        "h" => Some(3600),
        "d" => Some(86_400),
        _ => None,
    };
    if let Some(i) = s.find(|c: char| !c.is_ascii_digit())
        && i > 0
        && let Some(secs) = unit(&s[i..])
    {
        let n: u64 = s[..i].parse().map_err(|_| bad())?;
        let ago = n.checked_mul(secs * 1_000_000_000).ok_or_else(bad)?;
        return Ok(ncclscope_proto::now_ns().saturating_sub(ago));
    }
    let t = s.strip_suffix('Z').ok_or_else(bad)?;
    let (date, time) = t.split_once('T').ok_or_else(bad)?;
    let num = |v: &str| v.parse::<u64>().map_err(|_| bad());
    let d: Vec<&str> = date.split('-').collect();
    let (whole, frac) = time.split_once('.').unwrap_or((time, ""));
    let hms: Vec<&str> = whole.split(':').collect();
    if d.len() != 3 || hms.len() != 3 || frac.len() > 9 || !frac.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(bad());
    }
    let (y, m, day) = (num(d[0])?, num(d[1])?, num(d[2])?);
    let (h, min, sec) = (num(hms[0])?, num(hms[1])?, num(hms[2])?);
    if y < 1970
        || !(1..=12).contains(&m)
        || !(1..=31).contains(&day)
        || h > 23
        || min > 59
        || sec > 60
    {
        return Err(bad());
    }
    // Days from 1970-01-01 to the date (the proleptic Gregorian calendar, in March-based years).
    let (y, m) = if m <= 2 { (y - 1, m + 9) } else { (y, m - 3) };
    let days = 365 * y + y / 4 - y / 100 + y / 400 + (153 * m + 2) / 5 + day - 1 - 719_468;
    let nanos: u64 = format!("{frac:0<9}").parse().map_err(|_| bad())?;
    Ok(((days * 86_400 + h * 3600 + min * 60 + sec) * 1_000_000_000) + nanos)
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let filter = Filter {
        since: args.since,
        until: args.until,
        ranks: args.rank,
        comms: args.comm,
    };
    // One node per source: each spool directory given, else each daemon's API socket.
    let sources: Vec<Source> = if args.spool.is_empty() {
        args.api_socket.iter().cloned().map(Source::Api).collect()
    } else {
        args.spool.iter().cloned().map(Source::Spool).collect()
    };
    let which = match (&args.job, &args.slurm_job) {
        (_, Some(id)) => Which::Slurm(id.clone()),
        (Some(job), None) => Which::Job(job.clone()),
        (None, None) => anyhow::bail!("name --job or --slurm-job"),
    };
    // Every instance of `source` that the filter keeps, to `each`; what the spool had deleted of
    // the jobs read.
    let read =
        |source: &Source, each: &mut dyn FnMut(Collective) -> anyhow::Result<()>| match source {
            Source::Spool(dir) => read_spool(dir, &which, args.uid, &filter, each),
            Source::Api(socket) => tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?
                .block_on(read_api(socket, &which, args.uid, &filter, each)),
        };
    let (n, coverage) = match (&args.merge, sources.as_slice()) {
        (Some(trace), [source]) => {
            let mut colls = Vec::new();
            let mut coverage = Coverage::default();
            coverage.dropped = read(source, &mut |c| {
                coverage.add(&c);
                colls.push(c);
                Ok(())
            })?;
            let n = merge_into(trace, colls, &args.output, args.align, &coverage.line())?;
            (n, coverage)
        }
        (Some(_), _) => anyhow::bail!(
            "--merge adds one node's collectives to its ranks' trace: name one source"
        ),
        (None, [source]) => {
            let resource = match (args.format, source) {
                (Format::OtlpJson, Source::Spool(_)) => Some(local_resource()?),
                (Format::OtlpJson, Source::Api(socket)) => Some(
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()?
                        .block_on(api_resource(socket))?,
                ),
                _ => None,
            };
            let mut file = TraceFile::create(&args.output, args.format, resource)?;
            let mut coverage = Coverage::default();
            let read = read(source, &mut |c| {
                coverage.add(&c);
                file.write(&c)
            });
            let read = read.map(|dropped| {
                coverage.dropped = dropped;
                file.note(coverage.line());
            });
            (file.finish_if(read)?, coverage)
        }
        (None, _) => combine(&sources, &read, &args.output, args.format)?,
    };
    eprintln!(
        "wrote {n} collective instances of {which} to {}",
        args.output.display()
    );
    eprintln!("{}", coverage.line());
    Ok(())
}

/// What an export selects: a job, or every job that ran in a Slurm job.
enum Which {
    Job(String),
    Slurm(String),
}

impl std::fmt::Display for Which {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Which::Job(j) => write!(f, "job {j}"),
            Which::Slurm(id) => write!(f, "Slurm job {id}"),
        }
    }
}

/// What a trace covers: what was kept, and what the spool had already deleted; stated in the trace
/// (a note) and on stderr, where the Slurm Epilog takes it into its log line.
#[derive(Default)]
struct Coverage {
    instances: u64,
    first: u64,
    last: u64,
    ranks: std::collections::BTreeSet<u32>,
    hosts: std::collections::BTreeSet<String>,
    /// (job id, what the spool's bounds deleted of it) for the jobs read.
    dropped: Vec<(String, Evicted)>,
}

impl Coverage {
    fn add(&mut self, c: &Collective) {
        let (start, end) = crate::export::perfetto::extent(c);
        self.first = if self.instances == 0 {
            start
        } else {
            self.first.min(start)
        };
        self.last = self.last.max(end);
        self.instances += 1;
        self.ranks.insert(c.rank);
        if !self.hosts.contains(&c.host) {
            self.hosts.insert(c.host.clone());
        }
    }

    fn line(&self) -> String {
        let mut s = if self.instances == 0 {
            "coverage: no collective instances".to_string()
        } else {
            format!(
                "coverage: {} collective instances of {} ranks on {} from {} to {}",
                self.instances,
                self.ranks.len(),
                self.hosts.iter().cloned().collect::<Vec<_>>().join(","),
                utc(self.first),
                utc(self.last)
            )
        };
        let dropped: Vec<String> = (self.dropped.iter())
            .filter(|(_, d)| d.files > 0)
            .map(|(job, d)| {
                format!(
                    "{} files ({} bytes) of job {job}, instances up to {}",
                    d.files,
                    d.bytes,
                    utc(d.until_unix_ns)
                )
            })
            .collect();
        if dropped.is_empty() {
            s.push_str("; the spool had deleted none of it");
        } else {
            s.push_str(&format!(
                "; the spool's bounds had already deleted {}",
                dropped.join(", ")
            ));
        }
        s
    }
}

/// Unix ns as RFC 3339 UTC to the microsecond (the form --since takes).
fn utc(ns: u64) -> String {
    let secs = ns / 1_000_000_000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (the inverse of `parse_time`'s).
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ns % 1_000_000_000 / 1000
    )
}

/// Where an export reads one node's instances.
enum Source {
    Spool(PathBuf),
    Api(PathBuf),
}

type Read<'a> = dyn Fn(
        &Source,
        &mut dyn FnMut(Collective) -> anyhow::Result<()>,
    ) -> anyhow::Result<Vec<(String, Evicted)>>
    + 'a;

/// One trace of the job across `sources` (one per node): a first pass gathers each node's end times
/// per instance, from which [`node_clocks::estimate`] finds each node's clock against the first
/// node's; the second writes every node's instances shifted onto that clock. The estimates are
/// written into the trace (notes; JSON: metadata `ncclscope_node_clocks`) and to stderr.
fn combine(
    sources: &[Source],
    read: &Read<'_>,
    output: &Path,
    format: Format,
) -> anyhow::Result<(u64, Coverage)> {
    anyhow::ensure!(
        matches!(format, Format::Perfetto | Format::PerfettoJson),
        "one trace across nodes is a Perfetto trace (--format perfetto or perfetto-json)"
    );
    let mut ends = Vec::new();
    for source in sources {
        let mut node = NodeEnds::default();
        read(source, &mut |c| {
            node.add(&c);
            Ok(())
        })?;
        ends.push(node);
    }
    let clocks = node_clocks::estimate(&ends);
    let mut file = TraceFile::create(output, format, None)?;
    for (i, clock) in clocks.iter().enumerate() {
        let line = clock.describe(i);
        eprintln!("{line}");
        file.note(line);
    }
    file.metadata(
        "ncclscope_node_clocks",
        clocks.iter().map(NodeClock::to_json).collect(),
    );
    let mut coverage = Coverage::default();
    let mut result = Ok(());
    for (source, clock) in sources.iter().zip(&clocks) {
        match read(source, &mut |mut c| {
            crate::export::perfetto::shift(&mut c, -clock.offset_ns);
            coverage.add(&c);
            file.write(&c)
        }) {
            Ok(dropped) => coverage.dropped.extend(dropped),
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    if result.is_ok() {
        file.note(coverage.line());
    }
    Ok((file.finish_if(result)?, coverage))
}

/// One trace of `job` over several nodes' daemons (`demo --nodes N`), as [`combine`] writes it.
pub fn export_nodes_via_api(
    sockets: &[PathBuf],
    job: &str,
    output: &Path,
    format: Format,
) -> anyhow::Result<u64> {
    let sources: Vec<Source> = sockets.iter().cloned().map(Source::Api).collect();
    let which = Which::Job(job.to_string());
    let read = |source: &Source, each: &mut dyn FnMut(Collective) -> anyhow::Result<()>| {
        let filter = Filter::default();
        match source {
            Source::Spool(dir) => read_spool(dir, &which, None, &filter, each),
            Source::Api(socket) => tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?
                .block_on(read_api(socket, &which, None, &filter, each)),
        }
    };
    Ok(combine(&sources, &read, output, format)?.0)
}

/// Writes the file under a temporary name and renames it into place, so a reader never sees half a trace.
struct TraceFile {
    writer: Writer,
    tmp: PathBuf,
    path: PathBuf,
}

enum Writer {
    Perfetto(PerfettoProtoWriter<BufWriter<File>>),
    PerfettoJson(PerfettoWriter<BufWriter<File>>),
    Otlp(OtlpJsonWriter<BufWriter<File>>),
    /// The spool and the instances not yet appended to it.
    Spool(Spool, Vec<(Origin, Collective)>, u64),
}

/// Instances a spool export appends (and syncs) at once.
const SPOOL_BATCH: usize = 4096;

impl TraceFile {
    /// `resource`: the OTLP/JSON file's (the live export's), for that format only.
    fn create(
        path: &Path,
        format: Format,
        resource: Option<Resource>,
    ) -> anyhow::Result<TraceFile> {
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".partial");
        let tmp = PathBuf::from(tmp);
        if format == Format::Spool {
            // Bounded by what is exported, not by the daemon's limits.
            let limits = SpoolLimits {
                max_bytes: u64::MAX,
                max_bytes_per_uid: u64::MAX,
                max_age: std::time::Duration::MAX,
                ..SpoolLimits::default()
            };
            let spool = Spool::open(&tmp, limits)
                .with_context(|| format!("creating the spool {}", tmp.display()))?;
            return Ok(TraceFile {
                writer: Writer::Spool(spool, Vec::new(), 0),
                tmp,
                path: path.to_path_buf(),
            });
        }
        let file = BufWriter::new(
            File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?,
        );
        let writer = match format {
            Format::Perfetto => Writer::Perfetto(PerfettoProtoWriter::new(file)),
            Format::PerfettoJson => Writer::PerfettoJson(PerfettoWriter::new(file)?),
            Format::OtlpJson => Writer::Otlp(OtlpJsonWriter::new(
                file,
                resource.expect("the OTLP/JSON format comes with its resource"),
            )),
            Format::Spool => unreachable!("made above"),
        };
        Ok(TraceFile {
            writer,
            tmp,
            path: path.to_path_buf(),
        })
    }

    fn write(&mut self, c: &Collective) -> anyhow::Result<()> {
        let r = match &mut self.writer {
            Writer::Perfetto(w) => w.write(c),
            Writer::PerfettoJson(w) => w.write(c),
            Writer::Otlp(w) => w.write(c),
            Writer::Spool(spool, batch, n) => {
                batch.push((Origin::default(), c.clone()));
                *n += 1;
                if batch.len() >= SPOOL_BATCH {
                    spool.append(batch).map(|()| batch.clear())
                } else {
                    Ok(())
                }
            }
        };
        r.with_context(|| format!("writing {}", self.tmp.display()))
    }

    /// A statement about the trace (coverage, a node's clock): JSON metadata `ncclscope_notes`, a
    /// track of its own in the protobuf trace, nowhere in OTLP/JSON (spans only).
    fn note(&mut self, text: String) {
        match &mut self.writer {
            Writer::Perfetto(w) => w.note(text),
            Writer::PerfettoJson(w) => w.add_note(text),
            // The spool holds the instances; an export of it states its coverage anew.
            Writer::Otlp(_) | Writer::Spool(..) => {}
        }
    }

    /// Sets `key` of a JSON trace's metadata (the others hold their notes only).
    fn metadata(&mut self, key: &str, value: serde_json::Value) {
        if let Writer::PerfettoJson(w) = &mut self.writer {
            w.set_metadata(key, value);
        }
    }

    fn finish(self) -> anyhow::Result<u64> {
        let (n, file) = match self.writer {
            Writer::Perfetto(w) => (w.collectives(), w.finish()?),
            Writer::PerfettoJson(w) => (w.collectives(), w.finish()?),
            Writer::Otlp(w) => (w.collectives(), w.finish()?),
            Writer::Spool(mut spool, batch, n) => {
                spool
                    .append(&batch)
                    .with_context(|| format!("writing {}", self.tmp.display()))?;
                drop(spool);
                std::fs::rename(&self.tmp, &self.path)
                    .with_context(|| format!("renaming to {}", self.path.display()))?;
                return Ok(n);
            }
        };
        file.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&self.tmp, &self.path)
            .with_context(|| format!("renaming to {}", self.path.display()))?;
        Ok(n)
    }

    /// Finishes the file if everything was read (`read`), else removes it and returns the error.
    fn finish_if(self, read: anyhow::Result<()>) -> anyhow::Result<u64> {
        match read {
            Ok(()) => self.finish(),
            Err(e) => {
                match self.writer {
                    Writer::Spool(..) => std::fs::remove_dir_all(&self.tmp),
                    _ => std::fs::remove_file(&self.tmp),
                }
                .ok();
                Err(e)
            }
        }
    }
}

/// A bar when the total is known, a counter otherwise; invisible when stderr is not a terminal.
fn progress(total: Option<u64>) -> ProgressBar {
    match total.filter(|&t| t > 0) {
        Some(t) => ProgressBar::new(t).with_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} collectives {per_sec} eta {eta}")
                .expect("valid template"),
        ),
        None => ProgressBar::new_spinner().with_style(
            ProgressStyle::with_template("{spinner} {pos} collectives {per_sec}")
                .expect("valid template"),
        ),
    }
}

/// Exports every instance of `job` through the daemon's Export call; returns the number written.
pub async fn export_via_api(
    socket: &Path,
    job: &str,
    uid: Option<u32>,
    output: &Path,
    format: Format,
) -> anyhow::Result<u64> {
    let resource = match format {
        Format::OtlpJson => Some(api_resource(socket).await?),
        _ => None,
    };
    let mut file = TraceFile::create(output, format, resource)?;
    let which = Which::Job(job.to_string());
    let read = read_api(socket, &which, uid, &Filter::default(), &mut |c| {
        file.write(&c)
    })
    .await;
    file.finish_if(read.map(drop))
}

/// The resource the daemon's live OTLP export sends (its GetResource call).
async fn api_resource(socket: &Path) -> anyhow::Result<Resource> {
    let mut client = api::connect(socket).await?;
    let reply = (client.get_resource(ResourceRequest {}).await)
        .map_err(|s| anyhow::anyhow!("{}", s.message()))
        .context("asking the daemon for its OTLP resource")?
        .into_inner();
    let pairs = reply.attributes.into_iter().map(|a| (a.key, a.value));
    Ok(crate::export::otlp::resource_from(pairs))
}

/// Without a daemon (`--spool`): the resource a daemon on this machine with its configuration
/// (/etc/ncclscope/ncclscope.toml and this environment) sends.
fn local_resource() -> anyhow::Result<Resource> {
    let config = Config::load(None, std::env::vars(), &Overrides::default())
        .context("reading the daemon's configuration for the OTLP/JSON file's resource")?;
    Ok(crate::export::otlp::resource(
        &config.otlp,
        &crate::run::hostname(),
    ))
}

/// Hands each instance `which` selects and `filter` keeps to `each`, read through the daemon's
/// Export call; returns what the spool had deleted of the jobs read.
async fn read_api(
    socket: &Path,
    which: &Which,
    uid: Option<u32>,
    filter: &Filter,
    each: &mut dyn FnMut(Collective) -> anyhow::Result<()>,
) -> anyhow::Result<Vec<(String, Evicted)>> {
    let mut client = api::connect(socket).await?;
    let jobs = client.list_jobs(ListJobsRequest {}).await?.into_inner();
    let read: Vec<&Job> = (jobs.jobs.iter())
        .filter(|j| uid.is_none_or(|u| u == j.uid))
        .filter(|j| match which {
            Which::Job(job) => &j.job_id == job,
            Which::Slurm(id) => j.slurm_job_ids.contains(id),
        })
        .collect();
    let total = match which {
        Which::Job(_) => read.first().map(|j| j.collectives),
        Which::Slurm(_) => None,
    };
    let dropped = (read.iter())
        .map(|j| {
            let d = Evicted {
                files: j.spool_dropped_files,
                bytes: j.spool_dropped_bytes,
                until_unix_ns: j.spool_dropped_until_unix_ns,
            };
            (j.job_id.clone(), d)
        })
        .collect();
    let (job_id, slurm_job_id) = match which {
        Which::Job(job) => (job.clone(), String::new()),
        Which::Slurm(id) => (String::new(), id.clone()),
    };
    let mut stream = client
        .export(ExportRequest {
            job_id,
            uid,
            slurm_job_id,
        })
        .await
        .map_err(|s| anyhow::anyhow!("{}", s.message()))
        .with_context(|| format!("exporting {which}"))?
        .into_inner();
    let bar = progress(total);
    loop {
        let next = (stream.message().await)
            .map_err(|status| anyhow::anyhow!("exporting {which}: {}", status.message()))?;
        let Some(c) = next else { break };
        bar.inc(1);
        if filter.keeps(&c) {
            each(c)?;
        }
    }
    bar.finish_and_clear();
    Ok(dropped)
}

/// Hands each instance `which` selects and `filter` keeps to `each`, read from a spool directory;
/// returns what the spool had deleted of the jobs read.
fn read_spool(
    dir: &Path,
    which: &Which,
    uid: Option<u32>,
    filter: &Filter,
    each: &mut dyn FnMut(Collective) -> anyhow::Result<()>,
) -> anyhow::Result<Vec<(String, Evicted)>> {
    let spool = SpoolReader::open_dir(dir)?;
    let (keys, slurm) = match which {
        Which::Job(job) => {
            let key = spool.find(job, uid).map_err(|e| {
                anyhow::anyhow!(
                    "{e} in the spool at {}; it holds (uid, job) {:?}",
                    dir.display(),
                    spool.jobs()
                )
            })?;
            (vec![key], None)
        }
        Which::Slurm(id) => {
            let keys = spool.in_slurm_job(uid, id);
            anyhow::ensure!(
                !keys.is_empty(),
                "no spooled instances of Slurm job {id:?} in the spool at {}",
                dir.display()
            );
            (keys, Some(id.as_str()))
        }
    };
    let bar = progress(None);
    for key in &keys {
        for c in spool.read_job(key) {
            let c = c.with_context(|| format!("exporting {which} from {}", dir.display()))?;
            bar.inc(1);
            if filter.keeps(&c) && slurm.is_none_or(|id| c.slurm_job_id == id) {
                each(c)?;
            }
        }
    }
    bar.finish_and_clear();
    Ok((keys.iter())
        .map(|k| (k.1.clone(), spool.evicted(k).unwrap_or_default()))
        .collect())
}

/// Writes the PyTorch trace at `trace` with `colls` merged in ([`crate::export::perfetto::merge`]) to
/// `output` (under a temporary name, renamed into place), shifted onto the trace's clock as `align`
/// says (the check and what it did are in the trace, key `ncclscope_alignment`, beside
/// `ncclscope_coverage`); returns how many were added.
fn merge_into(
    trace: &Path,
    mut colls: Vec<Collective>,
    output: &Path,
    align: Align,
    coverage: &str,
) -> anyhow::Result<u64> {
    let read = File::open(trace).with_context(|| format!("opening {}", trace.display()))?;
    let mut torch: serde_json::Value = serde_json::from_reader(std::io::BufReader::new(read))
        .with_context(|| {
            format!(
                "reading {} as a PyTorch profiler trace (JSON)",
                trace.display()
            )
        })?;
    let (shift, record) = alignment(&torch, &colls, align)
        .with_context(|| format!("aligning the job's collectives with {}", trace.display()))?;
    if shift != 0 {
        for c in &mut colls {
            crate::export::perfetto::shift(c, shift);
        }
    }
    if let Some(map) = torch.as_object_mut() {
        map.insert("ncclscope_alignment".into(), record);
        map.insert("ncclscope_coverage".into(), coverage.into());
    }
    let merged = crate::export::perfetto::merge(torch, &colls)
        .with_context(|| format!("merging into {}", trace.display()))?;
    let mut tmp = output.as_os_str().to_owned();
    tmp.push(".partial");
    let tmp = PathBuf::from(tmp);
    let mut file =
        BufWriter::new(File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?);
    let written = serde_json::to_writer(&mut file, &merged)
        .map_err(anyhow::Error::from)
        .and_then(|()| Ok(file.into_inner().map_err(|e| e.into_error())?.sync_all()?));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e.context(format!("writing {}", tmp.display())));
    }
    std::fs::rename(&tmp, output).with_context(|| format!("renaming to {}", output.display()))?;
    Ok(colls.len() as u64)
}

/// `--merge`'s check ([`crate::export::align`]): the shift to apply to the collectives and what the trace
/// records of it; an error where `align` refuses. Says what it found on stderr.
fn alignment(
    torch: &serde_json::Value,
    colls: &[Collective],
    align: Align,
) -> anyhow::Result<(i64, serde_json::Value)> {
    use crate::export::align::{MAX_CORRECTION_NS, MIN_PAIRS, TOLERANCE_NS};
    if align == Align::Off {
        return Ok((
            0,
            serde_json::json!({"checked": false, "why": "--align off"}),
        ));
    }
    let kernels = crate::export::align::nccl_kernels(torch);
    let found =
        crate::export::align::check(&kernels, colls, crate::export::align::Owner::of(torch));
    let why = match &found {
        _ if kernels.is_empty() => {
            Some("the trace holds no NCCL kernel (profile with ProfilerActivity.CUDA)".to_string())
        }
        None => Some(format!(
            "none of the export's collectives pairs with the trace's {} NCCL kernels (another run,              or narrow the export with --rank/--since/--until)",
            kernels.len()
        )),
        Some(a) if a.paired < MIN_PAIRS => Some(format!(
            "only {} collectives paired with the trace's NCCL kernels",
            a.paired
        )),
        Some(a) if !a.consistent() => Some(format!(
            "the collectives do not line up with the trace's NCCL kernels at any one offset: {}",
            a.describe()
        )),
        Some(_) => None,
    };
    if let Some(why) = why {
        if align == Align::Check {
            anyhow::bail!("cannot check the alignment: {why}");
        }
        eprintln!("alignment not checked: {why}; merged on ncclscope's clock");
        return Ok((0, serde_json::json!({"checked": false, "why": why})));
    }
    let a = found.expect("checked above");
    eprintln!("alignment: {}", a.describe());
    if a.offset_ns.abs() > MAX_CORRECTION_NS {
        anyhow::bail!(
            "{:.3} us is past the {} ms ncclscope corrects: a clock stepped, or the trace is of another \
             run (--align off merges anyway)",
            a.offset_ns as f64 / 1000.0,
            MAX_CORRECTION_NS / 1_000_000
        );
    }
    let applied = match align {
        Align::Check if a.offset_ns.abs() > TOLERANCE_NS => anyhow::bail!(
            "{:.3} us is past the {} us --align check allows (--align correct shifts the collectives)",
            a.offset_ns as f64 / 1000.0,
            TOLERANCE_NS / 1000
        ),
        Align::Check => 0,
        _ => a.offset_ns,
    };
    if applied != 0 {
        eprintln!(
            "alignment: ncclscope's collectives shifted by {:+.3} us onto the trace's clock",
            applied as f64 / 1000.0
        );
    }
    Ok((applied, a.to_json(applied)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_parse_as_utc_or_as_a_duration_before_now() {
        assert_eq!(
            parse_time("2026-12-05T23:10:00Z"),
            Ok(1_796_512_200_000_000_000)
        );
        assert_eq!(
            parse_time("2000-02-29T00:00:00.25Z"),
            Ok(951_782_400_250_000_000)
        );
        let ago = ncclscope_proto::now_ns() - parse_time("15m").unwrap();
        assert!((899_000_000_000..=900_000_000_000).contains(&ago), "{ago}");
        for bad in [
            "yesterday",
            "2026-12-05 23:10:00",
            "2026-13-01T00:00:00Z",
            "15x",
            "m",
        ] {
            assert!(parse_time(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_filter_keeps_overlapping_times_listed_ranks_and_communicators() {
        let c = Collective {
            comm_hash: 0x5eed0ddec0ffee01,
            comm_name: "dp".into(),
            rank: 3,
            start_unix_ns: 1_000,
            end_unix_ns: 2_000,
            ..Default::default()
        };
        let keeps = |f: Filter| f.keeps(&c);
        assert!(keeps(Filter::default()));
        assert!(keeps(Filter {
            since: Some(2_000),
            until: Some(1_000),
            ..Default::default()
        }));
        assert!(!keeps(Filter {
            since: Some(2_001),
            ..Default::default()
        }));
        assert!(!keeps(Filter {
            until: Some(999),
            ..Default::default()
        }));
        assert!(keeps(Filter {
            ranks: vec![1, 3],
            ..Default::default()
        }));
        assert!(!keeps(Filter {
            ranks: vec![1],
            ..Default::default()
        }));
        for comm in ["5EED0d", "5eed0ddec0ffee01", "dp"] {
            assert!(
                keeps(Filter {
                    comms: vec![comm.into()],
                    ..Default::default()
                }),
                "{comm}"
            );
        }
        assert!(!keeps(Filter {
            comms: vec!["5eed1".into(), "tp".into()],
            ..Default::default()
        }));
    }
}
