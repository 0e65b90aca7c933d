//! `ncclscope cluster`: the suspects of a job across its nodes, from Prometheus (or Thanos Query,
//! Mimir: any server of Prometheus' HTTP query API) scraping every node's daemon and evaluating the
//! shipped recording rules (deploy/prometheus/ncclscope-rules.yaml). The daemons never talk to each
//! other: a rank's lateness is its communicator's largest mean exec time minus its own (a late rank
//! waits least; exec time is a duration on each GPU's own clock, so nodes compare without a common
//! clock), and a node is late when every rank it runs of a communicator is. Live like `top`
//! (redrawn every refresh on a terminal, plain lines otherwise); `--once` for scripts.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::time::Duration;

use anyhow::Context;
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// The shipped recording rules this reads.
pub const RANK_LATENESS: &str = "ncclscope:rank_lateness_microseconds:1m";
pub const NODE_LATENESS: &str = "ncclscope:node_lateness_microseconds:1m";
/// The daemon's info series: `instance` to the node's `host_name` (its `host.name`).
const BUILD_INFO: &str = "ncclscope_build_info";
/// A series every daemon serving the job exports (with `job_series = true`).
const JOB_SERIES: &str = "ncclscope_rank_collectives_total";

#[derive(clap::Args)]
pub struct Args {
    /// Base URL of Prometheus' HTTP API: http://prometheus:9090, Thanos Query's, or Mimir's
    /// http://mimir/prometheus.
    #[arg(long, env = "NCCLSCOPE_PROMETHEUS")]
    pub prometheus: String,
    /// The job (its `job_id`).
    #[arg(long)]
    pub job: String,
    /// A rank or node is named when its collectives start this much later than its communicator's
    /// punctual ranks', in microseconds (1-minute means).
    #[arg(long, default_value_t = 1000.0)]
    pub threshold_us: f64,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 15.0)]
    pub interval: f64,
    /// One refresh, then exit (for scripts).
    #[arg(long)]
    pub once: bool,
    /// Plain lines even on a terminal.
    #[arg(long)]
    pub plain: bool,
    /// A header sent with every query, `Name: value` (repeatable): a tenant (`X-Scope-OrgID: t1`),
    /// `Authorization: Bearer TOKEN`.
    #[arg(long = "header")]
    pub headers: Vec<String>,
}

/// How long one query may take before the refresh counts as failed.
const QUERY_TIMEOUT: Duration = Duration::from_secs(10);

pub fn run(args: Args) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let prom = Prometheus::new(&args.prometheus, &args.headers)?;
    let tty = std::io::stdout().is_terminal() && !args.plain && !args.once;
    let interval = Duration::from_secs_f64(args.interval.max(1.0));
    // The first refresh's failure (a wrong URL, an unreachable server, a refused query) is an
    // error; later ones are shown and retried, as `top` does with a restarting daemon.
    let mut first = true;
    loop {
        let view = rt.block_on(suspects(&prom, &args.job, args.threshold_us));
        let now = crate::cli::top::utc_hms();
        let lines = match view {
            Ok(v) => v.lines(&args.job, args.threshold_us),
            Err(e) if first => return Err(e),
            Err(e) => vec![
                crate::cli::error::report(&e, false)
                    .trim_end()
                    .replace('\n', "; "),
            ],
        };
        first = false;
        if tty {
            // Clear the screen and redraw, as `top` does.
            print!("\x1b[H\x1b[2J");
            println!(
                "ncclscope cluster: job {} on {} (every {} s, Ctrl-C quits)  {now}\n",
                args.job,
                args.prometheus,
                interval.as_secs()
            );
            for l in &lines {
                println!("{l}");
            }
        } else {
            for l in &lines {
                println!("{now} {l}");
            }
        }
        if args.once {
            return Ok(());
        }
        std::thread::sleep(interval);
    }
}

/// A Prometheus HTTP API client (plain HTTP/1.1).
pub struct Prometheus {
    base: String,
    headers: Vec<(hyper::header::HeaderName, hyper::header::HeaderValue)>,
    client: Client<HttpConnector, Empty<Bytes>>,
}

impl Prometheus {
    pub fn new(base: &str, headers: &[String]) -> anyhow::Result<Prometheus> {
        let base = base.trim_end_matches('/').to_string();
        let uri: hyper::Uri = base
            .parse()
            .with_context(|| format!("--prometheus {base} is not a URL"))?;
        anyhow::ensure!(
            uri.scheme_str() == Some("http") && uri.host().is_some(),
            "--prometheus {base}: give an http:// URL with a host (https is not supported: reach \
             it through a local proxy or port forward)"
        );
        let headers = headers
            .iter()
            .map(|h| {
                let (name, value) = h
                    .split_once(':')
                    .with_context(|| format!("--header {h:?} is not `Name: value`"))?;
                Ok((
                    name.trim()
                        .parse()
                        .with_context(|| format!("--header {h:?}: bad name"))?,
                    value
                        .trim()
                        .parse()
                        .with_context(|| format!("--header {h:?}: bad value"))?,
                ))
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Prometheus {
            base,
            headers,
            client: Client::builder(TokioExecutor::new()).build_http(),
        })
    }

    /// An instant query's vector: each series' labels and value.
    pub async fn query(&self, promql: &str) -> anyhow::Result<Vec<(HashMap<String, String>, f64)>> {
        let url = format!(
            "{}/api/v1/query?query={}",
            self.base,
            percent_encoding::utf8_percent_encode(promql, percent_encoding::NON_ALPHANUMERIC)
        );
        let mut req = hyper::Request::get(&url);
        for (k, v) in &self.headers {
            req = req.header(k, v);
        }
        let req = req.body(Empty::new())?;
        let what = || format!("querying {}/api/v1/query for {promql}", self.base);
        let answer = tokio::time::timeout(QUERY_TIMEOUT, async {
            let resp = self.client.request(req).await?;
            let status = resp.status();
            let body = resp.into_body().collect().await?.to_bytes();
            anyhow::Ok((status, body))
        })
        .await
        .map_err(|_| anyhow::anyhow!("no answer within {} s", QUERY_TIMEOUT.as_secs()))
        .and_then(|r| r)
        .with_context(what)?;
        let (status, body) = answer;
        // Errors come as JSON too (400 bad query, 422 execution, 503 timeout), except from proxies.
        let v: Value = serde_json::from_slice(&body).map_err(|_| {
            anyhow::anyhow!(
                "{}: HTTP {status}: {}",
                what(),
                String::from_utf8_lossy(&body[..body.len().min(200)]).trim()
            )
        })?;
        if v["status"] != "success" {
            anyhow::bail!(
                "{}: HTTP {status}: {} {}",
                what(),
                v["errorType"].as_str().unwrap_or(""),
                v["error"].as_str().unwrap_or("")
            );
        }
        anyhow::ensure!(
            v["data"]["resultType"] == "vector",
            "{}: the answer is a {}, not an instant vector",
            what(),
            v["data"]["resultType"]
        );
        let series = v["data"]["result"].as_array().cloned().unwrap_or_default();
        Ok(series
            .iter()
            .filter_map(|s| {
                let labels = s["metric"]
                    .as_object()?
                    .iter()
                    .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                    .collect();
                let value = s["value"][1].as_str()?.parse().ok()?;
                Some((labels, value))
            })
            .collect())
    }
}

/// A PromQL string literal.
fn quoted(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// A late rank or node, with the evidence.
#[derive(Debug, Clone, PartialEq)]
pub struct Suspect {
    /// The scrape target: one daemon, one node.
    pub instance: String,
    /// Its `host.name` (from `ncclscope_build_info`), if known.
    pub host: Option<String>,
    /// None: the whole node.
    pub rank: Option<Rank>,
    /// How much later than its communicator's punctual ranks it starts (node: its least late rank).
    pub lateness_us: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Rank {
    pub rank: String,
    pub comm: String,
    pub gpu: String,
    pub uuid: String,
}

/// One refresh: the suspects, and what they were picked among.
#[derive(Debug, Default)]
pub struct View {
    pub suspects: Vec<Suspect>,
    pub ranks: usize,
    pub nodes: usize,
    /// Why there is nothing to judge yet.
    pub no_data: Option<String>,
}

/// Asks Prometheus for the job's rank and node lateness and names those above `threshold_us`.
pub async fn suspects(prom: &Prometheus, job: &str, threshold_us: f64) -> anyhow::Result<View> {
    let sel = format!("{{job_id={}}}", quoted(job));
    let ranks = prom.query(&format!("{RANK_LATENESS}{sel}")).await?;
    if ranks.is_empty() {
        let seen = prom.query(&format!("count({JOB_SERIES}{sel})")).await?;
        let why = if seen.is_empty() {
            format!(
                "Prometheus has no series of job {job} ({JOB_SERIES}{sel}): is it running, and are \
                 its nodes' daemons scraped (with prometheus.job_series = true)?"
            )
        } else {
            format!(
                "no {RANK_LATENESS} series for job {job} yet: the ncclscope recording rules \
                 (deploy/prometheus/ncclscope-rules.yaml) need them loaded and a minute of data"
            )
        };
        return Ok(View {
            no_data: Some(why),
            ..View::default()
        });
    }
    let nodes = prom.query(&format!("{NODE_LATENESS}{sel}")).await?;
    let hosts: HashMap<String, String> = prom
        .query(BUILD_INFO)
        .await?
        .into_iter()
        .filter_map(|(mut l, _)| {
            // A scrape config that sets `host_name` on the target (the shipped one does, from the
            // address) renames the daemon's own to `exported_host_name`.
            let host = l.remove("exported_host_name").or(l.remove("host_name"))?;
            Some((l.remove("instance")?, host))
        })
        .collect();
    let label = |l: &HashMap<String, String>, k: &str| l.get(k).cloned().unwrap_or_default();
    let mut view = View {
        ranks: ranks.len(),
        nodes: {
            let mut i: Vec<String> = ranks.iter().map(|(l, _)| label(l, "instance")).collect();
            i.sort();
            i.dedup();
            i.len()
        },
        ..View::default()
    };
    let late = |v: &f64| *v > threshold_us;
    for (l, v) in nodes.iter().filter(|(_, v)| late(v)) {
        let instance = label(l, "instance");
        view.suspects.push(Suspect {
            host: hosts.get(&instance).cloned(),
            instance,
            rank: None,
            lateness_us: *v,
        });
    }
    for (l, v) in ranks.iter().filter(|(_, v)| late(v)) {
        let instance = label(l, "instance");
        view.suspects.push(Suspect {
            host: hosts.get(&instance).cloned(),
            instance,
            rank: Some(Rank {
                rank: label(l, "rank"),
                comm: label(l, "comm"),
                gpu: label(l, "gpu"),
                uuid: label(l, "UUID"),
            }),
            lateness_us: *v,
        });
    }
    // Nodes first, then ranks; the latest first in each.
    view.suspects.sort_by(|a, b| {
        (a.rank.is_some(), -a.lateness_us)
            .partial_cmp(&(b.rank.is_some(), -b.lateness_us))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    Ok(view)
}

impl View {
    /// What a refresh prints: a summary line, then one line per suspect.
    pub fn lines(&self, job: &str, threshold_us: f64) -> Vec<String> {
        if let Some(why) = &self.no_data {
            return vec![format!("job {job}: {why}")];
        }
        let late_nodes = self.suspects.iter().filter(|s| s.rank.is_none()).count();
        let late_ranks = self.suspects.len() - late_nodes;
        let mut out = vec![format!(
            "job {job}: {late_nodes} of {} nodes and {late_ranks} of {} ranks late by more than \
             {threshold_us:.0} us (1-minute means)",
            self.nodes, self.ranks
        )];
        for s in &self.suspects {
            let node = match &s.host {
                Some(h) => format!("{h} ({})", s.instance),
                None => s.instance.clone(),
            };
            out.push(match &s.rank {
                None => format!(
                    "  node {node}: every rank of a communicator late, the least by {:.0} us",
                    s.lateness_us
                ),
                Some(r) => format!(
                    "  rank {} on {node}, GPU {} {}: starts {:.0} us after the punctual ranks of \
                     communicator {}",
                    r.rank,
                    if r.gpu.is_empty() { "?" } else { &r.gpu },
                    r.uuid,
                    s.lateness_us,
                    r.comm
                ),
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_id_is_quoted_for_promql() {
        assert_eq!(quoted(r#"a"b\c"#), r#""a\"b\\c""#);
    }

    #[test]
    fn nodes_come_first_with_their_host_name() {
        let rank = Suspect {
            instance: "10.0.0.2:9464".into(),
            host: Some("gpu-b".into()),
            rank: Some(Rank {
                rank: "3".into(),
                comm: "5eed".into(),
                gpu: "1".into(),
                uuid: "GPU-1".into(),
            }),
            lateness_us: 3012.4,
        };
        let node = Suspect {
            rank: None,
            lateness_us: 2950.0,
            ..rank.clone()
        };
        let view = View {
            suspects: vec![node, rank],
            ranks: 4,
            nodes: 2,
            no_data: None,
        };
        assert_eq!(
            view.lines("j", 1000.0),
            [
                "job j: 1 of 2 nodes and 1 of 4 ranks late by more than 1000 us (1-minute means)",
                "  node gpu-b (10.0.0.2:9464): every rank of a communicator late, the least by 2950 us",
                "  rank 3 on gpu-b (10.0.0.2:9464), GPU 1 GPU-1: starts 3012 us after the punctual \
                 ranks of communicator 5eed",
            ]
        );
    }

    #[test]
    fn an_https_url_or_a_bad_header_is_an_error_naming_it() {
        let e = Prometheus::new("https://prom:9090", &[]).err().unwrap();
        assert!(e.to_string().contains("https is not supported"), "{e}");
        let e = Prometheus::new("http://prom:9090", &["X-Scope-OrgID".into()])
            .err()
            .unwrap();
        assert!(e.to_string().contains("not `Name: value`"), "{e}");
    }
}
