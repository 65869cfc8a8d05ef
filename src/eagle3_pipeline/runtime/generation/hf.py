"""The HF engine: batched `generate` on the target directory (left padded; CPU or GPU)."""

from __future__ import annotations

from pathlib import Path

from eagle3_pipeline.runtime.generation import Reply, RequestRejected, Settings
from eagle3_pipeline.tokenization import render


class HFEngine:
    """Batched `generate` on the target directory; histories sorted by length so padding stays small."""

    def __init__(self, target_dir: Path, settings: Settings, trust_remote_code: bool = False):
        import torch

        from eagle3_pipeline.runtime.target.devices import pick_device
        from eagle3_pipeline.runtime.target.loading import load_model, load_tokenizer

        self.torch = torch
        device = pick_device(settings.device)
        dtype = None if settings.dtype == "auto" else getattr(torch, settings.dtype)
        self.settings, self.device = settings, device
        self.tokenizer = load_tokenizer(target_dir, trust_remote_code)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = load_model(target_dir, device, dtype, trust_remote_code)
        configured = self.model.generation_config.eos_token_id
        configured = configured if isinstance(configured, list) else [configured]
        self.stop_ids = sorted({i for i in [self.tokenizer.eos_token_id, *configured] if i is not None})

    def reply(self, histories: list[list[dict[str, str]]], seeds: list[int]) -> list[Reply | RequestRejected]:
        prompts = [render(self.tokenizer, history, True, **self.settings.template_kwargs()) for history in histories]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: list[Reply | RequestRejected] = [RequestRejected("not generated")] * len(prompts)
        for start in range(0, len(order), self.settings.batch_size):
            batch = order[start:start + self.settings.batch_size]
            for index, reply in zip(batch, self._generate([prompts[i] for i in batch], seeds[batch[0]]), strict=True):
                results[index] = reply
        return results

    def _generate(self, prompts: list[str], seed: int) -> list[Reply]:
        torch, settings = self.torch, self.settings
        encoded = self.tokenizer(prompts, add_special_tokens=False, padding=True, return_tensors="pt").to(self.device)
        sampling = settings.temperature > 0
        if sampling:
            torch.manual_seed(seed)
        with torch.inference_mode():
            output = self.model.generate(
                **encoded, max_new_tokens=settings.max_new_tokens, do_sample=sampling,
                temperature=settings.temperature if sampling else None, top_p=settings.top_p if sampling else None,
                top_k=None, pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.stop_ids)
        new_tokens = output[:, encoded["input_ids"].shape[1]:].tolist()
        replies = []
        for tokens in new_tokens:
            stop_at = next((i for i, token in enumerate(tokens) if token in self.stop_ids), None)
            kept = tokens if stop_at is None else tokens[:stop_at]
            text = self.tokenizer.decode(kept, skip_special_tokens=True).strip()
            replies.append(Reply(text, finished=stop_at is not None, tokens=len(kept)))
        return replies
