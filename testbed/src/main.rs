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
