//! The Lua scripts a call runs, and what each kind of item tells them.

use redis::aio::ConnectionManager;
use tollgate_core::global::lease::{LeaseItem, MAX_DEBT};
use tollgate_core::global::permits::PermitItem;
pub(super) const LEASE_LUA: &str = include_str!("lease.lua");
pub(super) const SLOTS_LUA: &str = include_str!("slots.lua");
/// Helpers both scripts use, prepended to each.
const FAIR_LUA: &str = include_str!("fair.lua");
/// On a cluster the script may touch keys of several slots of the master it runs on (Redis 7).
const CLUSTER_FLAGS: &str = "#!lua flags=allow-cross-slot-keys\n";

/// A script as sent with `SCRIPT LOAD`, and its SHA-1 for `EVALSHA`.
pub(super) struct Script {
    pub(super) text: String,
    pub(super) sha: String,
}

impl Script {
    pub(super) fn new(body: &str, cluster: bool) -> Self {
        let flags = if cluster { CLUSTER_FLAGS } else { "" };
        let text = format!("{flags}{FAIR_LUA}{body}");
        let sha = redis::Script::new(&text).get_hash().to_owned();
        Self { text, sha }
    }
}

/// Items a script serves: where their keys are and what the script is told of each.
pub(super) trait Scripted {
    /// The item's hash, after its hash tag.
    const SUFFIX: &'static str;
    /// Numbers the script answers per item.
    const ANSWER: usize;
    /// Whether each item's arguments end with its instance (the script serves several calls'
    /// items at once), and the item count is followed by when the run was sent (Redis's clock);
    /// else the call's instance comes first, before the TTL.
    const INSTANCE_PER_ITEM: bool;
    /// The hash tag of the item's keys.
    fn tag(&self) -> String;
    fn push_args(&self, cmd: &mut redis::Cmd);
}

impl Scripted for LeaseItem {
    const SUFFIX: &'static str = ":b";
    const ANSWER: usize = 8;
    const INSTANCE_PER_ITEM: bool = true;
    fn tag(&self) -> String {
        format!("tg:{}:{}", self.limit_id, self.key)
    }
    fn push_args(&self, cmd: &mut redis::Cmd) {
        // (Amounts past what a bucket can owe or hold would only lose precision in Lua's
        // doubles: the script caps them alike.)
        let cap = |n: u64| n.min(2 * MAX_DEBT);
        let numbers = [
            self.requests,
            self.per_ms,
            self.burst,
            self.wanted,
            self.demand_mtps(),
            self.known_ms,
            self.known_remaining,
            cap(self.known_debt),
            self.returned,
            cap(self.owed),
            cap(self.held),
            self.share_mtps(),
            self.share_ms,
            // A calendar quota's period's end (0: none, a refilling bucket).
            self.period.map_or(0, |(_, end_ms)| end_ms),
        ];
        // One argument of 14 little-endian doubles, which the script reads with one
        // `struct.unpack`: Redis makes a Lua string of every argument, and the script read each
        // with `tonumber` — 13 of each per item were a sixth of the script's time. (The numbers
        // become the same doubles `tonumber` made of their decimal text.)
        let mut packed = [0u8; 14 * 8];
        for (place, n) in packed.chunks_exact_mut(8).zip(numbers) {
            place.copy_from_slice(&(n as f64).to_le_bytes());
        }
        cmd.arg(&packed[..]);
    }
}

impl Scripted for PermitItem {
    const SUFFIX: &'static str = ":s";
    const ANSWER: usize = 3;
    const INSTANCE_PER_ITEM: bool = false;
    fn tag(&self) -> String {
        format!("tg:{}:{}", self.limit_id, self.key)
    }
    fn push_args(&self, cmd: &mut redis::Cmd) {
        cmd.arg(self.concurrent)
            .arg(self.wanted)
            .arg(self.keep)
            .arg(self.known_held);
    }
}

/// Run the script by its hash, loading it first where the server does not know it.
pub(super) async fn eval_or_load(
    c: &mut ConnectionManager,
    evalsha: &redis::Cmd,
    load: &redis::Cmd,
) -> redis::RedisResult<Vec<u64>> {
    match evalsha.query_async::<Vec<u64>>(c).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            load.query_async::<()>(c).await?;
            evalsha.query_async(c).await
        }
        other => other,
    }
}
