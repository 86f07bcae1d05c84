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
    /// A value of the request's dynamic metadata (Envoy), set by a filter before tollgate (e.g.
    /// a JWT claim `jwt_authn` wrote): its property path, segments separated by NUL bytes.
    Metadata(Vec<u8>),
    /// A field of the request's JSON body (`body:model`, `body:metadata.user_id`): its path.
    Body(Vec<String>),
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
                } else if let Some(path) = s.strip_prefix("metadata:") {
                    metadata_path(path).map(Self::Metadata).ok_or_else(|| {
                        de::Error::custom(format!(
                            "invalid metadata path in key part {s:?} (expected \
                             metadata:NAMESPACE/FIELD[/FIELD…], e.g. \
                             metadata:envoy.filters.http.jwt_authn/payload/sub)"
                        ))
                    })
                } else if let Some(path) = s.strip_prefix("body:") {
                    body_path(path).map(Self::Body).ok_or_else(|| {
                        de::Error::custom(format!(
                            "invalid body field in key part {s:?} (expected \
                             body:FIELD[.FIELD…], e.g. body:model)"
                        ))
                    })
                } else {
                    Err(de::Error::custom(format!(
                        "unknown key part {s:?} (expected client_ip, path, method, host, \
                         header:NAME, query:NAME, metadata:NAMESPACE/FIELD or body:FIELD)"
                    )))
                }
            }
        }
    }
}

/// The property path of `NAMESPACE/FIELD[/FIELD…]` in the request's dynamic metadata
/// (`metadata.filter_metadata.NAMESPACE.FIELD…`), segments separated by NUL bytes; `None` if a
/// segment is empty or holds a NUL.
pub(super) fn metadata_path(path: &str) -> Option<Vec<u8>> {
    let segments: Vec<&str> = path.split('/').collect();
    if segments.len() < 2 || segments.iter().any(|s| s.is_empty() || s.contains('\0')) {
        return None;
    }
    let mut out = b"metadata\0filter_metadata".to_vec();
    for segment in segments {
        out.push(0);
        out.extend_from_slice(segment.as_bytes());
    }
    Some(out)
}

/// The segments of a JSON body field's path `FIELD[.FIELD…]`; `None` if one is empty.
pub fn body_path(path: &str) -> Option<Vec<String>> {
    let segments: Vec<String> = path.split('.').map(str::to_owned).collect();
    segments.iter().all(|s| !s.is_empty()).then_some(segments)
}

/// An HTTP field name: one or more token characters (RFC 9110 `tchar`).
pub fn is_token(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}
