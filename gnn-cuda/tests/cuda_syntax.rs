//! NVRTC needs the CUDA libraries, so on a machine without them the kernel source is checked by the host C++
//! compiler instead: a small shim stands in for the CUDA built-ins and `c++ -fsyntax-only` must accept the
//! source with no errors and no warnings except the unknown `#pragma unroll`. Skips when no compiler exists.

use std::process::Command;

use physalia_gnn_cuda::kernels::SOURCE;

const SHIM: &str = r#"
#include <math.h>
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static
struct float4 { float x, y, z, w; };
struct dim3 { unsigned x, y, z; };
static dim3 blockIdx, blockDim, threadIdx, gridDim;
float __shfl_xor_sync(unsigned, float, int);
unsigned __shfl_xor_sync(unsigned, unsigned, int);
float __int_as_float(int);
void __syncwarp();
void __syncthreads();
"#;

#[test]
fn kernel_source_is_valid_cpp_under_a_cuda_shim() {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    if Command::new(&cxx).arg("--version").output().is_err() {
        eprintln!("skipping: no C++ compiler ({cxx})");
        return;
    }
    let dir = std::env::temp_dir().join(format!("physalia-gnn-cuda-syntax-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let shim = dir.join("shim.h");
    let src = dir.join("kernels.cu");
    std::fs::write(&shim, SHIM).unwrap();
    std::fs::write(&src, SOURCE).unwrap();
    let out = Command::new(&cxx)
        .args([
            "-std=c++17",
            "-fsyntax-only",
            "-Wall",
            "-Wextra",
            "-Wno-unknown-pragmas",
        ])
        .arg("-include")
        .arg(&shim)
        .args(["-x", "c++"])
        .arg(&src)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.trim().is_empty(),
        "{cxx} rejects the kernels:\n{stderr}"
    );
}
