//! The command line over the config file.

use super::*;

/// Builds `Args` from `$cli` (the command line) over `$file`, one rule per kind of field:
/// `opt` fields take the command line's value if it has one, `flag`s are set if either sets
/// them, `list`s take the command line's if it is not empty; the fields after them are
/// special and spelled out.
macro_rules! merge_fields {
    (
        $cli:ident, $file:ident;
        opt $($opt:ident),* $(,)?;
        flag $($flag:ident),* $(,)?;
        list $($list:ident),* $(,)?;
        $($field:ident: $value:expr),* $(,)?
    ) => {
        Args {
            $($opt: $cli.$opt.or($file.$opt),)*
            $($flag: $cli.$flag || $file.$flag,)*
            $($list: if $cli.$list.is_empty() { $file.$list } else { $cli.$list },)*
            $($field: $value,)*
        }
    };
}

impl Args {
    /// `self` (the command line) over `file`.
    pub fn merge(self, file: Args) -> Args {
        let cli_metrics_port = self.prometheus_port.is_some() || self.metrics_port.is_some();
        let cli_llm_d_config = self.config_file.is_some() || self.config_text.is_some();
        merge_fields!(self, file;
        opt
            host, port, prometheus_host, discovery_provider, service_discovery_port,
            service_discovery_namespace, kubeconfig, discovery_file,
            discovery_check_interval_secs, prefill_policy, decode_policy, pd_protocol,
            pd_min_uncached_tokens, policy, prefix_token_count, prefix_hash_load_factor,
            max_idle_secs, assignment_mode, cache_threshold, balance_abs_threshold,
            balance_rel_threshold, eviction_interval_secs, max_tree_size, llm_d_prefix_weight,
            llm_d_queue_weight, llm_d_kv_weight, llm_d_lora_weight, least_load_kv_pressure_weight,
            least_load_default_throughput, least_load_mean_prefill_tokens,
            least_load_max_waiting_requests, worker_overload_waiting_requests,
            worker_overload_token_usage, metrics_refresh_ms, metrics_scrapes_per_sec, block_size,
            router_ttl_secs, router_max_indexed_blocks, router_event_threads, router_sample_ranks, tokenizer,
            tokenizer_cache_l1_max_memory, active_prefill_tokens_threshold,
            active_prefill_tokens_threshold_frac, active_decode_blocks_threshold, admin_api_key,
            client_api_key, replica_sync, replica_sync_subject_prefix, replica_timeout_secs,
            api_key, client_cert_path, client_key_path, tls_cert_path, tls_key_path,
            health_check_interval_secs, health_check_timeout_secs, health_failure_threshold,
            health_success_threshold, health_check_endpoint, worker_startup_timeout_secs,
            health_check_port, retry_max_retries, retry_initial_backoff_ms,
            retry_max_backoff_ms, retry_backoff_multiplier, retry_jitter_factor,
            migration_limit, migration_stall_timeout_secs, cb_failure_threshold,
            cb_success_threshold, cb_timeout_duration_secs, max_concurrent_requests, queue_size,
            queue_timeout_secs, rate_limit_tokens_per_second, shutdown_grace_period_secs,
            header_read_timeout_secs, router_queue_threshold, router_queue_policy,
            router_queue_timeout_secs, session_affinity_ttl_secs, session_affinity_mode,
            max_payload_size, request_timeout_secs, log_level, otlp_traces_endpoint,
            otlp_sampling_ratio, timing_model, grpc_port, grpc_health_port, secure_serving,
            cert_path, pool_name, pool_namespace, pool_group, endpoint_selector,
            kv_events_socket_port, metrics_prefix, tenant_header_name, jwt_issuer, jwt_audience,
            jwt_jwks_uri, priority_scheduler_tenant_metric_top_n, router_queue_fairness,
            priority_scheduler_config, priority_scheduler_default_max_class, engine_priority,
            tenant_rate_limit_config;
        flag
            service_discovery, pd_disaggregation, llm_d_precise_prefix,
            worker_overload_protection, disable_worker_overload_protection,
            worker_overload_shed, no_router_kv_events, tokenizer_cache_enable_l0,
            tokenizer_cache_enable_l1, disable_retries, disable_circuit_breaker, log_json,
            enable_trace, epp, trust_tenant_header, priority_scheduler_enabled,
            tenant_rate_limit_enabled;
        list
            worker_urls, selector, prefill_selector, decode_selector, prefill, decode,
            ca_cert_paths, routing_key_headers, endpoint_target_ports, metrics_compat,
            peer_noop_flags, tenant_api_key, jwt_role_mapping;
            // Only on the command line.
            config: self.config,
            dump_config_to: self.dump_config_to,
            slo: self.slo.merge(file.slo),
            kv_aware: self.kv_aware.merge(file.kv_aware),
            // Only in the file.
            workers: file.workers,
            policy_classes: file.policy_classes,
            // The file's setting of one of the pair yields to the command line's of the other.
            remove_unhealthy_workers: self.remove_unhealthy_workers
                || (file.remove_unhealthy_workers && !self.no_remove_unhealthy_workers),
            no_remove_unhealthy_workers: self.no_remove_unhealthy_workers
                || (file.no_remove_unhealthy_workers && !self.remove_unhealthy_workers),
            // Pairs of spellings of one setting: the command line's wins as a whole.
            prometheus_port: if cli_metrics_port {
                self.prometheus_port
            } else {
                file.prometheus_port
            },
            metrics_port: if cli_metrics_port {
                self.metrics_port
            } else {
                file.metrics_port
            },
            config_file: if cli_llm_d_config {
                self.config_file
            } else {
                file.config_file
            },
            config_text: if cli_llm_d_config {
                self.config_text
            } else {
                file.config_text
            },
        )
    }
}
