//! Bearer tokens for Azure: Resource Manager (the aci backend's calls) and Blob Storage (the `az://` job
//! store, `physalia-coordinator`'s `store.rs`), from one credential chain.
//!
//! Credentials come only from the standard places, never from arguments or the job file.
//! [`AzureCredentialChain`] is Azure's chain built from azure_identity's credentials (a service
//! principal's secret file, workload identity, the managed identity, the signed-in Azure CLI), with
//! caching and refresh per scope; [`DefaultAzureToken::from_env`], what the aci platform uses, is that
//! chain for Resource Manager, and the job store asks the same chain for Storage tokens.
//!
//! The backend asks a [`TokenProvider`] for a token before every request and never caches one itself.
//! [`StaticToken`] serves tests and a token from `az account get-access-token`; [`AzureIdentityToken`]
//! wraps any one `azure_identity` credential. [`ManagedIdentityToken`] and [`AzCliToken`] are the
//! two ends of the chain written by hand against their endpoints (a metadata service at any address, a
//! CLI at any path), which tests serve on loopback; [`DefaultAzureToken::new`] chains the two.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use azure_core::credentials::TokenCredential;

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

/// The standard chain for Resource Manager. [`DefaultAzureToken::from_env`] is Azure's credential chain
/// ([`AzureCredentialChain::from_env`]: a service principal's secret file, workload identity, the
/// managed identity (`AZURE_CLIENT_ID`, or `AZURE_MSI_RESOURCE_ID` as object_store reads it too, picks
/// a user-assigned one), the signed-in Azure CLI). [`DefaultAzureToken::new`] chains a hand-written
/// managed identity and CLI (tests serve both on loopback). Credentials never come from arguments or
/// the job file. When none gives a token, the error names each and says to run `az login`.
pub struct DefaultAzureToken {
    inner: Chain,
}

enum Chain {
    Azure(AzureCredentialChain),
    /// The environment was refused (a client secret in it): said at the first token, naming it.
    Refused {
        credential: String,
        detail: String,
    },
    Pair {
        identity: ManagedIdentityToken,
        cli: AzCliToken,
        /// The CLI gave the last token: ask it first (off Azure the identity endpoint costs its
        /// timeout).
        cli_first: std::sync::atomic::AtomicBool,
    },
}

impl DefaultAzureToken {
    /// Azure's credential chain from this process's environment. A refused environment (a client
    /// secret in a variable, a secret file others may read) is the error of the first token.
    pub fn from_env() -> DefaultAzureToken {
        let inner = match AzureCredentialChain::from_env() {
            Ok(chain) => Chain::Azure(chain),
            Err(Error::Credentials {
                credential, detail, ..
            }) => Chain::Refused { credential, detail },
            Err(other) => Chain::Refused {
                credential: "Azure's credential chain".into(),
                detail: other.to_string(),
            },
        };
        DefaultAzureToken { inner }
    }

    /// The managed identity, then the CLI.
    pub fn new(identity: ManagedIdentityToken, cli: AzCliToken) -> DefaultAzureToken {
        DefaultAzureToken {
            inner: Chain::Pair {
                identity,
                cli,
                cli_first: std::sync::atomic::AtomicBool::new(false),
            },
        }
    }
}

#[async_trait]
impl TokenProvider for DefaultAzureToken {
    async fn token(&self) -> Result<String> {
        use std::sync::atomic::Ordering;
        let (identity, cli, cli_first) = match &self.inner {
            Chain::Azure(chain) => return chain.token().await,
            Chain::Refused { credential, detail } => {
                return Err(credentials_error(
                    credential.clone(),
                    detail.clone(),
                    LOGIN_HINT,
                ));
            }
            Chain::Pair {
                identity,
                cli,
                cli_first,
            } => (identity, cli, cli_first),
        };
        if cli_first.load(Ordering::Relaxed)
            && let Ok(t) = cli.token().await
        {
            return Ok(t);
        }
        let first = match identity.token().await {
            Ok(t) => {
                cli_first.store(false, Ordering::Relaxed);
                return Ok(t);
            }
            Err(e) => e,
        };
        match cli.token().await {
            Ok(t) => {
                cli_first.store(true, Ordering::Relaxed);
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
        match &self.inner {
            Chain::Azure(chain) => chain.describe(),
            Chain::Refused { credential, .. } => credential.clone(),
            Chain::Pair { identity, cli, .. } => {
                format!("{}, then {}", identity.describe(), cli.describe())
            }
        }
    }
}

pub use identity::AzureIdentityToken;

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

/// The scope of a Blob Storage token (the `az://` job store).
pub const STORAGE_SCOPE: &str = "https://storage.azure.com/.default";

/// The variable naming the file that holds a service principal's client secret (mode 0400): secrets
/// are files here, never environment values.
pub const ENV_CLIENT_SECRET_FILE: &str = "AZURE_CLIENT_SECRET_FILE";

/// How long the managed identity may take to answer one token request: off Azure nothing answers, and
/// azure_identity's own retries (up to 72 s, as Azure recommends on a VM) must not hold a user's
/// command up.
const MANAGED_IDENTITY_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one credential other than the managed identity may take (the CLI, a token exchange).
const CREDENTIAL_TIMEOUT: Duration = Duration::from_secs(60);

/// One credential of the chain: its name for errors, the credential, and how long it may take.
struct Link {
    name: String,
    credential: Arc<dyn TokenCredential>,
    timeout: Duration,
    /// The signed-in Azure CLI: a user's, never a coordinator's ([`AzureCredentialChain::without_cli`]).
    cli: bool,
}

/// Azure's one credential chain, for Resource Manager (the aci backend's calls, [`ARM_SCOPE`]) and Blob
/// Storage (the `az://` job store, [`STORAGE_SCOPE`]) alike, built from azure_identity's credentials in
/// the order Azure's SDKs try them ([`AzureCredentialChain::from_env`]):
///
/// 1. a service principal's client secret: `AZURE_TENANT_ID`, `AZURE_CLIENT_ID` and the secret in the
///    file `AZURE_CLIENT_SECRET_FILE` names (mode 0400; `AZURE_CLIENT_SECRET` in the environment is
///    refused, naming the variable), against `AZURE_AUTHORITY_HOST` (HTTPS) or Entra ID's public cloud;
/// 2. workload identity (AKS): `AZURE_FEDERATED_TOKEN_FILE`, `AZURE_TENANT_ID`, `AZURE_CLIENT_ID`, as
///    the webhook injects them into a pod labelled `azure.workload.identity/use`;
/// 3. the managed identity (the coordinator's container group on ACI, a VM): the instance metadata
///    service, a user-assigned identity picked by `AZURE_CLIENT_ID` or `AZURE_MSI_RESOURCE_ID`, each
///    request bounded at 2 s;
/// 4. the signed-in Azure CLI (`az account get-access-token`, a user's machine).
///
/// The first two are in the chain only where their variables are set. Tokens are cached per scope until
/// five minutes before they expire (azure_identity's CLI credential caches nothing); a token still
/// valid is kept where refreshing fails. The credential that gave the last token is asked first. When
/// none gives one, the error names each and why.
pub struct AzureCredentialChain {
    links: Vec<Link>,
    /// The link that gave the last token.
    last: std::sync::atomic::AtomicUsize,
    cache: Mutex<std::collections::HashMap<String, Cached>>,
}

impl std::fmt::Debug for AzureCredentialChain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AzureCredentialChain({})", self.describe())
    }
}

impl AzureCredentialChain {
    /// The chain this process's environment sets up (see [`AzureCredentialChain`]). Refuses a client
    /// secret in the environment, a secret file that others may read, and credentials azure_identity
    /// refuses to build (a malformed tenant id, an authority host without HTTPS), naming the variable.
    pub fn from_env() -> Result<AzureCredentialChain> {
        AzureCredentialChain::from_vars(|k| std::env::var(k).ok())
    }

    /// [`AzureCredentialChain::from_env`] with the variables `var` gives.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<AzureCredentialChain> {
        let var = |k: &str| var(k).filter(|v| !v.trim().is_empty());
        let bad = |detail: String| {
            credentials_error(
                "Azure's credential chain (the environment)".into(),
                detail,
                LOGIN_HINT,
            )
        };
        let mut links = Vec::new();
        if var("AZURE_CLIENT_SECRET").is_some() {
            return Err(bad(format!(
                "AZURE_CLIENT_SECRET is set: a secret is never an environment value here; put it in a \
                 file (mode 0400) and name it in {ENV_CLIENT_SECRET_FILE}"
            )));
        }
        if let Some(file) = var(ENV_CLIENT_SECRET_FILE) {
            let (Some(tenant), Some(client)) = (var("AZURE_TENANT_ID"), var("AZURE_CLIENT_ID"))
            else {
                return Err(bad(format!(
                    "{ENV_CLIENT_SECRET_FILE} is set but AZURE_TENANT_ID or AZURE_CLIENT_ID is not: a \
                     service principal needs all three"
                )));
            };
            let secret = read_secret_file(&file).map_err(bad)?;
            let credential = azure_identity::ClientSecretCredential::new(
                &tenant,
                client.clone(),
                secret.into(),
                None,
            )
            .map_err(|e| {
                bad(format!(
                    "the service principal of AZURE_TENANT_ID, AZURE_CLIENT_ID and \
                     {ENV_CLIENT_SECRET_FILE}: {e}"
                ))
            })?;
            links.push(Link {
                name: format!("the service principal {client} ({ENV_CLIENT_SECRET_FILE})"),
                credential,
                timeout: CREDENTIAL_TIMEOUT,
                cli: false,
            });
        }
        if let Some(token_file) = var("AZURE_FEDERATED_TOKEN_FILE") {
            let options = azure_identity::WorkloadIdentityCredentialOptions {
                client_id: var("AZURE_CLIENT_ID"),
                tenant_id: var("AZURE_TENANT_ID"),
                token_file_path: Some(token_file.into()),
                ..Default::default()
            };
            let credential = azure_identity::WorkloadIdentityCredential::new(Some(options)).map_err(|e| {
                bad(format!(
                    "workload identity (AZURE_FEDERATED_TOKEN_FILE, AZURE_TENANT_ID, AZURE_CLIENT_ID): {e}"
                ))
            })?;
            links.push(Link {
                name: "workload identity (AZURE_FEDERATED_TOKEN_FILE)".into(),
                credential,
                timeout: CREDENTIAL_TIMEOUT,
                cli: false,
            });
        }
        let (user_assigned_id, which) = match (var("AZURE_CLIENT_ID"), var("AZURE_MSI_RESOURCE_ID"))
        {
            (Some(id), _) => (
                Some(azure_identity::UserAssignedId::ClientId(id.clone())),
                format!("the managed identity with client id {id} (AZURE_CLIENT_ID)"),
            ),
            (None, Some(id)) => (
                Some(azure_identity::UserAssignedId::ResourceId(id.clone())),
                format!("the managed identity {id} (AZURE_MSI_RESOURCE_ID)"),
            ),
            (None, None) => (None, "the managed identity".to_string()),
        };
        let credential = azure_identity::ManagedIdentityCredential::new(Some(
            azure_identity::ManagedIdentityCredentialOptions {
                user_assigned_id,
                ..Default::default()
            },
        ))
        .map_err(|e| bad(format!("{which}: {e}")))?;
        links.push(Link {
            name: which,
            credential,
            timeout: MANAGED_IDENTITY_TIMEOUT,
            cli: false,
        });
        let credential = azure_identity::AzureCliCredential::new(None)
            .map_err(|e| bad(format!("the Azure CLI: {e}")))?;
        links.push(Link {
            name: "the Azure CLI (`az account get-access-token`)".into(),
            credential,
            timeout: CREDENTIAL_TIMEOUT,
            cli: true,
        });
        Ok(AzureCredentialChain::new(links))
    }

    /// A chain of `credentials` (name, credential, how long one request may take), tried in order.
    pub fn of(credentials: Vec<(String, Arc<dyn TokenCredential>, Duration)>) -> Self {
        AzureCredentialChain::new(
            credentials
                .into_iter()
                .map(|(name, credential, timeout)| Link {
                    name,
                    credential,
                    timeout,
                    cli: false,
                })
                .collect(),
        )
    }

    /// The chain without the signed-in Azure CLI: a coordinator on its platform has its own identity
    /// and no user signed in.
    pub fn without_cli(mut self) -> Self {
        self.links.retain(|l| !l.cli);
        self
    }

    fn new(links: Vec<Link>) -> AzureCredentialChain {
        AzureCredentialChain {
            links,
            last: std::sync::atomic::AtomicUsize::new(0),
            cache: Mutex::new(std::collections::HashMap::new()),
        }
    }

    /// A bearer token for `scope` (e.g. [`ARM_SCOPE`], [`STORAGE_SCOPE`]) and when it expires.
    pub async fn token_for(&self, scope: &str) -> Result<(String, SystemTime)> {
        use std::sync::atomic::Ordering;
        let now = SystemTime::now();
        let cached = self
            .cache
            .lock()
            .expect("token cache lock")
            .get(scope)
            .cloned();
        if let Some(c) = &cached
            && c.expires > now + REFRESH_MARGIN
        {
            return Ok((c.token.clone(), c.expires));
        }
        let n = self.links.len();
        let first = self.last.load(Ordering::Relaxed).min(n.saturating_sub(1));
        let mut tried = Vec::new();
        for i in (0..n).map(|k| (first + k) % n) {
            let link = &self.links[i];
            let scopes = [scope];
            let asked = link.credential.get_token(&scopes, None);
            let detail = match tokio::time::timeout(link.timeout, asked).await {
                Err(_) => format!("no answer within {:?}", link.timeout),
                Ok(Err(e)) => first_line(&e.to_string()),
                Ok(Ok(t)) => {
                    let expires = UNIX_EPOCH
                        + Duration::from_secs(t.expires_on.unix_timestamp().max(0) as u64);
                    if expires <= now {
                        format!("it gave a token that expired at {}", t.expires_on)
                    } else {
                        let token = t.token.secret().to_string();
                        self.last.store(i, Ordering::Relaxed);
                        self.cache.lock().expect("token cache lock").insert(
                            scope.to_string(),
                            Cached {
                                token: token.clone(),
                                expires,
                            },
                        );
                        return Ok((token, expires));
                    }
                }
            };
            tried.push(format!("{}: {detail}", link.name));
        }
        // asking again failed: a token still valid serves until it expires
        if let Some(c) = cached
            && c.expires > now
        {
            return Ok((c.token, c.expires));
        }
        Err(credentials_error(
            format!("Azure's credential chain for {scope}"),
            if tried.is_empty() {
                "the chain has no credential".into()
            } else {
                tried.join("; ")
            },
            LOGIN_HINT,
        ))
    }
}

#[async_trait]
impl TokenProvider for AzureCredentialChain {
    async fn token(&self) -> Result<String> {
        Ok(self.token_for(ARM_SCOPE).await?.0)
    }

    fn describe(&self) -> String {
        let names: Vec<&str> = self.links.iter().map(|l| l.name.as_str()).collect();
        format!("Azure's credential chain ({})", names.join(", then "))
    }
}

/// The first line of an azure_identity error (the rest is a troubleshooting link).
fn first_line(text: &str) -> String {
    text.lines().next().unwrap_or("").trim().to_string()
}

/// The secret in `path`, which must be a file only its owner may read (mode 0400 or 0600).
fn read_secret_file(path: &str) -> std::result::Result<String, String> {
    use std::os::unix::fs::PermissionsExt;
    let meta =
        std::fs::metadata(path).map_err(|e| format!("{ENV_CLIENT_SECRET_FILE}: {path}: {e}"))?;
    let mode = meta.permissions().mode() & 0o777;
    if !meta.is_file() || mode & 0o077 != 0 {
        return Err(format!(
            "{ENV_CLIENT_SECRET_FILE}: {path} must be a file only its owner may read (mode 0400), \
             not mode {mode:o}"
        ));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("{ENV_CLIENT_SECRET_FILE}: {path}: {e}"))?;
    let secret = text.trim().to_string();
    if secret.is_empty() {
        return Err(format!("{ENV_CLIENT_SECRET_FILE}: {path} is empty"));
    }
    Ok(secret)
}

#[cfg(test)]
mod tests {
    use super::*;
    use azure_core::credentials::{AccessToken, TokenRequestOptions};
    use azure_core::time::OffsetDateTime;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A credential that answers with its script, one entry per call (the last repeats): a token
    /// valid for that many seconds, an error, or no answer at all.
    #[derive(Debug)]
    struct Scripted {
        name: &'static str,
        script: Vec<Answer>,
        calls: AtomicUsize,
    }

    #[derive(Clone, Copy, Debug)]
    enum Answer {
        Valid(i64),
        Fails,
        Hangs,
    }

    impl Scripted {
        fn new(name: &'static str, script: &[Answer]) -> Arc<Scripted> {
            Arc::new(Scripted {
                name,
                script: script.to_vec(),
                calls: AtomicUsize::new(0),
            })
        }
        fn calls(&self) -> usize {
            self.calls.load(Ordering::SeqCst)
        }
    }

    #[async_trait]
    impl TokenCredential for Scripted {
        async fn get_token(
            &self,
            scopes: &[&str],
            _: Option<TokenRequestOptions<'_>>,
        ) -> azure_core::Result<AccessToken> {
            let k = self.calls.fetch_add(1, Ordering::SeqCst);
            let answer = self.script[k.min(self.script.len() - 1)];
            match answer {
                Answer::Valid(secs) => Ok(AccessToken::new(
                    format!("{}#{k}@{}", self.name, scopes[0]),
                    OffsetDateTime::now_utc() + azure_core::time::Duration::seconds(secs),
                )),
                Answer::Fails => Err(azure_core::Error::with_message(
                    azure_core::error::ErrorKind::Credential,
                    format!(
                        "{} is not signed in\nTo troubleshoot, visit https://aka.ms",
                        self.name
                    ),
                )),
                Answer::Hangs => {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    unreachable!("the chain's timeout ends the wait")
                }
            }
        }
    }

    fn chain(links: &[&Arc<Scripted>]) -> AzureCredentialChain {
        AzureCredentialChain::of(
            links
                .iter()
                .map(|c| {
                    let credential: Arc<dyn TokenCredential> = (*c).clone();
                    (c.name.to_string(), credential, Duration::from_millis(200))
                })
                .collect(),
        )
    }

    /// A failing and a silent credential are passed over for the next; the one that answered is asked
    /// first next time; a token is per scope and cached; when every one fails, the error names each.
    #[tokio::test]
    async fn the_chain_falls_through_remembers_and_caches_per_scope() {
        let secret = Scripted::new("secret", &[Answer::Fails]);
        let identity = Scripted::new("identity", &[Answer::Hangs]);
        let cli = Scripted::new("cli", &[Answer::Valid(3600)]);
        let c = chain(&[&secret, &identity, &cli]);
        let (arm, _) = c.token_for(ARM_SCOPE).await.unwrap();
        assert_eq!(arm, format!("cli#0@{ARM_SCOPE}"));
        assert_eq!(c.token().await.unwrap(), arm, "cached");
        let (storage, _) = c.token_for(STORAGE_SCOPE).await.unwrap();
        assert_eq!(storage, format!("cli#1@{STORAGE_SCOPE}"), "another scope");
        // the CLI answered last: asked first, the others not again
        assert_eq!((secret.calls(), identity.calls(), cli.calls()), (1, 1, 2));

        let a = Scripted::new("a", &[Answer::Fails]);
        let b = Scripted::new("b", &[Answer::Hangs]);
        let err = chain(&[&a, &b])
            .token_for(ARM_SCOPE)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("a: a is not signed in"), "{err}");
        assert!(!err.contains("aka.ms"), "one line per credential: {err}");
        assert!(err.contains("b: no answer within 200ms"), "{err}");
        assert!(err.contains(ARM_SCOPE), "{err}");
    }

    /// A token within five minutes of expiry is fetched again; where that fails, a token still valid
    /// serves; an expired one never does.
    #[tokio::test]
    async fn tokens_are_refreshed_before_expiry_and_kept_while_valid() {
        let flaky = Scripted::new(
            "flaky",
            &[Answer::Valid(120), Answer::Fails, Answer::Valid(3600)],
        );
        let c = chain(&[&flaky]);
        let (first, _) = c.token_for(ARM_SCOPE).await.unwrap();
        // within the margin: asked again, which fails; the old token is still valid
        let (kept, _) = c.token_for(ARM_SCOPE).await.unwrap();
        assert_eq!(kept, first);
        let (fresh, expires) = c.token_for(ARM_SCOPE).await.unwrap();
        assert_eq!(fresh, format!("flaky#2@{ARM_SCOPE}"));
        assert!(expires > SystemTime::now() + Duration::from_secs(3000));
        assert_eq!(flaky.calls(), 3);

        let expired = Scripted::new("expired", &[Answer::Valid(-10)]);
        let err = chain(&[&expired])
            .token_for(ARM_SCOPE)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("expired"), "{err}");
    }

    /// The chain the environment sets up: a client secret in a variable is refused naming it; a
    /// secret file must be its owner's alone; workload identity joins where its token file is named;
    /// the managed identity and the CLI are always there (the CLI not on a platform).
    #[test]
    fn the_environment_sets_up_the_chain_and_secrets_are_files() {
        use std::os::unix::fs::PermissionsExt;
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let err = AzureCredentialChain::from_vars(vars(&[("AZURE_CLIENT_SECRET", "s3cr3t-value")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("AZURE_CLIENT_SECRET is set"), "{err}");
        assert!(err.contains(ENV_CLIENT_SECRET_FILE), "{err}");
        assert!(!err.contains("s3cr3t-value"), "{err}");

        let c = AzureCredentialChain::from_vars(vars(&[])).unwrap();
        assert_eq!(c.links.len(), 2, "{}", c.describe());
        assert!(
            c.describe()
                .contains("the managed identity, then the Azure CLI"),
            "{}",
            c.describe()
        );
        assert_eq!(c.without_cli().links.len(), 1);

        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, "eyJ.k8s.token").unwrap();
        let token_path: &'static str =
            Box::leak(token.to_string_lossy().into_owned().into_boxed_str());
        let tenant = "00000000-0000-0000-0000-0000000000aa";
        let pairs: &'static [(&'static str, &'static str)] = Box::leak(Box::new([
            ("AZURE_FEDERATED_TOKEN_FILE", token_path),
            ("AZURE_TENANT_ID", tenant),
            ("AZURE_CLIENT_ID", "c0000000-0000-0000-0000-00000000c001"),
        ]));
        let c = AzureCredentialChain::from_vars(vars(pairs)).unwrap();
        let d = c.describe();
        assert!(
            d.starts_with("Azure's credential chain (workload identity"),
            "{d}"
        );
        assert!(
            d.contains("client id c0000000-0000-0000-0000-00000000c001"),
            "{d}"
        );

        let secret = dir.path().join("secret");
        std::fs::write(&secret, "s3cr3t-value\n").unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o644)).unwrap();
        let secret_path: &'static str =
            Box::leak(secret.to_string_lossy().into_owned().into_boxed_str());
        let pairs: &'static [(&'static str, &'static str)] = Box::leak(Box::new([
            (ENV_CLIENT_SECRET_FILE, secret_path),
            ("AZURE_TENANT_ID", tenant),
            ("AZURE_CLIENT_ID", "c0000000-0000-0000-0000-00000000c002"),
        ]));
        let err = AzureCredentialChain::from_vars(vars(pairs))
            .unwrap_err()
            .to_string();
        assert!(err.contains("mode 0400") && err.contains("644"), "{err}");
        assert!(err.contains(secret_path), "{err}");
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o400)).unwrap();
        let c = AzureCredentialChain::from_vars(vars(pairs)).unwrap();
        assert!(
            c.describe()
                .starts_with("Azure's credential chain (the service principal c0000000-0000-0000-0000-00000000c002"),
            "{}",
            c.describe()
        );
        assert!(!format!("{c:?}").contains("s3cr3t"));
    }
}
