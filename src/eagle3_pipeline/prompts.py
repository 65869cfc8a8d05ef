"""Evaluation prompts: MT-bench questions, held-out conversations, {"id", "prompt"} lines, HumanEval problems."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Prompt:
    prompt_id: str
    messages: list[dict[str, str]]


def load_prompts(path: Path, limit: int | None, multi_turn: bool = False) -> list[Prompt]:
    """MT-bench `question.jsonl` (turns), held-out conversations (messages), {"id", "prompt"} lines or HumanEval
    problems ({"task_id", "prompt"}: a Python signature and docstring to complete); gzipped when *.gz."""
    prompts = []
    opener = gzip.open if Path(path).suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for index, line in enumerate(handle):
            if not line.strip():
                continue
            record = json.loads(line)
            prompt_id = str(record.get("question_id", record.get("id", index)))
            if "turns" in record:
                turns = record["turns"] if multi_turn else record["turns"][:1]
                prompts.append(Prompt(prompt_id, [{"role": "user", "content": t} for t in turns]))
            elif "messages" in record:
                messages = record["messages"]
                first_reply = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
                prompts.append(Prompt(prompt_id, messages[:first_reply]))
            elif "task_id" in record and "prompt" in record:
                prompt_id = str(record["task_id"])
                content = f"Complete this Python function.\n\n```python\n{record['prompt']}```"
                prompts.append(Prompt(prompt_id, [{"role": "user", "content": content}]))
            elif "prompt" in record:
                prompts.append(Prompt(prompt_id, [{"role": "user", "content": record["prompt"]}]))
            else:
                raise ValueError(f"{path} line {index + 1}: no 'turns', 'messages' or 'prompt'")
            if limit and len(prompts) >= limit:
                break
    return prompts
