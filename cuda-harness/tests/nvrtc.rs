//! Every CUDA C file of the workspace, compiled with tandem's own NVRTC path for sm_80 and sm_90
//! with the assembler's verbose report: any error fails, each kernel's registers and spills are
//! printed, and a kernel that spills must say why in its source (`// spills: <kernel>: <why>`).
//! Also the kernel cache, the library search agreeing with cudarc, and NVRTC's error reports.
//!
//! Without NVRTC each test prints `skipped: NVRTC not found (…)`; `TANDEM_REQUIRE_NVRTC=1` (set by
//! `.ci/run`, which installs NVRTC from pip and points `TANDEM_CUDA_LIBS` at it) makes that a
//! failure.

use std::sync::Arc;

use tandem_core::cuda::kernel_cache::{decode_entry, encode_entry, DiskCache, KernelCache};
use tandem_core::cuda::launch::KernelSource;
use tandem_core::cuda::libs::{self, CudaLibrary};
use tandem_core::cuda::nvrtc::{nvrtc_version, Arch, CompileError, CompileOptions};
use tandem_core::cuda::runtime_kernels::RUNTIME;
use tandem_core::{Device, Error};
use tandem_cuda_harness::{kernel_sources, nvrtc_available, KERNEL_LIBRARIES};

const ARCHS: [Arch; 2] = [Arch::new(8, 0), Arch::new(9, 0)];

#[test]
fn every_kernel_compiles_for_sm80_and_sm90_without_unexplained_spills() {
    if !nvrtc_available("every_kernel_compiles_for_sm80_and_sm90_without_unexplained_spills") {
        return;
    }
    let start = std::time::Instant::now();
    let sources = kernel_sources().expect("the kernel files can be read");
    let cache = KernelCache::new(DiskCache::Off);
    let verbose = CompileOptions {
        verbose: true,
        ..Default::default()
    };
    let mut failures = Vec::new();
    let mut table = vec![format!(
        "{:<28} {:>5} {:>5} {:>7} {:>6} {:>7} {:>7}",
        "kernel", "arch", "regs", "smem B", "stack", "spill-st", "spill-ld"
    )];
    for source in &sources {
        for arch in ARCHS {
            let cubin = match cache.compile(source, arch, &verbose) {
                Ok(cubin) => cubin,
                Err(e) => {
                    failures.push(format!("{}.cu for {arch}: {e}", source.name));
                    continue;
                }
            };
            assert!(
                !cubin.image.is_empty(),
                "{}.cu for {arch}: an empty CUBIN",
                source.name
            );
            if cubin.resources.is_empty() {
                failures.push(format!(
                    "{}.cu for {arch}: no kernels in the assembler's report",
                    source.name
                ));
            }
            for k in &cubin.resources {
                table.push(format!(
                    "{:<28} {:>5} {:>5} {:>7} {:>6} {:>7} {:>7}",
                    format!("{}:{}", source.name, k.kernel),
                    format!("sm_{}{}", arch.major, arch.minor),
                    k.registers,
                    k.shared_bytes,
                    k.stack_frame_bytes,
                    k.spill_store_bytes,
                    k.spill_load_bytes
                ));
                let explained = source.source.contains(&format!("// spills: {}:", k.kernel));
                if k.spill_store_bytes + k.spill_load_bytes > 0 && !explained {
                    failures.push(format!(
                        "{}.cu: kernel {} spills on {arch} ({} bytes stored, {} loaded); explain \
                         it with a comment `// spills: {}: <why>` or remove the spill",
                        source.name, k.kernel, k.spill_store_bytes, k.spill_load_bytes, k.kernel
                    ));
                }
                if !has_host_entry(source.name, &k.kernel) {
                    failures.push(format!(
                        "{}.cu: kernel {} has no host entry: follow it with TANDEM_HOST_EXPORT({})",
                        source.name, k.kernel, k.kernel
                    ));
                }
            }
        }
    }
    println!("{}", table.join("\n"));
    println!(
        "compiled {} kernel files for {} architectures in {:.2?}",
        sources.len(),
        ARCHS.len(),
        start.elapsed()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// Whether the harness's host library of `file` exports the kernel.
fn has_host_entry(file: &str, kernel: &str) -> bool {
    let Some(entry) = KERNEL_LIBRARIES.iter().find(|l| l.name == file) else {
        return false;
    };
    // SAFETY: built by the harness from tandem's kernels; only looked up, never called here.
    let library =
        unsafe { libloading::Library::new(entry.library) }.expect("open the host library");
    // SAFETY: the symbol is only checked for presence.
    unsafe { library.get::<*const ()>(format!("tandem_host_{kernel}").as_bytes()) }.is_ok()
}

/// A small kernel, so that the cache test's several compiles stay quick.
static SMALL: KernelSource = KernelSource {
    name: "small",
    source: "#include \"tandem.cuh\"\nextern \"C\" __global__ void halve(float* x, tandem_u64 n) {\n    TANDEM_GRID_STRIDE_LOOP(i, n) { x[i] *= 0.5f; }\n}\n",
    headers: &[],
};

#[test]
fn the_disk_cache_serves_entries_and_rewrites_corrupt_ones() {
    if !nvrtc_available("the_disk_cache_serves_entries_and_rewrites_corrupt_ones") {
        return;
    }
    let folder = tempfile::tempdir().unwrap();
    let options = CompileOptions::default();
    let arch = Arch::new(8, 0);
    let first = KernelCache::new(DiskCache::At(folder.path().to_path_buf()));
    let compiled = first.compile(&SMALL, arch, &options).unwrap();
    let entry = first
        .entry_path(&SMALL, arch, &options)
        .unwrap()
        .expect("a folder is set");
    assert!(entry.exists(), "the entry was written");
    let key = entry.file_stem().unwrap().to_str().unwrap().to_string();

    // A fresh cache (a new process) reads the entry instead of compiling: mark its log.
    std::fs::write(
        &entry,
        encode_entry(&key, &compiled.image, "marked by the test"),
    )
    .unwrap();
    let second = KernelCache::new(DiskCache::At(folder.path().to_path_buf()));
    let read = second.compile(&SMALL, arch, &options).unwrap();
    assert_eq!(read.log, "marked by the test");
    assert_eq!(read.image, compiled.image);
    // And keeps it in memory.
    assert!(Arc::ptr_eq(
        &read,
        &second.compile(&SMALL, arch, &options).unwrap()
    ));

    // A corrupt entry is ignored, compiled afresh and rewritten whole.
    std::fs::write(&entry, b"TANDEMCUBIN\x01 but then garbage").unwrap();
    let third = KernelCache::new(DiskCache::At(folder.path().to_path_buf()));
    let recompiled = third.compile(&SMALL, arch, &options).unwrap();
    assert_ne!(recompiled.log, "marked by the test");
    assert_eq!(recompiled.image, compiled.image, "NVRTC is deterministic");
    let rewritten =
        decode_entry(&std::fs::read(&entry).unwrap(), &key).expect("a valid entry again");
    assert_eq!(rewritten.0, compiled.image);

    // Another architecture is another entry.
    third.compile(&SMALL, Arch::new(9, 0), &options).unwrap();
    assert_eq!(std::fs::read_dir(folder.path()).unwrap().count(), 2);
}

#[test]
fn cudarc_opens_by_name_the_nvrtc_tandem_found() {
    if !nvrtc_available("cudarc_opens_by_name_the_nvrtc_tandem_found") {
        return;
    }
    let path = libs::locate(CudaLibrary::Nvrtc, Device::Cuda(0)).unwrap();
    println!("NVRTC: {}", path.display());
    // The test process's loader path does not hold NVRTC when it comes from TANDEM_CUDA_LIBS;
    // cudarc's open-by-name still finds it, through the SONAME of the library already open.
    // SAFETY: cudarc's presence check only opens and closes the library.
    assert!(unsafe { cudarc::nvrtc::sys::is_culib_present() });
    let (mut major, mut minor) = (0, 0);
    // SAFETY: ensure() has run (through locate), so cudarc finds the library; the pointers are
    // valid for one c_int each.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    assert_eq!(status, cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS);
    assert_eq!((major, minor), nvrtc_version(Device::Cuda(0)).unwrap());
}

#[test]
fn an_architecture_nvrtc_does_not_know_is_a_device_error() {
    if !nvrtc_available("an_architecture_nvrtc_does_not_know_is_a_device_error") {
        return;
    }
    let options = CompileOptions {
        device: Device::Cuda(3),
        ..Default::default()
    };
    let err = KernelCache::new(DiskCache::Off)
        .compile(&RUNTIME, Arch::new(5, 0), &options)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::DeviceUnavailable {
                device: Device::Cuda(3),
                ..
            }
        ),
        "{err}"
    );
    let msg = err.to_string();
    assert!(msg.contains("sm_50") && msg.contains("sm_90"), "{msg}");
}

#[test]
fn a_kernel_that_does_not_compile_reports_nvrtc_log() {
    if !nvrtc_available("a_kernel_that_does_not_compile_reports_nvrtc_log") {
        return;
    }
    static BROKEN: KernelSource = KernelSource {
        name: "broken",
        source: "#include \"tandem.cuh\"\nextern \"C\" __global__ void k(float* x) { x[0] = undeclared_name; }\n",
        headers: &[],
    };
    let err = KernelCache::new(DiskCache::Off)
        .compile(&BROKEN, Arch::new(8, 0), &CompileOptions::default())
        .unwrap_err();
    let Error::External { source, .. } = &err else {
        panic!("expected a compile error, got {err}");
    };
    let compile = source
        .downcast_ref::<CompileError>()
        .expect("a CompileError");
    assert!(compile.log.contains("undeclared_name"), "{}", compile.log);
    assert!(err.to_string().contains("broken.cu"), "{err}");
}
