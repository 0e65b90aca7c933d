//! `ncclscope export --job J -o FILE`: a job's spooled collective instances as a Perfetto/Chrome trace
//! or OTLP/JSON, read through the daemon's API (during or after the job), or straight from a spool
//! directory with `--spool DIR` when no daemon runs.

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use ncclscope_proto::api::{Collective, ExportRequest, ListJobsRequest};

use crate::api;
use crate::otlp_json::OtlpJsonWriter;
use crate::perfetto::PerfettoWriter;
use crate::spool::SpoolReader;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Chrome/Perfetto trace JSON (open in ui.perfetto.dev or chrome://tracing).
    Perfetto,
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
    /// The daemon's query API socket.
    #[arg(long, env = api::API_SOCKET_ENV, default_value = api::DEFAULT_API_SOCKET)]
    pub api_socket: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let n = match &args.spool {
        Some(dir) => export_from_spool(dir, &args.job, args.uid, &args.output, args.format)?,
        None => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(export_via_api(
                &args.api_socket,
                &args.job,
                args.uid,
                &args.output,
                args.format,
            ))?
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
    Perfetto(PerfettoWriter<BufWriter<File>>),
    Otlp(OtlpJsonWriter<BufWriter<File>>),
}

impl TraceFile {
    fn create(path: &Path, format: Format) -> anyhow::Result<TraceFile> {
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".partial");
        let tmp = PathBuf::from(tmp);
        let file = BufWriter::new(
            File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?,
        );
        let writer = match format {
            Format::Perfetto => Writer::Perfetto(PerfettoWriter::new(file)?),
            Format::OtlpJson => Writer::Otlp(OtlpJsonWriter::new(file)),
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
            Writer::Otlp(w) => w.write(c),
        };
        r.with_context(|| format!("writing {}", self.tmp.display()))
    }

    fn finish(self) -> anyhow::Result<u64> {
        let (n, file) = match self.writer {
            Writer::Perfetto(w) => (w.collectives(), w.finish()?),
            Writer::Otlp(w) => (w.collectives(), w.finish()?),
        };
        file.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&self.tmp, &self.path)
            .with_context(|| format!("renaming to {}", self.path.display()))?;
        Ok(n)
    }

    fn abandon(self) {
        let _ = std::fs::remove_file(&self.tmp);
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

/// Exports through the daemon's Export call; returns the number of instances written.
pub async fn export_via_api(
    socket: &Path,
    job: &str,
    uid: Option<u32>,
    output: &Path,
    format: Format,
) -> anyhow::Result<u64> {
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
    let mut file = TraceFile::create(output, format)?;
    let bar = progress(total);
    loop {
        let next = match stream.message().await {
            Ok(next) => next,
            Err(status) => {
                file.abandon();
                anyhow::bail!("exporting job {job:?}: {}", status.message());
            }
        };
        let Some(c) = next else { break };
        if let Err(e) = file.write(&c) {
            file.abandon();
            return Err(e);
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    file.finish()
}

/// Exports straight from a spool directory (no daemon needed).
pub fn export_from_spool(
    dir: &Path,
    job: &str,
    uid: Option<u32>,
    output: &Path,
    format: Format,
) -> anyhow::Result<u64> {
    let spool = SpoolReader::open_dir(dir)?;
    let key = spool.find(job, uid).map_err(|e| {
        anyhow::anyhow!(
            "{e} in the spool at {}; it holds (uid, job) {:?}",
            dir.display(),
            spool.jobs()
        )
    })?;
    let mut file = TraceFile::create(output, format)?;
    let bar = progress(None);
    for c in spool.read_job(&key) {
        let written = c.map_err(anyhow::Error::from).and_then(|c| file.write(&c));
        if let Err(e) = written {
            file.abandon();
            return Err(e.context(format!("exporting job {job:?} from {}", dir.display())));
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    file.finish()
}
