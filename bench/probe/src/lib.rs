//! Times host calls and core steps from inside Envoy, many times per request, and answers with
//! nanoseconds per operation: where a Wasm rate limiter's time goes, without the noise of a load test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, MapType, MetricType};
use std::fmt::Write;
use tollgate_core::{admit, Check, Limit, Lookup, SlotTable, StashTable, TokenBucket};

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Probe) });
}}

const ROUNDS: u32 = 2_000;

struct Probe;

impl Context for Probe {}

impl RootContext for Probe {
    fn on_configure(&mut self, _: usize) -> bool {
        let _ = hostcalls::set_shared_data("probe.group", Some(&[0u8; 160]), None);
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Probe))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

fn now() -> u64 {
    hostcalls::get_current_time()
        .unwrap()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

/// Nanoseconds per run of `f`, over ROUNDS runs.
fn time(mut f: impl FnMut(u32)) -> f64 {
    let start = now();
    for i in 0..ROUNDS {
        f(i);
    }
    (now() - start) as f64 / f64::from(ROUNDS)
}

/// A store over Envoy's shared data, as the filter has.
struct Shared;

impl tollgate_core::CasStore for Shared {
    fn read(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, tollgate_core::StoreError> {
        match hostcalls::get_shared_data(key) {
            Ok((Some(v), Some(cas))) => Ok(Some((v, cas))),
            _ => Ok(None),
        }
    }

    fn write(&self, key: &str, value: &[u8], cas: u32) -> Result<(), tollgate_core::StoreError> {
        hostcalls::set_shared_data(key, Some(value), Some(cas))
            .map_err(|_| tollgate_core::StoreError::CasMismatch)
    }
}

impl HttpContext for Probe {
    fn on_http_request_headers(&mut self, _: usize, _: bool) -> Action {
        let metric = hostcalls::define_metric(MetricType::Counter, "probe.count").unwrap();
        let memory = tollgate_core::MemoryStore::new();
        let table = SlotTable::new("probe.t.".into(), 1000);
        table.initialize(&memory).unwrap();
        table.initialize(&Shared).unwrap();
        let limit = Limit::TokenBucket(
            TokenBucket::new(1_000_000_000, 60_000_000_000, 1_000_000_000).unwrap(),
        );
        let slot = table.locate(b"127.0.0.1");
        let t0 = now();
        let check = |batch| Check {
            limit: &limit,
            table: &table,
            slot,
            cost: 1,
            enforced: true,
            batch,
            wait_for_stashes: false,
        };
        let mut stash = StashTable::default();
        let mut out = String::new();
        let mut row = |name: &str, ns: f64| {
            let _ = writeln!(out, "{name} {ns:.0}");
        };
        row(
            "get_current_time",
            time(|_| {
                let _ = hostcalls::get_current_time();
            }),
        );
        row(
            "get_shared_data_160B",
            time(|_| {
                let _ = hostcalls::get_shared_data("probe.group");
            }),
        );
        row(
            "set_shared_data_160B",
            time(|_| {
                let _ = hostcalls::set_shared_data("probe.group", Some(&[1u8; 160]), None);
            }),
        );
        row(
            "get_property_source_address",
            time(|_| {
                let _ = hostcalls::get_property(vec!["source", "address"]);
            }),
        );
        row(
            "get_property_source_port",
            time(|_| {
                let _ = hostcalls::get_property(vec!["source", "port"]);
            }),
        );
        row(
            "get_property_connection_id",
            time(|_| {
                let _ = hostcalls::get_property(vec!["connection", "id"]);
            }),
        );
        row(
            "get_property_request_path",
            time(|_| {
                let _ = hostcalls::get_property(vec!["request", "path"]);
            }),
        );
        row(
            "get_header_xff",
            time(|_| {
                let _ = hostcalls::get_map_value(MapType::HttpRequestHeaders, "x-forwarded-for");
            }),
        );
        row(
            "get_header",
            time(|_| {
                let _ = hostcalls::get_map_value(MapType::HttpRequestHeaders, "user-agent");
            }),
        );
        row(
            "set_header",
            time(|_| {
                let _ = hostcalls::set_map_value(
                    MapType::HttpRequestHeaders,
                    "x-probe",
                    Some("\"r\";r=5;t=60"),
                );
            }),
        );
        row(
            "increment_metric",
            time(|_| {
                let _ = hostcalls::increment_metric(metric, 1);
            }),
        );
        row(
            "format_two_headers",
            time(|i| {
                let a = format!("\"{}\";q={};w={}", "bench", 1000, 60);
                let b = format!("\"{}\";r={};t={}", "bench", i, 60);
                std::hint::black_box((a, b));
            }),
        );
        row(
            "locate_key",
            time(|i| {
                std::hint::black_box(table.locate(&i.to_le_bytes()));
            }),
        );
        row(
            "admit_in_wasm_memory",
            time(|i| {
                std::hint::black_box(admit(&memory, &[check(0)], t0 + u64::from(i)));
            }),
        );
        row(
            "admit_in_shared_data",
            time(|i| {
                std::hint::black_box(admit(&Shared, &[check(0)], t0 + u64::from(i)));
            }),
        );
        row(
            "stash_lookup_spend",
            time(|i| {
                let at = t0 + u64::from(i);
                if let Lookup::Ask { batch } = stash.lookup(0, slot, 1, 8, at) {
                    let o = admit(&memory, &[check(batch)], at);
                    if let tollgate_core::Verdict::Admitted {
                        remaining,
                        reset_ns,
                        ..
                    } = o.checks[0].verdict
                    {
                        stash.stash(0, slot, o.checks[0].stashed, remaining, reset_ns, at);
                    }
                }
            }),
        );
        let _ = hostcalls::send_http_response(200, vec![], Some(out.as_bytes()));
        Action::Pause
    }
}
