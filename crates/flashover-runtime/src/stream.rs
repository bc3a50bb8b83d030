//! Asynchronous collectives: a group's communication stream runs collectives on a thread of its
//! own, in submission order, and hands back a [`Work`] to wait on later (torch.distributed's
//! `async_op=True`; a CUDA stream for NCCL).
//!
//! Ranks submit in the same program order, so every rank issues the same collectives in the
//! same order on the group, and a collective started early (a prefetch, the next ring block)
//! runs while the training thread computes. The collectives are the group's own, so deadlines,
//! mismatch detection and flight-recorder entries are those of a blocking call. The training
//! thread must not run a collective on the same group while work it submitted is in flight
//! (wait first): the two threads' order would differ between ranks.

use flashover_comm::{CommError, CommResult, Group};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type Job = Box<dyn FnOnce(&Group) + Send>;

/// A collective submitted to a [`CommStream`]; [`Work::wait`] returns its result.
#[derive(Debug)]
pub struct Work<T> {
    reply: Receiver<CommResult<T>>,
    /// The stream's group, told how long its result was waited for (none: work done already).
    group: Option<Group>,
}

impl<T> Work<T> {
    /// Work already done, answering `result`.
    pub fn ready(result: CommResult<T>) -> Self {
        let (tx, rx) = channel();
        let _ = tx.send(result);
        Work {
            reply: rx,
            group: None,
        }
    }

    /// Blocks until the collective is done and returns its result. The time blocked is
    /// recorded on the group as communication not hidden
    /// ([`flashover_comm::Communicator::record_wait`]).
    pub fn wait(self) -> CommResult<T> {
        let started = Instant::now();
        let result = self.reply.recv().unwrap_or_else(|_| {
            Err(CommError::Engine {
                engine: "stream",
                detail: "the communication stream ended before answering".into(),
            })
        });
        if let Some(group) = &self.group {
            group.record_wait(started.elapsed());
        }
        result
    }

    /// [`Self::wait`], and how long the caller waited (the communication it did not hide).
    pub fn wait_timed(self) -> (CommResult<T>, Duration) {
        let started = Instant::now();
        let result = self.wait();
        (result, started.elapsed())
    }
}

impl<T: Clone> Work<T> {
    /// This work, waited for by whichever of its holders asks first (the others get the same
    /// result): one collective's result read by several consumers, on any thread.
    pub fn shared(self) -> SharedWork<T> {
        SharedWork {
            work: Mutex::new(Some(self)),
            result: OnceLock::new(),
        }
    }
}

/// A [`Work`] several holders read ([`Work::shared`]).
#[derive(Debug)]
pub struct SharedWork<T> {
    work: Mutex<Option<Work<T>>>,
    result: OnceLock<CommResult<T>>,
}

impl<T: Clone> SharedWork<T> {
    /// The collective's result, waiting for it the first time (as [`Work::wait`]).
    pub fn get(&self) -> CommResult<T> {
        // The lock is held through the wait, so the result is taken from the channel once.
        let mut work = self.work.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(work) = work.take() {
            let _ = self.result.set(work.wait());
        }
        self.result.get().cloned().unwrap_or_else(|| {
            Err(CommError::Engine {
                engine: "stream",
                detail: "a shared collective's result was never set".into(),
            })
        })
    }
}

/// A group's communication thread: collectives submitted to it run one at a time, in
/// submission order, while the submitter goes on.
pub struct CommStream {
    group: Group,
    label: String,
    jobs: Mutex<Option<Sender<Job>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for CommStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommStream")
            .field("group", &self.group.name())
            .field("label", &self.label)
            .finish()
    }
}

impl CommStream {
    /// A stream over `group`; `label` names its thread (and its errors).
    pub fn new(group: &Group, label: &str) -> Arc<Self> {
        let (tx, rx) = channel::<Job>();
        let worker_group = group.clone();
        let worker = std::thread::Builder::new()
            .name(label.to_string())
            .spawn(move || {
                flashover_comm::mark_background_thread();
                for job in rx {
                    job(&worker_group);
                }
            })
            .expect("spawn a communication stream thread");
        Arc::new(CommStream {
            group: group.clone(),
            label: label.to_string(),
            jobs: Mutex::new(Some(tx)),
            worker: Mutex::new(Some(worker)),
        })
    }

    /// The group its collectives run on.
    pub fn group(&self) -> &Group {
        &self.group
    }

    /// Runs `op` on the stream's thread after everything submitted before it: any
    /// [`crate::TensorCollectives`] call on the group, or several (`stream.submit(move |g|
    /// g.all_gather_tensor(t, 0))`). A panic in `op` (a collective failing inside a helper
    /// that cannot return errors) comes back as the error its payload carries.
    pub fn submit<T: Send + 'static>(
        &self,
        op: impl FnOnce(&Group) -> CommResult<T> + Send + 'static,
    ) -> Work<T> {
        let (tx, rx) = channel();
        let label = self.label.clone();
        let job: Job = Box::new(move |group| {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| op(group)))
                .unwrap_or_else(|payload| match payload.downcast::<CommError>() {
                    Ok(e) => Err(*e),
                    Err(payload) => Err(CommError::from_panic("stream", &label, &*payload)),
                });
            let _ = tx.send(result);
        });
        let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        let sent = jobs.as_ref().map(|jobs| jobs.send(job).is_ok());
        if sent != Some(true) {
            return Work::ready(Err(CommError::Engine {
                engine: "stream",
                detail: format!("the communication stream `{}` is gone", self.label),
            }));
        }
        Work {
            reply: rx,
            group: Some(self.group.clone()),
        }
    }
}

impl Drop for CommStream {
    fn drop(&mut self) {
        // Closing the channel ends the thread's loop once the work in flight is done.
        self.jobs.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(worker) = self.worker.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = worker.join();
        }
    }
}
