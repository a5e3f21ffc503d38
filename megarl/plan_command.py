"""`megarl plan`: train's pre-flight checks, then the plan (megarl/plan/planner.py), printed.

Separate from the planner because it runs train's pre-flight (megarl/trainer/lifecycle/preflight.py), which itself
asks the planner whether a GPU job fits: the planner imports neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from megarl.errors import UserError
from megarl.job import JobConfig
from megarl.plan.planner import run_plan


def plan_command(path: str | Path, overrides: Sequence[str] = (), as_json: bool = False) -> int:
    """`megarl plan --config FILE [--json] [overrides]`: print the plan (`as_json`: as one JSON object on stdout,
    PlanReport.as_dict); 0 when everything fits and `megarl train` would start, 1 when something does not fit.
    Train's pre-flight checks run first (the same function as train and --dry-run), so a config train refuses
    raises its UserError here too (the CLI prints it and exits 2)."""
    from megarl.trainer.lifecycle.preflight import preflight, would_start

    config, notes = load_for_planning(path, overrides)
    preflight(config, check_memory=False, off_machine=True)
    report = run_plan(config, str(path))
    report.notes += notes
    if as_json:
        import json

        print(json.dumps(report.as_dict(), indent=1))
    else:
        print(report.render())
    return 0 if would_start(config, report) else 1


def load_for_planning(path: str | Path, overrides: Sequence[str] = ()) -> tuple[JobConfig, list[str]]:
    """The job config, also where its data files exist only on the cluster (planning needs no data).

    The data sections check that their files exist when the config is built; a plan made on a laptop must not
    depend on that. Until the loader can skip that check, a missing-file error is answered by loading again with
    the data-file check turned off, and a note says so.
    """
    from unittest import mock

    from megarl.config.loader import load_config

    try:
        return load_config(JobConfig, path, overrides), []
    except UserError as error:
        if "_files[" not in str(error) or "does not exist" not in str(error):
            raise
        missing = str(error)
    with mock.patch("megarl.data.config.check_data_files", lambda files, key: None):
        config = load_config(JobConfig, path, overrides)
    return config, [f"data files not on this machine, not needed to plan ({missing.split(': ', 1)[-1]})"]
