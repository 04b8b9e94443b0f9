//! Edges spilled to disk by destination row range, then read back one range at a time as sorted CSR rows:
//! an external bucket sort, so a generator or importer can emit edges in any order (and both directions
//! of each) while holding only one bucket's edges, never the graph.
//!
//! An entry is a `u64` key `row << 32 | column`; bucket `b` holds the entries of rows
//! `[b * bucket_rows, (b + 1) * bucket_rows)` in a file of its own inside a temporary folder (removed on
//! drop). Reading a bucket sorts and deduplicates its keys, which gives exactly the rows
//! [`crate::csr_from_edges`] builds (ascending, no repeats; self loops are never spilled).

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::ops::Range;
use std::path::Path;
use std::sync::Mutex;

use crate::error::Error;

/// At most this many bucket files (each open while spilling); more rows per bucket beyond that.
const MAX_BUCKETS: usize = 256;

pub(crate) struct EdgeSpill {
    dir: tempfile::TempDir,
    n: usize,
    bucket_rows: usize,
    files: Vec<Mutex<BufWriter<File>>>,
}

impl EdgeSpill {
    /// A spill for `n` rows in a temporary folder inside `parent`; buckets are whole multiples of
    /// `chunk_rows` rows, so every output chunk comes from one bucket.
    pub(crate) fn new(parent: &Path, n: usize, chunk_rows: usize) -> Result<EdgeSpill, Error> {
        let chunks = n.div_ceil(chunk_rows).max(1);
        let bucket_rows = chunk_rows * chunks.div_ceil(MAX_BUCKETS);
        let dir = tempfile::Builder::new()
            .prefix(".spill-")
            .tempdir_in(parent)
            .map_err(|e| Error::io(parent, e))?;
        let files = (0..n.div_ceil(bucket_rows))
            .map(|b| {
                let path = dir.path().join(format!("bucket-{b:05}.bin"));
                File::create(&path)
                    .map(|f| Mutex::new(BufWriter::with_capacity(1 << 16, f)))
                    .map_err(|e| Error::io(&path, e))
            })
            .collect::<Result<_, Error>>()?;
        Ok(EdgeSpill {
            dir,
            n,
            bucket_rows,
            files,
        })
    }

    pub(crate) fn num_buckets(&self) -> usize {
        self.files.len()
    }

    pub(crate) fn bucket_range(&self, b: usize) -> Range<usize> {
        b * self.bucket_rows..((b + 1) * self.bucket_rows).min(self.n)
    }

    /// Spills edges `src[i] -> dst[i]` into row `dst[i]` (and, `undirected`, `dst[i]` into row `src[i]`),
    /// dropping self loops. Callable from many threads at once.
    pub(crate) fn push(&self, src: &[u32], dst: &[u32], undirected: bool) -> Result<(), Error> {
        let mut keys: Vec<u64> = Vec::with_capacity(src.len() * (1 + undirected as usize));
        for (&s, &d) in src.iter().zip(dst) {
            if s == d {
                continue;
            }
            keys.push(((d as u64) << 32) | s as u64);
            if undirected {
                keys.push(((s as u64) << 32) | d as u64);
            }
        }
        keys.sort_unstable();
        let mut rest: &[u64] = &keys;
        while let Some(&first) = rest.first() {
            let b = (first >> 32) as usize / self.bucket_rows;
            let end_row = ((b + 1) * self.bucket_rows) as u64;
            let len = rest.partition_point(|&k| (k >> 32) < end_row);
            let (now, later) = rest.split_at(len);
            let mut w = self.files[b]
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            w.write_all(bytemuck::cast_slice(now))
                .map_err(|e| Error::io(self.bucket_path(b), e))?;
            rest = later;
        }
        Ok(())
    }

    fn bucket_path(&self, b: usize) -> std::path::PathBuf {
        self.dir.path().join(format!("bucket-{b:05}.bin"))
    }

    /// Flushes every bucket file; call once all edges are pushed.
    pub(crate) fn flush(&mut self) -> Result<(), Error> {
        for (b, f) in self.files.iter_mut().enumerate() {
            let w = f.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner());
            w.flush()
                .map_err(|e| Error::io(self.dir.path().join(format!("bucket-{b:05}.bin")), e))?;
        }
        Ok(())
    }

    /// Bucket `b`'s rows: local offsets (`rows + 1`, from 0) and the ascending, deduplicated entries.
    /// Deletes the bucket file.
    pub(crate) fn read_bucket(&self, b: usize) -> Result<(Vec<i64>, Vec<i32>), Error> {
        let path = self.bucket_path(b);
        let mut f = File::open(&path).map_err(|e| Error::io(&path, e))?;
        let len = f.metadata().map_err(|e| Error::io(&path, e))?.len() as usize;
        let mut keys = vec![0u64; len / 8];
        f.read_exact(bytemuck::cast_slice_mut(&mut keys))
            .map_err(|e| Error::io(&path, e))?;
        drop(f);
        let _ = std::fs::remove_file(&path);
        keys.sort_unstable();
        keys.dedup();
        let r = self.bucket_range(b);
        let mut indptr = vec![0i64; r.len() + 1];
        for &k in &keys {
            indptr[(k >> 32) as usize - r.start + 1] += 1;
        }
        for i in 0..r.len() {
            indptr[i + 1] += indptr[i];
        }
        let indices = keys.iter().map(|&k| (k & 0xffff_ffff) as i32).collect();
        Ok((indptr, indices))
    }
}
