"""The HF engine: batched `generate` on the target directory (left padded; CPU or GPU).

Sampling draws each reply's tokens from that reply's own seed: HF's sampling draws a whole batch from one global
generator, so a reply would depend on its batch mates. Here generate decodes greedily over logits that leave one
token possible per row (`RowSeededSampling`): the token where the row's uniform draw falls in the cumulative
distribution of softmax(logits / T) (after top-p), the draw from a host generator seeded with the row's seed,
one draw per step. A step costs a handful of kernels whatever the batch (a device generator per row cost one
launch per row and step). What reproduces: the same seed and the same history on the same device and dtype give
the same draws; the logits themselves can differ in their last bits with the padding a batch brings (as in
greedy decoding), which at a boundary of the distribution changes a token. A run's batches are a function of its
input and settings, so the same config reproduces the same shard on the same machine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_pipeline.runtime.generation import Prompt, Reply, RequestRejected, Settings, decode_reply, stop_token_ids


class HFEngine:
    """Batched `generate` on the target directory; histories sorted by length so padding stays small.

    Compiled (`compile`; auto = on CUDA), a batch decodes over a static KV cache of the next power-of-two size
    that holds its longest history and reply, and `generate` runs its decode step through torch.compile (on a GPU
    in CUDA graphs: a small target's eager step is hundreds of kernel launches whatever the batch). Every batch is
    padded to `batch_size` rows (copies of its last history, dropped after), so each cache size compiles once. Where
    compiling fails the engine logs why and generates eagerly from then on."""

    def __init__(self, target_dir: Path, settings: Settings, trust_remote_code: bool = False, log: Any = None):
        import inspect

        import torch

        from eagle3_pipeline.runtime.target.devices import pick_device
        from eagle3_pipeline.runtime.target.loading import load_model, load_tokenizer

        self.torch, self.log = torch, log
        device = pick_device(settings.device)
        dtype = None if settings.dtype == "auto" else getattr(torch, settings.dtype)
        self.settings, self.device = settings, device
        self.tokenizer = load_tokenizer(target_dir, trust_remote_code)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = load_model(target_dir, device, dtype, trust_remote_code)
        self.stop_ids = stop_token_ids(self.tokenizer, self.model.generation_config.eos_token_id)
        self.compiled = settings.compile is True or (settings.compile == "auto" and device.startswith("cuda"))
        self.static = self.compiled  # static caches without compiling: what a CPU test checks of the padding
        if self.compiled:
            from transformers.generation import CompileConfig

            config = CompileConfig(dynamic=False)  # one static graph per cache size, not dynamic shapes after a 2nd
            config._compile_all_devices = True  # compile=true on a CPU too (transformers compiles on GPUs only)
            self.model.generation_config.compile_config = config
        # transformers renamed `past_key_values` to `cache` (5.2x)
        parameters = inspect.signature(self.model.forward).parameters
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self.caches: dict[tuple[int, int], Any] = {}  # static caches by (rows, slots)

    def reply(self, prompts: list[Prompt], seeds: list[int]) -> list[Reply | RequestRejected]:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i].token_ids))
        results: list[Reply | RequestRejected] = [RequestRejected("not generated")] * len(prompts)
        for start in range(0, len(order), self.settings.batch_size):
            batch = order[start:start + self.settings.batch_size]
            replies = self._generate([prompts[i].token_ids for i in batch], [seeds[i] for i in batch])
            for index, reply in zip(batch, replies, strict=True):
                results[index] = reply
        return results

    def _generate(self, prompts: list[list[int]], seeds: list[int]) -> list[Reply]:
        count = len(prompts)
        if self.static:  # a full batch: one compiled shape per cache size
            padding = self.settings.batch_size - count
            prompts, seeds = prompts + prompts[-1:] * padding, seeds + seeds[-1:] * padding
        encoded = self.tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt").to(self.device)
        try:
            output = self._decode(encoded, seeds)
        except Exception as exc:
            if not self.compiled:
                raise
            if self.log is not None:
                self.log.warning("compiled generate failed (%s: %s); generating eagerly from now on",
                                 type(exc).__name__, str(exc)[:300])
            self._go_eager()
            return self._generate(prompts[:count], seeds[:count])
        new_tokens = output[:count, encoded["input_ids"].shape[1]:].tolist()
        return [decode_reply(self.tokenizer, tokens, self.stop_ids) for tokens in new_tokens]

    def _go_eager(self) -> None:
        """Eager `generate` with dynamic caches from now on; the static caches' memory goes back (a failure may have
        been running out of it)."""
        self.compiled = self.static = False
        self.caches.clear()
        self.model.generation_config.compile_config = None
        if self.device.startswith("cuda"):
            self.torch.cuda.empty_cache()

    def _decode(self, encoded: Any, seeds: list[int]) -> Any:
        """Greedy `generate` (sampling is the processor's), over a static cache where the engine keeps them."""
        from eagle3_pipeline.runtime.kv_cache import static_size

        torch, settings = self.torch, self.settings
        sampling = [RowSeededSampling(seeds, settings.temperature, settings.top_p)] \
            if settings.temperature > 0 else []
        cache = {}
        with torch.inference_mode():  # (a static cache's tensors are inference tensors: reset them in it too)
            if self.static:  # a cache's batch is its first use's: kept by (rows, slots)
                shape = (encoded["input_ids"].shape[0],
                         static_size(encoded["input_ids"].shape[1] + settings.max_new_tokens))
                if shape not in self.caches:
                    from transformers import StaticCache

                    self.caches[shape] = StaticCache(config=self.model.config, max_cache_len=shape[1])
                self.caches[shape].reset()
                cache = {self.cache_argument: self.caches[shape]}
            return self.model.generate(
                **encoded, **cache, max_new_tokens=settings.max_new_tokens, do_sample=False, temperature=None,
                top_p=None, top_k=None, logits_processor=sampling, pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.stop_ids, disable_compile=not self.compiled)


class RowSeededSampling:
    """A logits processor for greedy `generate` that samples: per row, temperature, top-p (HF's own warper) and
    inverse-CDF sampling with a uniform draw from the row's own generator, returned as logits that allow only the
    drawn token (0 there, -inf elsewhere)."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float):
        import random

        from transformers import TopPLogitsWarper

        self.temperature = temperature
        self.top_p = TopPLogitsWarper(top_p) if top_p < 1 else None
        self.generators = [random.Random(seed) for seed in seeds]

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        scores = scores.float() / self.temperature
        if self.top_p is not None:
            scores = self.top_p(input_ids, scores)
        # float64 sums: the last of 49k+ probabilities must not vanish into the rounding of the total
        cumulative = torch.softmax(scores, dim=-1).double().cumsum(-1)
        uniform = torch.tensor([generator.random() for generator in self.generators], dtype=torch.float64)
        point = uniform.to(scores.device, non_blocking=True)[:, None] * cumulative[:, -1:]
        # right=True: the first token whose cumulative sum passes the point, which has a probability above 0
        drawn = torch.searchsorted(cumulative, point, right=True).clamp_(max=scores.shape[-1] - 1)
        return torch.full_like(scores, float("-inf")).scatter_(-1, drawn, 0.0)
