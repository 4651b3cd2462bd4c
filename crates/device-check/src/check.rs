//! The prepared device check (`ganymede device-check --out DIR`): what the CUDA backend has so
//! far, exercised on a real GPU in well under a minute, written to `DIR/report.md`.
//!
//! GPU time is scarce and comes in short visits, so every section runs even when an earlier one
//! fails (a failure, panics included, is written down and the next section starts), and the
//! report says what passed, what failed and what was measured.

use ganymede_core::sample::values;
use ganymede_core::{
    bf16, Blas, Category, CpuBackend, DType, Gemm, Ledger, Memory, Stream, Syrk, Tensor,
};
use ganymede_cuda::device::{probe, CudaBackend, DeviceError};
use std::fmt::Write as _;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// What the check found: the report's path and how many sections failed.
pub struct Summary {
    pub report: PathBuf,
    pub passed: usize,
    pub failed: usize,
}

/// A section's body: markdown on success, the reason on failure.
type Section = fn(&CudaBackend) -> Result<String, String>;

/// In order of what a fault would cost: a kernel that faults leaves a sticky error and the
/// context unusable, so the driver-and-cuBLAS sections (memory, copies, GEMMs, bandwidth,
/// Newton–Schulz) come first, then the model's kernels at full size (the tiny model's gradients
/// on the tensor-core attention, the attention timings), and NCCL, which one GPU does not
/// need, last.
const SECTIONS: &[(&str, Section)] = &[
    ("Every kernel of the sources found by name", kernels_by_name),
    ("Allocation, upload, download, fill, copy", memory_roundtrip),
    ("Pinned memory and asynchronous copies", pinned_async),
    (
        "Small writes are staged: no host wait, stream order kept",
        staged_writes,
    ),
    ("NVRTC kernel launch (f32 <-> bf16 casts)", cast_kernels),
    ("GEMM against the CPU backend", gemm_parity),
    ("Host <-> device bandwidth (pinned)", bandwidth),
    ("Copies overlap compute", overlap),
    ("GEMM throughput", gemm_throughput),
    (
        "Newton–Schulz time per matrix size (f32 and bf16 products)",
        newton_schulz_times,
    ),
    (
        "Newton–Schulz on an expert stack: one matrix at a time against one strided batch",
        newton_schulz_stack,
    ),
    (
        "Newton–Schulz's symmetric products into bf16: one kernel against mirror then cast",
        syrk_into_bf16,
    ),
    (
        "Expert GEMMs: one strided batch against a loop",
        expert_gemms,
    ),
    (
        "Expert GEMMs, uneven tokens: one grouped call against a loop",
        grouped_expert_gemms,
    ),
    (
        "Memory-bound kernels: 4-wide accesses against scalar ones",
        memory_bound_kernels,
    ),
    (
        "Launch cost, and Muon's normalisation into bf16 in one pass",
        launches_and_bf16_normalisation,
    ),
    (
        "The tiny model's gradients against the CPU backend, tensor by tensor",
        crate::model::tiny_gradients,
    ),
    (
        "Attention at medium's shape: SIMT against tensor-core kernels",
        attention_kernels,
    ),
    // After the timings: the experts' device-offset GEMMs run here first on a GPU.
    (
        "A training step reads nothing back before its update, and launches what the step before launched",
        crate::reads::gpu_step_reads,
    ),
    (
        "Training steps replayed as CUDA graphs against eager ones, bit for bit",
        crate::graphs::gpu_graph_replay,
    ),
    (
        "NCCL group at world size 1: the conformance suite",
        ganymede_dist::nccl::conformance_world1,
    ),
];

/// Probe, set up GPU 0, run every section and write `out/report.md`. An error only when the
/// device cannot be set up at all (the one-line reason); section failures are in the summary.
pub fn run(out: &Path) -> Result<Summary, DeviceError> {
    probe()?;
    std::fs::create_dir_all(out).map_err(|e| DeviceError::Driver {
        what: format!("creating {}", out.display()),
        error: e.to_string(),
    })?;
    let t0 = Instant::now();
    let ledger = Arc::new(Ledger::new());
    let be = CudaBackend::new(0, ledger)?;
    let setup = t0.elapsed();
    let (free, total) = be.context().mem_get_info().unwrap_or((0, 0));
    let mut md = String::new();
    let _ = writeln!(md, "# ganymede device check\n");
    let _ = writeln!(
        md,
        "- device: {} ({}), {:.1} GiB ({:.1} GiB free)",
        be.name(),
        be.arch(),
        total as f64 / (1u64 << 30) as f64,
        free as f64 / (1u64 << 30) as f64
    );
    let files: Vec<&str> = ganymede_cuda::sources::SOURCES
        .iter()
        .map(|(f, _)| *f)
        .collect();
    let _ = writeln!(
        md,
        "- NVRTC: {} kernel file(s) of `sources::SOURCES` ({}) and the backend's own, compiled \
         and loaded in {:.2} s (context and cuBLAS included)\n",
        files.len(),
        if files.is_empty() {
            "none yet".to_string()
        } else {
            files.join(", ")
        },
        setup.as_secs_f64()
    );
    let (mut passed, mut failed) = (0, 0);
    for (i, (title, body)) in SECTIONS.iter().enumerate() {
        // Where a hang or a crash stopped the check, should it (the script's timeout then
        // leaves this file as it is).
        let _ = std::fs::write(
            out.join("report.md"),
            format!("{md}## RUNNING: {title} (the check ended inside this section)\n"),
        );
        let t = Instant::now();
        let r = catch_unwind(AssertUnwindSafe(|| body(&be)))
            .unwrap_or_else(|p| Err(format!("panicked: {}", panic_text(&p))));
        let secs = t.elapsed().as_secs_f64();
        match r {
            Ok(text) => {
                passed += 1;
                let _ = writeln!(md, "## PASS: {title} ({secs:.2} s)\n\n{text}");
            }
            Err(why) => {
                failed += 1;
                let _ = writeln!(md, "## FAIL: {title} ({secs:.2} s)\n\n{why}\n");
            }
        }
        // A failed section may leave work queued; the next one starts clean. A sticky error (a
        // kernel's illegal address, say) leaves the context unusable: every later section
        // would fail on its first call, so they are listed as not run instead.
        if let Err(e) = be.context().synchronize() {
            let rest: Vec<&str> = SECTIONS[i + 1..].iter().map(|(t, _)| *t).collect();
            failed += 1;
            let _ = writeln!(
                md,
                "## FAIL: the CUDA context is unusable after \"{title}\" ({}); not run: {}\n",
                ganymede_cuda::device::probe::driver_error(&e),
                if rest.is_empty() {
                    "none".to_string()
                } else {
                    rest.join("; ")
                }
            );
            break;
        }
        // What has run so far, in case a later section takes the process down or past the
        // script's time limit (the whole report replaces it at the end).
        let _ = std::fs::write(out.join("report.md"), &md);
    }
    let _ = writeln!(
        md,
        "{passed} section(s) passed, {failed} failed, {:.1} s in all.",
        t0.elapsed().as_secs_f64()
    );
    let report = out.join("report.md");
    std::fs::write(&report, md).map_err(|e| DeviceError::Driver {
        what: format!("writing {}", report.display()),
        error: e.to_string(),
    })?;
    Ok(Summary {
        report,
        passed,
        failed,
    })
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(no message)".into())
}

fn ensure(cond: bool, why: impl FnOnce() -> String) -> Result<(), String> {
    if cond {
        Ok(())
    } else {
        Err(why())
    }
}

fn memory_roundtrip(be: &CudaBackend) -> Result<String, String> {
    let n = 1 << 20;
    let dev = be.device();
    let before = be.ledger().in_use(dev);
    let z = be.zeros(&[n], Category::Buffers);
    ensure(be.ledger().in_use(dev) - before == 4 * n as u64, || {
        "the ledger did not count the allocation's bytes".into()
    })?;
    ensure(be.download(z.view()).iter().all(|&x| x == 0.0), || {
        "zeros are not zero".into()
    })?;
    let data = values(n, 1);
    let t = be.upload(&data, &[n], Category::Buffers);
    ensure(be.download(t.view()) == data, || {
        "upload/download changed the data".into()
    })?;
    let mut c = be.zeros(&[n], Category::Buffers);
    be.copy(c.slice_mut(10, n - 10), t.slice(0, n - 10));
    let back = be.download(c.view());
    ensure(
        back[..10].iter().all(|&x| x == 0.0) && back[10..] == data[..n - 10],
        || "a device-to-device copy at an offset is wrong".into(),
    )?;
    be.fill(c.slice_mut(5, 100), 0.75);
    let back = be.download(c.slice(0, 200));
    ensure(
        back[5..105].iter().all(|&x| x == 0.75) && back[105] == data[95] && back[4] == 0.0,
        || "fill wrote outside or missed its range".into(),
    )?;
    let mut h = be.zeros_of(&[n], DType::BF16, Category::Buffers);
    be.write(h.view_mut(), &data);
    let want: Vec<f32> = data
        .iter()
        .map(|&x| bf16::to_f32(bf16::from_f32(x)))
        .collect();
    ensure(be.download(h.view()) == want, || {
        "a bf16 write/download is not the host's rounding".into()
    })?;
    // The sum of squares on the device (f64 accumulator, f32 and bf16 inputs).
    let want: f64 = data.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
    let got = be.sumsq(t.view());
    ensure((got - want).abs() <= 1e-9 * want, || {
        format!("sumsq of f32: {got} against the host's {want}")
    })?;
    let want16: f64 = data
        .iter()
        .map(|&x| f64::from(bf16::to_f32(bf16::from_f32(x))).powi(2))
        .sum();
    let mut acc = be.zeros_of(&[1], DType::F64, Category::Buffers);
    be.sumsq_acc(acc.view_mut(), h.view());
    be.sumsq_acc(acc.view_mut(), t.view());
    let got = be.download_f64(acc.view())[0];
    ensure(
        (got - want - want16).abs() <= 1e-9 * (want + want16),
        || {
            format!(
                "sumsq_acc of bf16 then f32: {got} against {}",
                want + want16
            )
        },
    )?;
    drop((z, t, c, h, acc));
    ensure(be.ledger().in_use(dev) == before, || {
        "the ledger still counts freed tensors".into()
    })?;
    Ok(format!(
        "{n} f32: zeros, upload/download, offset copy, fill, bf16 write, the f64 sum of squares \
         (f32 and bf16 inputs, to 1e-9); the ledger counted and freed every byte.\n"
    ))
}

fn pinned_async(be: &CudaBackend) -> Result<String, String> {
    let n = 1 << 22;
    let data = values(n, 2);
    let src = be.upload(&data, &[n], Category::Buffers);
    let mut host = be.pinned_zeros(&[n], Category::Buffers);
    ensure(
        host.device_buffer()
            .and_then(|b| b.host_ptr(false))
            .is_some(),
        || "pinned memory has no host address".into(),
    )?;
    // Device -> pinned on the to-host stream, ordered after the upload by an event.
    let up = be.record_event(Stream::Compute);
    be.wait_event(Stream::ToHost, &up);
    be.copy_async(host.view_mut(), src.view(), Stream::ToHost);
    let done = be.record_event(Stream::ToHost);
    be.synchronize_event(&done);
    ensure(be.query_event(&done), || {
        "a waited event is not complete".into()
    })?;
    ensure(host.view().host::<f32>() == &data[..], || {
        "the CPU does not read what the to-host copy wrote".into()
    })?;
    // The CPU changes the pinned copy; pinned -> device on the from-host stream, compute waits.
    for x in host.view_mut().host::<f32>().iter_mut() {
        *x *= 2.0;
    }
    let mut dst = be.zeros(&[n], Category::Buffers);
    let ready = be.record_event(Stream::Compute);
    be.wait_event(Stream::FromHost, &ready);
    be.copy_async(dst.view_mut(), host.view(), Stream::FromHost);
    let arrived = be.record_event(Stream::FromHost);
    be.wait_event(Stream::Compute, &arrived);
    let back = be.download(dst.view());
    ensure(back.iter().zip(&data).all(|(b, d)| *b == 2.0 * d), || {
        "the from-host copy did not bring the CPU's values".into()
    })?;
    // Dropping a source while its copy may be in flight is allowed (stream-ordered free).
    let tmp = be.upload(&data, &[n], Category::Buffers);
    be.copy_async(host.view_mut(), tmp.view(), Stream::ToHost);
    drop(tmp);
    let e = be.record_event(Stream::ToHost);
    be.synchronize_event(&e);
    ensure(host.view().host::<f32>() == &data[..], || {
        "a copy whose source was dropped in flight is wrong".into()
    })?;
    // Traced copies come back as spans on the host clock, with their bytes.
    be.trace_copies(true);
    be.copy_async(host.view_mut(), src.view(), Stream::ToHost);
    let e = be.record_event(Stream::ToHost);
    be.synchronize_event(&e);
    let spans = be.take_copy_spans();
    be.trace_copies(false);
    ensure(
        spans.len() == 1 && spans[0].bytes == 4 * n as u64 && spans[0].end >= spans[0].start,
        || format!("the traced copy's span is wrong: {spans:?}"),
    )?;
    let ms = be.elapsed(&up, &done).as_secs_f64() * 1e3;
    Ok(format!(
        "{n} f32 each way through non-write-combined pinned memory on the to-host and \
         from-host streams, ordered by events; event timing {ms:.3} ms for the first leg.\n"
    ))
}

/// `write_u32`/`write_f64` of a step's small data (ids, the aux-loss constants, grouped GEMMs'
/// pointer arrays) go through the staging ring: behind a long GEMM, a ring's worth of writes
/// return before the GEMM ends, and every write lands in stream order (a buffer written twice
/// holds the second value; more writes than slots reuse slots only after their copies).
fn staged_writes(be: &CudaBackend) -> Result<String, String> {
    use ganymede_core::staging::STAGING_SLOTS as SLOTS;
    let size = 8192;
    let a = be.zeros(&[size * size], Category::Buffers);
    let b = be.zeros(&[size * size], Category::Buffers);
    let mut c = be.zeros(&[size * size], Category::Buffers);
    let g = Gemm::new(size, size, size, false, true);
    be.gemm(c.view_mut(), a.view(), b.view(), g); // warm-up
    be.synchronize();
    let lens: Vec<usize> = (0..3 * SLOTS).map(|i| 1 + (i * 977) % 20_000).collect();
    let mut dst: Vec<Tensor> = lens
        .iter()
        .map(|&n| be.zeros_of(&[n], DType::U32, Category::Buffers))
        .collect();
    let data = |i: usize, round: u32| -> Vec<u32> {
        (0..lens[i] as u32)
            .map(|j| j ^ (i as u32) << 20 ^ round << 28)
            .collect()
    };
    // Round 0 grows the slots (pinned allocation may wait for the device); later rounds reuse.
    for (i, d) in dst.iter_mut().enumerate() {
        be.write_u32(d.view_mut(), &data(i, 0));
    }
    be.synchronize();
    // Every slot at the largest write's slot size now (the planner's rule).
    let largest = 4 * lens.iter().max().copied().unwrap_or(0);
    let ring = (SLOTS * ganymede_core::staging::staging_slot_bytes(largest)) as u64;
    let pinned = be
        .ledger()
        .report()
        .current(ganymede_core::Device::Host, Category::Buffers);
    ensure(pinned >= ring, || {
        format!("{pinned} bytes of pinned buffers on the ledger, fewer than the ring's {ring}")
    })?;
    let start = be.record_event(Stream::Compute);
    for _ in 0..3 {
        be.gemm(c.view_mut(), a.view(), b.view(), g);
    }
    let busy = be.record_event(Stream::Compute);
    let t = Instant::now();
    for (i, d) in dst.iter_mut().enumerate().take(SLOTS) {
        be.write_u32(d.view_mut(), &data(i, 1));
    }
    let host_ms = t.elapsed().as_secs_f64() * 1e3;
    let waited = be.query_event(&busy);
    be.synchronize_event(&busy);
    let gemm_ms = be.elapsed(&start, &busy).as_secs_f64() * 1e3;
    ensure(!waited, || {
        format!(
            "{SLOTS} staged writes took {host_ms:.2} ms on the host and the GEMMs before them \
             ({gemm_ms:.2} ms) had finished: the writes waited for the GPU"
        )
    })?;
    // Round 2 over every buffer (wrapping the ring three times), then round 3 over the first
    // ones: the later write wins.
    for (i, d) in dst.iter_mut().enumerate() {
        be.write_u32(d.view_mut(), &data(i, 2));
    }
    for (i, d) in dst.iter_mut().enumerate().take(SLOTS / 2) {
        be.write_u32(d.view_mut(), &data(i, 3));
    }
    for (i, d) in dst.iter().enumerate() {
        let want = data(i, if i < SLOTS / 2 { 3 } else { 2 });
        ensure(be.download_u32(d.view()) == want, || {
            format!("staged write {i} ({} words) did not land in order", lens[i])
        })?;
    }
    // A write read by the stream's next op, queued behind a GEMM without a host wait.
    let v: Vec<u32> = (0..4096u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    let mut small = be.zeros_of(&[v.len()], DType::U32, Category::Buffers);
    let mut copy = be.zeros_of(&[v.len()], DType::U32, Category::Buffers);
    be.gemm(c.view_mut(), a.view(), b.view(), g);
    be.write_u32(small.view_mut(), &v);
    be.copy(copy.view_mut(), small.view());
    ensure(be.download_u32(copy.view()) == v, || {
        "a copy after a staged write did not read it".into()
    })?;
    Ok(format!(
        "{SLOTS} u32 writes (1 to 20,000 words) returned in {host_ms:.2} ms on the host while \
         {gemm_ms:.2} ms of GEMMs ahead of them ran; {} writes in all landed in stream order; a \
         copy queued behind a GEMM read a staged write. Pinned buffers on the ledger after the \
         first round: {pinned} bytes (the ring: {ring}).\n",
        7 * SLOTS + SLOTS / 2
    ))
}

fn cast_kernels(be: &CudaBackend) -> Result<String, String> {
    // Ties, values past bf16's range, infinities, NaNs, denormals and ordinary numbers.
    let mut data: Vec<f32> = [
        0.0f32,
        -0.0,
        1.0,
        f32::from_bits(0x3f80_8000), // a tie, rounds to even (down)
        f32::from_bits(0x3f81_8000), // a tie, rounds to even (up)
        f32::MAX,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(0x7f80_0001), // a signalling NaN that truncation would make infinite
        f32::from_bits(0xff80_0001),
        f32::from_bits(0x0000_0001), // the smallest denormal
    ]
    .to_vec();
    data.extend(values(100_000, 3));
    let n = data.len();
    let src = be.upload(&data, &[n], Category::Buffers);
    let mut h = be.zeros_of(&[n], DType::BF16, Category::Buffers);
    be.cast(h.view_mut(), src.view());
    let mut back = be.zeros(&[n], Category::Buffers);
    be.cast(back.view_mut(), h.view());
    let got = be.download(back.view());
    for (i, (&g, &x)) in got.iter().zip(&data).enumerate() {
        let want = bf16::to_f32(bf16::from_f32(x));
        ensure(g.to_bits() == want.to_bits(), || {
            format!(
                "element {i}: {x:e} ({:#010x}) became {:#010x}, the host rounds to {:#010x}",
                x.to_bits(),
                g.to_bits(),
                want.to_bits()
            )
        })?;
    }
    Ok(format!(
        "{n} values f32 -> bf16 -> f32 on the device, bit for bit the host's rounding \
         (ties to even, NaN kept, overflow to infinity).\n"
    ))
}

/// Largest |got - want| over the largest |want|.
fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let scale = want.iter().fold(0f64, |m, &w| m.max(f64::from(w).abs()));
    let diff = got.iter().zip(want).fold(0f64, |m, (&g, &w)| {
        m.max((f64::from(g) - f64::from(w)).abs())
    });
    diff / scale.max(1e-30)
}

fn gemm_parity(be: &CudaBackend) -> Result<String, String> {
    let cpu = CpuBackend::new(Arc::new(Ledger::new()));
    let mut md = String::from("| m | n | k | transposes | ld padding | dtype | rel. error |\n|---|---|---|---|---|---|---|\n");
    let shapes = [(64, 48, 32), (129, 77, 65), (256, 512, 384), (1, 300, 17)];
    let mut i = 0;
    for &(m, n, k) in &shapes {
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            i += 1;
            let pad = (i % 3) * 5;
            let g0 = Gemm::new(m, n, k, ta, tb);
            let g = g0
                .alpha(if i % 2 == 0 { 1.0 } else { 0.5 })
                .beta(if i % 4 == 0 { 1.0 } else { 0.0 })
                .ld(g0.lda + pad, g0.ldb + pad, g0.ldc + pad);
            let a_rows = if ta { k } else { m };
            let b_rows = if tb { n } else { k };
            let a = values(a_rows * g.lda, 10 + i as u64);
            let b = values(b_rows * g.ldb, 20 + i as u64);
            let c = values(m * g.ldc, 30 + i as u64);
            let on = |be: &dyn Memory, x: &[f32]| be.upload(x, &[x.len()], Category::Buffers);
            let mut want_t = on(&cpu, &c);
            cpu.gemm(
                want_t.view_mut(),
                on(&cpu, &a).view(),
                on(&cpu, &b).view(),
                g,
            );
            let want = cpu.download(want_t.view());
            // f32 through cublasSgemm.
            let (da, db) = (on(be, &a), on(be, &b));
            let mut dc = on(be, &c);
            be.gemm(dc.view_mut(), da.view(), db.view(), g);
            let e32 = rel_err(&be.download(dc.view()), &want);
            let _ = writeln!(
                md,
                "| {m} | {n} | {k} | {ta}/{tb} | {pad} | f32 | {e32:.1e} |"
            );
            ensure(e32 < 1e-4, || format!("f32 {g:?}: relative error {e32:e}"))?;
            // bf16 inputs, f32 output through cublasGemmEx, against the CPU on the same
            // bf16-rounded inputs.
            let round = |x: &[f32]| -> Vec<f32> {
                x.iter().map(|&v| bf16::to_f32(bf16::from_f32(v))).collect()
            };
            let mut want_t = on(&cpu, &c);
            cpu.gemm(
                want_t.view_mut(),
                on(&cpu, &round(&a)).view(),
                on(&cpu, &round(&b)).view(),
                g,
            );
            let want = cpu.download(want_t.view());
            let bf = |t: &Tensor| {
                let mut h = be.zeros_of(&[t.len()], DType::BF16, Category::Buffers);
                be.cast(h.view_mut(), t.view());
                h
            };
            let (ha, hb) = (bf(&da), bf(&db));
            let mut dc = on(be, &c);
            be.gemm(dc.view_mut(), ha.view(), hb.view(), g);
            let e16 = rel_err(&be.download(dc.view()), &want);
            let _ = writeln!(
                md,
                "| {m} | {n} | {k} | {ta}/{tb} | {pad} | bf16→f32 | {e16:.1e} |"
            );
            ensure(e16 < 1e-4, || format!("bf16 {g:?}: relative error {e16:e}"))?;
            // The same product from the f32 operands with `Gemm::bf16_inputs` (what training
            // with compute_dtype = "bf16" runs): the backend's own cast into its scratch.
            let mut dc = on(be, &c);
            be.gemm(dc.view_mut(), da.view(), db.view(), g.bf16_inputs(true));
            let ein = rel_err(&be.download(dc.view()), &want);
            let _ = writeln!(
                md,
                "| {m} | {n} | {k} | {ta}/{tb} | {pad} | f32 as bf16 | {ein:.1e} |"
            );
            ensure(ein < 1e-4, || {
                format!("bf16_inputs {g:?}: relative error {ein:e}")
            })?;
            // An f32 A with a B that is bf16 already (the weights under bf16 compute): only A
            // is cast, B goes to cuBLAS as it is. The same inputs reach the same GEMM, so the
            // result should be the one above to the bit (the report says whether it is).
            let mut dw = on(be, &c);
            be.gemm(dw.view_mut(), da.view(), hb.view(), g.bf16_inputs(true));
            let (got_w, got_in) = (be.download(dw.view()), be.download(dc.view()));
            let ew = rel_err(&got_w, &want);
            let bitwise = got_w
                .iter()
                .zip(&got_in)
                .all(|(x, y)| x.to_bits() == y.to_bits());
            let _ = writeln!(
                md,
                "| {m} | {n} | {k} | {ta}/{tb} | {pad} | f32 × bf16 weight (bitwise: {bitwise}) | {ew:.1e} |"
            );
            ensure(ew < 1e-4, || {
                format!("bf16 weight {g:?}: relative error {ew:e}")
            })?;
        }
    }
    // Syrk (Newton–Schulz's X·Xᵀ): cublasSsyrk on one triangle plus the mirror kernel (which
    // also adds the diagonal term), both triangles against the CPU's, with beta reading a
    // symmetric C; with bf16 inputs (`optimizer.ns_dtype`), a full bf16 GemmEx then the same
    // mirror kernel, against the CPU on the same rounded operand.
    for &(n, k, trans, bf16) in &[
        (96usize, 64usize, false, false),
        (77, 130, true, false),
        (256, 512, false, false),
        (96, 64, false, true),
        (77, 130, true, true),
        (256, 512, false, true),
    ] {
        let s0 = Syrk::new(n, k, trans);
        let s = s0
            .alpha(0.5)
            .beta(1.0)
            .diag(-1.25)
            .ld(s0.lda + 3, s0.ldc + 2)
            .bf16_inputs(bf16);
        let rows = if trans { k } else { n };
        let a = values(rows * s.lda, 50 + n as u64);
        let r = values(n * s.ldc, 60 + n as u64);
        let mut c = r.clone();
        for x in 0..n {
            for y in 0..n {
                c[x * s.ldc + y] = r[x.max(y) * s.ldc + x.min(y)];
            }
        }
        let on = |be: &dyn Memory, x: &[f32]| be.upload(x, &[x.len()], Category::Buffers);
        let mut want_t = on(&cpu, &c);
        cpu.syrk(want_t.view_mut(), on(&cpu, &a).view(), s);
        let want = cpu.download(want_t.view());
        let mut dc = on(be, &c);
        be.syrk(dc.view_mut(), on(be, &a).view(), s);
        let got = be.download(dc.view());
        let e = rel_err(&got, &want);
        let _ = writeln!(
            md,
            "| {n} | {n} | {k} | syrk {trans} | 3/2 | {} | {e:.1e} |",
            if bf16 { "bf16→f32" } else { "f32" }
        );
        ensure(e < 1e-4, || format!("syrk {s:?}: relative error {e:e}"))?;
        for x in 0..n {
            for y in 0..x {
                ensure(got[x * s.ldc + y] == got[y * s.ldc + x], || {
                    format!("syrk {s:?}: ({x}, {y}) is not mirrored")
                })?;
            }
        }
    }
    md.push_str(
        "\nTolerance: 1e-4 of the largest |C| (f32 accumulation both sides; bf16 rows \
                 against the CPU on the same bf16-rounded inputs).\n",
    );
    Ok(md)
}

fn bandwidth(be: &CudaBackend) -> Result<String, String> {
    let n = 64 << 20; // 256 MiB of f32
    let mut host = be.pinned_zeros(&[n], Category::Buffers);
    let mut dev = be.zeros(&[n], Category::Buffers);
    // Allocated and zeroed on the compute stream: done before the copy streams touch it.
    be.synchronize();
    let mut md =
        String::from("| direction | stream | GB/s (256 MiB, best of 5) |\n|---|---|---|\n");
    for (name, stream, to_host) in [
        ("host → device", Stream::FromHost, false),
        ("device → host", Stream::ToHost, true),
    ] {
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let a = be.record_event(stream);
            if to_host {
                be.copy_async(host.view_mut(), dev.view(), stream);
            } else {
                be.copy_async(dev.view_mut(), host.view(), stream);
            }
            let b = be.record_event(stream);
            best = best.min(be.elapsed(&a, &b).as_secs_f64());
        }
        let gbs = (4 * n) as f64 / best / 1e9;
        let _ = writeln!(md, "| {name} | {} | {gbs:.1} |", stream.name());
        ensure(gbs > 1.0, || {
            format!("{name}: {gbs:.2} GB/s is not pinned-memory speed")
        })?;
    }
    Ok(md)
}

fn gemm_throughput(be: &CudaBackend) -> Result<String, String> {
    let mut md = String::from("| m = n = k | dtype | ms | TFLOP/s |\n|---|---|---|---|\n");
    for size in [1024usize, 2048, 4096, 8192] {
        for dtype in [DType::F32, DType::BF16] {
            let len = size * size;
            let a = be.zeros_of(&[len], dtype, Category::Buffers);
            let b = be.zeros_of(&[len], dtype, Category::Buffers);
            let mut c = be.zeros(&[len], Category::Buffers);
            let g = Gemm::new(size, size, size, false, true);
            be.gemm(c.view_mut(), a.view(), b.view(), g); // warm-up (heuristics, clocks)
            let iters = if size >= 4096 { 10 } else { 30 };
            let start = be.record_event(Stream::Compute);
            for _ in 0..iters {
                be.gemm(c.view_mut(), a.view(), b.view(), g);
            }
            let end = be.record_event(Stream::Compute);
            let s = be.elapsed(&start, &end).as_secs_f64() / iters as f64;
            let tflops = g.flops() as f64 / s / 1e12;
            let label = if dtype == DType::BF16 {
                "bf16→f32"
            } else {
                "f32"
            };
            let _ = writeln!(md, "| {size} | {label} | {:.3} | {tflops:.1} |", s * 1e3);
        }
    }
    md.push_str(
        "\nB transposed (`x·Wᵀ`, the model's linear layers); f32 is cuBLAS's default math \
                 (no TF32).\n",
    );
    Ok(md)
}

/// Newton–Schulz (5 steps, as Muon runs it) at square sizes and the write-up's expert shape
/// (1,792 × 6,144), with f32 and with bf16 products (`optimizer.ns_dtype`; `auto` is bf16 here):
/// median device ms of 5 calls each, and how far bf16's result is from f32's. The CPU tests hold
/// bf16 NS to the same band of singular values as f32; here a deviation beyond 20% of the
/// entries' rms means something other than operand rounding. By the FLOP count (4096², f32, at
/// ~50 TFLOP/s: ~40 ms a call, 6 calls) well under 2 s of GPU time in all; not yet run.
fn newton_schulz_times(be: &CudaBackend) -> Result<String, String> {
    use ganymede_cuda::device::CudaLauncher;
    use ganymede_cuda::kernel_backend::KernelBackend;
    use ganymede_cuda::ops::{KernelOps, Tuning};
    use ganymede_optim::{ns_timings, ns_timings_markdown};
    // The whole seam (NS normalises with a kernel), on this backend's context and streams.
    let tuning = Tuning::for_device(be.compute_major())?;
    let full = KernelBackend::new(
        KernelOps::with_tuning(CudaLauncher::new(be.clone()), tuning),
        be.clone(),
    );
    let shapes = [
        (256, 256),
        (1024, 1024),
        (2048, 2048),
        (4096, 4096),
        (1792, 6144),
    ];
    let rows = ns_timings(&full, &shapes, 5, 5);
    let mut md = ns_timings_markdown(&rows);
    md.push_str(
        "\nMedian of 5 calls after a warm-up, each on a fresh copy of the input, timed by \
         events on the compute stream; TFLOP/s counts every product as a full GEMM \
         (`ns_flops`). f32 is cuBLAS's default math (no TF32).\n",
    );
    for t in &rows {
        ensure(t.f32_ms.is_finite() && t.bf16_ms.is_finite(), || {
            format!("{}×{}: no time measured", t.rows, t.cols)
        })?;
        ensure(t.max_dev < 0.2 * t.rms, || {
            format!(
                "{}×{}: bf16 differs from f32 by {:.3e}, entries' rms {:.3e}\n\n{md}",
                t.rows, t.cols, t.max_dev, t.rms
            )
        })?;
    }
    Ok(md)
}

/// Muon on one of `medium`'s expert stacks (64 matrices of 512 × 1,024, bf16 products): the
/// matrices one at a time (`newton_schulz`, ~50 launches each) against the batch at once
/// (`newton_schulz_strided`, what the optimizer runs on a GPU), timed, the two within 2e-2 of
/// the entries' largest magnitude (cuBLAS may sum a batch in another order, and bf16 operands
/// one ulp apart round apart).
fn newton_schulz_stack(be: &CudaBackend) -> Result<String, String> {
    use ganymede_cuda::device::CudaLauncher;
    use ganymede_cuda::kernel_backend::KernelBackend;
    use ganymede_cuda::ops::{KernelOps, Tuning};
    use ganymede_optim::{newton_schulz, newton_schulz_strided, NsScratch, NsSteps};
    let tuning = Tuning::for_device(be.compute_major())?;
    let full = KernelBackend::new(
        KernelOps::with_tuning(CudaLauncher::new(be.clone()), tuning),
        be.clone(),
    );
    let (count, rows, cols) = (64usize, 512usize, 1024usize);
    let n = rows * cols;
    let g = be.upload(&values(count * n, 60), &[count * n], Category::Buffers);
    let mut one = be.zeros(&[count * n], Category::Buffers);
    let mut batch = be.zeros(&[count * n], Category::Buffers);
    let mut sc1 = NsScratch::new(&full, rows, cols);
    let mut scb = NsScratch::for_batch(&full, rows, cols, count);
    let mut per_matrix = |t: &mut Tensor| {
        be.copy(t.view_mut(), g.view());
        for e in 0..count {
            newton_schulz(
                &full,
                t.slice_mut(e * n, n),
                rows,
                cols,
                NsSteps::muon(5),
                true,
                &mut sc1,
            );
        }
    };
    let mut strided = |t: &mut Tensor| {
        be.copy(t.view_mut(), g.view());
        newton_schulz_strided(
            &full,
            t.view_mut(),
            count,
            rows,
            cols,
            NsSteps::muon(5),
            true,
            &mut scb,
        );
    };
    // Warm-up (the cast scratch grows), then timed by events.
    per_matrix(&mut one);
    strided(&mut batch);
    let time = |f: &mut dyn FnMut()| {
        let a = be.record_event(Stream::Compute);
        f();
        let b = be.record_event(Stream::Compute);
        be.elapsed(&a, &b).as_secs_f64()
    };
    let t0 = std::time::Instant::now();
    let t_one = time(&mut || per_matrix(&mut one));
    let wall_one = t0.elapsed().as_secs_f64();
    let t0 = std::time::Instant::now();
    let t_batch = time(&mut || strided(&mut batch));
    let wall_batch = t0.elapsed().as_secs_f64();
    let (a, b) = (be.download(one.view()), be.download(batch.view()));
    let scale = a.iter().fold(0.0f32, |m, x| m.max(x.abs())) as f64;
    let diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs() as f64)
        .fold(0.0, f64::max);
    let flops = count as f64 * ganymede_optim::ns_flops(rows, cols, 5) as f64;
    let md = format!(
        "| {count} × {rows}×{cols}, bf16 | GPU ms | host ms (enqueue) | TFLOP/s |\n\
         |---|---|---|---|\n\
         | one at a time | {:.2} | {:.2} | {:.1} |\n\
         | strided batch | {:.2} | {:.2} | {:.1} |\n\n\
         Batch against one at a time: max difference {diff:.2e} at entries up to {scale:.2e}.\n",
        t_one * 1e3,
        wall_one * 1e3,
        flops / t_one / 1e12,
        t_batch * 1e3,
        wall_batch * 1e3,
        flops / t_batch / 1e12,
    );
    ensure(diff <= 2e-2 * scale, || {
        format!("the batch differs\n\n{md}")
    })?;
    Ok(md)
}

/// Newton–Schulz in bf16 keeps X, A and B in bf16 (issue 32): each symmetric product's f32
/// result is mirrored, given its diagonal term and rounded by one kernel
/// (`syrk_strided_into_bf16`) where it was mirrored in place and then cast by the next product.
/// On one of `medium`'s expert stacks (64 × 512×1,024, bf16 operand) both ways, timed (median
/// of 5 after a warm-up); the same strided GEMM feeds both, so the bits must agree.
fn syrk_into_bf16(be: &CudaBackend) -> Result<String, String> {
    use ganymede_cuda::kernel_backend::Gemms;
    let (count, s, l) = (64usize, 512usize, 1024usize);
    let (n, ss) = (s * l, s * s);
    let x = be.upload(&values(count * n, 62), &[count * n], Category::Buffers);
    let mut x16 = be.zeros_of(&[count * n], DType::BF16, Category::Buffers);
    be.cast(x16.view_mut(), x.view());
    let sy = Syrk::new(s, l, false).diag(-1.2).bf16_inputs(true);
    let mut w = be.zeros(&[count * ss], Category::Buffers);
    let mut old = be.zeros_of(&[count * ss], DType::BF16, Category::Buffers);
    let mut new = be.zeros_of(&[count * ss], DType::BF16, Category::Buffers);
    let (mut t_old, mut t_new) = (Vec::new(), Vec::new());
    for i in 0..6 {
        let a = be.record_event(Stream::Compute);
        Gemms::syrk_strided(be, w.view_mut(), x16.view(), sy, count, [n, ss]);
        be.cast(old.view_mut(), w.view());
        let b = be.record_event(Stream::Compute);
        Gemms::syrk_strided_into_bf16(
            be,
            w.view_mut(),
            new.view_mut(),
            x16.view(),
            sy,
            count,
            [n, ss],
        );
        let c = be.record_event(Stream::Compute);
        if i > 0 {
            t_old.push(be.elapsed(&a, &b).as_secs_f64() * 1e3);
            t_new.push(be.elapsed(&b, &c).as_secs_f64() * 1e3);
        }
    }
    let median = |mut ms: Vec<f64>| {
        ms.sort_by(f64::total_cmp);
        ms[ms.len() / 2]
    };
    let widen = |t: &Tensor| {
        let mut f = be.zeros(&[count * ss], Category::Buffers);
        be.cast(f.view_mut(), t.view());
        be.download(f.view())
    };
    let (o, q) = (widen(&old), widen(&new));
    let differ = o
        .iter()
        .zip(&q)
        .filter(|(p, q)| p.to_bits() != q.to_bits())
        .count();
    let md = format!(
        "| {count} × X·Xᵀ of 512×1,024, bf16 | ms |\n|---|---|\n\
         | syrk, mirror in place, cast | {:.3} |\n\
         | syrk, mirror into bf16 | {:.3} |\n\n\
         Entries whose bits differ: {differ} of {}.\n",
        median(t_old),
        median(t_new),
        o.len(),
    );
    ensure(differ == 0, || format!("the bf16 results differ\n\n{md}"))?;
    Ok(md)
}

/// Issue 32's launcher and normalisation, timed: 10,000 launches of a 1,024-element `scale_f32`
/// (host µs per launch to enqueue, GPU µs per launch; the kernel handles resolved once, which
/// the launcher's count of lookups must show), and the Frobenius normalisation of one of
/// `medium`'s expert stacks (64 × 512×1,024 f32) into its bf16 copy, as Newton–Schulz in bf16
/// used to make it (in place, then a cast) against the one pass into bf16, whose bits must be
/// the same. Median of 5 after a warm-up.
fn launches_and_bf16_normalisation(be: &CudaBackend) -> Result<String, String> {
    use ganymede_core::OptimOps;
    use ganymede_cuda::device::CudaLauncher;
    use ganymede_cuda::launch::Launcher;
    use ganymede_cuda::ops::{KernelOps, Tuning};
    let ops = KernelOps::with_tuning(CudaLauncher::new(be.clone()), Tuning::default());
    let median = |mut ms: Vec<f64>| {
        ms.sort_by(f64::total_cmp);
        ms[ms.len() / 2]
    };
    let mut small = be.zeros(&[1024], Category::Buffers);
    ops.scale(small.view_mut(), 1.0);
    be.synchronize();
    let resolved = ops.launcher().resolutions();
    let launches = 10_000;
    let (t0, a) = (Instant::now(), be.record_event(Stream::Compute));
    for _ in 0..launches {
        ops.scale(small.view_mut(), 1.0);
    }
    let host_us = t0.elapsed().as_secs_f64() * 1e6 / launches as f64;
    let b = be.record_event(Stream::Compute);
    let gpu_us = be.elapsed(&a, &b).as_secs_f64() * 1e6 / launches as f64;
    ensure(ops.launcher().resolutions() == resolved, || {
        "a kernel was looked up again after its first launch".into()
    })?;

    let (count, n) = (64usize, 512usize * 1024);
    let g = be.upload(&values(count * n, 61), &[count * n], Category::Buffers);
    let mut x = be.zeros(&[count * n], Category::Buffers);
    let mut old = be.zeros_of(&[count * n], DType::BF16, Category::Buffers);
    let mut new = be.zeros_of(&[count * n], DType::BF16, Category::Buffers);
    let (mut t_old, mut t_new) = (Vec::new(), Vec::new());
    for i in 0..6 {
        be.copy(x.view_mut(), g.view());
        let a = be.record_event(Stream::Compute);
        ops.normalize_frobenius_strided(x.view_mut(), count, 1e-7);
        ops.cast(old.view_mut(), x.view());
        let b = be.record_event(Stream::Compute);
        ops.normalize_frobenius_strided_bf16(g.view(), new.view_mut(), count, 1e-7);
        let c = be.record_event(Stream::Compute);
        if i > 0 {
            t_old.push(be.elapsed(&a, &b).as_secs_f64() * 1e3);
            t_new.push(be.elapsed(&b, &c).as_secs_f64() * 1e3);
        }
    }
    let (t_old, t_new) = (median(t_old), median(t_new));
    let widen = |t: &Tensor| {
        let mut w = be.zeros(&[count * n], Category::Buffers);
        be.cast(w.view_mut(), t.view());
        be.download(w.view())
    };
    let same = widen(&old)
        .iter()
        .zip(widen(&new))
        .all(|(p, q)| p.to_bits() == q.to_bits());
    // Bytes: both read x for the norms (4); the old way then reads and writes x (8) and casts
    // (6), the new one reads x and writes bf16 (6).
    let gbs = |bytes: f64, ms: f64| bytes * (count * n) as f64 / (ms * 1e-3) / 1e9;
    let md = format!(
        "| | host µs / launch | GPU µs / launch |\n|---|---|---|\n\
         | {launches} × scale_f32 (1,024) | {host_us:.2} | {gpu_us:.2} |\n\n\
         | {count} × 512×1,024 into bf16 | ms | GB/s |\n|---|---|---|\n\
         | normalise in place, then cast | {t_old:.3} | {:.0} |\n\
         | one pass into bf16 | {t_new:.3} | {:.0} |\n\n\
         The bf16 copies' bits agree: {same}.\n",
        gbs(18.0, t_old),
        gbs(10.0, t_new),
    );
    ensure(same, || format!("the bf16 copies differ\n\n{md}"))?;
    Ok(md)
}

/// The experts' up projection at `medium`'s shapes (64 experts, 1,024 → 512, tokens sorted into
/// equal slots per expert): one strided-batched call against one GEMM per expert, equal up to
/// summation order (cuBLAS may pick another algorithm for the batch): 1e-4 of the largest |C|.
fn expert_gemms(be: &CudaBackend) -> Result<String, String> {
    let mut md = String::from(
        "| experts | tokens/expert | k → n | dtype | loop ms | batched ms | batched TFLOP/s | rel. diff |\n|---|---|---|---|---|---|---|---|\n",
    );
    let (experts, k, n) = (64usize, 1024usize, 512usize);
    for tokens in [128usize, 512, 2048] {
        let g = Gemm::new(tokens, n, k, false, true);
        let (sa, sb, sc) = (tokens * k, n * k, tokens * n);
        let x = be.upload(
            &values(experts * sa, 40),
            &[experts * sa],
            Category::Buffers,
        );
        let w = be.upload(
            &values(experts * sb, 41),
            &[experts * sb],
            Category::Buffers,
        );
        let mut xb = be.zeros_of(&[experts * sa], DType::BF16, Category::Buffers);
        let mut wb = be.zeros_of(&[experts * sb], DType::BF16, Category::Buffers);
        be.cast(xb.view_mut(), x.view());
        be.cast(wb.view_mut(), w.view());
        let mut looped = be.zeros(&[experts * sc], Category::Buffers);
        let mut batched = be.zeros(&[experts * sc], Category::Buffers);
        let run_loop = |c: &mut Tensor| {
            for e in 0..experts {
                be.gemm(
                    c.slice_mut(e * sc, sc),
                    xb.slice(e * sa, sa),
                    wb.slice(e * sb, sb),
                    g,
                );
            }
        };
        let run_batch = |c: &mut Tensor| {
            be.gemm_strided_batched(c.view_mut(), xb.view(), wb.view(), g, experts, [sa, sb, sc])
        };
        run_loop(&mut looped);
        run_batch(&mut batched);
        let diff = rel_err(&be.download(batched.view()), &be.download(looped.view()));
        ensure(diff < 1e-4, || {
            format!("{tokens} tokens/expert: batched differs from the loop by {diff:e}")
        })?;
        let time = |f: &dyn Fn()| {
            let iters = 10;
            let a = be.record_event(Stream::Compute);
            for _ in 0..iters {
                f();
            }
            let b = be.record_event(Stream::Compute);
            be.elapsed(&a, &b).as_secs_f64() / iters as f64
        };
        let cell = std::cell::RefCell::new(looped);
        let t_loop = time(&|| run_loop(&mut cell.borrow_mut()));
        let cell_b = std::cell::RefCell::new(batched);
        let t_batch = time(&|| run_batch(&mut cell_b.borrow_mut()));
        let tflops = (experts as f64 * g.flops() as f64) / t_batch / 1e12;
        let _ = writeln!(
            md,
            "| {experts} | {tokens} | {k} → {n} | bf16→f32 | {:.3} | {:.3} | {tflops:.1} | {diff:.1e} |",
            t_loop * 1e3,
            t_batch * 1e3
        );
    }
    Ok(md)
}

/// The experts' up projection at `medium`'s shapes (64 experts, 1,024 → 512) with uneven token
/// counts, as routing leaves them (some experts empty): one `cublasGemmGroupedBatchedEx`
/// (`gemm_grouped_batched`, what training runs) against one GEMM per expert, equal up to
/// summation order (1e-4 of the largest |C|), and their times. Twice in a row, so the second
/// call reuses the pointer slots (no allocation). And gemm.cu's tensor-core kernel on the same
/// groups (`Tuning::grouped_tc`), equal to the loop up to summation order, and its time; and
/// its form that reads the experts' rows from device offsets (`gemm_experts_tc`, what a step
/// with no count read-back runs), bitwise equal to it, and its time.
fn grouped_expert_gemms(be: &CudaBackend) -> Result<String, String> {
    use ganymede_cuda::device::CudaLauncher;
    use ganymede_cuda::ops::{KernelOps, Tuning};
    let mut md = String::from(
        "| experts (empty) | tokens | k → n | loop ms | grouped ms | grouped TFLOP/s | rel. diff | gemm.cu kernel ms | kernel TFLOP/s | kernel rel. diff | device-offsets kernel ms | its TFLOP/s |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    // gemm.cu's tensor-core grouped GEMM (`Tuning::grouped_tc`, `GANYMEDE_CUDA_GROUPED=kernel`).
    let ops = KernelOps::with_tuning(CudaLauncher::new(be.clone()), Tuning::default());
    let (experts, k, n) = (64usize, 1024usize, 512usize);
    for mean in [128usize, 512, 2048] {
        // A skewed split: expert e gets a share growing with (e mod 8)², every 9th none.
        let weight = |e: usize| if e % 9 == 4 { 0 } else { 1 + (e % 8) * (e % 8) };
        let total_w: usize = (0..experts).map(weight).sum();
        let counts: Vec<usize> = (0..experts)
            .map(|e| weight(e) * mean * experts / total_w)
            .collect();
        let tokens: usize = counts.iter().sum();
        let x = be.upload(&values(tokens * k, 50), &[tokens * k], Category::Buffers);
        let w = be.upload(
            &values(experts * n * k, 51),
            &[experts * n * k],
            Category::Buffers,
        );
        let mut xb = be.zeros_of(&[tokens * k], DType::BF16, Category::Buffers);
        let mut wb = be.zeros_of(&[experts * n * k], DType::BF16, Category::Buffers);
        be.cast(xb.view_mut(), x.view());
        be.cast(wb.view_mut(), w.view());
        let mut groups = Vec::new();
        let mut row = 0;
        for (e, &t) in counts.iter().enumerate() {
            groups.push((Gemm::new(t, n, k, false, true), row * k, e * n * k, row * n));
            row += t;
        }
        let mut looped = be.zeros(&[tokens * n], Category::Buffers);
        let mut grouped = be.zeros(&[tokens * n], Category::Buffers);
        be.gemm_grouped_loop(looped.view_mut(), xb.view(), wb.view(), &groups);
        // bf16 operands into an f32 result, as training's: cuBLAS may refuse this combination
        // for the grouped call, and training then loops (`CudaLauncher`'s `gemm_grouped`).
        let refused = be
            .try_gemm_grouped_batched(grouped.view_mut(), xb.view(), wb.view(), &groups)
            .err();
        let diff = if refused.is_none() {
            rel_err(&be.download(grouped.view()), &be.download(looped.view()))
        } else {
            0.0
        };
        ensure(diff < 1e-4, || {
            format!("mean {mean} tokens/expert: grouped differs from the loop by {diff:e}")
        })?;
        // From the f32 operands with `Gemm::bf16_inputs`: one cast of each whole operand, then
        // the grouped call on bf16.
        let gb: Vec<_> = groups
            .iter()
            .map(|&(g, a, b, c)| (g.bf16_inputs(true), a, b, c))
            .collect();
        let mut cast_in = be.zeros(&[tokens * n], Category::Buffers);
        ganymede_cuda::kernel_backend::Gemms::gemm_grouped(
            be,
            cast_in.view_mut(),
            x.view(),
            w.view(),
            &gb,
        );
        let d_in = rel_err(&be.download(cast_in.view()), &be.download(looped.view()));
        ensure(d_in < 1e-4, || {
            format!("mean {mean} tokens/expert: bf16_inputs differs from the loop by {d_in:e}")
        })?;
        // With the experts' weights bf16 already: only the rows are cast.
        let mut weight16 = be.zeros(&[tokens * n], Category::Buffers);
        ganymede_cuda::kernel_backend::Gemms::gemm_grouped(
            be,
            weight16.view_mut(),
            x.view(),
            wb.view(),
            &gb,
        );
        let d_w = rel_err(&be.download(weight16.view()), &be.download(looped.view()));
        ensure(d_w < 1e-4, || {
            format!("mean {mean} tokens/expert: bf16 weights differ from the loop by {d_w:e}")
        })?;
        let time = |f: &mut dyn FnMut()| {
            let iters = 10;
            let a = be.record_event(Stream::Compute);
            for _ in 0..iters {
                f();
            }
            let b = be.record_event(Stream::Compute);
            be.elapsed(&a, &b).as_secs_f64() / iters as f64
        };
        let t_loop =
            time(&mut || be.gemm_grouped_loop(looped.view_mut(), xb.view(), wb.view(), &groups));
        let flops = 2.0 * (tokens * n * k) as f64;
        let empty = counts.iter().filter(|&&c| c == 0).count();
        let mut tc = be.zeros(&[tokens * n], Category::Buffers);
        ops.gemm_grouped_tc(tc.view_mut(), xb.view(), wb.view(), &gb);
        let d_tc = rel_err(&be.download(tc.view()), &be.download(looped.view()));
        ensure(d_tc < 1e-4, || {
            format!(
                "mean {mean} tokens/expert: the gemm.cu kernel differs from the loop by {d_tc:e}"
            )
        })?;
        let t_tc = time(&mut || ops.gemm_grouped_tc(tc.view_mut(), xb.view(), wb.view(), &gb));
        // The same products with the rows' offsets read on the device.
        let mut offsets = vec![0u32];
        for &c in &counts {
            offsets.push(offsets.last().unwrap() + c as u32);
        }
        let off = be.upload_u32(&offsets, &[experts + 1], Category::Buffers);
        let spec = ganymede_core::ExpertGemm {
            gemm: Gemm::new(0, n, k, false, true).bf16_inputs(true),
            routed: ganymede_core::Routed::M,
            a: [k, 0],
            b: [0, n * k],
            c: [n, 0],
        };
        let mut dev = be.zeros(&[tokens * n], Category::Buffers);
        let mut run_dev = || {
            ops.gemm_experts_tc(
                dev.view_mut(),
                xb.view(),
                wb.view(),
                (off.view(), tokens),
                &spec,
            )
        };
        run_dev();
        let t_dev = time(&mut run_dev);
        ensure(be.download(dev.view()) == be.download(tc.view()), || {
            format!(
                "mean {mean} tokens/expert: the device-offsets kernel differs from the grouped one"
            )
        })?;
        let kernel = format!(
            "{:.3} | {:.1} | {d_tc:.1e} | {:.3} | {:.1}",
            t_tc * 1e3,
            flops / t_tc / 1e12,
            t_dev * 1e3,
            flops / t_dev / 1e12
        );
        if let Some(e) = refused {
            // What a bf16 result would give instead (cuBLAS's table has bf16 → bf16 for this
            // call): the figure that says whether a grouped call into bf16, widened after, would
            // beat the loop.
            let mut c16 = be.zeros_of(&[tokens * n], DType::BF16, Category::Buffers);
            let mut try16 =
                || be.try_gemm_grouped_batched(c16.view_mut(), xb.view(), wb.view(), &groups);
            let alt = match try16() {
                Err(e16) => format!("bf16 → bf16 refused too: {e16}"),
                Ok(()) => {
                    let t16 = time(&mut || {
                        let _ = try16();
                    });
                    let d16 = rel_err(&be.download(c16.view()), &be.download(looped.view()));
                    format!(
                        "bf16 → bf16 grouped: {:.3} ms, {:.1} TFLOP/s, {d16:.1e} from the loop",
                        t16 * 1e3,
                        flops / t16 / 1e12
                    )
                }
            };
            let _ = writeln!(
                md,
                "| {experts} ({empty}) | {tokens} | {k} → {n} | {:.3} | refused bf16 → f32: {e} \
                 (training loops); {alt} | {:.1} (loop) | – | {kernel} |",
                t_loop * 1e3,
                flops / t_loop / 1e12
            );
            continue;
        }
        let t_grouped = time(&mut || {
            be.gemm_grouped_batched(grouped.view_mut(), xb.view(), wb.view(), &groups)
        });
        let _ = writeln!(
            md,
            "| {experts} ({empty}) | {tokens} | {k} → {n} | {:.3} | {:.3} | {:.1} | {diff:.1e} | {kernel} |",
            t_loop * 1e3,
            t_grouped * 1e3,
            flops / t_grouped / 1e12
        );
    }
    Ok(md)
}

fn kernels_by_name(be: &CudaBackend) -> Result<String, String> {
    let mut files: Vec<(&str, &str)> = ganymede_cuda::sources::SOURCES.to_vec();
    files.push(ganymede_cuda::device::PLUMBING);
    let mut md = String::from("| file | kernels |\n|---|---|\n");
    for (file, src) in files {
        let names = ganymede_cuda::device::nvrtc::kernel_names(src);
        for n in &names {
            be.function(n).map_err(|e| format!("{file}: {e}"))?;
        }
        let _ = writeln!(md, "| {file} | {} |", names.len());
    }
    Ok(md)
}

/// A device-to-host copy on the to-host stream beside GEMMs on the compute stream: together they
/// must take less than one after the other (the streams run concurrently), as offload needs.
fn overlap(be: &CudaBackend) -> Result<String, String> {
    let n = 64 << 20; // 256 MiB of f32
    let mut host = be.pinned_zeros(&[n], Category::Buffers);
    let src = be.zeros(&[n], Category::Buffers);
    let size = 4096;
    let a = be.zeros_of(&[size * size], DType::BF16, Category::Buffers);
    let mut c = be.zeros(&[size * size], Category::Buffers);
    let g = Gemm::new(size, size, size, false, true);
    be.synchronize();
    let copy = |host: &mut Tensor| be.copy_async(host.view_mut(), src.view(), Stream::ToHost);
    let gemms = |c: &mut Tensor| {
        for _ in 0..40 {
            be.gemm(c.view_mut(), a.view(), a.view(), g);
        }
    };
    let timed = |stream: Stream, f: &mut dyn FnMut()| {
        let s = be.record_event(stream);
        f();
        let e = be.record_event(stream);
        be.elapsed(&s, &e).as_secs_f64()
    };
    gemms(&mut c); // warm-up
    let t_copy = timed(Stream::ToHost, &mut || copy(&mut host));
    let t_gemm = timed(Stream::Compute, &mut || gemms(&mut c));
    // Both, started together: the copy stream waits for the compute stream's start event, and
    // the end is compute's end after it has waited for the copy.
    let start = be.record_event(Stream::Compute);
    be.wait_event(Stream::ToHost, &start);
    copy(&mut host);
    gemms(&mut c);
    let copied = be.record_event(Stream::ToHost);
    be.wait_event(Stream::Compute, &copied);
    let end = be.record_event(Stream::Compute);
    let t_both = be.elapsed(&start, &end).as_secs_f64();
    let hidden = (t_copy + t_gemm - t_both) / t_copy.min(t_gemm);
    let md = format!(
        "| copy 256 MiB to host | 40 bf16 GEMMs of 4096 | both | hidden |\n|---|---|---|---|\n\
         | {:.2} ms | {:.2} ms | {:.2} ms | {:.0}% of the shorter |\n",
        t_copy * 1e3,
        t_gemm * 1e3,
        t_both * 1e3,
        100.0 * hidden
    );
    ensure(hidden > 0.25, || {
        format!("the copy and the GEMMs hardly overlapped:\n\n{md}")
    })?;
    Ok(md)
}

/// Causal attention at `medium`'s shape (batch 4, seq 4,096, 16 query heads on 4 kv heads,
/// head_dim 64, bf16): forward and backward on the SIMT kernels (`attention_*_bf16`) and on the
/// tensor-core kernels (`attention_*_tc64_bf16`) with either backward (dq in its own pass, or
/// fused into the dk/dv pass with atomic adds), timed, and the tensor-core results checked
/// against the SIMT ones. Both read the same bf16 inputs and accumulate in f32; the tensor-core
/// kernels also round probabilities and dS to bf16 as operands, so each output is held to
/// 2^-6 of its largest |SIMT value| (the host tests see up to 3.9e-3, about 2^-8, against the CPU in f32), and
/// lse, from f32 scores either way, to 1e-4. FLOPs are causal (half the T × T products): forward
/// 2 matmuls, 4 B H T² d / 2; backward counted as 2.5 times the forward, the usual convention
/// (the two-pass kernels do 3.5 times, dk/dv and dq each recompute S; the fused 2.5 times).
/// The tensor-core forward runs with 16 query rows a warp and, in the last row, 32.
fn attention_kernels(be: &CudaBackend) -> Result<String, String> {
    use ganymede_core::{AttnDims, AttnGrads, AttnSaved};
    use ganymede_cuda::device::CudaLauncher;
    use ganymede_cuda::ops::{KernelOps, Tuning};
    let d = AttnDims {
        batch: 4,
        tq: 4096,
        tk: 4096,
        heads: 16,
        kv_heads: 4,
        head_dim: 64,
    };
    let nq = d.batch * d.tq * d.heads * d.head_dim;
    let nk = d.batch * d.tk * d.kv_heads * d.head_dim;
    let nl = d.batch * d.heads * d.tq;
    let bf = |x: Vec<f32>| {
        let src = be.upload(&x, &[x.len()], Category::Buffers);
        let mut t = be.zeros_of(&[x.len()], DType::BF16, Category::Buffers);
        be.cast(t.view_mut(), src.view());
        t
    };
    let to_f32 = |t: &Tensor| {
        let mut f = be.zeros(&[t.len()], Category::Buffers);
        be.cast(f.view_mut(), t.view());
        be.download(f.view())
    };
    // q, k scaled so that scores spread (softmax neither uniform nor one-hot).
    let scaled = |n, seed, s: f32| values(n, seed).into_iter().map(|x| x * s).collect();
    let (q, k, v, dout) = (
        bf(scaled(nq, 50, 2.0)),
        bf(scaled(nk, 51, 2.0)),
        bf(values(nk, 52)),
        bf(values(nq, 53)),
    );
    let fwd_flops =
        4.0 * (d.batch * d.heads) as f64 * (d.tq * d.tk) as f64 * d.head_dim as f64 / 2.0;
    let mut md = String::from(
        "| kernels | forward ms | forward TFLOP/s | backward ms | backward TFLOP/s |\n|---|---|---|---|---|\n",
    );
    let mut results: Vec<Vec<Vec<f32>>> = Vec::new();
    // (tensor cores, fused backward, wide forward, label, its short name)
    let variants = [
        (false, false, false, "SIMT (f32 CUDA cores)", "SIMT"),
        (
            true,
            false,
            false,
            "tensor cores (mma.sync bf16), dq in its own pass",
            "two passes",
        ),
        (
            true,
            true,
            false,
            "tensor cores, fused backward (dq by atomic adds)",
            "fused",
        ),
        (
            true,
            true,
            true,
            "tensor cores, forward 32 rows a warp, fused backward",
            "wide forward",
        ),
    ];
    for (tc, fused, wide, what, _) in variants {
        let ops = KernelOps::with_tuning(
            CudaLauncher::new(be.clone()),
            Tuning {
                attn_tc: tc,
                attn_fused_dq: fused,
                attn_wide_fwd: wide,
                ..Tuning::default()
            },
        );
        let mut out = be.zeros_of(&[nq], DType::BF16, Category::Buffers);
        let mut lse = be.zeros(&[nl], Category::Buffers);
        let mut dq = be.zeros_of(&[nq], DType::BF16, Category::Buffers);
        let mut dk = be.zeros_of(&[nk], DType::BF16, Category::Buffers);
        let mut dv = be.zeros_of(&[nk], DType::BF16, Category::Buffers);
        let iters = 3;
        let mut fwd = || {
            ops.attention_forward(
                out.view_mut(),
                lse.view_mut(),
                q.view(),
                k.view(),
                v.view(),
                d,
            )
        };
        fwd(); // warm-up
        let a = be.record_event(Stream::Compute);
        for _ in 0..iters {
            fwd();
        }
        let b = be.record_event(Stream::Compute);
        let t_fwd = be.elapsed(&a, &b).as_secs_f64() / iters as f64;
        let mut bwd = || {
            ops.attention_backward(
                AttnGrads {
                    dq: dq.view_mut(),
                    dk: dk.view_mut(),
                    dv: dv.view_mut(),
                },
                dout.view(),
                AttnSaved {
                    out: out.view(),
                    q: q.view(),
                    k: k.view(),
                    v: v.view(),
                    lse: lse.view(),
                },
                d,
            )
        };
        bwd();
        let a = be.record_event(Stream::Compute);
        for _ in 0..iters {
            bwd();
        }
        let b = be.record_event(Stream::Compute);
        let t_bwd = be.elapsed(&a, &b).as_secs_f64() / iters as f64;
        let _ = writeln!(
            md,
            "| {what} | {:.3} | {:.1} | {:.3} | {:.1} |",
            t_fwd * 1e3,
            fwd_flops / t_fwd / 1e12,
            t_bwd * 1e3,
            2.5 * fwd_flops / t_bwd / 1e12
        );
        results.push(vec![
            to_f32(&out),
            be.download(lse.view()),
            to_f32(&dq),
            to_f32(&dk),
            to_f32(&dv),
        ]);
    }
    let _ = writeln!(
        md,
        "\nbatch {}, seq {}, {} q heads / {} kv heads, head_dim {}, causal, bf16; mean of 3 \
         after a warm-up. Tensor cores against SIMT (max |diff| / max |SIMT|; lse absolute):\n",
        d.batch, d.tq, d.heads, d.kv_heads, d.head_dim
    );
    let names = ["out", "lse", "dq", "dk", "dv"];
    let mut bad = Vec::new();
    for (v, (.., short)) in variants.iter().enumerate().skip(1) {
        let _ = writeln!(md, "{short}:\n");
        for (o, name) in names.iter().enumerate() {
            let (simt, tc) = (&results[0][o], &results[v][o]);
            let finite = tc.iter().all(|x| x.is_finite());
            let (err, tol) = if o == 1 {
                let e = tc.iter().zip(simt).fold(0f64, |m, (&a, &b)| {
                    m.max((f64::from(a) - f64::from(b)).abs())
                });
                (e, 1e-4)
            } else {
                (rel_err(tc, simt), 1.0 / 64.0)
            };
            let _ = writeln!(md, "- {name}: {err:.2e} (tolerance {tol:.1e})");
            if !finite || err.is_nan() || err > tol {
                bad.push(format!(
                    "{name} ({short}): {err:e} > {tol:e} (all finite: {finite})"
                ));
            }
        }
        let _ = writeln!(md);
    }
    // The host build gives dk and dv bit for bit from either backward, and out and lse from
    // either forward; say whether the device does (not a failure: a compiler may order a sum
    // differently in the other kernel).
    let same = |x: usize, y: usize, o: usize| {
        results[x][o]
            .iter()
            .zip(&results[y][o])
            .all(|(a, b)| a.to_bits() == b.to_bits())
    };
    let _ = writeln!(
        md,
        "dk, dv bitwise equal between the two tensor-core backwards: {}, {}; out, lse between \
         the two forwards: {}, {}",
        same(1, 2, 3),
        same(1, 2, 4),
        same(2, 3, 0),
        same(2, 3, 1)
    );
    if bad.is_empty() {
        Ok(md)
    } else {
        Err(format!(
            "{md}\ntensor cores differ from SIMT: {}",
            bad.join("; ")
        ))
    }
}

/// The memory-bound kernels' 4-wide accesses (`ew_loop`, `row_loop` in common.cuh) against their
/// scalar loops, which the same kernels take on views one element off a 16-byte boundary, at
/// `medium`'s sizes: GB/s over the bytes each must move, median of 5 after a warm-up. By
/// Little's law a scalar f32 kernel keeps too little in flight for much over a third of an
/// H200's HBM bandwidth; the 4-wide path is meant to come near it. Both paths must agree
/// (their arithmetic is the same per element; a compiler may contract the two differently).
fn memory_bound_kernels(be: &CudaBackend) -> Result<String, String> {
    use ganymede_core::OptimOps;
    use ganymede_cuda::device::CudaLauncher;
    use ganymede_cuda::ops::{KernelOps, Tuning};
    let ops = KernelOps::with_tuning(CudaLauncher::new(be.clone()), Tuning::default());
    let n = 32usize << 20;
    let (tokens, k, dim) = (16384usize, 8usize, 1024usize);
    let filled = |len: usize, dtype: DType, v: f32| {
        let mut t = be.zeros_of(&[len + 4], dtype, Category::Buffers);
        be.fill(t.view_mut(), v);
        t
    };
    // Median ms of 5 calls after one.
    let time = |f: &mut dyn FnMut()| {
        f();
        let mut ms: Vec<f64> = (0..5)
            .map(|_| {
                let a = be.record_event(Stream::Compute);
                f();
                let b = be.record_event(Stream::Compute);
                be.elapsed(&a, &b).as_secs_f64() * 1e3
            })
            .collect();
        ms.sort_by(f64::total_cmp);
        ms[2]
    };
    let h = ganymede_core::AdamWStep::at_step(1e-3, (0.9, 0.95), 1e-8, 0.1, 10);
    // The dispatched rows: k passes over the tokens in order (each expert's rows are in token
    // order), every token read k times.
    let src: Vec<u32> = (0..tokens * k).map(|r| (r % tokens) as u32).collect();
    let src = be.upload_u32(&src, &[src.len()], Category::Buffers);
    let mut md = String::from(
        "| kernel | elements | bytes moved | 4-wide ms | GB/s | scalar ms | GB/s | 4-wide / scalar |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    let mut bad = Vec::new();
    // (name, elements, bytes moved per element, op(offset, shifted set, read a sample back))
    type Op<'a> = Box<dyn FnMut(usize, bool, bool) -> Option<Vec<f32>> + 'a>;
    // The first 2^20 outputs in f32.
    let sample = |t: &Tensor, o: usize| {
        let view = t.slice(o, 1 << 20);
        if view.dtype() != DType::BF16 {
            return be.download(view);
        }
        let mut w = be.zeros(&[1 << 20], Category::Buffers);
        be.cast(w.view_mut(), view);
        be.download(w.view())
    };
    let (mut p, mut m, mut v, g) = (
        [filled(n, DType::F32, 0.5), filled(n, DType::F32, 0.5)],
        [filled(n, DType::F32, 0.01), filled(n, DType::F32, 0.01)],
        [filled(n, DType::F32, 0.25), filled(n, DType::F32, 0.25)],
        filled(n, DType::F32, 0.1),
    );
    let x32 = filled(n, DType::F32, 1.25);
    let mut y16 = [filled(n, DType::BF16, 0.0), filled(n, DType::BF16, 0.0)];
    let mut z16 = [filled(n, DType::BF16, 0.0), filled(n, DType::BF16, 0.0)];
    let mut y32 = [filled(n, DType::F32, 1.0), filled(n, DType::F32, 1.0)];
    let (gate, upv) = (filled(n, DType::BF16, 0.75), filled(n, DType::BF16, -0.5));
    let tok = filled(tokens * dim, DType::F32, 0.375);
    let mut rows = [
        filled(tokens * k * dim, DType::BF16, 0.0),
        filled(tokens * k * dim, DType::BF16, 0.0),
    ];
    let mut acc = be.zeros_of(&[1], DType::F64, Category::Buffers);
    let ops: Vec<(&str, usize, usize, Op)> = vec![
        (
            "adamw_step_f32",
            n,
            28,
            Box::new(|o, s, read| {
                let i = s as usize;
                ops.adamw_step(
                    p[i].slice_mut(o, n),
                    m[i].slice_mut(o, n),
                    v[i].slice_mut(o, n),
                    g.slice(o, n),
                    &h,
                    None,
                );
                read.then(|| sample(&p[i], o))
            }),
        ),
        (
            "cast_f32_to_bf16",
            n,
            6,
            Box::new(|o, s, read| {
                let i = s as usize;
                be.cast(y16[i].slice_mut(o, n), x32.slice(o, n));
                read.then(|| sample(&y16[i], o))
            }),
        ),
        (
            "add_f32",
            n,
            12,
            Box::new(|o, s, read| {
                let i = s as usize;
                be.add(y32[i].slice_mut(o, n), x32.slice(o, n));
                read.then(|| sample(&y32[i], o))
            }),
        ),
        (
            "swiglu_forward_bf16",
            n,
            6,
            Box::new(|o, s, read| {
                let i = s as usize;
                ops.swiglu_forward(z16[i].slice_mut(o, n), gate.slice(o, n), upv.slice(o, n));
                read.then(|| sample(&z16[i], o))
            }),
        ),
        (
            "sumsq_partial_f32",
            n,
            4,
            Box::new(|o, _, read| {
                be.fill(acc.view_mut(), 0.0);
                be.sumsq_acc(acc.view_mut(), x32.slice(o, n));
                read.then(|| vec![be.download_f64(acc.view())[0] as f32])
            }),
        ),
        (
            "moe_gather_f32_to_bf16 (rows of 1,024)",
            tokens * k * dim,
            6,
            Box::new(|o, s, read| {
                let i = s as usize;
                ops.moe_gather(
                    rows[i].slice_mut(o, tokens * k * dim),
                    tok.slice(o, tokens * dim),
                    src.view(),
                    dim,
                );
                read.then(|| sample(&rows[i], o))
            }),
        ),
    ];
    for (name, len, per, mut op) in ops {
        let mut run = |o: usize, shifted: bool| {
            let ms = time(&mut || {
                op(o, shifted, false);
            });
            (ms, op(o, shifted, true).unwrap_or_default())
        };
        let (wide_ms, wide) = run(0, false);
        let (scalar_ms, scalar) = run(1, true);
        let gbs = |ms: f64| (len * per) as f64 / (ms * 1e-3) / 1e9;
        let _ = writeln!(
            md,
            "| {name} | {len} | {per} B each | {wide_ms:.3} | {:.0} | {scalar_ms:.3} | {:.0} | {:.2}x |",
            gbs(wide_ms),
            gbs(scalar_ms),
            scalar_ms / wide_ms
        );
        let err = rel_err(&wide, &scalar);
        if err.is_nan() || err > 1e-5 {
            bad.push(format!("{name}: the two paths differ by {err:e}"));
        }
    }
    let _ = writeln!(
        md,
        "\nThe 4-wide path is the kernel on 16-byte-aligned views, the scalar path the same \
         kernel on views 1 element further (other tensors, as many calls); a sample of 2^20 \
         outputs of each (sumsq: the sum) must agree within 1e-5 relative."
    );
    if bad.is_empty() {
        Ok(md)
    } else {
        Err(format!("{md}\n{}", bad.join("; ")))
    }
}
