//! Reading policies: the examples parse, bad policies fail at the right line and column, the
//! schema round-trips, and errors can be placed inside a larger document.

use physalia_policies::{
    Action, Location, METRICS, Objective, PolicyError, check, json_schema, locate, parse_str,
};

fn errors(yaml: &str) -> Vec<PolicyError> {
    match parse_str(yaml, "p.yaml") {
        Ok(p) => panic!("accepted: {p:?}"),
        Err(e) => e.0,
    }
}

fn at(line: u32, column: u32) -> Option<Location> {
    Some(Location { line, column })
}

#[test]
fn every_example_policy_parses() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/policies");
    let mut n = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let text = std::fs::read_to_string(&path).unwrap();
            parse_str(&text, &path.display().to_string()).unwrap_or_else(|e| panic!("{e}"));
            n += 1;
        }
    }
    assert!(n >= 4);
}

#[test]
fn an_unknown_metric_is_reported_where_it_is_written() {
    let e = errors(
        "max_workers: 4\nrules:\n  - name: a\n    when: loss < 1.0 && wait_shar > 0.5\n    then: stop\n",
    );
    assert_eq!(e.len(), 1);
    // `    when: ` is 10 characters; `wait_shar` starts at offset 14 of the condition.
    assert_eq!(e[0].location(), at(4, 25));
    assert_eq!(e[0].path(), "rules[0].when");
    assert_eq!(
        e[0].to_string(),
        "p.yaml:4:25: rules[0].when: unknown metric `wait_shar` (did you mean `wait_share`?)"
    );
}

#[test]
fn a_cel_syntax_error_is_reported_inside_the_condition() {
    // Double-quoted: the condition starts one column after the quote.
    let e =
        errors("max_workers: 4\nrules:\n  - name: a\n    when: \"loss < 1.0 )\"\n    then: stop\n");
    assert_eq!(e.len(), 1);
    assert_eq!(e[0].location(), at(4, 23));
    assert!(e[0].message().starts_with("CEL syntax error"), "{}", e[0]);
}

#[test]
fn positions_count_characters_not_bytes() {
    let e = errors(
        "max_workers: 4\nrules:\n  - name: a\n    when: \"objective == 'éé' && nope > 1\"\n    then: stop\n",
    );
    assert_eq!(e[0].location(), at(4, 33));
}

#[test]
fn a_condition_on_several_lines_is_located_on_its_line() {
    let e = errors(
        "max_workers: 4\nrules:\n  - name: a\n    when: >-\n      loss < 1.0 &&\n      wait_shar > 0.5\n    then: stop\n",
    );
    assert_eq!(e[0].location(), at(6, 7));
}

#[test]
fn min_above_max_is_reported_at_min_workers() {
    let e = errors(
        "max_workers: 2\nmin_workers: 3\nrules:\n  - name: a\n    when: 'true'\n    then: stop\n",
    );
    assert_eq!(e.len(), 1);
    assert_eq!(e[0].location(), at(2, 14));
    assert_eq!(e[0].message(), "3 is above max_workers (2)");
}

#[test]
fn an_action_without_a_target_is_reported_at_the_action() {
    for (yaml, location) in [
        ("then: set_workers", at(5, 11)),
        ("then: {multiply_workers: }", at(5, 11)),
        ("then: {staleness: null}", at(5, 11)),
        ("then:\n      replan:", at(6, 7)),
    ] {
        let e = errors(&format!(
            "max_workers: 4\nrules:\n  - name: a\n    when: 'true'\n    {yaml}\n"
        ));
        assert_eq!(e.len(), 1, "{yaml}");
        assert!(matches!(e[0], PolicyError::Parse { .. }));
        assert!(e[0].message().contains("needs a target"), "{}", e[0]);
        assert_eq!(e[0].location(), location, "{yaml}: {}", e[0]);
    }
}

#[test]
fn every_semantic_error_is_reported_in_text_order() {
    let e = errors(
        "min_workers: 5\nmax_workers: 4\nrules:\n  - name: a\n    when: nope\n    then: {set_workers: 9}\n  - name: a\n    when: 'workers * 0.5 > 1.0'\n    then: {boundary_sampling: 0}\n",
    );
    let got: Vec<(Option<Location>, &str)> = e.iter().map(|e| (e.location(), e.path())).collect();
    assert_eq!(
        got,
        [
            (at(1, 14), "min_workers"),
            (at(5, 11), "rules[0].when"),
            (at(7, 11), "rules[1].name"),
            (at(8, 20), "rules[1].when"),
            (at(9, 31), "rules[1].then.boundary_sampling"),
        ]
    );
    // Bounds are inconsistent, so set_workers is not checked against them.
    assert!(e.iter().all(|e| !e.path().ends_with("set_workers")));
}

#[test]
fn type_errors_are_found_in_branches_a_run_might_skip() {
    // `epoch > 1000` is false on most epochs, so `workers * 1.5` would rarely run; it is
    // still a mistake.
    let e = errors(
        "max_workers: 4\nrules:\n  - name: a\n    when: epoch > 1000 && workers * 1.5 > 2.0\n    then: stop\n",
    );
    assert_eq!(e.len(), 1);
    // At the `*`.
    assert_eq!(e[0].location(), at(4, 35));
    assert!(e[0].message().contains("double(workers)"), "{}", e[0]);
}

#[test]
fn macros_bind_their_own_variables() {
    parse_str(
        "max_workers: 4\nrules:\n  - name: a\n    when: '[0.1, 0.2].exists(x, x > wait_share) && [1, 2].all(n, n < workers)'\n    then: stop\n",
        "p.yaml",
    )
    .unwrap();
}

#[test]
fn check_reports_paths_that_locate_places_in_a_larger_document() {
    // The policy as the `scaling:` section of a job file.
    let job = "name: arxiv\nscaling:\n  max_workers: 4\n  rules:\n    - name: a\n      when: loss > 1 && nope\n      then: {set_workers: 8}\n";
    #[derive(serde::Deserialize)]
    struct Job {
        #[allow(dead_code)]
        name: String,
        scaling: physalia_policies::PolicySet,
    }
    let job_spec: Job = serde_saphyr::from_str(job).unwrap();
    let problems = check(&job_spec.scaling);
    assert_eq!(problems.len(), 2);
    assert!(problems.iter().all(|e| e.location().is_none()));
    let located = locate(problems, job, "job.yaml", "scaling");
    let text: Vec<String> = located.iter().map(ToString::to_string).collect();
    assert_eq!(
        text,
        [
            "job.yaml:6:25: scaling.rules[0].when: unknown metric `nope`; the metrics are \
             epoch, loss, val_acc, delta_loss, delta_val_acc, epoch_s, wait_share, bytes, \
             workers, min_workers, max_workers, usd_spent, usd_per_epoch, budget_usd, \
             budget_left_usd, epochs_left, throughput_per_usd, grad_noise_scale, batch_size, \
             boundary_sampling, staleness, objective, epochs_since_change",
            "job.yaml:7:27: scaling.rules[0].then.set_workers: 8 is above max_workers (4)",
        ]
    );
}

#[test]
fn the_yaml_forms_of_actions() {
    let p = parse_str(
        "
max_workers: 8
rules:
  - {name: a, when: 'true', then: {set_workers: 4}}
  - {name: b, when: 'true', then: {multiply_workers: 1.5}}
  - {name: c, when: 'true', then: {add_workers: -2}}
  - {name: d, when: 'true', then: {boundary_sampling: 0.1}}
  - {name: e, when: 'true', then: {staleness: 3}}
  - {name: f, when: 'true', then: {replan: min_time}}
  - {name: g, when: 'true', then: stop}
  - name: h
    when: 'true'
    then:
      stop:
",
        "p.yaml",
    )
    .unwrap();
    let actions: Vec<Action> = p.rules.iter().map(|r| r.then).collect();
    assert_eq!(
        actions,
        [
            Action::SetWorkers(4),
            Action::MultiplyWorkers(1.5),
            Action::AddWorkers(-2),
            Action::BoundarySampling(0.1),
            Action::Staleness(3),
            Action::Replan(Objective::MinTime),
            Action::Stop,
            Action::Stop,
        ]
    );
    // Two keys in one action are refused.
    let e = errors(
        "max_workers: 8\nrules:\n  - {name: a, when: 'true', then: {set_workers: 4, staleness: 1}}\n",
    );
    assert!(e[0].message().contains("one key"), "{}", e[0]);
}

#[test]
fn policies_round_trip_through_yaml_and_json() {
    let text = include_str!("../../examples/policies/double-on-plateau.yaml");
    let p = parse_str(text, "x.yaml").unwrap();
    let yaml = serde_saphyr::to_string(&p).unwrap();
    assert_eq!(parse_str(&yaml, "again.yaml").unwrap(), p, "{yaml}");
    let json = serde_json::to_string(&p).unwrap();
    assert_eq!(
        serde_json::from_str::<physalia_policies::PolicySet>(&json).unwrap(),
        p
    );
}

#[test]
fn the_json_schema_describes_the_policy() {
    let schema = json_schema();
    let properties = &schema["properties"];
    for field in [
        "min_workers",
        "max_workers",
        "cooldown_epochs",
        "window_epochs",
        "prewarm",
        "rules",
    ] {
        assert!(properties.get(field).is_some(), "{field} in {schema}");
    }
    assert_eq!(schema["additionalProperties"], serde_json::json!(false));
    let text = schema.to_string();
    for action in ["set_workers", "multiply_workers", "replan", "stop"] {
        assert!(text.contains(action), "{action}");
    }
}

#[test]
fn the_user_docs_list_every_metric() {
    let readme = include_str!("../../examples/policies/README.md");
    for metric in METRICS {
        assert!(
            readme.contains(&format!("`{}`", metric.name)),
            "examples/policies/README.md does not document `{}`",
            metric.name
        );
    }
}
