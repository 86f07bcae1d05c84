//! The plugin configuration: parsed once, validated with errors that name the field and the reason.

use serde::de::{self, Deserializer};
use serde::Deserialize;
use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::num::{NonZeroU32, NonZeroU64};
use tollgate_core::{SlotTable, TokenBucket};

/// Slots per rule when `max_keys` is not given.
pub const DEFAULT_MAX_KEYS: u32 = 10_000;
/// Upper bound of `max_keys`: every slot is created when the configuration loads.
pub const MAX_MAX_KEYS: u32 = 1_000_000;

/// A configuration error, shown as `path: reason` (e.g. `rules[1].limit.per: invalid duration "5x"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

fn err(path: impl fmt::Display, reason: impl fmt::Display) -> ConfigError {
    ConfigError(format!("{path}: {reason}"))
}

/// The validated configuration the filter runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub rules: Vec<Rule>,
    pub response: Response,
    pub rate_limit_headers: HeaderFormat,
    pub trusted_hops: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    pub name: String,
    pub matcher: Match,
    pub key: Vec<KeyPart>,
    pub missing_key: MissingKey,
    pub bucket: TokenBucket,
    pub table: SlotTable,
    /// The rule's own `dry_run` or the top-level one.
    pub dry_run: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Match {
    pub path: Option<PathMatch>,
    /// Upper-case.
    pub methods: Vec<String>,
    /// Lower-case, without port.
    pub hosts: Vec<String>,
    /// Lower-case names, exact values.
    pub headers: Vec<(String, String)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathMatch {
    Exact(String),
    Prefix(String),
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KeyPart {
    ClientIp,
    Header(String),
    Query(String),
    Path,
    Method,
    Host,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MissingKey {
    #[default]
    Skip,
    Limit,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HeaderFormat {
    #[default]
    Draft,
    Legacy,
    Both,
    None,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u32,
    pub body: String,
    /// Lower-case names.
    pub headers: Vec<(String, String)>,
}

impl Config {
    /// Parse and validate the plugin configuration bytes.
    pub fn parse(bytes: &[u8]) -> Result<Self, ConfigError> {
        let mut de = serde_json::Deserializer::from_slice(bytes);
        let raw: RawConfig = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if path == "." || path == "?" {
                ConfigError(format!("configuration: {inner}"))
            } else {
                err(path, inner)
            }
        })?;
        de.end().map_err(|e| err("configuration", e))?;
        raw.validate()
    }
}

// ---- the JSON shape ----

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    rules: Vec<RawRule>,
    #[serde(default)]
    response: RawResponse,
    #[serde(default)]
    rate_limit_headers: HeaderFormat,
    #[serde(default)]
    client_ip: RawClientIp,
    #[serde(default)]
    dry_run: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: RuleName,
    #[serde(rename = "match", default)]
    matcher: RawMatch,
    #[serde(default)]
    key: Vec<KeyPart>,
    limit: RawLimit,
    burst: Option<NonZeroU64>,
    #[serde(default)]
    algorithm: Algorithm,
    #[serde(default)]
    missing_key: MissingKey,
    #[serde(default)]
    dry_run: bool,
    max_keys: Option<NonZeroU32>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawMatch {
    path_prefix: Option<String>,
    path: Option<String>,
    methods: Option<Vec<String>>,
    hosts: Option<Vec<String>>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimit {
    requests: NonZeroU64,
    per: Period,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawResponse {
    status: u32,
    body: String,
    headers: BTreeMap<String, String>,
}

impl Default for RawResponse {
    fn default() -> Self {
        Self {
            status: 429,
            body: "rate limited\n".into(),
            headers: BTreeMap::from([("content-type".into(), "text/plain".into())]),
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawClientIp {
    #[serde(default)]
    trusted_hops: u32,
}

/// `[a-z0-9_-]{1,64}`.
struct RuleName(String);

impl<'de> Deserialize<'de> for RuleName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let ok = !s.is_empty()
            && s.len() <= 64
            && s.bytes()
                .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-'));
        if ok {
            Ok(Self(s))
        } else {
            Err(de::Error::custom(format!(
                "invalid rule name {s:?}: use 1 to 64 of a-z, 0-9, _ and -"
            )))
        }
    }
}

#[derive(Default)]
enum Algorithm {
    #[default]
    TokenBucket,
}

impl<'de> Deserialize<'de> for Algorithm {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        match s.as_str() {
            "token_bucket" => Ok(Self::TokenBucket),
            _ => Err(de::Error::custom(format!(
                "unsupported algorithm {s:?} (supported: \"token_bucket\")"
            ))),
        }
    }
}

impl<'de> Deserialize<'de> for KeyPart {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let named = |prefix: &str| {
            s.strip_prefix(prefix)
                .filter(|n| !n.is_empty())
                .map(str::to_ascii_lowercase)
        };
        match s.as_str() {
            "client_ip" => Ok(Self::ClientIp),
            "path" => Ok(Self::Path),
            "method" => Ok(Self::Method),
            "host" => Ok(Self::Host),
            _ => {
                if let Some(name) = named("header:") {
                    Ok(Self::Header(name))
                } else if let Some(name) = s.strip_prefix("query:").filter(|n| !n.is_empty()) {
                    Ok(Self::Query(name.to_owned()))
                } else {
                    Err(de::Error::custom(format!(
                        "unknown key part {s:?} (expected client_ip, path, method, host, \
                         header:NAME or query:NAME)"
                    )))
                }
            }
        }
    }
}

/// A duration written as `<number><unit>`, unit one of ms, s, m, h, d.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Period {
    pub ns: u64,
}

impl Period {
    pub fn parse(s: &str) -> Option<Self> {
        let split = s.find(|c: char| !c.is_ascii_digit())?;
        let (digits, unit) = s.split_at(split);
        let n: u64 = digits.parse().ok()?;
        let unit_ns: u64 = match unit {
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            "d" => 86_400_000_000_000,
            _ => return None,
        };
        let ns = n.checked_mul(unit_ns)?;
        (ns > 0 && ns <= 366 * 86_400_000_000_000).then_some(Self { ns })
    }
}

impl<'de> Deserialize<'de> for Period {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::parse(&s).ok_or_else(|| {
            de::Error::custom(format!(
                "invalid duration {s:?} (expected a positive whole number and a unit: ms, s, m, h \
                 or d, at most 366d, e.g. \"250ms\", \"1m\")"
            ))
        })
    }
}

// ---- validation ----

impl RawConfig {
    fn validate(self) -> Result<Config, ConfigError> {
        if self.rules.is_empty() {
            return Err(err("rules", "at least one rule is required"));
        }
        let mut seen = HashSet::new();
        let mut rules = Vec::with_capacity(self.rules.len());
        for (i, raw) in self.rules.into_iter().enumerate() {
            let path = format!("rules[{i}]");
            if !seen.insert(raw.name.0.clone()) {
                return Err(err(
                    format!("{path}.name"),
                    format!("duplicate rule name {:?}", raw.name.0),
                ));
            }
            rules.push(raw.validate(&path, self.dry_run)?);
        }
        let response = self.response.validate()?;
        Ok(Config {
            rules,
            response,
            rate_limit_headers: self.rate_limit_headers,
            trusted_hops: self.client_ip.trusted_hops,
        })
    }
}

impl RawRule {
    fn validate(self, path: &str, dry_run_all: bool) -> Result<Rule, ConfigError> {
        let Algorithm::TokenBucket = self.algorithm;
        let matcher = self.matcher.validate(&format!("{path}.match"))?;
        let requests = self.limit.requests.get();
        let burst = self.burst.map_or(requests, NonZeroU64::get);
        let max_keys = self.max_keys.map_or(DEFAULT_MAX_KEYS, NonZeroU32::get);
        if max_keys > MAX_MAX_KEYS {
            return Err(err(
                format!("{path}.max_keys"),
                format!("{max_keys} is more than the maximum of {MAX_MAX_KEYS}"),
            ));
        }
        let bucket = TokenBucket::new(requests, self.limit.per.ns, burst)
            .ok_or_else(|| err(format!("{path}.limit"), "must be positive"))?;
        let mut seen = HashSet::new();
        for (j, part) in self.key.iter().enumerate() {
            if !seen.insert(part) {
                return Err(err(format!("{path}.key[{j}]"), "repeated key part"));
            }
        }
        // The slot names carry the parameters: a reload that changes them starts the rule fresh,
        // one that keeps them keeps its state.
        let params: Vec<u8> = [requests, self.limit.per.ns, burst, u64::from(max_keys)]
            .iter()
            .flat_map(|p| p.to_le_bytes())
            .collect();
        let fingerprint = tollgate_core::slot::fingerprint(&params);
        let table = SlotTable::new(
            format!("tollgate.tb.{}.{fingerprint:016x}.", self.name.0),
            max_keys,
        );
        Ok(Rule {
            name: self.name.0,
            matcher,
            key: self.key,
            missing_key: self.missing_key,
            bucket,
            table,
            dry_run: self.dry_run || dry_run_all,
        })
    }
}

impl RawMatch {
    fn validate(self, path: &str) -> Result<Match, ConfigError> {
        let path_match = match (self.path, self.path_prefix) {
            (Some(_), Some(_)) => {
                return Err(err(path, "give either path or path_prefix, not both"));
            }
            (Some(p), None) => Some(PathMatch::Exact(check_path(&format!("{path}.path"), p)?)),
            (None, Some(p)) => Some(PathMatch::Prefix(check_path(
                &format!("{path}.path_prefix"),
                p,
            )?)),
            (None, None) => None,
        };
        let list = |field: &str, values: Option<Vec<String>>, upper: bool| {
            let Some(values) = values else {
                return Ok(Vec::new());
            };
            if values.is_empty() {
                return Err(err(
                    format!("{path}.{field}"),
                    "must not be empty (leave it out to match any)",
                ));
            }
            values
                .into_iter()
                .enumerate()
                .map(|(j, v)| {
                    if v.is_empty() || v.contains(|c: char| c.is_whitespace() || c == ':') {
                        Err(err(
                            format!("{path}.{field}[{j}]"),
                            format!("invalid value {v:?}"),
                        ))
                    } else if upper {
                        Ok(v.to_ascii_uppercase())
                    } else {
                        Ok(v.to_ascii_lowercase())
                    }
                })
                .collect()
        };
        let methods = list("methods", self.methods, true)?;
        let hosts = list("hosts", self.hosts, false)?;
        let mut headers = Vec::with_capacity(self.headers.len());
        for (name, value) in self.headers {
            if name.is_empty() {
                return Err(err(format!("{path}.headers"), "empty header name"));
            }
            headers.push((name.to_ascii_lowercase(), value));
        }
        Ok(Match {
            path: path_match,
            methods,
            hosts,
            headers,
        })
    }
}

fn check_path(field: &str, p: String) -> Result<String, ConfigError> {
    if p.starts_with('/') {
        Ok(p)
    } else {
        Err(err(field, format!("{p:?} must start with \"/\"")))
    }
}

impl RawResponse {
    fn validate(self) -> Result<Response, ConfigError> {
        if !(200..=599).contains(&self.status) {
            return Err(err(
                "response.status",
                format!("{} is not an HTTP status between 200 and 599", self.status),
            ));
        }
        let mut headers = Vec::with_capacity(self.headers.len());
        for (name, value) in self.headers {
            let lower = name.to_ascii_lowercase();
            if lower.is_empty() || lower.starts_with(':') || lower == "content-length" {
                return Err(err(
                    format!("response.headers.{name}"),
                    "this header cannot be set",
                ));
            }
            headers.push((lower, value));
        }
        Ok(Response {
            status: self.status,
            body: self.body,
            headers,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Config, String> {
        Config::parse(s.as_bytes()).map_err(|e| e.0)
    }

    const MIN: &str = r#"{"rules":[{"name":"r","limit":{"requests":10,"per":"1s"}}]}"#;

    #[test]
    fn the_documented_example_parses() {
        let c = parse(
            r#"{
              "rules": [{
                "name": "per-ip",
                "match": { "path_prefix": "/api/", "methods": ["GET", "post"],
                           "hosts": ["API.example.com"], "headers": { "X-Tier": "free" } },
                "key": ["client_ip", "header:X-User", "query:page"],
                "limit": { "requests": 100, "per": "1m" },
                "burst": 20,
                "algorithm": "token_bucket",
                "missing_key": "limit",
                "dry_run": false
              }],
              "response": { "status": 429, "body": "rate limited\n",
                            "headers": { "content-type": "text/plain" } },
              "rate_limit_headers": "both",
              "client_ip": { "trusted_hops": 1 },
              "dry_run": true
            }"#,
        )
        .unwrap();
        let r = &c.rules[0];
        assert_eq!(r.bucket, TokenBucket::new(100, 60_000_000_000, 20).unwrap());
        assert_eq!(r.matcher.methods, ["GET", "POST"]);
        assert_eq!(r.matcher.hosts, ["api.example.com"]);
        assert_eq!(
            r.matcher.headers,
            [("x-tier".to_string(), "free".to_string())]
        );
        assert_eq!(
            r.key,
            [
                KeyPart::ClientIp,
                KeyPart::Header("x-user".into()),
                KeyPart::Query("page".into())
            ]
        );
        assert!(r.dry_run);
        assert_eq!(r.missing_key, MissingKey::Limit);
        assert_eq!(c.trusted_hops, 1);
        assert_eq!(c.rate_limit_headers, HeaderFormat::Both);
        assert!(!r.table.prefix().contains('/'));
    }

    #[test]
    fn defaults() {
        let c = parse(MIN).unwrap();
        let r = &c.rules[0];
        assert_eq!(r.bucket.burst(), 10);
        assert_eq!(r.table.len(), DEFAULT_MAX_KEYS);
        assert_eq!(r.missing_key, MissingKey::Skip);
        assert_eq!(c.response.status, 429);
        assert_eq!(c.rate_limit_headers, HeaderFormat::Draft);
        assert_eq!(c.trusted_hops, 0);
        assert!(!r.dry_run);
    }

    #[test]
    fn changed_parameters_change_the_slot_names() {
        let a = parse(MIN).unwrap();
        let b = parse(&MIN.replace("10", "11")).unwrap();
        assert_ne!(a.rules[0].table, b.rules[0].table);
        assert_eq!(a.rules[0].table, parse(MIN).unwrap().rules[0].table);
    }

    #[test]
    fn durations() {
        assert_eq!(Period::parse("250ms"), Some(Period { ns: 250_000_000 }));
        assert_eq!(
            Period::parse("1d"),
            Some(Period {
                ns: 86_400_000_000_000
            })
        );
        for bad in [
            "",
            "5",
            "5x",
            "0s",
            "-1s",
            "1.5s",
            " 1s",
            "1S",
            "367d",
            "99999999999999999999d",
        ] {
            assert_eq!(Period::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn errors_name_the_field_and_the_reason() {
        let cases: &[(&str, &str)] = &[
            ("{", "configuration: EOF"),
            ("{}", "configuration: missing field `rules`"),
            (r#"{"rules":[]}"#, "rules: at least one rule is required"),
            (
                r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}}],"x":1}"#,
                "x: unknown field `x`",
            ),
            (
                r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}},{"name":"s","limit":{"requests":1,"per":"5x"}}]}"#,
                r#"rules[1].limit.per: invalid duration "5x""#,
            ),
            (
                r#"{"rules":[{"name":"r","limit":{"requests":0,"per":"1s"}}]}"#,
                "rules[0].limit.requests: invalid value: integer `0`",
            ),
            (
                r#"{"rules":[{"name":"r","limit":{"requests":-3,"per":"1s"}}]}"#,
                "rules[0].limit.requests: invalid value: integer `-3`",
            ),
            (
                r#"{"rules":[{"name":"r","limit":{"requests":"5","per":"1s"}}]}"#,
                "rules[0].limit.requests: invalid type: string",
            ),
            (
                r#"{"rules":[{"name":"r","burst":0,"limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].burst: invalid value: integer `0`",
            ),
            (
                r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}},{"name":"r","limit":{"requests":1,"per":"1s"}}]}"#,
                r#"rules[1].name: duplicate rule name "r""#,
            ),
            (
                r#"{"rules":[{"name":"Bad/Name","limit":{"requests":1,"per":"1s"}}]}"#,
                r#"rules[0].name: invalid rule name "Bad/Name""#,
            ),
            (
                r#"{"rules":[{"name":"r","algorithm":"leaky_bucket","limit":{"requests":1,"per":"1s"}}]}"#,
                r#"rules[0].algorithm: unsupported algorithm "leaky_bucket""#,
            ),
            (
                r#"{"rules":[{"name":"r","key":["cookie"],"limit":{"requests":1,"per":"1s"}}]}"#,
                r#"rules[0].key[0]: unknown key part "cookie""#,
            ),
            (
                r#"{"rules":[{"name":"r","key":["header:"],"limit":{"requests":1,"per":"1s"}}]}"#,
                r#"rules[0].key[0]: unknown key part "header:""#,
            ),
            (
                r#"{"rules":[{"name":"r","key":["path","path"],"limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].key[1]: repeated key part",
            ),
            (
                r#"{"rules":[{"name":"r","match":{"path":"/a","path_prefix":"/b"},"limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].match: give either path or path_prefix",
            ),
            (
                r#"{"rules":[{"name":"r","match":{"path_prefix":"api"},"limit":{"requests":1,"per":"1s"}}]}"#,
                r#"rules[0].match.path_prefix: "api" must start with "/""#,
            ),
            (
                r#"{"rules":[{"name":"r","match":{"methods":[]},"limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].match.methods: must not be empty",
            ),
            (
                r#"{"rules":[{"name":"r","match":{"method":["GET"]},"limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].match.method: unknown field `method`",
            ),
            (
                r#"{"rules":[{"name":"r","missing_key":"maybe","limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].missing_key: unknown variant `maybe`",
            ),
            (
                r#"{"rules":[{"name":"r","max_keys":2000000,"limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].max_keys: 2000000 is more than the maximum",
            ),
            (
                r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}}],"response":{"status":99}}"#,
                "response.status: 99 is not an HTTP status",
            ),
            (
                r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}}],"rate_limit_headers":"ietf"}"#,
                "rate_limit_headers: unknown variant `ietf`",
            ),
            (
                r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}}],"client_ip":{"trusted_hops":-1}}"#,
                "client_ip.trusted_hops: invalid value: integer `-1`",
            ),
            (
                r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}}],"dry_run":"yes"}"#,
                "dry_run: invalid type: string",
            ),
        ];
        for (input, want) in cases {
            let got = parse(input).expect_err(input);
            assert!(
                got.starts_with(want),
                "for {input}\n got: {got}\nwant: {want}…"
            );
        }
    }
}
