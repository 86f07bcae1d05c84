//! The configuration and demo users start from work as shipped.

use crate::harness::{envoy_bin, wasm_path};
use std::path::Path;
use std::process::Command;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn example_envoy_config_validates() {
    wasm_path(); // the config mounts dist/tollgate.wasm
    let out = Command::new(envoy_bin())
        .current_dir(repo())
        .args([
            "--mode",
            "validate",
            "-c",
            "envoy/envoy.yaml",
            "-l",
            "error",
        ])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "envoy/envoy.yaml does not validate:\n{text}"
    );
}

/// The native demo (`make demo` runs it after building): starts, shows 200s turning into 429s
/// with headers and metrics, and stops what it started. It uses the fixed demo ports.
#[test]
fn demo_runs_end_to_end() {
    wasm_path();
    let out = Command::new("demo/run.sh")
        .current_dir(repo())
        .env("ENVOY_BIN", envoy_bin())
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed:\n{text}");
    for needle in [
        "HTTP/1.1 200 OK",
        "ratelimit: \"per-user\";r=2;",
        "HTTP/1.1 429 Too Many Requests",
        "x-tollgate-rule: per-user",
        "x-tollgate-rule: per-ip",
        "retry-after: ",
        "tollgate_rule_limited{tollgate_rule=\"per-ip\"} 1",
    ] {
        assert!(
            text.contains(needle),
            "demo output lacks {needle:?}:\n{text}"
        );
    }
    // Everything it started is gone: the demo ports are free again.
    for port in [8081, 9901, 10000] {
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
            "port {port} still served after the demo"
        );
    }
}
