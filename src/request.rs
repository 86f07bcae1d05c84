//! What a rule sees of a request: matching and the client key, over a host-independent view.
//!
//! Every value is the bytes the client sent: nothing here assumes UTF-8, and no input can panic.

use crate::config::{KeyPart, Match, MissingKey, PathMatch};
use crate::key::{push_key_part, push_unreadable_part, KeyBytes};
use crate::network::ClientIp;
use crate::number::{metadata_number, whole_number};
use crate::request_body::{BodyPart, RequestBody};
use std::borrow::Cow;
use std::cell::OnceCell;
use std::net::{IpAddr, SocketAddr};

/// A value of the request: the host's own bytes where it lends them for the callback (the Envoy
/// dynamic module), else a copy.
pub type Value<'a> = Cow<'a, [u8]>;

/// Access to the request, implemented by the host layer (and by tests). A view lives for one
/// callback: what it lends is valid until the callback returns.
pub trait RequestView {
    /// A request header by lower-case name, pseudo-headers (`:path`, `:method`) too.
    fn header(&self, name: &str) -> Option<Value<'_>>;
    /// The downstream peer address as the host gives it (`ip:port`).
    fn source_address(&self) -> Option<Value<'_>>;
    /// The host the request is for, as sent (`:authority` or `host`, port included).
    fn authority(&self) -> Option<Value<'_>> {
        self.header(":authority").or_else(|| self.header("host"))
    }
    /// A property by path (segments separated by NUL bytes), where the host has it.
    fn property(&self, _path: &[u8]) -> Option<Value<'_>> {
        None
    }
}

/// A request with its derived values computed once, on first use.
pub struct Request<'a, V: RequestView> {
    view: &'a V,
    client: ClientIp,
    path: OnceCell<Option<Value<'a>>>,
    method: OnceCell<Option<Value<'a>>>,
    host: OnceCell<Option<Value<'a>>>,
    client_ip: OnceCell<Option<Value<'a>>>,
    /// Its JSON body, where a rule reads it and the host buffered it.
    body: Option<&'a RequestBody>,
}

impl<'a, V: RequestView> Request<'a, V> {
    pub fn new(view: &'a V, client: impl Into<ClientIp>) -> Self {
        Self {
            view,
            client: client.into(),
            path: OnceCell::new(),
            method: OnceCell::new(),
            host: OnceCell::new(),
            client_ip: OnceCell::new(),
            body: None,
        }
    }

    /// The request with its buffered body.
    pub fn with_body(mut self, body: Option<&'a RequestBody>) -> Self {
        self.body = body;
        self
    }

    pub fn body(&self) -> Option<&RequestBody> {
        self.body
    }

    pub fn view(&self) -> &V {
        self.view
    }

    /// `:path` with its query string.
    pub fn full_path(&self) -> Option<&[u8]> {
        self.path
            .get_or_init(|| self.view.header(":path"))
            .as_deref()
    }

    /// `:path` without query string or fragment.
    pub fn path(&self) -> Option<&[u8]> {
        self.full_path().map(|p| {
            let end = p.iter().position(|&b| b == b'?' || b == b'#');
            &p[..end.unwrap_or(p.len())]
        })
    }

    pub fn method(&self) -> Option<&[u8]> {
        self.method
            .get_or_init(|| self.view.header(":method"))
            .as_deref()
    }

    /// The request's host, lower-case, without port.
    pub fn host(&self) -> Option<&[u8]> {
        self.host
            .get_or_init(|| {
                let host = self.view.authority()?;
                let end = strip_port(&host).len();
                Some(match host {
                    Cow::Borrowed(b) if !b[..end].iter().any(u8::is_ascii_uppercase) => {
                        Cow::Borrowed(&b[..end])
                    }
                    other => {
                        let mut owned = other.into_owned();
                        owned.truncate(end);
                        owned.make_ascii_lowercase();
                        Cow::Owned(owned)
                    }
                })
            })
            .as_deref()
    }

    /// The first value of query parameter `name`, percent-decoded (`+` is a space), as bytes.
    pub fn query(&self, name: &str) -> Option<Vec<u8>> {
        query_value(self.full_path()?, name.as_bytes())
    }

    /// The client address: the downstream peer, or with `trusted_hops = N > 0` the N-th entry from
    /// the right of `x-forwarded-for`, as its network under the configured prefix lengths
    /// ([`ClientIp::key_of`]); IPv4-mapped IPv6 addresses are the IPv4 address. When that entry is
    /// missing or is not an IP address, the downstream peer is used: a client cannot escape its
    /// limit by leaving the header out or sending garbage.
    pub fn client_ip(&self) -> Option<&[u8]> {
        self.client_ip
            .get_or_init(|| {
                let hops = self.client.trusted_hops;
                if hops > 0 {
                    let xff = self.view.header("x-forwarded-for");
                    if let Some(ip) = xff.and_then(|x| forwarded_hop(&x, hops)) {
                        return Some(Cow::Owned(self.client.key_of(ip)));
                    }
                }
                Some(peer_ip(self.view.source_address()?, &self.client))
            })
            .as_deref()
    }

    /// True if every condition of `m` holds.
    pub fn matches(&self, m: &Match) -> bool {
        let path_ok = match &m.path {
            None => true,
            Some(PathMatch::Exact(p)) => self.path() == Some(p.as_bytes()),
            Some(PathMatch::Prefix(p)) => self.path().is_some_and(|x| x.starts_with(p.as_bytes())),
        };
        path_ok
            && (m.methods.is_empty()
                || self
                    .method()
                    .is_some_and(|x| m.methods.iter().any(|w| w.as_bytes() == x)))
            && (m.hosts.is_empty()
                || self
                    .host()
                    .is_some_and(|x| m.hosts.iter().any(|w| w.as_bytes() == x)))
            && m.headers
                .iter()
                .all(|(name, value)| self.view.header(name).as_deref() == Some(value.as_bytes()))
    }

    /// The whole number a header or a metadata value holds (ASCII digits, surrounding spaces
    /// ignored); `None` if absent or anything else.
    pub fn number(&self, source: &KeyPart) -> Option<u64> {
        let (value, metadata) = match source {
            KeyPart::Header(name) => (self.view.header(name)?, false),
            KeyPart::Metadata(path) => (self.view.property(path)?, true),
            _ => return None,
        };
        if metadata {
            return metadata_number(&value);
        }
        whole_number(&value)
    }

    /// The rule's bucket key (see [`crate::key`]). `None` when a part is absent and the rule
    /// skips such requests (`missing`). A `body:` part of a body that cannot be read is one
    /// "unreadable" value unless `unreadable` skips it too (then it is absent).
    pub fn key(
        &self,
        parts: &[KeyPart],
        missing: MissingKey,
        unreadable: MissingKey,
    ) -> Option<KeyBytes> {
        let mut key = KeyBytes::new();
        for part in parts {
            let owned;
            let value: Option<&[u8]> = match part {
                KeyPart::ClientIp => self.client_ip(),
                KeyPart::Path => self.path(),
                KeyPart::Method => self.method(),
                KeyPart::Host => self.host(),
                KeyPart::Header(name) => {
                    owned = self.view.header(name);
                    owned.as_deref()
                }
                KeyPart::Query(name) => {
                    owned = self.query(name).map(Cow::Owned);
                    owned.as_deref()
                }
                KeyPart::Metadata(path) => {
                    owned = self.view.property(path);
                    owned.as_deref()
                }
                KeyPart::Body(path) => match self.body.map(|b| b.part(path)) {
                    Some(BodyPart::Value(v)) => {
                        owned = Some(Cow::Owned(v));
                        owned.as_deref()
                    }
                    Some(BodyPart::Unreadable) if unreadable == MissingKey::Limit => {
                        push_unreadable_part(&mut key);
                        continue;
                    }
                    _ => None,
                },
            };
            if value.is_none() && missing == MissingKey::Skip {
                return None;
            }
            push_key_part(&mut key, value);
        }
        Some(key)
    }
}

/// The `hops`-th entry from the right of an `x-forwarded-for` value, if it is an IP address.
pub fn forwarded_hop(xff: &[u8], hops: u32) -> Option<IpAddr> {
    let index = usize::try_from(hops).ok()?.checked_sub(1)?;
    let hop = xff.rsplit(|&b| b == b',').nth(index)?;
    std::str::from_utf8(hop.trim_ascii()).ok()?.parse().ok()
}

/// The key part of the peer address the host reports (`ip:port`, `[v6]:port`), as
/// [`ClientIp::key_of`] writes it; anything else is kept as it is (still a distinct key per value).
pub fn peer_ip<'a>(peer: Value<'a>, client: &ClientIp) -> Value<'a> {
    // The common case, IPv4 `a.b.c.d:port` as hosts write it, keyed by the whole address: cut,
    // don't reformat.
    if let (Some(colon), true) = (ipv4_with_port(&peer), client.ipv4_prefix >= 32) {
        return match peer {
            Cow::Borrowed(b) => Cow::Borrowed(&b[..colon]),
            Cow::Owned(mut v) => {
                v.truncate(colon);
                Cow::Owned(v)
            }
        };
    }
    let parsed = std::str::from_utf8(&peer)
        .ok()
        .and_then(|s| s.parse::<SocketAddr>().ok());
    match parsed {
        Some(addr) => Cow::Owned(client.key_of(addr.ip())),
        None => peer,
    }
}

/// Where the port starts in `a.b.c.d:port` (digits and dots, a colon, 1 to 5 digits), in one pass.
fn ipv4_with_port(peer: &[u8]) -> Option<usize> {
    let mut colon = None;
    for (i, &b) in peer.iter().enumerate() {
        match (b, colon) {
            (b'0'..=b'9', _) | (b'.', None) => {}
            (b':', None) if i > 0 => colon = Some(i),
            _ => return None,
        }
    }
    let colon = colon?;
    (1..=5).contains(&(peer.len() - colon - 1)).then_some(colon)
}

pub use crate::network::strip_port;

/// The first value of query parameter `name` in `path` (`/p?a=1&b=2#f`), decoded.
pub fn query_value(path: &[u8], name: &[u8]) -> Option<Vec<u8>> {
    query_params(path, name).next()
}

/// Every value of query parameter `name` in `path`, decoded, in order.
pub fn query_values(path: &[u8], name: &[u8]) -> Vec<Vec<u8>> {
    query_params(path, name).collect()
}

/// The values of query parameter `name` in `path`, decoded as they are asked for.
fn query_params<'p>(path: &'p [u8], name: &'p [u8]) -> impl Iterator<Item = Vec<u8>> + 'p {
    let start = path
        .iter()
        .position(|&b| b == b'?')
        .map_or(path.len(), |q| q + 1);
    let query = &path[start..];
    let query = &query[..query.iter().position(|&b| b == b'#').unwrap_or(query.len())];
    query
        .split(|&b| b == b'&')
        .filter(|pair| !pair.is_empty())
        .filter_map(move |pair| {
            let (k, v) = match pair.iter().position(|&b| b == b'=') {
                Some(eq) => (&pair[..eq], &pair[eq + 1..]),
                None => (pair, &pair[pair.len()..]),
            };
            (form_decode(k) == name).then(|| form_decode(v))
        })
}

/// `application/x-www-form-urlencoded` decoding to bytes: `+` is a space, `%XX` a byte; a `%`
/// not followed by two hex digits stays as it is.
fn form_decode(input: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(input.len());
    let mut i = 0;
    while i < input.len() {
        let b = input[i];
        let hex = |j: usize| input.get(j).and_then(|&c| (c as char).to_digit(16));
        match (b, hex(i + 1), hex(i + 2)) {
            (b'%', Some(hi), Some(lo)) => {
                // Two hex digits: at most 0xff.
                out.push((hi * 16 + lo) as u8);
                i += 3;
                continue;
            }
            (b'+', ..) => out.push(b' '),
            _ => out.push(b),
        }
        i += 1;
    }
    out
}

/// A request's cost from a header value: a whole number (ASCII digits, surrounding whitespace
/// ignored) kept within `min..=max` — a number too large for 64 bits is above any `max` — else
/// `default`.
pub fn header_cost(value: Option<&[u8]>, default: u64, min: u64, max: u64) -> u64 {
    value
        .and_then(whole_number)
        .map_or(default, |n| n.clamp(min, max))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use proptest::prelude::*;

    use std::collections::HashMap;

    #[derive(Default)]
    struct Fake {
        headers: HashMap<&'static str, Vec<u8>>,
        peer: Option<Vec<u8>>,
    }

    impl RequestView for Fake {
        fn header(&self, name: &str) -> Option<Value<'_>> {
            self.headers.get(name).map(|v| Cow::Borrowed(&v[..]))
        }
        fn source_address(&self) -> Option<Value<'_>> {
            self.peer.as_deref().map(Cow::Borrowed)
        }
    }

    fn fake(headers: &[(&'static str, &str)], peer: &str) -> Fake {
        Fake {
            headers: headers
                .iter()
                .map(|(n, v)| (*n, v.as_bytes().to_vec()))
                .collect(),
            peer: Some(peer.as_bytes().to_vec()),
        }
    }

    #[test]
    fn path_host_query_and_method() {
        let f = fake(
            &[
                (":path", "/api/v1/items?page=2&q=a%20b+c&page=3#frag"),
                (":authority", "API.Example.com:8443"),
                (":method", "GET"),
            ],
            "10.0.0.1:5555",
        );
        let r = Request::new(&f, 0);
        assert_eq!(r.path(), Some(&b"/api/v1/items"[..]));
        assert_eq!(r.host(), Some(&b"api.example.com"[..]));
        assert_eq!(r.query("page").as_deref(), Some(&b"2"[..]));
        assert_eq!(r.query("q").as_deref(), Some(&b"a b c"[..]));
        assert_eq!(r.query("none"), None);
        assert_eq!(r.method(), Some(&b"GET"[..]));
        assert_eq!(strip_port(b"[::1]:80"), b"[::1]");
        assert_eq!(strip_port(b"[::1]"), b"[::1]");
        assert_eq!(strip_port(b"h"), b"h");
        assert_eq!(strip_port(b"::1"), b"::1");
        assert_eq!(
            query_value(b"/?a=%ff%fe&b", b"a").as_deref(),
            Some(&[0xff, 0xfe][..])
        );
        assert_eq!(
            query_value(b"/?a=%zz%4", b"a").as_deref(),
            Some(&b"%zz%4"[..])
        );
        assert_eq!(query_value(b"/?b&a", b"b").as_deref(), Some(&b""[..]));
    }

    #[test]
    fn the_host_header_serves_when_the_view_says_so() {
        struct NginxLike(Fake);
        impl RequestView for NginxLike {
            fn header(&self, name: &str) -> Option<Value<'_>> {
                self.0.header(name)
            }
            fn source_address(&self) -> Option<Value<'_>> {
                None
            }
            fn authority(&self) -> Option<Value<'_>> {
                self.header("host").or_else(|| self.header(":authority"))
            }
        }
        let f = NginxLike(fake(
            &[(":authority", "server_name"), ("host", "Real.Example:81")],
            "x",
        ));
        assert_eq!(Request::new(&f, 0).host(), Some(&b"real.example"[..]));
    }

    #[test]
    fn only_dotted_digits_with_a_port_are_cut_without_parsing() {
        let cut = |p: &[u8]| ipv4_with_port(p);
        assert_eq!(cut(b"127.0.0.1:4000"), Some(9));
        assert_eq!(cut(b"1:1"), Some(1));
        assert_eq!(cut(b"1.2.3.4:65535"), Some(7));
        for no in [
            &b""[..],
            b"1.2.3.4",
            b"1.2.3.4:",
            b":80",
            b"1.2.3.4:123456",
            b"1.2.3.4:8.0",
            b"1.2.3.4:80:1",
            b"[::1]:80",
            b"1.2.3.x:80",
            b"1.2.3.4:8\xff",
        ] {
            assert_eq!(cut(no), None, "{no:?}");
        }
        // What the cut refuses is parsed, or kept as it came.
        let client = ClientIp::default();
        assert_eq!(
            &*peer_ip(Cow::Borrowed(b"1.2.3.4:123456"), &client),
            b"1.2.3.4:123456"
        );
        assert_eq!(&*peer_ip(Cow::Borrowed(b"1.2.3.4:80"), &client), b"1.2.3.4");
    }

    #[test]
    fn client_ip_with_and_without_trusted_hops() {
        let xff = [("x-forwarded-for", "1.1.1.1, 2.2.2.2,3.3.3.3")];
        let f = fake(&xff, "127.0.0.1:4000");
        let ip = |f: &Fake, hops| Request::new(f, hops).client_ip().map(<[u8]>::to_vec);
        assert_eq!(ip(&f, 0).as_deref(), Some(&b"127.0.0.1"[..]));
        assert_eq!(ip(&f, 1).as_deref(), Some(&b"3.3.3.3"[..]));
        assert_eq!(ip(&f, 2).as_deref(), Some(&b"2.2.2.2"[..]));
        assert_eq!(ip(&f, 3).as_deref(), Some(&b"1.1.1.1"[..]));
        // Fewer hops than trusted, or garbage: the peer address.
        assert_eq!(ip(&f, 4).as_deref(), Some(&b"127.0.0.1"[..]));
        let junk = fake(&[("x-forwarded-for", "not-an-ip")], "[::1]:9");
        // IPv6 clients are their /64.
        assert_eq!(ip(&junk, 1).as_deref(), Some(&b"::/64"[..]));
        let none = fake(&[], "127.0.0.1:1");
        assert_eq!(ip(&none, 1).as_deref(), Some(&b"127.0.0.1"[..]));
        let mut bytes = fake(&[], "10.0.0.9:1");
        bytes
            .headers
            .insert("x-forwarded-for", b"1.2.3.4, \xff\xfe".to_vec());
        assert_eq!(ip(&bytes, 1).as_deref(), Some(&b"10.0.0.9"[..]));
        assert_eq!(ip(&bytes, 2).as_deref(), Some(&b"1.2.3.4"[..]));
        // IPv4-mapped IPv6 is the IPv4 address, from the peer or from a forwarded hop.
        assert_eq!(
            peer_ip(
                Cow::Borrowed(b"[::ffff:203.0.113.10]:80"),
                &ClientIp::default()
            )
            .as_ref(),
            b"203.0.113.10"
        );
        let mapped = fake(&[("x-forwarded-for", "::ffff:203.0.113.10")], "10.0.0.1:1");
        assert_eq!(ip(&mapped, 1).as_deref(), Some(&b"203.0.113.10"[..]));
        // A peer the host writes some other way is still one key per value.
        assert_eq!(
            peer_ip(Cow::Borrowed(b"unix:/tmp/s"), &ClientIp::default()).as_ref(),
            b"unix:/tmp/s"
        );
        assert_eq!(
            peer_ip(Cow::Borrowed(b"1.2.3.4:99999999"), &ClientIp::default()).as_ref(),
            b"1.2.3.4:99999999"
        );
    }

    #[test]
    fn costs_from_header_bytes() {
        assert_eq!(header_cost(None, 1, 1, 10), 1);
        assert_eq!(header_cost(Some(b" 7 "), 1, 1, 10), 7);
        assert_eq!(header_cost(Some(b"70"), 1, 1, 10), 10);
        assert_eq!(header_cost(Some(b"99999999999999999999999"), 1, 1, 10), 10);
        assert_eq!(header_cost(Some(b"18446744073709551615"), 1, 1, 10), 10);
        assert_eq!(header_cost(Some(b"-3"), 1, 1, 10), 1);
        assert_eq!(header_cost(Some(b"\xff3"), 2, 1, 10), 2);
        assert_eq!(header_cost(Some(b""), 2, 1, 10), 2);
        // Zero is not free unless the configuration says so.
        assert_eq!(header_cost(Some(b"0"), 3, 1, 10), 1);
        assert_eq!(header_cost(Some(b"0"), 3, 0, 10), 0);
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
        let mut binary = fake(&base, "1.1.1.1:1");
        binary.headers.insert("x-tier", b"fr\xe9e".to_vec());
        assert!(!Request::new(&binary, 0).matches(&m));
        let exact = rule_of(r#""match":{"path":"/login"}"#).matcher;
        assert!(Request::new(&fake(&[(":path", "/login?next=/")], "x"), 0).matches(&exact));
        assert!(!Request::new(&fake(&[(":path", "/login/x")], "x"), 0).matches(&exact));
        assert!(Request::new(&fake(&[], "x"), 0).matches(&Match::default()));
    }

    #[test]
    fn keys_are_unambiguous_and_missing_parts_follow_the_rule() {
        let skip = rule_of(r#""key":["header:x-a","header:x-b"]"#);
        let limit = rule_of(r#""key":["header:x-a","header:x-b"],"missing_key":"limit""#);
        let k = |h: &[(&'static str, &str)], r: &crate::config::Rule| {
            Request::new(&fake(h, "1.1.1.1:1"), 0).key(&r.key, r.missing_key, r.unreadable_body)
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

    fn any_bytes() -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec(any::<u8>(), 0..48)
    }

    proptest! {
        /// Whatever bytes a client sends in any header the filter reads, deriving a request's
        /// values neither panics nor loses the distinction between different values.
        #[test]
        fn arbitrary_header_bytes_are_handled(
            path in any_bytes(), authority in any_bytes(), xff in any_bytes(),
            user in any_bytes(), other in any_bytes(), peer in any_bytes(), hops in 0u32..4,
        ) {
            let f = Fake {
                headers: [(":path", path.clone()), (":authority", authority), ("x-forwarded-for", xff),
                          ("x-user", user.clone()), (":method", other.clone())].into_iter().collect(),
                peer: Some(peer),
            };
            let r = Request::new(&f, hops);
            let _ = (r.path(), r.host(), r.method(), r.client_ip(), r.query("q"));
            let parts = [KeyPart::Header("x-user".into()), KeyPart::ClientIp, KeyPart::Host,
                         KeyPart::Query("q".into()), KeyPart::Path, KeyPart::Method];
            let key = r.key(&parts, MissingKey::Limit, MissingKey::Limit);
            prop_assert!(key.is_some());
            let _ = r.matches(&rule_of(r#""match":{"path_prefix":"/a","hosts":["h"],"headers":{"x-user":"u"}}"#).matcher);
            // Another user value gives another key.
            let mut g = Fake { headers: f.headers.clone(), peer: f.peer.clone() };
            let mut changed = user.clone();
            changed.push(0);
            g.headers.insert("x-user", changed);
            prop_assert_ne!(Request::new(&g, hops).key(&parts, MissingKey::Limit, MissingKey::Limit), key);
            let _ = header_cost(Some(&other), 1, 1, 100);
        }

        #[test]
        fn header_costs_are_within_min_and_max(value in any_bytes(), max in 1u64..1000) {
            let cost = header_cost(Some(&value), 1, 1, max);
            prop_assert!((1..=max).contains(&cost));
        }

        #[test]
        fn query_decoding_never_panics(path in any_bytes(), name in any_bytes()) {
            let _ = query_value(&path, &name);
        }
    }
}
