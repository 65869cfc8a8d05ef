"""Rule `plots`: the report's figures, table and provenance."""

import json
from pathlib import Path

from eagle3_pipeline import logs
from eagle3_pipeline.formats import evaluation, metrics
from eagle3_pipeline.stages import plots

snakemake = globals()["snakemake"]
log = logs.setup(snakemake.log[0])
evaluations = evaluation.read_evaluations(snakemake.input.evaluations)
plots.acceptance_figure(evaluations, Path(snakemake.output.acceptance))
evaluation.write_tau_table(Path(snakemake.output.tau), evaluations, evaluation.read_results(snakemake.input.timing))
plots.training_figure(Path(snakemake.input.metrics), Path(snakemake.output.training),
                      metrics.read_summary(snakemake.input.summary))
plots.disk_figure(json.loads(Path(snakemake.input.disk).read_text()), Path(snakemake.output.disk))
Path(snakemake.output.provenance).write_text(
    json.dumps(plots.provenance(dict(snakemake.params.full_config), Path(snakemake.input.config),
                                Path(snakemake.input.target)), indent=2))
log.info("wrote %s", ", ".join(snakemake.output))
