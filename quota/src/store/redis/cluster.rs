//! Redis Cluster's hash slots: which slot a key falls in, each slot's epoch marker, and the
//! masters `CLUSTER SLOTS` names.

use std::sync::OnceLock;

pub(super) const SLOTS: usize = 16_384;

/// A cluster slot of a hash tag (CRC16/XMODEM, as Redis Cluster computes it).
pub(super) fn slot(tag: &str) -> usize {
    usize::from(crc16::State::<crc16::XMODEM>::calculate(tag.as_bytes())) % SLOTS
}

/// The epoch marker key of each slot.
pub(super) fn marker(slot: usize) -> &'static str {
    static MARKERS: OnceLock<Vec<String>> = OnceLock::new();
    let markers = MARKERS.get_or_init(|| {
        let mut markers = vec![String::new(); SLOTS];
        let mut missing = SLOTS;
        let mut n = 0u64;
        while missing > 0 {
            let tag = format!("tg-epoch-{n}");
            let s = self::slot(&tag);
            if markers[s].is_empty() {
                markers[s] = format!("{{{tag}}}");
                missing -= 1;
            }
            n += 1;
        }
        markers
    });
    markers[slot].as_str()
}

/// `CLUSTER SLOTS`' answer as (first slot, last slot, master's host and port); entries that do
/// not read so are left out.
pub(super) fn slot_ranges(answer: redis::Value) -> Vec<(u16, u16, (String, u16))> {
    use redis::Value;
    let Value::Array(entries) = answer else {
        return Vec::new();
    };
    let int = |v: &Value| match v {
        Value::Int(n) => u16::try_from(*n).ok(),
        _ => None,
    };
    entries
        .iter()
        .filter_map(|entry| {
            let Value::Array(parts) = entry else {
                return None;
            };
            let (start, end) = (int(parts.first()?)?, int(parts.get(1)?)?);
            let Value::Array(node) = parts.get(2)? else {
                return None;
            };
            let host = match node.first()? {
                Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                Value::SimpleString(s) => s.clone(),
                _ => return None,
            };
            Some((start, end, (host, int(node.get(1)?)?)))
        })
        .collect()
}

/// Where a command for `slot` goes on a cluster: the master serving it.
pub(super) fn master_of(slot: u16) -> redis::cluster_routing::RoutingInfo {
    use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
    RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::new(
        slot,
        SlotAddr::Master,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_the_clusters_and_every_slot_has_a_marker() {
        // Values from the Redis Cluster specification (CLUSTER KEYSLOT).
        assert_eq!(slot("123456789"), 0x31C3);
        assert_eq!(slot("foo"), 12_182);
        for s in [0, 1, 12_182, SLOTS - 1] {
            let m = marker(s);
            assert_eq!(slot(&m[1..m.len() - 1]), s);
        }
    }
}
