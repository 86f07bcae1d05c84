//! What an LLM API's response says it used: the token usage in a JSON body or in a stream of
//! server-sent events (OpenAI chat and responses, Anthropic, Gemini), or a number at a chosen
//! field, read chunk by chunk as the body passes, within a bound on the bytes kept, never
//! delaying it.

use serde::{Deserialize, Deserializer};

/// Tokens a response reported, as far as it has been read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub input: Option<u64>,
    pub output: Option<u64>,
    pub total: Option<u64>,
    /// The provider's final count came: a JSON body's usage, or a stream's last usage event
    /// (OpenAI's usage chunk or `response.completed`, Anthropic's `message_delta`, Gemini's chunk
    /// with a `finishReason`). Before it, the counts are a stream's start (Anthropic's
    /// `message_start` says one output token) or running totals.
    pub complete: bool,
}

impl Usage {
    /// True once any count was read.
    pub fn is_known(&self) -> bool {
        self.input.is_some() || self.output.is_some() || self.total.is_some()
    }

    /// The total: as reported, else input and output added.
    pub fn total(&self) -> Option<u64> {
        self.total.or(match (self.input, self.output) {
            (None, None) => None,
            (i, o) => Some(i.unwrap_or(0).saturating_add(o.unwrap_or(0))),
        })
    }

    /// Take what `doc` (one JSON document: a whole body if not `in_stream`, else one event's
    /// data) reports. Counts only grow: a stream reports running totals (Anthropic's
    /// `message_delta`), or the same again.
    fn read(&mut self, doc: &Document, in_stream: bool) {
        let nested =
            [&doc.response, &doc.message].map(|n| n.as_ref().and_then(|n| n.usage.as_ref()));
        let finished = doc
            .candidates
            .iter()
            .flatten()
            .any(|c| c.finish_reason.is_some());
        // A top-level usage beside content still coming is a running count.
        let content_goes_on = doc
            .choices
            .as_ref()
            .is_some_and(|c| !c.is_empty() && c.iter().all(|c| c.finish_reason.is_none()));
        let last = (doc.usage.is_some() && !content_goes_on)
            || nested[0].is_some()
            || (doc.usage_metadata.is_some() && finished);
        let any =
            last || doc.usage.is_some() || nested[1].is_some() || doc.usage_metadata.is_some();
        if any && (last || !in_stream) {
            self.complete = true;
        }
        for counts in [doc.usage.as_ref(), nested[0], nested[1]]
            .into_iter()
            .flatten()
        {
            grow(
                &mut self.input,
                counts.prompt_tokens.or(counts.input_tokens),
            );
            grow(
                &mut self.output,
                counts.completion_tokens.or(counts.output_tokens),
            );
            grow(&mut self.total, counts.total_tokens);
        }
        if let Some(meta) = &doc.usage_metadata {
            grow(&mut self.input, meta.prompt_token_count);
            grow(&mut self.output, meta.candidates_token_count);
            grow(&mut self.total, meta.total_token_count);
        }
    }
}

/// The parts of a response document that may carry usage; everything else is skipped unread.
#[derive(Deserialize, Default)]
struct Document {
    usage: Option<Counts>,
    /// OpenAI's responses API (`response.completed`).
    response: Option<Nested>,
    /// Anthropic's `message_start`.
    message: Option<Nested>,
    /// Gemini.
    #[serde(rename = "usageMetadata")]
    usage_metadata: Option<GeminiCounts>,
    /// Gemini's last chunk has a candidate with a `finishReason`.
    candidates: Option<Vec<Candidate>>,
    /// OpenAI's chat chunks: the usage chunk has none (`[]`), or — in some compatible APIs —
    /// the choice that finishes; a chunk of content with a running usage (vLLM's
    /// `continuous_usage_stats`) is not the last count.
    choices: Option<Vec<Choice>>,
}

#[derive(Deserialize)]
struct Choice {
    finish_reason: Option<serde::de::IgnoredAny>,
}

#[derive(Deserialize)]
struct Candidate {
    #[serde(rename = "finishReason")]
    finish_reason: Option<serde::de::IgnoredAny>,
}

#[derive(Deserialize)]
struct Nested {
    usage: Option<Counts>,
}

#[derive(Deserialize)]
struct Counts {
    #[serde(default, deserialize_with = "count")]
    prompt_tokens: Option<u64>,
    #[serde(default, deserialize_with = "count")]
    input_tokens: Option<u64>,
    #[serde(default, deserialize_with = "count")]
    completion_tokens: Option<u64>,
    #[serde(default, deserialize_with = "count")]
    output_tokens: Option<u64>,
    #[serde(default, deserialize_with = "count")]
    total_tokens: Option<u64>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct GeminiCounts {
    #[serde(default, deserialize_with = "count")]
    prompt_token_count: Option<u64>,
    #[serde(default, deserialize_with = "count")]
    candidates_token_count: Option<u64>,
    #[serde(default, deserialize_with = "count")]
    total_token_count: Option<u64>,
}

/// A count as a whole number (one past 64 bits saturates, so a huge count is a huge charge);
/// anything else — negative, a fraction, a word, null — is no count, and the document's other
/// counts still stand.
fn count<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    Ok(crate::number::whole(&serde_json::Value::deserialize(d)?))
}

fn grow(slot: &mut Option<u64>, seen: Option<u64>) {
    if let Some(n) = seen {
        *slot = Some(slot.map_or(n, |old| old.max(n)));
    }
}

/// Reads a response body's usage (and whole numbers at chosen fields) as it passes. A JSON body
/// is kept (up to `max_bytes`) and read at its end; an event stream is read event by event,
/// keeping only the line being received (a line longer than `max_bytes` is skipped).
#[derive(Debug)]
pub struct UsageReader {
    stream: bool,
    max_bytes: usize,
    /// Read the LLM usage (else only `fields`).
    wants_usage: bool,
    /// Paths of whole numbers to read from each JSON document, and the last value each had.
    fields: Vec<(Vec<String>, Option<u64>)>,
    kept: Vec<u8>,
    /// The current line grew past `max_bytes`: skip to its end.
    skipping: bool,
    /// A JSON body grew past `max_bytes`: it is not read.
    overflowed: bool,
    usage: Usage,
}

impl UsageReader {
    /// A reader for a body of `content_type` (`text/event-stream` is a stream; anything else is
    /// read as one JSON document).
    #[cfg(test)]
    pub fn new(content_type: Option<&[u8]>, max_bytes: usize) -> Self {
        Self::with_fields(content_type, max_bytes, true, Vec::new())
    }

    /// A reader of the usage (if `wants_usage`) and of whole numbers at `fields` (paths).
    pub fn with_fields(
        content_type: Option<&[u8]>,
        max_bytes: usize,
        wants_usage: bool,
        fields: Vec<Vec<String>>,
    ) -> Self {
        let stream = content_type
            .is_some_and(|t| t.len() >= 17 && t[..17].eq_ignore_ascii_case(b"text/event-stream"));
        Self {
            stream,
            max_bytes,
            wants_usage,
            fields: fields.into_iter().map(|f| (f, None)).collect(),
            kept: Vec::new(),
            skipping: false,
            overflowed: false,
            usage: Usage::default(),
        }
    }

    /// Read the next bytes of the body.
    pub fn push(&mut self, mut chunk: &[u8]) {
        if !self.stream {
            if self.kept.len().saturating_add(chunk.len()) > self.max_bytes {
                self.overflowed = true;
                self.kept = Vec::new();
            }
            if !self.overflowed {
                self.kept.extend_from_slice(chunk);
            }
            return;
        }
        while let Some(end) = chunk.iter().position(|&b| b == b'\n') {
            let (line, rest) = chunk.split_at(end);
            let fits = self.kept.len().saturating_add(line.len()) <= self.max_bytes;
            if !self.skipping && fits {
                if self.kept.is_empty() {
                    self.line(line);
                } else {
                    // The line's start came in an earlier chunk.
                    let mut kept = std::mem::take(&mut self.kept);
                    kept.extend_from_slice(line);
                    self.line(&kept);
                    self.kept = kept;
                }
            }
            self.kept.clear();
            self.skipping = false;
            chunk = rest.get(1..).unwrap_or_default();
        }
        if self.skipping || self.kept.len().saturating_add(chunk.len()) > self.max_bytes {
            self.skipping = true;
            self.kept.clear();
        } else {
            self.kept.extend_from_slice(chunk);
        }
    }

    /// One line of an event stream: a `data:` line is one JSON document (or `[DONE]`).
    fn line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        self.document(data);
    }

    /// One JSON document: a body, or one event's data.
    fn document(&mut self, data: &[u8]) {
        if self.wants_usage {
            match serde_json::from_slice::<Document>(data) {
                Ok(doc) => self.usage.read(&doc, self.stream),
                // Or a JSON array of chunks (Gemini's stream without `alt=sse`).
                Err(_) => {
                    for doc in serde_json::from_slice::<Vec<Document>>(data).unwrap_or_default() {
                        self.usage.read(&doc, true);
                    }
                }
            }
        }
        if self.fields.is_empty() {
            return;
        }
        let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
            return;
        };
        for (path, last) in &mut self.fields {
            if let Some(n) = crate::number::field_at(&value, path).and_then(crate::number::whole) {
                *last = Some(n);
            }
        }
    }

    /// Each field's path and the last whole number it had, taken.
    pub fn fields(&mut self) -> Vec<(Vec<String>, Option<u64>)> {
        std::mem::take(&mut self.fields)
    }

    /// The body ended (or was cut): what it reported.
    pub fn finish(&mut self) -> Usage {
        if self.stream {
            if !self.skipping && !self.kept.is_empty() {
                let kept = std::mem::take(&mut self.kept);
                self.line(&kept);
            }
        } else if !self.overflowed {
            let kept = std::mem::take(&mut self.kept);
            self.document(&kept);
        }
        self.usage
    }

    /// What was read so far.
    pub fn usage(&self) -> Usage {
        self.usage
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SSE: Option<&[u8]> = Some(b"text/event-stream; charset=utf-8");
    const JSON: Option<&[u8]> = Some(b"application/json");

    fn read_in(content_type: Option<&[u8]>, body: &str, cuts: &[usize]) -> Usage {
        let mut r = UsageReader::new(content_type, 64 * 1024);
        let mut at = 0;
        for &cut in cuts {
            let cut = cut.clamp(at, body.len());
            r.push(&body.as_bytes()[at..cut]);
            at = cut;
        }
        r.push(&body.as_bytes()[at..]);
        r.finish()
    }

    const OPENAI_CHAT_STREAM: &str = "data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n\
        data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":30,\"total_tokens\":42}}\n\n\
        data: [DONE]\n\n";
    const OPENAI_RESPONSES_STREAM: &str = "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hi\"}\n\n\
        event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":7,\"output_tokens\":20,\"total_tokens\":27}}}\n\n";
    const ANTHROPIC_STREAM: &str = "event: message_start\r\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\r\n\r\n\
        event: content_block_delta\r\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"Hello\"}}\r\n\r\n\
        event: message_delta\r\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":15}}\r\n\r\n\
        event: message_stop\r\ndata: {\"type\":\"message_stop\"}\r\n\r\n";
    const GEMINI_STREAM: &str = "data: {\"candidates\":[],\"usageMetadata\":{\"promptTokenCount\":8,\"candidatesTokenCount\":2,\"totalTokenCount\":10}}\r\n\r\n\
        data: {\"candidates\":[{\"finishReason\":\"STOP\"}],\"usageMetadata\":{\"promptTokenCount\":8,\"candidatesTokenCount\":40,\"totalTokenCount\":48}}\r\n\r\n";

    /// Numbers at and past each end of the range: a count too large for 64 bits is the largest
    /// charge, not none; one that is not a whole number is no count, and leaves the others.
    #[test]
    fn huge_counts_saturate_and_other_values_are_no_count() {
        let read = |v: &str| {
            let body = format!(r#"{{"usage":{{"prompt_tokens":{v},"completion_tokens":4}}}}"#);
            read_in(JSON, &body, &[]).input
        };
        for huge in [
            "1e30",
            "1000000000000000000000000000000",
            "18446744073709551616",
            "1.9e19",
        ] {
            assert_eq!(read(huge), Some(u64::MAX), "{huge}");
        }
        assert_eq!(read("18446744073709551615"), Some(u64::MAX));
        assert_eq!(read("2000000000000"), Some(2_000_000_000_000));
        assert_eq!(read("0"), Some(0));
        assert_eq!(read("300.0"), Some(300));
        assert_eq!(read(r#""300""#), Some(300));
        for junk in [
            "-1", "-1e30", "1.5", "null", "true", r#""ten""#, r#""-3""#, "[1]", "{}",
        ] {
            assert_eq!(read(junk), None, "{junk}");
            let body = format!(r#"{{"usage":{{"prompt_tokens":{junk},"completion_tokens":4}}}}"#);
            assert_eq!(read_in(JSON, &body, &[]).total(), Some(4), "{junk}");
        }
    }

    #[test]
    fn each_format_reports_its_usage_in_a_stream_and_in_a_body() {
        let cases: [(&str, Option<&[u8]>, Usage); 6] = [
            (OPENAI_CHAT_STREAM, SSE, usage(12, 30, Some(42))),
            (OPENAI_RESPONSES_STREAM, SSE, usage(7, 20, Some(27))),
            (ANTHROPIC_STREAM, SSE, usage(25, 15, None)),
            (GEMINI_STREAM, SSE, usage(8, 40, Some(48))),
            (
                r#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#,
                JSON,
                usage(3, 4, Some(7)),
            ),
            (
                r#"{"content":[],"usage":{"input_tokens":5,"output_tokens":6}}"#,
                None,
                usage(5, 6, None),
            ),
        ];
        for (body, kind, want) in cases {
            assert_eq!(read_in(kind, body, &[]), want, "{body}");
        }
        assert_eq!(usage(25, 15, None).total(), Some(40));
    }

    fn usage(input: u64, output: u64, total: Option<u64>) -> Usage {
        Usage {
            input: Some(input),
            output: Some(output),
            total,
            complete: true,
        }
    }

    /// A stream cut at any byte: its usage is complete only once the provider's last usage event
    /// came whole; before, what it read is the start's or a running count (Anthropic's
    /// `message_start` says one output token).
    #[test]
    fn a_stream_cut_before_its_last_usage_event_is_incomplete() {
        for (stream, last_event) in [
            (OPENAI_CHAT_STREAM, "\"usage\""),
            (OPENAI_RESPONSES_STREAM, "response.completed"),
            (ANTHROPIC_STREAM, "message_delta"),
            (GEMINI_STREAM, "finishReason"),
        ] {
            let last = stream.rfind(last_event).unwrap();
            // The end of the line holding the last usage event.
            let whole = last + stream[last..].find('\n').unwrap();
            for cut in 0..=stream.len() {
                let mut r = UsageReader::new(SSE, 64 * 1024);
                r.push(&stream.as_bytes()[..cut]);
                let usage = r.finish();
                // (Cut exactly at the end of its JSON, the line is read whole.)
                let json_end = stream[..whole].trim_end_matches('\r').len();
                assert_eq!(
                    usage.complete,
                    cut >= json_end,
                    "{last_event}, cut at {cut}"
                );
            }
        }
        // A JSON body is read whole, or not at all.
        let body = r#"{"usage":{"input_tokens":5,"output_tokens":6}}"#;
        for cut in 0..body.len() {
            assert!(!read_in(JSON, &body[..cut], &[]).is_known(), "{cut}");
        }
        assert!(read_in(JSON, body, &[]).complete);
        // Anthropic's start alone, even with the stream ended: not the last count.
        let start =
            &ANTHROPIC_STREAM[..ANTHROPIC_STREAM.find("event: content_block_delta").unwrap()];
        let usage = read_in(SSE, start, &[]);
        assert_eq!(
            (usage.input, usage.output, usage.complete),
            (Some(25), Some(1), false)
        );
    }

    /// Running counts are not the last: vLLM's `continuous_usage_stats` puts a usage in every
    /// chunk of content (a first one of zeros, even); only the chunk without content (or with the
    /// choice that finishes) is the last count. Gemini's stream without `alt=sse` is one JSON
    /// array of chunks.
    #[test]
    fn running_counts_repeated_names_and_arrays_of_chunks() {
        let chunk = |content: &str, p: u64, c: u64| {
            format!(
                "data: {{\"choices\":{content},\"usage\":{{\"prompt_tokens\":{p},\"completion_tokens\":{c},\"total_tokens\":{}}}}}\n\n",
                p + c
            )
        };
        let delta = r#"[{"delta":{"content":"hi"},"finish_reason":null}]"#;
        let running = chunk(delta, 0, 0) + &chunk(delta, 10, 3) + &chunk(delta, 10, 4);
        let u = read_in(SSE, &running, &[]);
        assert_eq!(
            (u.total(), u.complete),
            (Some(14), false),
            "running counts only"
        );
        let finishing = r#"[{"delta":{},"finish_reason":"stop"}]"#;
        let u = read_in(SSE, &(running.clone() + &chunk(finishing, 10, 5)), &[]);
        assert_eq!(
            (u.total(), u.complete),
            (Some(15), true),
            "the choice that finishes"
        );
        let u = read_in(SSE, &(running + &chunk("[]", 10, 6)), &[]);
        assert_eq!((u.total(), u.complete), (Some(16), true), "the usage chunk");
        // A whole JSON body's usage is its last count, choices or not.
        let body = r#"{"choices":[{"message":{"content":"ok"}}],"usage":{"total_tokens":1100}}"#;
        assert!(read_in(JSON, body, &[]).complete);
        // (A usage object naming a count twice is not read: the reservation stands.)
        let dup = r#"{"usage":{"total_tokens":5,"total_tokens":900}}"#;
        assert!(!read_in(JSON, dup, &[]).is_known());
        let array = format!(
            "[{},{}]",
            r#"{"candidates":[{"content":{}}],"usageMetadata":{"promptTokenCount":8,"candidatesTokenCount":2}}"#,
            r#"{"candidates":[{"finishReason":"STOP"}],"usageMetadata":{"promptTokenCount":8,"candidatesTokenCount":40,"totalTokenCount":48}}"#
        );
        let u = read_in(JSON, &array, &[]);
        assert_eq!((u.total(), u.complete), (Some(48), true));
        let unfinished = format!(
            "[{}]",
            r#"{"candidates":[{"content":{}}],"usageMetadata":{"promptTokenCount":8,"candidatesTokenCount":2}}"#
        );
        assert!(!read_in(JSON, &unfinished, &[]).complete);
    }

    #[test]
    fn a_body_past_the_bound_is_not_read_and_a_long_line_is_skipped() {
        let body = r#"{"usage":{"total_tokens":9}}"#;
        let mut r = UsageReader::new(JSON, 10);
        r.push(body.as_bytes());
        assert!(!r.finish().is_known());
        let long = format!("data: {{\"pad\":\"{}\"}}\n", "x".repeat(100));
        let mut r = UsageReader::new(SSE, 64);
        r.push(long.as_bytes());
        r.push(b"data: {\"usage\":{\"total_tokens\":9}}\n");
        assert_eq!(r.finish().total, Some(9));
    }

    proptest! {
        /// A count over the whole u64 and f64 space reads as the whole number it writes: itself,
        /// the largest past 64 bits, none if negative or fractional — and never hides the others.
        #[test]
        fn any_count_reads_as_its_whole_number(n in any::<u64>(), f in any::<f64>()) {
            let read = |v: &str| {
                let body = format!(r#"{{"usage":{{"input_tokens":{v},"output_tokens":7}}}}"#);
                read_in(JSON, &body, &[])
            };
            let u = read(&n.to_string());
            prop_assert_eq!((u.input, u.output), (Some(n), Some(7)));
            if f.is_finite() {
                // (As the JSON reader rounds the text: it may be a neighbour of `f`.)
                let f: f64 = serde_json::from_str(&format!("{f:e}")).unwrap();
                let want = if f >= 0.0 && f.fract() == 0.0 {
                    Some(if f >= u64::MAX as f64 { u64::MAX } else { f as u64 })
                } else {
                    None
                };
                let u = read(&format!("{f:e}"));
                prop_assert_eq!((u.input, u.output), (want, Some(7)));
            }
        }

        /// However the host cuts the stream into chunks, the usage read is the same.
        #[test]
        fn chunking_never_changes_the_usage(mut cuts in proptest::collection::vec(0usize..700, 0..12)) {
            cuts.sort_unstable();
            for (body, want) in [
                (OPENAI_CHAT_STREAM, usage(12, 30, Some(42))),
                (ANTHROPIC_STREAM, usage(25, 15, None)),
                (GEMINI_STREAM, usage(8, 40, Some(48))),
            ] {
                prop_assert_eq!(read_in(SSE, body, &cuts), want);
            }
        }

        /// Any bytes: read without panicking, within the bound.
        #[test]
        fn any_bytes_are_read_without_panicking(
            chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..80), 0..8),
            stream in any::<bool>(),
        ) {
            let mut r = UsageReader::new(stream.then_some(b"text/event-stream".as_slice()), 100);
            for c in &chunks {
                r.push(c);
                prop_assert!(r.kept.len() <= 100);
            }
            let _ = r.finish();
        }
    }
}
