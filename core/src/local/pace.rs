//! Pacing bytes: a token bucket of bytes per key, charged with every chunk as it comes, and the
//! wait before that chunk may go on — a chunk is never refused, only held until the bucket has
//! covered it, so a key's bytes flow at its rate after its burst whatever its connections.

use crate::local::token_bucket::TokenBucket;
use crate::state::{read_u128, write_u128, State};

impl TokenBucket {
    /// The bucket's `state` after `bytes` more are charged at `now_ns`, and how long (ns) their
    /// sender must wait before passing them on: 0 while they fit in the burst, else until the
    /// rate has refilled what they take beyond it.
    pub fn pace(&self, state: &State, now_ns: u64, bytes: u64) -> (State, u64) {
        let tat = read_u128(state, 0);
        let charged = tat
            .max(self.scaled(now_ns))
            .saturating_add(u128::from(self.period_ns()).saturating_mul(u128::from(bytes)));
        let capacity = u128::from(self.period_ns()) * u128::from(self.burst());
        let due = self.unscale_up(charged.saturating_sub(capacity));
        let mut next = *state;
        write_u128(&mut next, 0, charged);
        (next, due.saturating_sub(now_ns))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::STATE_BYTES;
    use proptest::prelude::*;

    const SEC: u64 = 1_000_000_000;
    const START: u64 = 100_000 * SEC;

    #[test]
    fn the_burst_goes_at_once_and_the_rest_at_the_rate() {
        // 1 000 000 bytes a second, burst 100 000.
        let tb = TokenBucket::new(1_000_000, SEC, 100_000).unwrap();
        let (s, wait) = tb.pace(&[0; STATE_BYTES], START, 100_000);
        assert_eq!(wait, 0, "the burst");
        let (s, wait) = tb.pace(&s, START, 50_000);
        assert_eq!(wait, 50_000_000, "50 000 bytes beyond it: 50 ms");
        // Two senders of one key share the rate: the next chunk waits behind the first.
        let (_, wait) = tb.pace(&s, START + 10_000_000, 50_000);
        assert_eq!(wait, 90_000_000);
        // Idle long enough, the burst is back.
        let (_, wait) = tb.pace(&s, START + SEC, 100_000);
        assert_eq!(wait, 0);
    }

    proptest! {
        /// Bytes passed on by any time `t` (each chunk at its arrival plus its wait) stay within
        /// `burst + rate × (t − start)`, in exact integers.
        #[test]
        fn bytes_passed_on_stay_within_burst_plus_rate(
            rate in 1u64..5_000_000,
            burst in 1u64..200_000,
            chunks in proptest::collection::vec((0u64..50_000_000, 1u64..70_000), 1..100),
        ) {
            let tb = TokenBucket::new(rate, SEC, burst).unwrap();
            let mut state = [0; STATE_BYTES];
            let mut now = START;
            let mut released: Vec<(u64, u64)> = Vec::new();
            for (gap, bytes) in chunks {
                now += gap;
                let (next, wait) = tb.pace(&state, now, bytes);
                state = next;
                released.push((now + wait, bytes));
            }
            released.sort_unstable();
            let mut sent: u128 = 0;
            for (at, bytes) in &released {
                sent += u128::from(*bytes);
                let allowed = u128::from(burst) * u128::from(SEC)
                    + u128::from(at - START) * u128::from(rate);
                prop_assert!(sent * u128::from(SEC) <= allowed,
                    "{sent} bytes by {} ns", at - START);
            }
        }
    }
}
