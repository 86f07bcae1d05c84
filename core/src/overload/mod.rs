//! Overload protection: limits that follow what the upstream can take now (`adaptive`), and a
//! client-side throttle on its failures (`throttle`).

pub mod adaptive;
pub mod throttle;
