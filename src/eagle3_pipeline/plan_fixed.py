"""The disk plan's stages that do not scale with tokens: the target copy, the training state and trained
weights, the serving directory, the evaluation results; and the hidden size the plan assumes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_pipeline.plan import FixedStage
from eagle3_pipeline.target_shape import gguf_path, gguf_reader

ADAM_STATE_COPIES = 2  # AdamW keeps exp_avg and exp_avg_sq per trainable weight (fp32)
EVAL_JSON_BYTES_PER_TOKEN = 31  # indent=2 JSON: a token id line plus at most one accepted and one drafted entry
EVAL_JSON_BYTES_PER_TRACE = 400
MTBENCH_QUESTIONS = 80


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def target_copy(target_dir: Path, source: str, gguf_file: str | None, revision: str | None) -> FixedStage:
    """The materialised target: a GGUF dequantised to fp32 safetensors, or a copy of the HF files."""
    from eagle3_pipeline.formats.target_dir import COPIED_FILES, is_materialised

    if is_materialised(target_dir):
        size = directory_bytes(target_dir)
        return FixedStage("target", size, size, "exact")
    gguf = gguf_path(source, gguf_file)
    if gguf is not None:
        elements = sum(int(tensor.n_elements) for tensor in gguf_reader(gguf).tensors)
        return FixedStage("target", 4 * elements, 0, "estimate (GGUF -> fp32)")
    folder = Path(source)
    if not folder.is_dir() and source.count("/") == 1:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(source, "config.json", revision=revision)
        folder = Path(cached).parent if isinstance(cached, str) else folder
    files = {f for pattern in COPIED_FILES for f in folder.glob(pattern)} if folder.is_dir() else set()
    if not any(f.suffix == ".safetensors" for f in files):
        return FixedStage("target", None, 0, "unknown (not local)")
    return FixedStage("target", sum(f.stat().st_size for f in files), 0, "copy of the source files")


def drafter_parameters(dims: dict[str, int], draft_vocab_size: int) -> int:
    """Trainable drafter weights: fc, one decoder layer (attention input 2H), norms, lm_head over the draft vocab."""
    h, d = dims["hidden_size"], dims["head_dim"]
    return (3 * h * h + 2 * h * (dims["heads"] + 2 * dims["kv_heads"]) * d + dims["heads"] * d * h
            + 3 * h * dims["intermediate_size"] + 4 * h + h * draft_vocab_size)


def with_drafter_width(dims: dict[str, int] | None, intermediate_size: int | None) -> dict[str, int] | None:
    """The target's shape with the drafter's MLP width where `train.drafter_intermediate_size` sets one."""
    return dims | {"intermediate_size": intermediate_size} if dims and intermediate_size else dims


def assumed_dims(hidden_size: int, vocab_size: int) -> dict[str, int]:
    """A shape from the hidden size alone, on the large side: full multi-head attention, MLP width 4H."""
    return {"hidden_size": hidden_size, "num_layers": 0, "intermediate_size": 4 * hidden_size, "heads": 1,
            "kv_heads": 1, "head_dim": hidden_size, "vocab_size": vocab_size}


def drafter_stages(dims: dict[str, int] | None, draft_vocab_size: int, export_dtype: str,
                   train_weights: Path, serving_dir: Path, hidden_size: int | None = None) -> list[FixedStage]:
    """train: the fp32 checkpoint in train_state (weights + AdamW moments) plus the trained weights;
    serving: the export in its dtype. d2t (int64 [K]) and t2d (bool [V]) ride along in each.
    Without the target's shape, `hidden_size` (plan.target_hidden_size) gives a rough upper bound."""
    source = "estimate"
    if dims is None and hidden_size:
        dims, source = assumed_dims(hidden_size, draft_vocab_size), "rough (hidden size only)"
    if dims is None:
        return [FixedStage("train", None, 0, "unknown (target shape)"),
                FixedStage("serving", None, 0, "unknown (target shape)")]
    k = min(draft_vocab_size, dims["vocab_size"])
    parameters, vocab_maps = drafter_parameters(dims, k), 8 * k + dims["vocab_size"]
    train = (4 * (1 + ADAM_STATE_COPIES) * parameters + vocab_maps) + (4 * parameters + vocab_maps)
    export = (4 if export_dtype == "float32" else 2) * parameters + vocab_maps
    trained = Path(train_weights).is_file()
    return [FixedStage("train", train, train if trained else 0, f"{source} (checkpoint + weights)"),
            FixedStage("serving", export, export if Path(serving_dir).is_dir() else 0, source)]


def prompt_count(name: str, prompt_file: str | None, evaluate: dict[str, Any], data: dict[str, Any]) -> int:
    if name == "held-out":
        count = data.get("eval_conversations", 0)
    elif name == "mtbench-package":
        count = MTBENCH_QUESTIONS * (2 if evaluate.get("multi_turn") else 1)
    elif prompt_file and Path(prompt_file).is_file():
        with open(prompt_file, "rb") as handle:
            count = sum(1 for line in handle if line.strip())
    else:
        count = 0
    return min(count, evaluate["max_prompts"]) if evaluate.get("max_prompts") else count


def evaluation_stage(prompt_sets: dict[str, str | None], results: dict[str, Path], evaluate: dict[str, Any],
                     data: dict[str, Any]) -> FixedStage:
    """An upper bound: every method's trace of every prompt at max_new_tokens, in indented JSON."""
    draft_lengths = len(evaluate["draft_lengths"])
    methods = 2 + draft_lengths * (2 if evaluate.get("untrained_baseline", True) else 1)
    per_prompt = methods * (evaluate["max_new_tokens"] * EVAL_JSON_BYTES_PER_TOKEN + EVAL_JSON_BYTES_PER_TRACE)
    total = done = 0
    for name, prompt_file in prompt_sets.items():
        size = prompt_count(name, prompt_file, evaluate, data) * per_prompt
        total += size
        done += size if Path(results[name]).is_file() else 0
    return FixedStage("evaluation", total, done, "upper bound")


def planned_hidden_size(dims: dict[str, int] | None, configured: int | None, source: str
                        ) -> tuple[int | None, list[str]]:
    """The hidden size to plan with, and warnings: a configured size that the target's config overrides,
    or none at all (the hidden stage, the largest by far, cannot be planned)."""
    if dims is not None:
        if configured and configured != dims["hidden_size"]:
            return dims["hidden_size"], [f"plan.target_hidden_size ({configured}) is ignored: the target's config "
                                         f"says hidden_size {dims['hidden_size']}"]
        return dims["hidden_size"], []
    if configured:
        return configured, []
    return None, [f"the hidden stage is NOT in this plan: the hidden size of {source!r} is unknown (not local). "
                  f"Set plan.target_hidden_size, or materialise the target first; a real run that extracts "
                  f"refuses to start without it"]
