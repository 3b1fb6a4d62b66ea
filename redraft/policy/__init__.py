"""Cost-aware speculation policy (in progress): the measured verify cost curve."""

from redraft.policy.costcurve import CostCurve

__all__ = ["CostCurve"]
