//! Calls to the quota service at the host: a lease request sent (from whichever context makes
//! it: the root context for the tick's batched refills, a request's context for a call of its
//! own) and its answer read in the call-response callback.

use super::host::Host;
use crate::config::QuotaService;
use crate::engine::read_answer;
use crate::header_map;
use log::{error, warn};
use tollgate_core::global::lease::LeaseResponse;

/// Start a call to `path` (`/v1/lease`, `/v1/slots`); its answer comes to the calling context's
/// call-response callback. `None` if the call could not be made.
pub fn call<H: Host, T: serde::Serialize>(
    host: &H,
    service: &QuotaService,
    path: &str,
    request: &T,
) -> Option<u32> {
    let body = serde_json::to_vec(request)
        .map_err(|e| error!("cannot encode a quota service request: {e}"))
        .ok()?;
    let auth = service.token.as_ref().map(|t| format!("Bearer {t}"));
    let mut headers: Vec<(&[u8], &[u8])> = vec![
        (b":method", b"POST"),
        (b":path", path.as_bytes()),
        (b":authority", service.authority.as_bytes()),
        (b"content-type", b"application/json"),
    ];
    if let Some(auth) = &auth {
        headers.push((b"authorization", auth.as_bytes()));
    }
    let mut wire = Vec::new();
    header_map::serialize(headers.iter().copied(), &mut wire);
    let timeout = u32::try_from(service.timeout_ms).unwrap_or(u32::MAX);
    host.http_call(&service.upstream, &wire, &body, timeout)
        .map_err(|s| warn!("cannot call the quota service ({}): {s}", service.upstream))
        .ok()
}

/// The answer to a lease call for `items` items, read in its response callback; `None` if the
/// call failed or the answer is not a well-formed one.
pub fn answer<H: Host>(
    host: &H,
    num_headers: usize,
    body_size: usize,
    items: usize,
) -> Option<LeaseResponse> {
    let (status, body) = answer_parts(host, num_headers, body_size);
    read_answer(status.as_deref(), body.as_deref(), items)
}

/// The status and body of a call's answer, read in its response callback (none of either for a
/// failed call).
pub fn answer_parts<H: Host>(
    host: &H,
    num_headers: usize,
    body_size: usize,
) -> (Option<Vec<u8>>, Option<Vec<u8>>) {
    // A failed call (refused, reset, timed out) arrives with no headers at all.
    if num_headers == 0 {
        warn!("quota service call failed (no answer)");
        return (None, None);
    }
    let status = host.call_response_header(":status").map(|s| s.into_owned());
    let body = (body_size > 0)
        .then(|| host.call_response_body(body_size))
        .flatten();
    (status, body)
}
