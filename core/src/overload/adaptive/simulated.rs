//! A simulated upstream (workers, a queue, a service time) under open-loop load, in virtual time.

use super::*;
use crate::state::draw;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

pub const MS: u64 = 1_000_000;
/// The length of a [`Tick`].
pub const TICK_NS: u64 = 100 * MS;

/// An upstream serving `workers` requests at once, each for the service time it has when a
/// worker takes it; more wait in line, first come first served.
pub struct Upstream {
    /// When each worker is next free, ns.
    free_at: Vec<u64>,
    /// Requests admitted and not answered yet: (answered at, response time µs), soonest first.
    pending: BinaryHeap<Reverse<(u64, u64)>>,
}

/// What happened in 100 ms of a run.
#[derive(Debug, Default, Clone, Copy)]
pub struct Tick {
    /// Requests answered in it.
    pub answered: u64,
    /// Requests due in it that were admitted (each is answered: goodput by when it was due, as
    /// the load generator counts it).
    pub admitted: u64,
    /// The slowest answer in it, µs.
    pub slowest_us: u64,
    /// The estimate and the minimum response time (µs) at its last arrival.
    pub estimate: u64,
    pub min_rt_us: u64,
}

impl Upstream {
    pub fn new(workers: usize) -> Self {
        Self {
            free_at: vec![0; workers],
            pending: BinaryHeap::new(),
        }
    }

    /// Lose workers (requests they hold are still answered) or gain some.
    pub fn set_workers(&mut self, workers: usize) {
        self.free_at.sort_unstable();
        self.free_at.resize(workers, 0);
    }

    /// Decide each of `arrivals` (ns, in order, from `from`); admitted ones are served for
    /// `service_ns(when a worker takes them)`. The answers due by the last arrival are taken
    /// in; later ones stay pending for the next run. Ticks of 100 ms from `from`.
    pub fn run(
        &mut self,
        a: &Adaptive,
        mut w: Window,
        from: u64,
        arrivals: impl IntoIterator<Item = u64>,
        mut service_ns: impl FnMut(u64) -> u64,
    ) -> (Window, Vec<Tick>) {
        let mut ticks: Vec<Tick> = Vec::new();
        let tick_at = |ticks: &mut Vec<Tick>, t: u64| -> usize {
            let i = (t.saturating_sub(from) / TICK_NS) as usize;
            if ticks.len() <= i {
                ticks.resize(i + 1, Tick::default());
            }
            i
        };
        for t in arrivals {
            while let Some(&Reverse((at, rt_us))) = self.pending.peek().filter(|p| p.0 .0 <= t) {
                self.pending.pop();
                w = a.complete(&w, at, Seat::default(), rt_us, None);
                let i = tick_at(&mut ticks, at);
                let tick = &mut ticks[i];
                tick.answered += 1;
                tick.slowest_us = tick.slowest_us.max(rt_us);
            }
            let i = tick_at(&mut ticks, t);
            w = match a.admit(&w, t, Seat::default(), MILLI) {
                Admission::Admit(next) => {
                    let worker = (0..self.free_at.len())
                        .min_by_key(|&i| self.free_at[i])
                        .unwrap_or(0);
                    let start = self.free_at[worker].max(t);
                    let done = start + service_ns(start);
                    self.free_at[worker] = done;
                    self.pending.push(Reverse((done, (done - t) / 1_000)));
                    ticks[i].admitted += 1;
                    next
                }
                Admission::Refuse(next) => next,
            };
            ticks[i].estimate = a.estimate(&w).unwrap_or(0);
            ticks[i].min_rt_us = Adaptive::min_rt(&w).unwrap_or(0);
        }
        (w, ticks)
    }
}

/// One arrival every `gap_ns` from `from` until `to`.
pub fn every(from: u64, to: u64, gap_ns: u64) -> impl Iterator<Item = u64> {
    (from..to).step_by(gap_ns as usize)
}

/// Arrivals of a Poisson process of `per_s` a second from `from` until `to`, drawn from `seed`.
pub fn poisson(from: u64, to: u64, per_s: f64, seed: u64) -> impl Iterator<Item = u64> {
    let mut n = seed.wrapping_mul(1 << 32);
    std::iter::successors(Some(from), move |&t| {
        n += 1;
        // Exponential gaps: −ln(U) / λ, U in (0, 1].
        let u = (f64::from(draw(n)) + 1.0) / 4_294_967_296.0;
        Some(t + (-u.ln() / per_s * 1e9) as u64)
    })
    .skip(1)
    .take_while(move |&t| t < to)
}

/// Service times of `ms` stretched by up to 5% at random (a real upstream's and a proxy's own
/// jitter), drawn from `seed`.
pub fn jittered(ms: u64, seed: u64) -> impl FnMut(u64) -> u64 {
    let mut n = seed.wrapping_mul(1 << 32) ^ (1 << 31);
    move |_| {
        n += 1;
        ms * MS + u64::from(draw(n)) * (ms * MS / 20) / (1 << 32)
    }
}

/// Answered per second and the slowest response time (ms) over `ticks[from..to]`.
pub fn over(ticks: &[Tick], from: usize, to: usize) -> (f64, u64) {
    let span = &ticks[from..to];
    let answered: u64 = span.iter().map(|t| t.answered).sum();
    let slowest = span.iter().map(|t| t.slowest_us).max().unwrap_or(0);
    (answered as f64 * 10.0 / span.len() as f64, slowest / 1_000)
}
