//! A root context: one configuration in one worker. It loads the configuration, runs the tick
//! and takes the answers to the refills it sent.

use super::host::Host;
use super::plugin::Plugin;
use log::{error, warn};
use std::rc::Rc;

pub struct Root<H: Host> {
    host: H,
    plugin: Option<Rc<Plugin<H>>>,
    /// The tick period set so far (some hosts accept it only once).
    tick_ms: Option<u32>,
}

impl<H: Host + Clone> Root<H> {
    pub fn new(host: H) -> Self {
        Self {
            host,
            plugin: None,
            tick_ms: None,
        }
    }

    /// The configuration new requests of this root run with (none: they pass unlimited).
    pub fn plugin(&mut self) -> Option<Rc<Plugin<H>>> {
        self.plugin.clone()
    }

    pub fn configure(&mut self) -> bool {
        let bytes = match self.host.plugin_configuration() {
            Ok(bytes) => bytes,
            Err(s) => {
                error!("cannot read the plugin configuration: {s}");
                return false;
            }
        };
        let plugin = match Plugin::load(&bytes, self.host.clone()) {
            Ok(plugin) => plugin,
            Err(line) => {
                error!("{line}");
                return false;
            }
        };
        let tick = plugin.tick_ms();
        if self
            .tick_ms
            .is_none_or(|t| t > tick && plugin.caps.resume_from_timer)
        {
            match self.host.set_tick_period(tick) {
                Ok(()) => self.tick_ms = Some(tick),
                Err(s) => warn!("cannot set the tick period (held requests, stashes, stats): {s}"),
            }
        }
        if let Some(old) = self.plugin.replace(Rc::new(plugin)) {
            old.retire();
        }
        true
    }

    pub fn tick(&mut self) {
        if let Some(plugin) = &self.plugin {
            plugin.tick();
        }
    }

    /// True if this root sent the call `token` and waits for its answer.
    pub fn sent(&mut self, token: u32) -> bool {
        self.plugin.as_ref().is_some_and(|p| p.sent(token))
    }

    /// The answer to a call this root sent: refills to write into the keys' allowances.
    pub fn on_call_response(&mut self, token: u32, num_headers: usize, body_size: usize) {
        if let Some(plugin) = &self.plugin {
            plugin.refills_answered(token, num_headers, body_size);
        }
    }

    /// The configuration goes away (reload, shutdown).
    pub fn done(&mut self) {
        if let Some(plugin) = self.plugin.take() {
            plugin.retire();
        }
    }
}
