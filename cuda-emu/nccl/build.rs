//! Gives the emulated NCCL the SONAME `libnccl.so.2`, the name tandem's library search opens
//! (NVIDIA's packages ship only that name), as the emulated driver and cuBLAS carry theirs.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl.so.2");
}
