//! kvroute-sim over https, with certificates made in the test: https only, handshakes
//! counted (plain text too), a crash and restart on the same port, and client certificates
//! required with `--tls-client-ca-path`.

mod support;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa, KeyPair,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use support::{metric, start, wait_until};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A CA, a certificate for 127.0.0.1 it signed, and their PEM files.
struct Pki {
    dir: PathBuf,
    ca: CertificateDer<'static>,
    leaf: (CertificateDer<'static>, KeyPair),
}

impl Pki {
    fn new(test: &str) -> Pki {
        let dir =
            std::env::temp_dir().join(format!("kvroute-sim-tls-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let mut params = CertificateParams::new(vec!["127.0.0.1".to_owned()]).unwrap();
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().unwrap();
        let leaf = params.signed_by(&key, &ca).unwrap();
        std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
        std::fs::write(dir.join("sim.pem"), leaf.pem()).unwrap();
        std::fs::write(dir.join("sim.key"), key.serialize_pem()).unwrap();
        Pki {
            dir,
            ca: ca.der().clone(),
            leaf: (leaf.der().clone(), key),
        }
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).to_str().unwrap().to_owned()
    }

    /// A TLS client trusting the CA, presenting the leaf certificate when `identify`.
    fn client(&self, identify: bool) -> tokio_rustls::TlsConnector {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.ca.clone()).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        let config = if identify {
            let key = PrivatePkcs8KeyDer::from(self.leaf.1.serialize_der());
            builder
                .with_client_auth_cert(vec![self.leaf.0.clone()], PrivateKeyDer::Pkcs8(key))
                .unwrap()
        } else {
            builder.with_no_client_auth()
        };
        tokio_rustls::TlsConnector::from(Arc::new(config))
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `GET path` on a new connection closed after the answer: the whole answer, empty when the
/// server answered nothing.
async fn get_over<S>(mut stream: S, path: &str) -> String
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let request = format!("GET {path} HTTP/1.1\r\nhost: sim\r\nconnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).await.is_err() {
        return String::new();
    }
    let mut answer = Vec::new();
    // A close without close_notify, or the server's alert, ends the answer.
    let _ = stream.read_to_end(&mut answer).await;
    String::from_utf8_lossy(&answer).into_owned()
}

async fn get_tls(client: &tokio_rustls::TlsConnector, addr: SocketAddr, path: &str) -> String {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = ServerName::IpAddress(addr.ip().into());
    match client.connect(name, tcp).await {
        Ok(stream) => get_over(stream, path).await,
        Err(_) => String::new(),
    }
}

#[tokio::test]
async fn with_the_tls_flags_it_serves_https_only_and_counts_handshakes() {
    let pki = Pki::new("https");
    let (cert, key) = (pki.path("sim.pem"), pki.path("sim.key"));
    let sim = start(&["--tls-cert-path", &cert, "--tls-key-path", &key]).await;
    assert!(sim.url().starts_with("https://127.0.0.1:"), "{}", sim.url());
    let addr = sim.addr();
    let plain = get_over(TcpStream::connect(addr).await.unwrap(), "/health").await;
    assert_eq!(plain, "", "no answer in plain text");
    let client = pki.client(false);
    let answer = get_tls(&client, addr, "/metrics").await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let handshakes = "kvroute_sim_tls_handshakes_total";
    assert_eq!(metric(&answer, handshakes, &[r#"result="plaintext""#]), 1.0);
    assert_eq!(metric(&answer, handshakes, &[r#"result="ok""#]), 1.0);

    // A crash closes the https port; a restart serves https on it again.
    sim.crash();
    let mut sim = sim;
    assert!(sim.wait().await.unwrap_err().is::<kvroute_sim::Crashed>());
    let sim = sim.restart().await.unwrap();
    assert_eq!(sim.addr(), addr);
    let answer = get_tls(&client, addr, "/health").await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    sim.stop().await.unwrap();
}

#[tokio::test]
async fn with_a_client_ca_it_requires_a_client_certificate() {
    let pki = Pki::new("mtls");
    let (cert, key, ca) = (pki.path("sim.pem"), pki.path("sim.key"), pki.path("ca.pem"));
    let flags = [
        "--tls-cert-path",
        &cert,
        "--tls-key-path",
        &key,
        "--tls-client-ca-path",
        &ca,
    ];
    let sim = start(&flags).await;
    let without = get_tls(&pki.client(false), sim.addr(), "/health").await;
    assert_eq!(without, "", "refused without a client certificate");
    let with = get_tls(&pki.client(true), sim.addr(), "/health").await;
    assert!(with.starts_with("HTTP/1.1 200"), "{with}");
    // The refused handshake is counted once its task is done with it.
    let client = pki.client(true);
    wait_until("the refused handshake to be counted", || async {
        let m = get_tls(&client, sim.addr(), "/metrics").await;
        m.contains(r#"kvroute_sim_tls_handshakes_total{result="failed"} 1"#)
    })
    .await;
    sim.stop().await.unwrap();
}

#[test]
fn tls_flags_go_together() {
    use clap::Parser;
    for bad in [
        &["--tls-cert-path", "c.pem"][..],
        &["--tls-key-path", "k.pem"],
        &["--tls-client-ca-path", "ca.pem"],
    ] {
        let args = kvroute_sim::SimArgs::parse_from(["kvroute-sim"].iter().chain(bad));
        let error = args.validate().unwrap_err().to_string();
        assert!(error.contains("--tls-"), "{error}");
    }
    let args = kvroute_sim::SimArgs::parse_from([
        "kvroute-sim",
        "--tls-cert-path",
        "c",
        "--tls-key-path",
        "k",
    ]);
    assert!(args.validate().is_ok());
    assert_eq!(args.scheme(), "https");
}
