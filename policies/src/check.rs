//! Semantic checks of a policy: what the schema cannot say. Every problem is reported, each
//! with the path of its field; [`crate::locate`] turns paths into lines and columns.

use crate::conditions;
use crate::error::{PolicyError, one_line};
use crate::schema::{Action, PolicySet};

/// Most workers a policy may ask for.
pub const MAX_WORKERS: u32 = 65_535;
/// Longest rule name, in characters.
pub const MAX_RULE_NAME_CHARS: usize = 64;

/// Checks `policy` and returns every problem found (empty when it is valid), in the order of
/// its fields. The errors carry field paths but no file positions: [`crate::parse_str`] adds
/// them, or [`crate::locate`] for a policy read from a larger document.
pub fn check(policy: &PolicySet) -> Vec<PolicyError> {
    let mut errors = Vec::new();
    let bounds_valid = check_bounds(policy, &mut errors);
    if policy.window_epochs == 0 {
        errors.push(PolicyError::invalid(
            "window_epochs",
            "must be at least 1, got 0",
        ));
    }
    if let Some(prewarm) = &policy.prewarm {
        check_condition("prewarm.when", &prewarm.when, &mut errors);
        match (prewarm.workers, &prewarm.rule) {
            (Some(_), Some(_)) => errors.push(PolicyError::invalid(
                "prewarm",
                "give one of `workers` (a count) and `rule` (the rule whose growth to prewarm), not both",
            )),
            (None, None) => errors.push(PolicyError::invalid(
                "prewarm",
                "give `workers` (a count) or `rule` (the rule whose growth to prewarm)",
            )),
            (Some(0), None) => errors.push(PolicyError::invalid(
                "prewarm.workers",
                "must be at least 1, got 0",
            )),
            (Some(_), None) => {}
            (None, Some(name)) => match policy.rules.iter().find(|r| &r.name == name) {
                None => errors.push(PolicyError::invalid(
                    "prewarm.rule",
                    format!("no rule is named `{}`", one_line(name)),
                )),
                Some(rule) if !rule.then.changes_workers() => errors.push(PolicyError::invalid(
                    "prewarm.rule",
                    format!(
                        "rule `{}` does not change the worker count (its action is `{}`)",
                        one_line(name),
                        rule.then
                    ),
                )),
                Some(_) => {}
            },
        }
    }
    if policy.rules.is_empty() {
        errors.push(PolicyError::invalid(
            "rules",
            "a policy needs at least one rule",
        ));
    }
    for (i, rule) in policy.rules.iter().enumerate() {
        let at = |field: &str| format!("rules[{i}].{field}");
        let name = rule.name.trim();
        if name.is_empty() {
            errors.push(PolicyError::invalid(at("name"), "must not be empty"));
        } else if rule.name.chars().count() > MAX_RULE_NAME_CHARS
            || rule.name.chars().any(char::is_control)
        {
            errors.push(PolicyError::invalid(
                at("name"),
                format!("must be one line of at most {MAX_RULE_NAME_CHARS} characters"),
            ));
        } else if let Some(j) = policy.rules[..i].iter().position(|r| r.name == rule.name) {
            errors.push(PolicyError::invalid(
                at("name"),
                format!("rule name `{}` is already used by rules[{j}]", rule.name),
            ));
        }
        check_condition(&at("when"), &rule.when, &mut errors);
        check_action(policy, bounds_valid, &at("then"), &rule.then, &mut errors);
    }
    errors
}

/// Checks the worker bounds; whether they are usable to check actions against.
fn check_bounds(policy: &PolicySet, errors: &mut Vec<PolicyError>) -> bool {
    let before = errors.len();
    if policy.min_workers == 0 {
        errors.push(PolicyError::invalid(
            "min_workers",
            "must be at least 1, got 0",
        ));
    }
    if policy.max_workers == 0 {
        errors.push(PolicyError::invalid(
            "max_workers",
            "must be at least 1, got 0",
        ));
    } else if policy.max_workers > MAX_WORKERS {
        errors.push(PolicyError::invalid(
            "max_workers",
            format!("must be at most {MAX_WORKERS}, got {}", policy.max_workers),
        ));
    }
    if policy.min_workers > policy.max_workers && policy.max_workers > 0 {
        errors.push(PolicyError::invalid(
            "min_workers",
            format!(
                "{} is above max_workers ({})",
                policy.min_workers, policy.max_workers
            ),
        ));
    }
    errors.len() == before
}

fn check_condition(path: &str, source: &str, errors: &mut Vec<PolicyError>) {
    if let Err(problems) = conditions::compile(source, true) {
        errors.extend(
            problems
                .into_iter()
                .map(|p| PolicyError::in_condition(path, p.at, p.message)),
        );
    }
}

fn check_action(
    policy: &PolicySet,
    bounds_valid: bool,
    path: &str,
    action: &Action,
    errors: &mut Vec<PolicyError>,
) {
    let field = format!("{path}.{}", action.name());
    let mut bad = |message: String| errors.push(PolicyError::invalid(field.clone(), message));
    match *action {
        Action::SetWorkers(0) => bad("must be at least 1, got 0".to_string()),
        Action::SetWorkers(n) if bounds_valid && n > policy.max_workers => {
            bad(format!("{n} is above max_workers ({})", policy.max_workers))
        }
        Action::SetWorkers(n) if bounds_valid && n < policy.min_workers => {
            bad(format!("{n} is below min_workers ({})", policy.min_workers))
        }
        Action::MultiplyWorkers(x) if !(x.is_finite() && x > 0.0) => {
            bad(format!("must be a number above 0, got {x}"))
        }
        Action::MultiplyWorkers(1.0) => bad("multiplying by 1 changes nothing".to_string()),
        Action::AddWorkers(0) => bad("adding 0 workers changes nothing".to_string()),
        Action::BoundarySampling(p) if !(p.is_finite() && p > 0.0 && p <= 1.0) => {
            bad(format!("must be in (0, 1], got {p}"))
        }
        _ => {}
    }
}
