//! Local limits: each algorithm a pure function of a slot's 32 bytes of state, the time and a
//! request's cost; and the settlement of costs known only after the response.

pub mod concurrency;
pub mod fixed_window;
pub mod leaky_bucket;
pub mod settle;
pub mod sliding_window;
pub mod token_bucket;
pub mod warm_up;
