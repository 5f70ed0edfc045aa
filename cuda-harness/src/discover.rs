//! Finding tandem's CUDA C sources in the workspace. Shared by the build script (which compiles
//! every file for the host) and the NVRTC test (which compiles every file for the GPU), so both
//! see the same files, and a new kernel is picked up without registering it anywhere.

use std::path::{Path, PathBuf};

/// The folders, relative to the workspace root, searched (recursively) for `.cu` files.
pub const KERNEL_FOLDERS: &[&str] = &[
    "core/src/cuda/kernels",
    "ops/src",
    "optim/src",
    "dist/src",
    "cuda-harness/kernels",
];

/// The folder of `tandem.cuh`, relative to the workspace root; on the include path of every
/// host compile, and supplied by name to every NVRTC compile.
pub const SHARED_HEADER_FOLDER: &str = "core/src/cuda/kernels";

/// One `.cu` file.
#[derive(Clone, Debug)]
pub struct KernelFile {
    /// The file's stem (`runtime`), unique in the workspace.
    pub name: String,
    /// Its path.
    pub path: PathBuf,
    /// The `.cuh` headers beside it (which it may include by name), `tandem.cuh` excepted.
    pub headers: Vec<PathBuf>,
}

/// Every `.cu` file under [`KERNEL_FOLDERS`], sorted by path. Errors if two share a stem.
pub fn kernel_files(root: &Path) -> Result<Vec<KernelFile>, String> {
    let mut paths = Vec::new();
    for folder in KERNEL_FOLDERS {
        walk(&root.join(folder), &mut paths).map_err(|e| format!("reading {folder}: {e}"))?;
    }
    paths.sort();
    let mut files: Vec<KernelFile> = Vec::new();
    for path in paths {
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .ok_or_else(|| format!("{} has no UTF-8 name", path.display()))?
            .to_string();
        if let Some(other) = files.iter().find(|f| f.name == name) {
            return Err(format!(
                "{} and {} have the same name; kernel file names must be unique",
                other.path.display(),
                path.display()
            ));
        }
        let folder = path.parent().unwrap_or(root);
        let mut headers: Vec<PathBuf> = std::fs::read_dir(folder)
            .map_err(|e| format!("reading {}: {e}", folder.display()))?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "cuh"))
            .filter(|p| p.file_name().is_some_and(|n| n != "tandem.cuh"))
            .collect();
        headers.sort();
        files.push(KernelFile {
            name,
            path,
            headers,
        });
    }
    Ok(files)
}

fn walk(folder: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    if !folder.is_dir() {
        return Ok(());
    }
    for entry in std::fs::read_dir(folder)? {
        let path = entry?.path();
        if path.is_dir() {
            walk(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "cu") {
            out.push(path);
        }
    }
    Ok(())
}
