//! Gives the emulated cuBLASLt the SONAME `libcublasLt.so`, the first name cudarc asks for.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcublasLt.so");
}
