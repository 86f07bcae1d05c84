//! The validated configuration the filter runs with: rules, their quotas and slot tables.

mod describe;
pub mod overload;

pub use describe::describe;

pub use super::json::PaceBody;
pub use super::syntax::{FailureMode, FirstLease, HeaderFormat, KeyPart, LogLevel, MissingKey};
use tollgate_core::calendar::CalendarUnit;
use tollgate_core::slot::KeyPlacement;
use tollgate_core::{Limit, SlotTable};

/// Slots per rule when `max_keys` is not given.
pub const DEFAULT_MAX_KEYS: u32 = 10_000;
/// Upper bound of `max_keys`: every slot is created when the configuration loads.
pub const MAX_MAX_KEYS: u32 = 1_000_000;
/// Tokens a worker may stash per key when `worker_batch` is not given (token buckets).
pub const DEFAULT_WORKER_BATCH: u64 = 8;
/// Upper bound of `quota_service.instances_hint`: more proxies than that share no limit usefully.
pub const MAX_INSTANCES_HINT: u64 = 1_000_000;
/// Upper bound of `worker_batch`: what may sit in stashes is part of the accuracy bound.
pub const MAX_WORKER_BATCH: u64 = 64;
/// How long a leaky bucket may hold a request when `max_delay` is not given.
pub const DEFAULT_MAX_DELAY_NS: u64 = 10_000_000_000;

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub rules: Vec<Rule>,
    pub response: Response,
    pub rate_limit_headers: HeaderFormat,
    /// How `client_ip` is found (`trusted_hops`) and keyed (prefix lengths).
    pub client_ip: crate::network::ClientIp,
    /// Required when a rule has `"scope": "global"`.
    pub quota_service: Option<QuotaService>,
    /// The filter's own log level: messages below it are never formatted.
    pub log_level: LogLevel,
    /// Levels of requests for overload rules.
    pub priorities: overload::Priorities,
    /// From `placement_secret`; `None`: the deployment's random one.
    pub placement: Option<KeyPlacement>,
    /// The most request-body bytes buffered for rules that read the body.
    pub max_request_body_bytes: usize,
    /// How long a request waits for its whole body (ns) before it is decided without it.
    pub request_body_timeout_ns: u64,
    /// The most body bytes all requests waiting for their bodies keep, per worker.
    pub max_waiting_body_bytes: usize,
    /// Some rule reads the request's body (a cost from its fields, a `body:` key part).
    pub reads_request_body: bool,
    /// The status path, if configured.
    pub status: Option<Status>,
}

/// The most bytes of a key the status path shows (`status.max_key_bytes`).
pub const MOST_STATUS_KEY_BYTES: usize = 128;

/// The status path (`status`): who may read it and how keys are shown.
#[derive(Debug, Clone, PartialEq)]
pub struct Status {
    pub path: String,
    pub allow: Vec<crate::network::Network>,
    pub token: Option<String>,
    pub hashed: bool,
    pub max_key_bytes: usize,
    /// Log the keys each rule refused most this often (ms); 0: never.
    pub log_every_ms: u64,
}

/// Where global rules get their quota.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaService {
    /// An Envoy cluster name, or `host:port` on nginx.
    pub upstream: String,
    pub authority: String,
    pub timeout_ms: u64,
    pub token: Option<String>,
    pub failure_mode: FailureMode,
    /// How many proxies share the global limits (for `failure_mode: local` and provisional quota).
    pub instances_hint: u64,
    /// A key with no quota yet: wait for its first lease, or spend a provisional local allowance.
    pub first_lease: FirstLease,
    /// After a failed call, how long keys apply the failure mode before asking again.
    pub retry_ms: u64,
    /// One call per request (the request waits for it) instead of leased allowances.
    pub strict: bool,
    /// The key of the keyed hash that names client keys at the service (from `key_secret`);
    /// none: the plain key hash, the same in every deployment.
    pub key_secret: Option<[u8; 16]>,
}

/// A calendar quota's period: a day, a week or a month in a time zone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Calendar {
    pub unit: CalendarUnit,
    /// An IANA name (checked against [`tollgate_core::calendar::TIME_ZONES`]).
    pub time_zone: String,
}

/// What a global rule sends the quota service, and its local stand-in.
#[derive(Debug, Clone, PartialEq)]
pub struct GlobalRule {
    pub requests: u64,
    pub per_ms: u64,
    pub burst: u64,
    /// Fingerprint of the limit: different configurations never share global state.
    pub limit_id: String,
    /// A calendar quota: `requests` per calendar period, counted by the quota service.
    pub calendar: Option<Calendar>,
    /// The rule at `limit / instances_hint`, used by `failure_mode: local` and provisional quota.
    pub fallback: Quota,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    pub name: String,
    pub matcher: Match,
    pub key: Vec<KeyPart>,
    pub missing_key: MissingKey,
    /// What a `body:` part of a body that cannot be read is: one "unreadable" value (`Limit`), or
    /// absent (`Skip`: then `missing_key` decides).
    pub unreadable_body: MissingKey,
    /// What the rule limits, and where its state lives.
    pub kind: RuleKind,
    pub cost: Cost,
    /// Specific keys (encoded like request keys) with their own treatment.
    pub overrides: Vec<Override>,
    /// The rule's own refusal response, else the top-level one.
    pub response: Option<Response>,
    /// The rule's own `dry_run` or the top-level one.
    pub dry_run: bool,
    /// Token buckets (and global rules' leased allowance): most tokens a worker stashes at once
    /// per key (0: none).
    pub worker_batch: u64,
    /// `worker_batch` is the default, not given: hosts that cannot hold a request stash nothing
    /// ([`Config::fit_host`]).
    pub worker_batch_by_default: bool,
    /// A cost known only after the response: `cost` is the reservation, settled then.
    pub settle: Option<Settle>,
    /// Each key's own `limit.requests`, from the request (a tenant's plan).
    pub limit_from: Option<LimitFrom>,
}

/// What a byte limit paces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pace {
    pub body: PaceBody,
    /// Bytes of each body passed on before pacing starts.
    pub after: u64,
}

/// Where a key's own limit comes from, and the most it may be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitFrom {
    /// A `KeyPart::Header` or `KeyPart::Metadata`: where the number is read.
    pub source: KeyPart,
    pub max: u64,
}

/// Where a rule's cost known after the response comes from.
#[derive(Debug, Clone, PartialEq)]
pub struct Settle {
    pub from: SettleFrom,
    /// Body bytes kept at most to read a usage: a JSON body, or one event of a stream.
    pub max_body_bytes: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub enum SettleFrom {
    /// The reservation if the status is one of these, else nothing.
    Statuses(overload::StatusSet),
    /// A response header's whole number.
    Header(String),
    /// The response body's bytes.
    BodyBytes,
    /// The usage an LLM API reports.
    Usage(UsageCost),
    /// A whole number at this path of the JSON body (or of a stream's last event that has it).
    BodyField(Vec<String>),
}

/// What of a reported usage is the cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageCost {
    /// The total reported (else input and output added).
    Total,
    /// Thousandths of a token per input and per output token.
    Weighted { input_milli: u64, output_milli: u64 },
}

impl UsageCost {
    /// The cost of `usage`, if it reported what this counts.
    pub fn of(&self, usage: &crate::usage::Usage) -> Option<u64> {
        match *self {
            Self::Total => usage.total(),
            Self::Weighted {
                input_milli,
                output_milli,
            } => {
                let (i, o) = (usage.input, usage.output);
                if (i.is_none() || input_milli == 0) && (o.is_none() || output_milli == 0) {
                    return None;
                }
                let milli = u128::from(i.unwrap_or(0)) * u128::from(input_milli)
                    + u128::from(o.unwrap_or(0)) * u128::from(output_milli);
                Some(u64::try_from(milli.div_ceil(1_000)).unwrap_or(u64::MAX))
            }
        }
    }
}

/// A rule's kind: one per place its state lives, so that no rule is two at once.
#[derive(Debug, Clone, PartialEq)]
pub enum RuleKind {
    /// A limit kept in this proxy's shared data.
    Local(Quota),
    /// A byte limit: bytes of bodies per key, kept in this proxy's shared data, paced (it never
    /// refuses a request).
    Bytes(Quota, Pace),
    /// `"scope": "global"`: the quota is the allowance (or permits) leased from the quota
    /// service, in this proxy's slots; the global rule is what the service is asked for.
    Global(Quota, Box<GlobalRule>),
    /// An overload rule (adaptive, sre_throttle): windows, not slots.
    Overload(Box<overload::Guard>),
}

impl Rule {
    /// The rule reads the request's body: a cost from its fields, or a `body:` key part.
    pub fn reads_request_body(&self) -> bool {
        matches!(self.cost, Cost::Body { .. })
            || self.key.iter().any(|p| matches!(p, KeyPart::Body(_)))
    }

    /// The rule's own quota (none for overload rules).
    pub fn quota(&self) -> Option<&Quota> {
        match &self.kind {
            RuleKind::Local(q) | RuleKind::Bytes(q, _) | RuleKind::Global(q, _) => Some(q),
            RuleKind::Overload(_) => None,
        }
    }

    /// A byte limit's pacing (none for other rules).
    pub fn pace(&self) -> Option<Pace> {
        match &self.kind {
            RuleKind::Bytes(_, p) => Some(*p),
            _ => None,
        }
    }

    /// What a global rule asks the quota service for.
    pub fn global(&self) -> Option<&GlobalRule> {
        match &self.kind {
            RuleKind::Global(_, g) => Some(g),
            _ => None,
        }
    }

    /// An overload rule's settings.
    pub fn guard(&self) -> Option<&overload::Guard> {
        match &self.kind {
            RuleKind::Overload(g) => Some(g),
            _ => None,
        }
    }
}

/// A limit with the slots that hold its state and how headers state it.
#[derive(Debug, Clone, PartialEq)]
pub struct Quota {
    pub limit: Limit,
    pub table: SlotTable,
    /// `RateLimit-Policy` quota `q` and window `w` seconds (none for concurrency).
    pub policy: (u64, Option<u64>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    /// The key bytes it is for; with `networks`, their values for the other parts.
    pub key: Vec<u8>,
    /// `client_ip` parts given as a range wider than one key: (part index, range).
    pub networks: Vec<(usize, crate::network::Network)>,
    pub action: OverrideAction,
}

impl Override {
    /// True if a request's bucket key is this override's: equal bytes, or with ranges, each
    /// range part inside its range and every other part equal.
    pub fn matches(&self, key: &[u8]) -> bool {
        if self.networks.is_empty() {
            return self.key[..] == key[..];
        }
        let mut mine = crate::key::parts(&self.key);
        let mut theirs = crate::key::parts(key);
        let mut index = 0;
        loop {
            match (mine.next(), theirs.next()) {
                (None, None) => return true,
                (Some(a), Some(b)) => {
                    let ok = match self.networks.iter().find(|(i, _)| *i == index) {
                        Some((_, network)) => b.is_some_and(|b| network.contains_key(b)),
                        None => a == b,
                    };
                    if !ok {
                        return false;
                    }
                }
                _ => return false,
            }
            index += 1;
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum OverrideAction {
    /// This key gets its own limit (and its own slot: no sharing).
    Limit(Quota),
    /// The rule does not apply to this key.
    Unlimited,
    /// Every request of this key is refused by this rule.
    Block,
}

/// Tokens a request takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cost {
    Fixed(u64),
    /// From a request header: absent or not a whole number → `default`; else the number kept
    /// within `min..=max`.
    Header {
        name: String,
        default: u64,
        min: u64,
        max: u64,
    },
    /// From fields of the request's JSON body: the largest whole number among `fields`, else
    /// `default`, plus the body's bytes / `input_bytes_per_token` (rounded up), kept within
    /// `min..=max`; a body larger than the configuration's `max_request_body_bytes` costs `max`.
    Body {
        fields: Vec<Vec<String>>,
        input_bytes_per_token: Option<u64>,
        default: u64,
        min: u64,
        max: u64,
    },
}

impl Cost {
    /// The most a request can cost.
    pub fn most(&self) -> u64 {
        match self {
            Self::Fixed(n) => *n,
            Self::Header { max, .. } | Self::Body { max, .. } => *max,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Match {
    pub path: Option<PathMatch>,
    /// Upper-case.
    pub methods: Vec<String>,
    /// Lower-case, without port.
    pub hosts: Vec<String>,
    /// Lower-case names, exact values.
    pub headers: Vec<(String, String)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathMatch {
    Exact(String),
    Prefix(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u32,
    pub body: String,
    /// Lower-case names.
    pub headers: Vec<(String, String)>,
}

impl Config {
    /// Every quota with its rule: each rule's own, then its overrides' limits.
    pub fn quotas(&self) -> impl Iterator<Item = (&Rule, &Quota)> {
        self.rules
            .iter()
            .flat_map(|rule| rule.quotas().map(move |q| (rule, q)))
    }

    /// Windows in shared data over all overload rules (one per key, up to `max_keys`).
    pub fn windows(&self) -> u64 {
        let guards = self.rules.iter().filter_map(Rule::guard);
        guards.map(|g| u64::from(g.table.groups())).sum()
    }

    /// Slots in shared data over all rules (their own, overrides' and global rules' stand-ins).
    pub fn slots(&self) -> u64 {
        let stand_ins = self.rules.iter().filter_map(Rule::global);
        self.quotas().map(|(_, q)| q.table.capacity()).sum::<u64>()
            + stand_ins.map(|g| g.fallback.table.capacity()).sum::<u64>()
    }

    /// The refusal a rule answers with: its own, else the top-level one.
    pub fn response_of(&self, rule: usize) -> &Response {
        self.rules
            .get(rule)
            .and_then(|r| r.response.as_ref())
            .unwrap_or(&self.response)
    }
}

impl Rule {
    /// The rule's own quota, then its overrides' limits.
    pub fn quotas(&self) -> impl Iterator<Item = &Quota> {
        let own = self.quota();
        own.into_iter()
            .chain(self.overrides.iter().filter_map(|o| match &o.action {
                OverrideAction::Limit(q) => Some(q),
                _ => None,
            }))
    }

    /// True if an admitted request holds this rule's quota until it ends (concurrency).
    pub fn holds_requests_open(&self) -> bool {
        self.quotas().any(|q| q.limit.is_held())
    }

    /// True if this rule may hold a request before passing it on (a leaky bucket that delays).
    pub fn delays(&self) -> bool {
        self.quotas()
            .any(|q| matches!(q.limit, Limit::LeakyBucket(l) if l.delay() != u64::MAX))
    }
}

impl Quota {
    /// The limit for a key with its own `requests` (`limit_from`): a token bucket of that rate,
    /// its burst scaled alike (at least 1); otherwise the quota's.
    pub fn limit_for(&self, own_requests: Option<u64>) -> Limit {
        match (self.limit, own_requests) {
            (Limit::TokenBucket(tb), Some(n)) => {
                let scaled = u128::from(tb.burst()) * u128::from(n) / u128::from(tb.requests());
                let burst = u64::try_from(scaled).unwrap_or(u64::MAX).max(1);
                tollgate_core::TokenBucket::new(n, tb.period_ns(), burst)
                    .map_or(self.limit, Limit::TokenBucket)
            }
            (limit, _) => limit,
        }
    }

    /// `owner` names the slots (a rule, or a rule's override); the name carries the limit's
    /// parameters: a reload that keeps them keeps the state, one that changes them starts fresh.
    pub fn new(limit: Limit, owner: &str, max_keys: u32) -> Self {
        let fingerprint =
            tollgate_core::slot::fingerprint(format!("{limit:?}/{max_keys}").as_bytes());
        let table = SlotTable::new(format!("tollgate.{owner}.{fingerprint:016x}."), max_keys);
        Self {
            policy: policy(&limit),
            limit,
            table,
        }
    }
}

/// The policy as quota `q` per window `w` seconds, true of the configured rate and never zero: a
/// period of whole seconds as it is; otherwise the shortest whole number of seconds that holds a
/// whole number of periods ("1 per 1500ms" is `q=2;w=3`), or where that would be over an hour,
/// the period rounded up to whole seconds and `q` rounded down (never promising more).
fn policy(limit: &Limit) -> (u64, Option<u64>) {
    let (requests, period_ns) = match limit {
        Limit::TokenBucket(a) => (a.requests(), a.period_ns()),
        Limit::WarmUp(a) => (a.requests(), a.period_ns()),
        Limit::FixedWindow(a) => (a.limit(), a.period_ns()),
        Limit::SlidingWindow(a) => (a.limit(), a.period_ns()),
        Limit::LeakyBucket(a) => (a.requests(), a.period_ns()),
        Limit::Concurrency(a) => return (a.limit(), None),
        Limit::Lease(a) => return (a.lease_size, None),
        Limit::PermitLease(a) => return (a.concurrent, None),
    };
    let (q, w) = policy_of_rate(requests, period_ns);
    (q, Some(w))
}

/// `requests` per `period_ns` as a quota per whole seconds (see [`policy`]).
pub fn policy_of_rate(requests: u64, period_ns: u64) -> (u64, u64) {
    const NS_PER_SEC: u64 = 1_000_000_000;
    const LONGEST_EXACT_SECS: u64 = 3_600;
    let gcd = {
        let (mut a, mut b) = (period_ns.max(1), NS_PER_SEC);
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let exact_w = period_ns.max(1) / gcd;
    let exact_q = requests.checked_mul(NS_PER_SEC / gcd);
    match exact_q {
        Some(q) if exact_w <= LONGEST_EXACT_SECS || period_ns % NS_PER_SEC == 0 => (q, exact_w),
        _ => {
            let w = period_ns.div_ceil(NS_PER_SEC).max(1);
            let q = u128::from(requests) * u128::from(w) * u128::from(NS_PER_SEC)
                / u128::from(period_ns.max(1));
            (u64::try_from(q).unwrap_or(u64::MAX).max(1), w)
        }
    }
}
