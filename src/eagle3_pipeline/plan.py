"""The disk plan: how many bytes each stage will write, against the free space where results live.

Token counts are exact where token shards exist and estimated otherwise (from the normalized
conversation shards, else from the raw inputs); the plan says which. Stages whose size does not grow
with tokens (the target copy, training state and weights, the export, evaluation results) are sized
from the target's shape. `snakemake -n` prints it before the job table; a real run refuses to start
when the stages it will run do not fit, or when it would extract hidden states of unknown size
(see rules/common.smk).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

STAGE_RULES = {"tokens": "tokenize", "hidden": "extract", "target": "target", "train": "train",
               "serving": "export", "evaluation": "evaluate"}  # which rule writes each stage's bytes
ADAM_STATE_COPIES = 2  # AdamW keeps exp_avg and exp_avg_sq per trainable weight (fp32)
EVAL_JSON_BYTES_PER_TOKEN = 31  # indent=2 JSON: a token id line plus at most one accepted and one drafted entry
EVAL_JSON_BYTES_PER_TRACE = 400
MTBENCH_QUESTIONS = 80
CHARS_PER_TOKEN = 4.1  # measured: ShareGPT V3 under SmolLM2's tokenizer, 400 conversations (docs/ARCHITECTURE.md)
TEMPLATE_TOKENS_PER_TURN = 5  # role header and end-of-turn markers


@dataclass
class ShardPlan:
    name: str
    tokens: int
    exact: bool
    exists: bool = False


@dataclass
class StagePlan:
    stage: str
    raw_bytes_per_token: float
    expected_bytes_per_token: float
    shards: list[ShardPlan] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def total_bytes(self) -> int:
        return int(self.tokens * self.expected_bytes_per_token)

    @property
    def pending_bytes(self) -> int:
        return int(sum(s.tokens for s in self.shards if not s.exists) * self.expected_bytes_per_token)

    def shard_bytes(self, name: str) -> int:
        shard = next(s for s in self.shards if s.name == name)
        return int(shard.tokens * self.expected_bytes_per_token)

    @property
    def source(self) -> str:
        kinds = {s.exact for s in self.shards}
        return "exact" if kinds == {True} else "estimate" if kinds == {False} else "exact+estimate"


def hidden_bytes_per_token(hidden_size: int, compression: float) -> tuple[float, float]:
    """(raw, expected on disk) bytes per token of a hidden-state store: its row size (formats/hidden_store:
    4 bf16 vectors + id + mask), and on disk the hidden arrays compressed plus each chunk's crc32c."""
    from eagle3_pipeline.formats import hidden_store

    hidden, tokens = hidden_store.hidden_row_bytes(hidden_size), hidden_store.TOKEN_ROW_BYTES
    raw = hidden + tokens
    return raw, hidden / compression + tokens / 2 + hidden_store.checksum_bytes_per_row(hidden_size)


def human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(count) < 1000 or unit == "PB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1000
    return f"{count:.1f} PB"


def free_bytes(path: Path) -> int:
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


# ---------------------------------------------------------------- token counts

def conversation_tokens(conversation: dict[str, Any], max_seq_len: int) -> int:
    chars = sum(len(m["content"]) for m in conversation["messages"])
    estimate = chars / CHARS_PER_TOKEN + TEMPLATE_TOKENS_PER_TURN * (len(conversation["messages"]) + 1)
    return int(min(estimate, max_seq_len))


def estimate_from_conversations(path: Path, max_seq_len: int) -> int:
    with open(path, encoding="utf-8") as handle:
        return sum(conversation_tokens(json.loads(line), max_seq_len) for line in handle if line.strip())


def estimate_from_raw(inputs: list[Path], train_conversations: int | None, num_shards: int,
                      max_seq_len: int) -> int:
    """Rough tokens per shard from raw file sizes (no parsing: this runs at parse time)."""
    total_bytes = sum(p.stat().st_size for p in inputs)
    records = 0
    for path in inputs:
        data = path.read_bytes()
        records += data.count(b'"conversations"') + data.count(b'"messages"')
    records = max(records, 1)
    per_conversation = min(total_bytes / records / CHARS_PER_TOKEN, max_seq_len)
    conversations = min(train_conversations or records, records)
    return int(per_conversation * conversations / num_shards)


def shard_token_counts(shard_names: list[str], token_shard: str, conversation_shard: str,
                       inputs: list[Path], data: dict[str, Any]) -> list[ShardPlan]:
    from eagle3_pipeline.formats import token_shards

    plans, raw_estimate = [], None
    for name in shard_names:
        shard_path = Path(token_shard.format(shard=name))
        conversation_path = Path(conversation_shard.format(shard=name))
        if shard_path.is_dir():
            try:
                attrs = token_shards.validate(shard_path)
                plans.append(ShardPlan(name, int(attrs["num_tokens"]), exact=True))
                continue
            except token_shards.InvalidTokenShard:
                pass
        if conversation_path.is_file():
            plans.append(ShardPlan(name, estimate_from_conversations(conversation_path, data["max_seq_len"]), False))
            continue
        if raw_estimate is None:
            raw_estimate = estimate_from_raw(inputs, data.get("train_conversations"), data["num_shards"],
                                             data["max_seq_len"])
        plans.append(ShardPlan(name, raw_estimate, exact=False))
    return plans


# ---------------------------------------------------------------- the plan

@dataclass
class FixedStage:
    """A stage whose bytes do not scale with tokens; `total_bytes` None when they cannot be known yet."""

    stage: str
    total_bytes: int | None
    done_bytes: int  # the part already written (outputs that exist)
    source: str

    @property
    def pending_bytes(self) -> int:
        return 0 if self.total_bytes is None else max(self.total_bytes - self.done_bytes, 0)


@dataclass
class DiskPlan:
    stages: list[StagePlan]
    results_dir: Path
    free: int
    fixed: list[FixedStage] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    hidden_size_unknown: bool = False

    def _needed(self, stage: str, rules: set[str] | None) -> bool:
        return rules is None or STAGE_RULES[stage] in rules

    def pending_for(self, rules: set[str] | None = None) -> int:
        """Bytes still to write by the stages whose rules will run (all stages when `rules` is None)."""
        return sum(s.pending_bytes for s in [*self.stages, *self.fixed] if self._needed(s.stage, rules))

    @property
    def pending(self) -> int:
        return self.pending_for(None)

    def fits_for(self, rules: set[str] | None = None) -> bool:
        return self.pending_for(rules) <= self.free

    @property
    def fits(self) -> bool:
        return self.fits_for(None)

    def blind_for(self, rules: set[str] | None = None) -> bool:
        """True when extraction will run but the hidden stage could not be sized."""
        return self.hidden_size_unknown and self._needed("hidden", rules)

    def lines(self, rules: set[str] | None = None) -> list[str]:
        out = ["Disk plan (bytes to be written; tokens exact where token shards exist):",
               f"  {'stage':<10} {'tokens':>14} {'raw B/tok':>10} {'disk B/tok':>10} {'per shard':>11} "
               f"{'total':>11} {'to write':>11}  source"]
        for stage in self.stages:
            per_shard = stage.total_bytes / max(len(stage.shards), 1)
            pending = human_bytes(stage.pending_bytes) if self._needed(stage.stage, rules) else "not run"
            out.append(f"  {stage.stage:<10} {stage.tokens:>14,} {stage.raw_bytes_per_token:>10.1f} "
                       f"{stage.expected_bytes_per_token:>10.1f} {human_bytes(per_shard):>11} "
                       f"{human_bytes(stage.total_bytes):>11} {pending:>11}  {stage.source}")
        for item in self.fixed:
            total = human_bytes(item.total_bytes) if item.total_bytes is not None else "unknown"
            pending = human_bytes(item.pending_bytes) if self._needed(item.stage, rules) else "not run"
            out.append(f"  {item.stage:<10} {'-':>14} {'-':>10} {'-':>10} {'-':>11} {total:>11} {pending:>11}"
                       f"  {item.source}")
        verdict = "fits" if self.fits_for(rules) else "DOES NOT FIT"
        scope = "" if rules is None else " (stages this run needs)"
        out.append(f"  free space under {self.results_dir}: {human_bytes(self.free)}; to write{scope}: "
                   f"{human_bytes(self.pending_for(rules))} -> {verdict}")
        out += [f"  WARNING: {warning}" for warning in self.warnings]
        return out


def build(shard_names: list[str], paths: dict[str, str], inputs: list[Path], data: dict[str, Any],
          hidden_size: int | None, compression: float, results_dir: Path,
          fixed: list[FixedStage] | None = None, warnings: list[str] | None = None) -> DiskPlan:
    from eagle3_pipeline.formats.token_shards import BYTES_PER_TOKEN

    counts = shard_token_counts(shard_names, paths["token_shard"], paths["conversation_shard"], inputs, data)
    tokens = StagePlan("tokens", BYTES_PER_TOKEN, BYTES_PER_TOKEN / 2,
                       [ShardPlan(c.name, c.tokens, c.exact, Path(paths["token_shard"].format(shard=c.name)).exists())
                        for c in counts])
    stages = [tokens]
    if hidden_size:
        raw, expected = hidden_bytes_per_token(hidden_size, compression)
        stages.append(StagePlan("hidden", raw, expected,
                                [ShardPlan(c.name, c.tokens, c.exact,
                                           Path(paths["hidden_store"].format(shard=c.name)).exists())
                                 for c in counts]))
    return DiskPlan(stages, results_dir, free_bytes(results_dir), fixed or [], warnings or [],
                    hidden_size_unknown=not hidden_size)


def target_config(target_dir: Path, source: str, revision: str | None) -> dict[str, Any] | None:
    """The target's config.json: materialised copy, else the source directory, else the local HF cache."""
    from eagle3_pipeline.formats.target_dir import read_config

    for directory in (Path(target_dir), Path(source)):
        config = read_config(directory)
        if config is not None:
            return config
    if source.count("/") == 1 and not Path(source).exists():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(source, "config.json", revision=revision)
        if isinstance(cached, str):
            return json.loads(Path(cached).read_text())
    return None


@lru_cache(maxsize=4)
def gguf_reader(path: Path) -> Any:
    """One parse of a GGUF header per process (seconds for a big file): the plan and the family check share it."""
    from gguf import GGUFReader

    return GGUFReader(str(path))


def gguf_path(source: str, gguf_file: str | None) -> Path | None:
    path = Path(source) / gguf_file if gguf_file else Path(source)
    return path if path.suffix == ".gguf" and path.is_file() else None


def target_dims(target_dir: Path, source: str, gguf_file: str | None = None,
                revision: str | None = None) -> dict[str, int] | None:
    """The target's shape (hidden size, layers, MLP width, heads, vocab) or None when nothing local says."""
    config = target_config(target_dir, source, revision)
    if config is not None:
        config = config.get("text_config", config)
        heads = int(config["num_attention_heads"])
        return {"hidden_size": int(config["hidden_size"]), "num_layers": int(config["num_hidden_layers"]),
                "intermediate_size": int(config.get("intermediate_size") or 4 * config["hidden_size"]),
                "heads": heads, "kv_heads": int(config.get("num_key_value_heads") or heads),
                "head_dim": int(config.get("head_dim") or config["hidden_size"] // heads),
                "vocab_size": int(config["vocab_size"])}
    gguf = gguf_path(source, gguf_file)
    if gguf is None:
        return None
    reader = gguf_reader(gguf)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def field_value(key: str) -> int:
        return int(reader.fields[f"{arch}.{key}"].parts[-1][0])

    hidden, heads = field_value("embedding_length"), field_value("attention.head_count")
    return {"hidden_size": hidden, "num_layers": field_value("block_count"),
            "intermediate_size": field_value("feed_forward_length"), "heads": heads,
            "kv_heads": field_value("attention.head_count_kv"), "head_dim": hidden // heads,
            "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data)}


def target_shape(target_dir: Path, source: str, gguf_file: str | None = None) -> tuple[int, int] | None:
    """(hidden_size, num_layers) from the materialised target, else from the source, else None."""
    dims = target_dims(target_dir, source, gguf_file)
    return (dims["hidden_size"], dims["num_layers"]) if dims else None


# ---------------------------------------------------------------- stages that do not scale with tokens

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
