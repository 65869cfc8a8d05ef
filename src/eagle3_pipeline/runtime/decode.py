"""The target at decode time: loading with the device/dtype policy, aux-layer capture, its KV cache and step.

Two modes:
- eager (the CPU default): a growing `DynamicCache`, every forward as it comes;
- static (`evaluate.compile` on; `auto` = the timing pass on CUDA): preallocated transformers `StaticCache`s, one
  per power-of-two size, each reused by every sequence that fits it, and the 1-, (k+1)- and 64-token steps through
  `torch.compile(mode="reduce-overhead")`, which captures them in CUDA graphs (one per width and size). Attention
  over a static cache reads every slot, so a sequence uses the smallest size that holds it: a cache sized for the
  longest prompt would make every short one pay for its length, as a server's paged cache does not. Shorter
  inputs are padded to the next compiled width (the padding rows' keys land beyond the sequence, where the
  causal mask hides them until real rows overwrite them), so each width is captured once per size. A prompt
  goes in chunks of the prefill width (64), the last one padded like a step; it attends through target_attention.py.
Where compilation fails the runtime logs why and continues eagerly.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from eagle3_pipeline.runtime import target_attention
from eagle3_pipeline.runtime.compilation import claim_for_compilation, compile_decision
from eagle3_pipeline.runtime.kv_cache import (
    SMALLEST_CACHE,
    has_sliding_layers,
    remove_last_rows,
    rewind,
    row_tensors,
    static_size,
)


class TargetRuntime:
    """`forward(tokens, cache)` -> logits [n, V] and aux features [n, 3H] of `tokens` appended to `cache`."""

    def __init__(self, model: torch.nn.Module, aux_layer_ids: list[int], static: bool = False,
                 compiled: bool = False, log: Any = None, attention: str | None = None):
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.log = log
        # transformers renamed `past_key_values` to `cache` (5.2x; the old name goes in 5.40)
        parameters = inspect.signature(model.forward).parameters
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self.last_logits = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}  # prefill: one row's head
        layers = model.get_decoder().layers
        self.captured: dict[int, torch.Tensor] = {}
        self.aux_count = len(aux_layer_ids)
        for slot, index in enumerate(aux_layer_ids):
            layers[index - 1].register_forward_hook(self._hook(slot))
        if (static or compiled) and has_sliding_layers(model):
            if log is not None:  # a rolling window cannot be rewound past rejected drafts
                log.warning("target has sliding-window layers: its static cache cannot drop rejected drafts; "
                            "decoding eagerly with a dynamic cache")
            static = compiled = False
        self.static = static or compiled
        self.attention = attention or target_attention.default(model, self.static)  # set before each forward
        self.static_caches: dict[int, Any] = {}  # by size (slots)
        self.smallest_cache = SMALLEST_CACHE  # a benchmark raises it to show what one long cache costs
        # a prompt is prefilled in chunks of this many tokens: a few captured steps instead of an eager forward,
        # whose ~30 ms of kernel launches would weigh in every method's time as no server's prefill does
        self.prefill_width = 64
        self.widths: list[int] = [1, self.prefill_width]  # input lengths the static step pads to (and compiles for)
        self.headroom = self.prefill_width  # rows the widest step writes beyond a sequence's tokens
        self.step = None
        self.tree_step_failed = False  # compiling the tree verify failed: trees verify eagerly, chains stay compiled
        # successful compiled calls by (what, width, cache slots): CUDA-graph trees warm up on a shape's first call
        # and record on its second, so a shape that ran three times is past compilation and capture
        self.shape_calls: dict[tuple[str, int, int], int] = {}
        # the decoding loop with its state on the device (pipelined.py): the compiled runtime's; a benchmark turns
        # it off to time the host loop on the same runtime
        self.device_loops = compiled
        # draft trees in those loops too (off: trees in the host loop, chains and the target alone on the device)
        self.device_trees = True
        if compiled:
            claim_for_compilation(model)
            # one graph per (width, cache size, model): more than dynamo's default of 8 in one evaluation
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            self.step = torch.compile(model.forward, mode="reduce-overhead", dynamic=False)

    @property
    def compiled(self) -> bool:
        return self.step is not None

    def _hook(self, slot: int):
        def capture(_module, _inputs, output):
            self.captured[slot] = output[0] if isinstance(output, tuple) else output
        return capture

    def prepare(self, draft_lengths: list[int], tree_rows: list[int] | tuple[int, ...] = ()) -> None:
        """Verify widths to expect: k + 1 for every draft length k (the compiled widths), and the rows a tree's step
        writes beyond a sequence (`TreeSetting.rows_ahead`): together the room a cache keeps beyond a sequence."""
        self.widths = sorted({1, *(k + 1 for k in draft_lengths), self.prefill_width})
        self.headroom = max([*self.widths, *tree_rows])

    @torch.inference_mode()  # the cache's tensors are inference tensors: update them only in inference mode
    def new_cache(self, tokens: int) -> Any:
        """An empty KV cache for a sequence of at most `tokens` tokens, prompt and new ones (static: the reused
        cache of `cache_size(tokens)` slots)."""
        if not self.static:
            from transformers import DynamicCache

            return DynamicCache()
        size = self.cache_size(tokens)
        if size not in self.static_caches:
            from transformers import StaticCache

            self.static_caches[size] = StaticCache(config=self.model.config, max_cache_len=size)
        cache = self.static_caches[size]
        cache.reset()
        return cache

    def cache_size(self, tokens: int) -> int:
        """Slots of the static cache a sequence of at most `tokens` tokens decodes in (every method on a prompt
        gets the same): room for its widest last step, rounded up to a power of two (few sizes, few graphs)."""
        return static_size(tokens + self.headroom, self.smallest_cache)

    @torch.inference_mode()
    def forward(self, tokens: list[int], cache: Any, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.static:  # last_only (a prefill reads the last row's logits): the LM head runs on that row alone
            return self._run(self.model.forward, tokens, cache, **(self.last_logits if last_only else {}))
        widest = self.widths[-1]  # a prompt goes in chunks of the prefill width
        if len(tokens) <= widest:
            return self._static_step(tokens, cache)
        parts = [self._static_step(tokens[start:start + widest], cache) for start in range(0, len(tokens), widest)]
        return torch.cat([logits for logits, _ in parts]), torch.cat([aux for _, aux in parts])

    def _static_step(self, tokens: list[int], cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """At most the widest width of tokens, padded to the next width (compiled: its captured graph)."""
        n = len(tokens)
        width = next(w for w in self.widths if w >= n)
        padded = tokens + [tokens[-1]] * (width - n)
        logits, aux, replayed = self._step(padded, cache)
        # CUDA-graph outputs are overwritten by the next replay: keep copies of the rows asked for
        logits, aux = (logits[:n].clone(), aux[:n].clone()) if replayed else (logits[:n], aux[:n])
        if width > n:
            remove_last_rows(cache, width - n)  # forget the padding rows
        return logits, aux

    def _through_step(self, padded: list[int] | torch.Tensor, cache: Any, what: str, **inputs: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """`padded` through the compiled step: (logits, aux, failed). Where it raises (no Triton, an unsupported op,
        a compiler error, a failed capture) the cache goes back to its length before the call - a failure past the
        first layers has advanced some of them - and the tokens run eagerly. Compilation and capture happen in a
        shape's first two calls: after three, its length is not read before the call (a read waits for the
        device, which the device-resident loops never do) and a failure is raised."""
        shape = (what, len(padded[0]) if isinstance(padded, torch.Tensor) else len(padded), cache.get_max_length())
        proven = self.shape_calls.get(shape, 0) >= 3
        before = None if proven else int(cache.get_seq_length())
        # the last step's outputs were copied out: a new CUDA-graph-tree generation may reuse their memory
        # (without this, alternating with other graphs records new tree paths instead of replaying)
        torch.compiler.cudagraph_mark_step_begin()
        try:
            outputs = self._run(self.step, padded, cache, **inputs)
        except Exception as exc:
            if before is None:
                raise  # a shape past its compilation and capture: a real failure
            if self.log is not None:
                self.log.warning("compiled %s failed (%s: %s); running it eagerly", what, type(exc).__name__,
                                 str(exc)[:300])
            rewind(cache, before)
            return *self._run(self.model.forward, padded, cache, **inputs), True
        self.shape_calls[shape] = self.shape_calls.get(shape, 0) + 1
        return *outputs, False

    @torch.inference_mode()
    def forward_device(self, ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids already on the device ([1, W], W a compiled width) through the step, reading nothing back: the
        device-resident loops' step. The outputs may be a captured graph's: consume them before the next call."""
        logits, aux, _ = self._step(ids, cache)
        return logits, aux

    def _step(self, padded: list[int] | torch.Tensor, cache: Any) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """A compiled width of tokens through the compiled step where there is one (True: its outputs are the next
        replay's), else eagerly; a failed compilation leaves the runtime eager."""
        # a new cache allocates its tensors on first use: eagerly, so transformers marks them static addresses
        # (inside a compiled step it cannot, and CUDA graphs are skipped for the mutated cache)
        if self.step is None or not all(getattr(layer, "is_initialized", True) for layer in cache.layers):
            return *self._run(self.model.forward, padded, cache), False
        logits, aux, failed = self._through_step(padded, cache, "target step")
        if failed:
            self.step = None
        return logits, aux, True

    def _run(self, forward: Any, tokens: list[int] | torch.Tensor, cache: Any, **inputs: Any
             ) -> tuple[torch.Tensor, torch.Tensor]:
        ids = tokens if isinstance(tokens, torch.Tensor) else torch.tensor([tokens], device=self.device)
        target_attention.use(self.model, self.attention)
        output = forward(input_ids=ids, use_cache=True, **inputs, **{self.cache_argument: cache})
        aux = torch.cat([self.captured[s][0] for s in range(self.aux_count)], dim=-1)
        return output.logits[0], aux

    @torch.inference_mode()
    def forward_tree(self, tokens: list[int], positions: list[int], visible: torch.Tensor, cache: Any,
                     width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A draft tree in one forward: `tokens` at rotary `positions`, written after the cached rows (a static
        cache: slots n..n+T-1), token i attending to every cached row and to the tokens j with `visible[i, j]`
        (its ancestors and itself). The mask goes in as an additive float [1, 1, q, keys] (keys: cached + q, or a
        static cache's capacity), which transformers 5.x passes through unchanged (a 4D mask counts as prepared)
        and which both the sdpa and the eager attention add to their scores.

        A static cache pads a tree to `width` rows (one shape per tree setting; drafted trees always fill it, the
        padding serves smaller ones: each padding row sees the cached rows and itself, at positions after the
        tree's, and `keep_rows` drops it with the rejected rows) and runs the compiled step where there is one:
        ids, positions and mask are its tensor inputs, so each (width, cache) is captured once, as `forward`'s
        widths are."""
        count = len(tokens)
        width = max(width or count, count) if self.static else count
        inputs = self._tree_inputs(tokens, positions, visible, cache, width)
        ids = torch.tensor([tokens + [tokens[-1]] * (width - count)], device=self.device)
        replayed = self.step is not None and not self.tree_step_failed
        logits, aux = self.forward_tree_device(ids, inputs["position_ids"], inputs["attention_mask"], cache)
        # a CUDA graph's outputs are the next replay's: keep copies of the tree's rows
        return (logits[:count].clone(), aux[:count].clone()) if replayed else (logits[:count], aux[:count])

    @torch.inference_mode()
    def forward_tree_device(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """A draft tree already on the device (ids and positions [1, T], its additive mask [1, 1, T, slots]: the
        device-resident loop's tree, device_tree.TreeState; `forward_tree`'s, made from lists) through the compiled
        tree verify where there is one, reading nothing back. The outputs may be a captured graph's: consume them
        before the next call."""
        inputs = {"position_ids": positions, "attention_mask": mask}
        if self.step is None or self.tree_step_failed:
            return self._run(self.model.forward, ids, cache, **inputs)
        logits, aux, failed = self._through_step(ids, cache, "tree verify", **inputs)
        self.tree_step_failed = failed  # trees verify eagerly from now on, the chain's steps stay compiled
        return logits, aux

    def _tree_inputs(self, tokens: list[int], positions: list[int], visible: torch.Tensor, cache: Any,
                     width: int) -> dict[str, torch.Tensor]:
        """position_ids [1, width] and the additive mask [1, 1, width, keys] of a tree padded to `width` rows."""
        cached, count = int(cache.get_seq_length()), len(tokens)
        keys = int(cache.get_max_length()) if self.static else cached + width
        after = max(positions) + 1
        position_ids = torch.tensor([positions + list(range(after, after + width - count))], device=self.device)
        visible_rows = torch.eye(width, dtype=torch.bool, device=self.device)  # a padding row sees itself
        visible_rows[:count, :count] = visible.to(self.device)
        dtype = self.model.get_input_embeddings().weight.dtype
        mask = target_attention.tree_mask(torch.tensor(cached, device=self.device), visible_rows, keys, dtype)
        return {"position_ids": position_ids, "attention_mask": mask}

    @torch.inference_mode()
    def keep_rows(self, cache: Any, rows: list[int]) -> None:
        """Keep only the cached rows at indices `rows` (ascending), in that order: after a tree verify, the prefix
        and the accepted path. A dynamic cache gathers each layer's keys and values (every transformers 5.x); a
        static one copies the moved rows down in place (addresses stay: CUDA graphs) and rewinds its length."""
        start = next((i for i, row in enumerate(rows) if row != i), len(rows))  # rows before stay where they are
        if start == len(rows):
            self.crop(cache, len(rows))
            return
        moved = torch.tensor(rows[start:], device=self.device)
        if not self.static:
            for layer in cache.layers:
                layer.keys = torch.cat([layer.keys[..., :start, :], layer.keys.index_select(-2, moved)], dim=-2)
                layer.values = torch.cat([layer.values[..., :start, :], layer.values.index_select(-2, moved)], dim=-2)
            return
        slots = torch.arange(start, len(rows), device=self.device)
        for tensor in row_tensors(cache):  # every layer's keys and values
            tensor.index_copy_(-2, slots, tensor.index_select(-2, moved))
        self.crop(cache, len(rows))

    @torch.inference_mode()
    def forget(self, cache: Any, count: int) -> None:
        """Drop the last `count` rows (rejected drafts), counted by the caller: no read of the cache's length,
        which on a GPU waits for the device."""
        if count > 0:
            remove_last_rows(cache, count)

    @torch.inference_mode()
    def crop(self, cache: Any, keep: int) -> None:
        """Drop rejected rows. A negative argument means 'remove this many' in every transformers version."""
        self.forget(cache, int(cache.get_seq_length()) - keep)


def load(target_dir: Any, aux_layer_ids: list[int], device: str, dtype: torch.dtype, compile_setting: str | bool,
         timing_pass: bool, trust_remote_code: bool, log: Any) -> tuple[TargetRuntime, Any]:
    """The target (device and dtype as asked, aux capture, compiled where it should be) and its tokenizer."""
    from eagle3_pipeline.runtime.target import loading

    tokenizer = loading.load_tokenizer(target_dir, trust_remote_code)
    model = loading.load_model(target_dir, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    compiled, why = compile_decision(compile_setting, device, timing_pass)
    log.info("target step: %s (%s)", "compiled, static KV cache" if compiled else "eager", why)
    return TargetRuntime(model, aux_layer_ids, compiled=compiled, log=log), tokenizer
