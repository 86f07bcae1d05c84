//! Client addresses: trusted hops, prefix lengths, and override networks.

use crate::config::json::RawClientIp;
use crate::config::{err, ConfigError};
use crate::network::{ClientIp, Network};

/// An override's `client_ip` value: an address (its network under the keys' prefix length, as
/// clients are keyed) or a CIDR range at least as wide as the keys' networks.
pub(super) fn client_network(
    value: &str,
    client_ip: &ClientIp,
    at: &str,
) -> Result<Network, ConfigError> {
    let network = Network::parse(value).ok_or_else(|| {
        err(
            at,
            format!("{value:?} is not an IP address or a CIDR range (10.0.0.0/8, 2001:db8::/32)"),
        )
    })?;
    let (keyed, field) = if network.is_ipv4() {
        (client_ip.ipv4_prefix, "ipv4_prefix")
    } else {
        (client_ip.ipv6_prefix, "ipv6_prefix")
    };
    if !value.contains('/') {
        return Ok(network.widen(keyed));
    }
    if network.prefix() > keyed {
        return Err(err(
            at,
            format!(
                "{value:?} is narrower than the networks clients are keyed by \
                 (client_ip.{field} {keyed}): it would never match"
            ),
        ));
    }
    Ok(network)
}

impl RawClientIp {
    pub(super) fn validate(self, path: &str) -> Result<ClientIp, ConfigError> {
        let ipv4_prefix = self.ipv4_prefix.unwrap_or(32);
        let ipv6_prefix = self.ipv6_prefix.unwrap_or(64);
        if !(1..=32).contains(&ipv4_prefix) {
            return Err(err(format!("{path}.ipv4_prefix"), "must be 1 to 32"));
        }
        if !(1..=128).contains(&ipv6_prefix) {
            return Err(err(format!("{path}.ipv6_prefix"), "must be 1 to 128"));
        }
        Ok(ClientIp {
            trusted_hops: self.trusted_hops,
            ipv4_prefix,
            ipv6_prefix,
        })
    }
}
