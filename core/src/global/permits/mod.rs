//! Global concurrency: the permits of one key's limit, leased to proxy instances — the service's
//! side ([`Holdings`]) and a proxy's ([`PermitAllowance`]). Each instance holds some permits until its holding expires unless renewed; a proxy
//! that dies or is cut off loses its permits one lease term after its last renewal, and no one has
//! to decrement anything for it.
//!
//! A call says how many permits the instance wants to hold (`wanted`) and how many of those it
//! holds it keeps using whatever the answer (`keep`: its requests in flight, at least). The
//! instance then holds `max(keep, min(wanted, fair share, what others do not hold))`: never fewer
//! than it keeps (it may still be using them), never more than the limit in total. Fair shares are
//! max-min fair by `wanted` among the instances with live holdings; an instance above its share
//! is told its share and lets permits go as its requests end.
//!
//! Until the store has been up for a lease term (`settled`), a store that lost its holdings (a
//! restart) grants nothing new: instances renewing declare what they keep, and get that back.

mod allowance;
mod api;
mod holdings;
#[cfg(test)]
mod tests;

pub use allowance::PermitAllowance;
pub use api::{PermitAnswer, PermitAsk, PermitItem, PermitRequest, PermitResponse};
pub use holdings::{Holding, Holdings, PermitGrant};
