//! Running a benchmark's PyTorch peer: finding its script, checking that the interpreter can
//! import torch, running the script, reading the JSON object it prints on its last line, and
//! failing the benchmark when a required peer did not run. Shared by the benchmarks through
//! `#[path = "common/peer.rs"] mod peer;`.

use std::path::PathBuf;
use std::process::Command;

/// The environment variable that makes a peer that did not run an error (value `1`), as
/// `--require-peer` does; the GPU bundle sets it.
pub const REQUIRE_PEER_VAR: &str = "TANDEM_REQUIRE_PEER";

/// The peer script `name`, found at run time (`$TANDEM_PEERS_DIR/name`, else
/// `benches/peers/name` above the current folder or the executable's; see `tandem::locate`).
pub fn script(name: &str) -> Result<PathBuf, String> {
    tandem::locate::peer_script(name).map_err(|e| e.to_string())
}

/// Whether a peer that did not run fails the benchmark: `--require-peer`, or
/// `TANDEM_REQUIRE_PEER=1`.
pub fn required(flag: bool) -> bool {
    flag || std::env::var(REQUIRE_PEER_VAR).is_ok_and(|v| v == "1")
}

/// The benchmark's error when the peer was required (see [`required`]) but did not run, with
/// why (`why`, as printed on the "not run" line).
pub fn missing_error(why: &str) -> String {
    format!(
        "the PyTorch peer was required (--require-peer or {REQUIRE_PEER_VAR}=1) but did not \
         run: {why}"
    )
}

/// Checks that `python` runs and can execute `check` (Python source that exits non-zero when
/// what the peer needs is missing); `Err` says why not, for the benchmark's "not run" line.
pub fn probe(python: &str, check: &str, needs: &str) -> Result<(), String> {
    let probe = Command::new(python)
        .args(["-c", check])
        .output()
        .map_err(|e| format!("cannot run `{python}`: {e}"))?;
    if !probe.status.success() {
        return Err(format!(
            "`{python}` cannot {needs} (install it, or pass --peer-python)"
        ));
    }
    Ok(())
}

/// Runs the peer `command` and returns the JSON object on the last line of its stdout.
pub fn run_json(mut command: Command) -> Result<serde_json::Value, String> {
    let output = command
        .output()
        .map_err(|e| format!("cannot run the peer script: {e}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(format!(
            "the peer script failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    let last = stdout.lines().last().unwrap_or("");
    serde_json::from_str(last).map_err(|e| format!("unreadable peer output `{last}`: {e}"))
}

/// The number `name` of the peer's output `value`.
pub fn field(value: &serde_json::Value, name: &str) -> Result<f64, String> {
    value[name]
        .as_f64()
        .ok_or_else(|| format!("peer output lacks `{name}`: {value}"))
}
