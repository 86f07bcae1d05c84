//! The configuration's JSON Schema: the forms of the custom-parsed strings, and the committed file.

#[cfg(test)]
use super::json::RawConfig;
use super::json::{Delay, RuleName};
use super::model::KeyPart;
use super::period::{Per, Period};
use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};
use std::borrow::Cow;

impl JsonSchema for RuleName {
    fn schema_name() -> Cow<'static, str> {
        "RuleName".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "pattern": "^[a-z0-9_-]{1,64}$",
            "description": "Unique rule name: names metrics and the x-tollgate-rule header."
        })
    }
}

impl JsonSchema for Period {
    fn schema_name() -> Cow<'static, str> {
        "Duration".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "pattern": "^[0-9]+(ms|s|m|h|d)$",
            "description": "A positive whole number and a unit (ms, s, m, h, d), at most 366d: \"250ms\", \"1m\".",
            "examples": ["250ms", "1s", "1m", "1h", "1d"]
        })
    }
}

impl JsonSchema for Per {
    fn schema_name() -> Cow<'static, str> {
        "Per".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "pattern": "^([0-9]+(ms|s|m|h|d)|day|week|month)$",
            "description": "A duration (a positive whole number and a unit: ms, s, m, h, d; at most 366d), or a calendar period (day, week, month) with `calendar`.",
            "examples": ["1s", "1m", "1h", "1d", "month"]
        })
    }
}

impl JsonSchema for KeyPart {
    fn schema_name() -> Cow<'static, str> {
        "KeyPart".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "pattern": "^(client_ip|path|method|host|header:.+|query:.+|metadata:[^/]+(/[^/]+)+)$",
            "description": "A part of the bucket key: client_ip, path, method, host, header:NAME, query:NAME or metadata:NAMESPACE/FIELD[/FIELD…] (Envoy's dynamic metadata)."
        })
    }
}

impl JsonSchema for Delay {
    fn schema_name() -> Cow<'static, str> {
        "Delay".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "description": "Leaky bucket: excess requests passed on undelayed (nginx delay=N), or \"nodelay\".",
            "oneOf": [
                {"type": "integer", "minimum": 0},
                {"const": "nodelay"}
            ]
        })
    }
}

/// The committed JSON Schema (schema/tollgate.schema.json) is what the config types say.
/// `make schema` rewrites it.
#[test]
fn the_committed_schema_is_current() {
    let schema = schemars::schema_for!(RawConfig);
    let text = serde_json::to_string_pretty(&schema).unwrap() + "\n";
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/schema/tollgate.schema.json");
    if std::env::var_os("UPDATE_SCHEMA").is_some() {
        std::fs::create_dir_all(concat!(env!("CARGO_MANIFEST_DIR"), "/schema")).unwrap();
        std::fs::write(path, &text).unwrap();
    }
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        committed == text,
        "schema/tollgate.schema.json is stale: run `make schema`"
    );
}
