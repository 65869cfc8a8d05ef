"""Rule `vocab`: count assistant tokens over all token shards and pick the draft vocabulary."""

import json
from pathlib import Path

from eagle3_pipeline import logs
from eagle3_pipeline.stages import data as data_stage

snakemake = globals()["snakemake"]
log = logs.setup(snakemake.log[0])
stats = data_stage.build_vocab([Path(p) for p in snakemake.input.shards], Path(snakemake.input.target),
                        snakemake.params.draft_vocab_size, Path(snakemake.output.vocab), log)
stats["ingest"] = json.loads(Path(snakemake.input.ingest_report).read_text())
Path(snakemake.output.stats).write_text(json.dumps(stats, indent=2))
