//! Overload protection in the model: adaptive and success-rate-throttle rules (what they
//! estimate, their windows and flows) and the top-level priority classes.

use super::{KeyPart, Match};
use crate::config::period::format_duration;
use tollgate_core::overload::adaptive::{Adaptive, LEVELS, MILLI};
use tollgate_core::overload::throttle::{SreThrottle, K_SCALE};
use tollgate_core::SlotTable;
/// Windows per adaptive or throttle rule when `max_keys` is not given.
pub const DEFAULT_GUARD_KEYS: u32 = 100;
/// Upper bound of `max_keys` for these rules (each key's window is a shared-data value).
pub const MAX_GUARD_KEYS: u32 = 10_000;
/// The level of requests no priority class matches.
pub const DEFAULT_LEVEL: u8 = 1;

/// An overload rule: what it estimates, the windows of its keys, and its flow key.
#[derive(Debug, Clone, PartialEq)]
pub struct Guard {
    pub kind: GuardKind,
    /// Names the windows in shared data: one per key (keys beyond `max_keys` share by hash).
    pub table: SlotTable,
    /// Empty: no fairness between flows.
    pub fair_key: Vec<KeyPart>,
}

impl Guard {
    /// The rule as the configuration would write it.
    pub fn describe(&self) -> String {
        let ms = |ns: u64| format_duration(ns);
        match &self.kind {
            GuardKind::Adaptive { estimator, cpu } => {
                let signal = estimator.signal();
                let mut text = format!(
                    "adaptive, window {} in {} buckets, latency factor {}, cool-down {}",
                    ms(estimator.window_ns()),
                    estimator.buckets(),
                    signal.latency_factor as f64 / MILLI as f64,
                    ms(estimator.cool_down_ns())
                );
                if let (Some(h), Some(c)) = (cpu, signal.cpu) {
                    text += &format!(
                        ", cpu from {} above {}",
                        h.name,
                        c.threshold as f64 / MILLI as f64
                    );
                }
                if !self.fair_key.is_empty() {
                    text += ", fair per flow";
                }
                text
            }
            GuardKind::Throttle { throttle, .. } => format!(
                "sre_throttle, k {}, window {}",
                throttle.k_milli() as f64 / K_SCALE as f64,
                ms(throttle.period_ns())
            ),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum GuardKind {
    Adaptive {
        estimator: Adaptive,
        cpu: Option<CpuHeader>,
    },
    Throttle {
        throttle: SreThrottle,
        failures: StatusSet,
    },
}

/// Where an upstream reports its CPU.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuHeader {
    /// Lower-case.
    pub name: String,
    /// The reported number that means 100%.
    pub scale: f64,
}

/// A set of HTTP statuses (100 to 599).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatusSet([u64; 10]);

impl StatusSet {
    pub fn contains(&self, status: u32) -> bool {
        let Ok(i) = usize::try_from(status) else {
            return false;
        };
        i < 640 && self.0[i / 64] & (1 << (i % 64)) != 0
    }

    pub const EMPTY: Self = Self([0; 10]);

    pub fn insert(&mut self, status: usize) {
        if status < 640 {
            self.0[status / 64] |= 1 << (status % 64);
        }
    }
}

/// The priority classes and each level's share of an overload rule's capacity.
#[derive(Debug, Clone, PartialEq)]
pub struct Priorities {
    pub classes: Vec<PriorityClass>,
    /// Thousandths, by level.
    pub shares: [u64; LEVELS],
}

impl Default for Priorities {
    fn default() -> Self {
        Self {
            classes: Vec::new(),
            shares: [MILLI; LEVELS],
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct PriorityClass {
    pub name: String,
    pub matcher: Match,
    pub level: u8,
}
