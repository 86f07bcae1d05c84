//! Client addresses as networks: the `client_ip` key part of an address under the configured
//! prefix lengths, and CIDR ranges for overrides.

use std::net::IpAddr;

/// How `client_ip` is found and keyed (the configuration's `client_ip` object).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientIp {
    /// With N > 0, the client is the N-th entry from the right of `x-forwarded-for`.
    pub trusted_hops: u32,
    /// IPv4 clients are keyed by their /`ipv4_prefix` network (32: the address).
    pub ipv4_prefix: u8,
    /// IPv6 clients are keyed by their /`ipv6_prefix` network (128: the address).
    pub ipv6_prefix: u8,
}

impl Default for ClientIp {
    fn default() -> Self {
        Self {
            trusted_hops: 0,
            ipv4_prefix: 32,
            ipv6_prefix: 64,
        }
    }
}

impl From<u32> for ClientIp {
    /// `trusted_hops`, with the default prefixes.
    fn from(trusted_hops: u32) -> Self {
        Self {
            trusted_hops,
            ..Self::default()
        }
    }
}

impl ClientIp {
    /// The prefix length clients of `ip`'s family are keyed by.
    pub fn prefix_of(&self, ip: &IpAddr) -> u8 {
        match ip {
            IpAddr::V4(_) => self.ipv4_prefix,
            IpAddr::V6(_) => self.ipv6_prefix,
        }
    }

    /// The key part of a client address: the address itself under a full-length prefix
    /// (`10.0.0.1`), else its network (`2001:db8:1:2::/64`). IPv4-mapped IPv6 addresses are
    /// IPv4 addresses.
    pub fn key_of(&self, ip: IpAddr) -> Vec<u8> {
        let ip = ip.to_canonical();
        Network::new(ip, self.prefix_of(&ip)).text().into_bytes()
    }
}

/// An IP network: an address with its host bits cleared, and a prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Network {
    addr: IpAddr,
    prefix: u8,
}

impl Network {
    /// The network of `/prefix` around `ip` (a prefix beyond the family's length is the address).
    pub fn new(ip: IpAddr, prefix: u8) -> Self {
        match ip {
            IpAddr::V4(a) => {
                let prefix = prefix.min(32);
                let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
                Self {
                    addr: IpAddr::V4((u32::from(a) & mask).into()),
                    prefix,
                }
            }
            IpAddr::V6(a) => {
                let prefix = prefix.min(128);
                let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
                Self {
                    addr: IpAddr::V6((u128::from(a) & mask).into()),
                    prefix,
                }
            }
        }
    }

    /// `addr/len` or an address (a whole-length network); IPv4-mapped IPv6 is IPv4. Host bits are
    /// cleared.
    pub fn parse(text: &str) -> Option<Self> {
        let (addr, prefix) = match text.split_once('/') {
            Some((addr, len)) => {
                let len: u8 = len.parse().ok()?;
                (addr.parse::<IpAddr>().ok()?, Some(len))
            }
            None => (text.parse::<IpAddr>().ok()?, None),
        };
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = prefix.unwrap_or(max);
        if prefix > max {
            return None;
        }
        let canonical = addr.to_canonical();
        let prefix = match (addr, canonical) {
            (IpAddr::V6(_), IpAddr::V4(_)) => prefix.checked_sub(96)?,
            _ => prefix,
        };
        Some(Self::new(canonical, prefix))
    }

    /// The network of `/prefix` around this one's address, if that is wider.
    pub fn widen(self, prefix: u8) -> Self {
        Self::new(self.addr, prefix.min(self.prefix))
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    pub fn is_ipv4(&self) -> bool {
        self.addr.is_ipv4()
    }

    /// As keys are written: the address alone for a whole-length network.
    pub fn text(&self) -> String {
        let whole = if self.addr.is_ipv4() { 32 } else { 128 };
        if self.prefix == whole {
            self.addr.to_string()
        } else {
            format!("{}/{}", self.addr, self.prefix)
        }
    }

    /// True if the client key part `value` (as [`ClientIp::key_of`] writes it) is inside this
    /// network. Anything that is not an address or a network is not.
    pub fn contains_key(&self, value: &[u8]) -> bool {
        let Some(other) = std::str::from_utf8(value).ok().and_then(Self::parse) else {
            return false;
        };
        other.prefix >= self.prefix
            && other.addr.is_ipv4() == self.addr.is_ipv4()
            && Self::new(other.addr, self.prefix).addr == self.addr
    }
}

/// An authority without its port: `host:80` → `host`, `[::1]:80` → `[::1]`.
pub fn strip_port(authority: &[u8]) -> &[u8] {
    if authority.first() == Some(&b'[') {
        return match authority.iter().position(|&b| b == b']') {
            Some(end) => &authority[..=end],
            None => authority,
        };
    }
    let colons = authority.iter().filter(|&&b| b == b':').count();
    match authority.iter().position(|&b| b == b':') {
        Some(at) if colons == 1 => &authority[..at],
        _ => authority,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn clients_are_keyed_by_their_network() {
        let c = ClientIp::default();
        let key = |s: &str| String::from_utf8(c.key_of(s.parse().unwrap())).unwrap();
        assert_eq!(key("10.1.2.3"), "10.1.2.3");
        assert_eq!(key("2001:db8:1:2:aaaa::1"), "2001:db8:1:2::/64");
        assert_eq!(key("2001:db8:1:2:ffff::9"), "2001:db8:1:2::/64");
        assert_eq!(key("::ffff:10.1.2.3"), "10.1.2.3");
        let wide = ClientIp {
            ipv4_prefix: 24,
            ipv6_prefix: 128,
            ..c
        };
        let key = |s: &str| String::from_utf8(wide.key_of(s.parse().unwrap())).unwrap();
        assert_eq!(key("10.1.2.3"), "10.1.2.0/24");
        assert_eq!(key("2001:db8::1"), "2001:db8::1");
    }

    #[test]
    fn networks_parse_and_contain_keys() {
        let n = Network::parse("10.0.0.0/8").unwrap();
        assert!(n.contains_key(b"10.200.3.4"));
        assert!(n.contains_key(b"10.2.3.0/24"));
        assert!(!n.contains_key(b"11.0.0.1"));
        assert!(!n.contains_key(b"10.0.0.0/7"), "wider than the range");
        assert!(!n.contains_key(b"not an address"));
        assert!(!n.contains_key(b"\xff\xfe"));
        let v6 = Network::parse("2001:db8::/32").unwrap();
        assert!(v6.contains_key(b"2001:db8:1:2::/64"));
        assert!(!v6.contains_key(b"2001:db9::/64"));
        assert!(!v6.contains_key(b"10.0.0.1"));
        assert_eq!(Network::parse("10.1.2.3/16").unwrap().text(), "10.1.0.0/16");
        assert_eq!(
            Network::parse("::ffff:10.1.2.3/120").unwrap().text(),
            "10.1.2.0/24"
        );
        for bad in [
            "10.0.0.0/33",
            "::/129",
            "10.0.0.0/",
            "/8",
            "x/8",
            "::ffff:1.2.3.4/90",
        ] {
            assert_eq!(Network::parse(bad), None, "{bad}");
        }
    }

    proptest! {
        /// An address is inside a network exactly when its first `prefix` bits are the network's.
        #[test]
        fn containment_is_prefix_equality(a in any::<u128>(), b in any::<u128>(), prefix in 0u8..=128) {
            let n = Network::new(IpAddr::V6(a.into()), prefix);
            let key = IpAddr::V6(b.into()).to_string();
            let same = prefix == 0 || (a ^ b) >> (128 - u32::from(prefix)) == 0;
            // IPv4-mapped addresses are IPv4 clients: not in any IPv6 network.
            let mapped = IpAddr::V6(b.into()).to_canonical().is_ipv4();
            prop_assert_eq!(n.contains_key(key.as_bytes()), same && !mapped);
        }

        #[test]
        fn any_text_is_safe(text in ".{0,60}") {
            let _ = Network::parse(&text);
        }
    }
}
