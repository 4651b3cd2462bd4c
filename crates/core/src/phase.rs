//! Where a step's time goes, by phase: attention, the dense GEMMs, the router, the experts,
//! element-wise work, the LM head, the optimizer, communication.
//!
//! Code above the seam marks where a phase begins ([`crate::Memory::phase`]); the backend's
//! clock charges the time from one mark to the next to the earlier mark's phase, and
//! [`crate::Memory::take_phase_times`] ends the step's clock and returns the totals. Marks are
//! coarse (a stage of a block, not an op) and a mark of the phase already running costs no
//! event, so a step makes a few hundred at most.
//!
//! - The CPU backend's kernels run on the calling thread, so its clock is the wall clock
//!   ([`HostClock`]): a mark reads `Instant::now()`.
//! - A GPU's clock is events recorded on its compute stream at each mark, read once the stream
//!   has passed them: the time between two is the stream's, idle time included (a stream
//!   waiting on the host, on another stream or on a collective is charged to the phase that
//!   waits). Events come from a pool ([`PhaseClock`] reuses each once it is read), and the clock
//!   never waits for one: intervals whose end the stream has not reached when the step ends (its
//!   optimizer update, issued after the step's last read) are read at a later step's end and
//!   counted there.
//!
//! [`PhaseClock`] is that bookkeeping over any event type ([`PhaseEvents`]), so the pool and
//! the carrying over are tested on the host.

use std::collections::VecDeque;
use std::time::Instant;

/// What a step's work is, for timing by phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StepPhase {
    /// The embedding, the final norm, the LM head's GEMMs and the cross-entropy, forward and
    /// backward (with the step's token upload and its loss read).
    Head,
    /// The attention kernels (forward and backward) only.
    Attention,
    /// The dense GEMMs of a block: the q, k, v and o projections, a dense layer's SwiGLU and
    /// the shared experts'.
    Dense,
    /// The router: its GEMMs, top-k and softmax, the dispatch (with its read of the per-expert
    /// counts) and their backwards.
    Router,
    /// The routed experts: gather, grouped GEMMs, SwiGLU, combine, and their backwards.
    Experts,
    /// Norms, the q/k norm with RoPE, casts, residual adds and copies, zeroing gradients.
    Elementwise,
    /// The gradient norm, clipping, the optimizer update and the router-bias update.
    Optimizer,
    /// Collectives and waits on them (FSDP gathers and reduce-scatters, expert all-to-all, the
    /// step's sums).
    Communication,
}

impl StepPhase {
    pub const ALL: [StepPhase; 8] = [
        StepPhase::Head,
        StepPhase::Attention,
        StepPhase::Dense,
        StepPhase::Router,
        StepPhase::Experts,
        StepPhase::Elementwise,
        StepPhase::Optimizer,
        StepPhase::Communication,
    ];
    pub const COUNT: usize = Self::ALL.len();

    /// Position in [`StepPhase::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The name metrics use (`phase_ms.<name>`).
    pub fn name(self) -> &'static str {
        match self {
            StepPhase::Head => "head",
            StepPhase::Attention => "attention",
            StepPhase::Dense => "dense",
            StepPhase::Router => "router",
            StepPhase::Experts => "experts",
            StepPhase::Elementwise => "elementwise",
            StepPhase::Optimizer => "optimizer",
            StepPhase::Communication => "communication",
        }
    }
}

/// Milliseconds per phase of a step, and the marks it took.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PhaseTimes {
    /// Indexed by [`StepPhase::index`].
    pub ms: [f64; StepPhase::COUNT],
    /// Marks that changed the phase in the step (each an event on a GPU).
    pub marks: u32,
}

impl PhaseTimes {
    pub fn get(&self, p: StepPhase) -> f64 {
        self.ms[p.index()]
    }
    pub fn add(&mut self, p: StepPhase, ms: f64) {
        self.ms[p.index()] += ms;
    }
    /// All phases together.
    pub fn total_ms(&self) -> f64 {
        self.ms.iter().sum()
    }
    /// (name, ms) of each phase, in [`StepPhase::ALL`]'s order.
    pub fn named(&self) -> impl Iterator<Item = (&'static str, f64)> + '_ {
        StepPhase::ALL.iter().map(|&p| (p.name(), self.get(p)))
    }
}

/// Events a [`PhaseClock`] times with: made once, recorded again and again.
pub trait PhaseEvents {
    type Event;
    /// A new event (a driver call on a GPU: the clock pools them).
    fn create(&self) -> Self::Event;
    /// Record `e` now: on a GPU, after the work issued to the compute stream so far.
    fn record(&self, e: &mut Self::Event);
    /// Whether the stream has passed `e` (without waiting).
    fn done(&self, e: &Self::Event) -> bool;
    /// Milliseconds from `a` to `b`, both done.
    fn ms(&self, a: &Self::Event, b: &Self::Event) -> f64;
}

/// The host's clock: an event is the instant it was recorded, done at once.
pub struct HostClock;

impl PhaseEvents for HostClock {
    type Event = Instant;
    fn create(&self) -> Instant {
        Instant::now()
    }
    fn record(&self, e: &mut Instant) {
        *e = Instant::now();
    }
    fn done(&self, _e: &Instant) -> bool {
        true
    }
    fn ms(&self, a: &Instant, b: &Instant) -> f64 {
        b.saturating_duration_since(*a).as_secs_f64() * 1e3
    }
}

/// A backend's phase clock over events `E` (see the module doc): running between
/// [`PhaseClock::start`] and [`PhaseClock::take`], ignoring marks otherwise (validation,
/// generation).
pub struct PhaseClock<E> {
    running: bool,
    current: Option<StepPhase>,
    /// Recorded marks not yet read, oldest first: each with the phase it starts, or `None` for
    /// the end of a step's chain of marks.
    pending: VecDeque<(Option<StepPhase>, E)>,
    /// Read events, for reuse.
    pool: Vec<E>,
    totals: PhaseTimes,
    created: usize,
}

impl<E> Default for PhaseClock<E> {
    fn default() -> Self {
        PhaseClock {
            running: false,
            current: None,
            pending: VecDeque::new(),
            pool: Vec::new(),
            totals: PhaseTimes::default(),
            created: 0,
        }
    }
}

impl<E> PhaseClock<E> {
    /// Start a step's clock; its first mark starts its first interval.
    pub fn start(&mut self, src: &impl PhaseEvents<Event = E>) {
        self.end_chain(src);
        self.running = true;
    }

    /// Work from now on is `p`'s. Returns the phase it replaces (`None` when the clock is not
    /// running or no phase was marked yet), so that a nested phase can restore it.
    pub fn mark(&mut self, src: &impl PhaseEvents<Event = E>, p: StepPhase) -> Option<StepPhase> {
        if !self.running {
            return None;
        }
        let prev = self.current;
        if prev != Some(p) {
            self.push(src, Some(p));
            self.current = Some(p);
            self.totals.marks += 1;
        }
        prev
    }

    /// End the step's clock and return the time per phase read so far (intervals of this step
    /// and any carried over from earlier ones); `None` when the clock was not running. Waits
    /// for nothing: intervals not yet done stay for a later `take`.
    pub fn take(&mut self, src: &impl PhaseEvents<Event = E>) -> Option<PhaseTimes> {
        if !self.running {
            return None;
        }
        self.end_chain(src);
        self.running = false;
        self.read(src);
        Some(std::mem::take(&mut self.totals))
    }

    /// Events ever made (the pool's size plus those pending).
    pub fn created(&self) -> usize {
        self.created
    }

    /// Marks recorded and not yet read.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    fn end_chain(&mut self, src: &impl PhaseEvents<Event = E>) {
        if self.running && self.current.is_some() {
            self.push(src, None);
        }
        self.current = None;
    }

    fn push(&mut self, src: &impl PhaseEvents<Event = E>, phase: Option<StepPhase>) {
        let mut e = match self.pool.pop() {
            Some(e) => e,
            None => {
                self.created += 1;
                src.create()
            }
        };
        src.record(&mut e);
        self.pending.push_back((phase, e));
    }

    /// Charge every interval whose end is done to its phase, oldest first, and pool the
    /// events no interval needs any more. Events complete in order (one stream), so the first
    /// one not done ends the reading.
    fn read(&mut self, src: &impl PhaseEvents<Event = E>) {
        while let Some((phase, first)) = self.pending.front() {
            match phase {
                // The end of a chain: no interval starts there.
                None if src.done(first) => {}
                None => break,
                Some(p) => {
                    let Some((_, next)) = self.pending.get(1) else {
                        break;
                    };
                    if !src.done(next) {
                        break;
                    }
                    let ms = src.ms(first, next);
                    self.totals.add(*p, ms.max(0.0));
                }
            }
            let (_, e) = self.pending.pop_front().expect("front");
            self.pool.push(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// Events on a fake stream: an event is (id, time it is recorded at); the stream has
    /// reached times up to `now`.
    #[derive(Default)]
    struct Fake {
        clock: Cell<f64>,
        reached: Cell<f64>,
        made: Cell<u32>,
    }

    impl PhaseEvents for Fake {
        type Event = (u32, f64);
        fn create(&self) -> (u32, f64) {
            self.made.set(self.made.get() + 1);
            (self.made.get(), f64::NAN)
        }
        fn record(&self, e: &mut (u32, f64)) {
            e.1 = self.clock.get();
        }
        fn done(&self, e: &(u32, f64)) -> bool {
            e.1 <= self.reached.get()
        }
        fn ms(&self, a: &(u32, f64), b: &(u32, f64)) -> f64 {
            b.1 - a.1
        }
    }

    impl Fake {
        fn at(&self, t: f64) {
            self.clock.set(t);
        }
    }

    #[test]
    fn intervals_go_to_the_earlier_marks_phase_and_repeats_cost_nothing() {
        let f = Fake::default();
        f.reached.set(f64::INFINITY);
        let mut c = PhaseClock::default();
        // Not running: marks are ignored.
        assert_eq!(c.mark(&f, StepPhase::Head), None);
        assert_eq!(c.take(&f), None);
        c.start(&f);
        f.at(1.0);
        assert_eq!(c.mark(&f, StepPhase::Head), None);
        f.at(3.0);
        assert_eq!(c.mark(&f, StepPhase::Attention), Some(StepPhase::Head));
        f.at(4.0);
        // The same phase again: no event.
        assert_eq!(c.mark(&f, StepPhase::Attention), Some(StepPhase::Attention));
        f.at(7.0);
        let prev = c.mark(&f, StepPhase::Communication);
        f.at(7.5);
        c.mark(&f, prev.unwrap());
        f.at(10.0);
        let t = c.take(&f).unwrap();
        assert_eq!(t.get(StepPhase::Head), 2.0);
        assert_eq!(t.get(StepPhase::Attention), 4.0 + 2.5);
        assert_eq!(t.get(StepPhase::Communication), 0.5);
        assert_eq!(t.total_ms(), 9.0);
        assert_eq!(t.marks, 4);
        assert_eq!(f.made.get(), 5, "4 marks and the end");
        assert_eq!(c.pending(), 0);
    }

    #[test]
    fn events_are_reused_from_the_second_step_on() {
        let f = Fake::default();
        f.reached.set(f64::INFINITY);
        let mut c = PhaseClock::default();
        let mut t = 0.0;
        for _ in 0..5 {
            c.start(&f);
            for p in [StepPhase::Head, StepPhase::Dense, StepPhase::Optimizer] {
                t += 1.0;
                f.at(t);
                c.mark(&f, p);
            }
            t += 1.0;
            f.at(t);
            let times = c.take(&f).unwrap();
            assert_eq!(times.total_ms(), 3.0);
        }
        assert_eq!(c.created(), 4, "three marks and an end, made once");
        assert_eq!(f.made.get(), 4);
    }

    #[test]
    fn intervals_the_stream_has_not_reached_are_counted_at_a_later_step() {
        let f = Fake::default();
        let mut c = PhaseClock::default();
        c.start(&f);
        f.at(0.0);
        c.mark(&f, StepPhase::Dense);
        f.at(2.0);
        c.mark(&f, StepPhase::Optimizer);
        f.at(5.0);
        // The stream is at 2: the optimizer's interval (2 to 5) is not done.
        f.reached.set(2.0);
        let first = c.take(&f).unwrap();
        assert_eq!(first.get(StepPhase::Dense), 2.0);
        assert_eq!(first.get(StepPhase::Optimizer), 0.0);
        assert_eq!(c.pending(), 2, "the optimizer's mark and the end wait");
        // Next step: the gap between the steps (5 to 6) is no phase's.
        c.start(&f);
        f.at(6.0);
        c.mark(&f, StepPhase::Head);
        f.at(6.5);
        f.reached.set(f64::INFINITY);
        let second = c.take(&f).unwrap();
        assert_eq!(second.get(StepPhase::Optimizer), 3.0);
        assert_eq!(second.get(StepPhase::Head), 0.5);
        assert_eq!(second.total_ms(), 3.5);
        assert_eq!(second.marks, 1);
        assert_eq!(c.pending(), 0);
        // While intervals wait, their events are not reused: the second step's end is new.
        assert_eq!(c.created(), 4);
    }

    #[test]
    fn the_host_clock_measures_wall_time() {
        let mut c = PhaseClock::default();
        c.start(&HostClock);
        c.mark(&HostClock, StepPhase::Elementwise);
        std::thread::sleep(std::time::Duration::from_millis(20));
        let t = c.take(&HostClock).unwrap();
        let ms = t.get(StepPhase::Elementwise);
        assert!((20.0..2000.0).contains(&ms), "{ms}");
        assert_eq!(t.total_ms(), ms);
    }
}
