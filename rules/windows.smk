# A disk budget (plan.disk_budget_gb): when the hidden-state stores exceed it, training goes through rolling
# windows of shards (src/eagle3_pipeline/plan_windows.py). Each extraction group's stores are temp(): Snakemake
# deletes them after the group's last pass, and a window is extracted only after the pass before it finished.
from eagle3_pipeline import plan_windows

WINDOW_STORE = LAYOUT.window_store
WINDOWS_DIR = LAYOUT.windows_dir
PASS_CHECKPOINT = LAYOUT.pass_checkpoint  # consumed by the next pass: at most two exist
PASS_RECORD = LAYOUT.pass_record  # its stores' sizes, the bytes on disk at its start
EXTRACT_SETTINGS = {key: value for key, value in job_settings("extract").items()
                    if key not in ("store_shard_mb", "gpus")}  # what the stores' values follow


def window_plan():
    """The budget's window plan, or None without a budget; a budget no window fits is a config error."""
    budget = config["plan"]["disk_budget_gb"]
    if budget is None:
        return None
    stage = current_plan().hidden
    if stage is None:
        sys.exit("Config error: plan.disk_budget_gb needs the hidden stores' size: set plan.target_hidden_size, "
                 f"or materialise the target first: snakemake {TARGET_DIR}")
    heldout_tokens, heldout_exact = plan_windows.heldout_tokens(
        Path(TOKEN_SHARD.format(shard=HELDOUT)), Path(SELECTION_CONVERSATIONS),
        config["data"]["selection_conversations"], config["data"]["max_seq_len"])
    heldout_bytes = int(heldout_tokens * stage.expected_bytes_per_token) if heldout_stores(None) else 0
    try:
        return plan_windows.plan({shard: stage.shard_bytes(shard) for shard in SHARDS}, heldout_bytes, budget,
                                 config["train"]["epochs"], config["train"]["seed"],
                                 exact=stage.source == "exact" and heldout_exact)
    except plan_windows.WindowError as exc:
        sys.exit(f"Config error: {exc}")


WINDOW_PLAN = window_plan()
WINDOWED = WINDOW_PLAN is not None and WINDOW_PLAN.windowed
if WINDOWED:
    if config["train"]["gpus"] > 1:
        sys.exit("Config error: plan.disk_budget_gb: training in windows runs on one GPU (train.gpus: 1 or 0)")
    current_plan().hidden_peak = WINDOW_PLAN.peak_bytes  # the preflight counts the peak, not every store


def window_plan_lines():
    if WINDOW_PLAN is None:
        return []
    if not WINDOWED:
        return [f"Window plan: none needed, the hidden stores and the held-out store fit plan.disk_budget_gb "
                f"{config['plan']['disk_budget_gb']:g}"]
    return WINDOW_PLAN.lines()


if is_dry_run():
    print("\n".join([*current_plan().lines(), *window_plan_lines()]), file=sys.stderr)


def pass_name(index):
    return f"{index:03d}"


def training_inputs(wildcards):
    """What rule `train` trains from: every store, or under a budget the last pass's checkpoint."""
    if WINDOWED:
        return {"last_pass": PASS_CHECKPOINT.format(index=pass_name(len(WINDOW_PLAN.passes) - 1))}
    return {"stores": expand(HIDDEN_STORE, shard=SHARDS)}


def disk_report_inputs(wildcards):
    if WINDOWED:
        return {"passes": expand(PASS_RECORD, index=[pass_name(i) for i in range(len(WINDOW_PLAN.passes))])}
    return {"stores": expand(HIDDEN_STORE, shard=SHARDS)}


def extraction_after(wildcards):
    """An ordering edge: a group's stores are extracted once the pass before the group's first pass is done, so
    the group before it has been consumed (and deleted) and two windows never sit on disk at once."""
    first = WINDOW_PLAN.groups[int(wildcards.group)].passes[0]
    return {"after": PASS_CHECKPOINT.format(index=pass_name(first - 1))} if first else {}


def pass_inputs(wildcards):
    index = int(wildcards.index)
    group = WINDOW_PLAN.group_of_pass(index)
    stores = [WINDOW_STORE.format(group=group.index, shard=shard) for shard in WINDOW_PLAN.windows[group.window]]
    previous = {"previous": PASS_CHECKPOINT.format(index=pass_name(index - 1))} if index else {}
    return {"stores": stores, **previous}


if WINDOWED:

    wildcard_constraints:
        group=r"\d+",
        index=r"\d\d\d+",

    rule extract_window:
        input:
            unpack(lambda wildcards: {"parity": PARITY_REPORT} if config["parity"]["enabled"] else {}),
            unpack(extraction_after),
            tokens=TOKEN_SHARD,
            target=TARGET_DIR,
        output:
            temp(directory(WINDOW_STORE)),
        params:
            extract=job_settings("extract"),
            trust_remote_code=config["target"]["trust_remote_code"],
        threads: config["extract"]["threads"]
        resources:
            gpu=config["extract"]["gpus"],
            disk_mb=lambda wildcards: plan_windows.disk_mb(WINDOW_PLAN.shard_bytes[wildcards.shard]),
            mem_mb=8000,
        conda:
            "../envs/pipeline.yaml"
        log:
            f"{LOGS}/extract_window/x{{group}}/shard-{{shard}}.log",
        script:
            "../scripts/extract.py"

    rule train_pass:
        input:
            unpack(pass_inputs),
            heldout=heldout_stores,
            tokens=expand(TOKEN_SHARD, shard=SHARDS),
            vocab=DRAFT_VOCAB,
            target=TARGET_DIR,
        output:
            checkpoint=temp(PASS_CHECKPOINT),
            record=PASS_RECORD,
        params:
            settings=job_settings("train"),
            state_dir=TRAIN_STATE,
            windows=WINDOW_PLAN.as_dict(),
            window_store=lambda wildcards: WINDOW_STORE,  # a template: its wildcards are not this job's
            windows_dir=WINDOWS_DIR,
            shards=SHARDS,
            extract=EXTRACT_SETTINGS,
        threads: config["train"]["threads"]
        resources:
            gpu=config["train"]["gpus"],
            mem_mb=16000,
        conda:
            "../envs/pipeline.yaml"
        log:
            f"{LOGS}/train_passes/pass-{{index}}.log",
        script:
            "../scripts/train_pass.py"
