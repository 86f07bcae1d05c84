//! One credential at its share of the memory store sends new keys without pause: how long
//! another credential's lease calls take meanwhile (docs/quota-api.md has the figures).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use testkit::{Client, Quota};
use tollgate_core::global::lease::{LeaseItem, LeaseRequest, LeaseResponse};

const A: &str = "Bearer aaaaaaaaaaaaaaaa";
const B: &str = "Bearer bbbbbbbbbbbbbbbb";
/// How often B calls: a proxy renewing its leases, not a load of its own.
const B_EVERY: Duration = Duration::from_millis(2);
const B_KEYS: usize = 100;

struct Settings {
    keys: usize,
    seconds: u64,
    rounds: usize,
    /// A's connections, each sending its calls back to back.
    flooders: usize,
}

impl Settings {
    /// From `--keys`, `--seconds`, `--rounds` (cargo's own `--bench` is passed over).
    fn from_args() -> Self {
        let mut s = Self {
            keys: 200_000,
            seconds: 5,
            rounds: 3,
            flooders: 1,
        };
        let args: Vec<String> = std::env::args().skip(1).collect();
        for pair in args.windows(2) {
            let n = || {
                pair[1]
                    .parse()
                    .unwrap_or_else(|_| panic!("{} {}", pair[0], pair[1]))
            };
            match pair[0].as_str() {
                "--keys" => s.keys = n(),
                "--seconds" => s.seconds = n() as u64,
                "--rounds" => s.rounds = n(),
                "--flooders" => s.flooders = n(),
                _ => {}
            }
        }
        s
    }
}

/// An item of a 1-a-day limit (its bucket stays live for a day once a token is taken), or of
/// 100/s with a rate lease asked for (`rated`).
fn item(key: String, rated: bool) -> LeaseItem {
    let (requests, per_ms, demand) = if rated {
        (100, 1_000, 50.0)
    } else {
        (1, 86_400_000, 0.0)
    };
    LeaseItem {
        rule: "r".into(),
        limit_id: "lim".into(),
        key,
        requests,
        per_ms,
        burst: 100,
        wanted: 1,
        demand,
        ..LeaseItem::default()
    }
}

/// A lease call as `auth`: the answer.
fn lease(client: &Client, url: &str, auth: &str, items: Vec<LeaseItem>) -> LeaseResponse {
    let body = serde_json::to_vec(&LeaseRequest {
        instance: "p".into(),
        items,
    })
    .unwrap();
    let headers = [
        ("authorization", auth),
        ("content-type", "application/json"),
    ];
    let reply = client.post(url, &headers, &body);
    assert_eq!(reply.status, 200, "{}", reply.body);
    serde_json::from_str(&reply.body).unwrap()
}

/// B's call times over `seconds`, one call every [`B_EVERY`] (at once when the last was late).
fn b_calls(url: &str, seconds: u64) -> Vec<Duration> {
    let client = Client::new();
    let mut took = Vec::new();
    let end = Instant::now() + Duration::from_secs(seconds);
    let mut next = Instant::now();
    while next < end {
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
        let key = format!("b-{}", took.len() % B_KEYS);
        let started = Instant::now();
        let answer = lease(&client, url, B, vec![item(key, true)]);
        took.push(started.elapsed());
        assert!(answer.errors.is_empty(), "{answer:?}");
        next += B_EVERY;
    }
    took
}

/// p50, p99 and the slowest, in ms.
fn summary(mut took: Vec<Duration>) -> String {
    took.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let at = |q: usize| ms(took[(took.len() * q / 100).min(took.len() - 1)]);
    format!(
        "p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} calls)",
        at(50),
        at(99),
        ms(took[took.len() - 1]),
        took.len()
    )
}

/// `cargo bench -p tollgate-quota --bench full_share [-- --keys N --seconds S --rounds R
/// --flooders F]`: the service cargo built for the bench (or `TOLLGATE_QUOTA_BIN`), `--max-keys
/// 2N` over two proxy tokens, so each has a share of N (default 200 000). Credential A fills its
/// share with buckets that stay live (1 a day), then, in each round, credential B leases one known
/// key every 2 ms for S seconds alone, then S seconds more while A sends one new key per call back
/// to back (each refused: A is at its share), on F connections (default 1). B's latencies are
/// pooled over the rounds.
fn main() {
    let s = Settings::from_args();
    if std::env::var_os("TOLLGATE_QUOTA_BIN").is_none() {
        std::env::set_var("TOLLGATE_QUOTA_BIN", env!("CARGO_BIN_EXE_tollgate-quota"));
    }
    let max_keys = (2 * s.keys).to_string();
    let quota = Quota::start(&[
        "--max-keys",
        &max_keys,
        "--proxy-token",
        "edge-a=aaaaaaaaaaaaaaaa",
        "--proxy-token",
        "edge-b=bbbbbbbbbbbbbbbb",
        "--cold-start",
        "full",
    ]);
    let url = format!("http://127.0.0.1:{}/v1/lease", quota.port);
    let client = Client::new();
    let started = Instant::now();
    for first in (0..s.keys).step_by(1_000) {
        let items = (first..(first + 1_000).min(s.keys))
            .map(|i| item(format!("a-{i}"), false))
            .collect();
        let answer = lease(&client, &url, A, items);
        assert!(
            answer.errors.is_empty(),
            "filling: {:?}",
            answer.errors.first()
        );
    }
    let refused = lease(&client, &url, A, vec![item("one-more".into(), false)]);
    let why = refused.errors;
    assert!(
        why.first()
            .is_some_and(|e| e.error.contains("share of the store is full")),
        "A is not at its share: {why:?}"
    );
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average before: {}", load.trim());
    let status = std::fs::read_to_string(format!("/proc/{}/status", quota.pid())).unwrap();
    let rss = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .unwrap_or("VmRSS: ?");
    println!(
        "A made its share, {} keys, in {:.1} s (the service's {}); A's new keys are refused: {}",
        s.keys,
        started.elapsed().as_secs_f64(),
        rss.split_whitespace().collect::<Vec<_>>().join(" "),
        why[0].error
    );
    let (mut alone, mut flooded) = (Vec::new(), Vec::new());
    let flood_calls = AtomicU64::new(0);
    for _ in 0..s.rounds {
        alone.extend(b_calls(&url, s.seconds));
        let stop = AtomicBool::new(false);
        std::thread::scope(|scope| {
            for _ in 0..s.flooders {
                scope.spawn(|| {
                    let client = Client::new();
                    while !stop.load(Ordering::Relaxed) {
                        let n = flood_calls.fetch_add(1, Ordering::Relaxed);
                        lease(&client, &url, A, vec![item(format!("new-{n}"), false)]);
                    }
                });
            }
            flooded.extend(b_calls(&url, s.seconds));
            stop.store(true, Ordering::Relaxed);
        });
    }
    let flood_rate =
        flood_calls.load(Ordering::Relaxed) as f64 / (s.rounds as u64 * s.seconds) as f64;
    println!("B alone:                 {}", summary(alone));
    println!(
        "B while A floods:        {} (A: {flood_rate:.0} calls/s on {} connections, each \
         call with a new key)",
        summary(flooded),
        s.flooders
    );
}
