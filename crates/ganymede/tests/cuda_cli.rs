//! `device.kind = "cuda"` and `device-check` end with one clear line where CUDA cannot run:
//! a binary built without the `cuda` feature says so and how to build one; with the feature, a
//! machine without a driver names the missing library, and nothing runs on the CPU instead.
//! (These run where there is no GPU; on a GPU machine `scripts/device_check.sh` trains.)

mod util;

use util::{fails, ganymede, TempDir};

fn err_of(args: &[&str]) -> String {
    let tmp = TempDir::new("cuda");
    fails(ganymede(tmp.path(), args, &[]))
}

#[test]
fn cuda_training_is_refused_in_one_line() {
    let e = err_of(&["train", "--set", "device.kind=cuda", "--steps", "1"]);
    assert!(e.contains("device.kind = \"cuda\""), "{e}");
    if cfg!(feature = "cuda") {
        assert!(
            e.contains("not found") || e.contains("no GPU") || e.contains("failed to start"),
            "{e}"
        );
    } else {
        assert!(
            e.contains("built without CUDA") && e.contains("--features cuda"),
            "{e}"
        );
    }
}

#[test]
fn device_check_without_cuda_is_one_line() {
    let tmp = TempDir::new("cuda-check");
    let out = tmp.path().join("check");
    let o = ganymede(
        tmp.path(),
        &["device-check", "--out", out.to_str().unwrap()],
        &[],
    );
    if cfg!(feature = "cuda") && o.status.success() {
        // A machine with a GPU: the report exists.
        assert!(out.join("report.md").exists());
        return;
    }
    let e = fails(o);
    if cfg!(feature = "cuda") {
        assert!(
            e.contains("not found") || e.contains("GPU") || e.contains("failed"),
            "{e}"
        );
    } else {
        assert!(
            e.contains("device-check")
                && e.contains("built without")
                && e.contains("--features cuda"),
            "{e}"
        );
    }
}

#[test]
fn the_two_memory_knobs_are_refused_for_cuda() {
    let e = err_of(&[
        "train",
        "--set",
        "device.kind=cuda",
        "--set",
        "device.memory_gib=4",
    ]);
    assert!(
        e.contains("device.kind") && e.contains("cpu-two-memory"),
        "{e}"
    );
}

/// CUDA with thread ranks is refused up front: NCCL puts one process on each GPU.
#[test]
fn cuda_thread_ranks_are_refused_in_one_line() {
    let e = err_of(&["train", "--set", "device.kind=cuda", "--ranks", "2"]);
    assert!(
        e.contains("one process per GPU") && e.contains("--ranks"),
        "{e}"
    );
}

/// The system folders the NCCL search ends with hold no NCCL here (then the refusal must name
/// NCCL); with one there, the machine simply has it.
fn system_nccl() -> bool {
    [
        "/usr/local/cuda/lib64",
        "/usr/local/nccl/lib",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
    ]
    .iter()
    .any(|d| {
        ["libnccl.so", "libnccl.so.2"]
            .iter()
            .any(|n| std::path::Path::new(d).join(n).exists())
    })
}

/// Several processes (torchrun-style variables) with CUDA choose NCCL; where NCCL is nowhere to
/// be found the job is refused in one line that names what was searched, before anything runs.
#[test]
fn an_nccl_job_without_nccl_is_refused_in_one_line() {
    let tmp = TempDir::new("nccl-missing");
    let none = tmp.path().join("none").display().to_string();
    let home = tmp.path().display().to_string();
    let o = ganymede(
        tmp.path(),
        &["train", "--set", "device.kind=cuda", "--steps", "1"],
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("LD_LIBRARY_PATH", &none),
            ("HOME", &home),
            ("VIRTUAL_ENV", &none),
            ("NCCL_HOME", &none),
            ("CUDA_HOME", &none),
            ("CUDA_PATH", &none),
        ],
    );
    let e = fails(o);
    assert!(e.contains("device.kind = \"cuda\""), "{e}");
    if !cfg!(feature = "cuda") {
        assert!(e.contains("built without CUDA"), "{e}");
    } else if !system_nccl() {
        assert!(
            e.contains("needs NCCL: NCCL not found")
                && e.contains("libnccl.so or libnccl.so.2")
                && e.contains(&none)
                && e.contains("/usr/lib64"),
            "{e}"
        );
    }
}

/// Where NCCL is only the pip wheel's `libnccl.so.2` (ganymede's own venv on the build
/// machine), the binary links it as `libnccl.so`, restarts itself, and cudarc loads it: the
/// refusal on a machine without a driver is then the driver's, not NCCL's.
#[test]
fn the_wheels_libnccl_so_2_is_made_loadable() {
    let home = std::env::var("HOME").unwrap_or_default();
    let wheel = std::fs::read_dir(format!("{home}/.cache/ganymede/venv/lib"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("site-packages/nvidia/nccl/lib/libnccl.so.2"))
        .find(|p| p.exists());
    if !cfg!(feature = "cuda") || wheel.is_none() || system_nccl() {
        eprintln!("skipped: needs --features cuda and only the wheel's libnccl.so.2");
        return;
    }
    let tmp = TempDir::new("nccl-wheel");
    let e = fails(ganymede(
        tmp.path(),
        &["train", "--set", "device.kind=cuda", "--steps", "1"],
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
        ],
    ));
    assert!(!e.contains("NCCL"), "NCCL was not made loadable: {e}");
    assert!(e.contains("device.kind = \"cuda\""), "{e}");
}

/// A CUDA job's mesh is fitted to the launcher's world (4 processes here), not to one rank:
/// `parallelism.ep = 4` is valid there, and the refusal is CUDA's or NCCL's, not the config's.
#[test]
fn a_cuda_jobs_mesh_fits_the_launchers_world() {
    let tmp = TempDir::new("nccl-world");
    let e = fails(ganymede(
        tmp.path(),
        &[
            "train",
            "--set",
            "device.kind=cuda",
            "--set",
            "parallelism.ep=4",
            "--steps",
            "1",
        ],
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "127.0.0.1"),
        ],
    ));
    assert!(!e.contains("parallelism.ep"), "{e}");
    assert!(e.contains("device.kind = \"cuda\""), "{e}");
}
