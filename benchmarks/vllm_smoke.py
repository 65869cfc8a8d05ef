"""vLLM on a run's target alone, two short prompts, CUDA graphs on: checks the staged vLLM imports, loads the
target directory and runs (while the rest of the run is still preparing its data).
Usage: python benchmarks/vllm_smoke.py results/<run>/target"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from eagle3_pipeline.runtime.serving import vllm_offline


def main(target_dir: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = [{"prompt_id": str(i), "ids": tokenizer(text)["input_ids"]}
               for i, text in enumerate(["The capital of France is", "def fibonacci(n):"])]
    job = {"target_dir": target_dir, "serving_dir": None, "dtype": "bfloat16", "cuda_graphs": True,
           "gpu_memory_utilization": 0.2, "max_model_len": 512, "max_new_tokens": 16, "trust_remote_code": False,
           "draft_length": None, "sets": {"smoke": prompts}}
    with tempfile.TemporaryDirectory() as scratch:
        job_path = Path(scratch) / "job.json"
        job_path.write_text(json.dumps(job))
        result = vllm_offline.run(json.loads(job_path.read_text()))
    print(json.dumps({key: value for key, value in result.items() if key != "sets"}), result["sets"]["smoke"]["tokens"])


if __name__ == "__main__":
    main(sys.argv[1])
