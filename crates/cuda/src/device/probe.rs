//! Whether this machine can run the CUDA backend, asked before cudarc touches a library: cudarc
//! panics when a library it needs is missing, and a user should see one line naming it instead.

/// Why the CUDA backend cannot run here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProbeError {
    /// A shared library is not loadable (`library`: the name looked for, `role`: what it is).
    MissingLibrary {
        library: &'static str,
        role: &'static str,
        hint: &'static str,
    },
    /// The driver is there but `cuInit` failed (no device node, a driver/library mismatch).
    Driver(String),
    /// The driver works and sees no GPU.
    NoDevice,
    /// The driver is older than the CUDA 13 libraries need (`found`: its CUDA version as
    /// `cuDriverGetVersion` gives it, 12040 for 12.4).
    DriverTooOld { found: i32 },
}

/// The oldest driver API the backend runs on: the CUDA 13 libraries (cuBLAS, NVRTC's CUBINs)
/// and the driver entry points cudarc's `cuda-13000` bindings call.
pub const MIN_DRIVER_VERSION: i32 = 13000;

/// `cuDriverGetVersion`'s encoding (1000 × major + 10 × minor) as "major.minor".
fn cuda_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

impl std::fmt::Display for ProbeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProbeError::MissingLibrary {
                library,
                role,
                hint,
            } => write!(
                f,
                "no CUDA on this machine: {library} ({role}) not found; {hint}"
            ),
            ProbeError::Driver(e) => write!(f, "the CUDA driver failed to start: {e}"),
            ProbeError::NoDevice => write!(f, "the CUDA driver found no GPU on this machine"),
            ProbeError::DriverTooOld { found } => write!(
                f,
                "the NVIDIA driver supports CUDA {}, and the CUDA backend needs {} or later \
                 (its libraries are CUDA 13's): update the driver (580 or later)",
                cuda_version(*found),
                cuda_version(MIN_DRIVER_VERSION)
            ),
        }
    }
}

impl std::error::Error for ProbeError {}

const WHEELS: &str = "put the CUDA 13 libraries' folder (a Python venv's nvidia/cu13/lib) on \
                      LD_LIBRARY_PATH";

/// NVRTC alone: enough to compile kernels, on a machine without a GPU too (CI).
pub fn probe_nvrtc() -> Result<(), ProbeError> {
    // SAFETY: loading NVIDIA's library runs only its own initialisers; cudarc would load the
    // same library on first use.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(ProbeError::MissingLibrary {
            library: "libnvrtc.so.13",
            role: "NVRTC, the run-time CUDA C compiler",
            hint: WHEELS,
        })
    }
}

/// The driver, NVRTC and cuBLAS are loadable, the driver starts and sees a GPU: the number of
/// GPUs. Checked in that order, so the first thing missing is the one named.
pub fn probe() -> Result<usize, ProbeError> {
    // SAFETY: as in `probe_nvrtc`.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(ProbeError::MissingLibrary {
            library: "libcuda.so",
            role: "the NVIDIA driver's library",
            hint: "this needs a machine with an NVIDIA GPU and its driver installed",
        });
    }
    probe_nvrtc()?;
    // SAFETY: as above.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(ProbeError::MissingLibrary {
            library: "libcublas.so.13",
            role: "cuBLAS",
            hint: WHEELS,
        });
    }
    cudarc::driver::result::init().map_err(|e| ProbeError::Driver(driver_error(&e)))?;
    // Before any call that an older driver lacks (cudarc panics at a missing entry point).
    let mut version = 0;
    // SAFETY: an out-parameter; the entry point exists in every driver.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| ProbeError::Driver(driver_error(&e)))?;
    if version < MIN_DRIVER_VERSION {
        return Err(ProbeError::DriverTooOld { found: version });
    }
    let n = cudarc::driver::result::device::get_count()
        .map_err(|e| ProbeError::Driver(driver_error(&e)))?;
    if n <= 0 {
        return Err(ProbeError::NoDevice);
    }
    Ok(n as usize)
}

/// A driver error as its name and description (`CUDA_ERROR_NO_DEVICE: no CUDA-capable device
/// is detected`), falling back to the code.
pub fn driver_error(e: &cudarc::driver::DriverError) -> String {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned());
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned());
    match (name, text) {
        (Ok(n), Ok(t)) => format!("{n}: {t}"),
        _ => format!("{:?}", e.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_old_driver_is_named_with_its_cuda_version() {
        let line = ProbeError::DriverTooOld { found: 12040 }.to_string();
        assert!(
            line.contains("supports CUDA 12.4") && line.contains("needs 13.0 or later"),
            "{line}"
        );
        assert_eq!(cuda_version(12080), "12.8");
        assert_eq!(cuda_version(13010), "13.1");
    }

    /// On a machine without a driver (CI, the build machine) the probe answers with an error,
    /// it does not panic; with one, it finds at least one GPU. Either way the message is one line.
    #[test]
    fn probe_answers_without_panicking() {
        let r = std::panic::catch_unwind(probe).expect("the probe panicked");
        match r {
            Ok(n) => assert!(n >= 1),
            Err(e) => {
                let line = e.to_string();
                assert!(!line.contains('\n'), "{line}");
                assert!(line.contains("CUDA") || line.contains("GPU"), "{line}");
                // Without the driver's library, that is the one named.
                if !unsafe { cudarc::driver::sys::is_culib_present() } {
                    assert!(line.contains("libcuda.so"), "{line}");
                }
            }
        }
    }
}
