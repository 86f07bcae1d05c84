//! The configuration and demo users start from work as shipped.

use crate::harness::{envoy_bin, wasm_path};

fn built_artifact_path(var: &str) -> std::path::PathBuf {
    std::env::var_os(var)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| repo().join("target/debug/tollgate-quota"))
}
use std::path::Path;
use std::process::Command;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every Envoy configuration in the repository, as (path, YAML).
fn envoy_configs() -> Vec<(String, String)> {
    let mut found = Vec::new();
    for dir in ["envoy", "demo/compose", "examples/envoy"] {
        let Ok(entries) = std::fs::read_dir(repo().join(dir)) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "yaml") {
                let text = std::fs::read_to_string(&path).unwrap();
                found.push((
                    format!("{dir}/{}", entry.file_name().to_string_lossy()),
                    text,
                ));
            }
        }
    }
    found.sort();
    found
}

fn yaml(text: &str) -> serde_json::Value {
    serde_yaml_ng::from_str(text).unwrap()
}

#[test]
fn every_envoy_config_in_the_repository_validates() {
    let wasm = wasm_path();
    let configs = envoy_configs();
    let names: Vec<&str> = configs.iter().map(|(n, _)| n.as_str()).collect();
    assert!(names.len() >= 4, "{names:?}");
    let dir = repo().join("target/envoy-tests/validate");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, text) in configs {
        // Module paths are where each deployment mounts it; check against the one just built.
        let here = format!("filename: {}", wasm.display());
        let local = text
            .replace("filename: /etc/envoy/tollgate.wasm", &here)
            .replace("filename: dist/tollgate.wasm", &here);
        let path = dir.join(name.replace('/', "_"));
        std::fs::write(&path, local).unwrap();
        // The dynamic module, where a configuration loads it, from the one just built.
        let native = crate::harness::native_path();
        let out = Command::new(envoy_bin())
            .env(
                "ENVOY_DYNAMIC_MODULES_SEARCH_PATH",
                native.parent().unwrap(),
            )
            .args(["--mode", "validate", "-l", "error", "-c"])
            .arg(&path)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && text.contains(" OK"),
            "{name} does not validate:\n{text}"
        );
    }
}

/// The tollgate plugin configuration (parsed JSON) of an Envoy configuration.
fn plugin_config(envoy: &serde_json::Value) -> serde_json::Value {
    let filters = &envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["http_filters"];
    let tollgate = filters
        .as_array()
        .unwrap()
        .iter()
        .find(|f| {
            f["name"] == "envoy.filters.http.wasm"
                || f["name"] == "envoy.filters.http.dynamic_modules"
        })
        .expect("a tollgate filter (Wasm or the dynamic module)");
    let config = &tollgate["typed_config"];
    let value = match tollgate["name"].as_str() {
        Some("envoy.filters.http.wasm") => &config["config"]["configuration"]["value"],
        _ => &config["filter_config"]["value"],
    };
    serde_json::from_str(value.as_str().unwrap()).unwrap()
}

#[test]
fn every_plugin_configuration_in_the_repository_matches_the_schema() {
    let schema: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("schema/tollgate.schema.json")).unwrap(),
    )
    .unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    for (name, text) in envoy_configs() {
        let config = plugin_config(&yaml(&text));
        let errors: Vec<String> = validator
            .iter_errors(&config)
            .map(|e| e.to_string())
            .collect();
        assert!(errors.is_empty(), "{name}: {errors:?}");
    }
    // And it does reject what the filter rejects.
    let bad = serde_json::json!({"rules": [{"name": "Bad Name", "limit": {"requests": 0, "per": "5x"}}], "x": 1});
    assert!(validator.iter_errors(&bad).count() >= 3);
}

#[test]
fn the_compose_demo_is_consistent() {
    let compose = yaml(&std::fs::read_to_string(repo().join("docker-compose.yml")).unwrap());
    let services = compose["services"].as_object().expect("services");
    let names: Vec<&str> = services.keys().map(String::as_str).collect();
    for want in ["envoy-a", "envoy-b", "quota", "redis", "upstream"] {
        assert!(names.contains(&want), "no service {want}: {names:?}");
    }
    // Every mounted file exists (the module once `make build` ran), every build context too.
    for (name, service) in services {
        for volume in service["volumes"].as_array().into_iter().flatten() {
            let host = volume.as_str().unwrap().split(':').next().unwrap();
            if !host.starts_with('.') {
                // A named volume (Redis's data): declared at the top level, written to.
                assert!(
                    compose["volumes"].get(host).is_some(),
                    "{name}: {host} undeclared"
                );
                continue;
            }
            assert!(repo().join(host).exists(), "{name} mounts missing {host}");
            assert!(
                volume.as_str().unwrap().ends_with(":ro"),
                "{name}: {volume} read-only"
            );
        }
        if let Some(build) = service.get("build") {
            let context = repo().join(build["context"].as_str().unwrap());
            let file = build["dockerfile"].as_str().unwrap_or("Dockerfile");
            assert!(
                context.join(file).exists(),
                "{name}: no {file} in its build context"
            );
            // Cargo reads the whole workspace to build one crate: every member is copied in.
            let dockerfile = std::fs::read_to_string(context.join(file)).unwrap();
            for member in workspace_members().iter().filter(|m| *m != ".") {
                assert!(
                    dockerfile.contains(&format!("COPY {member} {member}")),
                    "{name}: {file} does not copy the workspace member {member}"
                );
            }
        }
    }
    // Envoy is the version the tests run.
    let setup = std::fs::read_to_string(repo().join("scripts/setup.sh")).unwrap();
    let pinned = setup
        .lines()
        .find_map(|l| l.strip_prefix("ENVOY_VERSION=\"${ENVOY_VERSION:-"))
        .and_then(|l| l.strip_suffix("}\""))
        .expect("the pinned Envoy version in scripts/setup.sh");
    for envoy in ["envoy-a", "envoy-b"] {
        assert_eq!(
            services[envoy]["image"],
            format!("envoyproxy/envoy:v{pinned}"),
            "{envoy}"
        );
    }
    // The Envoy config's clusters point at compose services, on the ports they listen on.
    let config = yaml(&std::fs::read_to_string(repo().join("demo/compose/envoy.yaml")).unwrap());
    for cluster in config["static_resources"]["clusters"].as_array().unwrap() {
        let address = &cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
            ["address"]["socket_address"];
        let host = address["address"].as_str().unwrap();
        let port = address["port_value"].as_u64().unwrap().to_string();
        let service = services
            .get(host)
            .unwrap_or_else(|| panic!("cluster address {host} is no compose service"));
        let command: Vec<&str> = service["command"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap())
            .collect();
        assert!(
            command
                .iter()
                .any(|c| *c == port || c.ends_with(&format!(":{port}"))),
            "{host} does not listen on {port}: {command:?}"
        );
    }
    // Prometheus (profile monitoring) scrapes compose services, with the rules mounted where its
    // config loads them; the stand-in script builds the image the compose file names.
    let prometheus = yaml(
        &std::fs::read_to_string(repo().join("monitoring/prometheus/prometheus.yml")).unwrap(),
    );
    for job in prometheus["scrape_configs"].as_array().unwrap() {
        for target in job["static_configs"][0]["targets"].as_array().unwrap() {
            let host = target.as_str().unwrap().split(':').next().unwrap();
            assert!(
                services.contains_key(host),
                "Prometheus scrapes {host}: no such service"
            );
        }
    }
    let rules_at = prometheus["rule_files"][0].as_str().unwrap();
    assert!(
        services["prometheus"]["volumes"]
            .to_string()
            .contains(&format!(":{rules_at}:ro")),
        "the alerting rules are not mounted at {rules_at}"
    );
    let standin = std::fs::read_to_string(repo().join("scripts/standin-prometheus.sh")).unwrap();
    let image = services["prometheus"]["image"].as_str().unwrap();
    assert!(standin.contains(&format!("tag={image}")), "{image}");
    // Nothing is published beyond this machine; the service requires the token the filter sends;
    // Redis persists its data.
    for (name, service) in services {
        for port in service["ports"].as_array().into_iter().flatten() {
            assert!(
                port.as_str().unwrap().starts_with("127.0.0.1:"),
                "{name} publishes {port} beyond loopback"
            );
        }
    }
    let quota_args: Vec<&str> = services["quota"]["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    let token = quota_args
        .windows(2)
        .find(|w| w[0] == "--token")
        .map(|w| w[1])
        .expect("the quota service requires a token");
    let plugin = plugin_config(&config);
    assert_eq!(plugin["quota_service"]["token"], token);
    assert!(plugin["quota_service"]["key_secret"].is_string());
    let redis_args = services["redis"]["command"].to_string();
    assert!(
        redis_args.contains(r#""--appendonly","yes""#),
        "{redis_args}"
    );
    // Docker and native demos run the same rules.
    let native = yaml(&std::fs::read_to_string(repo().join("envoy/envoy.yaml")).unwrap());
    assert_eq!(plugin_config(&config), plugin_config(&native));
}

/// The native demo (`make demo` runs it after building): starts, shows 200s turning into 429s
/// with headers and metrics, and stops what it started. It uses the fixed demo ports.
#[test]
fn demo_runs_end_to_end() {
    let _demo_ports = crate::harness::MachineLock::take("demo-ports");
    wasm_path();
    let out = Command::new("demo/run.sh")
        .current_dir(repo())
        .env("ENVOY_BIN", envoy_bin())
        .env(
            "TOLLGATE_QUOTA_BIN",
            built_artifact_path("TOLLGATE_QUOTA_BIN"),
        )
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed:\n{text}");
    let reports = |code: &str| text.matches(&format!("    {code} from ")).count();
    assert_eq!((reports("200"), reports("429")), (2, 2), "{text}");
    for needle in [
        "HTTP/1.1 200 OK",
        "ratelimit: \"per-user\";r=2;",
        "HTTP/1.1 429 Too Many Requests",
        "x-tollgate-rule: per-user",
        "x-tollgate-rule: per-ip",
        "retry-after: ",
        "tollgate_rule_limited{tollgate_rule=\"per-ip\"} 1",
        // The global rule: 6 a minute across both Envoys.
        "x-tollgate-rule: search",
        "tollgate_quota_tokens_granted_total 6",
        // Global concurrency: 2 of 4 slow reports at once across both Envoys.
        "tollgate_quota_slots_held{rule=\"reports\"",
        // The token budget: settled from the stream, then owed.
        "x-tollgate-rule: llm-tokens",
        "tollgate_rule_settled{tollgate_rule=\"llm-tokens\"} 1200",
        "tollgate_rule_charged{tollgate_rule=\"llm-tokens\"} 500",
    ] {
        assert!(
            text.contains(needle),
            "demo output lacks {needle:?}:\n{text}"
        );
    }
    assert_demo_ports_free();
}

/// Everything the demo started is gone: its ports are free again.
fn assert_demo_ports_free() {
    for port in [8081, 8090, 9901, 9902, 10000, 10001] {
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
            "port {port} still served after the demo"
        );
    }
}

/// The demo left running (after its walk-through: every rule kind of the demo has decided
/// requests) serves every metric, with every label, that the dashboard's panels and the alerting
/// rules in monitoring/ query — Envoy's `/stats/prometheus` with the README's `stats_tags`, the
/// quota service's `/metrics`; then Ctrl-C (SIGINT) stops every process it started.
#[test]
fn the_demo_left_running_serves_what_the_dashboard_and_alerts_query_and_ctrl_c_stops_it() {
    use std::io::BufRead;
    let _demo_ports = crate::harness::MachineLock::take("demo-ports");
    wasm_path();
    let mut child = Command::new("demo/run.sh")
        .current_dir(repo())
        .env("ENVOY_BIN", envoy_bin())
        .env(
            "TOLLGATE_QUOTA_BIN",
            built_artifact_path("TOLLGATE_QUOTA_BIN"),
        )
        .env("DEMO_KEEP", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let lines = std::io::BufReader::new(stdout).lines();
    let mut seen = Vec::new();
    for line in lines {
        let line = line.unwrap();
        let ready = line.contains("Press Ctrl-C");
        seen.push(line);
        if ready {
            break;
        }
    }
    assert!(
        seen.last().is_some_and(|l| l.contains("Press Ctrl-C")),
        "{seen:#?}"
    );
    let mut scrape = crate::monitoring::Scrape::new();
    let mut unscraped = Vec::new();
    for url in [
        "http://127.0.0.1:9901/stats/prometheus",
        "http://127.0.0.1:9902/stats/prometheus",
        "http://127.0.0.1:8090/metrics",
    ] {
        match ureq::get(url).call().map(|r| r.into_string()) {
            Ok(Ok(text)) => crate::monitoring::read_exposition(&text, &mut scrape),
            other => unscraped.push(format!("{url}: {other:?}")),
        }
    }
    let queries = crate::monitoring::monitoring_queries(repo());
    let mut missing = crate::monitoring::missing(&scrape, &queries);
    missing.extend(unscraped);
    Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    let exited = || child.try_wait().unwrap().is_some();
    assert!(
        crate::harness::eventually(std::time::Duration::from_secs(10), exited),
        "the demo ignored Ctrl-C"
    );
    assert_demo_ports_free();
    assert!(
        missing.is_empty(),
        "queried but not served by the live demo:\n{}",
        missing.join("\n")
    );
}

/// The workspace's members, as the root Cargo.toml lists them.
fn workspace_members() -> Vec<String> {
    let manifest = std::fs::read_to_string(repo().join("Cargo.toml")).unwrap();
    let list = manifest
        .lines()
        .find_map(|l| l.strip_prefix("members = ["))
        .and_then(|l| l.strip_suffix(']'))
        .expect("a one-line members list in Cargo.toml");
    list.split(',')
        .map(|m| m.trim().trim_matches('"').to_owned())
        .filter(|m| !m.is_empty())
        .collect()
}

/// The documents of a multi-document YAML file.
fn yaml_documents(text: &str) -> Vec<serde_json::Value> {
    use serde::Deserialize;
    serde_yaml_ng::Deserializer::from_str(text)
        .map(|doc| serde_json::Value::deserialize(doc).unwrap())
        .collect()
}

#[test]
fn the_envoy_gateway_samples_give_each_build_a_configuration_it_loads() {
    use tollgate::config::{Config, HostCaps};
    let schema: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("schema/tollgate.schema.json")).unwrap(),
    )
    .unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let check = |name: &str, config: &serde_json::Value, caps: &HostCaps| {
        let errors: Vec<String> = validator
            .iter_errors(config)
            .map(|e| e.to_string())
            .collect();
        assert!(errors.is_empty(), "{name}: {errors:?}");
        let parsed = Config::parse(config.to_string().as_bytes()).unwrap();
        parsed.check_host(caps).unwrap();
    };
    let dir = repo().join("examples/envoy-gateway");
    let wasm = yaml_documents(&std::fs::read_to_string(dir.join("wasm.yaml")).unwrap());
    let policy = &wasm[0];
    assert_eq!(policy["kind"], "EnvoyExtensionPolicy");
    let filter = &policy["spec"]["wasm"][0];
    assert_eq!(filter["rootID"], "tollgate");
    check("wasm.yaml", &filter["config"], &HostCaps::ENVOY);

    let native = yaml_documents(&std::fs::read_to_string(dir.join("dynamic-module.yaml")).unwrap());
    let kind = |k: &str| native.iter().find(|d| d["kind"] == k).unwrap();
    let proxy = kind("EnvoyProxy");
    let allowed = &proxy["spec"]["dynamicModules"][0];
    // Built for Envoy 1.40: the proxy runs it.
    let image = &proxy["spec"]["provider"]["kubernetes"]["envoyDeployment"]["container"]["image"];
    assert!(image.as_str().unwrap().ends_with("v1.40.0"), "{image}");
    let runtime: serde_json::Value =
        serde_yaml_ng::from_str(proxy["spec"]["bootstrap"]["value"].as_str().unwrap()).unwrap();
    let flag = "envoy.reloadable_features.dynamic_modules_strip_custom_stat_prefix";
    assert_eq!(
        runtime["layered_runtime"]["layers"][0]["static_layer"][flag],
        true
    );
    let gateway = kind("Gateway");
    assert_eq!(
        gateway["spec"]["infrastructure"]["parametersRef"]["name"],
        proxy["metadata"]["name"]
    );
    let policy = kind("EnvoyExtensionPolicy");
    let filter = &policy["spec"]["dynamicModule"][0];
    assert_eq!(filter["name"], allowed["name"]);
    assert_eq!(filter["filterName"], "tollgate");
    assert_eq!(
        policy["spec"]["targetRefs"][0]["name"],
        gateway["metadata"]["name"]
    );
    check(
        "dynamic-module.yaml",
        &filter["config"],
        &HostCaps::ENVOY_MODULE,
    );
}
