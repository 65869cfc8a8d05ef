"""Where a run's files live: `results/<run>/...` and `logs/<run>/...`, in one place for the rules
(rules/common.smk takes every path from here) and for the tools that read a finished run (the report's front
page, `plots --config`). Paths with `{shard}`, `{prompt_set}`, `{group}` or `{index}` are Snakemake patterns;
`.format(shard=...)` names one file."""

from __future__ import annotations


class RunLayout:
    def __init__(self, results_dir: str, run: str):
        self.root = root = f"{results_dir}/{run}"
        self.logs = f"logs/{run}"
        # the target and the data
        self.target_dir = f"{root}/target"
        self.conversation_shard = f"{root}/conversations/shard-{{shard}}.jsonl"
        self.eval_conversations = f"{root}/conversations/eval.jsonl"  # the `held-out` prompt set
        self.selection_conversations = f"{root}/conversations/selection.jsonl"  # the store that picks the epoch
        self.ingest_report = f"{root}/conversations/ingest_report.json"
        self.regenerated_shard = f"{root}/regenerated/shard-{{shard}}.jsonl"
        self.token_shard = f"{root}/tokens/shard-{{shard}}.zarr"
        self.draft_vocab = f"{root}/vocab/draft_vocab.safetensors"
        self.vocab_stats = f"{root}/vocab/data_stats.json"
        # the hidden states (under a disk budget: per window, extracted, trained on and deleted)
        self.hidden_store = f"{root}/hidden/shard-{{shard}}.zarr"
        self.parity_dir = f"{root}/parity"  # <backend>.json
        self.disk_report = f"{root}/reports/disk_plan_vs_actual.json"
        self.windows_dir = f"{root}/hidden_windows"
        self.window_store = f"{root}/hidden_windows/x{{group}}/shard-{{shard}}.zarr"
        self.pass_record = f"{root}/reports/windows/pass-{{index}}.json"  # a pass's stores, the disk at its start
        # training (checkpoints live outside Snakemake's outputs: a killed job resumes) and serving
        self.train_state = f"{root}/train_state"
        self.pass_checkpoint = f"{root}/train_state/passes/pass-{{index}}.pt"  # read by the next pass
        self.drafter_weights = f"{root}/train/drafter.safetensors"
        self.train_summary = f"{root}/train/summary.json"
        self.train_metrics = f"{root}/train/metrics.csv"
        self.config_snapshot = f"{root}/train/config_snapshot.yaml"
        self.serving_dir = f"{root}/serving/drafter"
        # evaluation and the report
        self.evaluation_dir = f"{root}/evaluation"
        self.eval_results = f"{root}/evaluation/{{prompt_set}}.json"
        self.timing_results = f"{root}/timing/timing.json"
        self.report_dir = f"{root}/report"
        self.engine_check_dir = f"{root}/engine_check"  # <engine>.json

    def parity_report(self, backend: str) -> str:
        return f"{self.parity_dir}/{backend}.json"

    def engine_check(self, engine: str) -> str:
        return f"{self.engine_check_dir}/{engine}.json"

    @classmethod
    def of(cls, config: dict) -> RunLayout:
        """The layout of a validated config's run."""
        return cls(config["results_dir"], config["run"])
