//! An LLM-like API: answers with a chosen token usage, as a JSON body or a stream of events in
//! the format of OpenAI chat, OpenAI responses, Anthropic or Gemini, paced as asked.
//!
//! Request headers choose the answer: `x-usage-input` and `x-usage-output` (tokens, default 10
//! and 100), `x-format` (`openai`, `responses`, `anthropic`, `gemini`; default `openai`),
//! `x-stream: 1` for events (else one JSON body), `x-events` (content events before the usage,
//! default 5), `x-event-ms` (pause between events, default 0), and `x-cut-after` (end the
//! connection after this many content events, before any usage: a stream cut short).

use crate::http::Head;
use std::io::{self, Write};
use std::time::Duration;

/// Write the answer to `head` on `out`; `Ok(false)` if the connection must close (cut short).
pub fn answer(head: &Head, out: &mut impl Write) -> io::Result<bool> {
    let number = |name: &str, default: u64| {
        head.header(name)
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(default)
    };
    let (input, output) = (number("x-usage-input", 10), number("x-usage-output", 100));
    let format = head.header("x-format").unwrap_or("openai");
    let events = number("x-events", 5);
    let pause = Duration::from_millis(number("x-event-ms", 0));
    let cut_after = head
        .header("x-cut-after")
        .and_then(|v| v.parse::<u64>().ok());
    if head.header("x-stream") != Some("1") {
        let body = document(format, input, output);
        write!(
            out,
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )?;
        return Ok(true);
    }
    write!(
        out,
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )?;
    out.flush()?;
    if format == "anthropic" {
        chunk(out, &event("message_start", &format!(
            "{{\"type\":\"message_start\",\"message\":{{\"usage\":{{\"input_tokens\":{input},\"output_tokens\":1}}}}}}"
        )))?;
    }
    for n in 0..events {
        if cut_after == Some(n) {
            out.flush()?;
            return Ok(false);
        }
        std::thread::sleep(pause);
        chunk(out, &content_event(format, n, input))?;
        out.flush()?;
    }
    if cut_after.is_some_and(|c| c <= events) {
        return Ok(false);
    }
    let last = match format {
        "anthropic" => event(
            "message_delta",
            &format!("{{\"type\":\"message_delta\",\"usage\":{{\"output_tokens\":{output}}}}}"),
        ) + &event("message_stop", "{\"type\":\"message_stop\"}"),
        "responses" => event(
            "response.completed",
            &format!(
                "{{\"type\":\"response.completed\",\"response\":{{\"usage\":{{\"input_tokens\":{input},\"output_tokens\":{output},\"total_tokens\":{}}}}}}}",
                input + output
            ),
        ),
        "gemini" => data(&gemini(input, output, true)),
        _ => {
            data(&format!(
                "{{\"choices\":[],\"usage\":{{\"prompt_tokens\":{input},\"completion_tokens\":{output},\"total_tokens\":{}}}}}",
                input + output
            )) + "data: [DONE]\n\n"
        }
    };
    chunk(out, &last)?;
    out.write_all(b"0\r\n\r\n")?;
    out.flush()?;
    Ok(true)
}

/// One JSON answer with its usage.
fn document(format: &str, input: u64, output: u64) -> String {
    let total = input + output;
    match format {
        "anthropic" => format!(
            "{{\"content\":[{{\"type\":\"text\",\"text\":\"ok\"}}],\"usage\":{{\"input_tokens\":{input},\"output_tokens\":{output}}}}}"
        ),
        "responses" => format!(
            "{{\"output\":[],\"usage\":{{\"input_tokens\":{input},\"output_tokens\":{output},\"total_tokens\":{total}}}}}"
        ),
        "gemini" => gemini(input, output, true),
        _ => format!(
            "{{\"choices\":[{{\"message\":{{\"content\":\"ok\"}}}}],\"usage\":{{\"prompt_tokens\":{input},\"completion_tokens\":{output},\"total_tokens\":{total}}}}}"
        ),
    }
}

/// Gemini's answer, or one chunk of its stream: every chunk has the usage so far, and the last
/// (`finished`) a candidate with its `finishReason`.
fn gemini(input: u64, output: u64, finished: bool) -> String {
    let candidates = if finished {
        "[{\"content\":{\"parts\":[{\"text\":\"ok\"}]},\"finishReason\":\"STOP\"}]"
    } else {
        "[]"
    };
    format!(
        "{{\"candidates\":{candidates},\"usageMetadata\":{{\"promptTokenCount\":{input},\"candidatesTokenCount\":{output},\"totalTokenCount\":{}}}}}",
        input + output
    )
}

/// Content event `n` (Gemini's carries its running usage, as Gemini's chunks do).
fn content_event(format: &str, n: u64, input: u64) -> String {
    match format {
        "anthropic" => event(
            "content_block_delta",
            &format!("{{\"type\":\"content_block_delta\",\"delta\":{{\"text\":\"word{n} \"}}}}"),
        ),
        "responses" => event(
            "response.output_text.delta",
            &format!("{{\"type\":\"response.output_text.delta\",\"delta\":\"word{n} \"}}"),
        ),
        "gemini" => data(&format!(
            "{{\"candidates\":[{{\"content\":{{\"parts\":[{{\"text\":\"word{n} \"}}]}}}}],\"usageMetadata\":{{\"promptTokenCount\":{input},\"candidatesTokenCount\":{},\"totalTokenCount\":{}}}}}",
            n + 1,
            input + n + 1
        )),
        _ => data(&format!(
            "{{\"choices\":[{{\"delta\":{{\"content\":\"word{n} \"}}}}]}}"
        )),
    }
}

fn event(name: &str, json: &str) -> String {
    format!("event: {name}\ndata: {json}\n\n")
}

fn data(json: &str) -> String {
    format!("data: {json}\n\n")
}

fn chunk(out: &mut impl Write, text: &str) -> io::Result<()> {
    write!(out, "{:x}\r\n{text}\r\n", text.len())
}
