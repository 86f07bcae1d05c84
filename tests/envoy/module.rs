//! The built module's interface: it imports only host functions that Envoy and ngx_wasm_module
//! both implement with the same signature, and exports every callback either host enters.

use crate::harness::{probe_wasm_path, wasm_path};
use std::collections::BTreeMap;
use wasmparser::{Parser, Payload, TypeRef, ValType};

/// (module, name) → (parameters, results) of a function the module imports or exports.
type Functions = BTreeMap<(String, String), (Vec<ValType>, Vec<ValType>)>;

fn interface(path: &std::path::Path) -> (Functions, Vec<String>) {
    let bytes = std::fs::read(path).unwrap();
    let mut types = Vec::new();
    let mut imports = Functions::new();
    let mut exports = Vec::new();
    for payload in Parser::new(0).parse_all(&bytes) {
        match payload.unwrap() {
            Payload::TypeSection(reader) => {
                for group in reader {
                    for sub in group.unwrap().into_types() {
                        let f = sub.unwrap_func();
                        types.push((f.params().to_vec(), f.results().to_vec()));
                    }
                }
            }
            Payload::ImportSection(reader) => {
                for import in reader.into_imports() {
                    let import = import.unwrap();
                    let TypeRef::Func(t) = import.ty else {
                        panic!("{} imports a non-function {}", import.module, import.name)
                    };
                    let key = (import.module.to_string(), import.name.to_string());
                    imports.insert(key, types[t as usize].clone());
                }
            }
            Payload::ExportSection(reader) => {
                exports.extend(reader.into_iter().map(|e| e.unwrap().name.to_string()));
            }
            _ => {}
        }
    }
    (imports, exports)
}

/// The host functions both hosts implement for ABI 0.2.1, with their signatures: i32 everywhere
/// except the metric value, an i64. (`proxy_get_log_level` is not here: ngx_wasm_module stubs it
/// with another signature, and a module importing it does not instantiate there.)
fn portable(name: &str) -> Option<usize> {
    Some(match name {
        "proxy_log" => 3,
        "proxy_get_current_time_nanoseconds" => 1,
        "proxy_set_tick_period_milliseconds" => 1,
        "proxy_get_buffer_bytes" => 5,
        "proxy_get_header_map_value" => 5,
        "proxy_add_header_map_value" => 5,
        "proxy_get_property" => 4,
        "proxy_get_shared_data" => 5,
        "proxy_set_shared_data" => 5,
        "proxy_define_metric" => 4,
        "proxy_increment_metric" | "proxy_record_metric" => 2,
        "proxy_http_call" => 10,
        "proxy_send_local_response" => 8,
        "proxy_set_effective_context" => 1,
        "proxy_continue_stream" => 1,
        _ => return None,
    })
}

#[test]
fn the_module_imports_only_what_both_hosts_implement_and_exports_every_callback() {
    for path in [wasm_path(), probe_wasm_path()] {
        let (imports, exports) = interface(&path);
        for ((module, name), (params, results)) in &imports {
            match module.as_str() {
                "env" => {
                    let arity = portable(name)
                        .unwrap_or_else(|| panic!("{}: imports env.{name}", path.display()));
                    assert_eq!(params.len(), arity, "env.{name}");
                    let metric = name.ends_with("_metric") && name != "proxy_define_metric";
                    for (i, p) in params.iter().enumerate() {
                        let want = if metric && i == 1 {
                            ValType::I64
                        } else {
                            ValType::I32
                        };
                        assert_eq!(*p, want, "env.{name} parameter {i}");
                    }
                    assert_eq!(results, &[ValType::I32], "env.{name}");
                }
                "wasi_snapshot_preview1" => {}
                other => panic!("imports from {other}"),
            }
        }
        for callback in [
            "_initialize",
            "proxy_abi_version_0_2_1",
            "proxy_on_memory_allocate",
            "proxy_on_context_create",
            "proxy_on_vm_start",
            "proxy_on_configure",
            "proxy_on_tick",
            "proxy_on_request_headers",
            "proxy_on_request_body",
            "proxy_on_request_trailers",
            "proxy_on_response_headers",
            "proxy_on_response_body",
            "proxy_on_response_trailers",
            "proxy_on_log",
            "proxy_on_done",
            "proxy_on_delete",
            "proxy_on_http_call_response",
            "proxy_on_queue_ready",
        ] {
            assert!(
                exports.iter().any(|e| e == callback),
                "{} does not export {callback}",
                path.display()
            );
        }
    }
}
