//! The job file's `resources` section: GPUs per worker and the CPU fallback, validated with the field named.

use physalia_coordinator::spec::*;

const BASE: &str = "\
dataset: ../shared/data/cora
model: {kind: gcn, hidden: 16}
workers: 2
";

fn parse(extra: &str) -> Result<JobSpec, SpecError> {
    parse_str(&format!("{BASE}{extra}"), "job.yaml", &[])
}

fn field_of(e: SpecError) -> (String, String) {
    match e {
        SpecError::Invalid { field, reason, .. } => (field, reason),
        other => panic!("expected an invalid field, got {other}"),
    }
}

#[test]
fn gpus_and_the_fallback_are_read() {
    let s =
        parse("resources: {gpu: {count: 2, model: NVIDIA-H100-80GB-HBM3}, gpu_fallback: cpu}\n")
            .unwrap();
    let r = s.resources.unwrap();
    assert_eq!(
        r.gpu,
        Some(GpuSpec {
            count: 2,
            model: Some("NVIDIA-H100-80GB-HBM3".into())
        })
    );
    assert_eq!(r.gpu_fallback, GpuFallback::Cpu);
    // a bare `gpu: {}` is one GPU of any model, failing without one
    let r = parse("resources: {gpu: {}}\n").unwrap().resources.unwrap();
    assert_eq!(r.gpu.unwrap().count, 1);
    assert_eq!(r.gpu_fallback, GpuFallback::None);
    // no section: the CPU
    assert!(parse("").unwrap().resources.is_none());
    // data parallelism trains its mini-batches on the GPU too
    parse("resources: {gpu: {}}\nparallelism: data\nminibatch: {fanouts: [5, 5]}\n").unwrap();
}

#[test]
fn bad_gpu_settings_name_the_field() {
    let cases = [
        (
            "resources: {gpu: {count: 0}}\n",
            "resources.gpu.count",
            "1 to 16",
        ),
        (
            "resources: {gpu: {count: 17}}\n",
            "resources.gpu.count",
            "1 to 16",
        ),
        (
            "resources: {gpu: {model: ' '}}\n",
            "resources.gpu.model",
            "GPU model",
        ),
        (
            "resources: {gpu_fallback: cpu}\n",
            "resources.gpu_fallback",
            "resources.gpu",
        ),
        (
            "resources: {gpu: {}}\nparallelism: model\nminibatch: {fanouts: [5, 5]}\n",
            "resources.gpu",
            "model parallelism (P3) runs on the CPU",
        ),
    ];
    for (extra, field, says) in cases {
        let (f, reason) = field_of(parse(extra).unwrap_err());
        assert_eq!(f, field, "{extra}");
        assert!(reason.contains(says), "{extra}: {reason}");
    }
    // unknown keys and values are refused by the parser, naming them
    let e = parse("resources: {gpus: 1}\n").unwrap_err().to_string();
    assert!(e.contains("gpus"), "{e}");
    let e = parse("resources: {gpu: {}, gpu_fallback: tpu}\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("tpu"), "{e}");
}
