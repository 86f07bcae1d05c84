//! Max-min fair division of a capacity among demands (Doorman's FAIR_SHARE).
//!
//! Everyone whose demand is at most an equal share gets it all; what they leave is split equally
//! among the rest, repeatedly. Capacity 120, demands 1000/50/10 → 60/50/10.

/// Each demand's allocation, in the same order. Never more than the demand; the sum never exceeds
/// `capacity`; whole tokens, with remainders going to the earliest unsatisfied demands.
pub fn max_min_fair(capacity: u64, demands: &[u64]) -> Vec<u64> {
    max_min_fair_from(capacity, demands, 0)
}

/// [`max_min_fair`] with the remainders handed out from demand `first` on (then from the start):
/// a service gives them to the caller asking now. With fewer tokens than claimants, a fixed
/// order would give them to the same few for ever (the first by name), and every other caller
/// nothing, however little the others asked for meanwhile.
pub fn max_min_fair_from(capacity: u64, demands: &[u64], first: usize) -> Vec<u64> {
    let mut alloc = vec![0u64; demands.len()];
    let mut left = capacity;
    let mut open: Vec<usize> = (0..demands.len()).filter(|&i| demands[i] > 0).collect();
    while left > 0 && !open.is_empty() {
        let share = left / open.len() as u64;
        if share == 0 {
            // Fewer tokens than claimants: one each, in order from `first`.
            rotate_to(&mut open, first);
            for &i in open.iter().take(left as usize) {
                alloc[i] += 1;
            }
            break;
        }
        let mut still_open = Vec::with_capacity(open.len());
        for &i in &open {
            let want = demands[i] - alloc[i];
            let take = want.min(share);
            alloc[i] += take;
            left -= take;
            if alloc[i] < demands[i] {
                still_open.push(i);
            }
        }
        if still_open.len() == open.len() {
            // Everyone took a full share and wants more: the equal split is final, but for
            // the remainder, handed out one by one from `first`.
            rotate_to(&mut still_open, first);
            for &i in still_open.iter().take(left as usize) {
                alloc[i] += 1;
            }
            break;
        }
        open = still_open;
    }
    alloc
}

/// Rotate sorted indices so that the first at or after `first` leads.
fn rotate_to(indices: &mut [usize], first: usize) {
    let k = indices.partition_point(|&i| i < first);
    indices.rotate_left(k);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn doorman_examples() {
        assert_eq!(max_min_fair(120, &[1000, 50, 10]), [60, 50, 10]);
        assert_eq!(max_min_fair(120, &[10, 20, 30]), [10, 20, 30]);
        assert_eq!(max_min_fair(90, &[100, 100, 100]), [30, 30, 30]);
        assert_eq!(max_min_fair(100, &[100, 100, 100]), [34, 33, 33]);
        assert_eq!(max_min_fair(2, &[5, 5, 5]), [1, 1, 0]);
        assert_eq!(max_min_fair(0, &[5]), [0]);
        assert_eq!(max_min_fair(10, &[]), Vec::<u64>::new());
        assert_eq!(max_min_fair(10, &[0, 7]), [0, 7]);
        // Remainders from the caller on.
        assert_eq!(max_min_fair_from(2, &[5, 5, 5], 2), [1, 0, 1]);
        assert_eq!(max_min_fair_from(100, &[100, 100, 100], 1), [33, 34, 33]);
        assert_eq!(max_min_fair_from(1, &[1, 0, 1, 1], 1), [0, 0, 1, 0]);
    }

    proptest! {
        #[test]
        fn allocations_are_feasible_and_max_min_fair(
            capacity in 0u64..10_000,
            demands in prop::collection::vec(0u64..5_000, 0..12),
        ) {
            let alloc = max_min_fair(capacity, &demands);
            let total: u64 = alloc.iter().sum();
            prop_assert!(total <= capacity);
            for (a, d) in alloc.iter().zip(&demands) {
                prop_assert!(a <= d);
            }
            let wanted: u64 = demands.iter().sum();
            // Work-conserving: all capacity is used unless everyone is satisfied.
            prop_assert_eq!(total, capacity.min(wanted));
            // Max-min: an unsatisfied demand gets at least as much as anyone else, minus rounding.
            let top = alloc.iter().copied().max().unwrap_or(0);
            for (a, d) in alloc.iter().zip(&demands) {
                if a < d {
                    prop_assert!(a + 1 >= top, "{:?} -> {:?}", demands, alloc);
                }
            }
        }
    }
}
