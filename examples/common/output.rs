//! Printing that survives a reader who went away.
//!
//! Rust ignores SIGPIPE, so `println!` to a closed pipe — the launcher was killed, or the
//! output was piped into `head` — panics with "failed printing to stdout", and the panic
//! message is lost too. The examples print through [`say`] instead: when stdout is gone the
//! process exits at once and quietly with status 141 (128 + SIGPIPE, what a program killed by
//! SIGPIPE reports to a shell). [`complain`] writes to stderr and never fails. The progress
//! bar (indicatif) draws only on a terminal and drops its own write errors.

use std::fmt;
use std::io::{ErrorKind, Write};

/// Exit status of a process whose output pipe was closed: 128 + SIGPIPE.
pub const BROKEN_PIPE_EXIT: i32 = 128 + 13;

/// Prints one line to stdout (flushed). Exits quietly with [`BROKEN_PIPE_EXIT`] if stdout is
/// a closed pipe; other write errors are ignored, like a terminal that went away.
pub fn say(line: fmt::Arguments) {
    let mut out = std::io::stdout().lock();
    let written = out
        .write_fmt(format_args!("{line}\n"))
        .and_then(|()| out.flush());
    if let Err(e) = written {
        if e.kind() == ErrorKind::BrokenPipe {
            std::process::exit(BROKEN_PIPE_EXIT);
        }
    }
}

/// Prints one line to stderr, ignoring any failure (there is nowhere left to report it).
pub fn complain(line: fmt::Arguments) {
    let mut err = std::io::stderr().lock();
    let _ = err
        .write_fmt(format_args!("{line}\n"))
        .and_then(|()| err.flush());
}
