# Paths, shard lists and parse-time checks shared by every stage.
from eagle3_pipeline import workflow_config

SETTINGS = workflow_config.check(config)

RESULTS = f"{config['results_dir']}/{config['run']}"
LOGS = f"logs/{config['run']}"
SHARDS = [f"{i:05d}" for i in range(config["data"]["num_shards"])]

TARGET_DIR = f"{RESULTS}/target"
CONVERSATION_SHARD = f"{RESULTS}/conversations/shard-{{shard}}.jsonl"
EVAL_CONVERSATIONS = f"{RESULTS}/conversations/eval.jsonl"
INGEST_REPORT = f"{RESULTS}/conversations/ingest_report.json"
TOKEN_SHARD = f"{RESULTS}/tokens/shard-{{shard}}.zarr"
DRAFT_VOCAB = f"{RESULTS}/vocab/draft_vocab.safetensors"
VOCAB_STATS = f"{RESULTS}/vocab/data_stats.json"


wildcard_constraints:
    shard=r"\d{5}",
