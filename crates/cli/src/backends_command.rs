//! `seam backends`: what is registered, what can run here, and what each can do.

use crate::cli_error::CliError;
use clap::Args;
use session_api::{registered_backends, Availability, Capabilities};

#[derive(Args)]
pub struct BackendsArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

fn describe_capabilities(c: &Capabilities) -> Vec<String> {
    let flag = |on: bool, name: &str| if on { Some(name.to_string()) } else { None };
    let sampling: Vec<String> = [
        flag(c.sampling.greedy, "greedy"),
        flag(c.sampling.temperature, "temperature"),
        flag(c.sampling.top_k, "top-k"),
        flag(c.sampling.top_p, "top-p"),
        flag(c.sampling.seeded, "seeded"),
    ]
    .into_iter()
    .flatten()
    .collect();
    let kv: Vec<String> = [flag(c.kv_ops.truncate, "truncate"), flag(c.kv_ops.fork, "fork")].into_iter().flatten().collect();
    let inputs: Vec<String> =
        [flag(c.inputs.tokens, "tokens"), flag(c.inputs.embeddings, "embeddings")].into_iter().flatten().collect();
    let formats: Vec<String> = c.weight_formats.iter().map(|f| f.to_string()).collect();
    vec![
        format!("max context     {}", c.max_context),
        format!("weight formats  {}", formats.join(", ")),
        format!("sampling        {}", sampling.join(", ")),
        format!("logits          {}", if c.logits { "yes" } else { "no" }),
        format!("kv operations   {}", if kv.is_empty() { "none".into() } else { kv.join(", ") }),
        format!("inputs          {}", inputs.join(", ")),
        format!(
            "sessions        {}{}",
            c.max_concurrent_sessions.map(|n| format!("at most {n}")).unwrap_or_else(|| "unlimited".into()),
            if c.parallel_sessions { ", in parallel" } else { ", one at a time" }
        ),
    ]
}

pub fn run(args: BackendsArgs) -> Result<(), CliError> {
    let mut listing = Vec::new();
    for entry in registered_backends() {
        let backend = match entry.instantiate() {
            Ok(b) => b,
            Err(e) => {
                listing.push(serde_json::json!({ "name": entry.name, "availability": { "status": "unavailable", "reason": e.to_string() } }));
                continue;
            }
        };
        listing.push(serde_json::json!({
            "name": backend.name(),
            "description": backend.description(),
            "availability": backend.availability(),
            "capabilities": backend.capabilities(),
        }));
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&listing).expect("the listing serializes"));
        return Ok(());
    }
    for entry in registered_backends() {
        let Ok(backend) = entry.instantiate() else {
            println!("{}\n  unavailable: built against another session-api version\n", entry.name);
            continue;
        };
        println!("{}  {}", backend.name(), backend.description());
        match backend.availability() {
            Availability::Available { devices } => {
                println!("  available");
                for d in devices {
                    println!("  device {}: {}", d.index, d.name);
                }
            }
            Availability::Unavailable { reason } => println!("  unavailable: {reason}"),
        }
        for line in describe_capabilities(&backend.capabilities()) {
            println!("  {line}");
        }
        println!();
    }
    Ok(())
}
