//! The tensor bridge on a wgpu device (Mesa lavapipe in CI): tensors come back on the device
//! they left, with the values a Flex run gives.
#![cfg(feature = "wgpu")]

use burn::tensor::Tensor;
use flashover_runtime::{CommError, DeviceChoice, Launch, ReduceOp, TensorCollectives};

#[test]
fn collectives_on_wgpu_tensors_match_flex() {
    let run = |choice: DeviceChoice| {
        let device = choice.device(0).unwrap();
        Launch::new(2)
            .unwrap()
            .device(device.clone())
            .run(|ctx| {
                let r = ctx.rank() as f32;
                let x = Tensor::<2>::from_floats([[r, 1.0 + r], [2.0, 3.0 * r]], ctx.device());
                let sum = ctx.world().all_reduce_tensor(x.clone(), ReduceOp::Sum)?;
                let gathered = ctx.world().all_gather_tensor(x, 1)?;
                assert_eq!(
                    sum.device(),
                    *ctx.device(),
                    "results stay on the rank's device"
                );
                Ok::<_, CommError>((
                    sum.into_data().try_to_vec::<f32>().unwrap(),
                    gathered.into_data().try_to_vec::<f32>().unwrap(),
                ))
            })
            .unwrap()
    };
    let on_wgpu = run(DeviceChoice::Wgpu);
    assert_eq!(on_wgpu, run(DeviceChoice::Flex));
    assert_eq!(on_wgpu[0].0, vec![1.0, 3.0, 4.0, 3.0]);
}
