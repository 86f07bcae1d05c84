//! The memory store at its caps: idle buckets and ended holdings make room for new keys, live
//! ones stay.

use super::*;

const TTL: u64 = 1_000;

/// A lease of one item at `now`: its grant, or why the store refused it.
fn leased(store: &MemoryStore, instance: &str, item: LeaseItem, now: u64) -> Result<u64, String> {
    let answers = store.lease(instance, &[item], now, TTL).unwrap();
    match answers.refused.first() {
        Some((_, why)) => Err(why.clone()),
        None => Ok(answers.items[0].granted),
    }
}

/// A slot call of one item at `now`: what the instance holds and what is free, or why the store
/// refused it.
fn holds(
    store: &MemoryStore,
    instance: &str,
    item: PermitItem,
    now: u64,
) -> Result<(u64, u64), String> {
    let answers = store.slots(instance, &[item], now, TTL).unwrap();
    match answers.refused.first() {
        Some((_, why)) => Err(why.clone()),
        None => Ok((answers.items[0].held, answers.items[0].free)),
    }
}

#[test]
fn idle_buckets_make_room_for_new_keys_and_live_ones_stay() {
    // Three buckets, one made by each credential.
    let store = MemoryStore::with_caps(3, 1, ColdStart::Full);
    let share_full = Err("this credential's share of the store is full (1 keys)".to_string());
    // edge-a empties a bucket of 1 a day (live for days); edge-b one of 1 000/s, which is full
    // again at once and idle one term after its call.
    assert_eq!(leased(&store, "edge-a/p", item("spent", 5, 5), 0), Ok(5));
    let quick = LeaseItem {
        requests: 1_000,
        per_ms: 1_000,
        ..item("quick", 5, 5)
    };
    assert_eq!(leased(&store, "edge-b/p", quick, 0), Ok(5));
    assert_eq!(
        leased(&store, "edge-a/p", item("new-a", 5, 1), 10),
        share_full
    );
    assert_eq!(
        leased(&store, "edge-b/p", item("new-b", 5, 1), TTL - 1),
        share_full
    );
    // A term after its call, edge-b's bucket is as good as new: its room goes to edge-b's new key.
    assert_eq!(leased(&store, "edge-b/p", item("new-b", 5, 1), TTL), Ok(1));
    // edge-a's is live: kept empty (made anew it would grant 5), and still all of edge-a's share.
    assert_eq!(leased(&store, "edge-a/p", item("spent", 5, 5), TTL), Ok(0));
    assert_eq!(
        leased(&store, "edge-a/p", item("new-a", 5, 1), TTL),
        share_full
    );
}

#[test]
fn ended_holdings_make_room_for_new_keys_and_live_ones_stay() {
    let store = MemoryStore::with_caps(2, 2, ColdStart::Full);
    // Two keys held; the one renewed later ends later.
    assert_eq!(holds(&store, "a", slot("short", 3, 0), 0), Ok((3, 7)));
    assert_eq!(holds(&store, "a", slot("long", 4, 0), 0), Ok((4, 6)));
    assert_eq!(holds(&store, "a", slot("long", 4, 4), 600), Ok((4, 6)));
    assert_eq!(
        holds(&store, "b", slot("new", 1, 0), TTL - 1),
        Err("storage is full (2 keys)".into())
    );
    // The short holding's term ended: its room goes to the new key; the long one still holds 4.
    assert_eq!(holds(&store, "b", slot("new", 1, 0), TTL), Ok((1, 9)));
    assert_eq!(holds(&store, "b", slot("long", 10, 0), TTL), Ok((6, 0)));
}
