"""Rule `ingest`: read raw conversations, normalise, report drops, split into shards + eval."""

import json
from pathlib import Path

from eagle3_pipeline import conversations, logs
from eagle3_pipeline.formats import conversation_shards

snakemake = globals()["snakemake"]
log = logs.setup(snakemake.log[0])
data = snakemake.params.data
kept, report = conversations.ingest([Path(p) for p in snakemake.input])
for line in report.summary_lines():
    log.info(line)
conversations.check_systemic(report)
weights = None
if data.get("weights"):  # by source file name: normalized conversations record the file they came from
    weights = {Path(p).name: w for p, w in zip(snakemake.input, data["weights"], strict=True)}
shards, held_out = conversations.split(kept, data["num_shards"], data["eval_conversations"],
                                       data.get("train_conversations"), data["seed"], weights)
for shard, path in zip(shards, snakemake.output.shards, strict=True):
    conversation_shards.write(Path(path), shard)
conversation_shards.write(Path(snakemake.output.eval), held_out)
summary = report.as_dict() | {"train_conversations": sum(map(len, shards)), "eval_conversations": len(held_out),
                              "conversations_per_shard": [len(s) for s in shards]}
Path(snakemake.output.report).write_text(json.dumps(summary, indent=2))
log.info("wrote %d shards (%s conversations) and %d held-out", len(shards),
         summary["conversations_per_shard"], len(held_out))
