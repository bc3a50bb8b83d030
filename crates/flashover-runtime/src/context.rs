//! What each rank's closure receives: its rank, the mesh, its device and its process groups.

use burn::tensor::Device;
use flashover_comm::{CommResult, CommStats, FlightRecorder, Group, GroupTraffic, HostBuffers};
use flashover_mesh::{Axis, DeviceMesh};
use std::sync::{Arc, Mutex};

/// One rank's view of the job. Built by the launcher (threads here; one process per rank later
/// with the same type), handed by value to the rank's code. Groups are values, never globals.
pub struct RankContext {
    rank: usize,
    mesh: DeviceMesh,
    device: Device,
    world: Group,
    /// The group along each axis, in [`Axis::ALL`] order (size 1 for axes of degree 1).
    axes: Vec<Group>,
    /// Groups over several axes created on request, kept for statistics.
    extra: Mutex<Vec<Group>>,
    /// The flight recorder of `world` and every group split from it, where the launcher
    /// records them: it also keeps their traffic.
    recorder: Option<Arc<FlightRecorder>>,
}

/// A second handle to the same rank: its groups are shared, not split again (for what keeps
/// the context beyond the rank's closure, such as a burn-train strategy).
impl Clone for RankContext {
    fn clone(&self) -> Self {
        RankContext {
            rank: self.rank,
            mesh: self.mesh.clone(),
            device: self.device.clone(),
            world: self.world.clone(),
            axes: self.axes.clone(),
            extra: Mutex::new(self.extra.lock().unwrap_or_else(|e| e.into_inner()).clone()),
            recorder: self.recorder.clone(),
        }
    }
}

impl RankContext {
    /// Builds the context of `rank`: splits `world` into one group per mesh axis.
    /// Collective: every rank of `world` must call it, in the same order.
    pub fn new(rank: usize, mesh: DeviceMesh, device: Device, world: Group) -> CommResult<Self> {
        let axes = Axis::ALL
            .iter()
            .map(|&axis| {
                let color = mesh.group_index(rank, &[axis]);
                world.split(color, mesh.coord(rank, axis), axis.name())
            })
            .collect::<CommResult<Vec<_>>>()?;
        Ok(RankContext {
            rank,
            mesh,
            device,
            world,
            axes,
            extra: Mutex::new(vec![]),
            recorder: None,
        })
    }

    /// This context with `recorder`, the flight recorder of its world group (and so of every
    /// group split from it), as the launcher sets it up.
    pub fn with_flight_recorder(mut self, recorder: Arc<FlightRecorder>) -> Self {
        self.recorder = Some(recorder);
        self
    }

    /// Collective traffic since the rank started, per mesh axis: every recorded group's,
    /// merged under the axes it spans that have more than one rank (`tp`; `dp+fsdp` for
    /// HSDP's replicas; `world` for the world group). Empty where the groups are not
    /// flight-recorded (a context built without [`Self::with_flight_recorder`]).
    pub fn traffic_by_axis(&self) -> Vec<GroupTraffic> {
        let Some(recorder) = &self.recorder else {
            return vec![];
        };
        let mut merged: Vec<GroupTraffic> = vec![];
        for group in recorder.traffic() {
            let label = self.axis_label(&group.label);
            match merged.iter_mut().find(|m| m.label == label) {
                Some(m) => m.add(&group),
                None => merged.push(GroupTraffic { label, ..group }),
            }
        }
        merged
    }

    /// The flight recorder of this rank's groups (its last calls, in order), where the launcher
    /// set one.
    pub fn flight_recorder(&self) -> Option<&Arc<FlightRecorder>> {
        self.recorder.as_ref()
    }

    /// This rank's byte-level collectives on host buffers so far, by purpose: a tensor's bytes
    /// staged by [`crate::TensorCollectives`], control values, or neither (a strategy handing
    /// the engine a host buffer of its own). `None` where the groups are not flight-recorded.
    pub fn host_buffers(&self) -> Option<HostBuffers> {
        self.recorder.as_ref().map(|r| r.host_buffers())
    }

    /// `label` (`dp+fsdp`, `tp`, `world`) with the axes of one rank dropped; a label that
    /// names no axis, or only axes of one rank, is kept as it is.
    fn axis_label(&self, label: &str) -> String {
        let axes: Vec<Axis> = label
            .split('+')
            .filter_map(|name| Axis::ALL.into_iter().find(|a| a.name() == name))
            .collect();
        let wide: Vec<&str> = axes
            .iter()
            .filter(|&&a| self.mesh.degree(a) > 1)
            .map(|a| a.name())
            .collect();
        match wide.is_empty() {
            true => label.to_string(),
            false => wide.join("+"),
        }
    }

    /// This rank's global index.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the job.
    pub fn world_size(&self) -> usize {
        self.mesh.world_size()
    }

    /// The job's mesh.
    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }

    /// This rank's coordinate along `axis`.
    pub fn coord(&self, axis: Axis) -> usize {
        self.mesh.coord(self.rank, axis)
    }

    /// The device this rank computes on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The group of all ranks.
    pub fn world(&self) -> &Group {
        &self.world
    }

    /// The group of ranks that differ from this one only along `axis`.
    pub fn group(&self, axis: Axis) -> &Group {
        let i = Axis::ALL
            .iter()
            .position(|&a| a == axis)
            .expect("every axis is in ALL");
        &self.axes[i]
    }

    /// The group of ranks that differ from this one only along `axes` (e.g. `[Dp, Fsdp]` for
    /// all data-parallel replicas of an HSDP job). Collective over the world: every rank must
    /// call it with the same axes, in the same order.
    pub fn subgroup(&self, axes: &[Axis]) -> CommResult<Group> {
        let color = self.mesh.group_index(self.rank, axes);
        let ranks = self.mesh.group_ranks(self.rank, axes);
        let key = ranks
            .iter()
            .position(|&r| r == self.rank)
            .expect("own group");
        let label = axes.iter().map(|a| a.name()).collect::<Vec<_>>().join("+");
        let group = self.world.split(color, key, &label)?;
        self.extra
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(group.clone());
        Ok(group)
    }

    /// Communication counters of every group of this rank, merged.
    pub fn comm_stats(&self) -> CommStats {
        let mut total = self.world.stats();
        for g in &self.axes {
            total.merge(&g.stats());
        }
        for g in self.extra.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            total.merge(&g.stats());
        }
        total
    }
}
