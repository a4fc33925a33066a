//! The `kvroute` binary's start-up: exit statuses and the policy log line.

mod support;

use std::io::{BufRead, BufReader};

use std::process::{Command, Stdio};
use support::*;

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

#[tokio::test]
async fn with_no_worker_it_serves_from_embedded_simulated_engines() {
    let port = free_port();
    let mut child = ChildGuard(
        kvroute()
            .args(["--port", &port.to_string(), "--prometheus-port", "0"])
            .env_remove("RUST_LOG")
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let stderr = BufReader::new(child.0.stderr.take().unwrap());
    // Read stderr to its end (closing it early would break the child's pipe).
    let said = std::thread::spawn(move || {
        let mut found = None;
        for line in stderr.lines().map_while(Result::ok) {
            if found.is_none() && line.contains("embedded simulated engines") {
                found = Some(line);
            }
        }
        found
    });
    let base = format!("http://127.0.0.1:{port}");
    // Readiness probe: the router answers 200 once the engines are probed.
    let ready = format!("{base}/readiness");
    wait_until_async("kvroute ready", || answers(&ready)).await;
    let body =
        r#"{"model":"kvroute-sim","max_tokens":3,"messages":[{"role":"user","content":"hi"}]}"#;
    let r = post(&base, "/v1/chat/completions", &[], body).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert!(r.worker().starts_with("http://127.0.0.1:"));
    assert_eq!(r.json()["usage"]["completion_tokens"], 3);
    drop(child);
    let line = said
        .join()
        .unwrap()
        .expect("the log says engines were started");
    assert!(line.contains("kvroute-sim"), "{line}");
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

#[test]
fn bad_certificate_files_exit_2_naming_the_file() {
    let dir = CertDir::new("cli");
    let ca = TestCa::new("kvroute test CA");
    let (cert, key) = dir.identity("router", &ca.issue("router"));
    let (_, other_key) = dir.identity("other", &ca.issue("other"));
    let not_pem = dir.write("not-pem.txt", "this is no certificate\n");
    let missing = dir.write("gone.pem", "");
    std::fs::remove_file(&missing).unwrap();
    let config = dir.write(
        "router.yaml",
        &format!(
            "tls_cert_path: {}\ntls_key_path: {}\n",
            arg(&cert),
            arg(&not_pem)
        ),
    );
    let cases: [(&[&str], &str); 8] = [
        (
            &[
                "--tls-cert-path",
                arg(&missing),
                "--tls-key-path",
                arg(&key),
            ],
            arg(&missing),
        ),
        (
            &[
                "--tls-cert-path",
                arg(&not_pem),
                "--tls-key-path",
                arg(&key),
            ],
            arg(&not_pem),
        ),
        (
            &[
                "--tls-cert-path",
                arg(&cert),
                "--tls-key-path",
                arg(&not_pem),
            ],
            arg(&not_pem),
        ),
        (
            &[
                "--tls-cert-path",
                arg(&cert),
                "--tls-key-path",
                arg(&other_key),
            ],
            arg(&other_key),
        ),
        (&["--ca-cert-paths", arg(&key), arg(&not_pem)], arg(&key)),
        (
            &[
                "--client-cert-path",
                arg(&cert),
                "--client-key-path",
                arg(&missing),
            ],
            arg(&missing),
        ),
        (&["--client-cert-path", arg(&cert)], "--client-key-path"),
        (&["--config", arg(&config)], arg(&not_pem)),
    ];
    for (flags, named) in cases {
        let out = kvroute()
            .args(["--worker-urls", "https://127.0.0.1:1"])
            .args(flags)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {err}");
        assert!(err.contains(named), "{flags:?} should name {named}: {err}");
    }
}

#[test]
fn a_peers_flag_kvroute_does_not_take_exits_2_naming_it_and_why() {
    for (args, says) in [
        (
            &["--job-queue-capacity", "5"][..],
            "--job-queue-capacity is refused: not applicable",
        ),
        (
            &["--cb-window-duration-secs=10"],
            "--cb-window-duration-secs is not supported yet",
        ),
        (
            &["--no-enable-anthropic-api"],
            "--no-enable-anthropic-api is refused: not supported yet: turning /v1/messages off",
        ),
        (
            &["--router-mode", "least-loaded"],
            "--router-mode least-loaded: not supported yet",
        ),
        (
            &["--router-mode", "kv", "--policy", "random"],
            "--router-mode and --policy both set --policy",
        ),
        (&["--kv-connector", "mooncake"], "--kv-connector mooncake"),
        (
            &["--router-ttl-secs", "1.5"],
            "'1.5' for '--router-ttl-secs",
        ),
    ] {
        let out = kvroute().args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

#[test]
fn bad_tenant_and_jwt_values_exit_2_naming_the_flag_never_the_key() {
    let cases: [(&[&str], &str); 6] = [
        (&["--tenant-api-key", "no-colon-s3cret"], "--tenant-api-key"),
        (
            &["--jwt-issuer", "not a url", "--jwt-audience", "a"],
            "--jwt-issuer",
        ),
        (
            &["--jwt-issuer", "https://idp.example.com"],
            "--jwt-audience",
        ),
        (&["--jwt-audience", "a"], "--jwt-issuer"),
        (
            &[
                "--jwt-issuer",
                "https://idp.example.com",
                "--jwt-audience",
                "a",
                "--jwt-role-mapping",
                "Admins",
            ],
            "--jwt-role-mapping",
        ),
        (
            &[
                "--jwt-issuer",
                "https://idp.example.com",
                "--jwt-audience",
                "a",
                "--jwt-role-mapping",
                "Admins=root",
            ],
            "admin or user",
        ),
    ];
    for (flags, named) in cases {
        let out = kvroute()
            .args(["--worker-urls", "http://127.0.0.1:1"])
            .args(flags)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {err}");
        assert!(err.contains(named), "{flags:?} should name {named}: {err}");
        assert!(!err.contains("s3cret"), "{err}");
    }
}

#[test]
fn a_bad_rate_limit_file_exits_2_naming_the_entry() {
    let dir = std::env::temp_dir().join(format!("kvroute-cli-rl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let default = "default_policy: {tokens_per_minute: 1000, requests_per_minute: 60}\n";
    let cases = [
        (
            format!("{default}tenants:\n  - {{tenant_key: auth:a, tokens_per_minute: 10, requests_per_minute: 1}}\n  - {{tenant_key: auth:b, tokens_per_minute: 0, requests_per_minute: 1}}\n"),
            "tenants[1] (auth:b): tokens_per_minute must be > 0",
        ),
        (
            format!("{default}tenants:\n  - tenant_key: auth:a\n    tokens_per_minute: 10\n    requests_per_minute: 1\n    model_rules:\n      - {{rule_id: r1, matcher: {{type: glob, value: x}}, tokens_per_minute: 1, requests_per_minute: 1}}\n"),
            "unknown variant `glob`",
        ),
        (
            format!("{default}tenants:\n  - {{tenant_key: team-a, tokens_per_minute: 10, requests_per_minute: 1}}\n"),
            "tenants[0] (team-a): tenant_key is not a canonical tenant key",
        ),
        ("default_policy: {tokens_per_minute: 1}\n".to_owned(), "requests_per_minute"),
    ];
    for (i, (yaml, named)) in cases.iter().enumerate() {
        let path = dir.join(format!("limits-{i}.yaml"));
        std::fs::write(&path, yaml).unwrap();
        let out = kvroute()
            .args([
                "--worker-urls",
                "http://127.0.0.1:1",
                "--tenant-rate-limit-enabled",
            ])
            .arg("--tenant-rate-limit-config")
            .arg(&path)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{yaml}: {err}");
        assert!(err.contains(named), "{yaml} should name {named}: {err}");
        assert!(err.contains("--tenant-rate-limit-config"), "{err}");
    }
    // The same from a --config file.
    let config = dir.join("router.yaml");
    let limits = dir.join("limits-0.yaml");
    let text = format!(
        "worker_urls: [http://127.0.0.1:1]\ntenant_rate_limit_enabled: true\ntenant_rate_limit_config: {}\n",
        limits.display()
    );
    std::fs::write(&config, text).unwrap();
    let out = kvroute().arg("--config").arg(&config).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("tenants[1] (auth:b)"), "{err}");
    // The flag without its file, and a file that is not there.
    let missing = dir.join("missing.yaml");
    let runs: [&[&std::ffi::OsStr]; 2] = [
        &["--tenant-rate-limit-enabled".as_ref()],
        &[
            "--tenant-rate-limit-enabled".as_ref(),
            "--tenant-rate-limit-config".as_ref(),
            missing.as_os_str(),
        ],
    ];
    for flags in runs {
        let out = kvroute()
            .args(["--worker-urls", "http://127.0.0.1:1"])
            .args(flags)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {err}");
        assert!(err.contains("--tenant-rate-limit-config"), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn dump_config_to_writes_the_settings_then_starts() {
    let dir = std::env::temp_dir().join(format!("kvroute-cli-dump-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let dump = dir.join("settings.json");
    let config = dir.join("router.yaml");
    std::fs::write(
        &config,
        "health_check_interval_secs: 7\nrouter_ttl_secs: 30\n",
    )
    .unwrap();
    let mut child = ChildGuard(
        kvroute()
            .arg("--dump-config-to")
            .arg(&dump)
            .arg("--config")
            .arg(&config)
            .args([
                "--worker-urls",
                "http://127.0.0.1:1",
                "--port",
                "0",
                "--prometheus-port",
                "0",
                "--router-mode",
                "round-robin",
                "--router-ttl-secs",
                "120.0",
                "--enforce-disagg",
                "--api-key",
                "s3cret",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // The whole file (it may be seen half written), or the process's exit, which fails.
    let whole = || {
        std::fs::read_to_string(&dump)
            .ok()
            .filter(|t| serde_json::from_str::<serde_json::Value>(t).is_ok())
    };
    wait_until("the dump written", || {
        if let Some(status) = child.0.try_wait().unwrap() {
            panic!(
                "kvroute exited ({status}) before writing {}",
                dump.display()
            );
        }
        whole().is_some()
    })
    .await;
    let text = whole().unwrap();
    // Written before serving: the process is still up.
    assert_eq!(child.0.try_wait().unwrap(), None);
    drop(child);
    let dumped: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(dumped["policy"], "round_robin");
    assert_eq!(dumped["router_ttl_secs"], 120);
    assert_eq!(dumped["health_check_interval_secs"], 7);
    assert_eq!(dumped["worker_urls"][0], "http://127.0.0.1:1");
    assert_eq!(dumped["peer_noop_flags"][0], "--enforce-disagg");
    assert!(
        !text.contains("s3cret") && dumped.get("api_key").is_none(),
        "{text}"
    );

    // The dump loads back as a config file (a bad one exits 2 before anything is written).
    let again = dir.join("again.json");
    let out = kvroute()
        .arg("--config")
        .arg(&dump)
        .arg("--dump-config-to")
        .arg(&again)
        .args(["--block-size", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(!again.exists());
    // A path that cannot be written exits 2 naming it.
    let bad = dir.join("missing-dir").join("settings.json");
    let out = kvroute()
        .args(["--worker-urls", "http://127.0.0.1:1", "--dump-config-to"])
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(bad.to_str().unwrap()), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn peer_no_op_flags_are_logged_once_each_at_start() {
    let mut child = ChildGuard(
        kvroute()
            .args([
                "--worker-urls",
                "http://127.0.0.1:1",
                "--no-serve-indexer",
                "--port",
                "0",
                "--enable-anthropic-api",
                "--prometheus-port",
                "0",
            ])
            .env_remove("RUST_LOG")
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let stderr = BufReader::new(child.0.stderr.take().unwrap());
    let mut noops = Vec::new();
    for line in stderr.lines() {
        let line = line.unwrap();
        if line.contains("Peer flag accepted as a no-op") {
            noops.push(line);
        } else if line.contains("kvroute listening") {
            break;
        }
    }
    drop(child);
    assert_eq!(noops.len(), 2, "{noops:#?}");
    assert!(
        noops[0].contains("--no-serve-indexer") && noops[0].contains("kvroute serves no indexer"),
        "{}",
        noops[0]
    );
    assert!(noops[1].contains("--enable-anthropic-api"), "{}", noops[1]);
}
