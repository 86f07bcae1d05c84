//! What a rule sees of a request: matching and the client key, over a host-independent view.

use crate::config::{KeyPart, Match, MissingKey, PathMatch};
use smallvec::SmallVec;
use std::borrow::Cow;
use std::cell::OnceCell;
use std::net::{IpAddr, SocketAddr};

/// Access to the request, implemented by the proxy-wasm adapter (and by tests).
pub trait RequestView {
    /// A request header by lower-case name, pseudo-headers (`:path`, `:method`, `:authority`) too.
    fn header(&self, name: &str) -> Option<String>;
    /// The downstream peer address as the host gives it (`ip:port`).
    fn source_address(&self) -> Option<String>;
}

/// A request with its derived values computed once, on first use.
pub struct Request<'a, V: RequestView> {
    view: &'a V,
    trusted_hops: u32,
    path: OnceCell<Option<String>>,
    method: OnceCell<Option<String>>,
    host: OnceCell<Option<String>>,
    client_ip: OnceCell<Option<String>>,
}

impl<'a, V: RequestView> Request<'a, V> {
    pub fn new(view: &'a V, trusted_hops: u32) -> Self {
        Self {
            view,
            trusted_hops,
            path: OnceCell::new(),
            method: OnceCell::new(),
            host: OnceCell::new(),
            client_ip: OnceCell::new(),
        }
    }

    /// `:path` with its query string.
    fn full_path(&self) -> Option<&str> {
        self.path
            .get_or_init(|| self.view.header(":path"))
            .as_deref()
    }

    /// `:path` without query string or fragment.
    pub fn path(&self) -> Option<&str> {
        self.full_path()
            .map(|p| p.split_once(['?', '#']).map_or(p, |(path, _)| path))
    }

    pub fn method(&self) -> Option<&str> {
        self.method
            .get_or_init(|| self.view.header(":method"))
            .as_deref()
    }

    /// `:authority` (or `host`), lower-case, without port.
    pub fn host(&self) -> Option<&str> {
        self.host
            .get_or_init(|| {
                let authority = self
                    .view
                    .header(":authority")
                    .or_else(|| self.view.header("host"))?;
                Some(strip_port(&authority).to_ascii_lowercase())
            })
            .as_deref()
    }

    /// The first value of query parameter `name`, percent-decoded.
    pub fn query(&self, name: &str) -> Option<String> {
        let query = self.full_path()?.split_once('?')?.1;
        let query = query.split_once('#').map_or(query, |(q, _)| q);
        form_urlencoded::parse(query.as_bytes())
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.into_owned())
    }

    /// The client address: the downstream peer, or with `trusted_hops = N > 0` the address N hops
    /// from the right of `x-forwarded-for`. When that header has fewer than N valid entries the
    /// downstream peer is used: a client cannot escape its limit by leaving the header out.
    pub fn client_ip(&self) -> Option<&str> {
        self.client_ip
            .get_or_init(|| {
                if self.trusted_hops > 0 {
                    let from_xff = self.view.header("x-forwarded-for").and_then(|xff| {
                        let hop = xff.rsplit(',').nth(self.trusted_hops as usize - 1)?;
                        hop.trim().parse::<IpAddr>().ok().map(|ip| ip.to_string())
                    });
                    if from_xff.is_some() {
                        return from_xff;
                    }
                }
                let mut peer = self.view.source_address()?;
                // The common case, IPv4 `a.b.c.d:port` as the host writes it: cut, don't reformat.
                if let Some((ip, port)) = peer.split_once(':') {
                    let dotted =
                        !ip.is_empty() && ip.bytes().all(|b| b.is_ascii_digit() || b == b'.');
                    if dotted && port.parse::<u16>().is_ok() {
                        peer.truncate(ip.len());
                        return Some(peer);
                    }
                }
                Some(match peer.parse::<SocketAddr>() {
                    Ok(addr) => addr.ip().to_string(),
                    Err(_) => peer,
                })
            })
            .as_deref()
    }

    /// True if every condition of `m` holds.
    pub fn matches(&self, m: &Match) -> bool {
        let path_ok = match &m.path {
            None => true,
            Some(PathMatch::Exact(p)) => self.path() == Some(p.as_str()),
            Some(PathMatch::Prefix(p)) => self.path().is_some_and(|x| x.starts_with(p.as_str())),
        };
        path_ok
            && (m.methods.is_empty()
                || self
                    .method()
                    .is_some_and(|x| m.methods.iter().any(|w| w == x)))
            && (m.hosts.is_empty() || self.host().is_some_and(|x| m.hosts.iter().any(|w| w == x)))
            && m.headers
                .iter()
                .all(|(name, value)| self.view.header(name).as_deref() == Some(value.as_str()))
    }

    /// The rule's bucket key: each part's value tagged and length-prefixed, so that no two
    /// different combinations of values (or of present and absent parts) give the same bytes.
    /// `None` when a part is absent and the rule skips.
    pub fn key(&self, parts: &[KeyPart], missing: MissingKey) -> Option<KeyBytes> {
        let mut key = KeyBytes::new();
        for part in parts {
            let value: Option<Cow<'_, str>> = match part {
                KeyPart::ClientIp => self.client_ip().map(Into::into),
                KeyPart::Path => self.path().map(Into::into),
                KeyPart::Method => self.method().map(Into::into),
                KeyPart::Host => self.host().map(Into::into),
                KeyPart::Header(name) => self.view.header(name).map(Into::into),
                KeyPart::Query(name) => self.query(name).map(Into::into),
            };
            if value.is_none() && missing == MissingKey::Skip {
                return None;
            }
            push_key_part(&mut key, value.as_deref());
        }
        Some(key)
    }
}

/// Key bytes from part values, as [`Request::key`] makes them (for override values).
pub fn encode_key<'v>(values: impl Iterator<Item = Option<&'v str>>) -> Vec<u8> {
    let mut key = KeyBytes::new();
    for value in values {
        push_key_part(&mut key, value);
    }
    key.into_vec()
}

fn push_key_part(key: &mut KeyBytes, value: Option<&str>) {
    match value {
        Some(v) => {
            key.push(1);
            key.extend_from_slice(&(v.len() as u32).to_le_bytes());
            key.extend_from_slice(v.as_bytes());
        }
        None => key.push(0),
    }
}

/// A rule's bucket key for one request: on the stack for keys of usual length.
pub type KeyBytes = SmallVec<[u8; 128]>;

fn strip_port(authority: &str) -> &str {
    if authority.starts_with('[') {
        return authority
            .find(']')
            .map_or(authority, |end| &authority[..=end]);
    }
    match authority.split_once(':') {
        Some((host, port)) if !port.contains(':') => host,
        _ => authority,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use std::collections::HashMap;

    #[derive(Default)]
    struct Fake {
        headers: HashMap<&'static str, &'static str>,
        peer: Option<&'static str>,
    }

    impl RequestView for Fake {
        fn header(&self, name: &str) -> Option<String> {
            self.headers.get(name).map(|v| v.to_string())
        }
        fn source_address(&self) -> Option<String> {
            self.peer.map(str::to_string)
        }
    }

    fn fake(headers: &[(&'static str, &'static str)], peer: &'static str) -> Fake {
        Fake {
            headers: headers.iter().copied().collect(),
            peer: Some(peer),
        }
    }

    #[test]
    fn path_host_query_and_method() {
        let f = fake(
            &[
                (":path", "/api/v1/items?page=2&q=a%20b&page=3#frag"),
                (":authority", "API.Example.com:8443"),
                (":method", "GET"),
            ],
            "10.0.0.1:5555",
        );
        let r = Request::new(&f, 0);
        assert_eq!(r.path(), Some("/api/v1/items"));
        assert_eq!(r.host(), Some("api.example.com"));
        assert_eq!(r.query("page").as_deref(), Some("2"));
        assert_eq!(r.query("q").as_deref(), Some("a b"));
        assert_eq!(r.query("none"), None);
        assert_eq!(r.method(), Some("GET"));
        assert_eq!(strip_port("[::1]:80"), "[::1]");
        assert_eq!(strip_port("[::1]"), "[::1]");
        assert_eq!(strip_port("h"), "h");
    }

    #[test]
    fn client_ip_with_and_without_trusted_hops() {
        let xff = [("x-forwarded-for", "1.1.1.1, 2.2.2.2,3.3.3.3")];
        let f = fake(&xff, "127.0.0.1:4000");
        assert_eq!(Request::new(&f, 0).client_ip(), Some("127.0.0.1"));
        assert_eq!(Request::new(&f, 1).client_ip(), Some("3.3.3.3"));
        assert_eq!(Request::new(&f, 2).client_ip(), Some("2.2.2.2"));
        assert_eq!(Request::new(&f, 3).client_ip(), Some("1.1.1.1"));
        // Fewer hops than trusted, or garbage: the peer address.
        assert_eq!(Request::new(&f, 4).client_ip(), Some("127.0.0.1"));
        let junk = fake(&[("x-forwarded-for", "not-an-ip")], "[::1]:9");
        assert_eq!(Request::new(&junk, 1).client_ip(), Some("::1"));
        let none = fake(&[], "127.0.0.1:1");
        assert_eq!(Request::new(&none, 1).client_ip(), Some("127.0.0.1"));
    }

    fn rule_of(json: &str) -> crate::config::Rule {
        let c = Config::parse(
            format!(r#"{{"rules":[{{"name":"r","limit":{{"requests":1,"per":"1s"}},{json}}}]}}"#)
                .as_bytes(),
        )
        .unwrap();
        c.rules.into_iter().next().unwrap()
    }

    #[test]
    fn matching() {
        let m = rule_of(
            r#""match":{"path_prefix":"/api/","methods":["GET","POST"],"hosts":["a.example"],"headers":{"x-tier":"free"}}"#,
        )
        .matcher;
        let base = [
            (":path", "/api/x?y=1"),
            (":method", "GET"),
            (":authority", "a.example:80"),
            ("x-tier", "free"),
        ];
        assert!(Request::new(&fake(&base, "1.1.1.1:1"), 0).matches(&m));
        for (i, bad) in [
            (":path", "/apx"),
            (":method", "PUT"),
            (":authority", "b.example"),
            ("x-tier", "paid"),
        ]
        .into_iter()
        .enumerate()
        {
            let mut h = base;
            h[i] = bad;
            assert!(
                !Request::new(&fake(&h, "1.1.1.1:1"), 0).matches(&m),
                "{bad:?}"
            );
        }
        let exact = rule_of(r#""match":{"path":"/login"}"#).matcher;
        assert!(Request::new(&fake(&[(":path", "/login?next=/")], "x"), 0).matches(&exact));
        assert!(!Request::new(&fake(&[(":path", "/login/x")], "x"), 0).matches(&exact));
        assert!(Request::new(&fake(&[], "x"), 0).matches(&Match::default()));
    }

    #[test]
    fn keys_are_unambiguous_and_missing_parts_follow_the_rule() {
        let skip = rule_of(r#""key":["header:x-a","header:x-b"]"#);
        let limit = rule_of(r#""key":["header:x-a","header:x-b"],"missing_key":"limit""#);
        let k = |h: &[(&'static str, &'static str)], r: &crate::config::Rule| {
            Request::new(&fake(h, "1.1.1.1:1"), 0).key(&r.key, r.missing_key)
        };
        assert_ne!(
            k(&[("x-a", "ab"), ("x-b", "c")], &skip),
            k(&[("x-a", "a"), ("x-b", "bc")], &skip)
        );
        assert_eq!(k(&[("x-a", "a")], &skip), None);
        assert!(k(&[("x-a", "a")], &limit).is_some());
        assert_ne!(
            k(&[("x-a", "a")], &limit),
            k(&[("x-a", "a"), ("x-b", "")], &limit)
        );
        let whole = rule_of(r#""match":{"path":"/"}"#);
        assert_eq!(k(&[], &whole), Some(KeyBytes::new()));
    }
}
