//! The configuration's words: the values its JSON shape and the model share (failure modes, key
//! parts, header formats, …) and what a header name may be.

use serde::de::{self, Deserializer};
use serde::Deserialize;

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureMode {
    /// Global rules do not apply while the service fails.
    #[default]
    Allow,
    /// Global rules refuse.
    Deny,
    /// Global rules are enforced locally at `limit / instances_hint`.
    Local,
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FirstLease {
    #[default]
    Wait,
    Provisional,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KeyPart {
    ClientIp,
    /// Lower-case name.
    Header(String),
    Query(String),
    Path,
    Method,
    Host,
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MissingKey {
    #[default]
    Skip,
    Limit,
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HeaderFormat {
    #[default]
    Draft,
    Legacy,
    Both,
    None,
}

/// The filter's log level (the host filters again by its own).
#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogLevel {
    Error,
    Warn,
    #[default]
    Info,
    /// Adds one line per decision.
    Debug,
}

impl<'de> Deserialize<'de> for KeyPart {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let named = |prefix: &str| {
            s.strip_prefix(prefix)
                .filter(|n| !n.is_empty())
                .map(str::to_ascii_lowercase)
        };
        if let Some(name) = named("header:").filter(|n| !is_token(n)) {
            return Err(de::Error::custom(format!(
                "invalid header name {name:?} in key part {s:?}"
            )));
        }
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

/// An HTTP field name: one or more token characters (RFC 9110 `tchar`).
pub fn is_token(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}
