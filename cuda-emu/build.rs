//! Gives the emulated driver the SONAME `libcuda.so`, the first name cudarc asks the dynamic
//! loader for. Once tandem has opened the emulator by its path, glibc answers cudarc's later
//! `dlopen("libcuda.so")` with it (it matches names against the SONAMEs of loaded libraries),
//! even on a machine where a real driver is on the loader's path.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so");
}
