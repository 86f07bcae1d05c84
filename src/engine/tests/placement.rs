//! Where keys land: slot groups and the key hashes sent to the service, by the deployment's secret.

use super::*;

fn key_of_token(token: &str) -> (String, String) {
    let config = GLOBAL.replace(
        r#""upstream":"quota""#,
        &format!(r#""upstream":"quota","token":"{token}""#),
    );
    let mut rig = Rig::new(&config.replace("FAILURE", "deny").replace("FIRST", "wait"));
    let u = req(&[("x-user", b"victim")]);
    assert_eq!(rig.step(&u, NOW), Step::Wait);
    let (refills, call) = rig.lease_call(NOW).unwrap();
    (
        format!("{:032x}", refills[0].key),
        call.items[0].key.clone(),
    )
}

/// The groups of `keys` under a placement secret (`None`: the deployment's, as the rig has it).
fn groups_of(secret: Option<&str>, keys: &[String]) -> Vec<u32> {
    let json = r#"{"rules":[{"name":"r","key":["header:x-user"],"limit":{"requests":5,"per":"1m"},"max_keys":4096}]SECRET}"#;
    let json = json.replace(
        "SECRET",
        &secret.map_or(String::new(), |s| format!(r#","placement_secret":"{s}""#)),
    );
    let mut rig = Rig::new(&json);
    keys.iter()
        .map(|k| {
            let r = Req {
                headers: vec![("x-user", k.as_bytes().to_vec())],
                peer: "10.0.0.1:4000",
            };
            rig.inputs(&r)[0].slot.group
        })
        .collect()
}

#[test]
fn which_keys_share_a_slot_group_depends_on_the_deployments_secret() {
    // Keys an attacker found to share a group under one secret (as they could under the public
    // seed before): under another secret they are spread like any keys.
    let keys: Vec<String> = (0..20_000).map(|i| format!("user-{i}")).collect();
    let under_a = groups_of(Some("deployment-a-placement"), &keys);
    let target = under_a[0];
    let colliding: Vec<String> = keys
        .iter()
        .zip(&under_a)
        .filter(|(_, g)| **g == target)
        .map(|(k, _)| k.clone())
        .collect();
    assert!(
        colliding.len() >= 5,
        "{} keys share group {target}",
        colliding.len()
    );
    assert_eq!(
        groups_of(Some("deployment-a-placement"), &colliding),
        vec![target; colliding.len()]
    );
    for other in [Some("deployment-b-placement"), None] {
        let spread = groups_of(other, &colliding);
        let together = spread.iter().filter(|g| **g == spread[0]).count();
        assert!(
            together <= 2,
            "{together} of {} still together",
            colliding.len()
        );
    }
    let e = Config::parse(br#"{"rules":[{"name":"r","key":["header:x-user"],"limit":{"requests":5,"per":"1m"}}],"placement_secret":"short"}"#).unwrap_err();
    assert!(e.to_string().contains("placement_secret"), "{e}");
}

#[test]
fn key_hashes_sent_to_the_service_are_keyed_by_the_deployments_secret() {
    let key_of = |secret: Option<&str>| {
        let config = match secret {
            Some(s) => GLOBAL.replace(
                r#""upstream":"quota""#,
                &format!(r#""upstream":"quota","key_secret":"{s}""#),
            ),
            None => GLOBAL.to_string(),
        };
        let mut rig = Rig::new(&config.replace("FAILURE", "deny").replace("FIRST", "wait"));
        let u = req(&[("x-user", b"victim")]);
        assert_eq!(rig.step(&u, NOW), Step::Wait);
        let (refills, call) = rig.lease_call(NOW).unwrap();
        (
            format!("{:032x}", refills[0].key),
            call.items[0].key.clone(),
        )
    };
    let (plain, sent) = key_of(None);
    assert_eq!(plain, sent, "no secret and no token: the plain key hash");
    let (_, by_token) = key_of_token("token-of-deployment-a");
    assert_eq!(by_token, key_of_token("token-of-deployment-a").1);
    assert!(
        by_token != plain,
        "a token keys the names when there is no key_secret"
    );
    assert!(by_token != key_of_token("token-of-deployment-b").1);
    let (_, a) = key_of(Some("deployment-a-secret-0123"));
    let (_, a_again) = key_of(Some("deployment-a-secret-0123"));
    let (_, b) = key_of(Some("deployment-b-secret-0123"));
    assert_eq!(a, a_again, "every proxy of a deployment agrees");
    assert!(a != plain && a != b, "{a} {b} {plain}");
    let short = GLOBAL
        .replace(
            r#""upstream":"quota""#,
            r#""upstream":"quota","key_secret":"short""#,
        )
        .replace("FAILURE", "deny")
        .replace("FIRST", "wait");
    let e = crate::config::Config::parse(short.as_bytes()).unwrap_err();
    assert!(e.to_string().contains("quota_service.key_secret"), "{e}");
}

#[test]
fn an_operator_names_a_clients_bucket_at_the_service_as_the_filter_does() {
    let json = r#"{"rules":[{"name":"g","scope":"global","key":["client_ip","header:x-tenant"],
        "limit":{"requests":100,"per":"1m"},"burst":40,"worker_batch":0}],
      "client_ip":{"ipv4_prefix":24},
      "quota_service":{"upstream":"quota","failure_mode":"deny","first_lease":"wait",
        "key_secret":"0123456789abcdef0123456789abcdef"}}"#;
    let mut rig = Rig::new(json);
    let r = Req {
        headers: vec![("x-tenant", b"Acme \xff".to_vec())],
        peer: "10.1.2.3:4000",
    };
    assert_eq!(rig.step(&r, NOW), Step::Wait);
    let (_, call) = rig.lease_call(NOW).unwrap();
    let sent = &call.items[0];
    let config = crate::config::Config::parse(json.as_bytes()).unwrap();
    // Another address of the same /24: the same bucket.
    let named = config
        .service_bucket("g", &[b"10.1.2.200", b"Acme \xff"], &|_, _| None)
        .unwrap();
    assert_eq!(named.0, format!("{}.100.60000.40", sent.limit_id));
    assert_eq!(named.1, sent.key);
    assert_ne!(
        config
            .service_bucket("g", &[b"10.1.3.1", b"Acme \xff"], &|_, _| None)
            .unwrap()
            .1,
        sent.key
    );
    for (rule, values, why) in [
        ("h", &[&b"1.2.3.4"[..], b"x"][..], "no rule named"),
        ("g", &[&b"1.2.3.4"[..]][..], "2 key part(s), 1 value(s)"),
        ("g", &[&b"not-an-ip"[..], b"x"][..], "not an IP address"),
    ] {
        let e = config
            .service_bucket(rule, values, &|_, _| None)
            .unwrap_err();
        assert!(e.contains(why), "{e}");
    }
}
