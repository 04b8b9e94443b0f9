//! Bearer tokens for Azure Resource Manager.
//!
//! Credentials come only from the standard places, never from arguments or the job file:
//! [`DefaultAzureToken`] tries the managed identity ([`ManagedIdentityToken`], the coordinator inside
//! Azure), then the signed-in Azure CLI ([`AzCliToken`], a user's machine).
//!
//! The backend asks a [`TokenProvider`] for a token before every request and never caches one itself.
//! [`StaticToken`] serves tests and a token from `az account get-access-token`; with the `azure-identity`
//! feature, [`AzureIdentityToken`] wraps any `azure_identity` credential (managed identity, workload
//! identity, the Azure CLI), which caches and refreshes. The feature is off by default: azure_core and
//! azure_identity add build time to every workspace build and their API still moves between releases,
//! while everything else the backend needs is one HTTP client.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;

use crate::error::{Error, Result};

/// The scope of an ARM token.
pub const ARM_SCOPE: &str = "https://management.azure.com/.default";

#[async_trait]
pub trait TokenProvider: Send + Sync {
    /// A bearer token for [`ARM_SCOPE`].
    async fn token(&self) -> Result<String>;
    /// Which credential this is, for error messages ("the managed identity ..."); never the token.
    fn describe(&self) -> String;
}

/// A fixed token.
pub struct StaticToken {
    token: String,
    source: String,
}

impl StaticToken {
    /// `source` says where the token came from, for error messages (e.g. `AZURE_ACCESS_TOKEN`).
    pub fn new(token: impl Into<String>, source: impl Into<String>) -> StaticToken {
        StaticToken {
            token: token.into(),
            source: source.into(),
        }
    }
}

impl std::fmt::Debug for StaticToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StaticToken(from {}, <redacted>)", self.source)
    }
}

#[async_trait]
impl TokenProvider for StaticToken {
    async fn token(&self) -> Result<String> {
        Ok(self.token.clone())
    }

    fn describe(&self) -> String {
        format!("the bearer token from {}", self.source)
    }
}

/// Refresh a cached token this long before it expires.
const REFRESH_MARGIN: Duration = Duration::from_secs(300);

/// A token and when it expires.
#[derive(Clone)]
struct Cached {
    token: String,
    expires: SystemTime,
}

fn fresh(cache: &Mutex<Option<Cached>>) -> Option<String> {
    let c = cache.lock().expect("token cache lock");
    c.as_ref()
        .filter(|c| c.expires > SystemTime::now() + REFRESH_MARGIN)
        .map(|c| c.token.clone())
}

fn credentials_error(credential: String, detail: String, hint: &str) -> Error {
    Error::Credentials {
        backend: "aci",
        credential,
        detail,
        hint: hint.into(),
    }
}

const LOGIN_HINT: &str = "run `az login` (or `az login --identity` on an Azure machine), or run the \
     coordinator with its managed identity (infra/azure)";

/// The signed-in Azure CLI's token: `az account get-access-token --resource
/// https://management.azure.com/`. Cached until five minutes before it expires. A missing `az`, a CLI that
/// is not signed in, or a token already expired is an [`Error::Credentials`] that says to run
/// `az login`.
pub struct AzCliToken {
    program: PathBuf,
    cache: Mutex<Option<Cached>>,
}

impl Default for AzCliToken {
    fn default() -> Self {
        AzCliToken::with_program("az")
    }
}

impl AzCliToken {
    pub fn new() -> AzCliToken {
        AzCliToken::default()
    }

    /// A CLI at another path (tests use a script).
    pub fn with_program(program: impl Into<PathBuf>) -> AzCliToken {
        AzCliToken {
            program: program.into(),
            cache: Mutex::new(None),
        }
    }
}

#[async_trait]
impl TokenProvider for AzCliToken {
    async fn token(&self) -> Result<String> {
        if let Some(t) = fresh(&self.cache) {
            return Ok(t);
        }
        let refused = |detail: String| credentials_error(self.describe(), detail, LOGIN_HINT);
        let run = tokio::process::Command::new(&self.program)
            .args([
                "account",
                "get-access-token",
                "--resource",
                "https://management.azure.com/",
                "--output",
                "json",
            ])
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output();
        let out = match tokio::time::timeout(Duration::from_secs(60), run).await {
            Err(_) => {
                return Err(refused(
                    "`az account get-access-token` took over 60 s".into(),
                ));
            }
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(refused(format!(
                    "{} is not installed or not on PATH",
                    self.program.display()
                )));
            }
            Ok(Err(e)) => return Err(refused(format!("running {}: {e}", self.program.display()))),
            Ok(Ok(out)) => out,
        };
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let said: String = stderr.trim().lines().take(3).collect::<Vec<_>>().join(" ");
            return Err(refused(format!(
                "`az account get-access-token` failed ({}): {said}",
                out.status
            )));
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| {
            refused(format!(
                "`az account get-access-token` printed no JSON: {e}"
            ))
        })?;
        let token = v["accessToken"]
            .as_str()
            .filter(|t| !t.is_empty())
            .ok_or_else(|| refused("`az account get-access-token` printed no accessToken".into()))?
            .to_string();
        // `expires_on` (POSIX seconds) since CLI 2.54; older CLIs give only a local time: assume an hour.
        let expires = match v["expires_on"]
            .as_i64()
            .or_else(|| v["expires_on"].as_str().and_then(|s| s.parse().ok()))
        {
            Some(secs) => UNIX_EPOCH + Duration::from_secs(secs.max(0) as u64),
            None => SystemTime::now() + Duration::from_secs(3600),
        };
        if expires <= SystemTime::now() {
            return Err(refused(format!(
                "the Azure CLI's token expired {} s ago",
                SystemTime::now()
                    .duration_since(expires)
                    .unwrap_or_default()
                    .as_secs()
            )));
        }
        *self.cache.lock().expect("token cache lock") = Some(Cached {
            token: token.clone(),
            expires,
        });
        Ok(token)
    }

    fn describe(&self) -> String {
        format!("the Azure CLI ({})", self.program.display())
    }
}

/// A managed identity's token from the instance metadata service (`GET
/// <endpoint>/metadata/identity/oauth2/token`, header `Metadata: true`), as on an Azure VM and inside an ACI
/// container group with a user-assigned identity: the coordinator's identity in cluster mode. Cached
/// until five minutes before it expires. Bounded: one request, [`ManagedIdentityToken::timeout`].
pub struct ManagedIdentityToken {
    endpoint: String,
    client_id: Option<String>,
    /// The identity's resource id (`msi_res_id`): which of several user-assigned identities a group
    /// holds (the coordinator's and the registry pull identity) to use. `client_id` wins when both are set.
    resource_id: Option<String>,
    timeout: Duration,
    http: reqwest::Client,
    cache: Mutex<Option<Cached>>,
}

impl ManagedIdentityToken {
    /// The instance metadata service at 169.254.169.254; `client_id` picks a user-assigned identity
    /// (`infra/azure` output `coordinator_identity_client_id`), `None` the only one.
    pub fn new(client_id: Option<String>) -> ManagedIdentityToken {
        ManagedIdentityToken::with_endpoint("http://169.254.169.254", client_id)
    }

    /// Another endpoint (tests serve one on loopback).
    pub fn with_endpoint(endpoint: impl Into<String>, client_id: Option<String>) -> Self {
        ManagedIdentityToken {
            endpoint: endpoint.into(),
            client_id,
            resource_id: None,
            timeout: Duration::from_secs(2),
            http: reqwest::Client::new(),
            cache: Mutex::new(None),
        }
    }

    /// How long one token request may take (default 2 s: off Azure nothing answers at all).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Asks for the identity with this resource id (`/subscriptions/.../userAssignedIdentities/NAME`).
    pub fn resource_id(mut self, resource_id: Option<String>) -> Self {
        self.resource_id = resource_id.filter(|r| !r.trim().is_empty());
        self
    }
}

#[async_trait]
impl TokenProvider for ManagedIdentityToken {
    async fn token(&self) -> Result<String> {
        if let Some(t) = fresh(&self.cache) {
            return Ok(t);
        }
        let refused = |detail: String| credentials_error(self.describe(), detail, LOGIN_HINT);
        let mut query = vec![
            ("api-version", "2018-02-01".to_string()),
            ("resource", "https://management.azure.com/".to_string()),
        ];
        if let Some(id) = &self.client_id {
            query.push(("client_id", id.clone()));
        } else if let Some(id) = &self.resource_id {
            query.push(("msi_res_id", id.clone()));
        }
        let url = format!(
            "{}/metadata/identity/oauth2/token",
            self.endpoint.trim_end_matches('/')
        );
        let mut full = reqwest::Url::parse(&url)
            .map_err(|e| refused(format!("bad identity endpoint {url:?}: {e}")))?;
        full.query_pairs_mut()
            .extend_pairs(query.iter().map(|(k, v)| (*k, v.as_str())));
        let resp = self
            .http
            .get(full)
            .header("Metadata", "true")
            .timeout(self.timeout)
            .send()
            .await
            .map_err(|e| {
                refused(format!(
                    "no managed identity answered at {url} ({e}): not on Azure, or no identity \
                     assigned"
                ))
            })?;
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        if !status.is_success() {
            return Err(refused(format!(
                "the identity endpoint answered {status}: {}",
                text.chars().take(300).collect::<String>()
            )));
        }
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| refused(format!("the identity endpoint answered no JSON: {e}")))?;
        let token = v["access_token"]
            .as_str()
            .filter(|t| !t.is_empty())
            .ok_or_else(|| refused("the identity endpoint gave no access_token".into()))?
            .to_string();
        let expires = v["expires_on"]
            .as_str()
            .and_then(|s| s.parse::<u64>().ok())
            .or_else(|| v["expires_on"].as_u64())
            .map(|s| UNIX_EPOCH + Duration::from_secs(s))
            .unwrap_or_else(|| SystemTime::now() + Duration::from_secs(3600));
        if expires <= SystemTime::now() {
            return Err(refused(
                "the identity endpoint gave an expired token".into(),
            ));
        }
        *self.cache.lock().expect("token cache lock") = Some(Cached {
            token: token.clone(),
            expires,
        });
        Ok(token)
    }

    fn describe(&self) -> String {
        match (&self.client_id, &self.resource_id) {
            (Some(id), _) => format!("the managed identity with client id {id}"),
            (None, Some(id)) => format!("the managed identity {id}"),
            (None, None) => "the managed identity".into(),
        }
    }
}

/// The standard chain: the managed identity first (the coordinator inside Azure; `AZURE_CLIENT_ID`, or
/// `AZURE_MSI_RESOURCE_ID` as object_store reads it too, picks a user-assigned one), then the signed-in Azure CLI (a user's machine). Credentials never come
/// from arguments or the job file. When neither gives a token, the error names both and says to run
/// `az login`.
pub struct DefaultAzureToken {
    identity: ManagedIdentityToken,
    cli: AzCliToken,
    /// The CLI gave the last token: ask it first (off Azure the identity endpoint costs its timeout).
    cli_first: std::sync::atomic::AtomicBool,
}

impl DefaultAzureToken {
    pub fn from_env() -> DefaultAzureToken {
        DefaultAzureToken::new(
            ManagedIdentityToken::new(std::env::var("AZURE_CLIENT_ID").ok())
                .resource_id(std::env::var("AZURE_MSI_RESOURCE_ID").ok()),
            AzCliToken::new(),
        )
    }

    pub fn new(identity: ManagedIdentityToken, cli: AzCliToken) -> DefaultAzureToken {
        DefaultAzureToken {
            identity,
            cli,
            cli_first: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

#[async_trait]
impl TokenProvider for DefaultAzureToken {
    async fn token(&self) -> Result<String> {
        use std::sync::atomic::Ordering;
        if self.cli_first.load(Ordering::Relaxed)
            && let Ok(t) = self.cli.token().await
        {
            return Ok(t);
        }
        let first = match self.identity.token().await {
            Ok(t) => {
                self.cli_first.store(false, Ordering::Relaxed);
                return Ok(t);
            }
            Err(e) => e,
        };
        match self.cli.token().await {
            Ok(t) => {
                self.cli_first.store(true, Ordering::Relaxed);
                Ok(t)
            }
            Err(second) => {
                let detail = |e: Error| match e {
                    Error::Credentials { detail, .. } => detail,
                    other => other.to_string(),
                };
                Err(credentials_error(
                    self.describe(),
                    format!("{}; {}", detail(first), detail(second)),
                    LOGIN_HINT,
                ))
            }
        }
    }

    fn describe(&self) -> String {
        format!("{}, then {}", self.identity.describe(), self.cli.describe())
    }
}

#[cfg(feature = "azure-identity")]
pub use identity::AzureIdentityToken;

#[cfg(feature = "azure-identity")]
mod identity {
    use std::sync::Arc;

    use async_trait::async_trait;
    use azure_core::credentials::TokenCredential;

    use super::{ARM_SCOPE, TokenProvider};
    use crate::error::{Error, Result};

    /// Any `azure_identity` credential, e.g. `azure_identity::ManagedIdentityCredential::new(None)?`.
    pub struct AzureIdentityToken {
        credential: Arc<dyn TokenCredential>,
        name: String,
    }

    impl AzureIdentityToken {
        /// `name` says which credential it is, for error messages.
        pub fn new(credential: Arc<dyn TokenCredential>, name: impl Into<String>) -> Self {
            AzureIdentityToken {
                credential,
                name: name.into(),
            }
        }
    }

    #[async_trait]
    impl TokenProvider for AzureIdentityToken {
        async fn token(&self) -> Result<String> {
            let token = self
                .credential
                .get_token(&[ARM_SCOPE], None)
                .await
                .map_err(|e| Error::Credentials {
                    backend: "aci",
                    credential: self.describe(),
                    detail: e.to_string(),
                    hint: "sign in (`az login`), or give the coordinator a managed or workload \
                           identity (infra/azure)"
                        .into(),
                })?;
            Ok(token.token.secret().to_string())
        }

        fn describe(&self) -> String {
            format!("the azure_identity credential {}", self.name)
        }
    }
}
