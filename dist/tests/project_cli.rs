//! The `tandem-project` command: a table for the device counts asked, and clear errors.

use std::process::Command;

fn recording_file(name: &str, json: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("tandem-project-{}-{name}", std::process::id()));
    std::fs::write(&path, json).unwrap();
    path
}

const RECORDING: &str = r#"{
  "model": "toy", "device": "cpu", "batch_size": 2,
  "forward_ms": 10.0, "backward_ms": 20.0, "optimizer_ms": 1.0,
  "buckets": [{"bytes": 1000000, "ready_ms": 5.0}, {"bytes": 3000000, "ready_ms": 20.0}]
}"#;

fn project(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem-project"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_projection_prints_one_row_per_device_count_with_the_link_it_used() {
    let path = recording_file("ok.json", RECORDING);
    let (ok, out, err) = project(&[
        path.to_str().unwrap(),
        "--devices",
        "2,4",
        "--busbw-gbs",
        "1",
        "--alpha-us",
        "0",
    ]);
    assert!(ok, "{err}");
    assert!(
        out.contains("toy on cpu") && out.contains("3.81 MiB of gradients in 2 buckets"),
        "{out}"
    );
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| l.trim_start().starts_with(['2', '4']))
        .collect();
    assert_eq!(rows.len(), 2, "{out}");
    // 2 devices at 1 MB/ms: bucket 0 5→6 ms, bucket 1 20→23 ms: 3 ms exposed, step 34 ms.
    assert!(
        rows[0].contains("34.00") && rows[0].contains("3.00"),
        "{out}"
    );
    let (ok, out, _) = project(&[path.to_str().unwrap()]);
    assert!(ok);
    for p in ["2", "8", "16", "64"] {
        assert!(
            out.lines().any(|l| l.split_whitespace().next() == Some(p)),
            "{p}: {out}"
        );
    }
    std::fs::remove_file(path).unwrap();
}

#[test]
fn bad_input_is_an_error_naming_the_problem() {
    let (ok, _, err) = project(&["/nonexistent/recording.json"]);
    assert!(!ok && err.contains("/nonexistent/recording.json"), "{err}");
    let path = recording_file("bad.json", &RECORDING.replace("20.0}]", "-1}]"));
    let (ok, _, err) = project(&[path.to_str().unwrap()]);
    assert!(!ok && err.contains("bucket 1"), "{err}");
    let (ok, _, err) = project(&[path.to_str().unwrap(), "--busbw-gbs", "10"]);
    assert!(!ok && err.contains("go together"), "{err}");
    let (ok, _, err) = project(&[path.to_str().unwrap(), "--devices", "2,x"]);
    assert!(!ok && err.contains("`x`"), "{err}");
    std::fs::remove_file(path).unwrap();
}
