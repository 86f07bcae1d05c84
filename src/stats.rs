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
    /// Gauge, concurrency and adaptive rules: requests in flight (weighted by cost).
    InFlight,
    /// Global concurrency rules: slots held from the quota service, as last answered.
    SlotsHeld,
    /// Rules that settle after the response: tokens reserved by admitted requests, the tokens
    /// their responses said they cost, the unused tokens refunded, and the excess charged
    /// beyond reservations, and the part of it the bucket did not have (debt).
    Reserved,
    Settled,
    Refunded,
    Charged,
    Debt,
    /// Byte limits: bytes charged to keys' byte buckets, and the time bodies were held (ms).
    PacedBytes,
    HeldMs,
    /// Overload rules: admitted and shed requests per priority level.
    Level0Allowed,
    Level1Allowed,
    Level2Allowed,
    Level3Allowed,
    Level0Shed,
    Level1Shed,
    Level2Shed,
    Level3Shed,
    /// Adaptive rules: the estimated capacity and the signal (thousandths), as last seen.
    Estimate,
    Signal,
}

impl RuleStat {
    pub const ALL: [Self; 33] = [
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
        Self::SlotsHeld,
        Self::Reserved,
        Self::Settled,
        Self::Refunded,
        Self::Charged,
        Self::Debt,
        Self::PacedBytes,
        Self::HeldMs,
        Self::Level0Allowed,
        Self::Level1Allowed,
        Self::Level2Allowed,
        Self::Level3Allowed,
        Self::Level0Shed,
        Self::Level1Shed,
        Self::Level2Shed,
        Self::Level3Shed,
        Self::Estimate,
        Self::Signal,
    ];

    /// Admitted (`shed` false) or shed requests of a priority level.
    pub fn of_level(level: u8, shed: bool) -> Self {
        const ALLOWED: [RuleStat; 4] = [
            RuleStat::Level0Allowed,
            RuleStat::Level1Allowed,
            RuleStat::Level2Allowed,
            RuleStat::Level3Allowed,
        ];
        const SHED: [RuleStat; 4] = [
            RuleStat::Level0Shed,
            RuleStat::Level1Shed,
            RuleStat::Level2Shed,
            RuleStat::Level3Shed,
        ];
        let i = usize::from(level).min(3);
        if shed {
            SHED[i]
        } else {
            ALLOWED[i]
        }
    }

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
            Self::SlotsHeld => "slots_held",
            Self::Reserved => "reserved",
            Self::Settled => "settled",
            Self::Refunded => "refunded",
            Self::Charged => "charged",
            Self::Debt => "debt",
            Self::PacedBytes => "paced_bytes",
            Self::HeldMs => "held_ms",
            Self::Level0Allowed => "level_0_allowed",
            Self::Level1Allowed => "level_1_allowed",
            Self::Level2Allowed => "level_2_allowed",
            Self::Level3Allowed => "level_3_allowed",
            Self::Level0Shed => "level_0_shed",
            Self::Level1Shed => "level_1_shed",
            Self::Level2Shed => "level_2_shed",
            Self::Level3Shed => "level_3_shed",
            Self::Estimate => "estimate",
            Self::Signal => "signal",
        }
    }

    pub fn is_gauge(self) -> bool {
        matches!(
            self,
            Self::InFlight | Self::SlotsHeld | Self::Estimate | Self::Signal
        )
    }

    /// Gauges whose values are absolute (set, not changed by deltas).
    pub fn is_absolute(self) -> bool {
        matches!(self, Self::SlotsHeld | Self::Estimate | Self::Signal)
    }

    /// Stats only rules that settle after the response have.
    pub fn is_settle(self) -> bool {
        matches!(
            self,
            Self::Reserved | Self::Settled | Self::Refunded | Self::Charged | Self::Debt
        )
    }

    /// Stats only overload rules have.
    pub fn is_overload(self) -> bool {
        self as usize >= Self::Level0Allowed as usize
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
    /// Gauge: bodies held by byte limits now.
    BodiesHeld,
    /// Requests decided without reading their body: longer than `max_request_body_bytes`,
    /// stalled, past `request_body_timeout`, beyond the worker's `max_waiting_body_bytes`, or
    /// ended by trailers.
    BodiesUnread,
    /// Gauge: bytes kept by request bodies waiting for their decision now.
    BodyBytesKept,
}

impl ProcessStat {
    pub const ALL: [Self; 10] = [
        Self::QueueHeld,
        Self::ReleaseErrors,
        Self::QuotaCalls,
        Self::QuotaFailures,
        Self::QuotaGranted,
        Self::QuotaWaiting,
        Self::StashHeld,
        Self::BodiesHeld,
        Self::BodiesUnread,
        Self::BodyBytesKept,
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
            Self::BodiesHeld => "tollgate.bodies.held",
            Self::BodiesUnread => "tollgate.bodies.unread",
            Self::BodyBytesKept => "tollgate.bodies.kept_bytes",
        }
    }

    pub fn is_gauge(self) -> bool {
        matches!(
            self,
            Self::QueueHeld
                | Self::QuotaWaiting
                | Self::StashHeld
                | Self::BodiesHeld
                | Self::BodyBytesKept
        )
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
/// A value of an absolute gauge not set since the last hand-over.
const UNSET: i64 = i64::MIN;

#[derive(Debug, Clone)]
pub struct Stats {
    rules: Vec<[i64; RULE_STATS]>,
    process: [i64; PROCESS_STATS],
}

impl Stats {
    pub fn new(rules: usize) -> Self {
        let mut row = [0; RULE_STATS];
        for stat in RuleStat::ALL.into_iter().filter(|s| s.is_absolute()) {
            row[stat as usize] = UNSET;
        }
        Self {
            rules: vec![row; rules],
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

    /// Set an absolute gauge.
    pub fn set(&mut self, rule: usize, stat: RuleStat, value: u64) {
        if let Some(row) = self.rules.get_mut(rule) {
            row[stat as usize] = i64::try_from(value).unwrap_or(i64::MAX);
        }
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
                let unchanged = if stat.is_absolute() { UNSET } else { 0 };
                let v = std::mem::replace(&mut row[stat as usize], unchanged);
                if v != unchanged {
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
        s.set(0, RuleStat::Estimate, 0);
        assert_eq!(s.pending(Stat::Rule(1, RuleStat::InFlight)), 2);
        let mut seen = Vec::new();
        s.drain(|stat, v| seen.push((stat, v)));
        assert_eq!(
            seen,
            [
                (Stat::Rule(0, RuleStat::Estimate), 0),
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
