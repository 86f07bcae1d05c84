//! The binary as run: signals, slow and idle clients, connection caps, where it listens, whom it trusts.

use super::*;

fn call_on(port: u16, conn: &mut Option<std::net::TcpStream>) -> std::io::Result<u16> {
    use std::io::{BufRead, BufReader, Read, Write};
    if conn.is_none() {
        let s = std::net::TcpStream::connect(("127.0.0.1", port))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        s.set_nodelay(true)?;
        *conn = Some(s);
    }
    let Some(s) = conn.as_mut() else {
        unreachable!()
    };
    let body = lease_body("proxy", vec![item("k", 1_000_000, 1)]);
    write!(
        s,
        "POST /v1/lease HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut reader = BufReader::new(s.try_clone()?);
    let mut status = String::new();
    if reader.read_line(&mut status)? == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    let mut length = 0;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line)?;
        if line == "\r\n" || line.is_empty() {
            break;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            length = v.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body)?;
    Ok(status
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0))
}

/// A lease call on a kept-alive connection (opened if `conn` has none): its status and time. As
/// a proxy does, a kept-alive connection the service closed meanwhile (its idle timeout) is
/// replaced once by a new one.
fn keep_alive_call(port: u16, conn: &mut Option<std::net::TcpStream>) -> (u16, Duration) {
    let started = Instant::now();
    let reused = conn.is_some();
    match call_on(port, conn) {
        Ok(code) => (code, started.elapsed()),
        Err(_) if reused => {
            *conn = None;
            let code = call_on(port, conn).unwrap_or_else(|e| panic!("on a new connection: {e}"));
            (code, started.elapsed())
        }
        Err(e) => panic!("on a new connection: {e}"),
    }
}

/// GET `path` on a connection of its own: the body.
fn ureq_get(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default()
}

/// The service binary on a port of its own, with `args`; killed on drop.
struct Binary {
    child: Child,
    port: u16,
}

impl Binary {
    fn start(args: &[&str]) -> Self {
        let port = free_port();
        let child = Command::new(env!("CARGO_BIN_EXE_tollgate-quota"))
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(args)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let listening = || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
        assert!(
            eventually(Duration::from_secs(10), listening),
            "did not start"
        );
        Self { child, port }
    }

    /// A lease call on a connection of its own: the status line.
    fn lease(&self) -> String {
        use std::io::{Read, Write};
        let body = lease_body("a", vec![item("k", 5, 1)]);
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(
            s,
            "POST /v1/lease HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out.lines().next().unwrap_or_default().to_string()
    }
}

impl Binary {
    /// A number from the service's `/metrics`.
    fn metric(&self, name: &str) -> u64 {
        let text = ureq_get(self.port, "/metrics");
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in\n{text}"))
    }
}

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn the_binary_serves_and_stops_gracefully_on_sigterm() {
    let mut svc = Binary::start(&[]);
    let health = {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", svc.port)).unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    };
    assert!(
        health.starts_with("HTTP/1.1 200") && health.ends_with("ok\n"),
        "{health}"
    );
    Command::new("kill")
        .args(["-TERM", &svc.child.id().to_string()])
        .status()
        .unwrap();
    let mut status = None;
    let exited = || {
        status = svc.child.try_wait().unwrap();
        status.is_some()
    };
    assert!(
        eventually(Duration::from_secs(5), exited),
        "still running after SIGTERM"
    );
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
}

#[test]
fn proxies_calls_are_served_while_slow_clients_hold_connections() {
    use std::io::Write;
    // The defaults (512 places, 5 s to send headers).
    let svc = Binary::start(&[]);
    let half_sent = |n: usize| -> Vec<std::net::TcpStream> {
        (0..n)
            .filter_map(|_| {
                let mut s = std::net::TcpStream::connect(("127.0.0.1", svc.port)).ok()?;
                s.write_all(b"POST /v1/lease HTTP/1.1\r\nhost: x\r\n")
                    .ok()?;
                Some(s)
            })
            .collect()
    };
    // A proxy's connection, proven by its first call before the attack.
    let mut proxy = None;
    assert_eq!(keep_alive_call(svc.port, &mut proxy).0, 200);
    let mut slow = half_sent(1_500);
    assert!(slow.len() >= 1_400, "{} slow connections", slow.len());
    // Good calls while they are held (and more keep coming): on the proxy's connection, and
    // on new ones.
    let mut latencies = Vec::new();
    for i in 0..200 {
        if i % 20 == 0 {
            slow.extend(half_sent(50));
        }
        let mut fresh = None;
        let conn = if i % 2 == 0 { &mut proxy } else { &mut fresh };
        let (status, took) = keep_alive_call(svc.port, conn);
        assert_eq!(status, 200, "call {i}");
        latencies.push(took);
    }
    latencies.sort();
    let p99 = latencies[latencies.len() * 99 / 100];
    let open = svc.metric("tollgate_quota_connections");
    eprintln!(
        "{} slow connections sent: good calls p50 {:?}, p99 {p99:?}, max {:?}; {open} open at \
         the service, {} closed to make room",
        slow.len(),
        latencies[latencies.len() / 2],
        latencies.last().unwrap(),
        svc.metric("tollgate_quota_connections_evicted_total")
    );
    assert!(open <= 513, "{open} connections open");
    // Before, calls waited for a place, up to the header timeout and beyond (seconds).
    assert!(p99 < Duration::from_millis(500), "p99 {p99:?}");
}

#[test]
fn slow_and_idle_clients_are_cut_off_and_connections_are_capped() {
    use std::io::{Read, Write};
    let svc = Binary::start(&[
        "--max-connections",
        "8",
        "--header-timeout-ms",
        "300",
        "--body-timeout-ms",
        "300",
    ]);
    // Eight connections that send half a request and stop take every place there is.
    let idle: Vec<std::net::TcpStream> = (0..8)
        .map(|_| {
            let mut s = std::net::TcpStream::connect(("127.0.0.1", svc.port)).unwrap();
            s.write_all(b"POST /v1/lease HTTP/1.1\r\nhost: x\r\n")
                .unwrap();
            s
        })
        .collect();
    // A good call on a new connection takes the place of the oldest of them at once: it does
    // not wait for the header timeout (300 ms).
    let started = Instant::now();
    assert_eq!(svc.lease(), "HTTP/1.1 200 OK");
    let waited = started.elapsed();
    assert!(waited < Duration::from_millis(250), "waited {waited:?}");
    assert!(svc.metric("tollgate_quota_connections_evicted_total") >= 1);
    // The half-sent ones were closed by the service (to make room, or by the header timeout).
    for mut s in idle {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = Vec::new();
        let read = s.read_to_end(&mut buf);
        // Closed (a connection closed to make room may be reset: its request was not read),
        // not left hanging until the read timeout.
        let closed = match &read {
            Ok(_) => true,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        };
        assert!(closed, "closed, not left hanging: {read:?}");
    }
    // A body that stops half-way: 408 once the body timeout passes.
    let mut s = std::net::TcpStream::connect(("127.0.0.1", svc.port)).unwrap();
    s.write_all(
        b"POST /v1/lease HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"instance\"",
    )
    .unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut out = vec![0u8; 512];
    let n = s.read(&mut out).unwrap();
    let answer = String::from_utf8_lossy(&out[..n]);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
}

#[test]
fn without_a_token_it_refuses_to_listen_beyond_loopback() {
    let port = free_port();
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate-quota"))
        .args(["--listen", &format!("0.0.0.0:{port}")])
        .env_remove("TOLLGATE_QUOTA_TOKEN")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("without --token"), "{err}");
    // With a token it serves there.
    let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate-quota"))
        .args(["--listen", &format!("0.0.0.0:{port}"), "--token", "t0ken"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let listening = || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
    assert!(
        eventually(Duration::from_secs(10), listening),
        "did not start"
    );
    child.kill().unwrap();
    child.wait().unwrap();
}

#[test]
fn a_tls_master_named_by_plain_sentinels_is_refused_at_startup() {
    // A sentinel's reply over plain TCP is not authenticated: whoever is on the network could name
    // any host with a certificate the system trusts as the master, and be sent its password.
    let sentinel = format!("redis://127.0.0.1:{}", free_port());
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate-quota"))
        .args(["--redis-sentinel", &sentinel, "--redis-master", "mymaster"])
        .args(["--redis-master-password", "m4ster", "--redis-master-tls"])
        .env_remove("TOLLGATE_QUOTA_REDIS_CA")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
    for named in ["--redis-master-tls", "rediss://", "--redis-ca"] {
        assert!(err.contains(named), "{named} in {err}");
    }
    assert!(!err.contains("m4ster"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
fn bad_rls_flags_stop_it_at_start_naming_the_problem() {
    let dir = std::env::temp_dir().join(format!("tollgate-rls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.yaml");
    std::fs::write(
        &bad,
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n",
    )
    .unwrap();
    let grpc = format!("127.0.0.1:{}", free_port());
    let listen = format!("127.0.0.1:{}", free_port());
    let bad_path = bad.display().to_string();
    let missing = dir.join("missing.yaml").display().to_string();
    let cases: [(&[&str], &str); 5] = [
        (
            &["--grpc-listen", &grpc, "--rls-config", &bad_path],
            "invalid rate limit unit 'fortnight'",
        ),
        (
            &["--grpc-listen", &grpc, "--rls-config", &missing],
            "cannot read",
        ),
        (&["--rls-config", &bad_path], "--grpc-listen"),
        (&["--grpc-listen", "0.0.0.0:0"], "without --token"),
        (
            &["--grpc-listen", &grpc, "--key-secret", "short"],
            "--key-secret must be at least 16 bytes",
        ),
    ];
    for (args, want) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_tollgate-quota"))
            .args(["--listen", &listen])
            .args(args)
            .env_remove("TOLLGATE_QUOTA_TOKEN")
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
        if want.contains("fortnight") {
            assert!(err.contains("bad.yaml"), "names the file: {err}");
        }
    }
}
