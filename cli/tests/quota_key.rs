//! `tollgate quota-key` as an operator runs it: a client's bucket name at the quota service.

// Test code: a failed expectation is meant to panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;

const GLOBAL: &str = r#"{"rules":[{"name":"per-tenant","scope":"global","key":["header:x-tenant"],
  "limit":{"requests":10,"per":"1h"}}],
  "quota_service":{"upstream":"quota","key_secret":"0123456789abcdef0123456789abcdef"}}"#;

fn quota_key(args: &[&str]) -> (bool, String, String) {
    quota_key_of(GLOBAL, args)
}

fn quota_key_of(config: &str, args: &[&str]) -> (bool, String, String) {
    let dir = std::env::temp_dir().join(format!("tollgate-quota-key-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = dir.join(format!("plugin-{n}.json"));
    std::fs::write(&path, config).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("quota-key")
        .arg(&path)
        .args(args)
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

#[test]
fn a_tenants_bucket_is_named_with_its_admin_paths() {
    let (ok, out, err) = quota_key(&["--rule", "per-tenant", "acme"]);
    assert!(ok, "{err}");
    let line = |name: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap_or_else(|| panic!("no {name} in {out}"))
            .to_owned()
    };
    let (limit_id, key) = (line("limit_id: "), line("key: "));
    assert!(limit_id.ends_with(".10.3600000.10"), "{limit_id}");
    assert_eq!(key.len(), 32, "{key}");
    assert!(
        out.contains(&format!("POST /admin/v1/buckets/{limit_id}/{key}/reset")),
        "{out}"
    );
    // Another tenant, another key; the same tenant, the same.
    assert_ne!(quota_key(&["--rule", "per-tenant", "other"]).1, out);
    assert_eq!(quota_key(&["--rule", "per-tenant", "acme"]).1, out);
}

#[test]
fn a_rule_that_is_not_there_or_values_that_do_not_fit_exit_1() {
    for (args, why) in [
        (&["--rule", "nope", "acme"][..], "no rule named \"nope\""),
        (
            &["--rule", "per-tenant", "a", "b"][..],
            "1 key part(s), 2 value(s)",
        ),
    ] {
        let (ok, _, err) = quota_key(args);
        assert!(!ok && err.contains(why), "{args:?}: {err}");
    }
}

/// docs/quota-api.md's example, as written: its `plugin.json` gives the output it shows.
#[test]
fn the_docs_example_prints_what_the_docs_show() {
    let docs =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/quota-api.md"))
            .unwrap();
    let after = docs.split_once("With this `plugin.json`:").unwrap().1;
    let (json, rest) = after
        .split_once("```json\n")
        .and_then(|(_, r)| r.split_once("\n```"))
        .unwrap();
    let shown = rest
        .split_once("```sh\n")
        .and_then(|(_, r)| r.split_once("\n```"))
        .unwrap()
        .0;
    let (command, output) = shown.split_once('\n').unwrap();
    assert!(
        command.ends_with("quota-key plugin.json --rule per-tenant acme"),
        "{command}"
    );
    let dir = std::env::temp_dir().join(format!("tollgate-quota-key-docs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("plugin.json"), json).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .current_dir(&dir)
        .args(["quota-key", "plugin.json", "--rule", "per-tenant", "acme"])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim_end(),
        output.trim_end()
    );
}

#[test]
fn a_calendar_quotas_bucket_is_its_periods_now_or_at_a_given_time() {
    let monthly = r#"{"rules":[{"name":"monthly","scope":"global","key":["header:x-tenant"],
      "limit":{"requests":10,"per":"month","calendar":{"time_zone":"Europe/Berlin"}}}],
      "quota_service":{"upstream":"quota","key_secret":"0123456789abcdef0123456789abcdef"}}"#;
    // December 2026 in Berlin: from 1 December 00:00 (+01:00) to 1 January 00:00.
    let (ok, out, err) = quota_key_of(
        monthly,
        &[
            "--rule",
            "monthly",
            "--at",
            "2026-12-01T00:05:00+01:00",
            "acme",
        ],
    );
    assert!(ok, "{err}");
    assert!(
        out.contains(".10.2678400000.10.1796079600000.1798758000000\n"),
        "{out}"
    );
    // A minute before: November's.
    let (_, before, _) = quota_key_of(
        monthly,
        &[
            "--rule",
            "monthly",
            "--at",
            "2026-11-30T23:59:00+01:00",
            "acme",
        ],
    );
    assert!(
        before.contains(".1793487600000.1796079600000\n"),
        "{before}"
    );
    // Now: the period this machine's clock is in (whichever it is, it is named by two bounds).
    let (ok, now, _) = quota_key_of(monthly, &["--rule", "monthly", "acme"]);
    assert!(ok);
    let limit_id = now.lines().next().unwrap();
    assert_eq!(limit_id.split('.').count(), 6, "{limit_id}");
    let (ok, _, err) = quota_key_of(monthly, &["--rule", "monthly", "--at", "soon", "acme"]);
    assert!(
        !ok && err.contains("--at \"soon\" is not an RFC 3339 time"),
        "{err}"
    );
}
