//! What a model is made of: the plain settings the orchestrator translates a job file into.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerKind {
    /// Kipf & Welling: symmetric normalisation with self-loops.
    Gcn,
    /// GraphSAGE with the mean aggregator and a root weight.
    Sage,
    /// Graph attention (Velickovic et al.): multi-head, edge softmax.
    Gat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    Relu,
    Elu,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub kind: LayerKind,
    pub in_dim: usize,
    /// Hidden width; per head for GAT.
    pub hidden: usize,
    pub out_dim: usize,
    pub layers: usize,
    /// GAT heads of the hidden layers (concatenated).
    pub heads: usize,
    /// GAT heads of the output layer (averaged).
    pub out_heads: usize,
    /// Dropout on the output of every hidden layer.
    pub dropout: f32,
    /// Dropout on the input features.
    pub input_dropout: f32,
    /// GAT: dropout on the attention coefficients.
    pub attn_dropout: f32,
    pub activation: Activation,
    /// GAT: slope of the LeakyReLU on attention scores.
    pub negative_slope: f32,
}

impl ModelConfig {
    /// A model with the given layer kind and the conventional defaults for the other fields.
    pub fn new(kind: LayerKind, in_dim: usize, hidden: usize, out_dim: usize) -> ModelConfig {
        ModelConfig {
            kind,
            in_dim,
            hidden,
            out_dim,
            layers: 2,
            heads: 8,
            out_heads: 1,
            dropout: 0.5,
            input_dropout: 0.5,
            attn_dropout: 0.0,
            activation: Activation::Relu,
            negative_slope: 0.2,
        }
    }
}
