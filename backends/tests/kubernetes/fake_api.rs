//! A small in-process Kubernetes API server behind kube-rs's `tower_test::mock` service: it keeps the
//! objects it is sent, makes up pods for a resumed Job from a script (per poll, per rank), and records
//! every request, create and delete so tests can check what a launch did and what it left behind.
//!
//! Where the script gives the cluster's nodes, it also schedules as kube-scheduler filters: a resumed
//! Job's pods fit a node only if its labels match their `nodeSelector` and required node affinity, they
//! tolerate each of its NoSchedule and NoExecute taints (the API's `ToleratesTaint` rule), and its
//! allocatable holds their requests; where no node fits, every pod stays Pending with the PodScheduled
//! condition False, reason Unschedulable, and kube-scheduler's message, whatever the script says.
//!
//! Deleting an object garbage-collects, at once, every stored object whose `ownerReferences` name its
//! uid (background propagation, as the backend asks), recursively, as Kubernetes' collector does.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use kube::client::Body;
use serde_json::{Value, json};

pub const NS: &str = "physalia";

/// What the pod of one rank looks like at one poll.
#[derive(Clone, Debug)]
pub enum PodState {
    /// No pod yet.
    Absent,
    Pending,
    Unschedulable(&'static str),
    Running,
    ImagePull(&'static str),
    Failed(i32),
}

/// How the fake answers.
pub struct Script {
    /// `(poll, rank) -> state`; polls count from 0 after the Job is resumed.
    pub pods: Box<dyn Fn(usize, usize) -> PodState + Send>,
    /// Creates of this resource (`jobs`, `secrets`, `services`) are refused with this code and message.
    pub refuse_create: Option<(&'static str, u16, &'static str, String)>,
    /// Events in the namespace (the Job controller's FailedCreate, for instance).
    pub events: Vec<Value>,
    /// The coordinator Job's pod at each poll (polls of the coordinator's pods count from 0).
    pub coordinator: Box<dyn Fn(usize) -> PodState + Send>,
    /// The cluster's nodes, as `GET /api/v1/nodes` lists them; `None`: listing nodes is forbidden
    /// (403, as for a ServiceAccount whose Roles are namespaced).
    pub nodes: Option<Vec<Value>>,
}

impl Default for Script {
    fn default() -> Self {
        Script {
            pods: Box::new(|poll, _| {
                if poll == 0 {
                    PodState::Pending
                } else {
                    PodState::Running
                }
            }),
            refuse_create: None,
            events: Vec::new(),
            coordinator: Box::new(|poll| {
                if poll == 0 {
                    PodState::Pending
                } else {
                    PodState::Running
                }
            }),
            nodes: None,
        }
    }
}

#[derive(Default)]
pub struct Record {
    /// `METHOD path?query`, in order.
    pub requests: Vec<String>,
    /// `resource/name` of every object created, and the bodies as sent.
    pub created: Vec<String>,
    pub bodies: Vec<Value>,
    /// `resource/name` of every delete that found its object.
    pub deleted: Vec<String>,
    /// Merge patches sent, as `(name, patch)`.
    pub patches: Vec<(String, Value)>,
    /// Objects still stored, `resource/name`.
    pub live: BTreeMap<String, Value>,
    /// Requests the fake did not understand.
    pub unexpected: Vec<String>,
    /// `(apiGroup, resource, verb)` of every request, as the API server's authorizer sees it.
    pub access: std::collections::BTreeSet<(String, String, String)>,
}

pub struct FakeApi {
    pub record: Arc<Mutex<Record>>,
}

impl FakeApi {
    /// Starts the fake on the current runtime; returns a client talking to it.
    pub fn start(script: Script) -> (kube::Client, FakeApi) {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let record = Arc::new(Mutex::new(Record::default()));
        let rec = record.clone();
        tokio::spawn(async move {
            let mut server = Server {
                script,
                record: rec,
                resumed: None,
                unschedulable: None,
                polls: 0,
                coordinator_polls: 0,
                uid: 0,
            };
            while let Some((request, send)) = handle.next_request().await {
                let response = server.handle(request).await;
                send.send_response(response);
            }
        });
        (kube::Client::new(service, NS), FakeApi { record })
    }

    pub fn record(&self) -> std::sync::MutexGuard<'_, Record> {
        self.record.lock().unwrap()
    }
}

struct Server {
    script: Script,
    record: Arc<Mutex<Record>>,
    /// The resumed Job's name and completions.
    resumed: Option<(String, usize)>,
    /// Why no node takes the resumed Job's pods, as kube-scheduler words it (nodes scripted only).
    unschedulable: Option<String>,
    polls: usize,
    coordinator_polls: usize,
    uid: u32,
}

fn respond(code: StatusCode, body: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Body::from(serde_json::to_vec(body).unwrap()))
        .unwrap()
}

fn status(code: u16, reason: &str, message: &str) -> Response<Body> {
    respond(
        StatusCode::from_u16(code).unwrap(),
        &json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code
        }),
    )
}

impl Server {
    async fn handle(&mut self, req: Request<Body>) -> Response<Body> {
        let method = req.method().clone();
        let path = req.uri().path().to_string();
        let query = req.uri().query().unwrap_or("").to_string();
        let bytes = req.into_body().collect().await.unwrap().to_bytes();
        let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        self.record
            .lock()
            .unwrap()
            .requests
            .push(format!("{method} {path}?{query}"));

        // cluster-scoped, outside the namespaced Role's reach
        if method == Method::GET && path == "/api/v1/nodes" {
            return match &self.script.nodes {
                Some(items) => respond(
                    StatusCode::OK,
                    &json!({"apiVersion": "v1", "kind": "NodeList", "metadata": {}, "items": items}),
                ),
                None => status(
                    403,
                    "Forbidden",
                    "nodes is forbidden: User \"system:serviceaccount:physalia:physalia-coordinator\" \
                     cannot list resource \"nodes\" in API group \"\" at the cluster scope",
                ),
            };
        }
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        // /api/v1/namespaces/NS/RES[/NAME[/SUB]] or /apis/batch/v1/namespaces/NS/RES[/NAME]
        let (group, rest) = match parts.as_slice() {
            ["api", "v1", "namespaces", ns, rest @ ..] if *ns == NS => ("", rest),
            ["apis", "batch", "v1", "namespaces", ns, rest @ ..] if *ns == NS => ("batch", rest),
            _ => return self.unexpected(&method, &path),
        };
        // The authorizer's view: resource (with subresource), verb.
        let resource = match rest {
            [res, _, sub] => format!("{res}/{sub}"),
            [res, ..] => res.to_string(),
            [] => String::new(),
        };
        let verb = match (&method, rest.len()) {
            (&Method::GET, 1) => "list",
            (&Method::GET, _) => "get",
            (&Method::POST, _) => "create",
            (&Method::PATCH, _) => "patch",
            (&Method::PUT, _) => "update",
            (&Method::DELETE, 1) => "deletecollection",
            (&Method::DELETE, _) => "delete",
            _ => "unknown",
        };
        self.record
            .lock()
            .unwrap()
            .access
            .insert((group.to_string(), resource, verb.to_string()));
        match (&method, rest) {
            (&Method::POST, [res]) => self.create(res, body),
            (&Method::PATCH, ["jobs", name]) => self.patch_job(name, body),
            (&Method::GET, ["jobs", name]) => self.get("jobs", name),
            (&Method::GET, ["pods"]) => self.list_pods(&query),
            (&Method::GET, ["events"]) => respond(
                StatusCode::OK,
                &json!({"apiVersion": "v1", "kind": "EventList", "metadata": {},
                        "items": self.script.events}),
            ),
            (&Method::GET, ["pods", name, "log"]) => Response::builder()
                .status(200)
                .body(Body::from(format!("log of {name}\n").into_bytes()))
                .unwrap(),
            (&Method::DELETE, [res, name]) => self.delete(res, name),
            _ => self.unexpected(&method, &path),
        }
    }

    fn unexpected(&mut self, method: &Method, path: &str) -> Response<Body> {
        self.record
            .lock()
            .unwrap()
            .unexpected
            .push(format!("{method} {path}"));
        status(404, "NotFound", "the fake API does not serve this")
    }

    fn create(&mut self, res: &str, mut body: Value) -> Response<Body> {
        if let Some((r, code, reason, message)) = &self.script.refuse_create
            && *r == res
        {
            return status(*code, reason, message);
        }
        let name = body["metadata"]["name"].as_str().unwrap_or("").to_string();
        let key = format!("{res}/{name}");
        let mut rec = self.record.lock().unwrap();
        if rec.live.contains_key(&key) {
            return status(
                409,
                "AlreadyExists",
                &format!("{res} \"{name}\" already exists"),
            );
        }
        rec.created.push(key.clone());
        rec.bodies.push(body.clone());
        self.uid += 1;
        body["metadata"]["uid"] = json!(format!("00000000-0000-0000-0000-{:012}", self.uid));
        body["metadata"]["resourceVersion"] = json!("1");
        rec.live.insert(key, body.clone());
        respond(StatusCode::CREATED, &body)
    }

    fn patch_job(&mut self, name: &str, patch: Value) -> Response<Body> {
        let mut rec = self.record.lock().unwrap();
        rec.patches.push((name.to_string(), patch.clone()));
        let Some(job) = rec.live.get_mut(&format!("jobs/{name}")) else {
            return status(404, "NotFound", &format!("jobs.batch \"{name}\" not found"));
        };
        if patch["spec"]["suspend"] == json!(false) {
            job["spec"]["suspend"] = json!(false);
            let n = job["spec"]["completions"].as_u64().unwrap() as usize;
            self.resumed = Some((name.to_string(), n));
            self.unschedulable = self
                .script
                .nodes
                .as_ref()
                .and_then(|nodes| unschedulable(&job["spec"]["template"]["spec"], nodes));
        }
        let job = job.clone();
        respond(StatusCode::OK, &job)
    }

    fn get(&mut self, res: &str, name: &str) -> Response<Body> {
        match self
            .record
            .lock()
            .unwrap()
            .live
            .get(&format!("{res}/{name}"))
        {
            Some(obj) => respond(StatusCode::OK, obj),
            None => status(404, "NotFound", &format!("{res} \"{name}\" not found")),
        }
    }

    /// Pods matching the request's `labelSelector` (one `key=value`, as the backend sends): the
    /// resumed worker Job's, from the script, and the coordinator Job's while it exists.
    fn list_pods(&mut self, query: &str) -> Response<Body> {
        let selector = query
            .split('&')
            .find_map(|kv| kv.strip_prefix("labelSelector="))
            .map(|v| {
                v.replace("%2F", "/")
                    .replace("%2f", "/")
                    .replace("%3D", "=")
                    .replace("%3d", "=")
            });
        let selected = |pod: &Value| match selector.as_deref().and_then(|s| s.split_once('=')) {
            Some((k, v)) => pod["metadata"]["labels"][k] == json!(v),
            None => true,
        };
        let mut items = Vec::new();
        let coordinators: Vec<String> = self
            .record
            .lock()
            .unwrap()
            .live
            .iter()
            .filter(|(k, job)| {
                k.starts_with("jobs/")
                    && job["metadata"]["labels"]["app.kubernetes.io/component"] == "coordinator"
            })
            .map(|(k, _)| k["jobs/".len()..].to_string())
            .collect();
        for job in coordinators {
            let state = (self.script.coordinator)(self.coordinator_polls);
            if let Some(pod) = coordinator_pod(&job, &state)
                && selected(&pod)
            {
                items.push(pod);
            }
        }
        if selector
            .as_deref()
            .is_some_and(|s| s.starts_with("physalia.dev/coordinator="))
        {
            self.coordinator_polls += 1;
        }
        if let Some((job, n)) = &self.resumed {
            let deleted = &self.record.lock().unwrap().deleted;
            for rank in 0..*n {
                let pod_name = format!("{job}-{rank}-x7k2p");
                if deleted.contains(&format!("pods/{pod_name}")) {
                    continue;
                }
                let state = (self.script.pods)(self.polls, rank);
                let made = match &self.unschedulable {
                    // the Job controller makes the pod; no node takes it
                    Some(why) => pod(job, rank, &pod_name, &PodState::Pending).map(|mut p| {
                        p["status"]["containerStatuses"] = json!([]);
                        p["status"]["conditions"] = json!([{"type": "PodScheduled",
                            "status": "False", "reason": "Unschedulable", "message": why}]);
                        p
                    }),
                    None => pod(job, rank, &pod_name, &state),
                };
                if let Some(pod) = made
                    && selected(&pod)
                {
                    items.push(pod);
                }
            }
            if selector
                .as_deref()
                .is_none_or(|s| s.starts_with("physalia.dev/launch="))
            {
                self.polls += 1;
            }
        }
        respond(
            StatusCode::OK,
            &json!({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "1"},
                    "items": items}),
        )
    }

    fn delete(&mut self, res: &str, name: &str) -> Response<Body> {
        let key = format!("{res}/{name}");
        let mut rec = self.record.lock().unwrap();
        if res == "pods" {
            rec.deleted.push(key);
            return respond(
                StatusCode::OK,
                &json!({"kind": "Status", "apiVersion": "v1",
                "metadata": {}, "status": "Success"}),
            );
        }
        match rec.live.remove(&key) {
            Some(obj) => {
                rec.deleted.push(key);
                collect_dependants(&mut rec, &obj);
                respond(StatusCode::OK, &obj)
            }
            None => status(404, "NotFound", &format!("{res} \"{name}\" not found")),
        }
    }
}

/// The garbage collector: every stored object with an owner reference to `owner`'s uid is deleted,
/// and its own dependants after it.
fn collect_dependants(rec: &mut Record, owner: &Value) {
    let Some(uid) = owner["metadata"]["uid"].as_str() else {
        return;
    };
    let owned: Vec<String> = rec
        .live
        .iter()
        .filter(|(_, o)| {
            o["metadata"]["ownerReferences"]
                .as_array()
                .is_some_and(|refs| refs.iter().any(|r| r["uid"] == json!(uid)))
        })
        .map(|(k, _)| k.clone())
        .collect();
    for key in owned {
        if let Some(obj) = rec.live.remove(&key) {
            rec.deleted.push(key);
            collect_dependants(rec, &obj);
        }
    }
}

/// A quantity as a number (CPU in cores, memory in bytes, counts as they are).
fn quantity(q: &Value) -> f64 {
    let text = match q {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        _ => return 0.0,
    };
    let units = [
        ("Ki", 1024f64),
        ("Mi", 1024f64.powi(2)),
        ("Gi", 1024f64.powi(3)),
        ("Ti", 1024f64.powi(4)),
        ("m", 1e-3),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
    ];
    for (suffix, scale) in units {
        if let Some(n) = text.strip_suffix(suffix) {
            return n.parse::<f64>().unwrap_or(f64::NAN) * scale;
        }
    }
    text.parse().unwrap_or(f64::NAN)
}

/// Whether `tolerations` tolerate `taint`, by the API's rule (core/v1 `Toleration.ToleratesTaint`):
/// a given effect must be the taint's, a given key the taint's (an empty key with `Exists` takes
/// every taint), `Equal` (the default) compares values, `Exists` takes any.
fn tolerated(tolerations: &Value, taint: &Value) -> bool {
    let text = |v: &Value| v.as_str().unwrap_or("").to_string();
    tolerations.as_array().into_iter().flatten().any(|t| {
        let (effect, key) = (text(&t["effect"]), text(&t["key"]));
        if !effect.is_empty() && effect != text(&taint["effect"]) {
            return false;
        }
        if !key.is_empty() && key != text(&taint["key"]) {
            return false;
        }
        match text(&t["operator"]).as_str() {
            "" | "Equal" => text(&t["value"]) == text(&taint["value"]),
            "Exists" => true,
            _ => false,
        }
    })
}

/// Why a pod of this spec fits none of `nodes`, in kube-scheduler's words (`0/6 nodes are available:
/// 3 node(s) didn't match Pod's node affinity/selector, 3 node(s) had untolerated taint {sku: gpu}.`);
/// `None` when one node takes it.
fn unschedulable(pod: &Value, nodes: &[Value]) -> Option<String> {
    let mut why: BTreeMap<String, usize> = BTreeMap::new();
    let mut requests: BTreeMap<String, f64> = BTreeMap::new();
    for c in pod["containers"].as_array().into_iter().flatten() {
        for (k, v) in c["resources"]["requests"].as_object().into_iter().flatten() {
            *requests.entry(k.clone()).or_default() += quantity(v);
        }
    }
    let terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"]
        .as_array();
    for node in nodes {
        let labels = &node["metadata"]["labels"];
        let selector_ok = pod["nodeSelector"]
            .as_object()
            .into_iter()
            .flatten()
            .all(|(k, v)| &labels[k] == v);
        let term_ok = |term: &Value| {
            term["matchExpressions"]
                .as_array()
                .into_iter()
                .flatten()
                .all(|e| {
                    let have = labels[e["key"].as_str().unwrap_or("")].as_str();
                    let values: Vec<&str> = (e["values"].as_array().into_iter().flatten())
                        .filter_map(Value::as_str)
                        .collect();
                    match e["operator"].as_str() {
                        Some("In") => have.is_some_and(|h| values.contains(&h)),
                        Some("NotIn") => have.is_none_or(|h| !values.contains(&h)),
                        Some("Exists") => have.is_some(),
                        Some("DoesNotExist") => have.is_none(),
                        _ => false,
                    }
                })
        };
        let affinity_ok = terms.is_none_or(|ts| ts.iter().any(term_ok));
        let repelling = node["spec"]["taints"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|t| {
                matches!(t["effect"].as_str(), Some("NoSchedule" | "NoExecute"))
                    && !tolerated(&pod["tolerations"], t)
            });
        let short = requests
            .iter()
            .find(|(k, want)| **want > quantity(&node["status"]["allocatable"][k.as_str()]) + 1e-9);
        let reason = if !selector_ok || !affinity_ok {
            "node(s) didn't match Pod's node affinity/selector".to_string()
        } else if let Some(t) = repelling {
            format!(
                "node(s) had untolerated taint {{{}: {}}}",
                t["key"].as_str().unwrap_or(""),
                t["value"].as_str().unwrap_or("")
            )
        } else if let Some((k, _)) = short {
            format!("Insufficient {k}")
        } else {
            return None;
        };
        *why.entry(reason).or_default() += 1;
    }
    Some(format!(
        "0/{} nodes are available: {}.",
        nodes.len(),
        why.iter()
            .map(|(r, n)| format!("{n} {r}"))
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

/// The coordinator Job's pod, `<job>-c0d3r`, in `state`.
fn coordinator_pod(job: &str, state: &PodState) -> Option<Value> {
    let mut pod = pod(job, 0, &format!("{job}-c0d3r"), state)?;
    pod["metadata"]["labels"] = json!({"physalia.dev/coordinator": job});
    pod["metadata"]["annotations"] = json!({});
    pod["spec"] = json!({"containers": [{"name": "coordinator"}]});
    if let Some(cs) = pod["status"]["containerStatuses"].as_array_mut() {
        for c in cs {
            c["name"] = json!("coordinator");
        }
    }
    pod["status"]["podIP"] = match state {
        PodState::Running | PodState::Failed(_) => json!("10.244.0.5"),
        _ => Value::Null,
    };
    Some(pod)
}

fn pod(job: &str, rank: usize, name: &str, state: &PodState) -> Option<Value> {
    let waiting = |reason: &str, message: &str| {
        json!([{"name": "worker", "image": "img", "imageID": "", "ready": false, "restartCount": 0,
                "state": {"waiting": {"reason": reason, "message": message}}}])
    };
    let (phase, ip, containers, conditions) = match state {
        PodState::Absent => return None,
        PodState::Pending => ("Pending", None, waiting("ContainerCreating", ""), json!([])),
        PodState::Unschedulable(msg) => (
            "Pending",
            None,
            json!([]),
            json!([{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                    "message": msg}]),
        ),
        PodState::ImagePull(msg) => ("Pending", None, waiting("ErrImagePull", msg), json!([])),
        PodState::Running => (
            "Running",
            Some(format!("10.244.1.{}", 10 + rank)),
            json!([{"name": "worker", "image": "img", "imageID": "", "ready": true,
                    "restartCount": 0, "state": {"running": {}}}]),
            json!([]),
        ),
        PodState::Failed(code) => (
            "Failed",
            Some(format!("10.244.1.{}", 10 + rank)),
            json!([{"name": "worker", "image": "img", "imageID": "", "ready": false,
                    "restartCount": 0,
                    "state": {"terminated": {"exitCode": code, "reason": "Error"}}}]),
            json!([]),
        ),
    };
    let index = rank.to_string();
    Some(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name, "namespace": NS,
            "creationTimestamp": "2026-11-21T00:00:00Z",
            "labels": {"physalia.dev/launch": job, "batch.kubernetes.io/job-completion-index": index},
            "annotations": {"batch.kubernetes.io/job-completion-index": index}
        },
        "spec": {"hostname": format!("{job}-{rank}"), "subdomain": job,
                 "containers": [{"name": "worker"}]},
        "status": {"phase": phase, "podIP": ip, "containerStatuses": containers,
                   "conditions": conditions}
    }))
}
