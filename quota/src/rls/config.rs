//! envoyproxy/ratelimit's configuration (YAML files of domains and nested descriptors), checked
//! at load, and the limit a request's descriptor finds in it.

use serde::Deserialize;
use std::collections::HashMap;
use std::path::Path;

/// Most levels of nested descriptors, and most entries a request's descriptor may have.
pub const MAX_DEPTH: usize = 32;

/// One file as envoyproxy/ratelimit reads it; `tollgate_bucket` is ours.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    domain: String,
    #[serde(default)]
    descriptors: Vec<RawDescriptor>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDescriptor {
    #[serde(default)]
    key: String,
    #[serde(default)]
    value: String,
    rate_limit: Option<RawRateLimit>,
    #[serde(default)]
    descriptors: Vec<RawDescriptor>,
    #[serde(default)]
    shadow_mode: bool,
    #[serde(default)]
    detailed_metric: bool,
    /// The bucket of a tollgate global rule this descriptor's limit counts in (its name as
    /// `tollgate quota-key` prints it: `<limit_id>.<requests>.<per_ms>.<burst>`).
    tollgate_bucket: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRateLimit {
    #[serde(default)]
    requests_per_unit: u32,
    #[serde(default)]
    unit: String,
    #[serde(default)]
    unlimited: bool,
    #[serde(default)]
    name: String,
    #[serde(default)]
    replaces: Vec<RawReplace>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReplace {
    #[serde(default)]
    name: String,
}

/// A time unit of RLS, as the protocol numbers it, with its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unit {
    /// `envoy.service.ratelimit.v3.RateLimitResponse.RateLimit.Unit`.
    pub proto: i32,
    pub ms: u64,
}

/// The units envoyproxy/ratelimit knows, by name (any case); a month 30 days, a year 365, as
/// there.
pub fn unit_named(name: &str) -> Option<Unit> {
    const DAY: u64 = 86_400_000;
    let (proto, ms) = match name.to_ascii_uppercase().as_str() {
        "SECOND" => (1, 1_000),
        "MINUTE" => (2, 60_000),
        "HOUR" => (3, 3_600_000),
        "DAY" => (4, DAY),
        "MONTH" => (5, 30 * DAY),
        "YEAR" => (6, 365 * DAY),
        "WEEK" => (7, 7 * DAY),
        _ => return None,
    };
    Some(Unit { proto, ms })
}

/// The unit the protocol numbers `proto` (a request's own limit), if it is one.
pub fn unit_of(proto: i32) -> Option<Unit> {
    ["SECOND", "MINUTE", "HOUR", "DAY", "MONTH", "YEAR", "WEEK"]
        .into_iter()
        .filter_map(unit_named)
        .find(|u| u.proto == proto)
}

/// A limit of the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    /// `domain.key_value.key…`: the descriptor's place (metrics, logs).
    pub full_key: String,
    /// None: `unlimited`.
    pub rate: Option<Rate>,
    pub shadow_mode: bool,
    pub detailed_metric: bool,
    pub name: String,
    pub replaces: Vec<String>,
    /// Counts in this tollgate rule's bucket: its `limit_id` and burst.
    pub tollgate: Option<(String, u64)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub requests_per_unit: u32,
    pub unit: Unit,
}

/// One level of descriptors: by `key_value`, or `key` alone (any value).
#[derive(Debug, Default)]
struct Level {
    nodes: HashMap<String, Node>,
    /// Names ending in `*` at this level: a prefix of `key_value`.
    wildcards: Vec<String>,
}

#[derive(Debug)]
struct Node {
    limit: Option<Limit>,
    /// This node matches any value of its key (it names no `value`).
    any_value: bool,
    children: Level,
}

/// What a request's descriptor found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found<'a> {
    pub limit: &'a Limit,
    /// The values of the entries matched by a node that names no value (or a `*` prefix), in
    /// order: a shared tollgate bucket's key parts.
    pub key_values: Vec<&'a str>,
}

/// Every domain's descriptors.
#[derive(Debug, Default)]
pub struct RlsConfig {
    domains: HashMap<String, Level>,
}

impl RlsConfig {
    /// Read every `.yaml`/`.yml` file of each path (a file, or a directory's files in name
    /// order), as envoyproxy/ratelimit does: the first problem, naming the file.
    pub fn load(paths: &[impl AsRef<Path>]) -> Result<Self, String> {
        let mut files = Vec::new();
        for path in paths {
            let path = path.as_ref();
            if path.is_dir() {
                let entries = std::fs::read_dir(path)
                    .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
                let mut found: Vec<_> = entries
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
                    .collect();
                found.sort();
                files.extend(found);
            } else {
                files.push(path.to_path_buf());
            }
        }
        let mut config = Self::default();
        for file in files {
            let text = std::fs::read_to_string(&file)
                .map_err(|e| format!("cannot read {}: {e}", file.display()))?;
            config
                .add(&text)
                .map_err(|e| format!("{}: {e}", file.display()))?;
        }
        Ok(config)
    }

    /// Add one file's domain.
    pub fn add(&mut self, yaml: &str) -> Result<(), String> {
        let raw: RawFile = serde_yaml_ng::from_str(yaml).map_err(|e| e.to_string())?;
        if raw.domain.is_empty() {
            return Err("config file cannot have empty domain".into());
        }
        if self.domains.contains_key(&raw.domain) {
            return Err(format!("duplicate domain '{}' in config file", raw.domain));
        }
        let level = load_level(&format!("{}.", raw.domain), raw.descriptors, 1)?;
        self.domains.insert(raw.domain, level);
        Ok(())
    }

    pub fn domains(&self) -> usize {
        self.domains.len()
    }

    pub fn has_domain(&self, domain: &str) -> bool {
        self.domains.contains_key(domain)
    }

    /// The limit of a request's descriptor (its entries as `(key, value)`), as envoyproxy/
    /// ratelimit finds it: level by level, `key_value` first, then a `*` prefix, then `key`
    /// alone; the limit of the node the last entry reaches, none if the descriptor is longer or
    /// shorter than a limited node's depth.
    pub fn find<'a>(&'a self, domain: &str, entries: &[(&'a str, &'a str)]) -> Option<Found<'a>> {
        let mut level = self.domains.get(domain)?;
        let mut key_values = Vec::new();
        let mut found = None;
        for (i, (key, value)) in entries.iter().enumerate() {
            let exact = format!("{key}_{value}");
            let node = level.nodes.get(&exact).map(|n| (n, false)).or_else(|| {
                level
                    .wildcards
                    .iter()
                    .find(|w| exact.starts_with(w.trim_end_matches('*')))
                    .and_then(|w| level.nodes.get(w))
                    .map(|n| (n, true))
                    .or_else(|| level.nodes.get(*key).map(|n| (n, true)))
            });
            let Some((node, by_prefix)) = node else {
                break;
            };
            if by_prefix || node.any_value {
                key_values.push(*value);
            }
            if i + 1 == entries.len() {
                found = node.limit.as_ref();
            }
            if node.children.nodes.is_empty() {
                break;
            }
            level = &node.children;
        }
        found.map(|limit| Found { limit, key_values })
    }
}

fn load_level(parent: &str, raw: Vec<RawDescriptor>, depth: usize) -> Result<Level, String> {
    if depth > MAX_DEPTH && !raw.is_empty() {
        return Err(format!(
            "{}: descriptors nested deeper than {MAX_DEPTH}",
            parent.trim_end_matches('.')
        ));
    }
    let mut level = Level::default();
    for d in raw {
        if d.key.is_empty() {
            return Err("descriptor has empty key".into());
        }
        let name = if d.value.is_empty() {
            d.key.clone()
        } else {
            format!("{}_{}", d.key, d.value)
        };
        let full_key = format!("{parent}{name}");
        if level.nodes.contains_key(&name) {
            return Err(format!("duplicate descriptor composite key '{full_key}'"));
        }
        let limit = match d.rate_limit {
            None if d.tollgate_bucket.is_some() => {
                return Err(format!("{full_key}: tollgate_bucket needs a rate_limit"));
            }
            None => None,
            Some(r) => Some(limit_of(
                &full_key,
                r,
                d.shadow_mode,
                d.detailed_metric,
                d.tollgate_bucket.as_deref(),
            )?),
        };
        let children = load_level(&format!("{full_key}."), d.descriptors, depth + 1)?;
        if name.ends_with('*') {
            level.wildcards.push(name.clone());
        }
        level.nodes.insert(
            name,
            Node {
                limit,
                any_value: d.value.is_empty(),
                children,
            },
        );
    }
    Ok(level)
}

fn limit_of(
    full_key: &str,
    r: RawRateLimit,
    shadow_mode: bool,
    detailed_metric: bool,
    tollgate_bucket: Option<&str>,
) -> Result<Limit, String> {
    let unit = unit_named(&r.unit);
    let rate = if r.unlimited {
        if unit.is_some() {
            return Err(format!(
                "{full_key}: should not specify rate limit unit when unlimited"
            ));
        }
        if tollgate_bucket.is_some() {
            return Err(format!(
                "{full_key}: an unlimited rate_limit has no tollgate_bucket"
            ));
        }
        None
    } else {
        let unit =
            unit.ok_or_else(|| format!("{full_key}: invalid rate limit unit '{}'", r.unit))?;
        if r.requests_per_unit > 1_000_000_000 {
            return Err(format!(
                "{full_key}: requests_per_unit {} is more than the maximum of 1000000000",
                r.requests_per_unit
            ));
        }
        Some(Rate {
            requests_per_unit: r.requests_per_unit,
            unit,
        })
    };
    let mut replaces = Vec::new();
    for e in r.replaces {
        if e.name.is_empty() {
            return Err(format!(
                "{full_key}: should not have an empty replaces entry"
            ));
        }
        if e.name == r.name {
            return Err(format!(
                "{full_key}: replaces should not contain name of same descriptor"
            ));
        }
        replaces.push(e.name);
    }
    if tollgate_bucket.is_some() && rate.is_some_and(|r| r.requests_per_unit == 0) {
        return Err(format!(
            "{full_key}: a limit of 0 refuses every request: it has no tollgate_bucket"
        ));
    }
    let tollgate = match (tollgate_bucket, rate) {
        (Some(bucket), Some(rate)) => Some(shared_bucket(full_key, bucket, rate)?),
        _ => None,
    };
    Ok(Limit {
        full_key: full_key.to_owned(),
        rate,
        shadow_mode,
        detailed_metric,
        name: r.name,
        replaces,
        tollgate,
    })
}

/// A tollgate rule's bucket name, `<limit_id>.<requests>.<per_ms>.<burst>`, checked against the
/// descriptor's own limit: `(limit_id, burst)`.
fn shared_bucket(full_key: &str, bucket: &str, rate: Rate) -> Result<(String, u64), String> {
    let bad = |why: String| format!("{full_key}: tollgate_bucket {bucket:?}: {why}");
    let parts: Vec<&str> = bucket.split('.').collect();
    let [limit_id, requests, per_ms, burst] = parts[..] else {
        return Err(bad(
            "must be <limit_id>.<requests>.<per_ms>.<burst>, as `tollgate quota-key` prints it \
             (calendar quotas cannot be shared with RLS)"
                .into(),
        ));
    };
    let number = |s: &str| s.parse::<u64>().ok();
    let (Some(requests), Some(per_ms), Some(burst)) =
        (number(requests), number(per_ms), number(burst))
    else {
        return Err(bad("its numbers are not whole numbers".into()));
    };
    let valid_id = !limit_id.is_empty()
        && limit_id.len() <= 128
        && limit_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if !valid_id {
        return Err(bad(
            "its limit_id must be 1 to 128 letters, digits, '-' or '_'".into(),
        ));
    }
    if requests != u64::from(rate.requests_per_unit) || per_ms != rate.unit.ms {
        return Err(bad(format!(
            "the rule limits {requests} per {per_ms} ms, the rate_limit {} per {} ms: they must \
             be the same limit",
            rate.requests_per_unit, rate.unit.ms
        )));
    }
    if burst == 0 || burst > 1_000_000_000 {
        return Err(bad("its burst must be 1 to 1000000000".into()));
    }
    Ok((limit_id.to_owned(), burst))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// envoyproxy/ratelimit's README example (the "Example 4" nested descriptors), unchanged.
    const EXAMPLE: &str = r#"
domain: mongo_cps
descriptors:
  - key: database
    value: users
    rate_limit:
      unit: second
      requests_per_unit: 500

  - key: database
    value: default
    rate_limit:
      unit: second
      requests_per_unit: 500
"#;

    const NESTED: &str = r#"
domain: edge_proxy_per_ip
descriptors:
  - key: remote_address
    rate_limit:
      unit: second
      requests_per_unit: 10
  - key: remote_address
    value: 50.0.0.5
    rate_limit:
      unit: second
      requests_per_unit: 1000
  - key: to_cluster
    value: mongo
    descriptors:
      - key: remote_address
        rate_limit:
          name: per_ip
          unit: minute
          requests_per_unit: 60
  - key: path
    value: /api/*
    rate_limit:
      unlimited: true
  - key: user
    shadow_mode: true
    detailed_metric: true
    rate_limit:
      unit: HOUR
      requests_per_unit: 5
      replaces:
        - name: per_ip
"#;

    fn config() -> RlsConfig {
        let mut c = RlsConfig::default();
        c.add(EXAMPLE).unwrap();
        c.add(NESTED).unwrap();
        c
    }

    #[test]
    fn descriptors_find_their_limits_as_envoyproxy_ratelimit_does() {
        let c = config();
        let users = c.find("mongo_cps", &[("database", "users")]).unwrap();
        assert_eq!(users.limit.full_key, "mongo_cps.database_users");
        assert_eq!(users.limit.rate.unwrap().requests_per_unit, 500);
        assert!(users.key_values.is_empty());
        assert!(c.find("mongo_cps", &[("database", "other")]).is_none());
        assert!(c.find("nope", &[("database", "users")]).is_none());
        // key_value before key alone.
        let special = c.find("edge_proxy_per_ip", &[("remote_address", "50.0.0.5")]);
        assert_eq!(special.unwrap().limit.rate.unwrap().requests_per_unit, 1000);
        let any = c
            .find("edge_proxy_per_ip", &[("remote_address", "10.0.0.1")])
            .unwrap();
        assert_eq!(any.limit.full_key, "edge_proxy_per_ip.remote_address");
        assert_eq!(any.key_values, ["10.0.0.1"]);
        // Nested: only the full depth has the limit.
        let nested = c
            .find(
                "edge_proxy_per_ip",
                &[("to_cluster", "mongo"), ("remote_address", "1.2.3.4")],
            )
            .unwrap();
        assert_eq!(nested.limit.name, "per_ip");
        assert_eq!(nested.limit.rate.unwrap().unit.ms, 60_000);
        assert!(c
            .find("edge_proxy_per_ip", &[("to_cluster", "mongo")])
            .is_none());
        // Longer than the configuration: no limit.
        assert!(c
            .find(
                "edge_proxy_per_ip",
                &[("remote_address", "1.2.3.4"), ("x", "y")]
            )
            .is_none());
        // A `*` prefix.
        let api = c
            .find("edge_proxy_per_ip", &[("path", "/api/v1/users")])
            .unwrap();
        assert_eq!(api.limit.rate, None);
        assert!(c.find("edge_proxy_per_ip", &[("path", "/other")]).is_none());
        let user = c.find("edge_proxy_per_ip", &[("user", "alice")]).unwrap();
        assert!(user.limit.shadow_mode && user.limit.detailed_metric);
        assert_eq!(user.limit.replaces, ["per_ip"]);
        assert_eq!(user.limit.rate.unwrap().unit.proto, 3);
    }

    #[test]
    fn bad_files_are_refused_naming_the_problem() {
        let cases = [
            ("descriptors: []", "empty domain"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: fortnight, requests_per_unit: 1}", "invalid rate limit unit 'fortnight'"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 0}\n    tollgate_bucket: 4c1f.0.1000.1", "a limit of 0 refuses every request"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, unlimited: true}", "should not specify rate limit unit when unlimited"),
            ("domain: d\ndescriptors:\n  - key: a\n  - key: a", "duplicate descriptor composite key 'd.a'"),
            ("domain: d\ndescriptors:\n  - key: a\n    ratelimit: {}", "unknown field `ratelimit`"),
            ("domain: d\ndescriptors:\n  - value: a", "descriptor has empty key"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, name: x, replaces: [{name: x}]}", "replaces should not contain name of same descriptor"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: 100}\n    tollgate_bucket: 4c1f.100.1000.100", "they must be the same limit"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: 100}\n    tollgate_bucket: 4c1f.100.60000", "must be <limit_id>"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: 100}\n    tollgate_bucket: 4c1f.100.60000.100.1.2", "calendar quotas"),
            ("domain: d\ndescriptors:\n  - key: a\n    tollgate_bucket: 4c1f.100.60000.100", "needs a rate_limit"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: day, requests_per_unit: 4000000000}", "more than the maximum"),
        ];
        for (yaml, want) in cases {
            let err = RlsConfig::default().add(yaml).unwrap_err();
            assert!(err.contains(want), "{yaml}: {err}");
        }
        let mut c = config();
        assert!(c
            .add(EXAMPLE)
            .unwrap_err()
            .contains("duplicate domain 'mongo_cps'"));
    }

    #[test]
    fn a_shared_bucket_is_bound_to_the_same_limit() {
        let mut c = RlsConfig::default();
        c.add(
            "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 100}\n    tollgate_bucket: 4c1f0e9ad2b37a55.100.60000.150",
        )
        .unwrap();
        let f = c.find("d", &[("user", "alice")]).unwrap();
        assert_eq!(f.limit.tollgate, Some(("4c1f0e9ad2b37a55".into(), 150)));
        assert_eq!(f.key_values, ["alice"]);
    }

    #[test]
    fn nesting_is_bounded() {
        let mut yaml = String::from("domain: d\ndescriptors:\n");
        for depth in 0..=MAX_DEPTH {
            let pad = "  ".repeat(2 * depth + 1);
            yaml.push_str(&format!("{pad}- key: k{depth}\n{pad}  descriptors:\n"));
        }
        let err = RlsConfig::default().add(&yaml).unwrap_err();
        assert!(err.contains("nested deeper than 32"), "{err}");
    }
}
