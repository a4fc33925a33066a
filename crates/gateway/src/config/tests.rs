use std::time::Duration;

use clap::Parser;
use kvroute_core::{CostModel, KvAwareConfig, MemoryCost, PolicyKind};

use super::*;

#[test]
fn yaml_and_json_files_read_the_same() {
    let yaml = "policy: consistent_hash\nport: 8080\nlog_level: warning\nworkers:\n  - id: a\n    url: http://10.0.0.1:8000/\n    model: llama\n  - url: http://10.0.0.2:8000\n";
    let json = r#"{"policy":"consistent_hash","port":8080,"log_level":"warning","workers":[
        {"id":"a","url":"http://10.0.0.1:8000/","model":"llama"},{"url":"http://10.0.0.2:8000"}]}"#;
    for text in [yaml, json] {
        let s = Args::from_text(text).unwrap().into_settings().unwrap();
        assert_eq!(s.policy, PolicyKind::ConsistentHash);
        assert_eq!(s.port, 8080);
        assert_eq!(s.log_level, LogLevel::Warn);
        assert_eq!(s.workers[0].id.as_deref(), Some("a"));
        assert_eq!(s.workers[0].url, "http://10.0.0.1:8000");
        assert_eq!(s.workers[0].model.as_deref(), Some("llama"));
        assert_eq!(s.workers[1].id.as_deref(), Some("http://10.0.0.2:8000"));
    }
}

#[test]
fn command_line_wins_over_file_and_defaults_apply() {
    let cli = Args::try_parse_from(["kvroute", "--port", "9", "--policy", "random"]).unwrap();
    let file = Args::from_text("port: 8\nhost: 0.0.0.0\npolicy: manual\n").unwrap();
    let s = cli.merge(file).into_settings().unwrap();
    assert_eq!(s.port, 9);
    assert_eq!(s.host, "0.0.0.0");
    assert_eq!(s.prometheus_host, "0.0.0.0");
    assert_eq!(s.policy, PolicyKind::Random);
    assert_eq!(s.prometheus_port, 29000);
    assert_eq!(s.max_payload_size, 512 * 1024 * 1024);
    let s = Args::default().into_settings().unwrap();
    assert_eq!((s.host.as_str(), s.port), ("127.0.0.1", 30000));
    assert_eq!(s.policy, PolicyKind::KvAware);
    assert_eq!(s.block_size, 16);
    assert_eq!(s.event_threads, 1, "one index behind a lock");
    assert_eq!(
        s.sample_ranks, None,
        "sampled in pools of 256 ranks or more"
    );
    assert_eq!(s.kv_events, KvEventsMode::Events);
    assert_eq!(s.policy_config.kv_aware, KvAwareConfig::default());
    let s = Args::try_parse_from([
        "kvroute",
        "--no-router-kv-events",
        "--router-temperature",
        "0.5",
        "--block-size",
        "32",
        "--router-event-threads",
        "4",
        "--router-sample-ranks",
        "48",
    ])
    .unwrap()
    .into_settings()
    .unwrap();
    assert_eq!(s.kv_events, KvEventsMode::Approximate);
    assert_eq!(s.policy_config.kv_aware.temperature, 0.5);
    assert_eq!(s.block_size, 32);
    assert_eq!(s.event_threads, 4);
    assert_eq!(s.sample_ranks, Some(48));
    let w = Args::from_text(
        "workers: [{url: 'http://a:1', kv_events: 'tcp://a:5557', dp_size: 2, dp_start_rank: 4}]",
    )
    .unwrap()
    .into_settings()
    .unwrap();
    assert_eq!(w.workers[0].ranks(), vec![Some(4), Some(5)]);
    assert_eq!(w.workers[0].kv_events.as_deref(), Some("tcp://a:5557"));
    assert_eq!(w.workers[0].role, WorkerRole::Both);
    let full = Args::from_text(
        "workers:\n  - {id: a, url: 'http://a:1', model: m, taints: [gpu-h100, zone-a], role: decode, max_num_batched_tokens: 8192, num_gpu_blocks: 16384, max_model_len: 32768}\n  - {id: b, url: 'http://b:1', role: prefill, bootstrap_port: 8998}",
    )
    .unwrap()
    .into_settings()
    .unwrap();
    assert!(full.pd.is_some(), "roles turn disaggregation on");
    assert_eq!(full.workers[1].bootstrap_port, Some(8998));
    // A decode worker with no prefill worker cannot serve a disaggregated request.
    let lone = Args::from_text("workers: [{url: 'http://a:1', role: decode}]").unwrap();
    assert!(matches!(
        lone.into_settings(),
        Err(ConfigError::Invalid {
            name: "pd_disaggregation",
            ..
        })
    ));
    let a = &full.workers[0];
    assert_eq!(
        (a.role, a.max_num_batched_tokens, a.num_gpu_blocks),
        (WorkerRole::Decode, Some(8192), Some(16384))
    );
    assert_eq!(a.max_model_len, Some(32768));
    assert_eq!(a.taints, ["gpu-h100", "zone-a"]);
    assert!(Args::from_text("workers: [{url: 'http://a:1', role: sideways}]").is_err());
    assert!(Args::from_text("router_temperature: -1")
        .unwrap()
        .into_settings()
        .is_err());
    assert!(
        Args::from_text("workers: [{url: 'http://a:1', kv_events: 'a:1'}]")
            .unwrap()
            .into_settings()
            .is_err()
    );
}

#[test]
fn bad_configs_are_clear_errors() {
    let e = Args::from_text("policy: nope\n").unwrap_err().to_string();
    assert!(
        e.contains("valid policies") && e.contains("round_robin"),
        "{e}"
    );
    let e = Args::from_text("polcy: random\n").unwrap_err().to_string();
    assert!(e.contains("polcy"), "{e}");
    assert!(Args::from_text("workers: [{id: a}]").is_err());
    assert!(Args::from_text("port: [1]").is_err());
    let dup = Args::from_text("workers: [{url: 'http://a:1'}, {url: 'http://a:1/'}]").unwrap();
    assert!(matches!(
        dup.into_settings(),
        Err(ConfigError::DuplicateWorker(_))
    ));
    for url in ["a:1", "ftp://a:1", "https://a:1/?x=1", "http://a:1/?x=1"] {
        let e = Args {
            worker_urls: vec![url.into()],
            ..Args::default()
        }
        .into_settings();
        assert!(matches!(e, Err(ConfigError::WorkerUrl { .. })), "{url}");
    }
    let e = Args::try_parse_from(["kvroute", "--policy", "nope"]).unwrap_err();
    assert_eq!(e.exit_code(), 2);
    assert!(e.to_string().contains("power_of_two"), "{e}");
    assert!(Args::try_parse_from(["kvroute", "--log-level", "warning"]).is_ok());
}

#[test]
fn prefill_flags_take_an_optional_bootstrap_port() {
    use clap::Parser;
    let args = Args::try_parse_from([
        "kvroute",
        "--pd-disaggregation",
        "--prefill",
        "http://p0:8000",
        "8998",
        "--prefill",
        "http://p1:8000",
        "--decode",
        "http://d0:8000",
    ])
    .unwrap();
    let s = args.into_settings().unwrap();
    let roles: Vec<_> = s
        .workers
        .iter()
        .map(|w| (w.url.as_str(), w.role, w.bootstrap_port))
        .collect();
    assert_eq!(
        roles,
        [
            ("http://p0:8000", WorkerRole::Prefill, Some(8998)),
            ("http://p1:8000", WorkerRole::Prefill, None),
            ("http://d0:8000", WorkerRole::Decode, None),
        ]
    );
    let pd = s.pd.unwrap();
    assert_eq!(pd.protocol, PdProtocol::Vllm);
    assert_eq!(pd.decode_config.kv_aware.overlap_score_credit, 0.0);
    assert_eq!(pd.prefill_config.kv_aware.overlap_score_credit, 2.0);
    assert!(Args::try_parse_from(["kvroute", "--prefill", "8998"])
        .unwrap()
        .into_settings()
        .is_err());
}

#[test]
fn data_parallel_ranks_are_bounded() {
    // Found by fuzzing: an overflowing rank range, and a rank count that exhausts memory.
    for (text, name) in [
        (
            "workers: [{url: 'http://a:1', dp_size: 2, dp_start_rank: 4294967295}]",
            "dp_start_rank",
        ),
        (
            "workers: [{url: 'http://a:1', dp_size: 100000000}]",
            "dp_size",
        ),
    ] {
        match Args::from_text(text).unwrap().into_settings() {
            Err(ConfigError::Invalid { name: n, .. }) => assert_eq!(n, name),
            other => panic!("{text}: {other:?}"),
        }
    }
    let ok = Args::from_text("workers: [{url: 'http://a:1', dp_size: 1024, dp_start_rank: 7}]")
        .unwrap()
        .into_settings()
        .unwrap();
    assert_eq!(ok.workers[0].ranks().len(), 1024);
}

#[test]
fn the_halves_policies_take_the_policy_parameters() {
    let s = Args::try_parse_from([
        "kvroute",
        "--prefill",
        "http://p:1",
        "--decode",
        "http://d:1",
        "--prefill-policy",
        "prefix_hash",
        "--prefix-token-count",
        "77",
        "--decode-policy",
        "manual",
        "--max-idle-secs",
        "9",
    ])
    .unwrap()
    .into_settings()
    .unwrap();
    let pd = s.pd.unwrap();
    assert_eq!(pd.prefill_config.prefix_token_count, 77);
    assert_eq!(pd.decode_config.max_idle, Duration::from_secs(9));
}

#[test]
fn one_worker_is_validated_on_its_own_whatever_its_role() {
    let decode = WorkerSpec {
        role: WorkerRole::Decode,
        ..WorkerSpec::url("http://d:1/")
    };
    let v = decode.validated().unwrap();
    assert_eq!(
        (v.url.as_str(), v.id.as_deref()),
        ("http://d:1", Some("http://d:1"))
    );
    let replay_only = WorkerSpec {
        kv_events_replay: Some("ipc:///x".into()),
        ..WorkerSpec::url("http://a:1")
    };
    assert!(matches!(
        replay_only.validated(),
        Err(ConfigError::Invalid {
            name: "kv_events",
            ..
        })
    ));
}

#[test]
fn a_worker_key_that_cannot_be_a_header_is_refused() {
    let args = |key: &str| Args {
        api_key: Some(key.into()),
        ..Args::default()
    };
    assert!(matches!(
        args("line\nbreak").into_settings(),
        Err(ConfigError::Invalid {
            name: "api_key",
            ..
        })
    ));
    assert!(args("sk-fine").into_settings().unwrap().api_key.is_some());
}

#[test]
fn retry_backoff_grows_and_is_capped() {
    let r = Args::default().into_settings().unwrap().retry;
    let ms = |n| r.backoff(n).as_millis();
    assert_eq!((ms(1), ms(2), ms(3)), (50, 75, 112));
    assert_eq!(ms(100), 30_000);
}

#[test]
fn zero_is_refused_wherever_a_positive_number_is_needed() {
    for flag in [
        "--header-read-timeout-secs",
        "--queue-timeout-secs",
        "--request-timeout-secs",
        "--block-size",
        "--health-check-interval-secs",
        "--router-event-threads",
    ] {
        let settings = Args::try_parse_from(["kvroute", flag, "0"])
            .unwrap()
            .into_settings();
        assert!(
            matches!(
                settings,
                Err(ConfigError::Invalid {
                    reason: "must be positive",
                    ..
                })
            ),
            "{flag}: {settings:?}"
        );
    }
}

#[test]
fn an_index_bound_over_2_pow_27_blocks_is_refused() {
    let parse = |n: &str| {
        Args::try_parse_from(["kvroute", "--router-max-indexed-blocks", n])
            .unwrap()
            .into_settings()
    };
    assert_eq!(parse("134217728").unwrap().max_indexed_blocks, 1 << 27);
    let over = parse("134217729");
    assert!(
        matches!(
            over,
            Err(ConfigError::Invalid {
                name: "router_max_indexed_blocks",
                ..
            })
        ),
        "{over:?}"
    );
}

#[test]
fn the_admission_queue_is_refused_with_disaggregation() {
    let r = Args::try_parse_from([
        "kvroute",
        "--prefill",
        "http://p:1",
        "--decode",
        "http://d:1",
        "--router-queue-threshold",
        "2",
    ])
    .unwrap()
    .into_settings();
    assert!(
        matches!(
            r,
            Err(ConfigError::Invalid {
                name: "router_queue_threshold",
                ..
            })
        ),
        "{r:?}"
    );
}

#[test]
fn https_workers_are_accepted_and_tls_files_go_in_pairs() {
    let s = Args::try_parse_from(["kvroute", "--worker-urls", "https://a:8443/"])
        .unwrap()
        .into_settings()
        .unwrap();
    assert_eq!(s.workers[0].url, "https://a:8443");
    assert!(s.tls.api.is_none());
    for (flags, name) in [
        (&["--client-cert-path", "c.pem"][..], "client_cert_path"),
        (&["--client-key-path", "k.pem"], "client_cert_path"),
        (&["--tls-cert-path", "c.pem"], "tls_cert_path"),
        (&["--tls-key-path", "k.pem"], "tls_cert_path"),
    ] {
        let r = Args::try_parse_from(["kvroute"].iter().chain(flags))
            .unwrap()
            .into_settings();
        assert!(
            matches!(r, Err(ConfigError::Invalid { name: n, .. }) if n == name),
            "{flags:?}: {r:?}"
        );
    }
    // The file's names are the flags' in snake_case; the command line wins.
    let file = Args::from_text("ca_cert_paths: [a.pem, b.pem]\ntls_cert_path: f.pem\n").unwrap();
    let cli = Args::try_parse_from(["kvroute", "--tls-cert-path", "cli.pem"]).unwrap();
    let merged = cli.merge(file);
    assert_eq!(merged.ca_cert_paths.len(), 2);
    assert_eq!(
        merged.tls_cert_path.as_deref(),
        Some(std::path::Path::new("cli.pem"))
    );
}

#[test]
fn discovery_flags_take_the_peers_names_and_defaults() {
    let parse = |argv: &[&str]| {
        let argv = std::iter::once("kvroute").chain(argv.iter().copied());
        Args::try_parse_from(argv).unwrap().into_settings()
    };
    let s = parse(&[
        "--service-discovery",
        "--selector",
        "app=vllm",
        "tier=gpu,zone=a",
    ])
    .unwrap();
    let k = s.discovery.kubernetes.as_ref().unwrap();
    assert_eq!(k.selectors.len(), 1);
    assert_eq!(k.selectors[0].query(), "app=vllm,tier=gpu,zone=a");
    assert_eq!((k.port, k.namespace.as_deref()), (80, None));
    assert_eq!(s.discovery.interval, Duration::from_secs(30));
    assert!(s.pd.is_none(), "one selector: no disaggregation");
    // smg's provider name, and the halves' selectors, which turn disaggregation on.
    let s = parse(&[
        "--discovery-provider",
        "kubernetes",
        "--prefill-selector",
        "role=p",
        "--decode-selector",
        "role=d",
        "--service-discovery-port",
        "8000",
        "--service-discovery-namespace",
        "ml",
    ])
    .unwrap();
    let k = s.discovery.kubernetes.as_ref().unwrap();
    let roles: Vec<WorkerRole> = k.selectors.iter().map(|s| s.role).collect();
    assert_eq!(roles, [WorkerRole::Prefill, WorkerRole::Decode]);
    assert_eq!((k.port, k.namespace.as_deref()), (8000, Some("ml")));
    assert!(s.pd.is_some(), "prefill and decode selectors disaggregate");
    assert!(s.workers.is_empty() && s.discovery.any());
    // The same from a config file, under the command line.
    let file = Args::from_text(
        "service_discovery: true\nselector: [app=vllm]\ndiscovery_file: /etc/w.yaml\ndiscovery_check_interval_secs: 5\n",
    )
    .unwrap();
    let cli = Args::try_parse_from(["kvroute", "--selector", "app=sglang"]).unwrap();
    let s = cli.merge(file).into_settings().unwrap();
    assert_eq!(
        s.discovery.kubernetes.unwrap().selectors[0].query(),
        "app=sglang"
    );
    assert_eq!(
        s.discovery.file.as_deref(),
        Some(std::path::Path::new("/etc/w.yaml"))
    );
    assert_eq!(s.discovery.interval, Duration::from_secs(5));
    // A static worker is a static one; the file's workers are the config's.
    let s = Args::from_text("worker_urls: [http://a:1]\nworkers: [{url: http://b:1}]\n")
        .unwrap()
        .into_settings()
        .unwrap();
    let sources: Vec<&str> = s.workers.iter().map(|w| w.source.name()).collect();
    assert_eq!(sources, ["static", "config"]);
}

#[test]
fn the_tokenizer_cache_takes_smgs_flags_and_is_on_by_default() {
    let s = Args::default().into_settings().unwrap();
    assert_eq!(s.tokenizer_cache_bytes, 256 << 20);
    let cli = Args::try_parse_from([
        "kvroute",
        "--tokenizer-cache-l1-max-memory",
        "1048576",
        "--tokenizer-cache-enable-l0",
        "--tokenizer-cache-enable-l1",
    ])
    .unwrap();
    assert_eq!(cli.into_settings().unwrap().tokenizer_cache_bytes, 1 << 20);
    let off = Args::from_text("tokenizer_cache_l1_max_memory: 0\n").unwrap();
    assert_eq!(off.into_settings().unwrap().tokenizer_cache_bytes, 0);
    for bad in [
        "--tokenizer-cache-l1-max-memory=50MB",
        "--tokenizer-cache-l1-max-memory=-1",
    ] {
        let e = Args::try_parse_from(["kvroute", bad]);
        assert!(e
            .unwrap_err()
            .to_string()
            .contains("tokenizer-cache-l1-max-memory"));
    }
}

#[test]
fn admission_takes_smgs_values() {
    let admission = |args: &[&str]| {
        let argv = std::iter::once("kvroute").chain(args.iter().copied());
        Args::try_parse_from(argv)
            .unwrap()
            .into_settings()
            .map(|s| s.admission)
    };
    assert_eq!(admission(&[]).unwrap(), None);
    assert_eq!(
        admission(&["--max-concurrent-requests", "0"]).unwrap(),
        None
    );
    let a = admission(&["--max-concurrent-requests", "8"])
        .unwrap()
        .unwrap();
    assert_eq!(
        (a.limit, a.queue_size, a.queue_timeout, a.rate),
        (Some(8), 100, Duration::from_secs(60), None)
    );
    let derived = admission(&["--max-concurrent-requests", "-1"])
        .unwrap()
        .unwrap();
    assert!(derived.limit.unwrap() >= 4096);
    let a = admission(&[
        "--rate-limit-tokens-per-second",
        "5",
        "--queue-size",
        "0",
        "--queue-timeout-secs",
        "3",
    ])
    .unwrap()
    .unwrap();
    assert_eq!(
        (a.limit, a.queue_size, a.queue_timeout, a.rate),
        (None, 0, Duration::from_secs(3), Some(5.0))
    );
    assert_eq!(
        admission(&["--rate-limit-tokens-per-second", "0"]).unwrap(),
        None
    );
    for bad in [
        &["--max-concurrent-requests", "-2"][..],
        &["--rate-limit-tokens-per-second", "-1"],
        &[
            "--queue-timeout-secs",
            "0",
            "--max-concurrent-requests",
            "1",
        ],
    ] {
        assert!(admission(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn the_peers_names_of_kvroutes_flags_are_aliases() {
    let s = Args::try_parse_from([
        "kvroute",
        "--kv-cache-block-size",
        "32",
        "--http-port",
        "8001",
        "--http-host",
        "0.0.0.0",
        "--no-kv-events",
        "--router-session-affinity-ttl-secs",
        "90",
        "--router-session-affinity-mode",
        "hard",
        "--kv-penalty-host",
        "0.5",
    ])
    .unwrap()
    .into_settings()
    .unwrap();
    assert_eq!(
        (s.block_size, s.port, s.host.as_str()),
        (32, 8001, "0.0.0.0")
    );
    assert_eq!(s.kv_events, KvEventsMode::Approximate);
    assert_eq!(
        s.session_affinity,
        Some((
            kvroute_core::affinity::AffinityMode::Hard,
            Duration::from_secs(90)
        ))
    );
    let s = Args::try_parse_from(["kvroute", "--kv-event-block-size", "64"])
        .unwrap()
        .into_settings()
        .unwrap();
    assert_eq!(s.block_size, 64);
}

#[test]
fn the_embedded_engines_timing_model_is_a_flag_and_a_key() {
    use kvroute_sim::engine::TimingFamily;
    let s = Args::default().into_settings().unwrap();
    assert_eq!(s.timing_model, TimingFamily::Kvroute);
    let cli = Args::try_parse_from(["kvroute", "--timing-model", "dynamo"]).unwrap();
    assert_eq!(
        cli.into_settings().unwrap().timing_model,
        TimingFamily::Dynamo
    );
    let file = Args::from_text("timing_model: dynamo\n").unwrap();
    let s = Args::default().merge(file).into_settings().unwrap();
    assert_eq!(s.timing_model, TimingFamily::Dynamo);
    assert!(Args::try_parse_from(["kvroute", "--timing-model", "sglang"]).is_err());
    assert!(Args::from_text("timing_model: fast\n").is_err());
}

#[test]
fn kv_aware_defaults_are_kvroutes_and_dynamos_model_is_five_flags_away() {
    let s = Args::try_parse_from(["kvroute"])
        .unwrap()
        .into_settings()
        .unwrap();
    assert_eq!(s.policy_config.kv_aware, KvAwareConfig::default());
    assert_eq!(s.policy_config.kv_aware.cost_model, CostModel::Calibrated);
    // The KV-overflow term is on, output blocks tracked or not (the engine's reported KV
    // utilisation holds the answers' blocks the router does not count).
    assert!(s.policy_config.kv_aware.kv_overflow_weight > 0.0);
    let tracked = Args::try_parse_from(["kvroute", "--router-track-output-blocks"])
        .unwrap()
        .into_settings()
        .unwrap();
    assert!(tracked.track_output_blocks);
    // Tracked, the router's counts hold the answers: the term applies where no engine has room.
    let counted = KvAwareConfig {
        answers_counted: true,
        ..KvAwareConfig::default()
    };
    assert_eq!(tracked.policy_config.kv_aware, counted);
    let s = Args::try_parse_from([
        "kvroute",
        "--router-cost-model",
        "weighted",
        "--router-kv-overlap-score-credit",
        "1",
        "--router-prefill-load-scale",
        "1",
        "--router-prefill-interference-weight",
        "0",
        "--router-kv-overflow-weight",
        "0",
    ])
    .unwrap()
    .into_settings()
    .unwrap();
    assert_eq!(s.policy_config.kv_aware, KvAwareConfig::dynamo());
    // The same keys in the config file; a bad weight or curve is refused.
    let file = Args::from_text(
        "router_kv_memory_cost: utilisation\nrouter_prefill_interference_weight: 0.5\nrouter_cost_model: predicted",
    )
    .unwrap()
    .into_settings()
    .unwrap();
    assert_eq!(file.policy_config.kv_aware.cost_model, CostModel::Predicted);
    assert_eq!(
        file.policy_config.kv_aware.memory_cost,
        MemoryCost::Utilisation
    );
    assert_eq!(file.policy_config.kv_aware.prefill_interference_weight, 0.5);
    assert!(matches!(
        Args::from_text("router_prefill_interference_weight: -1")
            .unwrap()
            .into_settings(),
        Err(ConfigError::Invalid {
            name: "router_prefill_interference_weight",
            ..
        })
    ));
    assert!(Args::from_text("router_kv_memory_cost: cubic").is_err());
}

#[test]
fn the_fleets_scrapes_have_a_budget_unless_a_policy_decides_on_the_engines_queues() {
    let budget = |argv: &[&str]| {
        let argv = [&["kvroute"][..], argv].concat();
        let s = Args::try_parse_from(argv).unwrap().into_settings().unwrap();
        s.metrics_scrapes_per_sec.map(|n| n.get())
    };
    assert_eq!(budget(&[]), Some(2_000));
    assert_eq!(budget(&["--metrics-scrapes-per-sec", "500"]), Some(500));
    assert_eq!(budget(&["--metrics-scrapes-per-sec", "0"]), None);
    for policy in ["llm_d", "least_load"] {
        assert_eq!(budget(&["--policy", policy]), None, "{policy}");
        let given = ["--policy", policy, "--metrics-scrapes-per-sec", "100"];
        assert_eq!(budget(&given), Some(100), "{policy}");
    }
    let pd = ["--pd-disaggregation", "--decode-policy", "llm_d"];
    assert_eq!(budget(&pd), None);
    assert_eq!(budget(&["--pd-disaggregation"]), Some(2_000));
    let file = Args::from_text("metrics_scrapes_per_sec: 300\n").unwrap();
    assert_eq!(
        (file.into_settings().unwrap().metrics_scrapes_per_sec).map(|n| n.get()),
        Some(300)
    );
}
