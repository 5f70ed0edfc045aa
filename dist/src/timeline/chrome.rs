//! Chrome trace files (the JSON array format Perfetto and `chrome://tracing` open): one
//! process per rank, one thread per stream, complete (`"ph": "X"`) events in microseconds;
//! and the job's trace, every rank's timeline merged into one file
//! ([`Timeline::write_job_chrome_trace`]).

use std::io;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::{Span, Timeline};
use crate::ProcessGroup;

impl Timeline {
    /// Writes the whole job's timeline as one Chrome trace at `path`: every rank writes its
    /// part ([`Timeline::rank_trace_path`]), the ranks meet at a barrier of `group`, and rank
    /// 0 merges the parts into `path` ([`merge_chrome_traces`]) and removes them. Every rank of
    /// `group` must call it; without a group (one process) it is
    /// [`Timeline::write_chrome_trace`]. The merged file is complete when rank 0's call
    /// returns.
    pub fn write_job_chrome_trace(
        &mut self,
        path: &Path,
        group: Option<&dyn ProcessGroup>,
    ) -> crate::Result<()> {
        let Some(group) = group.filter(|g| g.world_size() > 1) else {
            return self.write_chrome_trace(path);
        };
        let (rank, world) = (group.rank(), group.world_size());
        self.write_chrome_trace(&Timeline::rank_trace_path(path, rank, world))?;
        group.barrier()?.wait()?;
        if rank != 0 {
            return Ok(());
        }
        let parts: Vec<PathBuf> = (0..world)
            .map(|r| Timeline::rank_trace_path(path, r, world))
            .collect();
        merge_chrome_traces(&parts, path)?;
        for part in &parts {
            std::fs::remove_file(part).map_err(|e| {
                crate::DistError::io(format!("removing the trace part {}", part.display()), e)
            })?;
        }
        Ok(())
    }
}

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

#[cfg(test)]
mod tests {
    use tandem_core::Device;

    use super::*;
    use crate::{Phase, ThreadProcessGroup};

    #[test]
    fn two_thread_ranks_write_one_merged_trace_and_leave_no_parts() {
        let dir = std::env::temp_dir().join(format!("tandem-job-trace-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("trace.json");
        let handles: Vec<_> = ThreadProcessGroup::new_group(2)
            .unwrap()
            .into_iter()
            .map(|group| {
                let path = path.clone();
                std::thread::spawn(move || {
                    let mut timeline = Timeline::new(group.rank(), Device::Cpu).unwrap();
                    for _ in 0..2 {
                        timeline.begin_step().unwrap();
                        timeline.begin(Phase::Forward).unwrap();
                        timeline.end(Phase::Forward).unwrap();
                    }
                    timeline
                        .write_job_chrome_trace(&path, Some(&group))
                        .unwrap();
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let events: Vec<Value> = serde_json::from_str(&text).unwrap();
        for rank in 0..2u64 {
            let forwards = events
                .iter()
                .filter(|e| e["pid"].as_u64() == Some(rank) && e["name"] == "forward")
                .count();
            assert_eq!(forwards, 2, "rank {rank}'s two forward spans");
        }
        let files: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(files, ["trace.json"], "the parts are removed");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
