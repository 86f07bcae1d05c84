//! A configuration of any bytes, and what parses run with two requests of the same bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tollgate::fuzz_harness::{run_configuration, Bytes};

fuzz_target!(|data: &[u8]| {
    run_configuration(data, &[Bytes::from_raw(data), Bytes::from_raw(b"10.0.0.1\n\x00u")]);
});
