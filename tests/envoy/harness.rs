//! A real Envoy with the built tollgate module, started per test on free ports and always stopped.

use serde_json::{json, Value};
use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub use testkit::*;

pub fn envoy_bin() -> PathBuf {
    built_artifact("ENVOY_BIN", ".venv/bin/envoy")
}

/// What a test can vary around the plugin configuration.
pub struct Options {
    pub concurrency: u32,
    /// HTTP filters between tollgate and the router (e.g. a fault filter to slow requests down).
    pub filters_after: Vec<Value>,
    /// HTTP filters before tollgate (e.g. one that sets request metadata).
    pub filters_before: Vec<Value>,
    /// 0: any free port.
    pub port: u16,
    /// Serve the listener through file-based LDS, so that `Envoy::reconfigure` can replace it.
    pub lds: bool,
    /// Log Wasm (filter) messages at debug level.
    pub debug_log: bool,
    /// A cluster `quota` pointing at this port on 127.0.0.1 (the quota service).
    pub quota_port: Option<u16>,
    /// A standby quota service on this port: the cluster sends calls to it while `quota_port`
    /// fails its health check (Envoy's priority failover, checked every 100 ms).
    pub quota_standby: Option<u16>,
    /// More quota service replicas beside `quota_port`, round robin, each health-checked every
    /// 100 ms (as docs/quota-api.md's replicas).
    pub quota_replicas: Vec<u16>,
    /// Another build of the module than `make test`'s (e.g. [`probe_wasm_path`]).
    pub module: Option<PathBuf>,
    /// A second listener ("second", [`Envoy::port2`]) whose tollgate filter has this
    /// configuration, in the same `vm_id` as the first (static listeners only).
    pub second_plugin: Option<Value>,
    /// A cluster `app` on this port of 127.0.0.1, routed for paths under `/app`.
    pub app_port: Option<u16>,
    /// Routes of the main listener before its catch-all (e.g. direct responses with a status or
    /// a body a test needs).
    pub routes: Vec<Value>,
    /// The wasm filter's `allow_on_headers_stop_iteration` (what rules that read the request
    /// body need; off by default, as in Envoy).
    pub body_readable: bool,
    /// The build to run, whatever `TOLLGATE_BUILD` says (a test of one build's own interface).
    pub build: Option<Build>,
    /// Envoy's `--drain-time-s`: how long a replaced listener (and its filters) lives on.
    pub drain_time_s: Option<u32>,
}

impl Options {
    /// The build this Envoy runs.
    pub fn build(&self) -> Build {
        self.build.unwrap_or_else(build)
    }
}

impl Default for Options {
    fn default() -> Self {
        Self {
            concurrency: 2,
            filters_after: Vec::new(),
            filters_before: Vec::new(),
            port: 0,
            lds: false,
            debug_log: false,
            quota_port: None,
            quota_standby: None,
            quota_replicas: Vec::new(),
            module: None,
            second_plugin: None,
            app_port: None,
            routes: Vec::new(),
            body_readable: false,
            build: None,
            drain_time_s: None,
        }
    }
}

/// Envoy's fault filter, delaying (`x-envoy-fault-delay-request: <ms>`) or aborting
/// (`x-envoy-fault-abort-request: <status>`) the requests that ask for it.
pub fn fault_filter() -> Value {
    json!({
        "name": "envoy.filters.http.fault",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault",
            "delay": {"header_delay": {}, "percentage": {"numerator": 100, "denominator": "HUNDRED"}},
            "abort": {"header_abort": {}, "percentage": {"numerator": 100, "denominator": "HUNDRED"}},
            "max_active_faults": 100000
        }
    })
}

/// The main listener: tollgate, then `opts.filters_after`, then the router, which answers 200
/// itself except on `/dead` (a cluster whose only endpoint refuses connections).
pub fn listener(plugin: &Value, opts: &Options) -> Value {
    named_listener("main", plugin, opts)
}

/// How the build under test names its host (in logs and the status path).
pub fn host_name() -> &'static str {
    match build() {
        Build::Wasm => "Envoy",
        Build::Native => "Envoy (dynamic module)",
    }
}

/// The plugin configuration's text: a JSON string is passed through as the text itself.
fn plugin_text(plugin: &Value) -> String {
    match plugin {
        Value::String(text) => text.clone(),
        other => other.to_string(),
    }
}

/// tollgate's HTTP filter, of the build under test ([`build`]): the Wasm filter, or the
/// dynamic module (found in the search path [`spawn`] gives Envoy).
pub fn tollgate_filter(plugin: &Value, opts: &Options) -> Value {
    match opts.build() {
        Build::Wasm => json!({
            "name": "envoy.filters.http.wasm",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
                "config": {
                    "name": "tollgate",
                    "root_id": "tollgate",
                    "fail_open": false,
                    "allow_on_headers_stop_iteration": opts.body_readable,
                    "vm_config": {
                        "vm_id": "tollgate",
                        "runtime": "envoy.wasm.runtime.v8",
                        "code": {"local": {"filename": opts.module.clone().unwrap_or_else(wasm_path)}}
                    },
                    "configuration": {
                        "@type": "type.googleapis.com/google.protobuf.StringValue",
                        "value": plugin_text(plugin)
                    }
                }
            }
        }),
        Build::Native => json!({
            "name": "envoy.filters.http.dynamic_modules",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
                "dynamic_module_config": {"name": "tollgate"},
                "filter_name": "tollgate",
                "filter_config": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": plugin_text(plugin)
                }
            }
        }),
    }
}

fn named_listener(name: &str, plugin: &Value, opts: &Options) -> Value {
    let mut filters = opts.filters_before.clone();
    filters.push(tollgate_filter(plugin, opts));
    filters.extend(opts.filters_after.iter().cloned());
    filters.push(json!({
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}
    }));
    let port = if name == "main" { opts.port } else { 0 };
    let mut routes = vec![json!({"match": {"prefix": "/dead"}, "route": {"cluster": "dead"}})];
    if opts.app_port.is_some() {
        routes.push(
            json!({"match": {"prefix": "/app"}, "route": {"cluster": "app", "timeout": "30s"}}),
        );
    }
    if name == "main" {
        routes.extend(opts.routes.iter().cloned());
    }
    routes.push(json!({"match": {"prefix": "/"},
                       "direct_response": {"status": 200, "body": {"inline_string": "ok\n"}}}));
    json!({
        "name": name,
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "main",
                // source.address is then the TCP peer, and the filter reads x-forwarded-for
                // as the client sent it (see README, "Client addresses").
                "use_remote_address": true,
                "skip_xff_append": true,
                "route_config": {"virtual_hosts": [{
                    "name": "all", "domains": ["*"],
                    "routes": routes
                }]},
                "http_filters": filters
            }
        }]}]
    })
}

/// The Envoy bootstrap around [`listener`]; with `opts.lds` the listener is written to
/// `dir/lds/listeners.json` and watched.
pub fn bootstrap(plugin: &Value, opts: &Options, dir: &Path) -> Value {
    let mut boot = json!({
        "node": {"id": "tollgate-test", "cluster": "tollgate-test"},
        "static_resources": {"clusters": [{
            "name": "dead",
            "type": "STATIC",
            "connect_timeout": "1s",
            "load_assignment": {"cluster_name": "dead", "endpoints": [{"lb_endpoints": [{
                "endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 1}}}
            }]}]}
        }]},
        "stats_config": {"stats_tags": [{
            "tag_name": "tollgate_rule",
            "regex": "^wasmcustom\\.tollgate\\.rule\\.((.+?)\\.)\\w+$"
        }]},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}}
    });
    if opts.build() == Build::Native {
        // The dynamic module's stats under the same Prometheus names as the Wasm build's
        // (docs/envoy-native.md): Envoy strips their namespace, as it does `wasmcustom`.
        boot["layered_runtime"] = native_runtime();
    }
    if let Some(port) = opts.app_port {
        boot["static_resources"]["clusters"]
            .as_array_mut()
            .unwrap()
            .push(json!({
                "name": "app",
                "type": "STATIC",
                "connect_timeout": "1s",
                // As many connections as requests: the app's own queue is what is measured.
                "circuit_breakers": {"thresholds": [{
                    "max_connections": 100000, "max_pending_requests": 100000,
                    "max_requests": 100000
                }]},
                "load_assignment": {"cluster_name": "app", "endpoints": [{"lb_endpoints": [{
                    "endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}
                }]}]}
            }));
    }
    if let Some(port) = opts.quota_port {
        let endpoint = |port: u16, priority: u32| {
            json!({"priority": priority, "lb_endpoints": [{"endpoint": {"address":
                {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]})
        };
        let mut cluster = json!({
            "name": "quota",
            "type": "STATIC",
            "connect_timeout": "0.25s",
            "load_assignment": {"cluster_name": "quota", "endpoints": [endpoint(port, 0)]}
        });
        for &replica in &opts.quota_replicas {
            cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
                .as_array_mut()
                .unwrap()
                .push(json!({"endpoint": {"address":
                    {"socket_address": {"address": "127.0.0.1", "port_value": replica}}}}));
        }
        if let Some(standby) = opts.quota_standby {
            cluster["load_assignment"]["endpoints"]
                .as_array_mut()
                .unwrap()
                .push(endpoint(standby, 1));
        }
        if opts.quota_standby.is_some() || !opts.quota_replicas.is_empty() {
            cluster["health_checks"] = json!([{
                "timeout": "0.1s", "interval": "0.1s", "no_traffic_interval": "0.1s",
                "unhealthy_threshold": 1, "healthy_threshold": 1,
                "http_health_check": {"path": "/healthz"}
            }]);
        }
        boot["static_resources"]["clusters"]
            .as_array_mut()
            .unwrap()
            .push(cluster);
    }
    if opts.lds {
        fs::create_dir_all(dir.join("lds")).unwrap();
        write_lds(dir, plugin, opts);
        boot["dynamic_resources"] = json!({"lds_config": {
            "resource_api_version": "V3",
            "path_config_source": {
                "path": dir.join("lds/listeners.json"),
                "watched_directory": {"path": dir.join("lds")}
            }
        }});
    } else {
        let mut listeners = vec![listener(plugin, opts)];
        if let Some(second) = &opts.second_plugin {
            listeners.push(named_listener("second", second, opts));
        }
        boot["static_resources"]["listeners"] = json!(listeners);
    }
    boot
}

/// Replace the LDS file atomically (Envoy reloads on the move into the watched directory).
fn write_lds(dir: &Path, plugin: &Value, opts: &Options) {
    write_listener(dir, listener(plugin, opts));
}

fn write_listener(dir: &Path, mut resource: Value) {
    let tmp = dir.join("listeners.json.tmp");
    resource["@type"] = json!("type.googleapis.com/envoy.config.listener.v3.Listener");
    let body = json!({"resources": [resource]});
    fs::write(&tmp, serde_json::to_vec_pretty(&body).unwrap()).unwrap();
    fs::rename(&tmp, dir.join("lds/listeners.json")).unwrap();
}

pub struct Envoy {
    child: Option<Child>,
    dir: PathBuf,
    pub admin: String,
    pub port: u16,
    /// The second listener's port ([`Options::second_plugin`]), else 0.
    pub port2: u16,
}

/// How an Envoy that was meant to refuse its configuration ended.
pub struct Refused {
    pub status: std::process::ExitStatus,
    pub log: String,
}

/// The runtime layer the dynamic module's docs give: its stats' Prometheus names without the
/// `dynamicmodulescustom` namespace.
pub fn native_runtime() -> Value {
    json!({"layers": [{"name": "static", "static_layer": {
        "envoy.reloadable_features.dynamic_modules_strip_custom_stat_prefix": true
    }}]})
}

/// Where Envoy looks for `libtollgate.so`: the directory of the module under test.
pub fn module_search_path(opts: &Options) -> PathBuf {
    let module = opts.module.clone().unwrap_or_else(native_path);
    module.parent().map(Path::to_path_buf).unwrap_or_default()
}

fn spawn(dir: &Path, bootstrap: &Value, opts: &Options) -> Child {
    let config = dir.join("envoy.json");
    fs::write(&config, serde_json::to_vec_pretty(bootstrap).unwrap()).unwrap();
    let mut cmd = Command::new(envoy_bin());
    cmd.arg("-c")
        .arg(&config)
        .args(["--concurrency", &opts.concurrency.to_string()])
        .arg("--disable-hot-restart")
        .args(["-l", "info"])
        .args(["--file-flush-interval-msec", "100"])
        .args(match (opts.debug_log, opts.build()) {
            (false, _) => &[][..],
            (true, Build::Wasm) => &["--component-log-level", "wasm:debug"][..],
            (true, Build::Native) => &["--component-log-level", "dynamic_modules:debug"][..],
        })
        .args(
            opts.drain_time_s
                .map(|s| vec!["--drain-time-s".to_string(), s.to_string()])
                .unwrap_or_default(),
        )
        .arg("--admin-address-path")
        .arg(dir.join("admin"))
        .arg("--log-path")
        .arg(dir.join("envoy.log"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if opts.build() == Build::Native {
        cmd.env(
            "ENVOY_DYNAMIC_MODULES_SEARCH_PATH",
            module_search_path(opts),
        );
    }
    // If the test process dies without unwinding, the kernel still stops this Envoy.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    cmd.spawn().expect("start envoy")
}

impl Envoy {
    pub fn start(plugin: &Value) -> Self {
        Self::start_with(plugin, &Options::default())
    }

    pub fn start_with(plugin: &Value, opts: &Options) -> Self {
        let dir = scratch_dir("envoy-tests");
        let bootstrap = bootstrap(plugin, opts, &dir);
        Self::launch(dir, &bootstrap, opts)
    }

    /// Run Envoy with `bootstrap` in `dir` until it is ready.
    fn launch(dir: PathBuf, bootstrap: &Value, opts: &Options) -> Self {
        let child = spawn(&dir, bootstrap, opts);
        let mut envoy = Envoy {
            child: Some(child),
            dir,
            admin: String::new(),
            port: 0,
            port2: 0,
        };
        envoy.wait_ready();
        envoy
    }

    /// Start Envoy with a whole bootstrap of the caller's (e.g. one from the docs), given an
    /// admin address; its first listener is served as `main`.
    pub fn start_bootstrap(bootstrap: Value) -> Self {
        Self::start_bootstrap_with(bootstrap, &Options::default())
    }

    /// [`Envoy::start_bootstrap`] with `opts`' process settings (the build's search path, the
    /// workers).
    pub fn start_bootstrap_with(mut bootstrap: Value, opts: &Options) -> Self {
        bootstrap["admin"] =
            json!({"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}});
        bootstrap["static_resources"]["listeners"][0]["name"] = json!("main");
        Self::launch(scratch_dir("envoy-tests"), &bootstrap, opts)
    }

    /// Start Envoy with a configuration it must refuse; returns its exit status and log.
    pub fn expect_refusal(plugin: &Value) -> Refused {
        let dir = scratch_dir("envoy-tests");
        let opts = Options {
            concurrency: 1,
            ..Options::default()
        };
        let mut child = spawn(&dir, &bootstrap(plugin, &opts, &dir), &opts);
        let mut exited = None;
        let ended = eventually(START_TIMEOUT, || {
            if dir.join("admin").exists() && http_ok(&read_admin(&dir), "/ready") {
                let _ = child.kill();
                let _ = child.wait();
                panic!("Envoy accepted a configuration it should refuse: {plugin}");
            }
            exited = child.try_wait().unwrap();
            exited.is_some()
        });
        assert!(ended, "Envoy neither refused nor started");
        let log = fs::read_to_string(dir.join("envoy.log")).unwrap_or_default();
        let _ = fs::remove_dir_all(&dir);
        Refused {
            status: exited.unwrap(),
            log,
        }
    }

    fn wait_ready(&mut self) {
        let ready = eventually(START_TIMEOUT, || {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("Envoy exited ({status}) while starting:\n{}", self.log());
            }
            if self.dir.join("admin").exists() {
                self.admin = read_admin(&self.dir);
                return http_ok(&self.admin, "/ready");
            }
            false
        });
        assert!(ready, "Envoy not ready in time:\n{}", self.log());
        let listeners: Value =
            serde_json::from_str(&self.admin_get("/listeners?format=json")).unwrap();
        let port_of = |name: &str| {
            listeners["listener_statuses"]
                .as_array()
                .unwrap()
                .iter()
                .find(|l| l["name"] == name)
                .and_then(|l| l["local_address"]["socket_address"]["port_value"].as_u64())
                .map_or(0, |p| p as u16)
        };
        self.port = port_of("main");
        self.port2 = port_of("second");
        assert_ne!(self.port, 0, "listener port");
    }

    /// Serve a new plugin configuration (the Envoy must have been started with `opts.lds`, and
    /// `opts` must be the same but for the plugin). Returns once LDS has applied it.
    pub fn reconfigure(&self, plugin: &Value, opts: &Options) {
        self.serve_listener(listener(plugin, opts));
    }

    /// Serve `resource` as the main listener (the Envoy must have been started with `opts.lds`).
    pub fn serve_listener(&self, resource: Value) {
        let before = self.stat("listener_manager.lds.update_success");
        write_listener(&self.dir, resource);
        let applied = eventually(START_TIMEOUT, || {
            self.stat("listener_manager.lds.update_success") > before
        });
        assert!(applied, "LDS update not applied:\n{}", self.log());
    }

    /// Serve a plugin configuration that must be refused (as [`Envoy::reconfigure`]); returns
    /// the tollgate error line the refusal logged. Envoy goes on with the configuration it had.
    pub fn refuse_reconfiguration(&self, plugin: &Value, opts: &Options) -> String {
        let before = self.stat("listener_manager.lds.update_rejected");
        let seen = self.log().len();
        write_lds(&self.dir, plugin, opts);
        let mut line = None;
        let refused = eventually(START_TIMEOUT, || {
            if self.stat("listener_manager.lds.update_rejected") <= before {
                return false;
            }
            let log = self.log();
            line = log.get(seen..).and_then(|new| {
                new.lines()
                    .find(|l| l.contains("invalid configuration: "))
                    .map(str::to_string)
            });
            line.is_some()
        });
        assert!(
            refused,
            "not refused, or no tollgate line, for {plugin}:\n{}",
            self.log()
        );
        line.unwrap_or_default()
    }

    /// Wait until a stat the filter updates on its tick reads `value` on two reads more than two
    /// ticks apart (so a change made just before the first read has been reported by the second).
    pub fn wait_for_stat(&self, name: &str, value: i64) {
        let mut since: Option<Instant> = None;
        let steady = eventually(Duration::from_secs(10), || {
            if self.stat(name) != value {
                since = None;
                return false;
            }
            let first = *since.get_or_insert_with(Instant::now);
            first.elapsed() > Duration::from_millis(30)
        });
        assert!(steady, "{name} stayed at {}, not {value}", self.stat(name));
    }

    /// Wait until Envoy's health checks of cluster `quota` passed for the endpoint on `port`
    /// (until then, calls may go to a standby: [`Options::quota_standby`]).
    pub fn wait_for_quota_healthy(&self, port: u16) {
        let flags = format!("quota::127.0.0.1:{port}::health_flags::healthy");
        let healthy = || self.admin_get("/clusters").lines().any(|l| l == flags);
        assert!(
            eventually(Duration::from_secs(10), healthy),
            "the quota service on {port} never passed Envoy's health check"
        );
    }

    /// Wait until a stat is more than `value`.
    pub fn wait_for_stat_above(&self, name: &str, value: i64) {
        let above = || self.stat(name) > value;
        assert!(
            eventually(Duration::from_secs(10), above),
            "{name} stayed at most {value}"
        );
    }

    /// A plain Envoy stat, 0 if absent. tollgate's are named as the Wasm build names them
    /// (`wasmcustom.tollgate.…`); for the dynamic module they are read under its names.
    pub fn stat(&self, name: &str) -> i64 {
        let name = &native_stat_name(name);
        let text = self.admin_get("/stats");
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Envoy's resident memory (VmRSS) in KiB.
    pub fn rss_kib(&self) -> u64 {
        let pid = self.child.as_ref().unwrap().id();
        let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.join("envoy.log")).unwrap_or_default()
    }

    /// True once Envoy's log contains `needle` (it is flushed periodically), false after 10 s.
    pub fn log_shows(&self, needle: &str) -> bool {
        eventually(Duration::from_secs(10), || self.log().contains(needle))
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.port, path)
    }

    /// A URL on the second listener.
    pub fn url2(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.port2, path)
    }

    pub fn admin_get(&self, path: &str) -> String {
        ureq::get(&format!("http://{}{}", self.admin, path))
            .call()
            .unwrap()
            .into_string()
            .unwrap()
    }

    /// A tollgate counter of a rule as Envoy exposes it at /stats/prometheus.
    pub fn counter(&self, rule: &str, name: &str) -> u64 {
        self.prometheus(&format!("tollgate_rule_{name}{{tollgate_rule=\"{rule}\"}}")) as u64
    }

    /// A metric line's value at /stats/prometheus (`name{labels}` exactly as shown), once settled:
    /// the filter hands its counts to Envoy on its 10 ms tick, so the value must read the same
    /// twice, more than two ticks apart.
    pub fn prometheus(&self, series: &str) -> i64 {
        let mut last = self.prometheus_now(series);
        loop {
            std::thread::sleep(Duration::from_millis(25));
            let now = self.prometheus_now(series);
            if now == last {
                return now;
            }
            last = now;
        }
    }

    /// One read of a series, for a value that keeps moving (`prometheus` reads until it stops:
    /// on a gauge that moves under load that is a loop of whole dumps, every 25 ms, on Envoy's
    /// main thread and the test's).
    pub fn prometheus_now(&self, series: &str) -> i64 {
        let text = self.admin_get("/stats/prometheus");
        let line = format!("{series} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&line))
            .unwrap_or_else(|| panic!("no {line} in /stats/prometheus:\n{text}"))
            .trim()
            .parse()
            .unwrap()
    }

    /// Wait (up to 10 s) for a metric to reach `want`; returns its last value.
    pub fn await_prometheus(&self, series: &str, want: i64) -> i64 {
        let mut v = 0;
        eventually(Duration::from_secs(10), || {
            v = self.prometheus_now(series);
            v == want
        });
        v
    }

    /// Connections each worker accepted (`listener.<addr>.worker_N.downstream_cx_total`).
    pub fn connections_per_worker(&self) -> Vec<u64> {
        let text = self.admin_get("/stats?filter=worker_.*downstream_cx_total");
        text.lines()
            .filter(|l| l.starts_with("listener.") && !l.contains("admin"))
            .filter_map(|l| l.rsplit(": ").next()?.trim().parse().ok())
            .collect()
    }
}

impl Envoy {
    /// `kill -9`: the process dies with whatever it holds.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            eprintln!(
                "--- Envoy log ({}) ---\n{}",
                self.dir.display(),
                tail(&self.log(), 60)
            );
        } else {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// The dynamic module's name for a stat the Wasm build calls `name`: its namespace, and a rule's
/// name as the label it is (`wasmcustom.tollgate.rule.R.S` is
/// `dynamicmodulescustom.tollgate.rule.S.tollgate_rule.R`).
pub fn native_stat_name(name: &str) -> String {
    let Some(rest) = name.strip_prefix("wasmcustom.") else {
        return name.to_string();
    };
    if build() == Build::Wasm {
        return name.to_string();
    }
    match rest
        .strip_prefix("tollgate.rule.")
        .and_then(|r| r.rsplit_once('.'))
    {
        Some((rule, stat)) => {
            format!("dynamicmodulescustom.tollgate.rule.{stat}.tollgate_rule.{rule}")
        }
        None => format!("dynamicmodulescustom.{rest}"),
    }
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn read_admin(dir: &Path) -> String {
    fs::read_to_string(dir.join("admin"))
        .unwrap_or_default()
        .trim()
        .to_string()
}

fn http_ok(admin: &str, path: &str) -> bool {
    !admin.is_empty()
        && ureq::get(&format!("http://{admin}{path}"))
            .timeout(Duration::from_secs(2))
            .call()
            .is_ok()
}
