"""Row-block counters for reductions the kernel finishes itself (templates/coda/finish_rows.hpp).

The kernel counts the CTAs of each row block in with atomicInc, which wraps the counter back to 0
on the last arrival: the counters are zero before and after every launch, so no per-call memset is
needed. Kernels queued on one stream never overlap, so one zeroed buffer per (device, stream) is
safe to share between all kernels and calls on that stream; a larger launch grows it (the old one
is released in stream order). Under CUDA graph capture every call gets a freshly zeroed buffer
(the zeroing is captured with it), so no graph-pool memory is kept across captures.
"""

from __future__ import annotations

import torch

_BUFFERS: dict[tuple[int, int], torch.Tensor] = {}


def row_block_counters(device: torch.device, stream: int, count: int) -> torch.Tensor:
    """At least ``count`` zeroed int32 counters for launches on ``stream`` of ``device``."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(max(count, 1), dtype=torch.int32, device=device)
    key = (device.index if device.index is not None else torch.cuda.current_device(), stream)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < count:
        size = max(count, 2 * buf.numel() if buf is not None else 1024)
        buf = _BUFFERS[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return buf
