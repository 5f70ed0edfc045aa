//! The gradient-ready contract on a GPU (on the CUDA emulator without a GPU): every
//! parameter's event fires once per backward, after its gradient is final, in reverse layer
//! order, carrying an event of the GPU's compute stream; and the gradients equal the CPU's.

use tandem::core::Device;

#[path = "support/grad_ready.rs"]
mod support;

#[test]
fn grad_ready_contract_holds_on_cuda_and_the_gradients_match_the_cpu() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let gpu = support::check_contract(Device::Cuda(0));
    let cpu = support::check_contract(Device::Cpu);
    for ((name, g), (_, c)) in gpu.iter().zip(&cpu) {
        for (i, (a, b)) in g.iter().zip(c).enumerate() {
            assert!(
                (a - b).abs() <= 1e-4 + 1e-3 * b.abs(),
                "{name}[{i}]: {a} on cuda:0, {b} on the CPU"
            );
        }
    }
}
