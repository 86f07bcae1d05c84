//! The quota service as a child process.

use crate::paths::built_artifact;
use crate::process::{free_port, guarded, resume_process, stop_process, wait_for_port};
use std::process::{Child, Command, Stdio};
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
        let log = std::env::var("TOLLGATE_QUOTA_LOG").ok();
        let mut child = guarded(
            Command::new(bin)
                .args(["--listen", &format!("127.0.0.1:{}", self.port)])
                .args(&self.args)
                // TOLLGATE_QUOTA_LOG=tollgate_quota=debug logs each lease item and its answer.
                .env("RUST_LOG", log.as_deref().unwrap_or("warn"))
                .stdin(Stdio::null())
                .stdout(match &log {
                    // Appended to /tmp/tollgate-quota-<port>.log (one per service, across its
                    // restarts).
                    Some(_) => std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(format!("/tmp/tollgate-quota-{}.log", self.port))
                        .map_or_else(|_| Stdio::null(), Stdio::from),
                    None => Stdio::null(),
                }),
        );
        wait_for_port(self.port, "tollgate-quota", &mut child);
        self.child = Some(child);
    }

    /// Its process id (0 once killed).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
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
    /// Stop the service (SIGSTOP): it keeps its connections and answers nothing.
    pub fn pause(&self) {
        if let Some(child) = &self.child {
            stop_process(child.id());
        }
    }

    pub fn resume(&self) {
        if let Some(child) = &self.child {
            resume_process(child.id());
        }
    }

    pub fn metrics(&self) -> String {
        ureq::get(&format!("http://127.0.0.1:{}/metrics", self.port))
            .call()
            .unwrap()
            .into_string()
            .unwrap()
    }

    /// The value of the unlabelled series `name` (e.g. `tollgate_quota_tokens_granted_total`),
    /// 0 if absent.
    pub fn metric(&self, name: &str) -> i64 {
        let prefix = format!("{name} ");
        self.metrics()
            .lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for Quota {
    fn drop(&mut self) {
        self.kill();
    }
}
