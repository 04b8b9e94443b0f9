//! Issue 30: the kernels load on the oldest driver the catalog names. NVRTC runs without a GPU, so this
//! compiles the engine's kernel source exactly as `CudaEngine` does (`compile_for_device`) for every GPU
//! architecture of the built-in catalog, and checks each result against the oldest driver any offering of
//! that architecture runs: a cubin must be an `EM_CUDA` ELF for the device's `sm_XY`, holding every kernel
//! the engine loads, from an NVRTC whose CUDA major version that driver supports; PTX would need an ISA the
//! driver's CUDA version JIT-compiles (the PTX ISA release notes' table, `compile::PTX_ISA_FIRST_CUDA`).
//!
//! libnvrtc comes from NVIDIA's `nvidia-cuda-nvrtc-cu12` wheel, the one the CUDA image unpacks: found on the
//! loader path, in `$PHYSALIA_NVRTC_DIR`, or in the `nvidia.cuda_nvrtc` package of `python3`. cudarc opens it
//! by name, and the loader reads `LD_LIBRARY_PATH` only when a process starts, so the test runs itself again
//! with the folder on it. Without the library it prints a note and passes, unless `PHYSALIA_REQUIRE_NVRTC=1`
//! (CI), where a missing library fails it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use physalia_gnn_cuda::compile::{
    Image, Target, check_loads, compile, compile_for_device, cubin_sm, cuda_string, max_ptx_isa,
    nvrtc_version, ptx_isa,
};
use physalia_gnn_cuda::device::nvrtc_present;
use physalia_gnn_cuda::engine::KERNELS_FILE;
use physalia_gnn_cuda::kernels::{KERNELS, SOURCE};
use physalia_planner::Catalog;

const TEST: &str = "kernels_compile_for_every_catalog_gpu_and_load_on_its_oldest_driver";
const CHILD: &str = "PHYSALIA_NVRTC_CHILD";

/// A folder holding `libnvrtc.so.12`: `$PHYSALIA_NVRTC_DIR`, else the pip wheel's.
fn nvrtc_dir() -> Option<PathBuf> {
    let has_lib = |d: &PathBuf| d.join("libnvrtc.so.12").is_file();
    if let Some(d) = std::env::var_os("PHYSALIA_NVRTC_DIR").map(PathBuf::from) {
        return has_lib(&d).then_some(d);
    }
    let out = Command::new("python3")
        .args([
            "-c",
            "import os, nvidia.cuda_nvrtc as m; print(os.path.join(list(m.__path__)[0], 'lib'))",
        ])
        .output()
        .ok()?;
    let d = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    (out.status.success() && has_lib(&d)).then_some(d)
}

/// For each architecture (`(8, 9)`) of the catalog's GPUs: the oldest driver's CUDA version (12020) any
/// offering of it runs, and which offering and driver that is.
fn catalog_targets() -> BTreeMap<(u32, u32), (u32, String)> {
    let mut out: BTreeMap<(u32, u32), (u32, String)> = BTreeMap::new();
    for sku in Catalog::builtin().skus.iter().filter(|s| s.is_gpu()) {
        let gpu = sku.gpu.as_ref().unwrap();
        let cc = gpu
            .compute_capability
            .unwrap_or_else(|| panic!("{}: the catalog names no compute capability", sku.name));
        let driver = gpu
            .driver
            .as_ref()
            .unwrap_or_else(|| panic!("{}: the catalog names no driver", sku.name));
        let cuda = driver.cuda.cuda_encoded();
        let who = format!(
            "{} on {} (driver {})",
            gpu.model, sku.name, driver.min_version
        );
        let e = out
            .entry((cc.major, cc.minor))
            .or_insert((cuda, who.clone()));
        if cuda < e.0 {
            *e = (cuda, who);
        }
    }
    out
}

#[test]
fn kernels_compile_for_every_catalog_gpu_and_load_on_its_oldest_driver() {
    if !nvrtc_present() {
        let require = std::env::var("PHYSALIA_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
        if std::env::var_os(CHILD).is_some() {
            panic!(
                "libnvrtc does not load from LD_LIBRARY_PATH={:?}",
                std::env::var("LD_LIBRARY_PATH")
            );
        }
        let Some(dir) = nvrtc_dir() else {
            assert!(
                !require,
                "PHYSALIA_REQUIRE_NVRTC=1 but no libnvrtc.so.12: install the wheel the CUDA image uses \
                 (python3 -m pip install nvidia-cuda-nvrtc-cu12==12.8.93) or set PHYSALIA_NVRTC_DIR"
            );
            eprintln!(
                "skipping: no libnvrtc (pip install nvidia-cuda-nvrtc-cu12==12.8.93, or set PHYSALIA_NVRTC_DIR)"
            );
            return;
        };
        let path = match std::env::var("LD_LIBRARY_PATH") {
            Ok(p) if !p.is_empty() => format!("{}:{p}", dir.display()),
            _ => dir.display().to_string(),
        };
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", TEST, "--nocapture", "--test-threads=1"])
            .env("LD_LIBRARY_PATH", path)
            .env(CHILD, "1")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!("{text}");
        assert!(
            out.status.success(),
            "with libnvrtc from {}:\n{text}",
            dir.display()
        );
        assert!(
            text.contains("1 passed"),
            "the run with libnvrtc ran no test:\n{text}"
        );
        return;
    }

    let nvrtc = nvrtc_version().unwrap();
    let targets = catalog_targets();
    assert!(
        targets.len() >= 5,
        "the catalog's GPU architectures: {:?}",
        targets.keys()
    );
    let oldest = targets.values().map(|(c, _)| *c).min().unwrap();
    eprintln!(
        "NVRTC {}.{}; oldest driver the catalog names: CUDA {}",
        nvrtc.0,
        nvrtc.1,
        cuda_string(oldest)
    );
    for (&cc, (driver_cuda, who)) in &targets {
        let sm = 10 * cc.0 + cc.1;
        let compiled = compile_for_device(SOURCE, KERNELS_FILE, cc)
            .unwrap_or_else(|e| panic!("compiling for sm_{sm}: {e}"));
        assert_eq!(
            compiled.target,
            Target::Sass { sm },
            "the engine should compile SASS for sm_{sm} ({who})"
        );
        let Image::Cubin(bytes) = &compiled.image else {
            panic!("expected a cubin for sm_{sm}, got {}", compiled.describe());
        };
        assert_eq!(cubin_sm(bytes), Ok(sm), "the cubin's ELF architecture");
        for k in KERNELS {
            let name = format!("\0{k}\0");
            assert!(
                bytes.windows(name.len()).any(|w| w == name.as_bytes()),
                "the sm_{sm} cubin has no kernel {k}"
            );
        }
        if let Err(why) = check_loads(&compiled, cc, *driver_cuda) {
            panic!(
                "{} does not load on CUDA {} ({who}): {why}",
                compiled.describe(),
                cuda_string(*driver_cuda)
            );
        }
        // what the engine loaded before: PTX at NVRTC's own ISA, refused where the driver is older
        let ptx = compile(SOURCE, KERNELS_FILE, Target::Ptx { compute: sm }).unwrap();
        let Image::Ptx(text) = &ptx.image else {
            panic!("expected PTX for compute_{sm}")
        };
        let isa = ptx_isa(text).expect("NVRTC's PTX has a .version directive");
        let max = max_ptx_isa(*driver_cuda).unwrap();
        assert_eq!(
            check_loads(&ptx, cc, *driver_cuda).is_ok(),
            isa <= max,
            "PTX ISA {isa:?} against a driver JIT-compiling up to {max:?}"
        );
        eprintln!(
            "sm_{sm}: {} ({} bytes, ELF sm_{sm}, {} kernels) loads on CUDA {} ({who}); PTX would be ISA {}.{}, \
             which that driver {} (it JIT-compiles up to ISA {}.{})",
            compiled.describe(),
            bytes.len(),
            KERNELS.len(),
            cuda_string(*driver_cuda),
            isa.0,
            isa.1,
            if isa <= max { "accepts" } else { "refuses" },
            max.0,
            max.1
        );
    }
}
