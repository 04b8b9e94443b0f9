//! The sans-IO planner: catalog, cost model, candidate search, objective, explanations.
//!
//! Empty on purpose until the planner issue (issue 5). Today `submit` runs the job file's settings as written.
