//! Test helpers shared by the Envoy and nginx test binaries: built artifacts, an HTTP client,
//! raw requests, parallel load, and the quota service and Redis as child processes.

#![allow(dead_code)] // Each test binary uses its own share of these helpers.

use serde_json::{json, Value};
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
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

/// A raw HTTP/1.1 request closing its connection, with extra header lines (any bytes).
pub fn raw(path: &[u8], lines: &[&[u8]]) -> Vec<u8> {
    let mut r = b"GET ".to_vec();
    r.extend_from_slice(path);
    r.extend_from_slice(b" HTTP/1.1\r\nHost: h\r\nConnection: close\r\n");
    for line in lines {
        r.extend_from_slice(line);
        r.extend_from_slice(b"\r\n");
    }
    r.extend_from_slice(b"\r\n");
    r
}

/// The configuration the hostile-bytes checks run with (both proxies).
pub fn hostile_plugin() -> Value {
    json!({
        "client_ip": {"trusted_hops": 1},
        "rules": [
            {"name": "user", "key": ["header:x-user"], "limit": {"requests": 2, "per": "1h"},
             "worker_batch": 0},
            {"name": "tier", "match": {"headers": {"x-tier": "free"}}, "key": ["client_ip"],
             "limit": {"requests": 1000, "per": "1h"}},
            {"name": "query", "match": {"path_prefix": "/q"}, "key": ["query:q", "host"],
             "limit": {"requests": 1000, "per": "1h"}},
            {"name": "cost", "match": {"path": "/cost"}, "limit": {"requests": 1, "per": "1h"},
             "burst": 8, "cost": {"header": "x-cost", "default": 3, "max": 5}, "worker_batch": 0}
        ]
    })
}

/// One request for each header the filter reads with bytes that are not UTF-8: a keyed header, a
/// matched header, the cost header, a query key, the host and the forwarded-for address a
/// trusted hop reads. (A proxy may refuse raw bytes in the request line with 400 itself.)
pub fn hostile_requests() -> Vec<Vec<u8>> {
    vec![
        raw(b"/", &[b"x-user: caf\xe9"]),
        raw(b"/", &[b"x-user: \xff\xfe\xfd"]),
        raw(b"/", &[b"x-tier: fr\xe9e", b"x-user: t"]),
        raw(b"/q?q=%ff%fe&x=%e9", &[b"x-user: q"]),
        raw(b"/q?\xe9=\xe9", &[b"x-user: r", b"host: h\xe9st"]),
        raw(b"/cost", &[b"x-cost: \xff3", b"x-user: c"]),
        raw(
            b"/cost",
            &[b"x-cost: 99999999999999999999999", b"x-user: d"],
        ),
        raw(
            b"/",
            &[b"x-forwarded-for: 1.2.3.4, \xff\xfe::1", b"x-user: f"],
        ),
        raw(b"/", &[b"x-forwarded-for: \xc3\x28", b"x-tier: free"]),
    ]
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
/// A per-IP rule behind one trusted hop (so tests can send any client address) with the default
/// prefixes, and CIDR overrides: allowed, blocked, and an own limit.
pub fn client_networks_plugin() -> Value {
    json!({
        "rules": [{"name": "per-ip", "key": ["client_ip"], "limit": {"requests": 2, "per": "1h"},
                   "overrides": [{"values": ["10.0.0.0/8"], "unlimited": true},
                                 {"values": ["192.0.2.0/24"], "block": true},
                                 {"values": ["2001:db8:aaaa::/48"], "limit": {"requests": 4, "per": "1h"}}]}],
        "client_ip": {"trusted_hops": 1}
    })
}

/// What [`client_networks_plugin`] does, asked of a proxy at `url`.
pub fn check_client_networks(url: &str) {
    let from = |ip: &'static str, n| statuses(url, &[("x-forwarded-for", ip)], n);
    // Addresses of one /64 share one bucket of 2; the next /64 has its own.
    assert_eq!(from("2001:db8:1:2::1", 1), (1, 0));
    assert_eq!(from("2001:db8:1:2::ffff", 1), (1, 0));
    assert_eq!(from("2001:db8:1:2:8000::1", 1), (0, 1));
    assert_eq!(from("2001:db8:1:3::1", 3), (2, 1));
    // IPv4 clients are their address.
    assert_eq!(from("203.0.113.1", 3), (2, 1));
    assert_eq!(from("203.0.113.2", 3), (2, 1));
    // Ranges: allowed, blocked, and 4 per client /64 inside 2001:db8:aaaa::/48.
    assert_eq!(from("10.20.30.40", 10), (10, 0));
    assert_eq!(from("192.0.2.77", 2), (0, 2));
    assert_eq!(from("2001:db8:aaaa:1::1", 6), (4, 2));
    assert_eq!(from("2001:db8:aaaa:2::1", 6), (4, 2));
}

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

/// A lock held across processes on this machine until dropped: tests run one process each
/// (cargo-nextest), and two test runs may share a machine. `name` says what it guards (fixed
/// ports, a latency measurement).
pub struct MachineLock {
    _file: std::fs::File,
}

impl MachineLock {
    pub fn take(name: &str) -> Self {
        use std::os::fd::AsRawFd;
        let path = std::env::temp_dir().join(format!("tollgate-tests-{name}.lock"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        // SAFETY: flock on a descriptor this process owns; released when the file is closed.
        let taken = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
        assert_eq!(taken, 0, "flock {}", path.display());
        Self { _file: file }
    }
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

    /// With the service's own defaults (`--cold-start auto` among them) unless `args` say
    /// otherwise.
    pub fn start_on(port: u16, args: &[&str]) -> Self {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let mut q = Self {
            child: None,
            port,
            args,
        };
        q.restart();
        q
    }

    /// Start again with the same port and other arguments.
    pub fn restart_with(&mut self, args: &[&str]) {
        self.kill();
        self.args = args.iter().map(|a| a.to_string()).collect();
        self.restart();
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

    /// Stop the service without closing its socket (SIGSTOP): calls hang until [`Self::resume`].
    /// Returns once every thread is stopped: `kill` returns before the signal takes effect, and a
    /// thread still running could answer one more call.
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
        let Some(child) = &self.child else { return };
        let tasks = format!("/proc/{}/task", child.id());
        let all_stopped = || {
            std::fs::read_dir(&tasks).is_ok_and(|entries| {
                entries.flatten().all(|task| {
                    std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| {
                        // The state follows the parenthesised command name.
                        stat.rsplit_once(") ")
                            .is_some_and(|(_, rest)| rest.starts_with('T') || rest.starts_with('t'))
                    })
                })
            })
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        while !all_stopped() {
            assert!(Instant::now() < deadline, "the quota service did not stop");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, signal: i32) {
        if let Some(child) = &self.child {
            // SAFETY: signals the child process this harness started.
            unsafe {
                libc::kill(child.id() as i32, signal);
            }
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
    /// Its own working directory, where a persistent one keeps its append-only file.
    dir: Option<PathBuf>,
}

impl Redis {
    pub fn start() -> Self {
        let mut redis = Self {
            child: None,
            port: free_port(),
            dir: None,
        };
        redis.restart();
        redis
    }

    /// One that keeps its data in an append-only file (written at every write), as the compose
    /// demo's does.
    pub fn start_persistent() -> Self {
        let mut redis = Self {
            child: None,
            port: free_port(),
            dir: Some(scratch_dir("redis")),
        };
        redis.restart();
        redis
    }

    /// Start (again) on the same port: empty, or (persistent) with what it wrote.
    pub fn restart(&mut self) {
        let port = self.port;
        let mut cmd = Command::new("redis-server");
        cmd.args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
        ]);
        match &self.dir {
            Some(dir) => {
                cmd.arg("--dir")
                    .arg(dir)
                    .args(["--appendonly", "yes", "--appendfsync", "always"])
            }
            None => cmd.args(["--appendonly", "no"]),
        };
        let mut child = guarded(cmd.stdin(Stdio::null()).stdout(Stdio::null()));
        wait_for_port(port, "redis-server", &mut child);
        self.child = Some(child);
    }

    /// Stop it as an operator would (SIGTERM: it writes its data out) and start it again.
    pub fn restart_persistent(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: signals the child process this harness started.
            unsafe {
                libc::kill(child.id() as i32, libc::SIGTERM);
            }
            let _ = child.wait();
        }
        self.restart();
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
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A Redis Cluster on loopback: 3 masters, 3 replicas (`redis-cli --cluster create`), node
/// timeout 1 s so failovers are quick; each node killed on drop.
pub struct RedisCluster {
    pub ports: Vec<u16>,
    children: Vec<Option<Child>>,
    dir: std::path::PathBuf,
}

/// A port whose cluster bus port (+10 000) is free too.
fn cluster_port() -> u16 {
    loop {
        let port = free_port();
        if port < 55_000 && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli (make test installs redis-tools)");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl RedisCluster {
    pub fn start() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "tollgate-cluster-{}-{}",
            std::process::id(),
            cluster_port()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let ports: Vec<u16> = (0..6).map(|_| cluster_port()).collect();
        let children = ports
            .iter()
            .map(|&port| {
                let mut child = guarded(
                    Command::new("redis-server")
                        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                        .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"])
                        // Replicas sync at once, and a replica fails over whatever its lag.
                        .args(["--repl-diskless-sync-delay", "0"])
                        .args(["--cluster-replica-validity-factor", "0"])
                        .args(["--cluster-config-file", &format!("nodes-{port}.conf")])
                        .args(["--save", "", "--appendonly", "no"])
                        .arg("--dir")
                        .arg(&dir)
                        .stdin(Stdio::null())
                        .stdout(Stdio::null()),
                );
                wait_for_port(port, "redis-server (cluster)", &mut child);
                Some(child)
            })
            .collect();
        let nodes: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let created = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&nodes)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli");
        assert!(
            created.status.success(),
            "cluster create: {}",
            String::from_utf8_lossy(&created.stdout)
        );
        let cluster = Self {
            ports,
            children,
            dir,
        };
        cluster.wait_ok();
        cluster
    }

    /// Until every live node says the cluster is ok (all slots served) and every live replica
    /// is in sync with its master.
    pub fn wait_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        for (i, &port) in self.ports.iter().enumerate() {
            if self.children[i].is_none() {
                continue;
            }
            loop {
                let info = redis_cli(port, &["cluster", "info"]);
                let replication = redis_cli(port, &["info", "replication"]);
                let synced = replication.contains("role:master")
                    || replication.contains("master_link_status:up");
                if info.contains("cluster_state:ok") && synced {
                    break;
                }
                assert!(Instant::now() < deadline, "the cluster did not become ok");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// The nodes for `--redis-cluster`.
    pub fn urls(&self) -> String {
        let urls: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect();
        urls.join(",")
    }

    /// Which live masters hold keys matching `pattern`, and how many each.
    pub fn masters_with(&self, pattern: &str) -> Vec<(usize, usize)> {
        (0..self.ports.len())
            .filter(|&i| self.children[i].is_some())
            .filter(|&i| redis_cli(self.ports[i], &["role"]).starts_with("master"))
            .map(|i| {
                let keys = redis_cli(self.ports[i], &["--scan", "--pattern", pattern]);
                (i, keys.lines().filter(|l| !l.is_empty()).count())
            })
            .collect()
    }

    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.children[i].take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for i in 0..self.children.len() {
            self.kill(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The testbed binary (`make test` builds it).
fn testbed_bin() -> PathBuf {
    built_artifact("TOLLGATE_TESTBED_BIN", "target/debug/tollgate-testbed")
}

/// An upstream with a capacity (`tollgate-testbed upstream`), killed on drop.
pub struct Upstream {
    child: Child,
    pub port: u16,
}

impl Upstream {
    /// `args` as `tollgate-testbed upstream` takes them (`--capacity`, `--service-ms`, …).
    pub fn start(args: &[&str]) -> Self {
        let port = free_port();
        let mut child = guarded(
            Command::new(testbed_bin())
                .arg("upstream")
                .args(["--port", &port.to_string()])
                .args(args),
        );
        wait_for_port(port, "tollgate-testbed upstream", &mut child);
        Self { child, port }
    }

    /// The most requests it held at once (served and queued) since the last call.
    pub fn max_at_once(&self) -> u64 {
        let body = Client::new()
            .get(&format!("http://127.0.0.1:{}/__stats", self.port), &[])
            .body;
        serde_json::from_str::<Value>(&body).unwrap()["max_at_once"]
            .as_u64()
            .unwrap()
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Open-loop load (`tollgate-testbed load`): what came back, per class and for "all".
pub fn load(url: &str, args: &[&str]) -> Value {
    let out = Command::new(testbed_bin())
        .arg("load")
        .args(["--url", url])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}
