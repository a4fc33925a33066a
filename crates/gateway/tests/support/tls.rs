//! Real TLS in tests: certificate authorities and certificates made in the test (rcgen),
//! their PEM files in a directory of the test's own, and https clients that trust given CAs.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use http::Method;
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};

use super::{send_via, Reply};

/// A certificate authority of the test's own.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate for 127.0.0.1 and localhost, for a server or a client, with its key.
pub struct Identity {
    pub cert_pem: String,
    pub key_pem: String,
    pub der: CertificateDer<'static>,
}

impl TestCa {
    pub fn new(name: &str) -> TestCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        TestCa { issuer }
    }

    /// The CA's certificate, PEM.
    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A certificate named `name`, valid for 127.0.0.1 and localhost, signed by this CA.
    pub fn issue(&self, name: &str) -> Identity {
        let mut params =
            CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Identity {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().clone(),
        }
    }
}

/// A directory of PEM files, removed when dropped.
pub struct CertDir(PathBuf);

impl CertDir {
    pub fn new(test: &str) -> CertDir {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("kvroute-tls-{test}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        CertDir(dir)
    }

    /// Writes `contents` to the file `name`: its path.
    pub fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, contents).unwrap();
        path
    }

    /// Writes `identity` as `NAME.pem` and `NAME.key`: their paths.
    pub fn identity(&self, name: &str, identity: &Identity) -> (PathBuf, PathBuf) {
        (
            self.write(&format!("{name}.pem"), &identity.cert_pem),
            self.write(&format!("{name}.key"), &identity.key_pem),
        )
    }
}

impl Drop for CertDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A path as a command-line argument.
pub fn arg(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// A client configuration trusting `cas` (PEM) only, presenting `identity` when given.
pub fn client_tls(cas: &[&str], identity: Option<&Identity>) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    for pem in cas {
        for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
            roots.add(cert.unwrap()).unwrap();
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    match identity {
        None => builder.with_no_client_auth(),
        Some(id) => builder
            .with_client_auth_cert(
                vec![id.der.clone()],
                rustls::pki_types::PrivateKeyDer::from_pem_slice(id.key_pem.as_bytes()).unwrap(),
            )
            .unwrap(),
    }
}

pub type HttpsClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// An https client trusting `cas` (PEM) only; it refuses plain http URLs.
pub fn https_client(cas: &[&str]) -> HttpsClient {
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(client_tls(cas, None))
        .https_only()
        .enable_http1()
        .build();
    Client::builder(TokioExecutor::new()).build(connector)
}

pub async fn post_https(client: &HttpsClient, url: &str, path: &str, body: &str) -> Reply {
    send_via(client, url, Method::POST, path, &[], body.to_owned()).await
}

pub async fn get_https(client: &HttpsClient, url: &str, path: &str) -> Reply {
    send_via(client, url, Method::GET, path, &[], Bytes::new()).await
}

/// A TLS connection to `addr` (as 127.0.0.1) trusting `cas`: the stream, with the
/// certificate the server presented first in its chain.
pub async fn tls_connect(
    addr: SocketAddr,
    cas: &[&str],
) -> (
    tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    CertificateDer<'static>,
) {
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client_tls(cas, None)));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = ServerName::IpAddress(addr.ip().into());
    let stream = connector.connect(name, tcp).await.unwrap();
    let presented = stream.get_ref().1.peer_certificates().unwrap()[0].clone();
    (stream, presented)
}
