//! A minimal HTTP/1.1 responder for Prometheus scrapes: `GET /metrics` returns the latest rendered
//! text; anything else is 404. One short request per connection, with a read timeout.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

const MAX_REQUEST: usize = 8192;

pub async fn serve(listener: TcpListener, text: watch::Receiver<Arc<String>>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let text = text.clone();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(5), respond(stream, text)).await;
        });
    }
}

async fn respond(mut stream: TcpStream, text: watch::Receiver<Arc<String>>) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < MAX_REQUEST {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let request_line = buf.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut parts = request_line.split(|&b| b == b' ');
    let (method, path) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
    );
    let response = if method == b"GET" && (path == b"/metrics" || path.starts_with(b"/metrics?")) {
        let body = text.borrow().clone();
        format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
            body.len(),
            body
        )
    } else {
        "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_string()
    };
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}
