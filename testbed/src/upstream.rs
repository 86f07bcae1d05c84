//! An upstream with a capacity: it serves at most `capacity` requests at once for `service_ms`
//! each and queues the rest, so its latency grows with load. It can report its "CPU" (requests
//! at the service, queued ones included, over its capacity) and fail a share of its answers.
//! `GET /__stats` answers the most requests it had at once, and how many it served;
//! `GET /__set?service_ms=N&capacity=N` changes either while it runs (a slower upstream, one
//! that scaled out). Paths with `/llm` answer as an LLM API does (`llm.rs`); `/bytes/N` answers
//! N bytes.

use crate::http::{read_head, skip_body};
use std::io::{BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long)]
    port: u16,
    /// Requests served at once.
    #[arg(long, default_value_t = 10)]
    capacity: u64,
    /// How long each request takes once served (a request's `x-hold-ms` header overrides it).
    #[arg(long, default_value_t = 50)]
    service_ms: u64,
    /// Report utilisation in this response header: a percentage, or ORCA's text form when the
    /// header is `endpoint-load-metrics`.
    #[arg(long)]
    cpu_header: Option<String>,
    /// Answer this percentage of requests with 503 (spread evenly).
    #[arg(long, default_value_t = 0)]
    fail_percent: u64,
}

#[derive(Default)]
struct Counts {
    serving: u64,
    waiting: u64,
}

struct Service {
    args: Args,
    /// The service time and capacity now (`/__set` changes them).
    service_ms: AtomicU64,
    capacity: AtomicU64,
    counts: Mutex<Counts>,
    free: Condvar,
    max_at_once: AtomicU64,
    served: AtomicU64,
}

pub fn run(args: &Args) -> Result<(), String> {
    let listener = TcpListener::bind(("127.0.0.1", args.port)).map_err(|e| format!("bind: {e}"))?;
    let service = Arc::new(Service {
        args: Args {
            port: args.port,
            capacity: args.capacity.max(1),
            service_ms: args.service_ms,
            cpu_header: args.cpu_header.clone(),
            fail_percent: args.fail_percent.min(100),
        },
        service_ms: AtomicU64::new(args.service_ms),
        capacity: AtomicU64::new(args.capacity.max(1)),
        counts: Mutex::new(Counts::default()),
        free: Condvar::new(),
        max_at_once: AtomicU64::new(0),
        served: AtomicU64::new(0),
    });
    for stream in listener.incoming().flatten() {
        let service = service.clone();
        std::thread::spawn(move || {
            let _ = service.connection(stream);
        });
    }
    Ok(())
}

impl Service {
    fn connection(&self, stream: TcpStream) -> std::io::Result<()> {
        stream.set_nodelay(true)?;
        let mut out = stream.try_clone()?;
        let mut reader = BufReader::new(stream);
        while let Some(head) = read_head(&mut reader)? {
            skip_body(&mut reader, &head)?;
            let path = head.first.split(' ').nth(1).unwrap_or("/");
            let response = if path.starts_with("/__stats") {
                let body = format!(
                    "{{\"max_at_once\":{},\"served\":{}}}\n",
                    self.max_at_once.swap(0, Ordering::Relaxed),
                    self.served.load(Ordering::Relaxed)
                );
                format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                )
            } else if let Some(query) = path.strip_prefix("/__set?") {
                for (name, value) in query.split('&').filter_map(|kv| kv.split_once('=')) {
                    let Ok(n) = value.parse::<u64>() else {
                        continue;
                    };
                    match name {
                        "service_ms" => self.service_ms.store(n, Ordering::Relaxed),
                        "capacity" => {
                            self.capacity.store(n.max(1), Ordering::Relaxed);
                            self.free.notify_all();
                        }
                        _ => {}
                    }
                }
                "HTTP/1.1 204 No Content\r\n\r\n".to_string()
            } else if let Some(n) = bytes_asked(path) {
                // A download of `n` bytes, written as fast as the connection takes them.
                write!(
                    out,
                    "HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ncontent-length: {n}\r\n\r\n"
                )?;
                let block = [b'x'; 64 * 1024];
                let mut left = n;
                while left > 0 {
                    let take = left.min(block.len() as u64) as usize;
                    out.write_all(&block[..take])?;
                    left -= take as u64;
                }
                continue;
            } else if path.contains("/llm") {
                if !crate::llm::answer(&head, &mut out)? {
                    return Ok(());
                }
                continue;
            } else {
                let hold = head
                    .header("x-hold-ms")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| self.service_ms.load(Ordering::Relaxed));
                self.serve(hold)
            };
            out.write_all(response.as_bytes())?;
        }
        Ok(())
    }

    /// Wait for a free place, hold it, answer.
    fn serve(&self, hold_ms: u64) -> String {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        counts.waiting += 1;
        self.max_at_once
            .fetch_max(counts.waiting + counts.serving, Ordering::Relaxed);
        while counts.serving >= self.capacity.load(Ordering::Relaxed) {
            counts = self
                .free
                .wait(counts)
                .unwrap_or_else(PoisonError::into_inner);
        }
        counts.waiting -= 1;
        counts.serving += 1;
        drop(counts);
        std::thread::sleep(Duration::from_millis(hold_ms));
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        let load = (counts.serving + counts.waiting) * 100 / self.capacity.load(Ordering::Relaxed);
        counts.serving -= 1;
        drop(counts);
        self.free.notify_one();
        let n = self.served.fetch_add(1, Ordering::Relaxed);
        // Spread evenly: the n-th answer fails when it crosses a multiple of 100/percent.
        let fails = (n + 1) * self.args.fail_percent / 100 != n * self.args.fail_percent / 100;
        let status = if fails {
            "503 Service Unavailable"
        } else {
            "200 OK"
        };
        let cpu = match self.args.cpu_header.as_deref() {
            None => String::new(),
            Some(h) if h.eq_ignore_ascii_case("endpoint-load-metrics") => format!(
                "{h}: TEXT cpu_utilization={}.{:02}\r\n",
                load / 100,
                load % 100
            ),
            Some(h) => format!("{h}: {load}\r\n"),
        };
        format!("HTTP/1.1 {status}\r\ncontent-length: 3\r\n{cpu}\r\nok\n")
    }
}

/// `N` of a path `…/bytes/N`: a download of that many bytes.
fn bytes_asked(path: &str) -> Option<u64> {
    let (_, n) = path.split_once("/bytes/")?;
    n.split(['?', '/']).next()?.parse().ok()
}
