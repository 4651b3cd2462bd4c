//! The two-memory mode: data through the copy threads bit for bit, out-of-memory errors, the
//! ledger per device, event ordering between copy streams, and the checking mode catching the
//! missing (or misplaced) wait that would read stale data on a GPU.

use super::DEVICE;
use crate::backend::{Blas, Memory};
use crate::ledger::{Category, Device, Ledger};
use crate::stream::{MemoryError, Stream};
use crate::tensor::Tensor;
use crate::{CpuBackend, TwoMemoryOptions};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

fn backend(capacity: Option<u64>, checking: bool) -> CpuBackend {
    CpuBackend::two_memory(
        Arc::new(Ledger::new()),
        TwoMemoryOptions {
            device_capacity: capacity,
            checking,
        },
    )
}

/// Awkward bit patterns (NaN payloads, -0, subnormals, infinities) and a hash-like fill, so any
/// conversion or misplaced range shows.
fn data(n: usize, seed: u32) -> Vec<f32> {
    let special = [
        0x7fc0_1234,
        0x8000_0000,
        0x0000_0001,
        0xff80_0000,
        0x7f80_0001,
    ];
    let mut x = seed.wrapping_mul(2_654_435_761) | 1;
    (0..n)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            f32::from_bits(if i < special.len() { special[i] } else { x })
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn panic_text(f: impl FnOnce()) -> String {
    let err = catch_unwind(AssertUnwindSafe(f)).expect_err("expected a panic");
    err.downcast_ref::<String>()
        .cloned()
        .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

#[test]
fn two_memory_round_trip_is_bitwise() {
    let be = backend(None, true);
    let n = 1 << 20;
    let src = data(n, 1);
    let dev = be.upload(&src, &[n], Category::Activations);
    assert_eq!(dev.device(), DEVICE);
    let mut host = be.pinned_zeros(&[n], Category::Activations);
    assert_eq!(host.device(), Device::Host);

    // Offload in two halves (views at offsets), then read it on the host.
    let h = n / 2;
    be.copy_async(host.slice_mut(0, h), dev.slice(0, h), Stream::ToHost);
    be.copy_async(
        host.slice_mut(h, n - h),
        dev.slice(h, n - h),
        Stream::ToHost,
    );
    let offloaded = be.record_event(Stream::ToHost);
    be.synchronize_event(&offloaded);
    assert!(be.query_event(&offloaded));
    assert_eq!(bits(&be.download(host.view())), bits(&src));

    // Prefetch back into fresh device memory, then a kernel on the compute stream uses it.
    let mut back = be.zeros(&[n], Category::Activations);
    be.copy_async(back.view_mut(), host.view(), Stream::FromHost);
    let prefetched = be.record_event(Stream::FromHost);
    be.wait_event(Stream::Compute, &prefetched);
    assert_eq!(bits(&be.download(back.view())), bits(&src));
    let mut acc = be.upload(&vec![1.0; n], &[n], Category::Buffers);
    let small = data(n, 2)
        .iter()
        .map(|x| (x.to_bits() % 1000) as f32)
        .collect::<Vec<_>>();
    be.write(back.view_mut(), &small);
    be.axpy(acc.view_mut(), 2.0, back.view());
    let want: Vec<f32> = small.iter().map(|x| 1.0 + 2.0 * x).collect();
    assert_eq!(bits(&be.download(acc.view())), bits(&want));
}

#[test]
fn two_memory_oom_names_category_and_bytes() {
    let be = backend(Some(4096), false);
    let a = be.zeros(&[512], Category::Params); // 2048 bytes
    let err = be
        .try_zeros(&[600], Category::Activations)
        .expect_err("2048 + 2400 > 4096");
    assert_eq!(
        err,
        MemoryError::OutOfMemory {
            device: DEVICE,
            category: Category::Activations,
            requested: 2400,
            in_use: 2048,
            capacity: 4096,
        }
    );
    let text = err.to_string();
    for part in [
        "gpu0",
        "activations",
        "2400 bytes",
        "2048 of 4096",
        "2048 free",
    ] {
        assert!(text.contains(part), "{part:?} missing from {text:?}");
    }
    // The infallible path panics with the same message; nothing was charged by the failures.
    assert_eq!(
        panic_text(|| drop(be.zeros(&[600], Category::Activations))),
        text
    );
    assert_eq!(be.ledger().in_use(DEVICE), 2048);
    // Exactly full is fine; pinned host memory is not held to the device's capacity.
    let b = be.try_zeros(&[512], Category::Grads).expect("fits exactly");
    let pinned = be.pinned_zeros(&[4096], Category::Optimizer);
    let r = be.ledger().report();
    assert_eq!(r.current(DEVICE, Category::Params), 2048);
    assert_eq!(r.current(DEVICE, Category::Grads), 2048);
    assert_eq!(r.current(Device::Host, Category::Optimizer), 16384);
    assert_eq!(r.current(Device::Host, Category::Params), 0);
    drop((a, b, pinned));
    assert_eq!(be.ledger().in_use(DEVICE), 0);
    assert_eq!(be.ledger().in_use(Device::Host), 0);
}

/// One offload + prefetch step on buffers made beforehand.
fn offload_step(be: &CpuBackend, act: &mut Tensor, host: &mut Tensor, seed: u32) -> Vec<f32> {
    let x = data(act.len(), seed);
    be.write(act.view_mut(), &x);
    // Offload after the compute stream's write, then reuse the device buffer after the copy.
    let written = be.record_event(Stream::Compute);
    be.wait_event(Stream::ToHost, &written);
    be.copy_async(host.view_mut(), act.view(), Stream::ToHost);
    let out = be.record_event(Stream::ToHost);
    be.wait_event(Stream::Compute, &out);
    be.fill(act.view_mut(), 0.0);
    let cleared = be.record_event(Stream::Compute);
    be.wait_event(Stream::FromHost, &cleared);
    be.wait_event(Stream::FromHost, &out);
    be.copy_async(act.view_mut(), host.view(), Stream::FromHost);
    let back = be.record_event(Stream::FromHost);
    be.wait_event(Stream::Compute, &back);
    be.download(act.view())
}

#[test]
fn two_memory_steady_step_allocates_nothing() {
    let be = backend(Some(1 << 20), true);
    let mut act = be.zeros(&[4096], Category::Activations);
    let mut host = be.pinned_zeros(&[4096], Category::Activations);
    let l = be.ledger().clone();
    assert_eq!(
        (l.alloc_count_on(DEVICE), l.alloc_count_on(Device::Host)),
        (1, 1)
    );
    for step in 0..3 {
        l.mark_window();
        let got = offload_step(&be, &mut act, &mut host, step);
        assert_eq!(bits(&got), bits(&data(4096, step)), "step {step}");
        assert_eq!(l.window_alloc_count(), 0, "step {step} allocated");
    }
    let _extra = be.zeros(&[1], Category::Buffers);
    assert_eq!((l.window_alloc_count(), l.alloc_count()), (1, 3));
}

#[test]
fn events_order_two_copy_streams() {
    // The to-host stream first copies a large unrelated buffer, so its copy into `host` runs
    // well after the from-host stream is ready: only the event wait keeps the from-host copy
    // from reading `host` before it is written (a wait that orders nothing gives zeros). The
    // checked run below catches the missing wait deterministically as well.
    let be = backend(None, true);
    let n = 1 << 20;
    let src = data(n, 3);
    let dev = be.upload(&src, &[n], Category::Activations);
    let big = be.upload(&vec![1.0; 8 * n], &[8 * n], Category::Buffers);
    let mut big_host = be.pinned_zeros(&[8 * n], Category::Buffers);
    let mut host = be.pinned_zeros(&[n], Category::Activations);
    let mut back = be.zeros(&[n], Category::Activations);
    let start = be.record_event(Stream::ToHost);
    be.copy_async(big_host.view_mut(), big.view(), Stream::ToHost);
    be.copy_async(host.view_mut(), dev.view(), Stream::ToHost);
    let out = be.record_event(Stream::ToHost);
    be.wait_event(Stream::FromHost, &out);
    be.copy_async(back.view_mut(), host.view(), Stream::FromHost);
    let done = be.record_event(Stream::FromHost);
    be.wait_event(Stream::Compute, &done);
    assert_eq!(bits(&be.download(back.view())), bits(&src));
    // Events report completion and the time between them.
    be.synchronize_event(&done);
    assert!(be.query_event(&start) && be.query_event(&out));
    let t = be.elapsed(&start, &done);
    assert!(t >= be.elapsed(&start, &out), "{t:?}");

    // The same chain with the from-host stream not waiting for the offload.
    let mut again = be.zeros(&[n], Category::Activations);
    let mut host2 = be.pinned_zeros(&[n], Category::Activations);
    be.copy_async(host2.view_mut(), dev.view(), Stream::ToHost);
    let msg = panic_text(|| be.copy_async(again.view_mut(), host2.view(), Stream::FromHost));
    for part in [
        "an async copy (the from-host stream) reads host activations",
        "4194304 bytes",
        "the to-host stream's write",
    ] {
        assert!(msg.contains(part), "{part:?} missing from {msg:?}");
    }
    be.synchronize();
}

#[test]
fn checking_catches_missing_wait() {
    let be = backend(None, true);
    let n = 1 << 16;
    let src = data(n, 4);
    let state = be.upload(&src, &[n], Category::Optimizer);
    let mut host = be.pinned_zeros(&[n], Category::Optimizer);

    // Offloaded optimizer state read on the host before the copy's event was synchronized.
    be.copy_async(host.view_mut(), state.view(), Stream::ToHost);
    let msg = panic_text(|| drop(be.download(host.view())));
    for part in [
        "CPU code (the host) reads host optimizer buffer (f32 x 65536, 262144 bytes)",
        "the to-host stream's write of it",
    ] {
        assert!(msg.contains(part), "{part:?} missing from {msg:?}");
    }
    // Waiting on the compute stream does not order the host: still caught.
    let e = be.record_event(Stream::ToHost);
    be.wait_event(Stream::Compute, &e);
    assert!(catch_unwind(AssertUnwindSafe(|| be.download(host.view()))).is_err());
    be.synchronize_event(&e);
    assert_eq!(bits(&be.download(host.view())), bits(&src));

    // A prefetch read by a kernel before the compute stream waited for it.
    let mut dev = be.zeros(&[n], Category::Activations);
    be.copy_async(dev.view_mut(), host.view(), Stream::FromHost);
    let msg = panic_text(|| be.scale(dev.view_mut(), 2.0));
    for part in [
        "a kernel or transfer (the compute stream) writes gpu0 activations buffer",
        "262144 bytes",
        "the from-host stream's write of it",
    ] {
        assert!(msg.contains(part), "{part:?} missing from {msg:?}");
    }
    let e = be.record_event(Stream::FromHost);
    be.wait_event(Stream::Compute, &e);
    assert_eq!(bits(&be.download(dev.view())), bits(&src));
}

#[test]
fn checking_catches_wait_on_earlier_event() {
    let be = backend(None, true);
    let n = 1 << 16;
    let src = data(n, 5);
    let mut host = be.pinned_zeros(&[n], Category::Activations);
    be.write(host.view_mut(), &src); // CPU code filling pinned memory: ordered before later copies
    let mut dev = be.zeros(&[n], Category::Activations);
    let before = be.record_event(Stream::FromHost);
    be.copy_async(dev.view_mut(), host.view(), Stream::FromHost);
    be.wait_event(Stream::Compute, &before);
    let msg = panic_text(|| {
        be.sumsq(dev.view());
    });
    assert!(
        msg.contains("the compute stream) reads gpu0 activations buffer")
            && msg.contains("the from-host stream's write"),
        "{msg}"
    );
    let after = be.record_event(Stream::FromHost);
    be.wait_event(Stream::Compute, &after);
    assert_eq!(bits(&be.download(dev.view())), bits(&src));
}

#[test]
fn checking_catches_overwrite_during_offload() {
    // Write-after-read: reusing a device buffer while its offload may still be reading it.
    let be = backend(None, true);
    let n = 1 << 16;
    let mut act = be.upload(&data(n, 6), &[n], Category::Activations);
    let mut host = be.pinned_zeros(&[n], Category::Activations);
    be.copy_async(host.view_mut(), act.view(), Stream::ToHost);
    let msg = panic_text(|| be.fill(act.view_mut(), 0.0));
    assert!(
        msg.contains("while the to-host stream's read of it"),
        "{msg}"
    );
    // An offload that does not wait for the kernel that wrote its source is caught too.
    let mut w = be.upload(&data(n, 7), &[n], Category::Activations);
    be.scale(w.view_mut(), 1.0);
    let msg = panic_text(|| be.copy_async(host.view_mut(), w.view(), Stream::ToHost));
    assert!(
        msg.contains("reads gpu0 activations") && msg.contains("the compute stream's write"),
        "{msg}"
    );
    be.synchronize();
}

#[test]
fn dropping_a_copy_source_in_flight_is_safe() {
    // Stream-ordered free: the backend, not the caller, keeps freed memory from reuse until
    // the copies that use it are done. The ledger frees the bytes at once.
    let be = backend(None, true);
    let n = 1 << 20;
    let src = data(n, 10);
    let act = be.upload(&src, &[n], Category::Activations);
    let mut host = be.pinned_zeros(&[n], Category::Activations);
    be.copy_async(host.view_mut(), act.view(), Stream::ToHost);
    drop(act);
    assert_eq!(be.ledger().in_use(DEVICE), 0);
    let e = be.record_event(Stream::ToHost);
    be.synchronize_event(&e);
    assert_eq!(bits(&be.download(host.view())), bits(&src));
}

#[test]
fn unchecked_mode_stays_memory_safe() {
    // Without checking, a missing wait is not reported, but the emulation waits for the copy
    // rather than racing with it, so the data is whole.
    let be = backend(None, false);
    let n = 1 << 20;
    let src = data(n, 8);
    let dev = be.upload(&src, &[n], Category::Activations);
    let mut host = be.pinned_zeros(&[n], Category::Activations);
    be.copy_async(host.view_mut(), dev.view(), Stream::ToHost);
    assert_eq!(bits(&be.download(host.view())), bits(&src));
}

#[test]
fn plain_backend_stream_api_completes_at_once() {
    let be = CpuBackend::new(Arc::new(Ledger::new()));
    let src = data(1000, 9);
    let a = be.upload(&src, &[1000], Category::Params);
    let mut b = be.pinned_zeros(&[1000], Category::Params);
    assert_eq!(b.device(), Device::Host);
    let e0 = be.record_event(Stream::Compute);
    be.copy_async(b.view_mut(), a.view(), Stream::ToHost);
    let e1 = be.record_event(Stream::ToHost);
    be.wait_event(Stream::Compute, &e1);
    be.synchronize_event(&e1);
    assert!(be.query_event(&e1));
    assert!(be.elapsed(&e0, &e1) < std::time::Duration::from_secs(5));
    assert_eq!(bits(&be.download(b.view())), bits(&src));
    assert!(be.try_zeros(&[1 << 10], Category::Buffers).is_ok());
}

#[test]
fn f64_accumulators_live_on_the_device_and_sum_like_the_host_read() {
    // An f32 backend's step scalars: f64 tensors on the device, read once at the end.
    let be = backend(None, true);
    let xs: Vec<Tensor> = (0..3)
        .map(|i| {
            let v: Vec<f32> = (0..1000).map(|j| ((i * 1000 + j) as f32).sin()).collect();
            be.upload(&v, &[v.len()], Category::Grads)
        })
        .collect();
    let mut acc = be.zeros_of(&[1], crate::DType::F64, Category::Buffers);
    assert_eq!(acc.bytes(), 8);
    for x in &xs {
        be.sumsq_acc(acc.view_mut(), x.view());
    }
    let want: f64 = xs.iter().map(|x| be.sumsq(x.view())).sum();
    assert_eq!(be.download_f64(acc.view())[0], want);
    let r = be.ledger().report();
    assert_eq!(r.peak(DEVICE, Category::Buffers), 8);
}
