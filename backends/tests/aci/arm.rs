//! An Azure Resource Manager endpoint for Container Instances on loopback: a real HTTP server (hyper)
//! that keeps container groups, validates every PUT body against the published ContainerGroup schema,
//! answers like ARM (201 + `Azure-AsyncOperation` or `Location`, `Retry-After`, polling until the
//! operation ends, CloudError bodies) and plays back failures: quota (409), bad credentials (401), an
//! image refused at PUT (400 InaccessibleImage) or failing later (the group ends Failed).
//!
//! It records every request, create and delete so tests can check that a failed launch left nothing.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

use crate::swagger::Swagger;

pub const SUBSCRIPTION: &str = "00000000-0000-0000-0000-00000000beef";
pub const RESOURCE_GROUP: &str = "physalia-rg";
pub const TOKEN: &str = "test-token";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lro {
    /// 201 + `Azure-AsyncOperation` (what ACI sends for a create); DELETE answers 200 at once.
    AsyncOperation,
    /// 201/202 + `Location`, polled until it stops answering 202; DELETE answers 202 too.
    Location,
}

#[derive(Clone, Debug)]
pub enum Failure {
    /// 409 ContainerGroupQuotaReached at PUT; nothing is created.
    Quota,
    /// 400 InaccessibleImage at PUT; nothing is created.
    ImageRefused,
    /// The group is created, then its deployment fails pulling the image: the operation ends Failed
    /// and the group is in the Failed state with the pull error among its events.
    ImagePullFails,
}

pub struct Script {
    pub lro: Lro,
    /// `InProgress` answers before an operation ends.
    pub polls: usize,
    /// By rank ([`COORDINATOR_RANK`] for the coordinator's group).
    pub failures: BTreeMap<usize, Failure>,
    /// Groups per page of a list.
    pub page_size: usize,
    /// The async-operation URL points at another host (the client must not follow it).
    pub foreign_operation_url: bool,
    /// ARM's throttling: every Nth request of a principal (0: none) is answered [`Throttle::status`]
    /// (429 Too Many Requests) without being carried out.
    pub throttle: Throttle,
    /// ACI's regional usage in `eastus` (Location - List Usage): (name, localized name, current
    /// value, limit).
    pub usage: Vec<(&'static str, &'static str, u32, u32)>,
}

#[derive(Clone, Debug)]
pub struct Throttle {
    pub every: usize,
    pub status: u16,
    /// Its `Retry-After` (seconds), or none.
    pub retry_after: Option<&'static str>,
    /// Throttle at most this many requests in all, then none.
    pub limit: Option<usize>,
    /// Also throttle the first of each distinct request (`METHOD path?query`): every call path meets
    /// a 429 at least once.
    pub first_of_each: bool,
}

impl Default for Throttle {
    fn default() -> Self {
        Throttle {
            every: 0,
            status: 429,
            retry_after: Some("0"),
            limit: None,
            first_of_each: false,
        }
    }
}

impl Default for Script {
    fn default() -> Self {
        Script {
            lro: Lro::AsyncOperation,
            polls: 2,
            failures: BTreeMap::new(),
            page_size: 100,
            foreign_operation_url: false,
            throttle: Throttle::default(),
            // ACI's default regional quotas
            usage: vec![
                ("ContainerGroups", "Container Groups", 0, 100),
                ("StandardCores", "Standard Cores", 0, 100),
            ],
        }
    }
}

pub struct Group {
    pub rank: usize,
    pub body: Value,
    /// Provisioning state: Creating until its operation ends.
    pub state: &'static str,
    pub failure: Option<Failure>,
}

struct Op {
    group: String,
    polls_left: usize,
    kind: &'static str,
}

#[derive(Default)]
pub struct Record {
    /// `METHOD path?query` in order.
    pub requests: Vec<String>,
    /// Groups created (PUT accepted), in order.
    pub created: Vec<String>,
    /// Groups deleted (DELETE found them).
    pub deleted: Vec<String>,
    /// PUT bodies as received, by group.
    pub bodies: BTreeMap<String, Value>,
    /// Broken rules: schema violations, a wrong api-version, an unknown route. Tests assert it is empty.
    pub violations: Vec<String>,
    pub groups: BTreeMap<String, Group>,
    /// Requests answered as throttled, as `METHOD path?query`.
    pub throttled: Vec<String>,
    /// Requests seen per principal (its bearer token), for throttling.
    pub per_principal: BTreeMap<String, usize>,
}

struct State {
    script: Script,
    record: Record,
    ops: BTreeMap<u64, Op>,
    next_op: u64,
}

pub struct ArmServer {
    pub endpoint: String,
    state: Arc<Mutex<State>>,
}

impl ArmServer {
    pub async fn start(script: Script) -> ArmServer {
        let swagger = Arc::new(Swagger::load(&crate::spec_path()));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr: SocketAddr = listener.local_addr().unwrap();
        let endpoint = format!("http://{addr}");
        let state = Arc::new(Mutex::new(State {
            script,
            record: Record::default(),
            ops: BTreeMap::new(),
            next_op: 1,
        }));
        let st = state.clone();
        let base = endpoint.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (st, base, swagger) = (st.clone(), base.clone(), swagger.clone());
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let (st, base, swagger) = (st.clone(), base.clone(), swagger.clone());
                        async move { Ok::<_, Infallible>(handle(&st, &base, &swagger, req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        ArmServer { endpoint, state }
    }

    /// What the server saw and holds.
    pub fn record(&self) -> RecordRef<'_> {
        RecordRef(self.state.lock().unwrap())
    }
}

pub struct RecordRef<'a>(std::sync::MutexGuard<'a, State>);

impl std::ops::Deref for RecordRef<'_> {
    type Target = Record;
    fn deref(&self) -> &Record {
        &self.0.record
    }
}

impl std::ops::Deref for State {
    type Target = Record;
    fn deref(&self) -> &Record {
        &self.record
    }
}

impl std::ops::DerefMut for State {
    fn deref_mut(&mut self) -> &mut Record {
        &mut self.record
    }
}

fn reply(code: u16, body: Option<&Value>, headers: &[(&str, String)]) -> Response<Full<Bytes>> {
    let mut b = Response::builder().status(StatusCode::from_u16(code).unwrap());
    for (k, v) in headers {
        b = b.header(*k, v);
    }
    let bytes = body
        .map(|v| serde_json::to_vec(v).unwrap())
        .unwrap_or_default();
    if body.is_some() {
        b = b.header("content-type", "application/json; charset=utf-8");
    }
    b.body(Full::new(Bytes::from(bytes))).unwrap()
}

fn cloud_error(code: u16, error: &str, message: &str) -> Response<Full<Bytes>> {
    reply(
        code,
        Some(&json!({"error": {"code": error, "message": message}})),
        &[],
    )
}

fn groups_prefix() -> String {
    format!(
        "/subscriptions/{SUBSCRIPTION}/resourceGroups/{RESOURCE_GROUP}/providers/Microsoft.ContainerInstance/containerGroups"
    )
}

fn query_param<'a>(query: &'a str, name: &str) -> Option<&'a str> {
    query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

async fn handle(
    state: &Arc<Mutex<State>>,
    base: &str,
    swagger: &Swagger,
    req: Request<Incoming>,
) -> Response<Full<Bytes>> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let auth = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let bytes = req.into_body().collect().await.unwrap().to_bytes();
    let mut st = state.lock().unwrap();
    st.requests.push(format!("{method} {path}?{query}"));

    if query_param(&query, "api-version") != Some("2026-05-01") {
        st.violations.push(format!(
            "{method} {path}?{query}: api-version is not 2026-05-01"
        ));
        return cloud_error(400, "InvalidApiVersionParameter", "wrong api-version");
    }
    if auth != format!("Bearer {TOKEN}") {
        return cloud_error(
            401,
            "InvalidAuthenticationToken",
            "The access token is invalid.",
        );
    }

    let t = st.script.throttle.clone();
    let seen = st.per_principal.entry(auth.clone()).or_insert(0);
    *seen += 1;
    let seen = *seen;
    let this = format!("{method} {path}?{query}");
    let first = st.requests.iter().filter(|r| **r == this).count() == 1;
    let due = (t.every > 0 && seen.is_multiple_of(t.every)) || (t.first_of_each && first);
    if due && t.limit.is_none_or(|l| st.throttled.len() < l) {
        st.throttled.push(this);
        let headers: Vec<(&str, String)> = t
            .retry_after
            .map(|r| ("Retry-After", r.to_string()))
            .into_iter()
            .chain([(
                "x-ms-ratelimit-remaining-subscription-reads",
                "0".to_string(),
            )])
            .collect();
        let body = json!({"error": {
            "code": if t.status == 429 { "TooManyRequests" } else { "ServiceUnavailable" },
            "message": "The request is being throttled as the limit has been reached for operation type."
        }});
        return reply(t.status, Some(&body), &headers);
    }

    let usages = format!(
        "/subscriptions/{SUBSCRIPTION}/providers/Microsoft.ContainerInstance/locations/eastus/usages"
    );
    if method == Method::GET && path == usages {
        let value: Vec<Value> = st
            .script
            .usage
            .iter()
            .map(|(name, localized, current, limit)| {
                json!({
                    "id": format!("{path}/{name}"),
                    "unit": "Count",
                    "currentValue": current,
                    "limit": limit,
                    "name": {"value": name, "localizedValue": localized},
                })
            })
            .collect();
        return reply(200, Some(&json!({ "value": value })), &[]);
    }
    let prefix = groups_prefix();
    if let Some(id) = path.strip_prefix("/operations/") {
        return poll_operation(&mut st, id.parse().unwrap_or(0), false);
    }
    if let Some(id) = path.strip_prefix("/operationResults/") {
        return poll_operation(&mut st, id.parse().unwrap_or(0), true);
    }
    let Some(rest) = path.strip_prefix(&prefix) else {
        st.violations.push(format!("unknown route {method} {path}"));
        return cloud_error(404, "NotFound", "no such route");
    };
    let parts: Vec<&str> = rest.trim_start_matches('/').split('/').collect();
    match (&method, parts.as_slice()) {
        (&Method::GET, [""]) => list(&mut st, base, &query),
        (&Method::PUT, [name]) => {
            let body: Value = match serde_json::from_slice(&bytes) {
                Ok(v) => v,
                Err(e) => {
                    st.violations
                        .push(format!("PUT {name}: body is not JSON: {e}"));
                    return cloud_error(400, "InvalidRequestContent", "not JSON");
                }
            };
            put(&mut st, base, swagger, name, body)
        }
        (&Method::GET, [name]) => match st.groups.get(*name) {
            Some(g) => reply(200, Some(&view(name, g)), &[]),
            None => cloud_error(404, "ResourceNotFound", &format!("{name} not found")),
        },
        (&Method::DELETE, [name]) => delete(&mut st, base, name),
        (&Method::GET, [name, "containers", container, "logs"]) => match st.groups.get(*name) {
            Some(_) => reply(
                200,
                Some(&json!({"content": format!("log of {name}/{container}\n")})),
                &[],
            ),
            None => cloud_error(404, "ResourceNotFound", &format!("{name} not found")),
        },
        _ => {
            st.violations.push(format!("unknown route {method} {path}"));
            cloud_error(404, "NotFound", "no such route")
        }
    }
}

/// The coordinator's group plays rank [`COORDINATOR_RANK`] (its IP is 10.1.0.254).
pub const COORDINATOR_RANK: usize = 250;

fn rank_of(body: &Value, name: &str) -> usize {
    if body["tags"]["physalia-coordinator"].is_string() {
        return COORDINATOR_RANK;
    }
    body["tags"]["physalia-rank"]
        .as_str()
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| name.rsplit('-').next().unwrap().parse().unwrap())
}

fn put(
    st: &mut State,
    base: &str,
    swagger: &Swagger,
    name: &str,
    body: Value,
) -> Response<Full<Bytes>> {
    let errors = swagger.validate("ContainerGroup", &body);
    if !errors.is_empty() {
        st.violations
            .extend(errors.iter().map(|e| format!("PUT {name}: {e}")));
        return cloud_error(400, "InvalidRequestContent", &errors.join("; "));
    }
    st.bodies.insert(name.to_string(), body.clone());
    let rank = rank_of(&body, name);
    let failure = st.script.failures.get(&rank).cloned();
    match failure {
        Some(Failure::Quota) => {
            return cloud_error(
                409,
                "ContainerGroupQuotaReached",
                "Resource type 'Microsoft.ContainerInstance/containerGroups' container group quota \
                 'StandardCores' exceeded in region 'eastus'. Limit: '10', Usage: '8', Requested: '2'.",
            );
        }
        Some(Failure::ImageRefused) => {
            let image = body["properties"]["containers"][0]["properties"]["image"]
                .as_str()
                .unwrap_or("")
                .to_string();
            return cloud_error(
                400,
                "InaccessibleImage",
                &format!(
                    "The image '{image}' in container group '{name}' is not accessible. Please check the image and registry credential."
                ),
            );
        }
        _ => {}
    }
    if st.groups.contains_key(name) {
        st.violations
            .push(format!("PUT {name}: the group exists already"));
    }
    st.created.push(name.to_string());
    st.groups.insert(
        name.to_string(),
        Group {
            rank,
            body,
            state: "Creating",
            failure,
        },
    );
    let id = new_op(st, name, "create");
    let mut headers = vec![("Retry-After", "0".to_string())];
    match (st.script.lro, st.script.foreign_operation_url) {
        (Lro::AsyncOperation, true) => headers.push((
            "Azure-AsyncOperation",
            format!("http://203.0.113.7/operations/{id}?api-version=2026-05-01"),
        )),
        (Lro::AsyncOperation, false) => headers.push((
            "Azure-AsyncOperation",
            format!("{base}/operations/{id}?api-version=2026-05-01"),
        )),
        (Lro::Location, _) => headers.push((
            "Location",
            format!("{base}/operationResults/{id}?api-version=2026-05-01"),
        )),
    }
    let g = &st.groups[name];
    reply(201, Some(&view(name, g)), &headers)
}

fn new_op(st: &mut State, group: &str, kind: &'static str) -> u64 {
    let id = st.next_op;
    st.next_op += 1;
    let polls_left = st.script.polls;
    st.ops.insert(
        id,
        Op {
            group: group.to_string(),
            polls_left,
            kind,
        },
    );
    id
}

fn poll_operation(st: &mut State, id: u64, location_style: bool) -> Response<Full<Bytes>> {
    let Some(op) = st.ops.get_mut(&id) else {
        st.violations
            .push(format!("poll of unknown operation {id}"));
        return cloud_error(404, "NotFound", "no such operation");
    };
    if op.polls_left > 0 {
        op.polls_left -= 1;
        let headers = [("Retry-After", "0".to_string())];
        return if location_style {
            reply(202, None, &headers)
        } else {
            reply(200, Some(&json!({"status": "InProgress"})), &headers)
        };
    }
    let (group, kind) = (op.group.clone(), op.kind);
    if kind == "delete" {
        return reply(200, None, &[]);
    }
    let Some(g) = st.groups.get_mut(&group) else {
        return reply(200, Some(&json!({"status": "Canceled"})), &[]);
    };
    let failed = matches!(g.failure, Some(Failure::ImagePullFails));
    g.state = if failed { "Failed" } else { "Succeeded" };
    match (failed, location_style) {
        (true, false) => reply(
            200,
            Some(&json!({"status": "Failed", "error": {
                "code": "ResourceDeploymentFailure",
                "message": "The resource operation completed with terminal provisioning state 'Failed'."
            }})),
            &[],
        ),
        (true, true) => cloud_error(
            400,
            "ResourceDeploymentFailure",
            "The resource operation completed with terminal provisioning state 'Failed'.",
        ),
        (false, false) => reply(200, Some(&json!({"status": "Succeeded"})), &[]),
        (false, true) => {
            let v = view(&group, &st.groups[&group]);
            reply(200, Some(&v), &[])
        }
    }
}

/// A group as GET returns it: the request without secret values, plus state, IP and events.
fn view(name: &str, g: &Group) -> Value {
    let mut v = g.body.clone();
    v["id"] = json!(format!(
        "/subscriptions/{SUBSCRIPTION}/resourceGroups/{RESOURCE_GROUP}/providers/Microsoft.ContainerInstance/containerGroups/{name}"
    ));
    v["name"] = json!(name);
    v["type"] = json!("Microsoft.ContainerInstance/containerGroups");
    let props = &mut v["properties"];
    if let Some(vols) = props["volumes"].as_array_mut() {
        for vol in vols {
            if vol.get("secret").is_some() {
                vol["secret"] = json!({});
            }
        }
    }
    props["provisioningState"] = json!(g.state);
    let (runtime, events) = match g.state {
        "Succeeded" => ("Running", json!([])),
        "Failed" => (
            "Failed",
            json!([{"count": 3, "name": "Failed", "type": "Warning",
                    "message": format!("Failed to pull image \"{}\": manifest unknown",
                        props["containers"][0]["properties"]["image"].as_str().unwrap_or(""))}]),
        ),
        _ => ("Pending", json!([])),
    };
    props["instanceView"] = json!({"state": runtime, "events": []});
    props["containers"][0]["properties"]["instanceView"] = json!({
        "restartCount": 0,
        "currentState": {"state": if runtime == "Running" { "Running" } else { "Waiting" },
                         "detailStatus": if runtime == "Failed" { "ErrImagePull" } else { "" }},
        "events": events
    });
    props["ipAddress"]["ip"] = json!(format!("10.1.0.{}", 4 + g.rank));
    v
}

fn list(st: &mut State, base: &str, query: &str) -> Response<Full<Bytes>> {
    let skip: usize = query_param(query, "$skiptoken")
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let page = st.script.page_size;
    let all: Vec<Value> = st
        .groups
        .iter()
        .map(|(name, g)| {
            let mut v = view(name, g);
            // Lists carry no instance view.
            v["properties"]
                .as_object_mut()
                .unwrap()
                .remove("instanceView");
            v
        })
        .collect();
    let items: Vec<Value> = all.iter().skip(skip).take(page).cloned().collect();
    let mut body = json!({ "value": items });
    if skip + page < all.len() {
        body["nextLink"] = json!(format!(
            "{base}{}?api-version=2026-05-01&$skiptoken={}",
            groups_prefix(),
            skip + page
        ));
    }
    reply(200, Some(&body), &[])
}

fn delete(st: &mut State, base: &str, name: &str) -> Response<Full<Bytes>> {
    if st.groups.remove(name).is_none() {
        return reply(204, None, &[]);
    }
    st.deleted.push(name.to_string());
    match st.script.lro {
        Lro::AsyncOperation => reply(200, Some(&json!({"name": name})), &[]),
        Lro::Location => {
            let id = new_op(st, name, "delete");
            reply(
                202,
                None,
                &[
                    (
                        "Location",
                        format!("{base}/operationResults/{id}?api-version=2026-05-01"),
                    ),
                    ("Retry-After", "0".to_string()),
                ],
            )
        }
    }
}
