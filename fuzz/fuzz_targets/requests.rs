//! Requests of any bytes (peer address, headers) through every configuration example of
//! docs/configuration.md: the first byte picks the configuration, the rest is split into up to
//! three requests by NUL bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tollgate::fuzz_harness::{config_seeds, run_configuration, Bytes};

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let seeds = config_seeds();
    let seed = seeds[usize::from(pick) % seeds.len()];
    let requests: Vec<Bytes> = rest.split(|&b| b == 0).take(3).map(Bytes::from_raw).collect();
    run_configuration(seed.as_bytes(), &requests);
});
