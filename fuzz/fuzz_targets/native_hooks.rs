//! The Envoy dynamic module's hooks under arbitrary input, against Rust's stand-in for Envoy: a
//! request of any bytes (headers, address, metadata, body, response) and answers of any bytes to
//! the calls it makes, through configurations that read each and call the quota service
//! (`tollgate_native::fuzz_harness`). A panic a hook caught is a failure.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tollgate_native::fuzz_harness::{case_of, run};

fuzz_target!(|data: &[u8]| {
    let panics = run(&case_of(data));
    assert_eq!(panics, 0, "a hook panicked");
});
