//! Open-loop load: requests are due at a fixed rate whether or not earlier ones were answered
//! (up to `connections` at once), and each one's latency counts from when it was due, so a slow
//! server cannot hide its queue by slowing the client down.

use crate::http::{read_head, skip_body};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::{BufReader, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    /// http://127.0.0.1:PORT/PATH
    #[arg(long)]
    url: String,
    /// Requests per second.
    #[arg(long)]
    rate: f64,
    #[arg(long)]
    seconds: f64,
    /// Requests due in the first seconds are sent but not counted.
    #[arg(long, default_value_t = 0.0)]
    warmup: f64,
    /// Connections (and so requests in flight) at most.
    #[arg(long, default_value_t = 256)]
    connections: usize,
    /// A class of requests: NAME:PERCENT[:HEADER=VALUE,...]; the rest are class "other".
    #[arg(long = "class")]
    classes: Vec<String>,
    /// Give up on an answer after this many seconds (counted as an error).
    #[arg(long, default_value_t = 10.0)]
    timeout: f64,
    /// Also print the statuses of every request by when it was due, in buckets of this many
    /// milliseconds (warm-up included), and the latencies of the 200s in ms ("ok_ms"):
    /// "timeline".
    #[arg(long)]
    bucket_ms: Option<u64>,
}

struct Class {
    name: String,
    percent: u64,
    headers: Vec<(String, String)>,
}

/// One bucket of the timeline: statuses (and "error") by count, and the 200s' latencies (ms).
type Bucket = (BTreeMap<String, u64>, Vec<u64>);

/// What came back for one class.
#[derive(Default)]
struct Tally {
    statuses: BTreeMap<u16, u64>,
    errors: u64,
    ok_latencies_us: Vec<u64>,
    /// When the last answer came, from the end of the warm-up.
    last_us: u64,
}

fn parse_class(s: &str) -> Result<Class, String> {
    let mut parts = s.splitn(3, ':');
    let name = parts.next().unwrap_or_default().to_string();
    let percent = parts
        .next()
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| format!("class {s:?}: NAME:PERCENT[:HEADER=VALUE,...]"))?;
    let headers = parts
        .next()
        .map(|h| {
            h.split(',')
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
        .unwrap_or_default();
    Ok(Class {
        name,
        percent,
        headers,
    })
}

pub fn run(args: &Args) -> Result<(), String> {
    let rest = args
        .url
        .strip_prefix("http://")
        .ok_or("--url must start with http://")?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let mut classes = args
        .classes
        .iter()
        .map(|c| parse_class(c))
        .collect::<Result<Vec<_>, _>>()?;
    let given: u64 = classes.iter().map(|c| c.percent).sum();
    if given > 100 {
        return Err("class percentages add up to more than 100".into());
    }
    classes.push(Class {
        name: "other".into(),
        percent: 100 - given,
        headers: Vec::new(),
    });
    let total = (args.rate * args.seconds) as u64;
    let interval_ns = 1e9 / args.rate;
    let start = Instant::now() + Duration::from_millis(50);
    let next = AtomicU64::new(0);
    let tallies: Vec<Mutex<Tally>> = classes.iter().map(|_| Mutex::default()).collect();
    let bucket_ns = args.bucket_ms.map(|ms| ms.max(1) * 1_000_000);
    let buckets = bucket_ns.map_or(0, |b| (args.seconds * 1e9) as u64 / b + 1);
    let timeline: Mutex<Vec<Bucket>> = Mutex::new(vec![Bucket::default(); buckets as usize]);
    let timeout = Duration::from_secs_f64(args.timeout);
    std::thread::scope(|s| {
        for _ in 0..args.connections.max(1) {
            s.spawn(|| {
                let mut conn: Option<(TcpStream, BufReader<TcpStream>)> = None;
                loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    if k >= total {
                        return;
                    }
                    let due = start + Duration::from_nanos((k as f64 * interval_ns) as u64);
                    if let Some(wait) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                    // Classes interleave: of every 100 requests, the first PERCENT go to the
                    // first class, and so on (in a spread order).
                    let slot = (k * 37) % 100;
                    let mut acc = 0;
                    let ci = classes
                        .iter()
                        .position(|c| {
                            acc += c.percent;
                            slot < acc
                        })
                        .unwrap_or(classes.len() - 1);
                    let mut request = format!("GET {path} HTTP/1.1\r\nhost: {authority}\r\n");
                    for (k, v) in &classes[ci].headers {
                        request.push_str(&format!("{k}: {v}\r\n"));
                    }
                    request.push_str("\r\n");
                    let result = exchange(&mut conn, authority, &request, timeout);
                    if let Some(b) = bucket_ns {
                        let i = (due.duration_since(start).as_nanos() as u64 / b) as usize;
                        let key = result.map_or("error".to_string(), |s| s.to_string());
                        let mut tl = timeline.lock().unwrap_or_else(PoisonError::into_inner);
                        if let Some((counts, ok_ms)) = tl.get_mut(i) {
                            *counts.entry(key).or_default() += 1;
                            if result == Some(200) {
                                ok_ms.push(due.elapsed().as_millis() as u64);
                            }
                        }
                    }
                    let counted = due.duration_since(start).as_secs_f64() >= args.warmup;
                    if !counted {
                        continue;
                    }
                    let mut t = tallies[ci].lock().unwrap_or_else(PoisonError::into_inner);
                    let since = start + Duration::from_secs_f64(args.warmup);
                    t.last_us = t.last_us.max(since.elapsed().as_micros() as u64);
                    match result {
                        Some(status) => {
                            *t.statuses.entry(status).or_default() += 1;
                            if status == 200 {
                                t.ok_latencies_us.push(due.elapsed().as_micros() as u64);
                            }
                        }
                        None => t.errors += 1,
                    }
                }
            });
        }
    });
    let measured = (args.seconds - args.warmup).max(1e-9);
    let mut out = serde_json::Map::new();
    let mut all = Tally::default();
    for (class, tally) in classes.iter().zip(tallies) {
        let t = tally.into_inner().unwrap_or_else(PoisonError::into_inner);
        for (s, n) in &t.statuses {
            *all.statuses.entry(*s).or_default() += n;
        }
        all.errors += t.errors;
        all.last_us = all.last_us.max(t.last_us);
        all.ok_latencies_us.extend_from_slice(&t.ok_latencies_us);
        if class.percent > 0 {
            out.insert(class.name.clone(), summary(t, measured));
        }
    }
    out.insert("all".into(), summary(all, measured));
    if bucket_ns.is_some() {
        let tl: Vec<Value> = timeline
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
            .into_iter()
            .map(|(counts, ok_ms)| {
                let mut bucket = json!(counts);
                bucket["ok_ms"] = json!(ok_ms);
                bucket
            })
            .collect();
        out.insert("timeline".into(), json!(tl));
    }
    println!("{}", Value::Object(out));
    Ok(())
}

fn summary(mut t: Tally, seconds: f64) -> Value {
    t.ok_latencies_us.sort_unstable();
    let pct = |p: f64| -> f64 {
        if t.ok_latencies_us.is_empty() {
            return 0.0;
        }
        let i = ((t.ok_latencies_us.len() as f64 * p).ceil() as usize)
            .clamp(1, t.ok_latencies_us.len());
        t.ok_latencies_us[i - 1] as f64 / 1000.0
    };
    let sent: u64 = t.statuses.values().sum::<u64>() + t.errors;
    let ok = t.statuses.get(&200).copied().unwrap_or(0);
    // Answers per second of the time they took to come (at least the time they were due in).
    let took = seconds.max(t.last_us as f64 / 1e6);
    json!({
        "sent": sent,
        "ok": ok,
        "ok_per_s": ok as f64 / took,
        "seconds": took,
        "errors": t.errors,
        "statuses": t.statuses.iter().map(|(s, n)| (s.to_string(), json!(n))).collect::<serde_json::Map<_, _>>(),
        "p50_ms": pct(0.5),
        "p99_ms": pct(0.99),
    })
}

/// Send one request on the connection (opened if needed) and read the answer's status.
fn exchange(
    conn: &mut Option<(TcpStream, BufReader<TcpStream>)>,
    authority: &str,
    request: &str,
    timeout: Duration,
) -> Option<u16> {
    for _ in 0..2 {
        let reused = conn.is_some();
        if conn.is_none() {
            let stream = TcpStream::connect(authority).ok()?;
            stream.set_nodelay(true).ok()?;
            stream.set_read_timeout(Some(timeout)).ok()?;
            let reader = BufReader::new(stream.try_clone().ok()?);
            *conn = Some((stream, reader));
        }
        let (stream, reader) = conn.as_mut()?;
        let answer = stream
            .write_all(request.as_bytes())
            .and_then(|()| read_head(reader));
        let head = match answer {
            Ok(Some(head)) => head,
            // A kept-alive connection the server closed since the last request: once more on a
            // new one (not after a timeout: the request may still be served).
            Ok(None) => {
                *conn = None;
                if reused {
                    continue;
                }
                return None;
            }
            Err(e) => {
                *conn = None;
                let closed = matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::BrokenPipe
                        | std::io::ErrorKind::UnexpectedEof
                );
                if reused && closed {
                    continue;
                }
                return None;
            }
        };
        let status = head.first.split(' ').nth(1).and_then(|s| s.parse().ok());
        let keep = skip_body(reader, &head).is_ok()
            && !head
                .header("connection")
                .is_some_and(|c| c.eq_ignore_ascii_case("close"));
        if !keep {
            *conn = None;
        }
        return status;
    }
    None
}
