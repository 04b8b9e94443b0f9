//! Trained models as safetensors files: one tensor per parameter (`layers.0.weight`, `layers.0.bias`, ...),
//! the model configuration and run settings as JSON under the `physalia` metadata key. Loadable from PyTorch with `safetensors.torch.load_file`.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};

use crate::model::Model;
use crate::optim::Adam;
use crate::train::Progress;
use crate::{Error, Result};

/// Writes the model atomically: a temporary file in the same folder, renamed into place when complete.
pub fn save_model(model: &Model, path: &Path, extra_metadata: &[(&str, String)]) -> Result<()> {
    write_tensors(model, &[], path, extra_metadata)
}

/// A training checkpoint: the model's tensors as [`save_model`] writes them, plus the optimizer's moments
/// (`adam.m.<name>`, `adam.v.<name>`) and, in the metadata, the seed, the optimizer step and the
/// [`Progress`]. [`load_checkpoint`] restores all of it, so training resumes as if it had not stopped.
pub fn save_checkpoint(model: &Model, opt: &Adam, progress: &Progress, path: &Path) -> Result<()> {
    let (m, v) = opt.moments();
    let mut extra: Vec<(String, Vec<usize>, &[u8])> = Vec::new();
    for (p, (m, v)) in model.params.iter().zip(m.iter().zip(v)) {
        extra.push((
            format!("adam.m.{}", p.name),
            vec![m.len()],
            bytemuck::cast_slice(m),
        ));
        extra.push((
            format!("adam.v.{}", p.name),
            vec![v.len()],
            bytemuck::cast_slice(v),
        ));
    }
    let progress = serde_json::to_string(progress).expect("progress serialises");
    write_tensors(
        model,
        &extra,
        path,
        &[
            ("seed", model.seed().to_string()),
            ("adam_step", opt.steps().to_string()),
            ("lr", opt.lr.to_string()),
            ("weight_decay", opt.weight_decay.to_string()),
            ("progress", progress),
        ],
    )
}

/// Reads a checkpoint written by [`save_checkpoint`]: the model (rebuilt from its configuration and seed,
/// then given the saved weights), the optimizer and the progress. Every mismatch is an error naming the file.
pub fn load_checkpoint(path: &Path) -> Result<(Model, Adam, Progress)> {
    let bad = |what: String| Error::Format(format!("{}: {what}", path.display()));
    let bytes = std::fs::read(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)
        .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
    let info: serde_json::Value = header
        .metadata()
        .as_ref()
        .and_then(|m| m.get("physalia"))
        .ok_or_else(|| bad("no `physalia` metadata: not a checkpoint".into()))
        .and_then(|s| serde_json::from_str(s).map_err(|e| bad(format!("metadata: {e}"))))?;
    let field = |k: &str| -> Result<&str> {
        info.get(k)
            .and_then(|v| v.as_str())
            .ok_or_else(|| bad(format!("metadata has no `{k}`: not a checkpoint")))
    };
    let num = |k: &str| -> Result<f64> {
        field(k)?
            .parse::<f64>()
            .map_err(|e| bad(format!("metadata `{k}`: {e}")))
    };
    let cfg: crate::ModelConfig = serde_json::from_value(info["model"].clone())
        .map_err(|e| bad(format!("metadata `model`: {e}")))?;
    let seed: u64 = field("seed")?
        .parse()
        .map_err(|e| bad(format!("metadata `seed`: {e}")))?;
    let progress: Progress = serde_json::from_str(field("progress")?)
        .map_err(|e| bad(format!("metadata `progress`: {e}")))?;
    let tensors = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
    let read = |name: &str, len: usize| -> Result<Vec<f32>> {
        let t = tensors
            .tensor(name)
            .map_err(|_| bad(format!("tensor `{name}` is missing")))?;
        if t.dtype() != Dtype::F32 || t.data().len() != len * 4 {
            return Err(bad(format!(
                "tensor `{name}` is {:?} {:?}, expected {len} f32 values",
                t.dtype(),
                t.shape()
            )));
        }
        Ok(t.data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    };
    // The configuration says how big the model is. The file must hold its weights and their two Adam
    // moments before anything that size is allocated: a damaged or hostile header cannot ask for more.
    let holds = bytes.len() / 12;
    if weight_values_exceed(&cfg, holds) {
        return Err(bad(format!(
            "metadata `model` ({:?}, in {} hidden {} out {} x {} layers) needs more weights than the \
             file's {} bytes hold",
            cfg.kind,
            cfg.in_dim,
            cfg.hidden,
            cfg.out_dim,
            cfg.layers,
            bytes.len()
        )));
    }
    let mut model = Model::new(&cfg, seed)?;
    let (mut ms, mut vs) = (Vec::new(), Vec::new());
    for p in &mut model.params {
        let n = p.value.data().len();
        let w = read(&p.name, n)?;
        p.value.data_mut().copy_from_slice(&w);
        ms.push(read(&format!("adam.m.{}", p.name), n)?);
        vs.push(read(&format!("adam.v.{}", p.name), n)?);
    }
    let mut opt = Adam::new(
        &model.params,
        num("lr")? as f32,
        num("weight_decay")? as f32,
    );
    let step = num("adam_step")? as u64;
    opt.restore(step, ms, vs).map_err(bad)?;
    Ok((model, opt, progress))
}

/// Whether the weight matrices of `cfg` (a lower bound of its parameters, as [`Model::new`] shapes them)
/// have more than `limit` values; stops counting once they do, so a huge `layers` costs nothing.
fn weight_values_exceed(cfg: &crate::ModelConfig, limit: usize) -> bool {
    use crate::LayerKind;
    let mut total = 0usize;
    let mut d_in = cfg.in_dim;
    for index in 0..cfg.layers {
        let last = index + 1 == cfg.layers;
        let hc = match cfg.kind {
            LayerKind::Gat if last => cfg.out_heads.checked_mul(cfg.out_dim),
            LayerKind::Gat => cfg.heads.checked_mul(cfg.hidden),
            _ => Some(if last { cfg.out_dim } else { cfg.hidden }),
        };
        let Some(w) = hc.and_then(|hc| d_in.checked_mul(hc)) else {
            return true;
        };
        total = total.saturating_add(w.max(1));
        if total > limit {
            return true;
        }
        d_in = hc.unwrap_or(usize::MAX);
    }
    false
}

fn write_tensors(
    model: &Model,
    extra: &[(String, Vec<usize>, &[u8])],
    path: &Path,
    extra_metadata: &[(&str, String)],
) -> Result<()> {
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut shapes: Vec<(String, Vec<usize>, &[u8])> = model
        .params
        .iter()
        .map(|p| {
            let (r, c) = p.value.shape();
            let shape = if r == 1 && p.name.ends_with("bias") {
                vec![c]
            } else {
                vec![r, c]
            };
            (p.name.clone(), shape, bytemuck::cast_slice(p.value.data()))
        })
        .collect();
    shapes.extend(extra.iter().cloned());
    let views: Vec<(String, TensorView<'_>)> = shapes
        .iter()
        .map(|(n, s, b)| Ok((n.clone(), TensorView::new(Dtype::F32, s.clone(), b)?)))
        .collect::<std::result::Result<_, safetensors::SafeTensorError>>()
        .map_err(|e| Error::Format(format!("{}: {e}", path.display())))?;
    // one metadata key holding a JSON object (sorted keys): the header is byte-identical for the same model
    let mut info = serde_json::Map::new();
    info.insert(
        "model".into(),
        serde_json::to_value(model.config()).expect("model config serialises"),
    );
    for (k, v) in extra_metadata {
        info.insert((*k).to_string(), serde_json::Value::String(v.clone()));
    }
    let meta = HashMap::from([(
        "physalia".to_string(),
        serde_json::Value::Object(info).to_string(),
    )]);
    let bytes = safetensors::serialize(views, Some(meta))
        .map_err(|e| Error::Format(format!("{}: {e}", path.display())))?;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("model")
    ));
    let mut f = std::fs::File::create(&tmp).map_err(io)?;
    f.write_all(&bytes).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)?;
    Ok(())
}
