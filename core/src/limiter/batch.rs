//! What an admission takes for the worker's stash, and whether tokens in other workers' stashes
//! may still come back for a request the bucket would refuse.

use super::Check;
use crate::algorithm::Limit;
use crate::local::token_bucket::TokenBucket;
use crate::state::Decision;

/// True if a refused token bucket has tokens out in worker stashes that may still come back, and
/// they could make the request fit: deciding now would refuse a request another worker's stash
/// holds tokens for (the end of a burst spread over workers).
pub(super) fn stashes_may_return(check: &Check, state: &crate::state::State, now_ns: u64) -> bool {
    let Limit::TokenBucket(bucket) = check.limit else {
        return false;
    };
    check.wait_for_stashes
        && check.cost <= bucket.burst()
        && now_ns < TokenBucket::stash_out_until(state)
}

/// Tokens to take for the worker's stash beyond a request that `remaining` would be left after:
/// a quarter of what is left, at most `check.batch`, so that a bucket near empty is shared one
/// token at a time (exact) and only a bucket with plenty hands out batches. Returns the state
/// after taking them too.
pub(super) fn stash_take(
    check: &Check,
    before: &crate::state::State,
    remaining: u64,
    now_ns: u64,
) -> Option<(crate::state::State, u64)> {
    if !matches!(check.limit, Limit::TokenBucket(_) | Limit::Lease(_)) {
        return None;
    }
    let extra = check.batch.min(remaining / 4);
    if extra == 0 {
        return None;
    }
    match check
        .limit
        .decide(before, now_ns, check.cost.saturating_add(extra))
    {
        Decision::Admit { state, .. } => {
            let state = match check.limit {
                Limit::TokenBucket(_) => TokenBucket::with_stash_out(
                    &state,
                    now_ns.saturating_add(crate::stash::STASH_RETURNED_NS),
                ),
                _ => state,
            };
            Some((state, extra))
        }
        _ => None,
    }
}
