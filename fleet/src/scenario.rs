//! What a simulation runs — its keys, events, proxies and limit — and what it reports.

use serde::Serialize;
use tollgate_core::global::lease::rate_mtps;
use tollgate_core::LeaseAllowance;

/// How a request picks its key.
#[derive(Debug, Clone, Copy, Serialize)]
pub enum Keys {
    /// Each of `n` keys alike.
    Uniform(u32),
    /// Zipf with exponent `s` over `n` keys (key 0 the busiest).
    Zipf { n: u32, s: f64 },
    /// One key for every request.
    Hot,
}

/// Something that happens to the fleet.
#[derive(Debug, Clone, Copy, Serialize)]
pub enum Event {
    /// This share of the proxies (the first ones) restarts at `at_ms`: what they held is gone.
    Crash { at_ms: u64, share: f64 },
    /// The service loses every bucket at `at_ms` (a memory store restarted).
    StoreLoss { at_ms: u64 },
    /// Calls from this share of the proxies (the last ones) fail from `from_ms` to `until_ms`.
    Partition {
        from_ms: u64,
        until_ms: u64,
        share: f64,
    },
}

/// One run.
#[derive(Debug, Clone, Serialize)]
pub struct Scenario {
    pub name: String,
    pub proxies: usize,
    /// Workers per proxy: a request goes to one of them at random, and each worker sends the
    /// claims its requests made on its own tick (its calls hold only those).
    pub workers: u64,
    pub keys: Keys,
    /// Each key's limit: `requests` per `per_ms`, `burst`.
    pub requests: u64,
    pub per_ms: u64,
    pub burst: u64,
    /// Requests per second over the whole fleet (Poisson at each proxy).
    pub fleet_rate: f64,
    pub seconds: u64,
    /// Demand moves between proxies every this many ms (0: never): half the fleet sends four
    /// times what the other half does, and the halves swap.
    pub shift_ms: u64,
    /// Every this many ms (0: never) the fleet sends `burst_factor` times its rate for 500 ms.
    pub bursts_ms: u64,
    pub burst_factor: f64,
    pub events: Vec<Event>,
    pub ttl_ms: u64,
    /// `quota_service.lease_size` (none: its default with `instances_hint` = `proxies`).
    pub lease_size: Option<u64>,
    pub tick_ms: u64,
    pub timeout_ms: u64,
    pub retry_ms: u64,
    pub rtt_ms: u64,
    /// Each call's round trip is `rtt_ms` plus up to this much more (uniform), under the timeout.
    pub rtt_jitter_ms: u64,
    /// Chance that a call is lost (it fails after its timeout).
    pub call_loss: f64,
    pub seed: u64,
}

impl Scenario {
    /// The filter's defaults for a fleet of `proxies` (2 workers each, 5 ms ticks, 200 ms
    /// timeout, 500 ms retry, 10 s lease TTL, 2 ms round trip).
    pub fn new(
        name: &str,
        proxies: usize,
        keys: Keys,
        limit: (u64, u64, u64),
        fleet_rate: f64,
    ) -> Self {
        Self {
            name: name.into(),
            proxies,
            workers: 2,
            keys,
            requests: limit.0,
            per_ms: limit.1,
            burst: limit.2,
            fleet_rate,
            seconds: 20,
            shift_ms: 0,
            bursts_ms: 0,
            burst_factor: 4.0,
            events: Vec::new(),
            ttl_ms: 10_000,
            lease_size: None,
            tick_ms: 5,
            timeout_ms: 200,
            retry_ms: 500,
            rtt_ms: 2,
            rtt_jitter_ms: 0,
            call_loss: 0.0,
            seed: 1,
        }
    }

    pub(crate) fn allowance(&self) -> LeaseAllowance {
        // `quota_service.lease_size` by default: burst / (4 × instances_hint), 1 to 1 000.
        let lease_size = self
            .lease_size
            .unwrap_or((self.burst / (4 * self.proxies as u64)).clamp(1, 1_000));
        LeaseAllowance {
            lease_size,
            low_water: lease_size.div_ceil(2),
            claim_ms: self.timeout_ms + 100,
            global_burst: self.burst,
            global_interval_ns: self.per_ms * 1_000_000 / self.requests,
            global_rate_mtps: rate_mtps(self.requests, self.per_ms),
            calendar: false,
        }
    }

    /// Each key's tokens per second.
    pub(crate) fn key_rate(&self) -> f64 {
        self.requests as f64 * 1_000.0 / self.per_ms as f64
    }

    /// Proxy `p`'s weight at `now` (its part of the fleet's rate, relative).
    /// True during a burst.
    pub(crate) fn bursting(&self, now: u64) -> bool {
        now.checked_rem(self.bursts_ms).is_some_and(|at| at < 500)
    }

    /// Requests per second over the fleet at `now`.
    pub(crate) fn fleet_rate_at(&self, now: u64) -> f64 {
        if self.bursting(now) {
            self.fleet_rate * self.burst_factor
        } else {
            self.fleet_rate
        }
    }

    pub(crate) fn weight(&self, p: usize, now: u64) -> f64 {
        if self.shift_ms == 0 {
            return 1.0;
        }
        if (p as u64 + now / self.shift_ms) % 2 == 0 {
            4.0
        } else {
            1.0
        }
    }
}

/// What a run found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    pub requests: u64,
    pub admitted: u64,
    pub refused: u64,
    /// Decided by the failure mode (the service did not answer in time): not counted in the bound.
    pub fell_back: u64,
    /// Refused while the proxy's demand for the key was under its max-min share of the key's rate
    /// and the key had budget: one more admission would have kept the fleet within
    /// `burst + rate × t`.
    pub false_refusals: u64,
    /// Refused after waiting a whole timeout for a lease (counted in `refused`).
    pub timed_out: u64,
    /// The largest excess, over every key and admission, of what the fleet admitted over
    /// `burst + rate × t` (t since the key's first request; plus the stated slack per store
    /// loss): at most 0 when the bound holds.
    pub worst_excess: f64,
    pub keys_seen: usize,
    pub calls: u64,
    pub items: u64,
    pub calls_per_s: f64,
    pub items_per_s: f64,
    pub items_per_call: f64,
    /// After each shift of demand, how long until false refusals are back to what they were before
    /// it (at most twice the median per 100 ms of the second half of the phase before, or 2% of
    /// the requests), for half a second: the slowest shift.
    pub follow_ms: Option<u64>,
    /// Per 100 ms: requests, false refusals.
    pub bins: Vec<(u64, u64)>,
}
