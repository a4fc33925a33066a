use std::path::PathBuf;

use clap::Parser;

use super::*;
use crate::config::{Args, Settings};

fn parse(flags: &[&str]) -> Args {
    Args::try_parse_from(std::iter::once("kvroute").chain(flags.iter().copied())).unwrap()
}

fn settings(flags: &[&str]) -> Result<Settings, ConfigError> {
    parse(flags).into_settings()
}

fn epp(flags: &[&str]) -> EppSettings {
    settings(flags).unwrap().epp.expect("endpoint picker on")
}

fn err(flags: &[&str]) -> String {
    settings(flags).unwrap_err().to_string()
}

/// A fresh directory under the system's temp dir.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-epp-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn the_picker_is_off_by_default_and_its_flags_need_it() {
    assert_eq!(settings(&[]).unwrap().epp, None);
    for flags in [
        &["--grpc-port", "1"][..],
        &["--grpc-health-port", "1"],
        &["--secure-serving=false"],
        &["--cert-path", "/tmp"],
        &["--pool-namespace", "ns"],
        &["--pool-group", "g"],
        &["--endpoint-target-ports", "8000"],
        &["--kv-events-socket-port", "5557"],
    ] {
        let e = err(flags);
        assert!(e.contains("only in endpoint-picker mode"), "{flags:?}: {e}");
    }
}

#[test]
fn pool_name_implies_the_picker_with_llm_ds_defaults() {
    let e = EppFlags {
        pool_name: Some("my-pool".into()),
        kubeconfig: Some(std::path::Path::new("/k/config")),
        ..EppFlags::default()
    }
    .settings()
    .unwrap()
    .unwrap();
    assert_eq!(
        e,
        EppSettings {
            grpc_port: 9002,
            grpc_health_port: 9003,
            serving: EppServing::SelfSigned,
            endpoints: EppEndpoints::Pool(PoolRef {
                name: "my-pool".into(),
                namespace: "default".into(),
                group: "inference.networking.k8s.io".into(),
                kubeconfig: Some("/k/config".into()),
            }),
            kv_events_port: None,
        }
    );
    // The namespace defaults to $NAMESPACE, and the flag wins over it.
    let ns = |flag: Option<&str>, env: Option<&str>| {
        let e = EppFlags {
            pool_name: Some("p".into()),
            pool_namespace: flag.map(str::to_owned),
            namespace_env: env.map(str::to_owned),
            ..EppFlags::default()
        }
        .settings()
        .unwrap()
        .unwrap();
        match e.endpoints {
            EppEndpoints::Pool(p) => p.namespace,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(ns(None, Some("from-env")), "from-env");
    assert_eq!(ns(Some("ns"), Some("from-env")), "ns");
    assert_eq!(ns(None, Some("")), "default");
    // Through the parser: the flags and the kubeconfig shared with discovery.
    let e = epp(&[
        "--pool-name",
        "p",
        "--pool-namespace",
        "ns",
        "--pool-group",
        "inference.networking.x-k8s.io",
        "--kubeconfig",
        "/kc",
        "--grpc-port",
        "9102",
        "--grpc-health-port",
        "9103",
    ]);
    assert_eq!((e.grpc_port, e.grpc_health_port), (9102, 9103));
    assert_eq!(
        e.endpoints,
        EppEndpoints::Pool(PoolRef {
            name: "p".into(),
            namespace: "ns".into(),
            group: "inference.networking.x-k8s.io".into(),
            kubeconfig: Some("/kc".into()),
        })
    );
}

#[test]
fn the_metrics_port_is_llm_ds_9090_in_picker_mode_and_one_flag_of_two() {
    let s = settings(&["--pool-name", "p"]).unwrap();
    assert_eq!(s.prometheus_port, 9090);
    assert_eq!(
        settings(&["--pool-name", "p", "--metrics-port", "9191"])
            .unwrap()
            .prometheus_port,
        9191
    );
    assert_eq!(
        settings(&["--pool-name", "p", "--prometheus-port", "9292"])
            .unwrap()
            .prometheus_port,
        9292
    );
    // Outside the picker, --metrics-port is --prometheus-port; kvroute's default stays.
    assert_eq!(settings(&[]).unwrap().prometheus_port, 29000);
    assert_eq!(
        settings(&["--metrics-port", "9191"])
            .unwrap()
            .prometheus_port,
        9191
    );
    // Both: refused on the command line by clap, and in the merged config by validation.
    assert!(
        Args::try_parse_from(["kvroute", "--metrics-port", "1", "--prometheus-port", "2"]).is_err()
    );
    let file = Args::from_text("metrics_port: 1\nprometheus_port: 2\n").unwrap();
    let e = file.into_settings().unwrap_err().to_string();
    assert!(e.contains("--metrics-port and --prometheus-port"), "{e}");
    // The command line's one wins over the file's other.
    let file = Args::from_text("prometheus_port: 2\n").unwrap();
    let s = parse(&["--metrics-port", "1"])
        .merge(file)
        .into_settings()
        .unwrap();
    assert_eq!(s.prometheus_port, 1);
}

#[test]
fn secure_serving_takes_go_booleans_and_cert_path_needs_both_files() {
    let serving = |flags: &[&str]| {
        let mut all = vec!["--pool-name", "p"];
        all.extend_from_slice(flags);
        epp(&all).serving
    };
    assert_eq!(serving(&[]), EppServing::SelfSigned);
    assert_eq!(serving(&["--secure-serving"]), EppServing::SelfSigned);
    assert_eq!(serving(&["--secure-serving=true"]), EppServing::SelfSigned);
    assert_eq!(serving(&["--secure-serving=false"]), EppServing::H2c);
    assert_eq!(serving(&["--secure-serving=0"]), EppServing::H2c);
    assert_eq!(serving(&["--secure-serving=True"]), EppServing::SelfSigned);
    let e = Args::try_parse_from(["kvroute", "--secure-serving=maybe"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("maybe is not a boolean"), "{e}");
    // In the config file, a YAML boolean.
    let file =
        Args::from_text("epp: true\nsecure_serving: false\nworker_urls: ['http://a:1']\n").unwrap();
    assert_eq!(
        file.into_settings().unwrap().epp.unwrap().serving,
        EppServing::H2c
    );

    let dir = temp_dir("certs");
    let d = dir.to_str().unwrap();
    let e = err(&["--pool-name", "p", "--cert-path", d]);
    assert!(e.contains("tls.crt") && e.contains(d), "{e}");
    std::fs::write(dir.join("tls.crt"), "x").unwrap();
    let e = err(&["--pool-name", "p", "--cert-path", d]);
    assert!(e.contains("tls.key"), "{e}");
    std::fs::write(dir.join("tls.key"), "x").unwrap();
    assert_eq!(
        serving(&["--cert-path", d]),
        EppServing::CertDir(dir.clone())
    );
    let e = err(&[
        "--pool-name",
        "p",
        "--cert-path",
        d,
        "--secure-serving=false",
    ]);
    assert!(
        e.contains("cert_path") && e.contains("needs secure serving"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn endpoint_selector_takes_target_ports_as_a_list_or_repeated() {
    let e = epp(&[
        "--endpoint-selector",
        "app=vllm,env in (prod)",
        "--endpoint-target-ports",
        "8000,8001",
        "--endpoint-target-ports=8002",
        "--endpoint-target-ports",
        "8000",
        "--pool-namespace",
        "ns",
    ]);
    assert_eq!(
        e.endpoints,
        EppEndpoints::Selector {
            selector: "app=vllm,env in (prod)".into(),
            target_ports: vec![8000, 8001, 8002],
            namespace: "ns".into(),
            kubeconfig: None,
        }
    );
    let e = err(&["--endpoint-selector", "app=vllm"]);
    assert!(e.contains("needs at least one target port"), "{e}");
    let e = err(&[
        "--pool-name",
        "p",
        "--endpoint-selector",
        "app=vllm",
        "--endpoint-target-ports",
        "8000",
    ]);
    assert!(e.contains("not both"), "{e}");
    let e = err(&["--pool-name", "p", "--endpoint-target-ports", "8000"]);
    assert!(e.contains("goes with --endpoint-selector"), "{e}");
    let e = err(&["--endpoint-selector", "a=b", "--endpoint-target-ports", "0"]);
    assert!(e.contains("must not be 0"), "{e}");
    let e = err(&["--endpoint-selector", " ", "--endpoint-target-ports", "1"]);
    assert!(e.contains("must not be empty"), "{e}");
    // In the config file.
    let file =
        Args::from_text("endpoint_selector: app=sglang\nendpoint_target_ports: [30000]\n").unwrap();
    let e = file.into_settings().unwrap().epp.unwrap();
    assert!(
        matches!(e.endpoints, EppEndpoints::Selector { ref target_ports, .. } if target_ports == &[30000])
    );
}

#[test]
fn epp_alone_picks_among_the_static_workers_and_needs_some() {
    let s = settings(&["--epp", "--worker-urls", "http://a:8000"]).unwrap();
    assert_eq!(s.epp.unwrap().endpoints, EppEndpoints::Static);
    assert_eq!(s.workers.len(), 1);
    // No worker: no embedded engines in picker mode, an error instead.
    let e = err(&["--epp"]);
    assert!(e.contains("no endpoints"), "{e}");
    // A discovery source finds them.
    let s = settings(&["--epp", "--service-discovery", "--selector", "app=vllm"]).unwrap();
    assert_eq!(s.epp.unwrap().endpoints, EppEndpoints::Static);
    // A pool or a selector needs no worker.
    assert!(settings(&["--pool-name", "p"]).unwrap().workers.is_empty());
    // Without the picker, no worker still means the embedded engines (main's choice).
    assert!(settings(&[]).unwrap().epp.is_none());
}

#[test]
fn the_grpc_ports_differ() {
    let e = err(&["--pool-name", "p", "--grpc-port", "9003"]);
    assert!(e.contains("must differ from grpc_port"), "{e}");
    // Port 0 (any free port, for tests) twice is fine.
    let e = epp(&[
        "--pool-name",
        "p",
        "--grpc-port",
        "0",
        "--grpc-health-port",
        "0",
    ]);
    assert_eq!((e.grpc_port, e.grpc_health_port), (0, 0));
}

#[test]
fn a_reload_keeps_the_file_s_picker_flags_valid() {
    // Started with --pool-name on the command line, the re-read file has picker keys.
    let cli = crate::config::CliWorkers {
        epp: true,
        ..Default::default()
    };
    let file = Args::from_text("grpc_port: 9102\nworker_urls: ['http://a:1']\n").unwrap();
    let s = cli.over(file).into_settings().unwrap();
    assert_eq!(s.workers.len(), 1);
}

#[test]
fn the_picker_listens_on_every_interface_unless_told() {
    let pool = ["--pool-name", "p"];
    let s = settings(&pool).unwrap();
    assert_eq!(
        (s.host.as_str(), s.prometheus_host.as_str()),
        ("0.0.0.0", "0.0.0.0")
    );
    let s = settings(&["--pool-name", "p", "--host", "127.0.0.1"]).unwrap();
    assert_eq!(s.host, "127.0.0.1");
    assert_eq!(
        settings(&[]).unwrap().host,
        "127.0.0.1",
        "the proxy keeps loopback"
    );
}

#[test]
fn prefill_decode_disaggregation_is_refused_in_picker_mode() {
    let e = err(&[
        "--epp",
        "--pd-disaggregation",
        "--prefill",
        "http://p:8000",
        "--decode",
        "http://d:8000",
    ]);
    assert!(e.contains("not in endpoint-picker mode"), "{e}");
}

#[test]
fn engine_priority_is_refused_in_picker_mode_and_off_is_fine() {
    let e = err(&[
        "--epp",
        "--worker-urls",
        "http://w:8000",
        "--engine-priority",
        "vllm",
    ]);
    assert!(
        e.contains("engine_priority") && e.contains("endpoint-picker"),
        "{e}"
    );
    let off = [
        "--epp",
        "--worker-urls",
        "http://w:8000",
        "--engine-priority",
        "off",
    ];
    assert!(settings(&off).is_ok());
    let proxy = settings(&[
        "--worker-urls",
        "http://w:8000",
        "--engine-priority",
        "sglang",
    ]);
    assert_eq!(
        proxy.unwrap().engine_priority,
        kvroute_core::queue::engine_priority::EnginePriority::Sglang
    );
}
