//! The sans-IO scaling policies: YAML schema, CEL conditions, evaluator to a `ScaleDecision`.
//!
//! Empty on purpose until the scaling issue (issue 6).
