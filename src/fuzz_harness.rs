//! What the fuzz targets run, shared by the property tests (`src/fuzz.rs`) and the `cargo fuzz`
//! targets (`fuzz/`): configurations, requests of arbitrary bytes and quota answers through the
//! parser and the engine. Nothing here may panic on any input.

use crate::config::{Config, HostCaps};
use crate::engine::{read_answer, read_permit_answer, Call, Engine, Inputs, Step};
use crate::request::{Request, RequestView};
use tollgate_core::slot::KeyPlacement;
use tollgate_core::MemoryStore;

pub const NOW: u64 = 1_700_000_000_000_000_000;
pub const MS: u64 = 1_000_000;

/// Valid configurations to mutate (each parses: `src/fuzz.rs`): every JSON example of docs/configuration.md, and a few that
/// reach the options those do not show.
pub fn config_seeds() -> &'static [&'static str] {
    static SEEDS: std::sync::OnceLock<Vec<&'static str>> = std::sync::OnceLock::new();
    SEEDS.get_or_init(|| {
        let docs = include_str!("../docs/configuration.md");
        let mut seeds: Vec<&'static str> = docs
            .split("```json")
            .skip(1)
            .filter_map(|block| block.split("```").next())
            .filter(|text| text.contains("\"rules\""))
            .collect();
        seeds.extend([
            r#"{"rules":[{"name":"o","key":["header:x-user","path"],"limit":{"requests":5,"per":"1s"},
                "burst":10,"cost":{"header":"x-cost","default":1,"max":20},"worker_batch":4,
                "overrides":[{"values":["vip","/"],"limit":{"requests":50,"per":"1s"}},
                             {"values":["x","/a"],"block":true}],
                "response":{"status":503,"body":"slow down","headers":{"x-why":"limit"}}}],
                "client_ip":{"trusted_hops":1,"ipv6_prefix":56}}"#,
            r#"{"rules":[{"name":"w","algorithm":"sliding_window","limit":{"requests":3,"per":"10s"}},
                {"name":"f","algorithm":"fixed_window","limit":{"requests":3,"per":"10s"},"dry_run":true},
                {"name":"l","algorithm":"leaky_bucket","limit":{"requests":2,"per":"1s"},"burst":3,
                 "max_delay":"2s"},
                {"name":"c","algorithm":"concurrency","limit":{"concurrent":2},"key":["client_ip"]}]}"#,
            r#"{"rules":[{"name":"g","scope":"global","limit":{"requests":10,"per":"1s"},"key":["header:x-t"]},
                {"name":"l","limit":{"requests":2,"per":"1s"}}],
                "quota_service":{"upstream":"q","mode":"strict","failure_mode":"deny","timeout":"100ms",
                 "key_secret":"0123456789abcdef"}}"#,
            r#"{"rules":[{"name":"gc","scope":"global","algorithm":"concurrency","limit":{"concurrent":4}},
                {"name":"g","scope":"global","limit":{"requests":10,"per":"1s"}}],
                "quota_service":{"upstream":"q","first_lease":"provisional","failure_mode":"local",
                 "instances_hint":2,"lease_size":3}}"#,
        ]);
        seeds
    })
}

/// Give every rule of `doc` a small table unless it names one: creating 10 000 slots per rule
/// would be all a run does.
pub fn with_small_tables(doc: &mut serde_json::Value) {
    if let Some(serde_json::Value::Array(rules)) = doc.get_mut("rules") {
        for rule in rules {
            if let serde_json::Value::Object(m) = rule {
                m.entry("max_keys").or_insert(serde_json::json!(16));
            }
        }
    }
}

/// [`config_seeds`] with small tables.
pub fn small_seeds() -> &'static [String] {
    static SEEDS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    SEEDS.get_or_init(|| {
        config_seeds()
            .iter()
            .filter_map(|seed| {
                let mut doc: serde_json::Value = serde_json::from_str(seed).ok()?;
                with_small_tables(&mut doc);
                Some(doc.to_string())
            })
            .collect()
    })
}

/// Header names requests are made of.
pub const HEADER_NAMES: &[&str] = &[
    "x-user",
    "x-api-key",
    ":path",
    ":method",
    ":authority",
    "host",
    "x-forwarded-for",
    "x-cost",
    "x-tier",
    "cookie",
    "authorization",
];

#[derive(Debug)]
pub struct Bytes {
    pub headers: Vec<(String, Vec<u8>)>,
    pub peer: Vec<u8>,
}

impl RequestView for Bytes {
    fn header(&self, name: &str) -> Option<crate::request::Value<'_>> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| std::borrow::Cow::Borrowed(&v[..]))
    }
    fn source_address(&self) -> Option<crate::request::Value<'_>> {
        Some(std::borrow::Cow::Borrowed(&self.peer[..]))
    }
}

impl Bytes {
    /// A request from raw bytes: the peer address up to the first newline, then one header per
    /// line, its name chosen by the line's first byte.
    pub fn from_raw(data: &[u8]) -> Self {
        let mut lines = data.split(|&b| b == b'\n');
        let peer = lines.next().unwrap_or_default().to_vec();
        let headers = lines
            .take(8)
            .filter_map(|line| {
                let (&first, value) = line.split_first()?;
                let name = HEADER_NAMES[usize::from(first) % HEADER_NAMES.len()];
                Some((name.to_owned(), value.to_vec()))
            })
            .collect();
        Self { headers, peer }
    }
}

/// Decide `r` at `now` with `engine`, as the filter does (the strict path included).
pub fn decide(engine: &mut Engine, store: &MemoryStore, r: &Bytes, now: u64) {
    let trusted = engine.config().client_ip;
    let mut inputs = Inputs::new();
    if engine
        .gather(&Request::new(r, trusted), &mut inputs)
        .is_some()
        || inputs.is_empty()
    {
        return;
    }
    if engine.is_strict(&inputs) {
        let strict = engine.split(inputs, now);
        let _ = engine.local_refusal(store, &strict.locals, now);
        let _ = engine.finish_strict(store, strict, None, now);
        return;
    }
    if let Step::Admit(a) = engine.evaluate(store, &mut inputs, now, false) {
        engine.release(store, a.holds, now);
    }
}

/// Parse `config`; if it parses, check it for both hosts, and for Envoy run `requests` through
/// it, return the stashes and collect the refills.
/// Its rules' tables are made small (as [`with_small_tables`]) before it runs.
pub fn run_configuration(config: &[u8], requests: &[Bytes]) {
    if Config::parse(config).is_err() {
        return;
    }
    let Ok(mut doc) = serde_json::from_slice::<serde_json::Value>(config) else {
        return;
    };
    with_small_tables(&mut doc);
    let Ok(mut config) = Config::parse(doc.to_string().as_bytes()) else {
        return;
    };
    let _ = config.check_host(&HostCaps::NGINX);
    if config.check_host(&HostCaps::ENVOY).is_err() {
        return;
    }
    config.fit_host(&HostCaps::ENVOY);
    let mut engine = Engine::new(config, KeyPlacement::new([3; 16]));
    let store = MemoryStore::new();
    if engine.initialize(&store).is_err() {
        return;
    }
    for (i, r) in requests.iter().enumerate() {
        decide(&mut engine, &store, r, NOW + i as u64 * MS);
    }
    engine.return_stashes(&store, NOW + 100 * MS);
    let _ = engine.take_refills(&store, "fuzz", NOW + 100 * MS);
}

/// Answer a global rule's and a global concurrency rule's refills for `r` with these bodies and
/// status, then decide `r` again.
pub fn run_quota_answers(status: &[u8], lease_body: &[u8], slot_body: &[u8], r: &Bytes) {
    let config = br#"{"rules": [
        {"name": "g", "scope": "global", "limit": {"requests": 10, "per": "1s"}, "max_keys": 16},
        {"name": "c", "scope": "global", "algorithm": "concurrency", "limit": {"concurrent": 5},
         "max_keys": 16}],
      "quota_service": {"upstream": "quota", "first_lease": "provisional"}}"#;
    let Ok(config) = Config::parse(config) else {
        return;
    };
    let mut engine = Engine::new(config, KeyPlacement::new([3; 16]));
    let store = MemoryStore::new();
    if engine.initialize(&store).is_err() {
        return;
    }
    decide(&mut engine, &store, r, NOW);
    for call in engine.take_refills(&store, "fuzz", NOW + 5 * MS) {
        match call {
            Call::Lease(refills, _) => {
                let answer = read_answer(Some(status), Some(lease_body), refills.len());
                engine.apply_grants(&store, &refills, answer.as_ref(), NOW + 6 * MS);
            }
            Call::Permits(refills, _) => {
                let answer = read_permit_answer(Some(status), Some(slot_body), refills.len());
                engine.apply_permits(&store, &refills, answer.as_ref(), NOW + 6 * MS);
            }
            Call::GiveBack(_) => {}
        }
    }
    decide(&mut engine, &store, r, NOW + 7 * MS);
}
