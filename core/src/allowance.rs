//! A global rule's local allowance: tokens leased from the quota service, spent here with CAS.
//!
//! State: allowance (u32), the global bucket's remaining tokens as the service last reported them
//! for this key (u32), lease expiry (ms), and a mark with its own expiry (ms): a refill in flight
//! (claimed by one worker, so one call per key per process), or the service had nothing
//! (`EXHAUSTED`), or failed (`FAILED`). Refills themselves are the filter's business: this module
//! only decides, claims and applies grants.

use crate::state::{read_u32, read_u64, write_u32, write_u64, Decision, State, STATE_BYTES};

/// The service granted nothing: refuse until the mark expires.
pub const EXHAUSTED: u64 = 1 << 63;
/// The service could not be reached: apply the failure mode until the mark expires.
pub const FAILED: u64 = 1 << 62;
const UNTIL: u64 = FAILED - 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseAllowance {
    /// Tokens asked for per refill.
    pub lease_size: u64,
    /// Refill once the allowance falls below this.
    pub low_water: u64,
    /// A claimed refill is given up (and may be claimed again) after this long.
    pub claim_ms: u64,
    /// The global bucket's capacity and the time one token takes to come back to it: what the
    /// rate-limit headers of an admitted request say (`r`, `t`), from the service's last report.
    pub global_burst: u64,
    pub global_interval_ns: u64,
}

struct Parts {
    allowance: u64,
    /// The global bucket's remaining tokens when the service last answered for this key.
    reported: u64,
    expires_ms: u64,
    mark: u64,
}

fn parts(state: &State) -> Parts {
    Parts {
        allowance: u64::from(read_u32(state, 0)),
        reported: u64::from(read_u32(state, 4)),
        expires_ms: read_u64(state, 8),
        mark: read_u64(state, 16),
    }
}

fn encode(p: &Parts) -> State {
    let mut s = [0; STATE_BYTES];
    let u32_of = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
    write_u32(&mut s, 0, u32_of(p.allowance));
    write_u32(&mut s, 4, u32_of(p.reported));
    write_u64(&mut s, 8, p.expires_ms);
    write_u64(&mut s, 16, p.mark);
    s
}

impl LeaseAllowance {
    pub fn decide(&self, state: &State, now_ns: u64, cost: u64) -> Decision {
        let now_ms = now_ns / 1_000_000;
        let p = parts(state);
        let allowance = if p.expires_ms > now_ms {
            p.allowance
        } else {
            0
        };
        let until = p.mark & UNTIL;
        let marked = until > now_ms;
        if allowance >= cost {
            let left = allowance - cost;
            let mark = if left < self.low_water && !marked {
                now_ms + self.claim_ms
            } else {
                p.mark
            };
            return Decision::Allow {
                state: encode(&Parts {
                    allowance: left,
                    mark,
                    ..p
                }),
                // What the key has globally, as of the service's last report: the bucket's
                // remaining tokens plus what this proxy still holds of them; and the time the
                // global bucket takes to be full from there.
                remaining: left.saturating_add(p.reported),
                reset_ns: self
                    .global_burst
                    .saturating_sub(p.reported)
                    .saturating_mul(self.global_interval_ns),
                delay_ns: 0,
            };
        }
        if marked && p.mark & EXHAUSTED != 0 {
            let wait = (until - now_ms).saturating_mul(1_000_000);
            return Decision::Deny {
                retry_after_ns: wait,
                remaining: allowance,
                reset_ns: wait,
            };
        }
        if marked && p.mark & FAILED != 0 {
            return Decision::Fallback;
        }
        if marked {
            return Decision::Wait { claim: None };
        }
        Decision::Wait {
            claim: Some(encode(&Parts {
                allowance,
                mark: now_ms + self.claim_ms,
                ..p
            })),
        }
    }

    /// True if `before → after` is the claim of a refill (the writer must send it).
    pub fn claimed(&self, before: &State, after: &State) -> bool {
        let (b, a) = (parts(before), parts(after));
        a.mark != b.mark && a.mark & (EXHAUSTED | FAILED) == 0 && a.mark != 0
    }

    pub fn allowance(state: &State, now_ms: u64) -> u64 {
        let p = parts(state);
        if p.expires_ms > now_ms {
            p.allowance
        } else {
            0
        }
    }

    /// Add a grant: `granted` tokens valid for `ttl_ms`. Nothing granted marks the key exhausted
    /// for `retry_ms`.
    pub fn grant(state: &State, now_ms: u64, granted: u64, ttl_ms: u64, retry_ms: u64) -> State {
        let p = parts(state);
        let held = if p.expires_ms > now_ms {
            p.allowance
        } else {
            0
        };
        encode(&Parts {
            allowance: held.saturating_add(granted),
            reported: p.reported,
            expires_ms: if granted > 0 {
                now_ms.saturating_add(ttl_ms)
            } else {
                p.expires_ms
            },
            mark: if granted > 0 {
                0
            } else {
                EXHAUSTED | (now_ms + retry_ms.max(1))
            },
        })
    }

    /// Note what the service reported of the global bucket with its grant.
    pub fn reported(state: &State, remaining: u64) -> State {
        let mut p = parts(state);
        p.reported = remaining;
        encode(&p)
    }

    /// The refill failed: apply the failure mode for `retry_ms` (tokens held stay valid).
    pub fn fail(state: &State, now_ms: u64, retry_ms: u64) -> State {
        let mut p = parts(state);
        p.mark = FAILED | (now_ms + retry_ms.max(1));
        encode(&p)
    }

    pub fn is_idle(state: &State, now_ms: u64) -> bool {
        let p = parts(state);
        p.expires_ms <= now_ms && (p.mark & UNTIL) <= now_ms
    }

    pub fn refund(state: &State, cost: u64) -> State {
        let mut p = parts(state);
        p.allowance = p.allowance.saturating_add(cost);
        encode(&p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const T0: u64 = 1_700_000_000_000; // ms

    fn lease() -> LeaseAllowance {
        LeaseAllowance {
            lease_size: 10,
            low_water: 5,
            claim_ms: 200,
            global_burst: 0,
            global_interval_ns: 0,
        }
    }

    #[test]
    fn a_new_key_claims_a_refill_then_waits_then_spends_its_grant() {
        let l = lease();
        let fresh = [0; STATE_BYTES];
        let Decision::Wait {
            claim: Some(claimed),
        } = l.decide(&fresh, T0 * MS, 1)
        else {
            panic!("a new key waits and claims");
        };
        assert!(l.claimed(&fresh, &claimed));
        // Others wait without claiming again.
        assert_eq!(
            l.decide(&claimed, T0 * MS, 1),
            Decision::Wait { claim: None }
        );
        let granted = LeaseAllowance::grant(&claimed, T0, 10, 1_000, 50);
        let mut s = granted;
        for i in 0..10u64 {
            match l.decide(&s, (T0 + 1) * MS, 1) {
                Decision::Allow {
                    state, remaining, ..
                } => {
                    assert_eq!(remaining, 9 - i);
                    // Below the low-water mark (5 left) the spender claims the next refill, once.
                    assert_eq!(l.claimed(&s, &state), i == 5, "at {i}");
                    s = state;
                }
                d => panic!("{d:?}"),
            }
        }
        // Empty with a refill in flight: wait.
        assert_eq!(
            l.decide(&s, (T0 + 1) * MS, 1),
            Decision::Wait { claim: None }
        );
    }

    #[test]
    fn exhausted_refuses_failed_falls_back_and_leases_expire() {
        let l = lease();
        let none = LeaseAllowance::grant(&[0; STATE_BYTES], T0, 0, 1_000, 300);
        assert!(matches!(
            l.decide(&none, T0 * MS, 1),
            Decision::Deny { retry_after_ns, .. } if retry_after_ns == 300 * MS
        ));
        let failed = LeaseAllowance::fail(&[0; STATE_BYTES], T0, 1_000);
        assert_eq!(l.decide(&failed, T0 * MS, 1), Decision::Fallback);
        // After the mark, a new claim.
        assert!(matches!(
            l.decide(&failed, (T0 + 1_000) * MS, 1),
            Decision::Wait { claim: Some(_) }
        ));
        // Tokens held survive a failure until their lease ends.
        let held = LeaseAllowance::fail(
            &LeaseAllowance::grant(&[0; STATE_BYTES], T0, 3, 500, 1),
            T0,
            1_000,
        );
        assert!(matches!(
            l.decide(&held, T0 * MS, 1),
            Decision::Allow { .. }
        ));
        assert_eq!(l.decide(&held, (T0 + 500) * MS, 1), Decision::Fallback);
        assert!(!LeaseAllowance::is_idle(&held, T0 + 999));
        assert!(LeaseAllowance::is_idle(&held, T0 + 1_000));
    }
}
