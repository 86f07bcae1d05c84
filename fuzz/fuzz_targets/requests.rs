//! Requests of any bytes (peer address, headers) through every configuration example of
//! docs/configuration.md (with small tables): the first byte picks the configuration, the rest is split into up to
//! three requests by NUL bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tollgate::fuzz_harness::{run_configuration, small_seeds, Bytes};

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let seeds = small_seeds();
    let Some(seed) = seeds.get(usize::from(pick) % seeds.len().max(1)) else {
        return;
    };
    let requests: Vec<Bytes> = rest.split(|&b| b == 0).take(3).map(Bytes::from_raw).collect();
    run_configuration(seed.as_bytes(), &requests);
});
