import json

from relax.core.hookspecs import hookimpl


@hookimpl
def relax_on_run_end(run, status):
    summary = {"status": status, "step": run.step, "engines": run.engine_health()}
    (run.run_dir / "hello_summary.json").write_text(json.dumps(summary))
