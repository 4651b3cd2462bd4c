//! Streams, events and memory errors: the ordering vocabulary of [`crate::Memory`].
//!
//! A stream is a queue of work that runs in order; work on different streams may overlap. An
//! [`Event`] is recorded on a stream after some work and completes when that work has; another
//! stream (or the host) waits on it to order its later work after that work. This is CUDA's
//! model, and code above the seam is written to it even on the CPU backend, where most of it
//! completes at once: an asynchronous copy's destination may be used only after an event
//! recorded after the copy has been waited on by the stream (or host) that uses it.

use crate::ledger::{Category, Device};
use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The streams a backend offers. Kernels run on `Compute`; offload traffic has its own stream
/// per direction so a prefetch never queues behind an offload; collectives use `Comm`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stream {
    Compute,
    /// Device to host (activation and optimizer-state offload).
    ToHost,
    /// Host to device (prefetch).
    FromHost,
    /// Collectives and their copies.
    Comm,
}

impl Stream {
    pub const ALL: [Stream; 4] = [
        Stream::Compute,
        Stream::ToHost,
        Stream::FromHost,
        Stream::Comm,
    ];
    /// Position in [`Stream::ALL`], for backends that keep per-stream arrays.
    pub fn index(self) -> usize {
        self as usize
    }
    pub fn name(self) -> &'static str {
        match self {
            Stream::Compute => "compute",
            Stream::ToHost => "to-host",
            Stream::FromHost => "from-host",
            Stream::Comm => "comm",
        }
    }
}

impl std::fmt::Display for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} stream", self.name())
    }
}

/// A recorded event: an opaque handle whose contents belong to the backend that recorded it
/// (a `cudaEvent_t` for CUDA). Cloning shares the same event.
#[derive(Clone)]
pub struct Event(Arc<dyn Any + Send + Sync>);

/// The event of a backend whose work completes when it is issued: the time it was recorded.
pub struct CompletedEvent(pub Instant);

impl Event {
    pub fn new<E: Any + Send + Sync>(inner: E) -> Self {
        Event(Arc::new(inner))
    }
    /// An event that is complete now (what a synchronous backend records).
    pub fn completed_now() -> Self {
        Event::new(CompletedEvent(Instant::now()))
    }
    /// The backend's own event type.
    pub fn downcast<E: Any>(&self) -> Option<&E> {
        self.0.downcast_ref()
    }
    /// Time between two events of a synchronous backend (`None` for other backends' events).
    pub fn completed_elapsed(start: &Event, end: &Event) -> Option<Duration> {
        let (a, b) = (
            start.downcast::<CompletedEvent>()?,
            end.downcast::<CompletedEvent>()?,
        );
        Some(b.0.saturating_duration_since(a.0))
    }
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Event")
    }
}

/// One asynchronous copy as it ran, for the trace: which stream, when, how many bytes.
#[derive(Clone, Copy, Debug)]
pub struct CopySpan {
    pub stream: Stream,
    pub start: Instant,
    pub end: Instant,
    pub bytes: u64,
}

/// Why an allocation failed. Callers branch on it (e.g. offload more and retry), so it is typed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemoryError {
    OutOfMemory {
        device: Device,
        category: Category,
        /// Bytes the failed allocation asked for.
        requested: u64,
        /// Bytes in use on the device at the time.
        in_use: u64,
        capacity: u64,
    },
}

impl std::fmt::Display for MemoryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MemoryError::OutOfMemory {
                device,
                category,
                requested,
                in_use,
                capacity,
            } => write!(
                f,
                "out of memory on {device}: {} asked for {requested} bytes with {in_use} of \
                 {capacity} bytes in use ({} free)",
                category.name(),
                capacity.saturating_sub(*in_use)
            ),
        }
    }
}

impl std::error::Error for MemoryError {}
