//! Costs known only after the response: a request reserves an estimate from its key's token
//! bucket when it arrives, and settles once its cost is known. What it did not use goes back; what
//! it used beyond the reservation is charged even past the bucket's bottom, as debt that later
//! requests repay before any of them is admitted.
//!
//! The bound, per key, from a fresh bucket: at any admission at time `t`, the tokens settled so
//! far plus those reserved by requests still in flight are at most `burst + rate × t`. So the
//! tokens requests admitted by `t` turn out to cost are at most `burst + rate × t` plus the excess
//! of the requests in flight at `t` over their reservations — nothing more when each reservation
//! is the request's maximum.

use crate::local::token_bucket::{TokenBucket, OWED_UNTIL_AT};
use crate::state::{read_u128, read_u64, write_u128, write_u64, State};

impl TokenBucket {
    /// The bucket's `state` after a request that reserved `reserved` tokens turned out to cost
    /// `actual`, settled at `now_ns`: a refund of the difference, or a charge of the excess.
    pub fn settle_state(&self, state: &State, now_ns: u64, reserved: u64, actual: u64) -> State {
        let tat = read_u128(state, 0);
        let mut next = *state;
        if actual <= reserved {
            // A refund on a bucket in debt repays the debt first: both are the same timestamp.
            write_u128(&mut next, 0, self.refund(tat, reserved - actual));
            return next;
        }
        let excess = u128::from(self.period_ns()).saturating_mul(u128::from(actual - reserved));
        // A debt saturates where the bucket's clock ends (the year 2554): past it, it would read
        // as a clock that stepped back. Never below the `tat` it charges, though: a bucket whose
        // capacity reaches past the clock's end (a long period times a large burst) may stand
        // there already, and lowering it would give room instead of charging.
        let charged = tat
            .max(self.scaled(now_ns))
            .saturating_add(excess)
            .min(self.scaled(u64::MAX))
            .max(tat);
        write_u128(&mut next, 0, charged);
        let owed_until = self.unscale_up(charged).max(read_u64(state, OWED_UNTIL_AT));
        write_u64(&mut next, OWED_UNTIL_AT, owed_until);
        next
    }

    /// Tokens the bucket owes at `now_ns` (0 unless a settlement charged it past its bottom).
    pub fn debt(&self, state: &State, now_ns: u64) -> u64 {
        let horizon = self
            .scaled(now_ns)
            .saturating_add(u128::from(self.period_ns()) * u128::from(self.burst()));
        let tat = read_u128(state, 0);
        let owed = u64::try_from(tat.saturating_sub(horizon) / u128::from(self.period_ns()))
            .unwrap_or(u64::MAX);
        // A bucket whose capacity reaches past the clock's end (a long period times a large
        // burst): its charge saturated there, below the horizon, and the excess is not in the
        // state. It still owes (it refuses until `owed_until`): at least a token.
        let saturated = tat >= self.scaled(u64::MAX);
        if owed == 0 && saturated && read_u64(state, OWED_UNTIL_AT) > now_ns {
            return 1;
        }
        owed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Decision, STATE_BYTES};
    use proptest::prelude::*;

    const SEC: u64 = 1_000_000_000;
    const START: u64 = 100_000 * SEC;

    fn admitted(tb: &TokenBucket, state: &State, now: u64, cost: u64) -> Option<State> {
        match tb.decide_state(state, now, cost) {
            Decision::Admit { state, .. } => Some(state),
            _ => None,
        }
    }

    #[test]
    fn an_unused_reservation_goes_back_and_an_excess_is_debt_repaid_before_anyone_is_admitted() {
        // 100 tokens per second, burst 100.
        let tb = TokenBucket::new(100, SEC, 100).unwrap();
        let fresh = [0; STATE_BYTES];
        // Reserve 100, use 40: 60 come back.
        let s = admitted(&tb, &fresh, START, 100).unwrap();
        assert!(admitted(&tb, &s, START, 1).is_none());
        let s = tb.settle_state(&s, START, 100, 40);
        let s = admitted(&tb, &s, START, 60).expect("the unused 60 came back");
        // Reserve nothing more; a request that reserved 10 used 310: 300 owed.
        let s = tb.settle_state(&s, START, 10, 310);
        assert_eq!(tb.debt(&s, START), 300);
        match tb.decide_state(&s, START, 1) {
            Decision::Refuse { retry_after_ns, .. } => {
                // 300 owed and one more token: 3.01 s at 100 per second.
                assert_eq!(retry_after_ns, 3_010_000_000);
            }
            other => panic!("admitted in debt: {other:?}"),
        }
        assert!(admitted(&tb, &s, START + 3_000_000_000, 1).is_none());
        assert!(admitted(&tb, &s, START + 3_010_000_000, 1).is_some());
        // A refund while in debt repays it.
        let s = tb.settle_state(&s, START, 200, 0);
        assert_eq!(tb.debt(&s, START), 100);
    }

    /// Found by `any_debt_refuses_until_its_retry_after`: a bucket whose capacity (1 token per
    /// 8 hours, a burst of 636 664) reaches past the clock's end stands there once its burst is
    /// taken; a settlement's excess capped the `tat` at the clock's end — below it — and so gave
    /// room: the next request was admitted in debt, and the debt read 0.
    #[test]
    fn a_bucket_whose_capacity_passes_the_clocks_end_is_charged_not_given_room() {
        for period in [28_973_862_351_016, 28_973_953_368_909] {
            let tb = TokenBucket::new(1, period, 636_664).unwrap();
            let s = admitted(&tb, &[0; STATE_BYTES], START, 636_664).unwrap();
            let s = tb.settle_state(&s, START, 636_664, 636_665);
            assert!(tb.debt(&s, START) > 0, "{period}");
            assert!(
                admitted(&tb, &s, START, 1).is_none(),
                "{period}: admitted in debt"
            );
        }
    }

    #[test]
    fn any_excess_however_large_is_a_debt_that_refuses() {
        for (requests, period) in [(1_000, 60 * SEC), (1, 1), (u64::MAX, u64::MAX)] {
            let Some(tb) = TokenBucket::new(requests, period, 1) else {
                continue;
            };
            let s = admitted(&tb, &[0; STATE_BYTES], START, 1).unwrap();
            let s = tb.settle_state(&s, START, 1, u64::MAX);
            assert!(tb.debt(&s, START) > 0, "{requests}/{period}");
            match tb.decide_state(&s, START + 3_600 * SEC, 1) {
                Decision::Refuse { retry_after_ns, .. } => {
                    assert!(
                        retry_after_ns > 100 * 365 * 24 * 3_600 * SEC,
                        "{retry_after_ns}"
                    )
                }
                other => panic!("{requests}/{period}: admitted in debt: {other:?}"),
            }
        }
    }

    #[test]
    fn debt_is_not_taken_for_a_clock_that_stepped_back() {
        let tb = TokenBucket::new(10, SEC, 10).unwrap();
        let s = admitted(&tb, &[0; STATE_BYTES], START, 10).unwrap();
        // An hour's worth of excess: refused for that hour, not read as a clock step.
        let s = tb.settle_state(&s, START, 1, 36_001);
        assert!(admitted(&tb, &s, START + 60 * SEC, 1).is_none());
        assert!(admitted(&tb, &s, START + 3_601 * SEC, 1).is_some());
        // Without debt, a clock stepped back still leaves one token.
        let s = admitted(&tb, &[0; STATE_BYTES], START, 10).unwrap();
        assert!(admitted(&tb, &s, START - 3_600 * SEC, 1).is_some());
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Time passes (ms).
        Wait(u64),
        /// A request arrives reserving this many tokens.
        Reserve(u64),
        /// The in-flight request at this index (modulo) ends having cost this many.
        Settle(usize, u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u64..500).prop_map(Op::Wait),
            (1u64..60).prop_map(Op::Reserve),
            (any::<usize>(), 0u64..200).prop_map(|(i, a)| Op::Settle(i, a)),
        ]
    }

    proptest! {
        /// At every admission, tokens settled plus tokens reserved in flight are within
        /// `burst + rate × elapsed`, over any interleaving of arrivals, settlements and time.
        #[test]
        fn settled_and_reserved_tokens_stay_within_burst_plus_rate_times_elapsed(
            requests in 1u64..200,
            per_s in 1u64..5,
            burst in 1u64..150,
            ops in proptest::collection::vec(op(), 1..300),
        ) {
            let tb = TokenBucket::new(requests, per_s * SEC, burst).unwrap();
            let mut state = [0; STATE_BYTES];
            let mut now = START;
            let mut in_flight: Vec<u64> = Vec::new();
            let mut settled: u128 = 0;
            for op in ops {
                match op {
                    Op::Wait(ms) => now += ms * 1_000_000,
                    Op::Reserve(r) => {
                        if let Some(next) = admitted(&tb, &state, now, r) {
                            state = next;
                            in_flight.push(r);
                            let used = settled + in_flight.iter().map(|&r| u128::from(r)).sum::<u128>();
                            // used ≤ burst + requests × elapsed / period, in exact integers.
                            let allowed = u128::from(burst) * u128::from(per_s * SEC)
                                + u128::from(now - START) * u128::from(requests);
                            prop_assert!(
                                used * u128::from(per_s * SEC) <= allowed,
                                "{used} tokens at {} ms", (now - START) / 1_000_000
                            );
                        }
                    }
                    Op::Settle(i, actual) => {
                        if !in_flight.is_empty() {
                            let reserved = in_flight.remove(i % in_flight.len());
                            state = tb.settle_state(&state, now, reserved, actual);
                            settled += u128::from(actual);
                        }
                    }
                }
            }
        }

        /// Any excess over the whole u64 space, on any bucket: the key is refused until the
        /// refusal's `Retry-After`, and admitted then (where the clock reaches it) — a debt is
        /// never wiped by a small request, nor read as a clock that stepped back.
        #[test]
        fn any_debt_refuses_until_its_retry_after(
            requests in 1u64..1_000_000,
            period in 1_000_000u64..86_400 * SEC,
            burst in 1u64..1_000_000,
            excess in prop_oneof![1u64..1_000_000, any::<u64>()],
            small in 1u64..4,
        ) {
            let tb = TokenBucket::new(requests, period, burst).unwrap();
            let small = small.min(burst);
            // The whole burst reserved, and more used: `excess` owed.
            let s = admitted(&tb, &[0; STATE_BYTES], START, burst).unwrap();
            let s = tb.settle_state(&s, START, burst, burst.saturating_add(excess));
            let retry = match tb.decide_state(&s, START, small) {
                Decision::Refuse { retry_after_ns, .. } => retry_after_ns,
                other => return Err(TestCaseError::fail(format!("admitted in debt: {other:?}"))),
            };
            prop_assert!(tb.debt(&s, START) > 0);
            if let Some(half) = START.checked_add(retry / 2).filter(|_| retry > 1) {
                prop_assert!(admitted(&tb, &s, half, small).is_none(), "admitted half way");
            }
            if let Some(then) = START.checked_add(retry) {
                prop_assert!(admitted(&tb, &s, then, small).is_some(), "refused at its Retry-After");
            }
        }
    }
}
