//! Snapshots of the emitted text for the tiny config: any change to the graphs shows up as a
//! reviewable diff. (That the text computes the right numbers is `iree_numeric.rs`'s job.)

use llama_model::random::{tiny_config, tiny_llama32_config};
use session_api::WeightFormat;
use stablehlo_llama::{emit_module, GraphKind, GraphOptions, GraphSpec, LayerMode};

#[test]
fn tiny_decode_f16() {
    let options = GraphOptions::new(16, WeightFormat::F16);
    let text = emit_module(&tiny_config(), &options, &[GraphSpec { kind: GraphKind::Decode, logits: false }]).unwrap();
    insta::assert_snapshot!(text);
}

#[test]
fn tiny_llama32_prefill_int4_with_logits() {
    let options = GraphOptions::new(16, WeightFormat::Int4);
    let spec = GraphSpec { kind: GraphKind::Prefill { bucket: 4 }, logits: true };
    let text = emit_module(&tiny_llama32_config(), &options, &[spec]).unwrap();
    insta::assert_snapshot!(text);
}

#[test]
fn tiny_decode_f16_layer_loop() {
    let options = GraphOptions { layers: LayerMode::Loop, ..GraphOptions::new(16, WeightFormat::F16) };
    let text = emit_module(&tiny_config(), &options, &[GraphSpec { kind: GraphKind::Decode, logits: false }]).unwrap();
    insta::assert_snapshot!(text);
}
