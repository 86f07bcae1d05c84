//! Fuzzing by property tests: arbitrary JSON documents whose keys are a format's own field names,
//! so that generated input gets past the first "unknown field" and into the checks behind it.

use proptest::prelude::*;
use serde_json::{Map, Value};

/// Values that mean something to tollgate's formats (durations, algorithms, keys, networks).
const WORDS: &[&str] = &[
    "1s",
    "1m",
    "1h",
    "1d",
    "0s",
    "5x",
    "200ms",
    "-1s",
    "token_bucket",
    "fixed_window",
    "sliding_window",
    "leaky_bucket",
    "concurrency",
    "adaptive",
    "sre_throttle",
    "global",
    "local",
    "allow",
    "deny",
    "local",
    "wait",
    "provisional",
    "nodelay",
    "header:x-user",
    "client_ip",
    "path",
    "query:k",
    "cookie:c",
    "header:",
    "10.0.0.0/8",
    "2001:db8::/32",
    "::1",
    "0.0.0.0/0",
    "quota",
    "127.0.0.1:8090",
    "debug",
    "off",
    "",
    "\u{0}",
    "é",
];

/// A scalar: null, booleans, numbers at every extreme, short strings and [`WORDS`].
fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (0u64..100).prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        "[ -~]{0,12}".prop_map(Value::from),
        proptest::sample::select(WORDS).prop_map(Value::from),
    ]
}

/// A JSON value up to `depth` levels deep whose objects take their keys from `names` (and now and
/// then a name of no format).
pub fn value(names: &'static [&'static str], depth: u32) -> impl Strategy<Value = Value> {
    leaf().prop_recursive(depth, 96, 8, move |inner| {
        let key = prop_oneof![
            9 => proptest::sample::select(names).prop_map(str::to_owned),
            1 => "[a-z_]{1,8}",
        ];
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            proptest::collection::vec((key, inner), 0..8)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// The property names a JSON schema declares anywhere in it (for [`value`]'s `names`).
pub fn schema_names(schema: &Value) -> Vec<String> {
    let mut names = Vec::new();
    collect(schema, &mut names);
    names.sort();
    names.dedup();
    names
}

fn collect(v: &Value, names: &mut Vec<String>) {
    match v {
        Value::Object(map) => {
            if let Some(Value::Object(props)) = map.get("properties") {
                names.extend(props.keys().cloned());
            }
            map.values().for_each(|v| collect(v, names));
        }
        Value::Array(items) => items.iter().for_each(|v| collect(v, names)),
        _ => {}
    }
}

/// One change to a document: walk down by `path` (each number picks a child), then replace what
/// is there with `with`, or remove it when `with` is `None`.
#[derive(Debug, Clone)]
pub struct Mutation {
    pub path: Vec<usize>,
    pub with: Option<Value>,
}

/// Valid `seeds` (JSON texts) changed by a few [`Mutation`]s: most results are near-valid, so the
/// checks deep inside a parser are reached, not only its first refusal.
pub fn mutated(
    seeds: &'static [&'static str],
    names: &'static [&'static str],
) -> impl Strategy<Value = Value> {
    let mutation = (
        proptest::collection::vec(any::<usize>(), 0..5),
        proptest::option::weighted(0.8, value(names, 2)),
    )
        .prop_map(|(path, with)| Mutation { path, with });
    (
        proptest::sample::select(seeds),
        proptest::collection::vec(mutation, 0..4),
    )
        .prop_map(|(seed, mutations)| {
            let mut doc = serde_json::from_str(seed).unwrap_or(Value::Null);
            for m in &mutations {
                apply(&mut doc, &m.path, m.with.clone());
            }
            doc
        })
}

fn apply(doc: &mut Value, path: &[usize], with: Option<Value>) {
    let Some((&pick, rest)) = path.split_first() else {
        if let Some(v) = with {
            *doc = v;
        }
        return;
    };
    let child = match doc {
        Value::Object(map) if !map.is_empty() => {
            let key = map
                .keys()
                .nth(pick % map.len())
                .cloned()
                .unwrap_or_default();
            if rest.is_empty() && with.is_none() {
                map.remove(&key);
                return;
            }
            map.get_mut(&key)
        }
        Value::Array(items) if !items.is_empty() => {
            let i = pick % items.len();
            if rest.is_empty() && with.is_none() {
                items.remove(i);
                return;
            }
            items.get_mut(i)
        }
        _ => None,
    };
    match child {
        Some(c) => apply(c, rest, with),
        // A leaf reached early: the change lands here.
        None => {
            if let Some(v) = with {
                *doc = v;
            }
        }
    }
}
