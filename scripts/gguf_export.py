#!/usr/bin/env python3
"""GGUF files for llama.cpp from the weights seam runs, for side-by-side benchmarks.

Two commands (run with gguf-py 0.19 and numpy on PYTHONPATH; scripts/compare-llama-cpp.sh
installs them into .seam/py):

  to-f16 IN.gguf OUT.gguf
      The same model with every quantized tensor dequantized to F16 (F32 tensors, the norms, stay
      F32). All metadata, the tokenizer included, is copied. From SmolLM2's Q4_1 GGUF this gives
      the weights seam's fp16 model directory holds (seam convert dequantizes the same blocks).

  from-hf MODEL_DIR OUT.gguf --type f16|q4_1
      A seam / Hugging Face Llama directory (config.json, f16 model.safetensors, tokenizer.json of a
      byte-level BPE tokenizer) as a llama.cpp GGUF: llama.cpp's tensor names, the row order of
      attn_q / attn_k that llama.cpp's rope expects, the hyperparameters, the tokenizer. Norms stay
      F32; matrices are F16 or Q4_1 (quantized by gguf-py). Used for the Llama-3.2-1B-shaped random
      model of `seam synth-model`. Llama 3 rope scaling is not written (llama.cpp then uses plain
      rope): the speed of a forward pass does not depend on it.
"""

import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np
import gguf


def to_f16(src: Path, dst: Path) -> None:
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        # Header fields and the architecture are written by GGUFWriter itself.
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if name == "general.file_type":
            value = int(gguf.LlamaFileType.MOSTLY_F16)
        writer.add_key_value(name, value, vtype, sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            data = np.array(tensor.data)
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
        else:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            writer.add_tensor(tensor.name, values.astype(np.float16))
    finish(writer)


def finish(writer: "gguf.GGUFWriter") -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()


def read_safetensors(path: Path) -> dict:
    """Tensors of a safetensors file as numpy arrays (memory-mapped)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    dtypes = {"F16": np.float16, "F32": np.float32, "BF16": None}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = dtypes.get(info["dtype"])
        if dtype is None:
            raise SystemExit(f"{path}: tensor {name} is {info['dtype']}, expected F16 or F32")
        start, end = info["data_offsets"]
        out[name] = data[start:end].view(dtype).reshape(info["shape"])
    return out


def rope_rows_for_llama_cpp(w: np.ndarray, heads: int) -> np.ndarray:
    """Reorders the rows of a q or k projection from Hugging Face's rotate-half rope layout (each
    head's first half of dimensions pairs with its second half) to llama.cpp's interleaved pairs."""
    rows, cols = w.shape
    half = rows // heads // 2
    return w.reshape(heads, 2, half, cols).swapaxes(1, 2).reshape(rows, cols)


def tokenizer_metadata(writer: "gguf.GGUFWriter", model_dir: Path, config: dict) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    model = tok["model"]
    if model.get("type") != "BPE":
        raise SystemExit(f"{model_dir}/tokenizer.json: a {model.get('type')} tokenizer, only BPE is supported")
    vocab_size = config["vocab_size"]
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [int(gguf.TokenType.UNUSED)] * vocab_size
    for text, index in model["vocab"].items():
        if index < vocab_size:
            tokens[index], types[index] = text, int(gguf.TokenType.NORMAL)
    for added in tok.get("added_tokens", []):
        index = added["id"]
        if index < vocab_size:
            tokens[index] = added["content"]
            types[index] = int(gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    bos = config.get("bos_token_id")
    eos = config.get("eos_token_id")
    if isinstance(bos, int):
        writer.add_bos_token_id(bos)
    if isinstance(eos, list):
        eos = eos[0]
    if isinstance(eos, int):
        writer.add_eos_token_id(eos)


def from_hf(model_dir: Path, dst: Path, qtype: str) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    matrix_type = {"f16": gguf.GGMLQuantizationType.F16, "q4_1": gguf.GGMLQuantizationType.Q4_1}[qtype]
    file_type = {"f16": gguf.LlamaFileType.MOSTLY_F16, "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[qtype]

    writer = gguf.GGUFWriter(str(dst), "llama")
    writer.add_name(model_dir.name)
    writer.add_context_length(config.get("max_position_embeddings", 4096))
    writer.add_embedding_length(hidden)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-5)))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(int(file_type))
    tokenizer_metadata(writer, model_dir, config)

    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    tensors = read_safetensors(model_dir / "model.safetensors")
    for name, w in tensors.items():
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            out = "output.weight"
        elif name.startswith("model.layers."):
            layer, rest = name[len("model.layers."):].split(".", 1)
            out = f"blk.{layer}.{names[rest]}"
            if rest == "self_attn.q_proj.weight":
                w = rope_rows_for_llama_cpp(w, heads)
            elif rest == "self_attn.k_proj.weight":
                w = rope_rows_for_llama_cpp(w, kv_heads)
        else:
            raise SystemExit(f"unexpected tensor {name}")
        if w.ndim == 1:
            writer.add_tensor(out, np.asarray(w, dtype=np.float32))
        elif matrix_type == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(out, np.asarray(w, dtype=np.float16))
        else:
            q = gguf.quants.quantize(np.asarray(w, dtype=np.float32), matrix_type)
            writer.add_tensor(out, q, raw_shape=q.shape, raw_dtype=matrix_type)
    finish(writer)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    f16 = commands.add_parser("to-f16")
    f16.add_argument("src", type=Path)
    f16.add_argument("dst", type=Path)
    hf = commands.add_parser("from-hf")
    hf.add_argument("model_dir", type=Path)
    hf.add_argument("dst", type=Path)
    hf.add_argument("--type", choices=["f16", "q4_1"], required=True)
    args = parser.parse_args()
    tmp = args.dst.with_name(args.dst.name + ".partial")
    if args.command == "to-f16":
        to_f16(args.src, tmp)
    else:
        from_hf(args.model_dir, tmp, args.type)
    tmp.replace(args.dst)
    print(args.dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
