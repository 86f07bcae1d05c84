//! The testbed upstream and load generator as child processes.

use crate::http::Client;
use crate::paths::built_artifact;
use crate::process::{free_port, guarded, wait_for_port};
use serde_json::Value;
use std::path::PathBuf;
use std::process::{Child, Command};
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
