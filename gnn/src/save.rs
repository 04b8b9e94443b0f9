//! Trained models as safetensors files: one tensor per parameter (`layers.0.weight`, `layers.0.bias`, ...),
//! the model configuration as JSON metadata. Loadable from PyTorch with `safetensors.torch.load_file`.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};

use crate::model::Model;
use crate::{Error, Result};

/// Writes the model atomically: a temporary file in the same folder, renamed into place when complete.
pub fn save_model(model: &Model, path: &Path, extra_metadata: &[(&str, String)]) -> Result<()> {
    let io = |source| Error::Io { path: path.to_path_buf(), source };
    let shapes: Vec<(String, Vec<usize>, &[u8])> = model
        .params
        .iter()
        .map(|p| {
            let (r, c) = p.value.shape();
            let shape = if r == 1 && p.name.ends_with("bias") { vec![c] } else { vec![r, c] };
            (p.name.clone(), shape, bytemuck::cast_slice(p.value.data()))
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = shapes
        .iter()
        .map(|(n, s, b)| Ok((n.clone(), TensorView::new(Dtype::F32, s.clone(), b)?)))
        .collect::<std::result::Result<_, safetensors::SafeTensorError>>()
        .map_err(|e| Error::Format(format!("{}: {e}", path.display())))?;
    let mut meta = HashMap::new();
    meta.insert(
        "physalia.model".to_string(),
        serde_json::to_string(model.config()).expect("model config serialises"),
    );
    for (k, v) in extra_metadata {
        meta.insert((*k).to_string(), v.clone());
    }
    let bytes = safetensors::serialize(views, Some(meta)).map_err(|e| Error::Format(format!("{}: {e}", path.display())))?;
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let tmp = dir.join(format!(".{}.tmp", path.file_name().and_then(|n| n.to_str()).unwrap_or("model")));
    let mut f = std::fs::File::create(&tmp).map_err(io)?;
    f.write_all(&bytes).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)?;
    Ok(())
}
