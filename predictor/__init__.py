"""Predicts: the cost model composing layer costs and communication into iteration time and memory."""

from predictor.cost_model import CostContext, Evaluation, build_context, check_strategy, evaluate
from predictor.strategy import PipelineStrategy, StageStrategy, Strategy

__all__ = [
    "CostContext",
    "Evaluation",
    "PipelineStrategy",
    "StageStrategy",
    "Strategy",
    "build_context",
    "check_strategy",
    "evaluate",
]
