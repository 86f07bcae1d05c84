//! A key's allowance as its 32 bytes of state hold it: the parts, their flags and units, and
//! what they say at a time (what is held, accrued, owed).

use crate::state::{read_u32, saturating_u32, write_u32, State, CLOCK_SKEW_MS, STATE_BYTES};

pub(super) const EXHAUSTED: u32 = 1 << 31;
pub(super) const FAILED: u32 = 1 << 30;
/// Mark offsets are kept below this (12 days): a longer wait asks again sooner, never later.
pub(super) const MARK_MAX: u64 = (1 << 30) - 1;
pub(super) const RAN_DRY: u32 = 1 << 31;
pub(super) const CAPPED: u32 = 1 << 30;
/// The last answer granted nothing.
pub(super) const DENIED: u32 = 1 << 29;
/// The service answered for this key at `base` (with the bucket's `reported` tokens then).
pub(super) const ANSWERED: u32 = 1 << 28;
/// The last call failed: the failure mode decides, also while the next call is out.
pub(super) const FAILING: u32 = 1 << 27;
/// The rate no longer accrues (a call failed: the service may have replaced the reservation),
/// though the lease still says what it was, for the next call's evidence.
pub(super) const FROZEN: u32 = 1 << 26;
/// `spent` starts with a second's worth of what the lease before measured (a token lease topped
/// up): the demand is measured over a second more than the lease has run.
pub(super) const CARRIED: u32 = 1 << 25;
/// A request did not fit in what the lease held: it waits for the refill claimed with it.
pub(super) const WAITING: u32 = 1 << 24;
pub(super) const FLAGS: u32 =
    RAN_DRY | CAPPED | DENIED | ANSWERED | FAILING | FROZEN | CARRIED | WAITING;
pub(super) const SPENT: u32 = WAITING - 1;
/// Demand is measured over at least this long (ms).
pub(super) const MEASURE_FLOOR_MS: u64 = 250;
/// What a token lease measured of its demand is carried over to the next as this long's worth
/// (ms).
pub(super) const MEASURE_MEMORY_MS: u64 = 1_000;
/// Granted tokens are kept in these parts of a token.
pub(super) const UNIT: u64 = 64;
/// The balance is kept in 48 bits: at most this many [`UNIT`]s either way (2.2 × 10¹² tokens,
/// beyond the most a debt counts, [`crate::global::lease::MAX_DEBT`]).
pub(super) const BALANCE_MAX: i64 = (1 << 47) - 1;
/// Times are kept in 48 bits of ms (until the year 10889).
pub(super) const TIME_MAX: u64 = (1 << 48) - 1;

#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Parts {
    /// Granted and carried over, less spent, in [`UNIT`]s of a token; below zero: owed.
    pub(super) balance: i64,
    /// Tokens spent since the grant (what the next call reports).
    pub(super) spent: u64,
    pub(super) flags: u32,
    /// The global bucket's tokens by the last answer; below zero: what it owed.
    pub(super) reported: i64,
    pub(super) rate: u64,
    pub(super) base: u64,
    /// Absolute ms.
    pub(super) until: u64,
    /// Absolute ms; 0: none.
    pub(super) mark: u64,
    pub(super) mark_flags: u32,
}

pub(super) fn read_i48(s: &State, at: usize) -> i64 {
    let mut b = [0; 8];
    b[..6].copy_from_slice(&s[at..at + 6]);
    // Into the top 48 bits and back: the sign comes along.
    (i64::from_le_bytes(b) << 16) >> 16
}

pub(super) fn write_i48(s: &mut State, at: usize, v: i64) {
    let v = v.clamp(-BALANCE_MAX - 1, BALANCE_MAX);
    s[at..at + 6].copy_from_slice(&v.to_le_bytes()[..6]);
}

pub(super) fn read_u48(s: &State, at: usize) -> u64 {
    let mut b = [0; 8];
    b[..6].copy_from_slice(&s[at..at + 6]);
    u64::from_le_bytes(b)
}

pub(super) fn write_u48(s: &mut State, at: usize, v: u64) {
    s[at..at + 6].copy_from_slice(&v.min(TIME_MAX).to_le_bytes()[..6]);
}

pub(super) fn parts(state: &State) -> Parts {
    let spent = read_u32(state, 12);
    let base = read_u48(state, 6);
    let mark = read_u32(state, 28);
    let mark_at = u64::from(mark & !(EXHAUSTED | FAILED));
    Parts {
        balance: read_i48(state, 0),
        spent: u64::from(spent & SPENT),
        flags: spent & FLAGS,
        reported: i64::from(read_u32(state, 16) as i32),
        rate: u64::from(read_u32(state, 20)),
        base,
        until: base + u64::from(read_u32(state, 24)),
        mark: if mark_at == 0 { 0 } else { base + mark_at },
        mark_flags: mark & (EXHAUSTED | FAILED),
    }
}

pub(super) fn encode(p: &Parts) -> State {
    let mut s = [0; STATE_BYTES];
    write_i48(&mut s, 0, p.balance);
    write_u48(&mut s, 6, p.base);
    write_u32(
        &mut s,
        12,
        saturating_u32(p.spent.min(u64::from(SPENT))) | p.flags,
    );
    let reported = p.reported.clamp(i64::from(i32::MIN), i64::from(i32::MAX)) as i32;
    write_u32(&mut s, 16, reported as u32);
    write_u32(&mut s, 20, saturating_u32(p.rate));
    write_u32(&mut s, 24, saturating_u32(p.until.saturating_sub(p.base)));
    let mark = if p.mark == 0 {
        0
    } else {
        p.mark.saturating_sub(p.base).clamp(1, MARK_MAX) as u32 | p.mark_flags
    };
    write_u32(&mut s, 28, mark);
    s
}

/// `tokens` in [`UNIT`]s, saturating.
pub(super) fn units(tokens: u64) -> i64 {
    i64::try_from(u128::from(tokens) * u128::from(UNIT)).unwrap_or(i64::MAX)
}

impl Parts {
    /// The state as read at `now_ms`: answered further ahead than clocks differ, the clock stepped
    /// back. Then the lease is not trusted (it ends now, its unspent tokens are given up:
    /// stricter, never looser) and no mark holds: the next request claims a refill at once,
    /// instead of every request waiting (or applying a failure mode) until the clock catches up.
    pub(super) fn unstepped(mut self, now_ms: u64) -> Self {
        if self.base > now_ms.saturating_add(CLOCK_SKEW_MS) {
            self.base = now_ms;
            self.until = now_ms;
            self.balance = self.balance.min(0);
            self.mark = 0;
            self.mark_flags = 0;
        }
        self
    }

    pub(super) fn live(&self, now_ms: u64) -> bool {
        now_ms < self.until
    }

    /// How long `spent` was spent over at `now_ms` (ms, at least 1).
    pub(super) fn measured_ms(&self, now_ms: u64) -> u64 {
        let ran = now_ms.saturating_sub(self.base);
        if self.flags & CARRIED != 0 {
            ran.saturating_add(MEASURE_MEMORY_MS)
        } else {
            ran.max(1)
        }
    }

    /// What `spent` says of a rate when a request ends the measure: the requests in it, less
    /// one. A measure ends at a request — the one that spent the last token, or one that waits
    /// for more (counted) — and of a Poisson stream stopped at its k-th request, (k − 1) / t is
    /// the unbiased rate. Counting the last one as well reads a single request soon after a
    /// grant as a high rate: in a fleet where each proxy sees a key rarely, every such proxy
    /// then asked for (and was reserved) the key's whole rate for a lease term.
    pub(super) fn requests_before_last(&self) -> u64 {
        if self.flags & WAITING != 0 {
            self.spent
        } else {
            self.spent.saturating_sub(1)
        }
    }

    /// A rate share accrues (none after a failed call: see [`FROZEN`]).
    pub(super) fn accruing(&self) -> bool {
        self.rate > 0 && self.flags & FROZEN == 0
    }

    /// A refill is claimed (whether or not its claim has expired): accrual stops at the claim,
    /// since the service replaces this lease's reservation when the call arrives.
    pub(super) fn claim_at(&self, claim_ms: u64) -> Option<u64> {
        (self.mark != 0 && self.mark_flags == 0).then(|| self.mark.saturating_sub(claim_ms))
    }

    /// Where accrual ends at `now_ms`: now, or the claim of a refill if one was made.
    pub(super) fn accrual_end(&self, now_ms: u64, claim_ms: u64) -> u64 {
        self.claim_at(claim_ms).map_or(now_ms, |c| c.min(now_ms))
    }

    /// What accrued from the rate until `end` (never past the lease's end), in [`UNIT`]s.
    pub(super) fn accrued(&self, end_ms: u64) -> i64 {
        if self.flags & FROZEN != 0 {
            return 0;
        }
        let ms = end_ms.min(self.until).saturating_sub(self.base);
        let units = u128::from(self.rate) * u128::from(ms) * u128::from(UNIT) / 1_000_000;
        i64::try_from(units).unwrap_or(i64::MAX)
    }

    /// The balance with what accrued until `end`, in [`UNIT`]s: below 0 when a settlement
    /// charged more than the lease held (debt, to be charged to the global bucket).
    pub(super) fn balance_units(&self, end_ms: u64) -> i64 {
        self.balance.saturating_add(self.accrued(end_ms))
    }

    /// Whole tokens owed: spent beyond what the lease held until `end`.
    pub(super) fn owed(&self, end_ms: u64) -> u64 {
        let units = self.balance_units(end_ms).min(0).unsigned_abs();
        units.div_ceil(UNIT)
    }

    /// Whole tokens that may be spent now.
    pub(super) fn available(&self, now_ms: u64, claim_ms: u64) -> u64 {
        if !self.live(now_ms) {
            return 0;
        }
        let held = self
            .balance_units(self.accrual_end(now_ms, claim_ms))
            .max(0);
        held.unsigned_abs() / UNIT
    }

    /// Write a mark at `mark` (absolute ms); a key without a live lease starts afresh (keeping
    /// what it owes), with the time of its last answer as `base` while offsets from it stay
    /// small.
    pub(super) fn marked(mut self, now_ms: u64, mark: u64, flags: u32) -> Self {
        if !self.live(now_ms) {
            let recent =
                self.flags & ANSWERED != 0 && now_ms.saturating_sub(self.base) < MARK_MAX / 2;
            let kept = if recent { ANSWERED } else { 0 };
            self = Parts {
                balance: self.balance_units(now_ms).min(0),
                reported: self.reported,
                flags: self.flags & (RAN_DRY | DENIED | FAILING) | kept,
                base: if recent { self.base } else { now_ms },
                until: now_ms,
                ..Parts::default()
            };
        }
        self.mark = mark.max(self.base + 1);
        self.mark_flags = flags;
        self
    }

    /// A claim of a refill at `now_ms` (one worker sends it with its next tick).
    pub(super) fn claimed(self, now_ms: u64, claim_ms: u64) -> Self {
        self.marked(now_ms, now_ms + claim_ms, 0)
    }
}
