//! Child processes that die with the test, free ports, readiness, signals, clocks and waiting for a condition.

use crate::paths::START_TIMEOUT;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::time::{Duration, Instant};
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

/// Wait until `condition` holds, looking every 10 ms, for at most `within`: true if it held. The
/// way to wait for something to happen (never a fixed sleep).
pub fn eventually(within: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Stop process `pid` (SIGSTOP) and return once every thread of it has stopped (`kill` returns
/// before the signal takes effect): it keeps its sockets and answers nothing.
pub fn stop_process(pid: u32) {
    signal(pid, libc::SIGSTOP);
    let tasks = format!("/proc/{pid}/task");
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
    assert!(
        eventually(Duration::from_secs(5), all_stopped),
        "process {pid} did not stop"
    );
}

/// Let a process [`stop_process`] stopped go on (SIGCONT).
pub fn resume_process(pid: u32) {
    signal(pid, libc::SIGCONT);
}

fn signal(pid: u32, signal: i32) {
    let Ok(pid) = i32::try_from(pid) else {
        return;
    };
    // SAFETY: signals a child process a test started.
    unsafe {
        libc::kill(pid, signal);
    }
}

/// The machine's CPU time by kind since boot (`/proc/stat`'s first line, in seconds): a timing
/// test prints what the machine did meanwhile, so a failure under load says whether other
/// processes (user, system), the hypervisor (steal) or the disk (iowait) took the time.
#[derive(Clone, Copy, Debug, Default)]
pub struct MachineTimes {
    pub user: f64,
    pub system: f64,
    pub idle: f64,
    pub iowait: f64,
    pub steal: f64,
}

impl MachineTimes {
    pub fn now() -> Self {
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let ticks: Vec<f64> = stat
            .lines()
            .next()
            .unwrap_or("")
            .split_whitespace()
            .skip(1)
            .map(|t| t.parse::<f64>().unwrap_or(0.0) / 100.0)
            .collect();
        let at = |i: usize| ticks.get(i).copied().unwrap_or(0.0);
        // user nice system idle iowait irq softirq steal
        MachineTimes {
            user: at(0) + at(1),
            system: at(2) + at(5) + at(6),
            idle: at(3),
            iowait: at(4),
            steal: at(7),
        }
    }

    /// What the machine spent since `self`, as one line.
    pub fn since(&self) -> String {
        let now = MachineTimes::now();
        format!(
            "machine meanwhile: user {:.1} s, system {:.1} s, idle {:.1} s, iowait {:.1} s, steal {:.1} s",
            now.user - self.user,
            now.system - self.system,
            now.idle - self.idle,
            now.iowait - self.iowait,
            now.steal - self.steal
        )
    }
}
