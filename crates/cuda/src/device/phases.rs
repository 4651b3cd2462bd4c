//! The phase clock on the GPU (`ganymede_core::phase`): at each mark an event from the clock's
//! pool is recorded on the compute stream (`cuEventRecord`, no allocation once the pool holds a
//! step's marks), and at the step's end the events the stream has passed are read
//! (`cuEventQuery`, `cuEventElapsedTime`) without waiting for the others, which a later step's
//! end reads. The step's own read of its loss has waited for everything before the update, so
//! in steady state each step reports its forward and backward and the previous step's update.

use super::{ok, CudaBackend};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};
use ganymede_core::phase::{PhaseClock, PhaseEvents};
use ganymede_core::{PhaseTimes, StepPhase, Stream};
use std::sync::MutexGuard;

/// Timing events on one stream.
struct StreamEvents<'a>(&'a std::sync::Arc<CudaStream>);

impl PhaseEvents for StreamEvents<'_> {
    type Event = CudaEvent;
    fn create(&self) -> CudaEvent {
        let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
        ok(self.0.context().new_event(flags), "phase event")
    }
    fn record(&self, e: &mut CudaEvent) {
        ok(e.record(self.0), "phase event record")
    }
    fn done(&self, e: &CudaEvent) -> bool {
        ok(e.try_is_complete(), "phase event query")
    }
    fn ms(&self, a: &CudaEvent, b: &CudaEvent) -> f64 {
        f64::from(ok(a.elapsed_ms(b), "phase event elapsed"))
    }
}

impl CudaBackend {
    fn phase_clock(&self) -> MutexGuard<'_, PhaseClock<CudaEvent>> {
        self.phases.lock().unwrap_or_else(|e| e.into_inner())
    }
    pub(super) fn start_phases(&self) {
        self.phase_clock()
            .start(&StreamEvents(self.stream(Stream::Compute)))
    }
    pub(super) fn phase(&self, p: StepPhase) -> Option<StepPhase> {
        if self.streams.capturing() {
            // A graph's capture: its time is the phase's that launches it.
            return None;
        }
        self.phase_clock()
            .mark(&StreamEvents(self.stream(Stream::Compute)), p)
    }
    pub(super) fn take_phase_times(&self) -> Option<PhaseTimes> {
        self.phase_clock()
            .take(&StreamEvents(self.stream(Stream::Compute)))
    }
    /// Timing events the phase clock has made (they are reused: a steady step makes none).
    pub fn phase_events_made(&self) -> usize {
        self.phase_clock().created()
    }
}
