"""The price of a forward, in one place: measuring it, fitting and caching the curve, and pricing drafts on it.

- :mod:`~redraft.pricing.curve`: c(n), a verify forward with n draft tokens in plain 1-token steps (:class:`CostCurve`);
- :mod:`~redraft.pricing.measure`: timing forwards on a target (duck-typed: forward, crop, reset) into ratios;
- :mod:`~redraft.pricing.fit`: the curve from noisy ratios (and a batched runtime's step as a robust line);
- :mod:`~redraft.pricing.cache`: the measured curve on disk per model, dtype, threads and machine, and curve files;
- :mod:`~redraft.pricing.draft`: a draft's price on a cost table (marginal, with a draft model's own cost, a probe's);
- :mod:`~redraft.pricing.load`: a draft's price in a step other requests share (c_B, its tables);
- :mod:`~redraft.pricing.stepcost`: a packed step's rows (matrix products plus attention), for sizing prefill chunks.

It sits below the policy (which takes a curve, never a model) and the decode step (which measures through it):
numpy at import, torch only inside the measuring functions; it imports nothing of redraft above the file helpers.
"""

from redraft.pricing.curve import CostCurve

__all__ = ["CostCurve"]
