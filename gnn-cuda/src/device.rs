//! Finding a GPU without panicking, and choosing between it and the CPU.
//!
//! cudarc loads `libcuda`, `libnvrtc` and `libcublas` at run time (the build needs no CUDA), and its loader
//! panics when a library or a symbol is missing. Everything here checks for the library first and runs the
//! driver calls under `catch_unwind`, so a machine without a driver, without a device, or with too little
//! free memory gets a [`GpuError`] that says which, and [`select`] turns it into a CPU fallback when the job
//! allows one.
//!
//! The decision itself ([`decide`]) is a pure function of what the probe found, so every branch is tested on
//! machines without a GPU.

use std::panic::{AssertUnwindSafe, catch_unwind};

use cudarc::driver::{CudaContext, DriverError, result, sys};

/// Everything that can go wrong on the CUDA side, with what a user needs to act on it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GpuError {
    #[error(
        "no CUDA driver: libcuda could not be loaded (no NVIDIA driver on this machine, or its library is not \
         on the loader path)"
    )]
    NoDriver,
    #[error("no CUDA device {index}: the driver sees {count} device(s)")]
    NoDevice { index: usize, count: usize },
    #[error(
        "CUDA device {index} has {have_bytes} bytes free but the job needs {need_bytes} (use a larger GPU, more \
         workers, or the CPU)"
    )]
    TooLittleMemory {
        index: usize,
        need_bytes: u64,
        have_bytes: u64,
    },
    #[error(
        "the CUDA library {name} could not be loaded (install the CUDA {name} runtime, e.g. the nvidia-*-cu12 \
         wheels or the CUDA image, and put its folder on LD_LIBRARY_PATH)"
    )]
    MissingLibrary { name: &'static str },
    #[error("CUDA driver: {0}")]
    Driver(String),
    #[error("NVRTC could not compile the kernels: {0}")]
    Compile(String),
    /// The driver refused the compiled kernels (a PTX ISA newer than the driver, a cubin for another
    /// architecture): what was compiled, by which NVRTC, for which driver, and what to do.
    #[error(
        "the CUDA driver (CUDA {driver_cuda}) cannot load the kernels NVRTC {nvrtc} compiled ({image}): \
         {cause}; {advice}"
    )]
    KernelLoad {
        driver_cuda: String,
        image: String,
        nvrtc: String,
        cause: String,
        advice: String,
    },
    #[error("cuBLAS: {0}")]
    Blas(String),
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// The exchange with peers failed (partition-parallel training on the device).
    #[error("exchange with peers failed: {0}")]
    Exchange(String),
    #[error("{0}")]
    Unsupported(String),
}

impl From<physalia_gnn::DeviceError> for GpuError {
    fn from(e: physalia_gnn::DeviceError) -> Self {
        match e {
            physalia_gnn::DeviceError::Shape(s) => GpuError::Shape(s),
            physalia_gnn::DeviceError::Exchange(e) => GpuError::Exchange(e.to_string()),
            physalia_gnn::DeviceError::Unsupported(s) => GpuError::Unsupported(s),
        }
    }
}

impl From<DriverError> for GpuError {
    fn from(e: DriverError) -> Self {
        GpuError::Driver(describe(&e))
    }
}

/// `CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected`, without cudarc's `Debug` wrapping.
pub(crate) fn describe(e: &DriverError) -> String {
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    match e.error_string() {
        Ok(s) => format!("{name}: {}", s.to_string_lossy()),
        Err(_) => name,
    }
}

/// One device as the driver reports it (no context is created to read these).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub index: usize,
    pub name: String,
    /// (major, minor), e.g. (9, 0) for an H100 or H200.
    pub compute_capability: (u32, u32),
    pub total_bytes: u64,
}

/// What [`probe`] found: at least one device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInfo {
    /// As the driver encodes it: 1000 * major + 10 * minor (12080 is CUDA 12.8).
    pub driver_version: u32,
    pub devices: Vec<DeviceInfo>,
    /// Whether `libnvrtc` (run-time kernel compilation) loads.
    pub nvrtc: bool,
    /// Whether `libcublas` (dense products) loads.
    pub cublas: bool,
}

impl GpuInfo {
    /// `12.8`.
    pub fn driver_version_string(&self) -> String {
        format!(
            "{}.{}",
            self.driver_version / 1000,
            (self.driver_version % 1000) / 10
        )
    }
}

/// Runs a driver call that may panic inside cudarc's loader (a missing symbol in an old driver).
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, GpuError>) -> Result<T, GpuError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panic".into());
            Err(GpuError::Driver(format!("{what}: {msg}")))
        }
    }
}

/// Whether `libcuda` can be opened. Cheap after the first call (the loader caches the library).
pub fn driver_present() -> bool {
    // SAFETY: only opens the library by name (dlopen); no symbol is called.
    catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
}

/// Whether `libnvrtc` can be opened.
pub fn nvrtc_present() -> bool {
    // SAFETY: as in `driver_present`.
    catch_unwind(|| unsafe { cudarc::nvrtc::sys::is_culib_present() }).unwrap_or(false)
}

/// Whether `libcublas` can be opened.
pub fn cublas_present() -> bool {
    // SAFETY: as in `driver_present`.
    catch_unwind(|| unsafe { cudarc::cublas::sys::is_culib_present() }).unwrap_or(false)
}

/// Lists the CUDA devices. Never panics: no driver is [`GpuError::NoDriver`], a driver that sees no device
/// is [`GpuError::NoDevice`] with `count: 0`, any other driver failure is [`GpuError::Driver`].
pub fn probe() -> Result<GpuInfo, GpuError> {
    if !driver_present() {
        return Err(GpuError::NoDriver);
    }
    guarded("probing CUDA devices", || {
        match result::init() {
            Ok(()) => {}
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE => {
                return Err(GpuError::NoDevice { index: 0, count: 0 });
            }
            Err(e) => return Err(e.into()),
        }
        let mut version = 0i32;
        // SAFETY: writes one int.
        unsafe { sys::cuDriverGetVersion(&mut version) }.result()?;
        let count = result::device::get_count()?.max(0) as usize;
        if count == 0 {
            return Err(GpuError::NoDevice { index: 0, count: 0 });
        }
        let mut devices = Vec::with_capacity(count);
        for index in 0..count {
            let dev = result::device::get(index as i32)?;
            let attr = |a| {
                // SAFETY: `dev` came from `device::get`.
                unsafe { result::device::get_attribute(dev, a) }
            };
            use sys::CUdevice_attribute::*;
            let major = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
            let minor = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
            devices.push(DeviceInfo {
                index,
                name: result::device::get_name(dev)?,
                compute_capability: (major.max(0) as u32, minor.max(0) as u32),
                // SAFETY: `dev` came from `device::get`.
                total_bytes: unsafe { result::device::total_mem(dev) }? as u64,
            });
        }
        Ok(GpuInfo {
            driver_version: version.max(0) as u32,
            devices,
            nvrtc: nvrtc_present(),
            cublas: cublas_present(),
        })
    })
}

/// Free memory of device `index`, in bytes. Retains the device's primary context (released on return
/// unless an engine holds it), since the driver only answers this inside a context.
pub fn free_bytes(index: usize) -> Result<u64, GpuError> {
    if !driver_present() {
        return Err(GpuError::NoDriver);
    }
    guarded("reading free device memory", || {
        let ctx = CudaContext::new(index)?;
        let (free, _total) = ctx.mem_get_info()?;
        Ok(free as u64)
    })
}

/// Where the job wants to run, as the worker's spec says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DevicePreference {
    Cpu,
    /// GPU `index` (as the driver numbers the visible devices, after `CUDA_VISIBLE_DEVICES`); with
    /// `fallback_to_cpu`, any reason the GPU cannot be used selects the CPU instead of failing.
    Cuda {
        index: usize,
        fallback_to_cpu: bool,
    },
}

impl DevicePreference {
    /// The device of one worker from its spec: `gpu_count` GPUs visible to the worker (0: a CPU worker),
    /// an explicit `gpu_index`, or else `local_rank % gpu_count`, so several workers on one machine share its
    /// GPUs round-robin (and all share GPU 0 when there is one).
    pub fn for_worker(
        gpu_count: u32,
        gpu_index: Option<usize>,
        local_rank: usize,
        fallback_to_cpu: bool,
    ) -> DevicePreference {
        if gpu_count == 0 {
            return DevicePreference::Cpu;
        }
        DevicePreference::Cuda {
            index: gpu_index.unwrap_or(local_rank % gpu_count as usize),
            fallback_to_cpu,
        }
    }
}

/// The device chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selected {
    /// The CPU engine; `fallback` says why the GPU that was asked for is not used (None: the CPU was asked for).
    Cpu {
        fallback: Option<GpuError>,
    },
    Cuda {
        device: DeviceInfo,
        free_bytes: u64,
    },
}

impl Selected {
    /// One line for logs: `cuda:0 (NVIDIA H200, 139.7 GiB free)` or `cpu (fallback: ...)`.
    pub fn describe(&self) -> String {
        match self {
            Selected::Cpu { fallback: None } => "cpu".into(),
            Selected::Cpu { fallback: Some(e) } => format!("cpu (fallback: {e})"),
            Selected::Cuda { device, free_bytes } => format!(
                "cuda:{} ({}, {:.1} GiB free)",
                device.index,
                device.name,
                *free_bytes as f64 / (1u64 << 30) as f64
            ),
        }
    }
}

/// What the probe found about the device asked for, for [`decide`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    pub info: GpuInfo,
    /// Free bytes of the device asked for (None: it does not exist, so it was not read).
    pub free_bytes: Option<u64>,
}

/// Chooses the device for `pref` needing `need_bytes` of device memory: probes, then [`decide`]s.
pub fn select(pref: DevicePreference, need_bytes: u64) -> Result<Selected, GpuError> {
    let found = match pref {
        DevicePreference::Cpu => return Ok(Selected::Cpu { fallback: None }),
        DevicePreference::Cuda { index, .. } => probe().and_then(|info| {
            let free_bytes = if index < info.devices.len() {
                Some(free_bytes(index)?)
            } else {
                None
            };
            Ok(Found { info, free_bytes })
        }),
    };
    decide(pref, need_bytes, found)
}

/// The pure part of [`select`]: the device asked for must exist, its NVRTC and cuBLAS libraries must load, and
/// it must have `need_bytes` free. Any failure is an error, or the CPU with the reason when the preference
/// allows a fallback.
pub fn decide(
    pref: DevicePreference,
    need_bytes: u64,
    found: Result<Found, GpuError>,
) -> Result<Selected, GpuError> {
    let (index, fallback_to_cpu) = match pref {
        DevicePreference::Cpu => return Ok(Selected::Cpu { fallback: None }),
        DevicePreference::Cuda {
            index,
            fallback_to_cpu,
        } => (index, fallback_to_cpu),
    };
    let outcome = found.and_then(|f| {
        let count = f.info.devices.len();
        let device = f
            .info
            .devices
            .get(index)
            .cloned()
            .ok_or(GpuError::NoDevice { index, count })?;
        if !f.info.nvrtc {
            return Err(GpuError::MissingLibrary { name: "libnvrtc" });
        }
        if !f.info.cublas {
            return Err(GpuError::MissingLibrary { name: "libcublas" });
        }
        let free_bytes = f.free_bytes.ok_or(GpuError::NoDevice { index, count })?;
        if free_bytes < need_bytes {
            return Err(GpuError::TooLittleMemory {
                index,
                need_bytes,
                have_bytes: free_bytes,
            });
        }
        Ok(Selected::Cuda { device, free_bytes })
    });
    match outcome {
        Err(GpuError::NoDevice { count, .. }) => {
            // the probe cannot know which index was asked for; say it here
            let e = GpuError::NoDevice { index, count };
            if fallback_to_cpu {
                Ok(Selected::Cpu { fallback: Some(e) })
            } else {
                Err(e)
            }
        }
        Err(e) if fallback_to_cpu => Ok(Selected::Cpu { fallback: Some(e) }),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h200() -> GpuInfo {
        GpuInfo {
            driver_version: 12080,
            devices: vec![DeviceInfo {
                index: 0,
                name: "NVIDIA H200".into(),
                compute_capability: (9, 0),
                total_bytes: 150_000_000_000,
            }],
            nvrtc: true,
            cublas: true,
        }
    }

    fn cuda(index: usize, fallback_to_cpu: bool) -> DevicePreference {
        DevicePreference::Cuda {
            index,
            fallback_to_cpu,
        }
    }

    #[test]
    fn probe_without_a_driver_is_a_clean_error() {
        if driver_present() {
            eprintln!("skipping: this machine has a CUDA driver");
            return;
        }
        assert_eq!(probe(), Err(GpuError::NoDriver));
        assert_eq!(free_bytes(0), Err(GpuError::NoDriver));
    }

    #[test]
    fn select_without_a_driver_falls_back_or_explains() {
        if driver_present() {
            eprintln!("skipping: this machine has a CUDA driver");
            return;
        }
        let got = select(cuda(0, true), 1 << 30).unwrap();
        assert_eq!(
            got,
            Selected::Cpu {
                fallback: Some(GpuError::NoDriver)
            }
        );
        assert!(got.describe().starts_with("cpu (fallback: no CUDA driver"));
        let err = select(cuda(0, false), 1 << 30).unwrap_err();
        assert_eq!(
            err.to_string(),
            "no CUDA driver: libcuda could not be loaded (no NVIDIA driver on this machine, or its library is \
             not on the loader path)"
        );
        assert_eq!(
            select(DevicePreference::Cpu, 0).unwrap(),
            Selected::Cpu { fallback: None }
        );
    }

    #[test]
    fn decide_covers_every_reason() {
        let found = |free| {
            Ok(Found {
                info: h200(),
                free_bytes: Some(free),
            })
        };
        // fits
        let got = decide(cuda(0, false), 10, found(100)).unwrap();
        assert!(matches!(
            got,
            Selected::Cuda {
                free_bytes: 100,
                ..
            }
        ));
        assert_eq!(got.describe(), "cuda:0 (NVIDIA H200, 0.0 GiB free)");
        // too little memory
        let e = decide(cuda(0, false), 1000, found(100)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "CUDA device 0 has 100 bytes free but the job needs 1000 (use a larger GPU, more workers, or the CPU)"
        );
        assert_eq!(
            decide(cuda(0, true), 1000, found(100)).unwrap(),
            Selected::Cpu { fallback: Some(e) }
        );
        // index beyond the devices
        let none = Ok(Found {
            info: h200(),
            free_bytes: None,
        });
        let e = decide(cuda(3, false), 0, none.clone()).unwrap_err();
        assert_eq!(e, GpuError::NoDevice { index: 3, count: 1 });
        assert_eq!(
            e.to_string(),
            "no CUDA device 3: the driver sees 1 device(s)"
        );
        assert!(matches!(
            decide(cuda(3, true), 0, none).unwrap(),
            Selected::Cpu {
                fallback: Some(GpuError::NoDevice { index: 3, .. })
            }
        ));
        // a driver with no device at all: the index asked for is named
        let e = decide(
            cuda(1, false),
            0,
            Err(GpuError::NoDevice { index: 0, count: 0 }),
        )
        .unwrap_err();
        assert_eq!(e, GpuError::NoDevice { index: 1, count: 0 });
        // libraries
        let mut info = h200();
        info.nvrtc = false;
        let e = decide(
            cuda(0, false),
            0,
            Ok(Found {
                info,
                free_bytes: Some(1),
            }),
        )
        .unwrap_err();
        assert_eq!(e, GpuError::MissingLibrary { name: "libnvrtc" });
        assert!(e.to_string().contains("LD_LIBRARY_PATH"));
        // driver failures pass through or fall back
        let d = GpuError::Driver("CUDA_ERROR_UNKNOWN: unknown error".into());
        assert_eq!(decide(cuda(0, false), 0, Err(d.clone())), Err(d.clone()));
        assert_eq!(
            decide(cuda(0, true), 0, Err(d.clone())),
            Ok(Selected::Cpu { fallback: Some(d) })
        );
    }

    #[test]
    fn workers_pick_their_gpu_from_the_spec() {
        assert_eq!(
            DevicePreference::for_worker(0, None, 3, true),
            DevicePreference::Cpu
        );
        assert_eq!(
            DevicePreference::for_worker(1, None, 3, false),
            cuda(0, false)
        );
        assert_eq!(
            DevicePreference::for_worker(4, None, 6, true),
            cuda(2, true)
        );
        assert_eq!(
            DevicePreference::for_worker(4, Some(1), 6, true),
            cuda(1, true)
        );
    }
}
