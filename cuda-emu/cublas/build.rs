//! Gives the emulated cuBLAS the SONAME `libcublas.so`, the first name cudarc asks the dynamic
//! loader for, so that cudarc's open-by-name lands on the copy tandem opened by its path (as
//! for the emulated driver, `cuda-emu/build.rs`).
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcublas.so");
}
