# Paths, shard lists, parse-time checks and the disk plan shared by every stage.
from functools import cache

from eagle3_pipeline import plan as disk_plan
from eagle3_pipeline import workflow_config


def is_dry_run():
    # workflow.dryrun is still False while the Snakefile is parsed; output_settings knows (internal API).
    settings = getattr(workflow, "output_settings", None)
    return bool(getattr(settings, "dryrun", False))


RESULTS = f"{config['results_dir']}/{config['run']}"
LOGS = f"logs/{config['run']}"
SHARDS = [f"{i:05d}" for i in range(config["data"]["num_shards"])]

TARGET_DIR = f"{RESULTS}/target"
CONVERSATION_SHARD = f"{RESULTS}/conversations/shard-{{shard}}.jsonl"
EVAL_CONVERSATIONS = f"{RESULTS}/conversations/eval.jsonl"
INGEST_REPORT = f"{RESULTS}/conversations/ingest_report.json"
REGENERATED_SHARD = f"{RESULTS}/regenerated/shard-{{shard}}.jsonl"
# What tokenize reads: the target's own replies when regeneration is on, the ingested ones otherwise.
TRAINING_CONVERSATIONS = REGENERATED_SHARD if config["regenerate"]["enabled"] else CONVERSATION_SHARD
TOKEN_SHARD = f"{RESULTS}/tokens/shard-{{shard}}.zarr"
DRAFT_VOCAB = f"{RESULTS}/vocab/draft_vocab.safetensors"
VOCAB_STATS = f"{RESULTS}/vocab/data_stats.json"
HIDDEN_STORE = f"{RESULTS}/hidden/shard-{{shard}}.zarr"
PARITY_REPORT = f"{RESULTS}/parity/{config['extract']['backend']}.json"
DISK_REPORT = f"{RESULTS}/reports/disk_plan_vs_actual.json"
TRAIN_STATE = f"{RESULTS}/train_state"  # checkpoints live outside Snakemake's outputs: a killed job resumes
DRAFTER_WEIGHTS = f"{RESULTS}/train/drafter.safetensors"
TRAIN_SUMMARY = f"{RESULTS}/train/summary.json"
TRAIN_METRICS = f"{RESULTS}/train/metrics.csv"
CONFIG_SNAPSHOT = f"{RESULTS}/train/config_snapshot.yaml"
SERVING_DIR = f"{RESULTS}/serving/drafter"
EVAL_RESULTS = f"{RESULTS}/evaluation/{{prompt_set}}.json"
PLOTS = f"{RESULTS}/report"

try:
    SETTINGS = workflow_config.check(config, dry_run=is_dry_run(),
                                     target_materialised=Path(TARGET_DIR, "identity.json").is_file())
except workflow_config.ConfigError as exc:
    sys.exit(f"Config error: {exc}")  # one line, no traceback
for warning in SETTINGS.warnings:
    print(f"WARNING: {warning}", file=sys.stderr)


def prompt_set_name(entry):
    return entry if entry in ("held-out", "mtbench-package") else Path(entry).stem


def prompt_file(wildcards):
    for entry in config["evaluate"]["prompts"]:
        if prompt_set_name(entry) == wildcards.prompt_set:
            return EVAL_CONVERSATIONS if entry == "held-out" else workflow_config.resolve_input("evaluate.prompts", entry)
    raise ValueError(f"unknown prompt set {wildcards.prompt_set}")


PROMPT_SETS = [prompt_set_name(entry) for entry in config["evaluate"]["prompts"]]


wildcard_constraints:
    shard=r"\d{5}",


@cache
def current_plan():
    shape = disk_plan.target_shape(TARGET_DIR, SETTINGS.target_source)
    return disk_plan.build(
        SHARDS,
        {"token_shard": TOKEN_SHARD, "conversation_shard": CONVERSATION_SHARD, "hidden_store": HIDDEN_STORE},
        [Path(p) for p in SETTINGS.data_inputs],
        config["data"],
        shape[0] if shape else config["plan"].get("target_hidden_size"),
        config["plan"]["expected_compression"],
        Path(config["results_dir"]),
    )


def hidden_store_mb(wildcards):
    hidden = [stage for stage in current_plan().stages if stage.stage == "hidden"]
    return max(1, hidden[0].shard_bytes(wildcards.shard) // 1_000_000) if hidden else 1


if is_dry_run():
    print("\n".join(current_plan().lines()), file=sys.stderr)


onstart:
    plan_now = current_plan()
    print("\n".join(plan_now.lines()), file=sys.stderr)
    if not plan_now.fits and not config["plan"]["allow_exceeding_free_space"]:
        raise SystemExit(
            "Refusing to start: the disk plan exceeds free space. Free space, lower data.train_conversations "
            "or data.max_seq_len, or set plan.allow_exceeding_free_space: true."
        )
