//! The filter's stats: counted per worker in plain memory (a request makes no host call for them)
//! and handed to the host on the tick.

/// A per-rule stat (`tollgate.rule.<name>.<stat>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleStat {
    Allowed,
    Limited,
    Delayed,
    DryRunLimited,
    Blocked,
    /// Requests refused because they cost more than the rule can ever admit.
    CostExceeded,
    SlotTakenOver,
    /// A new key evicted the key closest to fresh (every slot of its group was active).
    SlotEvicted,
    /// Concurrency: a new key shares a slot with requests in flight.
    SlotShared,
    Contended,
    StoreErrors,
    /// Global rules: requests decided by the failure mode or provisional quota.
    Fallback,
    /// Global rules: requests that waited for quota.
    Waited,
    /// Token buckets: stashed tokens a worker did not spend in time and gave back.
    StashReturned,
    /// Gauge, concurrency rules: requests in flight, weighted by cost.
    InFlight,
}

impl RuleStat {
    pub const ALL: [Self; 15] = [
        Self::Allowed,
        Self::Limited,
        Self::Delayed,
        Self::DryRunLimited,
        Self::Blocked,
        Self::CostExceeded,
        Self::SlotTakenOver,
        Self::SlotEvicted,
        Self::SlotShared,
        Self::Contended,
        Self::StoreErrors,
        Self::Fallback,
        Self::Waited,
        Self::StashReturned,
        Self::InFlight,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Allowed => "allowed",
            Self::Limited => "limited",
            Self::Delayed => "delayed",
            Self::DryRunLimited => "dry_run_limited",
            Self::Blocked => "blocked",
            Self::CostExceeded => "cost_exceeded",
            Self::SlotTakenOver => "slot_taken_over",
            Self::SlotEvicted => "slot_evicted",
            Self::SlotShared => "slot_shared",
            Self::Contended => "contended",
            Self::StoreErrors => "store_errors",
            Self::Fallback => "fallback",
            Self::Waited => "waited",
            Self::StashReturned => "stash_returned",
            Self::InFlight => "in_flight",
        }
    }

    pub fn is_gauge(self) -> bool {
        self == Self::InFlight
    }
}

/// A process-wide stat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessStat {
    /// Gauge: requests held by leaky buckets now.
    QueueHeld,
    ReleaseErrors,
    QuotaCalls,
    QuotaFailures,
    /// Tokens granted by the quota service.
    QuotaGranted,
    /// Gauge: requests waiting for global quota now.
    QuotaWaiting,
    /// Gauge: tokens in worker stashes.
    StashHeld,
}

impl ProcessStat {
    pub const ALL: [Self; 7] = [
        Self::QueueHeld,
        Self::ReleaseErrors,
        Self::QuotaCalls,
        Self::QuotaFailures,
        Self::QuotaGranted,
        Self::QuotaWaiting,
        Self::StashHeld,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::QueueHeld => "tollgate.queue.held",
            Self::ReleaseErrors => "tollgate.release_errors",
            Self::QuotaCalls => "tollgate.quota.calls",
            Self::QuotaFailures => "tollgate.quota.failures",
            Self::QuotaGranted => "tollgate.quota.granted",
            Self::QuotaWaiting => "tollgate.quota.waiting",
            Self::StashHeld => "tollgate.stash.held",
        }
    }

    pub fn is_gauge(self) -> bool {
        matches!(self, Self::QueueHeld | Self::QuotaWaiting | Self::StashHeld)
    }
}

/// Either kind of stat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stat {
    Rule(usize, RuleStat),
    Process(ProcessStat),
}

impl Stat {
    pub fn is_gauge(self) -> bool {
        match self {
            Self::Rule(_, s) => s.is_gauge(),
            Self::Process(s) => s.is_gauge(),
        }
    }
}

const RULE_STATS: usize = RuleStat::ALL.len();
const PROCESS_STATS: usize = ProcessStat::ALL.len();

/// Changes since the last hand-over: counters' increments and gauges' deltas.
#[derive(Debug, Clone)]
pub struct Stats {
    rules: Vec<[i64; RULE_STATS]>,
    process: [i64; PROCESS_STATS],
}

impl Stats {
    pub fn new(rules: usize) -> Self {
        Self {
            rules: vec![[0; RULE_STATS]; rules],
            process: [0; PROCESS_STATS],
        }
    }

    pub fn add(&mut self, rule: usize, stat: RuleStat, n: i64) {
        if let Some(row) = self.rules.get_mut(rule) {
            let v = &mut row[stat as usize];
            *v = v.saturating_add(n);
        }
    }

    pub fn bump(&mut self, rule: usize, stat: RuleStat) {
        self.add(rule, stat, 1);
    }

    pub fn add_process(&mut self, stat: ProcessStat, n: i64) {
        let v = &mut self.process[stat as usize];
        *v = v.saturating_add(n);
    }

    /// The change pending for one stat.
    pub fn pending(&self, stat: Stat) -> i64 {
        match stat {
            Stat::Rule(rule, s) => self.rules.get(rule).map_or(0, |row| row[s as usize]),
            Stat::Process(s) => self.process[s as usize],
        }
    }

    /// Hand every non-zero change to `f` and start again from zero.
    pub fn drain(&mut self, mut f: impl FnMut(Stat, i64)) {
        for (rule, row) in self.rules.iter_mut().enumerate() {
            for stat in RuleStat::ALL {
                let v = std::mem::take(&mut row[stat as usize]);
                if v != 0 {
                    f(Stat::Rule(rule, stat), v);
                }
            }
        }
        for stat in ProcessStat::ALL {
            let v = std::mem::take(&mut self.process[stat as usize]);
            if v != 0 {
                f(Stat::Process(stat), v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_are_handed_over_once() {
        let mut s = Stats::new(2);
        s.bump(1, RuleStat::Limited);
        s.add(1, RuleStat::InFlight, 3);
        s.add(1, RuleStat::InFlight, -1);
        s.add_process(ProcessStat::QuotaCalls, 2);
        s.bump(7, RuleStat::Allowed); // no such rule: ignored
        assert_eq!(s.pending(Stat::Rule(1, RuleStat::InFlight)), 2);
        let mut seen = Vec::new();
        s.drain(|stat, v| seen.push((stat, v)));
        assert_eq!(
            seen,
            [
                (Stat::Rule(1, RuleStat::Limited), 1),
                (Stat::Rule(1, RuleStat::InFlight), 2),
                (Stat::Process(ProcessStat::QuotaCalls), 2)
            ]
        );
        s.drain(|_, _| panic!("nothing left"));
        for (i, stat) in RuleStat::ALL.into_iter().enumerate() {
            assert_eq!(stat as usize, i);
        }
        for (i, stat) in ProcessStat::ALL.into_iter().enumerate() {
            assert_eq!(stat as usize, i);
        }
    }
}
