//! The runtime's tests in one test binary: the launcher, the tensor bridge, and (with the
//! `wgpu` feature) the wgpu device.

mod launch;
mod tensor_bridge;
mod wgpu_device;
