//! A stand-alone OTLP/gRPC receiver for out-of-process checks (the GPU scripts, `demo --otlp-endpoint`):
//! runs `fake-opentelemetry-collector` on 127.0.0.1, prints `endpoint http://127.0.0.1:PORT` first, then
//! every received span as one JSON line, until stdin closes or `--seconds` pass.
//!
//!   otlp-sink [--seconds N] > spans.jsonl

use std::time::{Duration, Instant};

use fake_opentelemetry_collector::FakeCollectorServer;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let seconds = match args.iter().position(|a| a == "--seconds") {
        Some(i) => args
            .get(i + 1)
            .ok_or("--seconds needs a value")?
            .parse::<u64>()?,
        None => 3600,
    };
    let mut server = FakeCollectorServer::start().await?;
    println!("endpoint {}", server.endpoint());
    let deadline = Instant::now() + Duration::from_secs(seconds);
    while Instant::now() < deadline {
        for span in server.exported_spans(1, Duration::from_millis(200)).await {
            println!("{}", serde_json::to_string(&span)?);
        }
    }
    Ok(())
}
