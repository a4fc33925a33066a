//! The command line over the config file.

use super::*;

impl Args {
    /// `self` (the command line) over `file`.
    pub fn merge(self, file: Args) -> Args {
        let cli_metrics_port = self.prometheus_port.is_some() || self.metrics_port.is_some();
        let cli_llm_d_config = self.config_file.is_some() || self.config_text.is_some();
        Args {
            config: self.config,
            host: self.host.or(file.host),
            port: self.port.or(file.port),
            prometheus_host: self.prometheus_host.or(file.prometheus_host),
            prometheus_port: if cli_metrics_port {
                self.prometheus_port
            } else {
                file.prometheus_port
            },
            worker_urls: if self.worker_urls.is_empty() {
                file.worker_urls
            } else {
                self.worker_urls
            },
            workers: file.workers,
            service_discovery: self.service_discovery || file.service_discovery,
            discovery_provider: self.discovery_provider.or(file.discovery_provider),
            selector: if self.selector.is_empty() {
                file.selector
            } else {
                self.selector
            },
            prefill_selector: if self.prefill_selector.is_empty() {
                file.prefill_selector
            } else {
                self.prefill_selector
            },
            decode_selector: if self.decode_selector.is_empty() {
                file.decode_selector
            } else {
                self.decode_selector
            },
            service_discovery_port: self.service_discovery_port.or(file.service_discovery_port),
            service_discovery_namespace: self
                .service_discovery_namespace
                .or(file.service_discovery_namespace),
            kubeconfig: self.kubeconfig.or(file.kubeconfig),
            discovery_file: self.discovery_file.or(file.discovery_file),
            discovery_check_interval_secs: self
                .discovery_check_interval_secs
                .or(file.discovery_check_interval_secs),
            pd_disaggregation: self.pd_disaggregation || file.pd_disaggregation,
            prefill: if self.prefill.is_empty() {
                file.prefill
            } else {
                self.prefill
            },
            decode: if self.decode.is_empty() {
                file.decode
            } else {
                self.decode
            },
            prefill_policy: self.prefill_policy.or(file.prefill_policy),
            decode_policy: self.decode_policy.or(file.decode_policy),
            pd_protocol: self.pd_protocol.or(file.pd_protocol),
            pd_min_uncached_tokens: self.pd_min_uncached_tokens.or(file.pd_min_uncached_tokens),
            policy: self.policy.or(file.policy),
            prefix_token_count: self.prefix_token_count.or(file.prefix_token_count),
            prefix_hash_load_factor: self
                .prefix_hash_load_factor
                .or(file.prefix_hash_load_factor),
            max_idle_secs: self.max_idle_secs.or(file.max_idle_secs),
            assignment_mode: self.assignment_mode.or(file.assignment_mode),
            cache_threshold: self.cache_threshold.or(file.cache_threshold),
            balance_abs_threshold: self.balance_abs_threshold.or(file.balance_abs_threshold),
            balance_rel_threshold: self.balance_rel_threshold.or(file.balance_rel_threshold),
            eviction_interval_secs: self.eviction_interval_secs.or(file.eviction_interval_secs),
            max_tree_size: self.max_tree_size.or(file.max_tree_size),
            llm_d_prefix_weight: self.llm_d_prefix_weight.or(file.llm_d_prefix_weight),
            llm_d_queue_weight: self.llm_d_queue_weight.or(file.llm_d_queue_weight),
            llm_d_kv_weight: self.llm_d_kv_weight.or(file.llm_d_kv_weight),
            llm_d_precise_prefix: self.llm_d_precise_prefix || file.llm_d_precise_prefix,
            least_load_kv_pressure_weight: self
                .least_load_kv_pressure_weight
                .or(file.least_load_kv_pressure_weight),
            least_load_default_throughput: self
                .least_load_default_throughput
                .or(file.least_load_default_throughput),
            least_load_mean_prefill_tokens: self
                .least_load_mean_prefill_tokens
                .or(file.least_load_mean_prefill_tokens),
            least_load_max_waiting_requests: self
                .least_load_max_waiting_requests
                .or(file.least_load_max_waiting_requests),
            worker_overload_waiting_requests: self
                .worker_overload_waiting_requests
                .or(file.worker_overload_waiting_requests),
            worker_overload_token_usage: self
                .worker_overload_token_usage
                .or(file.worker_overload_token_usage),
            worker_overload_protection: self.worker_overload_protection
                || file.worker_overload_protection,
            disable_worker_overload_protection: self.disable_worker_overload_protection
                || file.disable_worker_overload_protection,
            worker_overload_shed: self.worker_overload_shed || file.worker_overload_shed,
            metrics_refresh_ms: self.metrics_refresh_ms.or(file.metrics_refresh_ms),
            block_size: self.block_size.or(file.block_size),
            router_kv_overlap_score_credit: self
                .router_kv_overlap_score_credit
                .or(file.router_kv_overlap_score_credit),
            router_prefill_load_scale: self
                .router_prefill_load_scale
                .or(file.router_prefill_load_scale),
            router_decode_active_request_weight: self
                .router_decode_active_request_weight
                .or(file.router_decode_active_request_weight),
            router_kv_memory_cost: self.router_kv_memory_cost.or(file.router_kv_memory_cost),
            router_prefill_interference_weight: self
                .router_prefill_interference_weight
                .or(file.router_prefill_interference_weight),
            router_temperature: self.router_temperature.or(file.router_temperature),
            router_host_cache_hit_weight: self
                .router_host_cache_hit_weight
                .or(file.router_host_cache_hit_weight),
            router_disk_cache_hit_weight: self
                .router_disk_cache_hit_weight
                .or(file.router_disk_cache_hit_weight),
            shared_cache_multiplier: self
                .shared_cache_multiplier
                .or(file.shared_cache_multiplier),
            no_router_kv_events: self.no_router_kv_events || file.no_router_kv_events,
            router_ttl_secs: self.router_ttl_secs.or(file.router_ttl_secs),
            router_max_indexed_blocks: self
                .router_max_indexed_blocks
                .or(file.router_max_indexed_blocks),
            tokenizer: self.tokenizer.or(file.tokenizer),
            tokenizer_cache_l1_max_memory: self
                .tokenizer_cache_l1_max_memory
                .or(file.tokenizer_cache_l1_max_memory),
            tokenizer_cache_enable_l0: self.tokenizer_cache_enable_l0
                || file.tokenizer_cache_enable_l0,
            tokenizer_cache_enable_l1: self.tokenizer_cache_enable_l1
                || file.tokenizer_cache_enable_l1,
            active_prefill_tokens_threshold: self
                .active_prefill_tokens_threshold
                .or(file.active_prefill_tokens_threshold),
            active_prefill_tokens_threshold_frac: self
                .active_prefill_tokens_threshold_frac
                .or(file.active_prefill_tokens_threshold_frac),
            active_decode_blocks_threshold: self
                .active_decode_blocks_threshold
                .or(file.active_decode_blocks_threshold),
            admin_api_key: self.admin_api_key.or(file.admin_api_key),
            client_api_key: self.client_api_key.or(file.client_api_key),
            replica_sync: self.replica_sync.or(file.replica_sync),
            replica_sync_subject_prefix: self
                .replica_sync_subject_prefix
                .or(file.replica_sync_subject_prefix),
            replica_timeout_secs: self.replica_timeout_secs.or(file.replica_timeout_secs),
            api_key: self.api_key.or(file.api_key),
            ca_cert_paths: if self.ca_cert_paths.is_empty() {
                file.ca_cert_paths
            } else {
                self.ca_cert_paths
            },
            client_cert_path: self.client_cert_path.or(file.client_cert_path),
            client_key_path: self.client_key_path.or(file.client_key_path),
            tls_cert_path: self.tls_cert_path.or(file.tls_cert_path),
            tls_key_path: self.tls_key_path.or(file.tls_key_path),
            health_check_interval_secs: self
                .health_check_interval_secs
                .or(file.health_check_interval_secs),
            health_check_timeout_secs: self
                .health_check_timeout_secs
                .or(file.health_check_timeout_secs),
            health_failure_threshold: self
                .health_failure_threshold
                .or(file.health_failure_threshold),
            health_success_threshold: self
                .health_success_threshold
                .or(file.health_success_threshold),
            health_check_endpoint: self.health_check_endpoint.or(file.health_check_endpoint),
            remove_unhealthy_workers: self.remove_unhealthy_workers
                || (file.remove_unhealthy_workers && !self.no_remove_unhealthy_workers),
            no_remove_unhealthy_workers: self.no_remove_unhealthy_workers
                || (file.no_remove_unhealthy_workers && !self.remove_unhealthy_workers),
            worker_startup_timeout_secs: self
                .worker_startup_timeout_secs
                .or(file.worker_startup_timeout_secs),
            health_check_port: self.health_check_port.or(file.health_check_port),
            retry_max_retries: self.retry_max_retries.or(file.retry_max_retries),
            retry_initial_backoff_ms: self
                .retry_initial_backoff_ms
                .or(file.retry_initial_backoff_ms),
            retry_max_backoff_ms: self.retry_max_backoff_ms.or(file.retry_max_backoff_ms),
            retry_backoff_multiplier: self
                .retry_backoff_multiplier
                .or(file.retry_backoff_multiplier),
            retry_jitter_factor: self.retry_jitter_factor.or(file.retry_jitter_factor),
            disable_retries: self.disable_retries || file.disable_retries,
            migration_limit: self.migration_limit.or(file.migration_limit),
            migration_stall_timeout_secs: self
                .migration_stall_timeout_secs
                .or(file.migration_stall_timeout_secs),
            cb_failure_threshold: self.cb_failure_threshold.or(file.cb_failure_threshold),
            cb_success_threshold: self.cb_success_threshold.or(file.cb_success_threshold),
            cb_timeout_duration_secs: self
                .cb_timeout_duration_secs
                .or(file.cb_timeout_duration_secs),
            disable_circuit_breaker: self.disable_circuit_breaker || file.disable_circuit_breaker,
            max_concurrent_requests: self
                .max_concurrent_requests
                .or(file.max_concurrent_requests),
            queue_size: self.queue_size.or(file.queue_size),
            queue_timeout_secs: self.queue_timeout_secs.or(file.queue_timeout_secs),
            rate_limit_tokens_per_second: self
                .rate_limit_tokens_per_second
                .or(file.rate_limit_tokens_per_second),
            shutdown_grace_period_secs: self
                .shutdown_grace_period_secs
                .or(file.shutdown_grace_period_secs),
            header_read_timeout_secs: self
                .header_read_timeout_secs
                .or(file.header_read_timeout_secs),
            router_queue_threshold: self.router_queue_threshold.or(file.router_queue_threshold),
            router_queue_policy: self.router_queue_policy.or(file.router_queue_policy),
            router_queue_timeout_secs: self
                .router_queue_timeout_secs
                .or(file.router_queue_timeout_secs),
            policy_classes: file.policy_classes,
            session_affinity_ttl_secs: self
                .session_affinity_ttl_secs
                .or(file.session_affinity_ttl_secs),
            session_affinity_mode: self.session_affinity_mode.or(file.session_affinity_mode),
            max_payload_size: self.max_payload_size.or(file.max_payload_size),
            request_timeout_secs: self.request_timeout_secs.or(file.request_timeout_secs),
            log_level: self.log_level.or(file.log_level),
            log_json: self.log_json || file.log_json,
            routing_key_headers: if self.routing_key_headers.is_empty() {
                file.routing_key_headers
            } else {
                self.routing_key_headers
            },
            otlp_traces_endpoint: self.otlp_traces_endpoint.or(file.otlp_traces_endpoint),
            enable_trace: self.enable_trace || file.enable_trace,
            otlp_sampling_ratio: self.otlp_sampling_ratio.or(file.otlp_sampling_ratio),
            timing_model: self.timing_model.or(file.timing_model),
            epp: self.epp || file.epp,
            grpc_port: self.grpc_port.or(file.grpc_port),
            grpc_health_port: self.grpc_health_port.or(file.grpc_health_port),
            secure_serving: self.secure_serving.or(file.secure_serving),
            cert_path: self.cert_path.or(file.cert_path),
            pool_name: self.pool_name.or(file.pool_name),
            pool_namespace: self.pool_namespace.or(file.pool_namespace),
            pool_group: self.pool_group.or(file.pool_group),
            endpoint_selector: self.endpoint_selector.or(file.endpoint_selector),
            endpoint_target_ports: if self.endpoint_target_ports.is_empty() {
                file.endpoint_target_ports
            } else {
                self.endpoint_target_ports
            },
            // Pairs of spellings of one setting: the command line's wins as a whole.
            metrics_port: if cli_metrics_port {
                self.metrics_port
            } else {
                file.metrics_port
            },
            kv_events_socket_port: self.kv_events_socket_port.or(file.kv_events_socket_port),
            metrics_compat: if self.metrics_compat.is_empty() {
                file.metrics_compat
            } else {
                self.metrics_compat
            },
            metrics_prefix: self.metrics_prefix.or(file.metrics_prefix),
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
            dump_config_to: self.dump_config_to,
            peer_noop_flags: if self.peer_noop_flags.is_empty() {
                file.peer_noop_flags
            } else {
                self.peer_noop_flags
            },
        }
    }
}
