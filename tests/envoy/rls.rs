//! Envoy 1.40's own global rate limit filter (`envoy.filters.http.ratelimit`) against the quota
//! service's RLS: the configuration of docs/quota-api.md as written, two Envoys sharing one
//! limit, a restart of the service over Redis, and one bucket shared by a tollgate Envoy and a
//! native one.

use crate::harness::{free_port, Client, Envoy, Options, Quota};
use serde_json::{json, Value};
use testkit::{Redis, Upstream};

/// The two fenced blocks of docs/quota-api.md's RLS section: the limits and the Envoy.
fn documented() -> (String, String) {
    documented_in("## Envoy's rate limit service (RLS)")
}

/// The first two YAML blocks of a section of docs/quota-api.md (RLS's or RLQS's).
pub(crate) fn documented_in(heading: &str) -> (String, String) {
    let doc =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/quota-api.md")).unwrap();
    let section = doc.split(heading).nth(1).unwrap();
    let mut blocks = section
        .split("```yaml")
        .skip(1)
        .map(|b| b.split("```").next().unwrap().to_owned());
    (blocks.next().unwrap(), blocks.next().unwrap())
}

fn scratch_file(name: &str, text: &str) -> String {
    let dir = testkit::scratch_dir("rls");
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

/// The documented Envoy, with its ports made this test's.
pub(crate) fn envoy_from_docs(yaml: &str, app: u16, grpc: u16, edit: impl Fn(&mut Value)) -> Envoy {
    let yaml = yaml
        .replace("port_value: 10000", "port_value: 0")
        .replace("port_value: 8000", &format!("port_value: {app}"))
        .replace("port_value: 8081", &format!("port_value: {grpc}"));
    let mut bootstrap: Value = serde_yaml_ng::from_str(&yaml).unwrap();
    edit(&mut bootstrap);
    Envoy::start_bootstrap(bootstrap)
}

fn rls_service(args: &[&str], grpc: u16, config: &str) -> Quota {
    let listen = format!("127.0.0.1:{grpc}");
    let mut all = vec!["--grpc-listen", &listen, "--rls-config", config];
    all.extend_from_slice(args);
    Quota::start(&all)
}

fn marketing(client: &Client, envoy: &Envoy, number: &str) -> u16 {
    client
        .get(
            &envoy.url("/send"),
            &[("x-message-type", "marketing"), ("x-to-number", number)],
        )
        .status
}

#[test]
fn the_documented_rls_configuration_works_as_written() {
    let (limits, envoy_yaml) = documented();
    let app = Upstream::start(&[]);
    let grpc = free_port();
    let quota = rls_service(&[], grpc, &scratch_file("ratelimit.yaml", &limits));
    let envoy = envoy_from_docs(&envoy_yaml, app.port, grpc, |_| {});
    let client = Client::new();
    let statuses: Vec<u16> = (0..6)
        .map(|_| marketing(&client, &envoy, "2061111111"))
        .collect();
    assert_eq!(statuses, [200, 200, 200, 200, 200, 429]);
    // Another number has its own 5; the first number's other messages only the 100 a day.
    assert_eq!(marketing(&client, &envoy, "2062222222"), 200);
    let plain = client.get(&envoy.url("/send"), &[("x-to-number", "2061111111")]);
    assert_eq!(plain.status, 200);
    assert_eq!(plain.header("x-ratelimit-limit"), Some("100, 100;w=86400"));
    assert_eq!(plain.header("x-ratelimit-remaining"), Some("93"));
    let refused = client.get(
        &envoy.url("/send"),
        &[
            ("x-message-type", "marketing"),
            ("x-to-number", "2061111111"),
        ],
    );
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("x-ratelimit-remaining"), Some("0"));
    // The next marketing message fits in 86 400 / 5 s.
    let reset: u64 = refused
        .header("x-ratelimit-reset")
        .unwrap()
        .parse()
        .unwrap();
    assert!((17_270..=17_280).contains(&reset), "{reset}");
    let metrics = quota.metrics();
    assert!(
        metrics.contains(r#"tollgate_quota_rls_descriptors_total{domain="messaging",descriptor="messaging.message_type_marketing.to_number",code="over_limit"} 2"#),
        "{metrics}"
    );
}

#[test]
fn two_envoys_share_one_limit_exactly_and_a_restart_over_redis_forgets_nothing() {
    let (limits, envoy_yaml) = documented();
    let redis = Redis::start();
    let app = Upstream::start(&[]);
    let grpc = free_port();
    let config = scratch_file("ratelimit.yaml", &limits);
    let token = "rls-token-0123456789";
    let args = ["--redis", &redis.url(), "--token", token];
    let mut quota = rls_service(&args, grpc, &config);
    // The documented Envoy with the service's token as gRPC metadata.
    let with_token = |b: &mut Value| {
        let filter = &mut b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
            ["typed_config"]["http_filters"][0]["typed_config"];
        filter["rate_limit_service"]["grpc_service"]["initial_metadata"] =
            json!([{"key": "authorization", "value": format!("Bearer {token}")}]);
    };
    let envoys = [
        envoy_from_docs(&envoy_yaml, app.port, grpc, with_token),
        envoy_from_docs(&envoy_yaml, app.port, grpc, with_token),
    ];
    let client = Client::new();
    let send = |i: usize| marketing(&client, &envoys[i % 2], "2063333333");
    // Three of the five, through both Envoys.
    assert_eq!((0..3).map(send).collect::<Vec<_>>(), [200; 3]);
    // The service is down: Envoy's failure_mode_deny answers 500.
    quota.kill();
    assert_eq!(send(0), 500);
    // Back, over the same Redis: two more, then refused, on either Envoy.
    quota.restart();
    let after: Vec<u16> = (0..6).map(send).collect();
    assert_eq!(after, [200, 200, 429, 429, 429, 429]);
    // An Envoy without the token is refused by the service: its failure mode answers.
    let anonymous = envoy_from_docs(&envoy_yaml, app.port, grpc, |_| {});
    assert_eq!(marketing(&client, &anonymous, "2064444444"), 500);
    assert!(quota
        .metrics()
        .contains(r#"tollgate_quota_rls_calls_total{outcome="unauthorized"} 1"#));
}

#[test]
fn a_tollgate_envoy_and_a_native_envoy_share_one_bucket() {
    let app = Upstream::start(&[]);
    let grpc = free_port();
    let secret = "a-deployment-key-secret";
    let plugin = json!({
        "rules": [{"name": "per-tenant", "scope": "global", "key": ["header:x-tenant"],
                   "limit": {"requests": 20, "per": "1m"}}],
        "quota_service": {"upstream": "quota", "timeout": "200ms", "key_secret": secret,
                          "lease_size": 5}
    });
    let config = tollgate::config::Config::parse(plugin.to_string().as_bytes()).unwrap();
    let (bucket, _) = config
        .service_bucket("per-tenant", &[b"acme"], &|_, _| None)
        .unwrap();
    let limits = format!(
        "domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: {{ unit: minute, \
         requests_per_unit: 20 }}\n    tollgate_bucket: {bucket}\n"
    );
    let quota = rls_service(
        &["--key-secret", secret],
        grpc,
        &scratch_file("api.yaml", &limits),
    );
    let tollgate_envoy = Envoy::start_with(
        &plugin,
        &Options {
            quota_port: Some(quota.port),
            ..Options::default()
        },
    );
    // The documented native Envoy, limiting by tenant in domain `api`.
    let (_, envoy_yaml) = documented();
    let native = envoy_from_docs(&envoy_yaml, app.port, grpc, |b| {
        let hcm = &mut b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
            ["typed_config"];
        hcm["http_filters"][0]["typed_config"]["domain"] = json!("api");
        hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["rate_limits"] = json!([
            {"actions": [{"request_headers": {"header_name": "x-tenant", "descriptor_key": "tenant"}}]}
        ]);
    });
    let client = Client::new();
    let tenant = [("x-tenant", "acme")];
    let mut admitted = [0, 0];
    for i in 0..60 {
        let (n, url) = if i % 2 == 0 {
            (0, tollgate_envoy.url("/"))
        } else {
            (1, native.url("/"))
        };
        admitted[n] += usize::from(client.get(&url, &tenant).status == 200);
    }
    let total = admitted[0] + admitted[1];
    eprintln!(
        "tollgate Envoy admitted {}, native Envoy {}",
        admitted[0], admitted[1]
    );
    // One bucket of 20 (and the refill of the test's few seconds): tokens the tollgate Envoy
    // leased and holds unspent are nobody else's.
    assert!(total <= 21, "{admitted:?}");
    assert!(
        admitted[0] >= 5 && admitted[1] >= 5,
        "both took from it: {admitted:?}"
    );
    // Another tenant is untouched on both.
    let other = [("x-tenant", "globex")];
    assert_eq!(client.get(&tollgate_envoy.url("/"), &other).status, 200);
    assert_eq!(client.get(&native.url("/"), &other).status, 200);
}

#[test]
fn per_route_rate_limits_spend_their_hits_addend() {
    let app = Upstream::start(&[]);
    let grpc = free_port();
    let limits = "domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: { unit: minute, requests_per_unit: 20 }\n";
    let _quota = rls_service(&[], grpc, &scratch_file("api.yaml", limits));
    let (_, envoy_yaml) = documented();
    // The route's own rate_limits give way to the per-route configuration's, which cost 5 each.
    let envoy = envoy_from_docs(&envoy_yaml, app.port, grpc, |b| {
        let hcm = &mut b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
            ["typed_config"];
        let route = &mut hcm["route_config"]["virtual_hosts"][0]["routes"][0];
        route["route"]
            .as_object_mut()
            .unwrap()
            .remove("rate_limits");
        route["typed_per_filter_config"] = json!({
            "envoy.filters.http.ratelimit": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute",
                "domain": "api",
                "rate_limits": [{
                    "actions": [{"request_headers": {"header_name": "x-tenant", "descriptor_key": "tenant"}}],
                    "hits_addend": {"number": 5}
                }]
            }
        });
    });
    let client = Client::new();
    let statuses: Vec<u16> = (0..6)
        .map(|_| client.get(&envoy.url("/"), &[("x-tenant", "acme")]).status)
        .collect();
    assert_eq!(statuses, [200, 200, 200, 200, 429, 429], "20 = 4 × 5");
}

#[test]
fn a_descriptor_value_that_is_not_utf8_is_limited_like_any_other() {
    let (limits, envoy_yaml) = documented();
    let app = Upstream::start(&[]);
    let grpc = free_port();
    let quota = rls_service(&[], grpc, &scratch_file("ratelimit.yaml", &limits));
    // failure_mode_deny off (Envoy's default): a call the service cannot answer would let the
    // request through unlimited.
    let envoy = envoy_from_docs(&envoy_yaml, app.port, grpc, |b| {
        b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
            ["http_filters"][0]["typed_config"]["failure_mode_deny"] = json!(false);
    });
    let bad = testkit::raw(
        b"/send",
        &[b"x-message-type: marketing", b"x-to-number: 206\xff\xfe"],
    );
    let statuses: Vec<Option<u16>> = (0..7)
        .map(|_| testkit::raw_status(envoy.port, &bad))
        .collect();
    // Five pass the limit (the test's upstream then refuses the header itself: 503), two are
    // refused by it.
    assert_eq!(&statuses[5..], [Some(429), Some(429)], "{statuses:?}");
    assert!(
        statuses[..5].iter().all(|s| *s != Some(429)),
        "{statuses:?}"
    );
    let metrics = quota.metrics();
    assert!(
        metrics.contains(
            r#"descriptor="messaging.message_type_marketing.to_number",code="over_limit"} 2"#
        ),
        "{metrics}"
    );
}
