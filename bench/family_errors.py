"""The family table of issue 21: for every model family from_hf takes, the largest relative error of
the loss and of any parameter gradient against the transformers model (tiny configs, fp32, weights
drawn larger than transformers' initialisation so attention is far from uniform). Runs on the CPU
(the reference interpreter: the kernels' programs) in about a minute; prints a markdown table.

    python bench/family_errors.py [--out family_errors.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import coda_cutlass.nn as cnn  # noqa: E402
from coda_cutlass.nn.hf.checkpoint import to_hf_keys  # noqa: E402

CASES = [
    ("llama", "Llama 3 (llama3 rope, tied)", {"tie_word_embeddings": True, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}),
    ("llama", "Llama (yarn rope, relu)", {"hidden_act": "relu", "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "original_max_position_embeddings": 8}}),
    ("mistral", "Mistral (window 5)", {"sliding_window": 5}),
    ("qwen2", "Qwen 2 (biases, window on layer 1)", {"use_sliding_window": True, "sliding_window": 5,
                                                      "max_window_layers": 1}),
    ("qwen3", "Qwen 3 (q/k norms)", {}),
    ("gemma", "Gemma", {}),
    ("gemma2", "Gemma 2 (soft-caps 5 / 3, window 5)", {"attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0,
                                                        "sliding_window": 5}),
    ("gemma3_text", "Gemma 3 (window 6, two rope bases)", {"layer_types": ["sliding_attention", "full_attention"],
                                                           "sliding_window": 6}),
    ("phi3", "Phi-3 (fused weights)", {"pad_token_id": 0}),
]


def errors(model_type: str, fields: dict) -> tuple[float, float, str]:
    from test_hf_models import hf_model
    hf = hf_model(model_type, **fields)
    model = cnn.from_hf(hf)
    tokens = torch.randint(1, 48, (2, 12), generator=torch.Generator().manual_seed(0))
    ref = hf(input_ids=tokens, labels=tokens).loss
    out = model(input_ids=tokens, labels=tokens).loss
    ref.backward()
    out.backward()
    ours = to_hf_keys({n: p.grad for n, p in model.coda.named_parameters(remove_duplicate=False)},
                      model.coda_family, model.config, model.coda_tied)
    worst, name = 0.0, ""
    for n, p in hf.named_parameters():
        e = ((ours[n] - p.grad).norm() / p.grad.norm().clamp_min(1e-30)).item()
        if e > worst:
            worst, name = e, n
    return abs(out.item() - ref.item()) / abs(ref.item()), worst, name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    lines = ["| family | test | loss rel. error | worst gradient rel. error (parameter) |", "|---|---|---|---|"]
    for model_type, label, fields in CASES:
        loss_err, grad_err, name = errors(model_type, fields)
        lines.append(f"| {model_type} | {label} | {loss_err:.1e} | {grad_err:.1e} ({name}) |")
        print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
