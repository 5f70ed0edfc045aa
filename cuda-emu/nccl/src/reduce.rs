//! NCCL's data types and reduction operators, applied to raw bytes.
//!
//! A reduction combines the ranks' contributions in rank order (0, 1, …), each step rounded to
//! the data type (half types add in f32 and round back, as the GPU's `__hadd` does), so every
//! rank computes bitwise the same result, as NCCL's ring does. `ncclAvg` is computed as NCCL
//! computes it: for floating-point types every contribution is first multiplied by `1/nranks`
//! rounded to the type (NCCL's "pre-multiplied sum"), then summed; for integer types the sum
//! is divided by `nranks` at the end.

use half::{bf16, f16};

/// `ncclDataType_t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataType {
    /// `ncclInt8` (`i8`).
    Int8,
    /// `ncclUint8` (`u8`).
    Uint8,
    /// `ncclInt32` (`i32`).
    Int32,
    /// `ncclUint32` (`u32`).
    Uint32,
    /// `ncclInt64` (`i64`).
    Int64,
    /// `ncclUint64` (`u64`).
    Uint64,
    /// `ncclFloat16` (IEEE half).
    Float16,
    /// `ncclFloat32` (`f32`).
    Float32,
    /// `ncclFloat64` (`f64`).
    Float64,
    /// `ncclBfloat16` (bfloat16).
    Bfloat16,
}

impl DataType {
    /// The type of an `ncclDataType_t` value; `None` for one the emulator does not know (the
    /// FP8 types among them).
    pub fn from_raw(raw: i32) -> Option<DataType> {
        Some(match raw {
            0 => DataType::Int8,
            1 => DataType::Uint8,
            2 => DataType::Int32,
            3 => DataType::Uint32,
            4 => DataType::Int64,
            5 => DataType::Uint64,
            6 => DataType::Float16,
            7 => DataType::Float32,
            8 => DataType::Float64,
            9 => DataType::Bfloat16,
            _ => return None,
        })
    }

    /// The `ncclDataType_t` value.
    pub fn raw(self) -> i32 {
        self as i32
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::Int8 | DataType::Uint8 => 1,
            DataType::Float16 | DataType::Bfloat16 => 2,
            DataType::Int32 | DataType::Uint32 | DataType::Float32 => 4,
            DataType::Int64 | DataType::Uint64 | DataType::Float64 => 8,
        }
    }

    /// NCCL's name for it.
    pub fn name(self) -> &'static str {
        match self {
            DataType::Int8 => "ncclInt8",
            DataType::Uint8 => "ncclUint8",
            DataType::Int32 => "ncclInt32",
            DataType::Uint32 => "ncclUint32",
            DataType::Int64 => "ncclInt64",
            DataType::Uint64 => "ncclUint64",
            DataType::Float16 => "ncclFloat16",
            DataType::Float32 => "ncclFloat32",
            DataType::Float64 => "ncclFloat64",
            DataType::Bfloat16 => "ncclBfloat16",
        }
    }
}

/// `ncclRedOp_t` (the built-in operators).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RedOp {
    /// `ncclSum`.
    Sum,
    /// `ncclProd`.
    Prod,
    /// `ncclMax`.
    Max,
    /// `ncclMin`.
    Min,
    /// `ncclAvg` (see the module docs for how it is computed).
    Avg,
}

impl RedOp {
    /// The operator of an `ncclRedOp_t` value; `None` for a custom one (`ncclRedOpCreatePreMulSum`
    /// is not emulated) or garbage.
    pub fn from_raw(raw: i32) -> Option<RedOp> {
        Some(match raw {
            0 => RedOp::Sum,
            1 => RedOp::Prod,
            2 => RedOp::Max,
            3 => RedOp::Min,
            4 => RedOp::Avg,
            _ => return None,
        })
    }

    /// The `ncclRedOp_t` value.
    pub fn raw(self) -> i32 {
        self as i32
    }

    /// NCCL's name for it.
    pub fn name(self) -> &'static str {
        match self {
            RedOp::Sum => "ncclSum",
            RedOp::Prod => "ncclProd",
            RedOp::Max => "ncclMax",
            RedOp::Min => "ncclMin",
            RedOp::Avg => "ncclAvg",
        }
    }
}

/// An element type the reductions work on.
trait Elem: Copy {
    const FLOAT: bool;
    fn add(self, other: Self) -> Self;
    fn mul(self, other: Self) -> Self;
    fn max(self, other: Self) -> Self;
    fn min(self, other: Self) -> Self;
    /// `1/n` rounded to the type (floating-point types only).
    fn reciprocal(n: usize) -> Self;
    /// Division by `n` (integer types only).
    fn div(self, n: usize) -> Self;
}

macro_rules! int_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            const FLOAT: bool = false;
            fn add(self, other: Self) -> Self { self.wrapping_add(other) }
            fn mul(self, other: Self) -> Self { self.wrapping_mul(other) }
            fn max(self, other: Self) -> Self { Ord::max(self, other) }
            fn min(self, other: Self) -> Self { Ord::min(self, other) }
            fn reciprocal(_: usize) -> Self { 0 }
            fn div(self, n: usize) -> Self { self / (n as $t) }
        }
    )*};
}
int_elem!(i8, u8, i32, u32, i64, u64);

macro_rules! float_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            const FLOAT: bool = true;
            fn add(self, other: Self) -> Self { self + other }
            fn mul(self, other: Self) -> Self { self * other }
            fn max(self, other: Self) -> Self { <$t>::max(self, other) }
            fn min(self, other: Self) -> Self { <$t>::min(self, other) }
            fn reciprocal(n: usize) -> Self { (1.0 / n as f64) as $t }
            fn div(self, _: usize) -> Self { self }
        }
    )*};
}
float_elem!(f32, f64);

macro_rules! half_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            const FLOAT: bool = true;
            // `half` adds and multiplies in f32 and rounds back, as `__hadd`/`__hmul` do.
            fn add(self, other: Self) -> Self { self + other }
            fn mul(self, other: Self) -> Self { self * other }
            fn max(self, other: Self) -> Self { <$t>::max(self, other) }
            fn min(self, other: Self) -> Self { <$t>::min(self, other) }
            fn reciprocal(n: usize) -> Self { <$t>::from_f64(1.0 / n as f64) }
            fn div(self, _: usize) -> Self { self }
        }
    )*};
}
half_elem!(f16, bf16);

/// One step of a reduction over `n` elements: `first` (rank 0's contribution) initialises
/// `dst`, later steps combine into it. `nranks` is for `ncclAvg`; `last` applies the integer
/// average's final division.
///
/// # Safety
/// `dst` is valid for reads and writes of `n` elements of `dtype`, `src` for reads; neither
/// needs alignment. They may be the same address (never partially overlapping).
#[allow(clippy::too_many_arguments)]
pub unsafe fn combine(
    dtype: DataType,
    op: RedOp,
    dst: *mut u8,
    src: *const u8,
    n: usize,
    first: bool,
    last: bool,
    nranks: usize,
) {
    // SAFETY: forwarded from this function's contract, with the element type matching dtype.
    unsafe {
        match dtype {
            DataType::Int8 => step::<i8>(op, dst, src, n, first, last, nranks),
            DataType::Uint8 => step::<u8>(op, dst, src, n, first, last, nranks),
            DataType::Int32 => step::<i32>(op, dst, src, n, first, last, nranks),
            DataType::Uint32 => step::<u32>(op, dst, src, n, first, last, nranks),
            DataType::Int64 => step::<i64>(op, dst, src, n, first, last, nranks),
            DataType::Uint64 => step::<u64>(op, dst, src, n, first, last, nranks),
            DataType::Float16 => step::<f16>(op, dst, src, n, first, last, nranks),
            DataType::Float32 => step::<f32>(op, dst, src, n, first, last, nranks),
            DataType::Float64 => step::<f64>(op, dst, src, n, first, last, nranks),
            DataType::Bfloat16 => step::<bf16>(op, dst, src, n, first, last, nranks),
        }
    }
}

/// [`combine`] for one element type.
///
/// # Safety
/// As [`combine`], with `T` the data type's element.
unsafe fn step<T: Elem>(
    op: RedOp,
    dst: *mut u8,
    src: *const u8,
    n: usize,
    first: bool,
    last: bool,
    nranks: usize,
) {
    let dst = dst.cast::<T>();
    let src = src.cast::<T>();
    let scale = T::reciprocal(nranks.max(1));
    for i in 0..n {
        // SAFETY: i < n, within both ranges (the caller's contract); unaligned accesses.
        let x = unsafe { src.add(i).read_unaligned() };
        let x = if op == RedOp::Avg && T::FLOAT {
            x.mul(scale)
        } else {
            x
        };
        let value = if first {
            x
        } else {
            // SAFETY: as above.
            let acc = unsafe { dst.add(i).read_unaligned() };
            match op {
                RedOp::Sum | RedOp::Avg => acc.add(x),
                RedOp::Prod => acc.mul(x),
                RedOp::Max => acc.max(x),
                RedOp::Min => acc.min(x),
            }
        };
        let value = if last && op == RedOp::Avg && !T::FLOAT {
            value.div(nranks.max(1))
        } else {
            value
        };
        // SAFETY: as above.
        unsafe { dst.add(i).write_unaligned(value) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reduce<T: Copy>(dtype: DataType, op: RedOp, inputs: &[Vec<T>]) -> Vec<T> {
        let mut out = inputs[0].clone();
        let n = out.len();
        for (q, x) in inputs.iter().enumerate() {
            // SAFETY: both hold n elements of T.
            unsafe {
                combine(
                    dtype,
                    op,
                    out.as_mut_ptr().cast(),
                    x.as_ptr().cast(),
                    n,
                    q == 0,
                    q + 1 == inputs.len(),
                    inputs.len(),
                )
            };
        }
        out
    }

    #[test]
    fn every_op_on_floats_and_integers() {
        let f = vec![vec![1.0f32, -2.0, 3.0], vec![4.0, 5.0, -6.0]];
        assert_eq!(reduce(DataType::Float32, RedOp::Sum, &f), [5.0, 3.0, -3.0]);
        assert_eq!(
            reduce(DataType::Float32, RedOp::Prod, &f),
            [4.0, -10.0, -18.0]
        );
        assert_eq!(reduce(DataType::Float32, RedOp::Max, &f), [4.0, 5.0, 3.0]);
        assert_eq!(reduce(DataType::Float32, RedOp::Min, &f), [1.0, -2.0, -6.0]);
        assert_eq!(reduce(DataType::Float32, RedOp::Avg, &f), [2.5, 1.5, -1.5]);
        let i = vec![vec![7i64, -3], vec![2, 8], vec![0, 1]];
        assert_eq!(reduce(DataType::Int64, RedOp::Sum, &i), [9, 6]);
        // The integer average divides the sum (truncating, as C does).
        assert_eq!(reduce(DataType::Int64, RedOp::Avg, &i), [3, 2]);
    }

    #[test]
    fn the_float_average_pre_multiplies_in_the_type() {
        // Every contribution is multiplied by 1/n rounded to f16, then summed in f16: for some
        // values that differs from the exact average (v, for n equal contributions of v).
        let mut differ = 0;
        for n in [3usize, 5, 7] {
            for v in 1..64 {
                let x = f16::from_f64(v as f64);
                let got = reduce(DataType::Float16, RedOp::Avg, &vec![vec![x]; n])[0];
                let scaled = x * f16::from_f64(1.0 / n as f64);
                let want = (1..n).fold(scaled, |acc, _| acc + scaled);
                assert_eq!(got, want, "{n} ranks of {v}");
                differ += usize::from(got != x);
            }
        }
        assert!(
            differ > 0,
            "the pre-multiplied average never differed from the exact one"
        );
    }
}
