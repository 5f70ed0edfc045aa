//! Run-time selection of the widest vector instructions for elementwise loops.
//!
//! The crate is compiled for baseline x86-64 (SSE2: 4 f32 lanes). [`wide_simd_fn`] defines a
//! function that runs an `#[inline(always)]` body compiled three times (AVX-512F, AVX2 + FMA,
//! baseline) and picks the widest one the CPU has, so that the loops LLVM auto-vectorises in
//! that body move 16 (or 8) f32 lanes at a time. (`parallel::parallel` is the one rule for when a
//! kernel forks onto the rayon pool.)

/// Defines `fn $name<generics>(args) -> ret` that calls `$body(args)` compiled for AVX-512F,
/// else AVX2 + FMA, else the baseline, chosen at run time. `$body` must be `#[inline(always)]`
/// (and so must any helper it calls that holds a hot loop) so that it is compiled with the
/// enabled features.
///
/// ```text
/// wide_simd_fn!(
///     /// doc
///     pub(crate) fn add_wide[T: FloatElement](a: &[T], b: &mut [T]) = add_body
/// );
/// ```
macro_rules! wide_simd_fn {
    (
        $(#[$meta:meta])*
        $vis:vis fn $name:ident [$($generics:tt)*] ($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?
            = $body:path
    ) => {
        $(#[$meta])*
        $vis fn $name<$($generics)*>($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512<$($generics)*>($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2<$($generics)*>($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU supports AVX-512F, checked just above.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU supports AVX2 and FMA, checked just above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}
pub(crate) use wide_simd_fn;

/// The method form of [`wide_simd_fn`]: defines `$name<T: FloatElement>(&self, …)`, which
/// runs the `#[inline(always)]` method `$owner::$body` compiled for the widest vector
/// instructions this CPU has.
///
/// ```text
/// wide_simd_method!(
///     /// doc
///     pub(crate) fn fill = Im2col::fill_tile(&self, t: usize, x: &[T], cols: &mut [T])
/// );
/// ```
macro_rules! wide_simd_method {
    ($(#[$meta:meta])* $vis:vis fn $name:ident = $owner:ident::$body:ident(&self $(, $arg:ident: $ty:ty)*)) => {
        $(#[$meta])*
        $vis fn $name<T: FloatElement>(&self $(, $arg: $ty)*) {
            $crate::cpu::simd::wide_simd_fn!(
                fn dispatch[T: FloatElement](this: &$owner $(, $arg: $ty)*) = $owner::$body
            );
            dispatch::<T>(self $(, $arg)*)
        }
    };
}
pub(crate) use wide_simd_method;

#[cfg(test)]
mod tests {
    #[inline(always)]
    fn scaled_sum<F: Fn(f32) -> f32>(x: &[f32], f: F) -> f32 {
        x.iter().map(|&v| f(v)).sum()
    }

    wide_simd_fn!(
        /// Test function: `Σ f(x)` through the dispatcher.
        fn scaled_sum_wide[F: Fn(f32) -> f32](x: &[f32], f: F) -> f32 = scaled_sum
    );

    #[test]
    fn dispatched_function_computes_what_its_body_computes() {
        let x: Vec<f32> = (0..100).map(|i| i as f32).collect();
        assert_eq!(scaled_sum_wide(&x, |v| 2.0 * v), 9900.0);
    }
}
