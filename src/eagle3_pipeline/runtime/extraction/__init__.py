"""Backends that run the target and return hidden states. One interface for all of them.

Given a batch of token-id sequences, a backend returns per sequence `aux [T, 3, H]` (the three aux layers,
HF hidden_states indices) and `last [T, H]` (the final hidden state after the final norm), in bf16.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class BackendInfo:
    name: str
    version: str
    aux_layer_ids: tuple[int, ...]  # HF hidden_states indices: [0] = embeddings, [i+1] = block i output
    hidden_size: int
    num_layers: int
    final_norm: str = "post"  # `last` is taken after the final norm

    def as_attrs(self) -> dict:
        return {f"backend_{k}" if k in ("name", "version") else k: (list(v) if isinstance(v, tuple) else v)
                for k, v in asdict(self).items()}


@dataclass
class HiddenStates:
    aux: torch.Tensor  # [T, 3, H] bf16
    last: torch.Tensor  # [T, H] bf16


def finite_rows(aux: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """[N] bool: the row has no NaN/Inf in its aux [N,3,H] or last [N,H] states."""
    return torch.isfinite(aux).flatten(1).all(1) & torch.isfinite(last).all(1)


class Backend(Protocol):
    info: BackendInfo

    def extract(self, batch: list[np.ndarray]) -> list[HiddenStates]: ...


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's low/middle/high layers as HF indices: [2, L//2, L-3]."""
    return [2, num_layers // 2, num_layers - 3]


def check_aux_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    if len(layer_ids) != 3:
        raise ValueError(f"extract.aux_layer_ids needs exactly 3 ids, got {layer_ids}")
    bad = [i for i in layer_ids if not 1 <= i < num_layers]
    if bad:
        raise ValueError(f"extract.aux_layer_ids {bad} out of range: HF indices 1..{num_layers - 1} for a "
                         f"{num_layers}-layer target ({num_layers} is the final-norm output, 0 the embeddings)")
    return list(layer_ids)


def sglang_layer_ids(hf_ids: list[int]) -> list[int]:
    """SGLang's eagle_aux_hidden_state_layer_ids number decoder-block outputs: HF index - 1."""
    return [i - 1 for i in hf_ids]


def from_config(settings: dict, target_dir, trust_remote_code: bool = False) -> Backend:
    """The backend `extract.backend` names, built from the `extract` config section."""
    if settings["backend"] == "hf":
        from eagle3_pipeline.runtime.extraction.hf import HFBackend

        return HFBackend.from_directory(target_dir, device=settings["device"], dtype=settings["dtype"],
                                        aux_layer_ids=settings.get("aux_layer_ids"),
                                        trust_remote_code=trust_remote_code)
    if settings["backend"] == "sglang":
        from eagle3_pipeline.runtime.extraction.sglang import SGLangBackend
        from eagle3_pipeline.runtime.target.loading import load_config

        config = load_config(target_dir, trust_remote_code)
        server = settings.get("sglang") or {}
        if not server.get("aux_url") or not server.get("final_url"):
            raise ValueError("extract.sglang.aux_url and extract.sglang.final_url are required for backend sglang")
        num_layers = config.num_hidden_layers
        return SGLangBackend(server["aux_url"], server["final_url"],
                             settings.get("aux_layer_ids") or default_aux_layer_ids(num_layers), num_layers,
                             config.hidden_size, timeout_s=server.get("timeout_s", 600.0),
                             retries=server.get("retries", 3))
    raise ValueError(f"extract.backend: unknown backend {settings['backend']!r}")
