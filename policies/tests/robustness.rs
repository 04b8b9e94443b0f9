//! No input makes the crate panic: garbage text, truncated and mutated policies, pathological
//! conditions, and extreme metric histories all end in an error value or a decision.

use physalia_policies::{
    EpochRecord, PlanState, PolicySet, evaluate, gradient_noise_scale, parse_str, simulate,
};

const EXAMPLES: &[&str] = &[
    include_str!("../../examples/policies/double-on-plateau.yaml"),
    include_str!("../../examples/policies/grow-with-noise-scale.yaml"),
    include_str!("../../examples/policies/budget.yaml"),
    include_str!("../../examples/policies/shrink-when-waiting.yaml"),
];

/// xorshift64*: deterministic test input without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Parses `text` and, when it parses, replays a short history through it.
fn exercise(text: &str) {
    if let Ok(policy) = parse_str(text, "fuzz.yaml") {
        let _ = simulate(&policy, &history(6), &PlanState::new(2));
    }
}

fn history(n: u32) -> Vec<EpochRecord> {
    (1..=n)
        .map(|epoch| EpochRecord {
            epoch,
            loss: 1.0 / f64::from(epoch),
            val_acc: (epoch % 2 == 0).then_some(0.5),
            epoch_s: 10.0,
            wait_share: 0.6,
            bytes: 1 << 20,
            workers: 2,
            usd_spent: 0.1 * f64::from(epoch),
            throughput_per_usd: Some(1e6),
            grad_noise_scale: Some(1000.0),
        })
        .collect()
}

#[test]
fn random_bytes_are_rejected_without_panicking() {
    let mut rng = Rng(0x1234_5678_9ABC_DEF1);
    for _ in 0..500 {
        let len = rng.below(200);
        let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        exercise(&String::from_utf8_lossy(&bytes));
    }
}

#[test]
fn every_prefix_of_every_example_is_handled() {
    for text in EXAMPLES {
        let mut end = 0;
        while end < text.len() {
            exercise(&text[..end]);
            end += 1;
            while !text.is_char_boundary(end) {
                end += 1;
            }
        }
    }
}

#[test]
fn mutated_examples_are_handled() {
    let alphabet: Vec<char> = " \n\t:{}[]-'\"#&*!|>?%@`,.0123456789aeloswx_()<=+/\\é\u{0}"
        .chars()
        .collect();
    let mut rng = Rng(0xDEAD_BEEF_CAFE_F00D);
    for text in EXAMPLES {
        let chars: Vec<char> = text.chars().collect();
        for _ in 0..300 {
            let mut mutated = chars.clone();
            for _ in 0..1 + rng.below(3) {
                let i = rng.below(mutated.len());
                match rng.below(3) {
                    0 => mutated[i] = alphabet[rng.below(alphabet.len())],
                    1 => {
                        mutated.remove(i);
                    }
                    _ => mutated.insert(i, alphabet[rng.below(alphabet.len())]),
                }
            }
            exercise(&mutated.iter().collect::<String>());
        }
    }
}

fn with_condition(condition: &str) -> String {
    format!(
        "max_workers: 4\nrules:\n  - name: r\n    when: {}\n    then: stop\n",
        serde_json::to_string(condition).unwrap()
    )
}

#[test]
fn pathological_conditions_are_rejected_without_panicking() {
    // 90 terms nest 91 deep: accepted. 240 are refused as too deep.
    let long_sum = format!("epoch{} > 1", " + 1".repeat(90));
    let longer_sum = format!("epoch{} > 1", " + 1".repeat(240));
    let cases = [
        "(".repeat(5000),
        format!("{}1{}", "(".repeat(200), ")".repeat(200)),
        format!("{}1{} > 0", "(".repeat(40), ")".repeat(40)),
        "!".repeat(999) + "true",
        "-".repeat(999) + "1 > 0",
        long_sum.clone(),
        longer_sum.clone(),
        "x".repeat(100_000),
        "[".repeat(998),
        "\u{0}\u{1}\u{7f}".to_string(),
        "'unterminated".to_string(),
        "epoch > 1 ? 'a' : 2".to_string(),
        "{'a': 1}.b > 0".to_string(),
        "1 / 0 > 0".to_string(),
        "9223372036854775807 + 1 > 0".to_string(),
        "size('x') > 0 && epoch in [1, 2]".to_string(),
        "b'\\xff' == b'\\xff'".to_string(),
        "has(epoch.x)".to_string(),
        "epoch.map(x, x)".to_string(),
        "[1, 2].map(x, [3].map(y, x * y)).size() > 0".to_string(),
        "1e400 > epoch_s".to_string(),
        "int('x') > 0".to_string(),
        "dyn(workers) > 1.5".to_string(),
        "type(workers) == int".to_string(),
        "google.protobuf.Int64Value{value: 1} == 1".to_string(),
        "optional.of(1).hasValue()".to_string(),
        "`epoch` > 1".to_string(),
        "é > 1".to_string(),
    ];
    for condition in &cases {
        exercise(&with_condition(condition));
    }
    // The long sum is accepted, and it runs.
    let policy = parse_str(&with_condition(&long_sum), "p.yaml").unwrap();
    let d = evaluate(&policy, &history(2), &PlanState::new(2), None);
    assert!(d.is_stop());
    let e = parse_str(&with_condition(&longer_sum), "p.yaml").unwrap_err();
    assert!(e.to_string().contains("nests deeper than"), "{e}");
}

#[test]
fn pathological_yaml_is_rejected_without_panicking() {
    let cases = [
        "[".repeat(100_000),
        "{a: ".repeat(100_000),
        "- ".repeat(10_000),
        "a: &a [*a]".to_string(),
        "a: &x 1\nb: *y\n".to_string(),
        // Billion laughs.
        "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\ne: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: [*e, *e, *e, *e, *e, *e, *e, *e, *e]\n".to_string(),
        "max_workers: 4\nmax_workers: 5\nrules: []\n".to_string(),
        "max_workers: 99999999999999999999\nrules: []\n".to_string(),
        "max_workers: -1\nrules: []\n".to_string(),
        "max_workers: 4\nrules:\n  - {name: a, when: 'true', then: {multiply_workers: .nan}}\n".to_string(),
        "max_workers: 4\nrules:\n  - {name: a, when: 'true', then: {multiply_workers: .inf}}\n".to_string(),
        "max_workers: 4\nrules:\n  - {name: a, when: 'true', then: {add_workers: -2147483648}}\n".to_string(),
        "max_workers: 4\nrules:\n  - {name: a, when: 'true', then: {staleness: 4294967295}}\n".to_string(),
        "max_workers: 4\nrules:\n  - {name: a, when: 'true', then: {}}\n".to_string(),
        "max_workers: 4\nrules:\n  - {name: a, when: 'true', then: [stop]}\n".to_string(),
        "max_workers: 4\nrules:\n  - {name: a, when: 'true', then: {? [a]: 1}}\n".to_string(),
        "max_workers: 4\nrules:\n  - {name: a, when: 1, then: stop}\n".to_string(),
        "max_workers: 4\nrules:\n  - {name: \"a\\nb\", when: 'true', then: stop}\n".to_string(),
        "--- \nmax_workers: 4\n---\nmax_workers: 5\n".to_string(),
        "\u{feff}max_workers: 4\nrules:\n  - {name: a, when: 'true', then: stop}\n".to_string(),
        "max_workers: 4\r\nrules:\r\n  - name: a\r\n    when: nope > 1\r\n    then: stop\r\n".to_string(),
        "!!binary aGVsbG8=".to_string(),
        "max_workers: !!str 4\nrules: []\n".to_string(),
    ];
    for text in &cases {
        exercise(text);
    }
}

#[test]
fn extreme_histories_never_panic() {
    let policies: Vec<PolicySet> = EXAMPLES
        .iter()
        .map(|t| parse_str(t, "x.yaml").unwrap())
        .chain(std::iter::once(
            parse_str(
                "max_workers: 65535\nwindow_epochs: 4294967295\ncooldown_epochs: 4294967295\nrules:\n  - {name: a, when: 'delta_loss > 0.0 || epochs_since_change > 2', then: {multiply_workers: 1e300}}\n",
                "x.yaml",
            )
            .unwrap(),
        ))
        .collect();
    let weird = [
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        -0.0,
        0.0,
        1e308,
        -1e308,
        5e-324,
    ];
    let mut rng = Rng(42);
    for policy in &policies {
        for _ in 0..40 {
            let n = 1 + rng.below(12);
            let pick = |rng: &mut Rng| weird[rng.below(weird.len())];
            let history: Vec<EpochRecord> = (0..n)
                .map(|_| EpochRecord {
                    epoch: [0, 1, 7, u32::MAX][rng.below(4)],
                    loss: pick(&mut rng),
                    val_acc: [None, Some(pick(&mut rng))][rng.below(2)],
                    epoch_s: pick(&mut rng),
                    wait_share: pick(&mut rng),
                    bytes: [0, u64::MAX][rng.below(2)],
                    workers: [0, u32::MAX][rng.below(2)],
                    usd_spent: pick(&mut rng),
                    throughput_per_usd: [None, Some(pick(&mut rng))][rng.below(2)],
                    grad_noise_scale: [None, Some(pick(&mut rng))][rng.below(2)],
                })
                .collect();
            let plan = PlanState {
                workers: [0, 1, u32::MAX][rng.below(3)],
                budget_usd: [None, Some(pick(&mut rng))][rng.below(2)],
                epochs_total: [None, Some(0), Some(u32::MAX)][rng.below(3)],
                boundary_sampling: pick(&mut rng),
                staleness: [0, u32::MAX][rng.below(2)],
                objective: Default::default(),
                batch_per_worker: [None, Some(u32::MAX)][rng.below(2)],
            };
            let last = [None, Some(0), Some(u32::MAX)][rng.below(3)];
            let d = evaluate(policy, &history, &plan, last);
            serde_json::to_string(&d).unwrap();
            for d in simulate(policy, &history, &plan) {
                serde_json::to_string(&d).unwrap();
            }
        }
    }
    let _ = gradient_noise_scale(f64::MIN_POSITIVE, f64::MAX, f64::MAX, 0.0);
}
