//! The simulated load: a seeded random source, which key a request picks, and how busy each
//! key is.

use crate::scenario::*;

/// A small deterministic random source (xorshift64*).
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub(crate) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The chance of each key, and drawing one.
pub(crate) struct KeyPicker {
    pub(crate) keys: Keys,
    /// Zipf: the cumulative chance of keys `0..=i`.
    pub(crate) cdf: Vec<f64>,
}

impl KeyPicker {
    pub(crate) fn new(keys: Keys) -> Self {
        let cdf = match keys {
            Keys::Zipf { n, s } => {
                let weights: Vec<f64> = (1..=n).map(|i| 1.0 / (i as f64).powf(s)).collect();
                let total: f64 = weights.iter().sum();
                let mut acc = 0.0;
                weights
                    .iter()
                    .map(|w| {
                        acc += w / total;
                        acc
                    })
                    .collect()
            }
            _ => Vec::new(),
        };
        Self { keys, cdf }
    }

    pub(crate) fn pick(&self, rng: &mut Rng) -> u32 {
        match self.keys {
            Keys::Uniform(n) => (rng.next() % u64::from(n.max(1))) as u32,
            Keys::Hot => 0,
            Keys::Zipf { .. } => {
                let u = rng.unit();
                self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1) as u32
            }
        }
    }

    pub(crate) fn chance(&self, key: u32) -> f64 {
        match self.keys {
            Keys::Uniform(n) => 1.0 / f64::from(n.max(1)),
            Keys::Hot => 1.0,
            Keys::Zipf { .. } => {
                let k = key as usize;
                self.cdf[k] - if k == 0 { 0.0 } else { self.cdf[k - 1] }
            }
        }
    }
}

/// Max-min fair shares of a key over the proxies' current rates: the water level, found from the
/// sorted rates and their prefix sums.
pub(crate) struct Levels {
    pub(crate) sorted: Vec<f64>,
    pub(crate) prefix: Vec<f64>,
}

impl Levels {
    pub(crate) fn new(rates: &[f64]) -> Self {
        let mut sorted = rates.to_vec();
        sorted.sort_by(f64::total_cmp);
        let mut prefix = vec![0.0];
        for r in &sorted {
            prefix.push(prefix.last().copied().unwrap_or(0.0) + r);
        }
        Self { sorted, prefix }
    }

    /// The level λ with Σ min(rate_i, λ) = `capacity` (infinite when all fit).
    pub(crate) fn level(&self, capacity: f64) -> f64 {
        let n = self.sorted.len();
        if self.prefix[n] <= capacity {
            return f64::INFINITY;
        }
        // The first i such that the i smallest rates fully served and the rest at λ ≥ sorted[i]
        // overflows: λ = (capacity − prefix[i]) / (n − i).
        for i in 0..n {
            let level = (capacity - self.prefix[i]) / (n - i) as f64;
            if level <= self.sorted[i] {
                return level.max(0.0);
            }
        }
        f64::INFINITY
    }
}
