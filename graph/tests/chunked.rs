//! The chunked dataset layout: round trips (in-memory, Cora, both generators streamed), range reads,
//! every way a manifest or a chunk can be bad (each error names the file and the field or chunk), the
//! streamed partitioner and streamed parts against their in-memory counterparts.

use std::path::{Path, PathBuf};

use physalia_graph::chunked::{ChunkedDataset, MANIFEST_FILE, write_chunked};
use physalia_graph::chunked_partition::{
    PartContext, begin_set_chunked, cut_part, partition_chunked,
};
use physalia_graph::chunked_synth::{rmat_chunked, sbm_chunked};
use physalia_graph::partition::{
    PartitionMethod, build_parts, ensure_partitions_with, list_partitions, load_partitioning,
};
use physalia_graph::stream::{StreamAlgorithm, StreamParams, partition_stream};
use physalia_graph::synth::{rmat, sbm};
use physalia_graph::{
    Error, FeatureDtype, Features, ImportOptions, OwnedDataset, RmatParams, SbmParams, Split,
    csr_from_edge_pairs, import,
};

const CORA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/data/cora");

fn small() -> OwnedDataset {
    let csr = csr_from_edge_pairs(7, &[(0, 1), (1, 2), (2, 3), (4, 5), (5, 0)], true);
    let feats: Vec<f32> = (0..14).map(|x| x as f32 * 0.5).collect();
    OwnedDataset::from_parts(
        "small",
        "test",
        false,
        csr,
        Features::F32(feats),
        2,
        vec![0, 1, 2, 0, -1, 1, 2],
        [vec![0, 1], vec![2, 6], vec![3]],
    )
}

fn sbm_params(n: usize, seed: u64) -> SbmParams {
    SbmParams {
        num_nodes: n,
        avg_degree: 8.0,
        feat_dim: 16,
        seed,
        ..SbmParams::default()
    }
}

fn chunk_file(dir: &Path, tensor: &str, i: usize) -> PathBuf {
    let ds = ChunkedDataset::open(dir).unwrap();
    let t = ds
        .manifest()
        .tensors
        .all()
        .into_iter()
        .find(|(n, _)| *n == tensor)
        .unwrap()
        .1
        .clone();
    dir.join(&t.chunks[i].file)
}

#[test]
fn round_trip_small_in_every_dtype_and_chunk_size() {
    let tmp = tempfile::tempdir().unwrap();
    for dtype in [FeatureDtype::F32, FeatureDtype::F16, FeatureDtype::BF16] {
        for rows in [1, 2, 3, 7, 100] {
            let ds = small().convert_features(dtype);
            let dir = tmp.path().join(format!("small-{dtype}-{rows}"));
            let m = write_chunked(&ds, &dir, rows).unwrap();
            assert_eq!(m.num_chunks(), 7usize.div_ceil(rows));
            let back = ChunkedDataset::open(&dir).unwrap().load().unwrap();
            assert_eq!(back, ds, "dtype {dtype}, {rows} rows per chunk");
        }
    }
}

#[test]
fn cora_round_trips_and_ranges_are_slices() {
    let cora = import::generic(Path::new(CORA), &ImportOptions::default()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cora");
    write_chunked(&cora, &dir, 500).unwrap();
    let ds = ChunkedDataset::open(&dir).unwrap();
    assert_eq!(ds.manifest().num_chunks(), 6);
    assert_eq!(ds.load().unwrap(), cora);
    ds.verify().unwrap();
    // Ranges inside a chunk, across chunks, empty, whole.
    let f = cora.meta.feat_dim;
    for r in [0..10, 490..1510, 1000..1000, 2700..2708, 0..2708, 499..501] {
        let got = ds.read_rows(r.clone()).unwrap();
        let (a, b) = (cora.indptr[r.start], cora.indptr[r.end]);
        let want_ptr: Vec<i64> = cora.indptr[r.start..=r.end].iter().map(|x| x - a).collect();
        assert_eq!(got.indptr, want_ptr, "{r:?}");
        assert_eq!(got.indices, &cora.indices[a as usize..b as usize], "{r:?}");
        assert_eq!(got.labels, &cora.labels[r.clone()], "{r:?}");
        let Features::F32(all) = &cora.features else {
            panic!("cora is f32")
        };
        assert_eq!(
            got.features,
            Features::F32(all[r.start * f..r.end * f].to_vec()),
            "{r:?}"
        );
    }
    assert!(matches!(ds.read_rows(2700..2709), Err(Error::Param { .. })));
    // Degrees and the row stream agree with the CSR.
    let deg = ds.degrees().unwrap();
    let mut seen = 0;
    ds.for_each_row(|v, row| {
        assert_eq!(row, cora.csr().neighbors(v));
        assert_eq!(deg[v] as usize, row.len());
        assert_eq!(v, seen);
        seen += 1;
    })
    .unwrap();
    assert_eq!(seen, 2708);
}

#[test]
fn streamed_synth_equals_the_in_memory_generators() {
    let tmp = tempfile::tempdir().unwrap();
    for (i, (n, rows)) in [(1000, 64), (40_000, 16_384), (40_000, 10_000)]
        .into_iter()
        .enumerate()
    {
        let p = sbm_params(n, i as u64 + 3);
        let dir = tmp.path().join(format!("sbm{i}"));
        sbm_chunked(&p, &dir, rows).unwrap();
        let back = ChunkedDataset::open(&dir).unwrap().load().unwrap();
        let want = sbm(&p).unwrap();
        assert_eq!(back.meta.source, want.meta.source);
        assert_eq!(back, want, "sbm n={n} rows={rows}");
        // No spill or data folder is left behind besides the one the manifest uses.
        let entries: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(entries.len(), 2, "{entries:?}");
    }
    for undirected in [true, false] {
        let p = RmatParams {
            scale: 12,
            edge_factor: 6,
            feat_dim: 8,
            undirected,
            seed: 5,
            ..RmatParams::default()
        };
        let dir = tmp.path().join(format!("rmat-{undirected}"));
        rmat_chunked(&p, &dir, 1000).unwrap();
        let back = ChunkedDataset::open(&dir).unwrap().load().unwrap();
        assert_eq!(back, rmat(&p).unwrap(), "rmat undirected={undirected}");
    }
}

#[test]
fn rewriting_replaces_the_old_data_and_keeps_the_folder_clean() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("d");
    write_chunked(&small(), &dir, 2).unwrap();
    let other = sbm(&sbm_params(300, 1)).unwrap();
    write_chunked(&other, &dir, 128).unwrap();
    assert_eq!(ChunkedDataset::open(&dir).unwrap().load().unwrap(), other);
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    // A writer dropped before finish leaves the dataset as it was and no data folder behind.
    let mut ds = small();
    ds.labels[0] = 5; // above num_classes: refused at append
    assert!(write_chunked(&ds, &dir, 2).is_err());
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);
    assert_eq!(ChunkedDataset::open(&dir).unwrap().load().unwrap(), other);
}

#[test]
fn a_corrupted_chunk_is_refused_naming_the_file_and_both_checksums() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("d");
    write_chunked(&sbm(&sbm_params(500, 2)).unwrap(), &dir, 100).unwrap();
    let victim = chunk_file(&dir, "features", 3);
    let mut bytes = std::fs::read(&victim).unwrap();
    bytes[17] ^= 0x40;
    std::fs::write(&victim, &bytes).unwrap();
    let ds = ChunkedDataset::open(&dir).unwrap(); // the manifest alone is fine
    let err = ds.load().unwrap_err();
    let msg = err.to_string();
    match &err {
        Error::Checksum {
            path,
            tensor,
            expected,
            actual,
        } => {
            assert_eq!(path, &victim);
            assert_eq!(tensor, "features");
            assert_ne!(expected, actual);
            assert!(msg.contains(expected.as_str()) && msg.contains(actual.as_str()));
        }
        other => panic!("expected a checksum error, got {other}"),
    }
    assert!(msg.contains("features-000003.bin"), "{msg}");
    assert!(ds.verify().is_err());
    // Chunks that do not hold the bad one still read.
    ds.read_rows(0..300).unwrap();
    assert!(ds.read_rows(250..350).is_err());

    // A truncated chunk file: the size is checked before the checksum.
    let edges = chunk_file(&dir, "indices", 1);
    let bytes = std::fs::read(&edges).unwrap();
    std::fs::write(&edges, &bytes[..bytes.len() - 4]).unwrap();
    let msg = ds.read_rows(100..110).unwrap_err().to_string();
    assert!(
        msg.contains("indices-000001.bin") && msg.contains("bytes"),
        "{msg}"
    );
    // The row stream stops with the error too.
    let msg = ds.for_each_row(|_, _| {}).unwrap_err().to_string();
    assert!(msg.contains("indices-000001.bin"), "{msg}");
}

#[test]
fn bad_chunk_contents_are_refused_even_with_a_matching_checksum() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("d");
    write_chunked(&small(), &dir, 3).unwrap();
    // Rewrite an indices chunk with an out-of-range id and fix its checksum in the manifest.
    let victim = chunk_file(&dir, "indices", 0);
    let mut ids: Vec<i32> = bytemuck::pod_collect_to_vec(&std::fs::read(&victim).unwrap());
    ids[0] = 99;
    std::fs::write(&victim, bytemuck::cast_slice(&ids)).unwrap();
    let mpath = dir.join(MANIFEST_FILE);
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&mpath).unwrap()).unwrap();
    m["tensors"]["indices"]["chunks"][0]["xxh3"] =
        physalia_graph::checksum(bytemuck::cast_slice(&ids)).into();
    std::fs::write(&mpath, serde_json::to_string(&m).unwrap()).unwrap();
    let ds = ChunkedDataset::open(&dir).unwrap();
    let msg = ds.for_each_row(|_, _| {}).unwrap_err().to_string();
    assert!(
        msg.contains("indices-000000.bin") && msg.contains("99") && msg.contains("out of range"),
        "{msg}"
    );
    // The partitioner gets the error instead of indexing out of bounds.
    assert!(partition_chunked(&ds, &StreamParams::new(2)).is_err());
}

#[test]
fn a_truncated_or_inconsistent_manifest_is_refused_naming_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("d");
    write_chunked(&small(), &dir, 3).unwrap();
    let mpath = dir.join(MANIFEST_FILE);
    let text = std::fs::read_to_string(&mpath).unwrap();

    // Cut inside the features' chunk list.
    let cut = text.find("\"features\"").unwrap() + 40;
    std::fs::write(&mpath, &text[..cut]).unwrap();
    let msg = ChunkedDataset::open(&dir).unwrap_err().to_string();
    assert!(msg.contains(MANIFEST_FILE), "{msg}");
    assert!(msg.contains("truncated"), "{msg}");
    assert!(msg.contains("field 'tensors.features."), "{msg}");
    // Cut inside the third indices chunk's checksum.
    let third = text.match_indices("indices-000002.bin").next().unwrap().0;
    let cut = third + text[third..].find("xxh3").unwrap() + 12;
    std::fs::write(&mpath, &text[..cut]).unwrap();
    let msg = ChunkedDataset::open(&dir).unwrap_err().to_string();
    assert!(
        msg.contains("field 'tensors.indices.chunks[2].xxh3'"),
        "{msg}"
    );

    let value: serde_json::Value = serde_json::from_str(&text).unwrap();
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit)> = vec![
        (
            "num_edges",
            Box::new(|m| {
                m.as_object_mut().unwrap().remove("num_edges");
            }),
        ),
        (
            "labels",
            Box::new(|m| {
                m["tensors"].as_object_mut().unwrap().remove("labels");
            }),
        ),
        ("num_nodes", Box::new(|m| m["num_nodes"] = 8.into())),
        ("num_edges", Box::new(|m| m["num_edges"] = 11.into())),
        (
            "tensors.features.chunks[1].bytes",
            Box::new(|m| m["tensors"]["features"]["chunks"][1]["bytes"] = 7.into()),
        ),
        (
            "tensors.labels.chunks[0].rows",
            Box::new(|m| m["tensors"]["labels"]["chunks"][0]["rows"] = serde_json::json!([0, 2])),
        ),
        (
            "tensors.indices.chunks[1].edges",
            Box::new(|m| {
                m["tensors"]["indices"]["chunks"][1]
                    .as_object_mut()
                    .unwrap()
                    .remove("edges");
            }),
        ),
        (
            "tensors.indptr.chunks[0].file",
            Box::new(|m| m["tensors"]["indptr"]["chunks"][0]["file"] = "../x.bin".into()),
        ),
        (
            "format_version",
            Box::new(|m| m["format_version"] = 9.into()),
        ),
        (
            "tensors.train_idx.chunks",
            Box::new(|m| m["splits"]["train"] = 3.into()),
        ),
        (
            "tensors.features.dtype",
            Box::new(|m| m["tensors"]["features"]["dtype"] = "f16".into()),
        ),
    ];
    for (field, edit) in cases {
        let mut m = value.clone();
        edit(&mut m);
        std::fs::write(&mpath, serde_json::to_string(&m).unwrap()).unwrap();
        let msg = ChunkedDataset::open(&dir).unwrap_err().to_string();
        assert!(msg.contains(MANIFEST_FILE), "{field}: {msg}");
        assert!(msg.contains(field), "expected the field {field} in: {msg}");
    }
}

#[test]
fn the_writer_refuses_bad_input_naming_what_was_expected() {
    let tmp = tempfile::tempdir().unwrap();
    // An undirected dataset whose edges are one-way.
    let mut ds = small();
    ds.indptr = vec![0, 0, 1, 1, 1, 1, 1, 1];
    ds.indices = vec![0];
    ds.meta.num_edges = 1;
    let msg = write_chunked(&ds, &tmp.path().join("a"), 3)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("one direction"), "{msg}");
    ds.meta.directed = true;
    write_chunked(&ds, &tmp.path().join("b"), 3).unwrap();
    // A path that is a file.
    let file = tmp.path().join("f");
    std::fs::write(&file, b"x").unwrap();
    let msg = write_chunked(&small(), &file, 3).unwrap_err().to_string();
    assert!(msg.contains("not a directory"), "{msg}");
    assert!(matches!(
        write_chunked(&small(), &tmp.path().join("c"), 0),
        Err(Error::Param {
            param: "chunk_rows",
            ..
        })
    ));
}

#[test]
fn streamed_partition_equals_the_in_memory_one() {
    let tmp = tempfile::tempdir().unwrap();
    let p = sbm_params(30_000, 9);
    let dir = tmp.path().join("sbm");
    sbm_chunked(&p, &dir, 4096).unwrap();
    let ds = ChunkedDataset::open(&dir).unwrap();
    let mem = sbm(&p).unwrap();
    for params in [
        StreamParams::new(4),
        StreamParams {
            passes: 3,
            algorithm: StreamAlgorithm::Ldg,
            seed: 4,
            ..StreamParams::new(7)
        },
    ] {
        let streamed = partition_chunked(&ds, &params).unwrap();
        let in_memory = partition_stream(mem.csr(), &params).unwrap();
        assert_eq!(streamed.partitioning, in_memory.partitioning, "{params:?}");
        assert_eq!(streamed.passes.len(), in_memory.passes.len());
    }
    // A sequential source cannot shuffle.
    let shuffled = StreamParams {
        order: physalia_graph::StreamOrder::Shuffled,
        ..StreamParams::new(2)
    };
    assert!(matches!(
        partition_chunked(&ds, &shuffled),
        Err(Error::Param { param: "order", .. })
    ));
}

#[test]
fn streamed_parts_equal_build_parts_and_the_set_is_stored_and_reused() {
    let tmp = tempfile::tempdir().unwrap();
    let mem = small();
    let dir = tmp.path().join("small");
    write_chunked(&mem, &dir, 3).unwrap();
    let ds = ChunkedDataset::open(&dir).unwrap();
    let p = partition_chunked(&ds, &StreamParams::new(3))
        .unwrap()
        .partitioning;
    let want = build_parts(&mem, &p).unwrap();
    let ctx = PartContext::new(&ds, &p).unwrap();
    for (me, w) in want.iter().enumerate() {
        assert_eq!(&ctx.build(me).unwrap(), w, "part {me}");
    }

    // Bigger, with f16 features, through ensure_partitions_with.
    let mem = sbm(&sbm_params(5000, 1))
        .unwrap()
        .convert_features(FeatureDtype::F16);
    let dir = tmp.path().join("sbm");
    write_chunked(&mem, &dir, 1024).unwrap();
    let sets = ensure_partitions_with(&dir, &[2, 5], 0, None).unwrap();
    assert_eq!(sets.len(), 2);
    for s in &sets {
        assert!(!s.reused);
        // A chunked dataset's default: the refined streaming partitioner.
        assert_eq!(s.meta.method, "fennel-x20~0.001-lp8-il");
        let (meta, p) = load_partitioning(&s.dir.join("partition.safetensors")).unwrap();
        let in_memory = partition_stream(mem.csr(), &StreamParams::refined(meta.k))
            .unwrap()
            .partitioning;
        assert_eq!(p.parts, in_memory.parts);
        assert_eq!(meta.edge_cut, in_memory.edge_cut);
        let want = build_parts(&mem, &p).unwrap();
        for (f, w) in s.part_files.iter().zip(&want) {
            assert_eq!(&physalia_graph::Part::load(f).unwrap(), w);
        }
    }
    let again = ensure_partitions_with(&dir, &[5], 0, None).unwrap();
    assert!(again[0].reused);
    let listed = list_partitions(&dir).unwrap();
    assert_eq!(listed.len(), 2);
    // Another method recomputes; METIS is refused on a chunked dataset.
    let ldg = PartitionMethod::Stream(StreamParams {
        algorithm: StreamAlgorithm::Ldg,
        ..StreamParams::new(5)
    });
    let redone = ensure_partitions_with(&dir, &[5], 0, Some(&ldg)).unwrap();
    assert!(!redone[0].reused);
    assert_eq!(redone[0].meta.method, "ldg");
    let msg = ensure_partitions_with(&dir, &[2], 0, Some(&PartitionMethod::Metis))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("METIS"), "{msg}");
    // Rewriting the dataset makes the sets stale.
    write_chunked(&sbm(&sbm_params(5000, 2)).unwrap(), &dir, 1024).unwrap();
    let stale = list_partitions(&dir).unwrap();
    assert!(
        stale
            .iter()
            .all(|s| s.status == physalia_graph::partition::ArtifactStatus::Stale)
    );
}

/// A set cut by its workers (issue 31): the assignment stored pending, each part cut by a process of
/// its own reading the dataset in place, then committed. The parts equal the ones cut in one process,
/// the committed set equals `ensure_partitions`'s own and is reused; an uncommitted set is missing to
/// every reader; a commit with a part missing fails and commits nothing; an assignment of another
/// version of the dataset is refused.
#[test]
fn parts_cut_one_by_one_from_a_pending_assignment_equal_the_set_cut_in_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    let mem = sbm(&sbm_params(3000, 4)).unwrap();
    let dir = tmp.path().join("sbm");
    write_chunked(&mem, &dir, 512).unwrap();
    let params = StreamParams::new(3);
    let current = |d: &Path| {
        list_partitions(d)
            .unwrap()
            .into_iter()
            .filter(|s| s.status == physalia_graph::partition::ArtifactStatus::Current)
            .count()
    };
    let pending = begin_set_chunked(&dir, 3, 0, &params).unwrap();
    assert_eq!(pending.k, 3);
    // nothing committed yet: no current set, so a reader would compute it again
    assert_eq!(current(&dir), 0);
    // the parts, cut each on its own, equal build_parts on the in-memory dataset
    let ds = ChunkedDataset::open(&dir).unwrap();
    let p = partition_chunked(
        &ds,
        &StreamParams {
            seed: 0,
            ..params.clone()
        },
    )
    .unwrap()
    .partitioning;
    let want = build_parts(&mem, &p).unwrap();
    // a commit before the parts exist fails and leaves the set uncommitted
    let early = pending.commit().unwrap_err().to_string();
    assert!(early.contains("part0.safetensors"), "{early}");
    assert_eq!(current(&dir), 0);
    for (me, out) in pending.part_files.iter().enumerate() {
        let part = cut_part(&dir, &pending.assignment, me, out).unwrap();
        assert_eq!(part, want[me], "part {me}");
        assert_eq!(physalia_graph::Part::load(out).unwrap(), want[me]);
    }
    let err = cut_part(&dir, &pending.assignment, 3, &tmp.path().join("x")).unwrap_err();
    assert!(err.to_string().contains("part 3"), "{err}");
    let meta = pending.commit().unwrap();
    assert!(
        !pending.assignment.exists(),
        "the pending assignment goes with the commit"
    );
    assert_eq!(meta.k, 3);
    assert_eq!(meta.edge_cut, p.edge_cut);
    assert!(
        meta.num_undirected_edges > 0 && meta.cut_fraction() > 0.0 && meta.cut_fraction() < 1.0
    );
    // the committed set is current and reused, with the same fingerprints as one computed in one process
    let method = PartitionMethod::Stream(params.clone());
    let reused = ensure_partitions_with(&dir, &[3], 0, Some(&method)).unwrap();
    assert!(reused[0].reused);
    let other = tmp.path().join("sbm2");
    write_chunked(&mem, &other, 512).unwrap();
    let one = ensure_partitions_with(&other, &[3], 0, Some(&method)).unwrap();
    assert!(!one[0].reused);
    let fps = |m: &physalia_graph::partition::PartitionMeta| {
        m.parts
            .iter()
            .map(|s| s.fingerprint.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(fps(&reused[0].meta), fps(&one[0].meta));
    assert_eq!(
        reused[0].meta.num_undirected_edges,
        one[0].meta.num_undirected_edges
    );

    // an assignment made before the dataset was rewritten is refused by the cutter
    let again = begin_set_chunked(&dir, 3, 0, &params).unwrap();
    // beginning again removed the commit marker: no reader pairs it with parts being cut
    assert_eq!(current(&dir), 0);
    write_chunked(&sbm(&sbm_params(3000, 5)).unwrap(), &dir, 512).unwrap();
    let out = &again.part_files[0];
    let stale = cut_part(&dir, &again.assignment, 0, out)
        .unwrap_err()
        .to_string();
    assert!(stale.contains("another version"), "{stale}");
}

#[test]
fn split_ids_are_checked_by_the_writer() {
    let tmp = tempfile::tempdir().unwrap();
    let mut ds = small();
    ds.val_idx = vec![4]; // node 4 is unlabelled
    let msg = write_chunked(&ds, &tmp.path().join("a"), 3)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("val_idx") && msg.contains("unlabelled"),
        "{msg}"
    );
    let ds = ChunkedDataset::open(&{
        let d = tmp.path().join("b");
        write_chunked(&small(), &d, 2).unwrap();
        d
    })
    .unwrap();
    assert_eq!(ds.read_split(Split::Val).unwrap(), vec![2, 6]);
    assert_eq!(ds.manifest().splits.train, 2);
}

fn put_gz(dir: &Path, name: &str, text: &str) {
    use std::io::Write;
    let p = dir.join(name);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    let mut enc = flate2::write::GzEncoder::new(
        std::fs::File::create(p).unwrap(),
        flate2::Compression::fast(),
    );
    enc.write_all(text.as_bytes()).unwrap();
    enc.finish().unwrap();
}

/// An OGB raw folder holding an SBM graph: each undirected edge once, in a scrambled order, some repeats
/// and a self loop; some nodes unlabelled.
fn ogb_folder(dir: &Path, n: usize) {
    let g = sbm(&sbm_params(n, 11)).unwrap();
    let mut edges = String::new();
    let mut k = 0usize;
    for v in (0..n).rev() {
        for &u in g.csr().neighbors(v) {
            if (u as usize) < v {
                k += 1;
                if k.is_multiple_of(2) {
                    edges.push_str(&format!("{u},{v}\n"));
                } else {
                    edges.push_str(&format!("{v},{u}\n"));
                }
                if k.is_multiple_of(7) {
                    edges.push_str(&format!("{v},{u}\n"));
                }
            }
        }
    }
    edges.push_str("3,3\n");
    put_gz(dir, "raw/edge.csv.gz", &edges);
    let Features::F32(f) = &g.features else {
        unreachable!()
    };
    let feats: Vec<String> = f
        .chunks(g.meta.feat_dim)
        .map(|r| {
            r.iter()
                .map(|x| format!("{}", x.abs()))
                .collect::<Vec<_>>()
                .join(",")
        })
        .collect();
    put_gz(dir, "raw/node-feat.csv.gz", &(feats.join("\n") + "\n"));
    let labels: Vec<String> = (0..n)
        .map(|v| {
            if v % 13 == 5 {
                "nan".into()
            } else {
                g.labels[v].to_string()
            }
        })
        .collect();
    put_gz(dir, "raw/node-label.csv.gz", &(labels.join("\n") + "\n"));
    put_gz(dir, "raw/num-node-list.csv.gz", &format!("{n}\n"));
    let ids = |s: &[i64]| {
        s.iter()
            .filter(|&&v| v % 13 != 5)
            .map(|v| v.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    };
    put_gz(dir, "split/time/train.csv.gz", &ids(&g.train_idx));
    put_gz(dir, "split/time/valid.csv.gz", &ids(&g.val_idx));
    put_gz(dir, "split/time/test.csv.gz", &ids(&g.test_idx));
}

#[test]
fn streamed_ogb_import_equals_the_in_memory_importer() {
    use physalia_graph::chunked_import::ogb_chunked;
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("ogbn-test");
    ogb_folder(&src, 3000);
    let variants = [
        ImportOptions::default(),
        ImportOptions {
            undirected: false,
            row_normalize: true,
            feature_dtype: FeatureDtype::BF16,
            ..ImportOptions::default()
        },
    ];
    for (i, opts) in variants.iter().enumerate() {
        for rows in [256, 1000, 5000] {
            let out = tmp.path().join(format!("out-{i}-{rows}"));
            ogb_chunked(&src, opts, &out, rows).unwrap();
            let back = ChunkedDataset::open(&out).unwrap().load().unwrap();
            let want = import::ogb(&src, opts).unwrap();
            assert_eq!(back, want, "variant {i}, {rows} rows per chunk");
            assert_eq!(std::fs::read_dir(&out).unwrap().count(), 2);
        }
    }
    // A bad edge line is reported with its file and line, and nothing is left behind.
    put_gz(&src, "raw/edge.csv.gz", "0,1\n1,2\n2,3000\n");
    let out = tmp.path().join("bad");
    let msg = ogb_chunked(&src, &ImportOptions::default(), &out, 256)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("edge.csv.gz:3") && msg.contains("3000"),
        "{msg}"
    );
    assert!(ChunkedDataset::open(&out).is_err());
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0);
    // Fewer labels than nodes.
    ogb_folder(&src, 3000);
    put_gz(&src, "raw/node-label.csv.gz", "1\n2\n");
    let msg = ogb_chunked(&src, &ImportOptions::default(), &out, 256)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("node-label.csv.gz") && msg.contains("labels"),
        "{msg}"
    );
}
