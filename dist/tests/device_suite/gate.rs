//! Holding a CUDA stream at a point the test controls: a host function enqueued on the stream
//! that returns only when the test releases it (or after 20 s, so that a test cannot hang).
//! Work issued to the stream after the gate does not run while it is held.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::Duration;

use tandem_core::{Device, Stream};

/// How long a gate holds its stream at most.
pub const GATE_LIMIT: Duration = Duration::from_secs(20);

/// What the host function receives: the release channel and the flag it sets on returning.
type Payload = (Receiver<()>, Arc<AtomicBool>);

/// A held CUDA stream.
pub struct Gate {
    release: Option<Sender<()>>,
    opened: Arc<AtomicBool>,
}

unsafe extern "C" fn wait_for_release(data: *mut c_void) {
    // SAFETY: `data` is the box `Gate::hold` leaked for this call, handed over exactly once; the
    // function makes no CUDA call.
    let payload = unsafe { Box::from_raw(data.cast::<Payload>()) };
    let _ = payload.0.recv_timeout(GATE_LIMIT);
    payload.1.store(true, Ordering::SeqCst);
}

impl Gate {
    /// Holds `stream` (a CUDA stream) from now until [`Gate::release`].
    pub fn hold(stream: &Stream) -> Gate {
        let cuda = stream
            .cuda_stream()
            .unwrap_or_else(|| panic!("{stream:?} is not a CUDA stream"));
        let Device::Cuda(ordinal) = stream.device() else {
            panic!("{stream:?} is not on a CUDA device");
        };
        tandem_core::cuda::device(ordinal)
            .and_then(|d| d.bind("gate"))
            .unwrap();
        let (release, receiver) = channel();
        let opened = Arc::new(AtomicBool::new(false));
        let payload: *mut Payload = Box::into_raw(Box::new((receiver, opened.clone())));
        // SAFETY: the stream is a live stream of the current context; on success the host
        // function takes ownership of `payload`, on failure it is freed here.
        let launched = unsafe {
            cudarc::driver::result::stream::launch_host_function(
                cuda.cu_stream(),
                wait_for_release,
                payload.cast(),
            )
        };
        if let Err(e) = launched {
            // SAFETY: the launch failed, so the host function never received `payload`.
            drop(unsafe { Box::from_raw(payload) });
            panic!("cuLaunchHostFunc on {stream:?}: {e:?}");
        }
        Gate {
            release: Some(release),
            opened,
        }
    }

    /// Lets the stream go on.
    pub fn release(&mut self) {
        self.release.take();
    }

    /// Whether the stream has passed the gate (released, or held for [`GATE_LIMIT`]).
    pub fn opened(&self) -> bool {
        self.opened.load(Ordering::SeqCst)
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.release();
    }
}
