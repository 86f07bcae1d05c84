//! The dashboard and alerting rules in monitoring/ against live metrics: every metric a panel or
//! a rule queries exists, with every label it uses, in a live Envoy's and a live quota service's
//! scrape; promtool accepts the rules and the panels' queries.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Metric names and the labels any of their series carries.
pub type Scrape = BTreeMap<String, BTreeSet<String>>;

/// The series of a Prometheus text exposition, merged into `into`.
pub fn read_exposition(text: &str, into: &mut Scrape) {
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let labels = into.entry(line[..name_end].to_owned()).or_default();
        if line[name_end..].starts_with('{') {
            let inner = &line[name_end + 1..];
            let mut rest = inner;
            // name="value", … } — values may hold commas, braces and escaped quotes.
            while let Some(eq) = rest.find("=\"") {
                let name = rest[..eq].trim_start_matches([',', ' ']);
                if !name.is_empty() {
                    labels.insert(name.to_owned());
                }
                let mut value = rest[eq + 2..].char_indices();
                let mut end = None;
                while let Some((i, c)) = value.next() {
                    match c {
                        '\\' => {
                            value.next();
                        }
                        '"' => {
                            end = Some(eq + 2 + i + 1);
                            break;
                        }
                        _ => {}
                    }
                }
                match end {
                    Some(e) => rest = &rest[e..],
                    None => break,
                }
            }
        }
    }
}

/// What a PromQL expression reads: each metric selector's name with the labels its matchers
/// name, and the labels its `by`/`without`/`on`/`ignoring` clauses name.
#[derive(Debug, Default, PartialEq)]
pub struct Query {
    pub selectors: Vec<(String, BTreeSet<String>)>,
    pub grouping: BTreeSet<String>,
}

/// Words that are not metrics: operators, and aggregations (which may come before `by (…)`).
const KEYWORDS: &[&str] = &[
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
];

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_ident(c: char) -> bool {
    is_ident_start(c) || c.is_ascii_digit()
}

/// The index after the string literal that opens at `chars[open]` (its quote).
fn after_string(chars: &[char], open: usize) -> usize {
    let mut i = open + 1;
    while i < chars.len() && chars[i] != chars[open] {
        if chars[i] == '\\' {
            i += 1;
        }
        i += 1;
    }
    i + 1
}

/// The label names of a `{…}` matcher list or a `(…)` label list starting at `chars[open]`;
/// and the index after its closing bracket.
fn label_list(chars: &[char], open: usize, close: char) -> (BTreeSet<String>, usize) {
    let mut labels = BTreeSet::new();
    let mut i = open + 1;
    let mut expect_name = true;
    while i < chars.len() && chars[i] != close {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i = after_string(chars, i);
            continue;
        }
        if expect_name && is_ident_start(c) {
            let start = i;
            while i < chars.len() && is_ident(chars[i]) {
                i += 1;
            }
            labels.insert(chars[start..i].iter().collect());
            expect_name = false;
            continue;
        }
        if c == ',' {
            expect_name = true;
        }
        i += 1;
    }
    (labels, i + 1)
}

/// Reads a PromQL expression (Grafana's `$variables` may stand in strings and ranges).
pub fn read_query(expr: &str) -> Query {
    let chars: Vec<char> = expr.chars().collect();
    let mut q = Query::default();
    let mut i = 0;
    let next_non_space = |mut j: usize| {
        while j < chars.len() && chars[j].is_whitespace() {
            j += 1;
        }
        j
    };
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i = after_string(&chars, i);
        } else if c == '[' {
            while i < chars.len() && chars[i] != ']' {
                i += 1;
            }
            i += 1;
        } else if c == '{' {
            // A selector without a name: `{__name__=…}` — none of ours.
            let (_, end) = label_list(&chars, i, '}');
            i = end;
        } else if c.is_ascii_digit() || c == '.' {
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
        } else if is_ident_start(c) {
            let start = i;
            while i < chars.len() && is_ident(chars[i]) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let after = next_non_space(i);
            let opens = chars.get(after).copied();
            if matches!(
                word.as_str(),
                "by" | "without" | "on" | "ignoring" | "group_left" | "group_right"
            ) {
                if opens == Some('(') {
                    let (labels, end) = label_list(&chars, after, ')');
                    q.grouping.extend(labels);
                    i = end;
                }
            } else if opens == Some('(') || KEYWORDS.contains(&word.as_str()) {
                // A function or an aggregation, or an operator word.
            } else if opens == Some('{') {
                let (labels, end) = label_list(&chars, after, '}');
                q.selectors.push((word, labels));
                i = end;
            } else {
                q.selectors.push((word, BTreeSet::new()));
            }
        } else {
            i += 1;
        }
    }
    q
}

/// Every PromQL expression of the dashboard (panels' targets; template queries as
/// `label_values(metric, label)` become `metric` grouped by `label`) and of the alerting rules,
/// each with where it comes from.
pub fn monitoring_queries(repo: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo.join("monitoring/grafana/tollgate-dashboard.json")).unwrap(),
    )
    .unwrap();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let title = panel["title"].as_str().unwrap_or_default();
            out.push((
                format!("panel {title:?}"),
                target["expr"].as_str().unwrap().to_owned(),
            ));
        }
    }
    for var in dashboard["templating"]["list"].as_array().unwrap() {
        if let Some(query) = var["query"]["query"].as_str() {
            let inner = query
                .strip_prefix("label_values(")
                .and_then(|q| q.strip_suffix(')'))
                .expect("template queries are label_values(metric, label)");
            let (metric, label) = inner.rsplit_once(',').unwrap();
            out.push((
                format!("variable {}", var["name"]),
                format!("sum by ({}) ({})", label.trim(), metric.trim()),
            ));
        }
    }
    let rules: serde_json::Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(repo.join("monitoring/prometheus/alerts.yml")).unwrap(),
    )
    .unwrap();
    for group in rules["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            out.push((
                format!("alert {}", rule["alert"]),
                rule["expr"].as_str().unwrap().to_owned(),
            ));
        }
    }
    out
}

/// Labels every scraped series has in Prometheus without the target exposing them.
const TARGET_LABELS: &[&str] = &["job", "instance"];

/// What in `queries` the scrape lacks: a metric no target serves, or a label none of its series
/// carries (`up`, Prometheus's own, is taken as served with its target labels).
pub fn missing(scrape: &Scrape, queries: &[(String, String)]) -> Vec<String> {
    let mut missing = Vec::new();
    for (source, expr) in queries {
        let q = read_query(expr);
        assert!(
            !q.selectors.is_empty(),
            "{source}: no metric read in {expr}"
        );
        let mut labels_of_expr: BTreeSet<&str> = TARGET_LABELS.iter().copied().collect();
        for (name, labels) in &q.selectors {
            if name == "up" {
                continue;
            }
            let Some(served) = scrape.get(name) else {
                missing.push(format!("{source}: metric {name} is not served"));
                continue;
            };
            labels_of_expr.extend(served.iter().map(String::as_str));
            for label in labels {
                if !served.contains(label) && !TARGET_LABELS.contains(&label.as_str()) {
                    missing.push(format!("{source}: {name} has no label {label}"));
                }
            }
        }
        for label in &q.grouping {
            if !labels_of_expr.contains(label.as_str()) {
                missing.push(format!("{source}: no metric of it has the label {label}"));
            }
        }
    }
    missing
}

/// The promtool `make test` installs (scripts/setup.sh), or $PROMTOOL_BIN.
pub fn promtool(repo: &Path) -> PathBuf {
    let path = std::env::var_os("PROMTOOL_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo.join(".venv/bin/promtool"));
    assert!(
        path.exists(),
        "{} missing: run scripts/setup.sh (make test does)",
        path.display()
    );
    path
}

/// `promtool check rules` on the alerting rules, and on the dashboard's queries written as
/// recording rules (Grafana's variables given values), so that a query Prometheus would reject
/// fails here.
pub fn promtool_accepts(repo: &Path, queries: &[(String, String)]) {
    let tool = promtool(repo);
    let out = Command::new(&tool)
        .args(["check", "rules"])
        .arg(repo.join("monitoring/prometheus/alerts.yml"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "promtool check rules alerts.yml:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let rules: Vec<serde_json::Value> = queries
        .iter()
        .filter(|(source, _)| !source.starts_with("alert "))
        .enumerate()
        .map(|(i, (_, expr))| {
            let expr = expr
                .replace("$__rate_interval", "1m")
                .replace("$rule", ".*");
            serde_json::json!({"record": format!("dashboard:query{i}"), "expr": expr})
        })
        .collect();
    let file = std::env::temp_dir().join(format!("tollgate-dashboard-{}.yml", std::process::id()));
    let doc = serde_json::json!({"groups": [{"name": "dashboard", "rules": rules}]});
    std::fs::write(&file, serde_json::to_string(&doc).unwrap()).unwrap();
    let out = Command::new(&tool)
        .args(["check", "rules"])
        .arg(&file)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&file);
    assert!(
        out.status.success(),
        "promtool rejects a dashboard query:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn queries_are_read_for_their_metrics_and_labels() {
    let q = read_query(
        r#"sum by (tollgate_rule) (rate(tollgate_rule_limited{tollgate_rule=~"$rule", x!="a,b}"}[$__rate_interval])) / on(instance) group_left sum(up{job="q"}) > 0.1 and bool histogram_quantile(0.99, sum by (le) (rate(m_bucket[5m])))"#,
    );
    let set = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(
        q.selectors,
        vec![
            ("tollgate_rule_limited".into(), set(&["tollgate_rule", "x"])),
            ("up".into(), set(&["job"])),
            ("m_bucket".into(), set(&[])),
        ]
    );
    assert_eq!(q.grouping, set(&["tollgate_rule", "instance", "le"]));
    let mut scrape = Scrape::new();
    read_exposition(
        "# TYPE a counter\na_total{outcome=\"o,k\",rule=\"x\\\"}\"} 1\nb 2\nc{} 3\n",
        &mut scrape,
    );
    assert_eq!(scrape["a_total"], set(&["outcome", "rule"]));
    assert!(scrape["b"].is_empty() && scrape["c"].is_empty());
    let queries = [
        (
            "p".to_owned(),
            "sum by (rule) (rate(a_total[1m]))".to_owned(),
        ),
        (
            "q".to_owned(),
            "sum by (pod) (b{mode=\"x\"}) + nope".to_owned(),
        ),
    ];
    assert_eq!(
        missing(&scrape, &queries),
        [
            "q: b has no label mode",
            "q: metric nope is not served",
            "q: no metric of it has the label pod"
        ]
    );
}

#[test]
fn the_alerting_rules_and_the_dashboards_queries_pass_promtool() {
    let repo = testkit::repo();
    promtool_accepts(&repo, &monitoring_queries(&repo));
}
