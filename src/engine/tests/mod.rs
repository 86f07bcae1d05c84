//! The engine without a proxy: every algorithm path, leases, strict answers and failure modes,
//! over an in-memory store with the strict CAS semantics of nginx-like hosts.

use super::*;
use crate::headers::HeaderSet;
use crate::stats::Stat;
use tollgate_core::global::lease::{LeaseGrant, LeaseResponse};
use tollgate_core::MemoryStore;

const SEC: u64 = 1_000_000_000;
const MS: u64 = 1_000_000;
const NOW: u64 = 1_700_000_000 * SEC;

mod global;
mod global_concurrency;
mod local;
mod networks;
mod overload;
mod placement;
mod strict;

/// A request as a fake host shows it.
#[derive(Default, Clone)]
struct Req {
    headers: Vec<(&'static str, Vec<u8>)>,
    peer: &'static str,
}

impl RequestView for Req {
    fn header(&self, name: &str) -> Option<crate::request::Value<'_>> {
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| std::borrow::Cow::Borrowed(&v[..]))
    }
    fn source_address(&self) -> Option<crate::request::Value<'_>> {
        Some(std::borrow::Cow::Borrowed(self.peer.as_bytes()))
    }
}

fn req(headers: &[(&'static str, &[u8])]) -> Req {
    Req {
        headers: headers.iter().map(|(n, v)| (*n, v.to_vec())).collect(),
        peer: "10.0.0.1:4000",
    }
}

struct Rig {
    engine: Engine,
    store: MemoryStore,
}

impl Rig {
    fn new(json: &str) -> Self {
        let config = Config::parse(json.as_bytes()).unwrap();
        let engine = Engine::new(config, KeyPlacement::new([7; 16]));
        let store = MemoryStore::new();
        engine.initialize(&store).unwrap();
        Self { engine, store }
    }

    fn inputs(&mut self, r: &Req) -> Inputs {
        let trusted = self.engine.config().client_ip;
        let mut inputs = Inputs::new();
        if let Some(b) = self.engine.gather(&Request::new(r, trusted), &mut inputs) {
            panic!("blocked: {b:?}");
        }
        inputs
    }

    fn step(&mut self, r: &Req, now: u64) -> Step {
        let mut inputs = self.inputs(r);
        self.engine.evaluate(&self.store, &mut inputs, now, false)
    }

    fn admitted(&mut self, r: &Req, now: u64, n: usize) -> usize {
        (0..n)
            .filter(|_| matches!(self.step(r, now), Step::Admit(_)))
            .count()
    }

    /// The lease call a tick would send now, if any.
    fn lease_call(
        &mut self,
        now: u64,
    ) -> Option<(Vec<Refill>, tollgate_core::global::lease::LeaseRequest)> {
        self.engine
            .take_refills(&self.store, "me", now)
            .into_iter()
            .find_map(|c| match c {
                Call::Lease(r, request) => Some((r, request)),
                Call::Permits(..) | Call::GiveBack(_) => None,
            })
    }

    fn stat(&self, rule: usize, stat: RuleStat) -> i64 {
        self.engine.stats.pending(Stat::Rule(rule, stat))
    }
}

fn admit(step: Step) -> Admitted {
    match step {
        Step::Admit(a) => a,
        other => panic!("not admitted: {other:?}"),
    }
}

fn refusal_of(step: Step) -> Refusal {
    match step {
        Step::Refuse(r) => r,
        other => panic!("not refused: {other:?}"),
    }
}

const ONE_RULE: &str = r#"{"rules":[{"name":"r","key":["header:x-user"],"limit":{"requests":1,"per":"1m"},"burst":3,"worker_batch":0}]}"#;

const GLOBAL: &str = r#"{"rules":[{"name":"g","scope":"global","key":["header:x-user"],
    "limit":{"requests":100,"per":"1m"},"burst":40,"worker_batch":0}],
  "quota_service":{"upstream":"quota","failure_mode":"FAILURE","first_lease":"FIRST","instances_hint":2}}"#;

fn global(failure: &str, first: &str) -> Rig {
    Rig::new(&GLOBAL.replace("FAILURE", failure).replace("FIRST", first))
}

fn grant(granted: u64) -> LeaseResponse {
    LeaseResponse {
        items: vec![LeaseGrant {
            granted,
            ttl_ms: 10_000,
            remaining: 7,
            reset_ms: 30_000,
            ..LeaseGrant::default()
        }],
        errors: Vec::new(),
    }
}
