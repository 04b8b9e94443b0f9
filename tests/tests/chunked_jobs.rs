//! Jobs on a chunked dataset directory (issue 31): `submit` of a partition-parallel job whose `dataset.path`
//! is a chunked dataset trains end to end, partitioned by streaming beside the directory, with the losses
//! of the same graph as one file (partition parallelism is exact: any partitioning trains like one
//! worker); a chunked dataset under data parallelism, which ships the whole file to every worker, is
//! refused naming `dataset.path`.

use std::path::Path;

use physalia_tests::{job_dirs, metrics, physalia, safetensors_header, write_job};
use tempfile::TempDir;

const SYNTH: [&str; 10] = [
    "--nodes",
    "4000",
    "--classes",
    "4",
    "--feat-dim",
    "16",
    "--avg-degree",
    "10",
    "--seed",
    "1",
];

/// The same SBM graph twice: `chunked/` (4 chunks) and `single.safetensors`.
fn synth_both(dir: &Path) {
    let mut args = vec!["data", "synth", "sbm"];
    args.extend(SYNTH);
    let mut chunked = args.clone();
    chunked.extend([
        "--layout",
        "chunked",
        "--chunk-rows",
        "1024",
        "-o",
        "chunked",
    ]);
    physalia(dir, &chunked).ok();
    let mut file = args;
    file.extend(["-o", "single.safetensors"]);
    physalia(dir, &file).ok();
    assert!(dir.join("chunked/manifest.json").is_file());
}

fn job(path: &str) -> String {
    format!(
        "name: chunked
dataset:
  path: {path}
model:
  kind: sage
  layers: 2
  hidden: 16
train:
  epochs: 10
  seed: 0
output:
  dir: jobs
"
    )
}

/// Submits `file` with `sets` (`--set` values); its job directory and per-epoch losses.
fn submit(dir: &Path, file: &str, sets: &[&str]) -> (std::path::PathBuf, Vec<f64>) {
    let mut args = vec!["submit", file, "-q", "--output", "json"];
    for s in sets {
        args.extend(["--set", s]);
    }
    let v = physalia(dir, &args).ok().last_json();
    let job_dir = dir.join(v["job_dir"].as_str().unwrap());
    let losses = metrics(&job_dir)
        .iter()
        .map(|m| m["metrics"]["loss"].as_f64().unwrap())
        .collect();
    (job_dir, losses)
}

fn assert_close(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), 10, "{what}: every epoch");
    assert_eq!(got.len(), want.len(), "{what}: every epoch");
    for (e, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * b.abs(),
            "epoch {}: {what} {a}, reference {b}",
            e + 1
        );
    }
}

/// The method a stored partition set was computed with.
fn set_method(set: &Path) -> String {
    let bytes = std::fs::read(set.join("partition.safetensors")).unwrap();
    let h = safetensors_header(&bytes);
    let meta: serde_json::Value =
        serde_json::from_str(h.json["__metadata__"]["physalia"].as_str().unwrap()).unwrap();
    meta["method"].as_str().unwrap().to_string()
}

#[test]
fn a_chunked_dataset_trains_partition_parallel_exactly_like_the_single_file() {
    let t = TempDir::new().unwrap();
    let dir = t.path();
    synth_both(dir);
    write_job(dir, "chunked.yaml", &job("chunked"));
    write_job(dir, "single.yaml", &job("single.safetensors"));

    let (chunked_dir, chunked) = submit(dir, "chunked.yaml", &["workers=2"]);
    // the coordinator streamed the assignment beside the directory; each worker (a local process,
    // reading the dataset in place) cut its own part and wrote it into the set, which the coordinator
    // committed after the first epoch: it never held a part
    let set = dir.join("chunked/parts/k2-seed0");
    assert!(set.join("part0.safetensors").is_file());
    assert!(set.join("part1.safetensors").is_file());
    assert!(
        !set.join("pending").exists(),
        "the pending assignment goes with the commit"
    );
    let read = |f: &str| std::fs::read_to_string(chunked_dir.join("logs").join(f)).unwrap();
    assert!(
        read("coordinator.log").contains("its 2 parts cut by the workers"),
        "{}",
        read("coordinator.log")
    );
    // they cut together: each read its share of the chunk files and sent the rows to their owners,
    // so the two read the dataset's files once between them
    let mut read_mib = 0.0;
    for rank in 0..2 {
        let log = read(&format!("worker-{rank}.log"));
        assert!(
            log.contains(&format!("worker {rank}: cut part {rank} of 2")),
            "{log}"
        );
        assert!(log.contains("with the other workers"), "{log}");
        let mib = physalia_tests::cut_read_mib(&log);
        assert!(mib > 0.0, "{log}");
        read_mib += mib;
    }
    let data_bytes = physalia_tests::chunked_data_bytes(&dir.join("chunked"));
    let data_mib = data_bytes as f64 / (1 << 20) as f64;
    assert!(
        (read_mib - data_mib).abs() <= 0.1,
        "the workers read {read_mib} MiB of a {data_mib} MiB dataset"
    );
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(chunked_dir.join("summary.json")).unwrap()).unwrap();
    let record = &summary["partitions"][0];
    assert_eq!(record["parts"], 2, "{summary}");
    assert_eq!(record["reused"], false, "{summary}");
    let cut = record["cut_fraction"].as_f64().unwrap();
    assert!(cut > 0.0 && cut < 1.0, "{record}");
    // what partitioning read: the workers every chunk file once, the coordinator the edges more
    let read = record["bytes_read"].as_u64().unwrap();
    assert!(read > data_bytes, "{record}");
    // the streaming default: Fennel restreamed until stable, label-propagation refinement, isolated nodes
    // dealt last (graph's `StreamParams::refined`)
    assert_eq!(set_method(&set), "fennel-x20~0.001-lp8-il");
    // the dataset was handed on as it is: nothing loaded and written into the job's record
    assert!(!chunked_dir.join("dataset.safetensors").exists());
    assert!(chunked_dir.join("model.safetensors").is_file());

    // the same graph as one file: one worker (no partitioning), and two workers on the same streamed
    // partitioning (`data partition --method stream`, reused by the job)
    let (_, one) = submit(dir, "single.yaml", &[]);
    physalia(
        dir,
        [
            "data",
            "partition",
            "single.safetensors",
            "--k",
            "2",
            "--method",
            "stream",
        ],
    )
    .ok();
    let (_, two) = submit(dir, "single.yaml", &["workers=2"]);
    // `--method stream` takes the refined streaming default too
    assert_eq!(
        set_method(&dir.join("single.parts/k2-seed0")),
        "fennel-x20~0.001-lp8-il"
    );
    assert_close("chunked, 2 workers vs file, 1 worker", &chunked, &one);
    assert_close("chunked, 2 workers vs file, 2 workers", &chunked, &two);

    // a second job reuses the committed set (served part files, nothing cut) and trains the same
    let (again_dir, again) = submit(dir, "chunked.yaml", &["workers=2"]);
    assert_close("chunked again", &again, &chunked);
    let log = std::fs::read_to_string(again_dir.join("logs/worker-0.log")).unwrap();
    assert!(!log.contains("cut part"), "{log}");
}

#[test]
fn a_chunked_dataset_under_data_parallelism_is_refused_naming_the_field() {
    let t = TempDir::new().unwrap();
    let dir = t.path();
    synth_both(dir);
    write_job(dir, "chunked.yaml", &job("chunked"));
    let out = physalia(
        dir,
        [
            "submit",
            "chunked.yaml",
            "--set",
            "workers=2",
            "--set",
            "parallelism=data",
        ],
    );
    out.one_line_error(&["dataset.path", "chunked", "parallelism: data", "partition"]);
    // refused before anything is written or partitioned
    assert!(job_dirs(&dir.join("jobs")).is_empty());
    assert!(!dir.join("chunked/parts").exists());
}

#[test]
fn repeated_seeds_on_a_chunked_dataset_load_it_whole_and_train() {
    let t = TempDir::new().unwrap();
    let dir = t.path();
    synth_both(dir);
    write_job(dir, "chunked.yaml", &job("chunked"));
    write_job(dir, "single.yaml", &job("single.safetensors"));
    let sets = ["train.runs=2", "train.epochs=3"];
    let run = |file: &str| {
        let mut args = vec!["submit", file, "-q", "--output", "json"];
        for s in sets {
            args.extend(["--set", s]);
        }
        physalia(dir, &args).ok().last_json()
    };
    let (c, s) = (run("chunked.yaml"), run("single.yaml"));
    assert_eq!(c["runs"].as_array().unwrap().len(), 2);
    for i in 0..2 {
        let (a, b) = (
            c["runs"][i]["final_loss"].as_f64().unwrap(),
            s["runs"][i]["final_loss"].as_f64().unwrap(),
        );
        assert!(
            (a - b).abs() <= 1e-4 * b.abs(),
            "run {i}: chunked {a}, file {b}"
        );
    }
}

/// `dataset.partitioner` picks how a missing partition set is computed (`auto`: the planner's choice,
/// whose reason the record keeps); a set already stored for the part count is reused whichever method made
/// it; the job's summary and report record each set's method, cut, balance and seconds; METIS on a chunked
/// dataset is refused naming the field.
#[test]
fn the_partitioner_is_the_job_files_or_the_planners_and_the_record_keeps_its_quality() {
    let t = TempDir::new().unwrap();
    let dir = t.path();
    synth_both(dir);
    write_job(dir, "single.yaml", &job("single.safetensors"));
    let partitions = |job_dir: &Path| -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(job_dir.join("summary.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["partitions"].as_array().cloned().unwrap_or_default()
    };

    // streaming asked for on a file: computed by streaming, recorded with its quality and why
    let (streamed_dir, streamed) = submit(
        dir,
        "single.yaml",
        &["workers=2", "dataset.partitioner=stream"],
    );
    assert_eq!(
        set_method(&dir.join("single.parts/k2-seed0")),
        "fennel-x20~0.001-lp8-il"
    );
    let p = partitions(&streamed_dir);
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(p[0]["parts"], 2);
    assert_eq!(p[0]["method"], "fennel-x20~0.001-lp8-il");
    assert_eq!(p[0]["reused"], false);
    assert!(
        p[0]["why"]
            .as_str()
            .unwrap()
            .contains("dataset.partitioner"),
        "{p:?}"
    );
    let cut = p[0]["cut_fraction"].as_f64().unwrap();
    assert!(cut > 0.0 && cut < 1.0, "{p:?}");
    assert!(p[0]["edge_cut"].as_u64().unwrap() > 0);
    assert!(p[0]["balance"].as_f64().unwrap() >= 1.0);
    assert!(p[0]["compute_seconds"].as_f64().unwrap() > 0.0);
    let report = std::fs::read_to_string(streamed_dir.join("report.html")).unwrap();
    assert!(
        report.contains("<h2>Partitions</h2>"),
        "no partitions table"
    );
    assert!(report.contains("fennel-x20~0.001-lp8-il"));

    // METIS asked for: the streamed set is current, so it is reused, not recomputed, and trains the same
    let (metis_dir, again) = submit(
        dir,
        "single.yaml",
        &["workers=2", "dataset.partitioner=metis"],
    );
    let p = partitions(&metis_dir);
    assert_eq!(p[0]["reused"], true, "{p:?}");
    assert_eq!(p[0]["method"], "fennel-x20~0.001-lp8-il");
    assert!(p[0].get("why").is_none(), "{p:?}");
    assert_close("the reused set", &again, &streamed);

    // auto, for a part count not stored: the planner's choice, with its reason
    let (auto_dir, _) = submit(dir, "single.yaml", &["workers=3", "train.epochs=10"]);
    let p = partitions(&auto_dir);
    let why = p[0]["why"].as_str().unwrap();
    assert!(why.starts_with("the planner's choice: "), "{why}");
    let method = set_method(&dir.join("single.parts/k3-seed0"));
    assert_eq!(p[0]["method"].as_str().unwrap(), method);
    assert_eq!(
        why.contains("edge-balanced parts save"),
        method == "metis",
        "{why} / {method}"
    );

    // METIS cannot cut a chunked dataset without loading it: refused before anything is written
    write_job(dir, "chunked.yaml", &job("chunked"));
    let out = physalia(
        dir,
        [
            "submit",
            "chunked.yaml",
            "--set",
            "workers=2",
            "--set",
            "dataset.partitioner=metis",
        ],
    );
    out.one_line_error(&["dataset.partitioner", "metis", "chunked"]);
    assert!(!dir.join("chunked/parts").exists());
    // one worker on a chunked dataset: its single part is still cut from the chunks (streaming), not by
    // METIS, which would refuse the directory, and by the worker: the coordinator never holds the graph
    let (one_dir, one) = submit(dir, "chunked.yaml", &["workers=1"]);
    assert_eq!(one.len(), 10);
    let log = std::fs::read_to_string(one_dir.join("logs/worker-0.log")).unwrap();
    assert!(log.contains("worker 0: cut part 0 of 1"), "{log}");
    let p = partitions(&one_dir);
    assert_eq!(p[0]["parts"], 1, "{p:?}");
    assert_ne!(p[0]["method"], "metis", "{p:?}");
}

/// A worker lost while the workers cut their parts: the launch is retried on the assignment the first
/// try stored (not partitioned again), the part files the first try wrote are kept (nothing is written
/// twice), the set is committed once, and the losses equal an uninterrupted job's on the same graph.
#[test]
fn a_worker_lost_while_cutting_is_retried_on_the_same_assignment_and_nothing_is_written_twice() {
    let t = TempDir::new().unwrap();
    let dir = t.path();
    for out in ["a", "b"] {
        let mut args = vec!["data", "synth", "sbm"];
        args.extend(SYNTH);
        args.extend(["--layout", "chunked", "--chunk-rows", "1024", "-o", out]);
        physalia(dir, &args).ok();
    }
    write_job(dir, "a.yaml", &job("a"));
    write_job(dir, "b.yaml", &job("b"));
    let (_, want) = submit(dir, "a.yaml", &["workers=2"]);
    // rank 1 kills itself right after writing its part, the first time it writes it
    let out = std::process::Command::new(physalia_tests::physalia_bin())
        .current_dir(dir)
        .args([
            "submit",
            "b.yaml",
            "-q",
            "--output",
            "json",
            "--set",
            "workers=2",
        ])
        .env("PHYSALIA_TEST_DIE_AT_EPOCH", "0")
        .env("PHYSALIA_TEST_DIE_RANK", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v = physalia_tests::last_json(&String::from_utf8_lossy(&out.stdout));
    let job_dir = dir.join(v["job_dir"].as_str().unwrap());
    let got: Vec<f64> = metrics(&job_dir)
        .iter()
        .map(|m| m["metrics"]["loss"].as_f64().unwrap())
        .collect();
    assert_close("retried after a worker lost while cutting", &got, &want);
    let read = |f: &str| std::fs::read_to_string(job_dir.join("logs").join(f)).unwrap();
    let coordinator = read("coordinator.log");
    assert!(
        coordinator
            .contains("its 2 parts cut by the workers on the assignment an earlier launch made"),
        "{coordinator}"
    );
    assert_eq!(coordinator.matches("committed").count(), 1, "{coordinator}");
    let events = v["scaling_events"].as_array().unwrap();
    assert!(
        events
            .iter()
            .any(|e| e["event"].as_str().unwrap().contains("lost a worker")),
        "{events:?}"
    );
    // the retry (segment 1) cut again, to train, but kept the files the first try wrote
    let first = read("worker-1.log");
    assert!(
        first.contains("killing myself after writing my part"),
        "{first}"
    );
    let worker1 = read("worker-1.seg1.log");
    assert!(
        worker1.contains("written by an earlier try, kept"),
        "{worker1}"
    );
    // the parts are the uninterrupted job's
    for f in ["part0.safetensors", "part1.safetensors"] {
        let a = physalia_graph::Part::load(&dir.join("a/parts/k2-seed0").join(f)).unwrap();
        let b = physalia_graph::Part::load(&dir.join("b/parts/k2-seed0").join(f)).unwrap();
        assert!(a == b, "{f}");
    }
    assert!(!dir.join("b/parts/k2-seed0/pending").exists());
}
