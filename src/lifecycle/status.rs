//! The status path (`status.path`): the filter answers it itself, before any rule, to the
//! networks and the token the configuration allows.

use super::host::{Action, Host};
use super::plugin::Plugin;
use crate::network::ClientIp;
use crate::request::{Request, RequestView};
use log::error;

/// Answer `request` if it is for the status path; `None` for any other request.
pub fn serve<H: Host, V: RequestView>(plugin: &Plugin<H>, request: &Request<V>) -> Option<Action> {
    let engine = plugin.engine.borrow();
    let status = engine.config().status.as_ref()?;
    if request.path() != Some(status.path.as_bytes()) {
        return None;
    }
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
            .and_then(|b| b.strip_prefix(b"Bearer "))
            .is_some_and(|given| constant_time_eq(given, t.as_bytes()))
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
    } else if request.method() != Some(b"GET") {
        (
            405,
            r#"{"error":"the status path answers GET only"}"#.to_owned(),
        )
    } else {
        let now_ms = plugin.host.now_ns().unwrap_or(0) / 1_000_000;
        (
            200,
            engine.status_json(&plugin.host, plugin.caps.name, now_ms),
        )
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

/// Equal, in time that does not depend on where they differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
