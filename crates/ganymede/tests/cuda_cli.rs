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
