//! `physalia data partition`: computes partition sets beside the dataset, reuses them on the next run,
//! recomputes them when the dataset changes, and `data inspect` lists them.

use std::path::Path;

use physalia_graph::Part;
use physalia_tests::{physalia, write_tiny_generic};
use tempfile::TempDir;

fn synth_sbm(dir: &Path, nodes: usize, seed: u64) {
    let (nodes, seed) = (nodes.to_string(), seed.to_string());
    physalia(
        dir,
        [
            "data",
            "synth",
            "sbm",
            "--nodes",
            nodes.as_str(),
            "--feat-dim",
            "8",
            "--seed",
            seed.as_str(),
            "--out",
            "g.safetensors",
        ],
    )
    .ok();
}

fn partition_json(dir: &Path, ks: &str) -> serde_json::Value {
    physalia(
        dir,
        [
            "data",
            "partition",
            "g.safetensors",
            "--k",
            ks,
            "--output",
            "json",
        ],
    )
    .ok()
    .last_json()
}

#[test]
fn partition_is_stored_reused_listed_and_recomputed_when_the_dataset_changes() {
    let t = TempDir::new().unwrap();
    synth_sbm(t.path(), 3000, 1);

    let v = partition_json(t.path(), "2,4");
    let sets = v["partitions"].as_array().unwrap();
    assert_eq!(sets.len(), 2);
    for (s, k) in sets.iter().zip([2usize, 4]) {
        assert_eq!(s["k"], k);
        assert_eq!(s["method"], "metis");
        assert_eq!(s["reused"], false);
        let parts = s["parts"].as_array().unwrap();
        assert_eq!(parts.len(), k);
        let owned: u64 = parts.iter().map(|p| p["owned"].as_u64().unwrap()).sum();
        assert_eq!(owned, 3000);
        assert!(parts.iter().all(|p| p["halo"].as_u64().unwrap() > 0));
        assert!(s["balance"].as_f64().unwrap() <= 1.05, "{s}");
        let cut = s["edge_cut"].as_u64().unwrap();
        let total = s["num_undirected_edges"].as_u64().unwrap();
        // SBM with homophily 0.8 over 8 classes: METIS should find far better than random (~1 - 1/k).
        assert!(cut > 0 && (cut as f64) < 0.5 * total as f64, "{s}");
        let dir = t.path().join(format!("g.parts/k{k}-seed0"));
        assert!(dir.join("partition.safetensors").is_file());
        for (p, want) in parts.iter().enumerate().take(k) {
            let part = Part::load(&dir.join(format!("part{p}.safetensors"))).unwrap();
            assert_eq!(part.k, k);
            assert_eq!(part.num_nodes_global, 3000);
            assert_eq!(part.n_owned() as u64, want["owned"].as_u64().unwrap());
        }
    }

    // Second run: both reused, same numbers.
    let again = partition_json(t.path(), "2,4");
    for (a, b) in again["partitions"].as_array().unwrap().iter().zip(sets) {
        assert_eq!(a["reused"], true);
        assert_eq!(a["edge_cut"], b["edge_cut"]);
        assert_eq!(a["parts"], b["parts"]);
    }
    // Text output says so too.
    let text = physalia(t.path(), ["data", "partition", "g.safetensors", "--k", "4"]).ok();
    assert!(
        text.stdout.contains("k=4 seed=0 (metis): reused"),
        "{}",
        text.stdout
    );
    assert!(text.stdout.contains("part 3"), "{}", text.stdout);

    // inspect lists both, current.
    let v = physalia(
        t.path(),
        ["data", "inspect", "g.safetensors", "--output", "json"],
    )
    .ok()
    .last_json();
    let listed = v["partitions"].as_array().unwrap();
    assert_eq!(listed.len(), 2);
    assert_eq!(listed[0]["k"], 2);
    assert_eq!(listed[1]["k"], 4);
    assert!(listed.iter().all(|s| s["status"] == "current"));
    let text = physalia(t.path(), ["data", "inspect", "g.safetensors"]).ok();
    let lines: Vec<&str> = text.stdout.lines().collect();
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("partitions") && l.contains("k=2 seed=0")),
        "{}",
        text.stdout
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("k=4 seed=0") && l.contains("edge cut")),
        "{}",
        text.stdout
    );

    // A different dataset under the same name: stale in inspect, recomputed by partition.
    synth_sbm(t.path(), 3000, 2);
    let v = physalia(
        t.path(),
        ["data", "inspect", "g.safetensors", "--output", "json"],
    )
    .ok()
    .last_json();
    assert!(
        v["partitions"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["status"] == "stale")
    );
    let text = physalia(t.path(), ["data", "inspect", "g.safetensors"]).ok();
    assert!(text.stdout.contains("stale"), "{}", text.stdout);
    let v = partition_json(t.path(), "2");
    assert_eq!(v["partitions"][0]["reused"], false);
}

#[test]
fn inspect_without_partitions_and_bad_requests() {
    let t = TempDir::new().unwrap();
    write_tiny_generic(&t.path().join("raw"));
    physalia(
        t.path(),
        ["data", "import", "raw", "--out", "g.safetensors"],
    )
    .ok();
    let text = physalia(t.path(), ["data", "inspect", "g.safetensors"]).ok();
    assert!(
        text.stdout.contains("partitions     none"),
        "{}",
        text.stdout
    );

    let k1 = partition_json(t.path(), "1");
    assert_eq!(k1["partitions"][0]["method"], "single");
    assert_eq!(k1["partitions"][0]["edge_cut"], 0);

    physalia(t.path(), ["data", "partition", "g.safetensors", "--k", "0"])
        .one_line_error(&["'k'", "at least 1"]);
    physalia(t.path(), ["data", "partition", "g.safetensors", "--k", "9"])
        .one_line_error(&["9 parts exceed the graph's 8 nodes", "g.safetensors"]);
    physalia(
        t.path(),
        ["data", "partition", "missing.safetensors", "--k", "2"],
    )
    .one_line_error(&["missing.safetensors"]);
    let usage = physalia(t.path(), ["data", "partition", "g.safetensors"]);
    assert_eq!(usage.code, Some(2), "--k is required: {}", usage.stderr);
    let usage = physalia(
        t.path(),
        ["data", "partition", "g.safetensors", "--k", "two"],
    );
    assert_eq!(usage.code, Some(2));
}

/// The chunked layout end to end through the CLI: `data synth --layout chunked`, `data import --layout
/// chunked`, `data inspect` of the directory, `data partition` streaming it (and refusing METIS), the
/// stored set listed by `inspect`, a corrupted chunk named.
#[test]
fn chunked_datasets_are_written_inspected_and_partitioned_by_streaming() {
    let t = TempDir::new().unwrap();
    let synth = physalia(
        t.path(),
        [
            "data",
            "synth",
            "sbm",
            "--nodes",
            "3000",
            "--feat-dim",
            "8",
            "--layout",
            "chunked",
            "--chunk-rows",
            "1024",
            "--out",
            "c",
        ],
    )
    .ok();
    assert!(
        synth.stderr.contains("3 chunks of 1024 rows"),
        "{}",
        synth.stderr
    );
    let text = physalia(t.path(), ["data", "inspect", "c"]).ok();
    assert!(text.stdout.contains("chunked layout v1"), "{}", text.stdout);
    assert!(
        text.stdout.contains("every chunk checksum verified"),
        "{}",
        text.stdout
    );
    assert!(
        text.stdout.contains("nodes          3000"),
        "{}",
        text.stdout
    );

    let v = physalia(
        t.path(),
        [
            "data",
            "partition",
            "c",
            "--k",
            "2,3",
            "--passes",
            "2",
            "--output",
            "json",
        ],
    )
    .ok()
    .last_json();
    let sets = v["partitions"].as_array().unwrap();
    assert_eq!(sets.len(), 2);
    for s in sets {
        assert_eq!(s["method"], "fennel-x2");
        assert_eq!(s["reused"], false);
        let k = s["k"].as_u64().unwrap() as usize;
        for p in 0..k {
            let part = Part::load(
                &t.path()
                    .join(format!("c/parts/k{k}-seed0/part{p}.safetensors")),
            );
            assert_eq!(part.unwrap().k, k);
        }
    }
    let again = physalia(
        t.path(),
        [
            "data",
            "partition",
            "c",
            "--k",
            "3",
            "--passes",
            "2",
            "--output",
            "json",
        ],
    )
    .ok()
    .last_json();
    assert_eq!(again["partitions"][0]["reused"], true);
    // without --passes the streaming default: restreamed until stable, refined by label propagation,
    // its own partitioning time recorded beside the whole step's; --refine alone adds refinement to
    // the given passes
    for (args, method) in [
        (&[][..], "fennel-x20~0.001-lp8-il"),
        (&["--passes", "1", "--refine", "3"][..], "fennel-lp3"),
    ] {
        let mut cmd = vec!["data", "partition", "c", "--k", "4", "--output", "json"];
        cmd.extend_from_slice(args);
        let v = physalia(t.path(), cmd).ok().last_json();
        let set = &v["partitions"][0];
        assert_eq!(set["method"], method, "{args:?}");
        let (part_s, all_s) = (
            set["partition_seconds"].as_f64().unwrap(),
            set["compute_seconds"].as_f64().unwrap(),
        );
        assert!(part_s > 0.0 && part_s <= all_s, "{part_s} of {all_s} s");
    }
    physalia(
        t.path(),
        ["data", "partition", "c", "--k", "2", "--method", "metis"],
    )
    .one_line_error(&["METIS needs the whole graph", "chunked"]);
    let v = physalia(t.path(), ["data", "inspect", "c", "--output", "json"])
        .ok()
        .last_json();
    assert_eq!(v["layout"], "chunked");
    assert_eq!(v["manifest"]["num_nodes"], 3000);
    // k = 2 and 3 (two passes), and k = 4 (the last of the two streaming runs above replaced the first)
    let sets = v["partitions"].as_array().unwrap();
    assert_eq!(sets.len(), 3);
    assert!(
        sets.iter().any(|s| s["k"] == 4
            && s["method"] == "fennel-lp3"
            && s["partition_seconds"].as_f64().is_some_and(|x| x > 0.0)),
        "{sets:?}"
    );

    // A generic folder imported into chunks loads the same graph as the single file.
    write_tiny_generic(&t.path().join("raw"));
    physalia(
        t.path(),
        [
            "data",
            "import",
            "raw",
            "--out",
            "tiny",
            "--layout",
            "chunked",
            "--chunk-rows",
            "3",
        ],
    )
    .ok();
    let single = physalia(
        t.path(),
        ["data", "import", "raw", "--out", "tiny.safetensors"],
    )
    .ok();
    assert_eq!(single.code, Some(0));
    let chunked = physalia_graph::ChunkedDataset::open(&t.path().join("tiny"))
        .unwrap()
        .load()
        .unwrap();
    let file = physalia_graph::Dataset::open(&t.path().join("tiny.safetensors"))
        .unwrap()
        .to_owned_dataset();
    assert_eq!(chunked.indices, file.indices);
    assert_eq!(chunked.features, file.features);

    // A folder that is not a dataset: the missing manifest is named.
    physalia(t.path(), ["data", "inspect", "raw"]).one_line_error(&["raw/manifest.json"]);
    physalia(t.path(), ["data", "partition", "raw", "--k", "2"])
        .one_line_error(&["raw/manifest.json"]);

    // A flipped byte in a chunk: inspect names the chunk file. (The chunk folder is `data-<token>/`; the
    // partition sets beside it in `parts/` are a folder too.)
    let data = std::fs::read_dir(t.path().join("c"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.is_dir()
                && p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("data-"))
        })
        .unwrap();
    let victim = data.join("labels-000001.bin");
    let mut bytes = std::fs::read(&victim).unwrap();
    bytes[0] ^= 1;
    std::fs::write(&victim, bytes).unwrap();
    physalia(t.path(), ["data", "inspect", "c"])
        .one_line_error(&["labels-000001.bin", "checksum mismatch"]);
}
