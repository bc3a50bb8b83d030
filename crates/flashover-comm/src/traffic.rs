//! Collective time per group, split by where it was spent: on the thread that needed the result
//! (exposed) or on a communication thread while that thread went on (background, overlapped
//! unless it was waited for). Kept by the [`crate::FlightRecorder`] for every group it records,
//! so a rank's report can say how much of each mesh axis's communication was hidden.

use std::cell::Cell;
use std::sync::Mutex;
use std::time::Duration;

thread_local! {
    static BACKGROUND: Cell<bool> = const { Cell::new(false) };
}

/// Marks the calling thread as a communication thread (a stream's, a gradient reducer's): the
/// time of the collectives it runs counts as [`GroupTraffic::background`].
pub fn mark_background_thread() {
    BACKGROUND.with(|b| b.set(true));
}

fn on_background_thread() -> bool {
    BACKGROUND.with(Cell::get)
}

/// One group's collective traffic as a rank saw it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GroupTraffic {
    /// The group's label: its name without the member list (`tp`, `dp+fsdp`, `world`).
    pub label: String,
    /// Calls (splits and barriers included).
    pub calls: u64,
    /// Bytes of this rank's largest buffer, summed over calls.
    pub bytes: u64,
    /// Wall time inside the group's collectives, on any thread.
    pub time: Duration,
    /// Of `time`, the part spent on communication threads ([`mark_background_thread`]).
    pub background: Duration,
    /// Time threads waited for background work on the group
    /// ([`crate::Communicator::record_wait`]).
    pub waited: Duration,
}

impl GroupTraffic {
    /// Communication the computing thread did not hide: its own calls, plus its waits for
    /// background ones up to their time (a wait beyond it was for the other work on the
    /// communication thread, staging or device work, not for a collective).
    pub fn exposed(&self) -> Duration {
        self.time.saturating_sub(self.background) + self.waited.min(self.background)
    }

    /// Background communication nobody waited for: hidden behind compute.
    pub fn overlapped(&self) -> Duration {
        self.background.saturating_sub(self.waited)
    }

    /// This traffic minus an earlier snapshot of the same group.
    pub fn since(&self, earlier: &GroupTraffic) -> GroupTraffic {
        GroupTraffic {
            label: self.label.clone(),
            calls: self.calls - earlier.calls,
            bytes: self.bytes - earlier.bytes,
            time: self.time.saturating_sub(earlier.time),
            background: self.background.saturating_sub(earlier.background),
            waited: self.waited.saturating_sub(earlier.waited),
        }
    }

    /// Adds `other`'s counts into this one.
    pub fn add(&mut self, other: &GroupTraffic) {
        self.calls += other.calls;
        self.bytes += other.bytes;
        self.time += other.time;
        self.background += other.background;
        self.waited += other.waited;
    }
}

/// Every recorded group's traffic, indexed like the recorder's group table.
#[derive(Debug, Default)]
pub(crate) struct TrafficTable {
    groups: Mutex<Vec<GroupTraffic>>,
}

impl TrafficTable {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<GroupTraffic>> {
        self.groups.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a group named `name`; its index follows the earlier ones'.
    pub(crate) fn register(&self, name: &str) {
        let label = name.split('[').next().unwrap_or(name).to_string();
        self.lock().push(GroupTraffic {
            label,
            ..GroupTraffic::default()
        });
    }

    /// A call of `bytes` on group `index` that took `took`, on the calling thread.
    pub(crate) fn call(&self, index: usize, bytes: usize, took: Duration) {
        let background = on_background_thread();
        if let Some(g) = self.lock().get_mut(index) {
            g.calls += 1;
            g.bytes += bytes as u64;
            g.time += took;
            if background {
                g.background += took;
            }
        }
    }

    /// A wait of `waited` for background work on group `index`. A background thread's wait
    /// (the gradient buckets' thread waiting for a reduce-scatter) keeps nothing from the
    /// training thread and is not counted.
    pub(crate) fn wait(&self, index: usize, waited: Duration) {
        if on_background_thread() {
            return;
        }
        if let Some(g) = self.lock().get_mut(index) {
            g.waited += waited;
        }
    }

    /// Every group's traffic so far, in registration order.
    pub(crate) fn snapshot(&self) -> Vec<GroupTraffic> {
        self.lock().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposed_and_overlapped_split_background_by_the_waits() {
        let table = std::sync::Arc::new(TrafficTable::default());
        table.register("tp[0, 1]");
        table.call(0, 64, Duration::from_millis(3));
        let background = table.clone();
        std::thread::spawn(move || {
            mark_background_thread();
            background.call(0, 128, Duration::from_millis(10));
            // A background thread's own wait keeps nothing from the training thread.
            background.wait(0, Duration::from_millis(50));
        })
        .join()
        .unwrap();
        table.wait(0, Duration::from_millis(4));
        let g = &table.snapshot()[0];
        assert_eq!(g.label, "tp");
        assert_eq!((g.calls, g.bytes), (2, 192));
        assert_eq!(g.background, Duration::from_millis(10));
        assert_eq!(g.exposed(), Duration::from_millis(7));
        assert_eq!(g.overlapped(), Duration::from_millis(6));
        // A wait longer than the background collectives exposes no more than they took.
        table.wait(0, Duration::from_millis(20));
        let g = &table.snapshot()[0];
        assert_eq!(g.exposed(), Duration::from_millis(13));
        assert_eq!(g.overlapped(), Duration::ZERO);
        assert_eq!(g.exposed() + g.overlapped(), g.time);
    }
}
