//! `tollgate check CONFIG.json`: validate a plugin configuration with the filter's own code, as
//! it would be when the proxy loads it — before it is deployed (`nginx -t` never runs the filter,
//! and Envoy only refuses a bad configuration once it is pushed).

use clap::{Parser, Subcommand, ValueEnum};
use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;
use tollgate::config::{Config, HostCaps};

/// Shared data nginx (ngx_wasm_module) needs per slot: 128–129 bytes measured (docs/nginx.md),
/// with room to spare.
const NGINX_BYTES_PER_SLOT: u64 = 136;
/// Room in an nginx `shm_kv` zone for tollgate's own few keys and the zone's bookkeeping.
const NGINX_ZONE_MARGIN: u64 = 64 * 1024;
/// Shared data nginx needs per overload rule window (256 bytes and the entry's bookkeeping).
const NGINX_BYTES_PER_WINDOW: u64 = 640;
/// The smallest zone nginx accepts.
const NGINX_MIN_ZONE: u64 = 15 * 1024;

#[derive(Parser)]
#[command(name = "tollgate", version, about = "tollgate's command line")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check a plugin configuration: print a summary and exit 0 if the filter would load it,
    /// else print the field that is wrong and why, and exit 1.
    Check {
        /// The configuration as JSON; `-` reads it from standard input.
        config: PathBuf,
        /// Also refuse what this proxy cannot do (without it: a warning for each host that
        /// would refuse the configuration).
        #[arg(long, value_enum)]
        host: Option<Host>,
    },
    /// Print what a global rule's bucket for one client is called at the quota service — the
    /// limit id and key hash the filter sends — and its admin API paths (docs/quota-api.md).
    QuotaKey {
        /// The plugin configuration as JSON (its `key_secret` names the keys); `-` reads it from
        /// standard input.
        config: PathBuf,
        /// The global rule.
        #[arg(long)]
        rule: String,
        /// A calendar quota's period at this time (RFC 3339, `2026-12-01T00:05:00+01:00`) rather
        /// than now: for a quota service run with `--calendar-clock`, or a period gone by.
        #[arg(long)]
        at: Option<String>,
        /// The client's value for each part of the rule's `key`, in order, as requests carry them
        /// (an IP address for `client_ip`, a header's value, a path, …).
        #[arg(required = true)]
        values: Vec<std::ffi::OsString>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Host {
    /// Envoy with the Wasm build (`tollgate.wasm`).
    Envoy,
    /// Envoy with the native build, a dynamic module (`libtollgate.so`).
    EnvoyModule,
    Nginx,
}

impl Host {
    fn caps(self) -> HostCaps {
        match self {
            Self::Envoy => HostCaps::ENVOY,
            Self::EnvoyModule => HostCaps::ENVOY_MODULE,
            Self::Nginx => HostCaps::NGINX,
        }
    }
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Check { config, host } => check(config, host),
        Command::QuotaKey {
            config,
            rule,
            at,
            values,
        } => quota_key(config, &rule, at.as_deref(), &values),
    }
}

/// The configuration at `path`, or the exit code for why not (printed).
fn load(path: &PathBuf) -> Result<Config, ExitCode> {
    let name = path.display();
    let bytes = read(path).map_err(|e| {
        eprintln!("{name}: cannot read: {e}");
        ExitCode::from(2)
    })?;
    Config::parse(&bytes).map_err(|e| {
        eprintln!("{name}: {e}");
        ExitCode::FAILURE
    })
}

fn quota_key(
    path: PathBuf,
    rule: &str,
    at: Option<&str>,
    values: &[std::ffi::OsString],
) -> ExitCode {
    use std::os::unix::ffi::OsStrExt;
    let config = match load(&path) {
        Ok(config) => config,
        Err(code) => return code,
    };
    let values: Vec<&[u8]> = values.iter().map(|v| v.as_bytes()).collect();
    let now_ms = match at {
        None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
        Some(at) => {
            match tollgate_core::calendar::rfc3339_ms(at) {
                Some(ms) => ms,
                None => {
                    eprintln!("--at {at:?} is not an RFC 3339 time after 1970 (2026-12-01T00:05:00+01:00)");
                    return ExitCode::from(2);
                }
            }
        }
    };
    let period_of = move |unit, zone: &str| tollgate_core::calendar::period_at(unit, zone, now_ms);
    match config.service_bucket(rule, &values, &period_of) {
        Ok((limit_id, key)) => {
            println!("limit_id: {limit_id}");
            println!("key: {key}");
            println!("GET  /admin/v1/buckets/{limit_id}/{key}");
            println!("POST /admin/v1/buckets/{limit_id}/{key}/reset");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{}: {e}", path.display());
            ExitCode::FAILURE
        }
    }
}

fn check(config: PathBuf, host: Option<Host>) -> ExitCode {
    let name = config.display().to_string();
    let parsed = match load(&config) {
        Ok(parsed) => parsed,
        Err(code) => return code,
    };
    if let Some(host) = host {
        if let Err(e) = parsed.check_host(&host.caps()) {
            eprintln!("{name}: {e}");
            return ExitCode::FAILURE;
        }
    }
    println!("{name}: ok: {}", parsed.summary());
    let (slots, windows) = (parsed.slots(), parsed.windows());
    // The status path's counts: per rule with a limit, its 32 keys (41 bytes and the key shown
    // each) and the entry's bookkeeping.
    let status = parsed.status.as_ref().map_or(0, |s| {
        let rules = parsed.rules.iter().filter(|r| r.quota().is_some()).count() as u64;
        rules * (32 * (41 + s.max_key_bytes as u64) + 256) + 256
    });
    let zone = (slots * NGINX_BYTES_PER_SLOT
        + windows * NGINX_BYTES_PER_WINDOW
        + status
        + NGINX_ZONE_MARGIN)
        .max(NGINX_MIN_ZONE);
    let windows = match windows {
        0 => String::new(),
        n => format!(", {n} overload windows"),
    };
    // nginx refuses zone sizes that are not whole pages: whole 64 KiB it is.
    println!(
        "shared data: {slots} slots{windows}; on nginx: shm_kv * {}k eviction=none; (or larger)",
        zone.div_ceil(64 * 1024) * 64
    );
    if parsed.rules.iter().any(|r| r.global().is_some())
        && !matches!(host, Some(Host::Envoy | Host::EnvoyModule))
    {
        println!(
            "note: on nginx, global rules need `proxy_wasm_request_headers_in_access on;` \
             (docs/nginx.md)"
        );
    }
    if parsed.reads_request_body && !matches!(host, Some(Host::Nginx)) {
        if !matches!(host, Some(Host::EnvoyModule)) {
            println!(
                "note: in Envoy, rules that read the request body need \
                 `allow_on_headers_stop_iteration: true` in the wasm filter's config \
                 (docs/llm-budgets.md)"
            );
        }
        if parsed.max_request_body_bytes >= 1 << 20 {
            println!(
                "note: in Envoy, max_request_body_bytes ({}) is not below the default \
                 per_connection_buffer_limit_bytes (1 MiB): a body Envoy stops holding there is \
                 decided as one too long to read unless the listener's limit is raised",
                parsed.max_request_body_bytes
            );
        }
    }
    if parsed.rules.iter().any(|r| r.pace().is_some()) && !matches!(host, Some(Host::Nginx)) {
        println!(
            "note: in Envoy, a paced body lasts as long as its bytes take at the rate: give the \
             route a timeout that long (Envoy's default is 15 s; \"timeout\": \"0s\" for none); \
             held bodies go on in steps of about twice per_connection_buffer_limit_bytes \
             (listener and cluster): lower both for smoother delivery"
        );
    }
    for warning in parsed.warnings() {
        println!("warning: {warning}");
    }
    if host.is_none() {
        for caps in [HostCaps::ENVOY, HostCaps::ENVOY_MODULE, HostCaps::NGINX] {
            if let Err(e) = parsed.check_host(&caps) {
                println!("warning: {} would refuse it: {e}", caps.name);
            }
        }
    }
    ExitCode::SUCCESS
}

fn read(path: &PathBuf) -> std::io::Result<Vec<u8>> {
    if path.as_os_str() == "-" {
        let mut bytes = Vec::new();
        std::io::stdin().read_to_end(&mut bytes)?;
        Ok(bytes)
    } else {
        std::fs::read(path)
    }
}
