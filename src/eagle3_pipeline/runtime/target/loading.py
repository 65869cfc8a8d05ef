"""Loading the target's model, tokenizer and config from its materialised directory (formats/target_dir)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(target_dir: Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target_dir), trust_remote_code=trust_remote_code)


def load_config(target_dir: Path, trust_remote_code: bool = False):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(target_dir), trust_remote_code=trust_remote_code)


def load_model(target_dir: Path, device: str = "cpu", dtype: Any = None, trust_remote_code: bool = False):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype, use_safetensors=True,
                                                 trust_remote_code=trust_remote_code)
    return model.to(device).eval()
