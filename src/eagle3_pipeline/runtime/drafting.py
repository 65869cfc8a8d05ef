"""The drafter side of speculative decoding: chain drafts from an EAGLE-3 drafter with its own KV cache, the
untrained baseline, and loading the target runtime with the exported drafters as a server would."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.drafter.attention import DecodeKV, StaticKV
from eagle3_pipeline.drafter.model import Drafter, DrafterConfig
from eagle3_pipeline.formats import serving_dir as serving_format
from eagle3_pipeline.formats.serving_dir import DRAFTER_CONFIG_KEY
from eagle3_pipeline.runtime.decode import TargetRuntime
from eagle3_pipeline.runtime.draft_graph import (
    CapturedCalls,
    CapturedChain,
    cache_key,
    chain_steps,
    split_rows,
    write_rows,
)
from eagle3_pipeline.runtime.kv_cache import static_size

# rows of a prompt written into a drafter's static cache per forward (the target prefills in chunks as wide)
PROMPT_CHUNK = 64


class DrafterProposer:
    """Chain drafts from an EAGLE-3 drafter, keeping its KV cache of real rows across verify steps.

    `static`: the cache is a preallocated StaticKV and the verified rows of a step are padded to k + 1, so the
    chain sees one shape per k. `compiled` (CUDA): that chain is recorded once as a CUDA graph and replayed
    (draft_graph.CapturedChain; `fuse`: of its inductor-compiled kernels). Padding rows sit beyond the last real
    position, where the chain and the next step overwrite them. Static caches are kept per power-of-two size, and
    a sequence takes the smallest that holds it (attention reads every slot), as the target's do. A prompt's rows
    go in chunks of PROMPT_CHUNK rows, the last one padded: one shape whatever the prompt's length."""

    def __init__(self, drafter: Drafter, static: bool = False, compiled: bool = False, log: Any = None,
                 fuse: bool = True):
        self.drafter = drafter.eval()
        self.device = next(drafter.parameters()).device
        self.cache: DecodeKV | StaticKV | None = None
        self.done = 0  # rows (f_t, x_{t+1}) already in the cache
        self.static = static or compiled
        self.static_caches: dict[int, StaticKV] = {}  # by size (slots)
        self.captured = (CapturedChain(drafter, fuse, log) if compiled and self.device.type == "cuda"
                         else None)
        # a prompt's rows, PROMPT_CHUNK at a time: the eager kernels recorded (no compilation to wait for)
        self.captured_writes = CapturedCalls(write_rows, log=log) if self.captured is not None else None
        self.recorded_step: Any = None  # draft_graph.RecordedStep: the device-resident chain step's graphs
        if compiled and self.captured is None and log is not None:
            log.info("drafter chain: eager on %s (CUDA graphs need a GPU)", self.device)
        self.log = log

    def reset(self, rows: int = 0) -> None:
        """A new sequence; `rows`: how many it may reach (static: its cache is taken now, so that a sequence's
        cache size, and the graphs recorded for it, depend on the sequence and not on when it grows)."""
        self.cache, self.done = None, 0
        if self.static and rows:
            self._reserve(rows)

    @torch.inference_mode()
    def __call__(self, context: list[int], features: torch.Tensor, k: int) -> list[int]:
        """context = tokens x_0..x_n (x_n not yet seen by the target); features = f_0..f_{n-1}."""
        drafts, _ = self.chain(context, features, k)
        # One device-to-host copy for the whole chain: a sync per draft token would stall the GPU k times
        # (and, with other processes on the GPU, wait for a time slice each time).
        return drafts.tolist()

    @torch.inference_mode()
    def chain(self, context: list[int], features: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft target ids [k] and the draft-vocab logits [k, K] they were chosen from.

        Positions as served (vLLM `EagleProposer.propose`, SGLang `draft_forward`): real row p (token x_{p+1},
        feature f_p) at position p; the first draft from the last real row (position n-1); chain row i
        (fed draft i) at position n-1+i."""
        integers, hidden = self.real_rows(context, features, k)
        width = hidden.shape[1]
        if self.captured is not None and width == k + 1:
            try:
                return self.captured(integers, hidden, self.cache, k)
            except Exception as exc:  # capture unsupported here: draft eagerly (rows land at their positions)
                if self.log is not None:
                    self.log.warning("drafter chain CUDA graph failed (%s: %s); drafting eagerly",
                                     type(exc).__name__, str(exc)[:300])
                self.captured = None
        ids, positions, last = split_rows(integers, width)
        drafts, logits, self.cache = chain_steps(self.drafter, ids, hidden, positions, last, self.cache, k)
        return drafts, logits  # the chain's rows are speculative: the cache keeps the real rows only

    def real_rows(self, context: list[int], features: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows the drafter has not seen: their ids, positions and the index of the last real one packed in one
        integer tensor (`draft_graph.split_rows`: one host-to-device copy that does not wait for the device), and
        their features [1,W,3H]. With a static cache they come padded to k + 1, the chain's one shape; more than
        that (a prompt's) are first written without drafting (`_write`, in chunks of PROMPT_CHUNK rows), so that the
        chain after a prompt is the recorded one too."""
        n = features.shape[0]
        if self.static:
            prompt = n - self.done > k + 1
            self._reserve(n + (PROMPT_CHUNK if prompt else k))  # the real rows and the chain's, or a padded chunk's
            if prompt:
                self._write(context, features, n - (k + 1))
        new = n - self.done
        integers, hidden = self._packed(context, features, new, k + 1 if self.static else new)
        self.done = n
        return integers, hidden

    def _packed(self, context: list[int], features: torch.Tensor, count: int, width: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The `count` rows after the cached ones, padded to `width` (the last row repeated, at the positions after
        it): their packed integers (`draft_graph.split_rows`) and features [1, width, 3H]."""
        tokens = context[self.done + 1: self.done + count + 1]
        packed = tokens + [tokens[-1]] * (width - count) + list(range(self.done, self.done + width)) + [count - 1]
        integers = torch.tensor(packed).to(self.device, non_blocking=True)
        hidden = features[self.done:self.done + count].to(self.device, self.drafter.fc.weight.dtype)
        if width > count:
            hidden = torch.cat([hidden, hidden[-1:].expand(width - count, -1)])
        return integers, hidden[None]

    def _write(self, context: list[int], features: torch.Tensor, upto: int) -> None:
        """Real rows up to `upto` into the static cache without drafting, PROMPT_CHUNK rows a forward (the last
        chunk padded; its padding lies beyond the real rows, where later rows overwrite it). Every prompt has the
        same shapes: a prompt of a new length pays for no set-up of its own (kernel selection, plans), which an
        eager forward per prompt length did inside the timed decode; on CUDA the chunk replays a CUDA graph."""
        while self.done < upto:
            count = min(PROMPT_CHUNK, upto - self.done)
            integers, hidden = self._packed(context, features, count, PROMPT_CHUNK)
            self._write_chunk(integers, hidden)
            self.done += count

    def _write_chunk(self, integers: torch.Tensor, hidden: torch.Tensor) -> None:
        if self.captured_writes is not None:
            try:
                self.captured_writes(cache_key(self.cache), {"integers": integers, "hidden": hidden},
                                     drafter=self.drafter, cache=self.cache)
                return
            except Exception as exc:  # capture unsupported here: write eagerly (rows land at their positions again)
                if self.log is not None:
                    self.log.warning("drafter prompt rows CUDA graph failed (%s: %s); writing them eagerly",
                                     type(exc).__name__, str(exc)[:300])
                self.captured_writes = None
        write_rows(integers, hidden, self.drafter, self.cache)

    def _reserve(self, rows: int) -> None:
        """A static cache of at least `rows` slots: the sequence's own, or the next size with its rows copied."""
        current = self.cache if isinstance(self.cache, StaticKV) else None
        if current is not None and current.capacity >= rows:
            return
        size = static_size(rows)
        if size not in self.static_caches:
            self.static_caches[size] = StaticKV.empty(self.drafter.config, size, self.device,
                                                      self.drafter.fc.weight.dtype)
        self.cache = self.static_caches[size]
        if current is not None:
            self.cache.keys[:, :, :current.capacity] = current.keys
            self.cache.values[:, :, :current.capacity] = current.values


def untrained_like(drafter: Drafter, seed: int = 0) -> Drafter:
    """The same drafter shape with fresh random weights, sharing the embedding and the vocab mapping."""
    torch.manual_seed(seed)
    untrained = Drafter(drafter.config)
    untrained.load_state_dict({k: v for k, v in drafter.state_dict().items()
                               if k.startswith("embed_tokens") or k in ("d2t", "t2d")}, strict=False)
    return untrained.to(next(drafter.parameters()).device, drafter.fc.weight.dtype).eval()


def load_models(target_dir: Path, serving_dir: Path, device_setting: str, dtype_name: str, untrained_baseline: bool,
                compile_setting: str | bool, trust_remote_code: bool, log: Any, timing_pass: bool = False
                ) -> tuple[TargetRuntime, Any, dict[str, Drafter]]:
    """The target runtime (aux capture; compiled where `evaluate.compile` says), its tokenizer and the drafters,
    all loaded from disk as a server would."""
    from eagle3_pipeline.runtime import decode as runtime
    from eagle3_pipeline.runtime.target.devices import pick_device

    device = pick_device(device_setting)
    dtype = getattr(torch, dtype_name)
    drafter = load_served_for(target_dir, serving_dir, dtype).to(device)
    drafters = {"eagle3": drafter}
    if untrained_baseline:
        drafters["eagle3-untrained"] = untrained_like(drafter)
    target, tokenizer = runtime.load(target_dir, drafter.config.aux_layer_ids, device, dtype, compile_setting,
                                     timing_pass, trust_remote_code, log)
    return target, tokenizer, drafters


def load_served_for(target_dir: Path, serving_dir: Path, dtype: torch.dtype) -> Drafter:
    """An exported drafter with its target's embedding (from the target directory), as a server loads it."""
    from eagle3_pipeline.formats.target_dir import read_head

    embedding, _ = read_head(target_dir)
    return load_served(serving_dir, embedding=embedding.float(), dtype=dtype)


def load_served(directory: Path, embedding: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> Drafter:
    """An exported drafter, loaded as a server would (the embedding comes from the target)."""
    config_json, state = serving_format.read(directory)
    model = Drafter(DrafterConfig(**config_json[DRAFTER_CONFIG_KEY]))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"embed_tokens.weight"}:
        raise ValueError(f"{directory}: missing {missing}, unexpected {unexpected}")
    if embedding is not None:
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embedding)
    return model.to(dtype).eval()
