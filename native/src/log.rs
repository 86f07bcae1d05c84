//! The `log` macros routed to Envoy's `dynamic_modules` logger, and the last-resort panic hook.

use crate::abi::{self, ModuleBuffer};

struct Logger;

static LOGGER: Logger = Logger;

fn envoy_level(level: log::Level) -> u32 {
    match level {
        log::Level::Error => abi::LOG_ERROR,
        log::Level::Warn => abi::LOG_WARN,
        log::Level::Info => abi::LOG_INFO,
        log::Level::Debug => abi::LOG_DEBUG,
        log::Level::Trace => abi::LOG_TRACE,
    }
}

/// Hand one line to Envoy.
pub fn line(level: u32, message: &str, file: &str, line: u32) {
    // SAFETY: every buffer outlives the call; Envoy copies what it keeps.
    unsafe {
        abi::log(
            level,
            ModuleBuffer::of(message.as_bytes()),
            ModuleBuffer::of(file.as_bytes()),
            line,
        )
    };
}

impl log::Log for Logger {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        // The configuration's level first (no call), then Envoy's for the component.
        metadata.level() <= log::max_level()
            // SAFETY: a plain value.
            && unsafe { abi::log_enabled(envoy_level(metadata.level())) }
    }

    fn log(&self, record: &log::Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let file = record.file().unwrap_or("");
        let at = record.line().unwrap_or(0);
        let level = envoy_level(record.level());
        match record.args().as_str() {
            Some(text) => line(level, text, file, at),
            None => line(level, &record.args().to_string(), file, at),
        }
    }

    fn flush(&self) {}
}

/// Route the `log` macros to Envoy, at info until a configuration says otherwise, and log any
/// panic at critical level (every hook also catches it: a panic never reaches Envoy).
pub fn install() {
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(log::LevelFilter::Info);
    std::panic::set_hook(Box::new(|info| {
        line(
            abi::LOG_CRITICAL,
            &format!("tollgate panicked: {info}"),
            "",
            0,
        );
    }));
}
