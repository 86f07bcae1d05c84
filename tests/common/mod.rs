//! Test helpers shared by the Envoy and nginx test binaries: built artifacts, an HTTP client,
//! raw requests, parallel load, and the quota service and Redis as child processes.

#![allow(dead_code)] // Each test binary uses its own share of these helpers.

use serde_json::{json, Value};
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
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
        Self::with_timeout(Duration::from_secs(10))
    }

    /// A client that gives up (and closes its connection) after `timeout`.
    pub fn with_timeout(timeout: Duration) -> Self {
        Self {
            agent: ureq::AgentBuilder::new()
                .timeout(timeout)
                .max_idle_connections_per_host(1)
                .build(),
        }
    }

    pub fn send(&self, method: &str, url: &str, headers: &[(&str, &str)]) -> Reply {
        self.try_send(method, url, headers)
            .unwrap_or_else(|e| panic!("{method} {url}: {e}"))
    }

    /// Like `send`, but a transport failure (e.g. the client's own timeout) is an `Err`.
    pub fn try_send(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
    ) -> Result<Reply, Box<ureq::Error>> {
        let mut req = self.agent.request(method, url);
        for (n, v) in headers {
            req = req.set(n, v);
        }
        let resp = match req.call() {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => return Err(Box::new(e)),
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
        Ok(Reply {
            status,
            headers,
            body,
        })
    }

    pub fn get(&self, url: &str, headers: &[(&str, &str)]) -> Reply {
        self.send("GET", url, headers)
    }
}

/// Send raw bytes as a request on a new connection (no HTTP library in between, so any byte
/// goes) and return the response's status once the whole response has arrived, or `None` if
/// the connection closed without one.
pub fn raw_status(port: u16, request: &[u8]) -> Option<u16> {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream.write_all(request).unwrap();
    let mut response = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&response).to_ascii_lowercase();
        if let Some(end) = text.find("\r\n\r\n") {
            let length = text[..end]
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            if response.len() >= end + 4 + length {
                break;
            }
        }
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => response.extend_from_slice(&chunk[..n]),
        }
    }
    let line = response.split(|&b| b == b'\r').next()?;
    std::str::from_utf8(line.get(9..12)?).ok()?.parse().ok()
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

/// Run `f(i)` for `i` in `0..n` on `n` threads released together; results in order of `i`.
pub fn parallel<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let barrier = std::sync::Barrier::new(n);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|i| {
                let (barrier, f) = (&barrier, &f);
                s.spawn(move || {
                    barrier.wait();
                    f(i)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Nanoseconds since the Unix epoch: the clock Envoy gives the filter.
pub fn unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

/// Sleep until the Unix time `at_ns` (to place requests around a window edge, not to wait for
/// anything to happen).
pub fn sleep_until_unix(at_ns: u64) {
    let now = unix_ns();
    if at_ns > now {
        std::thread::sleep(Duration::from_nanos(at_ns - now));
    }
}

/// A free TCP port on 127.0.0.1 (free when asked; taken by whoever binds it next).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn wait_for_port(port: u16, what: &str, child: &mut Child) {
    let deadline = Instant::now() + START_TIMEOUT;
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("{what} exited ({status}) while starting");
        }
        assert!(Instant::now() < deadline, "{what} did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub fn guarded(cmd: &mut Command) -> Child {
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    cmd.spawn().unwrap_or_else(|e| panic!("start {cmd:?}: {e}"))
}

/// The quota service binary (`make test` builds it), on a port of its own; killed on drop.
pub struct Quota {
    child: Option<Child>,
    pub port: u16,
    args: Vec<String>,
}

impl Quota {
    pub fn start(args: &[&str]) -> Self {
        Self::start_on(free_port(), args)
    }

    pub fn start_on(port: u16, args: &[&str]) -> Self {
        let mut q = Self {
            child: None,
            port,
            args: args.iter().map(|a| a.to_string()).collect(),
        };
        q.restart();
        q
    }

    /// Start (again) with the same port and arguments.
    pub fn restart(&mut self) {
        let bin = built_artifact("TOLLGATE_QUOTA_BIN", "target/debug/tollgate-quota");
        let mut child = guarded(
            Command::new(bin)
                .args(["--listen", &format!("127.0.0.1:{}", self.port)])
                .args(&self.args)
                .env("RUST_LOG", "warn")
                .stdin(Stdio::null())
                .stdout(Stdio::null()),
        );
        wait_for_port(self.port, "tollgate-quota", &mut child);
        self.child = Some(child);
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn metrics(&self) -> String {
        ureq::get(&format!("http://127.0.0.1:{}/metrics", self.port))
            .call()
            .unwrap()
            .into_string()
            .unwrap()
    }
}

impl Drop for Quota {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A redis-server of its own; killed on drop.
pub struct Redis {
    child: Option<Child>,
    pub port: u16,
}

impl Redis {
    pub fn start() -> Self {
        let port = free_port();
        let mut child = guarded(
            Command::new("redis-server")
                .args([
                    "--port",
                    &port.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                ])
                .args(["--appendonly", "no"])
                .stdin(Stdio::null())
                .stdout(Stdio::null()),
        );
        wait_for_port(port, "redis-server", &mut child);
        Self {
            child: Some(child),
            port,
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}
