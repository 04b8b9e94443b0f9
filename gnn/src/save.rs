//! Trained models as safetensors files: one tensor per parameter (`layers.0.weight`, `layers.0.bias`, ...),
//! the model configuration and run settings as JSON under the `physalia` metadata key. Loadable from PyTorch with `safetensors.torch.load_file`.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};

use crate::model::Model;
use crate::{Error, Result};

/// Writes the model atomically: a temporary file in the same folder, renamed into place when complete.
pub fn save_model(model: &Model, path: &Path, extra_metadata: &[(&str, String)]) -> Result<()> {
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let shapes: Vec<(String, Vec<usize>, &[u8])> = model
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
