//! `--dump-config-to`: the settings kvroute starts with, written back in the config file's
//! schema.

use std::path::Path;

use super::{Args, ConfigError};

impl Args {
    /// These arguments as pretty JSON in the `--config` file's schema (YAML reads JSON, so
    /// `--config` loads it back): every key, unset ones as `null`, policies by name. The
    /// secrets (`admin_api_key`, `client_api_key`, `api_key`, `tenant_api_key`) are left
    /// out, and so are `config` and `dump_config_to`.
    pub fn dump_json(&self) -> String {
        let mut text = serde_json::to_string_pretty(self).expect("Args serialise to JSON");
        text.push('\n');
        text
    }
}

/// Writes the dump to `path`.
pub(super) fn write(path: &Path, text: &str) -> Result<(), ConfigError> {
    std::fs::write(path, text).map_err(|source| ConfigError::Dump {
        path: path.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use serde_json::Value;

    use super::*;

    fn parse(flags: &[&str]) -> Args {
        Args::try_parse_from(std::iter::once("kvroute").chain(flags.iter().copied())).unwrap()
    }

    fn json(args: &Args) -> Value {
        serde_json::from_str(&args.dump_json()).unwrap()
    }

    #[test]
    fn the_dump_loads_back_as_the_same_arguments() {
        let args = parse(&[
            "--worker-urls",
            "http://a:8000",
            "--policy",
            "cache_aware",
            "--decode-policy",
            "round_robin",
            "--cache-threshold",
            "0.5",
            "--log-level",
            "warning",
            "--assignment-mode",
            "min_load",
            "--pd-protocol",
            "sglang",
            "--disable-retries",
            "--max-concurrent-requests",
            "-1",
        ]);
        let dumped = json(&args);
        assert_eq!(dumped["policy"], "cache_aware");
        assert_eq!(dumped["decode_policy"], "round_robin");
        assert_eq!(dumped["prefill_policy"], Value::Null);
        assert_eq!(dumped["log_level"], "warn");
        assert_eq!(dumped["assignment_mode"], "min_load");
        assert_eq!(dumped["pd_protocol"], "sglang");
        assert_eq!(dumped["disable_retries"], true);
        assert_eq!(dumped["max_concurrent_requests"], -1);
        assert_eq!(dumped["peer_noop_flags"], serde_json::json!([]));
        let back = Args::from_text(&args.dump_json()).unwrap();
        assert_eq!(back.dump_json(), args.dump_json());
    }

    #[test]
    fn the_endpoint_pickers_flags_are_dumped() {
        let args = parse(&[
            "--epp",
            "--secure-serving=false",
            "--endpoint-selector",
            "app=vllm",
            "--endpoint-target-ports",
            "8000,8001",
            "--kv-events-socket-port",
            "5557",
            "--metrics-port",
            "9191",
        ]);
        let dumped = json(&args);
        assert_eq!(dumped["epp"], true);
        assert_eq!(dumped["secure_serving"], false);
        assert_eq!(dumped["endpoint_selector"], "app=vllm");
        assert_eq!(
            dumped["endpoint_target_ports"],
            serde_json::json!([8000, 8001])
        );
        assert_eq!(dumped["kv_events_socket_port"], 5557);
        assert_eq!(dumped["metrics_port"], 9191);
        assert_eq!(dumped["pool_name"], Value::Null);
        let back = Args::from_text(&args.dump_json()).unwrap();
        assert_eq!(back.dump_json(), args.dump_json());
    }

    #[test]
    fn the_config_files_workers_and_classes_are_dumped() {
        let file = Args::from_text(
            "workers:\n  - url: http://a:1\n    model: m\n    role: prefill\n    \
             bootstrap_port: 8998\npolicy_classes:\n  - name: gold\n    weight: 4\n",
        )
        .unwrap();
        let args = parse(&["--port", "1"]).merge(file);
        let dumped = json(&args);
        assert_eq!(dumped["workers"][0]["role"], "prefill");
        assert_eq!(dumped["workers"][0]["bootstrap_port"], 8998);
        assert_eq!(dumped["policy_classes"][0]["weight"], 4);
        let back = Args::from_text(&args.dump_json()).unwrap();
        assert_eq!(back.workers, args.workers);
        assert_eq!(back.policy_classes, args.policy_classes);
    }

    #[test]
    fn secrets_and_the_files_own_paths_are_left_out() {
        let args = parse(&[
            "--admin-api-key",
            "s3cret-admin",
            "--client-api-key",
            "s3cret-client",
            "--api-key",
            "s3cret-worker",
            "--config",
            "/tmp/router.yaml",
            "--dump-config-to",
            "/tmp/dump.json",
        ]);
        let text = args.dump_json();
        assert!(!text.contains("s3cret"), "{text}");
        let dumped: Value = serde_json::from_str(&text).unwrap();
        for key in [
            "admin_api_key",
            "client_api_key",
            "api_key",
            "config",
            "dump_config_to",
        ] {
            assert!(dumped.get(key).is_none(), "{key} in {text}");
        }
        // Secrets still load from a file.
        let back = Args::from_text("api_key: k\n").unwrap();
        assert_eq!(back.api_key.as_deref(), Some("k"));
    }

    #[test]
    fn load_writes_the_dump_only_for_a_valid_config() {
        let dir = std::env::temp_dir().join(format!("kvroute-dump-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("dump.json");
        let file = dir.join("router.yaml");
        std::fs::write(&file, "port: 4321\nrouter_ttl_secs: 30\n").unwrap();
        let (f, o) = (file.to_str().unwrap(), out.to_str().unwrap());
        parse(&["--config", f, "--dump-config-to", o, "--policy", "random"])
            .load()
            .unwrap();
        let dumped: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        assert_eq!(dumped["port"], 4321);
        assert_eq!(dumped["router_ttl_secs"], 30);
        assert_eq!(dumped["policy"], "random");
        // Loadable with --config.
        let again = Args::from_file(&out).unwrap();
        assert_eq!(again.port, Some(4321));
        std::fs::remove_file(&out).unwrap();

        // A config that does not validate exits before anything is written.
        let err = parse(&["--dump-config-to", o, "--block-size", "0"])
            .load()
            .unwrap_err();
        assert!(err.to_string().contains("block_size"), "{err}");
        assert!(!out.exists());

        // A path that cannot be written is named.
        let bad = dir.join("no-such-dir").join("dump.json");
        let err = parse(&["--dump-config-to", bad.to_str().unwrap()])
            .load()
            .unwrap_err();
        assert!(matches!(err, ConfigError::Dump { .. }), "{err}");
        assert!(err.to_string().contains(bad.to_str().unwrap()), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
