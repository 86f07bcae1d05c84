//! A client's key for a rule, from its values, as the filter makes it: for an operator's look at
//! a local key (the status path) and at a global rule's bucket at the quota service
//! (`tollgate quota-key`: the same name the filter sends).

use super::model::Config;
use super::syntax::KeyPart;
use tollgate_core::calendar::CalendarUnit;

/// The bounds (ms since the epoch) of the period of a unit in a time zone now: the quota
/// service's calendar, which the filter does not carry.
pub type PeriodOf = dyn Fn(CalendarUnit, &str) -> Option<(u64, u64)>;

impl Config {
    /// Rule `rule`'s key for a client whose key parts are `values` (one per part of the rule's
    /// `key`, as the request carries them), as the filter makes it: the rule's index and the key.
    pub fn key_of(&self, rule: &str, values: &[&[u8]]) -> Result<(usize, Vec<u8>), String> {
        let (index, r) = self
            .rules
            .iter()
            .enumerate()
            .find(|(_, r)| r.name == rule)
            .ok_or_else(|| format!("no rule named {rule:?}"))?;
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
        Ok((index, key.into_vec()))
    }

    /// The bucket of global rule `rule` for a client whose key parts are `values` (see
    /// [`Config::key_of`]), as the quota service names it: `(limit_id, key)`, the path of its
    /// admin API's `/admin/v1/buckets/{limit_id}/{key}`. The rule's own limit (not an
    /// override's, nor one from `limit_from`).
    ///
    /// A calendar quota's bucket is its current period's: `period_of` says the bounds of the
    /// period of a unit in a time zone now (the quota service's rules, which the filter does
    /// not carry).
    pub fn service_bucket(
        &self,
        rule: &str,
        values: &[&[u8]],
        period_of: &PeriodOf,
    ) -> Result<(String, String), String> {
        let (index, key) = self.key_of(rule, values)?;
        let global = self.rules[index]
            .global()
            .ok_or_else(|| format!("rule {rule:?} is not global (scope: global, a limit)"))?;
        let secret = self.quota_service.as_ref().and_then(|q| q.key_secret);
        let name = crate::key::service_key(secret, tollgate_core::slot::key_hash(&key));
        let mut limit_id = format!(
            "{}.{}.{}.{}",
            global.limit_id, global.requests, global.per_ms, global.burst
        );
        if let Some(c) = &global.calendar {
            let (start, end) = period_of(c.unit, &c.time_zone)
                .ok_or_else(|| format!("no {} in {} now", c.unit.as_str(), c.time_zone))?;
            limit_id.push_str(&format!(".{start}.{end}"));
        }
        Ok((limit_id, format!("{name:032x}")))
    }
}
