//! A slot's state bytes, what a decision returns, and the helpers (integers, a draw) they share.

/// Bytes of algorithm state in a slot. All zeros is a fresh key.
pub const STATE_BYTES: usize = 32;

/// Clocks of workers and proxies differ by less than this (ms): a time stored further ahead of
/// now than anything puts it means the clock stepped back, and the state is read accordingly.
pub const CLOCK_SKEW_MS: u64 = 1_000;

/// One slot's algorithm state.
pub type State = [u8; STATE_BYTES];

/// What an algorithm decided for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Admit {
        state: State,
        /// Requests of cost 1 that would still be admitted right now.
        remaining: u64,
        /// Nanoseconds until the quota is fully back.
        reset_ns: u64,
        /// Nanoseconds to hold the request before passing it on (leaky bucket only).
        delay_ns: u64,
    },
    Refuse {
        /// Nanoseconds until this request would be admitted (`u64::MAX`: only by a release).
        retry_after_ns: u64,
        remaining: u64,
        reset_ns: u64,
    },
    /// No decision possible yet: quota is on its way (global rules). With `claim`, write it: this
    /// request asks for the refill.
    Wait { claim: Option<State> },
    /// The source of quota failed (global rules): the rule's failure mode decides. With
    /// `claim`, write it: this request asks the source again (the failure mode still decides it).
    Fallback { claim: Option<State> },
}

/// A draw in `0..2^32` from a seed (SplitMix64): requests need no random source of the host's, a
/// counter or the time is seed enough for a refusal probability.
pub fn draw(seed: u64) -> u32 {
    let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) >> 32) as u32
}

pub(crate) fn read_u32(s: &State, at: usize) -> u32 {
    let mut b = [0; 4];
    b.copy_from_slice(&s[at..at + 4]);
    u32::from_le_bytes(b)
}

pub(crate) fn write_u32(s: &mut State, at: usize, v: u32) {
    s[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

/// `n`, or `u32::MAX` if it does not fit: counts stored in 32 bits stop at their maximum.
pub(crate) fn saturating_u32(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

pub(crate) fn read_u64(s: &State, at: usize) -> u64 {
    let mut b = [0; 8];
    b.copy_from_slice(&s[at..at + 8]);
    u64::from_le_bytes(b)
}

pub(crate) fn write_u64(s: &mut State, at: usize, v: u64) {
    s[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

pub(crate) fn read_u128(s: &State, at: usize) -> u128 {
    let mut b = [0; 16];
    b.copy_from_slice(&s[at..at + 16]);
    u128::from_le_bytes(b)
}

pub(crate) fn write_u128(s: &mut State, at: usize, v: u128) {
    s[at..at + 16].copy_from_slice(&v.to_le_bytes());
}

/// `num / den` rounded up, saturated to u64.
pub(crate) fn div_ceil_u64(num: u128, den: u128) -> u64 {
    u64::try_from(num.div_ceil(den.max(1))).unwrap_or(u64::MAX)
}

/// `num / den` rounded down, saturated to u64.
pub(crate) fn div_u64(num: u128, den: u128) -> u64 {
    u64::try_from(num / den.max(1)).unwrap_or(u64::MAX)
}

/// Tests: keep the new state if the decision admitted the request.
#[cfg(test)]
pub(crate) fn apply(decision: Decision, state: &mut State) -> bool {
    match decision {
        Decision::Admit { state: next, .. } => {
            *state = next;
            true
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn draws_are_spread_evenly(seed in any::<u64>()) {
            // Of 4096 consecutive seeds, about a quarter fall below 2^30.
            let below = (0..4096u64).filter(|i| draw(seed.wrapping_add(*i)) < 1 << 30).count();
            prop_assert!((850..1200).contains(&below), "{below}");
        }
    }
}
