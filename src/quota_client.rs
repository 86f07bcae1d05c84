//! Calls to the quota service: the tick's batched refills, answered in the root context, and a
//! request's own call (strict mode, and waits on hosts that cannot resume from the timer),
//! answered in the request's context.

use crate::callbacks;
use crate::engine::read_answer;
use crate::header_map;
use crate::host::{self, SharedData};
use crate::plugin::Plugin;
use crate::stats::ProcessStat;
use log::{error, warn};
use tollgate_core::lease::{LeaseRequest, LeaseResponse};

/// Send the refills this worker's requests claimed, in one call from the root context.
pub fn send_refills(plugin: &Plugin, root_id: u32) {
    let claimed = plugin.engine.borrow_mut().take_refills(&plugin.instance);
    let Some((refills, request)) = claimed else {
        return;
    };
    match call(plugin, root_id, &request) {
        Some(token) => plugin.queues.borrow_mut().call_sent(token, refills),
        None => {
            let now = host::now_ns().unwrap_or(0);
            plugin
                .engine
                .borrow_mut()
                .apply_grants(&SharedData, &refills, None, now);
        }
    }
}

/// Start a lease call from context `context_id`; its answer comes to that context's
/// call-response callback. `None` if the call could not be made.
pub fn call(plugin: &Plugin, context_id: u32, request: &LeaseRequest) -> Option<u32> {
    plugin.add(ProcessStat::QuotaCalls, 1);
    let engine = plugin.engine.borrow();
    let service = engine.config().quota_service.as_ref()?;
    let body = serde_json::to_vec(request)
        .map_err(|e| error!("cannot encode a lease request: {e}"))
        .ok()?;
    let auth = service.token.as_ref().map(|t| format!("Bearer {t}"));
    let mut headers: Vec<(&[u8], &[u8])> = vec![
        (b":method", b"POST"),
        (b":path", b"/v1/lease"),
        (b":authority", service.authority.as_bytes()),
        (b"content-type", b"application/json"),
    ];
    if let Some(auth) = &auth {
        headers.push((b"authorization", auth.as_bytes()));
    }
    let mut wire = Vec::new();
    header_map::serialize(headers.iter().copied(), &mut wire);
    let timeout = u32::try_from(service.timeout_ms).unwrap_or(u32::MAX);
    match host::http_call(&service.upstream, &wire, &body, timeout) {
        Ok(token) => {
            callbacks::register_call(token, context_id);
            Some(token)
        }
        Err(s) => {
            warn!("cannot call the quota service ({}): {s}", service.upstream);
            None
        }
    }
}

/// The answer to a lease call for `items` items, read in its response callback; `None` if the
/// call failed or the answer is not a well-formed one.
pub fn answer(num_headers: usize, body_size: usize, items: usize) -> Option<LeaseResponse> {
    // A failed call (refused, reset, timed out) arrives with no headers at all.
    if num_headers == 0 {
        warn!("quota service call failed (no answer)");
        return None;
    }
    let status = host::call_response_header(":status");
    let body = (body_size > 0)
        .then(|| host::call_response_body(body_size))
        .flatten();
    read_answer(status.as_deref(), body.as_deref(), items)
}
