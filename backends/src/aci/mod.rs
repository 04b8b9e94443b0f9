//! The aci backend: Azure Container Instances through the ARM REST API (api-version [`API_VERSION`]), one
//! container group per worker, CPU only.
//!
//! There is no Rust management client for Container Instances, so this is plain HTTPS (reqwest, rustls)
//! with a bearer token from a [`TokenProvider`]. A launch PUTs every rank's group (at most
//! [`AciConfig::max_parallel`] at a time), follows each long-running operation (`Azure-AsyncOperation`,
//! else `Location`, honouring `Retry-After`), then GETs the group for its state and private IP. The first
//! failure stops new PUTs; the ones in flight finish; then every group the launch tried to create is
//! DELETEd (and those deletions followed to the end), so a failed launch leaves nothing running or billing.
//!
//! ACI retired its GPU SKUs on 14 July 2025: a GPU request is refused before any call, pointing to the
//! kubernetes backend (AKS) or ecs.
//!
//! The bearer token is only ever sent to the configured endpoint's origin: a long-running-operation URL
//! on another host is refused rather than followed.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use reqwest::header::{HeaderMap, RETRY_AFTER};
use reqwest::{Method, StatusCode, Url};
use serde_json::Value;

use crate::error::{BackendName, Error, Result};
use crate::{
    Backend, CoordinatorHandle, CoordinatorSpec, CoordinatorStatus, Demand, LaunchId, Launched,
    PlatformObject, WorkerSpec, WorkerState, WorkerStatus,
};

/// The kind of the coordinator's one object in its [`CoordinatorHandle`].
const KIND_GROUP: &str = "container-group";

pub mod body;
pub mod token;

pub use token::{
    ARM_SCOPE, AzCliToken, DefaultAzureToken, ManagedIdentityToken, StaticToken, TokenProvider,
};

const NAME: BackendName = "aci";
pub const API_VERSION: &str = "2026-05-01";

/// Pulls the image from a private registry (Azure Container Registry) as a user-assigned identity that
/// holds `AcrPull` on it; no registry password is ever sent.
#[derive(Clone, Debug)]
pub struct RegistryPull {
    /// e.g. `physalia.azurecr.io`.
    pub server: String,
    /// Resource id of the user-assigned identity.
    pub identity_id: String,
}

#[derive(Clone, Debug)]
pub struct AciConfig {
    pub subscription_id: String,
    pub resource_group: String,
    /// Azure region of the groups, e.g. `eastus`; the subnet must be in it.
    pub location: String,
    /// Resource id of the subnet (delegated to `Microsoft.ContainerInstance/containerGroups`) the workers
    /// and the coordinator share; `infra/azure` creates it.
    pub subnet_id: String,
    pub registry: Option<RegistryPull>,
    /// Resource id of the coordinator's user-assigned managed identity (`infra/azure`'s
    /// `azurerm_user_assigned_identity.coordinator`, output `coordinator_identity_id`): cluster mode's
    /// coordinator group runs as it.
    pub coordinator_identity_id: Option<String>,
    /// The ARM endpoint; tests point it at a loopback server.
    pub endpoint: String,
    /// Container groups created at once.
    pub max_parallel: usize,
    /// Wait between polls of a long-running operation when the server gives no `Retry-After`.
    pub poll_interval: Duration,
    /// Upper bound on any `Retry-After` the server asks for, while polling or when throttled, and on the
    /// backoff between throttled attempts.
    pub max_poll_interval: Duration,
    /// Attempts of one ARM request that ARM throttles (429, or 503 with `Retry-After`), the first
    /// included; then the call fails with [`Error::Throttled`].
    pub throttle_attempts: u32,
    /// How long one ARM request may keep being throttled, waits included; a wait that would pass it is
    /// not started and the call fails with [`Error::Throttled`].
    pub throttle_budget: Duration,
    /// First wait after a throttled answer without `Retry-After`; later ones double (capped by
    /// `max_poll_interval`), with jitter.
    pub throttle_backoff: Duration,
    /// How long one long-running operation (a create, a delete) may take.
    pub operation_timeout: Duration,
    /// How long one HTTP request may take.
    pub request_timeout: Duration,
}

impl AciConfig {
    /// The defaults for a subscription, resource group, region and subnet.
    pub fn new(
        subscription_id: impl Into<String>,
        resource_group: impl Into<String>,
        location: impl Into<String>,
        subnet_id: impl Into<String>,
    ) -> AciConfig {
        AciConfig {
            subscription_id: subscription_id.into(),
            resource_group: resource_group.into(),
            location: location.into(),
            subnet_id: subnet_id.into(),
            registry: None,
            coordinator_identity_id: None,
            endpoint: "https://management.azure.com".into(),
            max_parallel: 8,
            poll_interval: Duration::from_secs(5),
            max_poll_interval: Duration::from_secs(30),
            throttle_attempts: 10,
            throttle_budget: Duration::from_secs(300),
            throttle_backoff: Duration::from_secs(1),
            operation_timeout: Duration::from_secs(900),
            request_timeout: Duration::from_secs(60),
        }
    }
}

pub struct AciBackend {
    http: reqwest::Client,
    cfg: AciConfig,
    endpoint: Url,
    token: Arc<dyn TokenProvider>,
}

/// Why a rank's launch did not happen: a real failure, or skipped because another rank failed first.
enum RankFailure {
    Failed(Error),
    Skipped,
}

impl AciBackend {
    pub fn new(cfg: AciConfig, token: Arc<dyn TokenProvider>) -> Result<AciBackend> {
        let config_err = |detail: String| Error::Config {
            backend: NAME,
            detail,
        };
        let endpoint = Url::parse(&cfg.endpoint)
            .map_err(|e| config_err(format!("endpoint {:?} is not a URL: {e}", cfg.endpoint)))?;
        for (field, value) in [
            ("subscription_id", &cfg.subscription_id),
            ("resource_group", &cfg.resource_group),
            ("location", &cfg.location),
            ("subnet_id", &cfg.subnet_id),
        ] {
            if value.trim().is_empty() {
                return Err(config_err(format!(
                    "{field} is empty (infra/azure's outputs give all four)"
                )));
            }
        }
        if cfg.max_parallel == 0 {
            return Err(config_err("max_parallel is 0".into()));
        }
        if cfg.throttle_attempts == 0 {
            return Err(config_err(
                "throttle_attempts is 0 (1 sends each request once)".into(),
            ));
        }
        let http = reqwest::Client::builder()
            .timeout(cfg.request_timeout)
            .build()
            .map_err(|e| config_err(format!("building the HTTP client: {e}")))?;
        Ok(AciBackend {
            http,
            cfg,
            endpoint,
            token,
        })
    }

    fn groups_url(&self) -> String {
        format!(
            "{}/subscriptions/{}/resourceGroups/{}/providers/Microsoft.ContainerInstance/containerGroups",
            self.cfg.endpoint.trim_end_matches('/'),
            self.cfg.subscription_id,
            self.cfg.resource_group
        )
    }

    /// ACI's regional quotas (Location - List Usage): the job's peak in standard cores and in container
    /// groups must fit what is left of each (limit less current usage) in the backend's location. A
    /// principal that may not read usage (403) is not checked: the PUT then fails with ARM's reason.
    async fn check_quota(&self, spec: &WorkerSpec, demand: Demand) -> Result<()> {
        let op = format!("list ACI usage in {}", self.cfg.location);
        let url = format!(
            "{}/subscriptions/{}/providers/Microsoft.ContainerInstance/locations/{}/usages?api-version={API_VERSION}",
            self.cfg.endpoint.trim_end_matches('/'),
            self.cfg.subscription_id,
            self.cfg.location
        );
        let resp = self.send(Method::GET, &url, None, &op).await?;
        let usage = match self.json(resp, &op).await {
            Ok(v) => v,
            // not allowed to read usage, or no usage for this location: the PUT says why if it must
            Err(Error::Permission { .. }) => return Ok(()),
            Err(Error::Api {
                status: Some(404), ..
            }) => return Ok(()),
            Err(e) => return Err(e),
        };
        let peak = demand.peak_workers();
        let workers = f64::from(peak);
        let note = demand.overlap_note();
        for (name, need, what) in [
            (
                "StandardCores",
                workers * spec.cpu,
                format!("{peak} workers of {} cores each{note}", spec.cpu),
            ),
            (
                "ContainerGroups",
                workers,
                format!("{peak} workers, one group each{note}"),
            ),
        ] {
            let Some(u) = usage["value"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|u| u["name"]["value"].as_str() == Some(name))
            else {
                continue;
            };
            let (Some(limit), current) = (u["limit"].as_f64(), u["currentValue"].as_f64()) else {
                continue;
            };
            let current = current.unwrap_or(0.0);
            let free = (limit - current).max(0.0);
            if need > free {
                let label = u["name"]["localizedValue"].as_str().unwrap_or(name);
                return Err(Error::Quota {
                    backend: NAME,
                    rank: None,
                    detail: format!(
                        "the subscription's ACI quota \"{label}\" ({name}) in {} is {limit} with \
                         {current} in use, and this job needs {need} at its peak ({what}): request \
                         an increase (Azure portal: Quotas, Container Instances), or run fewer or \
                         smaller workers; nothing was created",
                        self.cfg.location
                    ),
                });
            }
        }
        Ok(())
    }

    fn group_url(&self, group: &str) -> String {
        format!("{}/{group}?api-version={API_VERSION}", self.groups_url())
    }

    /// One authenticated ARM request, retried while ARM throttles it: every call the backend makes (PUT,
    /// GET, list, DELETE, logs, the polls of a long-running operation) goes through here.
    ///
    /// ARM throttles per principal and subscription (and the resource provider per region) and answers
    /// 429 Too Many Requests with `Retry-After` in seconds; it also answers 503 with `Retry-After` when
    /// busy. Such an answer is retried after the server's `Retry-After` (capped by
    /// [`AciConfig::max_poll_interval`]), or, without one, after an exponential backoff with jitter from
    /// [`AciConfig::throttle_backoff`]; at most [`AciConfig::throttle_attempts`] attempts within
    /// [`AciConfig::throttle_budget`], then [`Error::Throttled`] with the status, the attempts and the
    /// time spent. Any other answer (a 503 without `Retry-After` included) is returned as it is.
    ///
    /// Retrying is safe for every request the backend sends: GETs and lists read; a PUT of a container
    /// group is create-or-update by name in ARM (sending the same body again gives the same group, and a
    /// throttled request was not carried out at all); a DELETE is idempotent (a group already gone
    /// answers 204, which [`Self::delete_group`] takes as done).
    async fn send(
        &self,
        method: Method,
        url: &str,
        body: Option<&Value>,
        operation: &str,
    ) -> Result<reqwest::Response> {
        let started = tokio::time::Instant::now();
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let resp = self.send_once(method.clone(), url, body, operation).await?;
            let status = resp.status();
            let retry_after = retry_after(resp.headers());
            let throttled = status == StatusCode::TOO_MANY_REQUESTS
                || (status == StatusCode::SERVICE_UNAVAILABLE && retry_after.is_some());
            if !throttled {
                return Ok(resp);
            }
            let wait = match retry_after {
                Some(d) => d.min(self.cfg.max_poll_interval),
                None => backoff(
                    self.cfg.throttle_backoff,
                    self.cfg.max_poll_interval,
                    attempts,
                ),
            };
            let spent = started.elapsed();
            if attempts >= self.cfg.throttle_attempts || spent + wait > self.cfg.throttle_budget {
                let remaining = ratelimit_remaining(resp.headers());
                let text = resp.text().await.unwrap_or_default();
                let (code, message) = cloud_error(&text);
                let said = [code, message]
                    .into_iter()
                    .flatten()
                    .collect::<Vec<_>>()
                    .join(": ");
                let why = if attempts >= self.cfg.throttle_attempts {
                    format!("{attempts} attempts are the most allowed (throttle_attempts)")
                } else {
                    format!(
                        "waiting {:.1} s more would pass the throttle budget of {:.1} s",
                        wait.as_secs_f64(),
                        self.cfg.throttle_budget.as_secs_f64()
                    )
                };
                return Err(Error::Throttled {
                    backend: NAME,
                    operation: operation.into(),
                    attempts,
                    detail: format!(
                        "Azure Resource Manager answered HTTP {}{}{} to each of them for {:.1} s; {why}{}",
                        status.as_u16(),
                        status
                            .canonical_reason()
                            .map(|r| format!(" {r}"))
                            .unwrap_or_default(),
                        if said.is_empty() {
                            String::new()
                        } else {
                            format!(" ({said})")
                        },
                        spent.as_secs_f64(),
                        if remaining.is_empty() {
                            String::new()
                        } else {
                            format!("; remaining: {}", remaining.join(", "))
                        }
                    ),
                    hint: format!(
                        "ARM limits requests per principal ({}) and subscription: wait and \
                         resubmit, launch fewer groups at once (max_parallel), or look for \
                         another client of subscription {} using up the same limits",
                        self.token.describe(),
                        self.cfg.subscription_id
                    ),
                });
            }
            tokio::time::sleep(wait).await;
        }
    }

    /// One authenticated request, sent once. Transport failures become [`Error::Api`] without a status.
    async fn send_once(
        &self,
        method: Method,
        url: &str,
        body: Option<&Value>,
        operation: &str,
    ) -> Result<reqwest::Response> {
        let parsed = Url::parse(url).map_err(|e| Error::Api {
            backend: NAME,
            operation: operation.into(),
            status: None,
            detail: format!("bad URL {url:?}: {e}"),
        })?;
        if parsed.origin() != self.endpoint.origin() {
            return Err(Error::Api {
                backend: NAME,
                operation: operation.into(),
                status: None,
                detail: format!(
                    "the server pointed to {}, outside {}; not sending the token there",
                    parsed.origin().ascii_serialization(),
                    self.endpoint.origin().ascii_serialization()
                ),
            });
        }
        let token = self.token.token().await?;
        let mut req = self.http.request(method, parsed).bearer_auth(token);
        if let Some(b) = body {
            req = req
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(b.to_string());
        }
        req.send().await.map_err(|e| Error::Api {
            backend: NAME,
            operation: operation.into(),
            status: None,
            detail: format!("{e} (is {} reachable?)", self.cfg.endpoint),
        })
    }

    /// Reads a response's body as JSON, or maps its error status.
    async fn json(&self, resp: reqwest::Response, operation: &str) -> Result<Value> {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        if !status.is_success() {
            return Err(self.arm_error(status, &text, operation));
        }
        if text.trim().is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_str(&text).map_err(|e| Error::Api {
            backend: NAME,
            operation: operation.into(),
            status: Some(status.as_u16()),
            detail: format!("the response is not JSON: {e}"),
        })
    }

    /// An ARM error response (`{"error": {"code", "message"}}`) as the variant a user can act on.
    fn arm_error(&self, status: StatusCode, text: &str, operation: &str) -> Error {
        let (code, message) = cloud_error(text);
        let detail = match (&code, &message) {
            (Some(c), Some(m)) => format!("{c}: {m}"),
            (Some(c), None) => c.clone(),
            (None, Some(m)) => m.clone(),
            (None, None) => text.chars().take(500).collect(),
        };
        let code_lc = code.as_deref().unwrap_or("").to_ascii_lowercase();
        let rg = &self.cfg.resource_group;
        match status.as_u16() {
            401 => Error::Credentials {
                backend: NAME,
                credential: self.token.describe(),
                detail,
                hint: "the token is missing, expired or for another tenant: sign in again \
                       (`az login`) or check the coordinator's managed identity"
                    .into(),
            },
            403 if !code_lc.contains("quota") => Error::Permission {
                backend: NAME,
                action: format!("{operation} in resource group {rg}"),
                detail,
                hint: format!(
                    "give {} the role `Physalia ACI launcher` on resource group {rg} (infra/azure)",
                    self.token.describe()
                ),
            },
            404 if code_lc.contains("resourcegroup") || code_lc.contains("subscription") => {
                Error::Config {
                    backend: NAME,
                    detail: format!(
                        "{detail} (subscription {}, resource group {rg}; infra/azure creates it)",
                        self.cfg.subscription_id
                    ),
                }
            }
            _ if code_lc.contains("quota") => Error::Quota {
                backend: NAME,
                rank: None,
                detail: format!(
                    "{detail} (request more under Quotas > Container Instances for {})",
                    self.cfg.location
                ),
            },
            s => Error::Api {
                backend: NAME,
                operation: operation.into(),
                status: Some(s),
                detail,
            },
        }
    }

    fn wait_for(&self, headers: &HeaderMap) -> Duration {
        retry_after(headers)
            .unwrap_or(self.cfg.poll_interval)
            .min(self.cfg.max_poll_interval)
    }

    /// Follows a long-running operation to its end. `first` is the response that started it.
    /// `Err` carries the operation's own error when it ended Failed or Canceled.
    async fn follow(&self, first: reqwest::Response, operation: &str) -> Result<()> {
        let headers = first.headers().clone();
        let status = first.status();
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let started = tokio::time::Instant::now();
        let timed_out = || Error::Timeout {
            backend: NAME,
            what: operation.to_string(),
            waited_s: started.elapsed().as_secs(),
        };
        let mut wait = self.wait_for(&headers);
        if let Some(url) = header("azure-asyncoperation") {
            loop {
                tokio::time::sleep(wait).await;
                let resp = self.send(Method::GET, &url, None, operation).await?;
                wait = self.wait_for(resp.headers());
                let op = self.json(resp, operation).await?;
                match op["status"].as_str().unwrap_or("") {
                    "Succeeded" => return Ok(()),
                    s @ ("Failed" | "Canceled") => {
                        let text = op.to_string();
                        let err = self.arm_error(StatusCode::CONFLICT, &text, operation);
                        return Err(match err {
                            Error::Api { detail, .. } => Error::Api {
                                backend: NAME,
                                operation: operation.into(),
                                status: None,
                                detail: format!("the operation ended {s}: {detail}"),
                            },
                            other => other,
                        });
                    }
                    _ if started.elapsed() > self.cfg.operation_timeout => {
                        return Err(timed_out());
                    }
                    _ => {}
                }
            }
        }
        if matches!(status, StatusCode::ACCEPTED | StatusCode::CREATED)
            && let Some(url) = header("location")
        {
            loop {
                tokio::time::sleep(wait).await;
                let resp = self.send(Method::GET, &url, None, operation).await?;
                wait = self.wait_for(resp.headers());
                if resp.status() == StatusCode::ACCEPTED {
                    if started.elapsed() > self.cfg.operation_timeout {
                        return Err(timed_out());
                    }
                    continue;
                }
                self.json(resp, operation).await?;
                return Ok(());
            }
        }
        Ok(())
    }

    /// GETs a group; `None` when it does not exist.
    async fn get_group(&self, group: &str) -> Result<Option<Value>> {
        let op = format!("get container group {group}");
        let resp = self
            .send(Method::GET, &self.group_url(group), None, &op)
            .await?;
        if resp.status() == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        self.json(resp, &op).await.map(Some)
    }

    /// Creates rank `rank`'s group and waits until it runs.
    async fn launch_one(
        &self,
        spec: &WorkerSpec,
        n: usize,
        rank: usize,
        attempted: &std::sync::Mutex<Vec<usize>>,
        failed: &AtomicBool,
    ) -> Result<WorkerStatus, RankFailure> {
        if failed.load(Ordering::SeqCst) {
            return Err(RankFailure::Skipped);
        }
        let launch = LaunchId::new(&spec.job_id, spec.segment);
        let group = body::group_name(&launch, rank);
        let op = format!("create container group {group}");
        let fail = |e: Error| {
            failed.store(true, Ordering::SeqCst);
            RankFailure::Failed(e.at_rank(rank))
        };
        let payload = body::container_group(&self.cfg, spec, n, rank);
        // Recorded before the request: a PUT whose answer is lost may still have created the group. (One
        // that stayed throttled to the end created nothing, but stays recorded: its DELETE answers 204.)
        attempted.lock().expect("attempted list lock").push(rank);
        let resp = self
            .send(Method::PUT, &self.group_url(&group), Some(&payload), &op)
            .await
            .map_err(fail)?;
        if !resp.status().is_success() {
            let status = resp.status();
            if status.is_client_error() {
                // ARM refused the request itself: nothing was created. (A 5xx may have created it.)
                attempted
                    .lock()
                    .expect("attempted list lock")
                    .retain(|&r| r != rank);
            }
            let text = resp.text().await.unwrap_or_default();
            return Err(fail(self.image_or(status, &text, spec, rank, &op)));
        }
        // Even when the operation failed, the group may exist and say why (an image pull in its events).
        let lro = self.follow(resp, &op).await;
        let got = self.get_group(&group).await;
        let got = match (lro, got) {
            (Ok(()), Ok(Some(g))) => g,
            (Ok(()), Ok(None)) => {
                return Err(fail(Error::WorkerFailed {
                    backend: NAME,
                    rank,
                    detail: format!("container group {group} vanished after it was created"),
                }));
            }
            (Ok(()), Err(e)) => return Err(fail(e)),
            (Err(e), Ok(Some(g))) => {
                let events = group_events(&g);
                return Err(fail(match events.iter().find(|e| is_image_message(e)) {
                    Some(pull) => Error::ImageMissing {
                        backend: NAME,
                        image: spec.image.clone(),
                        rank,
                        detail: format!("{pull} ({e})"),
                    },
                    None => self.reclassify_image(e, spec, rank),
                }));
            }
            (Err(e), _) => return Err(fail(self.reclassify_image(e, spec, rank))),
        };
        let status = group_status(rank, &group, &got);
        if status.state == WorkerState::Failed {
            let events = group_events(&got);
            let detail = status
                .detail
                .clone()
                .into_iter()
                .chain(events.iter().cloned())
                .collect::<Vec<_>>()
                .join("; ");
            return Err(fail(if events.iter().any(|e| is_image_message(e)) {
                Error::ImageMissing {
                    backend: NAME,
                    image: spec.image.clone(),
                    rank,
                    detail,
                }
            } else {
                Error::WorkerFailed {
                    backend: NAME,
                    rank,
                    detail,
                }
            }));
        }
        Ok(status)
    }

    /// The coordinator group's name from its handle.
    fn coordinator_group_name(handle: &CoordinatorHandle) -> Result<String> {
        handle.check_backend(NAME)?;
        handle
            .object(KIND_GROUP)
            .map(str::to_string)
            .ok_or_else(|| Error::Config {
                backend: NAME,
                detail: format!(
                    "the coordinator handle of job {} names no container group",
                    handle.job_id
                ),
            })
    }

    /// PUTs the coordinator's group, follows the operation and waits for it to run. `created` says
    /// whether the group may exist (and so must be deleted on failure).
    async fn create_coordinator(
        &self,
        group: &str,
        payload: &Value,
        image: &str,
        created: &mut bool,
    ) -> Result<()> {
        let op = format!("create container group {group}");
        let failed = |detail: String| Error::CoordinatorFailed {
            backend: NAME,
            detail,
        };
        let image_failed =
            |detail: String| failed(format!("image {image} could not be pulled: {detail}"));
        *created = true;
        let resp = self
            .send(Method::PUT, &self.group_url(group), Some(payload), &op)
            .await?;
        if !resp.status().is_success() {
            let status = resp.status();
            // ARM refused the request itself: nothing was created. (A 5xx may have created it.)
            *created = !status.is_client_error();
            let text = resp.text().await.unwrap_or_default();
            return Err(match self.arm_error(status, &text, &op) {
                Error::Api { detail, .. } if is_image_message(&detail) => image_failed(detail),
                other => other,
            });
        }
        let lro = self.follow(resp, &op).await;
        let started = tokio::time::Instant::now();
        loop {
            let got = self.get_group(group).await?.ok_or_else(|| {
                failed(format!(
                    "container group {group} vanished after it was created"
                ))
            })?;
            let status = group_status(0, group, &got);
            let events = group_events(&got);
            if let Some(pull) = events.iter().find(|e| is_image_message(e)) {
                return Err(image_failed(pull.clone()));
            }
            if let Err(e) = lro {
                return Err(match e {
                    Error::Api { detail, .. } => failed(detail),
                    other => other,
                });
            }
            match status.state {
                WorkerState::Running if status.ip.is_some() => return Ok(()),
                WorkerState::Succeeded => return Ok(()),
                WorkerState::Failed => {
                    let detail = status
                        .detail
                        .into_iter()
                        .chain(events)
                        .collect::<Vec<_>>()
                        .join("; ");
                    return Err(failed(detail));
                }
                _ if started.elapsed() > self.cfg.operation_timeout => {
                    return Err(Error::Timeout {
                        backend: NAME,
                        what: format!("the coordinator's group {group} to run"),
                        waited_s: started.elapsed().as_secs(),
                    });
                }
                _ => tokio::time::sleep(self.cfg.poll_interval).await,
            }
        }
    }

    /// An error status from a PUT: an image the registry does not have is an [`Error::ImageMissing`].
    fn image_or(
        &self,
        status: StatusCode,
        text: &str,
        spec: &WorkerSpec,
        rank: usize,
        op: &str,
    ) -> Error {
        self.reclassify_image(self.arm_error(status, text, op), spec, rank)
    }

    fn reclassify_image(&self, e: Error, spec: &WorkerSpec, rank: usize) -> Error {
        match e {
            Error::Api { detail, .. } if is_image_message(&detail) => Error::ImageMissing {
                backend: NAME,
                image: spec.image.clone(),
                rank,
                detail,
            },
            other => other,
        }
    }

    /// DELETEs a group and follows the deletion to its end; a group that is not there is fine.
    async fn delete_group(&self, group: &str) -> Result<()> {
        let op = format!("delete container group {group}");
        let resp = self
            .send(Method::DELETE, &self.group_url(group), None, &op)
            .await?;
        match resp.status() {
            StatusCode::NOT_FOUND | StatusCode::NO_CONTENT => Ok(()),
            s if s.is_success() => self.follow(resp, &op).await,
            s => {
                let text = resp.text().await.unwrap_or_default();
                Err(self.arm_error(s, &text, &op))
            }
        }
    }

    /// Deletes groups concurrently; the ones that could not be deleted, with why.
    async fn delete_groups(&self, groups: Vec<String>) -> Vec<String> {
        let results: Vec<(String, Result<()>)> = futures_util::stream::iter(groups)
            .map(|g| async move {
                let r = self.delete_group(&g).await;
                (g, r)
            })
            .buffer_unordered(self.cfg.max_parallel)
            .collect()
            .await;
        let rg = &self.cfg.resource_group;
        let mut leftovers: Vec<String> = results
            .into_iter()
            .filter_map(|(g, r)| {
                r.err()
                    .map(|e| format!("container group {g} in resource group {rg} ({e})"))
            })
            .collect();
        leftovers.sort();
        leftovers
    }

    /// Names and ranks of the launch's groups, from the resource group's list (following `nextLink`).
    async fn launch_groups(&self, launch: &LaunchId) -> Result<BTreeMap<usize, String>> {
        let base = launch.base_name();
        let op = format!(
            "list container groups in resource group {}",
            self.cfg.resource_group
        );
        let mut url = format!("{}?api-version={API_VERSION}", self.groups_url());
        let mut out = BTreeMap::new();
        loop {
            let resp = self.send(Method::GET, &url, None, &op).await?;
            let page = self.json(resp, &op).await?;
            for g in page["value"].as_array().into_iter().flatten() {
                let tags = &g["tags"];
                if tags[body::TAG_LAUNCH].as_str() != Some(base.as_str()) {
                    continue;
                }
                let (Some(rank), Some(name)) = (
                    tags[body::TAG_RANK].as_str().and_then(|r| r.parse().ok()),
                    g["name"].as_str(),
                ) else {
                    continue;
                };
                out.insert(rank, name.to_string());
            }
            match page["nextLink"].as_str() {
                Some(next) if !next.is_empty() => url = next.to_string(),
                _ => return Ok(out),
            }
        }
    }
}

#[async_trait]
impl Backend for AciBackend {
    fn name(&self) -> BackendName {
        NAME
    }

    async fn launch(&self, spec: &WorkerSpec, n_workers: usize) -> Result<Launched> {
        spec.validate(n_workers)?;
        unsupported_gpu(spec)?;
        let id = LaunchId::new(&spec.job_id, spec.segment);
        let attempted = std::sync::Mutex::new(Vec::new());
        let failed = AtomicBool::new(false);
        let results: Vec<(usize, Result<WorkerStatus, RankFailure>)> =
            futures_util::stream::iter(0..n_workers)
                .map(|rank| {
                    let (attempted, failed) = (&attempted, &failed);
                    async move {
                        (
                            rank,
                            self.launch_one(spec, n_workers, rank, attempted, failed)
                                .await,
                        )
                    }
                })
                .buffer_unordered(self.cfg.max_parallel)
                .collect()
                .await;
        let mut workers = Vec::with_capacity(n_workers);
        let mut first_error: Option<(usize, Error)> = None;
        for (rank, r) in results {
            match r {
                Ok(w) => workers.push(w),
                Err(RankFailure::Failed(e)) => {
                    if first_error.as_ref().is_none_or(|(r0, _)| rank < *r0) {
                        first_error = Some((rank, e));
                    }
                }
                Err(RankFailure::Skipped) => {}
            }
        }
        let Some((_, err)) = first_error else {
            workers.sort_by_key(|w| w.rank);
            return Ok(Launched { id, workers });
        };
        let mut ranks = attempted.into_inner().expect("attempted list lock");
        ranks.sort_unstable();
        let groups = ranks.iter().map(|&r| body::group_name(&id, r)).collect();
        let leftovers = self.delete_groups(groups).await;
        Err(err.after_cleanup(leftovers))
    }

    async fn list(&self, launch: &LaunchId) -> Result<Vec<WorkerStatus>> {
        let groups = self.launch_groups(launch).await?;
        let mut out = Vec::with_capacity(groups.len());
        for (rank, name) in groups {
            if let Some(g) = self.get_group(&name).await? {
                out.push(group_status(rank, &name, &g));
            }
        }
        Ok(out)
    }

    async fn stop(&self, launch: &LaunchId, rank: usize) -> Result<()> {
        self.delete_group(&body::group_name(launch, rank)).await
    }

    async fn stop_all(&self, launch: &LaunchId) -> Result<()> {
        let groups = self.launch_groups(launch).await?.into_values().collect();
        let leftovers = self.delete_groups(groups).await;
        Error::stop_all_result(NAME, launch, leftovers)
    }

    async fn check(&self, spec: &WorkerSpec, demand: Demand) -> Result<()> {
        unsupported_gpu(spec)?;
        // A token, and ARM taking it for this resource group: absent or expired credentials, a missing
        // role or resource group are refused now, before anything exists.
        let op = format!(
            "list container groups in resource group {}",
            self.cfg.resource_group
        );
        let url = format!("{}?api-version={API_VERSION}", self.groups_url());
        let resp = self.send(Method::GET, &url, None, &op).await?;
        self.json(resp, &op).await?;
        self.check_quota(spec, demand).await
    }

    async fn launch_coordinator(&self, spec: &CoordinatorSpec) -> Result<CoordinatorHandle> {
        spec.validate()?;
        let identity = self
            .cfg
            .coordinator_identity_id
            .clone()
            .filter(|i| !i.trim().is_empty())
            .ok_or_else(|| Error::Config {
                backend: NAME,
                detail: "coordinator_identity_id is not set: cluster mode runs the coordinator \
                         with infra/azure's user-assigned identity \
                         (azurerm_user_assigned_identity.coordinator, output coordinator_identity_id)"
                    .into(),
            })?;
        let group = LaunchId::coordinator_name(&spec.job_id);
        let payload = body::coordinator_group(&self.cfg, spec, &identity);
        let mut created = false;
        match self
            .create_coordinator(&group, &payload, &spec.image, &mut created)
            .await
        {
            Ok(()) => Ok(CoordinatorHandle {
                backend: NAME.into(),
                job_id: spec.job_id.clone(),
                scope: self.cfg.resource_group.clone(),
                objects: vec![PlatformObject {
                    kind: KIND_GROUP.into(),
                    id: group,
                }],
            }),
            Err(e) => {
                let leftovers = if created {
                    self.delete_groups(vec![group]).await
                } else {
                    Vec::new()
                };
                Err(e.after_cleanup(leftovers))
            }
        }
    }

    async fn coordinator_status(&self, handle: &CoordinatorHandle) -> Result<CoordinatorStatus> {
        let group = Self::coordinator_group_name(handle)?;
        Ok(match self.get_group(&group).await? {
            Some(g) => {
                let s = group_status(0, &group, &g);
                CoordinatorStatus {
                    state: s.state,
                    detail: s.detail,
                    ip: s.ip,
                }
            }
            None => CoordinatorStatus {
                state: WorkerState::Unknown,
                detail: Some(format!(
                    "container group {group} no longer exists in resource group {}",
                    self.cfg.resource_group
                )),
                ip: None,
            },
        })
    }

    async fn coordinator_logs(&self, handle: &CoordinatorHandle) -> Result<String> {
        let group = Self::coordinator_group_name(handle)?;
        let op = format!("read the logs of container group {group}");
        let url = format!(
            "{}/{group}/containers/{}/logs?api-version={API_VERSION}",
            self.groups_url(),
            body::COORDINATOR_CONTAINER
        );
        let resp = self.send(Method::GET, &url, None, &op).await?;
        let logs = self.json(resp, &op).await?;
        Ok(logs["content"].as_str().unwrap_or("").to_string())
    }

    async fn stop_coordinator(&self, handle: &CoordinatorHandle) -> Result<()> {
        let group = Self::coordinator_group_name(handle)?;
        self.delete_group(&group).await
    }

    async fn logs(&self, launch: &LaunchId, rank: usize) -> Result<String> {
        let group = body::group_name(launch, rank);
        let op = format!("read the logs of container group {group}");
        let url = format!(
            "{}/{group}/containers/{}/logs?api-version={API_VERSION}",
            self.groups_url(),
            body::CONTAINER
        );
        let resp = self.send(Method::GET, &url, None, &op).await?;
        if resp.status() == StatusCode::NOT_FOUND {
            return Err(Error::NoSuchWorker {
                backend: NAME,
                launch: launch.to_string(),
                rank,
            });
        }
        let logs = self.json(resp, &op).await?;
        Ok(logs["content"].as_str().unwrap_or("").to_string())
    }
}

/// The `Retry-After` of an answer, in seconds as ARM sends it; `None` without one (or with the
/// HTTP-date form, which ARM does not use: the caller's own backoff applies then).
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get(RETRY_AFTER)
        .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok())
        .map(Duration::from_secs)
}

/// ARM's `x-ms-ratelimit-remaining-*` headers of an answer, as `name=value`, for a throttling error.
fn ratelimit_remaining(headers: &HeaderMap) -> Vec<String> {
    let mut out: Vec<String> = headers
        .iter()
        .filter(|(k, _)| k.as_str().starts_with("x-ms-ratelimit-remaining-"))
        .filter_map(|(k, v)| Some(format!("{}={}", k.as_str(), v.to_str().ok()?)))
        .collect();
    out.sort();
    out
}

/// The wait before attempt `attempts + 1` of a throttled request without `Retry-After`: `first`
/// doubled per attempt so far, capped by `cap`, then drawn uniformly from its upper half (jitter, so
/// that the parallel creates of a launch do not come back at the same instant).
fn backoff(first: Duration, cap: Duration, attempts: u32) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let full = first
        .saturating_mul(1u32 << attempts.saturating_sub(1).min(20))
        .min(cap);
    // RandomState is seeded afresh per instance: a cheap uniform draw without a random-number crate.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(attempts);
    let unit = (h.finish() >> 11) as f64 / (1u64 << 53) as f64;
    full.mul_f64(0.5 + 0.5 * unit)
}

/// ACI has no GPUs: a GPU request is refused before any call.
fn unsupported_gpu(spec: &WorkerSpec) -> Result<()> {
    match &spec.gpu {
        None => Ok(()),
        Some(gpu) => Err(Error::Unsupported {
            backend: NAME,
            detail: format!(
                "Azure Container Instances has offered no GPUs since 14 July 2025, and the spec \
                 asks for {} x {} per worker; run GPU workers with the kubernetes backend on AKS \
                 (infra/k8s) or with the ecs backend, or drop `gpu` for CPU workers",
                gpu.count,
                gpu.kind.as_deref().unwrap_or("any GPU")
            ),
        }),
    }
}

/// `(code, message)` of an ARM error body, either `{"error": {...}}` or an operation's `{"error": {...}}`.
fn cloud_error(text: &str) -> (Option<String>, Option<String>) {
    let v: Value = serde_json::from_str(text).unwrap_or(Value::Null);
    let e = &v["error"];
    (
        e["code"].as_str().map(str::to_string),
        e["message"].as_str().map(str::to_string),
    )
}

fn is_image_message(s: &str) -> bool {
    let s = s.to_ascii_lowercase();
    s.contains("inaccessibleimage")
        || s.contains("pull image")
        || s.contains("image pull")
        || s.contains("manifest unknown")
        || s.contains("repository does not exist")
}

fn group_events(g: &Value) -> Vec<String> {
    let props = &g["properties"];
    let group_events = props["instanceView"]["events"]
        .as_array()
        .into_iter()
        .flatten();
    let container_events = props["containers"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|c| {
            c["properties"]["instanceView"]["events"]
                .as_array()
                .into_iter()
                .flatten()
        });
    group_events
        .chain(container_events)
        .filter_map(|e| e["message"].as_str().map(str::to_string))
        .collect()
}

/// A GET response as a [`WorkerStatus`].
fn group_status(rank: usize, name: &str, g: &Value) -> WorkerStatus {
    let props = &g["properties"];
    let provisioning = props["provisioningState"].as_str().unwrap_or("");
    let runtime = props["instanceView"]["state"].as_str();
    let state = match (provisioning, runtime) {
        ("Failed" | "Canceled" | "Unhealthy", _) => WorkerState::Failed,
        (_, Some("Running")) => WorkerState::Running,
        (_, Some("Succeeded")) => WorkerState::Succeeded,
        (_, Some("Failed" | "Stopped")) => WorkerState::Failed,
        (_, Some("Pending")) | ("Pending" | "Creating" | "Accepted" | "Updating", _) => {
            WorkerState::Pending
        }
        _ => WorkerState::Unknown,
    };
    let current = &props["containers"][0]["properties"]["instanceView"]["currentState"];
    let detail = match (
        current["detailStatus"].as_str(),
        current["exitCode"].as_i64(),
    ) {
        (Some(d), Some(code)) if !d.is_empty() => Some(format!("{d} (exit code {code})")),
        (Some(d), None) if !d.is_empty() => Some(d.to_string()),
        (_, Some(code)) => Some(format!("exit code {code}")),
        _ => (provisioning == "Failed").then(|| "provisioning failed".to_string()),
    };
    WorkerStatus {
        rank,
        name: name.to_string(),
        state,
        ip: props["ipAddress"]["ip"]
            .as_str()
            .and_then(|ip| ip.parse().ok()),
        dns_name: props["ipAddress"]["fqdn"].as_str().map(str::to_string),
        detail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap_with_jitter_in_the_upper_half() {
        let (first, cap) = (Duration::from_millis(100), Duration::from_secs(1));
        for (attempts, full) in [
            (1, 100),
            (2, 200),
            (3, 400),
            (4, 800),
            (5, 1000),
            (40, 1000),
        ] {
            for _ in 0..50 {
                let d = backoff(first, cap, attempts).as_millis();
                assert!((full / 2..=full).contains(&d), "{attempts}: {d} ms");
            }
        }
        let draws: std::collections::BTreeSet<_> =
            (0..20).map(|_| backoff(first, cap, 3)).collect();
        assert!(draws.len() > 1, "no jitter: {draws:?}");
    }

    #[test]
    fn retry_after_is_read_in_seconds() {
        let mut h = HeaderMap::new();
        assert_eq!(retry_after(&h), None);
        h.insert(RETRY_AFTER, " 7 ".parse().unwrap());
        assert_eq!(retry_after(&h), Some(Duration::from_secs(7)));
        h.insert(
            RETRY_AFTER,
            "Wed, 21 Oct 2015 07:28:00 GMT".parse().unwrap(),
        );
        assert_eq!(retry_after(&h), None);
    }
}
