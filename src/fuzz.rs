//! Fuzzing by property tests (`make fuzz` runs them with many more cases): configurations and
//! quota answers built from their formats' own field names, and requests of arbitrary bytes, go
//! through the parser and the engine; nothing may panic.

// Test code only (`#[cfg(test)] mod fuzz;` in lib.rs): a panic here is a failing test.
#![cfg(test)]

use crate::config::Config;
use crate::fuzz_harness::{
    config_seeds, run_configuration, run_quota_answers, with_small_tables, Bytes, HEADER_NAMES,
};
use proptest::prelude::*;
use serde_json::Value;
use tollgate_core::arbitrary_json::{mutated, schema_names, value};

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

fn request() -> impl Strategy<Value = Bytes> {
    let name = proptest::sample::select(HEADER_NAMES);
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

/// A configuration document: a valid one with a few changes.
fn config_document() -> impl Strategy<Value = Value> {
    mutated(config_seeds(), config_names()).prop_map(|mut doc| {
        with_small_tables(&mut doc);
        doc
    })
}

#[test]
fn every_configuration_seed_parses() {
    for seed in config_seeds() {
        if let Err(e) = Config::parse(seed.as_bytes()) {
            panic!("seed refused: {e}\n{seed}");
        }
    }
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
        run_configuration(doc.to_string().as_bytes(), &requests);
    }

    /// Quota answers of any shape, well-formed or not, are read safely and applied.
    #[test]
    fn fuzz_quota_answers_are_read_safely_and_applied(
        lease_answer in value(ANSWER_NAMES, 3),
        slot_answer in value(ANSWER_NAMES, 3),
        status in proptest::sample::select(STATUSES),
        r in request(),
    ) {
        let (lease_body, slot_body) = (lease_answer.to_string(), slot_answer.to_string());
        run_quota_answers(status, lease_body.as_bytes(), slot_body.as_bytes(), &r);
    }
}
