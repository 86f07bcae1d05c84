//! A real nginx with Kong's ngx_wasm_module (named by `NGINX_BIN`) running the built module, with
//! 2 workers, started per test on free ports and always stopped; and a backend it proxies to.

use serde_json::Value;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
pub use testkit::*;

/// The nginx binary to test, if one was given.
pub fn nginx_bin() -> Option<PathBuf> {
    std::env::var_os("NGINX_BIN")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// Tests call this first: without `NGINX_BIN` they say so and end.
#[macro_export]
macro_rules! nginx_or_skip {
    () => {
        if $crate::harness::nginx_bin().is_none() {
            eprintln!("skipped: NGINX_BIN is not set (an nginx built with ngx_wasm_module, see docs/nginx.md)");
            return;
        }
    };
}

/// A plugin configuration as an nginx string argument: single-quoted, with `\` and `'` escaped
/// (nginx unescapes `\\`, `\'`, `\n`, `\t` … in quoted arguments).
pub fn nginx_string(plugin: &Value) -> String {
    let text = match plugin {
        Value::String(text) => text.clone(),
        other => other.to_string(),
    };
    format!("'{}'", text.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// The slow backend: every request is answered "ok"; `/slow` requests after 600 ms (or
/// `x-delay-ms`). It counts the most requests in flight at once.
pub struct Backend {
    pub port: u16,
    pub peak: Arc<AtomicUsize>,
}

impl Backend {
    pub fn start() -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let in_flight = Arc::new(AtomicUsize::new(0));
        let peak = Arc::new(AtomicUsize::new(0));
        let (now, most) = (in_flight.clone(), peak.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let (now, most) = (now.clone(), most.clone());
                std::thread::spawn(move || {
                    let mut head = Vec::new();
                    let mut byte = [0u8; 1];
                    while !head.ends_with(b"\r\n\r\n") {
                        match stream.read(&mut byte) {
                            Ok(1) => head.push(byte[0]),
                            _ => return,
                        }
                    }
                    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
                    let delay = head
                        .lines()
                        .find_map(|l| l.strip_prefix("x-delay-ms:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(if head.contains(" /slow") { 600 } else { 0 });
                    let n = now.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(n, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(delay));
                    now.fetch_sub(1, Ordering::SeqCst);
                    let _ = stream.write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 3\r\nconnection: close\r\n\r\nok\n",
                    );
                });
            }
        });
        Self { port, peak }
    }
}

/// Where `proxy_wasm tollgate` runs, with which configuration.
pub struct Location {
    pub path: &'static str,
    pub plugin: Value,
    /// `proxy_wasm_request_headers_in_access on;` (docs/nginx.md: needed for global rules).
    pub in_access: bool,
}

pub struct Nginx {
    child: Option<Child>,
    dir: PathBuf,
    pub port: u16,
    pub backend: Backend,
}

impl Nginx {
    /// nginx with 2 workers and `plugin` on every path.
    pub fn start(plugin: &Value) -> Self {
        Self::start_with(vec![Location {
            path: "/",
            plugin: plugin.clone(),
            in_access: true,
        }])
    }

    pub fn start_with(locations: Vec<Location>) -> Self {
        let nginx = Self::spawn(&locations);
        let expected = 2 * locations.len();
        let ready = eventually(START_TIMEOUT, || {
            let log = nginx.log();
            assert!(
                !log.contains("cannot be respawned"),
                "nginx refused the configuration:\n{log}"
            );
            log.matches("configuration loaded on").count() >= expected && nginx.accepts()
        });
        assert!(ready, "nginx not ready in time:\n{}", nginx.log());
        nginx
    }

    /// True if nginx accepts connections on its port.
    fn accepts(&self) -> bool {
        std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok()
    }

    /// Start nginx with a configuration its workers must refuse; returns the error log once
    /// they have.
    pub fn expect_refusal(plugin: &Value) -> String {
        let nginx = Self::spawn(&[Location {
            path: "/",
            plugin: plugin.clone(),
            in_access: true,
        }]);
        let refused = eventually(START_TIMEOUT, || {
            let log = nginx.log();
            assert!(
                !log.contains("configuration loaded on"),
                "nginx accepted a configuration it should refuse: {plugin}"
            );
            log.matches("cannot be respawned").count() >= 2
        });
        assert!(
            refused,
            "nginx neither refused nor started:\n{}",
            nginx.log()
        );
        nginx.log()
    }

    fn spawn(locations: &[Location]) -> Self {
        let backend = Backend::start();
        let mut http_locations = String::new();
        for l in locations {
            http_locations += &format!(
                "    location {} {{\n      proxy_wasm_request_headers_in_access {};\n      proxy_wasm tollgate {};\n      add_header x-worker $pid always;\n      proxy_pass http://127.0.0.1:{};\n    }}\n",
                l.path,
                if l.in_access { "on" } else { "off" },
                nginx_string(&l.plugin),
                backend.port
            );
        }
        let conf = format!(
            "worker_processes 2;\nevents {{ worker_connections 1024; }}\n\
             wasm {{\n  module tollgate {};\n  shm_kv * 16m eviction=none;\n}}\n\
             http {{\n  server {{\n    listen 127.0.0.1:PORT;\n{http_locations}  }}\n}}\n",
            wasm_path().display()
        );
        Self::spawn_conf(&conf, backend)
    }

    /// nginx with a whole configuration of its own (`PORT` is replaced by the port it listens
    /// on); this harness adds where its files go and runs it in the foreground.
    pub fn start_conf(conf: &str, backend: Backend, workers_loaded: usize) -> Self {
        let nginx = Self::spawn_conf(conf, backend);
        let started = eventually(START_TIMEOUT, || {
            let log = nginx.log();
            assert!(
                !log.contains("cannot be respawned"),
                "nginx did not start:\n{log}"
            );
            log.matches("configuration loaded on").count() >= workers_loaded && nginx.accepts()
        });
        assert!(started, "nginx did not start:\n{}", nginx.log());
        nginx
    }

    fn spawn_conf(conf: &str, backend: Backend) -> Self {
        let dir = scratch_dir("nginx-tests");
        let port = free_port();
        let d = dir.display();
        let conf = format!(
            "daemon off;\nmaster_process on;\nerror_log {d}/logs/error.log info;\npid {d}/logs/nginx.pid;\n{}",
            conf.replace("PORT", &port.to_string()).replacen(
                "http {",
                &format!(
                    "http {{\n  access_log off;\n  client_body_temp_path {d}/body; proxy_temp_path {d}/proxy;\n  fastcgi_temp_path {d}/fcgi; uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;"
                ),
                1
            )
        );
        fs::write(dir.join("nginx.conf"), conf).unwrap();
        let mut cmd = Command::new(nginx_bin().expect("NGINX_BIN"));
        cmd.arg("-p")
            .arg(&dir)
            .arg("-c")
            .arg(dir.join("nginx.conf"))
            .arg("-e")
            .arg(dir.join("logs/error.log"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // Its own process group: the master and its workers are stopped together.
            .process_group(0);
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd.spawn().expect("start nginx");
        Self {
            child: Some(child),
            dir,
            port,
            backend,
        }
    }

    /// `nginx -s reload`: returns once the new workers have loaded the configuration.
    pub fn reload(&self) {
        let before = self.log().matches("configuration loaded on").count();
        let pid = self.child.as_ref().unwrap().id() as i32;
        // SAFETY: signals the master process this harness started.
        unsafe {
            libc::kill(pid, libc::SIGHUP);
        }
        let reloaded = eventually(START_TIMEOUT, || {
            self.log().matches("configuration loaded on").count() >= before + 2
        });
        assert!(reloaded, "no reload:\n{}", self.log());
        // The old workers finish what they serve and exit; new connections go to the new ones.
        assert!(
            eventually(START_TIMEOUT, || self.accepts()),
            "nginx accepts no connection after the reload"
        );
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.join("logs/error.log")).unwrap_or_default()
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.port, path)
    }

    /// True if no worker has crashed or trapped so far.
    pub fn workers_healthy(&self) -> bool {
        let log = self.log();
        !log.contains("exited on signal") && !log.contains("trap") && !log.contains("panicked")
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: signals the process group this harness created.
            unsafe {
                libc::kill(-(child.id() as i32), libc::SIGKILL);
            }
            let _ = child.wait();
        }
        if std::thread::panicking() {
            let log = self.log();
            let lines: Vec<&str> = log.lines().collect();
            eprintln!(
                "--- nginx error.log ({}) ---\n{}",
                self.dir.display(),
                lines[lines.len().saturating_sub(60)..].join("\n")
            );
        } else {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}
