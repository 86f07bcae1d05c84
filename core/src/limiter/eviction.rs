//! Which slot of its group a key uses: its own, a free or idle one, or the one whose eviction
//! loses least — never a limited key's.

use super::SlotEvent;
use crate::algorithm::{Limit, Standing};
use crate::slot::{Group, Slot, WAYS};

/// Which slot of the group a key uses, what that means, and the slot as the decision starts from.
///
/// Its own slot, else a free one, else an idle one (as good as fresh: nothing lost). With every
/// slot held by an active key, the slot whose reset gives back the least is evicted — never one
/// whose key is being limited; among equals the least recently admitted. A key that returns after
/// its eviction starts fresh: it can be admitted at most what it had spent more than it would have
/// been. When every key of the group is being limited, the new key shares the slot that frees
/// soonest (stricter for both, never looser). Concurrency slots with requests in flight are never
/// taken over: the new key shares the one with the fewest.
pub(super) fn choose(
    limit: &Limit,
    group: &Group,
    tag: u64,
    now_ns: u64,
) -> (usize, SlotEvent, Slot) {
    let slots = &group.slots;
    if let Some(i) = slots.iter().position(|s| s.tag == tag) {
        return (i, SlotEvent::Own, slots[i]);
    }
    let fresh = Slot {
        tag,
        ..Slot::default()
    };
    if let Some(i) = slots.iter().position(|s| s.tag == 0) {
        return (i, SlotEvent::Own, fresh);
    }
    if let Some(i) = slots.iter().position(|s| limit.is_idle(&s.state, now_ns)) {
        return (i, SlotEvent::TakenOver, fresh);
    }
    let standing: [Standing; WAYS] =
        std::array::from_fn(|i| limit.standing(&slots[i].state, now_ns));
    if limit.is_held() {
        let least = (0..WAYS).min_by_key(|&i| standing[i].spent).unwrap_or(0);
        return (least, SlotEvent::Shared, slots[least]);
    }
    if standing.iter().all(|s| s.limited) {
        // Evicting a limited key would reset it: whoever can fill a group with limited keys could
        // reset their own again and again. The newcomer shares the slot that frees soonest.
        let soonest = (0..WAYS)
            .min_by_key(|&i| standing[i].retry_after_ns)
            .unwrap_or(0);
        return (soonest, SlotEvent::Shared, slots[soonest]);
    }
    let victim = (0..WAYS)
        .filter(|&i| !standing[i].limited)
        .min_by_key(|&i| {
            (
                standing[i].spent,
                standing[i].retry_after_ns,
                slots[i].last_ns,
            )
        })
        .unwrap_or(0);
    (victim, SlotEvent::Evicted, fresh)
}
