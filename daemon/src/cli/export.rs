//! `ncclscope export --job J -o FILE`: a job's spooled collective instances as a Perfetto trace
//! (protobuf, or Chrome JSON) or OTLP/JSON, read through the daemon's API (during or after the job), or straight from a spool
//! directory with `--spool DIR` when no daemon runs.

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use ncclscope_proto::api::{Collective, ExportRequest, ListJobsRequest, ResourceRequest};
use opentelemetry_proto::tonic::resource::v1::Resource;

use crate::api;
use crate::config::{Config, Overrides};
use crate::otlp_json::OtlpJsonWriter;
use crate::perfetto::PerfettoWriter;
use crate::perfetto_proto::PerfettoProtoWriter;
use crate::spool::SpoolReader;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Perfetto's protobuf trace (open in ui.perfetto.dev): interned names, delta timestamps, several
    /// times smaller than the JSON.
    Perfetto,
    /// Chrome/Perfetto trace JSON (ui.perfetto.dev or chrome://tracing; for scripts and older tools).
    PerfettoJson,
    /// OTLP/JSON lines (the OpenTelemetry Collector's otlpjsonfile format): the spans the live export sends.
    OtlpJson,
}

#[derive(clap::Args)]
pub struct Args {
    /// The job to export.
    #[arg(long)]
    pub job: String,
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
    #[arg(long)]
    pub spool: Option<PathBuf>,
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
    /// The daemon's query API socket.
    #[arg(long, env = api::API_SOCKET_ENV, default_value = api::DEFAULT_API_SOCKET)]
    pub api_socket: PathBuf,
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
        let (start, end) = crate::perfetto::extent(c);
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
    // Every instance the filter keeps, from the spool or through the daemon, to `each`.
    let read = |each: &mut dyn FnMut(Collective) -> anyhow::Result<()>| match &args.spool {
        Some(dir) => read_spool(dir, &args.job, args.uid, &filter, each),
        None => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(read_api(
                &args.api_socket,
                &args.job,
                args.uid,
                &filter,
                each,
            )),
    };
    let n = match &args.merge {
        Some(trace) => {
            let mut colls = Vec::new();
            read(&mut |c| {
                colls.push(c);
                Ok(())
            })?;
            merge_into(trace, &colls, &args.output)?
        }
        None => {
            let resource = match (args.format, &args.spool) {
                (Format::OtlpJson, Some(_)) => Some(local_resource()?),
                (Format::OtlpJson, None) => Some(
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()?
                        .block_on(api_resource(&args.api_socket))?,
                ),
                _ => None,
            };
            let mut file = TraceFile::create(&args.output, args.format, resource)?;
            let read = read(&mut |c| file.write(&c));
            file.finish_if(read)?
        }
    };
    eprintln!(
        "wrote {n} collective instances of job {} to {}",
        args.job,
        args.output.display()
    );
    Ok(())
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
}

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
        };
        r.with_context(|| format!("writing {}", self.tmp.display()))
    }

    fn finish(self) -> anyhow::Result<u64> {
        let (n, file) = match self.writer {
            Writer::Perfetto(w) => (w.collectives(), w.finish()?),
            Writer::PerfettoJson(w) => (w.collectives(), w.finish()?),
            Writer::Otlp(w) => (w.collectives(), w.finish()?),
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
                let _ = std::fs::remove_file(&self.tmp);
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
    let read = read_api(socket, job, uid, &Filter::default(), &mut |c| {
        file.write(&c)
    })
    .await;
    file.finish_if(read)
}

/// The resource the daemon's live OTLP export sends (its GetResource call).
async fn api_resource(socket: &Path) -> anyhow::Result<Resource> {
    let mut client = api::connect(socket).await?;
    let reply = (client.get_resource(ResourceRequest {}).await)
        .map_err(|s| anyhow::anyhow!("{}", s.message()))
        .context("asking the daemon for its OTLP resource")?
        .into_inner();
    let pairs = reply.attributes.into_iter().map(|a| (a.key, a.value));
    Ok(crate::otlp::resource_from(pairs))
}

/// Without a daemon (`--spool`): the resource a daemon on this machine with its configuration
/// (/etc/ncclscope/ncclscope.toml and this environment) sends.
fn local_resource() -> anyhow::Result<Resource> {
    let config = Config::load(None, std::env::vars(), &Overrides::default())
        .context("reading the daemon's configuration for the OTLP/JSON file's resource")?;
    Ok(crate::otlp::resource(&config.otlp, &crate::run::hostname()))
}

/// Hands each instance of `job` that `filter` keeps to `each`, read through the daemon's Export call.
async fn read_api(
    socket: &Path,
    job: &str,
    uid: Option<u32>,
    filter: &Filter,
    each: &mut dyn FnMut(Collective) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let mut client = api::connect(socket).await?;
    let jobs = client.list_jobs(ListJobsRequest {}).await?.into_inner();
    let total = jobs
        .jobs
        .iter()
        .find(|j| j.job_id == job && uid.is_none_or(|u| u == j.uid))
        .map(|j| j.collectives);
    let mut stream = client
        .export(ExportRequest {
            job_id: job.to_string(),
            uid,
        })
        .await
        .map_err(|s| anyhow::anyhow!("{}", s.message()))
        .with_context(|| format!("exporting job {job:?}"))?
        .into_inner();
    let bar = progress(total);
    loop {
        let next = (stream.message().await)
            .map_err(|status| anyhow::anyhow!("exporting job {job:?}: {}", status.message()))?;
        let Some(c) = next else { break };
        bar.inc(1);
        if filter.keeps(&c) {
            each(c)?;
        }
    }
    bar.finish_and_clear();
    Ok(())
}

/// Hands each instance of `job` that `filter` keeps to `each`, read from a spool directory.
fn read_spool(
    dir: &Path,
    job: &str,
    uid: Option<u32>,
    filter: &Filter,
    each: &mut dyn FnMut(Collective) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let spool = SpoolReader::open_dir(dir)?;
    let key = spool.find(job, uid).map_err(|e| {
        anyhow::anyhow!(
            "{e} in the spool at {}; it holds (uid, job) {:?}",
            dir.display(),
            spool.jobs()
        )
    })?;
    let bar = progress(None);
    for c in spool.read_job(&key) {
        let c = c.with_context(|| format!("exporting job {job:?} from {}", dir.display()))?;
        bar.inc(1);
        if filter.keeps(&c) {
            each(c)?;
        }
    }
    bar.finish_and_clear();
    Ok(())
}

/// Writes the PyTorch trace at `trace` with `colls` merged in ([`crate::perfetto::merge`]) to
/// `output` (under a temporary name, renamed into place); returns how many were added.
fn merge_into(trace: &Path, colls: &[Collective], output: &Path) -> anyhow::Result<u64> {
    let read = File::open(trace).with_context(|| format!("opening {}", trace.display()))?;
    let torch: serde_json::Value = serde_json::from_reader(std::io::BufReader::new(read))
        .with_context(|| {
            format!(
                "reading {} as a PyTorch profiler trace (JSON)",
                trace.display()
            )
        })?;
    let merged = crate::perfetto::merge(torch, colls)
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
