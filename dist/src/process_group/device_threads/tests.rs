//! The device-threads backend on the CPU (its host path, which shares the rendezvous, sequence
//! numbers, failure handling and ordering with the device path). The device path itself is
//! tested on a GPU by `dist/tests/cuda_device_group.rs`, and its kernels by the host harness.

use std::time::{Duration, Instant};

use tandem_core::{DType, Device, Tensor};

use super::*;
use crate::testing::{conformance, on_each_rank};

#[test]
fn every_collective_matches_the_serial_reference_on_1_2_3_4_and_8_ranks() {
    for world in [1, 2, 3, 4, 8] {
        let groups = DeviceThreadGroup::new_group(Device::Cpu, world).unwrap();
        let results = on_each_rank(groups, |pg| {
            conformance(&pg, 11 + world as u64, &[0, 1, 5, 1001, 20_003])
        });
        for r in results {
            r.unwrap();
        }
    }
}

#[test]
fn ranks_issuing_different_collectives_get_an_error_naming_both() {
    let groups = DeviceThreadGroup::new_group(Device::Cpu, 2).unwrap();
    let errors = on_each_rank(groups, |pg| {
        let t = Tensor::zeros(&[100], DType::F32, Device::Cpu).unwrap();
        pg.barrier().unwrap().wait().unwrap();
        let work = if pg.rank() == 0 {
            pg.broadcast(&t, 0).unwrap()
        } else {
            pg.all_reduce(&t, ReduceOp::Sum).unwrap()
        };
        let err = work.wait().unwrap_err().to_string();
        // The group is broken afterwards.
        let later = pg.barrier().unwrap().wait().unwrap_err().to_string();
        (err, later)
    });
    for (err, later) in &errors {
        assert!(
            err.contains("collective #2")
                && err.contains("broadcast(f32, 100, root 0)")
                && err.contains("all_reduce(f32, 100, sum)"),
            "{err}"
        );
        assert!(err.contains("rank 0") && err.contains("rank 1"), "{err}");
        assert!(
            later.contains("broken") && later.contains("collective #3"),
            "{later}"
        );
    }
}

#[test]
fn a_dropped_rank_fails_the_others_naming_it_instead_of_hanging() {
    let mut groups = DeviceThreadGroup::new_group(Device::Cpu, 3).unwrap();
    drop(groups.pop());
    let started = Instant::now();
    let errors = on_each_rank(groups, |pg| {
        let t = Tensor::ones(&[8], DType::F32, Device::Cpu).unwrap();
        pg.all_reduce(&t, ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap_err()
    });
    assert!(started.elapsed() < Duration::from_secs(5));
    for err in errors {
        assert_eq!(err.blamed_ranks(), vec![2], "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("rank 2 left the group")
                && msg.contains("DeviceThreadGroup")
                && msg.contains("collective #1"),
            "{msg}"
        );
    }
}

#[test]
fn a_missing_rank_times_out_naming_it_and_breaks_the_group() {
    let config = GroupConfig {
        timeout: Duration::from_millis(200),
        ..GroupConfig::default()
    };
    let groups = DeviceThreadGroup::new_group_with(Device::Cpu, 2, &config).unwrap();
    let (first, _second) = (&groups[0], &groups[1]);
    let err = first.barrier().unwrap().wait().unwrap_err();
    assert!(
        matches!(&err, DistError::Timeout { waiting_for, seq: 1, .. } if waiting_for == &[1]),
        "{err}"
    );
    assert_eq!(
        err.diagnosis(),
        Some("rank 1 has issued no collective yet, while rank 0 waits at barrier #1"),
        "{err}"
    );
    let later = first.barrier().unwrap().wait().unwrap_err().to_string();
    assert!(
        later.contains("broken") && later.contains("collective #2"),
        "{later}"
    );
}

#[test]
fn a_mismatch_among_three_ranks_fails_every_rank_promptly() {
    let groups = DeviceThreadGroup::new_group(Device::Cpu, 3).unwrap();
    let started = Instant::now();
    let errors = on_each_rank(groups, |pg| {
        if pg.rank() == 2 {
            std::thread::sleep(Duration::from_millis(10));
            let t = Tensor::ones(&[3], DType::F32, Device::Cpu).unwrap();
            return pg
                .all_reduce(&t, ReduceOp::Max)
                .unwrap()
                .wait()
                .unwrap_err();
        }
        pg.barrier().unwrap().wait().unwrap_err()
    });
    assert!(started.elapsed() < Duration::from_secs(5), "nobody hung");
    for (rank, err) in errors.iter().enumerate() {
        let msg = err.to_string();
        assert!(
            msg.contains("collective #1") && msg.contains("all_reduce(f32, 3, max)"),
            "rank {rank}: {msg}"
        );
        let blamed = err.blamed_ranks();
        assert!(
            !blamed.is_empty() && !blamed.contains(&rank),
            "rank {rank}: {msg}"
        );
    }
}

#[test]
fn bad_arguments_are_refused_without_taking_a_sequence_number() {
    let groups = DeviceThreadGroup::new_group(Device::Cpu, 1).unwrap();
    let pg = &groups[0];
    let ints = Tensor::zeros(&[4], DType::I64, Device::Cpu).unwrap();
    let err = pg.all_reduce(&ints, ReduceOp::Sum).unwrap_err().to_string();
    assert!(err.contains("i64"), "{err}");
    let work = pg.barrier().unwrap();
    work.wait().unwrap();
    assert_eq!(work.sequence_number(), 1);
    // Every dtype broadcasts and gathers, bit for bit.
    let bytes = Tensor::from_vec(vec![7u8, 0, 255], &[3], Device::Cpu).unwrap();
    let gathered = Tensor::zeros(&[3], DType::U8, Device::Cpu).unwrap();
    pg.all_gather(&bytes, &gathered).unwrap().wait().unwrap();
    assert_eq!(gathered.to_vec::<u8>().unwrap(), vec![7, 0, 255]);
}

#[test]
fn groups_are_checked_when_made() {
    let err = DeviceThreadGroup::new_group(Device::Cpu, 0).unwrap_err();
    assert!(
        matches!(err, DistError::Config { .. }) && err.to_string().contains("at least one rank"),
        "{err}"
    );
    let err = DeviceThreadGroup::new_group(Device::Cpu, 65).unwrap_err();
    assert!(
        matches!(err, DistError::Config { .. }) && err.to_string().contains("at most 64"),
        "{err}"
    );
    if !tandem_core::cuda::is_available() {
        let err = DeviceThreadGroup::new_group(Device::Cuda(0), 2)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("cuda:0") && err.contains("not available"),
            "{err}"
        );
    }
}

#[test]
fn a_cpu_group_runs_on_the_calling_thread_and_its_work_completes_in_order() {
    let groups = DeviceThreadGroup::new_group(Device::Cpu, 2).unwrap();
    let results = on_each_rank(groups, |pg| {
        assert!(pg.comm_stream().is_compute());
        let t = Tensor::full(&[5], pg.rank() as f64 + 1.0, DType::F32, Device::Cpu).unwrap();
        let works: Vec<Work> = (0..3)
            .map(|_| pg.all_reduce(&t, ReduceOp::Sum).unwrap())
            .collect();
        // The data is in place when the call returns; the works complete in issue order.
        let value = t.to_vec::<f32>().unwrap()[0];
        works.last().unwrap().wait().unwrap();
        assert!(works.iter().all(Work::is_completed));
        value
    });
    // (1 + 2) three times over: 3, then 6, then 12.
    assert_eq!(results, vec![12.0, 12.0]);
}
