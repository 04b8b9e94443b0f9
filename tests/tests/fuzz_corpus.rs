//! The fuzzing corpus, replayed without a fuzzer: every file under `fuzz/corpus/<target>/` (seeds) and
//! `fuzz/regressions/<target>/` (inputs that once crashed a decoder) goes through the same entry point as
//! the libFuzzer target (`physalia_tests::decode`). Nothing may panic; seeds named `ok-*` are valid inputs
//! and must decode (so the harness reaches each decoder's success path, not only its first error), and every
//! regression must be refused with an error.
//!
//! `cargo test -p physalia-tests --test fuzz_corpus -- --ignored write_seed_corpus` rewrites the generated
//! seeds (datasets, partitions, checkpoints, frames and messages, from the same helpers as the tests); the
//! YAML seeds are copies of `examples/` and the planner's fixtures.

use std::fs;
use std::path::{Path, PathBuf};

use physalia_tests::decode::Kind;
use physalia_tests::{repo_root, write_tiny_generic};

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| p.is_file())
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

#[test]
fn every_seed_and_regression_decodes_without_a_panic() {
    let root = repo_root().join("fuzz");
    for kind in Kind::ALL {
        let seeds = files(&root.join("corpus").join(kind.name()));
        let ok: Vec<_> = seeds
            .iter()
            .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("ok-"))
            .collect();
        assert!(
            !ok.is_empty(),
            "no valid seed for the {} target",
            kind.name()
        );
        for f in &seeds {
            let bytes = fs::read(f).unwrap();
            let got = kind.decode(&bytes);
            if ok.contains(&f) {
                assert!(got.is_ok(), "{}: {:?}", f.display(), got);
            }
        }
        for f in files(&root.join("regressions").join(kind.name())) {
            let got = kind.decode(&fs::read(&f).unwrap());
            assert!(got.is_err(), "{} decodes: it must be refused", f.display());
        }
    }
}

/// Writes `bytes` as seed `name` of `kind`.
fn seed(kind: Kind, name: &str, bytes: &[u8]) {
    let dir = repo_root().join("fuzz/corpus").join(kind.name());
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join(name), bytes).unwrap();
}

#[test]
#[ignore = "rewrites fuzz/corpus; run by hand after a format change"]
fn write_seed_corpus() {
    use physalia_control::transfer::{Reply, Request};
    use physalia_control::{ToCoordinator, ToWorker};
    use physalia_wire::{Dtype, Frame, FrameHeader, Phase};

    let t = tempfile::tempdir().unwrap();
    // a dataset, its partition set and a checkpoint of a model for it
    write_tiny_generic(&t.path().join("raw"));
    let ds = physalia_graph::import::generic(&t.path().join("raw"), &Default::default()).unwrap();
    let path = t.path().join("tiny.safetensors");
    ds.write(&path).unwrap();
    seed(
        Kind::Dataset,
        "ok-tiny.safetensors",
        &fs::read(&path).unwrap(),
    );
    let sets = physalia_graph::partition::ensure_partitions(&path, &[2], 1).unwrap();
    seed(
        Kind::Partitioning,
        "ok-k2.safetensors",
        &fs::read(sets[0].dir.join("partition.safetensors")).unwrap(),
    );
    for (p, f) in sets[0].part_files.iter().enumerate() {
        seed(
            Kind::Part,
            &format!("ok-part{p}.safetensors"),
            &fs::read(f).unwrap(),
        );
    }
    // a part delta: rank 0's, from that set's two parts to a partitioning into three
    let parts = |k: usize, owner: Vec<u32>| {
        let p =
            physalia_graph::partition::Partitioning::from_assignment(ds.csr(), k, owner, "seed", 0)
                .unwrap();
        physalia_graph::partition::build_parts(&ds, &p).unwrap()
    };
    let n = ds.csr().num_nodes();
    let old_owner: Vec<u32> = (0..n).map(|v| (v % 2) as u32).collect();
    let new_owner: Vec<u32> = (0..n).map(|v| (v % 3) as u32).collect();
    let new = parts(3, new_owner.clone());
    let mut d = physalia_worker::delta::diff(&old_owner, &new_owner, &new[0]);
    // with the rows of its input halo it will not hold
    let lacking = physalia_worker::delta::lacking_halo(&old_owner, ds.csr(), &new[0], true);
    d.carry_halo_rows(lacking, ds.features.view()).unwrap();
    let delta = t.path().join("delta0.bin");
    d.write(&delta).unwrap();
    seed(Kind::PartDelta, "ok-delta0.bin", &fs::read(&delta).unwrap());
    let cfg = physalia_gnn::ModelConfig::new(physalia_gnn::LayerKind::Gcn, 3, 4, 2);
    let model = physalia_gnn::Model::new(&cfg, 7).unwrap();
    let opt = physalia_gnn::Adam::new(&model.params, 0.01, 0.0);
    let ck = t.path().join("ck.safetensors");
    physalia_gnn::save::save_checkpoint(&model, &opt, &Default::default(), &ck).unwrap();
    seed(
        Kind::Checkpoint,
        "ok-gcn.safetensors",
        &fs::read(&ck).unwrap(),
    );

    // control messages, alone and in frames; a tensor frame of each dtype
    let messages: Vec<(&str, Vec<u8>)> = vec![
        (
            "register",
            serde_json::to_vec(&ToCoordinator::Register {
                rank: 1,
                pid: 4242,
                mesh_addr: "127.0.0.1:5001".parse().unwrap(),
            })
            .unwrap(),
        ),
        (
            "failed",
            serde_json::to_vec(&ToCoordinator::Failed {
                rank: 0,
                error: "x".into(),
            })
            .unwrap(),
        ),
        (
            "paused",
            serde_json::to_vec(&ToCoordinator::Paused {
                rank: 1,
                mesh_addr: "127.0.0.1:5002".parse().unwrap(),
                holds_part: false,
            })
            .unwrap(),
        ),
        (
            "stop",
            serde_json::to_vec(&ToWorker::Stop {
                reason: "done".into(),
            })
            .unwrap(),
        ),
        (
            "prefetch",
            serde_json::to_vec(&ToWorker::Prefetch {
                artifacts: vec![physalia_control::Artifact {
                    name: "part-prep0-k2-1".into(),
                    size: 1234,
                    xxh3: 0xfeed,
                    path: None,
                    url: None,
                }],
                ready: Some(physalia_control::ReadyAs {
                    layer: physalia_gnn::LayerKind::Sage,
                    seed: Some(physalia_control::SeedAs {
                        row_normalize: true,
                        dtype: physalia_wire::Dtype::F16,
                    }),
                }),
            })
            .unwrap(),
        ),
        (
            "get",
            serde_json::to_vec(&Request::Get {
                name: "dataset".into(),
            })
            .unwrap(),
        ),
        (
            "sending",
            serde_json::to_vec(&Reply::Sending { size: 10, xxh3: 99 }).unwrap(),
        ),
    ];
    for (name, json) in &messages {
        seed(Kind::Control, &format!("ok-{name}.json"), json);
        let value: serde_json::Value = serde_json::from_slice(json).unwrap();
        let frame = Frame::control(FrameHeader::control(1, 0xfeed), &value).unwrap();
        seed(Kind::Frame, &format!("ok-{name}.frame"), &frame.encode());
    }
    for (dtype, phase) in [
        (Dtype::F32, Phase::Forward),
        (Dtype::F16, Phase::Backward),
        (Dtype::BF16, Phase::AllReduce),
        (Dtype::F64, Phase::AllReduce),
    ] {
        let mut h = FrameHeader::control(2, 0xfeed);
        h.phase = phase;
        h.dtype = dtype;
        h.epoch = 3;
        h.layer = 1;
        let f = Frame::tensor(h, &[1.0, -2.5, 0.0, 3.25, 1e-3, 7.0], 2, 3).unwrap();
        seed(
            Kind::Frame,
            &format!("ok-{}.frame", dtype.name()),
            &f.encode(),
        );
    }

    // YAML: the examples and the planner's valid catalog
    let root = repo_root();
    for f in files(&root.join("examples")) {
        if f.extension().is_some_and(|e| e == "yaml") {
            let name = format!("ok-{}", f.file_name().unwrap().to_string_lossy());
            seed(Kind::JobFile, &name, &fs::read(&f).unwrap());
        }
    }
    for f in files(&root.join("examples/policies")) {
        if f.extension().is_some_and(|e| e == "yaml") {
            let name = format!("ok-{}", f.file_name().unwrap().to_string_lossy());
            seed(Kind::Policy, &name, &fs::read(&f).unwrap());
        }
    }
    for f in files(&root.join("planner/tests/catalogs")) {
        let name = format!("ok-{}", f.file_name().unwrap().to_string_lossy());
        seed(Kind::Catalog, &name, &fs::read(&f).unwrap());
    }
    // invalid inputs the tests already use: they must stay errors, never panics
    for f in files(&root.join("planner/tests/invalid")) {
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        if name.ends_with(".yaml") {
            seed(
                Kind::Catalog,
                &format!("bad-{name}"),
                &fs::read(&f).unwrap(),
            );
        }
    }
}
