//! The status path: where it is, who may read it, how keys are shown.

use crate::config::json::{KeyDisplay, RawStatus};
use crate::config::{err, ConfigError, Status};
use crate::network::Network;

const MOST_KEY_BYTES: u64 = crate::config::MOST_STATUS_KEY_BYTES as u64;

pub(super) fn validate(raw: RawStatus) -> Result<Status, ConfigError> {
    let path_ok = raw.path.starts_with('/')
        && !raw.path.contains(['?', '#'])
        && raw.path.bytes().all(|b| b.is_ascii_graphic());
    if !path_ok {
        return Err(err(
            "status.path",
            format!(
                "{:?} is not a path: it starts with /, without a query or spaces",
                raw.path
            ),
        ));
    }
    let allow = raw
        .allow
        .unwrap_or_else(|| vec!["127.0.0.1".into(), "::1".into()]);
    let allow = allow
        .iter()
        .enumerate()
        .map(|(i, a)| {
            Network::parse(a).ok_or_else(|| {
                err(
                    format!("status.allow[{i}]"),
                    format!("{a:?} is not an IP address or a CIDR range (10.0.0.0/8, ::1)"),
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    if allow.is_empty() {
        return Err(err(
            "status.allow",
            "names no network: nobody could read the status",
        ));
    }
    if let Some(token) = &raw.token {
        if token.len() < 16 {
            return Err(err("status.token", "must be at least 16 bytes"));
        }
        // What a header can carry and hosts keep as sent (no spaces: hosts trim them).
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(err(
                "status.token",
                "must be printable ASCII without spaces (a header's value could not carry it)",
            ));
        }
    }
    let max_key_bytes = raw.max_key_bytes.unwrap_or(64);
    if !(1..=MOST_KEY_BYTES).contains(&max_key_bytes) {
        return Err(err(
            "status.max_key_bytes",
            format!("{max_key_bytes} is not within 1..={MOST_KEY_BYTES}"),
        ));
    }
    let log_every_ms = raw.log_every.map_or(60_000, |p| p.ms());
    if log_every_ms < 1_000 {
        return Err(err("status.log_every", "must be at least 1s"));
    }
    Ok(Status {
        path: raw.path,
        allow,
        token: raw.token,
        hashed: raw.keys == KeyDisplay::Hashed,
        max_key_bytes: usize::try_from(max_key_bytes).unwrap_or(64),
        log_every_ms: if raw.log.unwrap_or(true) {
            log_every_ms
        } else {
            0
        },
    })
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    fn error(status: &str) -> String {
        let json = format!(
            r#"{{"rules":[{{"name":"r","limit":{{"requests":1,"per":"1s"}}}}],"status":{status}}}"#
        );
        Config::parse(json.as_bytes())
            .map(|_| String::new())
            .unwrap_or_else(|e| e.to_string())
    }

    #[test]
    fn what_could_never_be_read_is_refused_naming_the_field() {
        for (status, field) in [
            (r#"{"path":"/s","allow":[]}"#, "status.allow"),
            (
                r#"{"path":"/s","allow":["10.0.0.0/33"]}"#,
                "status.allow[0]",
            ),
            (
                r#"{"path":"/s","token":"abcdefghijklmnop  "}"#,
                "status.token",
            ),
            (r#"{"path":"/s","token":"abcdefghijklmno"}"#, "status.token"),
            (r#"{"path":"s"}"#, "status.path"),
            (r#"{"path":"/s?x"}"#, "status.path"),
            (r#"{"path":"/s","max_key_bytes":0}"#, "status.max_key_bytes"),
            (
                r#"{"path":"/s","max_key_bytes":129}"#,
                "status.max_key_bytes",
            ),
            (r#"{"path":"/s","log_every":"999ms"}"#, "status.log_every"),
        ] {
            let e = error(status);
            assert!(e.starts_with(field), "{status}: {e}");
        }
        assert_eq!(
            error(r#"{"path":"/s","token":"abcdefghijklmnop","max_key_bytes":128}"#),
            ""
        );
    }
}
