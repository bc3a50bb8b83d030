//! Element types the collective layer moves and reduces.

use crate::op::ReduceOp;
use serde::{Deserialize, Serialize};
use std::fmt;

/// The element type of a buffer, carried next to raw bytes so engines can reduce them and peers
/// can detect a mismatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// 32-bit unsigned integer.
    U32,
    /// 64-bit unsigned integer.
    U64,
    /// Byte.
    U8,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// Whether the elements are floating point.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U32 => "u32",
            DType::U64 => "u64",
            DType::U8 => "u8",
        };
        f.write_str(s)
    }
}

/// A plain-old-data element type with a [`DType`] tag and the arithmetic reductions need.
///
/// Reductions accumulate in [`Element::Acc`] (`f32` for the 16-bit floats, the type itself
/// otherwise) and round once at the end, in a fixed rank order.
pub trait Element: bytemuck::Pod + Send + Sync + PartialEq + fmt::Debug + 'static {
    /// The tag of this type.
    const DTYPE: DType;
    /// Accumulator type for reductions.
    type Acc: Copy;
    /// Widen to the accumulator.
    fn to_acc(self) -> Self::Acc;
    /// Round back from the accumulator.
    fn from_acc(acc: Self::Acc) -> Self;
    /// Combine two accumulators with `op` (`Avg` combines like `Sum`).
    fn combine(op: ReduceOp, a: Self::Acc, b: Self::Acc) -> Self::Acc;
    /// Divide an accumulated sum by the group size (for `Avg`).
    fn div_count(acc: Self::Acc, n: usize) -> Self::Acc;
}

macro_rules! float_element {
    ($t:ty, $tag:expr) => {
        impl Element for $t {
            const DTYPE: DType = $tag;
            type Acc = $t;
            fn to_acc(self) -> $t {
                self
            }
            fn from_acc(acc: $t) -> $t {
                acc
            }
            fn combine(op: ReduceOp, a: $t, b: $t) -> $t {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a + b,
                    ReduceOp::Max => a.max(b),
                    ReduceOp::Min => a.min(b),
                }
            }
            fn div_count(acc: $t, n: usize) -> $t {
                acc / n as $t
            }
        }
    };
}

macro_rules! int_element {
    ($t:ty, $tag:expr) => {
        impl Element for $t {
            const DTYPE: DType = $tag;
            type Acc = $t;
            fn to_acc(self) -> $t {
                self
            }
            fn from_acc(acc: $t) -> $t {
                acc
            }
            fn combine(op: ReduceOp, a: $t, b: $t) -> $t {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Max => a.max(b),
                    ReduceOp::Min => a.min(b),
                }
            }
            fn div_count(acc: $t, n: usize) -> $t {
                acc / n as $t
            }
        }
    };
}

macro_rules! half_element {
    ($t:ty, $tag:expr) => {
        impl Element for $t {
            const DTYPE: DType = $tag;
            type Acc = f32;
            fn to_acc(self) -> f32 {
                self.to_f32()
            }
            fn from_acc(acc: f32) -> $t {
                <$t>::from_f32(acc)
            }
            fn combine(op: ReduceOp, a: f32, b: f32) -> f32 {
                <f32 as Element>::combine(op, a, b)
            }
            fn div_count(acc: f32, n: usize) -> f32 {
                acc / n as f32
            }
        }
    };
}

float_element!(f32, DType::F32);
float_element!(f64, DType::F64);
int_element!(i32, DType::I32);
int_element!(i64, DType::I64);
int_element!(u32, DType::U32);
int_element!(u64, DType::U64);
int_element!(u8, DType::U8);
half_element!(half::f16, DType::F16);
half_element!(half::bf16, DType::BF16);

/// Calls `$body` with `$t` bound to the Rust type of `$dtype`.
macro_rules! with_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $t = f32;
                $body
            }
            $crate::DType::F64 => {
                type $t = f64;
                $body
            }
            $crate::DType::F16 => {
                type $t = half::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            $crate::DType::I32 => {
                type $t = i32;
                $body
            }
            $crate::DType::I64 => {
                type $t = i64;
                $body
            }
            $crate::DType::U32 => {
                type $t = u32;
                $body
            }
            $crate::DType::U64 => {
                type $t = u64;
                $body
            }
            $crate::DType::U8 => {
                type $t = u8;
                $body
            }
        }
    };
}
pub(crate) use with_dtype;
