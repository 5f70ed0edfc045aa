//! The NCCL unique id and its trip through the rendezvous store.
//!
//! Every rank of a communicator must call `ncclCommInitRankConfig` with the same 128-byte id,
//! which one rank creates with `ncclGetUniqueId` (it holds the address of that rank's NCCL
//! bootstrap socket). Rank 0 creates it and sets it in tandem's store; every other rank reads
//! it. Creating an id needs the NCCL library but no GPU, so this exchange is tested in CI on
//! machines without one.

use std::time::Duration;

use super::ffi::{self, RawUniqueId, UNIQUE_ID_BYTES};
use crate::store::TcpStore;
use crate::{DistError, Result};

/// An NCCL unique id: the 128 bytes every rank of one communicator starts from.
#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId([u8; UNIQUE_ID_BYTES]);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let head: String = self.0[..8].iter().map(|b| format!("{b:02x}")).collect();
        write!(f, "UniqueId({head}…)")
    }
}

impl UniqueId {
    /// A fresh id from `ncclGetUniqueId` (loads NCCL; needs no GPU).
    pub fn new() -> Result<Self> {
        let api = ffi::api().map_err(DistError::NcclUnavailable)?;
        let mut raw = RawUniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        // SAFETY: `raw` is a writable ncclUniqueId.
        let status = unsafe { (api.get_unique_id)(&mut raw) };
        if status != ffi::SUCCESS {
            // SAFETY: no communicator involved.
            let detail = unsafe { api.describe(status, std::ptr::null_mut()) };
            return Err(DistError::Nccl {
                rank: 0,
                op: "ncclGetUniqueId".into(),
                detail,
            });
        }
        let mut bytes = [0u8; UNIQUE_ID_BYTES];
        for (dst, &src) in bytes.iter_mut().zip(raw.internal.iter()) {
            *dst = src as u8;
        }
        Ok(UniqueId(bytes))
    }

    /// The id's bytes.
    pub fn as_bytes(&self) -> &[u8; UNIQUE_ID_BYTES] {
        &self.0
    }

    /// An id from its bytes; `None` unless there are exactly 128.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(UniqueId)
    }
}

/// The id of a communicator every rank joins under `key`: rank 0 creates it with
/// `ncclGetUniqueId` and sets it in `store`; every other rank waits for it (at most `timeout`)
/// and reads it. A value of the wrong length is an error naming the key.
pub fn exchange_unique_id(
    store: &TcpStore,
    rank: usize,
    key: &str,
    timeout: Duration,
) -> Result<UniqueId> {
    if rank == 0 {
        let id = UniqueId::new().map_err(|e| match e {
            DistError::Nccl { op, detail, .. } => DistError::Nccl { rank, op, detail },
            other => other,
        })?;
        store.set(key, id.as_bytes())?;
        return Ok(id);
    }
    let bytes = store.get_timeout(key, timeout)?;
    UniqueId::from_bytes(&bytes).ok_or_else(|| DistError::Nccl {
        rank,
        op: format!("reading the unique id at {key:?} in the store"),
        detail: format!(
            "it has {} bytes, not {UNIQUE_ID_BYTES}: something else wrote that key",
            bytes.len()
        ),
    })
}

/// The version of the NCCL library tandem finds (loading it; needs no GPU).
pub fn version() -> Result<ffi::NcclVersion> {
    ffi::api()
        .map(|api| api.version)
        .map_err(DistError::NcclUnavailable)
}

/// The file NCCL was loaded from.
pub fn library_path() -> Result<String> {
    ffi::api()
        .map(|api| api.path.clone())
        .map_err(DistError::NcclUnavailable)
}
