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
    let kv: Vec<String> =
        [flag(c.kv_ops.truncate, "truncate"), flag(c.kv_ops.fork, "fork")].into_iter().flatten().collect();
    let inputs: Vec<String> =
        [flag(c.inputs.tokens, "tokens"), flag(c.inputs.embeddings, "embeddings")].into_iter().flatten().collect();
    let formats: Vec<String> = c.weight_formats.iter().map(|f| f.to_string()).collect();
    vec![
        // A backend reports usize::MAX when only the loaded model sets the limit.
        if c.max_context == usize::MAX {
            "max context     the model's".to_string()
        } else {
            format!("max context     {}", c.max_context)
        },
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

/// One registry entry as probed once: availability may touch devices, so it is asked only once.
struct Probed {
    name: String,
    /// `(backend, device)` for a device alias.
    alias_of: Option<(&'static str, &'static str)>,
    description: String,
    availability: Availability,
    capabilities: Option<Capabilities>,
}

fn probe_all() -> Vec<Probed> {
    registered_backends()
        .into_iter()
        .map(|entry| match entry.instantiate() {
            Ok(backend) => Probed {
                name: backend.name().to_string(),
                alias_of: entry.alias_of(),
                description: backend.description().to_string(),
                availability: backend.availability(),
                capabilities: Some(backend.capabilities()),
            },
            Err(e) => Probed {
                name: entry.name.to_string(),
                alias_of: entry.alias_of(),
                description: String::new(),
                availability: Availability::Unavailable { reason: e.to_string() },
                capabilities: None,
            },
        })
        .collect()
}

pub fn run(args: BackendsArgs) -> Result<(), CliError> {
    let probed = probe_all();
    if args.json {
        let listing: Vec<serde_json::Value> = probed
            .iter()
            .map(|b| {
                serde_json::json!({
                    "name": b.name,
                    "alias_of": b.alias_of.map(|(backend, device)| serde_json::json!({"backend": backend, "device": device})),
                    "description": b.description,
                    "availability": b.availability,
                    "capabilities": b.capabilities,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&listing).expect("the listing serializes"));
        return Ok(());
    }
    for b in &probed {
        if let Some((backend, device)) = b.alias_of {
            let status = match &b.availability {
                Availability::Available { .. } => "available".to_string(),
                Availability::Unavailable { reason } => format!("unavailable: {reason}"),
            };
            println!("{}  = {backend} --device {device} ({status})\n", b.name);
            continue;
        }
        println!("{}  {}", b.name, b.description);
        match &b.availability {
            Availability::Available { devices } => {
                println!("  available");
                for d in devices {
                    let kind = serde_json::to_value(d.kind)
                        .ok()
                        .and_then(|k| k.as_str().map(String::from))
                        .unwrap_or_default();
                    println!("  device {} ({kind}): {}", d.id, d.name);
                }
            }
            Availability::Unavailable { reason } => println!("  unavailable: {reason}"),
        }
        for line in b.capabilities.iter().flat_map(describe_capabilities) {
            println!("  {line}");
        }
        println!();
    }
    Ok(())
}
