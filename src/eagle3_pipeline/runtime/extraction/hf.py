"""HF transformers backend (the embedded default; CPU or GPU).

Forward hooks on the three aux decoder blocks capture their outputs; the base model's own output is the
final-norm state; the LM head is never run and `output_hidden_states` is never used (it would
materialise every layer). Sequences in a batch are right-padded; padding rows are stripped before the
device-to-host copy, which goes into pinned memory asynchronously so the GPU keeps computing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import transformers

from eagle3_pipeline.runtime.extraction import (
    BackendInfo,
    HiddenStates,
    check_aux_layer_ids,
    default_aux_layer_ids,
    finite_rows,
)
from eagle3_pipeline.runtime.target.devices import pick_device


def pick_dtype(requested: str, device: str) -> torch.dtype:
    if requested == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, requested)


class HFBackend:
    def __init__(self, model: torch.nn.Module, aux_layer_ids: list[int] | None = None):
        self.model = model.eval()
        self.base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        config = model.config
        num_layers = config.num_hidden_layers
        ids = check_aux_layer_ids(aux_layer_ids or default_aux_layer_ids(num_layers), num_layers)
        self.info = BackendInfo("hf-transformers", transformers.__version__, tuple(ids), config.hidden_size,
                                num_layers)
        self.device = next(model.parameters()).device
        self.captured: dict[int, torch.Tensor] = {}
        self.hooks = [self.base.layers[i - 1].register_forward_hook(self._capture(slot))
                      for slot, i in enumerate(ids)]

    @classmethod
    def from_directory(cls, target_dir: Path, device: str = "auto", dtype: str = "auto",
                       aux_layer_ids: list[int] | None = None, trust_remote_code: bool = False) -> HFBackend:
        from eagle3_pipeline.runtime.target.loading import load_model

        device = pick_device(device)
        model = load_model(target_dir, device=device, dtype=pick_dtype(dtype, device),
                           trust_remote_code=trust_remote_code)
        return cls(model, aux_layer_ids)

    def _capture(self, slot: int):
        def hook(_module, _inputs, output):
            self.captured[slot] = output[0] if isinstance(output, tuple) else output
        return hook

    @torch.inference_mode()
    def forward(self, batch: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run one right-padded batch; return aux [B,T,3,H], last [B,T,H] on the device and the mask."""
        width = max(len(ids) for ids in batch)
        input_ids = torch.zeros((len(batch), width), dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.from_numpy(ids.astype(np.int64))
            attention[row, : len(ids)] = 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        self.captured.clear()
        output = self.base(input_ids=input_ids, attention_mask=attention, use_cache=False)
        aux = torch.stack([self.captured[slot] for slot in range(3)], dim=2)
        return aux, output.last_hidden_state, attention.bool()

    def extract(self, batch: list[np.ndarray]) -> list[HiddenStates]:
        aux, last, mask = self.forward(batch)
        packed = pack_to_host(aux, last, mask, bf16_rows)
        if packed.ready is not None:
            packed.ready.synchronize()
        results, start = [], 0
        for ids in batch:
            end = start + len(ids)
            results.append(HiddenStates(packed.rows["aux"][start:end], packed.rows["last"][start:end]))
            start = end
        return results

    def extract_packed(self, batch: list[np.ndarray], encode: RowEncoder | None = None) -> PackedStates:
        """Rows of every sequence in order, padding stripped, on the host (pinned, async on GPU), plus a
        per-row finite flag computed on the device. `encode` turns (aux, last) into the arrays to copy, on the
        device (e.g. fp8 with scales: half the bytes to copy); without it, {"aux", "last"} in bf16. Wait on
        `ready` (GPU only) before reading."""
        aux, last, mask = self.forward(batch)
        return pack_to_host(aux, last, mask, encode or bf16_rows)


RowEncoder = Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]


def bf16_rows(aux: torch.Tensor, last: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"aux": aux, "last": last}


class PackedStates(NamedTuple):
    rows: dict[str, torch.Tensor]  # the encoder's arrays, one row per token
    finite: torch.Tensor  # [N] bool: no NaN/Inf in the row
    ready: torch.cuda.Event | None = None


def pack_to_host(aux: torch.Tensor, last: torch.Tensor, mask: torch.Tensor, encode: RowEncoder) -> PackedStates:
    """Strip padding on the device, cast to bf16, flag non-finite rows there (a full pass over the batch costs
    the CPU seconds, the GPU microseconds), encode, copy to (pinned) host memory without waiting."""
    aux_rows = aux[mask].to(torch.bfloat16)
    last_rows = last[mask].to(torch.bfloat16)
    finite = finite_rows(aux_rows, last_rows)
    rows = encode(aux_rows, last_rows)
    if aux_rows.device.type != "cuda":
        return PackedStates(rows, finite)
    host_rows = {name: _to_pinned(t) for name, t in rows.items()}
    host_finite = _to_pinned(finite)
    event = torch.cuda.Event()
    event.record()
    return PackedStates(host_rows, host_finite, event)


def _to_pinned(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
