//! The [`Dataset`] trait, the [`Batch`] it yields, and [`TensorDataset`] over in-memory
//! tensors.

use tandem_core::{with_element_type, Tensor};

use crate::{Error, Result};

/// One batch: model inputs and the matching targets, both with the batch as dim 0.
#[derive(Clone, Debug)]
pub struct Batch {
    /// Model inputs, e.g. f32 `[B, 1, 28, 28]` images.
    pub inputs: Tensor,
    /// Targets, e.g. i64 `[B]` class labels.
    pub targets: Tensor,
}

/// A collection of samples that can be assembled into batches.
///
/// `Send + Sync` because the data loader builds batches on a background thread.
pub trait Dataset: Send + Sync {
    /// Number of samples.
    fn len(&self) -> usize;

    /// Whether the dataset has no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The samples at `indices`, in that order, stacked into one batch. An index out of range
    /// is an error naming it and the dataset's length.
    fn get_batch(&self, indices: &[usize]) -> Result<Batch>;
}

/// Checks that every index is below `len`.
pub(crate) fn check_indices(what: &'static str, indices: &[usize], len: usize) -> Result<()> {
    if let Some(&bad) = indices.iter().find(|&&i| i >= len) {
        return Err(Error::data(
            what,
            format!("sample index {bad} is out of range for a dataset of {len} samples"),
        ));
    }
    Ok(())
}

/// Checks that the folder a data set is read from exists, so that a wrong folder is reported as
/// itself (with the files it should hold) and not as the first file missing inside it. The
/// error is [`Error::Io`] with [`std::io::ErrorKind::NotFound`] on `dir`.
pub(crate) fn check_data_dir(what: &str, dir: &std::path::Path, expected: &str) -> Result<()> {
    let problem = match std::fs::metadata(dir) {
        Ok(meta) if meta.is_dir() => return Ok(()),
        Ok(_) => "is not a directory",
        Err(_) => "does not exist",
    };
    Err(Error::Io {
        path: dir.to_path_buf(),
        source: std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("the {what} directory {problem}; it should hold {expected}"),
        ),
    })
}

/// A dataset over two in-memory tensors whose dim 0 indexes samples (`inputs[i]` goes with
/// `targets[i]`).
#[derive(Clone, Debug)]
pub struct TensorDataset {
    inputs: Tensor,
    targets: Tensor,
}

impl TensorDataset {
    /// A dataset of `inputs` `[N, …]` and `targets` `[N, …]`. Errors if either is a scalar or
    /// their first dims differ.
    pub fn new(inputs: Tensor, targets: Tensor) -> Result<Self> {
        if inputs.rank() == 0 || targets.rank() == 0 || inputs.dims()[0] != targets.dims()[0] {
            return Err(Error::config(
                "TensorDataset",
                format!(
                    "inputs {:?} and targets {:?} need the same number of samples in dim 0",
                    inputs.dims(),
                    targets.dims()
                ),
            ));
        }
        Ok(TensorDataset {
            inputs: inputs.contiguous_detached()?,
            targets: targets.contiguous_detached()?,
        })
    }
}

/// Copies rows `indices` of a contiguous tensor into a new tensor.
fn gather_rows(t: &Tensor, indices: &[usize]) -> Result<Tensor> {
    let row: usize = t.dims()[1..].iter().product();
    let mut shape = t.dims().to_vec();
    shape[0] = indices.len();
    with_element_type!(t.dtype(), T => {
        let src = t.read_slice::<T>()?;
        let mut out: Vec<T> = Vec::with_capacity(indices.len() * row);
        for &i in indices {
            out.extend_from_slice(&src[i * row..(i + 1) * row]);
        }
        Ok(Tensor::from_vec(out, &shape, t.device())?)
    })
}

impl Dataset for TensorDataset {
    fn len(&self) -> usize {
        self.inputs.dims()[0]
    }

    fn get_batch(&self, indices: &[usize]) -> Result<Batch> {
        check_indices("TensorDataset", indices, self.len())?;
        Ok(Batch {
            inputs: gather_rows(&self.inputs, indices)?,
            targets: gather_rows(&self.targets, indices)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_core::Device;

    #[test]
    fn tensor_dataset_gathers_rows_in_the_requested_order() {
        let x = Tensor::from_vec((0..6).map(|v| v as f32).collect(), &[3, 2], Device::Cpu).unwrap();
        let y = Tensor::from_vec(vec![10i64, 11, 12], &[3], Device::Cpu).unwrap();
        let ds = TensorDataset::new(x, y).unwrap();
        let b = ds.get_batch(&[2, 0]).unwrap();
        assert_eq!(b.inputs.dims(), &[2, 2]);
        assert_eq!(b.inputs.to_vec::<f32>().unwrap(), vec![4.0, 5.0, 0.0, 1.0]);
        assert_eq!(b.targets.to_vec::<i64>().unwrap(), vec![12, 10]);
        let err = ds.get_batch(&[3]).unwrap_err().to_string();
        assert!(
            err.contains("index 3") && err.contains("3 samples"),
            "{err}"
        );
    }

    #[test]
    fn tensor_dataset_rejects_mismatched_sample_counts() {
        let x = Tensor::zeros(&[3, 2], tandem_core::DType::F32, Device::Cpu).unwrap();
        let y = Tensor::zeros(&[4], tandem_core::DType::I64, Device::Cpu).unwrap();
        assert!(TensorDataset::new(x, y).is_err());
    }
}
