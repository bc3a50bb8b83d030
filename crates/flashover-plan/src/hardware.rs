//! What the cluster is: devices per node, memory, compute and the two kinds of links.

use serde::{Deserialize, Serialize};

/// One kind of device and how its nodes are connected. Bandwidths are the *bus bandwidth* a
/// collective reaches per device (nccl-tests' `busbw`), not the raw link rate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hardware {
    /// Preset name or `custom`.
    pub name: String,
    /// Devices (ranks) per node.
    pub devices_per_node: usize,
    /// Memory per device, bytes.
    pub memory_bytes: f64,
    /// Usable fraction of the memory (the rest: allocator fragmentation, workspaces, the
    /// framework).
    pub usable_memory: f64,
    /// Dense peak FLOP/s per device at the training precision.
    pub peak_flops: f64,
    /// Fraction of the peak the model's matrix products reach (model FLOPs utilisation
    /// before communication and bubbles).
    pub efficiency: f64,
    /// Collective bus bandwidth between devices of one node, bytes/s per device.
    pub intra_node_bandwidth: f64,
    /// Latency of one collective step within a node, seconds.
    pub intra_node_latency: f64,
    /// Collective bus bandwidth across nodes, bytes/s per device.
    pub inter_node_bandwidth: f64,
    /// Latency of one collective step across nodes, seconds.
    pub inter_node_latency: f64,
}

const GB: f64 = 1e9;

impl Hardware {
    /// Presets: `h100`, `h200`, `a100` (SXM, 8 per node, NVLink inside a node, one 400 Gb/s
    /// (A100: 200 Gb/s) InfiniBand NIC per GPU across nodes; peaks are dense BF16), and `cpu`
    /// (this project's 2-core development machine with ranks as threads, measured: see
    /// `docs/benchmarks.md`).
    pub fn preset(name: &str) -> Option<Hardware> {
        let gpu = |name: &str, memory: f64, flops: f64, nvlink: f64, ib: f64| Hardware {
            name: name.into(),
            devices_per_node: 8,
            memory_bytes: memory,
            usable_memory: 0.9,
            peak_flops: flops,
            efficiency: 0.5,
            intra_node_bandwidth: nvlink,
            intra_node_latency: 10e-6,
            inter_node_bandwidth: ib,
            inter_node_latency: 20e-6,
        };
        Some(match name.to_ascii_lowercase().as_str() {
            // NVLink 4: 450 GB/s per direction, all-reduce busbw ~360 GB/s; NDR 400 Gb/s = 50
            // GB/s per GPU, ~40 GB/s reached.
            "h100" => gpu("h100", 80.0 * GB, 989e12, 360.0 * GB, 40.0 * GB),
            "h200" => gpu("h200", 141.0 * GB, 989e12, 360.0 * GB, 40.0 * GB),
            // NVLink 3: 300 GB/s per direction, ~230 GB/s busbw; HDR 200 Gb/s, ~20 GB/s.
            "a100" => gpu("a100", 80.0 * GB, 312e12, 230.0 * GB, 20.0 * GB),
            // Two cores, ranks as threads: fp32 matrix products of the reference model and
            // the thread engine's all-reduce busbw (docs/benchmarks.md); one "node".
            "cpu" => Hardware {
                name: "cpu".into(),
                devices_per_node: 64,
                memory_bytes: 24.0 * GB,
                usable_memory: 0.9,
                peak_flops: 20e9,
                efficiency: 1.0,
                intra_node_bandwidth: 2.97 * GB,
                intra_node_latency: 20e-6,
                inter_node_bandwidth: 2.97 * GB,
                inter_node_latency: 20e-6,
            },
            _ => return None,
        })
    }

    /// Names of the presets.
    pub const PRESETS: [&'static str; 4] = ["h100", "h200", "a100", "cpu"];

    /// Usable bytes per device.
    pub fn usable_bytes(&self) -> f64 {
        self.memory_bytes * self.usable_memory
    }

    /// What is wrong with the description (each problem named by field).
    pub fn validate(&self) -> Vec<String> {
        let mut errors = vec![];
        if self.devices_per_node == 0 {
            errors.push("hardware.devices_per_node must be at least 1".to_string());
        }
        for (name, v) in [
            ("memory_bytes", self.memory_bytes),
            ("peak_flops", self.peak_flops),
            ("intra_node_bandwidth", self.intra_node_bandwidth),
            ("inter_node_bandwidth", self.inter_node_bandwidth),
        ] {
            if v.is_nan() || v <= 0.0 {
                errors.push(format!("hardware.{name} = {v} must be positive"));
            }
        }
        for (name, v) in [
            ("usable_memory", self.usable_memory),
            ("efficiency", self.efficiency),
        ] {
            if v.is_nan() || v <= 0.0 || v > 1.0 {
                errors.push(format!("hardware.{name} = {v} must be in (0, 1]"));
            }
        }
        errors
    }
}
