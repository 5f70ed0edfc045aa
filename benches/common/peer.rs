//! Running a benchmark's PyTorch peer: checking that the interpreter can import torch, running
//! the peer script, and reading the JSON object it prints on its last line. Shared by the
//! benchmarks through `#[path = "common/peer.rs"] mod peer;`.

use std::process::Command;

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
