//! Where the built artifacts are (the module, the service, the testbed) and scratch directories.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
/// Generous: the V8 or Wasmtime compile of the module and the slot tables take well under this.
pub const START_TIMEOUT: Duration = Duration::from_secs(60);

pub fn wasm_path() -> PathBuf {
    built_artifact("TOLLGATE_WASM", "dist/tollgate.wasm")
}

/// The `probe` build of the module (`--features probe`): it counts time and heap allocations per
/// callback into host counters `tollgate.probe.<callback>.{ns,allocs,calls}`.
pub fn probe_wasm_path() -> PathBuf {
    built_artifact(
        "TOLLGATE_PROBE_WASM",
        "target/probe/wasm32-wasip1/release/tollgate.wasm",
    )
}

/// Which build of tollgate the Envoy tests run: in the `envoy_native` test binary (the same
/// tests, tests/envoy_native.rs) the Envoy dynamic module; in the `envoy` binary the Wasm module,
/// or the dynamic module with `TOLLGATE_BUILD=native`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Build {
    Wasm,
    Native,
}

pub fn build() -> Build {
    let binary = std::env::current_exe().ok();
    let name = binary
        .as_ref()
        .and_then(|p| p.file_name())
        .and_then(|n| n.to_str());
    if name.is_some_and(|n| n.starts_with("envoy_native-")) {
        return Build::Native;
    }
    match std::env::var("TOLLGATE_BUILD").as_deref() {
        Ok("native") => Build::Native,
        Ok("wasm") | Err(_) => Build::Wasm,
        Ok(other) => panic!("TOLLGATE_BUILD={other}: expected wasm or native"),
    }
}

/// The Envoy dynamic module (`libtollgate.so`: Envoy finds it by that name in its search path).
pub fn native_path() -> PathBuf {
    built_artifact("TOLLGATE_NATIVE", "dist/libtollgate.so")
}

/// The `probe` build of the dynamic module (counters `tollgate.probe.<hook>.{ns,allocs,calls}`,
/// and a hook that panics when asked).
pub fn probe_native_path() -> PathBuf {
    built_artifact("TOLLGATE_PROBE_NATIVE", "dist/probe/libtollgate.so")
}

/// The module of the build under test (`probe`: its probe build).
pub fn module_path(probe: bool) -> PathBuf {
    match (build(), probe) {
        (Build::Wasm, false) => wasm_path(),
        (Build::Wasm, true) => probe_wasm_path(),
        (Build::Native, false) => native_path(),
        (Build::Native, true) => probe_native_path(),
    }
}

/// A path `make test` provides through `var`, else its default place in the repository.
pub fn built_artifact(var: &str, default: &str) -> PathBuf {
    let path = std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(default));
    assert!(
        path.exists(),
        "{} is missing: run the tests with `make test` (it builds and installs what they need)",
        path.display()
    );
    path
}

/// A fresh directory for one proxy of a test, under `target/<kind>/`.
pub fn scratch_dir(kind: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let dir = repo().join("target").join(kind).join(format!(
        "{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("logs")).unwrap();
    dir
}

pub fn repo() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}
