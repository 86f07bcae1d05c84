//! What a global rule's bucket for one client is called at the quota service, for an operator
//! (`tollgate quota-key`): the same name the filter sends, worked out from the configuration.

use super::model::Config;
use super::syntax::KeyPart;

impl Config {
    /// The bucket of global rule `rule` for a client whose key parts are `values` (one per part
    /// of the rule's `key`, as the request carries them: an address for `client_ip`, a header's
    /// value, …), as the quota service names it: `(limit_id, key)`, the path of its admin API's
    /// `/admin/v1/buckets/{limit_id}/{key}`. The rule's own limit (not an override's, nor one
    /// from `limit_from`).
    pub fn service_bucket(&self, rule: &str, values: &[&[u8]]) -> Result<(String, String), String> {
        let r = self
            .rules
            .iter()
            .find(|r| r.name == rule)
            .ok_or_else(|| format!("no rule named {rule:?}"))?;
        let global = r
            .global()
            .ok_or_else(|| format!("rule {rule:?} is not global (scope: global, a limit)"))?;
        if values.len() != r.key.len() {
            return Err(format!(
                "rule {rule:?} has {} key part(s), {} value(s) given",
                r.key.len(),
                values.len()
            ));
        }
        let mut key = crate::key::KeyBytes::new();
        for (value, part) in values.iter().zip(&r.key) {
            let normal: Vec<u8> = match part {
                KeyPart::ClientIp => {
                    let ip = std::str::from_utf8(value)
                        .ok()
                        .and_then(|v| v.trim().parse::<std::net::IpAddr>().ok())
                        .ok_or_else(|| {
                            format!("{:?} is not an IP address", String::from_utf8_lossy(value))
                        })?;
                    self.client_ip.key_of(ip)
                }
                KeyPart::Host => {
                    let mut host = crate::network::strip_port(value).to_vec();
                    host.make_ascii_lowercase();
                    host
                }
                _ => value.to_vec(),
            };
            crate::key::push_key_part(&mut key, Some(&normal));
        }
        let secret = self.quota_service.as_ref().and_then(|q| q.key_secret);
        let name = crate::key::service_key(secret, tollgate_core::slot::key_hash(&key));
        Ok((
            format!(
                "{}.{}.{}.{}",
                global.limit_id, global.requests, global.per_ms, global.burst
            ),
            format!("{name:032x}"),
        ))
    }
}
