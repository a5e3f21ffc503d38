"""The memory and placement planner: will a job fit, where does each role go, how long does a weight sync take.

`megarl plan --config FILE` prints `run_plan(config).render()`; `megarl train` calls `run_plan` as its pre-flight
memory check. Nothing here starts a process or reads weights.
"""

from megarl.plan.planner import run_plan
from megarl.plan.report import PlanReport, RoleReport

__all__ = ["PlanReport", "RoleReport", "run_plan"]
