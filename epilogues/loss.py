"""LM head epilogues: cross-entropy statistics without a separate softmax pass."""

import torch

import coda_cutlass as cc


@cc.epilogue
def lm_head_lse(acc, r: cc.PerRow(torch.float32), target: cc.PerRow(torch.int64)):
    """LM head after the final RMSNorm: logits = r * acc are not written; returns the per-row
    log-sum-exp and the target logit (loss = lse - target_logit; an out-of-range target such as
    ignore_index gives a target logit of 0, mask those rows)."""
    logits = acc * r
    return {"lse": cc.row_logsumexp(logits), "target_logit": cc.gather(logits, target)}


@cc.epilogue
def lm_head_lse_logits(acc, r: cc.PerRow(torch.float32), target: cc.PerRow(torch.int64)):
    """As lm_head_lse, and also writes the logits (D) for a backward that reads them. The log-sum-exp
    and target logit are of the logits as written (rounded to the GEMM dtype): the backward's
    exp(D - lse) is then a softmax that sums to one. From the fp32 logits instead, a dominant logit
    L (p ~ 1) would be off by up to L * 2^-9 in bf16, and so would p: 6% at L = 18 (tied
    embeddings scaled by sqrt(dim), as Gemma's, make the input token's logit that large)."""
    logits = cc.cast(acc * r)
    return {"D": logits, "lse": cc.row_logsumexp(logits), "target_logit": cc.gather(logits, target)}
