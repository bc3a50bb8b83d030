//! The in-process launcher: one thread per rank, every failure reported with its rank.

use crate::context::RankContext;
use burn::tensor::Device;
use flashover_comm::{BlobExchange, CommError, FaultPlan, FlightRecorder, Group, ThreadWorld};
use flashover_mesh::{DeviceMesh, MeshError};
use std::error::Error;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

/// The error type rank closures return: anything that converts into a boxed error
/// (`CommError`, `String`, your own error types).
pub type RankError = Box<dyn Error + Send + Sync + 'static>;

/// Anything that describes a mesh: a [`DeviceMesh`], a mesh string (`"dp=2,tp=2"`) or a number
/// of ranks (plain data parallel).
pub trait IntoMesh {
    /// The validated mesh.
    fn into_mesh(self) -> Result<DeviceMesh, MeshError>;
}

impl IntoMesh for DeviceMesh {
    fn into_mesh(self) -> Result<DeviceMesh, MeshError> {
        Ok(self)
    }
}

impl IntoMesh for &DeviceMesh {
    fn into_mesh(self) -> Result<DeviceMesh, MeshError> {
        Ok(self.clone())
    }
}

impl IntoMesh for &str {
    fn into_mesh(self) -> Result<DeviceMesh, MeshError> {
        self.parse()
    }
}

impl IntoMesh for usize {
    fn into_mesh(self) -> Result<DeviceMesh, MeshError> {
        DeviceMesh::data_parallel(self)
    }
}

/// One rank's failure.
#[derive(Debug, Clone)]
pub struct RankFailure {
    /// Global rank.
    pub rank: usize,
    /// Whether the rank panicked (rather than returning an error).
    pub panicked: bool,
    /// The panic message or the error's display, with its sources.
    pub message: String,
    /// How likely this failure is the cause rather than a consequence (0 = most likely).
    severity: u8,
}

/// Why a launch failed.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The mesh description is invalid.
    #[error(transparent)]
    Mesh(#[from] MeshError),
    /// A rank failed. `cause` is the likeliest root cause (a panic or a rank's own error before
    /// the consequent collective failures of its peers); `all` lists every failed rank.
    #[error("rank {} {}: {}{}", cause.rank, if cause.panicked { "panicked" } else { "failed" }, cause.message, others_note(all.len()))]
    Rank {
        /// The likeliest root cause.
        cause: RankFailure,
        /// Every failed rank, in rank order.
        all: Vec<RankFailure>,
    },
}

fn others_note(n: usize) -> String {
    if n > 1 {
        format!(" ({} ranks failed in all)", n)
    } else {
        String::new()
    }
}

impl LaunchError {
    /// The failure of `rank`, if it failed.
    pub fn failure_of(&self, rank: usize) -> Option<&RankFailure> {
        match self {
            LaunchError::Rank { all, .. } => all.iter().find(|f| f.rank == rank),
            LaunchError::Mesh(_) => None,
        }
    }
}

/// A launch under construction: mesh, device, collective timeout and injected faults.
#[derive(Debug, Clone)]
pub struct Launch {
    mesh: DeviceMesh,
    device: Device,
    timeout: Duration,
    faults: FaultPlan,
    /// Where a failing rank writes its flight record (none: not written).
    flight_dir: Option<PathBuf>,
    /// Each rank thread's own world and device, instead of the thread engine's world.
    own_worlds: Option<OwnWorlds>,
}

/// How a rank thread joins a world of its own engine: `join(rank, size, exchange)` returns its
/// world group, where `exchange` hands every rank every rank's blob once all have given theirs
/// (NCCL's unique id and each rank's GPU, say).
type JoinWorld = dyn Fn(
        usize,
        usize,
        &dyn Fn(&[u8]) -> Result<Vec<Vec<u8>>, String>,
    ) -> flashover_comm::CommResult<Group>
    + Send
    + Sync;

/// The device of each rank thread, by rank.
type RankDevice = dyn Fn(usize) -> Result<Device, String> + Send + Sync;

/// Rank threads that each join their own engine's world on their own device.
#[derive(Clone)]
struct OwnWorlds {
    join: Arc<JoinWorld>,
    device: Arc<RankDevice>,
}

impl std::fmt::Debug for OwnWorlds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OwnWorlds")
    }
}

/// Calls each rank's flight recorder keeps (see [`flashover_comm::FlightRecorder`]).
pub const FLIGHT_CAPACITY: usize = 256;

impl Launch {
    /// A launch over `mesh` on the Flex (CPU) device with the default timeout.
    pub fn new(mesh: impl IntoMesh) -> Result<Self, LaunchError> {
        Ok(Launch {
            mesh: mesh.into_mesh()?,
            device: Device::flex(),
            timeout: flashover_comm::DEFAULT_TIMEOUT,
            faults: FaultPlan::new(),
            flight_dir: std::env::var_os("FLASHOVER_FLIGHT_DIR").map(PathBuf::from),
            own_worlds: None,
        })
    }

    /// Every rank thread joins a world of another engine with `join` (e.g. NCCL's, one GPU
    /// per rank) on its own device, `device(rank)`, instead of sharing the thread engine's
    /// world and [`Self::device`]. A rank that cannot get its device or join fails naming why,
    /// and its peers stop at once. Faults cannot be injected into such a world.
    pub fn own_worlds(
        mut self,
        join: impl Fn(
            usize,
            usize,
            &dyn Fn(&[u8]) -> Result<Vec<Vec<u8>>, String>,
        ) -> flashover_comm::CommResult<Group>
        + Send
        + Sync
        + 'static,
        device: impl Fn(usize) -> Result<Device, String> + Send + Sync + 'static,
    ) -> Self {
        self.own_worlds = Some(OwnWorlds {
            join: Arc::new(join),
            device: Arc::new(device),
        });
        self
    }

    /// Every rank records its last collectives; a rank whose work fails writes them to
    /// `dir/flight-rank{r}.json` (`flashover debug flight DIR` reads them). Defaults to the
    /// `FLASHOVER_FLIGHT_DIR` environment variable.
    pub fn flight_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.flight_dir = Some(dir.into());
        self
    }

    /// The device every rank computes on (each rank gets a clone).
    pub fn device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// How long a rank waits at any collective for its peers before failing.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Faults to inject (tests).
    pub fn faults(mut self, faults: FaultPlan) -> Self {
        self.faults = faults;
        self
    }

    /// Runs `body` once per rank, each on its own thread, and returns the results in rank
    /// order, or the failure that most likely caused the others.
    pub fn run<T, E, F>(self, body: F) -> Result<Vec<T>, LaunchError>
    where
        T: Send,
        E: Into<RankError>,
        F: Fn(RankContext) -> Result<T, E> + Sync,
    {
        let n = self.mesh.world_size();
        let flight = self.flight_dir.as_deref();
        let outcomes: Vec<Result<T, RankFailure>> = match &self.own_worlds {
            None => {
                let comms = ThreadWorld::new(n)
                    .timeout(self.timeout)
                    .faults(self.faults.clone())
                    .build();
                on_rank_threads(comms, |rank, comm| {
                    let comm = Arc::new(comm);
                    let world = Group::new(comm.clone());
                    let leave = |reason: &str| comm.leave(reason);
                    let place = (self.mesh.clone(), self.device.clone());
                    run_rank(rank, world, place, flight, &body, leave)
                })
            }
            Some(own) => {
                if !self.faults.is_empty() {
                    let cause = unjoined(
                        0,
                        "faults cannot be injected into an engine's own world".into(),
                    );
                    return Err(LaunchError::Rank {
                        all: vec![cause.clone()],
                        cause,
                    });
                }
                let exchange = BlobExchange::new(n);
                on_rank_threads(vec![(); n], |rank, ()| {
                    let device = match (own.device)(rank) {
                        Ok(device) => device,
                        Err(why) => {
                            let _ = exchange.all_gather(rank, Err(why.clone()), self.timeout);
                            // A missing device is a cause; its peers' failed joins follow.
                            return Err(RankFailure {
                                severity: 0,
                                ..unjoined(rank, why)
                            });
                        }
                    };
                    let gather = |blob: &[u8]| exchange.all_gather(rank, Ok(blob), self.timeout);
                    let world = match (own.join)(rank, n, &gather) {
                        Ok(world) => world,
                        Err(e) => {
                            let _ = exchange.all_gather(rank, Err(e.to_string()), self.timeout);
                            return Err(unjoined(rank, e.to_string()));
                        }
                    };
                    let place = (self.mesh.clone(), device);
                    run_rank(rank, world, place, flight, &body, |_| {})
                })
            }
        };
        let mut results = Vec::with_capacity(n);
        let mut failures = vec![];
        for outcome in outcomes {
            match outcome {
                Ok(v) => results.push(v),
                Err(f) => failures.push(f),
            }
        }
        if failures.is_empty() {
            return Ok(results);
        }
        let cause = failures
            .iter()
            .min_by_key(|f| (f.severity, f.rank))
            .expect("non-empty")
            .clone();
        Err(LaunchError::Rank {
            cause,
            all: failures,
        })
    }
}

impl Launch {
    /// Runs `body` as rank `world.rank()` of a job whose ranks are processes (MPI, or any
    /// engine whose world group this process holds): one rank here, its peers elsewhere. The
    /// world must have the mesh's size. Returns this rank's result or its failure.
    pub fn run_process<T, E, F>(self, world: Group, body: F) -> Result<T, LaunchError>
    where
        E: Into<RankError>,
        F: Fn(RankContext) -> Result<T, E>,
    {
        let n = self.mesh.world_size();
        if world.size() != n {
            return Err(LaunchError::Rank {
                cause: RankFailure {
                    rank: world.rank(),
                    panicked: false,
                    message: format!(
                        "the mesh `{}` needs {n} ranks but the job has {} processes",
                        self.mesh.to_spec(),
                        world.size()
                    ),
                    severity: 1,
                },
                all: vec![],
            });
        }
        let rank = world.rank();
        let flight = self.flight_dir.as_deref();
        let place = (self.mesh, self.device);
        let abandon = world.clone();
        run_rank(rank, world, place, flight, &body, |_| {}).map_err(|failure| {
            // Peers in other processes would wait for this rank until their deadlines (and
            // MPI's finalisation would wait for them): end the job for them now.
            if abandon.size() > 1 {
                abandon.abandon(&failure.message);
            }
            LaunchError::Rank {
                cause: failure.clone(),
                all: vec![failure],
            }
        })
    }
}

/// Runs `body` as `rank` on `mesh` and `device`, turning errors and panics into a
/// [`RankFailure`]; `leave` is told why the rank's work ended (so in-process peers can stop
/// waiting for it). Every call on `world` (and groups split from it) is flight-recorded; a
/// failing rank writes its record into `flight` when set.
fn run_rank<T, E, F>(
    rank: usize,
    world: Group,
    (mesh, device): (DeviceMesh, Device),
    flight: Option<&Path>,
    body: &F,
    leave: impl FnOnce(&str),
) -> Result<T, RankFailure>
where
    E: Into<RankError>,
    F: Fn(RankContext) -> Result<T, E>,
{
    let recorder = FlightRecorder::new(world.rank(), FLIGHT_CAPACITY);
    let world = world.recorded(recorder.clone());
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let ctx = RankContext::new(rank, mesh, device, world)
            .map_err(|e| Box::new(e) as RankError)?
            .with_flight_recorder(recorder.clone());
        body(ctx).map_err(Into::into)
    }));
    let result = match outcome {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(RankFailure {
            rank,
            panicked: false,
            message: chain(&*e),
            severity: severity(&*e),
        }),
        // A collective that failed where no error can be returned (inside Burn's backward)
        // panics with the `CommError` itself, so it is ranked like a returned one.
        Err(payload) if payload.downcast_ref::<CommError>().is_some() => {
            let e = payload.downcast_ref::<CommError>().expect("checked");
            Err(RankFailure {
                rank,
                panicked: true,
                message: e.to_string(),
                severity: severity(e),
            })
        }
        Err(payload) => {
            let message = flashover_comm::panic_message(&*payload);
            Err(RankFailure {
                rank,
                panicked: true,
                message,
                severity: 0,
            })
        }
    };
    let result = result.map_err(|mut failure| {
        if let Some(dir) = flight {
            match recorder.dump(dir) {
                Ok(path) => failure.message += &format!(" [flight record: {}]", path.display()),
                Err(e) => failure.message += &format!(" [flight record not written: {e}]"),
            }
        }
        failure
    });
    // Peers still waiting for this rank fail at once, naming it and why.
    let reason = match &result {
        Ok(_) => "returned from its work".to_string(),
        Err(f) if f.panicked => format!("panicked: {}", f.message),
        Err(f) => format!("failed: {}", f.message),
    };
    leave(&reason);
    result
}

/// Runs `rank_body(rank, input)` on one thread per rank, each handed its own of `inputs` (in
/// rank order), and returns their outcomes in rank order.
fn on_rank_threads<I: Send, T: Send>(
    inputs: Vec<I>,
    rank_body: impl Fn(usize, I) -> Result<T, RankFailure> + Sync,
) -> Vec<Result<T, RankFailure>> {
    // The first rank to panic prints Rust's report, the others a line each.
    let reported = Arc::new(AtomicBool::new(false));
    std::thread::scope(|s| {
        let handles: Vec<_> = inputs
            .into_iter()
            .enumerate()
            .map(|(rank, input)| {
                let rank_body = &rank_body;
                let reported = reported.clone();
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    // Autodiff graphs of deep models recurse; give each rank room.
                    .stack_size(64 << 20)
                    .spawn_scoped(s, move || {
                        crate::panic_report::mark_rank_thread(rank, reported);
                        rank_body(rank, input)
                    })
                    .expect("spawn rank thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank threads catch their panics"))
            .collect()
    })
}

/// The failure of a rank that could not get its device or join its world.
fn unjoined(rank: usize, message: String) -> RankFailure {
    RankFailure {
        rank,
        panicked: false,
        message,
        severity: 1,
    }
}

/// The error's display followed by its sources.
fn chain(e: &(dyn Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        // Wrappers that display their source already (`#[error("{0}")]`) add nothing.
        let text = inner.to_string();
        if !s.contains(&text) {
            s += &format!(": {text}");
        }
        src = inner.source();
    }
    s
}

/// Ranks whose own code failed come first; collective failures that name another rank
/// (timeouts, departures, poisoned groups) are consequences.
fn severity(e: &(dyn Error + 'static)) -> u8 {
    let mut cur: Option<&(dyn Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(c) = err.downcast_ref::<CommError>() {
            return match c {
                CommError::Timeout { .. } | CommError::Mismatch { .. } => 2,
                CommError::PeerLeft { .. } => 3,
                CommError::Poisoned { .. } => 4,
                _ => 1,
            };
        }
        cur = err.source();
    }
    1
}

/// Runs `body` on every rank of `mesh` (a [`DeviceMesh`], a mesh string or a rank count) on
/// the Flex device with default settings, and returns the results in world-rank order. A mesh
/// string's axes may be written in any order (`ep=2,pp=2` is `pp=2,ep=2`): ranks are laid out
/// in the canonical axis order. See [`Launch`] for the options.
pub fn launch<T, E, F>(mesh: impl IntoMesh, body: F) -> Result<Vec<T>, LaunchError>
where
    T: Send,
    E: Into<RankError>,
    F: Fn(RankContext) -> Result<T, E> + Sync,
{
    Launch::new(mesh)?.run(body)
}
