#!/usr/bin/env python3
"""Checks a seam greedy generation against Hugging Face transformers' LlamaForCausalLM.

Usage: verify_against_transformers.py MODEL_DIR SEAM_RUN_JSON [GGUF]

SEAM_RUN_JSON is the output of `seam run --json --ignore-eos ...` (greedy). The script loads the
same model directory with transformers in float32 (or, given GGUF, that llama.cpp file, every
tensor dequantized to float32 by transformers' own GGUF reader: what seam's int4 model converted
from it must compute), feeds the same prompt ids, decodes greedily for
as many tokens as seam generated, and reports the first step where the two disagree, with the
transformers logit margin between its two best tokens at that step (a tiny margin means the
divergence is a rounding tie, a large one means a real difference).
"""
import json
import os
import sys

import torch
from transformers import DynamicCache, LlamaForCausalLM


def main() -> int:
    model_dir, run_json = sys.argv[1], sys.argv[2]
    gguf = sys.argv[3] if len(sys.argv) > 3 else None
    with open(run_json) as f:
        run = json.load(f)
    prompt = run["prompt_token_ids"]
    seam_tokens = run["token_ids"]
    torch.manual_seed(0)
    if gguf is None:
        model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    else:
        # The architecture from the model directory's config.json (seam wrote it from the GGUF's
        # hyperparameters); every weight from the GGUF through transformers' own reader, which
        # dequantizes each tensor to float32 and undoes llama.cpp's q/k row order.
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        tensors = load_gguf_checkpoint(os.path.abspath(gguf), return_tensors=True)["tensors"]
        model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        missing, unexpected = model.load_state_dict(
            {k: torch.as_tensor(v, dtype=torch.float32) for k, v in tensors.items()}, strict=False
        )
        # A tied head is the embedding; nothing else may be left out or left over.
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise SystemExit(f"GGUF tensors do not match the model: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
    model.eval()
    ids = torch.tensor([prompt])
    hf_tokens, margins = [], []
    past = DynamicCache()
    with torch.no_grad():
        for _ in range(len(seam_tokens)):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1]
            top2 = torch.topk(logits, 2)
            token = int(top2.indices[0])
            hf_tokens.append(token)
            margins.append(float(top2.values[0] - top2.values[1]))
            ids = torch.tensor([[token]])
    first = next((i for i, (a, b) in enumerate(zip(seam_tokens, hf_tokens)) if a != b), None)
    report = {
        "model_dir": model_dir,
        "gguf": gguf,
        "backend": run.get("backend"),
        "weights": run.get("weights"),
        "prompt_tokens": len(prompt),
        "compared_tokens": len(seam_tokens),
        "first_divergence": first,
        "margin_at_divergence": None if first is None else margins[first],
        "min_margin": min(margins) if margins else None,
        "transformers_tokens": hf_tokens,
    }
    print(json.dumps(report, indent=2))
    return 0 if first is None else 1


if __name__ == "__main__":
    sys.exit(main())
