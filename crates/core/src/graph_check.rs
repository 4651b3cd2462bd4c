//! A backend that holds [`Memory::graph`]'s bodies to what a CUDA graph replays, on a backend
//! that runs them eagerly (the CPU, the kernels' host build), so that a step made replayable is
//! tested where there is no GPU.
//!
//! A graph's replay issues the work captured the first time: its kernels, and its host writes
//! with the bytes they had then. Calling the body again instead is the same only if the body
//! writes the same bytes each time, reads nothing back and never waits, which is what this
//! wrapper checks: the first run of a key records each host write (destination and bytes) and
//! each allocation; every later run must make the same ones, or it panics naming the first
//! that differs (the write that belongs before the graph). A read or a host wait inside a body
//! panics at once. The kernels' own launches are the launch log's to compare
//! (`ganymede_cuda::launch::Recording`).

use crate::backend::{Backend, Blas, GraphRun, Memory, NnOps, OptimOps};
use crate::ledger::Category;
use crate::stream::Event;
use crate::tensor::{DType, Tensor, View, ViewMut};
use crate::{forward_all_optim_ops, forward_blas, forward_memory, forward_nn_kernels, MemoryError};
use std::collections::HashMap;
use std::sync::Mutex;

/// What the bodies of [`GraphCheck`] have done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphRuns {
    /// First runs of a key (what a GPU captures).
    pub captured: usize,
    /// Later runs: each body held to its key's first, or a real graph's replay.
    pub replayed: usize,
    /// Host writes and allocations inside the first runs.
    pub captured_effects: usize,
}

/// One host write or allocation inside a body: where (a buffer's address and byte offset, or
/// none for a new tensor), what, and the bytes written.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Effect {
    what: &'static str,
    at: (usize, usize),
    len: usize,
    bytes: Vec<u8>,
}

#[derive(Default)]
struct State {
    /// The key whose body is running and what it has done so far.
    open: Option<(u64, Vec<Effect>)>,
    first: HashMap<u64, Vec<Effect>>,
    runs: GraphRuns,
}

/// `inner` with its graphs' bodies checked (see the module's text).
pub struct GraphCheck<B> {
    pub inner: B,
    state: Mutex<State>,
}

impl<B: Backend> GraphCheck<B> {
    pub fn new(inner: B) -> Self {
        GraphCheck {
            inner,
            state: Mutex::default(),
        }
    }

    pub fn runs(&self) -> GraphRuns {
        self.lock().runs
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Note `e` if a body is running.
    fn effect(&self, e: impl FnOnce() -> Effect) {
        if let Some((_, effects)) = &mut self.lock().open {
            effects.push(e());
        }
    }

    /// A body may not do `what` (a graph cannot hold it).
    fn refuse(&self, what: &str) {
        let open = self.lock().open.as_ref().map(|(k, _)| *k);
        if let Some(key) = open {
            panic!("graph {key}: {what} inside a graph's body (a CUDA graph cannot capture it)");
        }
    }
}

/// A view's place: its buffer's address and the byte offset into it, and its length in bytes.
fn place_of(v: &ViewMut) -> ((usize, usize), usize) {
    let bytes = v.len() * v.dtype().size();
    let at = match v {
        ViewMut::Host(s) => (s.as_ptr() as usize, 0),
        ViewMut::Host64(s) => (s.as_ptr() as usize, 0),
        ViewMut::HostBf16(s) => (s.as_ptr() as usize, 0),
        ViewMut::HostU32(s) => (s.as_ptr() as usize, 0),
        ViewMut::Device(d) => {
            let buf = d.buffer() as *const dyn crate::DeviceBuffer as *const () as usize;
            (buf, d.offset() * d.dtype().size())
        }
    };
    (at, bytes)
}

fn bytes_of<T: Copy>(data: &[T]) -> Vec<u8> {
    let n = std::mem::size_of_val(data);
    // SAFETY: `data` is `n` initialised bytes of plain numbers (f32, f64, u32).
    unsafe { std::slice::from_raw_parts(data.as_ptr() as *const u8, n) }.to_vec()
}

fn write(what: &'static str, dst: &ViewMut, bytes: Vec<u8>) -> Effect {
    let (at, len) = place_of(dst);
    Effect {
        what,
        at,
        len,
        bytes,
    }
}

fn new_tensor(what: &'static str, len: usize, bytes: Vec<u8>) -> Effect {
    Effect {
        what,
        at: (0, 0),
        len,
        bytes,
    }
}

/// Where a later run's effects first differ from the first run's.
fn first_difference(first: &[Effect], now: &[Effect]) -> Option<String> {
    let at = first.iter().zip(now).position(|(a, b)| a != b);
    let name = |e: &Effect| format!("{} of {} bytes at {:#x}+{}", e.what, e.len, e.at.0, e.at.1);
    match at {
        Some(i) if first[i].what == now[i].what && first[i].at == now[i].at => Some(format!(
            "host write {i} ({}) holds other bytes than when the graph was captured, and a \
             replay writes the captured ones: write it before the graph, into memory the \
             graph reads",
            name(&now[i])
        )),
        Some(i) => Some(format!(
            "effect {i} was {}, now {}: a replay repeats the captured work",
            name(&first[i]),
            name(&now[i])
        )),
        None if first.len() != now.len() => Some(format!(
            "{} host writes and allocations when captured, {} now",
            first.len(),
            now.len()
        )),
        None => None,
    }
}

impl<B: Backend> Memory for GraphCheck<B> {
    fn graph(&self, key: u64, body: &mut dyn FnMut()) -> GraphRun {
        {
            let mut s = self.lock();
            if let Some((outer, _)) = &s.open {
                panic!("graph {key} inside graph {outer}'s body");
            }
            s.open = Some((key, vec![]));
        }
        // Closed however the body ends (a panic in it is a test's expected failure).
        struct Close<'a, B: Backend>(&'a GraphCheck<B>);
        impl<B: Backend> Drop for Close<'_, B> {
            fn drop(&mut self) {
                self.0.lock().open = None;
            }
        }
        let close = Close(self);
        let mut ran = false;
        let run = self.inner.graph(key, &mut || {
            ran = true;
            body()
        });
        let now = self.lock().open.take().expect("the open graph").1;
        drop(close);
        let mut s = self.lock();
        if !ran {
            // A real graph replayed: nothing ran here to hold.
            s.runs.replayed += 1;
            return run;
        }
        match s.first.get(&key) {
            None => {
                s.runs.captured += 1;
                s.runs.captured_effects += now.len();
                s.first.insert(key, now);
                GraphRun::Captured
            }
            Some(first) => {
                if let Some(d) = first_difference(first, &now) {
                    drop(s);
                    panic!("graph {key}: {d}");
                }
                s.runs.replayed += 1;
                GraphRun::Replayed
            }
        }
    }
    fn forget_graph(&self, key: u64) {
        self.lock().first.remove(&key);
        self.inner.forget_graph(key)
    }
    fn write(&self, dst: ViewMut, data: &[f32]) {
        self.effect(|| write("write", &dst, bytes_of(data)));
        self.inner.write(dst, data)
    }
    fn write_f64(&self, dst: ViewMut, data: &[f64]) {
        self.effect(|| write("write_f64", &dst, bytes_of(data)));
        self.inner.write_f64(dst, data)
    }
    fn write_u32(&self, dst: ViewMut, data: &[u32]) {
        self.effect(|| write("write_u32", &dst, bytes_of(data)));
        self.inner.write_u32(dst, data)
    }
    fn upload(&self, data: &[f32], shape: &[usize], category: Category) -> Tensor {
        self.effect(|| new_tensor("upload", data.len() * 4, bytes_of(data)));
        self.inner.upload(data, shape, category)
    }
    fn upload_f64(&self, data: &[f64], shape: &[usize], category: Category) -> Tensor {
        self.effect(|| new_tensor("upload_f64", data.len() * 8, bytes_of(data)));
        self.inner.upload_f64(data, shape, category)
    }
    fn upload_u32(&self, data: &[u32], shape: &[usize], category: Category) -> Tensor {
        self.effect(|| new_tensor("upload_u32", data.len() * 4, bytes_of(data)));
        self.inner.upload_u32(data, shape, category)
    }
    fn zeros(&self, shape: &[usize], category: Category) -> Tensor {
        let t = self.inner.zeros(shape, category);
        self.effect(|| new_tensor("zeros", t.len() * t.dtype().size(), vec![]));
        t
    }
    fn zeros_of(&self, shape: &[usize], dtype: DType, category: Category) -> Tensor {
        let t = self.inner.zeros_of(shape, dtype, category);
        self.effect(|| new_tensor("zeros_of", t.len() * dtype.size(), vec![]));
        t
    }
    fn try_zeros(&self, shape: &[usize], category: Category) -> Result<Tensor, MemoryError> {
        let t = self.inner.try_zeros(shape, category)?;
        self.effect(|| new_tensor("try_zeros", t.len() * t.dtype().size(), vec![]));
        Ok(t)
    }
    fn download(&self, src: View) -> Vec<f32> {
        self.refuse("a read (download)");
        self.inner.download(src)
    }
    fn download_f64(&self, src: View) -> Vec<f64> {
        self.refuse("a read (download_f64)");
        self.inner.download_f64(src)
    }
    fn download_u32(&self, src: View) -> Vec<u32> {
        self.refuse("a read (download_u32)");
        self.inner.download_u32(src)
    }
    fn synchronize(&self) {
        self.refuse("a host wait (synchronize)");
        self.inner.synchronize()
    }
    fn synchronize_event(&self, event: &Event) {
        self.refuse("a host wait (synchronize_event)");
        self.inner.synchronize_event(event)
    }
    fn query_event(&self, event: &Event) -> bool {
        self.refuse("an event query");
        self.inner.query_event(event)
    }
    fn elapsed(&self, start: &Event, end: &Event) -> std::time::Duration {
        self.refuse("an event timing");
        self.inner.elapsed(start, end)
    }
    fn pinned_zeros(&self, shape: &[usize], category: Category) -> Tensor {
        self.refuse("a pinned allocation");
        self.inner.pinned_zeros(shape, category)
    }
    fn pinned_zeros_of(&self, shape: &[usize], dtype: DType, category: Category) -> Tensor {
        self.refuse("a pinned allocation");
        self.inner.pinned_zeros_of(shape, dtype, category)
    }
    forward_memory!(inner:
        device, ledger, copy, fill, copy_async, record_event, wait_event, trace_copies,
        take_copy_spans, start_phases, phase, take_phase_times,
    );
}

impl<B: Backend> Blas for GraphCheck<B> {
    fn sumsq(&self, x: View) -> f64 {
        self.refuse("a read (sumsq)");
        self.inner.sumsq(x)
    }
    forward_blas!(inner:
        gemm, syrk, native_bf16, gemm_strided, syrk_strided, syrk_strided_into_bf16,
        batches_matrices, axpy, scale, add, sumsq_acc, sumsq_acc_many, cast,
    );
}

impl<B: Backend> NnOps for GraphCheck<B> {
    fn gemm_grouped(
        &self,
        c: ViewMut,
        a: View,
        b: View,
        groups: &[(crate::Gemm, usize, usize, usize)],
    ) {
        self.inner.gemm_grouped(c, a, b, groups)
    }
    fn gemm_experts(
        &self,
        c: ViewMut,
        a: View,
        b: View,
        rows: crate::ExpertRows,
        g: &crate::ExpertGemm,
    ) {
        self.inner.gemm_experts(c, a, b, rows, g)
    }
    fn experts_on_device(&self, bf16_inputs: bool) -> bool {
        self.inner.experts_on_device(bf16_inputs)
    }
    forward_nn_kernels!(inner);
}

impl<B: Backend> OptimOps for GraphCheck<B> {
    forward_all_optim_ops!(inner);
}

#[cfg(test)]
mod tests {
    use super::{GraphCheck, GraphRuns};
    use crate::{Category, CpuBackend, DType, GraphRun, Memory};
    use std::panic::{catch_unwind, AssertUnwindSafe};

    fn backend() -> GraphCheck<CpuBackend> {
        GraphCheck::new(CpuBackend::default())
    }

    /// The same writes each run pass (a first run, then replays); the CPU ran each body, so
    /// the memory holds the last run's work.
    #[test]
    fn a_body_that_repeats_itself_replays() {
        let be = backend();
        let mut t = be.zeros_of(&[3], DType::F64, Category::Buffers);
        let mut x = be.zeros(&[2], Category::Buffers);
        for (i, want) in [GraphRun::Captured, GraphRun::Replayed, GraphRun::Replayed]
            .into_iter()
            .enumerate()
        {
            // Outside the graph: a write that changes, as a step's learning rate.
            be.write_f64(t.view_mut(), &[i as f64, 0.5, 0.25]);
            let run = be.graph(7, &mut || {
                be.write(x.view_mut(), &[1.0, 2.0]);
                be.fill(x.view_mut(), 3.0);
            });
            assert_eq!(run, want);
        }
        assert_eq!(be.download_f64(t.view()), [2.0, 0.5, 0.25]);
        assert_eq!(be.download(x.view()), [3.0, 3.0]);
        let runs = be.runs();
        assert_eq!(
            runs,
            GraphRuns {
                captured: 1,
                replayed: 2,
                captured_effects: 1
            }
        );
    }

    /// What a replay would get wrong fails: a write whose bytes change between runs (the
    /// learning rate written inside the graph), a write to another place, a read, a wait,
    /// and a graph inside a graph.
    #[test]
    fn a_body_a_graph_would_replay_wrongly_panics() {
        let be = backend();
        let mut t = be.zeros_of(&[3], DType::F64, Category::Buffers);
        let mut u = be.zeros_of(&[3], DType::F64, Category::Buffers);
        let fails = |f: &mut dyn FnMut()| {
            let e = catch_unwind(AssertUnwindSafe(f)).expect_err("must panic");
            e.downcast_ref::<String>().cloned().unwrap_or_default()
        };
        be.graph(1, &mut || be.write_f64(t.view_mut(), &[1.0, 0.0, 0.0]));
        let msg = fails(&mut || {
            be.graph(1, &mut || be.write_f64(t.view_mut(), &[2.0, 0.0, 0.0]));
        });
        assert!(msg.contains("graph 1: host write 0"), "{msg}");
        assert!(msg.contains("other bytes"), "{msg}");
        let msg = fails(&mut || {
            be.graph(1, &mut || be.write_f64(u.view_mut(), &[1.0, 0.0, 0.0]));
        });
        assert!(msg.contains("effect 0 was write_f64"), "{msg}");
        let msg = fails(&mut || {
            be.graph(2, &mut || {
                be.download_f64(t.view());
            });
        });
        assert!(msg.contains("graph 2: a read (download_f64)"), "{msg}");
        let msg = fails(&mut || {
            be.graph(3, &mut || be.synchronize());
        });
        assert!(msg.contains("host wait"), "{msg}");
        let msg = fails(&mut || {
            be.graph(4, &mut || {
                be.graph(5, &mut || {});
            });
        });
        assert!(msg.contains("graph 5 inside graph 4"), "{msg}");
        // The same body as first captured still replays after all that.
        assert_eq!(
            be.graph(1, &mut || be.write_f64(t.view_mut(), &[1.0, 0.0, 0.0])),
            GraphRun::Replayed
        );
    }
}
