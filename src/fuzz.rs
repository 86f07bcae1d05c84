//! Fuzzing by property tests (`make fuzz` runs them with many more cases): configurations and
//! quota answers built from their formats' own field names, and requests of arbitrary bytes, go
//! through the parser and the engine; nothing may panic.

use crate::config::{Config, HostCaps};
use crate::engine::{read_answer, read_slot_answer, Call, Engine, Inputs, Step};
use crate::request::{Request, RequestView};
use proptest::prelude::*;
use serde_json::{json, Value};
use tollgate_core::arbitrary_json::{mutated, schema_names, value};
use tollgate_core::slot::KeyPlacement;
use tollgate_core::MemoryStore;

const NOW: u64 = 1_700_000_000_000_000_000;
const MS: u64 = 1_000_000;

/// The configuration's field names, from its schema.
fn config_names() -> &'static [&'static str] {
    static NAMES: std::sync::OnceLock<Vec<&'static str>> = std::sync::OnceLock::new();
    NAMES.get_or_init(|| {
        let schema: Value =
            serde_json::from_str(include_str!("../schema/tollgate.schema.json")).unwrap();
        schema_names(&schema)
            .into_iter()
            .map(|n| &*Box::leak(n.into_boxed_str()))
            .collect()
    })
}

/// Valid configurations to mutate: every JSON example of docs/configuration.md, and a few that
/// reach the options those do not show.
fn config_seeds() -> &'static [&'static str] {
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
        for seed in &seeds {
            if let Err(e) = Config::parse(seed.as_bytes()) {
                panic!("seed refused: {e}\n{seed}");
            }
        }
        seeds
    })
}

const STATUSES: &[&[u8]] = &[b"200", b"503", b"", b"2000"];

const ANSWER_NAMES: &[&str] = &[
    "items",
    "granted",
    "ttl_ms",
    "remaining",
    "reset_ms",
    "rate",
    "retry_ms",
    "held",
    "share",
    "free",
];

#[derive(Debug)]
struct Bytes {
    headers: Vec<(String, Vec<u8>)>,
    peer: Vec<u8>,
}

impl RequestView for Bytes {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    }
    fn source_address(&self) -> Option<Vec<u8>> {
        Some(self.peer.clone())
    }
}

fn request() -> impl Strategy<Value = Bytes> {
    let name = proptest::sample::select(
        &[
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
        ][..],
    );
    (
        proptest::collection::vec((name, proptest::collection::vec(any::<u8>(), 0..40)), 0..6),
        proptest::collection::vec(any::<u8>(), 0..48),
    )
        .prop_map(|(headers, peer)| Bytes {
            headers: headers
                .into_iter()
                .map(|(n, v)| (n.to_owned(), v))
                .collect(),
            peer,
        })
}

/// Decide `r` at `now` with `engine`, as the filter does (the strict path included).
fn decide(engine: &mut Engine, store: &MemoryStore, r: &Bytes, now: u64) {
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
        let strict = engine.split(inputs);
        let _ = engine.local_refusal(store, &strict.locals, now);
        let _ = engine.finish_strict(store, strict, None, now);
        return;
    }
    if let Step::Admit(a) = engine.evaluate(store, &mut inputs, now, false) {
        engine.release(store, a.holds, now);
    }
}

/// A configuration document: a valid one with a few changes.
fn config_document() -> impl Strategy<Value = Value> {
    mutated(config_seeds(), config_names()).prop_map(|mut doc| {
        // Small tables: creating 10 000 slots per rule and case would be all the run does.
        if let Some(Value::Array(rules)) = doc.get_mut("rules") {
            for rule in rules {
                if let Value::Object(m) = rule {
                    m.entry("max_keys").or_insert(json!(16));
                }
            }
        }
        doc
    })
}

proptest! {
    #[test]
    fn fuzz_configuration_bytes_are_parsed_or_refused(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = Config::parse(&bytes);
    }

    /// Whatever configuration parses runs: load checks for both hosts, slots created, requests
    /// decided, ticks.
    #[test]
    fn fuzz_configurations_parse_or_are_refused_and_what_parses_runs(
        doc in config_document(),
        requests in proptest::collection::vec(request(), 1..4),
    ) {
        let Ok(mut config) = Config::parse(doc.to_string().as_bytes()) else {
            return Ok(());
        };
        let _ = config.check_host(&HostCaps::NGINX);
        if config.check_host(&HostCaps::ENVOY).is_err() {
            return Ok(());
        }
        config.fit_host(&HostCaps::ENVOY);
        let mut engine = Engine::new(config, KeyPlacement::new([3; 16]));
        let store = MemoryStore::new();
        if engine.initialize(&store).is_err() {
            return Ok(());
        }
        for (i, r) in requests.iter().enumerate() {
            decide(&mut engine, &store, r, NOW + i as u64 * MS);
        }
        engine.return_stashes(&store, NOW + 100 * MS);
        let _ = engine.take_refills(&store, "fuzz", NOW + 100 * MS);
    }

    /// Quota answers of any shape, well-formed or not, are read safely and applied.
    #[test]
    fn fuzz_quota_answers_are_read_safely_and_applied(
        lease_answer in value(ANSWER_NAMES, 3),
        slot_answer in value(ANSWER_NAMES, 3),
        status in proptest::sample::select(STATUSES),
        r in request(),
    ) {
        let config = json!({
            "rules": [
                {"name": "g", "scope": "global", "limit": {"requests": 10, "per": "1s"},
                 "max_keys": 16},
                {"name": "c", "scope": "global", "algorithm": "concurrency",
                 "limit": {"concurrent": 5}, "max_keys": 16}
            ],
            "quota_service": {"upstream": "quota", "first_lease": "provisional"}
        });
        let config = Config::parse(config.to_string().as_bytes()).unwrap();
        let mut engine = Engine::new(config, KeyPlacement::new([3; 16]));
        let store = MemoryStore::new();
        engine.initialize(&store).unwrap();
        decide(&mut engine, &store, &r, NOW);
        let lease_body = lease_answer.to_string();
        let slot_body = slot_answer.to_string();
        for call in engine.take_refills(&store, "fuzz", NOW + 5 * MS) {
            match call {
                Call::Lease(refills, _) => {
                    let answer = read_answer(Some(status), Some(lease_body.as_bytes()), refills.len());
                    engine.apply_grants(&store, &refills, answer.as_ref(), NOW + 6 * MS);
                }
                Call::Slots(refills, _) => {
                    let answer = read_slot_answer(Some(status), Some(slot_body.as_bytes()), refills.len());
                    engine.apply_slots(&store, &refills, answer.as_ref(), NOW + 6 * MS);
                }
                Call::GiveBack(_) => {}
            }
        }
        decide(&mut engine, &store, &r, NOW + 7 * MS);
    }
}
