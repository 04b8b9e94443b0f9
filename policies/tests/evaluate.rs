//! The evaluator's rules: order, cooldown, missing metrics, clamping, no-effect fall-through,
//! run-time errors, prewarm, the window deltas, and purity.

use std::collections::BTreeMap;

use physalia_policies::{
    Action, Bound, Decision, Effect, EpochRecord, MetricValue, Objective, PlanState, PolicySet,
    RuleOutcome, evaluate, parse_str, simulate, variables,
};

fn policy(yaml: &str) -> PolicySet {
    parse_str(yaml, "test.yaml").unwrap_or_else(|e| panic!("{e}"))
}

fn record(epoch: u32, loss: f64) -> EpochRecord {
    EpochRecord {
        epoch,
        loss,
        val_acc: None,
        epoch_s: 10.0,
        wait_share: 0.1,
        bytes: 1_000,
        workers: 1,
        usd_spent: 0.01 * f64::from(epoch),
        throughput_per_usd: Some(1e6),
        grad_noise_scale: None,
    }
}

/// Losses 1.0, 0.9, ... as records of epochs 1, 2, ...
fn history(losses: &[f64]) -> Vec<EpochRecord> {
    losses
        .iter()
        .enumerate()
        .map(|(i, &loss)| record(i as u32 + 1, loss))
        .collect()
}

fn outcomes(decision: &Decision) -> Vec<(&str, &RuleOutcome)> {
    decision
        .checks
        .iter()
        .map(|c| (c.rule.as_str(), &c.outcome))
        .collect()
}

fn workers_effect(decision: &Decision) -> (u32, u32, Option<Bound>) {
    match &decision.change.as_ref().expect("a change").effect {
        Effect::Workers {
            from,
            to,
            clamped_to,
            ..
        } => (*from, *to, *clamped_to),
        other => panic!("not a worker change: {other:?}"),
    }
}

const ALWAYS_GROW: &str = "
max_workers: 10
cooldown_epochs: 2
rules:
  - name: grow
    when: epoch >= 1
    then: {multiply_workers: 3}
";

#[test]
fn an_empty_history_keeps_the_plan() {
    let d = evaluate(&policy(ALWAYS_GROW), &[], &PlanState::new(1), None);
    assert!(d.is_keep());
    assert_eq!(d.epoch, None);
    assert!(d.checks.is_empty());
}

#[test]
fn the_first_rule_that_fires_wins_and_records_what_it_read() {
    let p = policy(
        "
max_workers: 8
rules:
  - name: first
    when: loss < 0.5
    then: {add_workers: 1}
  - name: second
    when: loss < 2.0 && workers == 1
    then: {set_workers: 4}
  - name: third
    when: 'true'
    then: stop
",
    );
    let d = evaluate(&p, &history(&[1.0]), &PlanState::new(1), None);
    let change = d.change.as_ref().unwrap();
    assert_eq!(change.rule, "second");
    assert_eq!(change.action, Action::SetWorkers(4));
    assert_eq!(workers_effect(&d), (1, 4, None));
    let expected: BTreeMap<String, MetricValue> = [
        ("loss".to_string(), MetricValue::Float(1.0)),
        ("workers".to_string(), MetricValue::Int(1)),
    ]
    .into();
    assert_eq!(change.values, expected);
    // `third` is never tried.
    assert_eq!(d.checks.len(), 2);
    assert!(matches!(d.checks[0].outcome, RuleOutcome::False { .. }));
    assert_eq!(d.checks[1].outcome, RuleOutcome::Fired);
}

#[test]
fn cooldown_blocks_changes_until_enough_epochs_ran() {
    let p = policy(ALWAYS_GROW);
    let h = history(&[1.0, 0.9, 0.8, 0.7]);
    // Changed after epoch 2, cooldown 2: epochs 3 and 4 must run first.
    let d = evaluate(&p, &h[..3], &PlanState::new(3), Some(2));
    assert!(d.is_keep());
    assert_eq!(
        outcomes(&d),
        [("grow", &RuleOutcome::Cooldown { until_epoch: 4 })]
    );
    let d = evaluate(&p, &h[..4], &PlanState::new(3), Some(2));
    assert_eq!(workers_effect(&d), (3, 9, None));
}

#[test]
fn a_rule_may_override_the_cooldown() {
    let p = policy(
        "
max_workers: 10
cooldown_epochs: 5
rules:
  - name: grow
    when: 'true'
    then: {add_workers: 1}
  - name: guard
    when: usd_spent > 0.025
    then: stop
    cooldown_epochs: 0
",
    );
    let h = history(&[1.0, 0.9, 0.8]);
    let d = evaluate(&p, &h, &PlanState::new(2), Some(2));
    assert!(d.is_stop());
    assert_eq!(
        outcomes(&d)[0],
        ("grow", &RuleOutcome::Cooldown { until_epoch: 7 })
    );
}

#[test]
fn worker_changes_are_clamped_and_say_so() {
    let p = policy(ALWAYS_GROW);
    let d = evaluate(&p, &history(&[1.0]), &PlanState::new(4), None);
    assert_eq!(workers_effect(&d), (4, 10, Some(Bound::MaxWorkers)));
    match d.change.unwrap().effect {
        Effect::Workers { requested, .. } => assert_eq!(requested, 12),
        _ => unreachable!(),
    }

    let shrink = policy(
        "
min_workers: 2
max_workers: 10
rules:
  - name: shrink
    when: 'true'
    then: {add_workers: -5}
",
    );
    let d = evaluate(&shrink, &history(&[1.0]), &PlanState::new(4), None);
    assert_eq!(workers_effect(&d), (4, 2, Some(Bound::MinWorkers)));
}

#[test]
fn multiplying_always_moves_by_at_least_one_worker() {
    let grow = |factor: f64, from: u32| {
        let p = policy(&format!(
            "max_workers: 100\nrules:\n  - name: r\n    when: 'true'\n    then: {{multiply_workers: {factor}}}\n"
        ));
        let d = evaluate(&p, &history(&[1.0]), &PlanState::new(from), None);
        d.change.map(|c| match c.effect {
            Effect::Workers { to, .. } => to,
            _ => unreachable!(),
        })
    };
    assert_eq!(grow(1.1, 1), Some(2));
    assert_eq!(grow(1.5, 3), Some(5)); // 4.5 rounds up
    assert_eq!(grow(2.0, 3), Some(6));
    assert_eq!(grow(0.5, 3), Some(1)); // 1.5 rounds down
    assert_eq!(grow(0.9, 5), Some(4));
    assert_eq!(grow(0.5, 1), None); // at min_workers
    assert_eq!(grow(1e300, 1), Some(100));
}

#[test]
fn a_rule_without_effect_lets_the_next_one_fire() {
    let p = policy(
        "
min_workers: 2
max_workers: 8
rules:
  - name: shrink
    when: 'true'
    then: {multiply_workers: 0.5}
  - name: sample
    when: 'true'
    then: {boundary_sampling: 0.25}
  - name: stale
    when: 'true'
    then: {staleness: 2}
",
    );
    let mut plan = PlanState::new(2);
    let d = evaluate(&p, &history(&[1.0]), &plan, None);
    assert_eq!(
        d.checks[0].outcome,
        RuleOutcome::NoEffect {
            reason: "already at min_workers (2)".to_string()
        }
    );
    assert_eq!(
        d.change.as_ref().unwrap().effect,
        Effect::BoundarySampling {
            from: 1.0,
            to: 0.25
        }
    );
    plan = plan.apply(&d.change.unwrap().effect);
    let d = evaluate(&p, &history(&[1.0]), &plan, None);
    assert_eq!(
        d.change.as_ref().unwrap().effect,
        Effect::Staleness { from: 0, to: 2 }
    );
    plan = plan.apply(&d.change.unwrap().effect);
    // Nothing left to change.
    let d = evaluate(&p, &history(&[1.0]), &plan, None);
    assert!(d.is_keep());
    assert!(
        d.checks
            .iter()
            .all(|c| matches!(c.outcome, RuleOutcome::NoEffect { .. }))
    );
}

#[test]
fn replanning_to_the_current_objective_changes_nothing() {
    let p = policy(
        "max_workers: 4\nrules:\n  - name: r\n    when: 'true'\n    then: {replan: min_time}\n",
    );
    let mut plan = PlanState::new(1);
    let d = evaluate(&p, &history(&[1.0]), &plan, None);
    assert_eq!(
        d.change.as_ref().unwrap().effect,
        Effect::Replan {
            from: Objective::MinCost,
            to: Objective::MinTime
        }
    );
    plan.objective = Objective::MinTime;
    assert!(evaluate(&p, &history(&[1.0]), &plan, None).is_keep());
}

#[test]
fn a_rule_reading_a_missing_metric_does_not_fire() {
    let p = policy(
        "
max_workers: 8
window_epochs: 3
rules:
  - name: plateau
    when: delta_loss > -0.01 || epoch > 0
    then: {add_workers: 1}
  - name: accurate
    when: val_acc > 0.5
    then: stop
  - name: budget
    when: budget_left_usd < 1.0
    then: stop
",
    );
    let d = evaluate(&p, &history(&[1.0, 0.9, 0.8]), &PlanState::new(1), None);
    assert!(d.is_keep());
    let missing = |names: &[&str]| RuleOutcome::Missing {
        metrics: names.iter().map(|n| n.to_string()).collect(),
    };
    assert_eq!(
        outcomes(&d),
        [
            ("plateau", &missing(&["delta_loss"])),
            ("accurate", &missing(&["val_acc"])),
            ("budget", &missing(&["budget_left_usd"])),
        ]
    );
    // With one more epoch the window is full.
    let d = evaluate(
        &p,
        &history(&[1.0, 0.9, 0.8, 0.79]),
        &PlanState::new(1),
        None,
    );
    assert_eq!(d.change.unwrap().rule, "plateau");
}

#[test]
fn a_run_time_error_does_not_fire_the_rule() {
    let p = policy(
        "
max_workers: 8
rules:
  - name: divide
    when: bytes / (workers - 1) > 10
    then: {add_workers: 1}
  - name: next
    when: 'true'
    then: {add_workers: 2}
",
    );
    let d = evaluate(&p, &history(&[1.0]), &PlanState::new(1), None);
    assert!(
        matches!(&d.checks[0].outcome, RuleOutcome::Error { message } if message.contains("zero")),
        "{:?}",
        d.checks[0]
    );
    assert_eq!(d.change.unwrap().rule, "next");
}

#[test]
fn an_unchecked_policy_never_panics_the_evaluator() {
    // Built in code, never checked: bad conditions and bounds.
    let p: PolicySet = serde_json::from_value(serde_json::json!({
        "min_workers": 9, "max_workers": 3, "window_epochs": 0,
        "prewarm": {"when": "((", "rule": "nope"},
        "rules": [
            {"name": "syntax", "when": "loss >", "then": {"add_workers": 1}},
            {"name": "unknown", "when": "nope > 1", "then": {"add_workers": 1}},
            {"name": "bad-factor", "when": "true", "then": {"multiply_workers": -1.0}},
            {"name": "bad-rate", "when": "true", "then": {"boundary_sampling": 7.0}},
            {"name": "clamped", "when": "true", "then": {"set_workers": 1}},
        ]
    }))
    .unwrap();
    let d = evaluate(&p, &history(&[1.0, 0.5]), &PlanState::new(1), None);
    assert!(matches!(d.checks[0].outcome, RuleOutcome::Error { .. }));
    assert!(matches!(d.checks[1].outcome, RuleOutcome::Error { .. }));
    assert!(matches!(d.checks[2].outcome, RuleOutcome::NoEffect { .. }));
    assert!(matches!(d.checks[3].outcome, RuleOutcome::NoEffect { .. }));
    // min above max: the count is clamped to min_workers.
    assert_eq!(workers_effect(&d), (1, 9, Some(Bound::MinWorkers)));
}

#[test]
fn window_deltas_follow_their_definitions() {
    let p = policy(
        ALWAYS_GROW
            .replace("cooldown_epochs: 2", "window_epochs: 2")
            .as_str(),
    );
    let mut h = history(&[2.0, 1.5, 1.0, 0.9]);
    h[0].val_acc = Some(0.40);
    h[1].val_acc = Some(0.50);
    h[3].val_acc = Some(0.65);
    h[3].usd_spent = 1.0;
    let mut plan = PlanState::new(3);
    plan.budget_usd = Some(5.0);
    plan.epochs_total = Some(10);
    plan.batch_per_worker = Some(128);
    let vars = variables(&p, &h, &plan, Some(2));
    let get = |name: &str| vars[name].clone();
    // (0.9 - 1.5) / 1.5 over 2 epochs.
    assert_eq!(get("delta_loss"), MetricValue::Float((0.9 - 1.5) / 1.5));
    // The latest accuracy at epoch 4 (0.65) minus the latest at epoch 2 (0.50).
    assert_eq!(get("delta_val_acc"), MetricValue::Float(0.65 - 0.50));
    assert_eq!(get("val_acc"), MetricValue::Float(0.65));
    assert_eq!(get("usd_per_epoch"), MetricValue::Float(1.0 - 0.03));
    assert_eq!(get("budget_left_usd"), MetricValue::Float(4.0));
    assert_eq!(get("epochs_left"), MetricValue::Int(6));
    assert_eq!(get("batch_size"), MetricValue::Int(384));
    assert_eq!(get("epochs_since_change"), MetricValue::Int(2));
    assert_eq!(get("objective"), MetricValue::Text("min_cost".to_string()));
    assert_eq!(get("grad_noise_scale"), MetricValue::Missing);
    // Every metric has a value or is explicitly missing.
    assert_eq!(vars.len(), physalia_policies::METRICS.len());
}

#[test]
fn non_finite_metrics_count_as_missing() {
    let p = policy(
        "max_workers: 4\nrules:\n  - name: diverged\n    when: loss > 100.0\n    then: stop\n",
    );
    let mut h = history(&[1.0]);
    h[0].loss = f64::NAN;
    let d = evaluate(&p, &h, &PlanState::new(1), None);
    assert_eq!(
        d.checks[0].outcome,
        RuleOutcome::Missing {
            metrics: vec!["loss".to_string()]
        }
    );
    // And the decision still serialises (no NaN in JSON).
    serde_json::to_string(&d).unwrap();
}

#[test]
fn prewarm_keeps_spares_for_the_rule_it_names() {
    let p = policy(
        "
max_workers: 12
cooldown_epochs: 3
window_epochs: 1
prewarm:
  when: delta_loss > -0.2
  rule: double
rules:
  - name: double
    when: delta_loss > -0.05
    then: {multiply_workers: 2}
",
    );
    // Loss falling 10% an epoch: no doubling yet, but prewarm the 4 it would add.
    let d = evaluate(&p, &history(&[1.0, 0.9]), &PlanState::new(4), None);
    assert!(d.is_keep());
    assert_eq!(d.prewarm_workers, 4);
    // Doubling now, to 8: the next doubling would add 8 but only 4 fit under max_workers.
    let d = evaluate(&p, &history(&[1.0, 0.99]), &PlanState::new(4), None);
    assert_eq!(workers_effect(&d), (4, 8, None));
    assert_eq!(d.prewarm_workers, 4);
    // Loss falling fast: no spares.
    let d = evaluate(&p, &history(&[1.0, 0.5]), &PlanState::new(4), None);
    assert_eq!(d.prewarm_workers, 0);

    let fixed = policy(
        "
max_workers: 12
prewarm: {when: 'true', workers: 3}
rules:
  - name: stop
    when: loss < 0.1
    then: stop
",
    );
    assert_eq!(
        evaluate(&fixed, &history(&[1.0]), &PlanState::new(4), None).prewarm_workers,
        3
    );
    // A stop needs no spares.
    assert_eq!(
        evaluate(&fixed, &history(&[0.05]), &PlanState::new(4), None).prewarm_workers,
        0
    );
}

#[test]
fn simulate_feeds_decisions_back_and_ends_at_a_stop() {
    let p = policy(
        "
max_workers: 8
cooldown_epochs: 1
rules:
  - name: enough
    when: workers == 8
    then: stop
  - name: double
    when: 'true'
    then: {multiply_workers: 2}
",
    );
    let h = history(&[1.0; 10]);
    let trace = simulate(&p, &h, &PlanState::new(1));
    let workers: Vec<u32> = trace.iter().map(|d| d.workers).collect();
    assert_eq!(workers, [1, 2, 4, 8]);
    assert!(trace.last().unwrap().is_stop());
}

#[test]
fn evaluation_is_a_pure_function_of_its_inputs() {
    let p = policy(include_str!(
        "../../examples/policies/double-on-plateau.yaml"
    ));
    let h = history(&[2.0, 1.5, 1.2, 1.1, 1.09, 1.085, 1.08]);
    let plan = PlanState::new(2);
    let first = serde_json::to_string(&evaluate(&p, &h, &plan, Some(1))).unwrap();
    for _ in 0..5 {
        assert_eq!(
            serde_json::to_string(&evaluate(&p, &h, &plan, Some(1))).unwrap(),
            first
        );
    }
}

/// Values are binary fractions here: serde_json's default float parser can be one ulp off,
/// which says nothing about the decision types.
#[test]
fn decisions_round_trip_through_json() {
    let p = policy(include_str!("../../examples/policies/budget.yaml"));
    let mut h = history(&[1.0, 0.75, 0.5, 0.25]);
    for (i, r) in h.iter_mut().enumerate() {
        r.usd_spent = 0.25 * (i as f64 + 1.0);
    }
    let mut plan = PlanState::new(8);
    plan.budget_usd = Some(1.0);
    plan.epochs_total = Some(20);
    plan.objective = Objective::MinTime;
    let trace = simulate(&p, &h, &plan);
    assert!(trace.iter().any(|d| !d.is_keep()));
    for d in trace {
        let json = serde_json::to_string(&d).unwrap();
        let back: Decision = serde_json::from_str(&json).unwrap();
        assert_eq!(back, d, "{json}");
    }
}
