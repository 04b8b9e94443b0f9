//! Job-file parsing, overrides, validation and schema.

use std::path::{Path, PathBuf};

use physalia_coordinator::spec::*;

const FULL: &str = "\
name: cora-gcn
dataset:
  path: ../shared/data/cora
  format: generic
  row_normalize: true
model:
  kind: gat
  layers: 2
  hidden: 8
  heads: 8
  out_heads: 1
  dropout: 0.6
  input_dropout: null
  attn_dropout: 0.6
  activation: elu
  negative_slope: 0.2
train:
  epochs: 300
  lr: 0.005
  weight_decay: 5e-4
  seed: 7
  runs: 10
  threads: 4
  eval_every: 5
  patience: 100
workers: 1
backend: local
output:
  dir: out/jobs
";

const MINIMAL: &str = "\
dataset:
  path: cora.safetensors
model:
  kind: gcn
";

fn parse(text: &str, overrides: &[&str]) -> Result<JobSpec, SpecError> {
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    parse_str(text, "cora.yaml", &overrides)
}

fn ok(text: &str, overrides: &[&str]) -> JobSpec {
    match parse(text, overrides) {
        Ok(spec) => spec,
        Err(e) => panic!("expected a valid job, got: {e}"),
    }
}

/// The one-line message of the error `text` with `overrides` produces.
fn err(text: &str, overrides: &[&str]) -> String {
    match parse(text, overrides) {
        Ok(spec) => panic!("expected an error, got {spec:?}"),
        Err(e) => {
            let message = e.to_string();
            assert!(
                !message.contains('\n'),
                "message is not one line: {message:?}"
            );
            message
        }
    }
}

/// `text` with the line starting with `from` (after indentation) replaced by `to`.
fn edit(text: &str, from: &str, to: &str) -> String {
    let mut found = false;
    let out: Vec<String> = text
        .lines()
        .map(|line| {
            let indent = line.len() - line.trim_start().len();
            if !found && line.trim_start().starts_with(from) {
                found = true;
                format!("{}{to}", &line[..indent])
            } else {
                line.to_string()
            }
        })
        .collect();
    assert!(found, "no line starts with {from:?}");
    out.join("\n") + "\n"
}

#[test]
fn full_example_parses() {
    let spec = ok(FULL, &[]);
    let expected = JobSpec {
        name: Some("cora-gcn".into()),
        dataset: DatasetSpec {
            path: Some(PathBuf::from("../shared/data/cora")),
            format: DatasetFormat::Generic,
            row_normalize: true,
            synth: None,
            stats: None,
            partitioner: Default::default(),
        },
        model: ModelSpec {
            kind: ModelKind::Gat,
            layers: 2,
            hidden: 8,
            heads: Some(8),
            out_heads: Some(1),
            dropout: 0.6,
            input_dropout: None,
            attn_dropout: Some(0.6),
            activation: Activation::Elu,
            negative_slope: Some(0.2),
        },
        train: TrainSpec {
            epochs: 300,
            lr: 0.005,
            weight_decay: 5e-4,
            seed: 7,
            runs: 10,
            threads: Some(4),
            eval_every: 5,
            patience: Some(100),
        },
        workers: 1,
        parallelism: ParallelismSpec::Mode(Parallelism::Partition),
        minibatch: None,
        exchange: None,
        goal: None,
        scaling: None,
        scaling_file: None,
        resources: None,
        timeouts: None,
        max_retries: None,
        backend: BackendSpec::default(),
        output: OutputSpec {
            dir: PathBuf::from("out/jobs"),
        },
    };
    assert_eq!(spec, expected);
    assert_eq!(spec.job_name(Path::new("whatever.yaml")), "cora-gcn");
    assert_eq!(spec.model.input_dropout(), 0.6);
    assert_eq!(
        spec.dataset.source(),
        Some(DatasetSource::Path(Path::new("../shared/data/cora")))
    );
}

#[test]
fn defaults_are_filled() {
    let spec = ok(MINIMAL, &[]);
    assert_eq!(spec.name, None);
    assert_eq!(spec.job_name(Path::new("/x/cora-gcn.yaml")), "cora-gcn");
    assert_eq!(spec.dataset.format, DatasetFormat::Auto);
    assert!(!spec.dataset.row_normalize);
    let model = &spec.model;
    assert_eq!((model.layers, model.hidden, model.dropout), (2, 16, 0.5));
    assert_eq!(model.activation, Activation::Relu);
    assert_eq!((model.heads(), model.out_heads()), (8, 1));
    assert_eq!((model.input_dropout(), model.attn_dropout()), (0.5, 0.5));
    assert_eq!(model.negative_slope(), 0.2);
    assert_eq!(spec.train, TrainSpec::default());
    assert_eq!(spec.train.epochs, 200);
    assert_eq!(spec.train.lr, 0.01);
    assert_eq!(spec.train.weight_decay, 5e-4);
    assert_eq!((spec.train.runs, spec.train.eval_every), (1, 1));
    assert_eq!((spec.train.threads, spec.train.patience), (None, None));
    assert_eq!(spec.workers, 1);
    assert_eq!(spec.backend.name, BackendKind::Local);
    assert_eq!(spec.output.dir, PathBuf::from("jobs"));
}

#[test]
fn synth_dataset() {
    let sbm = "\
dataset:
  synth: {kind: sbm, nodes: 20000, classes: 8, avg_degree: 10, homophily: 0.8, feat_dim: 64, seed: 1}
model: {kind: sage}
";
    let spec = ok(sbm, &[]);
    let synth = spec.dataset.synth.as_ref().unwrap();
    assert_eq!(synth.kind, SynthKind::Sbm);
    assert_eq!((synth.nodes, synth.avg_degree), (Some(20000), Some(10.0)));
    assert!(matches!(
        spec.dataset.source(),
        Some(DatasetSource::Synth(_))
    ));

    let rmat = "\
dataset:
  synth: {kind: rmat, scale: 14, edge_factor: 8, classes: 8, feat_dim: 64}
model: {kind: gcn}
";
    assert_eq!(ok(rmat, &[]).dataset.synth.unwrap().scale, Some(14));
    assert_eq!(
        err(rmat, &["dataset.synth.nodes=5"]),
        "cora.yaml: dataset.synth.nodes (from --set dataset.synth.nodes=5): \
         does not apply when kind is rmat"
    );
    assert_eq!(
        err(rmat, &["dataset.synth.kind=sbm"]),
        "cora.yaml: dataset.synth.nodes: is required when kind is sbm"
    );
}

#[test]
fn job_name_from_awkward_stems() {
    let spec = ok(MINIMAL, &[]);
    assert_eq!(spec.job_name(Path::new("my job (2).yaml")), "my-job--2-");
    assert_eq!(spec.job_name(Path::new(".hidden.yaml")), "hidden");
    assert_eq!(spec.job_name(Path::new("")), "job");
}

// --- errors in the file: line and column -------------------------------------------------------

#[test]
fn typo_field_has_line_column_and_name() {
    let text = edit(FULL, "hidden:", "hiden: 8");
    assert_eq!(
        err(&text, &[]),
        "cora.yaml:9:3: model.hiden: unknown field `hiden`, expected one of kind, layers, \
         hidden, heads, out_heads, dropout, input_dropout, attn_dropout, activation, \
         negative_slope"
    );
}

#[test]
fn a_bare_dataset_path_is_short_for_a_path_mapping() {
    let short = ok(
        "dataset: graph.safetensors\nmodel:\n  kind: gcn\ntrain:\n  epochs: 2\n",
        &[],
    );
    let long = ok(
        "dataset:\n  path: graph.safetensors\nmodel:\n  kind: gcn\ntrain:\n  epochs: 2\n",
        &[],
    );
    assert_eq!(short, long);
    assert_eq!(short.dataset.path, Some(PathBuf::from("graph.safetensors")));
    // through an override too
    let set = ok(MINIMAL, &["dataset=other.safetensors"]);
    assert_eq!(set.dataset.path, Some(PathBuf::from("other.safetensors")));
    // the mapping keeps its located errors, and a value of another kind says what is expected
    let text = "dataset:\n  pth: graph.safetensors\nmodel:\n  kind: gcn\n";
    let message = err(text, &[]);
    assert!(
        message.starts_with("cora.yaml:2:3: dataset.pth: unknown field `pth`"),
        "{message}"
    );
    let message = err("dataset: [a, b]\nmodel:\n  kind: gcn\n", &[]);
    assert!(
        message.contains("dataset")
            && message.contains("a dataset path, or a mapping with `path` or `synth`"),
        "{message}"
    );
    // the schema offers both forms
    let schema = json_schema();
    let any = &schema["properties"]["dataset"]["anyOf"];
    assert_eq!(any[0]["type"], "string", "{schema}");
}

#[test]
fn typo_at_top_level() {
    let text = format!("{MINIMAL}worker: 2\n");
    let message = err(&text, &[]);
    assert!(
        message.starts_with("cora.yaml:5:1: worker: unknown field `worker`"),
        "{message}"
    );
}

#[test]
fn wrong_type() {
    let text = edit(FULL, "layers:", "layers: two");
    assert_eq!(err(&text, &[]), "cora.yaml:8:11: model.layers: invalid u32");
    let text = edit(FULL, "lr:", "lr: fast");
    assert_eq!(
        err(&text, &[]),
        "cora.yaml:19:7: train.lr: invalid floating point"
    );
    let text = edit(FULL, "kind:", "kind: gcm");
    assert_eq!(
        err(&text, &[]),
        "cora.yaml:7:9: model.kind: unknown variant `gcm`, expected one of gcn, sage, gat"
    );
    let text = edit(FULL, "layers:", "layers: -1");
    assert_eq!(err(&text, &[]), "cora.yaml:8:11: model.layers: invalid u32");
}

#[test]
fn missing_required_sections() {
    let message = err("dataset: {path: x}\n", &[]);
    assert!(message.starts_with("cora.yaml:1:"), "{message}");
    assert!(message.contains("missing field `model`"), "{message}");
    let message = err("dataset: {path: x}\nmodel: {layers: 2}\n", &[]);
    assert!(message.contains("model: missing field `kind`"), "{message}");
}

#[test]
fn yaml_syntax_errors_are_located() {
    let message = err("dataset: {path: x\nmodel: [\n", &[]);
    assert!(message.starts_with("cora.yaml:"), "{message}");
    assert!(
        message.split(':').nth(1).unwrap().parse::<u32>().is_ok(),
        "{message}"
    );
    let message = err("", &[]);
    assert!(message.starts_with("cora.yaml:1:1: "), "{message}");
    let message = err(&format!("{MINIMAL}---\n{MINIMAL}"), &[]);
    assert!(message.contains("multiple YAML documents"), "{message}");
    let message = err(&format!("{MINIMAL}workers: 1\nworkers: 1\n"), &[]);
    assert!(message.starts_with("cora.yaml:6:1: "), "{message}");
    assert!(message.contains("duplicate mapping key"), "{message}");
}

// --- validation --------------------------------------------------------------------------------

#[test]
fn validation_errors() {
    let cases: &[(&str, &str, &str)] = &[
        (
            "lr:",
            "lr: -0.01",
            "cora.yaml: train.lr: must be > 0 and finite, got -0.01",
        ),
        (
            "lr:",
            "lr: .nan",
            "cora.yaml: train.lr: must be > 0 and finite, got NaN",
        ),
        (
            "weight_decay:",
            "weight_decay: -1",
            "cora.yaml: train.weight_decay: must be >= 0 and finite, got -1",
        ),
        (
            "dropout:",
            "dropout: 1.0",
            "cora.yaml: model.dropout: must be in [0, 1), got 1",
        ),
        (
            "attn_dropout:",
            "attn_dropout: -0.1",
            "cora.yaml: model.attn_dropout: must be in [0, 1), got -0.1",
        ),
        (
            "layers:",
            "layers: 0",
            "cora.yaml: model.layers: must be >= 1, got 0",
        ),
        (
            "hidden:",
            "hidden: 0",
            "cora.yaml: model.hidden: must be >= 1, got 0",
        ),
        (
            "heads:",
            "heads: 0",
            "cora.yaml: model.heads: must be >= 1, got 0",
        ),
        (
            "epochs:",
            "epochs: 0",
            "cora.yaml: train.epochs: must be >= 1, got 0",
        ),
        (
            "runs:",
            "runs: 0",
            "cora.yaml: train.runs: must be >= 1, got 0",
        ),
        (
            "patience:",
            "patience: 0",
            "cora.yaml: train.patience: must be >= 1, got 0",
        ),
        (
            "workers:",
            "workers: 0",
            "cora.yaml: workers: must be >= 1, got 0",
        ),
        (
            "workers:",
            "workers: 2\nexchange:\n  boundary_sampling: 0",
            "cora.yaml: exchange.boundary_sampling: must be in (0, 1], got 0",
        ),
        (
            "workers:",
            "workers: 2\nexchange:\n  boundary_sampling: 1.5",
            "cora.yaml: exchange.boundary_sampling: must be in (0, 1], got 1.5",
        ),
        (
            "workers:",
            "workers: 2\ntimeouts:\n  epoch_s: 0",
            "cora.yaml: timeouts.epoch_s: must be > 0 seconds, got 0",
        ),
        (
            "workers:",
            "workers: 70000",
            "cora.yaml: workers: must be at most 65535, got 70000",
        ),
        (
            "backend:",
            "backend: ecs",
            "cora.yaml: backend.ecs: the ecs backend needs its settings: cluster, subnets, \
             security_groups, execution_role_arn, image, sku (`terraform output` of infra/ecs gives \
             most of them; see infra/README.md)",
        ),
        (
            "name:",
            "name: a/b",
            "cora.yaml: name: must be 1 to 64 letters, digits, '.', '_' or '-', not starting \
             with '.' or '-', got \"a/b\"",
        ),
        (
            "path:",
            "path: ''",
            "cora.yaml: dataset.path: must not be empty",
        ),
        (
            "dir:",
            "dir: ''",
            "cora.yaml: output.dir: must not be empty",
        ),
        (
            "kind:",
            "kind: gcn",
            "cora.yaml: model.heads: applies only to gat, but model.kind is gcn (remove it or \
             set it to null)",
        ),
    ];
    for (from, to, expected) in cases {
        assert_eq!(&err(&edit(FULL, from, to), &[]), expected, "{to}");
    }
}

#[test]
fn dataset_needs_exactly_one_source() {
    let both = "\
dataset:
  path: cora
  synth: {kind: sbm, nodes: 100, classes: 2, avg_degree: 3, feat_dim: 4}
model: {kind: gcn}
";
    assert_eq!(
        err(both, &[]),
        "cora.yaml: dataset: set exactly one of `path` or `synth`, both are set"
    );
    let neither = "dataset: {row_normalize: true}\nmodel: {kind: gcn}\n";
    assert_eq!(
        err(neither, &[]),
        "cora.yaml: dataset: set exactly one of `path` or `synth`, neither is set"
    );
    // An override can take one away.
    assert!(ok(both, &["dataset.synth=null"]).dataset.synth.is_none());
}

#[test]
fn validate_without_a_file() {
    let mut spec = ok(MINIMAL, &[]);
    spec.train.lr = 0.0;
    let e = spec.validate().unwrap_err();
    assert_eq!(e.to_string(), "train.lr: must be > 0 and finite, got 0");
}

// --- overrides ---------------------------------------------------------------------------------

#[test]
fn overrides_set_values_of_their_yaml_type() {
    let spec = ok(
        MINIMAL,
        &[
            "train.lr=0.005",
            "model.kind=gat",
            "model.heads=4",
            "dataset.path=foo",
            "name = 2024",
            "train.threads=",
            "output.dir=~/jobs",
        ],
    );
    assert_eq!(spec.train.lr, 0.005);
    assert_eq!(spec.model.kind, ModelKind::Gat);
    assert_eq!(spec.model.heads, Some(4));
    assert_eq!(spec.dataset.path, Some(PathBuf::from("foo")));
    // A number where a string is expected is read as its text, as in the file.
    assert_eq!(spec.name.as_deref(), Some("2024"));
    assert_eq!(spec.train.threads, None);
    assert_eq!(spec.output.dir, PathBuf::from("~/jobs"));
}

#[test]
fn overrides_create_sections_and_apply_in_order() {
    let spec = ok(MINIMAL, &["train.epochs=5", "workers=1", "train.epochs=6"]);
    assert_eq!(spec.train.epochs, 6);
    let spec = ok(
        MINIMAL,
        &[
            "dataset.path=",
            "dataset.synth={kind: rmat, scale: 10, edge_factor: 4, classes: 3, feat_dim: 5}",
        ],
    );
    assert_eq!(spec.dataset.synth.unwrap().scale, Some(10));
    let spec = ok(
        MINIMAL,
        &[
            "dataset.path=null",
            "dataset.synth.kind=sbm",
            "dataset.synth.nodes=10",
            "dataset.synth.avg_degree=2",
            "dataset.synth.classes=2",
            "dataset.synth.feat_dim=3",
        ],
    );
    assert_eq!(spec.dataset.synth.unwrap().nodes, Some(10));
}

#[test]
fn override_changes_kind() {
    // gcn -> gat picks up the gat defaults.
    let spec = ok(MINIMAL, &["model.kind=gat"]);
    assert_eq!((spec.model.kind, spec.model.heads()), (ModelKind::Gat, 8));
    // gat -> gcn must drop the gat-only fields the file sets.
    assert_eq!(
        err(FULL, &["model.kind=gcn"]),
        "cora.yaml: model.heads: applies only to gat, but model.kind is gcn (remove it or set \
         it to null)"
    );
    let spec = ok(
        FULL,
        &[
            "model.kind=sage",
            "model.heads=null",
            "model.out_heads=",
            "model.attn_dropout=~",
            "model.negative_slope=null",
        ],
    );
    assert_eq!(spec.model.kind, ModelKind::Sage);
    assert_eq!(
        err(FULL, &["model.kind=mlp"]),
        "cora.yaml: --set model.kind=mlp: model.kind: unknown variant `mlp`, expected one of \
         gcn, sage, gat"
    );
}

#[test]
fn override_fixes_the_file() {
    let text = edit(MINIMAL, "kind:", "kind: gcm");
    assert!(err(&text, &[]).starts_with("cora.yaml:4:9: "));
    assert_eq!(ok(&text, &["model.kind=sage"]).model.kind, ModelKind::Sage);
}

#[test]
fn bad_override_syntax() {
    let cases: &[(&str, &str)] = &[
        (
            "train.lr",
            "cora.yaml: --set train.lr: expected key.path=value",
        ),
        (
            "=3",
            "cora.yaml: --set =3: expected key.path=value, the key is empty",
        ),
        (
            "train..lr=3",
            "cora.yaml: --set train..lr=3: empty segment in key path `train..lr`",
        ),
        (
            ".lr=3",
            "cora.yaml: --set .lr=3: empty segment in key path `.lr`",
        ),
        (
            "train.=3",
            "cora.yaml: --set train.=3: empty segment in key path `train.`",
        ),
        (
            "model.kind.x=3",
            "cora.yaml: --set model.kind.x=3: `model.kind` is a string, not a mapping",
        ),
        (
            "train.lr=[1, 2",
            "cora.yaml: --set train.lr=[1, 2: value is not valid YAML: unclosed bracket '['",
        ),
    ];
    for (set, expected) in cases {
        assert_eq!(&err(MINIMAL, &[set]), expected, "{set}");
    }
    // A newline in an override cannot break the one-line message.
    assert_eq!(
        err(MINIMAL, &["a\nb"]),
        "cora.yaml: --set a\\nb: expected key.path=value"
    );
}

#[test]
fn override_of_unknown_key() {
    assert_eq!(
        err(MINIMAL, &["train.lrr=0.1"]),
        "cora.yaml: --set train.lrr=0.1: train.lrr: unknown field `lrr`, expected one of \
         epochs, lr, weight_decay, seed, runs, threads, eval_every, patience"
    );
    assert!(
        err(MINIMAL, &["model.layers=2", "trian.lr=1"])
            .starts_with("cora.yaml: --set trian.lr=1: trian: unknown field `trian`")
    );
    assert_eq!(
        err(MINIMAL, &["train.lr=fast"]),
        "cora.yaml: --set train.lr=fast: train.lr: invalid floating point"
    );
    assert_eq!(
        err(MINIMAL, &["train.lr=.inf"]),
        "cora.yaml: train.lr (from --set train.lr=.inf): must be > 0 and finite, got inf"
    );
    assert_eq!(
        err(MINIMAL, &["train.lr=-1"]),
        "cora.yaml: train.lr (from --set train.lr=-1): must be > 0 and finite, got -1"
    );
}

#[test]
fn file_errors_keep_their_location_with_overrides() {
    let text = edit(FULL, "hidden:", "hiden: 8");
    let message = err(&text, &["train.lr=0.1"]);
    assert!(
        message.starts_with("cora.yaml:9:3: model.hiden: unknown field `hiden`"),
        "{message}"
    );
    let message = err("dataset: [\n", &["train.lr=0.1"]);
    assert!(message.starts_with("cora.yaml:"), "{message}");
    let message = err("- 1\n- 2\n", &["train.lr=0.1"]);
    assert!(message.starts_with("cora.yaml:1:1: "), "{message}");
}

// --- files, schema, round trip -----------------------------------------------------------------

#[test]
fn load_reads_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cora-gcn.yaml");
    std::fs::write(&path, edit(FULL, "hidden:", "hiden: 8")).unwrap();
    let message = load(&path, &[]).unwrap_err().to_string();
    assert!(
        message.starts_with(&format!("{}:9:3: ", path.display())),
        "{message}"
    );
    std::fs::write(&path, MINIMAL).unwrap();
    let spec = load(&path, &["train.epochs=3".to_string()]).unwrap();
    assert_eq!(spec.train.epochs, 3);
    assert_eq!(spec.job_name(&path), "cora-gcn");
    let missing = dir.path().join("nope.yaml");
    let message = load(&missing, &[]).unwrap_err().to_string();
    assert!(
        message.starts_with(&format!("{}: cannot read job file: ", missing.display())),
        "{message}"
    );
}

#[test]
fn json_schema_has_properties_and_descriptions() {
    let schema = json_schema();
    let properties = schema["properties"].as_object().expect("properties");
    for key in [
        "name", "dataset", "model", "train", "workers", "backend", "output",
    ] {
        assert!(properties.contains_key(key), "{key}");
    }
    let required = schema["required"].as_array().unwrap();
    assert!(required.iter().any(|r| r == "model"));
    assert!(required.iter().any(|r| r == "dataset"));
    let text = schema.to_string();
    assert!(
        text.contains("Number of message-passing layers"),
        "model.layers description"
    );
    assert!(text.contains("Adam learning rate"), "train.lr description");
    assert!(
        text.contains("current working directory"),
        "dataset.path description"
    );
    assert!(
        text.contains("\"additionalProperties\":false"),
        "unknown fields are closed"
    );
}

#[test]
fn yaml_round_trip() {
    let rmat = "\
dataset:
  synth: {kind: rmat, scale: 14, edge_factor: 8, classes: 8, feat_dim: 64, seed: 3}
  row_normalize: true
model: {kind: sage, layers: 3, input_dropout: 0.1, activation: elu}
train: {lr: 0.1e-2, weight_decay: 0, threads: 2}
backend: local
";
    for text in [FULL, MINIMAL, rmat] {
        let spec = ok(text, &[]);
        let yaml = serde_saphyr::to_string(&spec).unwrap();
        assert_eq!(ok(&yaml, &[]), spec, "{yaml}");
        // And through JSON, which the schema describes.
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(serde_json::from_value::<JobSpec>(json).unwrap(), spec);
    }
}

// --- no panics ---------------------------------------------------------------------------------

/// xorshift64*: deterministic, no dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn never_panics(text: &str, overrides: &[&str]) {
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    if let Err(e) = parse_str(text, "fuzz.yaml", &overrides) {
        let message = e.to_string();
        assert!(!message.contains('\n'), "{message:?} from {text:?}");
    }
}

#[test]
fn truncated_files_never_panic() {
    for (i, _) in FULL.char_indices() {
        never_panics(&FULL[..i], &[]);
        never_panics(&FULL[..i], &["train.lr=0.1"]);
    }
}

#[test]
fn garbage_never_panics() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    const ALPHABET: &[u8] = b" \n\t:-?[]{},#&*!|>'\"%@`.=0123456789abcdeEnulxyz~\\";
    for _ in 0..2000 {
        let bytes: Vec<u8> = (0..rng.below(200))
            .map(|_| match rng.below(4) {
                0 => rng.next() as u8,
                _ => ALPHABET[rng.below(ALPHABET.len())],
            })
            .collect();
        let text = String::from_utf8_lossy(&bytes);
        never_panics(&text, &[]);
        let set = format!("model.{}", text.chars().take(20).collect::<String>());
        never_panics(MINIMAL, &[&set]);
    }
    // Mutations of a valid file reach deeper into the schema.
    for _ in 0..2000 {
        let mut bytes = FULL.as_bytes().to_vec();
        for _ in 0..1 + rng.below(4) {
            let at = rng.below(bytes.len());
            bytes[at] = ALPHABET[rng.below(ALPHABET.len())];
        }
        never_panics(&String::from_utf8_lossy(&bytes), &["train.epochs=3"]);
    }
    never_panics(&"[".repeat(100_000), &[]);
    never_panics(&"a:\n ".repeat(10_000), &[]);
    never_panics(MINIMAL, &[&format!("train.lr={}", "[".repeat(100_000))]);
    never_panics(MINIMAL, &[&format!("{}=1", "a.".repeat(10_000))]);
    let bomb = "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n\
                c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n\
                e: [*d, *d, *d, *d, *d, *d, *d, *d, *d]\n";
    never_panics(bomb, &[]);
    never_panics(bomb, &["train.lr=1"]);
}

#[test]
fn multi_worker_jobs_with_exchange_options() {
    let spec = ok(
        &format!(
            "{MINIMAL}workers: 3\nexchange:\n  boundary_sampling: 0.5\n  staleness: 2\n  dtype: bf16\ntimeouts:\n  epoch_s: 5\n"
        ),
        &[],
    );
    assert_eq!(spec.workers, 3);
    let x = spec.exchange.as_ref().unwrap();
    assert_eq!(
        (x.boundary_sampling, x.staleness, x.dtype),
        (0.5, 2, ExchangeDtype::Bf16)
    );
    let t = spec.timeouts.as_ref().unwrap();
    assert_eq!((t.register_s, t.epoch_s), (30.0, 5.0));
    let spec = ok(&format!("{MINIMAL}workers: 2\n"), &["exchange.dtype=f16"]);
    assert_eq!(spec.exchange.unwrap().dtype, ExchangeDtype::F16);
    let message = err(&format!("{MINIMAL}workers: 2\ntrain:\n  runs: 3\n"), &[]);
    assert!(
        message.contains("train.runs: repeated runs need workers: 1"),
        "{message}"
    );
    let message = err(&format!("{MINIMAL}workers: 2\nbackend: kubernetes\n"), &[]);
    assert!(
        message.contains("backend.kubernetes: the kubernetes backend needs its settings"),
        "{message}"
    );
    let spec = ok(&format!("{MINIMAL}workers: 2\nbackend: docker\n"), &[]);
    assert_eq!(spec.backend.name, BackendKind::Docker);
    let message = err(&format!("{MINIMAL}exchange:\n  dtype: f64\n"), &[]);
    assert!(message.contains("exchange.dtype"), "{message}");
    let schema = json_schema();
    assert!(
        schema["properties"]
            .as_object()
            .unwrap()
            .contains_key("exchange")
    );
}

/// A small scaling policy, inline.
const POLICY: &str = "\
scaling:
  min_workers: 1
  max_workers: 4
  cooldown_epochs: 2
  window_epochs: 2
  rules:
    - name: grow
      when: delta_loss > -0.03
      then: {add_workers: 1}
";

/// Partition, data and model parallelism checkpoint every epoch and resume exactly with another worker
/// count, so a policy may resize all three (data and model jobs were refused before their trainers
/// checkpointed). Replica groups stay refused: a resize may pick any count, their ranks need a multiple of
/// `k`.
#[test]
fn scaling_policies_resize_partition_data_and_model_jobs_but_not_replica_groups() {
    for mode in ["partition", "data", "model"] {
        let spec = ok(
            &format!("{MINIMAL}workers: 2\nparallelism: {mode}\n{POLICY}"),
            &[],
        );
        assert!(spec.scaling.is_some(), "{mode}");
        // a policy in a file is checked when it is read; the mode is accepted here too
        ok(
            &format!("{MINIMAL}workers: 2\nparallelism: {mode}\nscaling_file: policy.yaml\n"),
            &[],
        );
    }
    for groups in ["{partition: 2, replicas: 2}", "{data: 2, replicas: 2}"] {
        for scaling in [POLICY, "scaling_file: policy.yaml\n"] {
            let message = err(
                &format!("{MINIMAL}workers: 4\nparallelism: {groups}\n{scaling}"),
                &[],
            );
            assert!(
                message.contains("scaling")
                    && message.contains("not replica groups")
                    && message.contains("multiple of 2"),
                "{groups}: {message}"
            );
        }
    }
}

const CLOUD: &str = "\
dataset: cora.safetensors
model:
  kind: gcn
workers: 2
backend:
  name: local
  ecs:
    cluster: physalia
    subnets: [subnet-0a1]
    security_groups: [sg-0c2]
    execution_role_arn: arn:aws:iam::123456789012:role/physalia-task-execution
    image: 123456789012.dkr.ecr.us-east-1.amazonaws.com/physalia-worker:0.1.0
    sku: ecs-g5.xlarge
  kubernetes:
    image: registry.example/physalia-worker:0.1.0
    sku: gke-g2-standard-8
  aci:
    subscription_id: 00000000-0000-0000-0000-000000000000
    resource_group: physalia
    location: eastus
    subnet_id: /subscriptions/0/resourceGroups/physalia/providers/Microsoft.Network/virtualNetworks/v/subnets/w
    image: physalia.azurecr.io/physalia-worker:0.1.0
    sku: aci-cpu-2x8
";

fn on(text: &str, overrides: &[&str], backend: BackendKind) -> Result<JobSpec, SpecError> {
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    parse_str_on(text, "cora.yaml", &overrides, Some(backend))
}

/// One job file holds a section per platform; `--backend` picks one, its settings are checked, and its
/// SKU's catalog price is what a worker-second costs.
#[test]
fn a_backend_section_per_platform_prices_the_job_at_its_sku() {
    let catalog = physalia_planner::Catalog::builtin();
    let local = ok(CLOUD, &[]);
    assert_eq!(local.backend.name, BackendKind::Local);
    let p = local.backend.priced(&catalog, None).unwrap();
    assert_eq!((p.sku.as_str(), p.usd_per_worker_s), ("local", 0.0));
    for (backend, sku) in [
        (BackendKind::Ecs, "ecs-g5.xlarge"),
        (BackendKind::Kubernetes, "gke-g2-standard-8"),
        (BackendKind::Aci, "aci-cpu-2x8"),
    ] {
        let spec = on(CLOUD, &[], backend).unwrap_or_else(|e| panic!("{backend:?}: {e}"));
        assert_eq!(spec.backend.name, backend);
        let p = spec.backend.priced(&catalog, None).unwrap();
        let expected = catalog.get(sku).unwrap().usd_per_s();
        assert!(expected > 0.0, "{sku} has a price");
        assert_eq!((p.sku.as_str(), p.usd_per_worker_s), (sku, expected));
    }
    // ecs-g5.xlarge: $1.006 an hour
    let ecs = on(CLOUD, &[], BackendKind::Ecs).unwrap();
    let p = ecs.backend.priced(&catalog, None).unwrap();
    assert!((p.usd_per_worker_s * 3600.0 - 1.006).abs() < 1e-9, "{p:?}");
    // the defaults of a section
    let k = ecs.backend.kubernetes.as_ref().unwrap();
    assert_eq!(k.namespace, "physalia");
    assert_eq!(
        ecs.backend.ecs.as_ref().unwrap().log_group,
        "/physalia/workers"
    );
    // a bare name is short for {name: NAME}
    let short = ok(&format!("{MINIMAL}backend: docker\n"), &[]);
    assert_eq!(
        short.backend,
        BackendSpec {
            name: BackendKind::Docker,
            ..BackendSpec::default()
        }
    );
    // the schema offers both forms
    let schema = json_schema();
    assert!(
        schema["properties"]["backend"]["anyOf"].is_array(),
        "{schema}"
    );
}

/// Bad platform settings are refused before anything is created, each naming the field and what fits.
#[test]
fn bad_platform_settings_name_the_field_and_what_fits() {
    let message = |backend, overrides: &[&str]| match on(CLOUD, overrides, backend) {
        Ok(spec) => panic!("expected an error, got {spec:?}"),
        Err(e) => e.to_string(),
    };
    let m = message(BackendKind::Ecs, &["backend.ecs.capacity=fargate"]);
    assert!(
        m.contains("backend.ecs.capacity")
            && m.contains("fargate runs no GPUs")
            && m.contains("A10G"),
        "{m}"
    );
    // Fargate's capacity providers are Fargate too; a GPU capacity provider is fine
    let m = message(BackendKind::Ecs, &["backend.ecs.capacity=FARGATE_SPOT"]);
    assert!(m.contains("runs no GPUs"), "{m}");
    on(
        CLOUD,
        &["backend.ecs.capacity=physalia-gpu"],
        BackendKind::Ecs,
    )
    .unwrap();
    let m = message(BackendKind::Aci, &["backend.aci.sku=ecs-g5.xlarge"]);
    assert!(
        m.contains("backend.aci.sku") && m.contains("one of the ecs backend's, not aci"),
        "{m}"
    );
    let m = message(BackendKind::Ecs, &["backend.ecs.sku=nope"]);
    assert!(
        m.contains("backend.ecs.sku")
            && m.contains("no SKU named \"nope\"")
            && m.contains("ecs-g4dn.xlarge"),
        "{m}"
    );
    let m = message(BackendKind::Ecs, &["backend.ecs.subnets=[]"]);
    assert!(
        m.contains("backend.ecs.subnets") && m.contains("must name at least one"),
        "{m}"
    );
    let m = message(
        BackendKind::Ecs,
        &["backend.ecs.execution_role_arn=physalia-task-execution"],
    );
    assert!(
        m.contains("backend.ecs.execution_role_arn") && m.contains("must be an IAM role ARN"),
        "{m}"
    );
    let m = message(
        BackendKind::Kubernetes,
        &["backend.kubernetes.namespace=Physalia"],
    );
    assert!(
        m.contains("backend.kubernetes.namespace") && m.contains("must be a DNS label"),
        "{m}"
    );
    let m = message(BackendKind::Aci, &["backend.aci.subnet_id=workers"]);
    assert!(
        m.contains("backend.aci.subnet_id") && m.contains("must be a subnet's resource id"),
        "{m}"
    );
    let m = message(
        BackendKind::Aci,
        &["backend.aci.arm_endpoint=management.azure.com"],
    );
    assert!(
        m.contains("backend.aci.arm_endpoint")
            && m.contains("must be Azure Resource Manager's URL"),
        "{m}"
    );
    // a cloud job names its container, unless the planner chooses it
    let m = message(BackendKind::Kubernetes, &["backend.kubernetes.sku=null"]);
    assert!(
        m.contains("backend.kubernetes.sku")
            && m.contains("name the worker container: one of")
            && m.contains("gke-g2-standard-8"),
        "{m}"
    );
    on(
        CLOUD,
        &["backend.kubernetes.sku=null", "goal.objective=min_cost"],
        BackendKind::Kubernetes,
    )
    .unwrap();
    // an unknown field of a section is located in the file
    let text = CLOUD.replace("    cluster: physalia", "    clustr: physalia");
    let m = err(&text, &[]);
    assert!(m.contains("backend.ecs") && m.contains("clustr"), "{m}");
}

/// `gpu_image` names the image of GPU workers beside `image` on docker, kubernetes and ecs (ACI runs no
/// GPUs and has none); a blank one is refused naming the field.
#[test]
fn gpu_image_is_a_setting_of_the_gpu_platforms() {
    let ecs = on(
        CLOUD,
        &["backend.ecs.gpu_image=ecr.example/physalia-worker:0.1.0-cuda"],
        BackendKind::Ecs,
    )
    .unwrap();
    assert_eq!(
        ecs.backend.ecs.as_ref().unwrap().gpu_image.as_deref(),
        Some("ecr.example/physalia-worker:0.1.0-cuda")
    );
    assert_eq!(
        ecs.backend.gpu_image(),
        Some("ecr.example/physalia-worker:0.1.0-cuda")
    );
    // left out: the platform's default (`image` on the clouds)
    let k = on(CLOUD, &[], BackendKind::Kubernetes).unwrap();
    assert_eq!(k.backend.gpu_image(), None);
    let k = on(
        CLOUD,
        &["backend.kubernetes.gpu_image=registry.example/physalia-worker:0.1.0-cuda"],
        BackendKind::Kubernetes,
    )
    .unwrap();
    assert_eq!(
        k.backend.gpu_image(),
        Some("registry.example/physalia-worker:0.1.0-cuda")
    );
    let docker = ok(
        &format!("{MINIMAL}backend: {{name: docker, docker: {{gpu_image: mine:cuda}}}}\n"),
        &[],
    );
    assert_eq!(docker.backend.gpu_image(), Some("mine:cuda"));
    assert_eq!(docker.backend.docker.as_ref().unwrap().image, None);
    // a blank one names its field
    for (backend, field) in [
        (BackendKind::Ecs, "backend.ecs.gpu_image"),
        (BackendKind::Kubernetes, "backend.kubernetes.gpu_image"),
    ] {
        let m = on(CLOUD, &[&format!("{field}=' '")], backend)
            .unwrap_err()
            .to_string();
        assert!(m.contains(field) && m.contains("must not be empty"), "{m}");
    }
    let m = err(
        &format!("{MINIMAL}backend: {{name: docker, docker: {{gpu_image: ''}}}}\n"),
        &[],
    );
    assert!(m.contains("backend.docker.gpu_image"), "{m}");
    // ACI has no GPUs, so no gpu_image: an unknown field
    let text = CLOUD.replace(
        "    image: physalia.azurecr.io/physalia-worker:0.1.0\n",
        "    image: physalia.azurecr.io/physalia-worker:0.1.0\n    gpu_image: physalia.azurecr.io/w:cuda\n",
    );
    let m = err(&text, &[]);
    assert!(m.contains("backend.aci") && m.contains("gpu_image"), "{m}");
    // the schema describes it
    let schema = serde_json::to_string(&json_schema()).unwrap();
    assert!(schema.contains("The image of GPU workers"), "{schema}");
}

/// The example with every platform's section is valid on each of them.
#[test]
fn the_cloud_example_is_valid_on_every_backend() {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/cloud.yaml");
    for backend in [
        BackendKind::Local,
        BackendKind::Docker,
        BackendKind::Kubernetes,
        BackendKind::Ecs,
        BackendKind::Aci,
    ] {
        let spec =
            load_on(&file, &[], Some(backend)).unwrap_or_else(|e| panic!("{backend:?}: {e}"));
        assert_eq!(spec.backend.name, backend);
    }
}

/// Issue 14: `backend.mode` is cluster by default on the cloud platforms and client on this machine's;
/// cluster mode on local or docker, a misspelt mode and malformed coordinator settings are refused
/// naming the field (and, for a parse error, its line and column).
#[test]
fn backend_mode_defaults_to_cluster_on_clouds_and_is_checked() {
    for (backend, mode) in [
        (BackendKind::Ecs, Mode::Cluster),
        (BackendKind::Kubernetes, Mode::Cluster),
        (BackendKind::Aci, Mode::Cluster),
        (BackendKind::Local, Mode::Client),
        (BackendKind::Docker, Mode::Client),
    ] {
        let spec = on(CLOUD, &[], backend).unwrap_or_else(|e| panic!("{backend:?}: {e}"));
        assert_eq!(spec.backend.mode(), mode, "{backend:?}");
    }
    let client = on(CLOUD, &["backend.mode=client"], BackendKind::Ecs).unwrap();
    assert_eq!(client.backend.mode(), Mode::Client);
    // the coordinator's image defaults to the worker image (built --with-cli)
    let ecs = on(CLOUD, &[], BackendKind::Ecs).unwrap();
    assert_eq!(
        ecs.backend.coordinator_image(),
        Some("123456789012.dkr.ecr.us-east-1.amazonaws.com/physalia-worker:0.1.0")
    );
    let ecs = on(
        CLOUD,
        &["backend.ecs.coordinator_image=ecr/physalia:cli"],
        BackendKind::Ecs,
    )
    .unwrap();
    assert_eq!(ecs.backend.coordinator_image(), Some("ecr/physalia:cli"));
    let err = on(CLOUD, &["backend.mode=cluster"], BackendKind::Docker)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("backend.mode") && err.contains("cluster mode starts the coordinator"),
        "{err}"
    );
    let err = on(
        CLOUD,
        &["backend.ecs.coordinator_task_role_arn=physalia-coordinator"],
        BackendKind::Ecs,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("backend.ecs.coordinator_task_role_arn") && err.contains("IAM role ARN"),
        "{err}"
    );
    let err = on(
        CLOUD,
        &["backend.aci.coordinator_identity_id=coordinator"],
        BackendKind::Aci,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("backend.aci.coordinator_identity_id"), "{err}");
    let typo = CLOUD.replace("  name: local\n", "  name: ecs\n  mode: clustr\n");
    let err = parse(&typo, &[]).unwrap_err().to_string();
    assert!(
        err.starts_with("cora.yaml:7:") && err.contains("backend.mode"),
        "{err}"
    );
}

/// Issue 29 (b): a job that writes no fan-outs gets one per layer, whatever its layer count; fan-outs
/// the user wrote are still checked against the layers.
#[test]
fn issue_29_default_fanouts_follow_the_layer_count() {
    for mode in ["partition", "data", "model"] {
        let spec = ok(
            &format!("{MINIMAL}parallelism: {mode}\n"),
            &["model.layers=3"],
        );
        let mb = spec.minibatch.clone().unwrap_or_default();
        assert_eq!(
            mb.fanouts_for(spec.model.layers),
            vec![25, 10, 10],
            "{mode}"
        );
        let options = mb.options(spec.model.layers);
        assert_eq!(
            options.fanouts,
            vec![Some(25), Some(10), Some(10)],
            "{mode}"
        );
    }
    // a `minibatch` section without `fanouts`
    let spec = ok(
        &format!("{MINIMAL}parallelism: data\nminibatch: {{batch_size: 64}}\n"),
        &["model.layers=4"],
    );
    let mb = spec.minibatch.as_ref().unwrap();
    assert_eq!(mb.fanouts_for(spec.model.layers), vec![25, 10, 10, 10]);
    assert_eq!(default_fanouts(1), vec![25]);
    assert_eq!(default_fanouts(2), vec![25, 10]);
    // written ones are kept, and must match the layers
    let spec = ok(
        &format!("{MINIMAL}parallelism: data\nminibatch: {{fanouts: [5, -1, 3]}}\n"),
        &["model.layers=3"],
    );
    assert_eq!(
        spec.minibatch.unwrap().fanouts_for(spec.model.layers),
        vec![5, -1, 3]
    );
    let message = err(
        &format!("{MINIMAL}parallelism: data\nminibatch: {{fanouts: [5, 5]}}\n"),
        &["model.layers=3"],
    );
    assert!(
        message.contains("minibatch.fanouts: needs one fan-out per layer (3), got 2"),
        "{message}"
    );
}

/// Issue 29: the parallelism mode is one type: the job file's `parallelism`, the planner's candidate mode
/// and the workers' assignment mode, spelled the same in each, with no conversion between them.
#[test]
fn issue_29_the_parallelism_mode_is_one_type() {
    use physalia_planner::Mode;
    for (word, mode) in [
        ("partition", Mode::Partition),
        ("data", Mode::Data),
        ("model", Mode::Model),
    ] {
        let spec = ok(&format!("{MINIMAL}parallelism: {word}\nworkers: 2\n"), &[]);
        let assigned: physalia_control::TrainMode = spec.mode();
        assert_eq!(assigned, mode);
        assert_eq!(
            serde_json::to_value(assigned).unwrap(),
            serde_json::json!(word)
        );
        assert_eq!(mode.as_str(), word);
    }
    assert_eq!(Parallelism::default(), Mode::Partition);
}
