"""Searches the three-level tree for the fastest plan that fits memory; Plan schema; exports."""

from planner.plan import PLAN_SCHEMA, Plan, load_plan
from planner.planning import build_context, compute_bounds, plan, predict

__all__ = ["PLAN_SCHEMA", "Plan", "build_context", "compute_bounds", "load_plan", "plan", "predict"]
