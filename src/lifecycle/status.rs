//! The status path (`status.path`): the filter answers it itself, before any rule, to the
//! networks and the token the configuration allows.

use super::host::{Action, Host};
use super::plugin::Plugin;
use crate::engine::{json_string, Engine, KeyState};
use crate::network::ClientIp;
use crate::request::{query_values, Request, RequestView};
use log::{error, info};
use std::fmt::Write;
use tollgate_core::bearer::{bearer_token, constant_time_eq};

/// Answer `request` if it is for the status path; `None` for any other request.
pub fn serve<H: Host, V: RequestView>(plugin: &Plugin<H>, request: &Request<V>) -> Option<Action> {
    let engine = plugin.engine.borrow();
    let status = engine.config().status.as_ref()?;
    let path = request.path()?;
    let reset = match path.strip_prefix(status.path.as_bytes()) {
        Some(b"") => false,
        Some(b"/reset") => true,
        _ => return None,
    };
    // The client as rules find it (`trusted_hops`), its whole address.
    let whole = ClientIp {
        trusted_hops: engine.config().client_ip.trusted_hops,
        ipv4_prefix: 32,
        ipv6_prefix: 128,
    };
    let client = Request::new(request.view(), whole)
        .client_ip()
        .map(<[u8]>::to_vec);
    let allowed = client
        .as_deref()
        .is_some_and(|ip| status.allow.iter().any(|n| n.contains_key(ip)));
    let bearer = request.view().header("authorization");
    let token_ok = status.token.as_ref().is_none_or(|t| {
        bearer
            .as_deref()
            .and_then(|b| bearer_token(b).map(<[u8]>::to_vec))
            .is_some_and(|given| constant_time_eq(&given, t.as_bytes()))
    });
    let (code, body) = if !allowed {
        (
            403,
            r#"{"error":"the status path is not open to this client address (status.allow)"}"#
                .to_owned(),
        )
    } else if !token_ok {
        (
            401,
            r#"{"error":"the status path needs authorization: Bearer <status.token>"}"#.to_owned(),
        )
    } else if reset && request.method() != Some(b"POST") {
        (405, r#"{"error":"a reset is a POST"}"#.to_owned())
    } else if !reset && request.method() != Some(b"GET") {
        (
            405,
            r#"{"error":"the status path answers GET only"}"#.to_owned(),
        )
    } else {
        let now_ns = plugin.host.now_ns().unwrap_or(0);
        let query = |name: &[u8]| {
            request
                .full_path()
                .map(|p| query_values(p, name))
                .unwrap_or_default()
        };
        let (rule, values) = (query(b"rule"), query(b"key"));
        match rule.first() {
            None if !reset => (
                200,
                engine.status_json(&plugin.host, plugin.caps.name, now_ns / 1_000_000),
            ),
            None => (
                400,
                r#"{"error":"name the rule: ?rule=NAME&key=VALUE"}"#.to_owned(),
            ),
            Some(rule) => one_key(&engine, &plugin.host, rule, &values, reset, now_ns),
        }
    };
    let mut wire = Vec::new();
    let headers: [(&[u8], &[u8]); 2] = [
        (b"content-type", b"application/json"),
        (b"cache-control", b"no-store"),
    ];
    crate::header_map::serialize(headers.iter().copied(), &mut wire);
    let body = match plugin.caps.appends_newline_to_body {
        true => body,
        false => body + "\n",
    };
    if let Err(s) = plugin
        .host
        .send_local_response(code, &wire, body.as_bytes())
    {
        error!("cannot answer the status path: {s}");
    }
    Some(Action::Pause)
}

/// The status of one key of a local rule (`?rule=NAME&key=VALUE…`), or its reset: the answer's
/// status and JSON body.
fn one_key<H: Host>(
    engine: &Engine,
    host: &H,
    rule: &[u8],
    values: &[Vec<u8>],
    reset: bool,
    now_ns: u64,
) -> (u32, String) {
    let name = String::from_utf8_lossy(rule);
    let parts: Vec<&[u8]> = values.iter().map(Vec::as_slice).collect();
    let (index, key) = match engine.config().key_of(&name, &parts) {
        Ok(found) => found,
        Err(e) => return (400, error_json(&e)),
    };
    let mut out = String::from("{\"rule\":");
    json_string(&mut out, &name);
    out.push_str(",\"key\":[");
    for (i, v) in values.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        json_string(&mut out, &String::from_utf8_lossy(v));
    }
    out.push(']');
    if reset {
        return match engine.reset_key(host, index, &key) {
            Ok(done) => {
                if done {
                    info!("status path: a key of rule {name} reset");
                }
                let _ = write!(out, ",\"reset\":{done}}}");
                (200, out)
            }
            Err(e) => (400, error_json(&e)),
        };
    }
    match engine.key_state(host, index, &key, now_ns) {
        Ok(KeyState::Override(action)) => {
            let _ = write!(out, ",\"override\":\"{action}\"}}");
            (200, out)
        }
        Ok(KeyState::Limited {
            found,
            available,
            wait_ns,
            full_in_ns,
            debt,
            in_flight,
        }) => {
            let secs = |ns: u64| ns.div_ceil(1_000_000_000);
            let _ = write!(
                out,
                ",\"found\":{found},\"limited\":{},\"available\":{available},\
                 \"retry_after_s\":{},\"full_in_s\":{},\"debt\":{debt}",
                available == 0,
                secs(wait_ns),
                secs(full_in_ns)
            );
            if let Some(n) = in_flight {
                let _ = write!(out, ",\"in_flight\":{n}");
            }
            out.push('}');
            (200, out)
        }
        Err(e) => (400, error_json(&e)),
    }
}

fn error_json(message: &str) -> String {
    let mut out = String::from("{\"error\":");
    json_string(&mut out, message);
    out.push('}');
    out
}
