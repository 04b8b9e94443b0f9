//! Compiling the kernels for one GPU so that they load on the driver its machine runs.
//!
//! NVRTC writes PTX at its own toolkit's PTX ISA version (NVRTC 12.8 writes ISA 8.7), and a driver
//! JIT-compiles only PTX up to the ISA of its own CUDA version: a 535 driver (CUDA 12.2, ISA 8.2), what
//! Cloud Run's L4s, the ECS GPU AMI on Amazon Linux 2 and older AKS and GKE node images run, refuses it with
//! `CUDA_ERROR_UNSUPPORTED_PTX_VERSION`. SASS is not JIT-compiled: under CUDA minor version compatibility a
//! cubin built by any 12.x toolkit loads on any 12.x driver (525 or later), and newer major drivers load it
//! too. So the engine asks NVRTC for a cubin for the device's own `sm_XY` ([`target_for`]); only a device
//! NVRTC cannot assemble for (newer than the NVRTC) gets PTX, and its driver is then at least as new.
//!
//! [`check_loads`] is the same rule as a pure function of the compiled image and the driver's CUDA version,
//! so a CPU test compiles every kernel for every GPU of the catalog and checks the result against the
//! oldest driver the catalog names (`tests/nvrtc_targets.rs`); [`load_failure`] turns a driver's refusal
//! into an error that names the driver, the image and what to do.

use std::ffi::{CStr, CString, c_char, c_int};

use cudarc::nvrtc::{result, sys};

use crate::device::{GpuError, nvrtc_present};

/// What NVRTC is asked for, by architecture number (`10 * major + minor`: 89 for compute capability 8.9).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// SASS for `sm_XY`, as a cubin: loads on any driver of NVRTC's CUDA major version or later.
    Sass { sm: u32 },
    /// PTX for `compute_XY`, JIT-compiled by the driver: needs a driver at least as new as its ISA.
    Ptx { compute: u32 },
}

impl Target {
    /// NVRTC's `--gpu-architecture` value: `sm_89` or `compute_90`.
    pub fn arch(self) -> String {
        match self {
            Target::Sass { sm } => format!("sm_{sm}"),
            Target::Ptx { compute } => format!("compute_{compute}"),
        }
    }
}

/// `(8, 9)` -> 89.
pub fn arch_number(cc: (u32, u32)) -> u32 {
    10 * cc.0 + cc.1
}

/// What to compile for a device of compute capability `cc`, given the architectures NVRTC supports
/// (`nvrtcGetSupportedArchs`): SASS for the device's own architecture; else SASS for the newest
/// architecture of the same major version below it (a cubin runs on later minor versions of its major);
/// else PTX for the newest architecture below it (a device newer than the NVRTC, whose driver is newer
/// too). None: NVRTC supports nothing at or below the device (a device too old for this NVRTC).
pub fn target_for(cc: (u32, u32), supported: &[u32]) -> Option<Target> {
    let sm = arch_number(cc);
    if supported.contains(&sm) {
        return Some(Target::Sass { sm });
    }
    let below = supported.iter().copied().filter(|&a| a <= sm);
    if let Some(same_major) = below.clone().filter(|&a| a / 10 == cc.0).max() {
        return Some(Target::Sass { sm: same_major });
    }
    below.max().map(|compute| Target::Ptx { compute })
}

/// The compiled kernels, as the driver is given them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Image {
    Cubin(Vec<u8>),
    Ptx(String),
}

/// One compilation: what was asked for, what came out, and the NVRTC that made it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compiled {
    pub target: Target,
    pub image: Image,
    /// NVRTC's (major, minor) version.
    pub nvrtc: (u32, u32),
}

impl Compiled {
    /// `cubin for sm_89` or `PTX ISA 8.7 for compute_90`.
    pub fn describe(&self) -> String {
        match &self.image {
            Image::Cubin(_) => format!("cubin for {}", self.target.arch()),
            Image::Ptx(text) => match ptx_isa(text) {
                Some((a, b)) => format!("PTX ISA {a}.{b} for {}", self.target.arch()),
                None => format!("PTX without a .version for {}", self.target.arch()),
            },
        }
    }

    /// The image as cudarc's loader takes it (a cubin is passed as binary data, the driver tells the two
    /// apart by their headers).
    pub fn into_module_image(self) -> cudarc::nvrtc::Ptx {
        match self.image {
            Image::Cubin(bytes) => cudarc::nvrtc::Ptx::from_binary(bytes),
            Image::Ptx(text) => cudarc::nvrtc::Ptx::from_src(text),
        }
    }
}

fn nvrtc_err(what: &str, e: impl std::fmt::Debug) -> GpuError {
    GpuError::Compile(format!("{what}: {e:?}"))
}

fn need_nvrtc() -> Result<(), GpuError> {
    if nvrtc_present() {
        Ok(())
    } else {
        Err(GpuError::MissingLibrary { name: "libnvrtc" })
    }
}

/// The loaded NVRTC's (major, minor) version.
pub fn nvrtc_version() -> Result<(u32, u32), GpuError> {
    need_nvrtc()?;
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: writes two ints.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| nvrtc_err("nvrtcVersion", e))?;
    Ok((major.max(0) as u32, minor.max(0) as u32))
}

/// The real architectures the loaded NVRTC compiles for (`[50, 52, ..., 90, 100, 120]` for 12.8).
pub fn supported_archs() -> Result<Vec<u32>, GpuError> {
    need_nvrtc()?;
    let mut n: c_int = 0;
    // SAFETY: writes one int.
    unsafe { sys::nvrtcGetNumSupportedArchs(&mut n) }
        .result()
        .map_err(|e| nvrtc_err("nvrtcGetNumSupportedArchs", e))?;
    let mut archs = vec![0 as c_int; n.max(0) as usize];
    // SAFETY: `archs` holds the `n` ints NVRTC writes.
    unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }
        .result()
        .map_err(|e| nvrtc_err("nvrtcGetSupportedArchs", e))?;
    Ok(archs.into_iter().map(|a| a.max(0) as u32).collect())
}

/// Compiles `src` for a device of compute capability `cc`: the [`target_for`] it given what the loaded
/// NVRTC supports.
pub fn compile_for_device(src: &str, name: &str, cc: (u32, u32)) -> Result<Compiled, GpuError> {
    let supported = supported_archs()?;
    let target = target_for(cc, &supported).ok_or_else(|| {
        GpuError::Unsupported(format!(
            "NVRTC compiles for architectures {supported:?}, none at or below the device's sm_{}",
            arch_number(cc)
        ))
    })?;
    compile(src, name, target)
}

/// Compiles `src` (named `name` in NVRTC's messages) for `target`.
pub fn compile(src: &str, name: &str, target: Target) -> Result<Compiled, GpuError> {
    need_nvrtc()?;
    let nvrtc = nvrtc_version()?;
    let src_c =
        CString::new(src).map_err(|_| GpuError::Compile("the source holds a NUL".into()))?;
    let name_c =
        CString::new(name).map_err(|_| GpuError::Compile("the name holds a NUL".into()))?;
    let prog = result::create_program(&src_c, Some(name_c.as_c_str()))
        .map_err(|e| nvrtc_err("nvrtcCreateProgram", e))?;
    let program = Program(prog);
    let options = [format!("--gpu-architecture={}", target.arch())];
    // SAFETY: `prog` was created above and is destroyed only by `Program`'s drop.
    if let Err(e) = unsafe { result::compile_program(program.0, &options) } {
        // SAFETY: as above.
        let log = unsafe { result::get_program_log(program.0) }
            .map(|l| c_text(&l))
            .unwrap_or_default();
        return Err(GpuError::Compile(format!(
            "{e:?} for {} ({name}): {}",
            target.arch(),
            log.trim()
        )));
    }
    let image = match target {
        Target::Sass { .. } => {
            let mut size = 0usize;
            // SAFETY: `prog` compiled; writes one size.
            unsafe { sys::nvrtcGetCUBINSize(program.0, &mut size) }
                .result()
                .map_err(|e| nvrtc_err("nvrtcGetCUBINSize", e))?;
            let mut bytes = vec![0u8; size];
            // SAFETY: `bytes` holds the `size` bytes NVRTC writes.
            unsafe { sys::nvrtcGetCUBIN(program.0, bytes.as_mut_ptr() as *mut c_char) }
                .result()
                .map_err(|e| nvrtc_err("nvrtcGetCUBIN", e))?;
            Image::Cubin(bytes)
        }
        Target::Ptx { .. } => {
            // SAFETY: `prog` compiled.
            let ptx =
                unsafe { result::get_ptx(program.0) }.map_err(|e| nvrtc_err("nvrtcGetPTX", e))?;
            Image::Ptx(c_text(&ptx))
        }
    };
    Ok(Compiled {
        target,
        image,
        nvrtc,
    })
}

/// Destroys the program however `compile` returns.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by `create_program`, destroyed once, here.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

fn c_text(buf: &[c_char]) -> String {
    if buf.is_empty() {
        return String::new();
    }
    // SAFETY: NVRTC NUL-terminates what it writes; the buffer is its size.
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// The PTX ISA version of a PTX text: its `.version X.Y` directive.
pub fn ptx_isa(ptx: &str) -> Option<(u32, u32)> {
    let line = ptx
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with(".version"))?;
    let (a, b) = line.strip_prefix(".version")?.trim().split_once('.')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

/// The first CUDA release whose driver loads each PTX ISA version, `(ISA, CUDA as 1000 * major + 10 *
/// minor)`, from the PTX ISA release notes' table,
/// <https://docs.nvidia.com/cuda/parallel-thread-execution/#release-notes-ptx-release-history>, as NVIDIA's
/// `cuda.bindings.utils.get_minimal_required_cuda_ver_from_ptx_ver` encodes it (CUDA 12.6 kept ISA 8.5).
pub const PTX_ISA_FIRST_CUDA: [((u32, u32), u32); 20] = [
    ((7, 0), 11000),
    ((7, 1), 11010),
    ((7, 2), 11020),
    ((7, 3), 11030),
    ((7, 4), 11040),
    ((7, 5), 11050),
    ((7, 6), 11060),
    ((7, 7), 11070),
    ((7, 8), 11080),
    ((8, 0), 12000),
    ((8, 1), 12010),
    ((8, 2), 12020),
    ((8, 3), 12030),
    ((8, 4), 12040),
    ((8, 5), 12050),
    ((8, 6), 12070),
    ((8, 7), 12080),
    ((8, 8), 12090),
    ((9, 0), 13000),
    ((9, 1), 13010),
];

/// The newest PTX ISA a driver of CUDA version `driver_cuda` JIT-compiles (12020 -> 8.2); a driver newer
/// than the table gets the table's newest. None below CUDA 11.0.
pub fn max_ptx_isa(driver_cuda: u32) -> Option<(u32, u32)> {
    PTX_ISA_FIRST_CUDA
        .iter()
        .filter(|(_, first)| *first <= driver_cuda)
        .map(|(isa, _)| *isa)
        .max()
}

/// The CUDA release that first loads PTX ISA `isa` (None: newer than the table).
pub fn first_cuda_for_isa(isa: (u32, u32)) -> Option<u32> {
    PTX_ISA_FIRST_CUDA
        .iter()
        .find(|(v, _)| *v == isa)
        .map(|(_, c)| *c)
}

/// `12.2` from 12020.
pub fn cuda_string(v: u32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// The ELF machine number of CUDA cubins (`EM_CUDA`).
const EM_CUDA: u16 = 190;

/// The SM architecture (89 for sm_89) a cubin holds code for, from its ELF header: an ELF64 object of
/// machine `EM_CUDA` whose `e_flags` carry the architecture in their low byte (the CUDA ELF ABI version 7
/// that CUDA 12's assembler writes; another ABI version is reported, not guessed at).
pub fn cubin_sm(bytes: &[u8]) -> Result<u32, String> {
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" {
        return Err("not an ELF object".into());
    }
    if bytes[4] != 2 || bytes[5] != 1 {
        return Err(format!(
            "not a little-endian ELF64 object (class {}, data {})",
            bytes[4], bytes[5]
        ));
    }
    let machine = u16::from_le_bytes([bytes[18], bytes[19]]);
    if machine != EM_CUDA {
        return Err(format!(
            "ELF machine {machine}, not EM_CUDA ({EM_CUDA}): not a cubin"
        ));
    }
    let abi = bytes[8];
    if abi != 7 {
        return Err(format!(
            "CUDA ELF ABI version {abi} (this reader knows version 7, CUDA 12's)"
        ));
    }
    let flags = u32::from_le_bytes([bytes[48], bytes[49], bytes[50], bytes[51]]);
    Ok(flags & 0xff)
}

/// Whether a driver of CUDA version `driver_cuda` (as `cuDriverGetVersion` reports it: 12020 for CUDA
/// 12.2, a 535 driver) loads `compiled` on a device of compute capability `cc`: Ok, or why not.
///
/// A cubin must hold code for the device's architecture (its own, or an earlier minor version of its
/// major) and come from an NVRTC whose CUDA major version the driver supports (minor version
/// compatibility: any 12.x driver, 525 or later, runs 12.x SASS). PTX must target an architecture at or
/// below the device's and carry an ISA the driver's CUDA version JIT-compiles.
pub fn check_loads(compiled: &Compiled, cc: (u32, u32), driver_cuda: u32) -> Result<(), String> {
    let device = arch_number(cc);
    let driver = cuda_string(driver_cuda);
    match &compiled.image {
        Image::Cubin(bytes) => {
            let sm = cubin_sm(bytes)?;
            if let Target::Sass { sm: asked } = compiled.target
                && sm != asked
            {
                return Err(format!(
                    "the cubin is for sm_{sm}, NVRTC was asked for sm_{asked}"
                ));
            }
            if sm / 10 != cc.0 || sm > device {
                return Err(format!(
                    "the cubin is for sm_{sm} and the device is sm_{device}: SASS runs only on its own \
                     architecture and later minor versions of its major"
                ));
            }
            let (major, minor) = compiled.nvrtc;
            if driver_cuda / 1000 < major {
                return Err(format!(
                    "the cubin comes from NVRTC {major}.{minor} and the driver supports CUDA {driver}: minor \
                     version compatibility covers drivers of CUDA {major}.x only"
                ));
            }
            Ok(())
        }
        Image::Ptx(text) => {
            let isa = ptx_isa(text).ok_or("the PTX has no .version directive")?;
            if let Target::Ptx { compute } = compiled.target
                && compute > device
            {
                return Err(format!(
                    "the PTX is for compute_{compute} and the device is sm_{device}"
                ));
            }
            let max = max_ptx_isa(driver_cuda).ok_or_else(|| {
                format!("a driver of CUDA {driver} loads no PTX this engine makes")
            })?;
            if isa > max {
                return Err(format!(
                    "the PTX is ISA {}.{} and a driver of CUDA {driver} JIT-compiles PTX up to ISA {}.{}",
                    isa.0, isa.1, max.0, max.1
                ));
            }
            Ok(())
        }
    }
}

/// The error for a driver that refused the compiled kernels with `cause` (the driver's error name and
/// text): names the driver's CUDA version, what was compiled by which NVRTC, and what to do.
pub fn load_failure(
    compiled: &Compiled,
    cc: (u32, u32),
    driver_cuda: u32,
    cause: String,
) -> GpuError {
    let (major, minor) = compiled.nvrtc;
    let advice = match &compiled.image {
        Image::Ptx(text) => {
            let need = ptx_isa(text)
                .and_then(first_cuda_for_isa)
                .map_or(format!("{major}.{minor}"), cuda_string);
            let max = max_ptx_isa(driver_cuda)
                .map_or("none".to_string(), |(a, b)| format!("ISA {a}.{b}"));
            format!(
                "this driver JIT-compiles PTX up to {max}; NVRTC {major}.{minor} cannot assemble SASS for \
                 sm_{}, so update the NVIDIA driver to one of CUDA {need} or later (nvidia-smi shows the \
                 driver's CUDA version), or build the image with an NVRTC that knows this GPU (a newer \
                 nvidia-cuda-nvrtc wheel)",
                arch_number(cc)
            )
        }
        Image::Cubin(_) => match check_loads(compiled, cc, driver_cuda) {
            Err(why) => format!("{why}; update the NVIDIA driver to CUDA {major}.x or later"),
            Ok(()) => format!(
                "the cubin should load on a driver of CUDA {major}.x (525 or later); check the driver \
                 (nvidia-smi) and the device"
            ),
        },
    };
    GpuError::KernelLoad {
        driver_cuda: cuda_string(driver_cuda),
        image: compiled.describe(),
        nvrtc: format!("{major}.{minor}"),
        cause,
        advice,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC 12.8's `nvrtcGetSupportedArchs`.
    const NVRTC_12_8: [u32; 17] = [
        50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90, 100, 101, 120,
    ];

    #[test]
    fn each_device_gets_sass_for_its_own_architecture() {
        for (cc, sm) in [
            ((7, 5), 75),
            ((8, 0), 80),
            ((8, 6), 86),
            ((8, 9), 89),
            ((9, 0), 90),
        ] {
            assert_eq!(
                target_for(cc, &NVRTC_12_8),
                Some(Target::Sass { sm }),
                "{cc:?}"
            );
        }
        assert_eq!(Target::Sass { sm: 89 }.arch(), "sm_89");
        assert_eq!(Target::Ptx { compute: 90 }.arch(), "compute_90");
    }

    #[test]
    fn an_unknown_minor_version_gets_its_majors_sass_and_a_newer_major_gets_ptx() {
        // sm_121 is not in 12.8's list: sm_120's SASS runs on it
        assert_eq!(
            target_for((12, 1), &NVRTC_12_8),
            Some(Target::Sass { sm: 120 })
        );
        // sm_88 (made up): sm_87's SASS
        assert_eq!(
            target_for((8, 8), &NVRTC_12_8),
            Some(Target::Sass { sm: 87 })
        );
        // a major NVRTC does not know: PTX of the newest architecture below it
        assert_eq!(
            target_for((13, 0), &NVRTC_12_8),
            Some(Target::Ptx { compute: 120 })
        );
        // older than anything NVRTC supports
        assert_eq!(target_for((3, 5), &NVRTC_12_8), None);
    }

    #[test]
    fn ptx_isa_reads_the_version_directive() {
        let ptx = "//\n// Generated by NVIDIA NVVM Compiler\n//\n\n.version 8.7\n.target sm_90\n.address_size 64\n";
        assert_eq!(ptx_isa(ptx), Some((8, 7)));
        assert_eq!(ptx_isa(".target sm_90\n"), None);
        assert_eq!(ptx_isa(".version 10.12\n"), Some((10, 12)));
    }

    #[test]
    fn the_isa_table_follows_the_release_notes() {
        // a 535 driver is CUDA 12.2: PTX up to ISA 8.2
        assert_eq!(max_ptx_isa(12020), Some((8, 2)));
        // CUDA 12.6 added no ISA
        assert_eq!(max_ptx_isa(12060), Some((8, 5)));
        assert_eq!(max_ptx_isa(12080), Some((8, 7)));
        assert_eq!(max_ptx_isa(10020), None);
        assert_eq!(max_ptx_isa(99000), Some((9, 1)));
        assert_eq!(first_cuda_for_isa((8, 7)), Some(12080));
        // sorted both ways, so `max_ptx_isa` reads it as a monotone table
        for w in PTX_ISA_FIRST_CUDA.windows(2) {
            assert!(w[0].0 < w[1].0 && w[0].1 < w[1].1, "{w:?}");
        }
    }

    /// A minimal ELF64 header of a CUDA object.
    fn elf(machine: u16, abi: u8, flags: u32) -> Vec<u8> {
        let mut b = vec![0u8; 64];
        b[..4].copy_from_slice(b"\x7fELF");
        b[4] = 2;
        b[5] = 1;
        b[7] = 0x33;
        b[8] = abi;
        b[18..20].copy_from_slice(&machine.to_le_bytes());
        b[48..52].copy_from_slice(&flags.to_le_bytes());
        b
    }

    fn cubin(sm: u32, nvrtc: (u32, u32)) -> Compiled {
        Compiled {
            target: Target::Sass { sm },
            // NVRTC 12.8's flags for sm_89: 0x590559 (the virtual architecture above, the real one below)
            image: Image::Cubin(elf(EM_CUDA, 7, (sm << 16) | 0x0500 | sm)),
            nvrtc,
        }
    }

    fn ptx(compute: u32, isa: &str) -> Compiled {
        Compiled {
            target: Target::Ptx { compute },
            image: Image::Ptx(format!(".version {isa}\n.target sm_{compute}\n")),
            nvrtc: (12, 8),
        }
    }

    #[test]
    fn cubin_headers_are_read_and_refused_when_not_cuda() {
        assert_eq!(cubin_sm(&elf(EM_CUDA, 7, 0x590559)), Ok(89));
        assert!(
            cubin_sm(&elf(62, 7, 0x59))
                .unwrap_err()
                .contains("not EM_CUDA")
        );
        assert!(
            cubin_sm(&elf(EM_CUDA, 8, 0x5900))
                .unwrap_err()
                .contains("ABI version 8")
        );
        assert!(
            cubin_sm(b".version 8.7")
                .unwrap_err()
                .contains("not an ELF")
        );
    }

    #[test]
    fn a_cubin_loads_on_any_driver_of_its_major_and_only_on_its_architecture() {
        assert_eq!(check_loads(&cubin(89, (12, 8)), (8, 9), 12020), Ok(()));
        assert_eq!(check_loads(&cubin(89, (12, 8)), (8, 9), 13000), Ok(()));
        assert_eq!(check_loads(&cubin(120, (12, 8)), (12, 1), 12080), Ok(()));
        let e = check_loads(&cubin(89, (12, 8)), (8, 9), 11080).unwrap_err();
        assert!(e.contains("NVRTC 12.8") && e.contains("CUDA 11.8"), "{e}");
        let e = check_loads(&cubin(89, (12, 8)), (9, 0), 12080).unwrap_err();
        assert!(e.contains("sm_89") && e.contains("sm_90"), "{e}");
        let e = check_loads(&cubin(86, (12, 8)), (8, 0), 12080).unwrap_err();
        assert!(e.contains("sm_86"), "{e}");
    }

    #[test]
    fn ptx_loads_only_on_a_driver_as_new_as_its_isa() {
        assert_eq!(check_loads(&ptx(90, "8.2"), (9, 0), 12020), Ok(()));
        let e = check_loads(&ptx(90, "8.7"), (9, 0), 12020).unwrap_err();
        assert_eq!(
            e,
            "the PTX is ISA 8.7 and a driver of CUDA 12.2 JIT-compiles PTX up to ISA 8.2"
        );
        assert_eq!(check_loads(&ptx(90, "8.7"), (9, 0), 12080), Ok(()));
        assert!(check_loads(&ptx(90, "8.2"), (8, 9), 12080).is_err());
    }

    #[test]
    fn a_refused_module_names_the_driver_the_isa_and_what_to_do() {
        let e = load_failure(
            &ptx(120, "8.7"),
            (13, 0),
            12020,
            "CUDA_ERROR_UNSUPPORTED_PTX_VERSION: the provided PTX was compiled with an unsupported toolchain."
                .into(),
        );
        assert_eq!(
            e.to_string(),
            "the CUDA driver (CUDA 12.2) cannot load the kernels NVRTC 12.8 compiled (PTX ISA 8.7 for \
             compute_120): CUDA_ERROR_UNSUPPORTED_PTX_VERSION: the provided PTX was compiled with an \
             unsupported toolchain.; this driver JIT-compiles PTX up to ISA 8.2; NVRTC 12.8 cannot assemble \
             SASS for sm_130, so update the NVIDIA driver to one of CUDA 12.8 or later (nvidia-smi shows the \
             driver's CUDA version), or build the image with an NVRTC that knows this GPU (a newer \
             nvidia-cuda-nvrtc wheel)"
        );
        let e = load_failure(
            &cubin(89, (12, 8)),
            (8, 9),
            11080,
            "CUDA_ERROR_NO_BINARY_FOR_GPU: no kernel image is available".into(),
        );
        let text = e.to_string();
        assert!(text.starts_with("the CUDA driver (CUDA 11.8) cannot load the kernels NVRTC 12.8 compiled (cubin for sm_89)"), "{text}");
        assert!(
            text.contains("update the NVIDIA driver to CUDA 12.x or later"),
            "{text}"
        );
    }
}
