//! Kernels by number: [`Kernel`] is a kernel of [`crate::sources::KERNELS`] (which the tests
//! hold equal to what the host build and NVRTC find), resolved from its name at compile time.
//! A launch then needs no name at all: a launcher keeps each kernel's handle in a slot of a
//! [`Resolved`] table, filled at its first launch, so a launch in the steady state formats no
//! name, looks nothing up in a map and takes no lock (issue 32: the launcher's own cost).
//!
//! An op that picks among variants (storage type, document masking, head size) names them as
//! a [`Family`]: the variants' kernels, resolved at compile time, indexed at run time.

use crate::sources::KERNELS;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// How many kernels [`crate::sources::KERNELS`] lists.
pub const COUNT: usize = count();

const fn count() -> usize {
    let (mut n, mut i) = (0, 0);
    while i < KERNELS.len() {
        n += KERNELS[i].1.len();
        i += 1;
    }
    n
}

/// Every kernel's name, by number (file order, then the order within the file).
const NAMES: [&str; COUNT] = names();

const fn names() -> [&'static str; COUNT] {
    let mut out = [""; COUNT];
    let (mut n, mut i) = (0, 0);
    while i < KERNELS.len() {
        let ks = KERNELS[i].1;
        let mut j = 0;
        while j < ks.len() {
            out[n] = ks[j];
            n += 1;
            j += 1;
        }
        i += 1;
    }
    out
}

/// Whether `name` is the concatenation of `parts`.
const fn joined_eq(name: &str, parts: &[&str]) -> bool {
    let name = name.as_bytes();
    let (mut at, mut p) = (0, 0);
    while p < parts.len() {
        let part = parts[p].as_bytes();
        let mut i = 0;
        while i < part.len() {
            if at >= name.len() || name[at] != part[i] {
                return false;
            }
            at += 1;
            i += 1;
        }
        p += 1;
    }
    at == name.len()
}

/// One kernel of [`crate::sources::KERNELS`], by its number there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Kernel(u16);

impl Kernel {
    /// The kernel named by `parts` joined, if there is one (usable at compile time).
    pub const fn find(parts: &[&str]) -> Option<Kernel> {
        let mut i = 0;
        while i < COUNT {
            if joined_eq(NAMES[i], parts) {
                return Some(Kernel(i as u16));
            }
            i += 1;
        }
        None
    }

    /// The kernel `name`; at compile time (see [`kernel!`](crate::kernel!)) a name that is
    /// not a kernel fails the build.
    pub const fn named(name: &str) -> Kernel {
        match Self::find(&[name]) {
            Some(k) => k,
            None => panic!("not a kernel of sources::KERNELS"),
        }
    }

    /// The kernel `name`, looked up at run time (tests, and launches by name).
    pub fn by_name(name: &str) -> Option<Kernel> {
        Self::find(&[name])
    }

    pub fn name(self) -> &'static str {
        NAMES[self.0 as usize]
    }

    /// Its number: `0..COUNT`.
    pub fn index(self) -> usize {
        self.0 as usize
    }

    /// Every kernel, by number.
    pub fn all() -> impl Iterator<Item = Kernel> {
        (0..COUNT).map(|i| Kernel(i as u16))
    }
}

/// The kernel named by a string literal (or const), checked at compile time.
#[macro_export]
macro_rules! kernel {
    ($name:expr) => {
        const { $crate::kernel::Kernel::named($name) }
    };
}

/// Most axes a [`Family`] has.
const AXES: usize = 8;

/// The kernels named by every choice of one string from each axis, joined in axis order (the
/// first axis most significant); a choice that names no kernel is `None`, and fails only if it
/// is launched. Built at compile time: `const F: Family<4> = Family::new(&[&["axpy_"],
/// &["f32", "bf16"], ...])`.
#[derive(Clone, Copy, Debug)]
pub struct Family<const M: usize> {
    kernels: [Option<Kernel>; M],
    /// Each axis's number of choices (1 for a fixed part).
    radix: [usize; AXES],
    axes: usize,
}

impl<const M: usize> Family<M> {
    /// `M` must be the product of the axes' lengths.
    pub const fn new(axes: &[&[&str]]) -> Self {
        assert!(axes.len() <= AXES, "too many axes");
        let mut radix = [1; AXES];
        let mut total = 1;
        let mut a = 0;
        while a < axes.len() {
            radix[a] = axes[a].len();
            total *= axes[a].len();
            a += 1;
        }
        assert!(total == M, "M is not the product of the axes' lengths");
        let mut kernels = [None; M];
        let mut i = 0;
        while i < M {
            let mut parts = [""; AXES];
            let (mut rest, mut a) = (i, axes.len());
            while a > 0 {
                a -= 1;
                parts[a] = axes[a][rest % radix[a]];
                rest /= radix[a];
            }
            kernels[i] = Kernel::find(parts.split_at(axes.len()).0);
            i += 1;
        }
        Family {
            kernels,
            radix,
            axes: axes.len(),
        }
    }

    /// The kernel of choices `at`, one for each axis of more than one choice, in order.
    pub fn get(&self, at: &[usize]) -> Kernel {
        let mut i = 0;
        let mut next = at.iter();
        for &r in &self.radix[..self.axes] {
            if r > 1 {
                let c = *next.next().expect("a choice for every varying axis");
                assert!(c < r, "choice {c} of {r}");
                i = i * r + c;
            }
        }
        assert!(next.next().is_none(), "more choices than varying axes");
        self.kernels[i].unwrap_or_else(|| panic!("no kernel for the choices {at:?}"))
    }
}

/// What a launcher keeps per kernel (a function handle on a GPU, the host build's table entry
/// on the host), each resolved from the kernel's name at its first launch and kept: later
/// launches read the slot, no lock, no map, no allocation.
pub struct Resolved<T> {
    slots: Box<[OnceLock<T>]>,
    resolutions: AtomicU64,
}

impl<T> Default for Resolved<T> {
    fn default() -> Self {
        Resolved {
            slots: (0..COUNT).map(|_| OnceLock::new()).collect(),
            resolutions: AtomicU64::new(0),
        }
    }
}

impl<T> Resolved<T> {
    /// `k`'s entry, from `resolve(name)` the first time.
    pub fn get(&self, k: Kernel, resolve: impl FnOnce(&'static str) -> T) -> &T {
        self.slots[k.index()].get_or_init(|| {
            self.resolutions.fetch_add(1, Ordering::Relaxed);
            resolve(k.name())
        })
    }

    /// How many times an entry was resolved: at most once per kernel launched, so it stays
    /// put in the steady state (what the tests hold the cache to).
    pub fn resolutions(&self) -> u64 {
        self.resolutions.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_are_numbered_in_list_order() {
        let listed: Vec<&str> = KERNELS
            .iter()
            .flat_map(|(_, ks)| ks.iter().copied())
            .collect();
        let numbered: Vec<&str> = Kernel::all().map(Kernel::name).collect();
        assert_eq!(listed, numbered);
        for k in Kernel::all() {
            assert_eq!(Kernel::by_name(k.name()), Some(k));
        }
        assert_eq!(Kernel::by_name("axpy_f6"), None);
        assert_eq!(Kernel::by_name("axpy_f32x"), None);
        assert_eq!(
            Kernel::find(&["axpy", "_", "bf16"]),
            Kernel::by_name("axpy_bf16")
        );
        const K: Kernel = kernel!("zero_u32");
        assert_eq!(K.name(), "zero_u32");
    }

    #[test]
    fn every_kernel_is_in_the_host_build_and_takes_few_enough_arguments() {
        for k in Kernel::all() {
            let h = crate::host::resolve(k.name()).expect("in the host build");
            assert_eq!(h.name(), k.name());
            assert!(
                h.signature().len() <= crate::host::MAX_ARGS,
                "{}: {} parameters",
                k.name(),
                h.signature().len()
            );
        }
    }

    #[test]
    fn a_family_indexes_its_varying_axes() {
        const F: Family<16> = Family::new(&[
            &["attention_forward_tc"],
            &["16", "32", "64", "128"],
            &["", "x2"],
            &["_"],
            &["", "doc_"],
            &["bf16"],
        ]);
        for (h, hd) in ["16", "32", "64", "128"].iter().enumerate() {
            for (d, doc) in ["", "doc_"].iter().enumerate() {
                let want = format!("attention_forward_tc{hd}_{doc}bf16");
                assert_eq!(F.get(&[h, 0, d]).name(), want);
                if h < 3 {
                    let want = format!("attention_forward_tc{hd}x2_{doc}bf16");
                    assert_eq!(F.get(&[h, 1, d]).name(), want);
                }
            }
        }
        // No wide forward at head_dim 128: an error when asked for, not another kernel.
        assert!(std::panic::catch_unwind(|| F.get(&[3, 1, 0])).is_err());
        assert!(std::panic::catch_unwind(|| F.get(&[0, 0])).is_err());
    }

    #[test]
    fn an_entry_is_resolved_once() {
        let r: Resolved<String> = Resolved::default();
        let (a, b) = (kernel!("axpy_f32"), kernel!("add_bf16"));
        assert_eq!(r.get(a, str::to_string), "axpy_f32");
        assert_eq!(r.get(a, |_| unreachable!()), "axpy_f32");
        assert_eq!(r.get(b, str::to_string), "add_bf16");
        assert_eq!(r.resolutions(), 2);
    }
}
