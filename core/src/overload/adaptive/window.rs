//! A window as stored: its bytes in shared data, and what it says of a time.

use super::*;

impl Window {
    pub fn in_flight(&self) -> u64 {
        self.in_flight.iter().map(|&n| u64::from(n)).sum()
    }

    /// Requests in flight of `level` and above.
    pub fn in_flight_from(&self, level: u8) -> u64 {
        let from = usize::from(level).min(LEVELS - 1);
        self.in_flight[from..].iter().map(|&n| u64::from(n)).sum()
    }

    /// The smoothed CPU signal in thousandths, if the upstream reported any.
    pub fn cpu_milli(&self) -> Option<u64> {
        (self.cpu_milli != u32::MAX && self.newest != 0).then_some(u64::from(self.cpu_milli))
    }

    /// True if `seat` may not take another request with `capacity` estimated.
    pub(super) fn full_for(&self, seat: Seat, capacity: u64, share_milli: u64) -> bool {
        let allowance = (u128::from(capacity) * u128::from(share_milli))
            .div_ceil(u128::from(MILLI))
            .max(1);
        let allowance = u64::try_from(allowance).unwrap_or(u64::MAX);
        let from_level = self.in_flight_from(seat.level);
        if from_level >= allowance {
            return true;
        }
        let Some(f) = seat.flow() else {
            return false;
        };
        let level = seat.level();
        let above = from_level - u64::from(self.in_flight[level]);
        let mine = u64::from(self.flows[f]);
        let others = (0..FLOWS)
            .filter(|&i| i != f && self.flows[i] > 0 && usize::from(self.flow_levels[i]) == level)
            .count() as u64;
        mine >= (allowance - above).div_ceil(others + 1)
    }

    pub fn encode(&self) -> [u8; WINDOW_BYTES] {
        let mut out = [0; WINDOW_BYTES];
        out[0..8].copy_from_slice(&self.newest.to_le_bytes());
        out[8..12].copy_from_slice(&self.cpu_milli.to_le_bytes());
        out[12..16].copy_from_slice(&self.latched.to_le_bytes());
        out[16..24].copy_from_slice(&self.refused_ns.to_le_bytes());
        out[72..80].copy_from_slice(&self.floor_period.to_le_bytes());
        out[80..84].copy_from_slice(&self.floors[0].to_le_bytes());
        out[84..88].copy_from_slice(&self.floors[1].to_le_bytes());
        out[88..96].copy_from_slice(&self.cpu_ns.to_le_bytes());
        let levels = (self.flow_levels.iter().enumerate())
            .fold(0u32, |packed, (i, &l)| packed | u32::from(l & 3) << (2 * i));
        out[96..100].copy_from_slice(&levels.to_le_bytes());
        out[100..104].copy_from_slice(&self.carried.to_le_bytes());
        out[104..108].copy_from_slice(&self.moved.to_le_bytes());
        out[108..112].copy_from_slice(&self.probe_from.to_le_bytes());
        out[112..116].copy_from_slice(&self.hot.to_le_bytes());
        out[116..120].copy_from_slice(&self.confirmed.to_le_bytes());
        out[120..124].copy_from_slice(&self.probe_until.to_le_bytes());
        out[124..128].copy_from_slice(&self.probe_floor.to_le_bytes());
        for (i, n) in self.in_flight.iter().enumerate() {
            out[24 + i * 4..28 + i * 4].copy_from_slice(&n.to_le_bytes());
        }
        for (i, n) in self.flows.iter().enumerate() {
            out[40 + i * 2..42 + i * 2].copy_from_slice(&n.to_le_bytes());
        }
        for (i, b) in self.buckets.iter().enumerate() {
            let at = HEADER_BYTES + i * 8;
            out[at..at + 4].copy_from_slice(&b.passed.to_le_bytes());
            out[at + 4..at + 8].copy_from_slice(&b.rt_sum_us.to_le_bytes());
        }
        out
    }

    /// The window in `bytes`; anything shorter or longer is a fresh window.
    pub fn decode(bytes: &[u8]) -> Self {
        let Ok(bytes) = <&[u8; WINDOW_BYTES]>::try_from(bytes) else {
            return Self::default();
        };
        let u32_at = |at: usize| {
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        let u64_at = |at: usize| u64::from(u32_at(at)) | u64::from(u32_at(at + 4)) << 32;
        let mut w = Self {
            newest: u64_at(0),
            cpu_milli: u32_at(8),
            latched: u32_at(12),
            refused_ns: u64_at(16),
            floor_period: u64_at(72),
            floors: [u32_at(80), u32_at(84)],
            cpu_ns: u64_at(88),
            carried: u32_at(100),
            moved: u32_at(104),
            probe_from: u32_at(108),
            hot: u32_at(112),
            confirmed: u32_at(116),
            probe_until: u32_at(120),
            probe_floor: u32_at(124),
            flow_levels: std::array::from_fn(|i| (u32_at(96) >> (2 * i) & 3) as u8),
            ..Self::default()
        };
        for (i, n) in w.in_flight.iter_mut().enumerate() {
            *n = u32_at(24 + i * 4);
        }
        for (i, n) in w.flows.iter_mut().enumerate() {
            *n = u16::from_le_bytes([bytes[40 + i * 2], bytes[41 + i * 2]]);
        }
        for (i, b) in w.buckets.iter_mut().enumerate() {
            let at = HEADER_BYTES + i * 8;
            *b = Bucket {
                passed: u32_at(at),
                rt_sum_us: u32_at(at + 4),
            };
        }
        w
    }
}
