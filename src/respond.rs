//! Carrying out an answer at the host: a rejection sent as a local response, rate-limit headers
//! added to an admitted request's response. Both render into buffers the worker reuses.

use crate::engine::{QuotaReport, Rejection};
use crate::header_map;
use crate::host;
use crate::plugin::Plugin;
use log::{debug, error};

/// Refuse the current request with its rule's response and headers saying why.
pub fn reject(plugin: &Plugin, rejection: &Rejection) {
    let engine = plugin.engine.borrow();
    let mut scratch = plugin.scratch.borrow_mut();
    let scratch = &mut *scratch;
    scratch.headers.clear();
    scratch.wire.clear();
    let response = engine.render_rejection(&mut scratch.headers, rejection);
    let pairs = scratch
        .headers
        .iter()
        .map(|(n, v)| (n.as_bytes(), v.as_bytes()));
    header_map::serialize(pairs, &mut scratch.wire);
    // A host that appends a newline gets the body without its own last one: the client then
    // receives the configured body exactly.
    let body = match plugin.caps.appends_newline_to_body {
        true => response.body.strip_suffix('\n').unwrap_or(&response.body),
        false => &response.body,
    };
    if let Err(s) = host::send_local_response(response.status, &scratch.wire, body.as_bytes()) {
        error!("cannot send the rejection: {s}");
    }
}

/// Add the rate-limit headers describing `report` to the current response.
pub fn add_quota_headers(plugin: &Plugin, report: QuotaReport) {
    let engine = plugin.engine.borrow();
    let mut scratch = plugin.scratch.borrow_mut();
    scratch.headers.clear();
    engine.render_report(&mut scratch.headers, report);
    for (name, value) in scratch.headers.iter() {
        if let Err(s) = host::add_response_header(name, value) {
            debug!("cannot add response header {name}: {s}");
        }
    }
}
