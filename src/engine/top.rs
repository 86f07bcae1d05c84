//! The keys each rule sees most (the status path's): per worker a space-saving count in fixed
//! arrays — nothing on the request path allocates or calls the host — added on the tick into the
//! process's counts in shared data, which halve every window so that they follow the traffic.

use tollgate_core::store::{update, CasStore, UpdateError};

/// Keys a worker counts per rule between two merges.
pub const WORKER_KEYS: usize = 16;
/// Keys the process keeps per rule (in shared data).
pub const PROCESS_KEYS: usize = 32;
/// The most bytes of a key's display form kept.
pub const DISPLAY_BYTES: usize = crate::config::MOST_STATUS_KEY_BYTES;
/// The process's counts halve this often (ms).
pub const WINDOW_MS: u64 = 60_000;
/// A worker adds its counts to the process's this often (ms).
pub const MERGE_MS: u64 = 1_000;

/// One key's counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopKey {
    /// The key's placement hash: its identity (keyed by the deployment's secret).
    pub place: u128,
    pub requests: u64,
    pub refused: u64,
    /// At most this much of `requests` may be other keys' (it took their place in the count).
    pub overcount: u64,
    /// Its display form is known (a worker that counts a refusal of a key it no longer holds —
    /// a request decided after the merge that took its count — knows only its place).
    named: bool,
    len: u8,
    display: [u8; DISPLAY_BYTES],
}

impl TopKey {
    fn new(place: u128) -> Self {
        Self {
            place,
            requests: 0,
            refused: 0,
            overcount: 0,
            named: true,
            len: 0,
            display: [0; DISPLAY_BYTES],
        }
    }

    /// The key as shown: its parts' values, `, ` between, bytes that are not printable ASCII
    /// as `\xNN`, cut at the configured length.
    pub fn display(&self) -> &[u8] {
        &self.display[..usize::from(self.len)]
    }

    fn set_display(&mut self, key: &[u8], max: usize) {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let max = max.min(DISPLAY_BYTES);
        // Several parts: a `,` inside a value is escaped too, so that only the separator is one
        // (("x, y", "z") and ("x", "y, z") are two keys, shown as two).
        let several = crate::key::parts(key).nth(1).is_some();
        let mut n = 0;
        // Each piece whole or not at all: an escape is never cut in two.
        let mut put = |piece: &[u8], n: &mut usize| {
            if *n + piece.len() <= max {
                self.display[*n..*n + piece.len()].copy_from_slice(piece);
                *n += piece.len();
            }
        };
        for (i, part) in crate::key::parts(key).enumerate() {
            if i > 0 {
                put(b", ", &mut n);
            }
            let Some(value) = part else {
                put(b"(none)", &mut n);
                continue;
            };
            for &b in value {
                let plain = (0x20..0x7f).contains(&b) && b != b'\\' && !(several && b == b',');
                if plain {
                    put(&[b], &mut n);
                } else {
                    put(
                        &[
                            b'\\',
                            b'x',
                            HEX[usize::from(b >> 4)],
                            HEX[usize::from(b & 15)],
                        ],
                        &mut n,
                    );
                }
            }
        }
        self.len = u8::try_from(n).unwrap_or(u8::MAX);
    }
}

/// How keys are ranked, the first first: by requests refused, then by requests surely theirs
/// (a key that took another's place in the count may carry that one's requests).
fn rank(k: &TopKey) -> (u64, u64) {
    (k.refused, k.requests - k.overcount.min(k.requests))
}

/// A worker's counts for one rule.
#[derive(Debug, Clone, Default)]
struct WorkerTop {
    keys: Vec<TopKey>,
}

impl WorkerTop {
    /// A request of the key at `place` (`key`: its bytes, read only if it takes a place).
    fn seen(&mut self, place: u128, key: &[u8], max_display: usize) {
        if let Some(k) = self.keys.iter_mut().find(|k| k.place == place) {
            k.requests += 1;
            if !k.named {
                k.named = true;
                k.set_display(key, max_display);
            }
            return;
        }
        let Some(k) = self.take_place(place) else {
            return;
        };
        k.requests += 1;
        k.set_display(key, max_display);
    }

    /// A refusal of the key at `place`. A request decided after it was seen (one that waited)
    /// may find its key merged away meanwhile: counted again without its name, which the
    /// process's counts have.
    fn refused(&mut self, place: u128) {
        if let Some(k) = self.keys.iter_mut().find(|k| k.place == place) {
            k.refused += 1;
            return;
        }
        if let Some(k) = self.take_place(place) {
            k.named = false;
            k.refused += 1;
        }
    }

    /// A place for the key at `place`: a free one, else (space-saving) the least-seen key's, its
    /// count carried as overcount (keys refused go last: the status is about who is limited).
    fn take_place(&mut self, place: u128) -> Option<&mut TopKey> {
        if self.keys.len() < WORKER_KEYS {
            self.keys.push(TopKey::new(place));
            return self.keys.last_mut();
        }
        let at = (0..self.keys.len()).min_by_key(|&i| rank(&self.keys[i]))?;
        let carried = self.keys[at].requests;
        self.keys[at] = TopKey {
            requests: carried,
            overcount: carried,
            ..TopKey::new(place)
        };
        Some(&mut self.keys[at])
    }
}

/// What every worker counts, per rule (none for rules the status path does not show).
#[derive(Debug, Default)]
pub struct TopCounts {
    rules: Vec<WorkerTop>,
    max_display: usize,
    next_merge_ms: u64,
    /// When this worker looks at whether the log line is due next (ms).
    next_log_ms: u64,
    /// Where each rule's process counts live in shared data (none: a rule without a limit), and
    /// the key that claims the log line.
    shared: Vec<Option<String>>,
    log_key: Option<String>,
}

impl TopCounts {
    /// Counts for `rules` rules, keys shown up to `max_display` bytes. Allocates here only.
    pub fn new(rules: usize, max_display: usize) -> Self {
        Self {
            rules: (0..rules)
                .map(|_| WorkerTop {
                    keys: Vec::with_capacity(WORKER_KEYS),
                })
                .collect(),
            max_display,
            next_merge_ms: 0,
            next_log_ms: 0,
            shared: Vec::new(),
            log_key: None,
        }
    }

    /// Where each rule's process counts live (`shared[rule]`); the first also names the key
    /// that claims the log line.
    pub fn stored_at(mut self, shared: Vec<Option<String>>) -> Self {
        self.log_key = shared.iter().flatten().next().map(|k| format!("{k}.log"));
        self.shared = shared;
        self
    }

    pub fn seen(&mut self, rule: usize, place: u128, key: &[u8]) {
        let max = self.max_display;
        if let Some(top) = self.rules.get_mut(rule) {
            top.seen(place, key, max);
        }
    }

    pub fn refused(&mut self, rule: usize, place: u128) {
        if let Some(top) = self.rules.get_mut(rule) {
            top.refused(place);
        }
    }

    /// Whether a merge is due at `now_ms`.
    pub fn merge_due(&self, now_ms: u64) -> bool {
        !self.rules.is_empty() && now_ms >= self.next_merge_ms
    }

    /// Add this worker's counts of rule `rule` into the process's under `key`, and start anew;
    /// a merge that fails keeps them for the next.
    #[cfg(test)]
    pub fn merge<S: CasStore + ?Sized>(
        &mut self,
        store: &S,
        rule: usize,
        key: &str,
        now_ms: u64,
    ) -> Result<(), UpdateError> {
        self.next_merge_ms = now_ms + MERGE_MS;
        match self.rules.get_mut(rule) {
            Some(top) => top.merge(store, key, now_ms),
            None => Ok(()),
        }
    }

    /// Add every rule's counts into the process's where they are stored, when due.
    pub fn merge_due_counts<S: CasStore + ?Sized>(&mut self, store: &S, now_ms: u64) {
        if !self.merge_due(now_ms) {
            return;
        }
        self.next_merge_ms = now_ms + MERGE_MS;
        for (rule, (top, key)) in self.rules.iter_mut().zip(&self.shared).enumerate() {
            let Some(key) = key else {
                continue;
            };
            if let Err(e) = top.merge(store, key, now_ms) {
                log::debug!("status counts of rule {rule} not merged: {e:?}");
            }
        }
    }
}

impl WorkerTop {
    /// Add these counts into the process's under `key`, and start anew; a merge that fails keeps
    /// them for the next.
    fn merge<S: CasStore + ?Sized>(
        &mut self,
        store: &S,
        key: &str,
        now_ms: u64,
    ) -> Result<(), UpdateError> {
        if self.keys.is_empty() {
            return Ok(());
        }
        update(store, key, 4, |old| {
            let mut process = ProcessTop::decode(old.unwrap_or_default());
            process.add(&self.keys, now_ms);
            (Some(process.encode()), ())
        })?;
        self.keys.clear();
        Ok(())
    }
}

/// The process's counts for one rule, as kept in shared data.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProcessTop {
    /// When the counts last halved (ms).
    pub window_ms: u64,
    pub keys: Vec<TopKey>,
}

const HEAD: usize = 9;
const ENTRY: usize = 16 + 8 * 3 + 1;

impl ProcessTop {
    /// What shared data holds (nothing readable: none).
    pub fn decode(bytes: &[u8]) -> Self {
        let mut top = Self::default();
        let (Some(head), Some(&n)) = (bytes.get(..8), bytes.get(8)) else {
            return top;
        };
        top.window_ms = u64::from_le_bytes(head.try_into().unwrap_or_default());
        let mut at = HEAD;
        for _ in 0..usize::from(n).min(PROCESS_KEYS) {
            let Some(fixed) = bytes.get(at..at + ENTRY) else {
                break;
            };
            let u64_at =
                |i: usize| u64::from_le_bytes(fixed[i..i + 8].try_into().unwrap_or_default());
            let len = usize::from(fixed[ENTRY - 1]).min(DISPLAY_BYTES);
            let Some(display) = bytes.get(at + ENTRY..at + ENTRY + len) else {
                break;
            };
            let mut k = TopKey::new(u128::from_le_bytes(
                fixed[..16].try_into().unwrap_or_default(),
            ));
            (k.requests, k.refused, k.overcount) = (u64_at(16), u64_at(24), u64_at(32));
            k.len = u8::try_from(len).unwrap_or(0);
            k.display[..len].copy_from_slice(display);
            top.keys.push(k);
            at += ENTRY + len;
        }
        top
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEAD + self.keys.len() * (ENTRY + 32));
        out.extend_from_slice(&self.window_ms.to_le_bytes());
        out.push(u8::try_from(self.keys.len().min(PROCESS_KEYS)).unwrap_or(0));
        for k in self.keys.iter().take(PROCESS_KEYS) {
            out.extend_from_slice(&k.place.to_le_bytes());
            for n in [k.requests, k.refused, k.overcount] {
                out.extend_from_slice(&n.to_le_bytes());
            }
            out.push(k.len);
            out.extend_from_slice(k.display());
        }
        out
    }

    /// Add a worker's counts at `now_ms`: halved first for every window gone by; then the
    /// `PROCESS_KEYS` first by [`rank`] kept, in that order (a key that goes leaves its count as
    /// the others' possible overcount).
    pub fn add(&mut self, worker: &[TopKey], now_ms: u64) {
        if self.window_ms == 0 || now_ms < self.window_ms {
            self.window_ms = now_ms;
        }
        while now_ms.saturating_sub(self.window_ms) >= WINDOW_MS {
            for k in &mut self.keys {
                k.requests /= 2;
                k.refused /= 2;
                k.overcount /= 2;
            }
            self.keys.retain(|k| k.requests > 0);
            self.window_ms += WINDOW_MS;
            if self.keys.is_empty() {
                self.window_ms = now_ms;
            }
        }
        for w in worker {
            match self.keys.iter_mut().find(|k| k.place == w.place) {
                Some(k) => {
                    k.requests = k.requests.saturating_add(w.requests);
                    k.refused = k.refused.saturating_add(w.refused);
                    k.overcount = k.overcount.saturating_add(w.overcount);
                }
                // A key known only by its place cannot be shown: left out.
                None if w.named => self.keys.push(*w),
                None => {}
            }
        }
        self.keys
            .sort_unstable_by(|a, b| rank(b).cmp(&rank(a)).then(a.place.cmp(&b.place)));
        if self.keys.len() > PROCESS_KEYS {
            self.keys.truncate(PROCESS_KEYS);
        }
    }
}

impl super::Engine {
    /// Add this worker's counts into the process's, when due (on the tick).
    pub fn merge_top<S: CasStore + ?Sized>(&mut self, store: &S, now_ns: u64) {
        self.top.merge_due_counts(store, now_ns / 1_000_000);
    }

    /// Each rule's process counts, most seen first (rules without a limit: none).
    pub fn top_keys<S: CasStore + ?Sized>(&self, store: &S) -> Vec<(usize, ProcessTop)> {
        self.top
            .shared
            .iter()
            .enumerate()
            .filter_map(|(rule, key)| {
                let bytes = store.read(key.as_deref()?).ok().flatten().map(|(b, _)| b);
                Some((
                    rule,
                    ProcessTop::decode(bytes.as_deref().unwrap_or_default()),
                ))
            })
            .collect()
    }

    /// A key as the status shows it: its display form, or (`keys: hashed`) its placement hash.
    pub fn shown_key(&self, key: &TopKey) -> String {
        match self.config.status.as_ref().is_some_and(|s| s.hashed) {
            true => format!("{:032x}", key.place),
            false => String::from_utf8_lossy(key.display()).into_owned(),
        }
    }

    /// The status as JSON: per rule with a limit, its keys seen most (and how often refused).
    pub fn status_json<S: CasStore + ?Sized>(&self, store: &S, host: &str, now_ms: u64) -> String {
        use std::fmt::Write;
        // (Written out rather than with serde_json's values: they would grow the module by
        // some 60 KB.)
        let mut out = String::with_capacity(4096);
        out.push_str("{\"host\":");
        json_string(&mut out, host);
        let _ = write!(
            out,
            ",\"now_ms\":{now_ms},\"window_ms\":{WINDOW_MS},\"rules\":["
        );
        for (n, (rule, top)) in self.top_keys(store).into_iter().enumerate() {
            if n > 0 {
                out.push(',');
            }
            out.push_str("{\"rule\":");
            json_string(&mut out, &self.config.rules[rule].name);
            out.push_str(",\"keys\":[");
            for (i, k) in top.keys.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str("{\"key\":");
                json_string(&mut out, &self.shown_key(k));
                let _ = write!(
                    out,
                    ",\"requests\":{},\"refused\":{},\"overcount\":{}}}",
                    k.requests, k.refused, k.overcount
                );
            }
            out.push_str("]}");
        }
        out.push_str("]}");
        out
    }

    /// The log line of the keys each rule refused most (`None` if none refused any).
    pub fn top_log_line<S: CasStore + ?Sized>(&self, store: &S) -> Option<String> {
        let mut parts = Vec::new();
        for (rule, top) in self.top_keys(store) {
            // (Kept most refused first.)
            let refused: Vec<&TopKey> = top.keys.iter().filter(|k| k.refused > 0).collect();
            if refused.is_empty() {
                continue;
            }
            let shown: Vec<String> = refused
                .iter()
                .take(5)
                .map(|k| format!("{:?} ({} refused)", self.shown_key(k), k.refused))
                .collect();
            parts.push(format!(
                "{}: {}",
                self.config.rules[rule].name,
                shown.join(", ")
            ));
        }
        (!parts.is_empty()).then(|| format!("keys refused most: {}", parts.join("; ")))
    }
}

impl super::Engine {
    /// The log line of the keys refused most, if this worker's tick is the one (of the
    /// process's) to log it now: once per `status.log_every`, claimed in shared data.
    pub fn top_log_due<S: CasStore + ?Sized>(&mut self, store: &S, now_ns: u64) -> Option<String> {
        let every = self.config.status.as_ref()?.log_every_ms;
        let now_ms = now_ns / 1_000_000;
        if every == 0 || now_ms < self.top.next_log_ms {
            return None;
        }
        // Look again a second later at the earliest (another worker may have logged).
        self.top.next_log_ms = now_ms + MERGE_MS;
        let key = self.top.log_key.as_deref()?;
        let claimed = update(store, key, 2, |old| {
            let due = old
                .and_then(|b| b.get(..8))
                .and_then(|b| b.try_into().ok())
                .map_or(0, u64::from_le_bytes);
            match now_ms >= due {
                true => (Some((now_ms + every).to_le_bytes()), true),
                false => (None, false),
            }
        });
        match claimed {
            Ok(true) => self.top_log_line(store),
            _ => None,
        }
    }
}

/// `s` as a JSON string.
pub fn json_string(out: &mut String, s: &str) {
    use std::fmt::Write;
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::{push_key_part, KeyBytes};
    use std::cell::RefCell;
    use std::collections::HashMap;
    use tollgate_core::store::StoreError;

    #[derive(Default)]
    struct Shared(RefCell<HashMap<String, (Vec<u8>, u32)>>);

    impl CasStore for Shared {
        fn read(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
            Ok(self.0.borrow().get(key).cloned())
        }
        fn write(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
            let mut map = self.0.borrow_mut();
            let next = match map.get(key) {
                Some((_, c)) if cas != 0 && *c != cas => return Err(StoreError::CasMismatch),
                Some((_, c)) => c + 1,
                None => 1,
            };
            map.insert(key.to_owned(), (value.to_vec(), next));
            Ok(())
        }
    }

    fn key(value: &[u8]) -> KeyBytes {
        let mut k = KeyBytes::new();
        push_key_part(&mut k, Some(value));
        k
    }

    #[test]
    fn three_flooding_addresses_among_ten_thousand_come_first_across_two_workers() {
        let shared = Shared::default();
        let mut workers = [TopCounts::new(1, 64), TopCounts::new(1, 64)];
        let mut now = 1_000;
        for i in 0..10_000u128 {
            let w = &mut workers[(i % 2) as usize];
            let normal = format!("10.1.{}.{}", i / 256, i % 256);
            w.seen(0, 1_000_000 + i, &key(normal.as_bytes()));
            if i % 10 == 0 {
                for (n, flood) in ["192.0.2.1", "192.0.2.2", "192.0.2.3"].iter().enumerate() {
                    for _ in 0..3 {
                        w.seen(0, n as u128, &key(flood.as_bytes()));
                        w.refused(0, n as u128);
                    }
                }
            }
            if i % 500 == 0 {
                now += 100;
                for w in &mut workers {
                    w.merge(&shared, 0, "top", now).unwrap();
                }
            }
        }
        for w in &mut workers {
            w.merge(&shared, 0, "top", now).unwrap();
        }
        let (bytes, _) = shared.read("top").unwrap().unwrap();
        let top = ProcessTop::decode(&bytes);
        assert!(top.keys.len() <= PROCESS_KEYS);
        let first: Vec<&[u8]> = top.keys[..3].iter().map(TopKey::display).collect();
        let mut sorted = first.clone();
        sorted.sort();
        assert_eq!(sorted, [&b"192.0.2.1"[..], b"192.0.2.2", b"192.0.2.3"]);
        assert!(top.keys[..3]
            .iter()
            .all(|k| k.refused == 3_000 && k.requests >= 3_000));
        assert_eq!(ProcessTop::decode(&top.encode()), top);
    }

    #[test]
    fn a_refusal_decided_after_the_merge_that_took_its_key_is_still_counted() {
        let shared = Shared::default();
        let mut w = TopCounts::new(1, 64);
        // A request seen, then waiting (for other workers' stashes, for a lease) over a merge.
        w.seen(0, 7, &key(b"192.0.2.1"));
        w.merge(&shared, 0, "top", 1_000).unwrap();
        w.refused(0, 7);
        // A key never seen by the process cannot be named: left out rather than shown blank.
        w.refused(0, 8);
        w.merge(&shared, 0, "top", 2_000).unwrap();
        let top = ProcessTop::decode(&shared.read("top").unwrap().unwrap().0);
        assert_eq!(top.keys.len(), 1);
        let k = &top.keys[0];
        assert_eq!(
            (k.display(), k.requests, k.refused),
            (&b"192.0.2.1"[..], 1, 1)
        );
        // Seen again before the next merge: named again, counted on.
        w.refused(0, 7);
        w.seen(0, 7, &key(b"192.0.2.1"));
        w.merge(&shared, 0, "top", 3_000).unwrap();
        let top = ProcessTop::decode(&shared.read("top").unwrap().unwrap().0);
        let k = &top.keys[0];
        assert_eq!(
            (k.display(), k.requests, k.refused),
            (&b"192.0.2.1"[..], 2, 2)
        );
    }

    #[test]
    fn a_million_keys_take_no_more_room_and_counts_halve_each_window() {
        let shared = Shared::default();
        let mut w = TopCounts::new(1, 64);
        for i in 0..1_000_000u128 {
            w.seen(0, i, &key(&i.to_le_bytes()));
            if i % 50_000 == 0 {
                w.merge(&shared, 0, "top", 1_000).unwrap();
            }
        }
        w.merge(&shared, 0, "top", 1_000).unwrap();
        let (bytes, _) = shared.read("top").unwrap().unwrap();
        assert!(bytes.len() <= HEAD + PROCESS_KEYS * (ENTRY + DISPLAY_BYTES));
        // Non-printable bytes are escaped; a heavy key halves each window, then goes.
        let mut h = TopCounts::new(1, 64);
        for _ in 0..64 {
            h.seen(0, 7, &key(b"a\x00\xff\\"));
        }
        h.merge(&shared, 0, "heavy", 1_000).unwrap();
        let read = |k: &str| ProcessTop::decode(&shared.read(k).unwrap().unwrap().0);
        assert_eq!(read("heavy").keys[0].display(), b"a\\x00\\xff\\x5c");
        h.seen(0, 8, &key(b"b"));
        h.merge(&shared, 0, "heavy", 1_000 + 2 * WINDOW_MS).unwrap();
        let top = read("heavy");
        assert_eq!(top.keys[0].requests, 16, "{top:?}");
        h.seen(0, 8, &key(b"b"));
        h.merge(&shared, 0, "heavy", 1_000 + 9 * WINDOW_MS).unwrap();
        assert!(read("heavy").keys.iter().all(|k| k.place == 8));
    }

    #[test]
    fn display_is_cut_and_parts_are_joined() {
        let mut k = KeyBytes::new();
        push_key_part(&mut k, Some(b"tenant"));
        push_key_part(&mut k, None);
        let mut t = TopKey::new(1);
        t.set_display(&k, 64);
        assert_eq!(t.display(), b"tenant, (none)");
        t.set_display(&k, 3);
        assert_eq!(t.display(), b"ten");
        // An escape is never cut; with several parts a comma in a value is escaped.
        let one = |v: &[u8]| {
            let mut k = KeyBytes::new();
            push_key_part(&mut k, Some(v));
            k
        };
        t.set_display(&one(b"abcd\xff"), 5);
        assert_eq!(t.display(), b"abcd");
        t.set_display(&one(b"a, b"), 64);
        assert_eq!(t.display(), b"a, b");
        let mut two = KeyBytes::new();
        push_key_part(&mut two, Some(b"x, y"));
        push_key_part(&mut two, Some(b"z"));
        t.set_display(&two, 64);
        assert_eq!(t.display(), b"x\\x2c y, z");
        // Anything decodes to something bounded.
        assert!(ProcessTop::decode(&[0xff; 300]).keys.len() <= PROCESS_KEYS);
    }

    #[test]
    fn strings_are_escaped() {
        let mut out = String::new();
        json_string(&mut out, "a\"b\\c\u{1}é");
        assert_eq!(out, r#""a\"b\\c\u0001é""#);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v, "a\"b\\c\u{1}é");
    }
}
