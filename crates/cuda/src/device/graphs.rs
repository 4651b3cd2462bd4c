//! CUDA graphs (`Memory::graph`): the first call for a key captures its body's work on the
//! compute stream (`cuStreamBeginCapture`, relaxed mode, so that pinned allocation stays
//! allowed) into a graph, instantiated and launched; later calls launch that graph. While a
//! capture runs:
//! - a staged write copies from pinned memory of its own, kept with the graph
//!   (`staging::stage_in_capture`): a replay copies the captured bytes;
//! - device memory allocated before the capture and let go inside it is kept with the graph
//!   (the graph still uses it); memory allocated inside it is the graph's own (allocation
//!   nodes) and must be freed inside it: the graph frees its allocations at its next launch
//!   (`CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH`), so one that outlived the body would
//!   be freed under its owner, and the capture panics instead;
//! - a host wait panics (a read, a blocking write, `synchronize`): a capture cannot hold one;
//! - phase marks are skipped: the graph is timed as one piece, under the phase that launches it.
//!
//! cuBLAS gets a workspace of its own once, at set-up, so that its calls allocate nothing
//! inside a capture and eager and replayed GEMMs pick their algorithms with the same workspace.

use super::{ok, CudaBackend, DeviceError, Streams};
use cudarc::cublas::sys as cublas_sys;
use cudarc::cublas::CudaBlas;
use cudarc::driver::sys;
use cudarc::driver::{CudaGraph, CudaSlice, CudaStream, PinnedHostSlice};
use ganymede_core::{GraphRun, Tensor};
use std::collections::HashSet;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// cuBLAS's workspace: 32 MiB, what NVIDIA advises for Hopper (4 MiB suffices before it). Not
/// in the ledger, as cuBLAS's own workspace was not.
const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// What a capture holds while it runs, then its graph for as long as the graph lives.
#[derive(Default)]
pub(super) struct Capture {
    /// Device addresses allocated inside the capture and not freed there: the graph's own.
    allocated: HashSet<u64>,
    /// Device memory from before the capture that its body let go: the graph still reads or
    /// writes it.
    kept: Vec<CudaSlice<u8>>,
    kept_pinned: Vec<PinnedHostSlice<u8>>,
    /// The pinned sources of the body's staged writes.
    held: Vec<Tensor>,
}

/// A captured graph (none where the body issued no work) and what it keeps alive.
pub(super) struct Captured {
    graph: Option<CudaGraph>,
    _holds: Capture,
}

// SAFETY: the graph and the memory it keeps are used under the backend's lock on them only
// (`Inner::graphs`); cudarc's handles are plain driver handles.
unsafe impl Send for Captured {}

impl Streams {
    fn lock_capture(&self) -> std::sync::MutexGuard<'_, Option<Capture>> {
        self.capture.lock().unwrap_or_else(|e| e.into_inner())
    }
    /// Whether a graph's capture runs on the compute stream.
    pub(super) fn capturing(&self) -> bool {
        self.capturing.load(Ordering::Acquire)
    }
    /// Start (`Some`) or end (`None`, returning it) a capture's holdings.
    fn set_capture(&self, c: Option<Capture>) -> Option<Capture> {
        let mut capture = self.lock_capture();
        self.capturing.store(c.is_some(), Ordering::Release);
        std::mem::replace(&mut *capture, c)
    }
    /// Panic where a capture runs: `what` cannot be captured.
    pub(super) fn refuse_in_capture(&self, what: &str) {
        if self.capturing() {
            panic!(
                "{what} inside a CUDA graph's capture: a graph cannot hold it \
                 (training.cuda_graphs = false runs the step without graphs)"
            );
        }
    }
    /// Device memory at `addr` was allocated now.
    pub(super) fn allocated(&self, addr: u64) {
        if !self.capturing() {
            return;
        }
        if let Some(c) = self.lock_capture().as_mut() {
            c.allocated.insert(addr);
        }
    }
    /// `slice` (at `addr`) is let go: kept by the capture that runs if it is older than the
    /// capture (`None`), else handed back to be freed (in stream order: inside the graph).
    pub(super) fn keep(&self, addr: u64, slice: CudaSlice<u8>) -> Option<CudaSlice<u8>> {
        if !self.capturing() {
            return Some(slice);
        }
        let mut capture = self.lock_capture();
        let Some(c) = capture.as_mut() else {
            return Some(slice);
        };
        if c.allocated.remove(&addr) {
            // The graph's own, freed inside it (a free node).
            return Some(slice);
        }
        c.kept.push(slice);
        None
    }
    /// Pinned memory let go: kept by the capture that runs (`None`), else handed back.
    pub(super) fn keep_pinned(&self, slice: PinnedHostSlice<u8>) -> Option<PinnedHostSlice<u8>> {
        if !self.capturing() {
            return Some(slice);
        }
        match self.lock_capture().as_mut() {
            Some(c) => {
                c.kept_pinned.push(slice);
                None
            }
            None => Some(slice),
        }
    }
    /// `t` lives as long as the graph being captured.
    pub(super) fn hold(&self, t: Tensor) {
        self.lock_capture()
            .as_mut()
            .expect("a capture to hold memory")
            .held
            .push(t);
    }
}

/// cuBLAS's workspace on `stream`, set on `blas` (`None`, with a note, where cuBLAS refuses it;
/// an error only where the memory cannot be had).
pub(super) fn set_blas_workspace(
    blas: &CudaBlas,
    stream: &Arc<CudaStream>,
) -> Result<Option<CudaSlice<u8>>, DeviceError> {
    use cudarc::driver::DevicePtr;
    // SAFETY: cuBLAS writes it before it reads it.
    let w =
        unsafe { stream.alloc::<u8>(BLAS_WORKSPACE_BYTES) }.map_err(|e| DeviceError::Driver {
            what: "cuBLAS workspace".into(),
            error: super::probe::driver_error(&e),
        })?;
    let (ptr, _) = w.device_ptr(stream);
    // SAFETY: the handle is `blas`'s; the workspace outlives it (dropped after it, see
    // `Inner`), and `ptr` holds `BLAS_WORKSPACE_BYTES`.
    let r = unsafe {
        cublas_sys::cublasSetWorkspace_v2(
            *blas.handle(),
            ptr as *mut std::ffi::c_void,
            BLAS_WORKSPACE_BYTES,
        )
    };
    if r != cublas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        // Not fatal: cuBLAS keeps its own workspace, and only a graph's capture needs ours.
        eprintln!("note: cuBLAS did not take a workspace ({r:?}); CUDA graphs may fail to capture");
        return Ok(None);
    }
    Ok(Some(w))
}

impl CudaBackend {
    /// [`ganymede_core::Memory::graph`] (see the module's text).
    pub(super) fn graph(&self, key: u64, body: &mut dyn FnMut()) -> GraphRun {
        {
            let graphs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(c) = graphs.get(&key) {
                if let Some(g) = &c.graph {
                    ok(g.launch(), "graph launch");
                }
                return GraphRun::Replayed;
            }
        }
        assert!(
            !self.streams.capturing(),
            "graph {key} inside another's capture"
        );
        self.streams.set_capture(Some(Capture::default()));
        let compute = self.compute();
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        ok(compute.begin_capture(mode), "graph capture");
        let ran = catch_unwind(AssertUnwindSafe(&mut *body));
        // Ended however the body ended, so that the stream works again after a panic.
        let flags = sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH;
        let graph = compute.end_capture(flags);
        let holds = self.streams.set_capture(None).unwrap_or_default();
        if let Err(p) = ran {
            resume_unwind(p);
        }
        // The graph frees its allocations at its next launch: one that outlives the body
        // would be freed under its owner.
        let outliving = holds.allocated.len();
        assert!(
            outliving == 0,
            "graph {key}: its body made {outliving} device buffer(s) that outlive it, which a \
             replay would free: they must be made before the graph (training.cuda_graphs = \
             false runs the step without graphs)"
        );
        let graph = ok(graph, &format!("capturing graph {key}"));
        if let Some(g) = &graph {
            ok(g.launch(), "graph launch");
        }
        let mut graphs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        graphs.insert(
            key,
            Captured {
                graph,
                _holds: holds,
            },
        );
        GraphRun::Captured
    }

    /// [`ganymede_core::Memory::forget_graph`]: once the compute stream is done with it (a
    /// launch may still read the pinned memory it keeps).
    pub(super) fn forget_graph(&self, key: u64) {
        let gone = self
            .graphs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&key);
        if gone.is_some() {
            self.sync_compute();
        }
    }

    /// Graphs held now.
    pub fn graphs_held(&self) -> usize {
        self.graphs.lock().map(|g| g.len()).unwrap_or(0)
    }
}
