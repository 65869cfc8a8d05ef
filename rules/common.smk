# Paths, shard lists, parse-time checks and the disk plan shared by every stage.
from functools import cache

from eagle3_pipeline import assets
from eagle3_pipeline import plan as disk_plan
from eagle3_pipeline import plan_fixed, plan_tokens, target_shape
from eagle3_pipeline.plan_tokenizer import TokenizerSource
from eagle3_pipeline import copying, workflow_config
from eagle3_pipeline.formats.target_dir import is_materialised
from eagle3_pipeline.layout import RunLayout
from eagle3_pipeline.runtime.generation import Settings as RegenerateSettings
from eagle3_pipeline.stages.regenerate import regenerate_settings
from eagle3_pipeline.training.settings import TrainSettings


def is_dry_run():
    # workflow.dryrun is still False while the Snakefile is parsed; output_settings knows (internal API).
    settings = getattr(workflow, "output_settings", None)
    return bool(getattr(settings, "dryrun", False))


LAYOUT = RunLayout.of(config)  # every path of the run, in one place: src/eagle3_pipeline/layout.py
RESULTS, LOGS = LAYOUT.root, LAYOUT.logs
SHARDS = [f"{i:05d}" for i in range(config["data"]["num_shards"])]
HELDOUT = "heldout"  # the selection conversations as one more token shard and hidden store (offline estimate)

TARGET_DIR = LAYOUT.target_dir
CONVERSATION_SHARD = LAYOUT.conversation_shard
EVAL_CONVERSATIONS = LAYOUT.eval_conversations  # the `held-out` prompt set
SELECTION_CONVERSATIONS = LAYOUT.selection_conversations  # the held-out store: the estimate that picks the epoch
INGEST_REPORT = LAYOUT.ingest_report
REGENERATED_SHARD = LAYOUT.regenerated_shard
# What tokenize reads: the target's own replies when regeneration is on, the ingested ones otherwise.
TRAINING_CONVERSATIONS = REGENERATED_SHARD if config["regenerate"]["enabled"] else CONVERSATION_SHARD
TOKEN_SHARD = LAYOUT.token_shard
DRAFT_VOCAB = LAYOUT.draft_vocab
VOCAB_STATS = LAYOUT.vocab_stats
HIDDEN_STORE = LAYOUT.hidden_store
PARITY_REPORT = LAYOUT.parity_report(config["extract"]["backend"])
DISK_REPORT = LAYOUT.disk_report
TRAIN_STATE = LAYOUT.train_state
DRAFTER_WEIGHTS = LAYOUT.drafter_weights
TRAIN_SUMMARY = LAYOUT.train_summary
TRAIN_METRICS = LAYOUT.train_metrics
CONFIG_SNAPSHOT = LAYOUT.config_snapshot
SERVING_DIR = LAYOUT.serving_dir
EVAL_RESULTS = LAYOUT.eval_results
PLOTS = LAYOUT.report_dir

try:
    SETTINGS = workflow_config.check(config, dry_run=is_dry_run(),
                                     target_materialised=is_materialised(TARGET_DIR))
    workflow_config.check_target_family(Path(TARGET_DIR), config["target"], SETTINGS.target_source)
except workflow_config.ConfigError as exc:
    sys.exit(f"Config error: {exc}")  # one line, no traceback
for warning in SETTINGS.warnings:
    print(f"WARNING: {warning}", file=sys.stderr)
DATA_PARAMS = copying.rule_params(config["data"])  # the data rules' params: the copying keys only when in use


# a section's keys besides `threads` that size a job or its logs but not its output (the job reads them from the config);
# extract's are named here, not on its stage's Settings: that module loads torch, which planning must not
SIZE_ONLY = {"extract": {"writer_threads"}, "train": TrainSettings.SIZE_ONLY}
# settings added since runs were made, at the value that works as before: left out of the params at that value
NEUTRAL = {"train": TrainSettings.NEUTRAL, "regenerate": RegenerateSettings.NEUTRAL}


def job_settings(section, overrides=None):
    """A config section (with `overrides`) as a rule's params, less `threads` and its SIZE_ONLY keys: changing a
    job's size must not rerun it (hours of extraction or training), which Snakemake's params trigger would; nor must
    a setting added since a run was made, at the value that works as before (NEUTRAL). Params are that trigger:
    the jobs read the whole section from the config (regenerate: from these params, its NEUTRAL filled in)."""
    neutral = NEUTRAL.get(section, {})
    return {key: value for key, value in (config[section] | (overrides or {})).items()
            if key != "threads" and key not in SIZE_ONLY.get(section, ())
            and not (key in neutral and neutral[key] == value)}


def tokenize_input(wildcards):
    """The regenerated shard when regeneration is on, except the selection conversations of a mixture
    (regenerate.keep_original): the estimate then scores the data's text, as in runs without regeneration."""
    regenerated = config["regenerate"]["enabled"] and not (
        wildcards.shard == HELDOUT and config["regenerate"]["keep_original"])
    return TRAINING_CONVERSATIONS.format(shard=wildcards.shard) if regenerated else regenerate_input(wildcards)


def regenerate_input(wildcards):
    """A shard's ingested conversations; the held-out store's are the selection conversations, regenerated like the
    training shards when regeneration is on (the estimate then scores the target's own text, as decoding does)."""
    if wildcards.shard == HELDOUT:
        return SELECTION_CONVERSATIONS
    return CONVERSATION_SHARD.format(shard=wildcards.shard)


def regenerate_params(wildcards):
    """The regenerate section as the job's params. The selection conversations get one greedy reply per turn, kept
    whatever its repetition: the estimate's chain is then fed the target's own greedy tokens, as decoding is."""
    selection = {"samples": 1, "temperature": 0.0, "turns": None,
                 "repetition": {**config["regenerate"]["repetition"], "drop": False}}
    return job_settings("regenerate", selection if wildcards.shard == HELDOUT else None)


def heldout_stores(wildcards):
    wanted = config["train"]["heldout_estimate"] and config["data"]["selection_conversations"] > 0
    return [HIDDEN_STORE.format(shard=HELDOUT)] if wanted else []


def prompt_set_name(entry):
    return entry if entry == "held-out" or assets.is_alias(entry) else Path(entry).stem


def prompt_file(wildcards):
    for entry in config["evaluate"]["prompts"]:
        if prompt_set_name(entry) == wildcards.prompt_set:
            return EVAL_CONVERSATIONS if entry == "held-out" else workflow_config.resolve_input("evaluate.prompts", entry)
    raise ValueError(f"unknown prompt set {wildcards.prompt_set}")


PROMPT_SETS = [prompt_set_name(entry) for entry in config["evaluate"]["prompts"]]


wildcard_constraints:
    shard=rf"\d{{5}}|{HELDOUT}",


def token_sampler():
    # The sampled estimate is made only in the main process (and cached under .snakemake/): a cluster job
    # that parses this file reads the cached one or falls back to characters, it never tokenizes.
    target = config["target"]
    return plan_tokens.TokenEstimator(
        SHARDS,
        [[Path(TRAINING_CONVERSATIONS.format(shard=s)), Path(CONVERSATION_SHARD.format(shard=s))] for s in SHARDS],
        [Path(p) for p in SETTINGS.data_inputs],
        config["data"],
        TokenizerSource(Path(TARGET_DIR), SETTINGS.target_source, target["gguf_file"], target["revision"],
                        target["trust_remote_code"], target["chat_template"]),
        Path(".snakemake") / "eagle3_pipeline",
        may_compute=workflow.is_main_process,
        regeneration=regeneration_shape() if config["regenerate"]["enabled"] else None,
    )


def regeneration_shape():
    """What the regenerate stage makes of each conversation, for the disk plan before it has run."""
    settings = regenerate_settings(config["regenerate"], config["data"]["max_seq_len"])
    return plan_tokens.Regeneration(settings.samples, settings.keep_original, settings.turns,
                                    settings.max_new_tokens, settings.max_context_tokens, settings.thinking)


@cache
def current_plan():
    target = config["target"]
    where = (SETTINGS.target_source, target["gguf_file"], target["revision"])
    dims = target_shape.target_dims(TARGET_DIR, *where)
    hidden_size, warnings = plan_fixed.planned_hidden_size(dims, config["plan"]["target_hidden_size"],
                                                          target["source"])
    prompt_sets = {prompt_set_name(e): None if e in ("held-out", "mtbench-package") else e
                   for e in config["evaluate"]["prompts"]}
    fixed = [
        plan_fixed.target_copy(TARGET_DIR, *where),
        *plan_fixed.drafter_stages(plan_fixed.with_drafter_width(dims, config["train"]["drafter_intermediate_size"]),
                                  config["vocab"]["draft_vocab_size"], config["export"]["dtype"],
                                  Path(DRAFTER_WEIGHTS), Path(SERVING_DIR), hidden_size),
        plan_fixed.evaluation_stage(prompt_sets,
                                   {name: Path(EVAL_RESULTS.format(prompt_set=name)) for name in prompt_sets},
                                   config["evaluate"], config["data"]),
    ]
    warnings += [f"{item.stage}: size unknown, left out of the total" for item in fixed if item.total_bytes is None]
    return disk_plan.build(
        SHARDS,
        {"token_shard": TOKEN_SHARD, "conversation_shard": CONVERSATION_SHARD, "hidden_store": HIDDEN_STORE},
        [Path(p) for p in SETTINGS.data_inputs],
        config["data"],
        hidden_size,
        config["plan"]["expected_compression"],
        Path(config["results_dir"]),
        fixed,
        warnings,
        config["extract"]["store_dtype"],
        sampler=token_sampler(),
    )


def rules_to_run():
    # The DAG exists when onstart runs (internal API): the preflight counts only the stages this run executes.
    # --omit-from deletes the jobs it omits; --until keeps them in the DAG and runs only the named jobs and theirs.
    try:
        dag = workflow.dag
        jobs = set(dag.needrun_jobs())
        if dag.untilrules or dag.untilfiles:
            jobs &= set(dag.bfs(dag.dependencies, *dag.until_jobs()))
        return {job.rule.name for job in jobs}
    except AttributeError:
        return None


def hidden_store_mb(wildcards):
    hidden = current_plan().hidden
    if hidden is None or wildcards.shard == HELDOUT:  # the held-out store is small and not planned per shard
        return 1
    return max(1, hidden.shard_bytes(wildcards.shard) // 1_000_000)


# `snakemake -n` prints the disk plan from rules/windows.smk, once the disk budget's window plan is known.


onstart:
    plan_now = current_plan()
    rules_now = rules_to_run()
    print("\n".join([*plan_now.lines(rules_now), *window_plan_lines()]), file=sys.stderr)
    if plan_now.blind_for(rules_now):
        raise SystemExit(
            "Refusing to start: extraction would write hidden states of unknown size (the target is not local). "
            f"Set plan.target_hidden_size, or materialise the target first: snakemake {TARGET_DIR}"
        )
    if not plan_now.fits_for(rules_now) and not config["plan"]["allow_exceeding_free_space"]:
        raise SystemExit(plan_now.refusal(rules_now, DRAFT_VOCAB))
