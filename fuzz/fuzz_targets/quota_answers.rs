//! Quota answers of any bytes: the status, the lease answer's body, the slot answer's body and a
//! request, separated by NUL bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tollgate::fuzz_harness::{run_quota_answers, Bytes};

fuzz_target!(|data: &[u8]| {
    let mut parts = data.splitn(4, |&b| b == 0);
    let status = parts.next().unwrap_or_default();
    let lease = parts.next().unwrap_or_default();
    let slots = parts.next().unwrap_or_default();
    let request = Bytes::from_raw(parts.next().unwrap_or(b"10.0.0.1\n\x00u"));
    run_quota_answers(status, lease, slots, &request);
});
