//! Chrome trace files (the JSON array format Perfetto and `chrome://tracing` open): one
//! process per rank, one thread per stream, complete (`"ph": "X"`) events in microseconds.

use std::io;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::Span;

/// Writes `spans` of rank `rank` to `path` (atomically: a temporary file, then a rename).
/// Times are `epoch_us` (the wall-clock time of the spans' zero, in µs since the Unix epoch)
/// plus the spans' seconds.
pub(super) fn write(
    path: &Path,
    rank: usize,
    label: &str,
    epoch_us: f64,
    spans: &[Span],
) -> io::Result<()> {
    let mut events = vec![
        json!({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": label}}),
        json!({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}}),
    ];
    for track in [super::Track::Compute, super::Track::Comm] {
        events.push(json!({
            "name": "thread_name", "ph": "M", "pid": rank, "tid": track.tid(),
            "args": {"name": track.name()}
        }));
    }
    for s in spans {
        let us = |t: f64| ((epoch_us + t * 1e6) * 1000.0).round() / 1000.0;
        events.push(json!({
            "name": s.kind.name(),
            "cat": s.track.name(),
            "ph": "X",
            "pid": rank,
            "tid": s.track.tid(),
            "ts": us(s.start),
            "dur": ((s.end - s.start).max(0.0) * 1e9).round() / 1000.0,
            "args": {"step": s.step},
        }));
    }
    write_events(path, &events)
}

fn write_events(path: &Path, events: &[Value]) -> io::Result<()> {
    let text = serde_json::to_string(events).map_err(io::Error::other)?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, text + "\n")?;
    std::fs::rename(&tmp, path)
}

/// Merges the Chrome traces `inputs` (each a JSON array of events, as
/// [`Timeline::write_chrome_trace`](super::Timeline::write_chrome_trace) writes them, one per
/// rank) into one trace at `output`.
pub fn merge_chrome_traces(inputs: &[PathBuf], output: &Path) -> crate::Result<()> {
    let mut events = Vec::new();
    for input in inputs {
        let context = || format!("reading the Chrome trace {}", input.display());
        let text =
            std::fs::read_to_string(input).map_err(|e| crate::DistError::io(context(), e))?;
        let parsed: Value = serde_json::from_str(&text).map_err(|e| {
            crate::DistError::io(context(), io::Error::new(io::ErrorKind::InvalidData, e))
        })?;
        match parsed {
            Value::Array(list) => events.extend(list),
            _ => {
                let e = io::Error::new(io::ErrorKind::InvalidData, "not a JSON array of events");
                return Err(crate::DistError::io(context(), e));
            }
        }
    }
    write_events(output, &events).map_err(|e| {
        crate::DistError::io(format!("writing the Chrome trace {}", output.display()), e)
    })
}
