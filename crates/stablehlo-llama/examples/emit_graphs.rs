//! Writes the StableHLO module of a model to stdout, for inspecting and timing the graphs with
//! IREE's tools by hand:
//!
//! ```text
//! cargo run -p stablehlo-llama --example emit_graphs -- [--loop] <config.json> <f16|int4> <max_context> [bucket...]
//! ```
//!
//! The module holds `decode`, `decode_logits`, and `prefill_{bucket}` for each bucket given;
//! `--loop` emits one loop over stacked layer weights instead of unrolled layers.

use session_api::WeightFormat;
use stablehlo_llama::{emit_module, GraphKind, GraphOptions, GraphSpec, LayerMode};
use std::path::Path;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let layers = if args.first().is_some_and(|a| a == "--loop") {
        args.remove(0);
        LayerMode::Loop
    } else {
        LayerMode::Unrolled
    };
    if args.len() < 3 {
        return Err("usage: emit_graphs [--loop] <config.json> <f16|int4> <max_context> [bucket...]".into());
    }
    let config = llama_model::LlamaConfig::from_file(Path::new(&args[0]))?;
    let format: WeightFormat = args[1].parse()?;
    let max_context: usize = args[2].parse()?;
    let mut specs =
        vec![GraphSpec { kind: GraphKind::Decode, logits: false }, GraphSpec { kind: GraphKind::Decode, logits: true }];
    for bucket in &args[3..] {
        specs.push(GraphSpec { kind: GraphKind::Prefill { bucket: bucket.parse()? }, logits: false });
    }
    print!("{}", emit_module(&config, &GraphOptions { layers, ..GraphOptions::new(max_context, format) }, &specs)?);
    Ok(())
}
