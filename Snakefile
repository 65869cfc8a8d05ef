# EAGLE-3 drafter pipeline. Run `snakemake -n` first: it prints the disk plan and the job table.
import os
import re
import sys
from pathlib import Path

from snakemake.utils import min_version, validate

min_version("9.0")

report: "report/workflow.rst"

# The library lives in src/; make it importable here and in every job (scripts inherit the environment).
SRC = str(Path(workflow.basedir) / "src")
sys.path.insert(0, SRC)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))


# config/config.yaml is the embedded default (the 2-core demo). A run given --configfile starts from the schema's
# defaults instead, so a demo-sized setting never slips into it; to build on the demo, name it first.
if not workflow.overwrite_configfiles:
    configfile: str(Path(workflow.basedir) / "config" / "config.yaml")


from eagle3_pipeline import config_schema, workflow_config

try:  # a few lines naming the key, instead of the whole schema and config
    config_schema.check_schema(config, Path(workflow.basedir) / "config" / "schema.yaml")
except config_schema.ConfigError as exc:
    hint = ("\nA --configfile run starts from the schema's defaults, not from the demo: name run, target.source and "
            "data.inputs (config/examples/), or give config/config.yaml first to build on the demo."
            if workflow.overwrite_configfiles and re.search(r"config key (\(top level\)|target|data): '(run|target|"
                                                            r"data|source|inputs)' is a required property", str(exc))
            else "")
    sys.exit(f"Config error: {exc}{hint}")
validate(config, "config/schema.yaml")  # passes now; fills in the schema's defaults


include: "rules/common.smk"
include: "rules/target.smk"
include: "rules/data.smk"
include: "rules/regenerate.smk"
include: "rules/windows.smk"
include: "rules/extract.smk"
include: "rules/train.smk"
include: "rules/evaluate.smk"
include: "rules/engine_check.smk"


rule all:
    input:
        DRAFT_VOCAB,
        DISK_REPORT,
        SERVING_DIR,
        expand(EVAL_RESULTS, prompt_set=PROMPT_SETS),
        f"{PLOTS}/acceptance_by_position.png",
        [ENGINE_CHECK] if config["engine_check"]["enabled"] else [],
