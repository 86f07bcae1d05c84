//! The configurations' stats at Envoy: defined while a configuration is created (Envoy freezes
//! them after), a rule's stats as one labelled metric each (`tollgate.rule.<stat>` with the label
//! `tollgate_rule`), updated from any thread.

use crate::abi;
use parking_lot::RwLock;
use tollgate::lifecycle::{MetricKind, Status};

/// A stat as Envoy knows it.
struct Metric {
    /// The configuration that defined it (metric ids are per configuration).
    config: usize,
    envoy_id: usize,
    kind: MetricKind,
    /// A rule's stat: the rule's name, its label's value.
    rule: Option<Box<str>>,
    /// The name the lifecycle gave, and Envoy's (a rule's stat without the rule).
    name: Box<str>,
    envoy_name: Box<str>,
}

/// Every stat of the process's configurations, by the id the lifecycle was given (its index + 1).
static METRICS: RwLock<Vec<Option<Metric>>> = RwLock::new(Vec::new());

/// The label a rule's stats carry (what the Wasm build's `stats_tags` regex extracts).
const RULE_LABEL: &[u8] = b"tollgate_rule";

/// `tollgate.rule.<rule>.<stat>` → (`tollgate.rule.<stat>`, `<rule>`).
fn rule_stat(name: &str) -> Option<(String, &str)> {
    let rest = name.strip_prefix("tollgate.rule.")?;
    let (rule, stat) = rest.rsplit_once('.')?;
    Some((format!("tollgate.rule.{stat}"), rule))
}

/// Define `name` for the configuration `config` (its Envoy pointer), or find it defined already
/// (every worker's copy of a configuration defines the same stats). `defining`: Envoy still
/// accepts definitions (the configuration is being created).
pub fn define(
    config: abi::ConfigEnvoy,
    defining: bool,
    kind: MetricKind,
    name: &str,
) -> Result<u32, Status> {
    let key = config as usize;
    let mut metrics = METRICS.write();
    let found = metrics.iter().position(|m| {
        m.as_ref()
            .is_some_and(|m| m.config == key && &*m.name == name && m.kind == kind)
    });
    if let Some(i) = found {
        return u32::try_from(i + 1).map_err(|_| Status::BAD_ARGUMENT);
    }
    if !defining {
        return Err(Status::NOT_FOUND);
    }
    let (envoy_name, rule) = match rule_stat(name) {
        Some((stat, rule)) => (stat, Some(rule)),
        None => (name.to_owned(), None),
    };
    // A rule's stat is one metric for all rules: defined by the first.
    let same = metrics.iter().flatten().find(|m| {
        m.config == key
            && m.kind == kind
            && m.rule.is_some() == rule.is_some()
            && *m.envoy_name == *envoy_name
    });
    let envoy_id = match same {
        Some(m) => m.envoy_id,
        None => define_at_envoy(config, kind, &envoy_name, rule.is_some())?,
    };
    let metric = Some(Metric {
        config: key,
        envoy_id,
        kind,
        rule: rule.map(Box::from),
        name: name.into(),
        envoy_name: envoy_name.into(),
    });
    // The places of configurations gone are taken again: reloads do not grow the table.
    let index = match metrics.iter().position(Option::is_none) {
        Some(free) => {
            metrics[free] = metric;
            free
        }
        None => {
            metrics.push(metric);
            metrics.len() - 1
        }
    };
    let id = u32::try_from(index + 1).map_err(|_| Status::BAD_ARGUMENT)?;
    drop(metrics);
    // A labelled stat exists at Envoy once it has a value: shown at 0 from the start, as the
    // Wasm build's stats are.
    if rule.is_some() {
        let _ = update(id, 0);
    }
    Ok(id)
}

fn define_at_envoy(
    config: abi::ConfigEnvoy,
    kind: MetricKind,
    name: &str,
    labelled: bool,
) -> Result<usize, Status> {
    let mut label = abi::ModuleBuffer::of(RULE_LABEL);
    let (labels, count) = match labelled {
        true => (&mut label as *mut abi::ModuleBuffer, 1),
        false => (std::ptr::null_mut(), 0),
    };
    let mut id = 0;
    let name = abi::ModuleBuffer::of(name.as_bytes());
    // SAFETY: the name and label outlive the call; Envoy writes one id.
    let result = unsafe {
        match kind {
            MetricKind::Counter => abi::define_counter(config, name, labels, count, &mut id),
            MetricKind::Gauge => abi::define_gauge(config, name, labels, count, &mut id),
        }
    };
    match result {
        abi::METRICS_SUCCESS => Ok(id),
        other => Err(Status(100 + other)),
    }
}

/// Add `by` to counter `id` (or set gauge `id` to `value`).
pub fn update(id: u32, value: u64) -> Result<(), Status> {
    let metrics = METRICS.read();
    let Some(Some(m)) = usize::try_from(id)
        .ok()
        .and_then(|i| i.checked_sub(1))
        .and_then(|i| metrics.get(i))
    else {
        return Err(Status::NOT_FOUND);
    };
    let mut label = m
        .rule
        .as_deref()
        .map(|r| abi::ModuleBuffer::of(r.as_bytes()));
    let (labels, count) = match label.as_mut() {
        Some(l) => (l as *mut abi::ModuleBuffer, 1),
        None => (std::ptr::null_mut(), 0),
    };
    let config = m.config as abi::ConfigEnvoy;
    // SAFETY: the label outlives the call; the configuration is alive while its stats are
    // updated (they are forgotten when it goes: `forget`).
    let result = unsafe {
        match m.kind {
            MetricKind::Counter => abi::increment_counter(config, m.envoy_id, labels, count, value),
            MetricKind::Gauge => abi::set_gauge(config, m.envoy_id, labels, count, value),
        }
    };
    match result {
        abi::METRICS_SUCCESS => Ok(()),
        other => Err(Status(100 + other)),
    }
}

/// The configuration `config` goes away: its stats can no longer be updated.
pub fn forget(config: abi::ConfigEnvoy) {
    let key = config as usize;
    for slot in METRICS.write().iter_mut() {
        if slot.as_ref().is_some_and(|m| m.config == key) {
            *slot = None;
        }
    }
}
