"""Rule `tokenize`: one conversation shard -> one token shard (chat template + assistant loss mask)."""

from pathlib import Path

from eagle3_pipeline import logs
from eagle3_pipeline.formats import conversation_shards
from eagle3_pipeline.runtime.loading import load_tokenizer
from eagle3_pipeline.stages import data as data_stage

snakemake = globals()["snakemake"]
log = logs.setup(snakemake.log[0])
data = snakemake.params.data
data_stage.tokenize_shard(
    conversation_shards.read(Path(snakemake.input.conversations)),
    tokenizer=load_tokenizer(Path(snakemake.input.target), snakemake.params.trust_remote_code),
    target_dir=Path(snakemake.input.target),
    output=Path(snakemake.output[0]),
    max_seq_len=data["max_seq_len"],
    overlength=data["overlength"],
    end_of_turn=data.get("end_of_turn"),
    source_name=snakemake.input.conversations,
    log=log,
)
