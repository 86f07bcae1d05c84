//! `tollgate check` as a user runs it: the binary, a file or standard input, exit codes.

// Test code: a failed expectation is meant to panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Write;
use std::process::{Command, Output, Stdio};

fn check(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("check")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin.unwrap_or("").as_bytes()).unwrap();
    drop(input);
    child.wait_with_output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

const HELD: &str = r#"{"rules":[{"name":"slow","algorithm":"leaky_bucket","limit":{"requests":10,"per":"1s"},"burst":5}]}"#;

#[test]
fn a_valid_configuration_is_summarised_with_its_shared_data() {
    let dir = std::env::temp_dir().join(format!("tollgate-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("ok.json");
    std::fs::write(
        &file,
        r#"{"rules":[{"name":"per-ip","key":["client_ip"],"limit":{"requests":100,"per":"1m"},"max_keys":1000}]}"#,
    )
    .unwrap();
    let out = check(&[file.to_str().unwrap()], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("ok: 1 rule(s): per-ip (token_bucket 100 per 1m, burst 100, 1000 slots)"),
        "{stdout}"
    );
    assert!(stdout.contains("shared data: 1000 slots"), "{stdout}");
    assert!(stdout.contains("shm_kv * 256k eviction=none"), "{stdout}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn an_invalid_configuration_names_the_field_and_exits_1() {
    let out = check(
        &["-"],
        Some(r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"5x"}}]}"#),
    );
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.starts_with("-: rules[0].limit.per: invalid duration \"5x\""),
        "{stderr}"
    );
    assert!(text(&out.stdout).is_empty());
}

#[test]
fn a_host_that_cannot_hold_requests_refuses_delays() {
    let out = check(&["--host", "nginx", "-"], Some(HELD));
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("rules[0].delay: nginx (ngx_wasm_module) cannot resume a held request"),
        "{stderr}"
    );
    let out = check(&["--host", "envoy", "-"], Some(HELD));
    assert!(out.status.success());
    // Without --host: accepted, with a warning for the host that would refuse it.
    let out = check(&["-"], Some(HELD));
    assert!(out.status.success());
    assert!(text(&out.stdout).contains("warning: nginx (ngx_wasm_module) would refuse it"));
    let nodelay = HELD.replace(r#""burst":5"#, r#""burst":5,"delay":"nodelay""#);
    let out = check(&["--host", "nginx", "-"], Some(&nodelay));
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn a_missing_file_is_a_usage_error() {
    let out = check(&["/nonexistent/tollgate.json"], None);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("cannot read"));
}

#[test]
fn global_rules_carry_the_nginx_note() {
    let global = r#"{"rules":[{"name":"g","scope":"global","limit":{"requests":10,"per":"1s"}}],"quota_service":{"upstream":"127.0.0.1:8081"}}"#;
    let out = check(&["--host", "nginx", "-"], Some(global));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("proxy_wasm_request_headers_in_access on;"));
    let out = check(&["--host", "envoy", "-"], Some(global));
    assert!(!text(&out.stdout).contains("proxy_wasm_request_headers_in_access"));
}

#[test]
fn byte_limits_carry_the_envoy_route_timeout_note() {
    let bytes = r#"{"rules":[{"name":"dl","limit":{"bytes":1000000,"per":"1s"}}]}"#;
    let out = check(&["--host", "envoy", "-"], Some(bytes));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("paces response bodies"), "{stdout}");
    assert!(stdout.contains("give the route a timeout"), "{stdout}");
    let out = check(&["--host", "nginx", "-"], Some(bytes));
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn rules_that_read_the_body_carry_the_envoy_note() {
    let body = r#"{"rules":[{"name":"llm","limit":{"requests":1000,"per":"1m"},"cost":{"body":["max_tokens"],"max":900}}]}"#;
    let out = check(&["--host", "envoy", "-"], Some(body));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("reads the request body"), "{stdout}");
    assert!(
        stdout.contains("allow_on_headers_stop_iteration: true"),
        "{stdout}"
    );
    assert!(
        !stdout.contains("per_connection_buffer_limit_bytes"),
        "{stdout}"
    );
    let big = body.replace("}]}", r#"}],"max_request_body_bytes":2097152}"#);
    let out = check(&["--host", "envoy", "-"], Some(&big));
    assert!(text(&out.stdout).contains("per_connection_buffer_limit_bytes"));
    let out = check(&["--host", "nginx", "-"], Some(body));
    assert!(!text(&out.stdout).contains("allow_on_headers_stop_iteration"));
}

#[test]
fn a_body_cost_whose_default_is_below_its_max_is_warned_of() {
    let low = r#"{"rules":[{"name":"llm","key":["header:x-api-key"],"limit":{"requests":100000,"per":"1m"},
        "cost":{"body":["max_tokens"],"default":1000,"max":50000}}]}"#;
    let out = check(&["-"], Some(low));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("warning: rules[0].cost.default is 1000, less than its max 50000"),
        "{stdout}"
    );
    let at_max = low.replace(r#""default":1000,"#, "");
    let out = check(&["-"], Some(&at_max));
    assert!(!text(&out.stdout).contains("cost.default"));
}
