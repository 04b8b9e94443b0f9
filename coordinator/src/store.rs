//! The job store: where job records live. A local folder, or an object store URL (`s3://bucket/prefix`,
//! `az://container/prefix`, `gs://bucket/prefix`) through the `object_store` crate, its credentials
//! from each cloud's standard chain (aws-config's: `AWS_*`, `AWS_PROFILE` with SSO and
//! `credential_process`, the task role ([`s3_builder`]); `AZURE_*` and Azure's credential chain, the
//! one the aci backend's Resource Manager calls use ([`azure_builder`]); `GOOGLE_*`
//! and the metadata server), never from a job file or an argument.
//!
//! A job whose `output.dir` is a URL keeps its record in a staging folder on the coordinator's machine,
//! laid out as a local job directory, and mirrors it to `<url>/<job id>/` while it runs ([`Mirror`]):
//! every two seconds each file whose size or modification time changed is uploaded whole (object
//! stores have no append; the record's files are small, checkpoints are written once), deleted files
//! are deleted, and once more when the job ends. The launch secrets folder is never uploaded. A
//! `cancel` object put under the job by any machine is copied into the staging folder, where the
//! coordinator looks for it every loop.
//!
//! The commands that read jobs (`list`, `status`, `logs`, `report`, `cancel`) take `--dir URL`: they
//! download the record into a temporary folder and read it as they read a local one ([`Remote::fetch`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result, bail};
use futures::TryStreamExt;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

use crate::jobdir::CANCEL_FILE as CANCEL;

/// Files larger than this go up in parts of this size ([`Remote::put_file`]).
pub const MULTIPART_AT: usize = 32 << 20;
/// Parts of one upload in flight at once.
const MULTIPART_IN_FLIGHT: usize = 4;

/// Whether `dir` names an object store rather than a local folder.
pub fn is_url(dir: &Path) -> bool {
    dir.to_str().is_some_and(|s| s.contains("://"))
}

/// Set by `physalia coordinate`: this process is a coordinator on its platform, whose credentials are
/// the platform's identity (the managed identity on ACI); otherwise it runs on a user's machine.
static ON_PLATFORM: AtomicBool = AtomicBool::new(false);

/// Marks this process as a coordinator on its platform (see [`ON_PLATFORM`]).
pub fn use_platform_identity() {
    ON_PLATFORM.store(true, Ordering::Release);
}

/// Azure Blob Storage from the environment (`AZURE_STORAGE_ACCOUNT_NAME`, `AZURE_STORAGE_ENDPOINT`,
/// `AZURE_ALLOW_HTTP` and the rest object_store reads), its bearer tokens from Azure's one credential
/// chain, the one the aci backend's Resource Manager calls use
/// (`physalia_backends::aci::token::AzureCredentialChain`: a service principal's secret file, workload
/// identity, the managed identity, the signed-in Azure CLI; cached and refreshed). A coordinator on its
/// platform ([`use_platform_identity`]) has no signed-in user: its chain stops before the CLI. A
/// shared key, a SAS or a fixed token named in the environment, or the storage emulator, are
/// object_store's own as before.
fn azure_builder() -> Result<object_store::azure::MicrosoftAzureBuilder> {
    use object_store::azure::AzureConfigKey as K;
    let builder = object_store::azure::MicrosoftAzureBuilder::from_env();
    let own = [K::AccessKey, K::SasKey, K::Token]
        .iter()
        .any(|k| builder.get_config_value(k).is_some())
        // booleans always have a value: whether the environment set it
        || builder.get_config_value(&K::UseEmulator).as_deref() == Some("true");
    if own {
        return Ok(builder);
    }
    let chain = physalia_backends::aci::token::AzureCredentialChain::from_env()?;
    let chain = if ON_PLATFORM.load(Ordering::Acquire) {
        chain.without_cli()
    } else {
        chain
    };
    Ok(builder.with_credentials(Arc::new(AzureChain(chain))))
}

/// Azure's credential chain as object_store's [`object_store::CredentialProvider`]: Blob Storage bearer
/// tokens, cached by the chain until five minutes before they expire.
#[derive(Debug)]
struct AzureChain(physalia_backends::aci::token::AzureCredentialChain);

#[async_trait::async_trait]
impl object_store::CredentialProvider for AzureChain {
    type Credential = object_store::azure::AzureCredential;

    async fn get_credential(&self) -> object_store::Result<Arc<Self::Credential>> {
        let (token, _) = self
            .0
            .token_for(physalia_backends::aci::token::STORAGE_SCOPE)
            .await
            .map_err(|e| object_store::Error::Generic {
                store: "MicrosoftAzure",
                source: Box::new(e),
            })?;
        Ok(Arc::new(object_store::azure::AzureCredential::BearerToken(
            token,
        )))
    }
}

/// The Azure store at `url` from `builder`. Without an account (neither `AZURE_STORAGE_ACCOUNT_NAME`
/// nor one in the URL, as `abfss://CONTAINER@ACCOUNT.dfs.core.windows.net/...` names it) object_store
/// says only "Account must be specified": the error names the variable and the URL instead.
fn open_azure(
    url: &str,
    builder: object_store::azure::MicrosoftAzureBuilder,
) -> Result<object_store::azure::MicrosoftAzure> {
    use object_store::azure::AzureConfigKey as K;
    let named = builder.get_config_value(&K::AccountName).is_some();
    builder.with_url(url).build().map_err(|e| {
        if !named && e.to_string().contains("Account must be specified") {
            anyhow::anyhow!(
                "{url}: no Azure storage account: set AZURE_STORAGE_ACCOUNT_NAME to the account's name \
                 (infra/azure's `storage_account` output), or name it in the URL \
                 (abfss://CONTAINER@ACCOUNT.dfs.core.windows.net/PATH)"
            )
        } else {
            anyhow::Error::new(e).context(format!("{url}: opening the Azure Blob container"))
        }
    })
}

/// The whole AWS chain (profile files, `credential_process`, SSO, STS, the container endpoint) gets this
/// long, as the ECS calls do (backends' `ecs::from_env`).
const AWS_CHAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// One try, one second per phase, for the instance-metadata service: where it exists it answers in
/// milliseconds, and on a laptop it must not hold every command up.
const IMDS_TIMEOUT: Duration = Duration::from_secs(1);
/// How long S3 may take to say where a bucket is ([`s3_builder`]).
const BUCKET_REGION_TIMEOUT: Duration = Duration::from_secs(2);
/// Credentials that expire are fetched again this long before they do.
const REFRESH_BEFORE: Duration = Duration::from_secs(5 * 60);
const AWS_HINT: &str = "run `aws configure` or `aws sso login`, set AWS_PROFILE to a profile that has \
     credentials (or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY); inside AWS, give the task or instance \
     its role";

/// The profile aws-config reads: `AWS_PROFILE`'s, else `default`; said in errors.
fn aws_profile() -> String {
    match std::env::var("AWS_PROFILE") {
        Ok(p) if !p.is_empty() => format!("profile `{p}` (AWS_PROFILE)"),
        _ => "profile `default`".to_string(),
    }
}

/// An error and its causes on one line (aws-config's errors say the useful part in their sources).
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        next = cause.source();
    }
    out
}

/// An S3 store's builder for `url`, with aws-config's default chains, the ones the ECS calls use:
///
/// - credentials: the environment (`AWS_ACCESS_KEY_ID`, ...), the profile (`AWS_PROFILE`, else
///   `default`, in `AWS_CONFIG_FILE`/`AWS_SHARED_CREDENTIALS_FILE` or `~/.aws`) with its keys, SSO
///   session, `credential_process` or role to assume, web identity, the ECS container endpoint and
///   the instance-metadata service, in that order; fetched once here (so that none, or a profile whose
///   `credential_process` fails, is an error of `open` naming the profile) and again before they
///   expire ([`AwsChain`]);
/// - the region: `AWS_REGION`/`AWS_DEFAULT_REGION`, the profile's `region`, the instance's, else
///   us-east-1. S3 answers a request signed for another region than the bucket's with a 301 that
///   object_store does not follow ("Received redirect without LOCATION, this normally indicates an
///   incorrectly configured region"), so on AWS itself (no endpoint set) the bucket's own region is
///   asked of S3 first (an unsigned HEAD, which S3 answers with `x-amz-bucket-region` to anyone) and
///   wins over the chain's; where S3 does not answer within 2 s, the chain's region is used and a
///   bucket elsewhere fails at its first request with that error (set AWS_REGION to its region);
/// - the endpoint and the rest as object_store reads them from the environment: `AWS_ENDPOINT_URL`,
///   `AWS_ENDPOINT_URL_S3` (moto, MinIO, private endpoints: their region is the chain's, never asked
///   of the endpoint), `AWS_ALLOW_HTTP` and the other `AWS_*` settings it knows.
///
/// Returns the builder and the region its requests are signed for.
async fn s3_builder(
    url: &str,
    parsed: &url::Url,
) -> Result<(object_store::aws::AmazonS3Builder, String)> {
    use aws_config::meta::region::RegionProviderChain;
    use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey as K};

    let builder = AmazonS3Builder::from_env().with_url(url);
    let imds = aws_config::imds::Client::builder()
        .max_attempts(1)
        .connect_timeout(IMDS_TIMEOUT)
        .read_timeout(IMDS_TIMEOUT)
        .operation_timeout(IMDS_TIMEOUT * 2)
        .build();
    let region_chain = RegionProviderChain::first_try(
        aws_config::environment::region::EnvironmentVariableRegionProvider::new(),
    )
    .or_else(aws_config::profile::ProfileFileRegionProvider::new())
    .or_else(
        aws_config::imds::region::ImdsRegionProvider::builder()
            .imds_client(imds.clone())
            .build(),
    );
    let profile = aws_profile();
    let load = async {
        let region = region_chain.region().await;
        let chain = aws_config::default_provider::credentials::DefaultCredentialsChain::builder()
            .imds_client(imds)
            .build()
            .await;
        (region, chain)
    };
    let (region, chain) = tokio::time::timeout(AWS_CHAIN_TIMEOUT, load)
        .await
        .map_err(|_| {
            anyhow::anyhow!(
                "{url}: loading the AWS configuration ({profile}) took over {} s",
                AWS_CHAIN_TIMEOUT.as_secs()
            )
        })?;
    let credentials = Arc::new(AwsChain {
        chain: aws_credential_types::provider::SharedCredentialsProvider::new(chain),
        profile,
        cached: tokio::sync::Mutex::new(None),
    });
    // now, not at the first request: none (or a failing profile) is said once, with the profile's name
    object_store::CredentialProvider::get_credential(&*credentials)
        .await
        .map_err(|e| anyhow::anyhow!("{url}: {}", error_chain(&e)))?;

    let endpoint = [K::Endpoint, K::S3Endpoint]
        .iter()
        .any(|k| builder.get_config_value(k).is_some());
    let mut region = region.map_or_else(|| "us-east-1".to_string(), |r| r.to_string());
    if !endpoint && let Some(bucket) = parsed.host_str() {
        let options = object_store::ClientOptions::new()
            .with_timeout(BUCKET_REGION_TIMEOUT)
            .with_connect_timeout(BUCKET_REGION_TIMEOUT);
        let asked = object_store::aws::resolve_bucket_region(bucket, &options);
        if let Ok(Ok(found)) = tokio::time::timeout(BUCKET_REGION_TIMEOUT, asked).await {
            region = found;
        }
    }
    Ok((
        builder.with_credentials(credentials).with_region(&region),
        region,
    ))
}

/// aws-config's credential chain as object_store's [`object_store::CredentialProvider`]: asked once,
/// kept until [`REFRESH_BEFORE`] their expiry (profile keys and environment keys never expire), then
/// asked again; credentials still valid are kept where asking again fails.
#[derive(Debug)]
struct AwsChain {
    chain: aws_credential_types::provider::SharedCredentialsProvider,
    /// Which profile the chain reads, for errors.
    profile: String,
    cached: tokio::sync::Mutex<Option<(Arc<object_store::aws::AwsCredential>, Option<SystemTime>)>>,
}

#[async_trait::async_trait]
impl object_store::CredentialProvider for AwsChain {
    type Credential = object_store::aws::AwsCredential;

    async fn get_credential(&self) -> object_store::Result<Arc<Self::Credential>> {
        use aws_credential_types::provider::ProvideCredentials;
        let mut cached = self.cached.lock().await;
        let now = SystemTime::now();
        if let Some((credential, expiry)) = &*cached
            && expiry.is_none_or(|at| at > now + REFRESH_BEFORE)
        {
            return Ok(credential.clone());
        }
        let refused = |detail: String| object_store::Error::Generic {
            store: "S3",
            source: format!(
                "the AWS credential chain ({}) gave no credentials: {detail}; {AWS_HINT}",
                self.profile
            )
            .into(),
        };
        let fetched = match self.chain.provide_credentials().await {
            Ok(c) => c,
            Err(e) => {
                return match &*cached {
                    Some((credential, Some(at))) if *at > now => Ok(credential.clone()),
                    _ => Err(refused(error_chain(&e))),
                };
            }
        };
        if let Some(at) = fetched.expiry()
            && at <= now
        {
            let ago = now.duration_since(at).unwrap_or_default().as_secs();
            return Err(refused(format!(
                "the credentials it gave expired {ago} s ago"
            )));
        }
        let credential = Arc::new(object_store::aws::AwsCredential {
            key_id: fetched.access_key_id().to_string(),
            secret_key: fetched.secret_access_key().to_string(),
            token: fetched.session_token().map(str::to_string),
        });
        *cached = Some((credential.clone(), fetched.expiry()));
        Ok(credential)
    }
}

/// One object of a store, served to workers through the coordinator ([`Remote::source`]).
struct StoreObject {
    remote: Remote,
    key: ObjPath,
}

impl physalia_control::Source for StoreObject {
    fn open(&self) -> tokio::sync::mpsc::Receiver<Result<physalia_control::Bytes, String>> {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let (store, key, url) = (
            self.remote.store.clone(),
            self.key.clone(),
            self.remote.url.clone(),
        );
        // the store's connections belong to its runtime: the GET runs there, the bytes cross over
        self.remote.rt.spawn(async move {
            let what = |e: object_store::Error| format!("{url}: reading {key}: {e}");
            let mut stream = match store.get(&key).await {
                Ok(r) => r.into_stream(),
                Err(e) => {
                    let _ = tx.send(Err(what(e))).await;
                    return;
                }
            };
            loop {
                let next = match stream.try_next().await {
                    Ok(Some(piece)) => Ok(piece),
                    Ok(None) => return,
                    Err(e) => Err(what(e)),
                };
                let failed = next.is_err();
                if tx.send(next).await.is_err() || failed {
                    return;
                }
            }
        });
        rx
    }
}

/// A job store at a URL: the store and the prefix under which each job is a folder.
#[derive(Clone)]
pub struct Remote {
    store: Arc<dyn ObjectStore>,
    prefix: ObjPath,
    url: String,
    /// The store's HTTP connections live on this runtime, so every call goes through it.
    rt: Arc<tokio::runtime::Runtime>,
    s3_region: Option<String>,
    /// The same store as a signer of URLs (S3's presigned GETs, Azure's user delegation SAS, GCS's
    /// V4 signed URLs), where it signs them.
    signer: Option<Arc<dyn object_store::signer::Signer>>,
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.url)
    }
}

impl Remote {
    /// Opens `url` (`s3://`, `az://`/`abfs://`, `gs://`).
    pub fn open(url: &str) -> Result<Remote> {
        let parsed = url::Url::parse(url).with_context(|| format!("{url}: not a URL"))?;
        let rt = runtime()?;
        let mut s3_region = None;
        /// Every store opened here is also a signer of its URLs.
        fn both<S: ObjectStore + object_store::signer::Signer>(
            s: S,
        ) -> (Arc<dyn ObjectStore>, Arc<dyn object_store::signer::Signer>) {
            let s = Arc::new(s);
            (s.clone(), s)
        }
        let (store, signer) = match parsed.scheme() {
            "s3" | "s3a" => {
                let (builder, region) = rt.block_on(s3_builder(url, &parsed))?;
                s3_region = Some(region);
                both(
                    builder
                        .build()
                        .with_context(|| format!("{url}: opening the S3 bucket"))?,
                )
            }
            "az" | "abfs" | "abfss" | "azure" => both(open_azure(
                url,
                azure_builder().with_context(|| format!("{url}: Azure's credentials"))?,
            )?),
            "gs" => both(
                object_store::gcp::GoogleCloudStorageBuilder::from_env()
                    .with_url(url)
                    .build()
                    .with_context(|| format!("{url}: opening the GCS bucket"))?,
            ),
            other => bail!("{url}: the job store takes s3://, az:// or gs:// URLs, not {other}://"),
        };
        let prefix = ObjPath::parse(parsed.path().trim_matches('/'))
            .with_context(|| format!("{url}: the path is not a valid object prefix"))?;
        Ok(Remote {
            store,
            prefix,
            url: url.trim_end_matches('/').to_string(),
            rt,
            s3_region,
            signer: Some(signer),
        })
    }

    /// A URL that lets its holder GET the object `rel` of `job`'s folder for `ttl`, without credentials
    /// of its own, signed with this store's credentials: S3's presigned GET (a task role's session
    /// token goes in the URL, so it lasts no longer than that session); on Azure a user delegation SAS
    /// (read, this one blob) under a key Blob Storage gives the bearer token's principal (object_store
    /// asks for it and caches it; a shared key signs a service SAS instead); on GCS a V4 signed URL
    /// (a service account's key, or the IAM signBlob call for the metadata server's account). `None`
    /// where this store signs no URLs (the in-memory store). An error where the credentials cannot
    /// sign (an Azure SAS as the credential, a principal without the right to a delegation key):
    /// callers fall back to relaying the object.
    pub fn signed_get(
        &self,
        job: &str,
        rel: &str,
        ttl: Duration,
    ) -> Result<Option<physalia_control::SignedUrl>> {
        let Some(signer) = self.signer.clone() else {
            return Ok(None);
        };
        let key = self.key(job, rel);
        let url = self.block(async move {
            signer
                .signed_url(object_store::signer::Method::GET, &key, ttl)
                .await
                .map_err(|e| anyhow::anyhow!("signing a URL of {key}: {e}"))
        })?;
        Ok(Some(physalia_control::SignedUrl::new(url.into())))
    }

    /// The region an S3 store's requests are signed for (see [`s3_builder`]); `None` for other stores.
    pub fn s3_region(&self) -> Option<&str> {
        self.s3_region.as_deref()
    }

    /// An in-memory store (object_store's), for tests of what goes through a store.
    pub fn in_memory(url: &str) -> Remote {
        Remote {
            store: Arc::new(object_store::memory::InMemory::new()),
            prefix: ObjPath::from(url.split_once("://").map_or(url, |(_, p)| p)),
            url: url.to_string(),
            rt: runtime().expect("a runtime"),
            s3_region: None,
            signer: None,
        }
    }

    /// The folder `rel` of this store as a store of its own (the same connections and credentials).
    pub fn child(&self, rel: &str) -> Remote {
        Remote {
            prefix: self.key(rel, ""),
            url: format!("{}/{}", self.url, rel.trim_matches('/')),
            ..self.clone()
        }
    }

    fn block<T>(&self, f: impl std::future::Future<Output = Result<T>>) -> Result<T> {
        self.rt.block_on(f)
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    fn key(&self, job: &str, rel: &str) -> ObjPath {
        let mut p = self.prefix.clone();
        for part in job.split('/').chain(rel.split('/')) {
            if !part.is_empty() {
                p = p.join(part);
            }
        }
        p
    }

    /// The jobs under the prefix (their folder names).
    pub fn jobs(&self) -> Result<Vec<String>> {
        self.block(async {
            let listed = self
                .store
                .list_with_delimiter(Some(&self.prefix))
                .await
                .with_context(|| format!("listing {}", self.url))?;
            // `.datasets` and other dot-folders are the store's, not jobs
            Ok(listed
                .common_prefixes
                .iter()
                .filter_map(|p| p.filename().map(String::from))
                .filter(|name| !name.starts_with('.'))
                .collect())
        })
    }

    /// Downloads job `job`'s record, but its checkpoints, model, dataset and partitions, into
    /// `into/<job>` and returns that folder.
    pub fn fetch(&self, job: &str, into: &Path) -> Result<PathBuf> {
        self.fetch_with(job, into, false)
    }

    /// Downloads what a coordinator resuming job `job` needs: its record with its checkpoints.
    pub fn fetch_to_resume(&self, job: &str, into: &Path) -> Result<PathBuf> {
        self.fetch_with(job, into, true)
    }

    fn fetch_with(&self, job: &str, into: &Path, checkpoints: bool) -> Result<PathBuf> {
        let root = into.join(job);
        let base = self.key(job, "");
        self.block(async {
            let objects: Vec<_> = self
                .store
                .list(Some(&base))
                .try_collect()
                .await
                .with_context(|| format!("listing {}/{job}", self.url))?;
            if objects.is_empty() {
                bail!("{}/{job}: no such job in the store", self.url);
            }
            for meta in objects {
                let Some(rel) = meta.location.prefix_match(&base) else {
                    continue;
                };
                let rel: PathBuf = rel.map(|p| p.as_ref().to_string()).collect();
                let partitions = rel
                    .components()
                    .any(|c| c.as_os_str().to_string_lossy().ends_with(".parts"));
                if partitions
                    || (rel.starts_with("checkpoints") && !checkpoints)
                    || rel == Path::new("model.safetensors")
                    || rel == Path::new("dataset.safetensors")
                {
                    continue;
                }
                let path = root.join(&rel);
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent)?;
                }
                let bytes = self
                    .store
                    .get(&meta.location)
                    .await
                    .with_context(|| format!("reading {}", meta.location))?
                    .bytes()
                    .await?;
                std::fs::write(&path, &bytes)?;
            }
            Ok(())
        })?;
        Ok(root)
    }

    /// Puts `bytes` at `<job>/<rel>`.
    pub fn put(&self, job: &str, rel: &str, bytes: Vec<u8>) -> Result<()> {
        let key = self.key(job, rel);
        self.block(async {
            self.store
                .put(&key, PutPayload::from(bytes))
                .await
                .with_context(|| format!("writing {}/{job}/{rel}", self.url))?;
            Ok(())
        })
    }

    /// Uploads the file at `path` to `<job>/<rel>`: in one request up to [`MULTIPART_AT`] bytes, in
    /// parts of that size (a few in flight) above it, so a dataset of any size goes up with bounded
    /// memory and within each store's limit on one request (5 GiB on S3). A failed multipart upload is
    /// aborted: nothing is left under the key.
    pub fn put_file(&self, job: &str, rel: &str, path: &Path) -> Result<()> {
        self.put_file_in_parts(job, rel, path, MULTIPART_AT)
    }

    fn put_file_in_parts(&self, job: &str, rel: &str, path: &Path, part: usize) -> Result<()> {
        use std::io::Read;
        let key = self.key(job, rel);
        let what = || format!("writing {}/{job}/{rel}", self.url);
        let mut f =
            std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let size = f.metadata()?.len();
        if size <= part as u64 {
            let bytes =
                std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
            return self.block(async {
                self.store
                    .put(&key, PutPayload::from(bytes))
                    .await
                    .with_context(what)?;
                Ok(())
            });
        }
        self.block(async {
            let upload = self.store.put_multipart(&key).await.with_context(what)?;
            let mut writer = object_store::WriteMultipart::new_with_chunk_size(upload, part);
            let mut buf = vec![0u8; part];
            let sent = async {
                loop {
                    let mut filled = 0;
                    while filled < part {
                        let n = f
                            .read(&mut buf[filled..])
                            .with_context(|| format!("reading {}", path.display()))?;
                        if n == 0 {
                            break;
                        }
                        filled += n;
                    }
                    if filled == 0 {
                        return anyhow::Ok(());
                    }
                    writer
                        .wait_for_capacity(MULTIPART_IN_FLIGHT)
                        .await
                        .with_context(what)?;
                    writer.write(&buf[..filled]);
                }
            }
            .await;
            match sent {
                Ok(()) => {
                    writer.finish().await.with_context(what)?;
                    Ok(())
                }
                Err(e) => {
                    let _ = writer.abort().await;
                    Err(e)
                }
            }
        })
    }

    /// Every object under `<job>/<rel>/`, by path relative to it, with its size.
    pub fn list(&self, job: &str, rel: &str) -> Result<Vec<(String, u64)>> {
        let base = self.key(job, rel);
        self.block(async {
            let objects: Vec<_> = self
                .store
                .list(Some(&base))
                .try_collect()
                .await
                .with_context(|| format!("listing {}/{job}/{rel}", self.url))?;
            Ok(objects
                .into_iter()
                .filter_map(|m| {
                    let rel: Vec<String> = m
                        .location
                        .prefix_match(&base)?
                        .map(|p| p.as_ref().to_string())
                        .collect();
                    Some((rel.join("/"), m.size))
                })
                .collect())
        })
    }

    /// The bytes at `<job>/<rel>`, `None` where there is no such object.
    pub fn get(&self, job: &str, rel: &str) -> Result<Option<Vec<u8>>> {
        let key = self.key(job, rel);
        self.block(async {
            match self.store.get(&key).await {
                Ok(r) => Ok(Some(r.bytes().await?.to_vec())),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(e).with_context(|| format!("reading {}/{job}/{rel}", self.url)),
            }
        })
    }

    /// Downloads `<job>/<rel>` into the file `to` (through a temporary name: whole or absent).
    pub fn get_file(&self, job: &str, rel: &str, to: &Path) -> Result<()> {
        let key = self.key(job, rel);
        let tmp = to.with_extension("download.tmp");
        self.block(async {
            let mut stream = self
                .store
                .get(&key)
                .await
                .with_context(|| format!("reading {}/{job}/{rel}", self.url))?
                .into_stream();
            let mut f = std::fs::File::create(&tmp)
                .with_context(|| format!("creating {}", tmp.display()))?;
            while let Some(chunk) = stream.try_next().await? {
                std::io::Write::write_all(&mut f, &chunk)?;
            }
            Ok(())
        })?;
        std::fs::rename(&tmp, to).with_context(|| format!("writing {}", to.display()))?;
        Ok(())
    }

    /// `<job>/<rel>` as a [`physalia_control::Source`]: each opening streams the object through a
    /// channel from this store's runtime, a few pieces at a time, never held whole.
    pub fn source(&self, job: &str, rel: &str) -> Arc<dyn physalia_control::Source> {
        Arc::new(StoreObject {
            remote: self.clone(),
            key: self.key(job, rel),
        })
    }

    /// A new job id for a job named `name`: `<name>-<unix seconds>[-k]`, no job of which is in the store.
    pub fn new_job_id(&self, name: &str) -> Result<String> {
        let secs = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let safe: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        for k in 0.. {
            let id = match k {
                0 => format!("{safe}-{secs}"),
                k => format!("{safe}-{secs}-{k}"),
            };
            if !self.exists(&id, "job.json")? {
                return Ok(id);
            }
        }
        unreachable!("some suffix is free")
    }

    /// The size of the object `<job>/<rel>`.
    pub fn size(&self, job: &str, rel: &str) -> Result<u64> {
        let key = self.key(job, rel);
        self.block(async {
            let meta = self
                .store
                .head(&key)
                .await
                .with_context(|| format!("reading {}/{job}/{rel}", self.url))?;
            Ok(meta.size)
        })
    }

    /// Whether `<job>/<rel>` exists.
    pub fn exists(&self, job: &str, rel: &str) -> Result<bool> {
        let key = self.key(job, rel);
        self.block(async {
            match self.store.head(&key).await {
                Ok(_) => Ok(true),
                Err(object_store::Error::NotFound { .. }) => Ok(false),
                Err(e) => Err(e).with_context(|| format!("reading {}/{job}/{rel}", self.url)),
            }
        })
    }

    /// Checks that the store can be written before a job starts: writes and deletes a marker.
    pub fn check_writable(&self) -> Result<()> {
        let key = self.key(".physalia-write-check", "");
        self.block(async {
            self.store
                .put(&key, PutPayload::from_static(b"ok"))
                .await
                .with_context(|| format!("{}: the job store cannot be written", self.url))?;
            let _ = self.store.delete(&key).await;
            Ok(())
        })
    }
}

/// A job of a store at a URL, copied into a temporary folder to be read as a local record.
pub struct Fetched {
    pub remote: Remote,
    pub id: String,
    pub dir: PathBuf,
    _tmp: tempfile::TempDir,
}

impl Fetched {
    /// The job `job` names under the store `root` (a URL): its id, the newest job of that name, or a URL
    /// of the job itself (`root` is then ignored).
    pub fn locate(job: &str, root: &Path) -> Result<Fetched> {
        let (remote, wanted) = match job.contains("://") {
            true => {
                let (base, id) = job
                    .trim_end_matches('/')
                    .rsplit_once('/')
                    .context("a job URL")?;
                (Remote::open(base)?, id.to_string())
            }
            false => (Remote::open(&root.to_string_lossy())?, job.to_string()),
        };
        let ids = remote.jobs()?;
        let id = if ids.contains(&wanted) {
            wanted
        } else {
            // `<name>-<unix seconds>[-k]`: the newest of that name
            ids.iter()
                .filter_map(|id| {
                    let rest = id.strip_prefix(&wanted)?.strip_prefix('-')?;
                    let nums: Vec<u64> = rest
                        .split('-')
                        .map(|p| p.parse().ok())
                        .collect::<Option<_>>()?;
                    Some((nums, id))
                })
                .max()
                .map(|(_, id)| id.clone())
                .with_context(|| {
                    format!(
                        "{wanted}: no such job in {} (`physalia list --dir {}` shows its jobs)",
                        remote.url(),
                        remote.url()
                    )
                })?
        };
        let tmp = tempfile::tempdir().context("making a folder for the job's record")?;
        let dir = remote.fetch(&id, tmp.path())?;
        Ok(Fetched {
            remote,
            id,
            dir,
            _tmp: tmp,
        })
    }

    /// Downloads the record again (a job that is running).
    pub fn refresh(&self) -> Result<()> {
        self.remote
            .fetch(&self.id, self.dir.parent().expect("fetched under a folder"))?;
        Ok(())
    }

    /// Where the job is, as the user names it.
    pub fn url(&self) -> String {
        format!("{}/{}", self.remote.url(), self.id)
    }
}

/// Where the records of jobs kept in an object store are staged on this machine:
/// `$XDG_CACHE_HOME/physalia/staging` (or `~/.cache/...`, else the temporary folder).
pub fn staging_root() -> PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    cache.join("physalia").join("staging")
}

/// The job store's runtime (the CLI is synchronous): one thread, which keeps the store's connections.
fn runtime() -> Result<Arc<tokio::runtime::Runtime>> {
    Ok(Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("physalia-store")
            .enable_all()
            .build()
            .context("starting the job store's runtime")?,
    ))
}

/// A job directory being mirrored to a [`Remote`] store by a thread of its own.
pub struct Mirror {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Result<()>>>,
}

/// Every two seconds, a file's (size, modification time) is compared with what was last uploaded.
const MIRROR_EVERY: Duration = Duration::from_secs(2);

type Seen = BTreeMap<String, (u64, SystemTime)>;

impl Mirror {
    /// Starts mirroring `local` to `remote`'s `<job>/`.
    pub fn start(remote: Remote, job: String, local: PathBuf) -> Mirror {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("physalia-mirror".into())
            .spawn(move || {
                let mut seen = Seen::new();
                loop {
                    let last = flag.load(Ordering::Acquire);
                    let synced = sync(&remote, &job, &local, &mut seen);
                    if last {
                        return synced;
                    }
                    if let Err(e) = synced {
                        // the store being unreachable for a moment loses nothing: the next pass
                        // uploads whatever changed since
                        tracing_line(&format!("mirroring the job record: {e:#}"));
                    }
                    let until = std::time::Instant::now() + MIRROR_EVERY;
                    while std::time::Instant::now() < until && !flag.load(Ordering::Acquire) {
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            })
            .expect("spawning the mirror thread");
        Mirror {
            stop,
            thread: Some(thread),
        }
    }

    /// Uploads what changed since the last pass, stops the thread and says whether the record is whole
    /// in the store.
    pub fn finish(mut self) -> Result<()> {
        self.stop.store(true, Ordering::Release);
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(r)) => r,
            Some(Err(_)) => bail!("the job store's mirror thread panicked"),
            None => Ok(()),
        }
    }
}

impl Drop for Mirror {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn tracing_line(s: &str) {
    eprintln!("warning: {s}");
}

/// The record's status file, which followers poll.
const STATUS: &str = "status.json";

/// One pass: uploads new and changed files, deletes removed ones, copies a `cancel` object back.
fn sync(remote: &Remote, job: &str, local: &Path, seen: &mut Seen) -> Result<()> {
    // first: a store that refuses an upload must not keep a cancel from reaching the coordinator
    if !local.join(CANCEL).exists() && remote.exists(job, CANCEL)? {
        std::fs::write(
            local.join(CANCEL),
            b"cancel requested through the job store\n",
        )?;
    }
    let mut now = Seen::new();
    walk(local, local, &mut now)?;
    // the status is read first and put last: a status in the store is never newer than the metrics,
    // summary and logs beside it (a follower that reads a final status reads every epoch with it)
    let status = match now.get(STATUS) {
        Some(stamp) if seen.get(STATUS) != Some(stamp) => match std::fs::read(local.join(STATUS)) {
            Ok(b) => Some((b, *stamp)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e).with_context(|| format!("reading {STATUS}")),
        },
        _ => None,
    };
    for (rel, stamp) in &now {
        if seen.get(rel) == Some(stamp) || rel == STATUS {
            continue;
        }
        let bytes = match std::fs::read(local.join(rel)) {
            Ok(b) => b,
            // written to a temporary name and renamed in between: the next pass has it
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e).with_context(|| format!("reading {rel}")),
        };
        remote.put(job, rel, bytes)?;
        seen.insert(rel.clone(), *stamp);
    }
    if let Some((bytes, stamp)) = status {
        remote.put(job, STATUS, bytes)?;
        seen.insert(STATUS.to_string(), stamp);
    }
    let gone: Vec<String> = seen
        .keys()
        .filter(|k| !now.contains_key(*k))
        .cloned()
        .collect();
    for rel in gone {
        let key = remote.key(job, &rel);
        remote.block(async {
            match remote.store.delete(&key).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                Err(e) => Err(e).with_context(|| format!("deleting {rel}")),
            }
        })?;
        seen.remove(&rel);
    }
    Ok(())
}

/// Files under `dir` by path relative to `root`, skipping the launch secrets and temporary files.
fn walk(root: &Path, dir: &Path, out: &mut Seen) -> Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
    };
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        let Ok(meta) = entry.metadata() else { continue };
        if meta.is_dir() {
            if dir == root && name == "secrets" {
                continue;
            }
            walk(root, &path, out)?;
        } else if meta.is_file() && !name.starts_with('.') && !name.ends_with(".tmp") {
            let rel = path
                .strip_prefix(root)
                .expect("walked under root")
                .to_string_lossy()
                .into_owned();
            out.insert(rel, (meta.len(), meta.modified()?));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The mirror over object_store's in-memory store: new, changed and deleted files follow, the
    /// secrets folder never leaves the machine, a cancel put in the store reaches the folder.
    #[test]
    fn a_record_is_mirrored_whole_and_secrets_stay_here() {
        let remote = Remote {
            store: Arc::new(object_store::memory::InMemory::new()),
            prefix: ObjPath::from("jobs"),
            url: "memory://jobs".into(),
            rt: runtime().unwrap(),
            s3_region: None,
            signer: None,
        };
        let dir = tempfile::tempdir().unwrap();
        let local = dir.path().join("j-1");
        std::fs::create_dir_all(local.join("secrets/0/worker-0")).unwrap();
        std::fs::create_dir_all(local.join("logs")).unwrap();
        std::fs::write(local.join("secrets/0/worker-0/key.pem"), "KEY").unwrap();
        std::fs::write(local.join("status.json"), "{\"state\":\"running\"}").unwrap();
        std::fs::write(local.join("logs/worker-0.log"), "a\n").unwrap();
        let mut seen = Seen::new();
        sync(&remote, "j-1", &local, &mut seen).unwrap();
        assert_eq!(remote.jobs().unwrap(), ["j-1"]);
        std::fs::write(local.join("logs/worker-0.log"), "a\nb\n").unwrap();
        std::fs::remove_file(local.join("status.json")).unwrap();
        std::fs::write(local.join("metrics.jsonl"), "{}\n").unwrap();
        sync(&remote, "j-1", &local, &mut seen).unwrap();
        let out = tempfile::tempdir().unwrap();
        let got = remote.fetch("j-1", out.path()).unwrap();
        assert_eq!(
            std::fs::read_to_string(got.join("logs/worker-0.log")).unwrap(),
            "a\nb\n"
        );
        assert!(got.join("metrics.jsonl").is_file());
        assert!(!got.join("status.json").exists(), "deleted files follow");
        assert!(!got.join("secrets").exists(), "secrets never leave");
        remote.put("j-1", CANCEL, b"x".to_vec()).unwrap();
        sync(&remote, "j-1", &local, &mut seen).unwrap();
        assert!(local.join(CANCEL).is_file());
        let err = remote.fetch("nope", out.path()).unwrap_err().to_string();
        assert!(err.contains("no such job"), "{err}");
    }

    /// Cluster mode's store calls: fresh job ids, dot-folders (uploaded datasets) that are no jobs, and
    /// whole downloads.
    #[test]
    fn job_ids_are_fresh_and_the_datasets_folder_is_no_job() {
        let remote = Remote {
            store: Arc::new(object_store::memory::InMemory::new()),
            prefix: ObjPath::from("jobs"),
            url: "memory://jobs".into(),
            rt: runtime().unwrap(),
            s3_region: None,
            signer: None,
        };
        let id = remote.new_job_id("cora gcn").unwrap();
        assert!(id.starts_with("cora_gcn-"), "{id}");
        remote.put(&id, "job.json", b"{}".to_vec()).unwrap();
        let next = remote.new_job_id("cora gcn").unwrap();
        assert_eq!(next, format!("{id}-1"));
        remote
            .put(".datasets", "0123-cora.safetensors", b"bytes".to_vec())
            .unwrap();
        assert_eq!(remote.jobs().unwrap(), std::slice::from_ref(&id));
        assert_eq!(remote.get(&id, "job.json").unwrap().unwrap(), b"{}");
        assert_eq!(remote.get(&id, "nope.json").unwrap(), None);
        let dir = tempfile::tempdir().unwrap();
        let to = dir.path().join("cora.safetensors");
        remote
            .get_file(".datasets", "0123-cora.safetensors", &to)
            .unwrap();
        assert_eq!(std::fs::read(&to).unwrap(), b"bytes");
        assert!(
            remote
                .get_file(".datasets", "missing", &dir.path().join("m"))
                .is_err()
        );
    }

    /// A file larger than the part size goes up in parts and comes back whole; one that fits goes up in
    /// one request; a listing names what is under a folder with sizes.
    #[test]
    fn a_large_file_goes_up_in_parts_and_comes_back_whole() {
        let remote = Remote {
            store: Arc::new(object_store::memory::InMemory::new()),
            prefix: ObjPath::from("jobs"),
            url: "memory://jobs".into(),
            rt: runtime().unwrap(),
            s3_region: None,
            signer: None,
        };
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("big.bin");
        // 2.5 parts of 64 KiB (the memory store takes parts of any size)
        let bytes: Vec<u8> = (0..163_840u32).map(|i| (i * 7919 % 251) as u8).collect();
        std::fs::write(&big, &bytes).unwrap();
        remote
            .put_file_in_parts(".datasets", "x.parts/k2-seed0/part0.bin", &big, 64 << 10)
            .unwrap();
        let small = dir.path().join("small.bin");
        std::fs::write(&small, b"small").unwrap();
        remote
            .put_file_in_parts(
                ".datasets",
                "x.parts/k2-seed0/partition.bin",
                &small,
                64 << 10,
            )
            .unwrap();
        let to = dir.path().join("back.bin");
        remote
            .get_file(".datasets", "x.parts/k2-seed0/part0.bin", &to)
            .unwrap();
        assert_eq!(std::fs::read(&to).unwrap(), bytes);
        let mut listed = remote.list(".datasets", "x.parts").unwrap();
        listed.sort();
        assert_eq!(
            listed,
            [
                ("k2-seed0/part0.bin".to_string(), bytes.len() as u64),
                ("k2-seed0/partition.bin".to_string(), 5)
            ]
        );
        assert!(remote.list(".datasets", "y.parts").unwrap().is_empty());
        // a file that cannot be read leaves nothing behind
        let err = remote
            .put_file(".datasets", "gone", &dir.path().join("missing"))
            .unwrap_err();
        assert!(format!("{err:#}").contains("missing"), "{err:#}");
        assert!(!remote.exists(".datasets", "gone").unwrap());
    }

    /// Issue 30: an `az://` store without an account names the variable that sets it and the URL, not
    /// object_store's "Account must be specified".
    #[test]
    fn a_missing_azure_account_names_the_variable_and_the_url() {
        let builder = object_store::azure::MicrosoftAzureBuilder::new();
        let err = open_azure("az://jobs/runs", builder)
            .unwrap_err()
            .to_string();
        assert!(err.contains("AZURE_STORAGE_ACCOUNT_NAME"), "{err}");
        assert!(err.starts_with("az://jobs/runs: "), "{err}");
        assert!(!err.contains("Account must be specified"), "{err}");
        // named in the URL, or by the variable's key: no such error
        let builder =
            object_store::azure::MicrosoftAzureBuilder::new().with_bearer_token_authorization("t");
        open_azure(
            "abfss://jobs@physaliastore.dfs.core.windows.net/runs",
            builder.clone(),
        )
        .unwrap();
        open_azure("az://jobs/runs", builder.with_account("physaliastore")).unwrap();
    }

    #[test]
    fn urls_are_told_from_folders_and_unknown_schemes_refused() {
        assert!(is_url(Path::new("s3://b/jobs")));
        assert!(!is_url(Path::new("jobs")));
        let err = Remote::open("ftp://x/y").unwrap_err().to_string();
        assert!(err.contains("s3://, az:// or gs://"), "{err}");
    }
}
