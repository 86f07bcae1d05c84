//! The plugin configuration: parsed once, validated with errors that name the field and the reason.

mod bucket_name;
mod host;
mod json;
mod model;
mod period;
#[cfg(not(target_arch = "wasm32"))]
mod schema;
mod syntax;
#[cfg(test)]
mod tests;
mod validate;

pub use host::HostCaps;
pub use model::overload::{
    CpuHeader, Guard, GuardKind, Priorities, PriorityClass, StatusSet, DEFAULT_LEVEL,
};
pub use model::*;
pub use period::{format_duration, Period};
use std::fmt;

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

impl Config {
    /// Parse and validate the plugin configuration bytes.
    pub fn parse(bytes: &[u8]) -> Result<Self, ConfigError> {
        let mut de = serde_json::Deserializer::from_slice(bytes);
        let raw: json::RawConfig = serde_path_to_error::deserialize(&mut de).map_err(|e| {
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
