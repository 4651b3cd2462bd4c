//! The phase clock's cost per mark on the CPU backend: `Memory::phase` alternating between two
//! phases (every call a real mark: a lock, `Instant::now`, an event from the pool), a step's
//! worth at a time, with `take_phase_times` closing each step. Prints nanoseconds per mark (the
//! median of 15 rounds), beside a mark of the phase already running (no event) and a mark with
//! the clock stopped. `cargo run --release -p ganymede-core --example phase_mark_cost`
use ganymede_core::{CpuBackend, Memory, StepPhase};
use std::time::Instant;

fn main() {
    let be = CpuBackend::default();
    // 225 marks: a `medium`-shaped step's.
    const MARKS: usize = 225;
    const STEPS: usize = 200;
    let per_mark = |f: &dyn Fn(usize)| -> f64 {
        let mut rounds: Vec<f64> = (0..15)
            .map(|_| {
                let t = Instant::now();
                for _ in 0..STEPS {
                    be.start_phases();
                    for i in 0..MARKS {
                        f(i);
                    }
                    be.take_phase_times();
                }
                t.elapsed().as_secs_f64() * 1e9 / (STEPS * MARKS) as f64
            })
            .collect();
        rounds.sort_by(f64::total_cmp);
        rounds[rounds.len() / 2]
    };
    let change = per_mark(&|i| {
        be.phase(if i % 2 == 0 {
            StepPhase::Dense
        } else {
            StepPhase::Elementwise
        });
    });
    let same = per_mark(&|_| {
        be.phase(StepPhase::Dense);
    });
    let stopped = {
        let t = Instant::now();
        for i in 0..STEPS * MARKS {
            be.phase(if i % 2 == 0 {
                StepPhase::Dense
            } else {
                StepPhase::Elementwise
            });
        }
        t.elapsed().as_secs_f64() * 1e9 / (STEPS * MARKS) as f64
    };
    println!(
        "ns per mark (CPU backend, median of 15 rounds of {STEPS} steps of {MARKS} marks): \
         phase change {change:.1}, same phase {same:.1}, clock stopped {stopped:.1}"
    );
    println!(
        "a step of {MARKS} marks: {:.1} us of marks",
        change * MARKS as f64 / 1e3
    );
}
