//! The host build's bounds check: under [`Bounds::Guarded`], a launch through
//! [`crate::launch::HostLauncher`] runs on copies of its arguments' memory, each placed against
//! an inaccessible page, so a kernel that reads or writes past what it was given faults (the
//! shim then names the kernel) instead of quietly touching a neighbour, as on a GPU it would
//! touch another tensor or fault the whole context.
//!
//! What a kernel was given is what the ops layer took the address of: a view
//! ([`crate::launch::Launcher::addr`]) or a scratch region ([`crate::launch::Launcher::mark`]).
//! Each copy keeps its original's address modulo 16, so the kernels take the same wide or
//! narrow paths. The few bytes between a copy's end and the next page (under 16), and the rest
//! of the page before its start, hold a canary that must still be there after the launch (a
//! write past either end fails the check; a read there brings NaN into the output). The canary
//! is a signalling NaN as f32 and as either bf16 half, different for each copy, so that
//! arithmetic on a canary (which quietens it) or a copy of another region's canary is seen as
//! a write. A region the kernel was given only to read must come back unchanged. A scratch
//! region starts as NaN bytes when it is handed out, as on a device it would hold whatever the
//! last op left.

use crate::host::{self, Arg, LaunchConfig};
use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

/// Whether launches from this thread check their bounds (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bounds {
    Unchecked,
    Guarded,
}

thread_local! {
    static GUARDED: Cell<bool> = const { Cell::new(false) };
}

extern "C" {
    fn gany_host_report_faults();
}

/// Sets the bounds check for launches from this thread.
pub fn set_bounds(b: Bounds) {
    if b == Bounds::Guarded {
        // Safety: installs a signal handler once per process.
        unsafe { gany_host_report_faults() }
    }
    GUARDED.with(|g| g.set(b == Bounds::Guarded));
}

pub fn guarded() -> bool {
    GUARDED.with(Cell::get)
}

/// What the ops layer handed out: start address → (bytes, ever handed out for writing). The
/// latest extent at an address wins (memory is reused); recorded only while guarded.
#[derive(Default)]
pub struct Regions(Mutex<HashMap<usize, (usize, bool)>>);

impl Regions {
    pub fn note(&self, addr: *mut c_void, bytes: usize, write: bool) {
        if !guarded() {
            return;
        }
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let e = m.entry(addr as usize).or_insert((bytes, write));
        if e.0 != bytes {
            *e = (bytes, write);
        } else {
            e.1 |= write;
        }
    }

    /// A scratch region handed out: noted as writable, and filled with NaN bytes, as what an
    /// earlier op left there would be anything on a device (a kernel that reads scratch it did
    /// not write, or counts on a fresh pool's zeros, then fails its test).
    ///
    /// # Safety
    /// `addr` must be valid for `bytes` bytes of writes.
    pub unsafe fn scratch(&self, addr: *mut c_void, bytes: usize) {
        if guarded() {
            std::ptr::write_bytes(addr as *mut u8, 0xff, bytes);
            self.note(addr, bytes, true);
        }
    }

    /// Launches `name` on guarded copies of its pointer arguments' regions, then checks the
    /// guards and copies what the kernel wrote back.
    ///
    /// # Safety
    /// As [`host::launch`], with every pointer argument an address noted here (null excepted).
    pub unsafe fn launch(&self, name: &str, cfg: LaunchConfig, args: &[Arg]) {
        let k = host::resolve(name).unwrap_or_else(|| panic!("no kernel named {name}"));
        self.launch_resolved(&k, cfg, args)
    }

    /// [`Self::launch`] of a kernel found before.
    ///
    /// # Safety
    /// As [`Self::launch`].
    pub unsafe fn launch_resolved(&self, k: &host::HostKernel, cfg: LaunchConfig, args: &[Arg]) {
        let name = k.name();
        // (start, end, writable) per pointer argument, then merged where they overlap, so
        // aliases (an op in place) stay aliases.
        let mut spans: Vec<(usize, usize, bool)> = Vec::new();
        {
            let m = self.0.lock().unwrap_or_else(|e| e.into_inner());
            for (i, a) in args.iter().enumerate() {
                if let Arg::Ptr(p) = a {
                    if p.is_null() {
                        continue;
                    }
                    let &(bytes, write) = m.get(&(*p as usize)).unwrap_or_else(|| {
                        panic!(
                            "kernel {name}: argument {i} ({p:?}) is not the address of a view \
                             or a scratch region (bounds check)"
                        )
                    });
                    spans.push((*p as usize, *p as usize + bytes, write));
                }
            }
        }
        spans.sort_unstable();
        let mut merged: Vec<(usize, usize, bool)> = Vec::new();
        for (s, e, w) in spans {
            match merged.last_mut() {
                Some(last) if s < last.1 || (s == last.0 && s == e) => {
                    last.1 = last.1.max(e);
                    last.2 |= w;
                }
                _ => merged.push((s, e, w)),
            }
        }
        let copies: Vec<Guarded> = merged
            .iter()
            .map(|&(s, e, w)| Guarded::new(s, e - s, w))
            .collect();
        let moved: Vec<Arg> = args
            .iter()
            .map(|a| match *a {
                Arg::Ptr(p) if !p.is_null() => {
                    let c = copies
                        .iter()
                        .rev()
                        .find(|c| c.orig <= p as usize && (p as usize) <= c.orig + c.bytes)
                        .expect("every argument's span was copied");
                    Arg::Ptr((c.data + (p as usize - c.orig)) as *mut c_void)
                }
                other => other,
            })
            .collect();
        host::launch_resolved(k, cfg, &moved);
        for c in &copies {
            c.finish(name);
        }
    }
}

/// A copy of `bytes` at `orig`, ending just before an inaccessible page (see the module docs).
struct Guarded {
    orig: usize,
    bytes: usize,
    writable: bool,
    map: *mut c_void,
    map_len: usize,
    page: usize,
    data: usize,
    canary: u32,
}

/// The canary word of the next copy: two bf16 signalling NaNs (`0xff80 | m`, m in 1..64,
/// the quiet bit clear), which read together as an f32 signalling NaN; a different pair each
/// time.
fn next_canary() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let k = NEXT.fetch_add(1, Ordering::Relaxed);
    let half = |m: u32| 0xff80 | (1 + m % 63);
    (half(k / 63) << 16) | half(k)
}

/// The canary's byte at `addr` (the word repeats from 4-aligned addresses, so each f32 and
/// bf16 element reads a whole NaN).
fn canary_byte(word: u32, addr: usize) -> u8 {
    word.to_le_bytes()[addr % 4]
}

impl Guarded {
    fn new(orig: usize, bytes: usize, writable: bool) -> Self {
        // Safety: sysconf and an anonymous private mapping we own; the copy stays inside it.
        unsafe {
            let page = libc::sysconf(libc::_SC_PAGESIZE) as usize;
            // Bytes past the end so the copy keeps the original's address modulo 16.
            let gap = (16 - (orig + bytes) % 16) % 16;
            let inner = (bytes + gap).div_ceil(page).max(1) * page;
            let map_len = inner + 2 * page;
            let map = libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(
                map,
                libc::MAP_FAILED,
                "bounds check: mmap of {map_len} bytes"
            );
            let base = map as usize;
            let canary = next_canary();
            // Page-aligned, so the words land on 4-aligned addresses.
            let words = std::slice::from_raw_parts_mut((base + page) as *mut u32, inner / 4);
            words.fill(canary);
            for at in [base, base + page + inner] {
                let rc = libc::mprotect(at as *mut c_void, page, libc::PROT_NONE);
                assert_eq!(rc, 0, "bounds check: mprotect");
            }
            let data = base + page + inner - gap - bytes;
            std::ptr::copy_nonoverlapping(orig as *const u8, data as *mut u8, bytes);
            Guarded {
                orig,
                bytes,
                writable,
                map,
                map_len,
                page,
                data,
                canary,
            }
        }
    }

    /// Checks the NaN bytes around the copy, then copies it back (or requires it unchanged).
    fn finish(&self, kernel: &str) {
        let base = self.map as usize;
        let (lo, hi) = (base + self.page, base + self.map_len - self.page);
        // Safety: [lo, hi) is the accessible part of our mapping; `orig` is valid for `bytes`
        // (the launch's contract).
        unsafe {
            let before = std::slice::from_raw_parts(lo as *const u8, self.data - lo);
            let after = std::slice::from_raw_parts(
                (self.data + self.bytes) as *const u8,
                hi - self.data - self.bytes,
            );
            // Whether byte `i` of `bytes`, which start at address `at`, lost its canary.
            let spoiled =
                |bytes: &[u8], at: usize, i: usize| bytes[i] != canary_byte(self.canary, at + i);
            if let Some(k) = (0..before.len()).rev().position(|i| spoiled(before, lo, i)) {
                panic!(
                    "kernel {kernel}: wrote {} bytes before the region of {} bytes at {:#x} \
                     (bounds check)",
                    k + 1,
                    self.bytes,
                    self.orig
                );
            }
            let end = self.data + self.bytes;
            if let Some(k) = (0..after.len()).position(|i| spoiled(after, end, i)) {
                panic!(
                    "kernel {kernel}: wrote at byte {} past the end of the region of {} bytes \
                     at {:#x} (bounds check)",
                    k, self.bytes, self.orig
                );
            }
            let copy = std::slice::from_raw_parts(self.data as *const u8, self.bytes);
            let orig = std::slice::from_raw_parts(self.orig as *const u8, self.bytes);
            if copy != orig {
                assert!(
                    self.writable,
                    "kernel {kernel}: wrote into the {} bytes at {:#x}, which it was given to \
                     read (bounds check)",
                    self.bytes, self.orig
                );
                std::ptr::copy_nonoverlapping(copy.as_ptr(), self.orig as *mut u8, self.bytes);
            }
        }
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        // Safety: our own mapping, no longer used.
        unsafe {
            libc::munmap(self.map, self.map_len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EW: LaunchConfig = LaunchConfig {
        grid: [2, 1, 1],
        block: [32, 1, 1],
        shared: 0,
    };

    /// `zero_u32` over `n` words of `buf`, of which `noted` were handed out (as `write`).
    fn zero(buf: &mut [u32], noted: usize, write: bool, n: usize) {
        set_bounds(Bounds::Guarded);
        let r = Regions::default();
        let p = buf.as_mut_ptr() as *mut c_void;
        r.note(p, noted * 4, write);
        // Safety: `buf` holds `n` words; what the check lets through is the point.
        unsafe { r.launch("zero_u32", EW, &[Arg::Ptr(p), Arg::I64(n as i64)]) };
    }

    fn panic_text(f: impl FnOnce() + std::panic::UnwindSafe) -> String {
        let e = std::panic::catch_unwind(f).expect_err("the bounds check let it through");
        e.downcast_ref::<String>().cloned().unwrap_or_default()
    }

    #[test]
    fn a_launch_within_its_regions_writes_through() {
        for (len, offset) in [(37usize, 0usize), (64, 1), (1, 3), (1000, 2)] {
            let mut buf = vec![7u32; len + offset + 5];
            zero(&mut buf[offset..], len, true, len);
            let zeroed: Vec<bool> = buf.iter().map(|&x| x == 0).collect();
            let want: Vec<bool> = (0..buf.len())
                .map(|i| i >= offset && i < offset + len)
                .collect();
            assert_eq!(zeroed, want, "length {len} at offset {offset}");
        }
    }

    #[test]
    fn a_write_just_past_a_region_fails_and_leaves_memory_alone() {
        // 13 words: the copy ends 12 bytes before its guard page, so one word past the end
        // lands on the NaN bytes, not the page.
        let mut buf = vec![7u32; 16];
        let text = panic_text(std::panic::AssertUnwindSafe(|| {
            zero(&mut buf, 13, true, 14)
        }));
        assert!(
            text.contains("zero_u32: wrote at byte 0 past the end"),
            "{text}"
        );
        assert!(buf.iter().all(|&x| x == 7), "nothing was copied back");
    }

    #[test]
    fn a_write_into_a_region_given_to_read_fails() {
        let mut buf = vec![7u32; 20];
        let text = panic_text(std::panic::AssertUnwindSafe(|| {
            zero(&mut buf, 20, false, 20)
        }));
        assert!(text.contains("which it was given to read"), "{text}");
        assert!(buf.iter().all(|&x| x == 7));
    }

    #[test]
    fn an_address_nobody_handed_out_fails() {
        let mut buf = vec![7u32; 8];
        let text = panic_text(std::panic::AssertUnwindSafe(|| {
            set_bounds(Bounds::Guarded);
            let r = Regions::default();
            r.note(buf.as_mut_ptr() as *mut c_void, 32, true);
            let inner = buf[1..].as_mut_ptr() as *mut c_void;
            // Safety: as above.
            unsafe { r.launch("zero_u32", EW, &[Arg::Ptr(inner), Arg::I64(7)]) };
        }));
        assert!(text.contains("argument 0"), "{text}");
    }

    #[test]
    fn scratch_starts_as_nan_only_when_guarded() {
        let mut buf = vec![0u32; 6];
        let r = Regions::default();
        set_bounds(Bounds::Unchecked);
        // Safety: `buf` holds 24 bytes.
        unsafe { r.scratch(buf.as_mut_ptr() as *mut c_void, 24) };
        assert!(buf.iter().all(|&x| x == 0));
        set_bounds(Bounds::Guarded);
        unsafe { r.scratch(buf[1..].as_mut_ptr() as *mut c_void, 16) };
        assert_eq!(buf, [0, !0, !0, !0, !0, 0]);
        // And it was noted: a launch on it passes.
        unsafe {
            r.launch(
                "zero_u32",
                EW,
                &[Arg::Ptr(buf[1..].as_mut_ptr() as *mut c_void), Arg::I64(4)],
            )
        };
        assert_eq!(buf, [0; 6]);
    }

    #[test]
    fn aliased_arguments_stay_aliased() {
        // y += 1·x with x and y the same memory doubles it, as on a device.
        set_bounds(Bounds::Guarded);
        let r = Regions::default();
        let mut y: Vec<f32> = (0..50).map(|i| i as f32).collect();
        let p = y.as_mut_ptr() as *mut c_void;
        r.note(p, 200, true);
        r.note(p, 200, false);
        // Safety: `y` holds 50 floats.
        unsafe {
            r.launch(
                "axpy_f32",
                EW,
                &[Arg::Ptr(p), Arg::F32(1.0), Arg::Ptr(p), Arg::I64(50)],
            )
        };
        assert!(y.iter().enumerate().all(|(i, &v)| v == 2.0 * i as f32));
    }

    /// A write far past a region reaches its guard page: the process dies, and the shim names
    /// the kernel first. Run in a child process (this test binary, filtered to the one test).
    #[test]
    fn a_write_far_past_a_region_faults_and_names_the_kernel() {
        if std::env::var_os("GANYMEDE_BOUNDS_CHILD").is_some() {
            let mut buf = vec![7u32; 10_000];
            zero(&mut buf, 10, true, 10_000);
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "bounds::tests::a_write_far_past_a_region_faults_and_names_the_kernel",
                "--test-threads=1",
            ])
            .env("GANYMEDE_BOUNDS_CHILD", "1")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "the child survived: {err}");
        assert!(
            err.contains("cuda host shim: kernel zero_u32 touched 0x"),
            "{err}"
        );
    }
}
