//! Global limits: the lease API and the service's global bucket (`lease`), a proxy's leased
//! allowance (`allowance`), global concurrency's permits (`permits`), and the max-min fair shares
//! they divide by (`fair_share`).

pub mod allowance;
pub mod fair_share;
pub mod lease;
pub mod permits;
