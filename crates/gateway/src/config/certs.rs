//! The TLS flags into [`TlsSettings`]: pairs checked, every file read once.

use std::path::{Path, PathBuf};

use super::ConfigError;
use crate::tls::{client_config, ApiCertificate, TlsSettings};

/// TLS to the workers and for the clients; each certificate goes with its key (both or
/// neither), and every file is read now, so a bad one stops the start.
pub(super) fn tls_settings(
    ca_cert_paths: &[PathBuf],
    client_cert: Option<&Path>,
    client_key: Option<&Path>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
) -> Result<TlsSettings, ConfigError> {
    let identity = match (client_cert, client_key) {
        (Some(cert), Some(key)) => Some((cert, key)),
        (None, None) => None,
        (Some(_), None) | (None, Some(_)) => {
            return Err(ConfigError::Invalid {
                name: "client_cert_path",
                reason: "--client-cert-path and --client-key-path go together",
            })
        }
    };
    let api = match (tls_cert, tls_key) {
        (Some(cert), Some(key)) => Some(ApiCertificate::load(cert, key)?),
        (None, None) => None,
        (Some(_), None) | (None, Some(_)) => {
            return Err(ConfigError::Invalid {
                name: "tls_cert_path",
                reason: "--tls-cert-path and --tls-key-path go together",
            })
        }
    };
    Ok(TlsSettings {
        workers: client_config(ca_cert_paths, identity)?,
        api,
    })
}

impl super::Args {
    /// `--ca-cert-path`, `--client-cert-path`/`--client-key-path` and
    /// `--tls-cert-path`/`--tls-key-path`.
    pub(super) fn take_tls(&mut self) -> Result<TlsSettings, ConfigError> {
        tls_settings(
            &self.ca_cert_paths,
            self.client_cert_path.as_deref(),
            self.client_key_path.as_deref(),
            self.tls_cert_path.take(),
            self.tls_key_path.take(),
        )
    }
}
