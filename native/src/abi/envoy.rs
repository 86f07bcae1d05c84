//! The callbacks as Envoy exports them (the pinned 1.40.0 exports every one).

use super::*;

extern "C" {
    #[link_name = "envoy_dynamic_module_callback_log_v2"]
    pub fn log(level: u32, message: ModuleBuffer, source_file: ModuleBuffer, source_line: u32);
    #[link_name = "envoy_dynamic_module_callback_log_enabled"]
    pub fn log_enabled(level: u32) -> bool;
    #[link_name = "envoy_dynamic_module_callback_get_concurrency"]
    pub fn get_concurrency() -> u32;

    #[link_name = "envoy_dynamic_module_callback_http_get_header"]
    pub fn get_header(
        filter: FilterEnvoy,
        header_type: u32,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
        index: usize,
        optional_size: *mut usize,
    ) -> bool;
    #[link_name = "envoy_dynamic_module_callback_http_add_header"]
    pub fn add_header(
        filter: FilterEnvoy,
        header_type: u32,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
    #[link_name = "envoy_dynamic_module_callback_http_send_response"]
    pub fn send_response(
        filter: FilterEnvoy,
        status_code: u32,
        headers: *mut ModuleHeader,
        headers_size: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    );
    #[link_name = "envoy_dynamic_module_callback_http_filter_continue_decoding"]
    pub fn continue_decoding(filter: FilterEnvoy);
    #[link_name = "envoy_dynamic_module_callback_http_filter_continue_encoding"]
    pub fn continue_encoding(filter: FilterEnvoy);

    #[link_name = "envoy_dynamic_module_callback_http_get_body_size"]
    pub fn get_body_size(filter: FilterEnvoy, body_type: u32) -> usize;
    #[link_name = "envoy_dynamic_module_callback_http_get_body_chunks_size"]
    pub fn get_body_chunks_size(filter: FilterEnvoy, body_type: u32) -> usize;
    #[link_name = "envoy_dynamic_module_callback_http_get_body_chunks"]
    pub fn get_body_chunks(filter: FilterEnvoy, body_type: u32, result: *mut EnvoyBuffer) -> bool;

    #[link_name = "envoy_dynamic_module_callback_http_get_metadata_string"]
    pub fn get_metadata_string(
        filter: FilterEnvoy,
        source: u32,
        namespace: ModuleBuffer,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
    ) -> bool;
    #[link_name = "envoy_dynamic_module_callback_http_get_metadata_number"]
    pub fn get_metadata_number(
        filter: FilterEnvoy,
        source: u32,
        namespace: ModuleBuffer,
        key: ModuleBuffer,
        result: *mut f64,
    ) -> bool;
    #[link_name = "envoy_dynamic_module_callback_http_filter_get_attribute_string"]
    pub fn get_attribute_string(filter: FilterEnvoy, id: u32, result: *mut EnvoyBuffer) -> bool;
    #[link_name = "envoy_dynamic_module_callback_http_filter_get_worker_index"]
    pub fn get_worker_index(filter: FilterEnvoy) -> u32;

    #[link_name = "envoy_dynamic_module_callback_http_filter_scheduler_new"]
    pub fn filter_scheduler_new(filter: FilterEnvoy) -> Scheduler;
    #[link_name = "envoy_dynamic_module_callback_http_filter_scheduler_commit"]
    pub fn filter_scheduler_commit(scheduler: Scheduler, event_id: u64);
    #[link_name = "envoy_dynamic_module_callback_http_filter_scheduler_delete"]
    pub fn filter_scheduler_delete(scheduler: Scheduler);
    #[link_name = "envoy_dynamic_module_callback_http_filter_config_scheduler_new"]
    pub fn config_scheduler_new(config: ConfigEnvoy) -> Scheduler;
    #[link_name = "envoy_dynamic_module_callback_http_filter_config_scheduler_commit"]
    pub fn config_scheduler_commit(scheduler: Scheduler, event_id: u64);
    #[link_name = "envoy_dynamic_module_callback_http_filter_config_scheduler_delete"]
    pub fn config_scheduler_delete(scheduler: Scheduler);

    #[link_name = "envoy_dynamic_module_callback_http_filter_http_callout"]
    pub fn filter_callout(
        filter: FilterEnvoy,
        callout_id: *mut u64,
        cluster: ModuleBuffer,
        headers: *mut ModuleHeader,
        headers_size: usize,
        body: ModuleBuffer,
        timeout_ms: u64,
    ) -> u32;
    #[link_name = "envoy_dynamic_module_callback_http_filter_config_http_callout"]
    pub fn config_callout(
        config: ConfigEnvoy,
        callout_id: *mut u64,
        cluster: ModuleBuffer,
        headers: *mut ModuleHeader,
        headers_size: usize,
        body: ModuleBuffer,
        timeout_ms: u64,
    ) -> u32;

    #[link_name = "envoy_dynamic_module_callback_http_filter_config_define_counter"]
    pub fn define_counter(
        config: ConfigEnvoy,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        id: *mut usize,
    ) -> u32;
    #[link_name = "envoy_dynamic_module_callback_http_filter_config_define_gauge"]
    pub fn define_gauge(
        config: ConfigEnvoy,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        id: *mut usize,
    ) -> u32;
    #[link_name = "envoy_dynamic_module_callback_http_filter_config_increment_counter"]
    pub fn increment_counter(
        config: ConfigEnvoy,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    #[link_name = "envoy_dynamic_module_callback_http_filter_config_set_gauge"]
    pub fn set_gauge(
        config: ConfigEnvoy,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
}
