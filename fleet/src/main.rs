//! `tollgate-fleet`: run one simulated fleet and print what it found as JSON.

use clap::Parser;
use tollgate_fleet::{run, Event, Keys, Scenario};

#[derive(Parser)]
#[command(about = "Simulate a fleet of proxies over the real lease code (virtual time)")]
struct Args {
    #[arg(long, default_value_t = 100)]
    proxies: usize,
    #[arg(long, default_value_t = 2)]
    workers: u64,
    /// uniform, zipf or hot.
    #[arg(long, default_value = "zipf")]
    keys: String,
    /// Keys for uniform and zipf.
    #[arg(long, default_value_t = 100_000)]
    key_count: u32,
    /// Each key's limit: requests per second, and burst.
    #[arg(long, default_value_t = 100)]
    rate: u64,
    #[arg(long, default_value_t = 100)]
    burst: u64,
    /// Requests per second over the fleet.
    #[arg(long, default_value_t = 20_000.0)]
    fleet_rate: f64,
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// Move demand between proxies every this many ms (0: never).
    #[arg(long, default_value_t = 0)]
    shift_ms: u64,
    /// Every this many ms the fleet sends 4× its rate for 500 ms (0: never).
    #[arg(long, default_value_t = 0)]
    bursts_ms: u64,
    /// Restart this share of the proxies halfway.
    #[arg(long)]
    crash: Option<f64>,
    /// The service loses every bucket halfway.
    #[arg(long)]
    store_loss: bool,
    /// Cut this share of the proxies off the service for the middle fifth of the run.
    #[arg(long)]
    partition: Option<f64>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The service's lease TTL (`--lease-ttl-ms`).
    #[arg(long, default_value_t = 10_000)]
    ttl_ms: u64,
    /// The calls' round trip (ms), plus up to `--rtt-jitter-ms` more, and the share of calls lost.
    #[arg(long, default_value_t = 2)]
    rtt_ms: u64,
    #[arg(long, default_value_t = 0)]
    rtt_jitter_ms: u64,
    #[arg(long, default_value_t = 0.0)]
    call_loss: f64,
    /// `quota_service.lease_size` (default: burst / (4 × proxies), 1 to 1 000).
    #[arg(long)]
    lease_size: Option<u64>,
}

fn main() {
    let a = Args::parse();
    let keys = match a.keys.as_str() {
        "uniform" => Keys::Uniform(a.key_count),
        "hot" => Keys::Hot,
        _ => Keys::Zipf {
            n: a.key_count,
            s: 1.1,
        },
    };
    let mut s = Scenario::new(
        &a.keys,
        a.proxies,
        keys,
        (a.rate, 1_000, a.burst),
        a.fleet_rate,
    );
    s.workers = a.workers;
    s.seconds = a.seconds;
    s.shift_ms = a.shift_ms;
    s.bursts_ms = a.bursts_ms;
    s.seed = a.seed;
    s.ttl_ms = a.ttl_ms;
    s.lease_size = a.lease_size;
    s.rtt_ms = a.rtt_ms;
    s.rtt_jitter_ms = a.rtt_jitter_ms;
    s.call_loss = a.call_loss;
    let half = a.seconds * 500;
    if let Some(share) = a.crash {
        s.events.push(Event::Crash { at_ms: half, share });
    }
    if a.store_loss {
        s.events.push(Event::StoreLoss { at_ms: half });
    }
    if let Some(share) = a.partition {
        s.events.push(Event::Partition {
            from_ms: a.seconds * 400,
            until_ms: a.seconds * 600,
            share,
        });
    }
    let report = run(&s);
    println!("{}", serde_json::json!({"scenario": s, "report": report}));
}
