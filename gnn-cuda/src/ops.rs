//! What the CUDA device adds to `physalia_gnn::device`'s [`Ops`] trait: the CSR layout its kernels read
//! ([`HostCsr`]), the activation codes, and [`Emulator`], the trait over host memory running the kernels of
//! [`crate::cpu_emulate`] serially (so the kernels' algorithms run against `physalia_gnn` without a GPU).

use physalia_gnn::Activation;
use physalia_gnn::Matrix;
use physalia_gnn::device::{
    AdamStep, AttnDropout, Dropout, GatShape, Ops, View, check, check_copy2d, check_labels,
    gemm_shape,
};
use physalia_gnn::sparse::SparseOp;

use crate::cpu_emulate as emu;
use crate::device::GpuError;
use crate::kernels::{ACT_ELU, ACT_RELU, mask_threshold, spmm_lanes};

pub(crate) fn act_code(a: Activation) -> u32 {
    match a {
        Activation::Relu => ACT_RELU,
        Activation::Elu => ACT_ELU,
    }
}

/// A CSR and its transpose in the layout the kernels read (`long long` row pointers, u32 indices).
#[derive(Clone, Debug)]
pub struct HostCsr {
    pub n_dst: usize,
    pub n_src: usize,
    pub indptr: Vec<i64>,
    pub indices: Vec<u32>,
    pub values: Vec<f32>,
    pub t_indptr: Vec<i64>,
    pub t_indices: Vec<u32>,
    pub t_perm: Vec<u32>,
    pub t_values: Vec<f32>,
}

impl HostCsr {
    pub fn from_op(op: &SparseOp) -> HostCsr {
        let t_values = op
            .t_perm()
            .iter()
            .map(|&k| op.values()[k as usize])
            .collect();
        HostCsr {
            n_dst: op.n_dst(),
            n_src: op.n_src(),
            indptr: op.indptr().iter().map(|&v| v as i64).collect(),
            indices: op.indices().to_vec(),
            values: op.values().to_vec(),
            t_indptr: op.t_indptr().iter().map(|&v| v as i64).collect(),
            t_indices: op.t_indices().to_vec(),
            t_perm: op.t_perm().to_vec(),
            t_values,
        }
    }

    pub fn nnz(&self) -> usize {
        self.indices.len()
    }
}

/// The host twin of [`crate::CudaEngine`]: every operation runs its kernel's emulation from
/// [`crate::cpu_emulate`] (dense products, which cuBLAS does on the GPU, use `physalia_gnn::dense`).
#[derive(Debug, Default)]
pub struct Emulator;

/// The engine's SpMM as it launches it: one pass over the light rows, the heavy rows' chunks into partial
/// rows, and their in-order sums.
fn emu_spmm(
    (indptr, indices, values): (&[i64], &[u32], &[f32]),
    own: &[f32],
    halo: &[f32],
    n_own: u32,
    y: &mut [f32],
    d: usize,
) {
    let n_rows = indptr.len().saturating_sub(1);
    if n_rows == 0 || d == 0 {
        return;
    }
    let vec4 = d.is_multiple_of(4);
    let lanes = spmm_lanes(d, vec4);
    let plan = crate::kernels::HeavyPlan::of(indptr);
    let heavy = if plan.is_empty() {
        u64::MAX
    } else {
        crate::kernels::HEAVY_ROW_EDGES
    };
    let pass = |a: &emu::CsrRef<'_>, y: &mut [f32], n: u32, heavy: u64| {
        if vec4 {
            emu::spmm_v4(a, own, halo, n_own, y, n, d as u32, lanes, heavy);
        } else {
            emu::spmm_scalar(a, own, halo, n_own, y, n, d as u32, lanes, heavy);
        }
    };
    let rows = emu::CsrRef {
        lo: &indptr[..n_rows],
        hi: &indptr[1..],
        indices,
        values,
    };
    pass(&rows, y, n_rows as u32, heavy);
    if !plan.is_empty() {
        let chunks = emu::CsrRef {
            lo: &plan.lo,
            hi: &plan.hi,
            indices,
            values,
        };
        let mut partial = vec![0f32; plan.chunks() * d];
        pass(&chunks, &mut partial, plan.chunks() as u32, u64::MAX);
        emu::spmm_heavy_reduce(
            &plan.rows,
            &plan.first,
            &partial,
            y,
            plan.rows.len() as u32,
            d as u32,
        );
    }
}

fn view_to_matrix(v: &View<'_, Matrix>) -> Matrix {
    let d = v.m.data();
    let mut out = Vec::with_capacity(v.rows * v.cols);
    for r in 0..v.rows {
        let s = v.offset + r * v.ld;
        out.extend_from_slice(&d[s..s + v.cols]);
    }
    Matrix::from_vec(v.rows, v.cols, out)
}

fn emu_keys(gids: Option<&Vec<u32>>, row0: usize) -> emu::RowKeys<'_> {
    emu::RowKeys {
        gids: gids.map(|g| g.as_slice()),
        row0: row0 as u32,
    }
}

impl Ops for Emulator {
    type Mat = Matrix;
    type Csr = HostCsr;
    type Idx = Vec<u32>;
    type Labels = Vec<i32>;
    type Error = GpuError;

    fn dims(&self, m: &Matrix) -> (usize, usize) {
        m.shape()
    }
    fn upload(&mut self, m: &Matrix) -> Result<Matrix, GpuError> {
        Ok(m.clone())
    }
    fn download(&mut self, m: &Matrix) -> Result<Matrix, GpuError> {
        Ok(m.clone())
    }
    fn alloc(&mut self, rows: usize, cols: usize) -> Result<Matrix, GpuError> {
        // NaN, so a kernel that fails to write an element shows up in the comparisons
        Ok(Matrix::from_vec(rows, cols, vec![f32::NAN; rows * cols]))
    }
    fn zeros(&mut self, rows: usize, cols: usize) -> Result<Matrix, GpuError> {
        Ok(Matrix::zeros(rows, cols))
    }
    fn recycle(&mut self, _m: Matrix) {}
    fn upload_csr(&mut self, op: &SparseOp) -> Result<HostCsr, GpuError> {
        Ok(HostCsr::from_op(op))
    }
    fn upload_idx(&mut self, v: &[u32]) -> Result<Vec<u32>, GpuError> {
        Ok(v.to_vec())
    }
    fn upload_labels(&mut self, v: &[i64]) -> Result<Vec<i32>, GpuError> {
        Ok(v.iter().map(|&l| l as i32).collect())
    }

    fn gemm(
        &mut self,
        a: View<'_, Matrix>,
        b: View<'_, Matrix>,
        beta: f32,
        c: &mut Matrix,
    ) -> Result<(), GpuError> {
        gemm_shape(&a, &b, c.shape())?;
        let am = view_to_matrix(&a);
        let bm = view_to_matrix(&b);
        use physalia_gnn::dense::{matmul, matmul_at, matmul_bt};
        let prod = match (a.trans, b.trans) {
            (false, false) => matmul(&am, &bm),
            (true, false) => matmul_at(&am, &bm),
            (false, true) => matmul_bt(&am, &bm),
            (true, true) => matmul_bt(&transpose(&am), &bm),
        };
        if beta == 0.0 {
            *c = prod;
        } else {
            let mut p = prod;
            if beta != 1.0 {
                let mut cc = c.clone();
                cc.scale(beta);
                p.add_assign(&cc);
            } else {
                p.add_assign(c);
            }
            *c = p;
        }
        Ok(())
    }

    fn spmm(
        &mut self,
        a: &HostCsr,
        own: &Matrix,
        halo: Option<&Matrix>,
        y: &mut Matrix,
    ) -> Result<(), GpuError> {
        let d = own.cols();
        let n_halo = halo.map_or(0, |h| h.rows());
        check(
            own.rows() + n_halo == a.n_src
                && y.shape() == (a.n_dst, d)
                && halo.is_none_or(|h| h.cols() == d),
            || {
                format!(
                    "spmm: {} + {n_halo} source rows for {}",
                    own.rows(),
                    a.n_src
                )
            },
        )?;
        let h = halo.map_or(&[][..], |h| h.data());
        emu_spmm(
            (&a.indptr, &a.indices, &a.values),
            own.data(),
            h,
            own.rows() as u32,
            y.data_mut(),
            d,
        );
        Ok(())
    }

    fn spmm_t(&mut self, a: &HostCsr, x: &Matrix, y: &mut Matrix) -> Result<(), GpuError> {
        let d = x.cols();
        check(x.rows() == a.n_dst && y.shape() == (a.n_src, d), || {
            format!("spmm_t: {} rows for {} destinations", x.rows(), a.n_dst)
        })?;
        emu_spmm(
            (&a.t_indptr, &a.t_indices, &a.t_values),
            x.data(),
            &[],
            x.rows() as u32,
            y.data_mut(),
            d,
        );
        Ok(())
    }

    fn gat_messages(
        &mut self,
        z: &Matrix,
        a_src: &Matrix,
        a_dst: &Matrix,
        shape: GatShape,
        m: &mut Matrix,
        s_dst: &mut Matrix,
    ) -> Result<(), GpuError> {
        let (h, c) = (shape.heads as usize, shape.c as usize);
        let n = z.rows();
        check(
            z.cols() == h * c
                && m.shape() == (n, h * c + h)
                && s_dst.shape() == (n, h)
                && a_src.data().len() == h * c
                && a_dst.data().len() == h * c,
            || "gat_messages shapes".into(),
        )?;
        emu::gat_messages(
            z.data(),
            a_src.data(),
            a_dst.data(),
            m.data_mut(),
            s_dst.data_mut(),
            n as u32,
            shape.heads,
            shape.c,
        );
        Ok(())
    }

    fn gat_forward(
        &mut self,
        a: &HostCsr,
        m_own: &Matrix,
        m_halo: Option<&Matrix>,
        s_dst: &Matrix,
        gids: Option<&Vec<u32>>,
        drop: Option<AttnDropout>,
        shape: GatShape,
        alpha: &mut Matrix,
        out: &mut Matrix,
    ) -> Result<(), GpuError> {
        check_gat(a, m_own, m_halo, s_dst, shape)?;
        let d_out = shape.d_out();
        check(
            alpha.shape() == (a.nnz(), shape.heads as usize) && out.shape() == (a.n_dst, d_out),
            || "gat_forward output shapes".into(),
        )?;
        emu::gat_forward(
            &a.indptr,
            &a.indices,
            &emu::Messages {
                own: m_own.data(),
                halo: m_halo.map_or(&[][..], |m| m.data()),
                n_own: m_own.rows() as u32,
            },
            s_dst.data(),
            emu::GatKeys {
                gids: gids.map(|g| g.as_slice()),
                drop: drop.map(AttnDropout::kernel_args),
            },
            shape,
            alpha.data_mut(),
            out.data_mut(),
            a.n_dst as u32,
        );
        Ok(())
    }

    fn gat_backward_edges(
        &mut self,
        a: &HostCsr,
        m_own: &Matrix,
        m_halo: Option<&Matrix>,
        s_dst: &Matrix,
        alpha: &Matrix,
        d_out: &Matrix,
        gids: Option<&Vec<u32>>,
        drop: Option<AttnDropout>,
        shape: GatShape,
        d_score: &mut Matrix,
        a_used: &mut Matrix,
        ds_dst: &mut Matrix,
    ) -> Result<(), GpuError> {
        check_gat(a, m_own, m_halo, s_dst, shape)?;
        let h = shape.heads as usize;
        check(
            alpha.shape() == (a.nnz(), h)
                && d_score.shape() == (a.nnz(), h)
                && a_used.shape() == (a.nnz(), h)
                && ds_dst.shape() == (a.n_dst, h)
                && d_out.rows() == a.n_dst,
            || "gat_backward_edges shapes".into(),
        )?;
        emu::gat_backward_edges(
            &a.indptr,
            &a.indices,
            &emu::Messages {
                own: m_own.data(),
                halo: m_halo.map_or(&[][..], |m| m.data()),
                n_own: m_own.rows() as u32,
            },
            s_dst.data(),
            alpha.data(),
            d_out.data(),
            emu::GatKeys {
                gids: gids.map(|g| g.as_slice()),
                drop: drop.map(AttnDropout::kernel_args),
            },
            shape,
            emu::EdgeGrads {
                d_score: d_score.data_mut(),
                a_used: a_used.data_mut(),
                ds_dst: ds_dst.data_mut(),
            },
            a.n_dst as u32,
        );
        Ok(())
    }

    fn gat_backward_sources(
        &mut self,
        a: &HostCsr,
        a_used: &Matrix,
        d_score: &Matrix,
        d_out: &Matrix,
        shape: GatShape,
        dm: &mut Matrix,
    ) -> Result<(), GpuError> {
        let (h, c) = (shape.heads as usize, shape.c as usize);
        check(
            dm.shape() == (a.n_src, h * c + h) && d_out.rows() == a.n_dst,
            || "gat_backward_sources shapes".into(),
        )?;
        emu::gat_backward_sources(
            &emu::TransposeRef {
                t_indptr: &a.t_indptr,
                t_indices: &a.t_indices,
                t_perm: &a.t_perm,
            },
            a_used.data(),
            d_score.data(),
            d_out.data(),
            shape.heads,
            shape.c,
            shape.concat,
            dm.data_mut(),
            a.n_src as u32,
        );
        Ok(())
    }

    fn gat_dz(
        &mut self,
        dm: &Matrix,
        ds_dst: &Matrix,
        a_src: &Matrix,
        a_dst: &Matrix,
        shape: GatShape,
        dz: &mut Matrix,
    ) -> Result<(), GpuError> {
        let (h, c) = (shape.heads as usize, shape.c as usize);
        check(
            dm.shape() == (dz.rows(), h * c + h) && dz.cols() == h * c && ds_dst.cols() == h,
            || "gat_dz shapes".into(),
        )?;
        let n_in = dz.rows() as u32;
        emu::gat_dz(
            dm.data(),
            ds_dst.data(),
            a_src.data(),
            a_dst.data(),
            dz.data_mut(),
            n_in,
            ds_dst.rows() as u32,
            shape.heads,
            shape.c,
        );
        Ok(())
    }

    fn bias_add(&mut self, x: &mut Matrix, bias: &Matrix) -> Result<(), GpuError> {
        check(bias.data().len() == x.cols(), || "bias width".into())?;
        let (r, c) = x.shape();
        emu::bias_add(x.data_mut(), bias.data(), r as u32, c as u32);
        Ok(())
    }

    fn activate(&mut self, x: &mut Matrix, act: Activation) -> Result<(), GpuError> {
        emu::activate(x.data_mut(), act_code(act));
        Ok(())
    }

    fn dropout(
        &mut self,
        x: &mut Matrix,
        gids: Option<&Vec<u32>>,
        row0: usize,
        col0: usize,
        total_cols: usize,
        d: Dropout,
    ) -> Result<(), GpuError> {
        let (r, c) = x.shape();
        emu::dropout(
            x.data_mut(),
            r as u32,
            c as u32,
            emu_keys(gids, row0),
            col0 as u32,
            total_cols as u32,
            d.key,
            mask_threshold(d.p),
            1.0 / (1.0 - d.p),
        );
        Ok(())
    }

    fn activation_backward(
        &mut self,
        dy: &mut Matrix,
        y: &Matrix,
        gids: Option<&Vec<u32>>,
        row0: usize,
        act: Activation,
        d: Option<Dropout>,
    ) -> Result<(), GpuError> {
        check(dy.shape() == y.shape(), || {
            "activation_backward shapes".into()
        })?;
        let (r, c) = dy.shape();
        let scale = d.map_or(1.0, |d| 1.0 / (1.0 - d.p));
        emu::activation_backward(
            dy.data_mut(),
            y.data(),
            r as u32,
            c as u32,
            emu_keys(gids, row0),
            act_code(act),
            d.map(|d| (d.key, mask_threshold(d.p))),
            scale,
        );
        Ok(())
    }

    fn add_assign(&mut self, a: &mut Matrix, b: &Matrix) -> Result<(), GpuError> {
        check(a.cols() == b.cols() && b.rows() <= a.rows(), || {
            "add_assign shapes".into()
        })?;
        let n = b.data().len();
        emu::add_assign(&mut a.data_mut()[..n], b.data());
        Ok(())
    }

    fn col_sums(&mut self, x: &Matrix, out: &mut Matrix) -> Result<(), GpuError> {
        check(out.data().len() == x.cols(), || "col_sums width".into())?;
        let (r, c) = x.shape();
        emu::col_sums(x.data(), r as u32, c as u32, out.data_mut());
        Ok(())
    }

    fn copy2d(
        &mut self,
        src: View<'_, Matrix>,
        dst: &mut Matrix,
        dst_offset: usize,
        dst_ld: usize,
    ) -> Result<(), GpuError> {
        check(!src.trans, || "copy2d copies without transposing".into())?;
        check_copy2d(
            &src,
            dst.data().len(),
            src.m.data().len(),
            dst_offset,
            dst_ld,
        )?;
        emu::copy2d(
            &src.m.data()[src.offset..],
            src.ld as u32,
            &mut dst.data_mut()[dst_offset..],
            dst_ld as u32,
            src.rows as u32,
            src.cols as u32,
        );
        Ok(())
    }

    fn gather_rows(
        &mut self,
        src: &Matrix,
        idx: &Vec<u32>,
        dst: &mut Matrix,
    ) -> Result<(), GpuError> {
        check(
            dst.shape() == (idx.len(), src.cols())
                && idx.iter().all(|&i| (i as usize) < src.rows()),
            || "gather_rows shapes".into(),
        )?;
        emu::gather_rows(src.data(), idx, src.cols() as u32, dst.data_mut());
        Ok(())
    }

    fn cross_entropy(
        &mut self,
        logits: &Matrix,
        labels: &Vec<i32>,
        rows: &Vec<u32>,
        normalizer: f64,
        grad: &mut Matrix,
    ) -> Result<f64, GpuError> {
        check(grad.shape() == logits.shape(), || {
            "cross_entropy shapes".into()
        })?;
        check_labels(labels, rows, logits.shape())?;
        grad.fill(0.0);
        let mut loss = vec![0f64; rows.len()];
        emu::cross_entropy(
            logits.data(),
            labels,
            rows,
            logits.cols() as u32,
            (1.0 / normalizer) as f32,
            grad.data_mut(),
            &mut loss,
        );
        Ok(emu::sum_f64(&loss))
    }

    fn correct(
        &mut self,
        logits: &Matrix,
        labels: &Vec<i32>,
        rows: &Vec<u32>,
    ) -> Result<u64, GpuError> {
        check_labels(labels, rows, logits.shape())?;
        let mut flags = vec![0f64; rows.len()];
        emu::correct_rows(
            logits.data(),
            labels,
            rows,
            logits.cols() as u32,
            &mut flags,
        );
        Ok(emu::sum_f64(&flags) as u64)
    }

    fn adam(
        &mut self,
        w: &mut Matrix,
        g: &Matrix,
        m: &mut Matrix,
        v: &mut Matrix,
        s: AdamStep,
    ) -> Result<(), GpuError> {
        check(
            w.shape() == g.shape() && w.shape() == m.shape() && w.shape() == v.shape(),
            || "adam shapes".into(),
        )?;
        emu::adam(w.data_mut(), g.data(), m.data_mut(), v.data_mut(), s);
        Ok(())
    }
}

fn check_gat(
    a: &HostCsr,
    m_own: &Matrix,
    m_halo: Option<&Matrix>,
    s_dst: &Matrix,
    shape: GatShape,
) -> Result<(), GpuError> {
    let (h, c) = (shape.heads as usize, shape.c as usize);
    let width = h * c + h;
    let n_halo = m_halo.map_or(0, |m| m.rows());
    check(
        m_own.cols() == width
            && m_halo.is_none_or(|m| m.cols() == width)
            && m_own.rows() + n_halo == a.n_src
            && s_dst.cols() == h
            && s_dst.rows() >= a.n_dst,
        || "gat message shapes".into(),
    )?;
    Ok(())
}

fn transpose(a: &Matrix) -> Matrix {
    let mut t = Matrix::zeros(a.cols(), a.rows());
    for i in 0..a.rows() {
        for j in 0..a.cols() {
            t.row_mut(j)[i] = a.row(i)[j];
        }
    }
    t
}
