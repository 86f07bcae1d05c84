//! A request that just arrived, decided whole — overload seats, its checks, strict or leased —
//! into the one [`Step`] the stream carries out.

use super::{Engine, Inputs, Seats, Step};
use crate::request::{Request, RequestView};
use log::warn;
use tollgate_core::CasStore;

/// The host's time, read once and only when a decision needs it (a request no rule applies to
/// makes no host call for it).
pub struct Clock<'a> {
    read: &'a dyn Fn() -> Option<u64>,
    read_ns: Option<Option<u64>>,
}

impl<'a> Clock<'a> {
    pub fn new(read: &'a dyn Fn() -> Option<u64>) -> Self {
        Self {
            read,
            read_ns: None,
        }
    }

    /// Now (ns), as the host said the first time it was asked; `None` if it gave no time.
    pub fn now(&mut self) -> Option<u64> {
        *self.read_ns.get_or_insert_with(self.read)
    }
}

impl Engine {
    /// Decide a request that just arrived: the seats it takes in overload rules (in `seats`; a
    /// request one of them sheds is refused), its checks (gathered into `inputs`: a blocked key
    /// is refused), then, by the configuration, a call of its own (strict mode, once its local
    /// rules admit it), or the decision from its leased and local quota — which may be to wait
    /// for global quota (`inputs` keep its checks for deciding again). No check, or no time from
    /// the host: it passes.
    pub fn decide<S: CasStore + ?Sized, V: RequestView>(
        &mut self,
        store: &S,
        request: &Request<V>,
        clock: &mut Clock,
        seats: &mut Seats,
        inputs: &mut Inputs,
    ) -> Step {
        if self.has_guards() {
            if let Some(now) = clock.now() {
                if let Some(shed) = self.guard(store, request, now, seats) {
                    return Step::Refuse(shed);
                }
            }
        }
        if let Some(blocked) = self.gather(request, inputs) {
            return Step::Refuse(blocked);
        }
        if inputs.is_empty() {
            return Step::Pass;
        }
        let Some(now) = clock.now() else {
            warn!("the host gave no usable time; request not limited");
            return Step::Pass;
        };
        if self.is_strict(inputs) {
            let strict = self.split(std::mem::take(inputs), now);
            if let Some(refused) = self.local_refusal(store, &strict.locals, now) {
                return refused;
            }
            return Step::Call(Box::new(strict));
        }
        #[cfg(all(target_arch = "wasm32", feature = "probe"))]
        let _evaluating = crate::probe::start("evaluate");
        self.evaluate(store, inputs, now, false)
    }
}
