//! A real Envoy with the built tollgate module, started per test on free ports and always stopped.

use serde_json::{json, Value};
use std::fs;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Generous: the V8 compile of the module and the slot tables take well under this.
const START_TIMEOUT: Duration = Duration::from_secs(60);

pub fn wasm_path() -> PathBuf {
    built_artifact("TOLLGATE_WASM", "dist/tollgate.wasm")
}

pub fn envoy_bin() -> PathBuf {
    built_artifact("ENVOY_BIN", ".venv/bin/envoy")
}

/// A path `make test` provides through `var`, else its default place in the repository.
fn built_artifact(var: &str, default: &str) -> PathBuf {
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

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn scratch_dir() -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let dir = repo().join("target/envoy-tests").join(format!(
        "{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

/// What a test can vary around the plugin configuration.
pub struct Options {
    pub concurrency: u32,
    /// The HTTP filters around tollgate, e.g. none by default.
    pub extra_filters_before: Vec<Value>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            concurrency: 2,
            extra_filters_before: Vec::new(),
        }
    }
}

/// The Envoy bootstrap: one listener on a free port with tollgate then a direct 200 response.
pub fn bootstrap(plugin: &Value, opts: &Options) -> Value {
    let mut filters = opts.extra_filters_before.clone();
    filters.push(json!({
        "name": "envoy.filters.http.wasm",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": "tollgate",
                "root_id": "tollgate",
                "fail_open": false,
                "vm_config": {
                    "vm_id": "tollgate",
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": {"local": {"filename": wasm_path()}}
                },
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": match plugin {
                        // A JSON string is passed through as the configuration text itself.
                        Value::String(text) => text.clone(),
                        other => other.to_string(),
                    }
                }
            }
        }
    }));
    filters.push(json!({
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}
    }));
    json!({
        "static_resources": {"listeners": [{
            "name": "main",
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
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
                        "routes": [{"match": {"prefix": "/"},
                                    "direct_response": {"status": 200, "body": {"inline_string": "ok\n"}}}]
                    }]},
                    "http_filters": filters
                }
            }]}]
        }]},
        "stats_config": {"stats_tags": [{
            "tag_name": "tollgate_rule",
            "regex": "^wasmcustom\\.tollgate\\.rule\\.((.+?)\\.)\\w+$"
        }]},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}}
    })
}

pub struct Envoy {
    child: Option<Child>,
    dir: PathBuf,
    pub admin: String,
    pub port: u16,
}

/// How an Envoy that was meant to refuse its configuration ended.
pub struct Refused {
    pub status: std::process::ExitStatus,
    pub log: String,
}

fn spawn(dir: &Path, bootstrap: &Value, concurrency: u32) -> Child {
    let config = dir.join("envoy.json");
    fs::write(&config, serde_json::to_vec_pretty(bootstrap).unwrap()).unwrap();
    let mut cmd = Command::new(envoy_bin());
    cmd.arg("-c")
        .arg(&config)
        .args(["--concurrency", &concurrency.to_string()])
        .arg("--disable-hot-restart")
        .args(["-l", "info"])
        .args(["--file-flush-interval-msec", "100"])
        .arg("--admin-address-path")
        .arg(dir.join("admin"))
        .arg("--log-path")
        .arg(dir.join("envoy.log"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
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
        let dir = scratch_dir();
        let child = spawn(&dir, &bootstrap(plugin, opts), opts.concurrency);
        let mut envoy = Envoy {
            child: Some(child),
            dir,
            admin: String::new(),
            port: 0,
        };
        envoy.wait_ready();
        envoy
    }

    /// Start Envoy with a configuration it must refuse; returns its exit status and log.
    pub fn expect_refusal(plugin: &Value) -> Refused {
        let dir = scratch_dir();
        let mut child = spawn(&dir, &bootstrap(plugin, &Options::default()), 1);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                let log = fs::read_to_string(dir.join("envoy.log")).unwrap_or_default();
                let _ = fs::remove_dir_all(&dir);
                return Refused { status, log };
            }
            if dir.join("admin").exists() && http_ok(&read_admin(&dir), "/ready") {
                let _ = child.kill();
                let _ = child.wait();
                panic!("Envoy accepted a configuration it should refuse: {plugin}");
            }
            assert!(
                Instant::now() < deadline,
                "Envoy neither refused nor started"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("Envoy exited ({status}) while starting:\n{}", self.log());
            }
            if self.dir.join("admin").exists() {
                self.admin = read_admin(&self.dir);
                if http_ok(&self.admin, "/ready") {
                    break;
                }
            }
            assert!(
                Instant::now() < deadline,
                "Envoy not ready in time:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let listeners: Value =
            serde_json::from_str(&self.admin_get("/listeners?format=json")).unwrap();
        self.port = listeners["listener_statuses"][0]["local_address"]["socket_address"]
            ["port_value"]
            .as_u64()
            .expect("listener port") as u16;
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.join("envoy.log")).unwrap_or_default()
    }

    /// True once Envoy's log contains `needle` (it is flushed periodically), false after 10 s.
    pub fn log_shows(&self, needle: &str) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.log().contains(needle) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.port, path)
    }

    pub fn admin_get(&self, path: &str) -> String {
        ureq::get(&format!("http://{}{}", self.admin, path))
            .call()
            .unwrap()
            .into_string()
            .unwrap()
    }

    /// A tollgate counter as Envoy exposes it at /stats/prometheus.
    pub fn counter(&self, rule: &str, name: &str) -> u64 {
        let text = self.admin_get("/stats/prometheus");
        let line = format!("tollgate_rule_{name}{{tollgate_rule=\"{rule}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&line))
            .unwrap_or_else(|| panic!("no {line} in /stats/prometheus"))
            .trim()
            .parse()
            .unwrap()
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

/// A response, whatever its status.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// One client connection (ureq keeps it alive between requests).
pub struct Client {
    agent: ureq::Agent,
}

impl Default for Client {
    fn default() -> Self {
        Self::new()
    }
}

impl Client {
    pub fn new() -> Self {
        Self {
            agent: ureq::AgentBuilder::new()
                .timeout(Duration::from_secs(10))
                .max_idle_connections_per_host(1)
                .build(),
        }
    }

    pub fn send(&self, method: &str, url: &str, headers: &[(&str, &str)]) -> Reply {
        let mut req = self.agent.request(method, url);
        for (n, v) in headers {
            req = req.set(n, v);
        }
        let resp = match req.call() {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("{method} {url}: {e}"),
        };
        let status = resp.status();
        let headers = resp
            .headers_names()
            .into_iter()
            .map(|n| {
                let v = resp.header(&n).unwrap_or_default().to_string();
                (n, v)
            })
            .collect();
        let mut body = String::new();
        resp.into_reader().read_to_string(&mut body).unwrap();
        Reply {
            status,
            headers,
            body,
        }
    }

    pub fn get(&self, url: &str, headers: &[(&str, &str)]) -> Reply {
        self.send("GET", url, headers)
    }
}

/// Send `n` GETs on one connection and count the statuses.
pub fn statuses(url: &str, headers: &[(&str, &str)], n: usize) -> (usize, usize) {
    let client = Client::new();
    let mut ok = 0;
    let mut limited = 0;
    for _ in 0..n {
        match client.get(url, headers).status {
            200 => ok += 1,
            429 => limited += 1,
            s => panic!("unexpected status {s}"),
        }
    }
    (ok, limited)
}

/// A plugin configuration with one rule.
pub fn one_rule(rule: Value) -> Value {
    json!({"rules": [rule]})
}
