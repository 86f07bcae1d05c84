//! Lease calls that come while others run go to Redis together: one script run serves many
//! calls' items, so a call of one item costs Redis about what an item of a larger call does.
//!
//! A script run costs Redis a fixed part (the script's own set-up, its arguments, `TIME`) as
//! large as several items' work; calls of one item (a proxy with one busy key) would spend most
//! of Redis on it. No call waits for company: with no run out, a call's items go at once; while
//! one is out, the calls that come meanwhile queue, and the next run takes them all (up to
//! [`RUN_ITEMS`] items). A call that large or larger runs at once, by itself.

use super::ScriptRunner;
use crate::store::StoreError;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, Semaphore};
use tollgate_core::global::lease::{LeaseGrant, LeaseItem};

/// Script runs out at once. One Redis runs one script at a time, so a second run out would only
/// overlap the first's round trip, and split the calls queued meanwhile into smaller runs:
/// measured with one-item calls, one run out served more calls per Redis core than two. (On a
/// cluster a run's items go to each master at once.)
const RUNS_IN_FLIGHT: usize = 1;
/// Queued calls join a run until it has this many items (a larger call runs alone): a run
/// holds Redis for its whole length.
const RUN_ITEMS: usize = 128;
/// Calls queued at most (each is a request the service already holds); past it, callers wait
/// for room within their storage timeout.
const QUEUED_CALLS: usize = 4_096;

/// One lease call waiting for its run.
struct LeaseCall {
    instance: String,
    items: Vec<LeaseItem>,
    ttl_ms: u64,
    answer: oneshot::Sender<Result<Vec<LeaseGrant>, StoreError>>,
}

/// The queue lease calls go through; its task ends when the store is dropped.
pub(super) struct LeaseBatches {
    calls: mpsc::Sender<LeaseCall>,
    scripts: Arc<ScriptRunner>,
    timeout: Duration,
}

impl LeaseBatches {
    pub(super) fn start(scripts: Arc<ScriptRunner>, timeout: Duration) -> Self {
        let (calls, queue) = mpsc::channel(QUEUED_CALLS);
        tokio::spawn(dispatch(scripts.clone(), queue));
        Self {
            calls,
            scripts,
            timeout,
        }
    }

    /// `instance`'s items served, alone or with others', within the storage timeout (queueing
    /// included). A call given up on while its run is out still runs: its grants are lost to it
    /// (stricter, never looser). A call of [`RUN_ITEMS`] items or more gains nothing from
    /// company and does not queue: it runs at once, as it would alone.
    pub(super) async fn lease(
        &self,
        instance: &str,
        items: &[LeaseItem],
        ttl_ms: u64,
    ) -> Result<Vec<LeaseGrant>, StoreError> {
        if items.len() >= RUN_ITEMS {
            let owners = vec![instance; items.len()];
            return self.scripts.lease(&owners, items, ttl_ms).await;
        }
        let (answer, answered) = oneshot::channel();
        let call = LeaseCall {
            instance: instance.to_owned(),
            items: items.to_vec(),
            ttl_ms,
            answer,
        };
        let served = async {
            self.calls
                .send(call)
                .await
                .map_err(|_| StoreError::Failed("the lease queue has stopped".into()))?;
            answered
                .await
                .map_err(|_| StoreError::Failed("a lease run ended without an answer".into()))?
        };
        tokio::time::timeout(self.timeout, served)
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))?
    }
}

/// Take queued calls into runs, at most [`RUNS_IN_FLIGHT`] out at once.
async fn dispatch(scripts: Arc<ScriptRunner>, mut queue: mpsc::Receiver<LeaseCall>) {
    let free = Arc::new(Semaphore::new(RUNS_IN_FLIGHT));
    // A call that did not fit the run before (too many items, another TTL) leads the next.
    let mut carried: Option<LeaseCall> = None;
    loop {
        let Ok(permit) = free.clone().acquire_owned().await else {
            return;
        };
        let first = match carried.take() {
            Some(call) => call,
            None => match queue.recv().await {
                Some(call) => call,
                None => return,
            },
        };
        // A call whose caller gave up (its storage timeout passed while it queued) is not run:
        // under overload, running it would only make every later call wait longer.
        if first.answer.is_closed() {
            continue;
        }
        let mut size = first.items.len();
        let mut run = vec![first];
        while size < RUN_ITEMS {
            let Ok(call) = queue.try_recv() else { break };
            if call.answer.is_closed() {
                continue;
            }
            if size + call.items.len() > RUN_ITEMS || call.ttl_ms != run[0].ttl_ms {
                carried = Some(call);
                break;
            }
            size += call.items.len();
            run.push(call);
        }
        let scripts = scripts.clone();
        tokio::spawn(async move {
            serve_run(&scripts, run).await;
            drop(permit);
        });
    }
}

/// One script run for `run`'s calls; each call gets its own items' answers. A run of several
/// calls that fails other than by time (a script error, say from one call's item or a damaged
/// key) goes again call by call, so that the error is only the call's that caused it: one
/// caller's item never fails another's call. (What the failed run wrote before its error stays:
/// the tokens it took are lost to their callers, stricter, never looser.)
async fn serve_run(scripts: &ScriptRunner, run: Vec<LeaseCall>) {
    if run.len() > 1 {
        match serve_together(scripts, &run).await {
            Ok(answers) => {
                for (call, answer) in run.into_iter().zip(answers) {
                    let _ = call.answer.send(Ok(answer));
                }
                return;
            }
            Err(e @ StoreError::Timeout(_)) => {
                for call in run {
                    let _ = call.answer.send(Err(e.clone()));
                }
                return;
            }
            // Call by call, below.
            Err(StoreError::Failed(_)) => {}
        }
    }
    for call in run {
        if call.answer.is_closed() {
            continue;
        }
        let owners = vec![call.instance.as_str(); call.items.len()];
        let result = scripts.lease(&owners, &call.items, call.ttl_ms).await;
        let _ = call.answer.send(result);
    }
}

/// `run`'s calls in one script run: each call's answers, in order.
async fn serve_together(
    scripts: &ScriptRunner,
    run: &[LeaseCall],
) -> Result<Vec<Vec<LeaseGrant>>, StoreError> {
    let ttl_ms = run[0].ttl_ms;
    let mut items = Vec::with_capacity(run.iter().map(|c| c.items.len()).sum());
    let mut owners = Vec::with_capacity(items.capacity());
    for call in run {
        items.extend_from_slice(&call.items);
        owners.extend(std::iter::repeat_n(
            call.instance.as_str(),
            call.items.len(),
        ));
    }
    let mut grants = scripts.lease(&owners, &items, ttl_ms).await?.into_iter();
    Ok(run
        .iter()
        .map(|call| grants.by_ref().take(call.items.len()).collect())
        .collect())
}
