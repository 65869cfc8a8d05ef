"""The engine check's result: `engine_check/<engine>.json` (rule `engine_check`).

JSON (indent 2): `engine`, `engine_version`, `dtype`, `cuda_graphs`, `tolerance`, `passed`, `failures` (one sentence
each), `start_seconds` {engine: load + compile + capture seconds}, `serve_command`, and `sets` {prompt set:
{`prompts`, `target` {tokens_per_s, output_tokens}, `target_matches_evaluator_share`, `methods` {"eagle3@k=4": {
`engine_acceptance_length`, `evaluator_acceptance_length`, `gap`, `passed`, `judged_on` (the prompts the verdict
rests on: those whose text both decoders agree on, or all), `same_text_prompts`, `engine_acceptance_length_all`,
`evaluator_acceptance_length_all`, `engine_acceptance_by_position`,
`evaluator_acceptance_by_position`, `drafts`, `draft_tokens`, `accepted_tokens`, `tokens_per_s`,
`speedup_vs_target`, `identical_share`, `first_divergence` {prompt id: token index}}}}}.
Acceptance length is vLLM's: 1 + accepted drafts per verify step, computed the same way from the evaluator's traces
(engine_comparison.py).

One engine's run (`<output>.parts/<engine>-<fingerprint>.json`, runtime/serving/vllm_offline.py): `vllm_version`,
`draft_length` (null: the target alone), `start_seconds`, `sets` {prompt set: {`seconds`, `output_tokens`, `tokens`
{prompt id: token ids}, `counters` {drafts, draft_tokens, accepted_tokens, accepted_per_position}, `per_prompt`
{prompt id: counters}}}.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3_pipeline.formats.atomic import atomic_write

METHOD_KEYS = ("engine_acceptance_length", "evaluator_acceptance_length", "gap", "passed", "identical_share",
               "tokens_per_s", "speedup_vs_target")


class InvalidEngineCheck(ValueError):
    pass


def write_engine_run(path: Path, run: dict[str, Any]) -> None:
    atomic_write(Path(path), json.dumps(run))


def read_engine_run(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def write(path: Path, result: dict[str, Any]) -> None:
    atomic_write(Path(path), json.dumps(result, indent=2))


def read(path: Path) -> dict[str, Any]:
    """The result, or InvalidEngineCheck naming the file and what is wrong with it."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidEngineCheck(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(result, dict) or not isinstance(result.get("sets"), dict) or "passed" not in result:
        raise InvalidEngineCheck(f"{path}: not an engine check result (no `sets` or `passed`)")
    for name, values in result["sets"].items():
        for method, figures in values.get("methods", {}).items():
            if missing := [key for key in METHOD_KEYS if key not in figures]:
                raise InvalidEngineCheck(f"{path}: set {name!r}, {method}: no {', '.join(missing)}")
    return result
