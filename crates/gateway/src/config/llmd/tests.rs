use clap::Parser;
use kvroute_core::PolicyKind;

use super::*;
use crate::config::{EppSettings, KvEventsMode, Settings};

const HEAD: &str = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n";

fn overlay(body: &str) -> Result<LlmDOverlay, Problem> {
    LlmDOverlay::parse(&format!("{HEAD}{body}"))
}

fn weights(body: &str) -> (f64, f64, f64) {
    let o = overlay(body).unwrap();
    (o.prefix_weight, o.queue_weight, o.kv_weight)
}

/// The command line (with `--config-text` the llm-d config) as `load` reads it.
fn load(flags: &[&str], body: &str) -> Result<Settings, ConfigError> {
    let text = format!("{HEAD}{body}");
    let mut argv = vec!["kvroute", "--config-text", &text];
    argv.extend_from_slice(flags);
    Args::try_parse_from(argv)
        .unwrap()
        .with_llm_d_config()?
        .into_settings()
}

const THREE: &str = "plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: max-score-picker
- type: single-profile-handler
";

#[test]
fn the_profiles_weights_are_llm_ds_weights() {
    let (p, q, k) = weights(&format!(
        "{THREE}schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-scorer
    weight: 2.5
  - pluginRef: queue-scorer
  - pluginRef: kv-cache-utilization-scorer
    weight: 0
  - pluginRef: max-score-picker
"
    ));
    // A pluginRef without weight is 1.
    assert_eq!((p, q, k), (2.5, 1.0, 0.0));
    // A scorer the profile leaves out is 0 (not kvroute's 3/2/2).
    let (p, q, k) = weights(&format!(
        "{THREE}schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-scorer
    weight: 2
"
    ));
    assert_eq!((p, q, k), (2.0, 0.0, 0.0));
    // No profile: llm-d's default profile of every plugin, each weight 1.
    assert_eq!(weights(THREE), (1.0, 1.0, 1.0));
}

#[test]
fn plugin_refs_name_plugins_by_name_defaulting_to_type() {
    let body = "plugins:
- name: my-queue
  type: queue-scorer
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: my-queue
    weight: 4
  - pluginRef: prefix-cache-scorer
    weight: 3
";
    assert_eq!(weights(body), (3.0, 4.0, 0.0));
    // The type is not a name when the plugin has one.
    let e = overlay(&body.replace("pluginRef: my-queue", "pluginRef: queue-scorer")).unwrap_err();
    assert!(
        matches!(&e, Problem::UnknownRef { plugin_ref, .. } if plugin_ref == "queue-scorer"),
        "{e}"
    );
    let e = overlay("plugins:\n- type: queue-scorer\n- type: queue-scorer\n").unwrap_err();
    assert!(
        matches!(e, Problem::DuplicateName(ref n) if n == "queue-scorer"),
        "{e}"
    );
}

#[test]
fn an_unknown_plugin_type_is_refused_by_name() {
    for t in [
        "load-aware-scorer",
        "prefill-filter",
        "random-picker",
        "disagg-profile-handler",
    ] {
        let e = overlay(&format!("plugins:\n- type: {t}\n")).unwrap_err();
        assert!(matches!(&e, Problem::UnsupportedPlugin(n) if n == t), "{e}");
        assert!(e.to_string().contains(t), "{e}");
    }
    // Through load: a ConfigError (exit status 2) naming it and where it came from.
    let e = load(&[], "plugins:\n- type: load-aware-scorer\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("\"load-aware-scorer\"") && e.contains("--config-text"),
        "{e}"
    );
}

#[test]
fn the_no_op_plugins_change_nothing() {
    let mut body = String::from("plugins:\n- type: prefix-cache-scorer\n");
    for (t, why) in NOOPS {
        assert!(!why.is_empty());
        body.push_str(&format!("- type: {t}\n"));
    }
    let o = overlay(&body).unwrap();
    assert_eq!(
        (o.prefix_weight, o.queue_weight, o.kv_weight),
        (1.0, 0.0, 0.0)
    );
    assert_eq!((o.block_size, o.kv_events_socket_port), (None, None));
}

#[test]
fn the_header_and_top_level_are_checked() {
    let e = LlmDOverlay::parse("apiVersion: v1\nkind: EndpointPickerConfig\n").unwrap_err();
    assert!(matches!(e, Problem::ApiVersion(_)), "{e}");
    let e = LlmDOverlay::parse("apiVersion: llm-d.ai/v1alpha1\nkind: Pod\n").unwrap_err();
    assert!(matches!(e, Problem::Kind(_)), "{e}");
    // GIE's older group is read too.
    let gie = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n\
               plugins:\n- type: queue-scorer\n";
    assert_eq!(LlmDOverlay::parse(gie).unwrap().queue_weight, 1.0);
    let e = overlay("plugns: []\n").unwrap_err();
    assert!(e.to_string().contains("plugns"), "{e}");
    // Known sections kvroute does what it does anyway for, and ones it refuses.
    let ok = overlay(
        "featureGates: [prepareDataPlugins]\ndataLayer:\n  sources: []\nplugins:\n- type: queue-scorer\n",
    );
    assert!(ok.is_ok(), "{ok:?}");
    for (section, field) in [
        ("flowControl:\n  maxRequests: 10\n", "flowControl"),
        (
            "saturationDetector:\n  pluginRef: x\n",
            "saturationDetector",
        ),
    ] {
        let e = overlay(section).unwrap_err();
        assert!(
            matches!(e, Problem::Unsupported { field: f, .. } if f == field),
            "{e}"
        );
    }
    let e = overlay(
        "schedulingProfiles:\n- name: prefill\n  plugins: []\n- name: decode\n  plugins: []\n",
    )
    .unwrap_err();
    assert!(matches!(e, Problem::Profiles(2)), "{e}");
    let e = overlay(
        "plugins:\n- type: queue-scorer\nschedulingProfiles:\n- name: d\n  plugins:\n  - pluginRef: queue-scorer\n    weight: -1\n",
    )
    .unwrap_err();
    assert!(matches!(e, Problem::Weight(_)), "{e}");
}

#[test]
fn the_precise_producer_reads_kv_events_from_each_endpoint() {
    let precise = "plugins:
- type: token-producer
- type: endpoint-notification-source
- type: precise-prefix-cache-producer
  parameters:
    tokenProcessorConfig:
      blockSize: 64
    kvEventsConfig:
      discoverPods: true
      podDiscoveryConfig:
        socketPort: 5600
- type: prefix-cache-scorer
  parameters:
    prefixMatchInfoProducerName: precise-prefix-cache-producer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-scorer
    weight: 2.0
";
    let o = overlay(precise).unwrap();
    assert_eq!(o.block_size, Some(64));
    assert_eq!(o.kv_events_socket_port, Some(5600));
    assert_eq!(o.prefix_weight, 2.0);
    let s = load(&["--pool-name", "p"], precise).unwrap();
    assert_eq!(s.block_size, 64);
    assert_eq!(s.kv_events, KvEventsMode::Events);
    assert_eq!(s.epp.as_ref().unwrap().kv_events_port, Some(5600));
    assert!(o.precise);
    assert_eq!(
        s.policy_config.llm_d.prefix,
        kvroute_core::policy::PrefixSource::Exact { block_size: 64 },
        "the prefix is scored from the engines' events"
    );
    // llm-d's default port, and the brief's blockSizeTokens spelling.
    let o = overlay(
        "plugins:\n- type: precise-prefix-cache-producer\n  parameters:\n    tokenProcessorConfig:\n      blockSizeTokens: 32\n",
    )
    .unwrap();
    assert_eq!(
        (o.block_size, o.kv_events_socket_port),
        (Some(32), Some(5557))
    );
    // The deprecated scorer is both the producer and the prefix scorer.
    let o = overlay(
        "plugins:\n- type: precise-prefix-cache-scorer\n  parameters:\n    kvEventsConfig: { discoverPods: true, podDiscoveryConfig: { socketPort: 5557 } }\n",
    )
    .unwrap();
    assert_eq!(
        (o.prefix_weight, o.kv_events_socket_port),
        (1.0, Some(5557))
    );
    // One socket the engines publish to: refused.
    let e = overlay(
        "plugins:\n- type: precise-prefix-cache-producer\n  parameters:\n    kvEventsConfig:\n      zmqEndpoint: tcp://*:5557\n",
    )
    .unwrap_err();
    assert!(e.to_string().contains("kvEventsConfig.zmqEndpoint"), "{e}");
    let e = overlay(
        "plugins:\n- type: precise-prefix-cache-producer\n  parameters:\n    kvEventsConfig:\n      podDiscoveryConfig:\n        socketPort: 70000\n",
    )
    .unwrap_err();
    assert!(e.to_string().contains("socketPort"), "{e}");
    // The approximate producer is llm_d as it is.
    let o = overlay(
        "plugins:\n- type: approx-prefix-cache-producer\n  parameters:\n    lruCapacityPerServer: 31250\n",
    )
    .unwrap();
    assert_eq!((o.block_size, o.kv_events_socket_port), (None, None));
    assert!(
        !o.precise,
        "the approximate producer keeps the approximate prefix"
    );
}

#[test]
fn the_command_line_and_kvroutes_file_win_over_the_llm_d_config() {
    let body = "plugins:
- type: prefix-cache-scorer
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-scorer
    weight: 5
  - pluginRef: queue-scorer
    weight: 7
";
    let s = load(&["--worker-urls", "http://a:1"], body).unwrap();
    assert_eq!(s.policy, PolicyKind::LlmD);
    let ld = &s.policy_config.llm_d;
    assert_eq!(
        (ld.prefix_weight, ld.queue_weight, ld.kv_weight),
        (5.0, 7.0, 0.0)
    );
    let s = load(
        &[
            "--worker-urls",
            "http://a:1",
            "--policy",
            "kv_aware",
            "--llm-d-queue-weight",
            "1",
        ],
        body,
    )
    .unwrap();
    assert_eq!(s.policy, PolicyKind::KvAware);
    assert_eq!(s.policy_config.llm_d.queue_weight, 1.0);
    assert_eq!(s.policy_config.llm_d.prefix_weight, 5.0);
    // kvroute's own config file, which may name the llm-d one.
    let text = format!("{HEAD}{body}");
    let file = Args::from_text(&format!(
        "llm_d_kv_weight: 9\nconfig_text: {}\n",
        serde_json::to_string(&text).unwrap()
    ))
    .unwrap();
    let s = Args::try_parse_from(["kvroute"])
        .unwrap()
        .merge(file)
        .with_llm_d_config()
        .unwrap()
        .into_settings()
        .unwrap();
    let ld = &s.policy_config.llm_d;
    assert_eq!(
        (ld.prefix_weight, ld.queue_weight, ld.kv_weight),
        (5.0, 7.0, 9.0)
    );
    // Without an llm-d config, kvroute's defaults.
    let s = Settings::with_workers(vec![]).unwrap();
    assert_eq!(s.policy, PolicyKind::KvAware);
    assert_eq!(s.policy_config.llm_d.prefix_weight, 3.0);
}

#[test]
fn the_config_file_is_read_and_named_in_errors() {
    let dir = std::env::temp_dir().join(format!("kvroute-llmd-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("epp.yaml");
    std::fs::write(
        &path,
        format!("{HEAD}plugins:\n- type: kv-cache-utilization-scorer\n"),
    )
    .unwrap();
    let p = path.to_str().unwrap();
    let s = Args::try_parse_from(["kvroute", "--config-file", p, "--worker-urls", "http://a:1"])
        .unwrap()
        .with_llm_d_config()
        .unwrap()
        .into_settings()
        .unwrap();
    assert_eq!(s.policy_config.llm_d.kv_weight, 1.0);
    let missing = dir.join("missing.yaml");
    let e = Args::try_parse_from(["kvroute", "--config-file", missing.to_str().unwrap()])
        .unwrap()
        .with_llm_d_config()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("missing.yaml") && e.contains("cannot read"),
        "{e}"
    );
    // Both spellings: clap refuses them on the command line, validation in a file.
    assert!(Args::try_parse_from(["kvroute", "--config-file", p, "--config-text", "x"]).is_err());
    let both = Args::from_text(&format!("config_file: {p}\nconfig_text: x\n")).unwrap();
    let e = both.with_llm_d_config().unwrap_err().to_string();
    assert!(e.contains("not both"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_dump_shows_the_llm_d_configs_policy_and_weights() {
    let body = "plugins:\n- type: queue-scorer\nschedulingProfiles:\n- name: d\n  plugins:\n  - pluginRef: queue-scorer\n    weight: 2\n";
    let text = format!("{HEAD}{body}");
    let args = Args::try_parse_from(["kvroute", "--config-text", &text, "--pool-name", "p"])
        .unwrap()
        .with_llm_d_config()
        .unwrap();
    let d: serde_json::Value = serde_json::from_str(&args.dump_json()).unwrap();
    assert_eq!(d["policy"], "llm_d");
    assert_eq!(d["llm_d_queue_weight"], 2.0);
    assert_eq!(d["llm_d_prefix_weight"], 0.0);
    assert_eq!(d["llm_d_kv_weight"], 0.0);
    assert_eq!(d["pool_name"], "p");
    // It loads back as the same settings.
    let back = Args::from_text(&args.dump_json())
        .unwrap()
        .with_llm_d_config()
        .unwrap();
    assert_eq!(back.dump_json(), args.dump_json());
    let epp: EppSettings = back.into_settings().unwrap().epp.unwrap();
    assert_eq!(epp.grpc_port, 9002);
}

#[test]
fn the_lora_affinity_scorer_gives_the_lora_weight_and_the_flag_wins() {
    let body = format!(
        "{THREE}- type: lora-affinity-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-scorer
  - pluginRef: lora-affinity-scorer
    weight: 1.5
"
    );
    assert_eq!(overlay(&body).unwrap().lora_weight, 1.5);
    // Left out of the profile: 0; and 0 in the three-scorer file with no profile.
    assert_eq!(overlay(THREE).unwrap().lora_weight, 0.0);
    let s = load(&[], &body).unwrap();
    assert_eq!(s.policy_config.llm_d.lora_weight, 1.5);
    let s = load(&["--llm-d-lora-weight", "4"], &body).unwrap();
    assert_eq!(s.policy_config.llm_d.lora_weight, 4.0);
    assert!(load(&["--llm-d-lora-weight=-1"], &body).is_err());
}
