//! What the CUDA device adds to `physalia_gnn::device`'s `Ops` trait (implemented by [`crate::CudaEngine`]):
//! the CSR layout its kernels read ([`HostCsr`]) and the activation codes.

use physalia_gnn::Activation;
use physalia_gnn::sparse::SparseOp;

use crate::kernels::{ACT_ELU, ACT_RELU};

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

    /// Whether the operator equals its transpose, entry for entry and weight for weight (GCN's normalised
    /// adjacency of an undirected graph): then its transposed product is its forward product.
    pub fn is_symmetric(&self) -> bool {
        self.n_dst == self.n_src
            && self.t_indptr == self.indptr
            && self.t_indices == self.indices
            && self.t_values == self.values
    }
}
