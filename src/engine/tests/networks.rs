//! Client addresses as networks: IPv6 prefixes and CIDR overrides.

use super::*;

fn from_peer(peer: &'static str) -> Req {
    Req {
        headers: Vec::new(),
        peer,
    }
}

#[test]
fn an_ipv6_client_is_limited_by_its_64_whatever_address_it_uses() {
    let mut rig = Rig::new(
        r#"{"rules":[{"name":"ip","key":["client_ip"],"limit":{"requests":3,"per":"1h"}}]}"#,
    );
    // Three addresses of one /64: one bucket of 3.
    let admitted = [
        "[2001:db8:1:2::1]:5",
        "[2001:db8:1:2::2]:5",
        "[2001:db8:1:2:ffff::9]:5",
    ]
    .iter()
    .map(|p| rig.admitted(&from_peer(p), NOW, 2))
    .sum::<usize>();
    assert_eq!(admitted, 3);
    // Another /64 has its own.
    assert_eq!(rig.admitted(&from_peer("[2001:db8:1:3::1]:5"), NOW, 5), 3);
    // With ipv6_prefix 128 every address is a key.
    let mut rig = Rig::new(
        r#"{"rules":[{"name":"ip","key":["client_ip"],"limit":{"requests":3,"per":"1h"}}],
            "client_ip":{"ipv6_prefix":128,"ipv4_prefix":24}}"#,
    );
    assert_eq!(rig.admitted(&from_peer("[2001:db8:1:2::1]:5"), NOW, 5), 3);
    assert_eq!(rig.admitted(&from_peer("[2001:db8:1:2::2]:5"), NOW, 5), 3);
    // IPv4 clients by their /24.
    assert_eq!(rig.admitted(&from_peer("10.1.2.3:5"), NOW, 2), 2);
    assert_eq!(rig.admitted(&from_peer("10.1.2.4:5"), NOW, 5), 1);
    for (field, bad) in [
        ("ipv6_prefix", "0"),
        ("ipv6_prefix", "129"),
        ("ipv4_prefix", "33"),
    ] {
        let json = format!(
            r#"{{"rules":[{{"name":"ip","key":["client_ip"],"limit":{{"requests":3,"per":"1h"}}}}],
                "client_ip":{{"{field}":{bad}}}}}"#
        );
        let e = Config::parse(json.as_bytes()).unwrap_err().to_string();
        assert!(e.contains(&format!("client_ip.{field}")), "{e}");
    }
}

#[test]
fn cidr_overrides_allow_block_and_limit_whole_ranges() {
    let mut rig = Rig::new(
        r#"{"rules":[{"name":"ip","key":["client_ip"],"limit":{"requests":1,"per":"1h"},
            "overrides":[{"values":["10.0.0.0/8"],"unlimited":true},
                         {"values":["192.0.2.0/24"],"block":true},
                         {"values":["2001:db8::/32"],"limit":{"requests":5,"per":"1h"}},
                         {"values":["198.51.100.7"],"limit":{"requests":2,"per":"1h"}}]}]}"#,
    );
    assert_eq!(rig.admitted(&from_peer("10.200.3.4:1"), NOW, 20), 20);
    assert_eq!(rig.admitted(&from_peer("11.0.0.1:1"), NOW, 20), 1);
    let trusted = rig.engine.config().client_ip;
    let blocked = rig.engine.gather(
        &Request::new(&from_peer("192.0.2.99:1"), trusted),
        &mut Inputs::new(),
    );
    assert!(blocked.is_some(), "inside the blocked range");
    // The range's own limit is per key inside it (each /64 its own 5), like any override.
    assert_eq!(rig.admitted(&from_peer("[2001:db8:7::1]:1"), NOW, 20), 5);
    assert_eq!(rig.admitted(&from_peer("[2001:db8:8::1]:1"), NOW, 20), 5);
    assert_eq!(rig.admitted(&from_peer("[2001:db9::1]:1"), NOW, 20), 1);
    assert_eq!(rig.admitted(&from_peer("198.51.100.7:1"), NOW, 20), 2);
    // A range narrower than the keys' networks could never match: refused at load.
    let e = Config::parse(
        br#"{"rules":[{"name":"ip","key":["client_ip"],"limit":{"requests":1,"per":"1h"},
            "overrides":[{"values":["2001:db8::/96"],"unlimited":true}]}]}"#,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("rules[0].overrides[0].values[0]") && e.contains("ipv6_prefix"),
        "{e}"
    );
    let e = Config::parse(
        br#"{"rules":[{"name":"ip","key":["client_ip"],"limit":{"requests":1,"per":"1h"},
            "overrides":[{"values":["10.0.0.0/33"],"unlimited":true}]}]}"#,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("CIDR"), "{e}");
}
