//! An HTTP client, raw requests and parallel load.

use std::io::Read;
use std::time::Duration;
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
        self.try_send_body(method, url, headers, None)
    }

    /// A request with a body (sent with its `content-length`).
    pub fn try_send_body(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
    ) -> Result<Reply, Box<ureq::Error>> {
        let mut req = self.agent.request(method, url);
        for (n, v) in headers {
            req = req.set(n, v);
        }
        let sent = match body {
            Some(bytes) => req.send_bytes(bytes),
            None => req.call(),
        };
        let resp = match sent {
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

    pub fn post(&self, url: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
        self.try_send_body("POST", url, headers, Some(body))
            .unwrap_or_else(|e| panic!("POST {url}: {e}"))
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

/// Close `stream` with a reset (RST), as a client that vanished mid-answer does, rather than a
/// polite FIN.
pub fn reset(stream: std::net::TcpStream) {
    use std::os::fd::AsRawFd;
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid socket descriptor and a `linger` of the size given.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
    drop(stream);
}
