//! Atomic checkpoint writes, and the clean-up of temporary files that a killed save left.
//!
//! A save writes its bytes to a temporary file next to the target, named
//! `.{file}.tmp-{host}-{pid}-{n}` (`host` is this machine's name with every character other
//! than ASCII letters, digits and `_` replaced by `_`; `pid` the writing process; `n` a
//! counter within it), flushes it, renames it over the target and flushes the directory. A
//! process killed between the first write and the rename leaves its temporary file behind.
//!
//! **What counts as stale.** Every save and load of a checkpoint first removes the stale
//! temporary files *of that checkpoint* — names of exactly the form above for the same
//! `{file}`, and regular files only; nothing else in the directory is touched. A temporary
//! file is stale when
//! - it was written on this host by a process that no longer exists (`kill(pid, 0)` reports
//!   no such process) — removed at once; or
//! - it has not been modified for [`STALE_AFTER`] (one hour) — whatever its host or pid.
//!
//! So a concurrent writer's file survives: on this host its pid is alive, and a writer on
//! another host sharing the directory (NFS) keeps modifying its file while it writes, which
//! takes seconds, not an hour. The age bound covers what the pid check cannot see: writers on
//! other hosts, and a dead writer whose pid has since been reused (after a reboot, say). A save
//! stalled for over an hour between two writes would lose its temporary file and fail at the
//! rename with an error; it never corrupts the target. Temporary files of the older
//! `.{file}.tmp-{pid}-{n}` form, which recorded no host, fall under the age bound only.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use crate::{Error, Result};

/// How long a temporary file may go unmodified before any save or load of its checkpoint
/// removes it, whoever wrote it.
pub const STALE_AFTER: Duration = Duration::from_secs(3600);

/// Writes `bytes` to a fresh temporary file next to `path`, flushes it, renames it over `path`
/// and flushes the directory, so `path` always holds either the old or the new contents.
/// Stale temporary files of `path` are removed first (see the module documentation).
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |source| Error::Io { path: p, source }
    };
    let file_name = path.file_name().ok_or_else(|| Error::Format {
        path: path.to_path_buf(),
        msg: "cannot save checkpoint: the path has no file name".to_string(),
    })?;
    let dir = directory_of(path);
    // Best effort: a directory we cannot list still takes the save (which reports its own
    // error if the directory is unusable).
    let _ = remove_stale_temporary_files(path);
    let temp = dir.join(format!(
        "{}{}-{}-{}",
        temp_prefix(&file_name.to_string_lossy()),
        host_tag(),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let written = (|| -> Result<()> {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temp)
            .map_err(io(&temp))?;
        file.write_all(bytes).map_err(io(&temp))?;
        file.sync_all().map_err(io(&temp))?;
        drop(file);
        fs::rename(&temp, path).map_err(io(path))
    })();
    if let Err(e) = written {
        // The temporary file is ours alone; leaving it would litter the directory.
        let _ = fs::remove_file(&temp);
        return Err(e);
    }
    sync_directory(&dir).map_err(io(&dir))
}

/// Removes the stale temporary files that interrupted saves of the checkpoint at `path` left
/// in its directory, and returns them. Only names of the checkpoint's own temporary-file form
/// are considered, and only when stale: written on this host by a process that is gone, or
/// unmodified for [`STALE_AFTER`] (see the module documentation). [`save_checkpoint`] and
/// [`load_checkpoint`] call this themselves.
///
/// [`save_checkpoint`]: super::save_checkpoint
/// [`load_checkpoint`]: super::load_checkpoint
pub fn remove_stale_temporary_files(path: impl AsRef<Path>) -> Result<Vec<PathBuf>> {
    let path = path.as_ref();
    let Some(file_name) = path.file_name() else {
        return Ok(Vec::new());
    };
    let dir = directory_of(path);
    let prefix = temp_prefix(&file_name.to_string_lossy());
    let entries = fs::read_dir(&dir).map_err(|source| Error::Io {
        path: dir.clone(),
        source,
    })?;
    let host = host_tag();
    let now = SystemTime::now();
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(prefix.as_str())) else {
            continue;
        };
        let Some(writer) = TempWriter::parse(rest) else {
            continue;
        };
        // Never follow a link or touch a directory that merely has the right name.
        let Ok(meta) = fs::symlink_metadata(entry.path()) else {
            continue;
        };
        if !meta.is_file() {
            continue;
        }
        let old = meta
            .modified()
            .ok()
            .and_then(|m| now.duration_since(m).ok())
            .is_some_and(|age| age >= STALE_AFTER);
        let writer_gone = writer.host.as_deref() == Some(host.as_str())
            && writer.pid != std::process::id()
            && !process_exists(writer.pid);
        if (old || writer_gone) && fs::remove_file(entry.path()).is_ok() {
            removed.push(entry.path());
        }
    }
    Ok(removed)
}

/// Who wrote a temporary file, from the part of its name after `.{file}.tmp-`.
struct TempWriter {
    /// `None` for the older form without a host.
    host: Option<String>,
    pid: u32,
}

impl TempWriter {
    fn parse(rest: &str) -> Option<Self> {
        let parts: Vec<&str> = rest.split('-').collect();
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        match parts.as_slice() {
            [host, pid, n] if is_host_tag(host) && digits(pid) && digits(n) => Some(TempWriter {
                host: Some(host.to_string()),
                pid: pid.parse().ok()?,
            }),
            [pid, n] if digits(pid) && digits(n) => Some(TempWriter {
                host: None,
                pid: pid.parse().ok()?,
            }),
            _ => None,
        }
    }
}

fn temp_prefix(file_name: &str) -> String {
    format!(".{file_name}.tmp-")
}

fn directory_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

fn is_host_tag(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// This machine's name as it appears in temporary-file names (see the module documentation).
fn host_tag() -> String {
    let raw = hostname().unwrap_or_else(|| "unknown".to_string());
    let tag: String = raw
        .chars()
        .take(64)
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    if tag.is_empty() {
        "unknown".to_string()
    } else {
        tag
    }
}

#[cfg(unix)]
fn hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: the pointer and length describe `buf`, which lives for the call; gethostname
    // writes at most `len` bytes.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Some(String::from_utf8_lossy(&buf[..end]).into_owned())
}

#[cfg(not(unix))]
fn hostname() -> Option<String> {
    None
}

/// Whether a process with this pid exists on this host (a process we may not signal exists
/// too). Without a way to ask, every process is assumed alive, leaving the age bound.
#[cfg(unix)]
fn process_exists(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return true;
    };
    if pid <= 0 {
        return true;
    }
    // SAFETY: kill with signal 0 only checks whether the process exists and may be signalled;
    // it has no memory-safety preconditions.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

#[cfg(not(unix))]
fn process_exists(_pid: u32) -> bool {
    true
}

/// Flushes a directory entry change (the rename) to disk. Only Unix can open a directory as a
/// file; elsewhere the rename itself is the best available guarantee.
fn sync_directory(dir: &Path) -> std::io::Result<()> {
    if cfg!(unix) {
        File::open(dir)?.sync_all()
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch_dir(test: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tandem-atomic-{}-{test}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// The pid of a process that has exited (and been reaped).
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        pid
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    fn make_old(path: &Path) {
        let file = OpenOptions::new().write(true).open(path).unwrap();
        file.set_modified(SystemTime::now() - STALE_AFTER - Duration::from_secs(60))
            .unwrap();
    }

    #[test]
    fn temporary_names_parse_back_to_their_writer() {
        let w = TempWriter::parse("node_7-123-4").unwrap();
        assert_eq!((w.host.as_deref(), w.pid), (Some("node_7"), 123));
        let w = TempWriter::parse("123-4").unwrap();
        assert_eq!((w.host, w.pid), (None, 123));
        for bad in [
            "", "x", "1-2-3-4", "a.b-1-2", "host-1-", "host--2", "host-x-2",
        ] {
            assert!(TempWriter::parse(bad).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn only_stale_temporary_files_of_that_checkpoint_are_removed() {
        let dir = scratch_dir("stale");
        let target = dir.join("model.safetensors");
        let host = host_tag();
        let me = std::process::id();
        let dead = dead_pid();
        let create = |name: &str| {
            fs::write(dir.join(name), b"partial").unwrap();
            dir.join(name)
        };
        // Stale: a dead writer on this host; anything of the form unmodified for an hour.
        create(&format!(".model.safetensors.tmp-{host}-{dead}-0"));
        let old_foreign = create(&format!(".model.safetensors.tmp-otherhost-{me}-3"));
        make_old(&old_foreign);
        let old_legacy = create(&format!(".model.safetensors.tmp-{dead}-1"));
        make_old(&old_legacy);
        // Kept: a live writer (this process), a fresh file from another host, a fresh legacy
        // file, another checkpoint's temporary file, unrelated files, and a directory.
        create(&format!(".model.safetensors.tmp-{host}-{me}-9"));
        create(&format!(".model.safetensors.tmp-otherhost-{dead}-0"));
        create(&format!(".model.safetensors.tmp-{dead}-2"));
        let other = create(&format!(".other.safetensors.tmp-{host}-{dead}-0"));
        make_old(&other);
        create("notes.txt");
        create(&format!(".model.safetensors.tmp-{host}-{dead}-0-copy"));
        fs::create_dir(dir.join(format!(".model.safetensors.tmp-{host}-{dead}-5"))).unwrap();

        let mut removed: Vec<String> = remove_stale_temporary_files(&target)
            .unwrap()
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        removed.sort();
        let mut want = vec![
            format!(".model.safetensors.tmp-{host}-{dead}-0"),
            format!(".model.safetensors.tmp-otherhost-{me}-3"),
            format!(".model.safetensors.tmp-{dead}-1"),
        ];
        want.sort();
        assert_eq!(removed, want);
        let mut kept = vec![
            format!(".model.safetensors.tmp-{host}-{me}-9"),
            format!(".model.safetensors.tmp-otherhost-{dead}-0"),
            format!(".model.safetensors.tmp-{dead}-2"),
            format!(".other.safetensors.tmp-{host}-{dead}-0"),
            "notes.txt".to_string(),
            format!(".model.safetensors.tmp-{host}-{dead}-0-copy"),
            format!(".model.safetensors.tmp-{host}-{dead}-5"),
        ];
        kept.sort();
        assert_eq!(names(&dir), kept);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_next_save_or_load_removes_what_a_killed_save_left() {
        use std::collections::BTreeMap;

        use crate::checkpoint::{load_checkpoint, save_checkpoint};
        use crate::LinearConfig;

        let dir = scratch_dir("killed-save");
        let target = dir.join("latest.safetensors");
        let model = LinearConfig::new(2, 2).init().unwrap();
        let leftover = format!(".latest.safetensors.tmp-{}-{}-0", host_tag(), dead_pid());
        let unrelated = format!(".other.safetensors.tmp-{}-{}-0", host_tag(), dead_pid());
        fs::write(dir.join(&leftover), b"half a checkpoint").unwrap();
        fs::write(dir.join(&unrelated), b"someone else's").unwrap();
        save_checkpoint(&target, &model, &[], &BTreeMap::new()).unwrap();
        assert_eq!(
            names(&dir),
            [unrelated.clone(), "latest.safetensors".into()]
        );

        fs::write(dir.join(&leftover), b"half a checkpoint").unwrap();
        load_checkpoint(&target).unwrap();
        assert_eq!(names(&dir), [unrelated, "latest.safetensors".into()]);
        fs::remove_dir_all(&dir).unwrap();
    }
}
