"""Rule `engine_check`: the exported drafter served by vLLM, its acceptance beside the evaluator's."""

from eagle3_pipeline.stages import engine_check

engine_check.run_from_snakemake(globals()["snakemake"])
