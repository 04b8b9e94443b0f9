//! The CUDA device: a context on one GPU, a compute stream and a separate copy stream, the kernels of
//! [`crate::kernels`] compiled once by NVRTC, a cuBLAS handle for the dense products, and a pool of device
//! buffers keyed by size so the same shapes every epoch reuse the same memory.
//!
//! [`CudaEngine`] implements [`Ops`], so `physalia_gnn::DeviceModel` runs on it unchanged from the CPU device.
//! Nothing here runs unless [`CudaEngine::new`] succeeds, which probes first and returns a [`GpuError`]
//! instead of letting cudarc's loader panic.
//!
//! cudarc tracks a read and a write event on every buffer once a context has a second stream, so a copy on
//! the copy stream waits for the kernel that wrote its source, and a kernel waits for the copy that fills
//! its input, without explicit joins; halo rows move through pinned host buffers ([`HaloStaging`]) on the
//! copy stream while the compute stream keeps running.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, CudaView, DeviceRepr,
    LaunchConfig, PinnedHostSlice, ValidAsZeroBits, sys,
};

use physalia_gnn::device::{
    AdamStep, AttnDropout, Dropout, GatShape, Ops, View, check, check_copy2d, check_labels,
    gemm_shape,
};
use physalia_gnn::sparse::SparseOp;
use physalia_gnn::{Activation, Matrix};

use crate::compile::{compile_for_device, load_failure};
use crate::device::{DeviceInfo, GpuError, describe, probe};
use crate::kernels::{
    BLOCK, COLSUM_CHUNK_ROWS, HEAVY_ROW_EDGES, HeavyPlan, KERNELS, REDUCE_THREADS, SOURCE,
    colsum_chunks, elementwise_launch, mask_threshold, rows_launch, spmm_lanes,
};
use crate::launch::{Launch, signatures};
use crate::ops::{HostCsr, act_code};

/// A dense row-major f32 matrix in device memory (its buffer may be longer: one element for an empty one).
pub struct DeviceMatrix {
    rows: usize,
    cols: usize,
    buf: CudaSlice<f32>,
}

impl DeviceMatrix {
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }
    fn len(&self) -> usize {
        self.rows * self.cols
    }
}

/// A sparse operator and its explicit transpose in device memory.
pub struct DeviceCsr {
    n_dst: usize,
    n_src: usize,
    nnz: usize,
    indptr: CudaSlice<i64>,
    indices: CudaSlice<u32>,
    values: CudaSlice<f32>,
    /// The rows with more than `HEAVY_ROW_EDGES` edges.
    heavy: Option<DeviceHeavy>,
    /// The transpose; `None` for an operator equal to its transpose (GCN's normalised adjacency of an
    /// undirected graph), whose transposed products read the forward arrays.
    t: Option<DeviceTranspose>,
    /// For each transposed entry, its forward position: GAT's attention gradient alone reads it, so it is
    /// uploaded only for an operator whose weights are all 1 (GAT's structure).
    t_perm: Option<CudaSlice<u32>>,
}

/// The arrays of a CSR's transpose.
struct DeviceTranspose {
    indptr: CudaSlice<i64>,
    indices: CudaSlice<u32>,
    values: CudaSlice<f32>,
    heavy: Option<DeviceHeavy>,
}

/// A [`HeavyPlan`] in device memory.
struct DeviceHeavy {
    rows: CudaSlice<u32>,
    first: CudaSlice<u32>,
    lo: CudaSlice<i64>,
    hi: CudaSlice<i64>,
    n_heavy: u32,
    n_chunks: usize,
}

impl DeviceCsr {
    pub fn nnz(&self) -> usize {
        self.nnz
    }

    /// Whether the transposed products read the forward arrays (the operator is symmetric).
    pub fn shares_transpose(&self) -> bool {
        self.t.is_none()
    }

    /// The transpose's row pointers, indices, weights and heavy rows.
    fn transposed(
        &self,
    ) -> (
        &CudaSlice<i64>,
        &CudaSlice<u32>,
        &CudaSlice<f32>,
        Option<&DeviceHeavy>,
    ) {
        match &self.t {
            Some(t) => (&t.indptr, &t.indices, &t.values, t.heavy.as_ref()),
            None => (
                &self.indptr,
                &self.indices,
                &self.values,
                self.heavy.as_ref(),
            ),
        }
    }
    /// Bytes one SpMM over this operator must move at width `d`: the CSR arrays, every source row once per
    /// edge that reads it (an upper bound of what the caches must serve), the output rows once.
    pub fn spmm_bytes(&self, d: usize, transpose: bool) -> (u64, u64) {
        let (rows, _) = if transpose {
            (self.n_src, self.n_dst)
        } else {
            (self.n_dst, self.n_src)
        };
        let csr = (rows + 1) as u64 * 8 + self.nnz as u64 * 8;
        let gathered = self.nnz as u64 * d as u64 * 4;
        let written = rows as u64 * d as u64 * 4;
        (csr + written, csr + gathered + written)
    }
}

/// A list of u32 on the device, with its host copy (for bounds checks before a kernel reads it).
pub struct DeviceIdx {
    host: Vec<u32>,
    buf: CudaSlice<u32>,
}

/// Class labels on the device (i32), with their host copy.
pub struct DeviceLabels {
    host: Vec<i32>,
    buf: CudaSlice<i32>,
}

/// Reuse counts of the buffer pool, and where the device's memory peaked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub reused: u64,
    pub allocated: u64,
    pub cached_bytes: u64,
    /// The most device memory in use (total - free: the context, every buffer and the driver's pool) seen
    /// right after an allocation of 1 MiB or more, since the engine opened or [`CudaEngine::reset_peak`]. A
    /// peak can only rise at an allocation, so this is the peak of everything the engine allocates, to
    /// within the small buffers allocated after the last large one.
    pub peak_used_bytes: u64,
    /// What the pool held cached (free buffers of other sizes) at that peak: memory a bounded cache would
    /// have handed back.
    pub cached_at_peak: u64,
    /// The allocation (f32 elements) that set the peak.
    pub peak_alloc_len: u64,
}

/// Allocations from this size (1 MiB of f32) on update [`PoolStats::peak_used_bytes`].
const PEAK_PROBE_FLOATS: usize = 1 << 18;

/// Where the engine's freed buffers go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolMode {
    /// Kept by exact size and handed out again: after the first epoch no allocator call, but a size one
    /// phase used stays cached while another phase needs other sizes, so the device holds the sum of every
    /// size's largest working set.
    Exact,
    /// Handed back to the driver's stream-ordered pool (`cuMemFreeAsync`), which is told to keep what it
    /// holds (no release threshold) and reuses it for buffers of any size: the device holds about the
    /// largest working set of any moment.
    Driver,
}

impl PoolMode {
    /// `PHYSALIA_GPU_POOL` (`exact` or `driver`), or the default ([`PoolMode::Driver`]).
    pub fn from_env() -> Result<PoolMode, GpuError> {
        match std::env::var("PHYSALIA_GPU_POOL") {
            Err(_) => Ok(PoolMode::Driver),
            Ok(v) => match v.as_str() {
                "exact" => Ok(PoolMode::Exact),
                "driver" => Ok(PoolMode::Driver),
                other => Err(GpuError::Driver(format!(
                    "PHYSALIA_GPU_POOL={other:?}: expected \"exact\" or \"driver\""
                ))),
            },
        }
    }
}

/// Pinned host buffers and the events of the last copies, for moving halo rows on the copy stream.
pub struct HaloStaging {
    send: PinnedHostSlice<f32>,
    recv: PinnedHostSlice<f32>,
    send_len: usize,
    send_done: Option<CudaEvent>,
    recv_done: Option<CudaEvent>,
}

impl HaloStaging {
    pub fn capacity(&self) -> usize {
        self.send.len()
    }
}

pub struct CudaEngine {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    blas: CudaBlas,
    funcs: HashMap<&'static str, CudaFunction>,
    sigs: HashMap<String, Vec<String>>,
    pool: HashMap<usize, Vec<CudaSlice<f32>>>,
    pool64: HashMap<usize, Vec<CudaSlice<f64>>>,
    pool_mode: PoolMode,
    stats: PoolStats,
    dummy_u32: CudaSlice<u32>,
    dummy_f32: CudaSlice<f32>,
    device: DeviceInfo,
    driver_version: u32,
}

fn blas_err(e: impl std::fmt::Debug) -> GpuError {
    GpuError::Blas(format!("{e:?}"))
}

fn launch_cfg((grid, block): (u32, u32)) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The kernels' file name in NVRTC's messages.
pub const KERNELS_FILE: &str = "physalia_gnn_kernels.cu";

fn u32_size(n: usize, what: &str) -> Result<u32, GpuError> {
    u32::try_from(n)
        .map_err(|_| GpuError::Shape(format!("{what} = {n} exceeds the kernels' 32-bit range")))
}

/// A [`physalia_gnn::profile`] span around one operation on the compute stream. While profiling is on it
/// waits for the stream before it starts and again when dropped, so the span holds the operation's
/// device time (and the launch gaps it no longer hides: a profiled epoch is slower than a plain one);
/// otherwise it costs one relaxed load.
struct OpSpan {
    stream: Option<Arc<CudaStream>>,
    _span: physalia_gnn::profile::Span,
}

impl OpSpan {
    fn new(stream: &Arc<CudaStream>, name: &'static str) -> OpSpan {
        let stream = physalia_gnn::profile::on().then(|| stream.clone());
        if let Some(s) = &stream {
            // an error here shows again at the operation's own synchronisation
            let _ = s.synchronize();
        }
        OpSpan {
            stream,
            _span: physalia_gnn::profile::span(name),
        }
    }
}

impl Drop for OpSpan {
    fn drop(&mut self) {
        if let Some(s) = &self.stream {
            let _ = s.synchronize();
        }
        // then `_span` drops and counts the time
    }
}

impl CudaEngine {
    /// Opens GPU `index`: probes the driver and the libraries (a clear error, never a panic, when one is
    /// missing), creates the streams, compiles the kernels for the device's architecture and loads them.
    /// Freed buffers go where [`PoolMode::from_env`] says.
    pub fn new(index: usize) -> Result<CudaEngine, GpuError> {
        Self::with_pool(index, PoolMode::from_env()?)
    }

    /// [`CudaEngine::new`] with freed buffers going to `pool_mode` (the driver's pool falls back to the
    /// exact-size cache on a device without one).
    pub fn with_pool(index: usize, pool_mode: PoolMode) -> Result<CudaEngine, GpuError> {
        let info = probe()?;
        let device = info.devices.get(index).cloned().ok_or(GpuError::NoDevice {
            index,
            count: info.devices.len(),
        })?;
        if !info.nvrtc {
            return Err(GpuError::MissingLibrary { name: "libnvrtc" });
        }
        if !info.cublas {
            return Err(GpuError::MissingLibrary { name: "libcublas" });
        }
        let driver_version = info.driver_version;
        let opened =
            std::panic::catch_unwind(|| Self::open(device.clone(), driver_version, pool_mode));
        match opened {
            Ok(r) => r,
            Err(_) => Err(GpuError::Driver(
                "cudarc panicked while opening the device (a symbol missing from an old driver or library)"
                    .into(),
            )),
        }
    }

    fn open(
        device: DeviceInfo,
        driver_version: u32,
        pool_mode: PoolMode,
    ) -> Result<CudaEngine, GpuError> {
        let ctx = CudaContext::new(device.index)?;
        let pool_mode = match pool_mode {
            PoolMode::Driver if keep_driver_pool(&ctx).is_ok() => PoolMode::Driver,
            // no stream-ordered allocator (or its pool refused the setting): our own cache
            _ => PoolMode::Exact,
        };
        let stream = ctx.new_stream()?;
        let copy = ctx.new_stream()?;
        // SASS for the device's own architecture where NVRTC can assemble it: a cubin loads on any driver
        // of NVRTC's CUDA major version, where PTX needs a driver as new as NVRTC (`compile`'s docs)
        let compiled = compile_for_device(SOURCE, KERNELS_FILE, device.compute_capability)?;
        let module = ctx
            .load_module(compiled.clone().into_module_image())
            .map_err(|e| {
                load_failure(
                    &compiled,
                    device.compute_capability,
                    driver_version,
                    describe(&e),
                )
            })?;
        let mut funcs = HashMap::new();
        for &k in KERNELS {
            funcs.insert(k, module.load_function(k)?);
        }
        let blas = CudaBlas::new(stream.clone()).map_err(blas_err)?;
        let dummy_u32 = stream.alloc_zeros::<u32>(1)?;
        let dummy_f32 = stream.alloc_zeros::<f32>(1)?;
        Ok(CudaEngine {
            ctx,
            stream,
            copy,
            blas,
            funcs,
            sigs: signatures(SOURCE),
            pool: HashMap::new(),
            pool64: HashMap::new(),
            pool_mode,
            stats: PoolStats::default(),
            dummy_u32,
            dummy_f32,
            device,
            driver_version,
        })
    }

    pub fn device(&self) -> &DeviceInfo {
        &self.device
    }

    pub fn driver_version(&self) -> u32 {
        self.driver_version
    }

    pub fn pool_stats(&self) -> PoolStats {
        self.stats
    }

    /// (free, total) device memory in bytes.
    pub fn memory(&self) -> Result<(u64, u64), GpuError> {
        let (f, t) = self.ctx.mem_get_info()?;
        Ok((f as u64, t as u64))
    }

    fn func(&self, name: &'static str) -> &CudaFunction {
        self.funcs
            .get(name)
            .expect("every kernel of KERNELS is loaded")
    }

    /// A launch of `name` on the compute stream, its arguments checked against the kernel's signature.
    fn launch(&self, name: &'static str) -> Launch<'_> {
        let sig = self
            .sigs
            .get(name)
            .expect("every kernel of KERNELS has a signature");
        Launch::new(self.stream.launch_builder(self.func(name)), name, sig)
    }

    fn upload_vec<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        v: &[T],
    ) -> Result<CudaSlice<T>, GpuError> {
        if v.is_empty() {
            return Ok(self.stream.alloc_zeros::<T>(1)?);
        }
        Ok(self.stream.clone_htod(v)?)
    }

    fn take(&mut self, len: usize) -> Result<CudaSlice<f32>, GpuError> {
        let len = len.max(1);
        if let Some(b) = self.pool.get_mut(&len).and_then(|v| v.pop()) {
            self.stats.reused += 1;
            self.stats.cached_bytes -= len as u64 * 4;
            return Ok(b);
        }
        self.stats.allocated += 1;
        // SAFETY: the pool hands out buffers whose contents the next kernel overwrites (`alloc`) or that are
        // zeroed (`zeros`).
        let b = unsafe { self.stream.alloc::<f32>(len) }?;
        // the peak moves with large buffers; asking the driver after every small one (a mini-batch step
        // makes hundreds) would cost more than it tells
        if len >= PEAK_PROBE_FLOATS {
            self.note_peak(len);
        }
        Ok(b)
    }

    /// Records the device's use after an allocation of `len` floats if it is the highest seen.
    fn note_peak(&mut self, len: usize) {
        if let Ok((free, total)) = self.ctx.mem_get_info() {
            let used = (total - free) as u64;
            if used > self.stats.peak_used_bytes {
                self.stats.peak_used_bytes = used;
                self.stats.cached_at_peak = self.stats.cached_bytes;
                self.stats.peak_alloc_len = len as u64;
            }
        }
    }

    /// Starts a new peak (the memory in use now), so a caller can find which phase sets it.
    pub fn reset_peak(&mut self) {
        self.stats.peak_used_bytes = 0;
        self.stats.cached_at_peak = 0;
        self.stats.peak_alloc_len = 0;
        self.note_peak(0);
    }

    fn take64(&mut self, len: usize) -> Result<CudaSlice<f64>, GpuError> {
        let len = len.max(1);
        if let Some(b) = self.pool64.get_mut(&len).and_then(|v| v.pop()) {
            return Ok(b);
        }
        // SAFETY: as in `take`; the kernels write every element they later read.
        Ok(unsafe { self.stream.alloc::<f64>(len) }?)
    }

    fn give64(&mut self, b: CudaSlice<f64>) {
        if self.pool_mode == PoolMode::Exact {
            self.pool64.entry(b.len()).or_default().push(b);
        }
    }

    /// A buffer no longer used: into the exact-size cache, or back to the driver's pool (dropping it frees
    /// it on the stream, after the work queued so far).
    fn give(&mut self, b: CudaSlice<f32>) {
        if self.pool_mode == PoolMode::Exact {
            self.stats.cached_bytes += b.len() as u64 * 4;
            self.pool.entry(b.len()).or_default().push(b);
        }
    }

    /// Where freed buffers go (the driver's pool when the device has one, unless `PHYSALIA_GPU_POOL=exact`).
    pub fn pool_mode(&self) -> PoolMode {
        self.pool_mode
    }

    /// Drops every cached buffer and hands what the driver's pool keeps unused back to the device, once the
    /// queued work is done.
    pub fn trim_pool(&mut self) {
        self.pool.clear();
        self.pool64.clear();
        self.stats.cached_bytes = 0;
        if self.stream.synchronize().is_ok() {
            // a device without a stream-ordered pool frees synchronously: nothing to hand back
            let _ = trim_driver_pool(&self.ctx);
        }
    }

    /// Milliseconds per call of `f` on the compute stream (events around `reps` calls, after one warm-up).
    pub fn time_ms(
        &mut self,
        reps: u32,
        mut f: impl FnMut(&mut CudaEngine) -> Result<(), GpuError>,
    ) -> Result<f64, GpuError> {
        f(self)?;
        let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.stream.record_event(timing)?;
        for _ in 0..reps.max(1) {
            f(self)?;
        }
        let end = self.stream.record_event(timing)?;
        Ok(start.elapsed_ms(&end)? as f64 / reps.max(1) as f64)
    }

    /// Device-to-device copy bandwidth (bytes read + bytes written per second, in GB/s) of a plain float4
    /// copy kernel over `bytes`: the yardstick for SpMM's achieved bandwidth.
    pub fn copy_bandwidth_gbs(&mut self, bytes: usize, reps: u32) -> Result<f64, GpuError> {
        let n4 = (bytes / 16).max(1);
        let src = self.stream.alloc_zeros::<f32>(n4 * 4)?;
        let mut dst = self.stream.alloc_zeros::<f32>(n4 * 4)?;
        let n4_64 = n4 as u64;
        let (grid, block) = (
            (n4 as u64).div_ceil(BLOCK as u64).min(4 * 65_535) as u32,
            BLOCK,
        );
        let ms = {
            let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
            let f = self.func("copy_bandwidth").clone();
            let sig = self.sigs["copy_bandwidth"].clone();
            let mut run = |stream: &Arc<CudaStream>| -> Result<(), GpuError> {
                let mut b = Launch::new(stream.launch_builder(&f), "copy_bandwidth", &sig);
                b.arg(&src).arg(&mut dst).arg(&n4_64);
                // SAFETY: src and dst hold n4 float4s.
                unsafe { b.launch(launch_cfg((grid, block))) }?;
                Ok(())
            };
            run(&self.stream)?;
            let start = self.stream.record_event(timing)?;
            for _ in 0..reps.max(1) {
                run(&self.stream)?;
            }
            let end = self.stream.record_event(timing)?;
            start.elapsed_ms(&end)? as f64 / reps.max(1) as f64
        };
        Ok(2.0 * (n4 * 16) as f64 / (ms / 1e3) / 1e9)
    }

    /// Pinned host buffers for up to `capacity` f32 of halo rows each way.
    pub fn halo_staging(&self, capacity: usize) -> Result<HaloStaging, GpuError> {
        // plain page-locked memory (not write-combined): the host both reads the rows to send and writes the
        // rows received
        // SAFETY: the buffers are written (by a copy or by the host) before they are read.
        let (send, recv) = unsafe {
            (
                self.ctx
                    .alloc_pinned_with_flags::<f32>(capacity.max(1), 0)?,
                self.ctx
                    .alloc_pinned_with_flags::<f32>(capacity.max(1), 0)?,
            )
        };
        Ok(HaloStaging {
            send,
            recv,
            send_len: 0,
            send_done: None,
            recv_done: None,
        })
    }

    /// Gathers rows `rows` of `src` (compute stream) and starts copying them to the pinned send buffer on the
    /// copy stream; returns at once. [`CudaEngine::sent_rows`] waits for the copy.
    pub fn stage_send(
        &mut self,
        st: &mut HaloStaging,
        src: &DeviceMatrix,
        rows: &DeviceIdx,
    ) -> Result<(), GpuError> {
        let n = rows.host.len() * src.cols;
        check(n <= st.send.len(), || {
            format!(
                "{n} halo values exceed the staging capacity {}",
                st.send.len()
            )
        })?;
        st.send_len = n;
        if n == 0 {
            st.send_done = None;
            return Ok(());
        }
        let mut packed = self.alloc(rows.host.len(), src.cols)?;
        self.gather_rows(src, rows, &mut packed)?;
        if let Some(e) = st.send_done.take() {
            e.synchronize()?;
        }
        let dst = &mut st.send.as_mut_slice()?[..n];
        self.copy.memcpy_dtoh(&packed.buf.slice(0..n), dst)?;
        st.send_done = Some(self.copy.record_event(None)?);
        self.recycle(packed);
        Ok(())
    }

    /// The rows of the last [`CudaEngine::stage_send`], once their copy has finished.
    pub fn sent_rows<'a>(&self, st: &'a HaloStaging) -> Result<&'a [f32], GpuError> {
        if let Some(e) = &st.send_done {
            e.synchronize()?;
        }
        Ok(&st.send.as_slice()?[..st.send_len])
    }

    /// Copies received halo rows (host, `n_rows x cols`) through the pinned buffer to the device on the copy
    /// stream. Kernels reading the returned matrix wait for the copy; the host returns at once.
    pub fn stage_recv(
        &mut self,
        st: &mut HaloStaging,
        rows: &[f32],
        n_rows: usize,
        cols: usize,
    ) -> Result<DeviceMatrix, GpuError> {
        let n = n_rows * cols;
        check(rows.len() == n && n <= st.recv.len(), || {
            format!(
                "{} received values for {n_rows}x{cols} (capacity {})",
                rows.len(),
                st.recv.len()
            )
        })?;
        let mut out = self.alloc(n_rows, cols)?;
        if n == 0 {
            return Ok(out);
        }
        if let Some(e) = st.recv_done.take() {
            // the previous copy still reads the pinned buffer
            e.synchronize()?;
        }
        let pinned = &mut st.recv.as_mut_slice()?[..n];
        pinned.copy_from_slice(rows);
        self.copy.memcpy_htod(&*pinned, &mut out.buf)?;
        st.recv_done = Some(self.copy.record_event(None)?);
        Ok(out)
    }

    /// The heavy rows of `indptr` and their chunks on the device (`None`: no row is heavy).
    fn upload_heavy(&self, indptr: &[i64]) -> Result<Option<DeviceHeavy>, GpuError> {
        let plan = HeavyPlan::of(indptr);
        if plan.is_empty() {
            return Ok(None);
        }
        Ok(Some(DeviceHeavy {
            rows: self.upload_vec(&plan.rows)?,
            first: self.upload_vec(&plan.first)?,
            lo: self.upload_vec(&plan.lo)?,
            hi: self.upload_vec(&plan.hi)?,
            n_heavy: plan.rows.len() as u32,
            n_chunks: plan.chunks(),
        }))
    }

    /// SpMM over `indptr`/`indices`/`values` (either direction): the light rows in one pass; the heavy rows'
    /// chunks in a second into partial rows, summed per row in chunk order by a third.
    #[allow(clippy::too_many_arguments)]
    fn launch_spmm(
        &mut self,
        indptr: &CudaSlice<i64>,
        indices: &CudaSlice<u32>,
        values: &CudaSlice<f32>,
        heavy: Option<&DeviceHeavy>,
        own: &DeviceMatrix,
        halo: Option<&DeviceMatrix>,
        y: &mut DeviceMatrix,
    ) -> Result<(), GpuError> {
        let d = own.cols;
        if y.rows == 0 || d == 0 {
            return Ok(());
        }
        let n_rows = y.rows;
        let lo = indptr.slice(0..n_rows);
        let hi = indptr.slice(1..n_rows + 1);
        let threshold = heavy.map_or(u64::MAX, |_| HEAVY_ROW_EDGES);
        let edges = (&lo, &hi, indices, values);
        self.spmm_pass(edges, own, halo, &mut y.buf, n_rows, d, threshold)?;
        let Some(h) = heavy else {
            return Ok(());
        };
        let mut partial = self.take(h.n_chunks * d)?;
        let edges = (&h.lo.slice(..), &h.hi.slice(..), indices, values);
        self.spmm_pass(edges, own, halo, &mut partial, h.n_chunks, d, u64::MAX)?;
        let d32 = u32_size(d, "width")?;
        let mut b = self.launch("spmm_heavy_reduce");
        b.arg(&h.rows)
            .arg(&h.first)
            .arg(&partial)
            .arg(&mut y.buf)
            .arg(&h.n_heavy)
            .arg(&d32);
        // SAFETY: `partial` holds n_chunks x d floats, `first` n_heavy + 1 chunk bounds, `rows` < y.rows.
        unsafe { b.launch(launch_cfg(elementwise_launch(h.n_heavy as usize * d))) }?;
        self.give(partial);
        Ok(())
    }

    /// One SpMM launch: output row `r` sums edges `lo[r]..hi[r]`, skipping rows of more than `heavy` edges.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn spmm_pass(
        &self,
        (lo, hi, indices, values): (
            &CudaView<'_, i64>,
            &CudaView<'_, i64>,
            &CudaSlice<u32>,
            &CudaSlice<f32>,
        ),
        own: &DeviceMatrix,
        halo: Option<&DeviceMatrix>,
        y: &mut CudaSlice<f32>,
        rows: usize,
        d: usize,
        heavy: u64,
    ) -> Result<(), GpuError> {
        let vec4 = d.is_multiple_of(4);
        let lanes = spmm_lanes(d, vec4);
        let kernel = if vec4 { "spmm_v4" } else { "spmm_scalar" };
        let n_own = u32_size(own.rows, "source rows")?;
        let n_rows = u32_size(rows, "output rows")?;
        let d32 = u32_size(d, "width")?;
        let halo_buf = halo.map_or(&self.dummy_f32, |h| &h.buf);
        let mut b = self.launch(kernel);
        b.arg(lo)
            .arg(hi)
            .arg(indices)
            .arg(values)
            .arg(&own.buf)
            .arg(halo_buf)
            .arg(&n_own)
            .arg(y)
            .arg(&n_rows)
            .arg(&d32)
            .arg(&lanes)
            .arg(&heavy);
        // SAFETY: shapes checked by the callers; buffers hold rows x d floats, 16-byte aligned for float4.
        unsafe { b.launch(launch_cfg(rows_launch(rows, lanes))) }?;
        Ok(())
    }
}

/// The scalar arguments shared by `activation_backward` and `activation_backward_over`.
struct ActGradArgs {
    rows: u32,
    cols: u32,
    row0: u32,
    code: u32,
    use_mask: u32,
    key: u64,
    thr: u32,
    scale: f32,
    cfg: LaunchConfig,
}

impl ActGradArgs {
    /// `None` when `dy` is empty (nothing to launch).
    fn new(
        dy: &DeviceMatrix,
        gids: Option<&DeviceIdx>,
        row0: usize,
        act: Activation,
        d: Option<Dropout>,
    ) -> Result<Option<ActGradArgs>, GpuError> {
        check(gids.is_none_or(|g| g.host.len() >= row0 + dy.rows), || {
            "activation_backward: fewer global ids than rows".into()
        })?;
        if dy.len() == 0 {
            return Ok(None);
        }
        Ok(Some(ActGradArgs {
            rows: u32_size(dy.rows, "rows")?,
            cols: dy.cols as u32,
            row0: u32_size(row0, "rows")?,
            code: act_code(act),
            use_mask: d.is_some() as u32,
            key: d.map_or(0, |d| d.key),
            thr: d.map_or(0, |d| mask_threshold(d.p)),
            scale: d.map_or(1.0, |d| 1.0 / (1.0 - d.p)),
            cfg: launch_cfg(elementwise_launch(dy.len())),
        }))
    }
}

fn gids_arg<'a>(e: &'a CudaEngine, gids: Option<&'a DeviceIdx>) -> (&'a CudaSlice<u32>, u32) {
    match gids {
        Some(g) => (&g.buf, 1),
        None => (&e.dummy_u32, 0),
    }
}

fn gat_checks(
    a: &DeviceCsr,
    m_own: &DeviceMatrix,
    m_halo: Option<&DeviceMatrix>,
    s_dst: &DeviceMatrix,
    shape: GatShape,
) -> Result<(), GpuError> {
    let (h, c) = (shape.heads as usize, shape.c as usize);
    let width = h * c + h;
    let n_halo = m_halo.map_or(0, |m| m.rows);
    check(
        m_own.cols == width
            && m_halo.is_none_or(|m| m.cols == width)
            && m_own.rows + n_halo == a.n_src
            && s_dst.cols == h
            && s_dst.rows >= a.n_dst,
        || "gat message shapes".into(),
    )?;
    Ok(())
}

impl Ops for CudaEngine {
    type Mat = DeviceMatrix;
    type Csr = DeviceCsr;
    type Idx = DeviceIdx;
    type Labels = DeviceLabels;
    type Error = GpuError;

    fn dims(&self, m: &DeviceMatrix) -> (usize, usize) {
        m.shape()
    }

    fn upload(&mut self, m: &Matrix) -> Result<DeviceMatrix, GpuError> {
        let mut out = self.alloc(m.rows(), m.cols())?;
        if !m.data().is_empty() {
            self.stream.memcpy_htod(m.data(), &mut out.buf)?;
        }
        Ok(out)
    }

    fn download(&mut self, m: &DeviceMatrix) -> Result<Matrix, GpuError> {
        let n = m.len();
        if n == 0 {
            return Ok(Matrix::zeros(m.rows, m.cols));
        }
        let v = self.stream.clone_dtoh(&m.buf.slice(0..n))?;
        Ok(Matrix::from_vec(m.rows, m.cols, v))
    }

    fn alloc(&mut self, rows: usize, cols: usize) -> Result<DeviceMatrix, GpuError> {
        Ok(DeviceMatrix {
            rows,
            cols,
            buf: self.take(rows * cols)?,
        })
    }

    fn zeros(&mut self, rows: usize, cols: usize) -> Result<DeviceMatrix, GpuError> {
        let mut m = self.alloc(rows, cols)?;
        self.stream.memset_zeros(&mut m.buf)?;
        Ok(m)
    }

    fn recycle(&mut self, m: DeviceMatrix) {
        self.give(m.buf);
    }

    fn upload_csr(&mut self, op: &SparseOp) -> Result<DeviceCsr, GpuError> {
        let h = HostCsr::from_op(op);
        u32_size(h.n_src.max(h.n_dst), "nodes")?;
        let t = if h.is_symmetric() {
            None
        } else {
            Some(DeviceTranspose {
                indptr: self.upload_vec(&h.t_indptr)?,
                indices: self.upload_vec(&h.t_indices)?,
                values: self.upload_vec(&h.t_values)?,
                heavy: self.upload_heavy(&h.t_indptr)?,
            })
        };
        // GAT's structure has every weight 1 (GCN's and the mean's are 1 only on nodes without neighbours)
        let t_perm = if h.values.iter().all(|&v| v == 1.0) {
            Some(self.upload_vec(&h.t_perm)?)
        } else {
            None
        };
        Ok(DeviceCsr {
            n_dst: h.n_dst,
            n_src: h.n_src,
            nnz: h.nnz(),
            indptr: self.upload_vec(&h.indptr)?,
            indices: self.upload_vec(&h.indices)?,
            values: self.upload_vec(&h.values)?,
            heavy: self.upload_heavy(&h.indptr)?,
            t,
            t_perm,
        })
    }

    fn upload_idx(&mut self, v: &[u32]) -> Result<DeviceIdx, GpuError> {
        Ok(DeviceIdx {
            host: v.to_vec(),
            buf: self.upload_vec(v)?,
        })
    }

    fn upload_labels(&mut self, v: &[i64]) -> Result<DeviceLabels, GpuError> {
        let host: Vec<i32> = v.iter().map(|&l| l as i32).collect();
        Ok(DeviceLabels {
            buf: self.upload_vec(&host)?,
            host,
        })
    }

    fn gemm(
        &mut self,
        a: View<'_, DeviceMatrix>,
        b: View<'_, DeviceMatrix>,
        beta: f32,
        c: &mut DeviceMatrix,
    ) -> Result<(), GpuError> {
        let _p = OpSpan::new(&self.stream, "gemm");
        let (m, n, k) = gemm_shape(&a, &b, c.shape())?;
        for v in [&a, &b] {
            let end = if v.rows == 0 || v.cols == 0 {
                0
            } else {
                v.offset + (v.rows - 1) * v.ld + v.cols
            };
            check(end <= v.m.len().max(1) && end <= v.m.buf.len(), || {
                "gemm operand view out of bounds".into()
            })?;
        }
        if m == 0 || n == 0 {
            return Ok(());
        }
        let int = |x: usize| {
            i32::try_from(x).map_err(|_| GpuError::Shape(format!("gemm dimension {x} exceeds i32")))
        };
        // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: cuBLAS gets B first, with the
        // row-major leading dimensions as they are.
        let op = |t: bool| {
            if t {
                cublasOperation_t::CUBLAS_OP_T
            } else {
                cublasOperation_t::CUBLAS_OP_N
            }
        };
        let cfg = GemmConfig {
            transa: op(b.trans),
            transb: op(a.trans),
            m: int(n)?,
            n: int(m)?,
            k: int(k)?,
            alpha: 1.0f32,
            lda: int(b.ld.max(1))?,
            ldb: int(a.ld.max(1))?,
            beta,
            ldc: int(n)?,
        };
        let av = a.m.buf.slice(a.offset..);
        let bv = b.m.buf.slice(b.offset..);
        // SAFETY: the views' extents were checked against their buffers and C is m x n.
        unsafe { self.blas.gemm(cfg, &bv, &av, &mut c.buf) }.map_err(blas_err)
    }

    fn spmm(
        &mut self,
        a: &DeviceCsr,
        own: &DeviceMatrix,
        halo: Option<&DeviceMatrix>,
        y: &mut DeviceMatrix,
    ) -> Result<(), GpuError> {
        let _p = OpSpan::new(&self.stream, "spmm");
        let d = own.cols;
        let n_halo = halo.map_or(0, |h| h.rows);
        check(
            own.rows + n_halo == a.n_src
                && y.shape() == (a.n_dst, d)
                && halo.is_none_or(|h| h.cols == d),
            || format!("spmm: {} + {n_halo} source rows for {}", own.rows, a.n_src),
        )?;
        self.launch_spmm(
            &a.indptr,
            &a.indices,
            &a.values,
            a.heavy.as_ref(),
            own,
            halo,
            y,
        )
    }

    fn spmm_t(
        &mut self,
        a: &DeviceCsr,
        x: &DeviceMatrix,
        y: &mut DeviceMatrix,
    ) -> Result<(), GpuError> {
        let _p = OpSpan::new(&self.stream, "spmm_t");
        check(x.rows == a.n_dst && y.shape() == (a.n_src, x.cols), || {
            format!("spmm_t: {} rows for {} destinations", x.rows, a.n_dst)
        })?;
        let (indptr, indices, values, heavy) = a.transposed();
        self.launch_spmm(indptr, indices, values, heavy, x, None, y)
    }

    fn gat_messages(
        &mut self,
        z: &DeviceMatrix,
        a_src: &DeviceMatrix,
        a_dst: &DeviceMatrix,
        shape: GatShape,
        m: &mut DeviceMatrix,
        s_dst: &mut DeviceMatrix,
    ) -> Result<(), GpuError> {
        let _p = OpSpan::new(&self.stream, "gat_messages");
        let (h, c) = (shape.heads as usize, shape.c as usize);
        let n = z.rows;
        check(
            z.cols == h * c
                && m.shape() == (n, h * c + h)
                && s_dst.shape() == (n, h)
                && a_src.len() == h * c
                && a_dst.len() == h * c,
            || "gat_messages shapes".into(),
        )?;
        if n == 0 {
            return Ok(());
        }
        let n32 = u32_size(n, "rows")?;
        let mut b = self.launch("gat_messages");
        b.arg(&z.buf)
            .arg(&a_src.buf)
            .arg(&a_dst.buf)
            .arg(&mut m.buf)
            .arg(&mut s_dst.buf)
            .arg(&n32)
            .arg(&shape.heads)
            .arg(&shape.c);
        // SAFETY: shapes checked above.
        unsafe { b.launch(launch_cfg(rows_launch(n, 32))) }?;
        Ok(())
    }

    fn gat_forward(
        &mut self,
        a: &DeviceCsr,
        m_own: &DeviceMatrix,
        m_halo: Option<&DeviceMatrix>,
        s_dst: &DeviceMatrix,
        gids: Option<&DeviceIdx>,
        drop: Option<AttnDropout>,
        shape: GatShape,
        alpha: &mut DeviceMatrix,
        out: &mut DeviceMatrix,
    ) -> Result<(), GpuError> {
        let _p = OpSpan::new(&self.stream, "gat_forward");
        gat_checks(a, m_own, m_halo, s_dst, shape)?;
        let d_out = shape.d_out();
        check(
            alpha.shape() == (a.nnz, shape.heads as usize)
                && out.shape() == (a.n_dst, d_out)
                && gids.is_none_or(|g| g.host.len() >= a.n_src),
            || "gat_forward output shapes".into(),
        )?;
        if a.n_dst == 0 {
            return Ok(());
        }
        let (gbuf, use_gids) = gids_arg(self, gids);
        let (key, thr, scale) = drop.map_or((0, 0, 1.0), AttnDropout::kernel_args);
        let use_drop = drop.is_some() as u32;
        let n_own = m_own.rows as u32;
        let n_rows = a.n_dst as u32;
        let concat = shape.concat as u32;
        let halo = m_halo.map_or(&self.dummy_f32, |m| &m.buf);
        let mut b = self.launch("gat_forward");
        b.arg(&a.indptr)
            .arg(&a.indices)
            .arg(&m_own.buf)
            .arg(halo)
            .arg(&n_own)
            .arg(&s_dst.buf)
            .arg(gbuf)
            .arg(&use_gids)
            .arg(&key)
            .arg(&thr)
            .arg(&scale)
            .arg(&use_drop)
            .arg(&shape.slope)
            .arg(&shape.heads)
            .arg(&shape.c)
            .arg(&concat)
            .arg(&mut alpha.buf)
            .arg(&mut out.buf)
            .arg(&n_rows);
        // SAFETY: shapes checked above.
        unsafe { b.launch(launch_cfg(rows_launch(a.n_dst, 32))) }?;
        Ok(())
    }

    fn gat_backward_edges(
        &mut self,
        a: &DeviceCsr,
        m_own: &DeviceMatrix,
        m_halo: Option<&DeviceMatrix>,
        s_dst: &DeviceMatrix,
        alpha: &DeviceMatrix,
        d_out: &DeviceMatrix,
        gids: Option<&DeviceIdx>,
        drop: Option<AttnDropout>,
        shape: GatShape,
        d_score: &mut DeviceMatrix,
        a_used: &mut DeviceMatrix,
        ds_dst: &mut DeviceMatrix,
    ) -> Result<(), GpuError> {
        let _p = OpSpan::new(&self.stream, "gat_backward_edges");
        gat_checks(a, m_own, m_halo, s_dst, shape)?;
        let h = shape.heads as usize;
        check(
            alpha.shape() == (a.nnz, h)
                && d_score.shape() == (a.nnz, h)
                && a_used.shape() == (a.nnz, h)
                && ds_dst.shape() == (a.n_dst, h)
                && d_out.rows == a.n_dst
                && gids.is_none_or(|g| g.host.len() >= a.n_src),
            || "gat_backward_edges shapes".into(),
        )?;
        if a.n_dst == 0 {
            return Ok(());
        }
        let (gbuf, use_gids) = gids_arg(self, gids);
        let (key, thr, scale) = drop.map_or((0, 0, 1.0), AttnDropout::kernel_args);
        let use_drop = drop.is_some() as u32;
        let n_own = m_own.rows as u32;
        let n_rows = a.n_dst as u32;
        let concat = shape.concat as u32;
        let halo = m_halo.map_or(&self.dummy_f32, |m| &m.buf);
        let mut b = self.launch("gat_backward_edges");
        b.arg(&a.indptr)
            .arg(&a.indices)
            .arg(&m_own.buf)
            .arg(halo)
            .arg(&n_own)
            .arg(&s_dst.buf)
            .arg(&alpha.buf)
            .arg(&d_out.buf)
            .arg(gbuf)
            .arg(&use_gids)
            .arg(&key)
            .arg(&thr)
            .arg(&scale)
            .arg(&use_drop)
            .arg(&shape.slope)
            .arg(&shape.heads)
            .arg(&shape.c)
            .arg(&concat)
            .arg(&mut d_score.buf)
            .arg(&mut a_used.buf)
            .arg(&mut ds_dst.buf)
            .arg(&n_rows);
        // SAFETY: shapes checked above.
        unsafe { b.launch(launch_cfg(rows_launch(a.n_dst, 32))) }?;
        Ok(())
    }

    fn gat_backward_sources(
        &mut self,
        a: &DeviceCsr,
        a_used: &DeviceMatrix,
        d_score: &DeviceMatrix,
        d_out: &DeviceMatrix,
        shape: GatShape,
        dm: &mut DeviceMatrix,
    ) -> Result<(), GpuError> {
        let _p = OpSpan::new(&self.stream, "gat_backward_sources");
        let (h, c) = (shape.heads as usize, shape.c as usize);
        check(
            dm.shape() == (a.n_src, h * c + h)
                && d_out.rows == a.n_dst
                && a_used.shape() == (a.nnz, h)
                && d_score.shape() == (a.nnz, h),
            || "gat_backward_sources shapes".into(),
        )?;
        if a.n_src == 0 {
            return Ok(());
        }
        let n_src = a.n_src as u32;
        let concat = shape.concat as u32;
        let t_perm = a.t_perm.as_ref().ok_or_else(|| {
            GpuError::Unsupported(
                "GAT's backward over an operator uploaded without its entry map (its weights are not \
                 GAT's structure)"
                    .into(),
            )
        })?;
        let (t_indptr, t_indices, _, _) = a.transposed();
        let mut b = self.launch("gat_backward_sources");
        b.arg(t_indptr)
            .arg(t_indices)
            .arg(t_perm)
            .arg(&a_used.buf)
            .arg(&d_score.buf)
            .arg(&d_out.buf)
            .arg(&shape.heads)
            .arg(&shape.c)
            .arg(&concat)
            .arg(&mut dm.buf)
            .arg(&n_src);
        // SAFETY: shapes checked above.
        unsafe { b.launch(launch_cfg(rows_launch(a.n_src, 32))) }?;
        Ok(())
    }

    fn gat_dz(
        &mut self,
        dm: &DeviceMatrix,
        ds_dst: &DeviceMatrix,
        a_src: &DeviceMatrix,
        a_dst: &DeviceMatrix,
        shape: GatShape,
        dz: &mut DeviceMatrix,
    ) -> Result<(), GpuError> {
        let _p = OpSpan::new(&self.stream, "gat_dz");
        let (h, c) = (shape.heads as usize, shape.c as usize);
        check(
            dm.shape() == (dz.rows, h * c + h)
                && dz.cols == h * c
                && ds_dst.cols == h
                && a_src.len() == h * c
                && a_dst.len() == h * c,
            || "gat_dz shapes".into(),
        )?;
        if dz.len() == 0 {
            return Ok(());
        }
        let n_in = u32_size(dz.rows, "rows")?;
        let n_dst = ds_dst.rows as u32;
        let cfg = launch_cfg(elementwise_launch(dz.len()));
        let mut b = self.launch("gat_dz");
        b.arg(&dm.buf)
            .arg(&ds_dst.buf)
            .arg(&a_src.buf)
            .arg(&a_dst.buf)
            .arg(&mut dz.buf)
            .arg(&n_in)
            .arg(&n_dst)
            .arg(&shape.heads)
            .arg(&shape.c);
        // SAFETY: shapes checked above.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    fn bias_add(&mut self, x: &mut DeviceMatrix, bias: &DeviceMatrix) -> Result<(), GpuError> {
        let _p = OpSpan::new(&self.stream, "bias_add");
        check(bias.len() == x.cols, || "bias width".into())?;
        if x.len() == 0 {
            return Ok(());
        }
        let (rows, cols) = (u32_size(x.rows, "rows")?, x.cols as u32);
        let cfg = launch_cfg(elementwise_launch(x.len()));
        let mut b = self.launch("bias_add");
        b.arg(&mut x.buf).arg(&bias.buf).arg(&rows).arg(&cols);
        // SAFETY: bias holds cols floats.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    fn activate(&mut self, x: &mut DeviceMatrix, act: Activation) -> Result<(), GpuError> {
        let _p = OpSpan::new(&self.stream, "activate");
        if x.len() == 0 {
            return Ok(());
        }
        let n = u32_size(x.len(), "elements")?;
        let code = act_code(act);
        let cfg = launch_cfg(elementwise_launch(x.len()));
        let mut b = self.launch("activate");
        b.arg(&mut x.buf).arg(&n).arg(&code);
        // SAFETY: n elements.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    fn dropout(
        &mut self,
        x: &mut DeviceMatrix,
        gids: Option<&DeviceIdx>,
        row0: usize,
        col0: usize,
        total_cols: usize,
        d: Dropout,
    ) -> Result<(), GpuError> {
        let _p = OpSpan::new(&self.stream, "dropout");
        check(gids.is_none_or(|g| g.host.len() >= row0 + x.rows), || {
            "dropout: fewer global ids than rows".into()
        })?;
        if x.len() == 0 {
            return Ok(());
        }
        let (gbuf, use_gids) = gids_arg(self, gids);
        let (rows, cols) = (u32_size(x.rows, "rows")?, x.cols as u32);
        let (row0, col0, total) = (row0 as u32, col0 as u32, u32_size(total_cols, "columns")?);
        let thr = mask_threshold(d.p);
        let scale = 1.0 / (1.0 - d.p);
        let cfg = launch_cfg(elementwise_launch(x.len()));
        let mut b = self.launch("dropout");
        b.arg(&mut x.buf)
            .arg(&rows)
            .arg(&cols)
            .arg(gbuf)
            .arg(&use_gids)
            .arg(&row0)
            .arg(&col0)
            .arg(&total)
            .arg(&d.key)
            .arg(&thr)
            .arg(&scale);
        // SAFETY: shapes checked above.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    fn bias_activate_dropout(
        &mut self,
        x: &mut DeviceMatrix,
        bias: &DeviceMatrix,
        act: Activation,
        gids: Option<&DeviceIdx>,
        d: Option<Dropout>,
    ) -> Result<(), GpuError> {
        let _p = OpSpan::new(&self.stream, "bias_activate_dropout");
        check(bias.len() == x.cols, || "bias width".into())?;
        check(gids.is_none_or(|g| g.host.len() >= x.rows), || {
            "bias_activate_dropout: fewer global ids than rows".into()
        })?;
        if x.len() == 0 {
            return Ok(());
        }
        let (gbuf, use_gids) = gids_arg(self, gids);
        let (rows, cols) = (u32_size(x.rows, "rows")?, x.cols as u32);
        let code = act_code(act);
        let (use_mask, key, thr, scale) = match d {
            Some(d) => (1u32, d.key, mask_threshold(d.p), 1.0 / (1.0 - d.p)),
            None => (0u32, 0u64, 0u32, 1.0f32),
        };
        let cfg = launch_cfg(elementwise_launch(x.len()));
        let mut b = self.launch("bias_act_dropout");
        b.arg(&mut x.buf)
            .arg(&bias.buf)
            .arg(&rows)
            .arg(&cols)
            .arg(&code)
            .arg(gbuf)
            .arg(&use_gids)
            .arg(&use_mask)
            .arg(&key)
            .arg(&thr)
            .arg(&scale);
        // SAFETY: bias holds cols floats, gids (when used) at least rows ids.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    fn dropped_block_bytes(&self) -> usize {
        // the fused first-layer backward's blocks: a few large launches rather than hundreds of small ones
        64 << 20
    }

    fn activation_backward(
        &mut self,
        dy: &mut DeviceMatrix,
        y: &DeviceMatrix,
        gids: Option<&DeviceIdx>,
        row0: usize,
        act: Activation,
        d: Option<Dropout>,
    ) -> Result<(), GpuError> {
        let _p = OpSpan::new(&self.stream, "activation_backward");
        check(dy.shape() == y.shape(), || {
            "activation_backward shapes".into()
        })?;
        let Some(p) = ActGradArgs::new(dy, gids, row0, act, d)? else {
            return Ok(());
        };
        let (gbuf, use_gids) = gids_arg(self, gids);
        let mut b = self.launch("activation_backward");
        b.arg(&mut dy.buf)
            .arg(&y.buf)
            .arg(&p.rows)
            .arg(&p.cols)
            .arg(gbuf)
            .arg(&use_gids)
            .arg(&p.row0)
            .arg(&p.code)
            .arg(&p.use_mask)
            .arg(&p.key)
            .arg(&p.thr)
            .arg(&p.scale);
        // SAFETY: shapes checked above.
        unsafe { b.launch(p.cfg) }?;
        Ok(())
    }

    fn activation_backward_over(
        &mut self,
        dy: &mut DeviceMatrix,
        y: &mut DeviceMatrix,
        gids: Option<&DeviceIdx>,
        row0: usize,
        act: Activation,
        d: Option<Dropout>,
    ) -> Result<(), GpuError> {
        let _p = OpSpan::new(&self.stream, "activation_backward_over");
        check(dy.cols == y.cols && row0 + dy.rows <= y.rows, || {
            format!(
                "activation_backward_over: {}x{} at row {row0} of {}x{}",
                dy.rows, dy.cols, y.rows, y.cols
            )
        })?;
        let Some(p) = ActGradArgs::new(dy, gids, row0, act, d)? else {
            return Ok(());
        };
        let (gbuf, use_gids) = gids_arg(self, gids);
        let mut yv = y.buf.slice_mut(row0 * y.cols..);
        let mut b = self.launch("activation_backward_over");
        b.arg(&dy.buf)
            .arg(&mut yv)
            .arg(&p.rows)
            .arg(&p.cols)
            .arg(gbuf)
            .arg(&use_gids)
            .arg(&p.row0)
            .arg(&p.code)
            .arg(&p.use_mask)
            .arg(&p.key)
            .arg(&p.thr)
            .arg(&p.scale);
        // SAFETY: `dy`'s rows fit in `y` from `row0` (checked above), as wide.
        unsafe { b.launch(p.cfg) }?;
        Ok(())
    }

    fn add_assign(&mut self, a: &mut DeviceMatrix, other: &DeviceMatrix) -> Result<(), GpuError> {
        let _p = OpSpan::new(&self.stream, "add_assign");
        check(a.cols == other.cols && other.rows <= a.rows, || {
            "add_assign shapes".into()
        })?;
        if other.len() == 0 {
            return Ok(());
        }
        let n = u32_size(other.len(), "elements")?;
        let cfg = launch_cfg(elementwise_launch(other.len()));
        let mut b = self.launch("add_assign");
        b.arg(&mut a.buf).arg(&other.buf).arg(&n);
        // SAFETY: `other`'s rows are a prefix of `a`'s (row-major, same width).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    fn col_sums(&mut self, x: &DeviceMatrix, out: &mut DeviceMatrix) -> Result<(), GpuError> {
        let _p = OpSpan::new(&self.stream, "col_sums");
        check(out.len() == x.cols, || "col_sums width".into())?;
        if x.cols == 0 {
            return Ok(());
        }
        let chunks = colsum_chunks(x.rows);
        let mut partial = self.take64(chunks as usize * x.cols)?;
        let (rows, cols) = (u32_size(x.rows, "rows")?, x.cols as u32);
        let chunk_rows = COLSUM_CHUNK_ROWS;
        {
            let mut b = self.launch("col_sums_partial");
            b.arg(&x.buf)
                .arg(&rows)
                .arg(&cols)
                .arg(&chunk_rows)
                .arg(&mut partial);
            let cfg = LaunchConfig {
                grid_dim: (cols.div_ceil(32), chunks, 1),
                block_dim: (32, 8, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: partial holds chunks x cols doubles.
            unsafe { b.launch(cfg) }?;
        }
        {
            let mut b = self.launch("col_sums_finish");
            b.arg(&partial).arg(&chunks).arg(&cols).arg(&mut out.buf);
            // SAFETY: out holds cols floats.
            unsafe { b.launch(launch_cfg((cols.div_ceil(BLOCK), BLOCK))) }?;
        }
        self.give64(partial);
        Ok(())
    }

    fn copy2d(
        &mut self,
        src: View<'_, DeviceMatrix>,
        dst: &mut DeviceMatrix,
        dst_offset: usize,
        dst_ld: usize,
    ) -> Result<(), GpuError> {
        let _p = OpSpan::new(&self.stream, "copy2d");
        check(!src.trans, || "copy2d copies without transposing".into())?;
        check_copy2d(&src, dst.len(), src.m.len(), dst_offset, dst_ld)?;
        let n = src.rows * src.cols;
        if n == 0 {
            return Ok(());
        }
        let (src_ld, dst_ld32) = (u32_size(src.ld, "ld")?, u32_size(dst_ld, "ld")?);
        let (rows, cols) = (src.rows as u32, src.cols as u32);
        let sv = src.m.buf.slice(src.offset..);
        let mut dv = dst.buf.slice_mut(dst_offset..);
        let mut b = self.launch("copy2d");
        b.arg(&sv)
            .arg(&src_ld)
            .arg(&mut dv)
            .arg(&dst_ld32)
            .arg(&rows)
            .arg(&cols);
        // SAFETY: both extents checked above.
        unsafe { b.launch(launch_cfg(elementwise_launch(n))) }?;
        Ok(())
    }

    fn gather_rows(
        &mut self,
        src: &DeviceMatrix,
        idx: &DeviceIdx,
        dst: &mut DeviceMatrix,
    ) -> Result<(), GpuError> {
        let _p = OpSpan::new(&self.stream, "gather_rows");
        check(
            dst.shape() == (idx.host.len(), src.cols)
                && idx.host.iter().all(|&i| (i as usize) < src.rows),
            || "gather_rows shapes".into(),
        )?;
        if dst.len() == 0 {
            return Ok(());
        }
        let (n_idx, cols) = (idx.host.len() as u32, src.cols as u32);
        let cfg = launch_cfg(elementwise_launch(dst.len()));
        let mut b = self.launch("gather_rows");
        b.arg(&src.buf)
            .arg(&idx.buf)
            .arg(&n_idx)
            .arg(&cols)
            .arg(&mut dst.buf);
        // SAFETY: every index is below src.rows (checked above).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    fn cross_entropy(
        &mut self,
        logits: &DeviceMatrix,
        labels: &DeviceLabels,
        rows: &DeviceIdx,
        normalizer: f64,
        grad: &mut DeviceMatrix,
    ) -> Result<f64, GpuError> {
        let _p = OpSpan::new(&self.stream, "cross_entropy");
        check(grad.shape() == logits.shape(), || {
            "cross_entropy shapes".into()
        })?;
        check_labels(&labels.host, &rows.host, logits.shape())?;
        self.stream.memset_zeros(&mut grad.buf)?;
        let n_list = rows.host.len();
        if n_list == 0 {
            return Ok(0.0);
        }
        let mut loss = self.take64(n_list)?;
        let mut total = self.take64(1)?;
        let (n32, c) = (n_list as u32, logits.cols as u32);
        let scale = (1.0 / normalizer) as f32;
        {
            let mut b = self.launch("cross_entropy");
            b.arg(&logits.buf)
                .arg(&labels.buf)
                .arg(&rows.buf)
                .arg(&n32)
                .arg(&c)
                .arg(&scale)
                .arg(&mut grad.buf)
                .arg(&mut loss);
            // SAFETY: rows and labels were checked against the logits' shape.
            unsafe { b.launch(launch_cfg(rows_launch(n_list, 32))) }?;
        }
        let sum = self.reduce_f64(&loss, n32, &mut total)?;
        self.give64(loss);
        self.give64(total);
        Ok(sum)
    }

    fn correct(
        &mut self,
        logits: &DeviceMatrix,
        labels: &DeviceLabels,
        rows: &DeviceIdx,
    ) -> Result<u64, GpuError> {
        let _p = OpSpan::new(&self.stream, "correct");
        check_labels(&labels.host, &rows.host, logits.shape())?;
        let n_list = rows.host.len();
        if n_list == 0 {
            return Ok(0);
        }
        let mut flags = self.take64(n_list)?;
        let mut total = self.take64(1)?;
        let (n32, c) = (n_list as u32, logits.cols as u32);
        {
            let mut b = self.launch("correct_rows");
            b.arg(&logits.buf)
                .arg(&labels.buf)
                .arg(&rows.buf)
                .arg(&n32)
                .arg(&c)
                .arg(&mut flags);
            // SAFETY: rows and labels were checked against the logits' shape.
            unsafe { b.launch(launch_cfg(rows_launch(n_list, 32))) }?;
        }
        let sum = self.reduce_f64(&flags, n32, &mut total)?;
        self.give64(flags);
        self.give64(total);
        Ok(sum.round() as u64)
    }

    fn adam(
        &mut self,
        w: &mut DeviceMatrix,
        g: &DeviceMatrix,
        m: &mut DeviceMatrix,
        v: &mut DeviceMatrix,
        s: AdamStep,
    ) -> Result<(), GpuError> {
        let _p = OpSpan::new(&self.stream, "adam");
        check(
            w.shape() == g.shape() && w.shape() == m.shape() && w.shape() == v.shape(),
            || "adam shapes".into(),
        )?;
        if w.len() == 0 {
            return Ok(());
        }
        let n = u32_size(w.len(), "parameters")?;
        let cfg = launch_cfg(elementwise_launch(w.len()));
        let mut b = self.launch("adam");
        b.arg(&mut w.buf)
            .arg(&g.buf)
            .arg(&mut m.buf)
            .arg(&mut v.buf)
            .arg(&n)
            .arg(&s.step_size)
            .arg(&s.beta1)
            .arg(&s.beta2)
            .arg(&s.eps)
            .arg(&s.weight_decay)
            .arg(&s.bc2_sqrt);
        // SAFETY: equal shapes.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    fn synchronize(&mut self) -> Result<(), GpuError> {
        self.stream.synchronize()?;
        self.copy.synchronize()?;
        Ok(())
    }

    fn release_cached(&mut self) {
        // the exact-size cache only: the driver's pool reuses its memory for the next step's shapes, and
        // handing it to the device every step would make each step reserve it again
        self.pool.clear();
        self.pool64.clear();
        self.stats.cached_bytes = 0;
    }
}

impl CudaEngine {
    /// `sum_f64` over the first `n` values, read back to the host.
    fn reduce_f64(
        &mut self,
        x: &CudaSlice<f64>,
        n: u32,
        total: &mut CudaSlice<f64>,
    ) -> Result<f64, GpuError> {
        {
            let mut b = self.launch("sum_f64");
            b.arg(x).arg(&n).arg(&mut *total);
            // SAFETY: one block of REDUCE_THREADS (the kernel's shared array size).
            unsafe { b.launch(launch_cfg((1, REDUCE_THREADS))) }?;
        }
        let v = self.stream.clone_dtoh(&total.slice(0..1))?;
        Ok(v[0])
    }

    /// The GPU's SpMM alone, for benchmarks: `Y = A X` (or `A^T X`).
    pub fn spmm_only(
        &mut self,
        a: &DeviceCsr,
        x: &DeviceMatrix,
        y: &mut DeviceMatrix,
        transpose: bool,
    ) -> Result<(), GpuError> {
        if transpose {
            self.spmm_t(a, x, y)
        } else {
            self.spmm(a, x, None, y)
        }
    }
}

/// The device's default stream-ordered pool, which `cuMemAllocAsync` draws from.
fn default_pool(ctx: &CudaContext) -> Result<sys::CUmemoryPool, GpuError> {
    if ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? == 0 {
        return Err(GpuError::Unsupported(
            "the device has no stream-ordered allocator".into(),
        ));
    }
    ctx.bind_to_thread()?;
    let mut pool = std::ptr::null_mut();
    // SAFETY: `pool` is a valid out-pointer and the context's device is current.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }.result()?;
    Ok(pool)
}

/// Tells the default pool to keep freed memory for later allocations instead of handing it back to the
/// device at every synchronisation (its release threshold, 0 by default, set to no limit): the driver then
/// caches as our exact-size pool did, for buffers of any size.
fn keep_driver_pool(ctx: &CudaContext) -> Result<(), GpuError> {
    let pool = default_pool(ctx)?;
    let mut threshold = u64::MAX;
    // SAFETY: the release threshold attribute takes a pointer to a u64.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    }
    .result()?;
    Ok(())
}

/// Hands every unused byte of the default pool back to the device.
fn trim_driver_pool(ctx: &CudaContext) -> Result<(), GpuError> {
    let pool = default_pool(ctx)?;
    // SAFETY: trimming keeps every allocation in use; 0 releases all the rest.
    unsafe { sys::cuMemPoolTrimTo(pool, 0) }.result()?;
    Ok(())
}
