"""Fine-tune a transformers model with transformers' Trainer through coda_cutlass.nn.from_hf.

    python examples/finetune_hf.py                          # a small Llama from a config, synthetic data
    python examples/finetune_hf.py --model PATH             # a local checkpoint (AutoModelForCausalLM)
    python examples/finetune_hf.py --steps 3 --seq 32 --batch 2 --out /tmp/ft   # quick (CPU: seconds)

Data: sequences of a repeating pattern with noise (the model can learn it: the loss drops). On a
Hopper GPU the model runs the bf16 kernels with fp32 master weights (``bf16=True``: the Trainer's
autocast); elsewhere the same programs run through the reference interpreter in fp32. The trained
model is saved with ``save_pretrained`` as a transformers checkpoint, loaded back with
``AutoModelForCausalLM.from_pretrained``, and both are checked to give the same loss.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import coda_cutlass.nn as cnn  # noqa: E402


def synthetic(n: int, seq: int, vocab: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """n sequences: a random 8-token motif repeated, 10% of tokens replaced by noise."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        motif = torch.randint(0, vocab, (8,), generator=g)
        ids = motif.repeat(seq // 8 + 1)[:seq]
        noise = torch.rand(seq, generator=g) < 0.1
        ids = torch.where(noise, torch.randint(0, vocab, (seq,), generator=g), ids)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def main() -> None:
    import transformers
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a local transformers checkpoint (default: a small Llama config)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "finetune_hf")
    args = p.parse_args()
    # Trainer reads a negative max_steps as "train num_train_epochs (3) epochs" and 0 as one step: refuse both
    if args.steps < 1 or args.batch < 1 or args.seq < 2:
        p.error("--steps and --batch must be at least 1 and --seq at least 2 (labels are shifted by one token)")
    if args.model is not None and not Path(args.model).is_dir():
        p.error(f"--model {args.model}: not a folder (a local transformers checkpoint, as save_pretrained writes)")
    if args.out.exists() and not args.out.is_dir():
        p.error(f"--out {args.out} exists and is not a folder")
    on_hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    if args.model:
        hf = transformers.AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    else:
        cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                       max_position_embeddings=args.seq)
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(cfg)
    model = cnn.from_hf(hf)                 # fp32 master weights; bf16 kernels under the Trainer's autocast
    vocab = hf.config.vocab_size
    train, evaluation = synthetic(256, args.seq, vocab), synthetic(16, args.seq, vocab, seed=1)
    targs = transformers.TrainingArguments(
        output_dir=str(args.out), max_steps=args.steps, per_device_train_batch_size=args.batch, per_device_eval_batch_size=args.batch, learning_rate=3e-3,
        warmup_steps=max(1, args.steps // 10), logging_steps=max(1, args.steps // 10), save_strategy="no",
        report_to=[], bf16=on_hopper, use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
        disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=train, eval_dataset=evaluation)
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    print(f"eval loss {before:.4f} -> {after:.4f}")
    trainer.save_model(str(args.out / "model"))
    back = transformers.AutoModelForCausalLM.from_pretrained(args.out / "model").to(model.device)
    batch = torch.stack([r["input_ids"] for r in evaluation]).to(model.device)
    with torch.no_grad():
        ours = model(input_ids=batch, labels=batch).loss.item()
        theirs = back.float()(input_ids=batch, labels=batch).loss.item()
    print(f"saved checkpoint reloaded by transformers: loss {theirs:.4f} (coda {ours:.4f})")
    if not after < before:
        sys.exit("the loss did not drop")
    if abs(ours - theirs) > 1e-3 * abs(theirs):
        sys.exit("the reloaded checkpoint computes another loss")


if __name__ == "__main__":
    main()
