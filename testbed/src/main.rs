//! tollgate-testbed: an upstream that models a service with a capacity (and answers like an LLM
//! API on `/llm` paths), and an open-loop load generator, for the tests and benchmarks (loopback
//! only).

mod http;
mod llm;
mod load;
mod upstream;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "tollgate-testbed", about = "Upstream model and load generator")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve at most `capacity` requests at once, each for `service_ms`; queue the rest.
    ///
    /// Paths containing `/llm` answer like an LLM API instead, chosen by request headers:
    /// `x-usage-input` and `x-usage-output` (tokens, default 10 and 100), `x-format` (`openai`,
    /// `responses`, `anthropic`, `gemini`), `x-stream: 1` (server-sent events, else one JSON
    /// body), `x-events` (content events before the usage, default 5), `x-event-ms` (pause
    /// between events: a slow stream), `x-cut-after` (end the connection after this many
    /// content events, before any usage). Paths ending `/bytes/N` answer N bytes (downloads).
    Upstream(upstream::Args),
    /// Send requests at a fixed rate (open loop) and print what came back as JSON.
    Load(load::Args),
}

fn main() {
    let result = match Cli::parse().command {
        Command::Upstream(args) => upstream::run(&args),
        Command::Load(args) => load::run(&args),
    };
    if let Err(e) = result {
        eprintln!("tollgate-testbed: {e}");
        std::process::exit(1);
    }
}
