//! `set_num_threads` in a process of its own (it sizes the global pool once per process).

use tandem_core::{DType, Device, Generator, Tensor};
use tandem_ops::{set_num_threads, sum_all};

#[test]
fn the_calling_thread_becomes_a_worker_and_a_second_call_is_refused() {
    set_num_threads(2).unwrap();
    assert_eq!(rayon::current_num_threads(), 2);
    assert_eq!(rayon::current_thread_index(), Some(0));

    // A kernel large enough to split runs with the calling thread taking part.
    let mut gen = Generator::new(3);
    let x = Tensor::rand(&[1 << 18], 0.0, 1.0, DType::F64, Device::Cpu, &mut gen).unwrap();
    let expected: f64 = x.to_vec::<f64>().unwrap().iter().sum();
    let got = sum_all(&x).unwrap().item().unwrap();
    assert!(
        (got - expected).abs() <= 1e-9 * expected,
        "{got} vs {expected}"
    );

    let err = set_num_threads(4).unwrap_err().to_string();
    assert!(
        err.contains("set_num_threads") && err.contains("once"),
        "{err}"
    );
}
