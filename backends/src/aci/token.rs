//! Bearer tokens for Azure Resource Manager.
//!
//! The backend asks a [`TokenProvider`] for a token before every request and never caches one itself.
//! [`StaticToken`] serves tests and a token from `az account get-access-token`; with the `azure-identity`
//! feature, [`AzureIdentityToken`] wraps any `azure_identity` credential (managed identity, workload
//! identity, the Azure CLI), which caches and refreshes. The feature is off by default: azure_core and
//! azure_identity add build time to every workspace build and their API still moves between releases,
//! while everything else the backend needs is one HTTP client.

use async_trait::async_trait;

use crate::error::Result;

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
