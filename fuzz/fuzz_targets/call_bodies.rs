//! Lease and slot call bodies of any bytes, answered by a fresh quota service on a memory store:
//! each with a defined status, never a panic. The first byte picks the endpoint.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use tollgate_quota::fuzz_harness::{answer, memory_service, ANSWERED};

fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, body)) = data.split_first() else {
        return;
    };
    let status = answer(runtime(), &memory_service(), pick & 1 == 1, body.to_vec());
    assert!(ANSWERED.contains(&status), "{status}");
});
