//! Ranks die with their launcher.
//!
//! A launcher killed by SIGKILL cannot stop its ranks, and a rank whose launcher is gone
//! trains on as an orphan until it next writes to the launcher's pipe. On Linux each rank is
//! therefore started with the parent-death signal set to SIGKILL (`prctl(PR_SET_PDEATHSIG)`),
//! in the child between fork and exec. That leaves a race — the launcher may die after the
//! fork but before the `prctl` — so the child then checks that its parent is still the
//! launcher, and otherwise does not start the program at all. The signal survives `exec`; it
//! is sent when the launcher *thread* that started the rank ends, which is why [`launch`]
//! must be called from a thread that outlives it (it blocks until the ranks are done).
//!
//! Elsewhere no equivalent is used; ranks there still end when forwarded signals or a closed
//! output pipe reach them.
//!
//! [`launch`]: super::launch

use std::process::Command;

/// Makes the rank that `cmd` will start die (SIGKILL) when this launcher dies.
pub fn die_with_launcher(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;

        // SAFETY: getpid has no preconditions.
        let launcher = unsafe { libc::getpid() };
        // SAFETY: the closure runs in the forked child before exec. It makes only the
        // async-signal-safe system calls prctl and getppid, allocates nothing (the error is a
        // raw OS error), and touches no memory but its captured pid.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(
                    libc::PR_SET_PDEATHSIG,
                    libc::SIGKILL as libc::c_ulong,
                    0,
                    0,
                    0,
                ) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                // The launcher died before the prctl: its death signal is already missed.
                if libc::getppid() != launcher {
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}
