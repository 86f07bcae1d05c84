//! Carrying out an answer at the host: a refusal sent as a local response, rate-limit headers
//! added to an admitted request's response. Both render into buffers the worker reuses.

use super::host::Host;
use crate::config::HostCaps;
use crate::engine::{Engine, QuotaReport, Refusal};
use crate::header_map;
use crate::headers::HeaderSet;
use log::{debug, error};

/// Buffers a worker reuses from response to response.
#[derive(Default)]
pub struct Scratch {
    headers: HeaderSet,
    wire: Vec<u8>,
}

/// Refuse the current request with its rule's response and headers saying why.
pub fn refuse<H: Host>(
    host: &H,
    engine: &Engine,
    scratch: &mut Scratch,
    caps: &HostCaps,
    refusal: &Refusal,
) {
    scratch.headers.clear();
    scratch.wire.clear();
    let response = engine.render_refusal(&mut scratch.headers, refusal);
    let pairs = scratch
        .headers
        .iter()
        .map(|(n, v)| (n.as_bytes(), v.as_bytes()));
    header_map::serialize(pairs, &mut scratch.wire);
    // A host that appends a newline gets the body without its own last one: the client then
    // receives the configured body exactly.
    let body = match caps.appends_newline_to_body {
        true => response.body.strip_suffix('\n').unwrap_or(&response.body),
        false => &response.body,
    };
    if let Err(s) = host.send_local_response(response.status, &scratch.wire, body.as_bytes()) {
        error!("cannot send the refusal: {s}");
    }
}

/// Add the rate-limit headers describing `report` to the current response.
pub fn add_quota_headers<H: Host>(
    host: &H,
    engine: &Engine,
    scratch: &mut Scratch,
    report: QuotaReport,
) {
    scratch.headers.clear();
    engine.render_report(&mut scratch.headers, report);
    for (name, value) in scratch.headers.iter() {
        if let Err(s) = host.add_response_header(name, value) {
            debug!("cannot add response header {name}: {s}");
        }
    }
}
