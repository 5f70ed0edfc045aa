//! The NCCL unique-id exchange through tandem's store, on machines without a GPU: creating an
//! id (`ncclGetUniqueId`) needs the NCCL library but no device, so CI checks that the library
//! loads through tandem's own bindings, that rank 0's id reaches every rank intact, and that a
//! value of the wrong size is refused.
//!
//! Without NCCL the tests that need it print `skipped: NCCL not found (…)`;
//! `TANDEM_REQUIRE_NCCL=1` (set by `.ci/run`, which installs NCCL from pip and adds its folder
//! to `TANDEM_CUDA_LIBS`) makes that a failure.

use std::sync::Arc;
use std::time::Duration;

use tandem_dist::process_group::nccl::{
    exchange_unique_id, library_path, version, UniqueId, MIN_VERSION, UNIQUE_ID_BYTES,
};
use tandem_dist::{StoreServer, TcpStore};

/// Whether NCCL can be loaded; prints why not, or fails under `TANDEM_REQUIRE_NCCL=1`.
fn nccl_available(test: &str) -> bool {
    match version() {
        Ok(v) => {
            println!(
                "{test}: NCCL {v} from {}",
                library_path().unwrap_or_default()
            );
            true
        }
        Err(e) => {
            assert!(
                std::env::var("TANDEM_REQUIRE_NCCL").as_deref() != Ok("1"),
                "TANDEM_REQUIRE_NCCL=1 but NCCL cannot be used: {e}"
            );
            println!("skipped: NCCL not found ({e})");
            false
        }
    }
}

fn store() -> (StoreServer, String) {
    let server = StoreServer::bind("127.0.0.1:0").expect("store");
    let addr = server.local_addr().to_string();
    (server, addr)
}

#[test]
fn nccl_loads_through_tandems_bindings_with_a_supported_version() {
    if !nccl_available("nccl_loads_through_tandems_bindings_with_a_supported_version") {
        return;
    }
    let v = version().unwrap();
    assert!(v >= MIN_VERSION, "NCCL {v} is older than {MIN_VERSION}");
    assert!(library_path().unwrap().contains("libnccl"));
}

#[test]
fn rank_0s_unique_id_reaches_every_rank_intact() {
    if !nccl_available("rank_0s_unique_id_reaches_every_rank_intact") {
        return;
    }
    let (_server, addr) = store();
    let world = 4;
    // Ranks 1..3 start first and wait for the id; rank 0 creates it.
    let ids: Vec<UniqueId> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .rev()
            .map(|rank| {
                let addr = addr.clone();
                s.spawn(move || {
                    if rank == 0 {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    let store = TcpStore::connect(&addr, Duration::from_secs(10)).unwrap();
                    let id = exchange_unique_id(
                        &store,
                        rank,
                        "tandem/test/nccl/1/unique_id",
                        Duration::from_secs(10),
                    )
                    .unwrap();
                    (rank, id)
                })
            })
            .collect();
        let mut ids: Vec<(usize, UniqueId)> =
            handles.into_iter().map(|h| h.join().unwrap()).collect();
        ids.sort_by_key(|(rank, _)| *rank);
        ids.into_iter().map(|(_, id)| id).collect()
    });
    assert!(ids.iter().all(|id| id == &ids[0]), "{ids:?}");
    assert!(
        ids[0].as_bytes().iter().any(|&b| b != 0),
        "ncclGetUniqueId filled the id"
    );
    // Another communicator gets another id.
    assert_ne!(UniqueId::new().unwrap(), ids[0]);
}

#[test]
fn a_unique_id_of_the_wrong_size_is_refused_naming_the_key() {
    // Reading needs no NCCL: runs everywhere.
    let (_server, addr) = store();
    let store = Arc::new(TcpStore::connect(&addr, Duration::from_secs(10)).unwrap());
    store.set("tandem/test/nccl/2/unique_id", b"short").unwrap();
    let err = exchange_unique_id(
        &store,
        1,
        "tandem/test/nccl/2/unique_id",
        Duration::from_secs(5),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("rank 1")
            && err.contains("tandem/test/nccl/2/unique_id")
            && err.contains(&format!("5 bytes, not {UNIQUE_ID_BYTES}")),
        "{err}"
    );
    assert!(UniqueId::from_bytes(&[0u8; 127]).is_none());
    assert!(UniqueId::from_bytes(&[0u8; UNIQUE_ID_BYTES]).is_some());
    // A rank that waits for an id nobody sets gives up after its timeout.
    let err = exchange_unique_id(
        &store,
        2,
        "tandem/test/nccl/3/unique_id",
        Duration::from_millis(200),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("timed out"), "{err}");
}
