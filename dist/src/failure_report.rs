//! How a launcher learns which rank a failed job was waiting for.
//!
//! When a rank stops responding without exiting (stopped by a signal, hung, deadlocked), the
//! others time out one after another and exit with an error naming it; the first rank to exit
//! is one of the waiting ones, not the culprit. So a rank whose collective fails blaming other
//! ranks, or whose setup of the group timed out waiting for other ranks, leaves a short report
//! in the rendezvous store (key `tandem/failure/<rank>`: the blamed ranks, a newline, its error
//! message) before it returns the error — on a connection of its own when its usual one is busy
//! — and a launcher that serves the store follows the reports from the rank that failed first
//! (rank 0 was waiting for rank 1, which was waiting for rank 2, which left no report) to the
//! rank everyone was waiting for, and names that rank in its summary. A rank whose collective
//! timed out also leaves its hang diagnosis (`tandem/diagnosis/<rank>`: which ranks diverged
//! and where, see `process_group::progress`), which the launcher's summary repeats.

use std::time::Duration;

use crate::store::{StoreServer, TcpStore};
use crate::DistError;

/// Longest error message kept in a report.
const MAX_MESSAGE: usize = 2048;
/// Longest time a rank spends connecting to the store anew to leave its report when its own
/// connection is busy.
const OWN_CONNECTION_WAIT: Duration = Duration::from_secs(2);

/// The store key of rank `rank`'s report.
pub(crate) fn key(rank: usize) -> String {
    format!("tandem/failure/{rank}")
}

/// The store key of rank `rank`'s hang diagnosis.
fn diagnosis_key(rank: usize) -> String {
    format!("tandem/diagnosis/{rank}")
}

/// Most ranks whose diagnoses the launcher looks through.
const MAX_DIAGNOSES_READ: usize = 1024;

/// Leaves rank `rank`'s report of `err` in the store, if `err` blames other ranks and the
/// store connection is free (a failing collective must not wait behind the application).
pub(crate) fn post(store: &TcpStore, rank: usize, err: &DistError) {
    let blamed: Vec<String> = err
        .blamed_ranks()
        .iter()
        .filter(|&&r| r != rank)
        .take(16)
        .map(|r| r.to_string())
        .collect();
    if blamed.is_empty() {
        return;
    }
    let message = bounded(err.to_string());
    let value = format!("{}\n{message}", blamed.join(","));
    let mut entries = vec![(key(rank), value)];
    if let Some(diagnosis) = err.diagnosis() {
        entries.push((diagnosis_key(rank), bounded(diagnosis.to_string())));
    }
    for (key, value) in entries {
        set_without_blocking(store, &key, &value);
    }
}

/// `text` cut to at most [`MAX_MESSAGE`] bytes.
fn bounded(mut text: String) -> String {
    if text.len() > MAX_MESSAGE {
        let mut cut = MAX_MESSAGE;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    text
}

/// Sets `key` on `store`'s connection if it is free, else on a short-lived one of its own.
fn set_without_blocking(store: &TcpStore, key: &str, value: &str) {
    if let Ok(false) = store.try_set(key, value.as_bytes()) {
        // The connection is busy (another thread waits on it): a short-lived one of its own,
        // bounded in time, so that the report is not lost.
        if let Ok(own) = TcpStore::connect_with_secret(
            store.addr(),
            OWN_CONNECTION_WAIT,
            store.secret().cloned(),
        ) {
            let _ = own.set(key, value.as_bytes());
        }
    }
}

/// What a failed rank reported: the rank that the failed ranks were waiting for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailureReport {
    /// The rank the others were waiting for (the end of the chain of reports).
    pub waiting_for: usize,
    /// The error message of the rank that failed first.
    pub message: String,
    /// The hang diagnosis (which ranks diverged and where) left by the rank that failed first,
    /// else by the first other rank that left one.
    pub diagnosis: Option<String>,
}

fn parse(value: &[u8]) -> Option<(Vec<usize>, String)> {
    let text = String::from_utf8_lossy(value);
    let (ranks, message) = text.split_once('\n')?;
    let ranks = ranks
        .split(',')
        .filter_map(|r| r.parse().ok())
        .collect::<Vec<usize>>();
    Some((ranks, message.to_string()))
}

/// Follows the reports in `server` from rank `failed` to the rank it (transitively) waited
/// for. `None` if `failed` left no report.
pub fn explain(server: &StoreServer, failed: usize, world: usize) -> Option<FailureReport> {
    let (mut blamed, message) = parse(&server.value(&key(failed))?)?;
    let mut seen = vec![failed];
    let mut current = *blamed.first()?;
    for _ in 0..world.min(4096) {
        if seen.contains(&current) {
            break;
        }
        seen.push(current);
        match server.value(&key(current)).and_then(|v| parse(&v)) {
            Some((next, _)) if !next.is_empty() => {
                blamed = next;
                current = blamed[0];
            }
            _ => break,
        }
    }
    let diagnosis_of = |r: usize| {
        server
            .value(&diagnosis_key(r))
            .map(|v| String::from_utf8_lossy(&v).into_owned())
    };
    let diagnosis =
        diagnosis_of(failed).or_else(|| (0..world.min(MAX_DIAGNOSES_READ)).find_map(diagnosis_of));
    Some(FailureReport {
        waiting_for: current,
        message,
        diagnosis,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_launcher_follows_reports_to_the_rank_everyone_waited_for() {
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let store =
            TcpStore::connect(&server.local_addr().to_string(), Duration::from_secs(5)).unwrap();
        let timeout = |rank, waiting_for| DistError::Timeout {
            rank,
            collective: "all_reduce(f32, 4, sum)".into(),
            seq: 3,
            timeout: Duration::from_secs(1),
            waiting_for,
            diagnosis: None,
        };
        let diagnosed = |rank, waiting_for| match timeout(rank, waiting_for) {
            DistError::Timeout {
                rank,
                collective,
                seq,
                timeout,
                waiting_for,
                ..
            } => DistError::Timeout {
                rank,
                collective,
                seq,
                timeout,
                waiting_for,
                diagnosis: Some("rank 2 is behind".into()),
            },
            other => other,
        };
        assert_eq!(explain(&server, 0, 4), None);
        post(&store, 1, &diagnosed(1, vec![2]));
        post(&store, 0, &timeout(0, vec![1]));
        let report = explain(&server, 0, 4).unwrap();
        assert_eq!(report.waiting_for, 2);
        assert_eq!(
            report.diagnosis.as_deref(),
            Some("rank 2 is behind"),
            "the diagnosis of another rank when the first failed rank left none"
        );
        assert!(report.message.contains("rank 0") && report.message.contains("rank 1"));
        assert_eq!(explain(&server, 1, 4).unwrap().waiting_for, 2);
        assert_eq!(explain(&server, 3, 4), None);
        // Reports that blame each other do not loop.
        post(&store, 2, &timeout(2, vec![0]));
        assert!(explain(&server, 0, 4).is_some());
    }
}
