//! Gives the emulated NVRTC the SONAME `libnvrtc.so`, the first name cudarc asks the dynamic
//! loader for (see cuda-emu/build.rs), and tells cargo when the embedded headers change.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=include/tandem_emu.h");
    println!("cargo:rerun-if-changed=../../cuda-harness/include/tandem_host.h");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnvrtc.so");
}
