//! The job's certificate authority and the rustls configurations built from it.
//!
//! Every job gets its own CA ([`JobCa`]), created by the coordinator and never reused. Each worker gets one
//! certificate from it, named [`worker_name`]`(rank)`, usable both as a TLS server and as a TLS client,
//! because every worker both accepts and dials. The server configuration requires a client certificate
//! chaining to the job CA ([`WebPkiClientVerifier`]); the client configuration presents the worker's
//! certificate and trusts only the job CA. A process of another job, or one with no certificate, fails the
//! handshake (design invariant 5).
//!
//! One crypto provider everywhere: aws-lc-rs, passed explicitly to every builder and also installed as the
//! process default by [`install_crypto_provider`] (idempotent), so code elsewhere that asks rustls for the
//! default finds the same one.

use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::WireError;

/// The ALPN protocol both sides require.
pub const ALPN: &[u8] = b"physalia/1";

/// The certificate name of rank `rank`: the peer identity the mesh checks against the rank a peer claims.
pub fn worker_name(rank: usize) -> String {
    format!("worker-{rank}")
}

/// The 64-bit job id that frames carry, derived from the job's name (FNV-1a: stable across builds and
/// platforms, unlike `std`'s hasher). It tells frames of different jobs apart; it is not a secret, the CA
/// is what keeps other jobs out.
pub fn job_key(job_id: &str) -> u64 {
    job_id.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Makes aws-lc-rs the process-wide default provider; later calls (and a provider already installed by
/// someone else) are fine.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// A per-job certificate authority.
pub struct JobCa {
    job_id: String,
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl std::fmt::Debug for JobCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobCa")
            .field("job_id", &self.job_id)
            .finish_non_exhaustive()
    }
}

impl JobCa {
    pub fn new(job_id: &str) -> Result<JobCa, WireError> {
        install_crypto_provider();
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params
            .distinguished_name
            .push(DnType::CommonName, format!("physalia job {job_id} CA"));
        params
            .distinguished_name
            .push(DnType::OrganizationName, "physalia");
        // The CA signs leaves only: no intermediate may be issued under it.
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
        Ok(JobCa {
            job_id: job_id.to_string(),
            issuer,
        })
    }

    pub fn job_id(&self) -> &str {
        &self.job_id
    }

    /// [`job_key`] of this job's id.
    pub fn job_key(&self) -> u64 {
        job_key(&self.job_id)
    }

    pub fn cert_pem(&self) -> String {
        self.issuer.pem()
    }

    /// A certificate and key for `worker_name`, with both server and client authentication usages.
    /// Returns `(cert_pem, key_pem)`.
    pub fn issue(&self, worker_name: &str) -> Result<(String, String), WireError> {
        let mut params = CertificateParams::new(vec![worker_name.to_string()])?;
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, worker_name);
        params.distinguished_name.push(
            DnType::OrganizationName,
            format!("physalia job {}", self.job_id),
        );
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// Everything worker `worker_name` needs to join the mesh.
    pub fn identity(&self, worker_name: &str) -> Result<TlsIdentity, WireError> {
        let (cert_pem, key_pem) = self.issue(worker_name)?;
        Ok(TlsIdentity {
            ca_pem: self.cert_pem(),
            cert_pem,
            key_pem,
        })
    }
}

/// A worker's TLS material, as PEM: the job CA's certificate, its own certificate and its private key.
#[derive(Clone)]
pub struct TlsIdentity {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for TlsIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsIdentity")
            .field("cert_pem", &self.cert_pem)
            .finish_non_exhaustive()
    }
}

pub(crate) fn certs_from_pem(
    pem: &str,
    what: &'static str,
) -> Result<Vec<CertificateDer<'static>>, WireError> {
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| WireError::Pem {
            what,
            reason: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(WireError::Pem {
            what,
            reason: "no certificate found".into(),
        });
    }
    Ok(certs)
}

fn key_from_pem(pem: &str) -> Result<PrivateKeyDer<'static>, WireError> {
    PrivateKeyDer::from_pem_slice(pem.as_bytes()).map_err(|e| WireError::Pem {
        what: "private key",
        reason: e.to_string(),
    })
}

pub(crate) fn roots_from_pem(ca_pem: &str) -> Result<RootCertStore, WireError> {
    let mut roots = RootCertStore::empty();
    for cert in certs_from_pem(ca_pem, "job CA certificate")? {
        roots.add(cert)?;
    }
    Ok(roots)
}

/// TLS 1.3 server configuration that requires a client certificate issued by the job CA.
pub fn server_config(identity: &TlsIdentity) -> Result<ServerConfig, WireError> {
    install_crypto_provider();
    let roots = roots_from_pem(&identity.ca_pem)?;
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
        .build()
        .map_err(|e| WireError::Tls(rustls::Error::General(e.to_string())))?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            certs_from_pem(&identity.cert_pem, "worker certificate")?,
            key_from_pem(&identity.key_pem)?,
        )?;
    config.alpn_protocols = vec![ALPN.to_vec()];
    Ok(config)
}

/// TLS 1.3 client configuration that presents the worker's certificate and trusts only the job CA.
pub fn client_config(identity: &TlsIdentity) -> Result<ClientConfig, WireError> {
    install_crypto_provider();
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots_from_pem(&identity.ca_pem)?)
        .with_client_auth_cert(
            certs_from_pem(&identity.cert_pem, "worker certificate")?,
            key_from_pem(&identity.key_pem)?,
        )?;
    config.alpn_protocols = vec![ALPN.to_vec()];
    Ok(config)
}

/// Checks that `cert` (already verified against the job CA by the handshake) names `name`.
pub fn check_cert_name(cert: &CertificateDer<'_>, name: &str) -> Result<(), String> {
    let server_name = rustls_pki_types::ServerName::try_from(name.to_string())
        .map_err(|e| format!("{name:?} is not a certificate name: {e}"))?;
    let parsed = rustls::server::ParsedCertificate::try_from(cert).map_err(|e| e.to_string())?;
    rustls::client::verify_server_name(&parsed, &server_name).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issued_certificates_build_both_configs_and_carry_the_worker_name() {
        let ca = JobCa::new("job-a").unwrap();
        let identity = ca.identity(&worker_name(2)).unwrap();
        server_config(&identity).unwrap();
        client_config(&identity).unwrap();
        let cert = &certs_from_pem(&identity.cert_pem, "cert").unwrap()[0];
        check_cert_name(cert, "worker-2").unwrap();
        assert!(check_cert_name(cert, "worker-1").is_err());
        assert_eq!(job_key(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(job_key("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(ca.job_key(), job_key("job-a"));
    }

    #[test]
    fn bad_pem_is_an_error_naming_what() {
        let ca = JobCa::new("job-a").unwrap();
        let mut identity = ca.identity("worker-0").unwrap();
        identity.key_pem = "not a key".into();
        let err = server_config(&identity).unwrap_err().to_string();
        assert!(err.starts_with("bad pem (private key)"), "{err}");
        identity.ca_pem = String::new();
        let err = client_config(&identity).unwrap_err().to_string();
        assert!(err.starts_with("bad pem (job CA certificate)"), "{err}");
    }
}
