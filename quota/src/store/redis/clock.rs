//! Redis's clock as the service estimates it (`TIME` every 10 s), so that a run says when it was
//! sent and the script sees a caller's evidence as old as it is.

use super::{Connection, ScriptRunner};
use std::sync::atomic::Ordering;

/// No clock offset learnt: runs say nothing of when they were sent.
pub(super) const UNKNOWN_OFFSET: i64 = i64::MIN;
/// The clock offset is learnt again this often (and after a failed run: another master).
const CLOCK_TERM_MS: u64 = 10_000;

/// This process's clock (the memory store's, which no step of the system clock moves), ms.
fn local_ms() -> i64 {
    i64::try_from(crate::store::now_ms()).unwrap_or(i64::MAX)
}

impl ScriptRunner {
    /// When a run sent now is sent, in Redis's clock (0: not known). Learns Redis's clock first
    /// when it was last learnt a term ago (one `TIME`, bounded by the storage timeout).
    pub(super) async fn sent_ms(&self) -> u64 {
        if matches!(self.conn, Connection::Cluster(_)) {
            return 0;
        }
        let now = crate::store::now_ms();
        let learnt = self.clock_learnt_ms.load(Ordering::Relaxed);
        if now.saturating_sub(learnt) >= CLOCK_TERM_MS
            && self
                .clock_learnt_ms
                .compare_exchange(learnt, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let offset = tokio::time::timeout(self.timeout, self.clock_offset())
                .await
                .ok()
                .flatten()
                .unwrap_or(UNKNOWN_OFFSET);
            self.clock_offset_ms.store(offset, Ordering::Relaxed);
        }
        match self.clock_offset_ms.load(Ordering::Relaxed) {
            UNKNOWN_OFFSET => 0,
            offset => u64::try_from(local_ms().saturating_add(offset)).unwrap_or(0),
        }
    }

    /// Redis's clock less this process's, read with `TIME` (to within half its round trip).
    pub(super) async fn clock_offset(&self) -> Option<i64> {
        let mut conn = match &self.conn {
            Connection::Single(c) => c.clone(),
            Connection::Sentinel(link) => link.connection().await.ok()?,
            Connection::Cluster(_) => return None,
        };
        let before = local_ms();
        let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(&mut conn).await.ok()?;
        let after = local_ms();
        let redis_ms = secs.checked_mul(1_000)?.checked_add(micros / 1_000)?;
        Some(redis_ms - (before + after) / 2)
    }

    /// Learn Redis's clock again at the next run (a failed run may mean another master).
    pub(super) fn forget_clock(&self) {
        self.clock_learnt_ms.store(0, Ordering::Relaxed);
    }
}
