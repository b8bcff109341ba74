//! Self-generated TLS material for one control plane: a CA, the apiserver's serving
//! certificate for 127.0.0.1, and the service-account signing key.

use std::path::Path;

use anyhow::{Context, Result};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, SanType};

pub struct Pki {
    pub ca_pem: String,
}

/// Writes `ca.crt`, `apiserver.crt`, `apiserver.key`, `sa.key` and `sa.pub` into `dir`.
pub fn generate(dir: &Path) -> Result<Pki> {
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.distinguished_name.push(DnType::CommonName, "traffic-policy-operator test CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key)?;

    let serving_key = KeyPair::generate()?;
    let mut serving = CertificateParams::new(vec!["localhost".to_string(), "kubernetes.default.svc".to_string()])?;
    serving.subject_alt_names.push(SanType::IpAddress("127.0.0.1".parse()?));
    serving.distinguished_name.push(DnType::CommonName, "kube-apiserver");
    let issuer = rcgen::Issuer::from_params(&ca_params, &ca_key);
    let serving_cert = serving.signed_by(&serving_key, &issuer)?;

    let sa_key = KeyPair::generate()?;

    let write = |name: &str, contents: &str| {
        std::fs::write(dir.join(name), contents).with_context(|| format!("write {name} in {}", dir.display()))
    };
    write("ca.crt", &ca_cert.pem())?;
    write("apiserver.crt", &serving_cert.pem())?;
    write("apiserver.key", &serving_key.serialize_pem())?;
    write("sa.key", &sa_key.serialize_pem())?;
    write("sa.pub", &sa_key.public_key_pem())?;
    Ok(Pki { ca_pem: ca_cert.pem() })
}

/// A self-signed serving certificate for 127.0.0.1 and its key (PEM), which is its own CA:
/// a test replaces a server's certificate with it and trusts only it.
pub fn self_signed_localhost() -> Result<(String, String)> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(vec!["localhost".to_string()])?;
    params.subject_alt_names.push(SanType::IpAddress("127.0.0.1".parse()?));
    params.distinguished_name.push(DnType::CommonName, "traffic-policy-operator test serving certificate");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    Ok((params.self_signed(&key)?.pem(), key.serialize_pem()))
}
