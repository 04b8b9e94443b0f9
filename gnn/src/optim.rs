//! Adam with L2 weight decay, as `torch.optim.Adam(weight_decay=..)` computes it (the decay is added to the
//! gradient, not decoupled as in AdamW), so hyper-parameters from papers and PyG examples carry over.

use serde::{Deserialize, Serialize};

use crate::model::Param;
use crate::tensor::Matrix;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Adam {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    step: u64,
    m: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl Adam {
    pub fn new(params: &[Param], lr: f32, weight_decay: f32) -> Adam {
        let zeros = || {
            params
                .iter()
                .map(|p| vec![0f32; p.value.data().len()])
                .collect::<Vec<_>>()
        };
        Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
            step: 0,
            m: zeros(),
            v: zeros(),
        }
    }

    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The first and second moment estimates, one buffer per parameter (for checkpoints).
    pub fn moments(&self) -> (&[Vec<f32>], &[Vec<f32>]) {
        (&self.m, &self.v)
    }

    /// Restores a checkpointed state; the buffers must match the parameters' sizes.
    pub fn restore(&mut self, step: u64, m: Vec<Vec<f32>>, v: Vec<Vec<f32>>) -> Result<(), String> {
        let fits = |b: &[Vec<f32>]| {
            b.len() == self.m.len() && b.iter().zip(&self.m).all(|(a, o)| a.len() == o.len())
        };
        if !fits(&m) || !fits(&v) {
            return Err("optimizer state does not match the model's parameters".into());
        }
        (self.step, self.m, self.v) = (step, m, v);
        Ok(())
    }

    pub fn step(&mut self, params: &mut [Param], grads: &[Matrix]) {
        assert_eq!(params.len(), grads.len(), "one gradient per parameter");
        self.step += 1;
        let t = self.step as i32;
        let bc1 = 1.0 - self.beta1.powi(t);
        let bc2 = 1.0 - self.beta2.powi(t);
        let step_size = self.lr / bc1;
        let bc2_sqrt = bc2.sqrt();
        for (((p, g), m), v) in params
            .iter_mut()
            .zip(grads)
            .zip(&mut self.m)
            .zip(&mut self.v)
        {
            for (((w, &g), m), v) in p
                .value
                .data_mut()
                .iter_mut()
                .zip(g.data())
                .zip(m.iter_mut())
                .zip(v.iter_mut())
            {
                let g = g + self.weight_decay * *w;
                *m = self.beta1 * *m + (1.0 - self.beta1) * g;
                *v = self.beta2 * *v + (1.0 - self.beta2) * g * g;
                *w -= step_size * *m / ((*v).sqrt() / bc2_sqrt + self.eps);
            }
        }
    }
}
