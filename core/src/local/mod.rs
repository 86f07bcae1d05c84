//! Local limits: each algorithm a pure function of a slot's 32 bytes of state, the time and a
//! request's cost; the settlement of costs known only after the response; and pacing bytes.

pub mod concurrency;
pub mod fixed_window;
pub mod leaky_bucket;
pub mod pace;
pub mod settle;
pub mod sliding_window;
pub mod token_bucket;
pub mod warm_up;
