//! A minimal reader for NumPy `.npy` files: the subset importers need (little-endian int32/int64/
//! float16/float32/float64, C order), with errors that say which file and what was wrong. Written here
//! rather than pulled in as a dependency because the format is tiny and we want our own error messages.

use std::path::Path;

use half::f16;

use crate::error::Error;

const MAGIC: &[u8] = b"\x93NUMPY";

/// Element values of an array, widened where lossless and convenient.
#[derive(Debug)]
pub(crate) enum NpyData {
    /// int32 and int64 both land here.
    Int(Vec<i64>),
    /// float32 and float64 (rounded to f32).
    F32(Vec<f32>),
    F16(Vec<f16>),
}

#[derive(Debug)]
pub(crate) struct NpyArray {
    pub shape: Vec<usize>,
    pub data: NpyData,
}

impl NpyArray {
    /// The array as integers, or an error naming the file if it holds floats.
    pub fn into_ints(self, path: &Path) -> Result<(Vec<usize>, Vec<i64>), Error> {
        match self.data {
            NpyData::Int(v) => Ok((self.shape, v)),
            _ => Err(Error::input(
                path,
                "holds floating-point values, expected int32 or int64",
            )),
        }
    }
}

pub(crate) fn read(path: &Path) -> Result<NpyArray, Error> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    parse(path, &bytes)
}

fn parse(path: &Path, bytes: &[u8]) -> Result<NpyArray, Error> {
    let bad = |problem: String| Error::input(path, problem);
    if bytes.len() < 10 || &bytes[..6] != MAGIC {
        return Err(bad("not a .npy file (missing \\x93NUMPY magic)".into()));
    }
    let major = bytes[6];
    let (header_len, header_start) = match major {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 => {
            let Some(b) = bytes.get(8..12) else {
                return Err(bad("file truncated inside the .npy preamble".into()));
            };
            (u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize, 12)
        }
        v => {
            return Err(bad(format!(
                ".npy format version {v} is not supported (1, 2 or 3)"
            )));
        }
    };
    let Some(header) = bytes.get(header_start..header_start + header_len) else {
        return Err(bad(format!(
            "file truncated: header says {header_len} bytes, file has {} after the preamble",
            bytes.len().saturating_sub(header_start)
        )));
    };
    // Version 3 only differs by allowing UTF-8 in the header; all keys we read are ASCII.
    let header =
        std::str::from_utf8(header).map_err(|_| bad("header is not valid UTF-8".into()))?;
    let descr = dict_value(header, "descr")
        .and_then(|v| quoted(v))
        .ok_or_else(|| bad(format!("header has no 'descr' string: {header:?}")))?;
    let fortran = dict_value(header, "fortran_order")
        .ok_or_else(|| bad(format!("header has no 'fortran_order': {header:?}")))?;
    if fortran.starts_with("True") {
        return Err(bad(
            "array is in Fortran (column-major) order; save it with np.ascontiguousarray first"
                .into(),
        ));
    }
    if !fortran.starts_with("False") {
        return Err(bad(format!(
            "cannot read 'fortran_order' in header: {header:?}"
        )));
    }
    let shape = dict_value(header, "shape")
        .and_then(parse_shape)
        .ok_or_else(|| bad(format!("header has no readable 'shape' tuple: {header:?}")))?;

    let (order, kind) = descr.split_at(descr.len().min(1));
    if order == ">" {
        return Err(bad(format!(
            "dtype '{descr}' is big-endian; only little-endian arrays are supported (use arr.astype('<{kind}'))"
        )));
    }
    if !matches!(order, "<" | "=" | "|") {
        return Err(bad(format!("unsupported dtype '{descr}'")));
    }
    let item = match kind {
        "i4" | "i8" | "f2" | "f4" | "f8" => kind[1..].parse::<usize>().expect("matched digits"),
        _ => {
            return Err(bad(format!(
                "dtype '{descr}' is not supported; expected int32, int64, float16, float32 or float64"
            )));
        }
    };
    let count = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
    let data = &bytes[header_start + header_len..];
    let expected = count
        .checked_mul(item)
        .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
    if data.len() != expected {
        return Err(bad(format!(
            "data is {} bytes, expected {expected} for shape {shape:?} of '{descr}'",
            data.len()
        )));
    }
    let data = match kind {
        "i4" => NpyData::Int(
            data.chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().expect("chunk of 4")) as i64)
                .collect(),
        ),
        "i8" => NpyData::Int(
            data.chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("chunk of 8")))
                .collect(),
        ),
        "f2" => NpyData::F16(
            data.chunks_exact(2)
                .map(|c| f16::from_le_bytes(c.try_into().expect("chunk of 2")))
                .collect(),
        ),
        "f4" => NpyData::F32(
            data.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("chunk of 4")))
                .collect(),
        ),
        _ => NpyData::F32(
            data.chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("chunk of 8")) as f32)
                .collect(),
        ),
    };
    Ok(NpyArray { shape, data })
}

/// The text right after `'key':` in a Python dict literal.
fn dict_value<'a>(header: &'a str, key: &str) -> Option<&'a str> {
    for quote in ['\'', '"'] {
        let pat = format!("{quote}{key}{quote}");
        if let Some(pos) = header.find(&pat) {
            let rest = header[pos + pat.len()..].trim_start();
            return rest.strip_prefix(':').map(str::trim_start);
        }
    }
    None
}

fn quoted(v: &str) -> Option<&str> {
    let q = v.chars().next().filter(|c| *c == '\'' || *c == '"')?;
    let rest = &v[1..];
    rest.find(q).map(|end| &rest[..end])
}

/// Parses `(2708, 1433)`, `(5,)` or `()`.
fn parse_shape(v: &str) -> Option<Vec<usize>> {
    let inner = v.strip_prefix('(')?;
    let inner = &inner[..inner.find(')')?];
    inner
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.trim_end_matches('L').parse().ok())
        .collect()
}

/// Writes a little-endian C-order .npy (version 1). For tests and tools that want to produce inputs.
#[cfg(test)]
pub(crate) fn write(path: &Path, descr: &str, shape: &[usize], data: &[u8]) -> std::io::Result<()> {
    let shape_s = match shape {
        [d] => format!("({d},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header =
        format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape_s}, }}");
    // Pad so the data starts at a multiple of 64, with a trailing newline, as NumPy does.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + data.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[1, 0]);
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    std::fs::write(path, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_header(header: &str, data: &[u8]) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&[1, 0]);
        out.extend_from_slice(&(header.len() as u16).to_le_bytes());
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out
    }

    #[test]
    fn reads_ints_and_floats() {
        let p = Path::new("x.npy");
        let a = parse(
            p,
            &with_header(
                "{'descr': '<i4', 'fortran_order': False, 'shape': (2, 2), }\n",
                &[1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 255, 255, 255, 255],
            ),
        )
        .unwrap();
        assert_eq!(a.shape, vec![2, 2]);
        assert!(matches!(a.data, NpyData::Int(ref v) if v == &[1, 2, 3, -1]));
        let a = parse(
            p,
            &with_header(
                "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }",
                &1.5f32.to_le_bytes(),
            ),
        )
        .unwrap();
        assert!(matches!(a.data, NpyData::F32(ref v) if v == &[1.5]));
    }

    #[test]
    fn rejects_what_it_cannot_read() {
        let p = Path::new("x.npy");
        let err = |h: &str, d: &[u8]| parse(p, &with_header(h, d)).unwrap_err().to_string();
        assert!(
            err(
                "{'descr': '<i4', 'fortran_order': True, 'shape': (1,), }",
                &[0; 4]
            )
            .contains("Fortran")
        );
        assert!(
            err(
                "{'descr': '>i4', 'fortran_order': False, 'shape': (1,), }",
                &[0; 4]
            )
            .contains("big-endian")
        );
        assert!(
            err(
                "{'descr': '<u2', 'fortran_order': False, 'shape': (1,), }",
                &[0; 2]
            )
            .contains("not supported")
        );
        assert!(
            err(
                "{'descr': '<i8', 'fortran_order': False, 'shape': (2,), }",
                &[0; 8]
            )
            .contains("data is 8 bytes, expected 16")
        );
        assert!(
            parse(p, b"PK\x03\x04 not npy")
                .unwrap_err()
                .to_string()
                .contains("magic")
        );
    }
}
