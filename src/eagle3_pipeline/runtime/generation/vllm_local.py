"""The vLLM engine: vLLM's offline `LLM` in the regenerate job's own process, on the target directory.

Every round's histories go to one `generate` call, which vLLM batches continuously: `batch_size` sequences decode
at once and a finished reply's slot goes to the next history of the round at once (the call itself still ends
with the round's longest reply, so the stage gives this engine a large pool: long rounds). Its prefix cache keeps
the shared start of a conversation's turns. Prompts arrive rendered and tokenized with the chat template the
training data is tokenized with (generation.tokenize_histories), and replies are decoded as the HF engine decodes
them.

Sampling: each reply carries its own seed. vLLM 0.26's model runner for dense targets draws every row's noise in
one kernel from the row's seed and position (its older runner, still used for MoE and hybrid targets, draws
seeded rows one launch each per step), so a reply does not depend on its batch mates' draws. What reproduces: the
same seed and history with the same vLLM release, GPU and dtype; the logits can differ in their last bits with
what else is batched or cached, which at a boundary of the distribution changes a token (as in greedy decoding).

GPU memory: vLLM checks at its start that `gpu_memory_utilization` of the GPU's memory is free. It then sizes its
KV cache by profiling, which counts memory other processes take or free meanwhile as its own: jobs that share a
GPU set `kv_cache_gb`, a KV cache of that size with no profiling.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from eagle3_pipeline.runtime.generation import Prompt, Reply, RequestRejected, Settings, decode_reply, stop_token_ids

MISSING_VLLM = ("regenerate.engine 'vllm' needs the vllm package, which this environment lacks: install vllm (its "
                "torch pin must match the environment's torch; envs/vllm.yaml) or use regenerate.engine 'hf'")


def engine_arguments(target_dir: Path, settings: Settings) -> dict[str, Any]:
    """vLLM's LLM(...) arguments for regeneration: the target directory, the context cap, `batch_size` sequences
    decoding at once, prefix caching, CUDA graphs unless `compile` is false, a KV cache of `kv_cache_gb` if set."""
    return {
        "model": str(target_dir), "tokenizer": str(target_dir), "seed": settings.seed,
        "dtype": "bfloat16" if settings.dtype == "auto" else settings.dtype,  # auto: as the HF engine on a GPU
        "enforce_eager": settings.compile is False, "gpu_memory_utilization": settings.gpu_memory_utilization,
        "max_model_len": settings.max_context_tokens, "max_num_seqs": settings.batch_size,
        "enable_prefix_caching": True,  # a turn's history starts with the previous turn's
        "trust_remote_code": settings.trust_remote_code,
    } | ({"kv_cache_memory_bytes": int(settings.kv_cache_gb * 2**30)} if settings.kv_cache_gb else {})


def configured_stop_ids(target_dir: Path, trust_remote_code: bool) -> int | list[int] | None:
    """The end-of-sequence ids of the target's generation config, or of its model config without one (as HF's
    `from_pretrained` and vLLM read them)."""
    from transformers import AutoConfig, GenerationConfig

    try:
        return GenerationConfig.from_pretrained(target_dir).eos_token_id
    except OSError:  # no generation_config.json
        model_config = AutoConfig.from_pretrained(target_dir, trust_remote_code=trust_remote_code)
        return GenerationConfig.from_model_config(model_config).eos_token_id


class VLLMEngine:
    """vLLM's offline engine on the target directory; one `generate` call per round of histories."""

    def __init__(self, target_dir: Path, settings: Settings, log: logging.Logger | None = None):
        if settings.device != "auto" and not settings.device.startswith("cuda"):
            raise ValueError(f"regenerate.device {settings.device!r}: the vllm engine runs on CUDA GPUs; use "
                             "regenerate.engine 'hf' on a CPU")
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # FlashInfer is optional: torch's sampler
        try:
            from vllm import LLM, SamplingParams
            from vllm.inputs import TokensPrompt
        except ImportError as exc:
            raise RuntimeError(f"{MISSING_VLLM} ({exc})") from None
        from eagle3_pipeline import logs
        from eagle3_pipeline.runtime.target.loading import load_tokenizer

        self.settings, self.log = settings, log or logging.getLogger(__name__)
        self.sampling_params, self.tokens_prompt = SamplingParams, TokensPrompt
        self.tokenizer = load_tokenizer(target_dir, settings.trust_remote_code)
        self.stop_ids = stop_token_ids(self.tokenizer, configured_stop_ids(target_dir, settings.trust_remote_code))
        started = time.perf_counter()
        self.llm = LLM(**engine_arguments(target_dir, settings))
        logs.reattach()  # after vLLM 0.26.0 started (one H100), the job's log file kept only its first line
        self.log.info("engine: vLLM on %s, up to %d sequences at once, %s, %.0f %% of the GPU's memory; started in "
                      "%.1f s", target_dir, settings.batch_size, "eager" if settings.compile is False else
                      "CUDA graphs", 100 * settings.gpu_memory_utilization, time.perf_counter() - started)

    def sampling(self, seed: int) -> Any:
        """One reply's sampling: greedy at temperature 0, else temperature and top-p drawn from its own seed."""
        settings = self.settings
        sampled = settings.temperature > 0
        return self.sampling_params(
            temperature=settings.temperature, top_p=settings.top_p if sampled else 1.0,
            seed=seed if sampled else None, max_tokens=settings.max_new_tokens, stop_token_ids=self.stop_ids,
            detokenize=False)

    def reply(self, prompts: list[Prompt], seeds: list[int]) -> list[Reply | RequestRejected]:
        results: list[Reply | RequestRejected] = []
        requests, params, asked = [], [], []
        for ids, seed in zip((prompt.token_ids for prompt in prompts), seeds, strict=True):
            if len(ids) + self.settings.max_new_tokens > self.settings.max_context_tokens:
                results.append(RequestRejected(f"{len(ids)} prompt tokens + {self.settings.max_new_tokens} new "
                                               f"exceed max_model_len {self.settings.max_context_tokens}"))
                continue
            asked.append(len(results))
            results.append(RequestRejected("not generated"))
            requests.append(self.tokens_prompt(prompt_token_ids=ids))
            params.append(self.sampling(seed))
        if requests:
            for index, output in zip(asked, self.llm.generate(requests, params, use_tqdm=False), strict=True):
                completion = output.outputs[0]
                # (vLLM keeps the stop token in token_ids; decode_reply cuts there)
                results[index] = decode_reply(self.tokenizer, list(completion.token_ids), self.stop_ids)
        return results

    def close(self) -> None:
        """Stop vLLM's engine process and give its GPU memory back (at exit it goes anyway)."""
        self.llm.llm_engine.engine_core.shutdown()
