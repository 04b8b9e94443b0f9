//! The crate's one error type. Each launch failure a user can fix (credentials, permissions, quota, image,
//! a GPU the platform does not offer) is its own variant, whose message says which credential, quota or
//! image and what to do about it; everything else from a platform API is [`Error::Api`].

/// A backend's name, as in the job file's `backend:` field.
pub type BackendName = &'static str;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid worker spec: {0}")]
    InvalidSpec(String),

    /// The backend's configuration (not the spec) is unusable: a missing subscription, a bad endpoint.
    #[error("{backend}: {detail}")]
    Config {
        backend: BackendName,
        detail: String,
    },

    /// The platform refused who we are: an expired token, a wrong kubeconfig user.
    #[error("{backend}: the platform refused the credentials ({credential}): {detail}; {hint}")]
    Credentials {
        backend: BackendName,
        credential: String,
        detail: String,
        hint: String,
    },

    /// We are known, but not allowed to do this.
    #[error("{backend}: permission denied to {action}: {detail}; {hint}")]
    Permission {
        backend: BackendName,
        action: String,
        detail: String,
        hint: String,
    },

    #[error("{backend}: quota exceeded{}: {detail}", rank_suffix(*.rank))]
    Quota {
        backend: BackendName,
        rank: Option<usize>,
        detail: String,
    },

    /// The platform has no machine to put the worker on (ECS `RESOURCE:MEMORY`, `RESOURCE:GPU`).
    #[error("{backend}: no capacity for worker {rank}: {detail}")]
    NoCapacity {
        backend: BackendName,
        rank: usize,
        detail: String,
    },

    /// The platform's API refused to go faster even after retries (ECS `ThrottlingException`).
    #[error(
        "{backend}: {operation} was throttled by the API after {attempts} attempts: {detail}; {hint}"
    )]
    Throttled {
        backend: BackendName,
        operation: String,
        attempts: u32,
        detail: String,
        hint: String,
    },

    #[error("{backend}: image {image} could not be pulled for worker {rank}: {detail}")]
    ImageMissing {
        backend: BackendName,
        image: String,
        rank: usize,
        detail: String,
    },

    /// The platform does not offer what the spec asks for (ACI and GPUs).
    #[error("{backend}: {detail}")]
    Unsupported {
        backend: BackendName,
        detail: String,
    },

    #[error("{backend}: worker {rank} failed to start: {detail}")]
    WorkerFailed {
        backend: BackendName,
        rank: usize,
        detail: String,
    },

    /// The coordinator could not start (its image, its container, the platform's refusal).
    #[error("{backend}: the coordinator could not start: {detail}")]
    CoordinatorFailed {
        backend: BackendName,
        detail: String,
    },

    #[error("{backend}: gave up after {waited_s} s waiting for {what}")]
    Timeout {
        backend: BackendName,
        what: String,
        waited_s: u64,
    },

    /// A launch's platform objects already exist (the same job id and segment launched twice).
    #[error("{backend}: {what} already exists; stop that launch first or use a new segment")]
    AlreadyExists { backend: BackendName, what: String },

    #[error("{backend}: launch {launch} has no worker {rank}")]
    NoSuchWorker {
        backend: BackendName,
        launch: String,
        rank: usize,
    },

    #[error("{backend}: {operation} failed{}: {detail}", status_suffix(*.status))]
    Api {
        backend: BackendName,
        operation: String,
        status: Option<u16>,
        detail: String,
    },

    /// A launch failed and cleaning up what it had created failed too: the listed objects may still exist.
    #[error("{source}; cleaning up the half-launched job also failed, these may still exist: {}", .leftovers.join(", "))]
    CleanupFailed {
        #[source]
        source: Box<Error>,
        leftovers: Vec<String>,
    },
}

fn rank_suffix(rank: Option<usize>) -> String {
    rank.map(|r| format!(" launching worker {r}"))
        .unwrap_or_default()
}

fn status_suffix(status: Option<u16>) -> String {
    status.map(|s| format!(" (HTTP {s})")).unwrap_or_default()
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A failed launch's error once its cleanup ran: itself, or [`Error::CleanupFailed`] naming what the
    /// platform would not delete.
    pub(crate) fn after_cleanup(self, leftovers: Vec<String>) -> Error {
        if leftovers.is_empty() {
            self
        } else {
            Error::CleanupFailed {
                source: Box::new(self),
                leftovers,
            }
        }
    }

    /// `stop_all`'s answer once it tried to delete everything of `launch`.
    pub(crate) fn stop_all_result(
        backend: BackendName,
        launch: &crate::LaunchId,
        leftovers: Vec<String>,
    ) -> Result<()> {
        if leftovers.is_empty() {
            Ok(())
        } else {
            Err(Error::Api {
                backend,
                operation: format!("stop launch {launch}"),
                status: None,
                detail: format!("could not delete {}", leftovers.join(", ")),
            })
        }
    }

    /// The same error, said to be about worker `rank` where it names none yet.
    pub(crate) fn at_rank(self, rank: usize) -> Error {
        match self {
            Error::Quota {
                backend,
                rank: None,
                detail,
            } => Error::Quota {
                backend,
                rank: Some(rank),
                detail,
            },
            Error::Api {
                backend,
                operation,
                status,
                detail,
            } => Error::Api {
                backend,
                operation: format!("{operation} (worker {rank})"),
                status,
                detail,
            },
            other => other,
        }
    }
}
