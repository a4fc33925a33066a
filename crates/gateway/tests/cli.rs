//! The `kvroute` binary's start-up: exit statuses and the policy log line.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

fn kvroute() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
}

#[test]
fn unknown_policy_exits_2_and_lists_valid_names() {
    let out = kvroute()
        .args(["--worker-urls", "http://127.0.0.1:1", "--policy", "fastest"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    for name in kvroute_core::PolicyKind::ALL {
        assert!(err.contains(name.name()), "{err}");
    }
    assert!(err.contains("fastest"), "{err}");
}

#[test]
fn unknown_policy_in_config_file_exits_2() {
    let dir = std::env::temp_dir().join(format!("kvroute-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("router.yaml");
    std::fs::write(
        &path,
        "policy: fastest\nworkers:\n  - url: http://127.0.0.1:1\n",
    )
    .unwrap();
    let out = kvroute().arg("--config").arg(&path).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("valid policies") && err.contains("round_robin"),
        "{err}"
    );
    let out = kvroute()
        .arg("--config")
        .arg(dir.join("missing.yaml"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn no_workers_exits_2_with_a_hint() {
    let out = kvroute().output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--worker-urls"));
}

#[test]
fn startup_logs_the_policy_with_its_parameters() {
    let mut child = kvroute()
        .args([
            "--worker-urls",
            "http://127.0.0.1:1",
            "--policy",
            "prefix_hash",
            "--port",
            "0",
            "--prometheus-port",
            "0",
        ])
        .env_remove("RUST_LOG")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let mut found = None;
    for line in stderr.lines() {
        let line = line.unwrap();
        if line.contains("policy: ") {
            found = Some(line);
            break;
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let line = found.expect("a policy line");
    assert!(
        line.contains(
            "policy: PrefixHash { prefix_token_count: 256, load_factor: 1.25, virtual_nodes: 160 }"
        ),
        "{line}"
    );
}
