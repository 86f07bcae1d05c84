//! redis-server (single, with any arguments, persistent) and a local Redis Cluster as child processes.

use crate::paths::scratch_dir;
use crate::process::{free_port, guarded, wait_for_port};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
/// A redis-server of its own on a free port, in a working directory of its own (a replica writes
/// its master's snapshot there, and a Redis started where one lies would load it); killed on drop.
pub struct Redis {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
    /// A configuration file given first (`redis-server FILE --sentinel` runs a sentinel).
    config: Option<String>,
    args: Vec<String>,
    /// Keeps its data in an append-only file, written at every write.
    persistent: bool,
}

impl Redis {
    pub fn start() -> Self {
        Self::launch(None, &[], false)
    }

    /// With `extra` arguments after the port and binding (`--replicaof …`, `--requirepass …`).
    pub fn start_with(extra: &[&str]) -> Self {
        Self::launch(None, extra, false)
    }

    /// One that keeps its data in an append-only file (written at every write), as the compose
    /// demo's does.
    pub fn start_persistent() -> Self {
        Self::launch(None, &[], true)
    }

    /// A sentinel with the configuration file `config`.
    pub fn sentinel(config: &str) -> Self {
        Self::launch(Some(config), &["--sentinel"], false)
    }

    fn launch(config: Option<&str>, extra: &[&str], persistent: bool) -> Self {
        let mut redis = Self {
            child: None,
            port: free_port(),
            dir: scratch_dir("redis"),
            config: config.map(str::to_owned),
            args: extra.iter().map(|a| (*a).to_owned()).collect(),
            persistent,
        };
        redis.restart();
        redis
    }

    /// Start (again) on the same port, directory and arguments: empty, or (persistent) with what
    /// it wrote.
    pub fn restart(&mut self) {
        let port = self.port;
        let mut cmd = Command::new(std::env::var("REDIS_SERVER").unwrap_or("redis-server".into()));
        cmd.args(&self.config).arg("--dir").arg(&self.dir).args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
        ]);
        if self.persistent {
            cmd.args(["--appendonly", "yes", "--appendfsync", "always"]);
        } else {
            cmd.args(["--appendonly", "no"]);
        }
        cmd.args(&self.args);
        let mut child = guarded(cmd.stdin(Stdio::null()).stdout(Stdio::null()));
        wait_for_port(port, "redis-server", &mut child);
        self.child = Some(child);
    }

    /// Stop it as an operator would (SIGTERM: it writes its data out) and start it again.
    pub fn restart_persistent(&mut self) {
        self.terminate();
        self.restart();
    }

    /// Stop it as an operator would (SIGTERM) and start it again with `extra` arguments instead.
    pub fn restart_with(&mut self, extra: &[&str]) {
        self.terminate();
        self.args = extra.iter().map(|a| (*a).to_owned()).collect();
        self.restart();
    }

    fn terminate(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: signals the child process this harness started.
            unsafe {
                libc::kill(child.id() as i32, libc::SIGTERM);
            }
            let _ = child.wait();
        }
    }

    /// Its process id (0 once killed).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
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
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The masters of a [`RedisCluster`] (each with a replica).
const MASTERS: usize = 3;

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
        let ports: Vec<u16> = (0..2 * MASTERS).map(|_| cluster_port()).collect();
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
                        .arg("--logfile")
                        .arg(dir.join(format!("redis-{port}.log")))
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

    /// Until every live node says the cluster is ok (all slots served), every live replica is in
    /// sync with its master, and the live masters are the cluster's three: after a failover (the
    /// test's, or one a loaded machine's slow pings made), the master replaced says "master" and
    /// still holds its keys until it learns of its successor and becomes its replica.
    pub fn wait_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.settled() {
            assert!(Instant::now() < deadline, "the cluster did not become ok");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn settled(&self) -> bool {
        let mut masters = 0;
        for (i, &port) in self.ports.iter().enumerate() {
            if self.children[i].is_none() {
                continue;
            }
            let info = redis_cli(port, &["cluster", "info"]);
            let replication = redis_cli(port, &["info", "replication"]);
            let master = replication.contains("role:master");
            if !info.contains("cluster_state:ok")
                || !(master || replication.contains("master_link_status:up"))
            {
                return false;
            }
            masters += usize::from(master);
        }
        masters == MASTERS
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
        self.keys_on_masters(pattern)
            .into_iter()
            .map(|(i, keys)| (i, keys.len()))
            .collect()
    }

    /// The keys matching `pattern` on each live master.
    pub fn keys_on_masters(&self, pattern: &str) -> Vec<(usize, Vec<String>)> {
        (0..self.ports.len())
            .filter(|&i| self.children[i].is_some())
            .filter(|&i| redis_cli(self.ports[i], &["role"]).starts_with("master"))
            .map(|i| {
                let keys = redis_cli(self.ports[i], &["--scan", "--pattern", pattern]);
                let keys = keys.lines().filter(|l| !l.is_empty()).map(String::from);
                (i, keys.collect())
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
        // A failed test keeps the nodes' logs (failovers, roles) for its cause to be found.
        if std::thread::panicking() {
            eprintln!("--- Redis Cluster logs kept in {} ---", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
