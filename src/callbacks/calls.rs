//! Which context made each call in flight, by token: Envoy delivers every answer through the root
//! context, so a request's answer is found by the token of its call.

use rustc_hash::FxHashMap;
use std::cell::RefCell;

thread_local! {
    static CALLS: RefCell<FxHashMap<u32, u32>> = RefCell::new(FxHashMap::default());
}

/// Note that context `context_id` made the call `token`.
pub fn register(token: u32, context_id: u32) {
    CALLS.with(|c| {
        if let Ok(mut calls) = c.try_borrow_mut() {
            calls.insert(token, context_id);
        }
    });
}

/// The context that made the call `token`, forgotten from now on.
pub fn take(token: u32) -> Option<u32> {
    CALLS.with(|c| c.try_borrow_mut().ok()?.remove(&token))
}

/// Forget a call whose answer is no longer wanted (its context went away, or it was delivered
/// by the context's own id).
pub fn forget(token: u32) {
    let _ = take(token);
}
