//! What a configuration needs of its process once, when it loads: the log level, the deployment's
//! placement secret, this process's name at the quota service.

use crate::config::LogLevel;
use crate::lifecycle::host::Host;
use tollgate_core::slot::KeyPlacement;

/// This process's name at the quota service: made once per process (shared by its workers).
/// The process's random placement secret: made by whichever configuration loads first and kept in
/// shared data, so every worker and every later configuration places keys alike. Envoy configures
/// its main thread before any worker; nginx refuses a second create (a write with CAS 0 to a key
/// that exists), and whoever loses the race reads the winner's.
pub(super) fn deployment_placement<H: Host>(host: &H) -> KeyPlacement {
    const KEY: &str = "tollgate.placement";
    if let Ok(Some((secret, _))) = host.read(KEY) {
        if let Ok(secret) = <[u8; 16]>::try_from(&secret[..]) {
            return KeyPlacement::new(secret);
        }
    }
    let secret = random_secret(host);
    let _ = host.write(KEY, &secret, 0);
    match host.read(KEY) {
        Ok(Some((stored, _))) => match <[u8; 16]>::try_from(&stored[..]) {
            Ok(stored) => KeyPlacement::new(stored),
            Err(_) => KeyPlacement::new(secret),
        },
        _ => KeyPlacement::new(secret),
    }
}

/// 16 bytes from the host's random source (WASI `random_get`, through std's hash keys), mixed
/// with the time in nanoseconds: nginx's source is `random()` seeded from its pid and the time.
pub(super) fn random_secret<H: Host>(host: &H) -> [u8; 16] {
    use std::hash::{BuildHasher, Hasher};
    let now = host.now_ns().unwrap_or(0);
    let mut halves = [0u64; 2];
    for (i, half) in halves.iter_mut().enumerate() {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(now);
        h.write_usize(i);
        *half = h.finish();
    }
    let mut secret = [0; 16];
    secret[..8].copy_from_slice(&halves[0].to_le_bytes());
    secret[8..].copy_from_slice(&halves[1].to_le_bytes());
    secret
}

pub(super) fn instance_id<H: Host>(host: &H) -> String {
    const KEY: &str = "tollgate.instance";
    if let Ok(Some((id, _))) = host.read(KEY) {
        return String::from_utf8_lossy(&id).into_owned();
    }
    let id = format!("proxy-{:x}", host.now_ns().unwrap_or(0));
    // Whoever writes first wins; everyone then reads the winner's.
    let _ = host.write(KEY, id.as_bytes(), 0);
    match host.read(KEY) {
        Ok(Some((id, _))) => String::from_utf8_lossy(&id).into_owned(),
        _ => id,
    }
}

/// The filter's own level: messages below it are never formatted. One per VM: the last
/// configuration loaded sets it.
pub(super) fn set_log_level(level: LogLevel) {
    log::set_max_level(match level {
        LogLevel::Error => log::LevelFilter::Error,
        LogLevel::Warn => log::LevelFilter::Warn,
        LogLevel::Info => log::LevelFilter::Info,
        LogLevel::Debug => log::LevelFilter::Debug,
    });
}
