//! Kernel launches checked against the kernels' CUDA signatures.
//!
//! cudarc passes kernel arguments as untyped pointers: an argument list in the wrong order, or a `u32` where
//! the kernel takes a `u64`, is undefined behaviour on the GPU, not a compile error. [`Launch`] records the
//! type of each argument as it is pushed and, before launching, compares the list with the signature parsed
//! from [`crate::kernels::SOURCE`], so a mismatch is a [`GpuError::Shape`] naming the kernel and the argument.

use std::collections::HashMap;

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchArgs, LaunchConfig, PushKernelArg};

use crate::device::GpuError;

/// The CUDA spelling of a buffer's element type.
pub trait Elem {
    const C: &'static str;
}

impl Elem for f32 {
    const C: &'static str = "float";
}
impl Elem for f64 {
    const C: &'static str = "double";
}
impl Elem for u32 {
    const C: &'static str = "u32";
}
impl Elem for i32 {
    const C: &'static str = "int";
}
impl Elem for i64 {
    const C: &'static str = "i64";
}

/// The CUDA parameter type a kernel argument stands for (`float*`, `u32`, ...).
pub trait Describe {
    fn describe() -> String;
}

impl<T: Elem> Describe for &CudaSlice<T> {
    fn describe() -> String {
        format!("{}*", T::C)
    }
}
impl<T: Elem> Describe for &mut CudaSlice<T> {
    fn describe() -> String {
        format!("{}*", T::C)
    }
}
impl<T: Elem> Describe for &CudaView<'_, T> {
    fn describe() -> String {
        format!("{}*", T::C)
    }
}
impl<T: Elem> Describe for &mut CudaViewMut<'_, T> {
    fn describe() -> String {
        format!("{}*", T::C)
    }
}
impl Describe for &u32 {
    fn describe() -> String {
        "u32".into()
    }
}
impl Describe for &u64 {
    fn describe() -> String {
        "u64".into()
    }
}
impl Describe for &f32 {
    fn describe() -> String {
        "float".into()
    }
}

/// Parameter types of every `__global__` function of `source`, by name: `const` and `__restrict__` dropped,
/// `float4*` read as `float*` (the buffers are f32).
pub fn signatures(source: &str) -> HashMap<String, Vec<String>> {
    let mut out = HashMap::new();
    let mut rest = source;
    while let Some(at) = rest.find("__global__ void ") {
        rest = &rest[at + "__global__ void ".len()..];
        let open = rest
            .find('(')
            .expect("a kernel name is followed by its parameters");
        let close = rest.find(')').expect("a kernel's parameters end");
        let name = rest[..open].trim().to_string();
        let params = rest[open + 1..close]
            .split(',')
            .map(|p| {
                let words: Vec<&str> = p
                    .split_whitespace()
                    .filter(|w| *w != "const" && *w != "__restrict__")
                    .collect();
                // the last word is the parameter's name (a `*` may be glued to either side)
                let joined = words.join(" ");
                let name_start = joined
                    .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .map_or(0, |i| i + 1);
                let ty: String = joined[..name_start]
                    .chars()
                    .filter(|c| !c.is_whitespace())
                    .collect();
                if ty == "float4*" { "float*".into() } else { ty }
            })
            .collect();
        out.insert(name, params);
        rest = &rest[close..];
    }
    out
}

/// Compares the pushed argument types with the kernel's parameters.
pub fn check_args(name: &str, sig: &[String], got: &[String]) -> Result<(), GpuError> {
    if sig.len() != got.len() {
        return Err(GpuError::Shape(format!(
            "kernel {name} takes {} arguments, the launch passes {}",
            sig.len(),
            got.len()
        )));
    }
    for (i, (want, have)) in sig.iter().zip(got).enumerate() {
        if want != have {
            return Err(GpuError::Shape(format!(
                "kernel {name}: argument {i} is {have}, the kernel declares {want}"
            )));
        }
    }
    Ok(())
}

/// A launch whose argument types are checked against the kernel's signature.
pub struct Launch<'a> {
    b: LaunchArgs<'a>,
    name: &'static str,
    sig: &'a [String],
    kinds: Vec<String>,
}

impl<'a> Launch<'a> {
    pub fn new(b: LaunchArgs<'a>, name: &'static str, sig: &'a [String]) -> Launch<'a> {
        Launch {
            b,
            name,
            sig,
            kinds: Vec::with_capacity(sig.len()),
        }
    }

    pub fn arg<A: Describe>(&mut self, a: A) -> &mut Self
    where
        LaunchArgs<'a>: PushKernelArg<A>,
    {
        self.kinds.push(A::describe());
        self.b.arg(a);
        self
    }

    /// # Safety
    /// As `LaunchArgs::launch`: the buffers must hold what the kernel reads and writes for `cfg`.
    pub unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), GpuError> {
        check_args(self.name, self.sig, &self.kinds)?;
        // SAFETY: forwarded to the caller.
        unsafe { self.b.launch(cfg) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{KERNELS, SOURCE};

    #[test]
    fn every_kernel_signature_parses() {
        let s = signatures(SOURCE);
        assert_eq!(s.len(), KERNELS.len());
        for k in KERNELS {
            assert!(s.contains_key(*k), "{k}");
        }
        let v = |xs: &[&str]| xs.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(
            s["spmm_v4"],
            v(&[
                "i64*", "i64*", "u32*", "float*", "float*", "float*", "u32", "float*", "u32",
                "u32", "u32", "u64"
            ])
        );
        assert_eq!(s["gat_forward"].len(), 19);
        assert_eq!(s["gat_forward"][8], "u64");
        assert_eq!(s["copy_bandwidth"], v(&["float*", "float*", "u64"]));
        assert_eq!(s["cross_entropy"][1], "int*");
        assert_eq!(s["cross_entropy"][7], "double*");
    }

    #[test]
    fn mismatches_name_the_argument() {
        let sig = vec!["float*".to_string(), "u64".into()];
        assert!(check_args("k", &sig, &sig).is_ok());
        let e = check_args("k", &sig, &["float*".into(), "u32".into()]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "shape mismatch: kernel k: argument 1 is u32, the kernel declares u64"
        );
        let e = check_args("k", &sig, &["float*".into()]).unwrap_err();
        assert!(
            e.to_string()
                .contains("takes 2 arguments, the launch passes 1")
        );
        assert_eq!(<&CudaSlice<i64>>::describe(), "i64*");
        assert_eq!(<&mut CudaViewMut<'_, f32>>::describe(), "float*");
    }
}

#[cfg(test)]
mod launch_sites {
    use super::signatures;
    use crate::kernels::SOURCE;

    /// Every launch in `engine.rs` passes as many arguments as its kernel declares (the types are checked at
    /// run time by `Launch`; this catches a missing or extra argument without a GPU).
    #[test]
    fn engine_launches_pass_every_argument() {
        let sigs = signatures(SOURCE);
        let engine = include_str!("engine.rs");
        let mut seen = 0;
        for (at, _) in engine.match_indices(".launch(\"") {
            let name_start = at + ".launch(\"".len();
            let name = &engine[name_start..name_start + engine[name_start..].find('"').unwrap()];
            let body = &engine[name_start..];
            let end = body
                .find("b.launch(")
                .expect("a launch follows its arguments");
            let args = body[..end].matches(".arg(").count();
            assert_eq!(args, sigs[name].len(), "launch of {name} in engine.rs");
            seen += 1;
        }
        // SpMM picks its kernel at run time; the copy kernel is launched through `Launch::new`
        for (marker, name) in [
            ("self.launch(kernel)", "spmm_v4"),
            ("self.launch(kernel)", "spmm_scalar"),
            ("\"copy_bandwidth\", &sig)", "copy_bandwidth"),
        ] {
            let body = &engine[engine.find(marker).unwrap()..];
            let args = body[..body.find("b.launch(").unwrap()]
                .matches(".arg(")
                .count();
            assert_eq!(args, sigs[name].len(), "launch of {name} in engine.rs");
            seen += 1;
        }
        assert_eq!(seen, sigs.len(), "every kernel is launched from engine.rs");
    }
}
