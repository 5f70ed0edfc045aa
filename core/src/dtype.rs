//! Element types: the `DType` tag carried by every tensor and the `Element` trait that ties a
//! Rust scalar type to its tag and to its variant of CPU storage.

use half::{bf16, f16};
use std::fmt;

use crate::alloc::{Pool, Pools};
use crate::storage::CpuStorage;

/// The element type of a tensor.
///
/// f32 is the working type; f64 is used for gradient checks; f16 and bf16 for storage, gradient
/// compression and mixed precision; i64 for class labels; u8 for raw images.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit IEEE float (`f32`).
    F32,
    /// 64-bit IEEE float (`f64`).
    F64,
    /// 16-bit IEEE half float (`half::f16`).
    F16,
    /// 16-bit brain float (`half::bf16`): f32's exponent range with an 8-bit mantissa.
    BF16,
    /// 64-bit signed integer (`i64`).
    I64,
    /// 8-bit unsigned integer (`u8`).
    U8,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    /// Whether the dtype is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// The lower-case name used in messages and in checkpoint files.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I64 => "i64",
            DType::U8 => "u8",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust scalar type that can be stored in a tensor.
pub trait Element: Copy + Send + Sync + PartialOrd + fmt::Debug + 'static {
    /// The tag of this type.
    const DTYPE: DType;
    /// Lossy conversion used by casts and by reference computations.
    fn to_f64(self) -> f64;
    /// Lossy conversion used by casts (floats to integers truncate toward zero and saturate).
    fn from_f64(v: f64) -> Self;
    /// The zero of the type.
    const ZERO: Self;
    /// Borrows the storage as a slice of this type, if it holds this type.
    fn slice(storage: &CpuStorage) -> Option<&[Self]>;
    /// Mutably borrows the storage as a slice of this type, if it holds this type.
    fn slice_mut(storage: &mut CpuStorage) -> Option<&mut [Self]>;
    /// Wraps a vector as storage.
    fn into_storage(data: Vec<Self>) -> CpuStorage;
    /// The caching allocator's free buffers of this type.
    #[doc(hidden)]
    fn pool(pools: &mut Pools) -> &mut Pool<Self>;
}

macro_rules! element {
    ($t:ty, $variant:ident, $field:ident, $to:expr, $from:expr, $zero:expr) => {
        impl Element for $t {
            const DTYPE: DType = DType::$variant;
            #[inline]
            fn to_f64(self) -> f64 {
                #[allow(clippy::redundant_closure_call)]
                ($to)(self)
            }
            #[inline]
            fn from_f64(v: f64) -> Self {
                #[allow(clippy::redundant_closure_call)]
                ($from)(v)
            }
            const ZERO: Self = $zero;
            fn slice(storage: &CpuStorage) -> Option<&[Self]> {
                match storage {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn slice_mut(storage: &mut CpuStorage) -> Option<&mut [Self]> {
                match storage {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn into_storage(data: Vec<Self>) -> CpuStorage {
                CpuStorage::$variant(data)
            }
            fn pool(pools: &mut Pools) -> &mut Pool<Self> {
                &mut pools.$field
            }
        }
    };
}

element!(f32, F32, f32, |x: f32| x as f64, |v: f64| v as f32, 0.0);
element!(f64, F64, f64, |x: f64| x, |v: f64| v, 0.0);
element!(f16, F16, f16, |x: f16| x.to_f64(), f16::from_f64, f16::ZERO);
element!(
    bf16,
    BF16,
    bf16,
    |x: bf16| x.to_f64(),
    bf16::from_f64,
    bf16::ZERO
);
element!(i64, I64, i64, |x: i64| x as f64, |v: f64| v as i64, 0);
element!(u8, U8, u8, |x: u8| x as f64, |v: f64| v as u8, 0);

/// A floating-point element in which tandem's kernels compute (f32 and f64).
pub trait FloatElement:
    Element
    + num_traits::Float
    + std::iter::Sum
    + Default
    + std::ops::AddAssign
    + std::ops::SubAssign
    + std::ops::MulAssign
{
    /// Conversion from an f32 constant.
    fn from_f32(v: f32) -> Self;
}

impl FloatElement for f32 {
    #[inline]
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl FloatElement for f64 {
    #[inline]
    fn from_f32(v: f32) -> Self {
        v as f64
    }
}

/// A 16-bit float stored in tensors for mixed precision (f16 and bf16). Kernels load it,
/// compute in f32 and round the result once on the way out.
pub trait HalfElement: Element + crate::cpu::convert::HalfSlice {
    /// Widens to f32 (exact).
    fn to_f32(self) -> f32;
    /// Rounds an f32 to the nearest value of this type (ties to even).
    fn from_f32(v: f32) -> Self;
}

impl HalfElement for f16 {
    #[inline]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

impl HalfElement for bf16 {
    #[inline]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

impl DType {
    /// Whether the dtype is one of the 16-bit floats (f16, bf16) that ops store but compute in
    /// f32.
    pub fn is_half(self) -> bool {
        matches!(self, DType::F16 | DType::BF16)
    }
}

/// Runs a generic expression with `$T` bound to the 16-bit float type of `$dtype` (f16 or
/// bf16, a [`HalfElement`]); other dtypes yield `Error::UnsupportedDType` naming `$op`.
#[macro_export]
macro_rules! with_half_type {
    ($op:expr, $dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F16 => {
                type $T = $crate::half::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $T = $crate::half::bf16;
                $body
            }
            other => Err($crate::Error::UnsupportedDType {
                op: $op,
                dtype: other,
                supported: "f16, bf16",
            }),
        }
    };
}

/// Runs a generic expression with `$T` bound to the float type of `$dtype` (f32 or f64);
/// other dtypes yield `Error::UnsupportedDType` naming `$op`.
#[macro_export]
macro_rules! with_float_type {
    ($op:expr, $dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            other => Err($crate::Error::UnsupportedDType {
                op: $op,
                dtype: other,
                supported: "f32, f64",
            }),
        }
    };
}

/// Runs a generic expression with `$T` bound to the Rust type of any `$dtype`.
#[macro_export]
macro_rules! with_element_type {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::DType::F16 => {
                type $T = $crate::half::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $T = $crate::half::bf16;
                $body
            }
            $crate::DType::I64 => {
                type $T = i64;
                $body
            }
            $crate::DType::U8 => {
                type $T = u8;
                $body
            }
        }
    };
}
