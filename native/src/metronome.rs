//! The tick. Envoy gives an HTTP filter no timer: a thread of the module's own wakes at each
//! configuration's tick period and asks Envoy's main thread, through the configuration's
//! scheduler, to run that configuration's tick for every worker.

use crate::config::ModuleConfig;
use parking_lot::Mutex;
use std::sync::{Arc, Once, Weak};
use std::time::{Duration, Instant};

/// The live configurations and when each is due.
static WATCHED: Mutex<Vec<(Weak<ModuleConfig>, Instant)>> = Mutex::new(Vec::new());
static STARTED: Once = Once::new();

/// Tick `config` from now on (its tick period is set by then).
pub fn watch(config: &Arc<ModuleConfig>) {
    WATCHED
        .lock()
        .push((Arc::downgrade(config), Instant::now()));
    STARTED.call_once(|| {
        let started = std::thread::Builder::new()
            .name("tollgate-tick".into())
            .spawn(run);
        if let Err(e) = started {
            log::error!(
                "cannot start the tick's thread: {e} (held requests, refills and stats stop)"
            );
        }
    });
}

fn run() {
    loop {
        let next = beat(Instant::now());
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    }
}

/// Ask for the ticks due at `now`; when to look again.
fn beat(now: Instant) -> Instant {
    let mut watched = WATCHED.lock();
    watched.retain(|(config, _)| config.strong_count() > 0);
    let mut next = now + Duration::from_millis(50);
    for (config, due) in watched.iter_mut() {
        let Some(config) = config.upgrade() else {
            continue;
        };
        if *due <= now {
            // Guarded: a panic here would end the thread and every tick with it.
            let asked =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| config.ask_for_tick()));
            if asked.is_err() {
                log::error!("asking for a tick failed");
            }
            let period = config
                .tick_ms
                .load(std::sync::atomic::Ordering::Acquire)
                .clamp(1, 1000);
            *due = now + Duration::from_millis(u64::from(period));
        }
        next = next.min(*due);
    }
    next
}
