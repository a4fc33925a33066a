//! TLS, both ways: the client side to `https://` workers, and the API's own certificate, built
//! from PEM files once at start (a bad file is a configuration error).
//!
//! Both sides use rustls with the `ring` provider passed in, never a process-wide default.
//! To workers, trust is the system's roots (`rustls-native-certs`: the OS store, or the
//! `SSL_CERT_FILE` / `SSL_CERT_DIR` it names) plus every certificate of each
//! `--ca-cert-paths` file; with `--client-cert-path` and `--client-key-path` the router
//! presents that identity (mTLS). The connector (`http`) sends an `https://` URL over TLS
//! only, never in the clear. For clients, `--tls-cert-path` and `--tls-key-path`: the server
//! re-reads them on SIGHUP ([`ApiCertificate::reload`]) and each connection uses the
//! certificate current when it was accepted. KV events are not here: they stay on ZMQ over TCP.

use std::error::Error as StdError;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore, ServerConfig};

/// A certificate or key file that cannot be used; each names its file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read the {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        source: pem::Error,
    },
    #[error("no {what} in {path} (expected PEM, -----BEGIN {marker}-----)")]
    Empty {
        what: &'static str,
        marker: &'static str,
        path: PathBuf,
    },
    #[error("invalid CA certificate in {path}: {source}")]
    Ca {
        path: PathBuf,
        source: rustls::Error,
    },
    #[error("the key {key} does not go with the certificate {cert}: {source}")]
    Identity {
        cert: PathBuf,
        key: PathBuf,
        source: rustls::Error,
    },
    #[error("cannot set up TLS: {0}")]
    Setup(rustls::Error),
}

/// TLS as configured: how `https://` workers are reached, and the API's certificate.
#[derive(Debug, Clone)]
pub struct TlsSettings {
    /// The client side to https workers: the trusted roots and, for mTLS, the identity.
    pub workers: Arc<ClientConfig>,
    /// The API serves https with this certificate; plain HTTP when absent.
    pub api: Option<ApiCertificate>,
}

impl TlsSettings {
    /// Trust in the system's roots only, no client identity, and a plain-HTTP API.
    pub fn system() -> Self {
        Self {
            workers: client_config(&[], None).expect("no file to read"),
            api: None,
        }
    }
}

/// The API's certificate and key files, and the server configuration read from them.
#[derive(Debug, Clone)]
pub struct ApiCertificate {
    pub cert_path: PathBuf,
    pub key_path: PathBuf,
    /// As read at start.
    pub config: Arc<ServerConfig>,
}

impl ApiCertificate {
    pub fn load(cert_path: PathBuf, key_path: PathBuf) -> Result<Self, TlsError> {
        let config = server_config(&cert_path, &key_path)?;
        Ok(Self {
            cert_path,
            key_path,
            config,
        })
    }

    /// Reads the files again: the configuration for connections accepted from now on.
    pub fn reload(&self) -> Result<Arc<ServerConfig>, TlsError> {
        server_config(&self.cert_path, &self.key_path)
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Every certificate in a PEM file (at least one).
pub fn read_certs(
    path: &Path,
    what: &'static str,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let read = |source| TlsError::Read {
        what,
        path: path.to_owned(),
        source,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(read)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(read)?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            what,
            marker: "CERTIFICATE",
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|source| match source {
        pem::Error::NoItemsFound => TlsError::Empty {
            what: "private key",
            marker: "PRIVATE KEY",
            path: path.to_owned(),
        },
        source => TlsError::Read {
            what: "private key",
            path: path.to_owned(),
            source,
        },
    })
}

/// The client configuration to https workers: the system's roots and every certificate of
/// `ca_paths` trusted; with `identity` (certificate, key), that certificate presented.
pub fn client_config(
    ca_paths: &[PathBuf],
    identity: Option<(&Path, &Path)>,
) -> Result<Arc<ClientConfig>, TlsError> {
    let mut roots = RootCertStore::empty();
    // A system root that does not parse is skipped, as every TLS client does.
    roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
    for path in ca_paths {
        for cert in read_certs(path, "CA certificate")? {
            roots.add(cert).map_err(|source| TlsError::Ca {
                path: path.clone(),
                source,
            })?;
        }
    }
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Setup)?
        .with_root_certificates(roots);
    let config = match identity {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => builder
            .with_client_auth_cert(read_certs(cert, "client certificate")?, read_key(key)?)
            .map_err(|source| TlsError::Identity {
                cert: cert.to_owned(),
                key: key.to_owned(),
                source,
            })?,
    };
    Ok(Arc::new(config))
}

/// The server configuration of the API: this certificate chain and its key, HTTP/1.1.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, TlsError> {
    let chain = read_certs(cert, "certificate")?;
    let key_der = read_key(key)?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Setup)?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .map_err(|source| TlsError::Identity {
            cert: cert.to_owned(),
            key: key.to_owned(),
            source,
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The TLS error somewhere in an error's chain of causes (a certificate that does not
/// verify, an alert from the peer): rustls's error travels inside an `io::Error`, at times
/// inside another.
pub fn tls_cause<'a>(mut error: &'a (dyn StdError + 'static)) -> Option<&'a rustls::Error> {
    loop {
        if let Some(e) = error.downcast_ref::<rustls::Error>() {
            return Some(e);
        }
        // An `io::Error` gives its inner error's cause as its own: step into the inner one.
        error = match error
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::get_ref)
        {
            Some(inner) => inner,
            None => error.source()?,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tls_cause_is_found_inside_nested_io_errors() {
        let tls = rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer);
        let inner = std::io::Error::new(std::io::ErrorKind::InvalidData, tls.clone());
        let outer = std::io::Error::other(inner);
        assert_eq!(tls_cause(&outer), Some(&tls));
        assert_eq!(tls_cause(&std::io::Error::other("refused")), None);
    }
}
