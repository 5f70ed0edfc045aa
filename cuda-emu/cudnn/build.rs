//! Gives the emulated cuDNN the SONAME `libcudnn.so`, the first name cudarc asks the dynamic
//! loader for, so that cudarc's open-by-name lands on the copy tandem opened by its path (as
//! for the emulated driver and cuBLAS), whatever file name the copy has (`libcudnn.so.9`).
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcudnn.so");
}
