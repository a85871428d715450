"""Predicts: the cost model composing layer costs and communication into iteration time and memory."""

from predictor.cost_model import CostContext, Evaluation, build_context, evaluate

__all__ = ["CostContext", "Evaluation", "build_context", "evaluate"]
