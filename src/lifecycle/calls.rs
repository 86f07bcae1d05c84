//! Which context made each call in flight, by token: Envoy delivers every answer through the root
//! context, so a request's answer is found by the token of its call.

use rustc_hash::FxHashMap;
use std::cell::RefCell;

/// The callers of one VM's calls in flight. Borrowed only for one insert or removal: a
/// re-entered callback finds it free.
#[derive(Default)]
pub struct Callers(RefCell<FxHashMap<u32, u32>>);

impl Callers {
    /// Note that context `context_id` made the call `token`.
    pub fn register(&self, token: u32, context_id: u32) {
        if let Ok(mut calls) = self.0.try_borrow_mut() {
            calls.insert(token, context_id);
        }
    }

    /// The context that made the call `token`, forgotten from now on.
    pub fn take(&self, token: u32) -> Option<u32> {
        self.0.try_borrow_mut().ok()?.remove(&token)
    }

    /// Forget call `token` if context `context_id` made it (a host whose tokens are not unique
    /// per VM: another context's call may have the same token).
    pub fn forget_if(&self, token: u32, context_id: u32) {
        if let Ok(mut calls) = self.0.try_borrow_mut() {
            if calls.get(&token) == Some(&context_id) {
                calls.remove(&token);
            }
        }
    }

    /// Forget a call whose answer is no longer wanted (its context went away, or it was
    /// delivered by the context's own id).
    pub fn forget(&self, token: u32) {
        let _ = self.take(token);
    }
}
