//! CEL conditions: compiling them, checking them against the metric list, and running them.
//!
//! Checking goes beyond parsing: every identifier must be a metric (walking the AST, with the
//! variables that macros such as `exists` bind), and every call in the condition is run once on
//! representative values of the metrics so that type errors (`workers * 1.5`: CEL does not
//! mix `int` and `double`), unknown functions and non-bool results are found before training,
//! with their position in the condition, whatever branch a real run would take.

use std::collections::{BTreeMap, BTreeSet};

use cel::common::ast::{EntryExpr, Expr, IdedExpr};
use cel::{Context, ExecutionError, Program, Value};

use crate::error::Location;
use crate::metrics::{METRICS, MetricValue, sample_variables};

/// Longest condition accepted, in characters. Real conditions are a line; the limit keeps the
/// recursive CEL parser and interpreter far from the end of the stack.
pub const MAX_CONDITION_CHARS: usize = 1000;
/// Deepest condition accepted (nesting of operators and calls).
pub const MAX_CONDITION_DEPTH: usize = 100;

/// A problem in a condition, with its place in the condition when known.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ConditionProblem {
    pub at: Option<Location>,
    pub message: String,
}

/// A compiled condition and the metrics it reads.
pub(crate) struct Condition {
    program: Program,
    /// Metrics the condition reads, in name order.
    pub reads: Vec<&'static str>,
}

/// Compiles `source`, returning every problem found. With `full`, also runs the type check
/// (on sample values); the evaluator, which runs checked policies, skips it.
pub(crate) fn compile(source: &str, full: bool) -> Result<Condition, Vec<ConditionProblem>> {
    let chars = source.chars().count();
    if chars > MAX_CONDITION_CHARS {
        return Err(vec![problem(
            None,
            format!(
                "condition is {chars} characters long, at most {MAX_CONDITION_CHARS} are accepted"
            ),
        )]);
    }
    if source.trim().is_empty() {
        return Err(vec![problem(None, "condition is empty")]);
    }
    let program = Program::compile(source).map_err(|errors| {
        // Later errors of a parse are mostly echoes of the first: report that one.
        let first = errors.errors.first();
        let message = first.map_or_else(
            || "CEL syntax error".to_string(),
            |e| syntax_message(&e.msg),
        );
        let at = first.and_then(|e| {
            let line = u32::try_from(e.pos.0).ok().filter(|l| *l > 0)?;
            let column = u32::try_from(e.pos.1).ok().filter(|c| *c > 0)?;
            Some(Location { line, column })
        });
        vec![problem(at, message)]
    })?;
    let root = program.expression();
    if depth(root) > MAX_CONDITION_DEPTH {
        return Err(vec![problem(
            None,
            format!("condition nests deeper than {MAX_CONDITION_DEPTH} levels"),
        )]);
    }
    let mut problems = Vec::new();
    let mut reads = BTreeSet::new();
    let mut unknown = Vec::new();
    identifiers(
        root,
        &mut Vec::new(),
        &mut |name, id| match METRICS.iter().find(|m| m.name == name) {
            Some(m) => {
                reads.insert(m.name);
            }
            None => unknown.push((name.to_string(), id)),
        },
    );
    for (name, id) in unknown {
        let at = position(&program, source, id);
        problems.push(problem(at, unknown_metric(&name)));
    }
    if full && problems.is_empty() {
        problems.extend(type_check(&program, source));
    }
    if problems.is_empty() {
        Ok(Condition {
            program,
            reads: reads.into_iter().collect(),
        })
    } else {
        Err(problems)
    }
}

impl Condition {
    /// Runs the condition on `vars` (which must hold every metric it reads, none missing).
    pub fn run(&self, vars: &BTreeMap<&'static str, MetricValue>) -> Result<bool, String> {
        let mut context = Context::default();
        for name in &self.reads {
            let value = vars.get(name).map_or(Value::Null, MetricValue::to_cel);
            context.add_variable_from_value(*name, value);
        }
        match self.program.execute(&context) {
            Ok(Value::Bool(b)) => Ok(b),
            Ok(other) => Err(format!("condition gave {}, not a bool", type_name(&other))),
            Err(e) => Err(crate::error::one_line(&e.to_string())),
        }
    }
}

fn problem(at: Option<Location>, message: impl Into<String>) -> ConditionProblem {
    ConditionProblem {
        at,
        message: message.into(),
    }
}

fn syntax_message(msg: &str) -> String {
    if msg.contains("Recursion limit") {
        return format!("condition nests deeper than {MAX_CONDITION_DEPTH} levels");
    }
    let msg = msg.strip_prefix("Syntax error: ").unwrap_or(msg);
    format!("CEL syntax error: {}", crate::error::one_line(msg))
}

fn unknown_metric(name: &str) -> String {
    let name = crate::error::one_line(name);
    let mut words: Vec<&str> = name.split('_').collect();
    words.sort_unstable();
    // `loss_delta` for `delta_loss`: the same words in another order.
    let reordered = METRICS.iter().find(|m| {
        let mut theirs: Vec<&str> = m.name.split('_').collect();
        theirs.sort_unstable();
        theirs == words
    });
    let nearest = METRICS
        .iter()
        .map(|m| (edit_distance(&name, m.name), m.name))
        .min()
        .filter(|(distance, _)| *distance <= 2.max(name.len() / 3));
    match reordered.map(|m| m.name).or(nearest.map(|(_, n)| n)) {
        Some(suggestion) => format!("unknown metric `{name}` (did you mean `{suggestion}`?)"),
        None => format!(
            "unknown metric `{name}`; the metrics are {}",
            METRICS
                .iter()
                .map(|m| m.name)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = if ca == *cb {
                diagonal
            } else {
                1 + diagonal.min(above).min(row[j])
            };
            diagonal = above;
        }
    }
    row[b.len()]
}

/// Nesting depth of an expression, found without recursion.
fn depth(root: &IdedExpr) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(root, 1usize)];
    while let Some((expr, d)) = stack.pop() {
        deepest = deepest.max(d);
        if deepest > MAX_CONDITION_DEPTH {
            break;
        }
        for child in children(expr) {
            stack.push((child, d + 1));
        }
    }
    deepest
}

/// The direct sub-expressions of `expr`.
fn children(expr: &IdedExpr) -> Vec<&IdedExpr> {
    match &expr.expr {
        Expr::Call(call) => call
            .target
            .as_deref()
            .into_iter()
            .chain(&call.args)
            .collect(),
        Expr::Comprehension(c) => vec![
            &c.iter_range,
            &c.accu_init,
            &c.loop_cond,
            &c.loop_step,
            &c.result,
        ],
        Expr::List(list) => list.elements.iter().collect(),
        Expr::Map(map) => entries(&map.entries),
        Expr::Struct(s) => entries(&s.entries),
        Expr::Select(select) => vec![&select.operand],
        Expr::Ident(_) | Expr::Literal(_) | Expr::Unspecified => Vec::new(),
    }
}

fn entries(entries: &[cel::common::ast::IdedEntryExpr]) -> Vec<&IdedExpr> {
    entries
        .iter()
        .flat_map(|e| match &e.expr {
            EntryExpr::StructField(f) => vec![&f.value],
            EntryExpr::MapEntry(m) => vec![&m.key, &m.value],
        })
        .collect()
}

/// Calls `found(name, id)` for every free identifier: not one a macro binds.
/// Recursive, but only on expressions already checked to be shallow.
fn identifiers(expr: &IdedExpr, bound: &mut Vec<String>, found: &mut impl FnMut(&str, u64)) {
    match &expr.expr {
        Expr::Ident(name) => {
            if !bound.iter().any(|b| b == name) {
                found(name, expr.id);
            }
        }
        Expr::Comprehension(c) => {
            identifiers(&c.iter_range, bound, found);
            identifiers(&c.accu_init, bound, found);
            let before = bound.len();
            bound.push(c.iter_var.clone());
            bound.extend(c.iter_var2.clone());
            bound.push(c.accu_var.clone());
            for inner in [&c.loop_cond, &c.loop_step, &c.result] {
                identifiers(inner, bound, found);
            }
            bound.truncate(before);
        }
        _ => {
            for child in children(expr) {
                identifiers(child, bound, found);
            }
        }
    }
}

/// Where the node `id` starts in the condition. The parser gives byte offsets.
fn position(program: &Program, source: &str, id: u64) -> Option<Location> {
    let (start, _) = program.source_info().offset_for(id)?;
    let start = usize::try_from(start).ok()?;
    let (mut line, mut column) = (1u32, 1u32);
    for (i, c) in source.char_indices() {
        if i >= start {
            return Some(Location { line, column });
        }
        if c == '\n' {
            line = line.saturating_add(1);
            column = 1;
        } else {
            column = column.saturating_add(1);
        }
    }
    Some(Location { line, column })
}

/// Runs every call that does not depend on a macro's bound variables on representative
/// metric values, and the whole condition, reporting errors that no metric values could avoid.
/// A call is reported only when its arguments ran cleanly, so each mistake is reported once.
fn type_check(program: &Program, source: &str) -> Vec<ConditionProblem> {
    let samples = sample_variables();
    let mut context = Context::default();
    for (name, value) in &samples {
        context.add_variable_from_value(*name, value.to_cel());
    }
    let root = program.expression();
    let mut problems = Vec::new();
    check_calls(root, &context, &mut |call, e| {
        problems.push(problem(
            position(program, source, call.id),
            type_error_message(e),
        ));
    });
    if !problems.is_empty() {
        return problems;
    }
    match Value::resolve(root, &context) {
        Ok(Value::Bool(_)) => {}
        Ok(other) => problems.push(problem(
            position(program, source, root.id),
            format!(
                "condition gives {}, not a bool (compare it, e.g. `{} > 0`)",
                type_name(&other),
                crate::error::one_line(source.trim())
            ),
        )),
        Err(e) if is_type_error(&e) => problems.push(problem(
            position(program, source, root.id),
            type_error_message(&e),
        )),
        Err(_) => {}
    }
    problems
}

/// Runs the calls under `expr` innermost first, outside of macro bodies (which read the
/// macro's variables), calling `report` for each type error; whether one was found.
fn check_calls(
    expr: &IdedExpr,
    context: &Context,
    report: &mut impl FnMut(&IdedExpr, &ExecutionError),
) -> bool {
    match &expr.expr {
        Expr::Comprehension(c) => {
            let range = check_calls(&c.iter_range, context, report);
            check_calls(&c.accu_init, context, report) || range
        }
        Expr::Call(_) => {
            let mut inner = false;
            for child in children(expr) {
                inner |= check_calls(child, context, report);
            }
            if inner {
                return true;
            }
            match Value::resolve(expr, context) {
                Err(e) if is_type_error(&e) => {
                    report(expr, &e);
                    true
                }
                _ => false,
            }
        }
        _ => {
            let mut inner = false;
            for child in children(expr) {
                inner |= check_calls(child, context, report);
            }
            inner
        }
    }
}

/// Errors that depend on types, not on values: a division by zero or a missing map key on the
/// sample values says nothing about real runs.
fn is_type_error(e: &ExecutionError) -> bool {
    matches!(
        e,
        ExecutionError::NoSuchOverload(_)
            | ExecutionError::UnsupportedBinaryOperator(..)
            | ExecutionError::UndeclaredReference(_)
            | ExecutionError::UnexpectedType { .. }
            | ExecutionError::UnsupportedTargetType { .. }
            | ExecutionError::NotSupportedAsMethod { .. }
            | ExecutionError::ValuesNotComparable(..)
            | ExecutionError::InvalidArgumentCount { .. }
            | ExecutionError::MissingArgumentOrTarget
    )
}

fn type_error_message(e: &ExecutionError) -> String {
    let mixes = |a: &Value, b: &Value| {
        matches!(
            (a, b),
            (Value::Int(_), Value::Float(_)) | (Value::Float(_), Value::Int(_))
        )
    };
    let hint = match e {
        ExecutionError::UnsupportedBinaryOperator(_, a, b) if mixes(a, b) => {
            "; CEL does not mix int and double in arithmetic: write double(workers) or 2.0"
        }
        ExecutionError::NoSuchOverload(o)
            if o.argument_types().iter().any(|t| t == "int")
                && o.argument_types().iter().any(|t| t == "double") =>
        {
            "; CEL does not mix int and double in arithmetic: write double(workers) or 2.0"
        }
        _ => "",
    };
    let message = match e {
        ExecutionError::UnsupportedBinaryOperator(op, a, b) => format!(
            "no operator `{}` for {} and {}",
            operator_symbol(op),
            type_name(a),
            type_name(b)
        ),
        ExecutionError::UndeclaredReference(name) => {
            format!("unknown function `{}`", crate::error::one_line(name))
        }
        other => crate::error::one_line(&other.to_string()),
    };
    format!("{message}{hint}")
}

fn operator_symbol(op: &str) -> &str {
    match op {
        "add" => "+",
        "sub" => "-",
        "mul" => "*",
        "div" => "/",
        "rem" => "%",
        other => other,
    }
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::List(_) => "a list",
        Value::Map(_) => "a map",
        Value::Function(..) => "a function",
        Value::Int(_) => "an int",
        Value::UInt(_) => "a uint",
        Value::Float(_) => "a double",
        Value::String(_) => "a string",
        Value::Bytes(_) => "bytes",
        Value::Bool(_) => "a bool",
        Value::Null => "null",
        _ => "a value",
    }
}
