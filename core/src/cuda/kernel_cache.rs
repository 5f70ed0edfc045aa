//! The kernel cache: compiled CUBINs kept in memory for the life of the process and on disk,
//! so each kernel file is compiled once per architecture and NVRTC version, not once per run.
//!
//! The disk folder is the first of `$TANDEM_KERNEL_CACHE`, `$XDG_CACHE_HOME/tandem/kernels` and
//! `$HOME/.cache/tandem/kernels`. An entry's name is a SHA-256 of the source and its headers, the
//! NVRTC options, the architecture and NVRTC's version, so a change to any of them compiles
//! afresh. Entries are written to a temporary file and renamed into place, so concurrent
//! processes never see a partial entry; each entry carries a checksum, and one that is corrupt
//! or unreadable is ignored and rewritten. A cache that cannot be written only costs compile
//! time.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

use super::launch::{KernelSource, TANDEM_CUH};
use super::nvrtc::{lock, parse_resources, Arch, CompileOptions, Cubin, Nvrtc};
use crate::{Error, Result};

/// The environment variable that names the on-disk kernel cache folder.
pub const TANDEM_KERNEL_CACHE: &str = "TANDEM_KERNEL_CACHE";

/// Where compiled kernels are kept on disk.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum DiskCache {
    /// The folder from the environment (see the module docs), if one can be named.
    #[default]
    Default,
    /// This folder.
    At(PathBuf),
    /// Memory only.
    Off,
}

/// Compiled kernels, in memory and (optionally) in a folder on disk. [`compile`](super::nvrtc::compile) uses one per
/// process; tests make their own.
#[derive(Debug)]
pub struct KernelCache {
    memory: Mutex<HashMap<String, Arc<Cubin>>>,
    folder: Option<PathBuf>,
}

impl KernelCache {
    /// An empty in-memory cache over `disk`.
    pub fn new(disk: DiskCache) -> Self {
        KernelCache {
            memory: Mutex::new(HashMap::new()),
            folder: match disk {
                DiskCache::Default => default_cache_dir(),
                DiskCache::At(folder) => Some(folder),
                DiskCache::Off => None,
            },
        }
    }

    /// The folder entries are written to, if any.
    pub fn folder(&self) -> Option<&Path> {
        self.folder.as_deref()
    }

    /// The file an entry for `source`, `arch` and `options` lives in (whether or not it exists
    /// yet); `None` without a folder. Needs NVRTC, whose version is part of the key.
    pub fn entry_path(
        &self,
        source: &'static KernelSource,
        arch: Arch,
        options: &CompileOptions,
    ) -> Result<Option<PathBuf>> {
        let nvrtc = Nvrtc::get(options.device)?;
        let key = cache_key(source, arch, &options.nvrtc_options(arch), nvrtc.version);
        Ok(self.folder.as_ref().map(|f| f.join(format!("{key}.cubin"))))
    }

    /// Compiles `source` for `arch`, or returns the cached result; see
    /// [`compile`](super::nvrtc::compile).
    pub fn compile(
        &self,
        source: &'static KernelSource,
        arch: Arch,
        options: &CompileOptions,
    ) -> Result<Arc<Cubin>> {
        let nvrtc = Nvrtc::get(options.device)?;
        let nvrtc_options = options.nvrtc_options(arch);
        let key = cache_key(source, arch, &nvrtc_options, nvrtc.version);
        if let Some(hit) = lock(&self.memory).get(&key) {
            return Ok(hit.clone());
        }
        let entry = self.folder.as_ref().map(|f| f.join(format!("{key}.cubin")));
        let cached = entry.as_deref().and_then(|path| read_entry(path, &key));
        let (image, log) = match cached {
            Some(hit) => hit,
            None => {
                if !nvrtc.supports(arch) {
                    return Err(Error::DeviceUnavailable {
                        device: options.device,
                        reason: format!(
                            "NVRTC {}.{} cannot compile for {arch}; it supports {}",
                            nvrtc.version.0,
                            nvrtc.version.1,
                            nvrtc
                                .archs
                                .iter()
                                .map(|a| format!("sm_{a}"))
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    });
                }
                let (image, log) = nvrtc.compile(source, arch, &nvrtc_options)?;
                if let (Some(folder), Some(path)) = (&self.folder, &entry) {
                    // A cache that cannot be written only costs compile time next run.
                    let _ = write_entry(folder, path, &key, &image, &log);
                }
                (image, log)
            }
        };
        let cubin = Arc::new(Cubin {
            source: source.name,
            arch,
            nvrtc_version: nvrtc.version,
            resources: parse_resources(&log),
            image,
            log,
        });
        lock(&self.memory).insert(key, cubin.clone());
        Ok(cubin)
    }
}

/// The on-disk cache folder from the environment, if one can be named.
pub fn default_cache_dir() -> Option<PathBuf> {
    let var = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var(TANDEM_KERNEL_CACHE)
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("tandem/kernels")))
        .or_else(|| var("HOME").map(|d| d.join(".cache/tandem/kernels")))
}

/// The cache key: everything that changes the CUBIN.
fn cache_key(source: &KernelSource, arch: Arch, options: &[String], version: (i32, i32)) -> String {
    let mut hash = Sha256::new();
    let mut field = |bytes: &[u8]| {
        hash.update((bytes.len() as u64).to_le_bytes());
        hash.update(bytes);
    };
    field(b"tandem-cubin-v1");
    field(source.name.as_bytes());
    field(source.source.as_bytes());
    for header in std::iter::once(&TANDEM_CUH).chain(source.headers) {
        field(header.name.as_bytes());
        field(header.source.as_bytes());
    }
    for option in options {
        field(option.as_bytes());
    }
    field(arch.to_string().as_bytes());
    field(format!("nvrtc {}.{}", version.0, version.1).as_bytes());
    hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

const ENTRY_MAGIC: &[u8; 12] = b"TANDEMCUBIN\x01";

/// A cache entry's bytes. Layout: magic, SHA-256 of the rest, then key, log and image, each as a little-endian
/// u64 length and its bytes.
pub fn encode_entry(key: &str, image: &[u8], log: &str) -> Vec<u8> {
    let mut body = Vec::with_capacity(image.len() + log.len() + 96);
    for part in [key.as_bytes(), log.as_bytes(), image] {
        body.extend_from_slice(&(part.len() as u64).to_le_bytes());
        body.extend_from_slice(part);
    }
    let mut out = Vec::with_capacity(body.len() + 44);
    out.extend_from_slice(ENTRY_MAGIC);
    out.extend_from_slice(&Sha256::digest(&body));
    out.extend_from_slice(&body);
    out
}

/// The (image, log) of an entry, or `None` if it is not a whole, uncorrupted entry for `key`.
pub fn decode_entry(bytes: &[u8], key: &str) -> Option<(Vec<u8>, String)> {
    let rest = bytes.strip_prefix(ENTRY_MAGIC)?;
    let (checksum, body) = rest.split_at_checked(32)?;
    if Sha256::digest(body).as_slice() != checksum {
        return None;
    }
    let mut parts = Vec::with_capacity(3);
    let mut at = body;
    for _ in 0..3 {
        let (len, tail) = at.split_at_checked(8)?;
        let len = usize::try_from(u64::from_le_bytes(len.try_into().ok()?)).ok()?;
        let (part, tail) = tail.split_at_checked(len)?;
        parts.push(part);
        at = tail;
    }
    if !at.is_empty() || parts[0] != key.as_bytes() {
        return None;
    }
    let log = String::from_utf8(parts[1].to_vec()).ok()?;
    Some((parts[2].to_vec(), log))
}

fn read_entry(path: &Path, key: &str) -> Option<(Vec<u8>, String)> {
    decode_entry(&std::fs::read(path).ok()?, key)
}

/// Writes an entry atomically: a temporary file in the same folder, renamed into place.
fn write_entry(
    folder: &Path,
    path: &Path,
    key: &str,
    image: &[u8],
    log: &str,
) -> std::io::Result<()> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    std::fs::create_dir_all(folder)?;
    let temp = folder.join(format!(
        ".{key}.{}.{}.tmp",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = std::fs::write(&temp, encode_entry(key, image, log))
        .and_then(|()| std::fs::rename(&temp, path));
    if result.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    static SOURCE: KernelSource = KernelSource {
        name: "t",
        source: "extern \"C\" __global__ void k() {}",
        headers: &[],
    };

    #[test]
    fn cache_entries_round_trip_and_reject_corruption() {
        let key = cache_key(&SOURCE, Arch::new(8, 0), &["-std=c++17".into()], (13, 0));
        let entry = encode_entry(&key, b"\x7fELF image", "log text");
        assert_eq!(
            decode_entry(&entry, &key),
            Some((b"\x7fELF image".to_vec(), "log text".to_string()))
        );
        assert_eq!(decode_entry(&entry, "another key"), None);
        for cut in [0, 11, 40, entry.len() - 1] {
            assert_eq!(
                decode_entry(&entry[..cut], &key),
                None,
                "truncated at {cut}"
            );
        }
        let mut flipped = entry.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert_eq!(decode_entry(&flipped, &key), None);
    }

    #[test]
    fn concurrent_writers_leave_one_whole_entry_and_no_temporary_files() {
        let dir = tempfile::tempdir().unwrap();
        let key = "ab".repeat(32);
        let path = dir.path().join(format!("{key}.cubin"));
        std::thread::scope(|scope| {
            for writer in 0..8u8 {
                let (dir, path, key) = (dir.path(), &path, &key);
                scope.spawn(move || {
                    for _ in 0..20 {
                        write_entry(dir, path, key, &vec![writer; 64 * 1024], "log").unwrap();
                        // Readers never see a partial entry.
                        let (image, _) = read_entry(path, key).expect("a whole entry");
                        assert!(image.iter().all(|&b| b == image[0]));
                    }
                });
            }
        });
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, [std::ffi::OsString::from(format!("{key}.cubin"))]);
    }

    #[test]
    fn cache_key_changes_with_every_input() {
        let base = cache_key(&SOURCE, Arch::new(8, 0), &["-std=c++17".into()], (13, 0));
        assert_ne!(
            base,
            cache_key(&SOURCE, Arch::new(9, 0), &["-std=c++17".into()], (13, 0))
        );
        assert_ne!(
            base,
            cache_key(&SOURCE, Arch::new(8, 0), &["-std=c++14".into()], (13, 0))
        );
        assert_ne!(
            base,
            cache_key(&SOURCE, Arch::new(8, 0), &["-std=c++17".into()], (13, 1))
        );
        static OTHER: KernelSource = KernelSource {
            name: "t",
            source: "extern \"C\" __global__ void k() { }",
            headers: &[],
        };
        assert_ne!(
            base,
            cache_key(&OTHER, Arch::new(8, 0), &["-std=c++17".into()], (13, 0))
        );
        assert_eq!(
            base,
            cache_key(&SOURCE, Arch::new(8, 0), &["-std=c++17".into()], (13, 0))
        );
    }
}
