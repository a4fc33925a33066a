//! `kvroute` as llm-d's endpoint picker, from the command line its charts write: the flags and
//! the EndpointPickerConfig reaching `--dump-config-to`, and what exits with status 2. No
//! Kubernetes is reached: the dump is written before anything starts.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;
use support::*;

fn kvroute() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
}

/// A fresh directory for one test's files.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-epp-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes an llm-d EndpointPickerConfig with these plugins and profile entries.
fn llm_d_config(dir: &Path, body: &str) -> PathBuf {
    let path = dir.join("epp-config.yaml");
    std::fs::write(
        &path,
        format!("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n{body}"),
    )
    .unwrap();
    path
}

/// Starts kvroute with `args` and `--dump-config-to`, and returns the dump once written. What
/// the process does after (serve, or fail to reach a cluster) is not this test's business.
async fn dump_of(dir: &Path, args: &[&str]) -> Value {
    let dump = dir.join("settings.json");
    let _ = std::fs::remove_file(&dump);
    let mut child = ChildGuard(
        kvroute()
            .args(args)
            .args(["--port", "0", "--metrics-port", "0"])
            .arg("--dump-config-to")
            .arg(&dump)
            .env("KUBECONFIG", dir.join("no-kubeconfig"))
            .env_remove("KUBERNETES_SERVICE_HOST")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let whole = || {
        std::fs::read_to_string(&dump)
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
    };
    wait_until("the dump written", || {
        if whole().is_some() {
            return true;
        }
        if let Some(status) = child.0.try_wait().unwrap() {
            panic!(
                "kvroute exited ({status}) without writing {}",
                dump.display()
            );
        }
        false
    })
    .await;
    drop(child);
    whole().unwrap()
}

#[tokio::test]
async fn llm_ds_deployment_arguments_reach_the_dump() {
    let dir = temp_dir("deployment");
    let config = llm_d_config(
        &dir,
        "plugins:
- type: approx-prefix-cache-producer
  parameters:
    maxPrefixTokensToMatch: 16384
    lruCapacityPerServer: 31250
- type: prefix-cache-scorer
- type: queue-scorer
- type: decode-filter
- type: max-score-picker
- type: single-profile-handler
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: decode-filter
  - pluginRef: max-score-picker
  - pluginRef: prefix-cache-scorer
    weight: 2
  - pluginRef: queue-scorer
",
    );
    let d = dump_of(
        &dir,
        &[
            "--pool-name",
            "my-pool",
            "--pool-namespace",
            "ns",
            "--pool-group",
            "inference.networking.k8s.io",
            "--zap-encoder",
            "json",
            "--config-file",
            config.to_str().unwrap(),
            "--ha-enable-leader-election",
            "--grpc-health-port",
            "9003",
            "--v=4",
            "--tracing=false",
            "--metrics-endpoint-auth=false",
            "--secure-serving=false",
            "--grpc-port",
            "9002",
        ],
    )
    .await;
    assert_eq!(d["pool_name"], "my-pool");
    assert_eq!(d["pool_namespace"], "ns");
    assert_eq!(d["pool_group"], "inference.networking.k8s.io");
    assert_eq!(d["secure_serving"], false);
    assert_eq!(
        (d["grpc_port"].clone(), d["grpc_health_port"].clone()),
        (9002.into(), 9003.into())
    );
    assert_eq!(d["config_file"], config.to_str().unwrap());
    assert_eq!(d["policy"], "llm_d");
    assert_eq!(d["llm_d_prefix_weight"], 2.0);
    assert_eq!(d["llm_d_queue_weight"], 1.0);
    assert_eq!(d["llm_d_kv_weight"], 0.0);
    assert_eq!(
        d["peer_noop_flags"],
        serde_json::json!([
            "--zap-encoder",
            "--ha-enable-leader-election",
            "--v",
            "--tracing",
            "--metrics-endpoint-auth"
        ])
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn kvroutes_flags_win_over_the_llm_d_config() {
    let dir = temp_dir("precedence");
    let config = llm_d_config(
        &dir,
        "plugins:
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: kv-cache-utilization-scorer
    weight: 3
",
    );
    let c = config.to_str().unwrap();
    let d = dump_of(
        &dir,
        &[
            "--epp",
            "--worker-urls",
            "http://127.0.0.1:1",
            "--config-file",
            c,
        ],
    )
    .await;
    // A scorer defined but not in the profile weighs 0, not kvroute's default.
    assert_eq!(d["policy"], "llm_d");
    assert_eq!(d["llm_d_kv_weight"], 3.0);
    assert_eq!(d["llm_d_prefix_weight"], 0.0);
    assert_eq!(d["llm_d_queue_weight"], 0.0);
    let d = dump_of(
        &dir,
        &[
            "--epp",
            "--worker-urls",
            "http://127.0.0.1:1",
            "--config-file",
            c,
            "--policy",
            "kv_aware",
            "--llm-d-kv-weight",
            "0.5",
        ],
    )
    .await;
    assert_eq!(d["policy"], "kv_aware");
    assert_eq!(d["llm_d_kv_weight"], 0.5);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_unsupported_plugin_exits_2_naming_it() {
    let dir = temp_dir("unknown");
    let config = llm_d_config(
        &dir,
        "plugins:\n- type: prefix-cache-scorer\n- type: load-aware-scorer\n",
    );
    let out = kvroute()
        .args(["--pool-name", "p", "--config-file"])
        .arg(&config)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("load-aware-scorer") && err.contains(config.to_str().unwrap()),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_pickers_mistakes_exit_2_naming_the_setting() {
    let dir = temp_dir("mistakes");
    let d = dir.to_str().unwrap();
    for (args, says) in [
        (&["--epp"][..], "no endpoints"),
        (&["--endpoint-selector", "app=vllm"], "target port"),
        (
            &[
                "--pool-name",
                "p",
                "--endpoint-selector",
                "a=b",
                "--endpoint-target-ports",
                "1",
            ],
            "not both",
        ),
        (&["--pool-name", "p", "--cert-path", d], "tls.crt"),
        (&["--grpc-port", "9002"], "only in endpoint-picker mode"),
        (
            &["--pool-name", "p", "--tracing=perhaps"],
            "--tracing=perhaps",
        ),
        (
            &["--pool-name", "p", "--drain-timeout", "1s"],
            "--drain-timeout is refused",
        ),
    ] {
        let out = kvroute().args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
