//! A rule's overrides: keys with their own limit, unlimited, or blocked.

use super::clients::client_network;
use super::limit::LimitParams;
use crate::config::model::{KeyPart, Override, OverrideAction, Quota};
use crate::config::{err, ConfigError};
use crate::network::ClientIp;
use std::collections::HashSet;

/// A rule's overrides: keys with their own limit, unlimited, or blocked.
pub(super) fn overrides_of(
    raw: Vec<crate::config::json::RawOverride>,
    key: &[KeyPart],
    client_ip: &ClientIp,
    params: &LimitParams,
    name: &str,
    path: &str,
) -> Result<Vec<Override>, ConfigError> {
    let mut overrides = Vec::with_capacity(raw.len());
    let mut override_keys = HashSet::new();
    for (j, o) in raw.into_iter().enumerate() {
        let at = format!("{path}.overrides[{j}]");
        if o.values.len() != key.len() {
            return Err(err(
                format!("{at}.values"),
                format!(
                    "gives {} value(s) for a key of {} part(s)",
                    o.values.len(),
                    key.len()
                ),
            ));
        }
        let mut values = Vec::with_capacity(o.values.len());
        let mut networks = Vec::new();
        for (k, (v, part)) in o.values.iter().zip(key).enumerate() {
            values.push(match part {
                KeyPart::ClientIp => {
                    let at = format!("{at}.values[{k}]");
                    let network = client_network(v, client_ip, &at)?;
                    let keyed = if network.is_ipv4() {
                        client_ip.ipv4_prefix
                    } else {
                        client_ip.ipv6_prefix
                    };
                    // A range of exactly the keys' length is one key: matched as bytes.
                    if network.prefix() < keyed {
                        networks.push((k, network));
                    }
                    network.text()
                }
                KeyPart::Host => v.to_ascii_lowercase(),
                _ => v.clone(),
            });
        }
        let key = crate::key::encode_key(values.iter().map(|v| Some(v.as_bytes())));
        if !override_keys.insert(key.clone()) {
            return Err(err(
                format!("{at}.values"),
                "another override has the same values",
            ));
        }
        let action = match (o.limit, o.unlimited, o.block) {
            (Some(l), false, false) => {
                if l.calendar.is_some() {
                    return Err(err(
                        format!("{at}.limit.calendar"),
                        "a calendar quota is a global rule's own limit (global rules have \
                             no overrides)",
                    ));
                }
                let limit = params.limit(&l, o.burst, &at)?;
                OverrideAction::Limit(Quota::new(limit, &format!("{name}.o{j}"), 1))
            }
            (None, true, false) if o.burst.is_none() => OverrideAction::Unlimited,
            (None, false, true) if o.burst.is_none() => OverrideAction::Block,
            _ => {
                return Err(err(
                    at,
                    "give exactly one of limit (with optional burst), unlimited or block",
                ))
            }
        };
        overrides.push(Override {
            key,
            networks,
            action,
        });
    }
    Ok(overrides)
}
