//! `tandem-run`: starts the ranks of a data-parallel job on this node.
//!
//! `tandem-run --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P]
//! -- PROGRAM ARGS…` — see [`tandem_dist::launch`] for what it does and `--help` for the
//! options. Exits 0 when every rank succeeded; otherwise prints which rank failed and how, and
//! exits with that rank's exit code (128 + signal for a rank killed by a signal).
//!
//! From a project that depends on tandem, `cargo run -p tandem-dist` cannot reach this binary
//! (Cargo runs only the current workspace's packages); install it once with
//! `cargo install --path path/to/tandem/dist --bin tandem-run` and run
//! `tandem-run --nproc-per-node N -- target/release/my_program`.

use std::io::Write;
use std::process::ExitCode;

use tandem_dist::launch::{self, LaunchOptions};

fn main() -> ExitCode {
    let opts = match LaunchOptions::parse_args(std::env::args_os().skip(1)) {
        Ok(Some(opts)) => opts,
        Ok(None) => {
            print!("{}", launch::USAGE);
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = launch::forward_signals() {
        eprintln!("tandem-run: warning: {e}; Ctrl-C will not be forwarded to the ranks");
    }
    match launch::launch(&opts) {
        Ok(report) => {
            if let Some(message) = report.failure_message() {
                // A closed stderr must not turn the report into a panic.
                let _ = writeln!(std::io::stderr(), "tandem-run: {message}");
            }
            if let Some(failure) = &report.failed {
                print_waiting_for(failure.rank, report.report.as_ref());
            }
            ExitCode::from(report.exit_code())
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// Names the rank the failed rank was waiting for, when that is another rank: that rank, not
/// the first to exit, is where to look (it may be stopped or hung).
fn print_waiting_for(failed: usize, report: Option<&launch::FailureReport>) {
    if let Some(r) = report.filter(|r| r.waiting_for != failed) {
        let _ = writeln!(
            std::io::stderr(),
            "tandem-run: rank {failed} was waiting for rank {}, which did not respond (stopped or \
             hung?): {}",
            r.waiting_for,
            r.message
        );
    }
}
