//! The NCCL process group: `ProcessGroup` over NCCL communicators, one process per GPU.
//!
//! Every collective is launched on the backend's `Comm` stream after an event recorded on the
//! compute stream (so it sees the compute work issued before it), and an event recorded after
//! it is what [`Work::wait`] waits for. The wait is a watchdog ([`crate::watch`]): it
//! polls the event and `ncclCommGetAsyncError` until done, and on an NCCL error or past
//! `timeout` aborts the communicator (`ncclCommAbort`) and fails naming the rank, the group and
//! the collective, so a stalled peer ends the job instead of hanging it. After a successful
//! wait the compute stream also waits on the event, so the device results are ordered for it.
//!
//! Device views (the CUDA backend's memory) are used in place. Host views (the conformance
//! suite's, the counts of `exchange_counts`) and pinned memory are staged through device memory
//! the handle owns: copied in on the compute stream before the fence and out once the watchdog
//! has seen the collective complete, so no copy can block on a stalled peer, and the same suite
//! that checks the threads and MPI groups checks this one.
//!
//! The uneven all-to-all, gather and scatter are grouped `ncclSend`/`ncclRecv`
//! (`ncclGroupStart`/`ncclGroupEnd`), a rank's piece for itself a device copy; `split` is
//! `ncclCommSplit`, after a small all-gather of every rank's (color, key) so each group knows
//! its members' world ranks. The arguments are validated and the bytes counted by the checked
//! layer ([`crate::checks`]), as for the threads and MPI groups: this module is the transport.
//!
//! Communicator creation and split block inside NCCL until every peer joins; they run under a
//! deadline ([`crate::deadline`]) that ends the process with the same naming.
//!
//! Not yet run on a GPU: `ganymede device-check` runs the conformance suite on it at world size 1.

use crate::group::{Call, Membership, Transport};
use crate::{
    checks, watch, CommError, Op, Pending, Phase, Poll, ProcessGroup, RankCtx, Result, Watch,
    Watched, Work,
};
use cudarc::driver::sys as cu;
use cudarc::driver::CudaEvent;
use cudarc::nccl::sys as nc;
use ganymede_core::{DType, Stream, View, ViewMut};
use ganymede_cuda::device::probe::driver_error;
use ganymede_cuda::device::{place, place_mut, CudaBackend, DeviceMemory, Place};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Bytes of NCCL's unique id, which rank 0 makes and every rank needs to join.
pub const UNIQUE_ID_BYTES: usize = 128;

/// An NCCL communicator, aborted at most once, destroyed when the last handle goes.
struct Comm {
    raw: nc::ncclComm_t,
    aborted: AtomicBool,
    /// NCCL calls on one communicator must not overlap from several threads.
    lock: Mutex<()>,
}

// SAFETY: the communicator is used under `lock` (launches) or through NCCL's thread-safe calls
// (`ncclCommGetAsyncError`, `ncclCommAbort`).
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl Comm {
    fn abort(&self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            // SAFETY: a live communicator, aborted once.
            unsafe { nc::ncclCommAbort(self.raw) };
        }
    }
    /// NCCL's asynchronous error, if any (`ncclInProgress` is not one).
    fn async_error(&self) -> Option<String> {
        let mut r = nc::ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator and an out-parameter of the right type.
        let q = unsafe { nc::ncclCommGetAsyncError(self.raw, &mut r) };
        match (q, r) {
            (nc::ncclResult_t::ncclSuccess, nc::ncclResult_t::ncclSuccess)
            | (nc::ncclResult_t::ncclSuccess, nc::ncclResult_t::ncclInProgress) => None,
            (nc::ncclResult_t::ncclSuccess, e) | (e, _) => Some(self.describe(e)),
        }
    }
    /// An NCCL result as its name and NCCL's last message.
    fn describe(&self, r: nc::ncclResult_t) -> String {
        // SAFETY: NCCL returns static or communicator-owned C strings (or null).
        let text = |p: *const std::ffi::c_char| {
            if p.is_null() {
                String::new()
            } else {
                unsafe { std::ffi::CStr::from_ptr(p) }
                    .to_string_lossy()
                    .into_owned()
            }
        };
        let last = text(unsafe { nc::ncclGetLastError(self.raw) });
        let s = text(unsafe { nc::ncclGetErrorString(r) });
        if last.is_empty() {
            format!("{r:?} ({s})")
        } else {
            format!("{r:?} ({s}): {last}")
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if !self.aborted.load(Ordering::SeqCst) {
            // SAFETY: the last handle; every operation was waited for (or the comm aborted).
            unsafe { nc::ncclCommDestroy(self.raw) };
        }
    }
}

/// One rank's handle on an NCCL communicator.
pub struct NcclGroup {
    comm: Arc<Comm>,
    be: CudaBackend,
    m: Membership,
    timeout: Duration,
}

/// What a blocking NCCL call past its deadline does: it will never return, so end the process
/// with the error (the launcher then ends the job).
fn end_process(message: String) {
    eprintln!("error: {message}; ending the job");
    std::process::exit(1)
}

fn nccl_err(op: &'static str, message: String) -> CommError {
    CommError::Unsupported { op, message }
}

/// NCCL's unique id, made on rank 0 and handed to every rank (by MPI or the TCP store).
pub fn unique_id() -> Result<[u8; UNIQUE_ID_BYTES]> {
    crate::nccl_lib::check().map_err(|m| nccl_err("nccl", m))?;
    let mut id = nc::ncclUniqueId {
        internal: [0; UNIQUE_ID_BYTES],
    };
    // SAFETY: an out-parameter of the right type.
    let r = unsafe { nc::ncclGetUniqueId(&mut id) };
    if r != nc::ncclResult_t::ncclSuccess {
        return Err(nccl_err("nccl", format!("ncclGetUniqueId: {r:?}")));
    }
    Ok(id.internal.map(|c| c as u8))
}

impl NcclGroup {
    /// Join the world communicator as `rank` of `size` on the backend's GPU (collective: every
    /// rank calls it with the same id). Rank 0's `world` group; `timeout` bounds every wait.
    pub fn world(
        be: &CudaBackend,
        id: &[u8; UNIQUE_ID_BYTES],
        rank: usize,
        size: usize,
        ctx: RankCtx,
        timeout: Duration,
    ) -> Result<Arc<NcclGroup>> {
        crate::nccl_lib::check().map_err(|m| nccl_err("nccl", m))?;
        be.bind();
        let uid = nc::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let mut raw: nc::ncclComm_t = std::ptr::null_mut();
        let guard = crate::deadline(
            &Watch {
                op: "ncclCommInitRank",
                group: "world".into(),
                rank: ctx.world_rank,
                timeout,
            },
            end_process,
        );
        // SAFETY: out-parameter; NCCL uses the current device, the backend's (bound above).
        let r = unsafe { nc::ncclCommInitRank(&mut raw, size as i32, uid, rank as i32) };
        drop(guard);
        if r != nc::ncclResult_t::ncclSuccess {
            return Err(CommError::Aborted {
                op: "init",
                group: "world".into(),
                rank: ctx.world_rank,
                message: format!("ncclCommInitRank: {r:?}"),
            });
        }
        Ok(Arc::new(NcclGroup {
            comm: Arc::new(Comm {
                raw,
                aborted: AtomicBool::new(false),
                lock: Mutex::new(()),
            }),
            be: be.clone(),
            m: Membership {
                rank,
                world_ranks: (0..size).collect(),
                name: "world".into(),
                ctx,
            },
            timeout,
        }))
    }

    fn watch_of(&self, op: Op) -> Watch {
        Watch {
            op: op.name(),
            group: self.m.name.clone(),
            rank: self.m.ctx.world_rank,
            timeout: self.timeout,
        }
    }

    fn comm_stream(&self) -> &Arc<cudarc::driver::CudaStream> {
        self.be.stream(Stream::Comm)
    }

    fn check_live(&self, op: Op) -> Result<()> {
        if self.comm.aborted.load(Ordering::SeqCst) {
            return Err(CommError::Aborted {
                op: op.name(),
                group: self.m.name.clone(),
                rank: self.m.ctx.world_rank,
                message: "the communicator was aborted by an earlier failure".into(),
            });
        }
        Ok(())
    }
}

/// A device operand: address, element count, dtype.
#[derive(Clone, Copy)]
struct Ptr {
    addr: u64,
    len: usize,
    dtype: DType,
}

impl Ptr {
    fn at(self, off: usize, len: usize) -> Ptr {
        Ptr {
            addr: self.addr + (off * self.dtype.size()) as u64,
            len,
            dtype: self.dtype,
        }
    }
    fn cv(self) -> *const std::ffi::c_void {
        self.addr as usize as *const _
    }
    fn mv(self) -> *mut std::ffi::c_void {
        self.addr as usize as *mut _
    }
}

fn nccl_dtype(op: &'static str, d: DType) -> Result<nc::ncclDataType_t> {
    Ok(match d {
        DType::F32 => nc::ncclDataType_t::ncclFloat32,
        DType::F64 => nc::ncclDataType_t::ncclFloat64,
        DType::BF16 => nc::ncclDataType_t::ncclBfloat16,
        DType::U32 => nc::ncclDataType_t::ncclUint32,
        #[allow(unreachable_patterns)]
        _ => return Err(nccl_err(op, format!("dtype {} not served", d.name()))),
    })
}

/// One collective being put together: staging buffers and the copies in and out.
struct Launch<'g> {
    g: &'g NcclGroup,
    op: Op,
    stages: Vec<DeviceMemory>,
    copy_in: Vec<(u64, u64, usize)>,
    copy_out: Vec<(u64, u64, usize)>,
}

impl<'g> Launch<'g> {
    fn new(g: &'g NcclGroup, op: Op) -> Result<Self> {
        g.check_live(op)?;
        g.be.bind();
        Ok(Self {
            g,
            op,
            stages: Vec::new(),
            copy_in: Vec::new(),
            copy_out: Vec::new(),
        })
    }

    /// The device address of `p`: itself on the device, else a staging buffer (copied in when
    /// `input`, copied back when `output`).
    fn operand(&mut self, p: Place, input: bool, output: bool) -> Result<Ptr> {
        // Device memory is freed, and pinned memory released, only after the comm stream's work.
        // (The collective itself waits for compute, so a fresh buffer is ready: see `run`.)
        if let Some(u) = p.uses {
            u.mark(Stream::Comm);
        }
        if p.on_device {
            return Ok(Ptr {
                addr: p.addr,
                len: p.len,
                dtype: p.dtype,
            });
        }
        let m = self.g.be.alloc(p.len, p.dtype).map_err(|e| {
            nccl_err(
                self.op.name(),
                format!("staging memory: {}", driver_error(&e)),
            )
        })?;
        m.uses.mark(Stream::Comm);
        let addr = m.addr;
        if input {
            self.copy_in.push((addr, p.addr, p.bytes));
        }
        if output {
            self.copy_out.push((p.addr, addr, p.bytes));
        }
        self.stages.push(m);
        Ok(Ptr {
            addr,
            len: p.len,
            dtype: p.dtype,
        })
    }
    fn input(&mut self, v: &View) -> Result<Ptr> {
        self.operand(place(v), true, false)
    }
    fn output(&mut self, v: &mut ViewMut) -> Result<Ptr> {
        self.operand(place_mut(v), false, true)
    }
    fn inout(&mut self, v: &mut ViewMut) -> Result<Ptr> {
        self.operand(place_mut(v), true, true)
    }

    fn memcpy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        self.memcpy_on(Stream::Comm, dst, src, bytes)
    }

    fn memcpy_on(&self, stream: Stream, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let s = self.g.be.stream(stream).cu_stream();
        // SAFETY: ranges of views or staging buffers of `bytes` bytes, kept alive by the handle.
        unsafe { cu::cuMemcpyAsync(dst, src, bytes, s) }
            .result()
            .map_err(|e| nccl_err(self.op.name(), driver_error(&e)))
    }

    /// Order after compute, copy in, run `body` on the comm stream (under the communicator's
    /// lock), record the completion event (the copies out wait for it, in `wait`).
    fn run<'a>(
        self,
        call: Call,
        body: impl FnOnce(&Self, nc::cudaStream_t) -> std::result::Result<(), nc::ncclResult_t>,
    ) -> Result<Work<'a>>
    where
        'g: 'a,
    {
        let g = self.g;
        let posted = Instant::now();
        let compute = g.be.stream(Stream::Compute);
        let comm = g.comm_stream();
        let drv = |e: cudarc::driver::DriverError| nccl_err(self.op.name(), driver_error(&e));
        // Host data goes in on the compute stream, after the staging buffer's allocation: a
        // copy from pageable memory may wait for its stream, and compute never waits for a
        // pending collective, so this cannot block on a stalled peer (the comm stream could).
        for &(d, s, b) in &self.copy_in {
            self.memcpy_on(Stream::Compute, d, s, b)?;
        }
        let fence = compute.record_event(None).map_err(drv)?;
        comm.wait(&fence).map_err(drv)?;
        {
            let _l = g.comm.lock.lock().unwrap_or_else(|e| e.into_inner());
            if let Err(r) = body(&self, comm.cu_stream() as nc::cudaStream_t) {
                let message = g.comm.describe(r);
                g.comm.abort();
                return Err(CommError::Aborted {
                    op: self.op.name(),
                    group: g.m.name.clone(),
                    rank: g.m.ctx.world_rank,
                    message,
                });
            }
        }
        // Copies back to host memory wait for the watchdog's all-clear (in `wait`): a copy into
        // pageable memory blocks the host until the collective is done, with no deadline.
        let done = comm.record_event(None).map_err(drv)?;
        Ok(Work::new(Box::new(NcclPending {
            g,
            call,
            posted,
            done: Some(done),
            copy_out: self.copy_out,
            stages: self.stages,
            _borrow: PhantomData,
        })))
    }
}

/// Rank `j`'s piece of a buffer holding `counts[j]` elements per rank, consecutive in rank order.
fn pieces(p: Ptr, counts: &[usize]) -> Vec<(usize, Ptr)> {
    let mut off = 0;
    counts
        .iter()
        .enumerate()
        .map(|(j, &c)| {
            let x = (j, p.at(off, c));
            off += c;
            x
        })
        .collect()
}

fn ok(r: nc::ncclResult_t) -> std::result::Result<(), nc::ncclResult_t> {
    match r {
        nc::ncclResult_t::ncclSuccess | nc::ncclResult_t::ncclInProgress => Ok(()),
        e => Err(e),
    }
}

/// A launched collective: its completion event and the staging memory it uses.
struct NcclPending<'a> {
    g: &'a NcclGroup,
    call: Call,
    posted: Instant,
    done: Option<CudaEvent>,
    /// (host, staging, bytes): results to copy to host views after completion.
    copy_out: Vec<(u64, u64, usize)>,
    stages: Vec<DeviceMemory>,
    /// The views' buffers stay borrowed until the wait.
    _borrow: PhantomData<&'a mut ()>,
}

/// What the watchdog polls: the completion event and the communicator's error state.
struct Poller<'p> {
    comm: &'p Comm,
    done: &'p CudaEvent,
    stream: &'p cudarc::driver::CudaStream,
}

impl Watched for Poller<'_> {
    fn poll(&mut self) -> Poll {
        match self.done.try_is_complete() {
            Ok(true) => return Poll::Done,
            Ok(false) => {}
            Err(e) => return Poll::Failed(driver_error(&e)),
        }
        match self.comm.async_error() {
            Some(e) => Poll::Failed(e),
            None => Poll::Pending,
        }
    }
    fn abort(&mut self) {
        self.comm.abort();
        // The aborted kernels return, so the staging memory is no longer touched once this
        // returns (host views are never written: their copy back needs a completed wait).
        let _ = self.stream.synchronize();
    }
}

impl Pending for NcclPending<'_> {
    fn wait(mut self: Box<Self>) -> Result<()> {
        let t0 = Instant::now();
        let done = self.done.take().expect("waited once");
        let stream = self.g.comm_stream().clone();
        let mut p = Poller {
            comm: &self.g.comm,
            done: &done,
            stream: &stream,
        };
        let mut r = watch(&self.g.watch_of(self.call.op), &mut p);
        if r.is_ok() {
            // Device results are ordered for the compute stream's later work.
            let _ = self.g.be.stream(Stream::Compute).wait(&done);
            r = self.copy_back();
        }
        let t1 = Instant::now();
        self.call.trace(&self.g.m.ctx.tracer, self.posted, t0, t1);
        r
    }
    fn ready(&mut self) -> bool {
        self.done
            .as_ref()
            .is_none_or(|d| d.try_is_complete().unwrap_or(true))
    }
    fn abandon(mut self: Box<Self>) {
        // During a panic: do not wait for peers. Abort, so nothing keeps writing the buffers.
        self.g.comm.abort();
        let _ = self.g.comm_stream().synchronize();
        self.done = None;
    }
}

impl NcclPending<'_> {
    /// Staged results into the host views, once the collective is complete: synchronous
    /// copies on the legacy stream, which the backend's non-blocking streams do not wait for
    /// (a copy on the comm stream would queue behind collectives posted later, which may stall).
    fn copy_back(&self) -> Result<()> {
        for &(host, dev, bytes) in &self.copy_out {
            if bytes > 0 {
                // SAFETY: the host view (borrowed by this handle) and its staging buffer, both
                // `bytes` long; the collective that wrote the staging buffer is complete.
                unsafe { cu::cuMemcpyDtoH_v2(host as usize as *mut std::ffi::c_void, dev, bytes) }
                    .result()
                    .map_err(|e| nccl_err(self.call.op.name(), driver_error(&e)))?;
            }
        }
        Ok(())
    }
}

impl Drop for NcclPending<'_> {
    fn drop(&mut self) {
        // Staging memory is freed on the compute stream after the comm stream's work (its
        // `Uses` say so), so dropping it here is stream-ordered.
        self.stages.clear();
    }
}

impl NcclGroup {
    /// Rank-to-rank sends and receives as one NCCL group; pieces for this rank are copies.
    fn p2p<'a>(
        &'a self,
        l: Launch<'a>,
        sends: Vec<(usize, Ptr)>,
        recvs: Vec<(usize, Ptr)>,
        call: Call,
    ) -> Result<Work<'a>> {
        let me = self.m.rank;
        let raw = self.comm.raw;
        l.run(call, move |l, st| {
            for (&(_, s), &(_, r)) in sends
                .iter()
                .filter(|(j, _)| *j == me)
                .zip(recvs.iter().filter(|(j, _)| *j == me))
            {
                l.memcpy(r.addr, s.addr, s.len * s.dtype.size())
                    .map_err(|_| nc::ncclResult_t::ncclUnhandledCudaError)?;
            }
            // SAFETY: NCCL group calls; every range is a device range alive until the wait.
            unsafe {
                ok(nc::ncclGroupStart())?;
                for &(j, s) in sends.iter().filter(|(j, p)| *j != me && p.len > 0) {
                    ok(nc::ncclSend(
                        s.cv(),
                        s.len,
                        nccl_dtype("send", s.dtype).unwrap(),
                        j as i32,
                        raw,
                        st,
                    ))?;
                }
                for &(j, r) in recvs.iter().filter(|(j, p)| *j != me && p.len > 0) {
                    ok(nc::ncclRecv(
                        r.mv(),
                        r.len,
                        nccl_dtype("recv", r.dtype).unwrap(),
                        j as i32,
                        raw,
                        st,
                    ))?;
                }
                ok(nc::ncclGroupEnd())
            }
        })
    }
}

impl Transport for NcclGroup {
    fn membership(&self) -> &Membership {
        &self.m
    }

    fn post_all_gather<'a>(
        &'a self,
        call: Call,
        send: View<'a>,
        mut recv: ViewMut<'a>,
    ) -> Result<Work<'a>> {
        let n = send.len();
        let dt = nccl_dtype("all_gather", send.dtype())?;
        let mut l = Launch::new(self, call.op)?;
        let s = l.input(&send)?;
        let r = l.output(&mut recv)?;
        let raw = self.comm.raw;
        l.run(call, |_, st| {
            // SAFETY: device ranges of n and w*n elements, alive until the wait.
            ok(unsafe { nc::ncclAllGather(s.cv(), r.mv(), n, dt, raw, st) })
        })
    }

    fn post_reduce_scatter<'a>(
        &'a self,
        call: Call,
        send: View<'a>,
        mut recv: ViewMut<'a>,
    ) -> Result<Work<'a>> {
        let n = recv.len();
        let dt = nccl_dtype("reduce_scatter", send.dtype())?;
        let mut l = Launch::new(self, call.op)?;
        let s = l.input(&send)?;
        let r = l.output(&mut recv)?;
        let raw = self.comm.raw;
        l.run(call, |_, st| {
            // SAFETY: device ranges of w*n and n elements, alive until the wait.
            ok(unsafe {
                nc::ncclReduceScatter(s.cv(), r.mv(), n, dt, nc::ncclRedOp_t::ncclSum, raw, st)
            })
        })
    }

    fn post_all_reduce<'a>(&'a self, call: Call, mut buf: ViewMut<'a>) -> Result<Work<'a>> {
        let dt = nccl_dtype("all_reduce", buf.dtype())?;
        let mut l = Launch::new(self, call.op)?;
        let b = l.inout(&mut buf)?;
        let raw = self.comm.raw;
        l.run(call, |_, st| {
            // SAFETY: in place over one device range, alive until the wait.
            ok(unsafe {
                nc::ncclAllReduce(b.cv(), b.mv(), b.len, dt, nc::ncclRedOp_t::ncclSum, raw, st)
            })
        })
    }

    fn post_alltoallv<'a>(
        &'a self,
        call: Call,
        send: View<'a>,
        send_counts: &[usize],
        mut recv: ViewMut<'a>,
        recv_counts: &[usize],
    ) -> Result<Work<'a>> {
        let me = self.m.rank;
        nccl_dtype("alltoallv", send.dtype())?;
        // This rank's piece for itself is a device copy, not a send and a receive: the two
        // counts must agree here (the other groups find a disagreement in the exchange).
        if send_counts[me] != recv_counts[me] {
            return Err(CommError::Mismatch {
                op: "alltoallv",
                group: self.m.name.clone(),
                message: format!(
                    "rank {me} sends itself {} elements but expects {}",
                    send_counts[me], recv_counts[me]
                ),
            });
        }
        let mut l = Launch::new(self, call.op)?;
        let s = l.input(&send)?;
        let r = l.output(&mut recv)?;
        self.p2p(l, pieces(s, send_counts), pieces(r, recv_counts), call)
    }

    fn post_broadcast<'a>(&'a self, call: Call, mut buf: ViewMut<'a>) -> Result<Work<'a>> {
        let dt = nccl_dtype("broadcast", buf.dtype())?;
        let mut l = Launch::new(self, call.op)?;
        // Only the root's contents matter going in.
        let p = place_mut(&mut buf);
        let b = l.operand(p, call.is_root, true)?;
        let (raw, root) = (self.comm.raw, call.root as i32);
        l.run(call, |_, st| {
            // SAFETY: in place over one device range, alive until the wait.
            ok(unsafe { nc::ncclBroadcast(b.cv(), b.mv(), b.len, dt, root, raw, st) })
        })
    }

    fn post_reduce<'a>(&'a self, call: Call, mut buf: ViewMut<'a>) -> Result<Work<'a>> {
        let dt = nccl_dtype("reduce", buf.dtype())?;
        let mut l = Launch::new(self, call.op)?;
        let p = place_mut(&mut buf);
        // Other ranks' buffers are left as they were: only the root's is copied back.
        let b = l.operand(p, true, call.is_root)?;
        let (raw, root) = (self.comm.raw, call.root as i32);
        l.run(call, |_, st| {
            // SAFETY: in place over one device range, alive until the wait; NCCL writes the
            // receive buffer on the root only.
            ok(unsafe {
                nc::ncclReduce(
                    b.cv(),
                    b.mv(),
                    b.len,
                    dt,
                    nc::ncclRedOp_t::ncclSum,
                    root,
                    raw,
                    st,
                )
            })
        })
    }

    fn post_gather<'a>(
        &'a self,
        call: Call,
        send: View<'a>,
        mut recv: Option<ViewMut<'a>>,
    ) -> Result<Work<'a>> {
        let (w, n) = (self.m.world_ranks.len(), send.len());
        nccl_dtype("gather", send.dtype())?;
        let mut l = Launch::new(self, call.op)?;
        let s = l.input(&send)?;
        let sends = vec![(call.root, s)];
        let recvs = match &mut recv {
            Some(r) => {
                let r = l.output(r)?;
                (0..w).map(|j| (j, r.at(j * n, n))).collect()
            }
            None => Vec::new(),
        };
        self.p2p(l, sends, recvs, call)
    }

    fn post_scatter<'a>(
        &'a self,
        call: Call,
        send: Option<View<'a>>,
        mut recv: ViewMut<'a>,
    ) -> Result<Work<'a>> {
        let (w, n) = (self.m.world_ranks.len(), recv.len());
        nccl_dtype("scatter", recv.dtype())?;
        let mut l = Launch::new(self, call.op)?;
        let r = l.output(&mut recv)?;
        let sends = match &send {
            Some(s) => {
                let s = l.input(s)?;
                (0..w).map(|j| (j, s.at(j * n, n))).collect()
            }
            None => Vec::new(),
        };
        self.p2p(l, sends, vec![(call.root, r)], call)
    }

    fn post_barrier(&self, call: Call) -> Result<Work<'_>> {
        // A one-element all-reduce on device memory the handle owns.
        let mut l = Launch::new(self, call.op)?;
        let m = self
            .be
            .alloc(1, DType::F32)
            .map_err(|e| nccl_err("barrier", driver_error(&e)))?;
        m.uses.mark(Stream::Comm);
        let addr = m.addr;
        l.stages.push(m);
        let raw = self.comm.raw;
        l.run(call, move |_, st| {
            let p = addr as usize as *mut std::ffi::c_void;
            // SAFETY: the one-element staging buffer, alive until the wait.
            ok(unsafe {
                nc::ncclAllReduce(
                    p,
                    p,
                    1,
                    nc::ncclDataType_t::ncclFloat32,
                    nc::ncclRedOp_t::ncclSum,
                    raw,
                    st,
                )
            })
        })
    }

    fn split_group(
        &self,
        color: Option<usize>,
        key: usize,
        name: &str,
    ) -> Result<Option<Arc<dyn ProcessGroup>>> {
        // Every rank's (color + 1, key), so each new group knows its members (NCCL orders the
        // new ranks by key, then by rank here, as the other backends do).
        // The all-gather goes to the transport directly: it is part of the split, which the
        // layer counts as one call of no bytes.
        let w = self.m.world_ranks.len();
        let mine = [color.map_or(0, |c| c as u32 + 1), key as u32];
        let mut all = vec![0u32; 2 * w];
        let (sent, recv) = checks::all_gather(w, 2, 2 * w, DType::U32.size())?;
        let call = Call {
            op: Op::AllGather,
            phase: Phase::Other,
            root: 0,
            is_root: false,
            sent,
            recv,
        };
        self.post_all_gather(call, View::HostU32(&mine), ViewMut::HostU32(&mut all))?
            .wait()?;
        let mut new: nc::ncclComm_t = std::ptr::null_mut();
        {
            let _l = self.comm.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.be.bind();
            // NCCL_SPLIT_NOCOLOR: this rank joins no group.
            let c = color.map_or(-1, |c| c as i32);
            let guard = crate::deadline(
                &Watch {
                    op: "ncclCommSplit",
                    ..self.watch_of(Op::Split)
                },
                end_process,
            );
            // SAFETY: a live communicator and an out-parameter; a null config inherits it.
            let r = unsafe {
                nc::ncclCommSplit(self.comm.raw, c, key as i32, &mut new, std::ptr::null_mut())
            };
            drop(guard);
            if r != nc::ncclResult_t::ncclSuccess {
                let message = self.comm.describe(r);
                self.comm.abort();
                return Err(CommError::Aborted {
                    op: "split",
                    group: self.m.name.clone(),
                    rank: self.m.ctx.world_rank,
                    message,
                });
            }
        }
        let Some(c) = color else { return Ok(None) };
        let mut mates: Vec<(u32, usize)> = (0..w)
            .filter(|&j| all[2 * j] == c as u32 + 1)
            .map(|j| (all[2 * j + 1], j))
            .collect();
        mates.sort_unstable();
        let members: Vec<usize> = mates.iter().map(|&(_, j)| self.m.world_ranks[j]).collect();
        let rank = mates
            .iter()
            .position(|&(_, j)| j == self.m.rank)
            .expect("this rank is in its own color");
        Ok(Some(Arc::new(NcclGroup {
            comm: Arc::new(Comm {
                raw: new,
                aborted: AtomicBool::new(false),
                lock: Mutex::new(()),
            }),
            be: self.be.clone(),
            m: Membership {
                rank,
                world_ranks: members,
                name: name.to_string(),
                ctx: self.m.ctx.clone(),
            },
            timeout: self.timeout,
        })))
    }
}

/// The device check's section: the conformance suite on a world-1 NCCL group, against the
/// expected answers and the threads backend's byte counters.
pub fn conformance_world1(be: &CudaBackend) -> std::result::Result<String, String> {
    use crate::conformance;
    let id = unique_id().map_err(|e| e.to_string())?;
    let g = NcclGroup::world(
        be,
        &id,
        0,
        1,
        RankCtx::new(0, false),
        Duration::from_secs(60),
    )
    .map_err(|e| e.to_string())?;
    let t = Instant::now();
    let (out, snap) = conformance::run(&*g).map_err(|e| e.to_string())?;
    let secs = t.elapsed().as_secs_f64();
    let want = conformance::expected(0, 1);
    if out != want {
        let bad: Vec<&str> = out
            .iter()
            .zip(&want)
            .filter(|(a, b)| a != b)
            .map(|(a, _)| a.0.as_str())
            .collect();
        return Err(format!(
            "outputs differ from the expected ones in: {}",
            bad.join(", ")
        ));
    }
    let threads = crate::threads_world(1, &Default::default())
        .pop()
        .expect("one rank");
    let (_, tsnap) = conformance::run(&threads).map_err(|e| e.to_string())?;
    if snap != tsnap {
        return Err(format!(
            "byte counters differ from the threads backend's: {snap:?} vs {tsnap:?}"
        ));
    }
    Ok(format!(
        "{} collectives (f32, f64, bf16, u32 counts; a split) match the expected outputs and \
         the threads backend's counters, in {secs:.3} s. World size 1 only: NCCL does not put \
         two ranks on one GPU.\n",
        out.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alltoallv_pieces_are_consecutive_in_rank_order_in_bytes() {
        let p = Ptr {
            addr: 1000,
            len: 7,
            dtype: DType::BF16,
        };
        let got: Vec<(usize, u64, usize)> = pieces(p, &[3, 0, 4])
            .into_iter()
            .map(|(j, q)| (j, q.addr, q.len))
            .collect();
        assert_eq!(got, vec![(0, 1000, 3), (1, 1006, 0), (2, 1006, 4)]);
    }

    #[test]
    fn every_dtype_of_the_seam_has_an_nccl_type() {
        use nc::ncclDataType_t::*;
        let m = |d| nccl_dtype("t", d).unwrap();
        assert_eq!(m(DType::F32), ncclFloat32);
        assert_eq!(m(DType::F64), ncclFloat64);
        assert_eq!(m(DType::BF16), ncclBfloat16);
        assert_eq!(m(DType::U32), ncclUint32);
    }
}
